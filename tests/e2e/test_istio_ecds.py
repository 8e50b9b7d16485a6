"""The Istio install, in the real Envoy, with the filter delivered the way
Istio delivers it: through extension config discovery (ECDS).

istio/equivalent.py turns the shipped manifests (istio/<shape>/) into one
Envoy bootstrap: an Istio-like outbound listener, route and EDS cluster, with
the EnvoyFilter patches applied; the HTTP filter comes from a
`config_discovery` whose source is a file holding the EXTENSION_CONFIG as a
TypedExtensionConfig discovery response, its module rewritten to a local file
as Istio's agent does; the collector and envoy_admin come from the bootstrap
override ConfigMap. The plugin JSON is the manifests' own, unchanged (no state
path, no decision header), so what is asserted is what the emulator says: who
served each request.

Needs PyYAML (scripts/istio-check.sh installs it).
"""

import os
import subprocess
import sys

import pytest

from conftest import REPO, Process, completion, free_ports, request, text, wait_until

yaml = pytest.importorskip("yaml", reason="PyYAML is needed to read istio/ (pip install pyyaml)")
sys.path.insert(0, os.path.join(REPO, "istio"))
import equivalent  # noqa: E402


def _start_envoy(tmp_path, cfg, name):
    args = ["envoy", "-c", cfg["config"], "--concurrency", "2", "--use-dynamic-base-id",
            "--log-level", os.environ.get("KVROUTE_E2E_ENVOY_LOG", "warning")]
    return Process(name, args, str(tmp_path / f"{name}.log"))


@pytest.fixture
def istio_envoy(artifacts, tmp_path):
    started = []

    def start(shape, endpoints):
        port, admin = free_ports(2)
        cfg = equivalent.build(shape, str(tmp_path / shape), artifacts["wasm"], endpoints, port, admin)
        proc = _start_envoy(tmp_path, cfg, f"envoy-{shape}")
        started.append(proc)

        def live():
            if not proc.alive():
                raise AssertionError(f"Envoy exited; log:\n{proc.log_text()}")
            try:
                r = request(admin, "GET", "/ready", timeout=2)
                return r.status == 200 and r.body.strip() == b"LIVE"
            except OSError:
                return False

        wait_until(live, timeout=30, what="Envoy /ready == LIVE")
        cfg.update(port=port, admin=admin, process=proc)
        return cfg

    yield start
    for proc in reversed(started):
        proc.stop()


def _stats(admin, needle):
    r = request(admin, "GET", f"/stats?filter={needle}", timeout=5)
    assert r.status == 200, r
    out = {}
    for line in r.body.decode().splitlines():
        k, _, v = line.partition(": ")
        out[k] = v.strip()
    return out


@pytest.mark.parametrize("shape", ["sidecar", "gateway"])
def test_ecds_filter_routes_and_sticks(fleet, istio_envoy, shape):
    f = fleet(3)
    e = istio_envoy(shape, f.addresses)

    # The filter came over ECDS: Envoy counts the config it accepted.
    ecds = _stats(e["admin"], "extension_config_discovery")
    ok = {k: v for k, v in ecds.items() if k.endswith("kvroute.config_reload") and v.isdigit()}
    assert ok and all(int(v) >= 1 for v in ok.values()), ecds
    fails = {k: v for k, v in ecds.items() if k.endswith("kvroute.config_fail") and v != "0"}
    assert not fails, ecds

    # Discovery through envoy_admin (the bootstrap override) must have found
    # the members before routing can stick; until then the filter fails open.
    prefix = text(1000 + len(shape), 6000)

    def sticky_run():
        served = [completion(e["port"], prefix + f" q{i}", timeout=10).served_by for i in range(6)]
        return served if len(set(served)) == 1 and served[0] in f.addresses else None

    served = wait_until(sticky_run, timeout=30, interval=0.5, what="a shared prefix sticking to one endpoint")

    # Round robin alone would have spread 12 requests over all 3 members.
    more = [completion(e["port"], prefix + f" again {i}", timeout=10) for i in range(12)]
    assert all(r.status == 200 for r in more), more
    assert {r.served_by for r in more} == {served[0]}, [r.served_by for r in more]

    # A client-supplied destination header is stripped: the filter decides.
    others = [a for a in f.addresses if a != served[0]]
    r = completion(e["port"], prefix + " forced", headers={"x-gateway-destination-endpoint": others[0]})
    assert r.status == 200 and r.served_by == served[0], r

    # No VM died, Envoy is alive.
    reloads = {k: v for k, v in _stats(e["admin"], "wasm").items() if "vm_reload" in k and v not in ("0", "")}
    assert not reloads, reloads
    assert e["process"].alive()


def test_filter_is_off_for_other_services(fleet, istio_envoy):
    """The filter is disabled on the listener and enabled only on the route
    kvroute-models: another service behind the same listener is not routed by
    kvroute (its plain cluster spreads a shared prefix round robin)."""
    f = fleet(3)
    e = istio_envoy("sidecar", f.addresses)
    prefix = text(77, 6000)
    # Warm the model route first, so the collector has the members.
    wait_until(lambda: len({completion(e["port"], prefix + f" w{i}").served_by for i in range(4)}) == 1,
               timeout=30, interval=0.5, what="model route sticking")
    served = [completion(e["port"], prefix + f" o{i}", headers={"host": e["other_host"]}).served_by for i in range(6)]
    assert len(set(served)) > 1, served


def test_manifest_bootstraps_validate(artifacts, tmp_path):
    """`envoy --mode validate` on both shapes' equivalent bootstraps, and on
    each with the ECDS config inlined (validate mode does not fetch ECDS)."""
    import json

    for shape in ("sidecar", "gateway"):
        cfg = equivalent.build(shape, str(tmp_path / shape), artifacts["wasm"], ["127.0.0.1:1", "127.0.0.1:2"], 1, 2)
        with open(cfg["ecds"]) as fh:
            ec = json.load(fh)["resources"][0]
        with open(cfg["config"]) as fh:
            boot = json.load(fh)
        for filt in boot["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]["http_filters"]:
            if filt["name"] == ec["name"]:
                del filt["config_discovery"]
                filt["typed_config"] = ec["typed_config"]
        inline = str(tmp_path / f"{shape}-inline.json")
        with open(inline, "w") as fh:
            json.dump(boot, fh)
        for path in (cfg["config"], inline):
            p = subprocess.run(["envoy", "--mode", "validate", "-c", path, "--use-dynamic-base-id"],
                               capture_output=True, text=True, timeout=120)
            assert p.returncode == 0 and " OK" in p.stdout + p.stderr, (path, p.stdout[-3000:], p.stderr[-3000:])



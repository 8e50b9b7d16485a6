"""The Istio install, in the real Envoy, with the filter delivered the way
Istio delivers it: through extension config discovery (ECDS).

istio/equivalent.py turns the shipped manifests (istio/<shape>/) into one
Envoy bootstrap: an Istio-like outbound listener, route and EDS cluster, with
the EnvoyFilter patches applied; the HTTP filter comes from a
`config_discovery` whose source is a file holding the EXTENSION_CONFIG as a
TypedExtensionConfig discovery response, its module rewritten to a local file
as Istio's agent does; envoy_admin (a CLUSTER ADD) comes over CDS from a file.
The primary install is the EnvoyFilter alone, in collector.mode lease: no
bootstrap extension at all, the worker VMs elect the collector. The optional
alternative (istio/singleton/) adds the collector singleton from the bootstrap
override ConfigMap.

The routing tests use the manifests' plugin JSON unchanged (no state path, no
decision header), so what is asserted is what the emulator says: who served
each request. The collector tests add only routing.statePath, to read the
metrics table, and count the /metrics requests each emulated server answered
(`metrics_scrapes` in /emulator/stats): one collector polls, not one per worker.

Needs PyYAML (scripts/istio-check.sh installs it).
"""

import json
import os
import subprocess
import sys
import time

import pytest

from conftest import REPO, STATE_PATH, Process, completion, free_ports, request, text, wait_until

yaml = pytest.importorskip("yaml", reason="PyYAML is needed to read istio/ (pip install pyyaml)")
sys.path.insert(0, os.path.join(REPO, "istio"))
import equivalent  # noqa: E402


with open(os.path.join(REPO, "istio", "kvroute-plugin.json")) as _f:
    POLL_MS = json.load(_f)["collector"]["metricsPollIntervalMs"]


def _start_envoy(tmp_path, cfg, name, concurrency):
    args = ["envoy", "-c", cfg["config"], "--concurrency", str(concurrency), "--use-dynamic-base-id",
            "--log-level", os.environ.get("KVROUTE_E2E_ENVOY_LOG", "warning")]
    return Process(name, args, str(tmp_path / f"{name}.log"))


@pytest.fixture
def istio_envoy(artifacts, tmp_path):
    started = []

    def start(shape, endpoints, variant="lease", plugin_patch=None, concurrency=2, edit=None):
        """edit: a test's change to the bootstrap (a dict) before Envoy starts."""
        port, admin = free_ports(2)
        name = f"{variant}-{shape}"
        cfg = equivalent.build(shape, str(tmp_path / name), artifacts["wasm"], endpoints, port, admin, variant, plugin_patch)
        if edit:
            with open(cfg["config"]) as fh:
                boot = json.load(fh)
            edit(boot)
            with open(cfg["config"], "w") as fh:
                json.dump(boot, fh)
        proc = _start_envoy(tmp_path, cfg, f"envoy-{name}", concurrency)
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
    with open(e["config"]) as fh:
        assert not json.load(fh).get("bootstrap_extensions"), "the primary install adds no bootstrap extension"

    # The filter came over ECDS: Envoy counts the config it accepted.
    ecds = _stats(e["admin"], "extension_config_discovery")
    ok = {k: v for k, v in ecds.items() if k.endswith("kvroute.config_reload") and v.isdigit()}
    assert ok and all(int(v) >= 1 for v in ok.values()), ecds
    fails = {k: v for k, v in ecds.items() if k.endswith("kvroute.config_fail") and v != "0"}
    assert not fails, ecds

    # Discovery through envoy_admin (the EnvoyFilter's CLUSTER ADD, over CDS)
    # by the elected worker must have found the members before routing can
    # stick; until then the filter fails open.
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


def _scrapes(f):
    return {a: f.stats(a)["metrics_scrapes"] for a in f.addresses}


@pytest.mark.parametrize("variant,shape", [("lease", "sidecar"), ("lease", "gateway"), ("singleton", "sidecar")])
def test_ecds_collector_polls_once(fleet, istio_envoy, variant, shape):
    """The collector of the install works: metrics reach the shared table,
    and each endpoint is scraped about once per poll interval with 3 workers.
    In lease mode that is the one elected worker (one poller per worker would
    triple it); in the singleton alternative, the bootstrap singleton."""
    f = fleet(2)
    e = istio_envoy(shape, f.addresses, variant, plugin_patch={"routing": {"statePath": STATE_PATH}}, concurrency=3)
    with open(e["config"]) as fh:
        exts = [x["name"] for x in json.load(fh).get("bootstrap_extensions", [])]
    assert exts == ([] if variant == "lease" else ["envoy.bootstrap.wasm"]), exts

    def state():
        r = request(e["port"], "GET", STATE_PATH, timeout=5)
        return r.json() if r.status == 200 else None

    def metrics_for_all():
        s = state()
        return s is not None and {x["address"] for x in s["endpoints"]} == set(f.addresses) and all(
            x.get("metrics") for x in s["endpoints"])

    wait_until(metrics_for_all, timeout=20, interval=0.3, what="metrics for every endpoint in the shared table")
    r = completion(e["port"], text(4242, 4096))
    assert r.status == 200 and r.served_by in f.addresses, r

    before = _scrapes(f)
    seconds = 5
    time.sleep(seconds)
    after = _scrapes(f)
    expected = seconds * 1000 / POLL_MS
    for a in f.addresses:
        n = after[a] - before[a]
        assert expected * 0.6 <= n <= expected * 1.3, f"{a}: {n} scrapes in {seconds} s, expected about {expected} (one poller)"
    # The metrics keep arriving (fresh, not just once).
    assert metrics_for_all(), state()
    failures = {k: v for k, v in _stats(e["admin"], "kvroute_metrics_poll_failures").items() if v not in ("0", "")}
    assert not failures, failures
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


DIRECT_HOST = "direct.vllm.models.svc.cluster.local"


def _add_direct_route(boot):
    """A second route to the model servers' cluster, on the same listener:
    another VirtualService's route to the same Service, where the filter
    stays off (it is enabled on kvroute-models only)."""
    hcm = boot["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    hcm["route_config"]["virtual_hosts"].insert(0, {
        "name": "direct", "domains": [DIRECT_HOST],
        "routes": [{"name": "direct", "match": {"prefix": "/"},
                    "route": {"cluster": equivalent.MODEL_CLUSTER, "timeout": "0s"}}]})


@pytest.mark.parametrize("shape", ["sidecar", "gateway"])
def test_a_client_destination_header_picks_no_server_on_another_route(fleet, istio_envoy, shape):
    """The model servers' cluster honours x-gateway-destination-endpoint on
    any route that reaches it; the shape drops a client's copy on every route
    of the listener (header_mutation before the filter), so on a route where
    kvroute is off the cluster's fallback picks, not the client."""
    f = fleet(2)
    a, b = f.addresses
    e = istio_envoy(shape, f.addresses, edit=_add_direct_route)
    served = [completion(e["port"], text(f"direct-{i}", 512), timeout=10,
                         headers={"host": DIRECT_HOST, "x-gateway-destination-endpoint": b}).served_by
              for i in range(6)]
    assert set(served) == {a, b}, f"the client's header picked the server: {served}"
    # kvroute's own pick, on its route, still reaches the load balancer: a
    # shared prefix sticks (the client's header is ignored there too).
    prefix = text(31337, 6000)
    sticky = wait_until(lambda: len({completion(e["port"], prefix + f" s{i}", timeout=10).served_by
                                     for i in range(4)}) == 1,
                        timeout=30, interval=0.5, what="the model route sticking")
    assert sticky
    assert e["process"].alive()


def test_manifest_bootstraps_validate(artifacts, tmp_path):
    """`envoy --mode validate` on both variants' and shapes' equivalent
    bootstraps, and on each with the ECDS config inlined (validate mode does not fetch ECDS)."""
    for variant, shape in [(v, s) for v in sorted(equivalent.VARIANTS) for s in sorted(equivalent.SHAPES)]:
        cfg = equivalent.build(shape, str(tmp_path / variant / shape), artifacts["wasm"], ["127.0.0.1:1", "127.0.0.1:2"], 1, 2, variant)
        with open(cfg["ecds"]) as fh:
            ec = json.load(fh)["resources"][0]
        with open(cfg["config"]) as fh:
            boot = json.load(fh)
        for filt in boot["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]["http_filters"]:
            if filt["name"] == ec["name"]:
                del filt["config_discovery"]
                filt["typed_config"] = ec["typed_config"]
        inline = str(tmp_path / f"{variant}-{shape}-inline.json")
        with open(inline, "w") as fh:
            json.dump(boot, fh)
        for path in (cfg["config"], inline):
            p = subprocess.run(["envoy", "--mode", "validate", "-c", path, "--use-dynamic-base-id"],
                               capture_output=True, text=True, timeout=120)
            assert p.returncode == 0 and " OK" in p.stdout + p.stderr, (path, p.stdout[-3000:], p.stderr[-3000:])



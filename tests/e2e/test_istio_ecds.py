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

The emulators speak plain HTTP, as model servers without sidecars, so the
equivalent deletes the mTLS of the collector's two clusters there (the
documented step). The STRICT test keeps it: the servers sit behind a second
Envoy standing in for their inbound sidecars, which requires a client
certificate of the test CA (equivalent.inbound_sidecars).

Needs PyYAML (scripts/istio-check.sh installs it) and openssl.
"""

import json
import os
import subprocess
import sys
import time

import pytest

from conftest import REPO, STATE_PATH, Process, completion, free_ports, in_background, request, text, wait_until
from test_kv_events import relay_binary  # noqa: F401

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

    def start(shape, endpoints, variant="lease", plugin_patch=None, concurrency=2, edit=None, mesh_certs=None):
        """edit: a test's change to the bootstrap (a dict) before Envoy starts.
        mesh_certs: equivalent.make_mesh_certs()'s directory, for Istio STRICT."""
        port, admin = free_ports(2)
        name = f"{variant}-{shape}"
        cfg = equivalent.build(shape, str(tmp_path / name), artifacts["wasm"], endpoints, port, admin, variant, plugin_patch,
                               mesh_certs)
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




# --------------------------------------------------------------------------
# Istio STRICT: the collector's own clusters carry the mesh's mTLS


def _pods_behind_strict_sidecars(tmp_path, f, relay_bin, certs):
    """Each emulated server as a pod with its own IP (127.0.0.11, .12, ...):
    the pod's serving port and its relay's port (kvEvents.relayPort) are
    reached only through one Envoy standing in for the pods' inbound sidecars
    under STRICT (equivalent.inbound_sidecars). Returns (pod addresses, pod ->
    emulator address, relay port, the sidecars' admin port, processes)."""
    zmq = f.process.log_text().split("KV_EVENTS ", 1)[1].split()[0].split(",")
    serve_port, relay_port, admin = free_ports(3)
    pods, forward, procs = [], {}, []
    for i, (emulator, sub) in enumerate(zip(f.addresses, zmq)):
        ip = f"127.0.0.{11 + i}"
        (listen,) = free_ports(1)
        relay = Process(f"relay-{i}", [relay_bin, "--sub", sub, "--topic", f"kv@{emulator}@",
                                       "--listen", f"127.0.0.1:{listen}", "--max-blocks", "777"],
                        str(tmp_path / f"relay-{i}.log"))
        procs.append(relay)
        relay.wait_for_log("serving http://", timeout=30)
        pod = f"{ip}:{serve_port}"
        pods.append(pod)
        forward[pod] = emulator
        forward[f"{ip}:{relay_port}"] = f"127.0.0.1:{listen}"
    boot = equivalent.inbound_sidecars(str(tmp_path), certs, forward, admin)
    sidecars = Process("inbound-sidecars", ["envoy", "-c", boot, "--concurrency", "1", "--use-dynamic-base-id",
                                            "--log-level", "warning"], str(tmp_path / "inbound-sidecars.log"))
    procs.append(sidecars)

    def live():
        try:
            return request(admin, "GET", "/ready", timeout=2).body.strip() == b"LIVE"
        except OSError:
            assert sidecars.alive(), sidecars.log_text()
            return False

    wait_until(live, timeout=30, what="the inbound sidecars' Envoy LIVE")
    return pods, {p: forward[p] for p in pods}, relay_port, admin, procs


def _sum(stats, prefix, suffix):
    return sum(int(v) for k, v in stats.items() if k.startswith(prefix) and k.endswith(suffix) and v.isdigit())


@pytest.mark.parametrize("shape", ["sidecar", "gateway"])
def test_collector_polls_and_relays_under_strict_mtls(fleet, istio_envoy, relay_binary, tmp_path, shape):  # noqa: F811
    """Issue 40: the model pods' sidecars require mTLS (STRICT). The
    collector's /metrics polls (kvroute_metrics) and relay calls
    (kvroute_relays) reach them with the mesh identity the manifests give
    those clusters, and land on the inbound HTTP chain (the ALPN); routing
    goes through the model servers' cluster with auto-mTLS. With the clusters
    as before (plain HTTP) every poll is refused: no metrics, the
    poll-failure counter grows."""
    certs = equivalent.make_mesh_certs(str(tmp_path / "certs"))
    f = fleet(2, "--num-gpu-blocks", 777, "--kv-events-port-base", 0)
    pods, emulator_of, relay_port, sidecar_admin, procs = _pods_behind_strict_sidecars(tmp_path, f, relay_binary, certs)
    try:
        patch = {"routing": {"statePath": STATE_PATH},
                 "kvEvents": {"enabled": True, "relayPort": relay_port, "pollMs": 200, "staleMs": 2000}}
        e = istio_envoy(shape, pods, plugin_patch=patch, mesh_certs=certs)

        def state():
            r = request(e["port"], "GET", STATE_PATH, timeout=5)
            return {x["address"]: x for x in r.json()["endpoints"]} if r.status == 200 else {}

        def polled():
            s = state()
            return set(s) == set(pods) and all(
                (s[p].get("metrics") or {}).get("fresh") and s[p]["metrics"].get("numGpuBlocks") == 777
                and (s[p].get("kvEvents") or {}).get("fresh") for p in pods)

        try:
            wait_until(polled, timeout=20, interval=0.3,
                       what="every pod's /metrics (num_gpu_blocks 777) and relay polled through mTLS")
        except AssertionError:
            seen = {p: {"metrics": x.get("metrics"), "relayFailures": (x.get("kvEvents") or {}).get("failures")}
                    for p, x in state().items()}
            failures = _sum(_stats(e["admin"], "kvroute_metrics_poll_failures"), "", "")
            refused = _sum(_stats(sidecar_admin, "no_filter_chain_match"), "listener.", "no_filter_chain_match")
            raise AssertionError(f"no fresh metrics and relay view for every pod: {seen}; kvroute_metrics_poll_failures "
                                 f"{failures}; connections the sidecars refused (no filter chain match) {refused}") from None

        # Routing through the model servers' cluster (mTLS to the sidecars),
        # and the load the servers report reaches the collector's view.
        r = completion(e["port"], text(4343, 2048), timeout=10)
        assert r.status == 200 and r.served_by in f.addresses, r
        held = [in_background(completion, e["port"], text(f"held-{i}", 1024), max_tokens=160, timeout=60) for i in range(3)]
        wait_until(lambda: any(x["metrics"]["running"] + x["metrics"]["waiting"] > 0 for x in state().values()),
                   timeout=10, interval=0.2, what="the collector seeing the servers' running requests")
        for t, _ in held:
            t.join()
        done = [box[0] for _, box in held]
        assert all(getattr(r, "status", None) == 200 and r.served_by in f.addresses for r in done), done

        assert not {k: v for k, v in _stats(e["admin"], "kvroute_metrics_poll_failures").items() if v not in ("0", "")}
        kv = _stats(e["admin"], "kvroute_kv_events")
        assert _sum(kv, "wasmcustom.kvroute_kv_events_polls", "") > 0 and _sum(kv, "wasmcustom.kvroute_kv_events_bad_answers", "") == 0, kv
        assert all(f.stats(a)["metrics_scrapes"] > 0 for a in emulator_of.values())
        # Every call came over mTLS to the HTTP chain: none fell to the TCP
        # chain (another ALPN) or matched no chain (plain text).
        side = _stats(sidecar_admin, "inbound")
        assert _sum(side, "http.inbound_http_", ".downstream_rq_total") > 0, side
        assert _sum(side, "tcp.inbound_tcp_", ".downstream_cx_total") == 0, side
        assert _sum(_stats(sidecar_admin, "no_filter_chain_match"), "listener.", "no_filter_chain_match") == 0
        assert e["process"].alive()
    finally:
        for p in reversed(procs):
            p.stop()

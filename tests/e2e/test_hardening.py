"""Hardening of the plain-Envoy bootstrap (envoy/render.py), issue 40:

- a client's destination header picks no server on a route where kvroute
  does not run (a second route to the model servers' cluster);
- a client cannot make Envoy retry a prompt with x-envoy-retry-on /
  x-envoy-max-retries, whatever x-forwarded-for it sends;
- the collector's /metrics poll of an endpoint that left the cluster is
  answered by that endpoint or by no one, never by another member;
- the workers publish how long ago the collector ticked
  (kvroute_collector_tick_age_ms), and it grows when no collector runs.

Envoy is started from render.py's bootstrap, edited where a test needs a
second route or a changed collector; `--use-dynamic-base-id`, 127.0.0.1 only.
"""

import json
import os
import time

import pytest

from conftest import (DEST_HEADER, Envoy, Process, completion, free_ports, plugin_config, request, text,
                      wait_until)
import render

# The client listener's route in render.py's bootstrap (the first listener).
CLIENT_ROUTE = """              routes:
              - match: {prefix: "/"}
                route:
                  cluster: vllm
"""
# A second route to the same cluster, with kvroute off: an operator's
# passthrough, a health route, or any route of another team on the listener.
DIRECT_ROUTE = """              routes:
              - match: {prefix: "/direct/"}
                route:
                  cluster: vllm
                  prefix_rewrite: "/"
                typed_per_filter_config:
                  envoy.filters.http.wasm:
                    "@type": type.googleapis.com/envoy.config.route.v3.FilterConfig
                    disabled: true
              - match: {prefix: "/"}
                route:
                  cluster: vllm
"""
TICK_AGE = "wasmcustom.kvroute_collector_tick_age_ms"


def _start(artifacts, tmp_path, name, endpoints, config, edit=None, concurrency=2):
    """Envoy on render.py's bootstrap for `endpoints`, changed by `edit`
    (text -> text), LIVE and listing the endpoints in its state."""
    port, admin_port = free_ports(2)
    text_yaml = render.render(listen_port=port, admin_port=admin_port, endpoints=endpoints,
                              plugin_config=config, wasm=artifacts["wasm"])
    if edit:
        text_yaml = edit(text_yaml)
    path = str(tmp_path / f"{name}.yaml")
    with open(path, "w") as f:
        f.write(text_yaml)
    args = ["envoy", "-c", path, "--concurrency", str(concurrency), "--use-dynamic-base-id",
            "--log-level", os.environ.get("KVROUTE_E2E_ENVOY_LOG", "warning")]
    proc = Process(name, args, str(tmp_path / f"{name}.log"))
    e = Envoy(proc, port, admin_port, path)

    def live():
        if not proc.alive():
            raise AssertionError(f"Envoy exited; log:\n{proc.log_text()}")
        try:
            r = e.admin("/ready")
            return r.status == 200 and r.body.strip() == b"LIVE"
        except OSError:
            return False

    try:
        wait_until(live, timeout=60, what="Envoy /ready == LIVE")
    except BaseException:
        proc.stop()
        raise
    return e


def _one(text_yaml, old, new):
    assert text_yaml.count(old) >= 1, f"render.py's bootstrap changed; cannot find:\n{old}"
    return text_yaml.replace(old, new, 1)


def test_a_client_destination_header_picks_no_server_on_another_route(fleet, artifacts, tmp_path):
    f = fleet(2)
    a, b = f.addresses
    e = _start(artifacts, tmp_path, "second-route", f.addresses, plugin_config(),
               edit=lambda t: _one(t, CLIENT_ROUTE, DIRECT_ROUTE))
    try:
        # The cluster's override_host honours the header on any route; on this
        # one kvroute does not run. Round robin must pick, not the client.
        # The route rewrites /direct/v1/... to /v1/...; kvroute added no decision.
        served = [request(e.port, "POST", "/direct/v1/completions",
                          json.dumps({"model": "kvroute-e2e", "prompt": text(f"direct-{i}", 512),
                                      "max_tokens": 2}),
                          {"content-type": "application/json", DEST_HEADER: b}, timeout=10)
                  for i in range(6)]
        assert all(r.status == 200 and r.decision is None for r in served), served
        assert {r.served_by for r in served} == {a, b}, \
            f"the client's {DEST_HEADER}: {b} picked the server: {[r.served_by for r in served]}"
        # On kvroute's route its own pick still reaches the load balancer.
        for i in range(4):
            r = completion(e.port, text(f"routed-{i}", 2048), headers={DEST_HEADER: b}, timeout=10)
            assert r.status == 200 and r.decision, r
            assert r.decision["endpoint"] == r.served_by, r
        e.assert_alive()
        assert e.wasm_failures() == {}
    finally:
        e.process.stop()


def _faults(f):
    return sum(f.stats(x)["fault_responses"] for x in f.addresses)


FORGED = {
    # Header only: nothing is sent to 10.0.0.1.
    "x-forwarded-for": "10.0.0.1",
    "x-envoy-retry-on": "5xx",
    "x-envoy-max-retries": "3",
    "x-emulator-fail": "503",
}


# internal_address_config naming 10.0.0.0/8: an operator who trusts the
# pod network (Envoy < 1.33 did so by default).
TRUST_10 = ("          stat_prefix: kvroute\n",
            "          stat_prefix: kvroute\n"
            "          internal_address_config: {cidr_ranges: [{address_prefix: 10.0.0.0, prefix_len: 8}]}\n")


@pytest.mark.parametrize("trust", [False, True], ids=["shipped", "operator-trusts-10/8"])
def test_a_client_cannot_make_envoy_retry_a_prompt(fleet, artifacts, tmp_path, trust):
    f = fleet(2)
    e = _start(artifacts, tmp_path, "no-client-retries", f.addresses, plugin_config(),
               edit=(lambda t: _one(t, *TRUST_10)) if trust else None)
    try:
        before = _faults(f)
        r = completion(e.port, text("retry-me", 1024), headers=FORGED, timeout=20)
        assert r.status == 503, r
        assert _faults(f) - before == 1, \
            f"one client request reached the servers {_faults(f) - before} times (client-driven retries)"
    finally:
        e.process.stop()


def test_a_forged_forwarded_for_is_trusted_without_use_remote_address(fleet, artifacts, tmp_path):
    """The control: the same bootstrap without use_remote_address, for an
    operator who trusts 10.0.0.0/8. Envoy then takes the client's
    x-forwarded-for as the peer, the request is internal, and it is retried
    3 times; the count sees it, so the test above can fail."""
    f = fleet(2)

    def edit(t):
        return _one(t.replace("          use_remote_address: true\n", "", 1), *TRUST_10)

    e = _start(artifacts, tmp_path, "trusted-forwarded-for", f.addresses, plugin_config(), edit=edit)
    try:
        before = _faults(f)
        r = completion(e.port, text("retry-me", 1024), headers=FORGED, timeout=20)
        assert r.status == 503, r
        assert _faults(f) - before == 4, _faults(f) - before
    finally:
        e.process.stop()


def test_metrics_of_an_endpoint_that_left_the_cluster_are_never_another_servers(fleet, envoy):
    # Two members serve num_gpu_blocks 777; the third, 333. kvroute keeps all
    # three (a static list) while the Envoy cluster drops the third.
    f = fleet(2, "--num-gpu-blocks", 777)
    g = fleet(1, "--num-gpu-blocks", 333)
    (c,) = g.addresses
    everyone = f.addresses + [c]
    e = envoy(plugin_config(endpoints={"static": everyone}), eds=everyone)

    def blocks_of(addr):
        m = e.state_by_address()[addr].get("metrics") or {}
        return m.get("numGpuBlocks") if m.get("fresh") else None

    wait_until(lambda: blocks_of(c) == 333, timeout=10, what="c's own metrics recorded")
    e.set_members(f.addresses)

    def c_left():
        r = e.admin("/clusters?format=json")
        if r.status != 200:
            return False
        (vllm,) = [x for x in r.json()["cluster_statuses"] if x["name"] == render.VLLM_CLUSTER]
        ports = {h["address"]["socket_address"]["port_value"] for h in vllm.get("host_statuses", [])}
        return g.port_of(c) not in ports

    wait_until(c_left, timeout=10, what="c removed from the vllm cluster")
    # Through the model servers' cluster, c's polls would now be answered by
    # a or b (round robin): 777 recorded under c. Several polls (500 ms).
    seen = set()
    deadline = time.monotonic() + 4
    while time.monotonic() < deadline:
        seen.add(blocks_of(c))
        time.sleep(0.2)
    assert 777 not in seen, f"another server's metrics were recorded under {c}: {seen}"
    assert seen == {333}, seen
    e.assert_alive()


def _gauge(e, name):
    r = e.admin(f"/stats?filter=^{name}$")
    assert r.status == 200, r
    for line in r.body.decode().splitlines():
        k, _, v = line.partition(": ")
        if k == name and v.strip().isdigit():
            return int(v)
    return None


def test_the_collector_tick_age_stays_small_while_it_runs_and_grows_without_it(fleet, artifacts, tmp_path):
    f = fleet(2)
    e = _start(artifacts, tmp_path, "collector-runs", f.addresses, plugin_config())
    try:
        time.sleep(3)
        ages = [_gauge(e, TICK_AGE)]
        time.sleep(1.5)
        ages.append(_gauge(e, TICK_AGE))
        # Tick 250 ms (half of the 500 ms poll), gauge period 1 s.
        assert all(a is not None and a <= 1500 for a in ages), ages
    finally:
        e.process.stop()

    # The singleton that never collects: its root_id names no collector, so
    # no VM stamps a tick (as when the singleton VM has died).
    stopped = _start(artifacts, tmp_path, "collector-gone", f.addresses, plugin_config(),
                     edit=lambda t: _one(t, "      root_id: kvroute-collector\n",
                                         "      root_id: kvroute-collector-gone\n"))
    try:
        time.sleep(2.5)
        first = _gauge(stopped, TICK_AGE)
        time.sleep(2)
        second = _gauge(stopped, TICK_AGE)
        assert first is not None and second is not None, (first, second)
        assert first >= 1000 and second >= first + 1000, (first, second)
    finally:
        stopped.process.stop()

"""The collector polls each endpoint's /metrics through Envoy; its view in the
filter state matches what the endpoints serve, and dead metrics do not stop
routing."""

import collections
import re
import time

from conftest import completion, in_background, text, wait_until

NUM_GPU_BLOCKS = 777

# vLLM metric name -> field of `metrics` in the filter state (routing.statePath).
_SERVED_AS = {
    "vllm:num_requests_running": "running",
    "vllm:num_requests_waiting": "waiting",
    "vllm:kv_cache_usage_perc": "kvCacheUsage",
    "vllm:prefix_cache_queries_total": "prefixCacheQueries",
    "vllm:prefix_cache_hits_total": "prefixCacheHits",
}


def parse_prometheus(body):
    """{metric name: value} for unlabelled samples, and cache_config_info labels."""
    values = {}
    labels = {}
    for line in body.splitlines():
        if not line or line.startswith("#"):
            continue
        m = re.match(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)", line)
        if not m:
            continue
        name, lab, value = m.group(1), m.group(2) or "", m.group(3)
        values[name] = values.get(name, 0.0) + float(value)
        if name == "vllm:cache_config_info":
            labels.update(dict(re.findall(r'(\w+)="([^"]*)"', lab)))
    return values, labels


def _collector_matches(e, f):
    """True when, for every endpoint, the state's metrics equal a fresh read
    of the endpoint's own /metrics (gauges, counters, cache_config_info)."""
    state = e.state_by_address()
    for addr in f.addresses:
        seen = state[addr].get("metrics")
        if not seen or not seen.get("fresh"):
            return False
        served, labels = parse_prometheus(f.metrics_text(addr))
        for vllm_name, field in _SERVED_AS.items():
            assert vllm_name in served, f"{addr} does not serve {vllm_name}"
            if abs(float(seen[field]) - served[vllm_name]) > 1e-9:
                return False
        if seen["numGpuBlocks"] != int(labels["num_gpu_blocks"]) or seen["blockSize"] != int(labels["block_size"]):
            return False
    return True


def test_collector_view_matches_endpoints(fleet, envoy):
    f = fleet(2, "--num-gpu-blocks", NUM_GPU_BLOCKS, "--block-size", 64)
    e = envoy(endpoints=f.addresses)
    # Some traffic so the counters are not all zero; a shared prefix gives hits.
    prefix = text("metrics-prefix", 8192)
    for i in range(6):
        r = completion(e.port, prefix + text(f"m{i}", 512))
        assert r.status == 200, r
    served, labels = parse_prometheus(f.metrics_text(f.addresses[0]))
    assert labels.get("num_gpu_blocks") == str(NUM_GPU_BLOCKS), labels
    wait_until(lambda: _collector_matches(e, f), timeout=10, what="collector state equal to /metrics")

    # Long generations (300 tokens x 25 ms decode steps = 7.5 s) keep the
    # emulated engines busy; the collector sees running/waiting move.
    held = [in_background(completion, e.port, text(f"held-{i}", 4096), max_tokens=300, timeout=60)
            for i in range(4)]
    wait_until(lambda: _collector_matches(e, f) and any(
        x["metrics"]["running"] + x["metrics"]["waiting"] > 0 for x in e.state()["endpoints"]),
        timeout=10, what="collector seeing the held requests")
    for t, _ in held:
        t.join()


def _route_many(e, f, tag, n=6):
    """n distinct held requests sent one after another; all must succeed and
    the in-flight-load routing must use every endpoint."""
    held = []
    for i in range(n):
        held.append(in_background(completion, e.port, text(f"{tag}-{i}", 4096),
                                  headers={"x-emulator-delay-ms": "1500"}, timeout=30))
        wait_until(lambda: sum(x["inflightRequests"] for x in e.state()["endpoints"]) >= i + 1,
                   timeout=10, what="request charged")
    served = collections.Counter()
    for t, res in held:
        t.join()
        (r,) = res
        assert not isinstance(r, Exception), r
        assert r.status == 200, r
        assert r.decision, r
        served[r.served_by] += 1
    assert set(served) == set(f.addresses), served


def test_dead_metrics_do_not_stop_routing(fleet, envoy):
    f = fleet(2)
    e = envoy(endpoints=f.addresses)
    wait_until(lambda: all(x.get("metrics") for x in e.state()["endpoints"]), timeout=10,
               what="first metrics poll")
    a, b = f.addresses
    failures_before = e.state_by_address()[a]["metrics"]["failures"]
    for mode_a, mode_b in (("500", "ok"), ("garbage", "500"), ("hang", "garbage")):
        f.metrics_mode(a, mode_a)
        f.metrics_mode(b, mode_b)
        time.sleep(1.5)  # the collector polls every 500 ms: a few failed polls
        _route_many(e, f, f"dead-{mode_a}-{mode_b}")
        # The collector noticed: a's polls are counted as failures.
        assert e.state_by_address()[a]["metrics"]["failures"] > failures_before, e.state_by_address()[a]
        failures_before = e.state_by_address()[a]["metrics"]["failures"]
        assert {x["address"] for x in e.state()["endpoints"]} == set(f.addresses)
        e.assert_alive()
        assert e.wasm_failures() == {}
    f.metrics_mode(a, "ok")
    f.metrics_mode(b, "ok")
    wait_until(lambda: _collector_matches(e, f), timeout=10, what="metrics back after recovery")

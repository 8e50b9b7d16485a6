"""The collector polls each endpoint's /metrics through Envoy; its view in the
filter state matches what the endpoints serve, and dead metrics do not stop
routing."""

import collections
import re
import time

from conftest import completion, in_background, text, wait_until

NUM_GPU_BLOCKS = 777

# vLLM metric name -> the normalised key it should appear under in the state.
_GAUGES = {
    "vllm:num_requests_running": "numrequestsrunning",
    "vllm:num_requests_waiting": "numrequestswaiting",
    "vllm:kv_cache_usage_perc": "kvcacheusage",
}
_COUNTERS = {
    "vllm:prefix_cache_queries_total": "prefixcachequeries",
    "vllm:prefix_cache_hits_total": "prefixcachehits",
}


def _norm(key):
    key = key.lower().replace("vllm:", "")
    key = re.sub(r"[^a-z0-9]", "", key)
    for suffix in ("total", "perc", "percent"):
        if key.endswith(suffix) and key != suffix:
            key = key[: -len(suffix)]
    return key


def _flatten(obj, prefix=""):
    out = {}
    if isinstance(obj, dict):
        for k, v in obj.items():
            out.update(_flatten(v, f"{prefix}{k}."))
    elif isinstance(obj, (int, float)) and not isinstance(obj, bool):
        out[_norm(prefix.rstrip(".").rsplit(".", 1)[-1])] = float(obj)
    return out


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
    of the endpoint's own /metrics (gauges and counters)."""
    state = e.state_by_address()
    for addr in f.addresses:
        metrics = state[addr].get("metrics")
        if not metrics:
            return False
        seen = _flatten(metrics)
        served, labels = parse_prometheus(f.metrics_text(addr))
        for vllm_name, key in list(_GAUGES.items()) + list(_COUNTERS.items()):
            if vllm_name not in served:
                raise AssertionError(f"{addr} does not serve {vllm_name}")
            if key not in seen or abs(seen[key] - served[vllm_name]) > 1e-6:
                return False
        if seen.get("numgpublocks") != float(labels.get("num_gpu_blocks", -1)):
            return False
        if seen.get("blocksize") != float(labels.get("block_size", -1)):
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

    # With requests held in flight the gauges move; the collector follows.
    held = [in_background(completion, e.port, text(f"held-{i}", 4096),
                          headers={"x-emulator-delay-ms": "4000"}, timeout=30) for i in range(4)]
    wait_until(lambda: _collector_matches(e, f) and any(
        (x.get("metrics") or {}) and _flatten(x["metrics"]).get("numrequestsrunning", 0)
        + _flatten(x["metrics"]).get("numrequestswaiting", 0) > 0
        for x in e.state()["endpoints"]), timeout=10, what="collector seeing the held requests")
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
    for mode_a, mode_b in (("500", "ok"), ("garbage", "500"), ("hang", "garbage")):
        f.metrics_mode(a, mode_a)
        f.metrics_mode(b, mode_b)
        time.sleep(1.5)  # the collector polls every 500 ms: a few failed polls
        _route_many(e, f, f"dead-{mode_a}-{mode_b}")
        assert {x["address"] for x in e.state()["endpoints"]} == set(f.addresses)
        e.assert_alive()
        assert e.wasm_failures() == {}
    f.metrics_mode(a, "ok")
    f.metrics_mode(b, "ok")
    wait_until(lambda: _collector_matches(e, f), timeout=10, what="metrics back after recovery")

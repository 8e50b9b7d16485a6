"""The collector's stored view (the filter state) matches what the real vLLM
servers' /metrics serve: running, waiting, KV usage, block size, number of
blocks, prefix-cache queries and hits."""

import threading
import time

from conftest import BLOCK_SIZE, NUM_BLOCKS, completion, e2e, real_plugin_config, scrape, words

GAUGES = {
    "vllm:num_requests_running": "running",
    "vllm:num_requests_waiting": "waiting",
    "vllm:kv_cache_usage_perc": "kvCacheUsage",
}
COUNTERS = {
    "vllm:prefix_cache_queries_total": "prefixCacheQueries",
    "vllm:prefix_cache_hits_total": "prefixCacheHits",
}


def _fresh_metrics(e, addresses):
    state = e.state_by_address()
    out = {}
    for a in addresses:
        m = (state.get(a) or {}).get("metrics")
        if not m or not m.get("fresh"):
            return None
        out[a] = m
    return out


def _equal_now(e, addresses):
    """True when the state equals a scrape taken right after it, for every
    field (only holds while the servers are idle)."""
    seen = _fresh_metrics(e, addresses)
    if not seen:
        return False
    for a in addresses:
        _, served, labels = scrape(a)
        m = seen[a]
        for name, field in {**GAUGES, **COUNTERS}.items():
            assert name in served, f"{a} does not serve {name}"
            if abs(float(m[field]) - served[name]) > 1e-9:
                return False
        assert m["blockSize"] == int(labels["block_size"]) == BLOCK_SIZE, (m, labels)
        assert m["numGpuBlocks"] == int(labels["num_gpu_blocks"]) == NUM_BLOCKS, (m, labels)
    return True


def test_collector_view_matches_real_metrics(real_fleet, envoy):
    addrs = real_fleet.addresses
    cfg = real_plugin_config()
    timeout_s = cfg["collector"]["metricsTimeoutMs"] / 1000.0
    e = envoy(config=cfg, endpoints=addrs)
    e2e.wait_until(lambda: _fresh_metrics(e, addrs), timeout=60, what="fresh metrics for both servers")

    # Traffic through Envoy so that the counters are not zero: a shared
    # prefix gives prefix-cache hits.
    prefix = words("collector-prefix", 600)
    for i in range(6):
        completion(e.port, prefix + " " + words(f"collector-{i}", 30))

    # Idle: the stored view equals the scrape exactly.
    e2e.wait_until(lambda: _equal_now(e, addrs), timeout=60, interval=0.5,
                   what="collector state equal to the real /metrics")
    hits = sum(e.state_by_address()[a]["metrics"]["prefixCacheHits"] for a in addrs)
    assert hits > 0, e.state()

    # Under load: long generations on both servers. Counters in the state
    # lie between a scrape before its poll and a scrape after; the gauges
    # show the held requests.
    stop = threading.Event()
    errors = []

    def load(i):
        n = 0
        while not stop.is_set() and n < 40:
            try:
                completion(e.port, words(f"load-{i}-{n}", 200), max_tokens=600, ignore_eos=True, timeout=180)
            except Exception as ex:  # noqa: BLE001
                errors.append(ex)
                return
            n += 1

    threads = [threading.Thread(target=load, args=(i,), daemon=True) for i in range(4)]
    for t in threads:
        t.start()
    try:
        busy_seen = {a: False for a in addrs}
        usage_seen = {a: False for a in addrs}
        brackets = 0
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and (brackets < 6 or not all(busy_seen.values())
                                               or not all(usage_seen.values())):
            for a in addrs:
                _, before, _ = scrape(a)
                # The server read its counters before its answer arrived.
                t0 = time.time()

                def polled_after_t0():
                    # The state is made after t_req, so the poll's answer
                    # arrived at or after t_req - ageMs. Its request left at
                    # most metricsTimeoutMs before that (a later answer is a
                    # failure, not a value), so an answer recorded after
                    # t0 + timeout + 250 ms of slack was asked for after t0,
                    # and the server counted it after `before`. A margin of
                    # 250 ms alone failed twice in CI on the loaded 2-core
                    # machine: a poll sent before t0 was answered late.
                    t_req = time.time()
                    m = _fresh_metrics(e, [a])
                    if not m:
                        return None
                    m = m[a]
                    return m if t_req - m["ageMs"] / 1000.0 > t0 + timeout_s + 0.25 else None

                m = e2e.wait_until(polled_after_t0, timeout=30, interval=0.1, what=f"a poll of {a} after t0")
                _, after, _ = scrape(a)
                for name, field in COUNTERS.items():
                    assert before[name] <= m[field] <= after[name], (a, name, before[name], m[field], after[name])
                assert 0 <= m["running"] <= 32 and m["waiting"] >= 0, m
                assert 0.0 <= m["kvCacheUsage"] <= 1.0, m
                busy_seen[a] |= m["running"] + m["waiting"] > 0
                usage_seen[a] |= m["kvCacheUsage"] > 0
                brackets += 1
        assert not errors, errors
        assert all(busy_seen.values()), f"the state never showed a running request: {busy_seen}"
        assert all(usage_seen.values()), f"the state never showed KV usage: {usage_seen}"
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=300)

    # Idle again: exact equality once more.
    e2e.wait_until(lambda: _equal_now(e, addrs), timeout=60, interval=0.5,
                   what="collector state equal to the real /metrics after the load")
    e.assert_alive()
    assert e.wasm_failures() == {}

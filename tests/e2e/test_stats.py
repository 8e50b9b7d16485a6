"""kvroute's Envoy stats at /stats/prometheus (docs/observability.md), and the
explanation header on the internal debug listener only.

The histograms reach /stats/prometheus after the filter's tick (200 ms) and
Envoy's stats flush (stats_flush_interval, 5 s by default); the collector's
gauges are set every second.
"""

import json
import os
import re

from conftest import (
    DECISION, REPO, SERVED_BY, SHIPPED_PLUGIN_CONFIG, completion, in_background, request, text, wait_until,
)

SAMPLE_EVERY = 16  # telemetry::DECISION_SAMPLE_EVERY
INDEX_BUDGET = 65536  # 16 shards: the collector sweeps the whole index every second
DASHBOARD = os.path.join(REPO, "docs", "grafana", "kvroute.json")

_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{([^}]*)\})?\s+(\S+)$")


def scrape(e):
    """{(name, frozenset(labels)): value} of kvroute_* samples at /stats/prometheus."""
    r = e.admin("/stats/prometheus")
    assert r.status == 200, r
    out = {}
    for line in r.body.decode().splitlines():
        m = _LINE.match(line)
        if not m or not m.group(1).startswith("kvroute_"):
            continue
        labels = frozenset(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
        out[(m.group(1), labels)] = float(m.group(3))
    return out


def value(samples, name, **labels):
    return samples.get((name, frozenset(labels.items())))


def by_slot(samples, name):
    return {dict(k[1])["slot"]: v for k, v in samples.items() if k[0] == name and "slot" in dict(k[1])}


def shipped(**routing):
    cfg = json.loads(json.dumps(SHIPPED_PLUGIN_CONFIG))
    cfg.setdefault("sharedState", {})["indexBudgetBytes"] = INDEX_BUDGET
    cfg["routing"].update(routing)
    return cfg


def test_new_stats_appear_at_stats_prometheus(fleet, envoy):
    f = fleet(2)
    e = envoy(shipped(), endpoints=f.addresses, state_listener=True)
    slots = {x["address"]: str(x["slot"]) for x in e.state()["endpoints"]}

    # Enough routed requests that every worker times at least one decision
    # (1 in 16 per worker), all sharing a long prefix (affinity > 0).
    prefix = text("stats-prefix", 4096)
    n = 4 * SAMPLE_EVERY
    for i in range(n):
        r = completion(e.port, prefix + text(f"s{i}", 300))
        assert r.status == 200 and r.served_by in f.addresses, r

    def histograms():
        s = scrape(e)
        d = value(s, "kvroute_decision_time_us_count")
        a = value(s, "kvroute_affinity_percent_count")
        return s if d and a and a >= n else None

    s = wait_until(histograms, timeout=20, what="both histograms at /stats/prometheus")
    assert 1 <= value(s, "kvroute_decision_time_us_count") <= n, s
    # Our buckets (render.py stats_config), in µs: a decision takes well under 100 ms.
    assert value(s, "kvroute_decision_time_us_bucket", le="100000") == value(s, "kvroute_decision_time_us_count")
    assert value(s, "kvroute_decision_time_us_bucket", le="10") is not None
    # Every routed request is one affinity sample (fewer than 64 per tick here).
    assert value(s, "kvroute_affinity_percent_count") == n, s
    assert value(s, "kvroute_affinity_percent_bucket", le="100") == n
    assert value(s, "kvroute_affinity_percent_sum") > 0, "no request found its prefix"

    # Collector gauges, tagged by slot (a real Prometheus label).
    def gauges():
        s = scrape(e)
        ok = (
            value(s, "kvroute_endpoints") == 2
            and value(s, "kvroute_endpoints_stale_metrics") == 0
            and (value(s, "kvroute_index_used_bytes") or 0) > 0
            and set(by_slot(s, "kvroute_endpoint_metrics_age_ms")) == set(slots.values())
        )
        return s if ok else None

    s = wait_until(gauges, timeout=10, what="collector gauges")
    assert value(s, "kvroute_index_budget_bytes") == INDEX_BUDGET
    assert value(s, "kvroute_index_used_bytes") <= INDEX_BUDGET
    assert value(s, "kvroute_collector_leader") == 1, s
    # Polled every 500 ms, stale after collector.metricsStaleAfterMs.
    assert all(v < 5000 for v in by_slot(s, "kvroute_endpoint_metrics_age_ms").values()), s
    assert set(by_slot(s, "kvroute_endpoint_inflight_requests").values()) == {0}, s

    # Every series the Grafana dashboard queries is published, even at 0 (a
    # renamed stat or a typo in a panel leaves that panel empty).
    with open(DASHBOARD) as fh:
        exprs = [t["expr"] for p in json.load(fh)["panels"] for t in p["targets"]]
    # (Flow control's series exist only with its gate on: test_flow_control.py
    # checks those panels.)
    queried = {n for x in exprs for n in re.findall(r"\bkvroute_\w+", x) if not n.startswith("kvroute_flow_")}
    published = {k[0] for k in s}
    assert len(queried) >= 30, queried
    assert queried <= published, sorted(queried - published)

    # A request held in flight shows on its endpoint's slot, and goes back to 0.
    t, res = in_background(completion, e.port, text("held", 2000), headers={"x-emulator-delay-ms": "3000"})
    s = wait_until(
        lambda: (lambda s: s if any(v == 1 for v in by_slot(s, "kvroute_endpoint_inflight_requests").values())
                 else None)(scrape(e)),
        timeout=5, what="a held request in kvroute_endpoint_inflight_requests",
    )
    held = [k for k, v in by_slot(s, "kvroute_endpoint_inflight_requests").items() if v == 1]
    assert by_slot(s, "kvroute_endpoint_inflight_tokens")[held[0]] > 0, s
    t.join(timeout=15)
    assert res and not isinstance(res[0], Exception) and res[0].status == 200, res
    assert slots[res[0].served_by] == held[0], (slots, res[0].served_by, held)
    wait_until(
        lambda: set(by_slot(scrape(e), "kvroute_endpoint_inflight_tokens").values()) == {0},
        timeout=5, what="in-flight gauges back to 0",
    )
    assert e.wasm_failures() == {}


def test_explanation_header_only_on_the_debug_listener(fleet, envoy):
    f = fleet(2)
    e = envoy(shipped(), endpoints=f.addresses, state_listener=True, debug_listener=True)
    prompt = text("explained", 3000)
    r = completion(e.port, prompt)
    assert r.status == 200 and DECISION not in r.headers, r
    r = completion(e.debug_port, prompt)
    assert r.status == 200 and r.headers.get(SERVED_BY) in f.addresses, r
    d = r.decision
    assert d and d["endpoint"] == r.served_by and d["branch"] in {"sticky", "no-affinity"}, r
    # Same vm_id, same shared data: the client listener's request made this
    # one sticky to the same endpoint.
    assert d["branch"] == "sticky" and float(d["affinity"]) > 0.9, d
    assert {"ttft_ms", "uncached_tokens", "candidates", "passed"} <= set(d), d
    # The debug listener's charges are in the shared state too.
    t, res = in_background(completion, e.debug_port, text("dbg-held", 800), headers={"x-emulator-delay-ms": "1500"})
    wait_until(lambda: any(x["inflightRequests"] > 0 for x in e.state()["endpoints"]), timeout=5,
               what="the debug listener's request in the shared state")
    t.join(timeout=10)
    assert res and res[0].status == 200 and DECISION in res[0].headers, res
    # Not on the client listener, ever.
    assert DECISION not in completion(e.port, text("plain", 500)).headers
    assert request(e.port, "GET", "/v1/models").headers.get(DECISION) is None

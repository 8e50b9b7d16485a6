"""Online calibration in real Envoy: the collector estimates each endpoint's
prefill throughput from its /metrics (vllm:request_prefill_kv_computed_tokens
over vllm:request_prefill_time_seconds, filter/core/src/learners/prefill_rate.rs),
and with peakPrefillThroughput {"auto": …} the affinity filter's TTFT estimate
divides by it; a stalled metric falls back to the configured value.

The fleet is three emulators with different --prefill-tps. Their histograms
are in model seconds, so the estimate is their configured rate whatever the
time scale. The emulators run with --prefill-attention-tokens 0 (prefill
cost linear in tokens), so that the configured rate is the truth to compare
with; with the attention term the effective rate depends on prompt length.
"""

import json
import threading

from conftest import SHIPPED_PLUGIN_CONFIG, STATE_PATH, completion, text, wait_until
from test_stats import by_slot, scrape

RATES = [5000, 10000, 20000]  # model tokens/s, one emulator each
INITIAL = 8000  # the configured value: the gate's rate until (and unless) an estimate is fresh
STALE_AFTER_MS = 1500
PROMPT_BYTES = 16384  # about 7,500 tokens of the emulator's tokenizer


def config():
    cfg = json.loads(json.dumps(SHIPPED_PLUGIN_CONFIG))
    for p in cfg["plugins"]:
        if p["type"] == "prefix-cache-affinity-filter":
            p["parameters"]["peakPrefillThroughput"] = {
                "auto": True, "initial": INITIAL, "floor": 1000, "ceiling": 64000,
            }
    cfg["routing"].update({"debugHeader": True, "statePath": STATE_PATH, "seed": 7})
    cfg["collector"].update({"metricsPollIntervalMs": 250, "metricsStaleAfterMs": STALE_AFTER_MS})
    return cfg


def within(value, want, tol=0.10):
    return value is not None and abs(value - want) <= tol * want


def test_collector_estimates_each_endpoints_prefill_rate_and_the_gate_uses_it(fleet, envoy):
    fleets = [fleet(1, "--prefill-tps", r, "--time-scale", 20, "--prefill-attention-tokens", 0) for r in RATES]
    rate_of = {f.addresses[0]: r for f, r in zip(fleets, RATES)}
    by_address = {f.addresses[0]: f for f in fleets}
    e = envoy(config(), endpoints=list(rate_of), state_listener=True)

    # Before any traffic: no estimate, the gate uses the configured value.
    st = e.state_by_address()
    assert {a: x["gatePrefillTokensPerS"] for a, x in st.items()} == {a: INITIAL for a in rate_of}, st

    # Cold requests one at a time (no two prefills overlap), spread by the
    # router over the three endpoints.
    served = {a: 0 for a in rate_of}
    for i in range(36):
        r = completion(e.port, text(f"calib-{i}", PROMPT_BYTES), max_tokens=2)
        assert r.status == 200, r
        served[r.served_by] += 1
    assert all(n >= 2 for n in served.values()), served

    def estimates():
        st = e.state_by_address()
        got = {a: (x["metrics"] or {}).get("prefillTokensPerS") for a, x in st.items()}
        return st if all(within(got[a], rate_of[a]) for a in rate_of) else None

    st = wait_until(estimates, timeout=10, what="each endpoint's estimate within 10% of its --prefill-tps")
    print("estimates:", {rate_of[a]: x["metrics"]["prefillTokensPerS"] for a, x in st.items()}, "served:", served)
    for a, x in st.items():
        assert x["metrics"]["fresh"] and x["metrics"]["prefillSamples"] >= 1, x
        assert x["gatePrefillTokensPerS"] == x["metrics"]["prefillTokensPerS"], x
        # Every request was cold: each one computed its whole prompt.
        assert by_address[a].stats(a)["cached_tokens"] == 0

    # The per-slot gauge at /stats/prometheus carries the same estimate.
    slot_of = {a: str(x["slot"]) for a, x in st.items()}

    def gauges():
        g = by_slot(scrape(e), "kvroute_endpoint_prefill_tokens_per_s")
        return g if all(within(g.get(slot_of[a]), rate_of[a]) for a in rate_of) else None

    wait_until(gauges, timeout=10, what="kvroute_endpoint_prefill_tokens_per_s{slot} within 10%")

    # The gate divides by the endpoint's own estimate. A request held in
    # flight on a warm endpoint charges its uncached suffix there; the next
    # request with the same prefix sticks to it, and the decision header's
    # ttft_ms is that charge plus the probe's own uncached tokens there (the
    # saturation signal's x) over the endpoint's estimate (not over INITIAL).
    prefix = text("calib-shared", PROMPT_BYTES)
    first = completion(e.port, prefix, max_tokens=1)
    warm = first.served_by
    held_thread = threading.Thread(
        target=completion, args=(e.port, prefix + text("held", 4000)),
        kwargs={"max_tokens": 1, "headers": {"x-emulator-delay-ms": "2500"}}, daemon=True,
    )
    held_thread.start()
    charge = wait_until(lambda: e.state_by_address()[warm]["inflightTokens"], timeout=5,
                        what="the held request's charge")
    r = completion(e.port, prefix + text("probe", 400), max_tokens=1)
    d = r.decision
    assert r.served_by == warm and d["branch"] == "sticky", r
    estimate = e.state_by_address()[warm]["metrics"]["prefillTokensPerS"]
    own = int(d["uncached_tokens"])
    assert 0 < own < charge, d
    assert abs(float(d["ttft_ms"]) - (charge + own) / estimate * 1000) < 0.2, (d, charge, estimate)
    assert abs(float(d["ttft_ms"]) - (charge + own) / INITIAL * 1000) > 1, (d, charge)
    held_thread.join(timeout=15)

    # A stalled metric: /metrics answers 500, so the snapshot goes stale and
    # the gate falls back to the configured value for that endpoint only.
    stalled = max(rate_of, key=rate_of.get)
    by_address[stalled].metrics_mode(stalled, "500")
    st = wait_until(
        lambda: (lambda st: st if st[stalled]["gatePrefillTokensPerS"] == INITIAL else None)(e.state_by_address()),
        timeout=STALE_AFTER_MS / 1000 + 5, what="the stalled endpoint falling back to the configured rate",
    )
    assert st[stalled]["metrics"]["fresh"] is False, st[stalled]
    # The estimate itself is kept, for when the metrics come back.
    assert within(st[stalled]["metrics"]["prefillTokensPerS"], rate_of[stalled])
    for a in rate_of:
        if a != stalled:
            assert within(st[a]["gatePrefillTokensPerS"], rate_of[a]), st[a]
    by_address[stalled].metrics_mode(stalled, "ok")
    wait_until(
        lambda: within(e.state_by_address()[stalled]["gatePrefillTokensPerS"], rate_of[stalled]),
        timeout=5, what="the estimate back in use once /metrics recovers",
    )
    assert e.wasm_failures() == {}
    e.assert_alive()


"""Calibration on real vLLM: kvroute-calibrate's offline figure and the
collector's online estimate (peakPrefillThroughput "auto") from the real
servers' vllm:request_prefill_kv_computed_tokens and
vllm:request_prefill_time_seconds. The real rate depends on the machine, so
the assertions are about consistency and plumbing, not about a number: the
online estimate lies within the rates the servers' own histograms give, the
gate divides by it, and the offline figure is of the same order."""

import json
import os
import subprocess

from conftest import REPO, completion, e2e, real_plugin_config, scrape, words

CALIBRATE = os.path.join(e2e.TARGET_DIR, "debug", "kvroute-calibrate")


def _histograms(address):
    _, v, _ = scrape(address)
    return (v.get("vllm:request_prefill_kv_computed_tokens_sum"),
            v.get("vllm:request_prefill_time_seconds_sum"),
            v.get("vllm:request_prefill_time_seconds_count"))


def test_online_estimate_follows_the_real_servers_histograms(real_fleet, envoy):
    addrs = real_fleet.addresses
    cfg = real_plugin_config()
    for p in cfg["plugins"]:
        if p["type"] == "prefix-cache-affinity-filter":
            p.setdefault("parameters", {})["peakPrefillThroughput"] = {
                "auto": True, "initial": 50000, "floor": 1000, "ceiling": 5_000_000}
    e = envoy(config=cfg, endpoints=addrs)
    # The collector's first poll is each window's start.
    e2e.wait_until(lambda: all((x.get("metrics") or {}).get("fresh") for x in e.state()["endpoints"]),
                   timeout=60, what="fresh metrics for both servers")
    before = {a: _histograms(a) for a in addrs}
    assert all(None not in h for h in before.values()), before

    # Cold prompts (distinct words, ~1500 tokens each), one at a time. Each
    # request's own rate is read from its server's histograms around it: every
    # window the estimator closes is a ratio of sums over some of these
    # requests, so it lies between the slowest and the fastest of them, and so
    # does an EWMA of windows. (A whole-test ratio is no yardstick: on a loaded
    # 2-core machine single requests differ by more than 2x.)
    rates = {a: [] for a in addrs}
    last = dict(before)
    for i in range(12):
        completion(e.port, words(f"calibration-{i}", 1500), max_tokens=2)
        # vLLM may record a finished request's stats just after its response.
        now = e2e.wait_until(
            lambda: (lambda h: h if sum(h[a][2] - last[a][2] for a in addrs) >= 1 else None)(
                {a: _histograms(a) for a in addrs}),
            timeout=10, interval=0.1, what="the request in the servers' histograms")
        for a in addrs:
            d_tokens, d_seconds, d_requests = (now[a][k] - last[a][k] for k in range(3))
            if d_requests:
                assert d_requests == 1 and d_seconds > 0, (a, last[a], now[a])
                rates[a].append(d_tokens / d_seconds)
        last = now

    def estimated():
        st = e.state_by_address()
        return st if all((st[a]["metrics"] or {}).get("prefillSamples", 0) >= 1 for a in addrs) else None

    st = e2e.wait_until(estimated, timeout=60, interval=0.5, what="an online estimate for both servers")
    after = {a: _histograms(a) for a in addrs}
    for a in addrs:
        d_tokens = after[a][0] - before[a][0]
        d_seconds = after[a][1] - before[a][1]
        d_requests = after[a][2] - before[a][2]
        assert d_requests >= 1 and d_tokens >= 256 * d_requests and d_seconds > 0, (a, before[a], after[a])
        assert len(rates[a]) == d_requests, (a, rates[a], d_requests)
        overall = d_tokens / d_seconds
        est = st[a]["metrics"]["prefillTokensPerS"]
        lo, hi = min(rates[a]), max(rates[a])
        print(f"[real] {a}: online estimate {est:.0f} tok/s; its histograms over the test "
              f"{d_tokens:.0f} tokens / {d_seconds:.3f} s = {overall:.0f} tok/s ({d_requests:.0f} requests, "
              f"single requests {lo:.0f}..{hi:.0f} tok/s)")
        # 5 % for the histograms' float sums.
        assert lo * 0.95 <= est <= hi * 1.05, (est, lo, hi, rates[a])
        assert st[a]["gatePrefillTokensPerS"] == est, st[a]
    e.assert_alive()


def test_offline_calibrate_runs_against_a_real_server(real_fleet):
    if not os.path.exists(CALIBRATE):
        subprocess.run(["cargo", "build", "--bin", "kvroute-calibrate"], cwd=REPO, check=True)
    out = subprocess.run(
        [CALIBRATE, "--url", f"http://{real_fleet.addresses[0]}", "--tokens", "2048", "--requests", "5",
         "--warmup", "1", "--json"],
        capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr
    v = json.loads(out.stdout)
    print(f"[real] kvroute-calibrate: {v['peakPrefillThroughput']:.0f} tok/s, TTFT spread {v['ttftSeconds']}")
    assert v["model"] == "tiny" and len(v["ttftSeconds"]) == 5
    # Sanity only: a positive, finite rate, from TTFTs of a few ms or more.
    assert 0 < v["peakPrefillThroughput"] < 1e8
    assert all(t > 0.001 for t in v["ttftSeconds"]), v

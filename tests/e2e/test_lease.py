"""collector.mode lease through real Envoy: a filter-only install (no
bootstrap singleton), where Envoy's worker VMs elect one collector through a
lease key in shared data.

Checks that the workers create the shared tables and keep the metrics fresh
without a singleton, and that only one of them polls: the emulator counts the
/metrics requests it answers.
"""

import time

from conftest import completion, plugin_config, text, wait_until

POLL_MS = 500


def _scrapes(f):
    return {a: f.stats(a)["metrics_scrapes"] for a in f.addresses}


def test_filter_only_install_elects_one_collector(fleet, envoy):
    f = fleet(2)
    cfg = plugin_config(collector={"mode": "lease", "leaseMs": 2000, "metricsPollIntervalMs": POLL_MS})
    e = envoy(config=cfg, endpoints=f.addresses, concurrency=3)
    with open(e.config_path) as fh:
        assert "envoy.bootstrap.wasm" not in fh.read(), "lease mode must render no singleton"

    # Metrics arrive (someone is collecting) ...
    wait_until(
        lambda: all(x.get("metrics") for x in e.state()["endpoints"]),
        timeout=15,
        what="metrics for every endpoint from the elected collector",
    )
    # ... and requests are routed with them.
    r = completion(e.port, text("lease", 4096))
    assert r.status == 200 and r.decision, r

    # One poller: about one scrape per endpoint per interval, not one per worker.
    before = _scrapes(f)
    seconds = 6
    time.sleep(seconds)
    after = _scrapes(f)
    for a in f.addresses:
        n = after[a] - before[a]
        expected = seconds * 1000 / POLL_MS
        assert expected * 0.6 <= n <= expected * 1.3, f"{a}: {n} scrapes in {seconds} s, expected about {expected}"
    assert e.wasm_failures() == {}
    e.assert_alive()

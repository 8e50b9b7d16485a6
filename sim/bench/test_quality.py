"""Unit tests of quality.py's results merging (`--from-results`): no processes, no network.

    python3 -m pytest sim/bench/test_quality.py -q
"""

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import quality  # noqa: E402

FLEET = {"endpoints": 4, "num_gpu_blocks": 16384, "block_size": 16, "max_num_batched_tokens": 8192,
         "prefill_tps": 20480, "stream_interval": 32}


def stage(rate, p90, input_tps):
    return {"rate": rate, "ttft_p90_s": p90, "error_rate": 0.0, "ok": 100, "input_tps": input_tps,
            "output_tps": 0.0, "hit_ratio": 0.5, "max_token_share": 0.25}


def arm(knee_rate):
    """A ramp 1..4 req/s whose TTFT p90 crosses 2 s after `knee_rate`; input tok/s = 1000 x rate."""
    return {"stages": [stage(r, 0.5 if r <= knee_rate else 9.0, 1000.0 * r) for r in (1, 2, 3, 4)]}


def results(seeds, started, rates=(1, 2, 3, 4)):
    """One run of workload "w": seeds maps seed -> (round robin's knee, kvroute-default's knee)."""
    w = {"what": "w", "bound": "prefill", "time_scale": 10, "stage_s": 150, "rates": list(rates),
         "loadgen_extra": [], "target": None,
         "seeds": {str(s): {"round-robin": arm(rr), "kvroute-default": arm(kd)} for s, (rr, kd) in seeds.items()}}
    w["arms"] = w["seeds"][str(min(seeds))]
    return {"started": started, "commit": "`abc`", "command": f"run {started}", "wall_min": 1.0, "smoke": False,
            "fleet": FLEET, "slo_s": 2.0, "penalty_ms": 2000.0, "metrics_poll_ms": 100, "envoy_concurrency": 2,
            "workloads": {"w": w}}


def write(tmp_path, name, r):
    p = tmp_path / name
    p.write_text(json.dumps(r))
    return str(p)


def over_seeds(merged):
    w = merged["workloads"]["w"]
    quality.add_headlines(w, merged["slo_s"])
    return w["ratios_over_seeds"]["kvroute-default"]


def test_disjoint_seeds_of_one_scenario_are_pooled(tmp_path):
    a = write(tmp_path, "a.json", results({1: (1, 2), 2: (1, 2), 3: (1, 2)}, "A"))
    b = write(tmp_path, "b.json", results({4: (1, 4), 5: (1, 4), 6: (1, 4)}, "B"))
    merged = quality.merge_results([a, b])
    st = over_seeds(merged)
    assert sorted(st["by_seed"], key=int) == ["1", "2", "3", "4", "5", "6"]
    assert st["median"] == pytest.approx(3.0)  # (2 + 4) / 2 over six seeds
    assert st["worst"] == pytest.approx(2.0)
    runs = merged["workloads"]["w"]["seed_runs"]
    assert [(x["run"]["started"], x["seeds"]) for x in runs] == [("A", ["1", "2", "3"]), ("B", ["4", "5", "6"])]
    # the tables and plot stay the first run's first seed
    assert merged["workloads"]["w"]["arms"]["kvroute-default"] == arm(2)


def test_overlapping_seeds_replace_the_earlier_run(tmp_path):
    a = write(tmp_path, "a.json", results({1: (1, 2)}, "A"))
    b = write(tmp_path, "b.json", results({1: (1, 4)}, "B"))
    merged = quality.merge_results([a, b])
    st = over_seeds(merged)
    assert st["by_seed"] == {"1": pytest.approx(4.0)}
    assert merged["workloads"]["w"]["run"]["started"] == "B"
    assert "seed_runs" not in merged["workloads"]["w"]


def test_other_seeds_of_a_different_scenario_are_refused(tmp_path):
    a = write(tmp_path, "a.json", results({1: (1, 2)}, "A"))
    b = write(tmp_path, "b.json", results({2: (1, 2)}, "B", rates=(1, 2, 3, 4, 5)))
    with pytest.raises(ValueError, match="rates"):
        quality.merge_results([a, b])


def test_runs_of_another_fleet_are_refused(tmp_path):
    a = write(tmp_path, "a.json", results({1: (1, 2)}, "A"))
    other = results({2: (1, 2)}, "B")
    other["fleet"] = dict(FLEET, endpoints=8)
    b = write(tmp_path, "b.json", other)
    with pytest.raises(ValueError, match="fleet"):
        quality.merge_results([a, b])

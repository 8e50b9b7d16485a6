"""Unit tests of quality.py's results merging (`--from-results`): other seeds pooled, other arms added (and
arms re-run side by side replaced) over their own run's round robin, re-runs replacing, other scenarios
refused; the knee-rate table; and agreement.py handing the simulator the shipped profile Envoy ran. No processes,
no network.

    python3 -m pytest sim/bench/test_quality.py -q
"""

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import quality  # noqa: E402

FLEET = dict(quality.FLEET)


def stage(rate, p90, input_tps):
    return {"rate": rate, "ttft_p90_s": p90, "error_rate": 0.0, "ok": 100, "input_tps": input_tps,
            "output_tps": 0.0, "hit_ratio": 0.5, "max_token_share": 0.25}


def arm(knee_rate):
    """A ramp 1..4 req/s whose TTFT p90 crosses 2 s after `knee_rate`; input tok/s = 1000 x rate."""
    return {"stages": [stage(r, 0.5 if r <= knee_rate else 9.0, 1000.0 * r) for r in (1, 2, 3, 4)]}


def results(seeds, started, rates=(1, 2, 3, 4), name="kvroute-default"):
    """One run of workload "w": seeds maps seed -> (round robin's knee, the arm `name`'s knee)."""
    w = {"what": "w", "bound": "prefill", "time_scale": 10, "stage_s": 150, "rates": list(rates),
         "loadgen_extra": [], "target": None,
         "seeds": {str(s): {"round-robin": arm(rr), name: arm(kd)} for s, (rr, kd) in seeds.items()}}
    w["arms"] = w["seeds"][str(min(seeds))]
    return {"started": started, "commit": "`abc`", "command": f"run {started}", "wall_min": 1.0, "smoke": False,
            "fleet": FLEET, "slo_s": 2.0, "penalty_ms": 2000.0, "metrics_poll_ms": 100, "envoy_concurrency": 2,
            "workloads": {"w": w}}


def write(tmp_path, name, r):
    p = tmp_path / name
    p.write_text(json.dumps(r))
    return str(p)


def over_seeds(merged, name="kvroute-default"):
    w = merged["workloads"]["w"]
    quality.add_headlines(w, merged["slo_s"])
    return w["ratios_over_seeds"][name]


def test_disjoint_seeds_of_one_scenario_are_pooled(tmp_path):
    a = write(tmp_path, "a.json", results({1: (1, 2), 2: (1, 2), 3: (1, 2)}, "A"))
    b = write(tmp_path, "b.json", results({4: (1, 4), 5: (1, 4), 6: (1, 4)}, "B"))
    merged = quality.merge_results([a, b])
    st = over_seeds(merged)
    assert sorted(st["by_seed"], key=int) == ["1", "2", "3", "4", "5", "6"]
    assert st["median"] == pytest.approx(3.0)  # (2 + 4) / 2 over six seeds
    assert st["worst"] == pytest.approx(2.0)
    parts = merged["workloads"]["w"]["parts"]
    assert [(x["run"]["started"], x["seeds"], x["arms"]) for x in parts] == [("A", ["1", "2", "3"], None),
                                                                             ("B", ["4", "5", "6"], None)]
    # the tables and plot stay the first run's first seed
    assert merged["workloads"]["w"]["arms"]["kvroute-default"]["stages"] == arm(2)["stages"]


def test_overlapping_seeds_replace_the_earlier_run(tmp_path):
    a = write(tmp_path, "a.json", results({1: (1, 2)}, "A"))
    b = write(tmp_path, "b.json", results({1: (1, 4)}, "B"))
    merged = quality.merge_results([a, b])
    st = over_seeds(merged)
    assert st["by_seed"] == {"1": pytest.approx(4.0)}
    assert merged["workloads"]["w"]["run"]["started"] == "B"
    assert "parts" not in merged["workloads"]["w"]


def test_other_arms_of_the_same_seeds_are_added_over_their_own_round_robin(tmp_path):
    a = write(tmp_path, "a.json", results({1: (1, 2), 2: (2, 2)}, "A"))
    # the later run's round robin is slower in seed 1: smg's ratio must use it, not run A's
    b = write(tmp_path, "b.json", results({1: (2, 3), 2: (2, 3)}, "B", name="smg-cache-aware"))
    merged = quality.merge_results([a, b])
    assert over_seeds(merged, "smg-cache-aware")["by_seed"] == {"1": pytest.approx(1.5), "2": pytest.approx(1.5)}
    assert over_seeds(merged)["by_seed"] == {"1": pytest.approx(2.0), "2": pytest.approx(1.0)}
    w = merged["workloads"]["w"]
    assert w["ratios_vs_rr"] == {"kvroute-default": pytest.approx(2.0), "smg-cache-aware": pytest.approx(1.5)}
    assert set(w["arms"]) == {"round-robin", "kvroute-default", "smg-cache-aware"}
    assert w["parts"][1]["arms"] == ["smg-cache-aware"]


def test_an_arm_re_run_side_by_side_replaces_it_over_its_own_round_robin(tmp_path):
    # run A: kvroute-default; run B adds smg on its own round robin; run C re-runs kvroute-default beside
    # always-sticky on the same seeds: both divide by C's round robin, smg keeps B's, A's round robin stays
    a = write(tmp_path, "a.json", results({1: (1, 2), 2: (1, 2)}, "A"))
    b = write(tmp_path, "b.json", results({1: (2, 3), 2: (2, 3)}, "B", name="smg-cache-aware"))
    c = results({1: (2, 4), 2: (1, 3)}, "C")
    for s in c["workloads"]["w"]["seeds"].values():
        s["always-sticky"] = arm(3)
    c = write(tmp_path, "c.json", c)
    merged = quality.merge_results([a, b, c])
    assert over_seeds(merged)["by_seed"] == {"1": pytest.approx(2.0), "2": pytest.approx(3.0)}
    assert over_seeds(merged, "always-sticky")["by_seed"] == {"1": pytest.approx(1.5), "2": pytest.approx(3.0)}
    assert over_seeds(merged, "smg-cache-aware")["by_seed"] == {"1": pytest.approx(1.5), "2": pytest.approx(1.5)}
    w = merged["workloads"]["w"]
    assert w["seeds"]["1"]["round-robin"]["stages"] == arm(1)["stages"]
    assert [(x["run"]["started"], x["arms"], x.get("replaced")) for x in w["parts"]] == [
        ("A", None, None), ("B", ["smg-cache-aware"], None), ("C", ["always-sticky", "kvroute-default"],
                                                              ["kvroute-default"])]
    assert "kvroute-default replaces the earlier runs'" in quality.describe_part(w["parts"][2])


def test_other_arms_without_a_round_robin_are_refused(tmp_path):
    a = write(tmp_path, "a.json", results({1: (1, 2)}, "A"))
    other = results({1: (1, 3)}, "B", name="smg-cache-aware")
    del other["workloads"]["w"]["seeds"]["1"]["round-robin"]
    b = write(tmp_path, "b.json", other)
    with pytest.raises(ValueError, match="round robin"):
        quality.merge_results([a, b])


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


def test_a_ramp_ended_by_host_lag_is_marked(tmp_path):
    r = results({1: (1, 2), 2: (1, 2)}, "A")
    # seed 2's kvroute-default: the stage after its knee (3 req/s) ran on a host 2.5 s behind
    r["workloads"]["w"]["seeds"]["2"]["kvroute-default"]["stages"][2]["host_lag_s"] = 2.5
    # seed 1's: lag before the knee does not count
    r["workloads"]["w"]["seeds"]["1"]["kvroute-default"]["stages"][0]["host_lag_s"] = 9.0
    merged = quality.merge_results([write(tmp_path, "a.json", r)])
    assert over_seeds(merged)["host_limited"] == ["2"]


def test_a_render_sent_elsewhere_leaves_the_committed_results_and_plots_alone(tmp_path):
    committed = os.path.join(quality.HERE, "results", "quality.json")
    before = os.stat(committed).st_mtime_ns if os.path.exists(committed) else None
    out = tmp_path / "x.md"
    assert quality.main(["--from-results", write(tmp_path, "a.json", results({1: (1, 2)}, "A")),
                         "--out", str(out)]) == 0
    assert "Routing quality through Envoy" in out.read_text()
    assert (tmp_path / "img" / "quality-w.svg").exists()
    assert (os.stat(committed).st_mtime_ns if os.path.exists(committed) else None) == before


def test_merging_a_run_again_changes_nothing(tmp_path):
    a = write(tmp_path, "a.json", results({1: (1, 2)}, "A"))
    b = write(tmp_path, "b.json", results({2: (1, 4)}, "B"))
    merged = write(tmp_path, "m.json", quality.merge_results([a, b]))
    again = quality.merge_results([merged, b])
    assert sorted(again["workloads"]["w"]["seeds"]) == ["1", "2"]
    assert len(again["workloads"]["w"]["parts"]) == 2


def test_knee_rates_are_reported_seed_by_seed_with_their_median(tmp_path):
    # seeds 1-3: round robin's knee 1, 1, 2 req/s; kvroute-default's 2, 3, 3; seed 4 the default has none
    r = results({1: (1, 2), 2: (1, 3), 3: (2, 3), 4: (1, 0)}, "A")
    merged = quality.merge_results([write(tmp_path, "a.json", r)])
    w = merged["workloads"]["w"]
    quality.add_headlines(w, merged["slo_s"])
    kd, rr = w["knee_rates"]["kvroute-default"], w["knee_rates"]["round-robin"]
    assert kd["by_seed"] == {"1": 2, "2": 3, "3": 3, "4": 0.0}
    assert kd["median"] == pytest.approx(2.5)
    assert rr["median"] == pytest.approx(1.0)
    out = tmp_path / "x.md"
    assert quality.main(["--from-results", write(tmp_path, "m.json", merged), "--out", str(out)]) == 0
    assert "| w | 1, 1, 2, 1 · **1** | – | 2, 3, 3, 0 · **2.5** |" in out.read_text()


def test_agreement_gives_the_simulator_the_shipped_profile_envoy_ran(tmp_path):
    import agreement
    r = results({1: (1, 2)}, "A")
    w = r["workloads"]["w"]
    w["calibration"] = {"peak": 15230.0}
    assert agreement.router_args(r, w, "legacy-blend", str(tmp_path / "x")) == ["--arm", "legacy-blend"]
    flag, path = agreement.router_args(r, w, "kvroute-default", str(tmp_path / "x"))
    assert flag == "--config"
    doc = json.load(open(path))
    params = {p["type"]: p.get("parameters", {}) for p in doc["plugins"]}
    assert params["approx-prefix-cache-producer"]["blockSizeTokens"] == FLEET["block_size"]
    assert params["prefix-cache-affinity-filter"]["peakPrefillThroughput"] == 15230.0
    assert params["prefix-cache-affinity-filter"]["maxTTFTPenaltyMs"] == r["penalty_ms"]
    assert doc["schedulingProfiles"], "the shipped profile's scheduling profiles"


def test_the_filters_counters_must_account_for_every_request():
    s = {"label": "rate 3/s", "requests": 10,
         "router": {"routed": 9, "fail_open": 1, "branch_sticky": 6, "branch_saturation_release": 2,
                    "branch_no_affinity": 1}}
    assert quality.router_count_problems(s) == []
    # a decision the stage's counters missed, and a routed request on no branch
    s["router"]["routed"] = 8
    assert quality.router_count_problems(s) == ["stage rate 3/s: the filter decided 9 of 10 requests",
                                                "stage rate 3/s: 9 branch counts for 8 routed"]
    # not read (smg, older results) or no filter (plain Envoy): nothing to check
    for c in (None, {}):
        assert quality.router_count_problems(dict(s, router=c)) == []


def test_the_knee_table_gives_the_knee_stages_branches_else_the_whole_runs():
    res = arm(2)
    res["envoy_stats"] = {"branch_sticky": 50, "branch_saturation_release": 7, "branch_no_affinity": 3}
    k = quality.knee(res["stages"], 2.0, "prefill")
    assert quality.branches_cell("kvroute-default", res, k) == "50 / 7 / 3\\*"
    res["stages"][1]["router"] = {"routed": 20, "branch_sticky": 17, "branch_saturation_release": 2,
                                  "branch_no_affinity": 1}
    assert quality.branches_cell("kvroute-default", res, k) == "17 / 2 / 1"
    assert quality.branches_cell("legacy-blend", res, k) == "–"


def test_arms_are_one_file_with_quality_names_and_every_placeholder_filled():
    """arms.json defines every arm quality.py runs through kvroute (kvroute-simulate --arm reads the same file);
    plugin_config fills every placeholder, keeps the shipped profile's own plugins for kvroute-default, and
    gives None for round robin."""
    import kvbench
    _, by_name = kvbench.arms()
    assert quality.KVROUTE_ARMS <= set(by_name), quality.KVROUTE_ARMS - set(by_name)
    assert quality.plugin_config is kvbench.plugin_config and quality.knee is kvbench.knee
    assert kvbench.plugin_config("round-robin", 1000, 2000, 100) is None
    for name in quality.KVROUTE_ARMS:
        doc = kvbench.plugin_config(name, 12345, 2500, 250)
        text = json.dumps(doc)
        assert '"{' not in text, (name, text)
        assert doc["collector"]["metricsPollIntervalMs"] == 250 and doc["routing"]["statePath"] == "/kvroute/state"
    kd = kvbench.plugin_config("kvroute-default", 12345, 2500, 250)
    with open(os.path.join(kvbench.REPO, "envoy", "kvroute-config.json")) as f:
        shipped = json.load(f)
    assert kd["schedulingProfiles"] == shipped["schedulingProfiles"]
    assert [p["type"] for p in kd["plugins"]] == [p["type"] for p in shipped["plugins"]]
    gate = next(p for p in kd["plugins"] if p["type"] == "prefix-cache-affinity-filter")["parameters"]
    assert (gate["peakPrefillThroughput"], gate["maxTTFTPenaltyMs"]) == (12345, 2500)
    producer = next(p for p in kd["plugins"] if p["type"] == "approx-prefix-cache-producer")["parameters"]
    assert producer["blockSizeTokens"] == FLEET["block_size"]
    with pytest.raises(ValueError):
        kvbench.plugin_config("no-such-arm", 1, 2, 3)

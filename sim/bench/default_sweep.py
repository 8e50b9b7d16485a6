#!/usr/bin/env python3
"""Every arm on every workload of quality.py, several seeds, in the fleet
simulator (kvroute-simulate): knee throughput over round robin's, median and
worst seed. A benchmark, not a test: it prints figures and never fails on them.

    python3 sim/bench/default_sweep.py [--sim PATH] [--seeds 1,2,3] [--arms a,b] [--workloads w,x] [--segments]
                                       [--rates 1,2,3] [--peaks-from sim/bench/results/quality.json]
                                       [--sim-args "--proxies 4 --proxy-assign random --mesh-exchange"]

The fleet, workloads, ramps, SLO and knee rule are quality.py's own (imported
from it). `kvroute-default` is the shipped plugin JSON (envoy/kvroute-config.json)
with the fleet's block size and the calibrated peak, as quality.py's arm of
the same name; the other arms are kvroute-simulate's --arm (quality.py's arms).

The peak is the modelled fleet's own (`sim_peak`) unless --peaks-from names a
quality.py results file: through Envoy the calibration also measures HTTP and
the emulators' host, so its peak is lower (14,780-16,165 tok/s on five workloads,
11,942 on reasoning, against the model's 18,204), and a gate whose tau is peak x maxTTFTPenaltyMs
releases at a smaller token gap there. Both are worth a run: the modelled
peak is the fleet's, the calibrated one is what the arms had in the Envoy
figures (docs/lab/2026-12-06-gate-own-prefill.md).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
import kvbench  # noqa: E402  (sim/bench/kvbench.py)

ARMS = ["round-robin", "kvroute", "kvroute-default", "always-sticky", "legacy-blend", "active-request"]


def stage_rows(report, rates):
    rows = []
    for s, rate in zip(report["stages"], rates):
        shares = [e["request_share"] for e in s.get("endpoints", [])]
        rows.append({"rate": rate, "ttft_p90_s": s["ttft_s"]["p90"] if s["ok"] else None,
                     "error_rate": s["error_rate"], "ok": s["ok"],
                     "input_tps": s["input_tokens_per_s"], "output_tps": s["output_tokens_per_s"],
                     "hit_ratio": s["hit_ratio"], "max_token_share": max(shares) if shares else 0,
                     "hit_ratio_ceiling": s.get("hit_ratio_ceiling"),
                     "hit_over_ceiling": (s["hit_ratio"] / s["hit_ratio_ceiling"]
                                          if s["hit_ratio"] is not None and s.get("hit_ratio_ceiling") else None),
                     # the gate's releases and the routed requests of the stage (None for round robin)
                     "saturation_releases": (s.get("router_counters") or {}).get("kvroute_branch_saturation_release"),
                     "routed": (s.get("router_counters") or {}).get("kvroute_routed")})
    return rows


def sim_peak():
    """The fleet's prefill rate as quality.py measures it (B / median TTFT of
    cold B-token prompts): with the emulator's attention term, the peak times
    B / (B + B(B+1)/2 / C) (sim/model/src/vllm_model/step_cost.rs)."""
    b, c = kvbench.FLEET["max_num_batched_tokens"], 32768.0
    return round(float(kvbench.FLEET["prefill_tps"]) * b / (b + b * (b + 1) / 2 / c))


def fleet_args(endpoints):
    """kvroute-simulate's server flags for quality.py's fleet of `endpoints` servers."""
    return ["--endpoints", str(endpoints),
            "--num-gpu-blocks", str(kvbench.FLEET["num_gpu_blocks"]),
            "--block-size", str(kvbench.FLEET["block_size"]),
            "--max-num-batched-tokens", str(kvbench.FLEET["max_num_batched_tokens"]),
            "--prefill-tps", str(kvbench.FLEET["prefill_tps"])]


def router_args(arm, peak, work):
    """kvroute-simulate's router flags for a quality.py arm: the simulator's
    --arm, which reads the same arms.json as kvbench.plugin_config (the
    document for kvroute-default too: the shipped profile with the fleet's
    block size, --peak and --tau). `peak` and `work` are kept for callers."""
    return ["--arm", arm, "--tau", "2000"]


def run(sim, wname, w, arm, seed, peak, work, slo_s, stop_factor, exact=True, extra=()):
    rates = w["rates"]
    stages = "rate:" + ",".join(f"{r:g}" for r in rates) + f"@{w['stage_s']}s"
    out = os.path.join(work, f"{wname}-{arm}-{seed}.json")
    cmd = [sim, "--workload", w.get("workload", wname), *w["loadgen"], "--stages", stages,
           "--seed", str(seed), "--time-scale", str(w["time_scale"]),
           *fleet_args(kvbench.FLEET["endpoints"]),
           "--peak", f"{peak:g}", "--stop-after-ttft-p90", f"{slo_s * stop_factor:g}", "--json", out]
    if exact:
        # Text bodies: the router parses and estimates them as in Envoy, the
        # modelled server tokenizes them (the segments form gives the router
        # exact token counts, which flatters fixed-estimate arms).
        cmd.append("--exact-prompts")
    cmd += (router_args(arm, peak, work) if "--config" not in extra else []) + list(extra)
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    with open(out) as f:
        rep = json.load(f)
    rows = stage_rows(rep, rates)
    k = kvbench.knee(rows, slo_s, w["bound"])
    if k:
        # the stages up to the knee: the lowest share of the ceiling the arm reached there
        within = [r["hit_over_ceiling"] for r in rows if r["rate"] <= k["rate"] and r["hit_over_ceiling"] is not None]
        k["min_hit_over_ceiling"] = min(within) if within else None
        # every stage's gate releases / routed requests (the simulator counts the filter's branches)
        k["releases_by_stage"] = [[r["rate"], r["saturation_releases"], r["routed"]] for r in rows
                                  if r["routed"] is not None]
    return k, rows


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sim", default=os.path.join(REPO, "target", "release", "kvroute-simulate"))
    p.add_argument("--seeds", default="1,2,3")
    p.add_argument("--arms", default=",".join(ARMS))
    p.add_argument("--workloads", default=",".join(kvbench.WORKLOADS))
    p.add_argument("--slo-s", type=float, default=2.0)
    p.add_argument("--json", default=None, help="write every knee here")
    p.add_argument("--segments", action="store_true",
                   help="segment prompts (exact token counts for the router) instead of text bodies")
    p.add_argument("--peaks-from", default=None, metavar="RESULTS_JSON",
                   help="each workload's peakPrefillThroughput from the calibration of a quality.py results file "
                        "(e.g. sim/bench/results/quality.json) instead of the modelled fleet's: the peak the arms "
                        "had through Envoy, where HTTP and the emulator's host add to the measured TTFT")
    p.add_argument("--rates", default=None,
                   help="the ramp's offered rates (req/s, comma list) for every workload run, instead of "
                        "quality.py's; for a finer grid around a knee")
    p.add_argument("--sim-args", default="",
                   help="more kvroute-simulate flags for every run, e.g. \"--proxies 4 --proxy-assign random "
                        "--mesh-exchange\" (issue 43's knees with G proxies)")
    a = p.parse_args()
    seeds = [int(s) for s in a.seeds.split(",")]
    arms = a.arms.split(",")
    work = tempfile.mkdtemp(prefix="kvroute-sweep.")
    peaks = {}
    if a.peaks_from:
        with open(a.peaks_from) as f:
            for wname, w in json.load(f)["workloads"].items():
                if (w.get("calibration") or {}).get("peak"):
                    peaks[wname] = float(w["calibration"]["peak"])
    results = {}
    for wname in a.workloads.split(","):
        peak = peaks.get(wname, sim_peak())
        print(f"{wname}: peakPrefillThroughput {peak:g} tok/s"
              f"{' (calibrated through Envoy)' if wname in peaks else ''}", file=sys.stderr)
        w = dict(kvbench.WORKLOADS[wname])
        if a.rates:
            w["rates"] = [float(x) for x in a.rates.split(",")]
        results[wname] = {}
        for arm in arms:
            results[wname][arm] = {}
            for seed in seeds:
                k, _ = run(a.sim, wname, w, arm, seed, peak, work, a.slo_s, 4.0, exact=not a.segments,
                           extra=a.sim_args.split())
                results[wname][arm][seed] = k
    print("Knee throughput over round robin's (same seed), median [worst] of seeds " + a.seeds + ":\n")
    print("| workload | " + " | ".join(x for x in arms if x != "round-robin") + " |")
    print("|---|" + "---|" * (len(arms) - 1))
    for wname, per_arm in results.items():
        cells = []
        for arm in arms:
            if arm == "round-robin":
                continue
            ratios = []
            for seed in seeds:
                rr = per_arm.get("round-robin", {}).get(seed)
                k = per_arm[arm][seed]
                if rr and rr["throughput"] > 0:
                    ratios.append((k["throughput"] if k else 0.0) / rr["throughput"])
            cells.append(f"{statistics.median(ratios):.2f} [{min(ratios):.2f}]" if ratios else "–")
        print(f"| {wname} | " + " | ".join(cells) + " |")
    print("\nHit ratio at the knee, median of seeds:\n")
    print("| workload | " + " | ".join(arms) + " |")
    print("|---|" + "---|" * len(arms))
    for wname, per_arm in results.items():
        cells = []
        for arm in arms:
            h = [k["hit_ratio"] for k in per_arm[arm].values() if k]
            cells.append(f"{statistics.median(h):.2f}" if h else "–")
        print(f"| {wname} | " + " | ".join(cells) + " |")
    print("\nHit ratio ÷ the stream's ceiling at the knee, median [worst] of seeds (and the worst stage up to "
          "the knee, worst seed):\n")
    print("| workload | " + " | ".join(arms) + " |")
    print("|---|" + "---|" * len(arms))
    for wname, per_arm in results.items():
        cells = []
        for arm in arms:
            h = [k["hit_over_ceiling"] for k in per_arm[arm].values() if k and k.get("hit_over_ceiling") is not None]
            m = [k["min_hit_over_ceiling"] for k in per_arm[arm].values()
                 if k and k.get("min_hit_over_ceiling") is not None]
            cells.append(f"{statistics.median(h):.3f} [{min(h):.3f}] ({min(m):.3f})" if h else "–")
        print(f"| {wname} | " + " | ".join(cells) + " |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()

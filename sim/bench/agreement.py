#!/usr/bin/env python3
"""Simulator vs Envoy: the same scenario through kvroute-simulate and through
the emulated fleet behind real Envoy (a quality.py run), stage by stage.

    python3 sim/bench/quality.py --workloads shared-prefix --arms round-robin,kvroute-default,legacy-blend \\
        --rates 1,2,3,4,5,6,7,8 --seeds 1 --out /tmp/q.md --img-dir /tmp/img --results /tmp/quality.json
    python3 sim/bench/agreement.py /tmp/quality.json            # Markdown table on stdout

For every workload and arm of the results it runs kvroute-simulate with the
run's own parameters: fleet, stages (rates x stage length, model time), time
scale, stream interval, the calibrated peakPrefillThroughput, maxTTFTPenaltyMs,
the collector's poll period, the seed, Envoy's worker count, the workload
flags, the ramp's stop rule, and --exact-prompts (the same request bodies, through the filter's
parse path). The shipped profile (kvroute-default, not a simulator arm) gets
the plugin JSON quality.py gave Envoy. Then it puts hit ratio and input
throughput side by side, for every seed the run holds (`--seeds 1` for its
first only). Only the standard library is used.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
import kvbench  # noqa: E402  (sim/bench/kvbench.py)


def router_args(results, w, arm, out):
    """`--arm NAME`, or for the shipped profile (not a simulator arm) the plugin JSON quality.py gave
    Envoy: envoy/kvroute-config.json with the fleet's block size and the run's peak and τ."""
    if arm != "kvroute-default":
        return ["--arm", arm]
    path = out + ".config.json"
    with open(path, "w") as f:
        json.dump(kvbench.plugin_config(arm, w["calibration"]["peak"], results["penalty_ms"],
                                        results["metrics_poll_ms"]), f)
    return ["--config", path]


def simulate(binary, results, wname, w, arm, seed, out):
    f = results["fleet"]
    rates = ",".join(f"{r:g}" for r in w["rates"])
    argv = [binary, "--workload", w.get("workload", wname.replace("-skew", "")), *router_args(results, w, arm, out),
            "--stages", f"rate:{rates}@{w['stage_s']}s", "--exact-prompts",
            "--endpoints", str(f["endpoints"]), "--num-gpu-blocks", str(f["num_gpu_blocks"]),
            "--block-size", str(f["block_size"]), "--max-num-batched-tokens", str(f["max_num_batched_tokens"]),
            "--prefill-tps", str(f["prefill_tps"]), "--stream-interval", str(f["stream_interval"]),
            "--time-scale", str(w["time_scale"]), "--peak", str(w["calibration"]["peak"]),
            "--tau", str(results["penalty_ms"]), "--metrics-poll-ms", str(results["metrics_poll_ms"]),
            "--seed", str(seed),
            "--stop-after-ttft-p90", str(results["slo_s"] * results.get("stop_factor", 4.0)),
            "--envoy-workers", str(results.get("envoy_concurrency", 1)), *w["loadgen_extra"]]
    subprocess.run(argv + ["--json", out], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return json.load(open(out)), " ".join([os.path.relpath(binary, REPO)] + argv[1:])


def rel(a, b):
    return None if a is None or b is None or b == 0 else (a - b) / b


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("results", help="results.json of a quality.py run")
    p.add_argument("--binary", default=os.path.join(REPO, "target", "release", "kvroute-simulate"))
    p.add_argument("--tolerance", type=float, default=0.10, help="relative difference called agreement [0.10]")
    p.add_argument("--seeds", default=None, help="comma list of the run's seeds to simulate (default: all it holds)")
    a = p.parse_args()
    results = json.load(open(a.results))
    work = tempfile.mkdtemp(prefix="kvroute-agreement.")
    rows, commands, worst = [], [], 0.0
    want = None if a.seeds is None else {s.strip() for s in a.seeds.split(",")}
    runs = []  # (workload, its entry, seed, arm, that arm's result)
    for wname, w in results["workloads"].items():
        # A multi-seed run keeps each seed's arms under "seeds"; a one-seed run only "arms".
        for seed, arms in (w.get("seeds") or {str(results["seed"]): w["arms"]}).items():
            if want is None or seed in want:
                runs += [(wname, w, seed, arm, res) for arm, res in arms.items()
                         if "stages" in res and arm != "smg-cache-aware"]
    for wname, w, seed, arm, res in runs:
        sim, cmd = simulate(a.binary, results, wname, w, arm, seed,
                            os.path.join(work, f"{wname}.{arm}.seed{seed}.json"))
        commands.append(cmd)
        for env_st, sim_st in zip(res["stages"], sim["stages"]):
            dh = rel(sim_st["hit_ratio"], env_st["hit_ratio"])
            dt = rel(sim_st["input_tokens_per_s"], env_st["input_tps"])
            worst = max(worst, abs(dh or 0), abs(dt or 0))
            ok = dh is not None and dt is not None and abs(dh) <= a.tolerance and abs(dt) <= a.tolerance
            rows.append(f"| {wname} | {arm} | {seed} | {env_st['rate']:g} | {env_st['hit_ratio'] * 100:.1f} | "
                        f"{sim_st['hit_ratio'] * 100:.1f} | {dh * 100:+.1f} % | {env_st['input_tps']:.0f} | "
                        f"{sim_st['input_tokens_per_s']:.0f} | {dt * 100:+.1f} % | "
                        f"{env_st['ttft_p90_s'] * 1000:.0f} / {sim_st['ttft_s']['p90'] * 1000:.0f} | "
                        f"{'yes' if ok else '**no**'} |")
    print(f"Envoy run: {results['started']} (commit {results.get('commit')}), `{results['command']}`.\n")
    print("| workload | arm | seed | rate (req/s) | hit % Envoy | hit % sim | Δ | input tok/s Envoy | input tok/s sim | Δ | "
          "TTFT p90 ms Envoy / sim | within 10 % |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    print("\nSimulator commands:\n\n```sh\n" + "\n".join(commands) + "\n```")
    print(f"\n(largest relative difference {worst * 100:.1f} %)", file=sys.stderr)


if __name__ == "__main__":
    main()

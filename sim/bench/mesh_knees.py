#!/usr/bin/env python3
"""Knee throughput with G proxies (issue 43), in the fleet simulator: does a
mesh of G proxies, each with its own shared data, exchanging decisions and
in-flight load through the relays, sustain the load one gateway sustains? A
benchmark, not a test: it prints figures and never fails on them.

    python3 sim/bench/mesh_knees.py [--sim PATH] [--seeds 1,2,3] [--proxies 1,2,4,8] [--exchange-ms MS]
                                    [--shapes random,rotate] [--workloads a,b] [--json OUT] [--md OUT]

Each cell is default_sweep.py's knee run (quality.py's fleet, workloads, rate
ramps, SLO and knee rule; the shipped profile, `--arm kvroute-default`) with
`--proxies G --proxy-assign SHAPE --mesh-exchange` (G > 1). Reported per
workload, shape and G: the knee throughput over G = 1's for the same seed,
median [worst], and the hit ratio over the stream's ceiling at the knee.
"""

import argparse
import os
import statistics
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
import default_sweep  # noqa: E402
import kvbench  # noqa: E402
import mesh_sweep  # noqa: E402  (report)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sim", default=os.path.join(REPO, "target", "release", "kvroute-simulate"))
    ap.add_argument("--seeds", default="1,2,3")
    ap.add_argument("--proxies", default="1,2,4,8")
    ap.add_argument("--shapes", default="random,rotate")
    ap.add_argument("--workloads", default=",".join(kvbench.WORKLOADS))
    ap.add_argument("--slo-s", type=float, default=2.0)
    ap.add_argument("--exchange-ms", type=int, default=0,
                    help="router-clock ms between a proxy's exchanges [0: the metrics poll, 100 ms = 1 s of "
                         "model time at the workloads' time scale 10; 25 = the shipped kvEvents.pollMs, 250 ms, "
                         "on real hardware]")
    ap.add_argument("--json")
    ap.add_argument("--md")
    a = ap.parse_args()
    seeds = [int(x) for x in a.seeds.split(",")]
    gs = [int(x) for x in a.proxies.split(",")]
    shapes = a.shapes.split(",")
    peak = default_sweep.sim_peak()
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvroute-mesh-knees-") as work:
        for wname in a.workloads.split(","):
            w = dict(kvbench.WORKLOADS[wname])

            def knee(g, shape, seed):
                extra = [] if g == 1 else ["--proxies", str(g), "--proxy-assign", shape, "--mesh-exchange",
                                           "--exchange-ms", str(a.exchange_ms)]
                cell = os.path.join(work, f"{shape}-{g}")
                os.makedirs(cell, exist_ok=True)
                k, _ = default_sweep.run(a.sim, wname, w, "kvroute-default", seed, peak, cell, a.slo_s, 4.0,
                                         extra=extra)
                return k

            base = {s: knee(1, "one", s) for s in seeds}
            for shape, g in [("one gateway", 1)] + [(sh, g) for sh in shapes for g in gs if g > 1]:
                res = base if g == 1 else {s: knee(g, shape, s) for s in seeds}
                ratio = [(res[s]["throughput"] if res[s] else 0.0) / base[s]["throughput"]
                         for s in seeds if base[s] and base[s]["throughput"] > 0]
                share = [res[s]["hit_over_ceiling"] for s in seeds
                         if res[s] and res[s].get("hit_over_ceiling") is not None]
                row = {"workload": wname, "shape": shape, "proxies": g,
                       "knee_vs_one_median": statistics.median(ratio) if ratio else None,
                       "knee_vs_one_worst": min(ratio) if ratio else None,
                       "share_median": statistics.median(share) if share else None,
                       "share_worst": min(share) if share else None, "seeds": res}
                rows.append(row)
                print(f"{wname:20} {row['shape']:11} G={g:2} knee vs G=1 "
                      f"{fmt(row['knee_vs_one_median'])} [{fmt(row['knee_vs_one_worst'])}] "
                      f"hit/ceiling {fmt(row['share_median'])} [{fmt(row['share_worst'])}]", flush=True)
    md = ["| workload | shape | proxies | knee ÷ G = 1 (same seed) | hit ratio ÷ ceiling at the knee |",
          "|---|---|---|---|---|"]
    for r in rows:
        md.append(f"| {r['workload']} | {r['shape']} | {r['proxies']} | "
                  f"{fmt(r['knee_vs_one_median'])} [{fmt(r['knee_vs_one_worst'])}] | "
                  f"{fmt(r['share_median'])} [{fmt(r['share_worst'])}] |")
    mesh_sweep.report(md, rows, a)


def fmt(v):
    return "–" if v is None else f"{v:.3f}"


if __name__ == "__main__":
    main()

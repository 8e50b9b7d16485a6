#!/usr/bin/env python3
"""Several proxies in front of one fleet (issue 43), in the fleet simulator:
does a mesh of G proxies, each with its own shared data, keep the cache and
throughput of one gateway? A benchmark, not a test: it prints figures and
never fails on them.

    python3 sim/bench/mesh_sweep.py [--sim PATH] [--seeds 1,2,3] [--proxies 1,2,4,8,16,64]
                                    [--json OUT] [--md OUT]

kvroute-simulate models each proxy with its own store, collector and two
workers (`--proxies G`); with `--mesh-exchange` every proxy posts its
accepted decisions and in-flight sums to each server's exchange (the relay
beside it, modelled) every metrics poll and takes the others' (engine `mesh`).
Shapes (`--proxy-assign`): rotate (turn k of conversation c through proxy
(c + k) mod G: each turn through another proxy than the last, the worst case
for a proxy's own view), random (a load balancer in front of replicas) and
client (each closed-loop client through its own proxy: sidecars; 16 clients
on one system prompt).

Cells: the shipped profile (`--arm kvroute-default`) on agent-session (the
simulator's defaults: 4 servers, sessions behind one system prompt) at 16 in
flight for 60 s, and at Poisson 1.5 then 2.2 req/s for 60 s each (the last
stage reported); per cell the share of the stream's hit-ratio ceiling and
input tok/s, median [worst] of seeds, and the worst seed's throughput over
G = 1's for the same seed.
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

LOADS = {
    "conc 16": "concurrency:16@60s",
    "rate 2.2/s": "rate:1.5@60s;rate:2.2@60s",
}
SHAPES = ["rotate", "random", "client"]


def run(sim, work, load, shape, g, exchange, seed):
    out = os.path.join(work, f"{load}-{shape}-{g}-{int(exchange)}-{seed}.json".replace(" ", "_").replace("/", ""))
    cmd = [sim, "--workload", "agent-session", "--arm", "kvroute-default", "--stages", LOADS[load],
           "--envoy-workers", "2", "--seed", str(seed), "--proxies", str(g), "--proxy-assign", shape,
           "--json", out] + (["--mesh-exchange"] if exchange else [])
    p = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if p.returncode != 0:
        sys.exit(f"mesh_sweep.py: {' '.join(cmd)}\n{p.stderr}")
    with open(out) as f:
        s = json.load(f)["stages"][-1]
    return {"share": s["hit_ratio"] / s["hit_ratio_ceiling"], "tput": s["input_tokens_per_s"],
            "ttft_p90": s["ttft_s"].get("p90")}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sim", default=os.path.join(REPO, "target", "release", "kvroute-simulate"))
    ap.add_argument("--seeds", default="1,2,3")
    ap.add_argument("--proxies", default="1,2,4,8,16,64")
    ap.add_argument("--json")
    ap.add_argument("--md")
    a = ap.parse_args()
    seeds = [int(x) for x in a.seeds.split(",")]
    gs = [int(x) for x in a.proxies.split(",")]
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvroute-mesh-") as work:
        for load in LOADS:
            base = {s: run(a.sim, work, load, "rotate", 1, False, s) for s in seeds}
            for shape in SHAPES:
                for g in gs:
                    for exchange in ([False] if g == 1 else [False, True]):
                        if g == 1 and shape != "rotate":
                            continue
                        res = {s: (base[s] if g == 1 else run(a.sim, work, load, shape, g, exchange, s)) for s in seeds}
                        share = [r["share"] for r in res.values()]
                        tput = [r["tput"] for r in res.values()]
                        ratio = [res[s]["tput"] / base[s]["tput"] for s in seeds]
                        row = {"load": load, "shape": shape if g > 1 else "one gateway", "proxies": g,
                               "exchange": exchange, "share_median": statistics.median(share),
                               "share_worst": min(share), "tput_median": statistics.median(tput),
                               "tput_worst": min(tput), "tput_vs_one_worst": min(ratio),
                               "tput_vs_one_median": statistics.median(ratio), "seeds": res}
                        rows.append(row)
                        print(f"{load:10} {row['shape']:11} G={g:3} exchange={'on ' if exchange else 'off'} "
                              f"share {row['share_median']:.3f} [{row['share_worst']:.3f}] "
                              f"tok/s {row['tput_median']:.0f} [{row['tput_worst']:.0f}] "
                              f"vs G=1 {row['tput_vs_one_median']:.3f} [{row['tput_vs_one_worst']:.3f}]",
                              flush=True)
    md = ["| load | shape | proxies | exchange | share of the hit-ratio ceiling | input tok/s | ÷ G = 1 (same seed) |",
          "|---|---|---|---|---|---|---|"]
    for r in rows:
        md.append(f"| {r['load']} | {r['shape']} | {r['proxies']} | {'on' if r['exchange'] else 'off'} | "
                  f"{r['share_median']:.3f} [{r['share_worst']:.3f}] | {r['tput_median']:,.0f} [{r['tput_worst']:,.0f}] | "
                  f"{r['tput_vs_one_median']:.3f} [{r['tput_vs_one_worst']:.3f}] |")
    report(md, rows, a)


def report(md_lines, rows, a):
    """Prints the table (median [worst] of a.seeds) and writes it to a.md,
    the rows to a.json, when given."""
    text = "\n".join(md_lines) + "\n\nmedian [worst] of seeds " + a.seeds + "\n"
    print(text)
    if a.md:
        with open(a.md, "w") as f:
            f.write(text)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()

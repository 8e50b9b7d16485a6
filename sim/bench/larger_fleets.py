#!/usr/bin/env python3
"""quality.py's workloads on a larger fleet, in the fleet simulator: does an
arm keep its 4-server behaviour when servers, sessions and load all grow by
the same factor? A benchmark, not a test: it prints figures, never fails on them.

    python3 sim/bench/larger_fleets.py [--sim PATH] [--fleets 4,32] [--arms a,b]
                                       [--workloads w,x] [--seed 1] [--json OUT]

Each cell is one kvroute-simulate run: the workload's groups (sessions,
conversations, documents per round) times servers ÷ 4, one 300 s stage (model
time) at servers ÷ 4 times RATES' rate, near the 4-server knee of the shipped
profile (skew keeps its 2 hot groups: fewer hot prefixes than servers is the
point). Text bodies (`--exact-prompts`), quality.py's server model and calibrated
peak; `kvroute-default` is the shipped plugin JSON as quality.py runs it.
Reported per cell: TTFT p90, input tok/s, hit ratio ÷ the stream's ceiling,
and the busiest server's share of the prompt tokens.
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
import default_sweep  # noqa: E402
import kvbench  # noqa: E402  (sim/bench/kvbench.py)

# workload -> (kvroute-simulate workload, groups on 4 servers or None to keep, req/s on 4 servers)
RATES = {
    "shared-prefix": ("shared-prefix", 75, 5),
    "shared-prefix-skew": ("shared-prefix", None, 8),
    "code-generation": ("code-generation", 16, 3),
    "bursty-cold-start": ("bursty-cold-start", 24, 16),
    "agent-session": ("agent-session", 32, 4),
}
ARMS = ["round-robin", "kvroute", "legacy-blend", "kvroute-default"]


def cell(sim, work, wname, arm, servers, seed):
    sim_workload, groups, rate = RATES[wname]
    m = servers / 4
    peak = default_sweep.sim_peak()
    cmd = [sim, "--workload", sim_workload, "--stages", f"rate:{rate * m:g}@300s",
           *default_sweep.fleet_args(servers), "--seed", str(seed), "--exact-prompts",
           "--peak", str(peak), "--time-scale", "10"]
    loadgen = list(kvbench.WORKLOADS[wname]["loadgen"])
    if groups is not None:
        loadgen = [a for i, a in enumerate(loadgen) if a != "--groups" and (i == 0 or loadgen[i - 1] != "--groups")]
        loadgen += ["--groups", str(int(groups * m))]
    cmd += loadgen
    cmd += default_sweep.router_args(arm, peak, work)
    out = os.path.join(work, f"{wname}-{servers}-{arm}.json")
    p = subprocess.run(cmd + ["--json", out], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if p.returncode != 0:
        sys.exit(f"larger_fleets.py: {' '.join(cmd)}\n{p.stderr}")
    with open(out) as f:
        s = json.load(f)["stages"][0]
    queries = [e["prefix_cache_queries"] for e in s["endpoints"]]
    ceiling = s.get("hit_ratio_ceiling")
    return {"workload": wname, "servers": servers, "rate": rate * m, "arm": arm,
            "ttft_p90_s": s["ttft_s"]["p90"], "input_tps": s["input_tokens_per_s"],
            "error_rate": s["error_rate"],
            "hit_over_ceiling": s["hit_ratio"] / ceiling if ceiling else None,
            "busiest_share": max(queries) / sum(queries) if sum(queries) else None}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sim", default=os.path.join(REPO, "target", "release", "kvroute-simulate"))
    ap.add_argument("--fleets", default="4,32")
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--workloads", default=",".join(RATES))
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json")
    a = ap.parse_args()
    if not os.path.exists(a.sim):
        subprocess.run(["cargo", "build", "--release", "-p", "kvroute-sim", "--bin", "kvroute-simulate"],
                       cwd=REPO, check=True)
    rows = []
    print("| workload | servers | req/s | arm | TTFT p90 s | input tok/s | errors | hit ÷ ceiling | busiest share |")
    print("|---|---:|---:|---|---:|---:|---:|---:|---:|")
    with tempfile.TemporaryDirectory() as work:
        for wname in a.workloads.split(","):
            for servers in (int(x) for x in a.fleets.split(",")):
                for arm in a.arms.split(","):
                    r = cell(a.sim, work, wname, arm, servers, a.seed)
                    rows.append(r)
                    hc = "–" if r["hit_over_ceiling"] is None else f"{r['hit_over_ceiling']:.3f}"
                    print(f"| {wname} | {servers} | {r['rate']:g} | {arm} | {r['ttft_p90_s']:.2f} | "
                          f"{r['input_tps']:,.0f} | {r['error_rate']:.3f} | {hc} | {r['busiest_share']:.3f} |",
                          flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Chosen workload cells through real Envoy: the shipped profile beside the
other arms, side by side on one emulated fleet, several seeds (issue 41).
A benchmark, not a test: it prints figures and never fails on them.

    python3 sim/bench/envoy_cells.py                         # the demo's workload, 3 seeds
    python3 sim/bench/envoy_cells.py --cells demo,FILE.json  # plus the cells a JSON file lists
    python3 sim/bench/envoy_cells.py --quick                 # a few seconds per arm (smoke)

A cell is one emulated fleet and one load stage: {"name", "endpoints",
"num_gpu_blocks", "stage" (kvroute-loadgen's --stages grammar; the last stage
is measured, any earlier one warms the caches),
"time_scale", "loadgen": [kvroute-loadgen workload flags]}. The built-in
`demo` cell is `scripts/demo.sh`'s run: four servers of 2,400 16-token KV
blocks, 16 groups of 6,000-token system prompts, completions, 32 output
tokens, 8 in flight, 30 s, time scale 1.

Arms (each a fresh Envoy with `--concurrency 2`, its own plugin JSON, the
same fleet; the emulators' caches and counters are reset before each run):

  kvroute-default         envoy/kvroute-config.json as shipped (64-token blocks,
                          peakPrefillThroughput as shipped)
  kvroute-default-before  the same with countUnresolvedBlocks false (the profile
                          before d71b156)
  kvroute                 llm-d's matched configuration (quality.py's arm: affinity
                          filter + token-load scorer, 16-token blocks), with the
                          shipped file's peak
  legacy-blend            quality.py's arm, same peak
  round-robin             Envoy without kvroute

Every figure is the run's own: the servers' prefix-cache counters (hit ratio),
the stream's ceiling (kvroute-loadgen --ceiling-block-size 16: what one infinite
cache could have served) and the share of it each arm kept, input tokens/s and
TTFT p90 (model time). The summary gives the median of seeds and the shipped
profile over the best other arm.

Only the Python standard library. Everything runs on 127.0.0.1 and every
process started here is stopped here (by PID).
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
import quality  # noqa: E402  (plugin_config: the kvroute and legacy-blend arms)
from fleet import Procs, free_port, http_req, start_emulators, wait_fleet_idle, wait_until  # noqa: E402

ARMS = ["kvroute-default", "kvroute-default-before", "kvroute", "legacy-blend", "round-robin"]
DEMO = {"name": "demo", "endpoints": 4, "num_gpu_blocks": 2400, "stage": "concurrency:8@30s", "time_scale": 1,
        "loadgen": ["--workload", "shared-prefix", "--groups", "16", "--output-tokens", "32",
                    "--api", "completions"]}


def shipped():
    with open(os.path.join(REPO, "envoy", "kvroute-config.json")) as f:
        return json.load(f)


def plugin_json(arm, metrics_poll_ms):
    """The plugin JSON of an arm (None for round robin)."""
    doc = shipped()
    peak = next(p["parameters"]["peakPrefillThroughput"] for p in doc["plugins"]
                if p["type"] == "prefix-cache-affinity-filter")
    if arm == "round-robin":
        return None
    if arm in ("kvroute-default", "kvroute-default-before"):
        for p in doc["plugins"]:
            if p["type"] == "prefix-cache-affinity-filter" and arm.endswith("-before"):
                p["parameters"]["countUnresolvedBlocks"] = False
        return doc
    cfg = quality.plugin_config(arm, peak, 2000.0, metrics_poll_ms)
    cfg["routing"].pop("statePath", None)  # no state on the client listener: the internal listener serves it
    return cfg


def start_envoy(procs, work, tag, arm, endpoints, wasm, poll_ms):
    listen, admin, state = free_port(), free_port(), free_port()
    argv = ["bash", os.path.join(REPO, "envoy", "run.sh"), "--endpoints", ",".join(endpoints),
            "--listen-port", str(listen), "--admin-port", str(admin), "--wasm", wasm,
            "--log-level", "warning", "--concurrency", "2",
            "--config-out", os.path.join(work, f"{tag}.envoy.yaml")]
    cfg = plugin_json(arm, poll_ms)
    if cfg is None:
        argv.append("--baseline")
    else:
        path = os.path.join(work, f"{tag}.plugin.json")
        with open(path, "w") as f:
            json.dump(cfg, f, indent=1)
        argv += ["--plugin-config", path, "--state-listener", f"127.0.0.1:{state}"]
    p = procs.start(f"envoy {arm}", argv, os.path.join(work, f"{tag}.envoy.log"))

    def ready():
        st, body = http_req("GET", admin, "/ready")
        if st != 200 or body.strip() != b"LIVE":
            return False
        if cfg is None:
            return True
        st, body = http_req("GET", state, "/kvroute/state")
        eps = json.loads(body).get("endpoints", [])
        return len(eps) == len(endpoints) and all((e.get("metrics") or {}).get("fresh") for e in eps)

    wait_until(f"envoy ({arm})", ready, 60, p)
    return p, listen, admin


def run_cell(a, procs, work, cell, arms, seeds):
    emulator = os.path.join(a.target_dir, "release", "kvroute-emulator")
    loadgen = os.path.join(a.target_dir, "release", "kvroute-loadgen")
    wasm = os.path.join(a.target_dir, "wasm32-wasip1", "release", "kvroute_wasm.wasm")
    fleet = dict(quality.FLEET, endpoints=cell["endpoints"], num_gpu_blocks=cell["num_gpu_blocks"])
    fp, endpoints = start_emulators(procs, emulator, fleet, os.path.join(work, f"{cell['name']}.emulator.log"),
                                    cell["time_scale"], 1)
    out = {}
    try:
        for seed in seeds:
            for arm in arms:
                tag = f"{cell['name']}.{arm}.seed{seed}"
                router, port, admin = start_envoy(procs, work, tag, arm, endpoints, wasm, a.metrics_poll_ms)
                try:
                    wait_fleet_idle(endpoints)
                    res = os.path.join(work, f"{tag}.json")
                    argv = [loadgen, "--target", f"http://127.0.0.1:{port}", "--endpoints", ",".join(endpoints),
                            "--stages", cell["stage"], "--time-scale", str(cell["time_scale"]),
                            "--seed", str(seed), "--ceiling-block-size", "16", "--json", res, *cell["loadgen"]]
                    logp = os.path.join(work, f"{tag}.loadgen.log")
                    r = procs.start(f"loadgen {tag}", argv, logp)
                    r.wait()
                    procs.stop(r)
                    if r.returncode != 0:
                        raise RuntimeError(f"{tag}: kvroute-loadgen exited {r.returncode}; see {logp}")
                finally:
                    procs.stop(router)
                st = json.load(open(res))["stages"][-1]
                row = {"hit_ratio": st["hit_ratio"], "ceiling": st.get("hit_ratio_ceiling"),
                       "input_tps": st["input_tokens_per_s"], "ttft_p90_s": st["ttft_s"]["p90"],
                       "ok": st["ok"], "error_rate": st["error_rate"]}
                row["share"] = (row["hit_ratio"] / row["ceiling"]) if row["ceiling"] else None
                out.setdefault(arm, {})[seed] = row
                print(f"{cell['name']} seed {seed} {arm:<24} hit {row['hit_ratio']:.3f} of {row['ceiling'] or 0:.3f} "
                      f"({(row['share'] or 0):.0%}), {row['input_tps']:.0f} input tok/s, TTFT p90 "
                      f"{row['ttft_p90_s'] * 1000:.0f} ms, {row['ok']} ok, {row['error_rate']:.1%} errors",
                      file=sys.stderr, flush=True)
    finally:
        procs.stop(fp)
    return out


def med(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def report(cells, results, seeds):
    lines = []
    for cell in cells:
        per_arm = results[cell["name"]]
        lines.append(f"\n### {cell['name']}: {cell['endpoints']} servers x {cell['num_gpu_blocks']} KV blocks, "
                     f"`{cell['stage']}`, time scale {cell['time_scale']}, `{' '.join(cell['loadgen'])}`\n")
        lines.append("| arm | hit ratio | share of the ceiling | input tok/s | TTFT p90 (ms) |")
        lines.append("|---|---|---|---|---|")
        m = {}
        for arm, runs in per_arm.items():
            rs = [runs[s] for s in seeds if s in runs]
            m[arm] = {k: med([r[k] for r in rs]) for k in ("hit_ratio", "share", "input_tps", "ttft_p90_s")}
            worst = min(r["hit_ratio"] for r in rs)
            lines.append(f"| {arm} | {m[arm]['hit_ratio']:.3f} [{worst:.3f}] | {m[arm]['share']:.2f} | "
                         f"{m[arm]['input_tps']:.0f} | {m[arm]['ttft_p90_s'] * 1000:.0f} |")
        if "kvroute-default" in m:
            others = {k: v for k, v in m.items() if k not in ("kvroute-default", "kvroute-default-before")}
            if others:
                bh = max(others, key=lambda k: others[k]["hit_ratio"])
                bt = max(others, key=lambda k: others[k]["input_tps"])
                d = m["kvroute-default"]
                lines.append(f"\nShipped over the best other arm (medians of seeds {','.join(map(str, seeds))}): "
                             f"hit ratio {d['hit_ratio'] / others[bh]['hit_ratio']:.3f} (best: {bh}), "
                             f"input tok/s {d['input_tps'] / others[bt]['input_tps']:.3f} (best: {bt}).")
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cells", default="demo", help="comma list: demo and/or JSON files, each a cell or a list")
    p.add_argument("--arms", default=",".join(ARMS))
    p.add_argument("--seeds", default="1,2,3")
    p.add_argument("--metrics-poll-ms", type=int, default=500, help="the non-shipped arms' poll (shipped: 500)")
    p.add_argument("--target-dir", default=os.environ.get("CARGO_TARGET_DIR", os.path.join(REPO, "target")))
    p.add_argument("--quick", action="store_true", help="10 s stages, one seed, small prompts (a smoke)")
    p.add_argument("--json", default=None, help="write every run's figures here")
    p.add_argument("--work-dir", default=None)
    a = p.parse_args()
    cells = []
    for c in a.cells.split(","):
        if c == "demo":
            cells.append(dict(DEMO))
        else:
            with open(c) as f:
                d = json.load(f)
            cells.extend(d if isinstance(d, list) else [d])
    seeds = [int(s) for s in a.seeds.split(",")]
    if a.quick:
        seeds = seeds[:1]
        for c in cells:
            c["stage"] = c["stage"].rsplit("@", 1)[0] + "@10s"
            c["loadgen"] = c["loadgen"] + ["--system-tokens", "1024", "--question-tokens", "128"]
    work = a.work_dir or tempfile.mkdtemp(prefix="kvroute-envoy-cells.")
    os.makedirs(work, exist_ok=True)
    procs = Procs()
    results = {}
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    try:
        for cell in cells:
            results[cell["name"]] = run_cell(a, procs, work, cell, a.arms.split(","), seeds)
    finally:
        procs.stop_all()
    print(f"# Envoy cells, {started}, commit {quality.git_commit()}; logs in {work}")
    print(report(cells, results, seeds))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"started": started, "commit": quality.git_commit(), "cells": cells, "seeds": seeds,
                       "results": {c: {arm: {str(s): r for s, r in runs.items()} for arm, runs in per.items()}
                                   for c, per in results.items()}}, f, indent=1)


if __name__ == "__main__":
    main()

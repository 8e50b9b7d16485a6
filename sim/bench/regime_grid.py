#!/usr/bin/env python3
"""Issue 41's regime grid: every arm of quality.py on the shared-prefix
workload across regimes, in the fleet simulator (kvroute-simulate), 3 seeds.
A benchmark, not a test: it writes figures and never fails on them.

    python3 sim/bench/regime_grid.py [--quick] [--seeds 1,2,3] [--jobs 1] [--sim PATH]
                                     [--shipped envoy/kvroute-config.json] [--blocks A,B,C,D]
                                     [--json OUT.json] [--md OUT.md] [--svg OUT.svg]
    python3 sim/bench/regime_grid.py --from-json OUT.json [--md ...] [--svg ...]   # re-render only

Regime (one "config"): prefix groups, prompts per group, the share of a
7,200-token prompt that is the group's system prompt (--system-tokens /
--question-tokens), fleet KV against the working set, and servers. The
working set is groups x (system + prompts per group x question) tokens; each
server gets max(kv x working set / servers, 4 x 452) 16-token blocks (the
floor holds four in-flight prompts per server; a clamped config says so).

Loads (one "cell" = config x load): concurrency 2 and 4 per server (one run,
two 40 s stages, the second starting from the first's caches), and a Poisson
rate near the knee: R = 0.8 x the best arm's requests/s at 4 per server
(median of seeds), run as rate R/2 for 20 s (warm-up, not reported) then R
for 40 s.

Design (a full factorial is ~1,500 configs; this is 71 after merging the configs the
per-server floor makes identical: 30 min wall on the shared machine, --jobs 1):
  A  4 servers, 4 prompts/group: groups {4,16,64,256} x share {0.5,0.8,0.95} x kv {0.5,1,2,4}
  B  4 servers, 32 prompts/group, share 0.8: groups x kv
  C  16 servers, 4 prompts/group, share 0.8: groups x kv
  D  the demo: 16 groups x 5 prompts, 6,000 + 1,200 tokens, 4 servers of 2,400 blocks

Arms (quality.py's names): round-robin, kvroute (llm-d matched, --tau 2000),
always-sticky, legacy-blend, active-request (kvroute-simulate's --arm);
kvroute-default = the shipped file as shipped (64-token blocks, its own
maxTTFTPenaltyMs) with peakPrefillThroughput set to the modelled fleet's
(default_sweep.sim_peak); kvroute-default-before = the same with
countUnresolvedBlocks false (the profile before d71b156). Prompts are the
segments form (exact token counts for the router; text bodies are ~10x
slower to simulate).
"""

import argparse
import concurrent.futures
import datetime
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
from xml.sax.saxutils import escape

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
import default_sweep  # noqa: E402

ARMS = ["round-robin", "kvroute", "kvroute-default", "kvroute-default-before", "always-sticky", "legacy-blend",
        "active-request"]
SHIPPED = "kvroute-default"
BEFORE = "kvroute-default-before"
PROMPT_TOKENS = 7200
OUTPUT_TOKENS = 32
BLOCK = 16
FLOOR_BLOCKS = 4 * math.ceil((PROMPT_TOKENS + OUTPUT_TOKENS) / BLOCK)
CONC_PER_SERVER = [2, 4]
STAGE_S = 40
RATE_FRACTION = 0.8
BEATS = 0.03       # "beats by more than 3 %"
TTFT_FLOOR_S = 0.05  # rate loads: a TTFT p90 difference under 50 ms never counts

DEFINITION = (
    "Another arm **beats** the shipped profile in a cell when, on medians of the 3 seeds, "
    "at a concurrency load its input tok/s is more than 3 % above the shipped profile's "
    "(X > 1.03 x shipped), and at a rate load (where throughput is the offered rate) its TTFT p90 "
    "is more than 3 % below the shipped profile's *and* at least 50 ms below it "
    "(shipped > 1.03 x X and shipped - X >= 50 ms). A cell's **score** is the shipped profile's "
    "figure over the best arm's: throughput ÷ best throughput at concurrency loads, "
    "best TTFT p90 ÷ TTFT p90 at rate loads (counted only where the 50 ms floor is passed, else 1); "
    "1.00 means no arm does better.")


def configs(blocks, quick):
    out = []
    if quick:
        return [dict(design="Q", groups=16, ppg=4, share=0.8, kv=1.0, servers=4)]
    if "A" in blocks:
        for g in (4, 16, 64, 256):
            for share in (0.5, 0.8, 0.95):
                for kv in (0.5, 1.0, 2.0, 4.0):
                    out.append(dict(design="A", groups=g, ppg=4, share=share, kv=kv, servers=4))
    if "B" in blocks:
        for g in (4, 16, 64, 256):
            for kv in (0.5, 1.0, 2.0, 4.0):
                out.append(dict(design="B", groups=g, ppg=32, share=0.8, kv=kv, servers=4))
    if "C" in blocks:
        for g in (4, 16, 64, 256):
            for kv in (0.5, 1.0, 2.0, 4.0):
                out.append(dict(design="C", groups=g, ppg=4, share=0.8, kv=kv, servers=16))
    if "D" in blocks:
        out.append(dict(design="D", groups=16, ppg=5, share=6000 / 7200, kv=None, servers=4, blocks=2400))
    # configs the per-server floor makes identical run once (the first, smallest kv, stands for them)
    seen, kept = set(), []
    for c in out:
        key = (c["groups"], c["ppg"], c["share"], c["servers"], shape(c)[2])
        if key not in seen:
            seen.add(key)
            kept.append(c)
    return kept


def shape(c):
    """The workload flags and the per-server KV blocks of a config."""
    system = round(PROMPT_TOKENS * c["share"])
    question = PROMPT_TOKENS - system
    ws_tokens = c["groups"] * (system + c["ppg"] * question)
    if c.get("blocks"):
        blocks = c["blocks"]
    else:
        blocks = max(math.ceil(c["kv"] * ws_tokens / BLOCK / c["servers"]), FLOOR_BLOCKS)
    kv_eff = blocks * c["servers"] * BLOCK / ws_tokens
    wl = ["--workload", "shared-prefix", "--groups", str(c["groups"]), "--prompts-per-group", str(c["ppg"]),
          "--system-tokens", str(system), "--question-tokens", str(question),
          "--output-tokens", str(OUTPUT_TOKENS), "--api", "completions"]
    fleet = ["--endpoints", str(c["servers"]), "--num-gpu-blocks", str(blocks)]
    return wl, fleet, blocks, kv_eff


def config_name(c):
    _, _, blocks, kv_eff = shape(c)
    if c.get("blocks"):
        kv = f"{blocks} blk (kv {kv_eff:.2f}x)"
    else:
        kv = f"kv {c['kv']:g}x" + (f" (floor: {kv_eff:.2f}x)" if kv_eff > c["kv"] * 1.01 else "")
    return f"{c['design']}: {c['groups']}g x {c['ppg']}q, share {c['share']:.2f}, {kv}, {c['servers']} srv"


def shipped_file(path, work, count_unresolved):
    with open(path) as f:
        cfg = json.load(f)
    for p in cfg["plugins"]:
        if p["type"] == "prefix-cache-affinity-filter":
            p["parameters"]["peakPrefillThroughput"] = default_sweep.sim_peak()
            if count_unresolved is not None:
                p["parameters"]["countUnresolvedBlocks"] = count_unresolved
    out = os.path.join(work, f"shipped-{count_unresolved}.json")
    with open(out, "w") as f:
        json.dump(cfg, f)
    return out


def router_args(arm, files):
    if arm == SHIPPED:
        return ["--config", files[SHIPPED]]
    if arm == BEFORE:
        return ["--config", files[BEFORE]]
    return ["--arm", arm, "--tau", "2000"]


def run_one(sim, c, arm, seed, stages, files, work, tag):
    wl, fleet, _, _ = shape(c)
    out = os.path.join(work, f"{tag}-{arm}-{seed}.json")
    cmd = ["nice", "-n", "10", sim, *wl, *fleet, "--stages", stages, "--seed", str(seed),
           "--peak", str(default_sweep.sim_peak()), "--json", out, *router_args(arm, files)]
    done = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: exit {done.returncode}: {done.stderr[-2000:]}")
    with open(out) as f:
        rep = json.load(f)
    os.unlink(out)
    return [{"stage": s["stage"], "requests": s["requests"], "duration_s": s["duration_s"],
             "req_per_s": s["ok"] / s["duration_s"], "error_rate": s["error_rate"],
             "input_tps": s["input_tokens_per_s"], "hit_ratio": s["hit_ratio"],
             "hit_ratio_ceiling": s.get("hit_ratio_ceiling"),
             "ttft_p90_s": s["ttft_s"]["p90"], "ttft_p50_s": s["ttft_s"]["p50"]} for s in rep["stages"]]


def run_grid(a, cfgs, arms, seeds, stage_s):
    work = tempfile.mkdtemp(prefix="kvroute-grid.")
    files = {SHIPPED: shipped_file(a.shipped, work, None), BEFORE: shipped_file(a.shipped, work, False)}
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=a.jobs)
    results = []
    for i, c in enumerate(cfgs):
        tag = f"c{i}"
        conc = ";".join(f"concurrency:{k * c['servers']}@{stage_s}s" for k in CONC_PER_SERVER)
        futs = {(arm, s): pool.submit(run_one, a.sim, c, arm, s, conc, files, work, tag + "c")
                for arm in arms for s in seeds}
        runs = {arm: {s: futs[(arm, s)].result() for s in seeds} for arm in arms}
        top = max(statistics.median(runs[arm][s][-1]["req_per_s"] for s in seeds) for arm in arms)
        rate = round(RATE_FRACTION * top, 2)
        rstages = f"rate:{rate / 2:g}@{stage_s // 2}s;rate:{rate:g}@{stage_s}s"
        futs = {(arm, s): pool.submit(run_one, a.sim, c, arm, s, rstages, files, work, tag + "r")
                for arm in arms for s in seeds}
        for arm in arms:
            for s in seeds:
                runs[arm][s] = runs[arm][s] + futs[(arm, s)].result()[1:]
        _, _, blocks, kv_eff = shape(c)
        loads = [f"conc {k}/srv" for k in CONC_PER_SERVER] + [f"rate {rate:g}/s"]
        results.append({"config": c, "name": config_name(c), "blocks_per_server": blocks, "kv_effective": kv_eff,
                        "rate": rate, "loads": loads,
                        "runs": {arm: {str(s): runs[arm][s] for s in seeds} for arm in arms}})
        print(f"[{datetime.datetime.utcnow():%H:%M:%S}] {i + 1}/{len(cfgs)} {config_name(c)}", file=sys.stderr)
    pool.shutdown()
    return results


def summarise(results):
    """Per cell (config x load) and arm: medians and worst seeds; the shipped
    profile's and the before profile's scores against the other arms."""
    cells = []
    for r in results:
        arms = list(r["runs"])
        for li, load in enumerate(r["loads"]):
            per = {}
            for arm in arms:
                st = [r["runs"][arm][s][li] for s in r["runs"][arm]]
                tps = [x["input_tps"] for x in st]
                p90 = [x["ttft_p90_s"] for x in st]
                hit = [x["hit_ratio"] or 0.0 for x in st]
                per[arm] = {"input_tps": statistics.median(tps), "input_tps_worst": min(tps),
                            "ttft_p90_s": statistics.median(p90), "ttft_p90_worst_s": max(p90),
                            "hit_ratio": statistics.median(hit), "hit_ratio_worst": min(hit),
                            "ceiling": statistics.median(x["hit_ratio_ceiling"] or 0.0 for x in st)}
            cell = {"name": r["name"], "config": r["config"], "load": load, "kind": "rate" if li == 2 else "conc",
                    "rate": r["rate"], "blocks_per_server": r["blocks_per_server"], "arms": per}
            for prof in (SHIPPED, BEFORE):
                if prof in per:
                    cell[prof] = score(cell, prof)
            cells.append(cell)
    return cells


def score(cell, prof):
    """(score, best other arm, the other arms that beat prof); see DEFINITION."""
    per = cell["arms"]
    me = per[prof]
    others = [a for a in per if a not in (SHIPPED, BEFORE)]
    beaters = []
    best, best_arm = 1.0, None
    for a in others:
        x = per[a]
        if cell["kind"] == "conc":
            s = me["input_tps"] / x["input_tps"] if x["input_tps"] > 0 else 1.0
            if x["input_tps"] > (1 + BEATS) * me["input_tps"]:
                beaters.append(a)
        else:
            gap = me["ttft_p90_s"] - x["ttft_p90_s"]
            s = x["ttft_p90_s"] / me["ttft_p90_s"] if gap >= TTFT_FLOOR_S else 1.0
            if me["ttft_p90_s"] > (1 + BEATS) * x["ttft_p90_s"] and gap >= TTFT_FLOOR_S:
                beaters.append(a)
        if s < best:
            best, best_arm = s, a
    return {"score": best, "best_arm": best_arm, "beaten_by": beaters}


def fmt_arm(cell, arm):
    x = cell["arms"][arm]
    if cell["kind"] == "conc":
        return f"{x['input_tps']:,.0f} [{x['input_tps_worst']:,.0f}] ({100 * x['hit_ratio']:.1f} %)"
    return f"{1000 * x['ttft_p90_s']:,.0f} [{1000 * x['ttft_p90_worst_s']:,.0f}] ms ({100 * x['hit_ratio']:.1f} %)"


def flags(cell):
    c = cell["config"]
    wl, fleet, _, _ = shape(c)
    if cell["kind"] == "conc":
        k = int(cell["load"].split()[1].split("/")[0])
        stages = ";".join(f"concurrency:{j * c['servers']}@{STAGE_S}s" for j in CONC_PER_SERVER)
        which = f" (stage {CONC_PER_SERVER.index(k) + 1})"
    else:
        stages = f"rate:{cell['rate'] / 2:g}@{STAGE_S // 2}s;rate:{cell['rate']:g}@{STAGE_S}s"
        which = " (stage 2)"
    return " ".join(wl + fleet + ["--stages", f'"{stages}"']) + which


def markdown(meta, cells):
    L = []
    L.append("# Regime grid (issue 41)\n")
    L.append(f"Run {meta['date']} at commit `{meta['commit']}`, seeds {meta['seeds']}, "
             f"{meta['configs']} configs x 3 loads = {len(cells)} cells, {meta['wall_min']:.1f} min wall. "
             f"Command: `{meta['command']}`. Fleet simulator (kvroute-simulate), segments prompts; "
             "see the script's docstring for the design.\n")
    L.append(DEFINITION + "\n")
    L.append("Figures: median [worst seed] of input tok/s (concurrency) or TTFT p90 (rate), (median hit %).\n")
    for prof in (SHIPPED, BEFORE):
        if not cells or prof not in cells[0]:
            continue
        lost = [c for c in cells if c[prof]["beaten_by"]]
        L.append(f"## {prof}: {len(lost)} of {len(cells)} cells where another arm beats it by > 3 %\n")
        if prof == BEFORE:
            L.append("(The shipped file with `countUnresolvedBlocks: false`: the profile before d71b156.)\n")
        if not lost:
            continue
        lost.sort(key=lambda c: c[prof]["score"])
        L.append(f"| cell | load | {prof} | best arm | its figure | score | also beaten by |")
        L.append("|---|---|---|---|---|---|---|")
        for c in lost:
            b = c[prof]["best_arm"]
            L.append(f"| {c['name']} | {c['load']} | {fmt_arm(c, prof)} | {b} | {fmt_arm(c, b)} | "
                     f"{c[prof]['score']:.3f} | {', '.join(x for x in c[prof]['beaten_by'] if x != b) or '–'} |")
        L.append("")
    if cells and BEFORE in cells[0] and SHIPPED in cells[0]:
        L.append("## The worst cells before the fix, after it\n")
        L.append("| cell | load | score before | score after | best arm | flags (kvroute-simulate / kvroute-loadgen) |")
        L.append("|---|---|---|---|---|---|")
        for c in sorted(cells, key=lambda c: c[BEFORE]["score"])[:10]:
            L.append(f"| {c['name']} | {c['load']} | {c[BEFORE]['score']:.3f} | {c[SHIPPED]['score']:.3f} | "
                     f"{c[BEFORE]['best_arm'] or '–'} | `{flags(c)}` |")
        L.append("")
        n = len(cells)
        for prof in (BEFORE, SHIPPED):
            sc = sorted(c[prof]["score"] for c in cells)
            L.append(f"- {prof}: median score {statistics.median(sc):.3f}, worst {sc[0]:.3f}, "
                     f"cells within 3 % of the best arm {sum(1 for c in cells if not c[prof]['beaten_by'])}/{n}")
        L.append("")
    return "\n".join(L)


def color(s):
    # 1.0 green, 0.97 yellow, <= 0.7 red
    if s >= 0.999:
        return "#4daf4a"
    if s >= 0.97:
        return "#c7e9c0"
    t = max(0.0, min(1.0, (0.97 - s) / 0.27))
    r, g, b = 255, int(230 - 200 * t), int(120 - 100 * t)
    return f"#{r:02x}{g:02x}{b:02x}"


def svg(cells, path, title):
    names = []
    for c in cells:
        if c["name"] not in names:
            names.append(c["name"])
    profs = [p for p in (BEFORE, SHIPPED) if cells and p in cells[0]]
    cols = [(p, li) for p in profs for li in range(3)]
    cw, rh, left, top = 62, 13, 420, 60
    w, h = left + cw * len(cols) + 20, top + rh * len(names) + 40
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="10">',
           f'<rect width="{w}" height="{h}" fill="white"/>',
           f'<text x="10" y="16" font-size="13">{escape(title)}</text>',
           '<text x="10" y="30">score = shipped ÷ best arm (throughput at concurrency, TTFT p90 at rate); '
           'green ≥ 0.97, red below</text>']
    for ci, (p, li) in enumerate(cols):
        x = left + ci * cw
        lab = ["conc 2", "conc 4", "rate"][li]
        out.append(f'<text x="{x + 3}" y="{top - 16}">{"before" if p == BEFORE else "shipped"}</text>')
        out.append(f'<text x="{x + 3}" y="{top - 5}">{lab}</text>')
    by = {(c["name"], c["load"].split()[0] + (c["load"].split()[1] if c["kind"] == "conc" else "")): c for c in cells}
    for ri, n in enumerate(names):
        y = top + ri * rh
        out.append(f'<text x="5" y="{y + 10}">{escape(n)}</text>')
        row = [c for c in cells if c["name"] == n]
        for ci, (p, li) in enumerate(cols):
            if li >= len(row):
                continue
            s = row[li][p]["score"]
            x = left + ci * cw
            out.append(f'<rect x="{x}" y="{y}" width="{cw - 2}" height="{rh - 1}" fill="{color(s)}"/>')
            out.append(f'<text x="{x + 4}" y="{y + 10}">{s:.2f}</text>')
    del by
    out.append("</svg>")
    with open(path, "w") as f:
        f.write("\n".join(out) + "\n")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sim", default=os.path.join(REPO, "target", "release", "kvroute-simulate"))
    p.add_argument("--seeds", default="1,2,3")
    p.add_argument("--arms", default=",".join(ARMS))
    p.add_argument("--blocks", default="A,B,C,D", help="the design's blocks to run (A,B,C,D)")
    p.add_argument("--shipped", default=os.path.join(REPO, "envoy", "kvroute-config.json"),
                   help="the profile kvroute-default runs (and -before, with countUnresolvedBlocks false)")
    p.add_argument("--match", default=None,
                   help="run only the configs whose name contains one of these |-separated strings")
    p.add_argument("--jobs", type=int, default=1, help="simulator runs at once (each one core)")
    p.add_argument("--quick", action="store_true", help="a smoke: one config, one seed, 10 s stages (< 1 min)")
    p.add_argument("--json", default=None, help="write every run's stages and the cells here")
    p.add_argument("--from-json", default=None, help="re-render the report from a --json file; no runs")
    p.add_argument("--md", default=None, help="the Markdown report [stdout]")
    p.add_argument("--svg", default=None, help="the SVG heat map")
    a = p.parse_args()
    if a.from_json:
        with open(a.from_json) as f:
            data = json.load(f)
        meta, results = data["meta"], data["results"]
    else:
        seeds = [1] if a.quick else [int(s) for s in a.seeds.split(",")]
        cfgs = configs(a.blocks.split(","), a.quick)
        if a.match:
            cfgs = [c for c in cfgs if any(m in config_name(c) for m in a.match.split("|"))]
        stage_s = 10 if a.quick else STAGE_S
        t0 = datetime.datetime.utcnow()
        results = run_grid(a, cfgs, a.arms.split(","), seeds, stage_s)
        commit = subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", REPO, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True).stdout.strip()
        meta = {"date": f"{t0:%Y-%m-%d}", "commit": commit + ("+dirty" if dirty else ""), "seeds": seeds,
                "configs": len(cfgs), "wall_min": (datetime.datetime.utcnow() - t0).total_seconds() / 60,
                "shipped": os.path.relpath(a.shipped, REPO), "quick": a.quick,
                "command": "python3 sim/bench/regime_grid.py " + " ".join(sys.argv[1:])}
    cells = summarise(results)
    md = markdown(meta, cells)
    if a.md:
        with open(a.md, "w") as f:
            f.write(md + "\n")
    else:
        print(md)
    if a.svg:
        svg(cells, a.svg, f"Regime grid, {meta['date']}, {meta['commit']}: shipped profile ÷ best arm")
    if a.json and not a.from_json:
        with open(a.json, "w") as f:
            json.dump({"meta": meta, "results": results, "cells": cells}, f, separators=(",", ":"))


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""The fleet simulator against the Envoy gateway-replica runs (issue 43).

    python3 sim/bench/sim_vs_envoy.py [--envoy sim/bench/results/replicas.json] [--sim PATH]
                                      [--gateways 1,2,4,8] [--shapes rotate,sidecar]
                                      [--arms approx,approx-mesh] [--seeds 1,2,3] [--json OUT]

Runs `kvroute-simulate` on `replicas.py`'s own load (its FLEET and WORKLOAD
dicts, read from that file): 4 servers x 2,048 16-token blocks, 32
conversations x 6 turns (512-token shared system prompt, 2,048-token private
context, 256 user + 64 answer tokens per turn) as a sessions stage (each
conversation its own client, starting within 20 s, an exponential think time
of mean 4 s after each answer), token counts exact (the simulator's segment
prompts stand for token-ID prompts), time scale 5, one Envoy worker per
proxy, `--stream-interval 8`; the router is the plugin JSON replicas.py
gives Envoy (`plugin_config`: the shipped profile with 16-token blocks,
peak 20,480 tok/s). Arms:

  approx       each proxy alone (no exchange)
  approx-mesh  `--mesh-exchange --exchange-ms P`, P = replicas.py's kvEvents
               pollMs (the wasm collector exchanges at each relay poll)
  round-robin  `--arm round-robin` (Envoy without kvroute)

`precise` and `precise-no-mesh` are not modelled (the simulator has no KV
events). Shapes: rotate (turn k of conversation c through proxy (c + k) mod G)
and sidecar (`--proxy-assign client`: conversation c through proxy c mod G).

Printed per (shape, G, arm), medians over seeds, sim beside Envoy (a given
replicas.json; `–` where it has no such cell) and their difference: the
fleet's hit ratio (servers' prefix-cache hits / queries), its share of the
ceiling (each side's own: the simulator's exact one of its stream, replicas.py's
formula), turn follow (share of turns on the server of the conversation's
previous turn; the simulator's from its decision log, so not for round
robin), TTFT p90, and for G > 1 the worst seed's hit ratio over G = 1's (same
arm, shape and seed). Seeds are not the same draws on the two sides (the
simulator's generator is not Python's), so only distributions compare.

A benchmark: it never fails on figures; it exits 1 if a simulator run fails.
Only the Python standard library.
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
import replicas  # noqa: E402  (FLEET, WORKLOAD, plugin_config, events_section)

ARMS = ["approx", "approx-mesh", "round-robin"]
SHAPES = {"rotate": "rotate", "sidecar": "client"}


def sim_argv(sim, work, shape, g, arm, seed):
    """The simulator's command for one cell, and its report and log paths."""
    f, w = replicas.FLEET, replicas.WORKLOAD
    tag = f"{shape}-{g}-{arm}-{seed}"
    out, log = os.path.join(work, tag + ".json"), os.path.join(work, tag + ".jsonl")
    argv = [sim, "--workload", "agent-session",
            "--prompts-per-group", str(w["turns"]), "--system-tokens", str(w["system_tokens"]),
            "--persona-tokens", str(w["context_tokens"]), "--question-tokens", str(w["user_tokens"]),
            "--output-tokens", str(w["answer_tokens"]),
            "--stages", f"sessions:{w['conversations']}@{w['start_spread_s']}s,think={w['think_s']}s",
            "--endpoints", str(f["endpoints"]), "--block-size", str(f["block_size"]),
            "--num-gpu-blocks", str(f["num_gpu_blocks"]),
            "--max-num-batched-tokens", str(f["max_num_batched_tokens"]),
            "--prefill-tps", str(f["prefill_tps"]), "--stream-interval", "8",
            "--time-scale", str(w["time_scale"]), "--envoy-workers", "1",
            "--proxies", str(g), "--proxy-assign", SHAPES[shape],
            "--seed", str(seed), "--json", out]
    if arm == "round-robin":
        argv += ["--arm", "round-robin"]
    else:
        cfg = os.path.join(work, "approx.plugin.json")
        if not os.path.exists(cfg):
            with open(cfg, "w") as fh:
                # replicas.py's own document for its approx arm (the method reads no state)
                json.dump(replicas.plugin_config("approx", [], []), fh)
        argv += ["--config", cfg, "--decision-log", log]
        if arm == "approx-mesh":
            poll = replicas.events_section([], [])["pollMs"]
            argv += ["--mesh-exchange", "--exchange-ms", str(poll)]
    return argv, out, log


def turn_follow(log):
    """Share of turns routed to the server of their conversation's previous turn."""
    last, same, n = {}, 0, 0
    with open(log) as fh:
        for line in fh:
            d = json.loads(line)
            g, e = d["group"], d["endpoint"]
            if g in last:
                n += 1
                same += last[g] == e
            last[g] = e
    return same / n if n else None


def run_cell(sim, work, shape, g, arm, seed):
    argv, out, log = sim_argv(sim, work, shape, g, arm, seed)
    p = subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}\n{p.stderr}")
    with open(out) as fh:
        r = json.load(fh)
    s = r["stages"][-1]
    if s["errors"] or r["totals"]["unrouted"]:
        raise RuntimeError(f"{' '.join(argv)}: {s['errors']} errors, {r['totals']['unrouted']} unrouted")
    return {"shape": shape, "gateways": g, "arm": arm, "seed": seed, "requests": s["requests"],
            "hit_ratio": s["hit_ratio"], "ceiling": s["hit_ratio_ceiling"],
            "followed_prev_turn": turn_follow(log) if arm != "round-robin" else None,
            "ttft_p90_s": s["ttft_s"]["p90"], "input_tok_s": s["input_tokens_per_s"]}


def git_commit():
    p = subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return p.stdout.strip() or None


def add_ratios(runs):
    base = {(r["shape"], r["arm"], r["seed"]): r for r in runs if r["gateways"] == 1}
    for r in runs:
        b = base.get((r["shape"], r["arm"], r["seed"]))
        r["hit_vs_g1"] = (r["hit_ratio"] / b["hit_ratio"]
                          if b and b["hit_ratio"] and r["hit_ratio"] is not None else None)


def med(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def worst(xs):
    xs = [x for x in xs if x is not None]
    return min(xs) if xs else None


def fmt(v, spec):
    return "–" if v is None else format(v, spec)


def diff(a, b, spec):
    return "–" if a is None or b is None else format(a - b, "+" + spec)


def table(sim_runs, envoy, ceiling_envoy):
    """Markdown: sim | Envoy | difference, per (shape, G, arm)."""
    def cells(runs):
        out = {}
        for r in runs:
            out.setdefault((r["shape"], r["gateways"], r["arm"]), []).append(r)
        return out

    sc, ec = cells(sim_runs), cells(envoy)
    lines = ["| shape | G | arm | hit ratio sim · Envoy · Δ | of ceiling sim · Envoy "
             "| turn follow sim · Envoy · Δ | TTFT p90 s sim · Envoy | hit vs G=1, worst sim · Envoy · Δ "
             "| seeds sim · Envoy |",
             "|---|---|---|---|---|---|---|---|---|"]
    for key in sorted(sc, key=lambda k: (list(SHAPES).index(k[0]), k[1], ARMS.index(k[2]))):
        s, e = sc[key], ec.get(key, [])
        hs, he = med(r["hit_ratio"] for r in s), med(r["hit_ratio"] for r in e)
        shs = med(r["hit_ratio"] / r["ceiling"] for r in s if r["hit_ratio"] is not None)
        she = he / ceiling_envoy if he is not None and ceiling_envoy else None
        fs, fe = med(r["followed_prev_turn"] for r in s), med(r.get("followed_prev_turn") for r in e)
        ts, te = med(r["ttft_p90_s"] for r in s), med(r.get("ttft_p90_s") for r in e)
        g1 = key[1] > 1
        rs = worst(r["hit_vs_g1"] for r in s) if g1 else None
        re_ = worst(r.get("hit_vs_g1") for r in e) if g1 else None
        lines.append(f"| {key[0]} | {key[1]} | {key[2]} | {fmt(hs, '.3f')} · {fmt(he, '.3f')} · {diff(hs, he, '.3f')} "
                     f"| {fmt(shs, '.0%')} · {fmt(she, '.0%')} "
                     f"| {fmt(fs, '.2f')} · {fmt(fe, '.2f')} · {diff(fs, fe, '.2f')} "
                     f"| {fmt(ts, '.3f')} · {fmt(te, '.3f')} "
                     f"| {fmt(rs, '.3f')} · {fmt(re_, '.3f')} · {diff(rs, re_, '.3f')} | {len(s)} · {len(e)} |")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--envoy", default=os.path.join(HERE, "results", "replicas.json"),
                    help="a replicas.py results JSON [sim/bench/results/replicas.json]")
    ap.add_argument("--sim", default=os.path.join(REPO, "target", "release", "kvroute-simulate"))
    ap.add_argument("--gateways", default="1,2,4,8")
    ap.add_argument("--shapes", default="rotate,sidecar")
    ap.add_argument("--arms", default="approx,approx-mesh")
    ap.add_argument("--seeds", default="1,2,3", help="comma list, or a range like 1-40 [1,2,3]")
    ap.add_argument("--json", help="write the simulator's runs here")
    a = ap.parse_args(argv)
    gs = [int(x) for x in a.gateways.split(",")]
    seeds = []
    for x in a.seeds.split(","):
        lo, _, hi = x.partition("-")
        seeds += list(range(int(lo), int(hi or lo) + 1))
    arms = [x for x in a.arms.split(",") if x]
    shapes = [x for x in a.shapes.split(",") if x]
    for x in arms:
        if x not in ARMS:
            ap.error(f"unknown arm {x}; the simulator models {','.join(ARMS)} (not precise)")
    for x in shapes:
        if x not in SHAPES:
            ap.error(f"unknown shape {x}; shapes: {','.join(SHAPES)}")
    with open(a.envoy) as fh:
        env = json.load(fh)
    envoy_runs = env.get("runs", [])
    runs, failures = [], []
    with tempfile.TemporaryDirectory(prefix="kvroute-sim-vs-envoy.") as work:
        example = " ".join(sim_argv(a.sim, work, shapes[0], gs[-1], arms[0], seeds[0])[0]).replace(work, "WORK").replace(REPO + os.sep, "")
        for shape in shapes:
            for g in gs:
                for arm in arms:
                    for seed in seeds:
                        try:
                            runs.append(run_cell(a.sim, work, shape, g, arm, seed))
                        except (RuntimeError, OSError, ValueError, KeyError) as e:
                            failures.append(f"{shape} G={g} {arm} seed {seed}: {e}")
    add_ratios(runs)
    def one(v):
        return ", ".join(sorted(set(v))) if isinstance(v, list) else v

    print(f"Envoy: {a.envoy} (commit {one(env.get('commit'))}, started {one(env.get('started'))}; "
          f"ceiling {env.get('ceiling', 0):.3f} by replicas.py's formula). Simulator: {a.sim}, seeds {a.seeds}; "
          f"ceiling of its stream {fmt(med(r['ceiling'] for r in runs), '.3f')}. "
          "Medians over seeds; precise and precise-no-mesh are not modelled.\n")
    print(table(runs, envoy_runs, env.get("ceiling")))
    if a.json:
        with open(a.json, "w") as fh:
            fh.write(json.dumps({"envoy": a.envoy, "commit": git_commit(), "seeds": a.seeds,
                                 "example_command": example})[:-1] + ', "runs": [\n')
            fh.write(",\n".join(json.dumps(r) for r in runs) + "\n]}\n")
    if failures:
        print("\nFAILED RUNS:\n  " + "\n  ".join(failures), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Where a proxy's CPU goes per request, by code region, from `perf record`
(software cpu-clock sampling; this machine has no hardware counters).

For each arm it starts the stub and the arm (as bench.py does), sends one
request at a time (wrk -c 1) with bodies of one size, samples the proxy
process for a few seconds, and splits the samples into:

  jit      V8-generated code: the kvroute module itself ([JIT] in perf)
  envoy    Envoy's own code, V8's runtime included (the binary is stripped,
           so no finer split is possible)
  memmove  libc memmove/memcpy, split again by who called it: from jit
           (the module's own memory.copy) or from envoy (host-side copies:
           shared data, body buffer, headers)
  libc     the rest of libc (malloc, locks, ...)
  kernel   socket I/O and scheduling

Each region is reported in CPU microseconds per request (samples x period /
requests). Run as root (perf_event_paranoid is 2 here).

    python3 sim/bench/overhead/perf_split.py --arms envoy-rr,kv-skip,kvroute --size 8k
"""

import argparse
import collections
import json
import os
import re
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import bench  # noqa: E402


def classify(script_text):
    """Samples per region from `perf script -F ip,sym,dso` output with call chains."""
    counts = collections.Counter()
    for block in script_text.split("\n\n"):
        frames = []
        for line in block.strip().splitlines():
            m = re.match(r"\s*([0-9a-f]+)\s+(.*?)\s*\((.*)\)\s*$", line)
            if m:
                frames.append((m.group(2), os.path.basename(m.group(3))))
        if not frames:
            continue
        sym, dso = frames[0]
        if dso.startswith("perf-") or "JIT" in dso:
            counts["jit"] += 1
        elif "kernel" in dso:
            counts["kernel"] += 1
        elif dso.startswith("libc"):
            if "memmove" in sym or "memcpy" in sym:
                caller = next((d for _, d in frames[1:] if not d.startswith("libc")), "")
                if caller.startswith("perf-") or "JIT" in caller:
                    counts["memmove from jit"] += 1
                else:
                    counts["memmove from envoy"] += 1
            else:
                counts["libc other"] += 1
        elif dso in ("envoy", "python3", "python3.11") or "smg_rs" in dso:
            counts["native"] += 1
        else:
            counts["other"] += 1
    return counts


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arms", default="envoy-rr,kv-skip,kv-1block,kvroute")
    p.add_argument("--size", default="8k", choices=list(bench.SIZES))
    p.add_argument("--seconds", type=int, default=5, help="seconds sampled per arm and round")
    p.add_argument("--rounds", type=int, default=3, help="rounds, arms interleaved; medians are reported")
    p.add_argument("--connections", type=int, default=1)
    p.add_argument("--concurrency", type=int, default=1, help="Envoy --concurrency (1: one worker to sample)")
    p.add_argument("--wasm", default=os.path.join(os.environ.get("CARGO_TARGET_DIR", os.path.join(bench.REPO, "target")),
                                               "wasm32-wasip1", "release", "kvroute_wasm.wasm"))
    p.add_argument("--plugin-config", default=os.path.join(HERE, "kvroute-bench.json"))
    p.add_argument("--smg", default="smg")
    p.add_argument("--work", default=os.path.join(os.environ.get("TMPDIR", "/tmp"), f"kvroute-perf-{os.getpid()}"))
    p.add_argument("--variant", action="append", default=[], metavar="NAME=WASM",
                   help="an extra arm: the kvroute arm with another module (as bench.py --variant)")
    args = p.parse_args(argv)
    args.variants = {}
    for v in args.variant:
        name, sep, path = v.partition("=")
        if not sep or not name or not os.path.exists(path):
            p.error(f"--variant {v}: want NAME=WASM with an existing file")
        args.variants[name] = path
    args.stub_concurrency = 1
    arms = args.arms.split(",")
    os.makedirs(args.work, exist_ok=True)
    bodies = os.path.join(args.work, f"bodies-{args.size}.jsonl")
    count = bench.BODY_COUNTS[args.size] // 4
    with open(bodies, "w") as f:
        for b in bench.bodies_mod.generate(bench.SIZES[args.size], count):
            f.write(b + "\n")
    lua = os.path.join(HERE, "post.lua")
    rows = {}
    try:
        procs, urls, proxy_of, admins, startup, info = bench.start_everything(args, args.work, 4, arms)
        for arm in arms:
            bench.run_wrk(urls[arm], bodies, 4, 2, 0, lua)  # warm-up
        samples = {a: [] for a in arms}
        for rnd in range(args.rounds):
            for arm in arms:
                data = os.path.join(args.work, f"{arm}-{rnd}.data")
                total = args.seconds + 4
                wrk = subprocess.Popen(
                    ["wrk", "-t1", f"-c{args.connections}", f"-d{total}s", "-s", lua, urls[arm], "--", bodies],
                    stdout=subprocess.PIPE, text=True)
                time.sleep(2)
                subprocess.run(["perf", "record", "-q", "-e", "cpu-clock", "-F", "4000", "-g", "-p",
                                str(proxy_of[arm].pid), "-o", data, "--", "sleep", str(args.seconds)],
                               capture_output=True, check=True)
                out, _ = wrk.communicate(timeout=total + 60)
                res = json.loads([l for l in out.splitlines() if l.startswith("{")][-1])
                rps = res["requests"] / (res["duration_us"] / 1e6)
                script = subprocess.run(["perf", "script", "-i", data, "-F", "ip,sym,dso"],
                                        capture_output=True, text=True).stdout
                os.remove(data)
                counts = classify(script)
                period_us = 1e6 / 4000
                reqs = rps * args.seconds
                row = {k: v * period_us / reqs for k, v in counts.items()}
                row["total"] = sum(counts.values()) * period_us / reqs
                row["rps"] = rps
                samples[arm].append(row)
                print(f"[perf] r{rnd} {arm}: {rps:.0f} req/s, " + ", ".join(
                    f"{k} {v:.1f}" for k, v in sorted(row.items()) if k != "rps") + " µs/req", flush=True)
        for arm in arms:
            keys = set().union(*(r.keys() for r in samples[arm]))
            rows[arm] = {k: statistics.median([r.get(k, 0.0) for r in samples[arm]]) for k in keys}
    finally:
        bench.stop_all()
    regions = ["jit", "native", "memmove from jit", "memmove from envoy", "libc other", "kernel", "other", "total"]
    print(f"\nCPU µs per request by region (median of {args.rounds} rounds), {args.size} bodies, "
          f"wrk -c {args.connections}, "
          f"Envoy --concurrency {args.concurrency}\n")
    print("| region | " + " | ".join(arms) + " |")
    print("|---|" + "---|" * len(arms))
    for r in regions:
        print(f"| {r} | " + " | ".join(f"{rows.get(a, {}).get(r, 0.0):.1f}" for a in arms) + " |")
    with open(os.path.join(args.work, f"perf-{args.size}.json"), "w") as f:
        json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

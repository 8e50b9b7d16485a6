#!/usr/bin/env python3
"""Instructions per request of Envoy's worker thread, with and without
kvroute, counted by valgrind's callgrind: a figure that other processes on the
machine cannot disturb.

Each Envoy arm (round robin; kvroute) runs under
`valgrind --tool=callgrind --separate-threads=yes --smc-check=all-non-file`
(V8 writes the module's machine code at run time, so valgrind must watch all
non-file memory for new code) with `--concurrency 1`, in front of the same
stub as bench.py (not under valgrind). For each body size the script zeroes
the counters (`callgrind_control -z`), sends N requests one at a time, dumps
(`callgrind_control -d`), and reads the instruction count (Ir) of the busiest
thread, the one worker: Ir / N is the cost per request. Background work on
that thread during the window (timers) is included and is small; the
collector's /metrics polling runs on the main thread and is not included.

Arms: `envoy-rr`, `kvroute` (--wasm), `host-floor` (sim/bench/overhead/floor,
built here: kvroute's VM entries and host calls without its routing work),
and any NAME given with `--variant NAME=WASM` (another build of the module).

Slow: Envoy takes minutes to start under valgrind, V8 more.

    python3 sim/bench/overhead/callgrind.py [--sizes 8k,64k,400k] [--requests 100]
    python3 sim/bench/overhead/callgrind.py --sizes 8k --arms envoy-rr,host-floor,kvroute,new --variant new=/tmp/new.wasm
    python3 sim/bench/overhead/callgrind.py --sizes 8k,64k --fresh   # every request a new prompt
    python3 sim/bench/overhead/callgrind.py --sizes 8k,64k --fresh tail   # a known prompt, a new last block

By default 64 bodies per size are cycled after a warm-up on the first 20, so
44 of 100 measured requests (5 of 25 at 400 KiB) are bodies the router has not
seen, which part from their system prompt, and the rest repeat one; with
--fresh every request is new (bench.py --fresh), and with --fresh tail every
measured request is a body the warm-up sent, with a new last block.
"""

import argparse
import glob
import http.client
import json
import os
import re
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import bench  # noqa: E402


_sent = iter(range(1, 1 << 62))


def post_n(port, bodies, n, fresh=False):
    """n POSTs over one keep-alive connection; returns the statuses seen. With
    `fresh`, the bodies carry bodies.MARKER and each POST is a new prompt."""
    statuses = {}
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    for i in range(n):
        body = bodies[i % len(bodies)]
        if fresh:
            body = bench.bodies_mod.fresh(body, next(_sent))
        conn.request("POST", bench.CHAT_PATH, body=body, headers={"content-type": "application/json"})
        r = conn.getresponse()
        r.read()
        statuses[r.status] = statuses.get(r.status, 0) + 1
    conn.close()
    return statuses


def thread_irs(out_prefix, pid, dump_no):
    """Ir per thread of dump number dump_no (callgrind.out.PID.DUMP-THREAD)."""
    irs = {}
    for path in glob.glob(f"{out_prefix}.{pid}.{dump_no}-*"):
        tid = path.rsplit("-", 1)[-1]
        with open(path, errors="replace") as f:
            for line in f:
                if line.startswith("summary:") or line.startswith("totals:"):
                    irs[tid] = int(line.split()[1])
                    break
    return irs


def regions(path):
    """Self Ir of one callgrind dump, by code region: `jit` (no object, high
    addresses: code V8 generated for the module), `envoy` (the stripped Envoy
    binary, V8's runtime included), `memcpy` (libc memcpy/memmove, whoever
    called it: the host's copies and the module's memory.copy alike),
    `libc` (the rest of libc), `unmapped` (no object, low addresses)."""
    names = {"ob": {}, "fn": {}}
    cur = {"ob": "", "fn": ""}
    out = {}
    skip_next = False
    with open(path, errors="replace") as f:
        for line in f:
            if skip_next:  # the inclusive cost of a call, not self cost
                skip_next = False
                continue
            m = re.match(r"(c?)(ob|fn)=\((\d+)\)(?: (.*))?", line.rstrip("\n"))
            if m:
                if m.group(4):
                    names[m.group(2)][m.group(3)] = m.group(4)
                if not m.group(1):
                    cur[m.group(2)] = names[m.group(2)].get(m.group(3), m.group(3))
                continue
            if line.startswith("calls="):
                skip_next = True
                continue
            if not line or not (line[0].isdigit() or line[0] in "+-*"):
                continue
            parts = line.split()
            if len(parts) < 2 or not parts[1].isdigit():
                continue
            ob, fn = cur["ob"], cur["fn"]
            if "libc" in ob:
                key = "memcpy" if ("memcpy" in fn or "memmove" in fn) else "libc"
            elif ob.endswith("/envoy"):
                key = "envoy"
            elif "???" in ob or not ob:
                try:
                    key = "jit" if int(fn, 16) > 1 << 32 else "unmapped"
                except ValueError:
                    key = "unmapped"
            else:
                key = "other"
            out[key] = out.get(key, 0) + int(parts[1])
    return out


def build_floor():
    """Builds sim/bench/overhead/floor (its own workspace) and returns the module."""
    target = os.path.join(os.environ.get("CARGO_TARGET_DIR", os.path.join(bench.REPO, "target")), "overhead-floor")
    subprocess.run(["cargo", "build", "-q", "--release", "--target", "wasm32-wasip1", "--manifest-path",
                    os.path.join(HERE, "floor", "Cargo.toml"), "--target-dir", target], check=True)
    return os.path.join(target, "wasm32-wasip1", "release", "kvroute_overhead_floor.wasm")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arms", default="envoy-rr,kvroute")
    p.add_argument("--sizes", default="8k,64k,400k")
    p.add_argument("--requests", type=int, default=100, help="requests per size (400k: a quarter)")
    p.add_argument("--wasm", default=os.path.join(os.environ.get("CARGO_TARGET_DIR", os.path.join(bench.REPO, "target")),
                                               "wasm32-wasip1", "release", "kvroute_wasm.wasm"))
    p.add_argument("--plugin-config", default=os.path.join(HERE, "kvroute-bench.json"))
    p.add_argument("--variant", action="append", default=[], metavar="NAME=WASM",
                   help="an arm NAME running another build of the module; name it in --arms too")
    p.add_argument("--fresh", nargs="?", const="turn", choices=bench.bodies_mod.MARKER_PLACES,
                   help="every request a prompt no router has seen (bench.py --fresh [turn|tail]), not 64 "
                        "bodies cycled")
    p.add_argument("--start-timeout", type=int, default=1200, help="seconds to wait for Envoy under valgrind")
    p.add_argument("--work", default=os.path.join(os.environ.get("TMPDIR", "/tmp"), f"kvroute-callgrind-{os.getpid()}"))
    args = p.parse_args(argv)
    os.makedirs(args.work, exist_ok=True)
    sizes = args.sizes.split(",")
    arms = args.arms.split(",")
    wasm_of = {"envoy-rr": args.wasm, "kvroute": args.wasm}
    wasm_of.update(v.split("=", 1) for v in args.variant)
    if "host-floor" in arms and "host-floor" not in wasm_of:
        wasm_of["host-floor"] = build_floor()
    unknown = [a for a in arms if a not in wasm_of]
    if unknown:
        p.error(f"unknown arms {unknown}: name other builds with --variant NAME=WASM")
    envoy = bench.envoy_binary()
    bodies = {s: [b.encode() for b in bench.bodies_mod.generate(bench.SIZES[s], 64, marker=args.fresh)] for s in sizes}
    results = {}
    try:
        ports = bench.free_ports(5 + 2 * len(arms))
        stub_admin, stub_ports = ports[0], ports[1:5]
        with open(os.path.join(args.work, "stub.json"), "w") as f:
            f.write(bench.stub_mod.render(stub_ports, stub_admin))
        bench.Proc("stub", [envoy, "-c", os.path.join(args.work, "stub.json"), "--concurrency", "1",
                            "--use-dynamic-base-id", "-l", "warn"], os.path.join(args.work, "stub.log"))
        endpoints = ",".join(f"127.0.0.1:{p_}" for p_ in stub_ports)
        for i, arm in enumerate(arms):
            port, admin = ports[5 + 2 * i], ports[6 + 2 * i]
            cfg = os.path.join(args.work, f"{arm}.yaml")
            argv_r = [sys.executable, os.path.join(bench.REPO, "envoy", "render.py"), "--endpoints", endpoints,
                      "--listen-port", str(port), "--admin-port", str(admin), "--wasm", wasm_of[arm],
                      "--plugin-config", args.plugin_config, "-o", cfg]
            if arm == "envoy-rr":
                argv_r.append("--baseline")
            subprocess.run(argv_r, check=True)
            prefix = os.path.join(args.work, f"callgrind.{arm}")
            t0 = time.time()
            proc = bench.Proc(arm, ["valgrind", "--tool=callgrind", "--separate-threads=yes",
                                    "--smc-check=all-non-file", f"--callgrind-out-file={prefix}.%p",
                                    envoy, "-c", cfg, "--concurrency", "1", "--use-dynamic-base-id", "-l", "warn"],
                              os.path.join(args.work, f"{arm}.log"))
            bench.wait_ready(arm, f"http://127.0.0.1:{port}", proc, deadline_s=args.start_timeout)
            print(f"[callgrind] {arm} serving after {time.time() - t0:.0f}s under valgrind", flush=True)
            post_n(port, bodies[sizes[0]], 10, args.fresh)  # warm-up: connections, JIT tiers
            dump = 0
            for s in sizes:
                n = args.requests if s != "400k" else max(5, args.requests // 4)
                # Warm-up at this size; with --fresh tail, every body the
                # measurement sends, so that each of its requests sticks.
                warm = min(n, len(bodies[s])) if args.fresh == "tail" else min(n, 20)
                post_n(port, bodies[s], warm, args.fresh)
                subprocess.run(["callgrind_control", "-z", str(proc.pid)], check=True, capture_output=True)
                t1 = time.time()
                statuses = post_n(port, bodies[s], n, args.fresh)
                subprocess.run(["callgrind_control", "-d", str(proc.pid)], check=True, capture_output=True)
                dump += 1
                irs = {}
                for _ in range(60):
                    irs = thread_irs(prefix, proc.pid, dump)
                    if irs:
                        break
                    time.sleep(1)
                busiest = max(irs.values()) if irs else 0
                busiest_tid = max(irs, key=irs.get) if irs else None
                split = {}
                if busiest_tid:
                    split = {k: v / n for k, v in regions(f"{prefix}.{proc.pid}.{dump}-{busiest_tid}").items()}
                results.setdefault(arm, {})[s] = {
                    "worker_ir_by_region_per_request": split,
                    "requests": n, "statuses": statuses, "worker_ir_per_request": busiest / n,
                    "all_threads_ir_per_request": sum(irs.values()) / n, "seconds": time.time() - t1,
                }
                print(f"[callgrind] {arm} {s}: {busiest / n / 1e6:.2f} M instructions per request on the worker "
                      f"({sum(irs.values()) / n / 1e6:.2f} M all threads), statuses {statuses}", flush=True)
            proc.stop()
    finally:
        bench.stop_all()
    with open(os.path.join(args.work, "callgrind.json"), "w") as f:
        json.dump(results, f, indent=1)
    print("\n| size | arm | worker Ir/req | added over envoy-rr | × envoy-rr |")
    print("|---|---|---|---|---|")
    for s in sizes:
        base = results.get("envoy-rr", {}).get(s, {}).get("worker_ir_per_request")
        for arm in arms:
            b = results.get(arm, {}).get(s, {}).get("worker_ir_per_request")
            if b is None:
                continue
            added = f"{(b - base) / 1e6:.3f} M" if base and arm != "envoy-rr" else "—"
            ratio = f"{b / base:.2f}" if base else "—"
            print(f"| {s} | {arm} | {b / 1e6:.3f} M | {added} | {ratio} |")
    print("\nworker Ir per request by region (M):\n")
    keys = ["jit", "envoy", "memcpy", "libc", "unmapped", "other"]
    print("| arm | size | " + " | ".join(keys) + " |")
    print("|---|---|" + "---|" * len(keys))
    for arm in arms:
        for s in sizes:
            r = results.get(arm, {}).get(s, {}).get("worker_ir_by_region_per_request", {})
            print(f"| {arm} | {s} | " + " | ".join(f"{r.get(k, 0) / 1e6:.3f}" for k in keys) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

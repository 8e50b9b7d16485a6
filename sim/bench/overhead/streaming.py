#!/usr/bin/env python3
"""What streamed responses cost the proxy, with and without kvroute.

The added-latency benchmark (bench.py) answers with one small JSON body.
Model servers stream: one SSE chunk per output token, and Envoy calls the
module's `proxy_on_response_body` for every chunk (kvroute needs the first
one, to release the prompt charge; the ABI has no way to stop the calls
after it). This script measures that cost.

Setup: 4 emulated vLLM endpoints (`kvroute-emulator`, sped up with
--time-scale), Envoy with plain round robin and Envoy + kvroute in front of
them (`envoy/render.py`, `--concurrency 2`), and the load generator
(`kvroute-loadgen`, shared-prefix workload, streaming completions) at a
fixed concurrency. For each output length (max_tokens) and round, each arm
gets the same run; the proxy's on-CPU time (/proc/PID/task/*/schedstat)
divided by the completed requests is its CPU per request. The slope between
two output lengths is the CPU per streamed chunk.

    cargo build --release --target wasm32-wasip1 -p kvroute-wasm
    cargo build --release --bin kvroute-emulator --bin kvroute-loadgen
    python3 sim/bench/overhead/streaming.py [--outputs 1,128] [--rounds 3]

Only the Python standard library is used (plus envoy and the two binaries).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import bench  # noqa: E402

TARGET = os.environ.get("CARGO_TARGET_DIR", os.path.join(bench.REPO, "target"))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--outputs", default="1,128", help="comma list of max_tokens values (at least two)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seconds", type=float, default=8, help="wall seconds per run")
    p.add_argument("--concurrency", type=int, default=16, help="requests in flight (loadgen)")
    p.add_argument("--time-scale", type=float, default=20, help="emulator speed-up (model s per wall s)")
    p.add_argument("--wasm", default=os.path.join(TARGET, "wasm32-wasip1", "release", "kvroute_wasm.wasm"))
    p.add_argument("--emulator", default=os.path.join(TARGET, "release", "kvroute-emulator"))
    p.add_argument("--loadgen", default=os.path.join(TARGET, "release", "kvroute-loadgen"))
    p.add_argument("--plugin-config", default=os.path.join(HERE, "kvroute-bench.json"))
    p.add_argument("--work", default=os.path.join(os.environ.get("TMPDIR", "/tmp"), f"kvroute-stream-{os.getpid()}"))
    args = p.parse_args(argv)
    outputs = [int(x) for x in args.outputs.split(",")]
    if len(outputs) < 2:
        p.error("--outputs needs at least two lengths")
    for path in (args.wasm, args.emulator, args.loadgen):
        if not os.path.exists(path):
            sys.exit(f"streaming.py: {path} missing; see the build commands in --help")
    os.makedirs(args.work, exist_ok=True)
    envoy = bench.envoy_binary()
    arms = ["envoy-rr", "kvroute"]
    results = {a: {n: [] for n in outputs} for a in arms}
    try:
        ports = bench.free_ports(4 + 2 * len(arms))
        eps = [f"127.0.0.1:{q}" for q in ports[:4]]
        emu = bench.Proc("emulator", [args.emulator, "--ports", ",".join(str(q) for q in ports[:4]),
                                      "--time-scale", str(args.time_scale), "--accept-any-model"],
                         os.path.join(args.work, "emulator.log"))
        procs, urls = {}, {}
        for i, arm in enumerate(arms):
            port, admin = ports[4 + 2 * i], ports[5 + 2 * i]
            cfg = os.path.join(args.work, f"{arm}.yaml")
            argv_r = [sys.executable, os.path.join(bench.REPO, "envoy", "render.py"), "--endpoints", ",".join(eps),
                      "--listen-port", str(port), "--admin-port", str(admin), "--wasm", args.wasm,
                      "--plugin-config", args.plugin_config, "-o", cfg]
            if arm == "envoy-rr":
                argv_r.append("--baseline")
            subprocess.run(argv_r, check=True)
            procs[arm] = bench.Proc(arm, [envoy, "-c", cfg, "--concurrency", "2", "--use-dynamic-base-id",
                                          "-l", "warn"], os.path.join(args.work, f"{arm}.log"))
            urls[arm] = f"http://127.0.0.1:{port}"
        deadline = time.time() + 60
        while "READY" not in open(os.path.join(args.work, "emulator.log"), errors="replace").read():
            if time.time() > deadline or not emu.alive():
                sys.exit("streaming.py: the emulator did not come up")
            time.sleep(0.2)
        for arm in arms:
            bench.wait_ready(arm, urls[arm], procs[arm])
        time.sleep(2)  # the collector's first /metrics poll
        model_s = args.seconds * args.time_scale
        for rnd in range(args.rounds):
            for n in outputs:
                for arm in (arms if rnd % 2 == 0 else arms[::-1]):
                    out = os.path.join(args.work, f"{arm}-{n}-{rnd}.json")
                    before = procs[arm].cpu_ns()
                    subprocess.run([args.loadgen, "--target", urls[arm], "--endpoints", ",".join(eps),
                                    "--workload", "shared-prefix", "--api", "completions",
                                    "--output-tokens", str(n), "--time-scale", str(args.time_scale),
                                    "--stages", f"concurrency:{args.concurrency}@{model_s:.0f}s",
                                    "--json", out], check=True, stdout=subprocess.DEVNULL,
                                   stderr=subprocess.DEVNULL, timeout=args.seconds * 10 + 60)
                    cpu_ns = procs[arm].cpu_ns() - before
                    with open(out) as f:
                        doc = json.load(f)
                    stage = (doc["stages"] if isinstance(doc, dict) else doc)[0]
                    ok = stage.get("ok") or 0
                    if not ok:
                        sys.exit(f"streaming.py: {arm} completed no request at max_tokens {n}; see {out}")
                    per = cpu_ns / 1000 / ok
                    results[arm][n].append(per)
                    print(f"[stream] r{rnd} {arm:8} max_tokens {n:4}: {ok:5} requests, proxy {per:8.1f} µs/req",
                          flush=True)
    finally:
        bench.stop_all()
    med = {a: {n: statistics.median(v) for n, v in results[a].items()} for a in arms}
    lo, hi = outputs[0], outputs[-1]
    print(f"\nProxy CPU µs per request (median of {args.rounds} rounds), streaming completions, "
          f"{args.concurrency} in flight\n")
    print("| max_tokens | " + " | ".join(arms) + " | added by kvroute |")
    print("|---|" + "---|" * (len(arms) + 1))
    for n in outputs:
        print(f"| {n} | " + " | ".join(f"{med[a][n]:.1f}" for a in arms)
              + f" | {med['kvroute'][n] - med['envoy-rr'][n]:.1f} |")
    slope = {a: (med[a][hi] - med[a][lo]) / (hi - lo) for a in arms}
    print(f"\nPer streamed chunk (slope {lo}→{hi} tokens): envoy-rr {slope['envoy-rr']:.2f} µs, kvroute "
          f"{slope['kvroute']:.2f} µs, added by kvroute {slope['kvroute'] - slope['envoy-rr']:.2f} µs")
    with open(os.path.join(args.work, "streaming.json"), "w") as f:
        json.dump({"per_request_us": results, "median": med, "slope_us_per_chunk": slope}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""The relay's cost per POST /mesh/exchange (issue 43), on loopback.

Starts the release relay (no publisher: the exchange needs none), fills
its mesh ring from a "filler" proxy, then times two exchanges from one
keep-alive client, sequentially:

  (a) a post of 8 decisions of 64 hashes, answered with 256 decisions of
      64 hashes (limit 256, no cursor: the ring's oldest, all filler's);
  (b) a post of load only, answered with no decision (the cursor at the
      tip, nothing new from others);
  (c) for scale, GET /kv/events at the tip from the same client (what
      relay/README.md's "Cost" measured with wrk), and the idle relay.

CPU is the relay process's own (sum of /proc/PID/task/*/schedstat, ns), so
the client's share of the machine is not counted. Bytes are the JSON
bodies (HTTP heads excluded: about 100 bytes each way).

  python3 relay/bench/mesh_cost.py [--relay target/release/kvroute-relay] [--runs 3]
"""
import argparse
import glob
import http.client
import json
import os
import random
import subprocess
import sys
import time


def cpu_ns(pid):
    total = 0
    for f in glob.glob(f"/proc/{pid}/task/*/schedstat"):
        try:
            with open(f) as fh:
                total += int(fh.read().split()[0])
        except (OSError, ValueError, IndexError):
            pass  # a thread that ended
    return total


def decisions(n, hashes, rng):
    return [{"newBlocks": hashes, "hashes": [rng.getrandbits(64) for _ in range(hashes)]}
            for _ in range(n)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--relay", default="target/release/kvroute-relay")
    ap.add_argument("--port", type=int, default=39257)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--n-heavy", type=int, default=1000)
    ap.add_argument("--n-light", type=int, default=20000)
    args = ap.parse_args()
    rng = random.Random(43)

    relay = subprocess.Popen(
        [args.relay, "--sub", "tcp://127.0.0.1:1", "--listen", f"127.0.0.1:{args.port}"],
        stderr=subprocess.DEVNULL)
    try:
        conn = None
        for _ in range(100):
            try:
                conn = http.client.HTTPConnection("127.0.0.1", args.port, timeout=30)
                conn.request("GET", "/metrics")
                conn.getresponse().read()
                break
            except OSError:
                time.sleep(0.05)
        else:
            sys.exit("the relay did not start")

        def post(body):
            conn.request("POST", "/mesh/exchange", body)
            r = conn.getresponse()
            data = r.read()
            if r.status != 200:
                sys.exit(f"{r.status}: {data[:200]!r}")
            return data

        own = decisions(8, 64, rng)
        epoch = json.loads(post(json.dumps({"proxy": "probe"}).encode()))["epoch"]

        def fill():
            """2048 new filler decisions of 64 hashes; returns the seq before them."""
            before = json.loads(post(json.dumps({"proxy": "probe"}).encode()))["last"]
            for _ in range(8):
                post(json.dumps({"proxy": "filler", "decisions": decisions(256, 64, rng)}).encode())
            return before

        def heavy_body(after):
            return json.dumps({
                "proxy": "gateway-a", "epoch": epoch, "after": after, "limit": 256,
                "load": {"prompt": 12000, "output": 3000, "requests": 7}, "ttlMs": 2000,
                "decisions": own}).encode()

        def light_body(after):
            return json.dumps({
                "proxy": "gateway-b", "epoch": epoch, "after": after,
                "load": {"prompt": 12000, "output": 3000, "requests": 7}, "ttlMs": 2000}).encode()

        print(f"# {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())} "
              f"{os.cpu_count()} cores, load {' '.join(open('/proc/loadavg').read().split()[:3])}")
        print("case\trequests\treq_bytes\tanswer_bytes\tanswer_decisions\trelay_cpu_us_per_exchange"
              "\twall_us_per_exchange")
        for run in range(args.runs):
            # (a) from a cursor just before 2048 new filler decisions: each
            # answer is their first 256 (limit), the asker's own 8 come after.
            body = heavy_body(fill())
            for name, make, n in [("a: 8x64 posted, 256x64 answered", None, args.n_heavy),
                                  ("b: load only, empty answer", light_body, args.n_light)]:
                if make is not None:
                    # The cursor at the tip: nothing new from the others.
                    tip = json.loads(post(json.dumps({"proxy": "probe"}).encode()))["last"]
                    body = make(tip)
                answer = post(body)
                a = json.loads(answer)
                if make is None:
                    assert len(a["decisions"]) == 256 and a["more"] and not a["resync"], a["seq"]
                else:
                    assert not a["decisions"] and not a["resync"], a
                c0, t0 = cpu_ns(relay.pid), time.perf_counter()
                for _ in range(n):
                    post(body)
                c1, t1 = cpu_ns(relay.pid), time.perf_counter()
                a = json.loads(post(body))
                assert len(a["decisions"]) == (256 if make is None else 0) and not a["resync"]
                print(f"{name}\t{n}\t{len(body)}\t{len(answer)}\t{len(a['decisions'])}"
                      f"\t{(c1 - c0) / 1e3 / n:.1f}\t{(t1 - t0) * 1e6 / n:.0f}", flush=True)
            # The same client's baseline: GET /kv/events at the tip (nothing
            # to send), and the relay idle for 2 s.
            def get(path):
                conn.request("GET", path)
                r = conn.getresponse()
                return r.read()
            tip_answer = get("/kv/events?after=0")
            n = args.n_light
            c0, t0 = cpu_ns(relay.pid), time.perf_counter()
            for _ in range(n):
                get("/kv/events?after=0")
            c1, t1 = cpu_ns(relay.pid), time.perf_counter()
            print(f"c: GET /kv/events at the tip (baseline)\t{n}\t0\t{len(tip_answer)}\t0"
                  f"\t{(c1 - c0) / 1e3 / n:.1f}\t{(t1 - t0) * 1e6 / n:.0f}", flush=True)
            c0 = cpu_ns(relay.pid)
            time.sleep(2)
            print(f"# idle relay: {(cpu_ns(relay.pid) - c0) / 2e3:.1f} us CPU per second", flush=True)
        conn.close()
    finally:
        relay.terminate()
        relay.wait()


if __name__ == "__main__":
    main()

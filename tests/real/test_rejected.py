"""Affinity survives another client's rejected requests, on real vLLM
(issue 40, point 1; DESIGN.md §4 "Only accepted work changes state").

Envoy + kvroute (the shipped profile, the tier's block size) in front of the
two real servers (`--max-model-len 4096`, 256 blocks of 32 tokens). Four
users each grow a conversation (completions, the previous turn's text plus a
new question each turn). The workload runs twice on fresh gateways, with other
text each time: alone, then while a second client sends over-length chat
requests (~4,300 words), which vLLM answers at once with a 400 before any
prefill. Each time every user's first turn is placed first, then their later
turns go out in rounds, all users at once.

What must hold: the share of later turns served by the user's previous server
and the servers' own prefix-cache hit ratio over them (`vllm:prefix_cache_*`)
stay within 0.02 of the run without the flood, and a burst of rejected requests
alone leaves every endpoint's insert counter and routed prompt bytes as they
were. Before the fix each rejected prompt aged its endpoint's index entries
(an over-length prompt is ~165 of the 256 blocks kvroute believes a server
holds), so users were placed again as if cold. The users' contexts are kept
short (~60 blocks per server) so that one rejected request in flight at a time,
before its 400, cannot age their entries out even if a fix records and then
undoes it.
"""

import threading
import time

from conftest import MODEL, e2e, real_plugin_config, scrape, words

USERS = 4
TURNS = 4
CONTEXT_WORDS = 600
TURN_WORDS = 60
FLOOD_WORDS = 4300
FLOOD_PER_S = 6.0
THINK_S = 0.5  # between a user's turns (the flood runs on)
TOLERANCE = 0.02


def _counters(addrs):
    out = {}
    for a in addrs:
        _, v, _ = scrape(a)
        out[a] = (v.get("vllm:prefix_cache_queries_total", 0.0), v.get("vllm:prefix_cache_hits_total", 0.0),
                  v.get("vllm:request_success_total", 0.0))
    return out


def _state(e):
    return {x["address"]: {k: x[k] for k in ("insertCounter", "routedPromptBytes", "inflightRequests")}
            for x in e.state()["endpoints"]}


class Flood:
    """Over-length chat requests from a second client, each a new prefix."""

    def __init__(self, port, tag):
        self.port, self.tag, self.n = port, tag, 0
        self.results, self.threads = [], []
        self.lock = threading.Lock()
        self.stop_event = threading.Event()

    def one(self):
        n = self.n
        self.n += 1
        body = {"model": MODEL, "max_tokens": 8, "stream": n % 2 == 0,
                "messages": [{"role": "user", "content": words(f"{self.tag}-flood-{n}", FLOOD_WORDS)}]}

        def send():
            try:
                r = e2e.post(self.port, "/v1/chat/completions", body, timeout=120)
                res = (r.status, r.body[:300])
            except OSError as ex:
                res = ("error", repr(ex).encode())
            with self.lock:
                self.results.append(res)

        t = threading.Thread(target=send, daemon=True)
        t.start()
        self.threads.append(t)

    def burst(self, n):
        for _ in range(n):
            self.one()
        self.join()

    def start(self):
        def loop():
            while not self.stop_event.is_set():
                self.one()
                self.stop_event.wait(1.0 / FLOOD_PER_S)

        self.loop = threading.Thread(target=loop, daemon=True)
        self.loop.start()

    def stop(self):
        self.stop_event.set()
        self.loop.join(timeout=10)
        self.join()

    def join(self):
        for t in self.threads:
            t.join(timeout=180)
        assert not any(t.is_alive() for t in self.threads), "a flood request never finished"

    def check_all_rejected(self):
        bad = [r for r in self.results if r[0] != 400 or b"context length" not in r[1]]
        assert not bad, f"{len(bad)} of {len(self.results)} over-length requests not answered 400: {bad[:3]}"


def _phase(real_fleet, envoy, tag, flood):
    addrs = real_fleet.addresses
    e = envoy(config=real_plugin_config(), endpoints=addrs)
    e2e.wait_until(lambda: all((x.get("metrics") or {}).get("fresh") and x["capacityBlocks"] == 256
                               for x in e.state()["endpoints"]),
                   timeout=30, what="fresh metrics (256 blocks of 32 tokens) for every endpoint")
    prompts = {u: words(f"{tag}-user-{u}-context", CONTEXT_WORDS) for u in range(USERS)}
    served = {u: [] for u in range(USERS)}
    branches = {u: [] for u in range(USERS)}

    def turn(u, k):
        if k > 0:
            prompts[u] += f"\nquestion {k}: " + words(f"{tag}-user-{u}-q{k}", TURN_WORDS)
        body = {"model": MODEL, "prompt": prompts[u], "max_tokens": 4, "temperature": 0,
                "stream": (u + k) % 2 == 0}
        if body["stream"]:
            body["stream_options"] = {"include_usage": True}
        r = e2e.post(e.port, "/v1/completions", body, timeout=180)
        assert r.status == 200, r
        d = r.decision
        assert d and d.get("endpoint") in addrs, r
        served[u].append(d["endpoint"])
        branches[u].append(d.get("branch"))

    for u in range(USERS):
        turn(u, 0)
    out = {"placement": [served[u][0] for u in range(USERS)]}
    fl = None
    if flood:
        fl = Flood(e.port, tag)
        before, accepted = _state(e), _counters(addrs)
        fl.burst(6)
        e2e.wait_until(lambda: all(x["inflightRequests"] == 0 for x in _state(e).values()), timeout=30,
                       what="no request in flight after the burst")
        out["burst"] = (before, _state(e))
        assert _counters(addrs) == accepted, "a server counted a request of the burst"
        fl.start()
    c0 = _counters(addrs)
    errors = []
    t0 = time.monotonic()
    for k in range(1, TURNS + 1):
        def run(u, k=k):
            try:
                turn(u, k)
            except Exception as ex:  # noqa: BLE001
                errors.append(ex)

        threads = [threading.Thread(target=run, args=(u,)) for u in range(USERS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
        assert not errors, errors
        time.sleep(THINK_S)
    out["wall_s"] = time.monotonic() - t0
    c1 = _counters(addrs)
    if fl:
        fl.stop()
        fl.check_all_rejected()
        out["flood"] = len(fl.results)
    q = sum(c1[a][0] - c0[a][0] for a in addrs)
    h = sum(c1[a][1] - c0[a][1] for a in addrs)
    out["hit_ratio"] = h / q
    out["stickiness"] = sum(served[u][k] == served[u][k - 1] for u in range(USERS)
                            for k in range(1, TURNS + 1)) / (USERS * TURNS)
    out["branches"] = branches
    e.assert_alive()
    e.process.stop()
    return out


def test_affinity_survives_rejected_over_length_requests(real_fleet, envoy):
    calm = _phase(real_fleet, envoy, "calm", flood=False)
    stormy = _phase(real_fleet, envoy, "storm", flood=True)
    before, after = stormy["burst"]
    print(f"\nwithout flood: hit ratio {calm['hit_ratio']:.3f}, stickiness {calm['stickiness']:.3f}, "
          f"placement {calm['placement']}")
    print(f"with flood ({stormy['flood']} rejected requests over {stormy['wall_s']:.1f} s): hit ratio "
          f"{stormy['hit_ratio']:.3f}, stickiness {stormy['stickiness']:.3f}, branches {stormy['branches']}")
    print(f"state around a burst of 6 rejected requests: before {before}\n  after {after}")

    assert len(set(calm["placement"])) == 2 and len(set(stormy["placement"])) == 2, (calm, stormy)
    assert calm["stickiness"] >= 0.95, calm
    assert calm["hit_ratio"] >= 0.6, calm
    for a in real_fleet.addresses:
        assert after[a]["insertCounter"] == before[a]["insertCounter"], \
            f"{a}: rejected requests advanced the eviction clock: {before[a]} -> {after[a]}"
        assert after[a]["routedPromptBytes"] == before[a]["routedPromptBytes"], \
            f"{a}: rejected requests' bytes reached the bytes-per-token learner: {before[a]} -> {after[a]}"
    assert stormy["stickiness"] >= calm["stickiness"] - TOLERANCE, (calm["stickiness"], stormy["stickiness"])
    assert abs(stormy["hit_ratio"] - calm["hit_ratio"]) <= TOLERANCE, (calm["hit_ratio"], stormy["hit_ratio"])

"""KV events from real vLLM through kvroute-relay into the collector (in real Envoy).

Each real server binds its KV-event PUB on a local socket file; two
subscribers connect from before the first event (conftest.real_fleet): the
tests' own pyzmq sink, which keeps every raw message, and kvroute-relay. The
expected held set is computed here from the sink's messages alone (msgpack,
vLLM's BlockStored / BlockRemoved / AllBlocksCleared), so the check trusts
neither the relay nor kvroute's codec:

(a) the relay subscribes to a real server: its snapshot equals the sink's set;
(b) the collector's held view (the state JSON through real Envoy) equals it;
(c) after the small KV cache (256 blocks) evicts, the view no longer claims
    the evicted blocks.
"""

import time

import msgpack
import pytest

from conftest import BLOCK_SIZE, MODEL, NUM_BLOCKS, e2e, real_plugin_config

MASK = 2**64 - 1


def _hash(h):
    return int.from_bytes(h, "big") & MASK if isinstance(h, (bytes, bytearray)) else int(h) & MASK


def truth(messages):
    """(held set, removed-ever set, last seq) from a sink's raw messages, in order."""
    held, removed, last = set(), set(), None
    for topic, seq_frame, payload in messages:
        seq = int.from_bytes(seq_frame, "big")
        assert last is None and seq == 0 or seq == last + 1, f"the sink missed batches: {last} -> {seq}"
        last = seq
        batch = msgpack.unpackb(payload, raw=False, strict_map_key=False)
        for ev in batch[1]:
            kind = ev["type"] if isinstance(ev, dict) else ev[0]
            hashes = ev.get("block_hashes", []) if isinstance(ev, dict) else (ev[1] if len(ev) > 1 else [])
            hs = {_hash(h) for h in hashes or []}
            if kind == "BlockStored":
                held |= hs
                removed -= hs
            elif kind == "BlockRemoved":
                held -= hs
                removed |= hs
            elif kind == "AllBlocksCleared":
                removed |= held
                held.clear()
    return held, removed, last


def quiet(sink, settle=1.5, timeout=60):
    deadline = time.monotonic() + timeout
    n, since = len(sink.snapshot()), time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.1)
        m = len(sink.snapshot())
        if m != n:
            n, since = m, time.monotonic()
        elif time.monotonic() - since >= settle:
            break
    return sink.snapshot()


def send(port, prompt):
    r = e2e.post(port, "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 1, "temperature": 0},
                 timeout=120)
    assert r.status == 200, r
    return r


def tokens(seed, n):
    x = seed * 2654435761 % 2**32
    out = []
    for _ in range(n):
        x = (x * 1103515245 + 12345) % 2**31
        out.append(x % 4000 + 3)
    return out


@pytest.fixture
def kv_envoy(real_fleet, envoy):
    assert len(real_fleet.relays) == 2, "kvroute-relay is not built (cargo build --bin kvroute-relay)"
    cfg = real_plugin_config()
    cfg["kvEvents"] = {
        "enabled": True,
        "pollMs": 200,
        "timeoutMs": 3000,
        "staleMs": 10000,
        "maxHeldBlocks": NUM_BLOCKS,
        "relays": {s.address: r.address for s, r in zip(real_fleet.servers, real_fleet.relays)},
    }
    return envoy(cfg, endpoints=real_fleet.addresses)


def held_view(e, address):
    return e.state_by_address()[address]["kvEvents"]


def relay_snapshot(relay):
    host, port = relay.address.rsplit(":", 1)
    r = e2e.request(int(port), "GET", "/kv/snapshot", timeout=10)
    assert r.status == 200, r
    return r.json()


def test_relay_and_collector_hold_what_the_real_servers_published(real_fleet, kv_envoy):
    e = kv_envoy
    addrs = real_fleet.addresses
    # Prompts through Envoy (kvroute places them), and one straight to each
    # server (the gateway never saw it; the events still tell).
    for k in range(4):
        send(e.port, tokens(10 + k, 6 * BLOCK_SIZE + 5))
    for i, a in enumerate(addrs):
        send(int(a.rsplit(":", 1)[1]), tokens(50 + i, 3 * BLOCK_SIZE))
    for i, a in enumerate(addrs):
        want, _, last = truth(quiet(real_fleet.sinks[i]))
        assert want, f"server {i} published no stored block"
        # (a) the relay's snapshot is the sink's set, from seq 0: complete.
        snap = e2e.wait_until(lambda: (s := relay_snapshot(real_fleet.relays[i])) and set(s["blocks"]) == want and s,
                              timeout=20, what=f"relay {i} snapshot == sink set")
        assert snap["complete"] is True, snap
        # (b) the collector's view, through Envoy, is the same set.
        v = e2e.wait_until(lambda: (x := held_view(e, a)) and x.get("hashes") is not None
                           and set(x["hashes"]) == want and x,
                           timeout=20, what=f"held view of {a} == sink set ({len(want)} blocks, seq {last})")
        assert v["fresh"] is True and v["complete"] is True, v
        assert v["blocks"] == len(want)
    assert e.wasm_failures() == {}


def test_after_real_evictions_the_view_drops_the_evicted_blocks(real_fleet, kv_envoy):
    e = kv_envoy
    a = real_fleet.addresses[0]
    port = int(a.rsplit(":", 1)[1])
    sink = real_fleet.sinks[0]
    send(port, tokens(900, 8 * BLOCK_SIZE))
    # Distinct prompts worth 1.5x the cache (256 blocks): vLLM evicts.
    per = 3000 // BLOCK_SIZE * BLOCK_SIZE
    for k in range(NUM_BLOCKS * BLOCK_SIZE * 3 // 2 // per + 1):
        send(port, tokens(1000 + k, per))
    held, removed, last = truth(quiet(sink))
    assert removed, "the real server evicted nothing; the test proves nothing"
    v = e2e.wait_until(lambda: (x := held_view(e, a)) and x.get("hashes") is not None
                       and set(x["hashes"]) == held and x,
                       timeout=20, what=f"held view == sink set after evictions (seq {last})")
    assert not set(v["hashes"]) & removed, "the view still claims evicted blocks"
    assert v["blocks"] <= NUM_BLOCKS
    assert e.wasm_failures() == {}

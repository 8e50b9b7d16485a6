"""KV events end to end: emulator (ZMQ PUB) -> kvroute-relay -> collector in real Envoy.

Each emulated server runs in its own `kvroute-emulator` process (so one can
be restarted on the same ports) and publishes vLLM-format KV events; one
real `kvroute-relay` subscribes to each; the collector (kvEvents.enabled)
polls the relays through the `kvroute_relays` ORIGINAL_DST cluster that
render.py adds, and the state view lists each endpoint's held hashes.

The expected hashes are computed here, independently of the emulator, the
relay and the filter: vLLM's sha256_cbor chain over the token IDs of a
token-ID prompt (a small canonical CBOR encoder below, checked against
testdata/vllm/block-hash-sha256-cbor-vectors.json, which vLLM's own functions wrote).
"""

import hashlib
import json
import os
import re
import struct
import time

import pytest

from conftest import (
    MODEL,
    REPO,
    TARGET_DIR,
    Process,
    free_ports,
    plugin_config,
    post,
    request,
    wait_until,
)

RELAY = os.environ.get("KVROUTE_RELAY") or os.path.join(TARGET_DIR, "debug", "kvroute-relay")
BLOCK = 16  # emulator --block-size (tokens)
SEED = "0"  # PYTHONHASHSEED of the emulator's hashes (--python-hash-seed)


# --------------------------------------------------------------------------
# vLLM's block hashes, computed here (canonical CBOR of the few shapes used)


def _cbor_head(major, n):
    if n < 24:
        return bytes([major << 5 | n])
    for extra, fmt in ((24, ">B"), (25, ">H"), (26, ">I"), (27, ">Q")):
        if n < 1 << (8 * struct.calcsize(fmt)):
            return bytes([major << 5 | extra]) + struct.pack(fmt, n)
    raise ValueError(n)


def cbor(v):
    if v is None:
        return b"\xf6"
    if isinstance(v, bool):
        raise TypeError("bool")
    if isinstance(v, int):
        return _cbor_head(0, v) if v >= 0 else _cbor_head(1, -1 - v)
    if isinstance(v, bytes):
        return _cbor_head(2, len(v)) + v
    if isinstance(v, str):
        b = v.encode()
        return _cbor_head(3, len(b)) + b
    if isinstance(v, (list, tuple)):
        return _cbor_head(4, len(v)) + b"".join(cbor(x) for x in v)
    raise TypeError(type(v))


def block_hashes(tokens, block_size=BLOCK, seed=SEED):
    """The u64 event hashes of each full block of `tokens`."""
    parent = hashlib.sha256(cbor(seed)).digest()
    out = []
    for i in range(len(tokens) // block_size):
        parent = hashlib.sha256(cbor([parent, list(tokens[i * block_size:(i + 1) * block_size]), None])).digest()
        out.append(int.from_bytes(parent, "big") & (2**64 - 1))
    return out


def test_the_hash_helper_matches_the_cbor2_vectors():
    with open(os.path.join(REPO, "testdata", "vllm", "block-hash-sha256-cbor-vectors.json")) as f:
        cases = json.load(f)
    checked = 0
    for c in cases:
        # The helper hashes no extra keys (a salt, a LoRA adapter's).
        if c.get("cache_salt") or c.get("lora_name"):
            continue
        # The seed vLLM used (its default when PYTHONHASHSEED was unset).
        seed = c.get("resolved_seed", c["python_hash_seed"])
        assert block_hashes(c["token_ids"], c["block_size"], seed) == c["block_hashes_u64"], c["name"]
        checked += 1
    assert checked >= 1


# --------------------------------------------------------------------------
# processes


@pytest.fixture(scope="module")
def relay_binary():
    if os.environ.get("KVROUTE_E2E_NO_BUILD") != "1" and "KVROUTE_RELAY" not in os.environ:
        import subprocess

        p = subprocess.run(["cargo", "build", "--bin", "kvroute-relay"], cwd=REPO, capture_output=True, text=True)
        if p.returncode != 0:
            pytest.fail(f"cargo build --bin kvroute-relay failed:\n{p.stderr[-3000:]}", pytrace=False)
    if not os.path.exists(RELAY):
        pytest.fail(f"{RELAY} is missing; cargo build --bin kvroute-relay", pytrace=False)
    return RELAY


class Server:
    """One emulated vLLM server (its own process) and its relay."""

    def __init__(self, tmp_path, artifacts, relay_bin, name, blocks):
        self.tmp_path = tmp_path
        self.artifacts = artifacts
        self.relay_bin = relay_bin
        self.name = name
        self.blocks = blocks
        self.port, self.kv_port, self.relay_port = free_ports(3)
        self.address = f"127.0.0.1:{self.port}"
        self.relay_address = f"127.0.0.1:{self.relay_port}"
        self.emulator = None
        self.relay = None
        self.starts = 0

    def start_emulator(self):
        self.starts += 1
        cmd = [self.artifacts["emulator"], "--ports", str(self.port), "--model", MODEL,
               "--block-size", str(BLOCK), "--num-gpu-blocks", str(self.blocks),
               "--kv-events-port-base", str(self.kv_port), "--python-hash-seed", SEED,
               "--kv-events-topic", f"kv@{self.name}"]
        self.emulator = Process(f"emulator-{self.name}#{self.starts}", cmd,
                                str(self.tmp_path / f"emulator-{self.name}-{self.starts}.log"))
        text = self.emulator.wait_for_log("READY", timeout=30)
        assert f"KV_EVENTS tcp://127.0.0.1:{self.kv_port}" in text, text

    def start_relay(self):
        cmd = [self.relay_bin, "--sub", f"tcp://127.0.0.1:{self.kv_port}", "--topic", f"kv@{self.name}",
               "--listen", self.relay_address, "--max-blocks", str(self.blocks)]
        self.relay = Process(f"relay-{self.name}", cmd, str(self.tmp_path / f"relay-{self.name}.log"))
        self.relay.wait_for_log("serving http://", timeout=30)
        # The SUB connects asynchronously; a PUB drops what it sends before.
        wait_until(lambda: self.relay_get("/healthz").status == 200, timeout=10, what="relay /healthz")
        time.sleep(1.0)

    def relay_get(self, path):
        return request(self.relay_port, "GET", path, timeout=5)

    def complete(self, tokens, via_port=None, max_tokens=2):
        body = {"model": MODEL, "prompt": tokens, "max_tokens": max_tokens}
        r = post(via_port or self.port, "/v1/completions", body)
        assert r.status == 200, r
        return r

    def stop(self):
        for p in (self.relay, self.emulator):
            if p is not None:
                p.stop()


@pytest.fixture
def servers(artifacts, relay_binary, tmp_path):
    made = []

    def make(n, blocks=4096):
        for i in range(n):
            s = Server(tmp_path, artifacts, relay_binary, f"s{len(made)}", blocks)
            made.append(s)
            s.start_emulator()
            s.start_relay()
        return made[-n:]

    yield make
    for s in reversed(made):
        s.stop()


def kv_config(servers, mode="singleton", **kv):
    cfg = plugin_config(endpoints={"static": [s.address for s in servers]}, collector={"mode": mode})
    cfg["kvEvents"] = {
        "enabled": True,
        "pollMs": 100,
        "staleMs": 1500,
        "relays": {s.address: s.relay_address for s in servers},
        **kv,
    }
    return cfg


def held(envoy, address):
    return envoy.state_by_address()[address]["kvEvents"]


def stat(envoy, name):
    body = envoy.admin(f"/stats?filter={name}").body.decode()
    m = re.search(rf"{re.escape(name)}: (\d+)", body)
    return int(m.group(1)) if m else 0


def tokens(seed, n):
    # Token IDs, distinct per seed (a tiny LCG; any ints below the vocab do).
    x = seed * 7919 + 1
    out = []
    for _ in range(n):
        x = (x * 1103515245 + 12345) % (2**31)
        out.append(x % 30000)
    return out


# --------------------------------------------------------------------------
# tests


@pytest.mark.parametrize("mode", ["singleton", "lease"])
def test_held_blocks_match_what_the_servers_published(envoy, servers, mode):
    a, b = servers(2)
    e = envoy(kv_config([a, b], mode), endpoints=[a.address, b.address])
    wait_until(lambda: all(held(e, s.address).get("fresh") for s in (a, b)), timeout=10,
               what="both relays polled")
    assert held(e, a.address)["blocks"] == 0
    p1, p2 = tokens(1, 5 * BLOCK + 3), tokens(2, 3 * BLOCK)
    # Through Envoy: wherever kvroute routes the prompt, that server's held
    # set must gain exactly its blocks.
    r = a.complete(p1, via_port=e.port)
    chosen = r.headers.get("x-kvroute-served-by") or r.decision["endpoint"]
    b.complete(p2)  # straight to b: the gateway did not route it, the events still tell
    want = {s.address: set() for s in (a, b)}
    want[chosen] |= set(block_hashes(p1))
    want[b.address] |= set(block_hashes(p2))
    wait_until(lambda: all(set(held(e, addr)["hashes"]) == hs for addr, hs in want.items()), timeout=10,
               what=f"held sets {want}")
    for addr, hs in want.items():
        v = held(e, addr)
        assert v["blocks"] == len(hs)
        # A relay that saw its server's first batch (vLLM seq 0) knows its
        # set whole; one that saw nothing yet does not.
        assert v["complete"] is bool(hs), v
        assert v["relay"] == {s.address: s.relay_address for s in (a, b)}[addr]
    assert stat(e, "wasmcustom.kvroute_kv_events_bad_answers") == 0
    # The collector keeps polling (the waits above may end within 4 polls).
    wait_until(lambda: stat(e, "wasmcustom.kvroute_kv_events_polls") > 4, timeout=10, what="a fifth poll")
    # A client cannot reach a relay through the gateway: no route uses the
    # relay cluster, whatever ORIGINAL_DST header the client sends.
    r = request(e.port, "GET", "/kv/snapshot", headers={"x-envoy-original-dst-host": a.relay_address})
    assert b'"blocks"' not in r.body, r
    assert e.wasm_failures() == {}


def test_evictions_leave_the_held_view(envoy, servers):
    (a,) = servers(1, blocks=24)
    e = envoy(kv_config([a]), endpoints=[a.address])
    wait_until(lambda: held(e, a.address).get("fresh"), timeout=10, what="relay polled")
    first = tokens(10, 8 * BLOCK)
    a.complete(first)
    wait_until(lambda: set(block_hashes(first)) <= set(held(e, a.address)["hashes"]), timeout=10,
               what="first prompt held")
    # 8 more distinct 8-block prompts into a 24-block cache: the first is evicted.
    later = [tokens(11 + i, 8 * BLOCK) for i in range(8)]
    for p in later:
        a.complete(p, via_port=e.port)
    last = set(block_hashes(later[-1]))

    def settled():
        v = held(e, a.address)
        hs = set(v["hashes"])
        return last <= hs and not (hs & set(block_hashes(first))) and v

    v = wait_until(settled, timeout=10, what="the evicted blocks gone from the held view")
    assert v["blocks"] <= 24

    # Once the last events are in, the view counts what the server caches.
    def counts():
        view, stats = held(e, a.address), request(a.port, "GET", "/emulator/stats").json()
        return view["blocks"] == stats["cached_blocks"] and (view["blocks"], stats["cached_blocks"])

    wait_until(counts, timeout=10, what="held blocks == the emulator's cached_blocks")


def test_a_dead_relay_goes_stale_and_requests_still_route(envoy, servers):
    a, b = servers(2)
    e = envoy(kv_config([a, b], staleMs=800), endpoints=[a.address, b.address])
    wait_until(lambda: all(held(e, s.address).get("fresh") for s in (a, b)), timeout=10, what="both polled")
    a.relay.stop()
    wait_until(lambda: held(e, a.address)["fresh"] is False, timeout=10, what="a's view stale")
    assert held(e, b.address)["fresh"] is True
    wait_until(lambda: stat(e, "wasmcustom.kvroute_kv_events_stale_endpoints") == 1, timeout=5,
               what="stale gauge = 1")
    assert stat(e, "wasmcustom.kvroute_kv_events_poll_failures") > 0
    served = set()
    for i in range(8):
        r = a.complete(tokens(100 + i, 2 * BLOCK), via_port=e.port)
        served.add(r.decision["endpoint"])
    assert served <= {a.address, b.address}
    assert e.wasm_failures() == {}


def test_a_publisher_restart_resyncs_the_view(envoy, servers):
    (a,) = servers(1)
    e = envoy(kv_config([a]), endpoints=[a.address])
    wait_until(lambda: held(e, a.address).get("fresh"), timeout=10, what="relay polled")
    old = [tokens(200 + i, 4 * BLOCK) for i in range(6)]
    for p in old:
        a.complete(p)
    old_hashes = set().union(*(block_hashes(p) for p in old))
    wait_until(lambda: set(held(e, a.address)["hashes"]) == old_hashes, timeout=10, what="old set held")
    resyncs = stat(e, "wasmcustom.kvroute_kv_events_resyncs")
    # The server restarts (same ports): its cache is empty, its seq starts at 0.
    a.emulator.stop()
    a.start_emulator()
    time.sleep(1.0)  # the relay's SUB reconnects
    # A PUB drops what it sends before the SUB has reconnected: a first
    # request whose events may be lost, then the ones the test checks.
    a.complete(tokens(299, 2 * BLOCK))
    time.sleep(0.5)
    new = [tokens(300, 3 * BLOCK), tokens(301, 2 * BLOCK)]
    for p in new:
        a.complete(p)
    want = set().union(*(block_hashes(p) for p in new))

    def resynced():
        hs = set(held(e, a.address)["hashes"])
        return stat(e, "wasmcustom.kvroute_kv_events_resyncs") > resyncs and want <= hs and not (hs & old_hashes)

    wait_until(resynced, timeout=15, what="a resync and a view without the old blocks")
    # The server lost its cache: kvroute's approximate index forgot it too.
    assert stat(e, "wasmcustom.kvroute_kv_events_index_resets") >= 1
    assert e.wasm_failures() == {}

"""Precise mode's hashes of a LoRA adapter's requests on real vLLM 0.32.

One server of the tier's tiny model (its own fixture: the other tests'
fleet is unchanged) started with `--enable-lora --lora-modules
NAME=PATH --max-loras 1` and a tiny random adapter written by make_lora.py.
vLLM hashes every block of a request for NAME with the extra key
`("lora", NAME, PATH)`.

kvroute's side is the `vllm_hashes` example given the server's own
`GET /v1/models` answer: recorded as the collector records it (the shared
models table keeps each adapter's `root`), the adapter's path read back as
the request path reads it, and the prompt hashed with `(NAME, path)`.

Checked, block for block against the chain of the server's `BlockStored`
events: a token-ID completion for NAME; the same with a `cache_salt` (the
salt after the LoRA key on block 0); and the base model's request for the
same prompt, whose hashes (no LoRA key) equal its own chain and differ from
the adapter's in every block.

Through Envoy + kvroute in precise mode (`tokenizeIn: worker`, a
kvroute-relay on the server's events): the collector learns the adapter's
path from `/v1/models`; an adapter request sent a second time is matched on
the blocks the server holds (affinity 1 in the decision header, counted in
`kvroute_precise_matched`, no LoRA fallback), and the base model's request
for the same prompt matches none of them.
"""

import json
import secrets
import shutil
import subprocess
import tempfile
import time

import pytest

import make_lora
import vllm_tier
from conftest import (_LIVE, BLOCK_SIZE, MODEL, NUM_BLOCKS, REPO, EventSink, RelayProcess, e2e, precise_plugins,
                      real_plugin_config)
from test_hash_parity import _quiet, _stored_chain

ADAPTER = "sql-lora"


@pytest.fixture(scope="module")
def lora_server(tmp_path_factory):
    """One real vLLM server with adapter ADAPTER loaded, and a KV-event sink."""
    try:
        vllm_tier.ensure_setup()
    except Exception as ex:  # noqa: BLE001
        pytest.skip(f"the real-vLLM venv cannot be built here ({ex}); see tests/real/README.md")
    log_dir = tmp_path_factory.mktemp("vllm-lora")
    adapter = make_lora.write_adapter(log_dir / "adapters" / ADAPTER, vllm_tier.model_dir())
    ipc_dir = tempfile.mkdtemp(prefix="kvr-lora-")
    endpoint = f"ipc://{ipc_dir}/vllm0.sock"
    sink = EventSink(connect=endpoint)
    _LIVE.append(sink)
    port, relay_port = vllm_tier.free_ports(2)
    relay = RelayProcess(endpoint, "kv@real0", relay_port, log_dir / "relay0.log")
    _LIVE.append(relay)
    f = vllm_tier.Fleet(1, log_dir=log_dir, blocks=NUM_BLOCKS, ports=[port], event_ports=[endpoint],
                        extra_args=["--enable-lora", "--lora-modules", f"{ADAPTER}={adapter}",
                                    "--max-loras", "1", "--max-lora-rank", str(make_lora.RANK)])
    _LIVE.append(f)
    t0 = time.monotonic()
    f.start(timeout=900)
    print(f"\n[real] LoRA vLLM server healthy in {time.monotonic() - t0:.0f} s: {f.addresses}; logs in {log_dir}")
    f.sink, f.relay, f.adapter, f.log_dir = sink, relay, adapter, log_dir
    try:
        yield f
    finally:
        f.stop()
        sink.stop()
        relay.stop()
        shutil.rmtree(ipc_dir, ignore_errors=True)
        for obj in (f, sink, relay):
            if obj in _LIVE:
                _LIVE.remove(obj)


@pytest.fixture(scope="module")
def lora_hasher(lora_server, tmp_path_factory):
    """kvroute's hashes of a body (the vllm_hashes example), with the
    server's /v1/models answer as the collector records it."""
    out = tmp_path_factory.mktemp("lora-hashes")
    cfg = {"endpoints": {"static": ["127.0.0.1:1"]}, "plugins": precise_plugins(lora_server),
           "kvEvents": {"enabled": True}}
    cfg_path = out / "precise.json"
    cfg_path.write_text(json.dumps(cfg))
    r = e2e.request(lora_server.servers[0].port, "GET", "/v1/models", timeout=30)
    assert r.status == 200, r
    models = json.loads(r.body)
    cards = {c["id"]: c for c in models["data"]}
    assert cards[ADAPTER]["root"] == str(lora_server.adapter) and cards[ADAPTER]["parent"] == MODEL, cards
    models_path = out / "models.json"
    models_path.write_bytes(r.body)
    subprocess.run(["cargo", "build", "-q", "-p", "kvroute-core", "--example", "vllm_hashes"], cwd=REPO,
                   check=True, timeout=900)
    exe = REPO / "target" / "debug" / "examples" / "vllm_hashes"

    def run(body):
        p = out / f"body-{secrets.token_hex(4)}.json"
        p.write_text(json.dumps(body))
        r = subprocess.run([str(exe), str(cfg_path), "completions", str(p), str(models_path)],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, f"kvroute did not hash precisely: {r.stdout} {r.stderr}"
        return json.loads(r.stdout)

    return run


def _fresh_ids(n):
    # Vocabulary 4096; ids 0-2 are the special tokens.
    return [3 + secrets.randbelow(4000) for _ in range(n)]


def _served_chain(server, body):
    """The stored chain of `body`'s prompt on the server: [(hash, tokens)]."""
    sink = server.sink
    start = len(sink.snapshot())
    r = e2e.post(server.servers[0].port, "/v1/completions", dict(body, max_tokens=1, temperature=0),
                 timeout=180)
    assert r.status == 200, r
    assert r.json()["model"] == body["model"], r.json()
    assert r.json()["usage"]["prompt_tokens"] == len(body["prompt"]), r.json()["usage"]
    return _stored_chain(_quiet(sink, start), body["prompt"][:BLOCK_SIZE])


def _equal_chain(chain, ids, hashes):
    # The one generated token may complete one more block; the prompt's
    # full blocks come first.
    assert len(chain) in (len(hashes), len(hashes) + 1), (len(chain), len(hashes))
    assert [t for _, t in chain[:len(hashes)]] == [ids[i * BLOCK_SIZE:(i + 1) * BLOCK_SIZE]
                                                   for i in range(len(hashes))], "token IDs differ"
    assert [h for h, _ in chain[:len(hashes)]] == hashes, "block hashes differ"


@pytest.mark.parametrize("salt", [None, "tenant-a"])
def test_lora_adapter_hashes_equal_vllms(lora_server, lora_hasher, salt):
    ids = _fresh_ids(5 * BLOCK_SIZE + 7)
    body = {"model": ADAPTER, "prompt": ids}
    if salt:
        body["cache_salt"] = salt
    ours = lora_hasher(body)
    assert ours["lora"] == {"name": ADAPTER, "path": str(lora_server.adapter)}, ours
    hashes = ours["hashes"]
    assert ours["token_ids"] == ids and len(hashes) == 5
    _equal_chain(_served_chain(lora_server, body), ids, hashes)

    # The base model's request for the same prompt: no LoRA key, its own
    # chain, and no block in common with the adapter's.
    base_body = dict(body, model=MODEL)
    base = lora_hasher(base_body)
    assert base["lora"] is None, base
    assert all(a != b for a, b in zip(base["hashes"], hashes)), (base["hashes"], hashes)
    _equal_chain(_served_chain(lora_server, base_body), ids, base["hashes"])


def _stat(g, name):
    import re

    body = g.admin(f"/stats?filter={name}").body.decode()
    return sum(int(v) for v in re.findall(rf"{re.escape(name)}: (\d+)", body))


def _affinity(r):
    d = r.headers.get(e2e.DECISION, "")
    return float(dict(kv.split("=", 1) for kv in d.split(";") if "=" in kv)["affinity"])


def test_lora_requests_through_envoy_match_the_servers_held_blocks(lora_server, envoy):
    assert lora_server.relay.proc is not None, "kvroute-relay is not built (cargo build --bin kvroute-relay)"
    server = lora_server.servers[0]
    cfg = real_plugin_config()
    cfg["collector"]["modelsPollIntervalMs"] = 1000
    cfg["kvEvents"] = {"enabled": True, "pollMs": 200, "timeoutMs": 3000, "staleMs": 10000,
                       "maxHeldBlocks": NUM_BLOCKS, "relays": {server.address: lora_server.relay.address}}
    cfg["plugins"] = precise_plugins(lora_server, tokenize_in="worker") + [
        p for p in cfg["plugins"] if p["type"] != "approx-prefix-cache-producer"]
    g = envoy(cfg, endpoints=[server.address])

    def models():
        m = (g.state_by_address().get(server.address) or {}).get("models") or {}
        return m.get("adapters")

    adapters = e2e.wait_until(lambda: models(), timeout=30, what="the collector learnt the adapters")
    assert [(a["name"], a["path"]) for a in adapters] == [(ADAPTER, str(lora_server.adapter))], adapters
    e2e.wait_until(lambda: (g.state_by_address()[server.address].get("kvEvents") or {}).get("fresh"),
                   timeout=30, what="a fresh held view")
    ids = _fresh_ids(5 * BLOCK_SIZE + 7)

    def send(model):
        polls = _stat(g, "wasmcustom.kvroute_kv_events_polls")
        r = e2e.post(g.port, "/v1/completions", {"model": model, "prompt": ids, "max_tokens": 1, "temperature": 0},
                     timeout=180)
        assert r.status == 200, r
        # The server's events reach the held view within two relay polls.
        e2e.wait_until(lambda: _stat(g, "wasmcustom.kvroute_kv_events_polls") >= polls + 3, timeout=15,
                       what="relay polls after the request")
        return r

    first = send(ADAPTER)
    assert _affinity(first) == 0.0, first
    again = send(ADAPTER)
    base = send(MODEL)
    fallbacks = {k: _stat(g, f"wasmcustom.kvroute_precise_fallback_{k}")
                 for k in ("lora_adapter", "lora_path_unknown", "lora_paths_differ", "no_held_view")}
    matched = _stat(g, "wasmcustom.kvroute_precise_matched")
    print(f"[lora] affinity first {_affinity(first)}, again {_affinity(again)}, base {_affinity(base)}; "
          f"matched {matched}; fallbacks {fallbacks}")
    # The adapter's second request: all 5 of its blocks held.
    assert _affinity(again) == 1.0, again
    # The base model's request for the same prompt holds none of them.
    assert _affinity(base) == 0.0, base
    assert matched == 3, matched
    assert fallbacks == dict.fromkeys(fallbacks, 0), fallbacks
    assert g.wasm_failures() == {}

"""Precise mode with Qwen3's tokenizer and chat template on real vLLM 0.32
(issue 44's proof on the real engine).

Two servers of the tier's tiny random-weight Llama with Qwen3's
`tokenizer.json` and `tokenizer_config.json` (`vllm_tier.setup_qwen3_model`,
the files of `scripts/qwen3-tokenizer.sh`; embedding of 151,936 rows), same
flags as the tier's (`sha256_cbor`, block size 32, dummy weights).

(a) Hash parity: for chats with a system prompt, several turns, an
assistant turn with `tool_calls` and its `tool` result, multi-part text
content and a `cache_salt`, kvroute's hashes (the `vllm_hashes` example,
which also asserts that the off-path hashes equal the request path's) and
token IDs equal, block for block, the chain of the server's `BlockStored`
events, and the token IDs equal vLLM's own `/tokenize` of the same
messages, tools printed with `tojson` and tool-call arguments in another
JSON form included.

(b) Routing through Envoy in precise mode (`tokenizeIn: collector`, the
default) with Qwen3's tokenizer given by reference (`tokenizerUrl` on a
loopback HTTP server, `tokenizerSha256`, `tokenizerCluster`): several
conversations of several turns; every later turn goes to its conversation's
server, whose `cached_tokens` cover most of the previous prompt; the only
fallbacks are the first turns' `not_hashed_yet`.
"""

import hashlib
import http.server
import json
import os
import re
import secrets
import shutil
import subprocess
import tempfile
import threading
import time

import pytest

import vllm_tier
from conftest import (_LIVE, BLOCK_SIZE, MODEL, NUM_BLOCKS, REPO, EventSink, RelayProcess, e2e,
                      real_plugin_config, words)
from test_hash_parity import _quiet, _stored_chain

# Server #1 takes the parity cases; the routing test uses both.
PARITY_SERVER = 1


@pytest.fixture(scope="module")
def qwen3_fleet(tmp_path_factory):
    """Two real vLLM servers with the Qwen3-vocabulary model, each with a
    KV-event sink and a kvroute-relay, as the tier's `real_fleet`."""
    try:
        vllm_tier.ensure_setup()
    except Exception as ex:  # noqa: BLE001
        pytest.skip(f"the real-vLLM venv cannot be built here ({ex}); see tests/real/README.md")
    model = vllm_tier.setup_qwen3_model()
    log_dir = tmp_path_factory.mktemp("vllm-qwen3")
    ports = vllm_tier.free_ports(4)
    ipc_dir = tempfile.mkdtemp(prefix="kvr-q3-")
    endpoints = [f"ipc://{ipc_dir}/vllm{i}.sock" for i in range(2)]
    sinks, relays = [], []
    for ep in endpoints:
        s = EventSink(connect=ep)
        sinks.append(s)
        _LIVE.append(s)
    for i, ep in enumerate(endpoints):
        r = RelayProcess(ep, f"kv@real{i}", ports[2 + i], log_dir / f"relay{i}.log")
        if r.proc is not None:
            relays.append(r)
            _LIVE.append(r)
    f = vllm_tier.Fleet(2, log_dir=log_dir, blocks=NUM_BLOCKS, ports=ports[:2], event_ports=endpoints,
                        pidfile=_pidfile(), model=model)
    _LIVE.append(f)
    t0 = time.monotonic()
    f.start(timeout=900)
    f.startup_seconds = time.monotonic() - t0
    rss = [_tree_rss_mib(s.pid) for s in f.servers]
    print(f"\n[real] 2 Qwen3-vocabulary vLLM servers healthy in {f.startup_seconds:.0f} s, "
          f"RSS {rss} MiB (server and its children): {f.addresses}; logs in {log_dir}")
    f.sinks, f.relays, f.model = sinks, relays, model
    try:
        yield f
    finally:
        f.stop()
        for s in sinks + relays:
            s.stop()
        shutil.rmtree(ipc_dir, ignore_errors=True)
        for obj in [f] + sinks + relays:
            if obj in _LIVE:
                _LIVE.remove(obj)


def _pidfile():
    """servers-qwen3.json beside KVROUTE_REAL_PIDFILE (scripts/real-vllm.sh
    test stops what both list, also when pytest is killed)."""
    p = os.environ.get("KVROUTE_REAL_PIDFILE")
    return os.path.join(os.path.dirname(p), "servers-qwen3.json") if p else None


def _tree_rss_mib(pid):
    """RSS of pid and its descendants (vLLM forks an engine core), MiB."""
    children = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                ppid = int(open(f"/proc/{d}/stat").read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d))
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        todo += children.get(p, [])
        try:
            for line in open(f"/proc/{p}/status"):
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
        except OSError:
            pass
    return total // 1024


def qwen3_producer(model, **by):
    """A token-producer for Qwen3: tokenizer_config.json inline, the
    tokenizer inline (default) or as given in `by` (tokenizerUrl, ...)."""
    params = {"modelName": str(model), "servedModelNames": [MODEL],
              "tokenizerConfig": json.loads((model / "tokenizer_config.json").read_text())}
    if by:
        params.update(by)
    else:
        params["tokenizerJson"] = json.loads((model / "tokenizer.json").read_text())
    return {"type": "token-producer", "parameters": params}


def precise_producer(fleet):
    seed = fleet.servers[0].env()["PYTHONHASHSEED"]
    return {"type": "precise-prefix-cache-producer", "parameters": {
        "tokenProcessorConfig": {"blockSizeTokens": BLOCK_SIZE, "hashSeed": seed}}}


# ---------------------------------------------------------------- (a) hash parity


@pytest.fixture(scope="module")
def hasher(qwen3_fleet, tmp_path_factory):
    out = tmp_path_factory.mktemp("qwen3-parity")
    cfg = {"endpoints": {"static": ["127.0.0.1:1"]},
           "plugins": [qwen3_producer(qwen3_fleet.model), precise_producer(qwen3_fleet)],
           "kvEvents": {"enabled": True}}
    cfg_path = out / "precise.json"
    cfg_path.write_text(json.dumps(cfg))
    subprocess.run(["cargo", "build", "-q", "-p", "kvroute-core", "--example", "vllm_hashes"], cwd=REPO,
                   check=True, timeout=900)
    exe = REPO / "target" / "debug" / "examples" / "vllm_hashes"

    def run(body, api="chat"):
        p = out / f"body-{secrets.token_hex(4)}.json"
        p.write_text(json.dumps(body))
        r = subprocess.run([str(exe), str(cfg_path), api, str(p)], capture_output=True, text=True,
                           timeout=120)
        assert r.returncode == 0, f"kvroute did not hash precisely: {r.stdout} {r.stderr}"
        return json.loads(r.stdout)

    return run


@pytest.fixture(scope="module")
def decode(qwen3_fleet):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(qwen3_fleet.model / "tokenizer.json"))
    return lambda ids: tok.decode(ids, skip_special_tokens=False)


def _vllm_ids(server, body):
    """vLLM's own prompt token IDs for a chat body (its /tokenize endpoint:
    the same chat rendering as /v1/chat/completions)."""
    req = {k: v for k, v in body.items() if k in ("model", "messages", "tools", "add_generation_prompt",
                                                   "chat_template_kwargs", "add_special_tokens")}
    r = e2e.post(server.port, "/tokenize", req, timeout=120)
    assert r.status == 200, r
    return r.json()["tokens"]


def _first_difference(a, b):
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _check(fleet, hasher, decode, body):
    """kvroute's IDs equal vLLM's /tokenize IDs (else the two renders are
    shown around their first difference), and every full block's hash
    equals the server's BlockStored chain. Returns the number of blocks."""
    server, sink = fleet.servers[PARITY_SERVER], fleet.sinks[PARITY_SERVER]
    ours = hasher(body)
    ids, hashes = ours["token_ids"], ours["hashes"]
    theirs = _vllm_ids(server, body)
    if ids != theirs:
        ours_text, their_text = decode(ids), decode(theirs)
        at = _first_difference(ours_text, their_text)
        lo = max(0, at - 120)
        msg = (f"kvroute and vLLM render the chat differently at character {at} "
               f"(tokens {len(ids)} vs {len(theirs)}):\n"
               f"  kvroute: {ours_text[lo:at + 160]!r}\n  vLLM:    {their_text[lo:at + 160]!r}")
        print(msg)
        pytest.fail(msg)
    assert len(hashes) == len(ids) // BLOCK_SIZE >= 3, (len(ids), len(hashes))
    start = len(sink.snapshot())
    r = e2e.post(server.port, "/v1/chat/completions", dict(body, max_tokens=1, temperature=0), timeout=180)
    assert r.status == 200, r
    assert r.json()["usage"]["prompt_tokens"] == len(ids), "vLLM counted other prompt tokens"
    chain = _stored_chain(_quiet(sink, start), ids[:BLOCK_SIZE])
    assert len(chain) in (len(hashes), len(hashes) + 1), (len(chain), len(hashes))
    assert [t for _, t in chain[:len(hashes)]] == [ids[i * BLOCK_SIZE:(i + 1) * BLOCK_SIZE]
                                                   for i in range(len(hashes))], "token IDs differ"
    assert [h for h, _ in chain[:len(hashes)]] == hashes, "block hashes differ"
    return len(hashes)


def _system(seed):
    # A fresh random head: no block of the prompt is cached from before.
    return {"role": "system", "content": f"{secrets.token_hex(8)} you are a careful assistant. "
                                         + words(seed, 120)}


def _turns(seed, n):
    out = []
    for j in range(n):
        out.append({"role": "user", "content": words(seed + 10 + j, 40) + "?"})
        out.append({"role": "assistant", "content": f"Answer {j}: " + words(seed + 20 + j, 25) + "."})
    return out


def _tool_exchange(arguments):
    return [
        {"role": "user", "content": "What is the weather in Paris for the next three days?"},
        {"role": "assistant", "content": "", "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "{\"forecast\": [\"sun\", \"rain\", \"sun\"]}"},
        {"role": "assistant", "content": "Sun, then rain, then sun again."},
    ]


def _body(messages, **extra):
    return dict({"model": MODEL, "messages": messages}, **extra)


def test_system_prompt_and_several_turns(qwen3_fleet, hasher, decode):
    seed = secrets.randbelow(1 << 30)
    messages = [_system(seed)] + _turns(seed, 3) + [{"role": "user", "content": words(seed + 99, 30)}]
    assert _check(qwen3_fleet, hasher, decode, _body(messages)) >= 5


def test_tool_call_and_tool_result(qwen3_fleet, hasher, decode):
    # `arguments` as vLLM itself returns it (json.dumps: ", " and ": "), which
    # is how Qwen3's template prints the dict vLLM parses it into.
    seed = secrets.randbelow(1 << 30)
    messages = ([_system(seed)] + _turns(seed, 1)
                + _tool_exchange(json.dumps({"city": "Paris", "days": 3}))
                + [{"role": "user", "content": words(seed + 99, 30)}])
    assert _check(qwen3_fleet, hasher, decode, _body(messages)) >= 5


def test_multi_part_text_content(qwen3_fleet, hasher, decode):
    seed = secrets.randbelow(1 << 30)
    messages = [_system(seed)] + _turns(seed, 1) + [
        {"role": "user", "content": [{"type": "text", "text": words(seed + 40, 30)},
                                     {"type": "text", "text": words(seed + 41, 30)}]}]
    assert _check(qwen3_fleet, hasher, decode, _body(messages)) >= 5


def test_cache_salt(qwen3_fleet, hasher, decode):
    seed = secrets.randbelow(1 << 30)
    messages = [_system(seed)] + _turns(seed, 2) + [{"role": "user", "content": words(seed + 99, 30)}]
    body = _body(messages, cache_salt="tenant-" + secrets.token_hex(4))
    assert _check(qwen3_fleet, hasher, decode, body) >= 5


def test_everything_in_one_chat(qwen3_fleet, hasher, decode):
    seed = secrets.randbelow(1 << 30)
    messages = ([_system(seed)] + _turns(seed, 2)
                + _tool_exchange(json.dumps({"city": "Paris", "days": 3}))
                + [{"role": "user", "content": [{"type": "text", "text": words(seed + 40, 20)},
                                                {"type": "text", "text": words(seed + 41, 20)}]}])
    body = _body(messages, cache_salt="tenant-" + secrets.token_hex(4))
    assert _check(qwen3_fleet, hasher, decode, body) >= 6


# Three cases where kvroute's minijinja render of Qwen3's template differed
# from vLLM 0.32's, found here on 2026-12-07 and fixed in
# `precise/tokenizer.rs` (transformers' tojson, vLLM's message
# normalisation): `tools` printed with `tojson` (vLLM: Python's
# json.dumps(ensure_ascii=False), not compact and HTML-escaped), tool-call
# `arguments` sent in another JSON form than json.dumps's (vLLM parses them
# into an object first), and an assistant turn with `content: null` (vLLM
# renders ''; the render used to fail).


def test_tools(qwen3_fleet, hasher, decode):
    seed = secrets.randbelow(1 << 30)
    tools = [{"type": "function", "function": {
        "name": "get_weather", "description": "Weather <for> a city & day",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                       "required": ["city"]}}}]
    messages = ([_system(seed)] + _tool_exchange(json.dumps({"city": "Paris", "days": 3}))
                + [{"role": "user", "content": words(seed + 99, 30)}])
    # The servers run without --enable-auto-tool-choice: vLLM refuses
    # tools with the default "auto" choice (400), so the request says "none".
    assert _check(qwen3_fleet, hasher, decode, _body(messages, tools=tools, tool_choice="none")) >= 5


def test_tools_as_vllm_dumps_them(qwen3_fleet, hasher, decode):
    """vLLM hands the template its own dump of each tool
    (`ChatCompletionToolsParam.model_dump()`): a missing `description` and
    `parameters` print as null, keys it does not model (`cache_control`,
    a function's `extra`) are dropped, a tool-level `defer_loading` is
    copied into the function. kvroute builds the same (`request/tool_dump.rs`);
    passing the body's tools as sent printed something else."""
    seed = secrets.randbelow(1 << 30)
    tools = [
        {"type": "function", "function": {"name": "list_files", "extra": 1}, "cache_control": {"type": "ephemeral"}},
        {"function": {"parameters": {"type": "object", "properties": {"q": {"type": "string"}}},
                      "name": "search", "description": "Search <the> docs"}, "defer_loading": False},
    ]
    messages = [_system(seed), {"role": "user", "content": words(seed + 7, 40)}]
    assert _check(qwen3_fleet, hasher, decode, _body(messages, tools=tools, tool_choice="none")) >= 5


def test_tool_call_arguments_in_another_json_form(qwen3_fleet, hasher, decode):
    seed = secrets.randbelow(1 << 30)
    messages = ([_system(seed)] + _tool_exchange('{"city":"Paris","days":3}')
                + [{"role": "user", "content": words(seed + 99, 30)}])
    assert _check(qwen3_fleet, hasher, decode, _body(messages)) >= 5


def test_tool_call_with_null_content(qwen3_fleet, hasher, decode):
    seed = secrets.randbelow(1 << 30)
    exchange = _tool_exchange(json.dumps({"city": "Paris", "days": 3}))
    exchange[1]["content"] = None
    messages = [_system(seed)] + exchange + [{"role": "user", "content": words(seed + 99, 30)}]
    assert _check(qwen3_fleet, hasher, decode, _body(messages)) >= 5


# ---------------------------------------------------------------- (b) routing through Envoy


class Files:
    """A one-directory HTTP server on 127.0.0.1 that counts its GETs."""

    def __init__(self, directory):
        gets = self.gets = []

        class Handler(http.server.SimpleHTTPRequestHandler):
            def __init__(self, *a, **kw):
                super().__init__(*a, directory=directory, **kw)

            def do_GET(self):
                gets.append(self.path)
                super().do_GET()

            def log_message(self, *a):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def stop(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def tokenizer_files():
    res = subprocess.run(["bash", str(REPO / "scripts" / "qwen3-tokenizer.sh")], capture_output=True, text=True,
                         check=True)
    directory = res.stdout.strip().splitlines()[-1]
    f = Files(directory)
    f.directory = directory
    yield f
    f.stop()


def stat(g, name):
    body = g.admin(f"/stats?filter={name}").body.decode()
    return sum(int(v) for v in re.findall(rf"{re.escape(name)}: (\d+)", body))


def stats_with(g, prefix):
    body = g.admin(f"/stats?filter={prefix}").body.decode()
    return {k: int(v) for k, v in re.findall(rf"(\S*{re.escape(prefix)}\S*): (\d+)", body)}


CONVERSATIONS = 4
TURNS = 4


def test_qwen3_conversations_keep_their_cache_through_envoy(qwen3_fleet, envoy, tokenizer_files):
    assert len(qwen3_fleet.relays) == 2, "kvroute-relay is not built (cargo build --bin kvroute-relay)"
    addrs = qwen3_fleet.addresses
    sha = hashlib.sha256(open(os.path.join(tokenizer_files.directory, "tokenizer.json"), "rb").read()).hexdigest()
    cfg = real_plugin_config()
    cfg["kvEvents"] = {
        "enabled": True, "pollMs": 200, "timeoutMs": 3000, "staleMs": 10000, "maxHeldBlocks": NUM_BLOCKS,
        "relays": {s.address: r.address for s, r in zip(qwen3_fleet.servers, qwen3_fleet.relays)},
    }
    by_ref = qwen3_producer(qwen3_fleet.model,
                            tokenizerUrl=f"http://127.0.0.1:{tokenizer_files.port}/tokenizer.json",
                            tokenizerSha256=sha, tokenizerCluster="kvroute_tokenizer")
    cfg["plugins"] = [by_ref, precise_producer(qwen3_fleet)] + [
        p for p in cfg["plugins"] if p["type"] != "approx-prefix-cache-producer"]
    g = envoy(cfg, endpoints=addrs)
    e2e.wait_until(lambda: stat(g, "wasmcustom.kvroute_tokenizer_loaded") == 1, timeout=120,
                   what="Qwen3's tokenizer fetched and loaded by the collector")
    e2e.wait_until(lambda: all((x.get("metrics") or {}).get("fresh") and x["kvEvents"].get("fresh")
                               for x in g.state()["endpoints"]),
                   timeout=30, what="fresh metrics and relay polls for every endpoint")

    tag = secrets.token_hex(4)
    conv = {c: [{"role": "system", "content": f"{tag} conversation {c}. " + words(f"{tag}-{c}", 300)}]
            for c in range(CONVERSATIONS)}
    placed, prev_prompt, sent, covered = {}, {}, 0, []
    for k in range(TURNS):
        for c in range(CONVERSATIONS):
            conv[c].append({"role": "user", "content": f"question {k}: " + words(f"{tag}-{c}-q{k}", 50) + "?"})
            body = {"model": MODEL, "messages": conv[c], "max_tokens": 2, "temperature": 0}
            r = e2e.post(g.port, "/v1/chat/completions", body, timeout=180)
            assert r.status == 200, r
            sent += 1
            d = r.decision
            assert d and d.get("endpoint") in addrs, r
            usage = r.json()["usage"]
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
            if k == 0:
                placed[c] = d["endpoint"]
            else:
                assert d["endpoint"] == placed[c], (c, k, d)
                assert cached >= 0.8 * prev_prompt[c], (c, k, usage, prev_prompt[c])
                covered.append(cached / prev_prompt[c])
            prev_prompt[c] = usage["prompt_tokens"]
            conv[c].append({"role": "assistant", "content": f"Answer {k}: " + words(f"{tag}-{c}-a{k}", 20) + "."})
            # The collector tokenizes the turn's new text; the relays' next
            # polls show the server's blocks.
            polls = stat(g, "wasmcustom.kvroute_kv_events_polls")
            e2e.wait_until(lambda: stat(g, "wasmcustom.kvroute_tokenize_jobs_done") >= sent, timeout=30,
                           what=f"{sent} jobs tokenized")
            e2e.wait_until(lambda: stat(g, "wasmcustom.kvroute_kv_events_polls") >= polls + 2 * len(addrs),
                           timeout=15, what="two relay polls per endpoint after the turn")
    assert len(set(placed.values())) == 2, placed
    assert tokenizer_files.gets == ["/tokenizer.json"], tokenizer_files.gets
    fallbacks = stats_with(g, "kvroute_precise_fallback_")
    print(f"\n[qwen3] later turns: cached_tokens / previous prompt min {min(covered):.3f}, "
          f"mean {sum(covered) / len(covered):.3f}; last prompts {sorted(prev_prompt.values())} tokens")
    print(f"[qwen3] fallbacks {fallbacks}; matched {stat(g, 'wasmcustom.kvroute_precise_matched')}, "
          f"prefix_partial {stat(g, 'wasmcustom.kvroute_precise_prefix_partial')}")
    assert fallbacks, "no kvroute_precise_fallback_* counter in Envoy's stats"
    assert {k: v for k, v in fallbacks.items() if v and not k.endswith("not_hashed_yet")} == {}, fallbacks
    assert stat(g, "wasmcustom.kvroute_precise_fallback_not_hashed_yet") == CONVERSATIONS
    assert stat(g, "wasmcustom.kvroute_precise_matched") == CONVERSATIONS * (TURNS - 1)
    assert stat(g, "wasmcustom.kvroute_tokenize_jobs_failed") == 0
    assert stat(g, "wasmcustom.kvroute_tokenize_dropped") == 0
    assert stat(g, "wasmcustom.kvroute_tokenizer_loaded") == 1
    assert g.wasm_failures() == {}
    g.assert_alive()


def test_anthropic_messages_with_tool_use(qwen3_fleet, hasher, decode):
    """Issue 46: a /v1/messages body (system blocks, tool_use with an object
    input, a user's tool_result) hashed by kvroute's own conversion equals
    what vLLM stores for it under Qwen3's template, which prints the tool
    call's arguments. vLLM has no /tokenize for Messages: its count_tokens
    must give kvroute's token count, then the stored chain must match."""
    seed = secrets.randbelow(1 << 30)
    body = {"model": MODEL, "max_tokens": 1, "system": [
        {"type": "text", "text": "x-anthropic-billing-header: cch=" + secrets.token_hex(4)},
        {"type": "text", "text": f"{secrets.token_hex(8)} you are a careful assistant. " + words(seed, 120)}],
        "messages": [
            {"role": "user", "content": "What is the weather in Paris for the next three days?"},
            {"role": "assistant", "content": [
                {"type": "text", "text": "Let me look."},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                 "input": {"city": "Paris", "days": 3, "units": {"t": "C"}}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1",
                 "content": [{"type": "text", "text": "sun, rain, sun"}]},
                {"type": "text", "text": words(seed + 99, 30)}]}]}
    _check_messages(qwen3_fleet, hasher, decode, body)


def _check_messages(fleet, hasher, decode, body):
    """A /v1/messages body: vLLM's count_tokens equals kvroute's token count,
    and the chain vLLM stores for the body equals kvroute's IDs and hashes
    block for block (on a difference, both texts around it are shown).
    Returns the number of blocks."""
    server, sink = fleet.servers[PARITY_SERVER], fleet.sinks[PARITY_SERVER]
    ours = hasher(body, "messages")
    ids, hashes = ours["token_ids"], ours["hashes"]
    r = e2e.post(server.port, "/v1/messages/count_tokens", body, timeout=120)
    assert r.status == 200, r
    start = len(sink.snapshot())
    r2 = e2e.post(server.port, "/v1/messages", dict(body, temperature=0), timeout=180)
    assert r2.status == 200, r2
    chain = _stored_chain(_quiet(sink, start), ids[:BLOCK_SIZE])
    stored = [t for _, block in chain for t in block]
    if stored[:len(ids) // BLOCK_SIZE * BLOCK_SIZE] != ids[:len(ids) // BLOCK_SIZE * BLOCK_SIZE]:
        ours_text, their_text = decode(ids), decode(stored)
        at = _first_difference(ours_text, their_text)
        lo = max(0, at - 160)
        pytest.fail(f"kvroute and vLLM render the Messages body differently at character {at}:\n"
                    f"  kvroute: {ours_text[lo:at + 200]!r}\n  vLLM:    {their_text[lo:at + 200]!r}")
    assert r.json()["input_tokens"] == len(ids), (r.json(), len(ids), decode(ids)[-400:])
    assert len(hashes) == len(ids) // BLOCK_SIZE >= 3, (len(ids), len(hashes))
    assert len(chain) in (len(hashes), len(hashes) + 1), (len(chain), len(hashes))
    assert [t for _, t in chain[:len(hashes)]] == [ids[i * BLOCK_SIZE:(i + 1) * BLOCK_SIZE]
                                                   for i in range(len(hashes))], "token IDs differ"
    assert [h for h, _ in chain[:len(hashes)]] == hashes, "block hashes differ"
    return len(hashes)


def test_anthropic_messages_with_tools(qwen3_fleet, hasher, decode):
    """A /v1/messages body with `tools` (Claude Code always sends them):
    kvroute builds the template's `tools` as vLLM does (each tool's
    ChatCompletionToolsParam dump: `type`, then `function` with `name`,
    `description` null when absent, `parameters` with `type: object`
    appended when missing; `cache_control` and a tool's `type` dropped).
    Qwen3's template prints each tool with `tojson` in the system turn, so
    any difference in key order, a missing null or a kept extra key changes
    every block. The servers run without --enable-auto-tool-choice, so the
    body says `tool_choice: none` (vLLM's default "auto" is refused there)."""
    seed = secrets.randbelow(1 << 30)
    body = {"model": MODEL, "max_tokens": 1, "tool_choice": {"type": "none"},
            "tools": [
                {"name": "get_weather", "description": "The weather forecast for a city.",
                 "input_schema": {"type": "object", "properties": {
                     "city": {"type": "string", "description": "City name"},
                     "days": {"type": "integer", "minimum": 1, "maximum": 7},
                     "units": {"type": "object", "properties": {"t": {"enum": ["C", "F"]}}}},
                     "required": ["city"]},
                 "cache_control": {"type": "ephemeral"}},
                {"type": "custom", "name": "read_file",
                 "input_schema": {"properties": {"path": {"type": "string"},
                                                 "range": {"type": "array", "items": {"type": "integer"}}},
                                  "required": ["path"]}}],
            "system": [
                {"type": "text", "text": "x-anthropic-billing-header: cch=" + secrets.token_hex(4)},
                {"type": "text", "text": f"{secrets.token_hex(8)} you are a careful assistant. "
                                         + words(seed, 120)}],
            "messages": [
                {"role": "user", "content": "What is the weather in Paris for the next three days?"},
                {"role": "assistant", "content": [
                    {"type": "text", "text": "Let me look."},
                    {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                     "input": {"city": "Paris", "days": 3, "units": {"t": "C"}}}]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1",
                     "content": [{"type": "text", "text": "sun, rain, sun"}]},
                    {"type": "text", "text": words(seed + 99, 30)}]},
                {"role": "assistant", "content": [
                    {"type": "tool_use", "id": "toolu_2", "name": "read_file",
                     "input": {"path": "notes.txt", "range": [1, 20]}}]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_2", "content": words(seed + 7, 40)}]}]}
    assert _check_messages(qwen3_fleet, hasher, decode, body) >= 5

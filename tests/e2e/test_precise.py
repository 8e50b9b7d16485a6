"""Precise mode in real Envoy: requests are scored on the blocks the servers
report holding in their KV events (emulator -> kvroute-relay -> collector ->
held view in shared data), with vLLM's own sha256_cbor hashes of the prompt,
and fall back to the approximate index, counted by reason, when they cannot be.

The emulator publishes vLLM's hashes for token-ID prompts (the same
kvroute-core code the filter runs, checked against vLLM itself in
tests/real/test_hash_parity.py), so a token-ID prefix a server was sent
*directly*, bypassing the gateway, must draw that prefix group to it: the
approximate index cannot know about it.

Every test runs twice: on the default module and on the smaller one built
without the `tokenizer` feature (`--no-default-features`), which these
configs (no `tokenizerJson`) must run the same way.
"""

import time

import pytest

from conftest import MODEL, no_tokenizer_wasm, post, wait_until
from test_kv_events import BLOCK, held, kv_config, relay_binary, servers, stat, tokens  # noqa: F401

PRECISE = {"type": "precise-prefix-cache-producer",
           "parameters": {"tokenProcessorConfig": {"blockSizeTokens": BLOCK, "hashSeed": "0"}}}


@pytest.fixture(scope="module", params=["default-module", "no-tokenizer-module"])
def artifacts(request, artifacts):
    """conftest's artifacts, with the module under test swapped per param."""
    if request.param == "default-module":
        return artifacts
    return {**artifacts, "wasm": no_tokenizer_wasm(artifacts)}


def precise_config(srvs, **kv):
    cfg = kv_config(srvs, **kv)
    cfg["plugins"].insert(0, PRECISE)
    # The UDS tokenizer llm-d's guide names: accepted, but a VM cannot reach
    # it, so text prompts fall back (counted no_tokenizer).
    cfg["plugins"].insert(0, {"type": "token-producer", "parameters": {
        "modelName": MODEL, "udsTokenizerConfig": {"socketFile": "/tmp/tokenizer/tokenizer-uds.socket"}}})
    return cfg


def counters(e):
    names = ["matched", "fallback_no_held_view", "fallback_no_tokenizer", "fallback_unknown_model",
             "fallback_template", "fallback_tokenize", "fallback_unsupported"]
    return {n: stat(e, f"wasmcustom.kvroute_precise_{n}") for n in names}


def wait_counters(e, want, timeout=5):
    # Filter VMs flush their counters on a 200 ms tick.
    return wait_until(lambda: counters(e) == want and counters(e), timeout=timeout, what=f"counters {want}")


def test_a_prefix_held_by_one_server_draws_its_group_there(envoy, servers):  # noqa: F811
    srvs = servers(3)
    e = envoy(precise_config(srvs), endpoints=[s.address for s in srvs])
    wait_until(lambda: all(held(e, s.address).get("fresh") for s in srvs), timeout=10, what="relays polled")
    # Group g's 8-block prefix goes straight to server g: only its KV events
    # tell the gateway.
    prefixes = [tokens(1000 + g, 8 * BLOCK) for g in range(3)]
    for s, p in zip(srvs, prefixes):
        s.complete(p + [7, 7, 7])
    from test_kv_events import block_hashes

    wait_until(lambda: all(set(block_hashes(p)) <= set(held(e, s.address)["hashes"])
                           for s, p in zip(srvs, prefixes)), timeout=10, what="prefixes held")
    sent = 0
    for rnd in range(3):
        for g, p in enumerate(prefixes):
            # 9 full blocks: the server holds 8 (affinity 0.89 ≥ 0.8).
            body = {"model": MODEL, "prompt": p + tokens(5000 + 10 * g + rnd, BLOCK + 3), "max_tokens": 2}
            r = post(e.port, "/v1/completions", body)
            assert r.status == 200, r
            sent += 1
            assert r.decision["endpoint"] == srvs[g].address, (g, rnd, r.decision)
            assert r.decision["branch"] == "sticky", r.decision
    wait_counters(e, {"matched": sent, "fallback_no_held_view": 0, "fallback_no_tokenizer": 0,
                      "fallback_unknown_model": 0, "fallback_template": 0, "fallback_tokenize": 0,
                      "fallback_unsupported": 0})
    # A text prompt: no tokenizer (the UDS one cannot be reached), approximate
    # index, counted; and still routed.
    r = post(e.port, "/v1/completions", {"model": MODEL, "prompt": "hello there " * 50, "max_tokens": 2})
    assert r.status == 200 and r.decision["endpoint"] in {s.address for s in srvs}, r
    wait_until(lambda: counters(e)["fallback_no_tokenizer"] == 1, timeout=5, what="no_tokenizer counted")
    assert e.wasm_failures() == {}


def test_a_stale_relay_falls_back_to_the_approximate_index_counted(envoy, servers):  # noqa: F811
    a, b = servers(2)
    e = envoy(precise_config([a, b], staleMs=800), endpoints=[a.address, b.address])
    wait_until(lambda: all(held(e, s.address).get("fresh") for s in (a, b)), timeout=10, what="relays polled")
    p = tokens(77, 6 * BLOCK)
    r = post(e.port, "/v1/completions", {"model": MODEL, "prompt": p, "max_tokens": 2})
    assert r.status == 200, r
    wait_until(lambda: counters(e)["matched"] == 1, timeout=5, what="first request matched")
    a.relay.stop()
    wait_until(lambda: held(e, a.address)["fresh"] is False, timeout=10, what="a's view stale")
    # One stale view: the whole decision is the approximate index's, which
    # keeps the group where the gateway sent it.
    first = r.decision["endpoint"]
    for i in range(4):
        r = post(e.port, "/v1/completions", {"model": MODEL, "prompt": p + tokens(900 + i, 5), "max_tokens": 2})
        assert r.status == 200, r
        assert r.decision["endpoint"] == first, r.decision
    wait_until(lambda: counters(e)["fallback_no_held_view"] == 4, timeout=5, what="4 fallbacks counted")
    assert counters(e)["matched"] == 1
    assert e.wasm_failures() == {}

"""Precise mode with `tokenizeIn: collector` in real Envoy (issue 44).

The tokenizer is given by reference: the collector fetches `tokenizer.json`
over HTTP through a cluster (`tokenizerUrl`, `tokenizerCluster`), checks its
sha256 pin and loads it once; the worker VMs never load it. They render each
chat, look its longest tokenized prefix up in shared data, and hand the
new text of each accepted request to the collector through an Envoy shared
queue. A conversation's first turn is routed approximately (counted
`not_hashed_yet`); each later turn is routed on its earlier turns' vLLM
hashes, matched against what the servers' KV events say they hold.

The emulated servers tokenize chats with the same tiny tokenizer and chat
template (`testdata/tokenizer/tiny-bpe-4096`) and publish vLLM's hashes.
"""

import hashlib
import http.server
import json
import os
import threading
import time

import pytest

from conftest import MODEL, REPO, chat, wait_until
from test_kv_events import kv_config, relay_binary, servers, stat  # noqa: F401
from test_precise import PRECISE

TINY = os.path.join(REPO, "testdata", "tokenizer", "tiny-bpe-4096")


class Files:
    """A one-directory HTTP server on loopback that counts its GETs."""

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
def files():
    made = []

    def make(directory):
        f = Files(directory)
        made.append(f)
        return f

    yield make
    for f in made:
        f.stop()


def offpath_config(srvs, url, sha256):
    cfg = kv_config(srvs)
    with open(os.path.join(TINY, "tokenizer_config.json")) as f:
        tcfg = json.load(f)
    producer = {"type": "token-producer", "parameters": {
        "modelName": MODEL, "tokenizerUrl": url, "tokenizerSha256": sha256,
        "tokenizerCluster": "kvroute_tokenizer", "tokenizerConfig": tcfg}}
    cfg["plugins"] = [producer, PRECISE] + [p for p in cfg["plugins"] if p["type"] != "approx-prefix-cache-producer"]
    return cfg


def tiny_sha256():
    with open(os.path.join(TINY, "tokenizer.json"), "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def test_turns_stick_on_their_tokenized_prefix_and_the_tokenizer_is_fetched_once(envoy, servers, files):  # noqa: F811
    srvs = servers(2)
    store = files(TINY)
    url = f"http://127.0.0.1:{store.port}/tokenizer.json"
    e = envoy(offpath_config(srvs, url, tiny_sha256()), endpoints=[s.address for s in srvs])
    wait_until(lambda: stat(e, "wasmcustom.kvroute_tokenizer_loaded") == 1, timeout=20, what="tokenizer loaded")
    wait_until(lambda: all(x["kvEvents"].get("fresh") for x in e.state()["endpoints"]), timeout=10,
               what="relays polled")

    conversations, turns = 6, 4
    placed, sent = {}, 0
    for c in range(conversations):
        messages = [{"role": "system", "content": f"conversation {c}: " + "you answer questions about caches. " * 20}]
        for k in range(turns):
            messages.append({"role": "user", "content": f"question {k} of conversation {c}: " + "why? " * 30})
            r = chat(e.port, messages, max_tokens=2)
            assert r.status == 200, r
            sent += 1
            d = r.decision
            if k == 0:
                placed[c] = d["endpoint"]
            else:
                assert d["endpoint"] == placed[c], (c, k, d)
            messages.append({"role": "assistant", "content": f"answer {k}: " + "because. " * 20})
            # The collector takes the turn's job; the relay's next poll
            # shows the server's blocks.
            wait_until(lambda: stat(e, "wasmcustom.kvroute_tokenize_jobs_done") >= sent, timeout=10,
                       what=f"{sent} jobs tokenized")
            time.sleep(0.3)
    assert len(set(placed.values())) == 2, placed
    assert store.gets == ["/tokenizer.json"], store.gets
    assert stat(e, "wasmcustom.kvroute_precise_fallback_not_hashed_yet") == conversations
    assert stat(e, "wasmcustom.kvroute_precise_prefix_partial") == conversations * (turns - 1)
    assert stat(e, "wasmcustom.kvroute_precise_matched") == conversations * (turns - 1)
    assert stat(e, "wasmcustom.kvroute_tokenize_dropped") == 0
    assert stat(e, "wasmcustom.kvroute_tokenize_jobs_failed") == 0
    assert stat(e, "wasmcustom.kvroute_precise_fallback_tokenizer_loading") == 0
    assert e.wasm_failures() == {}


def test_a_tokenizer_whose_digest_differs_is_refused_and_requests_route_approximately(envoy, servers, files):  # noqa: F811
    srvs = servers(2)
    store = files(TINY)
    url = f"http://127.0.0.1:{store.port}/tokenizer.json"
    wrong = hashlib.sha256(b"not the tokenizer").hexdigest()
    e = envoy(offpath_config(srvs, url, wrong), endpoints=[s.address for s in srvs])
    wait_until(lambda: stat(e, "wasmcustom.kvroute_tokenizer_load_failures") >= 1, timeout=20,
               what="the load refused")
    assert "sha256" in e.process.log_text() and wrong in e.process.log_text()
    r = chat(e.port, [{"role": "user", "content": "hello " * 50}], max_tokens=2)
    assert r.status == 200, r
    wait_until(lambda: stat(e, "wasmcustom.kvroute_precise_fallback_tokenizer_loading") == 1, timeout=5,
               what="counted as tokenizer_loading")
    assert stat(e, "wasmcustom.kvroute_tokenizer_loaded") == 0
    assert e.wasm_failures() == {}

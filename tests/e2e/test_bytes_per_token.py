"""Real tokens in real Envoy (issue 15, part 3): with `charsPerToken: "auto"`
(the shipped kvroute-default profile) the collector learns each endpoint's
bytes per token from the server's `vllm:prompt_tokens_total` against the text
bytes it routed there (filter/core/src/learners/bytes_per_token.rs), and
with `learnOutputTokens` its mean output per finished request from
`vllm:request_generation_tokens` (learners/output_tokens.rs).

The emulated servers tokenize with a real tokenizer (the tiny BPE,
sim/model/src/vllm_server/tokenize.rs), at about 2 bytes per token on this text, so
the learnt figure must match what the servers report in `usage` and be far
from kvroute's fixed default of 4.
"""

import json

from conftest import SHIPPED_PLUGIN_CONFIG, STATE_PATH, chat, text, wait_until


def config():
    cfg = json.loads(json.dumps(SHIPPED_PLUGIN_CONFIG))
    producer = next(p for p in cfg["plugins"] if p["type"] == "approx-prefix-cache-producer")
    assert producer["parameters"].get("charsPerToken") == "auto", "the shipped profile learns bytes per token"
    inflight = next(p for p in cfg["plugins"] if p["type"] == "inflight-load-producer")
    assert inflight["parameters"].get("learnOutputTokens") is True, "the shipped profile learns output tokens"
    cfg["routing"].update({"debugHeader": True, "statePath": STATE_PATH, "seed": 3})
    cfg["collector"].update({"metricsPollIntervalMs": 200})
    return cfg


def test_bytes_per_token_is_learnt_from_the_servers_token_counts(fleet, envoy):
    f = fleet(2)
    e = envoy(config(), endpoints=f.addresses, state_listener=True)
    tokens = {a: 0 for a in f.addresses}
    # Distinct ~3 KB conversations (no cache hits, so routing spreads them);
    # each server needs 3 windows of >= 4096 tokens.
    for i in range(40):
        r = chat(e.port, [{"role": "user", "content": text(f"bpt-{i}", 3000)}], max_tokens=1)
        assert r.status == 200, r
        tokens[r.served_by] += r.json()["usage"]["prompt_tokens"]
    assert all(n > 3 * 4096 for n in tokens.values()), tokens

    def learnt():
        st = e.state_by_address()
        return st if all(x.get("bytesPerToken") for x in st.values()) else None

    st = wait_until(learnt, timeout=10, what="a bytesPerToken estimate for every endpoint")
    for a, x in st.items():
        # What the servers say: the bytes this gateway routed there over the
        # prompt tokens they counted for them.
        want = x["routedPromptBytes"] / tokens[a]
        got = x["bytesPerToken"]
        print(f"{a}: learnt {got:.3f} bytes/token, servers' usage gives {want:.3f}")
        assert abs(got - want) <= 0.1 * want, (a, got, want)
        assert got < 3.0, "the tiny BPE packs ~2 bytes per token; 4 is the fixed default"


def test_output_tokens_per_request_are_learnt_from_the_servers(fleet, envoy):
    f = fleet(2)
    e = envoy(config(), endpoints=f.addresses, state_listener=True)
    out = {a: [] for a in f.addresses}
    # Short distinct prompts with 20, 30 or 40 output tokens (mean 30, 1.5x
    # the prompt would be ~15); each server needs 2 windows of >= 4
    # finished requests after its first poll.
    for i in range(36):
        r = chat(e.port, [{"role": "user", "content": f"out-{i} " + text(f"o{i}", 40)}], max_tokens=20 + 10 * (i % 3))
        assert r.status == 200, r
        out[r.served_by].append(r.json()["usage"]["completion_tokens"])
    assert all(len(v) >= 9 for v in out.values()), {a: len(v) for a, v in out.items()}

    def learnt():
        st = e.state_by_address()
        return st if all(x.get("outputTokensPerRequest") for x in st.values()) else None

    st = wait_until(learnt, timeout=10, what="an outputTokensPerRequest estimate for every endpoint")
    for a, x in st.items():
        want = sum(out[a]) / len(out[a])
        got = x["outputTokensPerRequest"]
        print(f"{a}: learnt {got:.1f} output tokens per request, the servers' usage gives {want:.1f}")
        assert abs(got - want) <= 0.2 * want, (a, got, want)

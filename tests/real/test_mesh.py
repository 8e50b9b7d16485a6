"""Many proxies route as one, on real vLLM (issue 43).

Two and four Envoy processes, each with its own kvroute shared data and
collector, in front of the tier's two real servers. Each gateway's
`kvEvents.relays` names the servers' kvroute-relays, so the mesh exchange is
on (the default). A conversation's turns alternate between the gateways: the
gateway that routes turn k never routed turn k-1, so only the exchange (in
approximate mode) or the servers' KV events (in precise mode) can tell it
where the conversation's cache is.

What must hold, in both modes: every later turn goes to the server that holds
its conversation (the decision's endpoint, and the server's own
`cached_tokens` cover at least 80 % of the previous turn's prompt); the
conversations use both servers; no gateway counts an exchange failure or a
wasm failure, and in approximate mode each gateway received the others'
decisions. Approximate mode sends text completions (the shipped byte-block
index); precise mode sends chat requests, hashed with the tier's tokenizer and
chat template and matched against the blocks each server's events hold.
"""

import re

import pytest

from conftest import MODEL, NUM_BLOCKS, e2e, precise_plugins, real_plugin_config, words

CONVERSATIONS = 4
TURNS = 4
CONTEXT_WORDS = 500
TURN_WORDS = 60


def stat(g, name):
    body = g.admin(f"/stats?filter={name}").body.decode()
    return sum(int(v) for v in re.findall(rf"{re.escape(name)}: (\d+)", body))


RECEIVED = "wasmcustom.kvroute_mesh_decisions_received"


def settled_received(g, n_relays):
    """The gateway's received count once it has exchanged with every relay
    and taken what the relays held from earlier tests (they outlive a test)."""
    e2e.wait_until(lambda: stat(g, "wasmcustom.kvroute_mesh_exchanges") >= 2 * n_relays, timeout=15,
                   what="two exchanges per relay")
    last = [-1]

    def still():
        now, prev = stat(g, RECEIVED), last[0]
        last[0] = now
        return now == prev

    e2e.wait_until(still, timeout=15, interval=0.6, what="the relays' backlog taken")
    return last[0]


def mesh_config(real_fleet, precise):
    cfg = real_plugin_config()
    cfg["kvEvents"] = {
        "enabled": True, "pollMs": 200, "timeoutMs": 3000, "staleMs": 10000, "maxHeldBlocks": NUM_BLOCKS,
        "relays": {s.address: r.address for s, r in zip(real_fleet.servers, real_fleet.relays)},
    }
    if precise:
        # Each gateway routes each conversation's turns in turn, so with
        # `tokenizeIn: collector` (the default) a gateway would meet every
        # turn of a conversation for the first time: nothing of it hashed
        # in its own shared data (`not_hashed_yet`, routed on the mesh's
        # approximate view). Tokenizing on the request path makes every
        # turn precise, which is what this test checks across gateways.
        cfg["plugins"] = precise_plugins(real_fleet, tokenize_in="worker") + [
            p for p in cfg["plugins"] if p["type"] != "approx-prefix-cache-producer"]
    return cfg


def body(precise, tag, c, k):
    """Turn k of conversation c: its context and every question so far."""
    context = words(f"{tag}-conv-{c}-context", CONTEXT_WORDS)
    questions = [words(f"{tag}-conv-{c}-q{j}", TURN_WORDS) for j in range(k + 1)]
    if precise:
        messages = [{"role": "system", "content": context}]
        for j, q in enumerate(questions):
            if j:
                messages.append({"role": "assistant", "content": f"noted {j}"})
            messages.append({"role": "user", "content": q})
        return "/v1/chat/completions", {"model": MODEL, "messages": messages, "max_tokens": 2, "temperature": 0}
    prompt = context + "".join(f"\nquestion {j}: {q}" for j, q in enumerate(questions))
    return "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 2, "temperature": 0}


@pytest.mark.parametrize("mode", ["approx", "precise"])
@pytest.mark.parametrize("n_gateways", [2, 4])
def test_turns_through_alternating_gateways_stay_on_their_server(real_fleet, envoy, n_gateways, mode):
    assert len(real_fleet.relays) == 2, "kvroute-relay is not built (cargo build --bin kvroute-relay)"
    precise = mode == "precise"
    addrs = real_fleet.addresses
    cfg = mesh_config(real_fleet, precise)
    gws = [envoy(cfg, endpoints=addrs) for _ in range(n_gateways)]
    for g in gws:
        e2e.wait_until(lambda: all((x.get("metrics") or {}).get("fresh") and x["kvEvents"].get("fresh")
                                   for x in g.state()["endpoints"]),
                       timeout=30, what="fresh metrics and relay polls for every endpoint")

    tag = f"mesh-{mode}-{n_gateways}"
    placed, prev_prompt = {}, {}
    told = [settled_received(g, len(addrs)) for g in gws]
    for k in range(TURNS):
        for c in range(CONVERSATIONS):
            i = (c + k) % n_gateways
            path, b = body(precise, tag, c, k)
            r = e2e.post(gws[i].port, path, b, timeout=180)
            assert r.status == 200, r
            d = r.decision
            assert d and d.get("endpoint") in addrs, r
            usage = r.json()["usage"]
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
            if k == 0:
                placed[c] = d["endpoint"]
            else:
                # This gateway never routed the conversation's previous turn.
                assert d["endpoint"] == placed[c], (mode, c, k, i, d)
                assert cached >= 0.8 * prev_prompt[c], (mode, c, k, usage, prev_prompt[c])
            prev_prompt[c] = usage["prompt_tokens"]
            # Think time: every other gateway takes this decision (both
            # modes exchange accepted decisions; precise mode also needs the
            # servers' events, which vLLM publishes before it answers, so two
            # more relay polls per endpoint).
            polls = [stat(g, "wasmcustom.kvroute_kv_events_polls") for g in gws]
            for j, g in enumerate(gws):
                if j != i:
                    told[j] += 1
                    e2e.wait_until(lambda: stat(g, RECEIVED) >= told[j], timeout=15,
                                   what=f"gateway {j} told {told[j]} decisions")
            e2e.wait_until(lambda: all(stat(g, "wasmcustom.kvroute_kv_events_polls") >= p + 2 * len(addrs)
                                       for g, p in zip(gws, polls)),
                           timeout=15, what="two relay polls per endpoint after the turn")
    assert len(set(placed.values())) == 2, placed
    for g in gws:
        assert stat(g, "wasmcustom.kvroute_mesh_exchange_failures") == 0
        assert stat(g, "wasmcustom.kvroute_mesh_decisions_dropped") == 0
        assert g.wasm_failures() == {}
        if precise:
            assert stat(g, "wasmcustom.kvroute_precise_matched") > 0
        g.assert_alive()


def test_a_session_stays_on_its_server_through_alternating_gateways(real_fleet, envoy):
    """Issue 46, sessions across proxies, on real vLLM: with
    `session-affinity-filter` (`session_id`, header `x-session-id`) after the
    shipped profile's gate, each session's turns alternate between two
    gateways and every turn has a prompt of its own (no shared prefix, so
    neither the index nor the KV events can keep them together): only the
    binding the other gateway made, told through the relays' exchange, can
    send a turn to its session's server. Every turn is served there, and each
    gateway counts the other's bindings (`kvroute_session_peer_bound`)."""
    assert len(real_fleet.relays) == 2, "kvroute-relay is not built (cargo build --bin kvroute-relay)"
    addrs = real_fleet.addresses
    cfg = mesh_config(real_fleet, precise=False)
    cfg["plugins"].append({"type": "session-affinity-filter", "parameters": {
        "strategy": "session_id", "sessionIdConfig": {"sources": [{"header": "x-session-id"}]}}})
    profile = cfg["schedulingProfiles"][0]["plugins"]
    gate = next(i for i, p in enumerate(profile) if p["pluginRef"] == "prefix-cache-affinity-filter")
    profile.insert(gate + 1, {"pluginRef": "session-affinity-filter"})
    gws = [envoy(cfg, endpoints=addrs) for _ in range(2)]
    for g in gws:
        e2e.wait_until(lambda: all((x.get("metrics") or {}).get("fresh") and x["kvEvents"].get("fresh")
                                   for x in g.state()["endpoints"]),
                       timeout=30, what="fresh metrics and relay polls for every endpoint")

    def peer_bound(g):
        return stat(g, "wasmcustom.kvroute_session_peer_bound") + stat(g, "wasmcustom.kvroute_session_peer_moved")

    told = [peer_bound(g) for g in gws]
    placed = {}
    for k in range(TURNS):
        for s in range(CONVERSATIONS):
            i = (s + k) % 2
            r = e2e.post(gws[i].port, "/v1/completions",
                         {"model": MODEL, "prompt": words(f"session-{s}-turn-{k}", 300), "max_tokens": 2,
                          "temperature": 0},
                         headers={"x-session-id": f"real-mesh-session-{s}"}, timeout=180)
            assert r.status == 200, r
            d = r.decision
            assert d and d.get("endpoint") in addrs, r
            if k == 0:
                placed[s] = d["endpoint"]
            else:
                assert d["endpoint"] == placed[s], (s, k, i, d)
            # The other gateway is told the binding (bound or refreshed).
            j = 1 - i
            told[j] += 1
            e2e.wait_until(lambda: peer_bound(gws[j]) >= told[j], timeout=15,
                           what=f"gateway {j} told {told[j]} bindings")
    for g in gws:
        assert stat(g, "wasmcustom.kvroute_mesh_exchange_failures") == 0
        assert g.wasm_failures() == {}
        g.assert_alive()

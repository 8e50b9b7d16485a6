"""Many proxies route as one (issue 43), in real Envoy.

Two and four Envoy processes, each with its own kvroute shared data and
collector, route to the same three emulated servers with the shipped
profile. A conversation's turns alternate between the gateways, so the
gateway routing turn k never routed turn k-1. Approximate mode (text
prompts, no tokenizer): its own index has never seen that turn's blocks, and
only the mesh exchange tells it: every gateway posts its accepted decisions
to each server's relay (`POST /mesh/exchange`) and takes the others'.
Precise mode (token-ID prompts hashed as vLLM does): the servers' KV events
tell every gateway what each holds; the exchange still carries the others'
load and decisions.
"""

import pytest

from conftest import MODEL, post, text, wait_until
from test_kv_events import kv_config, relay_binary, servers, stat, tokens  # noqa: F401
from test_precise import PRECISE


def received(g):
    return stat(g, "wasmcustom.kvroute_mesh_decisions_received")


@pytest.mark.parametrize("mode", ["approx", "precise"])
@pytest.mark.parametrize("n_gateways", [2, 4])
def test_gateways_keep_a_conversation_on_one_server_while_its_turns_alternate(envoy, servers, n_gateways, mode):  # noqa: F811
    srvs = servers(3)
    addrs = [s.address for s in srvs]
    cfg = kv_config(srvs)
    if mode == "precise":
        cfg["plugins"] = [PRECISE] + [p for p in cfg["plugins"] if p["type"] != "approx-prefix-cache-producer"]
    gws = [envoy(cfg, endpoints=addrs) for _ in range(n_gateways)]
    for g in gws:
        wait_until(lambda: all(x["kvEvents"].get("fresh") for x in g.state()["endpoints"]),
                   timeout=10, what="relays polled")

    conversations, turns = 6, 4
    placed = {}
    told = [0] * n_gateways  # decisions each gateway should have received
    for c in range(conversations):
        prompt = text(f"mesh-conversation-{c}", 4000) if mode == "approx" else tokens(100 + c, 1000)
        for k in range(turns):
            if mode == "approx":
                prompt = prompt + " " + text(f"mesh-turn-{c}-{k}", 600)
            else:
                prompt = prompt + tokens(1000 * c + k, 150)
            i = (c + k) % n_gateways
            g = gws[i]
            r = post(g.port, "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 2})
            assert r.status == 200, r
            d = r.decision
            if k == 0:
                placed[c] = d["endpoint"]
            else:
                # This gateway never routed this conversation's last turn:
                # only the exchange can have told it where that went.
                assert d["endpoint"] == placed[c], (c, k, d)
                assert float(d["affinity"]) > 0.5, (c, k, d)
            # Think time: every other gateway takes this turn's decision.
            for j in range(n_gateways):
                if j != i:
                    told[j] += 1
            for j, other in enumerate(gws):
                wait_until(lambda: received(other) >= told[j], timeout=10,
                           what=f"gateway {j} told {told[j]} decisions (has {received(other)})")
    assert len(set(placed.values())) >= 2, placed
    for g in gws:
        assert stat(g, "wasmcustom.kvroute_mesh_exchange_failures") == 0
        assert stat(g, "wasmcustom.kvroute_mesh_decisions_dropped") == 0
        assert g.wasm_failures() == {}
        if mode == "precise":
            assert stat(g, "wasmcustom.kvroute_precise_matched") > 0


def test_a_gateway_that_cannot_reach_the_exchange_routes_alone_and_counts_it(envoy, servers):  # noqa: F811
    srvs = servers(2)
    addrs = [s.address for s in srvs]
    cfg = kv_config(srvs)
    # Its relays point nowhere: every exchange fails, routing goes on.
    cfg["kvEvents"]["relays"] = {a: "127.0.0.1:9" for a in addrs}
    g = envoy(cfg, endpoints=addrs)
    for k in range(3):
        r = post(g.port, "/v1/completions", {"model": MODEL, "prompt": text(f"alone-{k}", 2000), "max_tokens": 2})
        assert r.status == 200, r
        assert r.decision["endpoint"] in addrs
    wait_until(lambda: stat(g, "wasmcustom.kvroute_mesh_exchange_failures") > 0, timeout=10,
               what="counted exchange failures")
    assert received(g) == 0
    assert g.wasm_failures() == {}


def test_a_session_crosses_gateways_and_moves_on_every_gateway(envoy, servers):  # noqa: F811
    """Issue 46, sessions across proxies: a `session_id` binding made through
    one gateway is told through the exchange, so the session's requests
    (distinct prompts: only the binding keeps them together) stay on one
    server whichever gateway routes them; when one gateway's saturation gate
    releases the server and the session moves, the other gateway, which saw
    no saturation, moves it too and keeps it there once the old server is
    idle and warm again."""
    from test_routing import HOLD_SUFFIX_BYTES, PREFIX_BYTES, SMALL_SUFFIX_BYTES, _hold, _session_config
    from conftest import completion

    srvs = servers(2)
    addrs = [s.address for s in srvs]
    cfg = _session_config({"strategy": "session_id", "sessionIdConfig": {"sources": [{"header": "x-session-id"}]}})
    kv = kv_config(srvs)
    cfg["endpoints"], cfg["collector"], cfg["kvEvents"] = kv["endpoints"], kv["collector"], kv["kvEvents"]
    a, b = envoy(cfg, endpoints=addrs), envoy(cfg, endpoints=addrs)
    for g in (a, b):
        wait_until(lambda: all(x["kvEvents"].get("fresh") for x in g.state()["endpoints"]),
                   timeout=10, what="relays polled")
    sess = {"x-session-id": "mesh-session-1"}
    peer_bound = {id(a): 0, id(b): 0}

    def through(g, prompt):
        r = completion(g.port, prompt, headers=sess)
        assert r.status == 200, r
        # Every accepted request binds or refreshes: the other gateway is told.
        other = b if g is a else a
        peer_bound[id(other)] += 1
        n = peer_bound[id(other)]
        wait_until(lambda: stat(other, "wasmcustom.kvroute_session_peer_bound")
                   + stat(other, "wasmcustom.kvroute_session_peer_moved") >= n,
                   timeout=10, what=f"the other gateway told {n} bindings")
        return r

    home = through(a, text("mesh-session-turn-0", 2048)).served_by
    for i in range(1, 7):
        g = b if i % 2 else a
        r = through(g, text(f"mesh-session-turn-{i}", 2048))
        assert r.served_by == home, f"turn {i} through gateway {'b' if g is b else 'a'} left {home}: {r}"
    # Without the header such prompts spread, through either gateway.
    spread = {completion(b.port, text(f"mesh-no-session-{i}", 2048)).served_by for i in range(8)}
    assert spread == set(addrs), spread

    # Through A: the session's prefix, warm on home; another client's held
    # request loads home past tau and A's gate releases it: the session moves.
    prefix = text("mesh-session-prefix", PREFIX_BYTES)
    assert through(a, prefix + text("ms-warm", SMALL_SUFFIX_BYTES)).served_by == home
    t, _ = _hold(a, prefix + text("ms-hold", HOLD_SUFFIX_BYTES))
    try:
        probe = completion(a.port, prefix + text("ms-probe", SMALL_SUFFIX_BYTES), headers=sess)
    finally:
        t.join()
    assert probe.status == 200 and probe.served_by != home, probe
    assert probe.decision["branch"] == "saturation-release", probe
    moved_to = probe.served_by
    wait_until(lambda: stat(a, "wasmcustom.kvroute_session_moved") == 1, timeout=5, what="A counted the move")
    wait_until(lambda: stat(b, "wasmcustom.kvroute_session_peer_moved") == 1, timeout=10, what="B told of the move")
    # Home is idle again and as warm as ever: B, which never saw it
    # saturated, sends the session where it moved; so does A.
    wait_until(lambda: all(x["inflightRequests"] == 0 for x in b.state()["endpoints"]
                           + a.state()["endpoints"]), timeout=10, what="the held request released")
    for i in range(4):
        g = b if i % 2 == 0 else a
        r = completion(g.port, prefix + text(f"ms-after-{i}", SMALL_SUFFIX_BYTES), headers=sess)
        assert r.status == 200 and r.served_by == moved_to, f"after {i}: {r}"
    for g in (a, b):
        assert stat(g, "wasmcustom.kvroute_mesh_exchange_failures") == 0
        assert g.wasm_failures() == {}

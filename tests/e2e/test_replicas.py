"""Gateway replicas agree (issue 17, part 5), in real Envoy.

Two Envoy processes, each with its own kvroute shared data and its own
collector, route to the same three emulated servers. Both read the servers'
KV events through the same relays (precise mode). A conversation's turns
alternate between the two gateways, so the gateway routing turn k never
routed turn k-1. It must still send turn k where turn k-1 went, and it can
know where only from the KV events: its own approximate index has never seen
the previous turn's blocks.
"""

from conftest import MODEL, post, wait_until
from test_kv_events import BLOCK, block_hashes, held, relay_binary, servers, stat, tokens  # noqa: F401
from test_precise import precise_config


def test_two_gateways_keep_a_conversation_on_one_server_while_its_turns_alternate(envoy, servers):  # noqa: F811
    srvs = servers(3)
    addrs = [s.address for s in srvs]
    cfg = precise_config(srvs)
    gws = [envoy(cfg, endpoints=addrs), envoy(cfg, endpoints=addrs)]
    for g in gws:
        wait_until(lambda: all(held(g, a).get("fresh") for a in addrs), timeout=10, what="relays polled")

    conversations, turns = 6, 4
    placed = {}
    sent = 0
    for c in range(conversations):
        prompt = tokens(9000 + c, 6 * BLOCK)
        for k in range(turns):
            prev_blocks = len(prompt) // BLOCK if k else 0
            # the previous answer and the next user turn: two new blocks and a bit
            prompt = prompt + tokens(100 * c + k + 1, 2 * BLOCK + 5)
            g = gws[(c + k) % 2]
            r = post(g.port, "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 2})
            assert r.status == 200, r
            sent += 1
            d = r.decision
            if k == 0:
                placed[c] = d["endpoint"]
            else:
                assert d["endpoint"] == placed[c], (c, k, d)
                # Only the servers' events can tell this gateway about the
                # previous turn: it was routed by the other one.
                total = len(prompt) // BLOCK
                assert float(d["affinity"]) >= prev_blocks / total - 1e-3, (c, k, d, prev_blocks, total)
            # Think time: the turn's blocks reach both gateways' held views.
            want = set(block_hashes(prompt))
            for other in gws:
                wait_until(lambda: want <= set(held(other, placed[c])["hashes"]), timeout=10,
                           what=f"conversation {c} turn {k} held by {placed[c]}")
    assert len(set(placed.values())) >= 2, placed
    # Every request was decided on the held view, none fell back.
    matched = sum(stat(g, "wasmcustom.kvroute_precise_matched") for g in gws)
    wait_until(lambda: sum(stat(g, "wasmcustom.kvroute_precise_matched") for g in gws) == sent,
               timeout=5, what=f"{sent} precise matches (have {matched})")
    for g in gws:
        assert stat(g, "wasmcustom.kvroute_precise_fallback_no_held_view") == 0
        assert g.wasm_failures() == {}

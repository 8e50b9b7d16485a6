"""Routing through real Envoy: stickiness, spread, saturation release,
cross-worker shared state and stripping of a client-supplied destination.

Prompt sizes: the core estimates 4 bytes per token and cuts 64-token blocks,
so a block is 256 bytes of prompt text.
"""

import collections

from conftest import (
    DECISION,
    DEST_HEADER,
    MODEL,
    chat,
    completion,
    in_background,
    plugin_config,
    post,
    request,
    text,
    wait_until,
)

PREFIX_BYTES = 16384  # 4096 tokens, 64 blocks
SMALL_SUFFIX_BYTES = 512  # 2 blocks: affinity 64/66 on the warm endpoint
HOLD_SUFFIX_BYTES = 3584  # 14 blocks: affinity 64/78 = 0.82 >= 0.8, ~900 uncached tokens
HOLD_MS = 6000


def _hold(envoy, prompt, hold_ms=HOLD_MS):
    """Send a request the emulator holds for hold_ms before answering.

    Returns the background (thread, result). Waits until the filter's state
    shows one more in-flight request in total, so the next decision sees it.
    """
    before = sum(e["inflightRequests"] for e in envoy.state()["endpoints"])
    t, res = in_background(
        completion, envoy.port, prompt, headers={"x-emulator-delay-ms": str(hold_ms)}, timeout=hold_ms / 1000 + 30
    )
    wait_until(
        lambda: sum(e["inflightRequests"] for e in envoy.state()["endpoints"]) > before,
        timeout=10,
        what="the held request to be charged in the filter state",
    )
    return t, res


def test_shared_prefix_sticks_to_one_endpoint(fleet, envoy):
    f = fleet(2)
    e = envoy(endpoints=f.addresses)
    prefix = text("sticky-prefix", PREFIX_BYTES)

    first = completion(e.port, prefix + text("q0", SMALL_SUFFIX_BYTES))
    assert first.status == 200, first
    warm = first.served_by
    assert warm in f.addresses, first
    assert first.decision and first.decision.get("endpoint") == warm, first

    branches = collections.Counter()
    for i in range(1, 11):
        r = completion(e.port, prefix + text(f"q{i}", SMALL_SUFFIX_BYTES))
        assert r.status == 200, r
        assert r.served_by == warm, f"turn {i} left the warm endpoint: {r}"
        branches[r.decision["branch"]] += 1
    assert branches == {"sticky": 10}, branches


def test_more_endpoints_than_one_index_stripe(fleet, envoy):
    """Twelve endpoints: slots 8-11 fall in the prefix index's second stripe
    (shared-state STRIPE_SLOTS = 8), whose entries live in other shards.
    Cold prefixes spread over every endpoint, and each prefix's repeat
    stays where it was first served, on either stripe; the servers' own
    prefix-cache counters show the repeats hit."""
    f = fleet(12)
    e = envoy(endpoints=f.addresses)
    n = 24
    prefixes = [text(f"fleet-prefix-{i}", PREFIX_BYTES) for i in range(n)]
    home = {}
    for i, p in enumerate(prefixes):
        r = completion(e.port, p + text(f"first-{i}", SMALL_SUFFIX_BYTES))
        assert r.status == 200, r
        assert r.served_by in f.addresses, r
        home[i] = r.served_by
    # Cold placement balances the working set: every endpoint, the second
    # stripe's four included, holds some of the prefixes.
    placed = collections.Counter(home.values())
    assert set(placed) == set(f.addresses), placed
    hits_before = {a: f.stats(a)["prefix_cache_hits"] for a in f.addresses}
    for i, p in enumerate(prefixes):
        r = completion(e.port, p + text(f"repeat-{i}", SMALL_SUFFIX_BYTES))
        assert r.status == 200, r
        assert r.served_by == home[i], f"prefix {i} left {home[i]} (slot {f.addresses.index(home[i])}): {r}"
        assert r.decision["branch"] == "sticky", r
    for a in f.addresses:
        hit = f.stats(a)["prefix_cache_hits"] - hits_before[a]
        assert hit >= placed[a] * 0.9 * PREFIX_BYTES / 4 / 2, (a, hit, placed[a])


def test_distinct_prefixes_spread_by_inflight_load(fleet, envoy):
    f = fleet(2)
    e = envoy(endpoints=f.addresses)
    held = []
    for i in range(6):
        held.append(_hold(e, text(f"distinct-{i}", 8192), hold_ms=4000))
    served = collections.Counter()
    for t, res in held:
        t.join()
        (r,) = res
        assert not isinstance(r, Exception), r
        assert r.status == 200, r
        served[r.served_by] += 1
    # Each new cold request goes to the endpoint with fewer in-flight tokens,
    # so six equal-size requests split 3/3.
    assert sorted(served.values()) == [3, 3], served
    assert set(served) == set(f.addresses), served


def _saturate(e, prefix, max_holds=8):
    """Warm `prefix` on one endpoint, then alternate: add one held request
    sharing the prefix (about 900 uncached tokens on the warm endpoint), send
    one quick probe sharing the prefix. Stops after the first request that
    leaves the warm endpoint.

    Returns (warm, decisions): every request after the warm-up, in the order
    the filter decided them, as ("hold"|"probe", Response).
    """
    first = completion(e.port, prefix + text("warm", SMALL_SUFFIX_BYTES))
    assert first.status == 200, first
    warm = first.served_by
    order = []  # ("hold", result-list) or ("probe", Response), in decision order
    held = []
    try:
        for i in range(max_holds):
            t, res = _hold(e, prefix + text(f"hold-{i}", HOLD_SUFFIX_BYTES))
            held.append(t)
            order.append(("hold", res))
            probe = completion(e.port, prefix + text(f"probe-{i}", SMALL_SUFFIX_BYTES))
            assert probe.status == 200, probe
            order.append(("probe", probe))
            if probe.served_by != warm:
                break
    finally:
        for t in held:
            t.join()
    decisions = []
    for kind, r in order:
        if kind == "hold":
            (r,) = r
            assert not isinstance(r, Exception), r
        assert r.status == 200, r
        decisions.append((kind, r))
    return warm, decisions


def test_spill_once_inflight_uncached_tokens_exceed_tau(fleet, envoy):
    f = fleet(2)
    # tau = peakPrefillThroughput x maxTTFTPenaltyMs = 1000 tok/s x 0.05 s = 50 tokens,
    # so the gate opens at the first held request. The token-load scorer then
    # keeps the warm endpoint until its in-flight uncached tokens outweigh the
    # cold endpoint's cost of the whole prompt (~4200 tokens): about 5 holds.
    cfg = plugin_config(affinity={"peakPrefillThroughput": 1000, "maxTTFTPenaltyMs": 50})
    e = envoy(cfg, endpoints=f.addresses)
    prefix = text("spill-prefix", PREFIX_BYTES)

    warm, decisions = _saturate(e, prefix)
    moved = [i for i, (_, r) in enumerate(decisions) if r.served_by != warm]
    assert moved, f"nothing spilled after {len(decisions)} requests sharing the prefix: {decisions}"
    kind, spill = decisions[moved[0]]
    assert spill.decision["branch"] == "saturation-release", (kind, spill)
    assert spill.served_by in f.addresses
    # Before that, every request sharing the prefix stayed on the warm endpoint.
    assert all(r.served_by == warm for _, r in decisions[: moved[0]]), decisions
    assert moved[0] >= 2, f"spilled before the warm endpoint was loaded: {decisions}"


def test_zero_ttft_penalty_never_spills(fleet, envoy):
    f = fleet(2)
    cfg = plugin_config(affinity={"peakPrefillThroughput": 1000, "maxTTFTPenaltyMs": 0})
    e = envoy(cfg, endpoints=f.addresses)
    prefix = text("nospill-prefix", PREFIX_BYTES)

    warm, decisions = _saturate(e, prefix, max_holds=8)
    assert len(decisions) == 16, decisions
    for kind, r in decisions:
        assert r.served_by == warm, f"{kind} left the warm endpoint: {r}"
        assert r.decision["branch"] == "sticky", r


def test_conversation_sticks_across_workers_and_connections(fleet, envoy):
    f = fleet(2)
    e = envoy(endpoints=f.addresses, concurrency=4)
    conversations = []
    for c in range(6):
        conversations.append([{"role": "system", "content": text(f"system-{c}", 8192)}])
    home = {}
    for turn in range(4):
        for c, messages in enumerate(conversations):
            messages.append({"role": "user", "content": text(f"user-{c}-{turn}", 300)})
            # Each call opens a fresh connection; Envoy spreads connections
            # over its 4 workers, each with its own VM.
            r = chat(e.port, messages)
            assert r.status == 200, r
            if turn == 0:
                home[c] = r.served_by
            else:
                assert r.served_by == home[c], f"conversation {c} turn {turn} moved: {r}"
                assert r.decision["branch"] == "sticky", r
            reply = r.json()["choices"][0]["message"]["content"]
            messages.append({"role": "assistant", "content": reply})
    # The turns really did arrive on more than one worker.
    stats = e.admin("/stats?filter=worker_.*downstream_cx_total").body.decode()
    used = [line for line in stats.splitlines() if f"127.0.0.1_{e.port}.worker_" in line and not line.endswith(" 0")]
    assert len(used) >= 2, stats


def test_client_destination_header_is_ignored(fleet, envoy):
    f = fleet(2)
    outsider = fleet(1)  # a live server that is not a member of the cluster
    e = envoy(endpoints=f.addresses)
    prefix = text("client-header-prefix", PREFIX_BYTES)
    first = completion(e.port, prefix + text("a", SMALL_SUFFIX_BYTES))
    warm = first.served_by
    other = next(a for a in f.addresses if a != warm)

    # Naming the other member, or several addresses, does not move a sticky request.
    for value in (other, f"{other},{warm}", outsider.addresses[0], f"{outsider.addresses[0]},{other}"):
        r = completion(e.port, prefix + text(value, SMALL_SUFFIX_BYTES), headers={DEST_HEADER: value})
        assert r.status == 200, r
        assert r.served_by == warm, f"client header {value!r} chose the endpoint: {r}"

    # Requests the filter does not route still lose the header: round robin
    # spreads them instead of all going to the named member.
    served = collections.Counter()
    for _ in range(8):
        r = request(e.port, "GET", "/v1/models", headers={DEST_HEADER: other})
        served[r.served_by] += 1
    assert served[warm] >= 1, served

    # Cold requests naming the outsider are answered by members only, and
    # the outsider never sees a request.
    for i in range(4):
        r = completion(e.port, text(f"cold-{i}", 2048), headers={DEST_HEADER: outsider.addresses[0]})
        assert r.status == 200, r
        assert r.served_by in f.addresses, r
    assert outsider.stats(outsider.addresses[0])["requests"] == 0


def test_passthrough_parser_routes_other_paths_on_load(fleet, envoy):
    """llm-d's passthrough-parser listed in requestHandler.parsers: a request
    kvroute does not parse (here GET /v1/models) is routed by the filter at
    its headers, on load alone, and holds a charge until it is answered."""
    f = fleet(2)
    cfg = plugin_config()
    cfg["plugins"] += [{"type": "openai-parser"}, {"type": "passthrough-parser"}]
    cfg["requestHandler"] = {"parsers": [{"pluginRef": "openai-parser"}, {"pluginRef": "passthrough-parser"}]}
    e = envoy(cfg, endpoints=f.addresses)
    # Hold a parsed request on one endpoint: the load-only requests then
    # go to the other one (token-load and in-flight scorers).
    prefix = text("passthrough-hold", PREFIX_BYTES)
    t, res = _hold(e, prefix)
    held = [a for a, s in e.state_by_address().items() if s["inflightRequests"] > 0]
    assert len(held) == 1, e.state()
    other = next(a for a in f.addresses if a != held[0])
    for _ in range(4):
        r = request(e.port, "GET", "/v1/models", headers={DEST_HEADER: held[0]})
        assert r.status == 200, r
        assert r.decision and r.decision.get("endpoint") == other, r
        assert r.served_by == other, r
    t.join()
    assert res[0].status == 200, res
    wait_until(lambda: all(s["inflightRequests"] == 0 for s in e.state()["endpoints"]), timeout=10,
               what="every charge released")
def _session_config(session_params):
    """The tests' config with llm-d's gate (in-flight tokens, tau = 50 tokens),
    session-affinity-filter after it, and active-request-scorer: released,
    a request goes to the endpoint with fewer requests in flight."""
    cfg = plugin_config(affinity={"peakPrefillThroughput": 1000, "maxTTFTPenaltyMs": 50, "loadSignal": "inflight"})
    keep = ("approx-prefix-cache-producer", "inflight-load-producer", "prefix-cache-affinity-filter", "max-score-picker")
    cfg["plugins"] = [p for p in cfg["plugins"] if p["type"] in keep] + [
        {"type": "active-request-scorer"},
        {"type": "session-affinity-filter", "parameters": session_params},
    ]
    cfg["schedulingProfiles"][0]["plugins"] = [
        {"pluginRef": "prefix-cache-affinity-filter"},
        {"pluginRef": "session-affinity-filter"},
        {"pluginRef": "active-request-scorer", "weight": 1},
        {"pluginRef": "max-score-picker"},
    ]
    return cfg


def test_a_session_sticks_then_moves_when_saturated_and_stays_moved(fleet, envoy):
    """Issue 46: a session's requests (an agent's session header, 4 workers)
    go to one server, whatever their prompts; when the saturation gate
    releases that server and the session lands elsewhere, its binding moves
    there and the session stays there once the old server is idle again."""
    from test_kv_events import stat

    f = fleet(2)
    sources = [{"header": "x-session-id"}, {"attribute": "agent-identity"}]
    cfg = _session_config({"strategy": "session_id", "sessionIdConfig": {"sources": sources}})
    e = envoy(cfg, endpoints=f.addresses, concurrency=4)
    sess = {"x-claude-code-session-id": "e2e-session-1"}
    # Distinct prompts: only the session keeps them together.
    first = completion(e.port, text("session-turn-0", 2048), headers=sess)
    assert first.status == 200, first
    home = first.served_by
    for i in range(1, 6):
        r = completion(e.port, text(f"session-turn-{i}", 2048), headers=sess)
        assert r.status == 200 and r.served_by == home, f"turn {i} left {home}: {r}"
    # Without the header, such prompts do spread.
    spread = {completion(e.port, text(f"no-session-{i}", 2048)).served_by for i in range(8)}
    assert spread == set(f.addresses), spread

    # The session's prefix, warm on home; another client's held request
    # sharing it loads home past tau, and the gate releases home.
    prefix = text("session-prefix", PREFIX_BYTES)
    r = completion(e.port, prefix + text("s-warm", SMALL_SUFFIX_BYTES), headers=sess)
    assert r.served_by == home, r
    t, _ = _hold(e, prefix + text("s-hold", HOLD_SUFFIX_BYTES))
    try:
        probe = completion(e.port, prefix + text("s-probe", SMALL_SUFFIX_BYTES), headers=sess)
    finally:
        t.join()
    assert probe.status == 200 and probe.served_by != home, probe
    assert probe.decision["branch"] == "saturation-release", probe
    moved_to = probe.served_by
    assert wait_until(lambda: stat(e, "wasmcustom.kvroute_session_moved"), timeout=2, what="the move counted") == 1
    # Home is idle again and as warm as ever: the session stays moved.
    for i in range(4):
        r = completion(e.port, prefix + text(f"s-after-{i}", SMALL_SUFFIX_BYTES), headers=sess)
        assert r.status == 200 and r.served_by == moved_to, f"after {i}: {r}"
        assert r.decision["branch"] == "sticky", r
    assert e.wasm_failures() == {}
def _message(port, system, messages, stream=False, headers=None):
    body = {"model": MODEL, "max_tokens": 4, "stream": stream, "metadata": {"user_id": "e2e"},
            "system": [{"type": "text", "text": system}], "messages": messages}
    return post(port, "/v1/messages", body, headers)


def test_anthropic_messages_conversation_sticks_and_streams(fleet, envoy):
    """Anthropic's Messages API (issue 46): a multi-turn conversation with
    tool use sticks to its endpoint, whose prefix cache (the emulator
    converts the request as vLLM does) serves the earlier turns; the
    event stream releases the charge; count_tokens passes unrouted."""
    f = fleet(2)
    e = envoy(endpoints=f.addresses)
    conversations = [[] for _ in range(3)]
    home = {}
    for turn in range(3):
        for c, messages in enumerate(conversations):
            if turn == 1:
                # The assistant called a tool; the user answers with its result.
                messages.append({"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": f"toolu_{c}", "content": text(f"result-{c}", 600)},
                    {"type": "text", "text": text(f"user-{c}-{turn}", 300)}]})
            else:
                messages.append({"role": "user", "content": text(f"user-{c}-{turn}", 300)})
            r = _message(e.port, text(f"anthropic-system-{c}", 8192), messages)
            assert r.status == 200, r
            body = r.json()
            assert body["type"] == "message" and body["content"][0]["type"] == "text", body
            if turn == 0:
                home[c] = r.served_by
                reply = [{"type": "text", "text": body["content"][0]["text"]},
                         {"type": "tool_use", "id": f"toolu_{c}", "name": "lookup", "input": {"q": c}}]
            else:
                assert r.served_by == home[c], f"conversation {c} turn {turn} moved: {r}"
                assert r.decision["branch"] == "sticky", r
                # The server's prefix cache held the conversation so far.
                assert body["usage"]["cache_read_input_tokens"] > 0, body
                reply = body["content"][0]["text"]
            messages.append({"role": "assistant", "content": reply})
    # Streamed: Anthropic's event sequence, and the charge is released.
    messages = conversations[0] + [{"role": "user", "content": "and now?"}]
    r = _message(e.port, text("anthropic-system-0", 8192), messages, stream=True)
    assert r.status == 200, r
    assert r.served_by == home[0], r
    events = [line[len("event: "):] for line in r.body.decode().splitlines() if line.startswith("event: ")]
    assert events[:2] == ["message_start", "content_block_start"], events
    assert events[-3:] == ["content_block_stop", "message_delta", "message_stop"], events
    assert set(events[2:-3]) == {"content_block_delta"}, events
    wait_until(lambda: all(ep["inflightRequests"] == 0 and ep["inflightTokens"] == 0
                           for ep in e.state()["endpoints"]), timeout=5, what="the charge to be released")
    # count_tokens is passed untouched: answered, not routed (no decision).
    r = post(e.port, "/v1/messages/count_tokens",
             {"model": MODEL, "messages": [{"role": "user", "content": "how many?"}]})
    assert r.status == 200, r
    assert r.json()["input_tokens"] > 0, r
    assert r.headers.get(DECISION) is None, r

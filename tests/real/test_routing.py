"""A shared-prefix workload through Envoy + kvroute in front of two real vLLM
servers: each prefix group lands on one server, both servers are used, and
the servers' own prefix caches show the reuse."""

import collections
import threading

from conftest import MODEL, completion, e2e, real_plugin_config, scrape, words

GROUPS = 6
PER_GROUP = 4
PREFIX_WORDS = 1000
SUFFIX_WORDS = 40


def _counters(addrs):
    out = {}
    for a in addrs:
        _, v, _ = scrape(a)
        out[a] = {k: v.get(k, 0.0) for k in ("vllm:request_success_total", "vllm:prefix_cache_hits_total",
                                              "vllm:prefix_cache_queries_total")}
    return out


def test_prefix_groups_stick_to_one_real_server(real_fleet, envoy):
    addrs = real_fleet.addresses
    e = envoy(config=real_plugin_config(), endpoints=addrs)
    prefixes = [words(f"group-{g}", PREFIX_WORDS) for g in range(GROUPS)]
    before = _counters(addrs)

    results = collections.defaultdict(list)  # group -> [(round, endpoint, usage)]
    lock = threading.Lock()
    errors = []

    def send(g, r):
        try:
            resp = completion(e.port, prefixes[g] + " " + words(f"group-{g}-suffix-{r}", SUFFIX_WORDS),
                              max_tokens=2, timeout=180)
            d = resp.decision
            assert d and d.get("endpoint") in addrs, resp
            with lock:
                results[g].append((r, d["endpoint"], d.get("branch"), resp.json()["usage"]))
        except Exception as ex:  # noqa: BLE001
            errors.append(ex)

    # Each round sends one request per group, all groups at once: in round 0
    # nothing is cached anywhere and the in-flight load spreads the groups;
    # in later rounds each group's prefix is warm on one server.
    for r in range(PER_GROUP):
        threads = [threading.Thread(target=send, args=(g, r)) for g in range(GROUPS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
        assert not errors, errors

    after = _counters(addrs)
    placement = {}
    for g in range(GROUPS):
        eps = {ep for _, ep, _, _ in results[g]}
        assert len(results[g]) == PER_GROUP, results[g]
        assert len(eps) == 1, f"group {g} went to {eps}: {results[g]}"
        placement[g] = eps.pop()
    used = collections.Counter(placement.values())
    assert set(used) == set(addrs), f"not both servers used: {placement}"

    # The servers' own counters: every request kvroute sent to a server was
    # served by it (override_host honoured the decision) ...
    for a in addrs:
        sent = sum(PER_GROUP for g in range(GROUPS) if placement[g] == a)
        got = after[a]["vllm:request_success_total"] - before[a]["vllm:request_success_total"]
        assert got == sent, (a, got, sent, placement)

    # ... and each later request found its prefix in that server's cache.
    cached_by_server = collections.Counter()
    for g in range(GROUPS):
        for r, ep, _, usage in sorted(results[g]):
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
            cached_by_server[ep] += cached
            if r > 0:
                assert cached >= 0.8 * usage["prompt_tokens"], (g, r, usage)
    for a in addrs:
        hits = after[a]["vllm:prefix_cache_hits_total"] - before[a]["vllm:prefix_cache_hits_total"]
        assert hits >= cached_by_server[a] > 0, (a, hits, cached_by_server)
    print(f"\nplacement {placement}; cached tokens per server {dict(cached_by_server)}")


def test_vllm_generate_token_prompts_stick_through_envoy(real_fleet, envoy):
    """vLLM's own /inference/v1/generate (token IDs in, llm-d's
    vllmhttp-parser) is routed like a token-ID completion: each token-ID
    prefix group stays on one real server, which serves every request sent
    to it and finds the group's prefix in its cache."""
    import random

    from conftest import BLOCK_SIZE, MODEL

    addrs = real_fleet.addresses
    e = envoy(config=real_plugin_config(), endpoints=addrs)
    rnd = random.Random(46)
    groups, rounds, prefix_len = 4, 3, 24 * BLOCK_SIZE
    # Vocabulary 4096; ids 0-2 are the special tokens.
    prefixes = [[3 + rnd.randrange(4000) for _ in range(prefix_len)] for _ in range(groups)]
    before = _counters(addrs)
    placement = collections.defaultdict(set)
    for r in range(rounds):
        for g in range(groups):
            body = {"model": MODEL, "token_ids": prefixes[g] + [3 + rnd.randrange(4000) for _ in range(20)],
                    "sampling_params": {"max_tokens": 2, "temperature": 0}}
            resp = e2e.post(e.port, "/inference/v1/generate", body, timeout=180)
            assert resp.status == 200, resp
            assert resp.json()["choices"][0]["token_ids"], resp
            d = resp.decision
            assert d and d.get("endpoint") in addrs, resp
            placement[g].add(d["endpoint"])
    assert all(len(eps) == 1 for eps in placement.values()), dict(placement)
    after = _counters(addrs)
    for a in addrs:
        sent = rounds * sum(1 for eps in placement.values() if a in eps)
        got = after[a]["vllm:request_success_total"] - before[a]["vllm:request_success_total"]
        assert got == sent, (a, got, sent, dict(placement))
    # Rounds 1 and 2 of each group find its prefix's full blocks cached.
    hits = sum(after[a]["vllm:prefix_cache_hits_total"] - before[a]["vllm:prefix_cache_hits_total"] for a in addrs)
    assert hits >= 0.9 * groups * (rounds - 1) * prefix_len, (hits, dict(placement))
def test_anthropic_messages_conversations_stick_to_their_real_server(real_fleet, envoy):
    """Issue 46: multi-turn /v1/messages conversations (system blocks,
    tool_use and tool_result) through Envoy: each stays on one server, and
    that server's cache serves its earlier turns (Anthropic usage:
    cache_read_input_tokens)."""
    addrs = real_fleet.addresses
    e = envoy(config=real_plugin_config(), endpoints=addrs)
    convs = 4
    history = [[] for _ in range(convs)]
    home = {}
    for turn in range(3):
        for c in range(convs):
            if turn == 1:
                history[c].append({"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": f"toolu_{c}", "content": words(f"m-result-{c}", 40)},
                    {"type": "text", "text": words(f"m-user-{c}-{turn}", SUFFIX_WORDS)}]})
            else:
                history[c].append({"role": "user", "content": words(f"m-user-{c}-{turn}", SUFFIX_WORDS)})
            body = {"model": MODEL, "max_tokens": 2,
                    "system": [{"type": "text", "text": words(f"m-system-{c}", PREFIX_WORDS)}],
                    "messages": history[c]}
            r = e2e.post(e.port, "/v1/messages", body, timeout=180)
            assert r.status == 200, r
            d = r.decision
            assert d and d.get("endpoint") in addrs, r
            usage = r.json()["usage"]
            if turn == 0:
                home[c] = d["endpoint"]
                reply = [{"type": "text", "text": r.json()["content"][0]["text"]},
                         {"type": "tool_use", "id": f"toolu_{c}", "name": "lookup", "input": {"q": c}}]
            else:
                assert d["endpoint"] == home[c], f"conversation {c} turn {turn} moved: {r}"
                cached = usage.get("cache_read_input_tokens") or 0
                assert cached >= 0.7 * (cached + usage["input_tokens"]), (c, turn, usage)
                reply = r.json()["content"][0]["text"]
            history[c].append({"role": "assistant", "content": reply})
    print(f"\nplacement {home}")

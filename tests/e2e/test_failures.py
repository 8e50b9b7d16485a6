"""Bad input and missing endpoints, in fail-open and fail-closed mode.

Fail-open: the request still reaches a member (Envoy's fallback round robin).
Fail-closed: a 4xx with an OpenAI-style JSON error from the filter itself.
In both modes Envoy and every VM stay up, and later requests route normally.
"""

import json
import time

import pytest

from conftest import MODEL, completion, in_background, plugin_config, post, request, text, wait_until

BIG = 5 * 1024 * 1024  # over routing.maxBodyBytes (4 MiB), under Envoy's 8 MiB buffer
HUGE = 9 * 1024 * 1024  # over Envoy's per-connection buffer limit too


def _bad_requests():
    """(name, path, body bytes, headers) of requests the filter cannot route."""
    nested = ("[" * 100_000 + "]" * 100_000).encode()
    return [
        ("malformed-json", "/v1/completions", b'{"model": "m", "prompt": "abc', {"content-type": "application/json"}),
        ("not-an-object", "/v1/completions", b'"just a string"', {"content-type": "application/json"}),
        ("prompt-wrong-type", "/v1/completions", json.dumps({"model": MODEL, "prompt": 5}).encode(),
         {"content-type": "application/json"}),
        ("messages-wrong-type", "/v1/chat/completions", json.dumps({"model": MODEL, "messages": "hi"}).encode(),
         {"content-type": "application/json"}),
        ("missing-model", "/v1/completions", json.dumps({"prompt": "hello"}).encode(),
         {"content-type": "application/json"}),
        ("deeply-nested", "/v1/completions", b'{"model": "m", "prompt": ' + nested + b"}",
         {"content-type": "application/json"}),
        ("invalid-utf8", "/v1/completions", b'{"model": "m", "prompt": "\xff\xfe\xc3\x28 bad"}',
         {"content-type": "application/json"}),
        ("form-content-type", "/v1/completions", b"model=m&prompt=hello",
         {"content-type": "application/x-www-form-urlencoded"}),
        ("empty-body", "/v1/completions", b"", {"content-type": "application/json"}),
        ("over-max-body", "/v1/completions",
         json.dumps({"model": MODEL, "prompt": text("big", BIG), "max_tokens": 1}).encode(),
         {"content-type": "application/json"}),
    ]


def _assert_routes_normally(e, f, tag):
    """A well-formed request after the bad ones gets a decision and a member."""
    r = completion(e.port, text(f"after-{tag}", 4096))
    assert r.status == 200, r
    assert r.served_by in f.addresses, r
    assert r.decision and r.decision.get("endpoint") == r.served_by, r
    e.assert_alive()
    assert e.wasm_failures() == {}, e.wasm_failures()


def _assert_openai_error(r):
    body = r.json()
    assert isinstance(body.get("error"), dict), r
    assert isinstance(body["error"].get("message"), str) and body["error"]["message"], r
    assert "type" in body["error"], r


def test_fail_open_proxies_bad_requests(fleet, envoy):
    f = fleet(2)
    e = envoy(plugin_config(routing={"failureMode": "open"}), endpoints=f.addresses)
    for name, path, body, headers in _bad_requests():
        r = post(e.port, path, body, headers, timeout=60)
        # Proxied by the fallback load balancer: a member answered, whatever it said.
        assert r.served_by in f.addresses, f"{name}: not proxied: {r}"
        assert r.status != 503, f"{name}: {r}"
        _assert_routes_normally(e, f, name)


def test_fail_closed_rejects_bad_requests_with_openai_error(fleet, envoy):
    f = fleet(2)
    e = envoy(plugin_config(routing={"failureMode": "closed"}), endpoints=f.addresses)
    for name, path, body, headers in _bad_requests():
        r = post(e.port, path, body, headers, timeout=60)
        assert r.served_by is None, f"{name}: reached an endpoint in fail-closed mode: {r}"
        if name == "over-max-body":
            assert r.status in (400, 413), f"{name}: {r}"
        else:
            assert r.status == 400, f"{name}: {r}"
        _assert_openai_error(r)
        _assert_routes_normally(e, f, name)


@pytest.mark.parametrize("mode", ["open", "closed"])
def test_body_over_envoy_buffer_limit(fleet, envoy, mode):
    f = fleet(2)
    e = envoy(plugin_config(routing={"failureMode": mode}), endpoints=f.addresses)
    body = json.dumps({"model": MODEL, "prompt": text("huge", HUGE), "max_tokens": 1}).encode()
    try:
        r = post(e.port, "/v1/completions", body, {"content-type": "application/json"}, timeout=60)
    except (ConnectionError, OSError):
        r = None  # Envoy may close the connection while we are still sending
    if r is not None:
        if mode == "closed":
            assert r.served_by is None, r
            assert r.status in (400, 413), r
        else:
            assert r.status == 413 or r.served_by in f.addresses, r
    _assert_routes_normally(e, f, f"huge-{mode}")


def test_non_inference_requests_pass_through(fleet, envoy):
    f = fleet(2)
    e = envoy(plugin_config(routing={"failureMode": "closed"}), endpoints=f.addresses)
    r = request(e.port, "GET", "/v1/models")
    assert r.served_by in f.addresses, r
    assert r.status != 400, r
    _assert_routes_normally(e, f, "get")


def test_no_known_endpoints(fleet, envoy):
    """The filter knows no endpoints (discovery reads a cluster that does not
    exist) while the cluster has members: fail-open falls back to round robin,
    fail-closed answers 503 with a JSON error."""
    f = fleet(2)
    missing = {"fromCluster": {"cluster": "no-such-cluster", "adminCluster": "envoy_admin", "refreshMs": 200}}

    e_open = envoy(plugin_config(routing={"failureMode": "open"}, endpoints=missing),
                   endpoints=f.addresses, wait_endpoints=False)
    assert e_open.state()["endpoints"] == []
    served = set()
    for i in range(4):
        r = completion(e_open.port, text(f"open-{i}", 2048))
        assert r.status == 200, r
        served.add(r.served_by)
    assert served == set(f.addresses), served
    e_open.assert_alive()

    e_closed = envoy(plugin_config(routing={"failureMode": "closed"}, endpoints=missing),
                     endpoints=f.addresses, wait_endpoints=False)
    r = completion(e_closed.port, text("closed", 2048))
    assert r.status == 503, r
    assert r.served_by is None, r
    _assert_openai_error(r)
    e_closed.assert_alive()
    assert e_closed.wasm_failures() == {}


def test_each_model_reaches_only_its_servers_and_an_unknown_one_is_404(fleet, envoy):
    """Several models behind one pool: server A serves MODEL and the LoRA
    adapter "sql", server B "other-model". Once the collector has read their
    /metrics and /v1/models, each model's requests reach only its server; a
    model neither serves is the filter's own 404 in fail-closed mode (no
    server answered: no x-served-by), counted."""
    a = fleet(1, "--lora-modules", "sql", "--max-loras", "2")
    b = fleet(1, "--model", "other-model")
    e = envoy(plugin_config(routing={"failureMode": "closed"}), endpoints=a.addresses + b.addresses)

    def filter_404():
        r = completion(e.port, "probe", model="no-such-model")
        return r.status == 404 and r.served_by is None

    wait_until(filter_404, timeout=15, what="the filter knows both servers' models")
    r = completion(e.port, "probe", model="no-such-model")
    assert r.json()["error"] == {
        "message": "The model `no-such-model` does not exist.",
        "type": "NotFoundError",
        "param": "model",
        "code": 404,
    }, r
    for model, want in ((MODEL, a.addresses[0]), ("sql", a.addresses[0]), ("other-model", b.addresses[0])):
        for i in range(4):
            r = completion(e.port, text(f"{model}-{i}", 600), model=model)
            assert r.status == 200, r
            assert r.served_by == want, (model, r)
    stats = e.admin("/stats?filter=kvroute_unknown_model").body.decode()
    n = [int(v) for k, _, v in (l.partition(": ") for l in stats.splitlines()) if k.endswith("kvroute_unknown_model")]
    assert n and n[0] >= 2, stats
    e.assert_alive()
    assert e.wasm_failures() == {}, e.wasm_failures()


def test_lora_affinity_prefers_the_server_running_the_adapter_and_a_free_slot_for_another(fleet, envoy):
    """llm-d's lora-affinity-scorer on what the servers report: two servers
    serve the adapters "sql" and "chat" with one adapter slot each
    (--max-loras 1). While a long "sql" request runs on one of them (its
    /metrics lists "sql" in vllm:lora_requests_info, as vLLM does), more
    "sql" requests go there (1.0 against a free slot's 0.8), and "chat"
    requests go to the other server (a free slot, 0.8, against a full one,
    0). Without the servers' reports every endpoint would tie."""
    f = fleet(2, "--lora-modules", "sql,chat", "--max-loras", "1")
    cfg = plugin_config(collector={"metricsPollIntervalMs": 200})
    cfg["plugins"].append({"type": "lora-affinity-scorer"})
    cfg["schedulingProfiles"][0]["plugins"] = [{"pluginRef": "lora-affinity-scorer"},
                                               {"pluginRef": "max-score-picker"}]
    e = envoy(cfg, endpoints=f.addresses)
    wait_until(lambda: all((x.get("metrics") or {}).get("fresh") for x in e.state()["endpoints"]),
               timeout=10, what="fresh metrics")
    # About 300 tokens x 25 ms: the "sql" request runs for ~7 s.
    t, res = in_background(completion, e.port, text("lora-long", 400), max_tokens=300, model="sql", timeout=60)
    wait_until(lambda: any(s["inflightRequests"] > 0 for s in e.state()["endpoints"]), timeout=5,
               what="the long request charged")
    running = next(a for a, s in e.state_by_address().items() if s["inflightRequests"] > 0)
    other = next(a for a in f.addresses if a != running)
    # Two metrics polls: the filter has read that "sql" runs there.
    time.sleep(0.6)
    try:
        for i in range(4):
            r = completion(e.port, text(f"lora-sql-{i}", 400), max_tokens=1, model="sql")
            assert r.status == 200 and r.served_by == running, (i, r)
            r = completion(e.port, text(f"lora-chat-{i}", 400), max_tokens=1, model="chat")
            assert r.status == 200 and r.served_by == other, (i, r)
    finally:
        t.join()
    assert res and res[0].status == 200, res
    assert e.wasm_failures() == {}

"""Safe defaults, and the internal state listener.

The shipped plugin config (envoy/kvroute-config.json) turns neither
routing.statePath nor routing.debugHeader on, so the client listener shows
clients neither the shared state nor the decision details. render.py's
--state-listener adds a second listener (same module, same vm_id, so the same
shared data) whose filter serves the state; it has no route to the model
servers.
"""

import json

from conftest import (
    DECISION, SERVED_BY, SHIPPED_PLUGIN_CONFIG, STATE_PATH, completion, in_background, request, text,
    wait_until,
)


def test_shipped_config_turns_off_state_and_debug_header():
    routing = SHIPPED_PLUGIN_CONFIG.get("routing", {})
    assert not routing.get("debugHeader"), routing
    assert "statePath" not in routing, routing


def test_client_listener_serves_no_state_by_default_internal_listener_does(fleet, envoy):
    f = fleet(2)
    # The shipped config as it is; the fixture waits on the internal listener's state.
    e = envoy(json.loads(json.dumps(SHIPPED_PLUGIN_CONFIG)), endpoints=f.addresses, state_listener=True)

    # Client listener: a GET of the state path is just proxied to a model
    # server; no state JSON, and routed requests carry no decision header.
    r = request(e.port, "GET", STATE_PATH, timeout=5)
    assert r.headers.get(SERVED_BY) in f.addresses, r
    assert b'"endpoints"' not in r.body and b"inflightRequests" not in r.body, r
    for i in range(4):
        r = completion(e.port, text(900 + i, 600))
        assert r.status == 200 and r.headers.get(SERVED_BY) in f.addresses, r
        assert DECISION not in r.headers, r

    # Internal listener: the state, with the client listener's traffic in it
    # (shared data): a request held in flight on the client listener shows up.
    st = e.state()
    assert {x["address"] for x in st["endpoints"]} == set(f.addresses), st
    t, res = in_background(completion, e.port, text(950, 600), headers={"x-emulator-delay-ms": "2000"})
    held = wait_until(
        lambda: [x for x in e.state()["endpoints"] if x["inflightRequests"] > 0],
        timeout=5, what="the held request in the internal listener's state",
    )
    assert len(held) == 1 and held[0]["inflightTokens"] > 0, held
    t.join(timeout=10)
    assert res and not isinstance(res[0], Exception) and res[0].status == 200, res
    assert res[0].headers.get(SERVED_BY) == held[0]["address"], (res, held)
    wait_until(
        lambda: all(x["inflightRequests"] == 0 for x in e.state()["endpoints"]),
        timeout=5, what="in-flight back to 0",
    )

    # The internal listener routes nothing: every other path (and a
    # completion) gets Envoy's 404, no model server sees it, no decision header.
    before = {a: f.stats(a)["requests"] for a in f.addresses}
    inserts = {x["address"]: x["insertCounter"] for x in e.state()["endpoints"]}
    for method, path, body in (("GET", "/", None), ("GET", "/v1/models", None),
                               ("POST", STATE_PATH, b"{}"),
                               ("POST", "/v1/completions",
                                {"model": "kvroute-e2e", "prompt": text(960, 600), "max_tokens": 4})):
        r = request(e.state_port, method, path, body, timeout=5)
        assert r.status == 404, (method, path, r)
        assert SERVED_BY not in r.headers and DECISION not in r.headers, (method, path, r)
    assert {a: f.stats(a)["requests"] for a in f.addresses} == before
    # ... and the filter is off there: nothing was routed or indexed.
    assert {x["address"]: x["insertCounter"] for x in e.state()["endpoints"]} == inserts
    # A query string does not hide the state.
    r = request(e.state_port, "GET", STATE_PATH + "?pretty=1", timeout=5)
    assert r.status == 200 and "endpoints" in r.json(), r

    e.assert_alive()
    assert e.wasm_failures() == {}

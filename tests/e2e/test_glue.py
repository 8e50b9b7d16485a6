"""The module's glue on the proxy-wasm SDK, through real Envoy.

The SDK's String getters for headers unwrap UTF-8, and a client may send any
octet in a header value (RFC 9110 obs-text). The glue reads headers as bytes;
these tests prove a client cannot kill a worker's VM that way.
"""

from conftest import completion, request, text


def test_non_utf8_header_values_are_routed_and_do_not_kill_the_vm(fleet, envoy):
    f = fleet(2)
    e = envoy(endpoints=f.addresses)
    odd = {"x-odd": "caf\xe9 \xff\xfe"}  # http.client sends str headers as latin-1 bytes
    prompt = text("non-utf8-header", 4096)
    for i in range(3):
        r = completion(e.port, prompt + f" {i}", headers=odd)
        assert r.status == 200, r
        assert r.served_by in f.addresses, r
        assert r.decision, f"not routed by kvroute: {r}"
    r = request(e.port, "GET", "/v1/models", headers=odd)
    assert r.status == 200, r
    # Same worker VMs afterwards: none was reloaded, and routing goes on.
    assert e.wasm_failures() == {}
    e.assert_alive()
    r = completion(e.port, prompt + " after")
    assert r.status == 200 and r.decision, r

"""A request Envoy retries to another endpoint takes its charge with it
(issue 40 point 5).

The shipped route retries on connect-failure, refused-stream and
reset-before-request to the next address of the destination header. One
endpoint of the static list has nothing listening: requests routed to it
fail to connect and are retried to a live one. Once a retried request's
response headers are in, the dead endpoint holds no charge and the live
ones all of it; afterwards nothing is in flight, and the dead endpoint was
never credited the prompts' bytes (its server never saw them).
"""

import http.client
import json

from conftest import MODEL, free_ports, text, wait_until
from test_kv_events import stat


def by_address(e):
    return {ep["address"]: ep for ep in e.state()["endpoints"]}


def test_a_retried_request_moves_its_charge(fleet, envoy):
    f = fleet(2)
    dead = f"127.0.0.1:{free_ports(1)[0]}"
    e = envoy(endpoints=f.addresses + [dead], concurrency=1)
    moved = 0
    for i in range(6):
        body = json.dumps({"model": MODEL, "prompt": text(f"retried-{i}", 3000),
                           "max_tokens": 64, "stream": True})
        conn = http.client.HTTPConnection("127.0.0.1", e.port, timeout=60)
        conn.request("POST", "/v1/completions", body, {"content-type": "application/json"})
        r = conn.getresponse()  # headers only: the stream is still running
        assert r.status == 200, r.status
        now = by_address(e)
        assert now[dead]["inflightRequests"] == 0, (i, now[dead])
        assert sum(now[a]["inflightRequests"] for a in f.addresses) == 1, (i, now)
        r.read()
        conn.close()
        wait_until(lambda: all(ep["inflightRequests"] == 0 for ep in by_address(e).values()),
                   timeout=5, what="released")
    moved = wait_until(lambda: stat(e, "wasmcustom.kvroute_charge_moved"), timeout=2,
                       what="a request retried off the dead endpoint")
    assert moved >= 1
    assert by_address(e)[dead]["routedPromptBytes"] == 0, by_address(e)[dead]
    assert all(ep["inflightTokens"] == 0 for ep in by_address(e).values())

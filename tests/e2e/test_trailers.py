"""A request body that ends with HTTP/2 trailers (gRPC-style, over h2c) is
routed and charged like any other (issue 40 point 5).

Such a body never has a body callback with end of stream: the last one is
followed by the trailers. Before the filter handled the trailers callback,
the request went upstream unrouted and uncharged (Envoy's fallback load
balancer picked the server). The client is the `h2` package speaking
HTTP/2 with prior knowledge to the client listener (codec AUTO).
"""

import json
import socket

import h2.config
import h2.connection
import h2.events

from conftest import MODEL, wait_until
from test_kv_events import stat


def h2_post_with_trailers(port, path, body, trailers, timeout=30):
    """POST `body` over h2c with `trailers` after it; returns (status, headers, body)."""
    s = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    try:
        conn = h2.connection.H2Connection(config=h2.config.H2Configuration(client_side=True))
        conn.initiate_connection()
        sid = conn.get_next_available_stream_id()
        conn.send_headers(sid, [(":method", "POST"), (":path", path), (":scheme", "http"),
                                (":authority", "kvroute"), ("content-type", "application/json")])
        conn.send_data(sid, body)
        conn.send_headers(sid, trailers, end_stream=True)
        s.sendall(conn.data_to_send())
        status, headers, data, done = None, {}, b"", False
        while not done:
            chunk = s.recv(65536)
            if not chunk:
                break
            for ev in conn.receive_data(chunk):
                if isinstance(ev, h2.events.ResponseReceived):
                    headers = {k.decode(): v.decode() for k, v in ev.headers}
                    status = int(headers[":status"])
                elif isinstance(ev, h2.events.DataReceived):
                    data += ev.data
                    conn.acknowledge_received_data(ev.flow_controlled_length, ev.stream_id)
                elif isinstance(ev, (h2.events.StreamEnded, h2.events.StreamReset)):
                    done = True
            s.sendall(conn.data_to_send())
        return status, headers, data
    finally:
        s.close()


def test_a_body_with_trailers_is_routed_and_charged(envoy, fleet):
    f = fleet(2)
    e = envoy(endpoints=f.addresses, concurrency=1)
    body = json.dumps({"model": MODEL, "max_tokens": 4,
                       "messages": [{"role": "user", "content": "a request with trailers " * 40}]}).encode()
    routed0 = stat(e, "wasmcustom.kvroute_routed")
    fail_open0 = stat(e, "wasmcustom.kvroute_fail_open")
    for _ in range(3):
        status, headers, data = h2_post_with_trailers(e.port, "/v1/chat/completions", body,
                                                      [("x-checksum", "abc")])
        assert status == 200, (status, data[:300])
        assert json.loads(data)["choices"], data[:300]
    # Counters reach Envoy on the filter's 200 ms tick.
    wait_until(lambda: stat(e, "wasmcustom.kvroute_routed") - routed0 == 3, timeout=5,
               what="three routed requests")
    assert stat(e, "wasmcustom.kvroute_fail_open") == fail_open0
    # Charged and released: nothing is left in flight.
    wait_until(lambda: all(ep["inflightRequests"] == 0 for ep in e.state()["endpoints"]),
               timeout=5, what="charges released")

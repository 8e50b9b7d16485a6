"""In-flight accounting returns to zero after every kind of exit.

A mixed run (streaming, non-streaming, upstream 500s, upstream resets before
the first byte and after the first chunk, client aborts before and during the
response, bad bodies) is sent concurrently. While it runs the filter's state
must show charges; afterwards every endpoint's in-flight requests and tokens
must be back at zero.
"""

import http.client
import json
import socket
import threading
import time

from conftest import MODEL, completion, post, text, wait_until


def _raw_request(port, body, headers):
    hdrs = {"host": "kvroute", "content-type": "application/json", "content-length": str(len(body))}
    hdrs.update(headers)
    head = "POST /v1/completions HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in hdrs.items()) + "\r\n"
    return head.encode() + body


def client_abort(port, prompt, read_bytes, delay_ms):
    """Send a streaming request; read `read_bytes` of the response (0: none),
    then close the socket without finishing."""
    body = json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 200, "stream": True}).encode()
    s = socket.create_connection(("127.0.0.1", port), timeout=30)
    try:
        s.sendall(_raw_request(port, body, {"x-emulator-delay-ms": str(delay_ms)}))
        got = 0
        if read_bytes == 0:
            time.sleep(0.5)
        while got < read_bytes:
            chunk = s.recv(4096)
            if not chunk:
                break
            got += len(chunk)
    finally:
        s.close()
    return "aborted"


def _streaming(port, prompt, headers=None):
    r = completion(port, prompt, max_tokens=16, stream=True, headers=headers, timeout=60)
    return r


def _workload(port):
    """(callable, args) for every request of the mixed run."""
    jobs = []
    for i in range(8):
        jobs.append((completion, (port, text(f"plain-{i}", 3000)), {"max_tokens": 8}))
        jobs.append((_streaming, (port, text(f"stream-{i}", 3000)), {}))
    for i in range(4):
        jobs.append((completion, (port, text(f"err500-{i}", 3000)), {"headers": {"x-emulator-fail": "500"}}))
        jobs.append((completion, (port, text(f"rst0-{i}", 3000)),
                     {"headers": {"x-emulator-fail": "reset-before-first-byte"}}))
        jobs.append((_streaming, (port, text(f"rst1-{i}", 3000)),
                     {"headers": {"x-emulator-fail": "reset-after-first-chunk"}}))
        jobs.append((client_abort, (port, text(f"abort-early-{i}", 3000), 0, 3000), {}))
        jobs.append((client_abort, (port, text(f"abort-mid-{i}", 3000), 1, 0), {}))
        jobs.append((post, (port, "/v1/completions", b'{"model": "m", "prompt": ', {}), {}))
    # Requests held long enough that the state is read while they are in flight.
    for i in range(4):
        jobs.append((completion, (port, text(f"held-{i}", 3000)), {"headers": {"x-emulator-delay-ms": "3000"}}))
    return jobs


def _run_all(jobs):
    errors = []

    def run(fn, args, kwargs):
        try:
            fn(*args, **kwargs)
        except (OSError, http.client.HTTPException, json.JSONDecodeError):
            pass  # resets and aborts are the point; the state is what we check
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=run, args=job, daemon=True) for job in jobs]
    for t in threads:
        t.start()
    return threads, errors


def _totals(e):
    eps = e.state()["endpoints"]
    return sum(x["inflightRequests"] for x in eps), sum(x["inflightTokens"] for x in eps)


def test_inflight_returns_to_zero_after_mixed_run(fleet, envoy):
    f = fleet(2)
    e = envoy(endpoints=f.addresses, concurrency=2)
    assert _totals(e) == (0, 0)

    threads, errors = _run_all(_workload(e.port))
    # While the held requests are in flight, charges are visible.
    wait_until(lambda: _totals(e)[0] > 0 and _totals(e)[1] > 0, timeout=10, what="non-zero in-flight charges")
    for t in threads:
        t.join(timeout=90)
    assert not any(t.is_alive() for t in threads), "some requests never finished"
    assert not errors, errors

    wait_until(
        lambda: all(x["inflightRequests"] == 0 and x["inflightTokens"] == 0 for x in e.state()["endpoints"]),
        timeout=15,
        what="every endpoint's in-flight requests and tokens back at zero",
    )
    e.assert_alive()
    assert e.wasm_failures() == {}
    # And the fleet is still routable afterwards.
    r = completion(e.port, text("afterwards", 3000))
    assert r.status == 200 and r.served_by in f.addresses, r

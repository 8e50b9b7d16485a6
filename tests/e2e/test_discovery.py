"""Endpoint discovery from an Envoy cluster through the admin API.

The vllm cluster takes its members from an EDS file (rewritten atomically);
the collector reads /clusters?format=json through the envoy_admin cluster.
Adding or removing a member changes the set the filter routes to.
"""

import collections

from conftest import completion, in_background, text, wait_until


def _spread(e, tag, n):
    """n distinct requests held in flight one after another, so the in-flight
    load sends each to the least-loaded known endpoint. Returns who served."""
    held = []
    for i in range(n):
        held.append(in_background(completion, e.port, text(f"{tag}-{i}", 4096),
                                  headers={"x-emulator-delay-ms": "2000"}, timeout=30))
        wait_until(lambda: sum(x["inflightRequests"] for x in e.state()["endpoints"]) >= i + 1,
                   timeout=10, what="request charged")
    served = collections.Counter()
    for t, res in held:
        t.join()
        (r,) = res
        assert not isinstance(r, Exception), r
        assert r.status == 200, r
        served[r.served_by] += 1
    return served


def _addresses(e):
    return {x["address"] for x in e.state()["endpoints"]}


def test_members_follow_the_envoy_cluster(fleet, envoy):
    f = fleet(3)
    a, b, c = f.addresses
    e = envoy(eds=[a, b])  # waits until the state lists exactly a and b
    served = _spread(e, "two", 4)
    assert set(served) == {a, b}, served

    e.set_members([a, b, c])
    wait_until(lambda: _addresses(e) == {a, b, c}, timeout=10, what="c discovered")
    served = _spread(e, "three", 6)
    assert set(served) == {a, b, c}, served

    e.set_members([a, c])
    wait_until(lambda: _addresses(e) == {a, c}, timeout=10, what="b removed")
    served = _spread(e, "after-removal", 6)
    assert set(served) == {a, c}, served
    e.assert_alive()
    assert e.wasm_failures() == {}


def test_empty_cluster_then_members_arrive(fleet, envoy):
    f = fleet(2)
    e = envoy(eds=[], wait_endpoints=False)
    assert _addresses(e) == set()
    e.set_members(f.addresses)
    wait_until(lambda: _addresses(e) == set(f.addresses), timeout=10, what="members discovered")
    r = completion(e.port, text("first", 4096))
    assert r.status == 200 and r.served_by in f.addresses, r
    assert r.decision and r.decision.get("endpoint") == r.served_by, r

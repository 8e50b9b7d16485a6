//! Flow control in the real module under the harness host: a request that
//! meets a saturated pool stays paused after its body (nothing upstream),
//! and the worker's tick dispatches it through `proxy_set_effective_context`
//! and `proxy_continue_stream` when capacity frees; a client that leaves
//! while waiting leaves no charge; a request waiting past its TTL is
//! answered 429 with `Retry-After`.

use crate::support::*;
use kvroute_harness::Cluster;
use std::time::Duration;

/// Flow control with a concurrency-detector at one request per endpoint
/// (three endpoints: three go, the rest wait), TTL 2 s.
fn flow_config() -> String {
    config(serde_json::json!({
        "featureGates": ["flowControl"],
        "plugins": [
            {"type": "approx-prefix-cache-producer", "parameters": {"blockSizeTokens": 16}},
            {"type": "queue-scorer"},
            {"type": "max-score-picker"},
            {"type": "concurrency-detector", "parameters": {"maxConcurrency": 1}}
        ],
        "schedulingProfiles": [{"name": "d", "plugins": [{"pluginRef": "queue-scorer"}, {"pluginRef": "max-score-picker"}]}],
        "flowControl": {"saturationDetector": {"pluginRef": "concurrency-detector"}, "defaultRequestTTL": "2s"}
    }))
}

fn send(c: &Cluster, vm: usize, prompt_prefix: &str) -> kvroute_harness::Req {
    let req = c
        .start_request(
            vm,
            &[(":method", "POST"), (":path", "/v1/completions")],
            false,
        )
        .unwrap();
    c.send_body(req, &completion(&prompt(prompt_prefix, 64), false), true)
        .unwrap();
    req
}

#[test]
fn waiting_requests_are_dispatched_on_the_tick_and_leave_nothing_behind() {
    let c = Cluster::new();
    add_workers(&c, 1, &flow_config());
    let a = send(&c, 0, "a");
    let b = send(&c, 0, "b");
    let d = send(&c, 0, "d");
    assert!(primary(&c, a).is_some() && primary(&c, b).is_some() && primary(&c, d).is_some());
    // The pool is saturated (3 of 3): the next two wait, paused.
    let w1 = send(&c, 0, "w1");
    let w2 = send(&c, 0, "w2");
    assert_eq!(c.upstream_headers(w1), None, "waiting: nothing upstream");
    assert_eq!(c.upstream_headers(w2), None);
    assert_eq!(total_inflight(&c).1, 3, "a waiting request holds no charge");
    // The tick dispatches nothing while nothing frees.
    c.advance(Duration::from_millis(20)).unwrap();
    assert_eq!(c.upstream_headers(w1), None);
    // w2's client goes away while it waits.
    c.client_abort(w2).unwrap();
    // a ends: the next tick sends w1 on, routed.
    c.respond(a, &[b"{}"]).unwrap();
    c.advance(Duration::from_millis(10)).unwrap();
    assert!(
        primary(&c, w1).is_some(),
        "w1 dispatched with a destination"
    );
    assert_eq!(total_inflight(&c).1, 3);
    for r in [b, d, w1] {
        c.respond(r, &[b"{}"]).unwrap();
    }
    assert_eq!(total_inflight(&c), (0, 0), "every charge released");
    assert_eq!(stat(&c, "kvroute_flow_dispatched.band.0"), 1);
    assert_eq!(stat(&c, "kvroute_flow_cancelled.band.0"), 1);
    assert!(c.open_streams(0).is_empty());
}

#[test]
fn a_request_waiting_past_its_ttl_gets_429_with_retry_after() {
    let c = Cluster::new();
    add_workers(&c, 1, &flow_config());
    let held: Vec<_> = ["a", "b", "d"].iter().map(|p| send(&c, 0, p)).collect();
    let w = send(&c, 0, "late");
    assert_eq!(c.upstream_headers(w), None);
    c.advance(Duration::from_millis(2_100)).unwrap();
    assert_eq!(c.downstream_status(w), Some(429));
    let s = c.stream(w).unwrap();
    let headers = s.downstream_headers.unwrap();
    let has = |k: &str, v: &str| headers.iter().any(|(a, b)| a == k && b == v);
    assert!(has("retry-after", "1"), "{headers:?}");
    assert!(
        has("x-llm-d-request-dropped-reason", "rejected-ttl-expired"),
        "{headers:?}"
    );
    for r in held {
        c.respond(r, &[b"{}"]).unwrap();
    }
    assert_eq!(total_inflight(&c), (0, 0));
    assert_eq!(stat(&c, "kvroute_flow_shed_ttl.band.0"), 1);
}

//! Session affinity in the real module, across two worker VMs: a
//! `session_id` binding made by a 2xx on one worker steers the session's
//! next request on the other; a 5xx binds nothing; `encoded_endpoint_header`
//! sets the token on an accepted response only.

use crate::support::*;
use kvroute_harness::{Cluster, Req};

fn session_config(strategy: serde_json::Value) -> String {
    config(serde_json::json!({
        "plugins": [
            {"type": "approx-prefix-cache-producer"},
            {"type": "prefix-cache-affinity-filter"},
            {"type": "session-affinity-scorer", "parameters": strategy},
            {"type": "active-request-scorer"},
            {"type": "max-score-picker"}
        ],
        "schedulingProfiles": [{"name": "d", "plugins": [
            {"pluginRef": "prefix-cache-affinity-filter"},
            {"pluginRef": "session-affinity-scorer", "weight": 10},
            {"pluginRef": "active-request-scorer"},
            {"pluginRef": "max-score-picker"}
        ]}]
    }))
}

/// A routable request on filter VM `vm` with `extra` headers.
fn send(c: &Cluster, vm: usize, extra: &[(&str, &str)], prompt_seed: &str) -> Req {
    let body = completion(&prompt(prompt_seed, 200), false);
    let len = body.len().to_string();
    let mut h = vec![
        (":method", "POST"),
        (":path", "/v1/completions"),
        (":authority", "kvroute.test"),
        (":scheme", "http"),
        ("content-type", "application/json"),
        ("content-length", len.as_str()),
    ];
    h.extend_from_slice(extra);
    let req = c.start_request(vm, &h, false).unwrap();
    c.send_body(req, &body, true).unwrap();
    req
}

fn client_header(c: &Cluster, req: Req, name: &str) -> Option<String> {
    c.stream(req)?
        .downstream_headers?
        .into_iter()
        .find(|(k, _)| k.eq_ignore_ascii_case(name))
        .map(|(_, v)| v)
}

#[test]
fn a_binding_made_on_one_worker_steers_the_other() {
    // The collector is VM 0; the workers are VMs 1 and 2.
    let c = fleet(
        2,
        &session_config(serde_json::json!({"strategy": "session_id"})),
    );
    let sess = [("x-session-id", "harness-session")];
    // Rejected: nothing bound.
    let r = send(&c, 1, &sess, "rejected");
    c.respond_headers(r, 503, &[], true).unwrap();
    assert_eq!(stat(&c, "kvroute_session_bound"), 0);
    // Accepted on worker 0: bound there.
    let r = send(&c, 1, &sess, "first");
    let home = primary(&c, r).unwrap();
    c.respond(r, &[b"{}"]).unwrap();
    // Keep a request in flight on home: active-request would avoid it.
    let busy = send(&c, 1, &[], "first");
    assert_eq!(
        primary(&c, busy).as_deref(),
        Some(home.as_str()),
        "the same prompt sticks"
    );
    for (i, vm) in [2, 1, 2].into_iter().enumerate() {
        let r = send(&c, vm, &sess, &format!("turn-{i}"));
        assert_eq!(
            primary(&c, r).as_deref(),
            Some(home.as_str()),
            "turn {i} on worker {vm}"
        );
        c.respond(r, &[b"{}"]).unwrap();
    }
    c.respond(busy, &[b"{}"]).unwrap();
    assert_eq!(stat(&c, "kvroute_session_bound"), 4);
    assert_eq!(stat(&c, "kvroute_session_hits"), 3);
}

#[test]
fn the_token_is_set_on_accepted_responses_only() {
    let c = fleet(2, &session_config(serde_json::json!({})));
    let r = send(&c, 1, &[], "a");
    assert!(primary(&c, r).is_some());
    c.respond_headers(r, 500, &[], true).unwrap();
    assert_eq!(client_header(&c, r, "x-session-token"), None);
    let r = send(&c, 2, &[], "b");
    let to_b = primary(&c, r).unwrap();
    c.respond(r, &[b"{}"]).unwrap();
    let token = client_header(&c, r, "x-session-token").expect("token on a 2xx");
    // Echoed on the other worker with garbage around: followed or ignored,
    // never a failure.
    let r = send(&c, 1, &[("x-session-token", token.as_str())], "c");
    assert_eq!(primary(&c, r).as_deref(), Some(to_b.as_str()));
    c.respond(r, &[b"{}"]).unwrap();
    for bad in ["%%%%", "=", "QUFBQUFB=", "MTAuOS45Ljk6ODA="] {
        let r = send(&c, 2, &[("x-session-token", bad)], "d");
        assert!(primary(&c, r).is_some(), "{bad}");
        c.respond(r, &[b"{}"]).unwrap();
    }
}

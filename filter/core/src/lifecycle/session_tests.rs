//! Session affinity through the lifecycle: two worker VMs over one shared
//! store, bindings written only when a server accepts (a 2xx), the
//! encoded token only on routed, accepted responses.

use super::*;

/// Two endpoints, the affinity gate, token-load, and a session plugin.
fn doc(session: &str, weight: &str) -> String {
    format!(
        r#"{{"endpoints":{{"static":["127.0.0.1:1","127.0.0.1:2"]}},
    "plugins":[{{"type":"approx-prefix-cache-producer","parameters":{{"blockSizeTokens":16}}}},
               {{"type":"prefix-cache-affinity-filter"}},{{"type":"token-load-scorer"}},{{"type":"max-score-picker"}},
               {{"type":"session-affinity-scorer","parameters":{session}}}],
    "schedulingProfiles":[{{"name":"d","plugins":[{{"pluginRef":"prefix-cache-affinity-filter"}},{{"pluginRef":"token-load-scorer"}},
        {{"pluginRef":"session-affinity-scorer","weight":{weight}}},{{"pluginRef":"max-score-picker"}}]}}],
    "routing":{{"seed":7}}}}"#
    )
}

/// Two filter workers (VMs) configured on one host: one shared store.
fn two_workers(doc: &str) -> (FakeHost, Rc<Worker>, Rc<Worker>) {
    let host = FakeHost::default();
    host.now_ns.set(5_000_000_000);
    *host.config.borrow_mut() = doc.as_bytes().to_vec();
    *host.root_id.borrow_mut() = b"kvroute".to_vec();
    let mut ws = (0..2).map(|_| match configure(&host) {
        Ok(Role::Filter { worker, .. }) => worker,
        _ => panic!("not a filter"),
    });
    let (a, b) = (ws.next().unwrap(), ws.next().unwrap());
    (host, a, b)
}

/// Headers (with `extra`) and the whole body through worker `w`; the
/// routed endpoint.
fn send(
    host: &FakeHost,
    w: &Rc<Worker>,
    extra: &[(&str, &[u8])],
    body: Vec<u8>,
) -> (Stream, String) {
    host.set_request("POST", "/v1/chat/completions", extra);
    host.response_headers.borrow_mut().clear();
    *host.upstream.borrow_mut() = None;
    let mut s = Stream::new(Some(w.clone()));
    assert_eq!(s.on_request_headers(host, false), Action::Pause);
    let n = body.len();
    *host.body.borrow_mut() = body;
    assert_eq!(s.on_request_body(host, n, true), Action::Continue);
    let dest = host
        .header("x-gateway-destination-endpoint")
        .unwrap_or_default();
    (s, dest.split(',').next().unwrap_or("").to_string())
}

/// A counter over both workers (the host's counters are the process's).
fn total(host: &FakeHost, a: &Worker, b: &Worker, c: Counter) -> i64 {
    a.flush(host);
    b.flush(host);
    host.counter(c)
}

fn own_prompt(i: usize) -> Vec<u8> {
    serde_json::json!({"model":"m","messages":[{"role":"user","content":format!("prompt {i} {}", "own words ".repeat(20 + i))}]})
        .to_string()
        .into_bytes()
}

fn token_set(host: &FakeHost, name: &str) -> Option<String> {
    host.response_headers
        .borrow()
        .iter()
        .find(|(k, _)| k == name)
        .map(|(_, v)| v.clone())
}

/// A 5xx and a reset bind nothing; the first 2xx binds the session, on
/// either worker, and every later request through either worker goes to
/// that endpoint although the charges held there make the other lighter.
#[test]
fn only_accepted_work_binds_and_both_workers_see_the_binding() {
    let (host, a, b) = two_workers(&doc(
        r#"{"strategy":"session_id","sessionIdConfig":{"sources":[{"attribute":"agent-identity"}]}}"#,
        "10",
    ));
    let sess: &[(&str, &[u8])] = &[("x-claude-code-session-id", b"0c5e-claude")];
    // Rejected and reset: no binding, so each next request is placed on load.
    let (mut s, _) = send(&host, &a, sess, own_prompt(0));
    serve(&host, &mut s, "503");
    let (s, _) = send(&host, &b, sess, own_prompt(1));
    let mut s = s;
    s.on_end(&host);
    assert_eq!(total(&host, &a, &b, Counter::SessionBound), 0);
    assert_eq!(total(&host, &a, &b, Counter::SessionHits), 0);
    // Hold a charge on `first` so that load alone would avoid it, then
    // accept a request there: that binds.
    let (mut held, at) = send(&host, &a, &[], own_prompt(2));
    let (mut s, home) = send(&host, &b, sess, own_prompt(3));
    assert_ne!(home, at, "placed on load, away from the held charge");
    serve(&host, &mut s, "200");
    assert_eq!(total(&host, &a, &b, Counter::SessionBound), 1);
    // Charge `home` now: load points away, the session holds.
    let (mut held2, _) = send(&host, &a, &[], own_prompt(4));
    for (i, w) in [&a, &b, &a, &b].into_iter().enumerate() {
        let (mut s, to) = send(&host, w, sess, own_prompt(10 + i));
        assert_eq!(to, home, "request {i}");
        serve(&host, &mut s, "200");
    }
    assert_eq!(total(&host, &a, &b, Counter::SessionHits), 4);
    serve(&host, &mut held, "200");
    serve(&host, &mut held2, "200");
    // No token header with this strategy.
    assert_eq!(token_set(&host, "x-session-token"), None);
}

/// The encoded token: set to the serving endpoint on a routed 2xx, never
/// on a rejection; a token naming an endpoint is followed.
#[test]
fn the_token_names_the_endpoint_that_served_an_accepted_request() {
    let (host, a, b) = two_workers(&doc("{}", "10"));
    let (mut s, to) = send(&host, &a, &[], own_prompt(0));
    serve(&host, &mut s, "200");
    let token = token_set(&host, "x-session-token").expect("set on a 2xx");
    assert_eq!(token, crate::scheduling::session::encode_token(&to));
    // Echoed through the other worker, with the endpoint loaded: followed.
    let (mut held, _) = send(&host, &a, &[], own_prompt(1));
    let (mut s, again) = send(
        &host,
        &b,
        &[("x-session-token", token.as_bytes())],
        own_prompt(2),
    );
    assert_eq!(again, to);
    serve(&host, &mut s, "500");
    assert_eq!(token_set(&host, "x-session-token"), None, "not on a 5xx");
    serve(&host, &mut held, "200");
    // A retried request names the endpoint that answered.
    let (mut s, to) = send(&host, &a, &[], own_prompt(3));
    let other = if to == "127.0.0.1:1" {
        "127.0.0.1:2"
    } else {
        "127.0.0.1:1"
    };
    *host.upstream.borrow_mut() = Some(other.to_string());
    serve(&host, &mut s, "200");
    assert_eq!(
        token_set(&host, "x-session-token"),
        Some(crate::scheduling::session::encode_token(other))
    );
    // Garbage tokens are no preference and never fail the request.
    for bad in [&b"%%%"[..], b"", &[0xff; 40][..], &vec![b'A'; 4096][..]] {
        let (mut s, to) = send(&host, &a, &[("x-session-token", bad)], own_prompt(4));
        assert!(!to.is_empty());
        serve(&host, &mut s, "200");
    }
}

/// Envoy retried the session's request away from its bound endpoint (it
/// could not be reached): the binding moves to the one that answered.
#[test]
fn a_retry_elsewhere_moves_the_binding() {
    let (host, a, _b) = two_workers(&doc(r#"{"strategy":"session_id"}"#, "10"));
    let sess: &[(&str, &[u8])] = &[("x-session-id", b"s-1")];
    let (mut s, home) = send(&host, &a, sess, own_prompt(0));
    serve(&host, &mut s, "200");
    let other = if home == "127.0.0.1:1" {
        "127.0.0.1:2"
    } else {
        "127.0.0.1:1"
    };
    let (mut s, to) = send(&host, &a, sess, own_prompt(1));
    assert_eq!(to, home);
    *host.upstream.borrow_mut() = Some(other.to_string());
    serve(&host, &mut s, "200");
    assert_eq!(count(&host, &a, Counter::SessionMoved), 1);
    let (mut s, to) = send(&host, &a, sess, own_prompt(2));
    assert_eq!(to, other, "stays moved");
    serve(&host, &mut s, "200");
}

/// With the mesh exchange on, a settled binding goes to the outbox with
/// its accepted decision (the session's hash, never its id), a retried
/// request's move goes alone, and a rejection tells nothing.
#[test]
fn settled_bindings_go_to_the_mesh_outbox() {
    let d = doc(r#"{"strategy":"session_id"}"#, "10").replace(
        r#""routing":{"seed":7}"#,
        r#""routing":{"seed":7},"kvEvents":{"enabled":true}"#,
    );
    let (host, a, _b) = two_workers(&d);
    assert!(a.engine.config.mesh.enabled);
    let sess: &[(&str, &[u8])] = &[("x-session-id", b"s-mesh")];
    let slot_of = |addr: &str| {
        let t = a.engine.endpoint_table(&host.store).unwrap();
        let e = t.endpoints.iter().find(|e| e.address == addr).unwrap();
        (e.slot, e.generation)
    };
    let taken = || a.engine.mesh_outgoing(&host.store).unwrap().decisions;
    let (mut s, _) = send(&host, &a, sess, own_prompt(0));
    serve(&host, &mut s, "503");
    assert!(taken().is_empty(), "a rejection tells nothing");
    let (mut s, home) = send(&host, &a, sess, own_prompt(1));
    serve(&host, &mut s, "200");
    let out = taken();
    assert_eq!(out.len(), 1);
    let hash = out[0].session.expect("the binding is told").hash;
    assert!(!out[0].session.unwrap().moved);
    assert!(!out[0].hashes.is_empty(), "with its decision");
    assert_eq!((out[0].slot, out[0].generation), slot_of(&home));
    // A retry elsewhere: the decision is taken back, the move told alone.
    let other = if home == "127.0.0.1:1" {
        "127.0.0.1:2"
    } else {
        "127.0.0.1:1"
    };
    let (mut s, to) = send(&host, &a, sess, own_prompt(2));
    assert_eq!(to, home);
    *host.upstream.borrow_mut() = Some(other.to_string());
    serve(&host, &mut s, "200");
    let out = taken();
    assert_eq!(out.len(), 1, "{out:?}");
    assert_eq!(
        out[0].session,
        Some(kvroute_shared_state::mesh::SessionNote { hash, moved: true })
    );
    assert_eq!((out[0].slot, out[0].generation), slot_of(other));
    assert!(out[0].hashes.is_empty() && out[0].new_blocks == 0);
    // A request without a session tells no session.
    let (mut s, _) = send(&host, &a, &[], own_prompt(3));
    *host.upstream.borrow_mut() = None;
    serve(&host, &mut s, "200");
    assert!(taken().iter().all(|d| d.session.is_none()));
}

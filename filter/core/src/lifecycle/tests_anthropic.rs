//! Anthropic's Messages API through the stream: routed and charged like
//! chat, released on its event stream, refused in its own error shape,
//! and `count_tokens` passed untouched.

use super::*;

const MESSAGES: &str = "/v1/messages";

fn messages_body(stream: bool, user: &str) -> Vec<u8> {
    serde_json::json!({"model":"m","max_tokens":64,"stream":stream,
        "system":[{"type":"text","text":"shared system prompt ".repeat(30)}],
        "messages":[{"role":"user","content":[{"type":"text","text":user}]}]})
    .to_string()
    .into_bytes()
}

fn messages_stream(host: &FakeHost, w: &Rc<Worker>, body: Vec<u8>) -> (Stream, Action) {
    host.set_request("POST", MESSAGES, &[]);
    let mut s = Stream::new(Some(w.clone()));
    assert_eq!(s.on_request_headers(host, false), Action::Pause);
    let n = body.len();
    *host.body.borrow_mut() = body;
    let a = s.on_request_body(host, n, true);
    (s, a)
}

/// The last local reply: status and its JSON.
fn last_reply(host: &FakeHost) -> (u32, serde_json::Value) {
    let (status, body) = host.replies.borrow().last().unwrap().clone();
    (status, serde_json::from_str(&body).unwrap())
}

fn assert_anthropic_error(v: &serde_json::Value, kind: &str) {
    assert_eq!(v["type"], "error", "{v}");
    assert_eq!(v["error"]["type"], kind, "{v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .is_some_and(|m| !m.is_empty()),
        "{v}"
    );
    assert!(
        v.get("code").is_none() && v["error"].get("code").is_none(),
        "{v}"
    );
}

#[test]
fn messages_are_routable_by_default_and_count_tokens_passes() {
    let r = Config::from_json(format!("{{{BASE}}}").as_bytes())
        .unwrap()
        .routing;
    assert_eq!(
        classify(b"POST", b"/v1/messages", &r),
        PathClass::Routable(ApiKind::Messages)
    );
    assert_eq!(
        classify(b"POST", b"/anthropic/v1/messages?beta=true", &r),
        PathClass::Routable(ApiKind::Messages)
    );
    assert_eq!(
        classify(b"POST", b"/v1/messages/count_tokens", &r),
        PathClass::Pass
    );

    // count_tokens: not buffered, not routed, not charged.
    let (host, w) = filter("");
    host.set_request("POST", "/v1/messages/count_tokens", &[]);
    let mut s = Stream::new(Some(w.clone()));
    assert_eq!(s.on_request_headers(&host, false), Action::Continue);
    *host.body.borrow_mut() = messages_body(false, "q");
    assert_eq!(s.on_request_body(&host, 10, true), Action::Continue);
    assert!(!s.holds_charge());
    assert!(host.header("x-gateway-destination-endpoint").is_none());
    assert_eq!(inflight(&host, &w), (0, 0));
}

#[test]
fn a_streamed_message_releases_the_prompt_at_message_start_and_the_rest_at_message_stop() {
    let (host, w) = filter("");
    let (mut s, a) = messages_stream(&host, &w, messages_body(true, "q"));
    assert_eq!(a, Action::Continue);
    assert!(host.header("x-gateway-destination-endpoint").is_some());
    let (tokens, requests) = inflight(&host, &w);
    assert!(tokens > 0 && requests == 1, "{tokens} {requests}");
    *host.response_status.borrow_mut() = Some("200".into());
    s.on_response_headers(&host, false);
    // Anthropic's event stream, as vLLM 0.32 sends it, chunk by chunk.
    let events = [
        "event: message_start\ndata: {\"type\":\"message_start\"}\n\n",
        "event: content_block_start\ndata: {}\n\n",
        "event: content_block_delta\ndata: {}\n\n",
        "event: content_block_stop\ndata: {}\n\n",
        "event: message_delta\ndata: {}\n\n",
    ];
    for (i, e) in events.iter().enumerate() {
        s.on_response_body(&host, e.len(), false);
        assert_eq!(inflight(&host, &w), (0, 1), "after event {i}");
    }
    s.on_response_body(&host, "event: message_stop\ndata: {}\n\n".len(), true);
    assert_eq!(inflight(&host, &w), (0, 0));
    s.on_end(&host);
    assert_eq!(inflight(&host, &w), (0, 0));
    w.flush(&host);
    assert_eq!(host.counter(Counter::Routed), 1);
}

#[test]
fn a_message_answer_without_a_body_releases_at_the_end() {
    let (host, w) = filter("");
    let (mut s, _) = messages_stream(&host, &w, messages_body(false, "q"));
    assert_eq!(inflight(&host, &w).1, 1);
    *host.response_status.borrow_mut() = Some("200".into());
    s.on_response_headers(&host, false);
    s.on_end(&host);
    assert_eq!(inflight(&host, &w), (0, 0));
}

#[test]
fn fail_closed_answers_a_bad_message_in_anthropics_error_shape() {
    let (host, w) = filter(r#","failureMode":"closed","maxBodyBytes":4096"#);
    // Not JSON.
    let (_, a) = messages_stream(&host, &w, b"{not json".to_vec());
    assert_eq!(a, Action::Pause);
    let (status, v) = last_reply(&host);
    assert_eq!(status, 400);
    assert_anthropic_error(&v, "invalid_request_error");
    // A role the API does not have.
    let bad = br#"{"model":"m","max_tokens":1,"messages":[{"role":"robot","content":"x"}]}"#;
    let (_, a) = messages_stream(&host, &w, bad.to_vec());
    assert_eq!(a, Action::Pause);
    let (status, v) = last_reply(&host);
    assert_eq!(status, 400);
    assert_anthropic_error(&v, "invalid_request_error");
    assert!(v["error"]["message"].as_str().unwrap().contains("robot"));
    // No body at all.
    host.set_request("POST", MESSAGES, &[]);
    let mut s = Stream::new(Some(w.clone()));
    assert_eq!(s.on_request_headers(&host, true), Action::Pause);
    let (status, v) = last_reply(&host);
    assert_eq!(status, 400);
    assert_anthropic_error(&v, "invalid_request_error");
    // Too large.
    host.set_request("POST", MESSAGES, &[]);
    let mut s = Stream::new(Some(w.clone()));
    s.on_request_headers(&host, false);
    assert_eq!(s.on_request_body(&host, 8192, false), Action::Pause);
    let (status, v) = last_reply(&host);
    assert_eq!(status, 413);
    assert_anthropic_error(&v, "request_too_large");
    assert_eq!(inflight(&host, &w), (0, 0));
    // The OpenAI APIs keep OpenAI's shape.
    host.set_request("POST", "/v1/chat/completions", &[]);
    let mut s = Stream::new(Some(w.clone()));
    s.on_request_headers(&host, false);
    *host.body.borrow_mut() = b"{not json".to_vec();
    s.on_request_body(&host, 9, true);
    let (_, v) = last_reply(&host);
    assert_eq!(v["error"]["type"], "invalid_request_error");
    assert!(v.get("type").is_none());

    // Fail-open: a bad message passes unrouted, uncharged, unanswered.
    let (host, w) = filter("");
    let (s, a) = messages_stream(&host, &w, b"{not json".to_vec());
    assert_eq!(a, Action::Continue);
    assert!(!s.holds_charge());
    assert!(host.replies.borrow().is_empty());
}

#[test]
fn fail_closed_without_endpoints_answers_overloaded() {
    let host = FakeHost::default();
    host.now_ns.set(5_000_000_000);
    let base = BASE.replace(r#"["127.0.0.1:1","127.0.0.1:2"]"#, "[]");
    *host.config.borrow_mut() =
        format!(r#"{{{base},"routing":{{"seed":7,"failureMode":"closed"}}}}"#).into_bytes();
    *host.root_id.borrow_mut() = b"kvroute".to_vec();
    let w = match configure(&host) {
        Ok(Role::Filter { worker, .. }) => worker,
        Ok(Role::Collector(_)) => panic!("configured as the collector"),
        Err(e) => panic!("{e}"),
    };
    let (_, a) = messages_stream(&host, &w, messages_body(false, "q"));
    assert_eq!(a, Action::Pause);
    let (status, v) = last_reply(&host);
    assert_eq!(status, 503);
    assert_anthropic_error(&v, "overloaded_error");
}

//! Several models behind one pool, across the roles: the collector learns
//! each endpoint's models from its `/metrics` and `/v1/models`; workers
//! route a request only to endpoints that serve its `model`, and a model
//! no endpoint serves is answered 404 (fail-closed) or passed on unrouted
//! and counted (fail-open), holding no charge either way.

use super::*;

const DOC: &str = r#""endpoints":{"static":["127.0.0.1:1","127.0.0.1:2"]},
    "plugins":[{"type":"approx-prefix-cache-producer","parameters":{"blockSizeTokens":16}},
               {"type":"prefix-cache-affinity-filter"},{"type":"token-load-scorer"},{"type":"max-score-picker"}],
    "schedulingProfiles":[{"name":"d","plugins":[{"pluginRef":"prefix-cache-affinity-filter"},{"pluginRef":"token-load-scorer"},{"pluginRef":"max-score-picker"}]}],
    "collector":{"metricsCluster":"models","metricsPollIntervalMs":500}"#;

/// A collector and a worker on one host (one shared store).
fn pool(routing: &str) -> (FakeHost, Collector, Rc<Worker>) {
    let host = FakeHost::default();
    host.now_ns.set(1_000_000_000);
    *host.config.borrow_mut() =
        format!(r#"{{{DOC},"routing":{{"seed":7{routing}}}}}"#).into_bytes();
    *host.root_id.borrow_mut() = COLLECTOR_ROOT_ID.as_bytes().to_vec();
    let c = match configure(&host) {
        Ok(Role::Collector(c)) => *c,
        _ => panic!("not the collector"),
    };
    *host.root_id.borrow_mut() = b"kvroute".to_vec();
    let w = match configure(&host) {
        Ok(Role::Filter { worker, .. }) => worker,
        _ => panic!("not the filter"),
    };
    (host, c, w)
}

/// Answers every call of the last tick: `/metrics` with `metrics(addr)`,
/// `/v1/models` with `models(addr)`.
fn answer(
    host: &FakeHost,
    c: &mut Collector,
    metrics: &dyn Fn(&str) -> String,
    models: &dyn Fn(&str) -> String,
) {
    let calls: Vec<_> = host.calls.borrow().clone();
    *host.call_status.borrow_mut() = Some("200".into());
    for (token, (_, headers, _)) in calls.iter().enumerate() {
        let get = |k: &str| {
            headers
                .iter()
                .find(|(n, _)| n == k)
                .map(|(_, v)| v.clone())
                .unwrap_or_default()
        };
        let addr = get("x-envoy-original-dst-host");
        let body = if get(":path") == "/v1/models" {
            models(&addr)
        } else {
            metrics(&addr)
        };
        let n = body.len();
        *host.call_body.borrow_mut() = Some(body.into_bytes());
        c.on_http_call_response(host, token as u32 + 1, 3, n);
    }
    host.calls.borrow_mut().clear();
}

fn body(model: &str, user: &str) -> Vec<u8> {
    serde_json::json!({"model":model,"messages":[{"role":"user","content":user.repeat(40)}]})
        .to_string()
        .into_bytes()
}

/// Routes one request; the destination header, or `None` if not routed.
fn send(
    host: &FakeHost,
    w: &Rc<Worker>,
    model: &str,
    user: &str,
) -> (Stream, Action, Option<String>) {
    host.set_request("POST", "/v1/chat/completions", &[]);
    let mut s = Stream::new(Some(w.clone()));
    assert_eq!(s.on_request_headers(host, false), Action::Pause);
    let b = body(model, user);
    let n = b.len();
    *host.body.borrow_mut() = b;
    let a = s.on_request_body(host, n, true);
    let dest = host.header("x-gateway-destination-endpoint");
    (s, a, dest)
}

fn metrics_of(addr: &str) -> String {
    // Endpoint 1 serves "alpha" with adapter "sql" running; 2 serves "beta".
    if addr.ends_with(":1") {
        "vllm:num_requests_running{engine=\"0\",model_name=\"alpha\"} 0\n\
         vllm:lora_requests_info{max_lora=\"2\",running_lora_adapters=\"sql\",waiting_lora_adapters=\"\"} 1.7e9\n"
            .into()
    } else {
        "vllm:num_requests_running{engine=\"0\",model_name=\"beta\"} 0\n".into()
    }
}

fn models_of(addr: &str) -> String {
    if addr.ends_with(":1") {
        r#"{"object":"list","data":[{"id":"alpha","parent":null},{"id":"sql","parent":"alpha"},{"id":"idle-lora","parent":"alpha"}]}"#.into()
    } else {
        r#"{"object":"list","data":[{"id":"beta"}]}"#.into()
    }
}

#[test]
fn each_model_goes_only_to_the_endpoints_that_serve_it() {
    let (host, mut c, w) = pool("");
    // Before any report, every endpoint may serve any model.
    let (mut s, a, dest) = send(&host, &w, "anything", "a");
    assert_eq!(a, Action::Continue);
    assert!(dest.is_some());
    s.on_end(&host);

    c.on_tick(&host);
    // One /metrics and one /v1/models call per endpoint.
    assert_eq!(host.calls.borrow().len(), 4, "{:?}", host.calls.borrow());
    answer(&host, &mut c, &metrics_of, &models_of);
    assert_eq!(host.counter(Counter::ModelsPollFailures), 0);

    for (model, want) in [
        ("alpha", "127.0.0.1:1"),
        ("beta", "127.0.0.1:2"),
        ("sql", "127.0.0.1:1"),
        // Idle, statically loaded: only /v1/models shows it.
        ("idle-lora", "127.0.0.1:1"),
    ] {
        for user in ["x", "y", "z"] {
            let (mut s, a, dest) = send(&host, &w, model, user);
            assert_eq!(a, Action::Continue);
            assert_eq!(dest.as_deref(), Some(want), "{model}");
            s.on_end(&host);
        }
    }
    w.flush(&host);
    assert_eq!(host.counter(Counter::UnknownModel), 0);
    assert_eq!(host.counter(Counter::Routed), 13);
}

#[test]
fn an_unknown_model_is_404_fail_closed_and_counted_fail_open() {
    for closed in [true, false] {
        let mode = if closed {
            r#","failureMode":"closed""#
        } else {
            ""
        };
        let (host, mut c, w) = pool(mode);
        c.on_tick(&host);
        answer(&host, &mut c, &metrics_of, &models_of);
        let (mut s, a, dest) = send(&host, &w, "gamma", "q");
        assert_eq!(dest, None);
        assert!(!s.holds_charge());
        if closed {
            assert_eq!(a, Action::Pause);
            let (status, reply) = host.replies.borrow().last().unwrap().clone();
            assert_eq!(status, 404);
            let v: serde_json::Value = serde_json::from_str(&reply).unwrap();
            assert_eq!(v["error"]["message"], "The model `gamma` does not exist.");
            assert_eq!(v["error"]["type"], "NotFoundError");
            assert_eq!(v["error"]["param"], "model");
            assert_eq!(v["error"]["code"], 404);
        } else {
            assert_eq!(a, Action::Continue);
            assert!(host.replies.borrow().is_empty());
        }
        s.on_end(&host);
        w.flush(&host);
        assert_eq!(host.counter(Counter::UnknownModel), 1);
        assert_eq!(
            host.counter(if closed {
                Counter::Rejected
            } else {
                Counter::FailOpen
            }),
            1
        );
        assert_eq!(host.counter(Counter::Routed), 0);
        // Nothing charged anywhere.
        assert_eq!(inflight(&host, &w), (0, 0));
    }
}

#[test]
fn a_bad_model_list_keeps_the_last_and_is_counted() {
    let (host, mut c, w) = pool("");
    c.on_tick(&host);
    answer(&host, &mut c, &metrics_of, &models_of);
    // The next round: garbage from /v1/models, and metrics that no longer
    // name a model (a server without model labels).
    host.now_ns.set(20_000_000_000);
    c.on_tick(&host);
    answer(
        &host,
        &mut c,
        &|_| "vllm:num_requests_running 0\n".into(),
        &|_| "<html>oops".into(),
    );
    assert_eq!(host.counter(Counter::ModelsPollFailures), 2);
    // The listing part is kept: "idle-lora" still goes to endpoint 1 only.
    let (mut s, _, dest) = send(&host, &w, "idle-lora", "q");
    assert_eq!(dest.as_deref(), Some("127.0.0.1:1"));
    s.on_end(&host);
}

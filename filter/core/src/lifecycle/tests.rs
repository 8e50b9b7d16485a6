//! The lifecycle against a recording fake host over an in-memory store.

use super::*;
use kvroute_shared_state::memory::MemoryStore;
use std::collections::{HashMap, HashSet};

/// An HTTP call as dispatched: cluster, headers, timeout (ms).
type Call = (String, Vec<(String, String)>, u32);

/// A host that records what the lifecycle does and fails the calls named
/// in `failing`.
#[derive(Default)]
struct FakeHost {
    store: MemoryStore,
    now_ns: Cell<u64>,
    config: RefCell<Vec<u8>>,
    root_id: RefCell<Vec<u8>>,
    request_headers: RefCell<Vec<(String, Vec<u8>)>>,
    response_headers: RefCell<Vec<(String, String)>>,
    /// The upstream's `:status` as the response headers callback reads it.
    response_status: RefCell<Option<String>>,
    /// Envoy's `upstream.address` as the response headers callback reads it.
    upstream: RefCell<Option<String>>,
    body: RefCell<Vec<u8>>,
    replies: RefCell<Vec<(u32, String)>>,
    logs: RefCell<Vec<(Level, String)>>,
    counters: RefCell<HashMap<u32, i64>>,
    counter_calls: Cell<u32>,
    /// Gauges and histograms by name (ids from [`metric_id`]).
    metric_names: RefCell<HashMap<u32, String>>,
    gauges: RefCell<HashMap<String, i64>>,
    histograms: RefCell<HashMap<String, Vec<u64>>>,
    clock_reads: Cell<u32>,
    calls: RefCell<Vec<Call>>,
    /// POSTs (the mesh exchange): cluster, headers, body; tokens from
    /// [`POST_TOKENS`] on.
    posts: RefCell<Vec<Post>>,
    call_status: RefCell<Option<String>>,
    call_body: RefCell<Option<Vec<u8>>>,
    tick_ms: Cell<Option<u32>>,
    failing: RefCell<HashSet<&'static str>>,
    /// Shared queues: name → token, and each token's items.
    queues: RefCell<HashMap<String, u32>>,
    queue_items: RefCell<HashMap<u32, std::collections::VecDeque<Vec<u8>>>>,
    /// `proxy_set_effective_context` (flow control's dispatch).
    effective: Cell<Option<u32>>,
    /// Requests resumed: the effective context at each resume.
    resumed: RefCell<Vec<Option<u32>>>,
    /// Local replies with headers: effective context, status, body, headers.
    ctx_replies: RefCell<Vec<ReplyWith>>,
    /// Destination headers set: effective context, value.
    ctx_headers: RefCell<Vec<(Option<u32>, String, String)>>,
}

/// A local reply with headers: effective context, status, body, headers.
type ReplyWith = (Option<u32>, u32, String, Vec<(String, String)>);

/// A POST: cluster, headers, body.
type Post = (String, Vec<(String, String)>, Vec<u8>);

/// The fake host's POST tokens start here (GET calls count from 1).
const POST_TOKENS: u32 = 1_000_000;

impl FakeHost {
    fn fail(&self, call: &'static str) -> HostResult<()> {
        if self.failing.borrow().contains(call) {
            Err(HostError { call, status: 10 })
        } else {
            Ok(())
        }
    }

    fn gauge(&self, name: &str) -> Option<i64> {
        self.gauges.borrow().get(name).copied()
    }

    fn samples(&self, name: &str) -> Vec<u64> {
        self.histograms
            .borrow()
            .get(name)
            .cloned()
            .unwrap_or_default()
    }

    fn counter(&self, c: Counter) -> i64 {
        let id = Counter::ALL.iter().position(|x| *x == c).unwrap() as u32;
        self.counters.borrow().get(&id).copied().unwrap_or(0)
    }

    fn header(&self, name: &str) -> Option<String> {
        self.request_headers
            .borrow()
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| String::from_utf8_lossy(v).into_owned())
    }

    fn set_request(&self, method: &str, path: &str, extra: &[(&str, &[u8])]) {
        let mut h = vec![
            (":method".to_string(), method.as_bytes().to_vec()),
            (":path".to_string(), path.as_bytes().to_vec()),
        ];
        h.extend(extra.iter().map(|(k, v)| (k.to_string(), v.to_vec())));
        *self.request_headers.borrow_mut() = h;
    }
}

impl Host for FakeHost {
    fn store(&self) -> &dyn Store {
        &self.store
    }
    fn now_ns(&self) -> HostResult<u64> {
        self.clock_reads.set(self.clock_reads.get() + 1);
        self.fail("proxy_get_current_time_nanoseconds")?;
        Ok(self.now_ns.get())
    }
    fn log(&self, level: Level, message: &str) {
        self.logs.borrow_mut().push((level, message.to_string()));
    }
    fn set_tick_period_ms(&self, ms: u32) -> HostResult<()> {
        self.fail("proxy_set_tick_period_milliseconds")?;
        self.tick_ms.set(Some(ms));
        Ok(())
    }
    fn plugin_configuration(&self) -> HostResult<Option<Vec<u8>>> {
        self.fail("proxy_get_buffer_bytes")?;
        Ok(Some(self.config.borrow().clone()))
    }
    fn root_id(&self) -> HostResult<Option<Vec<u8>>> {
        self.fail("proxy_get_property")?;
        Ok(Some(self.root_id.borrow().clone()))
    }
    fn request_headers(&self) -> HostResult<Vec<(String, Vec<u8>)>> {
        self.fail("proxy_get_header_map_pairs")?;
        Ok(self.request_headers.borrow().clone())
    }
    fn remove_request_header(&self, name: &str) -> HostResult<()> {
        self.fail("proxy_remove_header_map_value")?;
        self.request_headers.borrow_mut().retain(|(k, _)| k != name);
        Ok(())
    }
    fn set_request_header(&self, name: &str, value: &str) -> HostResult<()> {
        self.fail("proxy_replace_header_map_value")?;
        self.ctx_headers.borrow_mut().push((
            self.effective.get(),
            name.to_string(),
            value.to_string(),
        ));
        let mut h = self.request_headers.borrow_mut();
        h.retain(|(k, _)| k != name);
        h.push((name.to_string(), value.as_bytes().to_vec()));
        Ok(())
    }
    fn set_response_header(&self, name: &str, value: &str) -> HostResult<()> {
        self.fail("proxy_replace_header_map_value")?;
        self.response_headers
            .borrow_mut()
            .push((name.to_string(), value.to_string()));
        Ok(())
    }
    fn response_header(&self, name: &str) -> HostResult<Option<Vec<u8>>> {
        self.fail("proxy_get_header_map_value")?;
        Ok(match name {
            ":status" => self
                .response_status
                .borrow()
                .clone()
                .map(String::into_bytes),
            _ => None,
        })
    }
    fn upstream_address(&self) -> HostResult<Option<Vec<u8>>> {
        self.fail("proxy_get_property")?;
        Ok(self.upstream.borrow().clone().map(String::into_bytes))
    }
    fn request_body(&self, size: usize) -> HostResult<Option<Vec<u8>>> {
        self.fail("proxy_get_buffer_bytes")?;
        let b = self.body.borrow();
        Ok(Some(b[..size.min(b.len())].to_vec()))
    }
    fn send_json_response(&self, status: u32, body: &str) -> HostResult<()> {
        self.fail("proxy_send_local_response")?;
        self.replies.borrow_mut().push((status, body.to_string()));
        Ok(())
    }
    fn send_json_response_with(
        &self,
        status: u32,
        body: &str,
        headers: &[(&str, &str)],
    ) -> HostResult<()> {
        self.fail("proxy_send_local_response")?;
        self.replies.borrow_mut().push((status, body.to_string()));
        self.ctx_replies.borrow_mut().push((
            self.effective.get(),
            status,
            body.to_string(),
            headers
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        ));
        Ok(())
    }
    fn set_effective_context(&self, context_id: u32) -> HostResult<()> {
        self.fail("proxy_set_effective_context")?;
        self.effective.set(Some(context_id));
        Ok(())
    }
    fn resume_request(&self) -> HostResult<()> {
        self.fail("proxy_continue_stream")?;
        self.resumed.borrow_mut().push(self.effective.get());
        Ok(())
    }
    fn http_post(
        &self,
        cluster: &str,
        headers: &[(&str, &str)],
        body: &[u8],
        _timeout_ms: u32,
    ) -> HostResult<u32> {
        self.fail("proxy_http_call")?;
        let mut posts = self.posts.borrow_mut();
        posts.push((
            cluster.to_string(),
            headers
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            body.to_vec(),
        ));
        Ok(POST_TOKENS + posts.len() as u32)
    }
    fn http_call(
        &self,
        cluster: &str,
        headers: &[(&str, &str)],
        timeout_ms: u32,
    ) -> HostResult<u32> {
        self.fail("proxy_http_call")?;
        let mut calls = self.calls.borrow_mut();
        calls.push((
            cluster.to_string(),
            headers
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            timeout_ms,
        ));
        Ok(calls.len() as u32)
    }
    fn http_call_status(&self) -> HostResult<Option<String>> {
        self.fail("proxy_get_header_map_value")?;
        Ok(self.call_status.borrow().clone())
    }
    fn http_call_body(&self, _size: usize) -> HostResult<Option<Vec<u8>>> {
        self.fail("proxy_get_buffer_bytes")?;
        Ok(self.call_body.borrow().clone())
    }
    fn register_queue(&self, name: &str) -> HostResult<u32> {
        self.fail("proxy_register_shared_queue")?;
        let mut q = self.queues.borrow_mut();
        let n = q.len() as u32 + 1;
        Ok(*q.entry(name.to_owned()).or_insert(n))
    }
    fn resolve_queue(&self, name: &str) -> HostResult<Option<u32>> {
        self.fail("proxy_resolve_shared_queue")?;
        Ok(self.queues.borrow().get(name).copied())
    }
    fn enqueue(&self, queue: u32, value: &[u8]) -> HostResult<()> {
        self.fail("proxy_enqueue_shared_queue")?;
        self.queue_items
            .borrow_mut()
            .entry(queue)
            .or_default()
            .push_back(value.to_vec());
        Ok(())
    }
    fn dequeue(&self, queue: u32) -> HostResult<Option<Vec<u8>>> {
        self.fail("proxy_dequeue_shared_queue")?;
        Ok(self
            .queue_items
            .borrow_mut()
            .get_mut(&queue)
            .and_then(|q| q.pop_front()))
    }
    fn define_counter(&self, name: &str) -> HostResult<u32> {
        self.fail("proxy_define_metric")?;
        match Counter::ALL.iter().position(|c| c.name() == name) {
            Some(i) => Ok(i as u32),
            // Other counters (flow control's per band): by name, with the
            // gauges (`increment_counter` adds to them).
            None => {
                let id = metric_id(3, name);
                self.metric_names.borrow_mut().insert(id, name.to_string());
                Ok(id)
            }
        }
    }
    fn increment_counter(&self, id: u32, by: i64) -> HostResult<()> {
        self.fail("proxy_increment_metric")?;
        if let Some(name) = self.metric_names.borrow().get(&id) {
            *self.gauges.borrow_mut().entry(name.clone()).or_default() += by;
            return Ok(());
        }
        self.counter_calls.set(self.counter_calls.get() + 1);
        *self.counters.borrow_mut().entry(id).or_default() += by;
        Ok(())
    }
    fn define_gauge(&self, name: &str) -> HostResult<u32> {
        self.fail("proxy_define_metric")?;
        let id = metric_id(1, name);
        self.metric_names.borrow_mut().insert(id, name.to_string());
        self.gauges
            .borrow_mut()
            .entry(name.to_string())
            .or_default();
        Ok(id)
    }
    fn define_histogram(&self, name: &str) -> HostResult<u32> {
        self.fail("proxy_define_metric")?;
        let id = metric_id(2, name);
        self.metric_names.borrow_mut().insert(id, name.to_string());
        self.histograms
            .borrow_mut()
            .entry(name.to_string())
            .or_default();
        Ok(id)
    }
    fn record_metric(&self, id: u32, value: u64) -> HostResult<()> {
        self.fail("proxy_record_metric")?;
        let Some(name) = self.metric_names.borrow().get(&id).cloned() else {
            return Err(HostError {
                call: "proxy_record_metric",
                status: 1,
            });
        };
        if id & 3 == 1 {
            self.gauges.borrow_mut().insert(name, value as i64);
        } else {
            self.histograms
                .borrow_mut()
                .entry(name)
                .or_default()
                .push(value);
        }
        Ok(())
    }
}

/// A gauge or histogram id that is the same for a name on every fake host
/// (the leader gauge's id is cached per thread), type in the low 2 bits as
/// Envoy does, never a counter id (those are small).
fn metric_id(kind: u32, name: &str) -> u32 {
    let h = name.bytes().fold(0x811c_9dc5u32, |h, b| {
        (h ^ u32::from(b)).wrapping_mul(0x0100_0193)
    });
    (h | 0x1000) & !3 | kind
}

const BASE: &str = r#""endpoints":{"static":["127.0.0.1:1","127.0.0.1:2"]},
    "plugins":[{"type":"approx-prefix-cache-producer","parameters":{"blockSizeTokens":16}},
               {"type":"prefix-cache-affinity-filter"},{"type":"token-load-scorer"},{"type":"max-score-picker"}],
    "schedulingProfiles":[{"name":"d","plugins":[{"pluginRef":"prefix-cache-affinity-filter"},{"pluginRef":"token-load-scorer"},{"pluginRef":"max-score-picker"}]}]"#;

/// A configured filter worker (and its host) for `routing` (a JSON object body).
fn filter(routing: &str) -> (FakeHost, Rc<Worker>) {
    let host = FakeHost::default();
    host.now_ns.set(5_000_000_000);
    *host.config.borrow_mut() =
        format!(r#"{{{BASE},"routing":{{"seed":7{routing}}}}}"#).into_bytes();
    *host.root_id.borrow_mut() = b"kvroute".to_vec();
    match configure(&host) {
        Ok(Role::Filter { worker, .. }) => (host, worker),
        Ok(Role::Collector(_)) => panic!("configured as the collector"),
        Err(e) => panic!("{e}"),
    }
}

fn chat_body(user: &str) -> Vec<u8> {
    serde_json::json!({"model":"m","messages":[{"role":"system","content":"shared system prompt ".repeat(30)},{"role":"user","content":user}]})
        .to_string()
        .into_bytes()
}

/// In-flight (tokens, requests) summed over endpoints.
fn inflight(host: &FakeHost, w: &Worker) -> (u64, u64) {
    let v: serde_json::Value =
        serde_json::from_str(&w.engine.state_json(host.store(), 0).unwrap()).unwrap();
    v["endpoints"]
        .as_array()
        .unwrap()
        .iter()
        .fold((0, 0), |a, e| {
            (
                a.0 + e["inflightTokens"].as_u64().unwrap(),
                a.1 + e["inflightRequests"].as_u64().unwrap(),
            )
        })
}

/// Runs headers and the whole body; returns the stream and the body action.
fn routed_stream(host: &FakeHost, w: &Rc<Worker>, body: Vec<u8>) -> Stream {
    host.set_request("POST", "/v1/chat/completions", &[]);
    let mut s = Stream::new(Some(w.clone()));
    assert_eq!(s.on_request_headers(host, false), Action::Pause);
    let n = body.len();
    *host.body.borrow_mut() = body;
    assert_eq!(s.on_request_body(host, n, true), Action::Continue);
    s
}

#[test]
fn classify_strips_query_and_matches_suffixes_once() {
    let routing = |state: Option<&str>| {
        let mut r = Config::from_json(format!("{{{BASE}}}").as_bytes())
            .unwrap()
            .routing;
        r.state_path = state.map(str::to_string);
        r
    };
    let r = routing(Some("/kvroute/state"));
    use PathClass::*;
    let cases: &[(&str, &str, PathClass)] = &[
        (
            "POST",
            "/v1/chat/completions",
            Routable(ApiKind::ChatCompletions),
        ),
        (
            "POST",
            "/v1/chat/completions?x=1",
            Routable(ApiKind::ChatCompletions),
        ),
        (
            "POST",
            "/v1/chat/completions/",
            Routable(ApiKind::ChatCompletions),
        ),
        (
            "POST",
            "/openai/v1/completions#f",
            Routable(ApiKind::Completions),
        ),
        (
            "POST",
            "/inference/v1/generate",
            Routable(ApiKind::Generate),
        ),
        ("POST", "/inference/v1/generate/extra", Pass),
        ("GET", "/v1/chat/completions", Pass),
        ("POST", "/v1/models", Pass),
        ("GET", "/kvroute/state", State),
        ("GET", "/kvroute/state?pretty", State),
        ("POST", "/kvroute/state", Pass),
        ("GET", "/kvroute/state/more", Pass),
    ];
    for (m, p, want) in cases {
        assert_eq!(classify(m.as_bytes(), p.as_bytes(), &r), *want, "{m} {p}");
    }
    assert_eq!(classify(b"POST", b"/v1/\xff/completions", &r), Pass);
    assert_eq!(classify(b"GET", b"/kvroute/state", &routing(None)), Pass);
    let mut only_chat = routing(None);
    only_chat.paths = vec!["/v1/chat/completions".into()];
    assert_eq!(classify(b"POST", b"/v1/completions", &only_chat), Pass);
}

#[test]
fn role_follows_root_id_and_a_bad_config_is_an_error() {
    let (host, _) = filter("");
    assert_eq!(host.tick_ms.get(), Some(FLUSH_PERIOD_MS));
    *host.root_id.borrow_mut() = COLLECTOR_ROOT_ID.as_bytes().to_vec();
    assert!(matches!(configure(&host), Ok(Role::Collector(_))));
    let good = host
        .config
        .replace(br#"{"routing":{"debugHeaderX":true}}"#.to_vec());
    let e = configure(&host).err().unwrap();
    assert!(e.contains("debugHeaderX"), "{e}");
    *host.config.borrow_mut() = good;
    host.failing.borrow_mut().insert("proxy_get_property");
    assert!(configure(&host).err().unwrap().contains("plugin_root_id"));
}

#[test]
fn config_warnings_are_logged_and_counted_once_per_process() {
    for root in [&b"kvroute"[..], COLLECTOR_ROOT_ID.as_bytes()] {
        let host = FakeHost::default();
        host.now_ns.set(5_000_000_000);
        *host.config.borrow_mut() =
            format!(r#"{{{BASE},"featureGates":["dataLayer"]}}"#).into_bytes();
        *host.root_id.borrow_mut() = root.to_vec();
        assert!(configure(&host).is_ok());
        let warned: Vec<String> = host
            .logs
            .borrow()
            .iter()
            .filter(|(l, m)| *l == Level::Warn && m.starts_with("kvroute config: "))
            .map(|(_, m)| m.clone())
            .collect();
        assert_eq!(warned.len(), 1, "{:?}", host.logs.borrow());
        assert!(warned[0].contains("featureGates[0]"), "{warned:?}");
        assert_eq!(host.gauge("kvroute_config_warnings"), Some(1));
        // Another VM of the same Envoy (same shared data), same config:
        // not logged or counted again.
        *host.root_id.borrow_mut() = b"kvroute".to_vec();
        assert!(configure(&host).is_ok());
        let n = host
            .logs
            .borrow()
            .iter()
            .filter(|(_, m)| m.starts_with("kvroute config: "))
            .count();
        assert_eq!(n, 1, "logged once per process");
        assert_eq!(host.gauge("kvroute_config_warnings"), Some(1));
    }
    // No warning, no such log.
    let (host, _) = filter("");
    assert!(
        !host
            .logs
            .borrow()
            .iter()
            .any(|(_, m)| m.starts_with("kvroute config: ")),
        "{:?}",
        host.logs.borrow()
    );
}

#[test]
fn a_non_streaming_request_releases_once_at_its_first_byte() {
    let (host, w) = filter("");
    let mut s = routed_stream(&host, &w, chat_body("q"));
    assert!(host.header("x-gateway-destination-endpoint").is_some());
    assert!(s.holds_charge());
    assert_eq!(inflight(&host, &w).1, 1);
    s.on_response_headers(&host, false);
    s.on_response_body(&host, 10, false);
    assert_eq!(inflight(&host, &w), (0, 0));
    assert!(!s.holds_charge());
    // Later callbacks and the end release nothing more.
    s.on_response_body(&host, 0, true);
    s.on_end(&host);
    assert_eq!(inflight(&host, &w), (0, 0));
    w.flush(&host);
    assert_eq!(host.counter(Counter::Routed), 1);
    assert_eq!(host.counter(Counter::HostErrors), 0);
}

#[test]
fn a_streaming_request_releases_the_prompt_then_the_rest() {
    let (host, w) = filter("");
    let body = serde_json::json!({"model":"m","stream":true,"messages":[{"role":"user","content":"x ".repeat(500)}]});
    let mut s = routed_stream(&host, &w, body.to_string().into_bytes());
    let (tokens, requests) = inflight(&host, &w);
    assert!(tokens > 0 && requests == 1, "{tokens} {requests}");
    s.on_response_headers(&host, false);
    s.on_response_body(&host, 5, false);
    assert_eq!(
        inflight(&host, &w),
        (0, 1),
        "prompt released at the first chunk"
    );
    s.on_response_body(&host, 5, false);
    assert_eq!(inflight(&host, &w), (0, 1));
    s.on_response_body(&host, 0, true);
    assert_eq!(inflight(&host, &w), (0, 0));
    s.on_end(&host);
    assert_eq!(inflight(&host, &w), (0, 0));
}

/// The upstream answers `status`: response headers, one body chunk that
/// ends the response, the stream's end.
fn serve(host: &FakeHost, s: &mut Stream, status: &str) {
    *host.response_status.borrow_mut() = Some(status.to_string());
    s.on_response_headers(host, false);
    s.on_response_body(host, 10, true);
    s.on_end(host);
}

/// A counter's value once the VM's batched counts are flushed.
fn count(host: &FakeHost, w: &Worker, c: Counter) -> i64 {
    w.flush(host);
    host.counter(c)
}

/// Per endpoint: (insert counter, routed prompt bytes) from the state page.
fn written(host: &FakeHost, w: &Worker) -> Vec<(u64, u64)> {
    let v: serde_json::Value =
        serde_json::from_str(&w.engine.state_json(host.store(), 0).unwrap()).unwrap();
    v["endpoints"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| {
            (
                e["insertCounter"].as_u64().unwrap(),
                e["routedPromptBytes"].as_u64().unwrap(),
            )
        })
        .collect()
}

/// Issue 40: only work a server accepted changes what kvroute believes.
/// A request answered with a non-2xx status, or ended before any response
/// header, leaves the eviction clock, the routed bytes and the index as if
/// it had never been routed (its charge is released as always); an
/// accepted one keeps them, and its prompt is then sticky.
#[test]
fn a_request_the_server_does_not_accept_leaves_no_trace() {
    let (host, w) = filter("");
    let mut warm = routed_stream(&host, &w, chat_body("warm"));
    serve(&host, &mut warm, "200");
    let before = written(&host, &w);
    let long = chat_body(&"an over-length prompt ".repeat(400));
    for (i, status) in ["400", "413", "503", "500", "429", "reset"]
        .into_iter()
        .enumerate()
    {
        let sticky = count(&host, &w, Counter::BranchSticky);
        let mut s = routed_stream(&host, &w, long.clone());
        assert_eq!(
            count(&host, &w, Counter::BranchSticky),
            sticky,
            "{status}: the rejected prompt was found in the index"
        );
        if status == "reset" {
            s.on_end(&host);
        } else {
            serve(&host, &mut s, status);
        }
        assert_eq!(written(&host, &w), before, "{status}");
        assert_eq!(inflight(&host, &w), (0, 0), "{status}");
        assert_eq!(count(&host, &w, Counter::TakenBack), i as i64 + 1);
    }
    // Accepted: kept, and the same prompt then sticks.
    let mut s = routed_stream(&host, &w, long.clone());
    serve(&host, &mut s, "200");
    assert_ne!(written(&host, &w), before);
    let sticky = count(&host, &w, Counter::BranchSticky);
    let mut again = routed_stream(&host, &w, long);
    assert_eq!(count(&host, &w, Counter::BranchSticky), sticky + 1);
    serve(&host, &mut again, "200");
    assert_eq!(count(&host, &w, Counter::TakenBack), 6);
    assert_eq!(inflight(&host, &w), (0, 0));
}

/// Identical prompts arriving together still go together: the second
/// finds the first's blocks while the first is in flight; if the first is
/// then rejected its entries go, and the next cold prompt is cold again.
#[test]
fn a_burst_sticks_while_in_flight_and_a_rejection_clears_it() {
    let (host, w) = filter("");
    let body = chat_body(&"burst document ".repeat(60));
    let mut first = routed_stream(&host, &w, body.clone());
    let sticky = count(&host, &w, Counter::BranchSticky);
    let mut second = routed_stream(&host, &w, body.clone());
    assert_eq!(count(&host, &w, Counter::BranchSticky), sticky + 1);
    serve(&host, &mut first, "400");
    serve(&host, &mut second, "400");
    let mut third = routed_stream(&host, &w, body);
    assert_eq!(count(&host, &w, Counter::BranchSticky), sticky + 1);
    serve(&host, &mut third, "200");
}

/// Issue 40: a body that ends with trailers (gRPC-style over HTTP/2) is
/// routed and charged in the trailers callback, not passed on unrouted.
#[test]
fn a_body_that_ends_with_trailers_is_routed_and_charged() {
    let (host, w) = filter("");
    host.set_request("POST", "/v1/chat/completions", &[]);
    let mut s = Stream::new(Some(w.clone()));
    assert_eq!(s.on_request_headers(&host, false), Action::Pause);
    let body = chat_body("with trailers");
    let n = body.len();
    *host.body.borrow_mut() = body;
    assert_eq!(s.on_request_body(&host, n, false), Action::Pause);
    assert!(host.header("x-gateway-destination-endpoint").is_none());
    assert_eq!(s.on_request_trailers(&host), Action::Continue);
    assert!(host.header("x-gateway-destination-endpoint").is_some());
    assert_eq!(count(&host, &w, Counter::Routed), 1);
    assert_eq!(inflight(&host, &w).1, 1);
    // A second trailers callback (none in Envoy) changes nothing.
    assert_eq!(s.on_request_trailers(&host), Action::Continue);
    assert_eq!(count(&host, &w, Counter::Routed), 1);
    serve(&host, &mut s, "200");
    assert_eq!(inflight(&host, &w), (0, 0));
    // An unroutable path's trailers pass.
    host.set_request("POST", "/other", &[]);
    let mut p = Stream::new(Some(w.clone()));
    assert_eq!(p.on_request_headers(&host, false), Action::Continue);
    assert_eq!(p.on_request_trailers(&host), Action::Continue);
    assert_eq!(count(&host, &w, Counter::Routed), 1);
}

/// Per endpoint address: in-flight requests.
fn inflight_by_address(host: &FakeHost, w: &Worker) -> HashMap<String, u64> {
    let v: serde_json::Value =
        serde_json::from_str(&w.engine.state_json(host.store(), 0).unwrap()).unwrap();
    v["endpoints"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| {
            (
                e["address"].as_str().unwrap().to_string(),
                e["inflightRequests"].as_u64().unwrap(),
            )
        })
        .collect()
}

/// Issue 40: Envoy retried the request to the next address of the
/// destination header: the charge moves to the endpoint that answered,
/// and what the decision wrote for the routed one is taken back.
#[test]
fn a_retry_to_another_endpoint_moves_the_charge() {
    let (host, w) = filter("");
    let before = written(&host, &w);
    let body = serde_json::json!({"model":"m","stream":true,"messages":[{"role":"user","content":"retried ".repeat(50)}]});
    let mut s = routed_stream(&host, &w, body.to_string().into_bytes());
    let primary = host.header("x-gateway-destination-endpoint").unwrap();
    let primary = primary.split(',').next().unwrap().to_string();
    let other = ["127.0.0.1:1", "127.0.0.1:2"]
        .into_iter()
        .find(|a| *a != primary)
        .unwrap();
    assert_eq!(inflight_by_address(&host, &w)[&primary], 1);
    *host.upstream.borrow_mut() = Some(other.to_string());
    *host.response_status.borrow_mut() = Some("200".into());
    s.on_response_headers(&host, false);
    let now = inflight_by_address(&host, &w);
    assert_eq!((now[&primary], now[other]), (0, 1), "{now:?}");
    assert_eq!(
        written(&host, &w),
        before,
        "the routed endpoint never saw it"
    );
    assert_eq!(count(&host, &w, Counter::ChargeMoved), 1);
    s.on_response_body(&host, 5, false);
    s.on_response_body(&host, 5, true);
    s.on_end(&host);
    assert_eq!(inflight(&host, &w), (0, 0));
    // Answered by the routed endpoint: nothing moves.
    let mut s = routed_stream(&host, &w, chat_body("direct"));
    let primary = host.header("x-gateway-destination-endpoint").unwrap();
    *host.upstream.borrow_mut() = primary.split(',').next().map(str::to_string);
    serve(&host, &mut s, "200");
    assert_eq!(count(&host, &w, Counter::ChargeMoved), 1);
    assert_ne!(written(&host, &w), before);
    assert_eq!(inflight(&host, &w), (0, 0));
}

#[test]
fn every_other_exit_releases_at_the_end() {
    let (host, w) = filter("");
    // Reset before any response, and a reset after the first chunk.
    let mut a = routed_stream(&host, &w, chat_body("a"));
    let body =
        serde_json::json!({"model":"m","stream":true,"messages":[{"role":"user","content":"b"}]});
    let mut b = routed_stream(&host, &w, body.to_string().into_bytes());
    b.on_response_body(&host, 3, false);
    assert_eq!(inflight(&host, &w).1, 2);
    a.on_end(&host);
    b.on_end(&host);
    b.on_end(&host);
    assert_eq!(inflight(&host, &w), (0, 0));
}

#[test]
fn the_client_destination_header_is_always_stripped() {
    let (host, w) = filter("");
    host.set_request(
        "GET",
        "/other",
        &[("x-gateway-destination-endpoint", b"10.0.0.9:80")],
    );
    let mut s = Stream::new(Some(w.clone()));
    assert_eq!(s.on_request_headers(&host, true), Action::Continue);
    assert_eq!(host.header("x-gateway-destination-endpoint"), None);
    // Headers that cannot be read are stripped blind; a strip that fails
    // refuses the request rather than let the client pick.
    host.failing
        .borrow_mut()
        .insert("proxy_get_header_map_pairs");
    host.failing
        .borrow_mut()
        .insert("proxy_remove_header_map_value");
    let mut s = Stream::new(Some(w.clone()));
    assert_eq!(s.on_request_headers(&host, false), Action::Pause);
    assert_eq!(host.replies.borrow().last().unwrap().0, 500);
    w.flush(&host);
    assert_eq!(host.counter(Counter::ClientHeaderStripped), 1);
    assert_eq!(host.counter(Counter::HostErrors), 2);
}

#[test]
fn non_utf8_header_values_do_not_stop_routing() {
    let (host, w) = filter("");
    host.set_request("POST", "/v1/chat/completions", &[("x-odd", b"\xff\xfe")]);
    let mut s = Stream::new(Some(w.clone()));
    assert_eq!(s.on_request_headers(&host, false), Action::Pause);
}

#[test]
fn a_failed_destination_write_gives_the_charge_back() {
    let (host, w) = filter("");
    host.failing
        .borrow_mut()
        .insert("proxy_replace_header_map_value");
    let mut s = routed_stream(&host, &w, chat_body("q"));
    assert_eq!(inflight(&host, &w), (0, 0));
    s.on_end(&host);
    assert_eq!(inflight(&host, &w), (0, 0));
    w.flush(&host);
    assert_eq!(host.counter(Counter::Routed), 0);
    assert_eq!(host.counter(Counter::HostErrors), 1);
}

#[test]
fn a_clock_error_is_counted_and_keeps_the_last_time() {
    let (host, w) = filter("");
    assert_eq!(w.now_ms(&host), 5_000);
    host.failing
        .borrow_mut()
        .insert("proxy_get_current_time_nanoseconds");
    let mut s = routed_stream(&host, &w, chat_body("q"));
    assert!(s.holds_charge());
    // The charge is stamped with the last good time, not 0, so the reaper
    // (which reaps charges older than reapAfterMs) leaves it alone.
    assert_eq!(w.engine.reap(host.store(), 5_000 + 1).unwrap(), 0);
    s.on_end(&host);
    w.flush(&host);
    assert_eq!(host.counter(Counter::HostErrors), 1);
    assert!(host.logs.borrow().iter().any(|(_, m)| m.contains("clock")));
}

#[test]
fn fail_closed_rejects_what_fail_open_passes() {
    let (host, w) = filter(r#","failureMode":"closed""#);
    host.set_request("POST", "/v1/chat/completions", &[]);
    let mut s = Stream::new(Some(w.clone()));
    assert_eq!(s.on_request_headers(&host, true), Action::Pause);
    assert_eq!(host.replies.borrow().last().unwrap().0, 400);
    let mut s = Stream::new(Some(w.clone()));
    assert_eq!(s.on_request_headers(&host, false), Action::Pause);
    *host.body.borrow_mut() = b"{not json".to_vec();
    assert_eq!(s.on_request_body(&host, 9, true), Action::Pause);
    assert_eq!(host.replies.borrow().last().unwrap().0, 400);

    let (host, w) = filter("");
    let mut s = routed_stream_fail_open(&host, &w);
    s.on_end(&host);
    w.flush(&host);
    assert_eq!(host.counter(Counter::FailOpen), 1);
    assert!(host.replies.borrow().is_empty());
}

fn routed_stream_fail_open(host: &FakeHost, w: &Rc<Worker>) -> Stream {
    host.set_request("POST", "/v1/chat/completions", &[]);
    let mut s = Stream::new(Some(w.clone()));
    assert_eq!(s.on_request_headers(host, false), Action::Pause);
    *host.body.borrow_mut() = b"{not json".to_vec();
    assert_eq!(s.on_request_body(host, 9, true), Action::Continue);
    assert!(!s.holds_charge());
    s
}

#[test]
fn state_and_decision_header_only_when_configured() {
    let (host, w) = filter("");
    host.set_request("GET", "/kvroute/state", &[]);
    let mut s = Stream::new(Some(w.clone()));
    assert_eq!(s.on_request_headers(&host, true), Action::Continue);
    let mut s = routed_stream(&host, &w, chat_body("q"));
    s.on_response_headers(&host, false);
    assert!(host.response_headers.borrow().is_empty());
    assert!(host.replies.borrow().is_empty());

    let (host, w) = filter(r#","debugHeader":true,"statePath":"/kvroute/state""#);
    host.set_request("GET", "/kvroute/state?x", &[]);
    let mut s = Stream::new(Some(w.clone()));
    assert_eq!(s.on_request_headers(&host, true), Action::Pause);
    let (status, body) = host.replies.borrow().last().unwrap().clone();
    assert_eq!(status, 200);
    assert!(body.contains("endpoints"), "{body}");
    let mut s = routed_stream(&host, &w, chat_body("q"));
    s.on_response_headers(&host, false);
    assert_eq!(host.response_headers.borrow()[0].0, DECISION_HEADER);
}

#[test]
fn an_oversized_body_passes_in_fail_open_and_gets_413_in_fail_closed() {
    let (host, w) = filter(r#","maxBodyBytes":1024"#);
    host.set_request("POST", "/v1/chat/completions", &[]);
    let mut s = Stream::new(Some(w.clone()));
    s.on_request_headers(&host, false);
    assert_eq!(s.on_request_body(&host, 2048, false), Action::Continue);
    assert_eq!(s.on_request_body(&host, 4096, true), Action::Continue);
    assert!(!s.holds_charge());

    let (host, w) = filter(r#","maxBodyBytes":1024,"failureMode":"closed""#);
    host.set_request("POST", "/v1/chat/completions", &[]);
    let mut s = Stream::new(Some(w.clone()));
    s.on_request_headers(&host, false);
    assert_eq!(s.on_request_body(&host, 2048, false), Action::Pause);
    assert_eq!(host.replies.borrow().last().unwrap().0, 413);
}

#[test]
fn an_unconfigured_stream_passes_everything() {
    let host = FakeHost::default();
    host.set_request("POST", "/v1/chat/completions", &[]);
    let mut s = Stream::new(None);
    assert_eq!(s.on_request_headers(&host, false), Action::Continue);
    assert_eq!(s.on_request_body(&host, 10, true), Action::Continue);
    s.on_end(&host);
    assert!(host.calls.borrow().is_empty() && host.logs.borrow().is_empty());
}

#[test]
fn batched_counts_reach_the_host_only_on_flush() {
    let (host, w) = filter("");
    let calls = host.counter_calls.get();
    for i in 0..3 {
        let mut s = routed_stream(&host, &w, chat_body(&format!("q{i}")));
        s.on_end(&host);
    }
    assert_eq!(host.counter_calls.get(), calls, "counted before the tick");
    w.flush(&host);
    assert_eq!(host.counter(Counter::Routed), 3);
    let branches: i64 = [
        Counter::BranchSticky,
        Counter::BranchNoAffinity,
        Counter::BranchSaturationRelease,
        Counter::BranchExploration,
        Counter::BranchOther,
    ]
    .iter()
    .map(|c| host.counter(*c))
    .sum();
    assert_eq!(branches, 3);
    w.flush(&host);
    assert_eq!(
        host.counter(Counter::Routed),
        3,
        "a count handed over twice"
    );
    // Without a tick, counts go at once.
    host.failing
        .borrow_mut()
        .insert("proxy_set_tick_period_milliseconds");
    let Ok(Role::Filter { worker: w, .. }) = configure(&host) else {
        panic!("not a filter")
    };
    let mut s = routed_stream(&host, &w, chat_body("q9"));
    s.on_end(&host);
    assert_eq!(host.counter(Counter::Routed), 4);
}

#[test]
fn branch_counters_cover_every_branch() {
    use crate::scheduling::Branch::*;
    let all = [
        Sticky,
        SaturationRelease,
        NoAffinity,
        Exploration,
        Single,
        Unfiltered,
    ];
    let got: Vec<Counter> = all.iter().map(|b| Counter::for_branch(*b)).collect();
    assert_eq!(
        got,
        [
            Counter::BranchSticky,
            Counter::BranchSaturationRelease,
            Counter::BranchNoAffinity,
            Counter::BranchExploration,
            Counter::BranchOther,
            Counter::BranchOther
        ]
    );
    let names: HashSet<&str> = Counter::ALL.iter().map(|c| c.name()).collect();
    assert_eq!(names.len(), Counter::ALL.len());
}

fn collector(extra: &str) -> (FakeHost, Collector) {
    collector_polling(500, extra)
}

fn collector_polling(poll_ms: u64, extra: &str) -> (FakeHost, Collector) {
    let host = FakeHost::default();
    host.now_ns.set(1_000_000_000);
    *host.config.borrow_mut() = format!(
        r#"{{{BASE},"collector":{{"metricsCluster":"models","metricsPollIntervalMs":{poll_ms}{extra}}}}}"#
    )
    .into_bytes();
    *host.root_id.borrow_mut() = COLLECTOR_ROOT_ID.as_bytes().to_vec();
    match configure(&host) {
        Ok(Role::Collector(c)) => (host, *c),
        Ok(Role::Filter { .. }) => panic!("not the collector"),
        Err(e) => panic!("{e}"),
    }
}

#[test]
fn collector_timers_come_from_the_config() {
    let (host, c) = collector(r#","reapAfterMs":2000"#);
    let t = c.timers();
    assert_eq!(host.tick_ms.get(), Some(250));
    assert_eq!(
        t,
        Timers {
            tick_ms: 250,
            admin_refresh_ms: None,
            admin_timeout_ms: 5_000,
            metrics_poll_ms: 500,
            metrics_timeout_ms: t.metrics_timeout_ms,
            reap_every_ms: 500,
            kv_events_poll_ms: None,
            kv_events_timeout_ms: 1000,
            models_poll_ms: Some(10_000),
        }
    );
    let (_, c) = collector_polling(50, "");
    assert_eq!(c.timers().tick_ms, 25, "clamped to 25 ms");
}

#[test]
fn collector_polls_each_endpoint_once_at_a_time_and_counts_failures() {
    // Model lists off: this test counts /metrics calls.
    let (host, mut c) = collector(r#","modelsPollIntervalMs":0"#);
    c.on_tick(&host);
    let calls = host.calls.borrow().clone();
    assert_eq!(calls.len(), 2, "{calls:?}");
    assert!(calls.iter().all(|(cl, h, _)| cl == "models"
        && h.iter()
            .any(|(k, v)| k == "x-gateway-destination-endpoint" && v.starts_with("127.0.0.1:"))));
    // The same address for an ORIGINAL_DST metrics cluster, which reaches
    // that host or no one (never a fallback pick).
    for (_, h, _) in &calls {
        let named = |name: &str| h.iter().find(|(k, _)| k == name).map(|(_, v)| v.clone());
        assert_eq!(
            named("x-envoy-original-dst-host"),
            named("x-gateway-destination-endpoint"),
            "{h:?}"
        );
    }
    // Still in flight: no second call on the next poll.
    host.now_ns.set(2_000_000_000);
    c.on_tick(&host);
    assert_eq!(host.calls.borrow().len(), 2);
    // One answers 200 with metrics, one times out (no headers).
    *host.call_status.borrow_mut() = Some("200".into());
    *host.call_body.borrow_mut() =
        Some(b"vllm:num_requests_running{model_name=\"m\"} 3\n".to_vec());
    c.on_http_call_response(&host, 1, 3, 40);
    c.on_http_call_response(&host, 2, 0, 0);
    assert_eq!(host.counter(Counter::MetricsPollFailures), 1);
    // A call the host refuses counts as a failed poll.
    host.failing.borrow_mut().insert("proxy_http_call");
    host.now_ns.set(3_000_000_000);
    c.on_tick(&host);
    assert_eq!(host.counter(Counter::MetricsPollFailures), 3);
    // A clock error skips the tick and is counted.
    host.failing
        .borrow_mut()
        .insert("proxy_get_current_time_nanoseconds");
    c.on_tick(&host);
    assert_eq!(host.counter(Counter::HostErrors), 1);
}

#[test]
fn a_lease_mode_filter_collects_once_it_holds_the_lease() {
    let host = FakeHost::default();
    host.now_ns.set(1_000_000_000);
    *host.config.borrow_mut() = format!(
        r#"{{{BASE},"collector":{{"mode":"lease","metricsCluster":"models","metricsPollIntervalMs":500,"modelsPollIntervalMs":0}}}}"#
    )
    .into_bytes();
    *host.root_id.borrow_mut() = b"kvroute".to_vec();
    let Ok(mut role) = configure(&host) else {
        panic!("not configured")
    };
    assert!(matches!(
        &role,
        Role::Filter {
            collector: Some(_),
            ..
        }
    ));
    // The tick serves both the counts' flush and the collector.
    assert_eq!(host.tick_ms.get(), Some(200));
    // The first tick creates the lease free; the second takes it and polls.
    role.on_tick(&host);
    assert!(host.calls.borrow().is_empty());
    assert_eq!(
        host.gauge(telemetry::LEADER_GAUGE),
        None,
        "a contender is not the collector"
    );
    host.now_ns.set(1_250_000_000);
    role.on_tick(&host);
    assert_eq!(host.calls.borrow().len(), 2);
    assert_eq!(host.gauge(telemetry::LEADER_GAUGE), Some(1));
    // Another VM's lease that has not expired: this one stays a follower.
    let other = lease::LeaseRecord {
        holder: 1,
        expires_at_ms: 10_000,
        ..Default::default()
    };
    host.store
        .set(lease::LEASE_KEY, &other.encode(), 0)
        .unwrap();
    host.now_ns.set(3_000_000_000);
    role.on_tick(&host);
    assert_eq!(host.calls.borrow().len(), 2, "a follower polled");
    assert_eq!(
        host.gauge(telemetry::LEADER_GAUGE),
        Some(0),
        "the lease was lost"
    );
    // The singleton mode filter has no collector.
    let (_, w) = filter("");
    assert_eq!(
        w.engine.config.collector.mode,
        crate::config::CollectorMode::Singleton
    );
}

#[test]
fn histograms_are_sampled_in_the_vm_and_recorded_on_the_tick() {
    use telemetry::{Histogram, DECISION_SAMPLE_EVERY, SAMPLES_PER_FLUSH};
    let (host, w) = filter("");
    let reads = host.clock_reads.get();
    for i in 0..DECISION_SAMPLE_EVERY {
        let mut s = routed_stream(&host, &w, chat_body(&format!("q{i}")));
        serve(&host, &mut s, "200");
    }
    // One clock read per request, and one more for the timed one.
    assert_eq!(host.clock_reads.get() - reads, DECISION_SAMPLE_EVERY + 1);
    assert_eq!(w.samples.pending(Histogram::DecisionTimeUs), 1);
    assert_eq!(
        w.samples.pending(Histogram::AffinityPercent),
        DECISION_SAMPLE_EVERY as usize
    );
    assert!(host.samples("kvroute_affinity_percent").is_empty());
    w.flush(&host);
    let affinity = host.samples("kvroute_affinity_percent");
    assert_eq!(affinity.len(), DECISION_SAMPLE_EVERY as usize);
    assert!(affinity.iter().all(|&p| p <= 100), "{affinity:?}");
    // The shared system prompt: later requests find it on their endpoint.
    assert!(affinity.iter().skip(1).any(|&p| p > 0), "{affinity:?}");
    assert_eq!(host.samples("kvroute_decision_time_us").len(), 1);
    assert_eq!(w.samples.pending(Histogram::AffinityPercent), 0);
    // A busy VM keeps at most SAMPLES_PER_FLUSH per histogram between ticks.
    for i in 0..3 * SAMPLES_PER_FLUSH {
        let mut s = routed_stream(&host, &w, chat_body(&format!("r{i}")));
        s.on_end(&host);
    }
    assert_eq!(
        w.samples.pending(Histogram::AffinityPercent),
        SAMPLES_PER_FLUSH
    );
    w.flush(&host);
    assert_eq!(
        host.samples("kvroute_affinity_percent").len(),
        DECISION_SAMPLE_EVERY as usize + SAMPLES_PER_FLUSH
    );
    // A host that refuses samples loses them, logged, and nothing panics.
    host.failing.borrow_mut().insert("proxy_record_metric");
    let mut s = routed_stream(&host, &w, chat_body("late"));
    s.on_end(&host);
    w.flush(&host);
    assert_eq!(w.samples.pending(Histogram::AffinityPercent), 0);
    assert!(host
        .logs
        .borrow()
        .iter()
        .any(|(_, m)| m.contains("sample dropped")));
}

/// A filter and the collector over one fake host (one store), with a
/// 16-shard index so one gauge period sweeps all of it.
fn filter_and_collector() -> (FakeHost, Rc<Worker>, Collector) {
    let host = FakeHost::default();
    host.now_ns.set(5_000_000_000);
    *host.config.borrow_mut() =
        format!(r#"{{{BASE},"routing":{{"seed":7}},"sharedState":{{"indexBudgetBytes":65536}}}}"#)
            .into_bytes();
    *host.root_id.borrow_mut() = COLLECTOR_ROOT_ID.as_bytes().to_vec();
    let Ok(Role::Collector(c)) = configure(&host) else {
        panic!("not the collector")
    };
    *host.root_id.borrow_mut() = b"kvroute".to_vec();
    let Ok(Role::Filter { worker: w, .. }) = configure(&host) else {
        panic!("not a filter")
    };
    (host, w, *c)
}

#[test]
fn collector_gauges_follow_the_shared_tables() {
    use telemetry::{slot_stat_name, GAUGE_PERIOD_MS};
    let (host, w, mut c) = filter_and_collector();
    let slot = |base: &str, s: u16| host.gauge(&slot_stat_name(base, s));
    c.on_tick(&host);
    assert_eq!(host.gauge("kvroute_endpoints"), Some(2));
    assert_eq!(host.gauge("kvroute_endpoints_stale_metrics"), Some(2));
    assert_eq!(host.gauge("kvroute_index_budget_bytes"), Some(65536));
    assert_eq!(host.gauge("kvroute_index_used_bytes"), Some(0));
    assert_eq!(slot("kvroute_endpoint_inflight_requests", 0), Some(0));
    assert_eq!(slot("kvroute_endpoint_metrics_age_ms", 1), Some(0));

    // A request held in flight shows on its endpoint's slot.
    let mut s = routed_stream(&host, &w, chat_body("q"));
    let primary = host.header("x-gateway-destination-endpoint").unwrap();
    let held = if primary.starts_with("127.0.0.1:1") {
        0
    } else {
        1
    };
    // Before the period is over nothing is read or set again.
    let calls = host.counter_calls.get();
    c.on_tick(&host);
    assert_eq!(slot("kvroute_endpoint_inflight_requests", held), Some(0));
    assert_eq!(host.counter_calls.get(), calls);
    host.now_ns
        .set(host.now_ns.get() + GAUGE_PERIOD_MS * 1_000_000);
    c.on_tick(&host);
    assert_eq!(slot("kvroute_endpoint_inflight_requests", held), Some(1));
    assert!(slot("kvroute_endpoint_inflight_tokens", held).unwrap() > 0);
    assert_eq!(
        slot("kvroute_endpoint_inflight_requests", 1 - held),
        Some(0)
    );
    // Metrics never came: their age runs from the collector's start.
    assert_eq!(
        slot("kvroute_endpoint_metrics_age_ms", held),
        Some(GAUGE_PERIOD_MS as i64)
    );
    let used = host.gauge("kvroute_index_used_bytes").unwrap();
    assert!(used > 0 && used % 16 == 0, "{used}");
    s.on_end(&host);
    host.now_ns
        .set(host.now_ns.get() + GAUGE_PERIOD_MS * 1_000_000);
    c.on_tick(&host);
    assert_eq!(slot("kvroute_endpoint_inflight_requests", held), Some(0));
    assert_eq!(slot("kvroute_endpoint_inflight_tokens", held), Some(0));
    // Gauges that cannot be set are logged, never fatal.
    host.failing.borrow_mut().insert("proxy_record_metric");
    host.now_ns
        .set(host.now_ns.get() + GAUGE_PERIOD_MS * 1_000_000);
    c.on_tick(&host);
}

#[test]
fn the_collector_leader_gauge_is_set_by_the_role() {
    use telemetry::{GAUGE_PERIOD_MS, LEADER_GAUGE};
    let (host, _w, mut c) = filter_and_collector();
    assert_eq!(host.gauge(LEADER_GAUGE), Some(1));
    // A second collector configured in the process (Envoy's canary) leaves 1.
    *host.root_id.borrow_mut() = COLLECTOR_ROOT_ID.as_bytes().to_vec();
    assert!(matches!(configure(&host), Ok(Role::Collector(_))));
    assert_eq!(host.gauge(LEADER_GAUGE), Some(1));
    // The hook is idempotent (a lease can call it every tick).
    c.set_leader(&host, true);
    assert_eq!(host.gauge(LEADER_GAUGE), Some(1));
    c.on_done(&host);
    assert_eq!(host.gauge(LEADER_GAUGE), Some(0));
    // A refused update is tried again on the next change.
    host.failing.borrow_mut().insert("proxy_record_metric");
    c.set_leader(&host, true);
    assert_eq!(host.gauge(LEADER_GAUGE), Some(0));
    host.failing.borrow_mut().clear();
    c.set_leader(&host, true);
    assert_eq!(host.gauge(LEADER_GAUGE), Some(1));
    // Another VM's late 0 (a lease hand-over) is overwritten by the leader
    // within one gauge period.
    *host.gauges.borrow_mut().get_mut(LEADER_GAUGE).unwrap() = 0;
    host.now_ns
        .set(host.now_ns.get() + GAUGE_PERIOD_MS * 1_000_000);
    c.on_tick(&host);
    assert_eq!(host.gauge(LEADER_GAUGE), Some(1));
}

#[test]
fn collector_gauges_show_the_prefill_estimate() {
    use telemetry::{slot_stat_name, GAUGE_PERIOD_MS};
    let (host, _w, mut c) = filter_and_collector();
    let gauge = |s: u16| host.gauge(&slot_stat_name("kvroute_endpoint_prefill_tokens_per_s", s));
    c.on_tick(&host);
    assert_eq!(gauge(0), Some(0), "no estimate yet");
    // Two polls of slot 0: 6000 computed tokens in 0.25 s of prefill.
    let engine = Engine::new(Config::from_json(&host.config.borrow()).unwrap());
    let text = |tokens: f64, seconds: f64, n: f64| {
        format!(
            "vllm:num_requests_running 0\nvllm:request_prefill_time_seconds_sum {seconds}\n\
             vllm:request_prefill_time_seconds_count {n}\nvllm:request_prefill_kv_computed_tokens_sum {tokens}\n"
        )
    };
    let now_ms = host.now_ns.get() / 1_000_000;
    let store = host.store();
    engine
        .record_metrics(store, 0, 1, Ok(text(0.0, 0.0, 0.0).as_bytes()), now_ms)
        .unwrap();
    engine
        .record_metrics(
            store,
            0,
            1,
            Ok(text(6000.0, 0.25, 2.0).as_bytes()),
            now_ms + 1,
        )
        .unwrap();
    host.now_ns
        .set(host.now_ns.get() + GAUGE_PERIOD_MS * 1_000_000);
    c.on_tick(&host);
    assert_eq!(gauge(0), Some(24_000));
    assert_eq!(gauge(1), Some(0));
}

// ---------------------------------------------------------------------------
// kvEvents: the collector polls each endpoint's relay.

mod kv_events {
    use super::*;
    use crate::engine::{Engine, Outcome};
    use crate::request::ApiKind;
    use kvroute_shared_state::held::{self, HeldTable};

    const KV_BASE: &str = r#""endpoints":{"static":["127.0.0.1:1","127.0.0.2:2"]},
        "plugins":[{"type":"approx-prefix-cache-producer","parameters":{"blockSizeTokens":16,"lruCapacityPerServer":1000}},
                   {"type":"prefix-cache-affinity-filter"},{"type":"token-load-scorer"},{"type":"max-score-picker"}],
        "schedulingProfiles":[{"name":"d","plugins":[{"pluginRef":"prefix-cache-affinity-filter"},{"pluginRef":"token-load-scorer"},{"pluginRef":"max-score-picker"}]}]"#;

    fn config(kv: &str) -> String {
        format!(
            r#"{{{KV_BASE},"routing":{{"seed":3}},"kvEvents":{{"enabled":true,"pollMs":100,"staleMs":1000,"relays":{{"127.0.0.2:2":"10.9.9.9:7000"}}{kv}}}}}"#
        )
    }

    fn kv_collector(kv: &str) -> (FakeHost, Collector) {
        let host = FakeHost::default();
        host.now_ns.set(1_000_000_000);
        *host.config.borrow_mut() = config(kv).into_bytes();
        *host.root_id.borrow_mut() = COLLECTOR_ROOT_ID.as_bytes().to_vec();
        match configure(&host) {
            Ok(Role::Collector(c)) => (host, *c),
            Ok(Role::Filter { .. }) => panic!("not the collector"),
            Err(e) => panic!("{e}"),
        }
    }

    fn engine(kv: &str) -> Engine {
        Engine::new(crate::config::Config::from_json(config(kv).as_bytes()).unwrap())
    }

    fn header<'a>(call: &'a Call, name: &str) -> &'a str {
        call.1
            .iter()
            .find(|(k, _)| k == name)
            .map_or("", |(_, v)| v.as_str())
    }

    /// Answers call `token` with 200 and `body`.
    fn answer(host: &FakeHost, c: &mut Collector, token: u32, body: &str) {
        *host.call_status.borrow_mut() = Some("200".into());
        *host.call_body.borrow_mut() = Some(body.as_bytes().to_vec());
        c.on_http_call_response(host, token, 3, body.len());
    }

    fn held_of(host: &FakeHost, e: &Engine, slot: u16) -> (Option<held::EndpointHeld>, Vec<u64>) {
        let t = HeldTable::read(&host.store).unwrap();
        let mut hashes = held::all_hashes(&host.store, &e.held_geometry(), &t, slot, 1).unwrap();
        hashes.sort();
        (t.get(slot, 1).copied(), hashes)
    }

    #[test]
    fn off_by_default_and_validated() {
        let (host, mut c) = collector("");
        c.on_tick(&host);
        assert!(host.calls.borrow().iter().all(|(cl, _, _)| cl == "models"));
        assert_eq!(c.timers().kv_events_poll_ms, None);
        for (bad, path) in [
            (r#""pollMs":5"#, "kvEvents.pollMs"),
            (r#""pollMs":100,"staleMs":50"#, "kvEvents.staleMs"),
            (r#""maxHeldBlocks":0"#, "kvEvents.maxHeldBlocks"),
            (r#""relayPort":70000"#, "kvEvents.relayPort"),
            (r#""nope":1"#, "kvEvents"),
        ] {
            let json = format!(r#"{{{KV_BASE},"kvEvents":{{{bad}}}}}"#);
            let e = crate::config::Config::from_json(json.as_bytes()).unwrap_err();
            assert!(e.to_string().contains(path), "{bad}: {e}");
        }
        let e = crate::config::Config::from_json(
            config("")
                .replace("10.9.9.9:7000", "not-an-address")
                .as_bytes(),
        )
        .unwrap_err();
        assert!(e.to_string().contains("kvEvents.relays"), "{e}");
        // The fuzz seed with every section sets every kvEvents field.
        let seed = include_str!("../../../../fuzz/seeds/config/every-section.json");
        let kv = crate::config::Config::from_json(seed.as_bytes())
            .unwrap()
            .kv_events;
        assert!(kv.enabled);
        assert_eq!(
            kv.relay_for("10.0.0.7:8000").as_deref(),
            Some("10.0.0.7:9158")
        );
        assert_eq!(
            kv.relay_for("10.0.0.8:8000").as_deref(),
            Some("10.0.0.8:9157")
        );
    }

    #[test]
    fn polls_each_relay_snapshot_first_then_events_after_its_seq() {
        let (host, mut c) = kv_collector("");
        assert_eq!(c.timers().kv_events_poll_ms, Some(100));
        assert_eq!(c.timers().tick_ms, 50, "the tick serves the relay poll");
        c.on_tick(&host);
        let calls = host.calls.borrow().clone();
        assert_eq!(calls.len(), 2, "{calls:?}");
        // Port convention for the first endpoint, the override for the second.
        assert_eq!(calls[0].0, "kvroute_relays");
        assert_eq!(
            header(&calls[0], "x-envoy-original-dst-host"),
            "127.0.0.1:9157"
        );
        assert_eq!(header(&calls[0], ":path"), "/kv/snapshot");
        assert_eq!(
            header(&calls[1], "x-envoy-original-dst-host"),
            "10.9.9.9:7000"
        );
        assert_eq!(calls[0].2, 1000, "kvEvents.timeoutMs");
        // In flight: the next round makes no second call to the same relay.
        host.now_ns.set(1_200_000_000);
        c.on_tick(&host);
        assert_eq!(host.calls.borrow().len(), 2);
        answer(
            &host,
            &mut c,
            1,
            r#"{"epoch":77,"seq":5,"complete":true,"blocks":[10,11,12]}"#,
        );
        let e = engine("");
        let (view, hashes) = held_of(&host, &e, 0);
        let view = view.unwrap();
        assert_eq!(hashes, [10, 11, 12]);
        assert_eq!(
            (view.relay_epoch, view.relay_seq, view.complete),
            (77, 5, true)
        );
        assert_eq!(host.counter(Counter::KvEventsSnapshots), 1);
        host.now_ns.set(1_400_000_000);
        c.on_tick(&host);
        let calls = host.calls.borrow().clone();
        assert_eq!(
            calls.len(),
            3,
            "only the relay that answered is called again"
        );
        assert_eq!(
            header(&calls[2], ":path"),
            "/kv/events?after=5&epoch=77&limit=4096"
        );
        // Stored and removed in order; `more` asks for the next page at once.
        answer(
            &host,
            &mut c,
            3,
            r#"{"epoch":77,"seq":7,"last":9,"resync":false,"more":true,"batches":[
                {"seq":6,"ops":[{"op":"stored","hashes":[13,14]},{"op":"removed","hashes":[10]}]},
                {"seq":7,"ops":[{"op":"removed","hashes":[13]},{"op":"stored","hashes":[13]}]}]}"#,
        );
        let (view, hashes) = held_of(&host, &e, 0);
        assert_eq!(hashes, [11, 12, 13, 14]);
        assert_eq!(view.unwrap().relay_seq, 7);
        let calls = host.calls.borrow().clone();
        assert_eq!(calls.len(), 4);
        assert_eq!(
            header(&calls[3], ":path"),
            "/kv/events?after=7&epoch=77&limit=4096"
        );
        assert_eq!(host.counter(Counter::KvEventsPolls), 4);
        // `more` without progress is not followed at once (no call loop).
        answer(
            &host,
            &mut c,
            4,
            r#"{"epoch":77,"seq":7,"more":true,"batches":[]}"#,
        );
        assert_eq!(host.calls.borrow().len(), 4);
        assert_eq!(held_of(&host, &e, 0).1, [11, 12, 13, 14]);
        // The state view shows the set.
        let state: serde_json::Value =
            serde_json::from_str(&e.state_json(&host.store, 1400).unwrap()).unwrap();
        let kv = &state["endpoints"][0]["kvEvents"];
        assert_eq!(kv["relay"], "127.0.0.1:9157");
        assert_eq!(kv["blocks"], 4);
        assert_eq!(kv["fresh"], true);
        assert_eq!(kv["hashes"], serde_json::json!([11, 12, 13, 14]));
        assert_eq!(state["endpoints"][1]["kvEvents"]["fresh"], false);
        assert_eq!(state["kvEvents"]["maxBytesPerEndpoint"], 512 * 2048);
    }

    #[test]
    fn garbage_and_failures_are_counted_and_keep_the_set() {
        let (host, mut c) = kv_collector("");
        c.on_tick(&host);
        answer(
            &host,
            &mut c,
            1,
            r#"{"epoch":1,"seq":0,"complete":true,"blocks":[5]}"#,
        );
        for (i, bad) in [
            "not json",
            r#"{"epoch":1}"#,
            r#"{"epoch":1,"seq":1,"batches":[{"seq":1,"ops":[{"op":"exploded"}]}]}"#,
            r#"{"epoch":1,"seq":1,"batches":[{"seq":1,"ops":[{"op":"stored","hashes":[-1]}]}]}"#,
        ]
        .iter()
        .enumerate()
        {
            host.now_ns.set(2_000_000_000 + i as u64 * 200_000_000);
            c.on_tick(&host);
            let token = host.calls.borrow().len() as u32;
            answer(&host, &mut c, token, bad);
        }
        assert_eq!(host.counter(Counter::KvEventsBadAnswers), 4);
        assert_eq!(host.counter(Counter::KvEventsPollFailures), 4);
        // A timeout (no headers) and a 503 are failed polls too.
        host.now_ns.set(3_000_000_000);
        c.on_tick(&host);
        let token = host.calls.borrow().len() as u32;
        c.on_http_call_response(&host, token, 0, 0);
        host.now_ns.set(3_200_000_000);
        c.on_tick(&host);
        let token = host.calls.borrow().len() as u32;
        *host.call_status.borrow_mut() = Some("503".into());
        c.on_http_call_response(&host, token, 3, 0);
        assert_eq!(host.counter(Counter::KvEventsPollFailures), 6);
        let e = engine("");
        let (view, hashes) = held_of(&host, &e, 0);
        assert_eq!(hashes, [5], "a failed poll keeps the set");
        assert_eq!(view.unwrap().failures, 6);
        // A refused dispatch is a failed poll, never a panic (the second
        // endpoint's first call never came back: it is still in flight).
        host.failing.borrow_mut().insert("proxy_http_call");
        host.now_ns.set(3_400_000_000);
        c.on_tick(&host);
        assert_eq!(host.counter(Counter::KvEventsPollFailures), 7);
        // A relay that stays down is warned about once per run of failures.
        let warns = host
            .logs
            .borrow()
            .iter()
            .filter(|(l, m)| *l == Level::Warn && m.contains("relay"))
            .count();
        assert_eq!(warns, 1, "{:?}", host.logs.borrow());
    }

    #[test]
    fn resync_and_epoch_change_reload_the_snapshot() {
        let (host, mut c) = kv_collector("");
        c.on_tick(&host);
        answer(
            &host,
            &mut c,
            1,
            r#"{"epoch":1,"seq":3,"complete":true,"blocks":[1,2,3,4]}"#,
        );
        host.now_ns.set(1_200_000_000);
        c.on_tick(&host);
        let n = host.calls.borrow().len() as u32;
        answer(
            &host,
            &mut c,
            n,
            r#"{"epoch":1,"seq":40,"resync":true,"batches":[]}"#,
        );
        assert_eq!(host.counter(Counter::KvEventsResyncs), 1);
        let calls = host.calls.borrow().clone();
        assert_eq!(
            calls.len() as u32,
            n + 1,
            "the snapshot is asked for at once"
        );
        assert_eq!(header(calls.last().unwrap(), ":path"), "/kv/snapshot");
        answer(
            &host,
            &mut c,
            n + 1,
            r#"{"epoch":1,"seq":40,"complete":false,"blocks":[3,4,5]}"#,
        );
        let e = engine("");
        let (view, hashes) = held_of(&host, &e, 0);
        assert_eq!(hashes, [3, 4, 5], "the snapshot replaced the set");
        assert!(!view.unwrap().complete);
        // A relay that restarted (new epoch) answers `resync` because the
        // epoch is not its own; an answer from another epoch is a resync too.
        host.now_ns.set(1_400_000_000);
        c.on_tick(&host);
        let n = host.calls.borrow().len() as u32;
        assert!(header(&host.calls.borrow()[n as usize - 1], ":path").contains("after=40&epoch=1"));
        answer(
            &host,
            &mut c,
            n,
            r#"{"epoch":2,"seq":0,"resync":false,"batches":[]}"#,
        );
        assert_eq!(host.counter(Counter::KvEventsResyncs), 2);
        answer(
            &host,
            &mut c,
            n + 1,
            r#"{"epoch":2,"seq":0,"complete":true,"blocks":[]}"#,
        );
        let (view, hashes) = held_of(&host, &e, 0);
        assert!(hashes.is_empty());
        assert_eq!(view.unwrap().relay_epoch, 2);
        // The server lost its whole cache: the approximate index forgot it.
        assert_eq!(host.counter(Counter::KvEventsIndexResets), 1);
    }

    #[test]
    fn cleared_empties_the_set_and_ages_out_the_approximate_index() {
        let (host, mut c) = kv_collector("");
        let e = engine("");
        // A request routed (approximate mode) before: the index holds it.
        let body = chat_body("hello");
        let mut rng = crate::scheduling::Rng::new(1);
        let Outcome::Routed(r) = e.route(
            &host.store,
            e.facts(ApiKind::ChatCompletions, &body).unwrap(),
            1000,
            &mut rng,
        ) else {
            panic!("not routed")
        };
        let slot = if r.primary_address() == "127.0.0.1:1" {
            0u16
        } else {
            1
        };
        let matched = |host: &FakeHost| {
            let req = crate::request::parse_request(
                ApiKind::ChatCompletions,
                &body,
                &crate::request::ParseLimits {
                    max_body_bytes: 1 << 20,
                },
            )
            .unwrap();
            let blocks = crate::blocks::prompt_blocks(&req, &e.config.prefix.blocks);
            let snap = e
                .snapshot(
                    &host.store,
                    &crate::engine::RequestFacts::blocks(
                        blocks.block_hashes,
                        blocks.prompt_tokens,
                        None,
                    ),
                    1000,
                )
                .unwrap()
                .unwrap();
            snap.candidates[slot as usize].matched_blocks
        };
        assert!(matched(&host) > 0);
        c.on_tick(&host);
        let token = slot as u32 + 1;
        answer(
            &host,
            &mut c,
            token,
            r#"{"epoch":9,"seq":1,"complete":true,"blocks":[1,2]}"#,
        );
        assert!(
            matched(&host) > 0,
            "a snapshot on first sight resets nothing"
        );
        host.now_ns.set(1_200_000_000);
        c.on_tick(&host);
        let n = host.calls.borrow().len() as u32;
        answer(
            &host,
            &mut c,
            n,
            r#"{"epoch":9,"seq":2,"batches":[{"seq":2,"ops":[{"op":"cleared"},{"op":"stored","hashes":[7]}]}]}"#,
        );
        let (view, hashes) = held_of(&host, &e, slot);
        assert_eq!(hashes, [7]);
        assert!(
            view.unwrap().complete,
            "after AllBlocksCleared the set is whole"
        );
        assert_eq!(host.counter(Counter::KvEventsIndexResets), 1);
        assert_eq!(
            matched(&host),
            0,
            "the approximate index no longer claims the prompt"
        );
    }

    /// The mesh exchange (on with `kvEvents`): each round posts every
    /// relay this proxy's accepted decisions there and its own load, and
    /// applies the answer: the other proxies' load and decisions.
    #[test]
    fn the_mesh_exchange_posts_each_relay_and_applies_the_answer() {
        let (host, mut c) = kv_collector("");
        let e = engine("");
        assert!(e.config.mesh.enabled, "on with kvEvents");
        // A worker routed a request and the server accepted it.
        let body =
            serde_json::json!({"model":"m","prompt":"the quick brown fox ".repeat(40)}).to_string();
        let facts = e.facts(ApiKind::Completions, body.as_bytes()).unwrap();
        let r = match e.route(
            &host.store,
            facts,
            1000,
            &mut crate::scheduling::Rng::new(1),
        ) {
            Outcome::Routed(r) => r,
            other => panic!("{other:?}"),
        };
        e.note_accepted(&host.store, r.provisional.as_ref().unwrap(), None)
            .unwrap();
        let to = r.primary_address().to_owned();
        c.on_tick(&host);
        let posts = host.posts.borrow().clone();
        assert_eq!(posts.len(), 2, "one post per relay");
        let mut sent = 0;
        for (cluster, headers, body) in &posts {
            let h = |n: &str| headers.iter().find(|(k, _)| k == n).map(|(_, v)| v.clone());
            assert_eq!(cluster, "kvroute_relays");
            assert_eq!(h(":method").as_deref(), Some("POST"));
            assert_eq!(h(":path").as_deref(), Some("/mesh/exchange"));
            let v: serde_json::Value = serde_json::from_slice(body).unwrap();
            assert_eq!(v["proxy"].as_str().unwrap().len(), 16);
            assert!(v.get("epoch").is_none(), "no cursor yet");
            let relay_of_to = if to == "127.0.0.1:1" {
                "127.0.0.1:9157"
            } else {
                "10.9.9.9:7000"
            };
            if h("x-envoy-original-dst-host").as_deref() == Some(relay_of_to) {
                assert_eq!(v["load"]["requests"], 1, "its own charge there");
                assert_eq!(v["decisions"].as_array().unwrap().len(), 1);
                sent += 1;
            } else {
                assert_eq!(v["load"]["requests"], 0);
                assert_eq!(v["decisions"].as_array().unwrap().len(), 0);
            }
        }
        assert_eq!(sent, 1);
        assert_eq!(host.counter(Counter::MeshDecisionsSent), 1);
        // The first relay answers with another proxy's decision and load.
        answer(
            &host,
            &mut c,
            POST_TOKENS + 1,
            r#"{"epoch":5,"seq":3,"last":3,"resync":false,"more":false,
                "load":{"prompt":700,"output":10,"requests":2,"proxies":1},
                "decisions":[{"newBlocks":4,"hashes":[101,102,103,104]}]}"#,
        );
        assert_eq!(host.counter(Counter::MeshExchanges), 1);
        assert_eq!(host.counter(Counter::MeshDecisionsReceived), 1);
        let t = kvroute_shared_state::load::LoadTable::decode(
            host.store
                .get(kvroute_shared_state::LOAD_KEY)
                .unwrap()
                .as_ref()
                .map(|(b, _)| b.as_slice()),
        );
        let peer = t.get(0, 1).unwrap().peer;
        assert_eq!(
            (peer.prompt_tokens, peer.output_tokens, peer.requests),
            (700, 10, 2)
        );
        // The second fails: counted, and its relay is posted again next round.
        *host.call_status.borrow_mut() = Some("503".into());
        *host.call_body.borrow_mut() = None;
        c.on_http_call_response(&host, POST_TOKENS + 2, 3, 0);
        assert_eq!(host.counter(Counter::MeshExchangeFailures), 1);
        host.now_ns.set(1_200_000_000);
        c.on_tick(&host);
        let posts = host.posts.borrow().clone();
        assert_eq!(posts.len(), 4);
        let cursors: Vec<serde_json::Value> = posts[2..]
            .iter()
            .map(|(_, _, b)| serde_json::from_slice::<serde_json::Value>(b).unwrap())
            .collect();
        assert!(
            cursors.iter().any(|v| v["epoch"] == 5 && v["after"] == 3),
            "the answered relay's cursor: {cursors:?}"
        );
        // Garbage is a failure, never a panic.
        answer(&host, &mut c, POST_TOKENS + 3, "{not json");
        assert_eq!(host.counter(Counter::MeshExchangeFailures), 2);
    }

    #[test]
    fn the_mesh_exchange_follows_kv_events_unless_turned_off() {
        let off = engine(r#"}, "mesh": {"exchange": false"#);
        assert!(!off.config.mesh.enabled);
        let json = format!(r#"{{{KV_BASE},"mesh":{{"exchange":true}}}}"#);
        let e = crate::config::Config::from_json(json.as_bytes()).unwrap_err();
        assert!(e.to_string().contains("mesh.exchange"), "{e}");
        let json = format!(r#"{{{KV_BASE}}}"#);
        assert!(
            !crate::config::Config::from_json(json.as_bytes())
                .unwrap()
                .mesh
                .enabled
        );
        let (host, mut c) = kv_collector(r#"}, "mesh": {"exchange": false"#);
        c.on_tick(&host);
        assert!(host.posts.borrow().is_empty());
    }

    #[test]
    fn a_dead_relay_goes_stale_and_routing_goes_on() {
        let (host, mut c) = kv_collector("");
        c.on_tick(&host);
        answer(
            &host,
            &mut c,
            1,
            r#"{"epoch":1,"seq":0,"complete":true,"blocks":[42]}"#,
        );
        answer(
            &host,
            &mut c,
            2,
            r#"{"epoch":1,"seq":0,"complete":true,"blocks":[42]}"#,
        );
        let e = engine("");
        let geo = e.held_geometry();
        let lookup = |now_ms: u64| {
            let t = HeldTable::read(&host.store).unwrap();
            held::longest_held(
                &host.store,
                &geo,
                &t,
                &[(0, 1), (1, 1)],
                &[42, 43],
                now_ms,
                1000,
            )
            .unwrap()
        };
        assert!(lookup(1000)
            .iter()
            .all(|m| m.fresh && m.matched_blocks == 1));
        // The engine's request-path helper says the same.
        let table = e.endpoint_table(&host.store).unwrap();
        let m = e
            .held_prefixes(&host.store, &table.endpoints, &[42, 43], 1000)
            .unwrap();
        assert!(m.iter().all(|m| m.fresh && m.matched_blocks == 1), "{m:?}");
        let off_json = config("").replace(r#""enabled":true"#, r#""enabled":false"#);
        let off = Engine::new(crate::config::Config::from_json(off_json.as_bytes()).unwrap());
        let m = off
            .held_prefixes(&host.store, &table.endpoints, &[42], 1000)
            .unwrap();
        assert!(m.iter().all(|m| !m.fresh), "kvEvents off: never fresh");
        // The relays stop answering: every poll times out.
        for i in 1..=12u64 {
            host.now_ns.set(1_000_000_000 + i * 200_000_000);
            c.on_tick(&host);
            let calls = host.calls.borrow().len() as u32;
            for t in calls.saturating_sub(1)..=calls {
                c.on_http_call_response(&host, t, 0, 0);
            }
        }
        let now_ms = 1000 + 12 * 200;
        assert!(lookup(now_ms)
            .iter()
            .all(|m| !m.fresh && m.matched_blocks == 0));
        assert_eq!(host.gauge("kvroute_kv_events_stale_endpoints"), Some(2));
        assert_eq!(host.gauge("kvroute_kv_events_held_blocks"), Some(2));
        let state: serde_json::Value =
            serde_json::from_str(&e.state_json(&host.store, now_ms).unwrap()).unwrap();
        assert_eq!(state["endpoints"][0]["kvEvents"]["fresh"], false);
        // Routing does not depend on the relays.
        let mut rng = crate::scheduling::Rng::new(1);
        assert!(matches!(
            e.route(
                &host.store,
                e.facts(ApiKind::ChatCompletions, &chat_body("x")).unwrap(),
                now_ms,
                &mut rng
            ),
            Outcome::Routed(_)
        ));
    }

    #[test]
    fn the_relay_position_is_shared_so_a_new_collector_carries_on() {
        let (host, mut c) = kv_collector("");
        c.on_tick(&host);
        answer(
            &host,
            &mut c,
            1,
            r#"{"epoch":5,"seq":12,"complete":true,"blocks":[1]}"#,
        );
        // Another collector (a new lease holder, a restarted singleton)
        // over the same shared data starts from the stored position.
        host.now_ns.set(2_000_000_000);
        let Ok(Role::Collector(mut c2)) = configure(&host) else {
            panic!("not configured")
        };
        let before = host.calls.borrow().len();
        c2.on_tick(&host);
        let calls = host.calls.borrow()[before..].to_vec();
        assert_eq!(
            header(&calls[0], ":path"),
            "/kv/events?after=12&epoch=5&limit=4096"
        );
        assert_eq!(header(&calls[1], ":path"), "/kv/snapshot");
    }

    #[test]
    fn a_caught_up_view_takes_the_relays_completeness() {
        let (host, mut c) = kv_collector("");
        c.on_tick(&host);
        // Taken before the relay saw its first batch: not complete.
        answer(
            &host,
            &mut c,
            1,
            r#"{"epoch":1,"seq":0,"complete":false,"blocks":[]}"#,
        );
        let e = engine("");
        assert!(!held_of(&host, &e, 0).0.unwrap().complete);
        host.now_ns.set(1_200_000_000);
        c.on_tick(&host);
        let n = host.calls.borrow().len() as u32;
        // Not caught up yet (more to come): the flag is not taken over.
        answer(
            &host,
            &mut c,
            n,
            r#"{"epoch":1,"seq":1,"last":2,"more":true,"complete":true,"batches":[{"seq":1,"ops":[{"op":"stored","hashes":[4]}]}]}"#,
        );
        assert!(!held_of(&host, &e, 0).0.unwrap().complete);
        answer(
            &host,
            &mut c,
            n + 1,
            r#"{"epoch":1,"seq":2,"last":2,"more":false,"complete":true,"batches":[{"seq":2,"ops":[{"op":"stored","hashes":[5]}]}]}"#,
        );
        let (view, hashes) = held_of(&host, &e, 0);
        assert_eq!(hashes, [4, 5]);
        assert!(view.unwrap().complete, "caught up with a complete relay");
    }

    #[test]
    fn the_set_stays_within_max_held_blocks() {
        let (host, mut c) = kv_collector(r#","maxHeldBlocks":300"#);
        c.on_tick(&host);
        let blocks: Vec<u64> = (1..=1000).collect();
        answer(
            &host,
            &mut c,
            1,
            &serde_json::json!({"epoch":1,"seq":0,"complete":true,"blocks":blocks}).to_string(),
        );
        let e = engine(r#","maxHeldBlocks":300"#);
        let (view, hashes) = held_of(&host, &e, 0);
        let view = view.unwrap();
        assert_eq!(hashes.len(), 300);
        assert_eq!(view.blocks, 300);
        assert!(
            !view.complete,
            "dropping at the bound makes the view incomplete"
        );
        assert_eq!(host.counter(Counter::KvEventsDropped), 700);
        assert!(
            host.store.bytes_with_prefix("kvroute/held/") as u64
                <= e.held_geometry().max_bytes_per_endpoint()
        );
    }
}

#[test]
fn workers_publish_the_age_of_the_collectors_last_tick() {
    use kvroute_shared_state::collector_tick;
    let age = |host: &FakeHost| host.gauge(telemetry::TICK_AGE_GAUGE);
    // The collector stamps each tick in shared data.
    let (host, mut c) = collector("");
    host.now_ns.set(4_000_000_000);
    c.on_tick(&host);
    assert_eq!(collector_tick::last(host.store()), Ok(Some(4_000)));
    // A worker with no collector ever seen: the age counts from its first look.
    let (host, w) = filter("");
    w.on_tick(&host);
    assert_eq!(age(&host), Some(0));
    host.now_ns.set(8_000_000_000);
    w.on_tick(&host);
    assert_eq!(age(&host), Some(3_000), "5 s → 8 s, no tick stamped");
    // A collector that ticks keeps it small.
    collector_tick::stamp(host.store(), 8_700).unwrap();
    host.now_ns.set(9_000_000_000);
    w.on_tick(&host);
    assert_eq!(age(&host), Some(300));
    // Within the gauge period the worker does not read again.
    host.now_ns.set(9_500_000_000);
    w.on_tick(&host);
    assert_eq!(age(&host), Some(300));
    // It stops ticking: the age grows with the clock.
    host.now_ns.set(20_000_000_000);
    w.on_tick(&host);
    assert_eq!(age(&host), Some(11_300));
    // A shared-data error leaves the gauge alone; a clock error skips it and
    // is counted.
    host.failing
        .borrow_mut()
        .insert("proxy_get_current_time_nanoseconds");
    host.now_ns.set(30_000_000_000);
    w.on_tick(&host);
    assert_eq!(age(&host), Some(11_300));
    assert_eq!(host.counter(Counter::HostErrors), 1);
}

#[test]
fn a_lease_follower_does_not_stamp_the_collectors_tick() {
    use kvroute_shared_state::collector_tick;
    let host = FakeHost::default();
    host.now_ns.set(1_000_000_000);
    *host.config.borrow_mut() = format!(
        r#"{{{BASE},"collector":{{"mode":"lease","metricsCluster":"models","metricsPollIntervalMs":500,"modelsPollIntervalMs":0}}}}"#
    )
    .into_bytes();
    *host.root_id.borrow_mut() = b"kvroute".to_vec();
    let Ok(mut role) = configure(&host) else {
        panic!("not configured")
    };
    let other = lease::LeaseRecord {
        holder: 1,
        expires_at_ms: 60_000,
        ..Default::default()
    };
    host.store
        .set(lease::LEASE_KEY, &other.encode(), 0)
        .unwrap();
    host.now_ns.set(2_000_000_000);
    role.on_tick(&host);
    assert_eq!(
        collector_tick::last(host.store()),
        Ok(None),
        "a follower stamped"
    );
    assert_eq!(host.gauge(telemetry::TICK_AGE_GAUGE), Some(0));
}

#[cfg(feature = "tokenizer")]
#[path = "tokenizing_tests.rs"]
mod tokenizing_tests;

#[path = "models_tests.rs"]
mod models_tests;

/// Flow control in a worker: admission, dispatch on the tick, shedding,
/// and every charge released on every exit path.
mod flow_control {
    use super::*;

    /// A filter worker with flow control: two endpoints, a
    /// concurrency-detector at `max` requests per endpoint, `flow` as the
    /// `flowControl` section and `objectives` as `inferenceObjectives`.
    fn flow_filter(
        host: &FakeHost,
        seed: u64,
        max: u32,
        flow: &str,
        objectives: &str,
    ) -> Rc<Worker> {
        host.now_ns.set(5_000_000_000);
        *host.config.borrow_mut() = format!(
            r#"{{"endpoints":{{"static":["127.0.0.1:1","127.0.0.1:2"]}},
            "featureGates":["flowControl"],
            "plugins":[{{"type":"approx-prefix-cache-producer","parameters":{{"blockSizeTokens":16}}}},
               {{"type":"queue-scorer"}},{{"type":"max-score-picker"}},
               {{"type":"concurrency-detector","parameters":{{"maxConcurrency":{max}}}}},
               {{"type":"round-robin-fairness-policy"}}],
            "schedulingProfiles":[{{"name":"d","plugins":[{{"pluginRef":"queue-scorer"}},{{"pluginRef":"max-score-picker"}}]}}],
            "flowControl":{{"saturationDetector":{{"pluginRef":"concurrency-detector"}}{flow}}},
            "inferenceObjectives":[{objectives}],
            "routing":{{"seed":{seed}}}}}"#
        )
        .into_bytes();
        *host.root_id.borrow_mut() = b"kvroute".to_vec();
        match configure(host) {
            Ok(Role::Filter { worker, .. }) => worker,
            Ok(Role::Collector(_)) => panic!("configured as the collector"),
            Err(e) => panic!("{e}"),
        }
    }

    /// Headers (with `extra`) and the whole body of stream `id`; returns the
    /// stream and the body callback's action.
    fn send(
        host: &FakeHost,
        w: &Rc<Worker>,
        id: u32,
        user: &str,
        extra: &[(&str, &[u8])],
    ) -> (Stream, Action) {
        host.set_request("POST", "/v1/chat/completions", extra);
        host.effective.set(None);
        let mut s = Stream::new(Some(w.clone())).with_id(id);
        assert_eq!(s.on_request_headers(host, false), Action::Pause);
        let body = chat_body(user);
        let n = body.len();
        *host.body.borrow_mut() = body;
        let a = s.on_request_body(host, n, true);
        (s, a)
    }

    fn metric(host: &FakeHost, name: &str) -> i64 {
        host.gauge(name).unwrap_or(0)
    }

    fn tick(host: &FakeHost, w: &Worker, advance_ms: u64) {
        host.now_ns.set(host.now_ns.get() + advance_ms * 1_000_000);
        host.effective.set(None);
        w.on_tick(host);
    }

    #[test]
    fn a_saturated_pool_holds_requests_and_dispatches_them_as_capacity_frees() {
        let host = FakeHost::default();
        let w = flow_filter(&host, 7, 1, "", "");
        assert_eq!(host.tick_ms.get(), Some(crate::flow::FLOW_TICK_MS));
        // Two endpoints × 1: two go at once, the third waits.
        let (mut a, act) = send(&host, &w, 1, "a", &[]);
        assert_eq!(act, Action::Continue);
        let (mut b, act) = send(&host, &w, 2, "b", &[]);
        assert_eq!(act, Action::Continue);
        let (mut c, act) = send(&host, &w, 3, "c", &[]);
        assert_eq!(act, Action::Pause, "the pool is saturated: c waits");
        let (mut d, act) = send(&host, &w, 4, "d", &[]);
        assert_eq!(act, Action::Pause);
        assert_eq!(
            inflight(&host, &w).1,
            2,
            "a waiting request holds no charge"
        );
        assert_eq!(metric(&host, "kvroute_flow_queued.band.0"), 2);
        // Nothing frees: the tick dispatches nothing.
        tick(&host, &w, 5);
        assert!(host.resumed.borrow().is_empty());
        assert_eq!(w.flow.as_ref().unwrap().waiting(), 2);
        // a ends: c (first come) goes, on its own context, routed.
        serve(&host, &mut a, "200");
        tick(&host, &w, 5);
        assert_eq!(*host.resumed.borrow(), vec![Some(3)]);
        let set = host.ctx_headers.borrow().last().cloned().unwrap();
        assert_eq!(
            (set.0, set.1.as_str()),
            (Some(3), "x-gateway-destination-endpoint")
        );
        assert_eq!(inflight(&host, &w).1, 2);
        assert_eq!(metric(&host, "kvroute_flow_dispatched.band.0"), 1);
        assert_eq!(host.samples("kvroute_flow_wait_ms.band.0"), vec![10]);
        // d's client goes away while it waits: out of the queue, nothing
        // charged, counted.
        d.on_end(&host);
        assert_eq!(metric(&host, "kvroute_flow_cancelled.band.0"), 1);
        assert_eq!(w.flow.as_ref().unwrap().waiting(), 0);
        // c's stream takes over its charge and releases it at its end.
        serve(&host, &mut c, "200");
        serve(&host, &mut b, "200");
        assert_eq!(inflight(&host, &w), (0, 0), "every charge released");
        // The board holds nothing once the queue is empty.
        tick(&host, &w, 5);
        let board = crate::flow::board::read(host.store()).unwrap();
        assert!(board.records.is_empty(), "{board:?}");
    }

    #[test]
    fn a_dispatched_request_whose_client_left_before_its_response_releases_its_charge() {
        let host = FakeHost::default();
        let w = flow_filter(&host, 7, 1, "", "");
        let (mut a, _) = send(&host, &w, 1, "a", &[]);
        let (_b, _) = send(&host, &w, 2, "b", &[]);
        let (mut c, act) = send(&host, &w, 3, "c", &[]);
        assert_eq!(act, Action::Pause);
        serve(&host, &mut a, "200");
        tick(&host, &w, 5);
        assert_eq!(inflight(&host, &w).1, 2, "c dispatched and charged");
        // Reset before any response: the stream's end takes the dispatch
        // over and gives back everything it wrote.
        c.on_end(&host);
        assert_eq!(inflight(&host, &w).1, 1);
    }

    #[test]
    fn the_higher_band_goes_first_and_a_full_band_or_a_long_wait_is_shed() {
        let host = FakeHost::default();
        let w = flow_filter(
            &host,
            7,
            1,
            r#","defaultRequestTTL":"1s","priorityBands":[{"priority":-5,"maxRequests":"1"}]"#,
            r#"{"name":"premium","priority":10},{"name":"batch","priority":-5}"#,
        );
        let obj: &str = crate::flow::OBJECTIVE_HEADERS[1];
        let (mut a, _) = send(&host, &w, 1, "a", &[]);
        let (_b, _) = send(&host, &w, 2, "b", &[]);
        let (_lo, act) = send(&host, &w, 3, "lo", &[(obj, b"batch")]);
        assert_eq!(act, Action::Pause);
        // The batch band holds one: the next batch request is shed.
        let (_lo2, act) = send(&host, &w, 4, "lo2", &[(obj, b"batch")]);
        assert_eq!(act, Action::Pause, "answered locally");
        let r = host.ctx_replies.borrow().last().cloned().unwrap();
        assert_eq!(r.1, 429);
        assert!(
            r.3.contains(&("retry-after".to_string(), "1".to_string())),
            "{r:?}"
        );
        assert!(r.3.contains(&(
            crate::flow::DROPPED_REASON_HEADER.to_string(),
            "rejected-saturated".to_string()
        )));
        assert!(r.2.contains("\"error\""), "an OpenAI-style error: {}", r.2);
        assert_eq!(metric(&host, "kvroute_flow_shed_capacity.band.m5"), 1);
        let (_hi, act) = send(&host, &w, 5, "hi", &[(obj, b"premium")]);
        assert_eq!(act, Action::Pause);
        // One slot frees: premium goes first although batch came earlier.
        serve(&host, &mut a, "200");
        tick(&host, &w, 5);
        assert_eq!(*host.resumed.borrow(), vec![Some(5)]);
        // batch waits past its TTL: 429 on its own context.
        tick(&host, &w, 1_000);
        let r = host.ctx_replies.borrow().last().cloned().unwrap();
        assert_eq!((r.0, r.1), (Some(3), 429));
        assert!(r.3.contains(&(
            crate::flow::DROPPED_REASON_HEADER.to_string(),
            "rejected-ttl-expired".to_string()
        )));
        assert_eq!(metric(&host, "kvroute_flow_shed_ttl.band.m5"), 1);
        assert_eq!(w.flow.as_ref().unwrap().waiting(), 0);
    }

    /// A Messages request (`/v1/messages`) and its whole body; returns the
    /// stream and the body callback's action.
    fn send_messages(host: &FakeHost, w: &Rc<Worker>, id: u32, user: &str) -> (Stream, Action) {
        host.set_request("POST", "/v1/messages", &[]);
        host.effective.set(None);
        let mut s = Stream::new(Some(w.clone())).with_id(id);
        assert_eq!(s.on_request_headers(host, false), Action::Pause);
        let body = serde_json::json!({"model":"m","max_tokens":16,
            "messages":[{"role":"user","content":user}]})
        .to_string()
        .into_bytes();
        let n = body.len();
        *host.body.borrow_mut() = body;
        let a = s.on_request_body(host, n, true);
        (s, a)
    }

    /// The last reply made on a stream's context: (context, status, JSON).
    fn last_ctx_reply(host: &FakeHost) -> (Option<u32>, u32, serde_json::Value) {
        let r = host.ctx_replies.borrow().last().cloned().unwrap();
        (r.0, r.1, serde_json::from_str(&r.2).unwrap())
    }

    #[test]
    fn a_shed_messages_request_gets_anthropics_rate_limit_error() {
        let host = FakeHost::default();
        let w = flow_filter(
            &host,
            7,
            1,
            r#","defaultRequestTTL":"1s","priorityBands":[{"priority":0,"maxRequests":"1"}]"#,
            "",
        );
        let (_a, _) = send_messages(&host, &w, 1, "a");
        let (_b, _) = send_messages(&host, &w, 2, "b");
        let (_c, act) = send_messages(&host, &w, 3, "c");
        assert_eq!(act, Action::Pause, "saturated: c waits");
        // The band holds one: d is shed at admission, in Anthropic's shape.
        let (_d, act) = send_messages(&host, &w, 4, "d");
        assert_eq!(act, Action::Pause, "answered locally");
        let (ctx, status, v) = last_ctx_reply(&host);
        assert_eq!((ctx, status), (None, 429));
        assert_eq!(v["type"], "error", "{v}");
        assert_eq!(v["error"]["type"], "rate_limit_error", "{v}");
        assert_eq!(
            v["error"]["message"],
            crate::flow::Shed::Capacity.message(),
            "{v}"
        );
        let headers = host.ctx_replies.borrow().last().cloned().unwrap().3;
        assert!(headers.contains(&("retry-after".to_string(), "1".to_string())));
        // c waits past its TTL: shed on its own context, in the same shape.
        tick(&host, &w, 1_000);
        let (ctx, status, v) = last_ctx_reply(&host);
        assert_eq!((ctx, status), (Some(3), 429));
        assert_eq!(v["type"], "error", "{v}");
        assert_eq!(v["error"]["type"], "rate_limit_error", "{v}");
        // A chat request shed at admission keeps OpenAI's shape.
        let (_e, _) = send_messages(&host, &w, 5, "e");
        let (_f, act) = send(&host, &w, 6, "f", &[]);
        assert_eq!(act, Action::Pause);
        let (_, status, v) = last_ctx_reply(&host);
        assert_eq!(status, 429);
        assert_eq!(v["error"]["type"], "rate_limit_exceeded", "{v}");
        assert!(v.get("type").is_none(), "{v}");
    }

    #[test]
    fn workers_agree_on_band_and_arrival_order_through_the_board() {
        // Two workers of one Envoy (one store), each with its own queue.
        let host = FakeHost::default();
        let w1 = flow_filter(&host, 7, 1, "", r#"{"name":"premium","priority":10}"#);
        let w2 = flow_filter(&host, 8, 1, "", r#"{"name":"premium","priority":10}"#);
        let obj: &str = crate::flow::OBJECTIVE_HEADERS[0];
        let (mut a, _) = send(&host, &w1, 1, "a", &[]);
        let (_b, _) = send(&host, &w2, 2, "b", &[]);
        // w1 holds an older default-band request, w2 a newer one.
        let (c, act) = send(&host, &w1, 3, "c", &[]);
        assert_eq!(act, Action::Pause);
        host.now_ns.set(host.now_ns.get() + 3_000_000);
        let (_d, act) = send(&host, &w2, 4, "d", &[]);
        assert_eq!(
            act,
            Action::Pause,
            "the pool is saturated and w1 has an older request"
        );
        // One slot frees: w2 ticks first but yields to w1's older request.
        serve(&host, &mut a, "200");
        tick(&host, &w2, 1);
        assert!(
            host.resumed.borrow().is_empty(),
            "w2 waited for w1's older request"
        );
        tick(&host, &w1, 1);
        assert_eq!(*host.resumed.borrow(), vec![Some(3)]);
        // A premium request on w1 waits behind nothing of its band, but the
        // pool is full; w2's default-band request must not pass it.
        let (_p, act) = send(&host, &w1, 5, "p", &[(obj, b"premium")]);
        assert_eq!(act, Action::Pause);
        let w2_flow = w2.flow.as_ref().unwrap();
        assert_eq!(w2_flow.waiting(), 1);
        // Capacity for one (c's dispatched request ends): w2 yields to
        // w1's premium band.
        let mut c = c;
        serve(&host, &mut c, "200");
        tick(&host, &w2, 1);
        assert_eq!(
            host.resumed.borrow().len(),
            1,
            "w2 yields to a higher band elsewhere"
        );
        tick(&host, &w1, 1);
        assert_eq!(host.resumed.borrow().last(), Some(&Some(5)));
    }

    #[test]
    fn a_stale_worker_record_does_not_block_the_others() {
        let host = FakeHost::default();
        let w1 = flow_filter(&host, 7, 1, "", "");
        let w2 = flow_filter(&host, 8, 1, "", "");
        let (mut a, _) = send(&host, &w1, 1, "a", &[]);
        let (_b, _) = send(&host, &w1, 2, "b", &[]);
        let (_c, _) = send(&host, &w1, 3, "c", &[]);
        host.now_ns.set(host.now_ns.get() + 1_000_000);
        let (_d, act) = send(&host, &w2, 4, "d", &[]);
        assert_eq!(act, Action::Pause);
        serve(&host, &mut a, "200");
        // w1 stops ticking (stuck or gone); after STALE_MS its record no
        // longer holds w2 back.
        tick(&host, &w2, 5);
        assert!(host.resumed.borrow().is_empty());
        tick(&host, &w2, crate::flow::board::STALE_MS + 1);
        assert_eq!(*host.resumed.borrow(), vec![Some(4)]);
    }

    #[test]
    fn gate_off_sheds_only_sheddable_requests_while_saturated() {
        let host = FakeHost::default();
        flow_filter(
            &host,
            7,
            1,
            "",
            r#"{"name":"batch","priority":-1,"models":["m"]}"#,
        );
        // Same config with the gate off.
        let cfg = String::from_utf8(host.config.borrow().clone()).unwrap();
        *host.config.borrow_mut() = cfg
            .replace(r#""featureGates":["flowControl"],"#, "")
            .into_bytes();
        let w = match configure(&host) {
            Ok(Role::Filter { worker, .. }) => worker,
            _ => panic!("configure"),
        };
        assert_eq!(host.tick_ms.get(), Some(FLUSH_PERIOD_MS));
        // Model "m" is the batch objective's: sheddable.
        let (_a, act) = send(&host, &w, 1, "a", &[]);
        assert_eq!(act, Action::Continue);
        let (_b, act) = send(&host, &w, 2, "b", &[]);
        assert_eq!(act, Action::Continue);
        let (_c, act) = send(&host, &w, 3, "c", &[]);
        assert_eq!(
            act,
            Action::Pause,
            "saturated: the sheddable request gets 429"
        );
        assert_eq!(host.ctx_replies.borrow().last().unwrap().1, 429);
        assert_eq!(metric(&host, "kvroute_flow_shed_sheddable.band.m1"), 1);
    }
}

mod flow_control_edges {
    use super::*;

    fn worker(host: &FakeHost, endpoints: &str, failure: &str) -> Rc<Worker> {
        host.now_ns.set(5_000_000_000);
        *host.config.borrow_mut() = format!(
            r#"{{"endpoints":{endpoints},"featureGates":["flowControl"],
            "flowControl":{{"defaultRequestTTL":"2s","noEndpointRequestTTL":"1s"}},
            "routing":{{"seed":7,"failureMode":"{failure}"}}}}"#
        )
        .into_bytes();
        *host.root_id.borrow_mut() = b"kvroute".to_vec();
        match configure(host) {
            Ok(Role::Filter { worker, .. }) => worker,
            _ => panic!("configure"),
        }
    }

    fn send(host: &FakeHost, w: &Rc<Worker>, id: u32) -> (Stream, Action) {
        host.set_request("POST", "/v1/chat/completions", &[]);
        host.effective.set(None);
        let mut s = Stream::new(Some(w.clone())).with_id(id);
        s.on_request_headers(host, false);
        let body = chat_body("x");
        let n = body.len();
        *host.body.borrow_mut() = body;
        let a = s.on_request_body(host, n, true);
        (s, a)
    }

    #[test]
    fn a_detector_blind_to_every_endpoint_follows_the_failure_mode() {
        // The default utilization-detector and no metrics at all (no
        // collector here): stale counts as saturated, as in llm-d...
        let host = FakeHost::default();
        let w = worker(&host, r#"{"static":["127.0.0.1:1"]}"#, "closed");
        let (_s, a) = send(&host, &w, 1);
        assert_eq!(a, Action::Pause, "closed: it waits");
        host.now_ns.set(host.now_ns.get() + 2_001_000_000);
        host.effective.set(None);
        w.on_tick(&host);
        let r = host.ctx_replies.borrow().last().cloned().unwrap();
        assert_eq!((r.0, r.1), (Some(1), 429), "then 429 at its TTL");
        // ...but failureMode open lets requests through (counted).
        let host = FakeHost::default();
        let w = worker(&host, r#"{"static":["127.0.0.1:1"]}"#, "open");
        let (_s, a) = send(&host, &w, 1);
        assert_eq!(a, Action::Continue);
        assert_eq!(host.gauge("kvroute_flow_detector_blind"), Some(1));
    }

    #[test]
    fn with_no_endpoint_a_request_waits_then_gets_503() {
        let host = FakeHost::default();
        let w = worker(&host, r#"{"fromCluster":{"cluster":"vllm"}}"#, "closed");
        let (mut s, a) = send(&host, &w, 1);
        assert_eq!(a, Action::Pause);
        host.now_ns.set(host.now_ns.get() + 500_000_000);
        host.effective.set(None);
        w.on_tick(&host);
        assert!(
            host.ctx_replies.borrow().is_empty(),
            "within noEndpointRequestTTL"
        );
        host.now_ns.set(host.now_ns.get() + 600_000_000);
        host.effective.set(None);
        w.on_tick(&host);
        let r = host.ctx_replies.borrow().last().cloned().unwrap();
        assert_eq!((r.0, r.1), (Some(1), 503));
        assert!(r.3.contains(&(
            crate::flow::DROPPED_REASON_HEADER.to_string(),
            "rejected-no-endpoints".to_string()
        )));
        assert!(!r.3.iter().any(|(k, _)| k == "retry-after"));
        assert_eq!(host.gauge("kvroute_flow_shed_no_endpoints.band.0"), Some(1));
        s.on_end(&host);
        assert_eq!(w.flow.as_ref().unwrap().waiting(), 0);
    }

    #[test]
    fn with_no_endpoint_a_messages_request_gets_anthropics_overloaded_error() {
        let host = FakeHost::default();
        let w = worker(&host, r#"{"fromCluster":{"cluster":"vllm"}}"#, "closed");
        host.set_request("POST", "/v1/messages", &[]);
        host.effective.set(None);
        let mut s = Stream::new(Some(w.clone())).with_id(1);
        assert_eq!(s.on_request_headers(&host, false), Action::Pause);
        let body = br#"{"model":"m","max_tokens":8,"messages":[{"role":"user","content":"x"}]}"#;
        *host.body.borrow_mut() = body.to_vec();
        assert_eq!(s.on_request_body(&host, body.len(), true), Action::Pause);
        host.now_ns.set(host.now_ns.get() + 1_100_000_000);
        host.effective.set(None);
        w.on_tick(&host);
        let r = host.ctx_replies.borrow().last().cloned().unwrap();
        assert_eq!((r.0, r.1), (Some(1), 503));
        let v: serde_json::Value = serde_json::from_str(&r.2).unwrap();
        assert_eq!(v["type"], "error", "{v}");
        assert_eq!(v["error"]["type"], "overloaded_error", "{v}");
        assert_eq!(v["error"]["message"], "no endpoints available", "{v}");
        assert!(r.3.contains(&(
            crate::flow::DROPPED_REASON_HEADER.to_string(),
            "rejected-no-endpoints".to_string()
        )));
        s.on_end(&host);
    }
}

#[test]
fn the_waiting_gauge_counts_every_worker_s_requests() {
    let host = FakeHost::default();
    host.now_ns.set(5_000_000_000);
    let cfg = |seed: u64| {
        format!(
            r#"{{"endpoints":{{"static":["127.0.0.1:1"]}},"featureGates":["flowControl"],
            "plugins":[{{"type":"concurrency-detector","parameters":{{"maxConcurrency":1}}}}],
            "flowControl":{{"saturationDetector":{{"pluginRef":"concurrency-detector"}}}},
            "routing":{{"seed":{seed}}}}}"#
        )
    };
    let mut workers = Vec::new();
    for seed in [7, 8] {
        *host.config.borrow_mut() = cfg(seed).into_bytes();
        *host.root_id.borrow_mut() = b"kvroute".to_vec();
        match configure(&host) {
            Ok(Role::Filter { worker, .. }) => workers.push(worker),
            _ => panic!("configure"),
        }
    }
    let mut streams = Vec::new();
    for (i, w) in [&workers[0], &workers[0], &workers[1]]
        .into_iter()
        .enumerate()
    {
        host.set_request("POST", "/v1/chat/completions", &[]);
        let mut s = Stream::new(Some(w.clone())).with_id(i as u32 + 1);
        s.on_request_headers(&host, false);
        let body = chat_body("g");
        let n = body.len();
        *host.body.borrow_mut() = body;
        s.on_request_body(&host, n, true);
        streams.push(s);
    }
    // One routed, one waiting in each worker: the gauge says 2.
    assert_eq!(host.gauge("kvroute_flow_waiting.band.0"), Some(2));
}

/// A filter worker whose config lists llm-d's `passthrough-parser` (and the
/// OpenAI parser) in `requestHandler.parsers`, or not.
fn passthrough_filter(listed: bool) -> (FakeHost, Rc<Worker>) {
    let host = FakeHost::default();
    host.now_ns.set(5_000_000_000);
    let handler = if listed {
        r#","requestHandler":{"parsers":[{"pluginRef":"openai-parser"},{"pluginRef":"passthrough-parser"}]}"#
    } else {
        ""
    };
    let base = BASE.replace(
        r#"{"type":"max-score-picker"}]"#,
        r#"{"type":"max-score-picker"},{"type":"openai-parser"},{"type":"passthrough-parser"}]"#,
    );
    *host.config.borrow_mut() =
        format!(r#"{{{base}{handler},"routing":{{"seed":7,"debugHeader":true,"statePath":"/kvroute/state"}}}}"#)
            .into_bytes();
    *host.root_id.borrow_mut() = b"kvroute".to_vec();
    match configure(&host) {
        Ok(Role::Filter { worker, .. }) => (host, worker),
        _ => panic!("not a filter"),
    }
}

/// llm-d's `passthrough-parser`: a request on a path kvroute does not parse
/// is routed at its headers on load alone (its body, if any, is not read;
/// its size is charged as prompt text), holds a charge like any routed
/// request and releases it on every exit; declared but not listed, the
/// parser changes nothing.
#[test]
fn passthrough_routes_unparsed_paths_on_load_alone() {
    let (host, w) = passthrough_filter(true);
    assert!(w.engine.config.routing.passthrough);
    // A GET with no body: routed at once, one request charged, no tokens.
    host.set_request("GET", "/v1/models", &[]);
    let mut s = Stream::new(Some(w.clone()));
    assert_eq!(s.on_request_headers(&host, true), Action::Continue);
    let dest = host
        .header("x-gateway-destination-endpoint")
        .expect("routed at the headers");
    assert!(dest.starts_with("127.0.0.1:"), "{dest}");
    assert_eq!(inflight(&host, &w), (0, 1));
    s.on_response_headers(&host, false);
    s.on_response_body(&host, 10, false);
    assert_eq!(inflight(&host, &w), (0, 1), "released as a streamed answer");
    s.on_response_body(&host, 0, true);
    s.on_end(&host);
    assert_eq!(inflight(&host, &w), (0, 0));

    // A POST with a 4,000-byte body on an unparsed path: its size is the
    // prompt's (4 bytes per token by default); the body is not buffered.
    host.set_request(
        "POST",
        "/v1/audio/transcriptions",
        &[("content-length", b"4000")],
    );
    let mut s = Stream::new(Some(w.clone()));
    assert_eq!(s.on_request_headers(&host, false), Action::Continue);
    assert_eq!(s.on_request_body(&host, 4000, true), Action::Continue);
    assert_eq!(inflight(&host, &w), (1000, 1));
    // Reset before any response: released, nothing left.
    s.on_end(&host);
    assert_eq!(inflight(&host, &w), (0, 0));

    // The parsed paths and the state path are unchanged; a client's own
    // destination header is still stripped first.
    host.set_request("POST", "/v1/chat/completions", &[]);
    let mut s = Stream::new(Some(w.clone()));
    assert_eq!(s.on_request_headers(&host, false), Action::Pause);
    s.on_end(&host);
    host.set_request("GET", "/kvroute/state", &[]);
    let mut s = Stream::new(Some(w.clone()));
    assert_eq!(s.on_request_headers(&host, true), Action::Pause);
    assert_eq!(host.replies.borrow().last().map(|r| r.0), Some(200));
    host.set_request(
        "GET",
        "/health",
        &[("x-gateway-destination-endpoint", b"10.0.0.9:80")],
    );
    let mut s = Stream::new(Some(w.clone()));
    assert_eq!(s.on_request_headers(&host, true), Action::Continue);
    let dest = host.header("x-gateway-destination-endpoint").unwrap();
    assert!(
        dest.starts_with("127.0.0.1:"),
        "the client's pick replaced: {dest}"
    );
    serve(&host, &mut s, "200");
    assert_eq!(inflight(&host, &w), (0, 0));

    // Declared but not listed in requestHandler.parsers: nothing routed.
    let (host, w) = passthrough_filter(false);
    assert!(!w.engine.config.routing.passthrough);
    host.set_request("GET", "/v1/models", &[]);
    let mut s = Stream::new(Some(w.clone()));
    assert_eq!(s.on_request_headers(&host, true), Action::Continue);
    assert_eq!(host.header("x-gateway-destination-endpoint"), None);
    assert_eq!(inflight(&host, &w), (0, 0));
}
/// Body-based routing (`routing.modelHeader`).
mod model_header {
    use super::*;

    const H: &str = "x-kvroute-model";

    /// Headers (with `extra`) and the whole `body` on `path`; returns the
    /// stream and the body callback's action (`None`: not paused at headers).
    fn send(
        host: &FakeHost,
        w: &Rc<Worker>,
        path: &str,
        body: &[u8],
        extra: &[(&str, &[u8])],
    ) -> (Stream, Option<Action>) {
        host.set_request("POST", path, extra);
        let mut s = Stream::new(Some(w.clone()));
        if s.on_request_headers(host, false) != Action::Pause {
            return (s, None);
        }
        *host.body.borrow_mut() = body.to_vec();
        let a = s.on_request_body(host, body.len(), true);
        (s, Some(a))
    }

    #[test]
    fn the_body_s_model_replaces_a_client_s_header() {
        let (host, w) = filter(&format!(r#","modelHeader":"{H}""#));
        let (mut s, a) = send(
            &host,
            &w,
            "/v1/chat/completions",
            &chat_body("q"),
            &[(H, b"other")],
        );
        assert_eq!(a, Some(Action::Continue));
        assert_eq!(host.header(H).as_deref(), Some("m"));
        assert!(
            host.header("x-gateway-destination-endpoint").is_some(),
            "routed too"
        );
        serve(&host, &mut s, "200");
        // Anthropic's Messages API: the same.
        let body =
            br#"{"model":"claude-like","max_tokens":8,"messages":[{"role":"user","content":"x"}]}"#;
        let (_s, a) = send(&host, &w, "/v1/messages", body, &[(H, b"other")]);
        assert_eq!(a, Some(Action::Continue));
        assert_eq!(host.header(H).as_deref(), Some("claude-like"));
    }

    #[test]
    fn a_client_s_header_is_removed_when_the_body_gives_no_model() {
        let (host, w) = filter(&format!(r#","modelHeader":"{H}""#));
        // A body that does not parse (fail-open: passed on unrouted).
        let (_s, a) = send(
            &host,
            &w,
            "/v1/completions",
            b"{not json",
            &[(H, b"spoofed")],
        );
        assert_eq!(a, Some(Action::Continue));
        assert_eq!(host.header(H), None);
        // vLLM's generate API without `model`.
        let body = br#"{"token_ids":[1,2,3],"sampling_params":{"max_tokens":2}}"#;
        let (_s, a) = send(
            &host,
            &w,
            "/inference/v1/generate",
            body,
            &[(H, b"spoofed")],
        );
        assert_eq!(a, Some(Action::Continue));
        assert_eq!(host.header(H), None);
        // A model that is not a plain header value is not copied.
        let body = serde_json::json!({"model":"a\nb","prompt":"x"}).to_string();
        let (_s, _) = send(
            &host,
            &w,
            "/v1/completions",
            body.as_bytes(),
            &[(H, b"spoofed")],
        );
        assert_eq!(host.header(H), None);
        // A path kvroute does not parse: removed at the headers.
        let (_s, a) = send(
            &host,
            &w,
            "/v1/messages/count_tokens",
            b"{}",
            &[(H, b"spoofed")],
        );
        assert_eq!(a, None, "passed on at its headers");
        assert_eq!(host.header(H), None);
        host.set_request("GET", "/v1/models", &[(H, b"spoofed")]);
        assert_eq!(
            Stream::new(Some(w.clone())).on_request_headers(&host, true),
            Action::Continue
        );
        assert_eq!(host.header(H), None);
        assert!(host.replies.borrow().is_empty());
    }

    #[test]
    fn a_client_s_header_that_cannot_be_removed_is_refused() {
        let (host, w) = filter(&format!(r#","modelHeader":"{H}""#));
        host.failing
            .borrow_mut()
            .insert("proxy_remove_header_map_value");
        host.set_request("POST", "/v1/chat/completions", &[(H, b"spoofed")]);
        let mut s = Stream::new(Some(w.clone()));
        assert_eq!(s.on_request_headers(&host, false), Action::Pause);
        assert_eq!(host.replies.borrow().last().unwrap().0, 500);
        // Without the option nothing is removed or set.
        let (host, w) = filter("");
        let (_s, a) = send(
            &host,
            &w,
            "/v1/chat/completions",
            &chat_body("q"),
            &[(H, b"kept")],
        );
        assert_eq!(a, Some(Action::Continue));
        assert_eq!(host.header(H).as_deref(), Some("kept"));
    }

    /// A header write that fails is the host's error, counted; the
    /// request goes on without the header (its client copy is gone).
    #[test]
    fn a_failed_header_write_is_a_host_error() {
        let (host, w) = filter(&format!(r#","modelHeader":"{H}""#));
        host.set_request("POST", "/v1/chat/completions", &[]);
        let mut s = Stream::new(Some(w.clone()));
        assert_eq!(s.on_request_headers(&host, false), Action::Pause);
        host.failing
            .borrow_mut()
            .insert("proxy_replace_header_map_value");
        let body = chat_body("q");
        *host.body.borrow_mut() = body.clone();
        s.on_request_body(&host, body.len(), true);
        assert_eq!(host.header(H), None);
        assert!(count(&host, &w, Counter::HostErrors) >= 1);
    }
}

#[path = "tests_anthropic.rs"]
mod anthropic;
#[path = "session_tests.rs"]
mod session_tests;

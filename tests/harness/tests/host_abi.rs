//! The host itself, proven against the abi-probe fixture module (not
//! kvroute): every rule the kvroute tests lean on is checked here first, so
//! a failure in the kvroute tests points at the module, not at the harness.

use kvroute_harness::artifacts::probe_wasm;
use kvroute_harness::{Cluster, EndOrder, HttpCallReply, VmSpec};
use std::time::Duration;

const VM_ID: &str = "probe";

fn worker(name: &str) -> VmSpec {
    VmSpec::new(
        name,
        &probe_wasm().expect("build abi-probe"),
        VM_ID,
        "probe",
        "{}",
    )
}

fn collector() -> VmSpec {
    VmSpec::new(
        "collector",
        &probe_wasm().expect("build abi-probe"),
        VM_ID,
        "probe-collector",
        "{}",
    )
}

fn shared_u64(c: &Cluster, key: &str) -> u64 {
    c.shared_get_str(VM_ID, key)
        .map(|s| s.parse().expect("decimal counter"))
        .unwrap_or(0)
}

#[test]
fn request_lifecycle_headers_body_and_end() {
    let c = Cluster::new();
    let vm = c.add_vm(worker("w0")).unwrap();
    assert!(vm.vm_started && vm.configured);
    let req = c
        .start_request(
            0,
            &[
                (":method", "POST"),
                (":path", "/v1/completions"),
                ("x-probe-dest", "10.0.0.1:80"),
            ],
            false,
        )
        .unwrap();
    // Paused on headers: nothing upstream yet.
    assert_eq!(c.upstream_headers(req), None);
    c.send_body(req, b"{\"prompt\":", false).unwrap();
    assert_eq!(c.upstream_headers(req), None);
    c.send_body(req, b"\"hi\"}", true).unwrap();
    assert_eq!(
        c.upstream_header(req, "x-probe-count").as_deref(),
        Some("1")
    );
    assert_eq!(
        c.upstream_header(req, "x-probe-body-len").as_deref(),
        Some("15")
    );
    assert_eq!(
        c.upstream_header(req, "x-probe-dest"),
        None,
        "client header stripped"
    );
    assert_eq!(c.stream(req).unwrap().upstream_body, b"{\"prompt\":\"hi\"}");
    c.respond(req, &[b"data: a\n\n", b"data: [DONE]\n\n"])
        .unwrap();
    let s = c.stream(req).unwrap();
    assert!(s.ended && !s.reset);
    assert_eq!(c.downstream_status(req), Some(200));
    let seen = s.downstream_headers.unwrap();
    assert!(seen.iter().any(|(k, _)| k == "x-probe-seen"));
    assert_eq!(shared_u64(&c, "probe/done"), 1);
    assert_eq!(shared_u64(&c, "probe/log"), 1);
    assert_eq!(c.metric("probe_requests"), Some(1));
    assert!(c.open_streams(0).is_empty());
}

#[test]
fn pause_without_allow_flag_is_a_full_stop() {
    let c = Cluster::new();
    c.add_vm(worker("w0").allow_on_headers_stop_iteration(false))
        .unwrap();
    let req = c
        .start_request(
            0,
            &[(":method", "POST"), (":path", "/v1/completions")],
            false,
        )
        .unwrap();
    c.send_body(req, b"{}", true).unwrap();
    let s = c.stream(req).unwrap();
    assert!(s.stopped_all && s.decoding_paused);
    assert_eq!(s.held_chunks.len(), 1, "body held by Envoy, not delivered");
    assert_eq!(s.request_body, b"", "the module never saw the body");
    let err = c.respond_headers(req, 200, &[], true).unwrap_err();
    assert!(err.to_string().contains("never went upstream"), "{err}");
    c.client_abort(req).unwrap();
    assert_eq!(shared_u64(&c, "probe/done"), 1);
    assert_eq!(shared_u64(&c, "probe/count"), 0);
}

#[test]
fn local_reply_goes_through_the_encoder_path() {
    let c = Cluster::new();
    c.add_vm(worker("w0")).unwrap();
    let req = c.post(0, "/deny", b"{}").unwrap();
    let s = c.stream(req).unwrap();
    assert!(s.ended);
    assert_eq!(c.downstream_status(req), Some(403));
    assert_eq!(s.downstream_body, b"denied by probe");
    assert_eq!(s.local_reply.as_ref().map(|r| r.status), Some(403));
    let h = s.downstream_headers.unwrap();
    assert!(h.iter().any(|(k, v)| k == "x-probe" && v == "denied"));
    assert!(
        h.iter().any(|(k, _)| k == "x-probe-seen"),
        "own encoder saw it"
    );
    assert_eq!(s.upstream_request_headers, None);
    assert_eq!(shared_u64(&c, "probe/done"), 1);
}

#[test]
fn request_header_write_after_forwarding_is_refused_and_sdk_traps() {
    let c = Cluster::new();
    c.add_vm(worker("w0")).unwrap();
    let req = c
        .start_request(0, &[(":method", "POST"), (":path", "/late-write")], false)
        .unwrap();
    assert!(c.upstream_headers(req).is_some());
    let err = c.send_body(req, b"x", true).unwrap_err().to_string();
    assert!(
        err.starts_with("module: VM w0 trap in proxy_on_request_body"),
        "{err}"
    );
    assert_eq!(c.late_header_writes(), 1);
    assert!(c.vm_failure(0).is_some());
    // A failed VM is not called again.
    let again = c.post(0, "/v1/completions", b"{}").unwrap_err().to_string();
    assert!(again.contains("failed earlier"), "{again}");
}

#[test]
fn buffered_body_over_the_limit_is_413() {
    let c = Cluster::new();
    c.add_vm(worker("w0").buffer_limit_bytes(1000)).unwrap();
    let req = c
        .start_request(
            0,
            &[(":method", "POST"), (":path", "/v1/completions")],
            false,
        )
        .unwrap();
    c.send_body(req, &[b'a'; 600], false).unwrap();
    assert!(!c.is_ended(req));
    c.send_body(req, &[b'a'; 600], false).unwrap();
    assert!(c.is_ended(req));
    assert_eq!(c.downstream_status(req), Some(413));
    assert_eq!(
        c.stream(req).unwrap().local_reply,
        None,
        "Envoy's reply, not the module's"
    );
    assert_eq!(shared_u64(&c, "probe/done"), 1);
}

#[test]
fn stream_without_buffering_passes_chunks() {
    let c = Cluster::new();
    c.add_vm(worker("w0")).unwrap();
    let req = c
        .start_request(0, &[(":method", "POST"), (":path", "/stream")], false)
        .unwrap();
    c.send_body(req, b"ab", false).unwrap();
    c.send_body(req, b"cd", true).unwrap();
    let s = c.stream(req).unwrap();
    assert_eq!(s.upstream_body, b"abcd");
    assert!(s.request_complete_upstream);
    let err = c.send_body(req, b"more", true).unwrap_err().to_string();
    assert!(
        err.starts_with("harness misuse: body after the end"),
        "{err}"
    );
}

#[test]
fn two_vms_at_the_same_instant_cas_conflict_loses_nothing() {
    let c = Cluster::new();
    c.add_vm(worker("w0")).unwrap();
    c.add_vm(worker("w1")).unwrap();
    // The counter exists: both writers go through the CAS path.
    c.shared_set(VM_ID, "probe/count", b"0");
    let other = std::rc::Rc::new(std::cell::RefCell::new(None));
    let slot = other.clone();
    // w0 reads probe/count; before its write lands, w1 runs a whole request.
    c.before_shared_set(0, "probe/count", move |c| {
        *slot.borrow_mut() = Some(c.post(1, "/v1/completions", b"{}").unwrap());
    });
    let first = c.post(0, "/v1/completions", b"{}").unwrap();
    let second = other.borrow().expect("hook ran");
    assert_eq!(c.pending_hooks(), 0);
    assert_eq!(
        c.upstream_header(second, "x-probe-count").as_deref(),
        Some("1")
    );
    assert_eq!(
        c.upstream_header(first, "x-probe-count").as_deref(),
        Some("2")
    );
    assert_eq!(shared_u64(&c, "probe/count"), 2);
    assert_eq!(shared_u64(&c, "probe/retries"), 1);
    assert!(c.cas_mismatches() >= 1);
}

/// Envoy's rule that a set on a missing key ignores the CAS means two
/// first writers of a key can lose an update even with a retry loop. The
/// probe has that bug on purpose; this test shows the harness exposes it.
#[test]
fn first_insert_race_loses_an_update_as_in_envoy() {
    let c = Cluster::new();
    c.add_vm(worker("w0")).unwrap();
    c.add_vm(worker("w1")).unwrap();
    c.before_shared_set(0, "probe/count", move |c| {
        c.post(1, "/v1/completions", b"{}").unwrap();
    });
    c.post(0, "/v1/completions", b"{}").unwrap();
    assert_eq!(shared_u64(&c, "probe/count"), 1, "two requests, one count");
    assert_eq!(shared_u64(&c, "probe/retries"), 0);
}

#[test]
fn forced_cas_mismatches_are_retried() {
    let c = Cluster::new();
    c.add_vm(worker("w0")).unwrap();
    c.post(0, "/v1/completions", b"{}").unwrap();
    c.force_cas_mismatch(VM_ID, "probe/count", 3);
    let req = c.post(0, "/v1/completions", b"{}").unwrap();
    assert_eq!(
        c.upstream_header(req, "x-probe-count").as_deref(),
        Some("2")
    );
    assert_eq!(shared_u64(&c, "probe/retries"), 3);
}

#[test]
fn ticks_drive_http_calls_with_scripted_answers() {
    let c = Cluster::new();
    c.add_vm(collector()).unwrap();
    let script = std::rc::Rc::new(std::cell::RefCell::new(HttpCallReply::ok(
        "vllm:num_requests_running 3\n",
    )));
    let s = script.clone();
    c.set_http_responder(move |req| {
        assert_eq!(req.cluster, "metrics");
        assert_eq!(req.path(), "/metrics");
        assert_eq!(req.timeout_ms, 500);
        s.borrow().clone()
    });
    c.advance(Duration::from_millis(999)).unwrap();
    assert_eq!(shared_u64(&c, "probe/ticks"), 0, "period is 1000 ms");
    c.advance(Duration::from_millis(1)).unwrap();
    assert_eq!(shared_u64(&c, "probe/ticks"), 1);
    let last = c.shared_get_str(VM_ID, "probe/last_call").unwrap();
    assert!(
        last.contains("status=200") && last.contains("body=28"),
        "{last}"
    );

    // Slower than the timeout: Envoy's 504, at the timeout.
    *script.borrow_mut() = HttpCallReply::ok("late").delayed(900);
    c.advance(Duration::from_millis(1000)).unwrap();
    assert_eq!(c.pending_http_calls().len(), 1);
    c.advance(Duration::from_millis(499)).unwrap();
    assert_eq!(shared_u64(&c, "probe/calls_done"), 1);
    c.advance(Duration::from_millis(1)).unwrap();
    let last = c.shared_get_str(VM_ID, "probe/last_call").unwrap();
    assert!(last.contains("status=504"), "{last}");
    assert_eq!(
        c.shared_get_str(VM_ID, "probe/last_body").unwrap(),
        "upstream request timeout"
    );

    // A 500, then a reset (no headers at all), then garbage bytes.
    *script.borrow_mut() = HttpCallReply::status(500, "boom");
    c.advance(Duration::from_millis(500)).unwrap();
    assert!(c
        .shared_get_str(VM_ID, "probe/last_call")
        .unwrap()
        .contains("status=500"));
    *script.borrow_mut() = HttpCallReply::Reset { after_ms: 10 };
    c.advance(Duration::from_millis(1000)).unwrap();
    assert_eq!(
        c.pending_http_calls().len(),
        1,
        "the reset comes 10 ms after the tick"
    );
    c.advance(Duration::from_millis(10)).unwrap();
    let last = c.shared_get_str(VM_ID, "probe/last_call").unwrap();
    assert!(last.contains("status=none headers=0 body=0"), "{last}");
    *script.borrow_mut() = HttpCallReply::ok(vec![0xff, 0x00, 0xfe]);
    c.advance(Duration::from_millis(1000)).unwrap();
    assert_eq!(
        c.shared_get(VM_ID, "probe/last_body").unwrap(),
        vec![0xff, 0x00, 0xfe]
    );

    // An unknown cluster is refused at dispatch.
    c.set_known_clusters(&["other"]);
    c.tick(0).unwrap();
    assert_eq!(
        c.shared_get_str(VM_ID, "probe/dispatch_error").as_deref(),
        Some("BadArgument")
    );
}

#[test]
fn queue_wakes_the_registering_vm() {
    let c = Cluster::new();
    c.add_vm(collector()).unwrap();
    c.add_vm(worker("w0")).unwrap();
    c.post(1, "/v1/completions", b"enqueue:hello").unwrap();
    assert_eq!(
        c.shared_get_str(VM_ID, "probe/queue_last").as_deref(),
        Some("hello")
    );
    assert_eq!(shared_u64(&c, "probe/queue_items"), 1);
}

#[test]
fn rejected_config_then_good_config() {
    let c = Cluster::new();
    let started = c
        .add_vm(VmSpec::new(
            "w0",
            &probe_wasm().unwrap(),
            VM_ID,
            "probe",
            "{\"mode\":\"bad\"}",
        ))
        .unwrap();
    assert!(started.vm_started);
    assert!(!started.configured);
    assert_eq!(c.logs_matching("field `mode`").len(), 1);
    assert!(c.configure(0, b"{}").unwrap());
    let req = c.post(0, "/v1/completions", b"{}").unwrap();
    assert_eq!(
        c.upstream_header(req, "x-probe-count").as_deref(),
        Some("1")
    );
}

#[test]
fn both_end_orders_call_each_end_callback_once() {
    for order in [EndOrder::DoneLogDelete, EndOrder::LogDoneDelete] {
        let c = Cluster::new();
        c.set_end_order(order);
        c.add_vm(worker("w0")).unwrap();
        for _ in 0..3 {
            let req = c.post(0, "/v1/completions", b"{}").unwrap();
            c.respond(req, &[b"x"]).unwrap();
        }
        assert_eq!(shared_u64(&c, "probe/done"), 3, "{order:?}");
        assert_eq!(shared_u64(&c, "probe/log"), 3, "{order:?}");
    }
}

#[test]
fn upstream_failures_before_and_after_first_byte() {
    let c = Cluster::new();
    c.add_vm(worker("w0")).unwrap();
    let before = c.post(0, "/v1/completions", b"{}").unwrap();
    c.upstream_reset(before).unwrap();
    assert_eq!(c.downstream_status(before), Some(503));
    assert!(c
        .stream(before)
        .unwrap()
        .downstream_headers
        .unwrap()
        .iter()
        .any(|(k, _)| k == "x-probe-seen"));
    let after = c.post(0, "/v1/completions", b"{}").unwrap();
    c.respond_headers(after, 200, &[], false).unwrap();
    c.respond_body(after, b"data: a", false).unwrap();
    c.route_timeout(after).unwrap();
    let s = c.stream(after).unwrap();
    assert!(s.ended && s.reset && !s.response_complete);
    let timeout = c.post(0, "/v1/completions", b"{}").unwrap();
    c.route_timeout(timeout).unwrap();
    assert_eq!(c.downstream_status(timeout), Some(504));
    assert_eq!(shared_u64(&c, "probe/done"), 3);
    // Misuse is reported as such.
    let paused = c
        .start_request(
            0,
            &[(":method", "POST"), (":path", "/v1/completions")],
            false,
        )
        .unwrap();
    let err = c.upstream_reset(paused).unwrap_err().to_string();
    assert!(err.starts_with("harness misuse"), "{err}");
}

#[test]
fn foreign_functions_and_properties() {
    let c = Cluster::new();
    c.add_vm(worker("w0")).unwrap();
    let req = c
        .start_request(0, &[(":method", "GET"), (":path", "/ff")], true)
        .unwrap();
    assert_eq!(
        c.upstream_header(req, "x-probe-ff").as_deref(),
        Some("NotFound")
    );
    c.register_foreign_function("probe_ff", |args| {
        let mut out = b"pong:".to_vec();
        out.extend_from_slice(args);
        Ok(out)
    });
    let req = c
        .start_request(0, &[(":method", "GET"), (":path", "/ff")], true)
        .unwrap();
    assert_eq!(
        c.upstream_header(req, "x-probe-ff").as_deref(),
        Some("pong:ping")
    );
    // plugin_root_id reached the module: it chose the HTTP role.
    assert_eq!(c.logs_matching("role probe vm_config").len(), 1);
}

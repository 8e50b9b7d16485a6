//! Test 5: the collector over scripted upstreams: /metrics parsing from the
//! real vLLM capture, stale / garbage / timeout handling, endpoint discovery
//! changes, and orphan reaping.

use crate::support::*;
use kvroute_harness::{Cluster, HttpCallReply, HttpCallRequest};
use kvroute_shared_state::endpoints::EndpointTable;
use kvroute_shared_state::metrics::MetricsTable;
use kvroute_shared_state::{ENDPOINTS_KEY, METRICS_KEY};
use std::cell::RefCell;
use std::rc::Rc;
use std::time::Duration;

fn capture() -> Vec<u8> {
    let path =
        kvroute_harness::artifacts::repo_root().join("testdata/vllm/metrics-vllm-0.32-cpu.txt");
    std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn metrics(c: &Cluster) -> (EndpointTable, MetricsTable) {
    let table = c
        .shared_get(VM_ID, ENDPOINTS_KEY)
        .and_then(|b| EndpointTable::decode(&b))
        .expect("endpoint table");
    let m = MetricsTable::decode(c.shared_get(VM_ID, METRICS_KEY).as_deref());
    (table, m)
}

#[derive(Clone)]
enum Upstream {
    Capture,
    Garbage,
    Hang,
    Status500,
}

fn metrics_config() -> String {
    config(serde_json::json!({"collector": {
        "metricsCluster": "vllm", "metricsPollIntervalMs": 1000, "metricsTimeoutMs": 500,
        "metricsStaleAfterMs": 5000, "modelsPollIntervalMs": 0
    }}))
}

#[test]
fn metrics_poll_parse_garbage_timeout_and_staleness() {
    let c = fleet(1, &metrics_config());
    let mode = Rc::new(RefCell::new(Upstream::Capture));
    let seen: Rc<RefCell<Vec<HttpCallRequest>>> = Rc::default();
    let (m2, s2) = (mode.clone(), seen.clone());
    let body = capture();
    c.set_http_responder(move |call| {
        s2.borrow_mut().push(call.clone());
        match &*m2.borrow() {
            Upstream::Capture => HttpCallReply::ok(body.clone()),
            Upstream::Garbage => HttpCallReply::ok(b"\xff\xfe not prometheus {{{".to_vec()),
            Upstream::Hang => HttpCallReply::Hang,
            Upstream::Status500 => HttpCallReply::status(500, "boom"),
        }
    });
    c.advance(Duration::from_millis(1000)).unwrap();
    let calls = seen.borrow().clone();
    assert!(!calls.is_empty(), "no /metrics poll after one interval");
    assert!(calls
        .iter()
        .all(|r| r.cluster == "vllm" && r.path() == "/metrics"));
    assert!(calls.iter().all(|r| r.timeout_ms == 500));
    c.advance(Duration::from_millis(10)).unwrap();
    let (table, m) = metrics(&c);
    for e in &table.endpoints {
        let s = m
            .get(e.slot, e.generation)
            .unwrap_or_else(|| panic!("no metrics for {}", e.address));
        assert!(s.ok_at_ms > 0 && s.failures == 0, "{}: {s:?}", e.address);
        assert!(
            s.block_size > 0 && s.num_gpu_blocks > 0,
            "cache_config_info parsed: {s:?}"
        );
    }
    let good = m.clone();

    for (bad, name) in [
        (Upstream::Garbage, "garbage"),
        (Upstream::Status500, "500"),
        (Upstream::Hang, "timeout"),
    ] {
        *mode.borrow_mut() = bad;
        c.advance(Duration::from_millis(1600)).unwrap();
        let (table, m) = metrics(&c);
        for e in &table.endpoints {
            let s = m.get(e.slot, e.generation).unwrap();
            let old = good.get(e.slot, e.generation).unwrap();
            assert!(s.failures >= 1, "{name}: failure not counted: {s:?}");
            assert_eq!(s.ok_at_ms, old.ok_at_ms, "{name}: last good time moved");
            assert_eq!(
                s.block_size, old.block_size,
                "{name}: old values must be kept"
            );
        }
        assert!(c.vm_failure(0).is_none(), "{name}");
    }
    // Long without a good poll: stale.
    let now_ms = c.now_ns() / 1_000_000;
    let (table, m) = metrics(&c);
    for e in &table.endpoints {
        assert!(!m.get(e.slot, e.generation).unwrap().is_fresh(now_ms, 5000));
    }
    // Requests still route on in-flight counters alone (for the model the
    // capture's server serves: the model filter remembers it).
    let body = serde_json::json!({"model": "tiny", "prompt": "metrics are dead", "max_tokens": 16});
    let req = c
        .post(1, "/v1/completions", body.to_string().as_bytes())
        .unwrap();
    assert!(primary(&c, req).is_some());
}

fn admin_body(hosts: &[(&str, &str)]) -> Vec<u8> {
    let hosts: Vec<serde_json::Value> = hosts
        .iter()
        .map(|(addr, health)| {
            let (ip, port) = addr.rsplit_once(':').unwrap();
            serde_json::json!({
                "address": {"socket_address": {"address": ip, "port_value": port.parse::<u32>().unwrap()}},
                "health_status": {"eds_health_status": health}
            })
        })
        .collect();
    serde_json::json!({"cluster_statuses": [
        {"name": "envoy_admin", "host_statuses": []},
        {"name": "vllm", "host_statuses": hosts}
    ]})
    .to_string()
    .into_bytes()
}

#[test]
fn discovery_follows_cluster_membership() {
    let cfg = config(serde_json::json!({"endpoints": {"fromCluster": {
        "cluster": "vllm", "adminCluster": "envoy_admin", "refreshMs": 1000
    }}}));
    let c = fleet(1, &cfg);
    let members = Rc::new(RefCell::new(admin_body(&[
        ("10.1.0.1:8000", "HEALTHY"),
        ("10.1.0.2:8000", "HEALTHY"),
    ])));
    let m2 = members.clone();
    c.set_http_responder(move |call| {
        if call.cluster == "envoy_admin" && call.path().starts_with("/clusters") {
            HttpCallReply::ok(m2.borrow().clone())
        } else {
            HttpCallReply::status(404, "")
        }
    });
    // Before discovery: nothing to route to (fail-open, no header).
    let early = c
        .post(1, "/v1/completions", &completion("early", false))
        .unwrap();
    assert_eq!(primary(&c, early), None);
    c.advance(Duration::from_millis(1100)).unwrap();
    let addrs = |c: &Cluster| -> Vec<(String, bool)> {
        let t = c
            .shared_get(VM_ID, ENDPOINTS_KEY)
            .and_then(|b| EndpointTable::decode(&b))
            .unwrap_or_default();
        let mut v: Vec<_> = t
            .endpoints
            .iter()
            .map(|e| (e.address.clone(), e.healthy))
            .collect();
        v.sort();
        v
    };
    assert_eq!(
        addrs(&c),
        vec![
            ("10.1.0.1:8000".into(), true),
            ("10.1.0.2:8000".into(), true)
        ]
    );
    let req = c
        .post(1, "/v1/completions", &completion("discovered", false))
        .unwrap();
    let p = primary(&c, req).expect("routed after discovery");
    assert!(p.starts_with("10.1.0."));
    // One host goes unhealthy, one is added, one removed.
    *members.borrow_mut() =
        admin_body(&[("10.1.0.2:8000", "UNHEALTHY"), ("10.1.0.3:8000", "HEALTHY")]);
    c.advance(Duration::from_millis(1000)).unwrap();
    let now = addrs(&c);
    assert!(now.contains(&("10.1.0.3:8000".into(), true)), "{now:?}");
    assert!(
        !now.iter().any(|(a, _)| a == "10.1.0.1:8000"),
        "removed host stays: {now:?}"
    );
    for i in 0..10 {
        let r = c
            .post(
                1,
                "/v1/completions",
                &completion(&format!("after change {i}"), false),
            )
            .unwrap();
        assert_eq!(
            primary(&c, r).as_deref(),
            Some("10.1.0.3:8000"),
            "only the healthy host"
        );
    }
    // Garbage from the admin keeps the last membership.
    *members.borrow_mut() = b"{not json".to_vec();
    c.advance(Duration::from_millis(1000)).unwrap();
    assert_eq!(addrs(&c), now);
}

#[test]
fn orphaned_charges_are_reaped_once() {
    let cfg = config(serde_json::json!({"collector": {"reapAfterMs": 1000}}));
    let c = fleet(1, &cfg);
    let orphan = c
        .post(
            1,
            "/v1/completions",
            &completion(&prompt("orphan", 500), false),
        )
        .unwrap();
    assert_eq!(total_inflight(&c).1, 1);
    // The request never ends (a lost on_done in a real proxy would look so).
    c.advance(Duration::from_secs(5)).unwrap();
    assert_eq!(
        total_inflight(&c),
        (0, 0),
        "the reaper did not remove the orphan"
    );
    assert_eq!(stat(&c, "kvroute_reaped_requests"), 1);
    // A fresh request, then the orphan's late end must not eat its charge.
    let fresh = c
        .post(
            1,
            "/v1/completions",
            &completion(&prompt("orphan", 500), false),
        )
        .unwrap();
    let target = primary(&c, fresh).unwrap();
    let charge = inflight_of(&c, &target);
    c.client_abort(orphan).unwrap();
    assert_eq!(
        inflight_of(&c, &target),
        charge,
        "a late release after reaping hit another request"
    );
    c.client_abort(fresh).unwrap();
    assert_eq!(total_inflight(&c), (0, 0));
}

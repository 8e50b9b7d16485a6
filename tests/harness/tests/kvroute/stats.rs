//! The module's Envoy stats beyond the counters (`lifecycle::telemetry`):
//! histograms reach the host only on the filter's tick, the collector's
//! gauges follow the shared tables, tagged by slot.

use crate::support::*;
use std::time::Duration;

#[test]
fn histograms_and_gauges_reach_the_host() {
    let c = fleet(
        2,
        &config(serde_json::json!({"sharedState": {"indexBudgetBytes": 65536}})),
    );
    c.advance(Duration::from_millis(600)).unwrap();
    assert_eq!(c.metric("kvroute_collector_leader"), Some(1));
    assert_eq!(c.metric("kvroute_index_budget_bytes"), Some(65536));
    let shared = prompt("stats system prompt", 600);
    for i in 0..32 {
        let req = c
            .post(
                1 + i % 2,
                "/v1/completions",
                &completion(&format!("{shared} q{i}"), false),
            )
            .unwrap();
        assert!(primary(&c, req).is_some(), "request {i} routed");
        c.respond(req, &[b"{}"]).unwrap();
    }
    // Sampled in the VMs, nothing recorded yet.
    assert_eq!(c.metric_samples("kvroute_affinity_percent").unwrap_or(0), 0);
    let held = c
        .post(
            1,
            "/v1/completions",
            &completion(&format!("{shared} held"), false),
        )
        .unwrap();
    let address = primary(&c, held).unwrap();
    let slot = ENDPOINTS.iter().position(|a| *a == address).unwrap();
    c.advance(Duration::from_millis(1100)).unwrap();
    // 33 routed: each one an affinity sample; 16 per worker timed 1 each.
    assert_eq!(c.metric_samples("kvroute_affinity_percent"), Some(33));
    assert_eq!(c.metric_samples("kvroute_decision_time_us"), Some(2));
    let gauge = |base: &str, s: usize| c.metric(&format!("{base}.slot.{s}"));
    assert_eq!(gauge("kvroute_endpoint_inflight_requests", slot), Some(1));
    assert!(gauge("kvroute_endpoint_inflight_tokens", slot).unwrap() > 0);
    for other in (0..3).filter(|s| *s != slot) {
        assert_eq!(gauge("kvroute_endpoint_inflight_requests", other), Some(0));
    }
    assert_eq!(c.metric("kvroute_endpoints"), Some(3));
    let used = c.metric("kvroute_index_used_bytes").unwrap();
    assert!(used > 0 && used <= 65536, "{used}");
    c.respond(held, &[b"{}"]).unwrap();
    c.advance(Duration::from_millis(1100)).unwrap();
    assert_eq!(gauge("kvroute_endpoint_inflight_requests", slot), Some(0));
    assert_eq!(gauge("kvroute_endpoint_inflight_tokens", slot), Some(0));
}

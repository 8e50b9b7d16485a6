use super::board::{Board, MAX_RECORDS, STALE_MS};
use super::config::{duration_ms, quantity};
use super::queue::{BandLoad, Entry, Queue};
use super::*;
use crate::config::Config;
use crate::scheduling::EndpointMetrics;
use serde_json::json;

fn entry(id: u32, band: usize, flow: &str, at: u64, ttl: u64) -> Entry<()> {
    Entry {
        id,
        band,
        flow: flow.to_string(),
        enqueued_ms: at,
        deadline_ms: at + ttl,
        bytes: 10,
        seq: 0,
        item: (),
    }
}

fn order(q: &mut Queue<()>) -> Vec<u32> {
    std::iter::from_fn(|| q.pop_head().map(|e| e.id)).collect()
}

#[test]
fn bands_go_in_priority_order_then_fcfs() {
    let mut q = Queue::new(&[(Fairness::GlobalStrict, Ordering::Fcfs); 2]);
    q.push(entry(1, 1, "a", 1, 100));
    q.push(entry(2, 0, "b", 2, 100));
    q.push(entry(3, 1, "b", 3, 100));
    q.push(entry(4, 0, "a", 4, 100));
    assert_eq!(
        q.loads()[1],
        BandLoad {
            requests: 2,
            bytes: 20,
            oldest_ms: 1
        }
    );
    assert_eq!(order(&mut q), vec![2, 4, 1, 3]);
    assert!(q.is_empty());
}

#[test]
fn round_robin_gives_each_flow_a_turn() {
    let mut q = Queue::new(&[(Fairness::RoundRobin, Ordering::Fcfs)]);
    for (i, f) in ["a", "a", "a", "b", "c", "b"].iter().enumerate() {
        q.push(entry(i as u32, 0, f, i as u64, 100));
    }
    // a's first, then b, c, then a, b, then a.
    assert_eq!(order(&mut q), vec![0, 3, 4, 1, 5, 2]);
    // Global strict over the same arrivals: plain arrival order.
    let mut q = Queue::new(&[(Fairness::GlobalStrict, Ordering::Fcfs)]);
    for (i, f) in ["a", "a", "a", "b", "c", "b"].iter().enumerate() {
        q.push(entry(i as u32, 0, f, i as u64, 100));
    }
    assert_eq!(order(&mut q), vec![0, 1, 2, 3, 4, 5]);
}

#[test]
fn edf_serves_the_earliest_deadline_and_removal_keeps_the_counts() {
    let mut q = Queue::new(&[(Fairness::GlobalStrict, Ordering::Edf)]);
    q.push(entry(1, 0, "a", 0, 500));
    q.push(entry(2, 0, "a", 1, 50));
    q.push(entry(3, 0, "b", 2, 10));
    assert_eq!(q.head().map(|e| e.id), Some(3));
    assert_eq!(q.remove(3).map(|e| e.id), Some(3));
    assert!(q.remove(3).is_none());
    assert_eq!(q.len(), 2);
    let gone = q.take_if(|e| e.deadline_ms <= 100);
    assert_eq!(gone.iter().map(|e| e.id).collect::<Vec<_>>(), vec![2]);
    assert_eq!(
        q.loads()[0],
        BandLoad {
            requests: 1,
            bytes: 10,
            oldest_ms: 0
        }
    );
    assert_eq!(order(&mut q), vec![1]);
}

#[test]
fn the_board_is_bounded_and_ignores_stale_records() {
    let mut b = Board::default();
    let load = |n| {
        vec![BandLoad {
            requests: n,
            bytes: n * 10,
            oldest_ms: 5,
        }]
    };
    for w in 0..(MAX_RECORDS as u64 + 20) {
        b.put(w, 1_000 + w, &load(1));
        let bytes = b.encode();
        assert!(
            bytes.len() <= 2 + MAX_RECORDS * (17 + 20),
            "{}",
            bytes.len()
        );
        assert_eq!(Board::decode(Some(&bytes)), b);
    }
    assert_eq!(b.records.len(), MAX_RECORDS);
    // The others' load: fresh records only, this worker's left out.
    let now = 1_000 + MAX_RECORDS as u64 + 19;
    let o = b.others(MAX_RECORDS as u64 + 19, now, 1);
    assert_eq!(o[0].requests, MAX_RECORDS as u64 - 1);
    assert_eq!(b.others(0, now + STALE_MS + 100, 1)[0].requests, 0);
    // An empty record is removed.
    b.put(30, now, &load(0));
    assert!(b.records.iter().all(|r| r.worker != 30));
    // Garbage decodes to an empty board.
    assert_eq!(Board::decode(Some(&[1, 5, 0, 0])), Board::default());
    assert_eq!(Board::decode(Some(&[9])), Board::default());
}

fn metrics(waiting: f64, running: f64, kv: f64) -> Option<EndpointMetrics> {
    Some(EndpointMetrics {
        waiting_requests: waiting,
        running_requests: running,
        kv_cache_usage: kv,
        kv_capacity_tokens: 0,
    })
}

#[test]
fn utilization_is_llm_d_s_mean_score_with_our_requests_since_the_poll() {
    let d = Detector::default();
    let idle = PoolEndpoint {
        inflight_requests: 0,
        inflight_tokens: 0,
        metrics: metrics(0.0, 0.0, 0.1),
        ..PoolEndpoint::default()
    };
    let queued = PoolEndpoint {
        inflight_requests: 0,
        inflight_tokens: 0,
        metrics: metrics(10.0, 4.0, 0.5),
        ..PoolEndpoint::default()
    };
    let stale = PoolEndpoint {
        inflight_requests: 0,
        inflight_tokens: 0,
        metrics: None,
        ..PoolEndpoint::default()
    };
    let level = |eps: &[PoolEndpoint]| match d.pool(eps) {
        Pool::Level { saturation, .. } => saturation,
        Pool::NoEndpoints => f64::NAN,
    };
    assert!((level(&[idle, queued]) - (0.125 + 2.0) / 2.0).abs() < 1e-9);
    assert!((level(&[idle, stale]) - (0.125 + 1.0) / 2.0).abs() < 1e-9);
    // 9 of ours in flight where 4 ran at the poll: 5 taken as waiting.
    let ours = PoolEndpoint {
        inflight_requests: 9,
        inflight_tokens: 0,
        metrics: metrics(0.0, 4.0, 0.0),
        ..PoolEndpoint::default()
    };
    assert!((level(&[ours]) - 1.0).abs() < 1e-9);
    assert_eq!(d.pool(&[]), Pool::NoEndpoints);
    assert_eq!(
        d.pool(&[stale]),
        Pool::Level {
            saturation: 1.0,
            blind: true
        }
    );
    let c = Detector::Concurrency {
        tokens: false,
        max_requests: 4,
        max_tokens: 1,
        headroom: 0.0,
    };
    let busy = PoolEndpoint {
        inflight_requests: 6,
        inflight_tokens: 0,
        metrics: None,
        ..PoolEndpoint::default()
    };
    assert_eq!(
        c.pool(&[busy, stale]),
        Pool::Level {
            saturation: 0.75,
            blind: false
        }
    );
}

#[test]
fn quantities_and_durations_read_as_kubernetes_writes_them() {
    for (v, want) in [
        (json!("1k"), 1000),
        (json!("10Gi"), 10 << 30),
        (json!(500), 500),
        (json!("1.5M"), 1_500_000),
        (json!("0"), 0),
    ] {
        assert_eq!(quantity(&v, "x").unwrap(), want, "{v}");
    }
    for v in [json!("-1"), json!("1x"), json!(-3), json!(true), json!("k")] {
        assert!(quantity(&v, "x").is_err(), "{v}");
    }
    for (v, want) in [
        ("30s", 30_000),
        ("1m30s", 90_000),
        ("1500ms", 1_500),
        ("0s", 0),
        ("2h", 7_200_000),
        ("10us", 1),
    ] {
        assert_eq!(duration_ms(&json!(v), "x").unwrap(), want, "{v}");
    }
    for v in [json!("30"), json!("-1s"), json!("1d"), json!(5), json!("")] {
        assert!(duration_ms(&v, "x").is_err(), "{v}");
    }
}

const PROFILE: &str = r#""endpoints":{"static":["127.0.0.1:1"]},"plugins":[{"type":"queue-scorer"},{"type":"max-score-picker"}DECL],
  "schedulingProfiles":[{"name":"d","plugins":[{"pluginRef":"queue-scorer"},{"pluginRef":"max-score-picker"}]}]"#;

fn cfg(decl: &str, rest: &str) -> Result<Config, crate::config::ConfigError> {
    let doc = format!("{{{},{rest}}}", PROFILE.replace("DECL", decl));
    Config::from_json(doc.as_bytes())
}

#[test]
fn llm_d_s_flow_control_guide_config_loads_as_written() {
    // The llm-d flow-control guide's shape (its plugins and bands).
    let c = cfg(
        r#",{"type":"round-robin-fairness-policy"},{"type":"fcfs-ordering-policy"},
            {"type":"concurrency-detector","parameters":{"maxConcurrency":132,"concurrencyMode":"requests","headroom":0.0}}"#,
        r#""featureGates":["flowControl"],
           "flowControl":{"maxBytes":"10Gi","maxRequests":"1k","defaultRequestTTL":"60s",
             "saturationDetector":{"pluginRef":"concurrency-detector"},
             "priorityBands":[
               {"priority":100,"maxRequests":"500","fairnessPolicyRef":"round-robin-fairness-policy","orderingPolicyRef":"fcfs-ordering-policy"},
               {"priority":0,"maxRequests":"200","fairnessPolicyRef":"round-robin-fairness-policy","orderingPolicyRef":"fcfs-ordering-policy"},
               {"priority":-10,"maxRequests":"50","fairnessPolicyRef":"round-robin-fairness-policy","orderingPolicyRef":"fcfs-ordering-policy"}]},
           "inferenceObjectives":[{"name":"premium-traffic","priority":100},{"name":"standard-traffic","priority":0},
             {"name":"best-effort-traffic","priority":-10},{"name":"tuned","priority":5,"models":["m"]}]"#,
    )
    .unwrap();
    let f = c.flow.unwrap();
    assert!(f.queueing);
    assert_eq!(
        (f.max_requests, f.max_bytes, f.ttl_ms, f.no_endpoint_ttl_ms),
        (1000, 10 << 30, 60_000, 60_000)
    );
    assert_eq!(
        f.bands.iter().map(|b| b.priority).collect::<Vec<_>>(),
        vec![100, 5, 0, -10]
    );
    assert_eq!(f.bands[0].max_requests, 500);
    assert_eq!(f.bands[0].fairness, Fairness::RoundRobin);
    assert_eq!(
        f.bands[1].max_requests,
        config::DEFAULT_BAND_MAX_REQUESTS,
        "a template band"
    );
    assert_eq!(
        f.detector,
        Detector::Concurrency {
            tokens: false,
            max_requests: 132,
            max_tokens: 1_000_000,
            headroom: 0.0
        }
    );
    // Classification: header (either name), then model, then 0.
    assert_eq!(f.classify(Some(b"premium-traffic"), "x", None).band, 0);
    assert_eq!(
        f.classify(None, "m", Some(b"tenant-a")),
        Class {
            band: 1,
            priority: 5,
            flow: "tenant-a".into()
        }
    );
    assert_eq!(
        f.classify(Some(b"nope"), "x", None),
        Class {
            band: 2,
            priority: 0,
            flow: DEFAULT_FLOW.into()
        }
    );
    assert_eq!(
        f.classify(Some(b"best-effort-traffic"), "m", Some(b""))
            .band,
        3
    );
    // Defaults: gate on alone, utilization-detector, 60 s.
    let f = cfg("", r#""featureGates":["flowControl"]"#)
        .unwrap()
        .flow
        .unwrap();
    assert_eq!(
        (f.detector.clone(), f.ttl_ms, f.bands.len()),
        (Detector::default(), 60_000, 1)
    );
    // Gate off: nothing, unless an objective is sheddable.
    assert!(cfg("", r#""flowControl":{"maxRequests":"5"}"#)
        .unwrap()
        .flow
        .is_none());
    let f = cfg("", r#""inferenceObjectives":[{"name":"b","priority":-1}]"#)
        .unwrap()
        .flow
        .unwrap();
    assert!(!f.queueing);
}

#[test]
fn what_kvroute_cannot_honour_is_refused_by_name() {
    let gate = r#""featureGates":["flowControl"],"#;
    let cases = [
        (
            "",
            r#""flowControl":{"enableEviction":true}"#,
            "flowControl.enableEviction",
        ),
        (
            "",
            r#""flowControl":{"defaultRequestTTL":"soon"}"#,
            "flowControl.defaultRequestTTL",
        ),
        (
            "",
            r#""flowControl":{"maxRequests":"-1"}"#,
            "flowControl.maxRequests",
        ),
        (
            "",
            r#""flowControl":{"priorityBands":[{"priority":1},{"priority":1}]}"#,
            "flowControl.priorityBands[1].priority",
        ),
        (
            "",
            r#""flowControl":{"priorityBands":[{"maxRequests":3}]}"#,
            "flowControl.priorityBands[0].priority",
        ),
        (
            "",
            r#""flowControl":{"priorityBands":[{"priority":1,"fairnessPolicyRef":"x"}]}"#,
            "flowControl.priorityBands[0].fairnessPolicyRef",
        ),
        (
            r#",{"type":"fcfs-ordering-policy"}"#,
            r#""flowControl":{"priorityBands":[{"priority":1,"fairnessPolicyRef":"fcfs-ordering-policy"}]}"#,
            "flowControl.priorityBands[0].fairnessPolicyRef",
        ),
        (
            r#",{"type":"concurrency-detector","parameters":{"concurrencyMode":"hybrid"}}"#,
            r#""flowControl":{"saturationDetector":{"pluginRef":"concurrency-detector"}}"#,
            "plugins[2].parameters.concurrencyMode",
        ),
        (
            r#",{"type":"utilization-detector","parameters":{"metricsStalenessThreshold":"200ms"}}"#,
            r#""flowControl":{"saturationDetector":{"pluginRef":"utilization-detector"}}"#,
            "plugins[2].parameters.metricsStalenessThreshold",
        ),
        (
            r#",{"type":"queue-scorer","name":"q2"}"#,
            r#""flowControl":{"usageLimitPolicyPluginRef":"q2"}"#,
            "flowControl.usageLimitPolicyPluginRef",
        ),
        (
            "",
            r#""flowControl":{"queueSize":3}"#,
            "flowControl.queueSize",
        ),
        (
            "",
            r#""inferenceObjectives":[{"name":"a"},{"name":"a"}]"#,
            "inferenceObjectives[1].name",
        ),
    ];
    for (decl, rest, path) in cases {
        let e = cfg(decl, &format!("{gate}{rest}"))
            .err()
            .unwrap_or_else(|| panic!("accepted: {rest}"));
        assert_eq!(e.path, path, "{rest}: {e}");
    }
    let e = cfg(
        r#",{"type":"program-aware-fairness"}"#,
        r#""featureGates":["flowControl"]"#,
    )
    .unwrap_err();
    assert!(e.message.contains("kvroute's flow control runs"), "{e}");
}

#[test]
fn kvroute_s_detector_prices_the_gate_s_queue_as_a_wait() {
    let d = Detector::Kvroute {
        max_queue_ms: 1_000.0,
        peak_prefill_tps: 1_000.0,
    };
    let idle = PoolEndpoint::default();
    // 1,500 prefill tokens of ours in flight at 1,000 tokens/s: 1.5 s.
    let busy = PoolEndpoint {
        inflight_requests: 3,
        inflight_tokens: 1_500,
        inflight_prefill_tokens: 1_500,
        ..PoolEndpoint::default()
    };
    assert_eq!(d.score(&idle), 0.0);
    assert!((d.score(&busy) - 1.5).abs() < 1e-9, "{}", d.score(&busy));
    // The endpoint's learnt rate wins over the configured peak.
    let fast = PoolEndpoint {
        prefill_tokens_per_s: Some(3_000.0),
        ..busy
    };
    assert!((d.score(&fast) - 0.5).abs() < 1e-9);
    // Other gateways' requests, from the server's counts, add to ours.
    let crowded = PoolEndpoint {
        metrics: metrics(6.0, 2.0, 0.2),
        ..busy
    };
    assert!(d.score(&crowded) > d.score(&busy));
    assert_eq!(
        d.pool(&[idle, busy]),
        Pool::Level {
            saturation: 0.75,
            blind: false
        }
    );
    // Config: named by flowControl, parameters checked.
    let c = cfg(
        r#",{"type":"kvroute-saturation-detector","parameters":{"maxQueueMs":500}}"#,
        r#""featureGates":["flowControl"],"flowControl":{"saturationDetector":{"pluginRef":"kvroute-saturation-detector"}}"#,
    )
    .unwrap();
    assert_eq!(
        c.flow.unwrap().detector,
        Detector::Kvroute {
            max_queue_ms: 500.0,
            peak_prefill_tps: config::DEFAULT_PEAK_PREFILL_TPS
        }
    );
    let e = cfg(
        r#",{"type":"kvroute-saturation-detector","parameters":{"maxQueueMs":0}}"#,
        r#""featureGates":["flowControl"],"flowControl":{"saturationDetector":{"pluginRef":"kvroute-saturation-detector"}}"#,
    )
    .unwrap_err();
    assert_eq!(e.path, "plugins[2].parameters.maxQueueMs");
}

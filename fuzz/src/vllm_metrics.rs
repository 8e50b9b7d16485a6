//! Fuzz target `vllm_metrics`: what a model server's `/metrics` answers,
//! through the collector's real path into shared data.
//!
//! The input is one or more `/metrics` bodies separated by NUL bytes (at
//! most [`MAX_POLLS`]), polled from two endpoints in turn, one second
//! apart, with a routed request before each poll (so the learners that
//! compare totals between polls, and the bytes-per-token learner that
//! needs routed bytes, all run). After each poll:
//!
//! - `vllm_metrics::parse` is deterministic, holds at most
//!   [`crate::alloc_bound`] heap bytes, and what it returns is in its
//!   documented range (counts finite, ≥ 0, ≤ 1e15; usage in 0–1);
//! - `Engine::record_metrics` reports a problem exactly when the parse
//!   failed, and never a store error;
//! - `kvroute/metrics` decodes and re-encodes to the same bytes, and the
//!   endpoint's entry is in range: finite values, learner estimates within
//!   their bounds (prefill within the filter's floor/ceiling, bytes per
//!   token 1–16, output tokens 1–1 Mi);
//! - a request routed afterwards gets healthy, distinct destinations and
//!   finite scores (`World::route`), and the state view is JSON.
//!
//! Each body is also given to the collector as the other endpoint's
//! `/v1/models` answer (`Engine::record_model_list`): it is an error
//! exactly when `vllm_models::parse` refuses it, and `kvroute/models`
//! decodes, re-encodes to the same bytes and stays within its bounds
//! (`models::MAX_NAMES` names of at most `MAX_NAME_BYTES` bytes per slot;
//! adapter paths only on listed adapters, each at most `MAX_PATH_BYTES`
//! and `MAX_PATH_BYTES_PER_ENDPOINT` per slot together), whatever the
//! `/metrics` and `/v1/models` bodies named.

use crate::engine::{route_chat, World};
use kvroute_core::config::Config;
use kvroute_core::learners::{bytes_per_token, output_tokens};
use kvroute_core::reports::{vllm_metrics, vllm_models};
use kvroute_shared_state::metrics::{MetricsSnapshot, MetricsTable, RatioLearner};
use kvroute_shared_state::models::{
    flags, ModelsTable, MAX_NAMES, MAX_NAME_BYTES, MAX_PATH_BYTES, MAX_PATH_BYTES_PER_ENDPOINT,
    MODELS_KEY,
};
use kvroute_shared_state::{Store, METRICS_KEY};

/// Most polls per input.
pub const MAX_POLLS: usize = 16;

/// Every consumer of the metrics: the prefill-rate estimator (`"auto"`
/// peak prefill), bytes per token (`charsPerToken: "auto"`), learnt output
/// tokens, the capacity from `cache_config_info` (`autoTune`), and the
/// queue and KV-cache scorers.
const CONFIG: &str = r#"{"endpoints":{"static":["127.0.0.1:8001","127.0.0.1:8002"]},
  "plugins":[{"type":"approx-prefix-cache-producer","parameters":{"blockSizeTokens":4,"autoTune":true,"charsPerToken":"auto"}},
             {"type":"inflight-load-producer","parameters":{"addEstimatedOutputTokens":true,"learnOutputTokens":true}},
             {"type":"prefix-cache-affinity-filter","parameters":{"maxTTFTPenaltyMs":200,
                "peakPrefillThroughput":{"auto":true,"initial":20480,"floor":2560,"ceiling":163840,"smoothing":0.3,"minTokensPerRequest":16}}},
             {"type":"token-load-scorer"},{"type":"queue-scorer"},{"type":"kv-cache-utilization-scorer"},{"type":"max-score-picker"}],
  "schedulingProfiles":[{"name":"d","plugins":[{"pluginRef":"prefix-cache-affinity-filter"},{"pluginRef":"token-load-scorer"},
             {"pluginRef":"queue-scorer"},{"pluginRef":"kv-cache-utilization-scorer"},{"pluginRef":"max-score-picker"}]}],
  "sharedState":{"indexBudgetBytes":65536}}"#;

fn count(what: &str, v: f64) {
    assert!(
        v.is_finite() && (0.0..=1e15).contains(&v),
        "{what} = {v}: not a sane count"
    );
}

fn check_parsed(m: &vllm_metrics::VllmMetrics) {
    count("waiting", m.waiting);
    count("running", m.running);
    count("prefix_queries", m.prefix_queries);
    count("prefix_hits", m.prefix_hits);
    assert!(
        (0.0..=1.0).contains(&m.kv_cache_usage),
        "kv_cache_usage {}",
        m.kv_cache_usage
    );
    if let Some(t) = m.prompt_tokens {
        count("prompt_tokens", t);
    }
    if let Some(p) = m.prefill {
        count("prefill.computed_tokens", p.computed_tokens);
        count("prefill.seconds", p.seconds);
        count("prefill.requests", p.requests);
    }
    if let Some(g) = m.generation {
        count("generation.tokens", g.tokens);
        count("generation.requests", g.requests);
    }
}

fn check_learner(what: &str, l: &RatioLearner) {
    assert!(usize::from(l.count) <= l.samples.len(), "{what}: {l:?}");
    assert!(usize::from(l.next) < l.samples.len(), "{what}: {l:?}");
    assert!(
        l.base_den.is_finite() && l.base_num.is_finite(),
        "{what}: {l:?}"
    );
    for s in &l.samples[..usize::from(l.count)] {
        assert!(s.is_finite() && *s >= 0.0, "{what}: a sample {s} in {l:?}");
    }
}

fn check_entry(w: &World, m: &MetricsSnapshot) {
    assert!(m.waiting.is_finite() && m.waiting >= 0.0, "{m:?}");
    assert!(m.running.is_finite() && m.running >= 0.0, "{m:?}");
    assert!((0.0..=1.0).contains(&m.kv_cache_usage), "{m:?}");
    assert!(m.prefix_queries.is_finite() && m.prefix_hits.is_finite());
    let params = w.engine.prefill_rate_params();
    let p = &m.prefill;
    assert!(
        p.tokens_per_s.is_finite() && p.tokens_per_s >= 0.0,
        "prefill {p:?}"
    );
    for v in [p.base_tokens, p.base_seconds, p.base_count] {
        assert!(v.is_finite(), "prefill baseline {p:?}");
    }
    if let Some(rate) = p.estimate() {
        assert!(
            (params.floor..=params.ceiling).contains(&rate),
            "prefill estimate {rate} tokens/s outside [{}, {}]",
            params.floor,
            params.ceiling
        );
    }
    check_learner("bytes_per_token", &m.bytes_per_token);
    check_learner("output_tokens", &m.output_tokens);
    if let Some(b) = bytes_per_token::estimate(&m.bytes_per_token) {
        let (lo, hi) = (
            f64::from(bytes_per_token::FLOOR),
            f64::from(bytes_per_token::CEILING),
        );
        assert!((lo..=hi).contains(&b), "bytes per token {b}");
    }
    if let Some(o) = output_tokens::estimate(&m.output_tokens) {
        assert!(
            (1.0..=f64::from(output_tokens::CEILING)).contains(&o),
            "output tokens per request {o}"
        );
    }
}

/// Runs one input (fuzz target `vllm_metrics`).
pub fn run(data: &[u8]) {
    let config = Config::from_json(CONFIG.as_bytes()).expect("fixed config");
    let mut w = World::new(config);
    let table = w.engine.endpoint_table(&w.store).expect("endpoint table");
    assert_eq!(table.endpoints.len(), 2);
    for (i, body) in data.split(|&b| b == 0).take(MAX_POLLS).enumerate() {
        route_chat(&mut w, i);
        w.now_ms += 1000;
        let base = crate::alloc_count::start();
        let parsed = vllm_metrics::parse(body);
        crate::check_alloc(
            "vllm_metrics::parse",
            body.len(),
            crate::alloc_count::peak_since(base),
        );
        assert_eq!(
            vllm_metrics::parse(body),
            parsed,
            "parsing is not deterministic"
        );
        match &parsed {
            Ok(m) => check_parsed(m),
            Err(e) => assert!(!e.to_string().is_empty()),
        }
        let e = &table.endpoints[i % table.endpoints.len()];
        let problem = w
            .engine
            .record_metrics(&w.store, e.slot, e.generation, Ok(body), w.now_ms)
            .expect("record_metrics on a MemoryStore");
        assert_eq!(
            problem.is_some(),
            parsed.is_err(),
            "record_metrics reported {problem:?} for a parse of {parsed:?}"
        );
        let (bytes, _) = w
            .store
            .get(METRICS_KEY)
            .expect("MemoryStore get")
            .expect("kvroute/metrics after a poll");
        let t = MetricsTable::decode(Some(&bytes));
        assert_eq!(t.encode(), bytes, "kvroute/metrics does not re-encode");
        let entry = t
            .get(e.slot, e.generation)
            .expect("the polled endpoint has a metrics entry");
        assert_eq!(entry.attempted_at_ms, w.now_ms);
        if parsed.is_ok() {
            assert_eq!((entry.ok_at_ms, entry.failures), (w.now_ms, 0));
        } else {
            assert!(entry.failures > 0);
        }
        check_entry(&w, entry);
        let other = &table.endpoints[(i + 1) % table.endpoints.len()];
        let listed = w
            .engine
            .record_model_list(&w.store, other.slot, other.generation, body);
        assert_eq!(
            listed.is_err(),
            vllm_models::parse(body).is_err(),
            "record_model_list said {listed:?}"
        );
        if let Some((bytes, _)) = w.store.get(MODELS_KEY).expect("MemoryStore get") {
            let t = ModelsTable::decode(Some(&bytes));
            assert_eq!(t.encode(), bytes, "kvroute/models does not re-encode");
            for m in &t.slots {
                assert!(m.names.len() <= MAX_NAMES, "{m:?}");
                assert!(m
                    .names
                    .iter()
                    .all(|n| n.name.len() <= MAX_NAME_BYTES && n.flags != 0));
                let mut path_bytes = 0;
                for n in &m.names {
                    if let Some(p) = &n.path {
                        assert!(n.flags & flags::LISTED_ADAPTER != 0, "{n:?}");
                        assert!(!p.is_empty() && p.len() <= MAX_PATH_BYTES, "{n:?}");
                        path_bytes += p.len();
                    }
                }
                assert!(path_bytes <= MAX_PATH_BYTES_PER_ENDPOINT, "{m:?}");
            }
        }
        w.check_accounting();
    }
    route_chat(&mut w, MAX_POLLS);
    w.finish();
}

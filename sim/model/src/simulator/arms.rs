//! The router arms `sim/bench/quality.py` runs, as plugin configuration
//! documents (its `plugin_config`), plus the shipped default
//! (`envoy/kvroute-config.json`). Each is the same JSON the filter takes;
//! `--config FILE` runs any other.

use super::RouterSpec;
use kvroute_core::config::Config;
use serde_json::{json, Value};

/// The shipped plugin configuration (`envoy/kvroute-config.json`).
pub const SHIPPED_DEFAULT: &str = include_str!("../../../../envoy/kvroute-config.json");

/// Arm names `--arm` accepts.
pub const ARMS: &[&str] = &[
    "round-robin",
    "kvroute",
    "always-sticky",
    "legacy-blend",
    "active-request",
    "shipped-default",
];

/// Knobs the arms take (quality.py: the calibrated peak, `--penalty-ms`,
/// `--metrics-poll-ms`).
#[derive(Clone, Debug, PartialEq)]
pub struct ArmParams {
    pub peak_prefill_tps: f64,
    pub max_ttft_penalty_ms: f64,
    pub affinity_threshold: f64,
    pub block_size: u32,
    pub metrics_poll_ms: u64,
}

impl Default for ArmParams {
    fn default() -> Self {
        ArmParams {
            peak_prefill_tps: 20_480.0,
            max_ttft_penalty_ms: 2000.0,
            affinity_threshold: 0.8,
            block_size: 16,
            metrics_poll_ms: 100,
        }
    }
}

/// The configuration document of a kvroute arm (`None` for round robin).
pub fn arm_document(arm: &str, p: &ArmParams) -> Result<Option<Value>, String> {
    let producers = json!([
        {"type": "approx-prefix-cache-producer", "parameters": {"blockSizeTokens": p.block_size}},
        {"type": "inflight-load-producer"},
    ]);
    let affinity = |tau: f64| {
        json!({"type": "prefix-cache-affinity-filter",
               "parameters": {"affinityThreshold": p.affinity_threshold, "maxTTFTPenaltyMs": tau,
                              "peakPrefillThroughput": p.peak_prefill_tps}})
    };
    let refs = |names: &[&str]| -> Value {
        Value::Array(names.iter().map(|n| json!({"pluginRef": n})).collect())
    };
    let (plugins, profile) = match arm {
        "round-robin" => return Ok(None),
        "kvroute" | "always-sticky" | "active-request" => {
            let tau = if arm == "always-sticky" {
                0.0
            } else {
                p.max_ttft_penalty_ms
            };
            let scorer = if arm == "active-request" {
                "active-request-scorer"
            } else {
                "token-load-scorer"
            };
            (
                json!([affinity(tau), {"type": scorer}, {"type": "max-score-picker"}]),
                refs(&["prefix-cache-affinity-filter", scorer, "max-score-picker"]),
            )
        }
        "legacy-blend" => (
            json!([{"type": "prefix-cache-scorer"}, {"type": "queue-scorer"},
                   {"type": "kv-cache-utilization-scorer"}, {"type": "no-hit-lru-scorer"},
                   {"type": "max-score-picker"}]),
            json!([{"pluginRef": "prefix-cache-scorer", "weight": 3},
                   {"pluginRef": "queue-scorer", "weight": 2},
                   {"pluginRef": "kv-cache-utilization-scorer", "weight": 2},
                   {"pluginRef": "no-hit-lru-scorer", "weight": 2},
                   {"pluginRef": "max-score-picker"}]),
        ),
        "shipped-default" => {
            let doc: Value = serde_json::from_str(SHIPPED_DEFAULT)
                .map_err(|e| format!("envoy/kvroute-config.json: {e}"))?;
            return Ok(Some(doc));
        }
        other => {
            return Err(format!(
                "unknown arm {other:?}: use one of {}",
                ARMS.join(", ")
            ))
        }
    };
    let mut all = producers.as_array().cloned().unwrap_or_default();
    all.extend(plugins.as_array().cloned().unwrap_or_default());
    Ok(Some(json!({
        "plugins": all,
        "schedulingProfiles": [{"name": "default", "plugins": profile}],
        "routing": {"failureMode": "open", "seed": 1},
        "collector": {"metricsCluster": "vllm", "metricsPollIntervalMs": p.metrics_poll_ms,
                      "metricsTimeoutMs": 300},
    })))
}

/// Compiles a configuration document as the filter does. A document
/// without `endpoints` gets `{"fromCluster": {"cluster": "vllm"}}`, as
/// `envoy/render.py` adds; the simulator then plays the cluster's members.
pub fn router_from_document(doc: &Value) -> Result<RouterSpec, String> {
    let mut doc = doc.clone();
    if let Some(o) = doc.as_object_mut() {
        o.entry("endpoints")
            .or_insert_with(|| json!({"fromCluster": {"cluster": "vllm"}}));
    }
    let bytes = serde_json::to_vec(&doc).map_err(|e| e.to_string())?;
    let c = Config::from_json(&bytes).map_err(|e| format!("plugin configuration: {e}"))?;
    Ok(RouterSpec::Kvroute(Box::new(c)))
}

/// The router of an arm.
pub fn arm_router(arm: &str, p: &ArmParams) -> Result<RouterSpec, String> {
    match arm_document(arm, p)? {
        None => Ok(RouterSpec::RoundRobin),
        Some(doc) => router_from_document(&doc),
    }
}

/// Sets `maxTTFTPenaltyMs` / `affinityThreshold` / `peakPrefillThroughput`
/// of every affinity filter in a document (sweeps over any config).
pub fn set_affinity_param(doc: &mut Value, key: &str, v: f64) -> bool {
    let mut found = false;
    if let Some(plugins) = doc.get_mut("plugins").and_then(Value::as_array_mut) {
        for p in plugins {
            if p.get("type").and_then(Value::as_str) == Some("prefix-cache-affinity-filter") {
                let params = p
                    .as_object_mut()
                    .map(|o| o.entry("parameters").or_insert_with(|| json!({})));
                if let Some(Value::Object(m)) = params {
                    m.insert(key.into(), json!(v));
                    found = true;
                }
            }
        }
    }
    found
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_arm_compiles_and_the_shipped_default_is_the_file() {
        let p = ArmParams::default();
        for a in ARMS {
            arm_router(a, &p).unwrap_or_else(|e| panic!("{a}: {e}"));
        }
        assert!(matches!(
            arm_router("round-robin", &p),
            Ok(RouterSpec::RoundRobin)
        ));
        assert!(arm_router("nope", &p).is_err());
        let mut d = arm_document("shipped-default", &p).unwrap().unwrap();
        assert!(set_affinity_param(&mut d, "maxTTFTPenaltyMs", 5.0));
        let s = d.to_string();
        assert!(s.contains("\"maxTTFTPenaltyMs\":5.0"), "{s}");
    }
}

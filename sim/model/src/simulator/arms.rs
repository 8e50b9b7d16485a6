//! The router arms of the benchmarks, read from `sim/bench/arms.json`, the
//! one definition `sim/bench/quality.py` (through `kvbench.plugin_config`)
//! reads too, under the same names. Each is the same JSON the filter takes;
//! `--config FILE` runs any other. `shipped-default` is
//! `envoy/kvroute-config.json` as it is; `kvroute-default` is that profile
//! with the arms' block size, peak and τ, as Envoy runs it.

use super::RouterSpec;
use kvroute_core::config::Config;
use serde_json::{json, Value};
use std::sync::LazyLock;

/// The shipped plugin configuration (`envoy/kvroute-config.json`).
pub const SHIPPED_DEFAULT: &str = include_str!("../../../../envoy/kvroute-config.json");

/// `sim/bench/arms.json`.
pub const ARMS_JSON: &str = include_str!("../../../bench/arms.json");

static ARMS_FILE: LazyLock<Result<Value, String>> = LazyLock::new(|| {
    serde_json::from_str(ARMS_JSON).map_err(|e| format!("sim/bench/arms.json: {e}"))
});

/// Arm names `--arm` accepts, in the file's order.
pub static ARMS: LazyLock<Vec<&'static str>> = LazyLock::new(|| match &*ARMS_FILE {
    Ok(f) => arms_of(f)
        .iter()
        .filter_map(|a| a.get("name").and_then(Value::as_str))
        .collect(),
    Err(_) => Vec::new(),
});

fn arms_of(f: &Value) -> &[Value] {
    f.get("arms")
        .and_then(Value::as_array)
        .map(Vec::as_slice)
        .unwrap_or(&[])
}

/// Knobs the arms take (quality.py: the calibrated peak, `--penalty-ms`,
/// `--metrics-poll-ms`), filling the file's placeholders.
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

/// A config file an arm names: only the shipped one is compiled in.
fn shipped(path: &str) -> Result<Value, String> {
    if path != "envoy/kvroute-config.json" {
        return Err(format!(
            "sim/bench/arms.json names {path:?}: only envoy/kvroute-config.json is compiled in"
        ));
    }
    serde_json::from_str(SHIPPED_DEFAULT).map_err(|e| format!("envoy/kvroute-config.json: {e}"))
}

/// Replaces every placeholder string (`"{peak}"`, …) by its number.
fn fill(v: &mut Value, p: &ArmParams) {
    match v {
        Value::String(s) => {
            let n = match s.as_str() {
                "{blockSize}" => json!(p.block_size),
                "{peak}" => json!(p.peak_prefill_tps),
                "{tau}" => json!(p.max_ttft_penalty_ms),
                "{threshold}" => json!(p.affinity_threshold),
                "{poll}" => json!(p.metrics_poll_ms),
                _ => return,
            };
            *v = n;
        }
        Value::Array(a) => a.iter_mut().for_each(|x| fill(x, p)),
        Value::Object(o) => o.values_mut().for_each(|x| fill(x, p)),
        _ => {}
    }
}

/// The configuration document of a kvroute arm (`None` for round robin).
pub fn arm_document(arm: &str, p: &ArmParams) -> Result<Option<Value>, String> {
    let file = ARMS_FILE.as_ref().map_err(Clone::clone)?;
    let Some(spec) = arms_of(file)
        .iter()
        .find(|a| a.get("name").and_then(Value::as_str) == Some(arm))
    else {
        return Err(format!(
            "unknown arm {arm:?}: use one of {}",
            ARMS.join(", ")
        ));
    };
    if let Some(path) = spec.get("file").and_then(Value::as_str) {
        return shipped(path).map(Some);
    }
    let mut doc = match spec.get("from").and_then(Value::as_str) {
        Some(path) => {
            let base = shipped(path)?;
            let mut plugins = base.get("plugins").cloned().unwrap_or(json!([]));
            let set = spec.get("set").and_then(Value::as_object);
            for plugin in plugins.as_array_mut().into_iter().flatten() {
                let ty = plugin.get("type").and_then(Value::as_str).unwrap_or("");
                let Some(Value::Object(values)) = set.and_then(|s| s.get(ty)) else {
                    continue;
                };
                let params = plugin
                    .as_object_mut()
                    .map(|o| o.entry("parameters").or_insert_with(|| json!({})));
                if let Some(Value::Object(m)) = params {
                    for (k, v) in values {
                        m.insert(k.clone(), v.clone());
                    }
                }
            }
            json!({"plugins": plugins,
                   "schedulingProfiles": base.get("schedulingProfiles").cloned().unwrap_or(json!([]))})
        }
        None => match spec.get("plugins") {
            None | Some(Value::Null) => return Ok(None),
            Some(plugins) => json!({"plugins": plugins,
                                    "schedulingProfiles": spec.get("schedulingProfiles").cloned().unwrap_or(json!([]))}),
        },
    };
    if let (Some(o), Some(common)) = (
        doc.as_object_mut(),
        file.get("common").and_then(Value::as_object),
    ) {
        for (k, v) in common {
            o.insert(k.clone(), v.clone());
        }
    }
    fill(&mut doc, p);
    Ok(Some(doc))
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
        for a in ARMS.iter() {
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

    #[test]
    fn the_file_names_quality_py_arms_and_fills_every_placeholder() {
        for a in [
            "round-robin",
            "kvroute",
            "kvroute-default",
            "always-sticky",
            "legacy-blend",
            "active-request",
            "kvroute-18s",
            "kvroute-output-est",
            "shipped-default",
        ] {
            assert!(ARMS.contains(&a), "{a} missing from {:?}", *ARMS);
        }
        let p = ArmParams {
            peak_prefill_tps: 18_204.0,
            max_ttft_penalty_ms: 2500.0,
            affinity_threshold: 0.7,
            block_size: 64,
            metrics_poll_ms: 250,
        };
        for a in ARMS.iter() {
            let Some(d) = arm_document(a, &p).unwrap() else {
                continue;
            };
            let s = d.to_string();
            assert!(!s.contains("\"{"), "{a}: a placeholder is left: {s}");
        }
        // kvroute-default is the shipped profile with the arms' knobs.
        let d = arm_document("kvroute-default", &p).unwrap().unwrap();
        let shipped: Value = serde_json::from_str(SHIPPED_DEFAULT).unwrap();
        assert_eq!(d["schedulingProfiles"], shipped["schedulingProfiles"]);
        let s = d.to_string();
        assert!(s.contains("\"blockSizeTokens\":64"), "{s}");
        assert!(s.contains("\"maxTTFTPenaltyMs\":2500.0"), "{s}");
        assert!(s.contains("\"peakPrefillThroughput\":18204.0"), "{s}");
        assert!(s.contains("\"metricsPollIntervalMs\":250"), "{s}");
    }
}

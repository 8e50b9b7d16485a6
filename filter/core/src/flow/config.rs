//! Flow control's configuration: llm-d's `featureGates: ["flowControl"]`,
//! its `flowControl` section and the plugins it names, plus kvroute's
//! `inferenceObjectives` (what llm-d reads from `InferenceObjective`
//! resources).
//!
//! What kvroute cannot honour is refused by name: `enableEviction`,
//! `usageLimitPolicyPluginRef` naming anything but a
//! `static-usage-limit-policy`, and the policy plugins it does not run.

use super::{Class, Detector, Fairness, Ordering, DEFAULT_FLOW, MAX_FLOW_ID_BYTES};
use crate::config::check::{err, strict_value, strict_value_req};
use crate::config::llm_d::{ConcurrencyDetectorParams, UtilizationDetectorParams};
use crate::config::ConfigError;
use serde::Deserialize;
use serde_json::Value;

/// llm-d's per-band defaults.
pub const DEFAULT_BAND_MAX_REQUESTS: u64 = 5_000;
pub const DEFAULT_BAND_MAX_BYTES: u64 = 1_000_000_000;
/// llm-d's `defaultRequestTTL` default.
pub const DEFAULT_TTL_MS: u64 = 60_000;
/// At most this many objectives (each may make a band).
pub const MAX_OBJECTIVES: usize = 64;

#[derive(Clone, Debug, PartialEq)]
pub struct BandConfig {
    pub priority: i32,
    pub max_requests: u64,
    pub max_bytes: u64,
    pub fairness: Fairness,
    pub ordering: Ordering,
}

/// An `inferenceObjectives` entry.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Objective {
    pub name: String,
    pub priority: i32,
    /// Requests for these models that name no objective get its priority.
    pub models: Vec<String>,
}

#[derive(Clone, Debug, PartialEq)]
pub struct FlowConfig {
    /// The `flowControl` gate is on: saturated requests wait. Off: only
    /// sheddable requests are refused while saturated (legacy admission).
    pub queueing: bool,
    /// Highest priority first; one per priority an objective can give, 0
    /// and each configured band.
    pub bands: Vec<BandConfig>,
    /// Global bounds (0: none).
    pub max_requests: u64,
    pub max_bytes: u64,
    /// Queue-wait budget, ms (0: none).
    pub ttl_ms: u64,
    /// The budget while the pool has no endpoint, ms (0: none).
    pub no_endpoint_ttl_ms: u64,
    pub detector: Detector,
    /// Metrics older than this count as stale for the detector, ms.
    pub stale_ms: u64,
    /// `static-usage-limit-policy` `threshold`: dispatch while the pool's
    /// saturation is below it.
    pub ceiling: f64,
    pub objectives: Vec<Objective>,
}

impl FlowConfig {
    /// A request's band and flow, from its headers' objective and fairness
    /// id and its model.
    pub fn classify(&self, objective: Option<&[u8]>, model: &str, flow: Option<&[u8]>) -> Class {
        let by_name = objective.and_then(|o| {
            self.objectives
                .iter()
                .find(|x| x.name.as_bytes() == o)
                .map(|x| x.priority)
        });
        let by_model = || {
            self.objectives
                .iter()
                .find(|x| x.models.iter().any(|m| m == model))
                .map(|x| x.priority)
        };
        let priority = by_name.or_else(by_model).unwrap_or(0);
        let band = self
            .bands
            .iter()
            .position(|b| b.priority == priority)
            .unwrap_or(self.bands.len().saturating_sub(1));
        let flow = match flow {
            Some(f) if !f.is_empty() => {
                let f = &f[..f.len().min(MAX_FLOW_ID_BYTES)];
                String::from_utf8_lossy(f).into_owned()
            }
            _ => DEFAULT_FLOW.to_string(),
        };
        Class {
            band,
            priority,
            flow,
        }
    }

    pub fn policies(&self) -> Vec<(Fairness, Ordering)> {
        self.bands
            .iter()
            .map(|b| (b.fairness, b.ordering))
            .collect()
    }
}

// ---------------------------------------------------------------------------
// Raw shapes.

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct RawFlowControl {
    #[serde(default)]
    max_bytes: Option<Value>,
    #[serde(default)]
    max_requests: Option<Value>,
    #[serde(default, rename = "defaultRequestTTL")]
    default_request_ttl: Option<Value>,
    #[serde(default, rename = "noEndpointRequestTTL")]
    no_endpoint_request_ttl: Option<Value>,
    #[serde(default)]
    default_priority_band: Option<RawBand>,
    #[serde(default)]
    default_negative_priority_band: Option<RawBand>,
    #[serde(default)]
    priority_bands: Vec<RawBand>,
    #[serde(default)]
    usage_limit_policy_plugin_ref: Option<String>,
    #[serde(default)]
    saturation_detector: Option<RawRef>,
    #[serde(default)]
    enable_eviction: Option<bool>,
}

#[derive(Deserialize, Default, Clone)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct RawBand {
    #[serde(default)]
    priority: Option<i32>,
    #[serde(default)]
    max_bytes: Option<Value>,
    #[serde(default)]
    max_requests: Option<Value>,
    #[serde(default)]
    fairness_policy_ref: Option<String>,
    #[serde(default)]
    ordering_policy_ref: Option<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct RawRef {
    plugin_ref: String,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawObjective {
    name: String,
    #[serde(default)]
    priority: i32,
    #[serde(default)]
    models: Vec<String>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct KvrouteDetectorParams {
    max_queue_ms: Option<f64>,
    peak_prefill_throughput: Option<f64>,
}

/// `kvroute-saturation-detector` defaults: a 2 s queue is saturation, at
/// the affinity filter's default prefill rate.
pub const DEFAULT_MAX_QUEUE_MS: f64 = 2_000.0;
pub const DEFAULT_PEAK_PREFILL_TPS: f64 = 15_928.0;

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct UsageLimitParams {
    threshold: Option<f64>,
}

/// A declared plugin: name, canonical type, parameters.
pub struct Declared<'a> {
    pub name: &'a str,
    pub kind: &'a str,
    pub params: &'a Option<Value>,
    pub path: String,
}

/// What [`compile`] reads.
pub struct Inputs<'a> {
    pub gate_on: bool,
    pub section: Option<&'a Value>,
    /// The deprecated top-level `saturationDetector`.
    pub top_detector: Option<&'a Value>,
    pub objectives: Option<&'a Value>,
    pub plugins: &'a [Declared<'a>],
    /// `collector.metricsStaleAfterMs` and `metricsPollIntervalMs`.
    pub metrics_stale_after_ms: u64,
    pub metrics_poll_ms: u64,
}

/// Flow control's config, or `None` when it has nothing to do (gate off and
/// no sheddable objective).
pub fn compile(i: &Inputs) -> Result<Option<FlowConfig>, ConfigError> {
    let objectives = match i.objectives {
        None | Some(Value::Null) => Vec::new(),
        Some(v) => {
            let raw: Vec<RawObjective> = strict_value_req(v, "inferenceObjectives")?;
            if raw.len() > MAX_OBJECTIVES {
                return Err(err(
                    "inferenceObjectives",
                    format!("{} objectives; at most {MAX_OBJECTIVES}", raw.len()),
                ));
            }
            let mut out: Vec<Objective> = Vec::new();
            for (k, o) in raw.into_iter().enumerate() {
                if o.name.is_empty() {
                    return Err(err(
                        format!("inferenceObjectives[{k}].name"),
                        "must not be empty",
                    ));
                }
                if out.iter().any(|x| x.name == o.name) {
                    return Err(err(
                        format!("inferenceObjectives[{k}].name"),
                        format!("duplicate objective \"{}\"", o.name),
                    ));
                }
                out.push(Objective {
                    name: o.name,
                    priority: o.priority,
                    models: o.models,
                });
            }
            out
        }
    };
    let fc: RawFlowControl = match i.section {
        Some(v) => strict_value_req(v, "flowControl")?,
        None => RawFlowControl::default(),
    };
    let find = |name: &str| i.plugins.iter().find(|p| p.name == name);

    // The detector: flowControl.saturationDetector wins over the deprecated
    // top-level one; default utilization-detector.
    let det_ref = match (&fc.saturation_detector, i.top_detector) {
        (Some(r), _) => Some((
            r.plugin_ref.clone(),
            "flowControl.saturationDetector.pluginRef",
        )),
        (None, Some(v)) => {
            let r: RawRef = strict_value_req(v, "saturationDetector")?;
            Some((r.plugin_ref, "saturationDetector.pluginRef"))
        }
        (None, None) => None,
    };
    let mut stale_ms = i.metrics_stale_after_ms;
    let detector = match det_ref {
        None => Detector::default(),
        Some((name, path)) => {
            let Some(p) = find(&name) else {
                return Err(err(
                    path,
                    format!("no plugin named \"{name}\" in `plugins` (names default to the type)"),
                ));
            };
            match p.kind {
                "utilization-detector" => {
                    let q: UtilizationDetectorParams = strict_value(p.params, &p.path)?;
                    if let Some(v) = &q.metrics_staleness_threshold {
                        let ms = duration_ms(
                            &Value::String(v.clone()),
                            &format!("{}.metricsStalenessThreshold", p.path),
                        )?;
                        if ms < i.metrics_poll_ms {
                            return Err(err(
                                format!("{}.metricsStalenessThreshold", p.path),
                                format!("{ms} ms is shorter than collector.metricsPollIntervalMs ({} ms): every endpoint would look stale, and stale counts as saturated", i.metrics_poll_ms),
                            ));
                        }
                        stale_ms = ms;
                    }
                    Detector::Utilization {
                        queue_depth_threshold: q.queue_depth_threshold.unwrap_or(5).max(1) as f64,
                        kv_cache_util_threshold: q.kv_cache_util_threshold.unwrap_or(0.8),
                        headroom: q.headroom.unwrap_or(0.0),
                    }
                }
                "concurrency-detector" => {
                    let q: ConcurrencyDetectorParams = strict_value(p.params, &p.path)?;
                    let mode = q.concurrency_mode.as_deref().unwrap_or("requests");
                    if mode == "hybrid" {
                        return Err(err(
                            format!("{}.concurrencyMode", p.path),
                            "\"hybrid\" is not supported by kvroute's flow control; use \"requests\" or \"tokens\"",
                        ));
                    }
                    let _ = q.in_flight_load_producer_name;
                    Detector::Concurrency {
                        tokens: mode == "tokens",
                        max_requests: q.max_concurrency.unwrap_or(100).max(1) as u64,
                        max_tokens: q.max_token_concurrency.unwrap_or(1_000_000).max(1) as u64,
                        headroom: q.headroom.unwrap_or(0.0),
                    }
                }
                "kvroute-saturation-detector" => {
                    let q: KvrouteDetectorParams = strict_value(p.params, &p.path)?;
                    let positive = |v: Option<f64>, field: &str, default: f64| match v {
                        None => Ok(default),
                        Some(x) if x.is_finite() && x > 0.0 => Ok(x),
                        Some(x) => Err(err(
                            format!("{}.{field}", p.path),
                            format!("{x} is out of range: must be > 0"),
                        )),
                    };
                    Detector::Kvroute {
                        max_queue_ms: positive(q.max_queue_ms, "maxQueueMs", DEFAULT_MAX_QUEUE_MS)?,
                        peak_prefill_tps: positive(
                            q.peak_prefill_throughput,
                            "peakPrefillThroughput",
                            DEFAULT_PEAK_PREFILL_TPS,
                        )?,
                    }
                }
                other => {
                    return Err(err(
                        path,
                        format!("\"{name}\" is a {other}; it must name a utilization-detector, concurrency-detector or kvroute-saturation-detector"),
                    ))
                }
            }
        }
    };

    let sheddable = objectives.iter().any(|o| o.priority < 0);
    if !i.gate_on {
        // llm-d ignores the rest of the section with the gate off.
        if !sheddable {
            return Ok(None);
        }
        let mut priorities: Vec<i32> = objectives.iter().map(|o| o.priority).collect();
        priorities.push(0);
        priorities.sort_unstable_by(|a, b| b.cmp(a));
        priorities.dedup();
        return Ok(Some(FlowConfig {
            queueing: false,
            bands: priorities
                .into_iter()
                .map(|priority| BandConfig {
                    priority,
                    max_requests: DEFAULT_BAND_MAX_REQUESTS,
                    max_bytes: DEFAULT_BAND_MAX_BYTES,
                    fairness: Fairness::GlobalStrict,
                    ordering: Ordering::Fcfs,
                })
                .collect(),
            max_requests: 0,
            max_bytes: 0,
            ttl_ms: 0,
            no_endpoint_ttl_ms: 0,
            detector,
            stale_ms,
            ceiling: 1.0,
            objectives,
        }));
    }

    if fc.enable_eviction == Some(true) {
        return Err(err(
            "flowControl.enableEviction",
            "kvroute does not evict in-flight requests (a dispatched request is the model server's); remove it or set false",
        ));
    }
    let ceiling = match &fc.usage_limit_policy_plugin_ref {
        None => 1.0,
        Some(name) => {
            let path = "flowControl.usageLimitPolicyPluginRef";
            let Some(p) = find(name) else {
                return Err(err(
                    path,
                    format!("no plugin named \"{name}\" in `plugins` (names default to the type)"),
                ));
            };
            if p.kind != "static-usage-limit-policy" {
                return Err(err(
                    path,
                    format!("\"{name}\" is a {}; kvroute's flow control runs static-usage-limit-policy only", p.kind),
                ));
            }
            let q: UsageLimitParams = strict_value(p.params, &p.path)?;
            match q.threshold {
                None => 1.0,
                Some(t) if t.is_finite() && t > 0.0 && t <= 1.0 => t,
                Some(t) => {
                    return Err(err(
                        format!("{}.threshold", p.path),
                        format!("{t} is out of range: must be in (0, 1]"),
                    ))
                }
            }
        }
    };
    let ttl_ms = match &fc.default_request_ttl {
        None => DEFAULT_TTL_MS,
        Some(v) => duration_ms(v, "flowControl.defaultRequestTTL")?,
    };
    let no_endpoint_ttl_ms = match &fc.no_endpoint_request_ttl {
        None => ttl_ms,
        Some(v) => duration_ms(v, "flowControl.noEndpointRequestTTL")?,
    };
    let global = |v: &Option<Value>, path: &str| match v {
        None => Ok(0),
        Some(v) => quantity(v, path),
    };
    let max_requests = global(&fc.max_requests, "flowControl.maxRequests")?;
    let max_bytes = global(&fc.max_bytes, "flowControl.maxBytes")?;

    let policy = |r: &Option<String>,
                  path: String,
                  fairness: bool|
     -> Result<(Fairness, Ordering), ConfigError> {
        let (f0, o0) = (Fairness::GlobalStrict, Ordering::Fcfs);
        let Some(name) = r else {
            return Ok((f0, o0));
        };
        let Some(p) = find(name) else {
            return Err(err(
                path,
                format!("no plugin named \"{name}\" in `plugins` (names default to the type)"),
            ));
        };
        match (fairness, p.kind) {
            (true, "global-strict-fairness-policy") => Ok((Fairness::GlobalStrict, o0)),
            (true, "round-robin-fairness-policy") => Ok((Fairness::RoundRobin, o0)),
            (false, "fcfs-ordering-policy") => Ok((f0, Ordering::Fcfs)),
            (false, "edf-ordering-policy") => Ok((f0, Ordering::Edf)),
            (true, k) => Err(err(path, format!("\"{name}\" is a {k}; kvroute's fairness policies are global-strict-fairness-policy and round-robin-fairness-policy"))),
            (false, k) => Err(err(path, format!("\"{name}\" is a {k}; kvroute's ordering policies are fcfs-ordering-policy and edf-ordering-policy"))),
        }
    };
    let band = |r: &RawBand, path: &str, priority: i32| -> Result<BandConfig, ConfigError> {
        let bound = |v: &Option<Value>, field: &str, default: u64| match v {
            None => Ok(default),
            Some(v) => {
                quantity(v, &format!("{path}.{field}")).map(|n| if n == 0 { default } else { n })
            }
        };
        let (fairness, _) = policy(
            &r.fairness_policy_ref,
            format!("{path}.fairnessPolicyRef"),
            true,
        )?;
        let (_, ordering) = policy(
            &r.ordering_policy_ref,
            format!("{path}.orderingPolicyRef"),
            false,
        )?;
        Ok(BandConfig {
            priority,
            max_requests: bound(&r.max_requests, "maxRequests", DEFAULT_BAND_MAX_REQUESTS)?,
            max_bytes: bound(&r.max_bytes, "maxBytes", DEFAULT_BAND_MAX_BYTES)?,
            fairness,
            ordering,
        })
    };
    let mut bands: Vec<BandConfig> = Vec::new();
    for (k, b) in fc.priority_bands.iter().enumerate() {
        let path = format!("flowControl.priorityBands[{k}]");
        let Some(p) = b.priority else {
            return Err(err(format!("{path}.priority"), "is required"));
        };
        if bands.iter().any(|x| x.priority == p) {
            return Err(err(
                format!("{path}.priority"),
                format!("duplicate band priority {p}"),
            ));
        }
        bands.push(band(b, &path, p)?);
    }
    let positive = fc.default_priority_band.clone().unwrap_or_default();
    let negative = fc
        .default_negative_priority_band
        .clone()
        .unwrap_or_else(|| positive.clone());
    // Check the templates even if no priority uses them.
    band(&positive, "flowControl.defaultPriorityBand", 0)?;
    band(&negative, "flowControl.defaultNegativePriorityBand", -1)?;
    let mut wanted: Vec<i32> = objectives.iter().map(|o| o.priority).collect();
    wanted.push(0);
    for p in wanted {
        if bands.iter().any(|b| b.priority == p) {
            continue;
        }
        let (t, path) = if p < 0 {
            (&negative, "flowControl.defaultNegativePriorityBand")
        } else {
            (&positive, "flowControl.defaultPriorityBand")
        };
        bands.push(band(t, path, p)?);
    }
    bands.sort_by_key(|b| std::cmp::Reverse(b.priority));
    Ok(Some(FlowConfig {
        queueing: true,
        bands,
        max_requests,
        max_bytes,
        ttl_ms,
        no_endpoint_ttl_ms,
        detector,
        stale_ms,
        ceiling,
        objectives,
    }))
}

/// A Kubernetes quantity (`"1k"`, `"10Gi"`, `"500M"`, `1000`) as an integer.
pub fn quantity(v: &Value, path: &str) -> Result<u64, ConfigError> {
    let bad = |why: &str| {
        err(
            path,
            format!("{v} is not a quantity ({why}); write e.g. 1000, \"1k\", \"500M\" or \"10Gi\""),
        )
    };
    let s = match v {
        Value::Number(n) => {
            return n
                .as_u64()
                .ok_or_else(|| bad("a non-negative integer is needed"))
        }
        Value::String(s) => s.trim(),
        _ => return Err(bad("not a number or a string")),
    };
    let split = s
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(s.len());
    let (num, suffix) = s.split_at(split);
    if num.is_empty() {
        return Err(bad("no number"));
    }
    let n: f64 = num.parse().map_err(|_| bad("bad number"))?;
    let mult: f64 = match suffix {
        "" => 1.0,
        "k" => 1e3,
        "M" => 1e6,
        "G" => 1e9,
        "T" => 1e12,
        "P" => 1e15,
        "E" => 1e18,
        "Ki" => 1024.0,
        "Mi" => 1024f64.powi(2),
        "Gi" => 1024f64.powi(3),
        "Ti" => 1024f64.powi(4),
        "Pi" => 1024f64.powi(5),
        "Ei" => 1024f64.powi(6),
        _ => return Err(bad("unknown suffix")),
    };
    let x = (n * mult).ceil();
    if !x.is_finite() || x > u64::MAX as f64 {
        return Err(bad("too large"));
    }
    Ok(x as u64)
}

/// A Go duration (`"30s"`, `"1m30s"`, `"1500ms"`, `"0s"`) in ms.
pub fn duration_ms(v: &Value, path: &str) -> Result<u64, ConfigError> {
    let bad = |why: &str| {
        err(
            path,
            format!("{v} is not a duration ({why}); write e.g. \"30s\", \"1500ms\" or \"1m\""),
        )
    };
    let Value::String(s) = v else {
        return Err(bad("not a string"));
    };
    let s = s.trim();
    if s == "0" {
        return Ok(0);
    }
    if s.is_empty() || s.starts_with('-') {
        return Err(bad("empty or negative"));
    }
    let mut rest = s;
    let mut total_ms = 0f64;
    while !rest.is_empty() {
        let end = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .ok_or_else(|| bad("a number without a unit"))?;
        let (num, tail) = rest.split_at(end);
        let n: f64 = num.parse().map_err(|_| bad("bad number"))?;
        let unit_end = tail
            .find(|c: char| c.is_ascii_digit() || c == '.')
            .unwrap_or(tail.len());
        let (unit, next) = tail.split_at(unit_end);
        let ms = match unit {
            "ns" => 1e-6,
            "us" | "µs" => 1e-3,
            "ms" => 1.0,
            "s" => 1e3,
            "m" => 60e3,
            "h" => 3600e3,
            _ => return Err(bad("unknown unit")),
        };
        total_ms += n * ms;
        rest = next;
    }
    if !total_ms.is_finite() || total_ms > 1e15 {
        return Err(bad("too large"));
    }
    Ok(total_ms.ceil() as u64)
}

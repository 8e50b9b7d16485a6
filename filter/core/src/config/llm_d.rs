//! The parts of llm-d's `EndpointPickerConfig` that are not scheduling
//! plugins kvroute runs: plugin types kvroute accepts but has no work for
//! (their names are in `scheduling/registry.rs`), plugin types it refuses
//! (and why), and the top-level
//! sections `featureGates`, `dataLayer`, `flowControl`, `requestHandler`,
//! `parser` and `saturationDetector`.
//!
//! The rule for each: accept what kvroute honours with llm-d's meaning;
//! ignore only what cannot change a routing decision (each such key is listed
//! in `docs/configuration.md`); refuse the rest with a message that names it
//! and says why.

use super::check::{err, Params};
use super::ConfigError;
use serde::Deserialize;
use serde_json::Value;

/// Plugins kvroute accepts in `plugins` but that have nothing to compute in
/// kvroute. Each says why accepting it cannot change a routing decision.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Inert {
    /// `single-profile-handler`: kvroute always runs its one profile.
    ProfileHandler,
    /// `decode-filter`: keeps endpoints whose `llm-d.ai/role` label is a
    /// decode role *or absent*. kvroute's endpoints carry no labels, so it
    /// keeps every endpoint.
    DecodeFilter,
    /// `utilization-detector`, `concurrency-detector`: saturation detectors,
    /// read by flow control (`flow::config`), which checks their parameters.
    Detector,
    /// Flow control's fairness, ordering and usage-limit policies, read by
    /// `flow::config` when a band or `flowControl` names them.
    FlowPolicy,
    /// `openai-parser`: kvroute parses the OpenAI API itself.
    Parser,
    /// llm-d's data-layer sources and extractors: kvroute's collector polls
    /// `/metrics` and finds endpoints from the `endpoints` section.
    DataLayer,
}

impl Inert {
    /// Why the plugin may not be listed in a scheduling profile, or `None`
    /// when it may (and is then skipped).
    pub(super) fn profile_error(self) -> Option<&'static str> {
        match self {
            Inert::DecodeFilter => None,
            Inert::ProfileHandler => Some("is a profile handler; llm-d names it in `plugins` only, not in a profile"),
            Inert::Detector => Some("is a saturation detector; kvroute accepts it for `saturationDetector` but does not run its filter role (dropping endpoints over queue/KV limits) in a profile"),
            Inert::Parser => Some("is a request parser; reference it from `requestHandler.parsers`, not from a profile"),
            Inert::DataLayer => Some("is a data-layer plugin; reference it from `dataLayer`, not from a profile"),
            Inert::FlowPolicy => Some("is a flow-control policy; reference it from `flowControl`, not from a profile"),
        }
    }
}

/// Why kvroute refuses an llm-d plugin type it knows of, or `None` for a
/// type it has never heard of.
pub(crate) fn unsupported_reason(kind: &str) -> Option<&'static str> {
    const PD: &str = "prefill/decode (or encode) disaggregation is not supported: kvroute runs one scheduling profile over one pool of servers that each do prefill and decode";
    Some(match kind {
        "pd-profile-handler" | "disagg-profile-handler" | "disagg-headers-handler"
        | "prefill-header-handler" | "always-disagg-pd-decider" | "prefix-based-pd-decider"
        | "always-disagg-multimodal-decider" | "prefill-filter" | "encode-filter"
        | "data-parallel-profile-handler" | "disaggregatedset-rollout-screener" => PD,
        "header-profile-handler" => "it picks among several profiles per request; kvroute runs one profile",
        "latency-scorer" | "predicted-latency-producer" | "slo-headroom-tier-filter"
        | "latency-slo-admitter" => "it needs llm-d's latency-predictor sidecars; use prefix-cache-affinity-filter with token-load-scorer or active-request-scorer",
        "random-picker" => "kvroute has max-score-picker and weighted-random-picker",
        "program-aware-fairness" | "slo-deadline-ordering-policy" | "priority-holdback-policy"
        | "soft-reflective-ceiling-policy" => "kvroute's flow control runs global-strict-fairness-policy, round-robin-fairness-policy, fcfs-ordering-policy, edf-ordering-policy and static-usage-limit-policy only",
        "sheddable-eviction-filter" | "priority-then-time-eviction-order-policy" => "kvroute does not evict in-flight requests (flowControl.enableEviction)",
        "agent-identity" => "kvroute has no request attributes; for session affinity, list `{\"attribute\": \"agent-identity\"}` in session-affinity-*'s `sessionIdConfig.sources` without this plugin (kvroute reads the same headers, x-claude-code-session-id, x-session-affinity, session-id, session_id), and for fairness set flow control's fairness header",
        "probabilistic-admitter" => "kvroute's admission is flow control's (featureGates: flowControl); it has no probabilistic admitter",
        "load-aware-scorer" | "running-requests-size-scorer" | "context-length-aware"
        | "label-selector-filter" | "by-label" | "by-label-selector"
        | "endpoint-attribute-filter" | "endpoint-attribute-scorer" | "topology-affinity-filter"
        | "topology-affinity-scorer" | "utilization-filter" | "header-label-affinity-scorer"
        | "mm-embeddings-cache-scorer" | "mm-embeddings-cache-producer"
        | "burst-prefix-cache-producer" | "p2p-source-producer" | "session-id-producer"
        | "no-hit-lru-filter" | "request-attribute-reporter"
        | "file-discovery" | "dcgm-data-source" | "dcgm-extractor" | "topology-extractor" => "kvroute does not implement it",
        // llm-d-router `pkg/epp/framework/plugins/requesthandling/parsers/`:
        // each parser claims path suffixes; kvroute routes the OpenAI ones
        // (`routing.paths`) and passes any other request on untouched.
        "vllmgrpc-parser" | "vertexai-parser" => "kvroute routes HTTP/JSON OpenAI-compatible requests only; it does not parse gRPC request bodies",
        "sglanghttp-parser" => "it parses SGLang's own /generate, not the OpenAI-compatible API, and kvroute does not route that path; for the OpenAI paths list openai-parser only",
        k if k.starts_with("multicluster-") => "multi-cluster routing is not supported: kvroute routes within one Envoy cluster",
        _ => return None,
    })
}

// ---------------------------------------------------------------------------
// Top-level sections.

/// What kvroute does with each feature gate llm-d has had.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Gate {
    /// `flowControl` (off unless listed): flow control (`flow/`).
    FlowControl,
    /// `haPopulateNonLeaderDatastore` (on unless listed): llm-d's standby
    /// replicas keep their datastore warm. kvroute has no leader: every
    /// Envoy keeps its own state, so the gate has nothing to switch.
    NoEffect,
    /// A gate llm-d removed when its behaviour became the only one; current
    /// llm-d refuses it as unknown. kvroute loads it, with a warning.
    Removed,
}

/// llm-d's feature gates. `flowControl` and `haPopulateNonLeaderDatastore`
/// are the ones llm-d-router registers today (`cmd/epp/runner/runner.go`,
/// `loader.RegisterFeatureGate`); `dataLayer`, `prepareDataPlugins` and
/// `enableLegacyMetrics` were removed in 2026.
const FEATURE_GATES: &[(&str, Gate)] = &[
    ("flowControl", Gate::FlowControl),
    ("haPopulateNonLeaderDatastore", Gate::NoEffect),
    ("dataLayer", Gate::Removed),
    ("prepareDataPlugins", Gate::Removed),
    ("enableLegacyMetrics", Gate::Removed),
];

/// A gate's value after `=`, as llm-d reads it (Go's `strconv.ParseBool`
/// of the lower-cased, trimmed text).
fn gate_value(v: &str) -> Option<bool> {
    match v.trim().to_ascii_lowercase().as_str() {
        "1" | "t" | "true" => Some(true),
        "0" | "f" | "false" => Some(false),
        _ => None,
    }
}

/// Validates `featureGates` key by key; returns whether the `flowControl`
/// gate is on (flow control, `flow/`). A removed gate adds a warning.
pub(super) fn feature_gates(
    gates: &[String],
    warnings: &mut Vec<String>,
) -> Result<bool, ConfigError> {
    let mut flow_control = false;
    for (i, g) in gates.iter().enumerate() {
        let path = format!("featureGates[{i}]");
        let (name, on) = match g.split_once('=') {
            None => (g.as_str(), true),
            Some((n, v)) => match gate_value(v) {
                Some(on) => (n, on),
                None => {
                    return Err(err(
                        path,
                        format!("\"{v}\" is not allowed after '='; use true or false (or 1/0, t/f), or the bare gate name"),
                    ))
                }
            },
        };
        let Some((_, gate)) = FEATURE_GATES.iter().find(|(n, _)| *n == name) else {
            let known: Vec<&str> = FEATURE_GATES.iter().map(|(n, _)| *n).collect();
            return Err(err(
                path,
                format!(
                    "unknown feature gate \"{name}\"; llm-d's gates are: {}",
                    known.join(", ")
                ),
            ));
        };
        match gate {
            Gate::FlowControl => flow_control = on,
            Gate::NoEffect => {}
            Gate::Removed => warnings.push(format!(
                "`{path}`: llm-d removed the \"{name}\" gate when its behaviour became the only one, and current llm-d refuses it as unknown; it changes nothing in kvroute: remove it"
            )),
        }
    }
    Ok(flow_control)
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct PluginRef {
    plugin_ref: String,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct DataLayer {
    #[serde(default)]
    inject_defaults: Option<bool>,
    #[serde(default)]
    sources: Vec<DataLayerSource>,
    #[serde(default)]
    discovery: Option<Value>,
    #[serde(default)]
    peer_discovery: Option<Value>,
    #[serde(default)]
    cross_replica_syncer_plugin_ref: Option<String>,
    #[serde(default)]
    cross_replica_sync_interval: Option<Value>,
}

/// `dataLayer.sources[]` (llm-d-router `apix/config/v1alpha1`).
#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct DataLayerSource {
    plugin_ref: String,
    #[serde(default)]
    extractors: Vec<PluginRef>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RequestHandler {
    #[serde(default)]
    parsers: Vec<PluginRef>,
}

/// The top-level llm-d sections, as written.
#[derive(Default)]
pub(super) struct Sections {
    pub data_layer: Option<Value>,
    pub request_handler: Option<Value>,
    pub parser: Option<Value>,
    pub saturation_detector: Option<Value>,
}

/// What the request parsers a config lists change.
pub(super) struct Parsers {
    /// `passthrough-parser` is listed: requests on paths kvroute does not
    /// parse are routed at their headers, on load alone
    /// (`RoutingConfig::passthrough`).
    pub passthrough: bool,
}

/// Validates the top-level sections against the declared plugins
/// (`(name, canonical type)`). Only a listed `passthrough-parser` changes
/// a decision (it is returned); any other part that would is refused.
pub(super) fn sections(
    s: &Sections,
    plugins: &[(String, String)],
    warnings: &mut Vec<String>,
) -> Result<Parsers, ConfigError> {
    let type_of = |name: &str| {
        plugins
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, t)| t.as_str())
    };
    let refers_to = |path: &str, name: &str, want: &[&str], what: &str| match type_of(name) {
        None => Err(err(
            path,
            format!("no plugin named \"{name}\" in `plugins` (names default to the type)"),
        )),
        Some(t) if want.contains(&t) => Ok(()),
        Some(t) => Err(err(path, format!("\"{name}\" is a {t}; {what}"))),
    };
    const DETECTORS: &[&str] = &[
        "utilization-detector",
        "concurrency-detector",
        "kvroute-saturation-detector",
    ];

    if let Some(v) = &s.saturation_detector {
        warnings.push("`saturationDetector`: deprecated in llm-d for `flowControl.saturationDetector`, which wins when both are set (kvroute reads it the same way)".to_string());
        let r: PluginRef = super::check::strict_value_req(v, "saturationDetector")?;
        refers_to(
            "saturationDetector.pluginRef",
            &r.plugin_ref,
            DETECTORS,
            "it must name a utilization-detector, concurrency-detector or kvroute-saturation-detector",
        )?;
    }
    if let Some(v) = &s.data_layer {
        let dl: DataLayer = super::check::strict_value_req(v, "dataLayer")?;
        if dl.cross_replica_syncer_plugin_ref.is_some() {
            return Err(err("dataLayer.crossReplicaSyncerPluginRef", "kvroute cannot share in-flight load between gateway replicas: each Envoy counts its own requests (shared by its workers); remove it"));
        }
        if dl.cross_replica_sync_interval.is_some() {
            return Err(err(
                "dataLayer.crossReplicaSyncInterval",
                "kvroute has no cross-replica syncer; remove it",
            ));
        }
        if dl.peer_discovery.is_some() {
            return Err(err(
                "dataLayer.peerDiscovery",
                "kvroute has no peer discovery between gateway replicas; remove it",
            ));
        }
        if dl.discovery.is_some() {
            return Err(err(
                "dataLayer.discovery",
                "kvroute finds endpoints from its `endpoints` section (a static list or an Envoy cluster); remove it",
            ));
        }
        // The sources and extractors are kvroute's collector; each
        // reference must name a declared plugin of its kind.
        for (i, src) in dl.sources.iter().enumerate() {
            let path = format!("dataLayer.sources[{i}]");
            match type_of(&src.plugin_ref) {
                Some(t) if t.ends_with("-source") => {}
                _ => refers_to(
                    &format!("{path}.pluginRef"),
                    &src.plugin_ref,
                    &[],
                    "it must name a data source (e.g. metrics-data-source)",
                )?,
            }
            for (j, x) in src.extractors.iter().enumerate() {
                match type_of(&x.plugin_ref) {
                    // llm-d's precise producer is an extractor of the
                    // endpoint-notification source.
                    Some(t) if t.ends_with("-extractor") || t.ends_with("-producer") => {}
                    _ => refers_to(
                        &format!("{path}.extractors[{j}].pluginRef"),
                        &x.plugin_ref,
                        &[],
                        "it must name an extractor (e.g. core-metrics-extractor) or a producer that extracts",
                    )?,
                }
            }
        }
        let _ = dl.inject_defaults;
    }
    let passthrough = std::cell::Cell::new(false);
    let parser_ref = |path: &str, name: &str| {
        refers_to(
            path,
            name,
            &["openai-parser", "anthropic-parser", "vllmhttp-parser", "passthrough-parser"],
            "kvroute parses OpenAI-compatible bodies (openai-parser), Anthropic's /v1/messages (anthropic-parser) and vLLM's /inference/v1/generate (vllmhttp-parser, which also covers the OpenAI paths), and routes other requests on load alone (passthrough-parser)",
        )?;
        if type_of(name) == Some("passthrough-parser") {
            passthrough.set(true);
        }
        Ok(())
    };
    if let Some(v) = &s.request_handler {
        let rh: RequestHandler = super::check::strict_value_req(v, "requestHandler")?;
        for (i, p) in rh.parsers.iter().enumerate() {
            parser_ref(
                &format!("requestHandler.parsers[{i}].pluginRef"),
                &p.plugin_ref,
            )?;
        }
    }
    if let Some(v) = &s.parser {
        warnings.push("`parser`: deprecated in llm-d for `requestHandler.parsers`".to_string());
        let p: PluginRef = super::check::strict_value_req(v, "parser")?;
        parser_ref("parser.pluginRef", &p.plugin_ref)?;
    }
    Ok(Parsers {
        passthrough: passthrough.get(),
    })
}

// ---------------------------------------------------------------------------
// Parameters of the inert plugins: checked for llm-d's names and ranges so a
// typo is still an error (the detectors' are then read by `flow::config`).

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub(crate) struct UtilizationDetectorParams {
    pub queue_depth_threshold: Option<i64>,
    pub kv_cache_util_threshold: Option<f64>,
    pub metrics_staleness_threshold: Option<String>,
    pub headroom: Option<f64>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub(crate) struct ConcurrencyDetectorParams {
    pub max_concurrency: Option<i64>,
    pub headroom: Option<f64>,
    pub concurrency_mode: Option<String>,
    pub max_token_concurrency: Option<i64>,
    pub in_flight_load_producer_name: Option<String>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct NoParams {}

/// `metrics-data-source` parameters (llm-d-router
/// `datalayer/source/metrics/datasource.go`).
#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct MetricsSourceParams {
    scheme: Option<String>,
    /// Checked against `collector.metricsPath` ([`metrics_source_path`]).
    path: Option<String>,
    port: Option<Value>,
    insecure_skip_verify: Option<bool>,
    ca_cert_path: Option<String>,
    client_cert_path: Option<String>,
    client_key_path: Option<String>,
    interval: Option<String>,
}

/// `core-metrics-extractor` parameters (llm-d-router
/// `datalayer/extractor/metrics/factories.go`).
#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct MetricsExtractorParams {
    engine_label_key: Option<String>,
    default_engine: Option<String>,
    engine_configs: Option<Value>,
}

/// The `path` a `metrics-data-source` gives, if any (its parameters were
/// checked when the plugin compiled).
pub(super) fn metrics_source_path(params: &Option<Value>) -> Option<&str> {
    params.as_ref()?.get("path")?.as_str()
}

/// Checks an inert plugin's parameters.
pub(crate) fn inert_params(p: &Params, role: Inert) -> Result<(), ConfigError> {
    let (kind, params, ppath) = (p.kind, p.value, p.path.as_str());
    let positive = |field: &str, v: Option<i64>| match v {
        Some(n) if n <= 0 => Err(err(
            format!("{ppath}.{field}"),
            format!("{n} is out of range: must be > 0"),
        )),
        _ => Ok(()),
    };
    let headroom = |v: Option<f64>| match v {
        Some(h) if !h.is_finite() || h < 0.0 => Err(err(
            format!("{ppath}.headroom"),
            format!("{h} is out of range: must be ≥ 0"),
        )),
        _ => Ok(()),
    };
    match (role, kind) {
        (Inert::Detector, "utilization-detector") => {
            let q: UtilizationDetectorParams = super::check::strict_value(params, ppath)?;
            positive("queueDepthThreshold", q.queue_depth_threshold)?;
            if let Some(k) = q.kv_cache_util_threshold {
                if !k.is_finite() || k <= 0.0 || k > 1.0 {
                    return Err(err(
                        format!("{ppath}.kvCacheUtilThreshold"),
                        format!("{k} is out of range: must be in (0, 1]"),
                    ));
                }
            }
            headroom(q.headroom)?;
            let _ = q.metrics_staleness_threshold;
        }
        // kvroute's own detector: checked by `flow::config`.
        (Inert::Detector, "kvroute-saturation-detector") => {}
        (Inert::Detector, _) => {
            let q: ConcurrencyDetectorParams = super::check::strict_value(params, ppath)?;
            positive("maxConcurrency", q.max_concurrency)?;
            positive("maxTokenConcurrency", q.max_token_concurrency)?;
            headroom(q.headroom)?;
            if let Some(m) = &q.concurrency_mode {
                if m != "requests" && m != "tokens" {
                    return Err(err(
                        format!("{ppath}.concurrencyMode"),
                        format!("\"{m}\" is not allowed; use \"requests\" or \"tokens\""),
                    ));
                }
            }
            let _ = q.in_flight_load_producer_name;
        }
        // The metrics source and extractor are kvroute's collector, which
        // polls each endpoint's `collector.metricsPath` through the Envoy
        // cluster `collector.metricsCluster` and reads vLLM's metrics.
        (Inert::DataLayer, "metrics-data-source") => {
            let q: MetricsSourceParams = super::check::strict_value(params, ppath)?;
            match q.scheme.as_deref() {
                None | Some("http") => {}
                Some("https") => p.warn("scheme", "kvroute's collector polls /metrics through the Envoy cluster `collector.metricsCluster`: TLS is that cluster's transport socket, not this parameter"),
                Some(o) => return Err(p.err("scheme", format!("\"{o}\" is not allowed; use \"http\" or \"https\""))),
            }
            if q.port.is_some() {
                return Err(p.err("port", "kvroute's collector polls each endpoint's metrics at the endpoint's own address (ip:port); a separate metrics port is not supported"));
            }
            if let Some(path) = &q.path {
                if !path.starts_with('/') {
                    return Err(p.err("path", format!("\"{path}\" must start with '/'")));
                }
            }
            for (field, given) in [
                ("caCertPath", q.ca_cert_path.is_some()),
                ("clientCertPath", q.client_cert_path.is_some()),
                ("clientKeyPath", q.client_key_path.is_some()),
            ] {
                if given {
                    p.warn(field, "not read: TLS to the servers' /metrics is the Envoy cluster `collector.metricsCluster`'s transport socket");
                }
            }
            if let Some(i) = &q.interval {
                p.warn("interval", format!("not read: kvroute's collector polls every `collector.metricsPollIntervalMs` (give \"{i}\" there in ms)"));
            }
            let _ = q.insecure_skip_verify;
        }
        (Inert::DataLayer, "core-metrics-extractor") => {
            let q: MetricsExtractorParams = super::check::strict_value(params, ppath)?;
            if let Some(e) = q.default_engine.as_deref().filter(|e| *e != "vllm") {
                return Err(p.err("defaultEngine", format!("\"{e}\": kvroute's collector reads vLLM's metrics only (vllm:num_requests_waiting, vllm:kv_cache_usage_perc, vllm:cache_config_info, …)")));
            }
            if q.engine_configs.is_some() {
                return Err(p.err("engineConfigs", "kvroute's collector reads vLLM's metrics by their own names; other engines' or custom metric mappings are not supported"));
            }
            // Which pod label names the engine: kvroute's endpoints carry
            // no labels, and every one is read as vLLM.
            let _ = q.engine_label_key;
        }
        // The other data-layer plugins (models, endpoint notifications)
        // feed llm-d's datastore; kvroute finds endpoints from its
        // `endpoints` section, so their parameters are not read.
        (Inert::DataLayer, _) => {}
        // `threshold`, checked by `flow::config` when flowControl names it.
        (Inert::FlowPolicy, "static-usage-limit-policy") => {
            #[derive(Deserialize, Default)]
            #[serde(deny_unknown_fields)]
            struct Threshold {
                #[allow(dead_code)]
                threshold: Option<f64>,
            }
            super::check::strict_value::<Threshold>(params, ppath)?;
        }
        _ => {
            strict_value_no_params(params, ppath)?;
        }
    }
    Ok(())
}

fn strict_value_no_params(params: &Option<Value>, ppath: &str) -> Result<(), ConfigError> {
    super::check::strict_value::<NoParams>(params, ppath).map(|_| ())
}

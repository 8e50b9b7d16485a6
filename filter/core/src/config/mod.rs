//! The plugin configuration: llm-d's `EndpointPickerConfig` shape
//! (`plugins`, `schedulingProfiles`, and the other llm-d sections, see
//! [`llm_d`]) plus kvroute's own sections (`endpoints`, `routing`,
//! `collector`, `kvEvents`, `sharedState`: `sections.rs`). Each plugin's
//! parameters are compiled in its own file, found through
//! `scheduling/registry.rs`; this file reads the document, names the
//! plugins and builds the one scheduling profile.
//!
//! Strict: unknown fields and out-of-range values are errors that name the
//! field path (`plugins[2].parameters.affinityThreshold`) and say what is
//! allowed. A config is validated whole before anything uses it, so a
//! rejected config is never half-applied. Defaults match llm-d's. The full
//! reference is `docs/configuration.md`.

use crate::blocks::BlockConfig;
use crate::precise::{PreciseConfig, TokenizerConfig};
use crate::scheduling::max_score::TieBreak;
use crate::scheduling::prefix_cache::PrefixCacheScorer;
use crate::scheduling::registry::{self, Compiled};
use crate::scheduling::session::Role as SessionRole;
use crate::scheduling::{Picker, Scheduler, Scorer};
use check::{err, strict, Params};
use serde::Deserialize;
use serde_json::Value;
use std::cell::RefCell;
use std::fmt;

pub(crate) mod check;
pub(crate) mod llm_d;
pub(crate) mod producers;
mod sections;
pub use producers::PrefixProducerConfig;
pub use sections::{
    CollectorConfig, CollectorMode, EndpointSource, FailureMode, KvEventsConfig, RoutingConfig,
    SharedStateConfig, ORIGINAL_DST_HOST_HEADER, RELAY_HOST_HEADER,
};
use sections::{RawCollector, RawEndpoints, RawKvEvents, RawMesh, RawRouting, RawSharedState};

/// A configuration error: where, and what is wrong.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConfigError {
    /// JSON path of the offending field, e.g. `plugins[2].parameters.affinityThreshold`.
    pub path: String,
    pub message: String,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.path.is_empty() {
            write!(f, "invalid kvroute config: {}", self.message)
        } else {
            write!(
                f,
                "invalid kvroute config at `{}`: {}",
                self.path, self.message
            )
        }
    }
}

impl std::error::Error for ConfigError {}

/// The whole validated configuration.
#[derive(Clone, Debug, PartialEq)]
pub struct Config {
    pub scheduler: Scheduler,
    pub prefix: PrefixProducerConfig,
    /// Precise mode (`precise-prefix-cache-producer`): vLLM's own block
    /// hashes; `None` = approximate only.
    pub precise: Option<PreciseConfig>,
    pub endpoints: EndpointSource,
    pub routing: RoutingConfig,
    pub collector: CollectorConfig,
    pub kv_events: KvEventsConfig,
    pub shared_state: SharedStateConfig,
    /// The mesh exchange between proxies (`mesh`; `engine` `mesh`).
    pub mesh: MeshConfig,
    /// Flow control (`featureGates: ["flowControl"]`, `flowControl`,
    /// `inferenceObjectives`); `None`: every request is routed at once.
    pub flow: Option<crate::flow::FlowConfig>,
    /// What loaded but deserves the operator's attention (a deprecated
    /// llm-d parameter and what it was mapped to, a gate llm-d removed),
    /// each naming its field. `lifecycle::configure` logs each at warn.
    pub warnings: Vec<String>,
}

/// How this proxy shares its routing with the other proxies of a mesh.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct MeshConfig {
    /// `mesh.exchange` (default: on with `kvEvents`): accepted decisions
    /// go to the outbox, the collector exchanges them through each
    /// server's relay, and the other proxies' load counts in decisions.
    pub enabled: bool,
    /// ms; the other proxies' load counts this long after it arrived
    /// (0: three metrics poll intervals).
    pub peer_ttl_ms: u64,
    /// XORed into the picker's tie key (`tieBreak: prefix`): each proxy
    /// its own, so ties among an empty fleet's endpoints spread over the
    /// proxies instead of all naming one endpoint. 0: none.
    pub tie_salt: u64,
}

impl Config {
    /// Parses and validates a configuration document.
    pub fn from_json(bytes: &[u8]) -> Result<Config, ConfigError> {
        let raw: RawConfig = strict(bytes, "")?;
        compile(raw)
    }
}

// ---------------------------------------------------------------------------
// Raw shapes (serde), strict.

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct RawConfig {
    #[serde(default)]
    api_version: Option<String>,
    #[serde(default)]
    kind: Option<String>,
    #[serde(default)]
    feature_gates: Vec<String>,
    #[serde(default)]
    plugins: Vec<RawPlugin>,
    #[serde(default)]
    scheduling_profiles: Vec<RawProfile>,
    #[serde(default)]
    data_layer: Option<Value>,
    #[serde(default)]
    flow_control: Option<Value>,
    #[serde(default)]
    request_handler: Option<Value>,
    #[serde(default)]
    parser: Option<Value>,
    #[serde(default)]
    saturation_detector: Option<Value>,
    #[serde(default)]
    endpoints: Option<RawEndpoints>,
    #[serde(default)]
    routing: RawRouting,
    #[serde(default)]
    collector: RawCollector,
    #[serde(default)]
    kv_events: RawKvEvents,
    #[serde(default)]
    shared_state: RawSharedState,
    #[serde(default)]
    mesh: RawMesh,
    /// kvroute's stand-in for llm-d's `InferenceObjective` resources
    /// (`flow::config`).
    #[serde(default)]
    inference_objectives: Option<Value>,
}

#[derive(Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawPlugin {
    #[serde(default)]
    name: Option<String>,
    #[serde(rename = "type")]
    kind: String,
    #[serde(default)]
    parameters: Option<Value>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawProfile {
    name: String,
    plugins: Vec<RawProfilePlugin>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct RawProfilePlugin {
    plugin_ref: String,
    #[serde(default)]
    weight: Option<f64>,
}

/// Compiles `plugins[i]`: a registered type ([`registry::PLUGINS`]), or an
/// error that says why not.
fn compile_plugin(
    p: &RawPlugin,
    path: &str,
    producers: &[String],
    warnings: &RefCell<Vec<String>>,
) -> Result<Compiled, ConfigError> {
    let kind = registry::canonical_type(&p.kind);
    let params = Params {
        kind,
        value: &p.parameters,
        path: format!("{path}.parameters"),
        producers,
        warnings,
    };
    if let Some(plugin) = registry::lookup(kind) {
        if kind != p.kind {
            let status = if p.kind == "tokenizer" {
                "deprecated in llm-d since v0.9 (removal planned for v0.11)"
            } else {
                "a Gateway API Inference Extension name that current llm-d no longer accepts"
            };
            warnings.borrow_mut().push(format!(
                "`{path}.type`: \"{}\" is an older name of \"{kind}\", {status}; use \"{kind}\"",
                p.kind
            ));
        } else if kind == producers::PRECISE_PREFIX_SCORER {
            warnings.borrow_mut().push(format!(
                "`{path}.type`: precise-prefix-cache-scorer is deprecated in llm-d: declare precise-prefix-cache-producer and a prefix-cache-scorer with `prefixMatchInfoProducerName` naming it"
            ));
        }
        return registry::compile(plugin, &params);
    }
    if let Some(why) = llm_d::unsupported_reason(kind) {
        return Err(err(
            format!("{path}.type"),
            format!("llm-d plugin type \"{}\" is not supported: {why}", p.kind),
        ));
    }
    Err(err(
        format!("{path}.type"),
        format!(
            "unknown plugin type \"{kind}\"; kvroute supports: {}",
            registry::supported_types()
        ),
    ))
}

// The duplicate checks read better as nested ifs than as match guards with side effects.
#[allow(clippy::collapsible_match)]
fn compile(raw: RawConfig) -> Result<Config, ConfigError> {
    if let Some(k) = &raw.kind {
        if k != "EndpointPickerConfig" {
            return Err(err(
                "kind",
                format!("\"{k}\" is not supported; use \"EndpointPickerConfig\" or leave it out"),
            ));
        }
    }
    let warnings = RefCell::new(Vec::new());
    if raw.api_version.as_deref() == Some("inference.networking.x-k8s.io/v1alpha1") {
        warnings.borrow_mut().push("`apiVersion`: inference.networking.x-k8s.io/v1alpha1 is deprecated in llm-d for llm-d.ai/v1alpha1".to_string());
    }
    let flow_gate = llm_d::feature_gates(&raw.feature_gates, &mut warnings.borrow_mut())?;

    // Names: `name` defaults to `type`; must be unique.
    let names: Vec<String> = raw
        .plugins
        .iter()
        .map(|p| p.name.clone().unwrap_or_else(|| p.kind.clone()))
        .collect();
    for (i, n) in names.iter().enumerate() {
        if names[..i].contains(n) {
            return Err(err(
                format!("plugins[{i}].name"),
                format!("duplicate plugin name \"{n}\"; give each instance its own `name`"),
            ));
        }
    }
    let producer_names: Vec<String> = raw
        .plugins
        .iter()
        .zip(&names)
        .filter(|(p, _)| p.kind.ends_with("-producer"))
        .map(|(_, n)| n.clone())
        .collect();

    let declared: Vec<(String, String)> = raw
        .plugins
        .iter()
        .zip(&names)
        .map(|(p, n)| (n.clone(), registry::canonical_type(&p.kind).to_string()))
        .collect();

    let mut compiled = Vec::with_capacity(raw.plugins.len());
    let mut prefix = None;
    let mut inflight = None;
    let mut precise: Option<PreciseConfig> = None;
    let mut tokenizers = Vec::new();
    // The index a `prefix-cache-scorer` configured with its old parameters
    // (`producers::legacy_scorer_index`), and which plugin gave it.
    let mut legacy_prefix: Option<(usize, PrefixProducerConfig)> = None;
    for (i, p) in raw.plugins.iter().enumerate() {
        let path = format!("plugins[{i}]");
        let c = if registry::canonical_type(&p.kind) == crate::scheduling::prefix_cache::TYPE {
            let (own, index) = producers::legacy_scorer_index(
                &p.parameters,
                &format!("{path}.parameters"),
                &warnings,
            )?;
            if let Some(index) = index {
                match &legacy_prefix {
                    Some((j, other)) if *other != index => {
                        return Err(err(
                            format!("{path}.parameters"),
                            format!("gives the prefix index other parameters than plugins[{j}] does; kvroute keeps one index: give them once, on approx-prefix-cache-producer"),
                        ))
                    }
                    Some(_) => {}
                    None => legacy_prefix = Some((i, index)),
                }
            }
            let stripped = RawPlugin {
                parameters: own,
                ..p.clone()
            };
            compile_plugin(&stripped, &path, &producer_names, &warnings)?
        } else {
            compile_plugin(p, &path, &producer_names, &warnings)?
        };
        match &c {
            Compiled::Prefix(x) => {
                if prefix.replace(x.clone()).is_some() {
                    return Err(err(
                        path,
                        "kvroute supports one approx-prefix-cache-producer",
                    ));
                }
            }
            Compiled::Inflight(x) => {
                if inflight.replace(x.clone()).is_some() {
                    return Err(err(path, "kvroute supports one inflight-load-producer"));
                }
            }
            Compiled::Precise { config, .. } => {
                if precise.replace(config.clone()).is_some() {
                    return Err(err(
                        path,
                        "kvroute supports one precise-prefix-cache-producer (or -scorer)",
                    ));
                }
            }
            Compiled::Tokenizer(t) => {
                let served = |n: &&String| {
                    tokenizers
                        .iter()
                        .any(|o: &TokenizerConfig| o.model_names.contains(n))
                };
                if let Some(n) = t.model_names.iter().find(served) {
                    return Err(err(
                        format!("{path}.parameters"),
                        format!("model \"{n}\" already has a token-producer: one per model"),
                    ));
                }
                tokenizers.push(t.clone());
            }
            _ => {}
        }
        compiled.push(c);
    }

    let parsers = llm_d::sections(
        &llm_d::Sections {
            data_layer: raw.data_layer.clone(),
            request_handler: raw.request_handler.clone(),
            parser: raw.parser.clone(),
            saturation_detector: raw.saturation_detector.clone(),
        },
        &declared,
        &mut warnings.borrow_mut(),
    )?;

    // Profile: exactly one (kvroute has no P/D disaggregation), or none →
    // llm-d's optimized baseline over the configured plugins.
    let mut filters = Vec::new();
    let mut scorers = Vec::new();
    let mut picker = None;
    let mut session = None;
    match raw.scheduling_profiles.len() {
        0 => {
            let runs_in_profile = |c: &Compiled| {
                matches!(
                    c,
                    Compiled::Filter(_)
                        | Compiled::Scorer(_)
                        | Compiled::Picker(_)
                        | Compiled::Session(_)
                )
            };
            if compiled.iter().any(runs_in_profile) {
                return Err(err("schedulingProfiles", "plugins other than producers are configured but no scheduling profile uses them; add a profile"));
            }
            let d = Scheduler::default();
            filters = d.filters;
            scorers = d.scorers;
            picker = Some(d.picker);
        }
        1 => {
            let prof = &raw.scheduling_profiles[0];
            if prof.name.is_empty() {
                return Err(err("schedulingProfiles[0].name", "must not be empty"));
            }
            for (j, r) in prof.plugins.iter().enumerate() {
                let path = format!("schedulingProfiles[0].plugins[{j}]");
                let Some(k) = names.iter().position(|n| *n == r.plugin_ref) else {
                    return Err(err(
                        format!("{path}.pluginRef"),
                        format!(
                            "no plugin named \"{}\" in `plugins` (names default to the type)",
                            r.plugin_ref
                        ),
                    ));
                };
                let weight = match r.weight {
                    None => 1.0,
                    Some(w) if w.is_finite() && w >= 0.0 => w,
                    Some(w) => {
                        return Err(err(
                            format!("{path}.weight"),
                            format!("{w} is out of range: must be a finite number ≥ 0"),
                        ))
                    }
                };
                match &compiled[k] {
                    Compiled::Filter(f) => {
                        if r.weight.is_some() {
                            return Err(err(format!("{path}.weight"), "only scorers take a weight"));
                        }
                        filters.push(f.clone())
                    }
                    Compiled::Scorer(s) => scorers.push((s.clone(), weight)),
                    Compiled::Session(s) => {
                        if !s.profile_name.is_empty() && s.profile_name != prof.name {
                            return Err(err(
                                format!("plugins[{k}].parameters.profileName"),
                                format!("\"{}\" is not the profile that lists it (\"{}\"): kvroute runs one profile, so leave profileName empty or name that one (prefill/decode disaggregation is not supported)", s.profile_name, prof.name),
                            ));
                        }
                        if session.is_some() {
                            return Err(err(format!("{path}.pluginRef"), "a profile has one session-affinity plugin (llm-d advises against combining the scorer and the filter: they keep separate bindings)"));
                        }
                        match s.role {
                            SessionRole::Scorer => {
                                scorers.push((Scorer::SessionAffinity, weight))
                            }
                            SessionRole::Filter if r.weight.is_some() => {
                                return Err(err(format!("{path}.weight"), "only scorers take a weight"));
                            }
                            SessionRole::Filter => {}
                        }
                        session = Some(s.clone());
                    }
                    Compiled::Picker(p) => {
                        if picker.replace(*p).is_some() {
                            return Err(err(format!("{path}.pluginRef"), "a profile has one picker"));
                        }
                    }
                    Compiled::Precise { scorer: true, .. } => {
                        // The deprecated scorer: precise matches, scored as
                        // prefix-cache-scorer scores them (matched / total).
                        scorers.push((
                            Scorer::PrefixCache(PrefixCacheScorer {
                                match_length_weight: 0.0,
                                ..PrefixCacheScorer::default()
                            }),
                            weight,
                        ))
                    }
                    Compiled::Tokenizer(_) => {
                        // Older llm-d listed the tokenizer in the profile
                        // (a PrepareData plugin); it runs for every request
                        // either way.
                        if r.weight.is_some() {
                            return Err(err(format!("{path}.weight"), "only scorers take a weight"));
                        }
                    }
                    Compiled::Prefix(_) | Compiled::Inflight(_) | Compiled::Precise { .. } => {
                        return Err(err(format!("{path}.pluginRef"), format!("\"{}\" is a data producer; producers run for every request and are not listed in a profile", r.plugin_ref)))
                    }
                    Compiled::Inert(role) => {
                        if let Some(why) = role.profile_error() {
                            return Err(err(format!("{path}.pluginRef"), format!("\"{}\" {why}", r.plugin_ref)));
                        }
                        if r.weight.is_some() {
                            return Err(err(format!("{path}.weight"), "only scorers take a weight"));
                        }
                    }
                }
            }
        }
        n => {
            return Err(err("schedulingProfiles", format!("kvroute runs one scheduling profile; found {n} (prefill/decode disaggregation is not supported)")));
        }
    }

    let mut routing = sections::routing(raw.routing)?;
    routing.passthrough = parsers.passthrough;
    let scheduler = Scheduler {
        filters,
        scorers,
        picker: picker.unwrap_or(Picker::MaxScore(TieBreak::Random)),
        inflight: inflight.unwrap_or_default(),
        max_fallbacks: routing.max_fallbacks,
        session,
    };
    let precise_index = raw
        .plugins
        .iter()
        .position(|p| registry::canonical_type(&p.kind).starts_with("precise-prefix-cache-"));
    if let Some(p) = precise.as_mut() {
        p.tokenizers = tokenizers;
    } else if !tokenizers.is_empty() {
        let i = raw
            .plugins
            .iter()
            .position(|p| registry::canonical_type(&p.kind) == "token-producer")
            .unwrap_or(0);
        return Err(err(
            format!("plugins[{i}].type"),
            "a token-producer (tokenizer) feeds only precise-prefix-cache-producer in kvroute; add one, or remove the tokenizer (approximate mode estimates tokens from bytes)",
        ));
    }
    if let (Some((j, _)), Some(_)) = (&legacy_prefix, &prefix) {
        return Err(err(
            format!("plugins[{j}].parameters"),
            "gives prefix-cache-scorer index parameters, and approx-prefix-cache-producer gives the index its own: give them once, on the producer",
        ));
    }
    let prefix = prefix.or(legacy_prefix.map(|(_, c)| c));
    let prefix = prefix.unwrap_or(PrefixProducerConfig {
        blocks: BlockConfig::default(),
        auto_tune: true,
        lru_capacity_per_server: 0,
        learn_bytes_per_token: false,
    });

    let endpoints = sections::endpoints(raw.endpoints)?;
    let collector = sections::collector(raw.collector)?;
    // llm-d's metrics-data-source is kvroute's collector: one path.
    for (i, p) in raw.plugins.iter().enumerate() {
        if registry::canonical_type(&p.kind) != "metrics-data-source" {
            continue;
        }
        if let Some(path) = llm_d::metrics_source_path(&p.parameters) {
            if path != collector.metrics_path {
                return Err(err(
                    format!("plugins[{i}].parameters.path"),
                    format!("\"{path}\" is not the path kvroute's collector polls (`collector.metricsPath`: \"{}\"); set `collector.metricsPath` to it", collector.metrics_path),
                ));
            }
        }
    }

    let kv_events = sections::kv_events(raw.kv_events)?;
    if precise.is_some() && !kv_events.enabled {
        let i = precise_index.unwrap_or(0);
        return Err(err(
            format!("plugins[{i}].type"),
            "precise matching needs the servers' held blocks: enable the `kvEvents` section (a relay beside each vLLM server; see docs/configuration.md)",
        ));
    }

    let shared_state = sections::shared_state(raw.shared_state)?;
    let mesh = sections::mesh(raw.mesh, &kv_events)?;

    let declared_params: Vec<crate::flow::config::Declared> = raw
        .plugins
        .iter()
        .zip(&names)
        .enumerate()
        .map(|(i, (p, n))| crate::flow::config::Declared {
            name: n,
            kind: registry::canonical_type(&p.kind),
            params: &p.parameters,
            path: format!("plugins[{i}].parameters"),
        })
        .collect();
    let flow = crate::flow::config::compile(&crate::flow::config::Inputs {
        gate_on: flow_gate,
        section: raw.flow_control.as_ref(),
        top_detector: raw.saturation_detector.as_ref(),
        objectives: raw.inference_objectives.as_ref(),
        plugins: &declared_params,
        metrics_stale_after_ms: collector.metrics_stale_after_ms,
        metrics_poll_ms: collector.metrics_poll_interval_ms,
    })?;

    Ok(Config {
        scheduler,
        prefix,
        precise,
        endpoints,
        routing,
        collector,
        kv_events,
        shared_state,
        mesh,
        flow,
        warnings: warnings.into_inner(),
    })
}

#[cfg(test)]
mod tests;

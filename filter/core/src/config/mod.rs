//! The plugin configuration: llm-d's `EndpointPickerConfig` shape
//! (`plugins`, `schedulingProfiles`, and the other llm-d sections, see
//! [`llm_d`]) plus kvroute's own sections (`endpoints`, `routing`,
//! `collector`, `kvEvents`, `sharedState`).
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
use crate::scheduling::{Picker, Scheduler, Scorer};
use check::{err, range_u64, strict, Params};
use serde::Deserialize;
use serde_json::Value;
use std::fmt;
use std::net::SocketAddr;

pub(crate) mod check;
pub(crate) mod llm_d;
pub(crate) mod producers;
pub use producers::PrefixProducerConfig;

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

/// Where endpoints come from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum EndpointSource {
    /// A fixed list of `ip:port`.
    Static(Vec<SocketAddr>),
    /// Members of an Envoy cluster, read from Envoy's admin
    /// `/clusters?format=json` through `admin_cluster`.
    FromCluster {
        cluster: String,
        admin_cluster: String,
        /// How often to re-read membership (ms).
        refresh_ms: u64,
    },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FailureMode {
    /// No destination header; Envoy's fallback load balancer decides.
    Open,
    /// OpenAI-style JSON error: 400 for bad bodies, 503 for no endpoints.
    Closed,
}

/// kvroute's `routing` section (the HTTP filter).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RoutingConfig {
    pub destination_header: String,
    pub max_fallbacks: usize,
    pub failure_mode: FailureMode,
    /// bytes
    pub max_body_bytes: usize,
    /// Path suffixes that are routed (POST only).
    pub paths: Vec<String>,
    pub debug_header: bool,
    /// GET on this path returns the shared state as JSON (off when `None`).
    pub state_path: Option<String>,
    /// Fixed RNG seed for reproducible tests; `None` seeds from the clock.
    pub seed: Option<u64>,
}

/// kvroute's `collector` section (the singleton).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CollectorConfig {
    /// Envoy cluster through which `/metrics` calls go; the destination
    /// header names the endpoint. `None` disables polling.
    pub metrics_cluster: Option<String>,
    pub metrics_path: String,
    /// ms
    pub metrics_poll_interval_ms: u64,
    /// ms
    pub metrics_timeout_ms: u64,
    /// ms; older metrics are ignored by scorers
    pub metrics_stale_after_ms: u64,
    /// ms; in-flight charges older than this are reaped (safety net)
    pub reap_after_ms: u64,
    /// Who runs the collector (`collector.mode`).
    pub mode: CollectorMode,
    /// ms; how long a lease holder stays the collector without renewing it
    /// (`collector.leaseMs`, `lease` mode only).
    pub lease_ms: u64,
}

/// Who runs the collector.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CollectorMode {
    /// The bootstrap singleton (`root_id: kvroute-collector`) runs it.
    Singleton,
    /// The filter's worker VMs elect one of themselves through a lease key
    /// in shared data; no singleton is needed (a singleton, if present,
    /// takes part in the election too).
    Lease,
}

/// kvroute's `kvEvents` section: the collector polls each endpoint's KV-event
/// relay (`relay/`) and keeps the blocks it holds in shared data
/// (`kvroute_shared_state::held`). Off by default.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KvEventsConfig {
    pub enabled: bool,
    /// Envoy cluster the relay calls go through: an `ORIGINAL_DST` cluster
    /// that takes the relay's `ip:port` from [`RELAY_HOST_HEADER`].
    pub cluster: String,
    /// The relay's port on the endpoint's IP, unless `relays` names it.
    pub relay_port: u16,
    /// Per-endpoint relay address overrides: endpoint `ip:port` → relay
    /// `ip:port`.
    pub relays: std::collections::BTreeMap<String, String>,
    /// ms between polls of one relay.
    pub poll_ms: u64,
    /// ms; a relay call's timeout.
    pub timeout_ms: u64,
    /// ms; an endpoint whose relay gave no good answer for this long is
    /// stale: routing uses the approximate index for it.
    pub stale_ms: u64,
    /// Most block hashes kept per endpoint (`held.rs` bound).
    pub max_held_blocks: u32,
    /// `limit` of one `/kv/events` call (hashes).
    pub max_hashes_per_poll: u32,
}

/// The header that names the host's `ip:port` to an `ORIGINAL_DST`
/// cluster (Envoy's default for `use_http_header`): the relay cluster's, and
/// `collector.metricsCluster`'s in the shipped configs, so that a poll
/// reaches the named host or no one.
pub const ORIGINAL_DST_HOST_HEADER: &str = "x-envoy-original-dst-host";
/// The relay cluster's host header ([`ORIGINAL_DST_HOST_HEADER`]).
pub const RELAY_HOST_HEADER: &str = ORIGINAL_DST_HOST_HEADER;

impl KvEventsConfig {
    /// The relay of the endpoint at `address` (`ip:port`): the override, or
    /// the endpoint's IP at `relayPort`. `None` if the address has no port.
    pub fn relay_for(&self, address: &str) -> Option<String> {
        if let Some(r) = self.relays.get(address) {
            return Some(r.clone());
        }
        let (host, _port) = address.rsplit_once(':')?;
        Some(format!("{host}:{}", self.relay_port))
    }
}

/// kvroute's `sharedState` section.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SharedStateConfig {
    /// bytes held by the prefix index in Envoy shared data
    pub index_budget_bytes: u64,
}

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
}

#[derive(Deserialize)]
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

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct RawEndpoints {
    #[serde(default, rename = "static")]
    static_list: Option<Vec<String>>,
    #[serde(default)]
    from_cluster: Option<RawFromCluster>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct RawFromCluster {
    cluster: String,
    #[serde(default = "default_admin_cluster")]
    admin_cluster: String,
    #[serde(default = "default_refresh_ms")]
    refresh_ms: u64,
}

fn default_admin_cluster() -> String {
    "envoy_admin".into()
}
fn default_refresh_ms() -> u64 {
    1000
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct RawRouting {
    destination_header: Option<String>,
    max_fallbacks: Option<u64>,
    failure_mode: Option<String>,
    max_body_bytes: Option<u64>,
    paths: Option<Vec<String>>,
    debug_header: Option<bool>,
    state_path: Option<String>,
    seed: Option<u64>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct RawCollector {
    metrics_cluster: Option<String>,
    metrics_path: Option<String>,
    metrics_poll_interval_ms: Option<u64>,
    metrics_timeout_ms: Option<u64>,
    metrics_stale_after_ms: Option<u64>,
    reap_after_ms: Option<u64>,
    mode: Option<String>,
    lease_ms: Option<u64>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct RawKvEvents {
    enabled: Option<bool>,
    cluster: Option<String>,
    relay_port: Option<u64>,
    #[serde(default)]
    relays: std::collections::BTreeMap<String, String>,
    poll_ms: Option<u64>,
    timeout_ms: Option<u64>,
    stale_ms: Option<u64>,
    max_held_blocks: Option<u64>,
    max_hashes_per_poll: Option<u64>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct RawSharedState {
    index_budget_bytes: Option<u64>,
}

/// Compiles `plugins[i]`: a registered type ([`registry::PLUGINS`]), or an
/// error that says why not.
fn compile_plugin(
    p: &RawPlugin,
    path: &str,
    producers: &[String],
) -> Result<Compiled, ConfigError> {
    let kind = registry::canonical_type(&p.kind);
    let params = Params {
        kind,
        value: &p.parameters,
        path: format!("{path}.parameters"),
        producers,
    };
    if let Some(plugin) = registry::lookup(kind) {
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
    let _ = raw.api_version;
    llm_d::feature_gates(&raw.feature_gates)?;

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
    for (i, p) in raw.plugins.iter().enumerate() {
        let path = format!("plugins[{i}]");
        let c = compile_plugin(p, &path, &producer_names)?;
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

    llm_d::sections(
        &llm_d::Sections {
            data_layer: raw.data_layer.clone(),
            flow_control: raw.flow_control.clone(),
            request_handler: raw.request_handler.clone(),
            parser: raw.parser.clone(),
            saturation_detector: raw.saturation_detector.clone(),
        },
        &declared,
    )?;

    // Profile: exactly one (kvroute has no P/D disaggregation), or none →
    // llm-d's optimized baseline over the configured plugins.
    let mut filters = Vec::new();
    let mut scorers = Vec::new();
    let mut picker = None;
    match raw.scheduling_profiles.len() {
        0 => {
            let runs_in_profile = |c: &Compiled| {
                matches!(
                    c,
                    Compiled::Filter(_) | Compiled::Scorer(_) | Compiled::Picker(_)
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
                                match_length_scale_tokens: 8192,
                                sticky_only: false,
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

    let routing = compile_routing(raw.routing)?;
    let scheduler = Scheduler {
        filters,
        scorers,
        picker: picker.unwrap_or(Picker::MaxScore(TieBreak::Random)),
        inflight: inflight.unwrap_or_default(),
        max_fallbacks: routing.max_fallbacks,
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
    let prefix = prefix.unwrap_or(PrefixProducerConfig {
        blocks: BlockConfig::default(),
        auto_tune: true,
        lru_capacity_per_server: 0,
        learn_bytes_per_token: false,
    });

    let endpoints = match raw.endpoints {
        None => return Err(err("endpoints", "required: give `{\"static\": [\"ip:port\", …]}` or `{\"fromCluster\": {\"cluster\": NAME}}`")),
        Some(RawEndpoints { static_list: Some(_), from_cluster: Some(_) }) => {
            return Err(err("endpoints", "give either `static` or `fromCluster`, not both"))
        }
        Some(RawEndpoints { static_list: Some(list), .. }) => {
            // Refuse long lists before the (quadratic) duplicate check.
            if list.len() > 1024 {
                return Err(err("endpoints.static", "at most 1024 endpoints"));
            }
            let mut addrs = Vec::with_capacity(list.len());
            for (i, s) in list.iter().enumerate() {
                let a: SocketAddr = s.parse().map_err(|_| {
                    err(format!("endpoints.static[{i}]"), format!("\"{s}\" is not an ip:port address (hostnames are not resolved; use fromCluster for DNS-backed clusters)"))
                })?;
                if addrs.contains(&a) {
                    return Err(err(format!("endpoints.static[{i}]"), format!("duplicate endpoint {a}")));
                }
                addrs.push(a);
            }
            if addrs.len() > 1024 {
                return Err(err("endpoints.static", "at most 1024 endpoints"));
            }
            EndpointSource::Static(addrs)
        }
        Some(RawEndpoints { from_cluster: Some(fc), .. }) => {
            if fc.cluster.is_empty() {
                return Err(err("endpoints.fromCluster.cluster", "must name an Envoy cluster"));
            }
            if fc.admin_cluster.is_empty() {
                return Err(err("endpoints.fromCluster.adminCluster", "must name the Envoy cluster that points at the admin listener"));
            }
            EndpointSource::FromCluster {
                refresh_ms: range_u64("endpoints.fromCluster.refreshMs", Some(fc.refresh_ms), 1000, 50, 3_600_000, "ms")?,
                cluster: fc.cluster,
                admin_cluster: fc.admin_cluster,
            }
        }
        Some(_) => return Err(err("endpoints", "give `static` or `fromCluster`")),
    };

    let c = raw.collector;
    let poll = range_u64(
        "collector.metricsPollIntervalMs",
        c.metrics_poll_interval_ms,
        1000,
        50,
        3_600_000,
        "ms",
    )?;
    let default_lease_ms = 3 * poll.max(1000);
    let collector = CollectorConfig {
        metrics_cluster: c.metrics_cluster.filter(|s| !s.is_empty()),
        metrics_path: match c.metrics_path {
            Some(p) if !p.starts_with('/') => {
                return Err(err(
                    "collector.metricsPath",
                    format!("\"{p}\" must start with '/'"),
                ))
            }
            Some(p) => p,
            None => "/metrics".into(),
        },
        metrics_poll_interval_ms: poll,
        metrics_timeout_ms: range_u64(
            "collector.metricsTimeoutMs",
            c.metrics_timeout_ms,
            500,
            10,
            60_000,
            "ms",
        )?,
        metrics_stale_after_ms: range_u64(
            "collector.metricsStaleAfterMs",
            c.metrics_stale_after_ms,
            5 * poll.max(1000),
            poll,
            86_400_000,
            "ms (at least metricsPollIntervalMs)",
        )?,
        reap_after_ms: range_u64(
            "collector.reapAfterMs",
            c.reap_after_ms,
            600_000,
            1_000,
            86_400_000,
            "ms",
        )?,
        mode: match c.mode.as_deref() {
            None | Some("singleton") => CollectorMode::Singleton,
            Some("lease") => CollectorMode::Lease,
            Some(o) => {
                return Err(err(
                    "collector.mode",
                    format!("\"{o}\" is not allowed; use \"singleton\" (the bootstrap singleton runs the collector) or \"lease\" (the worker VMs elect one)"),
                ))
            }
        },
        // The ceiling is 10 minutes, or the default when a longer poll
        // interval makes that larger: every poll interval the collector
        // accepts has a valid lease, also when `leaseMs` is not given.
        lease_ms: range_u64(
            "collector.leaseMs",
            c.lease_ms,
            default_lease_ms,
            poll.max(300),
            default_lease_ms.max(600_000),
            "ms (at least metricsPollIntervalMs and 300)",
        )?,
    };

    let kv_events = compile_kv_events(raw.kv_events)?;
    if precise.is_some() && !kv_events.enabled {
        let i = precise_index.unwrap_or(0);
        return Err(err(
            format!("plugins[{i}].type"),
            "precise matching needs the servers' held blocks: enable the `kvEvents` section (a relay beside each vLLM server; see docs/configuration.md)",
        ));
    }

    let shared_state = SharedStateConfig {
        index_budget_bytes: range_u64(
            "sharedState.indexBudgetBytes",
            raw.shared_state.index_budget_bytes,
            64 << 20,
            64 << 10,
            1 << 30,
            "bytes",
        )?,
    };

    Ok(Config {
        scheduler,
        prefix,
        precise,
        endpoints,
        routing,
        collector,
        kv_events,
        shared_state,
    })
}

fn compile_kv_events(k: RawKvEvents) -> Result<KvEventsConfig, ConfigError> {
    let poll_ms = range_u64("kvEvents.pollMs", k.poll_ms, 250, 20, 600_000, "ms")?;
    for (endpoint, relay) in &k.relays {
        for (what, v) in [("endpoint", endpoint), ("relay", relay)] {
            if v.parse::<SocketAddr>().is_err() {
                return Err(err(
                    format!("kvEvents.relays.{endpoint}"),
                    format!(
                        "{what} address \"{v}\" is not ip:port (for example \"10.0.0.7:9157\")"
                    ),
                ));
            }
        }
    }
    let cluster = k.cluster.unwrap_or_else(|| "kvroute_relays".into());
    if cluster.is_empty() {
        return Err(err("kvEvents.cluster", "must not be empty"));
    }
    Ok(KvEventsConfig {
        enabled: k.enabled.unwrap_or(false),
        cluster,
        relay_port: range_u64("kvEvents.relayPort", k.relay_port, 9157, 1, 65_535, "")? as u16,
        relays: k.relays,
        poll_ms,
        timeout_ms: range_u64("kvEvents.timeoutMs", k.timeout_ms, 1000, 10, 60_000, "ms")?,
        stale_ms: range_u64(
            "kvEvents.staleMs",
            k.stale_ms,
            (8 * poll_ms).max(2000),
            poll_ms,
            86_400_000,
            "ms (at least kvEvents.pollMs)",
        )?,
        max_held_blocks: range_u64(
            "kvEvents.maxHeldBlocks",
            k.max_held_blocks,
            65_536,
            1,
            4_194_304,
            "blocks",
        )? as u32,
        max_hashes_per_poll: range_u64(
            "kvEvents.maxHashesPerPoll",
            k.max_hashes_per_poll,
            4096,
            1,
            65_536,
            "hashes",
        )? as u32,
    })
}

fn compile_routing(r: RawRouting) -> Result<RoutingConfig, ConfigError> {
    let header = r
        .destination_header
        .unwrap_or_else(|| "x-gateway-destination-endpoint".into());
    if header.is_empty()
        || header.starts_with(':')
        || !header
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'_')
    {
        return Err(err(
            "routing.destinationHeader",
            format!("\"{header}\" is not a lowercase HTTP header name"),
        ));
    }
    let failure_mode = match r.failure_mode.as_deref() {
        None | Some("open") => FailureMode::Open,
        Some("closed") => FailureMode::Closed,
        Some(o) => {
            return Err(err(
                "routing.failureMode",
                format!("\"{o}\" is not allowed; use \"open\" or \"closed\""),
            ))
        }
    };
    let paths = r.paths.unwrap_or_else(|| {
        [
            "/v1/chat/completions",
            "/v1/completions",
            "/v1/responses",
            "/v1/embeddings",
        ]
        .map(String::from)
        .to_vec()
    });
    for (i, p) in paths.iter().enumerate() {
        if crate::request::ApiKind::from_path(p).is_none() {
            return Err(err(format!("routing.paths[{i}]"), format!("\"{p}\" is not an OpenAI API path kvroute can parse (…/v1/chat/completions, …/v1/completions, …/v1/responses, …/v1/embeddings)")));
        }
    }
    if let Some(s) = &r.state_path {
        if !s.starts_with('/') {
            return Err(err(
                "routing.statePath",
                format!("\"{s}\" must start with '/'"),
            ));
        }
    }
    Ok(RoutingConfig {
        destination_header: header,
        max_fallbacks: range_u64(
            "routing.maxFallbacks",
            r.max_fallbacks,
            2,
            0,
            16,
            "endpoints",
        )? as usize,
        failure_mode,
        max_body_bytes: range_u64(
            "routing.maxBodyBytes",
            r.max_body_bytes,
            4 << 20,
            1024,
            256 << 20,
            "bytes",
        )? as usize,
        paths,
        debug_header: r.debug_header.unwrap_or(false),
        state_path: r.state_path,
        seed: r.seed,
    })
}

#[cfg(test)]
mod tests;

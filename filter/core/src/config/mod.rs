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
use crate::learners::prefill_rate::PrefillRateParams;
use crate::precise::{self, PreciseConfig, TokenizerConfig};
use crate::scheduling::active_request::ActiveRequestScorer;
use crate::scheduling::affinity_filter::{AffinityFilter, LoadSignal};
use crate::scheduling::charge::InflightConfig;
use crate::scheduling::max_score::TieBreak;
use crate::scheduling::prefix_cache::PrefixCacheScorer;
use crate::scheduling::saturation::KvrouteLoadScorer;
use crate::scheduling::token_load::TokenLoadScorer;
use crate::scheduling::{Picker, Scheduler, Scorer};
use serde::de::DeserializeOwned;
use serde::Deserialize;
use serde_json::Value;
use std::fmt;
use std::net::SocketAddr;

mod llm_d;
use llm_d::Inert;

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

fn err(path: impl Into<String>, message: impl Into<String>) -> ConfigError {
    ConfigError {
        path: path.into(),
        message: message.into(),
    }
}

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

/// `approx-prefix-cache-producer` parameters.
#[derive(Clone, Debug, PartialEq)]
pub struct PrefixProducerConfig {
    pub blocks: BlockConfig,
    /// Capacity from `vllm:cache_config_info` when available.
    pub auto_tune: bool,
    /// blocks per endpoint when metrics give none; 0 = unknown (only the
    /// index's byte budget bounds what is remembered)
    pub lru_capacity_per_server: u64,
    /// `charsPerToken: "auto"`: text prompts' tokens (charges, capacity, τ)
    /// use the bytes per token learnt from the servers
    /// (`learners::bytes_per_token`); blocks stay cut at
    /// `blockSizeTokens × chars_per_token` bytes, so the index never moves.
    pub learn_bytes_per_token: bool,
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

// Plugin parameters, one struct per type, llm-d's names.

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct ApproxPrefixParams {
    auto_tune: Option<bool>,
    block_size_tokens: Option<u64>,
    /// Deprecated in llm-d for `blockSizeTokens` (same unit since the
    /// producer split); used only when `blockSizeTokens` is absent.
    block_size: Option<u64>,
    max_prefix_blocks_to_match: Option<u64>,
    max_prefix_tokens_to_match: Option<u64>,
    lru_capacity_per_server: Option<u64>,
    /// kvroute extension: bytes per estimated token, or `"auto"`.
    chars_per_token: Option<Value>,
}

/// `precise-prefix-cache-producer` (and the deprecated
/// `precise-prefix-cache-scorer`) parameters, llm-d's names.
#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct PreciseParams {
    token_processor_config: Option<TokenProcessorParams>,
    /// llm-d's in-process index and its tokenizer pool: kvroute's index is
    /// the collector's held-blocks view, and its tokenizer the
    /// `token-producer` plugin. Checked for shape only.
    indexer_config: Option<Value>,
    /// llm-d's ZMQ subscribers: kvroute's relay beside each server does
    /// that (a wasm VM cannot open a socket). Checked for shape only.
    kv_events_config: Option<Value>,
    /// kvroute's approximate index records every decision at once, which is
    /// what speculative entries do in llm-d; so both values behave alike.
    speculative_indexing: Option<bool>,
    #[serde(rename = "speculativeTTL")]
    speculative_ttl: Option<Value>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct TokenProcessorParams {
    block_size_tokens: Option<u64>,
    /// Deprecated in llm-d for `blockSizeTokens`.
    block_size: Option<u64>,
    hash_seed: Option<String>,
}

/// The largest inline `tokenizer.json` (bytes): production tokenizers are
/// 2–11 MB, and every VM holds its own loaded copy.
const MAX_TOKENIZER_JSON_BYTES: usize = 16 * 1024 * 1024;

/// `token-producer` (llm-d's older name: `tokenizer`) parameters.
#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct TokenizerParams {
    model_name: Option<String>,
    /// llm-d's gRPC-over-UDS tokenizer: not reachable from a wasm VM.
    uds_tokenizer_config: Option<Value>,
    /// llm-d's vLLM `/render` backend (an HTTP call per request).
    vllm: Option<Value>,
    /// llm-d's tokenizer-free estimate: kvroute's approximate mode.
    estimate: Option<Value>,
    /// kvroute: the model's `tokenizer.json`, inline (an object, or the
    /// file's text as a string).
    tokenizer_json: Option<Value>,
    /// kvroute: the model's `tokenizer_config.json`, inline (chat template,
    /// special tokens).
    tokenizer_config: Option<Value>,
    /// kvroute: a chat template that overrides `tokenizerConfig`'s.
    chat_template: Option<String>,
    /// kvroute: other names requests use for the model (vLLM's
    /// `--served-model-name`).
    served_model_names: Option<Vec<String>>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct InflightParams {
    add_estimated_output_tokens: Option<bool>,
    output_ratio: Option<f64>,
    max_estimated_output_tokens: Option<i64>,
    prefix_match_info_producer_name: Option<String>,
    /// Only acts with llm-d's cross-replica syncer, which kvroute does not
    /// have; either value means "local to this gateway".
    sync_cross_replica_state: Option<bool>,
    /// kvroute: the output part holds the whole prompt until the stream
    /// ends (`scheduling::charge`).
    hold_kv_until_end: Option<bool>,
    /// kvroute: the output estimate is the servers' mean output per
    /// finished request, learnt online (`learners::output_tokens`).
    learn_output_tokens: Option<bool>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct AffinityParams {
    affinity_threshold: Option<f64>,
    exploration_probability: Option<f64>,
    #[serde(rename = "maxTTFTPenaltyMs")]
    max_ttft_penalty_ms: Option<f64>,
    /// llm-d's earlier interface: τ in tokens.
    max_tokens_in_flight_penalty: Option<i64>,
    /// A number (tokens/s), `"auto"`, or an `{"auto": …}` object.
    peak_prefill_throughput: Option<Value>,
    ttft_source: Option<String>,
    prefix_match_info_producer_name: Option<String>,
    in_flight_load_producer_name: Option<String>,
    latency_prediction_info_producer_name: Option<String>,
    /// kvroute: `"inflight"` (llm-d's) or `"saturation"`.
    load_signal: Option<String>,
    /// kvroute: the threshold test counts the blocks the index cannot look up.
    count_unresolved_blocks: Option<bool>,
}

/// `peakPrefillThroughput: {"auto": true, …}`.
#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct AutoPeakParams {
    auto: Option<bool>,
    initial: Option<f64>,
    floor: Option<f64>,
    ceiling: Option<f64>,
    smoothing: Option<f64>,
    min_tokens_per_request: Option<f64>,
}

/// `peakPrefillThroughput` → (the configured value, the online estimator's
/// knobs when `"auto"`).
fn compile_peak_prefill(
    path: &str,
    v: &Option<Value>,
) -> Result<(f64, Option<PrefillRateParams>), ConfigError> {
    const MAX_TPS: f64 = 1e12;
    let tps = |p: &str, v: Option<f64>, default: f64, lo: f64| {
        range_f64(p, v, default, lo, MAX_TPS, "must be ≥ 0 tokens/s")
    };
    match v {
        None | Some(Value::Null) => Ok((15_928.0, None)),
        Some(Value::Number(n)) => Ok((tps(path, n.as_f64(), 15_928.0, 0.0)?, None)),
        Some(Value::String(s)) if s == "auto" => {
            Ok((15_928.0, Some(PrefillRateParams::around(15_928.0))))
        }
        Some(Value::String(s)) => Err(err(
            path,
            format!("\"{s}\" is not allowed: give tokens/s, \"auto\", or {{\"auto\": true, \"initial\": …, \"floor\": …, \"ceiling\": …}}"),
        )),
        Some(obj @ Value::Object(_)) => {
            let q: AutoPeakParams = strict_value_req(obj, path)?;
            let initial = tps(&format!("{path}.initial"), q.initial, 15_928.0, 0.0)?;
            if q.auto == Some(false) {
                // The estimator's knobs mean nothing without it: refuse them
                // rather than ignore a setting the operator believes is used.
                let knobs = [
                    ("floor", q.floor.is_some()),
                    ("ceiling", q.ceiling.is_some()),
                    ("smoothing", q.smoothing.is_some()),
                    ("minTokensPerRequest", q.min_tokens_per_request.is_some()),
                ];
                if let Some((name, _)) = knobs.iter().find(|(_, set)| *set) {
                    return Err(err(
                        format!("{path}.{name}"),
                        "applies only with \"auto\": true (with \"auto\": false the gate uses \"initial\" alone)",
                    ));
                }
                return Ok((initial, None));
            }
            if initial <= 0.0 {
                return Err(err(
                    format!("{path}.initial"),
                    "must be > 0 tokens/s with \"auto\"",
                ));
            }
            let d = PrefillRateParams::around(initial);
            let floor = tps(&format!("{path}.floor"), q.floor, d.floor, 0.0)?;
            let ceiling = tps(&format!("{path}.ceiling"), q.ceiling, d.ceiling, 0.0)?;
            if floor <= 0.0 || !(floor <= initial && initial <= ceiling) {
                return Err(err(
                    path,
                    format!("needs 0 < floor ≤ initial ≤ ceiling; got floor {floor}, initial {initial}, ceiling {ceiling} (tokens/s)"),
                ));
            }
            let smoothing = range_f64(
                &format!("{path}.smoothing"),
                q.smoothing,
                d.smoothing,
                0.0,
                1.0,
                "must be in (0, 1] (the weight of each new measurement)",
            )?;
            if smoothing <= 0.0 {
                return Err(err(
                    format!("{path}.smoothing"),
                    "0 is out of range: must be in (0, 1] (0 would never move)",
                ));
            }
            let min_tokens_per_request = range_f64(
                &format!("{path}.minTokensPerRequest"),
                q.min_tokens_per_request,
                d.min_tokens_per_request,
                1.0,
                1e9,
                "must be ≥ 1 token",
            )?;
            Ok((
                initial,
                Some(PrefillRateParams {
                    initial,
                    floor,
                    ceiling,
                    smoothing,
                    min_tokens_per_request,
                }),
            ))
        }
        Some(other) => Err(err(
            path,
            format!("{other} is not allowed: give tokens/s, \"auto\", or an {{\"auto\": true, …}} object"),
        )),
    }
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct TokenLoadParams {
    queue_threshold_tokens: Option<i64>,
    in_flight_load_producer_name: Option<String>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct KvrouteLoadParams {
    queue_threshold_tokens: Option<u64>,
    kv_capacity_tokens: Option<u64>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct ActiveRequestParams {
    idle_threshold: Option<i64>,
    max_busy_score: Option<f64>,
    /// Deprecated in llm-d and ignored there too.
    request_timeout: Option<String>,
    in_flight_load_producer_name: Option<String>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct PrefixScorerParams {
    prefix_match_info_producer_name: Option<String>,
    match_length_weight: Option<f64>,
    match_length_scale_tokens: Option<i64>,
    sticky_only: Option<bool>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct NoHitLruParams {
    /// Deprecated in llm-d: "never used".
    prefix_plugin_type: Option<String>,
    /// Deprecated in llm-d: "never used".
    prefix_plugin_name: Option<String>,
    lru_size: Option<i64>,
    prefix_match_info_producer_name: Option<String>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct NoParams {}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct PickerParams {
    max_num_of_endpoints: Option<i64>,
    /// `max-score-picker` only: `"random"` (llm-d's, the default) or
    /// `"prefix"` (rendezvous on the request's blocks).
    tie_break: Option<String>,
}

/// Deserialises with unknown-field rejection and a path in the error.
fn strict<T: DeserializeOwned>(bytes: &[u8], base: &str) -> Result<T, ConfigError> {
    let de = &mut serde_json::Deserializer::from_slice(bytes);
    let out = serde_path_to_error::deserialize(&mut *de).map_err(|e| {
        let inner = e.path().to_string();
        err(join_path(base, &inner), e.into_inner().to_string())
    })?;
    // Nothing but whitespace after the document (`from_slice` checks this;
    // a bare `Deserializer` does not).
    de.end().map_err(|e| err(base, e.to_string()))?;
    Ok(out)
}

/// Like [`strict_value`] for a section that is present.
fn strict_value_req<T: DeserializeOwned>(v: &Value, base: &str) -> Result<T, ConfigError> {
    serde_path_to_error::deserialize(v).map_err(|e| {
        let inner = e.path().to_string();
        err(join_path(base, &inner), e.into_inner().to_string())
    })
}

fn strict_value<T: DeserializeOwned + Default>(
    v: &Option<Value>,
    base: &str,
) -> Result<T, ConfigError> {
    match v {
        None | Some(Value::Null) => Ok(T::default()),
        Some(v) => serde_path_to_error::deserialize(v).map_err(|e| {
            let inner = e.path().to_string();
            err(join_path(base, &inner), e.into_inner().to_string())
        }),
    }
}

fn join_path(base: &str, inner: &str) -> String {
    match (base.is_empty(), inner == "." || inner.is_empty()) {
        (true, _) => inner.to_string(),
        (false, true) => base.to_string(),
        (false, false) => format!("{base}.{inner}"),
    }
}

// ---------------------------------------------------------------------------
// Compilation: defaults, ranges, cross-references.

const SUPPORTED_TYPES: &str = "approx-prefix-cache-producer, precise-prefix-cache-producer, \
precise-prefix-cache-scorer (deprecated in llm-d), token-producer (or tokenizer), inflight-load-producer, \
prefix-cache-affinity-filter, token-load-scorer, active-request-scorer, queue-scorer, \
kv-cache-utilization-scorer, prefix-cache-scorer, no-hit-lru-scorer, max-score-picker, \
weighted-random-picker, kvroute's kvroute-load-scorer and cache-balance-scorer (and, accepted with nothing to do: single-profile-handler, \
decode-filter, utilization-detector, concurrency-detector, openai-parser, llm-d's data-layer \
sources and extractors)";

enum Compiled {
    Prefix(PrefixProducerConfig),
    /// `precise-prefix-cache-producer`; `scorer` for the deprecated
    /// `precise-prefix-cache-scorer`, which also scores in a profile.
    Precise {
        config: PreciseConfig,
        scorer: bool,
    },
    Tokenizer(TokenizerConfig),
    Inflight(InflightConfig),
    Filter(AffinityFilter),
    Scorer(Scorer),
    Picker(Picker),
    /// Accepted, nothing to run (see [`Inert`]).
    Inert(Inert),
}

fn range_f64(
    path: &str,
    v: Option<f64>,
    default: f64,
    lo: f64,
    hi: f64,
    what: &str,
) -> Result<f64, ConfigError> {
    let x = v.unwrap_or(default);
    if !x.is_finite() || x < lo || x > hi {
        return Err(err(path, format!("{x} is out of range: {what}")));
    }
    Ok(x)
}

fn range_u64(
    path: &str,
    v: Option<u64>,
    default: u64,
    lo: u64,
    hi: u64,
    unit: &str,
) -> Result<u64, ConfigError> {
    let x = v.unwrap_or(default);
    if x < lo || x > hi {
        return Err(err(
            path,
            format!("{x} is out of range: must be {lo}..={hi} {unit}"),
        ));
    }
    Ok(x)
}

fn compile_plugin(
    p: &RawPlugin,
    path: &str,
    producers: &[String],
) -> Result<Compiled, ConfigError> {
    let ppath = format!("{path}.parameters");
    let check_producer = |field: &str, v: &Option<String>| -> Result<(), ConfigError> {
        match v {
            Some(n) if !producers.iter().any(|p| p == n) => Err(err(
                format!("{ppath}.{field}"),
                format!("no producer plugin named \"{n}\" in `plugins`"),
            )),
            _ => Ok(()),
        }
    };
    let kind = llm_d::canonical_type(&p.kind);
    if let Some(role) = Inert::of(kind) {
        llm_d::inert_params(kind, role, &p.parameters, &ppath)?;
        return Ok(Compiled::Inert(role));
    }
    if let Some(why) = llm_d::unsupported_reason(kind) {
        return Err(err(
            format!("{path}.type"),
            format!("llm-d plugin type \"{}\" is not supported: {why}", p.kind),
        ));
    }
    Ok(match kind {
        "approx-prefix-cache-producer" => {
            let q: ApproxPrefixParams = strict_value(&p.parameters, &ppath)?;
            let (bs_field, bs_value) = match (q.block_size_tokens, q.block_size) {
                (None, Some(b)) if b > 0 => ("blockSize", Some(b)),
                (t, _) => ("blockSizeTokens", t),
            };
            let bs = range_u64(
                &format!("{ppath}.{bs_field}"),
                bs_value,
                64,
                1,
                65_536,
                "tokens",
            )?;
            let (cpt_value, learn) = match &q.chars_per_token {
                None | Some(Value::Null) => (None, false),
                Some(Value::String(a)) if a == "auto" => (None, true),
                Some(Value::Number(n)) if n.as_u64().is_some() => (n.as_u64(), false),
                Some(other) => {
                    return Err(err(
                        format!("{ppath}.charsPerToken"),
                        format!("{other} is not allowed: give a whole number of bytes per token (1..=64) or \"auto\" (learn it from the servers)"),
                    ))
                }
            };
            let cpt = range_u64(
                &format!("{ppath}.charsPerToken"),
                cpt_value,
                4,
                1,
                64,
                "bytes per token",
            )?;
            // llm-d: the token cap (default 131072) wins when > 0; else the
            // block cap (default 2048) when > 0; both 0 = the whole prompt.
            let cap_tokens = q.max_prefix_tokens_to_match.unwrap_or(131_072);
            let cap_blocks = q.max_prefix_blocks_to_match.unwrap_or(2048);
            let max_tokens = if cap_tokens > 0 {
                cap_tokens
            } else {
                cap_blocks.saturating_mul(bs)
            };
            Compiled::Prefix(PrefixProducerConfig {
                blocks: BlockConfig {
                    block_size_tokens: bs as u32,
                    chars_per_token: cpt as u32,
                    max_prefix_tokens: max_tokens,
                },
                auto_tune: q.auto_tune.unwrap_or(true),
                lru_capacity_per_server: q.lru_capacity_per_server.unwrap_or(0),
                learn_bytes_per_token: learn,
            })
        }
        "precise-prefix-cache-producer" | "precise-prefix-cache-scorer" => {
            let q: PreciseParams = strict_value(&p.parameters, &ppath)?;
            let _ = (
                q.indexer_config,
                q.kv_events_config,
                q.speculative_indexing,
                q.speculative_ttl,
            );
            let tp = q.token_processor_config.unwrap_or_default();
            let tpath = format!("{ppath}.tokenProcessorConfig");
            let (bs_field, bs_value) = match (tp.block_size_tokens, tp.block_size) {
                (None | Some(0), Some(b)) if b > 0 => ("blockSize", Some(b)),
                // llm-d: 0 means "not set".
                (Some(0), _) => ("blockSizeTokens", None),
                (t, _) => ("blockSizeTokens", t),
            };
            let bs = range_u64(
                &format!("{tpath}.{bs_field}"),
                bs_value,
                u64::from(precise::DEFAULT_BLOCK_SIZE),
                1,
                65_536,
                "tokens (vLLM's --block-size)",
            )? as u32;
            if let Some(seed) = &tp.hash_seed {
                if seed.len() > 256 {
                    return Err(err(
                        format!("{tpath}.hashSeed"),
                        "is longer than 256 bytes; it must equal the servers' PYTHONHASHSEED",
                    ));
                }
            }
            Compiled::Precise {
                config: PreciseConfig {
                    block_size: bs,
                    hasher: precise::vllm_hash::VllmBlockHasher::new(tp.hash_seed.as_deref()),
                    // The approximate producer's default cap: 131072 tokens.
                    max_blocks: (131_072 / bs as usize).max(1),
                    tokenizers: Vec::new(),
                },
                scorer: kind == "precise-prefix-cache-scorer",
            }
        }
        "token-producer" => {
            let q: TokenizerParams = strict_value(&p.parameters, &ppath)?;
            let model = match q.model_name {
                Some(m) if !m.is_empty() => m,
                _ if q.estimate.is_some() => String::new(),
                _ => {
                    return Err(err(
                        format!("{ppath}.modelName"),
                        "required: the model whose tokenizer this is (llm-d requires it too)",
                    ))
                }
            };
            if q.vllm.is_some() {
                return Err(err(
                    format!("{ppath}.vllm"),
                    "llm-d's vLLM /render backend needs an HTTP call to a server per request; kvroute tokenizes inside the module: give `tokenizerJson` (and `tokenizerConfig` for chat) instead",
                ));
            }
            if q.estimate.is_some() && q.tokenizer_json.is_some() {
                return Err(err(
                    format!("{ppath}.estimate"),
                    "give either `estimate` (no tokenizer: text and chat prompts use the approximate index) or `tokenizerJson`, not both",
                ));
            }
            // udsTokenizerConfig: accepted and unused (see docs): without
            // `tokenizerJson` there is no tokenizer, and text and chat
            // prompts fall back to the approximate index (counted).
            let _ = q.uds_tokenizer_config;
            let tokenizer = match &q.tokenizer_json {
                None => None,
                Some(v) => {
                    let bytes = match v {
                        Value::String(s) => s.as_bytes().to_vec(),
                        Value::Object(_) => serde_json::to_vec(v).unwrap_or_default(),
                        _ => {
                            return Err(err(
                                format!("{ppath}.tokenizerJson"),
                                "must be the tokenizer.json object, or its text as a string",
                            ))
                        }
                    };
                    if bytes.len() > MAX_TOKENIZER_JSON_BYTES {
                        return Err(err(
                            format!("{ppath}.tokenizerJson"),
                            format!(
                                "is {} bytes; at most {MAX_TOKENIZER_JSON_BYTES} (each worker VM loads its own copy)",
                                bytes.len()
                            ),
                        ));
                    }
                    if let Some(c) = &q.tokenizer_config {
                        if !c.is_object() {
                            return Err(err(
                                format!("{ppath}.tokenizerConfig"),
                                "must be the tokenizer_config.json object",
                            ));
                        }
                    }
                    let t = precise::tokenizer::ModelTokenizer::load(
                        &bytes,
                        q.tokenizer_config.as_ref(),
                        q.chat_template.as_deref(),
                    )
                    .map_err(|e| err(format!("{ppath}.tokenizerJson"), e))?;
                    Some(std::sync::Arc::new(t))
                }
            };
            if tokenizer.is_none() && (q.tokenizer_config.is_some() || q.chat_template.is_some()) {
                return Err(err(
                    format!("{ppath}.tokenizerJson"),
                    "required when `tokenizerConfig` or `chatTemplate` is given",
                ));
            }
            let mut model_names = vec![model];
            model_names.extend(q.served_model_names.unwrap_or_default());
            model_names.retain(|m| !m.is_empty());
            Compiled::Tokenizer(TokenizerConfig {
                model_names,
                tokenizer,
            })
        }
        "inflight-load-producer" => {
            let q: InflightParams = strict_value(&p.parameters, &ppath)?;
            check_producer(
                "prefixMatchInfoProducerName",
                &q.prefix_match_info_producer_name,
            )?;
            let _ = q.sync_cross_replica_state;
            let ratio = range_f64(
                &format!("{ppath}.outputRatio"),
                q.output_ratio,
                1.5,
                0.0,
                f64::MAX,
                "must be a finite number ≥ 0",
            )?;
            let cap = match q.max_estimated_output_tokens {
                Some(n) if n < 0 => {
                    return Err(err(
                        format!("{ppath}.maxEstimatedOutputTokens"),
                        format!("{n} is out of range: must be ≥ 0 tokens"),
                    ))
                }
                Some(n) => Some(n as u64),
                None => None,
            };
            let add_output = q.add_estimated_output_tokens.unwrap_or(false);
            if q.learn_output_tokens == Some(true) && !add_output {
                return Err(err(
                    format!("{ppath}.learnOutputTokens"),
                    "learns the output estimate, which only `addEstimatedOutputTokens: true` charges: set that too, or drop this",
                ));
            }
            Compiled::Inflight(InflightConfig {
                add_estimated_output_tokens: add_output,
                output_ratio: ratio,
                max_estimated_output_tokens: cap,
                hold_kv_until_end: q.hold_kv_until_end.unwrap_or(false),
                learn_output_tokens: q.learn_output_tokens.unwrap_or(false),
            })
        }
        "prefix-cache-affinity-filter" => {
            let q: AffinityParams = strict_value(&p.parameters, &ppath)?;
            check_producer(
                "prefixMatchInfoProducerName",
                &q.prefix_match_info_producer_name,
            )?;
            check_producer("inFlightLoadProducerName", &q.in_flight_load_producer_name)?;
            if q.latency_prediction_info_producer_name.is_some() {
                return Err(err(
                    format!("{ppath}.latencyPredictionInfoProducerName"),
                    "names llm-d's latency-predictor producer, which kvroute does not have; remove it (the TTFT estimate is in-flight tokens / peakPrefillThroughput)",
                ));
            }
            let token_penalty = match q.max_tokens_in_flight_penalty {
                None => 0,
                Some(n) if n >= 0 => n as u64,
                Some(n) => {
                    return Err(err(
                        format!("{ppath}.maxTokensInFlightPenalty"),
                        format!("{n} is out of range: must be ≥ 0 tokens (0 = this gate is off)"),
                    ))
                }
            };
            // Written with the token gate, a config is in llm-d's earlier
            // interface, where maxTTFTPenaltyMs read the latency predictor
            // and was inert without it: so its default there is "off".
            let ttft_default = if token_penalty > 0 { 0.0 } else { 18_000.0 };
            if let Some(s) = &q.ttft_source {
                if s != "prefillThroughput" {
                    return Err(err(
                        format!("{ppath}.ttftSource"),
                        format!("\"{s}\" is not supported by kvroute; use \"prefillThroughput\" (the latency predictor needs llm-d's sidecar)"),
                    ));
                }
            }
            let (peak, prefill_auto) = compile_peak_prefill(
                &format!("{ppath}.peakPrefillThroughput"),
                &q.peak_prefill_throughput,
            )?;
            let f = AffinityFilter {
                affinity_threshold: range_f64(
                    &format!("{ppath}.affinityThreshold"),
                    q.affinity_threshold,
                    0.8,
                    0.0,
                    1.0,
                    "must be in [0, 1]",
                )?,
                exploration_probability: range_f64(
                    &format!("{ppath}.explorationProbability"),
                    q.exploration_probability,
                    0.0,
                    0.0,
                    1.0,
                    "must be in [0, 1]",
                )?,
                max_ttft_penalty_ms: range_f64(
                    &format!("{ppath}.maxTTFTPenaltyMs"),
                    q.max_ttft_penalty_ms,
                    ttft_default,
                    0.0,
                    86_400_000.0,
                    "must be ≥ 0 ms (0 = always stick)",
                )?,
                peak_prefill_throughput: peak,
                max_tokens_in_flight_penalty: token_penalty,
                prefill_auto,
                load_signal: match q.load_signal.as_deref() {
                    None | Some("inflight") => LoadSignal::Inflight,
                    Some("saturation") => LoadSignal::Saturation,
                    Some(other) => {
                        return Err(err(
                            format!("{ppath}.loadSignal"),
                            format!("\"{other}\" is not a load signal; use \"inflight\" (llm-d's) or \"saturation\""),
                        ))
                    }
                },
                count_unresolved_blocks: q.count_unresolved_blocks.unwrap_or(false),
            };
            if f.max_ttft_penalty_ms > 0.0 && f.peak_prefill_throughput <= 0.0 {
                return Err(err(
                    format!("{ppath}.peakPrefillThroughput"),
                    "must be > 0 tokens/s when maxTTFTPenaltyMs > 0",
                ));
            }
            Compiled::Filter(f)
        }
        "token-load-scorer" => {
            let q: TokenLoadParams = strict_value(&p.parameters, &ppath)?;
            check_producer("inFlightLoadProducerName", &q.in_flight_load_producer_name)?;
            let t = match q.queue_threshold_tokens {
                None => 4_194_304,
                Some(t) if t > 0 => t,
                Some(t) => {
                    return Err(err(
                        format!("{ppath}.queueThresholdTokens"),
                        format!("{t} is out of range: must be > 0 tokens"),
                    ))
                }
            };
            Compiled::Scorer(Scorer::TokenLoad(TokenLoadScorer {
                queue_threshold_tokens: t as f64,
            }))
        }
        "active-request-scorer" => {
            let q: ActiveRequestParams = strict_value(&p.parameters, &ppath)?;
            check_producer("inFlightLoadProducerName", &q.in_flight_load_producer_name)?;
            let _ = q.request_timeout;
            let idle = match q.idle_threshold {
                None => 0,
                Some(n) if n >= 0 => n as u64,
                Some(n) => {
                    return Err(err(
                        format!("{ppath}.idleThreshold"),
                        format!("{n} is out of range: must be ≥ 0 requests"),
                    ))
                }
            };
            Compiled::Scorer(Scorer::ActiveRequest(ActiveRequestScorer {
                idle_threshold: idle,
                max_busy_score: range_f64(
                    &format!("{ppath}.maxBusyScore"),
                    q.max_busy_score,
                    1.0,
                    0.0,
                    1.0,
                    "must be in [0, 1]",
                )?,
            }))
        }
        "kvroute-load-scorer" => {
            let q: KvrouteLoadParams = strict_value(&p.parameters, &ppath)?;
            let d = KvrouteLoadScorer::default();
            Compiled::Scorer(Scorer::KvrouteLoad(KvrouteLoadScorer {
                queue_threshold_tokens: range_u64(
                    &format!("{ppath}.queueThresholdTokens"),
                    q.queue_threshold_tokens,
                    d.queue_threshold_tokens as u64,
                    1,
                    1 << 40,
                    "tokens",
                )? as f64,
                kv_capacity_tokens: range_u64(
                    &format!("{ppath}.kvCapacityTokens"),
                    q.kv_capacity_tokens,
                    d.kv_capacity_tokens as u64,
                    1,
                    1 << 40,
                    "tokens",
                )? as f64,
            }))
        }
        "cache-balance-scorer" => {
            strict_value::<NoParams>(&p.parameters, &ppath)?;
            Compiled::Scorer(Scorer::CacheBalance)
        }
        "queue-scorer" => {
            strict_value::<NoParams>(&p.parameters, &ppath)?;
            Compiled::Scorer(Scorer::Queue)
        }
        "kv-cache-utilization-scorer" => {
            strict_value::<NoParams>(&p.parameters, &ppath)?;
            Compiled::Scorer(Scorer::KvCacheUtilization)
        }
        "prefix-cache-scorer" => {
            if let Some(Value::Object(m)) = &p.parameters {
                // Before llm-d split the index into its own producer, the
                // scorer kept it and took its parameters.
                for old in [
                    "hashBlockSize",
                    "blockSize",
                    "blockSizeTokens",
                    "maxPrefixBlocksToMatch",
                    "maxPrefixTokensToMatch",
                    "lruCapacityPerServer",
                    "autoTune",
                ] {
                    if m.contains_key(old) {
                        return Err(err(
                            format!("{ppath}.{old}"),
                            "is an index parameter from llm-d's older prefix-cache scorer; the index is now approx-prefix-cache-producer: move it there",
                        ));
                    }
                }
            }
            let q: PrefixScorerParams = strict_value(&p.parameters, &ppath)?;
            check_producer(
                "prefixMatchInfoProducerName",
                &q.prefix_match_info_producer_name,
            )?;
            let w = range_f64(
                &format!("{ppath}.matchLengthWeight"),
                q.match_length_weight,
                0.0,
                0.0,
                1.0,
                "must be in [0, 1]",
            )?;
            let scale = q.match_length_scale_tokens.unwrap_or(8192);
            if w > 0.0 && scale <= 0 {
                return Err(err(
                    format!("{ppath}.matchLengthScaleTokens"),
                    format!(
                        "{scale} is out of range: must be > 0 tokens when matchLengthWeight > 0"
                    ),
                ));
            }
            Compiled::Scorer(Scorer::PrefixCache(PrefixCacheScorer {
                match_length_weight: w,
                match_length_scale_tokens: scale.max(0) as u64,
                sticky_only: q.sticky_only.unwrap_or(false),
            }))
        }
        "no-hit-lru-scorer" => {
            let q: NoHitLruParams = strict_value(&p.parameters, &ppath)?;
            let _ = (q.prefix_plugin_type, q.prefix_plugin_name);
            check_producer(
                "prefixMatchInfoProducerName",
                &q.prefix_match_info_producer_name,
            )?;
            if let Some(n) = q.lru_size {
                if n <= 0 {
                    return Err(err(
                        format!("{ppath}.lruSize"),
                        format!("{n} is out of range: must be > 0 endpoints"),
                    ));
                }
            }
            Compiled::Scorer(Scorer::NoHitLru)
        }
        "max-score-picker" | "weighted-random-picker" => {
            let q: PickerParams = strict_value(&p.parameters, &ppath)?;
            if let Some(n) = q.max_num_of_endpoints {
                if n < 1 {
                    return Err(err(
                        format!("{ppath}.maxNumOfEndpoints"),
                        format!("{n} is out of range: must be ≥ 1"),
                    ));
                }
            }
            let tie = match q.tie_break.as_deref() {
                None | Some("random") => TieBreak::Random,
                Some("prefix") if kind == "max-score-picker" => TieBreak::Prefix,
                Some(other) => {
                    return Err(err(
                        format!("{ppath}.tieBreak"),
                        if kind == "max-score-picker" {
                            format!("\"{other}\" is not a tie break; use \"random\" or \"prefix\"")
                        } else {
                            "weighted-random-picker draws at random; only \"random\" applies".into()
                        },
                    ))
                }
            };
            Compiled::Picker(if kind == "max-score-picker" {
                Picker::MaxScore(tie)
            } else {
                Picker::WeightedRandom
            })
        }
        other => {
            return Err(err(
                format!("{path}.type"),
                format!("unknown plugin type \"{other}\"; kvroute supports: {SUPPORTED_TYPES}"),
            ))
        }
    })
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
        .map(|(p, n)| (n.clone(), llm_d::canonical_type(&p.kind).to_string()))
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
        .position(|p| llm_d::canonical_type(&p.kind).starts_with("precise-prefix-cache-"));
    if let Some(p) = precise.as_mut() {
        p.tokenizers = tokenizers;
    } else if !tokenizers.is_empty() {
        let i = raw
            .plugins
            .iter()
            .position(|p| llm_d::canonical_type(&p.kind) == "token-producer")
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

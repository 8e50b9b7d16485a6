//! kvroute's own sections of the config document: `endpoints`, `routing`
//! (the HTTP filter), `collector`, `kvEvents` and `sharedState`; their
//! shapes (serde, unknown fields denied), defaults and ranges.

use super::check::{err, range_u64};
use super::{ConfigError, MeshConfig};
use serde::Deserialize;
use std::net::SocketAddr;

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
    /// A JSON error in the request's API shape (OpenAI's; Anthropic's on
    /// the Messages API): 400 for bad bodies, 503 for no endpoints.
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
    /// llm-d's `passthrough-parser` is listed in `requestHandler.parsers`:
    /// a request on any other path (any method, but the state path) is
    /// routed at its headers on load alone, its body not read, instead of
    /// passing to Envoy's load balancer.
    pub passthrough: bool,
    /// Body-based routing (`routing.modelHeader`, off when `None`): this
    /// request header is set to the body's `model` once the body is read,
    /// so Envoy's routes can match on it (the Gateway API Inference
    /// Extension's body-based router); a client's copy is always removed.
    pub model_header: Option<String>,
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
    /// The path of each endpoint's model list (`collector.modelsPath`,
    /// vLLM's `/v1/models`), polled through `metrics_cluster`.
    pub models_path: String,
    /// ms; how often each endpoint's model list is polled (and at once for
    /// a new endpoint); 0: never (`collector.modelsPollIntervalMs`).
    pub models_poll_interval_ms: u64,
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
    /// slots of prompt prefixes with known vLLM hashes (precise mode with
    /// `tokenizeIn: collector`; `kvroute_shared_state::hashed`)
    pub hashed_prefix_slots: u32,
    /// bytes those prefixes may hold in all
    pub hashed_prefix_bytes: u64,
}

// ---------------------------------------------------------------------------
// Raw shapes (serde), strict.

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub(super) struct RawEndpoints {
    #[serde(default, rename = "static")]
    static_list: Option<Vec<String>>,
    #[serde(default)]
    from_cluster: Option<RawFromCluster>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub(super) struct RawFromCluster {
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
pub(super) struct RawRouting {
    destination_header: Option<String>,
    max_fallbacks: Option<u64>,
    failure_mode: Option<String>,
    max_body_bytes: Option<u64>,
    paths: Option<Vec<String>>,
    debug_header: Option<bool>,
    state_path: Option<String>,
    seed: Option<u64>,
    model_header: Option<String>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub(super) struct RawCollector {
    metrics_cluster: Option<String>,
    metrics_path: Option<String>,
    metrics_poll_interval_ms: Option<u64>,
    models_path: Option<String>,
    models_poll_interval_ms: Option<u64>,
    metrics_timeout_ms: Option<u64>,
    metrics_stale_after_ms: Option<u64>,
    reap_after_ms: Option<u64>,
    mode: Option<String>,
    lease_ms: Option<u64>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub(super) struct RawKvEvents {
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
pub(super) struct RawSharedState {
    index_budget_bytes: Option<u64>,
    hashed_prefix_slots: Option<u64>,
    hashed_prefix_bytes: Option<u64>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub(super) struct RawMesh {
    exchange: Option<bool>,
    peer_ttl_ms: Option<u64>,
}

/// kvroute's `mesh` section: the exchange between proxies goes through
/// the KV-event relays, so it is on wherever they are (`kvEvents`), unless
/// turned off.
pub(super) fn mesh(m: RawMesh, kv: &KvEventsConfig) -> Result<MeshConfig, ConfigError> {
    let enabled = match m.exchange {
        None => kv.enabled,
        Some(true) if !kv.enabled => {
            return Err(err(
                "mesh.exchange",
                "the mesh exchange goes through the KV-event relays beside the servers: enable the `kvEvents` section",
            ))
        }
        Some(on) => on,
    };
    Ok(MeshConfig {
        enabled,
        peer_ttl_ms: range_u64("mesh.peerTtlMs", m.peer_ttl_ms, 0, 0, 600_000, "ms")?,
        tie_salt: 0,
    })
}

// ---------------------------------------------------------------------------
// Compilation: defaults and ranges.

pub(super) fn endpoints(e: Option<RawEndpoints>) -> Result<EndpointSource, ConfigError> {
    Ok(match e {
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
    })
}

pub(super) fn collector(c: RawCollector) -> Result<CollectorConfig, ConfigError> {
    let poll = range_u64(
        "collector.metricsPollIntervalMs",
        c.metrics_poll_interval_ms,
        1000,
        50,
        3_600_000,
        "ms",
    )?;
    let default_lease_ms = 3 * poll.max(1000);
    Ok(CollectorConfig {
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
        models_path: match c.models_path {
            Some(p) if !p.starts_with('/') => {
                return Err(err(
                    "collector.modelsPath",
                    format!("\"{p}\" must start with '/'"),
                ))
            }
            Some(p) => p,
            None => "/v1/models".into(),
        },
        models_poll_interval_ms: match c.models_poll_interval_ms {
            Some(0) => 0,
            ms => range_u64(
                "collector.modelsPollIntervalMs",
                ms,
                10_000,
                1_000,
                86_400_000,
                "ms, or 0 for never",
            )?,
        },
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
    })
}

pub(super) fn shared_state(s: RawSharedState) -> Result<SharedStateConfig, ConfigError> {
    Ok(SharedStateConfig {
        index_budget_bytes: range_u64(
            "sharedState.indexBudgetBytes",
            s.index_budget_bytes,
            64 << 20,
            64 << 10,
            1 << 30,
            "bytes",
        )?,
        hashed_prefix_slots: range_u64(
            "sharedState.hashedPrefixSlots",
            s.hashed_prefix_slots,
            16_384,
            1,
            262_144,
            "prefixes",
        )? as u32,
        hashed_prefix_bytes: range_u64(
            "sharedState.hashedPrefixBytes",
            s.hashed_prefix_bytes,
            16 << 20,
            64 << 10,
            1 << 30,
            "bytes",
        )?,
    })
}

pub(super) fn kv_events(k: RawKvEvents) -> Result<KvEventsConfig, ConfigError> {
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

/// A lowercase HTTP header name kvroute may set (not a pseudo-header).
fn header_name(path: &str, header: &str) -> Result<(), ConfigError> {
    if header.is_empty()
        || !header
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'_')
    {
        return Err(err(
            path,
            format!("\"{header}\" is not a lowercase HTTP header name"),
        ));
    }
    Ok(())
}

pub(super) fn routing(r: RawRouting) -> Result<RoutingConfig, ConfigError> {
    let header = r
        .destination_header
        .unwrap_or_else(|| "x-gateway-destination-endpoint".into());
    header_name("routing.destinationHeader", &header)?;
    if let Some(m) = &r.model_header {
        header_name("routing.modelHeader", m)?;
        if *m == header {
            return Err(err(
                "routing.modelHeader",
                format!("\"{m}\" is the destination header (routing.destinationHeader); use another name"),
            ));
        }
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
            "/inference/v1/generate",
            "/v1/messages",
        ]
        .map(String::from)
        .to_vec()
    });
    for (i, p) in paths.iter().enumerate() {
        if crate::request::ApiKind::from_path(p).is_none() {
            return Err(err(format!("routing.paths[{i}]"), format!("\"{p}\" is not an API path kvroute can parse (…/v1/chat/completions, …/v1/completions, …/v1/responses, …/v1/embeddings, Anthropic's …/v1/messages, vLLM's …/inference/v1/generate)")));
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
        passthrough: false,
        model_header: r.model_header,
    })
}

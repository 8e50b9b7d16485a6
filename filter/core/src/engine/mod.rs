//! The routing engine: one request from its facts to a destination, and
//! the collector's writes, over a [`Store`].
//!
//! This is everything the wasm glue does between host calls, written
//! against the `Store` trait so it runs natively (tests, simulator) exactly
//! as it runs in Envoy. The glue only moves bytes and headers.
//!
//! One file per job:
//!
//! - `facts.rs`: [`RequestFacts`], what the engine routes on, and
//!   [`Engine::facts`], which reads them from a body (parse, blocks, precise
//!   mode's vLLM hashes);
//! - `route.rs`: the one entry, [`Engine::route`] (snapshot, schedule,
//!   charge, index insert), and what follows a decision: the releases,
//!   [`Engine::move_charge`], [`Engine::take_back`];
//! - `snapshot.rs`: [`Engine::snapshot`], the scheduler's input read from
//!   shared state (tables, index lookup, precise mode's held view);
//! - `collect.rs`: the collector's writes (membership, `/metrics` polls and
//!   the learners, relay answers, reaping);
//! - `mesh.rs`: the mesh exchange between proxies (the outbox of accepted
//!   decisions, the other proxies' decisions and load applied);
//! - `state.rs`: the state view ([`Engine::state_json`], `routing.statePath`).
//!
//! What they share is here: the [`Engine`] and its per-VM table cache, and
//! the outcome types. Parsing what servers report is `crate::reports`'s,
//! learning from it `crate::learners`'s; neither imports the engine.
//!
//! # The request path in detail
//!
//! [`Engine::facts`]: parse (with a tokenizer, in the same pass what a chat
//! template reads) → (precise mode: `PreciseConfig::request_hashes`,
//! token IDs → vLLM hashes) → `prompt_blocks`; then [`Engine::route`]:
//! [`Engine::snapshot`] → `Scheduler::schedule` → charge → index insert; the
//! lifecycle then writes the destination header (`ARCHITECTURE.md`, "The
//! request path", has the steps around this).
//!
//! - **Snapshot.** Reads `kvroute/load`; reads `kvroute/endpoints` and
//!   `kvroute/metrics` only when the load table's state epoch differs from
//!   the VM's cached copies (the collector bumps the epoch after writing
//!   either). Then `index::longest_prefixes`: a binary search over the
//!   8-block groups of chained blocks, each group read resolved in full
//!   (`index::last_held`). A whole group's shard is keyed by its first and
//!   last block, a prompt's final partial group by its first block, and
//!   where a match ends at a group's start the rest is looked up in that
//!   group's partial-group shard (`index::group_key`). A group's entries
//!   for each stripe of eight endpoint slots live in a shard of their own,
//!   so a fleet of more than eight endpoints reads one shard per group and
//!   stripe.
//! - **Precise mode.** `held::longest_held` on `kvroute/held` when every
//!   endpoint's view is fresh; its matches replace the index's for
//!   scheduling and the charge.
//! - **Charge.** A CAS on `kvroute/load`, first tried on the table the
//!   snapshot read; it returns a `Ticket`.
//! - **Insert.** `index::insert_seeded` for the chosen endpoint: whole
//!   8-block groups the endpoint already holds (all of them when it holds
//!   the whole prompt) are skipped unless they have aged half its
//!   capacity, which refreshes them like an LRU hit; unchanged shards are
//!   not written.
//! - **What the request keeps.** What the charge and the insert wrote
//!   ([`Provisional`]). A non-2xx answer, or a stream that ends before any
//!   response header (reset, connect failure), goes through
//!   [`Engine::take_back`] at its end: one load-table write that releases
//!   the charge and undoes the eviction clock, routed bytes and cold stamp
//!   (`LoadTable::undo`), then `index::remove` of the entries still as the
//!   request wrote them. So only work a server accepted changes the index
//!   and the learners, while identical cold prompts arriving together still
//!   find each other's blocks. Two things are not undone: entries the
//!   request overwrote in a full index set are not brought back, and an
//!   index entry recorded ahead of a clock that went back counts as just
//!   written (`index::AHEAD_WINDOW`).
//! - **Retries.** Before that, `Stream::follow_retry` reads Envoy's
//!   `upstream.address`: a request Envoy retried to another endpoint has
//!   its charge moved there ([`Engine::move_charge`], one load-table write)
//!   and what the decision wrote for the first endpoint taken back.
//! - **Releases.** [`Engine::release_prompt`] and [`Engine::release_rest`]
//!   with the ticket: a CAS write that patches the ticket's bucket in the
//!   encoded load table in place (`LoadTable::release_encoded`; a value
//!   that is not exactly one well-formed table goes through decode and
//!   encode instead). A response that ends on its first chunk, or any
//!   response to a non-streaming request (vLLM sends that body only once
//!   the request has finished), releases both parts in one write at its
//!   first body chunk.
//! - **Explanation.** The debug explanation is formatted only when
//!   `routing.debugHeader` is on.

use crate::config::{Config, EndpointSource, FailureMode};
use crate::precise::PreciseUse;
use crate::request::{ApiKind, ParseError, ParseLimits};
use crate::scheduling::Decision;
use kvroute_shared_state::endpoints::{EndpointEntry, EndpointTable};
use kvroute_shared_state::index::IndexGeometry;
use kvroute_shared_state::load::{Ticket, Undo};
use kvroute_shared_state::metrics::{MetricsSnapshot, MetricsTable};
use kvroute_shared_state::models::ModelsTable;
use kvroute_shared_state::{Store, StoreError, ENDPOINTS_KEY, METRICS_KEY};
use std::sync::{Arc, Mutex};

mod collect;
mod facts;
mod flow;
mod mesh;
mod models;
mod offpath;
mod route;
mod session;
#[cfg(test)]
mod session_tests;
mod snapshot;
mod state;

pub use collect::{Applied, ApplyError};
pub use facts::{
    model_header_value, OffPathText, PreciseIds, RequestFacts, MODEL_HEADER_MAX_BYTES,
};
pub use mesh::{MeshApplied, MeshOutgoing, OwnLoad, PeerApplied, PeerDecision};
pub use models::model_not_found;
pub use session::{SessionLookup, SessionRef};
pub use snapshot::{endpoint_key, ModelFit, Snapshot};
pub use state::STATE_HASHES_MAX;

/// Why a request was not routed by kvroute.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Unrouted {
    BadBody(ParseError),
    NoEndpoints,
    /// No endpoint serves the body's `model` (`engine/models.rs`).
    UnknownModel(String),
    /// Shared data refused a call (the message says how).
    Store(String),
}

impl Unrouted {
    /// A short stable label for counters and logs.
    pub fn label(&self) -> &'static str {
        match self {
            Unrouted::BadBody(e) => e.label(),
            Unrouted::NoEndpoints => "no_endpoints",
            Unrouted::UnknownModel(_) => "unknown_model",
            Unrouted::Store(_) => "shared_data",
        }
    }
}

/// What the filter does with a request.
// Returned once per request and matched at once: its size does not matter.
#[allow(clippy::large_enum_variant)]
#[derive(Clone, Debug, PartialEq)]
pub enum Outcome {
    /// Set the destination header to `destination` and continue.
    Routed(Routed),
    /// Continue without a destination header (fail-open): Envoy's fallback
    /// load balancer decides.
    FailOpen(Unrouted),
    /// Answer locally with this status and JSON body (fail-closed), in the
    /// shape of the request's API ([`Engine::fail_for`]).
    Reject {
        status: u32,
        body: String,
        why: Unrouted,
    },
}

#[derive(Clone, Debug, PartialEq)]
pub struct Routed {
    /// `ip:port[,fallback…]`
    pub destination: String,
    /// For releasing the charge; `None` if the charge could not be written.
    pub ticket: Option<Ticket>,
    pub decision: Decision,
    /// Uncached prompt tokens charged to the primary.
    pub uncached_tokens: u64,
    pub stream: bool,
    /// CAS races the charge and the index insert lost (and retried).
    pub cas_retries: u32,
    /// Precise mode's part (`None` when it is off).
    pub precise: Option<PreciseUse>,
    /// What the decision wrote beyond the charge, to take back if the
    /// server rejects the request (`None` if the charge did not land).
    pub provisional: Option<Provisional>,
    /// `tokenizeIn: collector`: the prompt's new text for the collector
    /// (boxed: most requests have none).
    pub tokenize: Option<Box<TokenizeJob>>,
    /// The body's `model` is a LoRA adapter on the endpoints that serve it
    /// (`engine/models.rs`).
    pub lora_adapter: bool,
    /// How the request's session was looked up (`session-affinity-*`).
    pub session: SessionLookup,
}

/// A routed prompt's new text for the collector (`tokenizeIn: collector`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TokenizeJob {
    /// `precise::offpath::Job`, encoded; sent once a server accepts.
    pub job: Vec<u8>,
    /// Routed on a stored prefix of the prompt, with this text after it.
    pub partial: bool,
}

/// What a routed request wrote to shared state beyond its in-flight
/// charge: the endpoint record's eviction clock, routed bytes and cold
/// stamp ([`Undo`]), and the prompt's index entries. It is written at
/// decision time, so identical cold prompts arriving together find the
/// first one's blocks and go together; if the server then rejects the
/// request, [`Engine::take_back`] undoes it (issue 40: only work a server
/// accepted changes what kvroute believes).
#[derive(Clone, Debug, PartialEq)]
pub struct Provisional {
    pub undo: Undo,
    /// The prompt's block hashes, handed over by [`Engine::route`] from
    /// its [`RequestFacts`] once the decision is made (no copy).
    hashes: Vec<u64>,
    /// The first block that was new on the endpoint (the blocks before it
    /// were held before the request came, and stay); `None`: nothing was
    /// inserted.
    from_block: Option<usize>,
    /// The counter the entries were recorded at.
    recorded: u32,
}

impl Routed {
    /// The primary's address (the first of `destination`).
    pub fn primary_address(&self) -> &str {
        self.destination.split(',').next().unwrap_or("")
    }

    /// Value of the debug header (`x-kvroute-decision`). Built on demand:
    /// it formats floats, and the header is off by default.
    pub fn explanation(&self) -> String {
        route::explain(&self.decision, self.primary_address(), self.uncached_tokens)
    }
}

/// The engine for one configuration.
#[derive(Clone, Debug)]
pub struct Engine {
    pub config: Config,
    geometry: IndexGeometry,
    limits: ParseLimits,
    tables: TableCache,
    #[cfg_attr(not(feature = "tokenizer"), allow(dead_code))]
    cuts: offpath::CutCache,
}

/// The endpoint and metrics tables as this engine last read them, and the
/// state epoch (see [`kvroute_shared_state::load::LoadTable::epoch`]) they belong to.
#[derive(Debug)]
struct Tables {
    epoch: u64,
    /// Healthy endpoints, in table order.
    healthy: Arc<Vec<EndpointEntry>>,
    metrics: Arc<MetricsTable>,
    models: Arc<ModelsTable>,
}

/// A per-engine (in Envoy: per worker VM) copy of [`Tables`]. Every request
/// reads the load table anyway; while its epoch is unchanged, the endpoint
/// and metrics tables are not read or decoded again. A clone starts empty.
#[derive(Debug, Default)]
struct TableCache(Mutex<Option<Tables>>);

impl Clone for TableCache {
    fn clone(&self) -> Self {
        TableCache::default()
    }
}

/// OpenAI-style error body.
pub fn openai_error(message: &str, kind: &str, code: u32) -> String {
    serde_json::json!({"error": {"message": message, "type": kind, "param": null, "code": code}})
        .to_string()
}

/// Anthropic-style error body (the Messages API's): its `error.type` from
/// the status, as Anthropic documents them.
pub fn anthropic_error(message: &str, status: u32) -> String {
    let kind = match status {
        400 => "invalid_request_error",
        404 => "not_found_error",
        413 => "request_too_large",
        429 => "rate_limit_error",
        503 | 529 => "overloaded_error",
        _ => "api_error",
    };
    serde_json::json!({"type": "error", "error": {"type": kind, "message": message}}).to_string()
}

/// A local error reply's body in the shape of the request's API: Anthropic's
/// for the Messages API, else OpenAI's (`kind` is OpenAI's error type).
/// `None`: a request whose API is not known (passthrough), answered in
/// OpenAI's shape.
pub fn error_body(api: Option<ApiKind>, message: &str, kind: &str, status: u32) -> String {
    match api {
        Some(ApiKind::Messages) => anthropic_error(message, status),
        _ => openai_error(message, kind, status),
    }
}

impl Unrouted {
    /// What a local error reply says.
    pub fn message(&self) -> String {
        match self {
            Unrouted::BadBody(e) => e.to_string(),
            Unrouted::NoEndpoints => "no model server endpoints are available".into(),
            Unrouted::UnknownModel(m) => format!("The model `{m}` does not exist."),
            Unrouted::Store(m) => m.clone(),
        }
    }
}

impl Engine {
    pub fn new(config: Config) -> Engine {
        let geometry = IndexGeometry::from_budget(config.shared_state.index_budget_bytes);
        let limits = ParseLimits {
            max_body_bytes: config.routing.max_body_bytes,
        };
        Engine {
            config,
            geometry,
            limits,
            tables: TableCache::default(),
            cuts: offpath::CutCache::default(),
        }
    }

    pub fn geometry(&self) -> IndexGeometry {
        self.geometry
    }

    /// The endpoint table: the collector's, or the static list's before the
    /// collector has written one.
    pub fn endpoint_table(&self, store: &dyn Store) -> Result<EndpointTable, StoreError> {
        if let Some((bytes, _)) = store.get(ENDPOINTS_KEY)? {
            if let Some(t) = EndpointTable::decode(&bytes) {
                return Ok(t);
            }
        }
        Ok(match &self.config.endpoints {
            EndpointSource::Static(list) => {
                EndpointTable::from_static(&list.iter().map(|a| a.to_string()).collect::<Vec<_>>())
            }
            EndpointSource::FromCluster { .. } => EndpointTable::default(),
        })
    }

    /// The healthy endpoints and the metrics table for state epoch `epoch`
    /// (see [`Engine::tables_with_models`]).
    fn tables(
        &self,
        store: &dyn Store,
        epoch: u64,
    ) -> Result<(Arc<Vec<EndpointEntry>>, Arc<MetricsTable>), StoreError> {
        self.tables_with_models(store, epoch)
            .map(|(healthy, metrics, _)| (healthy, metrics))
    }

    /// The healthy endpoints, the metrics table and the models table for
    /// state epoch `epoch`: this engine's copies if they belong to it, else
    /// read and decoded (and kept, if the epoch is known). Epoch 0 (no
    /// collector has bumped it) is never cached.
    #[allow(clippy::type_complexity)]
    fn tables_with_models(
        &self,
        store: &dyn Store,
        epoch: u64,
    ) -> Result<(Arc<Vec<EndpointEntry>>, Arc<MetricsTable>, Arc<ModelsTable>), StoreError> {
        if epoch != 0 {
            if let Ok(guard) = self.tables.0.lock() {
                if let Some(t) = guard.as_ref().filter(|t| t.epoch == epoch) {
                    return Ok((t.healthy.clone(), t.metrics.clone(), t.models.clone()));
                }
            }
        }
        let table = self.endpoint_table(store)?;
        let healthy: Arc<Vec<EndpointEntry>> =
            Arc::new(table.endpoints.into_iter().filter(|e| e.healthy).collect());
        let metrics = Arc::new(MetricsTable::decode(
            store.get(METRICS_KEY)?.as_ref().map(|(b, _)| b.as_slice()),
        ));
        let models = Arc::new(self.models_table(store)?);
        if epoch != 0 {
            if let Ok(mut guard) = self.tables.0.lock() {
                *guard = Some(Tables {
                    epoch,
                    healthy: healthy.clone(),
                    metrics: metrics.clone(),
                    models: models.clone(),
                });
            }
        }
        Ok((healthy, metrics, models))
    }

    /// What the failure mode says to do with a request kvroute cannot route:
    /// with `failureMode: closed`, a rejection whose body has the shape of
    /// the request's API (`api`, see [`error_body`]): 400 for a bad body,
    /// 413 for one over `maxBodyBytes`, 404 for an unknown model (vLLM's
    /// body on the OpenAI APIs), 503 for no endpoint or a shared-data error.
    pub fn fail_for(&self, why: Unrouted, api: Option<ApiKind>) -> Outcome {
        if self.config.routing.failure_mode == FailureMode::Open {
            return Outcome::FailOpen(why);
        }
        let message = why.message();
        let messages = api == Some(ApiKind::Messages);
        let (status, body) = match &why {
            // Over `maxBodyBytes`: 413 (the OpenAI body's `code` says 400).
            Unrouted::BadBody(ParseError::TooLarge { .. }) if !messages => {
                (413, openai_error(&message, "invalid_request_error", 400))
            }
            Unrouted::BadBody(ParseError::TooLarge { .. }) => (413, anthropic_error(&message, 413)),
            Unrouted::BadBody(_) => (400, error_body(api, &message, "invalid_request_error", 400)),
            // vLLM's own body on the OpenAI APIs.
            Unrouted::UnknownModel(m) if !messages => (404, models::model_not_found(m)),
            Unrouted::UnknownModel(_) => (404, anthropic_error(&message, 404)),
            Unrouted::NoEndpoints | Unrouted::Store(_) => {
                (503, error_body(api, &message, "service_unavailable", 503))
            }
        };
        Outcome::Reject { status, body, why }
    }

    /// Capacity of an endpoint in index blocks.
    pub(crate) fn capacity_blocks(&self, metrics: Option<&MetricsSnapshot>) -> u64 {
        self.capacity_blocks_in(metrics, self.config.prefix.blocks.block_size_tokens)
    }

    /// Capacity of an endpoint in index blocks of `block_tokens` (server)
    /// tokens each.
    pub(crate) fn capacity_blocks_in(
        &self,
        metrics: Option<&MetricsSnapshot>,
        block_tokens: u32,
    ) -> u64 {
        let bs = u64::from(block_tokens.max(1));
        if self.config.prefix.auto_tune {
            if let Some(tokens) = metrics.and_then(|m| m.capacity_tokens()) {
                return (tokens / bs).max(1);
            }
        }
        self.config.prefix.lru_capacity_per_server
    }
}

#[cfg(test)]
mod tests;

#[cfg(test)]
mod models_tests;

//! The module's lifecycle as plain Rust: what the proxy-wasm glue does on
//! each callback, written against a small [`Host`] trait so it is unit-tested
//! natively (`lifecycle/tests.rs`) and the glue only moves calls across.
//!
//! - [`configure`] reads the plugin JSON and picks the role by `root_id`:
//!   a filter [`Worker`] (one per Envoy worker VM) or the [`Collector`]
//!   singleton.
//! - [`Stream`] is one request through the filter: the release flags that
//!   make every exit path release its charge exactly once live there.
//! - [`classify`] is the one place a request's method and path are matched
//!   against `routing.paths` and `routing.statePath`.
//! - [`Counter`] and [`Counts`] are the Envoy counters, tallied in the VM and
//!   handed over on a tick.
//! - [`telemetry`]: the histograms (sampled in the VM, handed over on the
//!   tick), the collector's gauges and the collector-leader hook.

mod collector;
mod flow;
pub mod lease;
mod mesh_link;
mod stream;
pub mod telemetry;
#[cfg(test)]
mod tests;
pub mod tokenizing;

pub use collector::{Collector, Timers};
pub use stream::{Stream, DECISION_HEADER};

use crate::config::{CollectorMode, Config, RoutingConfig};
use crate::engine::Engine;
use crate::request::ApiKind;
use crate::scheduling::{Branch, Rng};
use kvroute_shared_state::Store;
use std::cell::{Cell, RefCell};
use std::fmt;
use std::rc::Rc;

/// `root_id` of the singleton collector. Any other root id is the filter.
pub const COLLECTOR_ROOT_ID: &str = "kvroute-collector";

/// How often a filter VM hands its counts to Envoy, in ms.
pub const FLUSH_PERIOD_MS: u32 = 200;

/// A host call that did not return `Ok`: the call's name and the
/// proxy-wasm status code it returned.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HostError {
    pub call: &'static str,
    pub status: u32,
}

impl fmt::Display for HostError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let name = match self.status {
            1 => "NotFound",
            2 => "BadArgument",
            3 => "SerializationFailure",
            4 => "ParseFailure",
            7 => "Empty",
            8 => "CasMismatch",
            10 => "InternalFailure",
            12 => "Unimplemented",
            _ => "unknown status",
        };
        write!(f, "{} returned {} ({})", self.call, self.status, name)
    }
}

pub type HostResult<T> = Result<T, HostError>;

/// Log levels kvroute uses (proxy-wasm's numbering).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Level {
    Debug = 1,
    Info = 2,
    Warn = 3,
    Error = 4,
}

/// What a stream callback tells Envoy.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Action {
    Continue,
    Pause,
}

/// Everything the lifecycle asks of the proxy. The glue implements it with
/// the proxy-wasm SDK's host calls; `lifecycle/tests.rs` with a recording
/// fake over an in-memory store. Every call that can fail returns a
/// `Result`, and the lifecycle counts or logs each error.
pub trait Host {
    /// Envoy shared data.
    fn store(&self) -> &dyn Store;
    /// Wall clock, ns since the epoch.
    fn now_ns(&self) -> HostResult<u64>;
    fn log(&self, level: Level, message: &str);
    fn set_tick_period_ms(&self, ms: u32) -> HostResult<()>;
    /// The plugin configuration (`None`: empty).
    fn plugin_configuration(&self) -> HostResult<Option<Vec<u8>>>;
    /// The plugin's `root_id` (`None`: not set).
    fn root_id(&self) -> HostResult<Option<Vec<u8>>>;

    /// The whole request header map in one call (names are lower case;
    /// values are bytes, since a client may send any octet).
    fn request_headers(&self) -> HostResult<Vec<(String, Vec<u8>)>>;
    fn remove_request_header(&self, name: &str) -> HostResult<()>;
    fn set_request_header(&self, name: &str, value: &str) -> HostResult<()>;
    fn set_response_header(&self, name: &str, value: &str) -> HostResult<()>;
    /// A response header's value (in the response headers callback;
    /// `:status` tells whether the server accepted the request).
    fn response_header(&self, name: &str) -> HostResult<Option<Vec<u8>>>;
    /// Envoy's `upstream.address` (`ip:port` of the host that answered),
    /// `None` when there was none (a local reply).
    fn upstream_address(&self) -> HostResult<Option<Vec<u8>>>;
    /// The buffered request body, `size` bytes from the start.
    fn request_body(&self, size: usize) -> HostResult<Option<Vec<u8>>>;
    /// Answers the request locally with a JSON body.
    fn send_json_response(&self, status: u32, body: &str) -> HostResult<()>;
    /// [`Host::send_json_response`] with more response headers.
    fn send_json_response_with(
        &self,
        status: u32,
        body: &str,
        headers: &[(&str, &str)],
    ) -> HostResult<()>;
    /// `proxy_set_effective_context`: the stream calls that follow (headers,
    /// local replies, resuming) act on that request. Flow control's
    /// dispatch on the root's tick uses it; each host callback starts with
    /// its own context effective again.
    fn set_effective_context(&self, context_id: u32) -> HostResult<()>;
    /// `proxy_continue_stream` of the effective context's request: a
    /// request paused after its body goes on upstream.
    fn resume_request(&self) -> HostResult<()>;

    /// Dispatches an HTTP call (no body) to `cluster`; returns its token.
    fn http_call(
        &self,
        cluster: &str,
        headers: &[(&str, &str)],
        timeout_ms: u32,
    ) -> HostResult<u32>;
    /// Dispatches an HTTP call with a body (a POST) to `cluster`; returns
    /// its token. The answer comes as for [`Host::http_call`].
    fn http_post(
        &self,
        cluster: &str,
        headers: &[(&str, &str)],
        body: &[u8],
        timeout_ms: u32,
    ) -> HostResult<u32>;
    /// In `on_http_call_response`: the response's `:status`.
    fn http_call_status(&self) -> HostResult<Option<String>>;
    /// In `on_http_call_response`: the response body.
    fn http_call_body(&self, size: usize) -> HostResult<Option<Vec<u8>>>;

    /// `proxy_register_shared_queue`: this VM is told of the queue's
    /// items (`on_queue_ready`); returns its token.
    fn register_queue(&self, name: &str) -> HostResult<u32>;
    /// `proxy_resolve_shared_queue` in this VM's `vm_id` (`None`: nobody
    /// registered it yet).
    fn resolve_queue(&self, name: &str) -> HostResult<Option<u32>>;
    /// `proxy_enqueue_shared_queue`.
    fn enqueue(&self, queue: u32, value: &[u8]) -> HostResult<()>;
    /// `proxy_dequeue_shared_queue` (`None`: empty).
    fn dequeue(&self, queue: u32) -> HostResult<Option<Vec<u8>>>;

    fn define_counter(&self, name: &str) -> HostResult<u32>;
    fn increment_counter(&self, id: u32, by: i64) -> HostResult<()>;
    /// `proxy_define_metric` of a gauge.
    fn define_gauge(&self, name: &str) -> HostResult<u32>;
    /// `proxy_define_metric` of a histogram.
    fn define_histogram(&self, name: &str) -> HostResult<u32>;
    /// `proxy_record_metric`: sets a gauge, or adds one histogram sample.
    fn record_metric(&self, id: u32, value: u64) -> HostResult<()>;
}

/// The module's Envoy counters (shown by Envoy as `wasmcustom.kvroute_*`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Counter {
    Routed,
    FailOpen,
    Rejected,
    BranchSticky,
    BranchSaturationRelease,
    BranchNoAffinity,
    BranchExploration,
    BranchOther,
    ClientHeaderStripped,
    /// Routed requests the server did not accept (non-2xx, or no response
    /// at all), whose index and learner writes were taken back.
    TakenBack,
    /// Routed requests Envoy retried to another endpoint, whose charge
    /// moved there.
    ChargeMoved,
    HostErrors,
    MetricsPollFailures,
    ReapedRequests,
    CasRetries,
    KvEventsPolls,
    KvEventsPollFailures,
    KvEventsBadAnswers,
    KvEventsResyncs,
    KvEventsSnapshots,
    KvEventsIndexResets,
    KvEventsDropped,
    /// Precise mode: routed on the servers' held blocks.
    PreciseMatched,
    /// Precise mode: routed on the approximate index, by reason
    /// ([`Fallback`](crate::precise::Fallback)).
    PreciseFallbackNoTokenizer,
    PreciseFallbackUnknownModel,
    PreciseFallbackTemplate,
    PreciseFallbackTokenize,
    PreciseFallbackUnsupported,
    PreciseFallbackNoHeldView,
    PreciseFallbackNotHashedYet,
    PreciseFallbackTokenizerLoading,
    PreciseFallbackLoraAdapter,
    PreciseFallbackLoraPathUnknown,
    PreciseFallbackLoraPathsDiffer,
    /// Requests for a model no endpoint serves (`engine/models.rs`):
    /// answered 404 (fail-closed) or passed on unrouted (fail-open).
    UnknownModel,
    /// The collector: `/v1/models` polls that failed (timeout, non-200,
    /// not vLLM's list).
    ModelsPollFailures,
    /// Precise mode (`tokenizeIn: collector`): routed on a stored prefix of
    /// the prompt, its new text estimated (a conversation's next turn).
    PrecisePrefixPartial,
    /// `tokenizeIn: collector`: texts handed to the collector, and those
    /// dropped (its queue full or not found).
    TokenizeQueued,
    TokenizeDropped,
    /// The collector: jobs tokenized and stored, jobs dropped (base gone,
    /// tokenizer failed), bytes tokenized, tokenizer loads and failures.
    TokenizeJobsDone,
    TokenizeJobsFailed,
    TokenizeBytes,
    TokenizerLoaded,
    TokenizerLoadFailures,
    /// Mesh exchange: posts to a relay that were answered.
    MeshExchanges,
    /// Mesh exchange: posts that failed (no relay, timeout, non-200,
    /// garbage); their decisions are not told.
    MeshExchangeFailures,
    /// Mesh exchange: accepted decisions told to the relays.
    MeshDecisionsSent,
    /// Mesh exchange: other proxies' decisions applied.
    MeshDecisionsReceived,
    /// Mesh exchange: decisions dropped at a bound (the outbox, or the
    /// unsent queue of an endpoint whose relay does not answer).
    MeshDecisionsDropped,
    /// Mesh exchange: a relay could not continue from this proxy's cursor.
    MeshResyncs,
    /// Session affinity: routed requests whose session named a healthy
    /// endpoint (a token or a live binding).
    SessionHits,
    /// Session affinity: routed requests whose binding had been idle past
    /// the TTL.
    SessionExpired,
    /// Session affinity (`session_id`): bindings made or refreshed by
    /// accepted work.
    SessionBound,
    /// Session affinity (`session_id`): bindings moved to another endpoint
    /// (the bound one was absent, released by the gate, or unreachable).
    SessionMoved,
    /// Session affinity (`session_id`): live bindings that gave up their
    /// slot to a new session (the table was full).
    SessionEvicted,
    /// Session affinity (`session_id`) across a mesh: bindings made or
    /// refreshed here by other proxies' accepted decisions (collector).
    SessionPeerBound,
    /// Session affinity (`session_id`) across a mesh: bindings moved here
    /// because another proxy moved its own (collector).
    SessionPeerMoved,
}

impl Counter {
    pub const ALL: [Counter; 57] = [
        Counter::Routed,
        Counter::FailOpen,
        Counter::Rejected,
        Counter::BranchSticky,
        Counter::BranchSaturationRelease,
        Counter::BranchNoAffinity,
        Counter::BranchExploration,
        Counter::BranchOther,
        Counter::ClientHeaderStripped,
        Counter::TakenBack,
        Counter::ChargeMoved,
        Counter::HostErrors,
        Counter::MetricsPollFailures,
        Counter::ReapedRequests,
        Counter::CasRetries,
        Counter::KvEventsPolls,
        Counter::KvEventsPollFailures,
        Counter::KvEventsBadAnswers,
        Counter::KvEventsResyncs,
        Counter::KvEventsSnapshots,
        Counter::KvEventsIndexResets,
        Counter::KvEventsDropped,
        Counter::PreciseMatched,
        Counter::PreciseFallbackNoTokenizer,
        Counter::PreciseFallbackUnknownModel,
        Counter::PreciseFallbackTemplate,
        Counter::PreciseFallbackTokenize,
        Counter::PreciseFallbackUnsupported,
        Counter::PreciseFallbackNoHeldView,
        Counter::PreciseFallbackNotHashedYet,
        Counter::PreciseFallbackTokenizerLoading,
        Counter::PreciseFallbackLoraAdapter,
        Counter::PreciseFallbackLoraPathUnknown,
        Counter::PreciseFallbackLoraPathsDiffer,
        Counter::UnknownModel,
        Counter::ModelsPollFailures,
        Counter::PrecisePrefixPartial,
        Counter::TokenizeQueued,
        Counter::TokenizeDropped,
        Counter::TokenizeJobsDone,
        Counter::TokenizeJobsFailed,
        Counter::TokenizeBytes,
        Counter::TokenizerLoaded,
        Counter::TokenizerLoadFailures,
        Counter::MeshExchanges,
        Counter::MeshExchangeFailures,
        Counter::MeshDecisionsSent,
        Counter::MeshDecisionsReceived,
        Counter::MeshDecisionsDropped,
        Counter::MeshResyncs,
        Counter::SessionHits,
        Counter::SessionExpired,
        Counter::SessionBound,
        Counter::SessionMoved,
        Counter::SessionEvicted,
        Counter::SessionPeerBound,
        Counter::SessionPeerMoved,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Counter::Routed => "kvroute_routed",
            Counter::FailOpen => "kvroute_fail_open",
            Counter::Rejected => "kvroute_rejected",
            Counter::BranchSticky => "kvroute_branch_sticky",
            Counter::BranchSaturationRelease => "kvroute_branch_saturation_release",
            Counter::BranchNoAffinity => "kvroute_branch_no_affinity",
            Counter::BranchExploration => "kvroute_branch_exploration",
            Counter::BranchOther => "kvroute_branch_other",
            Counter::ClientHeaderStripped => "kvroute_client_header_stripped",
            Counter::TakenBack => "kvroute_taken_back",
            Counter::ChargeMoved => "kvroute_charge_moved",
            Counter::HostErrors => "kvroute_host_errors",
            Counter::MetricsPollFailures => "kvroute_metrics_poll_failures",
            Counter::ReapedRequests => "kvroute_reaped_requests",
            Counter::CasRetries => "kvroute_cas_retries",
            Counter::KvEventsPolls => "kvroute_kv_events_polls",
            Counter::KvEventsPollFailures => "kvroute_kv_events_poll_failures",
            Counter::KvEventsBadAnswers => "kvroute_kv_events_bad_answers",
            Counter::KvEventsResyncs => "kvroute_kv_events_resyncs",
            Counter::KvEventsSnapshots => "kvroute_kv_events_snapshots",
            Counter::KvEventsIndexResets => "kvroute_kv_events_index_resets",
            Counter::KvEventsDropped => "kvroute_kv_events_dropped_blocks",
            Counter::PreciseMatched => "kvroute_precise_matched",
            Counter::PreciseFallbackNoTokenizer => "kvroute_precise_fallback_no_tokenizer",
            Counter::PreciseFallbackUnknownModel => "kvroute_precise_fallback_unknown_model",
            Counter::PreciseFallbackTemplate => "kvroute_precise_fallback_template",
            Counter::PreciseFallbackTokenize => "kvroute_precise_fallback_tokenize",
            Counter::PreciseFallbackUnsupported => "kvroute_precise_fallback_unsupported",
            Counter::PreciseFallbackNoHeldView => "kvroute_precise_fallback_no_held_view",
            Counter::PreciseFallbackNotHashedYet => "kvroute_precise_fallback_not_hashed_yet",
            Counter::PreciseFallbackTokenizerLoading => {
                "kvroute_precise_fallback_tokenizer_loading"
            }
            Counter::PreciseFallbackLoraAdapter => "kvroute_precise_fallback_lora_adapter",
            Counter::PreciseFallbackLoraPathUnknown => "kvroute_precise_fallback_lora_path_unknown",
            Counter::PreciseFallbackLoraPathsDiffer => "kvroute_precise_fallback_lora_paths_differ",
            Counter::UnknownModel => "kvroute_unknown_model",
            Counter::ModelsPollFailures => "kvroute_models_poll_failures",
            Counter::PrecisePrefixPartial => "kvroute_precise_prefix_partial",
            Counter::TokenizeQueued => "kvroute_tokenize_queued",
            Counter::TokenizeDropped => "kvroute_tokenize_dropped",
            Counter::TokenizeJobsDone => "kvroute_tokenize_jobs_done",
            Counter::TokenizeJobsFailed => "kvroute_tokenize_jobs_failed",
            Counter::TokenizeBytes => "kvroute_tokenize_bytes",
            Counter::TokenizerLoaded => "kvroute_tokenizer_loaded",
            Counter::TokenizerLoadFailures => "kvroute_tokenizer_load_failures",
            Counter::MeshExchanges => "kvroute_mesh_exchanges",
            Counter::MeshExchangeFailures => "kvroute_mesh_exchange_failures",
            Counter::MeshDecisionsSent => "kvroute_mesh_decisions_sent",
            Counter::MeshDecisionsReceived => "kvroute_mesh_decisions_received",
            Counter::MeshDecisionsDropped => "kvroute_mesh_decisions_dropped",
            Counter::MeshResyncs => "kvroute_mesh_resyncs",
            Counter::SessionHits => "kvroute_session_hits",
            Counter::SessionExpired => "kvroute_session_expired",
            Counter::SessionBound => "kvroute_session_bound",
            Counter::SessionMoved => "kvroute_session_moved",
            Counter::SessionEvicted => "kvroute_session_evicted",
            Counter::SessionPeerBound => "kvroute_session_peer_bound",
            Counter::SessionPeerMoved => "kvroute_session_peer_moved",
        }
    }

    /// The counter precise mode's outcome adds to.
    pub fn for_precise(u: crate::precise::PreciseUse) -> Counter {
        use crate::precise::{Fallback, PreciseUse};
        match u {
            PreciseUse::Matched { .. } => Counter::PreciseMatched,
            PreciseUse::Fallback { why, .. } => match why {
                Fallback::NoTokenizer => Counter::PreciseFallbackNoTokenizer,
                Fallback::UnknownModel => Counter::PreciseFallbackUnknownModel,
                Fallback::Template => Counter::PreciseFallbackTemplate,
                Fallback::Tokenize => Counter::PreciseFallbackTokenize,
                Fallback::Unsupported => Counter::PreciseFallbackUnsupported,
                Fallback::NoHeldView => Counter::PreciseFallbackNoHeldView,
                Fallback::NotHashedYet => Counter::PreciseFallbackNotHashedYet,
                Fallback::TokenizerLoading => Counter::PreciseFallbackTokenizerLoading,
                Fallback::LoraAdapter => Counter::PreciseFallbackLoraAdapter,
                Fallback::LoraPathUnknown => Counter::PreciseFallbackLoraPathUnknown,
                Fallback::LoraPathsDiffer => Counter::PreciseFallbackLoraPathsDiffer,
            },
        }
    }

    /// The counter a routing decision's branch adds to.
    pub fn for_branch(branch: Branch) -> Counter {
        match branch {
            Branch::Sticky => Counter::BranchSticky,
            Branch::SaturationRelease => Counter::BranchSaturationRelease,
            Branch::NoAffinity => Counter::BranchNoAffinity,
            Branch::Exploration => Counter::BranchExploration,
            Branch::Single | Branch::Unfiltered => Counter::BranchOther,
        }
    }
}

/// Counter ids as Envoy defined them, and (when batched) the counts not yet
/// handed over. Each `proxy_increment_metric` is a VM exit and entry, so a
/// filter VM counts in its own memory and flushes on its tick: Envoy's
/// counters lag by at most one [`FLUSH_PERIOD_MS`]. A counter that cannot be
/// defined is skipped (and logged), never fatal.
#[derive(Debug, Default)]
pub struct Counts {
    ids: Vec<Option<u32>>,
    pending: Option<[Cell<u64>; Counter::ALL.len()]>,
}

impl Counts {
    /// Counters that reach Envoy at once (`batched` false) or on [`Counts::flush`].
    pub fn define(host: &dyn Host, batched: bool) -> Counts {
        let ids = Counter::ALL
            .iter()
            .map(|c| match host.define_counter(c.name()) {
                Ok(id) => Some(id),
                Err(e) => {
                    host.log(
                        Level::Warn,
                        &format!("kvroute: counter {} not defined: {e}", c.name()),
                    );
                    None
                }
            })
            .collect();
        Counts {
            ids,
            pending: batched.then(|| std::array::from_fn(|_| Cell::new(0))),
        }
    }

    fn send(&self, host: &dyn Host, c: usize, by: u64) {
        if let Some(Some(id)) = self.ids.get(c) {
            if let Err(e) = host.increment_counter(*id, by.min(i64::MAX as u64) as i64) {
                host.log(
                    Level::Debug,
                    &format!(
                        "kvroute: counter {} not incremented: {e}",
                        Counter::ALL[c].name()
                    ),
                );
            }
        }
    }

    pub fn add(&self, host: &dyn Host, c: Counter, by: u64) {
        if by == 0 {
            return;
        }
        match self.pending.as_ref().and_then(|p| p.get(c as usize)) {
            Some(cell) => cell.set(cell.get().saturating_add(by)),
            None => self.send(host, c as usize, by),
        }
    }

    pub fn inc(&self, host: &dyn Host, c: Counter) {
        self.add(host, c, 1);
    }

    /// Hands the pending counts to Envoy (one host call per counter that moved).
    pub fn flush(&self, host: &dyn Host) {
        if let Some(pending) = &self.pending {
            for (i, cell) in pending.iter().enumerate() {
                let n = cell.replace(0);
                if n > 0 {
                    self.send(host, i, n);
                }
            }
        }
    }
}

/// What a request's method and path ask of the filter.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PathClass {
    /// `GET routing.statePath`: answer with the shared state.
    State,
    /// A POST to a configured inference path: buffer and route.
    Routable(ApiKind),
    /// Any other request when `passthrough-parser` is listed
    /// (`routing.passthrough`): route at the headers, on load alone.
    Passthrough,
    /// Anything else: pass on untouched.
    Pass,
}

/// The one place paths are matched. The query (`?…`) and fragment (`#…`)
/// are stripped first; a trailing `/` is ignored on both sides; a
/// configured path matches as a suffix (so `/v1/chat/completions` also
/// matches `/openai/v1/chat/completions`). With `routing.passthrough`,
/// every request that is neither is `Passthrough`.
pub fn classify(method: &[u8], path: &[u8], routing: &RoutingConfig) -> PathClass {
    let other = if routing.passthrough {
        PathClass::Passthrough
    } else {
        PathClass::Pass
    };
    let Ok(path) = std::str::from_utf8(path) else {
        return other;
    };
    let bare = path.split(['?', '#']).next().unwrap_or("");
    if method == b"GET" && routing.state_path.as_deref() == Some(bare) {
        return PathClass::State;
    }
    if method != b"POST" {
        return other;
    }
    let trimmed = bare.trim_end_matches('/');
    let configured = routing
        .paths
        .iter()
        .any(|p| trimmed.ends_with(p.trim_end_matches('/')));
    match ApiKind::from_path(bare) {
        Some(kind) if configured => PathClass::Routable(kind),
        _ => other,
    }
}

/// What a filter VM shares between its requests.
pub struct Worker {
    pub engine: Engine,
    rng: RefCell<Rng>,
    pub counts: Counts,
    /// Histogram samples, handed to Envoy with the counts.
    pub samples: telemetry::Samples,
    /// The last time the host's clock answered, in ms. A clock error reuses
    /// it (and is counted) rather than stamping time 0, which would make a
    /// fresh charge look ancient to the reaper.
    last_now_ms: Cell<u64>,
    /// `kvroute_collector_tick_age_ms`, which every worker publishes.
    tick_age: RefCell<telemetry::TickAge>,
    /// The tokenize queue's token, once resolved.
    tokenize_queue: Cell<Option<u32>>,
    /// Flow control (`featureGates: ["flowControl"]`), when configured.
    pub flow: Option<flow::FlowState>,
    /// When the counts were last handed to Envoy (the tick is faster with
    /// flow control).
    last_flush_ms: Cell<u64>,
}

impl Worker {
    pub fn new(engine: Engine, seed: u64, counts: Counts) -> Worker {
        Worker {
            engine,
            rng: RefCell::new(Rng::new(seed)),
            counts,
            samples: telemetry::Samples::new(seed),
            last_now_ms: Cell::new(0),
            tick_age: RefCell::new(telemetry::TickAge::default()),
            tokenize_queue: Cell::new(None),
            flow: None,
            last_flush_ms: Cell::new(0),
        }
    }

    /// Adds flow control from the engine's config (its metrics defined;
    /// `id`: this worker's record on the board).
    pub fn with_flow(mut self, host: &dyn Host, id: u64) -> Worker {
        self.flow = self
            .engine
            .config
            .flow
            .clone()
            .map(|cfg| flow::FlowState::new(host, cfg, id));
        self
    }

    /// Hands an accepted request's new text to the collector
    /// (`tokenizeIn: collector`): dropped, counted, when the queue is not
    /// registered yet or its bound is reached.
    pub fn send_job(&self, host: &dyn Host, job: &[u8]) {
        let queue = match self.tokenize_queue.get() {
            Some(q) => Some(q),
            None => match host.resolve_queue(tokenizing::TOKENIZE_QUEUE) {
                Ok(q) => {
                    self.tokenize_queue.set(q);
                    q
                }
                Err(e) => {
                    self.host_error(host, "resolving the tokenize queue", e);
                    None
                }
            },
        };
        let Some(queue) = queue else {
            self.counts.inc(host, Counter::TokenizeDropped);
            return;
        };
        let len = job.len() as u64;
        match kvroute_shared_state::hashed::reserve(
            host.store(),
            len,
            tokenizing::MAX_PENDING_BYTES,
        ) {
            Ok(true) => {}
            Ok(false) => {
                self.counts.inc(host, Counter::TokenizeDropped);
                return;
            }
            Err(e) => {
                self.host_error(host, "reserving room in the tokenize queue", e);
                self.counts.inc(host, Counter::TokenizeDropped);
                return;
            }
        }
        match host.enqueue(queue, job) {
            Ok(()) => self.counts.inc(host, Counter::TokenizeQueued),
            Err(e) => {
                self.host_error(host, "enqueueing a tokenize job", e);
                self.counts.inc(host, Counter::TokenizeDropped);
                // The queue may have gone (a new collector): resolve again.
                self.tokenize_queue.set(None);
                if let Err(e) = kvroute_shared_state::hashed::release(host.store(), len) {
                    self.host_error(host, "releasing room in the tokenize queue", e);
                }
            }
        }
    }

    /// Logs a host error and counts it in `kvroute_host_errors`.
    pub fn host_error(&self, host: &dyn Host, what: &str, e: impl fmt::Display) {
        host.log(Level::Warn, &format!("kvroute: {what}: {e}"));
        self.counts.inc(host, Counter::HostErrors);
    }

    /// Now in ms; on a clock error, the last time seen (the error counted).
    pub fn now_ms(&self, host: &dyn Host) -> u64 {
        self.clock_ns(host)
            .map_or(self.last_now_ms.get(), |ns| ns / 1_000_000)
    }

    /// The last time the clock answered, ms.
    pub fn now_ms_cached(&self) -> u64 {
        self.last_now_ms.get()
    }

    /// Now in ns (`None` on a clock error, counted); updates the last time.
    pub fn clock_ns(&self, host: &dyn Host) -> Option<u64> {
        match host.now_ns() {
            Ok(ns) => {
                self.last_now_ms.set(ns / 1_000_000);
                Some(ns)
            }
            Err(e) => {
                self.host_error(host, "reading the clock", e);
                None
            }
        }
    }

    /// The root's tick: publishes how long ago the collector ticked
    /// (`kvroute_collector_tick_age_ms`), then flushes. A clock error skips
    /// the gauge (counted) rather than compute an age from a stale time.
    pub fn on_tick(&self, host: &dyn Host) {
        let now = self.clock_ns(host).map(|ns| ns / 1_000_000);
        if let (Some(f), Some(now)) = (&self.flow, now) {
            f.on_tick(self, host, now);
        }
        // With flow control the tick is FLOW_TICK_MS; the gauge and the
        // counts still go every FLUSH_PERIOD_MS.
        if let Some(now) = now {
            if self.flow.as_ref().is_some_and(|f| f.cfg.queueing)
                && now.saturating_sub(self.last_flush_ms.get()) < u64::from(FLUSH_PERIOD_MS)
            {
                return;
            }
            self.last_flush_ms.set(now);
            self.tick_age.borrow_mut().on_tick(host, now);
        }
        self.flush(host);
    }

    /// Hands pending counts to Envoy (the root's tick and end).
    pub fn flush(&self, host: &dyn Host) {
        self.counts.flush(host);
        self.samples.flush(host);
    }
}

/// A configured root context.
pub enum Role {
    /// The HTTP filter of one worker VM; in `collector.mode: lease` it also
    /// has a collector, which works while this VM holds the lease.
    Filter {
        worker: Rc<Worker>,
        collector: Option<Box<Collector>>,
    },
    /// The bootstrap singleton.
    Collector(Box<Collector>),
}

impl Role {
    /// The filter's worker (what its requests share), if this is the filter.
    pub fn worker(&self) -> Option<Rc<Worker>> {
        match self {
            Role::Filter { worker, .. } => Some(worker.clone()),
            Role::Collector(_) => None,
        }
    }

    fn collector(&mut self) -> Option<&mut Collector> {
        match self {
            Role::Filter { collector, .. } => collector.as_deref_mut(),
            Role::Collector(c) => Some(c),
        }
    }

    /// `proxy_on_tick`: the collector's round, then the filter's gauge of
    /// the collector's last tick and its counts.
    pub fn on_tick(&mut self, host: &dyn Host) {
        if let Some(c) = self.collector() {
            c.on_tick(host);
        }
        if let Role::Filter { worker, .. } = self {
            worker.on_tick(host);
        }
    }

    /// `proxy_on_queue_ready`: the tokenize queue is the collector's.
    pub fn on_queue_ready(&mut self, host: &dyn Host, queue: u32) {
        if let Some(c) = self.collector() {
            c.on_queue_ready(host, queue);
        }
    }

    /// `proxy_on_http_call_response`: calls are the collector's.
    pub fn on_http_call_response(
        &mut self,
        host: &dyn Host,
        token: u32,
        num_headers: usize,
        body_size: usize,
    ) {
        if let Some(c) = self.collector() {
            c.on_http_call_response(host, token, num_headers, body_size);
        }
    }

    /// The root's end: hands over what was counted since the last tick;
    /// a collector gives back `kvroute_collector_leader`.
    pub fn on_done(&mut self, host: &dyn Host) {
        if let Some(c) = self.collector() {
            c.on_done(host);
        }
        if let Role::Filter { worker, .. } = self {
            worker.flush(host);
        }
    }
}

/// Seed mixed into the clock when `routing.seed` is not set.
const SEED_SALT: u64 = 0x6b76_726f_7574_6521;

/// Shared-data key: the hash of the last config whose warnings were logged.
const WARNED_KEY: &str = "kvroute/config/warned";

/// Logs the config's warnings (deprecated llm-d parameters and names, each
/// mapped to its replacement) once per Envoy process and config, not once
/// per VM: the first VM to mark the config's hash in shared data logs them
/// and counts them in `kvroute_config_warnings`.
fn warn_once(host: &dyn Host, bytes: &[u8], warnings: &[String]) {
    if warnings.is_empty() {
        return;
    }
    let hash = xxhash_rust::xxh64::xxh64(bytes, 0).to_le_bytes();
    let first = match host.store().get(WARNED_KEY) {
        Ok(Some((v, _))) if v == hash => false,
        Ok(Some((_, cas))) => host.store().set(WARNED_KEY, &hash, cas).is_ok(),
        Ok(None) => host.store().set(WARNED_KEY, &hash, 0).is_ok(),
        // No shared data: log here rather than never.
        Err(_) => true,
    };
    if !first {
        return;
    }
    for w in warnings {
        host.log(Level::Warn, &format!("kvroute config: {w}"));
    }
    if let Ok(id) = host.define_counter("kvroute_config_warnings") {
        let _ = host.increment_counter(id, warnings.len() as i64);
    }
}

/// `proxy_on_configure`: reads and validates the plugin configuration and
/// starts the role its `root_id` names. An error is the message to log;
/// the glue then fails the configuration (Envoy rejects the plugin).
pub fn configure(host: &dyn Host) -> Result<Role, String> {
    let bytes = host
        .plugin_configuration()
        .map_err(|e| format!("kvroute: cannot read the plugin configuration: {e}"))?
        .unwrap_or_default();
    let config = Config::from_json(&bytes).map_err(|e| format!("kvroute: {e}"))?;
    warn_once(host, &bytes, &config.warnings);
    let root_id = host
        .root_id()
        .map_err(|e| format!("kvroute: cannot read plugin_root_id: {e}"))?
        .unwrap_or_default();
    let engine = Engine::new(config);
    if root_id == COLLECTOR_ROOT_ID.as_bytes() {
        let c = Collector::start(host, engine).map_err(|e| format!("kvroute collector: {e}"))?;
        host.set_tick_period_ms(c.timers().tick_ms)
            .map_err(|e| format!("kvroute collector: no tick: {e}"))?;
        host.log(Level::Info, "kvroute collector configured");
        return Ok(Role::Collector(Box::new(c)));
    }
    // `lease` mode: this worker takes part in electing the collector.
    let collector = match engine.config.collector.mode {
        CollectorMode::Singleton => None,
        CollectorMode::Lease => Some(Box::new(
            Collector::start(host, engine.clone())
                .map_err(|e| format!("kvroute collector (lease): {e}"))?,
        )),
    };
    if let Err(e) = engine.ensure_tables(host.store()) {
        host.log(
            Level::Warn,
            &format!("kvroute: cannot create the shared tables: {e}"),
        );
    }
    let seed = match engine.config.routing.seed {
        Some(s) => s,
        None => match host.now_ns() {
            Ok(ns) => ns ^ SEED_SALT,
            Err(e) => {
                host.log(
                    Level::Warn,
                    &format!("kvroute: no clock for the seed ({e}); using a fixed one"),
                );
                SEED_SALT
            }
        },
    };
    // Mesh: this process's own tie salt (see `MeshConfig::tie_salt`).
    let mut engine = engine;
    if engine.config.mesh.enabled {
        engine.config.mesh.tie_salt = crate::scheduling::Rng::derive(seed, 0x5A17).next_u64();
    }
    // Counts go to Envoy on the tick; without a tick, at once. A lease
    // collector ticks at its own period when that is shorter.
    let tick_ms = collector
        .as_ref()
        .map_or(FLUSH_PERIOD_MS, |c| c.timers().tick_ms.min(FLUSH_PERIOD_MS));
    // Flow control dispatches on the tick.
    let queueing = engine.config.flow.as_ref().is_some_and(|f| f.queueing);
    let tick_ms = if queueing {
        tick_ms.min(crate::flow::FLOW_TICK_MS)
    } else {
        tick_ms
    };
    let batched = match host.set_tick_period_ms(tick_ms) {
        Ok(()) => true,
        Err(e) if collector.is_some() || queueing => {
            return Err(format!(
                "kvroute: collector.mode lease and flow control need a tick, and the host refused it: {e}"
            ))
        }
        Err(e) => {
            host.log(
                Level::Warn,
                &format!("kvroute: no tick ({e}); counters are sent per request"),
            );
            false
        }
    };
    let counts = Counts::define(host, batched);
    host.log(Level::Info, "kvroute filter configured");
    let flow_id = crate::scheduling::Rng::derive(seed, 0xF10E).next_u64();
    Ok(Role::Filter {
        worker: Rc::new(Worker::new(engine, seed, counts).with_flow(host, flow_id)),
        collector,
    })
}

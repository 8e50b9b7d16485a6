//! The routing engine: one request from body to destination, and the
//! collector's updates, over a [`Store`].
//!
//! This is everything the wasm glue does between host calls, written
//! against the `Store` trait so it runs natively (tests, simulator) exactly
//! as it runs in Envoy. The glue only moves bytes and headers.
//!
//! # The request path in detail
//!
//! [`Engine::route`]: parse → (precise mode: `PreciseConfig::request_hashes`,
//! token IDs → vLLM hashes) → `prompt_blocks` → [`Engine::snapshot`] →
//! `Scheduler::schedule` → charge → index insert; the lifecycle then writes
//! the destination header (`ARCHITECTURE.md`, "The request path", has the
//! steps around this).
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

use crate::blocks::prompt_blocks;
use crate::collector::prefill_rate::{self, PrefillRateParams};
use crate::collector::{bytes_per_token, output_tokens};
use crate::collector::{envoy_clusters, vllm_metrics};
use crate::config::{Config, EndpointSource, FailureMode};
use crate::precise::{Fallback, PreciseUse};
use crate::request::{parse_request, ApiKind, ParseError, ParseLimits, Prompt};
use crate::scheduling::charge::Work;
use crate::scheduling::{Candidate, Decision, EndpointMetrics, RequestView, Rng};
use kvroute_shared_state::cas::{update, update_bytes, update_seeded};
use kvroute_shared_state::endpoints::{EndpointEntry, EndpointTable};
use kvroute_shared_state::index::{self, Holder, IndexGeometry};
use kvroute_shared_state::load::{window_ms, LoadTable, Ticket, Undo};
use kvroute_shared_state::metrics::MetricsTable;
use kvroute_shared_state::{Store, StoreError, ENDPOINTS_KEY, LOAD_KEY, METRICS_KEY};
use std::fmt::Write as _;
use std::sync::{Arc, Mutex};

/// A candidate's rendezvous key: its `ip:port` hashed, so that every gateway
/// replica gives an endpoint the same key whatever slot it has there.
fn endpoint_key(address: &str) -> u64 {
    xxhash_rust::xxh64::xxh64(address.as_bytes(), 0)
}

/// The request's tie key (see [`RequestView::tie_key`]).
fn tie_key(hashes: &[u64], candidates: &[Candidate]) -> Option<u64> {
    let longest = candidates
        .iter()
        .map(|c| c.matched_blocks)
        .max()
        .unwrap_or(0) as usize;
    // The last block of the index group holding block `longest`: a prompt
    // that parts from a held one inside a group matches only the whole
    // groups before it (`index::group_key`), so block `longest` itself may
    // still be shared; that group's last block is the prompt's own.
    let group_end = longest / index::GROUP_BLOCKS * index::GROUP_BLOCKS + index::GROUP_BLOCKS - 1;
    hashes
        .get(group_end.min(hashes.len().saturating_sub(1)))
        .copied()
}

/// Why a request was not routed by kvroute.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Unrouted {
    BadBody(ParseError),
    NoEndpoints,
    /// Shared data refused a call (the message says how).
    Store(String),
}

impl Unrouted {
    /// A short stable label for counters and logs.
    pub fn label(&self) -> &'static str {
        match self {
            Unrouted::BadBody(e) => e.label(),
            Unrouted::NoEndpoints => "no_endpoints",
            Unrouted::Store(_) => "shared_data",
        }
    }
}

/// What the filter does with a request.
#[derive(Clone, Debug, PartialEq)]
pub enum Outcome {
    /// Set the destination header to `destination` and continue.
    Routed(Routed),
    /// Continue without a destination header (fail-open): Envoy's fallback
    /// load balancer decides.
    FailOpen(Unrouted),
    /// Answer locally with this status and OpenAI-style JSON (fail-closed).
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
    /// The prompt's block hashes, handed over by [`Engine::route`] once the
    /// decision is made (no copy on the request path).
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
        explain(&self.decision, self.primary_address(), self.uncached_tokens)
    }
}

/// What the scheduler sees for one request (see [`Engine::snapshot`]).
#[derive(Clone, Debug, PartialEq)]
pub struct Snapshot {
    /// Healthy endpoints, in table order; candidate `i` is endpoint `i`.
    pub endpoints: Arc<Vec<EndpointEntry>>,
    pub holders: Vec<Holder>,
    /// Per endpoint: `recorded` of its index entry for block 0, if held.
    pub first_recorded: Vec<Option<u32>>,
    /// The index shards the lookup read (see [`index::Matches::shards`]).
    pub shards: index::ShardReads,
    pub candidates: Vec<Candidate>,
    pub view: RequestView,
    /// The load table as read, with its CAS token (`None` if the key was
    /// missing): the charge tries its CAS on it before reading again.
    pub load: Option<(LoadTable, u32)>,
}

/// The engine for one configuration.
#[derive(Clone, Debug)]
pub struct Engine {
    pub config: Config,
    geometry: IndexGeometry,
    limits: ParseLimits,
    tables: TableCache,
}

/// The endpoint and metrics tables as this engine last read them, and the
/// state epoch (see [`LoadTable::epoch`]) they belong to.
#[derive(Debug)]
struct Tables {
    epoch: u64,
    /// Healthy endpoints, in table order.
    healthy: Arc<Vec<EndpointEntry>>,
    metrics: Arc<MetricsTable>,
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

/// A release on the load table's bytes, patched in place
/// ([`LoadTable::release_encoded`]); lost CAS races are retried. Returns
/// the races lost.
fn release(store: &dyn Store, ticket: &Ticket, rest: Option<bool>) -> Result<u32, StoreError> {
    update_bytes(
        store,
        LOAD_KEY,
        None,
        || LoadTable::default().encode(),
        |_| {},
        |bytes: &mut Vec<u8>| LoadTable::release_encoded(bytes, ticket, rest).then_some(()),
    )
    .map(|u| u.retries)
}

/// OpenAI-style error body.
pub fn openai_error(message: &str, kind: &str, code: u32) -> String {
    serde_json::json!({"error": {"message": message, "type": kind, "param": null, "code": code}})
        .to_string()
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

    /// The healthy endpoints and the metrics table for state epoch `epoch`:
    /// this engine's copies if they belong to it, else read and decoded
    /// (and kept, if the epoch is known). Epoch 0 (no collector has bumped
    /// it) is never cached.
    fn tables(
        &self,
        store: &dyn Store,
        epoch: u64,
    ) -> Result<(Arc<Vec<EndpointEntry>>, Arc<MetricsTable>), StoreError> {
        if epoch != 0 {
            if let Ok(guard) = self.tables.0.lock() {
                if let Some(t) = guard.as_ref().filter(|t| t.epoch == epoch) {
                    return Ok((t.healthy.clone(), t.metrics.clone()));
                }
            }
        }
        let table = self.endpoint_table(store)?;
        let healthy: Arc<Vec<EndpointEntry>> =
            Arc::new(table.endpoints.into_iter().filter(|e| e.healthy).collect());
        let metrics = Arc::new(MetricsTable::decode(
            store.get(METRICS_KEY)?.as_ref().map(|(b, _)| b.as_slice()),
        ));
        if epoch != 0 {
            if let Ok(mut guard) = self.tables.0.lock() {
                *guard = Some(Tables {
                    epoch,
                    healthy: healthy.clone(),
                    metrics: metrics.clone(),
                });
            }
        }
        Ok((healthy, metrics))
    }

    /// Tells workers that the endpoint or metrics table changed (the
    /// collector calls this after writing either).
    fn bump_epoch(&self, store: &dyn Store) -> Result<(), StoreError> {
        update(
            store,
            LOAD_KEY,
            LoadTable::decode,
            LoadTable::encode,
            |t: &mut LoadTable| {
                t.bump_epoch();
                Some(())
            },
        )
        .map(|_| ())
    }

    /// What the failure mode says to do with a request kvroute cannot route.
    pub fn fail_for(&self, why: Unrouted) -> Outcome {
        match self.config.routing.failure_mode {
            FailureMode::Open => Outcome::FailOpen(why),
            FailureMode::Closed => {
                let (status, body) = match &why {
                    Unrouted::BadBody(e) => (
                        400,
                        openai_error(&e.to_string(), "invalid_request_error", 400),
                    ),
                    Unrouted::NoEndpoints => (
                        503,
                        openai_error(
                            "no model server endpoints are available",
                            "service_unavailable",
                            503,
                        ),
                    ),
                    Unrouted::Store(m) => (503, openai_error(m, "service_unavailable", 503)),
                };
                Outcome::Reject { status, body, why }
            }
        }
    }

    /// Capacity of an endpoint in index blocks.
    pub(crate) fn capacity_blocks(
        &self,
        metrics: Option<&kvroute_shared_state::metrics::MetricsSnapshot>,
    ) -> u64 {
        self.capacity_blocks_in(metrics, self.config.prefix.blocks.block_size_tokens)
    }

    /// Capacity of an endpoint in index blocks of `block_tokens` (server)
    /// tokens each.
    fn capacity_blocks_in(
        &self,
        metrics: Option<&kvroute_shared_state::metrics::MetricsSnapshot>,
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

    /// Routes one request: parse, hash, read state, decide, charge, index.
    pub fn route(
        &self,
        store: &dyn Store,
        kind: ApiKind,
        body: &[u8],
        now_ms: u64,
        rng: &mut Rng,
    ) -> Outcome {
        let req = match parse_request(kind, body, &self.limits) {
            Ok(r) => r,
            Err(e) => return self.fail_for(Unrouted::BadBody(e)),
        };
        // Precise mode: vLLM's own hashes of the prompt, matched against the
        // blocks the servers hold (`kvEvents`); or, when they cannot be had,
        // the reason the approximate index decides instead.
        let precise = self
            .config
            .precise
            .as_ref()
            .map(|p| p.request_hashes(&req, body));
        let (precise_in, hash_failure) = match &precise {
            None => (None, None),
            Some(Ok((hashes, tokens))) => (Some((hashes.as_slice(), *tokens)), None),
            Some(Err(why)) => (None, Some(*why)),
        };
        let blocks = prompt_blocks(&req, &self.config.prefix.blocks);
        let text_bytes = match &req.prompt {
            Prompt::Text(t) => Some(t.len() as u64),
            Prompt::TokenIds(_) => None,
        };
        // n / best_of and a completions batch's other prompts (their text
        // estimated at `charsPerToken`, as a prompt without a learnt figure).
        let cpt = u64::from(self.config.prefix.blocks.chars_per_token.max(1));
        let rest = req.batch_rest;
        let work = Work {
            sequences: req.sequences,
            extra_prompts: rest.prompts,
            extra_prompt_tokens: rest.token_ids.saturating_add(rest.text_bytes.div_ceil(cpt)),
        };
        match self.route_parsed_precise(
            store,
            &blocks.block_hashes,
            blocks.prompt_tokens,
            precise_in,
            req.max_output_tokens,
            work,
            text_bytes,
            now_ms,
            rng,
        ) {
            Ok(Some(mut r)) => {
                r.stream = req.stream;
                if let Some(p) = r.provisional.as_mut().filter(|p| p.from_block.is_some()) {
                    p.hashes = blocks.block_hashes;
                }
                if let Some(why) = hash_failure {
                    r.precise = Some(PreciseUse::Fallback { why, blocks: 0 });
                }
                Outcome::Routed(r)
            }
            Ok(None) => self.fail_for(Unrouted::NoEndpoints),
            Err(e) => self.fail_for(Unrouted::Store(e.to_string())),
        }
    }

    /// The scheduler's input for a request, read from shared state: the
    /// healthy endpoints, their index holders, their candidates (longest
    /// held prefix, in-flight load, fresh metrics) and the request view.
    /// `None` when no healthy endpoint is known.
    pub fn snapshot(
        &self,
        store: &dyn Store,
        hashes: &[u64],
        prompt_tokens: u64,
        max_output_tokens: Option<u64>,
        now_ms: u64,
    ) -> Result<Option<Snapshot>, StoreError> {
        self.snapshot_of(
            store,
            hashes,
            prompt_tokens,
            max_output_tokens,
            None,
            now_ms,
        )
    }

    /// [`snapshot`](Self::snapshot) for a prompt of `text_bytes` bytes of
    /// text (`None`: token IDs or exact counts). With `charsPerToken:
    /// "auto"` and a learnt bytes-per-token figure, a text prompt's tokens,
    /// its block size in tokens and the endpoints' capacity in index blocks
    /// are in the servers' real tokens (`collector::bytes_per_token`).
    fn snapshot_of(
        &self,
        store: &dyn Store,
        hashes: &[u64],
        prompt_tokens: u64,
        max_output_tokens: Option<u64>,
        text_bytes: Option<u64>,
        now_ms: u64,
    ) -> Result<Option<Snapshot>, StoreError> {
        let load_read = store.get(LOAD_KEY)?;
        let load_cas = load_read.as_ref().map(|(_, cas)| *cas);
        let load = LoadTable::decode(load_read.as_ref().map(|(b, _)| b.as_slice()));
        drop(load_read);
        let (endpoints, metrics) = self.tables(store, load.epoch)?;
        if endpoints.is_empty() {
            return Ok(None);
        }
        let stale_after = self.config.collector.metrics_stale_after_ms;
        // Real tokens for a text prompt, once the servers taught us the
        // model's bytes per token.
        let bs = self.config.prefix.blocks.block_size_tokens.max(1);
        let (prompt_tokens, block_tokens) = match text_bytes
            .filter(|_| self.config.prefix.learn_bytes_per_token)
            .and_then(|b| {
                bytes_per_token::fleet_estimate(endpoints.iter().filter_map(|e| {
                    metrics
                        .get(e.slot, e.generation)
                        .filter(|m| m.is_fresh(now_ms, stale_after))
                        .and_then(|m| bytes_per_token::estimate(&m.bytes_per_token))
                }))
                .map(|bpt| (b, bpt))
            }) {
            Some((bytes, bpt)) => {
                let block_bytes =
                    f64::from(bs) * f64::from(self.config.prefix.blocks.chars_per_token.max(1));
                (
                    (bytes as f64 / bpt).ceil() as u64,
                    ((block_bytes / bpt).round() as u32).max(1),
                )
            }
            None => (prompt_tokens, bs),
        };

        let holders: Vec<Holder> = endpoints
            .iter()
            .map(|e| Holder {
                slot: e.slot,
                generation: e.generation,
                insert_counter: load
                    .get(e.slot, e.generation)
                    .map_or(0, |r| r.insert_counter),
                capacity_blocks: self
                    .capacity_blocks_in(metrics.get(e.slot, e.generation), block_tokens),
            })
            .collect();
        let matches = index::longest_prefixes(store, &self.geometry, hashes, &holders)?;

        let candidates: Vec<Candidate> = endpoints
            .iter()
            .zip(&matches.matched_blocks)
            .zip(&holders)
            .map(|((e, &matched), h)| {
                let rec = load.get(e.slot, e.generation);
                let m = metrics
                    .get(e.slot, e.generation)
                    .filter(|m| m.is_fresh(now_ms, stale_after));
                Candidate {
                    matched_blocks: matched,
                    unresolved_blocks: index::unresolved_after(matched, hashes.len()),
                    inflight_tokens: rec.map_or(0, |r| r.inflight_tokens()),
                    inflight_requests: rec.map_or(0, |r| r.inflight_requests()),
                    inflight_prefill_tokens: rec.map_or(0, |r| r.inflight_prompt_tokens()),
                    inflight_held_tokens: rec.map_or(0, |r| r.inflight_output_tokens()),
                    inserted_blocks: h.insert_counter,
                    capacity_blocks: h.capacity_blocks,
                    metrics: m.map(|m| EndpointMetrics {
                        waiting_requests: m.waiting,
                        running_requests: m.running,
                        kv_cache_usage: m.kv_cache_usage,
                        kv_capacity_tokens: m.capacity_tokens().unwrap_or(0),
                    }),
                    last_cold_pick: rec.map(|r| r.last_cold_pick).filter(|t| *t != 0),
                    prefill_tokens_per_s: m.and_then(|m| m.prefill.estimate()),
                    key: endpoint_key(&e.address),
                }
            })
            .collect();
        // The model's mean output per request, once the servers taught it
        // (looked up only when the charge will use it).
        let inflight = &self.config.scheduler.inflight;
        let learnt_output_tokens =
            if inflight.learn_output_tokens && inflight.add_estimated_output_tokens {
                output_tokens::fleet_estimate(endpoints.iter().filter_map(|e| {
                    metrics
                        .get(e.slot, e.generation)
                        .filter(|m| m.is_fresh(now_ms, stale_after))
                        .and_then(|m| output_tokens::estimate(&m.output_tokens))
                }))
                .map(|n| n.round() as u64)
            } else {
                None
            };
        let view = RequestView {
            prompt_tokens,
            total_blocks: hashes.len() as u32,
            block_size_tokens: block_tokens,
            max_output_tokens,
            learnt_output_tokens,
            tie_key: tie_key(hashes, &candidates),
        };
        Ok(Some(Snapshot {
            endpoints,
            holders,
            first_recorded: matches.first_recorded,
            shards: matches.shards,
            candidates,
            view,
            load: load_cas.map(|cas| (load, cas)),
        }))
    }

    /// The part of [`route`](Self::route) after parsing (also used by the
    /// simulator, which builds prompts directly).
    pub fn route_parsed(
        &self,
        store: &dyn Store,
        hashes: &[u64],
        prompt_tokens: u64,
        max_output_tokens: Option<u64>,
        now_ms: u64,
        rng: &mut Rng,
    ) -> Result<Option<Routed>, StoreError> {
        self.route_parsed_precise(
            store,
            hashes,
            prompt_tokens,
            None,
            max_output_tokens,
            Work::ONE,
            None,
            now_ms,
            rng,
        )
    }

    /// The precise view of a request: when every healthy endpoint's
    /// held-blocks view is fresh, the candidates' matches are the leading
    /// vLLM hashes each holds, and the request is measured in vLLM blocks
    /// and its exact token count. Otherwise `None`: the approximate index
    /// decides (one stale relay would make its endpoint look cold).
    fn held_candidates(
        &self,
        store: &dyn Store,
        snap: &Snapshot,
        vllm_hashes: &[u64],
        prompt_tokens: u64,
        now_ms: u64,
    ) -> Result<Option<(Vec<Candidate>, RequestView)>, StoreError> {
        let Some(p) = &self.config.precise else {
            return Ok(None);
        };
        let m = self.held_prefixes(store, &snap.endpoints, vllm_hashes, now_ms)?;
        if !m.iter().all(|x| x.fresh) {
            return Ok(None);
        }
        let candidates: Vec<Candidate> = snap
            .candidates
            .iter()
            .zip(&m)
            .map(|(c, x)| Candidate {
                matched_blocks: x.matched_blocks,
                // vLLM's hashes are looked up block by block.
                unresolved_blocks: 0,
                ..*c
            })
            .collect();
        // The tie key from vLLM's hashes and the held matches: gateway
        // replicas with the same held view break ties alike.
        let view = RequestView {
            prompt_tokens,
            total_blocks: vllm_hashes.len().min(u32::MAX as usize) as u32,
            block_size_tokens: p.block_size,
            max_output_tokens: snap.view.max_output_tokens,
            learnt_output_tokens: snap.view.learnt_output_tokens,
            tie_key: tie_key(vllm_hashes, &candidates),
        };
        Ok(Some((candidates, view)))
    }

    /// [`route_parsed`](Self::route_parsed) with precise mode's input:
    /// the request's vLLM hashes and exact token count, if it has them, and
    /// a text prompt's `text_bytes` (counted on the endpoint for the
    /// bytes-per-token learner, and scaled with it; see
    /// [`snapshot_of`](Self::snapshot_of)).
    /// The approximate index is kept up to date either way (it is the
    /// fallback), from `hashes`.
    #[allow(clippy::too_many_arguments)]
    pub fn route_parsed_precise(
        &self,
        store: &dyn Store,
        hashes: &[u64],
        prompt_tokens: u64,
        precise: Option<(&[u64], u64)>,
        max_output_tokens: Option<u64>,
        work: Work,
        text_bytes: Option<u64>,
        now_ms: u64,
        rng: &mut Rng,
    ) -> Result<Option<Routed>, StoreError> {
        let Some(snap) = self.snapshot_of(
            store,
            hashes,
            prompt_tokens,
            max_output_tokens,
            text_bytes,
            now_ms,
        )?
        else {
            return Ok(None);
        };
        let held = match precise {
            Some((vllm_hashes, tokens)) => {
                self.held_candidates(store, &snap, vllm_hashes, tokens, now_ms)?
            }
            None => None,
        };
        let precise_use = precise.map(|(vllm_hashes, _)| {
            let blocks = vllm_hashes.len().min(u32::MAX as usize) as u32;
            if held.is_some() {
                PreciseUse::Matched { blocks }
            } else {
                PreciseUse::Fallback {
                    why: Fallback::NoHeldView,
                    blocks,
                }
            }
        });
        let Snapshot {
            endpoints,
            holders,
            first_recorded,
            shards,
            candidates,
            view,
            load,
        } = snap;
        // Scheduling (and the charge) on the held view when there is one;
        // the approximate index's bookkeeping below stays on its own blocks.
        let (sched_candidates, sched_view) = match &held {
            Some((c, v)) => (c, v),
            None => (&candidates, &view),
        };
        let Some(decision) = self
            .config
            .scheduler
            .schedule(sched_view, sched_candidates, rng)
        else {
            return Ok(None);
        };
        let chosen = &endpoints[decision.primary];
        let charge = self.config.scheduler.inflight.charge_work(
            sched_view,
            &sched_candidates[decision.primary],
            work,
        );
        let cand = &candidates[decision.primary];
        // A server evicts at most its whole cache for one prompt: a prompt
        // longer than that ages the endpoint's entries by its capacity.
        let capacity = holders[decision.primary].capacity_blocks;
        let new_blocks = u64::from(view.total_blocks.saturating_sub(cand.matched_blocks));
        let new_blocks = if capacity == 0 {
            new_blocks
        } else {
            new_blocks.min(capacity)
        };
        let cold_stamp = if decision.cold { now_ms.max(1) } else { 0 };
        let window = window_ms(self.config.collector.reap_after_ms);

        // The charge must land: retry lost CAS races (bounded in `update`).
        // The first try is on the table the snapshot read.
        let charged = update_seeded(
            store,
            LOAD_KEY,
            load,
            LoadTable::decode,
            LoadTable::encode,
            |t: &mut LoadTable| {
                let prev_cold_pick = t.last_cold_pick(chosen.slot, chosen.generation);
                let charged = t.charge(
                    chosen.slot,
                    chosen.generation,
                    now_ms,
                    window,
                    charge.prompt_tokens,
                    charge.output_tokens,
                    new_blocks,
                    cold_stamp,
                );
                if let (Some(_), Some(b)) = (&charged, text_bytes) {
                    t.add_routed_bytes(chosen.slot, chosen.generation, b);
                }
                charged.map(|(ticket, counter)| (ticket, counter, prev_cold_pick))
            },
        );
        let charged = charged?;
        let mut cas_retries = charged.retries;
        let (ticket, counter_after, prev_cold_pick) = charged
            .result
            .map_or((None, 0, 0), |(t, c, p)| (Some(t), c, p));
        let mut provisional = ticket.map(|_| Provisional {
            undo: Undo {
                slot: chosen.slot,
                generation: chosen.generation,
                new_blocks,
                routed_bytes: text_bytes.unwrap_or(0),
                cold_stamp,
                prev_cold_pick,
            },
            hashes: Vec::new(),
            from_block: None,
            recorded: counter_after as u32,
        });

        // Record the blocks for the chosen endpoint (advisory: a failure
        // only costs future affinity).
        if ticket.is_some() && !hashes.is_empty() {
            let me = Holder {
                slot: chosen.slot,
                generation: chosen.generation,
                insert_counter: counter_after,
                capacity_blocks: holders[decision.primary].capacity_blocks,
            };
            // Judge the chosen endpoint's entries by its counter *after*
            // this charge: this request's own entries are recorded with it,
            // and the pre-charge counter would see them as already evicted.
            let is_live = |slot: u16, generation: u16, recorded: u32| {
                if slot == me.slot {
                    return me.holds(slot, generation, recorded);
                }
                holders
                    .iter()
                    .find(|h| h.slot == slot)
                    .is_some_and(|h| h.holds(slot, generation, recorded))
            };
            // Whole groups the endpoint already holds are not rewritten
            // unless they are due for an LRU refresh.
            let skip = index::insert_skip(
                &me,
                cand.matched_blocks,
                hashes.len(),
                first_recorded[decision.primary],
            );
            if let Ok(st) =
                index::insert_seeded(store, &self.geometry, hashes, skip, &me, &is_live, shards)
            {
                cas_retries += st.cas_retries;
            }
            if let Some(p) = provisional.as_mut() {
                // Kept whether or not the insert went through: a partial
                // insert's entries are cleared all the same.
                p.from_block = Some(cand.matched_blocks as usize);
            }
        }

        let mut destination = chosen.address.clone();
        for &f in &decision.fallbacks {
            destination.push(',');
            destination.push_str(&endpoints[f].address);
        }
        Ok(Some(Routed {
            destination,
            ticket,
            decision,
            uncached_tokens: charge.prompt_tokens,
            stream: false,
            cas_retries,
            precise: precise_use,
            provisional,
        }))
    }

    /// Moves a request's charge to the endpoint that actually served it:
    /// Envoy retried it (connect failure, refused stream, reset before the
    /// request) to the next address of the destination header. One
    /// load-table write releases the charge on the routed endpoint, undoes
    /// what the decision wrote there ([`Provisional`]: that server never
    /// saw the request) and charges the same tokens to `to`; then the
    /// routed endpoint's new index entries are cleared. Nothing is
    /// recorded for `to` in the index: its blocks reach the index with
    /// that prompt's next request. Returns the new ticket (`None` when
    /// `to` is not a known healthy endpoint: the charge is only released)
    /// and the CAS races lost.
    pub fn move_charge(
        &self,
        store: &dyn Store,
        ticket: &Ticket,
        provisional: Option<&Provisional>,
        to: &str,
        now_ms: u64,
    ) -> Result<(Option<Ticket>, u32), StoreError> {
        let table = self.endpoint_table(store)?;
        let target = table
            .endpoints
            .iter()
            .find(|e| e.healthy && e.address == to)
            .map(|e| (e.slot, e.generation));
        let window = window_ms(self.config.collector.reap_after_ms);
        let updated = update(
            store,
            LOAD_KEY,
            LoadTable::decode,
            LoadTable::encode,
            |t: &mut LoadTable| {
                t.release_rest(ticket, false);
                if let Some(p) = provisional {
                    t.undo(&p.undo);
                }
                Some(target.and_then(|(slot, generation)| {
                    t.charge(
                        slot,
                        generation,
                        now_ms,
                        window,
                        ticket.prompt_tokens,
                        ticket.output_tokens,
                        0,
                        0,
                    )
                    .map(|(t, _)| t)
                }))
            },
        )?;
        let mut retries = updated.retries;
        if let Some(p) = provisional {
            retries += self.remove_entries(store, p)?;
        }
        Ok((updated.result.flatten(), retries))
    }

    /// Clears a provisional record's index entries; returns the CAS races
    /// lost.
    fn remove_entries(&self, store: &dyn Store, p: &Provisional) -> Result<u32, StoreError> {
        let Some(from) = p.from_block else {
            return Ok(0);
        };
        let me = Holder {
            slot: p.undo.slot,
            generation: p.undo.generation,
            insert_counter: 0,
            capacity_blocks: 0,
        };
        let (_, r) = index::remove(store, &self.geometry, &p.hashes, from, &me, p.recorded)?;
        Ok(r)
    }

    /// Takes back a request the server rejected (a non-2xx answer, or a
    /// reset before any response byte): releases what its charge still
    /// holds and undoes the rest of what its decision wrote
    /// ([`Provisional`]), in the same load-table write; then clears its
    /// index entries. Returns the CAS races lost.
    pub fn take_back(
        &self,
        store: &dyn Store,
        ticket: &Ticket,
        p: &Provisional,
        prompt_released: bool,
    ) -> Result<u32, StoreError> {
        let mut retries = update(
            store,
            LOAD_KEY,
            LoadTable::decode,
            LoadTable::encode,
            |t: &mut LoadTable| {
                t.release_rest(ticket, prompt_released);
                t.undo(&p.undo);
                Some(())
            },
        )?
        .retries;
        retries += self.remove_entries(store, p)?;
        Ok(retries)
    }

    /// Releases the prompt part of a charge (first response byte).
    /// Returns the CAS races the write lost before it went through.
    pub fn release_prompt(&self, store: &dyn Store, ticket: &Ticket) -> Result<u32, StoreError> {
        release(store, ticket, None)
    }

    /// Releases the rest of a charge (end of stream, reset, abort…).
    pub fn release_rest(
        &self,
        store: &dyn Store,
        ticket: &Ticket,
        prompt_released: bool,
    ) -> Result<u32, StoreError> {
        release(store, ticket, Some(prompt_released))
    }

    // -----------------------------------------------------------------------
    // Collector side.

    /// Writes the initial state before traffic: the static endpoint list,
    /// empty load and metrics tables and every (empty) index shard, if they
    /// do not exist yet, so workers always CAS against an existing value.
    pub fn collector_init(&self, store: &dyn Store) -> Result<(), StoreError> {
        if let EndpointSource::Static(list) = &self.config.endpoints {
            self.apply_membership(store, list.iter().map(|a| (a.to_string(), true)).collect())?;
        }
        self.ensure_tables(store)?;
        // Create every index shard up front, before traffic: a worker that
        // finds a shard missing must write it unconditionally, which could
        // drop another worker's first insert. The index never holds more
        // than its budget, so this only spends it early.
        let empty = vec![0u8; index::SHARD_BYTES];
        for n in 0..self.geometry.shards {
            let key = index::shard_key_of(n);
            if store.get(&key)?.is_none() {
                store.set(&key, &empty, 0)?;
            }
        }
        Ok(())
    }

    /// Creates the load and metrics tables if they do not exist yet. The
    /// collector and every worker's root call this when configured, before
    /// traffic: Envoy applies a first write of a missing key
    /// unconditionally, so a key created while another worker is already
    /// charging could drop that charge.
    pub fn ensure_tables(&self, store: &dyn Store) -> Result<(), StoreError> {
        if store.get(LOAD_KEY)?.is_none() {
            store.set(LOAD_KEY, &LoadTable::default().encode(), 0)?;
        }
        if store.get(METRICS_KEY)?.is_none() {
            store.set(METRICS_KEY, &MetricsTable::default().encode(), 0)?;
        }
        Ok(())
    }

    /// Makes the endpoint table list exactly `members`. Returns true if it changed.
    pub fn apply_membership(
        &self,
        store: &dyn Store,
        members: Vec<(String, bool)>,
    ) -> Result<bool, StoreError> {
        let u = update(
            store,
            ENDPOINTS_KEY,
            |b| b.and_then(EndpointTable::decode).unwrap_or_default(),
            EndpointTable::encode,
            |t: &mut EndpointTable| t.apply_membership(members.clone()).then_some(()),
        )?;
        let changed = u.result.is_some();
        if changed {
            self.bump_epoch(store)?;
        }
        Ok(changed)
    }

    /// Applies an admin `/clusters?format=json` body.
    pub fn apply_admin_clusters(&self, store: &dyn Store, body: &[u8]) -> Result<bool, String> {
        let EndpointSource::FromCluster { cluster, .. } = &self.config.endpoints else {
            return Ok(false);
        };
        let members = envoy_clusters::cluster_members(body, cluster).map_err(|e| e.to_string())?;
        self.apply_membership(store, members)
            .map_err(|e| e.to_string())
    }

    /// Records one `/metrics` poll of (`slot`, `generation`): `Ok(body)` or a
    /// failure (timeout, non-200). Garbage keeps the old values, marked as a
    /// failure. Returns the parse error, if any.
    pub fn record_metrics(
        &self,
        store: &dyn Store,
        slot: u16,
        generation: u16,
        result: Result<&[u8], ()>,
        now_ms: u64,
    ) -> Result<Option<String>, StoreError> {
        let parsed = result.map(vllm_metrics::parse);
        let prefill = self.prefill_rate_params();
        // The text bytes routed to this endpoint so far, for the
        // bytes-per-token learner (read only when the server counts tokens).
        let routed_bytes = match &parsed {
            Ok(Ok(v)) if v.prompt_tokens.is_some() => {
                LoadTable::decode(store.get(LOAD_KEY)?.as_ref().map(|(b, _)| b.as_slice()))
                    .get(slot, generation)
                    .map_or(0, |r| r.routed_prompt_bytes)
            }
            _ => 0,
        };
        let mut problem = None;
        update(
            store,
            METRICS_KEY,
            MetricsTable::decode,
            MetricsTable::encode,
            |t: &mut MetricsTable| {
                let m = t.entry(slot, generation)?;
                m.attempted_at_ms = now_ms;
                match &parsed {
                    Ok(Ok(v)) => {
                        m.ok_at_ms = now_ms.max(1);
                        m.failures = 0;
                        m.waiting = v.waiting;
                        m.running = v.running;
                        m.kv_cache_usage = v.kv_cache_usage;
                        m.block_size = v.block_size.unwrap_or(m.block_size);
                        m.num_gpu_blocks = v.num_gpu_blocks.unwrap_or(m.num_gpu_blocks);
                        m.prefix_queries = v.prefix_queries;
                        m.prefix_hits = v.prefix_hits;
                        prefill_rate::observe(&mut m.prefill, v.prefill, now_ms, &prefill);
                        if let Some(tokens) = v.prompt_tokens {
                            bytes_per_token::observe(&mut m.bytes_per_token, tokens, routed_bytes);
                        }
                        if let Some(g) = v.generation {
                            output_tokens::observe(&mut m.output_tokens, g.tokens, g.requests);
                        }
                    }
                    Ok(Err(e)) => {
                        m.failures = m.failures.saturating_add(1);
                        problem = Some(e.to_string());
                    }
                    Err(()) => m.failures = m.failures.saturating_add(1),
                }
                Some(())
            },
        )?;
        self.bump_epoch(store)?;
        Ok(problem)
    }

    /// The online prefill-rate estimator's knobs: the affinity filter's
    /// `"auto"` settings, or defaults around its fixed value (the estimate is
    /// kept and shown either way; the gate uses it only with `"auto"`).
    pub fn prefill_rate_params(&self) -> PrefillRateParams {
        let f = self.config.scheduler.filters.first();
        match f.and_then(|f| f.prefill_auto) {
            Some(p) => p,
            None => PrefillRateParams::around(
                f.map(|f| f.peak_prefill_throughput)
                    .filter(|&r| r > 0.0)
                    .unwrap_or(15_928.0),
            ),
        }
    }

    /// Reaps charges older than `collector.reapAfterMs`. Returns the requests reaped.
    pub fn reap(&self, store: &dyn Store, now_ms: u64) -> Result<u64, StoreError> {
        let reap_after = self.config.collector.reap_after_ms;
        let u = update(
            store,
            LOAD_KEY,
            LoadTable::decode,
            LoadTable::encode,
            |t: &mut LoadTable| t.reap(now_ms, reap_after),
        )?;
        Ok(u.result.unwrap_or(0))
    }

    /// The shared state as JSON, for `routing.statePath`.
    pub fn state_json(&self, store: &dyn Store, now_ms: u64) -> Result<String, StoreError> {
        let table = self.endpoint_table(store)?;
        let load = LoadTable::decode(store.get(LOAD_KEY)?.as_ref().map(|(b, _)| b.as_slice()));
        let metrics =
            MetricsTable::decode(store.get(METRICS_KEY)?.as_ref().map(|(b, _)| b.as_slice()));
        let stale_after = self.config.collector.metrics_stale_after_ms;
        let held = self.held_state(store)?;
        let eps: Vec<serde_json::Value> = table
            .endpoints
            .iter()
            .map(|e| {
                let rec = load.get(e.slot, e.generation);
                let m = metrics.get(e.slot, e.generation);
                // What the affinity filter's TTFT estimate divides by now.
                let gate_rate = self.config.scheduler.filters.first().map(|f| {
                    f.prefill_tokens_per_s(&Candidate {
                        prefill_tokens_per_s: m
                            .filter(|m| m.is_fresh(now_ms, stale_after))
                            .and_then(|m| m.prefill.estimate()),
                        ..Default::default()
                    })
                });
                let kv_events = held
                    .as_ref()
                    .map(|h| h.endpoint_json(self, store, e, now_ms));
                serde_json::json!({
                    "address": e.address,
                    "slot": e.slot,
                    "generation": e.generation,
                    "healthy": e.healthy,
                    "inflightRequests": rec.map_or(0, |r| r.inflight_requests()),
                    "inflightTokens": rec.map_or(0, |r| r.inflight_tokens()),
                    "insertCounter": rec.map_or(0, |r| r.insert_counter),
                    "reapedRequests": rec.map_or(0, |r| r.reaped_requests),
                    "capacityBlocks": self.capacity_blocks(m),
                    "gatePrefillTokensPerS": gate_rate,
                    "routedPromptBytes": rec.map_or(0, |r| r.routed_prompt_bytes),
                    "bytesPerToken": m.and_then(|m| bytes_per_token::estimate(&m.bytes_per_token)),
                    "outputTokensPerRequest": m.and_then(|m| output_tokens::estimate(&m.output_tokens)),
                    "metrics": m.filter(|m| m.ok_at_ms != 0).map(|m| serde_json::json!({
                        "waiting": m.waiting,
                        "running": m.running,
                        "kvCacheUsage": m.kv_cache_usage,
                        "blockSize": m.block_size,
                        "numGpuBlocks": m.num_gpu_blocks,
                        "prefixCacheQueries": m.prefix_queries,
                        "prefixCacheHits": m.prefix_hits,
                        "prefillTokensPerS": m.prefill.estimate(),
                        "prefillSamples": m.prefill.samples,
                        "prefillUpdatedAgeMs": (m.prefill.updated_at_ms != 0)
                            .then(|| now_ms.saturating_sub(m.prefill.updated_at_ms)),
                        "ageMs": now_ms.saturating_sub(m.ok_at_ms),
                        "fresh": m.is_fresh(now_ms, stale_after),
                        "failures": m.failures,
                    })),
                    "kvEvents": kv_events,
                })
            })
            .collect();
        let index_bytes = self.geometry.max_bytes();
        let held_geo = self.held_geometry();
        Ok(serde_json::json!({
            "endpointTableVersion": table.version,
            "endpoints": eps,
            "index": {"shards": self.geometry.shards, "maxBytes": index_bytes},
            "kvEvents": self.config.kv_events.enabled.then(|| serde_json::json!({
                "maxHeldBlocks": held_geo.max_blocks,
                "shardsPerEndpoint": held_geo.shards,
                "maxBytesPerEndpoint": held_geo.max_bytes_per_endpoint(),
            })),
        })
        .to_string())
    }
}

/// `branch=sticky;endpoint=ip:port;affinity=0.95;ttft_ms=12.3;uncached_tokens=123;candidates=4;passed=1`
fn explain(d: &Decision, primary_address: &str, uncached: u64) -> String {
    let r = &d.report[d.primary];
    let mut s = String::with_capacity(160);
    let _ = write!(
        s,
        "branch={};endpoint={};affinity={:.3};ttft_ms={:.1};uncached_tokens={};candidates={};passed={}",
        d.branch.as_str(),
        primary_address,
        r.affinity,
        r.ttft_ms,
        uncached,
        d.report.len(),
        d.report.iter().filter(|c| c.passed_filter).count(),
    );
    let best_other = d
        .report
        .iter()
        .enumerate()
        .filter(|(i, _)| *i != d.primary)
        .map(|(_, c)| c.ttft_ms)
        .fold(f64::INFINITY, f64::min);
    if best_other.is_finite() {
        let _ = write!(s, ";best_other_ttft_ms={best_other:.1}");
    }
    s
}

#[cfg(test)]
mod tests;

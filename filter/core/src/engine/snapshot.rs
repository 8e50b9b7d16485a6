//! The scheduler's input for one request, read from shared state
//! ([`Engine::snapshot`]): the healthy endpoints, their longest held
//! prefix in the approximate index, their in-flight load and fresh
//! metrics; and precise mode's view of the blocks the servers hold
//! ([`Engine::held_prefixes`]).

use super::models::{self, Eligible};
use super::{Engine, RequestFacts};
use crate::learners::{bytes_per_token, output_tokens};
use crate::scheduling::{Candidate, EndpointMetrics, RequestView};
use kvroute_shared_state::endpoints::EndpointEntry;
use kvroute_shared_state::held::{self, HeldMatch, HeldTable};
use kvroute_shared_state::index::{self, Holder};
use kvroute_shared_state::load::{LoadRecord, LoadTable, PeerLoad};
use kvroute_shared_state::metrics::MetricsSnapshot;
use kvroute_shared_state::{Store, StoreError, LOAD_KEY};
use std::sync::Arc;

/// A candidate's rendezvous key: its `ip:port` hashed, so that every gateway
/// replica gives an endpoint the same key whatever slot it has there.
pub fn endpoint_key(address: &str) -> u64 {
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

/// An endpoint's load and metrics as the scheduler and flow control's
/// detector see them: this proxy's in-flight counts plus the mesh peers'
/// (saturating: a relay's sums are not to be trusted), and its fresh
/// metrics. The request-specific fields are left at their defaults.
pub(super) fn load_candidate(
    rec: Option<&LoadRecord>,
    peer: PeerLoad,
    m: Option<&MetricsSnapshot>,
) -> Candidate {
    Candidate {
        inflight_tokens: rec
            .map_or(0, |r| r.inflight_tokens())
            .saturating_add(peer.prompt_tokens)
            .saturating_add(peer.output_tokens),
        inflight_requests: rec
            .map_or(0, |r| r.inflight_requests())
            .saturating_add(u64::from(peer.requests)),
        inflight_prefill_tokens: rec
            .map_or(0, |r| r.inflight_prompt_tokens())
            .saturating_add(peer.prompt_tokens),
        inflight_held_tokens: rec
            .map_or(0, |r| r.inflight_output_tokens())
            .saturating_add(peer.output_tokens),
        metrics: m.map(|m| EndpointMetrics {
            waiting_requests: m.waiting,
            running_requests: m.running,
            kv_cache_usage: m.kv_cache_usage,
            kv_capacity_tokens: m.capacity_tokens().unwrap_or(0),
        }),
        prefill_tokens_per_s: m.and_then(|m| m.prefill.estimate()),
        ..Candidate::default()
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
    /// The model filter's verdict on the body's `model`
    /// (`engine/models.rs`); with [`ModelFit::Unknown`] there are no
    /// endpoints or candidates.
    pub model: ModelFit,
}

/// How the pool stands towards a request's `model`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ModelFit {
    /// Served as a base model, or not known to be otherwise.
    Served,
    /// A LoRA adapter on the endpoints that serve it: the path they all
    /// load it from (precise mode hashes with `(model, path)`), or why
    /// there is no one path (`engine/models.rs`, "LoRA and precise mode").
    Adapter(Result<String, crate::precise::Fallback>),
    /// No endpoint serves it.
    Unknown,
}

impl Engine {
    /// The scheduler's input for a request, read from shared state: the
    /// healthy endpoints, their index holders, their candidates (longest
    /// held prefix, in-flight load, fresh metrics) and the request view.
    /// `None` when no healthy endpoint is known. With `charsPerToken:
    /// "auto"` and a learnt bytes-per-token figure, a text prompt's tokens
    /// (`facts.text_bytes`), its block size in tokens and the endpoints'
    /// capacity in index blocks are in the servers' real tokens
    /// (`learners::bytes_per_token`).
    pub fn snapshot(
        &self,
        store: &dyn Store,
        facts: &RequestFacts,
        now_ms: u64,
    ) -> Result<Option<Snapshot>, StoreError> {
        let load_read = store.get(LOAD_KEY)?;
        let load_cas = load_read.as_ref().map(|(_, cas)| *cas);
        let load = LoadTable::decode(load_read.as_ref().map(|(b, _)| b.as_slice()));
        drop(load_read);
        let (endpoints, metrics, models_table) = self.tables_with_models(store, load.epoch)?;
        if endpoints.is_empty() {
            return Ok(None);
        }
        // The model filter (`engine/models.rs`): only endpoints that may
        // serve the body's `model` are candidates.
        let endpoints = match models::eligible(&models_table, &endpoints, &facts.model) {
            Eligible::All => endpoints,
            Eligible::Some(keep) => models::pick(&endpoints, &keep),
            Eligible::None => {
                return Ok(Some(Snapshot {
                    endpoints: Arc::new(Vec::new()),
                    holders: Vec::new(),
                    first_recorded: Vec::new(),
                    shards: Default::default(),
                    candidates: Vec::new(),
                    view: RequestView::default(),
                    load: None,
                    model: ModelFit::Unknown,
                }))
            }
        };
        let model = match models::adapter_key(&models_table, &endpoints, &facts.model) {
            Some(key) => ModelFit::Adapter(key),
            None => ModelFit::Served,
        };
        let stale_after = self.config.collector.metrics_stale_after_ms;
        // Real tokens for a text prompt, once the servers taught us the
        // model's bytes per token.
        let bs = self.config.prefix.blocks.block_size_tokens.max(1);
        let (prompt_tokens, block_tokens) = match facts
            .text_bytes
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
            None => (facts.prompt_tokens, bs),
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
        let hashes = facts.hashes.as_slice();
        let matches = index::longest_prefixes(store, &self.geometry, hashes, &holders)?;

        let peer_ttl = if self.config.mesh.enabled {
            self.peer_ttl_ms()
        } else {
            0
        };
        let candidates: Vec<Candidate> = endpoints
            .iter()
            .zip(&matches.matched_blocks)
            .zip(&holders)
            .map(|((e, &matched), h)| {
                let rec = load.get(e.slot, e.generation);
                let m = metrics
                    .get(e.slot, e.generation)
                    .filter(|m| m.is_fresh(now_ms, stale_after));
                // The other proxies' load (mesh), while recent.
                let peer = rec
                    .map(|r| r.peer)
                    .filter(|p| peer_ttl > 0 && p.is_fresh(now_ms, peer_ttl))
                    .unwrap_or_default();
                Candidate {
                    matched_blocks: matched,
                    unresolved_blocks: index::unresolved_after(matched, hashes.len()),
                    inserted_blocks: h.insert_counter,
                    capacity_blocks: h.capacity_blocks,
                    last_cold_pick: rec.map(|r| r.last_cold_pick).filter(|t| *t != 0),
                    key: endpoint_key(&e.address),
                    lora: models::lora_slots(models_table.get(e.slot, e.generation), &facts.model),
                    ..load_candidate(rec, peer, m)
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
            max_output_tokens: facts.max_output_tokens,
            learnt_output_tokens,
            // A mesh proxy's own salt: proxies that see the same empty
            // fleet at once (a burst of new sessions sharing a system
            // prompt) break ties differently, as one proxy's charges would.
            tie_key: tie_key(hashes, &candidates).map(|k| k ^ self.config.mesh.tie_salt),
        };
        Ok(Some(Snapshot {
            endpoints,
            holders,
            first_recorded: matches.first_recorded,
            shards: matches.shards,
            candidates,
            view,
            load: load_cas.map(|cas| (load, cas)),
            model,
        }))
    }

    /// The precise view of a request: when every healthy endpoint's
    /// held-blocks view is fresh, the candidates' matches are the leading
    /// vLLM hashes each holds, and the request is measured in vLLM blocks
    /// and its exact token count. Otherwise `None`: the approximate index
    /// decides (one stale relay would make its endpoint look cold).
    pub(super) fn held_candidates(
        &self,
        store: &dyn Store,
        snap: &Snapshot,
        vllm_hashes: &[u64],
        prompt_tokens: u64,
        unknown_blocks: u32,
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
            // A stored prefix and new text after it: the prompt's blocks
            // are the prefix's and the new text's estimate.
            total_blocks: (vllm_hashes.len().min(u32::MAX as usize) as u32)
                .saturating_add(unknown_blocks),
            block_size_tokens: p.block_size,
            max_output_tokens: snap.view.max_output_tokens,
            learnt_output_tokens: snap.view.learnt_output_tokens,
            tie_key: tie_key(vllm_hashes, &candidates).map(|k| k ^ self.config.mesh.tie_salt),
        };
        Ok(Some((candidates, view)))
    }

    /// The request path's view of the held sets (`kvEvents`): for each of
    /// `endpoints` (e.g. [`Snapshot::endpoints`]), the
    /// leading hashes of `hashes` (vLLM block hashes, block 0 first) it
    /// holds and whether its view is fresh (`kvEvents.staleMs`). With
    /// `kvEvents` off, every endpoint is not fresh and nothing is read.
    /// One read of `kvroute/held`, then [`kvroute_shared_state::held::longest_held`].
    pub fn held_prefixes(
        &self,
        store: &dyn Store,
        endpoints: &[EndpointEntry],
        hashes: &[u64],
        now_ms: u64,
    ) -> Result<Vec<HeldMatch>, StoreError> {
        let kv = &self.config.kv_events;
        if !kv.enabled {
            return Ok(vec![Default::default(); endpoints.len()]);
        }
        let status = HeldTable::read(store)?;
        let ids: Vec<(u16, u16)> = endpoints.iter().map(|e| (e.slot, e.generation)).collect();
        held::longest_held(
            store,
            &self.held_geometry(),
            &status,
            &ids,
            hashes,
            now_ms,
            kv.stale_ms,
        )
    }
}

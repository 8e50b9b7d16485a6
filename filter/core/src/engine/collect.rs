//! The collector's writes: the endpoint table (membership from Envoy's
//! admin `/clusters`, or the static list), one `/metrics` poll of an
//! endpoint with its learners (`crate::learners`), the relay's KV events
//! applied to the endpoint's held set, and reaping. The collector
//! (`lifecycle::Collector`) fetches the bytes; `crate::reports` parses
//! them; this file writes what they say.
//!
//! # Relay answers
//!
//! Applied to the endpoint's held-block set in shared data
//! (`kvroute_shared_state::held`); `reports::relay::next_ask` says which
//! call to make:
//!
//! - a `/kv/snapshot` answer replaces the set, and the position becomes
//!   the snapshot's `epoch` and `seq`;
//! - a `/kv/events` answer's batches are applied in order (`stored`,
//!   `removed`, `cleared`), and the position moves to the answer's `seq`;
//!   `more: true` asks again at once.
//!
//! A `resync` answer, or an answer from another relay epoch (the relay
//! restarted), empties the set and asks for the snapshot. A body that does
//! not parse is a failed poll (counted; the set and position are kept).
//!
//! The approximate index, corrected: events carry vLLM's token hashes,
//! which the byte-based index cannot match block by block. What events do
//! tell it is when a server lost its cache: on `cleared`
//! (`AllBlocksCleared`), or when a snapshot loaded after a resync keeps
//! fewer than half of the hashes the set held before (a server restart: its
//! relay sees vLLM's seq go back and starts over; a new relay epoch with a
//! near-empty snapshot). Then every index entry for that endpoint is aged
//! out at once, by advancing its eviction clock by its capacity
//! ([`LoadTable::advance_insert_counter`]). With no capacity known
//! (`lruCapacityPerServer: 0` and no `vllm:cache_config_info`) entries do
//! not age, and nothing is corrected.

use super::Engine;
use crate::config::EndpointSource;
use crate::learners::prefill_rate::{self, PrefillRateParams};
use crate::learners::{bytes_per_token, output_tokens};
use crate::reports::relay::{self, Ask, Op};
use crate::reports::{envoy_clusters, vllm_metrics};
use kvroute_shared_state::cas::update;
use kvroute_shared_state::endpoints::EndpointTable;
use kvroute_shared_state::held::{HeldGeometry, HeldTable, HeldWriter};
use kvroute_shared_state::index;
use kvroute_shared_state::load::LoadTable;
use kvroute_shared_state::metrics::MetricsTable;
use kvroute_shared_state::{Store, StoreError, ENDPOINTS_KEY, LOAD_KEY, METRICS_KEY};
use std::fmt;

/// What applying one relay answer did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Applied {
    /// Ask again at once: `Snapshot` after a resync, `Events` when the
    /// relay has more.
    pub follow_up: Option<Ask>,
    /// The relay could not serve from our position (or its epoch changed).
    pub resync: bool,
    /// A snapshot replaced the set.
    pub snapshot: bool,
    /// `cleared` ops applied.
    pub cleared: u32,
    pub stored: u64,
    pub removed: u64,
    /// Stores dropped at `maxHeldBlocks`.
    pub dropped: u64,
    /// The endpoint's approximate index entries were aged out.
    pub index_reset: bool,
    /// Blocks in the set afterwards.
    pub blocks: u32,
}

/// Why an answer was not applied.
#[derive(Debug)]
pub enum ApplyError {
    /// The body is not the relay's JSON (counted as a failed poll).
    Garbage(String),
    Store(StoreError),
}

impl fmt::Display for ApplyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ApplyError::Garbage(m) => write!(f, "relay answer is not valid: {m}"),
            ApplyError::Store(e) => write!(f, "{e}"),
        }
    }
}

impl From<StoreError> for ApplyError {
    fn from(e: StoreError) -> Self {
        ApplyError::Store(e)
    }
}

impl Engine {
    /// Tells workers that the endpoint or metrics table changed (the
    /// collector calls this after writing either).
    pub(super) fn bump_epoch(&self, store: &dyn Store) -> Result<(), StoreError> {
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
        if let Ok(Ok(v)) = &parsed {
            // The served model names and LoRA adapters (`engine/models.rs`);
            // the epoch bump below tells workers.
            self.record_metrics_models(store, slot, generation, v)?;
        }
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

    /// The held-set layout from `kvEvents.maxHeldBlocks`.
    pub fn held_geometry(&self) -> HeldGeometry {
        HeldGeometry::new(self.config.kv_events.max_held_blocks)
    }

    /// Records a relay call that failed (timeout, non-200, no relay address):
    /// the set and position are kept; only `failures` and the attempt time
    /// move, so the view goes stale after `kvEvents.staleMs`.
    pub fn record_relay_failure(
        &self,
        store: &dyn Store,
        slot: u16,
        generation: u16,
        now_ms: u64,
    ) -> Result<(), StoreError> {
        let status = HeldTable::read(store)?;
        let mut w = HeldWriter::open(&status, self.held_geometry(), slot, generation, now_ms);
        w.view.attempted_at_ms = now_ms;
        w.view.failures = w.view.failures.saturating_add(1);
        w.commit(store).map(|_| ())
    }

    /// Applies one relay answer (`ask` says which call it answers).
    pub fn apply_relay_answer(
        &self,
        store: &dyn Store,
        slot: u16,
        generation: u16,
        ask: Ask,
        body: &[u8],
        now_ms: u64,
    ) -> Result<Applied, ApplyError> {
        match ask {
            Ask::Events => self.apply_events(store, slot, generation, body, now_ms),
            Ask::Snapshot => self.apply_snapshot(store, slot, generation, body, now_ms),
        }
    }

    fn apply_events(
        &self,
        store: &dyn Store,
        slot: u16,
        generation: u16,
        body: &[u8],
        now_ms: u64,
    ) -> Result<Applied, ApplyError> {
        let a = relay::parse_events(body).map_err(ApplyError::Garbage)?;
        let status = HeldTable::read(store)?;
        let mut w = HeldWriter::open(&status, self.held_geometry(), slot, generation, now_ms);
        let mut out = Applied::default();
        w.view.attempted_at_ms = now_ms;
        w.view.failures = 0;
        w.view.ok_at_ms = now_ms.max(1);
        if a.resync || a.epoch != w.view.relay_epoch || w.view.relay_epoch == 0 {
            // Keep the set until the snapshot replaces it (it is compared
            // with the snapshot then); forget the position.
            w.view.relay_epoch = 0;
            w.view.relay_seq = 0;
            out.resync = true;
            out.follow_up = Some(Ask::Snapshot);
            out.blocks = w.view.blocks;
            w.commit(store)?;
            return Ok(out);
        }
        let dropped_before = w.view.dropped;
        let seq_before = w.view.relay_seq;
        for batch in &a.batches {
            for op in &batch.ops {
                match op {
                    Op::Stored { hashes } => {
                        for &h in hashes {
                            w.store(store, h)?;
                            out.stored += 1;
                        }
                    }
                    Op::Removed { hashes } => {
                        for &h in hashes {
                            w.remove(store, h)?;
                            out.removed += 1;
                        }
                    }
                    Op::Cleared => {
                        // The server holds nothing now: the set is complete.
                        let epoch = w.view.relay_epoch;
                        w.clear(now_ms);
                        w.view.relay_epoch = epoch;
                        w.view.complete = true;
                        out.cleared += 1;
                    }
                }
            }
        }
        w.view.relay_seq = a.seq;
        // Caught up, the set is the relay's snapshot: take its completeness
        // (unless this side dropped stores at the bound).
        if let (Some(complete), false) = (a.complete, a.more) {
            if a.last.is_none_or(|l| l == a.seq) {
                w.view.complete = complete && !w.view.lossy;
            }
        }
        out.dropped = w.view.dropped - dropped_before;
        out.blocks = w.view.blocks;
        // The next page at once, if this one moved the cursor (a relay that
        // says `more` without moving it is asked again on the next round,
        // not in a loop).
        if a.more && a.seq > seq_before {
            out.follow_up = Some(Ask::Events);
        }
        w.commit(store)?;
        if out.cleared > 0 {
            out.index_reset = self.age_out_index(store, slot, generation)?;
        }
        Ok(out)
    }

    fn apply_snapshot(
        &self,
        store: &dyn Store,
        slot: u16,
        generation: u16,
        body: &[u8],
        now_ms: u64,
    ) -> Result<Applied, ApplyError> {
        let a = relay::parse_snapshot(body).map_err(ApplyError::Garbage)?;
        let status = HeldTable::read(store)?;
        let geo = self.held_geometry();
        let mut w = HeldWriter::open(&status, geo, slot, generation, now_ms);
        let before = w.view.blocks;
        // How much of the old set the server still holds (read before the
        // clear; only when there was an old set).
        let mut kept = 0u32;
        if before > 0 {
            for &h in &a.blocks {
                kept += u32::from(w.contains(store, h)?);
            }
        }
        w.clear(now_ms);
        let mut out = Applied {
            snapshot: true,
            ..Default::default()
        };
        let dropped_before = w.view.dropped;
        for &h in &a.blocks {
            w.store(store, h)?;
            out.stored += 1;
        }
        out.dropped = w.view.dropped - dropped_before;
        w.view.relay_epoch = a.epoch.max(1);
        w.view.relay_seq = a.seq;
        w.view.complete = a.complete && !w.view.lossy;
        w.view.attempted_at_ms = now_ms;
        w.view.ok_at_ms = now_ms.max(1);
        w.view.failures = 0;
        out.blocks = w.view.blocks;
        w.commit(store)?;
        if before > 0 && u64::from(kept) * 2 < u64::from(before) {
            out.index_reset = self.age_out_index(store, slot, generation)?;
        }
        Ok(out)
    }

    /// Ages out every approximate-index entry of (`slot`, `generation`) by
    /// advancing its eviction clock by its capacity. False when the
    /// capacity is unknown (entries then never age; nothing to do).
    fn age_out_index(
        &self,
        store: &dyn Store,
        slot: u16,
        generation: u16,
    ) -> Result<bool, StoreError> {
        let metrics =
            MetricsTable::decode(store.get(METRICS_KEY)?.as_ref().map(|(b, _)| b.as_slice()));
        let capacity = self.capacity_blocks(metrics.get(slot, generation));
        if capacity == 0 {
            return Ok(false);
        }
        let u = update(
            store,
            LOAD_KEY,
            LoadTable::decode,
            LoadTable::encode,
            |t: &mut LoadTable| {
                t.advance_insert_counter(slot, generation, capacity)
                    .then_some(())
            },
        )?;
        Ok(u.result.is_some())
    }
}

//! KV events from an endpoint's relay (`relay/README.md` has its HTTP API),
//! applied to the endpoint's held-block set in shared data
//! (`kvroute_shared_state::held`).
//!
//! Per endpoint, the collector asks for one of two things:
//!
//! - `/kv/snapshot` when it has no position on the relay (first poll, a new
//!   slot generation, after a resync): the set is replaced by the snapshot,
//!   and the position becomes the snapshot's `epoch` and `seq`;
//! - `/kv/events?after=SEQ&epoch=E&limit=N` otherwise: each batch's ops are
//!   applied in order (`stored`, `removed`, `cleared`), and the position
//!   moves to the answer's `seq`; `more: true` asks again at once.
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

use crate::engine::Engine;
use kvroute_shared_state::cas::update;
use kvroute_shared_state::held::{EndpointHeld, HeldGeometry, HeldTable, HeldWriter};
use kvroute_shared_state::load::LoadTable;
use kvroute_shared_state::metrics::MetricsTable;
use kvroute_shared_state::{Store, StoreError, LOAD_KEY, METRICS_KEY};
use serde::Deserialize;
use std::fmt;

/// `GET /kv/events` answer.
#[derive(Debug, Deserialize)]
struct EventsAnswer {
    epoch: u64,
    seq: u64,
    /// The relay's newest seq (absent: treat `seq` as the newest).
    #[serde(default)]
    last: Option<u64>,
    /// The relay snapshot's completeness now (absent: unknown, keep ours).
    #[serde(default)]
    complete: Option<bool>,
    #[serde(default)]
    resync: bool,
    #[serde(default)]
    more: bool,
    #[serde(default)]
    batches: Vec<Batch>,
}

/// One batch of an answer (its `seq` is not needed: the answer's `seq` is
/// the cursor).
#[derive(Debug, Deserialize)]
struct Batch {
    ops: Vec<Op>,
}

#[derive(Debug, Deserialize)]
#[serde(tag = "op", rename_all = "lowercase")]
enum Op {
    Stored { hashes: Vec<u64> },
    Removed { hashes: Vec<u64> },
    Cleared,
}

/// `GET /kv/snapshot` answer.
#[derive(Debug, Deserialize)]
struct SnapshotAnswer {
    epoch: u64,
    seq: u64,
    complete: bool,
    blocks: Vec<u64>,
}

/// Which call to make to an endpoint's relay.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ask {
    Snapshot,
    Events,
}

/// What to ask the relay, given the endpoint's view (`None`: no view yet).
pub fn next_ask(view: Option<&EndpointHeld>) -> Ask {
    match view {
        Some(v) if v.relay_epoch != 0 => Ask::Events,
        _ => Ask::Snapshot,
    }
}

/// The request path of `ask`.
pub fn ask_path(ask: Ask, view: Option<&EndpointHeld>, limit: u32) -> String {
    match (ask, view) {
        (Ask::Events, Some(v)) => format!(
            "/kv/events?after={}&epoch={}&limit={limit}",
            v.relay_seq, v.relay_epoch
        ),
        _ => "/kv/snapshot".to_string(),
    }
}

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
        let a: EventsAnswer =
            serde_json::from_slice(body).map_err(|e| ApplyError::Garbage(e.to_string()))?;
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
        let a: SnapshotAnswer =
            serde_json::from_slice(body).map_err(|e| ApplyError::Garbage(e.to_string()))?;
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

/// Hashes listed per endpoint in the state view; a larger set is counted
/// but not listed (`hashesListed: false`).
pub const STATE_HASHES_MAX: u32 = 4096;

/// The held table as the state view reads it (`kvEvents.enabled` only).
pub(crate) struct HeldState {
    table: HeldTable,
}

impl HeldState {
    /// One endpoint's `kvEvents` object in the state JSON.
    pub(crate) fn endpoint_json(
        &self,
        engine: &Engine,
        store: &dyn Store,
        e: &kvroute_shared_state::endpoints::EndpointEntry,
        now_ms: u64,
    ) -> serde_json::Value {
        let kv = &engine.config.kv_events;
        let relay = kv.relay_for(&e.address);
        let Some(v) = self.table.get(e.slot, e.generation) else {
            return serde_json::json!({"relay": relay, "fresh": false, "blocks": 0});
        };
        let listed = v.blocks <= STATE_HASHES_MAX;
        let hashes = if listed {
            let geo = engine.held_geometry();
            match kvroute_shared_state::held::all_hashes(
                store,
                &geo,
                &self.table,
                e.slot,
                e.generation,
            ) {
                Ok(mut h) => {
                    h.sort_unstable();
                    Some(h)
                }
                Err(_) => None,
            }
        } else {
            None
        };
        serde_json::json!({
            "relay": relay,
            "relayEpoch": v.relay_epoch,
            "relaySeq": v.relay_seq,
            "blocks": v.blocks,
            "complete": v.complete,
            "fresh": v.is_fresh(now_ms, kv.stale_ms),
            "ageMs": (v.ok_at_ms != 0).then(|| now_ms.saturating_sub(v.ok_at_ms)),
            "failures": v.failures,
            "droppedBlocks": v.dropped,
            "hashesListed": hashes.is_some(),
            "hashes": hashes,
        })
    }
}

impl Engine {
    /// The held table for the state view, when `kvEvents.enabled`.
    pub(crate) fn held_state(&self, store: &dyn Store) -> Result<Option<HeldState>, StoreError> {
        if !self.config.kv_events.enabled {
            return Ok(None);
        }
        Ok(Some(HeldState {
            table: HeldTable::read(store)?,
        }))
    }
}

impl Engine {
    /// The request path's view of the held sets (`kvEvents`): for each of
    /// `endpoints` (e.g. [`crate::engine::Snapshot::endpoints`]), the
    /// leading hashes of `hashes` (vLLM block hashes, block 0 first) it
    /// holds and whether its view is fresh (`kvEvents.staleMs`). With
    /// `kvEvents` off, every endpoint is not fresh and nothing is read.
    /// One read of `kvroute/held`, then [`kvroute_shared_state::held::longest_held`].
    pub fn held_prefixes(
        &self,
        store: &dyn Store,
        endpoints: &[kvroute_shared_state::endpoints::EndpointEntry],
        hashes: &[u64],
        now_ms: u64,
    ) -> Result<Vec<kvroute_shared_state::held::HeldMatch>, StoreError> {
        let kv = &self.config.kv_events;
        if !kv.enabled {
            return Ok(vec![Default::default(); endpoints.len()]);
        }
        let status = HeldTable::read(store)?;
        let ids: Vec<(u16, u16)> = endpoints.iter().map(|e| (e.slot, e.generation)).collect();
        kvroute_shared_state::held::longest_held(
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

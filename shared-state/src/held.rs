//! Held blocks: the vLLM block hashes each endpoint holds, as its KV events
//! say (the collector polls the endpoint's relay and writes them here).
//!
//! # Request-path API
//!
//! ```text
//! let status = HeldTable::read(store)?;                       // 1 shared-data read
//! let m = longest_held(store, &geo, &status, &endpoints, &hashes, now_ms, stale_ms)?;
//! // m[i].matched_blocks: leading hashes of `hashes` endpoint i holds;
//! // m[i].fresh: its view is current (a good poll within stale_ms).
//! ```
//!
//! - `endpoints` are `(slot, generation)` pairs from the endpoint table,
//!   `hashes` the request's chain of vLLM block hashes (u64, low 64 bits of
//!   vLLM's hash, block 0 first).
//! - Only endpoints whose view is fresh are searched; a stale, unknown or
//!   other-generation view gives `matched_blocks: 0, fresh: false`, and the
//!   caller routes on the approximate index instead.
//! - Cost: one read of `kvroute/held` plus, per fresh endpoint, one read of
//!   block 0's shard (a cold endpoint stops there), one of the last block's
//!   (an endpoint holding the whole chain stops there), else a binary search
//!   over the chain (chained hashes make "holds block i" nearly monotone in
//!   i): at most `log2(blocks) + 2` shard reads of [`SHARD_BYTES`] each,
//!   fewer when probes share a shard (reads, bytes copied and time measured
//!   natively: `docs/lab/2026-12-06-measurements-from-code-comments.md`).
//!   In Envoy each read is a host call that copies the value.
//!
//! # Layout (bounded)
//!
//! | key | what |
//! |---|---|
//! | `kvroute/held` | [`HeldTable`]: per slot the generation, view id, relay epoch and seq, last good poll, completeness, block count |
//! | `kvroute/held/<slot>/<n>` | shard `n` of a slot's set: `view u32, count u32`, then [`SHARD_ENTRIES`] u64 hashes, open addressing with linear probing (0 = empty) |
//!
//! A hash lives in shard `mix(h) >> 32 % shards`. Each endpoint has
//! `shards = ceil(maxHeldBlocks / TARGET_PER_SHARD)` shards, so at most
//! `slots × shards × SHARD_BYTES` bytes plus the table (≈ 64 bytes a slot),
//! whatever the events say. A store beyond `maxHeldBlocks` for the
//! endpoint, or into a shard already holding [`SHARD_CAP`] hashes, is
//! dropped, counted in `dropped`, and marks the view incomplete.
//!
//! Clearing a view (resync, `AllBlocksCleared`, a new relay epoch, a new slot
//! generation) writes nothing but the table: the slot gets a new *view id*,
//! and a shard stamped with another view id reads as empty. Shared data has
//! no delete, so this is how a whole set disappears at once.
//!
//! The collector is the only writer ([`HeldWriter`]): it writes a view's
//! touched shards first, then its table entry (seq, time, count).

use crate::cas::update_bytes;
use crate::codec::{Reader, Writer};
use crate::{Store, StoreError, MAX_ENDPOINTS};
use std::collections::HashMap;

/// The key of the held-blocks table.
pub const HELD_KEY: &str = "kvroute/held";
/// Bytes per shard value.
pub const SHARD_BYTES: usize = 2048;
/// Bytes of a shard's header (`view u32, count u32`).
const SHARD_HEADER: usize = 8;
/// Hash slots per shard.
pub const SHARD_ENTRIES: usize = (SHARD_BYTES - SHARD_HEADER) / 8;
/// Hashes a shard takes at most (75% load: linear probing stays short).
pub const SHARD_CAP: u32 = 192;
/// Hashes per shard the geometry plans for (50% load): with hashes spread
/// uniformly a shard reaches [`SHARD_CAP`] only ~5.7 standard deviations
/// above the mean.
pub const TARGET_PER_SHARD: u32 = 128;

/// How the held sets are laid out, from `kvEvents.maxHeldBlocks`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HeldGeometry {
    /// Most hashes one endpoint's set holds.
    pub max_blocks: u32,
    /// Shards per endpoint.
    pub shards: u32,
}

impl HeldGeometry {
    pub fn new(max_blocks: u32) -> HeldGeometry {
        let max_blocks = max_blocks.max(1);
        HeldGeometry {
            max_blocks,
            shards: max_blocks.div_ceil(TARGET_PER_SHARD).clamp(1, 1 << 16),
        }
    }

    /// Most bytes the shards of one endpoint occupy.
    pub fn max_bytes_per_endpoint(&self) -> u64 {
        u64::from(self.shards) * SHARD_BYTES as u64
    }

    /// Most bytes held data occupies with `slots` endpoint slots in use
    /// (shards plus the table).
    pub fn max_bytes(&self, slots: u64) -> u64 {
        slots * (self.max_bytes_per_endpoint() + ENTRY_BYTES as u64) + 3
    }

    fn shard_of(&self, h: u64) -> u32 {
        ((mix(h) >> 32) % u64::from(self.shards)) as u32
    }
}

/// The shared-data key of `slot`'s shard `n`: `kvroute/held/<slot>/<n>`.
pub fn shard_key(slot: u16, n: u32) -> String {
    format!("kvroute/held/{slot}/{n}")
}

fn mix(h: u64) -> u64 {
    // splitmix64 finaliser (vLLM's hashes are already uniform; this guards
    // against a test's small integers clustering in one shard).
    let mut z = h;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Hash 0 marks an empty slot, so a real 0 is stored as 1.
fn key_hash(h: u64) -> u64 {
    h.max(1)
}

/// One endpoint's view, as the table holds it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EndpointHeld {
    pub generation: u16,
    /// Shards stamped with another view id read as empty.
    pub view: u32,
    /// The relay's epoch (its start, unix ms; 0 = none yet).
    pub relay_epoch: u64,
    /// The relay seq applied up to.
    pub relay_seq: u64,
    /// ms; when the last good poll finished (0 = never).
    pub ok_at_ms: u64,
    /// ms; when the last poll (any outcome) finished.
    pub attempted_at_ms: u64,
    /// Consecutive failed polls.
    pub failures: u32,
    /// The relay said its snapshot was complete, and nothing was dropped here.
    pub complete: bool,
    /// Hashes in the set.
    pub blocks: u32,
    /// A store was dropped at the bound since the set was last loaded or
    /// cleared: it cannot be complete until then.
    pub lossy: bool,
    /// Stores dropped at the bound, since the slot's generation began.
    pub dropped: u64,
}

const ENTRY_BYTES: usize = 2 + 4 + 8 + 8 + 8 + 8 + 4 + 1 + 4 + 8;

impl EndpointHeld {
    /// A good poll at most `stale_ms` ago.
    pub fn is_fresh(&self, now_ms: u64, stale_ms: u64) -> bool {
        self.ok_at_ms != 0 && now_ms.saturating_sub(self.ok_at_ms) <= stale_ms
    }
}

/// Per slot, the state of its held set (`kvroute/held`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct HeldTable {
    pub slots: Vec<EndpointHeld>,
}

const MAGIC: u8 = 0x4B;

impl HeldTable {
    pub fn encode(&self) -> Vec<u8> {
        let mut w = Writer::with_capacity(3 + self.slots.len() * ENTRY_BYTES);
        w.u8(MAGIC);
        w.u16(self.slots.len() as u16);
        for s in &self.slots {
            w.u16(s.generation);
            w.u32(s.view);
            w.u64(s.relay_epoch);
            w.u64(s.relay_seq);
            w.u64(s.ok_at_ms);
            w.u64(s.attempted_at_ms);
            w.u32(s.failures);
            w.u8(u8::from(s.complete) | u8::from(s.lossy) << 1);
            w.u32(s.blocks);
            w.u64(s.dropped);
        }
        w.buf
    }

    /// A missing or corrupt value decodes as empty.
    pub fn decode(bytes: Option<&[u8]>) -> HeldTable {
        bytes.and_then(Self::try_decode).unwrap_or_default()
    }

    fn try_decode(bytes: &[u8]) -> Option<HeldTable> {
        let mut r = Reader::new(bytes);
        if r.u8()? != MAGIC {
            return None;
        }
        let n = r.u16()? as usize;
        if n > MAX_ENDPOINTS {
            return None;
        }
        let mut slots = Vec::with_capacity(n);
        for _ in 0..n {
            slots.push(EndpointHeld {
                generation: r.u16()?,
                view: r.u32()?,
                relay_epoch: r.u64()?,
                relay_seq: r.u64()?,
                ok_at_ms: r.u64()?,
                attempted_at_ms: r.u64()?,
                failures: r.u32()?,
                complete: false,
                blocks: 0,
                lossy: false,
                dropped: 0,
            });
            let flags = r.u8()?;
            let last = slots.len() - 1;
            slots[last].complete = flags & 1 != 0;
            slots[last].lossy = flags & 2 != 0;
            slots[last].blocks = r.u32()?;
            slots[last].dropped = r.u64()?;
        }
        Some(HeldTable { slots })
    }

    /// Reads `kvroute/held` (empty if missing).
    pub fn read(store: &dyn Store) -> Result<HeldTable, StoreError> {
        Ok(Self::decode(
            store.get(HELD_KEY)?.as_ref().map(|(b, _)| b.as_slice()),
        ))
    }

    /// The view of `slot` if it belongs to `generation`.
    pub fn get(&self, slot: u16, generation: u16) -> Option<&EndpointHeld> {
        self.slots
            .get(slot as usize)
            .filter(|s| s.generation == generation && s.view != 0)
    }
}

/// What [`longest_held`] found for one endpoint.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HeldMatch {
    /// Leading hashes of the chain the endpoint holds (0 when not fresh).
    pub matched_blocks: u32,
    /// The endpoint's view is current: a good poll within `stale_ms`.
    pub fresh: bool,
    /// The view is known to be the whole set (see [`EndpointHeld::complete`]).
    pub complete: bool,
}

/// Is `h` in this shard value (stamped with `view`)?
fn shard_contains(shard: &[u8], view: u32, h: u64) -> bool {
    if shard_view(shard) != Some(view) {
        return false;
    }
    let h = key_hash(h);
    let start = (mix(h) % SHARD_ENTRIES as u64) as usize;
    for k in 0..SHARD_ENTRIES {
        match entry(shard, (start + k) % SHARD_ENTRIES) {
            0 => return false,
            e if e == h => return true,
            _ => {}
        }
    }
    false
}

fn shard_view(shard: &[u8]) -> Option<u32> {
    if shard.len() != SHARD_BYTES {
        return None;
    }
    shard
        .get(0..4)
        .and_then(|b| b.try_into().ok())
        .map(u32::from_le_bytes)
}

fn shard_count(shard: &[u8]) -> u32 {
    shard
        .get(4..8)
        .and_then(|b| b.try_into().ok())
        .map_or(0, u32::from_le_bytes)
}

fn entry(shard: &[u8], i: usize) -> u64 {
    let o = SHARD_HEADER + i * 8;
    shard
        .get(o..o + 8)
        .and_then(|b| b.try_into().ok())
        .map_or(0, u64::from_le_bytes)
}

fn set_entry(shard: &mut [u8], i: usize, v: u64) {
    let o = SHARD_HEADER + i * 8;
    if let Some(dst) = shard.get_mut(o..o + 8) {
        dst.copy_from_slice(&v.to_le_bytes());
    }
}

fn set_count(shard: &mut [u8], n: u32) {
    if let Some(dst) = shard.get_mut(4..8) {
        dst.copy_from_slice(&n.to_le_bytes());
    }
}

/// For each `(slot, generation)` in `endpoints`, the longest run of
/// `hashes` from block 0 it holds, and whether its view is fresh. See the
/// module docs for the cost.
pub fn longest_held(
    store: &dyn Store,
    geo: &HeldGeometry,
    status: &HeldTable,
    endpoints: &[(u16, u16)],
    hashes: &[u64],
    now_ms: u64,
    stale_ms: u64,
) -> Result<Vec<HeldMatch>, StoreError> {
    let mut out = vec![HeldMatch::default(); endpoints.len()];
    for (k, &(slot, generation)) in endpoints.iter().enumerate() {
        let Some(view) = status.get(slot, generation) else {
            continue;
        };
        if !view.is_fresh(now_ms, stale_ms) {
            continue;
        }
        out[k].fresh = true;
        out[k].complete = view.complete;
        if hashes.is_empty() || view.blocks == 0 {
            continue;
        }
        // Shards read for this endpoint, by shard number.
        let mut read: HashMap<u32, Option<Vec<u8>>> = HashMap::new();
        let mut holds = |i: usize| -> Result<bool, StoreError> {
            let n = geo.shard_of(key_hash(hashes[i]));
            if let std::collections::hash_map::Entry::Vacant(v) = read.entry(n) {
                v.insert(store.get(&shard_key(slot, n))?.map(|(b, _)| b));
            }
            Ok(read
                .get(&n)
                .and_then(Option::as_deref)
                .is_some_and(|s| shard_contains(s, view.view, hashes[i])))
        };
        if !holds(0)? {
            continue;
        }
        // The warm endpoint usually holds the whole chain: one more read.
        let last = hashes.len() - 1;
        if last > 0 && holds(last)? {
            out[k].matched_blocks = hashes.len() as u32;
            continue;
        }
        let (mut lo, mut hi) = (0usize, last);
        while lo < hi {
            let mid = (lo + hi).div_ceil(2);
            if holds(mid)? {
                lo = mid;
            } else {
                hi = mid - 1;
            }
        }
        out[k].matched_blocks = (lo + 1) as u32;
    }
    Ok(out)
}

/// Whether `h` is in `slot`'s current set (one shard read); for tests and
/// the state view.
pub fn contains(
    store: &dyn Store,
    geo: &HeldGeometry,
    status: &HeldTable,
    slot: u16,
    generation: u16,
    h: u64,
) -> Result<bool, StoreError> {
    let Some(view) = status.get(slot, generation) else {
        return Ok(false);
    };
    let n = geo.shard_of(key_hash(h));
    Ok(store
        .get(&shard_key(slot, n))?
        .is_some_and(|(s, _)| shard_contains(&s, view.view, h)))
}

/// Every hash in `slot`'s current set (reads all its shards); for tests and
/// operators, never the request path.
pub fn all_hashes(
    store: &dyn Store,
    geo: &HeldGeometry,
    status: &HeldTable,
    slot: u16,
    generation: u16,
) -> Result<Vec<u64>, StoreError> {
    let Some(view) = status.get(slot, generation) else {
        return Ok(Vec::new());
    };
    let mut out = Vec::new();
    for n in 0..geo.shards {
        if let Some((s, _)) = store.get(&shard_key(slot, n))? {
            if shard_view(&s) == Some(view.view) {
                out.extend((0..SHARD_ENTRIES).map(|i| entry(&s, i)).filter(|&e| e != 0));
            }
        }
    }
    Ok(out)
}

/// What one [`HeldWriter::commit`] did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Committed {
    pub shard_writes: u32,
    pub cas_retries: u32,
}

/// The collector's changes to one endpoint's view: load it with
/// [`HeldWriter::open`], apply events (`clear`, `store`, `remove`, `set_*`),
/// then [`HeldWriter::commit`]. Shards are read lazily and written once.
pub struct HeldWriter {
    geo: HeldGeometry,
    slot: u16,
    /// The view as it will be written.
    pub view: EndpointHeld,
    /// Touched shards, already normalised to the current view.
    shards: HashMap<u32, Vec<u8>>,
}

impl HeldWriter {
    /// `slot`'s view for `generation` (a new, empty one when the table has
    /// another generation or none). `now_ms` seeds a new view id.
    pub fn open(
        status: &HeldTable,
        geo: HeldGeometry,
        slot: u16,
        generation: u16,
        now_ms: u64,
    ) -> HeldWriter {
        let view = match status.get(slot, generation) {
            Some(v) => *v,
            None => EndpointHeld {
                generation,
                view: new_view_id(
                    status.slots.get(slot as usize).map_or(0, |s| s.view),
                    now_ms,
                ),
                ..Default::default()
            },
        };
        HeldWriter {
            geo,
            slot,
            view,
            shards: HashMap::new(),
        }
    }

    /// Empties the set (a new view id; nothing is read or deleted), and
    /// forgets the relay position.
    pub fn clear(&mut self, now_ms: u64) {
        self.view.view = new_view_id(self.view.view, now_ms);
        self.view.blocks = 0;
        self.view.lossy = false;
        self.view.relay_epoch = 0;
        self.view.relay_seq = 0;
        self.view.complete = false;
        self.shards.clear();
    }

    fn shard(&mut self, store: &dyn Store, n: u32) -> Result<&mut Vec<u8>, StoreError> {
        if !self.shards.contains_key(&n) {
            let mut s = store
                .get(&shard_key(self.slot, n))?
                .map(|(b, _)| b)
                .unwrap_or_default();
            if shard_view(&s) != Some(self.view.view) {
                s = vec![0; SHARD_BYTES];
                s[0..4].copy_from_slice(&self.view.view.to_le_bytes());
            }
            self.shards.insert(n, s);
        }
        // Inserted just above when missing.
        self.shards
            .get_mut(&n)
            .ok_or_else(|| StoreError::Host("held shard vanished".into()))
    }

    /// Whether `h` is in the set as this writer sees it.
    pub fn contains(&mut self, store: &dyn Store, h: u64) -> Result<bool, StoreError> {
        let n = self.geo.shard_of(key_hash(h));
        let view = self.view.view;
        let shard = self.shard(store, n)?;
        Ok(shard_contains(shard, view, h))
    }

    /// Adds `h`. Returns false if it was dropped at the bound (counted in
    /// `dropped`, and the view becomes incomplete).
    pub fn store(&mut self, store: &dyn Store, h: u64) -> Result<bool, StoreError> {
        let n = self.geo.shard_of(key_hash(h));
        let full = self.view.blocks >= self.geo.max_blocks;
        let shard = self.shard(store, n)?;
        let k = key_hash(h);
        let start = (mix(k) % SHARD_ENTRIES as u64) as usize;
        let mut free = None;
        for j in 0..SHARD_ENTRIES {
            let i = (start + j) % SHARD_ENTRIES;
            match entry(shard, i) {
                0 => {
                    free = Some(i);
                    break;
                }
                e if e == k => return Ok(true),
                _ => {}
            }
        }
        let count = shard_count(shard);
        match free {
            Some(i) if !full && count < SHARD_CAP => {
                set_entry(shard, i, k);
                set_count(shard, count + 1);
                self.view.blocks += 1;
                Ok(true)
            }
            _ => {
                self.view.dropped = self.view.dropped.saturating_add(1);
                self.view.complete = false;
                self.view.lossy = true;
                Ok(false)
            }
        }
    }

    /// Removes `h` if present (backward-shift deletion keeps probe runs whole).
    pub fn remove(&mut self, store: &dyn Store, h: u64) -> Result<bool, StoreError> {
        let n = self.geo.shard_of(key_hash(h));
        let shard = self.shard(store, n)?;
        let k = key_hash(h);
        let start = (mix(k) % SHARD_ENTRIES as u64) as usize;
        let mut at = None;
        for j in 0..SHARD_ENTRIES {
            let i = (start + j) % SHARD_ENTRIES;
            match entry(shard, i) {
                0 => break,
                e if e == k => {
                    at = Some(i);
                    break;
                }
                _ => {}
            }
        }
        let Some(mut hole) = at else {
            return Ok(false);
        };
        set_entry(shard, hole, 0);
        let mut i = hole;
        loop {
            i = (i + 1) % SHARD_ENTRIES;
            let e = entry(shard, i);
            if e == 0 {
                break;
            }
            let home = (mix(e) % SHARD_ENTRIES as u64) as usize;
            // Move e into the hole if its home is not cyclically in (hole, i].
            let dist_home = (i + SHARD_ENTRIES - home) % SHARD_ENTRIES;
            let dist_hole = (i + SHARD_ENTRIES - hole) % SHARD_ENTRIES;
            if dist_home >= dist_hole {
                set_entry(shard, hole, e);
                set_entry(shard, i, 0);
                hole = i;
            }
        }
        let count = shard_count(shard);
        set_count(shard, count.saturating_sub(1));
        self.view.blocks = self.view.blocks.saturating_sub(1);
        Ok(true)
    }

    /// Writes the touched shards, then the table entry (by CAS, since
    /// other slots share it). The collector is the only writer of a slot's
    /// shards, so they are set without CAS; a lease handover that overlaps
    /// two collectors for a moment can lose a poll's changes, which the
    /// next resync repairs.
    pub fn commit(self, store: &dyn Store) -> Result<Committed, StoreError> {
        let mut done = Committed::default();
        let mut shards: Vec<_> = self.shards.into_iter().collect();
        shards.sort_by_key(|(n, _)| *n);
        for (n, bytes) in shards {
            store.set(&shard_key(self.slot, n), &bytes, 0)?;
            done.shard_writes += 1;
        }
        let slot = self.slot as usize;
        let view = self.view;
        let u = update_bytes(
            store,
            HELD_KEY,
            None,
            || HeldTable::default().encode(),
            |_| {},
            |bytes| {
                let mut t = HeldTable::decode(Some(bytes));
                if slot >= MAX_ENDPOINTS {
                    return None;
                }
                if t.slots.len() <= slot {
                    t.slots.resize(slot + 1, EndpointHeld::default());
                }
                t.slots[slot] = view;
                *bytes = t.encode();
                Some(())
            },
        )?;
        done.cas_retries = u.retries;
        Ok(done)
    }
}

/// A view id unlike `old` and unlike ids of earlier lives of the table
/// (it mixes in the time), never 0.
fn new_view_id(old: u32, now_ms: u64) -> u32 {
    let t = (mix(now_ms ^ u64::from(old)) >> 32) as u32;
    let v = if t == old { t.wrapping_add(1) } else { t };
    v.max(1)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::MemoryStore;

    fn chain(seed: u64, n: usize) -> Vec<u64> {
        (0..n as u64).map(|i| mix(seed ^ mix(i + 1))).collect()
    }

    fn write(store: &MemoryStore, geo: HeldGeometry, slot: u16, hashes: &[u64], now: u64) {
        let t = HeldTable::read(store).unwrap();
        let mut w = HeldWriter::open(&t, geo, slot, 1, now);
        for &h in hashes {
            w.store(store, h).unwrap();
        }
        w.view.ok_at_ms = now;
        w.view.complete = true;
        w.commit(store).unwrap();
    }

    #[test]
    fn table_round_trip_and_corrupt() {
        let t = HeldTable {
            slots: vec![
                EndpointHeld::default(),
                EndpointHeld {
                    generation: 3,
                    view: 9,
                    relay_epoch: 1_764_600_000_000,
                    relay_seq: 42,
                    ok_at_ms: 5,
                    attempted_at_ms: 6,
                    failures: 1,
                    complete: true,
                    blocks: 17,
                    lossy: true,
                    dropped: 2,
                },
            ],
        };
        let enc = t.encode();
        assert_eq!(enc.len(), 3 + 2 * ENTRY_BYTES);
        assert_eq!(HeldTable::decode(Some(&enc)), t);
        assert_eq!(HeldTable::decode(Some(&enc[..10])), HeldTable::default());
        assert_eq!(HeldTable::decode(Some(b"garbage")), HeldTable::default());
        assert!(t.get(1, 3).is_some());
        assert!(t.get(1, 2).is_none(), "another generation is not this view");
        assert!(t.get(0, 0).is_none(), "view 0 = never written");
    }

    #[test]
    fn longest_held_matches_prefix_and_freshness() {
        let store = MemoryStore::new();
        let geo = HeldGeometry::new(4096);
        let a = chain(1, 100);
        write(&store, geo, 0, &a[..60], 1000);
        write(&store, geo, 1, &a[..10], 1000);
        write(&store, geo, 2, &a, 10); // stale at now = 1000
        let t = HeldTable::read(&store).unwrap();
        let m = longest_held(
            &store,
            &geo,
            &t,
            &[(0, 1), (1, 1), (2, 1), (3, 1)],
            &a,
            1000,
            500,
        )
        .unwrap();
        assert_eq!(m[0].matched_blocks, 60);
        assert!(m[0].fresh && m[0].complete);
        assert_eq!(m[1].matched_blocks, 10);
        assert_eq!(m[2], HeldMatch::default(), "stale: not searched, not fresh");
        // A whole chain held: found by the first and last block alone.
        for n in [1, 2, 59, 60] {
            let m = longest_held(&store, &geo, &t, &[(0, 1)], &a[..n], 1000, 500).unwrap();
            assert_eq!(m[0].matched_blocks, n as u32, "chain of {n}");
        }
        assert_eq!(m[3], HeldMatch::default(), "unknown slot");
        let m = longest_held(&store, &geo, &t, &[(0, 2)], &a, 1000, 500).unwrap();
        assert!(!m[0].fresh, "another generation's view does not count");
        let other = chain(2, 5);
        let m = longest_held(&store, &geo, &t, &[(0, 1)], &other, 1000, 500).unwrap();
        assert_eq!(m[0].matched_blocks, 0);
        assert!(m[0].fresh);
    }

    #[test]
    fn remove_and_clear() {
        let store = MemoryStore::new();
        // One shard: every hash probes the same table, so removals shift runs.
        let geo = HeldGeometry::new(100);
        assert_eq!(geo.shards, 1);
        let a = chain(7, 100);
        write(&store, geo, 0, &a, 1);
        let t = HeldTable::read(&store).unwrap();
        assert_eq!(t.get(0, 1).unwrap().blocks, 100);
        let mut w = HeldWriter::open(&t, geo, 0, 1, 2);
        for h in a.iter().step_by(3) {
            assert!(w.remove(&store, *h).unwrap());
        }
        assert!(!w.remove(&store, 12345).unwrap(), "absent hash");
        w.commit(&store).unwrap();
        let t = HeldTable::read(&store).unwrap();
        assert_eq!(t.get(0, 1).unwrap().blocks, 66);
        for (i, h) in a.iter().enumerate() {
            assert_eq!(
                contains(&store, &geo, &t, 0, 1, *h).unwrap(),
                i % 3 != 0,
                "block {i} after removals"
            );
        }
        let mut got = all_hashes(&store, &geo, &t, 0, 1).unwrap();
        got.sort();
        let mut want: Vec<u64> = a
            .iter()
            .enumerate()
            .filter(|(i, _)| i % 3 != 0)
            .map(|(_, h)| *h)
            .collect();
        want.sort();
        assert_eq!(got, want);

        let mut w = HeldWriter::open(&t, geo, 0, 1, 3);
        w.clear(3);
        w.view.ok_at_ms = 3;
        let c = w.commit(&store).unwrap();
        assert_eq!(c.shard_writes, 0, "a clear writes no shard");
        let t = HeldTable::read(&store).unwrap();
        assert_eq!(t.get(0, 1).unwrap().blocks, 0);
        assert!(!contains(&store, &geo, &t, 0, 1, a[1]).unwrap());
        assert!(all_hashes(&store, &geo, &t, 0, 1).unwrap().is_empty());
        // Storing again after the clear starts from empty shards.
        write(&store, geo, 0, &a[..3], 4);
        let t = HeldTable::read(&store).unwrap();
        assert_eq!(t.get(0, 1).unwrap().blocks, 3);
        assert_eq!(all_hashes(&store, &geo, &t, 0, 1).unwrap().len(), 3);
    }

    #[test]
    fn bounded_by_max_blocks_whatever_is_stored() {
        let store = MemoryStore::new();
        let geo = HeldGeometry::new(1000);
        for slot in 0..4u16 {
            let t = HeldTable::read(&store).unwrap();
            let mut w = HeldWriter::open(&t, geo, slot, 1, 1);
            let mut kept = 0;
            for h in chain(u64::from(slot) + 100, 50_000) {
                kept += u32::from(w.store(&store, h).unwrap());
            }
            assert_eq!(kept, 1000);
            assert_eq!(w.view.blocks, 1000);
            assert_eq!(w.view.dropped, 49_000);
            assert!(!w.view.complete);
            w.commit(&store).unwrap();
        }
        let (bytes, _) = store.usage();
        assert!(
            bytes as u64 <= geo.max_bytes(4),
            "{bytes} bytes > the bound {}",
            geo.max_bytes(4)
        );
        assert_eq!(
            store.bytes_with_prefix("kvroute/held/") as u64,
            4 * geo.max_bytes_per_endpoint()
        );
    }

    #[test]
    fn generation_change_starts_empty() {
        let store = MemoryStore::new();
        let geo = HeldGeometry::new(512);
        let a = chain(3, 20);
        write(&store, geo, 0, &a, 1);
        let t = HeldTable::read(&store).unwrap();
        let w = HeldWriter::open(&t, geo, 0, 2, 2);
        assert_eq!(w.view.blocks, 0);
        assert_ne!(w.view.view, t.get(0, 1).unwrap().view);
        w.commit(&store).unwrap();
        let t = HeldTable::read(&store).unwrap();
        assert!(!contains(&store, &geo, &t, 0, 2, a[0]).unwrap());
    }

    #[test]
    fn garbage_shards_read_as_empty() {
        let store = MemoryStore::new();
        let geo = HeldGeometry::new(128);
        let a = chain(5, 4);
        write(&store, geo, 0, &a, 1);
        store.set(&shard_key(0, 0), b"junk", 0).unwrap();
        let t = HeldTable::read(&store).unwrap();
        assert!(!contains(&store, &geo, &t, 0, 1, a[0]).unwrap());
        let m = longest_held(&store, &geo, &t, &[(0, 1)], &a, 1, 10).unwrap();
        assert_eq!(m[0].matched_blocks, 0);
    }
}

//! Per-endpoint in-flight load, written by every worker VM.
//!
//! One value (`kvroute/load`) holds a record per slot, so a decision reads
//! every endpoint's load with one get and charges it with one CAS.
//!
//! Charges are kept in 4 time buckets per endpoint, each `window` ms wide
//! (`window = reapAfterMs / 2`). A request remembers its [`Ticket`] (slot,
//! generation, bucket and the bucket's start), and releases against exactly
//! that bucket. The reaper zeroes buckets whose every charge is older than
//! `reapAfterMs` — charges of requests whose VM died — and counts them; a
//! late release then finds the bucket's start changed and does nothing. So a
//! charge is released at most once, counters never go below zero, and
//! nothing needs a per-request key.

use crate::codec::{Reader, Writer};
use crate::MAX_ENDPOINTS;

pub const BUCKETS: usize = 4;

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Bucket {
    /// ms; start of the window this bucket holds charges for
    pub start_ms: u64,
    /// uncached prompt tokens not yet prefilled
    pub prompt_tokens: u64,
    /// estimated output tokens (only with `addEstimatedOutputTokens`)
    pub output_tokens: u64,
    pub requests: u32,
}

impl Bucket {
    fn is_empty(&self) -> bool {
        self.prompt_tokens == 0 && self.output_tokens == 0 && self.requests == 0
    }

    /// The prompt part (`rest: None`), or the request and its output part,
    /// with the prompt part unless already released (`rest:
    /// Some(prompt_released)`).
    fn release(&mut self, t: &Ticket, rest: Option<bool>) {
        let Some(prompt_released) = rest else {
            self.prompt_tokens = self.prompt_tokens.saturating_sub(t.prompt_tokens);
            return;
        };
        if !prompt_released {
            self.prompt_tokens = self.prompt_tokens.saturating_sub(t.prompt_tokens);
        }
        self.output_tokens = self.output_tokens.saturating_sub(t.output_tokens);
        self.requests = self.requests.saturating_sub(1);
        if self.requests == 0 {
            // Rounding can leave nothing behind: all requests are out.
            self.prompt_tokens = 0;
            self.output_tokens = 0;
        }
    }
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LoadRecord {
    /// The slot generation this record belongs to.
    pub generation: u16,
    /// Blocks inserted into the prefix index for this endpoint, ever
    /// (monotone): the eviction clock.
    pub insert_counter: u64,
    /// Stamp of the last cold request routed here (no-hit-lru), 0 = never.
    pub last_cold_pick: u64,
    /// Requests whose charges the reaper removed (should stay 0).
    pub reaped_requests: u32,
    /// Bytes of text prompts routed here, ever (monotone, wrapping): what the
    /// collector sets against the server's `vllm:prompt_tokens_total` to
    /// learn bytes per token (`kvroute_core::learners::bytes_per_token`).
    pub routed_prompt_bytes: u64,
    /// Other proxies' in-flight work here, as the mesh exchange last
    /// reported it (the collector writes it; not released by requests).
    pub peer: PeerLoad,
    pub buckets: [Bucket; BUCKETS],
}

/// What the other proxies of a mesh have in flight on one endpoint: the
/// sums they last posted to the exchange (`kvroute_core::engine` `mesh`),
/// and when this proxy received them. A decision adds them to the
/// endpoint's own charges while `at_ms` is recent (the config's peer TTL).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PeerLoad {
    pub prompt_tokens: u64,
    pub output_tokens: u64,
    pub requests: u32,
    /// ms; 0 = never received.
    pub at_ms: u64,
}

impl PeerLoad {
    /// Whether the figures are recent enough to count at `now_ms`.
    pub fn is_fresh(&self, now_ms: u64, ttl_ms: u64) -> bool {
        self.at_ms != 0 && now_ms.saturating_sub(self.at_ms) <= ttl_ms
    }
}

impl LoadRecord {
    pub fn inflight_tokens(&self) -> u64 {
        self.buckets
            .iter()
            .map(|b| b.prompt_tokens.saturating_add(b.output_tokens))
            .fold(0, u64::saturating_add)
    }
    pub fn inflight_requests(&self) -> u64 {
        self.buckets.iter().map(|b| u64::from(b.requests)).sum()
    }
    /// The prompt parts of `inflight_tokens` (prefill not yet done).
    pub fn inflight_prompt_tokens(&self) -> u64 {
        self.buckets
            .iter()
            .map(|b| b.prompt_tokens)
            .fold(0, u64::saturating_add)
    }
    /// The output parts of `inflight_tokens` (held until the stream ends).
    pub fn inflight_output_tokens(&self) -> u64 {
        self.buckets
            .iter()
            .map(|b| b.output_tokens)
            .fold(0, u64::saturating_add)
    }
}

/// What a request keeps to release its charge later.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Ticket {
    pub slot: u16,
    pub generation: u16,
    pub bucket: u8,
    pub bucket_start_ms: u64,
    pub prompt_tokens: u64,
    pub output_tokens: u64,
}

/// What a decision wrote to an endpoint's record besides its charge: the
/// blocks it moved the eviction clock by, the text bytes it counted, and
/// its cold-pick stamp with the stamp it replaced. Kept by the request so
/// that a request the server rejects can be taken back
/// ([`LoadTable::undo`]): only work a server accepted changes what the
/// index and the learners believe.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Undo {
    pub slot: u16,
    pub generation: u16,
    pub new_blocks: u64,
    pub routed_bytes: u64,
    /// 0: the decision was not cold.
    pub cold_stamp: u64,
    pub prev_cold_pick: u64,
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LoadTable {
    /// The state epoch: the collector bumps it after every change to the
    /// endpoint or metrics table, so a worker that reads this table (as it
    /// does for every request) knows whether its copies of those two tables
    /// are current without reading them. 0 = never bumped (no collector).
    pub epoch: u64,
    pub records: Vec<LoadRecord>,
}

const MAGIC: u8 = 0x13;
/// The encoding's layout (see [`LoadTable::encode`]): magic, epoch, count;
/// per record generation, insert counter, last cold pick, reaped requests,
/// routed prompt bytes, the peers' load (prompt, output, requests, at),
/// then the buckets (start, prompt, output, requests).
const HEADER_BYTES: usize = 1 + 8 + 2;
const RECORD_HEAD_BYTES: usize = 2 + 8 + 8 + 4 + 8 + (8 + 8 + 4 + 8);
const BUCKET_BYTES: usize = 8 + 8 + 8 + 4;
const RECORD_BYTES: usize = RECORD_HEAD_BYTES + BUCKETS * BUCKET_BYTES;

fn le_u64(b: &[u8], at: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(a)
}

fn le_u32(b: &[u8], at: usize) -> u32 {
    let mut a = [0u8; 4];
    a.copy_from_slice(&b[at..at + 4]);
    u32::from_le_bytes(a)
}

/// Bucket width for a reap bound: `reapAfterMs / 2`, at least 1 ms.
pub fn window_ms(reap_after_ms: u64) -> u64 {
    (reap_after_ms / 2).max(1)
}

impl LoadTable {
    pub fn encode(&self) -> Vec<u8> {
        let mut w = Writer::with_capacity(HEADER_BYTES + self.records.len() * RECORD_BYTES);
        w.u8(MAGIC);
        w.u64(self.epoch);
        w.u16(self.records.len() as u16);
        for r in &self.records {
            w.u16(r.generation);
            w.u64(r.insert_counter);
            w.u64(r.last_cold_pick);
            w.u32(r.reaped_requests);
            w.u64(r.routed_prompt_bytes);
            w.u64(r.peer.prompt_tokens);
            w.u64(r.peer.output_tokens);
            w.u32(r.peer.requests);
            w.u64(r.peer.at_ms);
            for b in &r.buckets {
                w.u64(b.start_ms);
                w.u64(b.prompt_tokens);
                w.u64(b.output_tokens);
                w.u32(b.requests);
            }
        }
        w.buf
    }

    /// A missing or corrupt value decodes as an empty table.
    pub fn decode(bytes: Option<&[u8]>) -> LoadTable {
        bytes.and_then(Self::try_decode).unwrap_or_default()
    }

    fn try_decode(bytes: &[u8]) -> Option<LoadTable> {
        let mut r = Reader::new(bytes);
        if r.u8()? != MAGIC {
            return None;
        }
        let epoch = r.u64()?;
        let n = r.u16()? as usize;
        if n > MAX_ENDPOINTS {
            return None;
        }
        let mut records = Vec::with_capacity(n);
        for _ in 0..n {
            let mut rec = LoadRecord {
                generation: r.u16()?,
                insert_counter: r.u64()?,
                last_cold_pick: r.u64()?,
                reaped_requests: r.u32()?,
                routed_prompt_bytes: r.u64()?,
                peer: PeerLoad {
                    prompt_tokens: r.u64()?,
                    output_tokens: r.u64()?,
                    requests: r.u32()?,
                    at_ms: r.u64()?,
                },
                ..Default::default()
            };
            for b in rec.buckets.iter_mut() {
                *b = Bucket {
                    start_ms: r.u64()?,
                    prompt_tokens: r.u64()?,
                    output_tokens: r.u64()?,
                    requests: r.u32()?,
                };
            }
            records.push(rec);
        }
        Some(LoadTable { epoch, records })
    }

    /// Marks the endpoint or metrics table as changed (see `epoch`).
    pub fn bump_epoch(&mut self) {
        self.epoch = self.epoch.wrapping_add(1).max(1);
    }

    /// The record of `slot` if it belongs to `generation`.
    pub fn get(&self, slot: u16, generation: u16) -> Option<&LoadRecord> {
        self.records
            .get(slot as usize)
            .filter(|r| r.generation == generation)
    }

    /// The record of `slot`, reset if it belonged to an older generation.
    fn record_mut(&mut self, slot: u16, generation: u16) -> Option<&mut LoadRecord> {
        let s = slot as usize;
        if s >= MAX_ENDPOINTS {
            return None;
        }
        if self.records.len() <= s {
            self.records.resize(s + 1, LoadRecord::default());
        }
        let rec = &mut self.records[s];
        if rec.generation != generation {
            *rec = LoadRecord {
                generation,
                ..Default::default()
            };
        }
        Some(rec)
    }

    /// Advances an endpoint's eviction clock by `blocks` without a request:
    /// with `blocks` ≥ its capacity, every index entry written for it so
    /// far counts as evicted (`index::Holder::holds`). The collector uses
    /// it when KV events say the server lost its cache. False if the slot
    /// is out of range.
    pub fn advance_insert_counter(&mut self, slot: u16, generation: u16, blocks: u64) -> bool {
        match self.record_mut(slot, generation) {
            Some(rec) => {
                rec.insert_counter = rec.insert_counter.saturating_add(blocks);
                true
            }
            None => false,
        }
    }

    /// Sets what the other proxies have in flight on an endpoint (the mesh
    /// exchange's answer). False if the slot is out of range.
    pub fn set_peer_load(&mut self, slot: u16, generation: u16, peer: PeerLoad) -> bool {
        match self.record_mut(slot, generation) {
            Some(rec) => {
                rec.peer = peer;
                true
            }
            None => false,
        }
    }

    /// Counts `bytes` of text prompt routed to an endpoint (the decision's
    /// charge write does it in the same CAS). False if the slot is out of
    /// range.
    pub fn add_routed_bytes(&mut self, slot: u16, generation: u16, bytes: u64) -> bool {
        match self.record_mut(slot, generation) {
            Some(rec) => {
                rec.routed_prompt_bytes = rec.routed_prompt_bytes.wrapping_add(bytes);
                true
            }
            None => false,
        }
    }

    /// Charges a picked endpoint. `new_blocks` advances its eviction clock;
    /// `cold_stamp` (non-zero) records a cold pick. Returns the ticket and
    /// the insert counter after the charge.
    #[allow(clippy::too_many_arguments)]
    pub fn charge(
        &mut self,
        slot: u16,
        generation: u16,
        now_ms: u64,
        window_ms: u64,
        prompt_tokens: u64,
        output_tokens: u64,
        new_blocks: u64,
        cold_stamp: u64,
    ) -> Option<(Ticket, u64)> {
        let rec = self.record_mut(slot, generation)?;
        let window_ms = window_ms.max(1);
        let start = now_ms / window_ms * window_ms;
        let idx = ((now_ms / window_ms) % BUCKETS as u64) as usize;
        let b = &mut rec.buckets[idx];
        if b.start_ms != start {
            // Leftovers are ≥ 2 × reapAfterMs old: their requests are gone.
            rec.reaped_requests = rec.reaped_requests.saturating_add(b.requests);
            *b = Bucket {
                start_ms: start,
                ..Default::default()
            };
        }
        let b = &mut rec.buckets[idx];
        b.prompt_tokens = b.prompt_tokens.saturating_add(prompt_tokens);
        b.output_tokens = b.output_tokens.saturating_add(output_tokens);
        b.requests = b.requests.saturating_add(1);
        rec.insert_counter = rec.insert_counter.saturating_add(new_blocks);
        if cold_stamp != 0 {
            rec.last_cold_pick = cold_stamp;
        }
        Some((
            Ticket {
                slot,
                generation,
                bucket: idx as u8,
                bucket_start_ms: start,
                prompt_tokens,
                output_tokens,
            },
            rec.insert_counter,
        ))
    }

    /// The last cold-pick stamp of `slot` if it belongs to `generation`
    /// (0 otherwise): what [`Undo::prev_cold_pick`] keeps.
    pub fn last_cold_pick(&self, slot: u16, generation: u16) -> u64 {
        self.get(slot, generation).map_or(0, |r| r.last_cold_pick)
    }

    /// Takes back what a rejected request's decision wrote to its
    /// endpoint's record (see [`Undo`]): the eviction clock goes back by
    /// its blocks (index entries recorded meanwhile are then ahead of the
    /// clock and count as just written: `index::AHEAD_WINDOW`), its bytes
    /// come off the routed total, and its cold stamp is replaced by the
    /// one before it unless a later cold pick replaced it already. False
    /// when the record belongs to another generation now (nothing to undo).
    pub fn undo(&mut self, u: &Undo) -> bool {
        let Some(rec) = self
            .records
            .get_mut(u.slot as usize)
            .filter(|r| r.generation == u.generation)
        else {
            return false;
        };
        rec.insert_counter = rec.insert_counter.saturating_sub(u.new_blocks);
        rec.routed_prompt_bytes = rec.routed_prompt_bytes.wrapping_sub(u.routed_bytes);
        if u.cold_stamp != 0 && rec.last_cold_pick == u.cold_stamp {
            rec.last_cold_pick = u.prev_cold_pick;
        }
        true
    }

    fn bucket_of(&mut self, t: &Ticket) -> Option<&mut Bucket> {
        let rec = self
            .records
            .get_mut(t.slot as usize)
            .filter(|r| r.generation == t.generation)?;
        rec.buckets
            .get_mut(t.bucket as usize)
            .filter(|b| b.start_ms == t.bucket_start_ms)
    }

    /// Releases the prompt part (prefill is done). Returns false when the
    /// charge was already reaped or the endpoint's slot was reused.
    pub fn release_prompt(&mut self, t: &Ticket) -> bool {
        self.release(t, None)
    }

    /// Releases the request and its output part, and the prompt part too
    /// unless `prompt_released`.
    pub fn release_rest(&mut self, t: &Ticket, prompt_released: bool) -> bool {
        self.release(t, Some(prompt_released))
    }

    fn release(&mut self, t: &Ticket, rest: Option<bool>) -> bool {
        self.bucket_of(t).map(|b| b.release(t, rest)).is_some()
    }

    /// [`release_prompt`](Self::release_prompt) (`rest: None`) or
    /// [`release_rest`](Self::release_rest) (`rest: Some(prompt_released)`)
    /// on the encoded table: `bytes` ends up as the encoding of the
    /// released table, and the result is the release's. A well-formed
    /// encoding is patched in place (the ticket's bucket is the only thing
    /// a release changes), so a release builds no table and allocates
    /// nothing; anything else goes through decode, release and encode.
    pub fn release_encoded(bytes: &mut Vec<u8>, t: &Ticket, rest: Option<bool>) -> bool {
        match Self::bucket_at(bytes, t) {
            Some(Some(at)) => {
                let mut b = Bucket {
                    start_ms: t.bucket_start_ms,
                    prompt_tokens: le_u64(bytes, at + 8),
                    output_tokens: le_u64(bytes, at + 16),
                    requests: le_u32(bytes, at + 24),
                };
                b.release(t, rest);
                bytes[at + 8..at + 16].copy_from_slice(&b.prompt_tokens.to_le_bytes());
                bytes[at + 16..at + 24].copy_from_slice(&b.output_tokens.to_le_bytes());
                bytes[at + 24..at + 28].copy_from_slice(&b.requests.to_le_bytes());
                true
            }
            // Well formed, and the charge is gone: nothing to write.
            Some(None) => false,
            None => {
                let mut table = LoadTable::decode(Some(bytes));
                let released = table.release(t, rest);
                *bytes = table.encode();
                released
            }
        }
    }

    /// Where the ticket's bucket starts in `bytes`: `None` if `bytes` is not
    /// exactly one well-formed encoding, `Some(None)` if it is and the
    /// ticket's record or bucket is not there any more.
    fn bucket_at(bytes: &[u8], t: &Ticket) -> Option<Option<usize>> {
        if bytes.len() < HEADER_BYTES || bytes[0] != MAGIC {
            return None;
        }
        let n = usize::from(u16::from_le_bytes([bytes[9], bytes[10]]));
        if n > MAX_ENDPOINTS || bytes.len() != HEADER_BYTES + n * RECORD_BYTES {
            return None;
        }
        let slot = usize::from(t.slot);
        let bucket = usize::from(t.bucket);
        if slot >= n || bucket >= BUCKETS {
            return Some(None);
        }
        let rec = HEADER_BYTES + slot * RECORD_BYTES;
        if u16::from_le_bytes([bytes[rec], bytes[rec + 1]]) != t.generation {
            return Some(None);
        }
        let at = rec + RECORD_HEAD_BYTES + bucket * BUCKET_BYTES;
        Some((le_u64(bytes, at) == t.bucket_start_ms).then_some(at))
    }

    /// Zeroes buckets whose charges are all older than `reap_after_ms`.
    /// Returns the requests reaped; `None` if nothing changed.
    pub fn reap(&mut self, now_ms: u64, reap_after_ms: u64) -> Option<u64> {
        let window = window_ms(reap_after_ms);
        let mut reaped = 0u64;
        let mut changed = false;
        for rec in &mut self.records {
            for b in rec.buckets.iter_mut() {
                if !b.is_empty()
                    && b.start_ms
                        .saturating_add(window)
                        .saturating_add(reap_after_ms)
                        <= now_ms
                {
                    reaped += u64::from(b.requests);
                    rec.reaped_requests = rec.reaped_requests.saturating_add(b.requests);
                    *b = Bucket {
                        start_ms: b.start_ms,
                        ..Default::default()
                    };
                    // A distinct start so late releases cannot match.
                    b.start_ms = u64::MAX;
                    changed = true;
                }
            }
        }
        changed.then_some(reaped)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const W: u64 = 1000;

    #[test]
    fn charge_and_release_exactly_once() {
        let mut t = LoadTable::default();
        let (k, counter) = t.charge(2, 1, 5_000, W, 300, 50, 4, 0).unwrap();
        assert_eq!(counter, 4);
        let r = t.get(2, 1).unwrap();
        assert_eq!((r.inflight_tokens(), r.inflight_requests()), (350, 1));
        assert!(t.release_prompt(&k));
        assert_eq!(t.get(2, 1).unwrap().inflight_tokens(), 50);
        assert!(t.release_rest(&k, true));
        let r = t.get(2, 1).unwrap();
        assert_eq!((r.inflight_tokens(), r.inflight_requests()), (0, 0));
        // A second release cannot go below zero.
        t.release_rest(&k, true);
        assert_eq!(t.get(2, 1).unwrap().inflight_requests(), 0);
    }

    #[test]
    fn generation_change_resets_and_ignores_old_tickets() {
        let mut t = LoadTable::default();
        let (old, _) = t.charge(0, 1, 0, W, 100, 0, 1, 0).unwrap();
        t.charge(0, 2, 0, W, 7, 0, 1, 0).unwrap();
        assert!(!t.release_rest(&old, false));
        assert_eq!(t.get(0, 2).unwrap().inflight_tokens(), 7);
        assert_eq!(t.get(0, 1), None);
    }

    #[test]
    fn reaper_removes_only_old_charges_and_late_release_is_a_no_op() {
        let mut t = LoadTable::default();
        let reap_after = 2 * W;
        let (old, _) = t.charge(0, 1, 100, W, 10, 0, 0, 0).unwrap();
        let (fresh, _) = t.charge(0, 1, 2_500, W, 20, 0, 0, 0).unwrap();
        assert_eq!(t.reap(2_900, reap_after), None);
        assert_eq!(t.reap(3_000, reap_after), Some(1));
        let r = t.get(0, 1).unwrap();
        assert_eq!(
            (
                r.inflight_tokens(),
                r.inflight_requests(),
                r.reaped_requests
            ),
            (20, 1, 1)
        );
        assert!(!t.release_rest(&old, false));
        assert!(t.release_rest(&fresh, false));
        assert_eq!(t.get(0, 1).unwrap().inflight_requests(), 0);
    }

    #[test]
    fn undo_takes_back_what_the_decision_wrote() {
        let mut t = LoadTable::default();
        t.charge(1, 3, 0, W, 10, 0, 40, 7).unwrap();
        assert!(t.add_routed_bytes(1, 3, 1000));
        let before = t.get(1, 3).unwrap().clone();
        let prev = t.last_cold_pick(1, 3);
        let (k, counter) = t.charge(1, 3, 100, W, 500, 0, 300, 9).unwrap();
        assert_eq!(counter, 340);
        assert!(t.add_routed_bytes(1, 3, 4096));
        let u = Undo {
            slot: 1,
            generation: 3,
            new_blocks: 300,
            routed_bytes: 4096,
            cold_stamp: 9,
            prev_cold_pick: prev,
        };
        assert!(t.release_rest(&k, false));
        assert!(t.undo(&u));
        assert_eq!(t.get(1, 3).unwrap(), &before);
        // A later cold pick's stamp is not overwritten by the undo.
        let (_, _) = t.charge(1, 3, 200, W, 5, 0, 2, 11).unwrap();
        assert!(t.undo(&Undo { new_blocks: 0, ..u }));
        assert_eq!(t.get(1, 3).unwrap().last_cold_pick, 11);
        // Another generation's record is left alone.
        assert!(!t.undo(&Undo { generation: 4, ..u }));
    }

    #[test]
    fn round_trip() {
        let mut t = LoadTable::default();
        t.charge(3, 9, 123_456, W, 1, 2, 3, 77).unwrap();
        assert!(t.add_routed_bytes(3, 9, 4096));
        assert!(!t.add_routed_bytes(u16::MAX, 9, 1));
        let enc = t.encode();
        assert_eq!(LoadTable::decode(Some(&enc)), t);
        assert_eq!(
            LoadTable::decode(Some(&enc[..enc.len() - 1])),
            LoadTable::default()
        );
        assert_eq!(LoadTable::decode(None), LoadTable::default());
    }

    /// `release_encoded` against decode → release → encode, over random
    /// tables, tickets that match, have a stale bucket, generation, slot
    /// or bucket index, and encodings that are short, long or corrupt.
    #[test]
    fn release_on_the_bytes_matches_release_on_the_table() {
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = move |n: u64| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed % n.max(1)
        };
        let mut patched = 0;
        for case in 0..20_000 {
            let mut table = LoadTable {
                epoch: next(5),
                records: Vec::new(),
            };
            let mut tickets = Vec::new();
            for _ in 0..next(6) {
                let slot = next(8) as u16;
                let now = next(20_000);
                if let Some((t, _)) = table.charge(
                    slot,
                    next(3) as u16,
                    now,
                    W,
                    next(4) * next(1000),
                    next(3) * next(100),
                    next(40),
                    next(2) * now,
                ) {
                    tickets.push(t);
                }
            }
            if next(4) == 0 {
                table.reap(next(30_000), 2 * W);
            }
            let mut t = match tickets.get(next(tickets.len() as u64 + 2) as usize) {
                Some(t) => *t,
                None => Ticket {
                    slot: next(10) as u16,
                    generation: next(3) as u16,
                    bucket: next(5) as u8,
                    bucket_start_ms: next(20) * W,
                    prompt_tokens: next(500),
                    output_tokens: next(50),
                },
            };
            match next(8) {
                0 => t.bucket_start_ms += W,
                1 => t.generation ^= 1,
                2 => t.prompt_tokens = u64::MAX,
                _ => {}
            }
            let mut bytes = table.encode();
            match case % 16 {
                0 => bytes.push(0),
                1 => {
                    bytes.pop();
                }
                2 => bytes[0] ^= 0xff,
                3 => bytes.truncate(next(12) as usize),
                _ => {}
            }
            let rest = match next(3) {
                0 => None,
                1 => Some(false),
                _ => Some(true),
            };
            let mut expected_table = LoadTable::decode(Some(&bytes));
            let expected = match rest {
                None => expected_table.release_prompt(&t),
                Some(p) => expected_table.release_rest(&t, p),
            };
            let before = bytes.clone();
            let got = LoadTable::release_encoded(&mut bytes, &t, rest);
            assert_eq!(got, expected, "case {case}: {t:?} {rest:?}");
            if got {
                assert_eq!(
                    bytes,
                    expected_table.encode(),
                    "case {case}: {t:?} {rest:?}"
                );
                patched += usize::from(before.len() == bytes.len() && case % 16 > 3);
            }
        }
        // Most releases hit a live bucket of a well-formed table.
        assert!(patched > 3_000, "only {patched} in-place releases");
    }
}

//! The shared prefix index: which endpoint holds which prompt block.
//!
//! Bounded: the index is `shards` fixed-size values of [`SHARD_BYTES`] under
//! `kvroute/ix/<n>`, with `shards = indexBudgetBytes / SHARD_BYTES`, so it
//! never holds more than the budget, however many prompts arrive. A shard is
//! a set-associative table of 16-byte entries
//! `(block hash u64, slot u16, generation u16, recorded u32)`; a full set
//! overwrites one of its ways. An entry's set is chosen by its block hash
//! *and* its endpoint, with two choices: a block every endpoint holds (a
//! shared system prompt) has one entry per endpoint, so one set per block
//! could name only [`WAYS`] of them (see [`sets_of`]). For the same reason
//! a shard holds one group's entries for one stripe of eight endpoint
//! slots only ([`STRIPE_SLOTS`]): a fleet of more endpoints spreads a
//! shared prefix over one shard per stripe.
//!
//! Eviction-aware: every endpoint has an insert counter (blocks newly
//! inserted for it, in the load table). An entry records the counter after
//! its insert, and is *held* while `counter − recorded < capacity` (capacity
//! in blocks; 0 = unknown, then an entry is held until overwritten). That
//! mimics vLLM's LRU without deleting anything, which shared data cannot do.
//!
//! Cheap: blocks are grouped by [`GROUP_BLOCKS`] consecutive blocks, and a
//! group lives in the shard chosen by the hashes of its first and last
//! block ([`group_key`]; a prompt's final, partial group by its first) and
//! the stripe, so one
//! read-modify-write covers a group and shared prefixes land in the same
//! shards. Block hashes are chained, so "endpoint holds block i" is nearly
//! monotone in i, and the longest held prefix is found by a binary search
//! over groups ([`last_held`]): about log2(groups) + 1 shard reads per
//! stripe the holders fall in, not one per block.

use crate::cas::{update_bytes, Updated};
use crate::{Store, StoreError};

/// Bytes per shard value.
pub const SHARD_BYTES: usize = 4096;
/// Bytes per entry.
pub const ENTRY_BYTES: usize = 16;
/// Entries per set.
pub const WAYS: usize = 4;
/// Sets per shard.
pub const SETS: usize = SHARD_BYTES / ENTRY_BYTES / WAYS;
/// Consecutive blocks that share a shard: 8.
///
/// A group lived in the shard of its first block's hash, so every prompt
/// that shares a group's first block wrote that group into one shard of
/// 256 entries. When a shared prefix (a system prompt) ends inside a group,
/// the private blocks of every session or question that follows it landed
/// in that one shard (now a whole group is keyed by its last block too:
/// [`group_key`]). With 32-block groups a session brought up to 31 private
/// blocks there: 32 agent sessions overflowed its sets, random ways were
/// overwritten, the binary search below met holes, and sessions lost their
/// affinity (the simulator's agent-session fell well short of its hit-ratio
/// ceiling, and 8-block groups brought it close;
/// `docs/lab/2026-12-02-index-fixes.md`). With 8 a session brings at most 7.
/// The price is more shard round trips for long new prompts (one
/// read-modify-write per 8 blocks, 512 bytes of text at 16-token blocks);
/// lookups stay about log2(groups) + 1 reads per stripe ([`last_held`]).
pub const GROUP_BLOCKS: usize = 8;

/// Endpoint slots per stripe: a group's entries for slots `8k..8k+7` live
/// in the group's shard for stripe `k` ([`stripe_of`]).
///
/// A block every endpoint holds (a shared system prompt) has one entry per
/// endpoint, and a shard holds `SHARD_BYTES / ENTRY_BYTES` = 256 entries in
/// 64 sets of [`WAYS`]: a group of [`GROUP_BLOCKS`] blocks held by E
/// endpoints is 8·E entries. In one shard per group, a group held by more
/// than ~24 endpoints overwrote its own entries, holders read as cold, and
/// sessions lost their server (the simulator's agent-session, 4 sessions
/// per server: 0.90 of the hit-ratio ceiling on 32 servers, 0.37 on 64).
/// Sixteen per stripe (128 entries, two per set on average) still let the
/// fullest of the two-choice sets overflow now and then (the unit test
/// `a_prefix_held_by_every_endpoint_of_a_large_fleet_is_found_for_each`:
/// 2 of 128 holders short in 20 seeds); eight keep one group's shared
/// blocks to a quarter of a shard. Fleets of
/// up to 8 endpoints use stripe 0 only, one shard per group as before;
/// larger ones read one shard per group and stripe their holders fall in.
pub const STRIPE_SLOTS: u16 = 8;

/// What picks group `g`'s shard: for a whole group (all
/// [`GROUP_BLOCKS`] of its blocks in the prompt), the hashes of its first
/// and last block; for a prompt's final, partial group, its first block's
/// ([`partial_group_key`]).
///
/// Chosen by the first block alone, every prompt that shares a group's
/// first block shares its shard: where a system prompt ends inside a
/// group, the private blocks that follow it, up to 7 per session, of every
/// session on the stripe's endpoints went to that one shard of 256 entries.
/// It overflowed, sessions read a hole there, and the search over groups
/// stopped at it (the simulator's agent-session on 4 servers with a
/// 2000-token system prompt: 0.92 of the hit-ratio ceiling with 128
/// sessions at once, 0.90 with 256). With its last block in the key, a
/// whole group is as private as its last block. A final group is keyed by
/// its first block so that the next turn of a conversation, which makes it
/// whole, still finds it ([`longest_prefixes`] reads that shard where a
/// match ends at a group's start). The price: a prompt that parts inside
/// a whole group from what an endpoint holds (a new question after a
/// shared system prompt) matches only the whole groups before it, at most
/// 7 blocks short.
pub fn group_key(hashes: &[u64], g: usize) -> u64 {
    let first = g * GROUP_BLOCKS;
    let last = first + GROUP_BLOCKS - 1;
    match (hashes.get(first), hashes.get(last)) {
        (Some(&a), Some(&b)) => a ^ b.rotate_left(17),
        _ => partial_group_key(hashes, g),
    }
}

/// Blocks just past a match of `matched` blocks (of a `total`-block prompt)
/// that the index cannot look up, so may be held although the match stops
/// short of them: where the match ends at the start of a whole group, that
/// group is keyed by its last block ([`group_key`]), which a prompt that
/// parts from the held prefix inside the group (a new question after a
/// shared system prompt) does not share. Up to `GROUP_BLOCKS − 1` (the
/// group's last block differs, or the match would have covered it); 0 when
/// the match ends inside a group (its blocks were read one by one), at the
/// prompt's end, or before a final partial group (keyed by its first block,
/// so read), and for an empty match (nothing held).
pub fn unresolved_after(matched: u32, total: usize) -> u32 {
    let m = matched as usize;
    let whole_next = (m / GROUP_BLOCKS + 1) * GROUP_BLOCKS <= total;
    if m == 0 || !m.is_multiple_of(GROUP_BLOCKS) || m >= total || !whole_next {
        return 0;
    }
    (GROUP_BLOCKS - 1) as u32
}

/// The key a partial group is written under: its first block's hash.
pub fn partial_group_key(hashes: &[u64], g: usize) -> u64 {
    hashes.get(g * GROUP_BLOCKS).copied().unwrap_or(0)
}

/// The stripe of an endpoint slot (see [`STRIPE_SLOTS`]).
pub fn stripe_of(slot: u16) -> usize {
    usize::from(slot / STRIPE_SLOTS)
}

/// Shard layout derived from the byte budget.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IndexGeometry {
    pub shards: u32,
}

impl IndexGeometry {
    /// As many shards as fit in `budget_bytes` (at least one).
    pub fn from_budget(budget_bytes: u64) -> Self {
        let shards = (budget_bytes / SHARD_BYTES as u64).clamp(1, u64::from(u32::MAX)) as u32;
        IndexGeometry { shards }
    }

    /// Most bytes the index can occupy.
    pub fn max_bytes(&self) -> u64 {
        u64::from(self.shards) * SHARD_BYTES as u64
    }

    /// The shard of a group (by its [`group_key`] or
    /// [`partial_group_key`]) for the endpoints of one [`stripe_of`]
    /// stripe. Stripe 0 (slots below [`STRIPE_SLOTS`], every endpoint of a
    /// fleet that small) is the key's own shard.
    fn shard_key(&self, group: u64, stripe: usize) -> String {
        let h = if stripe == 0 {
            group
        } else {
            group ^ (stripe as u64).wrapping_mul(0xD6E8_FEB8_6659_FD93)
        };
        shard_key_string(mix(h) % u64::from(self.shards))
    }
}

/// The shared-data key of shard `n`.
pub fn shard_key_of(n: u32) -> String {
    shard_key_string(u64::from(n))
}

/// `kvroute/ix/<n>`, written digit by digit: under V8, `format!` of the
/// one or two keys a request reads showed in the module's time per request
/// (a `node --cpu-prof` of the steps program; the figure:
/// `docs/lab/2026-12-06-measurements-from-code-comments.md`).
fn shard_key_string(mut n: u64) -> String {
    const PREFIX: &str = "kvroute/ix/";
    let mut digits = [0u8; 20];
    let mut first = digits.len();
    loop {
        first -= 1;
        digits[first] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    let mut key = String::with_capacity(PREFIX.len() + digits.len() - first);
    key.push_str(PREFIX);
    key.extend(digits[first..].iter().map(|&d| char::from(d)));
    key
}

/// Entries in use in one shard value (hash not 0), for the occupancy gauge
/// (`kvroute_index_used_bytes` = entries × [`ENTRY_BYTES`]). A short or
/// missing value counts what it has.
pub fn used_entries(shard: &[u8]) -> u32 {
    shard
        .chunks_exact(ENTRY_BYTES)
        .filter(|e| e[..8] != [0u8; 8])
        .count() as u32
}

/// An endpoint as the index sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Holder {
    pub slot: u16,
    pub generation: u16,
    /// The endpoint's insert counter now (blocks).
    pub insert_counter: u64,
    /// Blocks the endpoint can hold; 0 = unknown.
    pub capacity_blocks: u64,
}

/// How far ahead of its endpoint's counter an entry may be recorded and
/// still count as just written (age 0). An entry is ahead when a request
/// routed before it was rejected by the server and its blocks were taken
/// back off the counter ([`crate::load::LoadTable::undo`]); it is never
/// ahead by more than the blocks of the requests rejected while it was
/// being written, far below this.
pub const AHEAD_WINDOW: u32 = 1 << 24;

impl Holder {
    /// Is an entry written for this holder still held? Its age is
    /// `counter − recorded` in 32-bit arithmetic; an entry recorded up to
    /// [`AHEAD_WINDOW`] ahead of the counter has age 0.
    pub fn holds(&self, slot: u16, generation: u16, recorded: u32) -> bool {
        slot == self.slot
            && generation == self.generation
            && (self.capacity_blocks == 0
                || self.capacity_blocks >= u64::from(u32::MAX / 2)
                || u64::from(age(self.insert_counter, recorded)) < self.capacity_blocks)
    }
}

/// An entry's age in blocks: how far its endpoint's counter has moved
/// since it was recorded; 0 if it was recorded ahead of the counter (see
/// [`AHEAD_WINDOW`]).
pub fn age(insert_counter: u64, recorded: u32) -> u32 {
    let a = (insert_counter as u32).wrapping_sub(recorded);
    if a > u32::MAX - AHEAD_WINDOW {
        0
    } else {
        a
    }
}

fn mix(h: u64) -> u64 {
    // splitmix64 finaliser: spreads chained hashes over shards and sets.
    let mut z = h;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The two sets an entry for block hash `h` held by endpoint `slot` may
/// live in; a lookup reads both, an insert fills the emptier.
///
/// Chosen by the hash alone, every endpoint's entry for one block shared
/// one set of [`WAYS`]: a block more than four endpoints held (a system
/// prompt on an 8-server fleet) overwrote its entries in turn, an endpoint
/// whose block-0 entry was gone read as cold, and sticky sessions moved
/// (the simulator's agent-session on 8 servers fell short of its hit-ratio
/// ceiling; `docs/lab/2026-12-02-index-fixes.md`). Mixing in the
/// slot spreads one block's entries over the shard; two choices keep the
/// fullest set near the mean. A shard holds at most
/// `SHARD_BYTES / ENTRY_BYTES` = 256 entries, so a group's entries are
/// also split by endpoint stripe over shards ([`STRIPE_SLOTS`]).
fn sets_of(h: u64, slot: u16) -> [usize; 2] {
    let z = mix(h.rotate_left(29) ^ (u64::from(slot) + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15));
    [
        (z % SETS as u64) as usize,
        ((z >> 32) % SETS as u64) as usize,
    ]
}

/// The shard positions of the two sets of [`sets_of`], the first set's first.
fn ways_of(h: u64, slot: u16) -> impl Iterator<Item = usize> {
    sets_of(h, slot)
        .into_iter()
        .flat_map(|set| (0..WAYS).map(move |w| set * WAYS + w))
}

/// Hash 0 marks an empty entry, so a real 0 is stored as 1.
fn key_hash(h: u64) -> u64 {
    if h == 0 {
        1
    } else {
        h
    }
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Entry {
    hash: u64,
    slot: u16,
    generation: u16,
    recorded: u32,
}

fn read_entry(shard: &[u8], i: usize) -> Entry {
    let o = i * ENTRY_BYTES;
    let b = |r: std::ops::Range<usize>| shard.get(o + r.start..o + r.end);
    let u64_at = |r| {
        b(r).and_then(|s| s.try_into().ok())
            .map(u64::from_le_bytes)
            .unwrap_or(0)
    };
    let u16_at = |r| {
        b(r).and_then(|s| s.try_into().ok())
            .map(u16::from_le_bytes)
            .unwrap_or(0)
    };
    let u32_at = |r| {
        b(r).and_then(|s| s.try_into().ok())
            .map(u32::from_le_bytes)
            .unwrap_or(0)
    };
    Entry {
        hash: u64_at(0..8),
        slot: u16_at(8..10),
        generation: u16_at(10..12),
        recorded: u32_at(12..16),
    }
}

fn write_entry(shard: &mut [u8], i: usize, e: Entry) {
    let o = i * ENTRY_BYTES;
    if let Some(dst) = shard.get_mut(o..o + ENTRY_BYTES) {
        dst[0..8].copy_from_slice(&e.hash.to_le_bytes());
        dst[8..10].copy_from_slice(&e.slot.to_le_bytes());
        dst[10..12].copy_from_slice(&e.generation.to_le_bytes());
        dst[12..16].copy_from_slice(&e.recorded.to_le_bytes());
    }
}

/// Result of a lookup.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Matches {
    /// Per holder (same order): blocks held from block 0.
    pub matched_blocks: Vec<u32>,
    /// Per holder: the `recorded` counter of its entry for block 0, if it
    /// holds block 0 (see [`refresh_due`]).
    pub first_recorded: Vec<Option<u32>>,
    /// Shard values read.
    pub shard_reads: u32,
    /// The shard values read, by group (`None`: not read, or the key did
    /// not exist), with their CAS tokens: [`insert`] starts from them
    /// instead of reading the shard again.
    pub shards: ShardReads,
}

/// Shard values a lookup read, with their CAS tokens, by group index and
/// endpoint stripe ([`STRIPE_SLOTS`]).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ShardReads {
    stripes: usize,
    reads: Vec<Option<(Vec<u8>, u32)>>,
}

impl ShardReads {
    /// Takes the read of `group`'s shard for `stripe`, if the lookup made it.
    fn take(&mut self, group: usize, stripe: usize) -> Option<(Vec<u8>, u32)> {
        if stripe >= self.stripes {
            return None;
        }
        self.reads
            .get_mut(group * self.stripes + stripe)
            .and_then(Option::take)
    }
}

/// Finds, for each holder, the longest run of `hashes` from block 0 it holds.
pub fn longest_prefixes(
    store: &dyn Store,
    geo: &IndexGeometry,
    hashes: &[u64],
    holders: &[Holder],
) -> Result<Matches, StoreError> {
    let n = hashes.len();
    let mut out = Matches {
        matched_blocks: vec![0; holders.len()],
        first_recorded: vec![None; holders.len()],
        shard_reads: 0,
        shards: ShardReads::default(),
    };
    if n == 0 || holders.is_empty() {
        return Ok(out);
    }
    let groups = n.div_ceil(GROUP_BLOCKS);
    let stripes = holders.iter().map(|h| stripe_of(h.slot)).max().unwrap_or(0) + 1;
    // Per group and stripe: not read yet (None), or (bytes, CAS token if
    // the key exists).
    let mut shards: Vec<Option<(Vec<u8>, Option<u32>)>> = vec![None; groups * stripes];
    // The same for whole groups' partial-group shards (the shard a shorter
    // prompt wrote the group to when it was its final group).
    let mut partial: Vec<Option<Vec<u8>>> = vec![None; groups * stripes];
    let whole = |g: usize| (g + 1) * GROUP_BLOCKS <= n;
    let mut held = |h: &Holder,
                    i: usize,
                    as_partial: bool,
                    out: &mut Matches|
     -> Result<Option<u32>, StoreError> {
        let g = i / GROUP_BLOCKS;
        let stripe = stripe_of(h.slot);
        let at = g * stripes + stripe;
        let shard = if as_partial {
            if partial[at].is_none() {
                let key = geo.shard_key(partial_group_key(hashes, g), stripe);
                out.shard_reads += 1;
                partial[at] = Some(store.get(&key)?.map(|(v, _)| v).unwrap_or_default());
            }
            partial[at].as_deref().unwrap_or(&[])
        } else {
            if shards[at].is_none() {
                let key = geo.shard_key(group_key(hashes, g), stripe);
                out.shard_reads += 1;
                shards[at] = Some(match store.get(&key)? {
                    Some((v, cas)) => (v, Some(cas)),
                    None => (Vec::new(), None),
                });
            }
            shards[at].as_ref().map_or(&[][..], |(v, _)| v.as_slice())
        };
        let hash = key_hash(hashes[i]);
        Ok(ways_of(hash, h.slot)
            .map(|i| read_entry(shard, i))
            .find(|e| e.hash == hash && h.holds(e.slot, e.generation, e.recorded))
            .map(|e| e.recorded))
    };
    for (k, h) in holders.iter().enumerate() {
        // Blocks held from block 0 in whole groups' own shards, then the
        // rest of the group where that run ends, from its partial-group
        // shard: an earlier, shorter prompt's final group. Not for group 0:
        // a prompt shorter than one group is not worth a read per endpoint
        // that holds nothing.
        let Some(first) = held(h, 0, false, &mut out)? else {
            continue;
        };
        out.first_recorded[k] = Some(first);
        let mut matched = last_held(n, |i| Ok(held(h, i, false, &mut out)?.is_some()))? + 1;
        if matched % GROUP_BLOCKS == 0 && matched < n && whole(matched / GROUP_BLOCKS) {
            let start = matched;
            while matched < start + GROUP_BLOCKS - 1 && held(h, matched, true, &mut out)?.is_some()
            {
                matched += 1;
            }
        }
        out.matched_blocks[k] = matched as u32;
    }
    out.shards = ShardReads {
        stripes,
        reads: shards
            .into_iter()
            .map(|r| r.and_then(|(v, cas)| Some((v, cas?))))
            .collect(),
    };
    Ok(out)
}

/// The last held block of an `n`-block prompt whose block 0 is held, by a
/// binary search over [`GROUP_BLOCKS`] groups rather than blocks. Each probe
/// is the last block of the group holding the unresolved range's middle
/// block, and the group it reads is then resolved in full for free (its
/// shard is in hand): a boundary
/// inside a group costs a read of that group alone, where a search over
/// blocks also read the next group. On a holder whose held blocks are a
/// prefix (chained hashes make this the rule) it finds the same block as a
/// search over blocks; in any case the block it returns is held and the
/// next one is not (or is past the end).
fn last_held(
    n: usize,
    mut held: impl FnMut(usize) -> Result<bool, StoreError>,
) -> Result<usize, StoreError> {
    // Invariant: block `lo` is held, and `hi + 1` is not (or is past the end).
    let (mut lo, mut hi) = (0usize, n.saturating_sub(1));
    loop {
        // Forward within lo's group, whose shard is read.
        let group_end = ((lo / GROUP_BLOCKS + 1) * GROUP_BLOCKS - 1).min(hi);
        while lo < group_end && held(lo + 1)? {
            lo += 1;
        }
        if lo < group_end || lo >= hi {
            return Ok(lo);
        }
        // lo ends its group: probe the last block of the group holding the
        // middle block.
        let g = (lo + hi).div_ceil(2) / GROUP_BLOCKS;
        let probe = ((g + 1) * GROUP_BLOCKS - 1).min(hi);
        if held(probe)? {
            lo = probe;
            continue;
        }
        // Backward within the probe's group, now read: its last held block.
        hi = probe - 1;
        let start = (g * GROUP_BLOCKS).max(lo + 1);
        while hi >= start && !held(hi)? {
            hi -= 1;
        }
        if hi >= start {
            return Ok(hi);
        }
    }
}

/// Should a holder's already-held prefix be written again, to refresh its
/// entries' `recorded` counter? vLLM's cache is LRU: a hit keeps blocks warm.
/// Rewriting held blocks on every hit is what made inserts dear (one shard
/// read-modify-write per group, every request), so they are refreshed
/// only once they have aged half the endpoint's capacity (`first_recorded`
/// from [`Matches`], the block-0 entry, is the oldest of a prefix written
/// in order). With capacity unknown (0) entries never age, so no refresh.
pub fn refresh_due(holder: &Holder, first_recorded: Option<u32>) -> bool {
    let Some(recorded) = first_recorded else {
        return true;
    };
    if holder.capacity_blocks == 0 || holder.capacity_blocks >= u64::from(u32::MAX / 2) {
        return false;
    }
    let age = u64::from(age(holder.insert_counter, recorded));
    age >= holder.capacity_blocks / 2
}

/// How many leading blocks of a `total`-block prompt an insert may skip:
/// the [`GROUP_BLOCKS`] groups wholly inside the `matched` prefix the holder
/// already holds (all of them if it holds the whole prompt), unless they
/// are due for a refresh. [`insert`] rounds it down to a whole group, so
/// the group holding the first new block is written in full.
pub fn insert_skip(
    holder: &Holder,
    matched: u32,
    total: usize,
    first_recorded: Option<u32>,
) -> usize {
    if refresh_due(holder, first_recorded) {
        return 0;
    }
    let matched = matched as usize;
    if matched >= total {
        return total;
    }
    matched / GROUP_BLOCKS * GROUP_BLOCKS
}

/// Counts of an insert.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct InsertStats {
    pub shard_writes: u32,
    pub cas_retries: u32,
}

/// Records that `holder` holds every block in `hashes` from block `skip`
/// on (`skip` is rounded down to a whole group unless it covers the whole
/// prompt; see [`insert_skip`]), with
/// the holder's insert counter as it is *after* this request's charge.
/// `is_live(slot, generation, recorded)` says whether another endpoint's
/// entry is still held; dead entries are overwritten first. A group whose
/// entries are already exactly as they would be written is not written.
pub fn insert(
    store: &dyn Store,
    geo: &IndexGeometry,
    hashes: &[u64],
    skip: usize,
    holder: &Holder,
    is_live: &dyn Fn(u16, u16, u32) -> bool,
) -> Result<InsertStats, StoreError> {
    insert_seeded(
        store,
        geo,
        hashes,
        skip,
        holder,
        is_live,
        ShardReads::default(),
    )
}

/// [`insert`], starting each group's read-modify-write from the shard the
/// lookup read for it ([`Matches::shards`]), if any: one get less per such
/// group when nobody wrote the shard in between (a lost race re-reads).
pub fn insert_seeded(
    store: &dyn Store,
    geo: &IndexGeometry,
    hashes: &[u64],
    skip: usize,
    holder: &Holder,
    is_live: &dyn Fn(u16, u16, u32) -> bool,
    mut reads: ShardReads,
) -> Result<InsertStats, StoreError> {
    let mut stats = InsertStats::default();
    let recorded = holder.insert_counter as u32;
    let from = if skip >= hashes.len() {
        hashes.len()
    } else {
        skip / GROUP_BLOCKS * GROUP_BLOCKS
    };
    let stripe = stripe_of(holder.slot);
    for (i, group) in hashes[from..].chunks(GROUP_BLOCKS).enumerate() {
        let key = geo.shard_key(group_key(&hashes[from..], i), stripe);
        let seed = reads.take(from / GROUP_BLOCKS + i, stripe);
        let Updated { result, retries } = update_bytes(
            store,
            &key,
            seed,
            || vec![0; SHARD_BYTES],
            |shard| shard.resize(SHARD_BYTES, 0),
            |shard| {
                let mut changed = false;
                for &h in group {
                    changed |= upsert(shard, key_hash(h), holder, recorded, is_live);
                }
                changed.then_some(())
            },
        )?;
        stats.shard_writes += u32::from(result.is_some());
        stats.cas_retries += retries;
    }
    Ok(stats)
}

/// Takes back what [`insert`] wrote for a request the server rejected:
/// every entry for `holder` of a block of `hashes` from block `from` on
/// that is still exactly as that insert wrote it (`recorded`) is cleared.
/// Entries rewritten since (another request's insert, an LRU refresh) and
/// the blocks before `from` (held before the request came) stay. What the
/// insert overwrote in a full set is not brought back: it was an entry the
/// set's eviction chose, as any other insert's would be. Returns the
/// entries cleared and the CAS races lost.
pub fn remove(
    store: &dyn Store,
    geo: &IndexGeometry,
    hashes: &[u64],
    from: usize,
    holder: &Holder,
    recorded: u32,
) -> Result<(u32, u32), StoreError> {
    let (mut cleared, mut retries) = (0u32, 0u32);
    if from >= hashes.len() {
        return Ok((0, 0));
    }
    let start = from / GROUP_BLOCKS * GROUP_BLOCKS;
    let stripe = stripe_of(holder.slot);
    for (i, group) in hashes[start..].chunks(GROUP_BLOCKS).enumerate() {
        let first = start + i * GROUP_BLOCKS;
        let own = &group[from.saturating_sub(first).min(group.len())..];
        let key = geo.shard_key(group_key(&hashes[start..], i), stripe);
        let Updated { result, retries: r } = update_bytes(
            store,
            &key,
            None,
            || vec![0; SHARD_BYTES],
            |shard| shard.resize(SHARD_BYTES, 0),
            |shard| {
                let mut n = 0u32;
                for &h in own {
                    let hash = key_hash(h);
                    let mine = Entry {
                        hash,
                        slot: holder.slot,
                        generation: holder.generation,
                        recorded,
                    };
                    for set in sets_of(hash, holder.slot) {
                        for k in set * WAYS..(set + 1) * WAYS {
                            if read_entry(shard, k) == mine {
                                write_entry(shard, k, Entry::default());
                                n += 1;
                            }
                        }
                    }
                }
                (n > 0).then_some(n)
            },
        )?;
        cleared += result.unwrap_or(0);
        retries += r;
    }
    Ok((cleared, retries))
}

/// Writes one entry; returns false if it was already there as written.
fn upsert(
    shard: &mut [u8],
    hash: u64,
    holder: &Holder,
    recorded: u32,
    is_live: &dyn Fn(u16, u16, u32) -> bool,
) -> bool {
    let sets = sets_of(hash, holder.slot);
    let at: [usize; 2 * WAYS] = std::array::from_fn(|k| sets[k / WAYS] * WAYS + k % WAYS);
    let entries: [Entry; 2 * WAYS] = std::array::from_fn(|k| read_entry(shard, at[k]));
    let free: [bool; 2 * WAYS] = std::array::from_fn(|k| {
        let e = entries[k];
        e.hash == 0 || !is_live(e.slot, e.generation, e.recorded)
    });
    // Free ways of the set with more of them first (two choices); when the
    // two sets coincide the second half repeats the first, harmlessly.
    let frees = |half: usize| {
        free[half * WAYS..(half + 1) * WAYS]
            .iter()
            .filter(|&&f| f)
            .count()
    };
    let order = if frees(1) > frees(0) { [1, 0] } else { [0, 1] };
    let k = entries
        .iter()
        .position(|e| e.hash == hash && e.slot == holder.slot)
        .or_else(|| {
            order
                .iter()
                .flat_map(|&half| half * WAYS..(half + 1) * WAYS)
                .find(|&k| free[k])
        })
        .unwrap_or(((mix(hash ^ u64::from(recorded)) >> 40) % (2 * WAYS) as u64) as usize);
    let entry = Entry {
        hash,
        slot: holder.slot,
        generation: holder.generation,
        recorded,
    };
    if entries[k] == entry {
        return false;
    }
    write_entry(shard, at[k], entry);
    true
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::MemoryStore;

    #[test]
    fn used_entries_counts_non_empty_entries() {
        let mut shard = vec![0u8; SHARD_BYTES];
        assert_eq!(used_entries(&shard), 0);
        for i in [0, 7, SHARD_BYTES / ENTRY_BYTES - 1] {
            write_entry(
                &mut shard,
                i,
                Entry {
                    hash: 1,
                    slot: 0,
                    generation: 1,
                    recorded: 0,
                },
            );
        }
        assert_eq!(used_entries(&shard), 3);
        assert_eq!(
            used_entries(&shard[..20]),
            1,
            "a short value counts whole entries"
        );
    }

    fn chain(seed: u64, n: usize) -> Vec<u64> {
        let mut v = Vec::with_capacity(n);
        let mut h = seed;
        for i in 0..n {
            h = mix(h ^ (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15));
            v.push(h);
        }
        v
    }

    fn holder(slot: u16, counter: u64, cap: u64) -> Holder {
        Holder {
            slot,
            generation: 1,
            insert_counter: counter,
            capacity_blocks: cap,
        }
    }

    const ALWAYS: &dyn Fn(u16, u16, u32) -> bool = &|_, _, _| true;

    #[test]
    fn longest_prefix_per_endpoint() {
        let s = MemoryStore::new();
        let geo = IndexGeometry::from_budget(1 << 20);
        let a = chain(1, 100);
        insert(&s, &geo, &a[..60], 0, &holder(0, 60, 0), ALWAYS).unwrap();
        insert(&s, &geo, &a[..25], 0, &holder(1, 25, 0), ALWAYS).unwrap();
        let m = longest_prefixes(
            &s,
            &geo,
            &a,
            &[holder(0, 60, 0), holder(1, 25, 0), holder(2, 0, 0)],
        )
        .unwrap();
        // The inserted prompts' final groups (blocks 56..59 and 24) are
        // found in their partial-group shards.
        assert_eq!(m.matched_blocks, vec![60, 25, 0]);
        // ~log2(100) probes per warm endpoint, shards memoised per group,
        // and one partial-group shard each where their matches ended.
        assert!(m.shard_reads <= 10, "{}", m.shard_reads);
        // The same prompts again are found in full.
        for (h, n) in [(holder(0, 60, 0), 60), (holder(1, 25, 0), 25)] {
            let m = longest_prefixes(&s, &geo, &a[..n], &[h]).unwrap();
            assert_eq!(m.matched_blocks, vec![n as u32]);
        }
        // Another prompt sharing the first 30 blocks.
        let mut b = a[..30].to_vec();
        b.extend(chain(99, 40));
        let m = longest_prefixes(&s, &geo, &b, &[holder(0, 60, 0), holder(1, 25, 0)]).unwrap();
        // b's group 3 (blocks 24..31) ends in its own blocks, so it is
        // keyed apart from a's whole group 3 (`group_key`): endpoint 0
        // matches the whole groups before it. Endpoint 1's a[..25] ended
        // in that group, whose partial-group shard has block 24.
        assert_eq!(m.matched_blocks, vec![24, 25]);
    }

    /// The groups a search touches, each one a shard read.
    fn groups_touched(n: usize, held: impl Fn(usize) -> bool, search: Search) -> (usize, usize) {
        let mut touched = std::collections::BTreeSet::from([0]);
        let mut probe = |i: usize| {
            touched.insert(i / GROUP_BLOCKS);
            Ok(held(i))
        };
        let last = match search {
            Search::Groups => last_held(n, probe).unwrap(),
            Search::Blocks => {
                // The search over blocks that `last_held` replaced.
                let (mut lo, mut hi) = (0usize, n - 1);
                while lo < hi {
                    let mid = (lo + hi).div_ceil(2);
                    if probe(mid).unwrap() {
                        lo = mid;
                    } else {
                        hi = mid - 1;
                    }
                }
                lo
            }
        };
        (last, touched.len())
    }

    #[derive(Clone, Copy)]
    enum Search {
        Groups,
        Blocks,
    }

    /// On every held prefix of prompts up to 6 groups long, the search over
    /// groups finds what the search over blocks found. For each prompt
    /// length its worst case reads no more groups, and over all cases it
    /// reads fewer (a boundary inside a group no longer reads the next one;
    /// it can read one more than the block search where that search's first
    /// probes happened to land in one group).
    #[test]
    fn search_over_groups_finds_the_same_prefix_with_fewer_reads() {
        let (mut reads_groups, mut reads_blocks) = (0, 0);
        for n in 1..=6 * GROUP_BLOCKS {
            let (mut worst_groups, mut worst_blocks) = (0, 0);
            for m in 1..=n {
                let held = |i: usize| i < m;
                let (a, ra) = groups_touched(n, held, Search::Groups);
                let (b, rb) = groups_touched(n, held, Search::Blocks);
                assert_eq!((a, b), (m - 1, m - 1), "n {n}, held {m}");
                worst_groups = worst_groups.max(ra);
                worst_blocks = worst_blocks.max(rb);
                reads_groups += ra;
                reads_blocks += rb;
            }
            assert!(
                worst_groups <= worst_blocks,
                "n {n}: {worst_groups} > {worst_blocks}"
            );
        }
        // 2,780 against 3,352.
        assert!(
            reads_groups * 100 < reads_blocks * 85,
            "{reads_groups} vs {reads_blocks} reads"
        );
    }

    /// With holes (entries overwritten), the block found is held and the
    /// next one is not: a boundary, as the search over blocks gave.
    #[test]
    fn search_over_groups_with_holes_ends_on_a_boundary() {
        for n in 1..=5 * GROUP_BLOCKS {
            for seed in 0..200u64 {
                let held = |i: usize| {
                    i == 0 || !mix(seed ^ ((i as u64) << 20) ^ n as u64).is_multiple_of(4)
                };
                let (last, reads) = groups_touched(n, held, Search::Groups);
                assert!(held(last), "n {n} seed {seed}");
                assert!(last + 1 == n || !held(last + 1), "n {n} seed {seed}");
                assert!(reads <= n.div_ceil(GROUP_BLOCKS));
            }
        }
    }

    /// Prompts that part from what their endpoint holds inside a group, and
    /// at a group's end.
    #[test]
    fn prompts_that_part_inside_a_group_match_its_whole_groups() {
        let s = MemoryStore::new();
        let geo = IndexGeometry::from_budget(1 << 20);
        let a = chain(3, 32);
        insert(&s, &geo, &a, 0, &holder(0, 32, 0), ALWAYS).unwrap();
        let mut b = a[..21].to_vec();
        b.extend(chain(4, 10));
        // b's group 2 (blocks 16..23) ends in a block a's does not have, so
        // it is keyed apart (`group_key`): nothing of it is found, and the
        // match stops at the whole groups before it.
        let m = longest_prefixes(&s, &geo, &b, &[holder(0, 32, 0)]).unwrap();
        assert_eq!(m.matched_blocks, vec![16]);
        // Where the prompts part at a group's end, the boundary is exact,
        // and found reading group 0 and the group after the boundary.
        let mut c = a[..24].to_vec();
        c.extend(chain(5, 7));
        let m = longest_prefixes(&s, &geo, &c, &[holder(0, 32, 0)]).unwrap();
        assert_eq!(m.matched_blocks, vec![24]);
        assert!(m.shard_reads <= 3, "{}", m.shard_reads);
        // b's match (16, the start of a whole group) may be 7 blocks short:
        // the true 21 is within it. c's (24) is exact: the group after it is
        // c's final, partial one, read by its first block.
        assert_eq!(unresolved_after(16, b.len()), 7);
        assert!(16 + unresolved_after(16, b.len()) >= 21);
        assert_eq!(unresolved_after(24, c.len()), 0);
    }

    #[test]
    fn unresolved_blocks_only_where_a_match_ends_before_a_whole_group() {
        assert_eq!(unresolved_after(0, 100), 0, "nothing held");
        assert_eq!(unresolved_after(88, 112), 7, "the shared-prefix case");
        assert_eq!(unresolved_after(90, 112), 0, "ended inside a group");
        assert_eq!(unresolved_after(112, 112), 0, "the whole prompt");
        assert_eq!(
            unresolved_after(104, 110),
            0,
            "a final partial group is read"
        );
        assert_eq!(unresolved_after(104, 112), 7, "a final whole group is not");
    }

    /// A prefix every endpoint of a large fleet holds (a shared system
    /// prompt) is found for each of them. With one set per block hash only
    /// `WAYS` endpoints' entries fit; the rest were overwritten and their
    /// endpoints read as cold. With one shard per group (no stripes), 32
    /// endpoints already lost entries. The budget is the default's 64 MiB:
    /// with few shards, two groups' stripes share one now and then.
    #[test]
    fn a_prefix_held_by_every_endpoint_of_a_large_fleet_is_found_for_each() {
        for endpoints in [8u16, 16, 32, 64, 128] {
            for seed in 0..20 {
                let s = MemoryStore::new();
                let geo = IndexGeometry::from_budget(64 << 20);
                let a = chain(1000 + seed, 4 * GROUP_BLOCKS);
                let holders: Vec<Holder> = (0..endpoints).map(|e| holder(e, 40, 0)).collect();
                // Inserted in turn, twice (each request rewrites its prefix).
                for _ in 0..2 {
                    for h in &holders {
                        insert(&s, &geo, &a, 0, h, ALWAYS).unwrap();
                    }
                }
                let m = longest_prefixes(&s, &geo, &a, &holders).unwrap();
                assert_eq!(
                    m.matched_blocks,
                    vec![a.len() as u32; endpoints as usize],
                    "{endpoints} endpoints, chain seed {seed}"
                );
                // The price: a stripe's holders share its shard reads, so
                // the lookup reads per stripe what one holder's search does.
                let one = longest_prefixes(&s, &geo, &a, &holders[..1]).unwrap();
                let stripes = u32::from(endpoints.div_ceil(STRIPE_SLOTS));
                assert_eq!(
                    m.shard_reads,
                    stripes * one.shard_reads,
                    "{endpoints} endpoints"
                );
            }
        }
    }

    /// Entries of other endpoints do not crowd out a live one: a session's
    /// private blocks on one endpoint survive many endpoints rewriting the
    /// shared blocks of the same group.
    #[test]
    fn shared_blocks_of_many_endpoints_leave_a_private_tail_alone() {
        let s = MemoryStore::new();
        let geo = IndexGeometry::from_budget(1 << 20);
        // 5 shared blocks and 3 private ones in the first group.
        let shared = chain(7, 5);
        let mut mine = shared.clone();
        mine.extend(chain(8, 3));
        insert(&s, &geo, &mine, 0, &holder(3, 8, 0), ALWAYS).unwrap();
        for round in 0..4u64 {
            for e in 0..12u16 {
                insert(&s, &geo, &shared, 0, &holder(e, 5 + round, 0), ALWAYS).unwrap();
            }
        }
        let m = longest_prefixes(&s, &geo, &mine, &[holder(3, 20, 0)]).unwrap();
        assert_eq!(m.matched_blocks, vec![8]);
    }

    /// A rejected request's entries are cleared; the blocks its endpoint
    /// held before it, another endpoint's entries of the same blocks and
    /// entries rewritten since stay.
    #[test]
    fn remove_clears_only_the_requests_own_entries() {
        let s = MemoryStore::new();
        let geo = IndexGeometry::from_budget(1 << 20);
        let a = chain(11, 20);
        // Endpoint 0 held the first 9 blocks (recorded 9); endpoint 1 all 20.
        insert(&s, &geo, &a[..9], 0, &holder(0, 9, 0), ALWAYS).unwrap();
        insert(&s, &geo, &a, 0, &holder(1, 20, 0), ALWAYS).unwrap();
        // The request: all 20 on endpoint 0, counter 20 after its charge.
        insert(&s, &geo, &a, 8, &holder(0, 20, 0), ALWAYS).unwrap();
        let look = |c0: u64| {
            longest_prefixes(&s, &geo, &a, &[holder(0, c0, 0), holder(1, 20, 0)])
                .unwrap()
                .matched_blocks
        };
        assert_eq!(look(20), vec![20, 20]);
        let (cleared, _) = remove(&s, &geo, &a, 9, &holder(0, 20, 0), 20).unwrap();
        assert_eq!(cleared, 11, "blocks 9..20 were the request's own");
        // Block 8 was rewritten (its group's refresh) and stays held, as do
        // the blocks before it and endpoint 1's entries.
        assert_eq!(look(9), vec![9, 20]);
        // A second removal finds nothing of its own.
        assert_eq!(remove(&s, &geo, &a, 9, &holder(0, 20, 0), 20).unwrap().0, 0);
    }

    /// An entry recorded ahead of its endpoint's counter (a request before
    /// it was rejected and taken back off the counter) is held, as just
    /// written; the window is bounded.
    #[test]
    fn entries_ahead_of_the_counter_count_as_just_written() {
        let h = |counter| holder(0, counter, 100);
        assert!(h(50).holds(0, 1, 60));
        assert_eq!(age(50, 60), 0);
        assert_eq!(age(160, 60), 100);
        assert!(!h(160).holds(0, 1, 60));
        assert!(!h(0).holds(0, 1, AHEAD_WINDOW + 1));
        assert_eq!(age(u64::from(u32::MAX) + 5, 3), 1, "the counter wraps");
    }

    #[test]
    fn eviction_by_newer_inserts() {
        let s = MemoryStore::new();
        let geo = IndexGeometry::from_budget(1 << 20);
        let a = chain(5, 10);
        insert(&s, &geo, &a, 0, &holder(0, 10, 100), ALWAYS).unwrap();
        assert_eq!(
            longest_prefixes(&s, &geo, &a, &[holder(0, 109, 100)])
                .unwrap()
                .matched_blocks,
            vec![10]
        );
        assert_eq!(
            longest_prefixes(&s, &geo, &a, &[holder(0, 110, 100)])
                .unwrap()
                .matched_blocks,
            vec![0]
        );
        // A different generation of the slot never matches.
        let other_gen = Holder {
            generation: 2,
            ..holder(0, 10, 100)
        };
        assert_eq!(
            longest_prefixes(&s, &geo, &a, &[other_gen])
                .unwrap()
                .matched_blocks,
            vec![0]
        );
    }

    #[test]
    fn bytes_stay_under_budget_for_many_distinct_prompts() {
        let s = MemoryStore::new();
        let budget = 256 << 10;
        let geo = IndexGeometry::from_budget(budget);
        for p in 0..20_000u64 {
            insert(
                &s,
                &geo,
                &chain(p + 1000, 8),
                0,
                &holder((p % 8) as u16, p, 0),
                ALWAYS,
            )
            .unwrap();
        }
        let used = s.bytes_with_prefix("kvroute/ix/") as u64;
        assert!(used <= budget, "{used} > {budget}");
        assert_eq!(used, geo.max_bytes(), "every shard touched at this volume");
    }

    #[test]
    fn held_groups_are_skipped_until_due_for_refresh() {
        const G: usize = GROUP_BLOCKS;
        let n = 2 * G + G / 2; // groups: 0..G, G..2G, 2G..n
        let nn = n as u64;
        let s = MemoryStore::new();
        let geo = IndexGeometry::from_budget(1 << 20);
        let a = chain(7, n);
        let st = insert(&s, &geo, &a, 0, &holder(0, nn, 1000), ALWAYS).unwrap();
        assert_eq!(st.shard_writes, 3);
        // Writing the same entries again changes nothing, so nothing is written.
        let st = insert(&s, &geo, &a, 0, &holder(0, nn, 1000), ALWAYS).unwrap();
        assert_eq!(st.shard_writes, 0);

        let h = holder(0, nn + 60, 1000);
        let m = longest_prefixes(&s, &geo, &a, &[h]).unwrap();
        assert_eq!(m.matched_blocks, vec![n as u32]);
        assert_eq!(m.first_recorded, vec![Some(n as u32)]);
        // Aged 60 of 1000, the last block new: only whole held groups are
        // skipped (2 groups); the group of the new block is written.
        let skip = insert_skip(&h, n as u32 - 1, n, m.first_recorded[0]);
        assert_eq!(skip, 2 * G);
        let st = insert(&s, &geo, &a, skip, &h, ALWAYS).unwrap();
        assert_eq!(st.shard_writes, 1);
        // Aged half the capacity: the whole prefix is refreshed, so it
        // survives the next half capacity of inserts, as an LRU hit would.
        let old = holder(0, nn + 500, 1000);
        let m = longest_prefixes(&s, &geo, &a, &[old]).unwrap();
        assert_eq!(m.matched_blocks, vec![n as u32]);
        assert_eq!(insert_skip(&old, n as u32, n, m.first_recorded[0]), 0);
        insert(&s, &geo, &a, 0, &old, ALWAYS).unwrap();
        let later = holder(0, nn + 1460, 1000);
        let m = longest_prefixes(&s, &geo, &a, &[later]).unwrap();
        assert_eq!(
            m.matched_blocks,
            vec![n as u32],
            "refreshed at n + 500, held until n + 1500"
        );
        // The whole prompt held and fresh: nothing is written at all.
        let st = insert(
            &s,
            &geo,
            &a,
            insert_skip(&h, n as u32, n, Some(nn as u32 + 60)),
            &h,
            ALWAYS,
        )
        .unwrap();
        assert_eq!(st.shard_writes, 0);
        // Nothing held at block 0: nothing skipped.
        assert_eq!(insert_skip(&h, 0, n, None), 0);
        // Capacity unknown: entries never age, held groups are always skipped.
        assert_eq!(
            insert_skip(&holder(0, 1 << 30, 0), n as u32 - 1, n, Some(1)),
            2 * G
        );
    }

    /// Counts gets, to see which reads an insert saves.
    struct Counting<'a>(&'a MemoryStore, std::cell::Cell<u32>);

    impl Store for Counting<'_> {
        fn get(&self, key: &str) -> Result<Option<(Vec<u8>, u32)>, StoreError> {
            self.1.set(self.1.get() + 1);
            self.0.get(key)
        }
        fn set(&self, key: &str, value: &[u8], cas: u32) -> Result<(), StoreError> {
            self.0.set(key, value, cas)
        }
    }

    #[test]
    fn insert_starts_from_the_shards_the_lookup_read() {
        let geo = IndexGeometry::from_budget(1 << 20);
        const G: usize = GROUP_BLOCKS;
        let n = 2 * G + G / 2; // 3 groups
        let a = chain(11, n);
        let holders = [holder(0, 0, 0), holder(1, G as u64, 0)];
        // Two identical stores: one insert seeded from the lookup, one not.
        let (mem, plain) = (MemoryStore::new(), MemoryStore::new());
        let mut gets = Vec::new();
        for (store, seeded) in [(&mem, true), (&plain, false)] {
            insert(store, &geo, &a[..G], 0, &holders[1], ALWAYS).unwrap();
            let s = Counting(store, Default::default());
            let m = longest_prefixes(&s, &geo, &a, &holders).unwrap();
            assert_eq!(m.matched_blocks, vec![0, G as u32]);
            let reused = m.shards.reads.iter().filter(|r| r.is_some()).count() as u32;
            assert!(reused >= 1, "group 0's shard exists and was read");
            s.1.set(0);
            let reads = if seeded {
                m.shards
            } else {
                ShardReads::default()
            };
            let me = holder(0, n as u64, 0);
            let st = insert_seeded(&s, &geo, &a, 0, &me, ALWAYS, reads).unwrap();
            assert_eq!((st.shard_writes, st.cas_retries), (3, 0));
            gets.push((s.1.get(), reused));
            let m = longest_prefixes(store, &geo, &a, &[me]).unwrap();
            assert_eq!(m.matched_blocks, vec![n as u32]);
        }
        // Every shard the lookup read is one get less for the insert.
        assert_eq!(gets[0].0 + gets[0].1, gets[1].0, "{gets:?}");

        // A seed that went stale (another worker wrote the shard since):
        // the CAS fails, the insert re-reads, and neither write is lost.
        let b = chain(12, G);
        mem.set(&geo.shard_key(group_key(&b, 0), 0), &[0; SHARD_BYTES], 0)
            .unwrap();
        let m = longest_prefixes(&mem, &geo, &b, &[holder(2, 0, 0)]).unwrap();
        assert!(m.shards.reads[0].is_some());
        insert(&mem, &geo, &b, 0, &holder(3, G as u64, 0), ALWAYS).unwrap();
        let st =
            insert_seeded(&mem, &geo, &b, 0, &holder(2, G as u64, 0), ALWAYS, m.shards).unwrap();
        assert_eq!((st.shard_writes, st.cas_retries), (1, 1));
        let m = longest_prefixes(
            &mem,
            &geo,
            &b,
            &[holder(2, G as u64, 0), holder(3, G as u64, 0)],
        )
        .unwrap();
        assert_eq!(m.matched_blocks, vec![G as u32, G as u32]);
    }

    #[test]
    fn corrupt_shards_read_as_empty() {
        let s = MemoryStore::new();
        let geo = IndexGeometry::from_budget(SHARD_BYTES as u64);
        s.set("kvroute/ix/0", b"short", 0).unwrap();
        let a = chain(3, 4);
        assert_eq!(
            longest_prefixes(&s, &geo, &a, &[holder(0, 0, 0)])
                .unwrap()
                .matched_blocks,
            vec![0]
        );
        insert(&s, &geo, &a, 0, &holder(0, 4, 0), ALWAYS).unwrap();
        assert_eq!(
            longest_prefixes(&s, &geo, &a, &[holder(0, 4, 0)])
                .unwrap()
                .matched_blocks,
            vec![4]
        );
    }

    #[test]
    fn shard_keys_are_the_decimal_shard_number() {
        for n in [
            0u64,
            7,
            9,
            10,
            99,
            100,
            4095,
            16_383,
            u64::from(u32::MAX),
            u64::MAX,
        ] {
            assert_eq!(shard_key_string(n), format!("kvroute/ix/{n}"));
        }
        assert_eq!(shard_key_of(12), "kvroute/ix/12");
        let geo = IndexGeometry::from_budget(64 * 1024 * 1024);
        let h = 0x1234_5678_9abc_def0;
        // Stripe 0 is the group's own shard (fleets of up to 8 endpoints
        // read and write exactly the shards they did before stripes).
        assert_eq!(
            geo.shard_key(h, 0),
            format!("kvroute/ix/{}", mix(h) % u64::from(geo.shards))
        );
        let keys: std::collections::HashSet<String> =
            (0..8).map(|stripe| geo.shard_key(h, stripe)).collect();
        assert_eq!(keys.len(), 8, "stripes of one group use distinct shards");
        assert_eq!((stripe_of(7), stripe_of(8), stripe_of(1023)), (0, 1, 127));
    }
}

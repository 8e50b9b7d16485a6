//! Token IDs of rendered-text segments, kept between requests, so that a
//! conversation's earlier turns cost a lookup instead of a tokenization
//! (`segments`: the text between the tokenizer's added tokens).
//!
//! [`SegmentCache`] is the interface: get and put of a [`SegmentKey`] to
//! token IDs as bytes (little-endian `u32`s), the shape Envoy's shared data
//! has, so one tokenizing VM can later fill a cache every worker reads.
//! [`MemorySegmentCache`] is the in-memory, bounded implementation: its
//! entries' cost ([`MemorySegmentCache::entry_cost`]: value bytes plus a
//! fixed per-entry overhead) never sums above its capacity; CLOCK eviction
//! (a referenced bit per entry, cleared by one pass of the hand) keeps
//! what was read since the hand last passed.
//!
//! A key is the segment's XXH3-128 with a seed (the tokenizer's
//! fingerprint mixed with the cache's seed, so two tokenizers never share
//! entries) and the segment's length in bytes. Two different segments of the
//! same length give the same key with probability 2^-128 per pair: at a
//! million segments in a cache, about 10^-27. XXH3 is not a cryptographic
//! hash, so a client who knows the seed could craft a colliding segment; the
//! worst it can do is make precise hashes wrong for requests holding the
//! other segment, that is, route them to a server without their cache. It
//! never changes an answer: the server tokenizes the prompt itself.
//! `docs/lab/2026-12-07-precise-segments.md` measures the alternative
//! (SHA-256).

use std::collections::HashMap;
use xxhash_rust::xxh3::xxh3_128_with_seed;

/// What a segment is cached under: its 128-bit hash and its length.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct SegmentKey {
    pub hash: u128,
    /// The segment's length (bytes).
    pub len: u64,
}

impl SegmentKey {
    /// The key of `segment` under `seed`.
    pub fn of(segment: &[u8], seed: u64) -> SegmentKey {
        SegmentKey {
            hash: xxh3_128_with_seed(segment, seed),
            len: segment.len() as u64,
        }
    }

    /// The key as 24 bytes (hash, then length; little-endian), for a store
    /// keyed by bytes or strings.
    pub fn to_bytes(&self) -> [u8; 24] {
        let mut b = [0u8; 24];
        b[..16].copy_from_slice(&self.hash.to_le_bytes());
        b[16..].copy_from_slice(&self.len.to_le_bytes());
        b
    }
}

/// Token IDs as a cache value: little-endian `u32`s.
pub fn ids_to_bytes(ids: &[u32]) -> Vec<u8> {
    let mut b = Vec::with_capacity(ids.len() * 4);
    for id in ids {
        b.extend_from_slice(&id.to_le_bytes());
    }
    b
}

/// Appends the token IDs of a cache value to `out`; `false` (and nothing
/// appended) when its length is not a multiple of 4.
pub fn append_ids(bytes: &[u8], out: &mut Vec<u32>) -> bool {
    if !bytes.len().is_multiple_of(4) {
        return false;
    }
    out.extend(
        bytes
            .chunks_exact(4)
            .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])),
    );
    true
}

/// Segments' token IDs, by key.
pub trait SegmentCache {
    /// The token IDs stored for `key` (as [`ids_to_bytes`] wrote them).
    fn get(&mut self, key: &SegmentKey) -> Option<Vec<u8>>;
    /// Stores the token IDs of the segment `key` names. May drop it, or
    /// others, to stay within a bound.
    fn put(&mut self, key: SegmentKey, value: &[u8]);
    /// Mixed into every key's hash seed (with the tokenizer's
    /// fingerprint): a per-process secret makes colliding segments hard to
    /// craft offline. 0 by default.
    fn seed(&self) -> u64 {
        0
    }
}

/// A cache that keeps nothing: every segment is tokenized (the cold cost).
#[derive(Clone, Copy, Debug, Default)]
pub struct NoSegmentCache;

impl SegmentCache for NoSegmentCache {
    fn get(&mut self, _: &SegmentKey) -> Option<Vec<u8>> {
        None
    }
    fn put(&mut self, _: SegmentKey, _: &[u8]) {}
}

#[derive(Debug)]
struct Slot {
    key: SegmentKey,
    value: Box<[u8]>,
    referenced: bool,
}

/// An in-memory [`SegmentCache`] of at most `capacity` bytes of entry cost,
/// with CLOCK eviction.
#[derive(Debug)]
pub struct MemorySegmentCache {
    capacity: usize,
    seed: u64,
    /// Sum of [`MemorySegmentCache::entry_cost`] over the entries.
    bytes: usize,
    index: HashMap<SegmentKey, usize>,
    slots: Vec<Option<Slot>>,
    free: Vec<usize>,
    hand: usize,
}

impl MemorySegmentCache {
    /// Bytes an entry costs beyond its value: the key twice (index and
    /// slot), the slot and the index's share, rounded up.
    pub const ENTRY_OVERHEAD: usize = 96;

    pub fn new(capacity: usize, seed: u64) -> MemorySegmentCache {
        MemorySegmentCache {
            capacity,
            seed,
            bytes: 0,
            index: HashMap::new(),
            slots: Vec::new(),
            free: Vec::new(),
            hand: 0,
        }
    }

    /// What an entry with a value of `value_len` bytes counts against the
    /// capacity.
    pub fn entry_cost(value_len: usize) -> usize {
        value_len + Self::ENTRY_OVERHEAD
    }

    /// Total entry cost held (at most the capacity).
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Entries held.
    pub fn len(&self) -> usize {
        self.index.len()
    }

    pub fn is_empty(&self) -> bool {
        self.index.is_empty()
    }

    fn remove_slot(&mut self, i: usize) {
        if let Some(s) = self.slots[i].take() {
            self.index.remove(&s.key);
            self.bytes -= Self::entry_cost(s.value.len());
            self.free.push(i);
        }
    }

    /// Evicts by CLOCK until `need` more bytes fit: the hand clears
    /// referenced bits and drops the first entry it finds unreferenced.
    /// Ends within two turns of the hand, as a turn clears every bit.
    fn make_room(&mut self, need: usize) {
        while self.bytes + need > self.capacity && !self.index.is_empty() {
            if self.hand >= self.slots.len() {
                self.hand = 0;
            }
            let i = self.hand;
            self.hand += 1;
            match &mut self.slots[i] {
                Some(s) if s.referenced => s.referenced = false,
                Some(_) => self.remove_slot(i),
                None => {}
            }
        }
    }
}

impl SegmentCache for MemorySegmentCache {
    fn get(&mut self, key: &SegmentKey) -> Option<Vec<u8>> {
        let i = *self.index.get(key)?;
        let s = self.slots[i].as_mut()?;
        s.referenced = true;
        Some(s.value.to_vec())
    }

    fn put(&mut self, key: SegmentKey, value: &[u8]) {
        if let Some(&i) = self.index.get(&key) {
            self.remove_slot(i);
        }
        let cost = Self::entry_cost(value.len());
        if cost > self.capacity {
            return;
        }
        self.make_room(cost);
        let slot = Slot {
            key,
            value: value.into(),
            // New entries start unreferenced: one that is never read again
            // goes at the hand's next pass.
            referenced: false,
        };
        let i = match self.free.pop() {
            Some(i) => {
                self.slots[i] = Some(slot);
                i
            }
            None => {
                self.slots.push(Some(slot));
                self.slots.len() - 1
            }
        };
        self.index.insert(key, i);
        self.bytes += cost;
    }

    fn seed(&self) -> u64 {
        self.seed
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(i: u64) -> SegmentKey {
        SegmentKey::of(format!("segment {i}").as_bytes(), 7)
    }

    #[test]
    fn ids_round_trip_through_bytes_and_odd_lengths_are_refused() {
        let ids = [0u32, 1, 151_643, u32::MAX];
        let mut out = vec![9];
        assert!(append_ids(&ids_to_bytes(&ids), &mut out));
        assert_eq!(out, [9, 0, 1, 151_643, u32::MAX]);
        assert!(!append_ids(&[1, 2, 3], &mut out));
        assert_eq!(out.len(), 5);
    }

    #[test]
    fn keys_differ_by_text_length_and_seed() {
        let a = SegmentKey::of(b"hello", 0);
        assert_eq!(a, SegmentKey::of(b"hello", 0));
        assert_ne!(a, SegmentKey::of(b"hellp", 0));
        assert_ne!(a, SegmentKey::of(b"hello", 1));
        assert_eq!(a.len, 5);
        assert_eq!(&a.to_bytes()[16..], &5u64.to_le_bytes());
    }

    /// Random puts and gets of values of random sizes: the held cost never
    /// exceeds the capacity, equals the sum over what is held, and what is
    /// held reads back as it was put.
    #[test]
    fn the_bound_holds_and_values_read_back() {
        let cap = 64 << 10;
        let mut c = MemorySegmentCache::new(cap, 1);
        let mut seed = 0x2545_F491_4F6C_DD1Du64;
        let mut next = move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        let value =
            |i: u64, n: usize| -> Vec<u8> { (0..n).map(|j| (i as usize * 31 + j) as u8).collect() };
        let mut sizes = HashMap::new();
        let (mut hits, mut max_bytes) = (0, 0);
        for step in 0..20_000 {
            let i = next() % 300;
            if next() % 3 == 0 {
                if let Some(v) = c.get(&key(i)) {
                    assert_eq!(v, value(i, sizes[&i]), "step {step}");
                    hits += 1;
                }
            } else {
                // Mostly small values, a few near the capacity.
                let n = match next() % 100 {
                    0 => cap - 50,
                    1 => cap + 1,
                    k => (k as usize * 37) % 600,
                };
                c.put(key(i), &value(i, n));
                sizes.insert(i, n);
            }
            assert!(c.bytes() <= cap, "step {step}: {} > {cap}", c.bytes());
            let held: usize = c
                .slots
                .iter()
                .flatten()
                .map(|s| MemorySegmentCache::entry_cost(s.value.len()))
                .sum();
            assert_eq!(held, c.bytes());
            assert_eq!(c.slots.iter().flatten().count(), c.len());
            max_bytes = max_bytes.max(c.bytes());
        }
        assert!(hits > 1_000, "{hits} hits");
        assert!(max_bytes > cap * 9 / 10, "the cache filled to {max_bytes}");
        // A value above the capacity is not stored, and evicts nothing.
        let before = c.len();
        c.put(key(99_999), &vec![0; cap]);
        assert!(c.get(&key(99_999)).is_none());
        assert_eq!(c.len(), before);
    }

    /// CLOCK: an entry read since the hand last passed survives the next
    /// eviction; an unread one goes.
    #[test]
    fn clock_keeps_what_was_read() {
        let cost = MemorySegmentCache::entry_cost(100);
        let mut c = MemorySegmentCache::new(3 * cost, 0);
        for i in 0..3 {
            c.put(key(i), &[i as u8; 100]);
        }
        assert!(c.get(&key(0)).is_some());
        c.put(key(3), &[3; 100]);
        assert!(c.get(&key(0)).is_some(), "read, so kept");
        assert!(c.get(&key(1)).is_none(), "unread, so evicted");
        assert!(c.get(&key(2)).is_some());
        assert!(c.get(&key(3)).is_some());
        assert_eq!(c.len(), 3);
        assert_eq!(c.bytes(), 3 * cost);
        // Putting a key again replaces its value and its cost.
        c.put(key(2), &[5; 10]);
        assert_eq!(c.get(&key(2)).unwrap(), vec![5; 10]);
        assert_eq!(c.bytes(), 2 * cost + MemorySegmentCache::entry_cost(10));
    }
}

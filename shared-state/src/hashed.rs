//! `kvroute/hashed/k/<slot>`, `kvroute/hashed/v/<slot>`: prompt prefixes
//! whose vLLM block hashes are known, and `kvroute/tok/<fingerprint>`: what
//! a worker needs of a tokenizer it does not load (precise mode with
//! `tokenizeIn: collector`).
//!
//! One VM tokenizes (the collector); the workers only render and cut the
//! prompt's text at the tokenizer's added tokens, chain a key over the
//! pieces ([`PrefixKey`]), and look here for the longest prefix already
//! tokenized. A slot holds one [`HashedPrefix`]: the key it is for (so a
//! worker reading a slot another prefix took finds no match), the tokens
//! up to it, every full block's vLLM hash (64-bit event form) up to it, and
//! what extending it needs (the last full block's 32-byte hash and the IDs
//! of the partial block after it).
//!
//! Bounded: `slots` pairs of keys, a key entry 24 bytes, a value at most
//! [`max_value_bytes`]. Only the tokenizing VM writes (unconditionally: a
//! slot's newest prefix wins); the value is written before its key entry,
//! and a reader checks the value's own key, so a torn pair reads as a miss.

use crate::codec::{Reader, Writer};
use crate::{Store, StoreError};

const MAGIC: u8 = 0x48;
const META_MAGIC: u8 = 0x54;

/// A prompt prefix's key: a 128-bit hash chained over its pieces (the
/// text between added tokens, and the added tokens), seeded per tokenizer,
/// block size, hash seed, `add_special_tokens` and cache salt; and the
/// prefix's length in bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct PrefixKey {
    pub hash: u128,
    pub text_len: u32,
}

impl PrefixKey {
    fn slot(&self, slots: u32) -> u32 {
        ((self.hash as u64) % u64::from(slots.max(1))) as u32
    }
    fn write(&self, w: &mut Writer) {
        w.u64(self.hash as u64);
        w.u64((self.hash >> 64) as u64);
        w.u32(self.text_len);
    }
    fn read(r: &mut Reader) -> Option<PrefixKey> {
        let lo = r.u64()?;
        let hi = r.u64()?;
        Some(PrefixKey {
            hash: u128::from(lo) | (u128::from(hi) << 64),
            text_len: r.u32()?,
        })
    }
}

/// A prompt prefix with its vLLM block hashes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HashedPrefix {
    pub key: PrefixKey,
    /// Tokens in the prefix.
    pub tokens: u32,
    /// The full blocks' hashes, block 0 first (at most the producer's
    /// `max_blocks`: a longer prefix keeps the first ones).
    pub hashes: Vec<u64>,
    /// The last full block's whole hash (the parent of the next block);
    /// `None` before the first full block.
    pub parent: Option<[u8; 32]>,
    /// The IDs after the last full block (fewer than a block).
    pub tail: Vec<u32>,
    /// Whether a longer prompt may continue from here (false when the
    /// post-processor added tokens to this prefix's IDs).
    pub extendable: bool,
}

/// The key of slot `n`'s key entry.
pub fn key_entry(n: u32) -> String {
    format!("kvroute/hashed/k/{n}")
}

/// The key of slot `n`'s value.
pub fn value_entry(n: u32) -> String {
    format!("kvroute/hashed/v/{n}")
}

/// The largest value for `max_blocks` hashes and a `block_size`.
pub fn max_value_bytes(max_blocks: usize, block_size: u32) -> usize {
    1 + 20 + 4 + 1 + 34 + 4 + 4 * block_size as usize + 4 + 8 * max_blocks
}

impl HashedPrefix {
    pub fn encode(&self) -> Vec<u8> {
        let mut w = Writer::with_capacity(66 + 4 * self.tail.len() + 8 * self.hashes.len());
        w.u8(MAGIC);
        self.key.write(&mut w);
        w.u32(self.tokens);
        w.u8(u8::from(self.extendable) | (u8::from(self.parent.is_some()) << 1));
        w.bytes(&self.parent.unwrap_or([0; 32]));
        w.u32(self.tail.len() as u32);
        for &t in &self.tail {
            w.u32(t);
        }
        w.u32(self.hashes.len() as u32);
        for &h in &self.hashes {
            w.u64(h);
        }
        w.buf
    }

    /// `None` for anything not written by [`HashedPrefix::encode`].
    pub fn decode(bytes: &[u8]) -> Option<HashedPrefix> {
        let mut r = Reader::new(bytes);
        if r.u8()? != MAGIC {
            return None;
        }
        let key = PrefixKey::read(&mut r)?;
        let tokens = r.u32()?;
        let flags = r.u8()?;
        let parent: [u8; 32] = r.bytes()?.try_into().ok()?;
        let n = r.u32()? as usize;
        if n > bytes.len() / 4 {
            return None;
        }
        let tail = (0..n).map(|_| r.u32()).collect::<Option<Vec<u32>>>()?;
        let n = r.u32()? as usize;
        if n > bytes.len() / 8 {
            return None;
        }
        let hashes = (0..n).map(|_| r.u64()).collect::<Option<Vec<u64>>>()?;
        if !r.is_empty() {
            return None;
        }
        Some(HashedPrefix {
            key,
            tokens,
            hashes,
            parent: (flags & 2 != 0).then_some(parent),
            tail,
            extendable: flags & 1 != 0,
        })
    }
}

/// The prefix stored for `key`, if its slot holds it.
pub fn get(
    store: &dyn Store,
    slots: u32,
    key: &PrefixKey,
) -> Result<Option<HashedPrefix>, StoreError> {
    if !holds(store, slots, key)? {
        return Ok(None);
    }
    let n = key.slot(slots);
    Ok(store
        .get(&value_entry(n))?
        .and_then(|(v, _)| HashedPrefix::decode(&v))
        .filter(|p| p.key == *key))
}

/// Whether `key`'s slot's key entry names it (one small read).
pub fn holds(store: &dyn Store, slots: u32, key: &PrefixKey) -> Result<bool, StoreError> {
    let n = key.slot(slots);
    Ok(store
        .get(&key_entry(n))?
        .and_then(|(v, _)| {
            let mut r = Reader::new(&v);
            (r.u8()? == MAGIC).then_some(())?;
            PrefixKey::read(&mut r)
        })
        .is_some_and(|k| k == *key))
}

/// The first of `keys` (in their order) that is stored, with its index
/// there. Each miss costs one small read.
pub fn find(
    store: &dyn Store,
    slots: u32,
    keys: impl IntoIterator<Item = PrefixKey>,
) -> Result<Option<(usize, HashedPrefix)>, StoreError> {
    for (i, k) in keys.into_iter().enumerate() {
        if let Some(p) = get(store, slots, &k)? {
            return Ok(Some((i, p)));
        }
    }
    Ok(None)
}

/// Stores `p` in its slot (replacing whatever prefix was there).
pub fn put(store: &dyn Store, slots: u32, p: &HashedPrefix) -> Result<(), StoreError> {
    let n = p.key.slot(slots);
    store.set(&value_entry(n), &p.encode(), 0)?;
    let mut w = Writer::with_capacity(21);
    w.u8(MAGIC);
    p.key.write(&mut w);
    store.set(&key_entry(n), &w.buf, 0)
}

/// Bytes a slot's key entry takes.
const KEY_ENTRY_BYTES: u64 = 21;

/// The collector's account of what each slot holds, so the stored prefixes
/// stay within a byte budget whatever their sizes (many short prompts, or
/// a few long conversations). Only the collector writes the slots, so its
/// count is the truth; a collector starting (a new VM, a lease handover)
/// reads every slot's size once, on its first put.
#[derive(Clone, Debug)]
pub struct Budget {
    sizes: Vec<u32>,
    /// Read since the hand last passed (CLOCK): a prefix jobs continue from
    /// (a conversation's earlier turns) is kept over one nobody continued.
    referenced: Vec<bool>,
    total: u64,
    max: u64,
    hand: usize,
    scanned: bool,
}

impl Budget {
    pub fn new(slots: u32, max_bytes: u64) -> Budget {
        Budget {
            sizes: vec![0; slots.max(1) as usize],
            referenced: vec![false; slots.max(1) as usize],
            total: 0,
            max: max_bytes,
            hand: 0,
            scanned: false,
        }
    }

    /// The slots.
    pub fn slots(&self) -> u32 {
        self.sizes.len() as u32
    }

    /// A job continued `key`'s prefix: keep it over unreferenced ones.
    pub fn touch(&mut self, key: &PrefixKey) {
        let n = key.slot(self.slots()) as usize;
        self.referenced[n] = true;
    }

    /// Bytes held (values and their key entries).
    pub fn total(&self) -> u64 {
        self.total
    }

    fn scan(&mut self, store: &dyn Store) -> Result<(), StoreError> {
        self.total = 0;
        for (n, size) in self.sizes.iter_mut().enumerate() {
            let len = store
                .get(&value_entry(n as u32))?
                .map_or(0, |(v, _)| v.len() as u64);
            *size = if len == 0 {
                0
            } else {
                (len + KEY_ENTRY_BYTES) as u32
            };
            self.total += u64::from(*size);
        }
        self.scanned = true;
        Ok(())
    }
}

/// Stores `p` in its slot within `budget`: other slots are emptied, in
/// turn (a clock hand: the oldest writes go first, but a prefix touched
/// since the hand last passed gets another turn), until it fits. A
/// prefix larger than the whole budget is not stored (false).
pub fn put_within(
    store: &dyn Store,
    budget: &mut Budget,
    p: &HashedPrefix,
) -> Result<bool, StoreError> {
    if !budget.scanned {
        budget.scan(store)?;
    }
    let slots = budget.slots();
    let n = p.key.slot(slots) as usize;
    let value = p.encode();
    let cost = value.len() as u64 + KEY_ENTRY_BYTES;
    if cost > budget.max {
        return Ok(false);
    }
    budget.total -= u64::from(budget.sizes[n]);
    budget.sizes[n] = 0;
    let mut steps = 0;
    // Two turns of the hand at most: the first may only clear bits.
    while budget.total + cost > budget.max && steps < 2 * slots as usize {
        let h = budget.hand;
        budget.hand = (h + 1) % slots as usize;
        steps += 1;
        if h == n || budget.sizes[h] == 0 {
            continue;
        }
        if std::mem::take(&mut budget.referenced[h]) {
            continue;
        }
        store.set(&value_entry(h as u32), &[], 0)?;
        store.set(&key_entry(h as u32), &[], 0)?;
        budget.total -= u64::from(budget.sizes[h]);
        budget.sizes[h] = 0;
    }
    store.set(&value_entry(n as u32), &value, 0)?;
    let mut w = Writer::with_capacity(21);
    w.u8(MAGIC);
    p.key.write(&mut w);
    store.set(&key_entry(n as u32), &w.buf, 0)?;
    budget.sizes[n] = cost as u32;
    budget.referenced[n] = false;
    budget.total += cost;
    Ok(true)
}

/// What a worker needs of a tokenizer it does not load: the added tokens
/// the tokenizer cuts raw text at (content, ID), and whether its
/// post-processor adds tokens to a single sequence. Written once by the
/// tokenizing VM after it loaded the tokenizer; `None` cuts: the tokenizer
/// cannot be segmented (its texts are looked up whole).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TokenizerMeta {
    pub cuts: Option<Vec<(Vec<u8>, u32)>>,
    pub post_adds: bool,
}

/// The key of a tokenizer's meta: its fingerprint (from its `tokenizer.json`
/// bytes or its sha256 pin), so a reloaded config never reads another's.
pub fn meta_key(fingerprint: u64) -> String {
    format!("kvroute/tok/{fingerprint:016x}")
}

impl TokenizerMeta {
    pub fn encode(&self) -> Vec<u8> {
        let mut w = Writer::with_capacity(64);
        w.u8(META_MAGIC);
        w.u8(u8::from(self.post_adds) | (u8::from(self.cuts.is_some()) << 1));
        let cuts = self.cuts.as_deref().unwrap_or(&[]);
        w.u32(cuts.len() as u32);
        for (c, id) in cuts {
            w.bytes(c);
            w.u32(*id);
        }
        w.buf
    }

    pub fn decode(bytes: &[u8]) -> Option<TokenizerMeta> {
        let mut r = Reader::new(bytes);
        if r.u8()? != META_MAGIC {
            return None;
        }
        let flags = r.u8()?;
        let n = r.u32()? as usize;
        if n > bytes.len() {
            return None;
        }
        let mut cuts = Vec::with_capacity(n);
        for _ in 0..n {
            let c = r.bytes()?.to_vec();
            if c.is_empty() {
                return None;
            }
            cuts.push((c, r.u32()?));
        }
        if !r.is_empty() {
            return None;
        }
        Some(TokenizerMeta {
            cuts: (flags & 2 != 0).then_some(cuts),
            post_adds: flags & 1 != 0,
        })
    }
}

/// Publishes a tokenizer's meta.
pub fn put_meta(store: &dyn Store, fingerprint: u64, m: &TokenizerMeta) -> Result<(), StoreError> {
    store.set(&meta_key(fingerprint), &m.encode(), 0)
}

/// A tokenizer's meta, once published.
pub fn get_meta(store: &dyn Store, fingerprint: u64) -> Result<Option<TokenizerMeta>, StoreError> {
    Ok(store
        .get(&meta_key(fingerprint))?
        .and_then(|(v, _)| TokenizerMeta::decode(&v)))
}

/// The key of the bytes waiting in the tokenize queue (jobs enqueued by
/// workers, not yet taken by the collector): Envoy's shared queues are
/// unbounded, so the workers bound them here.
pub const PENDING_KEY: &str = "kvroute/tokenize/pending";

fn pending_of(v: Option<&[u8]>) -> u64 {
    v.and_then(|b| Reader::new(b).u64()).unwrap_or(0)
}

fn pending_bytes(n: &u64) -> Vec<u8> {
    n.to_le_bytes().to_vec()
}

/// Reserves `bytes` of the queue's `max` for a job; false (nothing
/// changed) when they do not fit.
pub fn reserve(store: &dyn Store, bytes: u64, max: u64) -> Result<bool, StoreError> {
    let up = crate::cas::update(store, PENDING_KEY, pending_of, pending_bytes, |n| {
        (n.saturating_add(bytes) <= max).then(|| *n += bytes)
    })?;
    Ok(up.result.is_some())
}

/// Gives back `bytes` of a job taken off the queue (never below 0).
pub fn release(store: &dyn Store, bytes: u64) -> Result<(), StoreError> {
    crate::cas::update(store, PENDING_KEY, pending_of, pending_bytes, |n| {
        *n = n.saturating_sub(bytes);
        Some(())
    })?;
    Ok(())
}

/// Bytes reserved and not yet released.
pub fn pending(store: &dyn Store) -> Result<u64, StoreError> {
    Ok(pending_of(
        store.get(PENDING_KEY)?.as_ref().map(|(v, _)| v.as_slice()),
    ))
}

/// Forgets every reservation (a collector starting: the jobs of one
/// before it are drained without releasing more than is there).
pub fn reset_pending(store: &dyn Store) -> Result<(), StoreError> {
    store.set(PENDING_KEY, &pending_bytes(&0), 0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::MemoryStore;

    fn prefix(hash: u128, n: usize) -> HashedPrefix {
        HashedPrefix {
            key: PrefixKey {
                hash,
                text_len: n as u32 * 7,
            },
            tokens: n as u32 * 16 + 3,
            hashes: (0..n as u64).map(|i| i * 31 + hash as u64).collect(),
            parent: (n > 0).then_some([n as u8; 32]),
            tail: vec![1, 2, 3],
            extendable: n.is_multiple_of(2),
        }
    }

    #[test]
    fn a_prefix_reads_back_and_another_key_in_its_slot_is_a_miss() {
        let s = MemoryStore::new();
        let a = prefix(5, 4);
        put(&s, 8, &a).unwrap();
        assert_eq!(get(&s, 8, &a.key).unwrap(), Some(a.clone()));
        // Same slot (13 % 8 == 5), other key: a miss, then it replaces a.
        let b = prefix(13, 2);
        assert_eq!(get(&s, 8, &b.key).unwrap(), None);
        put(&s, 8, &b).unwrap();
        assert_eq!(get(&s, 8, &a.key).unwrap(), None);
        let mut found = find(&s, 8, [a.key, b.key]).unwrap().unwrap();
        assert_eq!(found.0, 1);
        found.1.tail.clear();
        assert_ne!(found.1, b);
    }

    #[test]
    fn a_torn_pair_reads_as_a_miss() {
        let s = MemoryStore::new();
        let a = prefix(5, 4);
        put(&s, 8, &a).unwrap();
        // The value of another prefix of the same slot lands first.
        s.set(&value_entry(5), &prefix(13, 1).encode(), 0).unwrap();
        assert_eq!(get(&s, 8, &a.key).unwrap(), None);
    }

    #[test]
    fn bounded_by_slots_whatever_is_put() {
        let s = MemoryStore::new();
        let slots = 16;
        for i in 0..2_000u128 {
            put(
                &s,
                slots,
                &prefix(i.wrapping_mul(0x9e37_79b9_7f4a_7c15), (i % 50) as usize),
            )
            .unwrap();
        }
        let (bytes, keys) = s.usage();
        assert_eq!(keys, 2 * slots as usize);
        assert!(
            bytes <= slots as usize * (21 + max_value_bytes(50, 16)),
            "{bytes}"
        );
        for n in 0..slots {
            let (v, _) = s.get(&value_entry(n)).unwrap().unwrap();
            assert!(v.len() <= max_value_bytes(49, 16), "{n}: {}", v.len());
        }
    }

    #[test]
    fn a_byte_budget_holds_whatever_is_put_and_a_new_collector_counts_what_is_there() {
        let s = MemoryStore::new();
        let (slots, max) = (256u32, 40_000u64);
        let mut b = Budget::new(slots, max);
        let mut stored = 0;
        for i in 0..3_000u128 {
            // Mostly small prefixes, some long ones.
            let n = if i % 17 == 0 { 900 } else { (i % 40) as usize };
            let p = prefix(i.wrapping_mul(0x9e37_79b9_7f4a_7c15), n);
            let fits = p.encode().len() as u64 + KEY_ENTRY_BYTES <= max;
            assert_eq!(put_within(&s, &mut b, &p).unwrap(), fits);
            if fits {
                stored += 1;
                assert_eq!(
                    get(&s, slots, &p.key).unwrap(),
                    Some(p),
                    "the last put is there"
                );
            }
            let held = s.bytes_with_prefix("kvroute/hashed/");
            assert!(held as u64 <= max, "{held} bytes after {i}");
            assert_eq!(
                b.total(),
                held as u64,
                "the count is what shared data holds"
            );
        }
        assert!(stored > 2_500);
        // A touched prefix outlives the writes that evict its neighbours.
        let keep = prefix(0xabc, 30);
        put_within(&s, &mut b, &keep).unwrap();
        for i in 0..400u128 {
            b.touch(&keep.key);
            put_within(
                &s,
                &mut b,
                &prefix(i.wrapping_mul(0x1234_5678_9abc_def1) | 1, 30),
            )
            .unwrap();
        }
        assert_eq!(get(&s, slots, &keep.key).unwrap(), Some(keep));
        // A new collector (a new VM) reads what is there and keeps the bound.
        let mut again = Budget::new(slots, max);
        for i in 0..500u128 {
            put_within(&s, &mut again, &prefix(i ^ 0x55, 30)).unwrap();
            assert!(s.bytes_with_prefix("kvroute/hashed/") as u64 <= max);
        }
    }

    #[test]
    fn the_queue_bound_holds_and_never_goes_below_zero() {
        let s = MemoryStore::new();
        assert!(reserve(&s, 600, 1000).unwrap());
        assert!(!reserve(&s, 500, 1000).unwrap());
        assert!(reserve(&s, 400, 1000).unwrap());
        assert_eq!(pending(&s).unwrap(), 1000);
        release(&s, 700).unwrap();
        release(&s, 700).unwrap();
        assert_eq!(pending(&s).unwrap(), 0);
        s.inject_conflicts.set(2);
        assert!(reserve(&s, 10, 1000).unwrap());
        reset_pending(&s).unwrap();
        assert_eq!(pending(&s).unwrap(), 0);
    }

    #[test]
    fn junk_decodes_to_none_and_meta_round_trips() {
        for junk in [&[][..], &[MAGIC], &[MAGIC, 1, 2, 3], &[0xff; 80]] {
            assert_eq!(HashedPrefix::decode(junk), None);
            assert_eq!(TokenizerMeta::decode(junk), None);
        }
        let a = prefix(7, 3);
        let bytes = a.encode();
        for cut in 0..bytes.len() {
            assert_eq!(HashedPrefix::decode(&bytes[..cut]), None, "{cut}");
        }
        let m = TokenizerMeta {
            cuts: Some(vec![
                (b"<|im_start|>".to_vec(), 151644),
                (b"<s>".to_vec(), 1),
            ]),
            post_adds: true,
        };
        let s = MemoryStore::new();
        assert_eq!(get_meta(&s, 9).unwrap(), None);
        put_meta(&s, 9, &m).unwrap();
        assert_eq!(get_meta(&s, 9).unwrap(), Some(m));
        let none = TokenizerMeta {
            cuts: None,
            post_adds: false,
        };
        assert_eq!(TokenizerMeta::decode(&none.encode()), Some(none));
    }
}

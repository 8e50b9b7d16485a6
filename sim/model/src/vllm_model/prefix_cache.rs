//! A block-granular prefix cache like vLLM's (v1 `BlockPool`).
//!
//! - The KV cache is `num_gpu_blocks` blocks of `block_size` tokens.
//! - A full prompt block can be *cached*: registered under its chained hash,
//!   so a later request whose prompt starts with the same blocks reuses them
//!   and skips their prefill.
//! - A block is *in use* while a running request holds it (`ref_cnt > 0`).
//!   Blocks not in use sit in a free queue in LRU order and stay cached until
//!   they are handed out again; handing out a cached free block evicts it
//!   (a `BlockRemoved` event).
//! - A request frees its blocks tail first, so the end of a prompt is evicted
//!   before its shared beginning (vLLM does the same).
//! - `kv_cache_usage = 1 − free_blocks / num_gpu_blocks`: cached but unused
//!   blocks count as free, as in `vllm:kv_cache_usage_perc`.

use crate::kv_events::{KvEvent, MEDIUM_GPU};
use std::collections::HashMap;

/// Index of a block in the pool.
pub type BlockId = u32;

const NIL: u32 = u32::MAX;

#[derive(Clone, Debug)]
struct Block {
    ref_cnt: u32,
    /// Chained hash when the block is cached.
    hash: Option<u64>,
    /// Free-queue links (`NIL` at the ends or when not free).
    prev: u32,
    next: u32,
    is_free: bool,
}

/// The pool of KV blocks with its cached-hash map and LRU free queue.
#[derive(Clone, Debug)]
pub struct PrefixCache {
    block_size: u32,
    blocks: Vec<Block>,
    free_head: u32,
    free_tail: u32,
    num_free: u32,
    cached: HashMap<u64, BlockId>,
    /// Events since the last `drain_events` (only kept when enabled).
    events: Vec<KvEvent>,
    events_enabled: bool,
    /// Blocks evicted since start (cached blocks handed out again).
    pub evictions: u64,
}

impl PrefixCache {
    /// A cache of `num_blocks` blocks of `block_size` tokens, all free.
    pub fn new(num_blocks: u32, block_size: u32, events_enabled: bool) -> PrefixCache {
        let n = num_blocks.max(1);
        let blocks = (0..n)
            .map(|i| Block {
                ref_cnt: 0,
                hash: None,
                prev: if i == 0 { NIL } else { i - 1 },
                next: if i + 1 == n { NIL } else { i + 1 },
                is_free: true,
            })
            .collect();
        PrefixCache {
            block_size: block_size.max(1),
            blocks,
            free_head: 0,
            free_tail: n - 1,
            num_free: n,
            cached: HashMap::new(),
            events: Vec::new(),
            events_enabled,
            evictions: 0,
        }
    }

    pub fn block_size(&self) -> u32 {
        self.block_size
    }

    pub fn num_blocks(&self) -> u32 {
        self.blocks.len() as u32
    }

    /// Blocks not held by any request (cached or empty).
    pub fn num_free(&self) -> u32 {
        self.num_free
    }

    /// Blocks currently registered under a hash.
    pub fn num_cached(&self) -> usize {
        self.cached.len()
    }

    /// `1 − free / total`, in [0, 1].
    pub fn usage(&self) -> f64 {
        1.0 - f64::from(self.num_free) / self.blocks.len() as f64
    }

    /// The cached blocks matching `hashes` from block 0 as a consecutive run.
    pub fn longest_cached_prefix(&self, hashes: &[u64]) -> Vec<BlockId> {
        hashes
            .iter()
            .map_while(|h| self.cached.get(h).copied())
            .collect()
    }

    /// Whether `new_blocks` fresh blocks can be handed out after taking the
    /// (possibly free) cached blocks `hits` into use.
    pub fn can_allocate(&self, hits: &[BlockId], new_blocks: u32) -> bool {
        let hits_free = hits
            .iter()
            .filter(|&&b| self.blocks[b as usize].is_free)
            .count() as u32;
        self.num_free.saturating_sub(hits_free) >= new_blocks
    }

    /// Takes cached blocks into use (`ref_cnt += 1`), leaving the free queue.
    pub fn touch(&mut self, ids: &[BlockId]) {
        for &b in ids {
            if self.blocks[b as usize].is_free {
                self.unlink(b);
            }
            self.blocks[b as usize].ref_cnt += 1;
        }
    }

    /// Hands out `n` blocks from the LRU end of the free queue, evicting the
    /// cached ones. `None` (and nothing changed) if fewer than `n` are free.
    pub fn allocate(&mut self, n: u32) -> Option<Vec<BlockId>> {
        if self.num_free < n {
            return None;
        }
        let mut out = Vec::with_capacity(n as usize);
        let mut removed = Vec::new();
        for _ in 0..n {
            let b = self.free_head;
            self.unlink(b);
            let blk = &mut self.blocks[b as usize];
            blk.ref_cnt = 1;
            if let Some(h) = blk.hash.take() {
                self.cached.remove(&h);
                self.evictions += 1;
                removed.push(h);
            }
            out.push(b);
        }
        if self.events_enabled {
            // vLLM emits one BlockRemoved per evicted block.
            for h in removed {
                self.events.push(KvEvent::BlockRemoved {
                    block_hashes: vec![h],
                    medium: Some(MEDIUM_GPU.into()),
                    group_idx: Some(0),
                });
            }
        }
        Some(out)
    }

    /// Registers consecutive full blocks under their hashes. `parent` is the
    /// hash of the block before `ids[0]` (`None` at block 0); `token_ids` are
    /// the blocks' tokens for the event. A hash that is already cached (the
    /// same prefix computed twice at once) leaves the duplicate block
    /// unregistered and ends the event's run there, as a chain must be
    /// contiguous.
    pub fn store(
        &mut self,
        ids: &[BlockId],
        hashes: &[u64],
        parent: Option<u64>,
        token_ids: &[u32],
        extra_keys: Option<Vec<Option<Vec<String>>>>,
    ) {
        let mut stored = Vec::with_capacity(hashes.len());
        for (&b, &h) in ids.iter().zip(hashes) {
            if self.cached.contains_key(&h) || self.blocks[b as usize].hash.is_some() {
                break;
            }
            self.blocks[b as usize].hash = Some(h);
            self.cached.insert(h, b);
            stored.push(h);
        }
        if self.events_enabled && !stored.is_empty() {
            let bs = self.block_size as usize;
            let n_tokens = (stored.len() * bs).min(token_ids.len());
            let extra = extra_keys
                .map(|mut e| {
                    e.truncate(stored.len());
                    e
                })
                .unwrap_or_else(|| vec![None; stored.len()]);
            self.events.push(KvEvent::BlockStored {
                block_hashes: stored,
                parent_block_hash: parent,
                token_ids: token_ids[..n_tokens].to_vec(),
                block_size: self.block_size,
                lora_id: None,
                medium: Some(MEDIUM_GPU.into()),
                lora_name: None,
                extra_keys: Some(extra),
                group_idx: Some(0),
                kv_cache_spec_kind: Some("full_attention".into()),
            });
        }
    }

    /// Releases a request's blocks, tail first, so the LRU end of the free
    /// queue gets the end of the prompt before its beginning.
    pub fn free(&mut self, ids: &[BlockId]) {
        for &b in ids.iter().rev() {
            let blk = &mut self.blocks[b as usize];
            debug_assert!(blk.ref_cnt > 0, "freeing a free block");
            blk.ref_cnt = blk.ref_cnt.saturating_sub(1);
            if blk.ref_cnt == 0 {
                self.push_free_tail(b);
            }
        }
    }

    /// Forgets every cached hash (`POST /emulator/reset`); blocks in use
    /// stay allocated but will not be reused by later requests.
    pub fn clear(&mut self) {
        for blk in &mut self.blocks {
            blk.hash = None;
        }
        self.cached.clear();
        if self.events_enabled {
            self.events.push(KvEvent::AllBlocksCleared);
        }
    }

    /// Events since the last call, in order.
    pub fn drain_events(&mut self) -> Vec<KvEvent> {
        std::mem::take(&mut self.events)
    }

    fn unlink(&mut self, b: BlockId) {
        let (prev, next) = {
            let blk = &self.blocks[b as usize];
            debug_assert!(blk.is_free);
            (blk.prev, blk.next)
        };
        if prev == NIL {
            self.free_head = next;
        } else {
            self.blocks[prev as usize].next = next;
        }
        if next == NIL {
            self.free_tail = prev;
        } else {
            self.blocks[next as usize].prev = prev;
        }
        let blk = &mut self.blocks[b as usize];
        blk.prev = NIL;
        blk.next = NIL;
        blk.is_free = false;
        self.num_free -= 1;
    }

    fn push_free_tail(&mut self, b: BlockId) {
        let tail = self.free_tail;
        {
            let blk = &mut self.blocks[b as usize];
            blk.prev = tail;
            blk.next = NIL;
            blk.is_free = true;
        }
        if tail == NIL {
            self.free_head = b;
        } else {
            self.blocks[tail as usize].next = b;
        }
        self.free_tail = b;
        self.num_free += 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cached_blocks_survive_free_and_are_found_again() {
        let mut c = PrefixCache::new(8, 4, false);
        let ids = c.allocate(3).unwrap();
        c.store(&ids, &[10, 11, 12], None, &[], None);
        c.free(&ids);
        assert_eq!(c.num_free(), 8);
        assert_eq!(c.longest_cached_prefix(&[10, 11, 12, 13]), ids);
        assert_eq!(c.longest_cached_prefix(&[99, 11]), Vec::<BlockId>::new());
    }

    #[test]
    fn lru_evicts_oldest_freed_tail_first() {
        let mut c = PrefixCache::new(4, 4, true);
        let a = c.allocate(2).unwrap();
        c.store(&a, &[1, 2], None, &[0; 8], None);
        c.free(&a);
        let b = c.allocate(2).unwrap(); // the two never-used blocks
        c.store(&b, &[3, 4], None, &[0; 8], None);
        c.free(&b);
        c.drain_events();
        // Next allocation takes A's blocks, A's tail (hash 2) first.
        let _ = c.allocate(1).unwrap();
        assert_eq!(
            c.drain_events(),
            vec![KvEvent::BlockRemoved {
                block_hashes: vec![2],
                medium: Some("GPU".into()),
                group_idx: Some(0)
            }]
        );
        assert_eq!(c.longest_cached_prefix(&[1, 2]).len(), 1);
        assert_eq!(c.longest_cached_prefix(&[3, 4]).len(), 2);
    }

    #[test]
    fn blocks_in_use_are_never_handed_out() {
        let mut c = PrefixCache::new(2, 4, false);
        let a = c.allocate(2).unwrap();
        assert!(c.allocate(1).is_none());
        assert!(!c.can_allocate(&[], 1));
        c.free(&a[1..]);
        assert!(c.can_allocate(&[], 1));
        assert_eq!(c.usage(), 0.5);
    }

    #[test]
    fn touching_a_free_cached_block_takes_it_out_of_the_free_count() {
        let mut c = PrefixCache::new(2, 4, false);
        let a = c.allocate(1).unwrap();
        c.store(&a, &[7], None, &[], None);
        c.free(&a);
        let hits = c.longest_cached_prefix(&[7]);
        assert!(c.can_allocate(&hits, 1));
        assert!(!c.can_allocate(&hits, 2));
        c.touch(&hits);
        assert_eq!(c.num_free(), 1);
    }
}

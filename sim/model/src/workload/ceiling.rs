//! The hit-ratio ceiling of a request stream: the fraction of prompt tokens
//! a perfect router could serve from cache if every server's KV were
//! infinite. A request can reuse the blocks of its prompt that some earlier
//! request already had, counted in whole blocks of the server's block size
//! from the first, as vLLM looks them up: a prefix, at most
//! `⌊(tokens − 1) / B⌋` blocks ([`cacheable_tokens`]), since the last token
//! is always computed. Every full block of a prompt is cached once it has
//! been prefilled.
//!
//! The load generator computes it from each request's parts (the
//! workload's own token counts, which leaves out the chat template's few
//! tokens and a real tokenizer's deviation from the stated lengths); the
//! simulator from the modelled server's own blocks, exactly.

use super::prompt::cacheable_tokens;
use std::collections::HashSet;

/// Blocks seen so far, and the block size they are counted in.
#[derive(Clone, Debug)]
pub struct Ceiling {
    block_size: u32,
    seen: HashSet<u64>,
}

impl Ceiling {
    pub fn new(block_size: u32) -> Ceiling {
        Ceiling {
            block_size: block_size.max(1),
            seen: HashSet::new(),
        }
    }

    pub fn block_size(&self) -> u32 {
        self.block_size
    }

    /// Adds one request (its prompt length and the chained hashes of its
    /// full blocks) and returns `(reusable tokens, prompt tokens)`.
    pub fn add(&mut self, prompt_tokens: u64, block_hashes: &[u64]) -> (u64, u64) {
        let bs = u64::from(self.block_size);
        let lookup = (cacheable_tokens(prompt_tokens, self.block_size) / bs) as usize;
        let hit = block_hashes
            .iter()
            .take(lookup)
            .take_while(|h| self.seen.contains(*h))
            .count() as u64;
        self.seen.extend(block_hashes.iter().copied());
        (hit * bs, prompt_tokens)
    }

    /// `Σ reusable / Σ prompt` over records that all carry a ceiling;
    /// `None` when one does not or there is no prompt token.
    pub fn ratio(parts: impl IntoIterator<Item = Option<(u64, u64)>>) -> Option<f64> {
        let (mut hit, mut prompt) = (0u64, 0u64);
        for p in parts {
            let (h, n) = p?;
            hit += h;
            prompt += n;
        }
        (prompt > 0).then(|| hit as f64 / prompt as f64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::workload::prompt::{piece_block_hashes, segment_id, Piece};
    use crate::workload::{Workload, WorkloadKind, WorkloadSpec};

    #[test]
    fn a_prefix_seen_before_counts_in_whole_blocks_up_to_the_last_token() {
        let mut c = Ceiling::new(16);
        // 100 tokens: 6 full blocks, nothing seen before.
        let a: Vec<u64> = (1..=6).collect();
        assert_eq!(c.add(100, &a), (0, 100));
        // The same 96 tokens again plus 4: lookup stops at (100−1)/16 = 6.
        assert_eq!(c.add(100, &a), (96, 100));
        // Exactly 96 tokens: (96−1)/16 = 5 blocks, the last is recomputed.
        assert_eq!(c.add(96, &a), (80, 96));
        // A prefix stops at the first block never seen.
        assert_eq!(c.add(100, &[1, 2, 99, 4, 5, 6]), (32, 100));
        assert_eq!(
            Ceiling::ratio([Some((32, 100)), Some((0, 60))]),
            Some(32.0 / 160.0)
        );
        assert_eq!(Ceiling::ratio([Some((32, 100)), None]), None);
    }

    fn stream_ceiling(spec: WorkloadSpec, n: usize, bs: u32) -> f64 {
        let mut w = Workload::new(spec, 1);
        let mut c = Ceiling::new(bs);
        let parts: Vec<Option<(u64, u64)>> = (0..n)
            .map(|_| {
                let p = w.next_parts();
                let pieces: Vec<Piece> = p
                    .messages
                    .iter()
                    .flat_map(|(_, s)| s.iter())
                    .map(|s| Piece {
                        id: segment_id(s),
                        tokens: s.tokens,
                    })
                    .collect();
                let tokens = pieces.iter().map(|p| u64::from(p.tokens)).sum();
                Some(c.add(tokens, &piece_block_hashes(&pieces, bs, 0)))
            })
            .collect();
        Ceiling::ratio(parts).unwrap()
    }

    #[test]
    fn ceilings_of_the_new_workloads_match_their_arithmetic() {
        // agent-session, steady state: a 10-turn session's prompts total
        // 10 × 8700 + 950 × 45 = 129,750 tokens, of which turn 0 reuses the
        // 2000-token system prompt and turn k all of turn k−1:
        // 2000 + 9 × 8700 + 950 × 36 = 114,500 (blocks of 16 divide every
        // piece, so whole blocks lose nothing but the last one's token).
        let agent = stream_ceiling(WorkloadSpec::standard(WorkloadKind::AgentSession), 2400, 16);
        assert!((agent - 114_500.0 / 129_750.0).abs() < 0.01, "{agent}");
        // bursty-cold-start: per round 24 cold documents and 36 repeats
        // that reuse the 4000-token document: 36 × 4000 / (60 × 4300).
        let bursty = stream_ceiling(
            WorkloadSpec::standard(WorkloadKind::BurstyColdStart),
            600,
            16,
        );
        assert!((bursty - 144_000.0 / 258_000.0).abs() < 0.005, "{bursty}");
    }
}

//! `prefix-cache-scorer` (legacy blend):
//!
//! score(e) = (1 − w) × affinity(e) + w × min(1, matched_tokens(e) / S)²
//!
//! - affinity(e) = matched blocks / request blocks;
//! - matched_tokens(e) = matched blocks × block size (tokens);
//! - w = `matchLengthWeight` in [0, 1] (default 0: the score is the affinity);
//! - S = `matchLengthScaleTokens` (tokens, default 8192).
//!
//! The length term favours long absolute hits over a high share of a short
//! prompt.

use super::{Candidate, RequestView};

#[derive(Clone, Debug, PartialEq)]
pub struct PrefixCacheScorer {
    /// weight of the match-length term, in [0, 1]
    pub match_length_weight: f64,
    /// tokens at which the match-length term saturates
    pub match_length_scale_tokens: u64,
}

impl Default for PrefixCacheScorer {
    fn default() -> Self {
        PrefixCacheScorer {
            match_length_weight: 0.0,
            match_length_scale_tokens: 8192,
        }
    }
}

impl PrefixCacheScorer {
    pub fn score(&self, req: &RequestView, cands: &[Candidate], idx: &[usize], out: &mut [f64]) {
        let w = self.match_length_weight;
        for (o, &i) in out.iter_mut().zip(idx) {
            let ratio = cands[i].affinity(req);
            *o = if w > 0.0 && self.match_length_scale_tokens > 0 {
                let matched_tokens = f64::from(cands[i].matched_blocks.min(req.total_blocks))
                    * f64::from(req.block_size_tokens);
                let len = (matched_tokens / self.match_length_scale_tokens as f64).min(1.0);
                (1.0 - w) * ratio + w * len * len
            } else {
                ratio
            };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn c(m: u32) -> Candidate {
        Candidate {
            matched_blocks: m,
            ..Default::default()
        }
    }

    #[test]
    fn default_score_is_affinity() {
        let r = RequestView {
            total_blocks: 4,
            ..Default::default()
        };
        let mut out = [0.0; 3];
        PrefixCacheScorer::default().score(&r, &[c(0), c(2), c(9)], &[0, 1, 2], &mut out);
        assert_eq!(out, [0.0, 0.5, 1.0]);
    }

    #[test]
    fn match_length_term_is_squared_and_capped() {
        // 64 blocks × 64 tokens = 4096 tokens of prompt.
        let r = RequestView {
            total_blocks: 64,
            block_size_tokens: 64,
            ..Default::default()
        };
        let s = PrefixCacheScorer {
            match_length_weight: 0.5,
            match_length_scale_tokens: 8192,
        };
        let mut out = [0.0; 2];
        // 32 blocks = 2048 tokens: ratio 0.5, length (2048/8192)² = 1/16.
        // 64 blocks = 4096 tokens: ratio 1, length (1/2)² = 1/4.
        s.score(&r, &[c(32), c(64)], &[0, 1], &mut out);
        assert_eq!(out, [0.5 * 0.5 + 0.5 / 16.0, 0.5 + 0.5 / 4.0]);
        let long = PrefixCacheScorer {
            match_length_weight: 1.0,
            match_length_scale_tokens: 1024,
        };
        long.score(&r, &[c(32), c(64)], &[0, 1], &mut out);
        assert_eq!(out, [1.0, 1.0]);
    }
}

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
//!
//! ## `stickyOnly` (kvroute's; the shipped `kvroute-default` sets it, weight 0.5)
//!
//! With `stickyOnly: true` the scorer scores only requests the affinity
//! filter kept on their sticky endpoints (its `sticky` branch); for every
//! other request (no affinity, gate-released, exploration, no filter) every
//! candidate scores 1, so it moves nothing there.
//!
//! Why: every endpoint above the affinity threshold is sticky, however much
//! more one of them holds. A server that holds only a group's system prompt
//! (6,000 of 7,200 tokens, 0.83) and the one that also holds the repeated
//! question are both sticky, and `kvroute-load-scorer` values the
//! question's 1,200 tokens only as their prefill time (its lookahead,
//! 0.5 × 1,200 / 32,768 ≈ 0.02 of score), so a small load difference sends
//! the repeat to the other server. That recomputes the question and puts a
//! second copy in a cache that is already full, evicting something else:
//! the miss costs more than its prefill. At weight 0.5 the longer match
//! is worth 0.5 × 0.17 ≈ 0.08, about 5,400 queued prefill tokens, before
//! load moves a repeat. Scoring the released and cold requests too is what
//! the plain scorer would do; those are the load and cache-balance
//! scorers' to place (a released request's warm servers are the saturated
//! ones). In the fleet simulator (`sim/bench/default_sweep.py`, nine
//! seeds) it raised shared-prefix-skew's knee and hit ratio and left the
//! other five workloads as they were (`docs/benchmarks.md`; the figures
//! once quoted here: `docs/lab/2026-12-06-measurements-from-code-comments.md`).

//!
//! ## `skipReleased` (kvroute's; the shipped `kvroute-default` sets it)
//!
//! Like `stickyOnly`, every candidate scores 1 for a request the gate
//! released (or an exploration); unlike it, a request with no sticky
//! endpoint is scored too. Where a group's system prompt is half of each
//! prompt, a new question matches 0.5 on the group's holder, under the
//! 0.8 threshold: with `stickyOnly`, load and `cache-balance-scorer` alone
//! placed it, and spread each group over several servers. At weight 0.5
//! a half match is worth 0.25 of score. In the regime grid
//! (`sim/bench/regime_grid.py`) it took the shared-share-0.5 cells the
//! shipped profile lost from 7 to none (the worst was 0.731 of the best
//! arm), and the six workloads kept every knee (figures in
//! `docs/benchmarks.md`).

use super::{Candidate, RequestView};
use crate::config::check::{err, range_f64, Params};
use crate::config::ConfigError;
use serde::Deserialize;
use serde_json::Value;

#[derive(Clone, Debug, PartialEq)]
pub struct PrefixCacheScorer {
    /// weight of the match-length term, in [0, 1]
    pub match_length_weight: f64,
    /// tokens at which the match-length term saturates
    pub match_length_scale_tokens: u64,
    /// kvroute's `stickyOnly`: score only requests the affinity filter kept
    /// on their sticky endpoints; every other request scores 1 everywhere.
    pub sticky_only: bool,
    /// kvroute's `skipReleased`: every candidate scores 1 for a request the
    /// gate released (or an exploration); sticky and no-affinity requests
    /// are scored.
    pub skip_released: bool,
}

impl Default for PrefixCacheScorer {
    fn default() -> Self {
        PrefixCacheScorer {
            match_length_weight: 0.0,
            match_length_scale_tokens: 8192,
            sticky_only: false,
            skip_released: false,
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

// ---------------------------------------------------------------------------
// Configuration: `prefix-cache-scorer` in `plugins`.

pub const TYPE: &str = "prefix-cache-scorer";

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct PrefixScorerParams {
    prefix_match_info_producer_name: Option<String>,
    match_length_weight: Option<f64>,
    match_length_scale_tokens: Option<i64>,
    sticky_only: Option<bool>,
    skip_released: Option<bool>,
}

pub(crate) fn compile(p: &Params) -> Result<PrefixCacheScorer, ConfigError> {
    // The index parameters it took before the index became a producer
    // are taken out and mapped before this runs
    // (`config::producers::legacy_scorer_index`); this one never was a
    // scorer parameter.
    if let Some(Value::Object(m)) = p.value {
        if m.contains_key("maxPrefixTokensToMatch") {
            return Err(err(
                p.field("maxPrefixTokensToMatch"),
                "is a parameter of approx-prefix-cache-producer (the index), not of the scorer: move it there",
            ));
        }
    }
    let q: PrefixScorerParams = p.parse()?;
    p.producer(
        "prefixMatchInfoProducerName",
        &q.prefix_match_info_producer_name,
    )?;
    let w = range_f64(
        &p.field("matchLengthWeight"),
        q.match_length_weight,
        0.0,
        0.0,
        1.0,
        "must be in [0, 1]",
    )?;
    let scale = q.match_length_scale_tokens.unwrap_or(8192);
    if w > 0.0 && scale <= 0 {
        return Err(err(
            p.field("matchLengthScaleTokens"),
            format!("{scale} is out of range: must be > 0 tokens when matchLengthWeight > 0"),
        ));
    }
    let sticky_only = q.sticky_only.unwrap_or(false);
    let skip_released = q.skip_released.unwrap_or(false);
    if sticky_only && skip_released {
        return Err(err(
            p.field("skipReleased"),
            "and stickyOnly are two choices of what is scored: give one",
        ));
    }
    Ok(PrefixCacheScorer {
        match_length_weight: w,
        match_length_scale_tokens: scale.max(0) as u64,
        sticky_only,
        skip_released,
    })
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
            ..Default::default()
        };
        let mut out = [0.0; 2];
        // 32 blocks = 2048 tokens: ratio 0.5, length (2048/8192)² = 1/16.
        // 64 blocks = 4096 tokens: ratio 1, length (1/2)² = 1/4.
        s.score(&r, &[c(32), c(64)], &[0, 1], &mut out);
        assert_eq!(out, [0.5 * 0.5 + 0.5 / 16.0, 0.5 + 0.5 / 4.0]);
        let long = PrefixCacheScorer {
            match_length_weight: 1.0,
            match_length_scale_tokens: 1024,
            ..Default::default()
        };
        long.score(&r, &[c(32), c(64)], &[0, 1], &mut out);
        assert_eq!(out, [1.0, 1.0]);
    }
}

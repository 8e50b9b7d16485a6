//! `cache-balance-scorer` (kvroute's): place new cache where the fleet's
//! working sets stay balanced.
//!
//! Each endpoint's insert counter `I(e)` (blocks the index has recorded for
//! it, ever; the eviction clock of `shared-state/src/index.rs`) says how
//! much new cache it has been given. An endpoint with capacity `cap(e)`
//! blocks holds the last `cap(e)` of them, so the endpoint that has been
//! given the least recently is the one whose cache a new prefix disturbs
//! least, and placing cold work there keeps every endpoint's share of the
//! fleet's working set even:
//!
//! `score(e) = 1 − min(1, (A(e) − min_passing A) / cap(e))`,
//! `A(e) = I(e) − m(e)`
//!
//! where `m(e)` is the request's match there (`matched_blocks`): placing it
//! on `e` gives `e` only the blocks past `m(e)`, so `A` compares the
//! counters after the placement. A request under the affinity threshold
//! (say half its prompt is a group's system prompt held on one endpoint)
//! is cold, but the holder is given half as much by it; counting `I` alone
//! sent such requests away from the holder and spread every group over
//! several endpoints (`docs/lab/2026-12-07-regime-grid.md`).
//! `cap(e) = 0` (unbounded index) uses the passing set's spread
//! `max A − min A` instead. The least-given endpoint scores 1; one a whole
//! cache ahead scores 0. It scores only requests with no sticky endpoint
//! (the filter's `no-affinity` branch, or no filter): a sticky request
//! stays where its cache is, and one the gate released is placed by load
//! (measured: balancing released requests too cost shared-prefix and skew
//! throughput); every candidate then scores 1.
//!
//! Exact ties (a fresh fleet) are left to the picker's `tieBreak`; after
//! each placement the chosen endpoint's counter moves on, so the next cold
//! request goes elsewhere — ties rotate deterministically, with no random
//! draw. Identical cold prompts in a burst still go together: the first
//! one's blocks are in the index at decision time, so the next sees it as
//! sticky (`engine` tests).

use super::Candidate;
use crate::config::check::Params;
use crate::config::ConfigError;

/// `cold`: the request has no sticky endpoint (else every score is 1).
pub fn score(cands: &[Candidate], idx: &[usize], cold: bool, out: &mut [f64]) {
    if !cold {
        out.iter_mut().for_each(|o| *o = 1.0);
        return;
    }
    // The counter after placing the request there: an endpoint already
    // holding part of the prompt is given only the rest.
    let after = |c: &Candidate| {
        c.inserted_blocks
            .saturating_sub(u64::from(c.matched_blocks))
    };
    let min = idx.iter().map(|&i| after(&cands[i])).min().unwrap_or(0);
    let max = idx.iter().map(|&i| after(&cands[i])).max().unwrap_or(0);
    for (o, &i) in out.iter_mut().zip(idx) {
        let c = &cands[i];
        let ahead = after(c) - min;
        let scale = if c.capacity_blocks > 0 {
            c.capacity_blocks
        } else {
            max - min
        };
        *o = if ahead == 0 || scale == 0 {
            1.0
        } else {
            1.0 - (ahead as f64 / scale as f64).min(1.0)
        };
    }
}

// ---------------------------------------------------------------------------
// Configuration: `cache-balance-scorer` in `plugins`.

pub const TYPE: &str = "cache-balance-scorer";

/// No parameters.
pub(crate) fn compile(p: &Params) -> Result<(), ConfigError> {
    p.none()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cand(inserted: u64, cap: u64) -> Candidate {
        Candidate {
            inserted_blocks: inserted,
            capacity_blocks: cap,
            ..Default::default()
        }
    }

    #[test]
    fn least_given_scores_one_and_a_cache_ahead_scores_zero() {
        let c = [cand(500, 1000), cand(1000, 1000), cand(2500, 1000)];
        let mut out = [0.0; 3];
        score(&c, &[0, 1, 2], true, &mut out);
        assert_eq!(out, [1.0, 0.5, 0.0]);
        // A sticky or released request: neutral.
        score(&c, &[0, 1, 2], false, &mut out);
        assert_eq!(out, [1.0; 3]);
        // Only the passing set counts: without endpoint 0, 1 is least given.
        let mut out = [0.0; 2];
        score(&c, &[1, 2], true, &mut out);
        assert_eq!(out, [1.0, 0.0]);
    }

    #[test]
    fn a_partial_match_counts_as_blocks_not_given() {
        // Endpoint 0 has been given 100 blocks more but already holds 100
        // of the request's: after the placement both are even.
        let mut c = [cand(1100, 1000), cand(1000, 1000)];
        c[0].matched_blocks = 100;
        let mut out = [0.0; 2];
        score(&c, &[0, 1], true, &mut out);
        assert_eq!(out, [1.0, 1.0]);
        // Holding 150 of them, it is the better place for the new cache.
        c[0].matched_blocks = 150;
        score(&c, &[0, 1], true, &mut out);
        assert_eq!(out, [1.0, 0.95]);
    }

    #[test]
    fn unbounded_capacity_uses_the_spread_and_equal_is_a_tie() {
        let c = [cand(10, 0), cand(30, 0), cand(20, 0)];
        let mut out = [0.0; 3];
        score(&c, &[0, 1, 2], true, &mut out);
        assert_eq!(out, [1.0, 0.0, 0.5]);
        let fresh = [cand(0, 0), cand(0, 100)];
        let mut out = [0.0; 2];
        score(&fresh, &[0, 1], true, &mut out);
        assert_eq!(out, [1.0, 1.0]);
    }
}

//! `prefix-cache-affinity-filter`: sticky until saturated.
//!
//! - affinity(e) = matched blocks / request blocks.
//! - sticky = { e : affinity(e) ≥ affinityThreshold }.
//! - ttft(e) ms = inflight_tokens(e) / peakPrefillThroughput × 1000. With
//!   `peakPrefillThroughput: "auto"`, each endpoint's own online estimate
//!   (`collector::prefill_rate`) replaces it while that endpoint's metrics are
//!   fresh; otherwise the configured (`initial`) value is used.
//! - If sticky is empty: every candidate passes (`no-affinity`).
//! - If `maxTTFTPenaltyMs` > 0, some candidate is not sticky, and
//!   min_sticky ttft − min_nonsticky ttft > maxTTFTPenaltyMs (strictly):
//!   every candidate passes (`saturation-release`). As a token gap this is
//!   τ = peakPrefillThroughput × maxTTFTPenaltyMs / 1000.
//! - The same release, stated in tokens: if `maxTokensInFlightPenalty` > 0,
//!   some candidate is not sticky, and min_sticky inflight_tokens −
//!   min_nonsticky inflight_tokens > maxTokensInFlightPenalty (strictly).
//!   This is llm-d's earlier interface (τ given directly); either gate firing
//!   releases.
//! - Otherwise only the sticky candidates pass (`sticky`).
//! - With probability `explorationProbability`, every candidate passes
//!   (`exploration`) before any of the above.
//! - With ≤ 1 candidate, or `affinityThreshold` ≤ 0, the filter does not
//!   apply: every candidate passes.
//!
//! Both penalties 0 means "always stick" (the hot-spotting baseline).

use super::{Candidate, RequestView, Rng};
use crate::collector::prefill_rate::PrefillRateParams;

#[derive(Clone, Debug, PartialEq)]
pub struct AffinityFilter {
    pub affinity_threshold: f64,
    pub max_ttft_penalty_ms: f64,
    /// tokens / second
    pub peak_prefill_throughput: f64,
    pub exploration_probability: f64,
    /// tokens; the token-gap gate, τ given directly (0 = this gate is off)
    pub max_tokens_in_flight_penalty: u64,
    /// `peakPrefillThroughput: "auto"`: use each candidate's estimate
    /// ([`Candidate::prefill_tokens_per_s`]) when it has one.
    pub prefill_auto: Option<PrefillRateParams>,
}

impl Default for AffinityFilter {
    fn default() -> Self {
        AffinityFilter {
            affinity_threshold: 0.8,
            max_ttft_penalty_ms: 18_000.0,
            peak_prefill_throughput: 15_928.0,
            exploration_probability: 0.0,
            max_tokens_in_flight_penalty: 0,
            prefill_auto: None,
        }
    }
}

/// Which branch of the filter decided.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FilterBranch {
    NotApplicable,
    Exploration,
    NoAffinity,
    SaturationRelease,
    Sticky,
}

impl AffinityFilter {
    /// The prefill rate the gate assumes for `c`, tokens/s: its online
    /// estimate with `"auto"` when it has one, else the configured value.
    pub fn prefill_tokens_per_s(&self, c: &Candidate) -> f64 {
        match (self.prefill_auto, c.prefill_tokens_per_s) {
            (Some(_), Some(r)) if r > 0.0 => r,
            _ => self.peak_prefill_throughput,
        }
    }

    /// Estimated TTFT in ms from in-flight tokens.
    pub fn ttft_ms(&self, c: &Candidate) -> f64 {
        let rate = self.prefill_tokens_per_s(c);
        if rate > 0.0 {
            c.inflight_tokens as f64 / rate * 1000.0
        } else {
            0.0
        }
    }

    /// Narrows `passing` (indices into `cands`) in place and says why.
    pub fn apply(
        &self,
        req: &RequestView,
        cands: &[Candidate],
        passing: &mut Vec<usize>,
        rng: &mut Rng,
    ) -> FilterBranch {
        if passing.len() <= 1 || self.affinity_threshold <= 0.0 {
            return FilterBranch::NotApplicable;
        }
        if self.exploration_probability > 0.0 && rng.next_f64() < self.exploration_probability {
            return FilterBranch::Exploration;
        }
        let is_sticky = |i: usize| cands[i].affinity(req) >= self.affinity_threshold;
        let mut best_sticky = f64::INFINITY;
        let mut best_other = f64::INFINITY;
        // tokens
        let mut fewest_sticky = u64::MAX;
        let mut fewest_other = u64::MAX;
        let mut any_sticky = false;
        let mut any_other = false;
        for &i in passing.iter() {
            let t = self.ttft_ms(&cands[i]);
            let n = cands[i].inflight_tokens;
            if is_sticky(i) {
                any_sticky = true;
                best_sticky = best_sticky.min(t);
                fewest_sticky = fewest_sticky.min(n);
            } else {
                any_other = true;
                best_other = best_other.min(t);
                fewest_other = fewest_other.min(n);
            }
        }
        if !any_sticky {
            return FilterBranch::NoAffinity;
        }
        let ttft_gate = self.max_ttft_penalty_ms > 0.0
            && any_other
            && best_sticky - best_other > self.max_ttft_penalty_ms;
        let token_gate = self.max_tokens_in_flight_penalty > 0
            && any_other
            && fewest_sticky.saturating_sub(fewest_other) > self.max_tokens_in_flight_penalty;
        if ttft_gate || token_gate {
            return FilterBranch::SaturationRelease;
        }
        passing.retain(|&i| is_sticky(i));
        FilterBranch::Sticky
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(blocks: u32) -> RequestView {
        RequestView {
            prompt_tokens: u64::from(blocks) * 10,
            total_blocks: blocks,
            block_size_tokens: 10,
            max_output_tokens: None,
            tie_key: None,
        }
    }

    fn cand(matched: u32, inflight: u64) -> Candidate {
        Candidate {
            matched_blocks: matched,
            inflight_tokens: inflight,
            ..Default::default()
        }
    }

    fn run(f: &AffinityFilter, r: &RequestView, c: &[Candidate]) -> (FilterBranch, Vec<usize>) {
        let mut p: Vec<usize> = (0..c.len()).collect();
        let b = f.apply(r, c, &mut p, &mut Rng::new(1));
        (b, p)
    }

    #[test]
    fn threshold_edge_is_inclusive() {
        let f = AffinityFilter::default();
        // 4 of 5 blocks = exactly 0.8 → sticky.
        assert_eq!(
            run(&f, &req(5), &[cand(4, 0), cand(0, 0)]),
            (FilterBranch::Sticky, vec![0])
        );
        // 79 of 100 blocks = 0.79 → not sticky.
        assert_eq!(
            run(&f, &req(100), &[cand(79, 0), cand(0, 0)]).0,
            FilterBranch::NoAffinity
        );
    }

    #[test]
    fn gate_fires_strictly_above_penalty() {
        // τ = 1000 tok/s × 2000 ms = 2000 tokens.
        let f = AffinityFilter {
            max_ttft_penalty_ms: 2000.0,
            peak_prefill_throughput: 1000.0,
            ..Default::default()
        };
        let r = req(10);
        assert_eq!(
            run(&f, &r, &[cand(10, 2500), cand(0, 500)]).0,
            FilterBranch::Sticky
        );
        assert_eq!(
            run(&f, &r, &[cand(10, 2501), cand(0, 500)]),
            (FilterBranch::SaturationRelease, vec![0, 1])
        );
        // The best sticky endpoint counts, not the worst.
        assert_eq!(
            run(&f, &r, &[cand(10, 9000), cand(10, 100), cand(0, 0)]),
            (FilterBranch::Sticky, vec![0, 1])
        );
    }

    #[test]
    fn zero_penalty_never_releases() {
        let f = AffinityFilter {
            max_ttft_penalty_ms: 0.0,
            ..Default::default()
        };
        assert_eq!(
            run(&f, &req(10), &[cand(10, u64::MAX / 4), cand(0, 0)]),
            (FilterBranch::Sticky, vec![0])
        );
    }

    #[test]
    fn token_gate_fires_strictly_above_tau() {
        // llm-d's earlier interface: τ in tokens, the TTFT gate off.
        let f = AffinityFilter {
            max_ttft_penalty_ms: 0.0,
            max_tokens_in_flight_penalty: 2000,
            ..Default::default()
        };
        let r = req(10);
        assert_eq!(
            run(&f, &r, &[cand(10, 2500), cand(0, 500)]).0,
            FilterBranch::Sticky
        );
        assert_eq!(
            run(&f, &r, &[cand(10, 2501), cand(0, 500)]),
            (FilterBranch::SaturationRelease, vec![0, 1])
        );
        // A cold endpoint busier than the warm one never releases.
        assert_eq!(
            run(&f, &r, &[cand(10, 0), cand(0, 9000)]).0,
            FilterBranch::Sticky
        );
    }

    #[test]
    fn either_gate_releases() {
        // TTFT gate τ = 1000 tok/s × 1000 ms = 1000 tokens; token gate τ = 5000.
        let f = AffinityFilter {
            max_ttft_penalty_ms: 1000.0,
            peak_prefill_throughput: 1000.0,
            max_tokens_in_flight_penalty: 5000,
            ..Default::default()
        };
        assert_eq!(
            run(&f, &req(10), &[cand(10, 1001), cand(0, 0)]).0,
            FilterBranch::SaturationRelease
        );
        let g = AffinityFilter {
            max_ttft_penalty_ms: 10_000.0,
            ..f
        };
        assert_eq!(
            run(&g, &req(10), &[cand(10, 5001), cand(0, 0)]).0,
            FilterBranch::SaturationRelease
        );
        assert_eq!(
            run(&g, &req(10), &[cand(10, 5000), cand(0, 0)]).0,
            FilterBranch::Sticky
        );
    }

    #[test]
    fn all_sticky_means_no_gate() {
        let f = AffinityFilter {
            max_ttft_penalty_ms: 1.0,
            peak_prefill_throughput: 1.0,
            ..Default::default()
        };
        assert_eq!(
            run(&f, &req(10), &[cand(10, 1_000_000), cand(10, 0)]),
            (FilterBranch::Sticky, vec![0, 1])
        );
    }

    #[test]
    fn not_applicable_cases() {
        let f = AffinityFilter::default();
        assert_eq!(
            run(&f, &req(10), &[cand(10, 0)]),
            (FilterBranch::NotApplicable, vec![0])
        );
        assert_eq!(
            run(&f, &req(10), &[]),
            (FilterBranch::NotApplicable, vec![])
        );
        let off = AffinityFilter {
            affinity_threshold: 0.0,
            ..Default::default()
        };
        assert_eq!(
            run(&off, &req(10), &[cand(10, 0), cand(0, 0)]).0,
            FilterBranch::NotApplicable
        );
        // A prompt shorter than one block has no affinity anywhere.
        assert_eq!(
            run(&f, &req(0), &[cand(0, 0), cand(0, 0)]).0,
            FilterBranch::NoAffinity
        );
    }

    #[test]
    fn exploration_passes_all_with_its_probability() {
        let f = AffinityFilter {
            exploration_probability: 0.25,
            ..Default::default()
        };
        let c = [cand(10, 0), cand(0, 0)];
        let mut rng = Rng::new(42);
        let mut explored = 0;
        for _ in 0..10_000 {
            let mut p = vec![0, 1];
            if f.apply(&req(10), &c, &mut p, &mut rng) == FilterBranch::Exploration {
                explored += 1;
                assert_eq!(p, vec![0, 1]);
            }
        }
        assert!((2200..2800).contains(&explored), "{explored}");
    }

    #[test]
    fn auto_gate_uses_each_endpoints_estimate() {
        // Fixed 1000 tok/s, τ 2 s: the warm endpoint's 2500 in-flight tokens
        // are 2.5 s, the cold one's 0 — 2.5 s > 2 s releases.
        let fixed = AffinityFilter {
            max_ttft_penalty_ms: 2000.0,
            peak_prefill_throughput: 1000.0,
            ..Default::default()
        };
        let warm = Candidate {
            prefill_tokens_per_s: Some(5000.0),
            ..cand(10, 2500)
        };
        let cold = cand(0, 0);
        let r = req(10);
        assert_eq!(
            run(&fixed, &r, &[warm, cold]).0,
            FilterBranch::SaturationRelease,
            "without auto the estimate is ignored"
        );
        // With auto the warm endpoint prefills at its measured 5000 tok/s:
        // 0.5 s, so it stays sticky.
        let auto = AffinityFilter {
            prefill_auto: Some(PrefillRateParams::around(1000.0)),
            ..fixed.clone()
        };
        assert_eq!(auto.ttft_ms(&warm), 500.0);
        assert_eq!(run(&auto, &r, &[warm, cold]).0, FilterBranch::Sticky);
        // No estimate (stale or none yet): the configured value.
        let unknown = cand(10, 2500);
        assert_eq!(auto.ttft_ms(&unknown), 2500.0);
        assert_eq!(
            run(&auto, &r, &[unknown, cold]).0,
            FilterBranch::SaturationRelease
        );
    }
}

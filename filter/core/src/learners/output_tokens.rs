//! Online output tokens per request, per endpoint, from what the server
//! reports.
//!
//! The in-flight charge holds an output estimate until a request's stream
//! ends (`scheduling::charge`). llm-d's estimate is `outputRatio × prompt
//! tokens` (1.5). Output length rarely follows prompt length: a reasoning
//! model writes thousands of tokens after a short prompt, and a RAG answer
//! is short after a long one. A wrong estimate skews the KV each server is
//! believed to hold, and decode-bound traffic is then spread by a wrong
//! weight (in the simulator's reasoning workload, long outputs after short
//! prompts, the ratio lost throughput at the knee that the true length
//! kept: `docs/lab/2026-12-06-measurements-from-code-comments.md`).
//!
//! vLLM observes `vllm:request_generation_tokens` (a histogram) once per
//! finished request, with the tokens it generated, so over a window
//! `Δ_sum / Δ_count` is exactly the mean output of the requests that
//! finished in it. The collector learns it per endpoint with the ratio
//! learner (`super::ratio`):
//!
//! - a window closes after [`MIN_REQUESTS`] finished requests;
//! - samples are clamped to [1, [`CEILING`]] tokens; the estimate is the
//!   median of the last 9 windows once [`MIN_SAMPLES`] closed;
//! - the fleet's figure is the median of the fresh endpoints' estimates.
//!
//! With `inflight-load-producer`'s `learnOutputTokens` (kvroute's default
//! profile), a request's output estimate is this figure, capped by its
//! `max_tokens` and by `maxEstimatedOutputTokens`; until it is learnt,
//! `outputRatio × prompt tokens` as in llm-d.

use super::ratio::{self, Bounds, RatioLearner};

/// Finished requests a window must count before it closes.
pub const MIN_REQUESTS: f64 = 4.0;
/// Windows before the estimate is used.
pub const MIN_SAMPLES: u8 = 2;
/// No request is taken to write more than this (vLLM's largest contexts
/// are about this long).
pub const CEILING: f32 = 1_048_576.0;

const BOUNDS: Bounds = Bounds {
    min_window: MIN_REQUESTS,
    floor: 1.0,
    ceiling: CEILING,
    min_samples: MIN_SAMPLES,
};

/// Feeds one poll: `vllm:request_generation_tokens_sum` and `_count`.
pub fn observe(state: &mut RatioLearner, generated_sum: f64, finished_count: f64) {
    ratio::observe(state, finished_count, generated_sum, &BOUNDS);
}

/// The endpoint's estimate, tokens per request.
pub fn estimate(state: &RatioLearner) -> Option<f64> {
    ratio::estimate(state, &BOUNDS)
}

/// The median of the endpoints' estimates (`None` if none has one).
pub fn fleet_estimate(estimates: impl IntoIterator<Item = f64>) -> Option<f64> {
    ratio::fleet_estimate(estimates, &BOUNDS)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Feeds polls of `(finished, mean output)`.
    fn feed(s: &mut RatioLearner, t: &mut (f64, f64), polls: &[(f64, f64)]) {
        for &(n, mean) in polls {
            t.0 += n * mean;
            t.1 += n;
            observe(s, t.0, t.1);
        }
    }

    #[test]
    fn learns_the_mean_output_of_finished_requests() {
        let mut s = RatioLearner::default();
        let mut t = (0.0, 0.0);
        observe(&mut s, 0.0, 0.0);
        // Three requests per poll: a window closes every other poll.
        feed(&mut s, &mut t, &[(3.0, 8000.0); 3]);
        assert_eq!(estimate(&s), None, "one window is not enough");
        feed(&mut s, &mut t, &[(3.0, 8000.0)]);
        assert_eq!(estimate(&s), Some(8000.0));
        // Nothing finished: nothing changes.
        let before = s;
        observe(&mut s, t.0, t.1);
        assert_eq!(s, before);
    }

    #[test]
    fn outliers_restarts_and_bad_readings() {
        let mut s = RatioLearner::default();
        let mut t = (0.0, 0.0);
        observe(&mut s, 0.0, 0.0);
        // One window of aborted (0-token) requests and one of runaway
        // answers: the median keeps 500.
        feed(
            &mut s,
            &mut t,
            &[
                (4.0, 500.0),
                (4.0, 0.0),
                (4.0, 500.0),
                (4.0, 1e9),
                (4.0, 500.0),
            ],
        );
        assert_eq!(estimate(&s), Some(500.0));
        assert!(s.samples.iter().all(|&x| (0.0..=CEILING).contains(&x)));
        // The server restarted: its totals are back near 0. The window
        // restarts, the samples stay.
        observe(&mut s, 100.0, 1.0);
        assert_eq!((s.base_num, s.base_den), (100.0, 1.0));
        assert_eq!(estimate(&s), Some(500.0));
        for bad in [f64::NAN, -1.0, f64::INFINITY] {
            observe(&mut s, bad, 5.0);
            observe(&mut s, 5000.0, bad);
        }
        assert_eq!((s.base_num, s.base_den), (100.0, 1.0));
    }

    #[test]
    fn fleet_median_is_bounded() {
        assert_eq!(fleet_estimate([]), None);
        assert_eq!(fleet_estimate([900.0, 1000.0, 7000.0]), Some(1000.0));
        assert_eq!(fleet_estimate([0.0, 1e12]), Some(f64::from(CEILING)));
    }
}

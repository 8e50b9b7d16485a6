//! Online estimate of one endpoint's prefill throughput (tokens/s), from
//! what vLLM exports on `/metrics`.
//!
//! **What vLLM gives.** For every finished request, vLLM (v1 engine,
//! `FinishedRequestStats`) observes two histograms at the same moment:
//! - `vllm:request_prefill_kv_computed_tokens`: the prompt tokens it
//!   computed, `num_prompt_tokens − num_cached_tokens` (prefix-cache hits and
//!   KV transferred from elsewhere excluded: `vllm:prompt_tokens_total` would
//!   count them; added by vllm-project/vllm#30189, December 2025);
//! - `vllm:request_prefill_time_seconds`: `first_token_ts − scheduled_ts`,
//!   the time from first scheduling to the first token (queueing excluded).
//!
//! Both are observed for the same requests, so over the window between two
//! polls the deltas of their `_sum`s cover the same population:
//!
//! ```text
//! ΔT = Δ prefill_kv_computed_tokens_sum      (tokens computed)
//! ΔS = Δ request_prefill_time_seconds_sum    (seconds spent prefilling)
//! Δn = Δ request_prefill_time_seconds_count  (requests)
//! sample = clamp(ΔT / ΔS, floor, ceiling)                       tokens/s
//! estimate ← sample                         (first window)
//! estimate ← estimate + α × (sample − estimate)   (later windows, EWMA)
//! ```
//!
//! For one request alone this is exactly the calibration recipe: B computed
//! tokens over the prefill time (`calibrate`'s B / TTFT without the network
//! and queueing). It is the *served* rate, so it reads low where prefills
//! overlap (several short prompts packed into one step each count the whole
//! step) and where a step's fixed cost dominates a short uncached suffix.
//!
//! **Guards.**
//! - *Too little work.* A window closes only once it holds at least one
//!   request and `minTokensPerRequest` computed tokens; until then the
//!   baseline stays and the window grows. A closed window whose mean is
//!   below `minTokensPerRequest` per request (mostly cache hits: fixed
//!   costs, not throughput) is dropped without feeding the estimate.
//! - *Counter reset.* Any sum or count going down (a server restart) starts
//!   a new window from the new values; the estimate is kept.
//! - *Bounds.* Each sample is clamped to [floor, ceiling] before smoothing,
//!   so the estimate stays inside them too.
//! - *Stale metric.* The estimate is used only while the endpoint's
//!   metrics are fresh (`collector.metricsStaleAfterMs`); otherwise the gate
//!   falls back to the configured value (`Engine::snapshot`).

use crate::reports::vllm_metrics::PrefillTotals;
use kvroute_shared_state::metrics::PrefillRate;

/// The estimator's knobs (`peakPrefillThroughput: {"auto": …}`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PrefillRateParams {
    /// tokens/s; the value used until an estimate exists, and when stale.
    pub initial: f64,
    /// tokens/s; lowest estimate.
    pub floor: f64,
    /// tokens/s; highest estimate.
    pub ceiling: f64,
    /// EWMA weight of a new window, in (0, 1].
    pub smoothing: f64,
    /// tokens; windows with fewer computed tokens per request are not used.
    pub min_tokens_per_request: f64,
}

impl PrefillRateParams {
    /// Defaults around an operator's value: floor ÷8, ceiling ×8, α 0.3,
    /// 256 tokens per request.
    pub fn around(initial: f64) -> PrefillRateParams {
        PrefillRateParams {
            initial,
            floor: initial / 8.0,
            ceiling: initial * 8.0,
            smoothing: 0.3,
            min_tokens_per_request: 256.0,
        }
    }
}

impl Default for PrefillRateParams {
    fn default() -> Self {
        PrefillRateParams::around(15_928.0)
    }
}

/// What one poll did to the estimate.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Observation {
    /// The server exports no prefill histograms: nothing changes.
    NoMetric,
    /// First poll (or after a reset): a window starts here.
    Baseline,
    /// A sum or count went down (server restart): a new window starts.
    CounterReset,
    /// Not enough work in the window yet: it keeps growing.
    Accumulating,
    /// The window was mostly cache hits (or took no time): dropped.
    Dropped,
    /// The window fed the estimate with this sample, tokens/s (clamped).
    Updated(f64),
}

/// Feeds one poll's totals into `state` (a slot's snapshot in shared data).
pub fn observe(
    state: &mut PrefillRate,
    totals: Option<PrefillTotals>,
    now_ms: u64,
    p: &PrefillRateParams,
) -> Observation {
    let Some(t) = totals else {
        return Observation::NoMetric;
    };
    let restart = |state: &mut PrefillRate| {
        state.base_tokens = t.computed_tokens;
        state.base_seconds = t.seconds;
        state.base_count = t.requests;
        state.base_at_ms = now_ms.max(1);
    };
    if state.base_at_ms == 0 {
        restart(state);
        return Observation::Baseline;
    }
    let d_tokens = t.computed_tokens - state.base_tokens;
    let d_seconds = t.seconds - state.base_seconds;
    let d_requests = t.requests - state.base_count;
    if d_tokens < 0.0 || d_seconds < 0.0 || d_requests < 0.0 {
        restart(state);
        return Observation::CounterReset;
    }
    if d_requests < 1.0 || d_tokens < p.min_tokens_per_request {
        return Observation::Accumulating;
    }
    restart(state);
    if d_seconds <= 0.0 || d_tokens / d_requests < p.min_tokens_per_request {
        return Observation::Dropped;
    }
    let sample = (d_tokens / d_seconds).clamp(p.floor, p.ceiling);
    state.tokens_per_s = if state.estimate().is_some() {
        state.tokens_per_s + p.smoothing * (sample - state.tokens_per_s)
    } else {
        sample
    };
    // Rounding cannot leave the bounds, but a changed config can.
    state.tokens_per_s = state.tokens_per_s.clamp(p.floor, p.ceiling);
    state.updated_at_ms = now_ms.max(1);
    state.samples = state.samples.saturating_add(1);
    Observation::Updated(sample)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn totals(tokens: f64, seconds: f64, requests: f64) -> Option<PrefillTotals> {
        Some(PrefillTotals {
            computed_tokens: tokens,
            seconds,
            requests,
        })
    }

    fn params() -> PrefillRateParams {
        PrefillRateParams {
            initial: 10_000.0,
            floor: 1_000.0,
            ceiling: 100_000.0,
            smoothing: 0.5,
            min_tokens_per_request: 256.0,
        }
    }

    #[test]
    fn first_poll_is_a_baseline_then_deltas_give_the_rate() {
        let p = params();
        let mut s = PrefillRate::default();
        // Work done before kvroute started does not count.
        assert_eq!(
            observe(&mut s, totals(1e6, 1.0, 10.0), 1000, &p),
            Observation::Baseline
        );
        assert_eq!(s.estimate(), None);
        // 10240 tokens in 0.5 s.
        assert_eq!(
            observe(&mut s, totals(1e6 + 10240.0, 1.5, 11.0), 2000, &p),
            Observation::Updated(20_480.0)
        );
        assert_eq!(s.estimate(), Some(20_480.0));
        assert_eq!((s.samples, s.updated_at_ms, s.base_at_ms), (1, 2000, 2000));
    }

    #[test]
    fn ewma_moves_a_share_of_the_way() {
        let p = params();
        let mut s = PrefillRate::default();
        observe(&mut s, totals(0.0, 0.0, 0.0), 1, &p);
        observe(&mut s, totals(10_000.0, 1.0, 1.0), 2, &p); // 10k
        observe(&mut s, totals(40_000.0, 2.0, 2.0), 3, &p); // 30k → 10k + 0.5 × 20k
        assert_eq!(s.estimate(), Some(20_000.0));
        assert_eq!(s.samples, 2);
    }

    #[test]
    fn too_little_work_keeps_the_window_open() {
        let p = params();
        let mut s = PrefillRate::default();
        observe(&mut s, totals(0.0, 0.0, 0.0), 1, &p);
        // No finished request yet.
        assert_eq!(
            observe(&mut s, totals(0.0, 0.0, 0.0), 2, &p),
            Observation::Accumulating
        );
        // One request, 100 tokens: below 256, the window grows.
        assert_eq!(
            observe(&mut s, totals(100.0, 0.01, 1.0), 3, &p),
            Observation::Accumulating
        );
        assert_eq!(s.base_at_ms, 1);
        // A second request of 3000 tokens closes it: 3100 tokens / 0.31 s.
        assert_eq!(
            observe(&mut s, totals(3100.0, 0.31, 2.0), 4, &p),
            Observation::Updated(10_000.0)
        );
    }

    #[test]
    fn mostly_cached_windows_are_dropped() {
        let p = params();
        let mut s = PrefillRate::default();
        observe(&mut s, totals(0.0, 0.0, 0.0), 1, &p);
        // 20 requests of 30 computed tokens each, 25 ms apiece (the step
        // floor): 1200 tok/s would be fixed cost, not throughput.
        assert_eq!(
            observe(&mut s, totals(600.0, 0.5, 20.0), 2, &p),
            Observation::Dropped
        );
        assert_eq!(s.estimate(), None);
        assert_eq!(s.base_at_ms, 2, "the dropped window is not reused");
        // Zero seconds for real work is dropped, not infinite.
        assert_eq!(
            observe(&mut s, totals(5600.0, 0.5, 21.0), 3, &p),
            Observation::Dropped
        );
    }

    #[test]
    fn counter_reset_restarts_the_window_and_keeps_the_estimate() {
        let p = params();
        let mut s = PrefillRate::default();
        observe(&mut s, totals(0.0, 0.0, 0.0), 1, &p);
        observe(&mut s, totals(20_000.0, 1.0, 2.0), 2, &p);
        assert_eq!(s.estimate(), Some(20_000.0));
        // The server restarted: its sums start again from small values.
        assert_eq!(
            observe(&mut s, totals(4000.0, 0.1, 1.0), 3, &p),
            Observation::CounterReset
        );
        assert_eq!(s.estimate(), Some(20_000.0));
        assert_eq!((s.base_tokens, s.base_at_ms), (4000.0, 3));
        // Only the count going down is a reset too.
        observe(&mut s, totals(9000.0, 0.2, 0.0), 4, &p);
        assert_eq!(s.base_count, 0.0);
    }

    #[test]
    fn samples_are_bounded_by_floor_and_ceiling() {
        let p = params();
        let mut s = PrefillRate::default();
        observe(&mut s, totals(0.0, 0.0, 0.0), 1, &p);
        assert_eq!(
            observe(&mut s, totals(1e9, 1.0, 1.0), 2, &p),
            Observation::Updated(100_000.0)
        );
        assert_eq!(s.estimate(), Some(100_000.0));
        for i in 0..50 {
            let k = f64::from(i + 1);
            observe(
                &mut s,
                totals(1e9 + 300.0 * k, 1.0 + 10.0 * k, 1.0 + k),
                3 + i as u64,
                &p,
            );
        }
        // 30 tok/s samples clamp to the floor; the EWMA closes in on it.
        let e = s.estimate().unwrap();
        assert!((1_000.0..1_000.001).contains(&e), "{e}");
    }

    #[test]
    fn no_metric_changes_nothing() {
        let p = params();
        let mut s = PrefillRate::default();
        assert_eq!(observe(&mut s, None, 5, &p), Observation::NoMetric);
        assert_eq!(s, PrefillRate::default());
    }
}

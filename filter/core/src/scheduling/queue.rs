//! `queue-scorer` (legacy blend): min-max normalised `vllm:num_requests_waiting`.
//!
//! score(e) = (max − waiting(e)) / (max − min) over candidates with metrics;
//! 1 for all when max = min; 0.5 (neutral) for a candidate without fresh metrics.

use super::Candidate;
use crate::config::check::Params;
use crate::config::ConfigError;

pub fn score(cands: &[Candidate], idx: &[usize], out: &mut [f64]) {
    // Non-finite values count as missing: min-max of ±inf would be NaN.
    let waiting = |i: usize| {
        cands[i]
            .metrics
            .map(|m| m.waiting_requests)
            .filter(|w| w.is_finite())
    };
    let (mut lo, mut hi) = (f64::INFINITY, f64::NEG_INFINITY);
    for &i in idx {
        if let Some(w) = waiting(i) {
            lo = lo.min(w);
            hi = hi.max(w);
        }
    }
    for (o, &i) in out.iter_mut().zip(idx) {
        *o = match waiting(i) {
            None => 0.5,
            Some(_) if hi <= lo || !(hi - lo).is_finite() => 1.0,
            Some(w) => (hi - w) / (hi - lo),
        };
    }
}

// ---------------------------------------------------------------------------
// Configuration: `queue-scorer` in `plugins`.

pub const TYPE: &str = "queue-scorer";

/// No parameters.
pub(crate) fn compile(p: &Params) -> Result<(), ConfigError> {
    p.none()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scheduling::EndpointMetrics;

    fn c(w: Option<f64>) -> Candidate {
        Candidate {
            metrics: w.map(|w| EndpointMetrics {
                waiting_requests: w,
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    #[test]
    fn min_max_normalised() {
        let mut out = [0.0; 4];
        score(
            &[c(Some(2.0)), c(Some(6.0)), c(Some(4.0)), c(None)],
            &[0, 1, 2, 3],
            &mut out,
        );
        assert_eq!(out, [1.0, 0.0, 0.5, 0.5]);
        let mut out = [0.0; 2];
        score(&[c(Some(3.0)), c(Some(3.0))], &[0, 1], &mut out);
        assert_eq!(out, [1.0, 1.0]);
        // A spread that overflows f64 must not turn into NaN.
        let mut out = [0.0; 3];
        score(
            &[c(Some(-1e308)), c(Some(1e308)), c(Some(f64::INFINITY))],
            &[0, 1, 2],
            &mut out,
        );
        assert!(out.iter().all(|s| s.is_finite()), "{out:?}");
    }
}

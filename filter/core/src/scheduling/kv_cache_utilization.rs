//! `kv-cache-utilization-scorer` (legacy blend): score(e) = 1 − `vllm:kv_cache_usage_perc`,
//! clamped to [0, 1]; 0.5 (neutral) without fresh metrics.

use super::Candidate;
use crate::config::check::Params;
use crate::config::ConfigError;

pub fn score(cands: &[Candidate], idx: &[usize], out: &mut [f64]) {
    for (o, &i) in out.iter_mut().zip(idx) {
        *o = cands[i]
            .metrics
            .map_or(0.5, |m| (1.0 - m.kv_cache_usage).clamp(0.0, 1.0));
    }
}

// ---------------------------------------------------------------------------
// Configuration: `kv-cache-utilization-scorer` in `plugins`.

pub const TYPE: &str = "kv-cache-utilization-scorer";

/// No parameters.
pub(crate) fn compile(p: &Params) -> Result<(), ConfigError> {
    p.none()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scheduling::EndpointMetrics;

    #[test]
    fn one_minus_usage() {
        let c = |u: f64| Candidate {
            metrics: Some(EndpointMetrics {
                kv_cache_usage: u,
                ..Default::default()
            }),
            ..Default::default()
        };
        let mut out = [0.0; 4];
        score(
            &[c(0.25), c(1.5), c(-1.0), Candidate::default()],
            &[0, 1, 2, 3],
            &mut out,
        );
        assert_eq!(out, [0.75, 0.0, 1.0, 0.5]);
    }
}

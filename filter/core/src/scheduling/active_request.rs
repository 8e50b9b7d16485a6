//! `active-request-scorer`: for decode-bound traffic.
//!
//! count(e) = in-flight requests; max = max over the scored candidates.
//! score(e) = 1 if count(e) ≤ idleThreshold, else (max − count(e)) / max × maxBusyScore.

use super::Candidate;
use crate::config::check::{err, range_f64, Params};
use crate::config::ConfigError;
use serde::Deserialize;

#[derive(Clone, Debug, PartialEq)]
pub struct ActiveRequestScorer {
    /// requests; endpoints at or below it count as idle (default 0).
    pub idle_threshold: u64,
    /// in [0, 1]; the best score a busy endpoint can get (default 1).
    pub max_busy_score: f64,
}

impl Default for ActiveRequestScorer {
    fn default() -> Self {
        ActiveRequestScorer {
            idle_threshold: 0,
            max_busy_score: 1.0,
        }
    }
}

impl ActiveRequestScorer {
    pub fn score(&self, cands: &[Candidate], idx: &[usize], out: &mut [f64]) {
        let max = idx
            .iter()
            .map(|&i| cands[i].inflight_requests)
            .max()
            .unwrap_or(0);
        for (o, &i) in out.iter_mut().zip(idx) {
            let count = cands[i].inflight_requests;
            *o = if count <= self.idle_threshold {
                1.0
            } else {
                (max - count) as f64 / max as f64 * self.max_busy_score
            };
        }
    }
}

// ---------------------------------------------------------------------------
// Configuration: `active-request-scorer` in `plugins`.

pub const TYPE: &str = "active-request-scorer";

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct ActiveRequestParams {
    idle_threshold: Option<i64>,
    max_busy_score: Option<f64>,
    /// Deprecated in llm-d and ignored there too.
    request_timeout: Option<String>,
    in_flight_load_producer_name: Option<String>,
}

pub(crate) fn compile(p: &Params) -> Result<ActiveRequestScorer, ConfigError> {
    let q: ActiveRequestParams = p.parse()?;
    p.producer("inFlightLoadProducerName", &q.in_flight_load_producer_name)?;
    if q.request_timeout.is_some() {
        p.warn(
            "requestTimeout",
            "deprecated and ignored in llm-d (the in-flight count tracks each request's life); ignored here too",
        );
    }
    let idle = match q.idle_threshold {
        None => 0,
        Some(n) if n >= 0 => n as u64,
        Some(n) => {
            return Err(err(
                p.field("idleThreshold"),
                format!("{n} is out of range: must be ≥ 0 requests"),
            ))
        }
    };
    Ok(ActiveRequestScorer {
        idle_threshold: idle,
        max_busy_score: range_f64(
            &p.field("maxBusyScore"),
            q.max_busy_score,
            1.0,
            0.0,
            1.0,
            "must be in [0, 1]",
        )?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn c(n: u64) -> Candidate {
        Candidate {
            inflight_requests: n,
            ..Default::default()
        }
    }

    #[test]
    fn scores_by_active_count() {
        let mut out = [0.0; 3];
        ActiveRequestScorer::default().score(&[c(0), c(2), c(4)], &[0, 1, 2], &mut out);
        assert_eq!(out, [1.0, 0.5, 0.0]);
    }

    #[test]
    fn idle_threshold_and_busy_cap() {
        let s = ActiveRequestScorer {
            idle_threshold: 1,
            max_busy_score: 0.5,
        };
        let mut out = [0.0; 3];
        s.score(&[c(1), c(2), c(4)], &[0, 1, 2], &mut out);
        assert_eq!(out, [1.0, 0.25, 0.0]);
    }
}

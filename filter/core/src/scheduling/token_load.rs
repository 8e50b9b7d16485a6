//! `token-load-scorer`: for prefill-bound traffic.
//!
//! load(e) = inflight_tokens(e) + charge of this request on e (its uncached
//! prompt tokens there, plus any output estimate) — the "lookahead", which
//! makes a warm endpoint cheaper for this request.
//! score(e) = 1 − min(1, load(e) / queueThresholdTokens); 1 when load is 0.

use super::Candidate;
use crate::config::check::{err, Params};
use crate::config::ConfigError;
use serde::Deserialize;

#[derive(Clone, Debug, PartialEq)]
pub struct TokenLoadScorer {
    /// tokens; default 4,194,304 (128 requests × 32K).
    pub queue_threshold_tokens: f64,
}

impl Default for TokenLoadScorer {
    fn default() -> Self {
        TokenLoadScorer {
            queue_threshold_tokens: 4_194_304.0,
        }
    }
}

impl TokenLoadScorer {
    /// `lookahead[i]` is this request's charge on candidate `i` (tokens).
    pub fn score(&self, cands: &[Candidate], lookahead: &[u64], idx: &[usize], out: &mut [f64]) {
        for (o, &i) in out.iter_mut().zip(idx) {
            let load = cands[i].inflight_tokens.saturating_add(lookahead[i]) as f64;
            *o = if load <= 0.0 {
                1.0
            } else {
                1.0 - (load / self.queue_threshold_tokens).min(1.0)
            };
        }
    }
}

// ---------------------------------------------------------------------------
// Configuration: `token-load-scorer` in `plugins`.

pub const TYPE: &str = "token-load-scorer";

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct TokenLoadParams {
    queue_threshold_tokens: Option<i64>,
    in_flight_load_producer_name: Option<String>,
}

pub(crate) fn compile(p: &Params) -> Result<TokenLoadScorer, ConfigError> {
    let q: TokenLoadParams = p.parse()?;
    p.producer("inFlightLoadProducerName", &q.in_flight_load_producer_name)?;
    let t = match q.queue_threshold_tokens {
        None => 4_194_304,
        Some(t) if t > 0 => t,
        Some(t) => {
            return Err(err(
                p.field("queueThresholdTokens"),
                format!("{t} is out of range: must be > 0 tokens"),
            ))
        }
    };
    Ok(TokenLoadScorer {
        queue_threshold_tokens: t as f64,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lookahead_prefers_warm_at_equal_load() {
        let s = TokenLoadScorer::default();
        let c = [
            Candidate {
                inflight_tokens: 1000,
                ..Default::default()
            },
            Candidate {
                inflight_tokens: 1000,
                ..Default::default()
            },
        ];
        // Warm endpoint 0 would prefill 100 tokens, cold endpoint 1 all 5000.
        let mut out = [0.0; 2];
        s.score(&c, &[100, 5000], &[0, 1], &mut out);
        assert!(out[0] > out[1]);
        assert_eq!(out[0], 1.0 - 1100.0 / 4_194_304.0);
    }

    #[test]
    fn saturates_at_threshold_and_idle_is_one() {
        let s = TokenLoadScorer {
            queue_threshold_tokens: 100.0,
        };
        let c = [
            Candidate {
                inflight_tokens: 500,
                ..Default::default()
            },
            Candidate::default(),
        ];
        let mut out = [0.0; 2];
        s.score(&c, &[0, 0], &[0, 1], &mut out);
        assert_eq!(out, [0.0, 1.0]);
    }
}

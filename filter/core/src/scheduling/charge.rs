//! What `inflight-load-producer` charges an endpoint when it is picked.
//!
//! prompt part = uncached prompt tokens of the request on that endpoint,
//! released at the first response byte (prefill is done);
//! output part (only with `addEstimatedOutputTokens`) =
//! min(estimate, max_output_tokens, maxEstimatedOutputTokens), released with
//! the request count at the end of the stream. The estimate is llm-d's
//! `round(prompt_tokens × outputRatio)`; with `learnOutputTokens`
//! (kvroute's parameter) it is the servers' mean output per finished
//! request once learnt (`learners::output_tokens`), the ratio until then.
//!
//! With `holdKvUntilEnd` (kvroute's parameter, off in llm-d's profile) the
//! output part also holds the request's uncached prompt tokens, so it
//! becomes the new KV the request occupies on the server until its stream
//! ends: held = uncached prompt tokens + output estimate (0 without
//! `addEstimatedOutputTokens`). Between the first token and the end of the
//! stream a request then still counts, as it does in vLLM's KV cache; the
//! prompt part (the prefill in flight) is released at the first token as
//! before. The cached part is left out on purpose: the server holds a
//! shared prefix once however many requests read it, and counting it per
//! request overstates KV use many times over on shared-prefix traffic
//! (measured: the gate then saw KV admission waits that were not there).

//!
//! A request can ask for more than one prompt's work ([`Work`]): `n` or
//! `best_of` output sequences (vLLM samples them from one prefill, so the
//! output part is multiplied and the prompt part is not), and a
//! completions batch (`prompt` a list: every prompt after the first is
//! charged as uncached prefill, and each gets its own outputs).

use super::{Candidate, RequestView};
use crate::config::check::{err, range_f64, Params};
use crate::config::ConfigError;
use serde::Deserialize;

/// What one request asks of a server beyond one prompt and one output.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Work {
    /// Output sequences per prompt: `max(n, best_of)`, at least 1.
    pub sequences: u64,
    /// Prompts of a completions batch after the first.
    pub extra_prompts: u64,
    /// Their estimated tokens (charged as uncached).
    pub extra_prompt_tokens: u64,
}

impl Work {
    /// One prompt, one output sequence.
    pub const ONE: Work = Work {
        sequences: 1,
        extra_prompts: 0,
        extra_prompt_tokens: 0,
    };
}

impl Default for Work {
    fn default() -> Self {
        Work::ONE
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct InflightConfig {
    pub add_estimated_output_tokens: bool,
    /// estimated output tokens per prompt token
    pub output_ratio: f64,
    /// tokens; `None` = no cap
    pub max_estimated_output_tokens: Option<u64>,
    /// kvroute: the output part holds the uncached prompt tokens as well
    /// (the new KV the request occupies until its stream ends).
    pub hold_kv_until_end: bool,
    /// kvroute: the output estimate is the learnt mean output per request
    /// (`RequestView::learnt_output_tokens`) when there is one.
    pub learn_output_tokens: bool,
}

impl Default for InflightConfig {
    fn default() -> Self {
        InflightConfig {
            add_estimated_output_tokens: false,
            // llm-d's DefaultOutputRatio (inflightload/token_estimator.go)
            output_ratio: 1.5,
            max_estimated_output_tokens: None,
            hold_kv_until_end: false,
            learn_output_tokens: false,
        }
    }
}

/// The in-flight charge of one request on one endpoint, in tokens.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Charge {
    pub prompt_tokens: u64,
    pub output_tokens: u64,
}

impl Charge {
    pub fn total(&self) -> u64 {
        self.prompt_tokens.saturating_add(self.output_tokens)
    }
}

impl InflightConfig {
    pub fn charge(&self, req: &RequestView, cand: &Candidate) -> Charge {
        self.charge_work(req, cand, Work::ONE)
    }

    /// [`charge`](Self::charge) of a request that asks for `work`: the
    /// output part (estimate and cap per sequence) times the sequences of
    /// every prompt, the batch's other prompts added to the prompt part.
    pub fn charge_work(&self, req: &RequestView, cand: &Candidate, work: Work) -> Charge {
        let prompt_tokens = cand
            .uncached_tokens(req)
            .saturating_add(work.extra_prompt_tokens);
        let output_tokens = if self.add_estimated_output_tokens {
            let est = match req
                .learnt_output_tokens
                .filter(|_| self.learn_output_tokens)
            {
                Some(n) => n as f64,
                None => (req.prompt_tokens as f64 * self.output_ratio).round(),
            };
            let est = if est.is_finite() && est > 0.0 {
                est as u64
            } else {
                0
            };
            [
                Some(est),
                req.max_output_tokens,
                self.max_estimated_output_tokens,
            ]
            .into_iter()
            .flatten()
            .min()
            .unwrap_or(0)
            .saturating_mul(work.sequences.max(1))
            .saturating_mul(work.extra_prompts.saturating_add(1))
        } else {
            0
        };
        let output_tokens = if self.hold_kv_until_end {
            output_tokens.saturating_add(prompt_tokens)
        } else {
            output_tokens
        };
        Charge {
            prompt_tokens,
            output_tokens,
        }
    }
}

// ---------------------------------------------------------------------------
// Configuration: `inflight-load-producer` in `plugins`.

pub const TYPE: &str = "inflight-load-producer";

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct InflightParams {
    add_estimated_output_tokens: Option<bool>,
    output_ratio: Option<f64>,
    max_estimated_output_tokens: Option<i64>,
    prefix_match_info_producer_name: Option<String>,
    /// Only acts with llm-d's cross-replica syncer, which kvroute does not
    /// have; either value means "local to this gateway".
    sync_cross_replica_state: Option<bool>,
    /// kvroute: the output part holds the whole prompt until the stream
    /// ends (`scheduling::charge`).
    hold_kv_until_end: Option<bool>,
    /// kvroute: the output estimate is the servers' mean output per
    /// finished request, learnt online (`learners::output_tokens`).
    learn_output_tokens: Option<bool>,
}

pub(crate) fn compile(p: &Params) -> Result<InflightConfig, ConfigError> {
    let q: InflightParams = p.parse()?;
    p.producer(
        "prefixMatchInfoProducerName",
        &q.prefix_match_info_producer_name,
    )?;
    let _ = q.sync_cross_replica_state;
    let ratio = range_f64(
        &p.field("outputRatio"),
        q.output_ratio,
        1.5,
        0.0,
        f64::MAX,
        "must be a finite number ≥ 0",
    )?;
    let cap = match q.max_estimated_output_tokens {
        Some(n) if n < 0 => {
            return Err(err(
                p.field("maxEstimatedOutputTokens"),
                format!("{n} is out of range: must be ≥ 0 tokens"),
            ))
        }
        Some(n) => Some(n as u64),
        None => None,
    };
    let add_output = q.add_estimated_output_tokens.unwrap_or(false);
    if q.learn_output_tokens == Some(true) && !add_output {
        return Err(err(
            p.field("learnOutputTokens"),
            "learns the output estimate, which only `addEstimatedOutputTokens: true` charges: set that too, or drop this",
        ));
    }
    Ok(InflightConfig {
        add_estimated_output_tokens: add_output,
        output_ratio: ratio,
        max_estimated_output_tokens: cap,
        hold_kv_until_end: q.hold_kv_until_end.unwrap_or(false),
        learn_output_tokens: q.learn_output_tokens.unwrap_or(false),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn charges_uncached_and_capped_output() {
        let r = RequestView {
            prompt_tokens: 1000,
            total_blocks: 15,
            block_size_tokens: 64,
            max_output_tokens: Some(300),
            learnt_output_tokens: None,
            tie_key: None,
        };
        let warm = Candidate {
            matched_blocks: 10,
            ..Default::default()
        };
        let off = InflightConfig::default();
        assert_eq!(
            off.charge(&r, &warm),
            Charge {
                prompt_tokens: 360,
                output_tokens: 0
            }
        );
        let on = InflightConfig {
            add_estimated_output_tokens: true,
            output_ratio: 0.5,
            max_estimated_output_tokens: None,
            hold_kv_until_end: false,
            learn_output_tokens: false,
        };
        assert_eq!(
            on.charge(&r, &Candidate::default()),
            Charge {
                prompt_tokens: 1000,
                output_tokens: 300
            }
        );
        let capped = InflightConfig {
            max_estimated_output_tokens: Some(10),
            ..on
        };
        assert_eq!(capped.charge(&r, &warm).output_tokens, 10);
    }

    #[test]
    fn hold_kv_keeps_the_uncached_prompt_until_the_end() {
        let r = RequestView {
            prompt_tokens: 1000,
            total_blocks: 15,
            block_size_tokens: 64,
            max_output_tokens: Some(300),
            learnt_output_tokens: None,
            tie_key: None,
        };
        let warm = Candidate {
            matched_blocks: 10,
            ..Default::default()
        };
        let hold = InflightConfig {
            hold_kv_until_end: true,
            ..Default::default()
        };
        // Prefill part and held part: the 360 uncached tokens (the 640
        // cached ones are on the server already, shared).
        assert_eq!(
            hold.charge(&r, &warm),
            Charge {
                prompt_tokens: 360,
                output_tokens: 360
            }
        );
        let both = InflightConfig {
            add_estimated_output_tokens: true,
            ..hold
        };
        // + min(1000 × 1.5, max_tokens 300).
        assert_eq!(both.charge(&r, &warm).output_tokens, 660);
    }

    /// With `learnOutputTokens`, the servers' learnt mean replaces
    /// `outputRatio × prompt`, capped like it; without a learnt figure (or
    /// without the parameter) the ratio is used.
    #[test]
    fn learnt_output_replaces_the_ratio_and_is_capped() {
        let mut r = RequestView {
            prompt_tokens: 1000,
            total_blocks: 15,
            block_size_tokens: 64,
            max_output_tokens: None,
            learnt_output_tokens: Some(8000),
            tie_key: None,
        };
        let learn = InflightConfig {
            add_estimated_output_tokens: true,
            learn_output_tokens: true,
            ..Default::default()
        };
        let cold = Candidate::default();
        assert_eq!(learn.charge(&r, &cold).output_tokens, 8000);
        let ratio = InflightConfig {
            learn_output_tokens: false,
            ..learn.clone()
        };
        assert_eq!(ratio.charge(&r, &cold).output_tokens, 1500);
        r.max_output_tokens = Some(2000);
        assert_eq!(learn.charge(&r, &cold).output_tokens, 2000);
        let capped = InflightConfig {
            max_estimated_output_tokens: Some(700),
            ..learn.clone()
        };
        assert_eq!(capped.charge(&r, &cold).output_tokens, 700);
        r.learnt_output_tokens = None;
        assert_eq!(learn.charge(&r, &cold).output_tokens, 1500);
        let off = InflightConfig {
            add_estimated_output_tokens: false,
            ..learn
        };
        r.learnt_output_tokens = Some(8000);
        assert_eq!(off.charge(&r, &cold).output_tokens, 0);
    }

    /// Issue 40: `n`/`best_of` multiply the output part, not the prefill;
    /// a batch's other prompts add their tokens to the prompt part and get
    /// outputs of their own.
    #[test]
    fn sequences_and_batches_are_charged() {
        let r = RequestView {
            prompt_tokens: 1000,
            total_blocks: 15,
            block_size_tokens: 64,
            max_output_tokens: Some(300),
            learnt_output_tokens: None,
            tie_key: None,
        };
        let cold = Candidate::default();
        let on = InflightConfig {
            add_estimated_output_tokens: true,
            ..Default::default()
        };
        let one = on.charge(&r, &cold);
        assert_eq!(one, on.charge_work(&r, &cold, Work::ONE));
        let n4 = Work {
            sequences: 4,
            ..Work::ONE
        };
        assert_eq!(
            on.charge_work(&r, &cold, n4),
            Charge {
                prompt_tokens: one.prompt_tokens,
                output_tokens: 4 * one.output_tokens,
            }
        );
        let batch = Work {
            sequences: 2,
            extra_prompts: 2,
            extra_prompt_tokens: 500,
        };
        assert_eq!(
            on.charge_work(&r, &cold, batch),
            Charge {
                prompt_tokens: one.prompt_tokens + 500,
                output_tokens: 2 * 3 * one.output_tokens,
            }
        );
        let hold = InflightConfig {
            hold_kv_until_end: true,
            ..on.clone()
        };
        let h = hold.charge_work(&r, &cold, batch);
        assert_eq!(
            h.output_tokens,
            6 * one.output_tokens + one.prompt_tokens + 500
        );
        // Saturates, never wraps.
        let huge = Work {
            sequences: u64::MAX,
            extra_prompts: u64::MAX,
            extra_prompt_tokens: u64::MAX,
        };
        let c = hold.charge_work(&r, &cold, huge);
        assert_eq!((c.prompt_tokens, c.output_tokens), (u64::MAX, u64::MAX));
    }
}

//! `prefix-cache-affinity-filter`: sticky until saturated.
//!
//! - affinity(e) = matched blocks / request blocks.
//! - sticky = { e : affinity(e) ≥ affinityThreshold }.
//! - ttft(e) ms = inflight_tokens(e) / peakPrefillThroughput × 1000. With
//!   `peakPrefillThroughput: "auto"`, each endpoint's own online estimate
//!   (`learners::prefill_rate`) replaces it while that endpoint's metrics are
//!   fresh; otherwise the configured (`initial`) value is used.
//! - With `countUnresolvedBlocks` (kvroute's parameter) the sticky test
//!   reads (matched + unresolved) / request blocks instead: the blocks just
//!   past a match that ends at the start of a whole index group, which the
//!   approximate index cannot look up ([`Candidate::unresolved_blocks`]).
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
//!
//! `loadSignal` (kvroute's parameter): `"inflight"` (the default, llm-d's
//! semantics above, exactly) or `"saturation"`, where both gates read
//! [`saturation::signal`](super::saturation)'s `L + O + x` instead of
//! `inflight_tokens`: the queue (prefill and held KV) merged with the
//! server's waiting requests, plus the wait for KV admission when the
//! server's KV is full, plus this request's own uncached prefill there (so
//! a release pays for recomputing the prompt on the cold endpoint).

use super::{saturation, Candidate, RequestView, Rng};
use crate::config::check::{err, range_f64, strict_value_req, Params};
use crate::config::ConfigError;
use crate::learners::prefill_rate::PrefillRateParams;
use serde::Deserialize;
use serde_json::Value;

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
    /// What the gates compare (`loadSignal`).
    pub load_signal: LoadSignal,
    /// `countUnresolvedBlocks`: the threshold test reads
    /// [`Candidate::possible_affinity`] (the match plus the blocks the index
    /// cannot look up) instead of the affinity.
    pub count_unresolved_blocks: bool,
}

/// The load the saturation gate compares.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum LoadSignal {
    /// llm-d's: in-flight tokens.
    #[default]
    Inflight,
    /// kvroute's: [`saturation::signal`]'s `L + O + x`.
    Saturation,
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
            load_signal: LoadSignal::Inflight,
            count_unresolved_blocks: false,
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

    /// The affinity the threshold test reads: the affinity, or with
    /// `countUnresolvedBlocks` the largest the index cannot rule out.
    pub fn sticky_affinity(&self, req: &RequestView, c: &Candidate) -> f64 {
        if self.count_unresolved_blocks {
            c.possible_affinity(req)
        } else {
            c.affinity(req)
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

    /// The tokens the gates compare for `c`: in-flight tokens, or the
    /// saturation signal's `L + O + x` (`loadSignal`).
    pub fn gate_tokens(&self, req: &RequestView, c: &Candidate) -> f64 {
        match self.load_signal {
            LoadSignal::Inflight => c.inflight_tokens as f64,
            LoadSignal::Saturation => saturation::signal(req, c).ttft_tokens(),
        }
    }

    /// The gate's TTFT estimate in ms: [`gate_tokens`](Self::gate_tokens)
    /// over the prefill rate.
    pub fn gate_ttft_ms(&self, req: &RequestView, c: &Candidate) -> f64 {
        let rate = self.prefill_tokens_per_s(c);
        if rate > 0.0 {
            self.gate_tokens(req, c) / rate * 1000.0
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
        let is_sticky = |i: usize| self.sticky_affinity(req, &cands[i]) >= self.affinity_threshold;
        let mut best_sticky = f64::INFINITY;
        let mut best_other = f64::INFINITY;
        // tokens
        let mut fewest_sticky = u64::MAX;
        let mut fewest_other = u64::MAX;
        let mut any_sticky = false;
        let mut any_other = false;
        for &i in passing.iter() {
            let t = self.gate_ttft_ms(req, &cands[i]);
            // Whole tokens, as llm-d compares them.
            let n = match self.load_signal {
                LoadSignal::Inflight => cands[i].inflight_tokens,
                LoadSignal::Saturation => self.gate_tokens(req, &cands[i]) as u64,
            };
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

// ---------------------------------------------------------------------------
// Configuration: `prefix-cache-affinity-filter` in `plugins`.

pub const TYPE: &str = "prefix-cache-affinity-filter";

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct AffinityParams {
    affinity_threshold: Option<f64>,
    exploration_probability: Option<f64>,
    #[serde(rename = "maxTTFTPenaltyMs")]
    max_ttft_penalty_ms: Option<f64>,
    /// llm-d's earlier interface: τ in tokens.
    max_tokens_in_flight_penalty: Option<i64>,
    /// A number (tokens/s), `"auto"`, or an `{"auto": …}` object.
    peak_prefill_throughput: Option<Value>,
    ttft_source: Option<String>,
    prefix_match_info_producer_name: Option<String>,
    in_flight_load_producer_name: Option<String>,
    latency_prediction_info_producer_name: Option<String>,
    /// kvroute: `"inflight"` (llm-d's) or `"saturation"`.
    load_signal: Option<String>,
    /// kvroute: the threshold test counts the blocks the index cannot look up.
    count_unresolved_blocks: Option<bool>,
}

/// `peakPrefillThroughput: {"auto": true, …}`.
#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct AutoPeakParams {
    auto: Option<bool>,
    initial: Option<f64>,
    floor: Option<f64>,
    ceiling: Option<f64>,
    smoothing: Option<f64>,
    min_tokens_per_request: Option<f64>,
}

pub(crate) fn compile(p: &Params) -> Result<AffinityFilter, ConfigError> {
    let q: AffinityParams = p.parse()?;
    p.producer(
        "prefixMatchInfoProducerName",
        &q.prefix_match_info_producer_name,
    )?;
    p.producer("inFlightLoadProducerName", &q.in_flight_load_producer_name)?;
    if q.latency_prediction_info_producer_name.is_some() {
        return Err(err(
            p.field("latencyPredictionInfoProducerName"),
            "names llm-d's latency-predictor producer, which kvroute does not have; remove it (the TTFT estimate is in-flight tokens / peakPrefillThroughput)",
        ));
    }
    let token_penalty = match q.max_tokens_in_flight_penalty {
        None => 0,
        Some(n) if n >= 0 => n as u64,
        Some(n) => {
            return Err(err(
                p.field("maxTokensInFlightPenalty"),
                format!("{n} is out of range: must be ≥ 0 tokens (0 = this gate is off)"),
            ))
        }
    };
    // Written with the token gate, a config is in llm-d's earlier
    // interface, where maxTTFTPenaltyMs read the latency predictor
    // and was inert without it: so its default there is "off".
    let ttft_default = if token_penalty > 0 { 0.0 } else { 18_000.0 };
    if let Some(s) = &q.ttft_source {
        if s != "prefillThroughput" {
            return Err(err(
                p.field("ttftSource"),
                format!("\"{s}\" is not supported by kvroute; use \"prefillThroughput\" (the latency predictor needs llm-d's sidecar)"),
            ));
        }
    }
    let (peak, prefill_auto) = peak_prefill(
        &p.field("peakPrefillThroughput"),
        &q.peak_prefill_throughput,
    )?;
    let f = AffinityFilter {
        affinity_threshold: range_f64(
            &p.field("affinityThreshold"),
            q.affinity_threshold,
            0.8,
            0.0,
            1.0,
            "must be in [0, 1]",
        )?,
        exploration_probability: range_f64(
            &p.field("explorationProbability"),
            q.exploration_probability,
            0.0,
            0.0,
            1.0,
            "must be in [0, 1]",
        )?,
        max_ttft_penalty_ms: range_f64(
            &p.field("maxTTFTPenaltyMs"),
            q.max_ttft_penalty_ms,
            ttft_default,
            0.0,
            86_400_000.0,
            "must be ≥ 0 ms (0 = always stick)",
        )?,
        peak_prefill_throughput: peak,
        max_tokens_in_flight_penalty: token_penalty,
        prefill_auto,
        load_signal: match q.load_signal.as_deref() {
            None | Some("inflight") => LoadSignal::Inflight,
            Some("saturation") => LoadSignal::Saturation,
            Some(other) => {
                return Err(err(
                    p.field("loadSignal"),
                    format!("\"{other}\" is not a load signal; use \"inflight\" (llm-d's) or \"saturation\""),
                ))
            }
        },
        count_unresolved_blocks: q.count_unresolved_blocks.unwrap_or(false),
    };
    if f.max_ttft_penalty_ms > 0.0 && f.peak_prefill_throughput <= 0.0 {
        return Err(err(
            p.field("peakPrefillThroughput"),
            "must be > 0 tokens/s when maxTTFTPenaltyMs > 0",
        ));
    }
    Ok(f)
}

/// `peakPrefillThroughput` → (the configured value, the online estimator's
/// knobs when `"auto"`).
fn peak_prefill(
    path: &str,
    v: &Option<Value>,
) -> Result<(f64, Option<PrefillRateParams>), ConfigError> {
    const MAX_TPS: f64 = 1e12;
    let tps = |p: &str, v: Option<f64>, default: f64, lo: f64| {
        range_f64(p, v, default, lo, MAX_TPS, "must be ≥ 0 tokens/s")
    };
    match v {
        None | Some(Value::Null) => Ok((15_928.0, None)),
        Some(Value::Number(n)) => Ok((tps(path, n.as_f64(), 15_928.0, 0.0)?, None)),
        Some(Value::String(s)) if s == "auto" => {
            Ok((15_928.0, Some(PrefillRateParams::around(15_928.0))))
        }
        Some(Value::String(s)) => Err(err(
            path,
            format!("\"{s}\" is not allowed: give tokens/s, \"auto\", or {{\"auto\": true, \"initial\": …, \"floor\": …, \"ceiling\": …}}"),
        )),
        Some(obj @ Value::Object(_)) => {
            let q: AutoPeakParams = strict_value_req(obj, path)?;
            let initial = tps(&format!("{path}.initial"), q.initial, 15_928.0, 0.0)?;
            if q.auto == Some(false) {
                // The estimator's knobs mean nothing without it: refuse them
                // rather than ignore a setting the operator believes is used.
                let knobs = [
                    ("floor", q.floor.is_some()),
                    ("ceiling", q.ceiling.is_some()),
                    ("smoothing", q.smoothing.is_some()),
                    ("minTokensPerRequest", q.min_tokens_per_request.is_some()),
                ];
                if let Some((name, _)) = knobs.iter().find(|(_, set)| *set) {
                    return Err(err(
                        format!("{path}.{name}"),
                        "applies only with \"auto\": true (with \"auto\": false the gate uses \"initial\" alone)",
                    ));
                }
                return Ok((initial, None));
            }
            if initial <= 0.0 {
                return Err(err(
                    format!("{path}.initial"),
                    "must be > 0 tokens/s with \"auto\"",
                ));
            }
            let d = PrefillRateParams::around(initial);
            let floor = tps(&format!("{path}.floor"), q.floor, d.floor, 0.0)?;
            let ceiling = tps(&format!("{path}.ceiling"), q.ceiling, d.ceiling, 0.0)?;
            if floor <= 0.0 || !(floor <= initial && initial <= ceiling) {
                return Err(err(
                    path,
                    format!("needs 0 < floor ≤ initial ≤ ceiling; got floor {floor}, initial {initial}, ceiling {ceiling} (tokens/s)"),
                ));
            }
            let smoothing = range_f64(
                &format!("{path}.smoothing"),
                q.smoothing,
                d.smoothing,
                0.0,
                1.0,
                "must be in (0, 1] (the weight of each new measurement)",
            )?;
            if smoothing <= 0.0 {
                return Err(err(
                    format!("{path}.smoothing"),
                    "0 is out of range: must be in (0, 1] (0 would never move)",
                ));
            }
            let min_tokens_per_request = range_f64(
                &format!("{path}.minTokensPerRequest"),
                q.min_tokens_per_request,
                d.min_tokens_per_request,
                1.0,
                1e9,
                "must be ≥ 1 token",
            )?;
            Ok((
                initial,
                Some(PrefillRateParams {
                    initial,
                    floor,
                    ceiling,
                    smoothing,
                    min_tokens_per_request,
                }),
            ))
        }
        Some(other) => Err(err(
            path,
            format!("{other} is not allowed: give tokens/s, \"auto\", or an {{\"auto\": true, …}} object"),
        )),
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
            learnt_output_tokens: None,
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

    /// The shared-prefix workload at 64-token blocks: a new question after a
    /// group's 6,000-token system prompt holds 93 of its 112 blocks (0.83),
    /// but the index finds the 88 of whole groups before the one where the
    /// question starts (0.79), 7 more unresolved.
    #[test]
    fn count_unresolved_blocks_keeps_a_match_cut_at_a_group_start_sticky() {
        let warm = Candidate {
            unresolved_blocks: 7,
            ..cand(88, 0)
        };
        let off = AffinityFilter::default();
        assert_eq!(
            run(&off, &req(112), &[warm, cand(0, 0)]).0,
            FilterBranch::NoAffinity
        );
        let on = AffinityFilter {
            count_unresolved_blocks: true,
            ..Default::default()
        };
        assert_eq!(
            run(&on, &req(112), &[warm, cand(0, 0)]),
            (FilterBranch::Sticky, vec![0])
        );
        // The bound never lifts a short match: 40 + 7 of 112 stays below.
        let short = Candidate {
            unresolved_blocks: 7,
            ..cand(40, 0)
        };
        assert_eq!(
            run(&on, &req(112), &[short, cand(0, 0)]).0,
            FilterBranch::NoAffinity
        );
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

    /// llm-d's gate, stated as a token gap: with a fixed rate r tok/s and
    /// penalty p ms it releases exactly when min_sticky − min_other
    /// in-flight tokens > τ = r × p / 1000. Checked at llm-d's shipped
    /// defaults (τ = 15928 × 18 = 286,704 tokens) on both sides of τ, and
    /// for other rates and penalties, against the token gate given τ
    /// directly (`maxTokensInFlightPenalty`, llm-d's earlier interface).
    /// The saturation signal with own counts only is the same gap with each
    /// side's own uncached prefill added: here the sticky candidate holds
    /// the whole prompt and the other none of its 100 tokens, so it
    /// releases exactly when the gap > τ + 100.
    #[test]
    fn ttft_gate_is_llm_ds_token_gap() {
        for (rate, penalty_ms) in [(15_928.0, 18_000.0), (1000.0, 2000.0), (20_480.0, 250.0)] {
            let tau = (rate * penalty_ms / 1000.0) as u64;
            let ttft = AffinityFilter {
                max_ttft_penalty_ms: penalty_ms,
                peak_prefill_throughput: rate,
                ..Default::default()
            };
            let tokens = AffinityFilter {
                max_ttft_penalty_ms: 0.0,
                max_tokens_in_flight_penalty: tau,
                ..Default::default()
            };
            let saturation_without_metrics = AffinityFilter {
                load_signal: LoadSignal::Saturation,
                ..ttft.clone()
            };
            let r = req(10);
            for other in [0, 1, 12_345] {
                for gap in [
                    0,
                    tau - 1,
                    tau,
                    tau + 1,
                    tau + 2,
                    tau + 99,
                    tau + 101,
                    2 * tau,
                ] {
                    let c = [cand(10, other + gap), cand(0, other)];
                    let want = gap > tau;
                    let fired =
                        |f: &AffinityFilter| run(f, &r, &c).0 == FilterBranch::SaturationRelease;
                    // At exactly τ the TTFT form compares two float64
                    // quotients (as llm-d's does), whose rounding decides;
                    // one token either side it is exact.
                    if gap != tau {
                        assert_eq!(fired(&ttft), want, "ttft gate, τ {tau}, gap {gap}");
                    }
                    assert_eq!(fired(&tokens), want, "token gate, τ {tau}, gap {gap}");
                    // Own counts only (one gateway, no fresh metrics), in
                    // flight split between prefill and held: llm-d's gap,
                    // with the cold side's own 100-token prefill added.
                    let c = c.map(|x| Candidate {
                        inflight_prefill_tokens: x.inflight_tokens / 3,
                        inflight_held_tokens: x.inflight_tokens - x.inflight_tokens / 3,
                        ..x
                    });
                    assert_eq!(
                        run(&saturation_without_metrics, &r, &c).0
                            == FilterBranch::SaturationRelease,
                        gap > tau + 100,
                        "saturation gate, τ {tau}, gap {gap}"
                    );
                }
            }
        }
    }

    /// A warm server full of another gateway's decoding requests, with its
    /// KV full and a queue: llm-d's gate sees only our 500 held tokens
    /// (0.5 s) and sticks; under `loadSignal: "saturation"` the server's
    /// counts show the queue and it releases. With stale metrics (`None`)
    /// only our counts remain, and it sticks.
    #[test]
    fn saturation_gate_sees_other_gateways_and_full_kv() {
        use crate::scheduling::EndpointMetrics;
        let inflight = AffinityFilter {
            max_ttft_penalty_ms: 1000.0,
            peak_prefill_throughput: 1000.0,
            ..Default::default()
        };
        let saturation = AffinityFilter {
            load_signal: LoadSignal::Saturation,
            ..inflight.clone()
        };
        let full = Candidate {
            inflight_requests: 2,
            inflight_held_tokens: 500,
            metrics: Some(EndpointMetrics {
                waiting_requests: 8.0,
                running_requests: 32.0,
                kv_cache_usage: 1.0,
                kv_capacity_tokens: 50_000,
            }),
            ..cand(8, 500)
        };
        let r = req(10);
        assert_eq!(
            run(&inflight, &r, &[full, cand(0, 0)]).0,
            FilterBranch::Sticky
        );
        assert_eq!(
            run(&saturation, &r, &[full, cand(0, 0)]).0,
            FilterBranch::SaturationRelease
        );
        // Ours 500 + (40 − 2.5 − 1) foreign × 250 each, plus the KV
        // overflow 50000 + 9 × 20 uncached − 50000, plus its own 20
        // uncached tokens, at 1000 tok/s.
        assert_eq!(saturation.gate_ttft_ms(&r, &full), 9825.0);
        let stale = Candidate {
            metrics: None,
            ..full
        };
        assert_eq!(
            run(&saturation, &r, &[stale, cand(0, 0)]).0,
            FilterBranch::Sticky
        );
    }

    /// The same queue gap (3 s of held tokens at 1000 tok/s, τ 2 s) releases
    /// a short prompt and keeps a long one: moving the 10,000-token prompt
    /// costs its whole prefill on the cold endpoint (10 s), more than the
    /// queue it would skip; the 100-token one costs 0.1 s.
    #[test]
    fn saturation_gate_prices_the_cold_prefill() {
        let f = AffinityFilter {
            max_ttft_penalty_ms: 2000.0,
            peak_prefill_throughput: 1000.0,
            load_signal: LoadSignal::Saturation,
            ..Default::default()
        };
        let busy = |blocks: u32| Candidate {
            inflight_held_tokens: 3000,
            inflight_requests: 3,
            ..cand(blocks, 3000)
        };
        assert_eq!(
            run(&f, &req(10), &[busy(10), cand(0, 0)]).0,
            FilterBranch::SaturationRelease
        );
        assert_eq!(
            run(&f, &req(1000), &[busy(1000), cand(0, 0)]),
            (FilterBranch::Sticky, vec![0])
        );
        // llm-d's signal compares the queues alone and releases both.
        let inflight = AffinityFilter {
            load_signal: LoadSignal::Inflight,
            ..f.clone()
        };
        assert_eq!(
            run(&inflight, &req(1000), &[busy(1000), cand(0, 0)]).0,
            FilterBranch::SaturationRelease
        );
    }
}

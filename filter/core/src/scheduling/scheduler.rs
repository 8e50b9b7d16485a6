//! Runs one scheduling profile: filters → weighted scorers → picker.
//!
//! total(e) = Σ weight_k × score_k(e) over the profile's scorers (not
//! normalised by the weights, as in llm-d). Scorers see only the candidates
//! that passed the filters. The fallback list is the rest of the passing set
//! in picker order, then the filtered-out candidates by ascending in-flight
//! tokens, cut to `max_fallbacks`.

use super::affinity_filter::{AffinityFilter, FilterBranch};
use super::charge::InflightConfig;
use super::registry::ScoreInput;
pub use super::registry::Scorer;
use super::session::{self, Presence, Role, SessionAffinity};
use super::session_affinity_filter;
use super::token_load::TokenLoadScorer;
use super::{max_score, no_hit_lru, weighted_random};
use super::{Candidate, RequestView, Rng};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Picker {
    MaxScore(max_score::TieBreak),
    WeightedRandom,
}

/// Which branch decided, for the explanation and counters.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Branch {
    /// Only sticky endpoints were considered.
    Sticky,
    /// The warm endpoints were saturated; all were considered.
    SaturationRelease,
    /// No endpoint held enough of the prompt; all were considered.
    NoAffinity,
    /// Exploration skipped the filter.
    Exploration,
    /// One candidate only.
    Single,
    /// No affinity filter in the profile (or threshold ≤ 0).
    Unfiltered,
}

impl Branch {
    pub fn as_str(&self) -> &'static str {
        match self {
            Branch::Sticky => "sticky",
            Branch::SaturationRelease => "saturation-release",
            Branch::NoAffinity => "no-affinity",
            Branch::Exploration => "exploration",
            Branch::Single => "single",
            Branch::Unfiltered => "unfiltered",
        }
    }
}

/// Per-candidate explanation of a decision.
#[derive(Clone, Debug, PartialEq)]
pub struct CandidateReport {
    pub affinity: f64,
    /// Estimated TTFT (ms) from in-flight tokens, as the affinity filter sees it.
    pub ttft_ms: f64,
    pub passed_filter: bool,
    /// Weighted total; `None` if the candidate was filtered out.
    pub score: Option<f64>,
}

/// The outcome of scheduling one request.
#[derive(Clone, Debug, PartialEq)]
pub struct Decision {
    /// Index into the candidate slice.
    pub primary: usize,
    /// Indices into the candidate slice, best first, distinct, without the primary.
    pub fallbacks: Vec<usize>,
    pub branch: Branch,
    /// True when no candidate held any block (no-hit-lru records these).
    pub cold: bool,
    /// One entry per candidate, in candidate order.
    pub report: Vec<CandidateReport>,
    /// Where the request's session endpoint stood after the affinity
    /// filters (`session-affinity-*`; [`Presence::None`] without one).
    pub session: Presence,
    /// Each scorer's unweighted score, for the simulator's decision log:
    /// `scorer_scores[i * scorers + k]` is scorer `k` (profile order) on
    /// candidate `i` (candidate order); 0 for a candidate the filter
    /// dropped. Empty unless asked for ([`Scheduler::schedule_scored`]).
    pub scorer_scores: Box<[f64]>,
}

/// A compiled scheduling profile.
#[derive(Clone, Debug, PartialEq)]
pub struct Scheduler {
    pub filters: Vec<AffinityFilter>,
    pub scorers: Vec<(Scorer, f64)>,
    pub picker: Picker,
    pub inflight: InflightConfig,
    pub max_fallbacks: usize,
    /// The profile's `session-affinity-scorer` or `-filter` (one at most):
    /// how the engine finds a request's session endpoint; a filter runs
    /// after `filters`, a scorer is also in `scorers` for its weight.
    pub session: Option<SessionAffinity>,
}

impl Default for Scheduler {
    /// llm-d's optimized baseline: affinity filter + token-load scorer + max-score picker.
    fn default() -> Self {
        Scheduler {
            filters: vec![AffinityFilter::default()],
            scorers: vec![(Scorer::TokenLoad(TokenLoadScorer::default()), 1.0)],
            picker: Picker::MaxScore(max_score::TieBreak::Random),
            inflight: InflightConfig::default(),
            max_fallbacks: 2,
            session: None,
        }
    }
}

impl Scheduler {
    /// Picks an endpoint; `None` only when there is no candidate.
    pub fn schedule(
        &self,
        req: &RequestView,
        cands: &[Candidate],
        rng: &mut Rng,
    ) -> Option<Decision> {
        self.decide(req, cands, rng, false)
    }

    /// [`schedule`](Self::schedule), keeping each scorer's score in
    /// [`Decision::scorer_scores`].
    pub fn schedule_scored(
        &self,
        req: &RequestView,
        cands: &[Candidate],
        rng: &mut Rng,
    ) -> Option<Decision> {
        self.decide(req, cands, rng, true)
    }

    fn decide(
        &self,
        req: &RequestView,
        cands: &[Candidate],
        rng: &mut Rng,
        keep_scores: bool,
    ) -> Option<Decision> {
        if cands.is_empty() {
            return None;
        }
        let mut passing: Vec<usize> = (0..cands.len()).collect();
        let mut branch = if cands.len() == 1 {
            Branch::Single
        } else {
            Branch::Unfiltered
        };
        for f in &self.filters {
            let b = f.apply(req, cands, &mut passing, rng);
            branch = match b {
                FilterBranch::NotApplicable => branch,
                FilterBranch::Exploration => Branch::Exploration,
                FilterBranch::NoAffinity => Branch::NoAffinity,
                FilterBranch::SaturationRelease => Branch::SaturationRelease,
                FilterBranch::Sticky => Branch::Sticky,
            };
        }
        // The session plugins run after the affinity filters: the gate
        // decides first (see `session`).
        let presence = if self.session.is_some() {
            session::presence(req, cands, &passing, branch, &self.filters)
        } else {
            Presence::None
        };
        if self
            .session
            .as_ref()
            .is_some_and(|s| s.role == Role::Filter)
        {
            session_affinity_filter::apply(presence, &mut passing);
        }

        // Weighted scores over the passing set.
        let mut totals = vec![0.0; passing.len()];
        let mut buf = vec![0.0; passing.len()];
        let n_scorers = self.scorers.len();
        let mut scorer_scores = vec![
            0.0;
            if keep_scores {
                cands.len() * n_scorers
            } else {
                0
            }
        ];
        let lookahead: Vec<u64> = if self
            .scorers
            .iter()
            .any(|(s, _)| matches!(s, Scorer::TokenLoad(_)))
        {
            cands
                .iter()
                .map(|c| self.inflight.charge(req, c).total())
                .collect()
        } else {
            Vec::new()
        };
        // The KV this request would hold on each candidate, for
        // kvroute-load-scorer: its uncached tokens there plus any output estimate.
        let held: Vec<u64> = if self
            .scorers
            .iter()
            .any(|(s, _)| matches!(s, Scorer::KvrouteLoad(_)))
        {
            let hold = InflightConfig {
                hold_kv_until_end: true,
                ..self.inflight.clone()
            };
            cands
                .iter()
                .map(|c| hold.charge(req, c).output_tokens)
                .collect()
        } else {
            Vec::new()
        };
        let input = ScoreInput {
            req,
            cands,
            passing: &passing,
            branch,
            lookahead: &lookahead,
            held: &held,
            session: match presence {
                Presence::Present(i) => Some(i),
                _ => None,
            },
        };
        for (k, (scorer, weight)) in self.scorers.iter().enumerate() {
            scorer.score(&input, &mut buf);
            for (t, s) in totals.iter_mut().zip(&buf) {
                *t += weight * s;
            }
            for (&i, s) in passing.iter().zip(&buf).filter(|_| keep_scores) {
                scorer_scores[i * n_scorers + k] = *s;
            }
        }

        // A non-finite score would outrank every real one; count it as 0.
        for t in totals.iter_mut().filter(|t| !t.is_finite()) {
            *t = 0.0;
        }
        let order = match self.picker {
            Picker::MaxScore(tie) => {
                // Endpoint keys matter only to the rendezvous tie break.
                let keys: Vec<u64> = match tie {
                    max_score::TieBreak::Prefix => passing.iter().map(|&i| cands[i].key).collect(),
                    max_score::TieBreak::Random => Vec::new(),
                };
                max_score::rank(&totals, tie, req.tie_key, &keys, rng)
            }
            Picker::WeightedRandom => weighted_random::rank(&totals, rng),
        };
        let primary = passing[order[0]];

        let mut fallbacks: Vec<usize> = order[1..].iter().map(|&k| passing[k]).collect();
        if fallbacks.len() < self.max_fallbacks {
            let mut rest: Vec<usize> = (0..cands.len()).filter(|i| !passing.contains(i)).collect();
            rest.sort_by_key(|&i| (cands[i].inflight_tokens, i));
            fallbacks.extend(rest);
        }
        fallbacks.truncate(self.max_fallbacks);

        let ttft = self.filters.first().cloned().unwrap_or_default();
        let mut report: Vec<CandidateReport> = cands
            .iter()
            .map(|c| CandidateReport {
                affinity: c.affinity(req),
                ttft_ms: ttft.gate_ttft_ms(req, c),
                passed_filter: false,
                score: None,
            })
            .collect();
        for (k, &i) in passing.iter().enumerate() {
            report[i].passed_filter = true;
            report[i].score = Some(totals[k]);
        }

        Some(Decision {
            primary,
            fallbacks,
            branch,
            cold: no_hit_lru::is_cold(req, cands, &passing),
            report,
            session: presence,
            scorer_scores: scorer_scores.into_boxed_slice(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scheduling::active_request::ActiveRequestScorer;
    use crate::scheduling::prefix_cache::PrefixCacheScorer;

    fn req(blocks: u32) -> RequestView {
        RequestView {
            prompt_tokens: u64::from(blocks) * 64,
            total_blocks: blocks,
            block_size_tokens: 64,
            max_output_tokens: None,
            learnt_output_tokens: None,
            tie_key: None,
        }
    }

    fn cand(matched: u32, tokens: u64, requests: u64) -> Candidate {
        Candidate {
            matched_blocks: matched,
            inflight_tokens: tokens,
            inflight_requests: requests,
            ..Default::default()
        }
    }

    #[test]
    fn empty_and_single() {
        let s = Scheduler::default();
        assert_eq!(s.schedule(&req(4), &[], &mut Rng::new(1)), None);
        let d = s
            .schedule(&req(4), &[cand(0, 99, 9)], &mut Rng::new(1))
            .unwrap();
        assert_eq!(
            (d.primary, d.branch, d.fallbacks.len()),
            (0, Branch::Single, 0)
        );
    }

    #[test]
    fn sticky_beats_less_loaded_cold_endpoint_until_gap() {
        let s = Scheduler::default();
        // Warm endpoint 1 has more load than cold 0, within τ ≈ 286,704 tokens.
        let c = [cand(0, 0, 0), cand(100, 200_000, 3), cand(0, 10, 1)];
        let d = s.schedule(&req(100), &c, &mut Rng::new(1)).unwrap();
        assert_eq!((d.primary, d.branch), (1, Branch::Sticky));
        assert_eq!(d.fallbacks, vec![0, 2]);
        assert!(!d.cold);
        // Past τ the gate releases and token load picks the idle endpoint.
        let c = [cand(0, 0, 0), cand(100, 300_000, 3), cand(0, 10, 1)];
        let d = s.schedule(&req(100), &c, &mut Rng::new(1)).unwrap();
        assert_eq!((d.primary, d.branch), (0, Branch::SaturationRelease));
    }

    #[test]
    fn lookahead_prefers_warm_at_equal_inflight_load_without_filter() {
        let s = Scheduler {
            filters: vec![],
            ..Default::default()
        };
        let c = [cand(0, 500, 1), cand(50, 500, 1)];
        let d = s.schedule(&req(100), &c, &mut Rng::new(1)).unwrap();
        assert_eq!((d.primary, d.branch), (1, Branch::Unfiltered));
    }

    #[test]
    fn active_request_profile() {
        let s = Scheduler {
            scorers: vec![(Scorer::ActiveRequest(ActiveRequestScorer::default()), 1.0)],
            ..Default::default()
        };
        let d = s
            .schedule(
                &req(1),
                &[cand(0, 0, 5), cand(0, 1_000_000, 2), cand(0, 0, 7)],
                &mut Rng::new(3),
            )
            .unwrap();
        assert_eq!((d.primary, d.branch), (1, Branch::NoAffinity));
        assert_eq!(d.fallbacks, vec![0, 2]);
    }

    #[test]
    fn legacy_blend_weights() {
        use crate::scheduling::EndpointMetrics;
        let s = Scheduler {
            filters: vec![],
            scorers: vec![
                (Scorer::PrefixCache(PrefixCacheScorer::default()), 3.0),
                (Scorer::Queue, 2.0),
                (Scorer::KvCacheUtilization, 2.0),
                (Scorer::NoHitLru, 2.0),
            ],
            ..Default::default()
        };
        let m = |w: f64, u: f64| {
            Some(EndpointMetrics {
                waiting_requests: w,
                running_requests: 0.0,
                kv_cache_usage: u,
                kv_capacity_tokens: 0,
            })
        };
        // e0: full hit, busy queue; e1: no hit, idle.
        let c = [
            Candidate {
                matched_blocks: 10,
                metrics: m(10.0, 0.9),
                ..Default::default()
            },
            Candidate {
                matched_blocks: 0,
                metrics: m(0.0, 0.1),
                ..Default::default()
            },
        ];
        let d = s.schedule(&req(10), &c, &mut Rng::new(1)).unwrap();
        // e0 = 3×1 + 2×0 + 2×0.1 + 2×0.5 = 4.2; e1 = 0 + 2×1 + 2×0.9 + 2×0.5 = 4.8.
        let s0 = d.report[0].score.unwrap();
        let s1 = d.report[1].score.unwrap();
        assert!(
            (s0 - 4.2).abs() < 1e-9 && (s1 - 4.8).abs() < 1e-9,
            "{s0} {s1}"
        );
        assert_eq!(d.primary, 1);
    }

    /// `skipReleased`: a request with no sticky endpoint is drawn to a
    /// partial holder (half its prompt held: under the threshold), while a
    /// gate-released one is placed by load alone.
    #[test]
    fn skip_released_prefix_scores_no_affinity_requests_too() {
        let s = |skip_released, sticky_only| Scheduler {
            scorers: vec![
                (
                    Scorer::TokenLoad(TokenLoadScorer {
                        queue_threshold_tokens: 32_768.0,
                    }),
                    1.0,
                ),
                (
                    Scorer::PrefixCache(PrefixCacheScorer {
                        skip_released,
                        sticky_only,
                        ..Default::default()
                    }),
                    0.5,
                ),
            ],
            ..Default::default()
        };
        // 6 of 12 blocks held on endpoint 1, a little more load there.
        let c = [cand(0, 0, 0), cand(6, 1000, 1), cand(0, 0, 0)];
        let d = s(true, false)
            .schedule(&req(12), &c, &mut Rng::new(1))
            .unwrap();
        assert_eq!((d.primary, d.branch), (1, Branch::NoAffinity));
        let d = s(false, true)
            .schedule(&req(12), &c, &mut Rng::new(1))
            .unwrap();
        assert_ne!(d.primary, 1, "stickyOnly leaves it to load");
        // Released: neutral, as with stickyOnly.
        let c = [cand(10, 300_000, 3), cand(12, 300_000, 3), cand(0, 0, 0)];
        let d = s(true, false)
            .schedule(&req(12), &c, &mut Rng::new(1))
            .unwrap();
        assert_eq!((d.primary, d.branch), (2, Branch::SaturationRelease));
        let parts: Vec<f64> = d.report.iter().map(|r| r.score.unwrap()).collect();
        let e = s(false, true)
            .schedule(&req(12), &c, &mut Rng::new(1))
            .unwrap();
        let same: Vec<f64> = e.report.iter().map(|r| r.score.unwrap()).collect();
        assert_eq!(parts, same);
    }

    #[test]
    fn sticky_only_prefix_scores_the_sticky_branch_alone() {
        let s = |sticky_only| Scheduler {
            scorers: vec![
                (
                    Scorer::TokenLoad(TokenLoadScorer {
                        queue_threshold_tokens: 32_768.0,
                    }),
                    1.0,
                ),
                (
                    Scorer::PrefixCache(PrefixCacheScorer {
                        sticky_only,
                        ..Default::default()
                    }),
                    0.5,
                ),
            ],
            ..Default::default()
        };
        let load_only = Scheduler {
            scorers: vec![(
                Scorer::TokenLoad(TokenLoadScorer {
                    queue_threshold_tokens: 32_768.0,
                }),
                1.0,
            )],
            ..Default::default()
        };
        // Both warm endpoints are sticky (10/12 and 12/12 blocks); load alone
        // sends the repeat to the one without its last blocks, the longer
        // match keeps it where all of it is held.
        let c = [cand(10, 0, 0), cand(12, 2000, 1), cand(0, 0, 0)];
        let d = load_only.schedule(&req(12), &c, &mut Rng::new(1)).unwrap();
        assert_eq!((d.primary, d.branch), (0, Branch::Sticky));
        for only in [true, false] {
            let d = s(only).schedule(&req(12), &c, &mut Rng::new(1)).unwrap();
            assert_eq!((d.primary, d.branch), (1, Branch::Sticky));
        }
        // Gate-released: every candidate scores 1 with stickyOnly, the plain
        // scorer still ranks by affinity.
        let c = [cand(10, 300_000, 3), cand(12, 300_000, 3), cand(0, 0, 0)];
        let prefix_part = |only: bool| {
            let d = s(only).schedule(&req(12), &c, &mut Rng::new(1)).unwrap();
            assert_eq!((d.primary, d.branch), (2, Branch::SaturationRelease));
            let l = load_only.schedule(&req(12), &c, &mut Rng::new(1)).unwrap();
            (0..3)
                .map(|i| d.report[i].score.unwrap() - l.report[i].score.unwrap())
                .collect::<Vec<f64>>()
        };
        assert!(prefix_part(true).iter().all(|p| (p - 0.5).abs() < 1e-9));
        let plain = prefix_part(false);
        assert!((plain[0] - 0.5 * 10.0 / 12.0).abs() < 1e-9, "{plain:?}");
        assert!(
            (plain[1] - 0.5).abs() < 1e-9 && plain[2].abs() < 1e-9,
            "{plain:?}"
        );
        // No affinity anywhere: neutral too.
        let c = [cand(1, 0, 0), cand(0, 0, 0)];
        let d = s(true).schedule(&req(12), &c, &mut Rng::new(1)).unwrap();
        let l = load_only.schedule(&req(12), &c, &mut Rng::new(1)).unwrap();
        assert_eq!(d.branch, Branch::NoAffinity);
        for i in 0..2 {
            let part = d.report[i].score.unwrap() - l.report[i].score.unwrap();
            assert!((part - 0.5).abs() < 1e-9, "{part}");
        }
    }

    #[test]
    fn ties_are_broken_by_the_seeded_rng() {
        let s = Scheduler::default();
        let c = [cand(0, 0, 0), cand(0, 0, 0), cand(0, 0, 0), cand(0, 0, 0)];
        let pick = |seed| {
            s.schedule(&req(3), &c, &mut Rng::new(seed))
                .unwrap()
                .primary
        };
        assert_eq!(pick(17), pick(17));
        let distinct: std::collections::BTreeSet<usize> = (0..64).map(pick).collect();
        assert_eq!(distinct.len(), 4);
    }

    #[test]
    fn fallbacks_respect_the_limit() {
        let s = Scheduler {
            max_fallbacks: 1,
            ..Default::default()
        };
        let c = [cand(10, 0, 0), cand(0, 5, 0), cand(0, 1, 0)];
        let d = s.schedule(&req(10), &c, &mut Rng::new(1)).unwrap();
        assert_eq!((d.primary, d.fallbacks.clone()), (0, vec![2]));
    }
}

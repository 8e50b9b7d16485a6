//! Property tests of the scheduler, the charge and the hashing.

use kvroute_core::blocks::{prompt_blocks, BlockConfig};
use kvroute_core::learners::prefill_rate::PrefillRateParams;
use kvroute_core::request::{ApiKind, InferenceRequest, Prompt};
use kvroute_core::scheduling::active_request::ActiveRequestScorer;
use kvroute_core::scheduling::affinity_filter::{AffinityFilter, LoadSignal};
use kvroute_core::scheduling::charge::InflightConfig;
use kvroute_core::scheduling::max_score::TieBreak;
use kvroute_core::scheduling::prefix_cache::PrefixCacheScorer;
use kvroute_core::scheduling::saturation::KvrouteLoadScorer;
use kvroute_core::scheduling::token_load::TokenLoadScorer;
use kvroute_core::scheduling::{
    Candidate, EndpointMetrics, Picker, RequestView, Rng, Scheduler, Scorer,
};
use proptest::prelude::*;

fn candidate() -> impl Strategy<Value = Candidate> {
    (
        0u32..200,
        0u64..2_000_000,
        0u64..500,
        proptest::option::of((0.0f64..50.0, 0.0f64..50.0, 0.0f64..1.0)),
        proptest::option::of(1u64..1000),
        proptest::option::of(1.0f64..1e6),
        (0u64..=2_000_000, 0u64..1_000_000, 0u64..100_000, 0u64..5000),
    )
        .prop_map(
            |(matched, tokens, requests, m, cold, rate, (prefill, cap, inserted, cap_blocks))| {
                let prefill = prefill.min(tokens);
                Candidate {
                    matched_blocks: matched,
                    // As the engine sets it: 7 past a match at a group start.
                    unresolved_blocks: if matched > 0 && matched % 8 == 0 {
                        7
                    } else {
                        0
                    },
                    inflight_tokens: tokens,
                    inflight_requests: requests,
                    inflight_prefill_tokens: prefill,
                    inflight_held_tokens: tokens - prefill,
                    inserted_blocks: inserted,
                    capacity_blocks: cap_blocks,
                    metrics: m.map(|(w, r, u)| EndpointMetrics {
                        waiting_requests: w,
                        running_requests: r,
                        kv_cache_usage: u,
                        kv_capacity_tokens: cap,
                    }),
                    last_cold_pick: cold,
                    prefill_tokens_per_s: rate,
                    key: 0,
                    lora: Default::default(),
                    session: false,
                }
            },
        )
}

fn scheduler() -> impl Strategy<Value = Scheduler> {
    (
        proptest::bool::ANY,
        0.0f64..=1.0,
        0.0f64..100_000.0,
        1.0f64..100_000.0,
        0.0f64..=1.0,
        0usize..8,
        proptest::bool::ANY,
        0usize..5,
        proptest::bool::ANY,
        0.0f64..4.0,
    )
        .prop_map(
            |(filter, thr, pen, tput, expl, scorer, weighted, fallbacks, out, ratio)| Scheduler {
                filters: if filter {
                    vec![AffinityFilter {
                        affinity_threshold: thr,
                        max_ttft_penalty_ms: pen,
                        peak_prefill_throughput: tput,
                        exploration_probability: expl,
                        max_tokens_in_flight_penalty: 0,
                        count_unresolved_blocks: fallbacks % 2 == 1,
                        // Half the cases read each candidate's estimate.
                        prefill_auto: (tput > 50_000.0).then(PrefillRateParams::default),
                        load_signal: if scorer >= 6 {
                            LoadSignal::Saturation
                        } else {
                            LoadSignal::Inflight
                        },
                    }]
                } else {
                    vec![]
                },
                scorers: vec![(
                    match scorer {
                        0 => Scorer::TokenLoad(TokenLoadScorer::default()),
                        1 => Scorer::ActiveRequest(ActiveRequestScorer::default()),
                        2 => Scorer::Queue,
                        3 => Scorer::KvCacheUtilization,
                        4 => Scorer::PrefixCache(PrefixCacheScorer::default()),
                        5 => Scorer::NoHitLru,
                        6 => Scorer::KvrouteLoad(KvrouteLoadScorer::default()),
                        _ => Scorer::CacheBalance,
                    },
                    1.5,
                )],
                picker: if weighted {
                    Picker::WeightedRandom
                } else if fallbacks % 2 == 0 {
                    // Both tie breaks, keyed off an unrelated draw.
                    Picker::MaxScore(TieBreak::Prefix)
                } else {
                    Picker::MaxScore(TieBreak::Random)
                },
                inflight: InflightConfig {
                    add_estimated_output_tokens: out,
                    output_ratio: ratio,
                    max_estimated_output_tokens: None,
                    hold_kv_until_end: out && ratio > 2.0,
                    learn_output_tokens: out && ratio < 1.0,
                },
                max_fallbacks: fallbacks,
                session: None,
            },
        )
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn decisions_are_well_formed(s in scheduler(), cands in proptest::collection::vec(candidate(), 0..12),
                                 blocks in 0u32..200, extra in 0u64..64, max_out in proptest::option::of(0u64..5000), seed in any::<u64>()) {
        let req = RequestView { prompt_tokens: u64::from(blocks) * 16 + extra, total_blocks: blocks, block_size_tokens: 16, max_output_tokens: max_out, learnt_output_tokens: (extra % 3 == 0).then_some(extra * 100), tie_key: if blocks > 0 { Some(u64::from(blocks) * 31 + extra) } else { None }, };
        let d = s.schedule(&req, &cands, &mut Rng::new(seed));
        if cands.is_empty() {
            prop_assert!(d.is_none());
            return Ok(());
        }
        let d = d.unwrap();
        prop_assert!(d.primary < cands.len());
        prop_assert!(d.report[d.primary].passed_filter);
        prop_assert!(d.fallbacks.len() <= s.max_fallbacks);
        let mut all = d.fallbacks.clone();
        all.push(d.primary);
        all.sort_unstable();
        all.dedup();
        prop_assert_eq!(all.len(), d.fallbacks.len() + 1, "fallbacks distinct and without the primary");
        prop_assert!(all.iter().all(|&i| i < cands.len()));
        // Same seed, same decision.
        prop_assert_eq!(s.schedule(&req, &cands, &mut Rng::new(seed)), Some(d.clone()));
        // The charge never exceeds prompt tokens plus the output estimate.
        let c = s.inflight.charge(&req, &cands[d.primary]);
        prop_assert!(c.prompt_tokens <= req.prompt_tokens);
        // With holdKvUntilEnd the held part also carries the uncached prompt.
        let held_prompt = if s.inflight.hold_kv_until_end { c.prompt_tokens } else { 0 };
        if !s.inflight.add_estimated_output_tokens {
            prop_assert_eq!(c.output_tokens, held_prompt);
        }
        if let Some(m) = max_out {
            prop_assert!(c.output_tokens <= m + held_prompt);
        }
    }

    #[test]
    fn blocks_are_prefix_stable(a in proptest::collection::vec(any::<u8>(), 0..2000), b in proptest::collection::vec(any::<u8>(), 0..500)) {
        let cfg = BlockConfig { block_size_tokens: 4, chars_per_token: 4, max_prefix_tokens: 0 };
        let req = |p: Vec<u8>| InferenceRequest { kind: ApiKind::Completions, model: "m".into(), prompt: Prompt::Text(p), max_output_tokens: None, stream: false, cache_salt: None, sequences: 1, batch_rest: Default::default() };
        let short = prompt_blocks(&req(a.clone()), &cfg);
        let mut longer = a.clone();
        longer.extend_from_slice(&b);
        let long = prompt_blocks(&req(longer), &cfg);
        prop_assert_eq!(&long.block_hashes[..short.block_hashes.len()], &short.block_hashes[..]);
        prop_assert!(short.prompt_tokens >= short.block_hashes.len() as u64 * 4);
    }
}

// ---------------------------------------------------------------------------
// Flow control's queue: any sequence of pushes, pops, removals and expiries
// keeps its counts equal to what it holds, serves bands in priority order,
// and never loses or duplicates a request.

mod flow_queue {
    use kvroute_core::flow::queue::{Entry, Queue};
    use kvroute_core::flow::{Fairness, Ordering};
    use proptest::prelude::*;
    use std::collections::BTreeSet;

    #[derive(Clone, Debug)]
    enum Op {
        Push {
            band: usize,
            flow: u8,
            bytes: u64,
            ttl: u64,
        },
        Pop,
        Remove(u32),
        Expire(u64),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            4 => (0usize..4, 0u8..4, 0u64..1000, 0u64..100).prop_map(|(band, flow, bytes, ttl)| Op::Push { band, flow, bytes, ttl }),
            2 => Just(Op::Pop),
            1 => (0u32..64).prop_map(Op::Remove),
            1 => (0u64..200).prop_map(Op::Expire),
        ]
    }

    fn policy() -> impl Strategy<Value = (Fairness, Ordering)> {
        (any::<bool>(), any::<bool>()).prop_map(|(rr, edf)| {
            (
                if rr {
                    Fairness::RoundRobin
                } else {
                    Fairness::GlobalStrict
                },
                if edf { Ordering::Edf } else { Ordering::Fcfs },
            )
        })
    }

    proptest! {
        #[test]
        fn counts_order_and_membership_hold(policies in proptest::collection::vec(policy(), 1..4),
                                            ops in proptest::collection::vec(op(), 0..200)) {
            let mut q: Queue<u32> = Queue::new(&policies);
            let bands = policies.len();
            let mut held: BTreeSet<u32> = BTreeSet::new();
            let mut next_id = 0u32;
            let mut now = 0u64;
            for op in ops {
                now += 1;
                match op {
                    Op::Push { band, flow, bytes, ttl } => {
                        q.push(Entry { id: next_id, band, flow: format!("f{flow}"), enqueued_ms: now,
                                       deadline_ms: now + ttl, bytes, seq: 0, item: next_id });
                        held.insert(next_id);
                        next_id += 1;
                    }
                    Op::Pop => {
                        let head = q.head().map(|e| (e.id, e.band));
                        let popped = q.pop_head().map(|e| (e.id, e.band));
                        prop_assert_eq!(head, popped, "pop_head takes what head shows");
                        if let Some((id, band)) = popped {
                            prop_assert!(held.remove(&id));
                            // Nothing waits in a higher band.
                            let loads = q.loads();
                            prop_assert!(loads[..band.min(bands - 1)].iter().all(|l| l.requests == 0));
                        }
                    }
                    Op::Remove(id) => {
                        let gone = q.remove(id).is_some();
                        prop_assert_eq!(gone, held.remove(&id));
                    }
                    Op::Expire(at) => {
                        for e in q.take_if(|e| e.deadline_ms <= at) {
                            prop_assert!(e.deadline_ms <= at);
                            prop_assert!(held.remove(&e.id));
                        }
                    }
                }
                let loads = q.loads();
                prop_assert_eq!(loads.iter().map(|l| l.requests as usize).sum::<usize>(), held.len());
                prop_assert_eq!(q.len(), held.len());
                prop_assert_eq!(q.is_empty(), held.is_empty());
            }
            let drained: BTreeSet<u32> = q.drain().into_iter().map(|e| e.id).collect();
            prop_assert_eq!(drained, held);
            prop_assert!(q.loads().iter().all(|l| l.requests == 0 && l.bytes == 0));
        }
    }
}

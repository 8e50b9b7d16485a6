//! The timing and cache model of one emulated vLLM server, driven in model
//! time without sleeping (a discrete-event loop over `Engine::step`).

use kvroute_sim_model::kv_events::KvEvent;
use kvroute_sim_model::vllm_model::{
    AdmitError, Engine, EngineConfig, EngineRequest, RequestId, TokenOutput,
};
use std::collections::HashMap;

const PEAK: f64 = 20_480.0;

/// A prompt of `blocks` full blocks whose hashes are `base + i`, chained so
/// that two prompts with the same `base` share a prefix.
fn prompt(base: u64, tokens: u32, block_size: u32, output: u32) -> EngineRequest {
    EngineRequest {
        prompt_tokens: tokens,
        block_hashes: (0..(tokens / block_size) as u64)
            .map(|i| base + i)
            .collect(),
        event_token_ids: None,
        first_block_extra_keys: None,
        output_tokens: output,
    }
}

/// Runs until idle; returns each request's outputs with their due times.
fn run(e: &mut Engine, now: &mut f64) -> HashMap<RequestId, Vec<(TokenOutput, f64)>> {
    let mut out: HashMap<RequestId, Vec<(TokenOutput, f64)>> = HashMap::new();
    let mut steps = 0;
    while e.has_work() {
        let r = e.step(*now);
        assert!(
            r.duration_s > 0.0 || !r.outputs.is_empty(),
            "engine stalled: nothing scheduled with work pending"
        );
        *now += r.duration_s;
        for o in r.outputs {
            out.entry(o.id).or_default().push((o, *now));
        }
        steps += 1;
        assert!(steps < 1_000_000, "runaway");
    }
    out
}

fn ttft(outs: &[(TokenOutput, f64)], arrival: f64) -> f64 {
    let (first, t) = &outs[0];
    assert!(first.first);
    t - arrival
}

/// 64-token blocks and no attention term: the linear cost model, so times
/// are `tokens / PEAK` by hand.
fn big_cache() -> EngineConfig {
    let mut c = EngineConfig {
        block_size: 64,
        num_gpu_blocks: 100_000,
        max_model_len: 1_000_000,
        ..EngineConfig::default()
    };
    c.step_cost.prefill_attention_context_tokens = 0.0;
    c
}

#[test]
fn prefill_after_a_cached_prefix_pays_for_attending_to_it() {
    // The default attention term (C = 32,768): a 16,384-token prompt whose
    // first 8192 tokens are cached computes 8192 tokens that attend to
    // 8192·8192 + 8192·8193/2 = 100,667,392 tokens: (8192 + 100,667,392 /
    // 32,768) / 20,480 = 0.550006 s, against 0.450006 s for 8192 cold ones.
    let mut cfg = big_cache();
    cfg.step_cost.prefill_attention_context_tokens = 32_768.0;
    let mut e = Engine::new(cfg, false);
    let mut now = 0.0;
    let a = e.add_request(prompt(1, 8192 + 64, 64, 1), now).unwrap();
    let cold = ttft(&run(&mut e, &mut now)[&a], 0.0);
    let t0 = now;
    let b = e.add_request(prompt(1, 16_384, 64, 1), now).unwrap();
    let outs = run(&mut e, &mut now);
    assert_eq!(outs[&b][0].0.cached_tokens, 8192 + 64);
    let warm = ttft(&outs[&b], t0);
    let want = (8128.0 + (8128.0 * 8256.0 + 8128.0 * 8129.0 / 2.0) / 32_768.0) / PEAK;
    assert!((warm - want).abs() < 1e-9, "{warm} vs {want}");
    // 8256 cold tokens: (8192 + attended(0, 8192)/C) / PEAK, then 64 more
    // after 8192 in a second step.
    assert!(cold > 8256.0 / PEAK, "{cold}");
}

#[test]
fn prefill_time_scales_with_uncached_tokens() {
    let mut ttfts = Vec::new();
    for (i, tokens) in [2048u32, 4096, 8192, 16_384, 32_768]
        .into_iter()
        .enumerate()
    {
        let mut e = Engine::new(big_cache(), false);
        let mut now = 0.0;
        let id = e
            .add_request(prompt(1000 * i as u64, tokens, 64, 1), now)
            .unwrap();
        let outs = run(&mut e, &mut now);
        let t = ttft(&outs[&id], 0.0);
        assert!(
            (t - tokens as f64 / PEAK).abs() < 1e-9,
            "{tokens} tokens: ttft {t}"
        );
        ttfts.push(t);
    }
    // Calibration recipe: B cold tokens with max_tokens=1 gives B/peak.
    assert!((ttfts[2] - 0.4).abs() < 1e-9);
    assert!((ttfts[3] / ttfts[1] - 4.0).abs() < 1e-9);
}

#[test]
fn cache_hits_skip_prefill_and_are_counted_in_tokens() {
    let mut e = Engine::new(big_cache(), false);
    let mut now = 0.0;
    let a = e.add_request(prompt(1, 8192, 64, 1), now).unwrap();
    let cold = ttft(&run(&mut e, &mut now)[&a], 0.0);

    let t0 = now;
    let b = e.add_request(prompt(1, 8192, 64, 1), now).unwrap();
    let outs = run(&mut e, &mut now);
    let warm = ttft(&outs[&b], t0);
    // At most (8192 − 1) / 64 = 127 blocks hit: the last block is recomputed.
    assert_eq!(outs[&b][0].0.cached_tokens, 127 * 64);
    assert!(
        (warm - 0.025).abs() < 1e-9,
        "warm ttft {warm} (one step floor)"
    );
    assert!(cold / warm > 15.0);

    // Sharing only the first half: half the prefill.
    let t1 = now;
    let mut half = prompt(1, 8192, 64, 1);
    for h in &mut half.block_hashes[64..] {
        *h += 1_000_000;
    }
    let c = e.add_request(half, now).unwrap();
    let outs = run(&mut e, &mut now);
    assert_eq!(outs[&c][0].0.cached_tokens, 4096);
    assert!((ttft(&outs[&c], t1) - 4096.0 / PEAK).abs() < 1e-9);

    assert_eq!(e.counters.prefix_cache_queries, 3 * 8192);
    assert_eq!(e.counters.prefix_cache_hits, 127 * 64 + 4096);
    assert_eq!(e.counters.prompt_tokens, 3 * 8192);
}

fn small_cache() -> EngineConfig {
    // 64 blocks × 16 tokens = 1024 tokens of KV.
    EngineConfig {
        block_size: 16,
        num_gpu_blocks: 64,
        ..EngineConfig::default()
    }
}

#[test]
fn eviction_happens_at_capacity_lru_tail_first() {
    let mut e = Engine::new(small_cache(), true);
    let mut now = 0.0;
    // A and B (32 blocks each) fill the cache; both stay cached when done.
    e.add_request(prompt(100, 512, 16, 1), now).unwrap();
    run(&mut e, &mut now);
    e.add_request(prompt(200, 512, 16, 1), now).unwrap();
    run(&mut e, &mut now);
    assert_eq!(e.cache().num_cached(), 64);
    assert_eq!(e.cache().evictions, 0);
    e.drain_kv_events();

    // C needs 32 blocks: A's are least recently used, so A goes, tail first.
    let c = e.add_request(prompt(300, 512, 16, 1), now).unwrap();
    let mut events = Vec::new();
    while e.has_work() {
        let r = e.step(now);
        now += r.duration_s;
        events.extend(r.kv_events);
    }
    assert_eq!(e.cache().evictions, 32);
    let removed: Vec<u64> = events
        .iter()
        .filter_map(|ev| match ev {
            KvEvent::BlockRemoved { block_hashes, .. } => Some(block_hashes[0]),
            _ => None,
        })
        .collect();
    assert_eq!(removed.len(), 32);
    assert_eq!(removed[0], 131, "A's last block is evicted first");
    assert_eq!(*removed.last().unwrap(), 100);
    let stored: Vec<&KvEvent> = events
        .iter()
        .filter(|ev| matches!(ev, KvEvent::BlockStored { .. }))
        .collect();
    assert_eq!(stored.len(), 1, "{stored:?}");
    let _ = c;

    // B is still there, A is gone.
    let b2 = e.add_request(prompt(200, 512, 16, 1), now).unwrap();
    let outs = run(&mut e, &mut now);
    assert_eq!(outs[&b2][0].0.cached_tokens, 31 * 16);
    let a2 = e.add_request(prompt(100, 512, 16, 1), now).unwrap();
    let outs = run(&mut e, &mut now);
    assert_eq!(outs[&a2][0].0.cached_tokens, 0);
}

#[test]
fn recently_reused_prefix_survives_eviction() {
    let mut e = Engine::new(small_cache(), false);
    let mut now = 0.0;
    e.add_request(prompt(100, 512, 16, 1), now).unwrap();
    run(&mut e, &mut now);
    e.add_request(prompt(200, 512, 16, 1), now).unwrap();
    run(&mut e, &mut now);
    // Reuse A: now B is the least recently used.
    e.add_request(prompt(100, 512, 16, 1), now).unwrap();
    run(&mut e, &mut now);
    e.add_request(prompt(300, 512, 16, 1), now).unwrap();
    run(&mut e, &mut now);
    let a = e.add_request(prompt(100, 512, 16, 1), now).unwrap();
    let outs = run(&mut e, &mut now);
    assert_eq!(outs[&a][0].0.cached_tokens, 31 * 16);
}

#[test]
fn request_that_cannot_get_blocks_waits_until_blocks_are_freed() {
    let mut e = Engine::new(small_cache(), false);
    let mut now = 0.0;
    // Each needs 38 blocks to start; 64 exist, so only one runs at a time.
    let x = e.add_request(prompt(100, 600, 16, 100), now).unwrap();
    let y = e.add_request(prompt(200, 600, 16, 100), now).unwrap();
    let r = e.step(now);
    now += r.duration_s;
    assert_eq!(e.num_running(), 1);
    assert_eq!(e.num_waiting(), 1);
    let outs = run(&mut e, &mut now);
    let x_done = outs[&x].last().unwrap().1;
    let y_first = outs[&y][0].1;
    assert!(
        y_first > x_done,
        "y started at {y_first}, before x finished at {x_done}"
    );
    assert_eq!(outs[&y].len(), 100);
    assert!(outs[&y].last().unwrap().0.finished);
}

#[test]
fn max_num_seqs_caps_the_batch() {
    let mut e = Engine::new(
        EngineConfig {
            max_num_seqs: 2,
            ..big_cache()
        },
        false,
    );
    for i in 0..3 {
        e.add_request(prompt(i * 100, 64, 64, 10), 0.0).unwrap();
    }
    e.step(0.0);
    assert_eq!(e.num_running(), 2);
    assert_eq!(e.num_waiting(), 1);
}

#[test]
fn decode_steps_slow_down_as_the_batch_grows() {
    let itl = |batch: u64| {
        let mut e = Engine::new(big_cache(), false);
        let mut now = 0.0;
        let ids: Vec<_> = (0..batch)
            .map(|i| e.add_request(prompt(i * 1000, 1024, 64, 50), 0.0).unwrap())
            .collect();
        let outs = run(&mut e, &mut now);
        let o = &outs[&ids[0]];
        (o[49].1 - o[1].1) / 48.0
    };
    let one = itl(1);
    let many = itl(128);
    assert!(
        (one - (0.025 + 0.0001 + 1025.0 * 40e-9)).abs() < 1e-4,
        "itl(1) = {one}"
    );
    assert!(many > 1.5 * one, "itl(128) = {many}, itl(1) = {one}");
}

#[test]
fn decode_growth_beyond_the_cache_preempts_and_still_finishes() {
    let mut e = Engine::new(small_cache(), false);
    let mut now = 0.0;
    // Both start (2 × 20 blocks), but growing to 2 × 40 blocks cannot fit.
    let a = e.add_request(prompt(100, 320, 16, 320), now).unwrap();
    let b = e.add_request(prompt(200, 320, 16, 320), now).unwrap();
    let outs = run(&mut e, &mut now);
    assert!(e.counters.preemptions > 0);
    for id in [a, b] {
        assert_eq!(outs[&id].len(), 320, "request {id}");
        assert!(outs[&id].last().unwrap().0.finished);
    }
    assert_eq!(e.cache().num_free(), 64);
}

#[test]
fn chunked_prefill_stores_blocks_as_a_chain() {
    let cfg = EngineConfig {
        max_num_batched_tokens: 256,
        block_size: 16,
        ..big_cache()
    };
    let mut e = Engine::new(cfg, true);
    let mut req = prompt(500, 512, 16, 1);
    req.event_token_ids = Some((0..512u32).collect::<Vec<_>>().into());
    e.add_request(req, 0.0).unwrap();
    let mut stored = Vec::new();
    let mut now = 0.0;
    while e.has_work() {
        let r = e.step(now);
        now += r.duration_s;
        stored.extend(r.kv_events);
    }
    assert_eq!(stored.len(), 2, "two chunks of 256 tokens");
    let KvEvent::BlockStored {
        block_hashes: h0,
        parent_block_hash: p0,
        token_ids: t0,
        ..
    } = &stored[0]
    else {
        panic!()
    };
    let KvEvent::BlockStored {
        block_hashes: h1,
        parent_block_hash: p1,
        token_ids: t1,
        ..
    } = &stored[1]
    else {
        panic!()
    };
    assert_eq!(*p0, None);
    assert_eq!(h0, &(500..516).collect::<Vec<u64>>());
    assert_eq!(*p1, Some(515));
    assert_eq!(h1[0], 516);
    assert_eq!(t0[..3], [0, 1, 2]);
    assert_eq!(t1[0], 256);
    assert!(
        (now - (0.025 + 0.025)).abs() < 1e-9,
        "two 256-token chunks at the floor: {now}"
    );
}

#[test]
fn too_long_requests_are_refused_with_the_limit() {
    let mut e = Engine::new(small_cache(), false);
    let err = e.add_request(prompt(1, 1000, 16, 100), 0.0).unwrap_err();
    assert_eq!(
        err,
        AdmitError::TooLong {
            requested: 1100,
            max_model_len: 1024
        }
    );
}

#[test]
fn aborted_requests_release_their_blocks() {
    let mut e = Engine::new(small_cache(), false);
    let id = e.add_request(prompt(1, 320, 16, 100), 0.0).unwrap();
    e.step(0.0);
    assert!(e.cache().num_free() < 64);
    e.abort(id);
    assert_eq!(e.cache().num_free(), 64);
    assert!(!e.has_work());
}

#[test]
fn same_inputs_same_timeline() {
    let go = || {
        let mut e = Engine::new(small_cache(), true);
        let mut now = 0.0;
        for i in 0..6 {
            e.add_request(prompt(i % 3 * 100, 300 + 16 * i as u32, 16, 40), 0.0)
                .unwrap();
        }
        let mut outs: Vec<_> = run(&mut e, &mut now).into_iter().collect();
        outs.sort_by_key(|(id, _)| *id);
        (now, outs, e.counters.clone())
    };
    assert_eq!(go(), go());
}

#[test]
fn prefill_histograms_give_computed_tokens_over_prefill_time() {
    // vLLM's two per-request prefill histograms, observed at finish:
    // a cold 20480-token prompt is 8192 + 8192 + 4096 tokens of chunked
    // prefill at 20480 tok/s = 1.0 s after it is first scheduled (queueing
    // excluded); its warm repeat computes only the last block.
    let mut e = Engine::new(big_cache(), false);
    let mut now = 0.0;
    e.add_request(prompt(1, 20_480, 64, 3), now).unwrap();
    run(&mut e, &mut now);
    assert_eq!(e.prefill_time.count, 1);
    assert!(
        (e.prefill_time.sum - 1.0).abs() < 1e-9,
        "{}",
        e.prefill_time.sum
    );
    assert_eq!(e.prefill_kv_computed.sum, 20_480.0);
    assert!((e.prefill_kv_computed.sum / e.prefill_time.sum - PEAK).abs() < 1e-6);
    // Two requests at once: the second waits for the first's chunks (queue
    // time, not prefill time), then takes one step of its own.
    let t0 = now;
    e.add_request(prompt(10_000, 8192, 64, 1), t0).unwrap();
    e.add_request(prompt(20_000, 8192, 64, 1), t0).unwrap();
    run(&mut e, &mut now);
    assert_eq!(e.prefill_time.count, 3);
    assert!(
        (e.prefill_time.sum - 1.8).abs() < 1e-9,
        "{}",
        e.prefill_time.sum
    );
    e.add_request(prompt(1, 20_480, 64, 1), now).unwrap();
    run(&mut e, &mut now);
    assert_eq!(e.prefill_kv_computed.sum, 20_480.0 + 2.0 * 8192.0 + 64.0);
    // vLLM's 1-2-5 token buckets up to max_model_len.
    assert_eq!(
        &kvroute_sim_model::vllm_model::buckets_1_2_5(4096)[..],
        &[1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0, 2000.0]
    );
}

//! Workloads and the load generator against an in-process emulated fleet.

use kvroute_core::blocks::{prompt_blocks, BlockConfig};
use kvroute_core::request::{parse_request, ApiKind, ParseLimits};
use kvroute_sim::emulator::{EmulatorConfig, Fleet};
use kvroute_sim::loadgen::client::HttpClient;
use kvroute_sim::loadgen::run::{run, RunConfig};
use kvroute_sim_model::workload::reject::RejectStream;
use kvroute_sim_model::workload::stages::parse_stages;
use kvroute_sim_model::workload::{Api, GenRequest, Workload, WorkloadKind, WorkloadSpec};
use std::time::Duration;

fn blocks(r: &GenRequest) -> Vec<u64> {
    let kind = ApiKind::from_path(r.path).unwrap();
    let body = r.body.to_string();
    let parsed = parse_request(kind, body.as_bytes(), &ParseLimits::default()).unwrap();
    prompt_blocks(
        &parsed,
        &BlockConfig {
            block_size_tokens: 64,
            chars_per_token: 4,
            max_prefix_tokens: 0,
        },
    )
    .block_hashes
}

fn shared_len(a: &[u64], b: &[u64]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

#[test]
fn prompts_have_the_stated_lengths_and_depend_only_on_the_seed() {
    for kind in [
        WorkloadKind::SharedPrefix,
        WorkloadKind::CodeGeneration,
        WorkloadKind::Reasoning,
        WorkloadKind::ChatLab,
    ] {
        let spec = WorkloadSpec::standard(kind);
        let mut a = Workload::new(spec.clone(), 7);
        let mut b = Workload::new(spec.clone(), 7);
        let mut c = Workload::new(spec.clone(), 8);
        let ra = a.next_request();
        assert_eq!(ra.body, b.next_request().body, "{kind:?}");
        assert_ne!(ra.body, c.next_request().body, "{kind:?}");
        assert_eq!(ra.body["max_tokens"], spec.output_tokens);
        let bytes = |t: u32| (f64::from(t) * spec.chars_per_token).round() as usize;
        let first_turn =
            bytes(spec.system_tokens) + bytes(spec.persona_tokens) + bytes(spec.question_tokens);
        // The persona is joined to the system prompt by one newline.
        let slack = usize::from(spec.persona_tokens > 0);
        assert_eq!(ra.prompt_bytes, first_turn + slack, "{kind:?}");
        let text: String = ra.body["messages"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| m["content"].as_str().unwrap())
            .collect();
        assert!(
            text.split_whitespace().count() > first_turn / 8,
            "{kind:?}: made of words"
        );
    }
}

#[test]
fn shared_prefix_groups_share_their_system_prompt_blocks_only() {
    let spec = WorkloadSpec {
        groups: 3,
        prompts_per_group: 4,
        ..WorkloadSpec::standard(WorkloadKind::SharedPrefix)
    };
    let mut w = Workload::new(spec, 1);
    let reqs: Vec<GenRequest> = (0..40).map(|_| w.next_request()).collect();
    let groups: std::collections::BTreeSet<u32> = reqs.iter().map(|r| r.group).collect();
    assert_eq!(groups.len(), 3);
    let a = &reqs[0];
    let same = reqs[1..]
        .iter()
        .find(|r| r.group == a.group && r.body != a.body)
        .unwrap();
    let other = reqs.iter().find(|r| r.group != a.group).unwrap();
    let (ba, bs, bo) = (blocks(a), blocks(same), blocks(other));
    // 6000 system tokens × 2.17 bytes = 13,020 bytes: 50 of the router's
    // blocks of 64 × 4 bytes (plus the role marker).
    assert!(shared_len(&ba, &bs) >= 49, "{}", shared_len(&ba, &bs));
    assert!(shared_len(&ba, &bs) < ba.len());
    assert_eq!(shared_len(&ba, &bo), 0);
}

#[test]
fn multi_turn_workloads_extend_their_own_prefix() {
    for kind in [WorkloadKind::CodeGeneration, WorkloadKind::ChatLab] {
        let spec = WorkloadSpec {
            groups: 1,
            prompts_per_group: 4,
            ..WorkloadSpec::standard(kind)
        };
        let mut w = Workload::new(spec.clone(), 3);
        let turns: Vec<GenRequest> = (0..4).map(|_| w.next_request()).collect();
        for k in 1..4 {
            let (prev, next) = (blocks(&turns[k - 1]), blocks(&turns[k]));
            assert!(next.len() > prev.len(), "{kind:?} turn {k}");
            // All but the last (partly filled) block of the previous turn.
            assert!(
                shared_len(&prev, &next) + 1 >= prev.len(),
                "{kind:?} turn {k}"
            );
        }
        // After the last turn the conversation starts over as a new one.
        let restart = w.next_request();
        assert_eq!(
            restart.body["messages"].as_array().unwrap().len(),
            2,
            "{kind:?}"
        );
    }
    // chat-lab users share the system prompt, not the persona.
    let mut w = Workload::new(WorkloadSpec::standard(WorkloadKind::ChatLab), 5);
    let reqs: Vec<GenRequest> = (0..30).map(|_| w.next_request()).collect();
    let a = &reqs[0];
    let b = reqs.iter().find(|r| r.group != a.group).unwrap();
    let shared = shared_len(&blocks(a), &blocks(b));
    assert!(
        (2..=4).contains(&shared),
        "250-token system prompt ≈ 3-4 blocks, got {shared}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_reports_counter_based_hit_ratio_and_per_endpoint_shares() {
    let emu = EmulatorConfig {
        time_scale: 50.0,
        ..EmulatorConfig::default()
    };
    let fleet = Fleet::start(&emu, &[0, 0]).await.unwrap();
    let eps: Vec<String> = fleet.addrs().iter().map(|a| a.to_string()).collect();
    let workload = WorkloadSpec {
        groups: 2,
        prompts_per_group: 2,
        system_tokens: 1000,
        question_tokens: 100,
        output_tokens: 8,
        api: Api::Completions,
        ..WorkloadSpec::standard(WorkloadKind::SharedPrefix)
    };
    let cfg = RunConfig {
        target: format!("http://{}", eps[0]),
        endpoints: eps.clone(),
        workload,
        seed: 11,
        stages: parse_stages("rate:10@3s;concurrency:2@10s").unwrap(),
        time_scale: 50.0,
        request_timeout: Duration::from_secs(10),
        reset: true,
        ceiling_block_size: Some(64),
        router_stats: None,
        reject_stream: None,
    };
    let report = run(cfg, &|_| {}).await.unwrap();
    assert_eq!(report.stages.len(), 2);
    for s in &report.stages {
        assert!(s.requests >= 3, "{}: {} requests", s.stage, s.requests);
        assert_eq!(s.errors, 0, "{:?}", s.error_kinds);
        assert!(s.ttft_s.p50.unwrap() > 0.0);
        assert!(s.input_tokens_per_s > 0.0 && s.output_tokens_per_s > 0.0);
        // All traffic went to endpoint 0, whose counters agree with usage.
        assert_eq!(s.endpoints[0].requests, s.requests);
        assert_eq!(s.endpoints[1].prefix_cache_queries, 0.0);
        let (hr, cr) = (s.hit_ratio.unwrap(), s.client_cached_ratio.unwrap());
        assert!((hr - cr).abs() < 1e-9, "{hr} vs {cr}");
        assert_eq!(s.emulator_host_lag_s.map(|l| l < s.span_s), Some(true));
    }
    // Four distinct prompts: once warm, almost everything is cached.
    assert!(report.stages[1].hit_ratio.unwrap() > 0.8);
    // The stream's ceiling is reported, and warm it is as high.
    assert!(report.stages[0].hit_ratio_ceiling.unwrap() > 0.0);
    assert!(report.stages[1].hit_ratio_ceiling.unwrap() > 0.8);

    // Counters that cannot be read make the ratio unknown, not wrong.
    let c = HttpClient::new();
    c.post(
        &format!("http://{}/emulator/metrics-mode", eps[1]),
        "500",
        &[],
    )
    .await
    .unwrap();
    let cfg = RunConfig {
        target: format!("http://{}", eps[0]),
        endpoints: eps.clone(),
        workload: WorkloadSpec {
            output_tokens: 2,
            ..WorkloadSpec::standard(WorkloadKind::Reasoning)
        },
        seed: 1,
        stages: parse_stages("concurrency:1@1s").unwrap(),
        time_scale: 50.0,
        request_timeout: Duration::from_secs(10),
        reset: false,
        ceiling_block_size: None,
        router_stats: None,
        reject_stream: None,
    };
    let report = run(cfg, &|_| {}).await.unwrap();
    assert_eq!(report.stages[0].hit_ratio, None);
    assert_eq!(report.stages[0].hit_ratio_ceiling, None);
    assert!(report.stages[0].endpoints[0].hit_ratio.is_some());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reject_stream_is_answered_400_and_leaves_the_servers_counters_alone() {
    let mut emu = EmulatorConfig {
        time_scale: 50.0,
        ..EmulatorConfig::default()
    };
    emu.engine.max_model_len = 4096;
    let fleet = Fleet::start(&emu, &[0]).await.unwrap();
    let eps: Vec<String> = fleet.addrs().iter().map(|a| a.to_string()).collect();
    let cfg = RunConfig {
        target: format!("http://{}", eps[0]),
        endpoints: eps.clone(),
        workload: WorkloadSpec {
            groups: 2,
            prompts_per_group: 2,
            system_tokens: 1000,
            question_tokens: 100,
            output_tokens: 8,
            ..WorkloadSpec::standard(WorkloadKind::SharedPrefix)
        },
        seed: 5,
        stages: parse_stages("rate:10@3s").unwrap(),
        time_scale: 50.0,
        request_timeout: Duration::from_secs(10),
        reset: true,
        ceiling_block_size: None,
        router_stats: None,
        reject_stream: Some(RejectStream {
            rate: 10.0,
            tokens: 6000,
        }),
    };
    let report = run(cfg, &|_| {}).await.unwrap();
    let s = &report.stages[0];
    let r = s.reject_stream.clone().unwrap();
    assert!(r.sent >= 5, "{r:?}");
    assert_eq!(r.rejected, r.sent, "{r:?}");
    // The workload alone is in the stage's figures, and the servers counted
    // only its prompts.
    assert_eq!(s.errors, 0, "{:?}", s.error_kinds);
    assert_eq!(s.endpoints[0].requests, s.requests);
    let (hr, cr) = (s.hit_ratio.unwrap(), s.client_cached_ratio.unwrap());
    assert!((hr - cr).abs() < 1e-9, "{hr} vs {cr}");
    let stats = HttpClient::new()
        .get(&format!("http://{}/emulator/stats", eps[0]))
        .await
        .unwrap()
        .json()
        .unwrap();
    assert_eq!(stats["requests"].as_u64(), Some(s.requests), "{stats}");
}

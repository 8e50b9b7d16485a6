//! `kvroute-calibrate` against the emulator over real HTTP on loopback: it
//! must recover the emulator's configured prefill rate.
//!
//! The emulator prefills at `--prefill-tps` in model time; with time scale
//! k its wall-clock TTFT is model TTFT / k, so the wall-clock measurement is
//! k × the rate. A request of B = `max_num_batched_tokens` cold tokens is one
//! engine step of B / rate (the 25 ms step floor is hidden below
//! 12000 × 0.025 = 300 tokens at this rate), so what is left over is the
//! request path outside the model: HTTP on loopback, JSON of 8192 IDs and
//! their block hashes, about 5–10 ms in a debug build against a 683 ms
//! TTFT (time scale 1; at scale 2 the same overhead doubles the error).
//!
//! The emulator's prefill cost grows with the attended context
//! (`StepCost::prefill_attention_context_tokens`), so what calibration
//! measures is the effective rate for B-token prompts, [`effective_rate`],
//! about 11 % below the configured peak at B = 8192.

use kvroute_core::config::Config;
use kvroute_sim::calibrate::{self, CalibrateConfig};
use kvroute_sim::emulator::{EmulatorConfig, Fleet};
use kvroute_sim_model::vllm_model::step_cost::attended_context;
use kvroute_sim_model::vllm_model::{EngineConfig, StepCost};

const RATE: f64 = 12_000.0;
const SCALE: f64 = 1.0;

fn emulator() -> EmulatorConfig {
    EmulatorConfig {
        time_scale: SCALE,
        engine: EngineConfig {
            step_cost: StepCost {
                prefill_tokens_per_s: RATE,
                ..StepCost::default()
            },
            ..EngineConfig::default()
        },
        ..EmulatorConfig::default()
    }
}

/// B cold tokens in one step: `(B + attended(0, B) / C) / RATE` seconds.
fn effective_rate(b: u32) -> f64 {
    let c = StepCost::default().prefill_attention_context_tokens;
    let b = u64::from(b);
    RATE * b as f64 / (b as f64 + attended_context(0, b) as f64 / c)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn recovers_the_emulators_prefill_rate() {
    let fleet = Fleet::start(&emulator(), &[0]).await.unwrap();
    let cfg = CalibrateConfig {
        base_url: format!("http://{}/v1", fleet.addrs()[0]),
        tokens: 8192,
        requests: 7,
        warmup: 1,
        ttft_tolerance_ms: 5000.0,
        ..CalibrateConfig::default()
    };
    let c = calibrate::run(&cfg).await.unwrap();
    assert_eq!(c.model, "tiny", "the model comes from /v1/models");
    assert_eq!(c.ttft_s.len(), 7);
    let model_rate = c.peak_prefill_throughput / SCALE;
    let want = effective_rate(8192);
    let err = (model_rate - want).abs() / want;
    println!(
        "measured {:.0} tok/s wall = {model_rate:.0} model tok/s vs {want:.0} effective ({RATE} peak; {:.2}% off)",
        c.peak_prefill_throughput,
        err * 100.0
    );
    assert!(err < 0.04, "{model_rate} vs {want}");
    // Every request was cold: each one took the full prefill, none hit.
    let [min, ..] = calibrate::spread(&c.ttft_s);
    assert!(min > 0.9 * 8192.0 / RATE / SCALE, "{:?}", c.ttft_s);
    let stats = kvroute_sim::loadgen::client::HttpClient::new()
        .get(&format!("http://{}/emulator/stats", fleet.addrs()[0]))
        .await
        .unwrap()
        .json()
        .unwrap();
    assert_eq!(stats["requests"], 8);
    assert_eq!(stats["cached_tokens"], 0, "{stats}");
    // The printed snippets are plugin entries kvroute accepts.
    let report = calibrate::report(&c, cfg.ttft_tolerance_ms);
    let snippets: Vec<&str> = report.lines().filter(|l| l.starts_with('{')).collect();
    assert_eq!(snippets.len(), 2, "{report}");
    for s in snippets {
        let plugin: serde_json::Value = serde_json::from_str(s).unwrap();
        let doc = serde_json::json!({
            "endpoints": {"static": ["127.0.0.1:1"]},
            "plugins": [plugin, {"type": "token-load-scorer"}],
            "schedulingProfiles": [{"name": "d", "plugins": [
                {"pluginRef": "prefix-cache-affinity-filter"}, {"pluginRef": "token-load-scorer"}]}],
        });
        let config = Config::from_json(doc.to_string().as_bytes()).unwrap();
        let f = &config.scheduler.filters[0];
        assert_eq!(f.max_ttft_penalty_ms, 5000.0);
        assert_eq!(f.peak_prefill_throughput, c.peak_prefill_throughput.round());
    }
    fleet.shutdown();
}

/// Runs the binary off the runtime's threads (the emulator serves on them).
async fn calibrate_bin(args: &[&str]) -> std::process::Output {
    let args: Vec<String> = args.iter().map(|s| s.to_string()).collect();
    tokio::task::spawn_blocking(move || {
        std::process::Command::new(env!("CARGO_BIN_EXE_kvroute-calibrate"))
            .args(args)
            .output()
            .unwrap()
    })
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_binary_runs_the_recipe_and_prints_json() {
    let fleet = Fleet::start(&emulator(), &[0]).await.unwrap();
    let url = format!("http://{}", fleet.addrs()[0]);
    let out = calibrate_bin(&[
        "--url",
        &url,
        "--tokens",
        "4096",
        "--requests",
        "3",
        "--warmup",
        "0",
        "--json",
    ])
    .await;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let rate = v["peakPrefillThroughput"].as_f64().unwrap() / SCALE;
    let want = effective_rate(4096);
    assert!((rate - want).abs() / want < 0.05, "{v} vs {want}");
    assert_eq!(v["ttftSeconds"].as_array().unwrap().len(), 3);
    // Bad input: a clear error and exit status 2.
    let bad = calibrate_bin(&["--url", &url, "--tokens", "0"]).await;
    assert_eq!(bad.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&bad.stderr).contains("--tokens"));
    let help = calibrate_bin(&["--help"]).await;
    assert!(String::from_utf8_lossy(&help.stdout).contains("B / median TTFT"));
    fleet.shutdown();
}

//! The emulator over real HTTP on loopback: API shape, timing, counters,
//! faults and control endpoints. Each test starts its own fleet on free
//! ports and runs the model fast (large time scale).

use kvroute_core::blocks::{prompt_blocks, BlockConfig};
use kvroute_core::request::{parse_request, ApiKind, ParseLimits};
use kvroute_core::scheduling::Rng;
use kvroute_sim::emulator::tokenize::Tokenization;
use kvroute_sim::emulator::{EmulatorConfig, Fleet};
use kvroute_sim::loadgen::client::HttpClient;
use kvroute_sim_model::prometheus::{find, parse};
use kvroute_sim_model::vllm_model::EngineConfig;
use kvroute_sim_model::words::text_of_bytes;
use serde_json::{json, Value};
use std::time::{Duration, Instant};

/// The stand-in server most tests here check by hand: text counted as
/// `bytes / 4` tokens (`--tokenizer estimate`), 64-token blocks, and the
/// linear prefill cost. [`honest_cfg`] is the default emulator.
fn cfg(time_scale: f64) -> EmulatorConfig {
    let mut engine = EngineConfig {
        block_size: 64,
        num_gpu_blocks: 4096,
        ..EngineConfig::default()
    };
    engine.step_cost.prefill_attention_context_tokens = 0.0;
    EmulatorConfig {
        time_scale,
        engine,
        tokenizer: Tokenization::Estimate,
        ..EmulatorConfig::default()
    }
}

/// The default emulator: the tiny BPE tokenizer and 16-token blocks.
fn honest_cfg(time_scale: f64) -> EmulatorConfig {
    EmulatorConfig {
        time_scale,
        ..EmulatorConfig::default()
    }
}

#[tokio::test]
async fn text_and_chat_prompts_count_the_tokenizers_tokens_in_16_token_blocks() {
    let (_f, urls) = fleet(&honest_cfg(100.0), 1).await;
    let Tokenization::Model(tok) = Tokenization::tiny() else {
        unreachable!()
    };
    let c = HttpClient::new();
    let prompt = text_of_bytes(3000, &mut Rng::new(21));
    // Completions: the prompt as given (the tiny BPE adds no special tokens).
    let want = tok.encode(&prompt, true).unwrap().len() as u64;
    let url = format!("{}/v1/completions", urls[0]);
    let first = c
        .post(&url, completion(&prompt, 1, false), &[])
        .await
        .unwrap()
        .json()
        .unwrap();
    assert_eq!(first["usage"]["prompt_tokens"], want);
    // Not the router's estimate: this text is about 2.2 bytes per token.
    assert!(want > 3000 / 3, "{want}");
    let second = c
        .post(&url, completion(&prompt, 1, false), &[])
        .await
        .unwrap()
        .json()
        .unwrap();
    assert_eq!(
        second["usage"]["prompt_tokens_details"]["cached_tokens"],
        (want - 1) / 16 * 16
    );
    // Chat: the chat template's text, tokenized.
    let body = json!({"model": "tiny", "max_tokens": 1,
                      "messages": [{"role": "system", "content": prompt}, {"role": "user", "content": "hi"}]});
    let rendered = format!("<s>system: {prompt}\n<s>user: hi\n<s>assistant: ");
    let want = tok.encode(&rendered, false).unwrap().len() as u64;
    let r = c
        .post(
            &format!("{}/v1/chat/completions", urls[0]),
            body.to_string(),
            &[],
        )
        .await
        .unwrap()
        .json()
        .unwrap();
    assert_eq!(r["usage"]["prompt_tokens"], want);
    // A template error is vLLM's 400, not a crash.
    let bad = json!({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "continue_final_message": true});
    let r = c
        .post(
            &format!("{}/v1/chat/completions", urls[0]),
            bad.to_string(),
            &[],
        )
        .await
        .unwrap();
    assert_eq!(r.status, 400, "{}", r.text());
}

async fn fleet(c: &EmulatorConfig, n: usize) -> (Fleet, Vec<String>) {
    let f = Fleet::start(c, &vec![0; n]).await.unwrap();
    let urls = f.addrs().iter().map(|a| format!("http://{a}")).collect();
    (f, urls)
}

fn completion(prompt: &str, max_tokens: u32, stream: bool) -> String {
    json!({"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "stream": stream,
           "stream_options": {"include_usage": true}})
    .to_string()
}

/// SSE `data:` payloads of a body, in order.
fn sse_events(body: &[u8]) -> Vec<String> {
    String::from_utf8_lossy(body)
        .split("\n\n")
        .filter_map(|e| e.strip_prefix("data: ").map(str::to_owned))
        .collect()
}

#[tokio::test]
async fn every_route_answers_with_the_served_by_header() {
    let (f, urls) = fleet(&cfg(100.0), 2).await;
    let c = HttpClient::new();
    for (i, u) in urls.iter().enumerate() {
        let want = f.addrs()[i].to_string();
        for r in [
            c.get(&format!("{u}/health")).await.unwrap(),
            c.get(&format!("{u}/v1/models")).await.unwrap(),
            c.get(&format!("{u}/metrics")).await.unwrap(),
            c.get(&format!("{u}/emulator/stats")).await.unwrap(),
            c.get(&format!("{u}/nope")).await.unwrap(),
            c.post(
                &format!("{u}/v1/completions"),
                completion("hi there", 2, false),
                &[],
            )
            .await
            .unwrap(),
        ] {
            assert_eq!(r.header("x-kvroute-served-by"), Some(want.as_str()));
        }
    }
    let models = c
        .get(&format!("{}/v1/models", urls[0]))
        .await
        .unwrap()
        .json()
        .unwrap();
    assert_eq!(models["data"][0]["id"], "tiny");
    assert_eq!(
        c.get(&format!("{}/nope", urls[0])).await.unwrap().status,
        404
    );
}

#[tokio::test]
async fn streaming_chat_sends_role_tokens_usage_and_done_like_vllm() {
    let (_f, urls) = fleet(&cfg(100.0), 1).await;
    let c = HttpClient::new();
    let body = json!({"model": "tiny", "stream": true, "max_completion_tokens": 5,
        "stream_options": {"include_usage": true},
        "messages": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hello?"}]});
    let r = c
        .post_timed(
            &format!("{}/v1/chat/completions", urls[0]),
            body.to_string(),
            &[],
            Duration::from_secs(10),
        )
        .await
        .unwrap();
    assert_eq!(r.status, 200);
    assert!(r.headers["content-type"]
        .to_str()
        .unwrap()
        .starts_with("text/event-stream"));
    assert!(r.body_error.is_none());
    let events = sse_events(&r.body());
    assert_eq!(events.last().unwrap(), "[DONE]");
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    assert_eq!(chunks[0]["object"], "chat.completion.chunk");
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let content: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert_eq!(content.split_whitespace().count(), 5, "{content:?}");
    let finish: Vec<&Value> = chunks
        .iter()
        .map(|c| &c["choices"][0]["finish_reason"])
        .collect();
    assert_eq!(
        finish
            .iter()
            .filter(|f| f.as_str() == Some("length"))
            .count(),
        1
    );
    let usage = &chunks.last().unwrap()["usage"];
    assert_eq!(chunks.last().unwrap()["choices"], json!([]));
    assert_eq!(usage["completion_tokens"], 5);
    assert_eq!(usage["prompt_tokens_details"]["cached_tokens"], 0);
    assert!(usage["prompt_tokens"].as_u64().unwrap() > 0);

    // Without include_usage there is no usage chunk.
    let body = json!({"model": "tiny", "stream": true, "max_tokens": 2, "prompt": "abc"});
    let r = c
        .post_timed(
            &format!("{}/v1/completions", urls[0]),
            body.to_string(),
            &[],
            Duration::from_secs(10),
        )
        .await
        .unwrap();
    let events = sse_events(&r.body());
    assert_eq!(events.len(), 3, "{events:?}");
    assert!(!events.iter().any(|e| e.contains("usage")));
}

#[tokio::test]
async fn cached_tokens_follow_the_core_block_boundaries() {
    let c_cfg = cfg(100.0);
    let (_f, urls) = fleet(&c_cfg, 1).await;
    let c = HttpClient::new();
    // 10.5 blocks of 64 tokens × 4 bytes.
    let prompt = text_of_bytes(256 * 10 + 128, &mut Rng::new(9));
    let body = completion(&prompt, 3, false);
    let parsed = parse_request(
        ApiKind::Completions,
        body.as_bytes(),
        &ParseLimits::default(),
    )
    .unwrap();
    let blocks = prompt_blocks(
        &parsed,
        &BlockConfig {
            block_size_tokens: 64,
            chars_per_token: 4,
            max_prefix_tokens: 0,
        },
    );
    let url = format!("{}/v1/completions", urls[0]);
    let first = c
        .post(&url, body.clone(), &[])
        .await
        .unwrap()
        .json()
        .unwrap();
    assert_eq!(first["usage"]["prompt_tokens"], blocks.prompt_tokens);
    assert_eq!(first["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    assert_eq!(first["usage"]["completion_tokens"], 3);
    let second = c.post(&url, body, &[]).await.unwrap().json().unwrap();
    assert_eq!(
        second["usage"]["prompt_tokens_details"]["cached_tokens"],
        blocks.block_hashes.len() as u64 * 64
    );
    // A different salt shares nothing.
    let salted =
        json!({"model": "tiny", "prompt": prompt, "max_tokens": 1, "cache_salt": "t2"}).to_string();
    let third = c.post(&url, salted, &[]).await.unwrap().json().unwrap();
    assert_eq!(third["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
}

#[tokio::test]
async fn ttft_over_http_reflects_uncached_prefill() {
    // Real time: a cold 8192-token prefill takes 0.4 s, a warm one one
    // 25 ms step, leaving room for a loaded host's overheads.
    let (_f, urls) = fleet(&cfg(1.0), 1).await;
    let c = HttpClient::new();
    let prompt = text_of_bytes(8192 * 4, &mut Rng::new(1));
    let url = format!("{}/v1/completions", urls[0]);
    let ttft = |r: &kvroute_sim::loadgen::client::Timed| r.chunks[0].0;
    let cold = c
        .post_timed(
            &url,
            completion(&prompt, 1, true),
            &[],
            Duration::from_secs(10),
        )
        .await
        .unwrap();
    let warm = c
        .post_timed(
            &url,
            completion(&prompt, 1, true),
            &[],
            Duration::from_secs(10),
        )
        .await
        .unwrap();
    assert!(
        ttft(&cold) >= Duration::from_millis(39),
        "cold {:?}",
        ttft(&cold)
    );
    assert!(
        ttft(&warm) * 2 < ttft(&cold),
        "warm {:?} cold {:?}",
        ttft(&warm),
        ttft(&cold)
    );
}

#[tokio::test]
async fn metrics_use_vllm_names_labels_and_agree_with_stats() {
    let (_f, urls) = fleet(&cfg(100.0), 1).await;
    let c = HttpClient::new();
    let prompt = text_of_bytes(256 * 4, &mut Rng::new(2));
    for _ in 0..3 {
        c.post(
            &format!("{}/v1/completions", urls[0]),
            completion(&prompt, 2, false),
            &[],
        )
        .await
        .unwrap();
    }
    let m = c.get(&format!("{}/metrics", urls[0])).await.unwrap();
    assert_eq!(m.status, 200);
    assert!(m.header("content-type").unwrap().starts_with("text/plain"));
    let text = m.text();
    let s = parse(&text).unwrap();
    let lbl = [("engine", "0"), ("model_name", "tiny")];
    assert_eq!(find(&s, "vllm:num_requests_running", &lbl), Some(0.0));
    assert_eq!(find(&s, "vllm:num_requests_waiting", &lbl), Some(0.0));
    let usage = find(&s, "vllm:kv_cache_usage_perc", &lbl).unwrap();
    assert!((0.0..=1.0).contains(&usage));
    // 1024-byte prompt = 256 tokens = 4 blocks; repeats hit (256-1)/64 = 3 blocks.
    assert_eq!(
        find(&s, "vllm:prefix_cache_queries_total", &lbl),
        Some(3.0 * 256.0)
    );
    assert_eq!(
        find(&s, "vllm:prefix_cache_hits_total", &lbl),
        Some(2.0 * 192.0)
    );
    assert_eq!(find(&s, "vllm:prompt_tokens_total", &lbl), Some(768.0));
    assert_eq!(find(&s, "vllm:generation_tokens_total", &lbl), Some(6.0));
    assert_eq!(
        find(&s, "vllm:time_to_first_token_seconds_count", &lbl),
        Some(3.0)
    );
    assert_eq!(
        find(
            &s,
            "vllm:time_to_first_token_seconds_bucket",
            &[("le", "+Inf")]
        ),
        Some(3.0)
    );
    // vLLM's per-request prefill histograms, observed at finish: computed
    // tokens = 256 + 2 × (256 − 192); each prefill is one step at the 25 ms
    // floor (256 tokens / 20480 tok/s is less), in model seconds.
    assert_eq!(
        find(&s, "vllm:request_prefill_kv_computed_tokens_sum", &lbl),
        Some(384.0)
    );
    assert_eq!(
        find(&s, "vllm:request_prefill_kv_computed_tokens_count", &lbl),
        Some(3.0)
    );
    assert_eq!(
        find(&s, "vllm:request_prefill_time_seconds_count", &lbl),
        Some(3.0)
    );
    let prefill_s = find(&s, "vllm:request_prefill_time_seconds_sum", &lbl).unwrap();
    assert!((prefill_s - 0.075).abs() < 1e-9, "{prefill_s}");
    let info = s
        .iter()
        .find(|x| x.name == "vllm:cache_config_info")
        .unwrap();
    assert_eq!(info.label("block_size"), Some("64"));
    assert_eq!(info.label("num_gpu_blocks"), Some("4096"));
    // The same label set as real vLLM 0.32 serves (a missing or extra label
    // is an emulator bug; tests/real checks it against a live server too).
    let capture = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../testdata/vllm/metrics-vllm-0.32-cpu-small-kv.txt"),
    )
    .unwrap();
    let real = parse(&capture).unwrap();
    let real_info = real
        .iter()
        .find(|x| x.name == "vllm:cache_config_info")
        .unwrap();
    let names = |s: &kvroute_sim_model::prometheus::Sample| {
        let mut v: Vec<String> = s.labels.iter().map(|(k, _)| k.clone()).collect();
        v.sort();
        v
    };
    assert_eq!(names(info), names(real_info));
    // The prefill-time histogram has vLLM's buckets.
    let les = |samples: &[kvroute_sim_model::prometheus::Sample]| -> Vec<String> {
        samples
            .iter()
            .filter(|x| x.name == "vllm:request_prefill_time_seconds_bucket")
            .filter_map(|x| x.label("le").map(str::to_owned))
            .collect()
    };
    assert_eq!(les(&s), les(&real));
    assert!(text.contains("# TYPE vllm:request_prefill_time_seconds histogram\n"));
    assert!(text.contains("vllm:num_requests_running{engine=\"0\",model_name=\"tiny\"} 0.0\n"));
    assert!(text.contains("# TYPE vllm:prefix_cache_hits_total counter\n"));
    let stats = c
        .get(&format!("{}/emulator/stats", urls[0]))
        .await
        .unwrap()
        .json()
        .unwrap();
    assert_eq!(stats["requests"], 3);
    assert_eq!(stats["prompt_tokens"], 768);
    assert_eq!(stats["cached_tokens"], 384);
}

#[tokio::test]
async fn metrics_modes_fail_the_way_they_say() {
    let (_f, urls) = fleet(&cfg(100.0), 1).await;
    let c = HttpClient::new();
    let mode = |m: &'static str| {
        let c = c.clone();
        let u = urls[0].clone();
        async move {
            c.post(&format!("{u}/emulator/metrics-mode"), m, &[])
                .await
                .unwrap()
        }
    };
    let metrics = format!("{}/metrics", urls[0]);
    assert_eq!(mode("500").await.status, 200);
    assert_eq!(c.get(&metrics).await.unwrap().status, 500);
    mode("garbage").await;
    let g = c.get(&metrics).await.unwrap();
    assert_eq!(g.status, 200);
    assert!(parse(&g.text()).is_err());
    mode("hang").await;
    let hung = tokio::time::timeout(Duration::from_millis(300), c.get(&metrics)).await;
    assert!(hung.is_err(), "hang mode answered");
    let bad = mode("sometimes").await;
    assert_eq!(bad.status, 400);
    assert!(bad.text().contains("ok, 500, garbage, hang"));
    mode("ok").await;
    assert!(parse(&c.get(&metrics).await.unwrap().text()).is_ok());
}

#[tokio::test]
async fn reset_clears_cache_and_counters() {
    let (_f, urls) = fleet(&cfg(100.0), 1).await;
    let c = HttpClient::new();
    let url = format!("{}/v1/completions", urls[0]);
    let prompt = text_of_bytes(2048, &mut Rng::new(3));
    c.post(&url, completion(&prompt, 1, false), &[])
        .await
        .unwrap();
    let r = c
        .post(&format!("{}/emulator/reset", urls[0]), "", &[])
        .await
        .unwrap();
    assert_eq!(r.status, 200);
    let stats = c
        .get(&format!("{}/emulator/stats", urls[0]))
        .await
        .unwrap()
        .json()
        .unwrap();
    assert_eq!(stats["requests"], 0);
    assert_eq!(stats["cached_blocks"], 0);
    let again = c
        .post(&url, completion(&prompt, 1, false), &[])
        .await
        .unwrap()
        .json()
        .unwrap();
    assert_eq!(again["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
}

#[tokio::test]
async fn fault_headers_fail_requests_as_asked() {
    let (f, urls) = fleet(&cfg(100.0), 1).await;
    let c = HttpClient::new();
    let url = format!("{}/v1/completions", urls[0]);
    let body = completion("some prompt text here", 20, true);

    let r = c
        .post(&url, body.clone(), &[("x-emulator-fail", "500")])
        .await
        .unwrap();
    assert_eq!(r.status, 500);
    assert_eq!(r.json().unwrap()["error"]["code"], 500);
    assert_eq!(
        r.header("x-kvroute-served-by"),
        Some(f.addrs()[0].to_string().as_str())
    );
    let r = c
        .post(&url, body.clone(), &[("x-emulator-fail", "503")])
        .await
        .unwrap();
    assert_eq!(r.status, 503);
    let r = c
        .post(&url, body.clone(), &[("x-emulator-fail", "explode")])
        .await
        .unwrap();
    assert_eq!(r.status, 400);

    let r = c
        .post(
            &url,
            body.clone(),
            &[("x-emulator-fail", "reset-before-first-byte")],
        )
        .await;
    assert!(r.is_err(), "expected a dropped connection, got {r:?}");

    // Long enough (2000 tokens ≥ 0.5 s wall) to be cut off mid-stream.
    let long = completion("some prompt text here", 2000, true);
    let r = c
        .post_timed(
            &url,
            long,
            &[("x-emulator-fail", "reset-after-first-chunk")],
            Duration::from_secs(5),
        )
        .await
        .unwrap();
    assert_eq!(r.status, 200);
    assert_eq!(r.chunks.len(), 1, "{:?}", r.chunks);
    assert!(r.body_error.is_some(), "body ended cleanly");
    assert!(!String::from_utf8_lossy(&r.body()).contains("[DONE]"));

    let t = Instant::now();
    let r = c
        .post(
            &url,
            completion("x y z", 1, false),
            &[("x-emulator-delay-ms", "150")],
        )
        .await
        .unwrap();
    assert_eq!(r.status, 200);
    assert!(t.elapsed() >= Duration::from_millis(150));

    // The emulator is still healthy, and the reset request was aborted.
    tokio::time::sleep(Duration::from_millis(100)).await;
    let stats = c
        .get(&format!("{}/emulator/stats", urls[0]))
        .await
        .unwrap()
        .json()
        .unwrap();
    assert_eq!(stats["running"], 0);
    assert_eq!(stats["requests_aborted"], 1);
    assert!(stats["fault_responses"].as_u64().unwrap() >= 4);
}

#[tokio::test]
async fn bad_requests_get_vllm_style_errors() {
    let mut c_cfg = cfg(100.0);
    c_cfg.engine = EngineConfig {
        block_size: 16,
        num_gpu_blocks: 64,
        ..EngineConfig::default()
    };
    let (_f, urls) = fleet(&c_cfg, 1).await;
    let c = HttpClient::new();
    let url = format!("{}/v1/completions", urls[0]);
    let r = c.post(&url, "{not json", &[]).await.unwrap();
    assert_eq!(r.status, 400);
    assert_eq!(r.json().unwrap()["error"]["type"], "BadRequestError");
    let r = c
        .post(
            &url,
            json!({"model": "other", "prompt": "x"}).to_string(),
            &[],
        )
        .await
        .unwrap();
    assert_eq!(r.status, 404);
    // vLLM's own answer (`OpenAIModelRegistry::check_model`).
    assert_eq!(
        r.json().unwrap(),
        json!({"error": {"message": "The model `other` does not exist. Valid aliases: tiny.",
                         "type": "NotFoundError", "param": "model", "code": 404}})
    );
    let long = text_of_bytes(5000, &mut Rng::new(4));
    let r = c
        .post(&url, completion(&long, 10, false), &[])
        .await
        .unwrap();
    assert_eq!(r.status, 400);
    assert!(
        r.text().contains("maximum context length is 1024"),
        "{}",
        r.text()
    );
}

#[tokio::test]
async fn queued_requests_show_as_waiting_and_client_aborts_free_the_slot() {
    let mut c_cfg = cfg(20.0);
    c_cfg.engine.max_num_seqs = 1;
    let (_f, urls) = fleet(&c_cfg, 1).await;
    let c = HttpClient::new();
    let url = format!("{}/v1/completions", urls[0]);
    // Each decodes 400 tokens at ≥ 25 ms model = 1.25 ms wall: ≥ 0.5 s.
    let mut tasks = Vec::new();
    for i in 0..3 {
        let c = c.clone();
        let url = url.clone();
        tasks.push(tokio::spawn(async move {
            c.post_timed(
                &url,
                completion(&format!("prompt {i}"), 400, true),
                &[],
                Duration::from_millis(250),
            )
            .await
        }));
    }
    tokio::time::sleep(Duration::from_millis(100)).await;
    let s = parse(&c.get(&format!("{}/metrics", urls[0])).await.unwrap().text()).unwrap();
    assert_eq!(find(&s, "vllm:num_requests_running", &[]), Some(1.0));
    assert_eq!(find(&s, "vllm:num_requests_waiting", &[]), Some(2.0));
    // The clients give up after 250 ms; the engine must drop their requests.
    for t in tasks {
        let _ = t.await.unwrap();
    }
    let mut drained = false;
    for _ in 0..50 {
        let stats = c
            .get(&format!("{}/emulator/stats", urls[0]))
            .await
            .unwrap()
            .json()
            .unwrap();
        if stats["running"] == 0 && stats["waiting"] == 0 {
            assert_eq!(stats["requests_aborted"], 3);
            drained = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(drained, "aborted requests still in the engine");
}

#[test]
fn binary_prints_ready_serves_and_exits_on_sigterm() {
    use std::io::{BufRead, BufReader};
    use std::process::{Command, Stdio};
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvroute-emulator"))
        .args(["--ports", "0,0", "--time-scale", "50"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    assert!(line.starts_with("READY 127.0.0.1:"), "{line:?}");
    let addrs: Vec<String> = line.trim()["READY ".len()..]
        .split(',')
        .map(String::from)
        .collect();
    assert_eq!(addrs.len(), 2);
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let c = HttpClient::new();
        for a in &addrs {
            let r = c.get(&format!("http://{a}/health")).await.unwrap();
            assert_eq!(r.status, 200);
            assert_eq!(r.header("x-kvroute-served-by"), Some(a.as_str()));
        }
    });
    let t = Instant::now();
    let st = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(st.success());
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        assert!(
            t.elapsed() < Duration::from_secs(5),
            "no exit within 5 s of SIGTERM"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(status.success(), "{status:?}");

    let out = Command::new(env!("CARGO_BIN_EXE_kvroute-emulator"))
        .args(["--port", "1"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("unknown flag --port"));
}

/// The routing core's own /metrics parser (the one the collector runs) reads
/// the emulator the way it reads the real vLLM capture.
#[tokio::test]
async fn the_collectors_parser_reads_emulated_and_real_metrics_alike() {
    use kvroute_core::reports::vllm_metrics;
    let mut c_cfg = cfg(100.0);
    c_cfg.engine = EngineConfig {
        block_size: 32,
        num_gpu_blocks: 256,
        ..EngineConfig::default()
    };
    let (_f, urls) = fleet(&c_cfg, 1).await;
    let c = HttpClient::new();
    let prompt = text_of_bytes(32 * 4 * 5, &mut Rng::new(5));
    for _ in 0..2 {
        c.post(
            &format!("{}/v1/completions", urls[0]),
            completion(&prompt, 1, false),
            &[],
        )
        .await
        .unwrap();
    }
    let ours =
        vllm_metrics::parse(&c.get(&format!("{}/metrics", urls[0])).await.unwrap().body).unwrap();
    assert_eq!(ours.block_size, Some(32));
    assert_eq!(ours.num_gpu_blocks, Some(256));
    assert_eq!(ours.prefix_queries, 320.0);
    assert_eq!(ours.prefix_hits, 128.0);
    assert_eq!((ours.running, ours.waiting), (0.0, 0.0));
    let real_text = std::fs::read(format!(
        "{}/../testdata/vllm/metrics-vllm-0.32-cpu-small-kv.txt",
        env!("CARGO_MANIFEST_DIR")
    ))
    .unwrap();
    let real = vllm_metrics::parse(&real_text).unwrap();
    assert_eq!(real.block_size, Some(32));
    assert_eq!(real.num_gpu_blocks, Some(256));
}

/// `--lora-modules`: the adapters are served by name, listed in
/// `/v1/models` with their parent, and reported in
/// `vllm:lora_requests_info`, all read back by the collector's parsers.
#[tokio::test]
async fn lora_modules_are_served_listed_and_reported() {
    use kvroute_core::reports::{vllm_metrics, vllm_models};
    let mut c_cfg = cfg(100.0);
    c_cfg.lora_modules = vec!["sql".into(), "chat".into()];
    c_cfg.max_loras = 3;
    let (_f, urls) = fleet(&c_cfg, 1).await;
    let c = HttpClient::new();
    let url = format!("{}/v1/completions", urls[0]);
    for (model, status) in [("tiny", 200), ("sql", 200), ("chat", 200), ("other", 404)] {
        let r = c
            .post(
                &url,
                json!({"model": model, "prompt": "x", "max_tokens": 1}).to_string(),
                &[],
            )
            .await
            .unwrap();
        assert_eq!(r.status, status, "{model}: {}", r.text());
    }
    let cards =
        vllm_models::parse(&c.get(&format!("{}/v1/models", urls[0])).await.unwrap().body).unwrap();
    let got: Vec<(&str, Option<&str>)> = cards
        .iter()
        .map(|c| (c.id.as_str(), c.parent.as_deref()))
        .collect();
    assert_eq!(
        got,
        vec![
            ("tiny", None),
            ("sql", Some("tiny")),
            ("chat", Some("tiny"))
        ]
    );
    let m =
        vllm_metrics::parse(&c.get(&format!("{}/metrics", urls[0])).await.unwrap().body).unwrap();
    assert_eq!(m.model_names, vec!["tiny".to_string()]);
    let lora = m.lora.unwrap();
    assert_eq!(lora.max_lora, 3);
    assert!(lora.running.is_empty() && lora.waiting.is_empty());
    // Without adapters there is no lora_requests_info, as in vLLM.
    let (_g, plain) = fleet(&cfg(100.0), 1).await;
    let m =
        vllm_metrics::parse(&c.get(&format!("{}/metrics", plain[0])).await.unwrap().body).unwrap();
    assert_eq!(m.lora, None);
}

/// `vllm:lora_requests_info` follows the adapters in flight as vLLM 0.32
/// reports them: every adapter with a request waiting or running is listed
/// in both labels, oldest request first; each label set keeps its own
/// series, and the current one has the latest value (what kvroute reads).
#[tokio::test]
async fn lora_requests_info_lists_the_adapters_in_flight() {
    use kvroute_core::reports::vllm_metrics;
    let mut c_cfg = cfg(20.0);
    c_cfg.lora_modules = vec!["sql".into(), "chat".into()];
    c_cfg.max_loras = 2;
    c_cfg.engine.max_num_seqs = 1;
    let (_f, urls) = fleet(&c_cfg, 1).await;
    let c = HttpClient::new();
    let url = format!("{}/v1/completions", urls[0]);
    let lora = |body: &[u8]| vllm_metrics::parse(body).unwrap().lora.unwrap();
    let idle = c.get(&format!("{}/metrics", urls[0])).await.unwrap();
    assert!(lora(&idle.body).running.is_empty());
    // Each decodes 400 tokens at >= 25 ms model = 1.25 ms wall: >= 0.5 s;
    // one runs at a time (max_num_seqs 1), the others wait.
    let mut tasks = Vec::new();
    for (i, model) in ["sql", "tiny", "chat"].into_iter().enumerate() {
        let c = c.clone();
        let url = url.clone();
        let body = json!({"model": model, "prompt": format!("lora prompt {i}"), "max_tokens": 400})
            .to_string();
        tasks.push(tokio::spawn(async move { c.post(&url, body, &[]).await }));
        tokio::time::sleep(Duration::from_millis(30)).await;
    }
    tokio::time::sleep(Duration::from_millis(60)).await;
    let busy = c.get(&format!("{}/metrics", urls[0])).await.unwrap();
    let l = lora(&busy.body);
    assert_eq!(
        l.running,
        vec!["sql".to_string(), "chat".to_string()],
        "{}",
        busy.text()
    );
    assert_eq!(l.waiting, l.running);
    assert_eq!(l.max_lora, 2);
    for t in tasks {
        assert_eq!(t.await.unwrap().unwrap().status, 200);
    }
    let done = c.get(&format!("{}/metrics", urls[0])).await.unwrap();
    assert!(lora(&done.body).running.is_empty(), "{}", done.text());
    // The earlier label sets are still there, older.
    let series = done
        .text()
        .lines()
        .filter(|l| l.starts_with("vllm:lora_requests_info{"))
        .count();
    assert_eq!(series, 2, "{}", done.text());
}

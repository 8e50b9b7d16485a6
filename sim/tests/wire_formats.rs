//! vLLM wire formats against the real vLLM 0.32 captures in testdata/vllm.

use base64::Engine as _;
use kvroute_sim::kv_events::{decode_seq, frames, KvEvent, KvEventBatch};
use kvroute_sim::vllm_hash::VllmBlockHasher;
use rmpv::Value;

fn testdata(name: &str) -> String {
    let p = format!("{}/../testdata/vllm/{name}", env!("CARGO_MANIFEST_DIR"));
    std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("read {p}: {e}"))
}

fn captured_frames() -> Vec<[Vec<u8>; 3]> {
    testdata("kv-events-vllm-0.32-frames.b64.jsonl")
        .lines()
        .map(|line| {
            let v: serde_json::Value = serde_json::from_str(line).unwrap();
            let f: Vec<Vec<u8>> = v["frames_b64"]
                .as_array()
                .unwrap()
                .iter()
                .map(|s| {
                    base64::engine::general_purpose::STANDARD
                        .decode(s.as_str().unwrap())
                        .unwrap()
                })
                .collect();
            [f[0].clone(), f[1].clone(), f[2].clone()]
        })
        .collect()
}

#[test]
fn real_capture_decodes_with_sequence_topic_and_event_kinds() {
    let frames = captured_frames();
    assert_eq!(frames.len(), 10);
    let mut stored = 0;
    let mut removed = 0;
    for (i, [topic, seq, payload]) in frames.iter().enumerate() {
        assert_eq!(topic, b"kv@test2");
        assert_eq!(decode_seq(seq).unwrap(), i as u64);
        let batch = KvEventBatch::decode(payload).unwrap();
        assert!(batch.ts > 1.7e9, "ts is unix seconds: {}", batch.ts);
        assert_eq!(batch.data_parallel_rank, Some(0));
        for e in &batch.events {
            match e {
                KvEvent::BlockStored {
                    block_hashes,
                    token_ids,
                    block_size,
                    medium,
                    extra_keys,
                    ..
                } => {
                    stored += 1;
                    assert_eq!(*block_size, 32);
                    assert_eq!(token_ids.len(), block_hashes.len() * 32);
                    assert_eq!(medium.as_deref(), Some("GPU"));
                    assert_eq!(extra_keys.as_ref().unwrap().len(), block_hashes.len());
                }
                KvEvent::BlockRemoved { block_hashes, .. } => {
                    removed += 1;
                    assert_eq!(block_hashes.len(), 1);
                }
                KvEvent::AllBlocksCleared => {}
            }
        }
    }
    assert_eq!(stored, 10);
    assert_eq!(removed, 41 - 1 + 47 - 1);
    // The chat requests' second block chains onto a block stored before.
    let b2 = KvEventBatch::decode(&frames[2][2]).unwrap();
    let KvEvent::BlockStored {
        parent_block_hash, ..
    } = &b2.events[0]
    else {
        panic!("frame 2 is a BlockStored");
    };
    assert_eq!(*parent_block_hash, Some(15645687166192966725));
}

/// Our encoder writes the same bytes vLLM wrote: same map key order, same
/// integer widths, f64 timestamps, batch as array.
#[test]
fn encoder_reproduces_real_payloads_byte_for_byte() {
    for (i, [topic, seq, payload]) in captured_frames().iter().enumerate() {
        let batch = KvEventBatch::decode(payload).unwrap();
        let topic = std::str::from_utf8(topic).unwrap();
        let ours = frames(topic, decode_seq(seq).unwrap(), &batch);
        assert_eq!(ours[0], *topic.as_bytes());
        assert_eq!(ours[1], *seq, "frame {i} seq");
        assert_eq!(ours[2], *payload, "frame {i} payload");
    }
}

#[test]
fn decoder_accepts_older_tagged_array_events_and_byte_hashes() {
    let mut hash = vec![0xAAu8; 24];
    hash.extend_from_slice(&42u64.to_be_bytes());
    let batch = Value::Array(vec![
        Value::F64(1.5),
        Value::Array(vec![
            Value::Array(vec![
                Value::from("BlockStored"),
                Value::Array(vec![Value::Binary(hash.clone())]),
                Value::Nil,
                Value::Array(vec![Value::from(1), Value::from(2)]),
                Value::from(2),
                Value::Nil,
            ]),
            Value::Array(vec![
                Value::from("BlockRemoved"),
                Value::Array(vec![Value::from(7u64)]),
            ]),
            Value::Array(vec![Value::from("AllBlocksCleared")]),
        ]),
    ]);
    let mut buf = Vec::new();
    rmpv::encode::write_value(&mut buf, &batch).unwrap();
    let got = KvEventBatch::decode(&buf).unwrap();
    assert_eq!(got.ts, 1.5);
    assert_eq!(got.data_parallel_rank, None);
    match &got.events[0] {
        KvEvent::BlockStored {
            block_hashes,
            parent_block_hash,
            token_ids,
            block_size,
            medium,
            ..
        } => {
            assert_eq!(block_hashes, &vec![42]);
            assert_eq!(*parent_block_hash, None);
            assert_eq!(token_ids, &vec![1, 2]);
            assert_eq!(*block_size, 2);
            assert_eq!(*medium, None);
        }
        other => panic!("{other:?}"),
    }
    assert!(
        matches!(&got.events[1], KvEvent::BlockRemoved { block_hashes, .. } if block_hashes == &vec![7])
    );
    assert_eq!(got.events[2], KvEvent::AllBlocksCleared);
}

#[test]
fn decoder_rejects_garbage_with_a_reason() {
    assert!(KvEventBatch::decode(b"").is_err());
    assert!(KvEventBatch::decode(&[0x93, 0xc0]).is_err());
    let mut buf = Vec::new();
    rmpv::encode::write_value(
        &mut buf,
        &Value::Array(vec![Value::F64(1.0), Value::Array(vec![Value::from(3)])]),
    )
    .unwrap();
    let err = KvEventBatch::decode(&buf).unwrap_err();
    assert!(
        err.to_string().contains("neither a map nor an array"),
        "{err}"
    );
}

/// The emulator's token-ID requests carry vLLM's own block hashes: the
/// vectors made by vLLM 0.32's functions (sim/tools/gen_vllm_hash_vectors.py),
/// through the emulator's request path (`engine_request`) with each
/// vector's block size, seed and `cache_salt`, and the salt published as
/// vLLM publishes it (untagged, on block 0).
#[test]
fn emulator_token_id_requests_hash_like_vllm() {
    use kvroute_core::request::{parse_request, ApiKind, ParseLimits};
    use kvroute_sim::emulator::{openai::engine_request, EmulatorConfig};
    let cases: serde_json::Value =
        serde_json::from_str(&testdata("block-hash-sha256-cbor-vectors.json")).unwrap();
    let cases = cases.as_array().unwrap();
    let mut checked = 0;
    for c in cases {
        let name = c["name"].as_str().unwrap();
        // The emulator always runs with a seed (`--python-hash-seed`).
        let Some(seed) = c["python_hash_seed"].as_str() else {
            continue;
        };
        // The emulator serves adapters by name only (no path): it hashes
        // their prompts as the base model's, so the LoRA vectors (vLLM's
        // `("lora", name, path)` key) are kvroute's, not the emulator's.
        if c["lora_name"].is_string() {
            continue;
        }
        let mut cfg = EmulatorConfig {
            python_hash_seed: seed.to_owned(),
            ..EmulatorConfig::default()
        };
        cfg.engine.block_size = c["block_size"].as_u64().unwrap() as u32;
        let mut body = serde_json::json!({"model": "tiny", "prompt": c["token_ids"]});
        if let Some(s) = c["cache_salt"].as_str() {
            body["cache_salt"] = s.into();
        }
        let body = body.to_string();
        let req = parse_request(
            ApiKind::Completions,
            body.as_bytes(),
            &ParseLimits::default(),
        );
        let Ok(req) = req else {
            // An empty token list is refused as a missing prompt.
            assert!(c["token_ids"].as_array().unwrap().is_empty(), "{name}");
            continue;
        };
        let hasher = VllmBlockHasher::new(Some(&cfg.python_hash_seed));
        let er = engine_request(&req, body.as_bytes(), &cfg, &hasher, true).unwrap();
        let want64: Vec<u64> = c["block_hashes_u64"]
            .as_array()
            .unwrap()
            .iter()
            .map(|h| h.as_u64().unwrap())
            .collect();
        assert_eq!(er.block_hashes, want64, "{name}");
        assert_eq!(
            er.first_block_extra_keys,
            c["cache_salt"].as_str().map(|s| vec![s.to_owned()]),
            "{name}"
        );
        checked += 1;
    }
    assert!(checked >= 6, "{checked}");
}

#[test]
fn prometheus_parser_reads_real_vllm_metrics_by_name_and_label() {
    use kvroute_sim_model::prometheus::{find, parse};
    for (file, blocks) in [
        ("metrics-vllm-0.32-cpu.txt", "65536"),
        ("metrics-vllm-0.32-cpu-small-kv.txt", "256"),
    ] {
        let samples = parse(&testdata(file)).unwrap_or_else(|e| panic!("{file}: {e}"));
        let m = [("model_name", "tiny")];
        for name in [
            "vllm:num_requests_running",
            "vllm:num_requests_waiting",
            "vllm:kv_cache_usage_perc",
            "vllm:prefix_cache_queries_total",
            "vllm:prefix_cache_hits_total",
            "vllm:prompt_tokens_total",
            "vllm:generation_tokens_total",
            "vllm:time_to_first_token_seconds_count",
        ] {
            assert!(find(&samples, name, &m).is_some(), "{file}: {name}");
        }
        let info = samples
            .iter()
            .find(|s| s.name == "vllm:cache_config_info")
            .unwrap();
        assert_eq!(info.label("block_size"), Some("32"), "{file}");
        assert_eq!(info.label("num_gpu_blocks"), Some(blocks), "{file}");
        assert_eq!(
            find(
                &samples,
                "vllm:time_to_first_token_seconds_bucket",
                &[("le", "+Inf")]
            ),
            find(&samples, "vllm:time_to_first_token_seconds_count", &[]),
        );
    }
}

/// Every value in the real capture, re-formatted by our writer, gives the
/// same text the Python client wrote.
#[test]
fn value_formatting_matches_the_python_client_on_every_captured_sample() {
    let mut checked = 0;
    for file in [
        "metrics-vllm-0.32-cpu.txt",
        "metrics-vllm-0.32-cpu-small-kv.txt",
    ] {
        for line in testdata(file)
            .lines()
            .filter(|l| !l.starts_with('#') && !l.is_empty())
        {
            let token = line.rsplit(' ').next().unwrap();
            let v: f64 = token.parse().unwrap();
            assert_eq!(
                kvroute_sim_model::prometheus::format_value(v),
                token,
                "{file}: {line}"
            );
            checked += 1;
        }
    }
    assert!(checked > 500, "{checked}");
}

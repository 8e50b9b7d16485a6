//! Parser parity between real vLLM 0.32 and the emulator, through kvroute's
//! own parsers: `kvroute_core::reports::vllm_metrics::parse` for `/metrics`
//! and `kvroute_sim::kv_events` for the ZMQ KV-event frames.
//!
//! Ignored by default: it needs captures that `tests/real/test_parity.py`
//! writes (from a real vLLM server and from `kvroute-emulator`, fed the same
//! token-ID prompts) into the directory named by `KVROUTE_REAL_PARITY_DIR`:
//! `metrics-real.txt`, `metrics-emu.txt`, `events-real.jsonl`,
//! `events-emu.jsonl` (one message per line, `{"frames_b64":[topic, seq, payload]}`).
//!
//! ```sh
//! KVROUTE_REAL_PARITY_DIR=/tmp/x cargo test -p kvroute-sim --test real_vllm_parity -- --ignored
//! ```

use base64::Engine as _;
use kvroute_core::reports::vllm_metrics::{self, VllmMetrics};
use kvroute_sim::kv_events::{decode_seq, KvEvent, KvEventBatch};
use std::collections::BTreeSet;
use std::path::PathBuf;

fn dir() -> PathBuf {
    PathBuf::from(
        std::env::var("KVROUTE_REAL_PARITY_DIR")
            .expect("KVROUTE_REAL_PARITY_DIR: the folder tests/real/test_parity.py wrote"),
    )
}

fn metrics(side: &str) -> VllmMetrics {
    let path = dir().join(format!("metrics-{side}.txt"));
    let text = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    vllm_metrics::parse(&text).unwrap_or_else(|e| panic!("{side} /metrics: {e}"))
}

struct Message {
    topic: String,
    seq: u64,
    payload: Vec<u8>,
    batch: KvEventBatch,
}

fn messages(side: &str) -> Vec<Message> {
    let path = dir().join(format!("events-{side}.jsonl"));
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let b64 = base64::engine::general_purpose::STANDARD;
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .map(|line| {
            let v: serde_json::Value = serde_json::from_str(line).unwrap();
            let frames: Vec<Vec<u8>> = v["frames_b64"]
                .as_array()
                .expect("frames_b64")
                .iter()
                .map(|f| b64.decode(f.as_str().unwrap()).unwrap())
                .collect();
            assert_eq!(frames.len(), 3, "{side}: [topic, seq, payload]");
            Message {
                topic: String::from_utf8(frames[0].clone()).expect("topic is UTF-8"),
                seq: decode_seq(&frames[1]).unwrap_or_else(|e| panic!("{side}: {e}")),
                batch: KvEventBatch::decode(&frames[2]).unwrap_or_else(|e| panic!("{side}: {e}")),
                payload: frames[2].clone(),
            }
        })
        .collect()
}

/// (parent, hash, that block's tokens) of every stored block.
fn stored_blocks(msgs: &[Message]) -> BTreeSet<(Option<u64>, u64, Vec<u32>)> {
    let mut out = BTreeSet::new();
    for m in msgs {
        for e in &m.batch.events {
            if let KvEvent::BlockStored {
                block_hashes,
                parent_block_hash,
                token_ids,
                block_size,
                ..
            } = e
            {
                let bs = *block_size as usize;
                assert_eq!(
                    token_ids.len(),
                    block_hashes.len() * bs,
                    "tokens = blocks x block_size"
                );
                let mut parent = *parent_block_hash;
                for (i, h) in block_hashes.iter().enumerate() {
                    out.insert((parent, *h, token_ids[i * bs..(i + 1) * bs].to_vec()));
                    parent = Some(*h);
                }
            }
        }
    }
    out
}

#[test]
#[ignore = "needs captures from real vLLM: run tests/real (bash scripts/real-vllm.sh test)"]
fn real_and_emulated_metrics_parse_alike() {
    let real = metrics("real");
    let emu = metrics("emu");
    println!("real {real:?}\nemu  {emu:?}");
    assert!(
        real.block_size.is_some() && real.num_gpu_blocks.is_some(),
        "real cache_config_info: {real:?}"
    );
    assert_eq!(real.block_size, emu.block_size, "block_size");
    assert_eq!(real.num_gpu_blocks, emu.num_gpu_blocks, "num_gpu_blocks");
    for (name, r, e) in [
        ("prefix_queries", real.prefix_queries, emu.prefix_queries),
        ("prefix_hits", real.prefix_hits, emu.prefix_hits),
    ] {
        assert!(r > 0.0 && e > 0.0, "{name}: real {r}, emulator {e}");
    }
    // The online prefill-rate estimate's inputs: both histograms, with work
    // in them after the same prompts.
    for (side, m) in [("real", &real), ("emulator", &emu)] {
        let p = m
            .prefill
            .unwrap_or_else(|| panic!("{side}: no prefill histograms"));
        assert!(
            p.computed_tokens > 0.0 && p.seconds > 0.0 && p.requests > 0.0,
            "{side}: {p:?}"
        );
    }
    for m in [&real, &emu] {
        assert!((0.0..=1.0).contains(&m.kv_cache_usage), "{m:?}");
        assert!(m.running >= 0.0 && m.waiting >= 0.0, "{m:?}");
    }
}

#[test]
#[ignore = "needs captures from real vLLM: run tests/real (bash scripts/real-vllm.sh test)"]
fn real_and_emulated_kv_events_decode_alike() {
    let real = messages("real");
    let emu = messages("emu");
    assert!(
        !real.is_empty() && !emu.is_empty(),
        "real {} emu {} messages",
        real.len(),
        emu.len()
    );
    for (side, msgs) in [("real", &real), ("emu", &emu)] {
        for w in msgs.windows(2) {
            assert_eq!(w[1].seq, w[0].seq + 1, "{side}: seq counts up by one");
            assert_eq!(w[1].topic, w[0].topic, "{side}: one topic");
        }
        for m in msgs.iter() {
            // The emulator's encoder writes back exactly the bytes it decoded:
            // both sides use the same msgpack encoding (map-form events, key
            // order, integer and float widths).
            assert_eq!(
                m.batch.encode(),
                m.payload,
                "{side}: re-encoding seq {} differs from the wire bytes",
                m.seq
            );
            for e in &m.batch.events {
                if let KvEvent::BlockStored {
                    block_size,
                    medium,
                    lora_id,
                    group_idx,
                    ..
                } = e
                {
                    assert_eq!(*block_size, 32, "{side}");
                    assert_eq!(medium.as_deref(), Some("GPU"), "{side}");
                    assert_eq!(*lora_id, None, "{side}");
                    assert_eq!(*group_idx, Some(0), "{side}");
                }
            }
        }
    }
    let kinds = |msgs: &[Message]| -> BTreeSet<Option<String>> {
        msgs.iter()
            .flat_map(|m| m.batch.events.iter())
            .filter_map(|e| match e {
                KvEvent::BlockStored {
                    kv_cache_spec_kind, ..
                } => Some(kv_cache_spec_kind.clone()),
                _ => None,
            })
            .collect()
    };
    assert_eq!(kinds(&real), kinds(&emu), "kv_cache_spec_kind");
    // Same token-ID prompts: the same blocks (their tokens) stored on both
    // sides; with the same hash algorithm (sha256_cbor) and PYTHONHASHSEED,
    // the same chained hashes and parents too.
    let (r, e) = (stored_blocks(&real), stored_blocks(&emu));
    assert!(!r.is_empty(), "real server stored no block");
    let tokens = |s: &BTreeSet<(Option<u64>, u64, Vec<u32>)>| -> BTreeSet<Vec<u32>> {
        s.iter().map(|b| b.2.clone()).collect()
    };
    assert_eq!(tokens(&r), tokens(&e), "the stored blocks' tokens differ");
    let only_real: Vec<_> = r.difference(&e).map(|b| b.1).collect();
    let only_emu: Vec<_> = e.difference(&r).map(|b| b.1).collect();
    assert!(
        only_real.is_empty() && only_emu.is_empty(),
        "stored blocks differ: {} only real {:x?}, {} only emulated {:x?} (of {} real)",
        only_real.len(),
        &only_real[..only_real.len().min(4)],
        only_emu.len(),
        &only_emu[..only_emu.len().min(4)],
        r.len()
    );
}

//! Shared by the relay's tests: the real vLLM 0.32 capture.
#![allow(dead_code)]

use base64::Engine as _;

/// The captured messages, `[topic, seq, payload]` each.
pub fn captured_frames() -> Vec<Vec<Vec<u8>>> {
    let p = format!(
        "{}/../testdata/vllm/kv-events-vllm-0.32-frames.b64.jsonl",
        env!("CARGO_MANIFEST_DIR")
    );
    let text = std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("read {p}: {e}"));
    text.lines()
        .map(|line| {
            let v: serde_json::Value = serde_json::from_str(line).unwrap();
            v["frames_b64"]
                .as_array()
                .unwrap()
                .iter()
                .map(|s| {
                    base64::engine::general_purpose::STANDARD
                        .decode(s.as_str().unwrap())
                        .unwrap()
                })
                .collect()
        })
        .collect()
}

pub fn refs(frames: &[Vec<u8>]) -> Vec<&[u8]> {
    frames.iter().map(Vec::as_slice).collect()
}

//! The smaller module, built without the `tokenizer` feature
//! (`cargo build … -p kvroute-wasm --no-default-features`): it is much
//! smaller than the default build, refuses a config that names a tokenizer
//! with a message that says why (where the default build accepts the same
//! config), and routes in precise mode: token-ID prompts are hashed, text and
//! chat prompts fall back to the approximate index (`no_tokenizer`).

use crate::support::*;
use kvroute_harness::artifacts::{kvroute_wasm, kvroute_wasm_without_tokenizer, repo_root};
use kvroute_harness::{Cluster, VmSpec};

fn precise(token_producer: serde_json::Value) -> String {
    config(serde_json::json!({
        "plugins": [
            {"type": "token-producer", "parameters": token_producer},
            {"type": "precise-prefix-cache-producer",
             "parameters": {"tokenProcessorConfig": {"blockSizeTokens": 16, "hashSeed": "0"}}},
            {"type": "prefix-cache-scorer",
             "parameters": {"prefixMatchInfoProducerName": "precise-prefix-cache-producer"}},
            {"type": "max-score-picker"}
        ],
        "schedulingProfiles": [{"name": "default", "plugins": [
            {"pluginRef": "prefix-cache-scorer", "weight": 2},
            {"pluginRef": "max-score-picker"}
        ]}],
        "kvEvents": {"enabled": true}
    }))
}

fn worker(wasm: &std::path::Path, config: &str) -> (Cluster, bool) {
    let c = Cluster::new();
    let started = c
        .add_vm(VmSpec::new("worker-0", wasm, VM_ID, "kvroute", config))
        .expect("worker VM");
    (c, started.configured)
}

#[test]
fn the_module_without_the_tokenizer_feature_is_smaller_refuses_a_tokenizer_and_routes() {
    let full = kvroute_wasm().expect("kvroute module");
    let lean = kvroute_wasm_without_tokenizer().expect("kvroute module without the tokenizer");
    let size = |p: &std::path::Path| std::fs::metadata(p).expect("module size").len();
    let (full_b, lean_b) = (size(&full), size(&lean));
    println!("module bytes: default {full_b}, without the tokenizer feature {lean_b}");
    // tokenizers and minijinja are about half of the default module.
    assert!(
        lean_b * 10 < full_b * 7,
        "the module without the tokenizer feature is {lean_b} bytes, not under 0.7 of the default's {full_b}"
    );

    let tokenizer_json = std::fs::read_to_string(
        repo_root().join("testdata/tokenizer/tiny-bpe-4096/tokenizer.json"),
    )
    .expect("testdata tokenizer");
    let with_tokenizer =
        precise(serde_json::json!({"modelName": "m", "tokenizerJson": tokenizer_json}));
    let (_, configured) = worker(&full, &with_tokenizer);
    assert!(
        configured,
        "the default module refused a config with a tokenizer"
    );
    let (c, configured) = worker(&lean, &with_tokenizer);
    assert!(!configured, "the module without the tokenizer accepted one");
    let why = c.logs_matching("built without the `tokenizer` feature");
    assert!(
        why.iter()
            .any(|l| l.contains("plugins[0].parameters.tokenizerJson")),
        "no log line names the field and the reason: {why:?}"
    );
    assert!(c.vm_failure(0).is_none());

    // The same VM takes a precise config without a tokenizer (llm-d's UDS
    // tokenizer, which a VM cannot reach) and routes both kinds of prompt.
    let without = precise(serde_json::json!({
        "modelName": "m", "udsTokenizerConfig": {"socketFile": "/tmp/tokenizer.sock"}}));
    assert!(
        c.configure(0, without.as_bytes()).unwrap(),
        "refused a config without a tokenizer"
    );
    let ids: Vec<u32> = (0..64).map(|i| 100 + i).collect();
    let body = serde_json::json!({"model": "m", "prompt": ids, "max_tokens": 1}).to_string();
    let req = c.post(0, "/v1/completions", body.as_bytes()).unwrap();
    assert!(
        primary(&c, req).is_some(),
        "a token-ID prompt was not routed"
    );
    let req = c
        .post(
            0,
            "/v1/completions",
            &completion("text needs a tokenizer", false),
        )
        .unwrap();
    assert!(primary(&c, req).is_some(), "a text prompt was not routed");
    c.tick(0).unwrap();
    let counter = |n: &str| {
        c.metric(&format!("kvroute_precise_fallback_{n}"))
            .unwrap_or(0)
    };
    // The token-ID prompt was hashed (no relay has reported, so it is
    // scored on the approximate index: no_held_view); the text one could not be.
    assert_eq!(counter("no_held_view"), 1, "the token-ID prompt's fallback");
    assert_eq!(counter("no_tokenizer"), 1, "the text prompt's fallback");
    assert!(c.vm_failure(0).is_none());
}

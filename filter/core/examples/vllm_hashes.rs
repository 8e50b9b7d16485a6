//! kvroute's precise hashes for one request, as the filter computes them:
//! the plugin config's `precise-prefix-cache-producer` (and `token-producer`)
//! applied to a request body. The real-engine tier compares its output with
//! the `BlockStored` events of a real vLLM server (tests/real/test_hash_parity.py).
//!
//! ```text
//! cargo run -p kvroute-core --example vllm_hashes -- CONFIG.json (completions|chat|messages|generate) BODY.json [MODELS.json]
//! ```
//!
//! Prints one JSON line: `{"token_ids":[…],"hashes":[…],"lora":…}` (hashes
//! as u64, vLLM's event form), or `{"fallback":"REASON"}` and exits 3.
//!
//! `MODELS.json`: a server's `GET /v1/models` answer. It is recorded as the
//! collector records it (`Engine::record_model_list`, the shared models
//! table) for the config's first endpoint, and a body whose `model` that
//! table lists as a LoRA adapter is hashed with the adapter's key
//! `(model, path)` as the request path does (`PreciseConfig::hashes_of`);
//! `lora` then says `{"name","path"}` (else null).

use kvroute_core::config::{Config, SharedStateConfig};
use kvroute_core::engine::Engine;
use kvroute_core::precise::offpath::{
    key_seed, lookup, process, JobFor, Lookup, TokenizerSource, Tokenizing,
};
use kvroute_core::precise::tokenizer::{completion_add_special, ModelTokenizer};
use kvroute_core::precise::vllm_hash::LoraKey;
use kvroute_core::precise::{OffPathModel, PreciseConfig};
use kvroute_core::request::{
    parse_request_for_template, ApiKind, ChatTemplateInputs, InferenceRequest, ParseLimits, Prompt,
};
use kvroute_shared_state::memory::MemoryStore;
use kvroute_shared_state::models::AdapterPath;
use std::sync::Arc;

fn offpath_load(m: &OffPathModel) -> Arc<ModelTokenizer> {
    let TokenizerSource::Inline(bytes) = &m.source else {
        panic!("give the tokenizer inline (tokenizerJson) to this example");
    };
    Arc::new(m.load(bytes).unwrap_or_else(|e| panic!("{e}")))
}

/// The off-path pipeline on an empty store: look up (a miss), process the
/// job as the collector does, look up again (the whole prompt).
fn offpath_hashes(
    p: &PreciseConfig,
    i: u8,
    tok: &ModelTokenizer,
    req: &InferenceRequest,
    body: &[u8],
    chat: Option<&ChatTemplateInputs>,
    shared: &SharedStateConfig,
) -> (Vec<u64>, u32) {
    let m = p.tokenizers[usize::from(i)].offpath.as_deref().unwrap();
    let (text, add_special) = match chat {
        Some(c) => m.renderer.render_inputs(c).expect("renders"),
        None => (
            String::from_utf8(match &req.prompt {
                Prompt::Text(t) => t.to_vec(),
                _ => panic!("a text prompt"),
            })
            .unwrap(),
            completion_add_special(body).unwrap(),
        ),
    };
    let seed = key_seed(
        m.fingerprint,
        p.block_size,
        &p.hasher,
        add_special,
        req.cache_salt.as_deref(),
    );
    let store = MemoryStore::new();
    let slots = shared.hashed_prefix_slots;
    let cut = tok.segmenter().ok();
    let jf = JobFor {
        model: i,
        add_special,
        salt: req.cache_salt.clone(),
    };
    let Lookup::Miss(Some(job)) = lookup(&store, slots, cut, &text, seed, jf.clone()).unwrap()
    else {
        panic!("an empty store holds nothing")
    };
    let budget = std::cell::RefCell::new(kvroute_shared_state::hashed::Budget::new(
        shared.hashed_prefix_slots,
        shared.hashed_prefix_bytes,
    ));
    let t = Tokenizing {
        tok,
        fingerprint: m.fingerprint,
        block_size: p.block_size,
        hasher: &p.hasher,
        max_blocks: p.max_blocks,
        budget: &budget,
    };
    process(&job, &t, &store).unwrap();
    match lookup(&store, slots, cut, &text, seed, jf).unwrap() {
        Lookup::Full(h) => (h.hashes, h.tokens),
        other => panic!("after its job: {other:?}"),
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.len() != 4 && args.len() != 5 {
        eprintln!("usage: vllm_hashes CONFIG.json (completions|chat|messages|generate) BODY.json [MODELS.json]");
        std::process::exit(2);
    }
    let read = |p: &str| std::fs::read(p).unwrap_or_else(|e| panic!("read {p}: {e}"));
    let config = Config::from_json(&read(&args[1])).unwrap_or_else(|e| panic!("{e}"));
    let engine = Engine::new(config.clone());
    let mut precise = config
        .precise
        .expect("the config has no precise-prefix-cache-producer");
    let kind = match args[2].as_str() {
        "completions" => ApiKind::Completions,
        "chat" => ApiKind::ChatCompletions,
        "generate" => ApiKind::Generate,
        "messages" => ApiKind::Messages,
        k => panic!("unknown API {k}"),
    };
    let body = read(&args[3]);
    let (req, chat) =
        parse_request_for_template(kind, &body, &ParseLimits::default()).expect("the body parses");
    // The adapter's path, as the collector keeps it and the request path
    // reads it (`engine/models.rs`).
    let lora_path: Option<String> = args.get(4).and_then(|models| {
        let store = MemoryStore::new();
        engine.collector_init(&store).expect("collector init");
        let table = engine.endpoint_table(&store).expect("endpoints");
        let ep = table.endpoints.first().expect("the config has an endpoint");
        engine
            .record_model_list(&store, ep.slot, ep.generation, &read(models))
            .expect("the /v1/models answer parses");
        let t = engine.models_table(&store).expect("models table");
        match t.get(ep.slot, ep.generation)?.adapter_path(&req.model) {
            AdapterPath::Path(p) => Some(p.to_string()),
            AdapterPath::Unknown => {
                println!("{}", serde_json::json!({"fallback": "lora_path_unknown"}));
                std::process::exit(3);
            }
            AdapterPath::NotAdapter => None,
        }
    });
    let lora = lora_path.as_deref().map(|path| LoraKey {
        name: &req.model,
        path,
    });
    // `tokenizeIn: collector` (the default): load the tokenizer as the
    // collector does, for the request path's IDs below, and hash the prompt
    // the off-path way too (a job, then the stored prefix).
    let offpath = precise
        .offpath_for(&req.model)
        .map(|(i, m)| (i, offpath_load(m)));
    if let Some((i, tok)) = &offpath {
        precise.tokenizers[usize::from(*i)].tokenizer = Some(tok.clone());
    }
    match precise.token_ids(&req, &body, chat.as_ref()) {
        Ok(ids) => {
            let hashes = precise.hashes_of(&ids, lora, req.cache_salt.as_deref());
            // A token-ID prompt is hashed as it is on every path: only text
            // and chat prompts go through the off-path pipeline (which
            // does not hash adapters: they fall back there).
            let tokenized = chat.is_some() || matches!(req.prompt, Prompt::Text(_));
            if let Some((i, tok)) = offpath.as_ref().filter(|_| tokenized && lora.is_none()) {
                let (off, tokens) = offpath_hashes(
                    &precise,
                    *i,
                    tok,
                    &req,
                    &body,
                    chat.as_ref(),
                    &config.shared_state,
                );
                assert_eq!(tokens as usize, ids.len(), "off-path token count differs");
                assert_eq!(
                    off, hashes,
                    "off-path hashes differ from the request path's"
                );
            }
            println!(
                "{}",
                serde_json::json!({"token_ids": ids, "hashes": hashes,
                                   "lora": lora.map(|l| serde_json::json!({"name": l.name, "path": l.path}))})
            );
        }
        Err(f) => {
            println!("{}", serde_json::json!({"fallback": f.label()}));
            std::process::exit(3);
        }
    }
}

//! kvroute's precise hashes for one request, as the filter computes them:
//! the plugin config's `precise-prefix-cache-producer` (and `token-producer`)
//! applied to a request body. The real-engine tier compares its output with
//! the `BlockStored` events of a real vLLM server (tests/real/test_hash_parity.py).
//!
//! ```text
//! cargo run -p kvroute-core --example vllm_hashes -- CONFIG.json (completions|chat) BODY.json
//! ```
//!
//! Prints one JSON line: `{"token_ids":[…],"hashes":[…]}` (hashes as u64,
//! vLLM's event form), or `{"fallback":"REASON"}` and exits 3.

use kvroute_core::config::Config;
use kvroute_core::request::{parse_request_for_template, ApiKind, ParseLimits};

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.len() != 4 {
        eprintln!("usage: vllm_hashes CONFIG.json (completions|chat) BODY.json");
        std::process::exit(2);
    }
    let read = |p: &str| std::fs::read(p).unwrap_or_else(|e| panic!("read {p}: {e}"));
    let config = Config::from_json(&read(&args[1])).unwrap_or_else(|e| panic!("{e}"));
    let precise = config
        .precise
        .expect("the config has no precise-prefix-cache-producer");
    let kind = match args[2].as_str() {
        "completions" => ApiKind::Completions,
        "chat" => ApiKind::ChatCompletions,
        k => panic!("unknown API {k}"),
    };
    let body = read(&args[3]);
    let (req, chat) =
        parse_request_for_template(kind, &body, &ParseLimits::default()).expect("the body parses");
    match precise.token_ids(&req, &body, chat.as_ref()) {
        Ok(ids) => {
            let hashes = precise.hasher.block_hashes_u64(
                &ids,
                precise.block_size,
                req.cache_salt.as_deref(),
                precise.max_blocks,
            );
            println!(
                "{}",
                serde_json::json!({"token_ids": ids, "hashes": hashes})
            );
        }
        Err(f) => {
            println!("{}", serde_json::json!({"fallback": f.label()}));
            std::process::exit(3);
        }
    }
}

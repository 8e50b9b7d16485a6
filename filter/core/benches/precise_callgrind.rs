//! Instruction counts of precise mode's tokenization of a chat body, for
//! `valgrind --tool=callgrind` (as `route_callgrind.rs`): the request parse,
//! the chat template and the tokenizer, N times inside `measured_requests`.
//!
//!     dir="$(bash scripts/qwen3-tokenizer.sh)"
//!     valgrind --tool=callgrind --collect-atstart=no \
//!         --toggle-collect='*measured_requests*' --callgrind-out-file=/dev/null \
//!         target/release/deps/precise_callgrind-HASH "$dir" once 8 10
//!
//! Arguments: TOKENIZER_DIR (`tokenizer.json` and `tokenizer_config.json`)
//! STAGE KB N. Stages: `once`, the router's path (one parse that also takes
//! what the template reads, then the template and the tokenizer);
//! `reread`, the same with the template's input read from the body again
//! by serde_json (`render_chat`, the path before the one parse); `parse`,
//! routing's parse alone (`parse_request`, as in approximate mode).

mod common;

use kvroute_core::precise::tokenizer::ModelTokenizer;
use kvroute_core::precise::vllm_hash::VllmBlockHasher;
use kvroute_core::precise::{PreciseConfig, TokenizerConfig};
use kvroute_core::request::{parse_request, parse_request_for_template, ApiKind, ParseLimits};
use std::hint::black_box;
use std::sync::Arc;

#[inline(never)]
fn measured_requests(precise: &PreciseConfig, body: &[u8], stage: &str, n: u64) {
    let kind = ApiKind::ChatCompletions;
    let limits = ParseLimits::default();
    for _ in 0..n {
        match stage {
            "once" => {
                let (req, chat) =
                    parse_request_for_template(kind, black_box(body), &limits).expect("parses");
                let ids = precise.token_ids(&req, body, chat.as_ref());
                black_box(ids.expect("tokenizes").len());
            }
            "reread" => {
                let req = parse_request(kind, black_box(body), &limits).expect("parses");
                let ids = precise.token_ids(&req, body, None);
                black_box(ids.expect("tokenizes").len());
            }
            "parse" => drop(black_box(parse_request(kind, black_box(body), &limits))),
            other => panic!("unknown stage {other}: use once, reread or parse"),
        }
    }
}

fn main() {
    let args: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with("--"))
        .collect();
    let usage = "usage: precise_callgrind TOKENIZER_DIR STAGE KB N (STAGE: once | reread | parse)";
    if args.is_empty() {
        // `cargo bench` runs every bench binary without arguments: nothing to do.
        eprintln!("{usage}");
        return;
    }
    let [dir, stage, kb, n] = <[String; 4]>::try_from(args).expect(usage);
    let kb: usize = kb.parse().expect(usage);
    let n: u64 = n.parse().expect(usage);
    let json = std::fs::read(format!("{dir}/tokenizer.json")).expect("tokenizer.json");
    let config: serde_json::Value = serde_json::from_slice(
        &std::fs::read(format!("{dir}/tokenizer_config.json")).expect("tokenizer_config.json"),
    )
    .expect("tokenizer_config.json is JSON");
    let tokenizer = ModelTokenizer::load(&json, Some(&config), None).expect("the tokenizer loads");
    let precise = PreciseConfig {
        block_size: 16,
        hasher: VllmBlockHasher::new(None),
        max_blocks: usize::MAX,
        tokenizers: vec![TokenizerConfig {
            model_names: vec!["qwen3-32b".into()],
            tokenizer: Some(Arc::new(tokenizer)),
            offpath: None,
        }],
    };
    let body = common::chat_body(kb << 10, 1);
    measured_requests(&precise, &body, &stage, n);
    println!("{} bytes, {stage} x{n}", body.len());
}

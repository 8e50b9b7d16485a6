//! The checks behind kvroute's fuzz targets.
//!
//! Each `fuzz_targets/*.rs` is one line that hands libFuzzer's input to a
//! function here. A check fails by panicking; libFuzzer reports the panic
//! as a crash and saves the input. What is checked, besides "no panic":
//!
//! - [`check_parse`]: every `ApiKind`; errors are typed and printable; a
//!   parsed request has a model (but for vLLM's generate API) and (but for
//!   embeddings) a non-empty UTF-8
//!   prompt; parsing is deterministic; the prompt's blocks satisfy
//!   `prompt_tokens ≥ blocks × block_size_tokens`, respect
//!   `maxPrefixTokensToMatch`, and are prefix-stable (a byte-prefix of the
//!   prompt hashes to a prefix of the blocks); dropping the last chat (or
//!   Anthropic Messages) message renders a byte-prefix; precise mode's
//!   parse (chat, Messages) gives the same request or error; allocation per
//!   parse is bounded by a multiple of the body's size.
//! - [`parse_differential::run`]: the parser against the frozen reference
//!   parser it replaced, under every `ApiKind`: equal requests when both
//!   accept, the same error label when both refuse.
//! - [`check_config`]: errors name a problem; an accepted config is
//!   deterministic, in range, and routes, charges and releases requests to
//!   zero over a `MemoryStore`; the same bytes as a session shard and a
//!   session token decode without a panic and re-encode to themselves.
//! - [`engine::run`]: a program of routes, releases, clock steps, metrics
//!   polls, membership changes and CAS conflicts against one engine; the
//!   in-flight counters equal the outstanding charges after every step, and
//!   return to zero once every routed request is released.
//!
//! What the collector parses from servers and relays (a broken or
//! compromised one must not crash a VM or corrupt shared data), each driven
//! through the engine's real path into a `MemoryStore`:
//!
//! - [`vllm_metrics::run`]: `/metrics` text → `record_metrics`;
//! - [`kv_events::run`]: relay `/kv/snapshot` and `/kv/events` answers →
//!   `apply_relay_answer` (the held-block sets);
//! - [`envoy_clusters::run`]: admin `/clusters?format=json` →
//!   `apply_admin_clusters` (the endpoint table);
//! - [`mesh_answer::run`]: relay answers to the collector's mesh posts →
//!   `apply_mesh_answer` (peer load, the index and eviction clocks), with
//!   the outbox filled and taken in between;
//! - [`relay_frames::run`]: vLLM's ZMQ frames → the relay's state machine,
//!   and its answers back into the collector;
//! - [`relay_mesh::run`]: proxies' `POST /mesh/exchange` bodies → the
//!   relay's request parser and mesh state, against a naive model.
//!
//! What one VM writes to shared data or a shared queue and another parses
//! (the same Envoy; still, bad input never panics a VM):
//!
//! - [`offpath::run`]: precise mode off the request path: the job,
//!   stored-prefix and tokenizer-meta codecs (what decodes re-encodes),
//!   the cutter built from published cuts (pieces cover the text, hold no
//!   cut, and split at cuts only), the workers' lookup over junk in
//!   `kvroute/hashed/*` against a model of its order, and the collector's
//!   processing with the tiny tokenizer (a processed text is then found
//!   whole, with exactly the request path's hashes).

pub mod alloc_count;
pub mod engine;
pub mod envoy_clusters;
pub mod kv_events;
pub mod mesh_answer;
pub mod offpath;
pub mod parse_differential;
pub mod relay_frames;
pub mod relay_mesh;
pub mod vllm_metrics;

use kvroute_core::blocks::{estimate_tokens, prompt_blocks, text_blocks, BlockConfig};
use kvroute_core::config::{Config, EndpointSource};
use kvroute_core::request::{
    parse_request, parse_request_for_template, ApiKind, InferenceRequest, ParseError, ParseLimits,
    Prompt,
};
use serde_json::Value;
use std::sync::OnceLock;

#[global_allocator]
static ALLOC: alloc_count::Counting = alloc_count::Counting;

/// Every API the parser knows.
pub const KINDS: [ApiKind; 6] = [
    ApiKind::ChatCompletions,
    ApiKind::Completions,
    ApiKind::Responses,
    ApiKind::Embeddings,
    ApiKind::Messages,
    ApiKind::Generate,
];

/// Block geometries the hashing invariants are checked under: the default,
/// the smallest blocks, a capped prefix, and the largest blocks.
fn block_configs() -> [BlockConfig; 4] {
    [
        BlockConfig::default(),
        BlockConfig {
            block_size_tokens: 1,
            chars_per_token: 1,
            max_prefix_tokens: 0,
        },
        BlockConfig {
            block_size_tokens: 16,
            chars_per_token: 4,
            max_prefix_tokens: 64,
        },
        BlockConfig {
            block_size_tokens: 65_536,
            chars_per_token: 64,
            max_prefix_tokens: 0,
        },
    ]
}

/// Heap bytes one parse may hold at once: `factor × body bytes + 64 KiB`.
/// `KVROUTE_FUZZ_ALLOC_FACTOR` overrides the factor (default 64; see
/// docs/lab/2026-11-29-fuzz-findings.md for what the parser actually needs).
pub fn alloc_bound(input_len: usize) -> usize {
    static FACTOR: OnceLock<usize> = OnceLock::new();
    let factor = *FACTOR.get_or_init(|| {
        std::env::var("KVROUTE_FUZZ_ALLOC_FACTOR")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(64)
    });
    factor.saturating_mul(input_len).saturating_add(64 << 10)
}

pub(crate) fn check_alloc(what: &str, input_len: usize, peak: usize) {
    assert!(
        peak <= alloc_bound(input_len),
        "{what}: {peak} heap bytes at peak for a {input_len}-byte input ({:.1}× the input), over the bound {}",
        peak as f64 / input_len.max(1) as f64,
        alloc_bound(input_len)
    );
}

/// Fuzz target `parse_request`: parse under every API, then hash.
pub fn check_parse(body: &[u8]) {
    let limits = ParseLimits::default();
    for kind in KINDS {
        let base = alloc_count::start();
        let parsed = parse_request(kind, body, &limits);
        check_alloc("parse_request", body.len(), alloc_count::peak_since(base));
        if matches!(kind, ApiKind::ChatCompletions | ApiKind::Messages) {
            // Precise mode's parse, which also takes what a chat template
            // reads (for Messages: vLLM's conversion to a chat request),
            // gives the same request or error.
            let base = alloc_count::start();
            let once = parse_request_for_template(kind, body, &limits).map(|(r, _)| r);
            check_alloc(
                "parse_request_for_template",
                body.len(),
                alloc_count::peak_since(base),
            );
            assert_eq!(
                once.as_ref(),
                parsed.as_ref(),
                "parse_request_for_template differs"
            );
        }
        match parsed {
            Ok(req) => {
                assert_eq!(
                    parse_request(kind, body, &limits).as_ref(),
                    Ok(&req),
                    "parsing is not deterministic"
                );
                check_request(kind, &req);
            }
            Err(e) => check_parse_error(&e, body),
        }
    }
    check_message_extension(body);
}

fn check_parse_error(e: &ParseError, body: &[u8]) {
    let label = e.label();
    assert!(
        [
            "empty",
            "too_large",
            "invalid_json",
            "missing_model",
            "missing_prompt"
        ]
        .contains(&label),
        "unknown label {label}"
    );
    assert!(!e.to_string().is_empty());
    assert_eq!(matches!(e, ParseError::Empty), body.is_empty());
    if let ParseError::Json(m) = e {
        assert!(!m.is_empty(), "a JSON error without a message");
    }
}

fn check_request(kind: ApiKind, req: &InferenceRequest) {
    assert_eq!(req.kind, kind);
    // vLLM's generate API may name no model (the server's one model).
    assert!(
        !req.model.is_empty() || kind == ApiKind::Generate,
        "a parsed request with an empty model"
    );
    if kind == ApiKind::Embeddings {
        assert_eq!(req.prompt, Prompt::Text(Vec::new()));
    } else {
        assert!(!req.prompt.is_empty(), "a parsed request with no prompt");
    }
    if let Prompt::Text(t) = &req.prompt {
        assert!(
            std::str::from_utf8(t).is_ok(),
            "the rendered prompt is not UTF-8"
        );
    }
    for cfg in block_configs() {
        check_blocks(req, &cfg);
    }
}

fn check_blocks(req: &InferenceRequest, cfg: &BlockConfig) {
    let b = prompt_blocks(req, cfg);
    let n = b.block_hashes.len();
    let bs = u64::from(cfg.block_size_tokens);
    assert!(
        b.prompt_tokens >= n as u64 * bs,
        "prompt_tokens {} < {n} blocks × {bs} tokens ({cfg:?})",
        b.prompt_tokens
    );
    assert!(n <= cfg.max_blocks(), "{n} blocks over the cap ({cfg:?})");
    assert_eq!(prompt_blocks(req, cfg), b, "hashing is not deterministic");
    let seed = kvroute_core::blocks::chain_seed(&req.model, req.cache_salt.as_deref());
    match &req.prompt {
        Prompt::Text(text) => {
            assert_eq!(
                b.prompt_tokens,
                estimate_tokens(text.len(), cfg.chars_per_token)
            );
            let block_bytes = cfg.block_size_tokens as usize * cfg.chars_per_token as usize;
            assert_eq!(n, (text.len() / block_bytes).min(cfg.max_blocks()));
            // A byte-prefix of the prompt hashes to a prefix of its blocks.
            for cut in [text.len() / 2, text.len().saturating_sub(1)] {
                let p = text_blocks(&text[..cut], seed, cfg);
                assert!(
                    b.block_hashes.starts_with(&p.block_hashes),
                    "blocks of a {cut}-byte prefix are not a prefix of the blocks ({cfg:?})"
                );
            }
        }
        Prompt::TokenIds(ids) => {
            assert_eq!(b.prompt_tokens, ids.len() as u64);
            assert_eq!(n, (ids.len() / bs as usize).min(cfg.max_blocks()));
        }
    }
}

/// Chat and Responses: a conversation without its last message renders to a
/// byte-prefix of the whole conversation (so it shares its leading blocks).
/// Both bodies are re-serialised from the same `serde_json::Value`, so raw
/// JSON (tools, tool calls, non-text parts) is spelled the same in both.
fn check_message_extension(body: &[u8]) {
    let Ok(Value::Object(doc)) = serde_json::from_slice::<Value>(body) else {
        return;
    };
    for (kind, field) in [
        (ApiKind::ChatCompletions, "messages"),
        (ApiKind::Responses, "input"),
        (ApiKind::Messages, "messages"),
    ] {
        let Some(Value::Array(items)) = doc.get(field) else {
            continue;
        };
        if items.len() < 2 {
            continue;
        }
        let full = serde_json::to_vec(&doc).expect("a Value serialises");
        let mut shorter = doc.clone();
        if let Some(Value::Array(items)) = shorter.get_mut(field) {
            items.pop();
        }
        let shorter = serde_json::to_vec(&shorter).expect("a Value serialises");
        let limits = ParseLimits::default();
        let Ok(long) = parse_request(kind, &full, &limits) else {
            continue;
        };
        let short = parse_request(kind, &shorter, &limits)
            .expect("the conversation parses but its first messages do not");
        match (&short.prompt, &long.prompt) {
            (Prompt::Text(s), Prompt::Text(l)) => assert!(
                l.starts_with(s),
                "{kind:?}: dropping the last message does not render a prefix"
            ),
            other => panic!("{kind:?}: unexpected prompt kinds {other:?}"),
        }
    }
}

/// Heap bytes building one inline tokenizer may hold at once:
/// `TOKENIZER_ALLOWANCE + TOKENIZER_FACTOR × tokenizer.json bytes +
/// ADDED_TOKEN_COST × bytes of its added tokens' contents`.
///
/// The `tokenizers` crate's build costs a multiple of the tokenizer's size,
/// and added tokens cost out of proportion: they are matched with
/// Aho-Corasick automata, hundreds of heap bytes per byte of token content
/// while there are at most 100 of them (a DFA; past 100 patterns
/// aho-corasick builds an NFA, much cheaper). The config fuzz target
/// stopped on this: `fuzz/seeds/config/regression-inline-tokenizer-alloc.json`,
/// a 1.5 KB config whose one added token is 300 bytes. The constants sit
/// above what this harness measured (the figures:
/// `docs/lab/2026-12-06-measurements-from-code-comments.md`).
pub const TOKENIZER_ALLOWANCE: usize = 1 << 20;
/// See [`TOKENIZER_ALLOWANCE`].
pub const TOKENIZER_FACTOR: usize = 64;
/// Heap bytes per byte of added-token content (twice the cost measured on
/// the DFA path, for margin). See [`TOKENIZER_ALLOWANCE`].
pub const ADDED_TOKEN_COST: usize = 1 << 10;

/// An inline tokenizer of a config document, as the loader hands it to
/// `ModelTokenizer::load`.
struct InlineTokenizer {
    json: Vec<u8>,
    config: Option<Value>,
    chat_template: Option<String>,
    /// Bytes of its `added_tokens[].content`.
    added_bytes: usize,
}

fn inline_tokenizers(doc: &[u8]) -> Vec<InlineTokenizer> {
    let Ok(v) = serde_json::from_slice::<Value>(doc) else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for p in v["plugins"].as_array().into_iter().flatten() {
        let q = &p["parameters"];
        let json = match &q["tokenizerJson"] {
            Value::String(s) => s.as_bytes().to_vec(),
            o @ Value::Object(_) => serde_json::to_vec(o).unwrap_or_default(),
            _ => continue,
        };
        let added_bytes = serde_json::from_slice::<Value>(&json)
            .ok()
            .and_then(|t| {
                t["added_tokens"].as_array().map(|a| {
                    a.iter()
                        .filter_map(|t| t["content"].as_str())
                        .map(str::len)
                        .sum()
                })
            })
            .unwrap_or(0);
        out.push(InlineTokenizer {
            json,
            config: q.get("tokenizerConfig").filter(|c| c.is_object()).cloned(),
            chat_template: q["chatTemplate"].as_str().map(str::to_owned),
            added_bytes,
        });
    }
    out
}

/// Builds each inline tokenizer of `doc` on its own, checks its heap peak
/// against its bound ([`TOKENIZER_ALLOWANCE`]), and returns the sum of the
/// peaks: the config loader may hold that much more than the document's
/// own bound ([`alloc_bound`]).
///
/// Why the fuzz check allows for the tokenizer rather than the loader
/// bounding it: a config is written by the operator, not sent by clients
/// or servers (the failure rules of DESIGN.md §4 are about those); a real
/// `tokenizer.json` must load (Qwen3's is 11.4 MB; the loader refuses one
/// over 16 MiB), and if it costs like the tiny BPE (25×) it takes each VM
/// some 300 MB anyway; and the loader cannot see heap use in the VM, so a cap
/// it could apply (bytes of added tokens) would be a guess that no real
/// tokenizer was at hand to check. What stays checked: the tokenizer's own
/// cost is bounded by its size and its added tokens' size, and everything
/// else the loader holds by the document's size.
fn tokenizer_cost(doc: &[u8]) -> usize {
    let mut total = 0usize;
    for t in inline_tokenizers(doc) {
        let base = alloc_count::start();
        let loaded = kvroute_core::precise::tokenizer::ModelTokenizer::load(
            &t.json,
            t.config.as_ref(),
            t.chat_template.as_deref(),
        );
        let peak = alloc_count::peak_since(base);
        drop(loaded);
        let bound = TOKENIZER_ALLOWANCE
            .saturating_add(TOKENIZER_FACTOR.saturating_mul(t.json.len()))
            .saturating_add(ADDED_TOKEN_COST.saturating_mul(t.added_bytes));
        assert!(
            peak <= bound,
            "ModelTokenizer::load: {peak} heap bytes at peak for a {}-byte tokenizer.json with {} bytes of added tokens, over the bound {bound}",
            t.json.len(),
            t.added_bytes
        );
        total = total.saturating_add(peak);
    }
    total
}

/// Fuzz target `config`: load a plugin configuration; when accepted, route
/// a few requests with it. Heap: the document's bound ([`alloc_bound`])
/// plus what its inline tokenizers cost on their own ([`tokenizer_cost`]).
pub fn check_config(doc: &[u8]) {
    // The flow-control board (shared data every worker writes) from the
    // same bytes: any value decodes without a panic, and what it decodes to
    // survives its own encoding.
    let board = kvroute_core::flow::board::Board::decode(Some(doc));
    assert_eq!(
        kvroute_core::flow::board::Board::decode(Some(&board.encode())),
        board,
        "board re-encoding changed it"
    );
    assert!(board.records.len() <= kvroute_core::flow::board::MAX_RECORDS);
    // A session shard (`kvroute/sessions/<i>`, shared data) and a session
    // token (a client's header) from the same bytes: no panic; what decodes
    // re-encodes to the same bytes and stays within its bounds.
    use kvroute_shared_state::sessions::{Shard, SHARD_SLOTS};
    if let Some(shard) = Shard::decode(doc) {
        assert!(shard.bindings.len() <= SHARD_SLOTS);
        assert_eq!(shard.encode(), doc, "session shard re-encoding changed it");
    }
    use kvroute_core::scheduling::session::{decode_token, encode_token, MAX_SESSION_VALUE_BYTES};
    if let Some(id) = decode_token(doc) {
        assert!(id.len() <= MAX_SESSION_VALUE_BYTES);
        assert_eq!(
            decode_token(encode_token(&id).as_bytes()).as_deref(),
            Some(id.as_str())
        );
        assert_eq!(
            encode_token(&id).as_bytes(),
            doc.trim_ascii(),
            "not canonical"
        );
    }
    let tokenizers = tokenizer_cost(doc);
    let base = alloc_count::start();
    let loaded = Config::from_json(doc);
    let peak = alloc_count::peak_since(base);
    check_alloc(
        "Config::from_json",
        doc.len(),
        peak.saturating_sub(tokenizers),
    );
    let config = match loaded {
        Err(e) => {
            assert!(!e.message.is_empty(), "a config error without a message");
            assert!(!e.to_string().is_empty());
            return;
        }
        Ok(c) => c,
    };
    assert_eq!(
        Config::from_json(doc).as_ref(),
        Ok(&config),
        "config loading is not deterministic"
    );
    if let Some(f) = &config.flow {
        assert!(!f.bands.is_empty(), "flow control without a band");
        assert!(
            f.bands.windows(2).all(|w| w[0].priority > w[1].priority),
            "bands not in strictly falling priority: {:?}",
            f.bands
        );
        assert!(f.ceiling > 0.0 && f.ceiling <= 1.0, "ceiling {}", f.ceiling);
        assert!(f
            .bands
            .iter()
            .all(|b| b.max_requests > 0 && b.max_bytes > 0));
        for o in &f.objectives {
            assert!(
                f.bands.iter().any(|b| b.priority == o.priority),
                "objective {o:?} has no band"
            );
        }
    }
    let b = &config.prefix.blocks;
    assert!((1..=65_536).contains(&b.block_size_tokens), "{b:?}");
    assert!((1..=64).contains(&b.chars_per_token), "{b:?}");
    assert!(config.routing.max_fallbacks <= 16);
    assert_eq!(config.scheduler.max_fallbacks, config.routing.max_fallbacks);
    assert!(config.routing.max_body_bytes >= 1024);
    for (_, w) in &config.scheduler.scorers {
        assert!(w.is_finite() && *w >= 0.0, "scorer weight {w}");
    }
    if let EndpointSource::Static(list) = &config.endpoints {
        assert!(list.len() <= 1024);
    }
    engine::route_with(config);
}

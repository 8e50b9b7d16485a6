//! What both benchmark binaries share: the request bodies, the engine and
//! its warmed-up shared state, and the stages of one routing decision.
//!
//! A *case* is a chat body of 8 KB, 64 KB or 400 KB routed among 8 or 64
//! endpoints with llm-d's optimized baseline (affinity filter, token-load
//! scorer, max-score picker; 64-token blocks of 4 bytes per token). The
//! state is warm: the request's conversation was routed before (so one
//! endpoint holds its blocks and the filter takes the sticky branch), and
//! other conversations are in flight on other endpoints.

#![allow(dead_code)] // each binary uses a different subset

use kvroute_core::blocks::{prompt_blocks, PromptBlocks};
use kvroute_core::config::Config;
use kvroute_core::engine::{Engine, Outcome, RequestFacts};
use kvroute_core::request::{parse_request, ApiKind, InferenceRequest, ParseLimits};
use kvroute_core::scheduling::{Candidate, Decision, RequestView, Rng};
use kvroute_shared_state::memory::MemoryStore;

/// Body sizes benchmarked, bytes.
pub const SIZES: [usize; 3] = [8 << 10, 64 << 10, 400 << 10];
/// Endpoint counts benchmarked.
pub const ENDPOINTS: [usize; 2] = [8, 64];
/// The clock every request is routed at (ms).
pub const NOW_MS: u64 = 1_000;

const WORDS: [&str; 48] = [
    "the",
    "cache",
    "prefix",
    "router",
    "endpoint",
    "token",
    "block",
    "request",
    "stream",
    "server",
    "model",
    "latency",
    "queue",
    "prefill",
    "decode",
    "batch",
    "answer",
    "question",
    "function",
    "return",
    "value",
    "error",
    "config",
    "shared",
    "state",
    "index",
    "hash",
    "parse",
    "body",
    "header",
    "envoy",
    "filter",
    "policy",
    "score",
    "picker",
    "load",
    "throughput",
    "memory",
    "bytes",
    "retry",
    "worker",
    "thread",
    "ticket",
    "release",
    "charge",
    "window",
    "bucket",
    "slot",
];

/// Deterministic prose of about `bytes` bytes, with a newline every ~12
/// words (JSON-escaped as `\n`, so the parser must copy, as with real chat).
fn prose(bytes: usize, seed: &mut u64) -> String {
    let mut s = String::with_capacity(bytes + 16);
    let mut n = 0u32;
    while s.len() < bytes {
        *seed = seed
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        s.push_str(WORDS[(*seed >> 33) as usize % WORDS.len()]);
        n += 1;
        s.push(if n.is_multiple_of(12) { '\n' } else { ' ' });
    }
    s
}

/// A chat body of `bytes` bytes (± one word): a system prompt of a quarter
/// of the size, then user/assistant turns of ~2 KiB, ending with a user
/// turn that fills the rest. `conversation` seeds the text: equal seeds
/// give equal bodies.
pub fn chat_body(bytes: usize, conversation: u64) -> Vec<u8> {
    let mut seed = conversation.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut messages =
        vec![serde_json::json!({"role": "system", "content": prose(bytes / 4, &mut seed)})];
    let turn = 2048.min(bytes / 4);
    // Bytes each message adds to the body, as serialised.
    let size = |m: &serde_json::Value| m.to_string().len() + 1;
    let mut len = size(&messages[0]) + 128;
    while len + 2 * turn < bytes {
        let role = if messages.len() % 2 == 1 {
            "user"
        } else {
            "assistant"
        };
        let m = serde_json::json!({"role": role, "content": prose(turn, &mut seed)});
        len += size(&m);
        messages.push(m);
    }
    if messages.len() % 2 == 0 {
        messages.push(serde_json::json!({"role": "assistant", "content": prose(64, &mut seed)}));
    }
    let doc = |messages: &[serde_json::Value]| {
        serde_json::to_vec(&serde_json::json!({
            "model": "qwen3-32b", "stream": true, "max_tokens": 256, "temperature": 0.7,
            "messages": messages,
        }))
        .expect("a Value serialises")
    };
    messages.push(serde_json::json!({"role": "user", "content": ""}));
    // Escapes (`\n`) take 2 bytes in the body for 1 in the text: fill in two steps.
    for _ in 0..2 {
        let missing = bytes.saturating_sub(doc(&messages).len());
        let last = messages.len() - 1;
        let mut text = messages[last]["content"].as_str().unwrap_or("").to_string();
        text.push_str(&prose(missing * 12 / 13, &mut seed));
        messages[last]["content"] = serde_json::Value::String(text);
    }
    doc(&messages)
}

/// The engine config: llm-d's optimized baseline over `endpoints` static endpoints.
pub fn config(endpoints: usize) -> Config {
    let list: Vec<String> = (0..endpoints)
        .map(|i| format!("10.1.{}.{}:8000", i / 200, 1 + i % 200))
        .collect();
    let doc = serde_json::json!({
        "endpoints": {"static": list},
        "routing": {"maxBodyBytes": 1 << 20},
    });
    Config::from_json(doc.to_string().as_bytes()).expect("bench config")
}

/// One benchmark case with warm shared state.
pub struct Case {
    pub bytes: usize,
    pub endpoints: usize,
    pub body: Vec<u8>,
    pub engine: Engine,
    pub store: MemoryStore,
}

impl Case {
    pub fn new(bytes: usize, endpoints: usize) -> Case {
        let engine = Engine::new(config(endpoints));
        let store = MemoryStore::new();
        engine.collector_init(&store).expect("collector_init");
        let body = chat_body(bytes, 1);
        let case = Case {
            bytes: body.len(),
            endpoints,
            body,
            engine,
            store,
        };
        // Other conversations in flight (never released), then this one
        // routed and released once, so its blocks are in the index.
        let mut rng = Rng::new(1);
        for c in 0..(endpoints as u64 / 2).max(3) {
            let other = chat_body(bytes, 100 + c);
            case.route(&other, &mut rng);
        }
        case.route_and_release(&mut rng);
        case
    }

    pub fn label(&self) -> String {
        format!(
            "{:>3} KiB x {:>2} endpoints",
            (self.bytes + 512) >> 10,
            self.endpoints
        )
    }

    pub fn parse(&self) -> InferenceRequest {
        parse_request(
            ApiKind::ChatCompletions,
            &self.body,
            &ParseLimits::default(),
        )
        .expect("bench body parses")
    }

    pub fn hash(&self, req: &InferenceRequest) -> PromptBlocks {
        prompt_blocks(req, &self.engine.config.prefix.blocks)
    }

    /// The engine's facts for `blocks` (as the simulator builds them).
    pub fn facts(&self, blocks: &PromptBlocks, max_output_tokens: Option<u64>) -> RequestFacts {
        RequestFacts::blocks(
            blocks.block_hashes.clone(),
            blocks.prompt_tokens,
            max_output_tokens,
        )
    }

    /// The scheduler's input for `facts`, read from shared state by
    /// `Engine::snapshot`, the same call `Engine::route` makes.
    pub fn candidates(&self, facts: &RequestFacts) -> (RequestView, Vec<Candidate>) {
        let snap = self
            .engine
            .snapshot(&self.store, facts, 0)
            .expect("shared state readable")
            .expect("endpoints known");
        (snap.view, snap.candidates)
    }

    pub fn decide(&self, view: &RequestView, candidates: &[Candidate], rng: &mut Rng) -> Decision {
        self.engine
            .config
            .scheduler
            .schedule(view, candidates, rng)
            .expect("a decision")
    }

    fn route(&self, body: &[u8], rng: &mut Rng) -> Outcome {
        match self.engine.facts(ApiKind::ChatCompletions, body) {
            Ok(facts) => self.engine.route(&self.store, facts, NOW_MS, rng),
            Err(why) => self.engine.fail_for(why, Some(ApiKind::ChatCompletions)),
        }
    }

    /// `Engine::route` end to end, then the release that keeps the state steady.
    pub fn route_and_release(&self, rng: &mut Rng) {
        match self.route(&self.body, rng) {
            Outcome::Routed(r) => {
                if let Some(t) = r.ticket {
                    self.engine
                        .release_rest(&self.store, &t, false)
                        .expect("release");
                }
            }
            other => panic!("bench request not routed: {other:?}"),
        }
    }

    /// Only the route (the caller releases with [`Case::release`]).
    pub fn route_only(&self, rng: &mut Rng) -> Option<kvroute_shared_state::load::Ticket> {
        match self.route(&self.body, rng) {
            Outcome::Routed(r) => r.ticket,
            other => panic!("bench request not routed: {other:?}"),
        }
    }

    pub fn release(&self, ticket: Option<kvroute_shared_state::load::Ticket>) {
        if let Some(t) = ticket {
            self.engine
                .release_rest(&self.store, &t, false)
                .expect("release");
        }
    }
}

//! Native cost of precise mode's stages on an agent-like chat, whole and by
//! segment (`precise::segments`), with a real tokenizer (Qwen3's), and the
//! tokenizer's resident memory. Single thread; wall clock, medians.
//!
//! ```text
//! dir="$(bash scripts/qwen3-tokenizer.sh)"
//! cargo build --release -p kvroute-core --example precise_segments
//! nice -n 10 target/release/examples/precise_segments "$dir" [REPS] [KB,KB,..]
//! ```
//!
//! A chat is a 6 KB system prompt, then user and assistant turns of 2-5 KB
//! (varied text: words from a large made-up vocabulary, numbers,
//! punctuation, JSON and code lines, some with the template's special
//! token strings) up to the size; the next turn adds an assistant answer
//! and a user turn (about 4 KB). The same with `bench prose` (the 48-word
//! prose of `benches/common`, as the Envoy figures of issue 44 used)
//! follows, for comparison.
//!
//! Stages: `parse` (the request parse that takes the template's inputs),
//! `render` (the chat template), `whole` (`encode` of the rendered text),
//! `split` (cutting it at added tokens), `seg cold` (`encode_segmented`
//! with an empty cache), `seg next` (the next turn's text with the chat's
//! segments cached), `seg same` (the same text again, all cached),
//! `render+seg next` (what a next turn costs after the parse), `vllm hash`
//! (vLLM's sha256_cbor block hashes of the IDs, 16-token blocks), and the
//! key hashes over the rendered text (`xxh3-128`, `sha256`).

use kvroute_core::precise::segment_cache::{MemorySegmentCache, SegmentKey};
use kvroute_core::precise::tokenizer::ModelTokenizer;
use kvroute_core::precise::vllm_hash::VllmBlockHasher;
use kvroute_core::request::{parse_request_for_template, ApiKind, ChatTemplateInputs, ParseLimits};
use serde_json::{json, Value};
use std::hint::black_box;
use std::time::Instant;

/// Resident memory of this process (KiB), from /proc/self/status.
fn rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
        })
        .unwrap_or(0)
}

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

const SYLLABLES: [&str; 40] = [
    "ka", "ro", "mi", "sen", "tal", "or", "ve", "lun", "dra", "phi", "st", "ex", "qui", "ber",
    "ton", "ma", "ly", "ing", "ed", "con", "pre", "ab", "ul", "ri", "zo", "ne", "gra", "pha",
    "tion", "ment", "al", "ic", "ous", "er", "in", "un", "re", "de", "mo", "sy",
];
const COMMON: [&str; 24] = [
    "the", "of", "and", "to", "a", "in", "is", "that", "for", "it", "with", "as", "on", "be",
    "this", "cache", "request", "server", "token", "block", "prefix", "route", "model", "error",
];

/// `bytes` of varied text: words made of syllables, common words, numbers,
/// punctuation, and now and then a JSON or code line.
fn varied(rng: &mut Rng, bytes: usize) -> String {
    let mut s = String::with_capacity(bytes + 64);
    while s.len() < bytes {
        match rng.below(100) {
            0..=39 => s.push_str(COMMON[rng.below(COMMON.len())]),
            40..=84 => {
                for _ in 0..1 + rng.below(4) {
                    s.push_str(SYLLABLES[rng.below(SYLLABLES.len())]);
                }
            }
            85..=89 => s.push_str(&rng.below(100_000).to_string()),
            90..=93 => s.push_str([",", ".", ":", ";", "?", "!", "(x)", "'s"][rng.below(8)]),
            94..=96 => s.push_str(&format!(
                "\n{{\"id\": {}, \"name\": \"{}\", \"ok\": true}}\n",
                rng.below(1000),
                SYLLABLES[rng.below(40)]
            )),
            97..=98 => s.push_str(&format!(
                "\n    let x{} = f(&y[{}..]);\n",
                rng.below(50),
                rng.below(9)
            )),
            _ => s.push_str("\n\n"),
        }
        s.push(' ');
    }
    s
}

/// The 48-word prose of `benches/common` (as in the Envoy figures).
fn bench_prose(rng: &mut Rng, bytes: usize) -> String {
    const WORDS: [&str; 48] = [
        "the",
        "cache",
        "prefix",
        "block",
        "token",
        "route",
        "server",
        "model",
        "request",
        "response",
        "latency",
        "queue",
        "memory",
        "batch",
        "kernel",
        "tensor",
        "weight",
        "layer",
        "attention",
        "head",
        "sequence",
        "context",
        "window",
        "prompt",
        "decode",
        "prefill",
        "scheduler",
        "endpoint",
        "cluster",
        "replica",
        "shard",
        "index",
        "hash",
        "score",
        "filter",
        "picker",
        "plugin",
        "config",
        "metric",
        "gauge",
        "counter",
        "event",
        "stream",
        "body",
        "header",
        "proxy",
        "envoy",
        "wasm",
    ];
    let mut s = String::with_capacity(bytes + 16);
    let mut n = 0u32;
    while s.len() < bytes {
        s.push_str(WORDS[rng.below(WORDS.len())]);
        n += 1;
        s.push(if n.is_multiple_of(12) { '\n' } else { ' ' });
    }
    s
}

/// An agent-like conversation of about `bytes` of text ending with a user
/// turn, and its next turn (an assistant answer and a user turn more).
fn conversation(bytes: usize, seed: u64, text: fn(&mut Rng, usize) -> String) -> (Value, Value) {
    let mut rng = Rng(seed);
    let system = text(&mut rng, 6_000.min(bytes / 2));
    let mut messages = vec![json!({"role": "system", "content": system})];
    let mut len = messages[0]["content"].as_str().map_or(0, str::len);
    while len < bytes {
        let n = (2_000 + rng.below(3_000)).min(bytes.saturating_sub(len).max(500));
        let role = if messages.len() % 2 == 1 {
            "user"
        } else {
            "assistant"
        };
        messages.push(json!({"role": role, "content": text(&mut rng, n)}));
        len += n;
    }
    if messages.len() % 2 == 1 {
        // End on a user turn.
        messages.push(json!({"role": "user", "content": text(&mut rng, 1_000)}));
    }
    let mut next = messages.clone();
    next.push(json!({"role": "assistant", "content": text(&mut rng, 1_000)}));
    next.push(json!({"role": "user", "content": text(&mut rng, 3_000)}));
    let body = |m| json!({"model": "qwen3", "messages": m, "max_tokens": 256});
    (body(messages), body(next))
}

fn inputs(body: &Value) -> (Vec<u8>, ChatTemplateInputs) {
    let bytes = serde_json::to_vec(body).expect("serialises");
    let (_, chat) =
        parse_request_for_template(ApiKind::ChatCompletions, &bytes, &ParseLimits::default())
            .expect("parses");
    (bytes, chat.expect("a chat"))
}

/// CPU time this thread has run (ns): `clock_gettime(CLOCK_THREAD_CPUTIME_ID)`
/// (Linux, 64-bit), as the machine is shared and wall time measures the
/// neighbours too. (`/proc/thread-self/schedstat` only advances at ticks.)
fn cpu_ns() -> u64 {
    #[repr(C)]
    struct Timespec {
        sec: i64,
        nsec: i64,
    }
    extern "C" {
        fn clock_gettime(clock: i32, tp: *mut Timespec) -> i32;
    }
    const CLOCK_THREAD_CPUTIME_ID: i32 = 3;
    let mut t = Timespec { sec: 0, nsec: 0 };
    // SAFETY: `t` is a valid, writable timespec for the call.
    let rc = unsafe { clock_gettime(CLOCK_THREAD_CPUTIME_ID, &mut t) };
    assert_eq!(rc, 0, "clock_gettime");
    t.sec as u64 * 1_000_000_000 + t.nsec as u64
}

/// Median over `reps` samples of `f`'s CPU time (ms) and wall time (ms);
/// `setup` runs before each call, untimed. A sample repeats `f` until it
/// has run at least 2 ms (a clock read's cost is subtracted).
fn median_ms<S>(reps: usize, mut setup: impl FnMut() -> S, mut f: impl FnMut(S)) -> (f64, f64) {
    // One clock read's cost (a timed call spans about one).
    let overhead = {
        let a = cpu_ns();
        for _ in 0..10 {
            black_box(cpu_ns());
        }
        (cpu_ns() - a) as f64 / 11.0
    };
    let mut cpu = Vec::new();
    let mut wall = Vec::new();
    for _ in 0..reps {
        let (mut c, mut w, mut n) = (0.0, 0.0, 0u32);
        while c < 2e6 || n == 0 {
            let s = setup();
            let (t0, c0) = (Instant::now(), cpu_ns());
            f(s);
            let c1 = cpu_ns();
            w += t0.elapsed().as_secs_f64() * 1e9;
            c += ((c1 - c0) as f64 - overhead).max(0.0);
            n += 1;
        }
        cpu.push(c / f64::from(n) / 1e6);
        wall.push(w / f64::from(n) / 1e6);
    }
    let median = |mut v: Vec<f64>| {
        v.sort_by(|a, b| a.total_cmp(b));
        v[v.len() / 2]
    };
    (median(cpu), median(wall))
}

const CACHE_BYTES: usize = 64 << 20;

fn run(
    tok: &ModelTokenizer,
    raw: &tokenizers::Tokenizer,
    kb: usize,
    reps: usize,
    kind: &str,
    text: fn(&mut Rng, usize) -> String,
) {
    let (chat, next) = conversation(kb << 10, kb as u64, text);
    let (body, chat_in) = inputs(&chat);
    let (_, next_in) = inputs(&next);
    let (rendered, special) = tok.render_inputs(&chat_in).expect("renders");
    let (next_text, _) = tok.render_inputs(&next_in).expect("renders");
    let whole_ids = tok.encode(&rendered, special).expect("encodes");
    let next_ids = tok.encode(&next_text, special).expect("encodes");
    // The figures below are only worth having if the results are equal.
    let mut cache = MemorySegmentCache::new(CACHE_BYTES, 0);
    let (cold_ids, cold_report) = tok
        .encode_segmented(&rendered, special, &mut cache)
        .unwrap();
    assert_eq!(cold_ids, whole_ids);
    let cached_bytes = cache.bytes();
    let (seg_next, next_report) = tok
        .encode_segmented(&next_text, special, &mut cache)
        .unwrap();
    assert_eq!(seg_next, next_ids);
    let messages = chat["messages"].as_array().map_or(0, Vec::len);
    println!(
        "\n## {kb} KB chat, {kind}: body {} B, {messages} messages, rendered {} B, {} tokens; \
         next turn +{} B rendered, +{} tokens",
        body.len(),
        rendered.len(),
        whole_ids.len(),
        next_text.len() - rendered.len(),
        next_ids.len() - whole_ids.len(),
    );
    println!("cold: {cold_report:?}; cache holds {cached_bytes} B for it");
    println!("next: {next_report:?}");
    let limits = ParseLimits::default();
    let hasher = VllmBlockHasher::new(None);
    let rows: Vec<(&str, (f64, f64))> = vec![
        (
            "parse",
            median_ms(
                reps,
                || (),
                |_| {
                    black_box(
                        parse_request_for_template(
                            ApiKind::ChatCompletions,
                            black_box(&body),
                            &limits,
                        )
                        .is_ok(),
                    );
                },
            ),
        ),
        (
            "render",
            median_ms(
                reps,
                || (),
                |_| {
                    black_box(tok.render_inputs(&chat_in).map(|t| t.0.len()).ok());
                },
            ),
        ),
        (
            "whole",
            median_ms(
                reps,
                || (),
                |_| {
                    black_box(
                        tok.encode(black_box(&rendered), special)
                            .map(|i| i.len())
                            .ok(),
                    );
                },
            ),
        ),
        (
            "whole next",
            median_ms(
                reps,
                || (),
                |_| {
                    black_box(
                        tok.encode(black_box(&next_text), special)
                            .map(|i| i.len())
                            .ok(),
                    );
                },
            ),
        ),
        (
            "pre-tokenizer only (whole)",
            median_ms(
                reps,
                || (),
                |_| {
                    use tokenizers::tokenizer::PreTokenizer;
                    let mut p = tokenizers::PreTokenizedString::from(black_box(rendered.as_str()));
                    if let Some(pre) = raw.get_pre_tokenizer() {
                        pre.pre_tokenize(&mut p).expect("pre-tokenizes");
                    }
                    black_box(
                        p.get_splits(
                            tokenizers::OffsetReferential::Original,
                            tokenizers::OffsetType::None,
                        )
                        .len(),
                    );
                },
            ),
        ),
        (
            "xxh3-128 keys (whole text)",
            median_ms(
                reps,
                || (),
                |_| {
                    black_box(SegmentKey::of(black_box(rendered.as_bytes()), 0));
                },
            ),
        ),
        (
            "sha256 (whole text)",
            median_ms(
                reps,
                || (),
                |_| {
                    use sha2::Digest;
                    black_box(sha2::Sha256::digest(black_box(rendered.as_bytes())));
                },
            ),
        ),
        (
            "seg cold",
            median_ms(
                reps,
                || MemorySegmentCache::new(CACHE_BYTES, 0),
                |mut c| {
                    black_box(
                        tok.encode_segmented(black_box(&rendered), special, &mut c)
                            .map(|i| i.0.len())
                            .ok(),
                    );
                },
            ),
        ),
        (
            "seg next",
            median_ms(
                reps,
                || {
                    let mut c = MemorySegmentCache::new(CACHE_BYTES, 0);
                    tok.encode_segmented(&rendered, special, &mut c)
                        .expect("encodes");
                    c
                },
                |mut c| {
                    black_box(
                        tok.encode_segmented(black_box(&next_text), special, &mut c)
                            .map(|i| i.0.len())
                            .ok(),
                    );
                },
            ),
        ),
        (
            "seg same (all cached)",
            median_ms(
                reps,
                || (),
                |_| {
                    black_box(
                        tok.encode_segmented(black_box(&rendered), special, &mut cache)
                            .map(|i| i.0.len())
                            .ok(),
                    );
                },
            ),
        ),
        (
            "render+seg next",
            median_ms(
                reps,
                || {
                    let mut c = MemorySegmentCache::new(CACHE_BYTES, 0);
                    tok.encode_segmented(&rendered, special, &mut c)
                        .expect("encodes");
                    c
                },
                |mut c| {
                    let (t, s) = tok.render_inputs(&next_in).expect("renders");
                    black_box(tok.encode_segmented(&t, s, &mut c).map(|i| i.0.len()).ok());
                },
            ),
        ),
        (
            "vllm hash (next turn's ids)",
            median_ms(
                reps,
                || (),
                |_| {
                    black_box(
                        hasher
                            .block_hashes_u64(black_box(&next_ids), 16, None, usize::MAX)
                            .len(),
                    );
                },
            ),
        ),
    ];
    println!("| stage | CPU ms (median) | wall ms |\n|---|---:|---:|");
    for (name, (cpu, wall)) in rows {
        println!("| {name} | {cpu:.3} | {wall:.3} |");
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let dir = args
        .get(1)
        .expect("usage: precise_segments TOKENIZER_DIR [REPS] [KB,KB,..]");
    let reps: usize = args.get(2).map_or(7, |r| r.parse().expect("REPS"));
    let sizes: Vec<usize> = args
        .get(3)
        .map_or("8,400".into(), String::clone)
        .split(',')
        .map(|k| k.parse().expect("KB"))
        .collect();
    let json = std::fs::read(format!("{dir}/tokenizer.json")).expect("tokenizer.json");
    let config: Value = serde_json::from_slice(
        &std::fs::read(format!("{dir}/tokenizer_config.json")).expect("tokenizer_config.json"),
    )
    .expect("JSON");
    let before = rss_kib();
    let start = Instant::now();
    let tok = ModelTokenizer::load(&json, Some(&config), None).expect("loads");
    let load_ms = start.elapsed().as_secs_f64() * 1e3;
    let loaded = rss_kib();
    let raw = tokenizers::Tokenizer::from_bytes(&json).expect("loads");
    let with_second = rss_kib();
    drop(json);
    let after_drop = rss_kib() - (with_second - loaded);
    println!(
        "tokenizer: load {load_ms:.0} ms; RSS {} MiB before, {} MiB loaded (+{} MiB), {} MiB \
         after dropping tokenizer.json's bytes (a second bare `Tokenizer`, for the \
         pre-tokenizer stage, not counted); ineligible: {:?}",
        before >> 10,
        loaded >> 10,
        (loaded - before) >> 10,
        after_drop >> 10,
        tok.ineligible()
    );
    for &kb in &sizes {
        run(&tok, &raw, kb, reps, "varied text", varied);
    }
    for &kb in &sizes {
        run(&tok, &raw, kb, reps, "bench prose", bench_prose);
    }
    println!("\nRSS at the end: {} MiB", rss_kib() >> 10);
}

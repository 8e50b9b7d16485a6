//! Segmented encoding gives exactly the whole encoding: on random chats
//! with the real-engine tier's tokenizer (and, ignored unless its files are
//! given, Qwen3's), on random texts, and for each rule that makes a
//! tokenizer ineligible, an example of what segmenting would get wrong.

use super::*;
use crate::precise::segment_cache::{MemorySegmentCache, NoSegmentCache};
use crate::precise::tokenizer::ModelTokenizer;
use crate::request::{parse_request_for_template, ApiKind, ParseLimits};
use serde_json::{json, Value};

pub(crate) const TINY_TOKENIZER: &[u8] =
    include_bytes!("../../../../testdata/tokenizer/tiny-bpe-4096/tokenizer.json");
pub(crate) const TINY_CONFIG: &str =
    include_str!("../../../../testdata/tokenizer/tiny-bpe-4096/tokenizer_config.json");

/// A template in Qwen's shape over the tiny tokenizer's added tokens: turns
/// closed by `</s>`, tool calls and tool results rendered.
pub(crate) const TOOLS_TEMPLATE: &str =
    "{% if tools %}<s>system\n{{ tools|tojson }}</s>\n{% endif %}\
{% for m in messages %}<s>{{ m.role }}\n{% if m.content %}{{ m.content }}{% endif %}\
{% if m.tool_calls %}{% for c in m.tool_calls %}\n<tool>{{ c.function.name }} \
{{ c.function.arguments }}</tool>{% endfor %}{% endif %}</s>\n{% endfor %}\
{% if add_generation_prompt %}<s>assistant\n{% endif %}";

/// splitmix64: a seeded, reproducible stream.
pub(crate) struct Rng(pub(crate) u64);

impl Rng {
    pub(crate) fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    pub(crate) fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
    fn pick<'a>(&mut self, from: &[&'a str]) -> &'a str {
        from[self.below(from.len())]
    }
}

/// Text fragments: words, unicode (combining marks, emoji, CJK, RTL),
/// whitespace runs, and every added token's string of the tokenizers
/// tested (whole, cut short, or glued to words).
const PIECES: &[&str] = &[
    "the",
    " cache",
    " prefix",
    "block",
    " token",
    " route",
    "Hello",
    ",",
    ".",
    "!",
    "?",
    "'s",
    "123",
    "4",
    " 56",
    "é",
    "e\u{301}",
    "日本語",
    "🙂",
    "👩\u{200d}💻",
    "שלום",
    "Ω",
    "ß",
    " ",
    "  ",
    "   ",
    "\t",
    "\n",
    "\n\n",
    "\r\n",
    " \n ",
    "\u{a0}",
    "\u{3000}",
    "<s>",
    "</s>",
    "<unk>",
    "<s",
    "s>",
    "</",
    "<<s>>",
    "<|im_start|>",
    "<|im_end|>",
    "<|endoftext|>",
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "<|im_",
    "|>",
    "<",
    ">",
    "{",
    "\"",
    "\\",
    "x<s>y",
    "a</s>b",
    "zqx",
    " ZQX ",
];

pub(crate) fn text(rng: &mut Rng, max_pieces: usize) -> String {
    let n = rng.below(max_pieces + 1);
    (0..n).map(|_| rng.pick(PIECES)).collect()
}

/// A random chat body: an optional system prompt, turns of user,
/// assistant (some with tool calls, some with reasoning), tool results,
/// empty and multi-part contents; sometimes tools and no generation prompt.
pub(crate) fn chat(rng: &mut Rng, turns: usize) -> Value {
    let mut messages = Vec::new();
    if rng.below(3) > 0 {
        messages.push(json!({"role": "system", "content": text(rng, 30)}));
    }
    for _ in 0..turns {
        let m = match rng.below(10) {
            0..=3 => json!({"role": "user", "content": text(rng, 25)}),
            4 => json!({"role": "user", "content": [
                {"type": "text", "text": text(rng, 8)}, {"type": "text", "text": text(rng, 8)}]}),
            5 => json!({"role": "user", "content": ""}),
            6 => json!({"role": "assistant", "content": text(rng, 20), "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "search",
                 "arguments": format!("{{\"q\": {}}}", json!(text(rng, 5)))}}]}),
            7 => json!({"role": "tool", "tool_call_id": "c1", "content": text(rng, 20)}),
            8 => json!({"role": "assistant", "content": format!("<think>{}</think>{}",
                text(rng, 6), text(rng, 10)), "reasoning_content": null}),
            _ => json!({"role": "assistant", "content": text(rng, 25)}),
        };
        messages.push(m);
    }
    let mut body = json!({"model": "m", "messages": messages});
    if rng.below(4) == 0 {
        body["tools"] = json!([{"type": "function", "function": {"name": "search",
            "description": text(rng, 6), "parameters": {"type": "object"}}}]);
    }
    if rng.below(5) == 0 {
        body["add_generation_prompt"] = json!(false);
    }
    body
}

/// Checks `n` random conversations, each at several lengths (the cache
/// holds the earlier turns' segments when the next is checked), and random
/// texts with and without special tokens. Returns (chats checked, of them
/// rendered, segments read from the cache).
fn check_random_chats(
    tok: &ModelTokenizer,
    seed: u64,
    n: usize,
    turn_max: usize,
) -> (u64, u64, u64) {
    let mut rng = Rng(seed);
    let mut cache = MemorySegmentCache::new(1 << 20, 3);
    let (mut checked, mut rendered, mut hits) = (0u64, 0u64, 0u64);
    for c in 0..n {
        let turns = 1 + rng.below(turn_max);
        let full = chat(&mut rng, turns);
        let messages = full["messages"].as_array().unwrap().clone();
        for upto in 1..=messages.len() {
            let mut body = full.clone();
            body["messages"] = Value::Array(messages[..upto].to_vec());
            let bytes = serde_json::to_vec(&body).unwrap();
            let limits = ParseLimits::default();
            let (_, inputs) =
                parse_request_for_template(ApiKind::ChatCompletions, &bytes, &limits).unwrap();
            let inputs = inputs.unwrap();
            let whole = tok.chat_ids_from(&inputs);
            let seg = tok.chat_ids_segmented(&inputs, &mut cache);
            let cold = tok.chat_ids_segmented(&inputs, &mut NoSegmentCache);
            assert_eq!(
                seg.as_ref().map(|s| &s.0),
                whole.as_ref(),
                "chat {c} at {upto} messages: {body}"
            );
            assert_eq!(cold.map(|s| s.0), whole, "chat {c}, cold");
            match seg {
                Ok((_, SegmentReport::Segmented { cached, .. })) => {
                    hits += u64::from(cached);
                    rendered += 1;
                }
                Ok((_, other)) => panic!("chat {c}: {other:?}"),
                Err(_) => {}
            }
            checked += 1;
        }
        let t = text(&mut rng, 40);
        for special in [false, true] {
            let (ids, report) = tok.encode_segmented(&t, special, &mut cache).unwrap();
            assert_eq!(ids, tok.encode(&t, special).unwrap(), "{t:?} {special}");
            assert!(
                matches!(report, SegmentReport::Segmented { .. }),
                "{report:?}"
            );
        }
    }
    (checked, rendered, hits)
}

pub(crate) fn tiny(template: Option<&str>) -> ModelTokenizer {
    let c: Value = serde_json::from_str(TINY_CONFIG).unwrap();
    ModelTokenizer::load(TINY_TOKENIZER, Some(&c), template).unwrap()
}

#[test]
fn segmented_equals_whole_on_random_chats_with_the_tiers_tokenizer() {
    for (template, seed) in [(None, 1), (Some(TOOLS_TEMPLATE), 2)] {
        let tok = tiny(template);
        assert_eq!(tok.ineligible(), None);
        let (checked, rendered, hits) = check_random_chats(&tok, seed, 150, 12);
        assert!(checked > 800, "{checked} chats");
        assert_eq!(rendered, checked, "the template renders them all");
        // The cache is used: a conversation's earlier turns are read back.
        assert!(
            hits > checked,
            "{hits} cached segments over {checked} chats"
        );
    }
}

/// The segments are the whole text's pieces: a segment of the split holds
/// no added token, and the pieces join back to the text.
#[test]
fn the_split_covers_the_text_and_cuts_at_every_added_token() {
    let tok = tokenizers::Tokenizer::from_bytes(TINY_TOKENIZER).unwrap();
    let s = Segmenter::new(&tok).unwrap();
    let mut rng = Rng(9);
    for _ in 0..2_000 {
        let t = text(&mut rng, 30);
        let mut joined = String::new();
        for p in s.split(&t) {
            match p {
                Ok(seg) => {
                    assert!(!seg.is_empty());
                    for added in ["<s>", "</s>", "<unk>"] {
                        assert!(!seg.contains(added), "{seg:?} in {t:?}");
                    }
                    joined.push_str(seg);
                }
                Err(id) => joined.push_str(&tok.id_to_token(id).unwrap()),
            }
        }
        assert_eq!(joined, t);
    }
}

/// The tiny tokenizer with its JSON changed by `edit`.
pub(crate) fn tiny_edited(edit: impl FnOnce(&mut Value)) -> ModelTokenizer {
    let mut j: Value = serde_json::from_slice(TINY_TOKENIZER).unwrap();
    edit(&mut j);
    ModelTokenizer::load(&serde_json::to_vec(&j).unwrap(), None, None).unwrap()
}

fn check_texts(tok: &ModelTokenizer, seed: u64, n: usize) -> usize {
    let mut rng = Rng(seed);
    let mut cache = MemorySegmentCache::new(1 << 20, 0);
    for _ in 0..n {
        let t = text(&mut rng, 40);
        for special in [false, true] {
            let (ids, _) = tok.encode_segmented(&t, special, &mut cache).unwrap();
            assert_eq!(ids, tok.encode(&t, special).unwrap(), "{t:?} {special}");
        }
    }
    n
}

/// A post-processor that adds tokens (`<s> $A </s>`): with
/// `add_special_tokens` it runs on the joined IDs, as on the whole.
#[test]
fn a_post_processor_that_adds_tokens_runs_on_the_joined_ids() {
    let tok = tiny_edited(|j| {
        j["post_processor"] = json!({"type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}},
                       {"Sequence": {"id": "A", "type_id": 0}},
                       {"SpecialToken": {"id": "</s>", "type_id": 0}}],
            "pair": [{"Sequence": {"id": "A", "type_id": 0}},
                     {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {"<s>": {"id": "<s>", "ids": [0], "tokens": ["<s>"]},
                               "</s>": {"id": "</s>", "ids": [1], "tokens": ["</s>"]}}});
    });
    assert_eq!(tok.ineligible(), None);
    let with = tok.encode("a b", true).unwrap();
    assert_eq!(with.first(), Some(&0));
    assert_eq!(with.last(), Some(&1));
    check_texts(&tok, 4, 500);
}

/// Added tokens matched after normalization (`normalized: true`) stay
/// inside their segments, where they match as in the whole text; a
/// normalizer (lowercase) acts on each piece, in both.
#[test]
fn normalized_added_tokens_and_a_normalizer_stay_exact() {
    let tok = tiny_edited(|j| {
        j["normalizer"] = json!({"type": "Lowercase"});
        j["added_tokens"]
            .as_array_mut()
            .unwrap()
            .push(json!({"id": 4096,
            "content": "zqx", "single_word": true, "lstrip": true, "rstrip": false,
            "normalized": true, "special": false}));
    });
    assert_eq!(tok.ineligible(), None);
    assert!(tok.encode("a ZQX b", false).unwrap().contains(&4096));
    assert!(!tok.encode("aZQX b", false).unwrap().contains(&4096));
    check_texts(&tok, 5, 500);
}

/// Each rule that makes a tokenizer ineligible: it then encodes whole (the
/// same IDs, reported as ineligible), and segmenting anyway would differ.
#[test]
fn ineligible_tokenizers_encode_whole_and_segmenting_them_would_differ() {
    let flag = |flag: &str| {
        let flag = flag.to_owned();
        tiny_edited(move |j| j["added_tokens"][1][flag] = json!(true))
    };
    let cases = [
        (flag("lstrip"), "a  </s>b"),
        (flag("rstrip"), "a</s>  b"),
        (flag("single_word"), "a</s>b"),
        (
            tiny_edited(|j| {
                // `Ġ`: the byte-level vocabulary's space.
                j["pre_tokenizer"] = json!({"type": "Metaspace", "replacement": "\u{120}",
                    "prepend_scheme": "first", "split": true});
            }),
            "a b<s>c d",
        ),
        (
            tiny_edited(|j| {
                j["truncation"] = json!({"direction": "Right", "max_length": 3,
                    "strategy": "LongestFirst", "stride": 0});
            }),
            "a b c d e<s>f g h",
        ),
        (
            tiny_edited(|j| {
                j["padding"] = json!({"strategy": {"Fixed": 40}, "direction": "Right",
                    "pad_to_multiple_of": null, "pad_id": 2, "pad_type_id": 0,
                    "pad_token": "<unk>"});
            }),
            "a b<s>c",
        ),
    ];
    let labels = [
        "added_token_flags",
        "added_token_flags",
        "added_token_flags",
        "metaspace_first",
        "truncation",
        "padding",
    ];
    for ((tok, text), label) in cases.iter().zip(labels) {
        let why = tok.ineligible().expect(label);
        assert_eq!(why.label(), label);
        let mut cache = MemorySegmentCache::new(1 << 20, 0);
        let (ids, report) = tok.encode_segmented(text, false, &mut cache).unwrap();
        assert_eq!(ids, tok.encode(text, false).unwrap());
        assert_eq!(report, SegmentReport::Ineligible(why.clone()));
        assert!(cache.is_empty());
        // What a segmenter built without the check would give: the
        // tokenizer's own pieces, each encoded alone.
        let raw = &tok.tokenizer_for_tests();
        let naive = Segmenter {
            by_first: {
                let mut b: Vec<Vec<(Box<[u8]>, u32)>> = vec![Vec::new(); 256];
                b[usize::from(b'<')] = vec![
                    (b"<unk>".as_slice().into(), 2),
                    (b"</s>".as_slice().into(), 1),
                    (b"<s>".as_slice().into(), 0),
                ];
                b
            },
            only_first: Some('<'),
            post_adds: false,
        };
        let (segmented, _) = naive
            .encode(raw, 0, text, false, &mut NoSegmentCache)
            .unwrap();
        assert_ne!(segmented, ids, "{label}: {text:?}");
    }
    let special = tiny_edited(|_| {});
    let mut raw = special.tokenizer_for_tests().clone();
    raw.set_encode_special_tokens(true);
    assert_eq!(
        Segmenter::new(&raw).err(),
        Some(Ineligible::EncodeSpecialTokens)
    );
}

/// Qwen3's tokenizer and chat template (tool calls, tool results,
/// reasoning, `<think>`): run with the directory `scripts/qwen3-tokenizer.sh`
/// prints,
///
///     KVROUTE_QWEN3_DIR="$(bash scripts/qwen3-tokenizer.sh)" \
///         cargo test -p kvroute-core --release qwen3 -- --ignored --nocapture
#[test]
#[ignore = "needs Qwen3's tokenizer files: KVROUTE_QWEN3_DIR"]
fn segmented_equals_whole_on_random_chats_with_qwen3() {
    let dir = std::env::var("KVROUTE_QWEN3_DIR").expect("KVROUTE_QWEN3_DIR");
    let json = std::fs::read(format!("{dir}/tokenizer.json")).unwrap();
    let config: Value =
        serde_json::from_slice(&std::fs::read(format!("{dir}/tokenizer_config.json")).unwrap())
            .unwrap();
    let tok = ModelTokenizer::load(&json, Some(&config), None).unwrap();
    assert_eq!(tok.ineligible(), None);
    let chats: usize = std::env::var("KVROUTE_QWEN3_CHATS")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(300);
    let (checked, rendered, hits) = check_random_chats(&tok, 44, chats, 16);
    eprintln!(
        "qwen3: {checked} chats checked ({rendered} rendered, the others equal errors), \
         {chats} texts x 2 special-token flags; 0 mismatches; {hits} segments read from the cache"
    );
    assert_eq!(rendered, checked, "the template renders them all");
    assert!(hits > checked);
}

/// Added tokens where one starts another (`<s>` and `<s>>`): the longest
/// match at the leftmost position is taken, as the tokenizer's own scan.
#[test]
fn overlapping_added_tokens_match_leftmost_longest() {
    let tok = tiny_edited(|j| {
        for (id, content) in [(4096, "<s>>"), (4097, "s><")] {
            j["added_tokens"]
                .as_array_mut()
                .unwrap()
                .push(json!({"id": id,
                "content": content, "single_word": false, "lstrip": false, "rstrip": false,
                "normalized": false, "special": true}));
        }
    });
    assert_eq!(tok.ineligible(), None);
    assert_eq!(tok.encode("<s>>", false).unwrap(), [4096]);
    check_texts(&tok, 6, 1_000);
}

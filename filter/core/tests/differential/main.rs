//! Differential test: the single-pass renderer against the previous parser
//! (`reference`, deserialise then render), over generated bodies: every
//! field order, escapes, unicode, parts, tools before and after the
//! messages, names, tool calls, array-form messages and parts, nulls,
//! duplicates, wrong types, and malformed mutations of all of these.
//! Accepted bodies must give equal requests (byte-identical prompts);
//! refused ones the same kind of error.
//!
//! An integration test, so it sees only kvroute-core's public API; the
//! fuzz target `parse_differential` checks the same two properties on
//! libFuzzer's inputs, with the same reference (`reference.rs`).
//!
//!     cargo test -p kvroute-core --test differential

mod reference;

use kvroute_core::request::{ApiKind, ParseLimits};

/// A small deterministic generator (PCG-style LCG); `errors` lets it
/// generate invalid strings, duplicate fields and values of the wrong type.
struct Gen {
    state: u64,
    errors: bool,
}

impl Gen {
    fn next(&mut self) -> u64 {
        self.state = self
            .state
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        self.state >> 33
    }
    /// A value of the wrong type, with odds `1 / n` when errors are on.
    fn wrong(&mut self, n: usize) -> bool {
        self.errors && self.below(n) == 0
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
    fn chance(&mut self, percent: usize) -> bool {
        self.below(100) < percent
    }
    fn pick<'s>(&mut self, items: &[&'s str]) -> &'s str {
        items[self.below(items.len())]
    }
    fn shuffle<T>(&mut self, v: &mut [T]) {
        for i in (1..v.len()).rev() {
            v.swap(i, self.below(i + 1));
        }
    }
}

/// Whitespace between tokens: usually none.
fn ws(g: &mut Gen) -> &'static str {
    match g.below(12) {
        0 => " ",
        1 => "\n  ",
        2 => "\t",
        3 => " \r\n ",
        _ => "",
    }
}

/// A JSON string literal: plain text, escapes of every kind, raw unicode,
/// long runs (across the 32-byte blocks), and now and then something
/// invalid (lone surrogate, raw control character, bad escape).
fn string(g: &mut Gen) -> String {
    const PIECES: &[&str] = &[
        "a",
        "hello world",
        " ",
        "The quick brown fox jumps over the lazy dog. ",
        "0123456789abcdefghijklmnopqrstuvwxyz!#$%&'()*+,-./:;<=>?@[]^_`{|}~",
        "\\n",
        "\\\"",
        "\\\\",
        "\\/",
        "\\b",
        "\\f",
        "\\r",
        "\\t",
        "\\u00e9",
        "\\u0000",
        "\\u001f",
        "\\uFFFF",
        "\\ud83d\\ude00",
        "\\u2028",
        "é",
        "日本語のテキスト",
        "😀",
        "\u{7f}",
        "<|user|>",
    ];
    const BAD: &[&str] = &[
        "\\ud83d",
        "\\ude00",
        "\\x",
        "\\u12g4",
        "\u{1}",
        "\\ud83d\\u0041",
    ];
    let mut s = String::from("\"");
    let n = match g.below(10) {
        0 => 0,
        1..=6 => 1 + g.below(6),
        _ => 10 + g.below(60),
    };
    for _ in 0..n {
        s.push_str(g.pick(PIECES));
    }
    if g.errors && g.chance(2) {
        let at = s.len();
        s.insert_str(at, g.pick(BAD));
    }
    s.push('"');
    s
}

/// Any JSON value, nested up to `depth`.
fn value(g: &mut Gen, depth: usize) -> String {
    match g.below(if depth == 0 { 6 } else { 9 }) {
        0 => "null".into(),
        1 => g.pick(&["true", "false"]).into(),
        2 => g
            .pick(&["0", "-1", "17", "3.5", "1e3", "18446744073709551615"])
            .into(),
        3..=5 => string(g),
        6 | 7 => {
            let n = g.below(4);
            let items: Vec<String> = (0..n).map(|_| value(g, depth - 1)).collect();
            format!("[{}{}]", ws(g), items.join(&format!(",{}", ws(g))))
        }
        _ => {
            let n = g.below(4);
            let items: Vec<String> = (0..n)
                .map(|_| format!("{}:{}{}", string(g), ws(g), value(g, depth - 1)))
                .collect();
            format!("{{{}}}", items.join(","))
        }
    }
}

/// An object from its fields, with whitespace, and now and then a
/// duplicate field.
fn object(g: &mut Gen, mut fields: Vec<(String, String)>) -> String {
    g.shuffle(&mut fields);
    if !fields.is_empty() && g.errors && g.chance(2) {
        let dup = fields[g.below(fields.len())].clone();
        fields.push(dup);
    }
    let items: Vec<String> = fields
        .into_iter()
        .map(|(k, v)| format!("{}\"{k}\"{}:{}{v}{}", ws(g), ws(g), ws(g), ws(g)))
        .collect();
    format!("{{{}}}", items.join(","))
}

fn opt_string(g: &mut Gen) -> String {
    if g.wrong(20) {
        return "5".into();
    }
    match g.below(20) {
        0 => "null".into(),
        _ => string(g),
    }
}

fn part(g: &mut Gen) -> String {
    if g.wrong(20) {
        return value(g, 2);
    }
    match g.below(20) {
        0..=4 => string(g),
        5 => {
            // Array form: [type, text].
            let n = g.below(4);
            let items: Vec<String> = (0..n).map(|_| opt_string(g)).collect();
            format!("[{}]", items.join(","))
        }
        _ => {
            let mut fields = Vec::new();
            if g.chance(85) {
                let t = match g.below(10) {
                    0 => "null".into(),
                    1 => string(g),
                    2 => "\"\"".into(),
                    3 => "\"t\\u0065xt\"".into(),
                    _ => format!(
                        "\"{}\"",
                        g.pick(&[
                            "text",
                            "input_text",
                            "output_text",
                            "image_url",
                            "input_audio",
                            "input_image"
                        ])
                    ),
                };
                fields.push(("type".into(), t));
            }
            if g.chance(75) {
                fields.push(("text".into(), opt_string(g)));
            }
            if g.chance(30) {
                fields.push(("image_url".into(), value(g, 3)));
            }
            if g.chance(10) {
                fields.push(("t\\u0065xt".into(), opt_string(g)));
            }
            object(g, fields)
        }
    }
}

fn content(g: &mut Gen) -> String {
    if g.wrong(20) {
        return value(g, 2);
    }
    match g.below(20) {
        0 | 1 => "null".into(),
        2..=6 => {
            let n = g.below(5);
            let items: Vec<String> = (0..n).map(|_| part(g)).collect();
            format!("[{}{}]", ws(g), items.join(&format!(",{}", ws(g))))
        }
        _ => string(g),
    }
}

fn message(g: &mut Gen) -> String {
    if g.wrong(30) {
        return value(g, 2);
    }
    match g.below(30) {
        0 | 1 => {
            // Array form: [role, name, content, tool_calls].
            let n = g.below(6);
            let mut items = Vec::new();
            for i in 0..n {
                items.push(match i {
                    0 | 1 => opt_string(g),
                    2 => content(g),
                    _ => value(g, 2),
                });
            }
            format!("[{}]", items.join(","))
        }
        _ => {
            let mut fields = Vec::new();
            if g.chance(80) {
                let role = match g.below(10) {
                    0 => opt_string(g),
                    _ => format!(
                        "\"{}\"",
                        g.pick(&["system", "user", "assistant", "tool", "developer"])
                    ),
                };
                fields.push(("role".into(), role));
            }
            if g.chance(25) {
                fields.push(("name".into(), opt_string(g)));
            }
            if g.chance(90) {
                fields.push(("content".into(), content(g)));
            }
            if g.chance(20) {
                fields.push(("tool_calls".into(), value(g, 3)));
            }
            if g.chance(20) {
                fields.push(("tool_call_id".into(), value(g, 2)));
            }
            if g.chance(5) {
                fields.push(("r\\u006fle".into(), opt_string(g)));
            }
            object(g, fields)
        }
    }
}

fn messages(g: &mut Gen) -> String {
    if g.wrong(25) {
        return value(g, 2);
    }
    match g.below(25) {
        0 => "null".into(),
        _ => {
            let n = g.below(6);
            let items: Vec<String> = (0..n).map(|_| message(g)).collect();
            format!("[{}{}]", ws(g), items.join(&format!(",{}", ws(g))))
        }
    }
}

/// A chat or Responses body (the fields of both, so that each API sees the
/// other's as unknown fields).
fn body(g: &mut Gen) -> String {
    let mut fields = Vec::new();
    if g.chance(95) {
        let model = match g.below(15) {
            0 => "null".into(),
            1 => "\"\"".into(),
            2 if g.errors => "7".into(),
            3 => "\"m\\u0031\"".into(),
            _ => "\"qwen3\"".into(),
        };
        fields.push(("model".into(), model));
    }
    if g.chance(80) {
        fields.push(("messages".into(), messages(g)));
    }
    if g.chance(35) {
        fields.push(("tools".into(), value(g, 3)));
    }
    if g.chance(40) {
        let input = match g.below(4) {
            0 => string(g),
            _ => messages(g),
        };
        fields.push(("input".into(), input));
    }
    if g.chance(30) {
        fields.push(("instructions".into(), opt_string(g)));
    }
    if g.chance(20) {
        fields.push(("prompt".into(), value(g, 2)));
    }
    let bad = g.errors;
    for (name, v) in [
        (
            "stream",
            g.pick(&[
                "true",
                "false",
                "null",
                if bad { "\"yes\"" } else { "true" },
            ]),
        ),
        (
            "max_tokens",
            g.pick(&[
                "7",
                "null",
                if bad { "-1" } else { "8" },
                if bad { "1.5" } else { "0" },
            ]),
        ),
        ("max_completion_tokens", g.pick(&["9", "3", "null"])),
        ("max_output_tokens", g.pick(&["5", "null"])),
        (
            "cache_salt",
            g.pick(&[
                "\"s\"",
                "null",
                "\"s\\u0032\"",
                if bad { "1" } else { "\"\"" },
            ]),
        ),
    ] {
        if g.chance(20) {
            fields.push((name.into(), v.into()));
        }
    }
    if g.chance(30) {
        fields.push(("temperature".into(), value(g, 0)));
    }
    if g.chance(20) {
        fields.push(("metadata".into(), value(g, 4)));
    }
    format!("{}{}{}", ws(g), object(g, fields), ws(g))
}

/// A malformed variant: truncated, a byte dropped, or a byte inserted.
fn mutate(g: &mut Gen, body: &[u8]) -> Vec<u8> {
    let mut b = body.to_vec();
    if b.is_empty() {
        return b;
    }
    let at = g.below(b.len());
    match g.below(3) {
        0 => b.truncate(at),
        1 => {
            b.remove(at);
        }
        _ => {
            const BYTES: &[u8] = b"{}[],:\"\\x0 n\xff\x01\x0c";
            b.insert(at, BYTES[g.below(BYTES.len())]);
        }
    }
    b
}

/// A tokenizer whose chat template prints every value it is given, so that
/// two renders are equal only if the values are.
#[cfg(feature = "tokenizer")]
fn dump_tokenizer() -> &'static kvroute_core::precise::tokenizer::ModelTokenizer {
    use kvroute_core::precise::tokenizer::ModelTokenizer;
    static TOK: std::sync::OnceLock<ModelTokenizer> = std::sync::OnceLock::new();
    TOK.get_or_init(|| {
        let json = include_bytes!("../../../../testdata/tokenizer/tiny-bpe-4096/tokenizer.json");
        let template =
            "{{ messages|tojson }}|{% if tools is defined %}{{ tools|tojson }}{% endif %}\
                        |{{ add_generation_prompt }}|{{ kw|default('-')|tojson }}\
                        {% for m in messages %}{% for k in m %}<{{ k }}>{% endfor %}{% endfor %}";
        ModelTokenizer::load(json, None, Some(template)).expect("the dump template loads")
    })
}

/// The one parse that also takes what a chat template reads
/// (`parse_request_for_template`) gives the same request or error as
/// `parse_request`, and the template renders the same from it as from the
/// body read again (`render_chat`, serde_json), or fails the same way; the
/// same with flags and template arguments put in front of the body.
#[cfg(feature = "tokenizer")]
fn check_template(body: &[u8]) {
    use kvroute_core::precise::Fallback;
    use kvroute_core::request::{parse_request, parse_request_for_template};
    let limits = ParseLimits::default();
    let tok = dump_tokenizer();
    let kind = ApiKind::ChatCompletions;
    let mut variants = vec![body.to_vec()];
    let start = body.iter().position(|b| !b.is_ascii_whitespace());
    if let Some(at) = start.filter(|&i| body[i] == b'{') {
        let rest = &body[at + 1..];
        if rest.iter().find(|b| !b.is_ascii_whitespace()) != Some(&b'}') {
            for front in [
                r#""add_generation_prompt":false,"#,
                r#""add_generation_prompt":"yes","#,
                r#""continue_final_message":true,"#,
                r#""continue_final_message":null,"add_special_tokens":true,"#,
                r#""add_special_tokens":true,"add_special_tokens":null,"#,
                r#""chat_template_kwargs":{"kw":{"a":[1,2.5,"xé",null]}},"#,
                r#""chat_template_kwargs":7,"#,
            ] {
                variants.push([&body[..=at], front.as_bytes(), rest].concat());
            }
        }
    }
    for b in &variants {
        let once = parse_request_for_template(kind, b, &limits);
        let plain = parse_request(kind, b, &limits);
        match (&once, &plain) {
            (Ok((r, chat)), Ok(p)) => {
                assert_eq!(r, p, "{}", String::from_utf8_lossy(b));
                let chat = chat.as_ref().expect("a chat body's template inputs");
                let from_inputs = tok.render_inputs(chat).map_err(Fallback::from);
                let from_body = tok.render_chat(b).map_err(Fallback::from);
                assert_eq!(from_inputs, from_body, "{}", String::from_utf8_lossy(b));
            }
            (Err(a), Err(b2)) => assert_eq!(a, b2),
            _ => panic!("{once:?} vs {plain:?}: {}", String::from_utf8_lossy(b)),
        }
    }
}

fn check(body: &[u8], stats: &mut [usize; 2]) {
    #[cfg(feature = "tokenizer")]
    check_template(body);
    let limits = ParseLimits::default();
    for kind in [
        ApiKind::ChatCompletions,
        ApiKind::Responses,
        ApiKind::Completions,
        ApiKind::Embeddings,
    ] {
        let accepted = reference::compare(kind, body, &limits);
        if matches!(kind, ApiKind::ChatCompletions | ApiKind::Responses) {
            stats[usize::from(accepted)] += 1;
        }
    }
}

#[test]
fn renderer_matches_reference_on_generated_bodies() {
    let mut g = Gen {
        state: 0x5eed,
        errors: false,
    };
    // [refused, accepted] chat and Responses parses, to see that both happen.
    let mut stats = [0usize; 2];
    for i in 0..6000 {
        g.errors = i % 2 == 1;
        let b = body(&mut g);
        check(b.as_bytes(), &mut stats);
        for _ in 0..2 {
            let m = mutate(&mut g, b.as_bytes());
            check(&m, &mut stats);
        }
    }
    eprintln!("stats {stats:?}");
    assert!(
        stats[1] > 2000 && stats[0] > 2000,
        "generator out of balance: {stats:?} [refused, accepted]"
    );
}

/// Hand-picked cases, mostly unusual orders and forms.
#[test]
fn renderer_matches_reference_on_table() {
    let cases: &[&str] = &[
        r#"{"model":"m","messages":[{"content":"c","role":"assistant"}]}"#,
        r#"{"model":"m","messages":[{"content":"c","name":"n","role":"assistant"}]}"#,
        r#"{"model":"m","messages":[{"role":"r","content":"c","name":"n"}]}"#,
        r#"{"model":"m","messages":[{"name":"n","content":"c"}]}"#,
        r#"{"model":"m","messages":[{"content":"c","role":null}]}"#,
        r#"{"model":"m","messages":[{"content":"c","name":null}]}"#,
        r#"{"model":"m","messages":[{"tool_calls":[1],"content":"c","role":"a"}]}"#,
        r#"{"model":"m","messages":[{"role":"a","tool_calls":null}]}"#,
        r#"{"messages":[{"content":"x"}],"tools":[{"a":1}],"model":"m"}"#,
        r#"{"tools":[{"a":1}],"messages":[{"content":"x"}],"model":"m"}"#,
        r#"{"tools":null,"messages":[{"content":"x"}],"model":"m"}"#,
        r#"{"tools":[1],"messages":[],"model":"m"}"#,
        r#"{"model":"m","messages":[{},{},[],["system"],["a","b","c",null]]}"#,
        r#"{"model":"m","messages":[["a","b","c",null,1]]}"#,
        r#"{"model":"m","messages":[["a",null,["x",{"type":"image_url"}],[1]]]}"#,
        r#"{"model":"m","messages":[{"content":[{"text":"t","type":"image_url"}]}]}"#,
        r#"{"model":"m","messages":[{"content":[{"type":"image_url","text":"t"}]}]}"#,
        r#"{"model":"m","messages":[{"content":[{"type":"text"}]}]}"#,
        r#"{"model":"m","messages":[{"content":[{"type":"text","text":null}]}]}"#,
        r#"{"model":"m","messages":[{"content":[{"type":null,"text":"t"}]}]}"#,
        r#"{"model":"m","messages":[{"content":[{},[],["text","hi"],[null,"x"],["x"]]}]}"#,
        r#"{"model":"m","messages":[{"content":[{"type":"text","text":"a","text":"b"}]}]}"#,
        r#"{"model":"m","messages":[{"content":[1]}]}"#,
        r#"{"model":"m","messages":[{"content":[null]}]}"#,
        r#"{"model":"m","messages":[{"content":{"a":1}}]}"#,
        r#"{"model":"m","messages":[{"content":true}]}"#,
        r#"{"model":"m","messages":[{"content":"a","content":"b"}]}"#,
        r#"{"model":"m","messages":[{"role":"a","role":null,"content":"b"}]}"#,
        r#"{"model":"m","messages":[{"content":"a"}],"messages":null}"#,
        r#"{"model":"m","messages":[{"content":"a"}],"tools":1,"tools":2}"#,
        r#"{"model":"m","messages":{"content":"a"}}"#,
        r#"{"model":"m","messages":[1]}"#,
        r#"{"model":"m","messages":[null]}"#,
        r#"{"model":"m","messages":[{"content":"a"},]}"#,
        r#"{"model":"m","messages":[{"content":"a",}]}"#,
        r#"{"model":"m","messages":[{"content":"a"}],}"#,
        r#"{"model":"m","messages":[{"content":"a"}]} x"#,
        r#"{"model":"m","messages":[{"content":"a"}]}  "#,
        "\x0c{\"model\":\"m\",\"messages\":[{\"content\":\"a\"}]}",
        r#"{"model":"m","messages":[{"content":"a"}],"x":[[[[[[[[]]]]]]]]}"#,
        r#"{"model":"m","messages":[{"content":"a"}],"x":"\ud800"}"#,
        r#"{"model":"m","messages":[{"content":"\ud800"}]}"#,
        r#"{"model":"m","messages":[{"c\u006fntent":"a","r\u006fle":"b"}]}"#,
        r#"{"m\u006fdel":"m","messages":[{"content":"a"}]}"#,
        r#"{"model":"m","messages":[{"content":[{"type":"image_url","image_url":{"url":"x"},"detail":"\u00e9"}]}]}"#,
        r#"{"model":"m","messages":[{"content":"a"}],"stream":true,"max_tokens":3,"max_output_tokens":2,"cache_salt":"s"}"#,
        r#"{"model":"m","messages":[{"content":"a"}],"max_tokens":-1}"#,
        r#"{"model":"m","messages":[{"content":"a"}],"max_tokens":1.0}"#,
        r#"{"model":"m","messages":[{"content":"a"}],"stream":nul}"#,
        r#"{"model":"m","messages":[{"content":nul}]}"#,
        r#"{"model":"m","messages":[{"content":null}]}"#,
        r#"{"model":"m","input":[{"content":"x"}],"instructions":"i"}"#,
        r#"{"model":"m","instructions":"i","input":[{"content":"x"}]}"#,
        r#"{"model":"m","input":"x","instructions":"i\n"}"#,
        r#"{"model":"m","input":"x","instructions":null}"#,
        r#"{"model":"m","input":[],"instructions":"i"}"#,
        r#"{"model":"m","input":[]}"#,
        r#"{"model":"m","input":{"a":1}}"#,
        r#"{"model":"m","input":5}"#,
        r#"{"model":"m","input":null,"instructions":5}"#,
        r#"{"model":"m","input":[{"type":"function_call","call_id":"c"},{"role":"user","content":[{"type":"input_text","text":"q"}]}]}"#,
        r#"{"model":"","messages":[]}"#,
        r#"{"messages":[]}"#,
        r#"{"messages":[{"content":[5]}]}"#,
        r#"{"model":"m","messages":[{"content":"aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa\n\n\nbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb"}]}"#,
        r#"{"model":"m","messages":[{"content":"aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaé\u00e9😀bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb"}]}"#,
        "",
        "{",
        "[]",
        "{}",
    ];
    let mut stats = [0usize; 2];
    for c in cases {
        check(c.as_bytes(), &mut stats);
    }
    // Invalid UTF-8: raw, in a long run, after an escape, in an ignored
    // value of a part (which the placeholder hashes).
    for bad in [
        &b"{\"model\":\"m\",\"messages\":[{\"content\":\"\xff\"}]}"[..],
        b"{\"model\":\"m\",\"messages\":[{\"content\":\"aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa\xc3\"}]}",
        b"{\"model\":\"m\",\"messages\":[{\"content\":\"\\u00e9\xa9\"}]}",
        b"{\"model\":\"m\",\"messages\":[{\"content\":[{\"type\":\"image\",\"x\":\"\xff\"}]}]}",
        b"{\"model\":\"m\",\"messages\":[{\"content\":[{\"type\":\"text\",\"text\":\"t\",\"x\":\"\xff\"}]}]}",
        b"{\"model\":\"m\",\"messages\":[{\"content\":\"a\"}],\"x\":\"\xff\"}",
        b"{\"model\":\"m\",\"messages\":[{\"content\":\"a\",\"role\":\"\xed\xa0\x80\"}]}",
    ] {
        check(bad, &mut stats);
    }
}

/// The corpus in testdata/requests, as is and truncated.
#[test]
fn renderer_matches_reference_on_corpus() {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../../testdata/requests");
    let mut stats = [0usize; 2];
    let mut files = 0;
    for entry in std::fs::read_dir(dir).expect("testdata/requests") {
        let path = entry.expect("a directory entry").path();
        if path.extension().and_then(|e| e.to_str()) != Some("json") {
            continue;
        }
        let body = std::fs::read(&path).expect("a readable file");
        check(&body, &mut stats);
        if body.len() < 4096 {
            for cut in 0..body.len() {
                check(&body[..cut], &mut stats);
            }
        }
        files += 1;
    }
    assert!(files > 20, "found {files} bodies in {dir}");
}

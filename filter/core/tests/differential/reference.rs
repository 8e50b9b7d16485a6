//! The parser as it was before single-pass rendering (commit 7672147),
//! kept verbatim for the tests: `parse_request` here is the reference the
//! new renderer must match byte for byte. Two users, each including this
//! file as a module: the differential test (`main.rs` beside it) and the
//! fuzz target `parse_differential` (`fuzz/src/parse_differential.rs`, by
//! `#[path]`). It uses kvroute-core's public API only.

#![allow(dead_code)]

use kvroute_core::request::{
    ApiKind, BatchRest, InferenceRequest, ParseError, ParseLimits, Prompt,
};
use serde::de::{self, SeqAccess, Visitor};
use serde::Deserialize;
use serde_json::value::RawValue;
use std::borrow::Cow;
use std::fmt;
use xxhash_rust::xxh3::xxh3_64;

/// The differential property both users check: `body` through kvroute-core's
/// parser and through this reference under `kind`. When both accept, the
/// requests are equal; when both refuse, the errors have the same label;
/// one accepting what the other refuses panics. Returns whether the new
/// parser accepted.
pub fn compare(kind: ApiKind, body: &[u8], limits: &ParseLimits) -> bool {
    let new = kvroute_core::request::parse_request(kind, body, limits);
    let old = parse_request(kind, body, limits);
    match (&new, &old) {
        (Ok(n), Ok(o)) => assert_eq!(
            n,
            o,
            "{kind:?}: different result for {}",
            String::from_utf8_lossy(body)
        ),
        (Err(n), Err(o)) => assert_eq!(
            n.label(),
            o.label(),
            "{kind:?}: {n} / reference: {o}, for {}",
            String::from_utf8_lossy(body)
        ),
        _ => panic!(
            "{kind:?}: {new:?} / reference: {old:?}, for {}",
            String::from_utf8_lossy(body)
        ),
    }
    new.is_ok()
}

pub fn parse_request(
    kind: ApiKind,
    body: &[u8],
    limits: &ParseLimits,
) -> Result<InferenceRequest, ParseError> {
    if body.is_empty() {
        return Err(ParseError::Empty);
    }
    if body.len() > limits.max_body_bytes {
        return Err(ParseError::TooLarge {
            limit: limits.max_body_bytes,
            actual: body.len(),
        });
    }
    // A request is a JSON object; serde's derive would also accept an array.
    if body.iter().find(|b| !b.is_ascii_whitespace()) != Some(&b'{') {
        return Err(ParseError::Json("expected a JSON object".into()));
    }
    let json_err = |e: serde_json::Error| ParseError::Json(e.to_string());
    let mut batch_rest = BatchRest::default();
    let (common, prompt) = match kind {
        ApiKind::ChatCompletions => {
            let mut b: ChatBody = serde_json::from_slice(body).map_err(json_err)?;
            let prompt = render_chat(b.tools, b.messages.as_deref())?;
            (b.common(), prompt)
        }
        ApiKind::Completions => {
            let mut b: CompletionBody = serde_json::from_slice(body).map_err(json_err)?;
            let (prompt, rest) = match b.prompt.take() {
                Some(CompletionPrompt::Text(t, rest)) => {
                    (Prompt::Text(t.into_owned().into_bytes()), rest)
                }
                Some(CompletionPrompt::Tokens(t, rest)) => (Prompt::TokenIds(t), rest),
                None => return Err(ParseError::MissingPrompt),
            };
            batch_rest = rest;
            (b.common(), prompt)
        }
        ApiKind::Responses => {
            let mut b: ResponsesBody = serde_json::from_slice(body).map_err(json_err)?;
            let prompt = render_responses(b.instructions.as_deref(), b.input.take())?;
            (b.common(), prompt)
        }
        ApiKind::Embeddings => {
            let mut b: EmbeddingsBody = serde_json::from_slice(body).map_err(json_err)?;
            (b.common(), Prompt::Text(Vec::new()))
        }
        // Anthropic's Messages API and vLLM's generate API came after this
        // parser was frozen; their parsers read with serde (no one-pass
        // renderer to compare).
        ApiKind::Messages | ApiKind::Generate => {
            return kvroute_core::request::parse_request(kind, body, limits)
        }
    };
    let model = match common.model {
        Some(m) if !m.is_empty() => m.into_owned(),
        _ => return Err(ParseError::MissingModel),
    };
    if kind != ApiKind::Embeddings && prompt.is_empty() {
        return Err(ParseError::MissingPrompt);
    }
    let max_output_tokens = [
        common.max_tokens,
        common.max_completion_tokens,
        common.max_output_tokens,
    ]
    .into_iter()
    .flatten()
    .min();
    Ok(InferenceRequest {
        kind,
        model,
        prompt,
        max_output_tokens,
        stream: common.stream.unwrap_or(false),
        cache_salt: common.cache_salt.map(Cow::into_owned),
        sequences: common
            .n
            .unwrap_or(1)
            .max(common.best_of.unwrap_or(1))
            .max(1),
        batch_rest,
    })
}

// ---------------------------------------------------------------------------
// Body shapes. Unknown fields are ignored: OpenAI bodies carry many fields
// routing does not read.

/// Declares a body struct with the fields every API shares, plus its own.
/// (Not `#[serde(flatten)]`: flatten buffers the whole body and cannot
/// borrow raw JSON.)
macro_rules! body_struct {
    ($name:ident { $($field:tt)* }) => {
        #[derive(Deserialize)]
        struct $name<'a> {
            #[serde(borrow, default)]
            model: Option<Cow<'a, str>>,
            #[serde(default)]
            max_tokens: Option<u64>,
            #[serde(default)]
            max_completion_tokens: Option<u64>,
            #[serde(default)]
            max_output_tokens: Option<u64>,
            #[serde(default)]
            stream: Option<bool>,
            #[serde(borrow, default)]
            cache_salt: Option<Cow<'a, str>>,
            #[serde(default)]
            n: Option<u64>,
            #[serde(default)]
            best_of: Option<u64>,
            $($field)*
        }
        impl<'a> $name<'a> {
            fn common(&mut self) -> Common<'a> {
                Common {
                    model: self.model.take(),
                    max_tokens: self.max_tokens,
                    max_completion_tokens: self.max_completion_tokens,
                    max_output_tokens: self.max_output_tokens,
                    stream: self.stream,
                    cache_salt: self.cache_salt.take(),
                    n: self.n,
                    best_of: self.best_of,
                }
            }
        }
    };
}

struct Common<'a> {
    model: Option<Cow<'a, str>>,
    max_tokens: Option<u64>,
    max_completion_tokens: Option<u64>,
    max_output_tokens: Option<u64>,
    stream: Option<bool>,
    cache_salt: Option<Cow<'a, str>>,
    n: Option<u64>,
    best_of: Option<u64>,
}

body_struct!(EmbeddingsBody {});

body_struct!(ChatBody {
    #[serde(borrow, default)]
    messages: Option<Vec<Message<'a>>>,
    #[serde(borrow, default)]
    tools: Option<&'a RawValue>,
});

#[derive(Deserialize)]
struct Message<'a> {
    #[serde(borrow, default)]
    role: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    name: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    content: Option<Content<'a>>,
    #[serde(borrow, default)]
    tool_calls: Option<&'a RawValue>,
}

/// `content` is a string, or an array of typed parts.
enum Content<'a> {
    Text(Cow<'a, str>),
    Parts(Vec<&'a RawValue>),
    Null,
}

impl<'de: 'a, 'a> Deserialize<'de> for Content<'a> {
    fn deserialize<D: de::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V<'a>(std::marker::PhantomData<&'a ()>);
        impl<'de: 'a, 'a> Visitor<'de> for V<'a> {
            type Value = Content<'a>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a string, an array of content parts, or null")
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
            fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
                Ok(Content::Null)
            }
            fn visit_none<E: de::Error>(self) -> Result<Self::Value, E> {
                Ok(Content::Null)
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
                let mut parts = Vec::new();
                while let Some(p) = seq.next_element::<&'de RawValue>()? {
                    parts.push(p);
                }
                Ok(Content::Parts(parts))
            }
        }
        d.deserialize_any(V(std::marker::PhantomData))
    }
}

/// A typed content part: `{"type":"text","text":"…"}` and friends.
#[derive(Deserialize)]
struct Part<'a> {
    #[serde(borrow, rename = "type", default)]
    kind: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    text: Option<Cow<'a, str>>,
}

body_struct!(CompletionBody {
    #[serde(borrow, default)]
    prompt: Option<CompletionPrompt<'a>>,
});

/// `prompt` is a string, a list of strings (batch: the first one routes),
/// a list of token IDs, or a list of token-ID lists (batch: the first routes).
enum CompletionPrompt<'a> {
    Text(Cow<'a, str>, BatchRest),
    Tokens(Vec<u32>, BatchRest),
}

impl<'de: 'a, 'a> Deserialize<'de> for CompletionPrompt<'a> {
    fn deserialize<D: de::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V<'a>(std::marker::PhantomData<&'a ()>);
        impl<'de: 'a, 'a> Visitor<'de> for V<'a> {
            type Value = CompletionPrompt<'a>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a string, an array of strings, an array of token IDs, or an array of token-ID arrays")
            }
            fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<Self::Value, E> {
                Ok(CompletionPrompt::Text(
                    Cow::Borrowed(v),
                    BatchRest::default(),
                ))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
                Ok(CompletionPrompt::Text(
                    Cow::Owned(v.to_owned()),
                    BatchRest::default(),
                ))
            }
            fn visit_string<E: de::Error>(self, v: String) -> Result<Self::Value, E> {
                Ok(CompletionPrompt::Text(Cow::Owned(v), BatchRest::default()))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
                let first: Option<PromptItem<'a>> = seq.next_element()?;
                let result = match first {
                    None => CompletionPrompt::Text(Cow::Borrowed(""), BatchRest::default()),
                    Some(PromptItem::Text(t)) => CompletionPrompt::Text(t, BatchRest::default()),
                    Some(PromptItem::Tokens(t)) => {
                        CompletionPrompt::Tokens(t, BatchRest::default())
                    }
                    Some(PromptItem::Token(t)) => {
                        let mut ids = vec![t];
                        while let Some(id) = seq.next_element::<u32>()? {
                            ids.push(id);
                        }
                        return Ok(CompletionPrompt::Tokens(ids, BatchRest::default()));
                    }
                };
                // Batch: the remaining prompts do not influence routing,
                // but are charged (counted, not kept).
                let rest = BatchRest::count(&mut seq)?;
                Ok(match result {
                    CompletionPrompt::Text(t, _) => CompletionPrompt::Text(t, rest),
                    CompletionPrompt::Tokens(t, _) => CompletionPrompt::Tokens(t, rest),
                })
            }
        }
        d.deserialize_any(V(std::marker::PhantomData))
    }
}

enum PromptItem<'a> {
    Text(Cow<'a, str>),
    Token(u32),
    Tokens(Vec<u32>),
}

impl<'de: 'a, 'a> Deserialize<'de> for PromptItem<'a> {
    fn deserialize<D: de::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V<'a>(std::marker::PhantomData<&'a ()>);
        impl<'de: 'a, 'a> Visitor<'de> for V<'a> {
            type Value = PromptItem<'a>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a string, a token ID (0..2^32) or an array of token IDs")
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<Self::Value, E> {
                u32::try_from(v)
                    .map(PromptItem::Token)
                    .map_err(|_| E::custom(format!("token ID {v} is out of range")))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<Self::Value, E> {
                u32::try_from(v)
                    .map(PromptItem::Token)
                    .map_err(|_| E::custom(format!("token ID {v} is out of range")))
            }
            fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<Self::Value, E> {
                Ok(PromptItem::Text(Cow::Borrowed(v)))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
                Ok(PromptItem::Text(Cow::Owned(v.to_owned())))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
                let mut ids = Vec::new();
                while let Some(id) = seq.next_element::<u32>()? {
                    ids.push(id);
                }
                Ok(PromptItem::Tokens(ids))
            }
        }
        d.deserialize_any(V(std::marker::PhantomData))
    }
}

body_struct!(ResponsesBody {
    #[serde(borrow, default)]
    instructions: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    input: Option<ResponsesInput<'a>>,
});

/// `input` is a string or a list of items; message items look like chat
/// messages (`role` + `content` string or parts with `input_text`).
enum ResponsesInput<'a> {
    Text(Cow<'a, str>),
    Items(Vec<Message<'a>>),
}

impl<'de: 'a, 'a> Deserialize<'de> for ResponsesInput<'a> {
    fn deserialize<D: de::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V<'a>(std::marker::PhantomData<&'a ()>);
        impl<'de: 'a, 'a> Visitor<'de> for V<'a> {
            type Value = ResponsesInput<'a>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a string or an array of input items")
            }
            fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<Self::Value, E> {
                Ok(ResponsesInput::Text(Cow::Borrowed(v)))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
                Ok(ResponsesInput::Text(Cow::Owned(v.to_owned())))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
                let mut items = Vec::new();
                while let Some(m) = seq.next_element::<Message<'a>>()? {
                    items.push(m);
                }
                Ok(ResponsesInput::Items(items))
            }
        }
        d.deserialize_any(V(std::marker::PhantomData))
    }
}

// ---------------------------------------------------------------------------
// Rendering.

fn render_chat(
    tools: Option<&RawValue>,
    messages: Option<&[Message<'_>]>,
) -> Result<Prompt, ParseError> {
    let messages = match messages {
        Some(m) if !m.is_empty() => m,
        _ => return Err(ParseError::MissingPrompt),
    };
    let mut out =
        Vec::with_capacity(estimate_render_len(messages) + tools.map_or(0, |t| t.get().len() + 16));
    if let Some(t) = tools {
        out.extend_from_slice(b"<|tools|>");
        out.extend_from_slice(t.get().as_bytes());
        out.push(b'\n');
    }
    for m in messages {
        render_message(&mut out, m)?;
    }
    Ok(Prompt::Text(out))
}

fn render_responses(
    instructions: Option<&str>,
    input: Option<ResponsesInput<'_>>,
) -> Result<Prompt, ParseError> {
    let mut out = Vec::new();
    if let Some(i) = instructions {
        out.extend_from_slice(b"<|instructions|>\n");
        out.extend_from_slice(i.as_bytes());
        out.push(b'\n');
    }
    match input {
        Some(ResponsesInput::Text(t)) => {
            out.extend_from_slice(b"<|user|>\n");
            out.extend_from_slice(t.as_bytes());
            out.push(b'\n');
        }
        Some(ResponsesInput::Items(items)) => {
            for m in &items {
                render_message(&mut out, m)?;
            }
        }
        None => {}
    }
    Ok(Prompt::Text(out))
}

fn estimate_render_len(messages: &[Message<'_>]) -> usize {
    messages
        .iter()
        .map(|m| {
            16 + match &m.content {
                Some(Content::Text(t)) => t.len(),
                Some(Content::Parts(p)) => p.iter().map(|r| r.get().len()).sum(),
                _ => 0,
            }
        })
        .sum()
}

fn render_message(out: &mut Vec<u8>, m: &Message<'_>) -> Result<(), ParseError> {
    out.extend_from_slice(b"<|");
    out.extend_from_slice(m.role.as_deref().unwrap_or("user").as_bytes());
    out.extend_from_slice(b"|>");
    if let Some(n) = &m.name {
        out.extend_from_slice(b"<|name:");
        out.extend_from_slice(n.as_bytes());
        out.extend_from_slice(b"|>");
    }
    out.push(b'\n');
    match &m.content {
        Some(Content::Text(t)) => out.extend_from_slice(t.as_bytes()),
        Some(Content::Parts(parts)) => {
            for raw in parts {
                render_part(out, raw)?;
            }
        }
        Some(Content::Null) | None => {}
    }
    out.push(b'\n');
    if let Some(tc) = m.tool_calls {
        out.extend_from_slice(b"<|tool_calls|>");
        out.extend_from_slice(tc.get().as_bytes());
        out.push(b'\n');
    }
    Ok(())
}

fn render_part(out: &mut Vec<u8>, raw: &RawValue) -> Result<(), ParseError> {
    // A bare string inside a content array is text too. Look at the first
    // byte instead of trying a string parse: a failed parse builds an error
    // message, which made non-text parts ~100x dearer than text (fuzz find).
    if raw.get().starts_with('"') {
        let s = serde_json::from_str::<Cow<'_, str>>(raw.get())
            .map_err(|e| ParseError::Json(e.to_string()))?;
        out.extend_from_slice(s.as_bytes());
        return Ok(());
    }
    let part: Part<'_> =
        serde_json::from_str(raw.get()).map_err(|e| ParseError::Json(e.to_string()))?;
    let kind = part.kind.as_deref().unwrap_or("");
    match (kind, &part.text) {
        ("text" | "input_text" | "output_text" | "", Some(t)) => {
            out.extend_from_slice(t.as_bytes())
        }
        _ => {
            let kind = if kind.is_empty() { "part" } else { kind };
            let tag = format!("<|{kind}:{:016x}|>", xxh3_64(raw.get().as_bytes()));
            out.extend_from_slice(tag.as_bytes());
        }
    }
    Ok(())
}

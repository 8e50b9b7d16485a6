//! Parsing of OpenAI-compatible request bodies into what routing needs.
//!
//! One pass over the buffered body. Chat and Responses bodies are rendered
//! while they are read (`render`): message text is decoded from the body
//! straight into the prompt, which is the only large allocation (about the
//! size of the body). Other values, and the other APIs, are read with
//! `serde_json`, borrowing strings without escapes from the body.
//! Everything the routing core does not read (sampling parameters,
//! logprobs, …) is skipped without being materialised.
//!
//! Precise mode with a tokenizer renders the model's chat template too:
//! [`parse_request_for_template`] hands what the template reads (messages,
//! `tools`, its flags and arguments) to `template` in the same pass, so the
//! body is not read again (`ChatTemplateInputs`). Without it nothing is
//! captured (the capture is a type parameter that compiles away).
//!
//! The *rendered prompt* is a byte string that stands in for what the model
//! server will tokenize. It need not equal the chat template's output; it must
//! only be stable (same request → same bytes) and prefix-preserving (a request
//! that extends another's conversation renders to a byte-extension of it), so
//! that equal prefixes give equal leading blocks.
//!
//! Chat rendering, per message in order:
//! `<|role|>` [`<|name:NAME|>`] `\n` text-content `\n` [`<|tool_calls|>` raw-json `\n`]
//! preceded by `<|tools|>` raw-json `\n` when `tools` is present. A non-text
//! content part renders as `<|TYPE:HASH|>`, where HASH is the xxh3-64 of the
//! part's raw JSON in hex, so two different images never share a block.

use serde::de::{self, IgnoredAny, SeqAccess, Visitor};
use serde::Deserialize;
use serde_json::value::RawValue;
use std::borrow::Cow;
use std::fmt;

mod anthropic;
mod json;
mod render;
#[cfg(feature = "tokenizer")]
mod template;
#[cfg(feature = "tokenizer")]
mod tool_dump;

#[cfg(feature = "tokenizer")]
pub(crate) use template::tools_too_deep;
#[cfg(feature = "tokenizer")]
pub use template::{ChatTemplateInputs, TemplateMessage};
#[cfg(feature = "tokenizer")]
pub use tool_dump::chat_tools;

/// What a chat template reads from a body: none in a build without the
/// `tokenizer` feature (no value).
#[cfg(not(feature = "tokenizer"))]
#[derive(Debug)]
pub enum ChatTemplateInputs {}

/// Which OpenAI-compatible API a request targets, chosen by path suffix.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ApiKind {
    /// `/v1/chat/completions`
    ChatCompletions,
    /// `/v1/completions`
    Completions,
    /// `/v1/responses`
    Responses,
    /// `/v1/embeddings` (parsed for `model` only)
    Embeddings,
    /// vLLM's own `/inference/v1/generate` (tokens in, tokens out:
    /// `token_ids`, with `max_tokens` and `n` under `sampling_params`;
    /// llm-d's `vllmhttp-parser`). `model` may be absent (the server's
    /// one model).
    Generate,
    /// `/v1/messages`: Anthropic's Messages API (`anthropic.rs`), which
    /// vLLM serves through its chat path. Its `/v1/messages/count_tokens`
    /// is not this (not routed).
    Messages,
}

impl ApiKind {
    /// Picks the API from a request path. The query string is ignored, and any
    /// prefix before `/v1/...` is allowed (gateways often mount under a prefix).
    pub fn from_path(path: &str) -> Option<ApiKind> {
        let path = path.split(['?', '#']).next().unwrap_or("");
        let path = path.strip_suffix('/').unwrap_or(path);
        if path.ends_with("/v1/chat/completions") {
            Some(ApiKind::ChatCompletions)
        } else if path.ends_with("/v1/completions") {
            Some(ApiKind::Completions)
        } else if path.ends_with("/v1/responses") {
            Some(ApiKind::Responses)
        } else if path.ends_with("/v1/embeddings") {
            Some(ApiKind::Embeddings)
        } else if path.ends_with("/inference/v1/generate") {
            Some(ApiKind::Generate)
        } else if path.ends_with("/v1/messages") {
            Some(ApiKind::Messages)
        } else {
            None
        }
    }
}

/// The prompt as routing sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Prompt {
    /// Rendered text prompt (UTF-8 bytes; see the module doc for the format).
    Text(Vec<u8>),
    /// A token-ID prompt (`/v1/completions` with `prompt: [ints]`).
    TokenIds(Vec<u32>),
}

impl Prompt {
    /// True when there is nothing to hash.
    pub fn is_empty(&self) -> bool {
        match self {
            Prompt::Text(t) => t.is_empty(),
            Prompt::TokenIds(t) => t.is_empty(),
        }
    }
}

/// What the routing core needs from one request body.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InferenceRequest {
    pub kind: ApiKind,
    pub model: String,
    pub prompt: Prompt,
    /// `max_tokens`, `max_completion_tokens` or `max_output_tokens`, whichever
    /// is given (the smallest if several are).
    pub max_output_tokens: Option<u64>,
    pub stream: bool,
    /// vLLM's `cache_salt`: requests with different salts never share blocks.
    pub cache_salt: Option<String>,
    /// Output sequences per prompt: `max(n, best_of)`, at least 1.
    pub sequences: u64,
    /// A completions batch's prompts after the first (routing follows the
    /// first; the charge counts them all).
    pub batch_rest: BatchRest,
}

/// The prompts of a completions batch after the first: counted, not kept.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BatchRest {
    pub prompts: u64,
    /// Bytes of the text prompts among them.
    pub text_bytes: u64,
    /// Token IDs of the token-ID prompts among them.
    pub token_ids: u64,
}

impl BatchRest {
    /// Counts the rest of a batch's list. Any JSON value is accepted as an
    /// element (as vLLM's own validation, not routing, judges them): a
    /// string counts its bytes, a list its elements, anything else nothing.
    ///
    /// Public for the frozen reference parser of the differential test and
    /// fuzz target (`filter/core/tests/differential/reference.rs`), which
    /// counts a batch the same way; routing code calls [`parse_request`].
    pub fn count<'de, A: SeqAccess<'de>>(seq: &mut A) -> Result<BatchRest, A::Error> {
        let mut rest = BatchRest::default();
        while let Some(item) = seq.next_element::<RestItem>()? {
            rest.prompts = rest.prompts.saturating_add(1);
            rest.text_bytes = rest.text_bytes.saturating_add(item.text_bytes);
            rest.token_ids = rest.token_ids.saturating_add(item.token_ids);
        }
        Ok(rest)
    }
}

/// One prompt of a batch after the first (see [`BatchRest::count`]).
struct RestItem {
    text_bytes: u64,
    token_ids: u64,
}

impl<'de> Deserialize<'de> for RestItem {
    fn deserialize<D: de::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        const NOTHING: RestItem = RestItem {
            text_bytes: 0,
            token_ids: 0,
        };
        impl<'de> Visitor<'de> for V {
            type Value = RestItem;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a prompt")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<RestItem, E> {
                Ok(RestItem {
                    text_bytes: v.len() as u64,
                    token_ids: 0,
                })
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<RestItem, A::Error> {
                let mut n = 0u64;
                while seq.next_element::<IgnoredAny>()?.is_some() {
                    n = n.saturating_add(1);
                }
                Ok(RestItem {
                    text_bytes: 0,
                    token_ids: n,
                })
            }
            fn visit_map<A: de::MapAccess<'de>>(self, mut map: A) -> Result<RestItem, A::Error> {
                while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
                Ok(NOTHING)
            }
            fn visit_bool<E: de::Error>(self, _: bool) -> Result<RestItem, E> {
                Ok(NOTHING)
            }
            fn visit_i64<E: de::Error>(self, _: i64) -> Result<RestItem, E> {
                Ok(NOTHING)
            }
            fn visit_u64<E: de::Error>(self, _: u64) -> Result<RestItem, E> {
                Ok(NOTHING)
            }
            fn visit_f64<E: de::Error>(self, _: f64) -> Result<RestItem, E> {
                Ok(NOTHING)
            }
            fn visit_unit<E: de::Error>(self) -> Result<RestItem, E> {
                Ok(NOTHING)
            }
            fn visit_none<E: de::Error>(self) -> Result<RestItem, E> {
                Ok(NOTHING)
            }
        }
        d.deserialize_any(V)
    }
}

/// Limits applied while parsing. serde_json itself refuses nesting deeper
/// than 128 levels, so deep bodies fail fast without recursion blow-ups.
#[derive(Clone, Debug)]
pub struct ParseLimits {
    /// Bodies longer than this are refused before parsing (bytes).
    pub max_body_bytes: usize,
}

impl Default for ParseLimits {
    fn default() -> Self {
        ParseLimits {
            max_body_bytes: 16 * 1024 * 1024,
        }
    }
}

/// Why a body could not be used for routing.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ParseError {
    /// The body is empty.
    Empty,
    /// The body is larger than `ParseLimits::max_body_bytes`.
    TooLarge { limit: usize, actual: usize },
    /// Not JSON, wrong types, invalid UTF-8 or nested too deeply; the message
    /// comes from serde_json and gives the line and column.
    Json(String),
    /// `model` is absent or empty.
    MissingModel,
    /// No prompt: no `messages`, `prompt` or `input`, or an empty one.
    MissingPrompt,
}

impl fmt::Display for ParseError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ParseError::Empty => write!(f, "request body is empty"),
            ParseError::TooLarge { limit, actual } => write!(
                f,
                "request body is {actual} bytes, over the {limit}-byte limit (routing.maxBodyBytes)"
            ),
            ParseError::Json(m) => write!(f, "request body is not a valid request: {m}"),
            ParseError::MissingModel => write!(f, "request body has no \"model\""),
            ParseError::MissingPrompt => {
                write!(
                    f,
                    "request body has no prompt (messages, prompt, input or token_ids)"
                )
            }
        }
    }
}

impl std::error::Error for ParseError {}

impl ParseError {
    /// A short stable label for counters and logs.
    pub fn label(&self) -> &'static str {
        match self {
            ParseError::Empty => "empty",
            ParseError::TooLarge { .. } => "too_large",
            ParseError::Json(_) => "invalid_json",
            ParseError::MissingModel => "missing_model",
            ParseError::MissingPrompt => "missing_prompt",
        }
    }
}

/// Parses a request body of the given API kind.
pub fn parse_request(
    kind: ApiKind,
    body: &[u8],
    limits: &ParseLimits,
) -> Result<InferenceRequest, ParseError> {
    parse(kind, body, limits, &mut render::NoCapture)
}

/// [`parse_request`], and for a chat body what its chat template reads
/// (precise mode with a tokenizer), taken in the same pass: the body is
/// read once. `None` for other bodies, and always in a build without the
/// `tokenizer` feature. Same result and errors as [`parse_request`].
pub fn parse_request_for_template(
    kind: ApiKind,
    body: &[u8],
    limits: &ParseLimits,
) -> Result<(InferenceRequest, Option<ChatTemplateInputs>), ParseError> {
    if kind == ApiKind::Messages {
        check_size(body, limits)?;
        return anthropic::parse(body, cfg!(feature = "tokenizer"));
    }
    #[cfg(feature = "tokenizer")]
    if kind == ApiKind::ChatCompletions {
        let mut cap = template::Capturing::default();
        let req = parse(kind, body, limits, &mut cap)?;
        return Ok((req, Some(cap.finish())));
    }
    parse_request(kind, body, limits).map(|r| (r, None))
}

/// The checks every body gets first: not empty, within the size limit, a
/// JSON object (serde's derive would also accept an array).
fn check_size(body: &[u8], limits: &ParseLimits) -> Result<(), ParseError> {
    if body.is_empty() {
        return Err(ParseError::Empty);
    }
    if body.len() > limits.max_body_bytes {
        return Err(ParseError::TooLarge {
            limit: limits.max_body_bytes,
            actual: body.len(),
        });
    }
    if body.iter().find(|b| !b.is_ascii_whitespace()) != Some(&b'{') {
        return Err(ParseError::Json("expected a JSON object".into()));
    }
    Ok(())
}

fn parse<C: render::Capture>(
    kind: ApiKind,
    body: &[u8],
    limits: &ParseLimits,
    cap: &mut C,
) -> Result<InferenceRequest, ParseError> {
    check_size(body, limits)?;
    let json_err = |e: serde_json::Error| ParseError::Json(e.to_string());
    let mut batch_rest = BatchRest::default();
    let (common, prompt) = match kind {
        ApiKind::ChatCompletions => {
            let p = render::parse(render::Body::Chat, body, cap)?;
            if p.messages.unwrap_or(0) == 0 {
                return Err(ParseError::MissingPrompt);
            }
            (p.common, Prompt::Text(p.prompt))
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
            let p = render::parse(render::Body::Responses, body, &mut render::NoCapture)?;
            (p.common, Prompt::Text(p.prompt))
        }
        ApiKind::Embeddings => {
            let mut b: EmbeddingsBody = serde_json::from_slice(body).map_err(json_err)?;
            (b.common(), Prompt::Text(Vec::new()))
        }
        ApiKind::Generate => {
            let b: GenerateBody = serde_json::from_slice(body).map_err(json_err)?;
            let sampling = b.sampling_params.unwrap_or_default();
            let common = Common {
                model: b.model,
                max_tokens: sampling.max_tokens,
                max_completion_tokens: None,
                max_output_tokens: None,
                stream: b.stream,
                cache_salt: b.cache_salt,
                n: sampling.n,
                best_of: None,
            };
            let ids = b.token_ids.ok_or(ParseError::MissingPrompt)?;
            (common, Prompt::TokenIds(ids))
        }
        ApiKind::Messages => return anthropic::parse(body, false).map(|(r, _)| r),
    };
    let model = match common.model {
        Some(m) if !m.is_empty() => m.into_owned(),
        // vLLM's generate API serves its one model when none is named.
        None if kind == ApiKind::Generate => String::new(),
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

/// vLLM's `GenerateRequest` (`vllm/entrypoints/serve/disagg/protocol.py`):
/// what routing reads of it. `sampling_params` is vLLM's `SamplingParams`;
/// `max_tokens` and `n` are the fields that size the request.
#[derive(Deserialize)]
struct GenerateBody<'a> {
    #[serde(borrow, default)]
    model: Option<Cow<'a, str>>,
    #[serde(default)]
    token_ids: Option<Vec<u32>>,
    #[serde(default)]
    sampling_params: Option<SamplingParams>,
    #[serde(default)]
    stream: Option<bool>,
    #[serde(borrow, default)]
    cache_salt: Option<Cow<'a, str>>,
}

#[derive(Deserialize, Default)]
struct SamplingParams {
    #[serde(default)]
    max_tokens: Option<u64>,
    #[serde(default)]
    n: Option<u64>,
}

/// A message read by serde: only those given as a JSON array
/// (`[role, name, content, tool_calls]`, which serde's derive accepts for a
/// struct) or that are not objects (to get serde's error); `render` reads
/// message objects itself.
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
// Rendering of what serde read (see `render` for the common path).

/// Renders a message read by serde: `<|role|>` [`<|name:NAME|>`] `\n`
/// text-content `\n` [`<|tool_calls|>` raw-json `\n`].
fn render_message(
    out: &mut json::Out,
    m: &Message<'_>,
    scratch: &mut Vec<u8>,
) -> Result<(), ParseError> {
    use json::Sink;
    out.put(b"<|");
    out.put(m.role.as_deref().unwrap_or("user").as_bytes());
    out.put(b"|>");
    if let Some(n) = &m.name {
        out.put(b"<|name:");
        out.put(n.as_bytes());
        out.put(b"|>");
    }
    out.put_byte(b'\n');
    match &m.content {
        Some(Content::Text(t)) => out.put(t.as_bytes()),
        Some(Content::Parts(parts)) => {
            for raw in parts {
                render::raw_part(out, raw, scratch)?;
            }
        }
        Some(Content::Null) | None => {}
    }
    out.put_byte(b'\n');
    if let Some(tc) = m.tool_calls {
        out.put(b"<|tool_calls|>");
        out.put(tc.get().as_bytes());
        out.put_byte(b'\n');
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Issue 40: the work a request asks for beyond one output of one
    /// prompt is read, so it can be charged.
    #[test]
    fn n_best_of_and_a_batch_are_read() {
        let lim = ParseLimits::default();
        let p = |k, b: &str| parse_request(k, b.as_bytes(), &lim).unwrap();
        let c = p(
            ApiKind::ChatCompletions,
            r#"{"model":"m","n":4,"messages":[{"role":"user","content":"x"}]}"#,
        );
        assert_eq!((c.sequences, c.batch_rest), (4, BatchRest::default()));
        let c = p(
            ApiKind::Completions,
            r#"{"model":"m","prompt":"x","n":2,"best_of":5}"#,
        );
        assert_eq!(c.sequences, 5);
        let c = p(ApiKind::Completions, r#"{"model":"m","prompt":"x","n":0}"#);
        assert_eq!(c.sequences, 1, "n: 0 is still one sequence");
        let c = p(
            ApiKind::Completions,
            r#"{"model":"m","prompt":["first","second!",[1,2,3],{"x":1},7]}"#,
        );
        assert_eq!(c.prompt, Prompt::Text(b"first".to_vec()));
        assert_eq!(
            c.batch_rest,
            BatchRest {
                prompts: 4,
                text_bytes: 7,
                token_ids: 3
            }
        );
        let c = p(
            ApiKind::Completions,
            r#"{"model":"m","prompt":[[1,2],[3,4,5],[6]]}"#,
        );
        assert_eq!(c.prompt, Prompt::TokenIds(vec![1, 2]));
        assert_eq!(
            c.batch_rest,
            BatchRest {
                prompts: 2,
                text_bytes: 0,
                token_ids: 4
            }
        );
        // A token-ID list is one prompt, not a batch.
        let c = p(ApiKind::Completions, r#"{"model":"m","prompt":[1,2,3]}"#);
        assert_eq!(c.batch_rest, BatchRest::default());
        // A bad `n` is a bad body (vLLM refuses it too).
        assert!(parse_request(
            ApiKind::ChatCompletions,
            br#"{"model":"m","n":-1,"messages":[{"role":"user","content":"x"}]}"#,
            &lim
        )
        .is_err());
    }

    fn chat(body: &str) -> Result<InferenceRequest, ParseError> {
        parse_request(
            ApiKind::ChatCompletions,
            body.as_bytes(),
            &ParseLimits::default(),
        )
    }

    fn text(r: &InferenceRequest) -> &str {
        match &r.prompt {
            Prompt::Text(t) => std::str::from_utf8(t).unwrap(),
            Prompt::TokenIds(_) => panic!("expected text"),
        }
    }

    #[test]
    fn path_selects_api() {
        assert_eq!(
            ApiKind::from_path("/v1/chat/completions"),
            Some(ApiKind::ChatCompletions)
        );
        assert_eq!(
            ApiKind::from_path("/v1/chat/completions?x=1"),
            Some(ApiKind::ChatCompletions)
        );
        assert_eq!(
            ApiKind::from_path("/openai/v1/completions/"),
            Some(ApiKind::Completions)
        );
        assert_eq!(
            ApiKind::from_path("/v1/responses"),
            Some(ApiKind::Responses)
        );
        assert_eq!(
            ApiKind::from_path("/v1/embeddings"),
            Some(ApiKind::Embeddings)
        );
        assert_eq!(ApiKind::from_path("/v1/models"), None);
        assert_eq!(ApiKind::from_path("/v1/chat/completionsX"), None);
    }

    #[test]
    fn chat_golden_rendering() {
        let r = chat(r#"{"model":"m","stream":true,"max_tokens":7,"cache_salt":"s",
            "tools":[{"type":"function","function":{"name":"f"}}],
            "messages":[{"role":"system","content":"You are terse."},
                        {"role":"user","name":"bob","content":[{"type":"text","text":"Hi "},{"type":"text","text":"there"}]},
                        {"role":"assistant","content":null,"tool_calls":[{"id":"1"}]}]}"#)
        .unwrap();
        assert_eq!(r.model, "m");
        assert!(r.stream);
        assert_eq!(r.max_output_tokens, Some(7));
        assert_eq!(r.cache_salt.as_deref(), Some("s"));
        assert_eq!(
            text(&r),
            "<|tools|>[{\"type\":\"function\",\"function\":{\"name\":\"f\"}}]\n\
             <|system|>\nYou are terse.\n\
             <|user|><|name:bob|>\nHi there\n\
             <|assistant|>\n\n<|tool_calls|>[{\"id\":\"1\"}]\n"
        );
    }

    #[test]
    fn non_text_parts_get_stable_distinct_placeholders() {
        let a = chat(r#"{"model":"m","messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"a.png"}}]}]}"#).unwrap();
        let a2 = chat(r#"{"model":"m","messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"a.png"}}]}]}"#).unwrap();
        let b = chat(r#"{"model":"m","messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"b.png"}}]}]}"#).unwrap();
        assert_eq!(a.prompt, a2.prompt);
        assert_ne!(a.prompt, b.prompt);
        assert!(text(&a).starts_with("<|user|>\n<|image_url:"));
    }

    #[test]
    fn conversation_extension_is_byte_extension() {
        let t1 = chat(r#"{"model":"m","messages":[{"role":"system","content":"S"},{"role":"user","content":"Q1"}]}"#).unwrap();
        let t2 = chat(r#"{"model":"m","messages":[{"role":"system","content":"S"},{"role":"user","content":"Q1"},{"role":"assistant","content":"A1"},{"role":"user","content":"Q2"}]}"#).unwrap();
        assert!(text(&t2).starts_with(text(&t1)));
    }

    #[test]
    fn completions_prompt_shapes() {
        let p =
            |b: &str| parse_request(ApiKind::Completions, b.as_bytes(), &ParseLimits::default());
        assert_eq!(
            p(r#"{"model":"m","prompt":"hello"}"#).unwrap().prompt,
            Prompt::Text(b"hello".to_vec())
        );
        assert_eq!(
            p(r#"{"model":"m","prompt":["a","b"]}"#).unwrap().prompt,
            Prompt::Text(b"a".to_vec())
        );
        assert_eq!(
            p(r#"{"model":"m","prompt":[1,2,3]}"#).unwrap().prompt,
            Prompt::TokenIds(vec![1, 2, 3])
        );
        assert_eq!(
            p(r#"{"model":"m","prompt":[[4,5],[6]]}"#).unwrap().prompt,
            Prompt::TokenIds(vec![4, 5])
        );
        assert!(matches!(
            p(r#"{"model":"m","prompt":[-1]}"#),
            Err(ParseError::Json(_))
        ));
        assert!(matches!(
            p(r#"{"model":"m","prompt":[]}"#),
            Err(ParseError::MissingPrompt)
        ));
        assert!(matches!(
            p(r#"{"model":"m"}"#),
            Err(ParseError::MissingPrompt)
        ));
    }

    #[test]
    fn output_limit_fields() {
        let p = |k, b: &str| parse_request(k, b.as_bytes(), &ParseLimits::default()).unwrap();
        assert_eq!(p(ApiKind::ChatCompletions, r#"{"model":"m","messages":[{"role":"user","content":"x"}],"max_completion_tokens":9}"#).max_output_tokens, Some(9));
        assert_eq!(
            p(
                ApiKind::Responses,
                r#"{"model":"m","input":"x","max_output_tokens":5}"#
            )
            .max_output_tokens,
            Some(5)
        );
        assert_eq!(
            p(
                ApiKind::Completions,
                r#"{"model":"m","prompt":"x","max_tokens":3,"max_completion_tokens":8}"#
            )
            .max_output_tokens,
            Some(3)
        );
    }

    #[test]
    fn responses_rendering() {
        let r = parse_request(
            ApiKind::Responses,
            br#"{"model":"m","instructions":"Be brief.","input":[{"role":"user","content":[{"type":"input_text","text":"Hello"}]}]}"#,
            &ParseLimits::default(),
        )
        .unwrap();
        assert_eq!(text(&r), "<|instructions|>\nBe brief.\n<|user|>\nHello\n");
    }

    #[test]
    fn vllm_generate_reads_token_ids_and_sampling_params() {
        let p = |b: &str| parse_request(ApiKind::Generate, b.as_bytes(), &ParseLimits::default());
        assert_eq!(
            ApiKind::from_path("/inference/v1/generate"),
            Some(ApiKind::Generate)
        );
        let r = p(
            r#"{"model":"m","token_ids":[1,2,3],"stream":true,"cache_salt":"s",
                     "sampling_params":{"max_tokens":8,"n":3,"temperature":0},"request_id":"x",
                     "kv_transfer_params":null,"priority":0}"#,
        )
        .unwrap();
        assert_eq!(r.model, "m");
        assert_eq!(r.prompt, Prompt::TokenIds(vec![1, 2, 3]));
        assert_eq!(r.max_output_tokens, Some(8));
        assert_eq!(r.sequences, 3);
        assert!(r.stream);
        assert_eq!(r.cache_salt.as_deref(), Some("s"));
        // `model` is optional in vLLM's GenerateRequest; `sampling_params`
        // is required there, but routing only reads its sizes.
        let r = p(r#"{"token_ids":[7]}"#).unwrap();
        assert_eq!(
            (r.model.as_str(), r.max_output_tokens, r.sequences),
            ("", None, 1)
        );
        assert_eq!(
            p(r#"{"model":"m","token_ids":[]}"#),
            Err(ParseError::MissingPrompt)
        );
        assert_eq!(
            p(r#"{"model":"m","prompt":"text"}"#),
            Err(ParseError::MissingPrompt)
        );
        assert_eq!(
            p(r#"{"model":"","token_ids":[1]}"#),
            Err(ParseError::MissingModel)
        );
        for bad in [
            r#"{"token_ids":[-1]}"#,
            r#"{"token_ids":[4294967296]}"#,
            r#"{"token_ids":"1 2"}"#,
            r#"{"token_ids":[1],"sampling_params":{"max_tokens":"8"}}"#,
        ] {
            assert_eq!(p(bad).unwrap_err().label(), "invalid_json", "{bad}");
        }
    }

    #[test]
    fn embeddings_need_only_model() {
        let r = parse_request(
            ApiKind::Embeddings,
            br#"{"model":"e","input":"x"}"#,
            &ParseLimits::default(),
        )
        .unwrap();
        assert_eq!(r.model, "e");
        assert!(r.prompt.is_empty());
    }

    #[test]
    fn bad_input_is_a_typed_error() {
        assert_eq!(chat(""), Err(ParseError::Empty));
        assert!(matches!(chat("{"), Err(ParseError::Json(_))));
        assert!(matches!(chat("[]"), Err(ParseError::Json(_))));
        assert!(matches!(
            chat(r#"{"model":5,"messages":[]}"#),
            Err(ParseError::Json(_))
        ));
        assert_eq!(
            chat(r#"{"messages":[{"role":"user","content":"x"}]}"#),
            Err(ParseError::MissingModel)
        );
        assert_eq!(
            chat(r#"{"model":"","messages":[{"role":"user","content":"x"}]}"#),
            Err(ParseError::MissingModel)
        );
        assert_eq!(
            chat(r#"{"model":"m","messages":[]}"#),
            Err(ParseError::MissingPrompt)
        );
        assert!(matches!(
            chat(r#"{"model":"m","messages":[{"role":"user","content":5}]}"#),
            Err(ParseError::Json(_))
        ));
        // Invalid UTF-8 inside a string.
        let mut b = br#"{"model":"m","messages":[{"role":"user","content":""#.to_vec();
        b.extend_from_slice(&[0xff, 0xfe]);
        b.extend_from_slice(br#""}]}"#);
        assert!(matches!(
            parse_request(ApiKind::ChatCompletions, &b, &ParseLimits::default()),
            Err(ParseError::Json(_))
        ));
    }

    #[test]
    fn deep_nesting_never_recurses_without_bound() {
        let nested = |depth: usize| format!("{}{}", "[".repeat(depth), "]".repeat(depth));
        // In a field routing reads: refused (serde_json stops at 128 levels,
        // or the shape is wrong); either way a typed error, not a crash.
        for depth in [200, 10_000, 1_000_000] {
            let b = format!(
                r#"{{"model":"m","messages":[{{"role":"user","content":{}}}]}}"#,
                nested(depth)
            );
            assert!(
                matches!(chat(&b), Err(ParseError::Json(_))),
                "depth {depth}"
            );
            let b = format!(r#"{{"model":"m","messages":{}}}"#, nested(depth));
            assert!(
                matches!(chat(&b), Err(ParseError::Json(_))),
                "depth {depth}"
            );
        }
        // In a field routing ignores: skipped iteratively by serde_json, so
        // it cannot overflow the stack; memory is bounded by the body limit.
        let b = format!(
            r#"{{"model":"m","messages":[{{"role":"user","content":"x"}}],"extra":{}}}"#,
            nested(1_000_000)
        );
        assert_eq!(chat(&b).unwrap().model, "m");
        // Deep objects in a read field hit serde_json's recursion limit.
        let deep_obj = format!("{}1{}", r#"{"a":"#.repeat(10_000), "}".repeat(10_000));
        let b = format!(
            r#"{{"model":"m","messages":[{{"role":"user","content":"x","name":{deep_obj}}}]}}"#
        );
        assert!(matches!(chat(&b), Err(ParseError::Json(_))));
    }

    #[test]
    fn size_limit() {
        let limits = ParseLimits { max_body_bytes: 10 };
        assert_eq!(
            parse_request(ApiKind::ChatCompletions, b"01234567890", &limits),
            Err(ParseError::TooLarge {
                limit: 10,
                actual: 11
            })
        );
    }

    #[test]
    fn ten_megabyte_string() {
        let big = "a".repeat(10 * 1024 * 1024);
        let body = format!(r#"{{"model":"m","messages":[{{"role":"user","content":"{big}"}}]}}"#);
        let r = chat(&body).unwrap();
        assert_eq!(text(&r).len(), big.len() + "<|user|>\n\n".len());
    }

    #[test]
    fn escaped_strings_are_decoded() {
        let r = chat(r#"{"model":"m\u0031","messages":[{"role":"user","content":"a\nb\u00e9"}]}"#)
            .unwrap();
        assert_eq!(r.model, "m1");
        assert_eq!(text(&r), "<|user|>\na\nbé\n");
    }
}

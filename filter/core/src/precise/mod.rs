//! Precise match mode: the request's prefix as vLLM's own block hashes, so
//! that it can be matched against the blocks each server reports holding in
//! its KV events (`BlockStored` / `BlockRemoved`), rather than against
//! kvroute's guess from its own past decisions (the approximate index).
//!
//! - [`vllm_hash`]: vLLM 0.32's `sha256_cbor` block hash (the servers must
//!   run with `--prefix-caching-hash-algo sha256_cbor`).
//! - [`tokenizer`]: the model's `tokenizer.json` and chat template, for text
//!   and chat prompts. Token-ID prompts need neither. Built without the
//!   `tokenizer` feature (a smaller module), it is a type that cannot be
//!   loaded: a config that names a tokenizer is refused, and token-ID
//!   prompts are hashed as in the full build.
//! - [`segments`]: the tokenizer's encoding by segment (the text between
//!   added tokens), each segment's IDs kept in a bounded
//!   [`segment_cache`], with exactly the whole text's result.
//!
//! When precise hashes cannot be had, the request is routed on the
//! approximate index instead, and the reason is counted ([`Fallback`]).

#[cfg(feature = "tokenizer")]
pub mod offpath;
pub mod segment_cache;
#[cfg(feature = "tokenizer")]
pub mod segments;
#[cfg(feature = "tokenizer")]
pub mod tokenizer;
#[cfg(not(feature = "tokenizer"))]
#[path = "no_tokenizer.rs"]
pub mod tokenizer;
pub mod vllm_hash;

use crate::request::{ApiKind, ChatTemplateInputs, InferenceRequest, Prompt};
use std::sync::Arc;
use tokenizer::ModelTokenizer;
use vllm_hash::VllmBlockHasher;

/// Why a prompt could not be turned into token IDs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TokenizeError {
    /// No chat template, or it failed to render (the message says why).
    Template(String),
    /// The tokenizer refused the text.
    Tokenize(String),
    /// A request shape vLLM would hash with extra keys or render differently
    /// (multimodal parts, `continue_final_message`).
    Unsupported(&'static str),
}

/// vLLM's and llm-d's default block size (tokens).
pub const DEFAULT_BLOCK_SIZE: u32 = 16;

/// A tokenizer for one model, as configured (llm-d's `tokenizer` plugin).
#[derive(Clone, Debug)]
pub struct TokenizerConfig {
    /// `modelName`, and the other names requests may use for the model
    /// (vLLM's `--served-model-name`).
    pub model_names: Vec<String>,
    /// `None`: configured without a loadable tokenizer (llm-d's UDS
    /// tokenizer, which a wasm VM cannot reach), or `tokenizeIn:
    /// collector` (then `offpath`); text and chat prompts fall back.
    pub tokenizer: Option<Arc<ModelTokenizer>>,
    /// `tokenizeIn: collector`: the tokenizer is loaded by the collector
    /// only, and workers look prompts up ([`offpath`]).
    pub offpath: Option<Arc<OffPathModel>>,
}

#[cfg(feature = "tokenizer")]
pub use offpath::OffPathModel;
#[cfg(not(feature = "tokenizer"))]
pub use tokenizer::OffPathModel;

/// Where a `tokenizeIn: collector` tokenizer comes from (opaque to the
/// config: the build without a tokenizer refuses it in [`offpath_model`]).
#[cfg(feature = "tokenizer")]
pub type OffPathSource = offpath::TokenizerSource;
/// (This build has no tokenizer: a source is refused by [`offpath_model`].)
#[cfg(not(feature = "tokenizer"))]
#[derive(Debug)]
pub struct OffPathSource;

/// An inline `tokenizer.json` for the collector.
pub fn offpath_source_inline(bytes: Vec<u8>) -> OffPathSource {
    #[cfg(feature = "tokenizer")]
    return offpath::TokenizerSource::Inline(bytes);
    #[cfg(not(feature = "tokenizer"))]
    {
        drop(bytes);
        OffPathSource
    }
}

/// A pinned `tokenizer.json` the collector fetches.
pub fn offpath_source_url(
    cluster: String,
    authority: String,
    path: String,
    sha256: [u8; 32],
    timeout_ms: u32,
) -> OffPathSource {
    #[cfg(feature = "tokenizer")]
    return offpath::TokenizerSource::Url {
        cluster,
        authority,
        path,
        sha256,
        timeout_ms,
    };
    #[cfg(not(feature = "tokenizer"))]
    {
        drop((cluster, authority, path, sha256, timeout_ms));
        OffPathSource
    }
}

/// The workers' side of a `tokenizeIn: collector` model (its chat template
/// compiled), or why it cannot be had.
pub fn offpath_model(
    source: OffPathSource,
    tokenizer_config: Option<serde_json::Value>,
    chat_template: Option<String>,
) -> Result<OffPathModel, String> {
    #[cfg(feature = "tokenizer")]
    return OffPathModel::new(source, tokenizer_config, chat_template);
    #[cfg(not(feature = "tokenizer"))]
    {
        drop((source, tokenizer_config, chat_template));
        Err(OffPathModel::refused())
    }
}

/// The precise producer's configuration (`precise-prefix-cache-producer`).
#[derive(Clone, Debug)]
pub struct PreciseConfig {
    /// `tokenProcessorConfig.blockSizeTokens` (or the older `blockSize`):
    /// vLLM's `--block-size`.
    pub block_size: u32,
    /// From `tokenProcessorConfig.hashSeed`: the servers' `PYTHONHASHSEED`
    /// (`None` when they run without one).
    pub hasher: VllmBlockHasher,
    /// Blocks hashed per request, at most.
    pub max_blocks: usize,
    pub tokenizers: Vec<TokenizerConfig>,
}

impl PartialEq for PreciseConfig {
    fn eq(&self, o: &Self) -> bool {
        self.block_size == o.block_size
            && self.hasher == o.hasher
            && self.max_blocks == o.max_blocks
            && self.tokenizers.len() == o.tokenizers.len()
            && self.tokenizers.iter().zip(&o.tokenizers).all(|(a, b)| {
                a.model_names == b.model_names
                    && a.tokenizer.is_some() == b.tokenizer.is_some()
                    && a.offpath.is_some() == b.offpath.is_some()
            })
    }
}

/// Why a request was routed on the approximate index in precise mode.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fallback {
    /// A text or chat prompt, and no tokenizer is loaded for its model.
    NoTokenizer,
    /// A text or chat prompt for a model no tokenizer is configured for.
    UnknownModel,
    /// The chat template is missing or failed to render.
    Template,
    /// The tokenizer failed.
    Tokenize,
    /// A request vLLM hashes with keys kvroute does not produce
    /// (multimodal parts, `continue_final_message`, the Responses API).
    Unsupported,
    /// No fresh held-blocks view of the servers to match against (no relay
    /// data yet, or stale).
    NoHeldView,
    /// `tokenizeIn: collector`: no prefix of the prompt is hashed yet (its
    /// text goes to the collector once a server accepts it).
    NotHashedYet,
    /// `tokenizeIn: collector`: the collector has not loaded the tokenizer
    /// yet (or could not).
    TokenizerLoading,
    /// The body's `model` is a LoRA adapter and the prompt is tokenized by
    /// the collector (`tokenizeIn: collector`): its stored prefixes are the
    /// base model's hashes, and vLLM hashes every block of an adapter's
    /// request with the extra key `("lora", name, path)`. (With the
    /// tokenizer in the worker, and for token-ID prompts, adapters are
    /// hashed with that key: `engine/models.rs`.)
    LoraAdapter,
    /// The body's `model` is a LoRA adapter, and some candidate endpoint
    /// that lists it has no known path for it (`/metrics` reports it but
    /// `/v1/models` has not, or its path is over the models table's bounds).
    LoraPathUnknown,
    /// The body's `model` is a LoRA adapter loaded from different paths on
    /// the candidate endpoints: vLLM's hashes of it differ by server.
    LoraPathsDiffer,
}

impl Fallback {
    pub const ALL: [Fallback; 11] = [
        Fallback::NoTokenizer,
        Fallback::UnknownModel,
        Fallback::Template,
        Fallback::Tokenize,
        Fallback::Unsupported,
        Fallback::NoHeldView,
        Fallback::NotHashedYet,
        Fallback::TokenizerLoading,
        Fallback::LoraAdapter,
        Fallback::LoraPathUnknown,
        Fallback::LoraPathsDiffer,
    ];

    /// A short stable label (the counter's suffix).
    pub fn label(self) -> &'static str {
        match self {
            Fallback::NoTokenizer => "no_tokenizer",
            Fallback::UnknownModel => "unknown_model",
            Fallback::Template => "template",
            Fallback::Tokenize => "tokenize",
            Fallback::Unsupported => "unsupported",
            Fallback::NoHeldView => "no_held_view",
            Fallback::NotHashedYet => "not_hashed_yet",
            Fallback::TokenizerLoading => "tokenizer_loading",
            Fallback::LoraAdapter => "lora_adapter",
            Fallback::LoraPathUnknown => "lora_path_unknown",
            Fallback::LoraPathsDiffer => "lora_paths_differ",
        }
    }
}

/// What precise mode did for one routed request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PreciseUse {
    /// Scored on the servers' held blocks; `blocks` vLLM hashes matched
    /// against them.
    Matched { blocks: u32 },
    /// Scored on the approximate index; `blocks` precise hashes were
    /// computed first (0 when none could be).
    Fallback { why: Fallback, blocks: u32 },
}

impl From<TokenizeError> for Fallback {
    fn from(e: TokenizeError) -> Fallback {
        match e {
            TokenizeError::Template(_) => Fallback::Template,
            TokenizeError::Tokenize(_) => Fallback::Tokenize,
            TokenizeError::Unsupported(_) => Fallback::Unsupported,
        }
    }
}

impl PreciseConfig {
    /// The tokenizer configured for `model`.
    fn tokenizer_for(&self, model: &str) -> Result<&ModelTokenizer, Fallback> {
        let t = self
            .tokenizers
            .iter()
            .find(|t| t.model_names.iter().any(|n| n == model))
            .ok_or(
                if self
                    .tokenizers
                    .iter()
                    .any(|t| t.tokenizer.is_some() || t.offpath.is_some())
                {
                    Fallback::UnknownModel
                } else {
                    Fallback::NoTokenizer
                },
            )?;
        t.tokenizer.as_deref().ok_or(Fallback::NoTokenizer)
    }

    /// Whether a chat template may be rendered (a tokenizer is loaded):
    /// then the request parser also takes what the template reads
    /// (`request::parse_request_for_template`).
    pub fn reads_chat_templates(&self) -> bool {
        self.tokenizers
            .iter()
            .any(|t| t.tokenizer.is_some() || t.offpath.is_some())
    }

    /// The off-path model (`tokenizeIn: collector`) for a request's model,
    /// and its index among the tokenizers.
    pub fn offpath_for(&self, model: &str) -> Option<(u8, &OffPathModel)> {
        let (i, t) = self
            .tokenizers
            .iter()
            .enumerate()
            .find(|(_, t)| t.model_names.iter().any(|n| n == model))?;
        Some((i.min(255) as u8, t.offpath.as_deref()?))
    }

    /// The request's prompt as vLLM token IDs (a token-ID prompt is
    /// borrowed, not copied). A chat prompt is rendered from `chat`, what
    /// the request parser took of the body, or else read from `body`.
    pub fn token_ids<'r>(
        &self,
        req: &'r InferenceRequest,
        body: &[u8],
        chat: Option<&ChatTemplateInputs>,
    ) -> Result<std::borrow::Cow<'r, [u32]>, Fallback> {
        use std::borrow::Cow;
        match (&req.prompt, req.kind) {
            (Prompt::TokenIds(ids), _) => Ok(Cow::Borrowed(ids.as_slice())),
            (Prompt::Text(text), ApiKind::Completions) => {
                let tok = self.tokenizer_for(&req.model)?;
                let text = std::str::from_utf8(text).map_err(|_| Fallback::Tokenize)?;
                Ok(Cow::Owned(tok.completion_ids(body, text)?))
            }
            (Prompt::Text(_), ApiKind::ChatCompletions) => {
                let tok = self.tokenizer_for(&req.model)?;
                Ok(Cow::Owned(match chat {
                    Some(chat) => tok.chat_ids_from(chat)?,
                    None => tok.chat_ids(body)?,
                }))
            }
            // vLLM's conversion to a chat request is the parser's
            // (`request/anthropic.rs`): without it, no hashes.
            (Prompt::Text(_), ApiKind::Messages) => {
                let tok = self.tokenizer_for(&req.model)?;
                let chat = chat.ok_or(Fallback::Unsupported)?;
                Ok(Cow::Owned(tok.chat_ids_from(chat)?))
            }
            (Prompt::Text(_), _) => Err(Fallback::Unsupported),
        }
    }

    /// vLLM's 64-bit block hashes of the request's prompt (full blocks
    /// only, at most `max_blocks`), and its token count (`chat`: as for
    /// [`PreciseConfig::token_ids`]).
    pub fn request_hashes(
        &self,
        req: &InferenceRequest,
        body: &[u8],
        chat: Option<&ChatTemplateInputs>,
    ) -> Result<(Vec<u64>, u64), Fallback> {
        let ids = self.token_ids(req, body, chat)?;
        let hashes = self.hashes_of(&ids, None, req.cache_salt.as_deref());
        Ok((hashes, ids.len() as u64))
    }

    /// vLLM's 64-bit block hashes of `ids` at this block size and cap, for
    /// a LoRA adapter's request when `lora` is set.
    pub fn hashes_of(
        &self,
        ids: &[u32],
        lora: Option<vllm_hash::LoraKey<'_>>,
        cache_salt: Option<&str>,
    ) -> Vec<u64> {
        self.hasher
            .block_hashes_u64_with(ids, self.block_size, lora, cache_salt, self.max_blocks)
    }
}

#[cfg(all(test, feature = "tokenizer"))]
mod tests;

//! The data producers that have no scheduling file: their parameters
//! (llm-d's names) and compile functions. `approx-prefix-cache-producer`
//! cuts prompts into blocks (`blocks.rs`) for the approximate index;
//! `precise-prefix-cache-producer` (and llm-d's deprecated
//! `precise-prefix-cache-scorer`) matches vLLM's own block hashes against
//! the held blocks the collector reads from the relays (`precise/`);
//! `token-producer` (llm-d's older name: `tokenizer`) is the model's
//! tokenizer for precise mode (`precise/tokenizer.rs`).

use super::check::{err, range_u64, Params};
use super::ConfigError;
use crate::blocks::BlockConfig;
use crate::precise::{self, PreciseConfig, TokenizerConfig};
use serde::Deserialize;
use serde_json::Value;

pub const APPROX_PREFIX: &str = "approx-prefix-cache-producer";
pub const PRECISE_PREFIX: &str = "precise-prefix-cache-producer";
/// Deprecated in llm-d: the precise producer that also scores in a profile.
pub const PRECISE_PREFIX_SCORER: &str = "precise-prefix-cache-scorer";
pub const TOKEN: &str = "token-producer";

/// `approx-prefix-cache-producer` parameters.
#[derive(Clone, Debug, PartialEq)]
pub struct PrefixProducerConfig {
    pub blocks: BlockConfig,
    /// Capacity from `vllm:cache_config_info` when available.
    pub auto_tune: bool,
    /// blocks per endpoint when metrics give none; 0 = unknown (only the
    /// index's byte budget bounds what is remembered)
    pub lru_capacity_per_server: u64,
    /// `charsPerToken: "auto"`: text prompts' tokens (charges, capacity, τ)
    /// use the bytes per token learnt from the servers
    /// (`learners::bytes_per_token`); blocks stay cut at
    /// `blockSizeTokens × chars_per_token` bytes, so the index never moves.
    pub learn_bytes_per_token: bool,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct ApproxPrefixParams {
    auto_tune: Option<bool>,
    block_size_tokens: Option<u64>,
    /// Deprecated in llm-d for `blockSizeTokens` (same unit since the
    /// producer split); used only when `blockSizeTokens` is absent.
    block_size: Option<u64>,
    max_prefix_blocks_to_match: Option<u64>,
    max_prefix_tokens_to_match: Option<u64>,
    lru_capacity_per_server: Option<u64>,
    /// kvroute extension: bytes per estimated token, or `"auto"`.
    chars_per_token: Option<Value>,
}

pub(crate) fn approx_prefix(p: &Params) -> Result<PrefixProducerConfig, ConfigError> {
    let q: ApproxPrefixParams = p.parse()?;
    let (bs_field, bs_value) = match (q.block_size_tokens, q.block_size) {
        (None, Some(b)) if b > 0 => ("blockSize", Some(b)),
        (t, _) => ("blockSizeTokens", t),
    };
    let bs = range_u64(&p.field(bs_field), bs_value, 64, 1, 65_536, "tokens")?;
    let (cpt_value, learn) = match &q.chars_per_token {
        None | Some(Value::Null) => (None, false),
        Some(Value::String(a)) if a == "auto" => (None, true),
        Some(Value::Number(n)) if n.as_u64().is_some() => (n.as_u64(), false),
        Some(other) => {
            return Err(err(
                p.field("charsPerToken"),
                format!("{other} is not allowed: give a whole number of bytes per token (1..=64) or \"auto\" (learn it from the servers)"),
            ))
        }
    };
    let cpt = range_u64(
        &p.field("charsPerToken"),
        cpt_value,
        4,
        1,
        64,
        "bytes per token",
    )?;
    // llm-d: the token cap (default 131072) wins when > 0; else the
    // block cap (default 2048) when > 0; both 0 = the whole prompt.
    let cap_tokens = q.max_prefix_tokens_to_match.unwrap_or(131_072);
    let cap_blocks = q.max_prefix_blocks_to_match.unwrap_or(2048);
    let max_tokens = if cap_tokens > 0 {
        cap_tokens
    } else {
        cap_blocks.saturating_mul(bs)
    };
    Ok(PrefixProducerConfig {
        blocks: BlockConfig {
            block_size_tokens: bs as u32,
            chars_per_token: cpt as u32,
            max_prefix_tokens: max_tokens,
        },
        auto_tune: q.auto_tune.unwrap_or(true),
        lru_capacity_per_server: q.lru_capacity_per_server.unwrap_or(0),
        learn_bytes_per_token: learn,
    })
}

/// `precise-prefix-cache-producer` (and the deprecated
/// `precise-prefix-cache-scorer`) parameters, llm-d's names.
#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct PreciseParams {
    token_processor_config: Option<TokenProcessorParams>,
    /// llm-d's in-process index and its tokenizer pool: kvroute's index is
    /// the collector's held-blocks view, and its tokenizer the
    /// `token-producer` plugin. Checked for shape only.
    indexer_config: Option<Value>,
    /// llm-d's ZMQ subscribers: kvroute's relay beside each server does
    /// that (a wasm VM cannot open a socket). Checked for shape only.
    kv_events_config: Option<Value>,
    /// kvroute's approximate index records every decision at once, which is
    /// what speculative entries do in llm-d; so both values behave alike.
    speculative_indexing: Option<bool>,
    #[serde(rename = "speculativeTTL")]
    speculative_ttl: Option<Value>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct TokenProcessorParams {
    block_size_tokens: Option<u64>,
    /// Deprecated in llm-d for `blockSizeTokens`.
    block_size: Option<u64>,
    hash_seed: Option<String>,
}

pub(crate) fn precise_prefix(p: &Params) -> Result<PreciseConfig, ConfigError> {
    let q: PreciseParams = p.parse()?;
    let _ = (
        q.indexer_config,
        q.kv_events_config,
        q.speculative_indexing,
        q.speculative_ttl,
    );
    let tp = q.token_processor_config.unwrap_or_default();
    let tpath = p.field("tokenProcessorConfig");
    let (bs_field, bs_value) = match (tp.block_size_tokens, tp.block_size) {
        (None | Some(0), Some(b)) if b > 0 => ("blockSize", Some(b)),
        // llm-d: 0 means "not set".
        (Some(0), _) => ("blockSizeTokens", None),
        (t, _) => ("blockSizeTokens", t),
    };
    let bs = range_u64(
        &format!("{tpath}.{bs_field}"),
        bs_value,
        u64::from(precise::DEFAULT_BLOCK_SIZE),
        1,
        65_536,
        "tokens (vLLM's --block-size)",
    )? as u32;
    if let Some(seed) = &tp.hash_seed {
        if seed.len() > 256 {
            return Err(err(
                format!("{tpath}.hashSeed"),
                "is longer than 256 bytes; it must equal the servers' PYTHONHASHSEED",
            ));
        }
    }
    Ok(PreciseConfig {
        block_size: bs,
        hasher: precise::vllm_hash::VllmBlockHasher::new(tp.hash_seed.as_deref()),
        // The approximate producer's default cap: 131072 tokens.
        max_blocks: (131_072 / bs as usize).max(1),
        tokenizers: Vec::new(),
    })
}

/// The largest inline `tokenizer.json` (bytes): production tokenizers are
/// 2–11 MB, and every VM holds its own loaded copy.
const MAX_TOKENIZER_JSON_BYTES: usize = 16 * 1024 * 1024;

/// `token-producer` (llm-d's older name: `tokenizer`) parameters.
#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct TokenizerParams {
    model_name: Option<String>,
    /// llm-d's gRPC-over-UDS tokenizer: not reachable from a wasm VM.
    uds_tokenizer_config: Option<Value>,
    /// llm-d's vLLM `/render` backend (an HTTP call per request).
    vllm: Option<Value>,
    /// llm-d's tokenizer-free estimate: kvroute's approximate mode.
    estimate: Option<Value>,
    /// kvroute: the model's `tokenizer.json`, inline (an object, or the
    /// file's text as a string).
    tokenizer_json: Option<Value>,
    /// kvroute: the model's `tokenizer_config.json`, inline (chat template,
    /// special tokens).
    tokenizer_config: Option<Value>,
    /// kvroute: a chat template that overrides `tokenizerConfig`'s.
    chat_template: Option<String>,
    /// kvroute: other names requests use for the model (vLLM's
    /// `--served-model-name`).
    served_model_names: Option<Vec<String>>,
    /// kvroute: `collector` (the default: only the collector loads the
    /// tokenizer; workers look prompts up, `precise::offpath`) or `worker`
    /// (each VM loads it and tokenizes on the request path).
    tokenize_in: Option<String>,
    /// kvroute: `tokenizer.json` by reference: an `http://` URL fetched by
    /// the collector through `tokenizerCluster`, pinned by
    /// `tokenizerSha256`.
    tokenizer_url: Option<String>,
    tokenizer_sha256: Option<String>,
    tokenizer_cluster: Option<String>,
    tokenizer_timeout_ms: Option<u64>,
}

/// `http://authority/path` → (authority, path).
fn http_url(url: &str) -> Option<(String, String)> {
    let rest = url.strip_prefix("http://")?;
    let (authority, path) = match rest.find('/') {
        Some(i) => (&rest[..i], &rest[i..]),
        None => (rest, "/"),
    };
    let ok = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_graphic());
    (ok(authority) && ok(path) && !authority.contains('@'))
        .then(|| (authority.to_owned(), path.to_owned()))
}

/// 64 hex digits → 32 bytes.
fn sha256_pin(s: &str) -> Option<[u8; 32]> {
    if s.len() != 64 {
        return None;
    }
    let mut out = [0u8; 32];
    for (i, b) in out.iter_mut().enumerate() {
        *b = u8::from_str_radix(s.get(2 * i..2 * i + 2)?, 16).ok()?;
    }
    Some(out)
}

pub(crate) fn token(p: &Params) -> Result<TokenizerConfig, ConfigError> {
    let q: TokenizerParams = p.parse()?;
    let model = match q.model_name {
        Some(m) if !m.is_empty() => m,
        _ if q.estimate.is_some() => String::new(),
        _ => {
            return Err(err(
                p.field("modelName"),
                "required: the model whose tokenizer this is (llm-d requires it too)",
            ))
        }
    };
    if q.vllm.is_some() {
        return Err(err(
            p.field("vllm"),
            "llm-d's vLLM /render backend needs an HTTP call to a server per request; kvroute tokenizes inside the module: give `tokenizerJson` (and `tokenizerConfig` for chat) instead",
        ));
    }
    if q.estimate.is_some() && q.tokenizer_json.is_some() {
        return Err(err(
            p.field("estimate"),
            "give either `estimate` (no tokenizer: text and chat prompts use the approximate index) or `tokenizerJson`, not both",
        ));
    }
    // udsTokenizerConfig: accepted and unused (see docs): without
    // `tokenizerJson` there is no tokenizer, and text and chat
    // prompts fall back to the approximate index (counted).
    let _ = q.uds_tokenizer_config;
    let collector = match q.tokenize_in.as_deref() {
        None => true,
        Some("collector") => true,
        Some("worker") if q.tokenizer_url.is_some() => {
            return Err(err(
                p.field("tokenizeIn"),
                "\"worker\" needs `tokenizerJson`: a tokenizer given by `tokenizerUrl` is fetched and loaded by the collector only",
            ))
        }
        Some("worker") => false,
        Some(o) => {
            return Err(err(
                p.field("tokenizeIn"),
                format!("\"{o}\" is not allowed; use \"worker\" (every VM loads the tokenizer) or \"collector\" (only the collector does)"),
            ))
        }
    };
    if q.tokenize_in.is_some() && q.tokenizer_json.is_none() && q.tokenizer_url.is_none() {
        return Err(err(
            p.field("tokenizeIn"),
            "needs `tokenizerJson` or `tokenizerUrl`",
        ));
    }
    if q.tokenizer_url.is_none()
        && (q.tokenizer_sha256.is_some()
            || q.tokenizer_cluster.is_some()
            || q.tokenizer_timeout_ms.is_some())
    {
        return Err(err(
            p.field("tokenizerUrl"),
            "required when `tokenizerSha256`, `tokenizerCluster` or `tokenizerTimeoutMs` is given",
        ));
    }
    if let Some(c) = &q.tokenizer_config {
        if !c.is_object() {
            return Err(err(
                p.field("tokenizerConfig"),
                "must be the tokenizer_config.json object",
            ));
        }
    }
    let source = match (&q.tokenizer_url, &q.tokenizer_json) {
        (Some(_), Some(_)) => {
            return Err(err(
                p.field("tokenizerUrl"),
                "give either `tokenizerUrl` or `tokenizerJson`, not both",
            ))
        }
        (Some(url), None) => {
            let (authority, path) = http_url(url).ok_or_else(|| {
                err(p.field("tokenizerUrl"), "must be an http:// URL (http://host[:port]/path): the collector fetches it through `tokenizerCluster`")
            })?;
            let pin = q.tokenizer_sha256.as_deref().ok_or_else(|| {
                err(p.field("tokenizerSha256"), "required with `tokenizerUrl`: the tokenizer's SHA-256, 64 hex digits (as Istio pins a module)")
            })?;
            let sha256 = sha256_pin(&pin.to_ascii_lowercase()).ok_or_else(|| {
                err(
                    p.field("tokenizerSha256"),
                    "must be 64 hex digits (the SHA-256 of tokenizer.json)",
                )
            })?;
            let cluster = match q.tokenizer_cluster.as_deref() {
                Some(c) if !c.is_empty() => c.to_owned(),
                _ => {
                    return Err(err(
                        p.field("tokenizerCluster"),
                        "required with `tokenizerUrl`: the Envoy cluster the collector sends the GET through",
                    ))
                }
            };
            let timeout_ms = range_u64(
                &p.field("tokenizerTimeoutMs"),
                q.tokenizer_timeout_ms,
                30_000,
                100,
                600_000,
                "ms",
            )? as u32;
            Some(precise::offpath_source_url(
                cluster, authority, path, sha256, timeout_ms,
            ))
        }
        _ => None,
    };
    let mut offpath = None;
    let tokenizer = match &q.tokenizer_json {
        None => None,
        Some(v) => {
            let bytes = match v {
                Value::String(s) => s.as_bytes().to_vec(),
                Value::Object(_) => serde_json::to_vec(v).unwrap_or_default(),
                _ => {
                    return Err(err(
                        p.field("tokenizerJson"),
                        "must be the tokenizer.json object, or its text as a string",
                    ))
                }
            };
            if bytes.len() > MAX_TOKENIZER_JSON_BYTES {
                return Err(err(
                    p.field("tokenizerJson"),
                    format!(
                        "is {} bytes; at most {MAX_TOKENIZER_JSON_BYTES} (each worker VM loads its own copy)",
                        bytes.len()
                    ),
                ));
            }
            if collector {
                // Loaded by the collector only: here, its JSON syntax.
                if let Err(e) = serde_json::from_slice::<serde::de::IgnoredAny>(&bytes) {
                    return Err(err(
                        p.field("tokenizerJson"),
                        format!("tokenizer.json does not load: {e}"),
                    ));
                }
                offpath = Some(precise::offpath_source_inline(bytes));
                None
            } else {
                let t = precise::tokenizer::ModelTokenizer::load(
                    &bytes,
                    q.tokenizer_config.as_ref(),
                    q.chat_template.as_deref(),
                )
                .map_err(|e| err(p.field("tokenizerJson"), e))?;
                Some(std::sync::Arc::new(t))
            }
        }
    };
    let offpath = match offpath.or(source) {
        None => None,
        Some(src) => {
            let field = if q.tokenizer_url.is_some() {
                "tokenizerUrl"
            } else {
                "tokenizerJson"
            };
            let m =
                precise::offpath_model(src, q.tokenizer_config.clone(), q.chat_template.clone())
                    .map_err(|e| err(p.field(field), e))?;
            Some(std::sync::Arc::new(m))
        }
    };
    if tokenizer.is_none()
        && offpath.is_none()
        && (q.tokenizer_config.is_some() || q.chat_template.is_some())
    {
        return Err(err(
            p.field("tokenizerJson"),
            "required when `tokenizerConfig` or `chatTemplate` is given",
        ));
    }
    let mut model_names = vec![model];
    model_names.extend(q.served_model_names.unwrap_or_default());
    model_names.retain(|m| !m.is_empty());
    Ok(TokenizerConfig {
        model_names,
        tokenizer,
        offpath,
    })
}

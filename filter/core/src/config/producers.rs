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
    match (bs_field, q.block_size) {
        ("blockSize", _) => p.warn(
            "blockSize",
            format!("deprecated in llm-d for `blockSizeTokens` (llm-d maps it the same way): read as blockSizeTokens {bs}"),
        ),
        (_, Some(b)) if b > 0 => p.warn(
            "blockSize",
            "deprecated in llm-d for `blockSizeTokens`, which is given: ignored",
        ),
        _ => {}
    }
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
    if let Some(n) = q.max_prefix_blocks_to_match {
        p.warn(
            "maxPrefixBlocksToMatch",
            if cap_tokens > 0 {
                format!("deprecated in llm-d for `maxPrefixTokensToMatch`, and read only when that is 0; it is {cap_tokens} here, so {n} blocks is ignored")
            } else {
                format!("deprecated in llm-d for `maxPrefixTokensToMatch`: {n} blocks × {bs} tokens = a cap of {max_tokens} tokens")
            },
        );
    }
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

/// The index parameters llm-d's `prefix-cache-scorer` took while it kept
/// the approximate index itself (gateway-api-inference-extension's
/// `multi/prefix` plugin, up to its split into a producer, 2026-04-06).
/// Current llm-d decodes the scorer's parameters strictly and refuses
/// them there; kvroute maps them to `approx-prefix-cache-producer` as they
/// meant then, with a warning each (`legacy_scorer_index`).
pub(crate) const LEGACY_SCORER_INDEX: &[&str] = &[
    "hashBlockSize",
    "blockSize",
    "blockSizeTokens",
    "maxPrefixBlocksToMatch",
    "lruCapacityPerServer",
    "autoTune",
];

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct LegacyScorerIndex {
    /// Characters (bytes of the prompt text) per block; renamed `blockSize`
    /// in 2025-09 (same unit), with no alias.
    hash_block_size: Option<u64>,
    /// Characters per block (2025-09 to 2026-01); once `blockSizeTokens`
    /// came, llm-d refused it given alone, and used `blockSizeTokens` when
    /// both were given.
    block_size: Option<u64>,
    /// Tokens per block (2026-01 on).
    block_size_tokens: Option<u64>,
    /// The only prefix cap then: blocks of the scorer's block size.
    max_prefix_blocks_to_match: Option<u64>,
    /// Index entries (blocks) per server; the producer's parameter today.
    lru_capacity_per_server: Option<u64>,
    /// 2025-11 on; the producer's parameter today.
    auto_tune: Option<bool>,
}

/// Splits a `prefix-cache-scorer`'s parameters (at `path`) into the
/// scorer's own and, when any [`LEGACY_SCORER_INDEX`] key is given, the
/// index they configure, as `approx-prefix-cache-producer` parameters
/// meaning the same; each key given adds a warning.
///
/// - `hashBlockSize` / `blockSize` (characters): the prompt was cut into
///   blocks of that many bytes; kvroute cuts blocks of `blockSizeTokens ×
///   4` bytes, so they map to `blockSizeTokens` = ⌊c / 4⌉ (≥ 1).
/// - `maxPrefixBlocksToMatch`: n blocks of that block size, so
///   `maxPrefixTokensToMatch` = n × `blockSizeTokens`.
/// - `lruCapacityPerServer`, `autoTune`, `blockSizeTokens`: the same name
///   and unit on the producer.
pub(crate) fn legacy_scorer_index(
    value: &Option<Value>,
    path: &str,
    warnings: &std::cell::RefCell<Vec<String>>,
) -> Result<(Option<Value>, Option<PrefixProducerConfig>), ConfigError> {
    let Some(Value::Object(all)) = value else {
        return Ok((value.clone(), None));
    };
    let (legacy, own): (
        serde_json::Map<String, Value>,
        serde_json::Map<String, Value>,
    ) = all
        .clone()
        .into_iter()
        .partition(|(k, _)| LEGACY_SCORER_INDEX.contains(&k.as_str()));
    if legacy.is_empty() {
        return Ok((value.clone(), None));
    }
    let q: LegacyScorerIndex = super::check::strict_value(&Some(Value::Object(legacy)), path)?;
    let field = |f: &str| format!("{path}.{f}");
    const WHY: &str = "an index parameter of llm-d's prefix-cache-scorer from before the index became approx-prefix-cache-producer (current llm-d refuses it here)";
    let mut notes: Vec<(&str, String)> = Vec::new();
    let chars = match (q.hash_block_size, q.block_size) {
        (Some(_), Some(_)) => {
            return Err(err(
                field("blockSize"),
                "and hashBlockSize are one parameter under its old and new name (characters per block): give one",
            ))
        }
        (Some(c), None) => Some(("hashBlockSize", c)),
        (None, Some(c)) => Some(("blockSize", c)),
        (None, None) => None,
    };
    let bs = match (q.block_size_tokens, chars) {
        (Some(t), chars) => {
            let t = range_u64(&field("blockSizeTokens"), Some(t), 64, 1, 65_536, "tokens")?;
            notes.push((
                "blockSizeTokens",
                format!("mapped to approx-prefix-cache-producer's blockSizeTokens {t}"),
            ));
            if let Some((f, _)) = chars {
                notes.push((
                    f,
                    "ignored: blockSizeTokens is given (llm-d's rule)".to_string(),
                ));
            }
            t
        }
        (None, Some((f, c))) => {
            let c = range_u64(&field(f), Some(c), 64, 1, 262_144, "characters")?;
            let t = ((c + 2) / 4).max(1);
            notes.push((f, format!("{c} characters per block mapped to approx-prefix-cache-producer's blockSizeTokens {t} (blocks of {} bytes at 4 bytes per token)", t * 4)));
            t
        }
        (None, None) => 64,
    };
    let mut producer = serde_json::Map::new();
    producer.insert("blockSizeTokens".into(), bs.into());
    if let Some(n) = q.max_prefix_blocks_to_match {
        let n = range_u64(
            &field("maxPrefixBlocksToMatch"),
            Some(n),
            256,
            1,
            1 << 24,
            "blocks",
        )?;
        let tokens = n.saturating_mul(bs);
        producer.insert("maxPrefixTokensToMatch".into(), tokens.into());
        notes.push(("maxPrefixBlocksToMatch", format!("{n} blocks × {bs} tokens mapped to approx-prefix-cache-producer's maxPrefixTokensToMatch {tokens}")));
    }
    if let Some(n) = q.lru_capacity_per_server {
        producer.insert("lruCapacityPerServer".into(), n.into());
        notes.push(("lruCapacityPerServer", format!("mapped to approx-prefix-cache-producer's lruCapacityPerServer {n} (blocks per server when metrics give no capacity)")));
    }
    if let Some(a) = q.auto_tune {
        producer.insert("autoTune".into(), a.into());
        notes.push((
            "autoTune",
            format!("mapped to approx-prefix-cache-producer's autoTune {a}"),
        ));
    }
    let producer = Some(Value::Object(producer));
    let config = approx_prefix(&Params {
        kind: APPROX_PREFIX,
        value: &producer,
        path: path.to_string(),
        producers: &[],
        warnings,
    })?;
    let mut w = warnings.borrow_mut();
    for (f, note) in notes {
        w.push(format!("`{}`: {WHY}; {note}", field(f)));
    }
    let own = (!own.is_empty()).then_some(Value::Object(own));
    Ok((own, Some(config)))
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
    if bs_field == "blockSize" {
        p.warn(
            "tokenProcessorConfig.blockSize",
            format!("deprecated in llm-d for `blockSizeTokens`: read as blockSizeTokens {bs}"),
        );
    }
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

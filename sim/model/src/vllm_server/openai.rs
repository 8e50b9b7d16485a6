//! The OpenAI-compatible surface as vLLM serves it: turning a parsed request
//! into engine input, and the JSON bodies and SSE chunks of the answers.

use super::tokenize::Tokenization;
use super::EmulatorConfig;
use crate::vllm_hash::VllmBlockHasher;
use crate::vllm_model::EngineRequest;
use crate::words::output_word;
use kvroute_core::blocks::{prompt_blocks, BlockConfig};
use kvroute_core::request::{ApiKind, InferenceRequest, Prompt};
use serde_json::{json, Value};

/// Stand-in vocabulary size for text prompts' event token IDs (Qwen3's).
const STAND_IN_VOCAB: u32 = 151_936;

/// Engine input for a request.
///
/// With a model tokenizer ([`Tokenization::Model`], the default) text and
/// chat prompts are tokenized as vLLM does (see [`super::tokenize`]) and,
/// like token-ID prompts, hashed with vLLM's `sha256_cbor` block hashes, so
/// KV events match a real server with the same tokenizer and
/// `PYTHONHASHSEED`. With [`Tokenization::Estimate`], and for the Responses
/// API (not modelled), text prompts count `bytes / chars_per_token` tokens
/// and use kvroute-core's block hashes. `Err` is a prompt the template or
/// tokenizer refuses (vLLM answers 400).
pub fn engine_request(
    req: &InferenceRequest,
    body: &[u8],
    cfg: &EmulatorConfig,
    hasher: &VllmBlockHasher,
    with_event_tokens: bool,
) -> Result<EngineRequest, String> {
    let bs = cfg.engine.block_size;
    let output_tokens = req
        .max_output_tokens
        .unwrap_or(u64::from(cfg.default_max_tokens))
        .clamp(1, u64::from(u32::MAX)) as u32;
    let salt = req.cache_salt.as_deref().filter(|s| !s.is_empty());
    let token_request = |ids: &[u32]| EngineRequest {
        prompt_tokens: ids.len().min(u32::MAX as usize) as u32,
        block_hashes: hasher.block_hashes_u64(ids, bs, salt, usize::MAX),
        event_token_ids: with_event_tokens.then(|| ids.to_vec().into()),
        first_block_extra_keys: salt.map(|s| vec![s.to_owned()]),
        output_tokens,
    };
    match &req.prompt {
        Prompt::Text(text) => {
            if let Tokenization::Model(tok) = &cfg.tokenizer {
                let text = String::from_utf8_lossy(text);
                if let Some(ids) = tok.prompt_ids(req.kind, body, &text) {
                    return ids.map(|ids| token_request(&ids));
                }
            }
            let blocks = prompt_blocks(
                req,
                &BlockConfig {
                    block_size_tokens: bs,
                    chars_per_token: cfg.chars_per_token,
                    max_prefix_tokens: 0,
                },
            );
            let event_token_ids = with_event_tokens.then(|| {
                text.chunks(cfg.chars_per_token.max(1) as usize)
                    .map(|chunk| fnv1a(chunk) % STAND_IN_VOCAB)
                    .collect::<Vec<u32>>()
                    .into()
            });
            Ok(EngineRequest {
                prompt_tokens: blocks.prompt_tokens.min(u64::from(u32::MAX)) as u32,
                block_hashes: blocks.block_hashes,
                event_token_ids,
                first_block_extra_keys: None,
                output_tokens,
            })
        }
        Prompt::TokenIds(ids) => Ok(token_request(ids)),
    }
}

fn fnv1a(bytes: &[u8]) -> u32 {
    bytes.iter().fold(0x811c_9dc5u32, |h, &b| {
        (h ^ u32::from(b)).wrapping_mul(0x0100_0193)
    })
}

/// vLLM's error body: `{"error": {"message", "type", "param", "code"}}`.
pub fn error_body(status: u16, message: &str) -> Value {
    let kind = match status {
        400 => "BadRequestError",
        404 => "NotFoundError",
        429 => "TooManyRequestsError",
        500 => "InternalServerError",
        503 => "ServiceUnavailableError",
        _ => "Error",
    };
    json!({"error": {"message": message, "type": kind, "param": null, "code": status}})
}

/// What the answer to one request looks like.
#[derive(Clone, Debug)]
pub struct ResponseShape {
    pub chat: bool,
    /// Anthropic's Messages API: the chat answer re-shaped
    /// (`super::anthropic`).
    pub messages: bool,
    pub id: String,
    pub created: u64,
    pub model: String,
    pub prompt_tokens: u32,
    pub include_usage: bool,
    /// Seeds the output words.
    pub text_seed: u64,
}

impl ResponseShape {
    pub fn new(
        kind: ApiKind,
        model: &str,
        prompt_tokens: u32,
        request_no: u64,
        include_usage: bool,
    ) -> Self {
        let chat = kind == ApiKind::ChatCompletions;
        let prefix = if chat { "chatcmpl" } else { "cmpl" };
        ResponseShape {
            chat,
            messages: false,
            id: format!("{prefix}-{request_no:032x}"),
            created: super::unix_now_s() as u64,
            model: model.to_owned(),
            prompt_tokens,
            include_usage,
            text_seed: request_no,
        }
    }

    /// Output text of tokens `from..to` (one word per token, space-led).
    pub fn text(&self, from: u32, to: u32) -> String {
        let mut s = String::new();
        for i in from..to {
            s.push(' ');
            s.push_str(output_word(self.text_seed, u64::from(i)));
        }
        s
    }

    pub fn usage(&self, completion_tokens: u32, cached_tokens: u32) -> Value {
        json!({
            "prompt_tokens": self.prompt_tokens,
            "total_tokens": self.prompt_tokens + completion_tokens,
            "completion_tokens": completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens},
        })
    }

    fn chunk_object(&self) -> &'static str {
        if self.chat {
            "chat.completion.chunk"
        } else {
            "text_completion"
        }
    }

    fn sse(v: &Value) -> String {
        format!("data: {v}\n\n")
    }

    /// The chat stream's opening chunk (role, empty content).
    pub fn role_chunk(&self) -> String {
        Self::sse(&json!({
            "id": self.id, "object": self.chunk_object(), "created": self.created, "model": self.model,
            "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": null, "finish_reason": null}],
        }))
    }

    /// A chunk carrying `text`; the last one has `finish_reason: "length"`.
    pub fn content_chunk(&self, text: &str, last: bool) -> String {
        let finish = if last { json!("length") } else { Value::Null };
        let choice = if self.chat {
            json!({"index": 0, "delta": {"content": text}, "logprobs": null, "finish_reason": finish, "stop_reason": null})
        } else {
            json!({"index": 0, "text": text, "logprobs": null, "finish_reason": finish, "stop_reason": null})
        };
        Self::sse(&json!({
            "id": self.id, "object": self.chunk_object(), "created": self.created, "model": self.model,
            "choices": [choice],
        }))
    }

    /// The closing usage chunk (`stream_options.include_usage`).
    pub fn usage_chunk(&self, completion_tokens: u32, cached_tokens: u32) -> String {
        Self::sse(&json!({
            "id": self.id, "object": self.chunk_object(), "created": self.created, "model": self.model,
            "choices": [], "usage": self.usage(completion_tokens, cached_tokens),
        }))
    }

    pub const DONE: &'static str = "data: [DONE]\n\n";

    /// One streamed step of a Messages answer: `message_start` and the
    /// text block's start first, a `text_delta`, and at the end the
    /// block's stop, `message_delta` (usage) and `message_stop`.
    pub fn messages_events(&self, first: bool, text: &str, finished: Option<(u32, u32)>) -> String {
        use super::anthropic;
        let mut out = String::new();
        if first {
            out.push_str(&anthropic::start_events(
                &self.id,
                &self.model,
                self.prompt_tokens,
            ));
        }
        out.push_str(&anthropic::delta_event(text));
        if let Some((generated, cached)) = finished {
            out.push_str(&anthropic::end_events(anthropic::usage(
                self.prompt_tokens,
                generated,
                cached,
            )));
        }
        out
    }

    /// The whole non-streaming answer.
    pub fn full_body(&self, completion_tokens: u32, cached_tokens: u32) -> Value {
        let text = self.text(0, completion_tokens);
        if self.messages {
            use super::anthropic;
            let usage = anthropic::usage(self.prompt_tokens, completion_tokens, cached_tokens);
            return anthropic::message_body(&self.id, &self.model, &text, usage);
        }
        let usage = self.usage(completion_tokens, cached_tokens);
        if self.chat {
            json!({
                "id": self.id, "object": "chat.completion", "created": self.created, "model": self.model,
                "choices": [{"index": 0,
                    "message": {"role": "assistant", "content": text, "refusal": null, "annotations": null,
                                "audio": null, "function_call": null, "tool_calls": [], "reasoning_content": null},
                    "logprobs": null, "finish_reason": "length", "stop_reason": null}],
                "service_tier": null, "system_fingerprint": null, "usage": usage,
                "prompt_logprobs": null, "kv_transfer_params": null,
            })
        } else {
            json!({
                "id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
                "choices": [{"index": 0, "text": text, "logprobs": null, "finish_reason": "length",
                             "stop_reason": null, "prompt_logprobs": null}],
                "service_tier": null, "system_fingerprint": null, "usage": usage,
                "kv_transfer_params": null,
            })
        }
    }
}

/// `/v1/models`.
pub fn models_body(model: &str, created: u64, max_model_len: u64) -> Value {
    models_body_with_loras(model, &[], created, max_model_len)
}

/// `GET /v1/models` as vLLM 0.32 answers it with LoRA adapters loaded: the
/// base model's card, then one card per adapter (`root` its path, `parent`
/// the base model, no `max_model_len`).
pub fn models_body_with_loras(
    model: &str,
    loras: &[String],
    created: u64,
    max_model_len: u64,
) -> Value {
    let mut data = vec![
        json!({"id": model, "object": "model", "created": created, "owned_by": "vllm",
                  "root": model, "parent": null, "max_model_len": max_model_len}),
    ];
    for l in loras {
        data.push(
            json!({"id": l, "object": "model", "created": created, "owned_by": "vllm",
                  "root": format!("/adapters/{l}"), "parent": model, "max_model_len": null}),
        );
    }
    json!({"object": "list", "data": data})
}

/// vLLM 0.32's 404 for a model it does not serve, `served` being its base
/// model (`entrypoints/serve/engine/serving.py`, `_check_model`; seen on the
/// real server: "The model `nope` does not exist. Valid aliases: tiny.").
pub fn model_not_found_body(model: &str, served: &str) -> Value {
    json!({"error": {"message": format!("The model `{model}` does not exist. Valid aliases: {served}."),
                     "type": "NotFoundError", "param": "model", "code": 404}})
}

//! What a modelled vLLM server answers, without I/O: its settings, the
//! OpenAI-compatible surface (request → engine input, response bodies), the
//! tokenizer and chat template, and the `/metrics` page. The emulator
//! (`kvroute-sim`'s `emulator`) serves these over HTTP; the simulator calls
//! them directly, so both drivers build the same engine input and the same
//! page from the same state.

pub mod anthropic;
pub mod metrics_text;
pub mod openai;
pub mod tokenize;

use crate::cli::Flags;
use crate::vllm_model::{EngineConfig, StepCost};

/// Everything one emulated endpoint needs besides its port.
#[derive(Clone, Debug)]
pub struct EmulatorConfig {
    pub engine: EngineConfig,
    /// Served model name (`--model`); requests for another model get 404.
    pub model: String,
    /// How text and chat prompts become tokens (`--tokenizer`).
    pub tokenizer: tokenize::Tokenization,
    /// Bytes of text per token with `--tokenizer estimate`
    /// (`--chars-per-token`), as the filter's estimate.
    pub chars_per_token: u32,
    /// Model seconds per wall-clock second (`--time-scale`); 10 runs ten
    /// times faster than the modelled hardware.
    pub time_scale: f64,
    /// First ZMQ port for KV events (`--kv-events-port-base`); endpoint i
    /// publishes on base + i. `Some(0)` picks free ports. `None`: off.
    pub kv_events_port_base: Option<u16>,
    /// ZMQ topic; `{endpoint}` and `{model}` are replaced.
    pub kv_events_topic: String,
    /// `PYTHONHASHSEED` of the emulated server, seeds token-ID block hashes.
    pub python_hash_seed: String,
    /// Output tokens per streamed chunk (vLLM `--stream-interval`).
    pub stream_interval: u32,
    /// Output tokens when the client gives no `max_tokens`.
    pub default_max_tokens: u32,
    /// Serve any `model` instead of answering 404.
    pub accept_any_model: bool,
    /// LoRA adapters loaded at start (`--lora-modules`): served by name,
    /// listed in `/v1/models` with `parent` the model, and reported in
    /// `vllm:lora_requests_info`. The engine treats their requests as the
    /// base model's.
    pub lora_modules: Vec<String>,
    /// Adapter slots (`--max-loras`), `max_lora` in `vllm:lora_requests_info`.
    pub max_loras: u32,
}

impl EmulatorConfig {
    /// Whether a request for `model` is served (the model or an adapter).
    pub fn serves(&self, model: &str) -> bool {
        self.accept_any_model || model == self.model || self.lora_modules.iter().any(|m| m == model)
    }
}

impl Default for EmulatorConfig {
    fn default() -> Self {
        EmulatorConfig {
            engine: EngineConfig::default(),
            model: "tiny".into(),
            tokenizer: tokenize::Tokenization::tiny(),
            chars_per_token: 4,
            time_scale: 1.0,
            kv_events_port_base: None,
            kv_events_topic: "kv@{endpoint}@{model}".into(),
            python_hash_seed: "0".into(),
            stream_interval: 1,
            default_max_tokens: 16,
            accept_any_model: false,
            lora_modules: Vec::new(),
            max_loras: 1,
        }
    }
}

/// Unix time now, seconds.
pub fn unix_now_s() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

/// The engine settings from the emulator's flags (`--block-size`,
/// `--num-gpu-blocks`, `--max-num-batched-tokens`, `--max-num-seqs`,
/// `--max-model-len`, `--prefill-tps`, `--prefill-attention-tokens`,
/// `--decode-step-ms`, `--decode-ms-per-seq`,
/// `--decode-ns-per-context-token`), each defaulting to
/// [`EngineConfig::default`]'s: one function for `kvroute-emulator` and the
/// simulator's binaries, so a modelled server is the emulated one. Check
/// the result with [`check_engine`].
pub fn engine_from_flags(f: &Flags) -> Result<EngineConfig, String> {
    let de = EngineConfig::default();
    let ds = StepCost::default();
    Ok(EngineConfig {
        block_size: f.get("block-size", de.block_size)?,
        num_gpu_blocks: f.get("num-gpu-blocks", de.num_gpu_blocks)?,
        max_num_batched_tokens: f.get("max-num-batched-tokens", de.max_num_batched_tokens)?,
        max_num_seqs: f.get("max-num-seqs", de.max_num_seqs)?,
        max_model_len: f.get("max-model-len", de.max_model_len)?,
        step_cost: StepCost {
            prefill_tokens_per_s: f.get("prefill-tps", ds.prefill_tokens_per_s)?,
            prefill_attention_context_tokens: f.get(
                "prefill-attention-tokens",
                ds.prefill_attention_context_tokens,
            )?,
            decode_step_ms: f.get("decode-step-ms", ds.decode_step_ms)?,
            decode_ms_per_seq: f.get("decode-ms-per-seq", ds.decode_ms_per_seq)?,
            decode_ns_per_context_token: f.get(
                "decode-ns-per-context-token",
                ds.decode_ns_per_context_token,
            )?,
        },
    })
}

/// Refuses engine settings the model cannot run, naming the flag as
/// `{program}: --flag …`: a zero block size, cache, batch budget or batch
/// size; a prefill rate that is not positive; a negative attended context.
pub fn check_engine(e: &EngineConfig, program: &str) -> Result<(), String> {
    for (name, v) in [
        ("--block-size", e.block_size),
        ("--num-gpu-blocks", e.num_gpu_blocks),
        ("--max-num-batched-tokens", e.max_num_batched_tokens),
        ("--max-num-seqs", e.max_num_seqs),
    ] {
        if v == 0 {
            return Err(format!("{program}: {name} must be at least 1"));
        }
    }
    let tps = e.step_cost.prefill_tokens_per_s;
    if !(tps > 0.0 && tps.is_finite()) {
        return Err(format!("{program}: --prefill-tps must be positive"));
    }
    let c = e.step_cost.prefill_attention_context_tokens;
    if !(c >= 0.0 && c.is_finite()) {
        return Err(format!(
            "{program}: --prefill-attention-tokens must be 0 (off) or positive"
        ));
    }
    Ok(())
}

//! What a modelled vLLM server answers, without I/O: its settings, the
//! OpenAI-compatible surface (request → engine input, response bodies), the
//! tokenizer and chat template, and the `/metrics` page. The emulator
//! (`kvroute-sim`'s `emulator`) serves these over HTTP; the simulator calls
//! them directly, so both drivers build the same engine input and the same
//! page from the same state.

pub mod metrics_text;
pub mod openai;
pub mod tokenize;

use crate::vllm_model::EngineConfig;

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

//! The modelled fleet's flags, shared by `kvroute-simulate` and
//! `kvroute-what-if`: the emulator's own names, and its engine settings built
//! by the same function ([`engine_from_flags`]).

use super::FleetSpec;
use crate::cli::Flags;
use crate::vllm_server::{check_engine, engine_from_flags};

/// Flags that describe the modelled fleet (the emulator's names), shared by
/// `kvroute-simulate` and `kvroute-what-if`.
pub const FLEET_FLAGS: &[(&str, bool)] = &[
    ("endpoints", true),
    ("model", true),
    ("block-size", true),
    ("num-gpu-blocks", true),
    ("max-num-batched-tokens", true),
    ("max-num-seqs", true),
    ("max-model-len", true),
    ("prefill-tps", true),
    ("prefill-attention-tokens", true),
    ("decode-step-ms", true),
    ("decode-ms-per-seq", true),
    ("decode-ns-per-context-token", true),
    ("chars-per-token", true),
    ("stream-interval", true),
];

/// Usage lines of [`FLEET_FLAGS`].
pub const FLEET_USAGE: &str = "\
Fleet (each modelled server is the emulator's model; the emulator's flag names):
  --endpoints N                  servers in the fleet [4]
  --model NAME                   served model name [tiny]
  --block-size N                 tokens per KV block [16]
  --num-gpu-blocks N             KV cache size in blocks [16384]
  --max-num-batched-tokens N     token budget per iteration, B [8192]
  --max-num-seqs N               sequences per batch [256]
  --max-model-len N              longest prompt + output, tokens [40960]
  --prefill-tps X                peak prefill tokens/s [20480]
  --prefill-attention-tokens X   attended context that doubles a prefill token's cost; 0 = off [32768]
  --decode-step-ms X             floor of one forward pass, ms [25]
  --decode-ms-per-seq X          extra per decoding sequence, ms [0.1]
  --decode-ns-per-context-token X  extra per attended context token, ns [40]
  --chars-per-token N            text bytes per token (text prompts) [4]
  --stream-interval N            output tokens per streamed chunk [1]
";

/// The fleet from [`FLEET_FLAGS`].
pub fn fleet_from_flags(f: &Flags, program: &str) -> Result<FleetSpec, String> {
    let d = FleetSpec::default();
    let fleet = FleetSpec {
        endpoints: f.get("endpoints", d.endpoints)?,
        model: f.get("model", d.model)?,
        chars_per_token: f.get("chars-per-token", d.chars_per_token)?,
        stream_interval: f.get("stream-interval", d.stream_interval)?,
        engine: engine_from_flags(f)?,
    };
    if fleet.endpoints == 0 {
        return Err(format!("{program}: --endpoints must be at least 1"));
    }
    check_engine(&fleet.engine, program)?;
    if fleet.chars_per_token == 0 {
        return Err(format!("{program}: --chars-per-token must be at least 1"));
    }
    let v = fleet.engine.step_cost.decode_step_ms;
    if !(v > 0.0 && v.is_finite()) {
        return Err(format!("{program}: --decode-step-ms must be positive"));
    }
    Ok(fleet)
}

//! What kvroute learns from what the servers report, one figure per
//! endpoint, updated on each `/metrics` poll: `prefill_rate` its prefill
//! throughput (from vLLM's prefill histograms), `bytes_per_token` its
//! bytes per token (from `vllm:prompt_tokens_total` against the bytes
//! routed to it) and `output_tokens` its mean output per request (from
//! `vllm:request_generation_tokens`), both of those with the `ratio`
//! learner. Their state lives in the metrics snapshot
//! (`kvroute_shared_state::metrics`), so a collector taking over the lease
//! continues them.
//!
//! Pure functions over that state; nothing here imports the engine.

pub mod bytes_per_token;
pub mod output_tokens;
pub mod prefill_rate;
pub mod ratio;

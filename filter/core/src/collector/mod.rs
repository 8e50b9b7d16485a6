//! Parsers for what the collector reads: vLLM's Prometheus `/metrics`, the
//! KV-event relay's answers (`kv_events`, with how they are applied) and
//! Envoy's admin `/clusters?format=json`. Pure functions; the singleton glue
//! fetches the bytes. `prefill_rate` turns successive polls into an
//! endpoint's prefill-throughput estimate, `bytes_per_token` its bytes per
//! token (from `vllm:prompt_tokens_total` against the bytes routed to it)
//! and `output_tokens` its mean output per request (from
//! `vllm:request_generation_tokens`), both with the `ratio` learner.

pub mod bytes_per_token;
pub mod envoy_clusters;
pub mod kv_events;
pub mod output_tokens;
pub mod prefill_rate;
pub mod ratio;
pub mod vllm_metrics;

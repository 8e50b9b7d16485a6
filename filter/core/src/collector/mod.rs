//! Parsers for what the collector reads: vLLM's Prometheus `/metrics`, the
//! KV-event relay's answers (`kv_events`, with how they are applied) and
//! Envoy's admin `/clusters?format=json`. Pure functions; the singleton glue
//! fetches the bytes. `prefill_rate` turns successive polls into an
//! endpoint's prefill-throughput estimate.

pub mod envoy_clusters;
pub mod kv_events;
pub mod prefill_rate;
pub mod vllm_metrics;

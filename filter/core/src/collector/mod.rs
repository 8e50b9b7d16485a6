//! Parsers for what the collector reads: vLLM's Prometheus `/metrics` and
//! Envoy's admin `/clusters?format=json`. Pure functions; the singleton glue
//! fetches the bytes. `prefill_rate` turns successive polls into an
//! endpoint's prefill-throughput estimate.

pub mod envoy_clusters;
pub mod prefill_rate;
pub mod vllm_metrics;

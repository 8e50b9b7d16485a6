//! Parsers for what the collector reads: vLLM's Prometheus `/metrics` and
//! Envoy's admin `/clusters?format=json`. Pure functions; the singleton glue
//! fetches the bytes.

pub mod envoy_clusters;
pub mod vllm_metrics;

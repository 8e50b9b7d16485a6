//! What the servers report, parsed: vLLM's Prometheus `/metrics`
//! (`vllm_metrics`) and `/v1/models` (`vllm_models`), Envoy's admin `/clusters?format=json`
//! (`envoy_clusters`), the KV-event relay's answers (`relay`) and its mesh
//! exchange's (`mesh`). Pure
//! functions from bytes to values; the collector fetches the bytes
//! (`lifecycle::Collector`) and the engine writes what they say
//! (`engine/collect.rs`).
//!
//! Nothing here reads or writes shared state, or imports the engine.

pub mod envoy_clusters;
pub mod mesh;
pub mod relay;
pub mod vllm_metrics;
pub mod vllm_models;

//! kvroute-sim: an emulated vLLM fleet and a load generator.
//!
//! - `engine`: the pure model of one vLLM server (timing, batching, prefix
//!   cache). No I/O.
//! - `kv_events` (re-exported from `kvroute-kv-events`, shared with the
//!   relay), `vllm_hash`, `prometheus`: vLLM's wire formats.
//! - `emulator`: HTTP/ZMQ glue that serves an engine on a loopback port.
//! - `loadgen`: workloads, arrival stages and per-stage reports.

pub mod cli;
pub mod emulator;
pub mod engine;
pub use kvroute_kv_events as kv_events;
pub mod loadgen;
pub mod prometheus;
pub mod rng;
pub mod simulator;
pub mod vllm_hash;
pub mod words;

//! kvroute-sim: a model of vLLM with two drivers (the emulated fleet and the
//! fleet simulator), the load generator and the what-if tool.
//!
//! - `vllm_model`: the pure model of one vLLM server (timing, batching, prefix
//!   cache), a state machine stepped with model time. No I/O, no clock. (Not
//!   the router's `kvroute_core::engine`.)
//! - `kv_events` (re-exported from `kvroute-kv-events`, shared with the
//!   relay), `vllm_hash` (re-exported from `kvroute-core`), `prometheus`: vLLM's wire formats.
//! - `emulator`: HTTP/ZMQ glue that serves a model on a loopback port.
//! - `loadgen`: workloads, arrival stages and per-stage reports.
//! - `calibrate`: offline measurement of `peakPrefillThroughput`
//!   (`kvroute-calibrate`).
//! - `simulator`: many models in virtual time behind kvroute-core's own
//!   routing engine; sweeps and the what-if analysis.

pub mod calibrate;
pub mod cli;
pub mod emulator;
pub mod vllm_model;
pub use kvroute_kv_events as kv_events;
pub mod loadgen;
pub mod prometheus;
pub mod simulator;
/// vLLM's sha256_cbor block hashes: the router's own implementation
/// (`kvroute_core::precise::vllm_hash`), so emulator and filter agree.
pub use kvroute_core::precise::vllm_hash;
pub mod words;

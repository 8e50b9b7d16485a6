//! kvroute-sim: the networked half of the simulation tools. The pure half
//! (`kvroute-sim-model`: the vLLM model, the workloads, the fleet simulator)
//! has no I/O; this crate serves it and drives it over the network, and
//! holds the binaries.
//!
//! - `emulator`: HTTP/ZMQ glue that serves the model on loopback ports, in
//!   scaled real time.
//! - `loadgen`: the load generator's HTTP client and run loop.
//! - `calibrate`: offline measurement of `peakPrefillThroughput`
//!   (`kvroute-calibrate`).
//! - `kv_events` (re-exported from `kvroute-kv-events`, shared with the
//!   relay), `vllm_hash` (re-exported from `kvroute-core`): vLLM's wire
//!   formats.
//! - `src/bin/`: `kvroute-emulator`, `kvroute-loadgen`, `kvroute-calibrate`,
//!   and the pure crate's drivers `kvroute-simulate` and `kvroute-what-if`.

pub mod calibrate;
pub mod emulator;
pub mod loadgen;
/// vLLM's sha256_cbor block hashes: the router's own implementation
/// (`kvroute_core::precise::vllm_hash`), so emulator and filter agree.
pub use kvroute_core::precise::vllm_hash;
pub use kvroute_kv_events as kv_events;

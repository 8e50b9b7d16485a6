//! kvroute-sim-model: the pure half of kvroute-sim. Everything here is
//! deterministic given a seed and steps with model time; nothing opens a
//! socket or needs an async runtime, and the only clock read is the Unix
//! time stamped into response bodies. The networked half
//! (`kvroute-sim`: the emulator's HTTP/ZMQ glue, the load generator's
//! client, the binaries) drives these types in scaled real time.
//!
//! - `vllm_model`: the model of one vLLM server (timing, batching, prefix
//!   cache), a state machine stepped with model time. (Not the router's
//!   `kvroute_core::engine`.)
//! - `vllm_server`: what that server answers, without I/O: its settings
//!   (`EmulatorConfig`), OpenAI request → engine input, the tokenizer, the
//!   `/metrics` page.
//! - `workload`: the load generator's workloads, arrival stages, segment
//!   prompts, the hit-ratio ceiling and the per-stage reports.
//! - `simulator`: many models in virtual time behind kvroute-core's own
//!   routing engine; the benchmark arms (`sim/bench/arms.json`, which
//!   `quality.py` reads too), sweeps and the what-if analysis.
//! - `calibrate`: the arithmetic and report of offline calibration (the
//!   measurement, over HTTP, is `kvroute_sim::calibrate`).
//! - `prometheus` (text format), `kv_events` (re-exported from
//!   `kvroute-kv-events`), `vllm_hash` (re-exported from `kvroute-core`):
//!   vLLM's wire formats. `cli`: the binaries' flag parser. `words`: the
//!   word list text is made of (`data/words.txt`).

pub mod calibrate;
pub mod cli;
pub mod prometheus;
pub mod simulator;
pub mod vllm_model;
pub mod vllm_server;
pub mod words;
pub mod workload;
/// vLLM's sha256_cbor block hashes: the router's own implementation
/// (`kvroute_core::precise::vllm_hash`), so emulator and filter agree.
pub use kvroute_core::precise::vllm_hash;
pub use kvroute_kv_events as kv_events;

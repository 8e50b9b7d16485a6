//! kvroute's routing core.
//!
//! Host-independent: no proxy-wasm, no I/O, no clocks, no global randomness
//! (the host, clock included, comes in through `lifecycle::Host`).
//! The wasm filter, the emulator and the simulator all call this code; none
//! of them re-implements it. See `ARCHITECTURE.md` at the repository root.

pub mod blocks;
pub mod config;
pub mod engine;
pub mod flow;
pub mod learners;
pub mod lifecycle;
pub mod precise;
pub mod reports;
pub mod request;
pub mod scheduling;

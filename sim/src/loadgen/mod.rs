//! The load generator: workloads of real-word prompts, Poisson and
//! fixed-concurrency stages, and per-stage reports that read the endpoints'
//! own prefix-cache counters before and after each stage.

pub mod ceiling;
pub mod client;
pub mod reject;
pub mod report;
pub mod run;
pub mod stages;
pub mod workload;

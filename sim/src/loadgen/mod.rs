//! The load generator's client: sends a workload's requests (see
//! `kvroute_sim_model::workload` for the workloads, stages and reports) to
//! real endpoints over HTTP, reading their own prefix-cache counters before
//! and after each stage.

pub mod client;
pub mod run;

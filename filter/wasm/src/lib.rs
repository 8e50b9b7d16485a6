//! The kvroute proxy-wasm module: thin glue between Envoy and
//! `kvroute_core::engine::Engine`.
//!
//! One `.wasm`, two roles chosen by the plugin's `root_id`, both under the
//! same `vm_id` so they share Envoy's shared data:
//! - `kvroute` — the HTTP filter ([`http`]), one VM per worker thread;
//! - `kvroute-collector` — the singleton service ([`collector`]) on the main
//!   thread: endpoint discovery, `/metrics` polling, reaping.
//!
//! Glue never panics: host calls go through [`host`], which turns every
//! status into a `Result`, and errors are logged and counted.

#![deny(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[cfg(target_arch = "wasm32")]
mod abi;
#[cfg(target_arch = "wasm32")]
mod collector;
pub mod host;
#[cfg(target_arch = "wasm32")]
mod http;
#[cfg(target_arch = "wasm32")]
mod root;
#[cfg(target_arch = "wasm32")]
mod stats;

/// `root_id` of the singleton collector. Any other root id is the filter.
pub const COLLECTOR_ROOT_ID: &str = "kvroute-collector";

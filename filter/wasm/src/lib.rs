//! The kvroute proxy-wasm module: thin glue between the proxy-wasm Rust SDK
//! and `kvroute_core::lifecycle`.
//!
//! One `.wasm`, two roles chosen by the plugin's `root_id`, both under the
//! same `vm_id` so they share Envoy's shared data:
//! - `kvroute` — the HTTP filter, one VM per worker thread: each request is
//!   a [`kvroute_core::lifecycle::Stream`];
//! - `kvroute-collector` — the singleton service on the main thread
//!   ([`kvroute_core::lifecycle::Collector`]): endpoint discovery,
//!   `/metrics` polling, reaping.
//!
//! Every callback hands off to the core at once; [`host`] implements the
//! core's `Host` trait with the SDK's host calls, each status a `Result`.

#![deny(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[cfg(target_arch = "wasm32")]
mod contexts;
#[cfg(target_arch = "wasm32")]
mod host;

pub use kvroute_core::lifecycle::COLLECTOR_ROOT_ID;

//! Issue 5's tests 1–7, against the real kvroute module
//! (`target/wasm32-wasip1/release/kvroute_wasm.wasm`, or `$KVROUTE_WASM`).

mod support;

mod bounds;
mod collector;
mod concurrency;
mod config;
mod flow;
mod lease;
mod lifecycle;
mod malformed;
mod no_tokenizer;
#[cfg(feature = "perfmap")]
mod profile_loop;
mod sessions;
mod stats;

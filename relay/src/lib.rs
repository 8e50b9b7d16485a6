//! kvroute-relay: subscribes to one vLLM server's KV events over ZMQ and
//! serves them over HTTP to kvroute's collector (a wasm VM cannot open a ZMQ
//! socket). It makes no routing decisions and is not on the request path.
//!
//! - `state`: sequence tracking, the ring, the snapshot, counters, the JSON
//!   answers. Synchronous and unit-tested.
//! - `subscriber`: the SUB socket and the replay DEALER around it.
//! - `http`: the hyper server around it.
//!
//! The sockets need the `server` feature (on by default); `state` alone
//! builds without it (the fuzz targets use it so).

#[cfg(feature = "server")]
pub mod http;
pub mod state;
#[cfg(feature = "server")]
pub mod subscriber;

use std::sync::{Arc, Mutex};

/// The state shared by the ZMQ task and the HTTP connections.
pub type Shared = Arc<Mutex<state::Relay>>;

/// Unix time, seconds.
pub fn unix_now_s() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// A new relay's epoch: its start time, unix ms.
pub fn new_epoch() -> u64 {
    (unix_now_s() * 1000.0) as u64
}

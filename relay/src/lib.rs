//! kvroute-relay: subscribes to one vLLM server's KV events over ZMQ and
//! serves them over HTTP to kvroute's collector (a wasm VM cannot open a ZMQ
//! socket). It makes no routing decisions and is not on the request path.
//!
//! - `state`: sequence tracking, the ring, the snapshot, counters, the JSON
//!   answers. Synchronous and unit-tested.
//! - `mesh`: the mesh exchange between proxies (`POST /mesh/exchange`,
//!   issue 43): their accepted decisions and in-flight load on this server.
//!   Synchronous and unit-tested.
//! - `subscriber`: the SUB socket and the replay DEALER around it.
//! - `http`: the hyper server around it.
//!
//! The sockets need the `server` feature (on by default); `state` alone
//! and `mesh` build without it (the fuzz targets use them so).

#[cfg(feature = "server")]
pub mod http;
pub mod mesh;
pub mod state;
#[cfg(feature = "server")]
pub mod subscriber;

use std::sync::{Arc, Mutex};

/// The state shared by the ZMQ task and the HTTP connections.
pub type Shared = Arc<Mutex<state::Relay>>;

/// The mesh exchange's state, shared by the HTTP connections.
pub type SharedMesh = Arc<Mutex<mesh::MeshState>>;

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

/// A new relay's mesh epoch: random and nonzero, from the clock (ns) and
/// the process id, mixed (SplitMix64's finalizer), so that a restarted relay
/// has another.
pub fn new_mesh_epoch() -> u64 {
    let ns = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    let mut z = ns ^ (u64::from(std::process::id()) << 32) ^ 0x9E37_79B9_7F4A_7C15;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^= z >> 31;
    z.max(1)
}

//! kvroute-harness: a wasmtime host for proxy-wasm ABI 0.2.1 that behaves
//! like Envoy where kvroute depends on it, and lets a test choose every
//! interleaving. See README.md for what it implements and what it does not.
//!
//! Layout:
//! - [`abi`]: numbers and the header-pair encoding;
//! - [`shared_data`]: Envoy's shared data (CAS) and shared queues;
//! - [`world`]: what all VMs of one process share (clock, stats, logs, calls);
//! - [`vm_state`]: one VM's host-side state and its HTTP streams;
//! - [`env_imports`], [`wasi`]: the imports the module links against;
//! - [`http_call`]: scripted `dispatch_http_call` answers;
//! - [`cluster`]: the scenario API tests use;
//! - [`artifacts`]: finding and building the `.wasm` files.

pub mod abi;
pub mod artifacts;
pub mod cluster;
pub mod env_imports;
pub mod http_call;
pub mod shared_data;
pub mod vm_state;
pub mod wasi;
pub mod world;

pub use cluster::{Cluster, EndOrder, Req, VmSpec, VmStarted};
pub use http_call::{HttpCallReply, HttpCallRequest};

//! What kvroute keeps in Envoy shared data, and how it is read and changed.
//!
//! Envoy shared data is a process-wide map (per `vm_id`) of byte strings with
//! a CAS token each. It has no delete and no key listing, and every get
//! copies the value into the VM. So everything here lives under a small,
//! fixed set of keys, every value has a fixed maximum size, and every
//! read-modify-write is a CAS loop with bounded retries:
//!
//! | key | written by | what |
//! |---|---|---|
//! | `kvroute/endpoints` | collector | [`endpoints::EndpointTable`]: address, slot, generation, health |
//! | `kvroute/load` | workers (and the collector: reaper, state epoch) | [`load::LoadTable`]: per-slot in-flight tokens/requests in time buckets, insert counter, the other proxies' load (mesh); the state epoch |
//! | `kvroute/metrics` | collector | [`metrics::MetricsTable`]: last polled vLLM metrics per slot, with age, and the online prefill-rate estimate |
//! | `kvroute/models` | collector | [`models::ModelsTable`]: the models and LoRA adapters each slot serves (its `/metrics` and `/v1/models`), at most 16 names of 128 bytes per slot, and each listed adapter's path (at most 512 bytes, 1024 per slot) |
//! | `kvroute/ix/<n>` | workers | [`index::PrefixIndex`] shards: fixed-size tables of block entries |
//! | `kvroute/held`, `kvroute/held/<slot>/<n>` | collector (`kvEvents`) | [`held`]: the vLLM block hashes each endpoint holds, from its KV events, with relay epoch/seq and freshness |
//! | `kvroute/mesh/outbox` | workers (append), collector (take) | [`mesh::Outbox`]: accepted decisions the other proxies of a mesh have not been told of, bounded |
//! | `kvroute/mesh/id` | collector (once) | [`mesh::proxy_id`]: this Envoy process's id on the relays |
//! | `kvroute/collector/tick` | collector | [`collector_tick`]: when it last ticked, ms (workers publish the age) |
//! | `kvroute/hashed/k/<n>`, `kvroute/hashed/v/<n>` | collector (`tokenizeIn: collector`) | [`hashed`]: prompt prefixes with their vLLM hashes, in `sharedState.hashedPrefixSlots` slots, within `sharedState.hashedPrefixBytes` ([`hashed::Budget`]) |
//! | `kvroute/tok/<fingerprint>` | collector | [`hashed::TokenizerMeta`]: a loaded tokenizer's added tokens, for the workers' cuts |
//! | `kvroute/tokenize/pending` | workers (reserve), collector (release) | [`hashed::reserve`]: bytes of jobs waiting in the tokenize queue |
//!
//! The crate knows nothing of proxy-wasm: the [`Store`] trait is implemented
//! over the host in `kvroute-wasm`, in the wasmtime harness, and in memory
//! ([`memory::MemoryStore`]) for native tests and the simulator.

pub mod cas;
pub mod codec;
pub mod collector_tick;
pub mod endpoints;
pub mod hashed;
pub mod held;
pub mod index;
pub mod load;
pub mod memory;
pub mod mesh;
pub mod metrics;
pub mod models;
pub mod sessions;

use std::fmt;

/// The key of the endpoint table.
pub const ENDPOINTS_KEY: &str = "kvroute/endpoints";
/// The key of the load table.
pub const LOAD_KEY: &str = "kvroute/load";
/// The key of the metrics table.
pub const METRICS_KEY: &str = "kvroute/metrics";

/// Most endpoints kvroute tracks (slots are `u16`, tables stay small).
pub const MAX_ENDPOINTS: usize = 1024;

/// Errors from a [`Store`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StoreError {
    /// The value changed since it was read (the CAS token did not match).
    CasMismatch,
    /// The host refused the call; the message says how.
    Host(String),
}

impl fmt::Display for StoreError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            StoreError::CasMismatch => write!(f, "shared data changed concurrently (CAS mismatch)"),
            StoreError::Host(m) => write!(f, "shared data host error: {m}"),
        }
    }
}

impl std::error::Error for StoreError {}

/// Envoy's shared-data semantics: get returns the bytes and a CAS token;
/// set succeeds when `cas` is 0 or equals the current token, and gives the
/// value a new token. There is no delete.
pub trait Store {
    /// The value and its CAS token, or `None` if the key was never set.
    fn get(&self, key: &str) -> Result<Option<(Vec<u8>, u32)>, StoreError>;
    /// Sets `key` if `cas` is 0 or matches the current token.
    fn set(&self, key: &str, value: &[u8], cas: u32) -> Result<(), StoreError>;
}

impl<S: Store + ?Sized> Store for &S {
    fn get(&self, key: &str) -> Result<Option<(Vec<u8>, u32)>, StoreError> {
        (**self).get(key)
    }
    fn set(&self, key: &str, value: &[u8], cas: u32) -> Result<(), StoreError> {
        (**self).set(key, value, cas)
    }
}

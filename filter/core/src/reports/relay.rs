//! The KV-event relay's answers (`relay/README.md` has its HTTP API): which
//! call to make to an endpoint's relay, and its two answers parsed.
//!
//! Per endpoint, the collector asks for one of two things:
//!
//! - `/kv/snapshot` when it has no position on the relay (first poll, a new
//!   slot generation, after a resync);
//! - `/kv/events?after=SEQ&epoch=E&limit=N` otherwise.
//!
//! How an answer changes the endpoint's held set is
//! `Engine::apply_relay_answer`'s (`engine/collect.rs`).

use kvroute_shared_state::held::EndpointHeld;
use serde::Deserialize;

/// `GET /kv/events` answer.
#[derive(Debug, Deserialize)]
pub struct EventsAnswer {
    pub epoch: u64,
    pub seq: u64,
    /// The relay's newest seq (absent: treat `seq` as the newest).
    #[serde(default)]
    pub last: Option<u64>,
    /// The relay snapshot's completeness now (absent: unknown, keep ours).
    #[serde(default)]
    pub complete: Option<bool>,
    #[serde(default)]
    pub resync: bool,
    #[serde(default)]
    pub more: bool,
    #[serde(default)]
    pub batches: Vec<Batch>,
}

/// One batch of an answer (its `seq` is not needed: the answer's `seq` is
/// the cursor).
#[derive(Debug, Deserialize)]
pub struct Batch {
    pub ops: Vec<Op>,
}

/// One operation on the server's held set.
#[derive(Debug, Deserialize)]
#[serde(tag = "op", rename_all = "lowercase")]
pub enum Op {
    Stored { hashes: Vec<u64> },
    Removed { hashes: Vec<u64> },
    Cleared,
}

/// `GET /kv/snapshot` answer.
#[derive(Debug, Deserialize)]
pub struct SnapshotAnswer {
    pub epoch: u64,
    pub seq: u64,
    pub complete: bool,
    pub blocks: Vec<u64>,
}

/// Parses a `/kv/events` answer; the error is serde's message.
pub fn parse_events(body: &[u8]) -> Result<EventsAnswer, String> {
    serde_json::from_slice(body).map_err(|e| e.to_string())
}

/// Parses a `/kv/snapshot` answer; the error is serde's message.
pub fn parse_snapshot(body: &[u8]) -> Result<SnapshotAnswer, String> {
    serde_json::from_slice(body).map_err(|e| e.to_string())
}

/// Which call to make to an endpoint's relay.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ask {
    Snapshot,
    Events,
}

/// What to ask the relay, given the endpoint's view (`None`: no view yet).
pub fn next_ask(view: Option<&EndpointHeld>) -> Ask {
    match view {
        Some(v) if v.relay_epoch != 0 => Ask::Events,
        _ => Ask::Snapshot,
    }
}

/// The request path of `ask`.
pub fn ask_path(ask: Ask, view: Option<&EndpointHeld>, limit: u32) -> String {
    match (ask, view) {
        (Ask::Events, Some(v)) => format!(
            "/kv/events?after={}&epoch={}&limit={limit}",
            v.relay_seq, v.relay_epoch
        ),
        _ => "/kv/snapshot".to_string(),
    }
}

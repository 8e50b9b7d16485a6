//! Session affinity's reads and writes (`session-affinity-scorer` /
//! `-filter`, `scheduling/session.rs`): which endpoint a request's session
//! points at, marked on its candidate before scheduling
//! ([`Engine::mark_session`]), and, for `strategy: session_id`, the
//! binding a server's acceptance writes ([`Engine::settle_session`],
//! `kvroute/sessions/*`, shared by every worker VM).
//!
//! Only accepted work moves a binding: the stream calls
//! [`Engine::settle_session`] on a 2xx response, never on a rejection or a
//! reset. A binding is bound or refreshed to the endpoint that served; it
//! moves to another only when the decision found its endpoint absent
//! (filtered out, released by the saturation gate, no longer a healthy
//! endpoint) or Envoy retried the request elsewhere (the bound endpoint
//! could not be reached). Outvoted, it stays.
//!
//! Across proxies, the mesh exchange (`engine/mesh.rs`) carries each
//! settled binding (the session id's hash, never the id, and whether it
//! moved) with the accepted decision; the other proxies settle theirs the
//! same way, so a session bound or moved through one gateway is bound or
//! moved on every gateway of the mesh after the next exchange.

use super::{Engine, Snapshot};
use crate::scheduling::session::{self, Strategy};
use kvroute_shared_state::sessions::{self, Lookup, SessionGeometry, SettleOutcome};
use kvroute_shared_state::{Store, StoreError};

/// What a request's headers say about its session.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SessionRef {
    /// `encoded_endpoint_header`: the endpoint ID (`ip:port`) its token names.
    Endpoint(String),
    /// `session_id`: the session id's hash.
    Id(u64),
}

/// How the session's lookup went, for counters.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum SessionLookup {
    /// No session, or no session plugin.
    #[default]
    None,
    /// The session names a healthy endpoint.
    Hit,
    /// It names none (unbound, an unknown or unhealthy endpoint).
    Miss,
    /// Its binding had been idle past the TTL.
    Expired,
}

/// The hash a session id is stored under (seeded apart from the block hashes).
fn session_hash(id: &[u8]) -> u64 {
    xxhash_rust::xxh64::xxh64(id, 0x5e55_1011)
}

impl Engine {
    /// The request's session, from its headers (`header(name)` gives a
    /// request header's value by lower-case name), for the profile's
    /// session plugin; `None` without one, or when the headers name no
    /// usable session (absent, empty, oversized, a token that does not
    /// decode).
    pub fn session_ref<'a>(&self, header: impl Fn(&str) -> Option<&'a [u8]>) -> Option<SessionRef> {
        match &self.config.scheduler.session.as_ref()?.strategy {
            Strategy::EncodedEndpointHeader { header: name } => {
                session::decode_token(header(name)?).map(SessionRef::Endpoint)
            }
            Strategy::SessionId { sources, .. } => sources
                .iter()
                .flat_map(|s| s.headers())
                .filter_map(&header)
                .map(<[u8]>::trim_ascii)
                .find(|v| !v.is_empty())
                .filter(|v| v.len() <= session::MAX_SESSION_VALUE_BYTES)
                .map(|v| SessionRef::Id(session_hash(v))),
        }
    }

    /// Marks the candidate the request's session points at
    /// ([`Candidate::session`](crate::scheduling::Candidate::session)):
    /// the endpoint its token names, or its binding's. A failed read is no
    /// preference (advisory, as the index is).
    pub(super) fn mark_session(
        &self,
        store: &dyn Store,
        session: Option<&SessionRef>,
        snap: &mut Snapshot,
        now_ms: u64,
    ) -> SessionLookup {
        let (Some(s), Some(cfg)) = (session, self.config.scheduler.session.as_ref()) else {
            return SessionLookup::None;
        };
        let (found, expired) = match (s, &cfg.strategy) {
            (SessionRef::Endpoint(id), _) => {
                (snap.endpoints.iter().position(|e| e.address == *id), false)
            }
            (
                SessionRef::Id(h),
                Strategy::SessionId {
                    ttl_ms,
                    max_sessions,
                    ..
                },
            ) => {
                let geo = SessionGeometry::for_capacity(*max_sessions);
                match sessions::lookup(store, &geo, *h, now_ms, *ttl_ms) {
                    Ok(Lookup::Bound(key)) => {
                        (snap.candidates.iter().position(|c| c.key == key), false)
                    }
                    Ok(Lookup::Expired) => (None, true),
                    Ok(Lookup::Unbound) | Err(_) => (None, false),
                }
            }
            (SessionRef::Id(_), Strategy::EncodedEndpointHeader { .. }) => (None, false),
        };
        match found {
            Some(i) => {
                snap.candidates[i].session = true;
                SessionLookup::Hit
            }
            None if expired => SessionLookup::Expired,
            None => SessionLookup::Miss,
        }
    }

    /// Records accepted work of session `id` served by `served` (`ip:port`);
    /// `may_move`: a binding to another endpoint moves here (this proxy's
    /// decision found the session's endpoint absent
    /// ([`Presence::may_move`](crate::scheduling::session::Presence::may_move)) or Envoy served it elsewhere than the
    /// decision's primary; or another proxy's decision moved it). `None`
    /// when the strategy keeps no binding.
    pub fn settle_session(
        &self,
        store: &dyn Store,
        id: u64,
        served: &str,
        may_move: bool,
        now_ms: u64,
    ) -> Result<Option<SettleOutcome>, StoreError> {
        let Some(Strategy::SessionId {
            ttl_ms,
            max_sessions,
            ..
        }) = self.config.scheduler.session.as_ref().map(|s| &s.strategy)
        else {
            return Ok(None);
        };
        let geo = SessionGeometry::for_capacity(*max_sessions);
        let key = super::snapshot::endpoint_key(served);
        sessions::settle(store, &geo, id, key, now_ms, *ttl_ms, may_move).map(Some)
    }
}

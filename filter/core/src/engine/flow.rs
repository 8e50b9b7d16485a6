//! What flow control's saturation detector reads: each healthy endpoint's
//! in-flight load and fresh metrics, without a request.

use super::snapshot::load_candidate;
use super::Engine;
use crate::flow::PoolEndpoint;
use kvroute_shared_state::load::LoadTable;
use kvroute_shared_state::{Store, StoreError, LOAD_KEY};

impl Engine {
    /// The healthy endpoints as the detector sees them: this proxy's
    /// in-flight counts (with the mesh peers' while recent) and the
    /// metrics polled within `stale_ms`.
    pub fn pool_endpoints(
        &self,
        store: &dyn Store,
        now_ms: u64,
        stale_ms: u64,
    ) -> Result<Vec<PoolEndpoint>, StoreError> {
        let load_read = store.get(LOAD_KEY)?;
        let load = LoadTable::decode(load_read.as_ref().map(|(b, _)| b.as_slice()));
        drop(load_read);
        let (endpoints, metrics) = self.tables(store, load.epoch)?;
        let peer_ttl = if self.config.mesh.enabled {
            self.peer_ttl_ms()
        } else {
            0
        };
        Ok(endpoints
            .iter()
            .map(|e| {
                let rec = load.get(e.slot, e.generation);
                let peer = rec
                    .map(|r| r.peer)
                    .filter(|p| peer_ttl > 0 && p.is_fresh(now_ms, peer_ttl))
                    .unwrap_or_default();
                let m = metrics
                    .get(e.slot, e.generation)
                    .filter(|m| m.is_fresh(now_ms, stale_ms));
                let c = load_candidate(rec, peer, m);
                PoolEndpoint {
                    inflight_requests: c.inflight_requests,
                    inflight_tokens: c.inflight_tokens,
                    inflight_prefill_tokens: c.inflight_prefill_tokens,
                    inflight_held_tokens: c.inflight_held_tokens,
                    prefill_tokens_per_s: c.prefill_tokens_per_s,
                    metrics: c.metrics,
                }
            })
            .collect())
    }
}

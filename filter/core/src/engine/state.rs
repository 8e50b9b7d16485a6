//! The state view: the shared state as JSON, for `routing.statePath`
//! ([`Engine::state_json`]): each endpoint's load, metrics, learnt figures
//! and, with `kvEvents`, its held set.

use super::Engine;
use crate::learners::{bytes_per_token, output_tokens};
use crate::scheduling::Candidate;
use kvroute_shared_state::endpoints::EndpointEntry;
use kvroute_shared_state::held::{self, HeldTable};
use kvroute_shared_state::load::LoadTable;
use kvroute_shared_state::metrics::MetricsTable;
use kvroute_shared_state::{Store, StoreError, LOAD_KEY, METRICS_KEY};

impl Engine {
    /// The shared state as JSON, for `routing.statePath`.
    pub fn state_json(&self, store: &dyn Store, now_ms: u64) -> Result<String, StoreError> {
        let table = self.endpoint_table(store)?;
        let load = LoadTable::decode(store.get(LOAD_KEY)?.as_ref().map(|(b, _)| b.as_slice()));
        let metrics =
            MetricsTable::decode(store.get(METRICS_KEY)?.as_ref().map(|(b, _)| b.as_slice()));
        let stale_after = self.config.collector.metrics_stale_after_ms;
        let held = self.held_state(store)?;
        let models = self.models_table(store)?;
        let eps: Vec<serde_json::Value> = table
            .endpoints
            .iter()
            .map(|e| {
                let rec = load.get(e.slot, e.generation);
                let m = metrics.get(e.slot, e.generation);
                // What the affinity filter's TTFT estimate divides by now.
                let gate_rate = self.config.scheduler.filters.first().map(|f| {
                    f.prefill_tokens_per_s(&Candidate {
                        prefill_tokens_per_s: m
                            .filter(|m| m.is_fresh(now_ms, stale_after))
                            .and_then(|m| m.prefill.estimate()),
                        ..Default::default()
                    })
                });
                let kv_events = held
                    .as_ref()
                    .map(|h| h.endpoint_json(self, store, e, now_ms));
                serde_json::json!({
                    "address": e.address,
                    "slot": e.slot,
                    "generation": e.generation,
                    "healthy": e.healthy,
                    "inflightRequests": rec.map_or(0, |r| r.inflight_requests()),
                    "inflightTokens": rec.map_or(0, |r| r.inflight_tokens()),
                    "insertCounter": rec.map_or(0, |r| r.insert_counter),
                    "reapedRequests": rec.map_or(0, |r| r.reaped_requests),
                    "capacityBlocks": self.capacity_blocks(m),
                    "gatePrefillTokensPerS": gate_rate,
                    "routedPromptBytes": rec.map_or(0, |r| r.routed_prompt_bytes),
                    "bytesPerToken": m.and_then(|m| bytes_per_token::estimate(&m.bytes_per_token)),
                    "outputTokensPerRequest": m.and_then(|m| output_tokens::estimate(&m.output_tokens)),
                    "metrics": m.filter(|m| m.ok_at_ms != 0).map(|m| serde_json::json!({
                        "waiting": m.waiting,
                        "running": m.running,
                        "kvCacheUsage": m.kv_cache_usage,
                        "blockSize": m.block_size,
                        "numGpuBlocks": m.num_gpu_blocks,
                        "prefixCacheQueries": m.prefix_queries,
                        "prefixCacheHits": m.prefix_hits,
                        "prefillTokensPerS": m.prefill.estimate(),
                        "prefillSamples": m.prefill.samples,
                        "prefillUpdatedAgeMs": (m.prefill.updated_at_ms != 0)
                            .then(|| now_ms.saturating_sub(m.prefill.updated_at_ms)),
                        "ageMs": now_ms.saturating_sub(m.ok_at_ms),
                        "fresh": m.is_fresh(now_ms, stale_after),
                        "failures": m.failures,
                    })),
                    "kvEvents": kv_events,
                    "models": models.get(e.slot, e.generation).filter(|m| m.known).map(super::models::state_json),
                })
            })
            .collect();
        let index_bytes = self.geometry.max_bytes();
        let held_geo = self.held_geometry();
        Ok(serde_json::json!({
            "endpointTableVersion": table.version,
            "endpoints": eps,
            "index": {"shards": self.geometry.shards, "maxBytes": index_bytes},
            "kvEvents": self.config.kv_events.enabled.then(|| serde_json::json!({
                "maxHeldBlocks": held_geo.max_blocks,
                "shardsPerEndpoint": held_geo.shards,
                "maxBytesPerEndpoint": held_geo.max_bytes_per_endpoint(),
            })),
        })
        .to_string())
    }
}

/// Hashes listed per endpoint in the state view; a larger set is counted
/// but not listed (`hashesListed: false`).
pub const STATE_HASHES_MAX: u32 = 4096;

/// The held table as the state view reads it (`kvEvents.enabled` only).
struct HeldState {
    table: HeldTable,
}

impl HeldState {
    /// One endpoint's `kvEvents` object in the state JSON.
    fn endpoint_json(
        &self,
        engine: &Engine,
        store: &dyn Store,
        e: &EndpointEntry,
        now_ms: u64,
    ) -> serde_json::Value {
        let kv = &engine.config.kv_events;
        let relay = kv.relay_for(&e.address);
        let Some(v) = self.table.get(e.slot, e.generation) else {
            return serde_json::json!({"relay": relay, "fresh": false, "blocks": 0});
        };
        let listed = v.blocks <= STATE_HASHES_MAX;
        let hashes = if listed {
            let geo = engine.held_geometry();
            match held::all_hashes(store, &geo, &self.table, e.slot, e.generation) {
                Ok(mut h) => {
                    h.sort_unstable();
                    Some(h)
                }
                Err(_) => None,
            }
        } else {
            None
        };
        serde_json::json!({
            "relay": relay,
            "relayEpoch": v.relay_epoch,
            "relaySeq": v.relay_seq,
            "blocks": v.blocks,
            "complete": v.complete,
            "fresh": v.is_fresh(now_ms, kv.stale_ms),
            "ageMs": (v.ok_at_ms != 0).then(|| now_ms.saturating_sub(v.ok_at_ms)),
            "failures": v.failures,
            "droppedBlocks": v.dropped,
            "hashesListed": hashes.is_some(),
            "hashes": hashes,
        })
    }
}

impl Engine {
    /// The held table for the state view, when `kvEvents.enabled`.
    fn held_state(&self, store: &dyn Store) -> Result<Option<HeldState>, StoreError> {
        if !self.config.kv_events.enabled {
            return Ok(None);
        }
        Ok(Some(HeldState {
            table: HeldTable::read(store)?,
        }))
    }
}

//! The collector's side of the mesh exchange (`mesh.exchange`): every
//! `kvEvents.pollMs`, one `POST /mesh/exchange` to each endpoint's relay
//! with this proxy's accepted decisions there and its own in-flight load,
//! and the answer (the other proxies' decisions and load) applied
//! (`Engine::apply_mesh_answer`). The wire format is `reports::mesh`'s.
//!
//! What it keeps in the VM: this proxy's cursor on each relay's log, and
//! the decisions taken from the outbox that could not be sent yet (a call
//! still in flight), bounded per endpoint like one post. The proxy's id
//! lives in shared data (`kvroute_shared_state::mesh::proxy_id`), so in
//! `lease` mode every collector of one Envoy process posts as one proxy.

use super::{Counter, Counts, Host, Level};
use crate::engine::{Engine, OwnLoad};
use crate::reports::mesh::{ExchangeRequest, WireDecision, WireLoad, ANSWER_LIMIT};
use kvroute_shared_state::mesh as shared_mesh;
use std::collections::{HashMap, VecDeque};

/// Most decisions, and hashes, one endpoint's post carries (the relay's
/// own bounds per request: `relay/README.md`).
const MAX_POST_DECISIONS: usize = 1024;
const MAX_POST_HASHES: usize = 65_536;

/// Seed mixed into the clock for a new proxy id.
const ID_SALT: u64 = 0x6d65_7368_2d69_6421;

pub struct MeshLink {
    /// This proxy's id on the relays (hex).
    proxy: String,
    /// Per endpoint: the relay's epoch and the last seq read.
    cursors: HashMap<(u16, u16), (u64, u64)>,
    /// Per endpoint: decisions taken from the outbox, not yet posted.
    unsent: HashMap<(u16, u16), VecDeque<WireDecision>>,
    /// The outbox's drop count when last read.
    outbox_dropped: u64,
}

/// What one endpoint's post needs besides the body.
pub struct Post {
    pub body: Vec<u8>,
    pub decisions: u64,
}

impl MeshLink {
    /// This process's proxy id (created in shared data by the first
    /// collector that asks).
    pub fn start(host: &dyn Host) -> Result<MeshLink, String> {
        let ns = host
            .now_ns()
            .map_err(|e| format!("no clock for the proxy id: {e}"))?;
        let id = shared_mesh::proxy_id(host.store(), ns ^ ID_SALT)
            .map_err(|e| format!("cannot read or create the mesh proxy id: {e}"))?;
        Ok(MeshLink {
            proxy: format!("{id:016x}"),
            cursors: HashMap::new(),
            unsent: HashMap::new(),
            outbox_dropped: 0,
        })
    }

    pub fn proxy(&self) -> &str {
        &self.proxy
    }

    /// Moves the outbox into the per-endpoint queues, and returns this
    /// proxy's own in-flight load per endpoint.
    pub fn take_outbox(
        &mut self,
        host: &dyn Host,
        engine: &Engine,
        counts: &Counts,
    ) -> Result<HashMap<(u16, u16), OwnLoad>, String> {
        let out = engine
            .mesh_outgoing(host.store())
            .map_err(|e| format!("taking the mesh outbox: {e}"))?;
        let dropped = out.dropped.saturating_sub(self.outbox_dropped);
        self.outbox_dropped = out.dropped;
        counts.add(host, Counter::MeshDecisionsDropped, dropped);
        for d in out.decisions {
            let q = self.unsent.entry((d.slot, d.generation)).or_default();
            q.push_back(WireDecision {
                new_blocks: d.new_blocks,
                prompt_bytes: d.prompt_bytes,
                hashes: d.hashes,
                session: d.session.map(|s| s.hash),
                session_moved: d.session.is_some_and(|s| s.moved),
            });
            let mut over = 0;
            while q.len() > MAX_POST_DECISIONS
                || q.iter().map(|d| d.hashes.len()).sum::<usize>() > MAX_POST_HASHES
            {
                q.pop_front();
                over += 1;
            }
            counts.add(host, Counter::MeshDecisionsDropped, over);
        }
        Ok(out
            .load
            .into_iter()
            .map(|l| ((l.slot, l.generation), l))
            .collect())
    }

    /// The post for one endpoint; its queued decisions go with it.
    pub fn post_for(
        &mut self,
        slot: u16,
        generation: u16,
        own: Option<OwnLoad>,
        ttl_ms: u64,
    ) -> Post {
        let decisions: Vec<WireDecision> = self
            .unsent
            .remove(&(slot, generation))
            .map(Vec::from)
            .unwrap_or_default();
        let cursor = self.cursors.get(&(slot, generation)).copied();
        let own = own.unwrap_or_default();
        let req = ExchangeRequest {
            proxy: &self.proxy,
            epoch: cursor.map(|c| c.0),
            after: cursor.map(|c| c.1),
            limit: ANSWER_LIMIT,
            load: WireLoad {
                prompt: own.prompt_tokens,
                output: own.output_tokens,
                requests: own.requests,
                proxies: 0,
            },
            ttl_ms,
            decisions: &decisions,
        };
        // Serialising plain numbers and strings cannot fail.
        let body = serde_json::to_vec(&req).unwrap_or_default();
        Post {
            body,
            decisions: decisions.len() as u64,
        }
    }

    /// Applies a relay's answer for an endpoint.
    #[allow(clippy::too_many_arguments)]
    pub fn on_answer(
        &mut self,
        host: &dyn Host,
        engine: &Engine,
        counts: &Counts,
        slot: u16,
        generation: u16,
        relay: &str,
        body: &[u8],
        now: u64,
    ) {
        match engine.apply_mesh_answer(host.store(), slot, generation, body, now) {
            Ok(a) => {
                counts.inc(host, Counter::MeshExchanges);
                counts.add(host, Counter::MeshDecisionsReceived, u64::from(a.decisions));
                counts.add(host, Counter::SessionPeerBound, u64::from(a.sessions_bound));
                counts.add(host, Counter::SessionPeerMoved, u64::from(a.sessions_moved));
                counts.add(host, Counter::SessionEvicted, u64::from(a.sessions_evicted));
                if a.resync {
                    counts.inc(host, Counter::MeshResyncs);
                }
                self.cursors.insert((slot, generation), (a.epoch, a.seq));
            }
            Err(crate::engine::ApplyError::Garbage(m)) => {
                counts.inc(host, Counter::MeshExchangeFailures);
                host.log(
                    Level::Debug,
                    &format!("kvroute collector: mesh exchange with {relay}: {m}"),
                );
            }
            Err(crate::engine::ApplyError::Store(e)) => {
                counts.inc(host, Counter::HostErrors);
                host.log(
                    Level::Warn,
                    &format!("kvroute collector: applying the mesh answer of {relay}: {e}"),
                );
            }
        }
    }
}

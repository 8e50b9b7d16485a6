//! The mesh exchange: what this proxy tells the other proxies of a mesh,
//! and what it takes from theirs (`config.mesh`).
//!
//! Each Envoy process has its own shared data and sees only its own
//! traffic. With the exchange on:
//!
//! - **Told.** A request a server accepted (2xx) goes to the outbox
//!   ([`Engine::note_accepted`]: `kvroute_shared_state::mesh`) with the
//!   blocks it inserted and its text prompt bytes; at each
//!   exchange the collector takes it, with this proxy's own in-flight sums
//!   per endpoint ([`Engine::mesh_outgoing`]). Rejected requests are never
//!   told: only accepted work changes another proxy's state.
//! - **Taken.** For one endpoint, the others' decisions and the sum of
//!   their in-flight load ([`Engine::apply_peer`]): each decision's blocks
//!   are inserted into this proxy's index for the endpoint and advance its
//!   eviction clock by what they advanced the teller's, so the index holds
//!   what the whole mesh routed there, and the clock (and so
//!   `cache-balance-scorer`) counts the whole mesh's new cache. Their
//!   text bytes are added to the endpoint's routed bytes, so the
//!   bytes-per-token learner (`charsPerToken: "auto"`) divides the bytes
//!   the whole mesh routed by the tokens the server counted (with only its
//!   own bytes, a proxy of G learnt 1/G of the model's figure and counted
//!   every text prompt G times over). A decision that settled a
//!   `session_id` session's binding carries the session's hash and whether
//!   it moved the binding; the receiver settles its own binding for the
//!   session towards the decision's endpoint: it binds an unbound session,
//!   refreshes a binding that points there, moves one that points elsewhere
//!   only when the teller moved its own (the teller found the bound
//!   endpoint absent or released: llm-d's rule, applied where the decision
//!   was made), and otherwise keeps it. So a session that moves on one
//!   proxy moves on all, and the last move wins. The load
//!   sum is kept beside the endpoint's own charges and counts in decisions
//!   while it is younger than `mesh.peerTtlMs` (`engine::snapshot`).
//!
//! Who carries the messages (the relay beside each server, or the fleet
//! simulator's model of it) is not this file's business.

use super::{Engine, Provisional};
use kvroute_shared_state::cas::update;
use kvroute_shared_state::endpoints::EndpointEntry;
use kvroute_shared_state::index::{self, Holder, InsertStats, GROUP_BLOCKS};
use kvroute_shared_state::load::{LoadTable, PeerLoad};
use kvroute_shared_state::mesh::{self, Accepted, SessionNote};
use kvroute_shared_state::metrics::MetricsTable;
use kvroute_shared_state::sessions::Settled;
use kvroute_shared_state::{Store, StoreError, LOAD_KEY};

/// One endpoint's own in-flight sums, as this proxy tells them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct OwnLoad {
    pub slot: u16,
    pub generation: u16,
    pub prompt_tokens: u64,
    pub output_tokens: u64,
    pub requests: u32,
}

/// One of the other proxies' accepted decisions on an endpoint.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PeerDecision<'a> {
    /// Blocks it advanced the teller's eviction clock by.
    pub new_blocks: u32,
    /// Text prompt bytes it routed there.
    pub prompt_bytes: u32,
    /// Approximate block hashes from the start of an index group on.
    pub hashes: &'a [u64],
    /// The session binding it settled there.
    pub session: Option<SessionNote>,
}

/// What applying the other proxies' news about an endpoint did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PeerApplied {
    /// The index writes.
    pub index: InsertStats,
    /// Session bindings bound or refreshed, and moved, towards the
    /// endpoint (`session_id` sessions only).
    pub sessions_bound: u32,
    pub sessions_moved: u32,
    /// Live bindings of other sessions that gave up their slot to them.
    pub sessions_evicted: u32,
}

/// What the collector posts at one exchange.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct MeshOutgoing {
    /// Accepted decisions since the last exchange, oldest first.
    pub decisions: Vec<Accepted>,
    /// Decisions the outbox dropped at its bound, ever.
    pub dropped: u64,
    /// Every endpoint with a record in the load table.
    pub load: Vec<OwnLoad>,
}

impl Engine {
    /// The peers' load counts this long after it arrived (ms).
    pub fn peer_ttl_ms(&self) -> u64 {
        match self.config.mesh.peer_ttl_ms {
            0 => self
                .config
                .collector
                .metrics_poll_interval_ms
                .saturating_mul(3),
            t => t,
        }
    }

    /// A server accepted the request: puts its decision in the outbox
    /// (when the exchange is on, and the decision inserted blocks, routed
    /// text bytes or settled a session's binding). Returns the CAS races
    /// lost.
    pub fn note_accepted(
        &self,
        store: &dyn Store,
        p: &Provisional,
        session: Option<SessionNote>,
    ) -> Result<u32, StoreError> {
        if !self.config.mesh.enabled {
            return Ok(0);
        }
        let from = p.from_block.filter(|&f| f < p.hashes.len());
        if from.is_none() && p.undo.routed_bytes == 0 && session.is_none() {
            return Ok(0);
        }
        // From the start of the index group holding the first new block:
        // a group's shard is keyed by its own blocks only.
        let hashes = from.map_or_else(Vec::new, |f| {
            p.hashes[f / GROUP_BLOCKS * GROUP_BLOCKS..].to_vec()
        });
        mesh::post(
            store,
            Accepted {
                slot: p.undo.slot,
                generation: p.undo.generation,
                new_blocks: p.undo.new_blocks.min(u64::from(u32::MAX)) as u32,
                prompt_bytes: p.undo.routed_bytes.min(u64::from(u32::MAX)) as u32,
                hashes,
                session,
            },
        )
    }

    /// A server accepted a request whose decision left nothing to tell
    /// (Envoy retried it on another endpoint, `served`: its decision was
    /// taken back) but which settled its session's binding there: tells
    /// the binding alone. An endpoint not in the table is not told.
    pub fn note_session(
        &self,
        store: &dyn Store,
        served: &str,
        session: SessionNote,
    ) -> Result<u32, StoreError> {
        if !self.config.mesh.enabled {
            return Ok(0);
        }
        let table = self.endpoint_table(store)?;
        let Some(e) = table.endpoints.iter().find(|e| e.address == served) else {
            return Ok(0);
        };
        mesh::post(
            store,
            Accepted {
                slot: e.slot,
                generation: e.generation,
                session: Some(session),
                ..Accepted::default()
            },
        )
    }

    /// What this proxy tells at an exchange: the outbox (emptied) and its
    /// own in-flight sums per endpoint.
    pub fn mesh_outgoing(&self, store: &dyn Store) -> Result<MeshOutgoing, StoreError> {
        let taken = mesh::take(store)?;
        let table = LoadTable::decode(store.get(LOAD_KEY)?.as_ref().map(|(b, _)| b.as_slice()));
        let load = table
            .records
            .iter()
            .enumerate()
            .filter(|(_, r)| r.generation != 0)
            .map(|(slot, r)| OwnLoad {
                slot: slot as u16,
                generation: r.generation,
                prompt_tokens: r.inflight_prompt_tokens(),
                output_tokens: r.inflight_output_tokens(),
                requests: r.inflight_requests().min(u64::from(u32::MAX)) as u32,
            })
            .collect();
        Ok(MeshOutgoing {
            decisions: taken.entries,
            dropped: taken.dropped,
            load,
        })
    }

    /// Applies what the other proxies told about one endpoint at `now_ms`:
    /// their in-flight sum (`None`: keep the last one, which ages out) and
    /// their accepted decisions there, oldest first (blocks, bytes, hashes
    /// from the start of an index group, session).
    pub fn apply_peer(
        &self,
        store: &dyn Store,
        slot: u16,
        generation: u16,
        load: Option<PeerLoad>,
        decisions: &[PeerDecision<'_>],
        now_ms: u64,
    ) -> Result<PeerApplied, StoreError> {
        if load.is_none() && decisions.is_empty() {
            return Ok(PeerApplied::default());
        }
        // Only a healthy endpoint this proxy knows: a stale or hostile
        // slot must not grow the load table. (Read once: the tables are
        // the collector's, which is who calls this.)
        let (endpoints, metrics) = self.tables(store, 0)?;
        let Some(address) = endpoints
            .iter()
            .find(|e| e.slot == slot && e.generation == generation)
            .map(|e| e.address.clone())
        else {
            return Ok(PeerApplied::default());
        };
        let mut applied = PeerApplied::default();
        for s in decisions.iter().filter_map(|d| d.session) {
            let Some(o) = self.settle_session(store, s.hash, &address, s.moved, now_ms)? else {
                continue;
            };
            match o.settled {
                Settled::Bound | Settled::Refreshed => applied.sessions_bound += 1,
                Settled::Moved => applied.sessions_moved += 1,
                Settled::Kept => {}
            }
            applied.sessions_evicted += u32::from(o.evicted);
        }
        applied.index = self.apply_peer_index(
            store,
            slot,
            generation,
            load,
            decisions,
            (&endpoints, &metrics),
        )?;
        Ok(applied)
    }

    /// [`Engine::apply_peer`]'s load-table and index part.
    fn apply_peer_index(
        &self,
        store: &dyn Store,
        slot: u16,
        generation: u16,
        load: Option<PeerLoad>,
        decisions: &[PeerDecision<'_>],
        (endpoints, metrics): (&[EndpointEntry], &MetricsTable),
    ) -> Result<InsertStats, StoreError> {
        let total_new: u64 = decisions.iter().map(|d| u64::from(d.new_blocks)).sum();
        let total_bytes: u64 = decisions.iter().map(|d| u64::from(d.prompt_bytes)).sum();
        // One load-table write: the peers' load, their routed bytes, and
        // the eviction clock moved by every decision at once. The counter
        // before is returned, so each decision's entries are recorded at
        // its own point.
        let before = update(
            store,
            LOAD_KEY,
            LoadTable::decode,
            LoadTable::encode,
            |t: &mut LoadTable| {
                let before = t.get(slot, generation).map_or(0, |r| r.insert_counter);
                let ok = load.is_none_or(|p| t.set_peer_load(slot, generation, p))
                    && t.advance_insert_counter(slot, generation, total_new)
                    && t.add_routed_bytes(slot, generation, total_bytes);
                ok.then_some(before)
            },
        )?
        .result;
        let Some(before) = before else {
            return Ok(InsertStats::default());
        };
        if decisions.iter().all(|d| d.hashes.is_empty()) {
            return Ok(InsertStats::default());
        }
        // Every endpoint's holder, to tell live entries from evicted ones.
        let table = LoadTable::decode(store.get(LOAD_KEY)?.as_ref().map(|(b, _)| b.as_slice()));
        let bs = self.config.prefix.blocks.block_size_tokens;
        let holders: Vec<Holder> = endpoints
            .iter()
            .map(|e| Holder {
                slot: e.slot,
                generation: e.generation,
                insert_counter: table
                    .get(e.slot, e.generation)
                    .map_or(0, |r| r.insert_counter),
                capacity_blocks: self.capacity_blocks_in(metrics.get(e.slot, e.generation), bs),
            })
            .collect();
        let Some(capacity_blocks) = holders
            .iter()
            .find(|h| h.slot == slot && h.generation == generation)
            .map(|h| h.capacity_blocks)
        else {
            // Not a healthy endpoint here (yet): its clock moved, nothing
            // is recorded for it.
            return Ok(InsertStats::default());
        };
        let mut stats = InsertStats::default();
        let mut counter = before;
        for d in decisions {
            counter = counter.saturating_add(u64::from(d.new_blocks));
            if d.hashes.is_empty() {
                continue;
            }
            let me = Holder {
                slot,
                generation,
                insert_counter: counter,
                capacity_blocks,
            };
            let is_live = |s: u16, g: u16, recorded: u32| {
                if s == slot {
                    return me.holds(s, g, recorded);
                }
                holders
                    .iter()
                    .find(|h| h.slot == s)
                    .is_some_and(|h| h.holds(s, g, recorded))
            };
            let st = index::insert(store, &self.geometry, d.hashes, 0, &me, &is_live)?;
            stats.shard_writes += st.shard_writes;
            stats.cas_retries += st.cas_retries;
        }
        Ok(stats)
    }
}

/// What one relay's mesh answer did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MeshApplied {
    /// The cursor for the next post.
    pub epoch: u64,
    pub seq: u64,
    /// The relay has more decisions after `seq`.
    pub more: bool,
    /// The relay could not continue from the cursor (restart, or the
    /// cursor fell off its log): decisions were missed.
    pub resync: bool,
    /// Other proxies' decisions applied, and how many proxies the load
    /// sum covers.
    pub decisions: u32,
    pub proxies: u32,
    /// Session bindings their decisions bound or refreshed, and moved,
    /// and other sessions' bindings evicted for them.
    pub sessions_bound: u32,
    pub sessions_moved: u32,
    pub sessions_evicted: u32,
}

impl Engine {
    /// Applies one relay's answer to a mesh post for an endpoint: the other
    /// proxies' load there (stamped `now_ms`) and their decisions, each cut
    /// to the outbox's bounds. Garbage changes nothing.
    pub fn apply_mesh_answer(
        &self,
        store: &dyn Store,
        slot: u16,
        generation: u16,
        body: &[u8],
        now_ms: u64,
    ) -> Result<MeshApplied, super::ApplyError> {
        let a = crate::reports::mesh::parse_answer(body).map_err(super::ApplyError::Garbage)?;
        let decisions: Vec<PeerDecision<'_>> = a
            .decisions
            .iter()
            .take(crate::reports::mesh::ANSWER_LIMIT as usize)
            .map(|d| PeerDecision {
                new_blocks: d.new_blocks,
                prompt_bytes: d.prompt_bytes,
                hashes: &d.hashes[..d.hashes.len().min(mesh::MAX_ENTRY_HASHES)],
                session: d.session.map(|hash| SessionNote {
                    hash,
                    moved: d.session_moved,
                }),
            })
            .collect();
        let peer = PeerLoad {
            prompt_tokens: a.load.prompt,
            output_tokens: a.load.output,
            requests: a.load.requests,
            at_ms: now_ms.max(1),
        };
        let applied = self.apply_peer(store, slot, generation, Some(peer), &decisions, now_ms)?;
        Ok(MeshApplied {
            epoch: a.epoch,
            seq: a.seq,
            more: a.more,
            resync: a.resync,
            decisions: decisions.len() as u32,
            proxies: a.load.proxies,
            sessions_bound: applied.sessions_bound,
            sessions_moved: applied.sessions_moved,
            sessions_evicted: applied.sessions_evicted,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;
    use crate::engine::{Outcome, Routed};
    use crate::request::ApiKind;
    use crate::scheduling::Rng;
    use kvroute_shared_state::memory::MemoryStore;

    fn engine(mesh: bool) -> Engine {
        let doc = r#"{"endpoints":{"static":["127.0.0.1:1","127.0.0.1:2","127.0.0.1:3"]},
            "plugins":[{"type":"approx-prefix-cache-producer","parameters":{"blockSizeTokens":16}},
                       {"type":"prefix-cache-affinity-filter","parameters":{"maxTTFTPenaltyMs":1000,"peakPrefillThroughput":1000}},
                       {"type":"token-load-scorer"},{"type":"max-score-picker"}],
            "schedulingProfiles":[{"name":"d","plugins":[{"pluginRef":"prefix-cache-affinity-filter"},{"pluginRef":"token-load-scorer"},{"pluginRef":"max-score-picker"}]}]}"#;
        let mut c = Config::from_json(doc.as_bytes()).unwrap();
        c.mesh.enabled = mesh;
        Engine::new(c)
    }

    fn proxy(mesh: bool) -> (Engine, MemoryStore) {
        let e = engine(mesh);
        let s = MemoryStore::new();
        e.collector_init(&s).unwrap();
        (e, s)
    }

    fn chat(turns: usize) -> Vec<u8> {
        // A long context and short turns: each turn's prompt is mostly the last one's.
        let mut messages = vec![
            serde_json::json!({"role":"system","content":"You are a careful agent. ".repeat(300)}),
        ];
        for t in 0..turns {
            messages.push(serde_json::json!({"role":"user","content":format!("turn {t}: {}", "details ".repeat(20))}));
            messages.push(serde_json::json!({"role":"assistant","content":format!("answer {t}: {}", "words ".repeat(20))}));
        }
        serde_json::json!({"model":"m","messages":messages})
            .to_string()
            .into_bytes()
    }

    fn route(e: &Engine, s: &MemoryStore, body: &[u8], now_ms: u64) -> Routed {
        let facts = e.facts(ApiKind::ChatCompletions, body).unwrap();
        match e.route(s, facts, now_ms, &mut Rng::new(7)) {
            Outcome::Routed(r) => r,
            other => panic!("expected Routed, got {other:?}"),
        }
    }

    fn slot_of(e: &Engine, s: &MemoryStore, address: &str) -> (u16, u16) {
        let t = e.endpoint_table(s).unwrap();
        let x = t.endpoints.iter().find(|x| x.address == address).unwrap();
        (x.slot, x.generation)
    }

    /// Proxy A's outgoing decisions, applied to proxy B endpoint by endpoint.
    fn tell(a: &(Engine, MemoryStore), b: &(Engine, MemoryStore)) -> MeshOutgoing {
        let out = a.0.mesh_outgoing(&a.1).unwrap();
        for d in &out.decisions {
            b.0.apply_peer(
                &b.1,
                d.slot,
                d.generation,
                None,
                &[PeerDecision {
                    new_blocks: d.new_blocks,
                    prompt_bytes: d.prompt_bytes,
                    hashes: &d.hashes,
                    session: d.session,
                }],
                1,
            )
            .unwrap();
        }
        out
    }

    #[test]
    fn a_turn_through_another_proxy_finds_what_the_first_one_told() {
        let a = proxy(true);
        let b = proxy(true);
        let first = route(&a.0, &a.1, &chat(1), 1);
        let to = first.primary_address().to_owned();
        // Not accepted yet: nothing to tell.
        assert!(a.0.mesh_outgoing(&a.1).unwrap().decisions.is_empty());
        a.0.note_accepted(&a.1, first.provisional.as_ref().unwrap(), None)
            .unwrap();
        let out = tell(&a, &b);
        assert_eq!(out.decisions.len(), 1);
        assert_eq!(
            (out.decisions[0].slot, out.decisions[0].generation),
            slot_of(&a.0, &a.1, &to)
        );
        // The next turn through B: sticky to A's server, with a match.
        let next = route(&b.0, &b.1, &chat(2), 2);
        assert_eq!(next.primary_address(), to);
        assert_eq!(next.decision.branch, crate::scheduling::Branch::Sticky);
        // B's eviction clock for that server moved as A's did.
        let (slot, generation) = slot_of(&b.0, &b.1, &to);
        let load = |s: &MemoryStore| {
            LoadTable::decode(s.get(LOAD_KEY).unwrap().as_ref().map(|(v, _)| v.as_slice()))
        };
        let a_clock = load(&a.1).get(slot, generation).unwrap().insert_counter;
        assert!(a_clock > 0);
        assert!(load(&b.1).get(slot, generation).unwrap().insert_counter >= a_clock);
        // The outbox is empty once taken.
        assert!(a.0.mesh_outgoing(&a.1).unwrap().decisions.is_empty());
    }

    #[test]
    fn nothing_is_told_with_the_exchange_off_and_a_held_prompt_tells_only_its_bytes() {
        let off = proxy(false);
        let r = route(&off.0, &off.1, &chat(1), 1);
        off.0
            .note_accepted(&off.1, r.provisional.as_ref().unwrap(), None)
            .unwrap();
        assert!(off.0.mesh_outgoing(&off.1).unwrap().decisions.is_empty());

        let on = proxy(true);
        let r = route(&on.0, &on.1, &chat(1), 1);
        on.0.note_accepted(&on.1, r.provisional.as_ref().unwrap(), None)
            .unwrap();
        on.0.release_rest(&on.1, r.ticket.as_ref().unwrap(), false)
            .unwrap();
        // The same prompt again: the server holds all of it, so no
        // blocks are told, only the text bytes it routed there.
        let again = route(&on.0, &on.1, &chat(1), 2);
        assert_eq!(again.primary_address(), r.primary_address());
        on.0.note_accepted(&on.1, again.provisional.as_ref().unwrap(), None)
            .unwrap();
        let out = on.0.mesh_outgoing(&on.1).unwrap().decisions;
        assert_eq!(out.len(), 2);
        assert!(!out[0].hashes.is_empty() && out[0].new_blocks > 0);
        assert!(out[1].hashes.is_empty() && out[1].new_blocks == 0);
        assert!(out[1].prompt_bytes > 1000, "{:?}", out[1]);
        assert_eq!(out[0].prompt_bytes, out[1].prompt_bytes);
    }

    #[test]
    fn peers_text_bytes_count_in_the_routed_bytes_the_learner_reads() {
        // Two proxies share a server: each must count the bytes both routed
        // there, or the bytes-per-token learner (the server's tokens over
        // one proxy's bytes) learns half the model's figure.
        let a = proxy(true);
        let b = proxy(true);
        let r = route(&a.0, &a.1, &chat(1), 1);
        a.0.note_accepted(&a.1, r.provisional.as_ref().unwrap(), None)
            .unwrap();
        let (slot, generation) = slot_of(&a.0, &a.1, r.primary_address());
        let bytes = |s: &MemoryStore| {
            LoadTable::decode(s.get(LOAD_KEY).unwrap().as_ref().map(|(v, _)| v.as_slice()))
                .get(slot, generation)
                .map_or(0, |r| r.routed_prompt_bytes)
        };
        let own = bytes(&a.1);
        assert!(own > 1000);
        assert_eq!(bytes(&b.1), 0);
        tell(&a, &b);
        assert_eq!(bytes(&b.1), own);
        // Token-ID prompts route no text bytes: nothing to count.
        let ids = serde_json::json!({"model":"m","prompt":[1, 2, 3]}).to_string();
        let facts = a.0.facts(ApiKind::Completions, ids.as_bytes()).unwrap();
        let Outcome::Routed(t) = a.0.route(&a.1, facts, 2, &mut Rng::new(7)) else {
            panic!("not routed")
        };
        a.0.note_accepted(&a.1, t.provisional.as_ref().unwrap(), None)
            .unwrap();
        assert!(a
            .0
            .mesh_outgoing(&a.1)
            .unwrap()
            .decisions
            .iter()
            .all(|d| d.prompt_bytes == 0));
    }

    #[test]
    fn peers_load_counts_while_recent() {
        let (e, s) = proxy(true);
        let (slot, generation) = slot_of(&e, &s, "127.0.0.1:2");
        let peer = PeerLoad {
            prompt_tokens: 5000,
            output_tokens: 300,
            requests: 4,
            at_ms: 10_000,
        };
        e.apply_peer(&s, slot, generation, Some(peer), &[], 1)
            .unwrap();
        let facts = e.facts(ApiKind::ChatCompletions, &chat(1)).unwrap();
        let at = |now| {
            let snap = e.snapshot(&s, &facts, now).unwrap().unwrap();
            let i = snap.endpoints.iter().position(|x| x.slot == slot).unwrap();
            let c = &snap.candidates[i];
            (
                c.inflight_tokens,
                c.inflight_requests,
                c.inflight_prefill_tokens,
            )
        };
        let ttl = e.peer_ttl_ms();
        assert_eq!(at(10_000 + ttl), (5300, 4, 5000));
        assert_eq!(at(10_001 + ttl), (0, 0, 0));
        // A proxy with the exchange off ignores what it holds.
        let off = engine(false);
        let snap = off.snapshot(&s, &facts, 10_000).unwrap().unwrap();
        assert!(snap.candidates.iter().all(|c| c.inflight_tokens == 0));
    }

    #[test]
    fn hostile_peer_input_neither_panics_nor_leaks_state() {
        let (e, s) = proxy(true);
        let before = s.usage().0;
        // An unknown slot, a clock jump at the bound, empty and long hash lists.
        let d = |new_blocks, hashes| PeerDecision {
            new_blocks,
            prompt_bytes: u32::MAX,
            hashes,
            session: Some(SessionNote {
                hash: 9,
                moved: true,
            }),
        };
        e.apply_peer(&s, 900, 3, None, &[d(u32::MAX, &[1, 2, 3])], 1)
            .unwrap();
        e.apply_peer(&s, 5000, 1, None, &[d(1, &[])], 1).unwrap();
        let (slot, generation) = slot_of(&e, &s, "127.0.0.1:1");
        let long: Vec<u64> = (0..20_000).collect();
        for _ in 0..3 {
            e.apply_peer(
                &s,
                slot,
                generation,
                None,
                &[d(u32::MAX, &long), d(0, &[])],
                1,
            )
            .unwrap();
        }
        let t = LoadTable::decode(s.get(LOAD_KEY).unwrap().as_ref().map(|(v, _)| v.as_slice()));
        assert_eq!(
            t.get(slot, generation).unwrap().insert_counter,
            3 * u64::from(u32::MAX)
        );
        // Shared data does not grow: the index's shards exist from the
        // start, and the load table keeps its records.
        let after = s.usage().0;
        assert!(after <= before + 1024, "{before} -> {after}");
        // A peer sum at the bound saturates the endpoint's load (the
        // fuzz target `mesh_answer` found the overflow).
        let huge = PeerLoad {
            prompt_tokens: u64::MAX,
            output_tokens: u64::MAX,
            requests: u32::MAX,
            at_ms: 5,
        };
        e.apply_peer(&s, slot, generation, Some(huge), &[], 5)
            .unwrap();
        let facts = e.facts(ApiKind::ChatCompletions, &chat(1)).unwrap();
        let snap = e.snapshot(&s, &facts, 5).unwrap().unwrap();
        let i = snap.endpoints.iter().position(|x| x.slot == slot).unwrap();
        assert_eq!(snap.candidates[i].inflight_tokens, u64::MAX);
        // Routing still works.
        let r = route(&e, &s, &chat(1), 5);
        assert!(!r.primary_address().is_empty());
    }

    /// Two proxies with `session_id` sessions and the exchange on.
    fn session_proxy() -> (Engine, MemoryStore) {
        let doc = r#"{"endpoints":{"static":["127.0.0.1:1","127.0.0.1:2","127.0.0.1:3"]},
            "plugins":[{"type":"approx-prefix-cache-producer","parameters":{"blockSizeTokens":16}},
                       {"type":"token-load-scorer"},{"type":"max-score-picker"},
                       {"type":"session-affinity-scorer","parameters":{"strategy":"session_id"}}],
            "schedulingProfiles":[{"name":"d","plugins":[{"pluginRef":"token-load-scorer"},
                {"pluginRef":"session-affinity-scorer","weight":10},{"pluginRef":"max-score-picker"}]}]}"#;
        let mut c = Config::from_json(doc.as_bytes()).unwrap();
        c.mesh.enabled = true;
        let e = Engine::new(c);
        let s = MemoryStore::new();
        e.collector_init(&s).unwrap();
        (e, s)
    }

    fn bound_to(p: &(Engine, MemoryStore), id: &[u8], now_ms: u64) -> Option<String> {
        let sref = p.0.session_ref(|h| (h == "x-session-id").then_some(id));
        let facts = p.0.facts(ApiKind::ChatCompletions, &chat(0)).unwrap();
        let mut snap = p.0.snapshot(&p.1, &facts, now_ms).unwrap().unwrap();
        match p.0.mark_session(&p.1, sref.as_ref(), &mut snap, now_ms) {
            crate::engine::SessionLookup::Hit => {
                let i = snap.candidates.iter().position(|c| c.session)?;
                Some(snap.endpoints[i].address.clone())
            }
            _ => None,
        }
    }

    fn hash_of(p: &(Engine, MemoryStore), id: &[u8]) -> u64 {
        match p.0.session_ref(|h| (h == "x-session-id").then_some(id)) {
            Some(crate::engine::SessionRef::Id(h)) => h,
            other => panic!("{other:?}"),
        }
    }

    /// A session bound through one proxy is bound on the other after an
    /// exchange; a move through one moves it on the other; a refresh
    /// elsewhere does not; without the exchange nothing crosses.
    #[test]
    fn session_bindings_cross_the_mesh_and_the_last_move_wins() {
        let a = session_proxy();
        let b = session_proxy();
        let h = hash_of(&a, b"agent-1");
        assert_eq!(
            h,
            hash_of(&b, b"agent-1"),
            "every proxy keys a session alike"
        );
        // A's request is accepted on :2, binding the session there.
        let r = route(&a.0, &a.1, &chat(1), 1);
        let home = r.primary_address().to_owned();
        let out =
            a.0.settle_session(&a.1, h, &home, false, 1)
                .unwrap()
                .unwrap();
        assert_eq!(out.settled, Settled::Bound);
        let note = SessionNote {
            hash: h,
            moved: false,
        };
        a.0.note_accepted(&a.1, r.provisional.as_ref().unwrap(), Some(note))
            .unwrap();
        assert_eq!(bound_to(&b, b"agent-1", 2), None, "not told yet");
        let told = tell(&a, &b);
        assert_eq!(told.decisions[0].session, Some(note));
        assert_eq!(bound_to(&b, b"agent-1", 2).as_deref(), Some(home.as_str()));
        // B routes the session there too, against load: its binding leads.
        let mut facts = b.0.facts(ApiKind::ChatCompletions, &chat(3)).unwrap();
        facts.session =
            b.0.session_ref(|n| (n == "x-session-id").then_some(&b"agent-1"[..]));
        let Outcome::Routed(rb) = b.0.route(&b.1, facts, 3, &mut Rng::new(1)) else {
            panic!("not routed")
        };
        assert_eq!(rb.primary_address(), home);
        // A's retry elsewhere moves the binding; told alone (no decision).
        let away = ["127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"]
            .into_iter()
            .find(|x| *x != home)
            .unwrap();
        let out = a.0.settle_session(&a.1, h, away, true, 4).unwrap().unwrap();
        assert_eq!(out.settled, Settled::Moved);
        a.0.note_session(
            &a.1,
            away,
            SessionNote {
                hash: h,
                moved: true,
            },
        )
        .unwrap();
        tell(&a, &b);
        assert_eq!(bound_to(&b, b"agent-1", 5).as_deref(), Some(away));
        // A binding A only refreshed (or bound anew) elsewhere does not
        // move B's: the teller found no reason to move.
        let third = ["127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"]
            .into_iter()
            .find(|x| *x != home && *x != away)
            .unwrap();
        a.0.note_session(
            &a.1,
            third,
            SessionNote {
                hash: h,
                moved: false,
            },
        )
        .unwrap();
        let applied = {
            let out = a.0.mesh_outgoing(&a.1).unwrap();
            let d = &out.decisions[0];
            b.0.apply_peer(
                &b.1,
                d.slot,
                d.generation,
                None,
                &[PeerDecision {
                    session: d.session,
                    ..PeerDecision::default()
                }],
                6,
            )
            .unwrap()
        };
        assert_eq!((applied.sessions_bound, applied.sessions_moved), (0, 0));
        assert_eq!(bound_to(&b, b"agent-1", 7).as_deref(), Some(away));
        // A refresh keeps B's binding alive past its own idle TTL.
        let ttl = 300_000;
        a.0.note_session(
            &a.1,
            away,
            SessionNote {
                hash: h,
                moved: false,
            },
        )
        .unwrap();
        let out = a.0.mesh_outgoing(&a.1).unwrap();
        let d = &out.decisions[0];
        let applied =
            b.0.apply_peer(
                &b.1,
                d.slot,
                d.generation,
                None,
                &[PeerDecision {
                    session: d.session,
                    ..PeerDecision::default()
                }],
                ttl,
            )
            .unwrap();
        assert_eq!(applied.sessions_bound, 1);
        assert_eq!(bound_to(&b, b"agent-1", ttl + 6).as_deref(), Some(away));
        // A session told for an endpoint B does not know binds nothing.
        let stranger =
            b.0.apply_peer(
                &b.1,
                900,
                1,
                None,
                &[PeerDecision {
                    session: Some(SessionNote {
                        hash: 5,
                        moved: true,
                    }),
                    ..PeerDecision::default()
                }],
                8,
            )
            .unwrap();
        assert_eq!(stranger, PeerApplied::default());
        // Exchange off: nothing is told.
        let mut off = session_proxy();
        let mut c = off.0.config.clone();
        c.mesh.enabled = false;
        off.0 = Engine::new(c);
        off.0
            .note_session(
                &off.1,
                away,
                SessionNote {
                    hash: h,
                    moved: true,
                },
            )
            .unwrap();
        assert!(off.0.mesh_outgoing(&off.1).unwrap().decisions.is_empty());
    }
}

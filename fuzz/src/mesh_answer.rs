//! Fuzz target `mesh_answer`: what a relay answers to the collector's mesh
//! posts (`POST /mesh/exchange`), through `Engine::apply_mesh_answer` into
//! the load table and the prefix index in a `MemoryStore`, with routing
//! and the outbox in between.
//!
//! The input is a sequence of answers separated by NUL bytes (at most
//! [`MAX_ANSWERS`]); the first byte of each picks the endpoint (the rest
//! is the body). Between answers one request is routed and, on odd steps,
//! told to the outbox (`note_accepted`), and every few steps the outbox is
//! taken (`mesh_outgoing`). After each answer:
//!
//! - garbage is an error and changes neither the load table nor the index;
//!   a store error never happens;
//! - an applied answer sets the endpoint's peer load to the answer's sums
//!   (stamped now) and moves its eviction clock forward, never back;
//! - shared data never grows past what it held after the first route plus
//!   the outbox's bound and the session table's (one shard of 64
//!   bindings), and the load table has records only for the endpoint
//!   table's slots;
//! - a peer decision's session is bound to the answer's endpoint when the
//!   answer names no other session (a moved one always; a bound or
//!   refreshed one unless it was bound elsewhere), and a told session
//!   never binds to an endpoint outside the table;
//! - the in-flight charges equal the outstanding requests (`World`).

use crate::engine::{route_chat, World};
use kvroute_core::config::Config;
use kvroute_core::engine::{endpoint_key, ApplyError};
use kvroute_core::reports::mesh::{parse_answer, ExchangeAnswer, ANSWER_LIMIT};
use kvroute_shared_state::endpoints::EndpointEntry;
use kvroute_shared_state::load::LoadTable;
use kvroute_shared_state::sessions::{shard_key, Binding, Shard, SHARD_SLOTS};
use kvroute_shared_state::mesh::{MAX_OUTBOX_BYTES, OUTBOX_KEY};
use kvroute_shared_state::{Store, LOAD_KEY};

/// Most answers per input.
pub const MAX_ANSWERS: usize = 32;

const CONFIG: &str = r#"{"endpoints":{"static":["127.0.0.1:8001","127.0.0.1:8002","127.0.0.1:8003"]},
  "plugins":[{"type":"approx-prefix-cache-producer","parameters":{"blockSizeTokens":4,"lruCapacityPerServer":64}},
             {"type":"prefix-cache-scorer"},{"type":"max-score-picker"},
             {"type":"session-affinity-scorer","parameters":{"strategy":"session_id",
               "sessionIdConfig":{"sources":[{"header":"x-session-id"}],"maxSessions":64}}}],
  "schedulingProfiles":[{"name":"d","plugins":[{"pluginRef":"prefix-cache-scorer"},
             {"pluginRef":"session-affinity-scorer"},{"pluginRef":"max-score-picker"}]}],
  "kvEvents":{"enabled":true},
  "sharedState":{"indexBudgetBytes":65536}}"#;

fn load(w: &World) -> LoadTable {
    let v = w.store.get(LOAD_KEY).expect("MemoryStore get");
    LoadTable::decode(v.as_ref().map(|(b, _)| b.as_slice()))
}

/// Everything but the outbox and the load table's peer fields.
fn index_bytes(w: &World) -> usize {
    w.store.bytes_with_prefix("kvroute/ix/")
}

/// The session table's bindings (one shard: `maxSessions` 64).
fn sessions(w: &World) -> Vec<Binding> {
    let v = w.store.get(&shard_key(0)).expect("MemoryStore get");
    Shard::decode_or_empty(v.as_ref().map(|(b, _)| b.as_slice())).bindings
}

/// An applied answer's sessions, when it names exactly one: a moved one
/// is bound to the answer's endpoint; a bound or refreshed one is too,
/// unless it was bound elsewhere before (kept).
fn check_sessions(w: &World, a: &ExchangeAnswer, before: &[Binding], e: &EndpointEntry) {
    let told: Vec<(u64, bool)> = a
        .decisions
        .iter()
        .take(ANSWER_LIMIT as usize)
        .filter_map(|d| d.session.map(|h| (h, d.session_moved)))
        .collect();
    let Some(&(h, _)) = told.first() else {
        return;
    };
    if told.iter().any(|&(x, _)| x != h) {
        return;
    }
    let key = endpoint_key(&e.address);
    let now = sessions(w);
    let bound = now.iter().find(|b| b.session == h).map(|b| b.endpoint);
    let was = before.iter().find(|b| b.session == h).map(|b| b.endpoint);
    let moved = told.iter().any(|&(_, m)| m);
    match was {
        Some(k) if k != key && !moved => {
            assert_eq!(bound, Some(k), "a peer's refresh moved a session")
        }
        _ => assert_eq!(bound, Some(key), "a peer's session was not bound here"),
    }
}

/// Routes one chat request outside `World`'s bookkeeping, tells the
/// outbox (as a 2xx answer does), and releases it.
fn accepted(w: &mut World, i: usize) {
    let body = serde_json::to_vec(&serde_json::json!({"model": "m", "messages": [
        {"role": "system", "content": "an accepted request's own long system prompt ".repeat(8)},
        {"role": "user", "content": format!("accepted {i}")}]}))
    .expect("a Value serialises");
    let facts = w
        .engine
        .facts(kvroute_core::request::ApiKind::ChatCompletions, &body)
        .expect("a chat body");
    let mut rng = kvroute_core::scheduling::Rng::new(i as u64);
    if let kvroute_core::engine::Outcome::Routed(r) =
        w.engine.route(&w.store, facts, w.now_ms, &mut rng)
    {
        if let Some(p) = &r.provisional {
            w.engine
                .note_accepted(&w.store, p, None)
                .expect("note_accepted");
        }
        if let Some(t) = &r.ticket {
            w.engine
                .release_rest(&w.store, t, false)
                .expect("release_rest");
        }
    }
}

/// Runs one input (fuzz target `mesh_answer`).
pub fn run(data: &[u8]) {
    let config = Config::from_json(CONFIG.as_bytes()).expect("fixed config");
    assert!(config.mesh.enabled, "the exchange follows kvEvents");
    let mut w = World::new(config);
    let table = w.engine.endpoint_table(&w.store).expect("endpoint table");
    let eps = table.endpoints.clone();
    route_chat(&mut w, 0);
    let (base_bytes, base_keys) = w.store.usage();
    let records = eps
        .iter()
        .map(|e| usize::from(e.slot) + 1)
        .max()
        .unwrap_or(0);
    for (step, answer) in data.split(|&b| b == 0).take(MAX_ANSWERS).enumerate() {
        w.now_ms += 100;
        let Some((&pick, body)) = answer.split_first() else {
            continue;
        };
        let e = &eps[usize::from(pick) % eps.len()];
        let before_load = load(&w);
        let before_ix = w.store.get("kvroute/ix/0").expect("MemoryStore get");
        let before_ix_bytes = index_bytes(&w);
        let before_sessions = sessions(&w);
        match w
            .engine
            .apply_mesh_answer(&w.store, e.slot, e.generation, body, w.now_ms)
        {
            Err(ApplyError::Store(s)) => panic!("a MemoryStore error: {s}"),
            Err(ApplyError::Garbage(m)) => {
                assert!(!m.is_empty());
                assert!(parse_answer(body).is_err(), "refused what parses");
                assert_eq!(
                    load(&w),
                    before_load,
                    "a garbage answer changed the load table"
                );
                assert_eq!(
                    w.store.get("kvroute/ix/0").expect("MemoryStore get"),
                    before_ix,
                    "a garbage answer changed the index"
                );
                assert_eq!(index_bytes(&w), before_ix_bytes);
                assert_eq!(sessions(&w), before_sessions, "a garbage answer bound a session");
            }
            Ok(applied) => {
                let a = parse_answer(body).expect("the engine accepted it");
                assert_eq!((applied.epoch, applied.seq), (a.epoch, a.seq));
                check_sessions(&w, &a, &before_sessions, e);
                let after = load(&w);
                let rec = after.get(e.slot, e.generation).expect("its record");
                assert_eq!(
                    (
                        rec.peer.prompt_tokens,
                        rec.peer.output_tokens,
                        rec.peer.requests
                    ),
                    (a.load.prompt, a.load.output, a.load.requests)
                );
                assert_eq!(rec.peer.at_ms, w.now_ms);
                let was = before_load
                    .get(e.slot, e.generation)
                    .map_or(0, |r| r.insert_counter);
                assert!(rec.insert_counter >= was, "the eviction clock went back");
            }
        }
        // Routing goes on; on odd steps a request the server accepted goes
        // to the outbox (and is released at once); every fourth step the
        // collector takes the outbox.
        route_chat(&mut w, step + 1);
        if step % 2 == 1 {
            accepted(&mut w, step);
        }
        if step % 4 == 3 {
            let out = w.engine.mesh_outgoing(&w.store).expect("mesh_outgoing");
            assert!(out.decisions.iter().all(|d| eps
                .iter()
                .any(|e| (e.slot, e.generation) == (d.slot, d.generation))));
        }
        let (bytes, keys) = w.store.usage();
        let outbox = w
            .store
            .get(OUTBOX_KEY)
            .expect("MemoryStore get")
            .map_or(0, |(b, _)| b.len());
        assert!(outbox <= MAX_OUTBOX_BYTES, "outbox {outbox}");
        let session_table = 2 + SHARD_SLOTS * 24;
        assert!(
            bytes <= base_bytes + MAX_OUTBOX_BYTES + session_table + 64,
            "shared data grew: {base_bytes} -> {bytes}"
        );
        assert!(keys <= base_keys + 3, "keys {base_keys} -> {keys}");
        let keys_of: Vec<u64> = eps.iter().map(|e| endpoint_key(&e.address)).collect();
        assert!(
            sessions(&w).iter().all(|b| keys_of.contains(&b.endpoint)),
            "a session bound outside the endpoint table"
        );
        // Records only for the table's slots, whatever an answer names.
        assert!(load(&w).records.len() <= records, "the load table grew");
    }
    w.finish();
}

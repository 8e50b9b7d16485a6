//! Fuzz target `kv_events`: what an endpoint's KV-event relay answers
//! (`/kv/snapshot`, `/kv/events`), through `Engine::apply_relay_answer`
//! into the held-block sets in a `MemoryStore`.
//!
//! The input is a sequence of relay answers separated by NUL bytes (at
//! most [`MAX_ANSWERS`]); an empty one is a failed call
//! (`record_relay_failure`). Each answer goes to the call the collector
//! would have made (`kv_events::next_ask`: the snapshot until it has a
//! position, then events), 100 ms apart. A reference set follows the ops
//! the engine accepted. After each answer:
//!
//! - garbage is an error and changes nothing; a store error never happens;
//! - `kvroute/held` decodes and re-encodes to the same bytes;
//! - the set holds at most `maxHeldBlocks` hashes, its count equals what
//!   its shards hold, each shard is [`SHARD_BYTES`] long with at most
//!   [`SHARD_CAP`] hashes (its header's count is right), no shard lies
//!   outside the geometry, and held data stays within `max_bytes`;
//! - the set is a subset of the reference, and equals it while nothing was
//!   dropped at the bound (`lossy` false); `complete` implies not lossy;
//! - the request-path lookup (`held_prefixes`) and the state view agree
//!   with the set.

use crate::engine::{route_chat, World};
use kvroute_core::config::Config;
use kvroute_core::engine::{Applied, ApplyError};
use kvroute_core::reports::relay::{next_ask, Ask};
use kvroute_shared_state::held::{
    all_hashes, shard_key, HeldTable, HELD_KEY, SHARD_BYTES, SHARD_CAP, SHARD_ENTRIES,
};
use kvroute_shared_state::{Store, LOAD_KEY};
use serde::Deserialize;
use serde_json::Value;
use std::collections::BTreeSet;

/// Most answers per input.
pub const MAX_ANSWERS: usize = 32;

/// Held sets of at most 300 hashes (3 shards), so the bound and the full
/// shard are reachable; a known capacity (`lruCapacityPerServer`), so a
/// cleared cache ages the approximate index out.
const CONFIG: &str = r#"{"endpoints":{"static":["127.0.0.1:8001","127.0.0.1:8002"]},
  "plugins":[{"type":"approx-prefix-cache-producer","parameters":{"blockSizeTokens":4,"lruCapacityPerServer":64}},
             {"type":"prefix-cache-scorer"},{"type":"max-score-picker"}],
  "schedulingProfiles":[{"name":"d","plugins":[{"pluginRef":"prefix-cache-scorer"},{"pluginRef":"max-score-picker"}]}],
  "kvEvents":{"enabled":true,"maxHeldBlocks":300,"staleMs":60000},
  "sharedState":{"indexBudgetBytes":65536}}"#;

/// How the held set keys a hash: 0 marks an empty slot, so 0 is kept as 1.
fn key(h: u64) -> u64 {
    h.max(1)
}

fn hashes(v: &Value) -> Vec<u64> {
    v.as_array()
        .map(|a| a.iter().filter_map(Value::as_u64).collect())
        .unwrap_or_default()
}

// The relay's answers as `relay/README.md` documents them: only what the
// reference set needs; other fields are ignored, as the engine ignores them
// unchecked. Not read into a `Value`: serde_json skips an ignored field's
// strings without checking them, so an answer with invalid UTF-8 in an
// unknown field is accepted, and a `Value` would refuse it
// (`seeds/kv_events/regression-ignored-invalid-utf8.json`).

#[derive(Deserialize)]
struct EventsDoc {
    #[serde(default)]
    batches: Vec<BatchDoc>,
}

#[derive(Deserialize)]
struct BatchDoc {
    ops: Vec<OpDoc>,
}

#[derive(Deserialize)]
#[serde(tag = "op", rename_all = "lowercase")]
enum OpDoc {
    Stored { hashes: Vec<u64> },
    Removed { hashes: Vec<u64> },
    Cleared,
}

#[derive(Deserialize)]
struct SnapshotDoc {
    blocks: Vec<u64>,
}

/// Replays an accepted `/kv/events` answer's ops on the reference set.
fn apply_events_to(reference: &mut BTreeSet<u64>, body: &[u8]) {
    let doc: EventsDoc = serde_json::from_slice(body).expect("the engine accepted it");
    for batch in doc.batches {
        for op in batch.ops {
            match op {
                OpDoc::Stored { hashes } => reference.extend(hashes.into_iter().map(key)),
                OpDoc::Removed { hashes } => {
                    for h in hashes {
                        reference.remove(&key(h));
                    }
                }
                OpDoc::Cleared => reference.clear(),
            }
        }
    }
}

/// Runs one input (fuzz target `kv_events`).
pub fn run(data: &[u8]) {
    let config = Config::from_json(CONFIG.as_bytes()).expect("fixed config");
    let mut w = World::new(config);
    let table = w.engine.endpoint_table(&w.store).expect("endpoint table");
    let e = table.endpoints[0].clone();
    let geo = w.engine.held_geometry();
    let mut reference = BTreeSet::new();
    for body in data.split(|&b| b == 0).take(MAX_ANSWERS) {
        w.now_ms += 100;
        let before = w.store.get(HELD_KEY).expect("MemoryStore get");
        let status = HeldTable::read(&w.store).expect("read held");
        let view = status.get(e.slot, e.generation).copied();
        if body.is_empty() {
            w.engine
                .record_relay_failure(&w.store, e.slot, e.generation, w.now_ms)
                .expect("record_relay_failure");
            check(&mut w, &e, &geo, &reference);
            continue;
        }
        let ask = next_ask(view.as_ref());
        let applied =
            w.engine
                .apply_relay_answer(&w.store, e.slot, e.generation, ask, body, w.now_ms);
        match applied {
            Err(ApplyError::Store(s)) => panic!("a MemoryStore error: {s}"),
            Err(ApplyError::Garbage(m)) => {
                assert!(!m.is_empty());
                assert_eq!(
                    w.store.get(HELD_KEY).expect("MemoryStore get"),
                    before,
                    "a garbage answer changed kvroute/held"
                );
            }
            Ok(a) => {
                check_applied(&a, ask);
                match ask {
                    Ask::Snapshot => {
                        let doc: SnapshotDoc =
                            serde_json::from_slice(body).expect("the engine accepted it");
                        reference = doc.blocks.into_iter().map(key).collect();
                    }
                    Ask::Events if a.resync => {}
                    Ask::Events => apply_events_to(&mut reference, body),
                }
                let view = HeldTable::read(&w.store)
                    .expect("read held")
                    .get(e.slot, e.generation)
                    .copied()
                    .expect("a view after an applied answer");
                assert_eq!(a.blocks, view.blocks, "{a:?} {view:?}");
                if a.resync {
                    assert_eq!((view.relay_epoch, view.relay_seq), (0, 0));
                } else {
                    assert_ne!(view.relay_epoch, 0, "no relay position after {a:?}");
                }
            }
        }
        check(&mut w, &e, &geo, &reference);
    }
    w.finish();
}

fn check_applied(a: &Applied, ask: Ask) {
    assert_eq!(a.snapshot, ask == Ask::Snapshot);
    if a.resync {
        assert_eq!(a.follow_up, Some(Ask::Snapshot));
        assert_eq!((a.stored, a.removed, a.cleared), (0, 0, 0));
    }
    assert!(a.dropped <= a.stored, "{a:?}");
}

fn check(
    w: &mut World,
    e: &kvroute_shared_state::endpoints::EndpointEntry,
    geo: &kvroute_shared_state::held::HeldGeometry,
    reference: &BTreeSet<u64>,
) {
    let raw = w.store.get(HELD_KEY).expect("MemoryStore get");
    if let Some((bytes, _)) = &raw {
        assert_eq!(
            HeldTable::decode(Some(bytes)).encode(),
            *bytes,
            "kvroute/held does not re-encode"
        );
    }
    let status = HeldTable::read(&w.store).expect("read held");
    let Some(view) = status.get(e.slot, e.generation).copied() else {
        return;
    };
    assert!(view.blocks <= geo.max_blocks, "{view:?} over {geo:?}");
    assert!(
        !(view.complete && view.lossy),
        "complete and lossy: {view:?}"
    );
    // Shards: the layout `held.rs` documents (view u32, count u32, entries).
    for n in 0..geo.shards + 2 {
        let Some((s, _)) = w.store.get(&shard_key(e.slot, n)).expect("get") else {
            continue;
        };
        assert!(n < geo.shards, "shard {n} outside the geometry {geo:?}");
        assert_eq!(s.len(), SHARD_BYTES, "shard {n}");
        let count = u32::from_le_bytes([s[4], s[5], s[6], s[7]]);
        let used = (0..SHARD_ENTRIES)
            .filter(|i| s[8 + 8 * i..16 + 8 * i] != [0; 8])
            .count() as u32;
        assert_eq!(
            count, used,
            "shard {n}: header count {count}, {used} hashes"
        );
        assert!(count <= SHARD_CAP, "shard {n} holds {count}");
    }
    assert!(
        w.store.bytes_with_prefix("kvroute/held") as u64 <= geo.max_bytes(2),
        "held data over its bound"
    );
    let held = all_hashes(&w.store, geo, &status, e.slot, e.generation).expect("all_hashes");
    let set: BTreeSet<u64> = held.iter().copied().collect();
    assert_eq!(set.len(), held.len(), "a hash held twice");
    assert_eq!(
        held.len() as u32,
        view.blocks,
        "count differs from the shards"
    );
    assert!(
        set.is_subset(reference),
        "held hashes the answers never stored: {:?}",
        set.difference(reference).take(4).collect::<Vec<_>>()
    );
    if !view.lossy {
        assert_eq!(&set, reference, "the set differs from the answers' ops");
    }
    // The request path: a chain of held hashes is matched in full while the
    // view is fresh (one good answer within staleMs).
    let chain: Vec<u64> = set.iter().copied().take(8).collect();
    let m = w
        .engine
        .held_prefixes(&w.store, std::slice::from_ref(e), &chain, w.now_ms)
        .expect("held_prefixes");
    assert_eq!(m.len(), 1);
    assert!(m[0].matched_blocks as usize <= chain.len());
    if m[0].fresh {
        assert_eq!(m[0].matched_blocks as usize, chain.len(), "{m:?}");
    }
    let state = w.engine.state_json(&w.store, w.now_ms).expect("state_json");
    let state: Value = serde_json::from_str(&state).expect("state_json is JSON");
    let ep = state["endpoints"]
        .as_array()
        .and_then(|a| a.iter().find(|x| x["slot"] == u64::from(e.slot)))
        .expect("the endpoint in the state view");
    let kv = &ep["kvEvents"];
    assert_eq!(kv["blocks"].as_u64(), Some(u64::from(view.blocks)), "{kv}");
    if view.blocks <= kvroute_core::engine::STATE_HASHES_MAX {
        let listed: BTreeSet<u64> = hashes(&kv["hashes"]).into_iter().collect();
        assert_eq!(listed, set, "the state view lists other hashes");
    }
    assert!(w.store.get(LOAD_KEY).expect("get").is_some());
    route_chat(w, 0);
    w.check_accounting();
}

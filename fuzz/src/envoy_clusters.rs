//! Fuzz target `envoy_clusters`: what Envoy's admin `/clusters?format=json`
//! answers, through `Engine::apply_admin_clusters` into the endpoint table
//! in a `MemoryStore` (`endpoints.fromCluster`, cluster `vllm`).
//!
//! The input is one or more admin bodies separated by NUL bytes (at most
//! [`MAX_POLLS`]). After each:
//!
//! - `cluster_members` is deterministic and holds at most
//!   [`crate::alloc_bound`] heap bytes; every member is an `ip:port`
//!   (what the destination header carries; `SocketAddr` parses it and
//!   prints it back the same);
//! - `apply_admin_clusters` fails exactly when `cluster_members` does, and
//!   a failure leaves the table as it was;
//! - `kvroute/endpoints` decodes and re-encodes to the same bytes, and
//!   lists exactly the distinct members (the first [`MAX_ENDPOINTS`]) with
//!   their health, each in its own slot below `MAX_ENDPOINTS` at the
//!   slot's current generation;
//! - a request routed afterwards goes to healthy members only, distinct,
//!   with finite scores (`World::route`).

use crate::engine::{route_chat, World};
use kvroute_core::config::Config;
use kvroute_core::reports::envoy_clusters::cluster_members;
use kvroute_shared_state::endpoints::EndpointTable;
use kvroute_shared_state::{Store, ENDPOINTS_KEY, MAX_ENDPOINTS};
use std::net::SocketAddr;

/// Most admin bodies per input.
pub const MAX_POLLS: usize = 8;

const CONFIG: &str = r#"{"endpoints":{"fromCluster":{"cluster":"vllm"}},
  "plugins":[{"type":"approx-prefix-cache-producer","parameters":{"blockSizeTokens":4}},
             {"type":"prefix-cache-affinity-filter","parameters":{"maxTTFTPenaltyMs":200,"peakPrefillThroughput":1000}},
             {"type":"token-load-scorer"},{"type":"max-score-picker"}],
  "schedulingProfiles":[{"name":"d","plugins":[{"pluginRef":"prefix-cache-affinity-filter"},{"pluginRef":"token-load-scorer"},{"pluginRef":"max-score-picker"}]}],
  "routing":{"maxFallbacks":4},
  "sharedState":{"indexBudgetBytes":65536}}"#;

/// Runs one input (fuzz target `envoy_clusters`).
pub fn run(data: &[u8]) {
    let config = Config::from_json(CONFIG.as_bytes()).expect("fixed config");
    let mut w = World::new(config);
    for (i, body) in data.split(|&b| b == 0).take(MAX_POLLS).enumerate() {
        let base = crate::alloc_count::start();
        let members = cluster_members(body, "vllm");
        crate::check_alloc(
            "cluster_members",
            body.len(),
            crate::alloc_count::peak_since(base),
        );
        assert_eq!(
            cluster_members(body, "vllm"),
            members,
            "cluster_members is not deterministic"
        );
        let before = w.store.get(ENDPOINTS_KEY).expect("MemoryStore get");
        let applied = w.engine.apply_admin_clusters(&w.store, body);
        let members = match members {
            Err(e) => {
                assert!(!e.to_string().is_empty());
                let m =
                    applied.expect_err("apply_admin_clusters took what cluster_members refused");
                assert!(!m.is_empty());
                assert_eq!(
                    w.store.get(ENDPOINTS_KEY).expect("MemoryStore get"),
                    before,
                    "a refused admin body changed the endpoint table"
                );
                continue;
            }
            Ok(m) => m,
        };
        applied.expect("apply_admin_clusters refused what cluster_members took");
        for (a, _) in &members {
            let parsed: SocketAddr = a
                .parse()
                .unwrap_or_else(|_| panic!("member {a:?} is not an ip:port"));
            assert_eq!(&parsed.to_string(), a, "member {a:?} is not canonical");
        }
        check_table(&w, &members);
        route_chat(&mut w, i);
        w.now_ms += 500;
        w.check_accounting();
    }
    w.finish();
}

fn check_table(w: &World, members: &[(String, bool)]) {
    let (bytes, _) = w
        .store
        .get(ENDPOINTS_KEY)
        .expect("MemoryStore get")
        .expect("kvroute/endpoints after a membership");
    let t = EndpointTable::decode(&bytes).expect("kvroute/endpoints decodes");
    assert_eq!(t.encode(), bytes, "kvroute/endpoints does not re-encode");
    let mut wanted: Vec<&(String, bool)> = Vec::new();
    for m in members {
        if wanted.len() < MAX_ENDPOINTS && !wanted.iter().any(|w| w.0 == m.0) {
            wanted.push(m);
        }
    }
    assert_eq!(t.endpoints.len(), wanted.len(), "table size");
    for (a, healthy) in wanted {
        let e = t
            .endpoints
            .iter()
            .find(|e| e.address == *a)
            .unwrap_or_else(|| panic!("member {a} is not in the table"));
        assert_eq!(e.healthy, *healthy, "{a}'s health");
        assert!(usize::from(e.slot) < MAX_ENDPOINTS);
        assert_ne!(e.generation, 0);
        assert_eq!(
            t.slot_generations.get(usize::from(e.slot)),
            Some(&e.generation),
            "{a}: slot {} at an old generation",
            e.slot
        );
        assert_eq!(
            t.endpoints.iter().filter(|x| x.slot == e.slot).count(),
            1,
            "slot {} shared",
            e.slot
        );
    }
}

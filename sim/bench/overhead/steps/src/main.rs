//! What each step of one routing decision costs, over the benchmark's own
//! request bodies, with an in-memory store that copies on get and set as
//! Envoy's shared data does. Built natively and for wasm32-wasip1 (run under
//! V8 by node, Envoy's wasm engine), so the two can be compared step by step.
//!
//!     steps BODIES.jsonl [ROUNDS]
//!
//! Steps, each timed alone over every body in the file, after one warm-up
//! pass that fills the prefix index (so lookups are warm, as in Envoy):
//!   copy     the body copied into a fresh Vec (what proxy_get_buffer_bytes does)
//!   parse    request::parse_request (serde_json + prompt render)
//!   hash     blocks::prompt_blocks (chained xxh64 over 256-byte blocks)
//!   lookup   index::longest_prefixes for 4 endpoints
//!   insert   index::insert of every block for one endpoint
//!   after_hash  Engine::route on facts built from the hashes (endpoint/load/
//!            metrics tables, lookup, decision, charge CAS, index insert,
//!            explanation) + both releases
//!   route    Engine::facts + Engine::route end to end + release_prompt +
//!            release_rest
//! Per step: median CPU ns per request (process CPU time, not wall time) over ROUNDS rounds, and the allocator's
//! traffic per request (allocations, bytes allocated, bytes moved by realloc).

use kvroute_core::config::Config;
use kvroute_core::engine::{Engine, Outcome, RequestFacts};
use kvroute_core::request::{parse_request, ApiKind, ParseLimits};
use kvroute_core::scheduling::Rng;
use kvroute_shared_state::index::{self, Holder};
use kvroute_shared_state::memory::MemoryStore;
use std::alloc::{GlobalAlloc, Layout, System};
use std::hint::black_box;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

/// CPU time of this process in nanoseconds: wall clocks are useless on a
/// machine shared with other people's builds.
#[cfg(target_os = "wasi")]
fn cpu_ns() -> u64 {
    #[link(wasm_import_module = "wasi_snapshot_preview1")]
    extern "C" {
        fn clock_time_get(id: u32, precision: u64, out: *mut u64) -> u16;
    }
    let mut t = 0u64;
    // 2 = process_cputime_id
    let rc = unsafe { clock_time_get(2, 1, &mut t) };
    assert_eq!(rc, 0, "clock_time_get(process_cputime_id) failed");
    t
}

#[cfg(not(target_os = "wasi"))]
fn cpu_ns() -> u64 {
    #[repr(C)]
    struct Timespec {
        sec: i64,
        nsec: i64,
    }
    extern "C" {
        fn clock_gettime(clock: i32, ts: *mut Timespec) -> i32;
    }
    let mut ts = Timespec { sec: 0, nsec: 0 };
    // 2 = CLOCK_PROCESS_CPUTIME_ID
    let rc = unsafe { clock_gettime(2, &mut ts) };
    assert_eq!(rc, 0, "clock_gettime(CLOCK_PROCESS_CPUTIME_ID) failed");
    ts.sec as u64 * 1_000_000_000 + ts.nsec as u64
}

struct Counting;
static ALLOCS: AtomicU64 = AtomicU64::new(0);
static ALLOC_BYTES: AtomicU64 = AtomicU64::new(0);
static REALLOC_MOVED: AtomicU64 = AtomicU64::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        ALLOCS.fetch_add(1, Relaxed);
        ALLOC_BYTES.fetch_add(l.size() as u64, Relaxed);
        System.alloc(l)
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        System.dealloc(p, l)
    }
    unsafe fn alloc_zeroed(&self, l: Layout) -> *mut u8 {
        ALLOCS.fetch_add(1, Relaxed);
        ALLOC_BYTES.fetch_add(l.size() as u64, Relaxed);
        System.alloc_zeroed(l)
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, new: usize) -> *mut u8 {
        let q = System.realloc(p, l, new);
        if q != p {
            // The allocator moved the block: it copied the old contents.
            REALLOC_MOVED.fetch_add(l.size().min(new) as u64, Relaxed);
        }
        ALLOC_BYTES.fetch_add(new.saturating_sub(l.size()) as u64, Relaxed);
        q
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

fn counters() -> [u64; 3] {
    [
        ALLOCS.load(Relaxed),
        ALLOC_BYTES.load(Relaxed),
        REALLOC_MOVED.load(Relaxed),
    ]
}

const CONFIG: &str = r#"{
  "plugins": [
    {"type": "approx-prefix-cache-producer", "parameters": {"blockSizeTokens": 64}},
    {"type": "inflight-load-producer"},
    {"type": "prefix-cache-affinity-filter", "parameters": {"affinityThreshold": 0.8, "maxTTFTPenaltyMs": 18000, "peakPrefillThroughput": 15928}},
    {"type": "token-load-scorer"},
    {"type": "max-score-picker"}
  ],
  "schedulingProfiles": [{"name": "default", "plugins": [
    {"pluginRef": "prefix-cache-affinity-filter"}, {"pluginRef": "token-load-scorer"}, {"pluginRef": "max-score-picker"}]}],
  "endpoints": {"static": ["127.0.0.1:8001", "127.0.0.1:8002", "127.0.0.1:8003", "127.0.0.1:8004"]},
  "routing": {"seed": 7}
}"#;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let path = args.get(1).expect("usage: steps BODIES.jsonl [ROUNDS]");
    let rounds: usize = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(7);
    let text = std::fs::read_to_string(path).expect("read bodies");
    let bodies: Vec<&[u8]> = text
        .lines()
        .filter(|l| !l.is_empty())
        .map(str::as_bytes)
        .collect();
    let n = bodies.len() as f64;

    let config = Config::from_json(CONFIG.as_bytes()).expect("config");
    let blocks_cfg = config.prefix.blocks.clone();
    let engine = Engine::new(config);
    let geo = engine.geometry();
    let limits = ParseLimits {
        max_body_bytes: 4 << 20,
    };
    let store = MemoryStore::new();
    // As the collector does in Envoy: the endpoint table written and the
    // state epoch bumped, so the engine keeps its table copies between
    // requests instead of rebuilding them from the static list each time.
    // (Not `collector_init`: creating all 16,384 index shards up front
    // makes node 20's V8 segfault in this program.)
    let members = (1..=4)
        .map(|i| (format!("127.0.0.1:800{i}"), true))
        .collect();
    engine
        .apply_membership(&store, members)
        .expect("endpoint table");
    let mut rng = Rng::new(11);

    let route_all = |store: &MemoryStore, rng: &mut Rng| {
        for b in &bodies {
            let outcome = match engine.facts(ApiKind::ChatCompletions, b) {
                Ok(facts) => engine.route(store, facts, 1_000, rng),
                Err(why) => engine.fail_for(why, Some(ApiKind::ChatCompletions)),
            };
            match outcome {
                Outcome::Routed(r) => {
                    if let Some(t) = &r.ticket {
                        engine.release_prompt(store, t).expect("release");
                        engine.release_rest(store, t, true).expect("release");
                    }
                    black_box(r);
                }
                other => panic!("not routed: {other:?}"),
            }
        }
    };
    route_all(&store, &mut rng); // warm: fill the index

    let reqs: Vec<_> = bodies
        .iter()
        .map(|b| parse_request(ApiKind::ChatCompletions, b, &limits).expect("parse"))
        .collect();
    let hashes: Vec<Vec<u64>> = reqs
        .iter()
        .map(|r| kvroute_core::blocks::prompt_blocks(r, &blocks_cfg).block_hashes)
        .collect();
    let holders: Vec<Holder> = (0..4u16)
        .map(|slot| Holder {
            slot,
            generation: 1,
            insert_counter: 1 << 20,
            capacity_blocks: 0,
        })
        .collect();
    let always = |_: u16, _: u16, _: u32| true;

    let tokens: Vec<u64> = reqs
        .iter()
        .map(|r| kvroute_core::blocks::prompt_blocks(r, &blocks_cfg).prompt_tokens)
        .collect();
    let steps = [
        "copy",
        "parse",
        "hash",
        "lookup",
        "insert",
        "after_hash",
        "route",
    ];
    let mut times: Vec<Vec<f64>> = vec![Vec::new(); steps.len()];
    let mut traffic = [[0u64; 3]; 7];
    for round in 0..rounds {
        for (k, step) in steps.iter().enumerate() {
            // `after_hash`'s facts own their hashes (the route consumes
            // them): copied here, outside the timing and the counts.
            let mut facts: Vec<RequestFacts> = if *step == "after_hash" {
                hashes
                    .iter()
                    .zip(&tokens)
                    .map(|(h, &t)| RequestFacts::blocks(h.clone(), t, Some(16)))
                    .collect()
            } else {
                Vec::new()
            };
            let before = counters();
            let t0 = cpu_ns();
            match *step {
                "copy" => bodies.iter().for_each(|b| drop(black_box(b.to_vec()))),
                "parse" => bodies.iter().for_each(|b| {
                    drop(black_box(parse_request(
                        ApiKind::ChatCompletions,
                        black_box(b),
                        &limits,
                    )))
                }),
                "hash" => reqs.iter().for_each(|r| {
                    drop(black_box(kvroute_core::blocks::prompt_blocks(
                        black_box(r),
                        &blocks_cfg,
                    )))
                }),
                "lookup" => hashes.iter().for_each(|h| {
                    drop(black_box(index::longest_prefixes(
                        &store, &geo, h, &holders,
                    )))
                }),
                "insert" => hashes.iter().for_each(|h| {
                    drop(black_box(index::insert(
                        &store,
                        &geo,
                        h,
                        0,
                        &holders[0],
                        &always,
                    )))
                }),
                "after_hash" => {
                    facts
                        .drain(..)
                        .for_each(|f| match engine.route(&store, f, 1_000, &mut rng) {
                            Outcome::Routed(r) => {
                                if let Some(tk) = &r.ticket {
                                    engine.release_prompt(&store, tk).expect("release");
                                    engine.release_rest(&store, tk, true).expect("release");
                                }
                                black_box(r);
                            }
                            other => panic!("not routed: {other:?}"),
                        })
                }
                _ => route_all(&store, &mut rng),
            }
            let dt = (cpu_ns() - t0) as f64 / n;
            times[k].push(dt);
            if round == 0 {
                let after = counters();
                for i in 0..3 {
                    traffic[k][i] = after[i] - before[i];
                }
            }
        }
    }
    let size = bodies.first().map_or(0, |b| b.len());
    let blocks = hashes.first().map_or(0, Vec::len);
    print!("{{\"body_bytes\":{size},\"blocks\":{blocks},\"bodies\":{},\"rounds\":{rounds},\"steps\":{{", bodies.len());
    for (k, step) in steps.iter().enumerate() {
        let t = &traffic[k];
        print!(
            "{}\"{step}\":{{\"ns\":{:.0},\"allocs\":{:.1},\"alloc_bytes\":{:.0},\"realloc_moved_bytes\":{:.0}}}",
            if k > 0 { "," } else { "" },
            median(times[k].clone()),
            t[0] as f64 / n,
            t[1] as f64 / n,
            t[2] as f64 / n
        );
    }
    println!("}}}}");
}

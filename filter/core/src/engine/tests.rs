use super::*;
use crate::precise::Fallback;
use crate::request::ApiKind;
use crate::scheduling::Rng;
use kvroute_shared_state::load::LoadTable;
use kvroute_shared_state::memory::MemoryStore;
use kvroute_shared_state::LOAD_KEY;

fn config(extra: &str) -> Config {
    let doc = format!(
        r#"{{"endpoints":{{"static":["127.0.0.1:1","127.0.0.1:2","127.0.0.1:3"]}},
            "plugins":[{{"type":"approx-prefix-cache-producer","parameters":{{"blockSizeTokens":16}}}},
                       {{"type":"prefix-cache-affinity-filter","parameters":{{"maxTTFTPenaltyMs":1000,"peakPrefillThroughput":1000}}}},
                       {{"type":"token-load-scorer"}},{{"type":"max-score-picker"}}],
            "schedulingProfiles":[{{"name":"d","plugins":[{{"pluginRef":"prefix-cache-affinity-filter"}},{{"pluginRef":"token-load-scorer"}},{{"pluginRef":"max-score-picker"}}]}}]
            {extra}}}"#
    );
    Config::from_json(doc.as_bytes()).unwrap()
}

fn chat(system: &str, user: &str) -> Vec<u8> {
    serde_json::json!({"model":"m","messages":[{"role":"system","content":system},{"role":"user","content":user}]})
        .to_string()
        .into_bytes()
}

fn routed(o: Outcome) -> Routed {
    match o {
        Outcome::Routed(r) => r,
        other => panic!("expected Routed, got {other:?}"),
    }
}

/// Routes a body as the lifecycle does: its facts, then the one entry.
fn route(
    e: &Engine,
    s: &dyn Store,
    kind: ApiKind,
    body: &[u8],
    now_ms: u64,
    rng: &mut Rng,
) -> Outcome {
    match e.facts(kind, body) {
        Ok(facts) => e.route(s, facts, now_ms, rng),
        Err(why) => e.fail_for(why, Some(kind)),
    }
}

fn primary(r: &Routed) -> &str {
    r.destination.split(',').next().unwrap()
}

fn inflight(e: &Engine, s: &MemoryStore) -> Vec<(u64, u64)> {
    let v: serde_json::Value = serde_json::from_str(&e.state_json(s, 0).unwrap()).unwrap();
    v["endpoints"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| {
            (
                x["inflightTokens"].as_u64().unwrap(),
                x["inflightRequests"].as_u64().unwrap(),
            )
        })
        .collect()
}

#[test]
fn shared_prefix_sticks_and_distinct_prefixes_spread() {
    let e = Engine::new(config(""));
    let s = MemoryStore::new();
    e.collector_init(&s).unwrap();
    let sys = "You are a helpful assistant. ".repeat(40); // ~1160 bytes ≈ 290 tokens
    let mut rng = Rng::new(1);
    let first = routed(route(
        &e,
        &s,
        ApiKind::ChatCompletions,
        &chat(&sys, "q0"),
        0,
        &mut rng,
    ));
    let t = first.ticket.unwrap();
    e.release_rest(&s, &t, false).unwrap();
    for i in 1..10 {
        let r = routed(route(
            &e,
            &s,
            ApiKind::ChatCompletions,
            &chat(&sys, &format!("question {i}")),
            i,
            &mut rng,
        ));
        assert_eq!(
            primary(&r),
            primary(&first),
            "turn {i}: {}",
            r.explanation()
        );
        assert!(
            r.explanation().starts_with("branch=sticky"),
            "{}",
            r.explanation()
        );
        e.release_rest(&s, &r.ticket.unwrap(), false).unwrap();
    }
    // Distinct prefixes while earlier ones are in flight spread out.
    let mut seen = std::collections::BTreeSet::new();
    for i in 0..3 {
        let r = routed(route(
            &e,
            &s,
            ApiKind::ChatCompletions,
            &chat(&format!("{i} other system prompt ").repeat(40), "q"),
            100,
            &mut rng,
        ));
        seen.insert(primary(&r).to_string());
    }
    assert_eq!(seen.len(), 3);
}

#[test]
fn spill_past_tau_and_accounting_returns_to_zero() {
    // τ = 1000 tok/s × 1000 ms = 1000 tokens.
    let e = Engine::new(config(""));
    let s = MemoryStore::new();
    e.collector_init(&s).unwrap();
    let sys = "x".repeat(4 * 16 * 40); // 640 tokens, 40 blocks
    let mut rng = Rng::new(2);
    let mut tickets = vec![];
    let warm = routed(route(
        &e,
        &s,
        ApiKind::ChatCompletions,
        &chat(&sys, "a"),
        0,
        &mut rng,
    ));
    let warm_ep = primary(&warm).to_string();
    tickets.push(warm.ticket.unwrap());
    let mut spilled = false;
    for i in 0..20 {
        // A shared 640-token prefix plus a distinct 100-token question: each
        // warm request charges its ~100 uncached tokens, and the gap to an
        // idle endpoint grows until it passes τ.
        let question = format!("{i:04}").repeat(100);
        let r = routed(route(
            &e,
            &s,
            ApiKind::ChatCompletions,
            &chat(&sys, &question),
            1,
            &mut rng,
        ));
        if primary(&r) != warm_ep {
            assert!(
                r.explanation().starts_with("branch=saturation-release"),
                "{}",
                r.explanation()
            );
            spilled = true;
        }
        // Hold the prompt charge so load builds up.
        tickets.push(r.ticket.unwrap());
        if spilled {
            break;
        }
    }
    assert!(spilled, "never spilled");
    // τ = 1000 tokens over ~100 tokens per request: 740 + 3 × 100 > 1000.
    assert!(
        (4..=6).contains(&tickets.len()),
        "spilled after {} requests",
        tickets.len()
    );
    for t in &tickets {
        e.release_prompt(&s, t).unwrap();
        e.release_rest(&s, t, true).unwrap();
        // A second release is a no-op: counters never go below zero.
        e.release_rest(&s, t, true).unwrap();
    }
    assert!(
        inflight(&e, &s).iter().all(|&(t, r)| t == 0 && r == 0),
        "{:?}",
        inflight(&e, &s)
    );
}

#[test]
fn always_stick_never_spills() {
    let c = config("").clone();
    let mut c = c;
    c.scheduler.filters[0].max_ttft_penalty_ms = 0.0;
    let e = Engine::new(c);
    let s = MemoryStore::new();
    e.collector_init(&s).unwrap();
    let sys = "y".repeat(4 * 16 * 40);
    let mut rng = Rng::new(3);
    let first = primary(&routed(route(
        &e,
        &s,
        ApiKind::ChatCompletions,
        &chat(&sys, "a"),
        0,
        &mut rng,
    )))
    .to_string();
    for i in 0..200 {
        let r = routed(route(
            &e,
            &s,
            ApiKind::ChatCompletions,
            &chat(&sys, &format!("b{i}")),
            1,
            &mut rng,
        ));
        assert_eq!(primary(&r), first);
    }
}

#[test]
fn failure_modes() {
    let s = MemoryStore::new();
    let open = Engine::new(config(""));
    assert!(matches!(
        route(
            &open,
            &s,
            ApiKind::ChatCompletions,
            b"{nope",
            0,
            &mut Rng::new(1)
        ),
        Outcome::FailOpen(Unrouted::BadBody(_))
    ));
    let closed = Engine::new(config(r#","routing":{"failureMode":"closed"}"#));
    match route(
        &closed,
        &s,
        ApiKind::ChatCompletions,
        b"{nope",
        0,
        &mut Rng::new(1),
    ) {
        Outcome::Reject {
            status: 400, body, ..
        } => {
            let v: serde_json::Value = serde_json::from_str(&body).unwrap();
            assert_eq!(v["error"]["type"], "invalid_request_error");
        }
        o => panic!("{o:?}"),
    }
    // fromCluster with no table yet: no endpoints.
    let c = Config::from_json(
        br#"{"endpoints":{"fromCluster":{"cluster":"vllm"}},"routing":{"failureMode":"closed"}}"#,
    )
    .unwrap();
    let e = Engine::new(c);
    assert!(matches!(
        route(
            &e,
            &s,
            ApiKind::ChatCompletions,
            &chat("s", "u"),
            0,
            &mut Rng::new(1)
        ),
        Outcome::Reject { status: 503, .. }
    ));
    // The rejection comes from `route` already in the shape of the body's
    // API: Anthropic's for a Messages request (flow control's dispatch
    // routes from the facts alone), OpenAI's when the API is not known.
    let messages = br#"{"model":"m","max_tokens":8,"messages":[{"role":"user","content":"u"}]}"#;
    let facts = e.facts(ApiKind::Messages, messages).unwrap();
    assert_eq!(facts.api, Some(ApiKind::Messages));
    match e.route(&s, facts, 0, &mut Rng::new(1)) {
        Outcome::Reject {
            status: 503, body, ..
        } => {
            let v: serde_json::Value = serde_json::from_str(&body).unwrap();
            assert_eq!(v["type"], "error", "{v}");
            assert_eq!(v["error"]["type"], "overloaded_error", "{v}");
        }
        o => panic!("{o:?}"),
    }
    match e.route(&s, e.load_only_facts(10), 0, &mut Rng::new(1)) {
        Outcome::Reject {
            status: 503, body, ..
        } => {
            let v: serde_json::Value = serde_json::from_str(&body).unwrap();
            assert_eq!(v["error"]["type"], "service_unavailable", "{v}");
        }
        o => panic!("{o:?}"),
    }
}

#[test]
fn collector_membership_metrics_and_reaping() {
    let c = Config::from_json(
        br#"{"endpoints":{"fromCluster":{"cluster":"vllm"}},"collector":{"reapAfterMs":2000}}"#,
    )
    .unwrap();
    let e = Engine::new(c);
    let s = MemoryStore::new();
    e.collector_init(&s).unwrap();
    let admin = br#"{"cluster_statuses":[{"name":"vllm","host_statuses":[
        {"address":{"socket_address":{"address":"127.0.0.1","port_value":7001}},"health_status":{"eds_health_status":"HEALTHY"}},
        {"address":{"socket_address":{"address":"127.0.0.1","port_value":7002}},"health_status":{"eds_health_status":"HEALTHY"}}]}]}"#;
    assert_eq!(e.apply_admin_clusters(&s, admin), Ok(true));
    assert_eq!(e.apply_admin_clusters(&s, admin), Ok(false));
    let mut rng = Rng::new(4);
    let r = routed(route(
        &e,
        &s,
        ApiKind::Completions,
        br#"{"model":"m","prompt":"hello world"}"#,
        10,
        &mut rng,
    ));
    let t = r.ticket.unwrap();
    // Metrics: good, then garbage keeps the old values.
    let text = include_bytes!("../../../../testdata/vllm/metrics-vllm-0.32-cpu.txt");
    assert_eq!(e.record_metrics(&s, 0, 1, Ok(text), 100).unwrap(), None);
    assert!(e
        .record_metrics(&s, 0, 1, Ok(b"garbage"), 200)
        .unwrap()
        .is_some());
    e.record_metrics(&s, 1, 1, Err(()), 200).unwrap();
    let v: serde_json::Value = serde_json::from_str(&e.state_json(&s, 300).unwrap()).unwrap();
    assert_eq!(v["endpoints"][0]["metrics"]["blockSize"], 32);
    assert_eq!(v["endpoints"][0]["metrics"]["failures"], 1);
    assert_eq!(v["endpoints"][0]["metrics"]["ageMs"], 200);
    assert!(v["endpoints"][1]["metrics"].is_null());
    // Nothing to reap yet; an orphan past the bound is reaped once.
    assert_eq!(e.reap(&s, 1000).unwrap(), 0);
    assert_eq!(e.reap(&s, 10 + 1000 + 2000 + 1000).unwrap(), 1);
    assert_eq!(e.reap(&s, 100_000).unwrap(), 0);
    e.release_rest(&s, &t, false).unwrap();
    assert!(inflight(&e, &s).iter().all(|&(t, r)| t == 0 && r == 0));
    // A member leaves: it is no longer routed to.
    let one = br#"{"cluster_statuses":[{"name":"vllm","host_statuses":[
        {"address":{"socket_address":{"address":"127.0.0.1","port_value":7002}}}]}]}"#;
    assert_eq!(e.apply_admin_clusters(&s, one), Ok(true));
    for i in 0..10 {
        let r = routed(route(
            &e,
            &s,
            ApiKind::Completions,
            format!(r#"{{"model":"m","prompt":"p{i}"}}"#).as_bytes(),
            20,
            &mut rng,
        ));
        assert_eq!(r.destination, "127.0.0.1:7002");
    }
}

#[test]
fn index_stays_under_budget() {
    let e = Engine::new(config(r#","sharedState":{"indexBudgetBytes":262144}"#));
    let s = MemoryStore::new();
    e.collector_init(&s).unwrap();
    let mut rng = Rng::new(5);
    for i in 0..5_000u64 {
        let body =
            serde_json::json!({"model":"m","prompt": format!("{i:08} ").repeat(64)}).to_string();
        let r = routed(route(
            &e,
            &s,
            ApiKind::Completions,
            body.as_bytes(),
            i,
            &mut rng,
        ));
        e.release_rest(&s, &r.ticket.unwrap(), false).unwrap();
    }
    assert!(s.bytes_with_prefix("kvroute/ix/") <= 262_144);
    assert!(inflight(&e, &s).iter().all(|&(t, r)| t == 0 && r == 0));
}

#[test]
fn conversation_turns_stay_warm_with_known_capacity() {
    // Regression: the chosen endpoint's own new entries were judged with its
    // pre-charge insert counter, looked evicted, and were overwritten by
    // later blocks of the same request.
    let c = config(r#","sharedState":{"indexBudgetBytes":65536}"#);
    let mut c = c;
    c.prefix.auto_tune = false;
    c.prefix.lru_capacity_per_server = 4096;
    let e = Engine::new(c);
    let s = MemoryStore::new();
    e.collector_init(&s).unwrap();
    let mut rng = Rng::new(9);
    let sys = "You review pull requests for a large Rust codebase. ".repeat(60);
    let mut messages = vec![serde_json::json!({"role":"system","content":sys})];
    let mut first: Option<String> = None;
    for turn in 0..6 {
        messages.push(serde_json::json!({"role":"user","content":format!("turn {turn}: {}", "please look at this diff ".repeat(20))}));
        let body = serde_json::json!({"model":"m","messages":messages}).to_string();
        let r = routed(route(
            &e,
            &s,
            ApiKind::ChatCompletions,
            body.as_bytes(),
            turn,
            &mut rng,
        ));
        e.release_rest(&s, &r.ticket.unwrap(), false).unwrap();
        match &first {
            None => first = Some(primary(&r).to_string()),
            Some(f) => {
                assert_eq!(primary(&r), f, "turn {turn}: {}", r.explanation());
                let affinity: f64 = r
                    .explanation()
                    .split(';')
                    .find_map(|kv| kv.strip_prefix("affinity="))
                    .unwrap()
                    .parse()
                    .unwrap();
                assert!(affinity > 0.8, "turn {turn}: {}", r.explanation());
            }
        }
        messages.push(serde_json::json!({"role":"assistant","content":"looks good ".repeat(30)}));
    }
}

/// A store that counts sets per key prefix and can interfere once: before
/// the first set of `LOAD_KEY`, it writes the load table itself (as another
/// worker charging at that instant would), so that set loses its CAS.
struct Probe {
    inner: MemoryStore,
    index_sets: std::cell::Cell<u32>,
    gets: std::cell::Cell<u32>,
    interfere: std::cell::Cell<bool>,
}

impl Probe {
    fn new() -> Probe {
        Probe {
            inner: MemoryStore::new(),
            index_sets: 0.into(),
            gets: 0.into(),
            interfere: false.into(),
        }
    }
}

impl Store for Probe {
    fn get(&self, key: &str) -> Result<Option<(Vec<u8>, u32)>, StoreError> {
        self.gets.set(self.gets.get() + 1);
        self.inner.get(key)
    }
    fn set(&self, key: &str, value: &[u8], cas: u32) -> Result<(), StoreError> {
        if key.starts_with("kvroute/ix/") {
            self.index_sets.set(self.index_sets.get() + 1);
        }
        if key == LOAD_KEY && self.interfere.replace(false) {
            let (bytes, now) = self.inner.get(LOAD_KEY)?.unwrap();
            let mut t = LoadTable::decode(Some(&bytes));
            let (eps, _) = self.inner.get(ENDPOINTS_KEY)?.unwrap();
            let ep = &EndpointTable::decode(&eps).unwrap().endpoints[2];
            t.charge(ep.slot, ep.generation, 0, 1000, 7, 0, 0, 0)
                .unwrap();
            self.inner.set(LOAD_KEY, &t.encode(), now)?;
        }
        self.inner.set(key, value, cas)
    }
}

#[test]
fn a_charge_that_loses_its_cas_after_the_snapshot_retries_and_lands() {
    let e = Engine::new(config(""));
    let s = Probe::new();
    e.collector_init(&s).unwrap();
    let mut rng = Rng::new(3);
    s.interfere.set(true);
    let r = routed(route(
        &e,
        &s,
        ApiKind::ChatCompletions,
        &chat("a b c", "q"),
        0,
        &mut rng,
    ));
    assert!(!s.interfere.get(), "the interference did not happen");
    assert!(r.ticket.is_some());
    let load = inflight(&e, &s.inner);
    // The other worker's charge (7 tokens on endpoint 3) and ours: none lost.
    assert_eq!(load.iter().map(|l| l.1).sum::<u64>(), 2, "{load:?}");
    assert!(load[2].0 >= 7, "{load:?}");
}

#[test]
fn tables_are_cached_per_engine_until_the_collector_changes_them() {
    let collector = Engine::new(config(""));
    let worker = Engine::new(config(""));
    let s = Probe::new();
    collector.collector_init(&s).unwrap();
    let mut rng = Rng::new(4);
    let body = chat(&"tenant one system prompt ".repeat(20), "q");
    routed(route(
        &worker,
        &s,
        ApiKind::ChatCompletions,
        &body,
        0,
        &mut rng,
    ));
    // Warm: a decision reads the load table and the index, not the
    // endpoint or metrics tables.
    let before = s.gets.get();
    let r = routed(route(
        &worker,
        &s,
        ApiKind::ChatCompletions,
        &body,
        0,
        &mut rng,
    ));
    let warm_gets = s.gets.get() - before;
    let index_reads = r.decision.report.len() as u32; // ≤ one shard read per warm holder here
    assert!(
        warm_gets <= 1 + index_reads,
        "{warm_gets} gets for a warm decision"
    );
    // The collector drops two endpoints: the next decision sees it at once.
    collector
        .apply_membership(&s, vec![("127.0.0.1:3".into(), true)])
        .unwrap();
    for i in 0..5 {
        let r = routed(route(
            &worker,
            &s,
            ApiKind::ChatCompletions,
            &chat("x", &i.to_string()),
            0,
            &mut rng,
        ));
        assert_eq!(r.destination, "127.0.0.1:3");
    }
    // And unhealthy endpoints leave the set too.
    collector
        .apply_membership(
            &s,
            vec![("127.0.0.1:3".into(), false), ("127.0.0.1:4".into(), true)],
        )
        .unwrap();
    let r = routed(route(
        &worker,
        &s,
        ApiKind::ChatCompletions,
        &body,
        0,
        &mut rng,
    ));
    assert_eq!(r.destination, "127.0.0.1:4");
}

#[test]
fn a_sticky_request_does_not_rewrite_the_groups_it_already_holds() {
    let doc = r#"{"endpoints":{"static":["127.0.0.1:1"]},
        "plugins":[{"type":"approx-prefix-cache-producer","parameters":{"blockSizeTokens":16}},
                   {"type":"prefix-cache-affinity-filter","parameters":{"maxTTFTPenaltyMs":100000,"peakPrefillThroughput":1000}},
                   {"type":"token-load-scorer"},{"type":"max-score-picker"}],
        "schedulingProfiles":[{"name":"d","plugins":[{"pluginRef":"prefix-cache-affinity-filter"},{"pluginRef":"token-load-scorer"},{"pluginRef":"max-score-picker"}]}]}"#;
    let e = Engine::new(Config::from_json(doc.as_bytes()).unwrap());
    let s = Probe::new();
    e.collector_init(&s).unwrap();
    let mut rng = Rng::new(5);
    let mut route = |body: &[u8]| {
        let before = s.index_sets.get();
        let r = routed(route(&e, &s, ApiKind::ChatCompletions, body, 0, &mut rng));
        e.release_rest(&s, &r.ticket.unwrap(), false).unwrap();
        (r, s.index_sets.get() - before)
    };
    // 16-token blocks of 64 bytes: each prompt is 7–8 KiB, at least 109
    // blocks, several groups.
    let groups = (109 / kvroute_shared_state::index::GROUP_BLOCKS) as u32;
    let a = chat(&"shared system prompt words ".repeat(300), "same question");
    let (_, writes) = route(&a);
    assert!(writes >= groups - 1, "{writes}");
    // Another prompt advances the endpoint's insert counter, so rewriting
    // A's entries would change them.
    let (_, writes) = route(&chat(&"another tenant entirely ".repeat(300), "q"));
    assert!(writes >= groups - 1, "{writes}");
    let (r, writes) = route(&a);
    assert!(
        r.explanation().contains("affinity=1.000"),
        "{}",
        r.explanation()
    );
    // Nothing is written again: the endpoint holds the whole prompt.
    assert_eq!(writes, 0, "index writes for a held prompt");
    // And the prefix is still found in full afterwards.
    let (r, _) = route(&a);
    assert!(
        r.explanation().contains("affinity=1.000"),
        "{}",
        r.explanation()
    );
}

const PRECISE_DOC: &str = r#"{"endpoints":{"static":["127.0.0.1:1","127.0.0.1:2","127.0.0.1:3"]},
    "plugins":[{"type":"token-producer","parameters":{"modelName":"m","udsTokenizerConfig":{"socketFile":"/x"}}},
               {"type":"precise-prefix-cache-producer","parameters":{"tokenProcessorConfig":{"blockSizeTokens":4,"hashSeed":"0"}}},
               {"type":"prefix-cache-scorer","parameters":{"prefixMatchInfoProducerName":"precise-prefix-cache-producer"}},
               {"type":"max-score-picker"}],
    "schedulingProfiles":[{"name":"d","plugins":[{"pluginRef":"prefix-cache-scorer"},{"pluginRef":"max-score-picker"}]}],
    "kvEvents":{"enabled":true,"staleMs":5000}}"#;

/// Each endpoint's relay snapshot, applied as the collector applies it.
fn held_snapshots(e: &Engine, s: &MemoryStore, held: &[Vec<u64>], now_ms: u64) {
    use crate::reports::relay::Ask;
    let table = e.endpoint_table(s).unwrap();
    for (ep, blocks) in table.endpoints.iter().zip(held) {
        let body = serde_json::json!({"epoch": 7, "seq": 1, "complete": true, "blocks": blocks});
        e.apply_relay_answer(
            s,
            ep.slot,
            ep.generation,
            Ask::Snapshot,
            body.to_string().as_bytes(),
            now_ms,
        )
        .unwrap();
    }
}

#[test]
fn precise_mode_routes_on_the_held_blocks_when_every_view_is_fresh() {
    let e = Engine::new(Config::from_json(PRECISE_DOC.as_bytes()).unwrap());
    let s = MemoryStore::new();
    e.collector_init(&s).unwrap();
    let p = e.config.precise.clone().unwrap();
    let ids: Vec<u32> = (100..117).collect(); // 4 full blocks of 4, and one token
    let vllm = p.hasher.block_hashes_u64(&ids, 4, None, 100);
    assert_eq!(vllm.len(), 4);
    let body = serde_json::json!({"model": "m", "prompt": ids}).to_string();
    // Endpoint 2 holds the first 3 blocks, endpoint 1 the first one: 2 wins.
    held_snapshots(
        &e,
        &s,
        &[vec![vllm[0], 999], vec![vllm[0], vllm[1], vllm[2]], vec![]],
        1000,
    );
    let mut rng = Rng::new(1);
    let r = routed(route(
        &e,
        &s,
        ApiKind::Completions,
        body.as_bytes(),
        1500,
        &mut rng,
    ));
    assert_eq!(r.precise, Some(PreciseUse::Matched { blocks: 4 }));
    assert_eq!(primary(&r), "127.0.0.1:2");
    // Uncached tokens in vLLM's terms: 17 − 3 × 4.
    assert_eq!(r.uncached_tokens, 5);
    e.release_rest(&s, &r.ticket.unwrap(), false).unwrap();
    // The held view moves: now endpoint 3 holds all 4.
    held_snapshots(&e, &s, &[vec![], vec![], vllm.clone()], 1600);
    let r = routed(route(
        &e,
        &s,
        ApiKind::Completions,
        body.as_bytes(),
        1700,
        &mut rng,
    ));
    assert_eq!(primary(&r), "127.0.0.1:3");
    assert_eq!(r.uncached_tokens, 1);
    e.release_rest(&s, &r.ticket.unwrap(), false).unwrap();
    // Past staleMs without a good poll: every request falls back.
    let r = routed(route(
        &e,
        &s,
        ApiKind::Completions,
        body.as_bytes(),
        1600 + 5001,
        &mut rng,
    ));
    assert_eq!(
        r.precise,
        Some(PreciseUse::Fallback {
            why: Fallback::NoHeldView,
            blocks: 4
        })
    );
}

#[test]
fn precise_mode_computes_vllm_hashes_and_falls_back_counted_by_reason() {
    let e = Engine::new(Config::from_json(PRECISE_DOC.as_bytes()).unwrap());
    let s = MemoryStore::new();
    e.collector_init(&s).unwrap();
    let mut rng = Rng::new(1);
    // Token IDs: hashed precisely (2 full blocks of 4); no relay has
    // answered yet, so they are routed on the approximate index.
    let ids = br#"{"model":"m","prompt":[1,2,3,4,5,6,7,8,9]}"#;
    let r = routed(route(&e, &s, ApiKind::Completions, ids, 0, &mut rng));
    assert_eq!(
        r.precise,
        Some(PreciseUse::Fallback {
            why: Fallback::NoHeldView,
            blocks: 2
        })
    );
    // Only two of three views fresh: still the approximate index.
    held_snapshots(&e, &s, &[vec![1], vec![2]], 10);
    let r = routed(route(&e, &s, ApiKind::Completions, ids, 20, &mut rng));
    assert!(matches!(
        r.precise,
        Some(PreciseUse::Fallback {
            why: Fallback::NoHeldView,
            ..
        })
    ));
    // Text with the UDS tokenizer (not loadable in a VM): no tokenizer.
    let text = br#"{"model":"m","prompt":"hello"}"#;
    let r = routed(route(&e, &s, ApiKind::Completions, text, 0, &mut rng));
    assert_eq!(
        r.precise,
        Some(PreciseUse::Fallback {
            why: Fallback::NoTokenizer,
            blocks: 0
        })
    );
    // Approximate mode: no precise part at all.
    let a = Engine::new(config(""));
    let s2 = MemoryStore::new();
    a.collector_init(&s2).unwrap();
    let r = routed(route(&a, &s2, ApiKind::Completions, ids, 0, &mut rng));
    assert_eq!(r.precise, None);
}

/// `/metrics` with the two prefill histograms' sums (tokens, seconds, requests).
fn prefill_metrics(tokens: f64, seconds: f64, requests: f64) -> Vec<u8> {
    format!(
        "vllm:num_requests_running{{engine=\"0\"}} 0\n\
         vllm:num_requests_waiting{{engine=\"0\"}} 0\n\
         vllm:request_prefill_time_seconds_sum{{engine=\"0\"}} {seconds}\n\
         vllm:request_prefill_time_seconds_count{{engine=\"0\"}} {requests}\n\
         vllm:request_prefill_kv_computed_tokens_sum{{engine=\"0\"}} {tokens}\n\
         vllm:request_prefill_kv_computed_tokens_count{{engine=\"0\"}} {requests}\n"
    )
    .into_bytes()
}

#[test]
fn online_prefill_estimate_reaches_the_gate_while_fresh() {
    let doc = serde_json::to_string(&serde_json::json!({
        "endpoints": {"static": ["127.0.0.1:1", "127.0.0.1:2"]},
        "plugins": [
            {"type": "prefix-cache-affinity-filter",
             "parameters": {"peakPrefillThroughput": {"auto": true, "initial": 10000}}},
            {"type": "token-load-scorer"}],
        "schedulingProfiles": [{"name": "d", "plugins": [
            {"pluginRef": "prefix-cache-affinity-filter"}, {"pluginRef": "token-load-scorer"}]}],
        "collector": {"metricsStaleAfterMs": 3000}
    }))
    .unwrap();
    let e = Engine::new(Config::from_json(doc.as_bytes()).unwrap());
    let s = MemoryStore::new();
    e.collector_init(&s).unwrap();
    let table = e.endpoint_table(&s).unwrap();
    let ep = &table.endpoints[0];
    let (slot, generation) = (ep.slot, ep.generation);
    // A baseline, then 8000 computed tokens in 0.5 s of prefill.
    e.record_metrics(
        &s,
        slot,
        generation,
        Ok(&prefill_metrics(50.0, 0.1, 1.0)),
        1000,
    )
    .unwrap();
    e.record_metrics(
        &s,
        slot,
        generation,
        Ok(&prefill_metrics(8050.0, 0.6, 3.0)),
        2000,
    )
    .unwrap();
    let snap = e
        .snapshot(&s, &RequestFacts::blocks(vec![], 10, None), 2500)
        .unwrap()
        .unwrap();
    let rates: Vec<_> = snap
        .candidates
        .iter()
        .map(|c| c.prefill_tokens_per_s)
        .collect();
    assert_eq!(rates, vec![Some(16_000.0), None]);
    let v: serde_json::Value = serde_json::from_str(&e.state_json(&s, 2500).unwrap()).unwrap();
    assert_eq!(v["endpoints"][0]["metrics"]["prefillTokensPerS"], 16_000.0);
    assert_eq!(v["endpoints"][0]["metrics"]["prefillSamples"], 1);
    assert_eq!(v["endpoints"][0]["gatePrefillTokensPerS"], 16_000.0);
    assert_eq!(v["endpoints"][1]["gatePrefillTokensPerS"], 10_000.0);
    // Polls fail from here: once the metrics are stale the gate falls back
    // to the configured value; the estimate itself is kept for later.
    e.record_metrics(&s, slot, generation, Err(()), 4000)
        .unwrap();
    let snap = e
        .snapshot(&s, &RequestFacts::blocks(vec![], 10, None), 5001)
        .unwrap()
        .unwrap();
    assert_eq!(snap.candidates[0].prefill_tokens_per_s, None);
    let v: serde_json::Value = serde_json::from_str(&e.state_json(&s, 5001).unwrap()).unwrap();
    assert_eq!(v["endpoints"][0]["gatePrefillTokensPerS"], 10_000.0);
    assert_eq!(v["endpoints"][0]["metrics"]["prefillTokensPerS"], 16_000.0);
    assert_eq!(v["endpoints"][0]["metrics"]["fresh"], false);
}

fn prefix_tie_config(endpoints: &str) -> Config {
    let doc = format!(
        r#"{{"endpoints":{{"static":[{endpoints}]}},
            "plugins":[{{"type":"approx-prefix-cache-producer","parameters":{{"blockSizeTokens":16}}}},
                       {{"type":"active-request-scorer"}},{{"type":"max-score-picker","parameters":{{"tieBreak":"prefix"}}}}],
            "schedulingProfiles":[{{"name":"d","plugins":[{{"pluginRef":"active-request-scorer"}},{{"pluginRef":"max-score-picker"}}]}}]}}"#
    );
    Config::from_json(doc.as_bytes()).unwrap()
}

/// Issue 17 part 5: two gateway replicas (two stores, different RNG seeds,
/// endpoints listed in different orders so their slots differ) place the
/// same cold prompts on the same endpoints.
#[test]
fn prefix_tie_break_places_cold_prompts_alike_in_two_replicas() {
    let a = Engine::new(prefix_tie_config(
        r#""127.0.0.1:1","127.0.0.1:2","127.0.0.1:3","127.0.0.1:4""#,
    ));
    let b = Engine::new(prefix_tie_config(
        r#""127.0.0.1:4","127.0.0.1:3","127.0.0.1:2","127.0.0.1:1""#,
    ));
    let (sa, sb) = (MemoryStore::new(), MemoryStore::new());
    a.collector_init(&sa).unwrap();
    b.collector_init(&sb).unwrap();
    let (mut ra, mut rb) = (Rng::new(1), Rng::new(987_654));
    let sys = "Shared system prompt for every session. ".repeat(30);
    let mut used = std::collections::BTreeMap::new();
    for i in 0..40 {
        let body = chat(
            &sys,
            &format!("session {i}: {}", "private context ".repeat(20)),
        );
        let pa = routed(route(&a, &sa, ApiKind::ChatCompletions, &body, i, &mut ra));
        let pb = routed(route(&b, &sb, ApiKind::ChatCompletions, &body, i, &mut rb));
        assert_eq!(primary(&pa), primary(&pb), "session {i}");
        *used.entry(primary(&pa).to_string()).or_insert(0) += 1;
        // Finished before the next arrives: every endpoint has no request
        // in flight, so each placement is a tie on the request-count score.
        a.release_rest(&sa, &pa.ticket.unwrap(), false).unwrap();
        b.release_rest(&sb, &pb.ticket.unwrap(), false).unwrap();
    }
    // Sessions share only the system prompt, which the fleet holds: the tie
    // key is their first private block, so they still spread.
    assert_eq!(used.len(), 4, "{used:?}");
    assert!(used.values().all(|&n| n >= 4), "{used:?}");
}

/// Without `tieBreak`, llm-d's random tie break is kept: replicas with
/// different seeds disagree on some cold placements.
#[test]
fn random_tie_break_is_the_llm_d_default() {
    let mk = || {
        let mut c = prefix_tie_config(r#""127.0.0.1:1","127.0.0.1:2","127.0.0.1:3""#);
        c.scheduler.picker =
            crate::scheduling::Picker::MaxScore(crate::scheduling::max_score::TieBreak::Random);
        Engine::new(c)
    };
    let (a, b) = (mk(), mk());
    let (sa, sb) = (MemoryStore::new(), MemoryStore::new());
    a.collector_init(&sa).unwrap();
    b.collector_init(&sb).unwrap();
    let (mut ra, mut rb) = (Rng::new(1), Rng::new(2));
    let mut differ = 0;
    for i in 0..30 {
        let body = chat(&format!("prompt {i} ").repeat(30), "q");
        let pa = routed(route(&a, &sa, ApiKind::ChatCompletions, &body, i, &mut ra));
        let pb = routed(route(&b, &sb, ApiKind::ChatCompletions, &body, i, &mut rb));
        differ += usize::from(primary(&pa) != primary(&pb));
        a.release_rest(&sa, &pa.ticket.unwrap(), false).unwrap();
        b.release_rest(&sb, &pb.ticket.unwrap(), false).unwrap();
    }
    assert!(differ > 5, "{differ}");
}

/// The shipped `kvroute-default` plugin set over `endpoints` static
/// addresses, 16-token blocks so short test prompts span several blocks.
fn default_profile(endpoints: &str) -> Config {
    let mut v: serde_json::Value =
        serde_json::from_slice(include_bytes!("../../../../envoy/kvroute-config.json")).unwrap();
    v["endpoints"] = serde_json::from_str(&format!(r#"{{"static":[{endpoints}]}}"#)).unwrap();
    v["plugins"][0]["parameters"]["blockSizeTokens"] = 16.into();
    Config::from_json(v.to_string().as_bytes()).unwrap()
}

const THREE: &str = r#""127.0.0.1:1","127.0.0.1:2","127.0.0.1:3""#;

/// Issue 15 part 2: with nothing in flight (every server looks idle between
/// turns), new sessions rotate over the fleet by the cache each endpoint
/// has been given, not by a coin: 30 sessions on 3 endpoints land within
/// one of a third each, and the placements are the same whatever the RNG
/// seed. (The endpoint that holds the shared system prompt is given fewer
/// new blocks per session, so it may take one more.)
#[test]
fn cold_sessions_balance_the_fleets_cache() {
    let mut placements = vec![];
    for seed in [1, 2, 3] {
        let e = Engine::new(default_profile(THREE));
        let s = MemoryStore::new();
        e.collector_init(&s).unwrap();
        let mut rng = Rng::new(seed);
        let sys = "Shared system prompt. ".repeat(8);
        let mut used = std::collections::BTreeMap::new();
        let mut order = vec![];
        for i in 0..30 {
            // Equal-length private contexts: the same number of new blocks.
            let body = chat(&sys, &format!("session {i:03}: {}", "context ".repeat(60)));
            let r = routed(route(&e, &s, ApiKind::ChatCompletions, &body, i, &mut rng));
            *used.entry(primary(&r).to_string()).or_insert(0) += 1;
            order.push(primary(&r).to_string());
            e.release_rest(&s, &r.ticket.unwrap(), false).unwrap();
        }
        // Rotation: the first three sessions take the three endpoints.
        let first: std::collections::BTreeSet<_> = order[..3].iter().collect();
        assert_eq!(first.len(), 3, "seed {seed}: {order:?}");
        let n: Vec<i32> = used.values().copied().collect();
        assert_eq!(n.len(), 3, "seed {seed}: {used:?}");
        assert!(
            n.iter().all(|&k| (9..=11).contains(&k)),
            "seed {seed}: {used:?}"
        );
        placements.push(order);
    }
    assert!(placements.windows(2).all(|w| w[0] == w[1]));
}

/// The same balance under llm-d's matched profile is a coin toss: the
/// random tie break leaves some endpoint well off a third.
#[test]
fn llm_d_matched_cold_placement_is_not_balanced() {
    let mut worst = 0;
    for seed in [1, 2, 3] {
        let e = Engine::new(config(""));
        let s = MemoryStore::new();
        e.collector_init(&s).unwrap();
        let mut rng = Rng::new(seed);
        let mut used = std::collections::BTreeMap::new();
        for i in 0..30 {
            let body = chat("sys", &format!("session {i:03}: {}", "context ".repeat(60)));
            let r = routed(route(&e, &s, ApiKind::ChatCompletions, &body, i, &mut rng));
            *used.entry(primary(&r).to_string()).or_insert(0) += 1;
            e.release_rest(&s, &r.ticket.unwrap(), false).unwrap();
        }
        let spread = used.values().max().unwrap() - used.values().min().unwrap_or(&0);
        worst = worst.max(spread);
    }
    assert!(worst >= 3, "{worst}");
}

/// Exact ties are broken by the rendezvous key (deterministic), and two
/// replicas with different seeds and slot orders make the same placements.
#[test]
fn default_profile_places_alike_in_two_replicas() {
    let a = Engine::new(default_profile(THREE));
    let b = Engine::new(default_profile(
        r#""127.0.0.1:3","127.0.0.1:1","127.0.0.1:2""#,
    ));
    let (sa, sb) = (MemoryStore::new(), MemoryStore::new());
    a.collector_init(&sa).unwrap();
    b.collector_init(&sb).unwrap();
    let (mut ra, mut rb) = (Rng::new(5), Rng::new(77));
    for i in 0..20 {
        let body = chat(&format!("tenant {} ", i % 4).repeat(20), &format!("q {i}"));
        let pa = routed(route(&a, &sa, ApiKind::ChatCompletions, &body, i, &mut ra));
        let pb = routed(route(&b, &sb, ApiKind::ChatCompletions, &body, i, &mut rb));
        assert_eq!(primary(&pa), primary(&pb), "request {i}");
        if i % 3 == 0 {
            a.release_rest(&sa, &pa.ticket.unwrap(), false).unwrap();
            b.release_rest(&sb, &pb.ticket.unwrap(), false).unwrap();
        }
    }
}

/// llm-d's burst-prefix-cache-producer idea comes from inserting the index
/// at decision time: identical cold prompts arriving together (none has
/// finished) share one endpoint, so one prefill; a different prompt in the
/// same burst goes elsewhere.
#[test]
fn identical_cold_prompts_in_a_burst_go_together() {
    let e = Engine::new(default_profile(THREE));
    let s = MemoryStore::new();
    e.collector_init(&s).unwrap();
    let mut rng = Rng::new(9);
    let body = chat(&"Burst document. ".repeat(40), "summarise it");
    let first = routed(route(&e, &s, ApiKind::ChatCompletions, &body, 0, &mut rng));
    for i in 1..8 {
        let r = routed(route(&e, &s, ApiKind::ChatCompletions, &body, i, &mut rng));
        assert_eq!(primary(&r), primary(&first), "{}", r.explanation());
        assert!(
            r.explanation().starts_with("branch=sticky"),
            "{}",
            r.explanation()
        );
    }
    let other = routed(route(
        &e,
        &s,
        ApiKind::ChatCompletions,
        &chat(&"Another document. ".repeat(40), "summarise it"),
        9,
        &mut rng,
    ));
    assert_ne!(primary(&other), primary(&first), "{}", other.explanation());
}

/// The held KV charge keeps a decoding request visible after its first
/// token (llm-d's prompt charge is gone by then), and it is all released
/// at the end.
#[test]
fn default_profile_holds_kv_until_the_stream_ends() {
    let e = Engine::new(default_profile(THREE));
    let s = MemoryStore::new();
    e.collector_init(&s).unwrap();
    let mut rng = Rng::new(1);
    let r = routed(route(
        &e,
        &s,
        ApiKind::ChatCompletions,
        &chat(&"x".repeat(640), "q"),
        0,
        &mut rng,
    ));
    let t = r.ticket.unwrap();
    e.release_prompt(&s, &t).unwrap();
    let after_first_token: u64 = inflight(&e, &s).iter().map(|x| x.0).sum();
    assert!(after_first_token >= t.prompt_tokens, "{after_first_token}");
    e.release_rest(&s, &t, true).unwrap();
    assert!(inflight(&e, &s).iter().all(|&x| x == (0, 0)));
}

fn token_metrics(prompt_tokens_total: f64) -> Vec<u8> {
    format!(
        "vllm:num_requests_running{{engine=\"0\"}} 0\n\
         vllm:num_requests_waiting{{engine=\"0\"}} 0\n\
         vllm:cache_config_info{{block_size=\"16\",num_gpu_blocks=\"1000\",engine=\"0\"}} 1\n\
         vllm:prompt_tokens_total{{engine=\"0\",model_name=\"m\"}} {prompt_tokens_total}\n"
    )
    .into_bytes()
}

/// Issue 15 part 3: with `charsPerToken: "auto"` the collector learns the
/// servers' bytes per token (`vllm:prompt_tokens_total` against the bytes
/// routed to each), and text prompts are then counted in real tokens: the
/// charge, the block size the affinity uses and the capacity in index
/// blocks. A fixed `charsPerToken` (or none) keeps the estimate; blocks and
/// hashes never move.
#[test]
fn bytes_per_token_is_learnt_from_the_servers_and_a_fixed_value_overrides_it() {
    let mk = |cpt: serde_json::Value| {
        let mut c = default_profile(r#""127.0.0.1:1""#);
        c.prefix.learn_bytes_per_token = cpt == "auto";
        if let Some(n) = cpt.as_u64() {
            c.prefix.blocks.chars_per_token = n as u32;
        }
        Engine::new(c)
    };
    let body = chat(&"word ".repeat(400), "q"); // ~2 KB of text
    for (cpt, learns) in [
        (serde_json::json!("auto"), true),
        (serde_json::json!(4), false),
    ] {
        let e = mk(cpt.clone());
        let s = MemoryStore::new();
        e.collector_init(&s).unwrap();
        let mut rng = Rng::new(1);
        // The server counts 2 bytes per token: each routed prompt of B
        // bytes shows up as B / 2 tokens at the next poll.
        let mut tokens = 0.0;
        let mut now = 1_000;
        e.record_metrics(&s, 0, 1, Ok(&token_metrics(tokens)), now)
            .unwrap();
        let mut first = None;
        for _ in 0..40 {
            let r = routed(route(
                &e,
                &s,
                ApiKind::ChatCompletions,
                &body,
                now,
                &mut rng,
            ));
            first.get_or_insert(r.uncached_tokens);
            e.release_rest(&s, &r.ticket.unwrap(), false).unwrap();
            let v: serde_json::Value =
                serde_json::from_str(&e.state_json(&s, now).unwrap()).unwrap();
            let bytes = v["endpoints"][0]["routedPromptBytes"].as_u64().unwrap();
            tokens = bytes as f64 / 2.0;
            now += 100;
            e.record_metrics(&s, 0, 1, Ok(&token_metrics(tokens)), now)
                .unwrap();
        }
        let v: serde_json::Value = serde_json::from_str(&e.state_json(&s, now).unwrap()).unwrap();
        let learnt = v["endpoints"][0]["bytesPerToken"].as_f64();
        // The collector learns either way (it is shown); only "auto" uses it.
        assert_eq!(learnt, Some(2.0), "{v}");
        // A new prompt (nothing cached): its charge in tokens.
        let fresh = chat(&"other ".repeat(400), "q");
        let bytes = fresh.len() as f64; // the rendered prompt is a little shorter
        let r = routed(route(
            &e,
            &s,
            ApiKind::ChatCompletions,
            &fresh,
            now,
            &mut rng,
        ));
        let estimate_at_4 = bytes / 4.0;
        if learns {
            assert!(
                r.uncached_tokens as f64 > 1.6 * estimate_at_4,
                "{} tokens, {} at 4 bytes/token",
                r.uncached_tokens,
                estimate_at_4
            );
        } else {
            assert!(
                (r.uncached_tokens as f64) < 1.1 * estimate_at_4,
                "{} tokens, {} at 4 bytes/token",
                r.uncached_tokens,
                estimate_at_4
            );
        }
        assert!(first.unwrap() > 0);
    }
}

fn generation_metrics(generated_sum: f64, finished: f64) -> Vec<u8> {
    format!(
        "vllm:num_requests_running{{engine=\"0\"}} 0\n\
         vllm:num_requests_waiting{{engine=\"0\"}} 0\n\
         vllm:cache_config_info{{block_size=\"16\",num_gpu_blocks=\"1000\",engine=\"0\"}} 1\n\
         vllm:request_generation_tokens_sum{{engine=\"0\",model_name=\"m\"}} {generated_sum}\n\
         vllm:request_generation_tokens_count{{engine=\"0\",model_name=\"m\"}} {finished}\n"
    )
    .into_bytes()
}

/// With `learnOutputTokens` (the default profile) the held output estimate
/// is the servers' mean output per finished request
/// (`vllm:request_generation_tokens` sum over count), capped by the
/// request's `max_tokens`; without it, or before it is learnt, or when the
/// metrics are stale, it is `outputRatio × prompt` as in llm-d.
#[test]
fn output_tokens_are_learnt_from_the_servers() {
    let body = chat(&"word ".repeat(400), "q");
    let capped = String::from_utf8(body.clone())
        .unwrap()
        .replacen('{', r#"{"max_tokens":3000,"#, 1)
        .into_bytes();
    for learn in [true, false] {
        let mut c = default_profile(r#""127.0.0.1:1""#);
        c.scheduler.inflight.learn_output_tokens = learn;
        let stale_after = c.collector.metrics_stale_after_ms;
        let e = Engine::new(c);
        let s = MemoryStore::new();
        e.collector_init(&s).unwrap();
        let mut rng = Rng::new(1);
        // The held estimate of one routed request: inflight tokens are
        // uncached (prefill) + uncached + output (held until the end).
        let held_output = |body: &[u8], now: u64, rng: &mut Rng| {
            let r = routed(route(&e, &s, ApiKind::ChatCompletions, body, now, rng));
            let v: serde_json::Value =
                serde_json::from_str(&e.state_json(&s, now).unwrap()).unwrap();
            let inflight = v["endpoints"][0]["inflightTokens"].as_u64().unwrap();
            e.release_rest(&s, &r.ticket.unwrap(), false).unwrap();
            (inflight - 2 * r.uncached_tokens, r.uncached_tokens)
        };
        let mut now = 1_000;
        let (before, prompt) = held_output(&body, now, &mut rng);
        assert_eq!(before, (prompt as f64 * 1.5).round() as u64);
        // Windows of 4 finished requests writing 6000 tokens each; one
        // request of 1 token and one of 50,000 do not move the median.
        let (mut sum, mut n) = (0.0, 0.0);
        e.record_metrics(&s, 0, 1, Ok(&generation_metrics(sum, n)), now)
            .unwrap();
        for mean in [6000.0, 1.0, 6000.0, 50_000.0, 6000.0] {
            sum += 4.0 * mean;
            n += 4.0;
            now += 100;
            e.record_metrics(&s, 0, 1, Ok(&generation_metrics(sum, n)), now)
                .unwrap();
        }
        let v: serde_json::Value = serde_json::from_str(&e.state_json(&s, now).unwrap()).unwrap();
        // Learnt and shown either way; used only with the parameter.
        assert_eq!(v["endpoints"][0]["outputTokensPerRequest"], 6000.0);
        let (after, _) = held_output(&body, now, &mut rng);
        let (with_cap, _) = held_output(&capped, now, &mut rng);
        let (stale, _) = held_output(&body, now + stale_after + 1, &mut rng);
        if learn {
            assert_eq!(after, 6000);
            assert_eq!(with_cap, 3000);
        } else {
            assert_eq!(after, before);
            assert_eq!(with_cap, 3000.min(before));
        }
        assert_eq!(stale, before, "stale metrics fall back to the ratio");
    }
}

/// Per endpoint: (insert counter, routed prompt bytes, last cold pick).
fn records(s: &MemoryStore) -> Vec<(u64, u64, u64)> {
    let load = LoadTable::decode(
        s.get(kvroute_shared_state::LOAD_KEY)
            .unwrap()
            .as_ref()
            .map(|(b, _)| b.as_slice()),
    );
    load.records
        .iter()
        .map(|r| (r.insert_counter, r.routed_prompt_bytes, r.last_cold_pick))
        .collect()
}

/// Issue 40: a prompt longer than an endpoint's whole cache moves its
/// eviction clock by the capacity at most (the server cannot evict more
/// than it holds), and a rejected request taken back leaves the clock,
/// the routed bytes, the cold stamp and the index as they were.
#[test]
fn a_long_prompt_ages_by_the_capacity_at_most_and_take_back_restores_all() {
    let mut c = default_profile(THREE);
    c.prefix.auto_tune = false;
    c.prefix.lru_capacity_per_server = 64;
    let e = Engine::new(c);
    let s = MemoryStore::new();
    e.collector_init(&s).unwrap();
    let mut rng = Rng::new(3);
    let warm = chat("a warm system prompt. ".repeat(20).as_str(), "hello");
    let w = routed(route(&e, &s, ApiKind::ChatCompletions, &warm, 1, &mut rng));
    e.release_rest(&s, &w.ticket.unwrap(), false).unwrap();
    let before = records(&s);
    let long = chat(&"x".repeat(64 * 64 * 3), "q");
    let r = routed(route(&e, &s, ApiKind::ChatCompletions, &long, 2, &mut rng));
    let after = records(&s);
    let grew: u64 = after
        .iter()
        .zip(before.iter().chain(std::iter::repeat(&(0, 0, 0))))
        .map(|(a, b)| a.0 - b.0)
        .sum();
    assert_eq!(grew, 64, "{after:?} after {before:?}");
    let p = r.provisional.as_ref().unwrap();
    assert_eq!(p.undo.new_blocks, 64);
    e.take_back(&s, &r.ticket.unwrap(), p, false).unwrap();
    let restored = records(&s);
    assert_eq!(
        &restored[..before.len()],
        &before[..],
        "{restored:?} after {before:?}"
    );
    assert!(restored[before.len()..].iter().all(|r| *r == (0, 0, 0)));
    assert!(inflight(&e, &s).iter().all(|&(t, r)| t == 0 && r == 0));
    // The long prompt is cold everywhere again; the warm one still sticks.
    let again = routed(route(&e, &s, ApiKind::ChatCompletions, &long, 3, &mut rng));
    assert!(
        again.explanation().starts_with("branch=no-affinity"),
        "{}",
        again.explanation()
    );
    let w2 = routed(route(&e, &s, ApiKind::ChatCompletions, &warm, 4, &mut rng));
    assert_eq!(primary(&w2), primary(&w), "{}", w2.explanation());
}

/// Issue 40: `n` multiplies the output part of the charge (not the
/// prefill); a completions batch is charged for every prompt.
#[test]
fn n_and_batches_are_charged_for_all_their_work() {
    let e = Engine::new(default_profile(THREE));
    let ticket = |body: &str| {
        let s = MemoryStore::new();
        e.collector_init(&s).unwrap();
        let r = routed(route(
            &e,
            &s,
            ApiKind::Completions,
            body.as_bytes(),
            0,
            &mut Rng::new(1),
        ));
        r.ticket.unwrap()
    };
    let prompt = "a completions prompt ".repeat(40);
    let one = ticket(&format!(
        r#"{{"model":"m","prompt":"{prompt}","max_tokens":50}}"#
    ));
    let four = ticket(&format!(
        r#"{{"model":"m","prompt":"{prompt}","max_tokens":50,"n":4}}"#
    ));
    assert!(one.output_tokens > 0, "{one:?}");
    assert_eq!(four.prompt_tokens, one.prompt_tokens);
    // The output part holds the uncached prompt once and 4 outputs.
    assert_eq!(
        four.output_tokens - one.prompt_tokens,
        4 * (one.output_tokens - one.prompt_tokens),
        "{one:?} {four:?}"
    );
    let batch = ticket(&format!(
        r#"{{"model":"m","prompt":["{prompt}","{prompt}","{prompt}"],"max_tokens":50}}"#
    ));
    assert_eq!(
        batch.prompt_tokens,
        one.prompt_tokens + 2 * (prompt.len() as u64).div_ceil(4)
    );
    assert!(batch.output_tokens > 3 * (one.output_tokens - one.prompt_tokens));
}

#[test]
fn scorer_scores_are_kept_only_when_the_facts_ask_for_them() {
    let e = Engine::new(config(""));
    let s = MemoryStore::new();
    e.collector_init(&s).unwrap();
    let body = chat("system", "question");
    let mut rng = Rng::new(1);
    // The request path: not allocated.
    let facts = e.facts(ApiKind::ChatCompletions, &body).unwrap();
    assert!(!facts.scorer_scores);
    let r = routed(e.route(&s, facts, 0, &mut rng));
    assert!(r.decision.scorer_scores.is_empty());
    // Asked for (the simulator's decision log): one per candidate and scorer.
    let mut facts = e.facts(ApiKind::ChatCompletions, &body).unwrap();
    facts.scorer_scores = true;
    let r = routed(e.route(&s, facts, 1, &mut rng));
    let scorers = e.config.scheduler.scorers.len();
    assert_eq!(r.decision.scorer_scores.len(), 3 * scorers);
    assert!(scorers > 0);
}

/// `tokenizeIn: collector`: a conversation's next turn is routed to the
/// endpoint that holds its earlier turns, on their stored hashes, and the
/// prompt is measured with its new text estimated.
#[cfg(feature = "tokenizer")]
#[test]
fn an_offpath_next_turn_goes_where_its_earlier_turns_are_held() {
    use crate::precise::offpath::{process, Job, Tokenizing};
    use crate::precise::OffPathModel;
    const TINY_JSON: &str =
        include_str!("../../../../testdata/tokenizer/tiny-bpe-4096/tokenizer.json");
    const TINY_CONFIG: &str =
        include_str!("../../../../testdata/tokenizer/tiny-bpe-4096/tokenizer_config.json");
    let doc = PRECISE_DOC.replace(
        r#""udsTokenizerConfig":{"socketFile":"/x"}"#,
        &format!(
            r#""tokenizeIn":"collector","tokenizerJson":{},"tokenizerConfig":{TINY_CONFIG}"#,
            serde_json::to_string(TINY_JSON).unwrap()
        ),
    );
    let e = Engine::new(Config::from_json(doc.as_bytes()).unwrap());
    let s = MemoryStore::new();
    e.collector_init(&s).unwrap();
    let p = e.config.precise.clone().unwrap();
    let m = p.tokenizers[0].offpath.clone().unwrap();
    // The collector's side: load and publish.
    let tok = m.load(TINY_JSON.as_bytes()).unwrap();
    kvroute_shared_state::hashed::put_meta(&s, m.fingerprint, &OffPathModel::meta(&tok)).unwrap();
    let budget = std::cell::RefCell::new(kvroute_shared_state::hashed::Budget::new(
        e.config.shared_state.hashed_prefix_slots,
        e.config.shared_state.hashed_prefix_bytes,
    ));
    let t = Tokenizing {
        tok: &tok,
        fingerprint: m.fingerprint,
        block_size: 4,
        hasher: &p.hasher,
        max_blocks: p.max_blocks,
        budget: &budget,
    };
    let turn = |n: usize| {
        let mut msgs = vec![
            serde_json::json!({"role":"system","content":"you route requests to the server that holds their cache"}),
        ];
        for i in 0..n {
            msgs.push(serde_json::json!({"role":"user","content":format!("question {i}: where is my prefix held today?")}));
            if i + 1 < n {
                msgs.push(serde_json::json!({"role":"assistant","content":format!("answer {i}: on the second server, most likely")}));
            }
        }
        serde_json::json!({"model":"m","messages":msgs}).to_string()
    };
    let mut rng = Rng::new(3);
    // Turn 1: not hashed yet; its job, once processed, stores its prefixes.
    let r = routed(route(
        &e,
        &s,
        ApiKind::ChatCompletions,
        turn(1).as_bytes(),
        1000,
        &mut rng,
    ));
    assert_eq!(
        r.precise,
        Some(PreciseUse::Fallback {
            why: Fallback::NotHashedYet,
            blocks: 0
        })
    );
    let job = Job::decode(&r.tokenize.as_ref().unwrap().job).unwrap();
    assert!(!r.tokenize.as_ref().unwrap().partial);
    process(&job, &t, &s).unwrap();
    e.release_rest(&s, &r.ticket.unwrap(), false).unwrap();
    // Endpoint 3 holds turn 1's prompt blocks.
    let ids = tok.chat_ids(turn(1).as_bytes()).unwrap();
    let held = p.hasher.block_hashes_u64(&ids, 4, None, usize::MAX);
    assert!(held.len() > 8);
    held_snapshots(&e, &s, &[vec![], vec![], held.clone()], 1100);
    // Turn 2: its stored prefix (turn 1 up to the generation prompt's
    // `<s>`) is matched on endpoint 3; its new text is estimated and
    // handed over.
    let r = routed(route(
        &e,
        &s,
        ApiKind::ChatCompletions,
        turn(2).as_bytes(),
        1200,
        &mut rng,
    ));
    assert_eq!(primary(&r), "127.0.0.1:3");
    let tk = r.tokenize.as_ref().unwrap();
    assert!(tk.partial);
    let Some(PreciseUse::Matched { blocks }) = r.precise else {
        panic!("{:?}", r.precise)
    };
    let whole = p.hasher.block_hashes_u64(
        &tok.chat_ids(turn(2).as_bytes()).unwrap(),
        4,
        None,
        usize::MAX,
    );
    assert!(
        blocks as usize + 2 >= held.len() && (blocks as usize) < whole.len(),
        "{blocks} of {}",
        whole.len()
    );
    let job = Job::decode(&tk.job).unwrap();
    assert!(job.base.is_some() && job.text.len() < turn(2).len() / 2);
    process(&job, &t, &s).unwrap();
    e.release_rest(&s, &r.ticket.unwrap(), false).unwrap();
    // Turn 2 again: all of it is known, exactly.
    let r = routed(route(
        &e,
        &s,
        ApiKind::ChatCompletions,
        turn(2).as_bytes(),
        1300,
        &mut rng,
    ));
    assert!(r.tokenize.is_none());
    assert_eq!(
        r.precise,
        Some(PreciseUse::Matched {
            blocks: whole.len() as u32
        })
    );
}

#[test]
fn the_model_header_carries_only_plain_model_names() {
    use super::{model_header_value, MODEL_HEADER_MAX_BYTES};
    for ok in [
        "m",
        "meta-llama/Llama-3.1-8B-Instruct",
        "org/model v2",
        "a:b@c",
    ] {
        assert_eq!(model_header_value(ok), Some(ok));
    }
    let long = "m".repeat(MODEL_HEADER_MAX_BYTES);
    assert_eq!(model_header_value(&long), Some(long.as_str()));
    let too_long = "m".repeat(MODEL_HEADER_MAX_BYTES + 1);
    for bad in [
        "",
        " m",
        "m ",
        "a\nb",
        "a\rb",
        "a\tb",
        "a\u{0}b",
        "modèle",
        too_long.as_str(),
    ] {
        assert_eq!(model_header_value(bad), None, "{bad:?}");
    }
}

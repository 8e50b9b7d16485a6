//! Engine programs: the fuzz input is read as a sequence of operations on
//! one [`Engine`] over a [`MemoryStore`], and the in-flight accounting is
//! checked after each one.
//!
//! Input layout: byte 0 picks one of [`CONFIGS`]; then, until the input
//! ends (at most [`MAX_OPS`] operations), one opcode byte and its operands:
//!
//! | op % 8 | operation | operands |
//! |---|---|---|
//! | 0, 1 | route a request | kind, shape, sizes, text (see [`request_body`]) |
//! | 2 | release the prompt part of an outstanding charge | which |
//! | 3 | release the rest of an outstanding charge | which |
//! | 4 | advance the clock | 0..=255 × 10 ms |
//! | 5 | record a `/metrics` poll of an endpoint | which, body shape, values |
//! | 6 | change the endpoint membership | 16-bit member mask, 16-bit health mask |
//! | 7 | the next CAS writes fail, or reap | count (< 8, under the retry bound) or reap |
//!
//! Index budgets are small (64–128 KiB): `collector_init` creates every
//! shard of the budget before traffic.
//!
//! A reap (with a clock jump past `reapAfterMs`) is the one step after which
//! the counters may legitimately differ from the outstanding charges; from
//! then on only the end state is checked: zero after every release.

use kvroute_core::config::Config;
use kvroute_core::engine::{Engine, Outcome, Routed, Unrouted};
use kvroute_core::request::ApiKind;
use kvroute_core::scheduling::Rng;
use kvroute_shared_state::load::{LoadTable, Ticket};
use kvroute_shared_state::memory::MemoryStore;
use kvroute_shared_state::{Store, LOAD_KEY};
use serde_json::json;

/// Most operations per input.
pub const MAX_OPS: usize = 512;

/// Addresses endpoints are drawn from (membership changes pick subsets).
const POOL: [&str; 12] = [
    "127.0.0.1:8001",
    "127.0.0.1:8002",
    "127.0.0.1:8003",
    "127.0.0.1:8004",
    "127.0.0.1:8005",
    "127.0.0.1:8006",
    "127.0.0.1:8007",
    "127.0.0.1:8008",
    "127.0.0.1:8009",
    "127.0.0.1:8010",
    "127.0.0.1:8011",
    "127.0.0.1:8012",
];

/// The fixed configurations programs run under: the optimized llm-d
/// baseline with small blocks and an easy saturation release; the legacy
/// blend with output estimates and the weighted-random picker; active
/// requests with exploration, always-stick, fail-closed and many fallbacks.
pub const CONFIGS: [&str; 3] = [
    r#"{"endpoints":{"static":["127.0.0.1:8001","127.0.0.1:8002","127.0.0.1:8003","127.0.0.1:8004"]},
        "plugins":[{"type":"approx-prefix-cache-producer","parameters":{"blockSizeTokens":4,"lruCapacityPerServer":64}},
                   {"type":"prefix-cache-affinity-filter","parameters":{"maxTTFTPenaltyMs":200,"peakPrefillThroughput":1000}},
                   {"type":"token-load-scorer","parameters":{"queueThresholdTokens":5000}},{"type":"max-score-picker"}],
        "schedulingProfiles":[{"name":"d","plugins":[{"pluginRef":"prefix-cache-affinity-filter"},{"pluginRef":"token-load-scorer"},{"pluginRef":"max-score-picker"}]}],
        "sharedState":{"indexBudgetBytes":65536}}"#,
    r#"{"endpoints":{"static":["127.0.0.1:8001","127.0.0.1:8002","127.0.0.1:8003"]},
        "plugins":[{"type":"approx-prefix-cache-producer","parameters":{"blockSizeTokens":8,"autoTune":true}},
                   {"type":"inflight-load-producer","parameters":{"addEstimatedOutputTokens":true,"outputRatio":0.5,"maxEstimatedOutputTokens":100}},
                   {"type":"prefix-cache-scorer"},{"type":"queue-scorer"},{"type":"kv-cache-utilization-scorer"},{"type":"no-hit-lru-scorer"},
                   {"type":"weighted-random-picker"}],
        "schedulingProfiles":[{"name":"legacy","plugins":[{"pluginRef":"prefix-cache-scorer","weight":3},{"pluginRef":"queue-scorer","weight":2},
                   {"pluginRef":"kv-cache-utilization-scorer","weight":2},{"pluginRef":"no-hit-lru-scorer","weight":2},{"pluginRef":"weighted-random-picker"}]}],
        "sharedState":{"indexBudgetBytes":131072}}"#,
    r#"{"endpoints":{"static":["127.0.0.1:8001","127.0.0.1:8002","127.0.0.1:8003","127.0.0.1:8004","127.0.0.1:8005","127.0.0.1:8006"]},
        "plugins":[{"type":"approx-prefix-cache-producer","parameters":{"blockSizeTokens":2,"charsPerToken":1,"maxPrefixTokensToMatch":64}},
                   {"type":"prefix-cache-affinity-filter","parameters":{"maxTTFTPenaltyMs":0,"explorationProbability":0.3,"affinityThreshold":0.5}},
                   {"type":"active-request-scorer","parameters":{"idleThreshold":1,"maxBusyScore":0.9}},{"type":"token-load-scorer"},{"type":"max-score-picker"}],
        "schedulingProfiles":[{"name":"a","plugins":[{"pluginRef":"prefix-cache-affinity-filter"},{"pluginRef":"active-request-scorer","weight":2},
                   {"pluginRef":"token-load-scorer","weight":0.5},{"pluginRef":"max-score-picker"}]}],
        "routing":{"failureMode":"closed","maxFallbacks":16,"maxBodyBytes":4096},
        "sharedState":{"indexBudgetBytes":65536}}"#,
];

/// Shared system prompts; requests that repeat one share leading blocks.
const SYSTEMS: [&str; 4] = [
    "You are a careful assistant. Answer in one paragraph. ",
    "You review Rust code for panics and unbounded allocation. ",
    "Translate the user's text into French, keeping the tone. ",
    "",
];

/// Reads operands; a short input reads as zeros, so every input is a program.
struct Reader<'a> {
    data: &'a [u8],
}

impl Reader<'_> {
    fn u8(&mut self) -> u8 {
        match self.data.split_first() {
            Some((b, rest)) => {
                self.data = rest;
                *b
            }
            None => 0,
        }
    }
    fn u16(&mut self) -> u16 {
        u16::from_le_bytes([self.u8(), self.u8()])
    }
    fn bytes(&mut self, n: usize) -> &[u8] {
        let (head, rest) = self.data.split_at(n.min(self.data.len()));
        self.data = rest;
        head
    }
    fn is_empty(&self) -> bool {
        self.data.is_empty()
    }
}

/// A routed request not yet fully released.
struct Outstanding {
    ticket: Ticket,
    prompt_released: bool,
}

/// One engine, its store, the clock and what is outstanding (also used by
/// the collector targets, which route through it after writing state).
pub(crate) struct World {
    pub(crate) engine: Engine,
    pub(crate) store: MemoryStore,
    rng: Rng,
    pub(crate) now_ms: u64,
    outstanding: Vec<Outstanding>,
    /// False after a reap: counters may then hold less than the outstanding charges.
    exact: bool,
}

impl World {
    pub(crate) fn new(config: Config) -> World {
        let engine = Engine::new(config);
        let store = MemoryStore::new();
        engine
            .collector_init(&store)
            .expect("collector_init on a MemoryStore");
        World {
            engine,
            store,
            rng: Rng::new(7),
            now_ms: 1,
            outstanding: Vec::new(),
            exact: true,
        }
    }

    fn load(&self) -> LoadTable {
        let value = self.store.get(LOAD_KEY).expect("MemoryStore get");
        LoadTable::decode(value.as_ref().map(|(b, _)| b.as_slice()))
    }

    pub(crate) fn route(&mut self, kind: ApiKind, body: &[u8]) {
        let outcome = match self.engine.facts(kind, body) {
            Ok(facts) => self
                .engine
                .route(&self.store, facts, self.now_ms, &mut self.rng),
            Err(why) => self.engine.fail_for(why, Some(kind)),
        };
        match outcome {
            Outcome::Routed(r) => {
                self.check_routed(&r);
                if let Some(ticket) = r.ticket {
                    self.outstanding.push(Outstanding {
                        ticket,
                        prompt_released: false,
                    });
                }
            }
            Outcome::FailOpen(why) => check_unrouted(&why),
            Outcome::Reject { status, body, why } => {
                check_unrouted(&why);
                let expected = match why {
                    Unrouted::BadBody(_) => 400,
                    Unrouted::UnknownModel(_) => 404,
                    _ => 503,
                };
                assert_eq!(status, expected, "status for {why:?}");
                let v: serde_json::Value =
                    serde_json::from_str(&body).expect("a reject body is JSON");
                assert!(v["error"]["message"].is_string(), "{body}");
            }
        }
    }

    fn check_routed(&self, r: &Routed) {
        let table = self
            .engine
            .endpoint_table(&self.store)
            .expect("endpoint table");
        let healthy: Vec<&str> = table
            .endpoints
            .iter()
            .filter(|e| e.healthy)
            .map(|e| e.address.as_str())
            .collect();
        let picked: Vec<&str> = r.destination.split(',').collect();
        assert!(
            picked.len() <= 1 + self.engine.config.routing.max_fallbacks,
            "{} destinations: {}",
            picked.len(),
            r.destination
        );
        for (i, a) in picked.iter().enumerate() {
            assert!(healthy.contains(a), "{a} is not a healthy endpoint");
            assert!(!picked[..i].contains(a), "{a} twice in {}", r.destination);
        }
        let d = &r.decision;
        // The candidates are the healthy endpoints that may serve the
        // request's model (`engine/models.rs`): all of them unless the
        // collector learnt which models each serves.
        assert!(!d.report.is_empty() && d.report.len() <= healthy.len());
        assert!(d.primary < d.report.len());
        assert!(!d.fallbacks.contains(&d.primary));
        assert!(
            d.report[d.primary].passed_filter,
            "the primary was filtered out"
        );
        for c in &d.report {
            assert!((0.0..=1.0).contains(&c.affinity), "affinity {}", c.affinity);
            assert!(c.ttft_ms >= 0.0, "ttft {}", c.ttft_ms);
            if let Some(s) = c.score {
                assert!(
                    s.is_finite(),
                    "a non-finite score {s} in {:?} ({})",
                    d.report,
                    r.explanation()
                );
            }
        }
        assert!(
            r.explanation().starts_with("branch="),
            "{}",
            r.explanation()
        );
    }

    /// Counters equal the outstanding charges (while no reap happened), and
    /// never exceed them.
    pub(crate) fn check_accounting(&self) {
        let load = self.load();
        for (slot, rec) in load.records.iter().enumerate() {
            let mine = self.outstanding.iter().filter(|o| {
                usize::from(o.ticket.slot) == slot && o.ticket.generation == rec.generation
            });
            let (mut requests, mut tokens) = (0u64, 0u64);
            for o in mine {
                requests += 1;
                tokens += o.ticket.output_tokens;
                if !o.prompt_released {
                    tokens += o.ticket.prompt_tokens;
                }
            }
            let (got_requests, got_tokens) = (rec.inflight_requests(), rec.inflight_tokens());
            if self.exact {
                assert_eq!(
                    (got_requests, got_tokens),
                    (requests, tokens),
                    "slot {slot}: counters (requests, tokens) differ from the outstanding charges"
                );
            } else {
                assert!(
                    got_requests <= requests && got_tokens <= tokens,
                    "slot {slot}: counters ({got_requests}, {got_tokens}) exceed the outstanding charges ({requests}, {tokens})"
                );
            }
        }
    }

    /// Releases everything still outstanding; every counter must be zero.
    pub(crate) fn finish(&mut self) {
        for o in std::mem::take(&mut self.outstanding) {
            self.engine
                .release_rest(&self.store, &o.ticket, o.prompt_released)
                .expect("release_rest");
        }
        for (slot, rec) in self.load().records.iter().enumerate() {
            assert_eq!(
                (rec.inflight_requests(), rec.inflight_tokens()),
                (0, 0),
                "slot {slot}: in-flight counters are not zero after every request was released"
            );
        }
        let state = self
            .engine
            .state_json(&self.store, self.now_ms)
            .expect("state_json");
        serde_json::from_str::<serde_json::Value>(&state).expect("state_json is JSON");
    }
}

fn check_unrouted(why: &Unrouted) {
    assert!(!why.label().is_empty());
    if let Unrouted::Store(m) = why {
        panic!("a MemoryStore error while routing: {m}");
    }
}

/// Builds a request body of `kind` from operands: mostly well-formed bodies
/// that share system prompts and grow turn by turn; sometimes raw bytes.
fn request_body(kind: ApiKind, r: &mut Reader) -> Vec<u8> {
    let shape = r.u8();
    if shape % 8 == 7 {
        let n = usize::from(r.u8());
        return r.bytes(n).to_vec();
    }
    let system =
        SYSTEMS[usize::from(shape >> 4) % SYSTEMS.len()].repeat(1 + usize::from(r.u8() % 16));
    let turns = 1 + usize::from(r.u8() % 4);
    let user_len = usize::from(r.u8() % 96);
    let user: String = r
        .bytes(user_len)
        .iter()
        .map(|b| char::from(b'a' + b % 26))
        .collect();
    let model = if shape & 1 == 0 { "m" } else { "n" };
    let mut doc = match kind {
        ApiKind::ChatCompletions => {
            let mut messages = vec![json!({"role": "system", "content": system})];
            for t in 0..turns {
                messages.push(json!({"role": "user", "content": format!("{user} turn {t}")}));
                if t + 1 < turns {
                    messages.push(json!({"role": "assistant", "content": format!("answer {t}")}));
                }
            }
            json!({"model": model, "messages": messages})
        }
        ApiKind::Completions if shape & 2 != 0 => {
            let ids: Vec<u32> = format!("{system}{user}").bytes().map(u32::from).collect();
            json!({"model": model, "prompt": ids})
        }
        ApiKind::Completions => json!({"model": model, "prompt": format!("{system}{user}")}),
        ApiKind::Responses => json!({"model": model, "instructions": system, "input": user}),
        ApiKind::Embeddings => json!({"model": model, "input": user}),
        ApiKind::Generate => {
            let ids: Vec<u32> = format!("{system}{user}").bytes().map(u32::from).collect();
            json!({"model": model, "token_ids": ids, "sampling_params": {"max_tokens": r.u8(), "n": 1 + r.u8() % 3}})
        }
        ApiKind::Messages => {
            let mut messages = Vec::new();
            for t in 0..turns {
                messages.push(json!({"role": "user", "content": [{"type": "text", "text": format!("{user} turn {t}")}]}));
                if t + 1 < turns {
                    messages.push(json!({"role": "assistant", "content": [
                        {"type": "text", "text": format!("answer {t}")},
                        {"type": "tool_use", "id": format!("t{t}"), "name": "f", "input": {}}]}));
                }
            }
            json!({"model": model, "max_tokens": 16, "system": system, "messages": messages})
        }
    };
    if shape & 4 != 0 {
        doc["cache_salt"] = json!("tenant-a");
    }
    if shape & 8 != 0 {
        doc["max_tokens"] = json!(r.u16());
        doc["stream"] = json!(true);
    }
    serde_json::to_vec(&doc).expect("a Value serialises")
}

/// A `/metrics` body: vLLM-shaped with chosen (sometimes extreme) values, or raw bytes.
fn metrics_body(r: &mut Reader) -> Vec<u8> {
    const VALUES: [&str; 12] = [
        "0", "1", "3.5", "17", "1e6", "0.25", "1e308", "-1e308", "-0.0", "NaN", "+Inf", "1e-320",
    ];
    let shape = r.u8();
    if shape % 4 == 3 {
        let n = usize::from(r.u8());
        return r.bytes(n).to_vec();
    }
    let v = |r: &mut Reader| VALUES[usize::from(r.u8()) % VALUES.len()];
    let engines = 1 + usize::from(shape >> 6);
    let mut body = String::from("# HELP vllm:num_requests_waiting Waiting.\n");
    for e in 0..engines {
        body.push_str(&format!(
            "vllm:num_requests_waiting{{engine=\"{e}\",model_name=\"m\"}} {}\n",
            v(r)
        ));
        body.push_str(&format!(
            "vllm:num_requests_running{{engine=\"{e}\"}} {}\n",
            v(r)
        ));
        body.push_str(&format!(
            "vllm:kv_cache_usage_perc{{engine=\"{e}\"}} {}\n",
            v(r)
        ));
        body.push_str(&format!(
            "vllm:cache_config_info{{block_size=\"16\",num_gpu_blocks=\"{}\"}} 1\n",
            r.u16()
        ));
    }
    body.into_bytes()
}

/// Runs one engine program (fuzz target `engine`).
pub fn run(data: &[u8]) {
    let mut r = Reader { data };
    let config = CONFIGS[usize::from(r.u8()) % CONFIGS.len()];
    let mut w = World::new(Config::from_json(config.as_bytes()).expect("fixed config"));
    let mut ops = 0;
    while !r.is_empty() && ops < MAX_OPS {
        ops += 1;
        match r.u8() % 8 {
            0 | 1 => {
                let kind = crate::KINDS[usize::from(r.u8()) % crate::KINDS.len()];
                let body = request_body(kind, &mut r);
                w.route(kind, &body);
            }
            2 if !w.outstanding.is_empty() => {
                let i = usize::from(r.u8()) % w.outstanding.len();
                let o = &mut w.outstanding[i];
                if !o.prompt_released {
                    o.prompt_released = true;
                    let t = o.ticket;
                    w.engine
                        .release_prompt(&w.store, &t)
                        .expect("release_prompt");
                }
            }
            3 if !w.outstanding.is_empty() => {
                let i = usize::from(r.u8()) % w.outstanding.len();
                let o = w.outstanding.swap_remove(i);
                w.engine
                    .release_rest(&w.store, &o.ticket, o.prompt_released)
                    .expect("release_rest");
            }
            4 => w.now_ms += u64::from(r.u8()) * 10,
            5 => {
                let table = w.engine.endpoint_table(&w.store).expect("endpoint table");
                if table.endpoints.is_empty() {
                    continue;
                }
                let e = &table.endpoints[usize::from(r.u8()) % table.endpoints.len()];
                let body = metrics_body(&mut r);
                let result = if body.is_empty() {
                    Err(())
                } else {
                    Ok(&body[..])
                };
                w.engine
                    .record_metrics(&w.store, e.slot, e.generation, result, w.now_ms)
                    .expect("record_metrics");
            }
            6 => {
                let (members, healthy) = (r.u16(), r.u16());
                let list = POOL
                    .iter()
                    .enumerate()
                    .filter(|(i, _)| members & (1 << i) != 0)
                    .map(|(i, a)| (a.to_string(), healthy & (1 << i) == 0))
                    .collect();
                w.engine
                    .apply_membership(&w.store, list)
                    .expect("apply_membership");
            }
            7 => {
                let n = r.u8();
                if n == 255 {
                    // Reap: jump past reapAfterMs; charges older than it may go.
                    w.now_ms += w.engine.config.collector.reap_after_ms * 3;
                    w.engine.reap(&w.store, w.now_ms).expect("reap");
                    w.exact = false;
                } else {
                    w.store.inject_conflicts.set(u32::from(n % 8));
                }
            }
            _ => {}
        }
        w.check_accounting();
    }
    w.store.inject_conflicts.set(0);
    w.finish();
}

/// Routes chat request `i` (a long shared system prompt and a short
/// question) through `w`, checking the decision (see `World::route`).
pub(crate) fn route_chat(w: &mut World, i: usize) {
    let system = SYSTEMS[0].repeat(24);
    let body = json!({"model": "m", "messages": [
        {"role": "system", "content": system},
        {"role": "user", "content": format!("question {i}")}]});
    let body = serde_json::to_vec(&body).expect("a Value serialises");
    w.route(ApiKind::ChatCompletions, &body);
}

/// Routes a few requests with an accepted configuration (fuzz target
/// `config`): nothing panics, and the counters return to zero.
pub fn route_with(mut config: Config) {
    // `collector_init` creates every index shard up front (the whole budget,
    // up to 1 GiB); a small index routes the same way and keeps runs fast.
    let budget = &mut config.shared_state.index_budget_bytes;
    *budget = (*budget).min(1 << 20);
    let mut w = World::new(config);
    if w.engine
        .endpoint_table(&w.store)
        .expect("endpoint table")
        .endpoints
        .is_empty()
    {
        // fromCluster: the collector would write membership; stand in for it.
        let members = POOL[..3].iter().map(|a| (a.to_string(), true)).collect();
        w.engine
            .apply_membership(&w.store, members)
            .expect("apply_membership");
    }
    for i in 0..4 {
        route_chat(&mut w, i);
        w.now_ms += 5;
        w.check_accounting();
    }
    w.finish();
}

//! The model filter and LoRA adapters on the engine (`engine/models.rs`).

use super::{Engine, Outcome, Routed, Unrouted};
use crate::config::Config;
use crate::precise::vllm_hash::LoraKey;
use crate::precise::{Fallback, PreciseUse};
use crate::request::ApiKind;
use crate::scheduling::Rng;
use kvroute_shared_state::memory::MemoryStore;
use kvroute_shared_state::Store;

const PRECISE_DOC: &str = r#"{"endpoints":{"static":["127.0.0.1:1","127.0.0.1:2"]},
    "plugins":[{"type":"token-producer","parameters":{"modelName":"base","udsTokenizerConfig":{"socketFile":"/x"}}},
               {"type":"precise-prefix-cache-producer","parameters":{"tokenProcessorConfig":{"blockSizeTokens":4,"hashSeed":"0"}}},
               {"type":"prefix-cache-scorer","parameters":{"prefixMatchInfoProducerName":"precise-prefix-cache-producer"}},
               {"type":"max-score-picker"}],
    "schedulingProfiles":[{"name":"d","plugins":[{"pluginRef":"prefix-cache-scorer"},{"pluginRef":"max-score-picker"}]}],
    "kvEvents":{"enabled":true,"staleMs":5000}}"#;

fn route(e: &Engine, s: &dyn Store, body: &[u8], now_ms: u64) -> Outcome {
    let mut rng = Rng::new(3);
    match e.facts(ApiKind::Completions, body) {
        Ok(f) => e.route(s, f, now_ms, &mut rng),
        Err(why) => e.fail_for(why, Some(ApiKind::Completions)),
    }
}

fn routed(o: Outcome) -> Routed {
    match o {
        Outcome::Routed(r) => r,
        other => panic!("expected Routed, got {other:?}"),
    }
}

/// Both endpoints serve "base"; endpoint 1 has adapter "sql" loaded (from
/// `sql_path`, or listed without a `root` when `None`), and endpoint 2 also
/// serves "other" as a base model and, with `sql_on_2`, "sql" from that path.
fn report_models(e: &Engine, s: &MemoryStore, sql_paths: [Option<&str>; 2]) {
    let table = e.endpoint_table(s).unwrap();
    for (i, ep) in table.endpoints.iter().enumerate() {
        let mut data = vec![serde_json::json!({"id": "base", "root": "/models/base"})];
        if i == 1 {
            data.push(serde_json::json!({"id": "other"}));
        }
        match (i, sql_paths[i]) {
            (0, None) => data.push(serde_json::json!({"id": "sql", "parent": "base"})),
            (_, Some(p)) => {
                data.push(serde_json::json!({"id": "sql", "parent": "base", "root": p}))
            }
            _ => {}
        }
        let body = serde_json::json!({ "data": data }).to_string();
        e.record_model_list(s, ep.slot, ep.generation, body.as_bytes())
            .unwrap();
    }
}

/// Every endpoint's held view fresh, holding these blocks.
fn held(e: &Engine, s: &MemoryStore, blocks: [&[u64]; 2], now_ms: u64) {
    let table = e.endpoint_table(s).unwrap();
    for (ep, b) in table.endpoints.iter().zip(blocks) {
        let body = serde_json::json!({"epoch": 7, "seq": 1, "complete": true, "blocks": b});
        e.apply_relay_answer(
            s,
            ep.slot,
            ep.generation,
            crate::reports::relay::Ask::Snapshot,
            body.to_string().as_bytes(),
            now_ms,
        )
        .unwrap();
    }
}

#[test]
fn an_adapters_request_without_a_known_path_falls_back_from_precise_hashes() {
    let e = Engine::new(Config::from_json(PRECISE_DOC.as_bytes()).unwrap());
    let s = MemoryStore::new();
    e.collector_init(&s).unwrap();
    report_models(&e, &s, [None, None]);
    let ids: Vec<u32> = (100..117).collect();
    // Every held view fresh (empty), so the base model's request matches.
    held(&e, &s, [&[], &[]], 1000);
    let base = serde_json::json!({"model": "base", "prompt": ids}).to_string();
    let r = routed(route(&e, &s, base.as_bytes(), 1500));
    assert_eq!(r.precise, Some(PreciseUse::Matched { blocks: 4 }));
    assert!(!r.lora_adapter);
    e.release_rest(&s, &r.ticket.unwrap(), false).unwrap();

    // Listed without a `root`: its path, which vLLM hashes with, is unknown.
    let sql = serde_json::json!({"model": "sql", "prompt": ids}).to_string();
    let r = routed(route(&e, &s, sql.as_bytes(), 1500));
    assert_eq!(
        r.precise,
        Some(PreciseUse::Fallback {
            why: Fallback::LoraPathUnknown,
            blocks: 4
        })
    );
    assert!(r.lora_adapter);
    assert_eq!(r.destination.split(',').next(), Some("127.0.0.1:1"));
    // Only endpoint 1 serves it: no fallback address to the other.
    assert_eq!(r.destination, "127.0.0.1:1");
    e.release_rest(&s, &r.ticket.unwrap(), false).unwrap();

    // "other" is a base model on endpoint 2 only.
    let other = serde_json::json!({"model": "other", "prompt": ids}).to_string();
    let r = routed(route(&e, &s, other.as_bytes(), 1500));
    assert_eq!(r.destination, "127.0.0.1:2");
    assert!(!r.lora_adapter);
    e.release_rest(&s, &r.ticket.unwrap(), false).unwrap();

    // Unknown to both.
    let none = serde_json::json!({"model": "nope", "prompt": ids}).to_string();
    assert_eq!(
        route(&e, &s, none.as_bytes(), 1500),
        Outcome::FailOpen(Unrouted::UnknownModel("nope".into()))
    );
    // Nothing left charged; the state view shows each endpoint's models.
    let v: serde_json::Value = serde_json::from_str(&e.state_json(&s, 0).unwrap()).unwrap();
    assert_eq!(
        v["endpoints"][0]["models"],
        serde_json::json!({"base": ["base"], "adapters": [{"name": "sql", "path": null, "running": false, "waiting": false}],
                           "maxLora": 0, "overflow": false})
    );
    for ep in v["endpoints"].as_array().unwrap() {
        assert_eq!(ep["inflightRequests"], 0, "{ep}");
    }
}

#[test]
fn an_adapters_request_is_hashed_with_its_name_and_path_and_matched() {
    let e = Engine::new(Config::from_json(PRECISE_DOC.as_bytes()).unwrap());
    let s = MemoryStore::new();
    e.collector_init(&s).unwrap();
    let p = e.config.precise.clone().unwrap();
    let ids: Vec<u32> = (100..117).collect();
    let key = |path| Some(LoraKey { name: "sql", path });
    let base_hashes = p.hashes_of(&ids, None, None);
    let sql_hashes = p.hashes_of(&ids, key("/a/sql"), None);
    let salted = p.hashes_of(&ids, key("/a/sql"), Some("t1"));
    assert_eq!(sql_hashes.len(), 4);
    assert!(base_hashes.iter().all(|h| !sql_hashes.contains(h)));
    assert_ne!(salted, sql_hashes);
    // Both serve "sql" from one path. Endpoint 1 holds the prompt as the
    // base model's blocks, endpoint 2 as the adapter's.
    report_models(&e, &s, [Some("/a/sql"), Some("/a/sql")]);
    // The same listing again writes nothing (no epoch bump for workers).
    let cas = s
        .get(kvroute_shared_state::models::MODELS_KEY)
        .unwrap()
        .unwrap()
        .1;
    report_models(&e, &s, [Some("/a/sql"), Some("/a/sql")]);
    assert_eq!(
        s.get(kvroute_shared_state::models::MODELS_KEY)
            .unwrap()
            .unwrap()
            .1,
        cas
    );
    held(&e, &s, [&base_hashes, &sql_hashes], 1000);
    let v: serde_json::Value = serde_json::from_str(&e.state_json(&s, 0).unwrap()).unwrap();
    assert_eq!(v["endpoints"][1]["models"]["adapters"][0]["path"], "/a/sql");
    let body = |model: &str, salt: Option<&str>| {
        let mut b = serde_json::json!({"model": model, "prompt": ids});
        if let Some(salt) = salt {
            b["cache_salt"] = salt.into();
        }
        b.to_string()
    };
    for _ in 0..3 {
        let r = routed(route(&e, &s, body("sql", None).as_bytes(), 1500));
        assert_eq!(r.precise, Some(PreciseUse::Matched { blocks: 4 }));
        assert!(r.lora_adapter);
        assert_eq!(r.primary_address(), "127.0.0.1:2", "{r:?}");
        e.release_rest(&s, &r.ticket.unwrap(), false).unwrap();
        // The base model's request for the same prompt: endpoint 1.
        let r = routed(route(&e, &s, body("base", None).as_bytes(), 1500));
        assert_eq!(r.primary_address(), "127.0.0.1:1", "{r:?}");
        assert!(!r.lora_adapter);
        e.release_rest(&s, &r.ticket.unwrap(), false).unwrap();
    }
    // The salt goes after the LoRA key on block 0: endpoint 1 holding the
    // salted adapter hashes wins a salted request.
    held(&e, &s, [&salted, &sql_hashes], 1100);
    let r = routed(route(&e, &s, body("sql", Some("t1")).as_bytes(), 1500));
    assert_eq!(r.precise, Some(PreciseUse::Matched { blocks: 4 }));
    assert_eq!(r.primary_address(), "127.0.0.1:1", "{r:?}");
    e.release_rest(&s, &r.ticket.unwrap(), false).unwrap();

    // Loaded from different paths: one set of hashes cannot match both.
    report_models(&e, &s, [Some("/a/sql"), Some("/b/sql")]);
    let r = routed(route(&e, &s, body("sql", None).as_bytes(), 1500));
    assert_eq!(
        r.precise,
        Some(PreciseUse::Fallback {
            why: Fallback::LoraPathsDiffer,
            blocks: 4
        })
    );
    e.release_rest(&s, &r.ticket.unwrap(), false).unwrap();
    // One lists it with a path, the other without: unknown there.
    report_models(&e, &s, [None, Some("/a/sql")]);
    let r = routed(route(&e, &s, body("sql", None).as_bytes(), 1500));
    assert_eq!(
        r.precise,
        Some(PreciseUse::Fallback {
            why: Fallback::LoraPathUnknown,
            blocks: 4
        })
    );
    e.release_rest(&s, &r.ticket.unwrap(), false).unwrap();
    // Only endpoint 1 lists it, with a path: hashed with it.
    report_models(&e, &s, [Some("/a/sql"), None]);
    let r = routed(route(&e, &s, body("sql", None).as_bytes(), 1500));
    assert_eq!(r.precise, Some(PreciseUse::Matched { blocks: 4 }));
    assert_eq!(r.destination, "127.0.0.1:1");
    e.release_rest(&s, &r.ticket.unwrap(), false).unwrap();
}

#[test]
fn a_model_list_replaces_only_its_own_part() {
    let e = Engine::new(
        Config::from_json(br#"{"endpoints":{"static":["127.0.0.1:1","127.0.0.1:2"]}}"#).unwrap(),
    );
    let s = MemoryStore::new();
    e.collector_init(&s).unwrap();
    let t = e.endpoint_table(&s).unwrap();
    let (a, b) = (&t.endpoints[0], &t.endpoints[1]);
    // Endpoint a reports by /metrics, b by nothing: b may serve anything.
    e.record_metrics(
        &s,
        a.slot,
        a.generation,
        Ok(b"vllm:num_requests_running{model_name=\"base\"} 0\n"),
        10,
    )
    .unwrap();
    let body = br#"{"model":"x","prompt":"hello"}"#;
    assert_eq!(routed(route(&e, &s, body, 20)).destination, "127.0.0.1:2");
    // A bad list is an error and changes nothing.
    assert!(e
        .record_model_list(&s, b.slot, b.generation, b"nope")
        .is_err());
    assert_eq!(routed(route(&e, &s, body, 20)).destination, "127.0.0.1:2");
    // b lists "base" only: "x" is served nowhere.
    e.record_model_list(&s, b.slot, b.generation, br#"{"data":[{"id":"base"}]}"#)
        .unwrap();
    assert!(matches!(
        route(&e, &s, body, 30),
        Outcome::FailOpen(Unrouted::UnknownModel(_))
    ));
    // A failed /metrics poll keeps a's list.
    e.record_metrics(&s, a.slot, a.generation, Err(()), 50)
        .unwrap();
    let r = routed(route(&e, &s, br#"{"model":"base","prompt":"hi"}"#, 60));
    assert!(r.destination.contains("127.0.0.1:"));
}

#[test]
fn lora_affinity_prefers_the_endpoint_running_the_adapter_then_a_free_slot() {
    let doc = r#"{"endpoints":{"static":["127.0.0.1:1","127.0.0.1:2","127.0.0.1:3"]},
        "plugins":[{"type":"lora-affinity-scorer"},{"type":"max-score-picker"}],
        "schedulingProfiles":[{"name":"d","plugins":[{"pluginRef":"lora-affinity-scorer"},{"pluginRef":"max-score-picker"}]}]}"#;
    let e = Engine::new(Config::from_json(doc.as_bytes()).unwrap());
    let s = MemoryStore::new();
    e.collector_init(&s).unwrap();
    let t = e.endpoint_table(&s).unwrap();
    // 1: base only, both slots taken by other adapters; 2: "sql" running
    // (slots full); 3: "sql" loaded idle, a free slot.
    let metrics = [
        "vllm:num_requests_running{model_name=\"base\"} 2\nvllm:lora_requests_info{max_lora=\"2\",running_lora_adapters=\"a,b\",waiting_lora_adapters=\"\"} 5\n",
        "vllm:num_requests_running{model_name=\"base\"} 2\nvllm:lora_requests_info{max_lora=\"2\",running_lora_adapters=\"sql,b\",waiting_lora_adapters=\"\"} 5\n",
        "vllm:num_requests_running{model_name=\"base\"} 0\nvllm:lora_requests_info{max_lora=\"2\",running_lora_adapters=\"\",waiting_lora_adapters=\"\"} 5\n",
    ];
    for (ep, m) in t.endpoints.iter().zip(metrics) {
        e.record_metrics(&s, ep.slot, ep.generation, Ok(m.as_bytes()), 10)
            .unwrap();
        e.record_model_list(
            &s,
            ep.slot,
            ep.generation,
            br#"{"data":[{"id":"base"},{"id":"sql","parent":"base"},{"id":"a","parent":"base"},{"id":"b","parent":"base"}]}"#,
        )
        .unwrap();
    }
    let body = br#"{"model":"sql","prompt":"hello there"}"#;
    let r = routed(route(&e, &s, body, 20));
    assert_eq!(r.destination.split(',').next(), Some("127.0.0.1:2"));
    e.release_rest(&s, &r.ticket.unwrap(), false).unwrap();
    // Adapter "c" runs nowhere: the free slot (3) wins.
    e.record_model_list(
        &s,
        t.endpoints[2].slot,
        t.endpoints[2].generation,
        br#"{"data":[{"id":"base"},{"id":"c","parent":"base"}]}"#,
    )
    .unwrap();
    for ep in &t.endpoints[..2] {
        e.record_model_list(
            &s,
            ep.slot,
            ep.generation,
            br#"{"data":[{"id":"base"},{"id":"c","parent":"base"}]}"#,
        )
        .unwrap();
    }
    let r = routed(route(
        &e,
        &s,
        br#"{"model":"c","prompt":"hello there"}"#,
        30,
    ));
    assert_eq!(r.destination.split(',').next(), Some("127.0.0.1:3"));
}

/// `tokenizeIn: collector`: the stored prefixes are the base model's
/// hashes. An adapter's text prompt finds the base model's stored prefix
/// (the lookup is by text) but falls back (`lora_adapter`), and sends the
/// collector no text.
#[cfg(feature = "tokenizer")]
#[test]
fn an_adapters_text_prompt_falls_back_with_the_tokenizer_in_the_collector() {
    use crate::precise::offpath::{process, Job, Tokenizing};
    use crate::precise::OffPathModel;
    const TINY_JSON: &str =
        include_str!("../../../../testdata/tokenizer/tiny-bpe-4096/tokenizer.json");
    const TINY_CONFIG: &str =
        include_str!("../../../../testdata/tokenizer/tiny-bpe-4096/tokenizer_config.json");
    let doc = PRECISE_DOC.replace(
        r#""udsTokenizerConfig":{"socketFile":"/x"}"#,
        &format!(
            r#""servedModelNames":["sql"],"tokenizeIn":"collector","tokenizerJson":{},"tokenizerConfig":{TINY_CONFIG}"#,
            serde_json::to_string(TINY_JSON).unwrap()
        ),
    );
    let e = Engine::new(Config::from_json(doc.as_bytes()).unwrap());
    let s = MemoryStore::new();
    e.collector_init(&s).unwrap();
    report_models(&e, &s, [Some("/a/sql"), Some("/a/sql")]);
    held(&e, &s, [&[], &[]], 1000);
    let p = e.config.precise.clone().unwrap();
    let m = p.tokenizers[0].offpath.clone().unwrap();
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
    let text = "you route requests to the server that holds their cache, most likely";
    let body = |model: &str| serde_json::json!({"model": model, "prompt": text}).to_string();
    // The base model's request: its job stores the prompt's hashes.
    let r = routed(route(&e, &s, body("base").as_bytes(), 1500));
    assert!(!r.lora_adapter);
    let job = Job::decode(&r.tokenize.as_ref().unwrap().job).unwrap();
    process(&job, &t, &s).unwrap();
    e.release_rest(&s, &r.ticket.unwrap(), false).unwrap();
    let r = routed(route(&e, &s, body("base").as_bytes(), 1500));
    let Some(PreciseUse::Matched { blocks }) = r.precise else {
        panic!("{:?}", r.precise)
    };
    assert!(blocks >= 3);
    e.release_rest(&s, &r.ticket.unwrap(), false).unwrap();
    // The adapter's: the same text, found, but not the adapter's hashes.
    let r = routed(route(&e, &s, body("sql").as_bytes(), 1500));
    assert!(r.lora_adapter);
    assert_eq!(
        r.precise,
        Some(PreciseUse::Fallback {
            why: Fallback::LoraAdapter,
            blocks
        })
    );
    assert!(r.tokenize.is_none());
    e.release_rest(&s, &r.ticket.unwrap(), false).unwrap();
}

use super::*;
use crate::learners::prefill_rate::PrefillRateParams;
use crate::scheduling::active_request::ActiveRequestScorer;
use crate::scheduling::affinity_filter::AffinityFilter;
use crate::scheduling::max_score::TieBreak;
use crate::scheduling::prefix_cache::PrefixCacheScorer;
use crate::scheduling::token_load::TokenLoadScorer;

const BASELINE: &str = r#"{"plugins":[{"type":"approx-prefix-cache-producer","parameters":{"blockSizeTokens":64,"maxPrefixTokensToMatch":131072}},
        {"type":"inflight-load-producer"},
        {"type":"prefix-cache-affinity-filter","parameters":{"affinityThreshold":0.8,"maxTTFTPenaltyMs":18000,"peakPrefillThroughput":15928}},
        {"type":"token-load-scorer"},{"type":"max-score-picker"}],
 "schedulingProfiles":[{"name":"default","plugins":[{"pluginRef":"prefix-cache-affinity-filter"},{"pluginRef":"token-load-scorer"},{"pluginRef":"max-score-picker"}]}]}"#;

fn with_endpoints(doc: &str) -> String {
    let mut v: Value = serde_json::from_str(doc).unwrap();
    v["endpoints"] = serde_json::json!({"static": ["127.0.0.1:8001", "127.0.0.1:8002"]});
    v.to_string()
}

fn reject(doc: &str) -> ConfigError {
    Config::from_json(doc.as_bytes()).expect_err("config should be rejected")
}

#[test]
fn llm_d_baseline_is_accepted_as_is_and_means_the_baseline() {
    let c = Config::from_json(with_endpoints(BASELINE).as_bytes()).unwrap();
    assert_eq!(c.scheduler, Scheduler::default());
    assert_eq!(c.prefix.blocks, BlockConfig::default());
    assert_eq!(c.routing.failure_mode, FailureMode::Open);
    assert_eq!(
        c.routing.destination_header,
        "x-gateway-destination-endpoint"
    );
}

#[test]
fn baseline_without_endpoints_names_the_missing_section() {
    assert_eq!(reject(BASELINE).path, "endpoints");
}

#[test]
fn unknown_and_out_of_range_fields_are_named() {
    let doc =
        with_endpoints(&BASELINE.replace("\"affinityThreshold\":0.8", "\"affinityThreshold\":1.5"));
    let e = reject(&doc);
    assert_eq!(e.path, "plugins[2].parameters.affinityThreshold");
    assert!(e.message.contains("[0, 1]"), "{e}");

    let doc = with_endpoints(&BASELINE.replace("\"blockSizeTokens\":64", "\"blockSizeTokenz\":64"));
    let e = reject(&doc);
    assert_eq!(e.path, "plugins[0].parameters.blockSizeTokenz");
    assert!(e.message.contains("unknown field"), "{e}");

    let e = reject(&with_endpoints(
        r#"{"routing":{"failureMode":"sometimes"}}"#,
    ));
    assert_eq!(e.path, "routing.failureMode");

    let e = reject(&with_endpoints(r#"{"routing":{"maxFallback":1}}"#));
    assert_eq!(e.path, "routing.maxFallback");

    let e = reject(r#"{"endpoints":{"static":["localhost:80"]}}"#);
    assert_eq!(e.path, "endpoints.static[0]");

    let e = reject(&with_endpoints(
        r#"{"plugins":[{"type":"magic-scorer"}],"schedulingProfiles":[{"name":"x","plugins":[]}]}"#,
    ));
    assert_eq!(e.path, "plugins[0].type");
    assert!(e.message.contains("token-load-scorer"));

    let e = reject(&with_endpoints(&BASELINE.replace(
        "\"pluginRef\":\"token-load-scorer\"",
        "\"pluginRef\":\"tokenload\"",
    )));
    assert_eq!(e.path, "schedulingProfiles[0].plugins[1].pluginRef");

    let e = reject(&with_endpoints(
        r#"{"plugins":[{"type":"token-load-scorer","parameters":{"queueThresholdTokens":"big"}}],"schedulingProfiles":[{"name":"x","plugins":[{"pluginRef":"token-load-scorer"}]}]}"#,
    ));
    assert_eq!(e.path, "plugins[0].parameters.queueThresholdTokens");

    let e = reject(&with_endpoints(
        r#"{"plugins":[{"type":"prefix-cache-affinity-filter","parameters":{"maxTTFTPenaltyMs":-1}}],"schedulingProfiles":[{"name":"x","plugins":[{"pluginRef":"prefix-cache-affinity-filter"}]}]}"#,
    ));
    assert_eq!(e.path, "plugins[0].parameters.maxTTFTPenaltyMs");

    assert!(reject("not json").message.contains("expected"));
    assert_eq!(
        reject(&with_endpoints(r#"{"sharedState":{"indexBudgetBytes":1}}"#)).path,
        "sharedState.indexBudgetBytes"
    );
}

/// Fuzz find (target `config`): a valid document followed by other bytes
/// was accepted, and its tokenizer built, with the rest ignored.
#[test]
fn bytes_after_the_document_are_refused() {
    let doc = with_endpoints(BASELINE);
    assert!(Config::from_json(format!("{doc}\n \t").as_bytes()).is_ok());
    for tail in ["1e308", "{}", ",", "\u{0}"] {
        let e = reject(&format!("{doc}\n{tail}"));
        assert_eq!(e.path, "", "{tail:?}: {e}");
        assert!(e.message.contains("trailing"), "{tail:?}: {e}");
    }
}

#[test]
fn legacy_blend_and_named_instances() {
    let doc = with_endpoints(
        r#"{"plugins":[{"type":"approx-prefix-cache-producer"},
        {"type":"prefix-cache-scorer"},{"type":"queue-scorer"},{"type":"kv-cache-utilization-scorer"},
        {"type":"no-hit-lru-scorer"},{"name":"pick","type":"weighted-random-picker"}],
        "schedulingProfiles":[{"name":"legacy","plugins":[{"pluginRef":"prefix-cache-scorer","weight":3},
          {"pluginRef":"queue-scorer","weight":2},{"pluginRef":"kv-cache-utilization-scorer","weight":2},
          {"pluginRef":"no-hit-lru-scorer","weight":2},{"pluginRef":"pick"}]}]}"#,
    );
    let c = Config::from_json(doc.as_bytes()).unwrap();
    assert!(c.scheduler.filters.is_empty());
    assert_eq!(c.scheduler.picker, Picker::WeightedRandom);
    let weights: Vec<(&str, f64)> = c
        .scheduler
        .scorers
        .iter()
        .map(|(s, w)| (s.type_name(), *w))
        .collect();
    assert_eq!(
        weights,
        vec![
            ("prefix-cache-scorer", 3.0),
            ("queue-scorer", 2.0),
            ("kv-cache-utilization-scorer", 2.0),
            ("no-hit-lru-scorer", 2.0)
        ]
    );
}

#[test]
fn always_stick_and_active_request() {
    let doc = with_endpoints(
        r#"{"plugins":[{"type":"prefix-cache-affinity-filter","parameters":{"maxTTFTPenaltyMs":0}},
        {"type":"active-request-scorer","parameters":{"idleThreshold":2,"maxBusyScore":0.5}},{"type":"max-score-picker"}],
        "schedulingProfiles":[{"name":"d","plugins":[{"pluginRef":"prefix-cache-affinity-filter"},{"pluginRef":"active-request-scorer"},{"pluginRef":"max-score-picker"}]}]}"#,
    );
    let c = Config::from_json(doc.as_bytes()).unwrap();
    assert_eq!(c.scheduler.filters[0].max_ttft_penalty_ms, 0.0);
    assert_eq!(
        c.scheduler.scorers[0].0,
        Scorer::ActiveRequest(ActiveRequestScorer {
            idle_threshold: 2,
            max_busy_score: 0.5
        })
    );
}

#[test]
fn empty_plugins_mean_the_baseline() {
    let c = Config::from_json(br#"{"endpoints":{"fromCluster":{"cluster":"vllm"}}}"#).unwrap();
    assert_eq!(c.scheduler, Scheduler::default());
    assert_eq!(
        c.endpoints,
        EndpointSource::FromCluster {
            cluster: "vllm".into(),
            admin_cluster: "envoy_admin".into(),
            refresh_ms: 1000
        }
    );
}

// ---------------------------------------------------------------------------
// llm-d documents as they are: the guide fixtures, top-level keys, plugin
// types, parameters and defaults.

fn fixture(name: &str) -> Vec<u8> {
    let path = format!("{}/../../testdata/llm-d/{name}", env!("CARGO_MANIFEST_DIR"));
    std::fs::read(&path).unwrap_or_else(|e| panic!("{path}: {e}"))
}

fn accept(doc: &str) -> Config {
    Config::from_json(doc.as_bytes()).unwrap_or_else(|e| panic!("{e}\n{doc}"))
}

/// The baseline profile with `extra` merged into the top level.
fn baseline_with(extra: serde_json::Value) -> String {
    let mut v: Value = serde_json::from_str(&with_endpoints(BASELINE)).unwrap();
    for (k, x) in extra.as_object().unwrap() {
        v[k] = x.clone();
    }
    v.to_string()
}

#[test]
fn guide_optimized_baseline_loads_with_the_token_gap_gate() {
    let c = Config::from_json(&fixture("optimized-baseline.json")).unwrap();
    let f = &c.scheduler.filters[0];
    assert_eq!(f.max_tokens_in_flight_penalty, 286_720);
    assert_eq!(f.max_ttft_penalty_ms, 0.0);
    assert_eq!(f.affinity_threshold, 0.8);
    assert_eq!(c.scheduler.picker, Picker::MaxScore(TieBreak::Random));
    assert_eq!(c.prefix.blocks.max_prefix_tokens, 40_960);
    assert_eq!(c.scheduler.inflight.output_ratio, 1.5);
}

#[test]
fn guide_flow_control_loads_with_its_bands_and_detector() {
    let c = Config::from_json(&fixture("flow-control.json")).unwrap();
    let f = c.flow.expect("flow control on");
    assert!(f.queueing);
    assert_eq!(
        f.bands
            .iter()
            .map(|b| (b.priority, b.max_requests))
            .collect::<Vec<_>>(),
        vec![(100, 500), (0, 200), (-10, 50)]
    );
    assert!(f
        .bands
        .iter()
        .all(|b| b.fairness == crate::flow::Fairness::RoundRobin));
    assert_eq!(
        (f.max_requests, f.max_bytes, f.ttl_ms),
        (1000, 10 << 30, 60_000)
    );
    assert_eq!(
        f.detector,
        crate::flow::Detector::Concurrency {
            tokens: false,
            max_requests: 132,
            max_tokens: 1_000_000,
            headroom: 0.0
        }
    );
    assert_eq!(f.objectives.len(), 3);
}

#[test]
fn router_chart_default_loads_with_its_data_layer_plugins() {
    // llm-d-router's chart, default-plugins.yaml, vLLM over HTTP, no
    // parsers: metrics-data-source and core-metrics-extractor are the
    // collector, polling /metrics.
    let c = Config::from_json(&fixture("router-chart-default.json")).unwrap();
    assert_eq!(
        c.scheduler.scorers,
        vec![
            (Scorer::Queue, 2.0),
            (Scorer::KvCacheUtilization, 2.0),
            (Scorer::PrefixCache(PrefixCacheScorer::default()), 3.0)
        ]
    );
    assert_eq!(c.collector.metrics_path, "/metrics");
    assert_eq!(c.warnings, Vec::<String>::new());
}

#[test]
fn router_chart_with_the_anthropic_parser_loads() {
    // router.epp.parsers: ["openai-parser", "anthropic-parser"]: kvroute
    // parses /v1/messages itself (in routing.paths by default).
    let c = Config::from_json(&fixture("router-chart-openai-anthropic.json")).unwrap();
    assert!(c.routing.paths.iter().any(|p| p == "/v1/messages"));
    assert!(!c.routing.passthrough);
    assert_eq!(c.warnings, Vec::<String>::new());
}

#[test]
fn router_chart_variants_are_refused_where_kvroute_cannot_honour_them() {
    for (file, path, msg) in [
        // modelServers.type: triton (passthrough-parser, triton metrics)
        (
            "router-chart-triton.json",
            "plugins[4].parameters.defaultEngine",
            "vLLM's metrics only",
        ),
        // modelServers.protocol: grpc
        ("router-chart-vllm-grpc.json", "plugins[5].type", "gRPC"),
        // llm-d-router deploy/config/epp-precise-prefix-cache-config.yaml
        (
            "epp-precise-prefix-cache-split.json",
            "plugins[0].parameters.vllm",
            "/render",
        ),
    ] {
        let e = Config::from_json(&fixture(file)).unwrap_err();
        assert_eq!(e.path, path, "{file}: {e}");
        assert!(e.message.contains(msg), "{file}: {e}");
    }
}

#[test]
fn old_sim_config_with_hash_block_size_loads_mapped_with_warnings() {
    let c = Config::from_json(&fixture("sim-epp-hash-block-size.json")).unwrap();
    assert_eq!(
        c.prefix.blocks,
        BlockConfig {
            block_size_tokens: 1,
            chars_per_token: 4,
            max_prefix_tokens: 256,
        }
    );
    assert_eq!(c.prefix.lru_capacity_per_server, 31250);
    assert_eq!(
        c.scheduler.scorers,
        vec![(Scorer::PrefixCache(PrefixCacheScorer::default()), 2.0)]
    );
    // The deprecated apiVersion, then one per old scorer parameter.
    assert_eq!(c.warnings.len(), 4, "{:?}", c.warnings);
    assert!(
        c.warnings[0].starts_with("`apiVersion`"),
        "{:?}",
        c.warnings
    );
}

#[test]
fn deprecated_names_llm_d_still_reads_load_with_a_warning() {
    let warned = |doc: &str| accept(doc).warnings;
    // Older type names.
    let w = warned(&one_plugin("kv-cache", "{}"));
    assert!(
        w.len() == 1
            && w[0].starts_with("`plugins[0].type`")
            && w[0].contains("kv-cache-utilization-scorer"),
        "{w:?}"
    );
    // Deprecated and ignored parameters.
    let w = warned(&one_plugin(
        "active-request-scorer",
        r#"{"requestTimeout":"2m"}"#,
    ));
    assert!(w.len() == 1 && w[0].contains("requestTimeout"), "{w:?}");
    let w = warned(&one_plugin(
        "no-hit-lru-scorer",
        r#"{"prefixPluginType":"prefix-cache-scorer","prefixPluginName":"p"}"#,
    ));
    assert_eq!(w.len(), 2, "{w:?}");
    // Deprecated top-level places.
    let w = warned(&with_endpoints(
        r#"{"plugins":[{"type":"openai-parser"},{"name":"sat","type":"utilization-detector"}],
            "parser":{"pluginRef":"openai-parser"},"saturationDetector":{"pluginRef":"sat"}}"#,
    ));
    assert!(
        w.iter().any(|x| x.starts_with("`parser`"))
            && w.iter().any(|x| x.starts_with("`saturationDetector`")),
        "{w:?}"
    );
    // The current names are quiet.
    assert_eq!(
        warned(&one_plugin("kv-cache-utilization-scorer", "{}")),
        Vec::<String>::new()
    );
}

#[test]
fn precise_split_pipeline_with_data_layer_sources_loads_adapted() {
    // The same config without the token-producer's vLLM /render backend:
    // the data layer wiring (the precise producer as the extractor of
    // endpoint-notification-source) loads; blockSize warns.
    let c = Config::from_json(&fixture("epp-precise-prefix-cache-split-adapted.json")).unwrap();
    assert_eq!(c.precise.as_ref().map(|p| p.block_size), Some(64));
    assert_eq!(c.warnings.len(), 1, "{:?}", c.warnings);
    assert!(
        c.warnings[0].contains("tokenProcessorConfig.blockSize"),
        "{:?}",
        c.warnings
    );
}

#[test]
fn guide_optimized_baseline_current_interface_loads() {
    let c = Config::from_json(&fixture("optimized-baseline-current.json")).unwrap();
    assert_eq!(c.scheduler.filters, vec![AffinityFilter::default()]);
    assert_eq!(
        c.scheduler.scorers,
        vec![(Scorer::TokenLoad(TokenLoadScorer::default()), 1.0)]
    );
}

#[test]
fn guide_precise_prefix_cache_loads_with_the_uds_tokenizer_adapted() {
    let c = Config::from_json(&fixture("precise-prefix-cache-aware.json")).unwrap();
    let p = c.precise.as_ref().expect("precise mode on");
    // tokenProcessorConfig: blockSize 64 (llm-d's older name), hashSeed "42".
    assert_eq!(p.block_size, 64);
    assert_eq!(
        p.hasher,
        crate::precise::vllm_hash::VllmBlockHasher::new(Some("42"))
    );
    assert_eq!(p.max_blocks, 131_072 / 64);
    // The `tokenizer` plugin (UDS): its model is known, but no tokenizer is
    // loaded, so text and chat prompts fall back (token IDs do not).
    assert_eq!(p.tokenizers.len(), 1);
    assert_eq!(
        p.tokenizers[0].model_names,
        vec!["Qwen/Qwen3-32B".to_string()]
    );
    assert!(p.tokenizers[0].tokenizer.is_none());
    // The deprecated scorer scores in the profile with its weight.
    let weights: Vec<(&str, f64)> = c
        .scheduler
        .scorers
        .iter()
        .map(|(s, w)| (s.type_name(), *w))
        .collect();
    assert_eq!(
        weights,
        vec![
            ("prefix-cache-scorer", 2.0),
            ("kv-cache-utilization-scorer", 1.0),
            ("queue-scorer", 1.0)
        ]
    );
    // Approximate mode, the fallback, keeps its defaults.
    assert_eq!(c.prefix.blocks, BlockConfig::default());
}

const TINY_TOKENIZER: &str =
    include_str!("../../../../testdata/tokenizer/tiny-bpe-4096/tokenizer.json");
#[cfg(feature = "tokenizer")]
const TINY_CONFIG: &str =
    include_str!("../../../../testdata/tokenizer/tiny-bpe-4096/tokenizer_config.json");

/// The current llm-d form: token-producer + precise-prefix-cache-producer +
/// prefix-cache-scorer naming it.
fn precise_doc(tokenizer_params: Value, producer_params: Value) -> String {
    with_endpoints(
        &serde_json::json!({
            "plugins": [
                {"type": "token-producer", "parameters": tokenizer_params},
                {"type": "precise-prefix-cache-producer", "parameters": producer_params},
                {"type": "prefix-cache-scorer", "parameters": {"prefixMatchInfoProducerName": "precise-prefix-cache-producer"}},
                {"type": "max-score-picker"}
            ],
            "schedulingProfiles": [{"name": "default", "plugins": [
                {"pluginRef": "prefix-cache-scorer", "weight": 2},
                {"pluginRef": "max-score-picker"}
            ]}],
            "kvEvents": {"enabled": true}
        })
        .to_string(),
    )
}

#[cfg(feature = "tokenizer")]
#[test]
fn precise_producer_with_an_inline_tokenizer_loads() {
    let tok: Value = serde_json::from_str(TINY_TOKENIZER).unwrap();
    let cfg: Value = serde_json::from_str(TINY_CONFIG).unwrap();
    for tokenizer_json in [tok.clone(), Value::String(TINY_TOKENIZER.into())] {
        let doc = precise_doc(
            serde_json::json!({"modelName": "org/tiny", "servedModelNames": ["tiny"],
                               "tokenizerJson": tokenizer_json, "tokenizerConfig": cfg}),
            serde_json::json!({"tokenProcessorConfig": {"blockSizeTokens": 32, "hashSeed": "0"}}),
        );
        let c = Config::from_json(doc.as_bytes()).unwrap();
        let p = c.precise.unwrap();
        assert_eq!(p.block_size, 32);
        assert_eq!(p.tokenizers[0].model_names, vec!["org/tiny", "tiny"]);
        // `tokenizeIn: collector` by default: the workers do not load it.
        assert!(p.tokenizers[0].tokenizer.is_none());
        assert!(p.tokenizers[0].offpath.is_some());
        let doc = precise_doc(
            serde_json::json!({"modelName": "org/tiny", "tokenizeIn": "worker",
                               "tokenizerJson": tokenizer_json, "tokenizerConfig": cfg}),
            serde_json::json!({}),
        );
        let p = Config::from_json(doc.as_bytes()).unwrap().precise.unwrap();
        assert!(p.tokenizers[0].tokenizer.is_some());
        assert!(p.tokenizers[0].offpath.is_none());
    }
    // Defaults: vLLM's block size 16, and vLLM's seed when PYTHONHASHSEED is unset.
    let doc = precise_doc(serde_json::json!({"modelName": "m"}), serde_json::json!({}));
    let p = Config::from_json(doc.as_bytes()).unwrap().precise.unwrap();
    assert_eq!(p.block_size, 16);
    assert_eq!(
        p.hasher,
        crate::precise::vllm_hash::VllmBlockHasher::new(None)
    );
}

/// Without the `tokenizer` feature a config that names a tokenizer is
/// refused, naming the field; token-ID precise mode still loads.
#[cfg(not(feature = "tokenizer"))]
#[test]
fn without_the_tokenizer_feature_a_named_tokenizer_is_refused() {
    let tok = serde_json::json!({"modelName": "m", "tokenizerJson": TINY_TOKENIZER});
    let e = reject(&precise_doc(tok, serde_json::json!({})));
    assert_eq!(e.path, "plugins[0].parameters.tokenizerJson");
    assert!(e.message.contains("`tokenizer` feature"), "{e}");
    let doc = precise_doc(serde_json::json!({"modelName": "m"}), serde_json::json!({}));
    let p = Config::from_json(doc.as_bytes()).unwrap().precise.unwrap();
    assert_eq!(p.block_size, 16);
    assert!(p.tokenizers[0].tokenizer.is_none() && p.tokenizers[0].offpath.is_none());
}

#[test]
fn precise_config_errors_name_the_field() {
    let e = reject(&precise_doc(
        serde_json::json!({"modelName": "m"}),
        serde_json::json!({"tokenProcessorConfig": {"blockSizeTokens": 100000}}),
    ));
    assert_eq!(
        e.path,
        "plugins[1].parameters.tokenProcessorConfig.blockSizeTokens"
    );
    let e = reject(&precise_doc(
        serde_json::json!({"modelName": "m"}),
        serde_json::json!({"tokenProcessorConfig": {"hashseed": "0"}}),
    ));
    assert!(
        e.path
            .starts_with("plugins[1].parameters.tokenProcessorConfig"),
        "{e}"
    );
    let e = reject(&precise_doc(serde_json::json!({}), serde_json::json!({})));
    assert_eq!(e.path, "plugins[0].parameters.modelName");
    let e = reject(&precise_doc(
        serde_json::json!({"modelName": "m", "tokenizerJson": "{not json"}),
        serde_json::json!({}),
    ));
    assert_eq!(e.path, "plugins[0].parameters.tokenizerJson");
    assert!(e.message.contains("does not load"), "{e}");
    let e = reject(&precise_doc(
        serde_json::json!({"modelName": "m", "vllm": {"url": "http://x"}}),
        serde_json::json!({}),
    ));
    assert_eq!(e.path, "plugins[0].parameters.vllm");
    let e = reject(&precise_doc(
        serde_json::json!({"modelName": "m", "tokenizerJson": TINY_TOKENIZER, "chatTemplate": "{% for %}"}),
        serde_json::json!({}),
    ));
    // (Without the `tokenizer` feature a good tokenizer is refused.)
    let says = if cfg!(feature = "tokenizer") {
        "chat template does not compile"
    } else {
        "`tokenizer` feature"
    };
    assert!(e.message.contains(says), "{e}");
    // One token-producer per model: a second one naming a model already
    // served (as its modelName or a served name) is refused.
    let mut v: Value = serde_json::from_str(&precise_doc(
        serde_json::json!({"modelName": "m", "servedModelNames": ["alias"]}),
        serde_json::json!({}),
    ))
    .unwrap();
    v["plugins"].as_array_mut().unwrap().insert(
        1,
        serde_json::json!({"type": "token-producer", "name": "second",
                           "parameters": {"modelName": "other", "servedModelNames": ["alias"]}}),
    );
    let e = reject(&v.to_string());
    assert_eq!(e.path, "plugins[1].parameters");
    assert!(e.message.contains("\"alias\""), "{e}");
    // Precise mode without the servers' held blocks would never match.
    let mut v: Value = serde_json::from_str(&precise_doc(
        serde_json::json!({"modelName": "m"}),
        serde_json::json!({}),
    ))
    .unwrap();
    v.as_object_mut().unwrap().remove("kvEvents");
    let e = reject(&v.to_string());
    assert_eq!(e.path, "plugins[1].type");
    assert!(e.message.contains("kvEvents"), "{e}");
    // The inline tokenizer is bounded.
    let huge = "x".repeat(16 * 1024 * 1024 + 1);
    let e = reject(&precise_doc(
        serde_json::json!({"modelName": "m", "tokenizerJson": huge}),
        serde_json::json!({}),
    ));
    assert_eq!(e.path, "plugins[0].parameters.tokenizerJson");
    assert!(e.message.contains("at most 16777216"), "{e}");
    // A tokenizer without a precise producer has nothing to feed.
    let e = reject(&with_endpoints(
        r#"{"plugins":[{"type":"tokenizer","parameters":{"modelName":"m"}}]}"#,
    ));
    assert_eq!(e.path, "plugins[0].type");
    assert!(e.message.contains("precise-prefix-cache-producer"), "{e}");
    // The producer is not listed in a profile; the deprecated scorer is.
    let e = reject(&with_endpoints(
        r#"{"plugins":[{"type":"precise-prefix-cache-producer"},{"type":"max-score-picker"}],
            "schedulingProfiles":[{"name":"d","plugins":[{"pluginRef":"precise-prefix-cache-producer"}]}],
            "kvEvents":{"enabled":true}}"#,
    ));
    assert!(e.message.contains("data producer"), "{e}");
    let e = reject(&with_endpoints(
        r#"{"plugins":[{"type":"precise-prefix-cache-producer"},{"name":"b","type":"precise-prefix-cache-scorer"}]}"#,
    ));
    assert!(
        e.message.contains("one precise-prefix-cache-producer"),
        "{e}"
    );
}

#[test]
fn guide_precise_prefix_cache_nearest_kvroute_form_loads() {
    let c = Config::from_json(&fixture("precise-prefix-cache-aware-approx.json")).unwrap();
    // decode-filter keeps every (unlabelled) endpoint, so no filter runs.
    assert!(c.scheduler.filters.is_empty());
    let weights: Vec<(&str, f64)> = c
        .scheduler
        .scorers
        .iter()
        .map(|(s, w)| (s.type_name(), *w))
        .collect();
    assert_eq!(
        weights,
        vec![
            ("prefix-cache-scorer", 2.0),
            ("kv-cache-utilization-scorer", 1.0),
            ("queue-scorer", 1.0)
        ]
    );
}

#[test]
fn guide_pd_disaggregation_is_refused_with_the_reason() {
    let e = Config::from_json(&fixture("pd-disaggregation.json")).unwrap_err();
    assert_eq!(e.path, "plugins[0].type");
    assert!(e.message.contains("always-disagg-pd-decider"), "{e}");
    assert!(e.message.contains("disaggregation is not supported"), "{e}");
}

#[test]
fn two_profiles_are_refused_even_with_supported_plugins() {
    let doc = with_endpoints(
        r#"{"plugins":[{"type":"token-load-scorer"},{"type":"active-request-scorer"}],
        "schedulingProfiles":[{"name":"prefill","plugins":[{"pluginRef":"token-load-scorer"}]},
                              {"name":"decode","plugins":[{"pluginRef":"active-request-scorer"}]}]}"#,
    );
    let e = reject(&doc);
    assert_eq!(e.path, "schedulingProfiles");
    assert!(e.message.contains("found 2"), "{e}");
}

#[test]
fn feature_gates() {
    for ok in [
        r#"["haPopulateNonLeaderDatastore"]"#,
        r#"["flowControl=false", "dataLayer", "prepareDataPlugins=true", "enableLegacyMetrics"]"#,
        "[]",
    ] {
        accept(&baseline_with(serde_json::json!({
            "featureGates": serde_json::from_str::<Value>(ok).unwrap()
        })));
    }
    // The flowControl gate turns flow control on (`flow/`).
    let on = Config::from_json(
        baseline_with(serde_json::json!({"featureGates": ["flowControl"]})).as_bytes(),
    )
    .unwrap();
    assert!(on.flow.is_some_and(|f| f.queueing));
    let off = Config::from_json(
        baseline_with(serde_json::json!({"featureGates": ["flowControl=false"]})).as_bytes(),
    )
    .unwrap();
    assert!(off.flow.is_none());
    let e = reject(&baseline_with(
        serde_json::json!({"featureGates": ["dataLayer", "fastMode"]}),
    ));
    assert_eq!(e.path, "featureGates[1]");
    assert!(
        e.message.contains("\"fastMode\"") && e.message.contains("flowControl"),
        "{e}"
    );
    let e = reject(&baseline_with(
        serde_json::json!({"featureGates": ["flowControl=maybe"]}),
    ));
    assert_eq!(e.path, "featureGates[0]");

    // Key by key: llm-d reads the value with Go's ParseBool (lower-cased).
    let on = accept(&baseline_with(
        serde_json::json!({"featureGates": ["flowControl=True"]}),
    ));
    assert!(on.flow.is_some());
    let off = accept(&baseline_with(
        serde_json::json!({"featureGates": ["flowControl=0"]}),
    ));
    assert!(off.flow.is_none());
    // The current gates load quietly; each removed one is a warning naming
    // its entry.
    let quiet = accept(&baseline_with(serde_json::json!({
        "featureGates": ["haPopulateNonLeaderDatastore=false", "flowControl=false"]
    })));
    assert_eq!(quiet.warnings, Vec::<String>::new());
    let old = accept(&baseline_with(serde_json::json!({
        "featureGates": ["haPopulateNonLeaderDatastore", "dataLayer", "enableLegacyMetrics=false"]
    })));
    assert_eq!(old.warnings.len(), 2, "{:?}", old.warnings);
    assert!(
        old.warnings[0].starts_with("`featureGates[1]`")
            && old.warnings[0].contains("\"dataLayer\""),
        "{:?}",
        old.warnings
    );
    assert!(
        old.warnings[1].starts_with("`featureGates[2]`"),
        "{:?}",
        old.warnings
    );
}

#[test]
fn top_level_llm_d_sections() {
    let with_plugins = |extra_plugins: Value, extra: Value| {
        let mut v: Value = serde_json::from_str(&baseline_with(extra)).unwrap();
        let ps = v["plugins"].as_array_mut().unwrap();
        ps.extend(extra_plugins.as_array().unwrap().iter().cloned());
        v.to_string()
    };
    // Accepted and unread: detectors for admission / flow control, the data
    // layer's sources and discovery, the OpenAI parser.
    accept(&with_plugins(
        serde_json::json!([{"name": "sat", "type": "concurrency-detector", "parameters": {"maxConcurrency": 64, "concurrencyMode": "tokens"}},
                           {"type": "openai-parser"}, {"type": "metrics-data-source", "parameters": {"path": "/metrics"}}]),
        serde_json::json!({
            "saturationDetector": {"pluginRef": "sat"},
            "flowControl": {"maxRequests": "1k", "saturationDetector": {"pluginRef": "sat"}, "priorityBands": []},
            "dataLayer": {"injectDefaults": true, "sources": [{"pluginRef": "metrics-data-source", "extractors": []}]},
            "requestHandler": {"parsers": [{"pluginRef": "openai-parser"}]},
            "parser": {"pluginRef": "openai-parser"}
        }),
    ));
    let cases = [
        (
            serde_json::json!({"saturationDetector": {"pluginRef": "nope"}}),
            "saturationDetector.pluginRef",
            "no plugin named",
        ),
        (
            serde_json::json!({"saturationDetector": {"pluginRef": "token-load-scorer"}}),
            "saturationDetector.pluginRef",
            "utilization-detector",
        ),
        (
            serde_json::json!({"saturationDetector": {"plugin": "x"}}),
            "saturationDetector.plugin",
            "unknown field",
        ),
        (
            serde_json::json!({"flowControl": {"maxRequest": 5}}),
            "flowControl.maxRequest",
            "unknown field",
        ),
        (
            serde_json::json!({"dataLayer": {"crossReplicaSyncerPluginRef": "s"}}),
            "dataLayer.crossReplicaSyncerPluginRef",
            "between gateway replicas",
        ),
        (
            serde_json::json!({"dataLayer": {"peerDiscovery": {"pluginRef": "p"}}}),
            "dataLayer.peerDiscovery",
            "peer discovery",
        ),
        (
            serde_json::json!({"dataLayer": {"source": []}}),
            "dataLayer.source",
            "unknown field",
        ),
        (
            serde_json::json!({"requestHandler": {"parsers": [{"pluginRef": "max-score-picker"}]}}),
            "requestHandler.parsers[0].pluginRef",
            "OpenAI",
        ),
        (
            serde_json::json!({"somethingElse": 1}),
            "somethingElse",
            "unknown field",
        ),
    ];
    for (extra, path, msg) in cases {
        let e = reject(&baseline_with(extra.clone()));
        assert_eq!(e.path, path, "{extra}: {e}");
        assert!(e.message.contains(msg), "{extra}: {e}");
    }
    let e = reject(&with_plugins(
        serde_json::json!([{"type": "vllmgrpc-parser"}]),
        serde_json::json!({}),
    ));
    assert_eq!(e.path, "plugins[5].type");
    assert!(e.message.contains("gRPC"), "{e}");
}

#[test]
fn data_layer_metrics_source_and_extractor_are_the_collector() {
    let doc = |plugins: Value, extra: Value| {
        let mut v: Value = serde_json::from_str(&baseline_with(extra)).unwrap();
        let ps = v["plugins"].as_array_mut().unwrap();
        ps.extend(plugins.as_array().unwrap().iter().cloned());
        v.to_string()
    };
    // llm-d's router chart writes both, with these parameters, and no
    // `dataLayer` section; a guide may wire them in `dataLayer.sources`.
    let chart = serde_json::json!([
        {"type": "metrics-data-source", "parameters": {"scheme": "http", "path": "/metrics", "insecureSkipVerify": true}},
        {"type": "core-metrics-extractor"}
    ]);
    let c = accept(&doc(chart.clone(), serde_json::json!({})));
    assert_eq!(c.warnings, Vec::<String>::new());
    accept(&doc(
        chart.clone(),
        serde_json::json!({"dataLayer": {"sources": [{"pluginRef": "metrics-data-source", "extractors": [{"pluginRef": "core-metrics-extractor"}]}]}}),
    ));
    accept(&doc(
        serde_json::json!([{"type": "core-metrics-extractor", "parameters": {"defaultEngine": "vllm", "engineLabelKey": "llm-d.ai/engine-type"}}]),
        serde_json::json!({}),
    ));
    // Parameters kvroute's collector takes elsewhere: a warning each.
    let c = accept(&doc(
        serde_json::json!([{"type": "metrics-data-source", "parameters": {"scheme": "https", "caCertPath": "/ca.pem", "interval": "1s"}}]),
        serde_json::json!({}),
    ));
    assert_eq!(c.warnings.len(), 3, "{:?}", c.warnings);
    assert!(
        c.warnings[0].starts_with("`plugins[5].parameters.scheme`"),
        "{:?}",
        c.warnings
    );

    let cases = [
        (
            serde_json::json!([{"type": "metrics-data-source", "parameters": {"path": "/stats"}}]),
            serde_json::json!({}),
            "plugins[5].parameters.path",
            "collector.metricsPath",
        ),
        (
            serde_json::json!([{"type": "metrics-data-source", "parameters": {"port": 9090}}]),
            serde_json::json!({}),
            "plugins[5].parameters.port",
            "own address",
        ),
        (
            serde_json::json!([{"type": "metrics-data-source", "parameters": {"scheme": "ftp"}}]),
            serde_json::json!({}),
            "plugins[5].parameters.scheme",
            "\"http\"",
        ),
        (
            serde_json::json!([{"type": "metrics-data-source", "parameters": {"paht": "/metrics"}}]),
            serde_json::json!({}),
            "plugins[5].parameters.paht",
            "unknown field",
        ),
        (
            serde_json::json!([{"type": "core-metrics-extractor", "parameters": {"defaultEngine": "sglang"}}]),
            serde_json::json!({}),
            "plugins[5].parameters.defaultEngine",
            "vLLM's metrics only",
        ),
        (
            serde_json::json!([{"type": "core-metrics-extractor", "parameters": {"engineConfigs": []}}]),
            serde_json::json!({}),
            "plugins[5].parameters.engineConfigs",
            "not supported",
        ),
        (
            chart.clone(),
            serde_json::json!({"dataLayer": {"sources": [{"pluginRef": "core-metrics-extractor"}]}}),
            "dataLayer.sources[0].pluginRef",
            "data source",
        ),
        (
            chart.clone(),
            serde_json::json!({"dataLayer": {"sources": [{"pluginRef": "metrics-data-source", "extractors": [{"pluginRef": "metrics-data-source"}]}]}}),
            "dataLayer.sources[0].extractors[0].pluginRef",
            "extractor",
        ),
        (
            chart.clone(),
            serde_json::json!({"dataLayer": {"sources": [{"pluginRef": "models-data-source"}]}}),
            "dataLayer.sources[0].pluginRef",
            "no plugin named",
        ),
        (
            chart,
            serde_json::json!({"dataLayer": {"discovery": {"pluginRef": "f"}}}),
            "dataLayer.discovery",
            "`endpoints`",
        ),
    ];
    for (plugins, extra, path, msg) in cases {
        let e = reject(&doc(plugins.clone(), extra.clone()));
        assert_eq!(e.path, path, "{plugins} {extra}: {e}");
        assert!(e.message.contains(msg), "{plugins} {extra}: {e}");
    }
    // The path is the collector's, when both say the same.
    let mut v: Value = serde_json::from_str(&doc(
        serde_json::json!([{"type": "metrics-data-source", "parameters": {"path": "/stats"}}]),
        serde_json::json!({}),
    ))
    .unwrap();
    v["collector"] = serde_json::json!({"metricsPath": "/stats"});
    assert_eq!(accept(&v.to_string()).collector.metrics_path, "/stats");
}

#[test]
fn old_plugin_type_names_are_aliases() {
    let doc = with_endpoints(
        r#"{"plugins":[{"type":"approx-prefix-cache-producer"},{"type":"single-profile"},
        {"type":"prefix-cache"},{"type":"queue"},{"type":"kv-cache-scorer"},{"type":"kv-cache"},{"type":"max-score"}],
        "schedulingProfiles":[{"name":"legacy","plugins":[{"pluginRef":"prefix-cache","weight":3},
          {"pluginRef":"queue","weight":2},{"pluginRef":"kv-cache-scorer","weight":2},{"pluginRef":"kv-cache","weight":1},
          {"pluginRef":"max-score"}]}]}"#,
    );
    let c = accept(&doc);
    let types: Vec<&str> = c
        .scheduler
        .scorers
        .iter()
        .map(|(s, _)| s.type_name())
        .collect();
    assert_eq!(
        types,
        vec![
            "prefix-cache-scorer",
            "queue-scorer",
            "kv-cache-utilization-scorer",
            "kv-cache-utilization-scorer"
        ]
    );
    assert_eq!(c.scheduler.picker, Picker::MaxScore(TieBreak::Random));
}

#[test]
fn inert_plugins_in_profiles() {
    let doc = |plugin: &str, profile_entry: &str| {
        with_endpoints(&format!(
            r#"{{"plugins":[{{"type":"token-load-scorer"}},{plugin}],
            "schedulingProfiles":[{{"name":"d","plugins":[{profile_entry},{{"pluginRef":"token-load-scorer"}}]}}]}}"#
        ))
    };
    // decode-filter keeps every kvroute endpoint: accepted, nothing runs.
    let c = accept(&doc(
        r#"{"type":"decode-filter"}"#,
        r#"{"pluginRef":"decode-filter"}"#,
    ));
    assert!(c.scheduler.filters.is_empty());
    let e = reject(&doc(
        r#"{"type":"decode-filter"}"#,
        r#"{"pluginRef":"decode-filter","weight":2}"#,
    ));
    assert_eq!(e.path, "schedulingProfiles[0].plugins[0].weight");
    for (plugin, name, msg) in [
        (
            r#"{"type":"single-profile-handler"}"#,
            "single-profile-handler",
            "profile handler",
        ),
        (
            r#"{"type":"utilization-detector"}"#,
            "utilization-detector",
            "filter role",
        ),
        (
            r#"{"type":"openai-parser"}"#,
            "openai-parser",
            "requestHandler",
        ),
    ] {
        let e = reject(&doc(plugin, &format!(r#"{{"pluginRef":"{name}"}}"#)));
        assert_eq!(e.path, "schedulingProfiles[0].plugins[0].pluginRef", "{e}");
        assert!(e.message.contains(msg), "{e}");
    }
    // Their parameters are still checked.
    let e = reject(&doc(
        r#"{"type":"single-profile-handler","parameters":{"x":1}}"#,
        r#"{"pluginRef":"token-load-scorer","weight":1}"#,
    ));
    assert_eq!(e.path, "plugins[1].parameters.x");
    let e = reject(&doc(
        r#"{"type":"utilization-detector","parameters":{"kvCacheUtilThreshold":1.5}}"#,
        r#"{"pluginRef":"token-load-scorer","weight":1}"#,
    ));
    assert_eq!(e.path, "plugins[1].parameters.kvCacheUtilThreshold");
}

#[test]
fn known_llm_d_types_are_refused_with_a_reason() {
    for (kind, msg) in [
        ("pd-profile-handler", "disaggregation"),
        ("prefill-filter", "disaggregation"),
        ("latency-scorer", "latency-predictor"),
        ("random-picker", "weighted-random-picker"),
        ("slo-deadline-ordering-policy", "flow control runs"),
        ("sheddable-eviction-filter", "does not evict"),
        ("multicluster-queue-scorer", "multi-cluster"),
        ("agent-identity", "sessionIdConfig.sources"),
        ("vllmgrpc-parser", "gRPC"),
        ("sglanghttp-parser", "SGLang"),
    ] {
        let e = reject(&with_endpoints(&format!(
            r#"{{"plugins":[{{"type":"{kind}"}}],"schedulingProfiles":[{{"name":"x","plugins":[]}}]}}"#
        )));
        assert_eq!(e.path, "plugins[0].type", "{kind}");
        assert!(e.message.contains(kind) && e.message.contains(msg), "{e}");
    }
}

/// One plugin of `kind` with `params`, listed alone in the profile unless it
/// is a producer.
fn one_plugin(kind: &str, params: &str) -> String {
    let profile = if kind.ends_with("-producer") {
        String::new()
    } else {
        format!(r#"{{"pluginRef":"{kind}"}}"#)
    };
    with_endpoints(&format!(
        r#"{{"plugins":[{{"type":"{kind}","parameters":{params}}}],"schedulingProfiles":[{{"name":"x","plugins":[{profile}]}}]}}"#
    ))
}

#[test]
fn affinity_filter_token_gap_parameters() {
    let f = |params: &str| {
        accept(&one_plugin("prefix-cache-affinity-filter", params))
            .scheduler
            .filters[0]
            .clone()
    };
    // The token gate alone: llm-d's earlier interface; the TTFT gate's
    // default there read the latency predictor, so it is off.
    let g = f(r#"{"maxTokensInFlightPenalty":286720}"#);
    assert_eq!(
        (g.max_tokens_in_flight_penalty, g.max_ttft_penalty_ms),
        (286_720, 0.0)
    );
    // Both given: both gates, either releases.
    let g = f(r#"{"maxTokensInFlightPenalty":1000,"maxTTFTPenaltyMs":5000}"#);
    assert_eq!(
        (g.max_tokens_in_flight_penalty, g.max_ttft_penalty_ms),
        (1000, 5000.0)
    );
    // Neither: the current default, 18 s × 15928 tok/s.
    let g = f("{}");
    assert_eq!(
        (g.max_tokens_in_flight_penalty, g.max_ttft_penalty_ms),
        (0, 18_000.0)
    );
    let e = reject(&one_plugin(
        "prefix-cache-affinity-filter",
        r#"{"maxTokensInFlightPenalty":-1}"#,
    ));
    assert_eq!(e.path, "plugins[0].parameters.maxTokensInFlightPenalty");
    let e = reject(&one_plugin(
        "prefix-cache-affinity-filter",
        r#"{"latencyPredictionInfoProducerName":"p"}"#,
    ));
    assert_eq!(
        e.path,
        "plugins[0].parameters.latencyPredictionInfoProducerName"
    );
}

#[test]
fn prefix_cache_scorer_match_length() {
    let c = accept(&one_plugin(
        "prefix-cache-scorer",
        r#"{"matchLengthWeight":0.3,"matchLengthScaleTokens":4096}"#,
    ));
    assert_eq!(
        c.scheduler.scorers[0].0,
        Scorer::PrefixCache(PrefixCacheScorer {
            match_length_weight: 0.3,
            match_length_scale_tokens: 4096,
            sticky_only: false,
            skip_released: false,
        })
    );
    let c = accept(&one_plugin(
        "prefix-cache-scorer",
        r#"{"skipReleased":true}"#,
    ));
    assert_eq!(
        c.scheduler.scorers[0].0,
        Scorer::PrefixCache(PrefixCacheScorer {
            skip_released: true,
            ..PrefixCacheScorer::default()
        })
    );
    let e = Config::from_json(
        one_plugin(
            "prefix-cache-scorer",
            r#"{"skipReleased":true,"stickyOnly":true}"#,
        )
        .as_bytes(),
    )
    .unwrap_err();
    assert!(e.to_string().contains("skipReleased"), "{e}");
    let c = accept(&one_plugin("prefix-cache-scorer", "{}"));
    assert_eq!(
        c.scheduler.scorers[0].0,
        Scorer::PrefixCache(PrefixCacheScorer::default())
    );
    let c = accept(&one_plugin("prefix-cache-scorer", r#"{"stickyOnly":true}"#));
    assert_eq!(
        c.scheduler.scorers[0].0,
        Scorer::PrefixCache(PrefixCacheScorer {
            sticky_only: true,
            ..Default::default()
        })
    );
    let e = reject(&one_plugin("prefix-cache-scorer", r#"{"stickyOnly":1}"#));
    assert_eq!(e.path, "plugins[0].parameters.stickyOnly");
    let e = reject(&one_plugin(
        "prefix-cache-scorer",
        r#"{"matchLengthWeight":1.5}"#,
    ));
    assert_eq!(e.path, "plugins[0].parameters.matchLengthWeight");
    let e = reject(&one_plugin(
        "prefix-cache-scorer",
        r#"{"matchLengthWeight":0.5,"matchLengthScaleTokens":0}"#,
    ));
    assert_eq!(e.path, "plugins[0].parameters.matchLengthScaleTokens");
    let e = reject(&one_plugin(
        "prefix-cache-scorer",
        r#"{"maxPrefixTokensToMatch":4096}"#,
    ));
    assert_eq!(e.path, "plugins[0].parameters.maxPrefixTokensToMatch");
    assert!(e.message.contains("approx-prefix-cache-producer"), "{e}");
}

#[test]
fn old_prefix_scorer_index_parameters_map_to_the_producer_with_warnings() {
    // llm-d's sim config before 2026-03: 5 characters per block, 256
    // blocks, 31250 entries per server.
    let c = accept(&one_plugin(
        "prefix-cache-scorer",
        r#"{"hashBlockSize":5,"maxPrefixBlocksToMatch":256,"lruCapacityPerServer":31250,"matchLengthWeight":0.5}"#,
    ));
    // 5 bytes → 1 token of 4 bytes; 256 blocks × 1 token.
    assert_eq!(
        c.prefix.blocks,
        BlockConfig {
            block_size_tokens: 1,
            chars_per_token: 4,
            max_prefix_tokens: 256,
        }
    );
    assert_eq!(c.prefix.lru_capacity_per_server, 31250);
    assert!(c.prefix.auto_tune);
    // The scorer keeps its own parameter.
    assert_eq!(
        c.scheduler.scorers[0].0,
        Scorer::PrefixCache(PrefixCacheScorer {
            match_length_weight: 0.5,
            ..Default::default()
        })
    );
    assert_eq!(c.warnings.len(), 3, "{:?}", c.warnings);
    for (w, f) in c.warnings.iter().zip([
        "hashBlockSize",
        "maxPrefixBlocksToMatch",
        "lruCapacityPerServer",
    ]) {
        assert!(
            w.starts_with(&format!("`plugins[0].parameters.{f}`"))
                && w.contains("current llm-d refuses"),
            "{w}"
        );
    }
    assert!(
        c.warnings[0].contains("blockSizeTokens 1"),
        "{:?}",
        c.warnings
    );
    assert!(
        c.warnings[1].contains("maxPrefixTokensToMatch 256"),
        "{:?}",
        c.warnings
    );

    // 64 characters (the old default) are 16 tokens; blockSizeTokens
    // wins over the character size, as it did in llm-d.
    let bs = |params: &str| {
        accept(&one_plugin("prefix-cache-scorer", params))
            .prefix
            .blocks
    };
    assert_eq!(bs(r#"{"blockSize":64}"#).block_size_tokens, 16);
    assert_eq!(
        bs(r#"{"blockSize":64,"blockSizeTokens":32}"#).block_size_tokens,
        32
    );
    let b = bs(r#"{"blockSizeTokens":32,"maxPrefixBlocksToMatch":10}"#);
    assert_eq!((b.block_size_tokens, b.max_prefix_tokens), (32, 320));
    // Unset ones keep the producer's defaults.
    assert_eq!(bs(r#"{"lruCapacityPerServer":7}"#), BlockConfig::default());
    assert!(
        !accept(&one_plugin("prefix-cache-scorer", r#"{"autoTune":false}"#))
            .prefix
            .auto_tune
    );

    // Errors name the old field.
    let e = reject(&one_plugin(
        "prefix-cache-scorer",
        r#"{"hashBlockSize":64,"blockSize":64}"#,
    ));
    assert_eq!(e.path, "plugins[0].parameters.blockSize");
    let e = reject(&one_plugin(
        "prefix-cache-scorer",
        r#"{"hashBlockSize":"big"}"#,
    ));
    assert_eq!(e.path, "plugins[0].parameters.hashBlockSize");
    let e = reject(&one_plugin(
        "prefix-cache-scorer",
        r#"{"maxPrefixBlocksToMatch":0}"#,
    ));
    assert_eq!(e.path, "plugins[0].parameters.maxPrefixBlocksToMatch");

    // One index: the producer's, or the scorers' when they agree.
    let two = |a: &str, b: &str| {
        with_endpoints(&format!(
            r#"{{"plugins":[{{"name":"a","type":"prefix-cache-scorer","parameters":{a}}},{{"name":"b","type":"prefix-cache-scorer","parameters":{b}}}],
              "schedulingProfiles":[{{"name":"x","plugins":[{{"pluginRef":"a"}},{{"pluginRef":"b"}}]}}]}}"#
        ))
    };
    let c = accept(&two(r#"{"hashBlockSize":64}"#, r#"{"hashBlockSize":64}"#));
    assert_eq!(c.prefix.blocks.block_size_tokens, 16);
    let e = reject(&two(r#"{"hashBlockSize":64}"#, r#"{"hashBlockSize":32}"#));
    assert_eq!(e.path, "plugins[1].parameters");
    let e = reject(&with_endpoints(
        r#"{"plugins":[{"type":"approx-prefix-cache-producer"},{"type":"prefix-cache-scorer","parameters":{"lruCapacityPerServer":5}}],
            "schedulingProfiles":[{"name":"x","plugins":[{"pluginRef":"prefix-cache-scorer"}]}]}"#,
    ));
    assert_eq!(e.path, "plugins[1].parameters");
}

#[test]
fn producer_parameters_and_llm_d_defaults() {
    let inflight = |params: &str| {
        accept(&one_plugin("inflight-load-producer", params))
            .scheduler
            .inflight
    };
    assert_eq!(inflight("{}").output_ratio, 1.5);
    assert_eq!(inflight(r#"{"outputRatio":2500}"#).output_ratio, 2500.0);
    assert!(!inflight(r#"{"syncCrossReplicaState":false}"#).add_estimated_output_tokens);
    let e = reject(&one_plugin(
        "inflight-load-producer",
        r#"{"outputRatio":-0.5}"#,
    ));
    assert_eq!(e.path, "plugins[0].parameters.outputRatio");

    let prefix = |params: &str| accept(&one_plugin("approx-prefix-cache-producer", params)).prefix;
    // The token cap wins; with it at 0, the block cap (default 2048 blocks).
    assert_eq!(prefix("{}").blocks.max_prefix_tokens, 131_072);
    assert_eq!(
        prefix(r#"{"maxPrefixTokensToMatch":0}"#)
            .blocks
            .max_prefix_tokens,
        2048 * 64
    );
    assert_eq!(
        prefix(r#"{"maxPrefixTokensToMatch":0,"maxPrefixBlocksToMatch":0}"#)
            .blocks
            .max_prefix_tokens,
        0
    );
    // Deprecated `blockSize` stands in for an absent `blockSizeTokens`,
    // with a warning.
    assert_eq!(prefix(r#"{"blockSize":16}"#).blocks.block_size_tokens, 16);
    let warned =
        |params: &str| accept(&one_plugin("approx-prefix-cache-producer", params)).warnings;
    assert_eq!(warned("{}"), Vec::<String>::new());
    let w = warned(r#"{"blockSize":16}"#);
    assert!(
        w.len() == 1 && w[0].starts_with("`plugins[0].parameters.blockSize`"),
        "{w:?}"
    );
    // Deprecated maxPrefixBlocksToMatch: read only with the token cap at 0;
    // the warning says which.
    let w = warned(r#"{"maxPrefixBlocksToMatch":256}"#);
    assert!(w.len() == 1 && w[0].contains("ignored"), "{w:?}");
    let w = warned(r#"{"maxPrefixBlocksToMatch":256,"maxPrefixTokensToMatch":0}"#);
    assert!(w.len() == 1 && w[0].contains("16384 tokens"), "{w:?}");
    assert_eq!(
        prefix(r#"{"blockSize":16,"blockSizeTokens":32}"#)
            .blocks
            .block_size_tokens,
        32
    );
    let e = reject(&one_plugin(
        "approx-prefix-cache-producer",
        r#"{"blockSize":100000}"#,
    ));
    assert_eq!(e.path, "plugins[0].parameters.blockSize");

    let c = accept(&one_plugin(
        "no-hit-lru-scorer",
        r#"{"prefixPluginType":"prefix-cache-scorer","prefixPluginName":"p","lruSize":8}"#,
    ));
    assert_eq!(c.scheduler.scorers[0].0, Scorer::NoHitLru);
}

#[test]
fn collector_mode_and_lease_are_checked() {
    let base = with_endpoints(BASELINE);
    let with = |collector: Value| {
        let mut v: Value = serde_json::from_str(&base).unwrap();
        v["collector"] = collector;
        v.to_string()
    };
    let c = Config::from_json(base.as_bytes()).unwrap();
    assert_eq!(c.collector.mode, CollectorMode::Singleton);
    assert_eq!(c.collector.lease_ms, 3000);
    let c =
        Config::from_json(with(serde_json::json!({"mode": "lease", "leaseMs": 5000})).as_bytes())
            .unwrap();
    assert_eq!(
        (c.collector.mode, c.collector.lease_ms),
        (CollectorMode::Lease, 5000)
    );
    let e = reject(&with(serde_json::json!({"mode": "leader"}))).to_string();
    assert!(e.contains("collector.mode") && e.contains("lease"), "{e}");
    // The lease outlives a poll interval.
    let e = reject(&with(
        serde_json::json!({"mode": "lease", "metricsPollIntervalMs": 2000, "leaseMs": 1000}),
    ))
    .to_string();
    assert!(e.contains("collector.leaseMs"), "{e}");
    // Every accepted poll interval has a valid default lease, in either mode
    // (a 10-minute ceiling alone refused polls above 200 s without leaseMs).
    for mode in ["singleton", "lease"] {
        let c = Config::from_json(
            with(serde_json::json!({"mode": mode, "metricsPollIntervalMs": 3_600_000})).as_bytes(),
        )
        .unwrap();
        assert_eq!(c.collector.lease_ms, 10_800_000);
    }
    let e = reject(&with(
        serde_json::json!({"mode": "lease", "leaseMs": 600_001}),
    ))
    .to_string();
    assert!(e.contains("collector.leaseMs"), "{e}");
}

#[test]
fn peak_prefill_throughput_auto() {
    let f = |params: &str| {
        accept(&one_plugin("prefix-cache-affinity-filter", params))
            .scheduler
            .filters[0]
            .clone()
    };
    let peak = |v: &str| format!(r#"{{"peakPrefillThroughput":{v}}}"#);
    // A number is fixed, as before.
    let g = f(&peak("20480"));
    assert_eq!(
        (g.peak_prefill_throughput, g.prefill_auto),
        (20_480.0, None)
    );
    // "auto": estimated, starting from (and falling back to) the default.
    let g = f(&peak(r#""auto""#));
    assert_eq!(g.peak_prefill_throughput, 15_928.0);
    assert_eq!(g.prefill_auto, Some(PrefillRateParams::around(15_928.0)));
    // The object form sets the bounds and knobs.
    let g = f(&peak(
        r#"{"auto":true,"initial":10000,"floor":2000,"ceiling":50000,"smoothing":0.5,"minTokensPerRequest":1024}"#,
    ));
    assert_eq!(g.peak_prefill_throughput, 10_000.0);
    assert_eq!(
        g.prefill_auto,
        Some(PrefillRateParams {
            initial: 10_000.0,
            floor: 2_000.0,
            ceiling: 50_000.0,
            smoothing: 0.5,
            min_tokens_per_request: 1024.0,
        })
    );
    // Omitted bounds are ÷8 and ×8 around initial; auto defaults to true.
    let g = f(&peak(r#"{"initial":8000}"#));
    assert_eq!(
        g.prefill_auto.map(|p| (p.floor, p.ceiling)),
        Some((1000.0, 64_000.0))
    );
    // "auto": false is the fixed initial value.
    let g = f(&peak(r#"{"auto":false,"initial":8000}"#));
    assert_eq!((g.peak_prefill_throughput, g.prefill_auto), (8000.0, None));

    let path = "plugins[0].parameters.peakPrefillThroughput";
    let bad = |v: &str| reject(&one_plugin("prefix-cache-affinity-filter", &peak(v)));
    let e = bad(r#""automatic""#);
    assert_eq!(e.path, path);
    assert!(e.message.contains("\"auto\""), "{e}");
    let e = bad(r#"{"auto":true,"flor":1}"#);
    assert_eq!(e.path, format!("{path}.flor"));
    let e = bad(r#"{"initial":1000,"floor":2000}"#);
    assert_eq!(e.path, path);
    assert!(e.message.contains("floor ≤ initial ≤ ceiling"), "{e}");
    let e = bad(r#"{"initial":0}"#);
    assert_eq!(e.path, format!("{path}.initial"));
    let e = bad(r#"{"smoothing":0}"#);
    assert_eq!(e.path, format!("{path}.smoothing"));
    let e = bad(r#"{"smoothing":1.5}"#);
    assert_eq!(e.path, format!("{path}.smoothing"));
    let e = bad(r#"{"minTokensPerRequest":0}"#);
    assert_eq!(e.path, format!("{path}.minTokensPerRequest"));
    // With "auto": false the estimator's knobs are refused, not ignored.
    for knob in ["floor", "ceiling", "smoothing", "minTokensPerRequest"] {
        let e = bad(&format!(r#"{{"auto":false,"initial":8000,"{knob}":1}}"#));
        assert_eq!(e.path, format!("{path}.{knob}"));
        assert!(e.message.contains("only with \"auto\": true"), "{e}");
    }
    let e = bad(r#"{"auto":false,"initial":-1}"#);
    assert_eq!(e.path, format!("{path}.initial"));
    let e = bad("-1");
    assert_eq!(e.path, path);
    let e = bad("true");
    assert_eq!(e.path, path);
    assert!(e.message.contains("not allowed"), "{e}");
}

#[test]
fn fuzz_seed_with_auto_peak_prefill_loads() {
    let doc = include_str!("../../../../fuzz/seeds/config/peak-prefill-auto.json");
    let c = Config::from_json(doc.as_bytes()).unwrap();
    let p = c.scheduler.filters[0].prefill_auto.unwrap();
    assert_eq!(
        (p.initial, p.floor, p.ceiling),
        (20_480.0, 2_560.0, 163_840.0)
    );
}

#[test]
fn max_score_picker_tie_break() {
    let doc = |picker: &str| {
        format!(
            r#"{{"endpoints":{{"static":["127.0.0.1:1"]}},"plugins":[{{"type":"token-load-scorer"}},{picker}],
                "schedulingProfiles":[{{"name":"d","plugins":[{{"pluginRef":"token-load-scorer"}},{{"pluginRef":"p"}}]}}]}}"#
        )
    };
    let c = Config::from_json(
        doc(r#"{"type":"max-score-picker","name":"p","parameters":{"tieBreak":"prefix"}}"#)
            .as_bytes(),
    )
    .unwrap();
    assert_eq!(c.scheduler.picker, Picker::MaxScore(TieBreak::Prefix));
    let c = Config::from_json(doc(r#"{"type":"max-score-picker","name":"p"}"#).as_bytes()).unwrap();
    assert_eq!(c.scheduler.picker, Picker::MaxScore(TieBreak::Random));
    let e = Config::from_json(
        doc(r#"{"type":"max-score-picker","name":"p","parameters":{"tieBreak":"first"}}"#)
            .as_bytes(),
    )
    .unwrap_err();
    assert!(e.to_string().contains("tieBreak"), "{e}");
    let e = Config::from_json(
        doc(r#"{"type":"weighted-random-picker","name":"p","parameters":{"tieBreak":"prefix"}}"#)
            .as_bytes(),
    )
    .unwrap_err();
    assert!(e.to_string().contains("tieBreak"), "{e}");
}

#[test]
fn shipped_config_breaks_ties_by_prefix() {
    // The shipped file leaves `endpoints` to the deployment (render.py adds them).
    let mut v: Value =
        serde_json::from_slice(include_bytes!("../../../../envoy/kvroute-config.json")).unwrap();
    v["endpoints"] = serde_json::json!({"static": ["127.0.0.1:1"]});
    let c = Config::from_json(v.to_string().as_bytes()).unwrap();
    assert_eq!(c.scheduler.picker, Picker::MaxScore(TieBreak::Prefix));
}

/// The shipped default profile (`kvroute-default`), in both shipped files,
/// compiles to kvroute's own plugins; llm-d's matched set (the same file
/// with llm-d's plugin names) compiles to exactly llm-d's semantics.
#[test]
fn shipped_files_run_the_kvroute_default_profile() {
    use crate::scheduling::affinity_filter::LoadSignal;
    for bytes in [
        &include_bytes!("../../../../envoy/kvroute-config.json")[..],
        &include_bytes!("../../../../istio/kvroute-plugin.json")[..],
    ] {
        let mut v: Value = serde_json::from_slice(bytes).unwrap();
        assert_eq!(v["schedulingProfiles"][0]["name"], "kvroute-default");
        v["endpoints"] = serde_json::json!({"static": ["127.0.0.1:1"]});
        let c = Config::from_json(v.to_string().as_bytes()).unwrap();
        let s = &c.scheduler;
        assert_eq!(s.filters[0].load_signal, LoadSignal::Saturation);
        assert!(s.inflight.hold_kv_until_end && s.inflight.add_estimated_output_tokens);
        assert!(c.prefix.learn_bytes_per_token);
        assert_eq!(
            c.prefix.blocks.chars_per_token, 4,
            "blocks stay cut at 4 bytes/token"
        );
        let names: Vec<_> = s.scorers.iter().map(|(x, _)| x.type_name()).collect();
        assert_eq!(
            names,
            [
                "kvroute-load-scorer",
                "cache-balance-scorer",
                "prefix-cache-scorer"
            ]
        );
        assert_eq!(
            s.scorers[2],
            (
                Scorer::PrefixCache(PrefixCacheScorer {
                    skip_released: true,
                    ..Default::default()
                }),
                0.5
            )
        );
        assert_eq!(s.picker, Picker::MaxScore(TieBreak::Prefix));
    }
    // llm-d's matched profile: nothing of kvroute's switched on.
    let c = Config::from_json(with_endpoints(BASELINE).as_bytes()).unwrap();
    let s = &c.scheduler;
    assert_eq!(s.filters[0].load_signal, LoadSignal::Inflight);
    assert!(!s.filters[0].count_unresolved_blocks);
    assert!(!s.inflight.hold_kv_until_end);
    assert!(!c.prefix.learn_bytes_per_token);
    assert_eq!(s.scorers[0].0.type_name(), "token-load-scorer");
}

#[test]
fn kvroute_plugin_parameters_are_checked() {
    let bad = |plugin: &str, field: &str| {
        let doc = format!(
            r#"{{"plugins":[{plugin},{{"type":"max-score-picker"}}],
            "schedulingProfiles":[{{"name":"d","plugins":[{{"pluginRef":"x"}},{{"pluginRef":"max-score-picker"}}]}}]}}"#
        );
        let e = Config::from_json(doc.as_bytes()).unwrap_err();
        assert!(e.to_string().contains(field), "{e}");
    };
    bad(
        r#"{"type":"prefix-cache-affinity-filter","name":"x","parameters":{"loadSignal":"kv"}}"#,
        "loadSignal",
    );
    bad(
        r#"{"type":"prefix-cache-affinity-filter","name":"x","parameters":{"countUnresolvedBlocks":1}}"#,
        "countUnresolvedBlocks",
    );
    bad(
        r#"{"type":"kvroute-load-scorer","name":"x","parameters":{"queueThresholdTokens":0}}"#,
        "queueThresholdTokens",
    );
    bad(
        r#"{"type":"kvroute-load-scorer","name":"x","parameters":{"kvCapacity":5}}"#,
        "kvCapacity",
    );
    bad(
        r#"{"type":"cache-balance-scorer","name":"x","parameters":{"weight":5}}"#,
        "weight",
    );
    // The learnt output estimate is only charged with addEstimatedOutputTokens.
    bad(
        r#"{"type":"inflight-load-producer","name":"x","parameters":{"learnOutputTokens":true}}"#,
        "learnOutputTokens",
    );
    // charsPerToken: a whole number, or "auto".
    let producer = |v: &str| {
        Config::from_json(
            with_endpoints(&format!(
                r#"{{"plugins":[{{"type":"approx-prefix-cache-producer","parameters":{{"charsPerToken":{v}}}}}]}}"#
            ))
            .as_bytes(),
        )
    };
    let auto = producer(r#""auto""#).unwrap();
    assert!(auto.prefix.learn_bytes_per_token);
    assert_eq!(auto.prefix.blocks.chars_per_token, 4);
    let fixed = producer("3").unwrap();
    assert!(!fixed.prefix.learn_bytes_per_token);
    assert_eq!(fixed.prefix.blocks.chars_per_token, 3);
    for wrong in [r#""learn""#, "2.5", "-1", "0", "65"] {
        let e = producer(wrong).unwrap_err();
        assert!(e.to_string().contains("charsPerToken"), "{wrong}: {e}");
    }
}

#[cfg(feature = "tokenizer")]
#[test]
fn tokenizer_by_reference_and_tokenize_in_errors_name_the_field() {
    let pin = "ab".repeat(32);
    let ok = |params: Value| {
        Config::from_json(precise_doc(params, serde_json::json!({})).as_bytes())
            .unwrap()
            .precise
            .unwrap()
    };
    let p = ok(
        serde_json::json!({"modelName": "m", "tokenizerUrl": "http://models:8080/q/tokenizer.json",
        "tokenizerSha256": pin.to_uppercase(), "tokenizerCluster": "models"}),
    );
    let t = &p.tokenizers[0];
    assert!(t.tokenizer.is_none() && t.offpath.is_some());
    let cases = [
        (
            serde_json::json!({"tokenizeIn": "gpu", "tokenizerUrl": "http://a/b"}),
            "tokenizeIn",
            "not allowed",
        ),
        (
            serde_json::json!({"tokenizeIn": "collector"}),
            "tokenizeIn",
            "tokenizerJson",
        ),
        (
            serde_json::json!({"tokenizeIn": "worker", "tokenizerUrl": "http://a/b", "tokenizerSha256": pin, "tokenizerCluster": "c"}),
            "tokenizeIn",
            "collector",
        ),
        (
            serde_json::json!({"tokenizerUrl": "https://a/b", "tokenizerSha256": pin, "tokenizerCluster": "c"}),
            "tokenizerUrl",
            "http://",
        ),
        (
            serde_json::json!({"tokenizerUrl": "http://a/b", "tokenizerCluster": "c"}),
            "tokenizerSha256",
            "required",
        ),
        (
            serde_json::json!({"tokenizerUrl": "http://a/b", "tokenizerSha256": "abc", "tokenizerCluster": "c"}),
            "tokenizerSha256",
            "64 hex",
        ),
        (
            serde_json::json!({"tokenizerUrl": "http://a/b", "tokenizerSha256": pin}),
            "tokenizerCluster",
            "required",
        ),
        (
            serde_json::json!({"tokenizerSha256": pin}),
            "tokenizerUrl",
            "required",
        ),
        (
            serde_json::json!({"tokenizerUrl": "http://a/b", "tokenizerSha256": pin, "tokenizerCluster": "c", "tokenizerJson": "{}"}),
            "tokenizerUrl",
            "not both",
        ),
        (
            serde_json::json!({"tokenizerUrl": "http://a/b", "tokenizerSha256": pin, "tokenizerCluster": "c", "tokenizerTimeoutMs": 5}),
            "tokenizerTimeoutMs",
            "",
        ),
    ];
    for (mut params, field, says) in cases {
        params["modelName"] = "m".into();
        let e = Config::from_json(precise_doc(params.clone(), serde_json::json!({})).as_bytes())
            .expect_err(&params.to_string());
        assert_eq!(
            e.path,
            format!("plugins[0].parameters.{field}"),
            "{params}: {e}"
        );
        assert!(e.message.contains(says), "{params}: {e}");
    }
}

/// The Istio singleton shape's precise-mode example: the tokenizer by
/// reference (an `outbound|…` cluster, a sha256 pin), loaded by the
/// collector only; small enough for a Kubernetes object. (Without the
/// `tokenizer` feature a config naming a tokenizer is refused.)
#[cfg(feature = "tokenizer")]
#[test]
fn the_istio_precise_example_gives_the_tokenizer_by_reference() {
    let bytes = &include_bytes!("../../../../istio/singleton/kvroute-plugin-precise.json")[..];
    assert!(bytes.len() < 16 * 1024, "{} bytes", bytes.len());
    let mut v: Value = serde_json::from_slice(bytes).unwrap();
    v["endpoints"] = serde_json::json!({"static": ["127.0.0.1:1"]});
    let c = Config::from_json(v.to_string().as_bytes()).unwrap();
    assert_eq!(c.collector.mode, crate::config::CollectorMode::Singleton);
    let p = c.precise.unwrap();
    let t = &p.tokenizers[0];
    assert!(t.tokenizer.is_none());
    match &t.offpath.as_ref().unwrap().source {
        crate::precise::offpath::TokenizerSource::Url { cluster, .. } => {
            assert!(cluster.starts_with("outbound|80||"))
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn the_model_header_is_off_by_default_and_must_be_a_lowercase_name() {
    let c = Config::from_json(with_endpoints("{}").as_bytes()).unwrap();
    assert_eq!(c.routing.model_header, None);
    let c = Config::from_json(
        with_endpoints(r#"{"routing":{"modelHeader":"x-kvroute-model"}}"#).as_bytes(),
    )
    .unwrap();
    assert_eq!(c.routing.model_header.as_deref(), Some("x-kvroute-model"));
    for bad in [
        r#""X-Model""#,
        r#""""#,
        r#"":path""#,
        r#""x model""#,
        r#""x-gateway-destination-endpoint""#,
        "true",
    ] {
        let e = reject(&with_endpoints(&format!(
            r#"{{"routing":{{"modelHeader":{bad}}}}}"#
        )));
        assert_eq!(e.path, "routing.modelHeader", "{bad}: {e}");
    }
}

#[path = "session_tests.rs"]
mod session_tests;

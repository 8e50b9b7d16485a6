//! `/metrics` of an emulated endpoint: the vLLM metric names routers read,
//! with vLLM's label style (`engine="0"`, `model_name=…`, sorted labels).
//! Latencies are in model seconds (the hardware being modelled).

use crate::prometheus::{format_value, Exposition};
use crate::vllm_model::EngineConfig;
use crate::vllm_model::Histogram;
use crate::vllm_model::{Engine, EngineCounters};

/// A point-in-time view for `/metrics` and `/emulator/stats`.
#[derive(Clone, Debug)]
pub struct Snapshot {
    pub running: usize,
    pub waiting: usize,
    pub kv_cache_usage: f64,
    pub cached_blocks: usize,
    pub evicted_blocks: u64,
    pub counters: EngineCounters,
    pub ttft: Histogram,
    pub prefill_time: Histogram,
    pub prefill_kv_computed: Histogram,
    pub generation_tokens: Histogram,
    pub fault_responses: u64,
    /// Model seconds lost to host lag since start (never reset).
    pub host_lag_model_s: f64,
}

impl Snapshot {
    /// The model's state (no faults, no host lag: those belong to the glue).
    pub fn of(engine: &Engine) -> Snapshot {
        Snapshot {
            running: engine.num_running(),
            waiting: engine.num_waiting(),
            kv_cache_usage: engine.cache().usage(),
            cached_blocks: engine.cache().num_cached(),
            evicted_blocks: engine.cache().evictions,
            counters: engine.counters.clone(),
            ttft: engine.ttft.clone(),
            prefill_time: engine.prefill_time.clone(),
            prefill_kv_computed: engine.prefill_kv_computed.clone(),
            generation_tokens: engine.generation_tokens.clone(),
            fault_responses: 0,
            host_lag_model_s: 0.0,
        }
    }
}

/// The `# HELP` and `# TYPE` lines of vLLM 0.32's `vllm:lora_requests_info`.
pub const LORA_REQUESTS_INFO_HEAD: &str =
    "# HELP vllm:lora_requests_info Running stats on lora requests.\n\
     # TYPE vllm:lora_requests_info gauge\n";

/// One series of vLLM 0.32's `vllm:lora_requests_info` (a server with LoRA
/// enabled), labels in vLLM's declared order, the value the unix time the
/// label set was last current; `adapters` is the comma-separated names
/// vLLM puts in both adapter labels (an adapter with any request in flight).
pub fn lora_requests_info(max_loras: u32, adapters: &str, unix_s: f64) -> String {
    format!(
        "vllm:lora_requests_info{{max_lora=\"{max_loras}\",waiting_lora_adapters=\"{adapters}\",running_lora_adapters=\"{adapters}\"}} {unix_s:e}\n"
    )
}

/// The page for a server of `model` with engine config `cfg`, started at
/// Unix time `created`, in state `s` (the simulator renders its modelled
/// servers' pages with this, and feeds them to the collector's parser).
pub fn render_parts(model: &str, cfg: &EngineConfig, created: f64, s: &Snapshot) -> String {
    let base: [(&str, &str); 2] = [("engine", "0"), ("model_name", model)];
    let mut e = Exposition::new();

    e.family(
        "vllm:num_requests_running",
        "Requests in the running batch.",
        "gauge",
    );
    e.sample("vllm:num_requests_running", &base, s.running as f64);
    e.family(
        "vllm:num_requests_waiting",
        "Requests waiting to be scheduled.",
        "gauge",
    );
    e.sample("vllm:num_requests_waiting", &base, s.waiting as f64);
    e.family(
        "vllm:num_requests_waiting_by_reason",
        "Waiting requests by reason; sums to vllm:num_requests_waiting.",
        "gauge",
    );
    for (reason, v) in [("capacity", s.waiting), ("deferred", 0)] {
        e.sample(
            "vllm:num_requests_waiting_by_reason",
            &[base[0], base[1], ("reason", reason)],
            v as f64,
        );
    }
    e.family(
        "vllm:kv_cache_usage_perc",
        "KV cache usage; 1 means full.",
        "gauge",
    );
    e.sample("vllm:kv_cache_usage_perc", &base, s.kv_cache_usage);

    let counters: [(&str, &str, u64); 5] = [
        (
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in queried tokens.",
            s.counters.prefix_cache_queries,
        ),
        (
            "vllm:prefix_cache_hits",
            "Prefix cache hits, in cached tokens.",
            s.counters.prefix_cache_hits,
        ),
        (
            "vllm:num_preemptions",
            "Preemptions.",
            s.counters.preemptions,
        ),
        (
            "vllm:prompt_tokens",
            "Prefill tokens processed.",
            s.counters.prompt_tokens,
        ),
        (
            "vllm:generation_tokens",
            "Generation tokens processed.",
            s.counters.generation_tokens,
        ),
    ];
    for (name, help, v) in counters {
        let total = format!("{name}_total");
        e.family(&total, help, "counter");
        e.sample(&total, &base, v as f64);
        let c = format!("{name}_created");
        e.family(&c, help, "gauge");
        e.sample(&c, &base, created);
    }

    e.family(
        "vllm:request_success_total",
        "Finished requests by reason.",
        "counter",
    );
    for (reason, v) in [
        ("stop", 0),
        ("length", s.counters.requests_finished),
        ("abort", s.counters.requests_aborted),
        ("error", 0),
    ] {
        e.sample(
            "vllm:request_success_total",
            &[base[0], ("finished_reason", reason), base[1]],
            v as f64,
        );
    }

    for (name, help, h) in [
        (
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            &s.ttft,
        ),
        (
            "vllm:request_prefill_time_seconds",
            "Histogram of time spent in PREFILL phase for request.",
            &s.prefill_time,
        ),
        (
            "vllm:request_prefill_kv_computed_tokens",
            "Histogram of new KV tokens computed during prefill (excluding cached tokens).",
            &s.prefill_kv_computed,
        ),
        (
            "vllm:request_generation_tokens",
            "Number of generation tokens processed.",
            &s.generation_tokens,
        ),
    ] {
        histogram(&mut e, name, help, h, &base, created);
    }

    let bs = cfg.block_size.to_string();
    let blocks = cfg.num_gpu_blocks.to_string();
    let size_tokens = (u64::from(cfg.block_size) * u64::from(cfg.num_gpu_blocks)).to_string();
    e.family(
        "vllm:cache_config_info",
        "Cache configuration of the engine.",
        "gauge",
    );
    // vLLM 0.32's whole label set (testdata/vllm/metrics-vllm-0.32-cpu*.txt),
    // in its order. Geometry and hashing come from the emulator's config; the
    // rest are vLLM's defaults on CPU. kv_cache_memory_bytes depends on the
    // deployment (VLLM_CPU_KVCACHE_SPACE): the emulator reports 0.
    let max_concurrency = format!(
        "{:?}",
        (u64::from(cfg.block_size) * u64::from(cfg.num_gpu_blocks)) as f64
            / cfg.effective_max_model_len().max(1) as f64
    );
    e.sample(
        "vllm:cache_config_info",
        &[
            ("_block_size_resolved", "True"),
            ("block_size", &bs),
            ("cache_dtype", "auto"),
            ("cache_hit_alignment_tokens", "None"),
            ("effective_attention_block_size", &bs),
            ("enable_mamba_shared_prefix_checkpoint", "False"),
            ("enable_prefix_caching", "True"),
            ("engine", "0"),
            ("gpu_memory_utilization", "0.92"),
            ("hash_block_size", "None"),
            ("is_attention_free", "False"),
            ("kv_cache_dtype_skip_layers", "[]"),
            ("kv_cache_layout", "None"),
            ("kv_cache_max_concurrency", &max_concurrency),
            ("kv_cache_memory_bytes", "0"),
            ("kv_cache_size_tokens", &size_tokens),
            ("kv_offloading_backend", "native"),
            ("kv_offloading_size", "None"),
            ("kv_sharing_fast_prefill", "False"),
            ("mamba_block_size", "None"),
            ("mamba_cache_dtype", "auto"),
            ("mamba_cache_mode", "none"),
            ("mamba_page_size_padded", "None"),
            ("mamba_ssm_cache_dtype", "float32"),
            ("num_cpu_blocks", "None"),
            ("num_gpu_blocks", &blocks),
            ("num_gpu_blocks_override", &blocks),
            ("prefix_cache_retention_interval", "0"),
            ("prefix_caching_hash_algo", "sha256_cbor"),
            ("prefix_match_unit", "None"),
            ("replayssm_buffer_len", "16"),
            ("skip_page_size_padded", "None"),
            ("sliding_window", "None"),
            ("swa_bounded_replay", "True"),
            ("use_kda_recoverssm", "False"),
            ("use_replayssm", "False"),
            ("user_specified_block_size", "True"),
        ],
        1.0,
    );
    e.family(
        "kvroute_emulator_host_lag_seconds_total",
        "Model seconds the emulator host fell behind its time scale (0 when it kept up).",
        "counter",
    );
    e.sample(
        "kvroute_emulator_host_lag_seconds_total",
        &base,
        s.host_lag_model_s,
    );
    e.finish()
}

/// One histogram family as vLLM writes it: cumulative `_bucket`s with `le`
/// between vLLM's labels, `_count`, `_sum`, and `_created`.
fn histogram(
    e: &mut Exposition,
    name: &str,
    help: &str,
    h: &Histogram,
    base: &[(&str, &str); 2],
    created: f64,
) {
    e.family(name, help, "histogram");
    let bucket = format!("{name}_bucket");
    let mut cumulative = 0u64;
    for (i, bound) in h.bounds.iter().enumerate() {
        cumulative += h.counts[i];
        let le = format_value(*bound);
        e.sample(&bucket, &[base[0], ("le", &le), base[1]], cumulative as f64);
    }
    e.sample(&bucket, &[base[0], ("le", "+Inf"), base[1]], h.count as f64);
    e.sample(&format!("{name}_count"), base, h.count as f64);
    e.sample(&format!("{name}_sum"), base, h.sum);
    let c = format!("{name}_created");
    e.family(&c, help, "gauge");
    e.sample(&c, base, created);
}

//! Reads the vLLM metrics routing uses from Prometheus text exposition.
//!
//! Labels are parsed by name (their order and set change between vLLM
//! versions). A server with several engines (data parallel) exposes one
//! series per engine: counts and counters are summed, `kv_cache_usage_perc`
//! is averaged. `_created` series and unknown names are ignored.

use std::fmt;

/// The metrics kvroute reads from one vLLM server.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct VllmMetrics {
    /// `vllm:num_requests_waiting`
    pub waiting: f64,
    /// `vllm:num_requests_running`
    pub running: f64,
    /// `vllm:kv_cache_usage_perc` (0–1), mean over engines
    pub kv_cache_usage: f64,
    /// `vllm:cache_config_info{block_size}` (tokens per block)
    pub block_size: Option<u32>,
    /// `vllm:cache_config_info{num_gpu_blocks}`
    pub num_gpu_blocks: Option<u64>,
    /// `vllm:prefix_cache_queries_total` (tokens)
    pub prefix_queries: f64,
    /// `vllm:prefix_cache_hits_total` (tokens)
    pub prefix_hits: f64,
    /// The two per-request prefill histograms, when the server exports both.
    pub prefill: Option<PrefillTotals>,
    /// `vllm:prompt_tokens_total` (prompt tokens the server processed,
    /// cached or not, summed over engines), if exported.
    pub prompt_tokens: Option<f64>,
    /// `vllm:request_generation_tokens` (tokens generated per finished
    /// request): its sum and count, when the server exports both.
    pub generation: Option<GenerationTotals>,
    /// The distinct `model_name` label values (the served model name), in
    /// order of first sight, at most [`MAX_MODEL_NAMES`].
    pub model_names: Vec<String>,
    /// `vllm:lora_requests_info`, when the server has LoRA enabled.
    pub lora: Option<LoraInfo>,
}

/// Most distinct `model_name` values kept from one `/metrics`.
pub const MAX_MODEL_NAMES: usize = 64;
/// Most adapter names kept from one `lora_requests_info` label.
pub const MAX_LORA_NAMES: usize = 64;

/// vLLM's `vllm:lora_requests_info{max_lora, running_lora_adapters,
/// waiting_lora_adapters}`: a gauge set to the time of the last update, one
/// series per label set ever seen, so the series with the largest value is
/// the current one. The adapter labels are comma-separated names.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct LoraInfo {
    /// Adapter slots (`--max-loras`).
    pub max_lora: u16,
    pub running: Vec<String>,
    pub waiting: Vec<String>,
}

impl LoraInfo {
    fn from_labels(labels: &str) -> LoraInfo {
        let names = |key| -> Vec<String> {
            label(labels, key)
                .unwrap_or("")
                .split(',')
                .map(str::trim)
                .filter(|n| !n.is_empty())
                .take(MAX_LORA_NAMES)
                .map(str::to_string)
                .collect()
        };
        LoraInfo {
            max_lora: label(labels, "max_lora")
                .and_then(|v| v.trim().parse::<u64>().ok())
                .map_or(0, |v| v.min(u64::from(u16::MAX)) as u16),
            running: names("running_lora_adapters"),
            waiting: names("waiting_lora_adapters"),
        }
    }
}

/// Sum and count of `vllm:request_generation_tokens`, summed over engines
/// (see `crate::learners::output_tokens`).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct GenerationTotals {
    /// `_sum`: output tokens of every finished request.
    pub tokens: f64,
    /// `_count`: finished requests.
    pub requests: f64,
}

/// Sums of vLLM's two prefill histograms, which it observes together for
/// each finished request (see `crate::learners::prefill_rate`).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct PrefillTotals {
    /// `vllm:request_prefill_kv_computed_tokens_sum`: prompt tokens computed
    /// (prompt − cached), tokens.
    pub computed_tokens: f64,
    /// `vllm:request_prefill_time_seconds_sum`: first token − first
    /// scheduled, seconds.
    pub seconds: f64,
    /// `vllm:request_prefill_time_seconds_count`: requests.
    pub requests: f64,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum MetricsError {
    /// The text has none of the vLLM load metrics: not a vLLM server, or garbage.
    NotVllm,
}

impl fmt::Display for MetricsError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            MetricsError::NotVllm => write!(
                f,
                "no vllm:num_requests_running / vllm:num_requests_waiting in /metrics; is this a vLLM server?"
            ),
        }
    }
}

impl std::error::Error for MetricsError {}

/// Parses Prometheus text. Lines that do not parse are skipped.
pub fn parse(text: &[u8]) -> Result<VllmMetrics, MetricsError> {
    let text = String::from_utf8_lossy(text);
    let mut m = VllmMetrics::default();
    let (mut seen_load, mut usage_sum, mut usage_n) = (false, 0.0, 0u32);
    let mut prefill = PrefillTotals::default();
    // Which of computed-tokens sum, time sum, time count were seen.
    let mut prefill_seen = [false; 3];
    let mut generation = GenerationTotals::default();
    let mut generation_seen = [false; 2];
    // The latest `lora_requests_info` series: its value and labels.
    let mut lora: Option<(f64, &str)> = None;
    for line in text.lines() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let Some((name, labels, value)) = split_sample(line) else {
            continue;
        };
        if name.starts_with("vllm:") && m.model_names.len() < MAX_MODEL_NAMES {
            if let Some(model) = label(labels, "model_name").filter(|n| !n.is_empty()) {
                if !m.model_names.iter().any(|n| n == model) {
                    m.model_names.push(model.to_string());
                }
            }
        }
        match name {
            "vllm:lora_requests_info" if lora.is_none_or(|(v, _)| value >= v) => {
                lora = Some((value, labels));
            }
            "vllm:num_requests_waiting" => {
                m.waiting += value;
                seen_load = true;
            }
            "vllm:num_requests_running" => {
                m.running += value;
                seen_load = true;
            }
            "vllm:kv_cache_usage_perc" | "vllm:gpu_cache_usage_perc" => {
                usage_sum += value;
                usage_n += 1;
            }
            "vllm:prefix_cache_queries_total" => m.prefix_queries += value,
            "vllm:prefix_cache_hits_total" => m.prefix_hits += value,
            "vllm:prompt_tokens_total" => {
                *m.prompt_tokens.get_or_insert(0.0) += value;
            }
            "vllm:request_prefill_kv_computed_tokens_sum" => {
                prefill.computed_tokens += value;
                prefill_seen[0] = true;
            }
            "vllm:request_prefill_time_seconds_sum" => {
                prefill.seconds += value;
                prefill_seen[1] = true;
            }
            "vllm:request_prefill_time_seconds_count" => {
                prefill.requests += value;
                prefill_seen[2] = true;
            }
            "vllm:request_generation_tokens_sum" => {
                generation.tokens += value;
                generation_seen[0] = true;
            }
            "vllm:request_generation_tokens_count" => {
                generation.requests += value;
                generation_seen[1] = true;
            }
            "vllm:cache_config_info" => {
                if let Some(bs) = label(labels, "block_size").and_then(|v| v.parse().ok()) {
                    m.block_size = Some(bs);
                }
                if let Some(n) = label(labels, "num_gpu_blocks").and_then(|v| v.parse().ok()) {
                    m.num_gpu_blocks = Some(n);
                }
            }
            _ => {}
        }
    }
    if !seen_load {
        return Err(MetricsError::NotVllm);
    }
    m.lora = lora.map(|(_, labels)| LoraInfo::from_labels(labels));
    if usage_n > 0 {
        m.kv_cache_usage = sane(usage_sum / f64::from(usage_n)).clamp(0.0, 1.0);
    }
    // Per-sample values are finite, but sums over engines can overflow and
    // a broken server can report negative counts.
    m.waiting = sane(m.waiting);
    m.running = sane(m.running);
    m.prefix_queries = sane(m.prefix_queries);
    m.prefix_hits = sane(m.prefix_hits);
    m.prompt_tokens = m.prompt_tokens.map(sane);
    if prefill_seen.iter().all(|&s| s) {
        m.prefill = Some(PrefillTotals {
            computed_tokens: sane(prefill.computed_tokens),
            seconds: sane(prefill.seconds),
            requests: sane(prefill.requests),
        });
    }
    if generation_seen.iter().all(|&s| s) {
        m.generation = Some(GenerationTotals {
            tokens: sane(generation.tokens),
            requests: sane(generation.requests),
        });
    }
    Ok(m)
}

/// Counts and counters: finite, ≥ 0, at most 1e15; anything else reads as 0.
fn sane(v: f64) -> f64 {
    if v.is_finite() && v >= 0.0 {
        v.min(1e15)
    } else {
        0.0
    }
}

/// `name{labels} value [timestamp]` → (name, labels, value).
fn split_sample(line: &str) -> Option<(&str, &str, f64)> {
    let (name, labels, rest) = match line.find('{') {
        Some(open) => {
            let close = open + line[open..].find('}')?;
            (&line[..open], &line[open + 1..close], &line[close + 1..])
        }
        None => {
            let sp = line.find([' ', '\t'])?;
            (&line[..sp], "", &line[sp..])
        }
    };
    let value = rest.split_whitespace().next()?;
    let v: f64 = match value {
        "NaN" => return None,
        "+Inf" => f64::INFINITY,
        "-Inf" => f64::NEG_INFINITY,
        v => v.parse().ok()?,
    };
    v.is_finite().then_some((name.trim(), labels, v))
}

/// The value of label `key` in `a="x",b="y"`.
fn label<'a>(labels: &'a str, key: &str) -> Option<&'a str> {
    let mut rest = labels;
    loop {
        let eq = rest.find('=')?;
        let k = rest[..eq].trim().trim_start_matches(',').trim();
        let after = rest[eq + 1..].trim_start().strip_prefix('"')?;
        let mut end = None;
        let bytes = after.as_bytes();
        let mut i = 0;
        while i < bytes.len() {
            match bytes[i] {
                b'\\' => i += 2,
                b'"' => {
                    end = Some(i);
                    break;
                }
                _ => i += 1,
            }
        }
        let end = end?;
        if k == key {
            return Some(&after[..end]);
        }
        rest = &after[end + 1..];
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn real_vllm_capture() {
        let text = include_bytes!("../../../../testdata/vllm/metrics-vllm-0.32-cpu.txt");
        let m = parse(text).unwrap();
        assert_eq!(m.block_size, Some(32));
        assert!(m.num_gpu_blocks.unwrap() > 0);
        assert!(m.prefix_queries > 0.0);
        assert!((0.0..=1.0).contains(&m.kv_cache_usage));
        let small = parse(include_bytes!(
            "../../../../testdata/vllm/metrics-vllm-0.32-cpu-small-kv.txt"
        ))
        .unwrap();
        assert_eq!(small.num_gpu_blocks, Some(256));
        assert_eq!(small.prompt_tokens, Some(14067.0));
        assert_eq!(
            parse(b"vllm:num_requests_running 0\n")
                .unwrap()
                .prompt_tokens,
            None
        );
        // The capture: 15 requests, 10093 computed tokens (= its
        // prompt_tokens_by_source{local_compute}), 0.374 s of prefill.
        let p = m.prefill.unwrap();
        assert_eq!((p.computed_tokens, p.requests), (10093.0, 15.0));
        assert!((p.seconds - 0.374_412_347).abs() < 1e-6, "{}", p.seconds);
        // 15 finished requests that generated 344 tokens.
        assert_eq!(
            m.generation,
            Some(GenerationTotals {
                tokens: 344.0,
                requests: 15.0
            })
        );
    }

    #[test]
    fn generation_totals_need_sum_and_count() {
        let both = b"vllm:num_requests_running 0\n\
vllm:request_generation_tokens_sum{engine=\"0\"} 900\n\
vllm:request_generation_tokens_sum{engine=\"1\"} 100\n\
vllm:request_generation_tokens_count{engine=\"0\"} 3\n\
vllm:request_generation_tokens_count{engine=\"1\"} 1\n\
vllm:request_generation_tokens_bucket{engine=\"0\",le=\"+Inf\"} 3\n";
        let g = parse(both).unwrap().generation.unwrap();
        assert_eq!((g.tokens, g.requests), (1000.0, 4.0));
        let sum_only = b"vllm:num_requests_running 0\nvllm:request_generation_tokens_sum 5\n";
        assert_eq!(parse(sum_only).unwrap().generation, None);
        let negative = b"vllm:num_requests_running 0\nvllm:request_generation_tokens_sum -5\nvllm:request_generation_tokens_count 2\n";
        assert_eq!(parse(negative).unwrap().generation.unwrap().tokens, 0.0);
    }

    #[test]
    fn prefill_totals_need_both_histograms() {
        let both = b"vllm:num_requests_running 0\n\
vllm:request_prefill_time_seconds_sum{engine=\"0\"} 0.5\n\
vllm:request_prefill_time_seconds_sum{engine=\"1\"} 0.25\n\
vllm:request_prefill_time_seconds_count{engine=\"0\"} 3\n\
vllm:request_prefill_time_seconds_bucket{engine=\"0\",le=\"+Inf\"} 3\n\
vllm:request_prefill_kv_computed_tokens_sum{engine=\"0\"} 9000\n";
        let p = parse(both).unwrap().prefill.unwrap();
        assert_eq!(
            (p.computed_tokens, p.seconds, p.requests),
            (9000.0, 0.75, 3.0)
        );
        let time_only = b"vllm:num_requests_running 0\nvllm:request_prefill_time_seconds_sum 1\nvllm:request_prefill_time_seconds_count 1\n";
        assert_eq!(parse(time_only).unwrap().prefill, None);
    }

    #[test]
    fn sums_engines_and_parses_labels_by_name() {
        let text = br#"
# HELP vllm:num_requests_running x
vllm:num_requests_running{engine="0",model_name="m"} 2.0
vllm:num_requests_running{engine="1",model_name="m"} 3.0
vllm:num_requests_waiting{model_name="m",engine="0"} 4
vllm:kv_cache_usage_perc{engine="0"} 0.2
vllm:kv_cache_usage_perc{engine="1"} 0.4
vllm:prefix_cache_hits_total{engine="0"} 10
vllm:prefix_cache_hits_created{engine="0"} 1.7e9
vllm:cache_config_info{num_gpu_blocks="1000",a="x\"y",block_size="16"} 1.0
"#;
        let m = parse(text).unwrap();
        assert_eq!((m.running, m.waiting, m.prefix_hits), (5.0, 4.0, 10.0));
        assert!((m.kv_cache_usage - 0.3).abs() < 1e-12);
        assert_eq!((m.block_size, m.num_gpu_blocks), (Some(16), Some(1000)));
    }

    /// Real vLLM 0.32 (CPU, tiny model) started with `--enable-lora
    /// --lora-modules sql=… idle-lora=… --max-loras 2`, after one request on
    /// `sql`: two series (running, then idle), the newest last. Before any
    /// adapter request the server exports no series at all, only HELP/TYPE.
    #[test]
    fn real_vllm_lora_capture() {
        let m = parse(include_bytes!(
            "../../../../testdata/vllm/metrics-vllm-0.32-cpu-lora.txt"
        ))
        .unwrap();
        assert_eq!(m.model_names, vec!["tiny".to_string()]);
        assert_eq!(
            m.lora,
            Some(LoraInfo {
                max_lora: 2,
                running: vec![],
                waiting: vec![]
            })
        );
        // The same page with the newer series gone: "sql" ran and waited
        // (vLLM counts a running adapter as waiting too).
        let text = String::from_utf8_lossy(include_bytes!(
            "../../../../testdata/vllm/metrics-vllm-0.32-cpu-lora.txt"
        ))
        .lines()
        .filter(|l| !l.contains("running_lora_adapters=\"\""))
        .collect::<Vec<_>>()
        .join("\n");
        let l = parse(text.as_bytes()).unwrap().lora.unwrap();
        assert_eq!(
            (l.running, l.waiting),
            (vec!["sql".to_string()], vec!["sql".to_string()])
        );
    }

    #[test]
    fn model_names_and_lora_info() {
        let m = parse(include_bytes!(
            "../../../../testdata/vllm/metrics-vllm-0.32-cpu.txt"
        ))
        .unwrap();
        assert_eq!(m.model_names, vec!["tiny".to_string()]);
        assert_eq!(m.lora, None);
        // vLLM 0.32's gauge (v1/metrics/loggers.py): labels in its declared
        // order, the value the time of the update; every label set seen
        // stays exported, the latest has the largest value.
        let text = br#"
# HELP vllm:lora_requests_info Running stats on lora requests.
# TYPE vllm:lora_requests_info gauge
vllm:lora_requests_info{max_lora="2",running_lora_adapters="sql,chat",waiting_lora_adapters="sql"} 1.7959421e+09
vllm:lora_requests_info{max_lora="2",running_lora_adapters="",waiting_lora_adapters=""} 1.7959425e+09
vllm:lora_requests_info{max_lora="2",running_lora_adapters="chat",waiting_lora_adapters=""} 1.7959423e+09
vllm:num_requests_running{engine="0",model_name="base-a"} 1.0
vllm:num_requests_waiting{engine="0",model_name="base-a"} 0.0
vllm:kv_cache_usage_perc{engine="1",model_name="base-b"} 0.0
"#;
        let m = parse(text).unwrap();
        assert_eq!(m.model_names, vec!["base-a", "base-b"]);
        assert_eq!(
            m.lora,
            Some(LoraInfo {
                max_lora: 2,
                running: vec![],
                waiting: vec![]
            })
        );
        let one = b"vllm:num_requests_running 0\nvllm:lora_requests_info{waiting_lora_adapters=\"b\",running_lora_adapters=\"a, b\",max_lora=\"99999999\"} 5\n";
        let l = parse(one).unwrap().lora.unwrap();
        assert_eq!(l.running, vec!["a", "b"]);
        assert_eq!(l.waiting, vec!["b"]);
        assert_eq!(l.max_lora, u16::MAX);
        // Many distinct names are cut at the bound.
        let mut many = String::from("vllm:num_requests_running 0\n");
        for i in 0..MAX_MODEL_NAMES + 10 {
            many.push_str(&format!("vllm:x{{model_name=\"m{i}\"}} 1\n"));
        }
        assert_eq!(
            parse(many.as_bytes()).unwrap().model_names.len(),
            MAX_MODEL_NAMES
        );
    }

    #[test]
    fn garbage_is_an_error_not_a_panic() {
        assert_eq!(parse(b"<html>oops</html>"), Err(MetricsError::NotVllm));
        assert_eq!(parse(b""), Err(MetricsError::NotVllm));
        assert_eq!(parse(&[0xff, 0x00, b'{', b'}']), Err(MetricsError::NotVllm));
        assert_eq!(
            parse(b"vllm:num_requests_running{engine=\"0 1"),
            Err(MetricsError::NotVllm)
        );
        assert!(parse(b"vllm:num_requests_running NaN\nvllm:num_requests_waiting 1").is_ok());
        // Sums that overflow, and negative counts, read as 0 (fuzz find).
        let m = parse(b"vllm:num_requests_waiting{engine=\"0\"} 1e308\nvllm:num_requests_waiting{engine=\"1\"} 1e308\nvllm:num_requests_running -5").unwrap();
        assert_eq!((m.waiting, m.running), (0.0, 0.0));
    }
}

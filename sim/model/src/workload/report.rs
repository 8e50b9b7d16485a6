//! Per-stage results: latency percentiles, throughput, errors, and the
//! fleet's prefix-cache hit ratio from the endpoints' own counters.
//!
//! ```text
//! hit ratio (fleet) = Σ_e Δ vllm:prefix_cache_hits_total(e) / Σ_e Δ vllm:prefix_cache_queries_total(e)
//! ```
//! with Δ taken between a read just before the stage and a read after its
//! last request ended (counters, not a scrape window, so nothing is lost to
//! timing). Throughput is tokens over the stage's span (its duration, or
//! until its last request ended if later), in model seconds.

use serde::Serialize;
use std::collections::BTreeMap;

/// Counters read from one endpoint's `/metrics`.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct EndpointCounters {
    pub prefix_cache_queries: f64,
    pub prefix_cache_hits: f64,
    pub prompt_tokens: f64,
    pub generation_tokens: f64,
    /// The emulator's `kvroute_emulator_host_lag_seconds_total` (0 elsewhere).
    pub host_lag_s: f64,
}

/// One request's outcome; times are model seconds from the stage start.
#[derive(Clone, Debug, Default)]
pub struct RequestRecord {
    pub sent_at_s: f64,
    pub ok: bool,
    pub error: Option<String>,
    pub ttft_s: Option<f64>,
    pub end_s: f64,
    /// From the first to the last output chunk, seconds.
    pub decode_s: Option<f64>,
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
    pub cached_tokens: u64,
    pub served_by: Option<String>,
    /// `(reusable, prompt)` tokens of the hit-ratio ceiling
    /// ([`super::ceiling::Ceiling`]), when it is computed.
    pub ceiling: Option<(u64, u64)>,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Percentiles {
    pub p50: Option<f64>,
    pub p90: Option<f64>,
    pub p99: Option<f64>,
    pub mean: Option<f64>,
}

/// Nearest-rank percentile of sorted values.
pub fn percentile(sorted: &[f64], p: f64) -> Option<f64> {
    if sorted.is_empty() {
        return None;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil().max(1.0) as usize;
    Some(sorted[rank.min(sorted.len()) - 1])
}

fn percentiles(mut v: Vec<f64>) -> Percentiles {
    v.sort_by(|a, b| a.total_cmp(b));
    Percentiles {
        p50: percentile(&v, 50.0),
        p90: percentile(&v, 90.0),
        p99: percentile(&v, 99.0),
        mean: if v.is_empty() {
            None
        } else {
            Some(v.iter().sum::<f64>() / v.len() as f64)
        },
    }
}

#[derive(Clone, Debug, Serialize)]
pub struct EndpointShare {
    pub endpoint: String,
    /// Requests whose `x-kvroute-served-by` named this endpoint.
    pub requests: u64,
    pub request_share: f64,
    pub prefix_cache_queries: f64,
    pub prefix_cache_hits: f64,
    pub hit_ratio: Option<f64>,
}

#[derive(Clone, Debug, Serialize)]
pub struct StageReport {
    pub stage: String,
    pub duration_s: f64,
    /// Model seconds from the stage start to its last request's end.
    pub span_s: f64,
    pub requests: u64,
    pub ok: u64,
    pub errors: u64,
    pub error_rate: f64,
    pub error_kinds: BTreeMap<String, u64>,
    /// Seconds (model time).
    pub ttft_s: Percentiles,
    /// Seconds per output token after the first (model time).
    pub tpot_s: Percentiles,
    pub input_tokens_per_s: f64,
    pub output_tokens_per_s: f64,
    /// From the endpoints' counters; `None` if they could not be read.
    pub prefix_cache_queries: Option<f64>,
    pub prefix_cache_hits: Option<f64>,
    pub hit_ratio: Option<f64>,
    /// The hit-ratio ceiling of the stage's requests (every request sent,
    /// given all requests before it, one infinite cache); `None` unless
    /// computed for every request (`--ceiling-block-size`).
    pub hit_ratio_ceiling: Option<f64>,
    /// From the responses' `usage.prompt_tokens_details.cached_tokens`.
    pub client_cached_ratio: Option<f64>,
    /// Model seconds the emulators fell behind during the stage (summed over
    /// endpoints); latencies are inflated when this is not ~0.
    pub emulator_host_lag_s: Option<f64>,
    pub endpoints: Vec<EndpointShare>,
    /// How much each of the router's counters rose over the stage (full
    /// names, e.g. `kvroute_branch_saturation_release`): Envoy's admin page
    /// (`kvroute-loadgen --router-stats`) or the simulator's own count of
    /// the same decisions. Absent when not read.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub router_counters: Option<BTreeMap<String, u64>>,
    /// The over-length requests of `--reject-stream` sent during the stage
    /// (not in `requests`, latencies or tokens). Absent without the stream.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reject_stream: Option<super::reject::RejectStats>,
}

/// Builds a stage report. `before`/`after` are per-endpoint counters (same
/// order as `endpoints`), `None` where a read failed.
pub fn stage_report(
    stage: String,
    duration_s: f64,
    records: &[RequestRecord],
    endpoints: &[String],
    before: &[Option<EndpointCounters>],
    after: &[Option<EndpointCounters>],
) -> StageReport {
    let ok: Vec<&RequestRecord> = records.iter().filter(|r| r.ok).collect();
    let mut error_kinds = BTreeMap::new();
    for r in records.iter().filter(|r| !r.ok) {
        *error_kinds
            .entry(r.error.clone().unwrap_or_else(|| "unknown".into()))
            .or_insert(0) += 1;
    }
    let span_s = records.iter().map(|r| r.end_s).fold(duration_s, f64::max);
    let prompt: u64 = ok.iter().map(|r| r.prompt_tokens).sum();
    let output: u64 = ok.iter().map(|r| r.completion_tokens).sum();
    let cached: u64 = ok.iter().map(|r| r.cached_tokens).sum();
    let tpot = ok
        .iter()
        .filter(|r| r.completion_tokens > 1)
        .filter_map(|r| r.decode_s.map(|d| d / (r.completion_tokens - 1) as f64))
        .collect();

    let mut shares = Vec::new();
    let (mut q, mut h, mut lag, mut complete) = (0.0, 0.0, 0.0, !endpoints.is_empty());
    for (i, e) in endpoints.iter().enumerate() {
        let served = records
            .iter()
            .filter(|r| r.served_by.as_deref() == Some(e.as_str()))
            .count() as u64;
        let delta = match (
            before.get(i).cloned().flatten(),
            after.get(i).cloned().flatten(),
        ) {
            (Some(b), Some(a)) => {
                lag += a.host_lag_s - b.host_lag_s;
                Some((
                    a.prefix_cache_queries - b.prefix_cache_queries,
                    a.prefix_cache_hits - b.prefix_cache_hits,
                ))
            }
            _ => None,
        };
        let (dq, dh) = delta.unwrap_or((f64::NAN, f64::NAN));
        if delta.is_some() {
            q += dq;
            h += dh;
        } else {
            complete = false;
        }
        shares.push(EndpointShare {
            endpoint: e.clone(),
            requests: served,
            request_share: if records.is_empty() {
                0.0
            } else {
                served as f64 / records.len() as f64
            },
            prefix_cache_queries: dq,
            prefix_cache_hits: dh,
            hit_ratio: (delta.is_some() && dq > 0.0).then(|| dh / dq),
        });
    }
    StageReport {
        stage,
        duration_s,
        span_s,
        requests: records.len() as u64,
        ok: ok.len() as u64,
        errors: (records.len() - ok.len()) as u64,
        error_rate: if records.is_empty() {
            0.0
        } else {
            (records.len() - ok.len()) as f64 / records.len() as f64
        },
        error_kinds,
        ttft_s: percentiles(ok.iter().filter_map(|r| r.ttft_s).collect()),
        tpot_s: percentiles(tpot),
        input_tokens_per_s: prompt as f64 / span_s,
        output_tokens_per_s: output as f64 / span_s,
        prefix_cache_queries: complete.then_some(q),
        prefix_cache_hits: complete.then_some(h),
        hit_ratio: (complete && q > 0.0).then(|| h / q),
        hit_ratio_ceiling: super::ceiling::Ceiling::ratio(records.iter().map(|r| r.ceiling)),
        client_cached_ratio: (prompt > 0).then(|| cached as f64 / prompt as f64),
        emulator_host_lag_s: complete.then_some(lag),
        endpoints: shares,
        router_counters: None,
        reject_stream: None,
    }
}

fn ms(v: Option<f64>) -> String {
    v.map_or("-".into(), |s| format!("{:.0}", s * 1e3))
}

fn pct(v: Option<f64>) -> String {
    v.map_or("-".into(), |r| format!("{:.1}", r * 100.0))
}

/// The human table: one header, one line per stage, then per-endpoint lines.
pub fn render_table(reports: &[StageReport]) -> String {
    let mut out = format!(
        "{:<22} {:>6} {:>6} {:>6} {:>9} {:>9} {:>9} {:>10} {:>10} {:>6} {:>6}\n",
        "stage",
        "req",
        "ok",
        "err%",
        "ttft p50",
        "ttft p90",
        "tpot p90",
        "in tok/s",
        "out tok/s",
        "hit%",
        "cli%"
    );
    for r in reports {
        out.push_str(&format!(
            "{:<22} {:>6} {:>6} {:>6.1} {:>9} {:>9} {:>9} {:>10.0} {:>10.0} {:>6} {:>6}\n",
            r.stage,
            r.requests,
            r.ok,
            r.error_rate * 100.0,
            ms(r.ttft_s.p50),
            ms(r.ttft_s.p90),
            ms(r.tpot_s.p90),
            r.input_tokens_per_s,
            r.output_tokens_per_s,
            pct(r.hit_ratio),
            pct(r.client_cached_ratio),
        ));
        for e in &r.endpoints {
            out.push_str(&format!(
                "    {:<24} requests {:>5} ({:>5.1}%)  hit% {:>5}\n",
                e.endpoint,
                e.requests,
                e.request_share * 100.0,
                pct(e.hit_ratio)
            ));
        }
        if let Some(lag) = r.emulator_host_lag_s.filter(|l| *l > 0.01 * r.span_s) {
            out.push_str(&format!(
                "    WARNING: the emulators fell {lag:.1} s (model time) behind; latencies are inflated, lower --time-scale\n"
            ));
        }
        for (k, n) in &r.error_kinds {
            out.push_str(&format!("    error {k}: {n}\n"));
        }
    }
    out.push_str("(latencies in ms and throughput in tokens/s of model time; hit% from the endpoints' counters, cli% from responses' cached_tokens)\n");
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank_percentiles() {
        let v: Vec<f64> = (1..=10).map(f64::from).collect();
        assert_eq!(percentile(&v, 50.0), Some(5.0));
        assert_eq!(percentile(&v, 90.0), Some(9.0));
        assert_eq!(percentile(&v, 100.0), Some(10.0));
        assert_eq!(percentile(&[], 50.0), None);
    }

    #[test]
    fn hit_ratio_comes_from_counter_deltas_summed_over_the_fleet() {
        let c = |q: f64, h: f64| {
            Some(EndpointCounters {
                prefix_cache_queries: q,
                prefix_cache_hits: h,
                ..Default::default()
            })
        };
        let recs = vec![
            RequestRecord {
                ok: true,
                served_by: Some("a".into()),
                prompt_tokens: 100,
                end_s: 1.0,
                ..Default::default()
            },
            RequestRecord {
                ok: false,
                error: Some("http 500".into()),
                served_by: Some("b".into()),
                end_s: 3.0,
                ..Default::default()
            },
        ];
        let r = stage_report(
            "s".into(),
            2.0,
            &recs,
            &["a".into(), "b".into()],
            &[c(100.0, 10.0), c(0.0, 0.0)],
            &[c(300.0, 110.0), c(100.0, 0.0)],
        );
        assert_eq!(r.prefix_cache_queries, Some(300.0));
        assert_eq!(r.hit_ratio, Some(100.0 / 300.0));
        assert_eq!(r.endpoints[0].hit_ratio, Some(0.5));
        assert_eq!(r.endpoints[1].hit_ratio, Some(0.0));
        assert_eq!(r.error_rate, 0.5);
        assert_eq!(r.span_s, 3.0);
        assert_eq!(r.input_tokens_per_s, 100.0 / 3.0);
        // A failed read makes the fleet ratio unknown rather than wrong.
        let r = stage_report(
            "s".into(),
            2.0,
            &recs,
            &["a".into(), "b".into()],
            &[c(0.0, 0.0), None],
            &[c(10.0, 5.0), c(1.0, 1.0)],
        );
        assert_eq!(r.hit_ratio, None);
        assert_eq!(r.endpoints[0].hit_ratio, Some(0.5));
    }
}

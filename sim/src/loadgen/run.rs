//! Drives a target (Envoy or one endpoint) through the stages and builds the
//! reports. Counters are read directly from each endpoint's `/metrics`.

use super::client::{HttpClient, Timed};
use kvroute_core::scheduling::Rng;
use kvroute_sim_model::prometheus;
use kvroute_sim_model::workload::ceiling::Ceiling;
use kvroute_sim_model::workload::prompt::{parts_pieces, piece_block_hashes};
use kvroute_sim_model::workload::reject::{RejectBodies, RejectStats, RejectStream};
use kvroute_sim_model::workload::report::{
    stage_report, EndpointCounters, RequestRecord, StageReport,
};
use kvroute_sim_model::workload::stages::{Stage, StageKind};
use kvroute_sim_model::workload::{GenRequest, Workload, WorkloadSpec};
use serde::Serialize;
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

#[derive(Clone, Debug)]
pub struct RunConfig {
    /// Base URL requests go to, e.g. `http://127.0.0.1:10000`.
    pub target: String,
    /// `host:port` of each model server, for counters and resets.
    pub endpoints: Vec<String>,
    pub workload: WorkloadSpec,
    pub seed: u64,
    pub stages: Vec<Stage>,
    /// Model seconds per wall second; must match the emulators'.
    pub time_scale: f64,
    /// Wall-clock bound on one request.
    pub request_timeout: Duration,
    /// POST /emulator/reset to every endpoint before the first stage.
    pub reset: bool,
    /// The servers' KV block size (tokens): when set, each stage reports
    /// the stream's hit-ratio ceiling in blocks of this size.
    pub ceiling_block_size: Option<u32>,
    /// A router's counters (Envoy's admin
    /// `/stats?filter=kvroute_&type=Counters`): read
    /// before and after each stage, which then reports their increase
    /// (`router_counters`). `None`: not read.
    pub router_stats: Option<String>,
    /// A second client sending over-length requests during every stage
    /// (`--reject-stream`); `None`: off.
    pub reject_stream: Option<RejectStream>,
}

/// The workload and the ceiling of what it has sent so far.
struct Source {
    workload: Workload,
    ceiling: Option<Ceiling>,
}

impl Source {
    fn next(&mut self) -> (GenRequest, Option<(u64, u64)>) {
        let req = self.workload.next_request();
        let ceiling = self.ceiling.as_mut().map(|c| {
            let pieces = parts_pieces(&req.parts);
            let tokens = pieces.iter().map(|p| u64::from(p.tokens)).sum();
            c.add(tokens, &piece_block_hashes(&pieces, c.block_size(), 0))
        });
        (req, ceiling)
    }
}

#[derive(Clone, Debug, Serialize)]
pub struct RunReport {
    pub target: String,
    pub workload: String,
    pub seed: u64,
    pub time_scale: f64,
    pub endpoints: Vec<String>,
    pub stages: Vec<StageReport>,
}

/// GETs `url` within 5 s; its body, or why not.
async fn get_text(client: &HttpClient, url: &str) -> Result<String, String> {
    let r = tokio::time::timeout(Duration::from_secs(5), client.get(url))
        .await
        .map_err(|_| format!("{url}: no answer within 5 s"))??;
    if !r.status.is_success() {
        return Err(format!("{url}: HTTP {}", r.status));
    }
    Ok(r.text())
}

/// Reads the prefix-cache and token counters of one endpoint.
pub async fn read_counters(
    client: &HttpClient,
    endpoint: &str,
) -> Result<EndpointCounters, String> {
    let url = format!("http://{endpoint}/metrics");
    let samples =
        prometheus::parse(&get_text(client, &url).await?).map_err(|e| format!("{url}: {e}"))?;
    let sum = |name: &str| -> Result<f64, String> {
        let v: Vec<f64> = samples
            .iter()
            .filter(|s| s.name == name)
            .map(|s| s.value)
            .collect();
        if v.is_empty() {
            Err(format!("{url}: no {name} (is this a vLLM server?)"))
        } else {
            Ok(v.iter().sum())
        }
    };
    Ok(EndpointCounters {
        prefix_cache_queries: sum("vllm:prefix_cache_queries_total")?,
        prefix_cache_hits: sum("vllm:prefix_cache_hits_total")?,
        prompt_tokens: sum("vllm:prompt_tokens_total")?,
        generation_tokens: sum("vllm:generation_tokens_total")?,
        host_lag_s: sum("kvroute_emulator_host_lag_seconds_total").unwrap_or(0.0),
    })
}

/// Integer counters of an Envoy admin `/stats` text answer (`name: value`
/// lines); other lines (histograms, gauges that are not integers) are skipped.
pub fn parse_stats(text: &str) -> BTreeMap<String, u64> {
    text.lines()
        .filter_map(|l| {
            let (name, value) = l.split_once(": ")?;
            Some((name.trim().to_owned(), value.trim().parse::<u64>().ok()?))
        })
        .collect()
}

/// How much each counter rose from `before` to `after` (a counter missing
/// before counts from 0; one that fell, e.g. after a restart, counts 0).
pub fn counter_increase(
    before: &BTreeMap<String, u64>,
    after: &BTreeMap<String, u64>,
) -> BTreeMap<String, u64> {
    after
        .iter()
        .map(|(k, v)| {
            let was = before.get(k).copied().unwrap_or(0);
            (k.clone(), v.saturating_sub(was))
        })
        .collect()
}

/// The kvroute filter hands its counts to Envoy on its tick, at most
/// `FLUSH_PERIOD_MS` apart: a stage's last decisions reach the admin page
/// within that, so the read after a stage waits twice it (wall time).
const ROUTER_FLUSH_WAIT: Duration =
    Duration::from_millis(2 * kvroute_core::lifecycle::FLUSH_PERIOD_MS as u64);

async fn read_router_stats(
    client: &HttpClient,
    url: &str,
    log: &dyn Fn(&str),
) -> Option<BTreeMap<String, u64>> {
    match get_text(client, url).await {
        Ok(text) => Some(parse_stats(&text)),
        Err(e) => {
            log(&format!("warning: router stats unreadable: {e}"));
            None
        }
    }
}

async fn read_all(
    client: &HttpClient,
    endpoints: &[String],
    log: &dyn Fn(&str),
) -> Vec<Option<EndpointCounters>> {
    let mut out = Vec::new();
    for e in endpoints {
        match read_counters(client, e).await {
            Ok(c) => out.push(Some(c)),
            Err(err) => {
                log(&format!("warning: counters of {e} unreadable: {err}"));
                out.push(None);
            }
        }
    }
    out
}

/// Turns a timed streamed response into a record.
fn record(sent_at_s: f64, result: Result<Timed, String>, scale: f64) -> RequestRecord {
    let t = match result {
        Ok(t) => t,
        Err(e) => {
            return RequestRecord {
                sent_at_s,
                ok: false,
                error: Some(classify_transport(&e)),
                end_s: sent_at_s,
                ..Default::default()
            }
        }
    };
    let served_by = t
        .headers
        .get("x-kvroute-served-by")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    let end = t.chunks.last().map_or(t.head_after, |(d, _)| *d);
    let end_s = sent_at_s + end.as_secs_f64() * scale;
    let mut rec = RequestRecord {
        sent_at_s,
        served_by,
        end_s,
        ..Default::default()
    };
    if !t.status.is_success() {
        rec.error = Some(format!("http {}", t.status.as_u16()));
        return rec;
    }
    if let Some(e) = &t.body_error {
        rec.error = Some(if e.contains("within") {
            "timeout".into()
        } else {
            "stream broken".into()
        });
        return rec;
    }
    let body = t.body();
    let text = String::from_utf8_lossy(&body);
    let events: Vec<&str> = text
        .split("\n\n")
        .filter_map(|e| e.trim().strip_prefix("data: "))
        .collect();
    if events.last() != Some(&"[DONE]") {
        rec.error = Some("no [DONE]".into());
        return rec;
    }
    let usage = events
        .iter()
        .rev()
        .filter_map(|e| serde_json::from_str::<serde_json::Value>(e).ok())
        .find_map(|v| v.get("usage").filter(|u| !u.is_null()).cloned());
    if let Some(u) = usage {
        rec.prompt_tokens = u["prompt_tokens"].as_u64().unwrap_or(0);
        rec.completion_tokens = u["completion_tokens"].as_u64().unwrap_or(0);
        rec.cached_tokens = u["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap_or(0);
    }
    // Chunks that carry tokens: all but the usage/[DONE] tail.
    let token_chunks: Vec<Duration> = t
        .chunks
        .iter()
        .filter(|(_, b)| {
            let s = String::from_utf8_lossy(b);
            s.contains("\"choices\":[{") || s.contains("\"choices\": [{")
        })
        .map(|(d, _)| *d)
        .collect();
    if let (Some(first), Some(last)) = (token_chunks.first(), token_chunks.last()) {
        rec.ttft_s = Some(first.as_secs_f64() * scale);
        rec.decode_s = Some((*last - *first).as_secs_f64() * scale);
    }
    rec.ok = true;
    rec
}

fn classify_transport(e: &str) -> String {
    if e.contains("within") {
        "timeout".into()
    } else if e.contains("closed") || e.contains("reset") || e.contains("IncompleteMessage") {
        "connection closed".into()
    } else {
        "transport".into()
    }
}

async fn send_one(
    client: &HttpClient,
    cfg: &RunConfig,
    (req, ceiling): (GenRequest, Option<(u64, u64)>),
    stage_start: Instant,
) -> RequestRecord {
    let sent_at_s = stage_start.elapsed().as_secs_f64() * cfg.time_scale;
    let url = format!("{}{}", cfg.target.trim_end_matches('/'), req.path);
    let res = client
        .post_timed(&url, req.body.to_string(), &[], cfg.request_timeout)
        .await;
    let mut r = record(sent_at_s, res, cfg.time_scale);
    r.end_s = r.end_s.max(sent_at_s);
    r.ceiling = ceiling;
    r
}

/// The `--reject-stream` client over one stage: Poisson arrivals at the
/// stream's rate (model time) until the stage's wall time is up, each
/// request on its own task. Returns the tasks and the shared tally.
fn spawn_reject_stream(
    client: &HttpClient,
    cfg: &Arc<RunConfig>,
    bodies: &Arc<Mutex<RejectBodies>>,
    stream: &RejectStream,
    stage_no: u64,
    wall: Duration,
) -> (tokio::task::JoinHandle<()>, Arc<Mutex<RejectStats>>) {
    let stats = Arc::new(Mutex::new(RejectStats::default()));
    let (client, cfg, bodies, out) = (client.clone(), cfg.clone(), bodies.clone(), stats.clone());
    let rate = stream.rate;
    let task = tokio::spawn(async move {
        let start = Instant::now();
        let mut rng = Rng::derive(cfg.seed, 0x0BAD_5EED ^ stage_no);
        let mean_gap_s = 1.0 / (rate * cfg.time_scale);
        let mut at = Duration::from_secs_f64(rng.exponential(mean_gap_s));
        let mut sent = Vec::new();
        while at < wall {
            tokio::time::sleep_until((start + at).into()).await;
            let (path, body) = bodies.lock().unwrap_or_else(|p| p.into_inner()).next_body();
            let url = format!("{}{}", cfg.target.trim_end_matches('/'), path);
            let (client, out, timeout) = (client.clone(), out.clone(), cfg.request_timeout);
            sent.push(tokio::spawn(async move {
                let status = tokio::time::timeout(timeout, client.post(&url, body, &[]))
                    .await
                    .ok()
                    .and_then(Result::ok)
                    .map(|r| r.status.as_u16());
                out.lock().unwrap_or_else(|p| p.into_inner()).add(status);
            }));
            at += Duration::from_secs_f64(rng.exponential(mean_gap_s));
        }
        for t in sent {
            let _ = t.await;
        }
    });
    (task, stats)
}

/// Runs one stage to completion (all its requests ended).
async fn run_stage(
    client: &HttpClient,
    cfg: &Arc<RunConfig>,
    workload: &Arc<Mutex<Source>>,
    rejects: Option<&Arc<Mutex<RejectBodies>>>,
    stage: &Stage,
    stage_no: u64,
) -> (Vec<RequestRecord>, Option<RejectStats>) {
    let wall = Duration::from_secs_f64(stage.duration_s / cfg.time_scale);
    let reject = match (rejects, &cfg.reject_stream) {
        (Some(bodies), Some(stream)) => Some(spawn_reject_stream(
            client, cfg, bodies, stream, stage_no, wall,
        )),
        _ => None,
    };
    let start = Instant::now();
    let records = Arc::new(Mutex::new(Vec::new()));
    let mut tasks = Vec::new();
    let next = |w: &Arc<Mutex<Source>>| w.lock().unwrap_or_else(|p| p.into_inner()).next();
    match stage.kind {
        StageKind::Rate(rate) => {
            let mut rng = Rng::derive(cfg.seed, 0x5EED ^ stage_no);
            let mean_gap_s = 1.0 / (rate * cfg.time_scale);
            let mut at = Duration::from_secs_f64(rng.exponential(mean_gap_s));
            while at < wall {
                tokio::time::sleep_until((start + at).into()).await;
                let req = next(workload);
                let (client, cfg, records) = (client.clone(), cfg.clone(), records.clone());
                tasks.push(tokio::spawn(async move {
                    let r = send_one(&client, &cfg, req, start).await;
                    records.lock().unwrap_or_else(|p| p.into_inner()).push(r);
                }));
                at += Duration::from_secs_f64(rng.exponential(mean_gap_s));
            }
        }
        StageKind::Concurrency(n) => {
            for _ in 0..n {
                let (client, cfg, records, workload) = (
                    client.clone(),
                    cfg.clone(),
                    records.clone(),
                    workload.clone(),
                );
                tasks.push(tokio::spawn(async move {
                    while start.elapsed() < wall {
                        let req = next(&workload);
                        let r = send_one(&client, &cfg, req, start).await;
                        records.lock().unwrap_or_else(|p| p.into_inner()).push(r);
                    }
                }));
            }
        }
        // Refused by `run_until` before any stage runs.
        StageKind::Sessions { .. } => {}
    }
    for t in tasks {
        let _ = t.await;
    }
    let rejected = match reject {
        Some((task, stats)) => {
            let _ = task.await;
            let s = stats.lock().unwrap_or_else(|p| p.into_inner()).clone();
            Some(s)
        }
        None => None,
    };
    let mut v = std::mem::take(&mut *records.lock().unwrap_or_else(|p| p.into_inner()));
    v.sort_by(|a, b| a.sent_at_s.total_cmp(&b.sent_at_s));
    (v, rejected)
}

/// Runs every stage in order; `log` receives progress lines.
pub async fn run(cfg: RunConfig, log: &dyn Fn(&str)) -> Result<RunReport, String> {
    run_until(cfg, None, log).await
}

/// As [`run`], but a ramp stops early: after the first stage whose TTFT p90
/// (model seconds) is above `stop_ttft_p90_s`, or which had no successful
/// request, the remaining stages are skipped (they would only be further
/// past the knee, and an overloaded stage takes long to drain).
pub async fn run_until(
    cfg: RunConfig,
    stop_ttft_p90_s: Option<f64>,
    log: &dyn Fn(&str),
) -> Result<RunReport, String> {
    if cfg.time_scale.is_nan() || cfg.time_scale <= 0.0 {
        return Err("--time-scale must be positive".into());
    }
    if cfg
        .stages
        .iter()
        .any(|s| matches!(s.kind, StageKind::Sessions { .. }))
    {
        return Err("sessions stages are kvroute-simulate's only".into());
    }
    let client = HttpClient::new();
    if cfg.reset {
        for e in &cfg.endpoints {
            match client
                .post(&format!("http://{e}/emulator/reset"), "", &[])
                .await
            {
                Ok(r) if r.status.is_success() => {}
                Ok(r) => log(&format!(
                    "warning: reset of {e} answered HTTP {} (not an emulator?)",
                    r.status
                )),
                Err(err) => log(&format!("warning: reset of {e} failed: {err}")),
            }
        }
    }
    let cfg = Arc::new(cfg);
    let workload = Arc::new(Mutex::new(Source {
        workload: Workload::new(cfg.workload.clone(), cfg.seed),
        ceiling: cfg.ceiling_block_size.map(Ceiling::new),
    }));
    let rejects = cfg.reject_stream.as_ref().map(|r| {
        Arc::new(Mutex::new(RejectBodies::new(
            &cfg.workload.model,
            r.tokens,
            cfg.workload.chars_per_token,
            cfg.seed,
        )))
    });
    let mut stages = Vec::new();
    for (i, stage) in cfg.stages.iter().enumerate() {
        log(&format!(
            "stage {}/{}: {}",
            i + 1,
            cfg.stages.len(),
            stage.label()
        ));
        let before = read_all(&client, &cfg.endpoints, log).await;
        let router_before = match &cfg.router_stats {
            Some(url) => read_router_stats(&client, url, log).await,
            None => None,
        };
        let (records, rejected) =
            run_stage(&client, &cfg, &workload, rejects.as_ref(), stage, i as u64).await;
        let after = read_all(&client, &cfg.endpoints, log).await;
        let router_after = match &cfg.router_stats {
            Some(url) => {
                tokio::time::sleep(ROUTER_FLUSH_WAIT).await;
                read_router_stats(&client, url, log).await
            }
            None => None,
        };
        let mut report = stage_report(
            stage.label(),
            stage.duration_s,
            &records,
            &cfg.endpoints,
            &before,
            &after,
        );
        if let (Some(b), Some(a)) = (&router_before, &router_after) {
            report.router_counters = Some(counter_increase(b, a));
        }
        if let Some(r) = &rejected {
            log(&format!(
                "reject stream: {} sent, {} rejected (4xx), {} accepted, {} other",
                r.sent, r.rejected, r.accepted, r.other
            ));
        }
        report.reject_stream = rejected;
        let over = stop_ttft_p90_s.filter(|limit| match report.ttft_s.p90 {
            Some(p90) => p90 > *limit,
            None => true,
        });
        stages.push(report);
        if let Some(limit) = over {
            if i + 1 < cfg.stages.len() {
                log(&format!(
                    "stopping the ramp: TTFT p90 above {limit} s (or no successful request); {} stage(s) skipped",
                    cfg.stages.len() - i - 1
                ));
            }
            break;
        }
    }
    Ok(RunReport {
        target: cfg.target.clone(),
        workload: cfg.workload.kind.name().into(),
        seed: cfg.seed,
        time_scale: cfg.time_scale,
        endpoints: cfg.endpoints.clone(),
        stages,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn envoy_admin_counters_parse_and_subtract() {
        // As Envoy's admin /stats?filter=kvroute_ answers (a histogram line
        // and a non-integer value are skipped).
        let before = parse_stats(
            "kvroute_branch_sticky: 10\nkvroute_routed: 12\n\
             kvroute_lat: P0(nan,1) P25(nan,2)\nkvroute_ratio: 0.5\n",
        );
        assert_eq!(before.len(), 2);
        assert_eq!(before["kvroute_routed"], 12);
        let after = parse_stats(
            "kvroute_branch_sticky: 15\nkvroute_routed: 20\n\
             kvroute_branch_saturation_release: 3\n",
        );
        let d = counter_increase(&before, &after);
        assert_eq!(d["kvroute_branch_sticky"], 5);
        assert_eq!(d["kvroute_routed"], 8);
        // Not there before: counted from 0.
        assert_eq!(d["kvroute_branch_saturation_release"], 3);
        // A counter that fell (the router restarted) rose by nothing.
        let d = counter_increase(&after, &before);
        assert_eq!(d["kvroute_routed"], 0);
        assert_eq!(parse_stats("").len(), 0);
    }
}

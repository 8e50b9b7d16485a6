//! Scenarios and sweeps: one scenario (fleet, router document, load) run
//! once per value of one parameter, summarised per run and rendered as a
//! Markdown table (and, with [`super::plot`], an SVG).

use super::arms::{arm_document, router_from_document, set_affinity_param, ArmParams};
use super::{simulate, FleetSpec, Load, MeshSpec, RouterSpec, SimConfig, SimReport};
use crate::workload::stages::{Stage, StageKind};
use serde::Serialize;
use serde_json::Value;

/// Everything a run needs, with the router as its configuration document
/// (`None`: round robin) so that sweeps can edit it.
#[derive(Clone, Debug)]
pub struct Scenario {
    pub fleet: FleetSpec,
    pub router_doc: Option<Value>,
    pub load: Load,
    pub seed: u64,
    pub time_scale: f64,
    pub stop_after_ttft_p90_s: Option<f64>,
    pub envoy_workers: usize,
    /// `--decision-log` (see [`SimConfig::decision_log`]).
    pub decision_log: Option<String>,
    /// Several proxies (see [`SimConfig::mesh`]).
    pub mesh: MeshSpec,
}

impl Scenario {
    pub fn sim_config(&self) -> Result<SimConfig, String> {
        let router = match &self.router_doc {
            None => RouterSpec::RoundRobin,
            Some(d) => router_from_document(d)?,
        };
        Ok(SimConfig {
            fleet: self.fleet.clone(),
            router,
            load: self.load.clone(),
            seed: self.seed,
            time_scale: self.time_scale,
            stop_after_ttft_p90_s: self.stop_after_ttft_p90_s,
            envoy_workers: self.envoy_workers,
            decision_log: self.decision_log.clone(),
            mesh: self.mesh.clone(),
        })
    }

    pub fn run(&self) -> Result<SimReport, String> {
        simulate(self.sim_config()?)
    }
}

/// What a sweep varies.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Param {
    /// Poisson rate of every stage (req/s); for a trace, its speed-up.
    Rate,
    /// `maxTTFTPenaltyMs` of the affinity filter (τ).
    Tau,
    /// `affinityThreshold`.
    Threshold,
    /// Endpoints in the fleet.
    Endpoints,
    /// KV blocks per server (`--num-gpu-blocks`).
    KvBlocks,
}

impl Param {
    pub fn parse(s: &str) -> Result<Param, String> {
        Ok(match s {
            "rate" => Param::Rate,
            "tau" | "max-ttft-penalty-ms" => Param::Tau,
            "threshold" | "affinity-threshold" => Param::Threshold,
            "endpoints" => Param::Endpoints,
            "kv-blocks" | "num-gpu-blocks" => Param::KvBlocks,
            other => {
                return Err(format!(
                "unknown sweep parameter {other:?}: use rate, tau, threshold, endpoints or kv-blocks"
            ))
            }
        })
    }

    pub fn label(self) -> &'static str {
        match self {
            Param::Rate => "rate (req/s)",
            Param::Tau => "maxTTFTPenaltyMs τ (ms)",
            Param::Threshold => "affinityThreshold",
            Param::Endpoints => "endpoints",
            Param::KvBlocks => "KV blocks per server",
        }
    }
}

/// Parses `PARAM=V1,V2,…`.
pub fn parse_sweep(s: &str) -> Result<(Param, Vec<f64>), String> {
    let (p, vs) = s
        .split_once('=')
        .ok_or_else(|| format!("--sweep {s:?} is not PARAM=V1,V2,… (e.g. tau=0,1000,2000)"))?;
    let param = Param::parse(p.trim())?;
    let values = vs
        .split(',')
        .filter(|v| !v.trim().is_empty())
        .map(|v| {
            v.trim()
                .parse::<f64>()
                .ok()
                .filter(|x| x.is_finite() && *x >= 0.0)
                .ok_or_else(|| format!("--sweep: {v:?} is not a number ≥ 0"))
        })
        .collect::<Result<Vec<_>, _>>()?;
    if values.is_empty() {
        return Err("--sweep needs at least one value".into());
    }
    Ok((param, values))
}

/// The scenario with `param` set to `v`.
pub fn with_param(base: &Scenario, param: Param, v: f64) -> Result<Scenario, String> {
    let mut s = base.clone();
    match param {
        Param::Rate => match &mut s.load {
            Load::Workload { stages, .. } => {
                if v <= 0.0 {
                    return Err("a rate must be positive".into());
                }
                let d = stages.first().map_or(300.0, |st| st.duration_s);
                *stages = vec![Stage {
                    kind: StageKind::Rate(v),
                    duration_s: d,
                }];
            }
            Load::Trace { speed, .. } => *speed = v,
        },
        Param::Tau | Param::Threshold => {
            let key = if param == Param::Tau {
                "maxTTFTPenaltyMs"
            } else {
                "affinityThreshold"
            };
            let doc = s
                .router_doc
                .as_mut()
                .ok_or("round robin has no affinity filter to sweep")?;
            if !set_affinity_param(doc, key, v) {
                return Err(format!(
                    "the configuration has no prefix-cache-affinity-filter whose {key} could be swept"
                ));
            }
        }
        Param::Endpoints => {
            let n = v as usize;
            if n == 0 || v.fract() != 0.0 {
                return Err("endpoints must be a whole number ≥ 1".into());
            }
            s.fleet.endpoints = n;
        }
        Param::KvBlocks => {
            if v < 1.0 || v.fract() != 0.0 {
                return Err("kv-blocks must be a whole number ≥ 1".into());
            }
            s.fleet.engine.num_gpu_blocks = v as u32;
        }
    }
    Ok(s)
}

/// One run, summarised (its last stage).
#[derive(Clone, Debug, Serialize)]
pub struct Point {
    pub value: f64,
    pub requests: u64,
    pub error_rate: f64,
    pub ttft_p50_s: Option<f64>,
    pub ttft_p90_s: Option<f64>,
    pub tpot_p90_s: Option<f64>,
    pub input_tps: f64,
    pub output_tps: f64,
    pub hit_ratio: Option<f64>,
    /// The largest endpoint's share of the fleet's queried prompt tokens.
    pub max_token_share: Option<f64>,
    pub sim_s: f64,
    pub wall_s: f64,
}

pub fn summarize(value: f64, r: &SimReport) -> Point {
    let st = r.stages.last();
    let shares: Vec<f64> = st
        .map(|s| s.endpoints.iter().map(|e| e.prefix_cache_queries).collect())
        .unwrap_or_default();
    let tot: f64 = shares.iter().sum();
    Point {
        value,
        requests: st.map_or(0, |s| s.requests),
        error_rate: st.map_or(0.0, |s| s.error_rate),
        ttft_p50_s: st.and_then(|s| s.ttft_s.p50),
        ttft_p90_s: st.and_then(|s| s.ttft_s.p90),
        tpot_p90_s: st.and_then(|s| s.tpot_s.p90),
        input_tps: st.map_or(0.0, |s| s.input_tokens_per_s),
        output_tps: st.map_or(0.0, |s| s.output_tokens_per_s),
        hit_ratio: st.and_then(|s| s.hit_ratio),
        max_token_share: (tot > 0.0).then(|| shares.iter().cloned().fold(0.0, f64::max) / tot),
        sim_s: r.sim_s,
        wall_s: r.wall_s,
    }
}

/// Runs `base` once per value.
pub fn run_sweep(
    base: &Scenario,
    param: Param,
    values: &[f64],
    log: &dyn Fn(&str),
) -> Result<Vec<Point>, String> {
    let mut out = Vec::new();
    for &v in values {
        let s = with_param(base, param, v)?;
        let r = s.run()?;
        let p = summarize(v, &r);
        log(&format!(
            "{} = {v}: TTFT p90 {} ms, hit {}%, {:.0} sim s in {:.2} wall s",
            param.label(),
            ms(p.ttft_p90_s),
            pct(p.hit_ratio),
            r.sim_s,
            r.wall_s
        ));
        out.push(p);
    }
    Ok(out)
}

pub fn ms(v: Option<f64>) -> String {
    v.map_or("–".into(), |s| format!("{:.0}", s * 1e3))
}

pub fn pct(v: Option<f64>) -> String {
    v.map_or("–".into(), |r| format!("{:.1}", r * 100.0))
}

/// A Markdown table of a sweep.
pub fn markdown(param: Param, points: &[Point]) -> String {
    let mut s = format!(
        "| {} | requests | err % | TTFT p50 (ms) | TTFT p90 (ms) | TPOT p90 (ms) | input tok/s | output tok/s | hit % | max endpoint share % |\n|---|---|---|---|---|---|---|---|---|---|\n",
        param.label()
    );
    for p in points {
        s.push_str(&format!(
            "| {} | {} | {:.1} | {} | {} | {} | {:.0} | {:.0} | {} | {} |\n",
            p.value,
            p.requests,
            p.error_rate * 100.0,
            ms(p.ttft_p50_s),
            ms(p.ttft_p90_s),
            ms(p.tpot_p90_s),
            p.input_tps,
            p.output_tps,
            pct(p.hit_ratio),
            pct(p.max_token_share),
        ));
    }
    s
}

/// Base arm document for a scenario (`None` for round robin).
pub fn arm_doc(arm: &str, p: &ArmParams) -> Result<Option<Value>, String> {
    arm_document(arm, p)
}

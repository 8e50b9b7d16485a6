//! What-if: does prefix-affinity routing pay for this traffic on this fleet?
//!
//! From a trace and the fleet's facts it works out, with numbers:
//! 1. **The three conditions** (DESIGN.md, "When affinity pays"), read off
//!    the trace's blocks at the servers' block size:
//!    - *distinguishing prefixes span whole blocks*: a block is
//!      distinguishing when it is reused (in ≥ 2 requests) but not common
//!      (in under 90 % of them); the condition holds when at least half of
//!      the requests carry one. A per-session prefix shorter than a block
//!      never gets one: its first block also holds unique text.
//!    - *the working set exceeds one endpoint's cache*: reused blocks ×
//!      block size against `num_gpu_blocks × block_size`.
//!    - *more than one candidate*: endpoints ≥ 2.
//! 2. **Ceilings**: the block ceiling (every prompt's whole cacheable blocks,
//!    `⌊(tokens − 1) / B⌋ · B`, over prompt tokens) and the reuse ceiling
//!    (only blocks an earlier request already had, one infinite cache).
//! 3. **Arms**, simulated on the trace: round robin, the llm-d matched
//!    configuration, the shipped default (with the fleet's calibrated
//!    throughput) and always-sticky.
//! 4. **Bottleneck** from the round-robin run's servers: KV memory when
//!    requests were preempted (> 1 %) or the cache sat ≥ 90 % full with a
//!    queue; else prefill or decode by which took more iteration time.
//! 5. **τ**: a sweep of `maxTTFTPenaltyMs` on the matched configuration.
//!    The cliff is the smallest τ from which every larger τ keeps ≥ 90 % of
//!    the best hit ratio. From one step above it (the whole sweep when
//!    nothing collapsed), the recommendation is the largest τ up to the
//!    shipped 18000 ms whose TTFT p90 is within 25 % (or 100 ms) of the best
//!    there: erring high. A sweep equal to the never-release run (the gate
//!    never fired) keeps 18000 ms. The cost of getting it wrong is the run
//!    one step below the cliff and the never-release run.
//! 6. **Verdict**: affinity pays when the three conditions hold and, at the
//!    recommended τ, the hit ratio beats round robin's by over 2 points with
//!    a TTFT p90 at most 10 % above its.

use super::arms::{arm_document, set_affinity_param, ArmParams};
use super::sweep::{ms, pct, summarize, Point, Scenario};
use super::trace::{TracePrompt, TraceRequest};
use super::{FleetSpec, Load};
use crate::workload::prompt::{cacheable_tokens, piece_block_hashes};
use kvroute_core::blocks::{chain_seed, text_blocks, BlockConfig};
use serde::Serialize;
use std::collections::{HashMap, HashSet};

/// τ values the sweep tries (ms); 0 (never release) is run separately.
pub const TAU_GRID: &[f64] = &[
    50.0, 100.0, 250.0, 500.0, 1000.0, 2000.0, 4000.0, 8000.0, 18000.0, 36000.0,
];

#[derive(Clone, Debug)]
pub struct Facts {
    pub fleet: FleetSpec,
    /// Calibrated `peakPrefillThroughput`, tok/s.
    pub peak_prefill_tps: f64,
    /// The collector's poll period, ms.
    pub metrics_poll_ms: u64,
    pub seed: u64,
}

#[derive(Clone, Debug, Serialize)]
pub struct Conditions {
    pub requests: u64,
    pub prompt_tokens: u64,
    pub block_size: u32,
    /// Requests carrying at least one distinguishing block.
    pub requests_with_distinguishing: u64,
    pub distinguishing_tokens_per_request: f64,
    pub common_tokens_per_request: f64,
    pub distinguishing_whole_blocks: bool,
    pub working_set_tokens: u64,
    pub capacity_tokens: u64,
    pub working_set_exceeds_one_cache: bool,
    pub endpoints: usize,
    pub several_candidates: bool,
    pub block_ceiling: f64,
    pub reuse_ceiling: f64,
}

#[derive(Clone, Debug, Serialize)]
pub struct ArmResult {
    pub arm: String,
    pub point: Point,
}

#[derive(Clone, Debug, Serialize)]
pub struct Verdict {
    pub conditions: Conditions,
    pub trace_seconds: f64,
    pub arms: Vec<ArmResult>,
    pub bottleneck: String,
    pub bottleneck_why: String,
    pub profile: String,
    pub tau_sweep: Vec<Point>,
    /// τ = 0: never release.
    pub never_release: Point,
    pub tau_cliff_ms: Option<f64>,
    pub tau_recommended_ms: f64,
    pub tau_note: String,
}

/// The servers' blocks of one request.
fn server_blocks(r: &TraceRequest, fleet: &FleetSpec) -> (u64, Vec<u64>) {
    let model = r.model.as_deref().unwrap_or(&fleet.model);
    let seed = chain_seed(model, None);
    let bs = fleet.engine.block_size;
    match &r.prompt {
        TracePrompt::Segments(p) => (
            p.iter().map(|x| u64::from(x.tokens)).sum(),
            piece_block_hashes(p, bs, seed),
        ),
        TracePrompt::Text(t) => {
            let b = text_blocks(
                t.as_bytes(),
                seed,
                &BlockConfig {
                    block_size_tokens: bs,
                    chars_per_token: fleet.chars_per_token,
                    max_prefix_tokens: 0,
                },
            );
            (b.prompt_tokens, b.block_hashes)
        }
    }
}

/// The three conditions and the ceilings.
pub fn conditions(trace: &[TraceRequest], fleet: &FleetSpec) -> Conditions {
    let bs = fleet.engine.block_size.max(1);
    let reqs: Vec<(u64, Vec<u64>)> = trace
        .iter()
        .map(|r| {
            let (tokens, mut blocks) = server_blocks(r, fleet);
            blocks.truncate((cacheable_tokens(tokens, bs) / u64::from(bs)) as usize);
            (tokens, blocks)
        })
        .collect();
    let n = reqs.len() as u64;
    let mut count: HashMap<u64, u64> = HashMap::new();
    for (_, b) in &reqs {
        for h in b {
            *count.entry(*h).or_insert(0) += 1;
        }
    }
    let common_at = ((n as f64) * 0.9).ceil().max(2.0) as u64;
    let (mut with_dist, mut dist_blocks, mut common_blocks) = (0u64, 0u64, 0u64);
    let mut seen: HashSet<u64> = HashSet::new();
    let (mut prompt, mut cacheable, mut reusable) = (0u64, 0u64, 0u64);
    for (tokens, b) in &reqs {
        prompt += tokens;
        cacheable += b.len() as u64 * u64::from(bs);
        let d = b
            .iter()
            .filter(|h| (2..common_at).contains(&count[*h]))
            .count() as u64;
        common_blocks += b.iter().filter(|h| count[*h] >= common_at).count() as u64;
        dist_blocks += d;
        if d > 0 {
            with_dist += 1;
        }
        let hit = b.iter().take_while(|h| seen.contains(*h)).count() as u64;
        reusable += hit * u64::from(bs);
        seen.extend(b.iter().copied());
    }
    let working_set_tokens = count.values().filter(|&&c| c >= 2).count() as u64 * u64::from(bs);
    let capacity_tokens = u64::from(fleet.engine.num_gpu_blocks) * u64::from(bs);
    let per = |blocks: u64| (blocks * u64::from(bs)) as f64 / n.max(1) as f64;
    Conditions {
        requests: n,
        prompt_tokens: prompt,
        block_size: bs,
        requests_with_distinguishing: with_dist,
        distinguishing_tokens_per_request: per(dist_blocks),
        common_tokens_per_request: per(common_blocks),
        distinguishing_whole_blocks: with_dist * 2 >= n && n > 0,
        working_set_tokens,
        capacity_tokens,
        working_set_exceeds_one_cache: working_set_tokens > capacity_tokens,
        endpoints: fleet.endpoints,
        several_candidates: fleet.endpoints >= 2,
        block_ceiling: cacheable as f64 / prompt.max(1) as f64,
        reuse_ceiling: reusable as f64 / prompt.max(1) as f64,
    }
}

fn scenario(trace: &[TraceRequest], f: &Facts, doc: Option<serde_json::Value>) -> Scenario {
    Scenario {
        fleet: f.fleet.clone(),
        router_doc: doc,
        load: Load::Trace {
            requests: trace.to_vec(),
            speed: 1.0,
        },
        seed: f.seed,
        time_scale: 1.0,
        stop_after_ttft_p90_s: None,
        envoy_workers: 1,
        decision_log: None,
        mesh: Default::default(),
    }
}

/// Runs everything and decides.
pub fn what_if(trace: &[TraceRequest], f: &Facts, log: &dyn Fn(&str)) -> Result<Verdict, String> {
    let conditions = conditions(trace, &f.fleet);
    let params = ArmParams {
        peak_prefill_tps: f.peak_prefill_tps,
        max_ttft_penalty_ms: 2000.0,
        affinity_threshold: 0.8,
        block_size: f.fleet.engine.block_size,
        metrics_poll_ms: f.metrics_poll_ms,
    };
    let mut arms = Vec::new();
    for (name, arm) in [
        ("round robin", "round-robin"),
        ("llm-d matched (τ 2000 ms)", "kvroute"),
        ("shipped default", "shipped-default"),
        ("always-sticky", "always-sticky"),
    ] {
        let mut doc = arm_document(arm, &params)?;
        if arm == "shipped-default" {
            if let Some(d) = doc.as_mut() {
                set_affinity_param(d, "peakPrefillThroughput", f.peak_prefill_tps);
            }
        }
        let r = scenario(trace, f, doc).run()?;
        log(&format!(
            "{name}: {:.0} sim s in {:.2} s",
            r.sim_s, r.wall_s
        ));
        arms.push(ArmResult {
            arm: name.into(),
            point: summarize(0.0, &r),
        });
    }
    let (bottleneck, why) = bottleneck(trace, f)?;
    let profile = match bottleneck.as_str() {
        "prefill" => "affinity filter + `token-load-scorer` (the matched configuration, as shipped)",
        "decode" => "affinity filter + `active-request-scorer` (the decode-bound profile)",
        "KV memory" => "more KV per server or more servers first: routing cannot create memory; of the profiles, affinity filter + `active-request-scorer` counts the requests that hold KV",
        _ => "the matched configuration (affinity filter + `token-load-scorer`), as shipped",
    };

    // τ sweep.
    let mut sweep = Vec::new();
    for &tau in TAU_GRID {
        let p = ArmParams {
            max_ttft_penalty_ms: tau,
            ..params.clone()
        };
        let r = scenario(trace, f, arm_document("kvroute", &p)?).run()?;
        sweep.push(summarize(tau, &r));
    }
    let never = arms[3].point.clone();
    let (cliff, rec, note) = recommend_tau(&sweep, &never);
    Ok(Verdict {
        trace_seconds: trace.last().map_or(0.0, |r| r.arrival_s),
        conditions,
        arms,
        bottleneck,
        bottleneck_why: why,
        profile: profile.into(),
        tau_sweep: sweep,
        never_release: never,
        tau_cliff_ms: cliff,
        tau_recommended_ms: rec,
        tau_note: note,
    })
}

/// The τ recommendation from a sweep (ascending τ) and the never-release
/// run: `(cliff, recommended, why)` (see the module doc).
pub fn recommend_tau(sweep: &[Point], never: &Point) -> (Option<f64>, f64, String) {
    if sweep.is_empty() {
        return (None, 18_000.0, "no sweep was run".into());
    }
    let best_hit = sweep
        .iter()
        .chain(std::iter::once(never))
        .filter_map(|p| p.hit_ratio)
        .fold(0.0, f64::max);
    let ok = |p: &Point| p.hit_ratio.is_some_and(|h| h >= 0.9 * best_hit);
    // Smallest index from which every larger τ keeps the hit ratio.
    let cliff_idx = (0..sweep.len()).find(|&i| sweep[i..].iter().all(ok));
    let all_same = sweep
        .iter()
        .all(|p| p.hit_ratio == never.hit_ratio && p.ttft_p90_s == never.ttft_p90_s);
    if all_same {
        (
            None,
            18_000.0,
            format!(
                "every τ from {} ms up gave the never-release run exactly: the gate never fired on this trace at this load, so τ does not matter here; keep the shipped 18000 ms, which errs high",
                TAU_GRID[0]
            ),
        )
    } else {
        match cliff_idx {
            None => (
                None,
                *TAU_GRID.last().unwrap_or(&18_000.0),
                "no τ in the sweep kept 90 % of the best hit ratio: the hit rate collapses whenever the gate releases; use the largest τ (or always-sticky) and add capacity".to_owned(),
            ),
            Some(i) => {
                // Candidates: one grid step above the cliff and up (all of
                // the sweep when nothing collapsed). Among those whose TTFT
                // p90 is near the best (within 25 % or 100 ms), the largest
                // τ up to the shipped 18000 ms: erring high.
                let from = if i == 0 { 0 } else { (i + 1).min(sweep.len() - 1) };
                let ttft = |p: &Point| p.ttft_p90_s.unwrap_or(f64::INFINITY);
                let t_best = sweep[from..]
                    .iter()
                    .map(ttft)
                    .fold(f64::INFINITY, f64::min);
                let near = (1.25 * t_best).max(t_best + 0.1);
                let ok: Vec<&Point> = sweep[from..].iter().filter(|p| ttft(p) <= near).collect();
                let pick = ok
                    .iter()
                    .rev()
                    .find(|p| p.value <= 18_000.0)
                    .or(ok.first())
                    .map_or(sweep[from].value, |p| p.value);
                let cliff_note = if i == 0 {
                    format!(
                        "the hit ratio held at every τ down to {} ms (no cliff in the sweep); of the τ whose TTFT p90 is within 25 % (or 100 ms) of the sweep's best ({} ms), the largest up to 18000 ms",
                        TAU_GRID[0],
                        ms(Some(t_best))
                    )
                } else {
                    let below = &sweep[i - 1];
                    format!(
                        "the hit ratio collapses below τ = {} ms (at {} ms: hit {} %, TTFT p90 {} ms); from one step above it, the largest τ up to 18000 ms whose TTFT p90 is within 25 % (or 100 ms) of the best there ({} ms), erring high",
                        sweep[i].value,
                        below.value,
                        pct(below.hit_ratio),
                        ms(below.ttft_p90_s),
                        ms(Some(t_best))
                    )
                };
                (Some(sweep[i].value), pick, cliff_note)
            }
        }
    }
}

/// Trace speed-ups the bottleneck search tries under round robin.
const SPEEDS: &[f64] = &[1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0];

/// Which resource gives out first as the trace is sped up under round
/// robin: KV memory (preemptions above 1 % of requests), prefill (TTFT p90
/// doubles, and past 1 s) or decode (TPOT p90 doubles).
fn bottleneck(trace: &[TraceRequest], f: &Facts) -> Result<(String, String), String> {
    let mut base: Option<(f64, f64)> = None;
    for &speed in SPEEDS {
        let mut sc = scenario(trace, f, None);
        sc.load = Load::Trace {
            requests: trace.to_vec(),
            speed,
        };
        let r = sc.run()?;
        let p = summarize(speed, &r);
        let (ttft, tpot) = (p.ttft_p90_s.unwrap_or(0.0), p.tpot_p90_s.unwrap_or(0.0));
        let pre = r.totals.preemptions as f64 / r.totals.arrived.max(1) as f64;
        let at = |what: &str| {
            format!(
                "under round robin at {speed}× the trace's rate, {what} (at 1×: TTFT p90 {} ms, TPOT p90 {} ms; at {speed}×: TTFT p90 {} ms, TPOT p90 {} ms, {} preemptions, mean KV usage {:.0} %)",
                ms(base.map(|b| b.0)),
                ms(base.map(|b| b.1)),
                ms(p.ttft_p90_s),
                ms(p.tpot_p90_s),
                r.totals.preemptions,
                r.utilization.kv_usage_mean() * 100.0
            )
        };
        if pre > 0.01 {
            return Ok(("KV memory".into(), at("requests were preempted first")));
        }
        let Some((t0, d0)) = base else {
            base = Some((ttft, tpot));
            continue;
        };
        let ttft_out = ttft > 2.0 * t0 && ttft > 1.0;
        let tpot_out = tpot > 2.0 * d0;
        if ttft_out || tpot_out {
            // Both at once: the larger relative growth decides.
            let prefill = ttft_out && (!tpot_out || ttft / t0.max(1e-9) >= tpot / d0.max(1e-9));
            return Ok(if prefill {
                ("prefill".into(), at("TTFT p90 gave out first"))
            } else {
                ("decode".into(), at("TPOT p90 gave out first"))
            });
        }
    }
    Ok((
        "none up to 8× this rate".into(),
        "under round robin, neither TTFT p90 nor TPOT p90 doubled and nothing was preempted up to 8× the trace's rate: the fleet has room; affinity then only saves prefill compute".into(),
    ))
}

fn yes(b: bool) -> &'static str {
    if b {
        "yes"
    } else {
        "**no**"
    }
}

/// The verdict as Markdown.
pub fn render(v: &Verdict, f: &Facts) -> String {
    let c = &v.conditions;
    let mut s = String::new();
    let pays =
        c.distinguishing_whole_blocks && c.working_set_exceeds_one_cache && c.several_candidates;
    let rr = &v.arms[0].point;
    let matched = &v.arms[1].point;
    let rec_point = v
        .tau_sweep
        .iter()
        .find(|p| p.value == v.tau_recommended_ms)
        .unwrap_or(matched);
    s.push_str("# What-if: prefix-affinity routing for this trace\n\n");
    s.push_str(&format!(
        "Trace: {} requests over {:.0} s ({:.2} req/s), {:.0} prompt tokens per request. Fleet: {} endpoints × {} KV blocks of {} tokens ({} tokens each), peakPrefillThroughput {:.0} tok/s.\n\n",
        c.requests,
        v.trace_seconds,
        c.requests as f64 / v.trace_seconds.max(1e-9),
        c.prompt_tokens as f64 / c.requests.max(1) as f64,
        f.fleet.endpoints,
        f.fleet.engine.num_gpu_blocks,
        c.block_size,
        c.capacity_tokens,
        f.peak_prefill_tps
    ));
    let gain = match (rec_point.hit_ratio, rr.hit_ratio) {
        (Some(a), Some(b)) => format!(
            "at the recommended τ: hit ratio {} % vs round robin's {} %, TTFT p90 {} ms vs {} ms",
            pct(Some(a)),
            pct(Some(b)),
            ms(rec_point.ttft_p90_s),
            ms(rr.ttft_p90_s)
        ),
        _ => "no hit ratio measured".into(),
    };
    let inf = f64::INFINITY;
    let faster = rec_point.ttft_p90_s.unwrap_or(inf) <= 1.1 * rr.ttft_p90_s.unwrap_or(inf);
    let more_hits = rec_point.hit_ratio.unwrap_or(0.0) > rr.hit_ratio.unwrap_or(0.0) + 0.02;
    let verdict = match (pays, faster && more_hits) {
        (true, true) => "affinity routing pays",
        (true, false) => "the conditions hold, but in simulation affinity does not beat round robin's TTFT p90 and hit ratio at this load",
        (false, _) => "affinity routing is not expected to pay; round robin is as good and cheaper",
    };
    s.push_str(&format!(
        "**Verdict: {verdict}** ({gain}). Bottleneck: **{}**; use {}. Recommended `maxTTFTPenaltyMs`: **{:.0}**.\n\n",
        v.bottleneck,
        v.profile,
        v.tau_recommended_ms
    ));
    s.push_str("## The three conditions\n\n| condition | holds | numbers |\n|---|---|---|\n");
    s.push_str(&format!(
        "| distinguishing prefixes span whole blocks | {} | {} of {} requests carry a reused, not-common block; {:.0} distinguishing and {:.0} common cached tokens per request ({}-token blocks) |\n",
        yes(c.distinguishing_whole_blocks),
        c.requests_with_distinguishing,
        c.requests,
        c.distinguishing_tokens_per_request,
        c.common_tokens_per_request,
        c.block_size
    ));
    s.push_str(&format!(
        "| the working set exceeds one endpoint's cache | {} | reused blocks hold {} tokens; one endpoint caches {} ({:.1}×) |\n",
        yes(c.working_set_exceeds_one_cache),
        c.working_set_tokens,
        c.capacity_tokens,
        c.working_set_tokens as f64 / c.capacity_tokens.max(1) as f64
    ));
    s.push_str(&format!(
        "| more than one candidate | {} | {} endpoints |\n\n",
        yes(c.several_candidates),
        c.endpoints
    ));
    s.push_str(&format!(
        "Hit-ratio ceilings: **{:.1} %** reuse ceiling (blocks an earlier request already had, one infinite cache); {:.1} % block ceiling (every prompt's whole cacheable blocks / prompt tokens).\n\n",
        c.reuse_ceiling * 100.0,
        c.block_ceiling * 100.0
    ));
    s.push_str("## Simulated arms (this trace, this fleet)\n\n| arm | hit % | TTFT p50 (ms) | TTFT p90 (ms) | input tok/s | max endpoint share % |\n|---|---|---|---|---|---|\n");
    for a in &v.arms {
        let p = &a.point;
        s.push_str(&format!(
            "| {} | {} | {} | {} | {:.0} | {} |\n",
            a.arm,
            pct(p.hit_ratio),
            ms(p.ttft_p50_s),
            ms(p.ttft_p90_s),
            p.input_tps,
            pct(p.max_token_share)
        ));
    }
    if let Some(share) = matched.max_token_share {
        let fair = 1.0 / f.fleet.endpoints.max(1) as f64;
        if share > 1.5 * fair && f.fleet.endpoints > 1 {
            s.push_str(&format!(
                "\nHot spot: under the matched configuration one endpoint served {:.0} % of the prompt tokens (a fair share is {:.0} %); it saturates first as load grows, which is what `maxTTFTPenaltyMs` is for.\n",
                share * 100.0,
                fair * 100.0
            ));
        }
    }
    s.push_str(&format!(
        "\n## Bottleneck\n\n**{}**: {}.\n\n",
        v.bottleneck, v.bottleneck_why
    ));
    s.push_str("## maxTTFTPenaltyMs (τ) on the matched configuration, at the trace's rate\n\n| τ (ms) | hit % | TTFT p90 (ms) |\n|---|---|---|\n");
    for p in &v.tau_sweep {
        s.push_str(&format!(
            "| {} | {} | {} |\n",
            p.value,
            pct(p.hit_ratio),
            ms(p.ttft_p90_s)
        ));
    }
    s.push_str(&format!(
        "| never release (0) | {} | {} |\n\n",
        pct(v.never_release.hit_ratio),
        ms(v.never_release.ttft_p90_s)
    ));
    let rec = v.tau_sweep.iter().find(|p| p.value == v.tau_recommended_ms);
    s.push_str(&format!(
        "Recommended τ = **{:.0} ms**: {}.",
        v.tau_recommended_ms, v.tau_note
    ));
    if let Some(r) = rec {
        s.push_str(&format!(
            " At {:.0} ms: hit {} %, TTFT p90 {} ms.",
            r.value,
            pct(r.hit_ratio),
            ms(r.ttft_p90_s)
        ));
    }
    s.push_str(" Cost of getting it wrong: ");
    let low = v
        .tau_cliff_ms
        .and_then(|c| v.tau_sweep.iter().rposition(|p| p.value < c))
        .map(|i| &v.tau_sweep[i]);
    match low {
        Some(l) => s.push_str(&format!(
            "too low ({} ms): hit {} %, TTFT p90 {} ms; ",
            l.value,
            pct(l.hit_ratio),
            ms(l.ttft_p90_s)
        )),
        None => s.push_str(&format!(
            "too low: no collapse within the sweep (down to {} ms); ",
            TAU_GRID[0]
        )),
    }
    s.push_str(&format!(
        "never releasing: hit {} %, TTFT p90 {} ms.\n",
        pct(v.never_release.hit_ratio),
        ms(v.never_release.ttft_p90_s)
    ));
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::simulator::trace::parse_trace;

    fn pt(tau: f64, hit: f64, ttft_s: f64) -> Point {
        Point {
            value: tau,
            requests: 100,
            error_rate: 0.0,
            ttft_p50_s: Some(ttft_s / 2.0),
            ttft_p90_s: Some(ttft_s),
            tpot_p90_s: None,
            input_tps: 0.0,
            output_tps: 0.0,
            hit_ratio: Some(hit),
            max_token_share: None,
            sim_s: 0.0,
            wall_s: 0.0,
        }
    }

    #[test]
    fn tau_recommendation_errs_high_of_the_cliff() {
        // Hit collapses below 500 ms; from 1000 ms up TTFT grows (hot spot).
        let sweep = vec![
            pt(100.0, 0.60, 50.0),
            pt(250.0, 0.62, 40.0),
            pt(500.0, 0.90, 0.3),
            pt(1000.0, 0.91, 0.32),
            pt(2000.0, 0.91, 0.35),
            pt(18000.0, 0.92, 6.0),
        ];
        let never = pt(0.0, 0.92, 6.0);
        let (cliff, rec, why) = recommend_tau(&sweep, &never);
        assert_eq!(cliff, Some(500.0));
        // One step above the cliff and up, within 25 % / 100 ms of the best
        // (0.32 s): 1000 and 2000; the larger wins.
        assert_eq!(rec, 2000.0, "{why}");
        // Nothing collapses, low τ is much faster: the largest near-best τ.
        let sweep = vec![
            pt(50.0, 0.90, 0.10),
            pt(500.0, 0.91, 0.14),
            pt(1000.0, 0.91, 0.25),
            pt(18000.0, 0.91, 5.0),
        ];
        let (cliff, rec, _) = recommend_tau(&sweep, &pt(0.0, 0.91, 5.0));
        assert_eq!((cliff, rec), (Some(50.0), 500.0));
        // A flat sweep equal to never-release: the gate never fired.
        let flat = vec![
            pt(50.0, 0.9, 0.1),
            pt(18000.0, 0.9, 0.1),
            pt(36000.0, 0.9, 0.1),
        ];
        let (cliff, rec, why) = recommend_tau(&flat, &pt(0.0, 0.9, 0.1));
        assert_eq!((cliff, rec), (None, 18000.0));
        assert!(why.contains("never fired"), "{why}");
    }

    #[test]
    fn ceilings_and_conditions_by_hand() {
        // Two identical 370-token prompts and one other: blocks of 64.
        let t = parse_trace(concat!(
            "{\"arrival_s\":0,\"segments\":[{\"id\":\"p\",\"tokens\":370}],\"output_tokens\":1}\n",
            "{\"arrival_s\":1,\"segments\":[{\"id\":\"p\",\"tokens\":370}],\"output_tokens\":1}\n",
            "{\"arrival_s\":2,\"segments\":[{\"id\":\"q\",\"tokens\":370}],\"output_tokens\":1}\n",
        ))
        .unwrap();
        let mut fleet = FleetSpec::default();
        fleet.engine.block_size = 64;
        fleet.engine.num_gpu_blocks = 4;
        let c = conditions(&t, &fleet);
        // Block ceiling: 3 × 320 / 1110 = 320/370 = 86.5 %.
        assert!(
            (c.block_ceiling - 320.0 / 370.0).abs() < 1e-9,
            "{}",
            c.block_ceiling
        );
        // Reuse ceiling: only the second prompt finds its 5 blocks: 320 / 1110.
        assert!(
            (c.reuse_ceiling - 320.0 / 1110.0).abs() < 1e-9,
            "{}",
            c.reuse_ceiling
        );
        // Reused blocks: p's 5 (in 2 of 3 requests, under 90 %: distinguishing).
        assert_eq!(c.working_set_tokens, 320);
        assert_eq!(c.capacity_tokens, 256);
        assert!(c.working_set_exceeds_one_cache);
        assert_eq!(c.requests_with_distinguishing, 2);
        assert!(c.distinguishing_whole_blocks);
        assert!(c.several_candidates);
        // A per-request prefix shorter than a block shares nothing.
        let t = parse_trace(concat!(
            "{\"arrival_s\":0,\"segments\":[{\"id\":\"u1\",\"tokens\":40},{\"id\":\"x1\",\"tokens\":300}],\"output_tokens\":1}\n",
            "{\"arrival_s\":1,\"segments\":[{\"id\":\"u1\",\"tokens\":40},{\"id\":\"x2\",\"tokens\":300}],\"output_tokens\":1}\n",
        ))
        .unwrap();
        let c = conditions(&t, &fleet);
        assert_eq!(c.reuse_ceiling, 0.0);
        assert!(!c.distinguishing_whole_blocks);
        assert!(!c.working_set_exceeds_one_cache);
    }
}

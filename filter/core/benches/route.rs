//! Parse + hash + decide, natively: what one routing decision costs, by
//! stage, for 8 KB, 64 KB and 400 KB chat bodies among 8 and 64 endpoints.
//!
//!     cargo bench -p kvroute-core --bench route [-- FILTER]
//!
//! Stages (each timed alone, over warm state; see `common/mod.rs`):
//! - `parse`: `request::parse_request` of the chat body;
//! - `hash`: `blocks::prompt_blocks` (token estimate + chained xxh64 blocks);
//! - `state`: reading the endpoint table, load and metrics tables, and the
//!   prefix-index lookup (`index::longest_prefixes`), building candidates
//!   as `Engine::route` does (`Engine::snapshot`);
//! - `decide`: `Scheduler::schedule` over those candidates;
//! - `route`: `Engine::route` end to end over a `MemoryStore` (all of the
//!   above, plus the charge CAS, the index insert and the explanation).
//!
//! Method: every (case, stage) is sampled once per round, rounds interleave
//! all cases so that machine noise hits them alike, and the median of the
//! rounds is reported with its spread (half the inter-quartile range, as a
//! percentage of the median). Rounds: `KVROUTE_BENCH_ROUNDS` (default 21).
//! The results and the command that produced them go in docs/benchmarks.md.

mod common;

use common::{Case, ENDPOINTS, SIZES};
use kvroute_core::scheduling::Rng;
use std::hint::black_box;
use std::time::{Duration, Instant};

/// Wall time one sample aims at.
const SAMPLE: Duration = Duration::from_millis(20);

const STAGES: [&str; 5] = ["parse", "hash", "state", "decide", "route"];

/// Runs stage `stage` of `case` `iters` times; returns the time per run (ns).
fn run(case: &Case, stage: &str, iters: u64, rng: &mut Rng) -> f64 {
    let req = case.parse();
    let blocks = case.hash(&req);
    let facts = case.facts(&blocks, req.max_output_tokens);
    let (view, cands) = case.candidates(&facts);
    let mut timed = Duration::ZERO;
    let start = Instant::now();
    match stage {
        "parse" => (0..iters).for_each(|_| drop(black_box(case.parse()))),
        "hash" => (0..iters).for_each(|_| drop(black_box(case.hash(black_box(&req))))),
        "state" => (0..iters).for_each(|_| drop(black_box(case.candidates(black_box(&facts))))),
        "decide" => {
            (0..iters).for_each(|_| drop(black_box(case.decide(&view, black_box(&cands), rng))))
        }
        "route" => {
            // Timed one by one: the release that keeps the state steady is not part of it.
            for _ in 0..iters {
                let t = Instant::now();
                let ticket = black_box(case.route_only(rng));
                timed += t.elapsed();
                case.release(ticket);
            }
        }
        other => unreachable!("stage {other}"),
    }
    if timed.is_zero() {
        timed = start.elapsed();
    }
    timed.as_nanos() as f64 / iters as f64
}

struct Series {
    iters: u64,
    samples: Vec<f64>,
}

impl Series {
    fn sorted(&self) -> Vec<f64> {
        let mut s = self.samples.clone();
        s.sort_by(f64::total_cmp);
        s
    }
    fn median(&self) -> f64 {
        let s = self.sorted();
        s[s.len() / 2]
    }
    /// Half the inter-quartile range, as % of the median.
    fn spread(&self) -> f64 {
        let s = self.sorted();
        let (q1, q3) = (s[s.len() / 4], s[s.len() * 3 / 4]);
        (q3 - q1) / 2.0 / self.median() * 100.0
    }
}

fn us(ns: f64) -> String {
    if ns >= 100_000.0 {
        format!("{:.0}", ns / 1000.0)
    } else if ns >= 1000.0 {
        format!("{:.1}", ns / 1000.0)
    } else {
        format!("{:.2}", ns / 1000.0)
    }
}

fn main() {
    let filter: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with("--"))
        .collect();
    let rounds: usize = std::env::var("KVROUTE_BENCH_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(21);
    let mut cases = Vec::new();
    for &bytes in &SIZES {
        for &endpoints in &ENDPOINTS {
            let c = Case::new(bytes, endpoints);
            if filter.is_empty() || filter.iter().any(|f| c.label().contains(f.as_str())) {
                cases.push(c);
            }
        }
    }
    let mut rng = Rng::new(42);
    // Calibrate: iterations per sample so that one sample takes ~SAMPLE.
    let mut series: Vec<Vec<Series>> = cases
        .iter()
        .map(|c| {
            STAGES
                .iter()
                .map(|s| {
                    run(c, s, 3, &mut rng);
                    let one = run(c, s, 3, &mut rng).max(1.0);
                    Series {
                        iters: ((SAMPLE.as_nanos() as f64 / one) as u64).clamp(3, 10_000_000),
                        samples: Vec::with_capacity(rounds),
                    }
                })
                .collect()
        })
        .collect();
    for _ in 0..rounds {
        for (c, case) in cases.iter().enumerate() {
            for (s, stage) in STAGES.iter().enumerate() {
                let iters = series[c][s].iters;
                let ns = run(case, stage, iters, &mut rng);
                series[c][s].samples.push(ns);
            }
        }
    }
    let med =
        |c: usize, s: &str| series[c][STAGES.iter().position(|x| *x == s).unwrap_or(0)].median();

    println!(
        "kvroute-core route bench: {rounds} rounds, ~{} ms per sample, medians (± half IQR)",
        SAMPLE.as_millis()
    );
    println!();
    println!("| case | parse µs | hash µs | state µs | decide µs | route µs | route − (parse+hash+state+decide) µs |");
    println!("|---|---:|---:|---:|---:|---:|---:|");
    for (c, case) in cases.iter().enumerate() {
        let cell = |s: usize| {
            format!(
                "{} ±{:.0}%",
                us(series[c][s].median()),
                series[c][s].spread()
            )
        };
        let rest =
            med(c, "route") - med(c, "parse") - med(c, "hash") - med(c, "state") - med(c, "decide");
        println!(
            "| {} | {} | {} | {} | {} | {} | {} |",
            case.label(),
            cell(0),
            cell(1),
            cell(2),
            cell(3),
            cell(4),
            us(rest)
        );
    }

    // Linearity in body size: ns per body byte, and the ratio to the smallest body.
    println!();
    println!("| body | endpoints | parse+hash ns/byte | route ns/byte | parse+hash vs smallest (per byte) |");
    println!("|---|---:|---:|---:|---:|");
    for &endpoints in &ENDPOINTS {
        let idx: Vec<usize> = (0..cases.len())
            .filter(|&c| cases[c].endpoints == endpoints)
            .collect();
        let Some(&first) = idx.first() else { continue };
        let per_byte = |c: usize| (med(c, "parse") + med(c, "hash")) / cases[c].bytes as f64;
        for &c in &idx {
            println!(
                "| {} KiB | {} | {:.2} | {:.2} | {:.2}× |",
                (cases[c].bytes + 512) >> 10,
                endpoints,
                per_byte(c),
                med(c, "route") / cases[c].bytes as f64,
                per_byte(c) / per_byte(first)
            );
        }
    }

    // Per-endpoint cost beyond hashing: the 64- vs 8-endpoint difference.
    println!();
    println!("| body | decide per extra endpoint ns | state per extra endpoint ns | route per extra endpoint ns |");
    println!("|---|---:|---:|---:|");
    for &bytes in &SIZES {
        let find = |e: usize| {
            cases
                .iter()
                .position(|c| c.endpoints == e && (c.bytes as f64 / bytes as f64 - 1.0).abs() < 0.1)
        };
        let (Some(a), Some(b)) = (find(ENDPOINTS[0]), find(ENDPOINTS[1])) else {
            continue;
        };
        let extra = (ENDPOINTS[1] - ENDPOINTS[0]) as f64;
        let d = |s: &str| (med(b, s) - med(a, s)) / extra;
        println!(
            "| {} KiB | {:.0} | {:.0} | {:.0} |",
            (cases[a].bytes + 512) >> 10,
            d("decide"),
            d("state"),
            d("route")
        );
    }
}

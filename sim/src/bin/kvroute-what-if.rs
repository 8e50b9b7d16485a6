//! `kvroute-what-if`: from a request trace and the fleet's facts, whether
//! prefix-affinity routing pays, which profile to use and which
//! `maxTTFTPenaltyMs`, with the simulated figures behind each answer.

use kvroute_sim_model::cli::Flags;
use kvroute_sim_model::simulator::trace::parse_trace;
use kvroute_sim_model::simulator::whatif::{render, what_if, Facts};
use kvroute_sim_model::simulator::{fleet_from_flags, FLEET_FLAGS, FLEET_USAGE};

const USAGE: &str = "\
kvroute-what-if --trace FILE [fleet options]

Reads a JSONL request trace (schema: sim/README.md) and the fleet's facts, and
prints a Markdown verdict: whether the three conditions that make affinity pay
hold (with numbers), the hit-ratio ceilings, simulated hit ratio and TTFT p90
for round robin, the llm-d matched configuration, the shipped default and
always-sticky, the bottleneck (prefill, KV memory, decode) and so the profile,
and a recommended maxTTFTPenaltyMs from a sweep, with the cost of getting it
wrong. Every run is kvroute-simulate's (virtual time, kvroute's own routing).

  --trace FILE              the trace (required)
  --peak X                  calibrated peakPrefillThroughput, tok/s [--prefill-tps]
  --metrics-poll-ms MS      the collector's poll period [100]
  --speed X                 play the trace X times faster (arrival times / X): the
                            verdict for the traffic grown by X [1]
  --seed N                  routing randomness [1]
  --json PATH               also write the verdict as JSON

";

const P: &str = "kvroute-what-if";

fn run(f: &Flags) -> Result<(), String> {
    let path = f
        .str("trace")
        .ok_or(format!("{P}: --trace FILE is required"))?;
    let text =
        std::fs::read_to_string(path).map_err(|e| format!("{P}: cannot read {path}: {e}"))?;
    let mut trace = parse_trace(&text).map_err(|e| format!("{P}: {path}: {e}"))?;
    let speed: f64 = f.get("speed", 1.0)?;
    if !(speed > 0.0 && speed.is_finite()) {
        return Err(format!("{P}: --speed must be positive"));
    }
    for r in &mut trace {
        r.arrival_s /= speed;
    }
    let fleet = fleet_from_flags(f, P)?;
    let facts = Facts {
        peak_prefill_tps: f.get("peak", fleet.engine.step_cost.prefill_tokens_per_s)?,
        metrics_poll_ms: f.get("metrics-poll-ms", 100)?,
        seed: f.get("seed", 1)?,
        fleet,
    };
    if !(facts.peak_prefill_tps > 0.0 && facts.peak_prefill_tps.is_finite()) {
        return Err(format!("{P}: --peak must be positive"));
    }
    let v = what_if(&trace, &facts, &|l| eprintln!("{l}")).map_err(|e| format!("{P}: {e}"))?;
    print!("{}", render(&v, &facts));
    if let Some(out) = f.str("json") {
        let text = serde_json::to_string_pretty(&v).map_err(|e| e.to_string())?;
        std::fs::write(out, text + "\n").map_err(|e| format!("{P}: cannot write {out}: {e}"))?;
        eprintln!("wrote {out}");
    }
    Ok(())
}

fn main() {
    let mut known: Vec<(&str, bool)> = vec![
        ("trace", true),
        ("peak", true),
        ("metrics-poll-ms", true),
        ("seed", true),
        ("speed", true),
        ("json", true),
    ];
    known.extend_from_slice(FLEET_FLAGS);
    let f = match Flags::parse(P, std::env::args().skip(1), &known) {
        Ok(f) => f,
        Err(e) => {
            eprintln!("{e}\n\n{USAGE}{FLEET_USAGE}");
            std::process::exit(2);
        }
    };
    if f.has("help") {
        print!("{USAGE}{FLEET_USAGE}");
        return;
    }
    if let Err(e) = run(&f) {
        eprintln!("{e}");
        std::process::exit(1);
    }
}

//! `kvroute-simulate`: a workload or a trace through N modelled vLLM
//! servers behind kvroute's own routing code, in virtual time. Prints the
//! load generator's per-stage table; `--sweep` runs one scenario per value
//! of a parameter and prints a Markdown table (and draws an SVG).

use kvroute_sim_model::cli::Flags;
use kvroute_sim_model::simulator::arms::{arm_document, set_affinity_param, ArmParams, ARMS};
use kvroute_sim_model::simulator::plot::sweep_svg;
use kvroute_sim_model::simulator::sweep::{markdown, parse_sweep, run_sweep, Scenario};
use kvroute_sim_model::simulator::trace::parse_trace;
use kvroute_sim_model::simulator::{
    fleet_from_flags, Load, MeshSpec, ProxyAssign, FLEET_FLAGS, FLEET_USAGE,
};
use kvroute_sim_model::workload::report::render_table;
use kvroute_sim_model::workload::stages::parse_stages;
use kvroute_sim_model::workload::{Api, WorkloadKind, WorkloadSpec};

const USAGE: &str = "\
kvroute-simulate (--workload NAME --stages SPEC | --trace FILE) [options]

Runs the load through N modelled vLLM servers (the emulator's model) routed by
kvroute's own code (kvroute-core's Engine over an in-memory shared store, with
the collector's /metrics updates), in virtual time: no sockets, no sleeps.
Prints the load generator's per-stage table (model time).

Load:
  --workload NAME           shared-prefix | code-generation | reasoning | chat-lab |
                            agent-session | bursty-cold-start
  --stages SPEC             rate:3,10,30@20s | concurrency:4,8@30s, joined with ';'
                            (the load generator's grammar; model time) [rate:2@300s];
                            or sessions:32@20s,think=4s (agent-session only: 32
                            conversations, one client each, starting over 20 s, each
                            sending all its turns with a mean 4 s think time after each
                            answer, as sim/bench/replicas.py does)
  --exact-prompts           build the real request bodies and run the filter's whole
                            parse/template/hash path on them (slower; default: segments,
                            exact token counts, no text)
  --trace FILE              a JSONL trace instead (schema: sim/README.md)
  --speed X                 trace only: divide arrival times by X [1]
  --seed N                  prompts, arrivals and routing randomness [1]
  --api, --groups, --prompts-per-group, --system-tokens, --persona-tokens,
  --question-tokens, --output-tokens   workload sizes, as kvroute-loadgen

Router:
  --arm NAME                an arm of sim/bench/arms.json (quality.py's): round-robin |
                            kvroute (llm-d's matched config) | kvroute-default (the shipped
                            profile with --peak, --tau, the fleet's block size) | always-sticky |
                            legacy-blend | active-request | kvroute-18s | kvroute-output-est;
                            or shipped-default (envoy/kvroute-config.json as it is) [kvroute]
  --config FILE             any plugin configuration JSON instead of --arm
  --peak X                  the arms' peakPrefillThroughput, tok/s [--prefill-tps]
  --tau MS                  the arms' maxTTFTPenaltyMs [2000]; with --config, overrides it
  --affinity-threshold X    the arms' affinityThreshold [0.8]
  --metrics-poll-ms MS      the arms' collector poll period, router-clock ms [100]
  --time-scale X            model seconds per router-clock second, as an emulator run at
                            --time-scale X behind Envoy; 1 for real hardware [1]
  --envoy-workers N         Envoy worker threads (--concurrency): each routes with its own
                            engine and generator (the same routing.seed, when set) over
                            the one shared store; a request lands on a random one [1]
  --proxies G               G Envoy processes in front of the fleet, each with its own shared
                            data, collector and --envoy-workers workers [1]
  --proxy-assign HOW        which proxy a request goes through: rotate (turn k of group g
                            through (g + k) mod G) | random | client (closed-loop client
                            mod G; rate stages by group) [rotate]
  --mesh-exchange           the proxies exchange accepted decisions and in-flight sums per
                            server (the relay beside each server, modelled) [off]
  --exchange-ms MS          router-clock ms between one proxy's exchanges [--metrics-poll-ms]

Output:
  --json PATH               the report (or the sweep's points) as JSON
  --sweep PARAM=V1,V2,…     run once per value: rate | tau | threshold | endpoints |
                            kv-blocks; prints a Markdown table of each run's last stage
  --plot PATH.svg           with --sweep: TTFT p90 and hit ratio against the parameter
  --title TEXT              the plot's title
  --decision-log PATH       one JSON line per routing decision: branch, each endpoint's
                            index affinity, filter verdict, total and per-scorer scores,
                            insert counter, and the prefix its modelled server really holds
  --stop-after-ttft-p90 X   end the stages after the first whose TTFT p90 > X s [off]

";

fn flags() -> Vec<(&'static str, bool)> {
    let mut v: Vec<(&str, bool)> = vec![
        ("workload", true),
        ("stages", true),
        ("exact-prompts", false),
        ("trace", true),
        ("speed", true),
        ("seed", true),
        ("api", true),
        ("groups", true),
        ("prompts-per-group", true),
        ("system-tokens", true),
        ("persona-tokens", true),
        ("question-tokens", true),
        ("output-tokens", true),
        ("arm", true),
        ("config", true),
        ("peak", true),
        ("tau", true),
        ("affinity-threshold", true),
        ("metrics-poll-ms", true),
        ("time-scale", true),
        ("envoy-workers", true),
        ("proxies", true),
        ("proxy-assign", true),
        ("mesh-exchange", false),
        ("exchange-ms", true),
        ("json", true),
        ("sweep", true),
        ("plot", true),
        ("title", true),
        ("stop-after-ttft-p90", true),
        ("decision-log", true),
    ];
    v.extend_from_slice(FLEET_FLAGS);
    v
}

const P: &str = "kvroute-simulate";

fn scenario(f: &Flags) -> Result<Scenario, String> {
    let fleet = fleet_from_flags(f, P)?;
    let seed: u64 = f.get("seed", 1)?;
    let load = match (f.str("trace"), f.str("workload")) {
        (Some(_), Some(_)) => return Err(format!("{P}: give --workload or --trace, not both")),
        (Some(path), None) => {
            let text = std::fs::read_to_string(path)
                .map_err(|e| format!("{P}: cannot read {path}: {e}"))?;
            Load::Trace {
                requests: parse_trace(&text).map_err(|e| format!("{P}: {path}: {e}"))?,
                speed: f.get("speed", 1.0)?,
            }
        }
        (None, Some(w)) => {
            let kind = WorkloadKind::parse(w).map_err(|e| format!("{P}: --workload: {e}"))?;
            let d = WorkloadSpec::standard(kind);
            let api = match f.str("api").unwrap_or("chat") {
                "chat" => Api::Chat,
                "completions" => Api::Completions,
                other => return Err(format!("{P}: --api {other:?} is not chat or completions")),
            };
            let spec = WorkloadSpec {
                kind,
                model: fleet.model.clone(),
                api,
                chars_per_token: d.chars_per_token,
                groups: f.get("groups", d.groups)?,
                prompts_per_group: f.get("prompts-per-group", d.prompts_per_group)?,
                system_tokens: f.get("system-tokens", d.system_tokens)?,
                persona_tokens: f.get("persona-tokens", d.persona_tokens)?,
                question_tokens: f.get("question-tokens", d.question_tokens)?,
                output_tokens: f.get("output-tokens", d.output_tokens)?,
            };
            let stages = parse_stages(f.str("stages").unwrap_or("rate:2@300s"))
                .map_err(|e| format!("{P}: --stages: {e}"))?;
            Load::Workload {
                spec,
                stages,
                exact_prompts: f.has("exact-prompts"),
            }
        }
        (None, None) => return Err(format!("{P}: --workload NAME or --trace FILE is required")),
    };
    let params = ArmParams {
        peak_prefill_tps: f.get("peak", fleet.engine.step_cost.prefill_tokens_per_s)?,
        max_ttft_penalty_ms: f.get("tau", 2000.0)?,
        affinity_threshold: f.get("affinity-threshold", 0.8)?,
        block_size: fleet.engine.block_size,
        metrics_poll_ms: f.get("metrics-poll-ms", 100)?,
    };
    let router_doc = match (f.str("config"), f.str("arm")) {
        (Some(_), Some(_)) => return Err(format!("{P}: give --arm or --config, not both")),
        (Some(path), None) => {
            let text = std::fs::read_to_string(path)
                .map_err(|e| format!("{P}: cannot read {path}: {e}"))?;
            let mut doc: serde_json::Value =
                serde_json::from_str(&text).map_err(|e| format!("{P}: {path}: {e}"))?;
            if f.has("tau") {
                set_affinity_param(&mut doc, "maxTTFTPenaltyMs", params.max_ttft_penalty_ms);
            }
            Some(doc)
        }
        (None, arm) => arm_document(arm.unwrap_or("kvroute"), &params)
            .map_err(|e| format!("{P}: --arm: {e} ({})", ARMS.join(", ")))?,
    };
    let stop = match f.str("stop-after-ttft-p90") {
        None => None,
        Some(_) => Some(f.get("stop-after-ttft-p90", 0.0)?).filter(|v: &f64| *v > 0.0),
    };
    let s = Scenario {
        fleet,
        router_doc,
        load,
        seed,
        time_scale: f.get("time-scale", 1.0)?,
        stop_after_ttft_p90_s: stop,
        envoy_workers: f.get("envoy-workers", 1usize)?.max(1),
        decision_log: f.str("decision-log").map(str::to_owned),
        mesh: MeshSpec {
            proxies: f.get("proxies", 1usize)?.max(1),
            assign: ProxyAssign::parse(f.str("proxy-assign").unwrap_or("rotate"))
                .map_err(|e| format!("{P}: {e}"))?,
            exchange: f.has("mesh-exchange"),
            exchange_ms: f.get("exchange-ms", 0u64)?,
        },
    };
    // Refuse a bad document now, with the filter's own error.
    s.sim_config().map_err(|e| format!("{P}: {e}"))?;
    Ok(s)
}

fn write(path: &str, text: &str) -> Result<(), String> {
    std::fs::write(path, text).map_err(|e| format!("{P}: cannot write {path}: {e}"))?;
    eprintln!("wrote {path}");
    Ok(())
}

fn run(f: &Flags) -> Result<(), String> {
    let s = scenario(f)?;
    if let Some(spec) = f.str("sweep") {
        let (param, values) = parse_sweep(spec).map_err(|e| format!("{P}: {e}"))?;
        let points = run_sweep(&s, param, &values, &|l| eprintln!("{l}"))
            .map_err(|e| format!("{P}: {e}"))?;
        print!("{}", markdown(param, &points));
        if let Some(path) = f.str("json") {
            let text = serde_json::to_string_pretty(&points).map_err(|e| e.to_string())?;
            write(path, &(text + "\n"))?;
        }
        if let Some(path) = f.str("plot") {
            let title = f
                .str("title")
                .map(str::to_owned)
                .unwrap_or_else(|| format!("TTFT p90 and hit ratio vs {}", param.label()));
            write(path, &sweep_svg(&title, param, &points))?;
        }
        return Ok(());
    }
    if f.has("plot") {
        return Err(format!("{P}: --plot needs --sweep"));
    }
    let r = s.run().map_err(|e| format!("{P}: {e}"))?;
    print!("{}", render_table(&r.stages));
    let t = &r.totals;
    println!(
        "simulated {:.0} s in {:.2} s wall ({:.0}× real time): {} requests, {} finished, {} dropped {:?}, {} unrouted, {} preemptions, {} iterations, {} scrapes",
        r.sim_s,
        r.wall_s,
        r.speedup(),
        t.arrived,
        t.finished,
        t.dropped.values().sum::<u64>(),
        t.dropped,
        t.unrouted,
        t.preemptions,
        r.iterations,
        t.scrapes
    );
    if let Some(path) = f.str("json") {
        let text = serde_json::to_string_pretty(&r).map_err(|e| e.to_string())?;
        write(path, &(text + "\n"))?;
    }
    Ok(())
}

fn main() {
    let known = flags();
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

//! `kvroute-loadgen`: drives a target through load stages and reports, per
//! stage, latency, throughput, errors and the fleet's prefix-cache hit ratio
//! read from the endpoints' own counters.

use kvroute_sim::loadgen::run::{run_until, RunConfig};
use kvroute_sim_model::cli::Flags;
use kvroute_sim_model::workload::reject::RejectStream;
use kvroute_sim_model::workload::report::render_table;
use kvroute_sim_model::workload::stages::parse_stages;
use kvroute_sim_model::workload::{Api, WorkloadKind, WorkloadSpec, WORKLOAD_NAMES};
use std::time::Duration;

const USAGE: &str = "\
kvroute-loadgen --target http://127.0.0.1:PORT --workload NAME --stages SPEC [options]

  --target URL              where requests go: Envoy or one endpoint (required)
  --endpoints LIST          host:port of each model server; counters are read from
                            their /metrics before and after each stage [target's host:port]
  --workload NAME           shared-prefix | code-generation | reasoning | chat-lab |
                            agent-session | bursty-cold-start (required)
  --stages SPEC             rate:3,10,30@20s | concurrency:4,8@30s, joined with ';' (required)
  --seed N                  fixes every prompt and arrival [1]
  --json PATH               also write the report as JSON
  --time-scale X            the emulators' --time-scale: rates and durations are model
                            time, latencies are reported in model time [1.0]
  --model NAME              model field of requests [tiny]
  --api chat|completions    API the requests use [chat]
  --chars-per-token X       bytes per token when sizing prompts [2.17, the emulator's tokenizer]
  --groups N                groups / conversations / users / sessions at once /
                            documents per round [workload default]
  --prompts-per-group N     questions per group / turns per conversation / requests per
                            repeated document [workload default]
  --system-tokens N         shared or system prompt (or document) length [workload default]
  --persona-tokens N        chat-lab persona / agent-session private context length
                            [workload default]
  --question-tokens N       question / turn length [workload default]
  --output-tokens N         max_tokens of each request [workload default]
  --request-timeout-s X     wall-clock limit per request [600]
  --ceiling-block-size B    the servers' KV block size: each stage also reports the
                            stream's hit-ratio ceiling (hit_ratio_ceiling) in B-token blocks [off]
  --router-stats URL        a router's counters in Envoy admin text (e.g.
                            http://127.0.0.1:ADMIN/stats?filter=kvroute_&type=Counters):
                            each stage also reports how much each rose
                            (router_counters) [off]
  --reject-stream RATE      a second client: over-length chat requests at RATE per model
                            second (Poisson) during every stage, each a new prefix, every
                            other one streaming; the servers should answer 400. Each stage
                            reports what they got (reject_stream); they are not in its
                            requests, latencies or tokens [off]
  --reject-tokens N         their prompt length in tokens (of --chars-per-token bytes):
                            above the servers' --max-model-len [49152]
  --no-reset                do not POST /emulator/reset to the endpoints first
  --stop-after-ttft-p90 X   end the ramp after the first stage whose TTFT p90 (model
                            seconds) is above X, or that had no successful request [off]
";

const FLAGS: &[(&str, bool)] = &[
    ("target", true),
    ("endpoints", true),
    ("workload", true),
    ("stages", true),
    ("seed", true),
    ("json", true),
    ("time-scale", true),
    ("model", true),
    ("api", true),
    ("chars-per-token", true),
    ("groups", true),
    ("prompts-per-group", true),
    ("system-tokens", true),
    ("persona-tokens", true),
    ("question-tokens", true),
    ("output-tokens", true),
    ("request-timeout-s", true),
    ("ceiling-block-size", true),
    ("router-stats", true),
    ("reject-stream", true),
    ("reject-tokens", true),
    ("no-reset", false),
    ("stop-after-ttft-p90", true),
];

type Parsed = (RunConfig, Option<String>, Option<f64>);

fn config(f: &Flags) -> Result<Parsed, String> {
    let target = f
        .str("target")
        .ok_or("kvroute-loadgen: --target is required, e.g. --target http://127.0.0.1:10000")?
        .trim_end_matches('/')
        .to_owned();
    let kind = WorkloadKind::parse(f.str("workload").ok_or_else(|| {
        format!(
            "kvroute-loadgen: --workload is required ({})",
            WORKLOAD_NAMES.join(", ")
        )
    })?)
    .map_err(|e| format!("kvroute-loadgen: --workload: {e}"))?;
    let stages = parse_stages(
        f.str("stages")
            .ok_or("kvroute-loadgen: --stages is required, e.g. --stages rate:3,10@20s")?,
    )
    .map_err(|e| format!("kvroute-loadgen: --stages: {e}"))?;
    let endpoints = match f.list::<String>("endpoints")? {
        Some(e) => e,
        None => vec![target
            .split("://")
            .nth(1)
            .unwrap_or(&target)
            .split('/')
            .next()
            .unwrap_or_default()
            .to_owned()],
    };
    let d = WorkloadSpec::standard(kind);
    let api = match f.str("api").unwrap_or("chat") {
        "chat" => Api::Chat,
        "completions" => Api::Completions,
        other => {
            return Err(format!(
                "kvroute-loadgen: --api {other:?} is not chat or completions"
            ))
        }
    };
    let workload = WorkloadSpec {
        kind,
        model: f.get("model", d.model.clone())?,
        api,
        chars_per_token: f.get("chars-per-token", d.chars_per_token)?,
        groups: f.get("groups", d.groups)?,
        prompts_per_group: f.get("prompts-per-group", d.prompts_per_group)?,
        system_tokens: f.get("system-tokens", d.system_tokens)?,
        persona_tokens: f.get("persona-tokens", d.persona_tokens)?,
        question_tokens: f.get("question-tokens", d.question_tokens)?,
        output_tokens: f.get("output-tokens", d.output_tokens)?,
    };
    let timeout: f64 = f.get("request-timeout-s", 600.0)?;
    let time_scale: f64 = f.get("time-scale", 1.0)?;
    if !(time_scale > 0.0 && time_scale.is_finite()) {
        return Err("kvroute-loadgen: --time-scale must be a positive number".into());
    }
    if !(timeout > 0.0 && timeout.is_finite()) {
        return Err("kvroute-loadgen: --request-timeout-s must be a positive number".into());
    }
    let stop: Option<f64> = match f.str("stop-after-ttft-p90") {
        None => None,
        Some(_) => {
            let v: f64 = f.get("stop-after-ttft-p90", 0.0)?;
            if !(v > 0.0 && v.is_finite()) {
                return Err(
                    "kvroute-loadgen: --stop-after-ttft-p90 must be a positive number".into(),
                );
            }
            Some(v)
        }
    };
    let reject_stream = match f.str("reject-stream") {
        None => None,
        Some(_) => {
            let rate: f64 = f.get("reject-stream", 0.0)?;
            if !(rate > 0.0 && rate.is_finite()) {
                return Err("kvroute-loadgen: --reject-stream must be a positive rate".into());
            }
            let tokens: u32 = f.get("reject-tokens", 49_152u32)?;
            if tokens == 0 {
                return Err("kvroute-loadgen: --reject-tokens must be at least 1".into());
            }
            Some(RejectStream { rate, tokens })
        }
    };
    if reject_stream.is_none() && f.str("reject-tokens").is_some() {
        return Err("kvroute-loadgen: --reject-tokens needs --reject-stream".into());
    }
    Ok((
        RunConfig {
            target,
            endpoints,
            workload,
            seed: f.get("seed", 1u64)?,
            stages,
            time_scale,
            request_timeout: Duration::from_secs_f64(timeout),
            reset: !f.has("no-reset"),
            ceiling_block_size: match f.str("ceiling-block-size") {
                None => None,
                Some(_) => match f.get("ceiling-block-size", 0u32)? {
                    0 => {
                        return Err(
                            "kvroute-loadgen: --ceiling-block-size must be at least 1".into()
                        )
                    }
                    b => Some(b),
                },
            },
            router_stats: f.str("router-stats").map(str::to_owned),
            reject_stream,
        },
        f.str("json").map(str::to_owned),
        stop,
    ))
}

fn main() {
    let flags = match Flags::parse("kvroute-loadgen", std::env::args().skip(1), FLAGS) {
        Ok(f) => f,
        Err(e) => {
            eprintln!("{e}\n\n{USAGE}");
            std::process::exit(2);
        }
    };
    if flags.has("help") {
        print!("{USAGE}");
        return;
    }
    let (cfg, json_path, stop) = match config(&flags) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("{e}");
            std::process::exit(2);
        }
    };
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("kvroute-loadgen: cannot start the runtime: {e}");
            std::process::exit(1);
        }
    };
    let report = rt.block_on(run_until(cfg, stop, &|line: &str| eprintln!("{line}")));
    let report = match report {
        Ok(r) => r,
        Err(e) => {
            eprintln!("kvroute-loadgen: {e}");
            std::process::exit(1);
        }
    };
    print!("{}", render_table(&report.stages));
    if let Some(path) = json_path {
        let text = match serde_json::to_string_pretty(&report) {
            Ok(t) => t,
            Err(e) => {
                eprintln!("kvroute-loadgen: cannot encode the report: {e}");
                std::process::exit(1);
            }
        };
        if let Err(e) = std::fs::write(&path, text + "\n") {
            eprintln!("kvroute-loadgen: cannot write {path}: {e}");
            std::process::exit(1);
        }
        eprintln!("wrote {path}");
    }
}

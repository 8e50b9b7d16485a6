//! `kvroute-calibrate`: measures `peakPrefillThroughput` of an
//! OpenAI-compatible server (see `kvroute_sim::calibrate`).

use kvroute_sim::calibrate::{self, CalibrateConfig};
use kvroute_sim_model::cli::Flags;
use std::time::Duration;

const USAGE: &str = "\
kvroute-calibrate --url http://HOST:PORT [options]

Measures peakPrefillThroughput = B / median TTFT: after a warm-up, N single
cold requests of exactly B random token IDs (/v1/completions, \"prompt\": [ids],
max_tokens 1, streaming), one at a time. Prints the value, the spread and a
prefix-cache-affinity-filter snippet for your TTFT tolerance.

Run it against one idle server (not through the router), with B set to the
server's --max-num-batched-tokens.

  --url URL                  the server's base URL (required; a trailing /v1 is fine)
  --model NAME               served model name [the first of /v1/models]
  --tokens B                 prompt tokens per request [8192]
  --requests N               measured requests [10]
  --warmup N                 unmeasured requests first [2]
  --ttft-tolerance-ms MS     maxTTFTPenaltyMs for the snippet [18000]
  --token-id-max N           token IDs are drawn from [10, N); keep N below the vocabulary [4000]
  --seed S                   seed of the random token IDs [1]
  --timeout-s S              per-request timeout, seconds [120]
  --json                     print the result as one JSON object instead
";

const FLAGS: &[(&str, bool)] = &[
    ("url", true),
    ("model", true),
    ("tokens", true),
    ("requests", true),
    ("warmup", true),
    ("ttft-tolerance-ms", true),
    ("token-id-max", true),
    ("seed", true),
    ("timeout-s", true),
    ("json", false),
];

fn config(f: &Flags) -> Result<CalibrateConfig, String> {
    let d = CalibrateConfig::default();
    let base_url = f
        .str("url")
        .ok_or("kvroute-calibrate: --url is required, e.g. --url http://127.0.0.1:8000")?
        .to_owned();
    let cfg = CalibrateConfig {
        base_url,
        model: f.str("model").map(str::to_owned),
        tokens: f.get("tokens", d.tokens)?,
        requests: f.get("requests", d.requests)?,
        warmup: f.get("warmup", d.warmup)?,
        token_id_max: f.get("token-id-max", d.token_id_max)?,
        seed: f.get("seed", d.seed)?,
        timeout: Duration::from_secs_f64(f.get("timeout-s", d.timeout.as_secs_f64())?),
        ttft_tolerance_ms: f.get("ttft-tolerance-ms", d.ttft_tolerance_ms)?,
    };
    if cfg.tokens == 0 || cfg.requests == 0 {
        return Err("kvroute-calibrate: --tokens and --requests must be at least 1".into());
    }
    if cfg.token_id_max <= 10 {
        return Err("kvroute-calibrate: --token-id-max must be above 10".into());
    }
    if !(cfg.ttft_tolerance_ms >= 0.0 && cfg.ttft_tolerance_ms.is_finite()) {
        return Err("kvroute-calibrate: --ttft-tolerance-ms must be ≥ 0".into());
    }
    Ok(cfg)
}

fn main() {
    let flags = match Flags::parse("kvroute-calibrate", std::env::args().skip(1), FLAGS) {
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
    let cfg = match config(&flags) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("{e}");
            std::process::exit(2);
        }
    };
    let rt = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("kvroute-calibrate: cannot start the runtime: {e}");
            std::process::exit(1);
        }
    };
    match rt.block_on(calibrate::run(&cfg)) {
        Ok(c) if flags.has("json") => {
            let [min, p10, p50, p90, max] = calibrate::spread(&c.ttft_s);
            println!(
                "{}",
                serde_json::json!({
                    "model": c.model,
                    "tokens": c.tokens,
                    "peakPrefillThroughput": c.peak_prefill_throughput,
                    "ttftSeconds": c.ttft_s,
                    "ttftSpreadSeconds": {"min": min, "p10": p10, "p50": p50, "p90": p90, "max": max},
                    "maxTTFTPenaltyMs": cfg.ttft_tolerance_ms,
                })
            );
        }
        Ok(c) => print!("{}", calibrate::report(&c, cfg.ttft_tolerance_ms)),
        Err(e) => {
            eprintln!("kvroute-calibrate: {e}");
            std::process::exit(1);
        }
    }
}

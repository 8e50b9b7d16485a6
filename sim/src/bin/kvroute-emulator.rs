//! `kvroute-emulator`: N emulated vLLM endpoints on loopback ports.
//!
//! Prints `READY 127.0.0.1:P1,127.0.0.1:P2` on stdout once every port
//! listens (and, before it, `KV_EVENTS tcp://…,…` when events are on), then
//! serves until SIGTERM or SIGINT, on which it exits 0.

use kvroute_sim::emulator::tokenize::Tokenization;
use kvroute_sim::emulator::{EmulatorConfig, Fleet};
use kvroute_sim_model::cli::Flags;
use kvroute_sim_model::vllm_server::{check_engine, engine_from_flags};
use std::io::Write;

const USAGE: &str = "\
kvroute-emulator --ports 18001,18002 [options]

Emulated vLLM endpoints (OpenAI API, vLLM /metrics, KV events) on 127.0.0.1.

  --ports LIST                   comma-separated ports; 0 picks a free port (required)
  --model NAME                   served model name [tiny]
  --accept-any-model             serve any model name instead of answering 404
  --lora-modules LIST            LoRA adapter names served besides --model (listed in
                                 /v1/models, reported in vllm:lora_requests_info) [none]
  --max-loras N                  adapter slots, max_lora in vllm:lora_requests_info [1]
  --block-size N                 tokens per KV block [16]
  --num-gpu-blocks N             KV cache size in blocks [16384]
  --max-num-batched-tokens N     token budget per iteration, B [8192]
  --max-num-seqs N               sequences per batch [256]
  --max-model-len N              longest prompt + output, tokens [40960]
  --prefill-tps X                peak prefill tokens/s [20480]
  --prefill-attention-tokens X   attended context that doubles a prefill token's cost; 0 = off [32768]
  --decode-step-ms X             floor of one forward pass, ms [25]
  --decode-ms-per-seq X          extra per decoding sequence, ms [0.1]
  --decode-ns-per-context-token X  extra per attended context token, ns [40]
  --time-scale X                 model seconds per wall second [1.0]
  --tokenizer T                  text/chat prompts: tiny (the compiled-in BPE of
                                 testdata/tokenizer/tiny-bpe-4096), a tokenizer.json
                                 or its directory, or estimate (bytes / --chars-per-token) [tiny]
  --chars-per-token N            text bytes per token with --tokenizer estimate [4]
  --default-max-tokens N         output tokens when the client sets none [16]
  --stream-interval N            output tokens per streamed chunk [1]
  --kv-events-port-base P        publish KV events on ZMQ ports P, P+1, …; 0 = free ports [off]
  --kv-events-topic T            ZMQ topic, {endpoint} and {model} replaced [kv@{endpoint}@{model}]
  --python-hash-seed S           PYTHONHASHSEED for token-ID block hashes [0]
";

const FLAGS: &[(&str, bool)] = &[
    ("ports", true),
    ("model", true),
    ("accept-any-model", false),
    ("lora-modules", true),
    ("max-loras", true),
    ("block-size", true),
    ("num-gpu-blocks", true),
    ("max-num-batched-tokens", true),
    ("max-num-seqs", true),
    ("max-model-len", true),
    ("prefill-tps", true),
    ("prefill-attention-tokens", true),
    ("decode-step-ms", true),
    ("decode-ms-per-seq", true),
    ("decode-ns-per-context-token", true),
    ("time-scale", true),
    ("tokenizer", true),
    ("chars-per-token", true),
    ("default-max-tokens", true),
    ("stream-interval", true),
    ("kv-events-port-base", true),
    ("kv-events-topic", true),
    ("python-hash-seed", true),
];

fn config(f: &Flags) -> Result<(EmulatorConfig, Vec<u16>), String> {
    let ports = f
        .list::<u16>("ports")?
        .filter(|p| !p.is_empty())
        .ok_or("kvroute-emulator: --ports is required, e.g. --ports 18001,18002")?;
    let d = EmulatorConfig::default();
    let cfg = EmulatorConfig {
        engine: engine_from_flags(f)?,
        model: f.get("model", d.model)?,
        tokenizer: match f.str("tokenizer") {
            None => d.tokenizer,
            Some(t) => Tokenization::from_arg(t).map_err(|e| format!("kvroute-emulator: {e}"))?,
        },
        chars_per_token: f.get("chars-per-token", d.chars_per_token)?,
        time_scale: f.get("time-scale", d.time_scale)?,
        kv_events_port_base: match f.str("kv-events-port-base") {
            None => None,
            Some(_) => Some(f.get("kv-events-port-base", 0u16)?),
        },
        kv_events_topic: f.get("kv-events-topic", d.kv_events_topic)?,
        python_hash_seed: f.get("python-hash-seed", d.python_hash_seed)?,
        stream_interval: f.get("stream-interval", d.stream_interval)?,
        default_max_tokens: f.get("default-max-tokens", d.default_max_tokens)?,
        accept_any_model: f.has("accept-any-model"),
        lora_modules: f
            .list::<String>("lora-modules")?
            .unwrap_or_default()
            .into_iter()
            .filter(|m| !m.is_empty())
            .collect(),
        max_loras: f.get("max-loras", d.max_loras)?,
    };
    check_engine(&cfg.engine, "kvroute-emulator")?;
    if cfg.chars_per_token == 0 {
        return Err("kvroute-emulator: --chars-per-token must be at least 1".into());
    }
    if !(cfg.time_scale > 0.0 && cfg.time_scale.is_finite()) {
        return Err("kvroute-emulator: --time-scale must be a positive number".into());
    }
    Ok((cfg, ports))
}

fn main() {
    let flags = match Flags::parse("kvroute-emulator", std::env::args().skip(1), FLAGS) {
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
    let (cfg, ports) = match config(&flags) {
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
            eprintln!("kvroute-emulator: cannot start the runtime: {e}");
            std::process::exit(1);
        }
    };
    let code = rt.block_on(async move {
        // The handlers go in before READY: whoever reads READY may send
        // SIGTERM at once, and it must end in a clean exit 0.
        let signals = Signals::install();
        let fleet = match Fleet::start(&cfg, &ports).await {
            Ok(f) => f,
            Err(e) => {
                eprintln!("kvroute-emulator: {e}");
                return 1;
            }
        };
        let mut out = std::io::stdout().lock();
        let kv: Vec<String> = fleet
            .endpoints
            .iter()
            .filter_map(|e| e.kv_events_addr.map(|a| format!("tcp://{a}")))
            .collect();
        if !kv.is_empty() {
            let _ = writeln!(out, "KV_EVENTS {}", kv.join(","));
        }
        let addrs: Vec<String> = fleet.addrs().iter().map(|a| a.to_string()).collect();
        let _ = writeln!(out, "READY {}", addrs.join(","));
        let _ = out.flush();
        drop(out);
        signals.wait().await;
        fleet.shutdown();
        0
    });
    rt.shutdown_timeout(std::time::Duration::from_millis(200));
    std::process::exit(code);
}

/// SIGTERM and SIGINT, listened for from `install` on.
struct Signals(Option<(tokio::signal::unix::Signal, tokio::signal::unix::Signal)>);

impl Signals {
    fn install() -> Signals {
        use tokio::signal::unix::{signal, SignalKind};
        match (
            signal(SignalKind::terminate()),
            signal(SignalKind::interrupt()),
        ) {
            (Ok(term), Ok(int)) => Signals(Some((term, int))),
            _ => Signals(None),
        }
    }

    async fn wait(self) {
        match self.0 {
            Some((mut term, mut int)) => {
                tokio::select! {
                    _ = term.recv() => {}
                    _ = int.recv() => {}
                }
            }
            None => {
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
}

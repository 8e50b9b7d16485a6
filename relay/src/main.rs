//! `kvroute-relay`: the binary. Flags, then the ZMQ task and the HTTP server.

use kvroute_relay::http::ServeLimits;
use kvroute_relay::mesh::{MeshLimits, MeshState};
use kvroute_relay::state::{HealthPolicy, Limits, Relay};
use kvroute_relay::subscriber::SubConfig;
use kvroute_relay::{http, new_epoch, new_mesh_epoch, subscriber, Shared, SharedMesh};
use std::process::ExitCode;
use std::sync::{Arc, Mutex};
use std::time::Duration;

const USAGE: &str = "\
kvroute-relay: re-serves one vLLM server's ZMQ KV events over HTTP, and carries the mesh
exchange between the proxies in front of the fleet (POST /mesh/exchange).

USAGE: kvroute-relay --sub ipc:///run/kvroute/kv-events.sock --listen $POD_IP:9157 [options]

  --sub ENDPOINT           vLLM's KV-event publisher (ipc://PATH or tcp://ADDR:PORT; the relay connects)
  --topic PREFIX           topic filter, e.g. kv@NAME (default: empty, all topics)
  --replay ENDPOINT        vLLM's replay socket (replay_endpoint in --kv-events-config), to fill gaps
  --replay-timeout-ms N    deadline for one replay (default 1000)
  --listen ADDR:PORT       HTTP listen address (default 127.0.0.1:9157); the collector calls the
                           endpoint's own IP, so in a pod use the pod IP, never a wildcard
  --max-blocks N           snapshot bound: the server's num_gpu_blocks (default 65536)
  --ring-batches N         batches kept for /kv/events (default 4096)
  --ring-hashes N          hashes kept across the ring (default 262144)
  --header-timeout-ms N    a request head must be complete N ms after the connection is ready for
                           one; also the keep-alive idle limit (default 10000)
  --idle-timeout-ms N      close a connection whose read or write makes no progress for N ms (default 30000)
  --max-connections N      open HTTP connections at most; more wait to be accepted (default 512)
  --max-in-flight N        answers held at once at most; more get 503 (default 64)
  --health-grace-ms N      /healthz stays 200 for N ms after the publisher disconnects (default 5000)
  --health-max-silence-ms N  /healthz is 503 after N ms without a message even while connected
                           (default 0: off; vLLM publishes only when blocks change)
  --mesh-ring-decisions N  decisions kept for POST /mesh/exchange (default 16384)
  --mesh-ring-hashes N     hashes kept across those decisions (default 1048576)
  --mesh-max-proxies N     proxies' load entries kept at most (default 4096)
  --mesh-max-body-bytes N  largest /mesh/exchange request body; larger: 413 (default 1048576)
  -h, --help               this text
";

/// The longest timeout a flag may set: a day, in ms.
const MAX_TIMEOUT_MS: u64 = 86_400_000;

struct Args {
    sub: SubConfig,
    listen: String,
    limits: Limits,
    serve: ServeLimits,
    health: HealthPolicy,
    mesh: MeshLimits,
}

fn parse(mut it: impl Iterator<Item = String>) -> Result<Option<Args>, String> {
    let mut sub = None;
    let mut topic = String::new();
    let mut replay = None;
    let mut replay_ms = 1000u64;
    let mut listen = "127.0.0.1:9157".to_string();
    let mut limits = Limits::default();
    let mut serve = ServeLimits::default();
    let mut health = HealthPolicy::default();
    let mut mesh = MeshLimits::default();
    while let Some(flag) = it.next() {
        if flag == "-h" || flag == "--help" {
            return Ok(None);
        }
        let (name, inline) = match flag.split_once('=') {
            Some((n, v)) => (n.to_string(), Some(v.to_string())),
            None => (flag.clone(), None),
        };
        let mut value = || {
            inline
                .clone()
                .or_else(|| it.next())
                .ok_or_else(|| format!("{name} needs a value (see --help)"))
        };
        let count = |v: String| {
            v.parse::<usize>()
                .ok()
                .filter(|&n| n > 0)
                .ok_or_else(|| format!("{name} {v:?}: expected a positive integer"))
        };
        // At most a day: hyper adds the header timeout to `Instant::now()`,
        // which must not overflow.
        let ms = |v: String| {
            v.parse::<u64>()
                .ok()
                .filter(|n| (1..=MAX_TIMEOUT_MS).contains(n))
                .map(Duration::from_millis)
                .ok_or_else(|| format!("{name} {v:?}: expected 1 to {MAX_TIMEOUT_MS} (ms)"))
        };
        match name.as_str() {
            "--sub" => sub = Some(value()?),
            "--topic" => topic = value()?,
            "--replay" => replay = Some(value()?),
            "--replay-timeout-ms" => replay_ms = count(value()?)? as u64,
            "--listen" => listen = value()?,
            "--max-blocks" => limits.max_blocks = count(value()?)?,
            "--ring-batches" => limits.ring_batches = count(value()?)?,
            "--ring-hashes" => limits.ring_hashes = count(value()?)?,
            "--header-timeout-ms" => serve.header_timeout = ms(value()?)?,
            "--idle-timeout-ms" => serve.idle_timeout = ms(value()?)?,
            "--max-connections" => serve.max_connections = count(value()?)?,
            "--max-in-flight" => serve.max_in_flight = count(value()?)?,
            "--health-grace-ms" => {
                let v = value()?;
                let n = v
                    .parse::<u64>()
                    .ok()
                    .filter(|&n| n <= MAX_TIMEOUT_MS)
                    .ok_or_else(|| format!("{name} {v:?}: expected 0 to {MAX_TIMEOUT_MS} (ms)"))?;
                health.grace = Duration::from_millis(n);
            }
            "--health-max-silence-ms" => {
                let v = value()?;
                let n = v
                    .parse::<u64>()
                    .ok()
                    .filter(|&n| n <= MAX_TIMEOUT_MS)
                    .ok_or_else(|| {
                        format!("{name} {v:?}: expected 0 (off) to {MAX_TIMEOUT_MS} (ms)")
                    })?;
                health.max_silence = (n > 0).then(|| Duration::from_millis(n));
            }
            "--mesh-ring-decisions" => mesh.ring_decisions = count(value()?)?,
            "--mesh-ring-hashes" => mesh.ring_hashes = count(value()?)?,
            "--mesh-max-proxies" => mesh.max_proxies = count(value()?)?,
            "--mesh-max-body-bytes" => mesh.max_body_bytes = count(value()?)?,
            other => return Err(format!("unknown flag {other:?} (see --help)")),
        }
    }
    let endpoint = sub.ok_or("--sub ENDPOINT is required, e.g. --sub tcp://127.0.0.1:5557")?;
    Ok(Some(Args {
        sub: SubConfig {
            endpoint,
            topic,
            replay,
            replay_timeout: Duration::from_millis(replay_ms),
        },
        listen,
        limits,
        serve,
        health,
        mesh,
    }))
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> ExitCode {
    let args = match parse(std::env::args().skip(1)) {
        Ok(Some(a)) => a,
        Ok(None) => {
            print!("{USAGE}");
            return ExitCode::SUCCESS;
        }
        Err(e) => {
            eprintln!("kvroute-relay: {e}");
            return ExitCode::from(2);
        }
    };
    let listener = match tokio::net::TcpListener::bind(&args.listen).await {
        Ok(l) => l,
        Err(e) => {
            eprintln!(
                "kvroute-relay: cannot listen on {}: {e} (choose another --listen)",
                args.listen
            );
            return ExitCode::from(1);
        }
    };
    if let Ok(a) = listener.local_addr() {
        eprintln!("kvroute-relay: serving http://{a}");
    }
    let mut relay = Relay::new(args.limits, new_epoch());
    relay.set_health_policy(args.health);
    let state: Shared = Arc::new(Mutex::new(relay));
    let mesh: SharedMesh = Arc::new(Mutex::new(MeshState::new(args.mesh, new_mesh_epoch())));
    let zmq = tokio::spawn(subscriber::run(args.sub, state.clone()));
    let web = tokio::spawn(http::serve_with_mesh(
        listener,
        state,
        mesh,
        args.serve,
        Arc::new(http::HttpStats::default()),
    ));
    let _ = tokio::signal::ctrl_c().await;
    zmq.abort();
    web.abort();
    ExitCode::SUCCESS
}

//! Serves emulated vLLM endpoints on loopback ports: the HTTP/ZMQ glue
//! around [`crate::vllm_model::Engine`]. One [`Fleet`] hosts N endpoints, each
//! with its own engine, port and (optionally) KV-event publisher.

pub mod endpoint;
pub mod http;
pub mod kv_publisher;
pub mod metrics_text;
pub mod openai;
pub mod tokenize;

use crate::vllm_model::EngineConfig;
use endpoint::Endpoint;
use std::net::SocketAddr;
use std::sync::Arc;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;

/// Everything one emulated endpoint needs besides its port.
#[derive(Clone, Debug)]
pub struct EmulatorConfig {
    pub engine: EngineConfig,
    /// Served model name (`--model`); requests for another model get 404.
    pub model: String,
    /// How text and chat prompts become tokens (`--tokenizer`).
    pub tokenizer: tokenize::Tokenization,
    /// Bytes of text per token with `--tokenizer estimate`
    /// (`--chars-per-token`), as the filter's estimate.
    pub chars_per_token: u32,
    /// Model seconds per wall-clock second (`--time-scale`); 10 runs ten
    /// times faster than the modelled hardware.
    pub time_scale: f64,
    /// First ZMQ port for KV events (`--kv-events-port-base`); endpoint i
    /// publishes on base + i. `Some(0)` picks free ports. `None`: off.
    pub kv_events_port_base: Option<u16>,
    /// ZMQ topic; `{endpoint}` and `{model}` are replaced.
    pub kv_events_topic: String,
    /// `PYTHONHASHSEED` of the emulated server, seeds token-ID block hashes.
    pub python_hash_seed: String,
    /// Output tokens per streamed chunk (vLLM `--stream-interval`).
    pub stream_interval: u32,
    /// Output tokens when the client gives no `max_tokens`.
    pub default_max_tokens: u32,
    /// Serve any `model` instead of answering 404.
    pub accept_any_model: bool,
}

impl Default for EmulatorConfig {
    fn default() -> Self {
        EmulatorConfig {
            engine: EngineConfig::default(),
            model: "tiny".into(),
            tokenizer: tokenize::Tokenization::tiny(),
            chars_per_token: 4,
            time_scale: 1.0,
            kv_events_port_base: None,
            kv_events_topic: "kv@{endpoint}@{model}".into(),
            python_hash_seed: "0".into(),
            stream_interval: 1,
            default_max_tokens: 16,
            accept_any_model: false,
        }
    }
}

/// One endpoint that is up.
pub struct RunningEndpoint {
    pub addr: SocketAddr,
    /// Where its KV events are published, when enabled.
    pub kv_events_addr: Option<SocketAddr>,
    pub endpoint: Arc<Endpoint>,
    tasks: Vec<JoinHandle<()>>,
}

/// N endpoints served by this process.
pub struct Fleet {
    pub endpoints: Vec<RunningEndpoint>,
}

impl Fleet {
    /// Binds 127.0.0.1 on each port (0 picks a free one) and starts serving.
    pub async fn start(cfg: &EmulatorConfig, ports: &[u16]) -> std::io::Result<Fleet> {
        let mut endpoints = Vec::with_capacity(ports.len());
        for (i, &port) in ports.iter().enumerate() {
            let listener = TcpListener::bind(("127.0.0.1", port)).await.map_err(|e| {
                std::io::Error::new(
                    e.kind(),
                    format!(
                        "cannot listen on 127.0.0.1:{port}: {e} (is another emulator running?)"
                    ),
                )
            })?;
            let addr = listener.local_addr()?;
            let mut tasks = Vec::new();
            let (kv_tx, kv_events_addr) = match cfg.kv_events_port_base {
                None => (None, None),
                Some(base) => {
                    let kv_port = if base == 0 {
                        0
                    } else {
                        base.checked_add(i as u16).ok_or_else(|| {
                            std::io::Error::other(
                                "--kv-events-port-base + endpoint index overflows",
                            )
                        })?
                    };
                    let topic = cfg
                        .kv_events_topic
                        .replace("{endpoint}", &addr.to_string())
                        .replace("{model}", &cfg.model);
                    let (tx, kv_addr, task) = kv_publisher::spawn(kv_port, topic).await?;
                    tasks.push(task);
                    (Some(tx), Some(kv_addr))
                }
            };
            let endpoint = Endpoint::new(cfg.clone(), addr, kv_tx);
            tasks.push(tokio::spawn(endpoint::run_engine(endpoint.clone())));
            tasks.push(tokio::spawn(http::serve(listener, endpoint.clone())));
            endpoints.push(RunningEndpoint {
                addr,
                kv_events_addr,
                endpoint,
                tasks,
            });
        }
        Ok(Fleet { endpoints })
    }

    pub fn addrs(&self) -> Vec<SocketAddr> {
        self.endpoints.iter().map(|e| e.addr).collect()
    }

    /// Stops every task of every endpoint.
    pub fn shutdown(&self) {
        for e in &self.endpoints {
            for t in &e.tasks {
                t.abort();
            }
        }
    }
}

impl Drop for Fleet {
    fn drop(&mut self) {
        self.shutdown();
    }
}

//! Serves emulated vLLM endpoints on loopback ports: the HTTP/ZMQ glue
//! around [`kvroute_sim_model::vllm_model::Engine`]. One [`Fleet`] hosts N endpoints, each
//! with its own engine, port and (optionally) KV-event publisher.

pub mod endpoint;
pub mod http;
pub mod kv_publisher;

/// The server's surface without I/O (settings, request → engine input,
/// tokenizer, `/metrics` page) lives in the pure crate, which the simulator
/// shares; re-exported here under the emulator's names.
pub use kvroute_sim_model::vllm_server::{metrics_text, openai, tokenize, EmulatorConfig};

use endpoint::Endpoint;
use std::net::SocketAddr;
use std::sync::Arc;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;

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

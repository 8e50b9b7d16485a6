//! Publishes an endpoint's KV events over ZMQ PUB, framed as vLLM does:
//! `[topic, seq (8 bytes big-endian, from 0), msgpack KVEventBatch]`.
//! One message per engine iteration that produced events. As with any PUB
//! socket, messages sent before a subscriber has connected are dropped.

use crate::kv_events::{frames, KvEvent, KvEventBatch};
use bytes::Bytes;
use std::net::SocketAddr;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use zeromq::{Socket, SocketSend, ZmqMessage};

/// Binds `tcp://127.0.0.1:port` (0: a free port) and returns the sender the
/// engine loop feeds, the bound address and the publishing task.
pub async fn spawn(
    port: u16,
    topic: String,
) -> std::io::Result<(
    mpsc::UnboundedSender<Vec<KvEvent>>,
    SocketAddr,
    JoinHandle<()>,
)> {
    let mut socket = zeromq::PubSocket::new();
    let bound = socket
        .bind(&format!("tcp://127.0.0.1:{port}"))
        .await
        .map_err(|e| {
            std::io::Error::other(format!(
                "cannot bind KV events on tcp://127.0.0.1:{port}: {e} (choose another --kv-events-port-base)"
            ))
        })?;
    let addr = match bound {
        zeromq::Endpoint::Tcp(host, p) => format!("{host}:{p}")
            .parse()
            .map_err(|e| std::io::Error::other(format!("bound address {host}:{p}: {e}")))?,
        other => {
            return Err(std::io::Error::other(format!(
                "unexpected endpoint {other}"
            )))
        }
    };
    let (tx, mut rx) = mpsc::unbounded_channel::<Vec<KvEvent>>();
    let task = tokio::spawn(async move {
        let mut seq = 0u64;
        while let Some(events) = rx.recv().await {
            let batch = KvEventBatch {
                ts: super::endpoint::unix_now_s(),
                events,
                data_parallel_rank: Some(0),
            };
            let [t, s, p] = frames(&topic, seq, &batch);
            let mut msg = ZmqMessage::from(Bytes::from(t));
            msg.push_back(Bytes::from(s));
            msg.push_back(Bytes::from(p));
            // A send error means no peer could take it; PUB drops silently.
            let _ = socket.send(msg).await;
            seq += 1;
        }
    });
    Ok((tx, addr, task))
}

//! The ZMQ side: a SUB socket connected to vLLM's publisher, and a DEALER
//! for vLLM's replay socket (ROUTER) to fill gaps.
//!
//! Replay protocol (vLLM `ZmqEventPublisher._service_replay`): the client
//! sends `[b"", start_seq (8 bytes big-endian)]`; the publisher answers, for
//! every buffered batch with `seq >= start_seq`, `[b"", seq, payload]` (newer
//! vLLM: `[b"", topic, seq, payload]`), then `[b"", END_SEQ, b""]` (newer:
//! `[b"", b"", END_SEQ, b""]`) with `END_SEQ` = -1 as 8 signed bytes.

use crate::state::{Relay, SeqCheck};
use crate::Shared;
use bytes::Bytes;
use futures_util::StreamExt;
use kvroute_kv_events::decode_seq;
use std::time::{Duration, Instant};
use zeromq::{Socket, SocketEvent, SocketRecv, SocketSend, ZmqMessage};

/// `END_SEQ`: the replay's last message.
const END_SEQ: [u8; 8] = [0xFF; 8];

/// Where to subscribe.
#[derive(Clone, Debug)]
pub struct SubConfig {
    /// vLLM's publisher, e.g. `tcp://127.0.0.1:5557`.
    pub endpoint: String,
    /// Topic prefix; empty: all.
    pub topic: String,
    /// vLLM's replay socket, e.g. `tcp://127.0.0.1:5558`.
    pub replay: Option<String>,
    /// Whole-replay deadline.
    pub replay_timeout: Duration,
}

fn lock(state: &Shared) -> std::sync::MutexGuard<'_, Relay> {
    state.lock().unwrap_or_else(|p| p.into_inner())
}

/// Subscribes forever: connects (retrying), then feeds every message to the
/// state. The `zeromq` SUB socket reconnects by itself once connected; its
/// monitor's `Connected`/`Disconnected` events keep the state's link flag
/// (`/healthz`, `kvroute_relay_publisher_connected`) current.
pub async fn run(cfg: SubConfig, state: Shared) {
    let mut backoff = Duration::from_millis(100);
    loop {
        let mut sub = zeromq::SubSocket::new();
        // Before connecting, so that no event is missed.
        let mut monitor = sub.monitor();
        let connected =
            tokio::time::timeout(Duration::from_secs(5), sub.connect(&cfg.endpoint)).await;
        match connected {
            Ok(Ok(())) => {}
            Ok(Err(e)) => {
                eprintln!(
                    "kvroute-relay: cannot connect to {}: {e}; retrying",
                    cfg.endpoint
                );
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(5));
                continue;
            }
            Err(_) => {
                eprintln!(
                    "kvroute-relay: connecting to {} timed out; retrying",
                    cfg.endpoint
                );
                continue;
            }
        }
        if let Err(e) = sub.subscribe(&cfg.topic).await {
            eprintln!("kvroute-relay: subscribe {:?}: {e}; retrying", cfg.topic);
            tokio::time::sleep(backoff).await;
            continue;
        }
        backoff = Duration::from_millis(100);
        eprintln!(
            "kvroute-relay: subscribed to {} topic {:?}",
            cfg.endpoint, cfg.topic
        );
        lock(&state).note_link(true, Instant::now());
        loop {
            tokio::select! {
                msg = sub.recv() => match msg {
                    Ok(msg) => handle(&cfg, &state, msg.into_vec()).await,
                    Err(e) => {
                        eprintln!(
                            "kvroute-relay: receive from {}: {e}; reconnecting",
                            cfg.endpoint
                        );
                        break;
                    }
                },
                Some(event) = monitor.next() => match event {
                    SocketEvent::Connected(..) => lock(&state).note_link(true, Instant::now()),
                    SocketEvent::Disconnected(..) => {
                        eprintln!("kvroute-relay: publisher {} disconnected", cfg.endpoint);
                        lock(&state).note_link(false, Instant::now());
                    }
                    _ => {}
                },
            }
        }
        lock(&state).note_link(false, Instant::now());
    }
}

/// One published message: fills a gap from the replay socket first when one
/// is configured, then ingests the message.
pub async fn handle(cfg: &SubConfig, state: &Shared, frames: Vec<Bytes>) {
    let gap = match frames.as_slice() {
        [_, seq, _] => match decode_seq(seq) {
            Ok(up) => match lock(state).check(up) {
                SeqCheck::Gap { from, to } => Some((from, to)),
                _ => None,
            },
            Err(_) => None,
        },
        _ => None,
    };
    if let (Some((from, to)), Some(replay)) = (gap, &cfg.replay) {
        fill_gap(replay, cfg.replay_timeout, state, from, to).await;
    }
    let refs: Vec<&[u8]> = frames.iter().map(|b| b.as_ref()).collect();
    let mut st = lock(state);
    st.note_message(Instant::now());
    if let Err(why) = st.ingest(&refs) {
        eprintln!("kvroute-relay: skipped a message: bad {}", why.reason());
    }
}

async fn fill_gap(endpoint: &str, deadline: Duration, state: &Shared, from: u64, to: u64) {
    let replayed = match tokio::time::timeout(deadline, replay_from(endpoint, from, to)).await {
        Ok(Ok(r)) => r,
        Ok(Err(e)) => {
            eprintln!("kvroute-relay: replay from {from} at {endpoint}: {e}");
            Vec::new()
        }
        Err(_) => {
            eprintln!("kvroute-relay: replay from {from} at {endpoint} timed out");
            Vec::new()
        }
    };
    let mut st = lock(state);
    st.counts.replayed_batches += replayed.len() as u64;
    let mut next = from;
    for (up, payload) in &replayed {
        if *up != next || *up >= to {
            break;
        }
        // A bad replayed payload is counted and makes a resync point there.
        let _ = st.ingest_payload(*up, payload);
        next += 1;
    }
    if next == to {
        st.note_gap_filled(from, to);
    } else {
        st.counts.replay_failures += 1;
    }
}

/// Asks for batches from `from` and collects those before `to`, up to the
/// end marker.
async fn replay_from(endpoint: &str, from: u64, to: u64) -> Result<Vec<(u64, Bytes)>, String> {
    let mut dealer = zeromq::DealerSocket::new();
    dealer.connect(endpoint).await.map_err(|e| e.to_string())?;
    let mut req = ZmqMessage::from(Bytes::new());
    req.push_back(Bytes::copy_from_slice(&from.to_be_bytes()));
    dealer.send(req).await.map_err(|e| e.to_string())?;
    let mut out = Vec::new();
    loop {
        let msg = dealer.recv().await.map_err(|e| e.to_string())?.into_vec();
        // Drop the empty delimiter, then [seq, payload] or [topic, seq, payload].
        let rest = match msg.split_first() {
            Some((d, rest)) if d.is_empty() => rest,
            _ => msg.as_slice(),
        };
        let (seq, payload) = match rest {
            [seq, payload] | [_, seq, payload] => (seq, payload),
            _ => return Err(format!("replay reply has {} frames", msg.len())),
        };
        if seq.as_ref() == END_SEQ {
            break;
        }
        let up = decode_seq(seq).map_err(|e| e.to_string())?;
        if up >= from && up < to {
            out.push((up, payload.clone()));
        }
    }
    Ok(out)
}

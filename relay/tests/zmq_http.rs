//! The relay's tasks against real sockets on loopback: a `zeromq` PUB that
//! publishes the real vLLM capture with a hole in it, a ROUTER that answers
//! vLLM's replay protocol, and the relay's HTTP server read over TCP.

mod common;

use bytes::Bytes;
use common::captured_frames;
use kvroute_kv_events::{KvEvent, KvEventBatch};
use kvroute_relay::state::{Limits, Relay};
use kvroute_relay::subscriber::SubConfig;
use kvroute_relay::{http, subscriber, Shared};
use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use zeromq::{Socket, SocketRecv, SocketSend, ZmqMessage};

fn bound_port(ep: zeromq::Endpoint) -> u16 {
    match ep {
        zeromq::Endpoint::Tcp(_, p) => p,
        other => panic!("{other}"),
    }
}

fn message(frames: &[&[u8]]) -> ZmqMessage {
    let mut m = ZmqMessage::from(Bytes::copy_from_slice(frames[0]));
    for f in &frames[1..] {
        m.push_back(Bytes::copy_from_slice(f));
    }
    m
}

async fn get(addr: std::net::SocketAddr, path: &str) -> (u16, String) {
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    s.write_all(
        format!("GET {path} HTTP/1.1\r\nHost: relay\r\nConnection: close\r\n\r\n").as_bytes(),
    )
    .await
    .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).await.unwrap();
    let (head, body) = out.split_once("\r\n\r\n").unwrap();
    let status = head.split(' ').nth(1).unwrap().parse().unwrap();
    (status, body.to_string())
}

async fn get_json(addr: std::net::SocketAddr, path: &str) -> serde_json::Value {
    let (status, body) = get(addr, path).await;
    assert_eq!(status, 200, "{path}: {body}");
    serde_json::from_str(&body).unwrap()
}

fn metric(text: &str, name: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or(0.0)
}

async fn wait_metric(addr: std::net::SocketAddr, name: &str, at_least: f64) {
    for _ in 0..200 {
        let (_, m) = get(addr, "/metrics").await;
        if metric(&m, name) >= at_least {
            return;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    panic!("{name} never reached {at_least}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relays_a_real_capture_fills_a_gap_by_replay_and_resyncs_after_a_restart() {
    let frames = captured_frames();
    // vLLM's side: PUB, and the replay ROUTER holding every batch.
    let mut publisher = zeromq::PubSocket::new();
    let pub_port = bound_port(publisher.bind("tcp://127.0.0.1:0").await.unwrap());
    let mut router = zeromq::RouterSocket::new();
    let replay_port = bound_port(router.bind("tcp://127.0.0.1:0").await.unwrap());
    let buffered = frames.clone();
    let replays = Arc::new(Mutex::new(Vec::<u64>::new()));
    let asked = replays.clone();
    let replay_task = tokio::spawn(async move {
        while let Ok(req) = router.recv().await {
            let req = req.into_vec();
            let [id, _, start] = req.as_slice() else {
                continue;
            };
            let start = u64::from_be_bytes(start.as_ref().try_into().unwrap());
            asked.lock().unwrap().push(start);
            for f in &buffered {
                if u64::from_be_bytes(f[1].as_slice().try_into().unwrap()) >= start {
                    router
                        .send(message(&[id, b"", &f[1], &f[2]]))
                        .await
                        .unwrap();
                }
            }
            router
                .send(message(&[id, b"", &[0xFF; 8], b""]))
                .await
                .unwrap();
        }
    });

    // The relay, on ephemeral loopback ports.
    let state: Shared = Arc::new(Mutex::new(Relay::new(Limits::default(), 42)));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let http_addr = listener.local_addr().unwrap();
    let web = tokio::spawn(http::serve(
        listener,
        state.clone(),
        http::ServeLimits::default(),
    ));
    let zmq = tokio::spawn(subscriber::run(
        SubConfig {
            endpoint: format!("tcp://127.0.0.1:{pub_port}"),
            topic: "kv@".into(),
            replay: Some(format!("tcp://127.0.0.1:{replay_port}")),
            replay_timeout: Duration::from_secs(2),
        },
        state.clone(),
    ));

    // Until the subscription is live, PUB drops messages. Probe with a bad
    // (one-frame) message until the relay counts one.
    let mut live = false;
    for _ in 0..200 {
        publisher.send(message(&[b"kv@probe"])).await.unwrap();
        let (_, m) = get(http_addr, "/metrics").await;
        if metric(&m, "kvroute_relay_bad_frames_total{reason=\"frame_count\"}") >= 1.0 {
            live = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    assert!(live, "subscription never became live");

    // Publish the capture with batches 3..6 missing: the relay asks the
    // replay socket for them.
    for (i, f) in frames.iter().enumerate() {
        if (3..6).contains(&i) {
            continue;
        }
        publisher
            .send(message(&[&f[0], &f[1], &f[2]]))
            .await
            .unwrap();
    }
    wait_metric(http_addr, "kvroute_relay_seq", 10.0).await;
    assert_eq!(*replays.lock().unwrap(), vec![3]);

    let mut want = HashSet::new();
    for f in &frames {
        for e in KvEventBatch::decode(&f[2]).unwrap().events {
            match e {
                KvEvent::BlockStored { block_hashes, .. } => want.extend(block_hashes),
                KvEvent::BlockRemoved { block_hashes, .. } => {
                    block_hashes.iter().for_each(|h| {
                        want.remove(h);
                    });
                }
                KvEvent::AllBlocksCleared => want.clear(),
            }
        }
    }
    let snap = get_json(http_addr, "/kv/snapshot").await;
    assert_eq!(snap["seq"], 10);
    assert_eq!(snap["complete"], true, "the gap was filled");
    let blocks: HashSet<u64> = snap["blocks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|h| h.as_u64().unwrap())
        .collect();
    assert_eq!(blocks, want);

    let page = get_json(http_addr, "/kv/events?after=0&epoch=42").await;
    assert_eq!(page["resync"], false);
    assert_eq!(page["seq"], 10);
    assert_eq!(page["batches"].as_array().unwrap().len(), 10);
    let small = get_json(http_addr, "/kv/events?after=0&limit=1").await;
    assert_eq!(small["more"], true);
    assert_eq!(small["batches"].as_array().unwrap().len(), 1);

    let (_, m) = get(http_addr, "/metrics").await;
    assert_eq!(metric(&m, "kvroute_relay_gaps_total"), 1.0, "{m}");
    assert_eq!(metric(&m, "kvroute_relay_gaps_filled_total"), 1.0);
    assert_eq!(metric(&m, "kvroute_relay_gap_batches_total"), 3.0);
    assert_eq!(metric(&m, "kvroute_relay_replayed_batches_total"), 3.0);
    assert_eq!(
        metric(&m, "kvroute_relay_events_total{type=\"stored\"}"),
        10.0
    );

    // Garbage on the wire is counted and skipped.
    publisher
        .send(message(&[
            b"kv@test2",
            &10u64.to_be_bytes(),
            b"\xc1garbage",
        ]))
        .await
        .unwrap();
    wait_metric(
        http_addr,
        "kvroute_relay_bad_frames_total{reason=\"payload\"}",
        1.0,
    )
    .await;
    assert_eq!(
        get_json(http_addr, "/kv/events?after=10").await["resync"],
        true
    );

    // The publisher restarts: seq 0 again. The collector is told to resync,
    // and the snapshot holds only the new server's blocks.
    publisher
        .send(message(&[&frames[0][0], &frames[0][1], &frames[0][2]]))
        .await
        .unwrap();
    wait_metric(http_addr, "kvroute_relay_publisher_restarts_total", 1.0).await;
    assert_eq!(
        get_json(http_addr, "/kv/events?after=11").await["resync"],
        true
    );
    let snap = get_json(http_addr, "/kv/snapshot").await;
    assert_eq!(snap["seq"], 12);
    assert_eq!(snap["complete"], true);
    let KvEvent::BlockStored { block_hashes, .. } =
        &KvEventBatch::decode(&frames[0][2]).unwrap().events[0]
    else {
        panic!("frame 0 stores blocks")
    };
    assert_eq!(snap["blocks"].as_array().unwrap().len(), block_hashes.len());
    let page = get_json(http_addr, "/kv/events?after=12").await;
    assert_eq!(
        (page["resync"].clone(), page["seq"].clone()),
        (false.into(), 12.into())
    );

    // The other endpoints.
    let (status, health) = get(http_addr, "/healthz").await;
    assert_eq!(status, 200, "{health}");
    assert!(
        health.starts_with("ok: connected, last message"),
        "{health}"
    );
    assert_eq!(get(http_addr, "/nope").await.0, 404);
    assert_eq!(get(http_addr, "/kv/events?after=x").await.0, 400);
    assert_eq!(get(http_addr, "/kv/events?since=1").await.0, 400);

    zmq.abort();
    web.abort();
    replay_task.abort();
}

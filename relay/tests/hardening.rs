//! The relay as a network service, on loopback: slow and silent clients and
//! more connections than the bound, while a real ZMQ PUB keeps publishing
//! and a well-behaved keep-alive client keeps polling; `/healthz`
//! following the subscription; and hostile `POST /mesh/exchange` bodies
//! (slow, oversized, garbage). Every client here has its own deadline and
//! the whole test has one, so nothing waits forever.

use bytes::Bytes;
use kvroute_kv_events::{KvEvent, KvEventBatch};
use kvroute_relay::http::{self, HttpStats, ServeLimits};
use kvroute_relay::mesh::{MeshLimits, MeshState};
use kvroute_relay::state::{HealthPolicy, Limits, Relay};
use kvroute_relay::subscriber::{self, SubConfig};
use kvroute_relay::{Shared, SharedMesh};
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;
use tokio::time::{sleep, timeout};
use zeromq::{Socket, SocketSend, ZmqMessage};

const TOPIC: &str = "kv@hard";

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

/// vLLM's upstream message number `seq`, storing one block `hash`.
fn batch(seq: u64, hash: u64) -> ZmqMessage {
    let payload = KvEventBatch {
        ts: 1.7e9,
        events: vec![KvEvent::BlockStored {
            block_hashes: vec![hash],
            parent_block_hash: None,
            token_ids: vec![7; 16],
            block_size: 16,
            lora_id: None,
            medium: Some("GPU".into()),
            lora_name: None,
            extra_keys: None,
            group_idx: Some(0),
            kv_cache_spec_kind: None,
        }],
        data_parallel_rank: Some(0),
    }
    .encode();
    message(&[TOPIC.as_bytes(), &seq.to_be_bytes(), &payload])
}

/// One HTTP/1.1 keep-alive connection, as a collector's pool holds it.
struct KeepAlive {
    stream: BufReader<TcpStream>,
}

impl KeepAlive {
    async fn connect(addr: SocketAddr) -> KeepAlive {
        KeepAlive {
            stream: BufReader::new(TcpStream::connect(addr).await.unwrap()),
        }
    }

    /// (status, body); panics if the connection fails.
    async fn get(&mut self, path: &str) -> (u16, String) {
        let req = format!("GET {path} HTTP/1.1\r\nHost: relay\r\n\r\n");
        self.stream
            .get_mut()
            .write_all(req.as_bytes())
            .await
            .unwrap();
        let mut line = String::new();
        self.stream.read_line(&mut line).await.unwrap();
        let status: u16 = line
            .split(' ')
            .nth(1)
            .unwrap_or_else(|| panic!("no status line: {line:?}"))
            .parse()
            .unwrap();
        let mut len = 0usize;
        loop {
            line.clear();
            self.stream.read_line(&mut line).await.unwrap();
            if line == "\r\n" || line.is_empty() {
                break;
            }
            if let Some((k, v)) = line.split_once(':') {
                if k.eq_ignore_ascii_case("content-length") {
                    len = v.trim().parse().unwrap();
                }
            }
        }
        let mut body = vec![0u8; len];
        self.stream.read_exact(&mut body).await.unwrap();
        (status, String::from_utf8(body).unwrap())
    }
}

async fn get_once(addr: SocketAddr, path: &str) -> (u16, String) {
    KeepAlive::connect(addr).await.get(path).await
}

/// Starts the relay's two tasks on ephemeral loopback ports.
async fn start_relay(
    pub_endpoint: String,
    serve: ServeLimits,
    health: HealthPolicy,
) -> (
    SocketAddr,
    Arc<HttpStats>,
    Shared,
    Vec<tokio::task::JoinHandle<()>>,
) {
    let mut relay = Relay::new(Limits::default(), 1);
    relay.set_health_policy(health);
    let state: Shared = Arc::new(Mutex::new(relay));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let stats = Arc::new(HttpStats::default());
    let web = tokio::spawn(http::serve_with_stats(
        listener,
        state.clone(),
        serve,
        stats.clone(),
    ));
    let zmq = tokio::spawn(subscriber::run(
        SubConfig {
            endpoint: pub_endpoint,
            topic: TOPIC.into(),
            replay: None,
            replay_timeout: Duration::from_secs(1),
        },
        state.clone(),
    ));
    (addr, stats, state, vec![web, zmq])
}

/// Until the subscription is live a PUB drops what it sends: send bad
/// one-frame probes until the relay counts one (at most 5 s).
async fn wait_live(publisher: &mut zeromq::PubSocket, state: &Shared) {
    for _ in 0..200 {
        publisher.send(message(&[TOPIC.as_bytes()])).await.unwrap();
        sleep(Duration::from_millis(25)).await;
        if state.lock().unwrap().counts.bad_frames_frame_count > 0 {
            return;
        }
    }
    panic!("the subscription never became live");
}

/// A client that writes `head` one byte every `every`, until the relay
/// closes the connection or `deadline` passes. Returns how long the relay
/// kept it open (None: still open at the deadline).
async fn slowloris(
    addr: SocketAddr,
    head: &'static [u8],
    every: Duration,
    deadline: Duration,
) -> Option<Duration> {
    let start = Instant::now();
    let mut s = TcpStream::connect(addr).await.ok()?;
    let mut buf = [0u8; 256];
    let mut next = 0usize;
    let run = async {
        loop {
            tokio::select! {
                r = s.read(&mut buf) => match r {
                    Ok(0) | Err(_) => return start.elapsed(),
                    Ok(_) => {}
                },
                _ = sleep(every) => {
                    let byte = [head[next % head.len()]];
                    next += 1;
                    if s.write_all(&byte).await.is_err() {
                        return start.elapsed();
                    }
                }
            }
        }
    };
    timeout(deadline, run).await.ok()
}

/// A client that connects and sends nothing. Returns how long the relay
/// kept it open (None: still open at the deadline).
async fn silent(addr: SocketAddr, deadline: Duration) -> Option<Duration> {
    let start = Instant::now();
    let mut s = TcpStream::connect(addr).await.ok()?;
    let mut buf = [0u8; 256];
    let run = async {
        loop {
            match s.read(&mut buf).await {
                Ok(0) | Err(_) => return start.elapsed(),
                Ok(_) => {}
            }
        }
    };
    timeout(deadline, run).await.ok()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_silent_and_too_many_clients_leave_a_polling_client_served_and_the_stream_followed() {
    timeout(Duration::from_secs(60), abuse())
        .await
        .expect("the test's own deadline");
}

/// The same on one thread, as the binary runs (`main.rs`: `current_thread`):
/// the relay, its ZMQ side and every client share it.
#[tokio::test(flavor = "current_thread")]
async fn the_same_abuse_on_one_thread_as_the_binary_runs() {
    timeout(Duration::from_secs(60), abuse())
        .await
        .expect("the test's own deadline");
}

async fn abuse() {
    const SLOW: usize = 6;
    const SILENT: usize = 6;
    const FLOOD: usize = 40;
    const BATCHES: u64 = 40;
    let limits = ServeLimits {
        // Long beside the polling client's 20 ms, so a loaded machine does
        // not make the relay close the well-behaved connection.
        header_timeout: Duration::from_millis(1_000),
        idle_timeout: Duration::from_secs(2),
        max_connections: 16,
        max_in_flight: 8,
    };
    let mut publisher = zeromq::PubSocket::new();
    let pub_port = bound_port(publisher.bind("tcp://127.0.0.1:0").await.unwrap());
    let (addr, stats, state, tasks) = start_relay(
        format!("tcp://127.0.0.1:{pub_port}"),
        limits,
        HealthPolicy::default(),
    )
    .await;
    wait_live(&mut publisher, &state).await;

    // The well-behaved client: one keep-alive connection, opened first (as
    // Envoy's pool holds one), polling every 20 ms.
    let mut good = KeepAlive::connect(addr).await;
    let (status, page) = good.get("/kv/events?after=0").await;
    assert_eq!(status, 200, "{page}");
    let mut cursor: u64 = serde_json::from_str::<serde_json::Value>(&page).unwrap()["last"]
        .as_u64()
        .unwrap();

    // The abuse, every client bounded by its own deadline.
    let deadline = Duration::from_secs(15);
    let mut abusers = Vec::new();
    for _ in 0..SLOW {
        abusers.push(tokio::spawn(slowloris(
            addr,
            b"GET /kv/snapshot HTTP/1.1\r\nHost: relay\r\nX-Slow: aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
            Duration::from_millis(100),
            deadline,
        )));
    }
    for _ in 0..SILENT + FLOOD {
        abusers.push(tokio::spawn(silent(addr, deadline)));
    }

    // Meanwhile vLLM's side publishes one stored block every 50 ms.
    let published = Arc::new(Mutex::new(Vec::<Instant>::new()));
    let stamps = published.clone();
    let feeder = tokio::spawn(async move {
        for seq in 0..BATCHES {
            stamps.lock().unwrap().push(Instant::now());
            publisher.send(batch(seq, 1_000 + seq)).await.unwrap();
            sleep(Duration::from_millis(50)).await;
        }
        publisher
    });

    // A fresh connection in the middle of the flood is served too, once a
    // slot frees (the flood is timed out in waves of max_connections).
    let fresh = tokio::spawn(async move {
        sleep(Duration::from_millis(200)).await;
        let t = Instant::now();
        let answer = timeout(
            Duration::from_secs(12),
            get_once(addr, "/kv/events?after=0"),
        )
        .await;
        (t.elapsed(), answer.map(|(status, _)| status))
    });

    // The well-behaved client sees every batch, promptly.
    let mut seen_after = Vec::new();
    let poll_deadline = Instant::now() + Duration::from_secs(15);
    while (seen_after.len() as u64) < BATCHES {
        assert!(
            Instant::now() < poll_deadline,
            "the polling client saw {} of {BATCHES} batches",
            seen_after.len()
        );
        let (status, page) = timeout(
            Duration::from_secs(2),
            good.get(&format!("/kv/events?after={cursor}")),
        )
        .await
        .expect("a keep-alive poll was not answered within 2 s");
        assert_eq!(status, 200, "{page}");
        let page: serde_json::Value = serde_json::from_str(&page).unwrap();
        let now = Instant::now();
        for b in page["batches"].as_array().unwrap() {
            for op in b["ops"].as_array().unwrap() {
                for h in op["hashes"].as_array().unwrap() {
                    let i = (h.as_u64().unwrap() - 1_000) as usize;
                    let at = published.lock().unwrap()[i];
                    seen_after.push(now.duration_since(at));
                }
            }
        }
        cursor = page["seq"].as_u64().unwrap();
        sleep(Duration::from_millis(20)).await;
    }
    let worst = seen_after.iter().max().copied().unwrap_or_default();
    assert!(
        worst < Duration::from_millis(1_000),
        "a batch reached the polling client only after {worst:?}"
    );

    let mut held = Vec::new();
    for a in abusers {
        held.push(a.await.unwrap());
    }
    let still_open = held.iter().filter(|h| h.is_none()).count();
    assert_eq!(
        still_open,
        0,
        "{still_open} of {} slow or silent connections were still open after {deadline:?}",
        held.len()
    );
    let longest = held.iter().flatten().max().copied().unwrap_or_default();
    let peak = stats.peak.load(Ordering::Relaxed);
    assert!(
        peak <= limits.max_connections,
        "{peak} connections open at once"
    );
    let (fresh_wait, fresh_status) = fresh.await.unwrap();
    assert_eq!(
        fresh_status.ok(),
        Some(200),
        "a fresh connection during the flood"
    );

    // The ZMQ side kept up: every batch applied, no gap.
    let _publisher = feeder.await.unwrap();
    {
        let st = state.lock().unwrap();
        assert_eq!(st.counts.gaps, 0);
        assert_eq!(st.counts.events_stored, BATCHES);
    }
    let timeouts = stats.header_timeouts.load(Ordering::Relaxed);
    assert!(
        timeouts >= (SLOW + SILENT) as u64,
        "{timeouts} header timeouts"
    );
    eprintln!(
        "abuse: {} clients against max_connections {}; peak open {peak}; slowest abuser closed after {longest:?}; \
         {timeouts} header timeouts; worst event latency to the polling client {worst:?}; \
         a fresh connection during the flood answered after {fresh_wait:?}",
        held.len(),
        limits.max_connections,
    );
    for t in tasks {
        t.abort();
    }
}

/// A client that sends a request, then reads nothing, holds an in-flight
/// slot only until the inactivity timeout; meanwhile others get `503 busy`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn answers_in_flight_are_bounded_and_a_client_that_stops_reading_is_closed() {
    timeout(Duration::from_secs(60), in_flight())
        .await
        .expect("the test's own deadline");
}

async fn in_flight() {
    let limits = ServeLimits {
        header_timeout: Duration::from_secs(5),
        idle_timeout: Duration::from_millis(500),
        max_connections: 16,
        max_in_flight: 1,
    };
    let mut publisher = zeromq::PubSocket::new();
    let pub_port = bound_port(publisher.bind("tcp://127.0.0.1:0").await.unwrap());
    let (addr, stats, state, tasks) = start_relay(
        format!("tcp://127.0.0.1:{pub_port}"),
        limits,
        HealthPolicy::default(),
    )
    .await;
    // A large snapshot (about 20 B a block in JSON): 400,000 blocks, some 8 MB.
    {
        let mut st = Relay::new(
            Limits {
                max_blocks: 400_000,
                ..Limits::default()
            },
            1,
        );
        let mut events = Vec::new();
        let hashes: Vec<u64> = (0..400_000u64)
            .map(|h| h.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1 << 63)
            .collect();
        events.push(KvEvent::BlockStored {
            block_hashes: hashes,
            parent_block_hash: None,
            token_ids: Vec::new(),
            block_size: 16,
            lora_id: None,
            medium: None,
            lora_name: None,
            extra_keys: None,
            group_idx: None,
            kv_cache_spec_kind: None,
        });
        let payload = KvEventBatch {
            ts: 1.7e9,
            events,
            data_parallel_rank: None,
        }
        .encode();
        st.ingest_payload(0, &payload).unwrap();
        *state.lock().unwrap() = st;
    }
    // The stalled reader: a small receive buffer, one request, no reads.
    let sock = tokio::net::TcpSocket::new_v4().unwrap();
    sock.set_recv_buffer_size(4096).unwrap();
    let mut stalled = sock.connect(addr).await.unwrap();
    stalled
        .write_all(b"GET /kv/snapshot HTTP/1.1\r\nHost: relay\r\n\r\n")
        .await
        .unwrap();
    // Once its answer holds the only slot, another request is turned away
    // (a 200 first only means the stalled request was not parsed yet).
    let start = Instant::now();
    loop {
        let (status, body) = get_once(addr, "/kv/events?after=0").await;
        if status == 503 {
            assert!(body.starts_with("busy"), "{body}");
            break;
        }
        assert_eq!(status, 200, "{}", &body[..body.len().min(200)]);
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "no request was turned away while a reader held the only slot"
        );
        sleep(Duration::from_millis(20)).await;
    }
    // The inactivity timeout frees it; then the same request is answered.
    let start = Instant::now();
    loop {
        let (status, body) = get_once(addr, "/kv/events?after=0").await;
        if status == 200 {
            break;
        }
        assert_eq!(status, 503, "{body}");
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "the stalled reader still held its slot after {:?}",
            start.elapsed()
        );
        sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(stats.idle_timeouts.load(Ordering::Relaxed), 1);
    // A client that reads gets the whole answer (8.4 MB: 128 chunks of 64 KiB).
    let (status, body) = timeout(Duration::from_secs(20), get_once(addr, "/kv/snapshot"))
        .await
        .expect("the 8 MB snapshot within 20 s");
    assert_eq!(status, 200);
    assert!(body.len() > 8_000_000, "{} bytes", body.len());
    let snap: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(snap["blocks"].as_array().unwrap().len(), 400_000);
    assert!(stats.busy.load(Ordering::Relaxed) >= 1);
    drop(publisher);
    for t in tasks {
        t.abort();
    }
}

async fn health(addr: SocketAddr) -> (u16, String) {
    get_once(addr, "/healthz").await
}

/// Polls `/healthz` every 25 ms until `want`, for at most `within`.
async fn wait_health(addr: SocketAddr, want: u16, within: Duration) -> String {
    let start = Instant::now();
    loop {
        let (status, body) = health(addr).await;
        if status == want {
            return body;
        }
        assert!(
            start.elapsed() < within,
            "/healthz still {status} ({body:?}) after {within:?}, wanted {want}"
        );
        sleep(Duration::from_millis(25)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn healthz_follows_the_publisher_connection() {
    timeout(Duration::from_secs(60), healthz_connection())
        .await
        .expect("the test's own deadline");
}

async fn healthz_connection() {
    // A free port with nothing on it yet.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let (addr, _, _, tasks) = start_relay(
        format!("tcp://127.0.0.1:{port}"),
        ServeLimits::default(),
        HealthPolicy {
            grace: Duration::from_millis(300),
            max_silence: None,
        },
    )
    .await;
    let (status, body) = health(addr).await;
    assert_eq!(
        (status, body.as_str()),
        (503, "not connected to the publisher yet\n")
    );

    // The publisher comes up: healthy, without any message (an idle server).
    let mut publisher = zeromq::PubSocket::new();
    publisher
        .bind(&format!("tcp://127.0.0.1:{port}"))
        .await
        .unwrap();
    let body = wait_health(addr, 200, Duration::from_secs(10)).await;
    assert!(body.starts_with("ok: connected"), "{body}");

    // It goes away: still 200 within the grace, then 503 with the reason.
    drop(publisher);
    let body = wait_health(addr, 503, Duration::from_secs(10)).await;
    assert!(body.starts_with("publisher disconnected for"), "{body}");

    // It comes back on the same port: 200 again.
    let mut publisher = zeromq::PubSocket::new();
    publisher
        .bind(&format!("tcp://127.0.0.1:{port}"))
        .await
        .unwrap();
    wait_health(addr, 200, Duration::from_secs(15)).await;
    drop(publisher);
    for t in tasks {
        t.abort();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn healthz_with_a_silence_limit_wants_messages() {
    timeout(Duration::from_secs(60), healthz_silence())
        .await
        .expect("the test's own deadline");
}

async fn healthz_silence() {
    let mut publisher = zeromq::PubSocket::new();
    let pub_port = bound_port(publisher.bind("tcp://127.0.0.1:0").await.unwrap());
    let (addr, _, state, tasks) = start_relay(
        format!("tcp://127.0.0.1:{pub_port}"),
        ServeLimits::default(),
        HealthPolicy {
            grace: Duration::from_secs(5),
            max_silence: Some(Duration::from_millis(300)),
        },
    )
    .await;
    wait_live(&mut publisher, &state).await;
    assert_eq!(health(addr).await.0, 200);
    // Connected, but silent past the limit.
    let body = wait_health(addr, 503, Duration::from_secs(5)).await;
    assert!(body.starts_with("connected, but no message for"), "{body}");
    // A message makes it healthy again.
    publisher.send(batch(0, 1)).await.unwrap();
    let body = wait_health(addr, 200, Duration::from_secs(5)).await;
    assert!(body.starts_with("ok: connected, last message"), "{body}");
    for t in tasks {
        t.abort();
    }
}

/// Reads one whole answer (the relay sends `Content-Length`): (status, body).
async fn read_answer(stream: &mut BufReader<TcpStream>) -> (u16, String) {
    let mut line = String::new();
    stream.read_line(&mut line).await.unwrap();
    let status: u16 = line
        .split(' ')
        .nth(1)
        .unwrap_or_else(|| panic!("no status line: {line:?}"))
        .parse()
        .unwrap();
    let mut len = 0usize;
    loop {
        line.clear();
        stream.read_line(&mut line).await.unwrap();
        if line == "\r\n" || line.is_empty() {
            break;
        }
        if let Some((k, v)) = line.split_once(':') {
            if k.eq_ignore_ascii_case("content-length") {
                len = v.trim().parse().unwrap();
            }
        }
    }
    let mut body = vec![0u8; len];
    stream.read_exact(&mut body).await.unwrap();
    (status, String::from_utf8(body).unwrap())
}

/// One request with `head` (request line and headers, without the blank
/// line) and `body`, on its own connection.
async fn send(addr: SocketAddr, head: &str, body: &[u8]) -> (u16, String) {
    let mut s = BufReader::new(TcpStream::connect(addr).await.unwrap());
    let req = format!("{head}\r\nHost: relay\r\nConnection: close\r\n\r\n");
    s.get_mut().write_all(req.as_bytes()).await.unwrap();
    // A refused body may meet a closed connection: the answer still counts.
    let _ = s.get_mut().write_all(body).await;
    timeout(Duration::from_secs(10), read_answer(&mut s))
        .await
        .expect("an answer within 10 s")
}

fn post_exchange(body: &[u8]) -> String {
    format!(
        "POST /mesh/exchange HTTP/1.1\r\nContent-Length: {}",
        body.len()
    )
}

/// `POST /mesh/exchange` bodies from hostile clients: one sent a byte every
/// 100 ms holds its in-flight slot only until the body deadline (the header
/// timeout), a declared or chunked body over the bound is refused with 413,
/// and garbage with 400; none of them changes the mesh state.
#[tokio::test(flavor = "current_thread")]
async fn slow_oversized_and_garbage_mesh_bodies_are_cut_off_and_change_nothing() {
    timeout(Duration::from_secs(60), mesh_bodies())
        .await
        .expect("the test's own deadline");
}

async fn mesh_bodies() {
    let limits = ServeLimits {
        header_timeout: Duration::from_millis(1000),
        // Longer than the test: only the body deadline may end the slow body.
        idle_timeout: Duration::from_secs(50),
        max_connections: 16,
        max_in_flight: 1,
    };
    let mesh_limits = MeshLimits {
        max_body_bytes: 16 * 1024,
        ..MeshLimits::default()
    };
    let mesh: SharedMesh = Arc::new(Mutex::new(MeshState::new(mesh_limits, 5)));
    let state: Shared = Arc::new(Mutex::new(Relay::new(Limits::default(), 1)));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let web = tokio::spawn(http::serve_with_mesh(
        listener,
        state,
        mesh.clone(),
        limits,
        Arc::new(HttpStats::default()),
    ));

    // The slow body: 1,000 bytes declared, one sent every 100 ms (100 s).
    let (read, mut write) = TcpStream::connect(addr).await.unwrap().into_split();
    write
        .write_all(b"POST /mesh/exchange HTTP/1.1\r\nHost: relay\r\nContent-Length: 1000\r\n\r\n")
        .await
        .unwrap();
    let trickle = tokio::spawn(async move {
        for _ in 0..200 {
            if write.write_all(b" ").await.is_err() {
                return;
            }
            sleep(Duration::from_millis(100)).await;
        }
    });
    let started = Instant::now();
    let slow = tokio::spawn(async move {
        let mut r = BufReader::new(read);
        let mut line = String::new();
        timeout(Duration::from_secs(20), r.read_line(&mut line))
            .await
            .ok()
            .map(|_| (line, started.elapsed()))
    });
    // While it trickles, its request holds the only slot.
    sleep(Duration::from_millis(300)).await;
    let (status, body) = send(addr, "GET /kv/events?after=0 HTTP/1.1", b"").await;
    assert_eq!(status, 503, "the slow body did not hold its slot: {body}");
    let (status_line, held) = slow
        .await
        .unwrap()
        .expect("the slow body was still being read after 20 s");
    assert!(status_line.starts_with("HTTP/1.1 408"), "{status_line:?}");
    assert!(held < Duration::from_secs(5), "held for {held:?}");
    trickle.abort();
    // The slot is free again.
    let (status, body) = send(addr, "GET /kv/events?after=0 HTTP/1.1", b"").await;
    assert_eq!(status, 200, "{body}");

    // A declared body over the bound: 413 before any body byte.
    let (status, body) = send(
        addr,
        "POST /mesh/exchange HTTP/1.1\r\nContent-Length: 10000000",
        b"",
    )
    .await;
    assert_eq!(status, 413, "{body}");
    // A chunked body that grows past the bound: 413.
    let chunk = format!("{:x}\r\n{}\r\n", 8192, " ".repeat(8192));
    let chunked = format!("1\r\n{{\r\n{}", chunk.repeat(3));
    let (status, body) = send(
        addr,
        "POST /mesh/exchange HTTP/1.1\r\nTransfer-Encoding: chunked",
        chunked.as_bytes(),
    )
    .await;
    assert_eq!(status, 413, "{body}");
    // Garbage, deep nesting, huge numbers, an id too long: 400.
    let deep = "[".repeat(10_000);
    let long_id = format!(r#"{{"proxy":"{}"}}"#, "x".repeat(65));
    let bad_bodies: [&[u8]; 5] = [
        b"\xff\xfe\x00garbage",
        deep.as_bytes(),
        br#"{"proxy":"a","after":1e400}"#,
        long_id.as_bytes(),
        br#"{"proxy":"a","decisions":[{"newBlocks":1,"hashes":[1,2,"x"]}]}"#,
    ];
    for b in bad_bodies {
        let (status, body) = send(addr, &post_exchange(b), b).await;
        assert_eq!(status, 400, "{body}");
        assert!(body.starts_with("{\"error\":"), "{body}");
    }
    {
        let m = mesh.lock().unwrap();
        assert_eq!(m.counts.bad_requests, 8);
        assert_eq!((m.counts.posts, m.counts.decisions, m.last()), (0, 0, 0));
        assert_eq!((m.ring_len(), m.load_entries()), (0, 0));
    }
    // A good exchange after all that is answered.
    let good = br#"{"proxy":"a","decisions":[{"newBlocks":1,"hashes":[1]}]}"#;
    let (status, body) = send(addr, &post_exchange(good), good).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(mesh.lock().unwrap().last(), 1);
    web.abort();
}

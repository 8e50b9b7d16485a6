//! What one relay costs, per event and per poll (issue 17, "at scale").
//!
//! Two modes:
//!
//! - `relay_cost state [--batches N]`: in-process, one thread. Encodes
//!   steady-state batches with the codec (vLLM 0.32's map form: one
//!   `BlockStored` of H new hashes with their token ids, then one
//!   `BlockRemoved` of the H oldest once the server is "full"), feeds them to
//!   `state::Relay::ingest`, and times it with the thread's CPU clock
//!   (`/proc/thread-self/schedstat`). Then times the answers a poll builds:
//!   `events_after` + JSON at the tip and with a backlog, and `/kv/snapshot`
//!   JSON at 256 and 65536 blocks.
//! - `relay_cost pub --endpoint tcp://127.0.0.1:PORT --batches N --hashes H
//!   --held K [--rate R]`: a `zeromq` PUB that publishes the same kind of
//!   batches (R per second, 0: as fast as it can), for a real relay to
//!   subscribe to; the caller reads what the relay applied from `/metrics`.
//!
//! - `relay_cost mesh`: in-process, one thread: the parts of one
//!   `POST /mesh/exchange` (issue 43) for the two cases of
//!   `bench/mesh_cost.py`: `mesh::parse_request`, `MeshState::exchange` and
//!   the answer's JSON, each timed alone.
//!
//! `relay/bench/cost.sh` runs the first two against the release relay with
//! `wrk`; `relay/bench/mesh_cost.py` times the exchange over HTTP.

use bytes::Bytes;
use kvroute_kv_events::{frames, KvEvent, KvEventBatch, MEDIUM_GPU};
use kvroute_relay::state::{Limits, Relay};
use std::collections::VecDeque;
use std::time::{Duration, Instant};
use zeromq::{Socket, SocketSend, ZmqMessage};

const BLOCK_SIZE: u32 = 16;

/// CPU time of the calling thread, ns (first field of schedstat).
fn thread_cpu_ns() -> u64 {
    std::fs::read_to_string("/proc/thread-self/schedstat")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse().ok())
        .unwrap_or(0)
}

/// Steady-state batches: each stores `hashes` new blocks (a chain, with
/// token ids) and, once `held` blocks are held, removes as many oldest.
struct Gen {
    next: u64,
    held: VecDeque<u64>,
    hashes: usize,
    max_held: usize,
    rng: u64,
}

impl Gen {
    fn new(hashes: usize, max_held: usize, seed: u64) -> Gen {
        Gen {
            next: 0,
            held: VecDeque::new(),
            hashes,
            max_held,
            rng: seed | 1,
        }
    }

    fn rand(&mut self) -> u64 {
        // xorshift64*: hashes look like vLLM's (spread over u64).
        self.rng ^= self.rng >> 12;
        self.rng ^= self.rng << 25;
        self.rng ^= self.rng >> 27;
        self.rng.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    fn batch(&mut self) -> KvEventBatch {
        let mut events = Vec::new();
        let stored: Vec<u64> = (0..self.hashes).map(|_| self.rand()).collect();
        let tokens: Vec<u32> = (0..self.hashes * BLOCK_SIZE as usize)
            .map(|_| (self.rand() % 150_000) as u32)
            .collect();
        events.push(KvEvent::BlockStored {
            block_hashes: stored.clone(),
            parent_block_hash: self.held.back().copied(),
            token_ids: tokens,
            block_size: BLOCK_SIZE,
            lora_id: None,
            medium: Some(MEDIUM_GPU.into()),
            lora_name: None,
            extra_keys: Some(vec![None; self.hashes]),
            group_idx: Some(0),
            kv_cache_spec_kind: Some("full_attention".into()),
        });
        self.held.extend(&stored);
        if self.held.len() > self.max_held {
            let n = (self.held.len() - self.max_held).min(self.hashes);
            let removed: Vec<u64> = self.held.drain(..n).collect();
            events.push(KvEvent::BlockRemoved {
                block_hashes: removed,
                medium: Some(MEDIUM_GPU.into()),
                group_idx: Some(0),
            });
        }
        self.next += 1;
        KvEventBatch {
            ts: 1.7e9 + self.next as f64 * 0.01,
            events,
            data_parallel_rank: Some(0),
        }
    }
}

fn arg<T: std::str::FromStr>(args: &[String], name: &str, default: T) -> T {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// Runs `f` at least `n` times and for at least 300 ms (schedstat moves in
/// scheduler ticks); returns (CPU µs per call, wall µs per call).
fn time<R>(n: usize, mut f: impl FnMut() -> R) -> (f64, f64) {
    let (c0, w0) = (thread_cpu_ns(), Instant::now());
    let mut done = 0usize;
    while done < n || w0.elapsed() < Duration::from_millis(300) {
        for _ in 0..n.max(1) {
            std::hint::black_box(f());
        }
        done += n.max(1);
    }
    let cpu = (thread_cpu_ns() - c0) as f64 / 1e3 / done as f64;
    let wall = w0.elapsed().as_secs_f64() * 1e6 / done as f64;
    (cpu, wall)
}

fn state_mode(args: &[String]) {
    let n: usize = arg(args, "--batches", 20_000);
    println!(
        "# in-process: state::Relay::ingest on codec-encoded frames (map form, token ids included)"
    );
    println!("stored+removed_per_batch\tbatches\tpayload_B\tcpu_us_per_batch\twall_us_per_batch\tcpu_ns_per_hash\tdecode_only_cpu_us");
    for &h in &[16usize, 64] {
        let mut gen = Gen::new(h, 8192, 42 + h as u64);
        let msgs: Vec<[Vec<u8>; 3]> = (0..n as u64)
            .map(|s| frames("kv@bench", s, &gen.batch()))
            .collect();
        let payload: usize = msgs.iter().map(|m| m[2].len()).sum::<usize>() / n;
        // Hashes handled: stored + removed.
        let hashes_total: usize = msgs
            .iter()
            .map(|m| {
                KvEventBatch::decode(&m[2])
                    .unwrap()
                    .events
                    .iter()
                    .map(|e| match e {
                        KvEvent::BlockStored { block_hashes, .. }
                        | KvEvent::BlockRemoved { block_hashes, .. } => block_hashes.len(),
                        KvEvent::AllBlocksCleared => 0,
                    })
                    .sum::<usize>()
            })
            .sum();
        let mut relay = Relay::new(Limits::default(), 1);
        let (c0, w0) = (thread_cpu_ns(), Instant::now());
        for m in &msgs {
            let refs: [&[u8]; 3] = [&m[0], &m[1], &m[2]];
            relay.ingest(&refs).unwrap();
        }
        let cpu_ns = (thread_cpu_ns() - c0) as f64;
        let wall_ns = w0.elapsed().as_nanos() as f64;
        let mut i = 0;
        let (dec, _) = time(n, || {
            i = (i + 1) % n;
            KvEventBatch::decode_lenient(&msgs[i][2]).unwrap()
        });
        println!(
            "{h}+{h}\t{n}\t{payload}\t{:.2}\t{:.2}\t{:.1}\t{:.2}",
            cpu_ns / 1e3 / n as f64,
            wall_ns / 1e3 / n as f64,
            cpu_ns / hashes_total as f64,
            dec
        );
    }

    println!("\n# in-process: building one poll's answer (events_after or snapshot, then serde_json::to_vec)");
    println!("answer\tbytes\tcpu_us\twall_us");
    // Steady state, 64 stored + 64 removed per batch, 256 blocks held.
    let mut gen = Gen::new(64, 256, 7);
    let mut relay = Relay::new(Limits::default(), 1);
    for s in 0..2_000u64 {
        let m = frames("kv@bench", s, &gen.batch());
        relay.ingest(&[&m[0], &m[1], &m[2]]).unwrap();
    }
    let tip = relay.seq();
    for (name, after) in [
        ("events tip (nothing new)", tip),
        ("events backlog 20 batches (2560 hashes)", tip - 20),
    ] {
        let bytes = serde_json::to_vec(&relay.events_after(after, 4096, None))
            .unwrap()
            .len();
        let (c, w) = time(2_000, || {
            serde_json::to_vec(&relay.events_after(after, 4096, None)).unwrap()
        });
        println!("{name}\t{bytes}\t{c:.2}\t{w:.2}");
    }
    for held in [256usize, 65_536] {
        let mut gen = Gen::new(64, held, 9);
        let mut relay = Relay::new(Limits::default(), 1);
        for s in 0..(held / 64 + 8) as u64 {
            let m = frames("kv@bench", s, &gen.batch());
            relay.ingest(&[&m[0], &m[1], &m[2]]).unwrap();
        }
        assert_eq!(relay.block_count(), held);
        let bytes = serde_json::to_vec(&relay.snapshot()).unwrap().len();
        let reps = if held > 1000 { 20 } else { 2_000 };
        let (c, w) = time(reps, || serde_json::to_vec(&relay.snapshot()).unwrap());
        println!("snapshot {held} blocks\t{bytes}\t{c:.2}\t{w:.2}");
    }
}

async fn pub_mode(args: &[String]) {
    let endpoint: String = arg(args, "--endpoint", "tcp://127.0.0.1:5557".to_string());
    let n: u64 = arg(args, "--batches", 10_000);
    let h: usize = arg(args, "--hashes", 64);
    let held: usize = arg(args, "--held", 256);
    let rate: f64 = arg(args, "--rate", 0.0);
    let wait_ms: u64 = arg(args, "--wait-ms", 1_000);
    let mut publisher = zeromq::PubSocket::new();
    publisher.bind(&endpoint).await.expect("bind");
    // Let the relay's SUB connect and subscribe (a PUB drops until then).
    tokio::time::sleep(Duration::from_millis(wait_ms)).await;
    let mut gen = Gen::new(h, held, 11);
    let msgs: Vec<[Vec<u8>; 3]> = (0..n)
        .map(|s| frames("kv@bench", s, &gen.batch()))
        .collect();
    let t0 = Instant::now();
    for (i, m) in msgs.iter().enumerate() {
        let mut z = ZmqMessage::from(Bytes::copy_from_slice(&m[0]));
        z.push_back(Bytes::copy_from_slice(&m[1]));
        z.push_back(Bytes::copy_from_slice(&m[2]));
        publisher.send(z).await.expect("send");
        if rate > 0.0 {
            let due = t0 + Duration::from_secs_f64((i + 1) as f64 / rate);
            tokio::time::sleep_until(due.into()).await;
        } else if i % 64 == 63 {
            // Yield so that the socket's writer runs.
            tokio::task::yield_now().await;
        }
    }
    let secs = t0.elapsed().as_secs_f64();
    // Let the last frames leave before the socket closes.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let bytes: usize = msgs.iter().map(|m| m[2].len()).sum();
    eprintln!(
        "published {n} batches of {h} stored (+removes beyond {held} held), {:.1} MB payload, in {secs:.2} s",
        bytes as f64 / 1e6
    );
}

/// The parts of one mesh exchange, in-process: 2048 filler decisions of 64
/// hashes in the ring, then (a) a post of 8 decisions of 64 hashes from a
/// cursor before the filler (256 answered), (b) a load-only post at the tip.
fn mesh_mode() {
    use kvroute_relay::mesh::{parse_request, Decision, ExchangeRequest, MeshLimits, MeshState};
    let limits = MeshLimits::default();
    let mut g = Gen::new(64, usize::MAX, 43);
    let filler: Vec<Decision> = (0..2048)
        .map(|_| Decision {
            new_blocks: 64,
            prompt_bytes: 16_384,
            hashes: (0..64).map(|_| g.rand()).collect(),
            ..Decision::default()
        })
        .collect();
    let now = Instant::now();
    let fresh = || {
        let mut m = MeshState::new(limits, 7);
        m.exchange(
            ExchangeRequest {
                proxy: "filler".into(),
                decisions: Some(filler.clone()),
                ..ExchangeRequest::default()
            },
            now,
        );
        m
    };
    let own: Vec<String> = (0..8)
        .map(|_| {
            let list: Vec<String> = (0..64).map(|_| g.rand().to_string()).collect();
            format!(r#"{{"newBlocks":64,"hashes":[{}]}}"#, list.join(","))
        })
        .collect();
    let load = r#""load":{"prompt":12000,"output":3000,"requests":7},"ttlMs":2000"#;
    let heavy = format!(
        r#"{{"proxy":"gateway-a","epoch":7,"after":0,"limit":256,{load},"decisions":[{}]}}"#,
        own.join(",")
    );
    let light = format!(r#"{{"proxy":"gateway-b","epoch":7,"after":2048,{load}}}"#);
    println!("# in-process: one POST /mesh/exchange, by part (ring: 2048 decisions of 64 hashes)");
    println!("case\treq_bytes\tanswer_bytes\tanswer_decisions\tparse_cpu_us\texchange_cpu_us\tanswer_json_cpu_us");
    for (name, body, n) in [
        ("a: 8x64 posted, 256x64 answered", &heavy, 1000),
        ("b: load only, empty answer", &light, 20_000),
    ] {
        let req = parse_request(body.as_bytes(), &limits).unwrap();
        let (parse_us, _) = time(n, || parse_request(body.as_bytes(), &limits));
        // Exactly n exchanges on a fresh ring: (a)'s own decisions
        // accumulate, and its cursor stays within the ring for 1,792.
        let mut m = fresh();
        let reqs: Vec<ExchangeRequest> = (0..n).map(|_| req.clone()).collect();
        let c0 = thread_cpu_ns();
        for r in reqs {
            std::hint::black_box(m.exchange(r, now));
        }
        let exchange_us = (thread_cpu_ns() - c0) as f64 / 1e3 / n as f64;
        let answer = m.exchange(req.clone(), now);
        assert!(!answer.resync);
        let (json_us, _) = time(n, || serde_json::to_vec(&answer).unwrap());
        let bytes = serde_json::to_vec(&answer).unwrap().len();
        println!(
            "{name}\t{}\t{bytes}\t{}\t{parse_us:.2}\t{exchange_us:.2}\t{json_us:.2}",
            body.len(),
            answer.decisions.len()
        );
    }
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.first().map(String::as_str) {
        Some("state") => state_mode(&args),
        Some("mesh") => mesh_mode(),
        Some("pub") => tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
            .block_on(pub_mode(&args)),
        _ => {
            eprintln!("usage: relay_cost state [--batches N] | relay_cost mesh | relay_cost pub --endpoint E --batches N --hashes H --held K [--rate R]");
            std::process::exit(2);
        }
    }
}

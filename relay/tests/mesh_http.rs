//! `POST /mesh/exchange` over real HTTP: the release binary's flags and
//! wiring, started as a process on a loopback port (no publisher: the mesh
//! exchange does not need one).

use serde_json::{json, Value};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

/// The relay binary on an ephemeral port; killed on drop.
struct RelayProcess {
    child: Child,
    addr: SocketAddr,
}

impl RelayProcess {
    fn start(extra: &[&str]) -> RelayProcess {
        let mut child = Command::new(env!("CARGO_BIN_EXE_kvroute-relay"))
            // Port 1: nothing listens; the SUB side keeps retrying quietly.
            .args(["--sub", "tcp://127.0.0.1:1", "--listen", "127.0.0.1:0"])
            .args(extra)
            .stderr(Stdio::piped())
            .spawn()
            .expect("start kvroute-relay");
        let stderr = child.stderr.take().unwrap();
        let mut lines = BufReader::new(stderr).lines();
        let addr = loop {
            let line = lines
                .next()
                .expect("the relay exited before serving")
                .unwrap();
            if let Some(a) = line.strip_prefix("kvroute-relay: serving http://") {
                break a.parse().unwrap();
            }
        };
        // Keep draining stderr so the relay never blocks on it.
        std::thread::spawn(move || for _ in lines {});
        RelayProcess { child, addr }
    }

    /// One request on its own connection: (status, body).
    fn request(&self, method: &str, path: &str, body: &[u8]) -> (u16, String) {
        let mut s = TcpStream::connect(self.addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let head = format!(
            "{method} {path} HTTP/1.1\r\nHost: relay\r\nConnection: close\r\nContent-Length: {}\r\n\r\n",
            body.len()
        );
        s.write_all(head.as_bytes()).unwrap();
        // A refused body may be cut off by the relay closing: fine.
        let _ = s.write_all(body);
        let mut out = Vec::new();
        let _ = s.read_to_end(&mut out);
        let out = String::from_utf8(out).unwrap();
        let (head, body) = out.split_once("\r\n\r\n").expect("an HTTP answer");
        (
            head.split(' ').nth(1).unwrap().parse().unwrap(),
            body.to_string(),
        )
    }

    fn exchange(&self, body: &Value) -> Value {
        let (status, text) = self.request("POST", "/mesh/exchange", body.to_string().as_bytes());
        assert_eq!(status, 200, "{body}: {text}");
        serde_json::from_str(&text).unwrap()
    }

    fn metric(&self, name: &str) -> f64 {
        let (_, text) = self.request("GET", "/metrics", b"");
        text.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
            .unwrap_or_else(|| panic!("{name} not in /metrics"))
    }
}

impl Drop for RelayProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn hash_lists(answer: &Value) -> Vec<Vec<u64>> {
    answer["decisions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| {
            d["hashes"]
                .as_array()
                .unwrap()
                .iter()
                .map(|h| h.as_u64().unwrap())
                .collect()
        })
        .collect()
}

#[test]
fn two_proxies_exchange_decisions_and_load_over_http() {
    let relay = RelayProcess::start(&[]);
    let a1 = relay.exchange(&json!({
        "proxy": "gateway-a",
        "load": {"prompt": 1200, "output": 300, "requests": 3},
        "ttlMs": 30000,
        "decisions": [
            {"newBlocks": 40, "hashes": [u64::MAX, 42]},
            {"newBlocks": 2, "hashes": [7]}
        ]
    }));
    let epoch = a1["epoch"].as_u64().unwrap();
    assert_ne!(epoch, 0);
    assert_eq!(
        (a1["seq"].as_u64(), a1["last"].as_u64()),
        (Some(2), Some(2))
    );
    assert_eq!(a1["decisions"], json!([]));
    assert_eq!(
        a1["load"],
        json!({"prompt": 0, "output": 0, "requests": 0, "proxies": 0})
    );

    // B, new: A's two decisions (u64::MAX exactly) and A's load.
    let b1 = relay.exchange(&json!({
        "proxy": "sidecar-b",
        "load": {"prompt": 500, "output": 50, "requests": 1},
        "decisions": [{"newBlocks": 1, "hashes": [99]}]
    }));
    assert_eq!(b1["epoch"].as_u64(), Some(epoch));
    assert_eq!(hash_lists(&b1), vec![vec![u64::MAX, 42], vec![7]]);
    assert_eq!(b1["decisions"][0]["newBlocks"], 40);
    assert_eq!(
        (b1["seq"].as_u64(), b1["last"].as_u64()),
        (Some(3), Some(3))
    );
    assert_eq!(b1["resync"], false);
    assert_eq!(b1["more"], false);
    assert_eq!(
        b1["load"],
        json!({"prompt": 1200, "output": 300, "requests": 3, "proxies": 1})
    );

    // A from its cursor: B's one, never its own; B's load.
    let a2 = relay.exchange(&json!({"proxy": "gateway-a", "epoch": epoch, "after": 2, "limit": 1}));
    assert_eq!(hash_lists(&a2), vec![vec![99]]);
    assert_eq!(a2["seq"].as_u64(), Some(3));
    assert_eq!(
        a2["load"],
        json!({"prompt": 500, "output": 50, "requests": 1, "proxies": 1})
    );
    // Another epoch: resync from the oldest, A's own still left out.
    let a3 = relay.exchange(&json!({"proxy": "gateway-a", "epoch": epoch ^ 1, "after": 3}));
    assert_eq!(a3["resync"], true);
    assert_eq!(hash_lists(&a3), vec![vec![99]]);

    assert_eq!(relay.metric("kvroute_relay_mesh_posts_total"), 4.0);
    assert_eq!(relay.metric("kvroute_relay_mesh_decisions_total"), 3.0);
    assert_eq!(relay.metric("kvroute_relay_mesh_ring_decisions"), 3.0);
    assert_eq!(relay.metric("kvroute_relay_mesh_ring_hashes"), 4.0);
    assert_eq!(relay.metric("kvroute_relay_mesh_proxies"), 2.0);
    assert_eq!(relay.metric("kvroute_relay_mesh_bad_requests_total"), 0.0);
}

#[test]
fn oversized_garbage_and_wrong_methods_are_refused_and_change_nothing() {
    let relay = RelayProcess::start(&[
        "--mesh-max-body-bytes",
        "4096",
        "--mesh-ring-decisions",
        "2",
    ]);
    let before = relay.exchange(&json!({"proxy": "a"}));
    let epoch = before["epoch"].as_u64().unwrap();
    let refused = |method: &str, body: &[u8], want: u16| {
        let (status, text) = relay.request(method, "/mesh/exchange", body);
        assert_eq!(
            status,
            want,
            "{}: {text}",
            String::from_utf8_lossy(&body[..body.len().min(80)])
        );
        text
    };
    // Over the body bound: 413, with a JSON error.
    let big = json!({"proxy": "a", "decisions": [{"newBlocks": 1, "hashes": vec![1u64; 3000]}]});
    let text = refused("POST", big.to_string().as_bytes(), 413);
    let err: Value = serde_json::from_str(&text).unwrap();
    assert!(err["error"].as_str().unwrap().contains("4096"), "{text}");
    // Garbage, a bad id, and a decision over its hash bound: 400.
    refused("POST", b"\x00\xffgarbage", 400);
    refused("POST", br#"{"proxy":"no spaces"}"#, 400);
    refused(
        "POST",
        br#"{"proxy":"a","decisions":[{"newBlocks":1,"hashes":[-1]}]}"#,
        400,
    );
    // GET on the exchange: 405; POST elsewhere still 405.
    refused("GET", b"", 405);
    let (status, _) = relay.request("POST", "/kv/events", b"{}");
    assert_eq!(status, 405);
    // The GET endpoints are as before.
    assert_eq!(relay.request("GET", "/kv/snapshot", b"").0, 200);

    assert_eq!(relay.metric("kvroute_relay_mesh_bad_requests_total"), 4.0);
    assert_eq!(relay.metric("kvroute_relay_mesh_decisions_total"), 0.0);
    // The ring bound flag: three decisions, two kept.
    let after = relay.exchange(&json!({"proxy": "a", "epoch": epoch, "after": 0,
        "decisions": [{"newBlocks": 1, "hashes": [1]}, {"newBlocks": 1, "hashes": [2]}, {"newBlocks": 1, "hashes": [3]}]}));
    assert_eq!(after["last"].as_u64(), Some(3));
    assert_eq!(relay.metric("kvroute_relay_mesh_ring_decisions"), 2.0);
    assert_eq!(
        relay.metric("kvroute_relay_mesh_decisions_dropped_total"),
        1.0
    );
    let b = relay.exchange(&json!({"proxy": "b", "epoch": epoch, "after": 0}));
    assert_eq!(b["resync"], true);
    assert_eq!(hash_lists(&b), vec![vec![2], vec![3]]);
}

#[test]
fn a_restarted_relay_has_another_epoch() {
    let first = RelayProcess::start(&[]).exchange(&json!({"proxy": "a"}))["epoch"].as_u64();
    let second = RelayProcess::start(&[]).exchange(&json!({"proxy": "a"}))["epoch"].as_u64();
    assert_ne!(first, second);
}

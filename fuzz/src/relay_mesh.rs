//! Fuzz target `relay_mesh`: what proxies send the relay's mesh exchange
//! (`POST /mesh/exchange`), through `mesh::parse_request` and
//! `MeshState::exchange`, against a naive model of the exchange.
//!
//! Input: records until the input ends (at most [`MAX_RECORDS`]). A record
//! is an opcode byte, then:
//!
//! | op % 3 | what | then |
//! |---|---|---|
//! | 0 | a raw request body | u16 LE length, bytes |
//! | 1 | a well-formed exchange, written as JSON | proxy byte, cursor byte, u16 LE `after`, limit byte, flags byte (1: load, 2: ttl), u16 prompt, u16 output, u8 requests, u16 ttl, decision count byte (% 5); per decision: u8 newBlocks, u8 hash count (% 40), u8 prompt-bytes kind, u64 LE hashes, session byte (1: a session, u64 LE hash follows; 2: moved) |
//! | 2 | the clock moves | u16 LE ms |
//!
//! Checked, besides "no panic":
//!
//! - `parse_request` refuses a body over `max_body_bytes` as too large and
//!   nothing else; what it accepts has a valid proxy id and is within the
//!   per-request bounds; parsing is deterministic; its heap peak is within
//!   the harness's bound for the body's size; a well-formed exchange is
//!   accepted and read back exactly (u64 hashes included);
//! - after every exchange, the ring holds at most `ring_decisions`
//!   decisions and `ring_hashes` hashes, the load table at most
//!   `max_proxies` entries;
//! - every answer equals the model's (a list of every decision ever posted,
//!   the retained ones being the longest suffix within both bounds; the
//!   cursor rule, the asker's own left out, the limit and `more`, and the
//!   load sum, all recomputed naively), and serialises to JSON.

use crate::alloc_count;
use kvroute_relay::mesh::{
    valid_proxy_id, Decision, ExchangeAnswer, ExchangeRequest, Load, LoadSum, MeshLimits,
    MeshState, RequestError, DEFAULT_LIMIT, DEFAULT_TTL_MS, MAX_ANSWER_HASHES, MAX_DECISION_HASHES,
    MAX_LIMIT, MAX_REQUEST_DECISIONS, MAX_REQUEST_HASHES, MAX_TTL_MS, MIN_TTL_MS,
};
use std::collections::HashMap;
use std::time::{Duration, Instant};

/// Most records per input.
pub const MAX_RECORDS: usize = 256;

/// Small bounds, so that every drop and eviction path runs.
const LIMITS: MeshLimits = MeshLimits {
    ring_decisions: 16,
    ring_hashes: 64,
    max_proxies: 4,
    max_body_bytes: 4096,
};

const EPOCH: u64 = 0x5EED_0000_0000_0001;

/// More proxies than `max_proxies`.
const PROXIES: [&str; 6] = ["a", "b", "gw-1", "gw-2", "side.car:3", "x_y-z"];

struct Reader<'a> {
    data: &'a [u8],
}

impl<'a> Reader<'a> {
    fn u8(&mut self) -> u8 {
        match self.data.split_first() {
            Some((b, rest)) => {
                self.data = rest;
                *b
            }
            None => 0,
        }
    }
    fn u16(&mut self) -> u16 {
        u16::from_le_bytes([self.u8(), self.u8()])
    }
    fn u64(&mut self) -> u64 {
        u64::from_le_bytes(std::array::from_fn(|_| self.u8()))
    }
    fn bytes(&mut self) -> &'a [u8] {
        let n = usize::from(self.u16()).min(self.data.len());
        let (head, rest) = self.data.split_at(n);
        self.data = rest;
        head
    }
}

/// The exchange, naively: every decision ever posted, kept whole.
struct Model {
    all: Vec<(u64, String, Decision)>,
    loads: HashMap<String, (Load, Instant)>,
}

impl Model {
    /// The retained decisions: the longest suffix within both ring bounds.
    fn retained(&self) -> &[(u64, String, Decision)] {
        let mut from = self.all.len();
        let mut hashes = 0usize;
        while from > 0 {
            let h = self.all[from - 1].2.hashes.len();
            if self.all.len() - from + 1 > LIMITS.ring_decisions || hashes + h > LIMITS.ring_hashes
            {
                break;
            }
            hashes += h;
            from -= 1;
        }
        &self.all[from..]
    }

    fn exchange(&mut self, req: &ExchangeRequest, now: Instant) -> ExchangeAnswer {
        self.loads.retain(|_, (_, exp)| *exp > now);
        if let Some(load) = req.load {
            let ttl = req
                .ttl_ms
                .unwrap_or(DEFAULT_TTL_MS)
                .clamp(MIN_TTL_MS, MAX_TTL_MS);
            let exp = now + Duration::from_millis(ttl);
            if !self.loads.contains_key(&req.proxy) && self.loads.len() >= LIMITS.max_proxies {
                let victim = self
                    .loads
                    .iter()
                    .map(|(k, (_, e))| (*e, k.clone()))
                    .min()
                    .map(|(_, k)| k)
                    .expect("a full table has entries");
                self.loads.remove(&victim);
            }
            self.loads.insert(req.proxy.clone(), (load, exp));
        }
        let mut last = self.all.last().map_or(0, |e| e.0);
        for d in req.decisions.iter().flatten() {
            last += 1;
            self.all.push((last, req.proxy.clone(), d.clone()));
        }
        let retained = self.retained();
        let oldest = retained.first().map_or(last + 1, |e| e.0);
        let good_cursor = |a: u64| req.epoch == Some(EPOCH) && a <= last && a + 1 >= oldest;
        let (start, resync) = match req.after {
            None => (oldest - 1, false),
            Some(a) if good_cursor(a) => (a, false),
            Some(_) => (oldest - 1, true),
        };
        let limit = req.limit.unwrap_or(DEFAULT_LIMIT).clamp(1, MAX_LIMIT) as usize;
        let mut decisions = Vec::new();
        let mut hashes = 0usize;
        let mut seq = start;
        let mut more = false;
        for (s, who, d) in retained.iter().filter(|e| e.0 > start) {
            if *who == req.proxy {
                seq = *s;
                continue;
            }
            if !decisions.is_empty()
                && (decisions.len() == limit || hashes + d.hashes.len() > MAX_ANSWER_HASHES)
            {
                more = true;
                break;
            }
            hashes += d.hashes.len();
            seq = *s;
            decisions.push(d.clone());
        }
        let mut load = LoadSum::default();
        let mut requests = 0u64;
        for (k, (l, _)) in &self.loads {
            if *k != req.proxy {
                load.prompt = load.prompt.saturating_add(l.prompt);
                load.output = load.output.saturating_add(l.output);
                requests += u64::from(l.requests);
                load.proxies += 1;
            }
        }
        load.requests = requests.min(u64::from(u32::MAX)) as u32;
        ExchangeAnswer {
            epoch: EPOCH,
            seq,
            last,
            resync,
            more,
            load,
            decisions: decisions
                .into_iter()
                .map(|d| kvroute_relay::mesh::AnswerDecision {
                    new_blocks: d.new_blocks,
                    prompt_bytes: d.prompt_bytes,
                    hashes: d.hashes.into(),
                    // Passed on as posted; a moved flag needs a session.
                    session: d.session,
                    session_moved: d.session.is_some() && d.session_moved,
                })
                .collect(),
        }
    }
}

/// Parses `body` and checks what the parser promises.
fn parse(body: &[u8]) -> Option<ExchangeRequest> {
    let base = alloc_count::start();
    let parsed = kvroute_relay::mesh::parse_request(body, &LIMITS);
    crate::check_alloc(
        "mesh::parse_request",
        body.len(),
        alloc_count::peak_since(base),
    );
    assert_eq!(
        kvroute_relay::mesh::parse_request(body, &LIMITS),
        parsed,
        "parsing is not deterministic"
    );
    match parsed {
        Err(RequestError::TooLarge { bytes, max }) => {
            assert_eq!((bytes, max), (body.len(), LIMITS.max_body_bytes));
            assert!(bytes > max);
            None
        }
        Err(RequestError::Bad(m)) => {
            assert!(body.len() <= LIMITS.max_body_bytes, "a large body was Bad");
            assert!(!m.is_empty(), "an error without a message");
            None
        }
        Ok(r) => {
            assert!(body.len() <= LIMITS.max_body_bytes);
            assert!(valid_proxy_id(&r.proxy), "{:?}", r.proxy);
            let ds = r.decisions.as_deref().unwrap_or_default();
            assert!(ds.len() <= MAX_REQUEST_DECISIONS);
            assert!(ds.iter().all(|d| d.hashes.len() <= MAX_DECISION_HASHES));
            assert!(ds.iter().map(|d| d.hashes.len()).sum::<usize>() <= MAX_REQUEST_HASHES);
            Some(r)
        }
    }
}

/// A well-formed exchange from the input, and its JSON body.
fn structured(r: &mut Reader, cursors: &HashMap<String, u64>) -> (ExchangeRequest, Vec<u8>) {
    let proxy = PROXIES[usize::from(r.u8()) % PROXIES.len()].to_string();
    let cursor = r.u8();
    let after = u64::from(r.u16());
    let (epoch, after) = match cursor % 5 {
        0 => (None, None),
        1 => (Some(EPOCH), Some(after)),
        2 => (Some(EPOCH ^ 1), Some(after)),
        3 => (None, Some(after)),
        // Where this proxy's last answer left it, as a collector does.
        _ => (Some(EPOCH), cursors.get(&proxy).copied()),
    };
    let limit = match r.u8() {
        255 => None,
        l => Some(u64::from(l)),
    };
    let flags = r.u8();
    let load = Load {
        prompt: u64::from(r.u16()),
        output: u64::from(r.u16()),
        requests: u32::from(r.u8()),
    };
    let ttl = u64::from(r.u16());
    let n = r.u8() % 5;
    let decisions: Vec<Decision> = (0..n)
        .map(|_| {
            let new_blocks = u32::from(r.u8());
            let h = r.u8() % 40;
            // Often 0 (left out of the JSON), sometimes at the bound.
            let prompt_bytes = match r.u8() % 4 {
                0 | 1 => 0,
                2 => u32::from(r.u16()),
                _ => u32::MAX,
            };
            let hashes = (0..h).map(|_| r.u64()).collect();
            // A session often absent; its moved flag sometimes set alone.
            let s = r.u8();
            Decision {
                new_blocks,
                prompt_bytes,
                hashes,
                session: (s & 1 != 0).then(|| r.u64()),
                session_moved: s & 2 != 0,
            }
        })
        .collect();
    let req = ExchangeRequest {
        proxy,
        epoch,
        after,
        limit,
        load: (flags & 1 != 0).then_some(load),
        ttl_ms: (flags & 2 != 0).then_some(ttl),
        decisions: (!decisions.is_empty()).then_some(decisions),
    };
    let mut doc = serde_json::json!({ "proxy": req.proxy });
    let set = |doc: &mut serde_json::Value, k: &str, v: serde_json::Value| {
        doc.as_object_mut().expect("an object").insert(k.into(), v);
    };
    if let Some(e) = req.epoch {
        set(&mut doc, "epoch", e.into());
    }
    if let Some(a) = req.after {
        set(&mut doc, "after", a.into());
    }
    if let Some(l) = req.limit {
        set(&mut doc, "limit", l.into());
    }
    if let Some(l) = req.load {
        set(
            &mut doc,
            "load",
            serde_json::json!({"prompt": l.prompt, "output": l.output, "requests": l.requests}),
        );
    }
    if let Some(t) = req.ttl_ms {
        set(&mut doc, "ttlMs", t.into());
    }
    if let Some(ds) = &req.decisions {
        let ds: Vec<serde_json::Value> = ds
            .iter()
            .map(|d| {
                let mut v = serde_json::json!({"newBlocks": d.new_blocks, "hashes": d.hashes});
                if d.prompt_bytes != 0 {
                    v["promptBytes"] = d.prompt_bytes.into();
                }
                if let Some(h) = d.session {
                    v["session"] = h.into();
                }
                if d.session_moved {
                    v["sessionMoved"] = true.into();
                }
                v
            })
            .collect();
        set(&mut doc, "decisions", ds.into());
    }
    // An unknown field, ignored.
    set(&mut doc, "future", serde_json::json!({"x": [1.5, null]}));
    let body = serde_json::to_vec(&doc).expect("a Value serialises");
    (req, body)
}

fn check_bounds(m: &MeshState) {
    assert!(
        m.ring_len() <= LIMITS.ring_decisions,
        "{} decisions",
        m.ring_len()
    );
    assert!(
        m.ring_hash_count() <= LIMITS.ring_hashes,
        "{} hashes",
        m.ring_hash_count()
    );
    assert!(
        m.load_entries() <= LIMITS.max_proxies,
        "{} load entries",
        m.load_entries()
    );
}

/// Runs one input (fuzz target `relay_mesh`).
pub fn run(data: &[u8]) {
    let mut state = MeshState::new(LIMITS, EPOCH);
    let mut model = Model {
        all: Vec::new(),
        loads: HashMap::new(),
    };
    let mut cursors: HashMap<String, u64> = HashMap::new();
    let t0 = Instant::now();
    let mut now = t0;
    let mut r = Reader { data };
    for _ in 0..MAX_RECORDS {
        if r.data.is_empty() {
            break;
        }
        let op = r.u8();
        let req = match op % 3 {
            0 => parse(r.bytes()),
            1 => {
                let (want, body) = structured(&mut r, &cursors);
                let got = parse(&body);
                if body.len() <= LIMITS.max_body_bytes {
                    assert_eq!(
                        got.as_ref(),
                        Some(&want),
                        "{}",
                        String::from_utf8_lossy(&body)
                    );
                }
                got
            }
            _ => {
                now += Duration::from_millis(u64::from(r.u16()));
                None
            }
        };
        let Some(req) = req else {
            continue;
        };
        let expect = model.exchange(&req, now);
        let proxy = req.proxy.clone();
        let got = state.exchange(req, now);
        assert_eq!(got, expect, "the exchange differs from the model");
        cursors.insert(proxy, got.seq);
        assert_eq!((got.epoch, got.last), (EPOCH, state.last()));
        assert!(got.seq <= got.last);
        check_bounds(&state);
        let json = serde_json::to_vec(&got).expect("an answer serialises");
        let back: serde_json::Value = serde_json::from_slice(&json).expect("answer JSON parses");
        assert_eq!(back["epoch"].as_u64(), Some(EPOCH));
    }
}

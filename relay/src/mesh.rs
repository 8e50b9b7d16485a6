//! The mesh exchange (`POST /mesh/exchange`, issue 43): the proxies in front
//! of one fleet tell each other, through the relay beside each server S,
//! which of their decisions S accepted and how much work each has in flight
//! on S. Plain, synchronous Rust; `http` reads the body and calls
//! [`MeshState::exchange`] under a short lock.
//!
//! - **The ring.** Every decision a proxy posts is appended with the next
//!   mesh seq (+1 per decision, never going back while the relay runs) and
//!   its poster. The ring keeps at most `ring_decisions` decisions and
//!   `ring_hashes` hashes, dropping its oldest (counted).
//! - **The cursor.** A proxy reads the others' decisions after its cursor
//!   `(epoch, after)`, oldest first. Its own are never returned to it but
//!   count as read, so its cursor moves past them. A cursor from another
//!   epoch (a restarted relay) or one that fell off the ring is a resync:
//!   the answer starts at the oldest retained decision and says so. A proxy
//!   with no cursor warms up from the ring's backlog, without `resync`.
//! - **The load.** Each proxy's in-flight work on this server, kept for the
//!   `ttlMs` it gives; an answer carries the sum over the other proxies'
//!   unexpired entries. At most `max_proxies` entries: when full, expired
//!   ones are purged, then the one expiring soonest is replaced.
//!
//! Memory is bounded whatever clients send: a request is at most
//! `max_body_bytes` and [`parse_request`] refuses one over its bounds before
//! anything is applied; the ring and the load table are bounded as above;
//! an answer carries at most [`MAX_ANSWER_HASHES`] hashes (but one decision).

use serde::{Deserialize, Serialize, Serializer};
use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Decisions per answer when `limit` is not given, and its clamp.
pub const DEFAULT_LIMIT: u64 = 256;
pub const MAX_LIMIT: u64 = 4096;
/// A load entry counts this long when `ttlMs` is not given (ms), and the
/// clamp of `ttlMs`.
pub const DEFAULT_TTL_MS: u64 = 2000;
pub const MIN_TTL_MS: u64 = 100;
pub const MAX_TTL_MS: u64 = 60_000;
/// Bounds of one request: hashes per decision, decisions, hashes in all.
pub const MAX_DECISION_HASHES: usize = 4096;
pub const MAX_REQUEST_DECISIONS: usize = 1024;
pub const MAX_REQUEST_HASHES: usize = 65_536;
/// Most hashes in one answer (at least one decision is sent however big):
/// about 1.3 MB of JSON. The rest follows with `more`.
pub const MAX_ANSWER_HASHES: usize = 65_536;
/// A proxy id: 1 to 64 characters of `[0-9A-Za-z_.:-]`.
pub const MAX_PROXY_ID_LEN: usize = 64;

/// Memory bounds; the defaults are the flags' defaults.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MeshLimits {
    /// Most decisions in the ring (`--mesh-ring-decisions`).
    pub ring_decisions: usize,
    /// Most hashes across the ring's decisions (`--mesh-ring-hashes`).
    pub ring_hashes: usize,
    /// Most load entries (`--mesh-max-proxies`).
    pub max_proxies: usize,
    /// Most bytes in a request body (`--mesh-max-body-bytes`).
    pub max_body_bytes: usize,
}

impl Default for MeshLimits {
    fn default() -> Self {
        MeshLimits {
            ring_decisions: 16_384,
            ring_hashes: 1_048_576,
            max_proxies: 4096,
            max_body_bytes: 1 << 20,
        }
    }
}

/// One proxy's in-flight work on this server (tokens, requests).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Load {
    pub prompt: u64,
    pub output: u64,
    pub requests: u32,
}

/// One accepted decision: the blocks it advanced the server's eviction
/// clock by, the text prompt bytes it routed here (absent: 0), its block
/// hashes (from the start of an index group; none when nothing was new),
/// and, when it settled a session's binding here, the session id's hash
/// and whether it moved the binding (absent: none, not moved). The relay
/// passes the session on as it came: it is the proxies' business.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Decision {
    pub new_blocks: u32,
    #[serde(default)]
    pub prompt_bytes: u32,
    pub hashes: Vec<u64>,
    #[serde(default)]
    pub session: Option<u64>,
    #[serde(default)]
    pub session_moved: bool,
}

/// A `POST /mesh/exchange` body. Unknown fields are ignored (forward
/// compatibility); absent optional fields take the defaults in
/// [`MeshState::exchange`].
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ExchangeRequest {
    /// The posting proxy's id.
    pub proxy: String,
    /// The mesh epoch the asker read from, and the last mesh seq it read.
    /// The cursor is `after`; without `after` there is none.
    pub epoch: Option<u64>,
    pub after: Option<u64>,
    /// Most decisions in the answer ([`DEFAULT_LIMIT`], clamped to
    /// 1..=[`MAX_LIMIT`]).
    pub limit: Option<u64>,
    /// This proxy's in-flight work here now; absent: its previous entry is
    /// left to expire.
    pub load: Option<Load>,
    /// How long `load` counts (ms; [`DEFAULT_TTL_MS`], clamped to
    /// [`MIN_TTL_MS`]..=[`MAX_TTL_MS`]).
    pub ttl_ms: Option<u64>,
    /// Accepted decisions routed here since this proxy's last call, oldest
    /// first.
    pub decisions: Option<Vec<Decision>>,
}

/// The other proxies' load summed, and how many entries the sum holds.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct LoadSum {
    pub prompt: u64,
    pub output: u64,
    /// Saturates at `u32::MAX`.
    pub requests: u32,
    pub proxies: u32,
}

/// A decision in an answer: the ring's hashes, shared, not copied.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct AnswerDecision {
    pub new_blocks: u32,
    #[serde(skip_serializing_if = "is_zero")]
    pub prompt_bytes: u32,
    #[serde(serialize_with = "hash_list")]
    pub hashes: Arc<[u64]>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub session: Option<u64>,
    #[serde(skip_serializing_if = "is_false")]
    pub session_moved: bool,
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

fn is_false(b: &bool) -> bool {
    !*b
}

fn hash_list<S: Serializer>(h: &Arc<[u64]>, s: S) -> Result<S::Ok, S::Error> {
    s.collect_seq(h.iter())
}

/// A `POST /mesh/exchange` answer.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct ExchangeAnswer {
    /// The relay's mesh epoch (random, nonzero, new at each start).
    pub epoch: u64,
    /// The asker's next `after`: the seq of the last decision considered
    /// (its own included), else the cursor it had (oldest retained − 1
    /// when it had none or resynced).
    pub seq: u64,
    /// The newest seq in the ring (0 when nothing was ever posted).
    pub last: u64,
    /// The cursor was from another epoch or fell off the ring: the answer
    /// starts at the oldest retained decision.
    pub resync: bool,
    /// Decisions with seq > `seq` remain.
    pub more: bool,
    pub load: LoadSum,
    /// Other proxies' decisions after the cursor, oldest first.
    pub decisions: Vec<AnswerDecision>,
}

/// Why a request was refused (the HTTP side: 413, 400). Nothing was applied.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RequestError {
    /// Over `max_body_bytes`.
    TooLarge { bytes: usize, max: usize },
    /// Not a valid request; the message says why.
    Bad(String),
}

impl std::fmt::Display for RequestError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RequestError::TooLarge { bytes, max } => {
                write!(f, "body of {bytes} bytes is over the bound of {max} bytes")
            }
            RequestError::Bad(m) => f.write_str(m),
        }
    }
}

/// Whether `id` is a proxy id: 1 to 64 characters of `[0-9A-Za-z_.:-]`.
pub fn valid_proxy_id(id: &str) -> bool {
    (1..=MAX_PROXY_ID_LEN).contains(&id.len())
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"_.:-".contains(&b))
}

/// Reads a request body: JSON within `max_body_bytes`, a valid proxy id,
/// and the per-request bounds. Never panics; allocation is bounded by a
/// multiple of the body's size.
pub fn parse_request(body: &[u8], limits: &MeshLimits) -> Result<ExchangeRequest, RequestError> {
    if body.len() > limits.max_body_bytes {
        return Err(RequestError::TooLarge {
            bytes: body.len(),
            max: limits.max_body_bytes,
        });
    }
    let req: ExchangeRequest =
        serde_json::from_slice(body).map_err(|e| RequestError::Bad(format!("bad JSON: {e}")))?;
    if !valid_proxy_id(&req.proxy) {
        return Err(RequestError::Bad(format!(
            "proxy {:?}: expected 1 to {MAX_PROXY_ID_LEN} characters of [0-9A-Za-z_.:-]",
            req.proxy
        )));
    }
    let decisions = req.decisions.as_deref().unwrap_or_default();
    if decisions.len() > MAX_REQUEST_DECISIONS {
        return Err(RequestError::Bad(format!(
            "{} decisions: at most {MAX_REQUEST_DECISIONS} per request",
            decisions.len()
        )));
    }
    let mut total = 0usize;
    for (i, d) in decisions.iter().enumerate() {
        if d.hashes.len() > MAX_DECISION_HASHES {
            return Err(RequestError::Bad(format!(
                "decisions[{i}]: {} hashes, at most {MAX_DECISION_HASHES} per decision",
                d.hashes.len()
            )));
        }
        total += d.hashes.len();
    }
    if total > MAX_REQUEST_HASHES {
        return Err(RequestError::Bad(format!(
            "{total} hashes: at most {MAX_REQUEST_HASHES} per request"
        )));
    }
    Ok(req)
}

/// A decision in the ring.
#[derive(Clone, Debug)]
struct Entry {
    seq: u64,
    proxy: Arc<str>,
    new_blocks: u32,
    prompt_bytes: u32,
    hashes: Arc<[u64]>,
    session: Option<u64>,
    session_moved: bool,
}

/// A proxy's load, until `expires`.
#[derive(Clone, Copy, Debug)]
struct LoadEntry {
    load: Load,
    expires: Instant,
}

/// Counters for `/metrics`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct MeshCounts {
    /// Exchanges answered.
    pub posts: u64,
    /// Requests refused (400, 413, or a body not complete in time).
    pub bad_requests: u64,
    /// Decisions appended to the ring.
    pub decisions: u64,
    /// Decisions dropped from the ring at its bounds.
    pub decisions_dropped: u64,
    /// Answers with `resync`.
    pub resyncs: u64,
    /// Decisions dropped because the server lost its cache.
    pub decisions_voided: u64,
}

/// The mesh exchange's whole state.
#[derive(Debug)]
pub struct MeshState {
    limits: MeshLimits,
    epoch: u64,
    /// Newest seq given to a decision (0: none yet).
    last: u64,
    ring: VecDeque<Entry>,
    ring_hashes: usize,
    loads: HashMap<Arc<str>, LoadEntry>,
    /// The relay's cache-loss count when last seen.
    cache_losses: u64,
    pub counts: MeshCounts,
}

impl MeshState {
    /// `epoch` should be random and nonzero ([`crate::new_mesh_epoch`]);
    /// 0 is taken as 1. Bounds of 0 are taken as 1.
    pub fn new(limits: MeshLimits, epoch: u64) -> MeshState {
        MeshState {
            limits: MeshLimits {
                ring_decisions: limits.ring_decisions.max(1),
                ring_hashes: limits.ring_hashes.max(1),
                max_proxies: limits.max_proxies.max(1),
                max_body_bytes: limits.max_body_bytes.max(1),
            },
            epoch: epoch.max(1),
            last: 0,
            ring: VecDeque::new(),
            ring_hashes: 0,
            loads: HashMap::new(),
            cache_losses: 0,
            counts: MeshCounts::default(),
        }
    }

    pub fn limits(&self) -> &MeshLimits {
        &self.limits
    }

    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// The newest seq given to a decision.
    pub fn last(&self) -> u64 {
        self.last
    }

    /// The oldest retained decision's seq (`last + 1` when the ring is empty).
    pub fn oldest(&self) -> u64 {
        self.ring.front().map_or(self.last + 1, |e| e.seq)
    }

    pub fn ring_len(&self) -> usize {
        self.ring.len()
    }

    pub fn ring_hash_count(&self) -> usize {
        self.ring_hashes
    }

    /// Load entries held, expired or not.
    pub fn load_entries(&self) -> usize {
        self.loads.len()
    }

    /// Unexpired load entries at `now`.
    pub fn proxies(&self, now: Instant) -> usize {
        self.loads.values().filter(|e| e.expires > now).count()
    }

    /// The server's cache-loss count (`Relay::cache_losses`): when it moved,
    /// every decision held is void (the blocks they placed are gone) and is
    /// dropped, so no proxy learns them from the backlog. Seqs go on.
    pub fn note_cache_losses(&mut self, losses: u64) {
        if losses != self.cache_losses {
            self.cache_losses = losses;
            self.counts.decisions_voided += self.ring.len() as u64;
            self.ring.clear();
            self.ring_hashes = 0;
        }
    }

    /// A request refused before it reached the state.
    pub fn note_bad_request(&mut self) {
        self.counts.bad_requests += 1;
    }

    /// One exchange: stores the asker's load, appends its decisions, then
    /// answers with the others' decisions after its cursor and the sum of
    /// their load. Takes any request (bounds are [`parse_request`]'s; the
    /// ring stays within its own whatever comes here).
    pub fn exchange(&mut self, req: ExchangeRequest, now: Instant) -> ExchangeAnswer {
        self.counts.posts += 1;
        let proxy: Arc<str> = Arc::from(req.proxy.as_str());
        // Expired entries go first, so a full table makes room by them.
        self.loads.retain(|_, e| e.expires > now);
        if let Some(load) = req.load {
            let ttl = req
                .ttl_ms
                .unwrap_or(DEFAULT_TTL_MS)
                .clamp(MIN_TTL_MS, MAX_TTL_MS);
            self.store_load(&proxy, load, now + Duration::from_millis(ttl));
        }
        for d in req.decisions.unwrap_or_default() {
            self.append(&proxy, d);
        }

        let oldest = self.oldest();
        let (start, resync) = match req.after {
            None => (oldest - 1, false),
            Some(after)
                if req.epoch == Some(self.epoch) && after <= self.last && after + 1 >= oldest =>
            {
                (after, false)
            }
            // Another epoch (or none given with `after`), fell off the
            // ring, or past the newest seq: start at the oldest retained.
            Some(_) => (oldest - 1, true),
        };
        if resync {
            self.counts.resyncs += 1;
        }
        let limit = req.limit.unwrap_or(DEFAULT_LIMIT).clamp(1, MAX_LIMIT) as usize;
        let mut decisions = Vec::new();
        let mut hashes = 0usize;
        let mut seq = start;
        let mut more = false;
        // Ring seqs are consecutive: the first after `start` is at a known
        // offset (at most the ring's length: `start` ≤ `last`).
        let skip = (start + 1 - oldest) as usize;
        for e in self.ring.range(skip..) {
            if e.proxy == proxy {
                // The asker's own: considered, not returned.
                seq = e.seq;
                continue;
            }
            let fits = decisions.is_empty()
                || (decisions.len() < limit && hashes + e.hashes.len() <= MAX_ANSWER_HASHES);
            if !fits {
                more = true;
                break;
            }
            hashes += e.hashes.len();
            seq = e.seq;
            decisions.push(AnswerDecision {
                new_blocks: e.new_blocks,
                prompt_bytes: e.prompt_bytes,
                hashes: e.hashes.clone(),
                session: e.session,
                session_moved: e.session.is_some() && e.session_moved,
            });
        }

        ExchangeAnswer {
            epoch: self.epoch,
            seq,
            last: self.last,
            resync,
            more,
            load: self.others_load(&proxy, now),
            decisions,
        }
    }

    fn append(&mut self, proxy: &Arc<str>, d: Decision) {
        self.last += 1;
        self.counts.decisions += 1;
        self.ring_hashes += d.hashes.len();
        self.ring.push_back(Entry {
            seq: self.last,
            proxy: proxy.clone(),
            new_blocks: d.new_blocks,
            prompt_bytes: d.prompt_bytes,
            hashes: d.hashes.into(),
            session: d.session,
            session_moved: d.session_moved,
        });
        while self.ring.len() > self.limits.ring_decisions
            || self.ring_hashes > self.limits.ring_hashes
        {
            let Some(old) = self.ring.pop_front() else {
                break;
            };
            self.ring_hashes -= old.hashes.len();
            self.counts.decisions_dropped += 1;
        }
    }

    /// Stores `proxy`'s load (expired entries were purged just before).
    fn store_load(&mut self, proxy: &Arc<str>, load: Load, expires: Instant) {
        let entry = LoadEntry { load, expires };
        if let Some(e) = self.loads.get_mut(proxy) {
            *e = entry;
            return;
        }
        if self.loads.len() >= self.limits.max_proxies {
            // Full of unexpired entries: replace the one expiring soonest
            // (the smallest id among equals, so that the choice does not
            // depend on the map's order).
            if let Some(k) = self
                .loads
                .iter()
                .min_by(|(ka, a), (kb, b)| a.expires.cmp(&b.expires).then_with(|| ka.cmp(kb)))
                .map(|(k, _)| k.clone())
            {
                self.loads.remove(&k);
            }
        }
        self.loads.insert(proxy.clone(), entry);
    }

    /// Prometheus text for `/metrics`.
    pub fn metrics(&self, now: Instant) -> String {
        use std::fmt::Write as _;
        let c = &self.counts;
        let mut out = String::new();
        let mut line = |name: &str, kind: &str, help: &str, v: u64| {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {v}"
            );
        };
        line(
            "kvroute_relay_mesh_posts_total",
            "counter",
            "Mesh exchanges answered.",
            c.posts,
        );
        line(
            "kvroute_relay_mesh_bad_requests_total",
            "counter",
            "Mesh exchange requests refused (400, 413, 408).",
            c.bad_requests,
        );
        line(
            "kvroute_relay_mesh_decisions_total",
            "counter",
            "Decisions appended to the mesh ring.",
            c.decisions,
        );
        line(
            "kvroute_relay_mesh_decisions_dropped_total",
            "counter",
            "Decisions dropped from the mesh ring at its bounds.",
            c.decisions_dropped,
        );
        line(
            "kvroute_relay_mesh_decisions_voided_total",
            "counter",
            "Decisions dropped from the mesh ring because the server lost its cache.",
            c.decisions_voided,
        );
        line(
            "kvroute_relay_mesh_resyncs_total",
            "counter",
            "Mesh exchange answers with resync.",
            c.resyncs,
        );
        line(
            "kvroute_relay_mesh_ring_decisions",
            "gauge",
            "Decisions in the mesh ring.",
            self.ring.len() as u64,
        );
        line(
            "kvroute_relay_mesh_ring_hashes",
            "gauge",
            "Hashes in the mesh ring.",
            self.ring_hashes as u64,
        );
        line(
            "kvroute_relay_mesh_proxies",
            "gauge",
            "Unexpired mesh load entries.",
            self.proxies(now) as u64,
        );
        out
    }

    /// The other proxies' unexpired load, summed.
    fn others_load(&self, proxy: &Arc<str>, now: Instant) -> LoadSum {
        let mut sum = LoadSum::default();
        let mut requests = 0u64;
        for (k, e) in &self.loads {
            if e.expires <= now || k == proxy {
                continue;
            }
            sum.prompt = sum.prompt.saturating_add(e.load.prompt);
            sum.output = sum.output.saturating_add(e.load.output);
            requests = requests.saturating_add(u64::from(e.load.requests));
            sum.proxies += 1;
        }
        sum.requests = requests.min(u64::from(u32::MAX)) as u32;
        sum
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const EPOCH: u64 = 0xE90C;

    fn state(limits: MeshLimits) -> MeshState {
        MeshState::new(limits, EPOCH)
    }

    fn d(new_blocks: u32, hashes: &[u64]) -> Decision {
        Decision {
            new_blocks,
            hashes: hashes.to_vec(),
            ..Decision::default()
        }
    }

    fn req(proxy: &str) -> ExchangeRequest {
        ExchangeRequest {
            proxy: proxy.into(),
            ..ExchangeRequest::default()
        }
    }

    /// A request with the cursor `(EPOCH, after)`.
    fn at(proxy: &str, after: u64) -> ExchangeRequest {
        ExchangeRequest {
            epoch: Some(EPOCH),
            after: Some(after),
            ..req(proxy)
        }
    }

    fn posting(mut r: ExchangeRequest, decisions: Vec<Decision>) -> ExchangeRequest {
        r.decisions = Some(decisions);
        r
    }

    fn hashes(a: &ExchangeAnswer) -> Vec<Vec<u64>> {
        a.decisions.iter().map(|d| d.hashes.to_vec()).collect()
    }

    fn load(prompt: u64, output: u64, requests: u32) -> Load {
        Load {
            prompt,
            output,
            requests,
        }
    }

    #[test]
    fn a_decisions_prompt_bytes_reach_the_others_also_without_hashes() {
        let mut m = state(MeshLimits::default());
        let t = Instant::now();
        let bytes_only = Decision {
            new_blocks: 0,
            prompt_bytes: 9000,
            hashes: vec![],
            ..Decision::default()
        };
        m.exchange(posting(req("a"), vec![bytes_only, d(2, &[5])]), t);
        let b = m.exchange(req("b"), t);
        let got: Vec<(u32, u32, usize)> = b
            .decisions
            .iter()
            .map(|d| (d.new_blocks, d.prompt_bytes, d.hashes.len()))
            .collect();
        assert_eq!(got, vec![(0, 9000, 0), (2, 0, 1)]);
        let json = serde_json::to_string(&b).unwrap();
        assert!(
            json.contains(r#"{"newBlocks":0,"promptBytes":9000,"hashes":[]}"#),
            "{json}"
        );
        assert!(json.contains(r#"{"newBlocks":2,"hashes":[5]}"#), "{json}");
    }

    #[test]
    fn a_decisions_session_reaches_the_others_as_posted() {
        let mut m = state(MeshLimits::default());
        let t = Instant::now();
        let body = br#"{"proxy":"a","decisions":[
            {"newBlocks":1,"hashes":[4],"session":18446744073709551615,"sessionMoved":true},
            {"newBlocks":0,"hashes":[],"session":7},
            {"newBlocks":0,"hashes":[],"sessionMoved":true},
            {"newBlocks":2,"hashes":[5]}]}"#;
        let r = parse_request(body, &MeshLimits::default()).unwrap();
        m.exchange(r, t);
        let b = m.exchange(req("b"), t);
        let got: Vec<(Option<u64>, bool)> = b
            .decisions
            .iter()
            .map(|d| (d.session, d.session_moved))
            .collect();
        // A moved flag without a session means nothing and is not passed on.
        assert_eq!(
            got,
            vec![
                (Some(u64::MAX), true),
                (Some(7), false),
                (None, false),
                (None, false)
            ]
        );
        let json = serde_json::to_string(&b).unwrap();
        assert!(
            json.contains(
                r#"{"newBlocks":1,"hashes":[4],"session":18446744073709551615,"sessionMoved":true}"#
            ),
            "{json}"
        );
        assert!(
            json.contains(r#"{"newBlocks":0,"hashes":[],"session":7}"#),
            "{json}"
        );
        assert!(json.contains(r#"{"newBlocks":2,"hashes":[5]}"#), "{json}");
        // A session that is not a number is a bad request.
        let bad = br#"{"proxy":"a","decisions":[{"newBlocks":0,"hashes":[],"session":"x"}]}"#;
        assert!(parse_request(bad, &MeshLimits::default()).is_err());
    }

    #[test]
    fn two_proxies_see_each_others_decisions_never_their_own_and_cursors_move() {
        let mut m = state(MeshLimits::default());
        let t = Instant::now();
        // A posts two decisions with no cursor: nothing of others yet, and
        // its cursor moves past its own.
        let a1 = m.exchange(posting(req("a"), vec![d(4, &[1, 2]), d(1, &[3])]), t);
        assert_eq!(
            (a1.epoch, a1.seq, a1.last, a1.resync, a1.more),
            (EPOCH, 2, 2, false, false)
        );
        assert!(a1.decisions.is_empty());
        // B, new: A's two, oldest first.
        let b1 = m.exchange(req("b"), t);
        assert_eq!(hashes(&b1), vec![vec![1, 2], vec![3]]);
        assert_eq!(b1.decisions[0].new_blocks, 4);
        assert_eq!((b1.seq, b1.last, b1.resync, b1.more), (2, 2, false, false));
        // B posts one; A asks from its cursor: B's, and not its own.
        let b2 = m.exchange(posting(at("b", b1.seq), vec![d(2, &[9])]), t);
        assert!(b2.decisions.is_empty(), "B's own came back: {b2:?}");
        assert_eq!(b2.seq, 3);
        let a2 = m.exchange(posting(at("a", a1.seq), vec![d(7, &[5])]), t);
        assert_eq!(hashes(&a2), vec![vec![9]]);
        // Its own new one (seq 4) counts as considered.
        assert_eq!((a2.seq, a2.last), (4, 4));
        // Caught up: nothing for A; B gets A's seq 4 only.
        assert!(m.exchange(at("a", a2.seq), t).decisions.is_empty());
        let b3 = m.exchange(at("b", b2.seq), t);
        assert_eq!(hashes(&b3), vec![vec![5]]);
        assert_eq!(b3.seq, 4);
        assert_eq!(m.counts.decisions, 4);
        assert_eq!(m.counts.posts, 6);
    }

    /// A server that lost its cache voids every decision held: a proxy
    /// new after the loss learns none of them; cursors carry on.
    #[test]
    fn a_lost_cache_voids_the_decisions_held() {
        let mut m = state(MeshLimits::default());
        let t = Instant::now();
        m.note_cache_losses(0);
        let a1 = m.exchange(posting(req("a"), vec![d(4, &[1, 2]), d(1, &[3])]), t);
        assert_eq!(a1.seq, 2);
        m.note_cache_losses(0);
        assert_eq!(m.ring_len(), 2, "no loss: kept");
        m.note_cache_losses(1);
        assert_eq!((m.ring_len(), m.ring_hash_count()), (0, 0));
        assert_eq!(m.counts.decisions_voided, 2);
        let b = m.exchange(req("b"), t);
        assert!(b.decisions.is_empty(), "{b:?}");
        // A posts on from its cursor; B's cursor sees only the new one.
        let a2 = m.exchange(posting(at("a", a1.seq), vec![d(2, &[9])]), t);
        assert_eq!((a2.seq, a2.resync), (3, false));
        let b2 = m.exchange(at("b", b.seq), t);
        assert_eq!(hashes(&b2), vec![vec![9]]);
        assert!(!b2.resync);
        assert!(m
            .metrics(t)
            .contains("kvroute_relay_mesh_decisions_voided_total 2"));
    }

    #[test]
    fn load_sums_exclude_the_asker_and_expire_after_their_ttl() {
        let mut m = state(MeshLimits::default());
        let t = Instant::now();
        let mut a = req("a");
        a.load = Some(load(1000, 100, 2));
        a.ttl_ms = Some(1000);
        m.exchange(a.clone(), t);
        let mut b = req("b");
        b.load = Some(load(300, 30, 1));
        // B's default ttl: 2 s.
        let sum = m.exchange(b, t).load;
        assert_eq!(
            sum,
            LoadSum {
                prompt: 1000,
                output: 100,
                requests: 2,
                proxies: 1
            }
        );
        // C sees both; A sees B only.
        let c = m.exchange(req("c"), t + Duration::from_millis(500)).load;
        assert_eq!(
            c,
            LoadSum {
                prompt: 1300,
                output: 130,
                requests: 3,
                proxies: 2
            }
        );
        let mut a_again = req("a");
        a_again.load = Some(load(10, 1, 1));
        a_again.ttl_ms = Some(1000);
        assert_eq!(m.exchange(a_again, t).load.prompt, 300);
        // A's entry replaced its old one (10, not 1000), and expires at 1 s.
        assert_eq!(
            m.exchange(req("c"), t + Duration::from_millis(999))
                .load
                .prompt,
            310
        );
        assert_eq!(
            m.exchange(req("c"), t + Duration::from_millis(1000))
                .load
                .prompt,
            300
        );
        assert_eq!(m.proxies(t + Duration::from_millis(1500)), 1);
        // B's 2 s: gone at 2 s.
        let late = m.exchange(req("c"), t + Duration::from_millis(2000)).load;
        assert_eq!(late, LoadSum::default());
        // A post without load leaves the previous entry to expire.
        let mut d1 = req("d");
        d1.load = Some(load(50, 5, 1));
        let t3 = t + Duration::from_secs(3);
        m.exchange(d1, t3);
        m.exchange(req("d"), t3 + Duration::from_millis(100));
        assert_eq!(
            m.exchange(req("c"), t3 + Duration::from_millis(1999))
                .load
                .prompt,
            50
        );
        assert_eq!(
            m.exchange(req("c"), t3 + Duration::from_millis(2000))
                .load
                .proxies,
            0
        );
    }

    #[test]
    fn ttl_is_clamped() {
        let mut m = state(MeshLimits::default());
        let t = Instant::now();
        for (proxy, ttl) in [("short", 1), ("long", u64::MAX)] {
            let mut r = req(proxy);
            r.load = Some(load(1, 0, 0));
            r.ttl_ms = Some(ttl);
            m.exchange(r, t);
        }
        let at = |m: &mut MeshState, ms| {
            m.exchange(req("x"), t + Duration::from_millis(ms))
                .load
                .proxies
        };
        assert_eq!(at(&mut m, 99), 2);
        assert_eq!(at(&mut m, 100), 1);
        assert_eq!(at(&mut m, 59_999), 1);
        assert_eq!(at(&mut m, 60_000), 0);
    }

    #[test]
    fn the_ring_drops_its_oldest_within_both_bounds_and_a_cursor_that_fell_off_resyncs() {
        let limits = MeshLimits {
            ring_decisions: 4,
            ring_hashes: 10,
            ..MeshLimits::default()
        };
        let mut m = state(limits);
        let t = Instant::now();
        // Six decisions of one hash: the first two are dropped (4 at most).
        let a = m.exchange(posting(req("a"), (1..=6).map(|h| d(1, &[h])).collect()), t);
        assert_eq!((a.seq, a.last), (6, 6));
        assert_eq!(
            (m.ring_len(), m.oldest(), m.counts.decisions_dropped),
            (4, 3, 2)
        );
        // B read up to 1: seq 2 is gone, so it resyncs from the oldest (3).
        let b = m.exchange(at("b", 1), t);
        assert!(b.resync);
        assert_eq!(hashes(&b), vec![vec![3], vec![4], vec![5], vec![6]]);
        assert_eq!(b.seq, 6);
        // A cursor at oldest − 1 is still good.
        let c = m.exchange(at("c", 2), t);
        assert!(!c.resync);
        assert_eq!(c.decisions.len(), 4);
        // The hash bound: one decision of 8 hashes leaves room for 2 more.
        m.exchange(posting(req("a"), vec![d(8, &[7; 8])]), t);
        assert!(m.ring_hash_count() <= 10);
        assert_eq!((m.ring_len(), m.ring_hash_count(), m.oldest()), (3, 10, 5));
        // A decision over the whole hash bound is dropped at once.
        m.exchange(posting(req("a"), vec![d(11, &[1; 11])]), t);
        assert_eq!((m.ring_len(), m.ring_hash_count(), m.last()), (0, 0, 8));
        // Empty ring: a cursor at `last` is fine, one before it resyncs.
        let e = m.exchange(at("b", 8), t);
        assert_eq!((e.seq, e.resync, e.decisions.len()), (8, false, 0));
        let f = m.exchange(at("b", 7), t);
        assert_eq!((f.seq, f.resync), (8, true));
        assert_eq!(m.counts.resyncs, 2);
    }

    #[test]
    fn another_epoch_or_a_cursor_past_the_newest_resyncs_from_the_oldest() {
        let mut m = state(MeshLimits::default());
        let t = Instant::now();
        m.exchange(posting(req("a"), vec![d(1, &[1]), d(1, &[2])]), t);
        let mut other = at("b", 1);
        other.epoch = Some(EPOCH + 1);
        let b = m.exchange(other, t);
        assert!(b.resync);
        assert_eq!(hashes(&b), vec![vec![1], vec![2]]);
        // `after` without an epoch cannot be checked: resync too.
        let mut no_epoch = at("b", 1);
        no_epoch.epoch = None;
        assert!(m.exchange(no_epoch, t).resync);
        // A cursor beyond `last` (from a relay that had more): resync.
        let ahead = m.exchange(at("b", 5), t);
        assert!(ahead.resync);
        assert_eq!(ahead.seq, 2);
        // No cursor at all (an epoch alone is none): the backlog, no resync.
        let mut epoch_only = req("c");
        epoch_only.epoch = Some(EPOCH);
        let c = m.exchange(epoch_only, t);
        assert!(!c.resync);
        assert_eq!(c.decisions.len(), 2);
        // The good cursor is served from where it is.
        let good = m.exchange(at("b", 1), t);
        assert_eq!((good.resync, hashes(&good)), (false, vec![vec![2]]));
    }

    #[test]
    fn limit_pages_with_more_and_skips_the_askers_own_past_the_limit() {
        let mut m = state(MeshLimits::default());
        let t = Instant::now();
        m.exchange(posting(req("a"), (1..=5).map(|h| d(1, &[h])).collect()), t);
        // B's own after A's five.
        m.exchange(posting(at("b", 5), vec![d(1, &[100]), d(1, &[101])]), t);
        let mut r = req("b");
        r.limit = Some(2);
        let p1 = m.exchange(r.clone(), t);
        assert_eq!(
            (hashes(&p1), p1.seq, p1.more),
            (vec![vec![1], vec![2]], 2, true)
        );
        r.epoch = Some(EPOCH);
        r.after = Some(p1.seq);
        let p2 = m.exchange(r.clone(), t);
        assert_eq!(
            (hashes(&p2), p2.seq, p2.more),
            (vec![vec![3], vec![4]], 4, true)
        );
        r.after = Some(p2.seq);
        // A's 5th, then B's own two are considered: the cursor ends at 7.
        let p3 = m.exchange(r.clone(), t);
        assert_eq!(
            (hashes(&p3), p3.seq, p3.more, p3.last),
            (vec![vec![5]], 7, false, 7)
        );
        // limit 0 is clamped to 1; a huge limit to 4096.
        r.after = Some(0);
        r.limit = Some(0);
        assert_eq!(m.exchange(r.clone(), t).decisions.len(), 1);
        r.limit = Some(u64::MAX);
        let all = m.exchange(r, t);
        assert_eq!((all.decisions.len(), all.more), (5, false));
    }

    #[test]
    fn answers_hold_at_most_max_answer_hashes_but_one_decision() {
        let mut m = state(MeshLimits::default());
        let t = Instant::now();
        let big: Vec<u64> = (0..MAX_DECISION_HASHES as u64).collect();
        // 17 decisions of 4096 hashes: 16 fit in 65,536.
        for _ in 0..17 {
            m.exchange(posting(req("a"), vec![d(1, &big)]), t);
        }
        let b = m.exchange(req("b"), t);
        assert_eq!((b.decisions.len(), b.more, b.seq), (16, true, 16));
        let rest = m.exchange(at("b", b.seq), t);
        assert_eq!((rest.decisions.len(), rest.more), (1, false));
    }

    #[test]
    fn u64_hashes_round_trip_through_json_exactly() {
        let near_max = [
            u64::MAX,
            u64::MAX - 1,
            (1 << 53) + 1,
            0,
            9_007_199_254_740_993,
        ];
        let body = format!(
            r#"{{"proxy":"a","decisions":[{{"newBlocks":4294967295,"hashes":[{}]}}],"unknown":{{"x":[1.5]}}}}"#,
            near_max.map(|h| h.to_string()).join(",")
        );
        let r = parse_request(body.as_bytes(), &MeshLimits::default()).unwrap();
        assert_eq!(r.decisions.as_ref().unwrap()[0].hashes, near_max);
        let mut m = state(MeshLimits::default());
        let t = Instant::now();
        m.exchange(r, t);
        let answer = serde_json::to_string(&m.exchange(req("b"), t)).unwrap();
        let v: serde_json::Value = serde_json::from_str(&answer).unwrap();
        let back: Vec<u64> = v["decisions"][0]["hashes"]
            .as_array()
            .unwrap()
            .iter()
            .map(|h| h.as_u64().unwrap())
            .collect();
        assert_eq!(back, near_max);
        assert_eq!(
            v["decisions"][0]["newBlocks"].as_u64(),
            Some(u64::from(u32::MAX))
        );
        assert!(answer.contains("18446744073709551615"), "{answer}");
        assert_eq!(v["epoch"].as_u64(), Some(EPOCH));
    }

    #[test]
    fn the_load_table_stays_within_max_proxies() {
        let limits = MeshLimits {
            max_proxies: 3,
            ..MeshLimits::default()
        };
        let mut m = state(limits);
        let t = Instant::now();
        let post = |m: &mut MeshState, p: &str, ttl: u64, at: u64| {
            let mut r = req(p);
            r.load = Some(load(1, 0, 1));
            r.ttl_ms = Some(ttl);
            m.exchange(r, t + Duration::from_millis(at))
        };
        post(&mut m, "a", 5000, 0);
        post(&mut m, "b", 1000, 0);
        post(&mut m, "c", 3000, 0);
        // Full, nothing expired: d replaces b (expiring soonest).
        let d_answer = post(&mut m, "d", 3000, 10);
        assert_eq!(d_answer.load.proxies, 2);
        assert_eq!(m.load_entries(), 3);
        let x = m.exchange(req("x"), t + Duration::from_millis(20)).load;
        assert_eq!(x.proxies, 3);
        // A proxy already present is updated in place, nothing is evicted.
        post(&mut m, "a", 5000, 30);
        assert_eq!(
            m.exchange(req("x"), t + Duration::from_millis(40))
                .load
                .proxies,
            3
        );
        // At 3.5 s, c and d expired: e takes a purged place, a stays.
        post(&mut m, "e", 5000, 3500);
        assert_eq!(m.load_entries(), 2);
        // Hundreds of proxies: never more than 3 entries.
        for i in 0..500 {
            post(&mut m, &format!("p{i}"), 60_000, 4000);
            assert!(m.load_entries() <= 3);
        }
    }

    #[test]
    fn requests_over_a_bound_or_malformed_are_refused() {
        let l = MeshLimits::default();
        let bad = |body: &str| match parse_request(body.as_bytes(), &l) {
            Err(RequestError::Bad(m)) => m,
            other => panic!("{body}: {other:?}"),
        };
        bad("");
        bad("garbage");
        bad("[]");
        bad(r#"{"epoch":1}"#);
        assert!(bad(r#"{"proxy":""}"#).contains("proxy"));
        bad(&format!(r#"{{"proxy":"{}"}}"#, "a".repeat(65)));
        bad(r#"{"proxy":"a b"}"#);
        bad(r#"{"proxy":"é"}"#);
        bad(r#"{"proxy":"a","after":-1}"#);
        bad(r#"{"proxy":"a","after":1.5}"#);
        bad(r#"{"proxy":"a","epoch":18446744073709551616}"#);
        bad(r#"{"proxy":"a","load":{"prompt":1,"output":1,"requests":4294967296}}"#);
        bad(r#"{"proxy":"a","load":{"prompt":1}}"#);
        bad(r#"{"proxy":"a","decisions":[{"hashes":[1]}]}"#);
        bad(r#"{"proxy":"a","decisions":[{"newBlocks":1,"hashes":["1"]}]}"#);
        bad(r#"{"proxy":"a","proxy":"b"}"#);
        let many = |n: usize, h: usize| {
            let one = format!(r#"{{"newBlocks":1,"hashes":[{}]}}"#, vec!["7"; h].join(","));
            format!(
                r#"{{"proxy":"a","decisions":[{}]}}"#,
                vec![one; n].join(",")
            )
        };
        assert!(parse_request(many(1024, 64).as_bytes(), &l).is_ok());
        assert!(bad(&many(1025, 0)).contains("1025 decisions"));
        assert!(parse_request(many(1, 4096).as_bytes(), &l).is_ok());
        assert!(bad(&many(1, 4097)).contains("4097 hashes"));
        assert!(parse_request(many(16, 4096).as_bytes(), &l).is_ok());
        assert!(bad(&many(17, 4096)).contains("69632 hashes"));
        // Size first.
        let small = MeshLimits {
            max_body_bytes: 10,
            ..l
        };
        assert_eq!(
            parse_request(br#"{"proxy":"ab"}"#, &small),
            Err(RequestError::TooLarge { bytes: 14, max: 10 })
        );
        // Good ones: the minimum, nulls for absent, all id characters.
        assert_eq!(parse_request(br#"{"proxy":"a"}"#, &l).unwrap(), req("a"));
        let id = "09azAZ_.:-".repeat(6) + "abcd";
        assert_eq!(id.len(), 64);
        let r = parse_request(
            format!(r#"{{"proxy":"{id}","epoch":null,"load":null,"decisions":null}}"#).as_bytes(),
            &l,
        )
        .unwrap();
        assert_eq!(r.proxy, id);
    }

    #[test]
    fn the_metrics_follow_the_state() {
        let mut m = state(MeshLimits {
            ring_decisions: 2,
            ..MeshLimits::default()
        });
        let t = Instant::now();
        let mut r = posting(req("a"), vec![d(1, &[1, 2]), d(1, &[3]), d(1, &[4, 5, 6])]);
        r.load = Some(load(1, 1, 1));
        m.exchange(r, t);
        m.note_bad_request();
        let text = m.metrics(t);
        let value = |name: &str| -> u64 {
            text.lines()
                .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
                .unwrap_or_else(|| panic!("{name} missing:\n{text}"))
        };
        assert_eq!(value("kvroute_relay_mesh_posts_total"), 1);
        assert_eq!(value("kvroute_relay_mesh_bad_requests_total"), 1);
        assert_eq!(value("kvroute_relay_mesh_decisions_total"), 3);
        assert_eq!(value("kvroute_relay_mesh_decisions_dropped_total"), 1);
        assert_eq!(value("kvroute_relay_mesh_ring_decisions"), 2);
        assert_eq!(value("kvroute_relay_mesh_ring_hashes"), 4);
        assert_eq!(value("kvroute_relay_mesh_proxies"), 1);
        let later = m.metrics(t + Duration::from_secs(3));
        assert!(later.contains("kvroute_relay_mesh_proxies 0"), "{later}");
    }
}

//! The relay's state machine: sequence tracking, the ring of recent batches,
//! the snapshot of held blocks, counters, and the JSON the HTTP endpoints
//! return. Plain, synchronous Rust; the sockets (`subscriber`, `http`) are
//! thin around it.
//!
//! Two sequence numbers are in play:
//! - the **upstream** seq, vLLM's 8-byte frame counter (from 0 at each
//!   publisher start), used only to detect gaps and restarts;
//! - the relay's own **seq**, +1 per accepted batch, never going back for the
//!   relay's lifetime. `GET /kv/events?after=SEQ` and `/kv/snapshot` speak in
//!   it, so a publisher restart does not make the collector's cursor jump back.
//!
//! A **resync point** is a relay seq from which the history before it cannot
//! be replayed: after a gap that replay did not fill, a publisher restart, or
//! a payload that did not decode. A collector whose cursor is before the
//! newest resync point (or before the ring's oldest batch) is told `resync`
//! and reloads `/kv/snapshot`.

use kvroute_kv_events::{decode_seq, KvEvent, KvEventBatch};
use serde::Serialize;
use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

/// Memory bounds.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    /// Most hashes in the snapshot: the server's `num_gpu_blocks`.
    pub max_blocks: usize,
    /// Most batches kept in the ring.
    pub ring_batches: usize,
    /// Most hashes kept across all batches in the ring.
    pub ring_hashes: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_blocks: 65_536,
            ring_batches: 4_096,
            ring_hashes: 262_144,
        }
    }
}

/// What `GET /healthz` requires of the subscription.
///
/// vLLM's publisher sends nothing while no block changes and has no
/// heartbeat, so silence alone cannot tell an idle server from a dead one.
/// The primary signal is the SUB socket's connection to the publisher (the
/// `zeromq` socket monitor's `Connected`/`Disconnected`): the publisher sits
/// in the same pod, so its process dying closes the connection at once.
#[derive(Clone, Copy, Debug)]
pub struct HealthPolicy {
    /// A disconnect shorter than this is still healthy: the SUB socket
    /// reconnects by itself.
    pub grace: Duration,
    /// When set, a connected subscription is also unhealthy after this long
    /// without a message (for publishers known to be busy, or that send
    /// heartbeats; vLLM's does not). `None`: off.
    pub max_silence: Option<Duration>,
}

impl Default for HealthPolicy {
    fn default() -> Self {
        HealthPolicy {
            grace: Duration::from_secs(5),
            max_silence: None,
        }
    }
}

/// The subscription's connection, as the socket monitor reports it.
#[derive(Clone, Copy, Debug, Default)]
struct Link {
    connected: bool,
    /// When `connected` last changed; `None`: never connected.
    changed: Option<Instant>,
    /// When the newest message (good or bad) arrived.
    last_message: Option<Instant>,
}

/// One operation of a batch, in the batch's event order. Consecutive events
/// of the same kind in one batch are merged.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(tag = "op", rename_all = "lowercase")]
pub enum Op {
    Stored { hashes: Vec<u64> },
    Removed { hashes: Vec<u64> },
    Cleared,
}

impl Op {
    fn hash_count(&self) -> usize {
        match self {
            Op::Stored { hashes } | Op::Removed { hashes } => hashes.len(),
            Op::Cleared => 0,
        }
    }
}

#[derive(Clone, Debug)]
struct RingBatch {
    seq: u64,
    ops: Vec<Op>,
}

impl RingBatch {
    fn hash_count(&self) -> usize {
        self.ops.iter().map(Op::hash_count).sum()
    }
}

/// What the upstream seq of a new frame means.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SeqCheck {
    /// The first frame the relay sees.
    First,
    /// The next one expected.
    InOrder,
    /// Upstream batches `from..to` (exclusive) were missed.
    Gap { from: u64, to: u64 },
    /// The seq went back: the publisher restarted.
    Restart,
}

/// Why a frame was skipped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BadFrame {
    /// Not three frames `[topic, seq, payload]`.
    FrameCount,
    /// The seq frame is not 8 bytes.
    Seq,
    /// The payload is not a msgpack batch `[ts, events, dp_rank]`.
    Payload,
}

impl BadFrame {
    /// The `reason` label of `kvroute_relay_bad_frames_total`.
    pub fn reason(self) -> &'static str {
        match self {
            BadFrame::FrameCount => "frame_count",
            BadFrame::Seq => "seq",
            BadFrame::Payload => "payload",
        }
    }
}

/// Counters for `/metrics`.
#[derive(Clone, Debug, Default)]
pub struct Counts {
    pub batches: u64,
    pub events_stored: u64,
    pub events_removed: u64,
    pub events_cleared: u64,
    pub hashes_stored: u64,
    pub hashes_removed: u64,
    /// Events skipped inside an otherwise good batch (unknown `type`, bad field).
    pub bad_events: u64,
    pub bad_frames_frame_count: u64,
    pub bad_frames_seq: u64,
    pub bad_frames_payload: u64,
    /// Gaps detected, and the upstream batches they spanned.
    pub gaps: u64,
    pub gap_batches: u64,
    /// Gaps fully filled from the replay socket, batches replayed, and
    /// replay attempts that failed or came back short.
    pub gaps_filled: u64,
    pub replayed_batches: u64,
    pub replay_failures: u64,
    pub restarts: u64,
    /// Hashes dropped from a full snapshot (stores beyond `max_blocks`).
    pub snapshot_evictions: u64,
    /// `/kv/events` answers with `resync: true`.
    pub resyncs_served: u64,
}

/// The relay's whole state.
#[derive(Debug)]
pub struct Relay {
    limits: Limits,
    /// Relay start, unix ms: tells a collector that this is a new relay.
    epoch: u64,
    /// Newest relay seq given to a batch (0: none yet).
    seq: u64,
    /// Upstream seq expected next; `None` before the first frame.
    next_upstream: Option<u64>,
    /// Newest resync point (relay seq); cursors below it must resync.
    resync_from: u64,
    ring: VecDeque<RingBatch>,
    ring_hashes: usize,
    /// hash → insertion stamp; `order` holds (hash, stamp) oldest first,
    /// with stale entries skipped lazily and compacted when it doubles.
    blocks: HashMap<u64, u64>,
    order: VecDeque<(u64, u64)>,
    stamp: u64,
    /// The snapshot follows every batch since a clean start (upstream seq 0,
    /// or an `AllBlocksCleared`), with nothing missed or evicted.
    complete: bool,
    /// Unix seconds of the newest batch, as vLLM stamped it.
    last_batch_ts: Option<f64>,
    link: Link,
    health: HealthPolicy,
    pub counts: Counts,
}

/// `GET /kv/events` answer.
#[derive(Debug, Serialize, PartialEq)]
pub struct EventsPage {
    pub epoch: u64,
    /// Cursor for the next call: the seq of the last batch included (or
    /// `after` when none is). With `resync`, the current seq.
    pub seq: u64,
    /// The relay's newest seq.
    pub last: u64,
    pub resync: bool,
    /// More batches after `seq` than fit in `limit`.
    pub more: bool,
    /// The snapshot's completeness now (as `/kv/snapshot` would say): a
    /// collector that is caught up (`seq == last`) holds what the snapshot
    /// holds, so it may take this flag over. It turns true on a clean
    /// start (vLLM seq 0 as the first batch seen) or `AllBlocksCleared`.
    pub complete: bool,
    pub batches: Vec<PageBatch>,
}

#[derive(Debug, Serialize, PartialEq)]
pub struct PageBatch {
    pub seq: u64,
    pub ops: Vec<Op>,
}

/// `GET /kv/snapshot` answer.
#[derive(Debug, Serialize, PartialEq)]
pub struct Snapshot {
    pub epoch: u64,
    /// The seq the snapshot is at: follow with `/kv/events?after=seq`.
    pub seq: u64,
    pub complete: bool,
    /// Held hashes, oldest stored first.
    pub blocks: Vec<u64>,
}

impl Relay {
    /// How often the server lost its cache so far (an `AllBlocksCleared`,
    /// or a publisher restart): the mesh exchange drops the decisions it
    /// holds when this moves (`mesh::MeshState::note_cache_losses`).
    pub fn cache_losses(&self) -> u64 {
        self.counts.events_cleared + self.counts.restarts
    }

    pub fn new(limits: Limits, epoch: u64) -> Relay {
        let limits = Limits {
            max_blocks: limits.max_blocks.max(1),
            ring_batches: limits.ring_batches.max(1),
            ring_hashes: limits.ring_hashes.max(1),
        };
        Relay {
            limits,
            epoch,
            seq: 0,
            next_upstream: None,
            resync_from: 0,
            ring: VecDeque::new(),
            ring_hashes: 0,
            blocks: HashMap::new(),
            order: VecDeque::new(),
            stamp: 0,
            complete: false,
            last_batch_ts: None,
            link: Link::default(),
            health: HealthPolicy::default(),
            counts: Counts::default(),
        }
    }

    pub fn set_health_policy(&mut self, policy: HealthPolicy) {
        self.health = policy;
    }

    /// The SUB socket connected to (`true`) or lost (`false`) the publisher.
    pub fn note_link(&mut self, connected: bool, now: Instant) {
        if self.link.connected != connected || self.link.changed.is_none() {
            self.link.connected = connected;
            self.link.changed = Some(now);
        }
    }

    /// A message arrived from the publisher (whether or not it was good).
    pub fn note_message(&mut self, now: Instant) {
        self.link.last_message = Some(now);
    }

    pub fn publisher_connected(&self) -> bool {
        self.link.connected
    }

    /// `GET /healthz`: `Ok` with a short status, or `Err` with the reason
    /// the subscription is not live (the HTTP side answers 503).
    pub fn health(&self, now: Instant) -> Result<String, String> {
        let secs = |t: Instant| now.saturating_duration_since(t).as_secs_f64();
        let Some(changed) = self.link.changed else {
            return Err("not connected to the publisher yet".into());
        };
        if !self.link.connected {
            let down = now.saturating_duration_since(changed);
            return if down <= self.health.grace {
                Ok(format!("ok: reconnecting for {:.1} s", down.as_secs_f64()))
            } else {
                Err(format!(
                    "publisher disconnected for {:.1} s",
                    down.as_secs_f64()
                ))
            };
        }
        let heard = self.link.last_message.map_or(changed, |m| m.max(changed));
        match self.health.max_silence {
            Some(limit) if now.saturating_duration_since(heard) > limit => Err(format!(
                "connected, but no message for {:.1} s (limit {} ms)",
                secs(heard),
                limit.as_millis()
            )),
            _ => Ok(match self.link.last_message {
                Some(m) => format!("ok: connected, last message {:.1} s ago", secs(m)),
                None => "ok: connected, no message yet".into(),
            }),
        }
    }

    pub fn seq(&self) -> u64 {
        self.seq
    }

    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    pub fn complete(&self) -> bool {
        self.complete
    }

    pub fn block_count(&self) -> usize {
        self.blocks.len()
    }

    pub fn ring_len(&self) -> usize {
        self.ring.len()
    }

    pub fn ring_hash_count(&self) -> usize {
        self.ring_hashes
    }

    /// The next upstream seq the relay expects (for a replay request).
    pub fn next_upstream(&self) -> Option<u64> {
        self.next_upstream
    }

    /// Classifies an upstream seq against what came before.
    pub fn check(&self, upstream: u64) -> SeqCheck {
        match self.next_upstream {
            None => SeqCheck::First,
            Some(n) if upstream == n => SeqCheck::InOrder,
            Some(n) if upstream > n => SeqCheck::Gap {
                from: n,
                to: upstream,
            },
            Some(_) => SeqCheck::Restart,
        }
    }

    /// Counts a gap that the replay socket filled (its batches went through
    /// `ingest_payload` in order, so it was not seen as a gap there).
    pub fn note_gap_filled(&mut self, from: u64, to: u64) {
        self.counts.gaps += 1;
        self.counts.gap_batches = self
            .counts
            .gap_batches
            .saturating_add(to.saturating_sub(from));
        self.counts.gaps_filled += 1;
    }

    /// Counts a frame that was skipped before its seq could be read.
    pub fn count_bad(&mut self, why: BadFrame) {
        match why {
            BadFrame::FrameCount => self.counts.bad_frames_frame_count += 1,
            BadFrame::Seq => self.counts.bad_frames_seq += 1,
            BadFrame::Payload => self.counts.bad_frames_payload += 1,
        }
    }

    /// Takes one ZMQ message (`[topic, seq, payload]`). Returns how its seq
    /// compared, or why it was skipped. Never panics on input.
    pub fn ingest(&mut self, frames: &[&[u8]]) -> Result<SeqCheck, BadFrame> {
        let [_topic, seq, payload] = frames else {
            self.count_bad(BadFrame::FrameCount);
            return Err(BadFrame::FrameCount);
        };
        let upstream = match decode_seq(seq) {
            Ok(s) => s,
            Err(_) => {
                self.count_bad(BadFrame::Seq);
                return Err(BadFrame::Seq);
            }
        };
        self.ingest_payload(upstream, payload)
    }

    /// Takes one payload with its upstream seq.
    pub fn ingest_payload(&mut self, upstream: u64, payload: &[u8]) -> Result<SeqCheck, BadFrame> {
        let check = self.check(upstream);
        match check {
            SeqCheck::First => {
                // Joined late unless this is the publisher's first batch.
                self.complete = upstream == 0;
                if upstream != 0 {
                    self.mark_resync();
                }
            }
            SeqCheck::InOrder => {}
            SeqCheck::Gap { from, to } => {
                self.counts.gaps += 1;
                // The publisher says how far it jumped: a broken one can
                // claim up to 2^64 batches each time (saturate, not wrap).
                self.counts.gap_batches = self.counts.gap_batches.saturating_add(to - from);
                self.complete = false;
                self.mark_resync();
            }
            SeqCheck::Restart => {
                // A new publisher holds no blocks.
                self.counts.restarts += 1;
                self.clear_blocks();
                self.complete = upstream == 0;
                self.mark_resync();
            }
        }
        // The seq is consumed whether or not the payload decodes.
        self.next_upstream = Some(upstream.saturating_add(1));
        let (batch, skipped) = match KvEventBatch::decode_lenient(payload) {
            Ok(b) => b,
            Err(_) => {
                // Its events are lost: like a gap of one batch. It still
                // takes a relay seq (an empty batch), so that a collector
                // resyncs once, to a snapshot at that seq.
                self.count_bad(BadFrame::Payload);
                self.complete = false;
                self.mark_resync();
                let ts = self.last_batch_ts;
                self.apply(KvEventBatch {
                    ts: 0.0,
                    events: Vec::new(),
                    data_parallel_rank: None,
                });
                self.last_batch_ts = ts;
                self.counts.batches -= 1;
                return Err(BadFrame::Payload);
            }
        };
        self.counts.bad_events += skipped.len() as u64;
        self.apply(batch);
        Ok(check)
    }

    /// The next batch is a resync point: cursors before it can no longer be
    /// served.
    fn mark_resync(&mut self) {
        self.resync_from = self.seq + 1;
    }

    fn clear_blocks(&mut self) {
        self.blocks.clear();
        self.order.clear();
    }

    fn apply(&mut self, batch: KvEventBatch) {
        self.seq += 1;
        self.counts.batches += 1;
        self.last_batch_ts = Some(batch.ts);
        let mut ops: Vec<Op> = Vec::new();
        for e in batch.events {
            match e {
                KvEvent::BlockStored { block_hashes, .. } => {
                    self.counts.events_stored += 1;
                    self.counts.hashes_stored += block_hashes.len() as u64;
                    for &h in &block_hashes {
                        self.store(h);
                    }
                    match ops.last_mut() {
                        Some(Op::Stored { hashes }) => hashes.extend(block_hashes),
                        _ => ops.push(Op::Stored {
                            hashes: block_hashes,
                        }),
                    }
                }
                KvEvent::BlockRemoved { block_hashes, .. } => {
                    self.counts.events_removed += 1;
                    self.counts.hashes_removed += block_hashes.len() as u64;
                    for h in &block_hashes {
                        self.blocks.remove(h);
                    }
                    match ops.last_mut() {
                        Some(Op::Removed { hashes }) => hashes.extend(block_hashes),
                        _ => ops.push(Op::Removed {
                            hashes: block_hashes,
                        }),
                    }
                }
                KvEvent::AllBlocksCleared => {
                    self.counts.events_cleared += 1;
                    self.clear_blocks();
                    // From here the snapshot is exact again.
                    self.complete = true;
                    ops.clear();
                    ops.push(Op::Cleared);
                }
            }
        }
        self.compact_order();
        let b = RingBatch { seq: self.seq, ops };
        self.ring_hashes += b.hash_count();
        self.ring.push_back(b);
        while self.ring.len() > self.limits.ring_batches
            || (self.ring_hashes > self.limits.ring_hashes && self.ring.len() > 1)
        {
            if let Some(old) = self.ring.pop_front() {
                self.ring_hashes -= old.hash_count();
            }
        }
    }

    fn store(&mut self, h: u64) {
        self.stamp += 1;
        self.blocks.insert(h, self.stamp);
        self.order.push_back((h, self.stamp));
        while self.blocks.len() > self.limits.max_blocks {
            // More blocks than the server can hold: removes were missed.
            // Drop the oldest stored.
            let Some((old, st)) = self.order.pop_front() else {
                break;
            };
            if self.blocks.get(&old) == Some(&st) {
                self.blocks.remove(&old);
                self.counts.snapshot_evictions += 1;
                self.complete = false;
            }
        }
    }

    /// Keeps `order` within twice the snapshot's size.
    fn compact_order(&mut self) {
        if self.order.len() > 2 * self.blocks.len() + 64 {
            let blocks = &self.blocks;
            self.order.retain(|(h, st)| blocks.get(h) == Some(st));
        }
    }

    /// `GET /kv/events?after=SEQ&limit=N[&epoch=E]`: whole batches after
    /// `after`, at most `limit` hashes (at least one batch, however big).
    pub fn events_after(&mut self, after: u64, limit: usize, epoch: Option<u64>) -> EventsPage {
        let oldest = self.ring.front().map_or(self.seq + 1, |b| b.seq);
        let resync = epoch.is_some_and(|e| e != self.epoch)
            || after > self.seq
            || (after < self.seq && (after + 1 < oldest || after < self.resync_from));
        if resync {
            self.counts.resyncs_served += 1;
            return EventsPage {
                epoch: self.epoch,
                seq: self.seq,
                last: self.seq,
                resync: true,
                more: false,
                complete: self.complete,
                batches: Vec::new(),
            };
        }
        let mut batches = Vec::new();
        let mut hashes = 0usize;
        let mut cursor = after;
        let mut more = false;
        // Ring seqs are consecutive, so the first batch after `after` is at
        // a known offset.
        let start = (after + 1).saturating_sub(oldest) as usize;
        for b in self.ring.iter().skip(start) {
            let n = b.hash_count();
            if !batches.is_empty() && hashes + n > limit {
                more = true;
                break;
            }
            hashes += n;
            cursor = b.seq;
            batches.push(PageBatch {
                seq: b.seq,
                ops: b.ops.clone(),
            });
        }
        EventsPage {
            epoch: self.epoch,
            seq: cursor,
            last: self.seq,
            resync: false,
            more,
            complete: self.complete,
            batches,
        }
    }

    /// `GET /kv/snapshot`.
    pub fn snapshot(&self) -> Snapshot {
        let blocks = self
            .order
            .iter()
            .filter(|(h, st)| self.blocks.get(h) == Some(st))
            .map(|(h, _)| *h)
            .collect();
        Snapshot {
            epoch: self.epoch,
            seq: self.seq,
            complete: self.complete,
            blocks,
        }
    }

    /// Prometheus text for `/metrics`; `now_s` is unix seconds.
    pub fn metrics(&self, now_s: f64) -> String {
        use std::fmt::Write as _;
        let c = &self.counts;
        let mut out = String::new();
        let mut line = |name: &str, kind: &str, help: &str, samples: &[(&str, f64)]| {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
            for (labels, v) in samples {
                let _ = writeln!(out, "{name}{labels} {v}");
            }
        };
        line(
            "kvroute_relay_batches_total",
            "counter",
            "Batches accepted.",
            &[("", c.batches as f64)],
        );
        line(
            "kvroute_relay_events_total",
            "counter",
            "Events accepted, by type.",
            &[
                ("{type=\"stored\"}", c.events_stored as f64),
                ("{type=\"removed\"}", c.events_removed as f64),
                ("{type=\"cleared\"}", c.events_cleared as f64),
            ],
        );
        line(
            "kvroute_relay_hashes_total",
            "counter",
            "Block hashes in accepted events, by type.",
            &[
                ("{type=\"stored\"}", c.hashes_stored as f64),
                ("{type=\"removed\"}", c.hashes_removed as f64),
            ],
        );
        line(
            "kvroute_relay_bad_frames_total",
            "counter",
            "Messages skipped, by reason.",
            &[
                ("{reason=\"frame_count\"}", c.bad_frames_frame_count as f64),
                ("{reason=\"seq\"}", c.bad_frames_seq as f64),
                ("{reason=\"payload\"}", c.bad_frames_payload as f64),
            ],
        );
        line(
            "kvroute_relay_bad_events_total",
            "counter",
            "Events skipped inside a good batch (unknown type, bad field).",
            &[("", c.bad_events as f64)],
        );
        line(
            "kvroute_relay_gaps_total",
            "counter",
            "Sequence gaps detected.",
            &[("", c.gaps as f64)],
        );
        line(
            "kvroute_relay_gap_batches_total",
            "counter",
            "Upstream batches missing in detected gaps.",
            &[("", c.gap_batches as f64)],
        );
        line(
            "kvroute_relay_gaps_filled_total",
            "counter",
            "Gaps filled from the replay socket.",
            &[("", c.gaps_filled as f64)],
        );
        line(
            "kvroute_relay_replayed_batches_total",
            "counter",
            "Batches received from the replay socket.",
            &[("", c.replayed_batches as f64)],
        );
        line(
            "kvroute_relay_replay_failures_total",
            "counter",
            "Replay requests that failed or came back short.",
            &[("", c.replay_failures as f64)],
        );
        line(
            "kvroute_relay_publisher_restarts_total",
            "counter",
            "Times the upstream seq went back.",
            &[("", c.restarts as f64)],
        );
        line(
            "kvroute_relay_snapshot_evictions_total",
            "counter",
            "Hashes dropped because the snapshot held max-blocks.",
            &[("", c.snapshot_evictions as f64)],
        );
        line(
            "kvroute_relay_resyncs_served_total",
            "counter",
            "/kv/events answers with resync.",
            &[("", c.resyncs_served as f64)],
        );
        line(
            "kvroute_relay_seq",
            "gauge",
            "The relay's newest seq.",
            &[("", self.seq as f64)],
        );
        line(
            "kvroute_relay_snapshot_blocks",
            "gauge",
            "Hashes held in the snapshot.",
            &[("", self.blocks.len() as f64)],
        );
        line(
            "kvroute_relay_snapshot_complete",
            "gauge",
            "1 when the snapshot follows every batch since a clean start.",
            &[("", if self.complete { 1.0 } else { 0.0 })],
        );
        line(
            "kvroute_relay_ring_batches",
            "gauge",
            "Batches in the ring.",
            &[("", self.ring.len() as f64)],
        );
        line(
            "kvroute_relay_ring_hashes",
            "gauge",
            "Hashes in the ring.",
            &[("", self.ring_hashes as f64)],
        );
        line(
            "kvroute_relay_publisher_connected",
            "gauge",
            "1 while the SUB socket is connected to the publisher.",
            &[("", if self.link.connected { 1.0 } else { 0.0 })],
        );
        if let Some(ts) = self.last_batch_ts {
            line(
                "kvroute_relay_lag_seconds",
                "gauge",
                "Now minus the newest batch's vLLM timestamp.",
                &[("", (now_s - ts).max(0.0))],
            );
        }
        out
    }
}

//! Fuzz target `relay_frames`: what a vLLM publisher sends the relay over
//! ZMQ (`[topic, seq, msgpack payload]`), through `state::Relay::ingest`,
//! the replay path (`ingest_payload`) and the answers it serves, which the
//! collector must then accept.
//!
//! Input: records until the input ends (at most [`MAX_RECORDS`]). A record
//! is an opcode byte, then:
//!
//! | op % 4 | what | then |
//! |---|---|---|
//! | 0, 1 | a published message of `(op >> 2) % 5` frames | each frame: u16 LE length, bytes |
//! | 2 | `GET /kv/events` | u16 LE `after` below the seq, u16 LE `limit`, epoch byte (0: none, 1: the relay's, else another) |
//! | 3 | a replayed batch (`ingest_payload`) | u64 LE upstream seq, one frame |
//!
//! `fuzz/seeds/relay_frames/` holds the real vLLM 0.32 capture in this
//! form (`testdata/vllm/kv-events-vllm-0.32-frames.b64.jsonl`).
//!
//! After each record:
//!
//! - a message is refused exactly when it has not 3 frames or its seq frame
//!   is not 8 bytes; otherwise it takes one relay seq, decodes or not;
//! - a payload that decodes re-encodes, in both event forms, to a payload
//!   that decodes (strictly) to the same batch;
//! - the snapshot holds at most `max_blocks` distinct hashes (its count is
//!   `block_count`), the ring at most `ring_batches` batches and
//!   `ring_hashes` hashes (but for one oversized batch);
//! - `/kv/events` pages hold consecutive batches after `after`, at most
//!   `limit` hashes (but for one batch), and the collector accepts the page
//!   and the snapshot as JSON (`Engine::apply_relay_answer`).

use kvroute_core::config::Config;
use kvroute_core::engine::ApplyError;
use kvroute_core::engine::Engine;
use kvroute_core::reports::relay::Ask;
use kvroute_kv_events::{EventForm, KvEventBatch};
use kvroute_relay::state::{BadFrame, Limits, Relay};
use kvroute_shared_state::memory::MemoryStore;
use std::collections::HashSet;

/// Most records per input.
pub const MAX_RECORDS: usize = 256;

/// Small bounds, so that every eviction path runs.
const LIMITS: Limits = Limits {
    max_blocks: 64,
    ring_batches: 8,
    ring_hashes: 256,
};

const EPOCH: u64 = 1_700_000_000_000;

const COLLECTOR: &str = r#"{"endpoints":{"static":["127.0.0.1:8001"]},
  "plugins":[{"type":"approx-prefix-cache-producer"},{"type":"prefix-cache-scorer"},{"type":"max-score-picker"}],
  "schedulingProfiles":[{"name":"d","plugins":[{"pluginRef":"prefix-cache-scorer"},{"pluginRef":"max-score-picker"}]}],
  "kvEvents":{"enabled":true,"maxHeldBlocks":128},
  "sharedState":{"indexBudgetBytes":65536}}"#;

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
    fn frame(&mut self) -> &'a [u8] {
        let n = usize::from(self.u16()).min(self.data.len());
        let (head, rest) = self.data.split_at(n);
        self.data = rest;
        head
    }
}

/// Two batches are the same (`ts` by its bits: NaN is allowed on the wire).
fn same(a: &KvEventBatch, b: &KvEventBatch) -> bool {
    a.ts.to_bits() == b.ts.to_bits()
        && a.events == b.events
        && a.data_parallel_rank == b.data_parallel_rank
}

/// A payload that decodes re-encodes to one that decodes to the same batch.
fn check_payload(payload: &[u8]) -> bool {
    let Ok((batch, skipped)) = KvEventBatch::decode_lenient(payload) else {
        assert!(KvEventBatch::decode(payload).is_err());
        return false;
    };
    match KvEventBatch::decode(payload) {
        Ok(strict) => {
            assert!(skipped.is_empty());
            assert!(same(&strict, &batch));
        }
        Err(e) => assert_eq!(Some(&e), skipped.first()),
    }
    for form in [EventForm::Map, EventForm::Array] {
        let again = KvEventBatch::decode(&batch.encode_as(form))
            .unwrap_or_else(|e| panic!("{form:?} re-encoding does not decode: {e}"));
        assert!(
            same(&again, &batch),
            "{form:?} re-encoding decodes to another batch:\n{batch:?}\n{again:?}"
        );
    }
    true
}

fn check_relay(r: &Relay) {
    assert!(
        r.block_count() <= LIMITS.max_blocks,
        "{} blocks",
        r.block_count()
    );
    assert!(
        r.ring_len() <= LIMITS.ring_batches,
        "{} batches",
        r.ring_len()
    );
    assert!(
        r.ring_hash_count() <= LIMITS.ring_hashes || r.ring_len() <= 1,
        "{} hashes in {} batches",
        r.ring_hash_count(),
        r.ring_len()
    );
    let s = r.snapshot();
    assert_eq!(s.blocks.len(), r.block_count(), "snapshot size");
    let distinct: HashSet<u64> = s.blocks.iter().copied().collect();
    assert_eq!(
        distinct.len(),
        s.blocks.len(),
        "a hash twice in the snapshot"
    );
    assert_eq!(
        (s.epoch, s.seq, s.complete),
        (r.epoch(), r.seq(), r.complete())
    );
}

/// The collector side: an engine that takes the relay's JSON.
struct Collector {
    engine: Engine,
    store: MemoryStore,
    now_ms: u64,
}

impl Collector {
    fn take(&mut self, ask: Ask, json: &[u8]) {
        self.now_ms += 10;
        match self
            .engine
            .apply_relay_answer(&self.store, 0, 1, ask, json, self.now_ms)
        {
            Ok(_) => {}
            Err(ApplyError::Garbage(m)) => panic!(
                "the collector refuses the relay's {ask:?} answer ({m}): {}",
                String::from_utf8_lossy(json)
            ),
            Err(ApplyError::Store(e)) => panic!("a MemoryStore error: {e}"),
        }
    }
}

/// Runs one input (fuzz target `relay_frames`).
pub fn run(data: &[u8]) {
    let mut relay = Relay::new(LIMITS, EPOCH);
    let engine = Engine::new(Config::from_json(COLLECTOR.as_bytes()).expect("fixed config"));
    let store = MemoryStore::new();
    engine.collector_init(&store).expect("collector_init");
    let mut c = Collector {
        engine,
        store,
        now_ms: 1,
    };
    let mut r = Reader { data };
    for _ in 0..MAX_RECORDS {
        if r.data.is_empty() {
            break;
        }
        let op = r.u8();
        let seq_before = relay.seq();
        match op % 4 {
            0 | 1 => {
                let n = usize::from(op >> 2) % 5;
                let frames: Vec<&[u8]> = (0..n).map(|_| r.frame()).collect();
                let got = relay.ingest(&frames);
                match (frames.as_slice(), got) {
                    ([_, seq, payload], got) if seq.len() == 8 => {
                        assert_eq!(
                            relay.seq(),
                            seq_before + 1,
                            "an accepted message takes one seq"
                        );
                        assert_eq!(check_payload(payload), got != Err(BadFrame::Payload));
                    }
                    ([_, _, _], got) => {
                        assert_eq!(got, Err(BadFrame::Seq));
                        assert_eq!(relay.seq(), seq_before);
                    }
                    (_, got) => {
                        assert_eq!(got, Err(BadFrame::FrameCount));
                        assert_eq!(relay.seq(), seq_before);
                    }
                }
            }
            2 => {
                let back = u64::from(r.u16());
                let after = relay.seq().saturating_sub(back);
                let limit = usize::from(r.u16());
                let epoch = match r.u8() {
                    0 => None,
                    1 => Some(EPOCH),
                    _ => Some(EPOCH + 1),
                };
                let page = relay.events_after(after, limit, epoch);
                assert_eq!((page.epoch, page.last), (EPOCH, relay.seq()));
                if page.resync {
                    assert!(page.batches.is_empty() && !page.more);
                } else {
                    let mut expect = after;
                    let mut hashes = 0usize;
                    for b in &page.batches {
                        expect += 1;
                        assert_eq!(b.seq, expect, "page batches are not consecutive");
                        hashes += b
                            .ops
                            .iter()
                            .map(|o| match o {
                                kvroute_relay::state::Op::Stored { hashes }
                                | kvroute_relay::state::Op::Removed { hashes } => hashes.len(),
                                kvroute_relay::state::Op::Cleared => 0,
                            })
                            .sum::<usize>();
                    }
                    assert_eq!(page.seq, expect, "the cursor is not the last batch's seq");
                    assert!(
                        hashes <= limit || page.batches.len() == 1,
                        "{hashes} hashes over {limit}"
                    );
                    assert_eq!(page.more, page.seq < relay.seq(), "more: {}", page.more);
                }
                let json = serde_json::to_vec(&page).expect("a page serialises");
                c.take(Ask::Events, &json);
            }
            _ => {
                let upstream = r.u64();
                let payload = r.frame();
                let got = relay.ingest_payload(upstream, payload);
                assert_eq!(relay.seq(), seq_before + 1);
                assert_eq!(check_payload(payload), got.is_ok());
            }
        }
        check_relay(&relay);
    }
    let json = serde_json::to_vec(&relay.snapshot()).expect("a snapshot serialises");
    c.take(Ask::Snapshot, &json);
}

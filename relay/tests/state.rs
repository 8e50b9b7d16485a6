//! The relay's state machine: real captured frames in both encodings, gaps,
//! publisher restarts, bounds and bad frames.

mod common;

use common::{captured_frames, refs};
use kvroute_kv_events::{EventForm, KvEvent, KvEventBatch};
use kvroute_relay::state::{BadFrame, Limits, Op, Relay, SeqCheck};
use std::collections::HashSet;

fn relay() -> Relay {
    Relay::new(Limits::default(), 7)
}

fn stored(hashes: &[u64]) -> KvEvent {
    KvEvent::BlockStored {
        block_hashes: hashes.to_vec(),
        parent_block_hash: None,
        token_ids: vec![0; hashes.len() * 2],
        block_size: 2,
        lora_id: None,
        medium: Some("GPU".into()),
        lora_name: None,
        extra_keys: None,
        group_idx: Some(0),
        kv_cache_spec_kind: None,
    }
}

fn removed(hashes: &[u64]) -> KvEvent {
    KvEvent::BlockRemoved {
        block_hashes: hashes.to_vec(),
        medium: Some("GPU".into()),
        group_idx: Some(0),
    }
}

fn payload(events: Vec<KvEvent>) -> Vec<u8> {
    KvEventBatch {
        ts: 1.7e9,
        events,
        data_parallel_rank: Some(0),
    }
    .encode()
}

/// The hash set the capture leaves behind, computed straight from the codec.
fn expected_blocks(frames: &[Vec<Vec<u8>>]) -> HashSet<u64> {
    let mut held = HashSet::new();
    for f in frames {
        for e in KvEventBatch::decode(&f[2]).unwrap().events {
            match e {
                KvEvent::BlockStored { block_hashes, .. } => held.extend(block_hashes),
                KvEvent::BlockRemoved { block_hashes, .. } => {
                    for h in block_hashes {
                        held.remove(&h);
                    }
                }
                KvEvent::AllBlocksCleared => held.clear(),
            }
        }
    }
    held
}

#[test]
fn real_capture_in_both_encodings_builds_the_same_snapshot_and_pages() {
    let frames = captured_frames();
    assert_eq!(frames.len(), 10);
    let want = expected_blocks(&frames);
    assert!(!want.is_empty());
    let mut answers = Vec::new();
    for form in [EventForm::Map, EventForm::Array] {
        let mut r = relay();
        for f in &frames {
            let mut f = f.clone();
            if form == EventForm::Array {
                // Re-encode vLLM's payload with positional (older vLLM) events.
                f[2] = KvEventBatch::decode(&f[2]).unwrap().encode_as(form);
            }
            r.ingest(&refs(&f)).unwrap();
        }
        assert_eq!(r.seq(), 10);
        let snap = r.snapshot();
        assert!(snap.complete, "{form:?}: capture starts at upstream seq 0");
        assert_eq!(snap.blocks.iter().copied().collect::<HashSet<_>>(), want);
        assert_eq!(snap.blocks.len(), want.len(), "no duplicates");
        let page = r.events_after(0, 1 << 20, Some(7));
        assert!(!page.resync && !page.more);
        assert_eq!(page.seq, 10);
        assert_eq!(page.batches.len(), 10);
        assert_eq!(r.counts.events_stored, 10);
        assert_eq!(r.counts.events_removed, 86);
        assert_eq!(r.counts.bad_events + r.counts.gaps + r.counts.restarts, 0);
        answers.push(serde_json::to_string(&page).unwrap());
    }
    assert_eq!(answers[0], answers[1], "both encodings give the same JSON");
    // The JSON shape the collector reads.
    let v: serde_json::Value = serde_json::from_str(&answers[0]).unwrap();
    assert_eq!(v["batches"][0]["seq"], 1);
    assert_eq!(v["batches"][0]["ops"][0]["op"], "stored");
    assert!(v["batches"][0]["ops"][0]["hashes"][0].is_u64());
}

#[test]
fn pages_are_bounded_by_limit_and_resume_from_the_cursor() {
    let frames = captured_frames();
    let mut r = relay();
    for f in &frames {
        r.ingest(&refs(f)).unwrap();
    }
    let mut after = 0;
    let mut seen = 0;
    let mut pages = 0;
    loop {
        let p = r.events_after(after, 40, None);
        assert!(!p.resync);
        let hashes: usize = p
            .batches
            .iter()
            .flat_map(|b| &b.ops)
            .map(|op| match op {
                Op::Stored { hashes } | Op::Removed { hashes } => hashes.len(),
                Op::Cleared => 0,
            })
            .sum();
        assert!(hashes <= 40 || p.batches.len() == 1, "{hashes}");
        seen += p.batches.len();
        after = p.seq;
        pages += 1;
        if !p.more {
            break;
        }
    }
    assert_eq!((seen, after), (10, 10));
    assert!(pages > 2, "{pages}");
    // Caught up: an empty page, same cursor.
    let p = r.events_after(10, 40, None);
    assert!(!p.resync && p.batches.is_empty() && p.seq == 10);
}

#[test]
fn a_gap_is_counted_and_cursors_before_it_resync() {
    let mut r = relay();
    assert_eq!(
        r.ingest_payload(0, &payload(vec![stored(&[1, 2])])),
        Ok(SeqCheck::First)
    );
    assert_eq!(
        r.ingest_payload(1, &payload(vec![stored(&[3])])),
        Ok(SeqCheck::InOrder)
    );
    assert_eq!(r.check(5), SeqCheck::Gap { from: 2, to: 5 });
    assert_eq!(
        r.ingest_payload(5, &payload(vec![removed(&[1])])),
        Ok(SeqCheck::Gap { from: 2, to: 5 })
    );
    assert_eq!((r.counts.gaps, r.counts.gap_batches), (1, 3));
    assert!(!r.complete());
    // A collector at seq 2 missed what the gap held: resync.
    let p = r.events_after(2, 100, None);
    assert!(p.resync && p.seq == 3 && p.batches.is_empty());
    // The snapshot it reloads is at seq 3, and it follows on from there.
    let s = r.snapshot();
    assert_eq!(
        (s.seq, s.complete, s.blocks.clone()),
        (3, false, vec![2, 3])
    );
    r.ingest_payload(6, &payload(vec![stored(&[9])])).unwrap();
    let p = r.events_after(3, 100, None);
    assert!(!p.resync);
    assert_eq!(p.batches.len(), 1);
    assert_eq!(p.batches[0].ops, vec![Op::Stored { hashes: vec![9] }]);
    // Another relay (epoch) or a cursor from the future: resync.
    assert!(r.events_after(3, 100, Some(8)).resync);
    assert!(r.events_after(99, 100, None).resync);
    assert_eq!(r.counts.resyncs_served, 3);
}

/// The publisher's seq says how many batches a gap spans, so a broken one
/// can claim 2^64 each time. Fuzz find (target `relay_frames`): jumping to
/// seq u64::MAX − 1 after each restart overflowed `gap_batches` (a panic
/// with debug assertions, a wrapped counter in release); it saturates now.
#[test]
fn huge_gaps_saturate_the_gap_counter() {
    let mut r = relay();
    for _ in 0..2 {
        r.ingest_payload(0, &payload(vec![stored(&[1])])).unwrap();
        assert_eq!(
            r.ingest_payload(u64::MAX - 1, &payload(vec![stored(&[2])])),
            Ok(SeqCheck::Gap {
                from: 1,
                to: u64::MAX - 1
            })
        );
    }
    assert_eq!(
        (r.counts.gaps, r.counts.gap_batches, r.counts.restarts),
        (2, u64::MAX, 1)
    );
    r.note_gap_filled(0, u64::MAX);
    assert_eq!((r.counts.gaps, r.counts.gap_batches), (3, u64::MAX));
}

#[test]
fn joining_late_is_incomplete_until_all_blocks_cleared() {
    let mut r = relay();
    r.ingest_payload(40, &payload(vec![stored(&[1])])).unwrap();
    assert!(!r.complete());
    assert_eq!(r.counts.gaps, 0, "no earlier frame: not a gap");
    assert!(r.events_after(0, 10, None).resync);
    r.ingest_payload(41, &payload(vec![KvEvent::AllBlocksCleared, stored(&[5])]))
        .unwrap();
    let s = r.snapshot();
    assert!(s.complete);
    assert_eq!(s.blocks, vec![5]);
    let p = r.events_after(1, 10, None);
    assert_eq!(
        p.batches[0].ops,
        vec![Op::Cleared, Op::Stored { hashes: vec![5] }]
    );
}

#[test]
fn a_publisher_restart_clears_the_snapshot_and_forces_a_resync() {
    let frames = captured_frames();
    let mut r = relay();
    for f in &frames[..6] {
        r.ingest(&refs(f)).unwrap();
    }
    assert!(r.block_count() > 0);
    // The server restarts: its seq starts from 0 again.
    assert_eq!(r.check(0), SeqCheck::Restart);
    assert_eq!(r.ingest(&refs(&frames[0])), Ok(SeqCheck::Restart));
    assert_eq!(r.counts.restarts, 1);
    assert_eq!(r.seq(), 7, "the relay's seq never goes back");
    let want = expected_blocks(&frames[..1]);
    let s = r.snapshot();
    assert!(s.complete);
    assert_eq!(s.blocks.iter().copied().collect::<HashSet<_>>(), want);
    for after in [0, 3, 6] {
        assert!(r.events_after(after, 4096, None).resync, "after={after}");
    }
    assert!(!r.events_after(7, 4096, None).resync);
    // It carries on in order from the new publisher.
    assert_eq!(r.ingest(&refs(&frames[1])), Ok(SeqCheck::InOrder));
}

#[test]
fn memory_stays_bounded_by_max_blocks_and_the_ring() {
    let limits = Limits {
        max_blocks: 256,
        ring_batches: 32,
        ring_hashes: 1000,
    };
    let mut r = Relay::new(limits, 1);
    let mut h = 0u64;
    for up in 0..20_000u64 {
        // Only stores, as if every remove was lost: the snapshot must not grow.
        let hashes: Vec<u64> = (0..8)
            .map(|_| {
                h += 1;
                h
            })
            .collect();
        r.ingest_payload(up, &payload(vec![stored(&hashes)]))
            .unwrap();
        assert!(r.block_count() <= 256);
        assert!(r.ring_len() <= 32);
        assert!(r.ring_hash_count() <= 1000);
    }
    assert_eq!(r.block_count(), 256);
    assert_eq!(r.counts.snapshot_evictions, 20_000 * 8 - 256);
    assert!(!r.complete(), "evictions mean removes were missed");
    // The newest blocks survive.
    let s = r.snapshot();
    assert_eq!(s.blocks.first(), Some(&(h - 255)));
    assert_eq!(s.blocks.last(), Some(&h));
    // A cursor older than the ring must resync; one inside it is served.
    assert!(r.events_after(1, 4096, None).resync);
    let p = r.events_after(r.seq() - 5, 4096, None);
    assert!(!p.resync && p.batches.len() == 5);
    // Re-storing the same hashes over and over does not grow the order queue
    // (checked through the snapshot staying exact).
    for up in 20_000..30_000u64 {
        r.ingest_payload(
            up,
            &payload(vec![stored(&[h]), removed(&[h]), stored(&[h])]),
        )
        .unwrap();
    }
    assert_eq!(r.snapshot().blocks.len(), 256);
}

#[test]
fn bad_frames_are_counted_and_skipped() {
    let frames = captured_frames();
    let mut r = relay();
    r.ingest(&refs(&frames[0])).unwrap();
    // Wrong frame counts.
    assert_eq!(r.ingest(&[]), Err(BadFrame::FrameCount));
    assert_eq!(r.ingest(&refs(&frames[1][..2])), Err(BadFrame::FrameCount));
    let mut four = frames[1].clone();
    four.push(b"extra".to_vec());
    assert_eq!(r.ingest(&refs(&four)), Err(BadFrame::FrameCount));
    // A seq frame that is not 8 bytes.
    assert_eq!(
        r.ingest(&[b"kv@test2", b"\x01", &frames[1][2]]),
        Err(BadFrame::Seq)
    );
    assert_eq!(r.seq(), 1, "nothing above took a seq");
    // The next good frame is still in order.
    assert_eq!(r.ingest(&refs(&frames[1])), Ok(SeqCheck::InOrder));
    // Garbage msgpack with a good seq: counted, and a resync point.
    for garbage in [
        &b""[..],
        b"\xc1\xc1",
        b"\x93\xcb",
        &[0xFF; 64],
        b"\x92\x01\x02",
    ] {
        let up = r.next_upstream().unwrap();
        assert_eq!(
            r.ingest(&[b"kv@test2", &up.to_be_bytes(), garbage]),
            Err(BadFrame::Payload)
        );
    }
    assert_eq!(r.counts.bad_frames_payload, 5);
    let cursor = r.seq();
    assert!(r.events_after(2, 100, None).resync);
    assert!(!r.events_after(cursor, 100, None).resync);
    // Unknown event types inside a good batch: skipped, the rest applied.
    let batch = rmpv::Value::Array(vec![
        rmpv::Value::F64(1.7e9),
        rmpv::Value::Array(vec![
            rmpv::Value::Map(vec![(
                rmpv::Value::from("type"),
                rmpv::Value::from("BlockMoved"),
            )]),
            rmpv::Value::from(17),
            stored(&[4242]).to_msgpack_value(),
        ]),
        rmpv::Value::from(0),
    ]);
    let mut buf = Vec::new();
    rmpv::encode::write_value(&mut buf, &batch).unwrap();
    let up = r.next_upstream().unwrap();
    assert_eq!(r.ingest_payload(up, &buf), Ok(SeqCheck::InOrder));
    assert_eq!(r.counts.bad_events, 2);
    assert!(r.snapshot().blocks.contains(&4242));
    let m = r.metrics(1.7e9 + 2.0);
    for line in [
        "kvroute_relay_bad_frames_total{reason=\"frame_count\"} 3",
        "kvroute_relay_bad_frames_total{reason=\"seq\"} 1",
        "kvroute_relay_bad_frames_total{reason=\"payload\"} 5",
        "kvroute_relay_bad_events_total 2",
        "kvroute_relay_lag_seconds 2",
    ] {
        assert!(m.contains(line), "{line}\n{m}");
    }
}

#[test]
fn random_bytes_never_panic() {
    // A small deterministic generator: xorshift64.
    let mut x = 0x9E37_79B9_7F4A_7C15u64;
    let mut next = || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let real = captured_frames();
    let mut r = Relay::new(
        Limits {
            max_blocks: 64,
            ring_batches: 8,
            ring_hashes: 64,
        },
        1,
    );
    for i in 0..3000 {
        let mut p = real[i % real.len()][2].clone();
        // Flip a few bytes or truncate.
        for _ in 0..(next() % 4) {
            let at = (next() as usize) % p.len();
            p[at] = next() as u8;
        }
        if next() % 5 == 0 {
            p.truncate((next() as usize) % p.len());
        }
        let _ = r.ingest_payload(next() % 16, &p);
        let _ = r.events_after(next() % 64, 1 + (next() as usize % 100), None);
    }
    assert!(r.block_count() <= 64);
    let _ = r.snapshot();
}

#[test]
fn health_follows_the_link_with_a_grace_and_an_optional_silence_limit() {
    use kvroute_relay::state::HealthPolicy;
    use std::time::{Duration, Instant};
    let ms = Duration::from_millis;
    let t0 = Instant::now();
    let mut r = relay();
    r.set_health_policy(HealthPolicy {
        grace: ms(500),
        max_silence: None,
    });
    assert_eq!(
        r.health(t0),
        Err("not connected to the publisher yet".into())
    );
    r.note_link(true, t0);
    // An idle publisher: connected, nothing sent, still healthy.
    assert_eq!(
        r.health(t0 + ms(60_000)),
        Ok("ok: connected, no message yet".into())
    );
    r.note_message(t0 + ms(1_000));
    assert_eq!(
        r.health(t0 + ms(3_000)),
        Ok("ok: connected, last message 2.0 s ago".into())
    );
    // A disconnect: healthy within the grace, not after.
    r.note_link(false, t0 + ms(10_000));
    assert_eq!(
        r.health(t0 + ms(10_400)),
        Ok("ok: reconnecting for 0.4 s".into())
    );
    assert_eq!(
        r.health(t0 + ms(10_600)),
        Err("publisher disconnected for 0.6 s".into())
    );
    // A repeated `false` does not restart the clock.
    r.note_link(false, t0 + ms(10_500));
    assert!(r.health(t0 + ms(10_600)).is_err());
    r.note_link(true, t0 + ms(11_000));
    assert!(r.health(t0 + ms(11_000)).is_ok());

    // With a silence limit, a connected but silent publisher is unhealthy;
    // the clock starts at the (re)connection or the newest message.
    r.set_health_policy(HealthPolicy {
        grace: ms(500),
        max_silence: Some(ms(2_000)),
    });
    assert!(r.health(t0 + ms(12_900)).is_ok());
    assert_eq!(
        r.health(t0 + ms(13_100)),
        Err("connected, but no message for 2.1 s (limit 2000 ms)".into())
    );
    r.note_message(t0 + ms(13_200));
    assert!(r.health(t0 + ms(15_100)).is_ok());
    assert!(r.health(t0 + ms(15_300)).is_err());
}

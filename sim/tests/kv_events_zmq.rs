//! KV events published over ZMQ, decoded the way a router would.

use kvroute_sim::emulator::{EmulatorConfig, Fleet};
use kvroute_sim::kv_events::{decode_seq, KvEvent, KvEventBatch};
use kvroute_sim::loadgen::client::HttpClient;
use kvroute_sim::vllm_hash::VllmBlockHasher;
use kvroute_sim_model::vllm_model::EngineConfig;
use serde_json::json;
use std::time::Duration;
use zeromq::{Socket, SocketRecv};

struct Received {
    topic: String,
    seq: u64,
    batch: KvEventBatch,
}

async fn recv(sub: &mut zeromq::SubSocket) -> Received {
    let msg = tokio::time::timeout(Duration::from_secs(5), sub.recv())
        .await
        .expect("no KV event within 5 s")
        .unwrap();
    let frames = msg.into_vec();
    assert_eq!(frames.len(), 3, "frames: topic, seq, payload");
    Received {
        topic: String::from_utf8(frames[0].to_vec()).unwrap(),
        seq: decode_seq(&frames[1]).unwrap(),
        batch: KvEventBatch::decode(&frames[2]).unwrap(),
    }
}

#[tokio::test]
async fn published_events_decode_and_carry_vllm_sha256_cbor_hashes() {
    let cfg = EmulatorConfig {
        engine: EngineConfig {
            block_size: 16,
            num_gpu_blocks: 32,
            ..EngineConfig::default()
        },
        time_scale: 100.0,
        kv_events_port_base: Some(0),
        ..EmulatorConfig::default()
    };
    let fleet = Fleet::start(&cfg, &[0]).await.unwrap();
    let ep = &fleet.endpoints[0];
    let kv_addr = ep.kv_events_addr.expect("events enabled");
    let mut sub = zeromq::SubSocket::new();
    sub.connect(&format!("tcp://{kv_addr}")).await.unwrap();
    sub.subscribe("").await.unwrap();
    // PUB drops messages until the subscription has reached it.
    tokio::time::sleep(Duration::from_millis(300)).await;

    let c = HttpClient::new();
    let url = format!("http://{}/v1/completions", ep.addr);
    let ids: Vec<u32> = (0..100).map(|i| (i * 37) % 5000).collect();
    let r = c
        .post(
            &url,
            json!({"model": "tiny", "prompt": ids, "max_tokens": 1}).to_string(),
            &[],
        )
        .await
        .unwrap();
    assert_eq!(r.status, 200, "{}", r.text());

    let m = recv(&mut sub).await;
    assert_eq!(m.topic, format!("kv@{}@tiny", ep.addr));
    assert_eq!(m.seq, 0);
    assert_eq!(m.batch.data_parallel_rank, Some(0));
    let want = VllmBlockHasher::new(Some("0")).block_hashes_u64(&ids, 16, None, usize::MAX);
    assert_eq!(want.len(), 6);
    match &m.batch.events[..] {
        [KvEvent::BlockStored {
            block_hashes,
            parent_block_hash,
            token_ids,
            block_size,
            medium,
            extra_keys,
            ..
        }] => {
            assert_eq!(block_hashes, &want);
            assert_eq!(*parent_block_hash, None);
            assert_eq!(token_ids, &ids[..96].to_vec());
            assert_eq!(*block_size, 16);
            assert_eq!(medium.as_deref(), Some("GPU"));
            assert_eq!(extra_keys.as_ref().unwrap(), &vec![None; 6]);
        }
        other => panic!("expected one BlockStored, got {other:?}"),
    }

    // A salted request: a different chain, the salt as block 0's extra key.
    let r = c
        .post(
            &url,
            json!({"model": "tiny", "prompt": ids, "max_tokens": 1, "cache_salt": "tenant-a"})
                .to_string(),
            &[],
        )
        .await
        .unwrap();
    assert_eq!(
        r.json().unwrap()["usage"]["prompt_tokens_details"]["cached_tokens"],
        0
    );
    let m = recv(&mut sub).await;
    assert_eq!(m.seq, 1);
    let KvEvent::BlockStored {
        block_hashes,
        extra_keys,
        ..
    } = &m.batch.events[0]
    else {
        panic!("{:?}", m.batch.events)
    };
    assert_eq!(
        block_hashes,
        &VllmBlockHasher::new(Some("0")).block_hashes_u64(&ids, 16, Some("tenant-a"), usize::MAX)
    );
    assert_eq!(
        extra_keys.as_ref().unwrap()[0],
        Some(vec!["tenant-a".to_string()])
    );
    assert_eq!(extra_keys.as_ref().unwrap()[1], None);

    // 12 blocks are cached; 32 exist. Three 10-block prompts force evictions.
    for k in 0..3u32 {
        let other: Vec<u32> = (0..160).map(|i| 10_000 + k * 1000 + i).collect();
        c.post(
            &url,
            json!({"model": "tiny", "prompt": other, "max_tokens": 1}).to_string(),
            &[],
        )
        .await
        .unwrap();
    }
    let mut removed = Vec::new();
    let mut last_seq = 1;
    while removed.len() < 10 {
        let m = recv(&mut sub).await;
        assert_eq!(m.seq, last_seq + 1, "sequence numbers are consecutive");
        last_seq = m.seq;
        for e in m.batch.events {
            if let KvEvent::BlockRemoved { block_hashes, .. } = e {
                removed.extend(block_hashes);
            }
        }
    }
    // LRU: the first prompt's blocks go first, its last block first of all.
    assert_eq!(removed[0], want[5]);
    assert!(removed.iter().take(6).all(|h| want.contains(h)));

    c.post(&format!("http://{}/emulator/reset", ep.addr), "", &[])
        .await
        .unwrap();
    let cleared = loop {
        let m = recv(&mut sub).await;
        if m.batch.events.contains(&KvEvent::AllBlocksCleared) {
            break m;
        }
    };
    assert_eq!(cleared.batch.events, vec![KvEvent::AllBlocksCleared]);
}

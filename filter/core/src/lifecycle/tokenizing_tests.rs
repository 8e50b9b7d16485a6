//! `tokenizeIn: collector` across the roles: the workers never load the
//! tokenizer; the collector loads it, publishes its cuts and takes the
//! jobs the workers send for accepted requests; a later turn of the same
//! conversation is then routed on its stored prefix.

use super::*;
use crate::lifecycle::tokenizing::TOKENIZE_QUEUE;

const TINY_JSON: &str = include_str!("../../../../testdata/tokenizer/tiny-bpe-4096/tokenizer.json");
const TINY_CONFIG: &str =
    include_str!("../../../../testdata/tokenizer/tiny-bpe-4096/tokenizer_config.json");

fn doc(tokenizer: &str) -> String {
    format!(
        r#"{{"endpoints":{{"static":["127.0.0.1:1","127.0.0.1:2"]}},
    "plugins":[{{"type":"token-producer","parameters":{{"modelName":"m",{tokenizer},"tokenizerConfig":{TINY_CONFIG}}}}},
               {{"type":"precise-prefix-cache-producer","parameters":{{"tokenProcessorConfig":{{"blockSizeTokens":4}}}}}},
               {{"type":"prefix-cache-scorer","parameters":{{"prefixMatchInfoProducerName":"precise-prefix-cache-producer"}}}},
               {{"type":"max-score-picker"}}],
    "schedulingProfiles":[{{"name":"d","plugins":[{{"pluginRef":"prefix-cache-scorer"}},{{"pluginRef":"max-score-picker"}}]}}],
    "kvEvents":{{"enabled":true,"staleMs":5000}},
    "routing":{{"seed":7}}}}"#
    )
}

fn inline() -> String {
    format!(
        r#""tokenizeIn":"collector","tokenizerJson":{}"#,
        serde_json::to_string(TINY_JSON).unwrap()
    )
}

/// A filter worker and the collector on one host (one shared data, one
/// set of queues).
fn roles(tokenizer: &str) -> (FakeHost, Rc<Worker>, Role) {
    let host = FakeHost::default();
    host.now_ns.set(5_000_000_000);
    *host.config.borrow_mut() = doc(tokenizer).into_bytes();
    *host.root_id.borrow_mut() = b"kvroute".to_vec();
    let w = match configure(&host) {
        Ok(Role::Filter { worker, .. }) => worker,
        Ok(_) => panic!("not the filter"),
        Err(e) => panic!("{e}"),
    };
    *host.root_id.borrow_mut() = COLLECTOR_ROOT_ID.as_bytes().to_vec();
    let c = configure(&host).unwrap();
    assert!(matches!(c, Role::Collector(_)));
    (host, w, c)
}

fn turns(n: usize) -> Vec<u8> {
    let mut messages = vec![
        serde_json::json!({"role":"system","content":"a shared system prompt, long enough for some blocks of four tokens"}),
    ];
    for i in 0..n {
        messages.push(serde_json::json!({"role":"user","content":format!("question number {i} about the cache")}));
        if i + 1 < n {
            messages.push(serde_json::json!({"role":"assistant","content":format!("answer number {i}, with some words")}));
        }
    }
    serde_json::json!({"model":"m","messages":messages})
        .to_string()
        .into_bytes()
}

fn count(host: &FakeHost, w: &Worker, c: Counter) -> i64 {
    w.flush(host);
    host.counter(c)
}

#[test]
fn the_collector_tokenizes_accepted_turns_and_the_next_turn_finds_them() {
    let (host, w, mut c) = roles(&inline());
    // Workers do not load the tokenizer.
    let t = &w.engine.config.precise.as_ref().unwrap().tokenizers[0];
    assert!(t.tokenizer.is_none() && t.offpath.is_some());

    // Before the collector has loaded it: approximate, no job.
    let mut s = routed_stream(&host, &w, turns(1));
    serve(&host, &mut s, "200");
    assert_eq!(
        count(&host, &w, Counter::PreciseFallbackTokenizerLoading),
        1
    );
    assert_eq!(count(&host, &w, Counter::TokenizeQueued), 0);

    c.on_tick(&host);
    assert_eq!(host.counter(Counter::TokenizerLoaded), 1);
    let queue = *host.queues.borrow().get(TOKENIZE_QUEUE).unwrap();

    // Not hashed yet: approximate; its text is queued once accepted, and
    // not when the server refuses it.
    let mut s = routed_stream(&host, &w, turns(1));
    serve(&host, &mut s, "503");
    assert_eq!(count(&host, &w, Counter::PreciseFallbackNotHashedYet), 1);
    assert_eq!(count(&host, &w, Counter::TokenizeQueued), 0);
    let mut s = routed_stream(&host, &w, turns(1));
    serve(&host, &mut s, "200");
    assert_eq!(count(&host, &w, Counter::TokenizeQueued), 1);
    assert!(kvroute_shared_state::hashed::pending(host.store()).unwrap() > 0);

    c.on_queue_ready(&host, queue);
    assert_eq!(host.counter(Counter::TokenizeJobsDone), 1);
    assert!(host.counter(Counter::TokenizeBytes) > 0);
    assert_eq!(
        kvroute_shared_state::hashed::pending(host.store()).unwrap(),
        0
    );

    // The same prompt: hashed (no relay, so no held view to match: the
    // fallback is `no_held_view`), and nothing new to queue.
    let mut s = routed_stream(&host, &w, turns(1));
    serve(&host, &mut s, "200");
    assert_eq!(count(&host, &w, Counter::PreciseFallbackNoHeldView), 1);
    assert_eq!(count(&host, &w, Counter::TokenizeQueued), 1);

    // The next turn: its earlier turns are found, the new text queued.
    let mut s = routed_stream(&host, &w, turns(2));
    serve(&host, &mut s, "200");
    assert_eq!(count(&host, &w, Counter::PrecisePrefixPartial), 1);
    assert_eq!(count(&host, &w, Counter::TokenizeQueued), 2);
    c.on_queue_ready(&host, queue);
    assert_eq!(host.counter(Counter::TokenizeJobsDone), 2);
    assert_eq!(count(&host, &w, Counter::HostErrors), 0);
    assert_eq!(count(&host, &w, Counter::TokenizeDropped), 0);
}

#[test]
fn a_tokenizer_by_url_is_fetched_once_and_refused_when_its_digest_differs() {
    use sha2::{Digest, Sha256};
    let good: String = Sha256::digest(TINY_JSON.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    let url = |pin: &str| {
        format!(
            r#""tokenizerUrl":"http://models.local:8080/tiny/tokenizer.json","tokenizerSha256":"{pin}","tokenizerCluster":"models""#
        )
    };
    let bad = format!("{}0", &good[..63]);
    for (pin, loads) in [(bad.as_str(), false), (good.as_str(), true)] {
        let (host, w, mut c) = roles(&url(pin));
        c.on_tick(&host);
        let calls = host.calls.borrow().clone();
        let (token, call) = calls
            .iter()
            .enumerate()
            .find(|(_, call)| call.0 == "models")
            .map(|(i, call)| (i as u32 + 1, call.clone()))
            .expect("a GET to the tokenizer's cluster");
        assert!(
            call.1
                .contains(&(":path".into(), "/tiny/tokenizer.json".into())),
            "{call:?}"
        );
        assert!(call
            .1
            .contains(&(":authority".into(), "models.local:8080".into())));
        // No second fetch while one is in flight.
        c.on_tick(&host);
        assert_eq!(
            host.calls
                .borrow()
                .iter()
                .filter(|c| c.0 == "models")
                .count(),
            1
        );
        *host.call_status.borrow_mut() = Some("200".into());
        *host.call_body.borrow_mut() = Some(TINY_JSON.as_bytes().to_vec());
        c.on_http_call_response(&host, token, 1, TINY_JSON.len());
        assert_eq!(host.counter(Counter::TokenizerLoaded), i64::from(loads));
        assert_eq!(
            host.counter(Counter::TokenizerLoadFailures),
            i64::from(!loads)
        );
        if !loads {
            let logs = host.logs.borrow();
            assert!(
                logs.iter()
                    .any(|(l, m)| *l == Level::Error && m.contains("sha256") && m.contains(&good)),
                "{logs:?}"
            );
        }
        // Workers route approximately until it is loaded.
        let mut s = routed_stream(&host, &w, turns(1));
        serve(&host, &mut s, "200");
        let want = if loads {
            Counter::PreciseFallbackNotHashedYet
        } else {
            Counter::PreciseFallbackTokenizerLoading
        };
        assert_eq!(count(&host, &w, want), 1);
    }
}

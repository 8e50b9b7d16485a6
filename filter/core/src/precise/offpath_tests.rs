//! Off-path precise hashes equal the on-path ones: on random growing
//! chats, a prompt's stored prefix is a prefix of its whole hashes, and once
//! its job is processed the whole prompt is found with exactly the hashes
//! (and token count) `PreciseConfig::request_hashes` computes.

use super::*;
use crate::precise::segments::tests::{chat, text, tiny, tiny_edited, Rng, TOOLS_TEMPLATE};
use crate::request::{parse_request_for_template, ApiKind, ParseLimits};
use kvroute_shared_state::memory::MemoryStore;
use serde_json::{json, Value};

const SLOTS: u32 = 4096;

fn render(tok: &ModelTokenizer, body: &Value) -> Option<(String, bool)> {
    let bytes = serde_json::to_vec(body).unwrap();
    let (_, inputs) =
        parse_request_for_template(ApiKind::ChatCompletions, &bytes, &ParseLimits::default())
            .unwrap();
    tok.render_inputs(&inputs.unwrap()).ok()
}

struct Setup<'a> {
    t: Tokenizing<'a>,
}

/// A budget that never evicts (the tests check equality, not eviction).
fn roomy() -> &'static std::cell::RefCell<hashed::Budget> {
    Box::leak(Box::new(std::cell::RefCell::new(hashed::Budget::new(
        SLOTS,
        1 << 40,
    ))))
}

impl<'a> Setup<'a> {
    fn new(tok: &'a ModelTokenizer, hasher: &'a VllmBlockHasher, max_blocks: usize) -> Self {
        Setup {
            t: Tokenizing {
                tok,
                fingerprint: 77,
                block_size: 16,
                hasher,
                max_blocks,
                budget: roomy(),
            },
        }
    }

    fn whole(&self, text: &str, add_special: bool, salt: Option<&str>) -> (Vec<u64>, u32) {
        let ids = self.t.tok.encode(text, add_special).unwrap();
        let h = self
            .t
            .hasher
            .block_hashes_u64(&ids, 16, salt, self.t.max_blocks);
        (h, ids.len() as u32)
    }

    fn lookup(
        &self,
        store: &MemoryStore,
        text: &str,
        add_special: bool,
        salt: Option<&str>,
    ) -> Lookup {
        let seed = key_seed(77, 16, self.t.hasher, add_special, salt);
        let req = JobFor {
            model: 0,
            add_special,
            salt: salt.map(str::to_owned),
        };
        let cut = self.t.tok.segmenter().ok();
        lookup(store, SLOTS, cut, text, seed, req).unwrap()
    }
}

/// Counts of (full, partial, miss) lookups.
fn grow_chats(tok: &ModelTokenizer, seed: u64, n: usize, max_blocks: usize) -> (u32, u32, u32) {
    let hasher = VllmBlockHasher::new(None);
    let s = Setup::new(tok, &hasher, max_blocks);
    let store = MemoryStore::new();
    let mut rng = Rng(seed);
    let (mut full, mut partial, mut miss) = (0, 0, 0);
    for c in 0..n {
        let turns = 2 + rng.below(10);
        let body = chat(&mut rng, turns);
        let messages = body["messages"].as_array().unwrap().clone();
        let salt = (rng.below(4) == 0).then(|| format!("salt{}", c % 3));
        for upto in 1..=messages.len() {
            let mut b = body.clone();
            b["messages"] = Value::Array(messages[..upto].to_vec());
            let Some((text, add_special)) = render(tok, &b) else {
                continue;
            };
            let (want, tokens) = s.whole(&text, add_special, salt.as_deref());
            let job = match s.lookup(&store, &text, add_special, salt.as_deref()) {
                Lookup::Full(p) => {
                    assert_eq!(
                        (p.hashes, p.tokens),
                        (want, tokens),
                        "chat {c} at {upto}: full"
                    );
                    full += 1;
                    continue;
                }
                Lookup::Partial {
                    prefix,
                    rest_bytes,
                    job,
                } => {
                    assert!(
                        want.starts_with(&prefix.hashes),
                        "chat {c} at {upto}: partial"
                    );
                    assert!(prefix.tokens <= tokens);
                    assert!(rest_bytes > 0 && rest_bytes < text.len());
                    assert_eq!(job.text, text[text.len() - rest_bytes..]);
                    partial += 1;
                    job
                }
                Lookup::Miss(job) => {
                    miss += 1;
                    job.unwrap()
                }
            };
            let job = Job::decode(&job.encode()).unwrap();
            let done = process(&job, &s.t, &store).unwrap();
            assert!(done.stored >= 1 && !done.already, "{done:?}");
            match s.lookup(&store, &text, add_special, salt.as_deref()) {
                Lookup::Full(p) => {
                    assert_eq!(
                        (p.hashes, p.tokens),
                        (want, tokens),
                        "chat {c} at {upto}: after"
                    )
                }
                other => panic!("chat {c} at {upto}: {other:?} after its job"),
            }
            // A second job for the same text does nothing.
            assert!(process(&job, &s.t, &store).unwrap().already);
        }
    }
    (full, partial, miss)
}

#[test]
fn growing_chats_find_their_earlier_turns_and_equal_the_whole_hashes() {
    for (template, seed) in [(None, 11), (Some(TOOLS_TEMPLATE), 12)] {
        let tok = tiny(template);
        let (full, partial, miss) = grow_chats(&tok, seed, 120, usize::MAX);
        // Most later turns continue a stored prefix; first turns miss.
        assert!(
            partial > 3 * miss,
            "{full} full, {partial} partial, {miss} miss"
        );
        assert!(full + partial + miss > 600, "{full} {partial} {miss}");
    }
}

#[test]
fn a_block_cap_keeps_the_first_blocks_as_on_the_request_path() {
    let tok = tiny(Some(TOOLS_TEMPLATE));
    let (_, partial, _) = grow_chats(&tok, 13, 60, 5);
    assert!(partial > 50);
}

#[test]
fn salt_and_special_tokens_flag_key_apart() {
    let tok = tiny(None);
    let hasher = VllmBlockHasher::new(None);
    let s = Setup::new(&tok, &hasher, usize::MAX);
    let store = MemoryStore::new();
    let text = "<s>user\nhello there, a long enough prompt to fill a block or two of tokens</s>\n<s>assistant\n";
    let Lookup::Miss(Some(job)) = s.lookup(&store, text, false, None) else {
        panic!()
    };
    process(&job, &s.t, &store).unwrap();
    assert!(matches!(
        s.lookup(&store, text, false, None),
        Lookup::Full(_)
    ));
    for (special, salt) in [(true, None), (false, Some("x"))] {
        assert!(
            matches!(s.lookup(&store, text, special, salt), Lookup::Miss(Some(_))),
            "{special} {salt:?}"
        );
    }
}

#[test]
fn a_post_processor_that_adds_tokens_is_looked_up_whole() {
    let tok = tiny_edited(|j| {
        j["post_processor"] = json!({"type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}},
                       {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"Sequence": {"id": "A", "type_id": 0}},
                     {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {"<s>": {"id": "<s>", "ids": [0], "tokens": ["<s>"]}}});
    });
    let hasher = VllmBlockHasher::new(None);
    let s = Setup::new(&tok, &hasher, usize::MAX);
    let store = MemoryStore::new();
    let mut rng = Rng(5);
    for _ in 0..200 {
        let a = text(&mut rng, 30) + "</s>";
        let b = format!("{a}{}", text(&mut rng, 10));
        for t in [&a, &b] {
            let (want, tokens) = s.whole(t, true, None);
            match s.lookup(&store, t, true, None) {
                Lookup::Full(p) => assert_eq!((p.hashes, p.tokens), (want, tokens)),
                Lookup::Partial { .. } => panic!("whole texts only"),
                Lookup::Miss(Some(job)) => {
                    assert_eq!(job.base, None);
                    process(&job, &s.t, &store).unwrap();
                    let Lookup::Full(p) = s.lookup(&store, t, true, None) else {
                        panic!()
                    };
                    assert_eq!((p.hashes, p.tokens), (want, tokens));
                }
                Lookup::Miss(None) => assert!(t.is_empty()),
            }
        }
    }
}

#[test]
fn a_job_whose_base_was_replaced_is_dropped() {
    let tok = tiny(None);
    let hasher = VllmBlockHasher::new(None);
    let s = Setup::new(&tok, &hasher, usize::MAX);
    let store = MemoryStore::new();
    let first =
        "<s>user\nthe first turn of a conversation, long enough for blocks</s>\n<s>assistant\n";
    let Lookup::Miss(Some(job)) = s.lookup(&store, first, false, None) else {
        panic!()
    };
    process(&job, &s.t, &store).unwrap();
    let next = format!("{first}an answer</s>\n<s>user\nmore</s>\n<s>assistant\n");
    let Lookup::Partial { job, .. } = s.lookup(&store, &next, false, None) else {
        panic!()
    };
    // Every slot overwritten by other prefixes.
    let base = job.base.unwrap();
    let other = HashedPrefix {
        key: PrefixKey {
            hash: base.hash.wrapping_add(u128::from(SLOTS)),
            text_len: 1,
        },
        tokens: 1,
        hashes: vec![],
        parent: None,
        tail: vec![1],
        extendable: true,
    };
    hashed::put(&store, SLOTS, &other).unwrap();
    assert_eq!(process(&job, &s.t, &store), Err(JobError::BaseGone));
}

#[test]
fn jobs_round_trip_and_junk_is_refused() {
    let j = Job {
        model: 3,
        add_special: true,
        salt: Some("s".into()),
        base: Some(PrefixKey {
            hash: u128::MAX - 5,
            text_len: 99,
        }),
        text: "héllo <s>".into(),
    };
    let b = j.encode();
    assert_eq!(Job::decode(&b), Some(j.clone()));
    for cut in 0..b.len() {
        assert_eq!(Job::decode(&b[..cut]), None);
    }
    let mut bad = b.clone();
    bad.push(0);
    assert_eq!(Job::decode(&bad), None);
    let none = Job {
        salt: None,
        base: None,
        ..j
    };
    assert_eq!(Job::decode(&none.encode()), Some(none));
    assert_eq!(Job::decode(&[JOB_MAGIC, 0, 9]), None);
}

/// A long new text is tokenized over several requests, at most
/// MAX_JOB_BYTES (one piece more at worst) each, each continuing from the
/// last; in the end the whole prompt is found with exactly its hashes.
#[test]
fn a_long_new_text_is_tokenized_a_job_at_a_time() {
    let tok = tiny(Some(TOOLS_TEMPLATE));
    let hasher = VllmBlockHasher::new(None);
    let s = Setup::new(&tok, &hasher, usize::MAX);
    let store = MemoryStore::new();
    let mut rng = Rng(21);
    let mut msgs = vec![json!({"role": "system", "content": text(&mut rng, 400).repeat(10)})];
    for i in 0..24 {
        let role = if i % 2 == 0 { "user" } else { "assistant" };
        let t: String = (0..12).map(|_| text(&mut rng, 400)).collect();
        msgs.push(json!({"role": role, "content": t}));
    }
    let body = json!({"model": "m", "messages": msgs});
    let (text, special) = render(&tok, &body).unwrap();
    assert!(text.len() > 3 * MAX_JOB_BYTES, "{}", text.len());
    let (want, tokens) = s.whole(&text, special, None);
    let mut rounds = 0;
    loop {
        rounds += 1;
        assert!(rounds < 50);
        let job = match s.lookup(&store, &text, special, None) {
            Lookup::Full(p) => {
                assert_eq!((p.hashes, p.tokens), (want, tokens));
                break;
            }
            Lookup::Partial { job, prefix, .. } => {
                assert!(want.starts_with(&prefix.hashes));
                job
            }
            Lookup::Miss(job) => job.unwrap(),
        };
        assert!(
            job.text.len() <= MAX_JOB_BYTES + 8 * 400,
            "{}",
            job.text.len()
        );
        process(&job, &s.t, &store).unwrap();
    }
    assert!(rounds >= 4, "{rounds} rounds");
}

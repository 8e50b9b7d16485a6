//! Fuzz target `offpath`: precise mode off the request path
//! (`tokenizeIn: collector`). What one VM writes and another parses (a
//! job on the shared queue, a stored prefix, a tokenizer's published
//! cuts), the cutter the workers build from those cuts, the workers'
//! lookup over shared data holding junk, and the collector's processing
//! of a job with the real-engine tier's tiny tokenizer.
//!
//! The input is parts separated by the two bytes `FE FF` (never in UTF-8;
//! [`SEP`]); missing parts are empty:
//!
//! 0. parameters: byte 0 flags (bit 0 `add_special`, bit 1 `post_adds`,
//!    bit 2 a salt, bit 3 cut IDs repeat (`i % 3`), bit 4 `process` the
//!    looked-up job too), byte 1 the slots (1 to 16, so slots collide),
//!    byte 2 vLLM's block size (1 to 16), byte 3 `max_blocks` (0: none,
//!    else 1 to 8), byte 4 bit 0 the tokenizer whose post-processor adds
//!    tokens;
//! 1. bytes for `Job::decode`; 2. for `HashedPrefix::decode`; 3. for
//!    `TokenizerMeta::decode` (its cuts, when it has some, are also cut
//!    with);
//! 4. the cuts: contents separated by NUL (any bytes: invalid UTF-8,
//!    duplicates, one a prefix of another), ID their index;
//! 5. text, taken with `String::from_utf8_lossy`;
//! 6. glue: each byte `F0..=FF` appends a cut's content (lossy; from the
//!    cuts of part 4, then the tiny tokenizer's `<s>`, `</s>`, `<unk>`),
//!    other ASCII bytes themselves, other bytes `é`; the text is part 5
//!    then the glue;
//! 7. and on: shared-data writes, in order: byte 0 `& 3` is the kind, `>> 2`
//!    the slot or boundary: 0 `kvroute/hashed/k/<n>` ← the rest, 1
//!    `kvroute/hashed/v/<n>` ← the rest, 2 a well-formed prefix (part 2's,
//!    or an empty one) stored with `hashed::put` under the key of the text's
//!    boundary `n` (the rest's first byte: its `extendable`), 3 part 2's
//!    prefix under its own key.
//!
//! Checked, besides "no panic":
//!
//! - the codecs: whatever decodes re-encodes and decodes to an equal value;
//!   the tokenizer's meta round-trips;
//! - the cutter ([`check_split`]), on the text, the glue alone and each
//!   cut's content: the ends strictly increase to the text's length; each
//!   text piece is the text between the previous end and its end and holds
//!   no (UTF-8) cut's content; each added-token piece's span is a cut's
//!   content with that ID; `split` equals `split_ends` without the ends;
//! - `lookup` ([`check_lookup`]) against a model of its order (the text's
//!   end, then the added tokens' ends backwards, extendable ones only):
//!   `Full` and `Partial` return what is stored under the key of that
//!   boundary; a `Partial` leaves `0 < rest_bytes < text.len()` and hands
//!   over the text's tail on its prefix; the job re-encodes;
//! - `process` (the tiny tokenizer, loaded once): never panics on a fuzzed
//!   job or the looked-up one over the junk; a job from the start that it
//!   processes is then found `Full` with exactly `ModelTokenizer::encode`
//!   and `VllmBlockHasher::block_hashes_u64`'s hashes; and on a clean
//!   store, the text's part-5 prefix processed first, then the whole text
//!   looked up (its stored prefix's hashes a prefix of the whole's),
//!   processed and looked up again, `Full` with the whole's exact hashes.

use kvroute_core::precise::offpath::{
    self, chain, key_seed, lookup, pieces, process, root, Job, JobFor, Lookup, Tokenizing,
};
use kvroute_core::precise::segments::Segmenter;
use kvroute_core::precise::tokenizer::ModelTokenizer;
use kvroute_core::precise::vllm_hash::VllmBlockHasher;
use kvroute_core::precise::OffPathModel;
use kvroute_shared_state::hashed::{self, HashedPrefix, PrefixKey, TokenizerMeta};
use kvroute_shared_state::memory::MemoryStore;
use kvroute_shared_state::Store;
use std::sync::OnceLock;

/// The separator of the input's parts.
pub const SEP: &[u8] = b"\xfe\xff";
/// Most shared-data writes per input.
pub const MAX_WRITES: usize = 64;
/// The glue stops growing past this many bytes (a cut's content may be
/// the whole input long).
pub const MAX_GLUE: usize = 16 << 10;
/// Most cuts per input.
pub const MAX_CUTS: usize = 64;
/// The tokenizer's fingerprint as the workers' keys are seeded.
const FINGERPRINT: u64 = 77;

const TINY_TOKENIZER: &[u8] =
    include_bytes!("../../testdata/tokenizer/tiny-bpe-4096/tokenizer.json");
const TINY_CONFIG: &[u8] =
    include_bytes!("../../testdata/tokenizer/tiny-bpe-4096/tokenizer_config.json");

/// The real-engine tier's tiny BPE tokenizer, loaded once; with `adds`,
/// its post-processor adds `<s> … </s>` (so with `add_special_tokens` its
/// texts are handled whole).
fn tiny(adds: bool) -> &'static ModelTokenizer {
    static TOK: [OnceLock<ModelTokenizer>; 2] = [OnceLock::new(), OnceLock::new()];
    TOK[usize::from(adds)].get_or_init(|| {
        let config: serde_json::Value =
            serde_json::from_slice(TINY_CONFIG).expect("tokenizer_config.json");
        let mut json: serde_json::Value =
            serde_json::from_slice(TINY_TOKENIZER).expect("tokenizer.json");
        if adds {
            json["post_processor"] = serde_json::json!({"type": "TemplateProcessing",
                "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}},
                           {"Sequence": {"id": "A", "type_id": 0}},
                           {"SpecialToken": {"id": "</s>", "type_id": 0}}],
                "pair": [{"Sequence": {"id": "A", "type_id": 0}},
                         {"Sequence": {"id": "B", "type_id": 1}}],
                "special_tokens": {"<s>": {"id": "<s>", "ids": [0], "tokens": ["<s>"]},
                                   "</s>": {"id": "</s>", "ids": [1], "tokens": ["</s>"]}}});
        }
        let bytes = serde_json::to_vec(&json).expect("a Value serialises");
        ModelTokenizer::load(&bytes, Some(&config), None).expect("the tiny tokenizer")
    })
}

fn split_parts(data: &[u8]) -> Vec<&[u8]> {
    let mut out = Vec::new();
    let mut rest = data;
    while let Some(i) = rest.windows(SEP.len()).position(|w| w == SEP) {
        out.push(&rest[..i]);
        rest = &rest[i + SEP.len()..];
    }
    out.push(rest);
    out
}

/// Runs one input (fuzz target `offpath`).
pub fn run(data: &[u8]) {
    let parts = split_parts(data);
    let part = |i: usize| parts.get(i).copied().unwrap_or(&[]);
    let params = part(0);
    let param = |i: usize| params.get(i).copied().unwrap_or(0);
    let flags = param(0);
    let add_special = flags & 1 != 0;
    let post_adds = flags & 2 != 0;
    let salt = (flags & 4 != 0).then(|| format!("salt{}", flags >> 5));
    let slots = 1 + u32::from(param(1) % 16);
    let block_size = 1 + u32::from(param(2) % 16);
    let max_blocks = match param(3) % 9 {
        0 => usize::MAX,
        n => usize::from(n),
    };

    // 1. The codecs.
    let job = Job::decode(part(1));
    if let Some(j) = &job {
        assert_eq!(
            Job::decode(&j.encode()).as_ref(),
            Some(j),
            "a job re-encodes"
        );
    }
    let prefix = HashedPrefix::decode(part(2));
    if let Some(p) = &prefix {
        assert_eq!(
            HashedPrefix::decode(&p.encode()).as_ref(),
            Some(p),
            "a prefix re-encodes"
        );
    }
    let meta = TokenizerMeta::decode(part(3));
    if let Some(m) = &meta {
        assert_eq!(
            TokenizerMeta::decode(&m.encode()).as_ref(),
            Some(m),
            "a meta re-encodes"
        );
    }

    // 2. The cutter.
    let mut cuts: Vec<(Vec<u8>, u32)> = part(4)
        .split(|&b| b == 0)
        .take(MAX_CUTS)
        .enumerate()
        .map(|(i, c)| {
            (
                c.to_vec(),
                if flags & 8 != 0 {
                    i as u32 % 3
                } else {
                    i as u32
                },
            )
        })
        .collect();
    if part(4).is_empty() {
        cuts.clear();
    }
    let seg = Segmenter::from_cuts(&cuts, post_adds);
    assert_eq!(seg.post_adds(), post_adds);
    for (c, _) in seg.cuts() {
        assert!(
            cuts.iter().any(|(x, _)| *x == c) && std::str::from_utf8(&c).is_ok() && !c.is_empty(),
            "a cut kept that was not given or is not UTF-8"
        );
    }
    let tok = tiny(param(4) & 1 != 0);
    let tok_cuts = tok.segmenter().map(|s| s.cuts()).unwrap_or_default();
    let glue_from: Vec<String> = cuts
        .iter()
        .chain(tok_cuts.iter())
        .map(|(c, _)| String::from_utf8_lossy(c).into_owned())
        .collect();
    let head = String::from_utf8_lossy(part(5)).into_owned();
    let glue = glued(part(6), &glue_from);
    let text = format!("{head}{glue}");
    for t in [&text, &glue] {
        check_split(&seg, &cuts, t);
    }
    for (c, _) in cuts.iter().take(8) {
        check_split(&seg, &cuts, &String::from_utf8_lossy(c));
    }
    let meta_seg = meta.as_ref().and_then(|m| {
        m.cuts
            .as_ref()
            .map(|c| (Segmenter::from_cuts(c, m.post_adds), c.clone()))
    });
    if let Some((s, c)) = &meta_seg {
        check_split(s, c, &text);
    }

    // 3. The workers' lookup over shared data holding junk.
    let hasher = VllmBlockHasher::new(None);
    let store = MemoryStore::new();
    let seed = key_seed(
        FINGERPRINT,
        block_size,
        &hasher,
        add_special,
        salt.as_deref(),
    );
    let req = JobFor {
        model: 0,
        add_special,
        salt: salt.clone(),
    };
    let cut = (!(add_special && seg.post_adds())).then_some(&seg);
    let bounds = chain(&pieces(cut, &text), seed, root(seed));
    for w in parts.iter().skip(7).take(MAX_WRITES) {
        let Some((&op, rest)) = w.split_first() else {
            continue;
        };
        let n = u32::from(op >> 2);
        match op & 3 {
            0 => store.set(&hashed::key_entry(n % slots), rest, 0),
            1 => store.set(&hashed::value_entry(n % slots), rest, 0),
            2 if !bounds.is_empty() => {
                let mut p = prefix.clone().unwrap_or(HashedPrefix {
                    key: root(seed),
                    tokens: 0,
                    hashes: Vec::new(),
                    parent: None,
                    tail: Vec::new(),
                    extendable: true,
                });
                p.key = bounds[n as usize % bounds.len()].key;
                p.extendable = rest.first().is_none_or(|b| b & 1 != 0);
                hashed::put(&store, slots, &p)
            }
            3 => match &prefix {
                Some(p) => hashed::put(&store, slots, p),
                None => Ok(()),
            },
            _ => Ok(()),
        }
        .expect("MemoryStore set");
    }
    let found = lookup(&store, slots, Some(&seg), &text, seed, req.clone()).expect("MemoryStore");
    check_lookup(&store, slots, &text, &req, &bounds, &found);
    if let Some((s, _)) = &meta_seg {
        let _ = lookup(&store, slots, Some(s), &text, seed, req.clone()).expect("MemoryStore");
    }

    // 4. The collector's processing, with the tiny tokenizer.
    // A budget that never evicts: the fuzzed slots collide anyway.
    let budget = std::cell::RefCell::new(hashed::Budget::new(slots, 1 << 40));
    let t = Tokenizing {
        tok,
        fingerprint: FINGERPRINT,
        block_size,
        hasher: &hasher,
        max_blocks,
        budget: &budget,
    };
    let worker_meta = OffPathModel::meta(tok);
    assert_eq!(
        TokenizerMeta::decode(&worker_meta.encode()).as_ref(),
        Some(&worker_meta)
    );
    let worker_cut = worker_meta
        .cuts
        .as_ref()
        .map(|c| Segmenter::from_cuts(c, worker_meta.post_adds));
    if let Some(j) = &job {
        process_and_find(&store, &t, worker_cut.as_ref(), j);
    }
    if flags & 16 != 0 {
        match &found {
            Lookup::Partial { job, .. } | Lookup::Miss(Some(job)) => {
                process_and_find(&store, &t, worker_cut.as_ref(), job)
            }
            _ => {}
        }
    }
    check_growth(&t, worker_cut.as_ref(), &req, &head, &text);
}

/// `bytes` as text: `F0..=FF` a cut's content, ASCII itself, else `é`.
fn glued(bytes: &[u8], cuts: &[String]) -> String {
    let mut s = String::new();
    for &b in bytes {
        match b {
            _ if s.len() >= MAX_GLUE => break,
            0xf0.. if !cuts.is_empty() => s.push_str(&cuts[usize::from(b & 0x0f) % cuts.len()]),
            0..0x80 => s.push(char::from(b)),
            _ => s.push('é'),
        }
    }
    s
}

/// The cutter's invariants on `text` (see the module doc).
pub fn check_split(seg: &Segmenter, cuts: &[(Vec<u8>, u32)], text: &str) {
    let ends = seg.split_ends(text);
    let mut at = 0;
    for &(end, piece) in &ends {
        assert!(
            end > at,
            "ends do not increase: {at} then {end} in {text:?}"
        );
        let span = text.get(at..end).expect("a piece's end is a char boundary");
        match piece {
            Ok(p) => {
                assert_eq!(p, span, "a text piece is not the text between its ends");
                let texts = cuts.iter().filter_map(|(c, _)| std::str::from_utf8(c).ok());
                for c in texts.filter(|c| !c.is_empty()) {
                    assert!(!p.contains(c), "the piece {p:?} holds the cut {c:?}");
                }
            }
            Err(id) => assert!(
                cuts.iter()
                    .any(|(c, i)| *i == id && c.as_slice() == span.as_bytes()),
                "the added token {id} spans {span:?}, no cut with that ID"
            ),
        }
        at = end;
    }
    assert_eq!(at, text.len(), "the pieces do not cover the text");
    let plain: Vec<_> = ends.iter().map(|&(_, p)| p).collect();
    assert_eq!(seg.split(text), plain, "split differs from split_ends");
}

/// `lookup`'s answer against a model of its order (see the module doc).
fn check_lookup(
    store: &MemoryStore,
    slots: u32,
    text: &str,
    req: &JobFor,
    bounds: &[offpath::Boundary],
    found: &Lookup,
) {
    let stored = |k: &PrefixKey| hashed::get(store, slots, k).expect("MemoryStore");
    let job_round_trips = |j: &Job| {
        let mut want = j.clone();
        want.salt = want.salt.filter(|s| !s.is_empty());
        assert_eq!(
            Job::decode(&j.encode()),
            Some(want),
            "a lookup's job re-encodes"
        );
    };
    // The boundaries lookup tries, in its order, and which it takes.
    let Some(last) = bounds.len().checked_sub(1) else {
        assert_eq!(*found, Lookup::Miss(None), "an empty text");
        return;
    };
    assert_eq!(bounds[last].end, text.len());
    let order = std::iter::once(last).chain((0..last).rev().filter(|&i| bounds[i].added));
    let want = order
        .filter_map(|i| stored(&bounds[i].key).map(|p| (i, p)))
        .find(|(i, p)| *i == last || p.extendable);
    match (found, want) {
        (Lookup::Full(p), Some((i, q))) => {
            assert_eq!(i, last, "Full, not at the text's end");
            assert_eq!(*p, q, "Full returned other than what is stored");
            assert_eq!(p.key, bounds[last].key);
        }
        (
            Lookup::Partial {
                prefix,
                rest_bytes,
                job,
            },
            Some((i, q)),
        ) => {
            assert!(i < last, "Partial at the text's end");
            assert_eq!(*prefix, q, "Partial returned other than what is stored");
            assert_eq!(prefix.key, bounds[i].key);
            assert!(prefix.extendable);
            assert!(
                0 < *rest_bytes && *rest_bytes < text.len(),
                "rest {rest_bytes} of {}",
                text.len()
            );
            assert_eq!(text.len() - rest_bytes, bounds[i].end);
            // A job carries at most MAX_JOB_BYTES (the fuzzed texts are
            // shorter; past that it is a prefix of the tail).
            let tail = &text[bounds[i].end..];
            assert!(
                tail.starts_with(job.text.as_str()),
                "the job is not the text's tail"
            );
            assert!(job.text.len() == tail.len() || tail.len() > offpath::MAX_JOB_BYTES);
            assert_eq!(job.base, Some(prefix.key));
            assert_eq!(
                (job.model, job.add_special, &job.salt),
                (req.model, req.add_special, &req.salt)
            );
            job_round_trips(job);
        }
        (Lookup::Miss(Some(job)), None) => {
            assert!(text.starts_with(job.text.as_str()));
            assert!(job.text.len() == text.len() || text.len() > offpath::MAX_JOB_BYTES);
            assert_eq!(job.base, None);
            job_round_trips(job);
        }
        (got, want) => panic!("lookup gave {got:?}, the model {want:?}"),
    }
}

/// The key seed of a job's tokenizer and block size.
fn job_seed(t: &Tokenizing, job: &Job) -> u64 {
    key_seed(
        t.fingerprint,
        t.block_size,
        t.hasher,
        job.add_special,
        job.salt.as_deref(),
    )
}

/// `text`'s exact hashes and token count, as the request path computes
/// them; `None` when the tokenizer refuses it.
fn exact(
    t: &Tokenizing,
    text: &str,
    add_special: bool,
    salt: Option<&str>,
) -> Option<(Vec<u64>, u32)> {
    let ids = t.tok.encode(text, add_special).ok()?;
    let salt = salt.filter(|s| !s.is_empty());
    let hashes = t
        .hasher
        .block_hashes_u64(&ids, t.block_size, salt, t.max_blocks);
    Some((hashes, ids.len() as u32))
}

/// Processes `job` over `store`; a job from the start is then found
/// whole, with the exact hashes.
fn process_and_find(store: &MemoryStore, t: &Tokenizing, cut: Option<&Segmenter>, job: &Job) {
    let Ok(done) = process(job, t, store) else {
        return;
    };
    if done.already || job.base.is_some() {
        return;
    }
    assert!(done.stored >= 1, "{done:?}");
    let req = JobFor {
        model: job.model,
        add_special: job.add_special,
        salt: job.salt.clone(),
    };
    let Some(want) = exact(t, &job.text, job.add_special, job.salt.as_deref()) else {
        panic!("process tokenized what encode refuses: {:?}", job.text);
    };
    match lookup(
        store,
        t.budget.borrow().slots(),
        cut,
        &job.text,
        job_seed(t, job),
        req,
    )
    .expect("MemoryStore")
    {
        Lookup::Full(p) => assert_eq!((p.hashes, p.tokens), want, "processed {:?}", job.text),
        other => panic!("{other:?} after processing {:?}", job.text),
    }
}

/// On a clean store: `head` processed, then `text` (which extends it)
/// looked up, processed and found whole with its exact hashes.
fn check_growth(t: &Tokenizing, cut: Option<&Segmenter>, req: &JobFor, head: &str, text: &str) {
    let store = MemoryStore::new();
    let mk = |s: &str| Job {
        model: req.model,
        add_special: req.add_special,
        salt: req.salt.clone(),
        base: None,
        text: s.to_owned(),
    };
    let seed = job_seed(t, &mk(""));
    process_and_find(&store, t, cut, &mk(head));
    let Some(want) = exact(t, text, req.add_special, req.salt.as_deref()) else {
        return;
    };
    let job = match lookup(
        &store,
        t.budget.borrow().slots(),
        cut,
        text,
        seed,
        req.clone(),
    )
    .expect("MemoryStore")
    {
        Lookup::Full(p) => {
            assert_eq!(
                (p.hashes, p.tokens),
                want,
                "found whole before its job: {text:?}"
            );
            return;
        }
        Lookup::Partial { prefix, job, .. } => {
            assert!(
                want.0.starts_with(&prefix.hashes),
                "a stored prefix's hashes are not the text's"
            );
            assert!(prefix.tokens <= want.1);
            job
        }
        Lookup::Miss(job) => match job {
            Some(j) => j,
            None => return,
        },
    };
    let job = Job::decode(&job.encode()).expect("a job decodes");
    // Its base was just found: it is there, and the text tokenizes.
    if let Err(e) = process(&job, t, &store) {
        panic!("{e:?} processing {text:?}");
    }
    match lookup(
        &store,
        t.budget.borrow().slots(),
        cut,
        text,
        seed,
        req.clone(),
    )
    .expect("MemoryStore")
    {
        Lookup::Full(p) => assert_eq!((p.hashes, p.tokens), want, "grown to {text:?}"),
        other => panic!("{other:?} after processing {text:?}"),
    }
}

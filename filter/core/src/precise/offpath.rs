//! Precise mode off the request path (`tokenizeIn: collector`): one VM
//! (the collector) holds the tokenizer; the workers never tokenize.
//!
//! - A worker renders the prompt's text (the chat template is small), cuts
//!   it at the tokenizer's added tokens ([`Segmenter::split`], from the
//!   cuts the collector published) and chains a key over the pieces
//!   ([`chain`]): the key at a piece's end stands for the whole text up to
//!   it. It then looks in shared data for the longest prefix whose vLLM
//!   hashes are known ([`lookup`]; `kvroute_shared_state::hashed`), trying
//!   the text's end first, then each added token's end backwards.
//!   - Found at the end ([`Lookup::Full`]): the prompt's hashes, exactly.
//!   - Found before it ([`Lookup::Partial`]): the hashes of that prefix
//!     (a conversation's earlier turns); the rest is new text, routed on
//!     what is known and estimated in tokens, and handed to the collector.
//!   - Not found ([`Lookup::Miss`]): the request is routed approximately
//!     (counted), and its text handed over.
//! - What is handed over is a [`Job`]: the text after the prefix found (the
//!   new turn's few KB, not the conversation), sent through an Envoy shared
//!   queue only once a server accepted the request.
//! - The collector runs [`process`]: it tokenizes the job's pieces alone
//!   (exact: `precise::segments`), continues the found prefix's block
//!   hashes from its last full block, and stores the new prefixes: at the
//!   text's end, at the last three added tokens' ends before it (where the
//!   next turn of a chat continues, and where a retried or edited last
//!   message starts: [`LAST_ADDED`]), and at the first added token's end
//!   after each power of two of blocks (so new conversations sharing a
//!   system prompt find it), `log2` of the blocks at most.
//!
//! Why it is exact: a piece's IDs do not depend on the text around it
//! (`precise::segments`), so the IDs of a text that extends a stored
//! prefix at a piece boundary start with the prefix's IDs. A tokenizer that
//! cannot be segmented, or a post-processor that adds tokens with
//! `add_special_tokens`, is handled whole: only the exact text is stored
//! and found.
//!
//! The key is XXH3-128 (not cryptographic; `segment_cache`'s note): a
//! collision makes a request's precise hashes wrong, so it is routed to a
//! server without its cache; the answer never changes.

use super::segments::Segmenter;
use super::tokenizer::{ChatRenderer, ModelTokenizer};
use super::vllm_hash::{encode_block, low64, VllmBlockHasher};
use super::TokenizeError;
use kvroute_shared_state::codec::{Reader, Writer};
use kvroute_shared_state::hashed::{self, HashedPrefix, PrefixKey, TokenizerMeta};
use kvroute_shared_state::{Store, StoreError};
use sha2::{Digest, Sha256};
use xxhash_rust::xxh3::{xxh3_128_with_seed, Xxh3};

/// Where the collector gets a model's `tokenizer.json`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TokenizerSource {
    /// Inline in the plugin JSON (`tokenizerJson`).
    Inline(Vec<u8>),
    /// Fetched with an HTTP GET through an Envoy cluster (`tokenizerUrl`,
    /// `tokenizerCluster`), refused unless its SHA-256 is `sha256`.
    Url {
        cluster: String,
        authority: String,
        path: String,
        sha256: [u8; 32],
        timeout_ms: u32,
    },
}

/// A model whose tokenizer only the collector loads (`tokenizeIn:
/// collector`): what the workers need (the chat renderer, the fingerprint
/// their keys and the tokenizer's published cuts are named by) and what
/// the collector loads from.
pub struct OffPathModel {
    pub fingerprint: u64,
    pub renderer: ChatRenderer,
    pub source: TokenizerSource,
    pub tokenizer_config: Option<serde_json::Value>,
    pub chat_template: Option<String>,
}

impl std::fmt::Debug for OffPathModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OffPathModel")
            .field("fingerprint", &self.fingerprint)
            .field("renderer", &self.renderer)
            .finish()
    }
}

impl OffPathModel {
    /// A model for the workers: the chat template compiles, the tokenizer
    /// is loaded later, by the collector.
    pub fn new(
        source: TokenizerSource,
        tokenizer_config: Option<serde_json::Value>,
        chat_template: Option<String>,
    ) -> Result<OffPathModel, String> {
        Ok(OffPathModel {
            fingerprint: Self::fingerprint_of(&source),
            renderer: ChatRenderer::load(tokenizer_config.as_ref(), chat_template.as_deref())?,
            source,
            tokenizer_config,
            chat_template,
        })
    }

    /// The fingerprint of an inline `tokenizer.json`, or of a pinned one.
    pub fn fingerprint_of(source: &TokenizerSource) -> u64 {
        match source {
            TokenizerSource::Inline(b) => xxhash_rust::xxh3::xxh3_64(b),
            TokenizerSource::Url { sha256, .. } => {
                u64::from_le_bytes(sha256[..8].try_into().unwrap_or([0; 8]))
            }
        }
    }

    /// Loads the tokenizer from `bytes` (the inline JSON, or a fetched
    /// body, which must match the pin).
    pub fn load(&self, bytes: &[u8]) -> Result<ModelTokenizer, String> {
        if let TokenizerSource::Url { sha256, path, .. } = &self.source {
            let got: [u8; 32] = Sha256::digest(bytes).into();
            if got != *sha256 {
                return Err(format!(
                    "the tokenizer fetched from {path} has sha256 {}, not the pinned {}",
                    hex(&got),
                    hex(sha256)
                ));
            }
        }
        ModelTokenizer::load(
            bytes,
            self.tokenizer_config.as_ref(),
            self.chat_template.as_deref(),
        )
    }

    /// What the workers need of a loaded tokenizer.
    pub fn meta(tok: &ModelTokenizer) -> TokenizerMeta {
        match tok.segmenter() {
            Ok(s) => TokenizerMeta {
                cuts: Some(s.cuts()),
                post_adds: s.post_adds(),
            },
            Err(_) => TokenizerMeta {
                cuts: None,
                post_adds: false,
            },
        }
    }
}

/// Lower-case hex.
pub fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// A worker's answer for one prompt: its known hashes and exact-or-estimated
/// tokens (or why there are none), the full blocks it is estimated to have
/// past the known ones, and the job for the collector.
#[derive(Clone, Debug, PartialEq)]
pub struct WorkerHashes {
    pub hashes: Result<(Vec<u64>, u64), super::Fallback>,
    pub unknown_blocks: u32,
    pub job: Option<Job>,
}

/// The worker's side for a text: look it up, and say what to route on.
/// `cut`: the published cuts (`None` inside: handled whole); `bytes_per_token`
/// estimates the new text's tokens.
#[allow(clippy::too_many_arguments)]
pub fn worker_hashes(
    store: &dyn Store,
    slots: u32,
    cut: Option<&Segmenter>,
    text: &str,
    seed: u64,
    req: JobFor,
    block_size: u32,
    bytes_per_token: u64,
) -> Result<WorkerHashes, StoreError> {
    Ok(match lookup(store, slots, cut, text, seed, req)? {
        Lookup::Full(p) => WorkerHashes {
            hashes: Ok((p.hashes, u64::from(p.tokens))),
            unknown_blocks: 0,
            job: None,
        },
        Lookup::Partial {
            prefix,
            rest_bytes,
            job,
        } => {
            let tokens =
                u64::from(prefix.tokens) + (rest_bytes as u64).div_ceil(bytes_per_token.max(1));
            let blocks = tokens / u64::from(block_size.max(1));
            let unknown = blocks.saturating_sub(prefix.hashes.len() as u64);
            WorkerHashes {
                hashes: Ok((prefix.hashes, tokens)),
                unknown_blocks: unknown.min(u64::from(u32::MAX)) as u32,
                job: Some(job),
            }
        }
        Lookup::Miss(job) => WorkerHashes {
            hashes: Err(super::Fallback::NotHashedYet),
            unknown_blocks: 0,
            job,
        },
    })
}

/// What a request's prefix keys are seeded with, besides its text: the
/// tokenizer, vLLM's block size and hash seed, `add_special_tokens` and
/// the cache salt (each makes different hashes of the same text).
pub fn key_seed(
    fingerprint: u64,
    block_size: u32,
    hasher: &VllmBlockHasher,
    add_special: bool,
    salt: Option<&str>,
) -> u64 {
    let mut h = Xxh3::new();
    h.update(b"kvroute/prefix/v1");
    h.update(&fingerprint.to_le_bytes());
    h.update(&block_size.to_le_bytes());
    h.update(&hasher.none_hash());
    h.update(&[u8::from(add_special)]);
    match salt.filter(|s| !s.is_empty()) {
        Some(s) => {
            h.update(&[1]);
            h.update(s.as_bytes());
        }
        None => h.update(&[0]),
    }
    h.digest()
}

/// The key of the empty prefix.
pub fn root(seed: u64) -> PrefixKey {
    PrefixKey {
        hash: xxh3_128_with_seed(b"kvroute/prefix/root", seed),
        text_len: 0,
    }
}

/// A piece's end in a text: the key of the text up to it, and whether the
/// piece was an added token.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Boundary {
    pub key: PrefixKey,
    pub added: bool,
    /// Byte offset of the end in the text given to [`pieces`].
    pub end: usize,
}

/// A text's pieces, each with its end offset: cut at the added tokens of
/// `cut`, or whole when `cut` is `None`.
pub type Pieces<'t> = Vec<(usize, Result<&'t str, u32>)>;

/// `text` cut into pieces (see [`Pieces`]).
pub fn pieces<'t>(cut: Option<&Segmenter>, text: &'t str) -> Pieces<'t> {
    match cut {
        Some(s) => s.split_ends(text),
        None if text.is_empty() => Vec::new(),
        None => vec![(text.len(), Ok(text))],
    }
}

/// The key at each piece's end, continuing from `from` (the key of the
/// text before them).
pub fn chain(pieces: &Pieces, seed: u64, from: PrefixKey) -> Vec<Boundary> {
    let mut k = from.hash;
    let mut out = Vec::with_capacity(pieces.len());
    for &(end, p) in pieces {
        let (pk, added) = match p {
            // 0xff never occurs in UTF-8: a token's piece key cannot be a
            // text's.
            Err(id) => {
                let mut b = [0xffu8; 5];
                b[1..].copy_from_slice(&id.to_le_bytes());
                (xxh3_128_with_seed(&b, seed), true)
            }
            Ok(s) => (xxh3_128_with_seed(s.as_bytes(), seed), false),
        };
        let mut b = [0u8; 32];
        b[..16].copy_from_slice(&k.to_le_bytes());
        b[16..].copy_from_slice(&pk.to_le_bytes());
        k = xxh3_128_with_seed(&b, seed);
        out.push(Boundary {
            key: PrefixKey {
                hash: k,
                text_len: from
                    .text_len
                    .saturating_add(end.min(u32::MAX as usize) as u32),
            },
            added,
            end,
        });
    }
    out
}

/// A request's text handed to the tokenizing VM, after a server accepted
/// it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Job {
    /// Index of the model's tokenizer in the config.
    pub model: u8,
    pub add_special: bool,
    pub salt: Option<String>,
    /// The stored prefix the text continues (`None`: from the start).
    pub base: Option<PrefixKey>,
    /// The text after the base.
    pub text: String,
}

const JOB_MAGIC: u8 = 0x4a;

impl Job {
    pub fn encode(&self) -> Vec<u8> {
        let salt = self.salt.as_deref().unwrap_or("");
        let mut w = Writer::with_capacity(40 + salt.len() + self.text.len());
        w.u8(JOB_MAGIC);
        w.u8(self.model);
        w.u8(u8::from(self.add_special) | (u8::from(self.base.is_some()) << 1));
        w.u32(salt.len() as u32);
        w.buf.extend_from_slice(salt.as_bytes());
        let base = self.base.unwrap_or(PrefixKey {
            hash: 0,
            text_len: 0,
        });
        w.u64(base.hash as u64);
        w.u64((base.hash >> 64) as u64);
        w.u32(base.text_len);
        w.u32(self.text.len() as u32);
        w.buf.extend_from_slice(self.text.as_bytes());
        w.buf
    }

    /// `None` for anything [`Job::encode`] did not write.
    pub fn decode(bytes: &[u8]) -> Option<Job> {
        let mut r = Reader::new(bytes);
        if r.u8()? != JOB_MAGIC {
            return None;
        }
        let model = r.u8()?;
        let flags = r.u8()?;
        if flags > 3 {
            return None;
        }
        let salt = take_str(&mut r)?;
        let lo = r.u64()?;
        let hi = r.u64()?;
        let text_len = r.u32()?;
        let text = take_str(&mut r)?;
        if !r.is_empty() {
            return None;
        }
        Some(Job {
            model,
            add_special: flags & 1 != 0,
            salt: (!salt.is_empty()).then_some(salt),
            base: (flags & 2 != 0).then_some(PrefixKey {
                hash: u128::from(lo) | (u128::from(hi) << 64),
                text_len,
            }),
            text,
        })
    }
}

fn take_str(r: &mut Reader) -> Option<String> {
    let n = r.u32()? as usize;
    let mut s = Vec::with_capacity(n.min(1 << 20));
    for _ in 0..n {
        s.push(r.u8()?);
    }
    String::from_utf8(s).ok()
}

/// The most new text one job carries (bytes), unless its first piece is
/// longer: about 40 ms of Qwen3 tokenizing in the collector.
pub const MAX_JOB_BYTES: usize = 64 * 1024;

/// What a worker found for a prompt.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Lookup {
    /// The whole prompt is stored.
    Full(HashedPrefix),
    /// A prefix is stored; `rest_bytes` of text follow it, handed over in
    /// `job` (up to [`MAX_JOB_BYTES`] of it).
    Partial {
        prefix: HashedPrefix,
        rest_bytes: usize,
        job: Job,
    },
    /// Nothing is stored; the text is handed over in `job` (`None` for an
    /// empty text).
    Miss(Option<Job>),
}

/// The request's side of a job: which tokenizer, and the keys' inputs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct JobFor {
    pub model: u8,
    pub add_special: bool,
    pub salt: Option<String>,
}

/// Whether texts with `add_special` are handled whole with `cut`.
fn whole(cut: Option<&Segmenter>, add_special: bool) -> bool {
    cut.is_none_or(|c| add_special && c.post_adds())
}

/// The longest stored prefix of `text` (the request path).
pub fn lookup(
    store: &dyn Store,
    slots: u32,
    cut: Option<&Segmenter>,
    text: &str,
    seed: u64,
    req: JobFor,
) -> Result<Lookup, StoreError> {
    let cut = if whole(cut, req.add_special) {
        None
    } else {
        cut
    };
    let ps = pieces(cut, text);
    let bounds = chain(&ps, seed, root(seed));
    // A job is the text after the prefix found, up to MAX_JOB_BYTES (at a
    // piece's end; at least one piece): a long new text is tokenized over
    // several requests, each continuing from where the last one stopped,
    // so no job holds the collector long.
    let job = |base: Option<PrefixKey>, from: usize| {
        let end = bounds
            .iter()
            .map(|b| b.end)
            .filter(|&e| e > from && e - from <= MAX_JOB_BYTES)
            .max()
            .or_else(|| bounds.iter().map(|b| b.end).find(|&e| e > from))
            .unwrap_or(text.len());
        Job {
            model: req.model,
            add_special: req.add_special,
            salt: req.salt.clone(),
            base,
            text: text[from..end].to_owned(),
        }
    };
    let Some(last) = bounds.len().checked_sub(1) else {
        return Ok(Lookup::Miss(None));
    };
    let order = std::iter::once(last).chain((0..last).rev().filter(|&i| bounds[i].added));
    for i in order {
        let Some(p) = hashed::get(store, slots, &bounds[i].key)? else {
            continue;
        };
        if i == last {
            return Ok(Lookup::Full(p));
        }
        if !p.extendable {
            continue;
        }
        let from = bounds[i].end;
        return Ok(Lookup::Partial {
            rest_bytes: text.len() - from,
            job: job(Some(p.key), from),
            prefix: p,
        });
    }
    Ok(Lookup::Miss(Some(job(None, 0))))
}

/// Added tokens' ends before a text's end where [`process`] stores the
/// prefix: a chat prompt ends `…<|im_end|>\n<|im_start|>user\n{U}<|im_end|>\n
/// <|im_start|>assistant\n`, so the last three are where the next turn
/// continues (after the last `<|im_start|>`), and where a retried or
/// edited last message starts (before `user`).
pub const LAST_ADDED: usize = 3;

/// What [`process`] did with a job.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Processed {
    /// Bytes of text tokenized.
    pub tokenized_bytes: u64,
    /// Prefixes stored (one larger than the whole budget is not).
    pub stored: u32,
    /// The text's end was stored already (another request's job): nothing
    /// done.
    pub already: bool,
}

/// Why a job was dropped.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum JobError {
    /// Its base prefix is no longer stored (its slot was taken) or cannot
    /// be continued: the next request for the text sends it whole.
    BaseGone,
    /// No tokenizer for its model index.
    NoTokenizer,
    Tokenize(TokenizeError),
    Store(StoreError),
}

impl JobError {
    /// A short stable label (a counter's suffix).
    pub fn label(&self) -> &'static str {
        match self {
            JobError::BaseGone => "base_gone",
            JobError::NoTokenizer => "no_tokenizer",
            JobError::Tokenize(_) => "tokenize",
            JobError::Store(_) => "store",
        }
    }
}

impl From<StoreError> for JobError {
    fn from(e: StoreError) -> JobError {
        JobError::Store(e)
    }
}

impl From<TokenizeError> for JobError {
    fn from(e: TokenizeError) -> JobError {
        JobError::Tokenize(e)
    }
}

/// The tokenizing VM's side: what [`process`] needs besides the job.
pub struct Tokenizing<'a> {
    pub tok: &'a ModelTokenizer,
    /// The tokenizer's fingerprint as the workers know it (from its
    /// `tokenizer.json` bytes or its sha256 pin).
    pub fingerprint: u64,
    pub block_size: u32,
    pub hasher: &'a VllmBlockHasher,
    pub max_blocks: usize,
    /// The stored prefixes' slots and byte budget (the collector's account).
    pub budget: &'a std::cell::RefCell<hashed::Budget>,
}

/// Tokenizes a job's text, continuing its base prefix's hashes, and
/// stores the new prefixes (see the module doc for which).
pub fn process(job: &Job, t: &Tokenizing, store: &dyn Store) -> Result<Processed, JobError> {
    let seed = key_seed(
        t.fingerprint,
        t.block_size,
        t.hasher,
        job.add_special,
        job.salt.as_deref(),
    );
    let cut = t.tok.segmenter().ok();
    let is_whole = whole(cut, job.add_special);
    let cut = if is_whole { None } else { cut };
    if job.base.is_some() && is_whole {
        return Err(JobError::BaseGone);
    }
    let from = job.base.unwrap_or_else(|| root(seed));
    let ps = pieces(cut, &job.text);
    let bounds = chain(&ps, seed, from);
    let Some(last) = bounds.len().checked_sub(1) else {
        return Ok(Processed {
            already: true,
            ..Processed::default()
        });
    };
    // Another request's job stored this text already.
    let slots = t.budget.borrow().slots();
    if hashed::holds(store, slots, &bounds[last].key)? {
        return Ok(Processed {
            already: true,
            ..Processed::default()
        });
    }
    let base = match job.base {
        Some(k) => {
            let p = hashed::get(store, slots, &k)?
                .filter(|p| p.extendable)
                .ok_or(JobError::BaseGone)?;
            t.budget.borrow_mut().touch(&k);
            p
        }
        None => HashedPrefix {
            key: from,
            tokens: 0,
            hashes: Vec::new(),
            parent: None,
            tail: Vec::new(),
            extendable: true,
        },
    };
    let bs = t.block_size.max(1) as usize;
    let salt = job.salt.as_deref().filter(|s| !s.is_empty());
    if is_whole {
        let ids = t.tok.encode(&job.text, job.add_special)?;
        let hashes = t
            .hasher
            .block_hashes_u64(&ids, t.block_size, salt, t.max_blocks);
        let stored = hashed::put_within(
            store,
            &mut t.budget.borrow_mut(),
            &HashedPrefix {
                key: bounds[last].key,
                tokens: ids.len().min(u32::MAX as usize) as u32,
                hashes,
                parent: None,
                tail: Vec::new(),
                extendable: false,
            },
        )?;
        return Ok(Processed {
            tokenized_bytes: job.text.len() as u64,
            stored: u32::from(stored),
            already: false,
        });
    }
    // Where to store: the end, the last LAST_ADDED added tokens' ends
    // before it, and the first added token's end after each power of two
    // of blocks.
    let near_end: Vec<usize> = (0..last)
        .rev()
        .filter(|&i| bounds[i].added)
        .take(LAST_ADDED)
        .collect();
    let mut mark = base.hashes.len().max(1).next_power_of_two();
    if mark == base.hashes.len() {
        mark *= 2;
    }
    let mut out = Processed::default();
    let mut tokens = base.tokens;
    let mut hashes = base.hashes;
    let mut parent = base.parent;
    let mut pending = base.tail;
    let mut capped = hashes.len() >= t.max_blocks;
    let mut buf = Vec::with_capacity(bs * 5 + 64);
    for (i, (_, piece)) in ps.iter().enumerate() {
        let ids = match piece {
            Err(id) => vec![*id],
            Ok(s) => {
                out.tokenized_bytes += s.len() as u64;
                t.tok.encode_piece(s)?
            }
        };
        for id in ids {
            pending.push(id);
            tokens = tokens.saturating_add(1);
            if pending.len() == bs {
                if !capped {
                    let p = parent.unwrap_or_else(|| t.hasher.none_hash());
                    let block_salt = if hashes.is_empty() { salt } else { None };
                    encode_block(&mut buf, &p, &pending, None, block_salt);
                    let h: [u8; 32] = Sha256::digest(&buf).into();
                    hashes.push(low64(&h));
                    parent = Some(h);
                    capped = hashes.len() >= t.max_blocks;
                }
                pending.clear();
            }
        }
        let at_mark = bounds[i].added && hashes.len() >= mark;
        if at_mark {
            mark = (hashes.len() + 1).next_power_of_two();
        }
        // A prefix without a full block matches nothing on a server: only
        // the text's end is stored then (its exact token count).
        if i == last || ((near_end.contains(&i) || at_mark) && !hashes.is_empty()) {
            let stored = hashed::put_within(
                store,
                &mut t.budget.borrow_mut(),
                &HashedPrefix {
                    key: bounds[i].key,
                    tokens,
                    hashes: hashes.clone(),
                    parent,
                    tail: pending.clone(),
                    extendable: true,
                },
            )?;
            out.stored += u32::from(stored);
        }
    }
    Ok(out)
}

#[cfg(test)]
#[path = "offpath_tests.rs"]
mod tests;

//! Segmented encoding: the token IDs of a text as the concatenation of its
//! segments' IDs, each segment tokenized alone and cached
//! ([`super::segment_cache`]), giving exactly the whole text's encoding.
//!
//! Why it is exact (`tokenizers` 0.22, `tokenizer/added_vocabulary.rs` and
//! `tokenizer/mod.rs`): `encode` first finds the added tokens that match
//! the raw text (those with `normalized: false`, special or not) with one
//! leftmost-longest scan, and cuts the text there; the normalizer, the
//! normalized added tokens, the pre-tokenizer and the model then each run
//! on one piece at a time. So a piece between two such matches tokenizes to
//! the same IDs alone, provided nothing reads beyond its piece. What can:
//!
//! - an added token with `single_word` (looks at the characters around the
//!   match), `lstrip` or `rstrip` (takes the whitespace around it);
//! - `encode_special_tokens` (matches are found, then skipped as text);
//! - Metaspace with `prepend_scheme: first` (prepends only to the piece at
//!   offset 0 of the whole text);
//! - truncation or padding (act on the whole encoding);
//! - a post-processor that adds tokens, with `add_special_tokens`: here it
//!   is run on the joined IDs, as `encode` runs it on its own.
//!
//! A tokenizer with any of the first four is not segmented
//! ([`Ineligible`]): its texts are encoded whole, and each call reports why.
//! A piece alone holds no match (a match inside it would have started
//! before the scan's next one, and leftmost-longest takes the earliest), and
//! each added token is checked at load to encode alone to its own ID.
//! Normalized added tokens stay inside their pieces, where they are
//! matched as in the whole text. `precise/tests.rs` checks the equality on
//! random chats (and an ignored test with Qwen3's tokenizer).

use super::segment_cache::{append_ids, ids_to_bytes, SegmentCache, SegmentKey};
use super::TokenizeError;
use tokenizers::tokenizer::PostProcessor;

/// Why a tokenizer's texts are encoded whole, not by segment.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Ineligible {
    /// An added token matched on the raw text has `single_word`, `lstrip`
    /// or `rstrip` (its content).
    AddedTokenFlags(String),
    /// An added token does not encode alone to its own ID (its content).
    AddedTokenAlone(String),
    /// `encode_special_tokens` is set.
    EncodeSpecialTokens,
    /// A Metaspace pre-tokenizer with `prepend_scheme: first`.
    MetaspaceFirst,
    /// `truncation` is configured.
    Truncation,
    /// `padding` is configured.
    Padding,
}

impl Ineligible {
    /// A short stable label (a counter's suffix).
    pub fn label(&self) -> &'static str {
        match self {
            Ineligible::AddedTokenFlags(_) => "added_token_flags",
            Ineligible::AddedTokenAlone(_) => "added_token_alone",
            Ineligible::EncodeSpecialTokens => "encode_special_tokens",
            Ineligible::MetaspaceFirst => "metaspace_first",
            Ineligible::Truncation => "truncation",
            Ineligible::Padding => "padding",
        }
    }
}

/// How one text was encoded.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SegmentReport {
    /// By segment: `segments` non-empty pieces between added tokens,
    /// `cached` of them read from the cache, the others (`tokenized_bytes`
    /// in all) tokenized; `added` added-token matches.
    Segmented {
        segments: u32,
        cached: u32,
        tokenized_bytes: u64,
        added: u32,
    },
    /// Whole: the tokenizer is not eligible.
    Ineligible(Ineligible),
    /// Whole: a segment failed to tokenize, so the text was encoded whole
    /// (its result, error included, is `encode`'s).
    SegmentFailed,
}

/// The added tokens a tokenizer cuts raw text at, and how to find them
/// (leftmost-longest, as `tokenizers`' `AddedVocabulary`).
#[derive(Debug)]
pub struct Segmenter {
    /// Per first byte: (content, ID), longest first.
    by_first: Vec<Vec<(Box<[u8]>, u32)>>,
    /// The one first byte every content starts with, when it is ASCII
    /// (the scan then uses `str::find`, which searches word-wise).
    only_first: Option<char>,
    /// The post-processor adds tokens to a single sequence: with
    /// `add_special_tokens` it runs on the joined IDs.
    post_adds: bool,
}

impl Segmenter {
    /// The segmenter of `tok`, or why its texts must be encoded whole.
    pub fn new(tok: &tokenizers::Tokenizer) -> Result<Segmenter, Ineligible> {
        if tok.get_truncation().is_some() {
            return Err(Ineligible::Truncation);
        }
        if tok.get_padding().is_some() {
            return Err(Ineligible::Padding);
        }
        if tok.get_encode_special_tokens() {
            return Err(Ineligible::EncodeSpecialTokens);
        }
        if let Some(pre) = tok.get_pre_tokenizer() {
            let json = serde_json::to_value(pre).unwrap_or(serde_json::Value::Null);
            if has_metaspace_first(&json) {
                return Err(Ineligible::MetaspaceFirst);
            }
        }
        let mut by_first: Vec<Vec<(Box<[u8]>, u32)>> = vec![Vec::new(); 256];
        let mut decoder: Vec<_> = tok.get_added_tokens_decoder().into_iter().collect();
        decoder.sort_by_key(|(id, _)| *id);
        for (_, t) in decoder {
            if t.normalized || t.content.is_empty() {
                continue;
            }
            if t.single_word || t.lstrip || t.rstrip {
                return Err(Ineligible::AddedTokenFlags(t.content));
            }
            // The ID `encode` gives a match (the content's, as the
            // tokenizer's own trie maps it).
            let Some(id) = tok.token_to_id(&t.content) else {
                return Err(Ineligible::AddedTokenAlone(t.content));
            };
            let alone = tok
                .encode_fast(t.content.as_str(), false)
                .map(|e| e.get_ids().to_vec())
                .ok();
            if alone.as_deref() != Some(&[id][..]) {
                return Err(Ineligible::AddedTokenAlone(t.content));
            }
            let list = &mut by_first[usize::from(t.content.as_bytes()[0])];
            if !list.iter().any(|(c, _)| **c == *t.content.as_bytes()) {
                list.push((t.content.as_bytes().into(), id));
            }
        }
        let post_adds = tok
            .get_post_processor()
            .is_some_and(|p| p.added_tokens(false) > 0);
        Ok(Self::finish(by_first, post_adds))
    }

    /// A segmenter that only cuts (`Segmenter::split`), from the added
    /// tokens another VM's [`Segmenter::cuts`] published: a worker that
    /// does not load the tokenizer (`tokenizeIn: collector`).
    pub fn from_cuts(cuts: &[(Vec<u8>, u32)], post_adds: bool) -> Segmenter {
        let mut by_first: Vec<Vec<(Box<[u8]>, u32)>> = vec![Vec::new(); 256];
        // Only whole UTF-8 strings (an added token's content always is): a
        // match then starts and ends on char boundaries of the text.
        let whole = |c: &[u8]| !c.is_empty() && std::str::from_utf8(c).is_ok();
        for (c, id) in cuts.iter().filter(|(c, _)| whole(c)) {
            let list = &mut by_first[usize::from(c[0])];
            if !list.iter().any(|(x, _)| **x == **c) {
                list.push((c.as_slice().into(), *id));
            }
        }
        Self::finish(by_first, post_adds)
    }

    /// The added tokens this segmenter cuts at (content, ID).
    pub fn cuts(&self) -> Vec<(Vec<u8>, u32)> {
        self.by_first
            .iter()
            .flatten()
            .map(|(c, id)| (c.to_vec(), *id))
            .collect()
    }

    /// Whether the post-processor adds tokens to a single sequence (with
    /// `add_special_tokens`).
    pub fn post_adds(&self) -> bool {
        self.post_adds
    }

    fn finish(mut by_first: Vec<Vec<(Box<[u8]>, u32)>>, post_adds: bool) -> Segmenter {
        for list in &mut by_first {
            list.sort_by_key(|(c, _)| std::cmp::Reverse(c.len()));
        }
        let firsts: Vec<usize> = (0..256).filter(|&b| !by_first[b].is_empty()).collect();
        let only_first = match firsts[..] {
            [b] if b < 128 => Some(char::from(b as u8)),
            _ => None,
        };
        Segmenter {
            by_first,
            only_first,
            post_adds,
        }
    }

    /// The leftmost-longest added-token match in `text` at or after
    /// `from` (a char boundary): its byte range and ID.
    fn next_match(&self, text: &str, from: usize) -> Option<(usize, usize, u32)> {
        let bytes = text.as_bytes();
        let mut i = from;
        loop {
            i = match self.only_first {
                Some(c) => i + text[i..].find(c)?,
                None => {
                    i + bytes[i..]
                        .iter()
                        .position(|&b| !self.by_first[usize::from(b)].is_empty())?
                }
            };
            for (content, id) in &self.by_first[usize::from(bytes[i])] {
                if bytes[i..].starts_with(content) {
                    return Some((i, i + content.len(), *id));
                }
            }
            // Past this byte: with `only_first` it is ASCII, so `i + 1` is a
            // char boundary; the byte scan needs none.
            i += 1;
        }
    }

    /// [`Segmenter::split`] with each piece's end offset in `text`.
    pub fn split_ends<'t>(&self, text: &'t str) -> Vec<(usize, Result<&'t str, u32>)> {
        let mut out = Vec::new();
        let mut at = 0;
        while let Some((start, end, id)) = self.next_match(text, at) {
            if start > at {
                out.push((start, Ok(&text[at..start])));
            }
            out.push((end, Err(id)));
            at = end;
        }
        if at < text.len() {
            out.push((text.len(), Ok(&text[at..])));
        }
        out
    }

    /// `text` as pieces: `Ok(piece)` text between matches (never empty),
    /// `Err(id)` an added token.
    pub fn split<'t>(&self, text: &'t str) -> Vec<Result<&'t str, u32>> {
        let mut out = Vec::new();
        let mut at = 0;
        while let Some((start, end, id)) = self.next_match(text, at) {
            if start > at {
                out.push(Ok(&text[at..start]));
            }
            out.push(Err(id));
            at = end;
        }
        if at < text.len() {
            out.push(Ok(&text[at..]));
        }
        out
    }

    /// `text`'s token IDs, as `tok.encode_fast(text, add_special_tokens)`
    /// gives them, from the segments' cached IDs where `cache` has them
    /// (the others are tokenized and put). `seed`: the tokenizer's
    /// fingerprint, mixed into every key.
    pub fn encode(
        &self,
        tok: &tokenizers::Tokenizer,
        seed: u64,
        text: &str,
        add_special_tokens: bool,
        cache: &mut dyn SegmentCache,
    ) -> Result<(Vec<u32>, SegmentReport), TokenizeError> {
        let whole = |why| encode_whole(tok, text, add_special_tokens).map(|ids| (ids, why));
        if text.is_empty() {
            return whole(SegmentReport::Segmented {
                segments: 0,
                cached: 0,
                tokenized_bytes: 0,
                added: 0,
            });
        }
        let seed = seed ^ cache.seed();
        let (mut segments, mut cached, mut tokenized_bytes, mut added) = (0u32, 0u32, 0u64, 0u32);
        let mut ids = Vec::with_capacity(text.len() / 3);
        for piece in self.split(text) {
            let segment = match piece {
                Err(id) => {
                    ids.push(id);
                    added += 1;
                    continue;
                }
                Ok(s) => s,
            };
            segments += 1;
            let key = SegmentKey::of(segment.as_bytes(), seed);
            if let Some(bytes) = cache.get(&key) {
                if append_ids(&bytes, &mut ids) {
                    cached += 1;
                    continue;
                }
            }
            let Ok(e) = tok.encode_fast(segment, false) else {
                return whole(SegmentReport::SegmentFailed);
            };
            tokenized_bytes += segment.len() as u64;
            cache.put(key, &ids_to_bytes(e.get_ids()));
            ids.extend_from_slice(e.get_ids());
        }
        if add_special_tokens && self.post_adds {
            ids = post_process(tok, ids)?;
        }
        Ok((
            ids,
            SegmentReport::Segmented {
                segments,
                cached,
                tokenized_bytes,
                added,
            },
        ))
    }
}

/// The tokenizer's whole-text encoding (`ModelTokenizer::encode`).
pub fn encode_whole(
    tok: &tokenizers::Tokenizer,
    text: &str,
    add_special_tokens: bool,
) -> Result<Vec<u32>, TokenizeError> {
    tok.encode_fast(text, add_special_tokens)
        .map(|e| e.get_ids().to_vec())
        .map_err(|e| TokenizeError::Tokenize(e.to_string()))
}

/// The post-processor with `add_special_tokens` over `ids`, as `encode`
/// runs it on its own encoding (the processors read IDs, type IDs and the
/// special-token mask; the token strings here are empty).
fn post_process(tok: &tokenizers::Tokenizer, ids: Vec<u32>) -> Result<Vec<u32>, TokenizeError> {
    let tokens = ids
        .into_iter()
        .map(|id| tokenizers::Token::new(id, String::new(), (0, 0)))
        .collect();
    let enc = tokenizers::Encoding::from_tokens(tokens, 0);
    tok.post_process(enc, None, true)
        .map(|e| e.get_ids().to_vec())
        .map_err(|e| TokenizeError::Tokenize(e.to_string()))
}

/// Whether a serialized pre-tokenizer holds a Metaspace that prepends to
/// the first piece only.
fn has_metaspace_first(v: &serde_json::Value) -> bool {
    match v {
        serde_json::Value::Object(o) => {
            (o.get("type").and_then(|t| t.as_str()) == Some("Metaspace")
                && o.get("prepend_scheme").and_then(|p| p.as_str()) == Some("first"))
                || o.values().any(has_metaspace_first)
        }
        serde_json::Value::Array(a) => a.iter().any(has_metaspace_first),
        _ => false,
    }
}

#[cfg(test)]
#[path = "segments_tests.rs"]
pub(crate) mod tests;

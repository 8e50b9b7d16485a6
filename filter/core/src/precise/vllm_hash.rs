//! vLLM's prefix-cache block hashes with `--prefix-caching-hash-algo
//! sha256_cbor`, as vLLM 0.32 computes them
//! (`vllm/v1/core/kv_cache_utils.py`, `vllm/utils/hashing.py`):
//!
//! ```text
//! seed      = PYTHONHASHSEED when set (any string, "" included),
//!             else "vllm-none-hash" (DEFAULT_NONE_HASH_SEED; sha256 and
//!             sha256_cbor only — xxhash algorithms draw a random seed)
//! NONE_HASH = sha256(cbor(seed as a text string))
//! h[i]      = sha256(cbor([h[i-1] or NONE_HASH as bytes,
//!                          [token ids of full block i],
//!                          extra_keys]))
//! extra_keys = null when there are none, else the array of
//!              ["lora", lora_name, lora_path] on every block of a LoRA
//!              adapter's request, then ["cache_salt", salt] on block 0
//!              when the request has a non-empty cache_salt
//!              (generate_block_hash_extra_keys: lora, multimodal, salt,
//!              prompt embeds; multimodal and prompt-embeds keys are not
//!              produced here: such requests are not hashed precisely)
//! event hash = low 64 bits of h[i] = its last 8 bytes, big-endian
//!              (maybe_convert_block_hash; VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1,
//!              the default)
//! ```
//!
//! Only full blocks are hashed; a partial last block has no hash.
//!
//! `cbor` is `cbor2.dumps(x, canonical=True)`: RFC 8949 core deterministic
//! encoding. For this one fixed shape (an array of a byte string, an array
//! of unsigned integers and null or an array of arrays of text strings) that is
//! shortest-form heads and definite lengths only, so the encoder below is a
//! dozen lines that write straight into one reused buffer. A general CBOR
//! crate (`ciborium`) would build a `Value` per token first: about 100,000
//! allocations for a 400 KB prompt on the request path. The tests check
//! these bytes against `ciborium`'s and the hashes against vectors made by
//! vLLM's own functions (`sim/tools/gen_vllm_hash_vectors.py`).

use sha2::{Digest, Sha256};

/// A full 32-byte vLLM block hash.
pub type VllmBlockHash = [u8; 32];

/// vLLM 0.32's `DEFAULT_NONE_HASH_SEED`: the seed of `NONE_HASH` when
/// `PYTHONHASHSEED` is unset and the algorithm is `sha256`/`sha256_cbor`.
pub const DEFAULT_NONE_HASH_SEED: &str = "vllm-none-hash";

/// CBOR major types used here (RFC 8949 §3.1).
const UINT: u8 = 0;
const BYTES: u8 = 2;
const TEXT: u8 = 3;
const ARRAY: u8 = 4;
/// `null` (major type 7, simple value 22).
const NULL: u8 = 0xf6;

/// Writes a CBOR head in its shortest form (RFC 8949 §4.2.1).
fn head(out: &mut Vec<u8>, major: u8, n: u64) {
    let m = major << 5;
    if n < 24 {
        out.push(m | n as u8);
    } else if n <= 0xff {
        out.extend_from_slice(&[m | 24, n as u8]);
    } else if n <= 0xffff {
        out.push(m | 25);
        out.extend_from_slice(&(n as u16).to_be_bytes());
    } else if n <= 0xffff_ffff {
        out.push(m | 26);
        out.extend_from_slice(&(n as u32).to_be_bytes());
    } else {
        out.push(m | 27);
        out.extend_from_slice(&n.to_be_bytes());
    }
}

fn text(out: &mut Vec<u8>, s: &str) {
    head(out, TEXT, s.len() as u64);
    out.extend_from_slice(s.as_bytes());
}

/// A LoRA adapter's extra key, vLLM's `("lora", lora_name, lora_path)`
/// (`_gen_lora_extra_hash_keys`): the request's `model` and the adapter's
/// path on the server (its `--lora-modules name=path`, the card's `root`
/// in `/v1/models`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LoraKey<'a> {
    pub name: &'a str,
    pub path: &'a str,
}

/// The canonical CBOR of one block's hash input: `[parent, [tokens], extra]`,
/// with extra the LoRA key (every block of an adapter's request) then the
/// salt (block 0 only: the caller passes it for that block), or null.
pub fn encode_block(
    out: &mut Vec<u8>,
    parent: &VllmBlockHash,
    tokens: &[u32],
    lora: Option<LoraKey<'_>>,
    salt: Option<&str>,
) {
    out.clear();
    head(out, ARRAY, 3);
    head(out, BYTES, parent.len() as u64);
    out.extend_from_slice(parent);
    head(out, ARRAY, tokens.len() as u64);
    for &t in tokens {
        head(out, UINT, u64::from(t));
    }
    let n = u64::from(lora.is_some()) + u64::from(salt.is_some());
    if n == 0 {
        out.push(NULL);
        return;
    }
    // extra_keys = (("lora", name, path), ("cache_salt", salt)), either part
    // absent.
    head(out, ARRAY, n);
    if let Some(l) = lora {
        head(out, ARRAY, 3);
        text(out, "lora");
        text(out, l.name);
        text(out, l.path);
    }
    if let Some(s) = salt {
        head(out, ARRAY, 2);
        text(out, "cache_salt");
        text(out, s);
    }
}

/// The event form of a hash: its low 64 bits.
pub fn low64(h: &VllmBlockHash) -> u64 {
    let mut last = [0u8; 8];
    last.copy_from_slice(&h[24..]);
    u64::from_be_bytes(last)
}

/// Computes vLLM `sha256_cbor` block hashes for one hash seed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VllmBlockHasher {
    none_hash: VllmBlockHash,
}

impl VllmBlockHasher {
    /// `python_hash_seed`: the servers' `PYTHONHASHSEED`, or `None` when
    /// they run without it (vLLM then uses [`DEFAULT_NONE_HASH_SEED`]).
    pub fn new(python_hash_seed: Option<&str>) -> VllmBlockHasher {
        let seed = python_hash_seed.unwrap_or(DEFAULT_NONE_HASH_SEED);
        let mut buf = Vec::with_capacity(seed.len() + 9);
        text(&mut buf, seed);
        VllmBlockHasher {
            none_hash: Sha256::digest(&buf).into(),
        }
    }

    /// The parent of block 0.
    pub fn none_hash(&self) -> VllmBlockHash {
        self.none_hash
    }

    /// Calls `each` with the hash of every full block of `token_ids`, from
    /// block 0, stopping after `max_blocks`. An empty `cache_salt` is no salt
    /// (vLLM tests its truthiness). `lora`: the request is for this LoRA
    /// adapter (its key goes into every block).
    pub fn for_each_block(
        &self,
        token_ids: &[u32],
        block_size: u32,
        lora: Option<LoraKey<'_>>,
        cache_salt: Option<&str>,
        max_blocks: usize,
        mut each: impl FnMut(&VllmBlockHash),
    ) {
        let bs = block_size.max(1) as usize;
        let salt = cache_salt.filter(|s| !s.is_empty());
        let mut parent = self.none_hash;
        // 9 bytes per token at most, plus the parent, the LoRA key and the salt.
        let extra =
            salt.map_or(0, |s| s.len() + 24) + lora.map_or(0, |l| l.name.len() + l.path.len() + 32);
        let mut buf = Vec::with_capacity(bs * 5 + 48 + extra);
        for (i, block) in token_ids.chunks_exact(bs).take(max_blocks).enumerate() {
            encode_block(
                &mut buf,
                &parent,
                block,
                lora,
                if i == 0 { salt } else { None },
            );
            parent = Sha256::digest(&buf).into();
            each(&parent);
        }
    }

    /// Hashes of the full blocks of `token_ids`, from block 0 (a base
    /// model's request).
    pub fn block_hashes(
        &self,
        token_ids: &[u32],
        block_size: u32,
        cache_salt: Option<&str>,
    ) -> Vec<VllmBlockHash> {
        self.block_hashes_with(token_ids, block_size, None, cache_salt)
    }

    /// [`block_hashes`](Self::block_hashes) of a request for `lora` (when
    /// `Some`).
    pub fn block_hashes_with(
        &self,
        token_ids: &[u32],
        block_size: u32,
        lora: Option<LoraKey<'_>>,
        cache_salt: Option<&str>,
    ) -> Vec<VllmBlockHash> {
        let mut out = Vec::with_capacity(token_ids.len() / block_size.max(1) as usize);
        self.for_each_block(token_ids, block_size, lora, cache_salt, usize::MAX, |h| {
            out.push(*h)
        });
        out
    }

    /// `block_hashes` in the 64-bit form that KV events carry, at most
    /// `max_blocks` of them (a base model's request).
    pub fn block_hashes_u64(
        &self,
        token_ids: &[u32],
        block_size: u32,
        cache_salt: Option<&str>,
        max_blocks: usize,
    ) -> Vec<u64> {
        self.block_hashes_u64_with(token_ids, block_size, None, cache_salt, max_blocks)
    }

    /// [`block_hashes_u64`](Self::block_hashes_u64) of a request for `lora`
    /// (when `Some`).
    pub fn block_hashes_u64_with(
        &self,
        token_ids: &[u32],
        block_size: u32,
        lora: Option<LoraKey<'_>>,
        cache_salt: Option<&str>,
        max_blocks: usize,
    ) -> Vec<u64> {
        let bs = block_size.max(1) as usize;
        let mut out = Vec::with_capacity((token_ids.len() / bs).min(max_blocks));
        self.for_each_block(token_ids, block_size, lora, cache_salt, max_blocks, |h| {
            out.push(low64(h))
        });
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde::Deserialize;

    #[derive(Deserialize)]
    struct Vector {
        name: String,
        python_hash_seed: Option<String>,
        block_size: u32,
        cache_salt: Option<String>,
        #[serde(default)]
        lora_name: Option<String>,
        #[serde(default)]
        lora_path: Option<String>,
        token_ids: Vec<u32>,
        none_hash_hex: String,
        block_hashes_hex: Vec<String>,
        block_hashes_u64: Vec<u64>,
    }

    fn hex(h: &[u8]) -> String {
        h.iter().map(|b| format!("{b:02x}")).collect()
    }

    fn vectors() -> Vec<Vector> {
        let text = include_str!("../../../../testdata/vllm/block-hash-sha256-cbor-vectors.json");
        serde_json::from_str(text).unwrap()
    }

    #[test]
    fn matches_vectors_made_by_vllm() {
        let vs = vectors();
        assert!(vs.len() >= 12);
        let mut lora_cases = 0;
        for v in vs {
            let h = VllmBlockHasher::new(v.python_hash_seed.as_deref());
            assert_eq!(hex(&h.none_hash()), v.none_hash_hex, "{}", v.name);
            let lora = match (&v.lora_name, &v.lora_path) {
                (Some(name), Some(path)) => Some(LoraKey { name, path }),
                _ => None,
            };
            lora_cases += usize::from(lora.is_some());
            let salt = v.cache_salt.as_deref();
            let got = h.block_hashes_with(&v.token_ids, v.block_size, lora, salt);
            let got_hex: Vec<String> = got.iter().map(|x| hex(x)).collect();
            assert_eq!(got_hex, v.block_hashes_hex, "{}", v.name);
            let got64 = h.block_hashes_u64_with(&v.token_ids, v.block_size, lora, salt, usize::MAX);
            assert_eq!(got64, v.block_hashes_u64, "{}", v.name);
            if lora.is_some() {
                // The LoRA key changes every block's hash.
                let base = h.block_hashes_u64(&v.token_ids, v.block_size, salt, usize::MAX);
                assert!(base.iter().zip(&got64).all(|(a, b)| a != b), "{}", v.name);
            }
        }
        assert!(lora_cases >= 4);
    }

    #[test]
    fn unset_seed_is_vllms_default_and_differs_from_empty() {
        let unset = VllmBlockHasher::new(None);
        assert_eq!(unset, VllmBlockHasher::new(Some(DEFAULT_NONE_HASH_SEED)));
        assert_ne!(unset, VllmBlockHasher::new(Some("")));
        assert_ne!(
            VllmBlockHasher::new(Some("0")),
            VllmBlockHasher::new(Some("42"))
        );
    }

    #[test]
    fn partial_last_block_is_not_hashed_and_cap_applies() {
        let h = VllmBlockHasher::new(Some("0"));
        let ids: Vec<u32> = (0..95).collect();
        assert_eq!(h.block_hashes(&ids, 32, None).len(), 2);
        assert_eq!(h.block_hashes(&ids[..31], 32, None).len(), 0);
        let all = h.block_hashes_u64(&ids, 16, None, usize::MAX);
        assert_eq!(all.len(), 5);
        assert_eq!(h.block_hashes_u64(&ids, 16, None, 3), all[..3]);
        // Chained: block 1's hash depends on block 0's tokens.
        let mut other = ids.clone();
        other[0] = 1;
        let b = h.block_hashes_u64(&other, 16, None, usize::MAX);
        assert!(all.iter().zip(&b).all(|(x, y)| x != y));
    }

    #[test]
    fn salt_only_changes_block_zero_input_and_empty_salt_is_none() {
        let h = VllmBlockHasher::new(Some("0"));
        let ids: Vec<u32> = (0..64).collect();
        assert_eq!(
            h.block_hashes(&ids, 32, Some("")),
            h.block_hashes(&ids, 32, None)
        );
        let a = h.block_hashes(&ids, 32, Some("a"));
        let b = h.block_hashes(&ids, 32, Some("b"));
        assert_ne!(a[0], b[0]);
        assert_ne!(a[1], b[1]); // through the chain
    }

    /// The same value built as a ciborium `Value` and encoded by ciborium.
    fn ciborium_bytes(
        parent: &VllmBlockHash,
        tokens: &[u32],
        lora: Option<LoraKey<'_>>,
        salt: Option<&str>,
    ) -> Vec<u8> {
        use ciborium::value::Value;
        let mut keys = Vec::new();
        if let Some(l) = lora {
            keys.push(Value::Array(vec![
                Value::Text("lora".into()),
                Value::Text(l.name.into()),
                Value::Text(l.path.into()),
            ]));
        }
        if let Some(s) = salt {
            keys.push(Value::Array(vec![
                Value::Text("cache_salt".into()),
                Value::Text(s.into()),
            ]));
        }
        let extra = if keys.is_empty() {
            Value::Null
        } else {
            Value::Array(keys)
        };
        let v = Value::Array(vec![
            Value::Bytes(parent.to_vec()),
            Value::Array(tokens.iter().map(|&t| Value::Integer(t.into())).collect()),
            extra,
        ]);
        let mut out = Vec::new();
        ciborium::ser::into_writer(&v, &mut out).unwrap();
        out
    }

    #[test]
    fn encoding_equals_ciborium_at_every_integer_width() {
        let parent = [7u8; 32];
        // Head boundaries: 23/24, 255/256, 65535/65536, u32::MAX.
        let ids = [
            0,
            1,
            23,
            24,
            255,
            256,
            65_535,
            65_536,
            151_935,
            u32::MAX - 1,
            u32::MAX,
        ];
        let mut buf = Vec::new();
        for n in [0usize, 1, 3, 11] {
            encode_block(&mut buf, &parent, &ids[..n], None, None);
            assert_eq!(buf, ciborium_bytes(&parent, &ids[..n], None, None), "n={n}");
        }
        // Array lengths across the 1-, 2- and 3-byte heads (23/24, 255/256).
        for len in [23usize, 24, 255, 256, 1000] {
            let t: Vec<u32> = (0..len as u32).map(|i| i * 4099).collect();
            encode_block(&mut buf, &parent, &t, None, None);
            assert_eq!(buf, ciborium_bytes(&parent, &t, None, None), "len={len}");
        }
        let long_salt = "s".repeat(300);
        for salt in ["a", "tenant-a", long_salt.as_str(), "ünïcode"] {
            encode_block(&mut buf, &parent, &ids, None, Some(salt));
            assert_eq!(buf, ciborium_bytes(&parent, &ids, None, Some(salt)));
        }
        let long_path = format!("/adapters/{}", "p".repeat(300));
        for (name, path) in [("sql", "/tmp/kvr-lora/sql"), ("ünï", long_path.as_str())] {
            let lora = Some(LoraKey { name, path });
            for salt in [None, Some("tenant-a")] {
                encode_block(&mut buf, &parent, &ids, lora, salt);
                assert_eq!(
                    buf,
                    ciborium_bytes(&parent, &ids, lora, salt),
                    "{name} {salt:?}"
                );
            }
        }
        // Spot check of the shape: array(3), bytes(32), …
        encode_block(&mut buf, &parent, &[24], None, None);
        assert_eq!(&buf[..3], &[0x83, 0x58, 0x20]);
        assert_eq!(&buf[35..], &[0x81, 0x18, 24, 0xf6]);
    }

    #[test]
    fn seed_head_matches_ciborium_for_long_seeds() {
        for seed in ["", "0", &"x".repeat(24), &"y".repeat(300)] {
            let mut ours = Vec::new();
            text(&mut ours, seed);
            let mut theirs = Vec::new();
            ciborium::ser::into_writer(&ciborium::value::Value::Text(seed.into()), &mut theirs)
                .unwrap();
            assert_eq!(ours, theirs);
        }
    }
}

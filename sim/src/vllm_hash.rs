//! vLLM's prefix-cache block hashes for token-ID prompts, with
//! `--prefix-caching-hash-algo sha256_cbor`.
//!
//! ```text
//! NONE_HASH = sha256(cbor(PYTHONHASHSEED as a text string))
//! h[i]      = sha256(cbor([h[i-1] or NONE_HASH as bytes, [token ids of block i], extra_keys]))
//! extra_keys = nil, or [cache_salt] on block 0 when the request has one
//! event hash = low 64 bits of h[i] = its last 8 bytes, big-endian
//! ```
//!
//! `cbor` is canonical CBOR (RFC 8949 core deterministic encoding: shortest
//! integer heads, definite lengths). vLLM draws `NONE_HASH` at random when
//! `PYTHONHASHSEED` is unset, so servers agree on hashes only when it is set;
//! the emulator always behaves as if it were (default seed `"0"`).

use ciborium::value::Value;
use sha2::{Digest, Sha256};

/// A full 32-byte vLLM block hash.
pub type VllmBlockHash = [u8; 32];

fn sha256_cbor(v: &Value) -> VllmBlockHash {
    let mut buf = Vec::new();
    // Serialising a Value into a Vec cannot fail.
    let _ = ciborium::ser::into_writer(v, &mut buf);
    Sha256::digest(&buf).into()
}

/// The event form of a hash: its low 64 bits.
pub fn low64(h: &VllmBlockHash) -> u64 {
    let mut last = [0u8; 8];
    last.copy_from_slice(&h[24..]);
    u64::from_be_bytes(last)
}

/// Computes vLLM `sha256_cbor` block hashes for one hash seed.
#[derive(Clone, Debug)]
pub struct VllmBlockHasher {
    none_hash: VllmBlockHash,
}

impl VllmBlockHasher {
    /// `python_hash_seed` is the server's `PYTHONHASHSEED` value.
    pub fn new(python_hash_seed: &str) -> VllmBlockHasher {
        VllmBlockHasher {
            none_hash: sha256_cbor(&Value::Text(python_hash_seed.to_owned())),
        }
    }

    /// The parent of block 0.
    pub fn none_hash(&self) -> VllmBlockHash {
        self.none_hash
    }

    /// Hashes of the full blocks of `token_ids`, from block 0.
    pub fn block_hashes(
        &self,
        token_ids: &[u32],
        block_size: u32,
        cache_salt: Option<&str>,
    ) -> Vec<VllmBlockHash> {
        let bs = block_size.max(1) as usize;
        let mut parent = self.none_hash;
        let mut out = Vec::with_capacity(token_ids.len() / bs);
        for (i, block) in token_ids.chunks_exact(bs).enumerate() {
            let extra = match cache_salt {
                Some(salt) if i == 0 && !salt.is_empty() => {
                    Value::Array(vec![Value::Text(salt.to_owned())])
                }
                _ => Value::Null,
            };
            let v = Value::Array(vec![
                Value::Bytes(parent.to_vec()),
                Value::Array(block.iter().map(|&t| Value::Integer(t.into())).collect()),
                extra,
            ]);
            parent = sha256_cbor(&v);
            out.push(parent);
        }
        out
    }

    /// `block_hashes` in the 64-bit form that KV events carry.
    pub fn block_hashes_u64(
        &self,
        token_ids: &[u32],
        block_size: u32,
        cache_salt: Option<&str>,
    ) -> Vec<u64> {
        self.block_hashes(token_ids, block_size, cache_salt)
            .iter()
            .map(low64)
            .collect()
    }
}

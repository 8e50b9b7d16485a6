//! Token estimate and chained prefix block hashes.
//!
//! Without a tokenizer, a text prompt of `n` bytes is estimated at
//! `ceil(n / charsPerToken)` tokens. The prompt is cut into full blocks of
//! `blockSizeTokens × charsPerToken` bytes (token-ID prompts: of
//! `blockSizeTokens` IDs); a trailing partial block is not hashed, as in
//! vLLM, which caches full blocks only.
//!
//! Block hashes are chained: `h[i] = xxh64(bytes(block i), seed = h[i-1])`
//! with `h[-1] = xxh3_64(model ‖ 0x00 ‖ cache_salt)`. So block i's hash stands
//! for the whole prefix up to and including block i, two models or two salts
//! never share a block, and a change in block k changes hashes ≥ k only.
//!
//! xxh64 rather than xxh3 for the blocks: in the module (WebAssembly under
//! V8) xxh3's 64×64→128-bit multiplies become calls to a software routine
//! (`__multi3`), and a seeded xxh3 derives a 192-byte secret per block;
//! xxh64 takes its seed as its initial state and multiplies 64 bits only.
//! In Envoy that cut the module's instructions per request (callgrind,
//! `docs/lab/2026-11-30-reqs-target-analysis.md`), though natively, where
//! xxh3 runs on SSE2, xxh64 is the slower one.

//! The emulator calls these same functions, so the filter's blocks and the
//! emulated server's blocks cover the same bytes.

use crate::request::{InferenceRequest, Prompt};
use xxhash_rust::xxh3::xxh3_64;
use xxhash_rust::xxh64::xxh64;

/// How prompts are cut into blocks.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BlockConfig {
    /// Tokens per block (llm-d `blockSizeTokens`).
    pub block_size_tokens: u32,
    /// Bytes of text per estimated token (`charsPerToken`).
    pub chars_per_token: u32,
    /// Only the first this-many tokens are hashed (`maxPrefixTokensToMatch`);
    /// 0 means no cap.
    pub max_prefix_tokens: u64,
}

impl Default for BlockConfig {
    fn default() -> Self {
        BlockConfig {
            block_size_tokens: 64,
            chars_per_token: 4,
            max_prefix_tokens: 131_072,
        }
    }
}

impl BlockConfig {
    /// The most blocks hashed per request.
    pub fn max_blocks(&self) -> usize {
        if self.max_prefix_tokens == 0 || self.block_size_tokens == 0 {
            usize::MAX
        } else {
            usize::try_from(self.max_prefix_tokens / u64::from(self.block_size_tokens))
                .unwrap_or(usize::MAX)
        }
    }
}

/// A prompt's estimated size and its chained block hashes.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct PromptBlocks {
    /// Estimated prompt tokens (the whole prompt, not only hashed blocks).
    pub prompt_tokens: u64,
    /// Hashes of full blocks from block 0, at most `max_blocks()` of them.
    pub block_hashes: Vec<u64>,
}

/// Estimated tokens in `bytes` bytes of text: `ceil(bytes / chars_per_token)`.
pub fn estimate_tokens(bytes: usize, chars_per_token: u32) -> u64 {
    let cpt = u64::from(chars_per_token.max(1));
    (bytes as u64).div_ceil(cpt)
}

/// The chain seed for a model and salt.
pub fn chain_seed(model: &str, cache_salt: Option<&str>) -> u64 {
    let salt = cache_salt.unwrap_or("");
    let mut buf = Vec::with_capacity(model.len() + 1 + salt.len());
    buf.extend_from_slice(model.as_bytes());
    buf.push(0);
    buf.extend_from_slice(salt.as_bytes());
    xxh3_64(&buf)
}

/// The hash of a block that follows the prefix whose hash is `prev`.
#[inline]
pub fn chain(prev: u64, block: &[u8]) -> u64 {
    xxh64(block, prev)
}

/// Estimates the prompt's tokens and hashes its full blocks.
pub fn prompt_blocks(req: &InferenceRequest, cfg: &BlockConfig) -> PromptBlocks {
    let seed = chain_seed(&req.model, req.cache_salt.as_deref());
    match &req.prompt {
        Prompt::Text(text) => text_blocks(text, seed, cfg),
        Prompt::TokenIds(ids) => token_blocks(ids, seed, cfg),
    }
}

/// Blocks of a text prompt.
pub fn text_blocks(text: &[u8], seed: u64, cfg: &BlockConfig) -> PromptBlocks {
    let prompt_tokens = estimate_tokens(text.len(), cfg.chars_per_token);
    let block_bytes =
        (cfg.block_size_tokens.max(1) as usize).saturating_mul(cfg.chars_per_token.max(1) as usize);
    let n = (text.len() / block_bytes).min(cfg.max_blocks());
    let mut block_hashes = Vec::with_capacity(n);
    let mut prev = seed;
    for chunk in text.chunks_exact(block_bytes).take(n) {
        prev = chain(prev, chunk);
        block_hashes.push(prev);
    }
    PromptBlocks {
        prompt_tokens,
        block_hashes,
    }
}

/// Blocks of a token-ID prompt; each ID hashes as 4 little-endian bytes.
pub fn token_blocks(ids: &[u32], seed: u64, cfg: &BlockConfig) -> PromptBlocks {
    let bs = cfg.block_size_tokens.max(1) as usize;
    let n = (ids.len() / bs).min(cfg.max_blocks());
    let mut block_hashes = Vec::with_capacity(n);
    let mut prev = seed;
    let mut buf = Vec::with_capacity(bs * 4);
    for chunk in ids.chunks_exact(bs).take(n) {
        buf.clear();
        for id in chunk {
            buf.extend_from_slice(&id.to_le_bytes());
        }
        prev = chain(prev, &buf);
        block_hashes.push(prev);
    }
    PromptBlocks {
        prompt_tokens: ids.len() as u64,
        block_hashes,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::request::ApiKind;

    fn req(model: &str, salt: Option<&str>, text: &[u8]) -> InferenceRequest {
        InferenceRequest {
            kind: ApiKind::Completions,
            model: model.into(),
            prompt: Prompt::Text(text.to_vec()),
            max_output_tokens: None,
            stream: false,
            cache_salt: salt.map(Into::into),
            sequences: 1,
            batch_rest: Default::default(),
        }
    }

    fn cfg(bs: u32) -> BlockConfig {
        BlockConfig {
            block_size_tokens: bs,
            chars_per_token: 4,
            max_prefix_tokens: 0,
        }
    }

    #[test]
    fn token_estimate_rounds_up() {
        assert_eq!(estimate_tokens(0, 4), 0);
        assert_eq!(estimate_tokens(1, 4), 1);
        assert_eq!(estimate_tokens(8, 4), 2);
        assert_eq!(estimate_tokens(9, 4), 3);
    }

    #[test]
    fn full_blocks_only() {
        // 2 tokens per block at 4 bytes per token = 8-byte blocks.
        let b = prompt_blocks(&req("m", None, &[b'a'; 23]), &cfg(2));
        assert_eq!(b.prompt_tokens, 6);
        assert_eq!(b.block_hashes.len(), 2);
    }

    /// Golden values: a change here changes every deployed index's keys.
    #[test]
    fn golden_hashes() {
        let b = prompt_blocks(&req("m", None, b"0123456789abcdef"), &cfg(2));
        assert_eq!(b.block_hashes, golden());
        fn golden() -> Vec<u64> {
            let seed = xxh3_64(b"m\0");
            let h0 = xxh64(b"01234567", seed);
            vec![h0, xxh64(b"89abcdef", h0)]
        }
    }

    #[test]
    fn same_prefix_same_leading_hashes_and_change_at_k_changes_only_from_k() {
        let base: Vec<u8> = (0..200u8).collect();
        let a = prompt_blocks(&req("m", None, &base), &cfg(4));
        for k in 0..a.block_hashes.len() {
            let mut changed = base.clone();
            changed[k * 16 + 3] ^= 0x55;
            let b = prompt_blocks(&req("m", None, &changed), &cfg(4));
            assert_eq!(a.block_hashes[..k], b.block_hashes[..k], "block {k}");
            for i in k..a.block_hashes.len() {
                assert_ne!(
                    a.block_hashes[i], b.block_hashes[i],
                    "block {i} after change at {k}"
                );
            }
        }
        // A longer prompt with the same start shares all leading blocks.
        let mut longer = base.clone();
        longer.extend_from_slice(b"more text, more blocks, more text!!");
        let c = prompt_blocks(&req("m", None, &longer), &cfg(4));
        assert_eq!(c.block_hashes[..a.block_hashes.len()], a.block_hashes[..]);
    }

    #[test]
    fn model_and_salt_separate_chains() {
        let t = [b'x'; 64];
        let a = prompt_blocks(&req("m", None, &t), &cfg(2));
        let b = prompt_blocks(&req("n", None, &t), &cfg(2));
        let c = prompt_blocks(&req("m", Some("tenant-1"), &t), &cfg(2));
        let d = prompt_blocks(&req("m", Some("tenant-2"), &t), &cfg(2));
        for (i, h) in a.block_hashes.iter().enumerate() {
            assert_ne!(*h, b.block_hashes[i]);
            assert_ne!(*h, c.block_hashes[i]);
            assert_ne!(c.block_hashes[i], d.block_hashes[i]);
        }
        // "m" + salt "x" must not equal model "m\0x" with no salt … both are
        // seeded from the same bytes, which is acceptable only because a
        // model name never contains NUL; assert the common case differs.
        assert_ne!(chain_seed("m", Some("")), chain_seed("m", Some("a")));
    }

    #[test]
    fn max_prefix_caps_blocks_but_not_tokens() {
        let c = BlockConfig {
            block_size_tokens: 2,
            chars_per_token: 4,
            max_prefix_tokens: 6,
        };
        let b = prompt_blocks(&req("m", None, &[b'a'; 80]), &c);
        assert_eq!(b.block_hashes.len(), 3);
        assert_eq!(b.prompt_tokens, 20);
    }

    #[test]
    fn token_id_prompts_hash_ids() {
        let mut r = req("m", None, b"");
        r.prompt = Prompt::TokenIds((0..10).collect());
        let b = prompt_blocks(&r, &cfg(4));
        assert_eq!(b.prompt_tokens, 10);
        assert_eq!(b.block_hashes.len(), 2);
        r.prompt = Prompt::TokenIds((0..8).chain([99, 98]).collect());
        let b2 = prompt_blocks(&r, &cfg(4));
        assert_eq!(b.block_hashes, b2.block_hashes);
    }
}

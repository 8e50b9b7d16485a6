//! A simulated request's prompt, as the router and as the modelled server
//! each see it.
//!
//! Two forms:
//! - **Text** (`--exact-prompts`, or a trace line with `"text"`): the real
//!   request body. The router runs the filter's whole path on it
//!   (`Engine::route`: parse, template, token estimate, block hashes) and the
//!   modelled server gets what the emulator would build from the same body
//!   (`emulator::openai::engine_request`). Exact, and as slow as building
//!   and hashing the text.
//! - **Segments** (the default for named workloads, and trace lines with
//!   `"segments"`): the prompt as a list of shared pieces, each an id and an
//!   exact token count, joined in order. Block `i` stands for the pieces
//!   covering tokens `[i·B, (i+1)·B)`; its hash chains over
//!   `(piece id, first token, tokens)` of each piece it covers, so two
//!   prompts share block `i` exactly when they share their first `(i+1)·B`
//!   tokens. The router hashes with its `blockSizeTokens` and the modelled
//!   server with its `--block-size`, each from its own seed, so neither
//!   reuses the other's values. No text is built: a 55k-token prompt costs
//!   two passes over its ~860 blocks. What this form leaves out: the chat
//!   template's few tokens around each message and the router's
//!   bytes-per-token estimate (both sides count tokens exactly).

use super::{GenParts, Segment};
use crate::vllm_model::EngineRequest;
use kvroute_core::blocks::{chain, chain_seed};

/// One shared piece of a prompt.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Piece {
    pub id: u64,
    pub tokens: u32,
}

/// Seed offset of the modelled server's hashes (the router's are
/// `chain_seed(model, None)`).
const SERVER_SEED: u64 = 0x5E57_E7A1_0000_0001;

/// Chained hashes of the full `block_size`-token blocks of `pieces`.
pub fn piece_block_hashes(pieces: &[Piece], block_size: u32, seed: u64) -> Vec<u64> {
    let bs = u64::from(block_size.max(1));
    let total: u64 = pieces.iter().map(|p| u64::from(p.tokens)).sum();
    let n = total / bs;
    let mut out = Vec::with_capacity(n as usize);
    let mut prev = seed;
    let mut buf: Vec<u8> = Vec::with_capacity(64);
    // Cursor: piece index and offset inside it.
    let (mut pi, mut off) = (0usize, 0u64);
    for _ in 0..n {
        buf.clear();
        let mut need = bs;
        while need > 0 {
            let p = pieces[pi];
            let left = u64::from(p.tokens) - off;
            if left == 0 {
                pi += 1;
                off = 0;
                continue;
            }
            let take = left.min(need);
            buf.extend_from_slice(&p.id.to_le_bytes());
            buf.extend_from_slice(&off.to_le_bytes());
            buf.extend_from_slice(&take.to_le_bytes());
            off += take;
            need -= take;
        }
        prev = chain(prev, &buf);
        out.push(prev);
    }
    out
}

/// What the router is given for a request.
#[derive(Clone, Debug)]
pub enum RouterInput {
    /// A request body on an OpenAI path: the filter's whole path.
    Body {
        kind: kvroute_core::request::ApiKind,
        body: Vec<u8>,
    },
    /// Already hashed with the router's block size (segments form).
    Hashed {
        hashes: Vec<u64>,
        prompt_tokens: u64,
        max_output_tokens: Option<u64>,
    },
}

/// A request ready for the simulator: the router's input and the modelled
/// server's.
#[derive(Clone, Debug)]
pub struct SimRequest {
    pub router: RouterInput,
    pub server: EngineRequest,
}

/// A segments-form request.
pub fn from_pieces(
    model: &str,
    pieces: &[Piece],
    output_tokens: u32,
    router_block_size: u32,
    router_max_blocks: usize,
    server_block_size: u32,
) -> SimRequest {
    let prompt_tokens: u64 = pieces.iter().map(|p| u64::from(p.tokens)).sum();
    let seed = chain_seed(model, None);
    let mut hashes = piece_block_hashes(pieces, router_block_size, seed);
    hashes.truncate(router_max_blocks);
    let server_hashes = piece_block_hashes(pieces, server_block_size, seed ^ SERVER_SEED);
    SimRequest {
        router: RouterInput::Hashed {
            hashes,
            prompt_tokens,
            max_output_tokens: Some(u64::from(output_tokens)),
        },
        server: EngineRequest {
            prompt_tokens: prompt_tokens.min(u64::from(u32::MAX)) as u32,
            block_hashes: server_hashes,
            event_token_ids: None,
            first_block_extra_keys: None,
            output_tokens: output_tokens.max(1),
        },
    }
}

/// Whole cacheable blocks over prompt tokens: the most of a prompt any
/// prefix cache can serve (vLLM caches full blocks only, and always
/// computes the last token: `(tokens − 1) / B` blocks at most).
pub fn cacheable_tokens(prompt_tokens: u64, block_size: u32) -> u64 {
    let bs = u64::from(block_size.max(1));
    (prompt_tokens.saturating_sub(1) / bs) * bs
}

/// A request's messages as segments-form pieces, in order.
pub fn parts_pieces(parts: &GenParts) -> Vec<Piece> {
    parts
        .messages
        .iter()
        .flat_map(|(_, segs)| segs.iter())
        .map(|s| Piece {
            id: segment_id(s),
            tokens: s.tokens,
        })
        .collect()
}

/// The piece id of a workload segment (segments form).
pub fn segment_id(s: &Segment) -> u64 {
    let mut h = kvroute_core::blocks::chain(0x5E6, &[s.kind]);
    h = kvroute_core::blocks::chain(h, &s.a.to_le_bytes());
    h = kvroute_core::blocks::chain(h, &s.b.to_le_bytes());
    match s.fresh {
        Some(n) => kvroute_core::blocks::chain(h ^ 0xF2E5, &n.to_le_bytes()),
        None => h,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shared_pieces_share_blocks_and_nothing_after_the_first_difference() {
        let a = [Piece { id: 1, tokens: 130 }, Piece { id: 2, tokens: 70 }];
        let b = [Piece { id: 1, tokens: 130 }, Piece { id: 3, tokens: 70 }];
        let ha = piece_block_hashes(&a, 64, 9);
        let hb = piece_block_hashes(&b, 64, 9);
        assert_eq!(ha.len(), 3);
        // Blocks 0 and 1 lie inside piece 1; block 2 straddles the difference.
        assert_eq!(ha[..2], hb[..2]);
        assert_ne!(ha[2], hb[2]);
        // Another seed (the server's) gives other values for the same blocks.
        assert_ne!(piece_block_hashes(&a, 64, 10)[0], ha[0]);
    }

    #[test]
    fn a_piece_split_differently_is_a_different_prompt() {
        // Same ids, other lengths: token 64.. comes from another place.
        let a = [Piece { id: 1, tokens: 64 }, Piece { id: 2, tokens: 64 }];
        let b = [Piece { id: 1, tokens: 32 }, Piece { id: 2, tokens: 96 }];
        let (ha, hb) = (piece_block_hashes(&a, 64, 0), piece_block_hashes(&b, 64, 0));
        assert_ne!(ha[0], hb[0]);
    }

    #[test]
    fn ceiling_of_a_370_token_prompt_with_64_token_blocks_is_320() {
        // By hand: 369 / 64 = 5 whole blocks = 320 tokens; 320 / 370 = 86.5 %.
        assert_eq!(cacheable_tokens(370, 64), 320);
        let r = cacheable_tokens(370, 64) as f64 / 370.0;
        assert!((r - 0.8649).abs() < 1e-4, "{r}");
        // A prompt of exactly 5 blocks keeps its last token to compute.
        assert_eq!(cacheable_tokens(320, 64), 256);
        assert_eq!(cacheable_tokens(0, 64), 0);
    }
}

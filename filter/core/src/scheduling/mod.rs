//! llm-d-compatible scheduling: one profile = filters, then weighted scorers,
//! then a picker.
//!
//! The input is a snapshot of candidate endpoints (the host reads it from
//! shared state); the output is a primary endpoint, an ordered fallback list
//! and an explanation. Nothing here touches shared state or the clock; the
//! randomness comes from an injected, seeded [`Rng`].
//!
//! One concept per file, each with its formula at the top:
//! [`affinity_filter`], the scorers ([`token_load`], [`active_request`],
//! [`queue`], [`kv_cache_utilization`], [`prefix_cache`], [`no_hit_lru`],
//! [`lora_affinity`], [`session_affinity_scorer`], and kvroute's own:
//! [`saturation`]'s `kvroute-load-scorer` and [`cache_balance`]),
//! [`session_affinity_filter`] (with [`session`], what the two session
//! plugins share),
//! the pickers ([`max_score`], [`weighted_random`]), [`rng`],
//! [`scheduler`] which runs a profile, and [`charge`] for the in-flight
//! accounting a decision causes. Each plugin's file also holds its
//! parameters and their checks (`compile`); [`registry`] names every plugin
//! type and holds the [`Scorer`] enum the scheduler dispatches on.

pub mod active_request;
pub mod affinity_filter;
pub mod cache_balance;
pub mod charge;
pub mod kv_cache_utilization;
pub mod lora_affinity;
pub mod max_score;
pub mod no_hit_lru;
pub mod prefix_cache;
pub mod queue;
pub mod registry;
pub mod rng;
pub mod saturation;
pub mod scheduler;
pub mod session;
pub mod session_affinity_filter;
pub mod session_affinity_scorer;
pub mod token_load;
pub mod weighted_random;

pub use registry::Scorer;
pub use rng::Rng;
pub use scheduler::{Branch, CandidateReport, Decision, Picker, Scheduler};

/// What the scheduler needs to know about the request.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct RequestView {
    /// Estimated prompt tokens.
    pub prompt_tokens: u64,
    /// Full prompt blocks that were hashed (the affinity denominator).
    pub total_blocks: u32,
    /// Tokens per block.
    pub block_size_tokens: u32,
    /// The client's output cap (`max_tokens` and friends), if any.
    pub max_output_tokens: Option<u64>,
    /// The fleet's learnt mean output tokens per request
    /// (`learners::output_tokens`), when `inflight-load-producer` learns
    /// it and the servers have taught it; else `None`.
    pub learnt_output_tokens: Option<u64>,
    /// What `max-score-picker`'s `tieBreak: prefix` hashes: the request's
    /// block hash at the end of the index group holding block `m` (or its
    /// last block), where `m` is the longest match any candidate has: past
    /// what the fleet holds (a match can stop up to a group short of a
    /// shared prefix's end, `index::group_key`), so requests that share
    /// only a common prefix (a system prompt) still spread, while identical
    /// prompts get the same key.
    /// `None` without a full block.
    pub tie_key: Option<u64>,
}

/// Polled vLLM metrics of one endpoint. The host passes `None` when it has
/// none or they are older than `collector.metricsStaleAfterMs`.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct EndpointMetrics {
    /// `vllm:num_requests_waiting`
    pub waiting_requests: f64,
    /// `vllm:num_requests_running`
    pub running_requests: f64,
    /// `vllm:kv_cache_usage_perc`, in [0, 1].
    pub kv_cache_usage: f64,
    /// The server's KV capacity in its own tokens
    /// (`vllm:cache_config_info` `num_gpu_blocks × block_size`); 0 = unknown.
    pub kv_capacity_tokens: u64,
}

/// One candidate endpoint as the scheduler sees it.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Candidate {
    /// Longest run of the request's blocks, from block 0, that this endpoint
    /// is believed to hold.
    pub matched_blocks: u32,
    /// Blocks just past `matched_blocks` the approximate index cannot look
    /// up, so may be held too (up to 7, where the match ends at the start
    /// of a whole index group: `kvroute_shared_state::index::unresolved_after`);
    /// 0 in precise mode. The affinity filter's `countUnresolvedBlocks`
    /// counts them in its threshold test.
    pub unresolved_blocks: u32,
    /// In-flight tokens charged to this endpoint (uncached prompt tokens not
    /// yet prefilled, plus any output estimate).
    pub inflight_tokens: u64,
    /// In-flight requests on this endpoint.
    pub inflight_requests: u64,
    /// The prompt part of `inflight_tokens`: uncached prompt tokens of
    /// requests that have not sent their first token (prefill in flight).
    pub inflight_prefill_tokens: u64,
    /// The rest of `inflight_tokens`: the output estimates, or with
    /// `holdKvUntilEnd` the KV each in-flight request holds (prompt +
    /// output estimate), released at the end of the stream.
    pub inflight_held_tokens: u64,
    /// The endpoint's insert counter in the prefix index (blocks ever
    /// inserted for it, monotone): how much new cache it has been given.
    pub inserted_blocks: u64,
    /// Its index capacity in blocks (what `inserted_blocks` is aged against).
    pub capacity_blocks: u64,
    pub metrics: Option<EndpointMetrics>,
    /// When this endpoint last received a cold request (a monotone stamp,
    /// larger = more recent), for `no-hit-lru-scorer`; `None` if never.
    pub last_cold_pick: Option<u64>,
    /// The collector's prefill-throughput estimate for this endpoint,
    /// tokens/s, while its metrics are fresh (`learners::prefill_rate`);
    /// the affinity filter uses it with `peakPrefillThroughput: "auto"`.
    pub prefill_tokens_per_s: Option<f64>,
    /// A stable hash of the endpoint's `ip:port` (the same in every gateway
    /// replica), for rendezvous tie-breaking.
    pub key: u64,
    /// Its LoRA adapter state towards the request's model
    /// (`lora-affinity-scorer`).
    pub lora: lora_affinity::LoraSlots,
    /// The request's session points at this endpoint (a session token or
    /// binding, `session-affinity-*`; see [`session`]). At most one
    /// candidate has it.
    pub session: bool,
}

impl Candidate {
    /// Affinity = matched blocks / request blocks, in [0, 1]; 0 when the
    /// request has no full block.
    pub fn affinity(&self, req: &RequestView) -> f64 {
        if req.total_blocks == 0 {
            0.0
        } else {
            f64::from(self.matched_blocks.min(req.total_blocks)) / f64::from(req.total_blocks)
        }
    }

    /// The largest affinity the index cannot rule out: matched plus
    /// unresolved blocks over request blocks, in [0, 1].
    pub fn possible_affinity(&self, req: &RequestView) -> f64 {
        if req.total_blocks == 0 {
            0.0
        } else {
            let m = self.matched_blocks.saturating_add(self.unresolved_blocks);
            f64::from(m.min(req.total_blocks)) / f64::from(req.total_blocks)
        }
    }

    /// Prompt tokens this endpoint would have to prefill:
    /// `prompt_tokens − min(prompt_tokens, matched_blocks × block_size)`.
    pub fn uncached_tokens(&self, req: &RequestView) -> u64 {
        let cached = u64::from(self.matched_blocks) * u64::from(req.block_size_tokens);
        req.prompt_tokens - cached.min(req.prompt_tokens)
    }
}

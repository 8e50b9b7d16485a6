//! The pure model of one vLLM server: continuous batching with chunked
//! prefill over a block-granular prefix cache. No I/O and no clock: the
//! caller passes model time in and sleeps for the returned iteration time.
//!
//! One call to [`Engine::step`] is one iteration, scheduled as vLLM v1's
//! scheduler does:
//! 1. Running requests first, in admission order. A decoding request takes
//!    one token of the budget `B = max_num_batched_tokens`; a request still
//!    prefilling takes `min(remaining, budget left)` (chunked prefill). When
//!    a running request cannot get a KV block, the most recently admitted
//!    running request is preempted (its blocks are freed, it goes back to the
//!    front of the queue and later recomputes), as vLLM's recompute
//!    preemption does.
//! 2. Then waiting requests, first come first served, while fewer than
//!    `max_num_seqs` run and budget is left: the prefix cache is looked up
//!    (hits count from block 0, consecutive; at most `(tokens − 1) / block`
//!    blocks so the last token is always computed), blocks are taken for
//!    the first chunk, and if they cannot be had the queue stops there
//!    (head-of-line: the request waits).
//! 3. The iteration time comes from [`StepCost`]; tokens computed in the
//!    iteration are credited at its end: a request whose known tokens are all
//!    computed samples one new token (its first token ends prefill).
//!
//! Full prompt blocks are cached as soon as they are scheduled for compute.
//! Output tokens take KV blocks but are not cached (see the README).

pub mod prefix_cache;
pub mod step_cost;

use prefix_cache::{BlockId, PrefixCache};
use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
pub use step_cost::StepCost;

use crate::kv_events::KvEvent;

/// Capacity and batching knobs of one emulated server.
#[derive(Clone, Debug, PartialEq)]
pub struct EngineConfig {
    /// Tokens per KV block (`--block-size`).
    pub block_size: u32,
    /// KV cache size in blocks (`--num-gpu-blocks`).
    pub num_gpu_blocks: u32,
    /// Token budget of one iteration, B (`--max-num-batched-tokens`).
    pub max_num_batched_tokens: u32,
    /// Most sequences in one iteration (`--max-num-seqs`).
    pub max_num_seqs: u32,
    /// Longest prompt + output accepted, tokens (`--max-model-len`); also
    /// capped at the cache size so an admitted request can always run.
    pub max_model_len: u32,
    pub step_cost: StepCost,
}

impl Default for EngineConfig {
    /// Qwen3-32B on 2×H100 with vLLM's 16-token blocks: 16,384 blocks
    /// (262,144 tokens of KV).
    fn default() -> Self {
        EngineConfig {
            block_size: 16,
            num_gpu_blocks: 16_384,
            max_num_batched_tokens: 8192,
            max_num_seqs: 256,
            max_model_len: 40_960,
            step_cost: StepCost::default(),
        }
    }
}

impl EngineConfig {
    /// The longest request (prompt + output tokens) that can be admitted.
    pub fn effective_max_model_len(&self) -> u64 {
        u64::from(self.max_model_len)
            .min(u64::from(self.num_gpu_blocks) * u64::from(self.block_size))
    }
}

/// What the engine needs to know about a request.
#[derive(Clone, Debug, Default)]
pub struct EngineRequest {
    /// Prompt length, tokens.
    pub prompt_tokens: u32,
    /// Chained hashes of the prompt's full blocks, from block 0.
    pub block_hashes: Vec<u64>,
    /// The prompt's token IDs (real or stand-in), for `BlockStored` events.
    pub event_token_ids: Option<Arc<[u32]>>,
    /// Extra hash keys of block 0 (vLLM puts the cache salt there).
    pub first_block_extra_keys: Option<Vec<String>>,
    /// Tokens to generate (≥ 1); the emulator always generates exactly this.
    pub output_tokens: u32,
}

/// Engine-wide request handle.
pub type RequestId = u64;

/// Why a request was refused at admission.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum AdmitError {
    /// Prompt + output exceed the context length or the whole KV cache.
    TooLong { requested: u64, max_model_len: u64 },
}

/// What one iteration produced for one request, credited at its end.
#[derive(Clone, Debug, PartialEq)]
pub struct TokenOutput {
    pub id: RequestId,
    /// True for the request's first output token (end of prefill).
    pub first: bool,
    /// Output tokens generated so far, including this one.
    pub generated: u32,
    /// Prompt tokens served from the prefix cache at admission.
    pub cached_tokens: u32,
    pub finished: bool,
}

/// One iteration's result.
#[derive(Clone, Debug, Default)]
pub struct StepResult {
    /// Model seconds the iteration takes; outputs are due at `now + duration_s`.
    pub duration_s: f64,
    pub prefill_tokens: u64,
    pub decode_seqs: u64,
    pub outputs: Vec<TokenOutput>,
    /// KV events of the iteration (empty unless enabled).
    pub kv_events: Vec<KvEvent>,
}

/// vLLM's TTFT histogram buckets, seconds.
pub const TTFT_BUCKETS_S: [f64; 22] = [
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
];

/// vLLM's `vllm:request_prefill_time_seconds` buckets, seconds (its
/// request-latency buckets).
pub const REQUEST_LATENCY_BUCKETS_S: [f64; 21] = [
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
    480.0, 960.0, 1920.0, 7680.0,
];

/// vLLM's 1-2-5 buckets up to `max` (`build_1_2_5_buckets`), used for
/// token-count histograms: 1, 2, 5, 10, 20, 50, … ≤ max.
pub fn buckets_1_2_5(max: u64) -> Vec<f64> {
    let mut out = Vec::new();
    let mut scale = 1u64;
    'outer: loop {
        for m in [1u64, 2, 5] {
            let v = m.saturating_mul(scale);
            if v > max {
                break 'outer;
            }
            out.push(v as f64);
        }
        scale = scale.saturating_mul(10);
    }
    out
}

/// A cumulative histogram with fixed upper bounds.
#[derive(Clone, Debug, PartialEq)]
pub struct Histogram {
    pub bounds: Vec<f64>,
    /// Non-cumulative counts per bound; the last slot is `+Inf`.
    pub counts: Vec<u64>,
    pub sum: f64,
    pub count: u64,
}

impl Histogram {
    pub fn new(bounds: &[f64]) -> Histogram {
        Histogram {
            bounds: bounds.to_vec(),
            counts: vec![0; bounds.len() + 1],
            sum: 0.0,
            count: 0,
        }
    }

    pub fn observe(&mut self, v: f64) {
        let i = self
            .bounds
            .iter()
            .position(|&b| v <= b)
            .unwrap_or(self.bounds.len());
        self.counts[i] += 1;
        self.sum += v;
        self.count += 1;
    }
}

/// Monotone counters, as vLLM exports them.
#[derive(Clone, Debug, PartialEq, Default)]
pub struct EngineCounters {
    /// Requests admitted to the waiting queue.
    pub requests: u64,
    /// Requests that generated all their tokens.
    pub requests_finished: u64,
    /// Requests aborted (client gone).
    pub requests_aborted: u64,
    /// Prompt tokens of requests whose prefill completed.
    pub prompt_tokens: u64,
    /// Output tokens generated.
    pub generation_tokens: u64,
    /// Tokens looked up in the prefix cache (`vllm:prefix_cache_queries`).
    pub prefix_cache_queries: u64,
    /// Of those, tokens found (`vllm:prefix_cache_hits`).
    pub prefix_cache_hits: u64,
    pub preemptions: u64,
}

#[derive(Clone, Debug)]
struct RequestState {
    req: EngineRequest,
    arrival_s: f64,
    /// Tokens whose KV is computed (prompt, then generated).
    computed: u32,
    generated: u32,
    blocks: Vec<BlockId>,
    /// Prompt blocks already registered in the cache by this request.
    stored_blocks: usize,
    /// Prompt tokens hit in the cache at first admission.
    cached_tokens: u32,
    ever_admitted: bool,
    /// Model seconds; start of the iteration that first scheduled it.
    scheduled_s: f64,
    /// Model seconds; end of the iteration that produced its first token.
    first_token_s: f64,
}

impl RequestState {
    fn total_tokens(&self) -> u32 {
        self.req.prompt_tokens + self.generated
    }
}

/// One emulated vLLM engine.
#[derive(Clone, Debug)]
pub struct Engine {
    cfg: EngineConfig,
    cache: PrefixCache,
    waiting: VecDeque<RequestId>,
    running: Vec<RequestId>,
    requests: HashMap<RequestId, RequestState>,
    next_id: RequestId,
    pub counters: EngineCounters,
    /// Time to first token, model seconds.
    pub ttft: Histogram,
    /// `vllm:request_prefill_time_seconds`: first token − first scheduled,
    /// model seconds; observed when a request finishes, as vLLM does.
    pub prefill_time: Histogram,
    /// `vllm:request_prefill_kv_computed_tokens`: prompt − cached tokens;
    /// observed with `prefill_time`.
    pub prefill_kv_computed: Histogram,
    /// `vllm:request_generation_tokens`: tokens generated; observed when a
    /// request finishes.
    pub generation_tokens: Histogram,
}

impl Engine {
    pub fn new(cfg: EngineConfig, kv_events: bool) -> Engine {
        let kv_buckets = buckets_1_2_5(cfg.max_model_len.into());
        Engine {
            cache: PrefixCache::new(cfg.num_gpu_blocks, cfg.block_size, kv_events),
            cfg,
            waiting: VecDeque::new(),
            running: Vec::new(),
            requests: HashMap::new(),
            next_id: 1,
            counters: EngineCounters::default(),
            ttft: Histogram::new(&TTFT_BUCKETS_S),
            prefill_time: Histogram::new(&REQUEST_LATENCY_BUCKETS_S),
            prefill_kv_computed: Histogram::new(&kv_buckets),
            generation_tokens: Histogram::new(&kv_buckets),
        }
    }

    pub fn config(&self) -> &EngineConfig {
        &self.cfg
    }

    pub fn cache(&self) -> &PrefixCache {
        &self.cache
    }

    pub fn num_running(&self) -> usize {
        self.running.len()
    }

    pub fn num_waiting(&self) -> usize {
        self.waiting.len()
    }

    pub fn has_work(&self) -> bool {
        !self.running.is_empty() || !self.waiting.is_empty()
    }

    /// Queues a request that arrived at `now_s` (model seconds).
    pub fn add_request(&mut self, req: EngineRequest, now_s: f64) -> Result<RequestId, AdmitError> {
        let mut req = req;
        req.output_tokens = req.output_tokens.max(1);
        let requested = u64::from(req.prompt_tokens) + u64::from(req.output_tokens);
        let max = self.cfg.effective_max_model_len();
        if requested > max {
            return Err(AdmitError::TooLong {
                requested,
                max_model_len: max,
            });
        }
        let id = self.next_id;
        self.next_id += 1;
        self.requests.insert(
            id,
            RequestState {
                req,
                arrival_s: now_s,
                computed: 0,
                generated: 0,
                blocks: Vec::new(),
                stored_blocks: 0,
                cached_tokens: 0,
                ever_admitted: false,
                scheduled_s: now_s,
                first_token_s: now_s,
            },
        );
        self.waiting.push_back(id);
        self.counters.requests += 1;
        Ok(id)
    }

    /// Drops a request wherever it is (the client went away).
    pub fn abort(&mut self, id: RequestId) {
        if let Some(st) = self.requests.remove(&id) {
            self.waiting.retain(|&w| w != id);
            self.running.retain(|&r| r != id);
            self.cache.free(&st.blocks);
            self.counters.requests_aborted += 1;
        }
    }

    /// Clears the prefix cache and zeroes the counters (`/emulator/reset`).
    pub fn reset_cache_and_counters(&mut self) {
        self.cache.clear();
        self.counters = EngineCounters::default();
        self.ttft = Histogram::new(&TTFT_BUCKETS_S);
        self.prefill_time = Histogram::new(&REQUEST_LATENCY_BUCKETS_S);
        self.prefill_kv_computed = Histogram::new(&self.prefill_kv_computed.bounds.clone());
        self.generation_tokens = Histogram::new(&self.generation_tokens.bounds.clone());
    }

    /// Events not yet handed out by `step` (e.g. from a reset).
    pub fn drain_kv_events(&mut self) -> Vec<KvEvent> {
        self.cache.drain_events()
    }

    fn blocks_for(&self, tokens: u32) -> u32 {
        tokens.div_ceil(self.cfg.block_size)
    }

    /// Frees a running request's blocks and puts it back at the queue front.
    fn preempt(&mut self, id: RequestId) {
        if let Some(st) = self.requests.get_mut(&id) {
            self.cache.free(&st.blocks);
            st.blocks.clear();
            st.computed = 0;
            st.stored_blocks = 0;
            self.waiting.push_front(id);
            self.counters.preemptions += 1;
        }
    }

    /// Registers the request's prompt blocks that `computed_after` tokens fill.
    fn store_full_prompt_blocks(&mut self, id: RequestId, computed_after: u32) {
        let bs = self.cfg.block_size as usize;
        let Some(st) = self.requests.get_mut(&id) else {
            return;
        };
        let full = (computed_after as usize / bs).min(st.req.block_hashes.len());
        if full <= st.stored_blocks {
            return;
        }
        let from = st.stored_blocks;
        let parent = from.checked_sub(1).map(|i| st.req.block_hashes[i]);
        let tokens: &[u32] = match &st.req.event_token_ids {
            Some(t) => &t[(from * bs).min(t.len())..(full * bs).min(t.len())],
            None => &[],
        };
        let extra = st.req.first_block_extra_keys.as_ref().map(|k| {
            (from..full)
                .map(|i| if i == 0 { Some(k.clone()) } else { None })
                .collect()
        });
        self.cache.store(
            &st.blocks[from..full],
            &st.req.block_hashes[from..full],
            parent,
            tokens,
            extra,
        );
        st.stored_blocks = full;
    }

    /// Runs one iteration starting at `now_s` (model seconds).
    pub fn step(&mut self, now_s: f64) -> StepResult {
        let mut budget = self.cfg.max_num_batched_tokens;
        // (request, tokens computed this iteration)
        let mut scheduled: Vec<(RequestId, u32)> = Vec::new();
        let mut preempted = false;

        // 1. Running requests, in admission order.
        let mut i = 0;
        while i < self.running.len() && budget > 0 {
            let id = self.running[i];
            let st = &self.requests[&id];
            let n = (st.total_tokens() - st.computed).min(budget);
            let need = self
                .blocks_for(st.computed + n)
                .saturating_sub(st.blocks.len() as u32);
            let mut self_preempted = false;
            while !self.cache.can_allocate(&[], need) {
                let Some(victim) = self.running.pop() else {
                    break;
                };
                self.preempt(victim);
                preempted = true;
                if victim == id {
                    self_preempted = true;
                    break;
                }
            }
            if self_preempted {
                break;
            }
            let Some(new_blocks) = self.cache.allocate(need) else {
                break;
            };
            let st = self.requests.get_mut(&id).expect("running request exists");
            st.blocks.extend(new_blocks);
            let after = st.computed + n;
            self.store_full_prompt_blocks(id, after);
            budget -= n;
            scheduled.push((id, n));
            i += 1;
        }

        // 2. Waiting requests, FCFS, unless this iteration had to preempt.
        while !preempted && budget > 0 && (self.running.len() as u32) < self.cfg.max_num_seqs {
            let Some(&id) = self.waiting.front() else {
                break;
            };
            let bs = self.cfg.block_size;
            let st = &self.requests[&id];
            let total = st.total_tokens();
            let max_hit_blocks = ((total.saturating_sub(1)) / bs) as usize;
            let hashes = &st.req.block_hashes[..st.req.block_hashes.len().min(max_hit_blocks)];
            let hits = self.cache.longest_cached_prefix(hashes);
            let computed0 = hits.len() as u32 * bs;
            let n = (total - computed0).min(budget);
            let need = self.blocks_for(computed0 + n) - hits.len() as u32;
            if !self.cache.can_allocate(&hits, need) {
                break; // head-of-line: it waits for blocks
            }
            self.cache.touch(&hits);
            let Some(new_blocks) = self.cache.allocate(need) else {
                self.cache.free(&hits);
                break;
            };
            self.waiting.pop_front();
            self.counters.prefix_cache_queries += u64::from(total);
            self.counters.prefix_cache_hits += u64::from(computed0);
            let st = self.requests.get_mut(&id).expect("waiting request exists");
            if !st.ever_admitted {
                st.cached_tokens = computed0;
                st.ever_admitted = true;
                st.scheduled_s = now_s;
            }
            st.stored_blocks = hits.len();
            st.blocks = hits;
            st.blocks.extend(new_blocks);
            st.computed = computed0;
            self.store_full_prompt_blocks(id, computed0 + n);
            budget -= n;
            self.running.push(id);
            scheduled.push((id, n));
        }

        // 3. Cost of the iteration.
        let mut prefill_tokens = 0u64;
        let mut prefill_attended = 0u64;
        let mut decode_seqs = 0u64;
        let mut context_tokens = 0u64;
        for &(id, n) in &scheduled {
            let st = &self.requests[&id];
            let decoding = st.generated > 0 && n == 1 && st.computed + 1 == st.total_tokens();
            if decoding {
                decode_seqs += 1;
                context_tokens += u64::from(st.computed);
            } else {
                prefill_tokens += u64::from(n);
                prefill_attended +=
                    step_cost::attended_context(u64::from(st.computed), u64::from(n));
            }
        }
        let duration_s = self.cfg.step_cost.iteration_seconds(
            prefill_tokens,
            prefill_attended,
            decode_seqs,
            context_tokens,
        );
        let end_s = now_s + duration_s;

        // 4. Credit the computed tokens at the iteration's end.
        let mut outputs = Vec::new();
        for (id, n) in scheduled {
            let Some(st) = self.requests.get_mut(&id) else {
                continue;
            };
            st.computed += n;
            if st.computed < st.total_tokens() {
                continue; // mid-prefill chunk
            }
            st.generated += 1;
            let first = st.generated == 1;
            if first {
                st.first_token_s = end_s;
                self.ttft.observe((end_s - st.arrival_s).max(0.0));
                self.counters.prompt_tokens += u64::from(st.req.prompt_tokens);
            }
            self.counters.generation_tokens += 1;
            let finished = st.generated >= st.req.output_tokens;
            outputs.push(TokenOutput {
                id,
                first,
                generated: st.generated,
                cached_tokens: st.cached_tokens,
                finished,
            });
            if finished {
                self.prefill_time
                    .observe((st.first_token_s - st.scheduled_s).max(0.0));
                self.prefill_kv_computed.observe(f64::from(
                    st.req.prompt_tokens.saturating_sub(st.cached_tokens),
                ));
                self.generation_tokens.observe(f64::from(st.generated));
                let blocks = std::mem::take(&mut st.blocks);
                self.cache.free(&blocks);
                self.requests.remove(&id);
                self.running.retain(|&r| r != id);
                self.counters.requests_finished += 1;
            }
        }

        StepResult {
            duration_s,
            prefill_tokens,
            decode_seqs,
            outputs,
            kv_events: self.cache.drain_events(),
        }
    }
}

//! kvroute's load signal: what saturates a vLLM server, in tokens, and the
//! `kvroute-load-scorer` over it. The affinity filter's gate uses the same
//! signal with `loadSignal: "saturation"`.
//!
//! ## Why llm-d's signal is not enough
//!
//! llm-d's in-flight load counts only the uncached prompt tokens of
//! requests still in prefill; they are released at the first token. A
//! server busy decoding, or with its KV cache full, therefore looks idle:
//! its TTFT grows (each engine step also carries every decoding sequence,
//! and a new request waits for KV blocks to free up) while the count stays
//! near 0, so the gate never releases and cold placement sees ties
//! everywhere.
//!
//! ## The signal, per endpoint e
//!
//! Own counts (this gateway's, from the load table, current to the request):
//! - `P(e)`: in-flight prefill tokens (prompt parts not yet at their first
//!   token);
//! - `H(e)`: held KV tokens (with `holdKvUntilEnd`: each in-flight
//!   request's uncached prompt tokens + output estimate, released at the end
//!   of its stream);
//! - `n(e)`: in-flight requests.
//!
//! The server's view, when its metrics are fresh (`collector.
//! metricsStaleAfterMs`; stale metrics are ignored, never read as idle or
//! busy): `W` = `vllm:num_requests_waiting`, `R` =
//! `vllm:num_requests_running`, `u` = `vllm:kv_cache_usage_perc` (blocks
//! referenced by running requests; cached-but-free blocks do not count) and
//! `C` = KV capacity, `num_gpu_blocks × block_size` tokens. The server
//! counts every gateway's requests; what it counts beyond ours is other
//! replicas' load (as of the last poll). Merged:
//!
//! - foreign requests `f(e) = max(0, W + R − 1.25·n(e) − 1)`, each taken to
//!   weigh what ours weigh on average, `ℓ(e) = (P + H)/n` (this request's
//!   own `x(e)` when we have none there). vLLM does not export queued
//!   tokens. The dead band (a quarter of our count, plus one) absorbs the
//!   poll's lag: our count is current, the server's is one poll old, and
//!   with one gateway the two differ only by what started or ended since.
//!   (Measured in the simulator without it: a busy warm server looked
//!   busier than it was and the gate spilled code-generation turns.)
//! - queue `L(e) = P(e) + H(e) + f(e) × ℓ(e)` tokens. Held tokens count as
//!   load at the prefill rate: a server's step time grows with the
//!   sequences it decodes, so a new prefill shares each step with them (the
//!   same view as llm-d's `addEstimatedOutputTokens`, kept until the end).
//! - KV held `K(e) = max(H(e), u × C)`; without a known `C`,
//!   `K(e) = max(H(e), ℓ_H × R)` with `ℓ_H = H/n`, our mean footprint.
//! - KV admission: vLLM admits a request only when the new KV it needs is
//!   free, so what does not fit waits for running requests to finish. While
//!   the server is queueing (`W ≥ 1`; a full cache with nothing waiting is
//!   vLLM's normal greedy use of it), the overflow
//!   `O(e) = max(0, K(e) + (W + 1) × x(e) − C)` tokens must be freed first
//!   (`x(e)` = this request's uncached tokens on e, and each waiting request
//!   is taken to need as much; 0 when `C` is unknown).
//!
//! With one gateway and room in the KV cache, `L = P + H`: exactly the
//! in-flight tokens llm-d's gate compares (with the held part).
//!
//! TTFT estimate (the gate's, ms):
//! `ttft(e) = (L(e) + O(e) + x(e)) / rate(e) × 1000`, where `rate(e)` is
//! the gate's prefill rate (`peakPrefillThroughput` or its online estimate)
//! and `x(e)` is this request's own prefill there: what it would wait for
//! on e, its own uncached tokens included. Freeing KV takes decode steps,
//! so counting the overflow at the prefill rate is a lower bound on the
//! admission wait: the gate errs towards staying sticky.
//!
//! Why `x(e)`: llm-d's gate compares only the queues, so a release is
//! priced as if the request's prefill cost the same everywhere; it costs
//! the whole uncached prompt on a cold endpoint and almost nothing on the
//! warm one. With held KV in `L` (decoding requests count until their
//! streams end) the queues of a fleet near its capacity differ by more
//! than τ often, and without `x` a long-context request left its warm
//! server whenever they did: in the simulator's agent-session (long
//! contexts near the knee) `x` cut the share of released requests and
//! raised the knee, and through Envoy it brought the default's knees level
//! with or above llm-d matched's (`docs/lab/2026-12-06-gate-own-prefill.md`;
//! the figures once quoted here: `docs/lab/2026-12-06-measurements-from-code-comments.md`).
//! A short prompt (small `x`) is released as before. With own counts only, the gate is
//! llm-d's token gap over in-flight tokens plus `x` on each side (tests in
//! `affinity_filter`).
//!
//! ## `kvroute-load-scorer`
//!
//! `score(e) = 1 − ½·min(1, (Lp(e) + O(e) + x(e)) / Q) − ½·min(1, (K(e) + h) / C')`
//!
//! - the first half is llm-d's token-load score over the merged prefill
//!   queue `Lp = P + f × P/n` (the prefill part of `L`; `f × x` with none of
//!   ours), with the same lookahead `x(e)` (a warm endpoint costs this
//!   request less);
//! - the second half is KV (decode) pressure after placing this request:
//!   `h` = the new KV the request will hold there (its uncached tokens +
//!   output estimate), which also favours the warm endpoint;
//!   `C' = C` when known, else `kvCapacityTokens`.
//!
//! `Q` = `queueThresholdTokens` (default 32,768: two seconds of prefill at
//! 16k tok/s, the scale of a TTFT objective; llm-d's 4M makes the score
//! nearly flat, so only ties decide). The lookahead `x` makes Q also the
//! price of a cold prefill: with 65,536, a 6,000-token prefix recomputed on
//! a cold endpoint weighed little against load, and on the skewed
//! shared-prefix workload hot prefixes were copied more than needed (in the
//! simulator 32,768 gave a higher hit ratio and knee there, and moved the
//! other workloads by less than the seeds differ;
//! `docs/lab/2026-12-02-default-tuning.md`).
//! An idle endpoint scores 1; the score is in [0, 1].

use super::{Candidate, RequestView};
use crate::config::check::{range_u64, Params};
use crate::config::ConfigError;
use serde::Deserialize;

/// The signal of one endpoint for one request (see the module doc), tokens.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Signal {
    /// `L`: prefill and held tokens queued on the server, ours and others'.
    pub queue_tokens: f64,
    /// The prefill part of `L`: `P + f × P/n` (`f × x` with none of ours).
    pub prefill_tokens: f64,
    /// `O`: KV tokens that must be freed before this request is admitted.
    pub admission_tokens: f64,
    /// `K`: KV tokens held by in-flight requests.
    pub kv_tokens: f64,
    /// `C`: the server's KV capacity, if known.
    pub kv_capacity_tokens: Option<f64>,
    /// `x`: this request's own uncached tokens here.
    pub request_tokens: f64,
}

impl Signal {
    /// `L + O + x`: what stands between this request and its first token,
    /// its own prefill included, in prefill-equivalent tokens.
    pub fn ttft_tokens(&self) -> f64 {
        self.queue_tokens + self.admission_tokens + self.request_tokens
    }
}

/// The signal of `c` for `req` (module doc). Never negative, never NaN.
pub fn signal(req: &RequestView, c: &Candidate) -> Signal {
    let own_prefill = c.inflight_prefill_tokens as f64;
    let own_held = c.inflight_held_tokens as f64;
    let own = own_prefill + own_held;
    let x = c.uncached_tokens(req) as f64;
    let clean = |v: f64| if v.is_finite() && v > 0.0 { v } else { 0.0 };
    let Some(m) = c.metrics else {
        return Signal {
            queue_tokens: own,
            prefill_tokens: own_prefill,
            admission_tokens: 0.0,
            kv_tokens: own_held,
            kv_capacity_tokens: None,
            request_tokens: x,
        };
    };
    let n = c.inflight_requests as f64;
    let waiting = clean(m.waiting_requests);
    let running = clean(m.running_requests);
    let usage = clean(m.kv_cache_usage).min(1.0);
    let foreign = clean(waiting + running - 1.25 * n - 1.0);
    let (per_request, per_prefill) = if n > 0.0 {
        (own / n, own_prefill / n)
    } else {
        (x, x)
    };
    let queue = own + foreign * per_request;
    let (kv, capacity) = if m.kv_capacity_tokens > 0 {
        let cap = m.kv_capacity_tokens as f64;
        (own_held.max(usage * cap), Some(cap))
    } else if n > 0.0 {
        (own_held.max(own_held / n * running), None)
    } else {
        (own_held, None)
    };
    // Only a server that is queueing (W ≥ 1) is refusing admissions.
    let admission = match capacity {
        Some(cap) if waiting >= 1.0 => clean(kv + (waiting + 1.0) * x - cap),
        _ => 0.0,
    };
    Signal {
        queue_tokens: clean(queue),
        prefill_tokens: clean(own_prefill + foreign * per_prefill),
        admission_tokens: admission,
        kv_tokens: clean(kv),
        kv_capacity_tokens: capacity,
        request_tokens: x,
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct KvrouteLoadScorer {
    /// `Q`, tokens.
    pub queue_threshold_tokens: f64,
    /// `C'` when the server's capacity is unknown, tokens.
    pub kv_capacity_tokens: f64,
}

impl Default for KvrouteLoadScorer {
    fn default() -> Self {
        KvrouteLoadScorer {
            queue_threshold_tokens: 32_768.0,
            kv_capacity_tokens: 1_048_576.0,
        }
    }
}

impl KvrouteLoadScorer {
    /// `held[i]` is the KV this request would hold on candidate `i`
    /// (`h`, tokens).
    pub fn score(
        &self,
        req: &RequestView,
        cands: &[Candidate],
        held: &[u64],
        idx: &[usize],
        out: &mut [f64],
    ) {
        for (o, &i) in out.iter_mut().zip(idx) {
            let c = &cands[i];
            let s = signal(req, c);
            // Held tokens count once, in the KV half.
            let queue = s.prefill_tokens + s.admission_tokens + s.request_tokens;
            let cap = s.kv_capacity_tokens.unwrap_or(self.kv_capacity_tokens);
            let h = held.get(i).copied().unwrap_or(0) as f64;
            let q = (queue / self.queue_threshold_tokens).min(1.0);
            let k = if cap > 0.0 {
                ((s.kv_tokens + h) / cap).min(1.0)
            } else {
                0.0
            };
            let v = 1.0 - 0.5 * q - 0.5 * k;
            *o = if v.is_finite() {
                v.clamp(0.0, 1.0)
            } else {
                0.0
            };
        }
    }
}

// ---------------------------------------------------------------------------
// Configuration: `kvroute-load-scorer` in `plugins`.

pub const TYPE: &str = "kvroute-load-scorer";

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct KvrouteLoadParams {
    queue_threshold_tokens: Option<u64>,
    kv_capacity_tokens: Option<u64>,
}

pub(crate) fn compile(p: &Params) -> Result<KvrouteLoadScorer, ConfigError> {
    let q: KvrouteLoadParams = p.parse()?;
    let d = KvrouteLoadScorer::default();
    Ok(KvrouteLoadScorer {
        queue_threshold_tokens: range_u64(
            &p.field("queueThresholdTokens"),
            q.queue_threshold_tokens,
            d.queue_threshold_tokens as u64,
            1,
            1 << 40,
            "tokens",
        )? as f64,
        kv_capacity_tokens: range_u64(
            &p.field("kvCapacityTokens"),
            q.kv_capacity_tokens,
            d.kv_capacity_tokens as u64,
            1,
            1 << 40,
            "tokens",
        )? as f64,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scheduling::EndpointMetrics;

    fn req(tokens: u64) -> RequestView {
        RequestView {
            prompt_tokens: tokens,
            total_blocks: (tokens / 10) as u32,
            block_size_tokens: 10,
            max_output_tokens: None,
            learnt_output_tokens: None,
            tie_key: None,
        }
    }

    fn metrics(waiting: f64, running: f64, usage: f64, cap: u64) -> Option<EndpointMetrics> {
        Some(EndpointMetrics {
            waiting_requests: waiting,
            running_requests: running,
            kv_cache_usage: usage,
            kv_capacity_tokens: cap,
        })
    }

    #[test]
    fn own_counts_only_without_fresh_metrics() {
        // The engine passes `metrics: None` for stale metrics: only our own
        // counts count, and there is no admission term.
        let c = Candidate {
            inflight_prefill_tokens: 700,
            inflight_held_tokens: 5000,
            inflight_requests: 2,
            ..Default::default()
        };
        let s = signal(&req(100), &c);
        assert_eq!(
            s,
            Signal {
                queue_tokens: 5700.0,
                prefill_tokens: 700.0,
                admission_tokens: 0.0,
                kv_tokens: 5000.0,
                kv_capacity_tokens: None,
                request_tokens: 100.0,
            }
        );
    }

    #[test]
    fn merges_the_servers_view_with_our_own() {
        // The server runs 8 + 3 requests, one of them ours: past the dead
        // band, 11 − 1.25 − 1 = 8.75 are another gateway's, each taken to
        // weigh what ours does (100 + 1000).
        let busy_elsewhere = Candidate {
            inflight_prefill_tokens: 100,
            inflight_held_tokens: 1000,
            inflight_requests: 1,
            metrics: metrics(3.0, 8.0, 0.5, 100_000),
            ..Default::default()
        };
        let s = signal(&req(400), &busy_elsewhere);
        assert_eq!(s.queue_tokens, 1100.0 + 8.75 * 1100.0);
        assert_eq!(s.prefill_tokens, 100.0 + 8.75 * 100.0);
        assert_eq!(s.kv_tokens, 50_000.0, "50% of 100k > our 1000");
        assert_eq!(s.admission_tokens, 0.0, "there is room");
        // All the server's requests are ours (one gateway): nothing added;
        // our counts are newer than the poll and win when larger.
        let ours = Candidate {
            inflight_prefill_tokens: 9000,
            inflight_held_tokens: 80_000,
            inflight_requests: 4,
            metrics: metrics(1.0, 2.0, 0.0, 100_000),
            ..Default::default()
        };
        let s = signal(&req(400), &ours);
        assert_eq!((s.queue_tokens, s.kv_tokens), (89_000.0, 80_000.0));
        // None of ours there: each of the 5 − 1 foreign requests weighs this
        // request's uncached tokens.
        let theirs = Candidate {
            metrics: metrics(2.0, 3.0, 0.1, 100_000),
            ..Default::default()
        };
        assert_eq!(signal(&req(400), &theirs).queue_tokens, 1600.0);
        // Without a capacity, our mean footprint × the server's running count.
        let no_cap = Candidate {
            inflight_held_tokens: 2000,
            inflight_requests: 2,
            metrics: metrics(0.0, 6.0, 0.9, 0),
            ..Default::default()
        };
        assert_eq!(signal(&req(10), &no_cap).kv_tokens, 6000.0);
    }

    #[test]
    fn full_kv_adds_the_admission_wait() {
        // 95% of 10k held, 2 waiting and this request, 1000 uncached tokens
        // each: 9500 + 3000 − 10000 = 2500 tokens must be freed first.
        let full = Candidate {
            metrics: metrics(2.0, 20.0, 0.95, 10_000),
            ..Default::default()
        };
        let s = signal(&req(1000), &full);
        assert_eq!(s.admission_tokens, 2500.0);
        // 21 foreign requests × this request's 1000 tokens, plus the wait,
        // plus its own prefill.
        assert_eq!(s.ttft_tokens(), 21_000.0 + 2500.0 + 1000.0);
        // A warm request needs less room: 9500 + 3 × 200 − 10000.
        let warm = Candidate {
            matched_blocks: 80,
            ..full
        };
        assert_eq!(signal(&req(1000), &warm).admission_tokens, 100.0);
        // Nothing waiting: a full cache is not a queue.
        let greedy = Candidate {
            metrics: metrics(0.0, 20.0, 1.0, 10_000),
            ..Default::default()
        };
        assert_eq!(signal(&req(1000), &greedy).admission_tokens, 0.0);
    }

    #[test]
    fn bad_metrics_are_bounded() {
        let c = Candidate {
            metrics: metrics(f64::NAN, -3.0, f64::INFINITY, 1000),
            ..Default::default()
        };
        let s = signal(&req(100), &c);
        assert!(s.queue_tokens == 0.0 && s.kv_tokens == 0.0, "{s:?}");
        let mut out = [9.0];
        KvrouteLoadScorer::default().score(&req(100), &[c], &[100], &[0], &mut out);
        assert!((0.0..=1.0).contains(&out[0]), "{out:?}");
    }

    #[test]
    fn scorer_sees_decode_pressure_that_token_load_misses() {
        // Both endpoints have no prefill in flight (llm-d's token load is 0
        // on both); endpoint 0 is full of decoding requests.
        let decoding = Candidate {
            inflight_held_tokens: 60_000,
            inflight_requests: 30,
            ..Default::default()
        };
        let idle = Candidate::default();
        let s = KvrouteLoadScorer {
            queue_threshold_tokens: 65_536.0,
            kv_capacity_tokens: 100_000.0,
        };
        let mut out = [0.0; 2];
        s.score(&req(100), &[decoding, idle], &[100, 100], &[0, 1], &mut out);
        assert!(out[1] > out[0], "{out:?}");
        // Idle and nothing to place scores exactly 1; saturation scores 0.
        s.score(&req(0), &[idle], &[0], &[0], &mut out[..1]);
        assert_eq!(out[0], 1.0);
        let swamped = Candidate {
            inflight_prefill_tokens: 1 << 40,
            inflight_held_tokens: 1 << 40,
            ..Default::default()
        };
        s.score(&req(0), &[swamped], &[0], &[0], &mut out[..1]);
        assert_eq!(out[0], 0.0);
    }
}

//! Time of one engine iteration (one forward pass over the batch).
//!
//! ```text
//! t = max((prefill_tokens + prefill_attended / C) / prefill_tokens_per_s,
//!         decode_step_ms / 1000)
//!     + decode_seqs × decode_ms_per_seq / 1000
//!     + decode_context_tokens × decode_ns_per_context_token / 1e9
//! ```
//!
//! where `prefill_attended` is the sum, over the prompt tokens computed in
//! the iteration, of the context each one attends to (the tokens before it,
//! cached or not), and `C = prefill_attention_context_tokens`.
//!
//! Why this shape:
//! - Prefill is compute-bound: a chunk of `p` tokens at the start of a prompt
//!   costs about `p / peak` seconds, and that compute hides the one-off cost
//!   of reading the weights.
//! - **Prefill cost grows with the attended context.** The weight matmuls
//!   cost `2·N` FLOPs per token (N parameters). Attention costs about
//!   `4·L·H` FLOPs per (token, earlier token) pair: `Q·Kᵀ` and `A·V`, over
//!   `L` layers of attention width `H = heads × head dim`. A token with `c`
//!   tokens before it therefore costs `(1 + c / C)` times a token with none,
//!   where `C = 2N / (4·L·H)`. For Qwen3-32B (N = 32.8e9, L = 64,
//!   H = 64 × 128 = 8192): `C = 65.5e9 / 2.1e6 ≈ 31,000`; the default rounds
//!   it to 32,768. So a 1200-token question after a cached 6000-token system
//!   prompt costs about 20 % more per token than the same question cold, and
//!   a turn deep in a 30k-token conversation about twice as much. `C = 0`
//!   turns the term off (the cost model of earlier releases).
//! - With the term off, a batch of exactly `B = max_num_batched_tokens` cold
//!   tokens takes `B/peak`, and the calibration recipe
//!   (`peakPrefillThroughput = B / median TTFT`) recovers
//!   `prefill_tokens_per_s` exactly. With it on, the recipe measures the
//!   effective rate at that prompt length (about 11 % lower at B = 8192).
//! - A forward pass can never be cheaper than reading the weights once:
//!   `decode_step_ms` is that floor (Qwen3-32B bf16 on 2×H100: ~25 ms with
//!   launch overheads).
//! - Each decoding sequence adds sampling/attention work (`decode_ms_per_seq`)
//!   and each token of context it attends to adds a KV read
//!   (`decode_ns_per_context_token`; Qwen3-32B keeps 256 KiB of KV per token,
//!   read over ~6.7 TB/s of HBM across two GPUs ≈ 40 ns/token).
//!   So the decode step grows with the batch, as on real hardware.

/// The cost model's constants. All times are model time (the hardware being
/// modelled), not wall-clock time; the time-scale factor lives in the glue.
#[derive(Clone, Debug, PartialEq)]
pub struct StepCost {
    /// Peak prefill rate, tokens/s (`--prefill-tps`).
    pub prefill_tokens_per_s: f64,
    /// Attended context at which a prefill token costs twice as much as one
    /// at the start of a prompt, tokens (`--prefill-attention-tokens`); 0 is
    /// off. See the module doc.
    pub prefill_attention_context_tokens: f64,
    /// Floor of one forward pass, ms (`--decode-step-ms`).
    pub decode_step_ms: f64,
    /// Extra per decoding sequence in the batch, ms (`--decode-ms-per-seq`).
    pub decode_ms_per_seq: f64,
    /// Extra per context token attended by decoding sequences, ns
    /// (`--decode-ns-per-context-token`).
    pub decode_ns_per_context_token: f64,
}

impl Default for StepCost {
    /// Qwen3-32B on 2×H100 (see the module doc).
    fn default() -> Self {
        StepCost {
            prefill_tokens_per_s: 20_480.0,
            prefill_attention_context_tokens: 32_768.0,
            decode_step_ms: 25.0,
            decode_ms_per_seq: 0.1,
            decode_ns_per_context_token: 40.0,
        }
    }
}

impl StepCost {
    /// Seconds (model time) for one iteration that prefills `prefill_tokens`
    /// tokens, which together attend to `prefill_attended` tokens of context
    /// ([`attended_context`]), and decodes one token for each of
    /// `decode_seqs` sequences, which together attend to
    /// `decode_context_tokens` tokens of context. An empty batch costs
    /// nothing.
    pub fn iteration_seconds(
        &self,
        prefill_tokens: u64,
        prefill_attended: u64,
        decode_seqs: u64,
        decode_context_tokens: u64,
    ) -> f64 {
        if prefill_tokens == 0 && decode_seqs == 0 {
            return 0.0;
        }
        let attention = if self.prefill_attention_context_tokens > 0.0 {
            prefill_attended as f64 / self.prefill_attention_context_tokens
        } else {
            0.0
        };
        let prefill_s = (prefill_tokens as f64 + attention) / self.prefill_tokens_per_s;
        let floor_s = self.decode_step_ms / 1e3;
        prefill_s.max(floor_s)
            + decode_seqs as f64 * self.decode_ms_per_seq / 1e3
            + decode_context_tokens as f64 * self.decode_ns_per_context_token / 1e9
    }
}

/// The context attended by a prefill chunk of `n` tokens that starts after
/// `start` tokens: `Σ (start + j)` for `j` in `1..=n`, each token attending
/// to itself and everything before it.
pub fn attended_context(start: u64, n: u64) -> u64 {
    n * start + n * (n + 1) / 2
}

#[cfg(test)]
mod tests {
    use super::*;

    fn off() -> StepCost {
        StepCost {
            prefill_attention_context_tokens: 0.0,
            ..StepCost::default()
        }
    }

    #[test]
    fn full_budget_of_cold_tokens_takes_b_over_peak() {
        let c = off();
        let t = c.iteration_seconds(8192, attended_context(0, 8192), 0, 0);
        assert!((t - 0.4).abs() < 1e-12, "{t}");
    }

    #[test]
    fn prefill_grows_with_the_attended_context() {
        let c = StepCost::default();
        // By hand: 8192 cold tokens attend to 8192·8193/2 = 33,558,528
        // tokens; / 32,768 = 1024.125 token-equivalents, so
        // (8192 + 1024.125) / 20,480 = 0.450006 s.
        let cold = c.iteration_seconds(8192, attended_context(0, 8192), 0, 0);
        assert!((cold - 0.450_006_1).abs() < 1e-6, "{cold}");
        // The same chunk after 32,768 cached tokens: +8192·32,768/32,768
        // more, 0.85 s in all; at 0 context it would be 0.4.
        let deep = c.iteration_seconds(8192, attended_context(32_768, 8192), 0, 0);
        assert!(
            (deep - (8192.0 + 1024.125 + 8192.0) / 20_480.0).abs() < 1e-9,
            "{deep}"
        );
        assert!(deep > cold);
    }

    #[test]
    fn attended_context_sums_each_tokens_context() {
        assert_eq!(attended_context(0, 1), 1);
        assert_eq!(attended_context(0, 3), 1 + 2 + 3);
        assert_eq!(attended_context(10, 2), 11 + 12);
        assert_eq!(attended_context(5, 0), 0);
    }

    #[test]
    fn tiny_prefill_costs_the_floor() {
        let c = StepCost::default();
        assert!((c.iteration_seconds(10, 55, 0, 0) - 0.025).abs() < 1e-12);
        assert_eq!(c.iteration_seconds(0, 0, 0, 0), 0.0);
    }

    #[test]
    fn decode_step_grows_with_batch_and_context() {
        let c = StepCost::default();
        let one = c.iteration_seconds(0, 0, 1, 1000);
        let many = c.iteration_seconds(0, 0, 64, 64_000);
        let longer = c.iteration_seconds(0, 0, 64, 512_000);
        assert!(one < many && many < longer, "{one} {many} {longer}");
        // 64 seqs: 25 + 6.4 + 2.56 ms.
        assert!((many - 0.03396).abs() < 1e-9, "{many}");
    }
}

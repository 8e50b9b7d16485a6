//! Time of one engine iteration (one forward pass over the batch).
//!
//! ```text
//! t = max(prefill_tokens / prefill_tokens_per_s, decode_step_ms / 1000)
//!     + decode_seqs × decode_ms_per_seq / 1000
//!     + decode_context_tokens × decode_ns_per_context_token / 1e9
//! ```
//!
//! Why this shape:
//! - Prefill is compute-bound: a chunk of `p` tokens costs `p / peak` seconds,
//!   and that compute hides the one-off cost of reading the weights. So a
//!   batch of exactly `B = max_num_batched_tokens` cold tokens takes `B/peak`
//!   and the calibration recipe (`peakPrefillThroughput = B / median TTFT`)
//!   recovers `prefill_tokens_per_s` exactly.
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
            decode_step_ms: 25.0,
            decode_ms_per_seq: 0.1,
            decode_ns_per_context_token: 40.0,
        }
    }
}

impl StepCost {
    /// Seconds (model time) for one iteration that prefills `prefill_tokens`
    /// tokens and decodes one token for each of `decode_seqs` sequences,
    /// which together attend to `decode_context_tokens` tokens of context.
    /// An empty batch costs nothing.
    pub fn iteration_seconds(
        &self,
        prefill_tokens: u64,
        decode_seqs: u64,
        decode_context_tokens: u64,
    ) -> f64 {
        if prefill_tokens == 0 && decode_seqs == 0 {
            return 0.0;
        }
        let prefill_s = prefill_tokens as f64 / self.prefill_tokens_per_s;
        let floor_s = self.decode_step_ms / 1e3;
        prefill_s.max(floor_s)
            + decode_seqs as f64 * self.decode_ms_per_seq / 1e3
            + decode_context_tokens as f64 * self.decode_ns_per_context_token / 1e9
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn full_budget_of_cold_tokens_takes_b_over_peak() {
        let c = StepCost::default();
        let t = c.iteration_seconds(8192, 0, 0);
        assert!((t - 0.4).abs() < 1e-12, "{t}");
    }

    #[test]
    fn tiny_prefill_costs_the_floor() {
        let c = StepCost::default();
        assert!((c.iteration_seconds(10, 0, 0) - 0.025).abs() < 1e-12);
        assert_eq!(c.iteration_seconds(0, 0, 0), 0.0);
    }

    #[test]
    fn decode_step_grows_with_batch_and_context() {
        let c = StepCost::default();
        let one = c.iteration_seconds(0, 1, 1000);
        let many = c.iteration_seconds(0, 64, 64_000);
        let longer = c.iteration_seconds(0, 64, 512_000);
        assert!(one < many && many < longer, "{one} {many} {longer}");
        // 64 seqs: 25 + 6.4 + 2.56 ms.
        assert!((many - 0.03396).abs() < 1e-9, "{many}");
    }
}

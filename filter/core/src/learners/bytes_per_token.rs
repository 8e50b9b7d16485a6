//! Online bytes per token, per endpoint, from what the server reports.
//!
//! kvroute has no tokenizer: it estimates a text prompt's tokens as
//! `bytes / charsPerToken`. The 4 bytes/token default can be far off (2×
//! against a real tokenizer has been measured), and then index capacity,
//! charges and τ are off by as much. The server counts real tokens, so the
//! collector learns the ratio:
//!
//! - each routed text prompt adds its rendered bytes to the endpoint's
//!   `routed_prompt_bytes` (load table, written with the decision's charge);
//!   with the mesh exchange on, the other proxies' accepted decisions add
//!   theirs (`engine::mesh`), so the bytes are the whole mesh's, as the
//!   server's token count is;
//! - each poll reads `vllm:prompt_tokens_total` (every prompt token the
//!   server processed, cached or not);
//! - a window closes once the server has counted at least `MIN_TOKENS`
//!   more tokens since its start: sample = Δbytes / Δtokens;
//! - each sample is clamped to [`FLOOR`, `CEILING`] bytes/token, kept in a
//!   ring of the last `SAMPLES`, and the estimate is their median once
//!   `MIN_SAMPLES` windows closed. The median ignores a window skewed by
//!   requests in flight at its edges, or token-ID prompts (tokens without
//!   bytes). It does not fix another gateway's steady share of the traffic
//!   (tokens without our bytes, in every window): without the exchange, a
//!   gateway that routes 1/G of a server's text learns 1/G of the figure;
//! - a counter that goes backwards (server restart, slot reuse) restarts
//!   the window; samples survive (the model is the same).
//!
//! All of it lives in the metrics snapshot (shared data, a fixed size per
//! endpoint), so a collector taking over in lease mode continues it. It is
//! used only with `charsPerToken: "auto"` (approx-prefix-cache-producer); a
//! fixed `charsPerToken` overrides it. The fleet's figure is the median of
//! the endpoints' estimates that are fresh (`fleet_estimate`): one cluster
//! serves one model, so this is the model's bytes per token.

pub use super::ratio::RatioLearner as BytesPerToken;
use super::ratio::{self, Bounds};

/// Bytes per token never learnt below this (1 byte per token).
pub const FLOOR: f32 = 1.0;
/// Nor above this (no tokenizer averages 16 bytes per token on text).
pub const CEILING: f32 = 16.0;
/// Tokens a window must count before it closes.
pub const MIN_TOKENS: f64 = 4096.0;
/// Windows before the estimate is used.
pub const MIN_SAMPLES: u8 = 3;
/// The ring's length.
pub const SAMPLES: usize = ratio::RATIO_SAMPLES;

const BOUNDS: Bounds = Bounds {
    min_window: MIN_TOKENS,
    floor: FLOOR,
    ceiling: CEILING,
    min_samples: MIN_SAMPLES,
};

/// Feeds one poll: the server's `vllm:prompt_tokens_total` and the bytes
/// routed to it so far.
pub fn observe(state: &mut BytesPerToken, prompt_tokens_total: f64, routed_bytes: u64) {
    ratio::observe(state, prompt_tokens_total, routed_bytes as f64, &BOUNDS);
}

/// The median of the kept samples, once there are `MIN_SAMPLES`.
pub fn estimate(state: &BytesPerToken) -> Option<f64> {
    ratio::estimate(state, &BOUNDS)
}

/// The median of the endpoints' estimates (`None` if none has one).
pub fn fleet_estimate(estimates: impl IntoIterator<Item = f64>) -> Option<f64> {
    ratio::fleet_estimate(estimates, &BOUNDS)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Feeds windows of `tokens` tokens at `bpt` bytes per token.
    fn feed(s: &mut BytesPerToken, total: &mut (f64, u64), windows: &[(f64, f64)]) {
        for &(tokens, bpt) in windows {
            total.0 += tokens;
            total.1 += (tokens * bpt) as u64;
            observe(s, total.0, total.1);
        }
    }

    #[test]
    fn learns_the_servers_ratio_after_enough_windows() {
        let mut s = BytesPerToken::default();
        let mut t = (100.0, 400);
        observe(&mut s, t.0, t.1); // the baseline
        feed(&mut s, &mut t, &[(5000.0, 2.0), (5000.0, 2.0)]);
        assert_eq!(estimate(&s), None, "two windows are not enough");
        feed(&mut s, &mut t, &[(5000.0, 2.0)]);
        assert_eq!(estimate(&s), Some(2.0));
    }

    #[test]
    fn small_windows_accumulate_until_min_tokens() {
        let mut s = BytesPerToken::default();
        let mut t = (0.0, 0);
        observe(&mut s, 0.0, 0);
        // 1000-token polls: a sample every 5th poll (≥ 4096 tokens).
        feed(&mut s, &mut t, &[(1000.0, 3.0); 14]);
        assert_eq!(s.count, 2);
        feed(&mut s, &mut t, &[(1000.0, 3.0)]);
        assert_eq!(estimate(&s), Some(3.0));
    }

    #[test]
    fn outliers_and_bounds() {
        let mut s = BytesPerToken::default();
        let mut t = (0.0, 0);
        observe(&mut s, 0.0, 0);
        // Token-ID traffic (no bytes) and a burst of another gateway's
        // tokens are outliers; the median keeps the true 3.5.
        feed(
            &mut s,
            &mut t,
            &[
                (5000.0, 3.5),
                (5000.0, 0.0),
                (5000.0, 3.5),
                (5000.0, 3.5),
                (5000.0, 40.0),
            ],
        );
        assert_eq!(estimate(&s), Some(3.5));
        // Every sample is within [FLOOR, CEILING], so the estimate is too.
        let mut z = BytesPerToken::default();
        let mut t = (0.0, 0);
        observe(&mut z, 0.0, 0);
        feed(&mut z, &mut t, &[(5000.0, 0.0); 5]);
        assert_eq!(estimate(&z), Some(f64::from(FLOOR)));
        feed(&mut z, &mut t, &[(5000.0, 1000.0); 9]);
        assert_eq!(estimate(&z), Some(f64::from(CEILING)));
        assert!(z.count as usize <= SAMPLES);
    }

    #[test]
    fn a_counter_reset_restarts_the_window_and_keeps_the_samples() {
        let mut s = BytesPerToken::default();
        let mut t = (0.0, 0);
        observe(&mut s, 0.0, 0);
        feed(&mut s, &mut t, &[(5000.0, 2.5); 3]);
        // The server restarted: its counter is back near 0.
        observe(&mut s, 10.0, t.1);
        assert_eq!(s.base_den, 10.0);
        assert_eq!(estimate(&s), Some(2.5));
        // A bad reading is ignored.
        observe(&mut s, f64::NAN, t.1);
        observe(&mut s, -1.0, t.1);
        assert_eq!(s.base_den, 10.0);
    }

    #[test]
    fn fleet_median() {
        assert_eq!(fleet_estimate([]), None);
        assert_eq!(fleet_estimate([2.0, 3.0, 9.0]), Some(3.0));
        assert_eq!(fleet_estimate([2.0, 3.0]), Some(2.5));
    }
}

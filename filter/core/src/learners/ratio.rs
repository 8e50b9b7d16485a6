//! The collector's learner of one ratio of two totals a server (or the
//! load table) only ever grows: `Δnumerator / Δdenominator`, one endpoint
//! at a time. Bytes per token (`bytes_per_token`) and output tokens per
//! finished request (`output_tokens`) are both learnt this way.
//!
//! - a window closes once the denominator has grown by at least
//!   `min_window` since the window's start: sample = Δnum / Δden, clamped
//!   to [`floor`, `ceiling`];
//! - the last [`RATIO_SAMPLES`] samples are kept in a ring, and the
//!   estimate is their median once `min_samples` windows closed. The median
//!   ignores a window skewed by what was in flight at its edges or by
//!   traffic of another kind;
//! - a total that goes backwards (server restart, slot reuse) restarts the
//!   window; the samples survive (the model is the same). A reading that is
//!   not a finite number ≥ 0 is ignored.
//!
//! The state is a fixed size per endpoint (`RatioLearner`, in the metrics
//! snapshot in shared data), so a collector taking over in lease mode
//! continues it, and it never grows.

pub use kvroute_shared_state::metrics::{RatioLearner, RATIO_SAMPLES};

/// One learner's knobs.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Bounds {
    /// How much the denominator must grow before a window closes.
    pub min_window: f64,
    /// No sample (so no estimate) below this.
    pub floor: f32,
    /// Nor above this.
    pub ceiling: f32,
    /// Windows before the estimate is used (1 ≤ it ≤ `RATIO_SAMPLES`).
    pub min_samples: u8,
}

/// Feeds one poll's totals.
pub fn observe(state: &mut RatioLearner, den_total: f64, num_total: f64, b: &Bounds) {
    let ok = |v: f64| v.is_finite() && v >= 0.0;
    if !ok(den_total) || !ok(num_total) {
        return;
    }
    if !state.based || den_total < state.base_den || num_total < state.base_num {
        state.based = true;
        state.base_den = den_total;
        state.base_num = num_total;
        return;
    }
    let den = den_total - state.base_den;
    if den < b.min_window || den <= 0.0 {
        return;
    }
    let sample = ((num_total - state.base_num) / den) as f32;
    let sample = if sample.is_finite() {
        sample.clamp(b.floor, b.ceiling)
    } else {
        b.ceiling
    };
    let at = usize::from(state.next) % RATIO_SAMPLES;
    state.samples[at] = sample;
    state.next = ((at + 1) % RATIO_SAMPLES) as u8;
    state.count = state.count.saturating_add(1).min(RATIO_SAMPLES as u8);
    state.base_den = den_total;
    state.base_num = num_total;
}

/// The median of the kept samples, once there are `min_samples`.
pub fn estimate(state: &RatioLearner, b: &Bounds) -> Option<f64> {
    if state.count < b.min_samples.max(1) {
        return None;
    }
    median(
        state.samples[..usize::from(state.count).min(RATIO_SAMPLES)].to_vec(),
        b,
    )
}

/// The median of the endpoints' estimates (`None` if none has one): one
/// cluster serves one model, so this is the model's figure.
pub fn fleet_estimate(estimates: impl IntoIterator<Item = f64>, b: &Bounds) -> Option<f64> {
    median(estimates.into_iter().map(|e| e as f32).collect(), b)
}

/// One allocation per call (the caller's `Vec`), sorted in place.
fn median(mut v: Vec<f32>, b: &Bounds) -> Option<f64> {
    v.retain(|x| x.is_finite());
    if v.is_empty() {
        return None;
    }
    v.sort_by(f32::total_cmp);
    let n = v.len();
    let m = if n % 2 == 1 {
        f64::from(v[n / 2])
    } else {
        (f64::from(v[n / 2 - 1]) + f64::from(v[n / 2])) / 2.0
    };
    Some(m.clamp(f64::from(b.floor), f64::from(b.ceiling)))
}

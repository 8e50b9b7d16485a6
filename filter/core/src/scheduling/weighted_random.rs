//! `weighted-random-picker`: samples in proportion to score, with the
//! A-Res key `key = U^(1/score)` (U uniform in (0,1)); highest key wins.
//! Endpoints scoring 0 are only picked when every score is 0 (then uniform).

use super::Rng;
use crate::config::check::Params;
use crate::config::ConfigError;

/// Orders positions by sampled key, descending.
pub fn rank(scores: &[f64], rng: &mut Rng) -> Vec<usize> {
    let all_zero = scores.iter().all(|s| *s <= 0.0);
    let mut keyed: Vec<(usize, f64)> = scores
        .iter()
        .enumerate()
        .map(|(k, &s)| {
            let u = rng.next_f64().max(f64::MIN_POSITIVE);
            let key = if all_zero {
                u
            } else if s <= 0.0 {
                -1.0 + u * 0.5 // below every positive-score key, still ordered
            } else {
                u.powf(1.0 / s)
            };
            (k, key)
        })
        .collect();
    keyed.sort_by(|a, b| b.1.total_cmp(&a.1));
    keyed.into_iter().map(|(k, _)| k).collect()
}

// ---------------------------------------------------------------------------
// Configuration: `weighted-random-picker` in `plugins`.

pub const TYPE: &str = "weighted-random-picker";

/// llm-d's picker parameters (`max_score::compile`); only `tieBreak: "random"`.
pub(crate) fn compile(p: &Params) -> Result<(), ConfigError> {
    super::max_score::compile(p).map(|_| ())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frequencies_follow_scores() {
        let mut rng = Rng::new(9);
        let mut seen = [0u32; 3];
        for _ in 0..30_000 {
            seen[rank(&[0.6, 0.3, 0.0], &mut rng)[0]] += 1;
        }
        assert_eq!(seen[2], 0);
        let share = f64::from(seen[0]) / 30_000.0;
        assert!((0.63..0.70).contains(&share), "{share}");
    }

    #[test]
    fn all_zero_is_uniform() {
        let mut rng = Rng::new(1);
        let mut seen = [0u32; 2];
        for _ in 0..2000 {
            seen[rank(&[0.0, 0.0], &mut rng)[0]] += 1;
        }
        assert!(seen[0] > 850 && seen[1] > 850, "{seen:?}");
    }
}

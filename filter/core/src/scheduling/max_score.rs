//! `max-score-picker`: the highest total score wins. Returns positions into
//! the scored set, best first. Equal scores are ordered by the picker's
//! `tieBreak`:
//!
//! - `random` (llm-d's behaviour, the default): a seeded random order, so
//!   the first is a uniform pick among the best.
//! - `prefix`: rendezvous (highest-random-weight) hashing of the request's
//!   tie key against each endpoint's key,
//!   `w(e) = mix(tie_key ⊕ key(e))`, highest first. `key(e)` is a hash of
//!   the endpoint's `ip:port` and the tie key is a block hash of the
//!   request (see [`RequestView::tie_key`](super::RequestView)), so two
//!   gateway replicas with equal views place a cold prefix on the same
//!   endpoint, identical prompts go together, and distinct prompts spread
//!   evenly over the tied endpoints. Adding or removing an endpoint moves
//!   only the prompts whose winner it was. A request without a full block
//!   has no tie key and falls back to `random`.

use super::Rng;
use crate::config::check::{err, Params};
use crate::config::ConfigError;
use serde::Deserialize;

/// How equal best scores are ordered.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum TieBreak {
    #[default]
    Random,
    Prefix,
}

/// splitmix64's finaliser: a bijective mix, so distinct inputs give
/// distinct weights.
fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Orders positions `0..scores.len()` by score, descending; equal scores are
/// ordered by `tie` (see the module doc). `keys[k]` is position k's endpoint
/// key; `tie_key` the request's.
pub fn rank(
    scores: &[f64],
    tie: TieBreak,
    tie_key: Option<u64>,
    keys: &[u64],
    rng: &mut Rng,
) -> Vec<usize> {
    let mut keyed: Vec<(usize, u64)> = match (tie, tie_key) {
        (TieBreak::Prefix, Some(t)) => (0..scores.len())
            // Highest weight first: the sort below is ascending.
            .map(|k| (k, !mix(t ^ keys.get(k).copied().unwrap_or(k as u64))))
            .collect(),
        _ => (0..scores.len()).map(|k| (k, rng.next_u64())).collect(),
    };
    keyed.sort_by(|a, b| {
        scores[b.0]
            .total_cmp(&scores[a.0])
            .then_with(|| a.1.cmp(&b.1))
    });
    keyed.into_iter().map(|(k, _)| k).collect()
}

// ---------------------------------------------------------------------------
// Configuration: `max-score-picker` in `plugins`.

pub const TYPE: &str = "max-score-picker";

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct PickerParams {
    max_num_of_endpoints: Option<i64>,
    /// `max-score-picker` only: `"random"` (llm-d's, the default) or
    /// `"prefix"` (rendezvous on the request's blocks).
    tie_break: Option<String>,
}

/// llm-d's picker parameters, for both pickers (`weighted_random` calls
/// it): the tie break, `random` for `weighted-random-picker`.
pub(crate) fn compile(p: &Params) -> Result<TieBreak, ConfigError> {
    let q: PickerParams = p.parse()?;
    if let Some(n) = q.max_num_of_endpoints {
        if n < 1 {
            return Err(err(
                p.field("maxNumOfEndpoints"),
                format!("{n} is out of range: must be ≥ 1"),
            ));
        }
    }
    let tie = match q.tie_break.as_deref() {
        None | Some("random") => TieBreak::Random,
        Some("prefix") if p.kind == "max-score-picker" => TieBreak::Prefix,
        Some(other) => {
            return Err(err(
                p.field("tieBreak"),
                if p.kind == "max-score-picker" {
                    format!("\"{other}\" is not a tie break; use \"random\" or \"prefix\"")
                } else {
                    "weighted-random-picker draws at random; only \"random\" applies".into()
                },
            ))
        }
    };
    Ok(tie)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn random(scores: &[f64], rng: &mut Rng) -> Vec<usize> {
        rank(scores, TieBreak::Random, Some(7), &[], rng)
    }

    #[test]
    fn best_first_and_ties_random_but_seeded() {
        assert_eq!(random(&[0.1, 0.9, 0.5], &mut Rng::new(3))[0], 1);
        let mut seen = [0u32; 3];
        let mut rng = Rng::new(11);
        for _ in 0..3000 {
            seen[random(&[0.7, 0.7, 0.2], &mut rng)[0]] += 1;
        }
        assert_eq!(seen[2], 0);
        assert!(seen[0] > 1300 && seen[1] > 1300, "{seen:?}");
        // Same seed, same answer.
        assert_eq!(
            random(&[1.0, 1.0, 1.0, 1.0], &mut Rng::new(5)),
            random(&[1.0, 1.0, 1.0, 1.0], &mut Rng::new(5))
        );
    }

    #[test]
    fn prefix_ties_ignore_the_rng_and_follow_the_tie_key() {
        let keys = [11, 22, 33, 44];
        let scores = [1.0, 1.0, 1.0, 0.5];
        for t in 0..200u64 {
            let a = rank(&scores, TieBreak::Prefix, Some(t), &keys, &mut Rng::new(1));
            let b = rank(&scores, TieBreak::Prefix, Some(t), &keys, &mut Rng::new(99));
            assert_eq!(a, b, "two replicas with different seeds agree");
            assert_eq!(a[3], 3, "a lower score never wins a tie");
        }
    }

    #[test]
    fn prefix_ties_spread_distinct_keys_evenly() {
        let keys = [0x1111, 0x2222, 0x3333];
        let mut seen = [0u32; 3];
        for t in 0..3000u64 {
            let first = rank(
                &[2.0; 3],
                TieBreak::Prefix,
                Some(t.wrapping_mul(0x9e37_79b9_7f4a_7c15)),
                &keys,
                &mut Rng::new(0),
            )[0];
            seen[first] += 1;
        }
        assert!(seen.iter().all(|&n| n > 850), "{seen:?}");
    }

    #[test]
    fn prefix_ties_move_only_the_removed_endpoints_share() {
        // Rendezvous: removing endpoint 2 re-places only what it won.
        let keys = [5, 6, 7, 8];
        for t in 0..500u64 {
            let all = rank(
                &[1.0; 4],
                TieBreak::Prefix,
                Some(t),
                &keys,
                &mut Rng::new(0),
            )[0];
            let three = [keys[0], keys[1], keys[3]];
            let less = rank(
                &[1.0; 3],
                TieBreak::Prefix,
                Some(t),
                &three,
                &mut Rng::new(0),
            )[0];
            let less_addr = three[less];
            if keys[all] != 7 {
                assert_eq!(less_addr, keys[all], "key {t}");
            }
        }
    }

    #[test]
    fn prefix_without_a_tie_key_is_random() {
        let mut seen = [0u32; 2];
        let mut rng = Rng::new(4);
        for _ in 0..2000 {
            seen[rank(&[1.0, 1.0], TieBreak::Prefix, None, &[1, 2], &mut rng)[0]] += 1;
        }
        assert!(seen[0] > 800 && seen[1] > 800, "{seen:?}");
    }
}

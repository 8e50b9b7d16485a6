//! `max-score-picker`: the highest total score wins; ties are broken at
//! random (seeded). Returns positions into the scored set, best first.

use super::Rng;

/// Orders positions `0..scores.len()` by score, descending; equal scores are
/// put in a random order, so the first is a uniform pick among the best.
pub fn rank(scores: &[f64], rng: &mut Rng) -> Vec<usize> {
    let mut keyed: Vec<(usize, u64)> = (0..scores.len()).map(|k| (k, rng.next_u64())).collect();
    keyed.sort_by(|a, b| {
        scores[b.0]
            .total_cmp(&scores[a.0])
            .then_with(|| a.1.cmp(&b.1))
    });
    keyed.into_iter().map(|(k, _)| k).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn best_first_and_ties_random_but_seeded() {
        assert_eq!(rank(&[0.1, 0.9, 0.5], &mut Rng::new(3))[0], 1);
        let mut seen = [0u32; 3];
        let mut rng = Rng::new(11);
        for _ in 0..3000 {
            seen[rank(&[0.7, 0.7, 0.2], &mut rng)[0]] += 1;
        }
        assert_eq!(seen[2], 0);
        assert!(seen[0] > 1300 && seen[1] > 1300, "{seen:?}");
        // Same seed, same answer.
        assert_eq!(
            rank(&[1.0, 1.0, 1.0, 1.0], &mut Rng::new(5)),
            rank(&[1.0, 1.0, 1.0, 1.0], &mut Rng::new(5))
        );
    }
}

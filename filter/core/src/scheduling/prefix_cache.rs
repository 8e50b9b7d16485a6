//! `prefix-cache-scorer` (legacy blend): score(e) = affinity(e) = matched blocks / request blocks.

use super::{Candidate, RequestView};

pub fn score(req: &RequestView, cands: &[Candidate], idx: &[usize], out: &mut [f64]) {
    for (o, &i) in out.iter_mut().zip(idx) {
        *o = cands[i].affinity(req);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn score_is_affinity() {
        let r = RequestView {
            total_blocks: 4,
            ..Default::default()
        };
        let c = |m| Candidate {
            matched_blocks: m,
            ..Default::default()
        };
        let mut out = [0.0; 3];
        score(&r, &[c(0), c(2), c(9)], &[0, 1, 2], &mut out);
        assert_eq!(out, [0.0, 0.5, 1.0]);
    }
}

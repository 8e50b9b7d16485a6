//! `no-hit-lru-scorer` (legacy blend): spreads cold requests.
//!
//! A request is *cold* when no candidate holds any of its blocks. Warm
//! requests score 0.5 everywhere (neutral). For cold requests, candidates are
//! ranked: never-used-for-cold first (in candidate order), then by when they
//! last took a cold request, oldest first; with n candidates,
//! score = 1 − rank / (n − 1), and a single candidate scores 1.
//! The host records the pick of a cold request (`Decision::cold`).

use super::{Candidate, RequestView};
use crate::config::check::{err, Params};
use crate::config::ConfigError;
use serde::Deserialize;

pub fn is_cold(req: &RequestView, cands: &[Candidate], idx: &[usize]) -> bool {
    req.total_blocks == 0 || idx.iter().all(|&i| cands[i].matched_blocks == 0)
}

pub fn score(req: &RequestView, cands: &[Candidate], idx: &[usize], out: &mut [f64]) {
    if !is_cold(req, cands, idx) {
        out.iter_mut().for_each(|o| *o = 0.5);
        return;
    }
    let n = idx.len();
    if n == 1 {
        out[0] = 1.0;
        return;
    }
    // Rank: (used?, last stamp, position) ascending.
    let mut order: Vec<usize> = (0..n).collect();
    order.sort_by_key(|&k| match cands[idx[k]].last_cold_pick {
        None => (0u8, 0u64, k),
        Some(t) => (1u8, t, k),
    });
    for (rank, &k) in order.iter().enumerate() {
        out[k] = (1.0 - rank as f64 / (n - 1) as f64).max(0.0);
    }
}

// ---------------------------------------------------------------------------
// Configuration: `no-hit-lru-scorer` in `plugins`.

pub const TYPE: &str = "no-hit-lru-scorer";

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct NoHitLruParams {
    /// Deprecated in llm-d: "never used".
    prefix_plugin_type: Option<String>,
    /// Deprecated in llm-d: "never used".
    prefix_plugin_name: Option<String>,
    lru_size: Option<i64>,
    prefix_match_info_producer_name: Option<String>,
}

/// The parameters are llm-d's; the scorer has nothing to set.
pub(crate) fn compile(p: &Params) -> Result<(), ConfigError> {
    let q: NoHitLruParams = p.parse()?;
    for (field, given) in [
        ("prefixPluginType", q.prefix_plugin_type.is_some()),
        ("prefixPluginName", q.prefix_plugin_name.is_some()),
    ] {
        if given {
            p.warn(field, "deprecated in llm-d as never used; ignored");
        }
    }
    p.producer(
        "prefixMatchInfoProducerName",
        &q.prefix_match_info_producer_name,
    )?;
    if let Some(n) = q.lru_size {
        if n <= 0 {
            return Err(err(
                p.field("lruSize"),
                format!("{n} is out of range: must be > 0 endpoints"),
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cold_requests_prefer_least_recently_used() {
        let r = RequestView {
            total_blocks: 3,
            ..Default::default()
        };
        let c = |t: Option<u64>| Candidate {
            last_cold_pick: t,
            ..Default::default()
        };
        let mut out = [0.0; 3];
        score(&r, &[c(Some(5)), c(None), c(Some(2))], &[0, 1, 2], &mut out);
        assert_eq!(out, [0.0, 1.0, 0.5]);
    }

    #[test]
    fn warm_requests_are_neutral() {
        let r = RequestView {
            total_blocks: 3,
            ..Default::default()
        };
        let cands = [
            Candidate {
                matched_blocks: 1,
                ..Default::default()
            },
            Candidate::default(),
        ];
        let mut out = [0.0; 2];
        score(&r, &cands, &[0, 1], &mut out);
        assert_eq!(out, [0.5, 0.5]);
    }
}

//! Envoy stats the module exports (shown by Envoy as `wasmcustom.kvroute_*`).
//! A counter that cannot be defined is skipped, never fatal.
//!
//! A filter VM counts in its own memory and hands the counts to Envoy on its
//! root context's tick ([`FLUSH_PERIOD_MS`]): each `proxy_increment_metric`
//! is a VM exit and entry, and a request would otherwise pay two of them on
//! its path. Envoy's counters therefore lag the module by at most one tick
//! (plus the time the worker is busy). The collector counts directly: its
//! events are rare.

use crate::host;
use std::cell::Cell;

/// How often a filter VM hands its counts to Envoy.
pub const FLUSH_PERIOD_MS: u32 = 200;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Counter {
    Routed,
    FailOpen,
    Rejected,
    BranchSticky,
    BranchSaturationRelease,
    BranchNoAffinity,
    BranchExploration,
    BranchOther,
    ClientHeaderStripped,
    HostErrors,
    MetricsPollFailures,
    ReapedRequests,
    CasRetries,
}

const NAMES: [&str; 13] = [
    "kvroute_routed",
    "kvroute_fail_open",
    "kvroute_rejected",
    "kvroute_branch_sticky",
    "kvroute_branch_saturation_release",
    "kvroute_branch_no_affinity",
    "kvroute_branch_exploration",
    "kvroute_branch_other",
    "kvroute_client_header_stripped",
    "kvroute_host_errors",
    "kvroute_metrics_poll_failures",
    "kvroute_reaped_requests",
    "kvroute_cas_retries",
];

#[derive(Debug, Default)]
pub struct Stats {
    ids: Vec<Option<u32>>,
    /// Counts not yet handed to Envoy; `None`: every count goes at once.
    pending: Option<[Cell<u64>; NAMES.len()]>,
}

impl Stats {
    /// Counters that reach Envoy at once.
    pub fn define() -> Stats {
        Stats {
            ids: NAMES.iter().map(|n| host::define_counter(n).ok()).collect(),
            pending: None,
        }
    }

    /// Counters kept in the VM until [`Stats::flush`] (called on a tick).
    pub fn define_batched() -> Stats {
        Stats {
            pending: Some(Default::default()),
            ..Stats::define()
        }
    }

    fn send(&self, c: usize, by: u64) {
        if let Some(Some(id)) = self.ids.get(c) {
            let _ = host::increment(*id, by.min(i64::MAX as u64) as i64);
        }
    }

    pub fn add(&self, c: Counter, by: u64) {
        match self.pending.as_ref().and_then(|p| p.get(c as usize)) {
            Some(cell) => cell.set(cell.get().saturating_add(by)),
            None => self.send(c as usize, by),
        }
    }

    pub fn inc(&self, c: Counter) {
        self.add(c, 1);
    }

    /// Hands the pending counts to Envoy (one host call per counter that moved).
    pub fn flush(&self) {
        if let Some(pending) = &self.pending {
            for (i, cell) in pending.iter().enumerate() {
                let n = cell.replace(0);
                if n > 0 {
                    self.send(i, n);
                }
            }
        }
    }
}

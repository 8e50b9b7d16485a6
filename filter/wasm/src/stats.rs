//! Envoy stats the module exports (shown by Envoy as `wasmcustom.kvroute_*`).
//! A counter that cannot be defined is skipped, never fatal.

use crate::host;

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
}

const NAMES: [&str; 12] = [
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
];

#[derive(Clone, Debug, Default)]
pub struct Stats {
    ids: Vec<Option<u32>>,
}

impl Stats {
    pub fn define() -> Stats {
        Stats {
            ids: NAMES.iter().map(|n| host::define_counter(n).ok()).collect(),
        }
    }

    pub fn add(&self, c: Counter, by: u64) {
        if let Some(Some(id)) = self.ids.get(c as usize) {
            let _ = host::increment(*id, by.min(i64::MAX as u64) as i64);
        }
    }

    pub fn inc(&self, c: Counter) {
        self.add(c, 1);
    }
}

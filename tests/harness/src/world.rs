//! What all VMs of one simulated Envoy process share: shared data and
//! queues, the manual clock, stats, logs, in-flight `dispatch_http_call`s and
//! the scripts and hooks a test installs.

use crate::abi::{Headers, Status};
use crate::http_call::{HttpCallReply, HttpCallRequest};
use crate::shared_data::{SharedData, SharedQueues};
use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};

/// The manual clock starts here: 2024-01-01T00:00:00Z, in ns since the epoch.
pub const EPOCH_NS: u64 = 1_704_067_200_000_000_000;

/// proxy-wasm log levels (0 trace … 5 critical).
pub const LEVEL_NAMES: [&str; 6] = ["trace", "debug", "info", "warn", "error", "critical"];

#[derive(Clone, Debug)]
pub struct LogLine {
    pub vm: String,
    pub level: u32,
    pub message: String,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MetricKind {
    Counter,
    Gauge,
    Histogram,
}

/// One process-wide stat, as Envoy keeps it by name.
#[derive(Clone, Debug)]
pub struct Metric {
    pub kind: MetricKind,
    /// Counter: total; gauge: current value (may go negative here, so a test
    /// can see an underflow Envoy would hide); histogram: last recorded value.
    pub value: i64,
    /// Histogram samples recorded.
    pub samples: u64,
}

/// An outstanding `dispatch_http_call`.
pub struct PendingCall {
    pub vm: usize,
    pub context: u32,
    pub token: u32,
    pub request: HttpCallRequest,
    /// When the module gets its callback (ns on the manual clock); `None`
    /// means never (a hung upstream with no timeout).
    pub due_ns: Option<u64>,
    pub reply: Delivered,
}

/// What `proxy_on_http_call_response` will see.
#[derive(Clone, Debug)]
pub enum Delivered {
    /// Headers (with `:status`), body, trailers.
    Response(Headers, Vec<u8>, Headers),
    /// Envoy's `onFailure` (reset): 0 headers, 0 body, status BrokenConnection.
    Failure,
}

/// A one-shot hook run inside a VM's `proxy_set_shared_data`, before the set
/// is applied: the way a test makes another VM act "at the same instant".
pub struct SetHook {
    pub vm: usize,
    pub key_prefix: String,
    pub action: Box<dyn FnOnce()>,
}

pub type Responder = Box<dyn FnMut(&HttpCallRequest) -> HttpCallReply>;
pub type ForeignFunction = Box<dyn FnMut(&[u8]) -> Result<Vec<u8>, Status>>;

pub struct World {
    pub shared: SharedData,
    pub queues: SharedQueues,
    pub now_ns: u64,
    pub logs: VecDeque<LogLine>,
    pub log_capacity: usize,
    /// Lines logged per level, including those dropped from `logs`.
    pub log_counts: [u64; 6],
    /// Level the module sees from `proxy_get_log_level`: Envoy's logger
    /// level, info (2) by default as in Envoy. Lines below it are still kept.
    pub log_level: u32,
    /// Echo module logs to stderr (env `KVROUTE_HARNESS_LOG=1`).
    pub echo_logs: bool,
    pub metrics: BTreeMap<String, Metric>,
    pub calls: Vec<PendingCall>,
    pub next_call_token: u32,
    pub responder: Option<Responder>,
    /// Upstream clusters Envoy knows; `None` = every name is known.
    pub known_clusters: Option<HashSet<String>>,
    pub foreign: HashMap<String, ForeignFunction>,
    pub set_hooks: Vec<SetHook>,
    /// Request-header writes refused because the headers had already gone
    /// upstream (Envoy answers `BadArgument`).
    pub late_header_writes: u64,
}

impl World {
    pub fn new() -> World {
        World {
            shared: SharedData::new(),
            queues: SharedQueues::default(),
            now_ns: EPOCH_NS,
            logs: VecDeque::new(),
            log_capacity: 20_000,
            log_counts: [0; 6],
            log_level: 2,
            echo_logs: std::env::var("KVROUTE_HARNESS_LOG").is_ok_and(|v| v == "1"),
            metrics: BTreeMap::new(),
            calls: Vec::new(),
            next_call_token: 0,
            responder: None,
            known_clusters: None,
            foreign: HashMap::new(),
            set_hooks: Vec::new(),
            late_header_writes: 0,
        }
    }

    pub fn log(&mut self, vm: &str, level: u32, message: String) {
        let level = level.min(5);
        self.log_counts[level as usize] += 1;
        if self.echo_logs {
            eprintln!("[{vm} {}] {message}", LEVEL_NAMES[level as usize]);
        }
        if self.logs.len() >= self.log_capacity {
            self.logs.pop_front();
        }
        self.logs.push_back(LogLine {
            vm: vm.to_string(),
            level,
            message,
        });
    }

    /// The last `n` log lines of one VM, oldest first, for error reports.
    pub fn tail(&self, vm: &str, n: usize) -> Vec<String> {
        let mut lines: Vec<String> = self
            .logs
            .iter()
            .rev()
            .filter(|l| l.vm == vm)
            .take(n)
            .map(|l| format!("[{}] {}", LEVEL_NAMES[l.level as usize], l.message))
            .collect();
        lines.reverse();
        lines
    }

    pub fn take_set_hook(&mut self, vm: usize, key: &str) -> Option<Box<dyn FnOnce()>> {
        let at = self
            .set_hooks
            .iter()
            .position(|h| h.vm == vm && key.starts_with(&h.key_prefix))?;
        Some(self.set_hooks.remove(at).action)
    }
}

impl Default for World {
    fn default() -> Self {
        World::new()
    }
}

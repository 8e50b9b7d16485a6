//! Flow control: admission, queueing, priority bands and shedding inside
//! the proxy (llm-d's `flowControl` feature gate and section).
//!
//! With the gate on, a request whose pool is saturated (the detector,
//! `detector.rs`) waits in its worker's queue, paused after its body,
//! instead of joining a model server's queue. Each worker's root ticks
//! every [`FLOW_TICK_MS`] and dispatches, highest band first, while the
//! pool has room; a dispatched request is routed then (so it still goes
//! where its cache is), its header set and its stream resumed. A request
//! is shed with 429 (`Retry-After`, an error in the shape of its API,
//! OpenAI's or on `/v1/messages` Anthropic's, and llm-d's
//! `x-llm-d-request-dropped-reason`) when its band or the whole queue is
//! full, or when it waited `defaultRequestTTL`; with no endpoint at all,
//! 503 after `noEndpointRequestTTL`. A client that goes away while waiting
//! leaves nothing behind: a waiting request holds no charge (it is charged
//! when dispatched).
//!
//! With the gate off, llm-d's legacy admission: a sheddable request
//! (priority < 0) gets 429 while the pool is saturated; every other
//! request is routed at once.
//!
//! Priority comes from `inferenceObjectives` (kvroute's stand-in for
//! llm-d's `InferenceObjective` resources): the objective the request
//! names in `x-llm-d-inference-objective` (or its alias
//! `x-gateway-inference-objective`), else the one that lists its model,
//! else 0. The flow is `x-llm-d-inference-fairness-id` (alias
//! `x-gateway-inference-fairness-id`), default `default-flow`.

pub mod board;
pub mod config;
pub mod detector;
pub mod queue;

pub use config::{FlowConfig, Objective};
pub use detector::{Detector, Pool, PoolEndpoint};

/// The worker root's tick while flow control is on, ms.
pub const FLOW_TICK_MS: u32 = 5;
/// At most this many dispatches per worker per tick (the pool is read again
/// after each).
pub const MAX_DISPATCH_PER_TICK: usize = 64;
/// `Retry-After` on a shed request, seconds.
pub const RETRY_AFTER_S: u32 = 1;
/// The flow of a request that names none (llm-d's `DefaultFairnessID`).
pub const DEFAULT_FLOW: &str = "default-flow";
/// Fairness ids longer than this are cut (a client header).
pub const MAX_FLOW_ID_BYTES: usize = 128;

/// llm-d's objective header, then its deprecated alias.
pub const OBJECTIVE_HEADERS: [&str; 2] = [
    "x-llm-d-inference-objective",
    "x-gateway-inference-objective",
];
/// llm-d's fairness header, then its deprecated alias.
pub const FAIRNESS_HEADERS: [&str; 2] = [
    "x-llm-d-inference-fairness-id",
    "x-gateway-inference-fairness-id",
];
/// Response header naming why a request was dropped (llm-d's).
pub const DROPPED_REASON_HEADER: &str = "x-llm-d-request-dropped-reason";

/// The `stats_tags` regex (Envoy bootstrap `stats_config`) that makes a
/// flow-control stat's band a Prometheus label, tag name `band`
/// (`envoy/render.py` adds it; `lifecycle/flow.rs` names the stats; `m5` is priority −5).
pub const BAND_TAG_REGEX: &str = r"^wasmcustom\.kvroute_flow_[a-z_]+(\.band\.(m?[0-9]+))$";

/// How a band picks the next flow.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fairness {
    /// `global-strict-fairness-policy` (default): the band is one queue.
    GlobalStrict,
    /// `round-robin-fairness-policy`: one turn per waiting flow.
    RoundRobin,
}

/// How a flow picks its next request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ordering {
    /// `fcfs-ordering-policy` (default).
    Fcfs,
    /// `edf-ordering-policy`: earliest deadline (arrival + TTL) first.
    Edf,
}

/// Why a request did not reach a server.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Shed {
    /// Its band or the whole queue is full (429).
    Capacity,
    /// It waited its TTL (429).
    Ttl,
    /// No endpoint: full queue or `noEndpointRequestTTL` (503).
    NoEndpoints,
    /// Gate off, sheddable (priority < 0) and the pool saturated (429).
    Sheddable,
}

impl Shed {
    pub fn status(self) -> u32 {
        match self {
            Shed::NoEndpoints => 503,
            _ => 429,
        }
    }

    /// llm-d's `x-llm-d-request-dropped-reason`.
    pub fn reason(self) -> &'static str {
        match self {
            Shed::Capacity => "rejected-saturated",
            Shed::Ttl => "rejected-ttl-expired",
            Shed::NoEndpoints => "rejected-no-endpoints",
            Shed::Sheddable => "rejected-saturated",
        }
    }

    pub fn message(self) -> &'static str {
        match self {
            Shed::Capacity => "request rejected: the gateway's queue is at capacity",
            Shed::Ttl => "request timed out in the gateway's queue",
            Shed::NoEndpoints => "no endpoints available",
            Shed::Sheddable => "system saturated, sheddable request dropped",
        }
    }

    /// The counter label.
    pub fn label(self) -> &'static str {
        match self {
            Shed::Capacity => "capacity",
            Shed::Ttl => "ttl",
            Shed::NoEndpoints => "no_endpoints",
            Shed::Sheddable => "sheddable",
        }
    }
}

/// A request's class: its band and flow.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Class {
    pub band: usize,
    pub priority: i32,
    pub flow: String,
}

#[cfg(test)]
mod tests;

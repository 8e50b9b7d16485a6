//! The saturation detector: whether the pool has room for one more request
//! now. Flow control holds requests while it says no.
//!
//! The pool's saturation, as llm-d computes it (1.0 is the set point;
//! dispatch goes on while it is below the usage limit, 1.0 by default),
//! from what the scheduler sees ([`PoolEndpoint`]: this proxy's in-flight
//! counts, current to the request, with the mesh peers' load when the mesh
//! exchange is on; the server's polled metrics while fresh):
//! - `utilization-detector`: the mean over the endpoints of
//!   `max(W / queueDepthThreshold, kv / kvCacheUtilThreshold)`, an
//!   endpoint without fresh metrics counting 1.0. `W` is the server's
//!   waiting count as of the last poll, brought up to date with this
//!   proxy's own count: `W' = max(W, n − R)` (`n` our in-flight requests
//!   there, `R` its running ones at the poll). Requests of ours beyond
//!   what was running are new since the poll, and taken as waiting until
//!   the next poll says otherwise. Without that, a proxy dispatching
//!   between two polls sees the old count and over-dispatches; with it a
//!   burst pauses dispatch for at most one poll (the servers' own counts,
//!   which every proxy reads, stay the shared truth).
//! - `concurrency-detector`: this proxy's in-flight requests
//!   (`concurrencyMode: requests`) or tokens (`tokens`) over
//!   `endpoints × maxConcurrency` (or `maxTokenConcurrency`). It needs no
//!   metrics; with several proxies each counts its own.
//!
//! `headroom` is the bound of llm-d's filter role, which kvroute does not
//! run; it does not change the saturation. With no endpoint at all the
//! answer is [`Pool::NoEndpoints`] (requests wait up to
//! `noEndpointRequestTTL`, then 503).

use crate::scheduling::{saturation, Candidate, EndpointMetrics, RequestView};

/// A saturation detector, as configured.
#[derive(Clone, Debug, PartialEq)]
pub enum Detector {
    Utilization {
        queue_depth_threshold: f64,
        kv_cache_util_threshold: f64,
        headroom: f64,
    },
    Concurrency {
        /// `concurrencyMode: tokens`
        tokens: bool,
        max_requests: u64,
        max_tokens: u64,
        headroom: f64,
    },
    /// `kvroute-saturation-detector`.
    Kvroute {
        /// The wait that is saturation (score 1), ms.
        max_queue_ms: f64,
        /// Prefill tokens/s when the endpoint's own estimate is unknown.
        peak_prefill_tps: f64,
    },
}

impl Default for Detector {
    /// llm-d's defaults for `utilization-detector`.
    fn default() -> Detector {
        Detector::Utilization {
            queue_depth_threshold: 5.0,
            kv_cache_util_threshold: 0.8,
            headroom: 0.0,
        }
    }
}

/// One endpoint as the detector sees it.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct PoolEndpoint {
    pub inflight_requests: u64,
    pub inflight_tokens: u64,
    /// The prefill and held parts of `inflight_tokens`.
    pub inflight_prefill_tokens: u64,
    pub inflight_held_tokens: u64,
    /// The collector's prefill-throughput estimate, tokens/s, if any.
    pub prefill_tokens_per_s: Option<f64>,
    /// `None`: stale or never polled.
    pub metrics: Option<EndpointMetrics>,
}

/// The pool's state for admission.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Pool {
    NoEndpoints,
    /// The saturation (1.0: the set point), and whether the detector was
    /// blind (it reads metrics and no endpoint had fresh ones).
    Level {
        saturation: f64,
        blind: bool,
    },
}

impl Detector {
    /// One endpoint's score (utilization) or load share (concurrency).
    pub fn score(&self, e: &PoolEndpoint) -> f64 {
        match *self {
            Detector::Utilization {
                queue_depth_threshold,
                kv_cache_util_threshold,
                ..
            } => {
                let Some(m) = e.metrics else {
                    return 1.0;
                };
                let waiting = m
                    .waiting_requests
                    .max(e.inflight_requests as f64 - m.running_requests)
                    .max(0.0);
                (waiting / queue_depth_threshold.max(1e-9))
                    .max(m.kv_cache_usage / kv_cache_util_threshold.max(1e-9))
            }
            Detector::Concurrency {
                tokens,
                max_requests,
                max_tokens,
                ..
            } => {
                if tokens {
                    e.inflight_tokens as f64 / max_tokens.max(1) as f64
                } else {
                    e.inflight_requests as f64 / max_requests.max(1) as f64
                }
            }
            Detector::Kvroute {
                max_queue_ms,
                peak_prefill_tps,
            } => {
                let c = Candidate {
                    inflight_tokens: e.inflight_tokens,
                    inflight_requests: e.inflight_requests,
                    inflight_prefill_tokens: e.inflight_prefill_tokens,
                    inflight_held_tokens: e.inflight_held_tokens,
                    metrics: e.metrics,
                    ..Candidate::default()
                };
                // A request with no prompt: the queue alone (x = 0).
                let sig = saturation::signal(&RequestView::default(), &c);
                let rate = e
                    .prefill_tokens_per_s
                    .filter(|r| r.is_finite() && *r > 0.0)
                    .unwrap_or(peak_prefill_tps)
                    .max(1.0);
                let wait_ms = sig.ttft_tokens() / rate * 1000.0;
                let s = wait_ms / max_queue_ms.max(1.0);
                if s.is_finite() {
                    s
                } else {
                    0.0
                }
            }
        }
    }

    pub fn pool(&self, endpoints: &[PoolEndpoint]) -> Pool {
        if endpoints.is_empty() {
            return Pool::NoEndpoints;
        }
        let sum: f64 = endpoints.iter().map(|e| self.score(e)).sum();
        Pool::Level {
            saturation: sum / endpoints.len() as f64,
            blind: self.reads_metrics() && endpoints.iter().all(|e| e.metrics.is_none()),
        }
    }

    /// Whether the detector reads the servers' metrics.
    pub fn reads_metrics(&self) -> bool {
        matches!(self, Detector::Utilization { .. })
    }
}

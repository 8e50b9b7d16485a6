//! Flow control in a worker VM (`crate::flow` has the policy): admission
//! in the body callback, the queue, and dispatch and expiry on the root's
//! tick.
//!
//! A waiting request holds no charge and has written nothing to shared
//! state but its count on the board: it is routed (charged, indexed) only
//! when dispatched, so a client that goes away while waiting, or a shed
//! request, leaves nothing to take back. What a dispatch decides is kept
//! here until the request's stream takes it over (its next callback, or
//! its end).

use super::stream::{apply_outcome, Applied, Decided};
use super::{Host, Level, Worker};
use crate::config::FailureMode;
use crate::engine::{error_body, RequestFacts};
use crate::flow::board;
use crate::flow::queue::{BandLoad, Entry, Queue};
use crate::flow::{
    Class, FlowConfig, Pool, Shed, DROPPED_REASON_HEADER, MAX_DISPATCH_PER_TICK, RETRY_AFTER_S,
};
use crate::request::ApiKind;
use std::cell::{Cell, RefCell};

/// What admission says about a request.
pub(super) enum Admit {
    /// Route it now.
    Go(Box<RequestFacts>),
    /// It waits (the stream stays paused).
    Queued,
    /// Answer it now.
    Shed(Shed),
}

/// A request whose body was read, at admission.
pub(super) struct Arrival {
    /// Its stream's context id.
    pub id: u32,
    pub class: Class,
    /// Its body's bytes.
    pub bytes: u64,
    pub facts: RequestFacts,
}

/// Per band: counters, a wait histogram and the waiting gauge.
struct BandMetrics {
    queued: Option<u32>,
    dispatched: Option<u32>,
    cancelled: Option<u32>,
    shed: [Option<u32>; 4],
    wait_ms: Option<u32>,
    waiting: Option<u32>,
}

struct FlowMetrics {
    bands: Vec<BandMetrics>,
    saturation_pct: Option<u32>,
    blind: Option<u32>,
}

fn band_label(priority: i32) -> String {
    if priority < 0 {
        format!("m{}", priority.unsigned_abs())
    } else {
        priority.to_string()
    }
}

impl FlowMetrics {
    fn define(host: &dyn Host, cfg: &FlowConfig) -> FlowMetrics {
        let counter = |n: String| host.define_counter(&n).ok();
        let bands = cfg
            .bands
            .iter()
            .map(|b| {
                // `wasmcustom.kvroute_flow_<what>.band.<p>`: Envoy's tag
                // rule (BAND_TAG_REGEX) makes the band a label.
                let l = band_label(b.priority);
                let n = |what: &str| format!("kvroute_flow_{what}.band.{l}");
                BandMetrics {
                    queued: counter(n("queued")),
                    dispatched: counter(n("dispatched")),
                    cancelled: counter(n("cancelled")),
                    shed: [
                        counter(n("shed_capacity")),
                        counter(n("shed_ttl")),
                        counter(n("shed_no_endpoints")),
                        counter(n("shed_sheddable")),
                    ],
                    wait_ms: host.define_histogram(&n("wait_ms")).ok(),
                    waiting: host.define_gauge(&n("waiting")).ok(),
                }
            })
            .collect();
        FlowMetrics {
            bands,
            saturation_pct: host.define_gauge("kvroute_flow_saturation_pct").ok(),
            blind: host.define_counter("kvroute_flow_detector_blind").ok(),
        }
    }
}

fn bump(host: &dyn Host, id: Option<u32>) {
    if let Some(id) = id {
        let _ = host.increment_counter(id, 1);
    }
}

fn shed_index(s: Shed) -> usize {
    match s {
        Shed::Capacity => 0,
        Shed::Ttl => 1,
        Shed::NoEndpoints => 2,
        Shed::Sheddable => 3,
    }
}

/// Answers the effective context's request for flow control: 429 (with
/// `Retry-After`) or 503, an error in the shape of the request's API
/// (`api`: Anthropic's `rate_limit_error` or `overloaded_error` on the
/// Messages API, else OpenAI's) and llm-d's dropped-reason header.
pub(super) fn send_shed(host: &dyn Host, why: Shed, api: Option<ApiKind>) -> super::HostResult<()> {
    let body = error_body(api, why.message(), "rate_limit_exceeded", why.status());
    let retry = RETRY_AFTER_S.to_string();
    let mut headers: Vec<(&str, &str)> = vec![(DROPPED_REASON_HEADER, why.reason())];
    if why.status() == 429 {
        headers.push(("retry-after", &retry));
    }
    host.send_json_response_with(why.status(), &body, &headers)
}

/// A worker's flow control.
pub struct FlowState {
    pub cfg: FlowConfig,
    /// This worker's record on the board.
    id: u64,
    queue: RefCell<Queue<Box<RequestFacts>>>,
    /// Dispatched requests whose streams have not taken over yet.
    dispatched: RefCell<Vec<(u32, Box<Decided>)>>,
    /// The board holds a record of ours (cleared when the queue empties).
    on_board: Cell<bool>,
    metrics: FlowMetrics,
}

impl FlowState {
    pub fn new(host: &dyn Host, cfg: FlowConfig, id: u64) -> FlowState {
        let metrics = FlowMetrics::define(host, &cfg);
        FlowState {
            queue: RefCell::new(Queue::new(&cfg.policies())),
            cfg,
            id,
            dispatched: RefCell::new(Vec::new()),
            on_board: Cell::new(false),
            metrics,
        }
    }

    /// Requests waiting in this worker.
    pub fn waiting(&self) -> usize {
        self.queue.borrow().len()
    }

    /// The pool's saturation now (`None`: no endpoint). A detector blind
    /// to every endpoint (no fresh metrics: the collector is down) counts
    /// as saturated in `failureMode: closed`, as in llm-d, and as room in
    /// `open` (requests flow as without flow control; counted).
    fn saturation(&self, w: &Worker, host: &dyn Host, now_ms: u64) -> Option<f64> {
        let pool = match w
            .engine
            .pool_endpoints(host.store(), now_ms, self.cfg.stale_ms)
        {
            Ok(eps) => self.cfg.detector.pool(&eps),
            Err(e) => {
                w.host_error(host, "reading the pool for flow control", e);
                return match w.engine.config.routing.failure_mode {
                    FailureMode::Open => Some(0.0),
                    FailureMode::Closed => Some(f64::INFINITY),
                };
            }
        };
        let s = match pool {
            Pool::NoEndpoints => return None,
            Pool::Level { saturation, blind } => {
                if blind && w.engine.config.routing.failure_mode == FailureMode::Open {
                    bump(host, self.metrics.blind);
                    0.0
                } else {
                    saturation
                }
            }
        };
        if let Some(g) = self.metrics.saturation_pct {
            let _ = host.record_metric(g, (s * 100.0).clamp(0.0, 1e9) as u64);
        }
        Some(s)
    }

    fn others(&self, w: &Worker, host: &dyn Host, now_ms: u64) -> Vec<BandLoad> {
        match board::read(host.store()) {
            Ok(b) => b.others(self.id, now_ms, self.cfg.bands.len()),
            Err(e) => {
                w.host_error(host, "reading the flow-control board", e);
                vec![BandLoad::default(); self.cfg.bands.len()]
            }
        }
    }

    fn publish(&self, w: &Worker, host: &dyn Host, now_ms: u64) {
        let loads = self.queue.borrow().loads();
        let any = loads.iter().any(|l| l.requests > 0);
        if !any && !self.on_board.get() {
            return;
        }
        match board::publish(host.store(), self.id, now_ms, &loads) {
            Ok((retries, all)) => {
                self.on_board.set(any);
                w.counts
                    .add(host, super::Counter::CasRetries, u64::from(retries));
                // The gauge is process-wide: what waits in every worker.
                for (m, l) in self.metrics.bands.iter().zip(&all) {
                    if let Some(g) = m.waiting {
                        let _ = host.record_metric(g, l.requests);
                    }
                }
            }
            Err(e) => w.host_error(host, "writing the flow-control board", e),
        }
    }

    /// Admission of a request whose body was read (its stream is `id`).
    pub(super) fn admit(&self, w: &Worker, host: &dyn Host, a: Arrival, now_ms: u64) -> Admit {
        let Arrival {
            id,
            class,
            bytes,
            facts,
        } = a;
        let class = &class;
        let sat = self.saturation(w, host, now_ms);
        let ceiling = self.cfg.ceiling;
        if !self.cfg.queueing {
            // llm-d's legacy admission: only sheddable requests are refused.
            if class.priority < 0 && sat.is_some_and(|s| s >= ceiling) {
                self.count_shed(host, class.band, Shed::Sheddable);
                return Admit::Shed(Shed::Sheddable);
            }
            return Admit::Go(Box::new(facts));
        }
        let local = self.queue.borrow().loads();
        let others = self.others(w, host, now_ms);
        let waiting = |b: usize| local[b].requests + others[b].requests;
        // Nobody at or above this band waits, and there is room: go.
        let ahead = (0..=class.band.min(local.len().saturating_sub(1))).any(|b| waiting(b) > 0);
        if !ahead && sat.is_some_and(|s| s < ceiling) {
            return Admit::Go(Box::new(facts));
        }
        // Bounds (this worker's queue and the others' as of their last
        // write).
        let total: u64 = (0..local.len()).map(waiting).sum();
        let total_bytes: u64 = local
            .iter()
            .zip(&others)
            .map(|(a, b)| a.bytes + b.bytes)
            .sum();
        let band = &self.cfg.bands[class.band];
        let band_bytes = local[class.band].bytes + others[class.band].bytes;
        let full = (self.cfg.max_requests > 0 && total + 1 > self.cfg.max_requests)
            || (self.cfg.max_bytes > 0 && total_bytes + bytes > self.cfg.max_bytes)
            || waiting(class.band) + 1 > band.max_requests
            || band_bytes + bytes > band.max_bytes;
        if full {
            let why = if sat.is_none() {
                Shed::NoEndpoints
            } else {
                Shed::Capacity
            };
            self.count_shed(host, class.band, why);
            return Admit::Shed(why);
        }
        let deadline_ms = match self.cfg.ttl_ms {
            0 => u64::MAX,
            t => now_ms.saturating_add(t),
        };
        self.queue.borrow_mut().push(Entry {
            id,
            band: class.band,
            flow: class.flow.clone(),
            enqueued_ms: now_ms,
            deadline_ms,
            bytes,
            seq: 0,
            item: Box::new(facts),
        });
        bump(host, self.metrics.bands[class.band].queued);
        self.publish(w, host, now_ms);
        Admit::Queued
    }

    fn count_shed(&self, host: &dyn Host, band: usize, why: Shed) {
        if let Some(m) = self.metrics.bands.get(band) {
            bump(host, m.shed[shed_index(why)]);
        }
    }

    /// The stream `id` ended while waiting: takes it out (counted). False
    /// when it was not waiting.
    pub(super) fn cancel(&self, w: &Worker, host: &dyn Host, id: u32) -> bool {
        let e = self.queue.borrow_mut().remove(id);
        let Some(e) = e else {
            return false;
        };
        if let Some(m) = self.metrics.bands.get(e.band) {
            bump(host, m.cancelled);
        }
        let now = w.now_ms(host);
        self.publish(w, host, now);
        true
    }

    /// What dispatch decided for stream `id`, once.
    pub(super) fn take_dispatched(&self, id: u32) -> Option<Box<Decided>> {
        let mut d = self.dispatched.borrow_mut();
        let i = d.iter().position(|(x, _)| *x == id)?;
        Some(d.swap_remove(i).1)
    }

    /// Answers a waiting request locally (its stream made effective).
    fn shed_waiting(&self, w: &Worker, host: &dyn Host, e: &Entry<Box<RequestFacts>>, why: Shed) {
        self.count_shed(host, e.band, why);
        if let Err(err) = host.set_effective_context(e.id) {
            w.host_error(host, "switching to a waiting request", err);
            return;
        }
        if let Err(err) = send_shed(host, why, e.item.api) {
            w.host_error(host, "shedding a waiting request", err);
        }
    }

    /// The root's tick: sheds what waited too long, then dispatches while
    /// the pool has room, highest band first; a band's turn waits for
    /// another worker's higher band or earlier arrival in the same band.
    pub(super) fn on_tick(&self, w: &Worker, host: &dyn Host, now_ms: u64) {
        if self.queue.borrow().is_empty() {
            if self.on_board.get() {
                self.publish(w, host, now_ms);
            }
            return;
        }
        let mut sat = self.saturation(w, host, now_ms);
        // Expiry: with endpoints, the TTL; with none, noEndpointRequestTTL.
        let expired = {
            let ne = self.cfg.no_endpoint_ttl_ms;
            let mut q = self.queue.borrow_mut();
            match sat {
                Some(_) => q.take_if(|e| e.deadline_ms <= now_ms),
                None if ne > 0 => q.take_if(|e| e.enqueued_ms.saturating_add(ne) <= now_ms),
                None => Vec::new(),
            }
        };
        for e in &expired {
            let why = if sat.is_some() {
                Shed::Ttl
            } else {
                Shed::NoEndpoints
            };
            self.shed_waiting(w, host, e, why);
        }
        let others = self.others(w, host, now_ms);
        for _ in 0..MAX_DISPATCH_PER_TICK {
            let Some((band, enq)) = self.queue.borrow().head().map(|e| (e.band, e.enqueued_ms))
            else {
                break;
            };
            if others[..band].iter().any(|o| o.requests > 0) {
                break;
            }
            let o = &others[band];
            if o.requests > 0 && o.oldest_ms != 0 && o.oldest_ms < enq {
                break;
            }
            if !sat.is_some_and(|s| s < self.cfg.ceiling) {
                break;
            }
            let Some(e) = self.queue.borrow_mut().pop_head() else {
                break;
            };
            self.dispatch(w, host, e, now_ms);
            sat = self.saturation(w, host, now_ms);
        }
        self.publish(w, host, now_ms);
    }

    /// Routes a waiting request now and lets its stream go on.
    fn dispatch(&self, w: &Worker, host: &dyn Host, e: Entry<Box<RequestFacts>>, now_ms: u64) {
        if let Some(m) = self.metrics.bands.get(e.band) {
            bump(host, m.dispatched);
            if let Some(h) = m.wait_ms {
                let _ = host.record_metric(h, now_ms.saturating_sub(e.enqueued_ms));
            }
        }
        if let Err(err) = host.set_effective_context(e.id) {
            // The stream is gone (its end will find nothing to release).
            w.host_error(host, "switching to a dispatched request", err);
            return;
        }
        let outcome = {
            let mut rng = w.rng.borrow_mut();
            w.engine.route(host.store(), *e.item, now_ms, &mut rng)
        };
        match apply_outcome(w, host, outcome) {
            Applied::Routed(d) => {
                self.dispatched.borrow_mut().push((e.id, d));
                self.resume(w, host);
            }
            Applied::Unrouted => self.resume(w, host),
            Applied::Replied => {}
        }
    }

    fn resume(&self, w: &Worker, host: &dyn Host) {
        if let Err(err) = host.resume_request() {
            w.host_error(host, "resuming a dispatched request", err);
            host.log(
                Level::Warn,
                "kvroute: a dispatched request could not be resumed; it ends at Envoy's timeout",
            );
        }
    }
}

//! One endpoint's runtime: the engine behind a lock, the loop that runs its
//! iterations in (scaled) real time, and the hand-off of tokens to the HTTP
//! handlers waiting for them.
//!
//! Model time runs at `time_scale` × wall-clock time. The loop keeps a model
//! clock that advances by each iteration's duration and sleeps until the
//! matching wall-clock instant, so short iterations at a large time scale
//! do not drift even though each sleep is coarse. After an idle spell the
//! model clock jumps to "now".

use super::EmulatorConfig;
use crate::kv_events::KvEvent;
use crate::vllm_hash::VllmBlockHasher;
use kvroute_sim_model::vllm_model::{AdmitError, Engine, EngineRequest, RequestId};
use kvroute_sim_model::vllm_server::metrics_text;
pub use kvroute_sim_model::vllm_server::metrics_text::Snapshot;
pub use kvroute_sim_model::vllm_server::unix_now_s;
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};
use tokio::sync::{mpsc, Notify};

/// How `/metrics` answers (`POST /emulator/metrics-mode`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MetricsMode {
    Ok,
    /// 500 Internal Server Error.
    Status500,
    /// 200 with a body that is not Prometheus text.
    Garbage,
    /// Never answers.
    Hang,
}

impl MetricsMode {
    pub fn parse(s: &str) -> Option<MetricsMode> {
        match s.trim() {
            "ok" => Some(MetricsMode::Ok),
            "500" => Some(MetricsMode::Status500),
            "garbage" => Some(MetricsMode::Garbage),
            "hang" => Some(MetricsMode::Hang),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            MetricsMode::Ok => "ok",
            MetricsMode::Status500 => "500",
            MetricsMode::Garbage => "garbage",
            MetricsMode::Hang => "hang",
        }
    }
}

/// Progress of one request, sent to its HTTP handler.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Progress {
    /// Output tokens generated so far.
    pub generated: u32,
    /// This message carries the first token.
    pub first: bool,
    pub cached_tokens: u32,
    pub finished: bool,
}

struct Waiter {
    tx: mpsc::UnboundedSender<Progress>,
    /// Tokens already reported.
    reported: u32,
    /// Report every this many tokens (first and last always).
    interval: u32,
    /// The LoRA adapter the request names (`None`: the base model).
    adapter: Option<String>,
}

/// Most `vllm:lora_requests_info` series kept (vLLM keeps every label set
/// it ever set; the emulator drops the stalest past this).
const MAX_LORA_SERIES: usize = 64;

/// Wall-clock ↔ model-time mapping.
#[derive(Clone, Copy, Debug)]
pub struct ModelClock {
    start: Instant,
    scale: f64,
}

impl ModelClock {
    pub fn new(scale: f64) -> ModelClock {
        ModelClock {
            start: Instant::now(),
            scale: if scale > 0.0 { scale } else { 1.0 },
        }
    }

    /// Model seconds since start.
    pub fn now(&self) -> f64 {
        self.start.elapsed().as_secs_f64() * self.scale
    }

    /// The wall-clock instant of model time `t` (seconds).
    pub fn instant_at(&self, t: f64) -> Instant {
        self.start + Duration::from_secs_f64((t / self.scale).max(0.0))
    }
}

/// One emulated vLLM server.
pub struct Endpoint {
    pub cfg: EmulatorConfig,
    pub addr: SocketAddr,
    /// Value of the `x-kvroute-served-by` header.
    pub served_by: String,
    pub hasher: VllmBlockHasher,
    /// Unix time the endpoint started (for `_created` samples).
    pub started_unix_s: f64,
    engine: Mutex<Engine>,
    waiters: Mutex<HashMap<RequestId, Waiter>>,
    work: Notify,
    clock: ModelClock,
    metrics_mode: Mutex<MetricsMode>,
    kv_tx: Option<mpsc::UnboundedSender<Vec<KvEvent>>>,
    /// Responses replaced by an injected fault.
    pub fault_responses: AtomicU64,
    /// `GET /metrics` requests answered, whatever the metrics mode.
    pub metrics_scrapes: AtomicU64,
    /// `vllm:lora_requests_info`'s series: (adapter names label, unix time
    /// last set), oldest label set first.
    lora_series: Mutex<Vec<(String, f64)>>,
    /// Model microseconds skipped because the host fell behind the time
    /// scale; non-zero means latencies are inflated (lower --time-scale).
    pub host_lag_model_us: AtomicU64,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while holding the lock leaves consistent-enough state for an
    // emulator; keep serving rather than poisoning every later request.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Endpoint {
    pub fn new(
        cfg: EmulatorConfig,
        addr: SocketAddr,
        kv_tx: Option<mpsc::UnboundedSender<Vec<KvEvent>>>,
    ) -> Arc<Endpoint> {
        Arc::new(Endpoint {
            engine: Mutex::new(Engine::new(cfg.engine.clone(), kv_tx.is_some())),
            hasher: VllmBlockHasher::new(Some(&cfg.python_hash_seed)),
            clock: ModelClock::new(cfg.time_scale),
            served_by: addr.to_string(),
            addr,
            cfg,
            started_unix_s: unix_now_s(),
            waiters: Mutex::new(HashMap::new()),
            work: Notify::new(),
            metrics_mode: Mutex::new(MetricsMode::Ok),
            kv_tx,
            fault_responses: AtomicU64::new(0),
            metrics_scrapes: AtomicU64::new(0),
            lora_series: Mutex::new(Vec::new()),
            host_lag_model_us: AtomicU64::new(0),
        })
    }

    pub fn kv_events_enabled(&self) -> bool {
        self.kv_tx.is_some()
    }

    /// Queues a request (for LoRA adapter `adapter`, if any); progress
    /// arrives on the returned receiver. `stream_interval` of 0 reports
    /// only the first and the last token.
    pub fn submit(
        &self,
        req: EngineRequest,
        stream_interval: u32,
        adapter: Option<String>,
    ) -> Result<(RequestId, mpsc::UnboundedReceiver<Progress>), AdmitError> {
        let (tx, rx) = mpsc::unbounded_channel();
        let id = {
            let mut engine = lock(&self.engine);
            let id = engine.add_request(req, self.clock.now())?;
            // Registered under the engine lock, so no output can be missed.
            lock(&self.waiters).insert(
                id,
                Waiter {
                    tx,
                    reported: 0,
                    interval: if stream_interval == 0 {
                        u32::MAX
                    } else {
                        stream_interval
                    },
                    adapter,
                },
            );
            id
        };
        self.work.notify_one();
        Ok((id, rx))
    }

    /// Drops a request (client gone); a no-op once it has finished.
    pub fn abort(&self, id: RequestId) {
        let mut engine = lock(&self.engine);
        engine.abort(id);
        lock(&self.waiters).remove(&id);
    }

    /// Clears the prefix cache and the counters.
    pub fn reset(&self) {
        let events = {
            let mut engine = lock(&self.engine);
            engine.reset_cache_and_counters();
            engine.drain_kv_events()
        };
        self.fault_responses.store(0, Ordering::Relaxed);
        self.metrics_scrapes.store(0, Ordering::Relaxed);
        self.publish(events);
    }

    pub fn metrics_mode(&self) -> MetricsMode {
        *lock(&self.metrics_mode)
    }

    pub fn set_metrics_mode(&self, m: MetricsMode) {
        *lock(&self.metrics_mode) = m;
    }

    /// `vllm:lora_requests_info` now, as vLLM 0.32 reports it: every
    /// adapter with a request in flight (waiting or running) is listed in
    /// both `running_lora_adapters` and `waiting_lora_adapters` (vLLM sets
    /// a key per adapter with any request, its count possibly 0), in the
    /// order of their oldest request in flight; the current label set's
    /// value is now, and the series of earlier label sets stay with the
    /// time they were last current (vLLM's gauge keeps every label set).
    /// vLLM sets it at each engine step; the emulator at each scrape.
    pub fn lora_info_text(&self, now_unix_s: f64) -> String {
        let names = {
            let waiters = lock(&self.waiters);
            let mut by_age: Vec<(RequestId, &str)> = waiters
                .iter()
                .filter_map(|(id, w)| w.adapter.as_deref().map(|a| (*id, a)))
                .collect();
            by_age.sort_unstable();
            let mut names: Vec<&str> = Vec::new();
            for (_, a) in by_age {
                if !names.contains(&a) {
                    names.push(a);
                }
            }
            names.join(",")
        };
        let mut series = lock(&self.lora_series);
        match series.iter_mut().find(|(l, _)| *l == names) {
            Some(s) => s.1 = now_unix_s,
            None => {
                if series.len() >= MAX_LORA_SERIES {
                    if let Some(k) =
                        (0..series.len()).min_by(|&a, &b| series[a].1.total_cmp(&series[b].1))
                    {
                        series.remove(k);
                    }
                }
                series.push((names, now_unix_s));
            }
        }
        series
            .iter()
            .map(|(l, t)| metrics_text::lora_requests_info(self.cfg.max_loras, l, *t))
            .collect::<Vec<_>>()
            .concat()
    }

    pub fn snapshot(&self) -> Snapshot {
        let engine = lock(&self.engine);
        Snapshot {
            fault_responses: self.fault_responses.load(Ordering::Relaxed),
            host_lag_model_s: self.host_lag_model_us.load(Ordering::Relaxed) as f64 / 1e6,
            ..Snapshot::of(&engine)
        }
    }

    fn publish(&self, events: Vec<KvEvent>) {
        if let (Some(tx), false) = (&self.kv_tx, events.is_empty()) {
            let _ = tx.send(events);
        }
    }
}

/// Runs the endpoint's iterations forever (until the task is aborted).
pub async fn run_engine(ep: Arc<Endpoint>) {
    // Wall-clock lag tolerated before the model clock is pulled forward
    // (the host cannot keep up); smaller lags are caught up by not sleeping.
    const MAX_LAG: Duration = Duration::from_millis(50);
    let max_lag_model_s = MAX_LAG.as_secs_f64() * ep.clock.scale;
    let mut model_t = 0.0f64;
    let mut idle = true;
    loop {
        let step = {
            let mut engine = lock(&ep.engine);
            if engine.has_work() {
                let now = ep.clock.now();
                if idle {
                    model_t = model_t.max(now);
                } else if now - model_t > max_lag_model_s {
                    // Model time the host could not deliver on time.
                    let lag_us = ((now - model_t) * 1e6) as u64;
                    ep.host_lag_model_us.fetch_add(lag_us, Ordering::Relaxed);
                    model_t = now;
                }
                idle = false;
                Some(engine.step(model_t))
            } else {
                None
            }
        };
        let Some(step) = step else {
            idle = true;
            ep.work.notified().await;
            continue;
        };
        if step.duration_s <= 0.0 && step.outputs.is_empty() {
            // Nothing could be scheduled; wait for a change instead of spinning.
            let _ = tokio::time::timeout(Duration::from_millis(5), ep.work.notified()).await;
            continue;
        }
        ep.publish(step.kv_events);
        model_t += step.duration_s;
        tokio::time::sleep_until(ep.clock.instant_at(model_t).into()).await;

        let mut gone = Vec::new();
        {
            let mut waiters = lock(&ep.waiters);
            for o in step.outputs {
                let Some(w) = waiters.get_mut(&o.id) else {
                    continue;
                };
                let due = o.first || o.finished || o.generated - w.reported >= w.interval;
                if due {
                    w.reported = o.generated;
                    let sent = w.tx.send(Progress {
                        generated: o.generated,
                        first: o.first,
                        cached_tokens: o.cached_tokens,
                        finished: o.finished,
                    });
                    if sent.is_err() && !o.finished {
                        gone.push(o.id);
                    }
                }
                if o.finished {
                    waiters.remove(&o.id);
                }
            }
        }
        for id in gone {
            ep.abort(id);
        }
    }
}

//! The collector singleton: keeps the shared endpoint table and metrics
//! current, and reaps orphaned charges.
//!
//! Every tick: refresh membership from Envoy's admin API (`fromCluster`),
//! poll each endpoint's `/metrics` through `collector.metricsCluster` with
//! the destination header naming the endpoint (override_host sends it
//! there), and reap charges older than `collector.reapAfterMs`. At most one
//! call per target is in flight; a call that times out comes back with no
//! headers and counts as a failed poll.

use crate::host::{self, Buffer, Level, Map};
use crate::stats::{Counter, Stats};
use kvroute_core::config::EndpointSource;
use kvroute_core::engine::Engine;
use std::collections::HashMap;

enum Pending {
    Admin,
    Metrics { slot: u16, generation: u16 },
}

pub struct Collector {
    engine: Engine,
    stats: Stats,
    pending: HashMap<u32, Pending>,
    next_refresh_ms: u64,
    next_poll_ms: u64,
    next_reap_ms: u64,
}

/// Tick period: fine enough for the shortest configured interval.
fn tick_ms(engine: &Engine) -> u32 {
    let mut t = engine.config.collector.metrics_poll_interval_ms;
    if let EndpointSource::FromCluster { refresh_ms, .. } = &engine.config.endpoints {
        t = t.min(*refresh_ms);
    }
    (t / 2).clamp(25, 1000) as u32
}

impl Collector {
    pub fn start(engine: Engine, stats: Stats) -> Result<Collector, String> {
        engine
            .collector_init(&host::HostStore)
            .map_err(|e| format!("cannot initialise shared state: {e}"))?;
        host::set_tick_period_ms(tick_ms(&engine)).map_err(|e| e.to_string())?;
        Ok(Collector {
            engine,
            stats,
            pending: HashMap::new(),
            next_refresh_ms: 0,
            next_poll_ms: 0,
            next_reap_ms: 0,
        })
    }

    pub fn on_tick(&mut self) {
        let now = match host::now_ms() {
            Ok(t) => t,
            Err(e) => {
                host::log(Level::Warn, &format!("kvroute collector: {e}"));
                return;
            }
        };
        if let EndpointSource::FromCluster {
            admin_cluster,
            refresh_ms,
            ..
        } = &self.engine.config.endpoints
        {
            let in_flight = self.pending.values().any(|p| matches!(p, Pending::Admin));
            if now >= self.next_refresh_ms && !in_flight {
                self.next_refresh_ms = now + refresh_ms;
                let headers = [
                    (":method", "GET"),
                    (":path", "/clusters?format=json"),
                    (":authority", "envoy-admin"),
                ];
                match host::http_call(admin_cluster, &headers, 5_000) {
                    Ok(token) => {
                        self.pending.insert(token, Pending::Admin);
                    }
                    Err(e) => host::log(
                        Level::Warn,
                        &format!("kvroute collector: admin call to cluster {admin_cluster}: {e}"),
                    ),
                }
            }
        }
        if now >= self.next_poll_ms {
            self.next_poll_ms = now + self.engine.config.collector.metrics_poll_interval_ms;
            self.poll_metrics(now);
        }
        if now >= self.next_reap_ms {
            self.next_reap_ms = now + 1000;
            match self.engine.reap(&host::HostStore, now) {
                Ok(0) => {}
                Ok(n) => {
                    self.stats.add(Counter::ReapedRequests, n);
                    host::log(Level::Warn, &format!("kvroute collector: reaped {n} orphaned in-flight charges (a request ended without releasing)"));
                }
                Err(e) => host::log(Level::Warn, &format!("kvroute collector: reaping: {e}")),
            }
        }
    }

    fn poll_metrics(&mut self, now: u64) {
        let Some(cluster) = self.engine.config.collector.metrics_cluster.clone() else {
            return;
        };
        let table = match self.engine.endpoint_table(&host::HostStore) {
            Ok(t) => t,
            Err(e) => {
                host::log(
                    Level::Warn,
                    &format!("kvroute collector: reading endpoints: {e}"),
                );
                return;
            }
        };
        let timeout = self
            .engine
            .config
            .collector
            .metrics_timeout_ms
            .min(u64::from(u32::MAX)) as u32;
        let path = self.engine.config.collector.metrics_path.clone();
        let header = self.engine.config.routing.destination_header.clone();
        for e in &table.endpoints {
            let busy = self
                .pending
                .values()
                .any(|p| matches!(p, Pending::Metrics { slot, .. } if *slot == e.slot));
            if busy {
                continue;
            }
            let headers = [
                (":method", "GET"),
                (":path", path.as_str()),
                (":authority", e.address.as_str()),
                (header.as_str(), e.address.as_str()),
            ];
            match host::http_call(&cluster, &headers, timeout) {
                Ok(token) => {
                    self.pending.insert(
                        token,
                        Pending::Metrics {
                            slot: e.slot,
                            generation: e.generation,
                        },
                    );
                }
                Err(err) => {
                    self.stats.inc(Counter::MetricsPollFailures);
                    host::log(
                        Level::Warn,
                        &format!("kvroute collector: /metrics call for {}: {err}", e.address),
                    );
                    let _ = self.engine.record_metrics(
                        &host::HostStore,
                        e.slot,
                        e.generation,
                        Err(()),
                        now,
                    );
                }
            }
        }
    }

    pub fn on_http_call_response(&mut self, token: u32, num_headers: usize, body_size: usize) {
        let Some(kind) = self.pending.remove(&token) else {
            return;
        };
        let now = host::now_ms().unwrap_or(0);
        let status = if num_headers == 0 {
            None
        } else {
            host::get_header(Map::HttpCallResponseHeaders, ":status")
                .ok()
                .flatten()
        };
        let body = if status.as_deref() == Some("200") {
            host::get_buffer(Buffer::HttpCallResponseBody, 0, body_size)
                .ok()
                .flatten()
        } else {
            None
        };
        match kind {
            Pending::Admin => match body {
                Some(b) => {
                    if let Err(e) = self.engine.apply_admin_clusters(&host::HostStore, &b) {
                        host::log(Level::Warn, &format!("kvroute collector: {e}"));
                    }
                }
                None => host::log(
                    Level::Warn,
                    &format!(
                        "kvroute collector: admin /clusters answered {}",
                        status.as_deref().unwrap_or("nothing (timeout or reset)")
                    ),
                ),
            },
            Pending::Metrics { slot, generation } => {
                let result = body.as_deref().ok_or(());
                if result.is_err() {
                    self.stats.inc(Counter::MetricsPollFailures);
                }
                match self
                    .engine
                    .record_metrics(&host::HostStore, slot, generation, result, now)
                {
                    Ok(Some(problem)) => {
                        self.stats.inc(Counter::MetricsPollFailures);
                        host::log(
                            Level::Debug,
                            &format!("kvroute collector: slot {slot}: {problem}"),
                        );
                    }
                    Ok(None) => {}
                    Err(e) => host::log(
                        Level::Warn,
                        &format!("kvroute collector: storing metrics: {e}"),
                    ),
                }
            }
        }
    }
}

//! The collector singleton: keeps the shared endpoint table and metrics
//! current, and reaps orphaned charges.
//!
//! Every tick: refresh membership from Envoy's admin API (`fromCluster`),
//! poll each endpoint's `/metrics` through `collector.metricsCluster`, and
//! reap charges older than `collector.reapAfterMs`. Every
//! `collector.modelsPollIntervalMs` (and at once for a new endpoint) it
//! also asks each endpoint's `collector.modelsPath` (`/v1/models`) for the
//! models and LoRA adapters it serves (`engine/models.rs`). At most one call per
//! target is in flight; a call that times out comes back with no headers and
//! counts as a failed poll.
//!
//! A poll names its endpoint in [`ORIGINAL_DST_HOST_HEADER`] (an
//! `ORIGINAL_DST` cluster with `use_http_header` connects to that address
//! and nowhere else: the shipped `kvroute_metrics`) and in the destination
//! header (an override_host cluster). Through an override_host cluster an
//! endpoint that is no longer a healthy member is answered by the fallback
//! policy's pick, so another server's counters would be recorded under it;
//! `docs/configuration.md` (`metricsCluster`) says to use the former.
//!
//! With `kvEvents.enabled`, every `kvEvents.pollMs` it also calls each
//! endpoint's KV-event relay (`kvEvents.relays`, else the endpoint's IP at
//! `kvEvents.relayPort`) through the `ORIGINAL_DST` cluster `kvEvents.cluster`
//! (the relay's `ip:port` in [`RELAY_HOST_HEADER`]), and applies the answer
//! to the endpoint's held set (`Engine::apply_relay_answer`). The relay position
//! (epoch, seq) lives in shared data with the set, so in `lease` mode a new
//! leader carries on where the last one stopped.
//!
//! With `collector.mode: lease` every worker VM has a collector and only
//! the one holding the lease ([`super::lease`]) does this work each tick.

use super::lease::{Lease, Schedule, Standing};
use super::mesh_link::MeshLink;
use super::telemetry::{self, CollectorStats};
use super::{Counter, Counts, Host, HostResult, Level};
use crate::config::{CollectorMode, EndpointSource, ORIGINAL_DST_HOST_HEADER, RELAY_HOST_HEADER};
use crate::engine::Engine;
use crate::reports::relay::{ask_path, next_ask, Ask};
use kvroute_shared_state::collector_tick;
use kvroute_shared_state::held::HeldTable;
use std::collections::HashMap;

/// The collector's timers, in ms, all derived from the configuration here
/// so the tick and the intervals it serves are decided in one place.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Timers {
    /// The tick period: half the shortest interval below, within 25..=1000 ms.
    pub tick_ms: u32,
    /// `endpoints.fromCluster.refreshMs`, when discovery reads Envoy's admin.
    pub admin_refresh_ms: Option<u64>,
    /// Timeout of the admin `/clusters` call.
    pub admin_timeout_ms: u32,
    /// `collector.metricsPollIntervalMs`.
    pub metrics_poll_ms: u64,
    /// `collector.metricsTimeoutMs`, capped at `u32::MAX`.
    pub metrics_timeout_ms: u32,
    /// How often orphaned charges are looked for: a quarter of
    /// `collector.reapAfterMs`, within 100..=1000 ms.
    pub reap_every_ms: u64,
    /// `kvEvents.pollMs`, when `kvEvents.enabled`.
    pub kv_events_poll_ms: Option<u64>,
    /// `collector.modelsPollIntervalMs`, unless 0 (never).
    pub models_poll_ms: Option<u64>,
    /// `kvEvents.timeoutMs`.
    pub kv_events_timeout_ms: u32,
}

/// Timeout of the admin `/clusters` call, ms: the admin listener is local.
const ADMIN_TIMEOUT_MS: u32 = 5_000;

impl Timers {
    pub fn from_engine(engine: &Engine) -> Timers {
        let c = &engine.config.collector;
        let admin_refresh_ms = match &engine.config.endpoints {
            EndpointSource::FromCluster { refresh_ms, .. } => Some(*refresh_ms),
            _ => None,
        };
        let kv = &engine.config.kv_events;
        let kv_events_poll_ms = kv.enabled.then_some(kv.poll_ms);
        let shortest = admin_refresh_ms
            .into_iter()
            .chain(kv_events_poll_ms)
            .fold(c.metrics_poll_interval_ms, u64::min);
        Timers {
            tick_ms: (shortest / 2).clamp(25, 1000) as u32,
            admin_refresh_ms,
            admin_timeout_ms: ADMIN_TIMEOUT_MS,
            metrics_poll_ms: c.metrics_poll_interval_ms,
            metrics_timeout_ms: c.metrics_timeout_ms.min(u64::from(u32::MAX)) as u32,
            reap_every_ms: (c.reap_after_ms / 4).clamp(100, 1000),
            kv_events_poll_ms,
            kv_events_timeout_ms: kv.timeout_ms.min(u64::from(u32::MAX)) as u32,
            models_poll_ms: (c.models_poll_interval_ms > 0).then_some(c.models_poll_interval_ms),
        }
    }
}

enum Pending {
    Admin,
    Metrics {
        slot: u16,
        generation: u16,
    },
    /// A `/v1/models` call (`engine/models.rs`).
    Models {
        slot: u16,
        generation: u16,
    },
    Relay {
        slot: u16,
        generation: u16,
        ask: Ask,
        relay: String,
        /// The view's consecutive failures when the call was made: only the
        /// first of a run is logged as a warning.
        failures: u32,
    },
    Mesh {
        slot: u16,
        generation: u16,
        relay: String,
        /// Decisions the post carried (lost if it fails).
        decisions: u64,
    },
}

pub struct Collector {
    engine: Engine,
    counts: Counts,
    timers: Timers,
    pending: HashMap<u32, Pending>,
    next_refresh_ms: u64,
    next_poll_ms: u64,
    next_reap_ms: u64,
    next_kv_events_ms: u64,
    next_models_ms: u64,
    /// Endpoints (slot, generation) whose model list was asked for: a new
    /// one is asked at once, not at the next `modelsPollIntervalMs`.
    models_asked: std::collections::HashSet<(u16, u16)>,
    /// The last time the clock answered (see [`Collector::now_ms`]).
    last_now_ms: u64,
    /// `lease` mode: this VM's part in the election.
    lease: Option<Lease>,
    /// The gauges (`telemetry`), published by the VM that collects.
    stats: CollectorStats,
    /// `mesh.exchange`: this proxy's side of the exchange.
    mesh: Option<MeshLink>,
    /// Mesh posts that failed in a row (only the first is a warning).
    mesh_failures: u32,
    /// `tokenizeIn: collector`: the tokenizers and their queue.
    tokenizing: super::tokenizing::Tokenizing,
}

impl Collector {
    /// Initialises the shared state (missing keys only) and, in `lease`
    /// mode, joins the election. The caller sets the tick period (at most
    /// [`Timers::tick_ms`]).
    pub fn start(host: &dyn Host, engine: Engine) -> Result<Collector, String> {
        engine
            .collector_init(host.store())
            .map_err(|e| format!("cannot initialise shared state: {e}"))?;
        let timers = Timers::from_engine(&engine);
        let lease = match engine.config.collector.mode {
            CollectorMode::Singleton => None,
            CollectorMode::Lease => {
                let now_ns = host.now_ns().map_err(|e| e.to_string())?;
                let lease = Lease::join(host.store(), engine.config.collector.lease_ms, now_ns)
                    .map_err(|e| format!("cannot join the collector lease: {e}"))?;
                Some(lease)
            }
        };
        let mesh = if engine.config.mesh.enabled {
            let link = MeshLink::start(host)?;
            host.log(
                Level::Info,
                &format!(
                    "kvroute collector: mesh exchange on, through the KV-event relays, as proxy {}",
                    link.proxy()
                ),
            );
            Some(link)
        } else {
            None
        };
        Ok(Collector {
            tokenizing: super::tokenizing::Tokenizing::new(&engine),
            mesh,
            mesh_failures: 0,
            engine,
            counts: Counts::define(host, false),
            timers,
            pending: HashMap::new(),
            next_refresh_ms: 0,
            next_poll_ms: 0,
            next_reap_ms: 0,
            next_kv_events_ms: 0,
            next_models_ms: 0,
            models_asked: Default::default(),
            last_now_ms: 0,
            stats: telemetry::start_collector_stats(host, lease.is_none()),
            lease,
        })
    }

    /// Sets `kvroute_collector_leader` for this collector (the lease's and
    /// the singleton's hook).
    pub fn set_leader(&mut self, host: &dyn Host, leader: bool) {
        self.stats.set_leader(host, leader);
    }

    pub fn timers(&self) -> Timers {
        self.timers
    }

    /// Whether this VM runs the collector: always for the singleton; in
    /// `lease` mode, while it holds the lease.
    pub fn is_leader(&self) -> bool {
        self.lease.as_ref().is_none_or(Lease::held)
    }

    fn schedule(&self) -> Schedule {
        Schedule {
            next_refresh_ms: self.next_refresh_ms,
            next_poll_ms: self.next_poll_ms,
            next_reap_ms: self.next_reap_ms,
        }
    }

    /// `lease` mode, before the tick's work: whether this VM leads.
    fn contend(&mut self, host: &dyn Host, now: u64) -> bool {
        let mine = self.schedule();
        let Some(lease) = self.lease.as_mut() else {
            return true;
        };
        match lease.contend(host.store(), now, mine) {
            Ok((Standing::Follower, _)) => false,
            Ok((Standing::Leader, None)) => true,
            Ok((Standing::Leader, Some(s))) => {
                host.log(
                    Level::Info,
                    &format!(
                        "kvroute collector: this VM took the collector lease (id {:016x})",
                        lease.id()
                    ),
                );
                self.next_refresh_ms = s.next_refresh_ms;
                self.next_poll_ms = s.next_poll_ms;
                self.next_reap_ms = s.next_reap_ms;
                true
            }
            Err(e) => {
                self.host_error(host, "reading the collector lease", e);
                false
            }
        }
    }

    /// `lease` mode, after the tick's work: renews the lease.
    fn renew(&mut self, host: &dyn Host, now: u64) {
        let schedule = self.schedule();
        let Some(lease) = self.lease.as_mut() else {
            return;
        };
        match lease.renew(host.store(), now, schedule) {
            Ok(true) => {}
            Ok(false) => host.log(
                Level::Info,
                "kvroute collector: another VM holds the collector lease now",
            ),
            Err(e) => self.host_error(host, "renewing the collector lease", e),
        }
    }

    fn host_error(&self, host: &dyn Host, what: &str, e: impl std::fmt::Display) {
        host.log(Level::Warn, &format!("kvroute collector: {what}: {e}"));
        self.counts.inc(host, Counter::HostErrors);
    }

    /// Now in ms; a clock error is counted and `None` (the caller skips the
    /// work rather than stamp a wrong time).
    fn now_ms(&mut self, host: &dyn Host) -> Option<u64> {
        match host.now_ns() {
            Ok(ns) => {
                self.last_now_ms = ns / 1_000_000;
                Some(self.last_now_ms)
            }
            Err(e) => {
                self.host_error(host, "reading the clock", e);
                None
            }
        }
    }

    pub fn on_tick(&mut self, host: &dyn Host) {
        let Some(now) = self.now_ms(host) else {
            return;
        };
        if !self.contend(host, now) {
            self.stats.set_leader(host, false);
            return;
        }
        self.work(host, now);
        self.tokenizing
            .on_tick(host, &self.engine, &self.counts, now);
        // The workers publish how long ago this was
        // (`kvroute_collector_tick_age_ms`): a collector that stops is seen.
        if let Err(e) = collector_tick::stamp(host.store(), now) {
            self.host_error(host, "stamping the collector's tick", e);
        }
        self.renew(host, now);
        let leader = self.is_leader();
        self.stats.set_leader(host, leader);
        self.stats.on_tick(host, &self.engine, now);
    }

    fn work(&mut self, host: &dyn Host, now: u64) {
        if let (EndpointSource::FromCluster { admin_cluster, .. }, Some(refresh_ms)) =
            (&self.engine.config.endpoints, self.timers.admin_refresh_ms)
        {
            let in_flight = self.pending.values().any(|p| matches!(p, Pending::Admin));
            if now >= self.next_refresh_ms && !in_flight {
                self.next_refresh_ms = now + refresh_ms;
                let headers = [
                    (":method", "GET"),
                    (":path", "/clusters?format=json"),
                    (":authority", "envoy-admin"),
                ];
                match host.http_call(admin_cluster, &headers, self.timers.admin_timeout_ms) {
                    Ok(token) => {
                        self.pending.insert(token, Pending::Admin);
                    }
                    Err(e) => {
                        self.host_error(host, &format!("admin call to cluster {admin_cluster}"), e)
                    }
                }
            }
        }
        if now >= self.next_poll_ms {
            self.next_poll_ms = now + self.timers.metrics_poll_ms;
            self.poll_metrics(host, now);
            if let Some(every) = self.timers.models_poll_ms {
                // Every endpoint each period; a new one with the next
                // metrics round.
                let all = now >= self.next_models_ms;
                if all {
                    self.next_models_ms = now + every;
                }
                self.poll_models(host, all);
            }
        }
        if let Some(every) = self.timers.kv_events_poll_ms {
            if now >= self.next_kv_events_ms {
                self.next_kv_events_ms = now + every;
                self.poll_relays(host, now);
                self.exchange_mesh(host, now);
            }
        }
        if now >= self.next_reap_ms {
            self.next_reap_ms = now + self.timers.reap_every_ms;
            match self.engine.reap(host.store(), now) {
                Ok(0) => {}
                Ok(n) => {
                    self.counts.add(host, Counter::ReapedRequests, n);
                    host.log(Level::Warn, &format!("kvroute collector: reaped {n} orphaned in-flight charges (a request ended without releasing)"));
                }
                Err(e) => self.host_error(host, "reaping", e),
            }
        }
    }

    /// `proxy_on_queue_ready`: tokenize jobs, while this VM collects.
    pub fn on_queue_ready(&mut self, host: &dyn Host, queue: u32) {
        if !self.is_leader() {
            return;
        }
        let now = self.now_ms(host).unwrap_or(self.last_now_ms);
        self.tokenizing
            .on_queue_ready(host, &self.engine, &self.counts, queue, now);
    }

    /// The VM is going away: this VM no longer runs the collector.
    pub fn on_done(&mut self, host: &dyn Host) {
        self.stats.set_leader(host, false);
    }

    /// Stores one poll's result; a store error is logged and counted.
    fn record(
        &self,
        host: &dyn Host,
        slot: u16,
        generation: u16,
        result: Result<&[u8], ()>,
        now: u64,
    ) {
        match self
            .engine
            .record_metrics(host.store(), slot, generation, result, now)
        {
            Ok(Some(problem)) => {
                self.counts.inc(host, Counter::MetricsPollFailures);
                host.log(
                    Level::Debug,
                    &format!("kvroute collector: slot {slot}: {problem}"),
                );
            }
            Ok(None) => {}
            Err(e) => self.host_error(host, "storing metrics", e),
        }
    }

    /// A GET of `path` on one endpoint through `cluster` (the metrics
    /// cluster: `ORIGINAL_DST` by header, or `override_host` by the
    /// destination header), with the metrics timeout.
    fn endpoint_get(
        &self,
        host: &dyn Host,
        cluster: &str,
        path: &str,
        address: &str,
    ) -> HostResult<u32> {
        let headers = [
            (":method", "GET"),
            (":path", path),
            (":authority", address),
            (ORIGINAL_DST_HOST_HEADER, address),
            (
                self.engine.config.routing.destination_header.as_str(),
                address,
            ),
        ];
        host.http_call(cluster, &headers, self.timers.metrics_timeout_ms)
    }

    fn poll_metrics(&mut self, host: &dyn Host, now: u64) {
        let Some(cluster) = self.engine.config.collector.metrics_cluster.clone() else {
            return;
        };
        let table = match self.engine.endpoint_table(host.store()) {
            Ok(t) => t,
            Err(e) => return self.host_error(host, "reading endpoints", e),
        };
        let path = self.engine.config.collector.metrics_path.clone();
        for e in &table.endpoints {
            let busy = self
                .pending
                .values()
                .any(|p| matches!(p, Pending::Metrics { slot, .. } if *slot == e.slot));
            if busy {
                continue;
            }
            match self.endpoint_get(host, &cluster, &path, &e.address) {
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
                    self.counts.inc(host, Counter::MetricsPollFailures);
                    host.log(
                        Level::Warn,
                        &format!("kvroute collector: /metrics call for {}: {err}", e.address),
                    );
                    self.record(host, e.slot, e.generation, Err(()), now);
                }
            }
        }
    }

    /// Asks endpoints for their model list (`/v1/models`): all of them
    /// (`all`), or those not asked yet in their current generation.
    fn poll_models(&mut self, host: &dyn Host, all: bool) {
        let Some(cluster) = self.engine.config.collector.metrics_cluster.clone() else {
            return;
        };
        let table = match self.engine.endpoint_table(host.store()) {
            Ok(t) => t,
            Err(e) => return self.host_error(host, "reading endpoints", e),
        };
        // Forget endpoints that left, so the set stays within the table.
        let current: std::collections::HashSet<(u16, u16)> = table
            .endpoints
            .iter()
            .map(|e| (e.slot, e.generation))
            .collect();
        self.models_asked.retain(|k| current.contains(k));
        let path = self.engine.config.collector.models_path.clone();
        for e in &table.endpoints {
            let id = (e.slot, e.generation);
            if !all && self.models_asked.contains(&id) {
                continue;
            }
            let busy = self
                .pending
                .values()
                .any(|p| matches!(p, Pending::Models { slot, .. } if *slot == e.slot));
            if busy {
                continue;
            }
            self.models_asked.insert(id);
            match self.endpoint_get(host, &cluster, &path, &e.address) {
                Ok(token) => {
                    self.pending.insert(
                        token,
                        Pending::Models {
                            slot: e.slot,
                            generation: e.generation,
                        },
                    );
                }
                Err(err) => {
                    self.counts.inc(host, Counter::ModelsPollFailures);
                    host.log(
                        Level::Debug,
                        &format!("kvroute collector: {path} call for {}: {err}", e.address),
                    );
                }
            }
        }
    }

    /// One round of relay calls: one per endpoint with none in flight.
    fn poll_relays(&mut self, host: &dyn Host, now: u64) {
        let table = match self.engine.endpoint_table(host.store()) {
            Ok(t) => t,
            Err(e) => return self.host_error(host, "reading endpoints", e),
        };
        let held = match HeldTable::read(host.store()) {
            Ok(t) => t,
            Err(e) => return self.host_error(host, "reading held blocks", e),
        };
        for e in &table.endpoints {
            let busy = self
                .pending
                .values()
                .any(|p| matches!(p, Pending::Relay { slot, .. } if *slot == e.slot));
            if busy {
                continue;
            }
            let view = held.get(e.slot, e.generation);
            self.call_relay(
                host,
                e.slot,
                e.generation,
                &e.address,
                next_ask(view),
                view,
                now,
            );
        }
    }

    /// Dispatches one relay call; a failure to dispatch is a failed poll.
    #[allow(clippy::too_many_arguments)]
    fn call_relay(
        &mut self,
        host: &dyn Host,
        slot: u16,
        generation: u16,
        address: &str,
        ask: Ask,
        view: Option<&kvroute_shared_state::held::EndpointHeld>,
        now: u64,
    ) {
        let kv = &self.engine.config.kv_events;
        let Some(relay) = kv.relay_for(address) else {
            host.log(
                Level::Warn,
                &format!(
                    "kvroute collector: endpoint {address} has no port; no KV-event relay for it"
                ),
            );
            return self.relay_failed(host, slot, generation, now);
        };
        let path = ask_path(ask, view, kv.max_hashes_per_poll);
        let failures = view.map_or(0, |v| v.failures);
        let headers = [
            (":method", "GET"),
            (":path", path.as_str()),
            (":authority", relay.as_str()),
            (RELAY_HOST_HEADER, relay.as_str()),
        ];
        self.counts.inc(host, Counter::KvEventsPolls);
        match host.http_call(&kv.cluster, &headers, self.timers.kv_events_timeout_ms) {
            Ok(token) => {
                self.pending.insert(
                    token,
                    Pending::Relay {
                        slot,
                        generation,
                        ask,
                        relay,
                        failures,
                    },
                );
            }
            Err(err) => {
                host.log(
                    first_of_run(failures),
                    &format!(
                        "kvroute collector: relay call to {relay} (cluster {}): {err}",
                        kv.cluster
                    ),
                );
                self.relay_failed(host, slot, generation, now);
            }
        }
    }

    /// One round of mesh posts (`mesh_link`): the outbox is shared out per
    /// endpoint, then one post to each endpoint's relay with none in flight.
    fn exchange_mesh(&mut self, host: &dyn Host, _now: u64) {
        let Some(link) = self.mesh.as_mut() else {
            return;
        };
        let own = match link.take_outbox(host, &self.engine, &self.counts) {
            Ok(own) => own,
            Err(e) => return self.host_error(host, "mesh exchange", e),
        };
        let table = match self.engine.endpoint_table(host.store()) {
            Ok(t) => t,
            Err(e) => return self.host_error(host, "reading endpoints", e),
        };
        let kv = &self.engine.config.kv_events;
        // The others count this proxy's load for three rounds.
        let ttl_ms = kv.poll_ms.saturating_mul(3);
        for e in table.endpoints.iter().filter(|e| e.healthy) {
            let busy = self
                .pending
                .values()
                .any(|p| matches!(p, Pending::Mesh { slot, .. } if *slot == e.slot));
            if busy {
                continue;
            }
            let Some(relay) = kv.relay_for(&e.address) else {
                continue;
            };
            let post = link.post_for(
                e.slot,
                e.generation,
                own.get(&(e.slot, e.generation)).copied(),
                ttl_ms,
            );
            let headers = [
                (":method", "POST"),
                (":path", "/mesh/exchange"),
                (":authority", relay.as_str()),
                ("content-type", "application/json"),
                (RELAY_HOST_HEADER, relay.as_str()),
            ];
            match host.http_post(
                &kv.cluster,
                &headers,
                &post.body,
                self.timers.kv_events_timeout_ms,
            ) {
                Ok(token) => {
                    self.counts
                        .add(host, Counter::MeshDecisionsSent, post.decisions);
                    self.pending.insert(
                        token,
                        Pending::Mesh {
                            slot: e.slot,
                            generation: e.generation,
                            relay,
                            decisions: post.decisions,
                        },
                    );
                }
                Err(err) => {
                    self.counts.inc(host, Counter::MeshExchangeFailures);
                    self.counts
                        .add(host, Counter::MeshDecisionsDropped, post.decisions);
                    host.log(
                        first_of_run(self.mesh_failures),
                        &format!("kvroute collector: mesh post to {relay}: {err}"),
                    );
                    self.mesh_failures = self.mesh_failures.saturating_add(1);
                }
            }
        }
    }

    fn relay_failed(&self, host: &dyn Host, slot: u16, generation: u16, now: u64) {
        // (Logged by the caller, at Warn only for the first of a run.)
        self.counts.inc(host, Counter::KvEventsPollFailures);
        if let Err(e) = self
            .engine
            .record_relay_failure(host.store(), slot, generation, now)
        {
            self.host_error(host, "storing a relay failure", e);
        }
    }

    /// A relay's answer: applied, then any follow-up call (the snapshot
    /// after a resync, the next page) is made at once.
    #[allow(clippy::too_many_arguments)]
    fn on_relay_answer(
        &mut self,
        host: &dyn Host,
        slot: u16,
        generation: u16,
        ask: Ask,
        relay: &str,
        failures: u32,
        status: Option<&str>,
        body: Option<Vec<u8>>,
        now: u64,
    ) {
        let Some(body) = body else {
            host.log(
                first_of_run(failures),
                &format!(
                    "kvroute collector: relay {relay} answered {}",
                    status.unwrap_or("nothing (timeout or reset)")
                ),
            );
            return self.relay_failed(host, slot, generation, now);
        };
        let applied =
            match self
                .engine
                .apply_relay_answer(host.store(), slot, generation, ask, &body, now)
            {
                Ok(a) => a,
                Err(crate::engine::ApplyError::Garbage(m)) => {
                    self.counts.inc(host, Counter::KvEventsBadAnswers);
                    host.log(
                        first_of_run(failures),
                        &format!("kvroute collector: relay {relay}: {m}"),
                    );
                    return self.relay_failed(host, slot, generation, now);
                }
                Err(crate::engine::ApplyError::Store(e)) => {
                    return self.host_error(host, "storing held blocks", e)
                }
            };
        if applied.resync {
            self.counts.inc(host, Counter::KvEventsResyncs);
            host.log(
                Level::Info,
                &format!(
                    "kvroute collector: relay {relay} asks for a resync; reloading its snapshot"
                ),
            );
        }
        if applied.snapshot {
            self.counts.inc(host, Counter::KvEventsSnapshots);
        }
        if applied.index_reset {
            self.counts.inc(host, Counter::KvEventsIndexResets);
            host.log(
                Level::Info,
                &format!("kvroute collector: relay {relay}: the server lost its cache; its approximate index entries are aged out"),
            );
        }
        self.counts
            .add(host, Counter::KvEventsDropped, applied.dropped);
        if let Some(next) = applied.follow_up {
            let held = match HeldTable::read(host.store()) {
                Ok(t) => t,
                Err(e) => return self.host_error(host, "reading held blocks", e),
            };
            let address = match self.engine.endpoint_table(host.store()) {
                Ok(t) => t
                    .endpoints
                    .into_iter()
                    .find(|e| e.slot == slot && e.generation == generation)
                    .map(|e| e.address),
                Err(e) => return self.host_error(host, "reading endpoints", e),
            };
            if let Some(address) = address {
                let view = held.get(slot, generation).copied();
                self.call_relay(host, slot, generation, &address, next, view.as_ref(), now);
            }
        }
    }

    pub fn on_http_call_response(
        &mut self,
        host: &dyn Host,
        token: u32,
        num_headers: usize,
        body_size: usize,
    ) {
        if self.tokenizing.owns_call(token) {
            let now = self.now_ms(host).unwrap_or(self.last_now_ms);
            self.tokenizing.on_http_call_response(
                host,
                &self.engine,
                &self.counts,
                token,
                num_headers,
                body_size,
                now,
            );
            return;
        }
        let Some(kind) = self.pending.remove(&token) else {
            return;
        };
        let now = self.now_ms(host).unwrap_or(self.last_now_ms);
        let status = if num_headers == 0 {
            None
        } else {
            host.http_call_status().unwrap_or_else(|e| {
                self.host_error(host, "reading a call's :status", e);
                None
            })
        };
        let body = if status.as_deref() == Some("200") {
            host.http_call_body(body_size).unwrap_or_else(|e| {
                self.host_error(host, "reading a call's body", e);
                None
            })
        } else {
            None
        };
        match kind {
            Pending::Admin => match body {
                Some(b) => {
                    if let Err(e) = self.engine.apply_admin_clusters(host.store(), &b) {
                        host.log(Level::Warn, &format!("kvroute collector: {e}"));
                    }
                }
                None => host.log(
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
                    self.counts.inc(host, Counter::MetricsPollFailures);
                }
                self.record(host, slot, generation, result, now);
            }
            Pending::Models { slot, generation } => {
                let result = match body.as_deref() {
                    Some(b) => self
                        .engine
                        .record_model_list(host.store(), slot, generation, b),
                    None => Err(format!(
                        "answered {}",
                        status.as_deref().unwrap_or("nothing (timeout or reset)")
                    )),
                };
                if let Err(e) = result {
                    self.counts.inc(host, Counter::ModelsPollFailures);
                    host.log(
                        Level::Debug,
                        &format!("kvroute collector: slot {slot}: model list: {e}"),
                    );
                }
            }
            Pending::Relay {
                slot,
                generation,
                ask,
                relay,
                failures,
            } => self.on_relay_answer(
                host,
                slot,
                generation,
                ask,
                &relay,
                failures,
                status.as_deref(),
                body,
                now,
            ),
            Pending::Mesh {
                slot,
                generation,
                relay,
                decisions,
            } => {
                let Some(link) = self.mesh.as_mut() else {
                    return;
                };
                match body {
                    Some(b) => {
                        self.mesh_failures = 0;
                        link.on_answer(
                            host,
                            &self.engine,
                            &self.counts,
                            slot,
                            generation,
                            &relay,
                            &b,
                            now,
                        )
                    }
                    None => {
                        self.counts.inc(host, Counter::MeshExchangeFailures);
                        self.counts
                            .add(host, Counter::MeshDecisionsDropped, decisions);
                        host.log(
                            first_of_run(self.mesh_failures),
                            &format!(
                                "kvroute collector: mesh exchange with {relay} answered {}",
                                status.as_deref().unwrap_or("nothing (timeout or reset)")
                            ),
                        );
                        self.mesh_failures = self.mesh_failures.saturating_add(1);
                    }
                }
            }
        }
    }
}

/// A relay that stays down is logged once as a warning, then at debug
/// level on every poll until it answers again (the counters count them all).
fn first_of_run(failures: u32) -> Level {
    if failures == 0 {
        Level::Warn
    } else {
        Level::Debug
    }
}

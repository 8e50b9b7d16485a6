//! Envoy stats beyond the counters: two histograms the filter VMs sample,
//! the gauges the collector sets, and the collector-leader gauge. Envoy
//! shows each as `wasmcustom.<name>` in `/stats` and, in
//! `/stats/prometheus`, as `<name>` (the `wasmcustom` namespace is stripped
//! and no `envoy_` prefix is added). `docs/observability.md` lists them.
//!
//! **Cost on the request path.** None of this adds a host call to a routed
//! request, except one clock read on the 1 request in
//! [`DECISION_SAMPLE_EVERY`] whose decision time is measured. Samples go
//! to a bounded in-VM reservoir ([`SAMPLES_PER_FLUSH`] per histogram) and
//! reach Envoy on the filter's 200 ms tick, one `proxy_record_metric` per
//! sample, like the batched [`super::Counts`].
//!
//! **Bounded cardinality.** Per-endpoint gauges are tagged by endpoint
//! *slot*, not address: `kvroute_endpoint_inflight_tokens.slot.3`. Slots
//! are reused lowest-free and bounded by the endpoint table
//! ([`kvroute_shared_state::MAX_ENDPOINTS`]), so a fleet that churns through
//! many addresses still defines at most (peak fleet size × 4) stats. The
//! slot's address is in the state (`routing.statePath`). Envoy turns
//! `.slot.<n>` into a Prometheus label `slot="<n>"` when the bootstrap has
//! the `stats_tags` rule `envoy/render.py` adds ([`SLOT_TAG_REGEX`]);
//! without it the name reads `kvroute_endpoint_inflight_tokens_slot_3`.

use super::{Host, Level};
use crate::engine::{Engine, Outcome};
use kvroute_shared_state::collector_tick;
use kvroute_shared_state::held::{HeldTable, HELD_KEY};
use kvroute_shared_state::index::{self, ENTRY_BYTES};
use kvroute_shared_state::load::LoadTable;
use kvroute_shared_state::metrics::MetricsTable;
use kvroute_shared_state::{LOAD_KEY, MAX_ENDPOINTS, METRICS_KEY};
use std::cell::{Cell, RefCell};

/// A filter VM times 1 routable request in this many (its 16th, 32nd, …):
/// each timed request costs one more clock read (a VM exit).
pub const DECISION_SAMPLE_EVERY: u32 = 16;
/// Samples each histogram keeps between two flushes: a uniform reservoir
/// over the requests of that 200 ms, so a flush is at most this many
/// `proxy_record_metric` calls per histogram (≤ 2 × 64 × 5 = 640 host calls
/// a second per worker, off the request path).
pub const SAMPLES_PER_FLUSH: usize = 64;
/// How often the collector refreshes its gauges, ms.
pub const GAUGE_PERIOD_MS: u64 = 1_000;
/// Index shards the collector reads per [`GAUGE_PERIOD_MS`] to estimate
/// occupancy (4 KiB each: 2 MiB a second of shared-data copies on the main
/// thread). The default 64 MiB budget (16,384 shards) is swept in 32 s.
pub const INDEX_SHARDS_PER_PERIOD: u32 = 512;

/// The `stats_tags` regex (Envoy bootstrap `stats_config`) that makes the
/// slot a Prometheus label, tag name [`SLOT_TAG_NAME`]. The first group is
/// cut from the name, the second is the value.
pub const SLOT_TAG_REGEX: &str = r"^wasmcustom\.kvroute_endpoint_[a-z_]+(\.slot\.([0-9]+))$";
pub const SLOT_TAG_NAME: &str = "slot";

/// The histograms filter VMs record.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Histogram {
    /// `Engine::route` wall time (parse, hash, state read, schedule, charge,
    /// index insert), µs, on sampled requests, whatever the outcome.
    DecisionTimeUs,
    /// The chosen endpoint's affinity (share of the prompt's blocks it
    /// holds, from the prefix index), in percent 0..=100; every routed
    /// request (reservoir-sampled per flush).
    AffinityPercent,
}

impl Histogram {
    pub const ALL: [Histogram; 2] = [Histogram::DecisionTimeUs, Histogram::AffinityPercent];

    pub fn name(self) -> &'static str {
        match self {
            Histogram::DecisionTimeUs => "kvroute_decision_time_us",
            Histogram::AffinityPercent => "kvroute_affinity_percent",
        }
    }
}

#[derive(Default)]
struct Reservoir {
    values: Vec<u64>,
    /// Samples offered since the last flush.
    seen: u64,
}

/// A filter VM's histogram samples, handed to Envoy on its tick.
pub struct Samples {
    /// Histogram ids, defined at the first flush (`None` inside: not defined).
    ids: RefCell<Option<Vec<Option<u32>>>>,
    reservoirs: RefCell<[Reservoir; 2]>,
    /// Routable requests seen, for the 1-in-N decision timing.
    requests: Cell<u32>,
    /// xorshift64 state for the reservoir: its own, so routing's seeded
    /// randomness is untouched.
    rng: Cell<u64>,
}

impl Samples {
    pub fn new(seed: u64) -> Samples {
        Samples {
            ids: RefCell::new(None),
            reservoirs: RefCell::default(),
            requests: Cell::new(0),
            rng: Cell::new(seed | 1),
        }
    }

    /// Once per routable request, before `Engine::route`: whether to time
    /// this decision (1 in [`DECISION_SAMPLE_EVERY`]).
    pub fn time_decision(&self) -> bool {
        let n = self.requests.get().wrapping_add(1);
        self.requests.set(n);
        n.is_multiple_of(DECISION_SAMPLE_EVERY)
    }

    /// After `Engine::route`: the decision time (when `started_ns` is set,
    /// one clock read) and the routed endpoint's affinity.
    pub fn on_decision(&self, host: &dyn Host, started_ns: Option<u64>, outcome: &Outcome) {
        if let Some(start) = started_ns {
            match host.now_ns() {
                Ok(end) => self.add(Histogram::DecisionTimeUs, end.saturating_sub(start) / 1_000),
                Err(e) => host.log(
                    Level::Debug,
                    &format!("kvroute: decision time not sampled: {e}"),
                ),
            }
        }
        if let Outcome::Routed(r) = outcome {
            if let Some(c) = r.decision.report.get(r.decision.primary) {
                // affinity ∈ [0, 1] → percent; NaN casts to 0.
                let pct = (c.affinity * 100.0).round().clamp(0.0, 100.0) as u64;
                self.add(Histogram::AffinityPercent, pct);
            }
        }
    }

    fn next_random(&self) -> u64 {
        let mut x = self.rng.get();
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.rng.set(x);
        x
    }

    /// Offers a sample (reservoir sampling, algorithm R).
    pub fn add(&self, h: Histogram, value: u64) {
        let mut rs = self.reservoirs.borrow_mut();
        let r = &mut rs[h as usize];
        r.seen += 1;
        if r.values.len() < SAMPLES_PER_FLUSH {
            r.values.push(value);
        } else {
            let j = self.next_random() % r.seen;
            if let Some(v) = r.values.get_mut(j as usize) {
                *v = value;
            }
        }
    }

    /// Samples waiting for the next flush, per histogram (tests).
    pub fn pending(&self, h: Histogram) -> usize {
        self.reservoirs.borrow()[h as usize].values.len()
    }

    /// The tick: defines the histograms (first time), records the samples.
    pub fn flush(&self, host: &dyn Host) {
        let mut ids = self.ids.borrow_mut();
        let ids = ids.get_or_insert_with(|| {
            Histogram::ALL
                .iter()
                .map(|h| match host.define_histogram(h.name()) {
                    Ok(id) => Some(id),
                    Err(e) => {
                        host.log(
                            Level::Warn,
                            &format!("kvroute: histogram {} not defined: {e}", h.name()),
                        );
                        None
                    }
                })
                .collect()
        });
        let mut rs = self.reservoirs.borrow_mut();
        for (h, r) in Histogram::ALL.iter().zip(rs.iter_mut()) {
            r.seen = 0;
            let values = std::mem::take(&mut r.values);
            let Some(Some(id)) = ids.get(*h as usize) else {
                continue;
            };
            for v in values {
                if let Err(e) = host.record_metric(*id, v) {
                    host.log(
                        Level::Debug,
                        &format!("kvroute: histogram {} sample dropped: {e}", h.name()),
                    );
                }
            }
        }
    }
}

/// One gauge, set only when its value changes.
#[derive(Default)]
struct Gauge {
    id: Option<u32>,
    last: Option<u64>,
}

impl Gauge {
    fn define(host: &dyn Host, name: &str) -> Gauge {
        match host.define_gauge(name) {
            Ok(id) => Gauge {
                id: Some(id),
                last: None,
            },
            Err(e) => {
                host.log(
                    Level::Warn,
                    &format!("kvroute collector: gauge {name} not defined: {e}"),
                );
                Gauge::default()
            }
        }
    }

    fn set(&mut self, host: &dyn Host, value: u64) {
        let Some(id) = self.id else { return };
        if self.last == Some(value) {
            return;
        }
        match host.record_metric(id, value) {
            Ok(()) => self.last = Some(value),
            Err(e) => host.log(
                Level::Debug,
                &format!("kvroute collector: gauge {id} not set: {e}"),
            ),
        }
    }
}

/// The per-slot gauges, in this order.
pub const SLOT_GAUGES: [&str; 4] = [
    // Σ in-flight (uncached prompt + expected output) tokens charged, tokens.
    "kvroute_endpoint_inflight_tokens",
    // In-flight requests charged.
    "kvroute_endpoint_inflight_requests",
    // now − last successful /metrics poll, ms (since the collector started
    // when no poll ever succeeded; 0 for a free slot).
    "kvroute_endpoint_metrics_age_ms",
    // The collector's online prefill-throughput estimate
    // (learners::prefill_rate), tokens/s, rounded; 0 until one exists.
    "kvroute_endpoint_prefill_tokens_per_s",
];

/// The collector-wide gauges, in this order.
pub const GLOBAL_GAUGES: [&str; 6] = [
    // Endpoints in the table.
    "kvroute_endpoints",
    // Endpoints whose metrics are older than collector.metricsStaleAfterMs
    // (or never came): routed on load alone.
    "kvroute_endpoints_stale_metrics",
    // Index entries in use × 16 B, bytes, over the last full sweep.
    "kvroute_index_used_bytes",
    // The index's size, shards × 4 KiB, bytes (sharedState.indexBudgetBytes
    // rounded down to whole shards).
    "kvroute_index_budget_bytes",
    // kvEvents: block hashes held in the endpoints' views, summed.
    "kvroute_kv_events_held_blocks",
    // kvEvents: endpoints whose view had no good relay poll within
    // kvEvents.staleMs (routed on the approximate index).
    "kvroute_kv_events_stale_endpoints",
];

/// The Envoy stat name of slot gauge `base` for `slot`.
pub fn slot_stat_name(base: &str, slot: u16) -> String {
    format!("{base}.slot.{slot}")
}

/// The collector's gauges.
pub struct CollectorStats {
    global: Vec<Gauge>,
    /// By slot, defined the first time the slot is used.
    slots: Vec<Option<[Gauge; 4]>>,
    /// Used entries per index shard, as last read.
    shard_used: Vec<u16>,
    next_shard: u32,
    next_ms: u64,
    started_ms: Option<u64>,
    /// `kvroute_collector_leader`, as this collector last set it.
    leader: LeaderGauge,
}

impl CollectorStats {
    pub fn define(host: &dyn Host) -> CollectorStats {
        CollectorStats {
            global: GLOBAL_GAUGES
                .iter()
                .map(|n| Gauge::define(host, n))
                .collect(),
            slots: Vec::new(),
            shard_used: Vec::new(),
            next_shard: 0,
            next_ms: 0,
            started_ms: None,
            leader: LeaderGauge::default(),
        }
    }

    /// Sets `kvroute_collector_leader` for this collector ([`LeaderGauge::set`]).
    pub fn set_leader(&mut self, host: &dyn Host, leader: bool) {
        self.leader.set(host, leader);
    }

    /// The collector's tick: every [`GAUGE_PERIOD_MS`], reads the endpoint,
    /// load and metrics tables (3 gets) and [`INDEX_SHARDS_PER_PERIOD`]
    /// index shards, and sets the gauges that changed.
    pub fn on_tick(&mut self, host: &dyn Host, engine: &Engine, now_ms: u64) {
        let started = *self.started_ms.get_or_insert(now_ms);
        if now_ms < self.next_ms {
            return;
        }
        self.next_ms = now_ms + GAUGE_PERIOD_MS;
        self.leader.refresh(host);
        let store = host.store();
        let table = match engine.endpoint_table(store) {
            Ok(t) => t,
            Err(e) => {
                return host.log(
                    Level::Debug,
                    &format!("kvroute collector: gauges not updated: {e}"),
                )
            }
        };
        let get = |key: &str| match store.get(key) {
            Ok(v) => v.map(|(b, _)| b),
            Err(e) => {
                host.log(
                    Level::Debug,
                    &format!("kvroute collector: gauges: reading {key}: {e}"),
                );
                None
            }
        };
        let load = LoadTable::decode(get(LOAD_KEY).as_deref());
        let metrics = MetricsTable::decode(get(METRICS_KEY).as_deref());
        let stale_after = engine.config.collector.metrics_stale_after_ms;
        let mut seen = vec![false; self.slots.len()];
        let mut stale = 0u64;
        for e in &table.endpoints {
            let s = usize::from(e.slot);
            if s >= MAX_ENDPOINTS {
                continue;
            }
            if self.slots.len() <= s {
                self.slots.resize_with(s + 1, || None);
                seen.resize(s + 1, false);
            }
            seen[s] = true;
            let rec = load.get(e.slot, e.generation);
            let m = metrics.get(e.slot, e.generation);
            let fresh = m.is_some_and(|m| m.is_fresh(now_ms, stale_after));
            if !fresh {
                stale += 1;
            }
            let ok_at = m.map_or(0, |m| m.ok_at_ms);
            let age = now_ms.saturating_sub(if ok_at == 0 { started } else { ok_at });
            let g = self.slots[s].get_or_insert_with(|| {
                SLOT_GAUGES.map(|base| Gauge::define(host, &slot_stat_name(base, e.slot)))
            });
            g[0].set(host, rec.map_or(0, |r| r.inflight_tokens()));
            g[1].set(host, rec.map_or(0, |r| r.inflight_requests()));
            g[2].set(host, age);
            let rate = m.and_then(|m| m.prefill.estimate()).unwrap_or(0.0);
            g[3].set(host, rate.round() as u64);
        }
        // A slot whose endpoint left reads 0.
        for (s, g) in self.slots.iter_mut().enumerate() {
            if let (Some(g), false) = (g, seen.get(s).copied().unwrap_or(false)) {
                g.iter_mut().for_each(|g| g.set(host, 0));
            }
        }
        self.global[0].set(host, table.endpoints.len() as u64);
        self.global[1].set(host, stale);
        if engine.config.kv_events.enabled {
            let held = HeldTable::decode(get(HELD_KEY).as_deref());
            let stale_ms = engine.config.kv_events.stale_ms;
            let (mut blocks, mut stale) = (0u64, 0u64);
            for e in &table.endpoints {
                match held.get(e.slot, e.generation) {
                    Some(v) if v.is_fresh(now_ms, stale_ms) => blocks += u64::from(v.blocks),
                    Some(v) => {
                        blocks += u64::from(v.blocks);
                        stale += 1;
                    }
                    None => stale += 1,
                }
            }
            self.global[4].set(host, blocks);
            self.global[5].set(host, stale);
        }
        self.scan_index(host, engine);
    }

    /// Reads the next [`INDEX_SHARDS_PER_PERIOD`] shards (round robin) and
    /// sets the occupancy gauges from every shard's last count.
    fn scan_index(&mut self, host: &dyn Host, engine: &Engine) {
        let geometry = engine.geometry();
        let shards = geometry.shards;
        self.shard_used.resize(shards as usize, 0);
        for _ in 0..INDEX_SHARDS_PER_PERIOD.min(shards) {
            let n = self.next_shard % shards;
            self.next_shard = (n + 1) % shards;
            match host.store().get(&index::shard_key_of(n)) {
                Ok(v) => {
                    let used = v.map_or(0, |(b, _)| index::used_entries(&b));
                    self.shard_used[n as usize] = used.min(u32::from(u16::MAX)) as u16;
                }
                Err(e) => host.log(
                    Level::Debug,
                    &format!("kvroute collector: reading index shard {n}: {e}"),
                ),
            }
        }
        let used: u64 = self.shard_used.iter().map(|&u| u64::from(u)).sum();
        self.global[2].set(host, used * ENTRY_BYTES as u64);
        self.global[3].set(host, geometry.max_bytes());
    }
}

/// The collector's gauges; `leader`: this VM collects from the start (the
/// singleton). A lease contender becomes the leader on its first won round.
pub fn start_collector_stats(host: &dyn Host, leader: bool) -> CollectorStats {
    let mut stats = CollectorStats::define(host);
    if leader {
        stats.set_leader(host, true);
    }
    stats
}

/// `kvroute_collector_leader`: 1 while a VM of this Envoy runs the
/// collector, else 0. Envoy gauges are process-wide (one per name, whatever
/// the VM), so the gauge is *set*, not added to: Envoy runs a configuration
/// "canary" (a throw-away clone of the VM that is configured and deleted
/// without `proxy_on_done`), so a VM that added its 1 could leave the gauge
/// at 2. The leader sets it again every [`GAUGE_PERIOD_MS`], so after a
/// hand-over (the old leader's 0 landing after the new one's 1) it is right
/// again within a second.
pub const LEADER_GAUGE: &str = "kvroute_collector_leader";

/// This collector's standing as last written to [`LEADER_GAUGE`], and the
/// gauge's id once defined. Per collector (per root context): in lease mode
/// each root of a VM contends on its own.
#[derive(Debug, Default)]
pub struct LeaderGauge {
    id: Option<u32>,
    leader: bool,
}

impl LeaderGauge {
    fn record(&mut self, host: &dyn Host, leader: bool) -> bool {
        let id = match self.id {
            Some(id) => id,
            None => match host.define_gauge(LEADER_GAUGE) {
                Ok(id) => id,
                Err(e) => {
                    host.log(
                        Level::Warn,
                        &format!("kvroute: gauge {LEADER_GAUGE} not defined: {e}"),
                    );
                    return false;
                }
            },
        };
        self.id = Some(id);
        match host.record_metric(id, u64::from(leader)) {
            Ok(()) => true,
            Err(e) => {
                host.log(
                    Level::Warn,
                    &format!("kvroute: gauge {LEADER_GAUGE} not set: {e}"),
                );
                false
            }
        }
    }

    /// The hook for whatever decides that this collector runs: the
    /// singleton's start and end, a lease's acquire and loss. Sets
    /// [`LEADER_GAUGE`] when the standing changes; a call that changes
    /// nothing makes no host call, so it can be called on every tick. A
    /// refused update is tried again on the next call.
    pub fn set(&mut self, host: &dyn Host, leader: bool) {
        if self.leader != leader && self.record(host, leader) {
            self.leader = leader;
        }
    }

    /// Sets [`LEADER_GAUGE`] to 1 again if this collector runs (the
    /// collector's gauge period), over a late 0 from another VM.
    pub fn refresh(&mut self, host: &dyn Host) {
        if self.leader {
            self.record(host, true);
        }
    }
}

/// `kvroute_collector_tick_age_ms`: how long ago the collector last ran its
/// tick, ms, as a filter worker VM sees it (now − the stamp the collector
/// writes to shared data on each tick, [`collector_tick`]; before any stamp,
/// now − the worker's first look). A collector that runs keeps it under its
/// tick period plus [`GAUGE_PERIOD_MS`]; a dead singleton VM or an
/// unrenewed lease makes it grow without bound, and the endpoint table and
/// metrics stop changing. Set by the workers, not the collector, so that it
/// grows when the collector is gone. Every worker sets the same gauge each
/// [`GAUGE_PERIOD_MS`] (Envoy gauges are process-wide); their values differ
/// by at most that period.
pub const TICK_AGE_GAUGE: &str = "kvroute_collector_tick_age_ms";

/// A worker's [`TICK_AGE_GAUGE`].
#[derive(Default)]
pub struct TickAge {
    gauge: Option<Gauge>,
    started_ms: Option<u64>,
    next_ms: u64,
}

impl TickAge {
    /// The worker's tick: every [`GAUGE_PERIOD_MS`], one shared-data get
    /// and, if the age changed, one gauge set. A read error leaves the
    /// gauge as it was (logged at debug level).
    pub fn on_tick(&mut self, host: &dyn Host, now_ms: u64) {
        let started = *self.started_ms.get_or_insert(now_ms);
        if now_ms < self.next_ms {
            return;
        }
        self.next_ms = now_ms + GAUGE_PERIOD_MS;
        let last = match collector_tick::last(host.store()) {
            Ok(last) => last,
            Err(e) => {
                return host.log(
                    Level::Debug,
                    &format!("kvroute: {TICK_AGE_GAUGE} not updated: {e}"),
                )
            }
        };
        let age = now_ms.saturating_sub(last.unwrap_or(started));
        self.gauge
            .get_or_insert_with(|| Gauge::define(host, TICK_AGE_GAUGE))
            .set(host, age);
    }
}

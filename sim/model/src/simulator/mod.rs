//! The fleet simulator: N modelled vLLM servers ([`crate::vllm_model`], the
//! emulator's own model) behind the filter's own routing code, in virtual
//! time (discrete events, no sockets, no sleeps).
//!
//! - **Servers.** Each is a [`crate::vllm_model::Engine`]. An iteration starts
//!   when the server has work and is idle (`step(now)`), and its outputs are
//!   delivered at `now + duration`, exactly as the emulator's loop does in
//!   scaled real time.
//! - **Router.** `kvroute_core::engine::Engine` over the in-memory `Store`
//!   (`kvroute_shared_state::memory::MemoryStore`): the same parse, hashing,
//!   snapshot, scheduler, charge, prefix-index insert and releases (prompt at
//!   the first token, the rest at the end) as the filter in Envoy. The
//!   round-robin arm is Envoy's own balancer, so it is modelled as a
//!   rotation, without kvroute.
//! - **Collector.** Every `metricsPollIntervalMs` each server's `/metrics`
//!   page is rendered by the emulator's renderer from the server's state and
//!   handed to `Engine::record_metrics`, the collector's parser and writer;
//!   charges are reaped as the collector does.
//! - **Clocks.** The servers run in model seconds. The router and collector
//!   see `now_ms` as Envoy would next to an emulator run at
//!   `time_scale` (model seconds per wall second): `time_scale` 10 makes a
//!   1000 ms poll interval 10 model seconds. Use 1 for real hardware.
//! - **Load.** The load generator's stages (Poisson rate or closed-loop
//!   concurrency, each drained before the next) or a trace; the reports are
//!   the load generator's [`StageReport`]s, built by the same function.
//! - **Files.** `mod.rs` the event loop (segment prompts: `workload::prompt`),
//!   `trace.rs` the JSONL trace, `arms.rs` `quality.py`'s router arms,
//!   `sweep.rs`, `plot.rs` (SVG), `whatif.rs` (the what-if analysis).

pub mod arms;
pub mod flags;
pub mod plot;
pub mod sweep;
pub mod trace;
pub mod whatif;

pub use flags::{fleet_from_flags, FLEET_FLAGS, FLEET_USAGE};

use crate::vllm_hash::VllmBlockHasher;
use crate::vllm_model::{Engine as Server, EngineConfig, RequestId, StepResult};
use crate::vllm_server::metrics_text::{render_parts, Snapshot};
use crate::vllm_server::openai::engine_request;
use crate::vllm_server::EmulatorConfig;
use crate::workload::ceiling::Ceiling;
use crate::workload::prompt::{from_pieces, parts_pieces, RouterInput, SimRequest};
use crate::workload::report::{stage_report, EndpointCounters, RequestRecord, StageReport};
use crate::workload::stages::{Stage, StageKind};
use crate::workload::{GenParts, Workload, WorkloadSpec};
use kvroute_core::config::{Config, EndpointSource};
use kvroute_core::engine::{Engine as Router, Outcome, OwnLoad, PeerDecision, RequestFacts};
use kvroute_core::lifecycle::Counter;
use kvroute_core::request::{parse_request, ApiKind, ParseLimits};
use kvroute_core::scheduling::Rng;
use kvroute_shared_state::load::{LoadTable, PeerLoad, Ticket};
use kvroute_shared_state::memory::MemoryStore;
use kvroute_shared_state::mesh::Accepted;
use kvroute_shared_state::Store;
use serde::Serialize;
use std::cmp::Ordering;
use std::collections::{BTreeMap, BinaryHeap, HashMap};
use std::time::Instant;

/// How requests are routed.
#[derive(Clone, Debug)]
pub enum RouterSpec {
    /// Envoy's round robin, without kvroute.
    RoundRobin,
    /// kvroute with this plugin configuration document.
    Kvroute(Box<Config>),
}

/// The modelled fleet.
#[derive(Clone, Debug)]
pub struct FleetSpec {
    pub endpoints: usize,
    pub engine: EngineConfig,
    /// Served model name (the `/metrics` label and the requests' `model`).
    pub model: String,
    /// Bytes per token of text prompts (the emulator's `--chars-per-token`).
    pub chars_per_token: u32,
    /// Output tokens per streamed chunk (`--stream-interval`); TTFT and TPOT
    /// are measured on chunks, as the load generator does.
    pub stream_interval: u32,
}

impl Default for FleetSpec {
    fn default() -> Self {
        FleetSpec {
            endpoints: 4,
            engine: EngineConfig::default(),
            model: "tiny".into(),
            chars_per_token: 4,
            stream_interval: 1,
        }
    }
}

/// Where requests come from.
#[derive(Clone, Debug)]
pub enum Load {
    /// A named workload through load-generator stages.
    Workload {
        spec: WorkloadSpec,
        stages: Vec<Stage>,
        /// Build the real request bodies (see [`crate::workload::prompt`]).
        exact_prompts: bool,
    },
    /// A trace, as one stage; arrivals are divided by `speed`.
    Trace {
        requests: Vec<trace::TraceRequest>,
        speed: f64,
    },
}

#[derive(Clone, Debug)]
pub struct SimConfig {
    pub fleet: FleetSpec,
    pub router: RouterSpec,
    pub load: Load,
    pub seed: u64,
    /// Model seconds per router-clock second (see the module doc).
    pub time_scale: f64,
    /// End after the first stage whose TTFT p90 is above this (model s).
    pub stop_after_ttft_p90_s: Option<f64>,
    /// Envoy worker threads (`--concurrency`), each routing with its own
    /// engine and generator over the one shared store.
    pub envoy_workers: usize,
    /// Write one JSON line per routing decision here (`--decision-log`):
    /// the branch, each endpoint's index match, filter verdict, total and
    /// per-scorer scores, its insert counter, and the prefix the modelled
    /// server really holds, for finding why a profile misses.
    pub decision_log: Option<String>,
    /// Several proxies in front of the fleet (gateway replicas, sidecars).
    pub mesh: MeshSpec,
}

/// Several proxies (Envoy processes) in front of one fleet: each has its
/// own shared data (its own store, collector and workers) and sees only the
/// requests sent through it.
#[derive(Clone, Debug, PartialEq)]
pub struct MeshSpec {
    /// Proxies (`--proxies`); 1 is one gateway.
    pub proxies: usize,
    /// Which proxy a request goes through (`--proxy-assign`).
    pub assign: ProxyAssign,
    /// The mesh exchange on (`--mesh-exchange`): every `exchange_ms` each
    /// proxy posts its accepted decisions and in-flight sums per server to
    /// that server's exchange (the relay beside it) and takes the others'
    /// posted since its last call (`kvroute_core::engine` `mesh`).
    pub exchange: bool,
    /// ms of router clock between one proxy's exchanges (0: the metrics
    /// poll interval).
    pub exchange_ms: u64,
}

impl Default for MeshSpec {
    fn default() -> Self {
        MeshSpec {
            proxies: 1,
            assign: ProxyAssign::Rotate,
            exchange: false,
            exchange_ms: 0,
        }
    }
}

/// How requests are spread over the proxies.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ProxyAssign {
    /// Turn k of conversation (group) g through proxy (g + k) mod G: each
    /// turn through another proxy than the last (`replicas.py`'s shape).
    Rotate,
    /// A uniformly random proxy (a load balancer in front of replicas).
    Random,
    /// Each closed-loop client through its own proxy (client mod G; a rate
    /// stage's requests by group): sidecars.
    Client,
}

impl ProxyAssign {
    pub fn parse(s: &str) -> Result<ProxyAssign, String> {
        match s {
            "rotate" => Ok(ProxyAssign::Rotate),
            "random" => Ok(ProxyAssign::Random),
            "client" => Ok(ProxyAssign::Client),
            _ => Err(format!(
                "--proxy-assign: '{s}' is not rotate, random or client"
            )),
        }
    }
}

/// Totals of a run.
#[derive(Clone, Debug, Default, Serialize, PartialEq)]
pub struct Totals {
    /// Requests that arrived.
    pub arrived: u64,
    /// Requests that generated all their tokens.
    pub finished: u64,
    /// Requests refused (by the server, or answered locally by the filter),
    /// by reason; `arrived = finished + Σ dropped`.
    pub dropped: BTreeMap<String, u64>,
    /// Requests kvroute did not route (fail-open: the fallback picked).
    pub unrouted: u64,
    pub preemptions: u64,
    /// `/metrics` pages fed to the collector.
    pub scrapes: u64,
    /// Charges the collector reaped (should be 0: every request releases).
    pub reaped: u64,
}

/// Model seconds between utilization samples.
const SAMPLE_S: f64 = 1.0;

/// Where the servers' time and memory went, over the whole run.
#[derive(Clone, Debug, Default, Serialize, PartialEq)]
pub struct Utilization {
    /// Iteration time spent on prefill (`prefill tokens / prefill rate`),
    /// summed over servers, model s.
    pub prefill_busy_s: f64,
    /// The rest of the iteration time (the decode step), model s.
    pub decode_busy_s: f64,
    /// Sums over per-second samples of every server.
    pub kv_usage_sum: f64,
    pub waiting_sum: f64,
    pub running_sum: f64,
    pub samples: u64,
}

impl Utilization {
    pub fn kv_usage_mean(&self) -> f64 {
        self.kv_usage_sum / self.samples.max(1) as f64
    }
    pub fn waiting_mean(&self) -> f64 {
        self.waiting_sum / self.samples.max(1) as f64
    }
    pub fn running_mean(&self) -> f64 {
        self.running_sum / self.samples.max(1) as f64
    }
}

#[derive(Clone, Debug, Serialize)]
pub struct SimReport {
    pub router: String,
    pub endpoints: Vec<String>,
    pub stages: Vec<StageReport>,
    pub totals: Totals,
    /// Model seconds simulated.
    pub sim_s: f64,
    pub wall_s: f64,
    /// Iterations run by all servers.
    pub iterations: u64,
    /// In-flight requests the router's load table still holds after the
    /// run (every charge released: 0).
    pub inflight_after: u64,
    /// Bytes the router's shared data holds after the run.
    pub shared_data_bytes: usize,
    pub utilization: Utilization,
}

impl SimReport {
    pub fn speedup(&self) -> f64 {
        if self.wall_s > 0.0 {
            self.sim_s / self.wall_s
        } else {
            f64::INFINITY
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Ev {
    /// Utilization sample of every server.
    Sample,
    StepEnd(usize),
    Scrape,
    Reap,
    /// Proxy p's mesh exchange.
    Exchange(usize),
}

#[derive(Debug)]
struct Event {
    t: f64,
    seq: u64,
    ev: Ev,
}

impl PartialEq for Event {
    fn eq(&self, o: &Self) -> bool {
        self.cmp(o) == Ordering::Equal
    }
}
impl Eq for Event {}
impl PartialOrd for Event {
    fn partial_cmp(&self, o: &Self) -> Option<Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for Event {
    /// Earliest first in a max-heap; ties in insertion order.
    fn cmp(&self, o: &Self) -> Ordering {
        o.t.total_cmp(&self.t).then(o.seq.cmp(&self.seq))
    }
}

struct ServerState {
    model: Server,
    /// The iteration in progress, delivered at its end.
    pending: Option<StepResult>,
    /// Model request id → simulator request index.
    ids: HashMap<RequestId, usize>,
}

struct Inflight {
    rec: RequestRecord,
    /// Stage start, model s (the record's times are relative to it).
    stage_t0: f64,
    ticket: Option<Ticket>,
    /// The proxy that routed it (its charge is in that proxy's store).
    proxy: usize,
    prompt_released: bool,
    first_at: Option<f64>,
    last_chunk_at: f64,
    reported: u32,
    /// Closed-loop client that sent it.
    client: Option<usize>,
}

enum KvRouter {
    /// One rotation per Envoy worker; a request lands on a random worker.
    RoundRobin { next: Vec<usize>, pick_worker: Rng },
    Kvroute {
        /// One per Envoy process ([`MeshSpec`]); one gateway: one.
        proxies: Vec<Proxy>,
        /// Which proxy a request goes through ([`ProxyAssign::Random`]).
        pick_proxy: Rng,
        /// Requests so far per group ([`ProxyAssign::Rotate`]).
        turns: HashMap<u32, u32>,
        /// The mesh exchange, when on.
        exchange: Option<Exchange>,
        /// Endpoint address → fleet index.
        by_address: HashMap<String, usize>,
        /// Fleet index → (slot, generation), the same in every proxy.
        slots: Vec<(u16, u16)>,
    },
}

/// One Envoy process running kvroute.
struct Proxy {
    /// The collector's engine (and the releases').
    router: Box<Router>,
    store: MemoryStore,
    /// Envoy's worker threads: each has its own engine (its own table
    /// cache) and its own generator, seeded as the filter seeds it (every
    /// worker the same `routing.seed`, when set).
    workers: Vec<(Box<Router>, Rng)>,
    /// Which worker a request lands on (the kernel's connection spread).
    pick_worker: Rng,
    fallback_next: usize,
}

/// The exchange beside each server (the relay's part): what each proxy
/// posted, in order, and each proxy's last posted in-flight sums there.
struct Exchange {
    period_s: f64,
    /// Per server: (poster, its decision), in posting order.
    log: Vec<Vec<(usize, Accepted)>>,
    /// Per server, per proxy: its last posted sums and when (model s).
    load: Vec<Vec<Option<(OwnLoad, f64)>>>,
    /// Per proxy, per server: how far into `log` it has read.
    cursor: Vec<Vec<usize>>,
}

/// The result of routing one request.
struct Routed {
    endpoint: usize,
    ticket: Option<Ticket>,
    /// What the decision wrote, told to the mesh once the server accepts.
    provisional: Option<kvroute_core::engine::Provisional>,
    proxy: usize,
    unrouted: bool,
}

/// One simulation in progress.
pub struct Sim {
    cfg: SimConfig,
    emu: EmulatorConfig,
    hasher: VllmBlockHasher,
    servers: Vec<ServerState>,
    names: Vec<String>,
    router: KvRouter,
    heap: BinaryHeap<Event>,
    seq: u64,
    now: f64,
    requests: Vec<Option<Inflight>>,
    done: Vec<RequestRecord>,
    outstanding: usize,
    totals: Totals,
    iterations: u64,
    workload: Option<Workload>,
    limits: ParseLimits,
    poll_s: Option<f64>,
    reap_s: f64,
    /// Closed-loop clients whose request ended (concurrency stages).
    client_queue: Vec<usize>,
    use_: Utilization,
    /// The hit-ratio ceiling of the requests so far, in the modelled
    /// servers' own blocks.
    ceiling: Ceiling,
    /// The filter's counters the routing decisions of the current stage
    /// would have raised in Envoy (`kvroute_routed`, `kvroute_branch_*`,
    /// `kvroute_fail_open`, `kvroute_rejected`).
    router_counts: BTreeMap<&'static str, u64>,
    /// `--decision-log`: the open file, the workload tag of the request
    /// being built (group, last segment), and the decision just taken.
    decision_log: Option<std::io::BufWriter<std::fs::File>>,
    pending_tag: Option<(u32, String)>,
    last_decision: Option<(kvroute_core::scheduling::Decision, u64)>,
    /// The group of the request being built (which proxy it goes through).
    pending_group: Option<u32>,
    /// The proxy that routed the request just routed.
    last_proxy: usize,
    /// Conversations begun by sessions stages so far: a later stage's
    /// conversation c is session `sessions_begun + c`, a new one.
    sessions_begun: u32,
}

impl Sim {
    pub fn new(cfg: SimConfig) -> Result<Sim, String> {
        if cfg.fleet.endpoints == 0 {
            return Err("the fleet needs at least one endpoint".into());
        }
        if !(cfg.time_scale > 0.0 && cfg.time_scale.is_finite()) {
            return Err("--time-scale must be positive".into());
        }
        let mut names: Vec<String> = (0..cfg.fleet.endpoints)
            .map(|i| format!("127.0.0.1:{}", 18000 + i))
            .collect();
        let (router, poll_s, reap_s) = match &cfg.router {
            RouterSpec::RoundRobin => (
                KvRouter::RoundRobin {
                    // Envoy starts each worker's rotation at a random host.
                    next: {
                        let mut r = Rng::derive(cfg.seed, 0xE0E1);
                        (0..cfg.envoy_workers.max(1) * cfg.mesh.proxies.max(1))
                            .map(|_| r.below(cfg.fleet.endpoints as u64) as usize)
                            .collect()
                    },
                    pick_worker: Rng::derive(cfg.seed, 0xE0E0),
                },
                None,
                1.0,
            ),
            RouterSpec::Kvroute(config) => {
                let mut config = (**config).clone();
                config.mesh.enabled = cfg.mesh.exchange;
                if let EndpointSource::Static(list) = &config.endpoints {
                    if list.len() != cfg.fleet.endpoints {
                        return Err(format!(
                            "the configuration lists {} static endpoints but the fleet has {}",
                            list.len(),
                            cfg.fleet.endpoints
                        ));
                    }
                    names = list.iter().map(|a| a.to_string()).collect();
                }
                let c = config.collector.clone();
                let poll_s = c
                    .metrics_cluster
                    .as_ref()
                    .map(|_| c.metrics_poll_interval_ms as f64 / 1e3 * cfg.time_scale);
                let reap_s = (c.reap_after_ms / 4).clamp(100, 1000) as f64 / 1e3 * cfg.time_scale;
                let fixed_seed = config.routing.seed;
                let n_proxies = cfg.mesh.proxies.max(1);
                let mut proxies = Vec::with_capacity(n_proxies);
                for p in 0..n_proxies {
                    let mut config = config.clone();
                    if cfg.mesh.exchange && n_proxies > 1 {
                        // Each Envoy process its own tie salt.
                        config.mesh.tie_salt = Rng::derive(p as u64, 0x5A17).next_u64();
                    }
                    let router = Box::new(Router::new(config));
                    // Proxy 0 is seeded as one gateway always was.
                    let base = cfg.seed.wrapping_add((p as u64) << 20);
                    let workers = (0..cfg.envoy_workers.max(1))
                        .map(|i| {
                            let s = fixed_seed.unwrap_or(base.wrapping_add(i as u64));
                            (router.clone(), Rng::new(s))
                        })
                        .collect();
                    let store = MemoryStore::new();
                    router
                        .collector_init(&store)
                        .map_err(|e| format!("collector init: {e}"))?;
                    router
                        .apply_membership(&store, names.iter().map(|n| (n.clone(), true)).collect())
                        .map_err(|e| format!("membership: {e}"))?;
                    proxies.push(Proxy {
                        router,
                        store,
                        workers,
                        pick_worker: Rng::derive(cfg.seed ^ ((p as u64) << 32), 0xE0E0),
                        fallback_next: 0,
                    });
                }
                let (router, store) = (&proxies[0].router, &proxies[0].store);
                let table = router
                    .endpoint_table(store)
                    .map_err(|e| format!("endpoint table: {e}"))?;
                let mut by_address = HashMap::new();
                let mut slots = vec![(0, 0); names.len()];
                for (i, n) in names.iter().enumerate() {
                    let e = table
                        .endpoints
                        .iter()
                        .find(|e| &e.address == n)
                        .ok_or_else(|| format!("endpoint {n} missing from the table"))?;
                    by_address.insert(n.clone(), i);
                    slots[i] = (e.slot, e.generation);
                }
                // Every proxy has the same slots (the same membership, in order).
                for p in &proxies[1..] {
                    let t = p
                        .router
                        .endpoint_table(&p.store)
                        .map_err(|e| format!("endpoint table: {e}"))?;
                    for (i, n) in names.iter().enumerate() {
                        if !t
                            .endpoints
                            .iter()
                            .any(|e| &e.address == n && (e.slot, e.generation) == slots[i])
                        {
                            return Err(format!("proxies disagree on {n}'s slot"));
                        }
                    }
                }
                let exchange = cfg.mesh.exchange.then(|| {
                    let ms = match cfg.mesh.exchange_ms {
                        0 => c.metrics_poll_interval_ms,
                        ms => ms,
                    };
                    Exchange {
                        period_s: ms.max(1) as f64 / 1e3 * cfg.time_scale,
                        log: vec![Vec::new(); names.len()],
                        load: vec![vec![None; n_proxies]; names.len()],
                        cursor: vec![vec![0; names.len()]; n_proxies],
                    }
                });
                (
                    KvRouter::Kvroute {
                        proxies,
                        pick_proxy: Rng::derive(cfg.seed, 0xE0E2),
                        turns: HashMap::new(),
                        exchange,
                        by_address,
                        slots,
                    },
                    poll_s,
                    reap_s,
                )
            }
        };
        let emu = EmulatorConfig {
            engine: cfg.fleet.engine.clone(),
            model: cfg.fleet.model.clone(),
            chars_per_token: cfg.fleet.chars_per_token,
            stream_interval: cfg.fleet.stream_interval,
            accept_any_model: true,
            ..EmulatorConfig::default()
        };
        let servers = (0..cfg.fleet.endpoints)
            .map(|_| ServerState {
                model: Server::new(cfg.fleet.engine.clone(), false),
                pending: None,
                ids: HashMap::new(),
            })
            .collect();
        let workload = match &cfg.load {
            Load::Workload { spec, .. } => Some(Workload::new(spec.clone(), cfg.seed)),
            Load::Trace { .. } => None,
        };
        Ok(Sim {
            hasher: VllmBlockHasher::new(Some(&emu.python_hash_seed)),
            emu,
            servers,
            names,
            router,
            heap: BinaryHeap::new(),
            seq: 0,
            now: 0.0,
            requests: Vec::new(),
            done: Vec::new(),
            outstanding: 0,
            totals: Totals::default(),
            iterations: 0,
            workload,
            limits: ParseLimits {
                max_body_bytes: usize::MAX,
            },
            poll_s,
            reap_s,
            client_queue: Vec::new(),
            use_: Utilization::default(),
            ceiling: Ceiling::new(cfg.fleet.engine.block_size),
            router_counts: BTreeMap::new(),
            decision_log: match &cfg.decision_log {
                None => None,
                Some(path) => Some(std::io::BufWriter::new(
                    std::fs::File::create(path)
                        .map_err(|e| format!("cannot create {path}: {e}"))?,
                )),
            },
            pending_tag: None,
            last_decision: None,
            pending_group: None,
            last_proxy: 0,
            sessions_begun: 0,
            cfg,
        })
    }

    fn push(&mut self, t: f64, ev: Ev) {
        self.seq += 1;
        self.heap.push(Event {
            t,
            seq: self.seq,
            ev,
        });
    }

    /// The router's clock, ms (wall-equivalent; never 0).
    fn now_ms(&self) -> u64 {
        1_000_000 + (self.now / self.cfg.time_scale * 1e3) as u64
    }

    /// Runs the whole load; consumes the simulation.
    pub fn run(mut self) -> Result<SimReport, String> {
        let wall = Instant::now();
        if let Some(p) = self.poll_s {
            self.scrape(); // the collector's first poll, before traffic
            self.push(p, Ev::Scrape);
        }
        if matches!(self.router, KvRouter::Kvroute { .. }) {
            self.push(self.reap_s, Ev::Reap);
        }
        if let KvRouter::Kvroute {
            proxies,
            exchange: Some(x),
            ..
        } = &self.router
        {
            // Each proxy on its own phase within the period.
            let (n, period) = (proxies.len(), x.period_s);
            for p in 0..n {
                self.push(period * (p as f64 + 0.5) / n as f64, Ev::Exchange(p));
            }
        }
        self.push(SAMPLE_S, Ev::Sample);
        let mut stages = Vec::new();
        match self.cfg.load.clone() {
            Load::Workload { stages: st, .. } => {
                for (i, stage) in st.iter().enumerate() {
                    let report = self.run_stage(stage, i as u64)?;
                    let over = self
                        .cfg
                        .stop_after_ttft_p90_s
                        .is_some_and(|limit| report.ttft_s.p90.is_none_or(|p| p > limit));
                    stages.push(report);
                    if over {
                        break;
                    }
                }
            }
            Load::Trace { requests, speed } => {
                stages.push(self.run_trace(&requests, speed)?);
            }
        }
        let router = match &self.cfg.router {
            RouterSpec::RoundRobin => "round-robin".to_owned(),
            RouterSpec::Kvroute(_) => "kvroute".to_owned(),
        };
        self.totals.preemptions = self
            .servers
            .iter()
            .map(|s| s.model.counters.preemptions)
            .sum();
        let (inflight_after, shared_data_bytes) = match &self.router {
            KvRouter::Kvroute { proxies, slots, .. } => {
                let (mut inflight, mut bytes_max) = (0, 0);
                for p in proxies {
                    let bytes = p
                        .store
                        .get(kvroute_shared_state::LOAD_KEY)
                        .map_err(|e| format!("reading the load table: {e}"))?;
                    let load = LoadTable::decode(bytes.as_ref().map(|(b, _)| b.as_slice()));
                    inflight += slots
                        .iter()
                        .filter_map(|&(slot, generation)| load.get(slot, generation))
                        .map(|r| r.inflight_requests())
                        .sum::<u64>();
                    bytes_max = bytes_max.max(p.store.usage().0);
                }
                (inflight, bytes_max)
            }
            KvRouter::RoundRobin { .. } => (0, 0),
        };
        Ok(SimReport {
            utilization: std::mem::take(&mut self.use_),
            inflight_after,
            shared_data_bytes,
            router,
            endpoints: self.names.clone(),
            stages,
            totals: self.totals,
            sim_s: self.now,
            wall_s: wall.elapsed().as_secs_f64(),
            iterations: self.iterations,
        })
    }

    fn counters(&self) -> Vec<Option<EndpointCounters>> {
        self.servers
            .iter()
            .map(|s| {
                let c = &s.model.counters;
                Some(EndpointCounters {
                    prefix_cache_queries: c.prefix_cache_queries as f64,
                    prefix_cache_hits: c.prefix_cache_hits as f64,
                    prompt_tokens: c.prompt_tokens as f64,
                    generation_tokens: c.generation_tokens as f64,
                    host_lag_s: 0.0,
                })
            })
            .collect()
    }

    /// The next workload request.
    fn next_workload_request(&mut self) -> SimRequest {
        let parts = self
            .workload
            .as_mut()
            .expect("workload load has a workload")
            .next_parts();
        self.workload_request(parts)
    }

    /// A workload request from its structure.
    fn workload_request(&mut self, parts: GenParts) -> SimRequest {
        let exact = matches!(
            self.cfg.load,
            Load::Workload {
                exact_prompts: true,
                ..
            }
        );
        let w = self
            .workload
            .as_mut()
            .expect("workload load has a workload");
        if exact {
            let g = w.request_of(parts);
            self.pending_group = Some(g.group);
            let kind = if g.path.ends_with("/chat/completions") {
                ApiKind::ChatCompletions
            } else {
                ApiKind::Completions
            };
            self.body_request(kind, g.body.to_string().into_bytes())
        } else {
            self.pending_group = Some(parts.group);
            let model = w.spec().model.clone();
            if self.decision_log.is_some() {
                let last = parts
                    .messages
                    .last()
                    .and_then(|(_, segs)| segs.last())
                    .map(|g| format!("{}.{}.{}", g.kind, g.a, g.b))
                    .unwrap_or_default();
                self.pending_tag = Some((parts.group, last));
            }
            self.parts_request(&model, &parts)
        }
    }

    fn router_blocks(&self) -> (u32, usize) {
        match &self.cfg.router {
            RouterSpec::Kvroute(c) => (
                c.prefix.blocks.block_size_tokens,
                c.prefix.blocks.max_blocks(),
            ),
            RouterSpec::RoundRobin => (self.cfg.fleet.engine.block_size, usize::MAX),
        }
    }

    fn parts_request(&self, model: &str, parts: &GenParts) -> SimRequest {
        let pieces = parts_pieces(parts);
        let (rbs, rmax) = self.router_blocks();
        from_pieces(
            model,
            &pieces,
            parts.output_tokens,
            rbs,
            rmax,
            self.cfg.fleet.engine.block_size,
        )
    }

    /// A text request: the router gets the body, the server what the
    /// emulator builds from it.
    fn body_request(&self, kind: ApiKind, body: Vec<u8>) -> SimRequest {
        let server = match parse_request(kind, &body, &self.limits)
            .map_err(|e| e.to_string())
            .and_then(|req| engine_request(&req, &body, &self.emu, &self.hasher, false))
        {
            Ok(r) => r,
            // The emulator would answer 400; an over-long prompt makes the
            // server refuse it too (counted as dropped).
            Err(_) => crate::vllm_model::EngineRequest {
                prompt_tokens: u32::MAX,
                ..Default::default()
            },
        };
        SimRequest {
            router: RouterInput::Body { kind, body },
            server,
        }
    }

    fn route(
        &mut self,
        input: &RouterInput,
        client: Option<usize>,
    ) -> Result<Option<Routed>, String> {
        let now_ms = self.now_ms();
        let n = self.servers.len();
        let group = self.pending_group.take();
        match &mut self.router {
            KvRouter::RoundRobin { next, pick_worker } => {
                let w = pick_worker.below(next.len() as u64) as usize;
                let e = next[w] % n;
                next[w] = (e + 1) % n;
                Ok(Some(Routed {
                    endpoint: e,
                    ticket: None,
                    provisional: None,
                    proxy: 0,
                    unrouted: false,
                }))
            }
            KvRouter::Kvroute {
                proxies,
                pick_proxy,
                turns,
                by_address,
                ..
            } => {
                let g = proxies.len();
                let p = match (self.cfg.mesh.assign, group, client) {
                    _ if g == 1 => 0,
                    (ProxyAssign::Client, _, Some(c)) => c % g,
                    (ProxyAssign::Client, Some(grp), None) => grp as usize % g,
                    (ProxyAssign::Rotate, Some(grp), _) => {
                        let k = turns.entry(grp).or_insert(0);
                        let p = (grp as usize + *k as usize) % g;
                        *k = k.wrapping_add(1);
                        p
                    }
                    _ => pick_proxy.below(g as u64) as usize,
                };
                self.last_proxy = p;
                let Proxy {
                    store,
                    workers,
                    pick_worker,
                    fallback_next,
                    ..
                } = &mut proxies[p];
                let w = pick_worker.below(workers.len() as u64) as usize;
                let (router, rng) = &mut workers[w];
                let api = match input {
                    RouterInput::Body { kind, .. } => Some(*kind),
                    RouterInput::Hashed { .. } => None,
                };
                let facts = match input {
                    RouterInput::Body { kind, body } => router.facts(*kind, body),
                    RouterInput::Hashed {
                        hashes,
                        prompt_tokens,
                        max_output_tokens,
                    } => Ok(RequestFacts::blocks(
                        hashes.clone(),
                        *prompt_tokens,
                        *max_output_tokens,
                    )),
                };
                let outcome = match facts {
                    Ok(mut facts) => {
                        // The decision log prints each scorer's score.
                        facts.scorer_scores = self.decision_log.is_some();
                        router.route(store, facts, now_ms, rng)
                    }
                    Err(why) => router.fail_for(why, api),
                };
                let mut count = |c: Counter| *self.router_counts.entry(c.name()).or_insert(0) += 1;
                match &outcome {
                    Outcome::Routed(r) => {
                        count(Counter::Routed);
                        count(Counter::for_branch(r.decision.branch));
                        if self.decision_log.is_some() {
                            self.last_decision = Some((r.decision.clone(), r.uncached_tokens));
                        }
                    }
                    Outcome::FailOpen(_) => count(Counter::FailOpen),
                    Outcome::Reject { .. } => count(Counter::Rejected),
                }
                match outcome {
                    Outcome::Routed(r) => {
                        let e = *by_address
                            .get(r.primary_address())
                            .ok_or_else(|| format!("routed to unknown {}", r.primary_address()))?;
                        Ok(Some(Routed {
                            endpoint: e,
                            ticket: r.ticket,
                            provisional: r.provisional,
                            proxy: p,
                            unrouted: false,
                        }))
                    }
                    // Envoy's fallback balancer (round robin) picks.
                    Outcome::FailOpen(_) => {
                        let e = *fallback_next % n;
                        *fallback_next = (e + 1) % n;
                        Ok(Some(Routed {
                            endpoint: e,
                            ticket: None,
                            provisional: None,
                            proxy: p,
                            unrouted: true,
                        }))
                    }
                    Outcome::Reject { .. } => Ok(None),
                }
            }
        }
    }

    fn release(
        &mut self,
        proxy: usize,
        ticket: &Ticket,
        rest: bool,
        prompt_released: bool,
    ) -> Result<(), String> {
        if let KvRouter::Kvroute { proxies, .. } = &self.router {
            let Proxy { router, store, .. } = &proxies[proxy];
            let r = if rest {
                router.release_rest(store, ticket, prompt_released)
            } else {
                router.release_prompt(store, ticket)
            };
            r.map_err(|e| format!("release: {e}"))?;
        }
        Ok(())
    }

    fn drop_request(&mut self, mut rec: RequestRecord, why: &str) {
        rec.ok = false;
        rec.error = Some(why.to_owned());
        *self.totals.dropped.entry(why.to_owned()).or_insert(0) += 1;
        self.done.push(rec);
    }

    /// A request arrives now.
    fn arrive(
        &mut self,
        req: SimRequest,
        stage_t0: f64,
        client: Option<usize>,
    ) -> Result<(), String> {
        self.totals.arrived += 1;
        let ceiling = (req.server.prompt_tokens != u32::MAX).then(|| {
            self.ceiling.add(
                u64::from(req.server.prompt_tokens),
                &req.server.block_hashes,
            )
        });
        let rec = RequestRecord {
            sent_at_s: self.now - stage_t0,
            end_s: self.now - stage_t0,
            prompt_tokens: u64::from(req.server.prompt_tokens),
            ceiling: Some(ceiling.unwrap_or((0, 0))),
            ..Default::default()
        };
        let router_blocks = match &req.router {
            RouterInput::Hashed { hashes, .. } => hashes.len(),
            RouterInput::Body { .. } => 0,
        };
        self.last_decision = None;
        let Some(routed) = self.route(&req.router, client)? else {
            // A closed-loop client whose request is refused at once stops
            // (in virtual time it would otherwise resend forever at one instant).
            self.drop_request(rec, "rejected by kvroute");
            return Ok(());
        };
        if routed.unrouted {
            self.totals.unrouted += 1;
        }
        let e = routed.endpoint;
        let now = self.now;
        if self.decision_log.is_some() {
            self.log_decision(&req, e, router_blocks)?;
        }
        match self.servers[e].model.add_request(req.server, now) {
            Ok(id) => {
                // The server accepted it: the filter tells the mesh at the
                // response's headers (`lifecycle::stream`).
                if let (KvRouter::Kvroute { proxies, .. }, Some(prov)) =
                    (&self.router, &routed.provisional)
                {
                    let px = &proxies[routed.proxy];
                    px.router
                        .note_accepted(&px.store, prov, None)
                        .map_err(|e| format!("outbox: {e}"))?;
                }
                let idx = self.requests.len();
                self.requests.push(Some(Inflight {
                    rec: RequestRecord {
                        served_by: Some(self.names[e].clone()),
                        ..rec
                    },
                    stage_t0,
                    ticket: routed.ticket,
                    proxy: routed.proxy,
                    prompt_released: false,
                    first_at: None,
                    last_chunk_at: now,
                    reported: 0,
                    client,
                }));
                self.servers[e].ids.insert(id, idx);
                self.outstanding += 1;
                if self.servers[e].pending.is_none() {
                    self.start_step(e);
                }
            }
            Err(_) => {
                // vLLM answers 400 at once; the filter releases at the reply.
                if let Some(t) = &routed.ticket {
                    self.release(routed.proxy, t, true, false)?;
                }
                // As above: the refused client stops.
                self.drop_request(rec, "http 400");
            }
        }
        Ok(())
    }

    /// One line of `--decision-log` for the request just routed to `e`
    /// (nothing for round robin or a fail-open pick).
    fn log_decision(
        &mut self,
        req: &SimRequest,
        e: usize,
        router_blocks: usize,
    ) -> Result<(), String> {
        use std::io::Write;
        let Some((d, uncached)) = self.last_decision.take() else {
            return Ok(());
        };
        let tag = self.pending_tag.take();
        let load = match &self.router {
            KvRouter::Kvroute { proxies, .. } => {
                let bytes = proxies[self.last_proxy]
                    .store
                    .get(kvroute_shared_state::LOAD_KEY)
                    .map_err(|e| format!("reading the load table: {e}"))?;
                Some(LoadTable::decode(bytes.as_ref().map(|(b, _)| b.as_slice())))
            }
            KvRouter::RoundRobin { .. } => None,
        };
        let slots = match &self.router {
            KvRouter::Kvroute { slots, .. } => slots.clone(),
            KvRouter::RoundRobin { .. } => Vec::new(),
        };
        let bs = self.cfg.fleet.engine.block_size;
        let n_scorers = d.scorer_scores.len() / d.report.len().max(1);
        let cands: Vec<serde_json::Value> = d
            .report
            .iter()
            .enumerate()
            .map(|(i, c)| {
                let server_cached_blocks = self
                    .servers
                    .get(i)
                    .map(|s| {
                        s.model
                            .cache()
                            .longest_cached_prefix(&req.server.block_hashes)
                            .len()
                    })
                    .unwrap_or(0);
                let insert_counter = slots
                    .get(i)
                    .and_then(|&(slot, g)| load.as_ref().and_then(|l| l.get(slot, g)))
                    .map(|r| r.insert_counter);
                serde_json::json!({
                    "affinity": c.affinity,
                    "ttft_ms": c.ttft_ms,
                    "passed": c.passed_filter,
                    "score": c.score,
                    "scorers": &d.scorer_scores[i * n_scorers..(i + 1) * n_scorers],
                    "server_cached_tokens": server_cached_blocks as u64 * u64::from(bs),
                    "insert_counter": insert_counter,
                })
            })
            .collect();
        let line = serde_json::json!({
            "t": self.now,
            "group": tag.as_ref().map(|t| t.0),
            "last_segment": tag.as_ref().map(|t| t.1.clone()),
            "prompt_tokens": req.server.prompt_tokens,
            "router_blocks": router_blocks,
            "branch": d.branch.as_str(),
            "primary": d.primary,
            "endpoint": e,
            "uncached_tokens": uncached,
            "candidates": cands,
        });
        if let Some(w) = self.decision_log.as_mut() {
            writeln!(w, "{line}").map_err(|e| format!("decision log: {e}"))?;
        }
        Ok(())
    }

    fn start_step(&mut self, e: usize) {
        let s = &mut self.servers[e];
        if !s.model.has_work() {
            return;
        }
        let r = s.model.step(self.now);
        if r.duration_s <= 0.0 && r.outputs.is_empty() {
            return; // nothing schedulable; the next arrival restarts it
        }
        self.iterations += 1;
        let prefill_s = if r.prefill_tokens > 0 {
            (r.prefill_tokens as f64 / self.cfg.fleet.engine.step_cost.prefill_tokens_per_s)
                .min(r.duration_s)
        } else {
            0.0
        };
        self.use_.prefill_busy_s += prefill_s;
        self.use_.decode_busy_s += r.duration_s - prefill_s;
        let end = self.now + r.duration_s;
        s.pending = Some(r);
        self.push(end, Ev::StepEnd(e));
    }

    fn step_end(&mut self, e: usize) -> Result<(), String> {
        let Some(r) = self.servers[e].pending.take() else {
            return Ok(());
        };
        let interval = self.cfg.fleet.stream_interval.max(1);
        for o in r.outputs {
            let Some(&idx) = self.servers[e].ids.get(&o.id) else {
                continue;
            };
            let now = self.now;
            let mut release: Option<(usize, Ticket, bool, bool)> = None;
            let finished;
            {
                let inf = self.requests[idx].as_mut().expect("live request");
                let chunk = o.first || o.finished || o.generated - inf.reported >= interval;
                if chunk {
                    inf.reported = o.generated;
                    inf.last_chunk_at = now;
                }
                if o.first {
                    inf.first_at = Some(now);
                    inf.rec.cached_tokens = u64::from(o.cached_tokens);
                    if !o.finished {
                        if let Some(t) = &inf.ticket {
                            release = Some((inf.proxy, *t, false, false));
                        }
                        inf.prompt_released = true;
                    }
                }
                finished = o.finished;
                if finished {
                    if let Some(t) = &inf.ticket {
                        release = Some((inf.proxy, *t, true, inf.prompt_released));
                    }
                    inf.rec.completion_tokens = u64::from(o.generated);
                }
            }
            if let Some((px, t, rest, pr)) = release {
                self.release(px, &t, rest, pr)?;
            }
            if finished {
                self.servers[e].ids.remove(&o.id);
                let inf = self.requests[idx].take().expect("live request");
                let mut rec = inf.rec;
                let first = inf.first_at.unwrap_or(now);
                rec.ok = true;
                rec.ttft_s = Some(first - inf.stage_t0 - rec.sent_at_s);
                rec.decode_s = Some(inf.last_chunk_at - first);
                rec.end_s = now - inf.stage_t0;
                self.done.push(rec);
                self.totals.finished += 1;
                self.outstanding -= 1;
                self.client_done(inf.client);
            }
        }
        self.start_step(e);
        Ok(())
    }

    /// A closed-loop client's request ended: it sends the next one now if
    /// its stage is still on (see `run_stage`).
    fn client_done(&mut self, client: Option<usize>) {
        if let Some(c) = client {
            self.client_queue.push(c);
        }
    }

    fn scrape(&mut self) {
        let KvRouter::Kvroute { proxies, slots, .. } = &self.router else {
            return;
        };
        let now_ms = 1_000_000 + (self.now / self.cfg.time_scale * 1e3) as u64;
        for (i, s) in self.servers.iter().enumerate() {
            let page = render_parts(
                &self.cfg.fleet.model,
                &self.cfg.fleet.engine,
                0.0,
                &Snapshot::of(&s.model),
            );
            let (slot, generation) = slots[i];
            // Every proxy's collector polls every server. A failure to
            // write is the collector's problem in Envoy too: it keeps the
            // old values, which go stale.
            for p in proxies {
                let _ = p.router.record_metrics(
                    &p.store,
                    slot,
                    generation,
                    Ok(page.as_bytes()),
                    now_ms,
                );
            }
            self.totals.scrapes += 1;
        }
    }

    fn reap(&mut self) {
        if let KvRouter::Kvroute { proxies, .. } = &self.router {
            let now_ms = 1_000_000 + (self.now / self.cfg.time_scale * 1e3) as u64;
            for p in proxies {
                if let Ok(n) = p.router.reap(&p.store, now_ms) {
                    self.totals.reaped += n;
                }
            }
        }
    }

    /// Proxy `p`'s exchange: it posts what its outbox holds and its own
    /// in-flight sums to each server's exchange, and takes what the others
    /// posted there since its last call, with their latest sums.
    fn exchange(&mut self, p: usize) -> Result<(), String> {
        let now = self.now;
        let now_ms = self.now_ms();
        let KvRouter::Kvroute {
            proxies,
            exchange: Some(x),
            slots,
            ..
        } = &mut self.router
        else {
            return Ok(());
        };
        let px = &proxies[p];
        let out = px
            .router
            .mesh_outgoing(&px.store)
            .map_err(|e| format!("mesh outgoing: {e}"))?;
        let server_of =
            |slot: u16, generation: u16| slots.iter().position(|&s| s == (slot, generation));
        for d in out.decisions {
            if let Some(e) = server_of(d.slot, d.generation) {
                x.log[e].push((p, d));
            }
        }
        for l in &out.load {
            if let Some(e) = server_of(l.slot, l.generation) {
                x.load[e][p] = Some((*l, now));
            }
        }
        // A proxy's sums count for three periods after it posted them.
        let ttl = 3.0 * x.period_s;
        for (e, &(slot, generation)) in slots.iter().enumerate() {
            let mut peer = PeerLoad {
                at_ms: now_ms.max(1),
                ..Default::default()
            };
            for (q, l) in x.load[e].iter().enumerate() {
                if let Some((l, _)) = (*l).filter(|&(_, at)| q != p && now - at <= ttl) {
                    peer.prompt_tokens += l.prompt_tokens;
                    peer.output_tokens += l.output_tokens;
                    peer.requests += l.requests;
                }
            }
            let from = x.cursor[p][e];
            let decisions: Vec<PeerDecision<'_>> = x.log[e][from..]
                .iter()
                .filter(|(q, _)| *q != p)
                .map(|(_, d)| PeerDecision {
                    new_blocks: d.new_blocks,
                    prompt_bytes: d.prompt_bytes,
                    hashes: &d.hashes,
                    session: d.session,
                })
                .collect();
            px.router
                .apply_peer(&px.store, slot, generation, Some(peer), &decisions, now_ms)
                .map_err(|e| format!("mesh apply: {e}"))?;
            x.cursor[p][e] = x.log[e].len();
        }
        Ok(())
    }

    fn handle(&mut self, ev: Ev) -> Result<(), String> {
        match ev {
            Ev::StepEnd(e) => self.step_end(e)?,
            Ev::Scrape => {
                self.scrape();
                if let Some(p) = self.poll_s {
                    self.push(self.now + p, Ev::Scrape);
                }
            }
            Ev::Reap => {
                self.reap();
                self.push(self.now + self.reap_s, Ev::Reap);
            }
            Ev::Exchange(p) => {
                self.exchange(p)?;
                if let KvRouter::Kvroute {
                    exchange: Some(x), ..
                } = &self.router
                {
                    let period = x.period_s;
                    self.push(self.now + period, Ev::Exchange(p));
                }
            }
            Ev::Sample => {
                for sv in &self.servers {
                    self.use_.kv_usage_sum += sv.model.cache().usage();
                    self.use_.waiting_sum += sv.model.num_waiting() as f64;
                    self.use_.running_sum += sv.model.num_running() as f64;
                    self.use_.samples += 1;
                }
                self.push(self.now + SAMPLE_S, Ev::Sample);
            }
        }
        Ok(())
    }

    fn finish_stage(
        &mut self,
        label: String,
        duration_s: f64,
        before: &[Option<EndpointCounters>],
    ) -> StageReport {
        let after = self.counters();
        let mut records = std::mem::take(&mut self.done);
        records.sort_by(|a, b| a.sent_at_s.total_cmp(&b.sent_at_s));
        let mut report = stage_report(label, duration_s, &records, &self.names, before, &after);
        let counts = std::mem::take(&mut self.router_counts);
        if matches!(self.router, KvRouter::Kvroute { .. }) {
            report.router_counters =
                Some(counts.into_iter().map(|(k, v)| (k.to_owned(), v)).collect());
        }
        report
    }

    fn run_stage(&mut self, stage: &Stage, stage_no: u64) -> Result<StageReport, String> {
        let t0 = self.now;
        let before = self.counters();
        let end = t0 + stage.duration_s;
        match stage.kind {
            StageKind::Rate(rate) => {
                // The load generator's arrival stream for this stage.
                let mut rng = Rng::derive(self.cfg.seed, 0x5EED ^ stage_no);
                let mean_gap_s = 1.0 / rate;
                let mut at = t0 + rng.exponential(mean_gap_s);
                while at < end {
                    self.advance_to(at)?;
                    let req = self.next_workload_request();
                    self.arrive(req, t0, None)?;
                    at += rng.exponential(mean_gap_s);
                }
            }
            StageKind::Concurrency(n) => {
                for c in 0..n as usize {
                    let req = self.next_workload_request();
                    self.arrive(req, t0, Some(c))?;
                }
                loop {
                    while let Some(c) = self.client_queue.pop() {
                        if self.now < end {
                            let req = self.next_workload_request();
                            self.arrive(req, t0, Some(c))?;
                        }
                    }
                    if self.outstanding == 0 && self.client_queue.is_empty() {
                        break;
                    }
                    self.next_event()?;
                }
            }
            StageKind::Sessions { clients, think_s } => {
                self.run_sessions(t0, clients, think_s, stage.duration_s, stage_no)?;
            }
        }
        self.drain()?;
        self.client_queue.clear();
        Ok(self.finish_stage(stage.label(), stage.duration_s, &before))
    }

    /// A sessions stage: conversation `c` is client `c` (a new session,
    /// never one of an earlier stage's); it starts at a
    /// uniform time in `[t0, t0 + spread_s)`, sends turn k + 1 an
    /// exponential think time (mean `think_s`) after turn k's last token,
    /// and stops after the workload's turns per conversation (or a refused
    /// turn). Each client draws from its own generator, so one client's
    /// timing does not move another's.
    fn run_sessions(
        &mut self,
        t0: f64,
        clients: u32,
        think_s: f64,
        spread_s: f64,
        stage_no: u64,
    ) -> Result<(), String> {
        let turns = self
            .workload
            .as_ref()
            .map_or(1, |w| w.spec().prompts_per_group.max(1));
        let mut rngs: Vec<Rng> = (0..clients)
            .map(|c| Rng::derive(self.cfg.seed, 0x5E55_0000 ^ (stage_no << 32) ^ u64::from(c)))
            .collect();
        // Each client's next send time (None: waiting for an answer, or done)
        // and next turn.
        let mut due: Vec<Option<f64>> = rngs
            .iter_mut()
            .map(|r| Some(t0 + r.next_f64() * spread_s))
            .collect();
        let mut next_turn = vec![0u32; clients as usize];
        let first = self.sessions_begun;
        self.sessions_begun = first.saturating_add(clients);
        loop {
            // Clients whose answer just ended think, then send again.
            while let Some(c) = self.client_queue.pop() {
                if next_turn[c] < turns {
                    due[c] = Some(self.now + rngs[c].exponential(think_s));
                }
            }
            let send = due
                .iter()
                .enumerate()
                .filter_map(|(c, t)| t.map(|t| (t, c)))
                .min_by(|a, b| a.0.total_cmp(&b.0));
            match send {
                // Events due at or before the send first, as `advance_to`.
                Some((t, c)) if self.heap.peek().is_none_or(|e| e.t > t) => {
                    due[c] = None;
                    self.now = self.now.max(t);
                    let parts = self
                        .workload
                        .as_ref()
                        .expect("workload load has a workload")
                        .session_parts(first.saturating_add(c as u32), next_turn[c])?;
                    next_turn[c] += 1;
                    let req = self.workload_request(parts);
                    self.arrive(req, t0, Some(c))?;
                }
                None if self.outstanding == 0 => return Ok(()),
                _ => self.next_event()?,
            }
        }
    }

    fn run_trace(
        &mut self,
        reqs: &[trace::TraceRequest],
        speed: f64,
    ) -> Result<StageReport, String> {
        let t0 = self.now;
        let before = self.counters();
        let speed = if speed > 0.0 { speed } else { 1.0 };
        let mut last = 0.0f64;
        for r in reqs {
            let at = t0 + r.arrival_s / speed;
            self.advance_to(at)?;
            last = last.max(r.arrival_s / speed);
            let req = self.trace_request(r);
            self.arrive(req, t0, None)?;
        }
        self.drain()?;
        Ok(self.finish_stage("trace".into(), last.max(1e-9), &before))
    }

    fn trace_request(&self, r: &trace::TraceRequest) -> SimRequest {
        let model = r.model.as_deref().unwrap_or(&self.cfg.fleet.model);
        match &r.prompt {
            trace::TracePrompt::Segments(p) => {
                let (rbs, rmax) = self.router_blocks();
                from_pieces(
                    model,
                    p,
                    r.output_tokens,
                    rbs,
                    rmax,
                    self.cfg.fleet.engine.block_size,
                )
            }
            trace::TracePrompt::Text(text) => {
                let body = serde_json::json!({
                    "model": model, "prompt": text, "max_tokens": r.output_tokens,
                    "ignore_eos": true, "stream": true,
                    "stream_options": {"include_usage": true},
                });
                self.body_request(ApiKind::Completions, body.to_string().into_bytes())
            }
        }
    }

    /// Handles every event before `t`, then sets the clock to `t`.
    fn advance_to(&mut self, t: f64) -> Result<(), String> {
        while self.heap.peek().is_some_and(|e| e.t <= t) {
            self.next_event()?;
        }
        self.now = self.now.max(t);
        Ok(())
    }

    fn next_event(&mut self) -> Result<(), String> {
        let Some(e) = self.heap.pop() else {
            return Err("the event queue ran dry with requests outstanding".into());
        };
        self.now = self.now.max(e.t);
        self.handle(e.ev)
    }

    /// Runs until every outstanding request has ended.
    fn drain(&mut self) -> Result<(), String> {
        while self.outstanding > 0 {
            self.next_event()?;
        }
        Ok(())
    }
}

/// Runs one simulation.
pub fn simulate(cfg: SimConfig) -> Result<SimReport, String> {
    Sim::new(cfg)?.run()
}

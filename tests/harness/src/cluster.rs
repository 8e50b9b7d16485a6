//! The scenario API: one simulated Envoy process with N worker VMs and a
//! singleton over one shared-data store, a manual clock, scripted upstreams.
//!
//! Everything runs on the test's thread, one callback at a time, so a test
//! decides every interleaving: which VM runs next, when the clock moves, when
//! an http call answers, and (with [`Cluster::before_shared_set`]) what
//! another VM does between a module's read and its write.

use crate::abi::{Headers, ACTION_CONTINUE};
use crate::http_call::{HttpCallReply, HttpCallRequest};
use crate::vm_state::{Callback, Crossings, Deferred, LocalReply, Stream, VmState};
use crate::world::{Delivered, World};
use anyhow::{anyhow, bail, Context as _, Result};
use std::cell::{Cell, RefCell};
use std::collections::{HashMap, HashSet, VecDeque};
use std::path::{Path, PathBuf};
use std::rc::Rc;
use std::sync::{Mutex, OnceLock};
use std::time::Duration;
use wasmtime::{Engine, Instance, Linker, Module, Store, TypedFunc};

/// How one VM is created: Envoy's `vm_config` + plugin `configuration`.
#[derive(Clone, Debug)]
pub struct VmSpec {
    /// Label for logs and errors, e.g. `worker-0`, `collector`.
    pub name: String,
    pub wasm: PathBuf,
    pub vm_id: String,
    pub root_id: String,
    pub vm_config: Vec<u8>,
    pub plugin_config: Vec<u8>,
    /// Envoy's `allow_on_headers_stop_iteration` (HTTP filter config).
    pub allow_on_headers_stop_iteration: bool,
    /// Envoy's `per_connection_buffer_limit_bytes`; default 1 MiB.
    pub buffer_limit_bytes: usize,
    /// `vm_config.environment_variables`.
    pub env: Vec<(String, String)>,
    /// Seed of WASI `random_get`.
    pub seed: u64,
}

impl VmSpec {
    pub fn new(name: &str, wasm: &Path, vm_id: &str, root_id: &str, config: &str) -> VmSpec {
        VmSpec {
            name: name.to_string(),
            wasm: wasm.to_path_buf(),
            vm_id: vm_id.to_string(),
            root_id: root_id.to_string(),
            vm_config: Vec::new(),
            plugin_config: config.as_bytes().to_vec(),
            allow_on_headers_stop_iteration: true,
            buffer_limit_bytes: 1 << 20,
            env: Vec::new(),
            seed: 0x006b_7672_6f75_7465,
        }
    }
    pub fn allow_on_headers_stop_iteration(mut self, allow: bool) -> VmSpec {
        self.allow_on_headers_stop_iteration = allow;
        self
    }
    pub fn buffer_limit_bytes(mut self, bytes: usize) -> VmSpec {
        self.buffer_limit_bytes = bytes;
        self
    }
    pub fn vm_config(mut self, config: &str) -> VmSpec {
        self.vm_config = config.as_bytes().to_vec();
        self
    }
}

/// The order of the three end-of-stream callbacks. Envoy does not promise
/// one: `on_done` comes from the filter's onDestroy and `on_log` from the
/// access-log pass, and their order has changed between versions.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EndOrder {
    DoneLogDelete,
    LogDoneDelete,
}

/// One HTTP stream: the VM it runs on and its context id.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Req {
    pub vm: usize,
    pub context: u32,
}

/// Result of creating a VM.
#[derive(Clone, Copy, Debug)]
pub struct VmStarted {
    pub index: usize,
    /// `proxy_on_vm_start` returned true.
    pub vm_started: bool,
    /// `proxy_on_configure` returned true.
    pub configured: bool,
}

struct Exports {
    on_context_create: Option<TypedFunc<(i32, i32), ()>>,
    on_vm_start: Option<TypedFunc<(i32, i32), i32>>,
    on_configure: Option<TypedFunc<(i32, i32), i32>>,
    on_tick: Option<TypedFunc<i32, ()>>,
    on_queue_ready: Option<TypedFunc<(i32, i32), ()>>,
    on_request_headers: Option<TypedFunc<(i32, i32, i32), i32>>,
    on_request_body: Option<TypedFunc<(i32, i32, i32), i32>>,
    on_response_headers: Option<TypedFunc<(i32, i32, i32), i32>>,
    on_response_body: Option<TypedFunc<(i32, i32, i32), i32>>,
    on_done: Option<TypedFunc<i32, i32>>,
    on_log: Option<TypedFunc<i32, ()>>,
    on_delete: Option<TypedFunc<i32, ()>>,
    on_http_call_response: Option<TypedFunc<CallResponseArgs, ()>>,
}

/// (context, token, header count, body bytes, trailer count)
type CallResponseArgs = (i32, i32, i32, i32, i32);

impl Exports {
    fn new(instance: &Instance, store: &mut Store<VmState>) -> Exports {
        macro_rules! f {
            ($name:literal) => {
                instance.get_typed_func(&mut *store, $name).ok()
            };
        }
        Exports {
            on_context_create: f!("proxy_on_context_create"),
            on_vm_start: f!("proxy_on_vm_start"),
            on_configure: f!("proxy_on_configure"),
            on_tick: f!("proxy_on_tick"),
            on_queue_ready: f!("proxy_on_queue_ready"),
            on_request_headers: f!("proxy_on_request_headers"),
            on_request_body: f!("proxy_on_request_body"),
            on_response_headers: f!("proxy_on_response_headers"),
            on_response_body: f!("proxy_on_response_body"),
            on_done: f!("proxy_on_done"),
            on_log: f!("proxy_on_log"),
            on_delete: f!("proxy_on_delete"),
            on_http_call_response: f!("proxy_on_http_call_response"),
        }
    }
}

struct Vm {
    store: Store<VmState>,
    ex: Exports,
    failed: Option<String>,
}

/// One engine for the whole test process; modules compiled once per path.
/// With the `perfmap` feature, `KVROUTE_PERFMAP` set makes wasmtime write a
/// perf map, so `perf` names the module's functions (`wasm-perf/run.sh`).
fn engine() -> &'static Engine {
    static ENGINE: OnceLock<Engine> = OnceLock::new();
    #[cfg(feature = "perfmap")]
    if std::env::var_os("KVROUTE_PERFMAP").is_some() {
        return ENGINE.get_or_init(|| {
            let mut c = wasmtime::Config::new();
            c.profiler(wasmtime::ProfilingStrategy::PerfMap);
            Engine::new(&c).expect("wasmtime engine with the perf map profiler")
        });
    }
    ENGINE.get_or_init(Engine::default)
}

fn module(path: &Path) -> Result<Module> {
    static MODULES: OnceLock<Mutex<HashMap<PathBuf, Module>>> = OnceLock::new();
    let cache = MODULES.get_or_init(|| Mutex::new(HashMap::new()));
    let mut cache = cache.lock().map_err(|_| anyhow!("module cache poisoned"))?;
    if let Some(m) = cache.get(path) {
        return Ok(m.clone());
    }
    let bytes = std::fs::read(path).with_context(|| {
        format!(
            "cannot read wasm module {}: build it first (see tests/harness/README.md)",
            path.display()
        )
    })?;
    let m = compile_cached(&bytes)
        .map_err(|e| anyhow!("{} is not a valid wasm module: {e:?}", path.display()))?;
    cache.insert(path.to_path_buf(), m.clone());
    Ok(m)
}

/// Compiles `wasm`, reusing machine code compiled by an earlier test
/// process (Cranelift in a debug build takes tens of seconds on a large
/// module). The code is kept under `<target>/harness-module-cache/`, keyed by
/// a hash of the wasm bytes; wasmtime refuses a file made by another
/// version or configuration, and the harness then compiles afresh.
fn compile_cached(wasm: &[u8]) -> wasmtime::Result<Module> {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    wasm.hash(&mut h);
    let dir = crate::artifacts::target_dir().join("harness-module-cache");
    let file = dir.join(format!("{:016x}-{}.cwasm", h.finish(), wasm.len()));
    if file.is_file() {
        // SAFETY: the file was written by `Module::serialize` below, into our
        // own target dir; wasmtime checks its version and config header.
        if let Ok(m) = unsafe { Module::deserialize_file(engine(), &file) } {
            return Ok(m);
        }
    }
    let m = Module::new(engine(), wasm)?;
    if let Ok(bytes) = m.serialize() {
        let tmp = file.with_extension(format!("tmp{}", std::process::id()));
        if std::fs::create_dir_all(&dir).is_ok() && std::fs::write(&tmp, bytes).is_ok() {
            let _ = std::fs::rename(&tmp, &file);
        }
    }
    Ok(m)
}

struct Inner {
    world: Rc<RefCell<World>>,
    vms: RefCell<Vec<Rc<RefCell<Vm>>>>,
    names: RefCell<Vec<String>>,
    end_order: Cell<EndOrder>,
    depth: Cell<u32>,
    /// Streams that ended, newest last (bounded), for inspection.
    finished: RefCell<(HashMap<Req, Stream>, VecDeque<Req>)>,
}

/// A simulated Envoy process. Cheap to clone (a handle).
#[derive(Clone)]
pub struct Cluster(Rc<Inner>);

const FINISHED_KEPT: usize = 4096;

impl Default for Cluster {
    fn default() -> Self {
        Cluster::new()
    }
}

impl Cluster {
    pub fn new() -> Cluster {
        Cluster(Rc::new(Inner {
            world: Rc::new(RefCell::new(World::new())),
            vms: RefCell::new(Vec::new()),
            names: RefCell::new(Vec::new()),
            end_order: Cell::new(EndOrder::DoneLogDelete),
            depth: Cell::new(0),
            finished: RefCell::new((HashMap::new(), VecDeque::new())),
        }))
    }

    // ---- VMs -----------------------------------------------------------------

    /// Loads the module, runs `_initialize`, creates the root context, then
    /// `proxy_on_vm_start` and `proxy_on_configure`, as Envoy does.
    pub fn add_vm(&self, spec: VmSpec) -> Result<VmStarted> {
        let module = module(&spec.wasm)?;
        let index = self.0.vms.borrow().len();
        let mut linker: Linker<VmState> = Linker::new(engine());
        crate::env_imports::add_to_linker(&mut linker)?;
        crate::wasi::add_to_linker(&mut linker)?;
        let state = VmState {
            index,
            name: spec.name.clone(),
            vm_id: spec.vm_id.clone(),
            root_id: spec.root_id.clone(),
            root_context: 0,
            next_context: 0,
            vm_config: spec.vm_config.clone(),
            plugin_config: spec.plugin_config.clone(),
            allow_on_headers_stop_iteration: spec.allow_on_headers_stop_iteration,
            buffer_limit_bytes: spec.buffer_limit_bytes,
            world: self.0.world.clone(),
            contexts: HashSet::new(),
            current: 0,
            effective: 0,
            callback: Callback::Initialize,
            streams: HashMap::new(),
            call_response: None,
            tick_period_ms: 0,
            next_tick_ns: None,
            deferred: Vec::new(),
            stop_iteration: false,
            properties: HashMap::new(),
            metric_ids: HashMap::new(),
            next_metric_id: [0, 1, 2],
            rng: spec.seed ^ (index as u64).wrapping_mul(0x9E37_79B9),
            env: spec.env.clone(),
            status: (0, String::new()),
            memory: None,
            alloc: None,
            crossings: Crossings::default(),
        };
        let mut store = Store::new(engine(), state);
        store.call_hook(|mut ctx, hook| {
            let c = &mut ctx.data_mut().crossings;
            match hook {
                wasmtime::CallHook::CallingWasm => c.entries += 1,
                wasmtime::CallHook::CallingHost => c.host_calls += 1,
                _ => {}
            }
            Ok(())
        });
        let instance = linker.instantiate(&mut store, &module).map_err(|e| {
            anyhow!(
                "module {} does not link against the harness host (Envoy's ABI 0.2.1 + WASI subset): {e:?}",
                spec.wasm.display()
            )
        })?;
        if instance
            .get_func(&mut store, "proxy_abi_version_0_2_1")
            .is_none()
        {
            bail!(
                "module {} does not export proxy_abi_version_0_2_1; this host speaks ABI 0.2.1 only",
                spec.wasm.display()
            );
        }
        let memory = instance
            .get_memory(&mut store, "memory")
            .ok_or_else(|| anyhow!("module exports no memory"))?;
        let alloc = instance
            .get_typed_func::<i32, i32>(&mut store, "proxy_on_memory_allocate")
            .or_else(|_| instance.get_typed_func::<i32, i32>(&mut store, "malloc"))
            .map_err(|_| anyhow!("module exports neither proxy_on_memory_allocate nor malloc"))?;
        store.data_mut().memory = Some(memory);
        store.data_mut().alloc = Some(alloc);
        let ex = Exports::new(&instance, &mut store);
        let init = instance
            .get_typed_func::<(), ()>(&mut store, "_initialize")
            .or_else(|_| instance.get_typed_func::<(), ()>(&mut store, "_start"))
            .ok();
        self.0.vms.borrow_mut().push(Rc::new(RefCell::new(Vm {
            store,
            ex,
            failed: None,
        })));
        self.0.names.borrow_mut().push(spec.name.clone());
        if let Some(init) = init {
            self.call(index, 0, Callback::Initialize, "_initialize", |vm| {
                init.call(&mut vm.store, ())
            })?;
        }
        // Root context: the first context id of the VM.
        let root = {
            let vm = self.vm(index)?;
            let mut vm = vm.borrow_mut();
            let s = vm.store.data_mut();
            s.next_context += 1;
            s.root_context = s.next_context;
            s.contexts.insert(s.root_context);
            s.root_context
        };
        self.call(
            index,
            root,
            Callback::ContextCreate,
            "proxy_on_context_create",
            |vm| match vm.ex.on_context_create.clone() {
                Some(f) => f.call(&mut vm.store, (root as i32, 0)),
                None => Ok(()),
            },
        )?;
        let vm_config_len = spec.vm_config.len() as i32;
        let vm_started =
            self.call(
                index,
                root,
                Callback::VmStart,
                "proxy_on_vm_start",
                |vm| match vm.ex.on_vm_start.clone() {
                    Some(f) => f
                        .call(&mut vm.store, (root as i32, vm_config_len))
                        .map(|r| r != 0),
                    None => Ok(true),
                },
            )?;
        let configured = if vm_started {
            self.configure(index, &spec.plugin_config)?
        } else {
            false
        };
        self.pump()?;
        Ok(VmStarted {
            index,
            vm_started,
            configured,
        })
    }

    /// Calls `proxy_on_configure` on the VM's root context with `config`
    /// (a config update); returns what the module answered.
    pub fn configure(&self, vm: usize, config: &[u8]) -> Result<bool> {
        let root = {
            let v = self.vm(vm)?;
            let mut v = v.borrow_mut();
            let s = v.store.data_mut();
            s.plugin_config = config.to_vec();
            s.root_context
        };
        let len = config.len() as i32;
        let ok = self.call(
            vm,
            root,
            Callback::Configure,
            "proxy_on_configure",
            |v| match v.ex.on_configure.clone() {
                Some(f) => f.call(&mut v.store, (root as i32, len)).map(|r| r != 0),
                None => Ok(true),
            },
        )?;
        self.pump()?;
        Ok(ok)
    }

    fn vm(&self, index: usize) -> Result<Rc<RefCell<Vm>>> {
        self.0
            .vms
            .borrow()
            .get(index)
            .cloned()
            .ok_or_else(|| anyhow!("harness misuse: no VM with index {index}"))
    }

    pub fn vm_count(&self) -> usize {
        self.0.vms.borrow().len()
    }

    /// Calls across VM `vm`'s boundary so far (see [`Crossings`]).
    pub fn crossings(&self, vm: usize) -> Result<Crossings> {
        Ok(self.vm(vm)?.borrow().store.data().crossings)
    }

    /// Takes VM `vm` away, as Envoy does when it drains a worker or a VM
    /// dies: it gets no more callbacks (ticks, call answers, requests).
    pub fn stop_vm(&self, vm: usize) -> Result<()> {
        self.vm(vm)?.borrow_mut().failed = Some("stopped by the test".into());
        Ok(())
    }

    /// Why the VM failed (a trap), if it did.
    pub fn vm_failure(&self, vm: usize) -> Option<String> {
        self.vm(vm).ok()?.borrow().failed.clone()
    }

    /// Runs one module callback on `vm` with `context` current, collects the
    /// effects Envoy defers to after the call, and applies them.
    fn call<T>(
        &self,
        vm: usize,
        context: u32,
        callback: Callback,
        export: &str,
        f: impl FnOnce(&mut Vm) -> wasmtime::Result<T>,
    ) -> Result<T> {
        let (value, deferred) = self.call_raw(vm, context, callback, export, f)?;
        self.apply(vm, deferred)?;
        Ok(value.0)
    }

    /// Like `call`, but returns the deferred effects and whether a local
    /// reply forced a stop, without applying them.
    fn call_raw<T>(
        &self,
        vm: usize,
        context: u32,
        callback: Callback,
        export: &str,
        f: impl FnOnce(&mut Vm) -> wasmtime::Result<T>,
    ) -> Result<((T, bool), Vec<Deferred>)> {
        let rc = self.vm(vm)?;
        let mut guard = rc.try_borrow_mut().map_err(|_| {
            anyhow!("harness misuse: VM {vm} is already inside a callback (a hook re-entered it; a worker VM runs one callback at a time)")
        })?;
        let v = &mut *guard;
        if let Some(why) = &v.failed {
            bail!(
                "module: VM {} failed earlier and Envoy would not call it again: {why}",
                v.store.data().name
            );
        }
        {
            let s = v.store.data_mut();
            s.current = context;
            s.effective = 0;
            s.callback = callback;
            s.stop_iteration = false;
        }
        self.0.depth.set(self.0.depth.get() + 1);
        let result = f(v);
        self.0.depth.set(self.0.depth.get() - 1);
        let s = v.store.data_mut();
        let deferred = std::mem::take(&mut s.deferred);
        let stop = std::mem::replace(&mut s.stop_iteration, false);
        s.callback = Callback::None;
        s.current = 0;
        s.effective = 0;
        s.call_response = None;
        match result {
            Ok(value) => Ok(((value, stop), deferred)),
            Err(trap) => {
                let name = s.name.clone();
                let tail = self.0.world.borrow().tail(&name, 8).join("\n    ");
                let why = format!("trap in {export} (context {context}): {trap:?}\n  last module log lines:\n    {tail}");
                v.failed = Some(why.clone());
                bail!("module: VM {name} {why}")
            }
        }
    }

    // ---- shared data, clock, scripts, hooks ---------------------------------

    pub fn world(&self) -> std::cell::RefMut<'_, World> {
        self.0.world.borrow_mut()
    }

    pub fn shared_get(&self, vm_id: &str, key: &str) -> Option<Vec<u8>> {
        self.0.world.borrow().shared.get(vm_id, key).map(|(v, _)| v)
    }

    pub fn shared_get_str(&self, vm_id: &str, key: &str) -> Option<String> {
        self.shared_get(vm_id, key)
            .map(|v| String::from_utf8_lossy(&v).into_owned())
    }

    pub fn shared_keys(&self, vm_id: &str) -> Vec<String> {
        self.0.world.borrow().shared.keys(vm_id)
    }

    /// Bytes (keys + values) one vm_id holds in shared data.
    pub fn shared_bytes(&self, vm_id: &str) -> usize {
        self.0.world.borrow().shared.bytes_held(vm_id)
    }

    /// Writes shared data as an outside party would (cas 0, unconditional).
    pub fn shared_set(&self, vm_id: &str, key: &str, value: &[u8]) {
        self.0.world.borrow_mut().shared.set(vm_id, key, value, 0);
    }

    /// The next `count` conditional sets on keys starting with `key_prefix`
    /// fail with CasMismatch (an invisible concurrent writer).
    pub fn force_cas_mismatch(&self, vm_id: &str, key_prefix: &str, count: u32) {
        self.0
            .world
            .borrow_mut()
            .shared
            .force_cas_mismatch(vm_id, key_prefix, count);
    }

    pub fn cas_mismatches(&self) -> u64 {
        self.0.world.borrow().shared.cas_mismatches
    }

    /// Runs `action` once, inside `vm`'s next `proxy_set_shared_data` on a key
    /// starting with `key_prefix`, before that set is applied. The action
    /// may drive other VMs: this is how two VMs decide "at the same instant".
    pub fn before_shared_set(
        &self,
        vm: usize,
        key_prefix: &str,
        action: impl FnOnce(&Cluster) + 'static,
    ) {
        let me = self.clone();
        self.0
            .world
            .borrow_mut()
            .set_hooks
            .push(crate::world::SetHook {
                vm,
                key_prefix: key_prefix.to_string(),
                action: Box::new(move || action(&me)),
            });
    }

    /// Hooks installed and not yet fired.
    pub fn pending_hooks(&self) -> usize {
        self.0.world.borrow().set_hooks.len()
    }

    pub fn now_ns(&self) -> u64 {
        self.0.world.borrow().now_ns
    }

    pub fn set_end_order(&self, order: EndOrder) {
        self.0.end_order.set(order);
    }

    /// Answers every future `dispatch_http_call`. Without one, calls hang.
    pub fn set_http_responder(&self, f: impl FnMut(&HttpCallRequest) -> HttpCallReply + 'static) {
        self.0.world.borrow_mut().responder = Some(Box::new(f));
    }

    /// Limits the upstream clusters Envoy knows (others → BadArgument).
    pub fn set_known_clusters(&self, names: &[&str]) {
        self.0.world.borrow_mut().known_clusters =
            Some(names.iter().map(|s| s.to_string()).collect());
    }

    pub fn register_foreign_function(
        &self,
        name: &str,
        f: impl FnMut(&[u8]) -> Result<Vec<u8>, crate::abi::Status> + 'static,
    ) {
        self.0
            .world
            .borrow_mut()
            .foreign
            .insert(name.to_string(), Box::new(f));
    }

    /// Sets a property `get_property` returns (path segments joined by '.').
    pub fn set_property(&self, vm: usize, path: &str, value: &[u8]) -> Result<()> {
        let v = self.vm(vm)?;
        v.borrow_mut()
            .store
            .data_mut()
            .properties
            .insert(path.to_string(), value.to_vec());
        Ok(())
    }

    /// Calls the module made that have not been answered yet.
    pub fn pending_http_calls(&self) -> Vec<HttpCallRequest> {
        self.0
            .world
            .borrow()
            .calls
            .iter()
            .map(|c| c.request.clone())
            .collect()
    }

    pub fn metric(&self, name: &str) -> Option<i64> {
        self.0.world.borrow().metrics.get(name).map(|m| m.value)
    }

    /// Samples recorded into a histogram (`None`: not defined).
    pub fn metric_samples(&self, name: &str) -> Option<u64> {
        self.0.world.borrow().metrics.get(name).map(|m| m.samples)
    }

    /// Log lines (kept ones) containing `needle`, as "vm: message".
    pub fn logs_matching(&self, needle: &str) -> Vec<String> {
        self.0
            .world
            .borrow()
            .logs
            .iter()
            .filter(|l| l.message.contains(needle))
            .map(|l| format!("{}: {}", l.vm, l.message))
            .collect()
    }

    /// Lines logged at `level` (0 trace … 5 critical), dropped ones included.
    pub fn log_count(&self, level: u32) -> u64 {
        self.0.world.borrow().log_counts[level.min(5) as usize]
    }

    pub fn late_header_writes(&self) -> u64 {
        self.0.world.borrow().late_header_writes
    }

    /// Moves the manual clock forward, delivering due http-call answers and
    /// ticks in time order (answers before ticks at the same instant).
    pub fn advance(&self, by: Duration) -> Result<()> {
        let target = self.now_ns() + by.as_nanos() as u64;
        loop {
            let next_call = {
                let w = self.0.world.borrow();
                w.calls
                    .iter()
                    .enumerate()
                    .filter_map(|(i, c)| c.due_ns.map(|d| (d, c.token, i)))
                    .min()
            };
            let next_tick = (0..self.vm_count())
                .filter_map(|i| {
                    let v = self.vm(i).ok()?;
                    let v = v.borrow();
                    if v.failed.is_some() {
                        return None;
                    }
                    v.store.data().next_tick_ns.map(|t| (t, i))
                })
                .min();
            match (next_call, next_tick) {
                (Some((t, _, i)), tick) if t <= target && tick.is_none_or(|(tt, _)| t <= tt) => {
                    self.0.world.borrow_mut().now_ns = t.max(self.now_ns());
                    let call = self.0.world.borrow_mut().calls.remove(i);
                    self.deliver_call(call)?;
                }
                (_, Some((t, vm))) if t <= target => {
                    self.0.world.borrow_mut().now_ns = t.max(self.now_ns());
                    self.fire_tick(vm)?;
                }
                _ => {
                    self.0.world.borrow_mut().now_ns = target;
                    break;
                }
            }
            self.pump()?;
        }
        Ok(())
    }

    /// Fires `proxy_on_tick` on `vm` now, whatever its period.
    pub fn tick(&self, vm: usize) -> Result<()> {
        self.fire_tick(vm)?;
        self.pump()
    }

    fn fire_tick(&self, vm: usize) -> Result<()> {
        let now = self.now_ns();
        let root = {
            let v = self.vm(vm)?;
            let mut v = v.borrow_mut();
            let s = v.store.data_mut();
            let period = s.tick_period_ms as u64;
            s.next_tick_ns = (period > 0).then(|| now + period * 1_000_000);
            s.root_context
        };
        self.call(vm, root, Callback::Tick, "proxy_on_tick", |v| {
            match v.ex.on_tick.clone() {
                Some(f) => f.call(&mut v.store, root as i32),
                None => Ok(()),
            }
        })
    }

    fn deliver_call(&self, call: crate::world::PendingCall) -> Result<()> {
        let (headers, body, trailers, status) = match &call.reply {
            Delivered::Response(h, b, t) => (h.len(), b.len(), t.len(), (0, String::new())),
            Delivered::Failure => (0, 0, 0, (11, "reset".to_string())),
        };
        {
            let v = self.vm(call.vm)?;
            let mut v = v.borrow_mut();
            if v.failed.is_some() {
                return Ok(()); // the VM is gone: so are its calls
            }
            let s = v.store.data_mut();
            s.status = status;
            if !s.contexts.contains(&call.context) {
                return Ok(()); // the context is gone: Envoy cancelled the call
            }
        }
        let reply = call.reply.clone();
        let ctx = call.context;
        self.call(
            call.vm,
            ctx,
            Callback::HttpCallResponse,
            "proxy_on_http_call_response",
            |v| {
                v.store.data_mut().call_response = Some(reply);
                match v.ex.on_http_call_response.clone() {
                    Some(f) => f.call(
                        &mut v.store,
                        (
                            ctx as i32,
                            call.token as i32,
                            headers as i32,
                            body as i32,
                            trailers as i32,
                        ),
                    ),
                    None => Ok(()),
                }
            },
        )
    }

    /// Delivers `proxy_on_queue_ready` wake-ups Envoy would have posted.
    /// Runs after every top-level step, never inside a callback.
    fn pump(&self) -> Result<()> {
        if self.0.depth.get() > 0 {
            return Ok(());
        }
        loop {
            let next = self.0.world.borrow_mut().queues.pending_ready.pop_front();
            let Some((owner, token)) = next else {
                return Ok(());
            };
            let root = owner.root_context;
            self.call(
                owner.vm,
                root,
                Callback::QueueReady,
                "proxy_on_queue_ready",
                |v| match v.ex.on_queue_ready.clone() {
                    Some(f) => f.call(&mut v.store, (root as i32, token as i32)),
                    None => Ok(()),
                },
            )?;
        }
    }

    // ---- HTTP streams --------------------------------------------------------

    fn with_stream<T>(&self, req: Req, f: impl FnOnce(&mut Stream, &VmState) -> T) -> Result<T> {
        let v = self.vm(req.vm)?;
        let mut v = v.borrow_mut();
        let s = v.store.data_mut();
        let mut stream = s
            .streams
            .remove(&req.context)
            .ok_or_else(|| anyhow!("harness misuse: stream {req:?} does not exist or has ended"))?;
        let out = f(&mut stream, s);
        s.streams.insert(req.context, stream);
        Ok(out)
    }

    /// The stream's state now (or at its end, for the last few thousand).
    pub fn stream(&self, req: Req) -> Option<Stream> {
        if let Ok(s) = self.with_stream(req, |s, _| s.clone()) {
            return Some(s);
        }
        self.0.finished.borrow().0.get(&req).cloned()
    }

    /// The request headers the router saw, once the module let them go.
    pub fn upstream_headers(&self, req: Req) -> Option<Headers> {
        self.stream(req)?.upstream_request_headers
    }

    pub fn upstream_header(&self, req: Req, name: &str) -> Option<String> {
        let find = |s: &Stream| {
            s.upstream_request_headers
                .as_ref()?
                .iter()
                .find(|(k, _)| k == name)
                .map(|(_, v)| v.clone())
        };
        match self.with_stream(req, |s, _| find(s)) {
            Ok(v) => v,
            Err(_) => self.0.finished.borrow().0.get(&req).and_then(find),
        }
    }

    /// Status the client got, if any.
    pub fn downstream_status(&self, req: Req) -> Option<u16> {
        let s = self.stream(req)?;
        s.downstream_headers?
            .iter()
            .find(|(k, _)| k == ":status")
            .and_then(|(_, v)| v.parse().ok())
    }

    pub fn is_ended(&self, req: Req) -> bool {
        match self.with_stream(req, |s, _| s.ended) {
            Ok(ended) => ended,
            // Context ids are never reused: a past stream id that is no
            // longer live has ended.
            Err(_) => self.vm(req.vm).is_ok_and(|v| {
                let v = v.borrow();
                let s = v.store.data();
                req.context != s.root_context && req.context <= s.next_context
            }),
        }
    }

    /// A new stream on `vm`: creates its context and delivers the headers.
    pub fn start_request(
        &self,
        vm: usize,
        headers: &[(&str, &str)],
        end_of_stream: bool,
    ) -> Result<Req> {
        let (context, root) = {
            let v = self.vm(vm)?;
            let mut v = v.borrow_mut();
            let s = v.store.data_mut();
            s.next_context += 1;
            let id = s.next_context;
            s.contexts.insert(id);
            s.streams.insert(
                id,
                Stream {
                    request_headers: headers
                        .iter()
                        .map(|(k, v)| (k.to_ascii_lowercase(), v.to_string()))
                        .collect(),
                    request_end_seen: end_of_stream,
                    ..Default::default()
                },
            );
            (id, s.root_context)
        };
        let req = Req { vm, context };
        self.call(
            vm,
            context,
            Callback::ContextCreate,
            "proxy_on_context_create",
            |v| match v.ex.on_context_create.clone() {
                Some(f) => f.call(&mut v.store, (context as i32, root as i32)),
                None => Ok(()),
            },
        )?;
        let n = headers.len() as i32;
        let ((action, stop), deferred) = self.call_raw(
            vm,
            context,
            Callback::RequestHeaders,
            "proxy_on_request_headers",
            |v| match v.ex.on_request_headers.clone() {
                Some(f) => f.call(&mut v.store, (context as i32, n, end_of_stream as i32)),
                None => Ok(ACTION_CONTINUE),
            },
        )?;
        if !stop {
            if action == ACTION_CONTINUE {
                self.forward_request(req)?;
            } else {
                self.with_stream(req, |s, vs| {
                    s.decoding_paused = true;
                    // Without the flag Envoy turns StopIteration into
                    // StopAllIterationAndWatermark: no body callbacks until continue.
                    s.stopped_all = !vs.allow_on_headers_stop_iteration;
                })?;
            }
        }
        self.apply(vm, deferred)?;
        self.pump()?;
        Ok(req)
    }

    /// POST with a JSON body in one chunk: the common case.
    pub fn post(&self, vm: usize, path: &str, body: &[u8]) -> Result<Req> {
        let len = body.len().to_string();
        let req = self.start_request(
            vm,
            &[
                (":method", "POST"),
                (":path", path),
                (":authority", "kvroute.test"),
                (":scheme", "http"),
                ("content-type", "application/json"),
                ("content-length", &len),
            ],
            body.is_empty(),
        )?;
        if !body.is_empty() && !self.is_ended(req) {
            self.send_body(req, body, true)?;
        }
        Ok(req)
    }

    /// The client sends a body chunk.
    pub fn send_body(&self, req: Req, chunk: &[u8], end_of_stream: bool) -> Result<()> {
        let held = self.with_stream(req, |s, _| {
            if s.request_end_seen || s.held_chunks.iter().any(|(_, end)| *end) {
                return Err(anyhow!(
                    "harness misuse: body after the end of stream of {req:?}"
                ));
            }
            if s.stopped_all && s.decoding_paused {
                s.held_chunks.push_back((chunk.to_vec(), end_of_stream));
                return Ok(true);
            }
            Ok(false)
        })??;
        if !held {
            self.deliver_request_body(req, chunk, end_of_stream)?;
        }
        self.pump()
    }

    fn deliver_request_body(&self, req: Req, chunk: &[u8], eos: bool) -> Result<()> {
        let (len, forwarded_all) = self.with_stream(req, |s, _| {
            s.request_body.extend_from_slice(chunk);
            s.request_body_visible = true;
            s.request_end_seen |= eos;
            (s.request_body.len(), s.request_complete_upstream)
        })?;
        if forwarded_all {
            bail!("harness misuse: body after the request completed");
        }
        let ctx = req.context;
        let ((action, stop), deferred) = self.call_raw(
            req.vm,
            ctx,
            Callback::RequestBody,
            "proxy_on_request_body",
            |v| match v.ex.on_request_body.clone() {
                Some(f) => f.call(&mut v.store, (ctx as i32, len as i32, eos as i32)),
                None => Ok(ACTION_CONTINUE),
            },
        )?;
        if !stop {
            if action == ACTION_CONTINUE {
                self.forward_request(req)?;
            } else {
                // StopIterationAndBuffer: Envoy keeps buffering, up to the limit.
                let over = self.with_stream(req, |s, vs| {
                    s.decoding_paused = true;
                    s.request_body.len() > vs.buffer_limit_bytes
                })?;
                if over {
                    self.apply(req.vm, deferred)?;
                    return self.envoy_local_reply(req, 413, "Payload Too Large");
                }
            }
        }
        self.apply(req.vm, deferred)
    }

    /// Headers (if not yet) and the buffered body go upstream.
    fn forward_request(&self, req: Req) -> Result<()> {
        self.with_stream(req, |s, _| {
            if !s.request_headers_forwarded {
                s.request_headers_forwarded = true;
                s.upstream_request_headers = Some(s.request_headers.clone());
            }
            let body = std::mem::take(&mut s.request_body);
            s.upstream_body.extend_from_slice(&body);
            s.request_body_visible = false;
            s.decoding_paused = false;
            s.stopped_all = false;
            if s.request_end_seen {
                s.request_complete_upstream = true;
            }
        })
    }

    /// Effects the module asked for during a callback, applied after it.
    fn apply(&self, vm: usize, deferred: Vec<Deferred>) -> Result<()> {
        for d in deferred {
            match d {
                Deferred::ContinueRequest(ctx) => {
                    let req = Req { vm, context: ctx };
                    let live = self.with_stream(req, |s, _| {
                        !s.ended && !s.reset && s.downstream_headers.is_none()
                    });
                    if !live.unwrap_or(false) {
                        continue;
                    }
                    self.forward_request(req)?;
                    let held: Vec<_> =
                        self.with_stream(req, |s, _| s.held_chunks.drain(..).collect())?;
                    for (chunk, eos) in held {
                        self.deliver_request_body(req, &chunk, eos)?;
                    }
                }
                Deferred::ContinueResponse(ctx) => {
                    let req = Req { vm, context: ctx };
                    let done = self.with_stream(req, |s, _| {
                        Self::forward_response(s);
                        s.response_complete
                    });
                    if done.unwrap_or(false) {
                        self.end_stream(req)?;
                    }
                }
                Deferred::LocalReply(ctx, reply) => {
                    let req = Req { vm, context: ctx };
                    self.local_reply(req, reply)?;
                }
                Deferred::ResetStream(ctx) => {
                    let req = Req { vm, context: ctx };
                    if self.with_stream(req, |s, _| s.reset = true).is_ok() {
                        self.end_stream(req)?;
                    }
                }
            }
        }
        Ok(())
    }

    fn forward_response(s: &mut Stream) {
        if !s.response_headers_forwarded {
            if let Some(h) = &s.response_headers {
                s.response_headers_forwarded = true;
                s.downstream_headers = Some(h.clone());
            }
        }
        let body = std::mem::take(&mut s.response_body);
        s.downstream_body.extend_from_slice(&body);
        s.response_body_visible = false;
        s.encoding_paused = false;
    }

    /// The upstream answers with headers.
    pub fn respond_headers(
        &self,
        req: Req,
        status: u16,
        headers: &[(&str, &str)],
        end_of_stream: bool,
    ) -> Result<()> {
        let ok = self.with_stream(req, |s, _| {
            s.request_headers_forwarded && s.response_headers.is_none() && !s.ended
        })?;
        if !ok {
            bail!("harness misuse: upstream cannot answer {req:?}: its request headers never went upstream (the module paused and did not continue), or it already has a response");
        }
        let mut h: Headers = vec![(":status".to_string(), status.to_string())];
        h.extend(
            headers
                .iter()
                .map(|(k, v)| (k.to_ascii_lowercase(), v.to_string())),
        );
        self.deliver_response_headers(req, h, end_of_stream)?;
        self.pump()
    }

    /// The upstream sends a body chunk.
    pub fn respond_body(&self, req: Req, chunk: &[u8], end_of_stream: bool) -> Result<()> {
        let ok = self.with_stream(req, |s, _| s.response_headers.is_some() && !s.ended)?;
        if !ok {
            bail!("harness misuse: response body for {req:?} before response headers, or after its end");
        }
        self.deliver_response_body(req, chunk, end_of_stream)?;
        self.pump()
    }

    /// A whole 200 response: headers then `chunks`, the last one ending it.
    pub fn respond(&self, req: Req, chunks: &[&[u8]]) -> Result<()> {
        self.respond_headers(
            req,
            200,
            &[("content-type", "text/event-stream")],
            chunks.is_empty(),
        )?;
        for (i, c) in chunks.iter().enumerate() {
            if self.is_ended(req) {
                break;
            }
            self.respond_body(req, c, i + 1 == chunks.len())?;
        }
        Ok(())
    }

    fn deliver_response_headers(&self, req: Req, headers: Headers, eos: bool) -> Result<()> {
        let n = headers.len() as i32;
        self.with_stream(req, |s, _| s.response_headers = Some(headers))?;
        let ctx = req.context;
        let ((action, _stop), deferred) = self.call_raw(
            req.vm,
            ctx,
            Callback::ResponseHeaders,
            "proxy_on_response_headers",
            |v| match v.ex.on_response_headers.clone() {
                Some(f) => f.call(&mut v.store, (ctx as i32, n, eos as i32)),
                None => Ok(ACTION_CONTINUE),
            },
        )?;
        let complete = self.with_stream(req, |s, _| {
            if action == ACTION_CONTINUE {
                Self::forward_response(s);
            } else {
                s.encoding_paused = true;
            }
            if eos {
                s.response_complete = true;
            }
            s.response_complete && s.response_headers_forwarded
        })?;
        self.apply(req.vm, deferred)?;
        if complete {
            self.end_stream(req)?;
        }
        Ok(())
    }

    fn deliver_response_body(&self, req: Req, chunk: &[u8], eos: bool) -> Result<()> {
        let len = self.with_stream(req, |s, _| {
            s.response_body.extend_from_slice(chunk);
            s.response_body_visible = true;
            s.response_body.len()
        })?;
        let ctx = req.context;
        let ((action, _stop), deferred) = self.call_raw(
            req.vm,
            ctx,
            Callback::ResponseBody,
            "proxy_on_response_body",
            |v| match v.ex.on_response_body.clone() {
                Some(f) => f.call(&mut v.store, (ctx as i32, len as i32, eos as i32)),
                None => Ok(ACTION_CONTINUE),
            },
        )?;
        let complete = self.with_stream(req, |s, _| {
            if action == ACTION_CONTINUE {
                Self::forward_response(s);
            } else {
                s.encoding_paused = true;
            }
            if eos {
                s.response_complete = true;
            }
            s.response_complete && !s.encoding_paused
        })?;
        self.apply(req.vm, deferred)?;
        if complete {
            self.end_stream(req)?;
        }
        Ok(())
    }

    fn local_reply(&self, req: Req, reply: LocalReply) -> Result<()> {
        let state = self.with_stream(req, |s, _| (s.ended, s.downstream_headers.is_some()));
        let Ok((ended, headers_sent)) = state else {
            return Ok(());
        };
        if ended {
            return Ok(());
        }
        if headers_sent {
            // Too late for a reply: Envoy resets the stream.
            self.with_stream(req, |s, _| s.reset = true)?;
            return self.end_stream(req);
        }
        let mut headers: Headers = vec![
            (":status".into(), reply.status.to_string()),
            ("content-length".into(), reply.body.len().to_string()),
        ];
        if !reply.body.is_empty() {
            headers.push(("content-type".into(), "text/plain".into()));
        }
        headers.extend(reply.headers.iter().cloned());
        let body = reply.body.clone();
        self.with_stream(req, |s, _| {
            s.local_reply = Some(reply);
            s.response_headers = None;
            s.response_body.clear();
            s.decoding_paused = false;
            s.held_chunks.clear();
        })?;
        // The reply goes through the encoder path of this filter too.
        self.deliver_response_headers(req, headers, body.is_empty())?;
        if !body.is_empty() && !self.is_ended(req) {
            self.deliver_response_body(req, &body, true)?;
        }
        Ok(())
    }

    /// A reply Envoy itself makes (413, 503, 504), as seen by the filter.
    fn envoy_local_reply(&self, req: Req, status: u32, body: &str) -> Result<()> {
        self.local_reply(
            req,
            LocalReply {
                status,
                details: "envoy".into(),
                body: body.as_bytes().to_vec(),
                headers: Vec::new(),
                grpc_status: -1,
            },
        )?;
        // Not the module's reply: keep `local_reply` for the module's own.
        let _ = self.with_stream(req, |s, _| s.local_reply = None);
        if let Some(s) = self.0.finished.borrow_mut().0.get_mut(&req) {
            s.local_reply = None;
        }
        Ok(())
    }

    /// The client goes away (downstream reset), at any point.
    pub fn client_abort(&self, req: Req) -> Result<()> {
        self.with_stream(req, |s, _| s.reset = true)?;
        self.end_stream(req)?;
        self.pump()
    }

    /// The upstream resets the stream: Envoy answers 503 if the client has no
    /// response headers yet, else it resets the client.
    pub fn upstream_reset(&self, req: Req) -> Result<()> {
        self.upstream_failure(
            req,
            503,
            "upstream connect error or disconnect/reset before headers. reset reason: remote reset",
        )
    }

    /// The route timeout fires: 504 before response headers, else a reset.
    pub fn route_timeout(&self, req: Req) -> Result<()> {
        self.upstream_failure(req, 504, "upstream request timeout")
    }

    fn upstream_failure(&self, req: Req, status: u32, body: &str) -> Result<()> {
        let (forwarded, headers_sent) = self.with_stream(req, |s, _| {
            (s.request_headers_forwarded, s.downstream_headers.is_some())
        })?;
        if !forwarded {
            bail!("harness misuse: {req:?} has no upstream request yet (the module still holds the request headers)");
        }
        if headers_sent {
            self.with_stream(req, |s, _| s.reset = true)?;
            self.end_stream(req)?;
        } else {
            self.envoy_local_reply(req, status, body)?;
        }
        self.pump()
    }

    /// on_done / on_log / on_delete, once, in the cluster's end order.
    fn end_stream(&self, req: Req) -> Result<()> {
        let first = self.with_stream(req, |s, _| !std::mem::replace(&mut s.ended, true))?;
        if !first {
            return Ok(());
        }
        let ctx = req.context;
        let done = |c: &Cluster| {
            c.call(req.vm, ctx, Callback::Done, "proxy_on_done", |v| {
                match v.ex.on_done.clone() {
                    Some(f) => f.call(&mut v.store, ctx as i32).map(|_| ()),
                    None => Ok(()),
                }
            })
        };
        let log = |c: &Cluster| -> Result<()> {
            c.with_stream(req, |s, _| s.in_log_phase = true)?;
            c.call(req.vm, ctx, Callback::Log, "proxy_on_log", |v| {
                match v.ex.on_log.clone() {
                    Some(f) => f.call(&mut v.store, ctx as i32),
                    None => Ok(()),
                }
            })?;
            c.with_stream(req, |s, _| s.in_log_phase = false)
        };
        match self.0.end_order.get() {
            EndOrder::DoneLogDelete => {
                done(self)?;
                log(self)?;
            }
            EndOrder::LogDoneDelete => {
                log(self)?;
                done(self)?;
            }
        }
        self.call(
            req.vm,
            ctx,
            Callback::Delete,
            "proxy_on_delete",
            |v| match v.ex.on_delete.clone() {
                Some(f) => f.call(&mut v.store, ctx as i32),
                None => Ok(()),
            },
        )?;
        let v = self.vm(req.vm)?;
        let mut v = v.borrow_mut();
        let s = v.store.data_mut();
        s.contexts.remove(&ctx);
        if let Some(stream) = s.streams.remove(&ctx) {
            let mut f = self.0.finished.borrow_mut();
            f.0.insert(req, stream);
            f.1.push_back(req);
            if f.1.len() > FINISHED_KEPT {
                if let Some(old) = f.1.pop_front() {
                    f.0.remove(&old);
                }
            }
        }
        Ok(())
    }

    /// Streams of `vm` that have not ended.
    pub fn open_streams(&self, vm: usize) -> Vec<Req> {
        let Ok(v) = self.vm(vm) else {
            return Vec::new();
        };
        let v = v.borrow();
        let mut ids: Vec<u32> = v.store.data().streams.keys().copied().collect();
        ids.sort();
        ids.into_iter().map(|context| Req { vm, context }).collect()
    }
}

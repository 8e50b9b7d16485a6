//! Shared setup for the tests that drive the real kvroute module.

use kvroute_harness::artifacts::kvroute_wasm;
use kvroute_harness::{Cluster, Req, VmSpec};
use kvroute_shared_state::endpoints::EndpointTable;
use kvroute_shared_state::load::LoadTable;
use kvroute_shared_state::{ENDPOINTS_KEY, LOAD_KEY};

pub const VM_ID: &str = "kvroute";
pub const DEST: &str = "x-gateway-destination-endpoint";
pub const ENDPOINTS: [&str; 3] = ["10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"];

/// A plugin configuration with three static endpoints and a fixed seed;
/// `extra` is merged into the top level (its keys win).
pub fn config(extra: serde_json::Value) -> String {
    let mut doc = serde_json::json!({
        "endpoints": {"static": ENDPOINTS},
        "routing": {"seed": 7},
    });
    if let (Some(base), Some(extra)) = (doc.as_object_mut(), extra.as_object()) {
        for (k, v) in extra {
            base.insert(k.clone(), v.clone());
        }
    }
    doc.to_string()
}

/// Adds `workers` filter VMs (`worker-0`…) with `config` to `c`.
pub fn add_workers(c: &Cluster, workers: usize, config: &str) {
    let wasm = kvroute_wasm().expect("kvroute module");
    for i in 0..workers {
        let started = c
            .add_vm(VmSpec::new(
                &format!("worker-{i}"),
                &wasm,
                VM_ID,
                "kvroute",
                config,
            ))
            .expect("worker VM");
        assert!(started.configured, "worker {i} rejected the config");
    }
}

/// The collector (VM 0), then `workers` filter VMs (1..=workers), all with `config`.
pub fn fleet(workers: usize, config: &str) -> Cluster {
    let wasm = kvroute_wasm().expect("kvroute module");
    let c = Cluster::new();
    let started = c
        .add_vm(VmSpec::new(
            "collector",
            &wasm,
            VM_ID,
            "kvroute-collector",
            config,
        ))
        .expect("collector VM");
    assert!(
        started.vm_started && started.configured,
        "collector rejected the config: {:?}",
        c.logs_matching("config")
    );
    add_workers(&c, workers, config);
    c
}

/// A completions body whose prompt is `prompt`.
pub fn completion(prompt: &str, stream: bool) -> Vec<u8> {
    serde_json::json!({"model": "m", "prompt": prompt, "max_tokens": 16, "stream": stream})
        .to_string()
        .into_bytes()
}

/// A prompt of about `tokens` tokens (4 bytes per token by default) that
/// starts with `prefix`.
pub fn prompt(prefix: &str, tokens: usize) -> String {
    let mut p = prefix.to_string();
    let mut i = 0;
    while p.len() < tokens * 4 {
        p.push_str(&format!(" w{i}"));
        i += 1;
    }
    p
}

/// In-flight (tokens, requests) per endpoint address, from shared data.
pub fn inflight(c: &Cluster) -> Vec<(String, u64, u64)> {
    // Like the module: the collector's table, else the static list.
    let table = c
        .shared_get(VM_ID, ENDPOINTS_KEY)
        .and_then(|b| EndpointTable::decode(&b))
        .unwrap_or_else(|| {
            EndpointTable::from_static(&ENDPOINTS.iter().map(|a| a.to_string()).collect::<Vec<_>>())
        });
    let load = LoadTable::decode(c.shared_get(VM_ID, LOAD_KEY).as_deref());
    table
        .endpoints
        .iter()
        .map(|e| {
            let (t, r) = load
                .get(e.slot, e.generation)
                .map(|rec| (rec.inflight_tokens(), rec.inflight_requests()))
                .unwrap_or((0, 0));
            (e.address.clone(), t, r)
        })
        .collect()
}

pub fn total_inflight(c: &Cluster) -> (u64, u64) {
    inflight(c)
        .iter()
        .fold((0, 0), |(t, r), (_, a, b)| (t + a, r + b))
}

pub fn inflight_of(c: &Cluster, address: &str) -> (u64, u64) {
    inflight(c)
        .into_iter()
        .find(|(a, _, _)| a == address)
        .map(|(_, t, r)| (t, r))
        .unwrap_or((0, 0))
}

/// The primary endpoint the module chose for `req`.
pub fn primary(c: &Cluster, req: Req) -> Option<String> {
    c.upstream_header(req, DEST)
        .map(|v| v.split(',').next().unwrap_or("").to_string())
}

/// A stat the module defined, by name (Envoy shows it as `wasmcustom.<name>`).
///
/// Filter VMs hand their counts to Envoy on their tick, so the filter VMs
/// of a [`fleet`] (1..) are ticked first, as Envoy would within 200 ms.
pub fn stat(c: &Cluster, name: &str) -> i64 {
    for vm in 1..c.vm_count() {
        c.tick(vm).expect("tick");
    }
    c.metric(name)
        .or_else(|| c.metric(&format!("wasmcustom.{name}")))
        .unwrap_or(0)
}

/// CPU time this thread has used (user + system), from
/// `/proc/thread-self/stat`; `None` off Linux. Speed limits are checked on
/// CPU time so that other builds on a shared 2-core machine do not make a
/// test fail; wall time is printed beside it.
pub fn thread_cpu_time() -> Option<std::time::Duration> {
    let stat = std::fs::read_to_string("/proc/thread-self/stat").ok()?;
    // Fields after the command name (which ends with the last ')').
    let rest = &stat[stat.rfind(')')? + 2..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // utime and stime are fields 14 and 15 of the whole line, in clock ticks
    // (USER_HZ, 100 on Linux).
    let ticks: u64 = fields.get(11)?.parse::<u64>().ok()? + fields.get(12)?.parse::<u64>().ok()?;
    Some(std::time::Duration::from_millis(ticks * 10))
}

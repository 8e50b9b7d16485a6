//! Test 2 (two VMs, one instant, forced CAS conflict) and test 3 (the soak).

use crate::support::*;
use kvroute_harness::{Cluster, Req, VmSpec};
use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::Rc;

#[test]
fn two_workers_same_prefix_same_instant_with_cas_conflict() {
    let c = fleet(2, &config(serde_json::json!({})));
    let body = completion(&prompt("shared system prompt", 1500), false);
    let second: Rc<RefCell<Option<Req>>> = Rc::default();
    let slot = second.clone();
    let other_body = body.clone();
    // Worker 1 has read the load table; before its write lands, worker 2
    // makes its whole decision for the same prefix and writes first.
    c.before_shared_set(1, kvroute_shared_state::LOAD_KEY, move |c| {
        *slot.borrow_mut() = Some(c.post(2, "/v1/completions", &other_body).unwrap());
    });
    let mismatches_before = c.cas_mismatches();
    let first = c.post(1, "/v1/completions", &body).unwrap();
    let second = second.borrow().expect("the hook ran");
    assert_eq!(c.pending_hooks(), 0);
    assert!(
        c.cas_mismatches() > mismatches_before,
        "worker 1 must have hit the conflict"
    );
    assert!(primary(&c, first).is_some() && primary(&c, second).is_some());
    assert_eq!(
        total_inflight(&c).1,
        2,
        "exactly one charge each, no lost update"
    );
    // And more forced conflicts on top: still one charge per request.
    c.force_cas_mismatch(VM_ID, kvroute_shared_state::LOAD_KEY, 3);
    let third = c.post(1, "/v1/completions", &body).unwrap();
    assert!(primary(&c, third).is_some());
    assert_eq!(total_inflight(&c).1, 3);
    // Every lost race is counted: the hook's one and the three forced.
    let retries = stat(&c, "kvroute_cas_retries");
    let lost = (c.cas_mismatches() - mismatches_before) as i64;
    assert!(
        retries >= 4 && retries <= lost,
        "{retries} retries, {lost} mismatches"
    );
    for r in [first, second, third] {
        c.respond(r, &[b"{}"]).unwrap();
    }
    assert_eq!(total_inflight(&c), (0, 0));
}

#[test]
fn same_instant_conflict_on_an_index_shard() {
    let c = fleet(2, &config(serde_json::json!({})));
    // Warm the first half of the prompt; both racing requests then carry
    // the whole prompt, so both insert the new second half's groups (a
    // group already held is not rewritten, so the warm half alone would
    // give the race nothing to write).
    let warm = c
        .post(
            1,
            "/v1/completions",
            &completion(&prompt("index race", 1500), false),
        )
        .unwrap();
    c.respond(warm, &[b"{}"]).unwrap();
    let body = completion(&prompt("index race", 3000), false);
    let other = body.clone();
    c.before_shared_set(1, "kvroute/ix/", move |c| {
        c.post(2, "/v1/completions", &other).unwrap();
    });
    let before = c.cas_mismatches();
    let first = c.post(1, "/v1/completions", &body).unwrap();
    assert_eq!(c.pending_hooks(), 0, "worker 1 never wrote an index shard");
    assert!(
        c.cas_mismatches() > before,
        "worker 1 must have hit the conflict"
    );
    assert!(primary(&c, first).is_some());
    assert_eq!(total_inflight(&c).1, 2);
    // Both inserts count: a third request with the same prompt is warm
    // somewhere (it sticks to a worker's choice).
    let third = c.post(1, "/v1/completions", &body).unwrap();
    assert_eq!(primary(&c, third), primary(&c, first));
}

/// Regression (found by this harness): a missing key written with cas 0 is
/// applied unconditionally by Envoy, so two workers that both found
/// `kvroute/load` missing (no collector yet) lost one charge. Fixed by
/// creating the tables at configure and creating before changing in
/// `cas::update`.
#[test]
fn first_writers_of_a_missing_load_table_keep_both_charges() {
    let wasm = kvroute_harness::artifacts::kvroute_wasm().unwrap();
    let cfg = config(serde_json::json!({}));
    let c = Cluster::new();
    for i in 0..2 {
        let vm = VmSpec::new(&format!("worker-{i}"), &wasm, VM_ID, "kvroute", &cfg);
        assert!(c.add_vm(vm).unwrap().configured);
    }
    let body = completion(&prompt("no collector yet", 800), false);
    let other = body.clone();
    c.before_shared_set(0, kvroute_shared_state::LOAD_KEY, move |c| {
        c.post(1, "/v1/completions", &other).unwrap();
    });
    let first = c.post(0, "/v1/completions", &body).unwrap();
    assert!(primary(&c, first).is_some());
    assert_eq!(
        total_inflight(&c).1,
        2,
        "a charge was lost to an unconditional first write"
    );
}

/// The same race on a prefix-index shard (regression): the collector now
/// creates every shard before traffic, so both writers go through CAS.
#[test]
fn first_writers_of_an_index_shard_keep_both_inserts() {
    let c = fleet(2, &config(serde_json::json!({})));
    let body = completion(&prompt("cold shard race", 1500), false);
    let other = body.clone();
    c.before_shared_set(1, "kvroute/ix/", move |c| {
        c.post(2, "/v1/completions", &other).unwrap();
    });
    let before = c.cas_mismatches();
    c.post(1, "/v1/completions", &body).unwrap();
    assert!(
        c.cas_mismatches() > before,
        "worker 1 overwrote worker 2's shard without a CAS check"
    );
}

/// xorshift64*: the soak's own seeded generator.
struct Dice(u64);
impl Dice {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

#[derive(Clone, Copy)]
enum Phase {
    Sent,
    FirstByte,
}

/// 100,000 lifecycles over 4 workers with random exits and interleavings,
/// checked against a model of the in-flight request counts per endpoint.
/// `KVROUTE_SOAK_LIFECYCLES` changes the count (for a quicker local run);
/// see tests/harness/README.md.
#[test]
fn soak_100k_lifecycles_match_the_model() {
    let total: usize = std::env::var("KVROUTE_SOAK_LIFECYCLES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(100_000);
    let setup = std::time::Instant::now();
    let c = fleet(4, &config(serde_json::json!({})));
    eprintln!("soak: module load and VM start took {:?}", setup.elapsed());
    let started = std::time::Instant::now();
    let cpu_started = thread_cpu_time();
    let mut dice = Dice(0x5eed_cafe_f00d_d00d);
    let prefixes: Vec<String> = (0..40)
        .map(|i| prompt(&format!("tenant {i} system"), 300))
        .collect();
    // (request, phase, endpoint still counted in the model, streaming)
    let mut open: Vec<(Req, Phase, Option<String>, bool)> = Vec::new();
    let mut model: HashMap<String, u64> = HashMap::new();
    let mut done = 0usize;
    let mut routed = 0usize;
    let check = |c: &Cluster, model: &HashMap<String, u64>, at: usize| {
        for (addr, tokens, requests) in inflight(c) {
            let want = model.get(&addr).copied().unwrap_or(0);
            assert_eq!(
                requests, want,
                "after {at} lifecycles: {addr} in-flight requests"
            );
            if want == 0 {
                assert_eq!(
                    tokens, 0,
                    "after {at} lifecycles: {addr} holds tokens with no request"
                );
            }
        }
    };
    while done < total {
        // Start a request on a random worker, or advance an open one.
        if open.len() < 64 && (open.is_empty() || dice.below(2) == 0) {
            let vm = 1 + dice.below(4) as usize;
            // Now and then another writer gets to the load table first.
            if dice.below(100) == 0 {
                c.force_cas_mismatch(
                    VM_ID,
                    kvroute_shared_state::LOAD_KEY,
                    1 + dice.below(3) as u32,
                );
            }
            let p = &prefixes[dice.below(prefixes.len() as u64) as usize];
            let streaming = dice.below(2) == 0;
            let body = completion(&format!("{p} q{}", dice.next()), streaming);
            let req = c.post(vm, "/v1/completions", &body).unwrap();
            let target = primary(&c, req);
            if let Some(t) = &target {
                *model.entry(t.clone()).or_default() += 1;
                routed += 1;
            }
            open.push((req, Phase::Sent, target, streaming));
            continue;
        }
        let i = dice.below(open.len() as u64) as usize;
        let (req, phase, target, streaming) = open[i].clone();
        let roll = dice.below(100);
        let ended = match phase {
            Phase::Sent if roll < 60 => {
                c.respond_headers(req, 200, &[], false).unwrap();
                c.respond_body(req, b"data: a\n\n", false).unwrap();
                open[i].1 = Phase::FirstByte;
                if !streaming {
                    // A non-streaming body comes once the request is over:
                    // its first byte releases the request.
                    if let Some(t) = open[i].2.take() {
                        *model.get_mut(&t).expect("modelled") -= 1;
                    }
                }
                false
            }
            Phase::Sent if roll < 75 => {
                c.client_abort(req).unwrap();
                true
            }
            Phase::Sent if roll < 90 => {
                c.upstream_reset(req).unwrap();
                true
            }
            Phase::Sent => {
                c.route_timeout(req).unwrap();
                true
            }
            Phase::FirstByte if roll < 80 => {
                c.respond_body(req, b"data: [DONE]\n\n", true).unwrap();
                true
            }
            Phase::FirstByte if roll < 90 => {
                c.client_abort(req).unwrap();
                true
            }
            Phase::FirstByte => {
                c.upstream_reset(req).unwrap();
                true
            }
        };
        if ended {
            assert!(c.is_ended(req));
            if let Some(t) = target {
                *model.get_mut(&t).expect("modelled") -= 1;
            }
            open.swap_remove(i);
            done += 1;
            if done.is_multiple_of(5_000) {
                check(&c, &model, done);
            }
        }
    }
    for (req, _, target, _) in open.drain(..) {
        c.client_abort(req).unwrap();
        if let Some(t) = target {
            *model.get_mut(&t).unwrap() -= 1;
        }
    }
    check(&c, &model, done);
    assert_eq!(total_inflight(&c), (0, 0));
    assert!(
        routed > total / 2,
        "most requests must be routed ({routed} of {total})"
    );
    for vm in 0..5 {
        assert!(c.vm_failure(vm).is_none());
    }
    let took = started.elapsed();
    let cpu = thread_cpu_time()
        .zip(cpu_started)
        .map(|(end, start)| end - start)
        .unwrap_or(took);
    eprintln!(
        "soak: {total} lifecycles over 4 workers: {cpu:?} CPU, {took:?} wall, {routed} routed"
    );
    assert!(
        cpu.as_secs() < 60,
        "soak too slow: {cpu:?} of CPU for {total} lifecycles"
    );
}

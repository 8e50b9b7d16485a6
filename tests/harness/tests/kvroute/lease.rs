//! `collector.mode: lease`: filter-only installs, where the worker VMs
//! elect one collector through a lease key in shared data. Worker VMs only,
//! no singleton; every `/metrics` call is recorded with the VM that made it.

use crate::support::*;
use kvroute_harness::{Cluster, HttpCallReply};
use kvroute_shared_state::endpoints::EndpointTable;
use kvroute_shared_state::ENDPOINTS_KEY;
use std::cell::RefCell;
use std::rc::Rc;
use std::time::Duration;

const POLL_MS: u64 = 1000;
const LEASE_MS: u64 = 3000;

/// `workers` filter VMs in lease mode, and the log of (ms, vm, endpoint)
/// of every `/metrics` call they make.
fn lease_fleet(workers: usize) -> (Cluster, Calls) {
    let config = config(serde_json::json!({"collector": {
        "mode": "lease", "leaseMs": LEASE_MS,
        "metricsCluster": "vllm", "metricsPollIntervalMs": POLL_MS, "metricsTimeoutMs": 200
    }}));
    let c = Cluster::new();
    add_workers(&c, workers, &config);
    let calls: Calls = Rc::default();
    let log = calls.clone();
    c.set_http_responder(move |call| {
        if call.path() != "/metrics" {
            // The collector's slower `/v1/models` poll: answered, not logged.
            return HttpCallReply::ok(
                br#"{"object":"list","data":[{"id":"m","object":"model"}]}"#.to_vec(),
            );
        }
        let endpoint = call.header(DEST).unwrap_or_default().to_string();
        // Stamped with the time by `run` (the clock is borrowed here).
        log.borrow_mut().push((u64::MAX, call.vm, endpoint));
        HttpCallReply::ok(b"vllm:num_requests_running{model_name=\"m\"} 1\n".to_vec())
    });
    (c, calls)
}

type Calls = Rc<RefCell<Vec<(u64, usize, String)>>>;

/// Advances the clock by `by` in 10 ms steps, stamping each call with the
/// step it was made in.
fn run(c: &Cluster, calls: &Calls, by: Duration) {
    let steps = by.as_millis() / 10;
    for _ in 0..steps {
        c.advance(Duration::from_millis(10)).unwrap();
        let now = c.now_ns() / 1_000_000;
        for call in calls.borrow_mut().iter_mut().filter(|x| x.0 == u64::MAX) {
            call.0 = now;
        }
    }
}

/// Checks that per endpoint, polls are at least `POLL_MS` apart (one tick
/// of slack): however the lease changes hands, never two pollers at once.
fn polls_spaced(calls: &[(u64, usize, String)]) {
    let tick_slack_ms = 250;
    for endpoint in ENDPOINTS {
        let times: Vec<(u64, usize)> = calls
            .iter()
            .filter(|(_, _, e)| e == endpoint)
            .map(|(t, vm, _)| (*t, *vm))
            .collect();
        for w in times.windows(2) {
            assert!(
                w[1].0 + tick_slack_ms >= w[0].0 + POLL_MS,
                "{endpoint} polled twice within an interval: {w:?} (all: {times:?})"
            );
        }
    }
}

/// [`polls_spaced`], and the lease never goes back to an earlier holder;
/// returns the VMs that polled, in order of their first poll.
fn one_poller_at_a_time(calls: &[(u64, usize, String)]) -> Vec<usize> {
    polls_spaced(calls);
    let mut order = Vec::new();
    for (_, vm, _) in calls {
        if order.last() != Some(vm) {
            assert!(
                !order.contains(vm),
                "polling went back to VM {vm}: {calls:?}"
            );
            order.push(*vm);
        }
    }
    order
}

#[test]
fn exactly_one_of_three_workers_polls() {
    let (c, calls) = lease_fleet(3);
    run(&c, &calls, Duration::from_secs(20));
    let calls = calls.borrow().clone();
    let pollers = one_poller_at_a_time(&calls);
    assert_eq!(pollers.len(), 1, "{calls:?}");
    // About one poll per endpoint per interval (not one per worker).
    let n = calls.len() as u64;
    let expected = 20_000 / POLL_MS * ENDPOINTS.len() as u64;
    assert!(
        n + 2 * ENDPOINTS.len() as u64 >= expected && n <= expected + ENDPOINTS.len() as u64,
        "{n} polls in 20 s, expected about {expected}"
    );
    // The workers created the shared tables themselves (no singleton).
    let table = EndpointTable::decode(&c.shared_get(VM_ID, ENDPOINTS_KEY).unwrap()).unwrap();
    assert_eq!(table.endpoints.len(), ENDPOINTS.len());
    assert_eq!(
        c.logs_matching("took the collector lease").len(),
        1,
        "{:?}",
        c.logs_matching("lease")
    );
}

#[test]
fn another_worker_takes_over_within_the_lease_when_the_leader_goes() {
    let (c, calls) = lease_fleet(2);
    run(&c, &calls, Duration::from_secs(5));
    let leader = one_poller_at_a_time(&calls.borrow())[0];
    let stopped_at = c.now_ns() / 1_000_000;
    c.stop_vm(leader).unwrap();
    run(&c, &calls, Duration::from_secs(10));
    let calls = calls.borrow().clone();
    let order = one_poller_at_a_time(&calls);
    assert_eq!(order.len(), 2, "{calls:?}");
    assert_eq!(order[0], leader);
    let first_new = calls
        .iter()
        .find(|(_, vm, _)| *vm == order[1])
        .map(|(t, _, _)| *t)
        .unwrap();
    // Takeover within the lease time plus one poll interval and a tick.
    assert!(
        first_new <= stopped_at + LEASE_MS + POLL_MS + 250,
        "took over at {first_new} ms, the leader stopped at {stopped_at} ms"
    );
    // And the new leader keeps polling every endpoint.
    let after: Vec<_> = calls.iter().filter(|(t, _, _)| *t > first_new).collect();
    assert!(after.len() >= 3 * ENDPOINTS.len(), "{after:?}");
}

#[test]
fn no_double_polling_when_every_renewal_races() {
    let (c, calls) = lease_fleet(4);
    // Every tick, the leader's and the contenders' lease writes lose a CAS
    // race now and then: the lease changes hands, never doubles.
    for _ in 0..10 {
        c.force_cas_mismatch(VM_ID, "kvroute/lease", 1);
        run(&c, &calls, Duration::from_millis(1500));
    }
    let calls = calls.borrow().clone();
    polls_spaced(&calls);
    assert!(
        calls.len() as u64 >= 10 * ENDPOINTS.len() as u64,
        "{calls:?}"
    );
}

#[test]
fn singleton_mode_workers_do_not_poll() {
    let c = fleet(
        2,
        &config(serde_json::json!({"collector": {
            "metricsCluster": "vllm", "metricsPollIntervalMs": POLL_MS
        }})),
    );
    let vms: Rc<RefCell<Vec<usize>>> = Rc::default();
    let v2 = vms.clone();
    c.set_http_responder(move |call| {
        v2.borrow_mut().push(call.vm);
        HttpCallReply::ok(Vec::new())
    });
    c.advance(Duration::from_secs(5)).unwrap();
    let vms = vms.borrow();
    assert!(!vms.is_empty());
    assert!(vms.iter().all(|&v| v == 0), "a worker polled: {vms:?}");
}

//! Test 4: after 1,000,000 distinct prompts the bytes kvroute holds in
//! shared data stay under the configured budget. `KVROUTE_BOUND_PROMPTS`
//! changes the count (for a quicker local run); see tests/harness/README.md.

use crate::support::*;

#[test]
fn shared_data_stays_under_budget_after_a_million_prompts() {
    let prompts: usize = std::env::var("KVROUTE_BOUND_PROMPTS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1_000_000);
    let budget: usize = 65_536;
    let c = fleet(
        1,
        &config(serde_json::json!({"sharedState": {"indexBudgetBytes": budget}})),
    );
    let started = std::time::Instant::now();
    let mut peak = 0;
    for i in 0..prompts {
        // Distinct from the first block on, and three blocks long (64 tokens
        // × 4 bytes per block): every prompt inserts new index entries.
        let body = completion(&prompt(&format!("{i:08} distinct"), 3 * 64 + 8), false);
        let req = c.post(1, "/v1/completions", &body).unwrap();
        c.respond_headers(req, 200, &[], true).unwrap();
        if i.is_multiple_of((prompts / 20).max(1)) {
            peak = peak.max(c.shared_bytes(VM_ID));
        }
    }
    let held = c.shared_bytes(VM_ID);
    let shards = c
        .shared_keys(VM_ID)
        .iter()
        .filter(|k| k.starts_with("kvroute/ix/"))
        .count();
    assert!(
        shards > 0,
        "no prefix-index shard was written: the test would prove nothing"
    );
    peak = peak.max(held);
    // The index budget plus the small fixed tables (endpoints, load, metrics:
    // a few hundred bytes each for three endpoints) and key names.
    let allowance = budget + 8 * 1024;
    eprintln!(
        "bound: {prompts} prompts, {held} bytes held (peak {peak}) in {shards} index shards, budget {budget}, {:?}",
        started.elapsed()
    );
    assert!(
        peak <= allowance,
        "shared data grew to {peak} bytes, budget {budget}"
    );
    assert_eq!(total_inflight(&c), (0, 0));
}

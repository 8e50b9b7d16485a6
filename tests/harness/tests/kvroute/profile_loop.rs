//! A loop for `sim/bench/overhead/wasm-perf/run.sh` (feature `perfmap`),
//! not a test: routes `N` bodies (default 20,000) from the JSON-lines file
//! `KVROUTE_PERF_BODIES` through one filter VM, answering each with a
//! non-streaming body, so that `perf` samples the module's own code.

use super::support::*;

#[test]
#[ignore = "a profiling loop: run by sim/bench/overhead/wasm-perf/run.sh"]
fn profile_loop() {
    let path = std::env::var("KVROUTE_PERF_BODIES")
        .expect("KVROUTE_PERF_BODIES: a JSON-lines file of request bodies");
    let text = std::fs::read_to_string(&path).expect("readable KVROUTE_PERF_BODIES");
    let bodies: Vec<&str> = text.lines().collect();
    assert!(!bodies.is_empty(), "{path} has no bodies");
    let n: usize = std::env::var("N")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(20_000);
    let c = fleet(1, &config(serde_json::json!({})));
    for i in 0..n {
        let req = c
            .post(
                1,
                "/v1/chat/completions",
                bodies[i % bodies.len()].as_bytes(),
            )
            .expect("post");
        c.respond_headers(req, 200, &[("content-type", "application/json")], false)
            .expect("response headers");
        c.respond_body(req, b"{\"choices\":[]}", false)
            .expect("response body");
        c.respond_body(req, b"", true).expect("end of stream");
    }
}

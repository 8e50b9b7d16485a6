//! Instruction counts per request, for `valgrind --tool=callgrind`: runs one
//! stage of one case (see `route.rs` and `common/mod.rs`) N times inside
//! `measured_requests`, which is the only function callgrind collects
//! (`--collect-atstart=no --toggle-collect=*measured_requests*`), so the
//! count excludes setup and is the same on every run.
//!
//!     benches/callgrind.sh            # every case, a markdown table
//!     valgrind --tool=callgrind --collect-atstart=no \
//!         --toggle-collect='*measured_requests*' --callgrind-out-file=/dev/null \
//!         target/release/deps/route_callgrind-HASH route 400 64 20
//!
//! Arguments: STAGE (parse | hash | state | decide | route) KB ENDPOINTS N.

mod common;

use common::Case;
use kvroute_core::scheduling::Rng;
use std::hint::black_box;

#[inline(never)]
fn measured_requests(case: &Case, stage: &str, n: u64, rng: &mut Rng) {
    let req = case.parse();
    let blocks = case.hash(&req);
    let facts = case.facts(&blocks, req.max_output_tokens);
    let (view, cands) = case.candidates(&facts);
    // The line above is collected too; subtracting a run with N = 0 removes it
    // (callgrind.sh does).
    for _ in 0..n {
        match stage {
            "parse" => drop(black_box(case.parse())),
            "hash" => drop(black_box(case.hash(black_box(&req)))),
            "state" => drop(black_box(case.candidates(black_box(&facts)))),
            "decide" => drop(black_box(case.decide(&view, black_box(&cands), rng))),
            "route" => case.route_and_release(rng),
            other => panic!("unknown stage {other}: use parse, hash, state, decide or route"),
        }
    }
}

fn main() {
    let args: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with("--"))
        .collect();
    let usage = "usage: route_callgrind STAGE KB ENDPOINTS N (STAGE: parse | hash | state | decide | route)";
    if args.is_empty() {
        // `cargo bench` runs every bench binary without arguments: nothing to do.
        eprintln!("{usage}");
        return;
    }
    let [stage, kb, endpoints, n] = <[String; 4]>::try_from(args).expect(usage);
    let kb: usize = kb.parse().expect(usage);
    let endpoints: usize = endpoints.parse().expect(usage);
    let n: u64 = n.parse().expect(usage);
    let case = Case::new(kb << 10, endpoints);
    let mut rng = Rng::new(42);
    measured_requests(&case, &stage, n, &mut rng);
    println!(
        "{} bytes, {} endpoints, {stage} x{n}",
        case.bytes, case.endpoints
    );
}

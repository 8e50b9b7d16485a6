//! Native cost of a request's steps in precise mode with `tokenizeIn:
//! collector` (the worker's side: parse, render, cut and key, look up,
//! route) against approximate mode's, on real bodies; and the collector's
//! job. Single thread, medians of `REPS`.
//!
//! ```text
//! cargo run --release -p kvroute-core --example offpath_cost -- CONFIG.json FIRST.json NEXT.json [REPS]
//! ```
//!
//! CONFIG: a plugin config with a `token-producer` (inline `tokenizerJson`)
//! and a precise producer. FIRST: a chat body; NEXT: its next turn (FIRST's
//! messages and more). FIRST is routed and its job processed first, so
//! NEXT finds FIRST's prefix stored.

use kvroute_core::config::Config;
use kvroute_core::engine::{Engine, Outcome};
use kvroute_core::precise::offpath::{
    chain, key_seed, pieces, process, Job, TokenizerSource, Tokenizing,
};
use kvroute_core::precise::OffPathModel;
use kvroute_core::request::{parse_request, parse_request_for_template, ApiKind, ParseLimits};
use kvroute_core::scheduling::Rng;
use kvroute_shared_state::memory::MemoryStore;
use std::hint::black_box;
use std::time::Instant;

fn median_ms(reps: usize, mut f: impl FnMut()) -> f64 {
    let mut xs: Vec<f64> = (0..reps)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed().as_secs_f64() * 1e3
        })
        .collect();
    xs.sort_by(|a, b| a.total_cmp(b));
    xs[xs.len() / 2]
}

fn main() {
    let a: Vec<String> = std::env::args().collect();
    let read = |p: &str| std::fs::read(p).unwrap_or_else(|e| panic!("{p}: {e}"));
    let reps: usize = a.get(4).map_or(21, |s| s.parse().unwrap());
    let cfg = read(&a[1]);
    let (first, next) = (read(&a[2]), read(&a[3]));
    let engine = Engine::new(Config::from_json(&cfg).unwrap());
    let mut v: serde_json::Value = serde_json::from_slice(&cfg).unwrap();
    v["plugins"] = serde_json::Value::Array(
        v["plugins"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|p| {
                p["type"] != "token-producer" && p["type"] != "precise-prefix-cache-producer"
            })
            .cloned()
            .collect(),
    );
    v.as_object_mut().unwrap().remove("kvEvents");
    let approx = Engine::new(Config::from_json(v.to_string().as_bytes()).unwrap());
    let store = MemoryStore::new();
    engine.collector_init(&store).unwrap();
    approx.collector_init(&store).unwrap();
    let p = engine.config.precise.clone().unwrap();
    let m = p.tokenizers[0].offpath.clone().unwrap();
    let TokenizerSource::Inline(bytes) = &m.source else {
        panic!()
    };
    let tok = m.load(bytes).unwrap();
    kvroute_shared_state::hashed::put_meta(&store, m.fingerprint, &OffPathModel::meta(&tok))
        .unwrap();
    let budget = std::cell::RefCell::new(kvroute_shared_state::hashed::Budget::new(
        engine.config.shared_state.hashed_prefix_slots,
        engine.config.shared_state.hashed_prefix_bytes,
    ));
    let t = Tokenizing {
        tok: &tok,
        fingerprint: m.fingerprint,
        block_size: p.block_size,
        hasher: &p.hasher,
        max_blocks: p.max_blocks,
        budget: &budget,
    };
    let mut rng = Rng::new(1);
    let route = |e: &Engine, body: &[u8], rng: &mut Rng| match e.route(
        &store,
        e.facts(ApiKind::ChatCompletions, body).unwrap(),
        1000,
        rng,
    ) {
        Outcome::Routed(r) => r,
        other => panic!("{other:?}"),
    };
    // FIRST, processed: NEXT finds its prefix.
    let r = route(&engine, &first, &mut rng);
    let job = Job::decode(&r.tokenize.unwrap().job).unwrap();
    let t0 = Instant::now();
    process(&job, &t, &store).unwrap();
    println!(
        "collector: FIRST's job ({} KB, cold) {:.1} ms",
        job.text.len() / 1024,
        t0.elapsed().as_secs_f64() * 1e3
    );
    engine
        .release_rest(&store, &r.ticket.unwrap(), false)
        .unwrap();
    let r = route(&engine, &next, &mut rng);
    let tk = r.tokenize.clone().unwrap();
    let job = Job::decode(&tk.job).unwrap();
    println!(
        "NEXT: partial {} ({:?}), new text {} bytes",
        tk.partial,
        r.precise,
        job.text.len()
    );
    engine
        .release_rest(&store, &r.ticket.unwrap(), false)
        .unwrap();
    let limits = ParseLimits::default();
    let parse = median_ms(reps, || {
        black_box(parse_request(ApiKind::ChatCompletions, &next, &limits).unwrap());
    });
    let parse_t = median_ms(reps, || {
        black_box(parse_request_for_template(ApiKind::ChatCompletions, &next, &limits).unwrap());
    });
    let (_, chat) = parse_request_for_template(ApiKind::ChatCompletions, &next, &limits).unwrap();
    let chat = chat.unwrap();
    let render = median_ms(reps, || {
        black_box(m.renderer.render_inputs(&chat).unwrap());
    });
    let (text, add) = m.renderer.render_inputs(&chat).unwrap();
    let seg = tok.segmenter().ok();
    let seed = key_seed(m.fingerprint, p.block_size, &p.hasher, add, None);
    let keys = median_ms(reps, || {
        let ps = pieces(seg, &text);
        black_box(chain(&ps, seed, kvroute_core::precise::offpath::root(seed)));
    });
    let facts_p = median_ms(reps, || {
        black_box(engine.facts(ApiKind::ChatCompletions, &next).unwrap());
    });
    let facts_a = median_ms(reps, || {
        black_box(approx.facts(ApiKind::ChatCompletions, &next).unwrap());
    });
    let route_p = median_ms(reps, || {
        let r = route(&engine, &next, &mut Rng::new(2));
        engine
            .release_rest(&store, &r.ticket.unwrap(), false)
            .unwrap();
    });
    let route_a = median_ms(reps, || {
        let r = route(&approx, &next, &mut Rng::new(2));
        approx
            .release_rest(&store, &r.ticket.unwrap(), false)
            .unwrap();
    });
    let t0 = Instant::now();
    process(&job, &t, &store).unwrap();
    let jobms = t0.elapsed().as_secs_f64() * 1e3;
    println!("NEXT ({} KB): parse {parse:.3} ms, parse with template inputs {parse_t:.3}, render {render:.3}, cut and key {keys:.3}", next.len() / 1024);
    println!("facts: precise {facts_p:.3} ms, approximate {facts_a:.3}; facts + route + release: precise {route_p:.3}, approximate {route_a:.3}");
    println!("collector: NEXT's job {jobms:.2} ms");
}

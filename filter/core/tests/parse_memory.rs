//! Heap use of `parse_request`, measured with a counting allocator: how
//! many allocations, how many bytes, and the most held at once, for the
//! bench's chat bodies and for bodies of thousands of tiny messages or
//! parts (which render to several times their size).
//!
//!     cargo test -p kvroute-core --test parse_memory -- --nocapture
//!
//! prints the figures.

#[path = "../benches/common/mod.rs"]
mod common;

use kvroute_core::request::{parse_request, ApiKind, ParseLimits, Prompt};
use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

/// Counts this thread's allocations (tests run on threads of their own).
struct Counting;

#[derive(Clone, Copy, Default, Debug)]
struct Usage {
    /// Allocations (a reallocation counts as one).
    count: usize,
    /// Bytes allocated (a reallocation counts its new size).
    bytes: usize,
    live: usize,
    /// Most bytes live at once, a moving reallocation holding both blocks.
    peak: usize,
}

thread_local! {
    static USAGE: Cell<Usage> = const { Cell::new(Usage { count: 0, bytes: 0, live: 0, peak: 0 }) };
}

fn update(f: impl FnOnce(&mut Usage)) {
    let _ = USAGE.try_with(|u| {
        let mut v = u.get();
        f(&mut v);
        v.peak = v.peak.max(v.live);
        u.set(v);
    });
}

// SAFETY: every call is forwarded to `System` unchanged; only counters change.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            update(|u| {
                u.count += 1;
                u.bytes += layout.size();
                u.live += layout.size();
            });
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) };
        update(|u| u.live = u.live.saturating_sub(layout.size()));
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            let old = layout.size();
            update(|u| {
                u.count += 1;
                u.bytes += new_size;
                if p != ptr {
                    // Moved: both blocks were held during the copy.
                    u.peak = u.peak.max(u.live + new_size);
                }
                u.live = u.live - old.min(u.live) + new_size;
            });
        }
        p
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

/// Parses `body` and returns the heap use of the call (the result is
/// dropped after the measurement) and the rendered length.
fn measure(kind: ApiKind, body: &[u8]) -> (Usage, usize) {
    let limits = ParseLimits::default();
    let base = USAGE.with(|u| {
        let mut v = u.get();
        v.peak = v.live;
        u.set(v);
        v
    });
    let parsed = parse_request(kind, body, &limits);
    let after = USAGE.with(Cell::get);
    let len = match parsed {
        Ok(r) => match r.prompt {
            Prompt::Text(t) => t.len(),
            Prompt::TokenIds(t) => t.len(),
        },
        Err(e) => panic!("{kind:?}: {e}"),
    };
    let usage = Usage {
        count: after.count - base.count,
        bytes: after.bytes - base.bytes,
        live: after.live.saturating_sub(base.live),
        peak: after.peak - base.live,
    };
    (usage, len)
}

fn report(what: &str, body: usize, rendered: usize, u: &Usage) {
    eprintln!(
        "{what}: body {body} B, rendered {rendered} B; {} allocations, {} B allocated ({:.2}× body), peak {} B ({:.2}× body)",
        u.count,
        u.bytes,
        u.bytes as f64 / body as f64,
        u.peak,
        u.peak as f64 / body as f64,
    );
}

fn testdata(name: &str) -> Vec<u8> {
    let path = format!(
        "{}/../../testdata/requests/{name}",
        env!("CARGO_MANIFEST_DIR")
    );
    std::fs::read(&path).unwrap_or_else(|e| panic!("{path}: {e}"))
}

#[test]
fn chat_bodies_allocate_about_their_rendered_size_once() {
    for bytes in common::SIZES {
        let body = common::chat_body(bytes, 1);
        let (u, rendered) = measure(ApiKind::ChatCompletions, &body);
        report(
            &format!("chat {} KiB", bytes >> 10),
            body.len(),
            rendered,
            &u,
        );
        // The model name, the prompt's first 4 KiB, the prompt.
        assert!(u.count <= 3, "{u:?}");
        assert!(u.bytes <= body.len() * 17 / 16 + 8192, "{u:?}");
        // What stays allocated: the prompt, with little spare room.
        assert!(u.live <= rendered * 9 / 8 + 64, "{u:?}");
    }
}

#[test]
fn many_tiny_messages_peak_at_a_small_multiple_of_the_body() {
    // 50,000 `{}`: each renders to `<|user|>\n\n`, 3.3× its JSON.
    let body = testdata("bad-many-empty-messages.json");
    let (u, rendered) = measure(ApiKind::ChatCompletions, &body);
    report("bad-many-empty-messages", body.len(), rendered, &u);
    assert!(u.peak <= 4 * body.len() + (64 << 10), "{u:?}");
    assert!(u.count <= 4, "{u:?}");

    // The same at 4 MiB.
    let mut big = br#"{"model":"m","messages":["#.to_vec();
    while big.len() < 4 << 20 {
        big.extend_from_slice(b"{},");
    }
    big.extend_from_slice(b"{}]}");
    let (u, rendered) = measure(ApiKind::ChatCompletions, &big);
    report("4 MiB of empty messages", big.len(), rendered, &u);
    assert!(u.peak <= 4 * big.len() + (64 << 10), "{u:?}");

    // Parts render to up to 8.3× their JSON (`{}` → `<|part:HASH|>`).
    let body = testdata("bad-many-empty-parts.json");
    let (u, rendered) = measure(ApiKind::ChatCompletions, &body);
    report("bad-many-empty-parts", body.len(), rendered, &u);
    assert!(u.peak <= 10 * body.len() + (64 << 10), "{u:?}");
}

//! The proxy-wasm ABI 0.2.1 entry points the module exports, and the table
//! of live contexts they dispatch to.
//!
//! The module exports these itself instead of linking the proxy-wasm SDK's
//! dispatcher, for one reason: Envoy calls only the callbacks a module
//! exports, and every call is a VM entry and exit. The SDK exports all of
//! them, so every request also paid for `proxy_on_log` and `proxy_on_done`
//! (and trailers and metadata callbacks where they occur). kvroute needs,
//! per request, only context creation, the request headers and body, the
//! response headers and body, and `proxy_on_delete`, which is where a
//! request's remaining charge is released on every exit path (Envoy calls
//! it for every stream context it created, whatever ended the stream).
//!
//! Context ids are Envoy's. A callback takes its context out of the table
//! while it runs and puts it back after, so a host call that re-enters the
//! module for the same context finds nothing and gets the neutral answer
//! instead of a double borrow (a panic, which would kill the VM).

use crate::http::RouteContext;
use crate::root::Root;
use std::cell::RefCell;
use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::mem::MaybeUninit;

/// What a stream callback tells Envoy (`proxy_action_t`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u32)]
pub enum Action {
    Continue = 0,
    Pause = 1,
}

#[derive(Default)]
struct Contexts {
    roots: HashMap<u32, Root, IdHash>,
    streams: HashMap<u32, RouteContext, IdHash>,
}

/// Hashes a context id with one multiplication. The ids are Envoy's
/// (counted up, not chosen by clients), and every callback takes its
/// context out of the table and puts it back, so std's SipHash cost a
/// noticeable share of a request's instructions in the module.
type IdHash = BuildHasherDefault<IdHasher>;

#[derive(Default)]
struct IdHasher(u64);

impl Hasher for IdHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.write_u64((self.0 << 8) | u64::from(b));
        }
    }

    fn write_u32(&mut self, id: u32) {
        self.write_u64(u64::from(id));
    }

    fn write_u64(&mut self, x: u64) {
        // Fibonacci hashing: spreads consecutive ids over the high bits
        // (hashbrown's tags) and keeps them distinct in the low bits.
        self.0 = (self.0 ^ x).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    }
}

thread_local! {
    static CONTEXTS: RefCell<Contexts> = RefCell::new(Contexts::default());
}

/// Runs `f` on root context `id`, if it exists and is not already running.
fn with_root<R>(id: u32, neutral: R, f: impl FnOnce(&mut Root) -> R) -> R {
    let Some(mut root) = CONTEXTS.with(|c| c.borrow_mut().roots.remove(&id)) else {
        return neutral;
    };
    let out = f(&mut root);
    CONTEXTS.with(|c| c.borrow_mut().roots.insert(id, root));
    out
}

/// Runs `f` on stream context `id`; `Continue` if there is none.
fn with_stream(id: u32, f: impl FnOnce(&mut RouteContext) -> Action) -> u32 {
    let Some(mut stream) = CONTEXTS.with(|c| c.borrow_mut().streams.remove(&id)) else {
        return Action::Continue as u32;
    };
    let out = f(&mut stream);
    CONTEXTS.with(|c| c.borrow_mut().streams.insert(id, stream));
    out as u32
}

#[no_mangle]
pub extern "C" fn proxy_abi_version_0_2_1() {}

#[cfg(target_os = "wasi")]
extern "C" {
    fn __wasm_call_ctors();
}

/// The WASI reactor entry point, called once before anything else.
#[no_mangle]
pub extern "C" fn _initialize() {
    // SAFETY: the linker-generated constructor runner, called once, first.
    #[cfg(target_os = "wasi")]
    unsafe {
        __wasm_call_ctors()
    };
}

/// Memory the host fills and hands back (header maps, buffers, shared
/// data). Exactly `size` bytes, so [`crate::host`] can take it back as a
/// `Vec` of that capacity.
#[no_mangle]
pub extern "C" fn proxy_on_memory_allocate(size: usize) -> *mut u8 {
    let mut v: Vec<MaybeUninit<u8>> = Vec::with_capacity(size);
    let p = v.as_mut_ptr();
    std::mem::forget(v);
    p.cast()
}

#[no_mangle]
pub extern "C" fn proxy_on_context_create(context_id: u32, parent_context_id: u32) {
    if parent_context_id == 0 {
        CONTEXTS.with(|c| c.borrow_mut().roots.insert(context_id, Root::default()));
        return;
    }
    // A stream of an unknown root gets an unconfigured context, which
    // passes the request on untouched (Envoy does not create streams for a
    // plugin whose root failed to configure).
    let stream = with_root(parent_context_id, None, |r| Some(r.new_stream()))
        .unwrap_or_else(|| RouteContext::new(None));
    CONTEXTS.with(|c| c.borrow_mut().streams.insert(context_id, stream));
}

#[no_mangle]
pub extern "C" fn proxy_on_vm_start(_root_id: u32, _vm_configuration_size: usize) -> u32 {
    1
}

#[no_mangle]
pub extern "C" fn proxy_on_configure(root_id: u32, plugin_configuration_size: usize) -> u32 {
    u32::from(with_root(root_id, false, |r| {
        r.on_configure(plugin_configuration_size)
    }))
}

#[no_mangle]
pub extern "C" fn proxy_on_tick(root_id: u32) {
    with_root(root_id, (), Root::on_tick);
}

#[no_mangle]
pub extern "C" fn proxy_on_http_call_response(
    root_id: u32,
    token: u32,
    num_headers: usize,
    body_size: usize,
    _num_trailers: usize,
) {
    with_root(root_id, (), |r| {
        r.on_http_call_response(token, num_headers, body_size)
    });
}

#[no_mangle]
pub extern "C" fn proxy_on_request_headers(
    context_id: u32,
    num_headers: usize,
    end_of_stream: u32,
) -> u32 {
    with_stream(context_id, |s| {
        s.on_request_headers(num_headers, end_of_stream != 0)
    })
}

#[no_mangle]
pub extern "C" fn proxy_on_request_body(
    context_id: u32,
    body_size: usize,
    end_of_stream: u32,
) -> u32 {
    with_stream(context_id, |s| {
        s.on_request_body(body_size, end_of_stream != 0)
    })
}

#[no_mangle]
pub extern "C" fn proxy_on_response_headers(
    context_id: u32,
    num_headers: usize,
    end_of_stream: u32,
) -> u32 {
    with_stream(context_id, |s| {
        s.on_response_headers(num_headers, end_of_stream != 0)
    })
}

#[no_mangle]
pub extern "C" fn proxy_on_response_body(
    context_id: u32,
    body_size: usize,
    end_of_stream: u32,
) -> u32 {
    with_stream(context_id, |s| {
        s.on_response_body(body_size, end_of_stream != 0)
    })
}

/// The end of every context. A stream releases what it still holds; a
/// root hands over its pending counters.
#[no_mangle]
pub extern "C" fn proxy_on_delete(context_id: u32) {
    let (stream, root) = CONTEXTS.with(|c| {
        let mut c = c.borrow_mut();
        let stream = c.streams.remove(&context_id);
        let root = if stream.is_none() {
            c.roots.remove(&context_id)
        } else {
            None
        };
        (stream, root)
    });
    if let Some(mut s) = stream {
        s.on_delete();
    }
    if let Some(r) = root {
        r.on_delete();
    }
}

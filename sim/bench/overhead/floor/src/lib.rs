//! The floor of kvroute's design on Envoy's V8: per routable request, the
//! VM entries and host calls kvroute makes for an 8 KiB chat request whose
//! prompt spans one or two index groups, and nothing else.
//!
//! - `proxy_on_context_create`
//! - request headers: one `get_header_map_pairs` (plus its allocation
//!   callback), the client's destination header removed if present, Pause
//!   for POST
//! - request body: buffer to end of stream, one `get_buffer_bytes` (plus
//!   allocation), one clock read, the load table read and written back with
//!   its CAS token (the charge), one index shard read and written back (the
//!   lookup and the insert), the destination header set; Continue
//! - response headers: Continue
//! - response body: at the end of stream, the load table read and written
//!   back (the release)
//! - `proxy_on_delete`
//!
//! The values written are 1 byte unless built with other sizes (see
//! `LOAD_BYTES`; `run.sh` builds both); the destination is the next static
//! endpoint in turn, read from the plugin configuration's `endpoints.static`
//! the way `envoy/render.py` writes it. A lost CAS race is retried, as
//! kvroute does. Benchmark fixture only: it routes round robin.

use std::cell::RefCell;
use std::collections::HashMap;
use std::mem::MaybeUninit;

#[link(wasm_import_module = "env")]
extern "C" {
    fn proxy_get_current_time_nanoseconds(return_time: *mut u64) -> u32;
    fn proxy_get_buffer_bytes(
        buffer_type: u32,
        start: usize,
        max_size: usize,
        return_buffer_data: *mut *mut u8,
        return_buffer_size: *mut usize,
    ) -> u32;
    fn proxy_get_header_map_pairs(
        map_type: u32,
        return_map_data: *mut *mut u8,
        return_map_size: *mut usize,
    ) -> u32;
    fn proxy_replace_header_map_value(
        map_type: u32,
        key_data: *const u8,
        key_size: usize,
        value_data: *const u8,
        value_size: usize,
    ) -> u32;
    fn proxy_remove_header_map_value(map_type: u32, key_data: *const u8, key_size: usize) -> u32;
    fn proxy_get_shared_data(
        key_data: *const u8,
        key_size: usize,
        return_value_data: *mut *mut u8,
        return_value_size: *mut usize,
        return_cas: *mut u32,
    ) -> u32;
    fn proxy_set_shared_data(
        key_data: *const u8,
        key_size: usize,
        value_data: *const u8,
        value_size: usize,
        cas: u32,
    ) -> u32;
}

const REQUEST_HEADERS: u32 = 0;
const REQUEST_BODY: u32 = 0;
const PLUGIN_CONFIGURATION: u32 = 7;
const DESTINATION: &str = "x-gateway-destination-endpoint";
const LOAD_KEY: &str = "floor/load";
const CAS_MISMATCH: u32 = 8;
// Value sizes and the number of index keys, fixed at build time (default
// 1 byte, 1 key); with FLOOR_LOAD_BYTES=547 FLOOR_SHARD_BYTES=4096
// FLOOR_SHARDS=16384 the values and the key count are kvroute's (4 endpoints,
// the default 64 MiB index).
const LOAD_BYTES: usize = build_number(option_env!("FLOOR_LOAD_BYTES"));
const SHARD_BYTES: usize = build_number(option_env!("FLOOR_SHARD_BYTES"));
const SHARDS: usize = build_number(option_env!("FLOOR_SHARDS"));

/// A pseudo-random index key for the n-th request.
#[allow(clippy::modulo_one)] // SHARDS is 1 in the default build
fn shard_of(n: u64) -> usize {
    (n.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 32) as usize % SHARDS
}

const fn build_number(v: Option<&str>) -> usize {
    let Some(v) = v else {
        return 1;
    };
    let b = v.as_bytes();
    let (mut i, mut n) = (0, 0usize);
    while i < b.len() {
        n = n * 10 + (b[i] - b'0') as usize;
        i += 1;
    }
    if n == 0 {
        1
    } else {
        n
    }
}

#[derive(Default)]
struct Stream {
    routable: bool,
    charged: bool,
}

#[derive(Default)]
struct State {
    endpoints: Vec<String>,
    next: usize,
    requests: u64,
    streams: HashMap<u32, Stream>,
}

thread_local! {
    static STATE: RefCell<State> = RefCell::new(State::default());
}

unsafe fn take(data: *mut u8, size: usize) -> Vec<u8> {
    if data.is_null() {
        Vec::new()
    } else {
        Vec::from_raw_parts(data, size, size)
    }
}

fn get_buffer(kind: u32, size: usize) -> Vec<u8> {
    let (mut p, mut n) = (std::ptr::null_mut(), 0);
    if unsafe { proxy_get_buffer_bytes(kind, 0, size, &mut p, &mut n) } != 0 {
        return Vec::new();
    }
    unsafe { take(p, n) }
}

/// Reads `key` (created as `size` zero bytes if missing) and writes it
/// back one byte changed, with its CAS token; retries a lost race
/// (bounded).
fn read_modify_write(key: &str, size: usize) {
    for _ in 0..8 {
        let (mut p, mut n, mut cas) = (std::ptr::null_mut(), 0, 0u32);
        let status =
            unsafe { proxy_get_shared_data(key.as_ptr(), key.len(), &mut p, &mut n, &mut cas) };
        let mut value = if status == 0 {
            unsafe { take(p, n) }
        } else {
            Vec::new()
        };
        if value.is_empty() {
            value.resize(size, 0);
        }
        value[0] = value[0].wrapping_add(1);
        let set = unsafe {
            proxy_set_shared_data(key.as_ptr(), key.len(), value.as_ptr(), value.len(), cas)
        };
        if set != CAS_MISMATCH {
            return;
        }
    }
}

/// `"ip:port"` strings of `endpoints.static` in the plugin configuration
/// (a plain scan: the fixture has no JSON parser).
fn static_endpoints(config: &[u8]) -> Vec<String> {
    let text = String::from_utf8_lossy(config);
    let Some(start) = text.find("\"static\"") else {
        return Vec::new();
    };
    let rest = &text[start..];
    let Some(open) = rest.find('[') else {
        return Vec::new();
    };
    let Some(close) = rest[open..].find(']') else {
        return Vec::new();
    };
    rest[open + 1..open + close]
        .split(',')
        .map(|s| s.trim().trim_matches('"').to_string())
        .filter(|s| !s.is_empty())
        .collect()
}

#[no_mangle]
pub extern "C" fn proxy_abi_version_0_2_1() {}

#[cfg(target_os = "wasi")]
extern "C" {
    fn __wasm_call_ctors();
}

#[no_mangle]
pub extern "C" fn _initialize() {
    #[cfg(target_os = "wasi")]
    unsafe {
        __wasm_call_ctors()
    };
}

#[no_mangle]
pub extern "C" fn proxy_on_memory_allocate(size: usize) -> *mut u8 {
    let mut v: Vec<MaybeUninit<u8>> = Vec::with_capacity(size);
    let p = v.as_mut_ptr();
    std::mem::forget(v);
    p.cast()
}

#[no_mangle]
pub extern "C" fn proxy_on_vm_start(_root: u32, _size: usize) -> u32 {
    1
}

#[no_mangle]
pub extern "C" fn proxy_on_configure(_root: u32, size: usize) -> u32 {
    let config = get_buffer(PLUGIN_CONFIGURATION, size);
    let endpoints = static_endpoints(&config);
    STATE.with(|s| {
        let mut s = s.borrow_mut();
        if !endpoints.is_empty() {
            s.endpoints = endpoints;
        }
    });
    1
}

#[no_mangle]
pub extern "C" fn proxy_on_context_create(context_id: u32, parent: u32) {
    if parent != 0 {
        STATE.with(|s| s.borrow_mut().streams.insert(context_id, Stream::default()));
    }
}

#[no_mangle]
pub extern "C" fn proxy_on_request_headers(context_id: u32, _n: usize, eos: u32) -> u32 {
    let (mut p, mut n) = (std::ptr::null_mut(), 0);
    let pairs = if unsafe { proxy_get_header_map_pairs(REQUEST_HEADERS, &mut p, &mut n) } == 0 {
        unsafe { take(p, n) }
    } else {
        Vec::new()
    };
    // The serialized map holds the names verbatim: a byte search finds them.
    let has = |needle: &[u8]| pairs.windows(needle.len()).any(|w| w == needle);
    if has(DESTINATION.as_bytes()) {
        unsafe {
            proxy_remove_header_map_value(REQUEST_HEADERS, DESTINATION.as_ptr(), DESTINATION.len())
        };
    }
    let routable = eos == 0 && has(b"POST");
    STATE.with(|s| {
        if let Some(st) = s.borrow_mut().streams.get_mut(&context_id) {
            st.routable = routable;
        }
    });
    u32::from(routable)
}

#[no_mangle]
pub extern "C" fn proxy_on_request_body(context_id: u32, size: usize, eos: u32) -> u32 {
    let routable = STATE.with(|s| {
        s.borrow()
            .streams
            .get(&context_id)
            .is_some_and(|st| st.routable && !st.charged)
    });
    if !routable {
        return 0;
    }
    if eos == 0 {
        return 1;
    }
    // The body is copied into the VM as kvroute's is, and not looked at.
    std::hint::black_box(get_buffer(REQUEST_BODY, size));
    let mut t = 0u64;
    unsafe { proxy_get_current_time_nanoseconds(&mut t) };
    read_modify_write(LOAD_KEY, LOAD_BYTES);
    let (request, destination) = STATE.with(|s| {
        let mut s = s.borrow_mut();
        s.requests = s.requests.wrapping_add(1);
        let request = s.requests;
        if let Some(st) = s.streams.get_mut(&context_id) {
            st.charged = true;
        }
        if s.endpoints.is_empty() {
            return (request, String::new());
        }
        s.next = (s.next + 1) % s.endpoints.len();
        (request, s.endpoints[s.next].clone())
    });
    // A different index key per request when there are several.
    if SHARDS == 1 {
        read_modify_write("floor/ix/0", SHARD_BYTES);
    } else {
        read_modify_write(&format!("floor/ix/{}", shard_of(request)), SHARD_BYTES);
    }
    if !destination.is_empty() {
        unsafe {
            proxy_replace_header_map_value(
                REQUEST_HEADERS,
                DESTINATION.as_ptr(),
                DESTINATION.len(),
                destination.as_ptr(),
                destination.len(),
            )
        };
    }
    0
}

#[no_mangle]
pub extern "C" fn proxy_on_response_headers(_context_id: u32, _n: usize, _eos: u32) -> u32 {
    0
}

fn release(context_id: u32) {
    let charged = STATE.with(|s| {
        s.borrow_mut()
            .streams
            .get_mut(&context_id)
            .is_some_and(|st| std::mem::take(&mut st.charged))
    });
    if charged {
        read_modify_write(LOAD_KEY, LOAD_BYTES);
    }
}

#[no_mangle]
pub extern "C" fn proxy_on_response_body(context_id: u32, _size: usize, eos: u32) -> u32 {
    if eos != 0 {
        release(context_id);
    }
    0
}

#[no_mangle]
pub extern "C" fn proxy_on_delete(context_id: u32) {
    release(context_id);
    STATE.with(|s| s.borrow_mut().streams.remove(&context_id));
}

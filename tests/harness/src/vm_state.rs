//! The host-side state of one VM instance (one Envoy worker, or the main
//! thread for the singleton) and of the HTTP streams it is filtering.

use crate::abi::{Headers, Status};
use crate::world::{Delivered, World};
use std::cell::RefCell;
use std::collections::{HashMap, HashSet, VecDeque};
use std::rc::Rc;
use wasmtime::{Memory, TypedFunc};

/// Which module callback is running; decides what the host calls may touch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Callback {
    None,
    Initialize,
    ContextCreate,
    VmStart,
    Configure,
    Tick,
    QueueReady,
    HttpCallResponse,
    RequestHeaders,
    RequestBody,
    ResponseHeaders,
    ResponseBody,
    Done,
    Log,
    Delete,
    ForeignFunction,
}

/// A local reply the module asked for with `proxy_send_local_response`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LocalReply {
    pub status: u32,
    pub details: String,
    pub body: Vec<u8>,
    pub headers: Headers,
    pub grpc_status: i32,
}

/// Effects Envoy applies after the VM call returns (its
/// `addAfterVmCallAction`): continuing, local replies and resets never
/// re-enter the module from inside a host call.
#[derive(Clone, Debug)]
pub enum Deferred {
    ContinueRequest(u32),
    ContinueResponse(u32),
    LocalReply(u32, LocalReply),
    ResetStream(u32),
}

/// One HTTP stream as the filter chain sees it, with only this filter and
/// the router in it.
#[derive(Default, Debug, Clone)]
pub struct Stream {
    pub request_headers: Headers,
    /// Headers went upstream; from then on Envoy refuses writes to them.
    pub request_headers_forwarded: bool,
    /// The request headers the router saw (what the module set is here).
    pub upstream_request_headers: Option<Headers>,
    /// Body Envoy buffers for this filter (what `get_buffer(HttpRequestBody)`
    /// returns).
    pub request_body: Vec<u8>,
    pub request_body_visible: bool,
    /// Body bytes that went upstream.
    pub upstream_body: Vec<u8>,
    /// The request's end of stream has been delivered to the filter.
    pub request_end_seen: bool,
    /// The end of stream has gone upstream.
    pub request_complete_upstream: bool,
    /// Headers returned Pause without `allow_on_headers_stop_iteration`:
    /// Envoy stops all iteration, and body chunks wait (not delivered).
    pub stopped_all: bool,
    /// The filter is holding the request (Pause) until it continues.
    pub decoding_paused: bool,
    /// Chunks Envoy holds while the filter has stopped all iteration.
    pub held_chunks: VecDeque<(Vec<u8>, bool)>,
    pub response_headers: Option<Headers>,
    pub response_headers_forwarded: bool,
    pub response_body: Vec<u8>,
    pub response_body_visible: bool,
    pub encoding_paused: bool,
    /// What the client got.
    pub downstream_headers: Option<Headers>,
    pub downstream_body: Vec<u8>,
    pub response_complete: bool,
    /// The last local reply the module asked for.
    pub local_reply: Option<LocalReply>,
    /// The stream was reset (client abort, upstream reset after headers,
    /// the module's close_stream).
    pub reset: bool,
    /// on_done / on_log / on_delete have been delivered.
    pub ended: bool,
    pub in_log_phase: bool,
}

pub struct VmState {
    pub index: usize,
    pub name: String,
    pub vm_id: String,
    pub root_id: String,
    pub root_context: u32,
    pub next_context: u32,
    pub vm_config: Vec<u8>,
    pub plugin_config: Vec<u8>,
    /// Envoy 1.35+: `allow_on_headers_stop_iteration` on the filter config.
    pub allow_on_headers_stop_iteration: bool,
    /// `per_connection_buffer_limit_bytes` (Envoy's default is 1 MiB).
    pub buffer_limit_bytes: usize,
    pub world: Rc<RefCell<World>>,
    pub contexts: HashSet<u32>,
    /// The context whose callback runs now.
    pub current: u32,
    /// Set by `proxy_set_effective_context`, reset after each callback.
    pub effective: u32,
    pub callback: Callback,
    pub streams: HashMap<u32, Stream>,
    /// The response `proxy_on_http_call_response` is reading.
    pub call_response: Option<Delivered>,
    pub tick_period_ms: u32,
    pub next_tick_ns: Option<u64>,
    pub deferred: Vec<Deferred>,
    /// `proxy_send_local_response` makes Envoy stop the current iteration
    /// whatever the callback returns.
    pub stop_iteration: bool,
    pub properties: HashMap<String, Vec<u8>>,
    pub metric_ids: HashMap<u32, String>,
    pub next_metric_id: [u32; 3],
    /// splitmix64 state for WASI `random_get` (seeded: runs repeat).
    pub rng: u64,
    pub env: Vec<(String, String)>,
    /// `proxy_get_status` after a failed http call.
    pub status: (u32, String),
    pub memory: Option<Memory>,
    pub alloc: Option<TypedFunc<i32, i32>>,
    /// Calls across the VM boundary, counted by a store call hook.
    pub crossings: Crossings,
}

/// Calls across a VM's boundary. In Envoy each one is a V8 call with its
/// wrappers, a few thousand instructions (docs/benchmarks.md).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Crossings {
    /// Host → module: callbacks, and the allocation callbacks the host
    /// makes to hand data back (`proxy_on_memory_allocate`).
    pub entries: u64,
    /// Module → host: every ABI and WASI import called.
    pub host_calls: u64,
}

impl VmState {
    /// The context host calls act on: the effective one if the module set it.
    pub fn context(&self) -> u32 {
        if self.effective != 0 && self.contexts.contains(&self.effective) {
            self.effective
        } else {
            self.current
        }
    }

    pub fn stream_mut(&mut self) -> Result<&mut Stream, Status> {
        let id = self.context();
        self.streams.get_mut(&id).ok_or(Status::BadArgument)
    }

    pub fn stream(&self) -> Result<&Stream, Status> {
        self.streams.get(&self.context()).ok_or(Status::BadArgument)
    }

    pub fn next_random(&mut self) -> u64 {
        self.rng = self.rng.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.rng;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
}

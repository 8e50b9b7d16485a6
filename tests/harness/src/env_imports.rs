//! The `env` imports: proxy-wasm ABI 0.2.1, host side.
//!
//! Each function follows what Envoy (through proxy-wasm-cpp-host) does; the
//! README lists the rules and where they come from. Status codes that the
//! Rust SDK does not expect make the SDK panic, so returning the same code as
//! Envoy matters: a module that would crash in Envoy crashes here too.

use crate::abi::{self, BufferType, Headers, MapType, Status};
use crate::http_call::HttpCallRequest;
use crate::shared_data::QueueOwner;
use crate::vm_state::{Callback, Deferred, LocalReply, VmState};
use crate::world::{Delivered, Metric, MetricKind, PendingCall};
use wasmtime::{Caller, Linker};

pub type C<'a> = Caller<'a, VmState>;

/// Why a host call did not return Ok: a status for the module, or a trap.
pub enum Fail {
    Status(Status),
    Trap(wasmtime::Error),
}

impl From<Status> for Fail {
    fn from(s: Status) -> Fail {
        Fail::Status(s)
    }
}

impl From<wasmtime::Error> for Fail {
    fn from(e: wasmtime::Error) -> Fail {
        Fail::Trap(e)
    }
}

pub type R<T> = Result<T, Fail>;

pub fn finish(r: R<()>) -> wasmtime::Result<i32> {
    match r {
        Ok(()) => Ok(Status::Ok as i32),
        Err(Fail::Status(s)) => Ok(s as i32),
        Err(Fail::Trap(e)) => Err(e),
    }
}

/// Runs a host call body written with `?` and turns its outcome into the
/// status code (or trap) the module gets.
pub fn attempt(body: impl FnOnce() -> R<()>) -> wasmtime::Result<i32> {
    finish(body())
}

pub fn read(c: &mut C, ptr: i32, len: i32) -> R<Vec<u8>> {
    let memory = c.data().memory.ok_or(Status::InvalidMemoryAccess)?;
    let data = memory.data(&*c);
    let start = ptr as u32 as usize;
    let end = start
        .checked_add(len as u32 as usize)
        .ok_or(Status::InvalidMemoryAccess)?;
    Ok(data
        .get(start..end)
        .ok_or(Status::InvalidMemoryAccess)?
        .to_vec())
}

pub fn read_str(c: &mut C, ptr: i32, len: i32) -> R<String> {
    Ok(String::from_utf8_lossy(&read(c, ptr, len)?).into_owned())
}

pub fn write(c: &mut C, ptr: i32, bytes: &[u8]) -> R<()> {
    let memory = c.data().memory.ok_or(Status::InvalidMemoryAccess)?;
    let data = memory.data_mut(&mut *c);
    let start = ptr as u32 as usize;
    let slot = data
        .get_mut(start..start + bytes.len())
        .ok_or(Status::InvalidMemoryAccess)?;
    slot.copy_from_slice(bytes);
    Ok(())
}

pub fn write_u32(c: &mut C, ptr: i32, v: u32) -> R<()> {
    write(c, ptr, &v.to_le_bytes())
}

pub fn write_u64(c: &mut C, ptr: i32, v: u64) -> R<()> {
    write(c, ptr, &v.to_le_bytes())
}

/// Envoy's `copyToPointerSize`: allocate in the VM with
/// `proxy_on_memory_allocate`, copy, write pointer and size. An empty value
/// is returned as (null, 0) without allocating.
pub fn copy_out(c: &mut C, bytes: &[u8], ptr_ptr: i32, size_ptr: i32) -> R<()> {
    let mut pointer = 0i32;
    if !bytes.is_empty() {
        let alloc = c.data().alloc.clone().ok_or(Status::InvalidMemoryAccess)?;
        pointer = alloc.call(&mut *c, bytes.len() as i32)?;
        if pointer == 0 {
            return Err(Status::InvalidMemoryAccess.into());
        }
        write(c, pointer, bytes)?;
    }
    write_u32(c, ptr_ptr, pointer as u32)?;
    write_u32(c, size_ptr, bytes.len() as u32)
}

fn world<'a>(c: &'a C<'_>) -> std::cell::RefMut<'a, crate::world::World> {
    c.data().world.borrow_mut()
}

/// Which header map the module may read (write = false) or change now.
fn with_map<T>(c: &mut C, map: i32, write: bool, f: impl FnOnce(&mut Headers) -> T) -> R<T> {
    let map = MapType::from_abi(map).ok_or(Status::BadArgument)?;
    let state = c.data_mut();
    let callback = state.callback;
    match map {
        MapType::RequestHeaders => {
            let stream = state.stream_mut()?;
            if write && (stream.request_headers_forwarded || stream.in_log_phase) {
                state.world.borrow_mut().late_header_writes += 1;
                return Err(Status::BadArgument.into());
            }
            let stream = state.stream_mut()?;
            Ok(f(&mut stream.request_headers))
        }
        MapType::ResponseHeaders => {
            let stream = state.stream_mut()?;
            if write && (stream.response_headers_forwarded || stream.in_log_phase) {
                return Err(Status::BadArgument.into());
            }
            match stream.response_headers.as_mut() {
                Some(h) => Ok(f(h)),
                None => Err(Status::BadArgument.into()),
            }
        }
        MapType::RequestTrailers | MapType::ResponseTrailers => {
            state.stream_mut()?;
            // No trailers are modelled: an empty map; writes go nowhere.
            Ok(f(&mut Vec::new()))
        }
        MapType::HttpCallResponseHeaders | MapType::HttpCallResponseTrailers => {
            if callback != Callback::HttpCallResponse || write {
                return Err(Status::BadArgument.into());
            }
            match state.call_response.as_mut() {
                Some(Delivered::Response(h, _, t)) => {
                    if map == MapType::HttpCallResponseHeaders {
                        Ok(f(h))
                    } else {
                        Ok(f(t))
                    }
                }
                _ => Ok(f(&mut Vec::new())),
            }
        }
        MapType::GrpcInitialMetadata | MapType::GrpcTrailingMetadata => {
            Err(Status::BadArgument.into())
        }
    }
}

pub fn add_to_linker(linker: &mut Linker<VmState>) -> wasmtime::Result<()> {
    // ---- logging, time, ticks ---------------------------------------------
    linker.func_wrap(
        "env",
        "proxy_log",
        |mut c: C, level: i32, ptr: i32, len: i32| {
            attempt(|| {
                if !(0..=5).contains(&level) {
                    return Err(Status::BadArgument.into());
                }
                let message = read_str(&mut c, ptr, len)?;
                let name = c.data().name.clone();
                world(&c).log(&name, level as u32, message);
                Ok(())
            })
        },
    )?;
    linker.func_wrap("env", "proxy_get_log_level", |mut c: C, ptr: i32| {
        attempt(|| {
            let level = world(&c).log_level;
            write_u32(&mut c, ptr, level)
        })
    })?;
    linker.func_wrap(
        "env",
        "proxy_get_current_time_nanoseconds",
        |mut c: C, ptr: i32| {
            attempt(|| {
                let now = world(&c).now_ns;
                write_u64(&mut c, ptr, now)
            })
        },
    )?;
    linker.func_wrap(
        "env",
        "proxy_set_tick_period_milliseconds",
        |mut c: C, period: i32| {
            let now = world(&c).now_ns;
            let state = c.data_mut();
            state.tick_period_ms = period as u32;
            state.next_tick_ns = (period > 0).then(|| now + period as u32 as u64 * 1_000_000);
            Ok(Status::Ok as i32)
        },
    )?;

    // ---- buffers -----------------------------------------------------------
    linker.func_wrap(
        "env",
        "proxy_get_buffer_bytes",
        |mut c: C, kind: i32, start: i32, max: i32, ptr_ptr: i32, size_ptr: i32| {
            attempt(|| {
                let kind = BufferType::from_abi(kind).ok_or(Status::BadArgument)?;
                let bytes = buffer_view(c.data(), kind)?;
                let start = start as u32 as usize;
                let max = max as u32 as usize;
                if start.checked_add(max).is_none() {
                    return Err(Status::BadArgument.into());
                }
                let end = (start + max).min(bytes.len());
                let slice = if start >= end {
                    Vec::new()
                } else {
                    bytes[start..end].to_vec()
                };
                if slice.is_empty() {
                    // Envoy returns Ok without touching the out-pointers.
                    return Ok(());
                }
                copy_out(&mut c, &slice, ptr_ptr, size_ptr)
            })
        },
    )?;
    linker.func_wrap(
        "env",
        "proxy_set_buffer_bytes",
        |mut c: C, kind: i32, start: i32, size: i32, ptr: i32, len: i32| {
            attempt(|| {
                let kind = BufferType::from_abi(kind).ok_or(Status::BadArgument)?;
                let data = read(&mut c, ptr, len)?;
                let state = c.data_mut();
                let buffer = match kind {
                    BufferType::RequestBody => {
                        let s = state.stream_mut()?;
                        if !s.request_body_visible {
                            return Err(Status::NotFound.into());
                        }
                        &mut s.request_body
                    }
                    BufferType::ResponseBody => {
                        let s = state.stream_mut()?;
                        if !s.response_body_visible {
                            return Err(Status::NotFound.into());
                        }
                        &mut s.response_body
                    }
                    _ => return Err(Status::BadArgument.into()),
                };
                // Envoy's Buffer::copyFrom: prepend, replace all, or append.
                let (start, size) = (start as u32 as usize, size as u32 as usize);
                if start == 0 && size == 0 {
                    let mut v = data;
                    v.extend_from_slice(buffer);
                    *buffer = v;
                } else if start == 0 && size >= buffer.len() {
                    *buffer = data;
                } else if start >= buffer.len() {
                    buffer.extend_from_slice(&data);
                } else {
                    return Err(Status::BadArgument.into());
                }
                Ok(())
            })
        },
    )?;

    // ---- header maps -------------------------------------------------------
    linker.func_wrap(
        "env",
        "proxy_get_header_map_pairs",
        |mut c: C, map: i32, ptr_ptr: i32, size_ptr: i32| {
            attempt(|| {
                let pairs = with_map(&mut c, map, false, |h| h.clone())?;
                let bytes = if pairs.is_empty() {
                    Vec::new()
                } else {
                    abi::encode_pairs(&pairs)
                };
                copy_out(&mut c, &bytes, ptr_ptr, size_ptr)
            })
        },
    )?;
    linker.func_wrap(
        "env",
        "proxy_set_header_map_pairs",
        |mut c: C, map: i32, ptr: i32, len: i32| {
            attempt(|| {
                let bytes = read(&mut c, ptr, len)?;
                // cpp-host's toPairs turns a malformed buffer into no pairs.
                let pairs = abi::decode_pairs(&bytes).unwrap_or_default();
                with_map(&mut c, map, true, |h| {
                    *h = pairs
                        .into_iter()
                        .map(|(k, v)| (k.to_ascii_lowercase(), v))
                        .collect();
                })
            })
        },
    )?;
    linker.func_wrap(
        "env",
        "proxy_get_header_map_size",
        |mut c: C, map: i32, ptr: i32| {
            attempt(|| {
                let n = with_map(&mut c, map, false, |h| h.len())?;
                write_u32(&mut c, ptr, n as u32)
            })
        },
    )?;
    linker.func_wrap(
        "env",
        "proxy_get_header_map_value",
        |mut c: C, map: i32, kp: i32, kl: i32, ptr_ptr: i32, size_ptr: i32| {
            attempt(|| {
                let key = read_str(&mut c, kp, kl)?.to_ascii_lowercase();
                let value = with_map(&mut c, map, false, |h| {
                    h.iter().find(|(k, _)| *k == key).map(|(_, v)| v.clone())
                })?;
                match value {
                    None => Err(Status::NotFound.into()),
                    Some(v) => copy_out(&mut c, v.as_bytes(), ptr_ptr, size_ptr),
                }
            })
        },
    )?;
    linker.func_wrap(
        "env",
        "proxy_replace_header_map_value",
        |mut c: C, map: i32, kp: i32, kl: i32, vp: i32, vl: i32| {
            attempt(|| {
                let key = read_str(&mut c, kp, kl)?.to_ascii_lowercase();
                let value = read_str(&mut c, vp, vl)?;
                with_map(&mut c, map, true, |h| {
                    // Envoy's setCopy: the first entry takes the value, the rest go.
                    match h.iter().position(|(k, _)| *k == key) {
                        Some(at) => {
                            h[at].1 = value;
                            let mut seen = 0;
                            h.retain(|(k, _)| {
                                if *k == key {
                                    seen += 1;
                                    seen == 1
                                } else {
                                    true
                                }
                            });
                        }
                        None => h.push((key, value)),
                    }
                })
            })
        },
    )?;
    linker.func_wrap(
        "env",
        "proxy_add_header_map_value",
        |mut c: C, map: i32, kp: i32, kl: i32, vp: i32, vl: i32| {
            attempt(|| {
                let key = read_str(&mut c, kp, kl)?.to_ascii_lowercase();
                let value = read_str(&mut c, vp, vl)?;
                with_map(&mut c, map, true, |h| h.push((key, value)))
            })
        },
    )?;
    linker.func_wrap(
        "env",
        "proxy_remove_header_map_value",
        |mut c: C, map: i32, kp: i32, kl: i32| {
            attempt(|| {
                let key = read_str(&mut c, kp, kl)?.to_ascii_lowercase();
                with_map(&mut c, map, true, |h| h.retain(|(k, _)| *k != key))
            })
        },
    )?;

    // ---- properties --------------------------------------------------------
    linker.func_wrap(
        "env",
        "proxy_get_property",
        |mut c: C, pp: i32, pl: i32, ptr_ptr: i32, size_ptr: i32| {
            attempt(|| {
                let path = abi::property_path(&read(&mut c, pp, pl)?);
                let state = c.data();
                let value = match path.as_str() {
                    "plugin_root_id" => Some(state.root_id.clone().into_bytes()),
                    "plugin_vm_id" => Some(state.vm_id.clone().into_bytes()),
                    "plugin_name" => Some(state.root_id.clone().into_bytes()),
                    _ => state.properties.get(&path).cloned(),
                };
                match value {
                    None => Err(Status::NotFound.into()),
                    Some(v) => copy_out(&mut c, &v, ptr_ptr, size_ptr),
                }
            })
        },
    )?;
    linker.func_wrap(
        "env",
        "proxy_set_property",
        |mut c: C, pp: i32, pl: i32, vp: i32, vl: i32| {
            attempt(|| {
                let path = abi::property_path(&read(&mut c, pp, pl)?);
                let value = read(&mut c, vp, vl)?;
                c.data_mut().properties.insert(path, value);
                Ok(())
            })
        },
    )?;

    // ---- shared data -------------------------------------------------------
    linker.func_wrap(
        "env",
        "proxy_get_shared_data",
        |mut c: C, kp: i32, kl: i32, ptr_ptr: i32, size_ptr: i32, cas_ptr: i32| {
            attempt(|| {
                let key = read_str(&mut c, kp, kl)?;
                let vm_id = c.data().vm_id.clone();
                let entry = world(&c).shared.get(&vm_id, &key);
                let (value, cas) = entry.ok_or(Status::NotFound)?;
                copy_out(&mut c, &value, ptr_ptr, size_ptr)?;
                write_u32(&mut c, cas_ptr, cas)
            })
        },
    )?;
    linker.func_wrap(
        "env",
        "proxy_set_shared_data",
        |mut c: C, kp: i32, kl: i32, vp: i32, vl: i32, cas: i32| {
            attempt(|| {
                let key = read_str(&mut c, kp, kl)?;
                let value = read(&mut c, vp, vl)?;
                let (vm, vm_id) = (c.data().index, c.data().vm_id.clone());
                // A test hook runs first: another VM may act "at this instant".
                let hook = world(&c).take_set_hook(vm, &key);
                if let Some(action) = hook {
                    action();
                }
                match world(&c).shared.set(&vm_id, &key, &value, cas as u32) {
                    Status::Ok => Ok(()),
                    s => Err(s.into()),
                }
            })
        },
    )?;

    // ---- shared queues -----------------------------------------------------
    linker.func_wrap(
        "env",
        "proxy_register_shared_queue",
        |mut c: C, np: i32, nl: i32, token_ptr: i32| {
            attempt(|| {
                let name = read_str(&mut c, np, nl)?;
                let s = c.data();
                let owner = QueueOwner {
                    vm: s.index,
                    root_context: s.root_context,
                };
                let vm_id = s.vm_id.clone();
                let token = world(&c).queues.register(&vm_id, &name, owner);
                write_u32(&mut c, token_ptr, token)
            })
        },
    )?;
    linker.func_wrap(
        "env",
        "proxy_resolve_shared_queue",
        |mut c: C, vp: i32, vl: i32, np: i32, nl: i32, token_ptr: i32| {
            attempt(|| {
                let vm_id = read_str(&mut c, vp, vl)?;
                let name = read_str(&mut c, np, nl)?;
                let token = world(&c).queues.resolve(&vm_id, &name);
                write_u32(&mut c, token_ptr, token.ok_or(Status::NotFound)?)
            })
        },
    )?;
    linker.func_wrap(
        "env",
        "proxy_enqueue_shared_queue",
        |mut c: C, token: i32, vp: i32, vl: i32| {
            attempt(|| {
                let value = read(&mut c, vp, vl)?;
                match world(&c).queues.enqueue(token as u32, &value) {
                    Status::Ok => Ok(()),
                    s => Err(s.into()),
                }
            })
        },
    )?;
    linker.func_wrap(
        "env",
        "proxy_dequeue_shared_queue",
        |mut c: C, token: i32, ptr_ptr: i32, size_ptr: i32| {
            attempt(|| {
                let item = world(&c).queues.dequeue(token as u32);
                let item = item.map_err(Fail::Status)?;
                copy_out(&mut c, &item, ptr_ptr, size_ptr)
            })
        },
    )?;

    // ---- stream control ----------------------------------------------------
    linker.func_wrap("env", "proxy_continue_stream", |mut c: C, kind: i32| {
        attempt(|| {
            let state = c.data_mut();
            let id = state.context();
            state.stream()?;
            match kind {
                0 => state.deferred.push(Deferred::ContinueRequest(id)),
                1 => state.deferred.push(Deferred::ContinueResponse(id)),
                _ => return Err(Status::BadArgument.into()),
            }
            Ok(())
        })
    })?;
    linker.func_wrap("env", "proxy_close_stream", |mut c: C, kind: i32| {
        attempt(|| {
            let state = c.data_mut();
            let id = state.context();
            match kind {
                0 | 1 => {
                    if state.streams.contains_key(&id) {
                        state.deferred.push(Deferred::ResetStream(id));
                    }
                    Ok(())
                }
                2 | 3 => Ok(()),
                _ => Err(Status::BadArgument.into()),
            }
        })
    })?;
    linker.func_wrap(
        "env",
        "proxy_send_local_response",
        |mut c: C, status: i32, dp: i32, dl: i32, bp: i32, bl: i32, hp: i32, hl: i32, grpc: i32| {
            attempt(|| {
                let details = read_str(&mut c, dp, dl)?;
                let body = read(&mut c, bp, bl)?;
                let headers = abi::decode_pairs(&read(&mut c, hp, hl)?).unwrap_or_default();
                let state = c.data_mut();
                let id = state.context();
                let reply = LocalReply {
                    status: status as u32,
                    details,
                    body,
                    headers,
                    grpc_status: grpc,
                };
                // Envoy sends it only from a stream (decoder callbacks); on a
                // root context the call is a no-op that still returns Ok.
                if state.streams.contains_key(&id) {
                    state.deferred.push(Deferred::LocalReply(id, reply));
                    state.stop_iteration = true;
                }
                Ok(())
            })
        },
    )?;
    linker.func_wrap("env", "proxy_clear_route_cache", |_c: C| {
        Ok(Status::Ok as i32)
    })?;
    linker.func_wrap("env", "proxy_set_effective_context", |mut c: C, id: i32| {
        let state = c.data_mut();
        if state.contexts.contains(&(id as u32)) {
            state.effective = id as u32;
            Ok(Status::Ok as i32)
        } else {
            Ok(Status::BadArgument as i32)
        }
    })?;
    linker.func_wrap("env", "proxy_done", |_c: C| Ok(Status::Ok as i32))?;

    // ---- http calls --------------------------------------------------------
    linker.func_wrap(
        "env",
        "proxy_http_call",
        |mut c: C,
         up: i32,
         ul: i32,
         hp: i32,
         hl: i32,
         bp: i32,
         bl: i32,
         tp: i32,
         tl: i32,
         timeout_ms: i32,
         token_ptr: i32| {
            attempt(|| {
                let cluster = read_str(&mut c, up, ul)?;
                let headers = abi::decode_pairs(&read(&mut c, hp, hl)?).unwrap_or_default();
                let body = read(&mut c, bp, bl)?;
                let trailers = abi::decode_pairs(&read(&mut c, tp, tl)?).unwrap_or_default();
                let request = HttpCallRequest {
                    cluster,
                    headers,
                    body,
                    trailers,
                    timeout_ms: timeout_ms as u32,
                    vm: c.data().index,
                };
                // Envoy: unknown cluster, or no :method/:path/:authority → BadArgument.
                let has = |k: &str| request.headers.iter().any(|(h, _)| h == k);
                if !(has(":method") && has(":path") && has(":authority")) {
                    return Err(Status::BadArgument.into());
                }
                let (vm, context) = (c.data().index, c.data().root_context);
                let token = {
                    let mut w = world(&c);
                    if let Some(known) = &w.known_clusters {
                        if !known.contains(&request.cluster) {
                            return Err(Status::BadArgument.into());
                        }
                    }
                    w.next_call_token += 1;
                    let token = w.next_call_token;
                    let reply = match w.responder.as_mut() {
                        Some(responder) => responder(&request),
                        None => crate::http_call::HttpCallReply::Hang,
                    };
                    let (after_ms, delivered) = reply.resolve(request.timeout_ms);
                    let now = w.now_ns;
                    w.calls.push(PendingCall {
                        vm,
                        context,
                        token,
                        request,
                        due_ns: after_ms.map(|ms| now + ms * 1_000_000),
                        reply: delivered,
                    });
                    token
                };
                write_u32(&mut c, token_ptr, token)
            })
        },
    )?;
    linker.func_wrap(
        "env",
        "proxy_get_status",
        |mut c: C, code_ptr: i32, ptr_ptr: i32, size_ptr: i32| {
            attempt(|| {
                let (code, message) = c.data().status.clone();
                write_u32(&mut c, code_ptr, code)?;
                copy_out(&mut c, message.as_bytes(), ptr_ptr, size_ptr)
            })
        },
    )?;

    // ---- gRPC: not modelled (kvroute does not use it) ---------------------
    linker.func_wrap(
        "env",
        "proxy_grpc_call",
        |_c: C,
         _: i32,
         _: i32,
         _: i32,
         _: i32,
         _: i32,
         _: i32,
         _: i32,
         _: i32,
         _: i32,
         _: i32,
         _: i32,
         _: i32| { Ok(Status::Unimplemented as i32) },
    )?;
    linker.func_wrap(
        "env",
        "proxy_grpc_stream",
        |_c: C, _: i32, _: i32, _: i32, _: i32, _: i32, _: i32, _: i32, _: i32, _: i32| {
            Ok(Status::Unimplemented as i32)
        },
    )?;
    linker.func_wrap(
        "env",
        "proxy_grpc_send",
        |_c: C, _: i32, _: i32, _: i32, _: i32| Ok(Status::NotFound as i32),
    )?;
    linker.func_wrap("env", "proxy_grpc_cancel", |_c: C, _: i32| {
        Ok(Status::NotFound as i32)
    })?;
    linker.func_wrap("env", "proxy_grpc_close", |_c: C, _: i32| {
        Ok(Status::NotFound as i32)
    })?;

    // ---- foreign functions -------------------------------------------------
    linker.func_wrap(
        "env",
        "proxy_call_foreign_function",
        |mut c: C, np: i32, nl: i32, ap: i32, al: i32, ptr_ptr: i32, size_ptr: i32| {
            attempt(|| {
                let name = read_str(&mut c, np, nl)?;
                let args = read(&mut c, ap, al)?;
                let function = world(&c).foreign.remove(&name);
                let Some(mut function) = function else {
                    return Err(Status::NotFound.into());
                };
                let result = function(&args);
                world(&c).foreign.insert(name, function);
                let out = result.map_err(Fail::Status)?;
                copy_out(&mut c, &out, ptr_ptr, size_ptr)
            })
        },
    )?;

    // ---- metrics -----------------------------------------------------------
    linker.func_wrap(
        "env",
        "proxy_define_metric",
        |mut c: C, kind: i32, np: i32, nl: i32, id_ptr: i32| {
            attempt(|| {
                let kind_enum = match kind {
                    0 => MetricKind::Counter,
                    1 => MetricKind::Gauge,
                    2 => MetricKind::Histogram,
                    _ => return Err(Status::BadArgument.into()),
                };
                let name = read_str(&mut c, np, nl)?;
                // Envoy tags ids with the type in the low 2 bits, steps of 4.
                let state = c.data_mut();
                let id = state.next_metric_id[kind as usize];
                state.next_metric_id[kind as usize] += 4;
                state.metric_ids.insert(id, name.clone());
                world(&c).metrics.entry(name).or_insert(Metric {
                    kind: kind_enum,
                    value: 0,
                    samples: 0,
                });
                write_u32(&mut c, id_ptr, id)
            })
        },
    )?;
    linker.func_wrap(
        "env",
        "proxy_increment_metric",
        |c: C, id: i32, offset: i64| {
            attempt(|| {
                let name = c.data().metric_ids.get(&(id as u32)).cloned();
                let name = name.ok_or(Status::NotFound)?;
                let mut w = world(&c);
                let m = w.metrics.get_mut(&name).ok_or(Status::NotFound)?;
                match m.kind {
                    MetricKind::Counter if offset > 0 => m.value += offset,
                    MetricKind::Counter => return Err(Status::BadArgument.into()),
                    MetricKind::Gauge => m.value += offset,
                    MetricKind::Histogram => return Err(Status::BadArgument.into()),
                }
                Ok(())
            })
        },
    )?;
    linker.func_wrap("env", "proxy_record_metric", |c: C, id: i32, value: i64| {
        attempt(|| {
            let name = c.data().metric_ids.get(&(id as u32)).cloned();
            let name = name.ok_or(Status::NotFound)?;
            let mut w = world(&c);
            let m = w.metrics.get_mut(&name).ok_or(Status::NotFound)?;
            match m.kind {
                MetricKind::Counter => m.value += value,
                MetricKind::Gauge => m.value = value,
                MetricKind::Histogram => {
                    m.value = value;
                    m.samples += 1;
                }
            }
            Ok(())
        })
    })?;
    linker.func_wrap("env", "proxy_get_metric", |mut c: C, id: i32, ptr: i32| {
        attempt(|| {
            let name = c.data().metric_ids.get(&(id as u32)).cloned();
            let name = name.ok_or(Status::NotFound)?;
            let m = world(&c)
                .metrics
                .get(&name)
                .cloned()
                .ok_or(Status::NotFound)?;
            if m.kind == MetricKind::Histogram {
                return Err(Status::BadArgument.into());
            }
            write_u64(&mut c, ptr, m.value as u64)
        })
    })?;
    Ok(())
}

/// The bytes behind a buffer type right now, as Envoy would expose them.
fn buffer_view(state: &VmState, kind: BufferType) -> R<Vec<u8>> {
    match kind {
        BufferType::VmConfiguration => Ok(state.vm_config.clone()),
        BufferType::PluginConfiguration => {
            if state.callback == Callback::Configure {
                Ok(state.plugin_config.clone())
            } else {
                Err(Status::NotFound.into())
            }
        }
        BufferType::RequestBody => {
            let s = state.stream().map_err(|_| Status::NotFound)?;
            if s.request_body_visible {
                Ok(s.request_body.clone())
            } else {
                Err(Status::NotFound.into())
            }
        }
        BufferType::ResponseBody => {
            let s = state.stream().map_err(|_| Status::NotFound)?;
            if s.response_body_visible {
                Ok(s.response_body.clone())
            } else {
                Err(Status::NotFound.into())
            }
        }
        BufferType::HttpCallResponseBody => match (&state.callback, &state.call_response) {
            (Callback::HttpCallResponse, Some(Delivered::Response(_, body, _))) => Ok(body.clone()),
            (Callback::HttpCallResponse, _) => Ok(Vec::new()),
            _ => Err(Status::NotFound.into()),
        },
        _ => Err(Status::NotFound.into()),
    }
}

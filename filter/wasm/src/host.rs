//! The proxy-wasm ABI 0.2.1 calls kvroute makes, declared here so that every
//! status the host returns becomes a `Result` (a panic would kill the VM
//! for every request on the worker). Memory the host returns was allocated
//! through the module's `proxy_on_memory_allocate` ([`crate::abi`]), exactly
//! the size asked for, so it is taken back as a `Vec`.

use kvroute_shared_state::{Store, StoreError};
use std::fmt;
use std::ptr::{null, null_mut};

/// A host call that did not return `Ok`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HostError {
    pub call: &'static str,
    pub status: u32,
}

impl fmt::Display for HostError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let name = match self.status {
            1 => "NotFound",
            2 => "BadArgument",
            3 => "SerializationFailure",
            4 => "ParseFailure",
            7 => "Empty",
            8 => "CasMismatch",
            10 => "InternalFailure",
            12 => "Unimplemented",
            _ => "unknown status",
        };
        write!(f, "{} returned {} ({})", self.call, self.status, name)
    }
}

const OK: u32 = 0;
const NOT_FOUND: u32 = 1;
const CAS_MISMATCH: u32 = 8;

pub type HostResult<T> = Result<T, HostError>;

fn check(call: &'static str, status: u32) -> HostResult<()> {
    if status == OK {
        Ok(())
    } else {
        Err(HostError { call, status })
    }
}

#[derive(Clone, Copy)]
#[repr(u32)]
pub enum Map {
    RequestHeaders = 0,
    ResponseHeaders = 2,
    HttpCallResponseHeaders = 6,
}

#[derive(Clone, Copy)]
#[repr(u32)]
pub enum Buffer {
    RequestBody = 0,
    HttpCallResponseBody = 4,
    PluginConfiguration = 7,
}

#[derive(Clone, Copy)]
#[repr(u32)]
pub enum Level {
    Debug = 1,
    Info = 2,
    Warn = 3,
    Error = 4,
}

#[link(wasm_import_module = "env")]
extern "C" {
    fn proxy_log(level: u32, message_data: *const u8, message_size: usize) -> u32;
    fn proxy_get_current_time_nanoseconds(return_time: *mut u64) -> u32;
    fn proxy_set_tick_period_milliseconds(period: u32) -> u32;
    fn proxy_get_buffer_bytes(
        buffer_type: u32,
        start: usize,
        max_size: usize,
        return_buffer_data: *mut *mut u8,
        return_buffer_size: *mut usize,
    ) -> u32;
    fn proxy_get_header_map_value(
        map_type: u32,
        key_data: *const u8,
        key_size: usize,
        return_value_data: *mut *mut u8,
        return_value_size: *mut usize,
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
    fn proxy_get_property(
        path_data: *const u8,
        path_size: usize,
        return_value_data: *mut *mut u8,
        return_value_size: *mut usize,
    ) -> u32;
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
    fn proxy_send_local_response(
        status_code: u32,
        status_code_details_data: *const u8,
        status_code_details_size: usize,
        body_data: *const u8,
        body_size: usize,
        headers_data: *const u8,
        headers_size: usize,
        grpc_status: i32,
    ) -> u32;
    fn proxy_define_metric(
        metric_type: u32,
        name_data: *const u8,
        name_size: usize,
        return_id: *mut u32,
    ) -> u32;
    fn proxy_increment_metric(metric_id: u32, offset: i64) -> u32;
    fn proxy_http_call(
        upstream_data: *const u8,
        upstream_size: usize,
        headers_data: *const u8,
        headers_size: usize,
        body_data: *const u8,
        body_size: usize,
        trailers_data: *const u8,
        trailers_size: usize,
        timeout_milliseconds: u32,
        return_token: *mut u32,
    ) -> u32;
}

/// Takes ownership of a host-allocated buffer.
///
/// # Safety
/// `data` must be null or a pointer the host got from this module's
/// allocator for exactly `size` bytes.
unsafe fn take(data: *mut u8, size: usize) -> Option<Vec<u8>> {
    if data.is_null() {
        None
    } else {
        // SAFETY: per the function contract.
        Some(unsafe { Vec::from_raw_parts(data, size, size) })
    }
}

pub fn log(level: Level, message: &str) {
    // SAFETY: pointer and length of a live &str. A failed log has nowhere to go.
    let _ = unsafe { proxy_log(level as u32, message.as_ptr(), message.len()) };
}

/// Wall-clock time in ms since the Unix epoch.
pub fn now_ms() -> HostResult<u64> {
    let mut t: u64 = 0;
    // SAFETY: valid out-pointer.
    check("proxy_get_current_time_nanoseconds", unsafe {
        proxy_get_current_time_nanoseconds(&mut t)
    })?;
    Ok(t / 1_000_000)
}

/// Wall-clock time in ns (for seeding).
pub fn now_ns() -> HostResult<u64> {
    let mut t: u64 = 0;
    // SAFETY: valid out-pointer.
    check("proxy_get_current_time_nanoseconds", unsafe {
        proxy_get_current_time_nanoseconds(&mut t)
    })?;
    Ok(t)
}

pub fn set_tick_period_ms(ms: u32) -> HostResult<()> {
    // SAFETY: plain value.
    check("proxy_set_tick_period_milliseconds", unsafe {
        proxy_set_tick_period_milliseconds(ms)
    })
}

pub fn get_buffer(buffer: Buffer, start: usize, max: usize) -> HostResult<Option<Vec<u8>>> {
    let mut data = null_mut();
    let mut size = 0;
    // SAFETY: valid out-pointers.
    match unsafe { proxy_get_buffer_bytes(buffer as u32, start, max, &mut data, &mut size) } {
        // SAFETY: host-allocated per the ABI.
        OK => Ok(unsafe { take(data, size) }),
        NOT_FOUND => Ok(None),
        status => Err(HostError {
            call: "proxy_get_buffer_bytes",
            status,
        }),
    }
}

pub fn get_header(map: Map, key: &str) -> HostResult<Option<String>> {
    let mut data = null_mut();
    let mut size = 0;
    // SAFETY: valid pointers.
    match unsafe {
        proxy_get_header_map_value(map as u32, key.as_ptr(), key.len(), &mut data, &mut size)
    } {
        // SAFETY: host-allocated per the ABI.
        OK => Ok(unsafe { take(data, size) }.map(|v| String::from_utf8_lossy(&v).into_owned())),
        NOT_FOUND => Ok(None),
        status => Err(HostError {
            call: "proxy_get_header_map_value",
            status,
        }),
    }
}

pub fn set_header(map: Map, key: &str, value: &str) -> HostResult<()> {
    // SAFETY: valid pointers.
    check("proxy_replace_header_map_value", unsafe {
        proxy_replace_header_map_value(
            map as u32,
            key.as_ptr(),
            key.len(),
            value.as_ptr(),
            value.len(),
        )
    })
}

pub fn remove_header(map: Map, key: &str) -> HostResult<()> {
    // SAFETY: valid pointers.
    match unsafe { proxy_remove_header_map_value(map as u32, key.as_ptr(), key.len()) } {
        OK | NOT_FOUND => Ok(()),
        status => Err(HostError {
            call: "proxy_remove_header_map_value",
            status,
        }),
    }
}

/// Reads a property by path segments (e.g. `["plugin_root_id"]`).
pub fn get_property(path: &[&str]) -> HostResult<Option<Vec<u8>>> {
    let joined = path.join("\0");
    let mut data = null_mut();
    let mut size = 0;
    // SAFETY: valid pointers.
    match unsafe { proxy_get_property(joined.as_ptr(), joined.len(), &mut data, &mut size) } {
        // SAFETY: host-allocated per the ABI.
        OK => Ok(unsafe { take(data, size) }),
        NOT_FOUND => Ok(None),
        status => Err(HostError {
            call: "proxy_get_property",
            status,
        }),
    }
}

/// A whole header map, in one host call (instead of one call, plus one
/// allocation callback into the VM, per header read). It stays in the
/// host's serialised form: a lookup walks it and borrows, so reading a
/// request's headers allocates once, not twice per header.
pub fn get_headers(map: Map) -> HostResult<HeaderPairs> {
    let mut data = null_mut();
    let mut size = 0;
    // SAFETY: valid pointers.
    match unsafe { proxy_get_header_map_pairs(map as u32, &mut data, &mut size) } {
        // SAFETY: host-allocated per the ABI.
        OK => Ok(HeaderPairs(unsafe { take(data, size) }.unwrap_or_default())),
        NOT_FOUND => Ok(HeaderPairs(Vec::new())),
        status => Err(HostError {
            call: "proxy_get_header_map_pairs",
            status,
        }),
    }
}

/// A header map in [`serialize_pairs`]' format, read in place.
#[derive(Default)]
pub struct HeaderPairs(Vec<u8>);

impl HeaderPairs {
    /// The value of the first header named `name` (ASCII case-insensitive),
    /// if there is one; a value that is not UTF-8 reads as empty.
    pub fn get(&self, name: &str) -> Option<&str> {
        pairs(&self.0)
            .find(|(k, _)| k.eq_ignore_ascii_case(name.as_bytes()))
            .map(|(_, v)| std::str::from_utf8(v).unwrap_or_default())
    }
}

/// The pairs of [`serialize_pairs`]' format, borrowed; a malformed map
/// yields the pairs before the first malformed one (never panics).
fn pairs(b: &[u8]) -> impl Iterator<Item = (&[u8], &[u8])> {
    let u32_at = move |o: usize| {
        b.get(o..o.checked_add(4)?)
            .and_then(|s| s.try_into().ok())
            .map(|a: [u8; 4]| u32::from_le_bytes(a) as usize)
    };
    // Each pair takes at least 10 bytes: two lengths and two NULs.
    let n = u32_at(0).unwrap_or(0).min(b.len() / 10);
    let mut data = 4 + n * 8;
    (0..n).map_while(move |i| {
        let (kl, vl) = (u32_at(4 + i * 8)?, u32_at(8 + i * 8)?);
        let k = data;
        let v = k.saturating_add(kl).saturating_add(1);
        let key = b.get(k..k.saturating_add(kl))?;
        let value = b.get(v..v.saturating_add(vl))?;
        data = v.saturating_add(vl).saturating_add(1);
        Some((key, value))
    })
}

/// Proxy-wasm header map serialisation: count, (key len, value len)*, then
/// each key and value NUL-terminated.
fn serialize_pairs(pairs: &[(&str, &str)]) -> Vec<u8> {
    let mut out = Vec::with_capacity(
        4 + pairs
            .iter()
            .map(|(k, v)| k.len() + v.len() + 10)
            .sum::<usize>(),
    );
    out.extend_from_slice(&(pairs.len() as u32).to_le_bytes());
    for (k, v) in pairs {
        out.extend_from_slice(&(k.len() as u32).to_le_bytes());
        out.extend_from_slice(&(v.len() as u32).to_le_bytes());
    }
    for (k, v) in pairs {
        out.extend_from_slice(k.as_bytes());
        out.push(0);
        out.extend_from_slice(v.as_bytes());
        out.push(0);
    }
    out
}

pub fn send_local_response(status: u32, headers: &[(&str, &str)], body: &[u8]) -> HostResult<()> {
    let h = serialize_pairs(headers);
    // SAFETY: valid pointers.
    check("proxy_send_local_response", unsafe {
        proxy_send_local_response(
            status,
            null(),
            0,
            body.as_ptr(),
            body.len(),
            h.as_ptr(),
            h.len(),
            -1,
        )
    })
}

/// Starts an HTTP call (no body, no trailers); returns its token. The
/// answer comes to `proxy_on_http_call_response` of the calling root.
pub fn http_call(cluster: &str, headers: &[(&str, &str)], timeout_ms: u32) -> HostResult<u32> {
    let h = serialize_pairs(headers);
    let trailers = serialize_pairs(&[]);
    let mut token = 0;
    // SAFETY: valid pointers for the duration of the call.
    check("proxy_http_call", unsafe {
        proxy_http_call(
            cluster.as_ptr(),
            cluster.len(),
            h.as_ptr(),
            h.len(),
            null(),
            0,
            trailers.as_ptr(),
            trailers.len(),
            timeout_ms,
            &mut token,
        )
    })?;
    Ok(token)
}

pub fn define_counter(name: &str) -> HostResult<u32> {
    let mut id = 0;
    // SAFETY: valid pointers.
    check("proxy_define_metric", unsafe {
        proxy_define_metric(0, name.as_ptr(), name.len(), &mut id)
    })?;
    Ok(id)
}

pub fn increment(id: u32, by: i64) -> HostResult<()> {
    // SAFETY: plain values.
    check("proxy_increment_metric", unsafe {
        proxy_increment_metric(id, by)
    })
}

/// [`Store`] over Envoy shared data.
pub struct HostStore;

impl Store for HostStore {
    fn get(&self, key: &str) -> Result<Option<(Vec<u8>, u32)>, StoreError> {
        let mut data = null_mut();
        let mut size = 0;
        let mut cas = 0;
        // SAFETY: valid pointers.
        match unsafe {
            proxy_get_shared_data(key.as_ptr(), key.len(), &mut data, &mut size, &mut cas)
        } {
            // SAFETY: host-allocated per the ABI. A key set to an empty
            // value may come back as a null pointer.
            OK => Ok(Some((unsafe { take(data, size) }.unwrap_or_default(), cas))),
            NOT_FOUND => Ok(None),
            status => Err(StoreError::Host(
                HostError {
                    call: "proxy_get_shared_data",
                    status,
                }
                .to_string(),
            )),
        }
    }

    fn set(&self, key: &str, value: &[u8], cas: u32) -> Result<(), StoreError> {
        // SAFETY: valid pointers.
        match unsafe {
            proxy_set_shared_data(key.as_ptr(), key.len(), value.as_ptr(), value.len(), cas)
        } {
            OK => Ok(()),
            CAS_MISMATCH => Err(StoreError::CasMismatch),
            status => Err(StoreError::Host(
                HostError {
                    call: "proxy_set_shared_data",
                    status,
                }
                .to_string(),
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_pairs_round_trip_and_bad_maps_do_not_panic() {
        let pairs = [
            (":method", "POST"),
            (":path", "/v1/chat/completions"),
            ("x", ""),
        ];
        let b = serialize_pairs(&pairs);
        let back: Vec<(&[u8], &[u8])> = super::pairs(&b).collect();
        assert_eq!(
            back,
            pairs
                .iter()
                .map(|(k, v)| (k.as_bytes(), v.as_bytes()))
                .collect::<Vec<_>>()
        );
        for cut in 0..b.len() {
            assert!(super::pairs(&b[..cut]).count() <= pairs.len());
            let _ = HeaderPairs(b[..cut].to_vec()).get(":path");
        }
        assert!(super::pairs(&[0xff; 64]).count() <= 6);
        let map = HeaderPairs(b);
        assert_eq!(map.get(":PATH"), Some("/v1/chat/completions"));
        assert_eq!(map.get("x"), Some(""));
        assert_eq!(map.get("y"), None);
    }
}

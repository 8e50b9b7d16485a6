//! [`Host`] and [`Store`] over the proxy-wasm SDK's host calls.
//!
//! Each SDK call returns a `Result` with the host's status; it becomes a
//! [`HostError`] naming the ABI call. Two SDK behaviours shape this file:
//! - The SDK's `String` getters (`get_map`, `get_map_value`) unwrap UTF-8,
//!   and a client may send any octet in a header value, so headers are read
//!   as bytes (`get_map_bytes`, `get_map_value_bytes`).
//! - The SDK panics on a status that the ABI says a call cannot return
//!   (for example `proxy_log` answering anything but `Ok`). That is the
//!   SDK's contract with Envoy, not input a client controls.

use kvroute_core::lifecycle::{Host, HostError, HostResult, Level};
use kvroute_shared_state::{Store, StoreError};
use proxy_wasm::hostcalls;
use proxy_wasm::types::{BufferType, LogLevel, MapType, MetricType, Status};
use std::time::{Duration, UNIX_EPOCH};

/// The host as the SDK reaches it; stateless.
pub struct SdkHost;

fn err(call: &'static str) -> impl Fn(Status) -> HostError {
    move |s| HostError {
        call,
        status: s as u32,
    }
}

impl Store for SdkHost {
    fn get(&self, key: &str) -> Result<Option<(Vec<u8>, u32)>, StoreError> {
        match hostcalls::get_shared_data(key) {
            // Envoy gives every stored value a non-zero CAS; a key set to an
            // empty value may come back without bytes.
            Ok((Some(b), cas)) => Ok(Some((b, cas.unwrap_or(0)))),
            Ok((None, Some(cas))) => Ok(Some((Vec::new(), cas))),
            Ok((None, None)) => Ok(None),
            Err(s) => Err(StoreError::Host(
                err("proxy_get_shared_data")(s).to_string(),
            )),
        }
    }

    fn set(&self, key: &str, value: &[u8], cas: u32) -> Result<(), StoreError> {
        match hostcalls::set_shared_data(key, Some(value), (cas != 0).then_some(cas)) {
            Ok(()) => Ok(()),
            Err(Status::CasMismatch) => Err(StoreError::CasMismatch),
            Err(s) => Err(StoreError::Host(
                err("proxy_set_shared_data")(s).to_string(),
            )),
        }
    }
}

impl Host for SdkHost {
    fn store(&self) -> &dyn Store {
        self
    }

    fn now_ns(&self) -> HostResult<u64> {
        let t = hostcalls::get_current_time().map_err(err("proxy_get_current_time_nanoseconds"))?;
        // A clock before 1970 reads as 0 (the core then keeps its last time).
        Ok(t.duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos().min(u128::from(u64::MAX)) as u64))
    }

    fn log(&self, level: Level, message: &str) {
        let level = match level {
            Level::Debug => LogLevel::Debug,
            Level::Info => LogLevel::Info,
            Level::Warn => LogLevel::Warn,
            Level::Error => LogLevel::Error,
        };
        // A log line the host refuses has nowhere else to go.
        if hostcalls::log(level, message).is_err() {}
    }

    fn set_tick_period_ms(&self, ms: u32) -> HostResult<()> {
        hostcalls::set_tick_period(Duration::from_millis(u64::from(ms)))
            .map_err(err("proxy_set_tick_period_milliseconds"))
    }

    fn plugin_configuration(&self) -> HostResult<Option<Vec<u8>>> {
        hostcalls::get_buffer(BufferType::PluginConfiguration, 0, usize::MAX)
            .map_err(err("proxy_get_buffer_bytes"))
    }

    fn root_id(&self) -> HostResult<Option<Vec<u8>>> {
        hostcalls::get_property(vec!["plugin_root_id"]).map_err(err("proxy_get_property"))
    }

    fn request_headers(&self) -> HostResult<Vec<(String, Vec<u8>)>> {
        hostcalls::get_map_bytes(MapType::HttpRequestHeaders)
            .map_err(err("proxy_get_header_map_pairs"))
    }

    fn remove_request_header(&self, name: &str) -> HostResult<()> {
        hostcalls::remove_map_value(MapType::HttpRequestHeaders, name)
            .map_err(err("proxy_remove_header_map_value"))
    }

    fn set_request_header(&self, name: &str, value: &str) -> HostResult<()> {
        hostcalls::set_map_value(MapType::HttpRequestHeaders, name, Some(value))
            .map_err(err("proxy_replace_header_map_value"))
    }

    fn set_response_header(&self, name: &str, value: &str) -> HostResult<()> {
        hostcalls::set_map_value(MapType::HttpResponseHeaders, name, Some(value))
            .map_err(err("proxy_replace_header_map_value"))
    }

    fn response_header(&self, name: &str) -> HostResult<Option<Vec<u8>>> {
        hostcalls::get_map_value_bytes(MapType::HttpResponseHeaders, name)
            .map_err(err("proxy_get_header_map_value"))
    }

    fn upstream_address(&self) -> HostResult<Option<Vec<u8>>> {
        hostcalls::get_property(vec!["upstream", "address"]).map_err(err("proxy_get_property"))
    }

    fn request_body(&self, size: usize) -> HostResult<Option<Vec<u8>>> {
        hostcalls::get_buffer(BufferType::HttpRequestBody, 0, size)
            .map_err(err("proxy_get_buffer_bytes"))
    }

    fn send_json_response(&self, status: u32, body: &str) -> HostResult<()> {
        hostcalls::send_http_response(
            status,
            vec![("content-type", "application/json")],
            Some(body.as_bytes()),
        )
        .map_err(err("proxy_send_local_response"))
    }

    fn send_json_response_with(
        &self,
        status: u32,
        body: &str,
        headers: &[(&str, &str)],
    ) -> HostResult<()> {
        let mut h = vec![("content-type", "application/json")];
        h.extend_from_slice(headers);
        hostcalls::send_http_response(status, h, Some(body.as_bytes()))
            .map_err(err("proxy_send_local_response"))
    }

    fn set_effective_context(&self, context_id: u32) -> HostResult<()> {
        hostcalls::set_effective_context(context_id).map_err(err("proxy_set_effective_context"))
    }

    fn resume_request(&self) -> HostResult<()> {
        hostcalls::resume_http_request().map_err(err("proxy_continue_stream"))
    }

    fn http_call(
        &self,
        cluster: &str,
        headers: &[(&str, &str)],
        timeout_ms: u32,
    ) -> HostResult<u32> {
        hostcalls::dispatch_http_call(
            cluster,
            headers.to_vec(),
            None,
            Vec::new(),
            Duration::from_millis(u64::from(timeout_ms)),
        )
        .map_err(err("proxy_http_call"))
    }

    fn http_post(
        &self,
        cluster: &str,
        headers: &[(&str, &str)],
        body: &[u8],
        timeout_ms: u32,
    ) -> HostResult<u32> {
        hostcalls::dispatch_http_call(
            cluster,
            headers.to_vec(),
            Some(body),
            Vec::new(),
            Duration::from_millis(u64::from(timeout_ms)),
        )
        .map_err(err("proxy_http_call"))
    }

    fn http_call_status(&self) -> HostResult<Option<String>> {
        hostcalls::get_map_value_bytes(MapType::HttpCallResponseHeaders, ":status")
            .map(|v| v.map(|b| String::from_utf8_lossy(&b).into_owned()))
            .map_err(err("proxy_get_header_map_value"))
    }

    fn http_call_body(&self, size: usize) -> HostResult<Option<Vec<u8>>> {
        hostcalls::get_buffer(BufferType::HttpCallResponseBody, 0, size)
            .map_err(err("proxy_get_buffer_bytes"))
    }

    fn register_queue(&self, name: &str) -> HostResult<u32> {
        hostcalls::register_shared_queue(name).map_err(err("proxy_register_shared_queue"))
    }

    fn resolve_queue(&self, name: &str) -> HostResult<Option<u32>> {
        let vm_id = hostcalls::get_property(vec!["plugin_vm_id"])
            .map_err(err("proxy_get_property"))?
            .unwrap_or_default();
        // Envoy answers `NotFound` for a name nobody registered: the SDK
        // maps it to `None`.
        hostcalls::resolve_shared_queue(&String::from_utf8_lossy(&vm_id), name)
            .map_err(err("proxy_resolve_shared_queue"))
    }

    fn enqueue(&self, queue: u32, value: &[u8]) -> HostResult<()> {
        hostcalls::enqueue_shared_queue(queue, Some(value))
            .map_err(err("proxy_enqueue_shared_queue"))
    }

    fn dequeue(&self, queue: u32) -> HostResult<Option<Vec<u8>>> {
        hostcalls::dequeue_shared_queue(queue).map_err(err("proxy_dequeue_shared_queue"))
    }

    fn define_counter(&self, name: &str) -> HostResult<u32> {
        hostcalls::define_metric(MetricType::Counter, name).map_err(err("proxy_define_metric"))
    }

    fn increment_counter(&self, id: u32, by: i64) -> HostResult<()> {
        hostcalls::increment_metric(id, by).map_err(err("proxy_increment_metric"))
    }

    fn define_gauge(&self, name: &str) -> HostResult<u32> {
        hostcalls::define_metric(MetricType::Gauge, name).map_err(err("proxy_define_metric"))
    }

    fn define_histogram(&self, name: &str) -> HostResult<u32> {
        hostcalls::define_metric(MetricType::Histogram, name).map_err(err("proxy_define_metric"))
    }

    fn record_metric(&self, id: u32, value: u64) -> HostResult<()> {
        hostcalls::record_metric(id, value).map_err(err("proxy_record_metric"))
    }
}

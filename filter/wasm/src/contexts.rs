//! The SDK's contexts: one root per plugin (filter or collector, by
//! `root_id`) and one HTTP context per request. Each callback hands off to
//! `kvroute_core::lifecycle` at once.

use crate::host::SdkHost;
use kvroute_core::lifecycle::{self, Action as CoreAction, Host, Level, Role, Stream};
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, ContextType, LogLevel};

proxy_wasm::main! {{
    proxy_wasm::set_log_level(LogLevel::Info);
    proxy_wasm::set_root_context(|_| -> Box<dyn RootContext> { Box::new(Root::default()) });
}}

fn action(a: CoreAction) -> Action {
    match a {
        CoreAction::Continue => Action::Continue,
        CoreAction::Pause => Action::Pause,
    }
}

#[derive(Default)]
struct Root {
    role: Option<Role>,
}

impl Context for Root {
    fn on_http_call_response(
        &mut self,
        token_id: u32,
        num_headers: usize,
        body_size: usize,
        _num_trailers: usize,
    ) {
        if let Some(role) = &mut self.role {
            role.on_http_call_response(&SdkHost, token_id, num_headers, body_size);
        }
    }

    /// The VM is going away: hand over what was counted since the last
    /// tick; a collector takes back its `kvroute_collector_leader`.
    fn on_done(&mut self) -> bool {
        if let Some(role) = &mut self.role {
            role.on_done(&SdkHost);
        }
        true
    }
}

impl RootContext for Root {
    fn on_configure(&mut self, _plugin_configuration_size: usize) -> bool {
        match lifecycle::configure(&SdkHost) {
            Ok(role) => {
                self.role = Some(role);
                true
            }
            Err(e) => {
                SdkHost.log(Level::Error, &e);
                false
            }
        }
    }

    fn on_tick(&mut self) {
        if let Some(role) = &mut self.role {
            role.on_tick(&SdkHost);
        }
    }

    fn on_queue_ready(&mut self, queue_id: u32) {
        if let Some(role) = &mut self.role {
            role.on_queue_ready(&SdkHost, queue_id);
        }
    }

    /// A stream of an unconfigured root (or of the collector) passes every
    /// request on untouched.
    fn create_http_context(&self, context_id: u32) -> Option<Box<dyn HttpContext>> {
        let worker = self.role.as_ref().and_then(Role::worker);
        Some(Box::new(Request(Stream::new(worker).with_id(context_id))))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

struct Request(Stream);

impl Context for Request {
    /// The stream is over, whatever ended it: release what it still holds.
    fn on_done(&mut self) -> bool {
        self.0.on_end(&SdkHost);
        true
    }
}

/// `proxy_on_delete` drops the context: a host that deletes a stream
/// without `proxy_on_done` still gets its charge back (a no-op otherwise).
impl Drop for Request {
    fn drop(&mut self) {
        self.0.on_end(&SdkHost);
    }
}

impl HttpContext for Request {
    fn on_http_request_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        action(self.0.on_request_headers(&SdkHost, end_of_stream))
    }

    fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        action(self.0.on_request_body(&SdkHost, body_size, end_of_stream))
    }

    fn on_http_request_trailers(&mut self, _num_trailers: usize) -> Action {
        action(self.0.on_request_trailers(&SdkHost))
    }

    fn on_http_response_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        action(self.0.on_response_headers(&SdkHost, end_of_stream))
    }

    fn on_http_response_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        action(self.0.on_response_body(&SdkHost, body_size, end_of_stream))
    }
}

//! One request through the filter.
//!
//! headers → (strip client destination header; Pause if routable) → body
//! chunks buffered to end of stream → `Engine::route` → destination header,
//! Continue → first response body byte: release the prompt charge → end of
//! response, or `proxy_on_delete` on any other exit: release the rest. The
//! release flags make every exit path release exactly once.
//!
//! A non-streaming request (`"stream"` absent or false) releases everything
//! at its first response body byte, in one write: the model server sends
//! such a body only once the request has finished, so prefill and decode
//! are both over by then, and a second read-modify-write of the load table
//! a few microseconds later (at the end of the stream) would only cost
//! three more VM crossings per request.

use crate::abi::Action;
use crate::host::{self, Buffer, Level, Map};
use crate::root::Shared;
use crate::stats::Counter;
use kvroute_core::engine::{Outcome, Unrouted};
use kvroute_core::request::{ApiKind, ParseError};
use kvroute_shared_state::load::Ticket;
use std::rc::Rc;

/// Response header carrying the decision explanation (`routing.debugHeader`).
pub const DECISION_HEADER: &str = "x-kvroute-decision";

pub struct RouteContext {
    shared: Option<Rc<Shared>>,
    /// Set once the request is known to be routable.
    kind: Option<ApiKind>,
    ticket: Option<Ticket>,
    /// The routed request asked for a streamed response.
    streaming: bool,
    prompt_released: bool,
    done: bool,
    explanation: Option<String>,
    /// Stop buffering (body too large in fail-open mode).
    passthrough: bool,
}

impl RouteContext {
    pub fn new(shared: Option<Rc<Shared>>) -> Self {
        RouteContext {
            shared,
            kind: None,
            ticket: None,
            streaming: false,
            prompt_released: false,
            done: false,
            explanation: None,
            passthrough: false,
        }
    }

    fn host_error(&self, what: &str, e: impl std::fmt::Display) {
        host::log(Level::Warn, &format!("kvroute: {what}: {e}"));
        if let Some(s) = &self.shared {
            s.stats.inc(Counter::HostErrors);
        }
    }

    fn release_prompt(&mut self) {
        if self.prompt_released || self.done {
            return;
        }
        self.prompt_released = true;
        if let (Some(s), Some(t)) = (&self.shared, &self.ticket) {
            match s.engine.release_prompt(&host::HostStore, t) {
                Ok(retries) => s.stats.add(Counter::CasRetries, u64::from(retries)),
                Err(e) => self.host_error("releasing the prompt charge", e),
            }
        }
    }

    fn release_rest(&mut self) {
        if self.done {
            return;
        }
        self.done = true;
        if let (Some(s), Some(t)) = (&self.shared, &self.ticket) {
            match s
                .engine
                .release_rest(&host::HostStore, t, self.prompt_released)
            {
                Ok(retries) => s.stats.add(Counter::CasRetries, u64::from(retries)),
                Err(e) => self.host_error("releasing the request charge", e),
            }
        }
    }

    /// Answers locally; returns Pause (the local reply ends the request).
    fn reply(&self, status: u32, body: &str) -> Action {
        if let Err(e) = host::send_local_response(
            status,
            &[("content-type", "application/json")],
            body.as_bytes(),
        ) {
            self.host_error("sending a local response", e);
            return Action::Continue;
        }
        Action::Pause
    }

    fn unrouted(&self, shared: &Shared, why: &Unrouted) -> Action {
        shared.stats.inc(Counter::FailOpen);
        host::log(
            Level::Debug,
            &format!(
                "kvroute: not routed ({}), Envoy's load balancer decides",
                why.label()
            ),
        );
        Action::Continue
    }

    /// The context's end (`proxy_on_delete`), on every exit path: releases
    /// what the request still holds.
    pub fn on_delete(&mut self) {
        self.release_rest();
    }

    pub fn on_request_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        let Some(shared) = self.shared.clone() else {
            return Action::Continue;
        };
        let routing = &shared.engine.config.routing;
        // One host call for the whole map: every header read costs a call
        // plus an allocation callback into the VM.
        let (headers, unread) = match host::get_headers(Map::RequestHeaders) {
            Ok(h) => (h, false),
            Err(e) => {
                self.host_error("reading request headers", e);
                (host::HeaderPairs::default(), true)
            }
        };
        let header = |name: &str| headers.get(name);
        // Never trust a client-supplied destination, routed or not.
        // (Headers that could not be read may hold one: remove it blind.)
        if unread || header(&routing.destination_header).is_some() {
            if !unread {
                shared.stats.inc(Counter::ClientHeaderStripped);
            }
            if let Err(e) = host::remove_header(Map::RequestHeaders, &routing.destination_header) {
                // Cannot strip it: refuse rather than let the client pick.
                self.host_error("removing the client's destination header", e);
                return self.reply(
                    500,
                    &kvroute_core::engine::openai_error("internal error", "internal_error", 500),
                );
            }
        }
        let method = header(":method").unwrap_or_default();
        let path = header(":path").unwrap_or_default();

        if let Some(state_path) = &routing.state_path {
            let bare = path.split('?').next().unwrap_or("");
            if method == "GET" && bare == state_path {
                let now = host::now_ms().unwrap_or(0);
                return match shared.engine.state_json(&host::HostStore, now) {
                    Ok(body) => self.reply(200, &body),
                    Err(e) => self.reply(
                        503,
                        &kvroute_core::engine::openai_error(
                            &e.to_string(),
                            "service_unavailable",
                            503,
                        ),
                    ),
                };
            }
        }
        if method != "POST" {
            return Action::Continue;
        }
        let bare = path.split(['?', '#']).next().unwrap_or("");
        let configured = routing.paths.iter().any(|p| {
            bare.trim_end_matches('/')
                .ends_with(p.trim_end_matches('/'))
        });
        let Some(kind) = ApiKind::from_path(bare).filter(|_| configured) else {
            return Action::Continue;
        };
        if end_of_stream {
            // A POST without a body cannot be routed.
            return match shared.engine.fail_for(Unrouted::BadBody(ParseError::Empty)) {
                Outcome::Reject { status, body, .. } => {
                    shared.stats.inc(Counter::Rejected);
                    self.reply(status, &body)
                }
                _ => self.unrouted(&shared, &Unrouted::BadBody(ParseError::Empty)),
            };
        }
        self.kind = Some(kind);
        Action::Pause
    }

    pub fn on_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        let (Some(shared), Some(kind)) = (self.shared.clone(), self.kind) else {
            return Action::Continue;
        };
        if self.passthrough || self.ticket.is_some() {
            return Action::Continue;
        }
        let limit = shared.engine.config.routing.max_body_bytes;
        if body_size > limit {
            let why = Unrouted::BadBody(ParseError::TooLarge {
                limit,
                actual: body_size,
            });
            self.kind = None;
            return match shared.engine.fail_for(why.clone()) {
                Outcome::Reject { body, .. } => {
                    shared.stats.inc(Counter::Rejected);
                    self.reply(413, &body)
                }
                _ => {
                    self.passthrough = true;
                    self.unrouted(&shared, &why)
                }
            };
        }
        if !end_of_stream {
            return Action::Pause;
        }
        let body = match host::get_buffer(Buffer::RequestBody, 0, body_size) {
            Ok(b) => b.unwrap_or_default(),
            Err(e) => {
                self.host_error("reading the request body", e);
                Vec::new()
            }
        };
        let now = host::now_ms().unwrap_or(0);
        let outcome = {
            let mut rng = shared.rng.borrow_mut();
            shared
                .engine
                .route(&host::HostStore, kind, &body, now, &mut rng)
        };
        match outcome {
            Outcome::Routed(r) => {
                let header = &shared.engine.config.routing.destination_header;
                if let Err(e) = host::set_header(Map::RequestHeaders, header, &r.destination) {
                    // The request goes on unrouted; give the charge back.
                    self.host_error("setting the destination header", e);
                    self.ticket = r.ticket;
                    self.release_rest();
                    return Action::Continue;
                }
                shared.stats.inc(Counter::Routed);
                shared
                    .stats
                    .add(Counter::CasRetries, u64::from(r.cas_retries));
                shared.stats.inc(match r.decision.branch.as_str() {
                    "sticky" => Counter::BranchSticky,
                    "saturation-release" => Counter::BranchSaturationRelease,
                    "no-affinity" => Counter::BranchNoAffinity,
                    "exploration" => Counter::BranchExploration,
                    _ => Counter::BranchOther,
                });
                if r.ticket.is_none() {
                    self.host_error("charging the endpoint", "shared data refused the write");
                }
                self.ticket = r.ticket;
                self.streaming = r.stream;
                if shared.engine.config.routing.debug_header {
                    self.explanation = Some(r.explanation());
                }
                Action::Continue
            }
            Outcome::FailOpen(why) => self.unrouted(&shared, &why),
            Outcome::Reject { status, body, .. } => {
                shared.stats.inc(Counter::Rejected);
                self.reply(status, &body)
            }
        }
    }

    pub fn on_response_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        if let Some(x) = self.explanation.take() {
            if let Err(e) = host::set_header(Map::ResponseHeaders, DECISION_HEADER, &x) {
                self.host_error("setting the decision header", e);
            }
        }
        if end_of_stream {
            // One write releases both parts (see `release_rest`).
            self.release_rest();
        }
        Action::Continue
    }

    pub fn on_response_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        if end_of_stream || (body_size > 0 && !self.streaming) {
            // A response that ends with its first chunk, or the first chunk
            // of a non-streaming response (the request is over on the model
            // server): prompt and rest in one write.
            self.release_rest();
        } else if body_size > 0 {
            self.release_prompt();
        }
        Action::Continue
    }
}

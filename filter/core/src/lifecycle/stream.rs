//! One request through the filter.
//!
//! headers → (strip client destination header; Pause if routable) → body
//! chunks buffered to end of stream → `Engine::route` → destination header,
//! Continue → first response body byte: release the prompt charge → end of
//! response, or [`Stream::on_end`] on any other exit: release the rest. The
//! release flags make every exit path release exactly once.
//!
//! Only work a server accepted changes what kvroute believes: the decision
//! writes the index, the endpoint's eviction clock, its routed bytes and
//! cold stamp at once (so identical cold prompts arriving together still
//! go together), and the request keeps what it wrote
//! ([`Provisional`]). A response whose `:status` is not 2xx, or an end
//! before any response header (a reset, a connect failure), takes it all
//! back with the charge's release ([`Engine::take_back`](crate::engine::Engine::take_back)).
//!
//! A non-streaming request (`"stream"` absent or false) releases everything
//! at its first response body byte, in one write: the model server sends
//! such a body only once the request has finished, so prefill and decode
//! are both over by then, and a second read-modify-write of the load table
//! a few microseconds later (at the end of the stream) would only cost
//! three more VM crossings per request.

use super::flow::{send_shed, Admit, Arrival};
use super::{classify, Action, Counter, Host, Level, PathClass, Worker};
use crate::engine::{openai_error, Outcome, Provisional, SessionLookup, SessionRef, Unrouted};
use crate::request::{ApiKind, ParseError};
use crate::scheduling::session::{self, Presence, Strategy};
use kvroute_shared_state::load::Ticket;
use kvroute_shared_state::mesh::SessionNote;
use std::rc::Rc;

/// The objective and fairness headers' values, as sent.
type FlowHeaders = (Option<Vec<u8>>, Option<Vec<u8>>);

/// Response header carrying the decision explanation (`routing.debugHeader`).
pub const DECISION_HEADER: &str = "x-kvroute-decision";

/// A request's state across its callbacks.
pub struct Stream {
    /// `None`: the root is not configured; every callback passes.
    worker: Option<Rc<Worker>>,
    /// Set once the request is known to be routable.
    kind: Option<ApiKind>,
    ticket: Option<Ticket>,
    /// What the decision wrote beyond the charge (taken back if the server
    /// does not accept the request).
    provisional: Option<Provisional>,
    /// The destination header as set (`ip:port[,fallback…]`, its first
    /// address the routed endpoint), kept until the response headers say
    /// which endpoint answered.
    destination: Option<String>,
    /// The response headers came with a 2xx `:status` (or one that could
    /// not be read: then kvroute keeps what it wrote, as before).
    accepted: bool,
    /// The routed request asked for a streamed response.
    streaming: bool,
    prompt_released: bool,
    done: bool,
    explanation: Option<String>,
    /// Stop buffering (body too large in fail-open mode).
    passthrough: bool,
    /// Bytes of request body buffered so far (a body that ends with
    /// trailers is routed in the trailers callback, with this size).
    buffered: usize,
    /// `tokenizeIn: collector`: the prompt's new text for the collector,
    /// sent when a server accepts the request.
    tokenize_job: Option<Vec<u8>>,
    /// The stream's context id (flow control acts on it from the tick).
    id: u32,
    /// Flow control: the objective and fairness headers as sent.
    flow_headers: Option<FlowHeaders>,
    /// Flow control holds (or held) the request: its decision, if any, is
    /// the dispatch's (taken over at the next callback or the end).
    queued: bool,
    /// The request's session (`session-affinity-*`), from its headers.
    session: Option<SessionRef>,
    /// Where the decision found the session's endpoint.
    presence: Presence,
    /// The endpoint that serves the routed request: the decision's
    /// primary, or where Envoy retried it.
    served: Option<String>,
    /// Envoy retried the request to another endpoint than the primary.
    retried: bool,
}

impl Stream {
    pub fn new(worker: Option<Rc<Worker>>) -> Stream {
        Stream {
            worker,
            kind: None,
            ticket: None,
            provisional: None,
            destination: None,
            accepted: false,
            streaming: false,
            prompt_released: false,
            done: false,
            explanation: None,
            passthrough: false,
            buffered: 0,
            tokenize_job: None,
            id: 0,
            flow_headers: None,
            queued: false,
            session: None,
            presence: Presence::None,
            served: None,
            retried: false,
        }
    }

    /// The stream's context id (flow control needs it to dispatch).
    pub fn with_id(mut self, id: u32) -> Stream {
        self.id = id;
        self
    }

    /// Flow control: takes over what a dispatch decided for this request,
    /// once (`queued` stays set while it still waits).
    fn settle_flow(&mut self, host: &dyn Host) {
        if !self.queued {
            return;
        }
        let Some(w) = self.worker.clone() else {
            return;
        };
        let Some(f) = &w.flow else {
            return;
        };
        if let Some(d) = f.take_dispatched(self.id) {
            self.queued = false;
            self.adopt(host, *d);
        }
    }

    /// The charge this request still holds (`None`: nothing to release).
    pub fn holds_charge(&self) -> bool {
        self.ticket.is_some() && !self.done
    }

    fn release_prompt(&mut self, host: &dyn Host) {
        if self.prompt_released || self.done {
            return;
        }
        self.prompt_released = true;
        if let (Some(w), Some(t)) = (&self.worker, &self.ticket) {
            match w.engine.release_prompt(host.store(), t) {
                Ok(retries) => w.counts.add(host, Counter::CasRetries, u64::from(retries)),
                Err(e) => w.host_error(host, "releasing the prompt charge", e),
            }
        }
    }

    fn release_rest(&mut self, host: &dyn Host) {
        if self.done {
            return;
        }
        self.done = true;
        let taken_back = match (&self.worker, &self.ticket, &self.provisional) {
            (Some(w), Some(t), Some(p)) if !self.accepted => Some((
                w,
                w.engine.take_back(host.store(), t, p, self.prompt_released),
            )),
            _ => None,
        };
        if let Some((w, r)) = taken_back {
            w.counts.inc(host, Counter::TakenBack);
            match r {
                Ok(retries) => w.counts.add(host, Counter::CasRetries, u64::from(retries)),
                Err(e) => w.host_error(host, "taking back a rejected request", e),
            }
            return;
        }
        if let (Some(w), Some(t)) = (&self.worker, &self.ticket) {
            match w.engine.release_rest(host.store(), t, self.prompt_released) {
                Ok(retries) => w.counts.add(host, Counter::CasRetries, u64::from(retries)),
                Err(e) => w.host_error(host, "releasing the request charge", e),
            }
        }
    }

    /// Answers locally; returns Pause (the local reply ends the request).
    fn reply(w: &Worker, host: &dyn Host, status: u32, body: &str) -> Action {
        if let Err(e) = host.send_json_response(status, body) {
            w.host_error(host, "sending a local response", e);
            return Action::Continue;
        }
        Action::Pause
    }

    /// Flow control refused the request: 429 (with `Retry-After`) or 503,
    /// an error in the shape of its API and llm-d's dropped-reason header.
    fn shed(&self, w: &Worker, host: &dyn Host, why: crate::flow::Shed) -> Action {
        if let Err(e) = send_shed(host, why, self.kind) {
            w.host_error(host, "sending a local response", e);
            return Action::Continue;
        }
        Action::Pause
    }

    fn unrouted(w: &Worker, host: &dyn Host, why: &Unrouted) -> Action {
        w.counts.inc(host, Counter::FailOpen);
        host.log(
            Level::Debug,
            &format!(
                "kvroute: not routed ({}), Envoy's load balancer decides",
                why.label()
            ),
        );
        Action::Continue
    }

    /// The stream's end, on every exit path (success, reset, abort, local
    /// reply, timeout): releases what the request still holds.
    pub fn on_end(&mut self, host: &dyn Host) {
        if self.queued {
            self.settle_flow(host);
            if self.queued {
                // Still waiting (the client went away): out of the queue.
                self.queued = false;
                if let Some(w) = self.worker.clone() {
                    if let Some(f) = &w.flow {
                        f.cancel(&w, host, self.id);
                    }
                }
            }
        }
        self.release_rest(host);
    }

    pub fn on_request_headers(&mut self, host: &dyn Host, end_of_stream: bool) -> Action {
        let Some(w) = self.worker.clone() else {
            return Action::Continue;
        };
        let routing = &w.engine.config.routing;
        // One host call for the whole map: every header read is a VM exit
        // plus an allocation callback into the VM.
        let (headers, unread) = match host.request_headers() {
            Ok(h) => (h, false),
            Err(e) => {
                w.host_error(host, "reading request headers", e);
                (Vec::new(), true)
            }
        };
        let header = |name: &str| {
            headers
                .iter()
                .find(|(k, _)| k.eq_ignore_ascii_case(name))
                .map(|(_, v)| v.as_slice())
        };
        // Never trust a client-supplied destination, routed or not.
        // (Headers that could not be read may hold one: remove it blind.)
        if unread || header(&routing.destination_header).is_some() {
            if !unread {
                w.counts.inc(host, Counter::ClientHeaderStripped);
            }
            if let Err(a) = Self::strip(&w, host, &routing.destination_header, "destination") {
                return a;
            }
        }
        // Body-based routing (`routing.modelHeader`): the model header is
        // kvroute's to set from the body, never the client's, on every
        // request (routed, passed on, or refused).
        if let Some(name) = routing.model_header.as_deref() {
            if unread || header(name).is_some() {
                if let Err(a) = Self::strip(&w, host, name, "model") {
                    return a;
                }
            }
        }
        let method = header(":method").unwrap_or_default();
        let path = header(":path").unwrap_or_default();
        let kind = match classify(method, path, routing) {
            PathClass::Pass => return Action::Continue,
            PathClass::State => {
                let now = w.now_ms(host);
                return match w.engine.state_json(host.store(), now) {
                    Ok(body) => Self::reply(&w, host, 200, &body),
                    Err(e) => Self::reply(
                        &w,
                        host,
                        503,
                        &openai_error(&e.to_string(), "service_unavailable", 503),
                    ),
                };
            }
            PathClass::Routable(kind) => Some(kind),
            PathClass::Passthrough => None,
        };
        self.session = w.engine.session_ref(header);
        if w.flow.is_some() {
            let first = |names: [&str; 2]| names.iter().find_map(|n| header(n)).map(<[u8]>::to_vec);
            self.flow_headers = Some((
                first(crate::flow::OBJECTIVE_HEADERS),
                first(crate::flow::FAIRNESS_HEADERS),
            ));
        }
        let Some(kind) = kind else {
            // `passthrough-parser`: routed now, on load alone; the body (if
            // any) is not read. Its size, from `content-length`, stands for
            // the prompt in the charge.
            let bytes = header("content-length")
                .and_then(|v| std::str::from_utf8(v).ok())
                .and_then(|v| v.trim().parse::<u64>().ok())
                .unwrap_or(0);
            let timed = w.samples.time_decision();
            let now_ns = w.clock_ns(host);
            let facts = w.engine.load_only_facts(bytes);
            return self.route_facts(host, &w, Ok(facts), bytes, (timed, now_ns));
        };
        if end_of_stream {
            // A POST without a body cannot be routed.
            let why = Unrouted::BadBody(ParseError::Empty);
            return match w.engine.fail_for(why.clone(), Some(kind)) {
                Outcome::Reject { status, body, .. } => {
                    w.counts.inc(host, Counter::Rejected);
                    Self::reply(&w, host, status, &body)
                }
                _ => Self::unrouted(&w, host, &why),
            };
        }
        self.kind = Some(kind);
        Action::Pause
    }

    pub fn on_request_body(
        &mut self,
        host: &dyn Host,
        body_size: usize,
        end_of_stream: bool,
    ) -> Action {
        let (Some(w), Some(kind)) = (self.worker.clone(), self.kind) else {
            return Action::Continue;
        };
        if self.passthrough || self.ticket.is_some() || self.queued {
            return Action::Continue;
        }
        let limit = w.engine.config.routing.max_body_bytes;
        if body_size > limit {
            let why = Unrouted::BadBody(ParseError::TooLarge {
                limit,
                actual: body_size,
            });
            self.kind = None;
            return match w.engine.fail_for(why.clone(), Some(kind)) {
                Outcome::Reject { status, body, .. } => {
                    w.counts.inc(host, Counter::Rejected);
                    Self::reply(&w, host, status, &body)
                }
                _ => {
                    self.passthrough = true;
                    Self::unrouted(&w, host, &why)
                }
            };
        }
        if !end_of_stream {
            self.buffered = body_size;
            return Action::Pause;
        }
        self.route_body(host, &w, kind, body_size)
    }

    /// A request body that ends with trailers (gRPC-style, HTTP/2): its
    /// last body callback did not say end of stream, so it is routed here,
    /// on what was buffered, before the request goes upstream.
    pub fn on_request_trailers(&mut self, host: &dyn Host) -> Action {
        let (Some(w), Some(kind)) = (self.worker.clone(), self.kind) else {
            return Action::Continue;
        };
        if self.passthrough || self.ticket.is_some() || self.queued {
            return Action::Continue;
        }
        let size = self.buffered;
        self.route_body(host, &w, kind, size)
    }

    /// Envoy retries a request that could not reach its endpoint
    /// (`retry_on: connect-failure,refused-stream,reset-before-request`) to
    /// the next address of the destination header: the charge moves to
    /// the endpoint that answered, and what the decision wrote for the
    /// routed one is taken back (`Engine::move_charge`).
    fn follow_retry(&mut self, host: &dyn Host) {
        let (Some(destination), Some(w), Some(t)) =
            (self.destination.take(), self.worker.clone(), self.ticket)
        else {
            return;
        };
        let to = match host.upstream_address() {
            Ok(Some(a))
                if Some(a.as_slice()) != destination.split(',').next().map(str::as_bytes) =>
            {
                a
            }
            Ok(_) => return,
            Err(e) => {
                w.host_error(host, "reading the upstream address", e);
                return;
            }
        };
        let to = String::from_utf8_lossy(&to);
        let now = w.now_ms(host);
        match w
            .engine
            .move_charge(host.store(), &t, self.provisional.as_ref(), &to, now)
        {
            Ok((ticket, retries)) => {
                self.ticket = ticket;
                self.provisional = None;
                self.served = Some(to.into_owned());
                self.retried = true;
                w.counts.inc(host, Counter::ChargeMoved);
                w.counts.add(host, Counter::CasRetries, u64::from(retries));
            }
            Err(e) => w.host_error(host, "moving the charge to the retried endpoint", e),
        }
    }

    /// Reads the buffered body, routes it and acts on the outcome.
    fn route_body(
        &mut self,
        host: &dyn Host,
        w: &Rc<Worker>,
        kind: ApiKind,
        body_size: usize,
    ) -> Action {
        let body = match host.request_body(body_size) {
            Ok(b) => b.unwrap_or_default(),
            Err(e) => {
                w.host_error(host, "reading the request body", e);
                Vec::new()
            }
        };
        let timed = w.samples.time_decision();
        let now_ns = w.clock_ns(host);
        let facts = w.engine.facts(kind, &body);
        drop(body);
        Self::set_model_header(host, w, &facts);
        self.route_facts(host, w, facts, body_size as u64, (timed, now_ns))
    }

    /// Body-based routing (`routing.modelHeader`): sets the model header to
    /// the body's `model` (when it is a plain header value), before flow
    /// control and routing, so that the route Envoy matches once the request
    /// goes on sees it (Envoy clears its route cache when a filter changes
    /// request headers). A body that did not parse sets nothing: the
    /// client's copy is already gone.
    fn set_model_header(
        host: &dyn Host,
        w: &Worker,
        facts: &Result<crate::engine::RequestFacts, Unrouted>,
    ) {
        let Some(name) = w.engine.config.routing.model_header.as_deref() else {
            return;
        };
        let Some(value) = facts
            .as_ref()
            .ok()
            .and_then(|f| crate::engine::model_header_value(&f.model))
        else {
            return;
        };
        if let Err(e) = host.set_request_header(name, value) {
            w.host_error(host, "setting the model header", e);
        }
    }

    /// Admits (flow control), routes and acts on the outcome: a body's
    /// facts, or a passthrough request's (`bytes`: its body's size;
    /// `timing`: whether the decision time is sampled, and when the
    /// decision started).
    fn route_facts(
        &mut self,
        host: &dyn Host,
        w: &Rc<Worker>,
        facts: Result<crate::engine::RequestFacts, Unrouted>,
        bytes: u64,
        (timed, now_ns): (bool, Option<u64>),
    ) -> Action {
        let now = now_ns.map_or_else(|| w.now_ms_cached(), |ns| ns / 1_000_000);
        let facts = facts.map(|mut f| {
            f.session = self.session.clone();
            f
        });
        // Flow control: the request may wait, or be shed, before routing.
        let facts = match (facts, &w.flow) {
            (Ok(facts), Some(f)) => {
                let (objective, flow) = self.flow_headers.take().unwrap_or_default();
                let class = f
                    .cfg
                    .classify(objective.as_deref(), &facts.model, flow.as_deref());
                let arrival = Arrival {
                    id: self.id,
                    class,
                    bytes,
                    facts,
                };
                match f.admit(w, host, arrival, now) {
                    Admit::Go(facts) => Ok(*facts),
                    Admit::Queued => {
                        self.queued = true;
                        return Action::Pause;
                    }
                    Admit::Shed(why) => return self.shed(w, host, why),
                }
            }
            (other, _) => other,
        };
        let outcome = {
            let mut rng = w.rng.borrow_mut();
            match facts {
                Ok(facts) => w.engine.route(host.store(), facts, now, &mut rng),
                Err(why) => w.engine.fail_for(why, self.kind),
            }
        };
        w.samples
            .on_decision(host, now_ns.filter(|_| timed), &outcome);
        match apply_outcome(w, host, outcome) {
            Applied::Routed(d) => {
                self.adopt(host, *d);
                Action::Continue
            }
            Applied::Unrouted => Action::Continue,
            Applied::Replied => Action::Pause,
        }
    }

    /// Takes over what a decision made for this request wrote (the charge,
    /// the destination); a destination header that could not be set gives
    /// it all back at once.
    fn adopt(&mut self, host: &dyn Host, d: Decided) {
        self.ticket = d.ticket;
        self.streaming = d.streaming;
        self.explanation = d.explanation;
        self.provisional = d.provisional;
        self.tokenize_job = d.tokenize_job;
        self.presence = d.presence;
        if d.header_failed {
            self.release_rest(host);
        } else {
            self.served = d.destination.split(',').next().map(str::to_string);
            self.destination = Some(d.destination);
        }
    }

    /// Removes a client's copy of a header kvroute owns (`what`: which);
    /// `Err` is the 500 reply when it cannot: refuse rather than let the
    /// client pick the endpoint or the route.
    fn strip(w: &Rc<Worker>, host: &dyn Host, name: &str, what: &str) -> Result<(), Action> {
        host.remove_request_header(name).map_err(|e| {
            w.host_error(host, &format!("removing the client's {what} header"), e);
            Self::reply(
                w,
                host,
                500,
                &openai_error("internal error", "internal_error", 500),
            )
        })
    }

    pub fn on_response_headers(&mut self, host: &dyn Host, end_of_stream: bool) -> Action {
        self.settle_flow(host);
        self.follow_retry(host);
        // Only a request a server accepted is tokenized (`tokenizeIn:
        // collector`).
        if let (Some(job), Some(w)) = (self.tokenize_job.take(), &self.worker) {
            let ok = matches!(host.response_header(":status"),
                Ok(Some(v)) if v.len() == 3 && v[0] == b'2' && v.iter().all(u8::is_ascii_digit));
            if ok {
                w.send_job(host, &job);
            }
        }
        // Only a definite 2xx moves a session (a retried request has no
        // provisional record left, so `accepted` is not read for it).
        let sessions =
            (self.worker.as_ref()).is_some_and(|w| w.engine.config.scheduler.session.is_some());
        let mut session_note = None;
        if sessions
            && self.served.is_some()
            && matches!(host.response_header(":status"),
                Ok(Some(v)) if v.len() == 3 && v[0] == b'2' && v.iter().all(u8::is_ascii_digit))
        {
            session_note = self.settle_session(host);
        }
        if self.provisional.is_some() {
            self.accepted = match host.response_header(":status") {
                Ok(Some(v)) => v.len() == 3 && v[0] == b'2' && v.iter().all(u8::is_ascii_digit),
                // Unknown: keep what the decision wrote, as before.
                Ok(None) => true,
                Err(e) => {
                    if let Some(w) = &self.worker {
                        w.host_error(host, "reading the response status", e);
                    }
                    true
                }
            };
            // Accepted work is told to the other proxies (mesh exchange),
            // with the session binding it settled.
            if let (true, Some(w), Some(p)) = (self.accepted, &self.worker, &self.provisional) {
                match w.engine.note_accepted(host.store(), p, session_note.take()) {
                    Ok(retries) => w.counts.add(host, Counter::CasRetries, u64::from(retries)),
                    Err(e) => w.host_error(host, "telling the mesh of an accepted request", e),
                }
            }
        }
        // A settled binding with no decision to go with (a retried
        // request's was taken back) is told alone.
        if let (Some(note), Some(w), Some(served)) = (session_note, &self.worker, &self.served) {
            match w.engine.note_session(host.store(), served, note) {
                Ok(retries) => w.counts.add(host, Counter::CasRetries, u64::from(retries)),
                Err(e) => w.host_error(host, "telling the mesh of a session binding", e),
            }
        }
        if let Some(x) = self.explanation.take() {
            if let Err(e) = host.set_response_header(DECISION_HEADER, &x) {
                if let Some(w) = &self.worker {
                    w.host_error(host, "setting the decision header", e);
                }
            }
        }
        if end_of_stream {
            // One write releases both parts (see `release_rest`).
            self.release_rest(host);
        }
        Action::Continue
    }

    /// A server accepted the routed request: with `encoded_endpoint_header`
    /// the response names the endpoint that served it; with `session_id`
    /// the session's binding is bound, refreshed or moved there
    /// ([`Engine::settle_session`](crate::engine::Engine::settle_session)).
    /// Nothing is written for a request kvroute did not route (fail-open:
    /// Envoy's load balancer chose, and a token would pin the client to an
    /// endpoint kvroute never judged) or one a server did not accept.
    /// Returns the binding bound, refreshed or moved, for the mesh.
    fn settle_session(&mut self, host: &dyn Host) -> Option<SessionNote> {
        let (Some(w), Some(served)) = (self.worker.clone(), self.served.as_deref()) else {
            return None;
        };
        let cfg = w.engine.config.scheduler.session.as_ref()?;
        match (&cfg.strategy, &self.session) {
            (Strategy::EncodedEndpointHeader { header }, _) => {
                if let Err(e) = host.set_response_header(header, &session::encode_token(served)) {
                    w.host_error(host, "setting the session token header", e);
                }
            }
            (Strategy::SessionId { .. }, Some(SessionRef::Id(id))) => {
                let now = w.now_ms(host);
                let may_move = self.presence.may_move() || self.retried;
                match w
                    .engine
                    .settle_session(host.store(), *id, served, may_move, now)
                {
                    Ok(Some(out)) => {
                        use kvroute_shared_state::sessions::Settled;
                        match out.settled {
                            Settled::Bound | Settled::Refreshed => {
                                w.counts.inc(host, Counter::SessionBound)
                            }
                            Settled::Moved => w.counts.inc(host, Counter::SessionMoved),
                            Settled::Kept => {}
                        }
                        if out.evicted {
                            w.counts.inc(host, Counter::SessionEvicted);
                        }
                        w.counts
                            .add(host, Counter::CasRetries, u64::from(out.cas_retries));
                        return (out.settled != Settled::Kept).then_some(SessionNote {
                            hash: *id,
                            moved: out.settled == Settled::Moved,
                        });
                    }
                    Ok(None) => {}
                    Err(e) => w.host_error(host, "writing the session binding", e),
                }
            }
            _ => {}
        }
        None
    }

    pub fn on_response_body(
        &mut self,
        host: &dyn Host,
        body_size: usize,
        end_of_stream: bool,
    ) -> Action {
        if end_of_stream || (body_size > 0 && !self.streaming) {
            // A response that ends with its first chunk, or the first chunk
            // of a non-streaming response (the request is over on the model
            // server): prompt and rest in one write.
            self.release_rest(host);
        } else if body_size > 0 {
            self.release_prompt(host);
        }
        Action::Continue
    }
}

/// What a routing decision left for the request's stream to hold.
pub(super) struct Decided {
    ticket: Option<Ticket>,
    provisional: Option<Provisional>,
    destination: String,
    streaming: bool,
    explanation: Option<String>,
    tokenize_job: Option<Vec<u8>>,
    /// The destination header could not be set: the request goes on
    /// unrouted and the stream gives everything back when it adopts this.
    header_failed: bool,
    /// Where the decision found the session's endpoint.
    presence: Presence,
}

/// How a decision was acted on.
pub(super) enum Applied {
    /// Routed: the destination header is set (or `header_failed`).
    Routed(Box<Decided>),
    /// Not routed (fail-open): Envoy's load balancer decides.
    Unrouted,
    /// Answered locally.
    Replied,
}

/// Acts on a decision for the request whose stream is the effective
/// context: sets the destination header, counts, or answers locally.
/// Shared by the body callback and flow control's dispatch on the tick.
pub(super) fn apply_outcome(w: &Worker, host: &dyn Host, outcome: Outcome) -> Applied {
    match outcome {
        Outcome::Routed(mut r) => {
            let header = &w.engine.config.routing.destination_header;
            if let Err(e) = host.set_request_header(header, &r.destination) {
                // The request goes on unrouted; the charge goes back, and
                // what the decision wrote (the endpoint never saw it).
                w.host_error(host, "setting the destination header", e);
                return Applied::Routed(Box::new(Decided {
                    ticket: r.ticket,
                    provisional: r.provisional,
                    destination: String::new(),
                    streaming: r.stream,
                    explanation: None,
                    tokenize_job: None,
                    header_failed: true,
                    presence: Presence::None,
                }));
            }
            w.counts.inc(host, Counter::Routed);
            w.counts
                .add(host, Counter::CasRetries, u64::from(r.cas_retries));
            w.counts.inc(host, Counter::for_branch(r.decision.branch));
            match r.session {
                SessionLookup::Hit => w.counts.inc(host, Counter::SessionHits),
                SessionLookup::Expired => w.counts.inc(host, Counter::SessionExpired),
                SessionLookup::None | SessionLookup::Miss => {}
            }
            if let Some(u) = r.precise {
                w.counts.inc(host, Counter::for_precise(u));
            }
            let mut tokenize_job = None;
            if let Some(t) = r.tokenize.take() {
                if t.partial {
                    w.counts.inc(host, Counter::PrecisePrefixPartial);
                }
                tokenize_job = Some(t.job);
            }
            if r.ticket.is_none() {
                w.host_error(
                    host,
                    "charging the endpoint",
                    "shared data refused the write",
                );
            }
            let explanation = w
                .engine
                .config
                .routing
                .debug_header
                .then(|| r.explanation());
            Applied::Routed(Box::new(Decided {
                ticket: r.ticket,
                provisional: r.provisional,
                destination: r.destination,
                streaming: r.stream,
                explanation,
                tokenize_job,
                header_failed: false,
                presence: r.decision.session,
            }))
        }
        Outcome::FailOpen(why) => {
            if matches!(why, Unrouted::UnknownModel(_)) {
                w.counts.inc(host, Counter::UnknownModel);
            }
            Stream::unrouted(w, host, &why);
            Applied::Unrouted
        }
        Outcome::Reject { status, body, why } => {
            if matches!(why, Unrouted::UnknownModel(_)) {
                w.counts.inc(host, Counter::UnknownModel);
            }
            w.counts.inc(host, Counter::Rejected);
            match Stream::reply(w, host, status, &body) {
                Action::Pause => Applied::Replied,
                Action::Continue => Applied::Unrouted,
            }
        }
    }
}

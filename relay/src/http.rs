//! The HTTP side (hyper 1, HTTP/1.1): `GET /kv/events`, `/kv/snapshot`,
//! `/healthz`, `/metrics`, and `POST /mesh/exchange`. Answers are built by
//! `state::Relay` and `mesh::MeshState` under a short lock each; nothing
//! here blocks on the ZMQ side.
//!
//! The relay is a network service, so every connection is bounded
//! ([`ServeLimits`]):
//! - at most `max_connections` open: a slot is taken before `accept`, so
//!   beyond the bound new connections wait in the kernel's accept queue;
//! - hyper's `header_read_timeout`: a connection that has not sent a whole
//!   request head this long after it became ready for one (accepted, or its
//!   previous answer sent) is closed. This ends slowloris heads and silent
//!   connections, and is also the keep-alive idle limit;
//! - an I/O inactivity timeout (`tokio-io-timeout`): a read or write that
//!   makes no progress this long fails the connection (a client that stops
//!   reading an answer, or stalls a request body);
//! - at most `max_in_flight` answers held at once, from the request to the
//!   last chunk handed to hyper; past it the answer is `503 busy` at once;
//! - a `/mesh/exchange` body is read only up to `--mesh-max-body-bytes`
//!   (past it, 413), and must be complete within `header_timeout` of the
//!   request head (else 408), so a slow body holds its slot no longer.

use crate::mesh::{self, MeshLimits, MeshState, RequestError};
use crate::{Shared, SharedMesh};
use bytes::Bytes;
use futures_util::future::Either;
use futures_util::StreamExt;
use http_body_util::{combinators::BoxBody, BodyExt, Limited, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::net::TcpListener;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio_io_timeout::TimeoutStream;

/// Hashes per `/kv/events` page when `limit` is not given, and the most a
/// caller may ask for.
pub const DEFAULT_LIMIT: usize = 4096;
pub const MAX_LIMIT: usize = 65_536;

/// hyper's per-connection read buffer bound (bytes). A request is a GET line
/// and a few headers; hyper answers 431 past it. hyper's minimum is 8 KiB.
pub const MAX_BUF_BYTES: usize = 16 * 1024;

/// Answers are handed to hyper in chunks of this size (bytes), so a large
/// answer (a full snapshot is about 1.3 MB) is taken only as fast as the
/// client reads it, and its in-flight slot is held until then.
const CHUNK_BYTES: usize = 64 * 1024;

/// Bounds of the HTTP side; the defaults are the flags' defaults.
#[derive(Clone, Copy, Debug)]
pub struct ServeLimits {
    /// A request head must be complete this long after the connection is
    /// ready for one (hyper's `header_read_timeout`; also the keep-alive
    /// idle limit).
    pub header_timeout: Duration,
    /// A read or write with no progress for this long closes the connection.
    pub idle_timeout: Duration,
    /// Open connections at most.
    pub max_connections: usize,
    /// Answers held at once at most; past it, `503 busy`.
    pub max_in_flight: usize,
}

impl Default for ServeLimits {
    fn default() -> Self {
        ServeLimits {
            header_timeout: Duration::from_secs(10),
            idle_timeout: Duration::from_secs(30),
            max_connections: 512,
            max_in_flight: 64,
        }
    }
}

/// Counters of the HTTP side, for `/metrics` and tests.
#[derive(Debug, Default)]
pub struct HttpStats {
    /// Connections open now, and the most open at once.
    pub open: AtomicUsize,
    pub peak: AtomicUsize,
    pub accepted: AtomicU64,
    /// Connections closed by the header timeout, by the inactivity timeout.
    pub header_timeouts: AtomicU64,
    pub idle_timeouts: AtomicU64,
    /// Requests answered `503 busy` (no in-flight slot).
    pub busy: AtomicU64,
}

impl HttpStats {
    fn metrics(&self, limits: &ServeLimits) -> String {
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        format!(
            "# HELP kvroute_relay_http_connections Open HTTP connections (bound: --max-connections).\n\
             # TYPE kvroute_relay_http_connections gauge\n\
             kvroute_relay_http_connections {}\n\
             # HELP kvroute_relay_http_max_connections The --max-connections bound.\n\
             # TYPE kvroute_relay_http_max_connections gauge\n\
             kvroute_relay_http_max_connections {}\n\
             # HELP kvroute_relay_http_connections_total HTTP connections accepted.\n\
             # TYPE kvroute_relay_http_connections_total counter\n\
             kvroute_relay_http_connections_total {}\n\
             # HELP kvroute_relay_http_timeouts_total Connections closed by a timeout, by kind.\n\
             # TYPE kvroute_relay_http_timeouts_total counter\n\
             kvroute_relay_http_timeouts_total{{kind=\"header\"}} {}\n\
             kvroute_relay_http_timeouts_total{{kind=\"idle\"}} {}\n\
             # HELP kvroute_relay_http_busy_total Requests answered 503 for want of an in-flight slot.\n\
             # TYPE kvroute_relay_http_busy_total counter\n\
             kvroute_relay_http_busy_total {}\n",
            self.open.load(Ordering::Relaxed),
            limits.max_connections,
            get(&self.accepted),
            get(&self.header_timeouts),
            get(&self.idle_timeouts),
            get(&self.busy),
        )
    }
}

/// An answer's body: chunks of one buffer, holding an in-flight slot until
/// hyper has taken the last one (or dropped the body).
type Body = BoxBody<Bytes, Infallible>;

/// Serves until the task is dropped (the mesh exchange with its default
/// bounds).
pub async fn serve(listener: TcpListener, state: Shared, limits: ServeLimits) {
    serve_with_stats(listener, state, limits, Arc::new(HttpStats::default())).await
}

/// [`serve`], counting into `stats`.
pub async fn serve_with_stats(
    listener: TcpListener,
    state: Shared,
    limits: ServeLimits,
    stats: Arc<HttpStats>,
) {
    let mesh = Arc::new(Mutex::new(MeshState::new(
        MeshLimits::default(),
        crate::new_mesh_epoch(),
    )));
    serve_with_mesh(listener, state, mesh, limits, stats).await
}

/// [`serve_with_stats`], with the mesh exchange's state given.
pub async fn serve_with_mesh(
    listener: TcpListener,
    state: Shared,
    mesh: SharedMesh,
    limits: ServeLimits,
    stats: Arc<HttpStats>,
) {
    let mesh_limits = *lock_mesh(&mesh).limits();
    let connections = Arc::new(Semaphore::new(
        limits.max_connections.clamp(1, Semaphore::MAX_PERMITS),
    ));
    let in_flight = Arc::new(Semaphore::new(
        limits.max_in_flight.clamp(1, Semaphore::MAX_PERMITS),
    ));
    loop {
        // A slot first: past the bound, connections wait in the accept queue.
        let Ok(slot) = connections.clone().acquire_owned().await else {
            return;
        };
        let (stream, _) = match listener.accept().await {
            Ok(s) => s,
            Err(e) => {
                eprintln!("kvroute-relay: accept: {e}");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        stats.accepted.fetch_add(1, Ordering::Relaxed);
        let open = stats.open.fetch_add(1, Ordering::Relaxed) + 1;
        stats.peak.fetch_max(open, Ordering::Relaxed);
        let mut io = TimeoutStream::new(stream);
        io.set_read_timeout(Some(limits.idle_timeout));
        io.set_write_timeout(Some(limits.idle_timeout));
        let (state, mesh, in_flight, stats) = (
            state.clone(),
            mesh.clone(),
            in_flight.clone(),
            stats.clone(),
        );
        tokio::spawn(async move {
            let svc_stats = stats.clone();
            let svc = hyper::service::service_fn(move |req: Request<Incoming>| {
                let permit = match in_flight.clone().try_acquire_owned() {
                    Ok(permit) => permit,
                    Err(_) => {
                        svc_stats.busy.fetch_add(1, Ordering::Relaxed);
                        let mut r = reply(
                            StatusCode::SERVICE_UNAVAILABLE,
                            "text/plain",
                            Bytes::from_static(b"busy: too many answers in flight, retry\n"),
                            None,
                        );
                        r.headers_mut().insert(
                            hyper::header::RETRY_AFTER,
                            hyper::header::HeaderValue::from_static("1"),
                        );
                        return Either::Left(std::future::ready(Ok::<_, Infallible>(r)));
                    }
                };
                if req.uri().path() == MESH_PATH && req.method() == Method::POST {
                    // The body is read first: the only answer that awaits.
                    let mesh = mesh.clone();
                    let state = state.clone();
                    return Either::Right(async move {
                        let (status, content_type, body) =
                            exchange(&state, &mesh, req, &mesh_limits, limits.header_timeout).await;
                        Ok(reply(status, content_type, body, Some(permit)))
                    });
                }
                let (status, content_type, body) =
                    respond(&state, &mesh, &req, &limits, &svc_stats);
                Either::Left(std::future::ready(Ok(reply(
                    status,
                    content_type,
                    body,
                    Some(permit),
                ))))
            });
            let served = hyper::server::conn::http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(limits.header_timeout)
                .max_buf_size(MAX_BUF_BYTES)
                .serve_connection(TokioIo::new(Box::pin(io)), svc)
                .await;
            if let Err(e) = served {
                if e.is_timeout() {
                    stats.header_timeouts.fetch_add(1, Ordering::Relaxed);
                } else if io_timed_out(&e) {
                    stats.idle_timeouts.fetch_add(1, Ordering::Relaxed);
                }
            }
            stats.open.fetch_sub(1, Ordering::Relaxed);
            drop(slot);
        });
    }
}

/// Whether hyper's error comes from the inactivity timeout.
fn io_timed_out(e: &hyper::Error) -> bool {
    let mut source = std::error::Error::source(e);
    while let Some(s) = source {
        if let Some(io) = s.downcast_ref::<std::io::Error>() {
            return io.kind() == std::io::ErrorKind::TimedOut;
        }
        source = s.source();
    }
    false
}

/// An answer: status, content type, body.
type Answer = (StatusCode, &'static str, Bytes);

/// The response, its body in `CHUNK_BYTES` chunks that hold `permit` until
/// the last is taken. `Content-Length` is set, so the chunks are not sent
/// with chunked transfer-encoding.
fn reply(
    status: StatusCode,
    content_type: &'static str,
    body: Bytes,
    permit: Option<OwnedSemaphorePermit>,
) -> Response<Body> {
    let len = body.len();
    let chunks = (0..len).step_by(CHUNK_BYTES).map(move |at| {
        Ok::<_, Infallible>(Frame::data(body.slice(at..(at + CHUNK_BYTES).min(len))))
    });
    let stream = futures_util::stream::iter(chunks).map(move |frame| {
        let _held = &permit;
        frame
    });
    let mut r = Response::new(BodyExt::boxed(StreamBody::new(stream)));
    *r.status_mut() = status;
    r.headers_mut().insert(
        hyper::header::CONTENT_TYPE,
        hyper::header::HeaderValue::from_static(content_type),
    );
    r.headers_mut().insert(
        hyper::header::CONTENT_LENGTH,
        hyper::header::HeaderValue::from(len),
    );
    r
}

fn json<T: serde::Serialize>(v: &T) -> Answer {
    match serde_json::to_vec(v) {
        Ok(b) => (StatusCode::OK, "application/json", b.into()),
        Err(e) => (
            StatusCode::INTERNAL_SERVER_ERROR,
            "text/plain",
            format!("{e}\n").into(),
        ),
    }
}

fn text(status: StatusCode, body: impl Into<Bytes>) -> Answer {
    (status, "text/plain", body.into())
}

/// `after`, `limit`, `epoch` from a query string.
pub fn parse_events_query(query: &str) -> Result<(u64, usize, Option<u64>), String> {
    let (mut after, mut limit, mut epoch) = (0u64, DEFAULT_LIMIT, None);
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        let num = |what: &str| {
            v.parse::<u64>()
                .map_err(|_| format!("{what}={v:?} is not a non-negative integer"))
        };
        match k {
            "after" => after = num("after")?,
            "limit" => limit = (num("limit")?.clamp(1, MAX_LIMIT as u64)) as usize,
            "epoch" => epoch = Some(num("epoch")?),
            _ => {
                return Err(format!(
                    "unknown parameter {k:?} (allowed: after, limit, epoch)"
                ))
            }
        }
    }
    Ok((after, limit, epoch))
}

/// The mesh exchange's path: POST only.
pub const MESH_PATH: &str = "/mesh/exchange";

fn lock_mesh(mesh: &SharedMesh) -> std::sync::MutexGuard<'_, MeshState> {
    mesh.lock().unwrap_or_else(|p| p.into_inner())
}

fn json_error(status: StatusCode, message: &str) -> Answer {
    let body = serde_json::json!({ "error": message }).to_string() + "\n";
    (status, "application/json", body.into())
}

/// `POST /mesh/exchange`: the body (at most `max_body_bytes`, complete
/// within `deadline`), parsed, then one call to the state under its lock.
async fn exchange(
    state: &Shared,
    mesh: &SharedMesh,
    req: Request<Incoming>,
    limits: &MeshLimits,
    deadline: Duration,
) -> Answer {
    let refuse = |status: StatusCode, message: &str| {
        lock_mesh(mesh).note_bad_request();
        json_error(status, message)
    };
    let max = limits.max_body_bytes;
    let declared = req
        .headers()
        .get(hyper::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
    if declared.is_some_and(|n| n > max as u64) {
        return refuse(
            StatusCode::PAYLOAD_TOO_LARGE,
            &format!("body over the bound of {max} bytes (--mesh-max-body-bytes)"),
        );
    }
    let read = tokio::time::timeout(deadline, Limited::new(req.into_body(), max).collect());
    let body = match read.await {
        Ok(Ok(collected)) => collected.to_bytes(),
        Ok(Err(e)) if e.is::<http_body_util::LengthLimitError>() => {
            return refuse(
                StatusCode::PAYLOAD_TOO_LARGE,
                &format!("body over the bound of {max} bytes (--mesh-max-body-bytes)"),
            )
        }
        Ok(Err(e)) => return refuse(StatusCode::BAD_REQUEST, &format!("reading the body: {e}")),
        Err(_) => {
            return refuse(
                StatusCode::REQUEST_TIMEOUT,
                &format!(
                    "body not complete within {} ms (--header-timeout-ms)",
                    deadline.as_millis()
                ),
            )
        }
    };
    let parsed = match mesh::parse_request(&body, limits) {
        Ok(r) => r,
        Err(e @ RequestError::TooLarge { .. }) => {
            return refuse(StatusCode::PAYLOAD_TOO_LARGE, &e.to_string())
        }
        Err(e) => return refuse(StatusCode::BAD_REQUEST, &e.to_string()),
    };
    let losses = state
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .cache_losses();
    let answer = {
        let mut m = lock_mesh(mesh);
        m.note_cache_losses(losses);
        m.exchange(parsed, Instant::now())
    };
    json(&answer)
}

fn respond(
    state: &Shared,
    mesh: &SharedMesh,
    req: &Request<Incoming>,
    limits: &ServeLimits,
    stats: &HttpStats,
) -> Answer {
    if req.uri().path() == MESH_PATH {
        // POST went to `exchange`.
        return json_error(StatusCode::METHOD_NOT_ALLOWED, "POST only");
    }
    if req.method() != Method::GET {
        return text(StatusCode::METHOD_NOT_ALLOWED, "GET only\n");
    }
    let mut st = state.lock().unwrap_or_else(|p| p.into_inner());
    match req.uri().path() {
        "/kv/events" => match parse_events_query(req.uri().query().unwrap_or("")) {
            Ok((after, limit, epoch)) => json(&st.events_after(after, limit, epoch)),
            Err(e) => text(StatusCode::BAD_REQUEST, format!("{e}\n")),
        },
        "/kv/snapshot" => json(&st.snapshot()),
        "/healthz" => match st.health(Instant::now()) {
            Ok(status) => text(StatusCode::OK, format!("{status}\n")),
            Err(why) => text(StatusCode::SERVICE_UNAVAILABLE, format!("{why}\n")),
        },
        "/metrics" => {
            let mut m = st.metrics(crate::unix_now_s());
            drop(st);
            m.push_str(&lock_mesh(mesh).metrics(Instant::now()));
            m.push_str(&stats.metrics(limits));
            (StatusCode::OK, "text/plain; version=0.0.4", m.into())
        }
        _ => text(
            StatusCode::NOT_FOUND,
            "not found (try /kv/events?after=SEQ, /kv/snapshot, /healthz, /metrics, POST /mesh/exchange)\n",
        ),
    }
}

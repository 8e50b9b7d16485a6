//! The HTTP side (hyper 1, HTTP/1.1): `/kv/events`, `/kv/snapshot`,
//! `/healthz`, `/metrics`. Answers are built by `state::Relay` under a short
//! lock; nothing here blocks on the ZMQ side.

use crate::Shared;
use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use std::convert::Infallible;
use tokio::net::TcpListener;

/// Hashes per `/kv/events` page when `limit` is not given, and the most a
/// caller may ask for.
pub const DEFAULT_LIMIT: usize = 4096;
pub const MAX_LIMIT: usize = 65_536;

/// Serves until the task is dropped.
pub async fn serve(listener: TcpListener, state: Shared) {
    loop {
        let (stream, _) = match listener.accept().await {
            Ok(s) => s,
            Err(e) => {
                eprintln!("kvroute-relay: accept: {e}");
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                continue;
            }
        };
        let state = state.clone();
        tokio::spawn(async move {
            let svc = hyper::service::service_fn(move |req: Request<Incoming>| {
                let state = state.clone();
                async move { Ok::<_, Infallible>(respond(&state, &req)) }
            });
            let _ = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(stream), svc)
                .await;
        });
    }
}

fn reply(status: StatusCode, content_type: &str, body: impl Into<Bytes>) -> Response<Full<Bytes>> {
    let mut r = Response::new(Full::new(body.into()));
    *r.status_mut() = status;
    if let Ok(v) = content_type.parse() {
        r.headers_mut().insert(hyper::header::CONTENT_TYPE, v);
    }
    r
}

fn json<T: serde::Serialize>(v: &T) -> Response<Full<Bytes>> {
    match serde_json::to_vec(v) {
        Ok(b) => reply(StatusCode::OK, "application/json", b),
        Err(e) => reply(
            StatusCode::INTERNAL_SERVER_ERROR,
            "text/plain",
            format!("{e}\n"),
        ),
    }
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

fn respond(state: &Shared, req: &Request<Incoming>) -> Response<Full<Bytes>> {
    if req.method() != Method::GET {
        return reply(StatusCode::METHOD_NOT_ALLOWED, "text/plain", "GET only\n");
    }
    let mut st = state.lock().unwrap_or_else(|p| p.into_inner());
    match req.uri().path() {
        "/kv/events" => match parse_events_query(req.uri().query().unwrap_or("")) {
            Ok((after, limit, epoch)) => json(&st.events_after(after, limit, epoch)),
            Err(e) => reply(StatusCode::BAD_REQUEST, "text/plain", format!("{e}\n")),
        },
        "/kv/snapshot" => json(&st.snapshot()),
        "/healthz" => reply(StatusCode::OK, "text/plain", "ok\n"),
        "/metrics" => reply(
            StatusCode::OK,
            "text/plain; version=0.0.4",
            st.metrics(crate::unix_now_s()),
        ),
        _ => reply(
            StatusCode::NOT_FOUND,
            "text/plain",
            "not found (try /kv/events?after=SEQ, /kv/snapshot, /healthz, /metrics)\n",
        ),
    }
}

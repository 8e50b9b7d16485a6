//! HTTP/1.1 surface of one endpoint.
//!
//! | route | answer |
//! |---|---|
//! | `POST /v1/chat/completions`, `POST /v1/completions` | vLLM-style JSON or SSE |
//! | `POST /v1/messages` | Anthropic's Messages JSON or event stream, as vLLM converts it (`vllm_server::anthropic`) |
//! | `POST /v1/messages/count_tokens` | `{"input_tokens": N}` |
//! | `GET /v1/models`, `GET /health` | as vLLM |
//! | `GET /metrics` | Prometheus text, or a fault (see `/emulator/metrics-mode`) |
//! | `POST /emulator/reset` | clears prefix cache and counters |
//! | `POST /emulator/metrics-mode` | body `ok`, `500`, `garbage` or `hang` |
//! | `GET /emulator/stats` | JSON counters |
//!
//! Every response carries `x-kvroute-served-by: 127.0.0.1:PORT`.
//! Faults by request header: `x-emulator-fail: 500` (or any 4xx/5xx code),
//! `reset-before-first-byte`, `reset-after-first-chunk`;
//! `x-emulator-delay-ms: N` delays the first byte by N wall-clock ms.

use super::endpoint::{Endpoint, MetricsMode, Progress};
use super::metrics_text;
use super::openai::{
    engine_request, error_body, model_not_found_body, models_body_with_loras, ResponseShape,
};
use bytes::Bytes;
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper::header::{HeaderValue, CONTENT_TYPE};
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use kvroute_core::request::{parse_request, ApiKind, ParseLimits};
use kvroute_sim_model::vllm_model::{AdmitError, RequestId};
use kvroute_sim_model::vllm_server::anthropic;
use serde_json::json;
use std::convert::Infallible;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;
use tokio::sync::mpsc;

/// Response body: whole or streamed; an `Err` frame drops the connection.
pub type Body = BoxBody<Bytes, std::io::Error>;

pub const SERVED_BY: &str = "x-kvroute-served-by";
pub const FAIL_HEADER: &str = "x-emulator-fail";
pub const DELAY_HEADER: &str = "x-emulator-delay-ms";

/// Returned by the service to make hyper close the connection unanswered.
#[derive(Debug)]
pub struct DropConnection;

impl std::fmt::Display for DropConnection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("x-emulator-fail: reset-before-first-byte")
    }
}

impl std::error::Error for DropConnection {}

/// Accepts connections until the task is aborted.
pub async fn serve(listener: TcpListener, ep: Arc<Endpoint>) {
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            tokio::time::sleep(Duration::from_millis(10)).await;
            continue;
        };
        let _ = stream.set_nodelay(true);
        let ep = ep.clone();
        tokio::spawn(async move {
            let service = hyper::service::service_fn(move |req| handle(ep.clone(), req));
            let _ = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(stream), service)
                .await;
        });
    }
}

fn full(bytes: impl Into<Bytes>) -> Body {
    Full::new(bytes.into())
        .map_err(|never: Infallible| match never {})
        .boxed()
}

fn respond(ep: &Endpoint, status: StatusCode, content_type: &str, body: Body) -> Response<Body> {
    let mut r = Response::new(body);
    *r.status_mut() = status;
    let h = r.headers_mut();
    if let Ok(v) = HeaderValue::from_str(content_type) {
        h.insert(CONTENT_TYPE, v);
    }
    if let Ok(v) = HeaderValue::from_str(&ep.served_by) {
        h.insert(SERVED_BY, v);
    }
    r
}

fn json_response(ep: &Endpoint, status: StatusCode, v: &serde_json::Value) -> Response<Body> {
    respond(ep, status, "application/json", full(v.to_string()))
}

fn error_response(ep: &Endpoint, status: StatusCode, message: &str) -> Response<Body> {
    json_response(ep, status, &error_body(status.as_u16(), message))
}

async fn handle(
    ep: Arc<Endpoint>,
    req: Request<Incoming>,
) -> Result<Response<Body>, DropConnection> {
    let fail = req
        .headers()
        .get(FAIL_HEADER)
        .and_then(|v| v.to_str().ok())
        .map(|s| s.trim().to_ascii_lowercase());
    let delay_ms = req
        .headers()
        .get(DELAY_HEADER)
        .and_then(|v| v.to_str().ok())
        .and_then(|s| s.trim().parse::<u64>().ok());
    let method = req.method().clone();
    let path = req.uri().path().to_owned();
    let body = match req.into_body().collect().await {
        Ok(b) => b.to_bytes(),
        Err(_) => return Err(DropConnection),
    };
    if let Some(ms) = delay_ms {
        tokio::time::sleep(Duration::from_millis(ms)).await;
    }
    match fail.as_deref() {
        None | Some("") | Some("reset-after-first-chunk") => {}
        Some("reset-before-first-byte") => {
            ep.fault_responses.fetch_add(1, Ordering::Relaxed);
            return Err(DropConnection);
        }
        Some(code) => {
            let status = code
                .parse::<u16>()
                .ok()
                .and_then(|c| StatusCode::from_u16(c).ok())
                .filter(|s| s.is_client_error() || s.is_server_error());
            ep.fault_responses.fetch_add(1, Ordering::Relaxed);
            return Ok(match status {
                Some(s) => {
                    error_response(&ep, s, &format!("emulated failure ({FAIL_HEADER}: {code})"))
                }
                None => error_response(
                    &ep,
                    StatusCode::BAD_REQUEST,
                    &format!(
                        "unknown {FAIL_HEADER} value {code:?}: use a 4xx/5xx status code, \
                         reset-before-first-byte or reset-after-first-chunk"
                    ),
                ),
            });
        }
    }
    let reset_after_first = fail.as_deref() == Some("reset-after-first-chunk");

    Ok(match (method, path.as_str()) {
        (Method::GET, "/health") => respond(&ep, StatusCode::OK, "application/json", full("")),
        (Method::GET, "/v1/models") => json_response(
            &ep,
            StatusCode::OK,
            &models_body_with_loras(
                &ep.cfg.model,
                &ep.cfg.lora_modules,
                ep.started_unix_s as u64,
                ep.cfg.engine.effective_max_model_len(),
            ),
        ),
        (Method::GET, "/metrics") => return metrics(&ep).await,
        (Method::POST, "/emulator/reset") => {
            ep.reset();
            json_response(
                &ep,
                StatusCode::OK,
                &json!({"reset": true, "endpoint": ep.served_by}),
            )
        }
        (Method::POST, "/emulator/metrics-mode") => {
            let text = String::from_utf8_lossy(&body);
            match MetricsMode::parse(&text) {
                Some(m) => {
                    ep.set_metrics_mode(m);
                    json_response(&ep, StatusCode::OK, &json!({"metrics_mode": m.name()}))
                }
                None => error_response(
                    &ep,
                    StatusCode::BAD_REQUEST,
                    &format!(
                        "metrics mode {:?} is not one of: ok, 500, garbage, hang",
                        text.trim()
                    ),
                ),
            }
        }
        (Method::GET, "/emulator/stats") => json_response(&ep, StatusCode::OK, &stats(&ep)),
        (Method::POST, p) if p.trim_end_matches('/').ends_with("/v1/messages/count_tokens") => {
            count_tokens(&ep, &body)
        }
        (Method::POST, p)
            if matches!(
                ApiKind::from_path(p),
                Some(ApiKind::ChatCompletions | ApiKind::Completions | ApiKind::Messages)
            ) =>
        {
            completion(&ep, p, &body, reset_after_first).await
        }
        (_, p) => error_response(
            &ep,
            StatusCode::NOT_FOUND,
            &format!(
                "no route for {p}: the emulator serves /v1/chat/completions, /v1/completions, \
                 /v1/messages, /v1/models, /health, /metrics and /emulator/{{reset,metrics-mode,stats}}"
            ),
        ),
    })
}

async fn metrics(ep: &Arc<Endpoint>) -> Result<Response<Body>, DropConnection> {
    ep.metrics_scrapes.fetch_add(1, Ordering::Relaxed);
    Ok(match ep.metrics_mode() {
        MetricsMode::Ok => {
            let mut text = metrics_text::render_parts(
                &ep.cfg.model,
                &ep.cfg.engine,
                ep.started_unix_s,
                &ep.snapshot(),
            );
            if !ep.cfg.lora_modules.is_empty() {
                text.push_str(metrics_text::LORA_REQUESTS_INFO_HEAD);
                text.push_str(&ep.lora_info_text(kvroute_sim_model::vllm_server::unix_now_s()));
            }
            respond(
                ep,
                StatusCode::OK,
                "text/plain; version=0.0.4; charset=utf-8",
                full(text),
            )
        }
        MetricsMode::Status500 => respond(
            ep,
            StatusCode::INTERNAL_SERVER_ERROR,
            "text/plain; charset=utf-8",
            full("Internal Server Error"),
        ),
        MetricsMode::Garbage => respond(
            ep,
            StatusCode::OK,
            "text/plain; version=0.0.4; charset=utf-8",
            full(
                &b"\x00\xffthis is {not prometheus\nvllm:num_requests_running{engine=\"0\" NaNx\n"
                    [..],
            ),
        ),
        MetricsMode::Hang => {
            std::future::pending::<()>().await;
            unreachable!()
        }
    })
}

fn stats(ep: &Endpoint) -> serde_json::Value {
    let s = ep.snapshot();
    let c = &s.counters;
    json!({
        "endpoint": ep.served_by,
        "model": ep.cfg.model,
        "requests": c.requests,
        "requests_finished": c.requests_finished,
        "requests_aborted": c.requests_aborted,
        "prompt_tokens": c.prompt_tokens,
        "generation_tokens": c.generation_tokens,
        "cached_tokens": c.prefix_cache_hits,
        "prefix_cache_queries": c.prefix_cache_queries,
        "prefix_cache_hits": c.prefix_cache_hits,
        "preemptions": c.preemptions,
        "running": s.running,
        "waiting": s.waiting,
        "kv_cache_usage": s.kv_cache_usage,
        "cached_blocks": s.cached_blocks,
        "evicted_blocks": s.evicted_blocks,
        "num_gpu_blocks": ep.cfg.engine.num_gpu_blocks,
        "block_size": ep.cfg.engine.block_size,
        "time_scale": ep.cfg.time_scale,
        "fault_responses": s.fault_responses,
        "metrics_scrapes": ep.metrics_scrapes.load(Ordering::Relaxed),
        "host_lag_model_s": s.host_lag_model_s,
        "metrics_mode": ep.metrics_mode().name(),
        "kv_events": ep.kv_events_enabled(),
    })
}

/// Aborts the request in the engine when the response is dropped early.
struct AbortGuard {
    ep: Arc<Endpoint>,
    id: RequestId,
}

impl Drop for AbortGuard {
    fn drop(&mut self) {
        self.ep.abort(self.id);
    }
}

/// `/v1/messages/count_tokens`: the converted chat prompt's token count,
/// as vLLM answers it (`{"input_tokens": N}`).
fn count_tokens(ep: &Arc<Endpoint>, body: &[u8]) -> Response<Body> {
    let bad = |m: &str| json_response(ep, StatusCode::BAD_REQUEST, &anthropic::error_body(m));
    let chat = match anthropic::to_chat_body(body) {
        Ok(b) => b,
        Err(e) => return bad(&e),
    };
    let parsed = match parse_request(ApiKind::ChatCompletions, &chat, &ParseLimits::default()) {
        Ok(p) => p,
        Err(e) => return bad(&e.to_string()),
    };
    match engine_request(&parsed, &chat, &ep.cfg, &ep.hasher, false) {
        Ok(r) => json_response(
            ep,
            StatusCode::OK,
            &json!({"input_tokens": r.prompt_tokens}),
        ),
        Err(e) => bad(&e),
    }
}

async fn completion(
    ep: &Arc<Endpoint>,
    path: &str,
    body: &[u8],
    reset_after_first: bool,
) -> Response<Body> {
    let Some(kind) = ApiKind::from_path(path) else {
        return error_response(ep, StatusCode::NOT_FOUND, "unknown API");
    };
    // Anthropic's Messages API: vLLM serves the chat request it converts
    // the body into, and answers in Anthropic's shapes.
    let messages = kind == ApiKind::Messages;
    let error_response = |ep: &Endpoint, status: StatusCode, message: &str| {
        if messages {
            json_response(ep, status, &anthropic::error_body(message))
        } else {
            error_response(ep, status, message)
        }
    };
    let chat_body;
    let (kind, body) = if messages {
        chat_body = match anthropic::to_chat_body(body) {
            Ok(b) => b,
            Err(e) => return error_response(ep, StatusCode::BAD_REQUEST, &e),
        };
        (ApiKind::ChatCompletions, &chat_body[..])
    } else {
        (kind, body)
    };
    let parsed = match parse_request(kind, body, &ParseLimits::default()) {
        Ok(p) => p,
        Err(e) => return error_response(ep, StatusCode::BAD_REQUEST, &e.to_string()),
    };
    if !ep.cfg.serves(&parsed.model) {
        return json_response(
            ep,
            StatusCode::NOT_FOUND,
            &model_not_found_body(&parsed.model, &ep.cfg.model),
        );
    }
    let include_usage = serde_json::from_slice::<serde_json::Value>(body)
        .ok()
        .and_then(|v| {
            v.pointer("/stream_options/include_usage")
                .and_then(|b| b.as_bool())
        })
        .unwrap_or(false)
        || messages;
    let ereq = match engine_request(&parsed, body, &ep.cfg, &ep.hasher, ep.kv_events_enabled()) {
        Ok(r) => r,
        Err(e) => return error_response(ep, StatusCode::BAD_REQUEST, &e),
    };
    let prompt_tokens = ereq.prompt_tokens;
    let interval = if parsed.stream {
        ep.cfg.stream_interval.max(1)
    } else {
        0
    };
    let adapter = (parsed.model != ep.cfg.model && ep.cfg.lora_modules.contains(&parsed.model))
        .then(|| parsed.model.clone());
    let (id, rx) = match ep.submit(ereq, interval, adapter) {
        Ok(x) => x,
        Err(AdmitError::TooLong {
            requested,
            max_model_len,
        }) => {
            return error_response(
                ep,
                StatusCode::BAD_REQUEST,
                &format!(
                    "This model's maximum context length is {max_model_len} tokens. However, you \
                     requested {requested} tokens (prompt + max_tokens). Shorten the prompt or \
                     lower max_tokens."
                ),
            )
        }
    };
    let guard = AbortGuard { ep: ep.clone(), id };
    let request_no = (u64::from(ep.addr.port()) << 40) ^ id;
    let mut shape = ResponseShape::new(
        kind,
        &parsed.model,
        prompt_tokens,
        request_no,
        include_usage,
    );
    shape.messages = messages;
    if parsed.stream {
        let (tx, body_rx) = mpsc::channel::<Result<Frame<Bytes>, std::io::Error>>(16);
        tokio::spawn(stream_answer(guard, rx, tx, shape, reset_after_first));
        let stream = futures_util::stream::unfold(body_rx, |mut rx| async move {
            rx.recv().await.map(|item| (item, rx))
        });
        respond(
            ep,
            StatusCode::OK,
            "text/event-stream; charset=utf-8",
            StreamBody::new(stream).boxed(),
        )
    } else {
        whole_answer(ep, guard, rx, shape, reset_after_first).await
    }
}

async fn whole_answer(
    ep: &Arc<Endpoint>,
    _guard: AbortGuard,
    mut rx: mpsc::UnboundedReceiver<Progress>,
    shape: ResponseShape,
    reset_after_first: bool,
) -> Response<Body> {
    let mut last = None;
    while let Some(p) = rx.recv().await {
        if p.finished {
            last = Some(p);
            break;
        }
    }
    let Some(p) = last else {
        return error_response(ep, StatusCode::INTERNAL_SERVER_ERROR, "request was aborted");
    };
    let body = shape.full_body(p.generated, p.cached_tokens).to_string();
    if reset_after_first {
        // Headers and the first half of the body, then the connection drops.
        let cut = body.len() / 2;
        let half = Bytes::from(body).slice(..cut);
        let stream = futures_util::stream::iter(vec![
            Ok(Frame::data(half)),
            Err(std::io::Error::other(
                "x-emulator-fail: reset-after-first-chunk",
            )),
        ]);
        ep.fault_responses.fetch_add(1, Ordering::Relaxed);
        return respond(
            ep,
            StatusCode::OK,
            "application/json",
            StreamBody::new(stream).boxed(),
        );
    }
    respond(ep, StatusCode::OK, "application/json", full(body))
}

async fn stream_answer(
    guard: AbortGuard,
    mut rx: mpsc::UnboundedReceiver<Progress>,
    tx: mpsc::Sender<Result<Frame<Bytes>, std::io::Error>>,
    shape: ResponseShape,
    reset_after_first: bool,
) {
    let mut sent = 0u32;
    while let Some(p) = rx.recv().await {
        let mut out = String::new();
        if shape.messages {
            let text = shape.text(sent, p.generated);
            let end = p.finished.then_some((p.generated, p.cached_tokens));
            out = shape.messages_events(p.first, &text, end);
        } else if p.first && shape.chat {
            out.push_str(&shape.role_chunk());
        }
        if !shape.messages {
            out.push_str(&shape.content_chunk(&shape.text(sent, p.generated), p.finished));
            if p.finished {
                if shape.include_usage {
                    out.push_str(&shape.usage_chunk(p.generated, p.cached_tokens));
                }
                out.push_str(ResponseShape::DONE);
            }
        }
        sent = p.generated;
        if tx.send(Ok(Frame::data(Bytes::from(out)))).await.is_err() {
            return; // client gone; the guard aborts the request
        }
        if reset_after_first {
            guard.ep.fault_responses.fetch_add(1, Ordering::Relaxed);
            // Let hyper write the chunk before the connection is dropped.
            tokio::time::sleep(Duration::from_millis(50)).await;
            let _ = tx
                .send(Err(std::io::Error::other(
                    "x-emulator-fail: reset-after-first-chunk",
                )))
                .await;
            return;
        }
        if p.finished {
            return;
        }
    }
}

//! A small HTTP/1.1 client over hyper for the load generator and the tests:
//! plain GET/POST, and streamed POSTs that time every body chunk.

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::header::HeaderMap;
use hyper::{Method, Request, StatusCode};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use std::time::{Duration, Instant};

/// A pooled keep-alive client.
#[derive(Clone)]
pub struct HttpClient {
    inner: Client<HttpConnector, Full<Bytes>>,
}

/// A whole response.
#[derive(Clone, Debug)]
pub struct Fetched {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: Bytes,
}

impl Fetched {
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    pub fn json(&self) -> Result<serde_json::Value, String> {
        serde_json::from_slice(&self.body)
            .map_err(|e| format!("body is not JSON ({e}): {}", self.text()))
    }

    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }
}

/// A streamed response: when each chunk arrived, and how it ended.
#[derive(Clone, Debug)]
pub struct Timed {
    pub status: StatusCode,
    pub headers: HeaderMap,
    /// Time from sending to the response head.
    pub head_after: Duration,
    /// Each body chunk with its arrival time since sending.
    pub chunks: Vec<(Duration, Bytes)>,
    /// Set when the body broke off (connection reset, timeout).
    pub body_error: Option<String>,
}

impl Timed {
    pub fn body(&self) -> Vec<u8> {
        self.chunks
            .iter()
            .flat_map(|(_, b)| b.iter().copied())
            .collect()
    }
}

impl Default for HttpClient {
    fn default() -> Self {
        HttpClient::new()
    }
}

impl HttpClient {
    pub fn new() -> HttpClient {
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        HttpClient {
            inner: Client::builder(TokioExecutor::new())
                .pool_idle_timeout(Duration::from_secs(30))
                .build(connector),
        }
    }

    fn request(
        method: Method,
        url: &str,
        body: Bytes,
        headers: &[(&str, &str)],
    ) -> Result<Request<Full<Bytes>>, String> {
        let mut b = Request::builder().method(method).uri(url);
        if !body.is_empty() {
            b = b.header("content-type", "application/json");
        }
        for (k, v) in headers {
            b = b.header(*k, *v);
        }
        b.body(Full::new(body))
            .map_err(|e| format!("bad request for {url}: {e}"))
    }

    async fn send(&self, req: Request<Full<Bytes>>) -> Result<hyper::Response<Incoming>, String> {
        let url = req.uri().to_string();
        self.inner
            .request(req)
            .await
            .map_err(|e| format!("{url}: {e} ({:?})", std::error::Error::source(&e)))
    }

    pub async fn get(&self, url: &str) -> Result<Fetched, String> {
        self.fetch(Method::GET, url, Bytes::new(), &[]).await
    }

    pub async fn post(
        &self,
        url: &str,
        body: impl Into<Bytes>,
        headers: &[(&str, &str)],
    ) -> Result<Fetched, String> {
        self.fetch(Method::POST, url, body.into(), headers).await
    }

    pub async fn fetch(
        &self,
        method: Method,
        url: &str,
        body: Bytes,
        headers: &[(&str, &str)],
    ) -> Result<Fetched, String> {
        let resp = self
            .send(Self::request(method, url, body, headers)?)
            .await?;
        let (parts, body) = resp.into_parts();
        let body = body
            .collect()
            .await
            .map_err(|e| format!("{url}: body: {e}"))?
            .to_bytes();
        Ok(Fetched {
            status: parts.status,
            headers: parts.headers,
            body,
        })
    }

    /// POSTs and records the arrival time of every body chunk. The whole
    /// exchange is bounded by `timeout`.
    pub async fn post_timed(
        &self,
        url: &str,
        body: impl Into<Bytes>,
        headers: &[(&str, &str)],
        timeout: Duration,
    ) -> Result<Timed, String> {
        let start = Instant::now();
        let deadline = tokio::time::Instant::now() + timeout;
        let req = Self::request(Method::POST, url, body.into(), headers)?;
        let resp = tokio::time::timeout_at(deadline, self.send(req))
            .await
            .map_err(|_| format!("{url}: no response head within {timeout:?}"))??;
        let head_after = start.elapsed();
        let (parts, mut body) = resp.into_parts();
        let mut chunks = Vec::new();
        let mut body_error = None;
        loop {
            match tokio::time::timeout_at(deadline, body.frame()).await {
                Err(_) => {
                    body_error = Some(format!("body not finished within {timeout:?}"));
                    break;
                }
                Ok(None) => break,
                Ok(Some(Err(e))) => {
                    body_error = Some(e.to_string());
                    break;
                }
                Ok(Some(Ok(frame))) => {
                    if let Ok(data) = frame.into_data() {
                        chunks.push((start.elapsed(), data));
                    }
                }
            }
        }
        Ok(Timed {
            status: parts.status,
            headers: parts.headers,
            head_after,
            chunks,
            body_error,
        })
    }
}

//! Scripted answers to the module's `dispatch_http_call`.
//!
//! Envoy's async client turns upstream trouble into responses, not failures:
//! a request timeout becomes a 504 with body `upstream request timeout`, a
//! connect failure a 503; only a reset reaches the module as a failure
//! (`proxy_on_http_call_response` with 0 headers and 0 body bytes).

use crate::abi::Headers;
use crate::world::Delivered;

/// What the module asked for.
#[derive(Clone, Debug)]
pub struct HttpCallRequest {
    /// Envoy cluster name the module named.
    pub cluster: String,
    pub headers: Headers,
    pub body: Vec<u8>,
    pub trailers: Headers,
    /// 0 = no timeout (Envoy leaves it unset).
    pub timeout_ms: u32,
    /// Index of the VM that dispatched the call.
    pub vm: usize,
}

impl HttpCallRequest {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }
    pub fn path(&self) -> &str {
        self.header(":path").unwrap_or("")
    }
    pub fn authority(&self) -> &str {
        self.header(":authority").unwrap_or("")
    }
}

/// How the upstream behaves for one call.
#[derive(Clone, Debug)]
pub enum HttpCallReply {
    /// A response after `after_ms`; past the call's timeout it becomes a 504.
    Respond {
        status: u16,
        headers: Headers,
        body: Vec<u8>,
        after_ms: u64,
    },
    /// The upstream never answers: a 504 at the call's timeout, or nothing
    /// at all without one.
    Hang,
    /// Connection refused: Envoy's 503 after `after_ms`.
    ConnectFailure { after_ms: u64 },
    /// The stream is reset after `after_ms`: the module sees a failure.
    Reset { after_ms: u64 },
}

impl HttpCallReply {
    /// A 200 with `body`, answered at once.
    pub fn ok(body: impl Into<Vec<u8>>) -> HttpCallReply {
        HttpCallReply::Respond {
            status: 200,
            headers: vec![("content-type".into(), "text/plain".into())],
            body: body.into(),
            after_ms: 0,
        }
    }

    pub fn status(status: u16, body: impl Into<Vec<u8>>) -> HttpCallReply {
        HttpCallReply::Respond {
            status,
            headers: Vec::new(),
            body: body.into(),
            after_ms: 0,
        }
    }

    pub fn delayed(self, ms: u64) -> HttpCallReply {
        match self {
            HttpCallReply::Respond {
                status,
                headers,
                body,
                ..
            } => HttpCallReply::Respond {
                status,
                headers,
                body,
                after_ms: ms,
            },
            HttpCallReply::ConnectFailure { .. } => HttpCallReply::ConnectFailure { after_ms: ms },
            HttpCallReply::Reset { .. } => HttpCallReply::Reset { after_ms: ms },
            HttpCallReply::Hang => HttpCallReply::Hang,
        }
    }

    /// When (ms after dispatch) and what the module gets, given the timeout.
    pub fn resolve(self, timeout_ms: u32) -> (Option<u64>, Delivered) {
        let timeout = (timeout_ms > 0).then_some(timeout_ms as u64);
        let timed_out = || (timeout, envoy_local_reply(504, "upstream request timeout"));
        match self {
            HttpCallReply::Respond {
                status,
                mut headers,
                body,
                after_ms,
            } => {
                if timeout.is_some_and(|t| after_ms > t) {
                    return timed_out();
                }
                headers.insert(0, (":status".into(), status.to_string()));
                (
                    Some(after_ms),
                    Delivered::Response(headers, body, Vec::new()),
                )
            }
            HttpCallReply::Hang => timed_out(),
            HttpCallReply::ConnectFailure { after_ms } => {
                if timeout.is_some_and(|t| after_ms > t) {
                    return timed_out();
                }
                (
                    Some(after_ms),
                    envoy_local_reply(
                        503,
                        "upstream connect error or disconnect/reset before headers. reset reason: connection failure",
                    ),
                )
            }
            HttpCallReply::Reset { after_ms } => {
                if timeout.is_some_and(|t| after_ms > t) {
                    return timed_out();
                }
                (Some(after_ms), Delivered::Failure)
            }
        }
    }
}

/// A response as Envoy's router makes it for a local reply.
fn envoy_local_reply(status: u16, body: &str) -> Delivered {
    Delivered::Response(
        vec![
            (":status".into(), status.to_string()),
            ("content-length".into(), body.len().to_string()),
            ("content-type".into(), "text/plain".into()),
        ],
        body.as_bytes().to_vec(),
        Vec::new(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slow_answer_past_timeout_is_504() {
        let (due, d) = HttpCallReply::ok("x").delayed(900).resolve(500);
        assert_eq!(due, Some(500));
        match d {
            Delivered::Response(h, body, _) => {
                assert_eq!(h[0], (":status".into(), "504".into()));
                assert_eq!(body, b"upstream request timeout");
            }
            Delivered::Failure => panic!("timeout must be a 504 response"),
        }
    }

    #[test]
    fn hang_without_timeout_never_answers() {
        let (due, _) = HttpCallReply::Hang.resolve(0);
        assert_eq!(due, None);
    }
}

//! What `session-affinity-scorer` and `session-affinity-filter` share: their
//! parameters (llm-d's), how a request names its session, and whether the
//! session's endpoint is present among the candidates.
//!
//! A request's session points at one endpoint, found before scheduling by
//! the engine (`engine/session.rs`) and marked on that candidate
//! ([`Candidate::session`]):
//!
//! - `strategy: encoded_endpoint_header` (llm-d's default): the request
//!   header (`encodedEndpointHeaderConfig.header`, default
//!   `x-session-token`) holds padded standard base64 of the endpoint's ID.
//!   In kvroute an endpoint's ID is its Envoy host address, `ip:port`, as
//!   the endpoint table names it (llm-d's is the pod's `namespace/name`;
//!   kvroute does not know pods). A routed 2xx response carries the header
//!   set to base64 of the endpoint that served it. Stateless.
//! - `strategy: session_id`: the first non-empty of `sessionIdConfig.sources`
//!   (request headers; `attribute: agent-identity` stands for the coding
//!   agents' session headers, [`AGENT_IDENTITY_HEADERS`]) is hashed and
//!   looked up in the shared bindings (`kvroute/sessions/*`, all worker
//!   VMs), idle TTL `evictionTtlSeconds`.
//!
//! **Present or absent.** After the profile's other filters (kvroute's
//! `prefix-cache-affinity-filter`, the saturation gate) the session's
//! endpoint is *present* when it is still among the passing candidates and
//! the gate did not release it. llm-d moves a binding only when the bound
//! endpoint was absent from the candidates; kvroute's gate does not drop
//! endpoints when it releases affinity (every candidate passes), so a
//! release is counted as absence when the session's endpoint is one of the
//! sticky (warm) endpoints the gate released, i.e. it was saturated:
//! the session then goes where the scorers send it, and with `session_id`
//! its binding moves there once the server accepts the request, so the
//! next request sticks to the new endpoint ("moves and stays moved").
//! A session endpoint that is present but loses to other scorers (an
//! outweighed scorer) keeps its binding: the next request is pulled back.
//!
//! **Trust.** The header is a preference among candidates, never a route:
//! only a healthy candidate that passed the other filters can be preferred,
//! and a value naming anything else (an unknown address, bad base64, an
//! oversized value) is ignored. A client cannot reach an endpoint kvroute
//! would not otherwise pick.

use super::affinity_filter::AffinityFilter;
use super::{Branch, Candidate, RequestView};
use crate::config::check::Params;
use crate::config::ConfigError;
use serde::Deserialize;

/// The longest header value read as a session token or id, bytes; a
/// longer one is ignored (no preference).
pub const MAX_SESSION_VALUE_BYTES: usize = 512;

/// What `attribute: agent-identity` reads, in llm-d's `agent-identity`
/// order: Claude Code, OpenCode, Codex ≥ 0.131, Codex ≤ 0.130.
pub const AGENT_IDENTITY_HEADERS: [&str; 4] = [
    "x-claude-code-session-id",
    "x-session-affinity",
    "session-id",
    "session_id",
];

/// The attribute name kvroute resolves to [`AGENT_IDENTITY_HEADERS`].
pub const AGENT_IDENTITY: &str = "agent-identity";

/// llm-d's default request/response header of `encoded_endpoint_header`.
pub const DEFAULT_TOKEN_HEADER: &str = "x-session-token";
/// llm-d's default session-id source.
pub const DEFAULT_SESSION_HEADER: &str = "x-session-id";

/// Which plugin of the two.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// Soft: 1 for the session's endpoint, 0 for the others.
    Scorer,
    /// Hard: only the session's endpoint passes.
    Filter,
}

/// Where a session id comes from (`sessionIdConfig.sources[]`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Source {
    /// A request header (lower case).
    Header(String),
    /// `attribute: agent-identity`: the first of [`AGENT_IDENTITY_HEADERS`].
    AgentIdentity,
}

impl Source {
    /// The headers this source reads, in order.
    pub fn headers(&self) -> Vec<&str> {
        match self {
            Source::Header(h) => vec![h.as_str()],
            Source::AgentIdentity => AGENT_IDENTITY_HEADERS.to_vec(),
        }
    }
}

#[derive(Clone, Debug, PartialEq)]
pub enum Strategy {
    /// The client echoes a token naming its endpoint.
    EncodedEndpointHeader { header: String },
    /// kvroute keeps session → endpoint in shared data.
    SessionId {
        sources: Vec<Source>,
        /// ms; a binding idle longer is gone.
        ttl_ms: u64,
        /// ms; llm-d's sweep period, accepted and checked (kvroute checks
        /// expiry on read and reuses expired slots; it has no sweep).
        sweep_ms: u64,
        /// Bindings the shared table holds at most (kvroute's
        /// `maxSessions`), rounded up to whole shards of 64.
        max_sessions: u64,
    },
}

/// A compiled session-affinity plugin.
#[derive(Clone, Debug, PartialEq)]
pub struct SessionAffinity {
    pub role: Role,
    pub strategy: Strategy,
    /// `profileName` ("" = the primary profile, kvroute's only one).
    pub profile_name: String,
}

/// Whether the request's session endpoint is present after the filters.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Presence {
    /// No candidate is the session's (no session, unbound, or its endpoint
    /// is not a healthy endpoint).
    #[default]
    None,
    /// Candidate `i` is the session's and passed the filters.
    Present(usize),
    /// The session's candidate was filtered out (`prefix-cache-affinity-filter`
    /// kept other endpoints).
    Absent,
    /// The gate released affinity and the session's candidate was one of
    /// the warm endpoints it released: saturated, counted as absent.
    Released,
}

impl Presence {
    /// The binding may follow the request elsewhere (llm-d's "bound pod
    /// absent"): none, absent or released.
    pub fn may_move(self) -> bool {
        !matches!(self, Presence::Present(_))
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Presence::None => "none",
            Presence::Present(_) => "present",
            Presence::Absent => "absent",
            Presence::Released => "released",
        }
    }
}

/// Where the session's candidate stands after the profile's affinity
/// filters (`filters`, which left `passing` and decided `branch`).
pub fn presence(
    req: &RequestView,
    cands: &[Candidate],
    passing: &[usize],
    branch: Branch,
    filters: &[AffinityFilter],
) -> Presence {
    let Some(i) = cands.iter().position(|c| c.session) else {
        return Presence::None;
    };
    if !passing.contains(&i) {
        return Presence::Absent;
    }
    if branch == Branch::SaturationRelease
        && filters
            .iter()
            .any(|f| f.sticky_affinity(req, &cands[i]) >= f.affinity_threshold)
    {
        return Presence::Released;
    }
    Presence::Present(i)
}

// ---------------------------------------------------------------------------
// Configuration: the parameters both plugins take.

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct SessionParams {
    strategy: Option<String>,
    profile_name: Option<String>,
    encoded_endpoint_header_config: Option<EncodedParams>,
    session_id_config: Option<SessionIdParams>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct EncodedParams {
    header: Option<String>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct SessionIdParams {
    sources: Option<Vec<SourceParams>>,
    eviction_ttl_seconds: Option<f64>,
    eviction_sweep_seconds: Option<f64>,
    /// kvroute's: the bound on the shared binding table.
    max_sessions: Option<u64>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct SourceParams {
    header: Option<String>,
    attribute: Option<String>,
    producer: Option<String>,
}

/// kvroute's default `maxSessions`: 16,384 bindings, 256 shards of 64
/// (1.5 KiB each, 384 KiB in all).
pub const DEFAULT_MAX_SESSIONS: u64 = 16_384;

/// A header name as llm-d keeps it: trimmed, lower case; empty → `default`.
fn header_name(v: Option<&str>, default: &str) -> String {
    match v.map(str::trim).filter(|h| !h.is_empty()) {
        Some(h) => h.to_ascii_lowercase(),
        None => default.to_string(),
    }
}

/// A header name must be a token (RFC 9110) to be read or set.
fn check_header(p: &Params, field: &str, h: &str) -> Result<(), ConfigError> {
    let ok = h
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b));
    if ok {
        Ok(())
    } else {
        Err(p.err(field, format!("\"{h}\" is not a valid HTTP header name")))
    }
}

fn seconds_ms(p: &Params, field: &str, v: Option<f64>, default: f64) -> Result<u64, ConfigError> {
    let s = v.unwrap_or(default);
    // Up to a year, as Dynamo's TTL bound.
    if !s.is_finite() || s <= 0.0 || s > 31_536_000.0 {
        return Err(p.err(
            field,
            format!("{s} is out of range: must be > 0 and at most 31536000 seconds"),
        ));
    }
    Ok(((s * 1000.0).ceil() as u64).max(1))
}

/// Compiles either plugin's parameters.
pub(crate) fn compile(p: &Params, role: Role) -> Result<SessionAffinity, ConfigError> {
    let q: SessionParams = p.parse()?;
    let strategy = match q.strategy.as_deref().unwrap_or("encoded_endpoint_header") {
        "encoded_endpoint_header" => {
            if q.session_id_config.is_some() {
                return Err(p.err(
                    "sessionIdConfig",
                    "only read with strategy \"session_id\"",
                ));
            }
            let e = q.encoded_endpoint_header_config.unwrap_or_default();
            let header = header_name(e.header.as_deref(), DEFAULT_TOKEN_HEADER);
            check_header(p, "encodedEndpointHeaderConfig.header", &header)?;
            Strategy::EncodedEndpointHeader { header }
        }
        "session_id" => {
            if q.encoded_endpoint_header_config.is_some() {
                return Err(p.err(
                    "encodedEndpointHeaderConfig",
                    "only read with strategy \"encoded_endpoint_header\"",
                ));
            }
            let s = q.session_id_config.unwrap_or_default();
            let mut sources = Vec::new();
            for (k, src) in s.sources.unwrap_or_default().into_iter().enumerate() {
                let field = format!("sessionIdConfig.sources[{k}]");
                sources.push(match (src.header, src.attribute) {
                    (Some(h), None) => {
                        if src.producer.is_some() {
                            return Err(p.err(
                                &format!("{field}.producer"),
                                "only an attribute source names a producer",
                            ));
                        }
                        let h = header_name(Some(&h), "");
                        if h.is_empty() {
                            return Err(p.err(&format!("{field}.header"), "must not be empty"));
                        }
                        check_header(p, &format!("{field}.header"), &h)?;
                        Source::Header(h)
                    }
                    (None, Some(a)) if a.trim() == AGENT_IDENTITY => Source::AgentIdentity,
                    (None, Some(a)) => {
                        return Err(p.err(
                            &format!("{field}.attribute"),
                            format!("\"{a}\" is not an attribute kvroute resolves: kvroute resolves \"agent-identity\" (the coding agents' session headers x-claude-code-session-id, x-session-affinity, session-id, session_id, in that order); name any other header with `header`"),
                        ))
                    }
                    _ => {
                        return Err(p.err(&field, "set exactly one of `header` or `attribute`"))
                    }
                });
            }
            if sources.is_empty() {
                sources.push(Source::Header(DEFAULT_SESSION_HEADER.to_string()));
            }
            let max_sessions = s.max_sessions.unwrap_or(DEFAULT_MAX_SESSIONS);
            let cap = u64::from(kvroute_shared_state::sessions::MAX_SHARDS)
                * kvroute_shared_state::sessions::SHARD_SLOTS as u64;
            if max_sessions == 0 || max_sessions > cap {
                return Err(p.err(
                    "sessionIdConfig.maxSessions",
                    format!("{max_sessions} is out of range: must be 1..={cap} bindings"),
                ));
            }
            Strategy::SessionId {
                sources,
                ttl_ms: seconds_ms(
                    p,
                    "sessionIdConfig.evictionTtlSeconds",
                    s.eviction_ttl_seconds,
                    300.0,
                )?,
                sweep_ms: seconds_ms(
                    p,
                    "sessionIdConfig.evictionSweepSeconds",
                    s.eviction_sweep_seconds,
                    10.0,
                )?,
                max_sessions,
            }
        }
        other => {
            return Err(p.err(
                "strategy",
                format!("\"{other}\" is not a strategy: use \"encoded_endpoint_header\" (the default) or \"session_id\""),
            ))
        }
    };
    Ok(SessionAffinity {
        role,
        strategy,
        profile_name: q.profile_name.unwrap_or_default(),
    })
}

// ---------------------------------------------------------------------------
// The token: padded standard base64 (RFC 4648 §4) of the endpoint's ID.

const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

/// Standard base64 with padding.
pub fn encode_token(id: &str) -> String {
    let b = id.as_bytes();
    let mut out = String::with_capacity(b.len().div_ceil(3) * 4);
    for chunk in b.chunks(3) {
        let n = chunk
            .iter()
            .enumerate()
            .fold(0u32, |n, (k, &x)| n | (u32::from(x) << (16 - 8 * k)));
        for k in 0..4 {
            if k <= chunk.len() {
                out.push(ALPHABET[(n >> (18 - 6 * k) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

/// The endpoint ID a token names; `None` for anything that is not padded
/// standard base64 of UTF-8 (surrounding spaces are trimmed), or longer
/// than [`MAX_SESSION_VALUE_BYTES`].
pub fn decode_token(token: &[u8]) -> Option<String> {
    let t = token.trim_ascii();
    if t.is_empty() || t.len() > MAX_SESSION_VALUE_BYTES || !t.len().is_multiple_of(4) {
        return None;
    }
    let pad = t.iter().rev().take_while(|&&c| c == b'=').count();
    if pad > 2 {
        return None;
    }
    let mut out = Vec::with_capacity(t.len() / 4 * 3);
    for (q, quad) in t.chunks(4).enumerate() {
        let last = q == t.len() / 4 - 1;
        let mut n = 0u32;
        let mut used = 0;
        for (k, &c) in quad.iter().enumerate() {
            let v = match c {
                b'A'..=b'Z' => c - b'A',
                b'a'..=b'z' => c - b'a' + 26,
                b'0'..=b'9' => c - b'0' + 52,
                b'+' => 62,
                b'/' => 63,
                b'=' if last && k >= 4 - pad => {
                    continue;
                }
                _ => return None,
            };
            n |= u32::from(v) << (18 - 6 * k);
            used += 1;
        }
        let bytes = [(n >> 16) as u8, (n >> 8) as u8, n as u8];
        let keep = used - 1;
        // Non-canonical padding bits (e.g. "QR==") are refused, as Go's
        // StdEncoding.Strict would; the plain decoder accepts them, but a
        // token kvroute wrote never has them.
        if (keep < 3) && (n & ((1 << (8 * (3 - keep))) - 1)) != 0 {
            return None;
        }
        out.extend_from_slice(&bytes[..keep]);
    }
    String::from_utf8(out).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_round_trip_and_match_base64() {
        assert_eq!(encode_token("10.0.0.1:8000"), "MTAuMC4wLjE6ODAwMA==");
        assert_eq!(encode_token("a"), "YQ==");
        assert_eq!(encode_token("ab"), "YWI=");
        assert_eq!(encode_token("abc"), "YWJj");
        for id in [
            "",
            "a",
            "ab",
            "abc",
            "127.0.0.1:9001",
            "[::1]:8000",
            "ns/pod-0",
        ] {
            if id.is_empty() {
                continue;
            }
            assert_eq!(
                decode_token(encode_token(id).as_bytes()).as_deref(),
                Some(id)
            );
        }
        assert_eq!(
            decode_token(b" MTAuMC4wLjE6ODAwMA== ").as_deref(),
            Some("10.0.0.1:8000")
        );
    }

    #[test]
    fn bad_tokens_are_no_preference() {
        let long = "QUFB".repeat(MAX_SESSION_VALUE_BYTES / 4 + 1);
        for bad in [
            &b""[..],
            b"   ",
            b"YQ",
            b"YQ=",
            b"Y===",
            b"====",
            b"YQ==YQ==",
            b"Y=Q=",
            b"QR==",
            b"@@@@",
            b"YW\xffj",
            b"//8=", // not UTF-8
            long.as_bytes(),
        ] {
            assert_eq!(
                decode_token(bad),
                None,
                "{:?}",
                String::from_utf8_lossy(bad)
            );
        }
    }

    fn cand(matched: u32, session: bool) -> Candidate {
        Candidate {
            matched_blocks: matched,
            session,
            ..Default::default()
        }
    }

    #[test]
    fn presence_after_the_gate() {
        let req = RequestView {
            prompt_tokens: 640,
            total_blocks: 10,
            block_size_tokens: 64,
            ..Default::default()
        };
        let f = [AffinityFilter::default()];
        let warm_bound = [cand(10, true), cand(0, false)];
        assert_eq!(
            presence(&req, &warm_bound, &[0], Branch::Sticky, &f),
            Presence::Present(0)
        );
        assert_eq!(
            presence(&req, &warm_bound, &[0, 1], Branch::SaturationRelease, &f),
            Presence::Released
        );
        // Bound to the cold one while the warm one is released: present.
        let cold_bound = [cand(10, false), cand(0, true)];
        assert_eq!(
            presence(&req, &cold_bound, &[0, 1], Branch::SaturationRelease, &f),
            Presence::Present(1)
        );
        assert_eq!(
            presence(&req, &cold_bound, &[0], Branch::Sticky, &f),
            Presence::Absent
        );
        assert_eq!(
            presence(&req, &[cand(10, false)], &[0], Branch::Single, &f),
            Presence::None
        );
        assert!(Presence::Released.may_move() && !Presence::Present(0).may_move());
    }
}

//! The mesh exchange's wire format: what the collector posts to a server's
//! relay (`POST /mesh/exchange`, `relay/README.md`) and its answer.
//!
//! The post carries this proxy's id, its cursor on the relay's log
//! (epoch, last seq read), its own in-flight load on the server and the
//! decisions it routed there that the server accepted. The answer carries
//! the other proxies' decisions since the cursor, the sum of their load,
//! and the new cursor. How the answer changes shared state is
//! `Engine::apply_mesh_answer`'s (`engine/mesh.rs`).

use serde::{Deserialize, Serialize};

/// Most decisions asked for in one answer.
pub const ANSWER_LIMIT: u32 = 1024;

/// In-flight work on one server (one proxy's, or the sum of the others').
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct WireLoad {
    #[serde(default)]
    pub prompt: u64,
    #[serde(default)]
    pub output: u64,
    #[serde(default)]
    pub requests: u32,
    /// In an answer: how many other proxies the sum covers.
    #[serde(default, skip_serializing)]
    pub proxies: u32,
}

/// One accepted decision on the wire.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct WireDecision {
    pub new_blocks: u32,
    /// Text prompt bytes routed (omitted when 0; absent reads as 0).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub prompt_bytes: u32,
    pub hashes: Vec<u64>,
    /// The hash of the request's session id, when the decision settled a
    /// `session_id` binding (omitted otherwise).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub session: Option<u64>,
    /// The decision moved that binding (omitted when false).
    #[serde(default, skip_serializing_if = "is_false")]
    pub session_moved: bool,
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

fn is_false(b: &bool) -> bool {
    !*b
}

/// The post's body.
#[derive(Clone, Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ExchangeRequest<'a> {
    pub proxy: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub epoch: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub after: Option<u64>,
    pub limit: u32,
    pub load: WireLoad,
    pub ttl_ms: u64,
    pub decisions: &'a [WireDecision],
}

/// The relay's answer.
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize)]
pub struct ExchangeAnswer {
    pub epoch: u64,
    pub seq: u64,
    #[serde(default)]
    pub resync: bool,
    #[serde(default)]
    pub more: bool,
    #[serde(default)]
    pub load: WireLoad,
    #[serde(default)]
    pub decisions: Vec<WireDecision>,
}

/// Parses an answer; the error is serde's message.
pub fn parse_answer(body: &[u8]) -> Result<ExchangeAnswer, String> {
    serde_json::from_slice(body).map_err(|e| format!("mesh answer: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_request_serializes_as_the_relay_reads_it() {
        let d = [
            WireDecision {
                new_blocks: 3,
                prompt_bytes: 0,
                hashes: vec![u64::MAX, 1],
                ..Default::default()
            },
            WireDecision {
                new_blocks: 0,
                prompt_bytes: 4000,
                hashes: vec![],
                session: Some(u64::MAX - 1),
                session_moved: true,
            },
        ];
        let r = ExchangeRequest {
            proxy: "p1",
            epoch: Some(7),
            after: None,
            limit: 16,
            load: WireLoad {
                prompt: 10,
                output: 2,
                requests: 1,
                proxies: 9,
            },
            ttl_ms: 1500,
            decisions: &d,
        };
        assert_eq!(
            serde_json::to_string(&r).unwrap(),
            r#"{"proxy":"p1","epoch":7,"limit":16,"load":{"prompt":10,"output":2,"requests":1},"ttlMs":1500,"decisions":[{"newBlocks":3,"hashes":[18446744073709551615,1]},{"newBlocks":0,"promptBytes":4000,"hashes":[],"session":18446744073709551614,"sessionMoved":true}]}"#
        );
    }

    #[test]
    fn answers_parse_and_garbage_is_an_error() {
        let a = parse_answer(
            br#"{"epoch":5,"seq":9,"last":9,"resync":false,"more":true,
                 "load":{"prompt":100,"output":7,"requests":2,"proxies":3},
                 "decisions":[{"newBlocks":2,"hashes":[18446744073709551615,0]},
                              {"newBlocks":0,"promptBytes":812,"hashes":[],"session":7},
                              {"newBlocks":0,"hashes":[],"session":9,"sessionMoved":true}]}"#,
        )
        .unwrap();
        assert_eq!((a.epoch, a.seq, a.more, a.load.proxies), (5, 9, true, 3));
        assert_eq!(a.decisions[0].hashes, vec![u64::MAX, 0]);
        assert_eq!(
            (a.decisions[0].prompt_bytes, a.decisions[1].prompt_bytes),
            (0, 812)
        );
        // Sessions: absent (an older proxy's decision), bound, moved.
        let sessions: Vec<_> = a
            .decisions
            .iter()
            .map(|d| (d.session, d.session_moved))
            .collect();
        assert_eq!(sessions, [(None, false), (Some(7), false), (Some(9), true)]);
        for bad in [
            &b""[..],
            b"{",
            b"[]",
            b"{\"epoch\":-1,\"seq\":0}",
            b"{\"seq\":1}",
        ] {
            assert!(
                parse_answer(bad).is_err(),
                "{:?}",
                String::from_utf8_lossy(bad)
            );
        }
    }
}

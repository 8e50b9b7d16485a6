//! `session-affinity-scorer` and `-filter` in the config: llm-d's
//! parameters and defaults, strict errors naming the JSON path, one per
//! profile, and the chart's payload-agnostic profile with openai-parser.

use super::*;
use crate::config::Config;
use crate::scheduling::session::{Role, SessionAffinity, Source, Strategy};
use crate::scheduling::Scorer;

fn session_config(
    kind: &str,
    params: &str,
    weight: &str,
) -> Result<Config, crate::config::ConfigError> {
    Config::from_json(
        with_endpoints(&format!(
            r#"{{"plugins":[{{"type":"{kind}","parameters":{params}}},{{"type":"max-score-picker"}}],
                "schedulingProfiles":[{{"name":"default","plugins":[{{"pluginRef":"{kind}"{weight}}},{{"pluginRef":"max-score-picker"}}]}}]}}"#
        ))
        .as_bytes(),
    )
}

#[test]
fn defaults_are_llm_d_s() {
    let c = session_config("session-affinity-scorer", "null", r#","weight":2"#).unwrap();
    assert_eq!(c.scheduler.scorers, vec![(Scorer::SessionAffinity, 2.0)]);
    assert_eq!(
        c.scheduler.session,
        Some(SessionAffinity {
            role: Role::Scorer,
            strategy: Strategy::EncodedEndpointHeader {
                header: "x-session-token".into()
            },
            profile_name: String::new(),
        })
    );
    let c = session_config(
        "session-affinity-filter",
        r#"{"strategy":"session_id"}"#,
        "",
    )
    .unwrap();
    assert!(c.scheduler.scorers.is_empty());
    let s = c.scheduler.session.unwrap();
    assert_eq!(s.role, Role::Filter);
    assert_eq!(
        s.strategy,
        Strategy::SessionId {
            sources: vec![Source::Header("x-session-id".into())],
            ttl_ms: 300_000,
            sweep_ms: 10_000,
            max_sessions: 16_384,
        }
    );
}

#[test]
fn every_parameter_is_read() {
    let c = session_config(
        "session-affinity-scorer",
        r#"{"strategy":"session_id","profileName":"default","sessionIdConfig":{
            "sources":[{"header":" X-Conversation "},{"attribute":"agent-identity","producer":"agent-identity"}],
            "evictionTtlSeconds":1.5,"evictionSweepSeconds":0.5,"maxSessions":100}}"#,
        "",
    )
    .unwrap();
    assert_eq!(
        c.scheduler.session.unwrap().strategy,
        Strategy::SessionId {
            sources: vec![
                Source::Header("x-conversation".into()),
                Source::AgentIdentity
            ],
            ttl_ms: 1_500,
            sweep_ms: 500,
            max_sessions: 100,
        }
    );
    let c = session_config(
        "session-affinity-filter",
        r#"{"encodedEndpointHeaderConfig":{"header":"X-Pin"}}"#,
        "",
    )
    .unwrap();
    assert_eq!(
        c.scheduler.session.unwrap().strategy,
        Strategy::EncodedEndpointHeader {
            header: "x-pin".into()
        }
    );
}

#[test]
fn bad_parameters_name_their_path() {
    let p = "plugins[0].parameters";
    for (params, path, msg) in [
        (
            r#"{"strategy":"cookie"}"#,
            format!("{p}.strategy"),
            "not a strategy",
        ),
        (
            r#"{"headerName":"x"}"#,
            p.to_string(),
            "unknown field `headerName`",
        ),
        (
            r#"{"strategy":"session_id","sessionIdConfig":{"evictionTtlSeconds":0}}"#,
            format!("{p}.sessionIdConfig.evictionTtlSeconds"),
            "must be > 0",
        ),
        (
            r#"{"strategy":"session_id","sessionIdConfig":{"evictionSweepSeconds":-1}}"#,
            format!("{p}.sessionIdConfig.evictionSweepSeconds"),
            "must be > 0",
        ),
        (
            r#"{"strategy":"session_id","sessionIdConfig":{"maxSessions":0}}"#,
            format!("{p}.sessionIdConfig.maxSessions"),
            "out of range",
        ),
        (
            r#"{"strategy":"session_id","sessionIdConfig":{"sources":[{"header":"a","attribute":"agent-identity"}]}}"#,
            format!("{p}.sessionIdConfig.sources[0]"),
            "exactly one",
        ),
        (
            r#"{"strategy":"session_id","sessionIdConfig":{"sources":[{}]}}"#,
            format!("{p}.sessionIdConfig.sources[0]"),
            "exactly one",
        ),
        (
            r#"{"strategy":"session_id","sessionIdConfig":{"sources":[{"attribute":"SessionID"}]}}"#,
            format!("{p}.sessionIdConfig.sources[0].attribute"),
            "agent-identity",
        ),
        (
            r#"{"strategy":"session_id","sessionIdConfig":{"sources":[{"header":"bad header"}]}}"#,
            format!("{p}.sessionIdConfig.sources[0].header"),
            "not a valid HTTP header",
        ),
        (
            r#"{"strategy":"session_id","sessionIdConfig":{"sources":[{"hdr":"x"}]}}"#,
            format!("{p}.sessionIdConfig.sources[0]"),
            "unknown field `hdr`",
        ),
        (
            r#"{"sessionIdConfig":{}}"#,
            format!("{p}.sessionIdConfig"),
            "session_id",
        ),
        (
            r#"{"strategy":"session_id","encodedEndpointHeaderConfig":{}}"#,
            format!("{p}.encodedEndpointHeaderConfig"),
            "encoded_endpoint_header",
        ),
        (
            r#"{"profileName":"prefill"}"#,
            format!("{p}.profileName"),
            "one profile",
        ),
    ] {
        let e = session_config("session-affinity-scorer", params, "").unwrap_err();
        assert!(
            e.path.starts_with(&path) && e.message.contains(msg),
            "{params}: {e}"
        );
    }
    let e = session_config("session-affinity-filter", "{}", r#","weight":1"#).unwrap_err();
    assert_eq!(e.path, "schedulingProfiles[0].plugins[0].weight");
}

#[test]
fn one_session_plugin_per_profile() {
    let e = Config::from_json(
        with_endpoints(
            r#"{"plugins":[{"type":"session-affinity-scorer"},{"type":"session-affinity-filter"}],
                "schedulingProfiles":[{"name":"d","plugins":[{"pluginRef":"session-affinity-filter"},{"pluginRef":"session-affinity-scorer"}]}]}"#,
        )
        .as_bytes(),
    )
    .unwrap_err();
    assert_eq!(e.path, "schedulingProfiles[0].plugins[1].pluginRef");
    assert!(e.message.contains("one session-affinity plugin"), "{e}");
}

/// llm-d's chart `payload-agnostic` profile loads as written: its
/// `passthrough-parser` routes every other path on load alone, with the
/// session scorer.
#[test]
fn the_payload_agnostic_profile_loads() {
    let c = Config::from_json(&fixture("router-chart-payload-agnostic.json")).unwrap();
    assert!(c.routing.passthrough);
    assert_eq!(c.scheduler.scorers.len(), 2);
    assert_eq!(c.scheduler.scorers[1], (Scorer::SessionAffinity, 1.0));
    assert!(matches!(
        c.scheduler.session.unwrap().strategy,
        Strategy::EncodedEndpointHeader { .. }
    ));
    assert!(c.scheduler.filters.is_empty());
}

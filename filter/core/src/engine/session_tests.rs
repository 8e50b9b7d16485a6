//! Session affinity through the engine: the session's endpoint found and
//! preferred, the binding settled as the lifecycle settles it on a 2xx.

use super::*;
use crate::request::ApiKind;
use crate::scheduling::session::{encode_token, Presence};
use crate::scheduling::Rng;
use kvroute_shared_state::memory::MemoryStore;
use kvroute_shared_state::sessions::Settled;

const EPS: [&str; 3] = ["127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"];

/// Three endpoints, the affinity gate (τ = 1000 tokens), token-load, and
/// `session` as the profile's session plugin (`"scorer", w` or `"filter"`).
fn config(kind: &str, params: &str, weight: Option<f64>) -> Config {
    let w = weight.map_or(String::new(), |w| format!(r#","weight":{w}"#));
    let doc = format!(
        r#"{{"endpoints":{{"static":["127.0.0.1:1","127.0.0.1:2","127.0.0.1:3"]}},
            "plugins":[{{"type":"approx-prefix-cache-producer","parameters":{{"blockSizeTokens":16}}}},
                       {{"type":"prefix-cache-affinity-filter","parameters":{{"maxTTFTPenaltyMs":1000,"peakPrefillThroughput":1000}}}},
                       {{"type":"session-affinity-{kind}","parameters":{params}}},
                       {{"type":"token-load-scorer"}},{{"type":"max-score-picker"}}],
            "schedulingProfiles":[{{"name":"d","plugins":[{{"pluginRef":"prefix-cache-affinity-filter"}},
                {{"pluginRef":"session-affinity-{kind}"{w}}},
                {{"pluginRef":"token-load-scorer"}},{{"pluginRef":"max-score-picker"}}]}}]}}"#
    );
    Config::from_json(doc.as_bytes()).unwrap()
}

const SESSION_ID: &str = r#"{"strategy":"session_id","sessionIdConfig":{"evictionTtlSeconds":60}}"#;

fn chat(user: &str) -> Vec<u8> {
    serde_json::json!({"model":"m","messages":[{"role":"user","content":user}]})
        .to_string()
        .into_bytes()
}

struct Fleet {
    e: Engine,
    s: MemoryStore,
    rng: Rng,
}

impl Fleet {
    fn new(c: Config) -> Fleet {
        let e = Engine::new(c);
        let s = MemoryStore::new();
        e.collector_init(&s).unwrap();
        Fleet {
            e,
            s,
            rng: Rng::new(7),
        }
    }

    /// The session of a request with `name: value` as its only header.
    fn sref(&self, name: &str, value: &[u8]) -> Option<SessionRef> {
        self.e.session_ref(|n| (n == name).then_some(value))
    }

    fn route(&mut self, body: &[u8], session: Option<SessionRef>, now: u64) -> Routed {
        let mut f = self.e.facts(ApiKind::ChatCompletions, body).unwrap();
        f.session = session;
        match self.e.route(&self.s, f, now, &mut self.rng) {
            Outcome::Routed(r) => r,
            other => panic!("{other:?}"),
        }
    }

    /// What the stream does on a 2xx: settle the binding on the primary.
    fn accept(&self, r: &Routed, session: &Option<SessionRef>, now: u64) -> Option<Settled> {
        let Some(SessionRef::Id(id)) = session else {
            return None;
        };
        self.e
            .settle_session(
                &self.s,
                *id,
                r.primary_address(),
                r.decision.session.may_move(),
                now,
            )
            .unwrap()
            .map(|o| o.settled)
    }
}

/// Each request of a session has a prompt of its own (no shared prefix):
/// only the session keeps them together.
fn distinct(i: u32) -> Vec<u8> {
    chat(&format!(
        "turn {i}: {}",
        "words of its own ".repeat(10 + i as usize)
    ))
}

#[test]
fn session_id_binds_on_acceptance_and_sticks_across_distinct_prompts() {
    let mut f = Fleet::new(config("scorer", SESSION_ID, Some(10.0)));
    let sess = f.sref("x-session-id", b"conv-1");
    assert!(matches!(sess, Some(SessionRef::Id(_))));
    let first = f.route(&distinct(0), sess.clone(), 0);
    assert_eq!(first.session, SessionLookup::Miss, "unbound");
    // Not accepted yet: nothing is bound, the next request is free.
    let r = f.route(&distinct(1), sess.clone(), 1);
    assert_eq!(r.session, SessionLookup::Miss);
    assert_eq!(f.accept(&first, &sess, 2), Some(Settled::Bound));
    let home = first.primary_address().to_string();
    // Every later request goes home although the charges held there make
    // the other endpoints lighter.
    for i in 2..8 {
        let r = f.route(&distinct(i), sess.clone(), u64::from(i));
        assert_eq!(r.session, SessionLookup::Hit);
        assert_eq!(r.primary_address(), home, "turn {i}");
        assert_eq!(r.decision.session, Presence::Present(r.decision.primary));
        assert_eq!(f.accept(&r, &sess, u64::from(i)), Some(Settled::Refreshed));
    }
    // Another session is not pulled there.
    let other = f.sref("x-session-id", b"conv-2");
    let r = f.route(&distinct(9), other, 9);
    assert_ne!(r.primary_address(), home);
}

#[test]
fn an_outweighed_scorer_keeps_its_binding() {
    // token-load-scorer separates one charge by ~1e-5 (4M-token scale).
    let mut f = Fleet::new(config("scorer", SESSION_ID, Some(0.000001)));
    let sess = f.sref("x-session-id", b"conv-1");
    let first = f.route(&distinct(0), sess.clone(), 0);
    f.accept(&first, &sess, 0);
    let home = first.primary_address().to_string();
    // Home holds the first charge: token load outvotes the weak scorer.
    let r = f.route(&distinct(1), sess.clone(), 1);
    assert_ne!(r.primary_address(), home);
    assert!(matches!(r.decision.session, Presence::Present(_)));
    assert_eq!(f.accept(&r, &sess, 1), Some(Settled::Kept));
    // Released there, the session is pulled back home.
    f.e.release_rest(&f.s, &first.ticket.unwrap(), false)
        .unwrap();
    f.e.release_rest(&f.s, &r.ticket.unwrap(), false).unwrap();
    let r = f.route(&distinct(2), sess, 2);
    assert_eq!(r.primary_address(), home);
}

/// The gate releases the saturated home: the session moves, and with its
/// binding moved it stays on the new endpoint once home is idle again.
#[test]
fn a_gate_release_moves_the_session_and_it_stays_moved() {
    let mut f = Fleet::new(config("filter", SESSION_ID, None));
    let sess = f.sref("x-session-id", b"agent");
    // One conversation: each turn extends the last (prefix affinity holds).
    let conv = |turn: usize| {
        chat(&format!(
            "{}{}",
            "a long agent conversation. ".repeat(60),
            "more. ".repeat(turn)
        ))
    };
    let first = f.route(&conv(1), sess.clone(), 0);
    f.accept(&first, &sess, 0);
    f.e.release_rest(&f.s, &first.ticket.unwrap(), false)
        .unwrap();
    let home = first.primary_address().to_string();
    let r = f.route(&conv(2), sess.clone(), 1);
    assert_eq!(
        (r.primary_address(), r.decision.branch),
        (home.as_str(), crate::scheduling::Branch::Sticky)
    );
    f.accept(&r, &sess, 1);
    f.e.release_rest(&f.s, &r.ticket.unwrap(), false).unwrap();
    // Saturate home: other sessions' long prompts in flight there.
    let mut held = Vec::new();
    {
        use kvroute_shared_state::cas::update;
        use kvroute_shared_state::load::LoadTable;
        let table = f.e.endpoint_table(&f.s).unwrap();
        let ep = table
            .endpoints
            .iter()
            .find(|e| e.address == home)
            .unwrap()
            .clone();
        update(
            &f.s,
            kvroute_shared_state::LOAD_KEY,
            LoadTable::decode,
            LoadTable::encode,
            |t: &mut LoadTable| {
                t.charge(ep.slot, ep.generation, 2, 60_000, 5_000, 0, 0, 0)
                    .map(|(t, _)| t)
            },
        )
        .unwrap()
        .result
        .into_iter()
        .for_each(|t| held.push(t));
    }
    assert_eq!(held.len(), 1);
    let r = f.route(&conv(3), sess.clone(), 3);
    assert_eq!(
        r.decision.branch,
        crate::scheduling::Branch::SaturationRelease
    );
    assert_eq!(r.decision.session, Presence::Released);
    let new_home = r.primary_address().to_string();
    assert_ne!(new_home, home);
    assert_eq!(f.accept(&r, &sess, 3), Some(Settled::Moved));
    f.e.release_rest(&f.s, &r.ticket.unwrap(), false).unwrap();
    // Home is idle again; the session stays where it moved.
    for t in held {
        f.e.release_rest(&f.s, &t, false).unwrap();
    }
    for turn in 4..7 {
        let r = f.route(&conv(turn), sess.clone(), turn as u64);
        assert_eq!(r.primary_address(), new_home, "turn {turn}");
        assert_eq!(f.accept(&r, &sess, turn as u64), Some(Settled::Refreshed));
        f.e.release_rest(&f.s, &r.ticket.unwrap(), false).unwrap();
    }
}

/// Filtered out by prefix affinity (the bound endpoint is cold for this
/// prompt, another holds it): absent, and the binding follows the pick.
#[test]
fn an_absent_endpoint_lets_the_binding_move() {
    let mut f = Fleet::new(config("filter", SESSION_ID, None));
    let warm = chat(&"a prompt another session warmed. ".repeat(20));
    let w = f.route(&warm, None, 0);
    f.e.release_rest(&f.s, &w.ticket.unwrap(), false).unwrap();
    let warm_at = w.primary_address().to_string();
    let sess = f.sref("x-session-id", b"s");
    // Bind the session elsewhere.
    let cold = EPS.iter().find(|a| **a != warm_at).unwrap();
    let Some(SessionRef::Id(id)) = sess.clone() else {
        unreachable!()
    };
    f.e.settle_session(&f.s, id, cold, false, 1).unwrap();
    let r = f.route(&warm, sess.clone(), 2);
    assert_eq!(r.session, SessionLookup::Hit);
    assert_eq!(r.decision.session, Presence::Absent);
    assert_eq!(r.primary_address(), warm_at);
    assert_eq!(f.accept(&r, &sess, 2), Some(Settled::Moved));
}

#[test]
fn bindings_expire_after_the_idle_ttl() {
    let mut f = Fleet::new(config("scorer", SESSION_ID, Some(10.0)));
    let sess = f.sref("x-session-id", b"s");
    let r = f.route(&distinct(0), sess.clone(), 0);
    f.accept(&r, &sess, 1_000);
    assert_eq!(
        f.route(&distinct(1), sess.clone(), 61_000).session,
        SessionLookup::Hit
    );
    assert_eq!(
        f.route(&distinct(2), sess, 61_001).session,
        SessionLookup::Expired
    );
}

#[test]
fn encoded_tokens_pin_a_healthy_candidate_and_nothing_else() {
    let mut f = Fleet::new(config("filter", "{}", None));
    for (k, ep) in EPS.into_iter().enumerate() {
        let sess = f.sref("x-session-token", encode_token(ep).as_bytes());
        assert_eq!(sess, Some(SessionRef::Endpoint(ep.to_string())));
        for i in 0..3 {
            // Prompts of their own: a warm one would be the affinity
            // filter's to place first.
            let r = f.route(&distinct(10 * k as u32 + i), sess.clone(), 0);
            assert_eq!((r.primary_address(), r.session), (ep, SessionLookup::Hit));
        }
    }
    // An address that is not a healthy endpoint: no preference, and it is
    // never routed to.
    let sess = f.sref("x-session-token", encode_token("10.9.9.9:80").as_bytes());
    let r = f.route(&distinct(50), sess, 0);
    assert_eq!(r.session, SessionLookup::Miss);
    assert!(EPS.contains(&r.primary_address()));
    // Bad base64, oversized values: no session at all.
    assert_eq!(f.sref("x-session-token", b"not base64!"), None);
    let big = encode_token(&"1".repeat(600));
    assert_eq!(f.sref("x-session-token", big.as_bytes()), None);
    // The session_id strategy's header means nothing to this one.
    assert_eq!(f.sref("x-session-id", b"abc"), None);
}

#[test]
fn session_ids_come_from_the_sources_in_order() {
    let c = config(
        "scorer",
        r#"{"strategy":"session_id","sessionIdConfig":{"sources":[{"header":"X-Session-ID"},{"attribute":"agent-identity"}]}}"#,
        Some(1.0),
    );
    let e = Engine::new(c);
    let hdrs: &[(&str, &[u8])] = &[
        ("session_id", b"codex-old"),
        ("x-claude-code-session-id", b"claude"),
    ];
    let get = |h: &[(&str, &'static [u8])]| {
        let h = h.to_vec();
        e.session_ref(move |n| h.iter().find(|(k, _)| *k == n).map(|(_, v)| *v))
    };
    let claude = get(&hdrs[1..]);
    assert_eq!(
        get(hdrs),
        claude,
        "x-claude-code-session-id comes before session_id"
    );
    assert_ne!(get(&hdrs[..1]), claude);
    assert_eq!(get(&[("x-session-id", b"  ")]), None, "blank is no session");
    assert_ne!(get(&[("x-session-id", b"claude")]), None);
    let big: &'static [u8] = Box::leak(vec![b'a'; 513].into_boxed_slice());
    assert_eq!(get(&[("x-session-id", big)]), None, "oversized");
    assert_eq!(get(&[]), None);
}

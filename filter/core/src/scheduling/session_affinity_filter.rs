//! `session-affinity-filter`: a hard pin to the request's session endpoint
//! (llm-d's, both strategies; see [`session`](super::session) for how the
//! endpoint is found and the gate rule).
//!
//! passing' = {s} if the session's endpoint s is present after the
//! profile's other filters (not filtered out, not a warm endpoint the
//! saturation gate released); otherwise passing' = passing, unchanged. It
//! never empties the set. It runs after `prefix-cache-affinity-filter`
//! whatever the profile's order, so the gate decides first: a saturated
//! session endpoint is released, the session goes where the scorers send
//! it and (`session_id`) its binding moves there.

use super::session::{self, Presence, Role, SessionAffinity};
use crate::config::check::Params;
use crate::config::ConfigError;

pub const TYPE: &str = "session-affinity-filter";

/// Narrows `passing` to the present session endpoint, if any.
pub fn apply(presence: Presence, passing: &mut Vec<usize>) {
    if let Presence::Present(i) = presence {
        if passing.contains(&i) {
            passing.clear();
            passing.push(i);
        }
    }
}

pub(crate) fn compile(p: &Params) -> Result<SessionAffinity, ConfigError> {
    session::compile(p, Role::Filter)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pins_a_present_endpoint_and_never_empties() {
        let mut p = vec![0, 1, 2];
        apply(Presence::Present(1), &mut p);
        assert_eq!(p, vec![1]);
        for pr in [
            Presence::None,
            Presence::Absent,
            Presence::Released,
            Presence::Present(7),
        ] {
            let mut p = vec![0, 2];
            apply(pr, &mut p);
            assert_eq!(p, vec![0, 2], "{pr:?}");
        }
    }
}

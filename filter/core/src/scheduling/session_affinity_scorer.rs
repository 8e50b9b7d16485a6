//! `session-affinity-scorer`: a soft preference for the request's session
//! endpoint (llm-d's, both strategies; see [`session`](super::session) for
//! how the endpoint is found and the gate rule).
//!
//! score(e) = 1 if e is the session's endpoint and it is present after the
//! filters (not filtered out, not a warm endpoint the saturation gate
//! released); 0 otherwise. With no present session endpoint every
//! candidate scores 0: the scorer abstains. Its weight sets how much load
//! or cache the other scorers must see before they outvote it; an
//! outvoted session keeps its binding (`session_id`), so its next request
//! is pulled back.

use super::session::{self, Role, SessionAffinity};
use crate::config::check::Params;
use crate::config::ConfigError;

pub const TYPE: &str = "session-affinity-scorer";

/// Scores the passing candidates (`passing[k]` → `out[k]`); `present` is
/// the candidate index of a present session endpoint.
pub fn score(present: Option<usize>, passing: &[usize], out: &mut [f64]) {
    for (o, &i) in out.iter_mut().zip(passing) {
        *o = if Some(i) == present { 1.0 } else { 0.0 };
    }
}

pub(crate) fn compile(p: &Params) -> Result<SessionAffinity, ConfigError> {
    session::compile(p, Role::Scorer)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_for_the_present_endpoint_else_abstains() {
        let mut out = [9.0; 3];
        score(Some(2), &[0, 2, 3], &mut out);
        assert_eq!(out, [0.0, 1.0, 0.0]);
        score(None, &[0, 2, 3], &mut out);
        assert_eq!(out, [0.0; 3]);
    }
}

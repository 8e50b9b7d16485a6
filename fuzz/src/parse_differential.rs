//! Fuzz target `parse_differential`: the single-pass request parser
//! (`kvroute_core::request::parse_request`) against the parser it replaced,
//! kept frozen as the reference (`filter/core/tests/differential/reference.rs`,
//! the same file the differential test `cargo test -p kvroute-core --test
//! differential` uses, included here by `#[path]`).
//!
//! For each `ApiKind`, the same bytes go to both parsers, and:
//!
//! - when both accept, the requests are equal (byte-identical prompts, the
//!   same model, limits, salt, sequences and batch rest);
//! - when both refuse, the errors have the same label;
//! - one accepting what the other refuses is a failure.
//!
//! These are the differential test's properties; that test feeds generated
//! bodies, this target libFuzzer's (seeds: `testdata/requests/`).

#[path = "../../filter/core/tests/differential/reference.rs"]
mod reference;

use crate::KINDS;
use kvroute_core::request::{ApiKind, ParseLimits};

/// Parses `body` with both parsers under every API and compares.
pub fn run(body: &[u8]) {
    let limits = ParseLimits::default();
    // Anthropic's Messages API and vLLM's generate API have no frozen
    // reference (their parsers read with serde; the reference hands them
    // back to the parser itself).
    for kind in KINDS
        .into_iter()
        .filter(|k| !matches!(k, ApiKind::Messages | ApiKind::Generate))
    {
        reference::compare(kind, body, &limits);
    }
}

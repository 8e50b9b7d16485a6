//! Request traces (JSONL): one request per line, in arrival order.
//!
//! ```text
//! {"arrival_s": 0.0, "model": "qwen3", "segments": [{"id": "sys-a", "tokens": 6000}, {"id": "q-17", "tokens": 1200}], "output_tokens": 1000}
//! {"arrival_s": 0.4, "text": "You are a helpful assistant. …", "output_tokens": 200}
//! ```
//!
//! - `arrival_s` (number, required): seconds since the trace start.
//! - `model` (string, optional): the served model; default the fleet's.
//! - the prompt, exactly one of:
//!   - `segments`: the prompt as shared pieces in order, each an `id`
//!     (string or number; the same id means the same tokens) and its exact
//!     `tokens` count. A piece of the same id must always have the same
//!     length. Two prompts share a cache block exactly when they share all
//!     pieces up to its end.
//!   - `text`: the prompt text (sent as a `/v1/completions` prompt; tokens
//!     are estimated as the filter does, `bytes / charsPerToken`).
//! - `output_tokens` (integer ≥ 1, required): tokens generated.
//!
//! Blank lines and lines starting with `#` are skipped.

use crate::workload::prompt::Piece;
use serde::Deserialize;
use serde_json::Value;
use std::collections::HashMap;

#[derive(Clone, Debug, PartialEq)]
pub enum TracePrompt {
    Segments(Vec<Piece>),
    Text(String),
}

#[derive(Clone, Debug, PartialEq)]
pub struct TraceRequest {
    pub arrival_s: f64,
    pub model: Option<String>,
    pub prompt: TracePrompt,
    pub output_tokens: u32,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawLine {
    arrival_s: f64,
    #[serde(default)]
    model: Option<String>,
    #[serde(default)]
    segments: Option<Vec<RawSegment>>,
    #[serde(default)]
    text: Option<String>,
    output_tokens: u32,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawSegment {
    id: Value,
    tokens: u32,
}

/// Parses a JSONL trace; errors name the line.
pub fn parse_trace(text: &str) -> Result<Vec<TraceRequest>, String> {
    let mut out = Vec::new();
    // id → (numeric id, tokens), to catch a piece used with two lengths.
    let mut ids: HashMap<String, (u64, u32)> = HashMap::new();
    let mut last_t = f64::NEG_INFINITY;
    for (i, line) in text.lines().enumerate() {
        let n = i + 1;
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let raw: RawLine =
            serde_json::from_str(line).map_err(|e| format!("trace line {n}: {e}"))?;
        if !(raw.arrival_s.is_finite() && raw.arrival_s >= 0.0) {
            return Err(format!("trace line {n}: arrival_s must be a number ≥ 0"));
        }
        if raw.arrival_s < last_t {
            return Err(format!(
                "trace line {n}: arrival_s {} is before the previous line's {last_t}; sort the trace",
                raw.arrival_s
            ));
        }
        last_t = raw.arrival_s;
        if raw.output_tokens == 0 {
            return Err(format!("trace line {n}: output_tokens must be ≥ 1"));
        }
        let prompt = match (raw.segments, raw.text) {
            (Some(segs), None) => {
                if segs.is_empty() {
                    return Err(format!("trace line {n}: segments is empty"));
                }
                let mut pieces = Vec::with_capacity(segs.len());
                for s in segs {
                    let key = match &s.id {
                        Value::String(v) => format!("s:{v}"),
                        Value::Number(v) => format!("n:{v}"),
                        _ => {
                            return Err(format!(
                                "trace line {n}: a segment id must be a string or a number"
                            ))
                        }
                    };
                    let next = ids.len() as u64 + 1;
                    let (id, tokens) = *ids.entry(key.clone()).or_insert((next, s.tokens));
                    if tokens != s.tokens {
                        return Err(format!(
                            "trace line {n}: segment {} has {} tokens here but {tokens} earlier",
                            s.id, s.tokens
                        ));
                    }
                    if s.tokens == 0 {
                        return Err(format!("trace line {n}: segment {} has 0 tokens", s.id));
                    }
                    pieces.push(Piece { id, tokens });
                }
                TracePrompt::Segments(pieces)
            }
            (None, Some(t)) => TracePrompt::Text(t),
            _ => {
                return Err(format!(
                    "trace line {n}: give the prompt as exactly one of \"segments\" or \"text\""
                ))
            }
        };
        out.push(TraceRequest {
            arrival_s: raw.arrival_s,
            model: raw.model,
            prompt,
            output_tokens: raw.output_tokens,
        });
    }
    if out.is_empty() {
        return Err("the trace has no requests".into());
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn segments_and_text_lines_parse_and_ids_are_stable() {
        let t = parse_trace(
            "# comment\n{\"arrival_s\":0,\"segments\":[{\"id\":\"a\",\"tokens\":10},{\"id\":7,\"tokens\":5}],\"output_tokens\":3}\n\n{\"arrival_s\":1.5,\"model\":\"m\",\"text\":\"hi\",\"output_tokens\":1}\n{\"arrival_s\":2,\"segments\":[{\"id\":\"a\",\"tokens\":10}],\"output_tokens\":3}\n",
        )
        .unwrap();
        assert_eq!(t.len(), 3);
        let (TracePrompt::Segments(a), TracePrompt::Segments(c)) = (&t[0].prompt, &t[2].prompt)
        else {
            panic!("segments expected")
        };
        assert_eq!(a[0], c[0]);
        assert_ne!(a[0].id, a[1].id);
        assert_eq!(t[1].prompt, TracePrompt::Text("hi".into()));
    }

    #[test]
    fn bad_lines_are_refused_with_their_number() {
        for (bad, what) in [
            ("{\"arrival_s\":0,\"output_tokens\":1}", "exactly one"),
            ("{\"arrival_s\":0,\"text\":\"x\",\"output_tokens\":0}", "≥ 1"),
            ("{\"arrival_s\":-1,\"text\":\"x\",\"output_tokens\":1}", "≥ 0"),
            ("{\"arrival_s\":0,\"text\":\"x\",\"output_tokens\":1,\"extra\":1}", "unknown field"),
            ("{\"arrival_s\":0,\"segments\":[{\"id\":\"a\",\"tokens\":1}],\"output_tokens\":1}\n{\"arrival_s\":1,\"segments\":[{\"id\":\"a\",\"tokens\":2}],\"output_tokens\":1}", "earlier"),
            ("{\"arrival_s\":2,\"text\":\"x\",\"output_tokens\":1}\n{\"arrival_s\":1,\"text\":\"x\",\"output_tokens\":1}", "sort"),
        ] {
            let e = parse_trace(bad).unwrap_err();
            assert!(e.contains(what) && e.contains("line"), "{bad}: {e}");
        }
        assert!(parse_trace("\n").is_err());
    }
}

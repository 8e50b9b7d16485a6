//! A second client beside the workload: a stream of over-length chat
//! requests, which a vLLM server (and the emulator) answers at once with a
//! 400 ("This model's maximum context length is …"): nothing prefilled,
//! nothing cached, no counter of the server moves.
//!
//! It measures issue 40's point 1 ("only what a server accepted may change
//! what kvroute believes"): run a workload with and without the stream and
//! compare the servers' hit ratio. A router that lets a rejected prompt age
//! its index or train its learners loses affinity to a client whose every
//! request fails.
//!
//! Every request is a new prefix (a unique first line), so each is a cold
//! placement spread over the fleet. The rest of the prompt is lines from a
//! fixed pool: the emulator tokenizes text line by line through a cache, so
//! the stream costs it little CPU whatever its length.

use crate::words::text_of_bytes;
use kvroute_core::scheduling::Rng;
use serde::Serialize;
use serde_json::json;

/// Bytes of each pooled line, its newline included.
const LINE_BYTES: usize = 512;
/// Distinct pooled lines.
const POOL_LINES: u64 = 64;

/// `--reject-stream RATE` and `--reject-tokens N`.
#[derive(Clone, Debug, PartialEq)]
pub struct RejectStream {
    /// Requests per model second, Poisson arrivals.
    pub rate: f64,
    /// Prompt length, in tokens of `chars_per_token` bytes: over the
    /// servers' `--max-model-len`.
    pub tokens: u32,
}

/// The stream's request bodies.
pub struct RejectBodies {
    model: String,
    seed: u64,
    lines: usize,
    pool: Vec<String>,
    next: u64,
}

impl RejectBodies {
    pub fn new(model: &str, tokens: u32, chars_per_token: f64, seed: u64) -> RejectBodies {
        let bytes = (f64::from(tokens) * chars_per_token.max(1.0)).ceil() as usize;
        let pool = (0..POOL_LINES)
            .map(|i| {
                let mut rng = Rng::derive(seed, 0x0BAD_0000 ^ i);
                // The words come with a leading space; a line must start
                // with a word for the emulator to cut the text there.
                let mut line = text_of_bytes(LINE_BYTES, &mut rng)[1..].to_owned();
                line.push('\n');
                line
            })
            .collect();
        RejectBodies {
            model: model.to_owned(),
            seed,
            lines: bytes.div_ceil(LINE_BYTES).max(1),
            pool,
            next: 0,
        }
    }

    /// The next request: `(path, body)`. Every other one streams.
    pub fn next_body(&mut self) -> (&'static str, String) {
        let n = self.next;
        self.next += 1;
        let mut content = format!(
            "rejected request {}-{n}: review every file below before answering.\n",
            self.seed
        );
        for i in 0..self.lines as u64 {
            content.push_str(&self.pool[((n * 7 + i) % POOL_LINES) as usize]);
        }
        let body = json!({
            "model": self.model,
            "messages": [{"role": "user", "content": content}],
            "max_tokens": 16,
            "stream": n.is_multiple_of(2),
        });
        ("/v1/chat/completions", body.to_string())
    }
}

/// What the stream's requests got, over one stage.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct RejectStats {
    pub sent: u64,
    /// Answered 4xx (what a server says to an over-length prompt).
    pub rejected: u64,
    /// Answered 2xx: the prompt was not over the servers' length limit, and
    /// the comparison is void.
    pub accepted: u64,
    /// 5xx, no answer or a broken connection.
    pub other: u64,
}

impl RejectStats {
    pub fn add(&mut self, status: Option<u16>) {
        self.sent += 1;
        match status {
            Some(s) if (400..500).contains(&s) => self.rejected += 1,
            Some(s) if (200..300).contains(&s) => self.accepted += 1,
            _ => self.other += 1,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bodies_are_long_distinct_and_deterministic() {
        let mut a = RejectBodies::new("tiny", 5000, 2.17, 3);
        let mut b = RejectBodies::new("tiny", 5000, 2.17, 3);
        let (p, x) = a.next_body();
        assert_eq!(p, "/v1/chat/completions");
        assert_eq!(x, b.next_body().1);
        let y = a.next_body().1;
        let vx: serde_json::Value = serde_json::from_str(&x).unwrap();
        let vy: serde_json::Value = serde_json::from_str(&y).unwrap();
        let cx = vx["messages"][0]["content"].as_str().unwrap();
        let cy = vy["messages"][0]["content"].as_str().unwrap();
        assert!(cx.len() >= (5000.0 * 2.17) as usize, "{}", cx.len());
        // A new prefix each time: the first lines differ.
        assert_ne!(cx.lines().next(), cy.lines().next());
        // Every line starts with a word (the emulator caches text line by
        // line, cutting after a newline that a non-space follows).
        assert!(cx.lines().all(|l| l.len() > 8 && !l.starts_with(' ')));
        assert!(cx.lines().skip(1).all(|l| l.len() == LINE_BYTES - 1));
        assert_eq!(vx["stream"], true);
        assert_eq!(vy["stream"], false);
        // Another seed, other prompts.
        let z = RejectBodies::new("tiny", 5000, 2.17, 4).next_body().1;
        assert_ne!(x, z);
    }

    #[test]
    fn stats_classify_statuses() {
        let mut s = RejectStats::default();
        for st in [Some(400), Some(413), Some(200), Some(503), None] {
            s.add(st);
        }
        assert_eq!(
            s,
            RejectStats {
                sent: 5,
                rejected: 2,
                accepted: 1,
                other: 2
            }
        );
    }
}

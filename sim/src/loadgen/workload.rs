//! Workloads (DESIGN.md §5), each a deterministic stream of requests whose
//! prompts are real words of about the stated token lengths: `tokens ×
//! chars_per_token` bytes, where the default [`TEXT_BYTES_PER_TOKEN`] is what
//! the emulator's default tokenizer (the tiny BPE) averages on this text. The
//! exact count is whatever the server's tokenizer makes of it; kvroute's
//! estimate (4 bytes per token unless learned) is not used here.
//!
//! | workload | prompt | output |
//! |---|---|---|
//! | shared-prefix | one of `groups` system prompts (6000 tok) + one of `prompts_per_group` questions (1200 tok) | 1000 |
//! | code-generation | per-conversation system prompt (4000 tok) + the conversation so far + a 1500-token turn | 800 |
//! | reasoning | one shared prompt (250 tok) + a unique user prompt (1000 tok) | 8000 |
//! | chat-lab | shared system prompt (250 tok) + the user's persona (200 tok) + history + a short question (50 tok) | 150 |
//!
//! Multi-turn workloads replay recorded assistant turns (deterministic
//! words), not what the server answered, so the prefix a turn extends is
//! fixed by the seed, as in a conversation-replay dataset.

use crate::rng::SeededRng;
use crate::words::text_of_bytes;
use serde_json::{json, Value};
use std::collections::HashMap;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WorkloadKind {
    SharedPrefix,
    CodeGeneration,
    Reasoning,
    ChatLab,
}

impl WorkloadKind {
    pub fn parse(s: &str) -> Result<WorkloadKind, String> {
        match s {
            "shared-prefix" => Ok(WorkloadKind::SharedPrefix),
            "code-generation" => Ok(WorkloadKind::CodeGeneration),
            "reasoning" => Ok(WorkloadKind::Reasoning),
            "chat-lab" => Ok(WorkloadKind::ChatLab),
            other => Err(format!(
                "unknown workload {other:?}: use shared-prefix, code-generation, reasoning or chat-lab"
            )),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            WorkloadKind::SharedPrefix => "shared-prefix",
            WorkloadKind::CodeGeneration => "code-generation",
            WorkloadKind::Reasoning => "reasoning",
            WorkloadKind::ChatLab => "chat-lab",
        }
    }
}

/// Bytes per token of [`crate::words`] text under the emulator's default
/// tokenizer (`testdata/tokenizer/tiny-bpe-4096`), measured on 500 KB of it
/// (`tests::text_sizing_matches_the_tiny_tokenizer`).
pub const TEXT_BYTES_PER_TOKEN: f64 = 2.17;

/// Which OpenAI API the requests use.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Api {
    Chat,
    Completions,
}

/// Sizes of a workload; every length is in tokens.
#[derive(Clone, Debug, PartialEq)]
pub struct WorkloadSpec {
    pub kind: WorkloadKind,
    pub model: String,
    pub api: Api,
    /// Bytes of text per token when sizing prompts (`--chars-per-token`).
    pub chars_per_token: f64,
    /// shared-prefix: groups; code-generation: conversations; chat-lab: users.
    pub groups: u32,
    /// shared-prefix: questions per group; multi-turn: turns per conversation.
    pub prompts_per_group: u32,
    /// The shared / system part of each prompt.
    pub system_tokens: u32,
    /// chat-lab: persona per user; ignored elsewhere.
    pub persona_tokens: u32,
    /// The question / turn / user part.
    pub question_tokens: u32,
    pub output_tokens: u32,
}

impl WorkloadSpec {
    /// The sizes DESIGN.md gives for a workload.
    pub fn standard(kind: WorkloadKind) -> WorkloadSpec {
        let base = WorkloadSpec {
            kind,
            model: "tiny".into(),
            api: Api::Chat,
            chars_per_token: TEXT_BYTES_PER_TOKEN,
            groups: 0,
            prompts_per_group: 0,
            system_tokens: 0,
            persona_tokens: 0,
            question_tokens: 0,
            output_tokens: 0,
        };
        match kind {
            WorkloadKind::SharedPrefix => WorkloadSpec {
                groups: 150,
                prompts_per_group: 5,
                system_tokens: 6000,
                question_tokens: 1200,
                output_tokens: 1000,
                ..base
            },
            WorkloadKind::CodeGeneration => WorkloadSpec {
                groups: 32,
                prompts_per_group: 8,
                system_tokens: 4000,
                question_tokens: 1500,
                output_tokens: 800,
                ..base
            },
            WorkloadKind::Reasoning => WorkloadSpec {
                groups: 1,
                prompts_per_group: 1,
                system_tokens: 250,
                question_tokens: 1000,
                output_tokens: 8000,
                ..base
            },
            WorkloadKind::ChatLab => WorkloadSpec {
                groups: 6,
                prompts_per_group: 40,
                system_tokens: 250,
                persona_tokens: 200,
                question_tokens: 50,
                output_tokens: 150,
                ..base
            },
        }
    }
}

/// One request to send.
#[derive(Clone, Debug)]
pub struct GenRequest {
    /// Path under the target, e.g. `/v1/chat/completions`.
    pub path: &'static str,
    pub body: Value,
    /// Bytes of prompt text the request carries (system + history + turn).
    pub prompt_bytes: usize,
    /// Which group / conversation / user it belongs to.
    pub group: u32,
}

/// Generates a workload's requests in a seeded order.
pub struct Workload {
    spec: WorkloadSpec,
    seed: u64,
    rng: SeededRng,
    /// Text cache: (kind, a, b) → text.
    texts: HashMap<(u8, u32, u32), String>,
    /// Multi-turn: next turn per conversation, and the generation (a
    /// conversation that finished all its turns starts over as a new one).
    next_turn: Vec<u32>,
    generation: Vec<u32>,
    /// Fresh (never repeated) texts handed out so far.
    fresh: u64,
}

/// Sub-stream of the fresh texts (`SeededRng::derive(seed, FRESH_STREAM ^ n)`).
const FRESH_STREAM: u64 = 0xF2E5_0000_0000_0000;

/// One piece of a message's text: the deterministic text `(kind, a, b)` of
/// `tokens` tokens, or (`fresh: Some(n)`) the workload's n-th unique text.
/// Pieces of one message are joined by a newline.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Segment {
    pub kind: u8,
    pub a: u32,
    pub b: u32,
    pub tokens: u32,
    pub fresh: Option<u64>,
}

/// A request's structure: its messages as segments.
#[derive(Clone, Debug, PartialEq)]
pub struct GenParts {
    pub group: u32,
    pub messages: Vec<(&'static str, Vec<Segment>)>,
    pub output_tokens: u32,
}

impl Workload {
    pub fn new(spec: WorkloadSpec, seed: u64) -> Workload {
        let n = spec.groups.max(1) as usize;
        Workload {
            rng: SeededRng::derive(seed, 0xA11),
            spec,
            seed,
            texts: HashMap::new(),
            next_turn: vec![0; n],
            generation: vec![0; n],
            fresh: 0,
        }
    }

    pub fn spec(&self) -> &WorkloadSpec {
        &self.spec
    }

    fn bytes(&self, tokens: u32) -> usize {
        (f64::from(tokens) * self.spec.chars_per_token.max(1.0)).round() as usize
    }

    /// Deterministic text `(kind, a, b)` of `tokens` tokens.
    fn text(&mut self, kind: u8, a: u32, b: u32, tokens: u32) -> String {
        let bytes = self.bytes(tokens);
        let seed = self.seed;
        self.texts
            .entry((kind, a, b))
            .or_insert_with(|| {
                let stream = (u64::from(kind) << 56) ^ (u64::from(a) << 28) ^ u64::from(b);
                text_of_bytes(bytes, &mut SeededRng::derive(seed, stream))
            })
            .clone()
    }

    /// The text of a segment (fresh text is not cached: it is never reused).
    fn segment_text(&mut self, seg: Segment) -> String {
        match seg.fresh {
            Some(n) => {
                let bytes = self.bytes(seg.tokens);
                text_of_bytes(bytes, &mut SeededRng::derive(self.seed, FRESH_STREAM ^ n))
            }
            None => self.text(seg.kind, seg.a, seg.b, seg.tokens),
        }
    }

    /// The next request.
    pub fn next_request(&mut self) -> GenRequest {
        let parts = self.next_parts();
        let mut messages = Vec::with_capacity(parts.messages.len());
        for (role, segs) in parts.messages {
            let mut text = String::new();
            for (i, seg) in segs.into_iter().enumerate() {
                if i > 0 {
                    text.push('\n');
                }
                text.push_str(&self.segment_text(seg));
            }
            messages.push((role, text));
        }
        self.build(messages, parts.group)
    }

    /// The next request as its structure (which texts, how long, in which
    /// message), without building any text: the simulator's fast path. The
    /// sequence of requests is the one [`next_request`](Self::next_request)
    /// gives for the same seed.
    pub fn next_parts(&mut self) -> GenParts {
        let s = self.spec.clone();
        let seg = |kind: u8, a: u32, b: u32, tokens: u32| Segment {
            kind,
            a,
            b,
            tokens,
            fresh: None,
        };
        match s.kind {
            WorkloadKind::SharedPrefix => {
                let g = self.rng.below(u64::from(s.groups.max(1))) as u32;
                let q = self.rng.below(u64::from(s.prompts_per_group.max(1))) as u32;
                GenParts {
                    group: g,
                    messages: vec![
                        ("system", vec![seg(1, g, 0, s.system_tokens)]),
                        ("user", vec![seg(2, g, q, s.question_tokens)]),
                    ],
                    output_tokens: s.output_tokens,
                }
            }
            WorkloadKind::Reasoning => {
                let n = self.fresh;
                self.fresh += 1;
                GenParts {
                    group: 0,
                    messages: vec![
                        ("system", vec![seg(1, 0, 0, s.system_tokens)]),
                        (
                            "user",
                            vec![Segment {
                                fresh: Some(n),
                                ..seg(0, 0, 0, s.question_tokens)
                            }],
                        ),
                    ],
                    output_tokens: s.output_tokens,
                }
            }
            WorkloadKind::CodeGeneration | WorkloadKind::ChatLab => self.next_turn(),
        }
    }

    fn next_turn(&mut self) -> GenParts {
        let s = self.spec.clone();
        let c = self.rng.below(u64::from(s.groups.max(1))) as u32;
        let turn = self.next_turn[c as usize];
        let generation = self.generation[c as usize];
        let turns = s.prompts_per_group.max(1);
        if turn + 1 >= turns {
            self.next_turn[c as usize] = 0;
            self.generation[c as usize] += 1;
        } else {
            self.next_turn[c as usize] = turn + 1;
        }
        // Conversation identity across restarts.
        let conv = c + generation * s.groups.max(1);
        let seg = |kind: u8, a: u32, b: u32, tokens: u32| Segment {
            kind,
            a,
            b,
            tokens,
            fresh: None,
        };
        let mut system = vec![match s.kind {
            // chat-lab: one system prompt for everyone, then the user's persona.
            WorkloadKind::ChatLab => seg(1, 0, 0, s.system_tokens),
            _ => seg(1, conv, 0, s.system_tokens),
        }];
        if s.persona_tokens > 0 {
            system.push(seg(3, conv, 0, s.persona_tokens));
        }
        let mut messages = vec![("system", system)];
        for t in 0..=turn {
            messages.push(("user", vec![seg(2, conv, t, s.question_tokens)]));
            if t < turn {
                messages.push(("assistant", vec![seg(4, conv, t, s.output_tokens)]));
            }
        }
        GenParts {
            group: c,
            messages,
            output_tokens: s.output_tokens,
        }
    }

    fn build(&mut self, messages: Vec<(&'static str, String)>, group: u32) -> GenRequest {
        let s = &self.spec;
        let prompt_bytes = messages.iter().map(|(_, t)| t.len()).sum();
        let (path, body) = match s.api {
            Api::Chat => (
                "/v1/chat/completions",
                json!({
                    "model": s.model,
                    "messages": messages.iter().map(|(r, t)| json!({"role": r, "content": t})).collect::<Vec<_>>(),
                    "max_tokens": s.output_tokens,
                    "ignore_eos": true,
                    "stream": true,
                    "stream_options": {"include_usage": true},
                }),
            ),
            Api::Completions => (
                "/v1/completions",
                json!({
                    "model": s.model,
                    "prompt": messages.iter().map(|(_, t)| t.as_str()).collect::<Vec<_>>().join("\n"),
                    "max_tokens": s.output_tokens,
                    "ignore_eos": true,
                    "stream": true,
                    "stream_options": {"include_usage": true},
                }),
            ),
        };
        GenRequest {
            path,
            body,
            prompt_bytes,
            group,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::emulator::tokenize::Tokenization;

    #[test]
    fn text_sizing_matches_the_tiny_tokenizer() {
        let Tokenization::Model(tok) = Tokenization::tiny() else {
            unreachable!()
        };
        let mut rng = SeededRng::new(3);
        let text = text_of_bytes(500_000, &mut rng);
        let n = tok.encode(&text, false).unwrap().len();
        let bpt = text.len() as f64 / n as f64;
        assert!(
            (bpt - TEXT_BYTES_PER_TOKEN).abs() < 0.03,
            "{bpt:.3} bytes per token; update TEXT_BYTES_PER_TOKEN"
        );
    }
}

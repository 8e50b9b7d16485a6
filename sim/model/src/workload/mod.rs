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
//! | agent-session | one system prompt shared by all sessions (2000 tok) + the session's private repository/tool context (6000 tok) + history + a 700-token user/tool turn; 24 sessions at once × 10 turns, served in rounds (think time) | 250 |
//! | bursty-cold-start | rounds of 24 brand-new documents (4000 tok) + a 300-token question; half the documents get 3 more questions in the same round | 200 |
//!
//! Multi-turn workloads replay recorded assistant turns (deterministic
//! words), not what the server answered, so the prefix a turn extends is
//! fixed by the seed, as in a conversation-replay dataset.
//!
//! **agent-session** does not draw turns at random: the `groups` active
//! sessions are served in a seeded random permutation, one turn each, then
//! re-permuted (never the same session twice in a row across the seam), so
//! consecutive turns of a session are about `groups` requests apart (think
//! time ≈ groups / rate). A session that has done its `prompts_per_group`
//! turns is replaced by a new one (new identity, new private context; the
//! system prompt stays). The first session of slot `c` is cut to
//! `turns − ⌊c · turns / groups⌋` turns, so sessions do not all start and end
//! in the same round: from the start the fleet sees a steady mix of cold
//! first turns and long warm histories. In a sessions stage
//! ([`stages::StageKind::Sessions`]) the stage picks instead: each session
//! is its own client and sends its turns in order
//! ([`Workload::session_parts`]).
//!
//! **bursty-cold-start** proceeds in rounds: round `r` brings `groups`
//! documents never sent before and emits, shuffled within the round, one
//! request per document and, for a seeded half of them,
//! `prompts_per_group − 1` more with other questions. Identical cold
//! prefixes so arrive close together, while the first may still be in
//! prefill; every document of a round comes before any of the next.

pub mod ceiling;
pub mod prompt;
pub mod reject;
pub mod report;
pub mod stages;

use crate::words::text_of_bytes;
use kvroute_core::scheduling::Rng;
use serde_json::{json, Value};
use std::collections::HashMap;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WorkloadKind {
    SharedPrefix,
    CodeGeneration,
    Reasoning,
    ChatLab,
    AgentSession,
    BurstyColdStart,
}

/// Every workload name, in the order of the module's table.
pub const WORKLOAD_NAMES: &[&str] = &[
    "shared-prefix",
    "code-generation",
    "reasoning",
    "chat-lab",
    "agent-session",
    "bursty-cold-start",
];

impl WorkloadKind {
    pub fn parse(s: &str) -> Result<WorkloadKind, String> {
        match s {
            "shared-prefix" => Ok(WorkloadKind::SharedPrefix),
            "code-generation" => Ok(WorkloadKind::CodeGeneration),
            "reasoning" => Ok(WorkloadKind::Reasoning),
            "chat-lab" => Ok(WorkloadKind::ChatLab),
            "agent-session" => Ok(WorkloadKind::AgentSession),
            "bursty-cold-start" => Ok(WorkloadKind::BurstyColdStart),
            other => Err(format!(
                "unknown workload {other:?}: use one of {}",
                WORKLOAD_NAMES.join(", ")
            )),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            WorkloadKind::SharedPrefix => "shared-prefix",
            WorkloadKind::CodeGeneration => "code-generation",
            WorkloadKind::Reasoning => "reasoning",
            WorkloadKind::ChatLab => "chat-lab",
            WorkloadKind::AgentSession => "agent-session",
            WorkloadKind::BurstyColdStart => "bursty-cold-start",
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
    /// shared-prefix: groups; code-generation: conversations; chat-lab:
    /// users; agent-session: sessions active at once; bursty-cold-start:
    /// new documents per round.
    pub groups: u32,
    /// shared-prefix: questions per group; multi-turn: turns per
    /// conversation; bursty-cold-start: requests per repeated document.
    pub prompts_per_group: u32,
    /// The shared / system part of each prompt (bursty-cold-start: the
    /// document).
    pub system_tokens: u32,
    /// chat-lab: persona per user; agent-session: the session's private
    /// repository/tool context; ignored elsewhere.
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
            WorkloadKind::AgentSession => WorkloadSpec {
                groups: 24,
                prompts_per_group: 10,
                system_tokens: 2000,
                persona_tokens: 6000,
                question_tokens: 700,
                output_tokens: 250,
                ..base
            },
            WorkloadKind::BurstyColdStart => WorkloadSpec {
                groups: 24,
                prompts_per_group: 4,
                system_tokens: 4000,
                question_tokens: 300,
                output_tokens: 200,
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
    /// Which group / conversation / user / session / document it belongs to.
    pub group: u32,
    /// The request's structure ([`Workload::next_parts`]'s answer), for
    /// what is computed without text (the hit-ratio ceiling).
    pub parts: GenParts,
}

/// Generates a workload's requests in a seeded order.
pub struct Workload {
    spec: WorkloadSpec,
    seed: u64,
    rng: Rng,
    /// Text cache: (kind, a, b) → text.
    texts: HashMap<(u8, u32, u32), String>,
    /// Multi-turn: next turn per conversation, and the generation (a
    /// conversation that finished all its turns starts over as a new one).
    next_turn: Vec<u32>,
    generation: Vec<u32>,
    /// Fresh (never repeated) texts handed out so far.
    fresh: u64,
    /// agent-session: the sessions' order in this round and the next
    /// position; bursty-cold-start: this round's (document, question)
    /// requests, shuffled, and the next position.
    order: Vec<(u32, u32)>,
    pos: usize,
    /// Rounds begun (bursty-cold-start).
    round: u32,
}

/// Sub-stream of the fresh texts (`Rng::derive(seed, FRESH_STREAM ^ n)`).
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
            rng: Rng::derive(seed, 0xA11),
            spec,
            seed,
            texts: HashMap::new(),
            next_turn: vec![0; n],
            generation: vec![0; n],
            fresh: 0,
            order: Vec::new(),
            pos: 0,
            round: 0,
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
                text_of_bytes(bytes, &mut Rng::derive(seed, stream))
            })
            .clone()
    }

    /// The text of a segment (fresh text is not cached: it is never reused).
    fn segment_text(&mut self, seg: Segment) -> String {
        match seg.fresh {
            Some(n) => {
                let bytes = self.bytes(seg.tokens);
                text_of_bytes(bytes, &mut Rng::derive(self.seed, FRESH_STREAM ^ n))
            }
            None => self.text(seg.kind, seg.a, seg.b, seg.tokens),
        }
    }

    /// The next request.
    pub fn next_request(&mut self) -> GenRequest {
        let parts = self.next_parts();
        self.request_of(parts)
    }

    /// The request a structure stands for, with its text.
    pub fn request_of(&mut self, parts: GenParts) -> GenRequest {
        let mut messages = Vec::with_capacity(parts.messages.len());
        for (role, segs) in parts.messages.iter().cloned() {
            let mut text = String::new();
            for (i, seg) in segs.into_iter().enumerate() {
                if i > 0 {
                    text.push('\n');
                }
                text.push_str(&self.segment_text(seg));
            }
            messages.push((role, text));
        }
        self.build(messages, parts)
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
            WorkloadKind::AgentSession => self.next_agent_turn(),
            WorkloadKind::BurstyColdStart => self.next_burst_request(),
        }
    }

    /// Turn `turn` (from 0) of conversation `session`, for a sessions
    /// stage, where each conversation is its own client and the stage, not
    /// the workload, decides when each turn is sent. agent-session only:
    /// `session`'s private context and turns, behind the shared system
    /// prompt, as [`next_parts`](Self::next_parts) gives them.
    pub fn session_parts(&self, session: u32, turn: u32) -> Result<GenParts, String> {
        match self.spec.kind {
            WorkloadKind::AgentSession => Ok(self.agent_parts(session, turn)),
            other => Err(format!(
                "sessions stages need the agent-session workload, not {}",
                other.name()
            )),
        }
    }

    /// Fisher–Yates with the workload's generator.
    fn shuffle<T>(&mut self, v: &mut [T]) {
        for i in (1..v.len()).rev() {
            let j = self.rng.below(i as u64 + 1) as usize;
            v.swap(i, j);
        }
    }

    /// agent-session: the next session of the round's permutation, its
    /// next turn.
    fn next_agent_turn(&mut self) -> GenParts {
        let s = self.spec.clone();
        let groups = s.groups.max(1);
        let turns = s.prompts_per_group.max(1);
        if self.pos >= self.order.len() {
            let last = self.order.last().map(|&(c, _)| c);
            let mut order: Vec<(u32, u32)> = (0..groups).map(|c| (c, 0)).collect();
            self.shuffle(&mut order);
            // Never the same session back to back across the seam.
            if order.len() > 1 && Some(order[0].0) == last {
                let j = 1 + self.rng.below(order.len() as u64 - 1) as usize;
                order.swap(0, j);
            }
            self.order = order;
            self.pos = 0;
        }
        let c = self.order[self.pos].0;
        self.pos += 1;
        let turn = self.next_turn[c as usize];
        let generation = self.generation[c as usize];
        // The first session of each slot is cut short, staggered over the
        // slots, so sessions do not run in lockstep.
        let length = if generation == 0 {
            turns - (u64::from(c) * u64::from(turns) / u64::from(groups)) as u32
        } else {
            turns
        };
        if turn + 1 >= length {
            self.next_turn[c as usize] = 0;
            self.generation[c as usize] += 1;
        } else {
            self.next_turn[c as usize] = turn + 1;
        }
        self.agent_parts(c + generation * groups, turn)
    }

    /// agent-session: turn `turn` of session `session`. The session's
    /// identity fixes its private context and turns; the system prompt is
    /// everyone's.
    fn agent_parts(&self, session: u32, turn: u32) -> GenParts {
        let s = &self.spec;
        let seg = |kind: u8, a: u32, b: u32, tokens: u32| Segment {
            kind,
            a,
            b,
            tokens,
            fresh: None,
        };
        let mut system = vec![seg(1, 0, 0, s.system_tokens)];
        if s.persona_tokens > 0 {
            system.push(seg(3, session, 0, s.persona_tokens));
        }
        let mut messages = vec![("system", system)];
        for t in 0..=turn {
            messages.push(("user", vec![seg(2, session, t, s.question_tokens)]));
            if t < turn {
                messages.push(("assistant", vec![seg(4, session, t, s.output_tokens)]));
            }
        }
        GenParts {
            group: session,
            messages,
            output_tokens: s.output_tokens,
        }
    }

    /// bursty-cold-start: the next request of the round (a new round, with
    /// new documents, when this one is done).
    fn next_burst_request(&mut self) -> GenParts {
        let s = self.spec.clone();
        let groups = s.groups.max(1);
        if self.pos >= self.order.len() {
            let base = self.round * groups;
            self.round += 1;
            // A seeded half of the documents is asked again.
            let mut docs: Vec<u32> = (0..groups).map(|i| base + i).collect();
            self.shuffle(&mut docs);
            let repeated = (groups / 2) as usize;
            let mut order: Vec<(u32, u32)> = (0..groups).map(|i| (base + i, 0)).collect();
            for &d in &docs[..repeated] {
                order.extend((1..s.prompts_per_group.max(1)).map(|q| (d, q)));
            }
            self.shuffle(&mut order);
            self.order = order;
            self.pos = 0;
        }
        let (d, q) = self.order[self.pos];
        self.pos += 1;
        let seg = |kind: u8, a: u32, b: u32, tokens: u32| Segment {
            kind,
            a,
            b,
            tokens,
            fresh: None,
        };
        GenParts {
            group: d,
            messages: vec![
                ("system", vec![seg(1, d, 0, s.system_tokens)]),
                ("user", vec![seg(2, d, q, s.question_tokens)]),
            ],
            output_tokens: s.output_tokens,
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

    fn build(&mut self, messages: Vec<(&'static str, String)>, parts: GenParts) -> GenRequest {
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
            group: parts.group,
            parts,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::vllm_server::tokenize::Tokenization;
    use std::collections::{HashMap, HashSet};
    #[test]
    fn text_sizing_matches_the_tiny_tokenizer() {
        let Tokenization::Model(tok) = Tokenization::tiny() else {
            unreachable!()
        };
        let mut rng = Rng::new(3);
        let text = text_of_bytes(500_000, &mut rng);
        let n = tok.encode(&text, false).unwrap().len();
        let bpt = text.len() as f64 / n as f64;
        assert!(
            (bpt - TEXT_BYTES_PER_TOKEN).abs() < 0.03,
            "{bpt:.3} bytes per token; update TEXT_BYTES_PER_TOKEN"
        );
    }

    fn small(kind: WorkloadKind) -> WorkloadSpec {
        WorkloadSpec {
            system_tokens: 40,
            persona_tokens: if kind == WorkloadKind::AgentSession {
                30
            } else {
                0
            },
            question_tokens: 12,
            output_tokens: 8,
            ..WorkloadSpec::standard(kind)
        }
    }

    /// The messages' texts, in order.
    fn texts(r: &GenRequest) -> Vec<(String, String)> {
        r.body["messages"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| {
                (
                    m["role"].as_str().unwrap().to_owned(),
                    m["content"].as_str().unwrap().to_owned(),
                )
            })
            .collect()
    }

    const NEW: [WorkloadKind; 2] = [WorkloadKind::AgentSession, WorkloadKind::BurstyColdStart];

    #[test]
    fn new_kinds_are_reachable_by_name() {
        for name in WORKLOAD_NAMES {
            assert_eq!(WorkloadKind::parse(name).unwrap().name(), *name);
        }
        let e = WorkloadKind::parse("agent").unwrap_err();
        assert!(
            e.contains("agent-session") && e.contains("bursty-cold-start"),
            "{e}"
        );
    }

    #[test]
    fn new_kinds_depend_only_on_the_seed() {
        for kind in NEW {
            let spec = small(kind);
            let run = |seed| {
                let mut w = Workload::new(spec.clone(), seed);
                (0..200).map(|_| w.next_request().body).collect::<Vec<_>>()
            };
            assert_eq!(run(7), run(7), "{kind:?}");
            assert_ne!(run(7), run(8), "{kind:?}");
        }
    }

    #[test]
    fn text_form_and_parts_form_agree() {
        for kind in NEW {
            for api in [Api::Chat, Api::Completions] {
                let spec = WorkloadSpec { api, ..small(kind) };
                let (mut text, mut parts) =
                    (Workload::new(spec.clone(), 3), Workload::new(spec, 3));
                for i in 0..300 {
                    let r = text.next_request();
                    let p = parts.next_parts();
                    assert_eq!(r.parts, p, "{kind:?} request {i}");
                    // The text the parts stand for is the text sent.
                    let mut rendered = Vec::new();
                    for (role, segs) in &p.messages {
                        let t: Vec<String> = segs.iter().map(|s| parts.segment_text(*s)).collect();
                        rendered.push((role.to_string(), t.join("\n")));
                    }
                    match api {
                        Api::Chat => assert_eq!(texts(&r), rendered, "{kind:?} request {i}"),
                        Api::Completions => {
                            let joined: Vec<String> =
                                rendered.into_iter().map(|(_, t)| t).collect();
                            assert_eq!(r.body["prompt"], joined.join("\n"), "{kind:?} {i}");
                        }
                    }
                    assert_eq!(r.group, p.group);
                }
            }
        }
    }

    #[test]
    fn agent_turns_are_spaced_by_the_other_sessions_and_extend_the_previous_turn() {
        let spec = small(WorkloadKind::AgentSession);
        let groups = spec.groups as usize;
        let turns = spec.prompts_per_group as usize;
        let mut w = Workload::new(spec.clone(), 11);
        let reqs: Vec<GenRequest> = (0..groups * turns * 5).map(|_| w.next_request()).collect();
        let mut last: HashMap<u32, usize> = HashMap::new();
        let mut gaps = Vec::new();
        let system = texts(&reqs[0])[0].1.split('\n').next().unwrap().to_owned();
        let mut contexts = HashSet::new();
        let mut session_turns: HashMap<u32, usize> = HashMap::new();
        for (i, r) in reqs.iter().enumerate() {
            let m = texts(r);
            // One system prompt for all sessions, then the private context.
            let (sys, ctx) = m[0].1.split_once('\n').unwrap();
            assert_eq!(sys, system);
            let turn = (m.len() - 2) / 2;
            let n = session_turns.entry(r.group).or_insert(0);
            assert_eq!(turn, *n, "session {} turn order", r.group);
            *n += 1;
            assert!(*n <= turns);
            if turn == 0 {
                // A new session: a private context never seen before.
                assert!(
                    contexts.insert(ctx.to_owned()),
                    "request {i}: context reused"
                );
            }
            if let Some(&j) = last.get(&r.group) {
                // Other requests between two turns of one session.
                assert!(i - j > 1, "session {} back to back at {i}", r.group);
                gaps.push((i - j) as f64);
                // Turn t's prompt extends turn t−1's exactly.
                let prev = texts(&reqs[j]);
                assert_eq!(m[..prev.len()], prev[..], "request {i}");
                assert_eq!(m.len(), prev.len() + 2);
                assert_eq!(m[prev.len()].0, "assistant");
                let flat = |v: &[(String, String)]| {
                    v.iter()
                        .map(|(_, t)| t.as_str())
                        .collect::<Vec<_>>()
                        .join("\n")
                };
                assert!(flat(&m).starts_with(&flat(&prev)));
            }
            // Session ids are never reused, so a finished session's entry
            // is never looked up again.
            last.insert(r.group, i);
        }
        let mean = gaps.iter().sum::<f64>() / gaps.len() as f64;
        assert!(
            (mean - groups as f64).abs() < 0.1 * groups as f64,
            "mean gap {mean} requests, groups {groups}"
        );
        // Sessions are replaced: many more than `groups` were seen, and
        // every replacement ran all its turns unless cut by the end.
        assert!(session_turns.len() > 3 * groups, "{}", session_turns.len());
        let first = session_turns
            .iter()
            .filter(|(s, _)| **s < groups as u32)
            .map(|(_, n)| *n)
            .collect::<HashSet<_>>();
        // The first sessions are staggered: lengths 1..=turns.
        assert!(first.len() >= turns / 2, "{first:?}");
    }

    #[test]
    fn a_session_turn_is_the_turn_the_rounds_give_that_session() {
        let spec = small(WorkloadKind::AgentSession);
        let mut w = Workload::new(spec.clone(), 4);
        let mut turns: HashMap<u32, u32> = HashMap::new();
        for _ in 0..spec.groups * spec.prompts_per_group * 3 {
            let p = w.next_parts();
            let t = turns.entry(p.group).or_insert(0);
            assert_eq!(w.session_parts(p.group, *t).unwrap(), p);
            *t += 1;
        }
        let e = Workload::new(small(WorkloadKind::SharedPrefix), 4)
            .session_parts(0, 0)
            .unwrap_err();
        assert!(e.contains("agent-session"), "{e}");
    }

    #[test]
    fn bursty_rounds_bring_new_documents_and_repeats_share_them() {
        let spec = small(WorkloadKind::BurstyColdStart);
        let groups = spec.groups;
        let per_round = (groups + groups / 2 * (spec.prompts_per_group - 1)) as usize;
        let mut w = Workload::new(spec.clone(), 5);
        let reqs: Vec<GenRequest> = (0..per_round * 4).map(|_| w.next_request()).collect();
        let mut doc_round: HashMap<String, usize> = HashMap::new();
        let mut doc_questions: HashMap<String, HashSet<String>> = HashMap::new();
        for (round, chunk) in reqs.chunks(per_round).enumerate() {
            let mut docs = HashMap::new();
            for r in chunk {
                let m = texts(r);
                let (doc, question) = (m[0].1.clone(), m[1].1.clone());
                // Never reused across rounds.
                assert_eq!(*doc_round.entry(doc.clone()).or_insert(round), round);
                // Repeats share the document and differ in the question.
                assert!(doc_questions
                    .entry(doc.clone())
                    .or_default()
                    .insert(question));
                *docs.entry(doc).or_insert(0u32) += 1;
            }
            // Every document of the round, and only those, in this round.
            assert_eq!(docs.len() as u32, groups, "round {round}");
            let repeated = docs
                .values()
                .filter(|&&n| n == spec.prompts_per_group)
                .count();
            assert_eq!(repeated as u32, groups / 2, "round {round}");
            assert!(docs
                .values()
                .all(|&n| n == 1 || n == spec.prompts_per_group));
        }
        // Shuffled within a round: the repeats are not all at the end.
        let first = &reqs[..per_round];
        let first_repeat = first
            .iter()
            .enumerate()
            .filter(|(i, r)| first[..*i].iter().any(|p| p.group == r.group))
            .map(|(i, _)| i)
            .min()
            .unwrap();
        assert!(first_repeat < per_round / 2, "{first_repeat}");
    }
}

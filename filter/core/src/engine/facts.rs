//! What the engine routes on: a request's facts ([`RequestFacts`]), read
//! from its body by [`Engine::facts`] or built from blocks directly
//! ([`RequestFacts::blocks`]: the simulator and the benches).

use super::{Engine, Unrouted};
use crate::blocks::prompt_blocks;
use crate::precise::Fallback;
use crate::request::{parse_request, parse_request_for_template, ApiKind, Prompt};
use crate::scheduling::charge::Work;

/// One request as the engine sees it: its prompt cut into blocks, and what
/// the charge and the learners need to know about it.
#[derive(Clone, Debug, PartialEq)]
pub struct RequestFacts {
    /// kvroute's chained block hashes of the prompt (`blocks::prompt_blocks`):
    /// the approximate index's keys, kept up to date in precise mode too
    /// (it is the fallback).
    pub hashes: Vec<u64>,
    /// The prompt's tokens (estimated at `charsPerToken` for text).
    pub prompt_tokens: u64,
    /// Precise mode's input (`None`: precise mode off): the prompt's vLLM
    /// block hashes and exact token count, or why they could not be had
    /// (the approximate index decides then).
    pub precise: Option<Result<(Vec<u64>, u64), Fallback>>,
    /// The client's output cap (`max_tokens` and friends), if any.
    pub max_output_tokens: Option<u64>,
    /// `n` / `best_of` and a completions batch's other prompts.
    pub work: Work,
    /// A text prompt's bytes (`None`: token IDs or exact counts): counted
    /// on the endpoint for the bytes-per-token learner, and scaled with it
    /// (see [`Engine::snapshot`]).
    pub text_bytes: Option<u64>,
    /// The client asked for a streamed answer.
    pub stream: bool,
    /// Keep each scorer's score in the decision
    /// (`Decision::scorer_scores`): the simulator's decision log. Off on
    /// the request path, which does not allocate them.
    pub scorer_scores: bool,
    /// Precise mode with `tokenizeIn: collector`: the prompt's text to look
    /// up in shared data when routing ([`Engine::route`] fills `precise`
    /// from it).
    pub offpath: Option<OffPathText>,
    /// Full blocks of the prompt past its known vLLM hashes (a stored
    /// prefix and new text after it: estimated).
    pub precise_unknown_blocks: u32,
    /// Precise mode with the prompt's token IDs at hand (not `tokenizeIn:
    /// collector`): those IDs and the `cache_salt`, for [`Engine::route`]
    /// to hash again with a LoRA adapter's key when the models table says
    /// the `model` is one (`engine/models.rs`). Dropped with the facts: kept
    /// while flow control queues the request (4 bytes a token, besides its
    /// body).
    pub precise_ids: Option<PreciseIds>,
    /// The body's `model` (flow control's objective by model).
    pub model: String,
    /// The request's session, read from its headers by the lifecycle
    /// ([`Engine::session_ref`]); `None` without one.
    pub session: Option<super::SessionRef>,
    /// The API the body was read as (`None`: built from blocks, or a
    /// passthrough request): the shape of a local error reply
    /// ([`Engine::fail_for`]).
    pub api: Option<ApiKind>,
}

/// A prompt's vLLM token IDs and `cache_salt` (see
/// [`RequestFacts::precise_ids`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PreciseIds {
    pub ids: Vec<u32>,
    pub salt: Option<String>,
}

/// A prompt's rendered text, for the off-path lookup.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OffPathText {
    pub model: u8,
    pub text: String,
    pub add_special: bool,
    pub salt: Option<String>,
}

/// Longest body `model` that `routing.modelHeader` carries.
pub const MODEL_HEADER_MAX_BYTES: usize = 256;

/// The value of the model header (`routing.modelHeader`) for a body's
/// `model`: the model itself when it is a header value Envoy's routes can
/// match exactly (1 to [`MODEL_HEADER_MAX_BYTES`] bytes of visible ASCII,
/// spaces inside it allowed); `None` otherwise (no model, or one that is
/// not a plain header value: the header is then left absent, since the
/// client's copy was removed at the request's headers).
pub fn model_header_value(model: &str) -> Option<&str> {
    let b = model.as_bytes();
    let plain = |c: &u8| c.is_ascii_graphic() || *c == b' ';
    let ok = !b.is_empty()
        && b.len() <= MODEL_HEADER_MAX_BYTES
        && b.iter().all(plain)
        && b.first() != Some(&b' ')
        && b.last() != Some(&b' ');
    ok.then_some(model)
}

impl RequestFacts {
    /// A prompt already cut into blocks (the simulator, the benches): one
    /// prompt, one output sequence, no text bytes, no precise hashes, not
    /// streamed.
    pub fn blocks(
        hashes: Vec<u64>,
        prompt_tokens: u64,
        max_output_tokens: Option<u64>,
    ) -> RequestFacts {
        RequestFacts {
            hashes,
            prompt_tokens,
            precise: None,
            max_output_tokens,
            work: Work::ONE,
            text_bytes: None,
            stream: false,
            scorer_scores: false,
            offpath: None,
            precise_unknown_blocks: 0,
            precise_ids: None,
            model: String::new(),
            session: None,
            api: None,
        }
    }
}

impl Engine {
    /// A request routed on load alone (llm-d's `passthrough-parser`): no
    /// prompt to match, its body's `bytes` charged as prompt text at
    /// `charsPerToken`, released as a streamed answer (the prompt part at
    /// the first response byte, the rest at the end), since nothing says
    /// whether it streams.
    pub fn load_only_facts(&self, bytes: u64) -> RequestFacts {
        let cpt = u64::from(self.config.prefix.blocks.chars_per_token.max(1));
        let mut facts = RequestFacts::blocks(Vec::new(), bytes.div_ceil(cpt), None);
        facts.stream = true;
        facts
    }

    /// A request's facts from its body: parse it (`request::parse_request`),
    /// then, in precise mode, turn the prompt into vLLM's block hashes, and
    /// cut it into kvroute's blocks. A body that does not parse is
    /// `Unrouted::BadBody` (give it to [`Engine::fail_for`]).
    pub fn facts(&self, kind: ApiKind, body: &[u8]) -> Result<RequestFacts, Unrouted> {
        let precise = self.config.precise.as_ref();
        // With a tokenizer, the one parse also takes what a chat template
        // reads (the body is not read again to render it).
        let (req, chat) = match precise {
            Some(p) if p.reads_chat_templates() => {
                parse_request_for_template(kind, body, &self.limits)
            }
            _ => parse_request(kind, body, &self.limits).map(|r| (r, None)),
        }
        .map_err(Unrouted::BadBody)?;
        // Precise mode: vLLM's own hashes of the prompt, matched against the
        // blocks the servers hold (`kvEvents`); or, when they cannot be had,
        // the reason the approximate index decides instead.
        let mut offpath = None;
        let mut precise_ids = None;
        let precise = precise.map(|p| match p.offpath_for(&req.model) {
            Some((model, m)) => match offpath_text(m, &req, body, chat.as_ref()) {
                Ok((text, add_special)) => {
                    offpath = Some(OffPathText {
                        model,
                        text,
                        add_special,
                        salt: req.cache_salt.clone(),
                    });
                    // Filled from shared data when routing.
                    Err(Fallback::NotHashedYet)
                }
                Err(why) => Err(why),
            },
            None => p.token_ids(&req, body, chat.as_ref()).map(|ids| {
                let salt = req.cache_salt.as_deref();
                let hashes = p.hashes_of(&ids, None, salt);
                let tokens = ids.len() as u64;
                precise_ids = Some(PreciseIds {
                    ids: ids.into_owned(),
                    salt: req.cache_salt.clone(),
                });
                (hashes, tokens)
            }),
        });
        let blocks = prompt_blocks(&req, &self.config.prefix.blocks);
        let text_bytes = match &req.prompt {
            Prompt::Text(t) => Some(t.len() as u64),
            Prompt::TokenIds(_) => None,
        };
        // n / best_of and a completions batch's other prompts (their text
        // estimated at `charsPerToken`, as a prompt without a learnt figure).
        let cpt = u64::from(self.config.prefix.blocks.chars_per_token.max(1));
        let rest = req.batch_rest;
        let work = Work {
            sequences: req.sequences,
            extra_prompts: rest.prompts,
            extra_prompt_tokens: rest.token_ids.saturating_add(rest.text_bytes.div_ceil(cpt)),
        };
        Ok(RequestFacts {
            hashes: blocks.block_hashes,
            prompt_tokens: blocks.prompt_tokens,
            precise,
            max_output_tokens: req.max_output_tokens,
            work,
            text_bytes,
            stream: req.stream,
            scorer_scores: false,
            offpath,
            precise_unknown_blocks: 0,
            precise_ids,
            model: req.model,
            session: None,
            api: Some(kind),
        })
    }
}

/// A text or chat prompt's text as vLLM tokenizes it, and its
/// `add_special_tokens` (token-ID prompts have no text: hashed directly).
#[cfg(feature = "tokenizer")]
fn offpath_text(
    m: &crate::precise::OffPathModel,
    req: &crate::request::InferenceRequest,
    body: &[u8],
    chat: Option<&crate::request::ChatTemplateInputs>,
) -> Result<(String, bool), Fallback> {
    use crate::precise::tokenizer::completion_add_special;
    match (&req.prompt, req.kind) {
        (Prompt::TokenIds(_), _) => Err(Fallback::Unsupported),
        (Prompt::Text(text), ApiKind::Completions) => {
            let text = std::str::from_utf8(text).map_err(|_| Fallback::Tokenize)?;
            Ok((text.to_owned(), completion_add_special(body)?))
        }
        (Prompt::Text(_), ApiKind::ChatCompletions) => Ok(match chat {
            Some(chat) => m.renderer.render_inputs(chat)?,
            None => m.renderer.render_chat(body)?,
        }),
        (Prompt::Text(_), ApiKind::Messages) => Ok(m
            .renderer
            .render_inputs(chat.ok_or(Fallback::Unsupported)?)?),
        (Prompt::Text(_), _) => Err(Fallback::Unsupported),
    }
}

#[cfg(not(feature = "tokenizer"))]
fn offpath_text(
    m: &crate::precise::OffPathModel,
    _req: &crate::request::InferenceRequest,
    _body: &[u8],
    _chat: Option<&crate::request::ChatTemplateInputs>,
) -> Result<(String, bool), Fallback> {
    match *m {}
}

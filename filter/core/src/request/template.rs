//! What precise mode's chat template reads from a chat body, taken while
//! `render` reads it (the [`Capture`] it is given), so a body is read once:
//! each message as the template's value, `tools`, `add_generation_prompt`,
//! `continue_final_message`, `add_special_tokens` and
//! `chat_template_kwargs`.
//!
//! The values are those that deserialising the body with serde_json into
//! minijinja values gives (`ModelTokenizer::render_chat`, which the
//! emulator uses, still does that): maps keep the body's key order, a
//! repeated key keeps its first place and its last value, numbers and
//! strings are serde_json's. Content text is taken from the rendered
//! prompt, where the reader has already decoded it; a value routing skips
//! is deserialised from its slice of the body. Where that deserialisation
//! would fail (a wrong type, a repeated field, serde_json's nesting limit
//! counted from the body's top), [`ChatTemplateInputs::error`] says so, and
//! the template is not rendered.
//!
//! Each message keeps its own value and its slice of the body
//! ([`TemplateMessage`]), so that what is computed per message can later be
//! kept per message.

use super::render::Capture;
use minijinja::Value;
use std::collections::BTreeMap;
use std::ops::Range;

/// What a chat template reads from one chat body.
#[derive(Debug, Default)]
pub struct ChatTemplateInputs {
    /// `messages`, in order.
    pub messages: Vec<TemplateMessage>,
    /// `tools` (`None`: absent or null).
    pub tools: Option<Value>,
    pub add_generation_prompt: Option<bool>,
    pub continue_final_message: Option<bool>,
    pub add_special_tokens: Option<bool>,
    pub chat_template_kwargs: Option<BTreeMap<String, Value>>,
    /// Why these fields do not deserialise (the first reason), if they do
    /// not: the template is then not rendered.
    pub error: Option<String>,
    /// Why vLLM's prompt for this request cannot be reproduced (an
    /// Anthropic request's conversion, `anthropic.rs`): the request falls
    /// back to the approximate index.
    pub unsupported: Option<&'static str>,
}

/// One message of a chat body.
#[derive(Debug)]
pub struct TemplateMessage {
    /// Where its JSON is in the body (bytes).
    pub raw: Range<usize>,
    /// The message as the template's value.
    pub value: Value,
}

/// serde_json's nesting limit: a value `k` containers deep, inside `outer`
/// containers of the body (the body's own object counts), does not
/// deserialise when `outer + k` is over this.
const MAX_NESTING: usize = 127;

/// The top-level fields the template reads that routing skips.
#[derive(Clone, Copy)]
enum Top {
    AddGenerationPrompt,
    ContinueFinalMessage,
    AddSpecialTokens,
    ChatTemplateKwargs,
}

impl Top {
    fn name(self) -> &'static str {
        match self {
            Top::AddGenerationPrompt => "add_generation_prompt",
            Top::ContinueFinalMessage => "continue_final_message",
            Top::AddSpecialTokens => "add_special_tokens",
            Top::ChatTemplateKwargs => "chat_template_kwargs",
        }
    }
}

/// Builds [`ChatTemplateInputs`] from what the reader hands over.
#[derive(Default)]
pub(super) struct Capturing {
    inputs: ChatTemplateInputs,
    /// The top-level field whose value comes next.
    top: Option<Top>,
    seen: [bool; 4],
    /// The key of the next raw field.
    key: Value,
    /// The fields of the message being read, in body order.
    message: Vec<(Value, Value)>,
    message_start: usize,
    /// The content parts of the message being read.
    parts: Vec<Value>,
    /// The fields of the part being read (`in_part`).
    part: Vec<(Value, Value)>,
    in_part: bool,
}

impl Capturing {
    pub fn finish(self) -> ChatTemplateInputs {
        self.inputs
    }

    fn fail(&mut self, why: String) {
        self.inputs.error.get_or_insert(why);
    }

    /// A JSON value inside `outer` containers of the body, as serde_json
    /// deserialises it there.
    fn value(&mut self, raw: &[u8], outer: usize) -> Value {
        if too_deep(raw, outer) {
            self.fail("recursion limit exceeded".into());
            return Value::UNDEFINED;
        }
        serde_json::from_slice(raw).unwrap_or_else(|e| {
            self.fail(e.to_string());
            Value::UNDEFINED
        })
    }

    fn put(&mut self, key: Value, value: Value) {
        if self.in_part {
            self.part.push((key, value));
        } else {
            self.message.push((key, value));
        }
    }

    fn text(&mut self, text: &[u8]) -> Value {
        match std::str::from_utf8(text) {
            Ok(t) => Value::from(t),
            Err(e) => {
                self.fail(e.to_string());
                Value::UNDEFINED
            }
        }
    }
}

/// Whether a body's `tools` value nests deeper than serde_json allows
/// (what reading the body again with serde_json would refuse).
pub(crate) fn tools_too_deep(raw: &str) -> bool {
    too_deep(raw.as_bytes(), 1)
}

/// Whether `raw` nests deeper than serde_json allows inside `outer`
/// containers (a value nested `k` deep is at least `2k` bytes long, so
/// short values are not scanned).
fn too_deep(raw: &[u8], outer: usize) -> bool {
    if raw.len() / 2 + outer <= MAX_NESTING {
        return false;
    }
    let (mut depth, mut deepest) = (0usize, 0usize);
    let (mut in_string, mut escaped) = (false, false);
    for &b in raw {
        if in_string {
            match b {
                _ if escaped => escaped = false,
                b'\\' => escaped = true,
                b'"' => in_string = false,
                _ => {}
            }
            continue;
        }
        match b {
            b'"' => in_string = true,
            b'[' | b'{' => {
                depth += 1;
                deepest = deepest.max(depth);
            }
            b']' | b'}' => depth = depth.saturating_sub(1),
            _ => {}
        }
    }
    outer + deepest > MAX_NESTING
}

impl Capture for Capturing {
    const ON: bool = true;

    fn top_key(&mut self, key: &[u8]) -> bool {
        let (top, i) = match key {
            b"add_generation_prompt" => (Top::AddGenerationPrompt, 0),
            b"continue_final_message" => (Top::ContinueFinalMessage, 1),
            b"add_special_tokens" => (Top::AddSpecialTokens, 2),
            b"chat_template_kwargs" => (Top::ChatTemplateKwargs, 3),
            _ => return false,
        };
        if std::mem::replace(&mut self.seen[i], true) {
            self.fail(format!("duplicate field `{}`", top.name()));
        }
        self.top = Some(top);
        true
    }

    fn top_value(&mut self, raw: &[u8]) {
        let Some(top) = self.top.take() else {
            return;
        };
        let flag = |c: &mut Capturing, raw: &[u8]| match serde_json::from_slice(raw) {
            Ok(v) => v,
            Err(e) => {
                c.fail(e.to_string());
                None
            }
        };
        match top {
            Top::AddGenerationPrompt => self.inputs.add_generation_prompt = flag(self, raw),
            Top::ContinueFinalMessage => self.inputs.continue_final_message = flag(self, raw),
            Top::AddSpecialTokens => self.inputs.add_special_tokens = flag(self, raw),
            Top::ChatTemplateKwargs => {
                if too_deep(raw, 1) {
                    self.fail("recursion limit exceeded".into());
                    return;
                }
                match serde_json::from_slice(raw) {
                    Ok(kw) => self.inputs.chat_template_kwargs = kw,
                    Err(e) => self.fail(e.to_string()),
                }
            }
        }
    }

    /// vLLM hands the template its own dump of the tools
    /// (`tool_dump.rs`); what it does not reproduce falls back.
    fn tools(&mut self, raw: Option<&str>) {
        let Some(raw) = raw else {
            self.inputs.tools = None;
            return;
        };
        if tools_too_deep(raw) {
            self.fail("recursion limit exceeded".into());
            return;
        }
        match super::tool_dump::chat_tools(raw) {
            Ok(v) => self.inputs.tools = Some(v),
            Err(why) => {
                self.inputs.unsupported.get_or_insert(why);
            }
        }
    }

    fn message_start(&mut self, at: usize) {
        self.message.clear();
        self.message_start = at;
    }

    fn message_end(&mut self, end: usize) {
        let value = Value::from_iter(self.message.drain(..));
        self.inputs.messages.push(TemplateMessage {
            raw: self.message_start..end,
            value,
        });
    }

    fn raw_message(&mut self, at: usize, raw: &[u8]) {
        let value = self.value(raw, 2);
        self.inputs.messages.push(TemplateMessage {
            raw: at..at + raw.len(),
            value,
        });
    }

    fn key(&mut self, key: &[u8]) {
        self.key = self.text(key);
    }

    fn raw_field(&mut self, raw: &[u8]) {
        // Inside the body, the messages, a message (and a content list and
        // a part).
        let outer = if self.in_part { 5 } else { 3 };
        let value = self.value(raw, outer);
        let key = std::mem::take(&mut self.key);
        self.put(key, value);
    }

    fn str_field(&mut self, name: &'static str, value: Option<&str>) {
        self.put(
            Value::from(name),
            value.map_or(Value::from(()), Value::from),
        );
    }

    fn text_field(&mut self, name: &'static str, text: &[u8]) {
        let value = self.text(text);
        self.put(Value::from(name), value);
    }

    fn parts_start(&mut self) {
        self.parts.clear();
    }

    fn parts_end(&mut self) {
        let parts = Value::from(std::mem::take(&mut self.parts));
        self.put(Value::from("content"), parts);
    }

    fn part_start(&mut self) {
        self.part.clear();
        self.in_part = true;
    }

    fn part_end(&mut self) {
        self.in_part = false;
        let part = Value::from_iter(self.part.drain(..));
        self.parts.push(part);
    }

    fn text_part(&mut self, text: &[u8]) {
        let value = self.text(text);
        self.parts.push(value);
    }

    fn raw_part(&mut self, raw: &[u8]) {
        let value = self.value(raw, 4);
        self.parts.push(value);
    }

    fn lost(&mut self, what: &'static str) {
        self.fail(format!("{what}: not captured"));
    }
}

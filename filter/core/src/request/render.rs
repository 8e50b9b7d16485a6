//! Chat and Responses bodies, rendered while they are read.
//!
//! One pass over the body with a [`Cursor`]: each message is rendered into
//! the output as its fields arrive, content text is decoded straight into
//! the output (no string per message, no list of messages), and every
//! other value goes to serde_json. The result is byte-identical to
//! rendering the deserialised body (the previous implementation, kept as
//! the reference of the differential test and fuzz target:
//! `filter/core/tests/differential/reference.rs`), whatever the order of
//! the fields:
//!
//! - a message's header (`<|role|>` and `<|name:…|>`) is written when its
//!   content starts if `role` came first (the usual order), else inserted
//!   before the content at the end of the message; a `name` after `content`
//!   rewrites it. Either moves the message's content once (in place);
//! - `tool_calls` is kept as a slice of the body and written at the end of
//!   the message;
//! - `tools` (chat) and `instructions` (Responses) are rendered first: when
//!   they come after the messages, they are inserted in front (one move of
//!   the rendered messages: rare);
//! - a non-text content part is replaced by its placeholder once its
//!   `type` is known (text written before it is dropped).
//!
//! Messages and parts given as JSON arrays (which serde's derive accepts
//! for structs) and values of the wrong type go through the serde types of
//! the parent module, for identical results and errors.

use super::json::{Cursor, Out, Sink};
use super::{render_message, Common, Content, Message, ParseError, Part, ResponsesInput};
use serde::de::IgnoredAny;
use serde_json::value::RawValue;
use std::borrow::Cow;
use xxhash_rust::xxh3::xxh3_64;

/// What precise mode's chat template reads from a chat body, handed over
/// while the body is read (`template.rs` builds the template's values), so
/// the body is read once. [`NoCapture`] (every other request) does nothing:
/// with `ON` false, the calls and what they are given compile away.
///
/// Names are the template's keys; raw values are JSON slices of the body.
pub(super) trait Capture {
    const ON: bool;
    /// A top-level key routing does not read: whether its raw value is
    /// wanted (given to [`Capture::top_value`]).
    fn top_key(&mut self, _key: &[u8]) -> bool {
        false
    }
    fn top_value(&mut self, _raw: &[u8]) {}
    /// `tools` (`None`: null).
    fn tools(&mut self, _raw: Option<&str>) {}
    /// A message object starts at body byte `_at`, or ends before byte `_end`.
    fn message_start(&mut self, _at: usize) {}
    fn message_end(&mut self, _end: usize) {}
    /// A message that is not an object, starting at body byte `_at`.
    fn raw_message(&mut self, _at: usize, _raw: &[u8]) {}
    /// The key of the next [`Capture::raw_field`] (of a message or a part).
    fn key(&mut self, _key: &[u8]) {}
    fn raw_field(&mut self, _raw: &[u8]) {}
    fn str_field(&mut self, _name: &'static str, _value: Option<&str>) {}
    /// A string field's decoded text (UTF-8, checked by the reader).
    fn text_field(&mut self, _name: &'static str, _text: &[u8]) {}
    /// `content` is a list: its parts follow, then [`Capture::parts_end`].
    fn parts_start(&mut self) {}
    fn parts_end(&mut self) {}
    /// A part object: its fields follow, then [`Capture::part_end`].
    fn part_start(&mut self) {}
    fn part_end(&mut self) {}
    /// A part that is a bare string (decoded), or neither string nor object.
    fn text_part(&mut self, _text: &[u8]) {}
    fn raw_part(&mut self, _raw: &[u8]) {}
    /// A value the reader took in a way the template cannot follow (never,
    /// for a body that parses).
    fn lost(&mut self, _what: &'static str) {}
}

/// No capture: routing's own parse.
pub(super) struct NoCapture;

impl Capture for NoCapture {
    const ON: bool = false;
}

/// Which body is read.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Body {
    Chat,
    Responses,
}

/// What a chat or Responses body yields.
pub(super) struct Parsed<'a> {
    pub common: Common<'a>,
    /// The rendered prompt.
    pub prompt: Vec<u8>,
    /// Chat: how many messages (`None` if `messages` is absent or null).
    pub messages: Option<usize>,
}

enum Field {
    Model,
    MaxTokens,
    MaxCompletionTokens,
    MaxOutputTokens,
    Stream,
    CacheSalt,
    Messages,
    Tools,
    Instructions,
    Input,
    N,
    BestOf,
    /// A key the capture asked for ([`Capture::top_key`]).
    Captured,
    Other,
}

fn field(body: Body, key: &[u8]) -> Field {
    match (key, body) {
        (b"model", _) => Field::Model,
        (b"max_tokens", _) => Field::MaxTokens,
        (b"max_completion_tokens", _) => Field::MaxCompletionTokens,
        (b"max_output_tokens", _) => Field::MaxOutputTokens,
        (b"stream", _) => Field::Stream,
        (b"cache_salt", _) => Field::CacheSalt,
        (b"messages", Body::Chat) => Field::Messages,
        (b"tools", Body::Chat) => Field::Tools,
        (b"instructions", Body::Responses) => Field::Instructions,
        (b"input", Body::Responses) => Field::Input,
        (b"n", _) => Field::N,
        (b"best_of", _) => Field::BestOf,
        _ => Field::Other,
    }
}

fn duplicate(cur: &Cursor<'_>, name: &str) -> ParseError {
    cur.error(&format!("duplicate field `{name}`"))
}

/// Sets `seen`, or fails if it was already set (serde's derive refuses a
/// repeated field, even when the first value was null).
fn once(cur: &Cursor<'_>, seen: &mut bool, name: &str) -> Result<(), ParseError> {
    if std::mem::replace(seen, true) {
        Err(duplicate(cur, name))
    } else {
        Ok(())
    }
}

/// Parses a chat or Responses body (whose first non-whitespace byte is `{`),
/// telling `cap` what a chat template reads.
pub(super) fn parse<'a, C: Capture>(
    body: Body,
    src: &'a [u8],
    cap: &mut C,
) -> Result<Parsed<'a>, ParseError> {
    let mut cur = Cursor::new(src);
    let mut out = Out::for_body(src.len());
    let mut scratch = Vec::new();
    let mut common = Common {
        model: None,
        max_tokens: None,
        max_completion_tokens: None,
        max_output_tokens: None,
        stream: None,
        cache_salt: None,
        n: None,
        best_of: None,
    };
    let mut seen = [false; 12];
    let mut messages = None;
    // Where the front block (tools, instructions) goes when it comes late.
    let mut body_rendered = false;
    if cur.peek() != Some(b'{') {
        return Err(cur.error("expected a JSON object"));
    }
    cur.bump();
    let mut first = true;
    while let Some(f) = cur.next_key(&mut first, &mut scratch, |k| match field(body, k) {
        Field::Other if C::ON && cap.top_key(k) => Field::Captured,
        f => f,
    })? {
        match f {
            Field::Model => {
                once(&cur, &mut seen[0], "model")?;
                common.model = cur.value()?;
            }
            Field::MaxTokens => {
                once(&cur, &mut seen[1], "max_tokens")?;
                common.max_tokens = cur.value()?;
            }
            Field::MaxCompletionTokens => {
                once(&cur, &mut seen[2], "max_completion_tokens")?;
                common.max_completion_tokens = cur.value()?;
            }
            Field::MaxOutputTokens => {
                once(&cur, &mut seen[3], "max_output_tokens")?;
                common.max_output_tokens = cur.value()?;
            }
            Field::Stream => {
                once(&cur, &mut seen[4], "stream")?;
                common.stream = cur.value()?;
            }
            Field::CacheSalt => {
                once(&cur, &mut seen[5], "cache_salt")?;
                common.cache_salt = cur.value()?;
            }
            Field::Messages => {
                once(&cur, &mut seen[6], "messages")?;
                body_rendered = true;
                messages = match cur.peek() {
                    Some(b'n') => {
                        cur.null()?;
                        None
                    }
                    Some(b'[') => Some(message_list(&mut cur, &mut out, &mut scratch, cap)?),
                    _ => {
                        // Not a list: serde_json's error for it.
                        cur.value::<Option<Vec<IgnoredAny>>>()?;
                        return Err(cur.error("invalid type: expected a sequence"));
                    }
                };
            }
            Field::Tools => {
                once(&cur, &mut seen[7], "tools")?;
                let tools = cur.value::<Option<&RawValue>>()?;
                if C::ON {
                    cap.tools(tools.map(RawValue::get));
                }
                if let Some(tools) = tools {
                    let block = [b"<|tools|>", tools.get().as_bytes(), b"\n"];
                    front(&mut out, body_rendered, &block);
                }
            }
            Field::Instructions => {
                once(&cur, &mut seen[8], "instructions")?;
                match cur.peek() {
                    Some(b'n') => cur.null()?,
                    Some(b'"') if !body_rendered => {
                        out.put(b"<|instructions|>\n");
                        cur.string_into(&mut out)?;
                        out.put_byte(b'\n');
                    }
                    Some(b'"') => {
                        let mut text = Vec::new();
                        cur.string_into(&mut text)?;
                        front(&mut out, true, &[b"<|instructions|>\n", &text, b"\n"]);
                    }
                    _ => {
                        if let Some(i) = cur.value::<Option<Cow<'_, str>>>()? {
                            let block = [b"<|instructions|>\n", i.as_bytes(), b"\n"];
                            front(&mut out, body_rendered, &block);
                        }
                    }
                }
            }
            Field::N => {
                once(&cur, &mut seen[10], "n")?;
                common.n = cur.value()?;
            }
            Field::BestOf => {
                once(&cur, &mut seen[11], "best_of")?;
                common.best_of = cur.value()?;
            }
            Field::Input => {
                once(&cur, &mut seen[9], "input")?;
                body_rendered = true;
                match cur.peek() {
                    Some(b'n') => cur.null()?,
                    Some(b'"') => {
                        out.put(b"<|user|>\n");
                        cur.string_into(&mut out)?;
                        out.put_byte(b'\n');
                    }
                    Some(b'[') => {
                        message_list(&mut cur, &mut out, &mut scratch, &mut NoCapture)?;
                    }
                    _ => match cur.value::<Option<ResponsesInput<'_>>>()? {
                        Some(ResponsesInput::Text(t)) => {
                            out.put(b"<|user|>\n");
                            out.put(t.as_bytes());
                            out.put_byte(b'\n');
                        }
                        Some(ResponsesInput::Items(items)) => {
                            for m in &items {
                                render_message(&mut out, m, &mut scratch)?;
                            }
                        }
                        None => {}
                    },
                }
            }
            Field::Captured => {
                let s = cur.pos();
                cur.value::<IgnoredAny>()?;
                cap.top_value(cur.since(s));
            }
            Field::Other => {
                cur.value::<IgnoredAny>()?;
            }
        }
    }
    if cur.peek().is_some() {
        return Err(cur.error("trailing characters"));
    }
    Ok(Parsed {
        common,
        prompt: out.into_vec(),
        messages,
    })
}

/// Writes the concatenation of `parts` at the end of `out`, or in front of
/// everything if the messages were already rendered.
fn front(out: &mut Out, in_front: bool, parts: &[&[u8]]) {
    if in_front {
        out.replace(0, 0, &parts.concat());
    } else {
        for p in parts {
            out.put(p);
        }
    }
}

/// Renders the messages (or Responses input items) of the list at the
/// cursor; returns how many there were.
fn message_list<'a, C: Capture>(
    cur: &mut Cursor<'a>,
    out: &mut Out,
    scratch: &mut Vec<u8>,
    cap: &mut C,
) -> Result<usize, ParseError> {
    cur.bump();
    let mut first = true;
    let mut n = 0;
    while cur.next_element(&mut first)? {
        out.at(cur.pos());
        if cur.peek() == Some(b'{') {
            message(cur, out, scratch, cap)?;
        } else {
            // `[role, name, content, tool_calls]`, or not a message at all.
            let at = cur.pos();
            let m: Message<'a> = cur.value()?;
            if C::ON {
                cap.raw_message(at, cur.since(at));
            }
            render_message(out, &m, scratch)?;
        }
        n += 1;
    }
    Ok(n)
}

enum MessageField {
    Role,
    Name,
    Content,
    ToolCalls,
    Other,
}

/// Renders the message object at the cursor:
/// `<|role|>` [`<|name:NAME|>`] `\n` content `\n` [`<|tool_calls|>` raw `\n`].
fn message<'a, C: Capture>(
    cur: &mut Cursor<'a>,
    out: &mut Out,
    scratch: &mut Vec<u8>,
    cap: &mut C,
) -> Result<(), ParseError> {
    if C::ON {
        cap.message_start(cur.pos());
    }
    cur.bump();
    let start = out.len();
    let mut role: Option<Cow<'a, str>> = None;
    let mut name: Option<Cow<'a, str>> = None;
    let mut tool_calls: Option<&'a RawValue> = None;
    // Length of the header once written.
    let mut header: Option<usize> = None;
    let mut seen = [false; 4];
    let mut first = true;
    while let Some(f) = cur.next_key(&mut first, scratch, |k| match k {
        b"role" => MessageField::Role,
        b"name" => MessageField::Name,
        b"content" => MessageField::Content,
        b"tool_calls" => MessageField::ToolCalls,
        _ => {
            if C::ON {
                cap.key(k);
            }
            MessageField::Other
        }
    })? {
        match f {
            MessageField::Role | MessageField::Name => {
                let slot = if matches!(f, MessageField::Role) {
                    once(cur, &mut seen[0], "role")?;
                    &mut role
                } else {
                    once(cur, &mut seen[1], "name")?;
                    &mut name
                };
                *slot = opt_str(cur, scratch)?;
                if C::ON {
                    let name = if matches!(f, MessageField::Role) {
                        "role"
                    } else {
                        "name"
                    };
                    cap.str_field(name, slot.as_deref());
                }
                if let Some(len) = header {
                    // After the content: rewrite the header.
                    header = Some(with_header(role.as_deref(), name.as_deref(), |h| {
                        out.replace(start, start + len, h);
                    }));
                }
            }
            MessageField::Content => {
                once(cur, &mut seen[2], "content")?;
                // With the role known (the usual order), the header goes
                // first; else it is inserted before the content at the end.
                if header.is_none() && seen[0] {
                    header = Some(write_header(out, role.as_deref(), name.as_deref()));
                }
                content(cur, out, scratch, cap)?;
            }
            MessageField::ToolCalls => {
                once(cur, &mut seen[3], "tool_calls")?;
                let s = cur.pos();
                tool_calls = cur.value()?;
                if C::ON {
                    cap.key(b"tool_calls");
                    cap.raw_field(cur.since(s));
                }
            }
            MessageField::Other => {
                let s = cur.pos();
                cur.value::<IgnoredAny>()?;
                if C::ON {
                    cap.raw_field(cur.since(s));
                }
            }
        }
    }
    if C::ON {
        cap.message_end(cur.pos());
    }
    if header.is_none() {
        if out.len() == start {
            write_header(out, role.as_deref(), name.as_deref());
        } else {
            with_header(role.as_deref(), name.as_deref(), |h| {
                out.replace(start, start, h)
            });
        }
    }
    out.put_byte(b'\n');
    if let Some(tc) = tool_calls {
        out.put(b"<|tool_calls|>");
        out.put(tc.get().as_bytes());
        out.put_byte(b'\n');
    }
    Ok(())
}

/// Writes `<|role|>` [`<|name:NAME|>`] `\n`; returns its length.
fn write_header(out: &mut Out, role: Option<&str>, name: Option<&str>) -> usize {
    let start = out.len();
    for p in header_parts(role, name) {
        out.put(p);
    }
    out.len() - start
}

/// The pieces of `<|role|>` [`<|name:NAME|>`] `\n` (role `user` if absent).
fn header_parts<'s>(role: Option<&'s str>, name: Option<&'s str>) -> [&'s [u8]; 7] {
    let role = role.unwrap_or("user").as_bytes();
    match name {
        Some(n) => [b"<|", role, b"|>", b"<|name:", n.as_bytes(), b"|>", b"\n"],
        None => [b"<|", role, b"|>", b"", b"", b"", b"\n"],
    }
}

/// Calls `f` with the header (built on the stack unless it is long);
/// returns its length.
fn with_header(role: Option<&str>, name: Option<&str>, f: impl FnOnce(&[u8])) -> usize {
    let parts = header_parts(role, name);
    let len = parts.iter().map(|p| p.len()).sum::<usize>();
    let mut stack = [0u8; 64];
    if let Some(buf) = stack.get_mut(..len) {
        let mut i = 0;
        for p in parts {
            if let Some(d) = buf.get_mut(i..i + p.len()) {
                d.copy_from_slice(p);
            }
            i += p.len();
        }
        f(buf);
    } else {
        f(&parts.concat());
    }
    len
}

/// An optional string field (`role`, `name`, a part's `type`): borrowed
/// from the body unless it has escapes.
fn opt_str<'a>(
    cur: &mut Cursor<'a>,
    scratch: &mut Vec<u8>,
) -> Result<Option<Cow<'a, str>>, ParseError> {
    match cur.peek() {
        Some(b'"') => {
            let s = match cur.str_bytes(scratch)? {
                Some(b) => std::str::from_utf8(b).map(Cow::Borrowed),
                None => std::str::from_utf8(scratch).map(|s| Cow::Owned(s.to_owned())),
            };
            s.map(Some)
                .map_err(|_| cur.error("invalid unicode code point"))
        }
        Some(b'n') => cur.null().map(|()| None),
        // Anything else: serde_json's verdict (an error).
        _ => cur.value(),
    }
}

/// Renders the `content` value at the cursor: a string, a list of parts,
/// or null.
fn content<'a, C: Capture>(
    cur: &mut Cursor<'a>,
    out: &mut Out,
    scratch: &mut Vec<u8>,
    cap: &mut C,
) -> Result<(), ParseError> {
    match cur.peek() {
        Some(b'"') => {
            let start = out.len();
            cur.string_into(out)?;
            if C::ON {
                cap.text_field("content", out.written_since(start));
            }
            Ok(())
        }
        Some(b'[') => {
            cur.bump();
            if C::ON {
                cap.parts_start();
            }
            let mut first = true;
            while cur.next_element(&mut first)? {
                out.at(cur.pos());
                part(cur, out, scratch, cap)?;
            }
            if C::ON {
                cap.parts_end();
            }
            Ok(())
        }
        Some(b'n') => {
            cur.null()?;
            if C::ON {
                cap.str_field("content", None);
            }
            Ok(())
        }
        // Anything else: serde_json's verdict (an error).
        _ => match cur.value::<Option<Content<'a>>>()? {
            Some(Content::Text(t)) => {
                cap.lost("content");
                out.put(t.as_bytes());
                Ok(())
            }
            Some(Content::Parts(parts)) => {
                cap.lost("content");
                for raw in parts {
                    raw_part(out, raw, scratch)?;
                }
                Ok(())
            }
            Some(Content::Null) | None => {
                cap.lost("content");
                Ok(())
            }
        },
    }
}

/// Renders a content part given as raw JSON (from a message read by serde).
pub(super) fn raw_part(
    out: &mut Out,
    raw: &RawValue,
    scratch: &mut Vec<u8>,
) -> Result<(), ParseError> {
    let mut cur = Cursor::new(raw.get().as_bytes());
    part(&mut cur, out, scratch, &mut NoCapture)
}

enum PartField {
    Type,
    Text,
    Other,
}

/// Renders the content part at the cursor: a bare string is text; an
/// object is its `text` if its `type` is a text type (or absent), else the
/// placeholder `<|TYPE:HASH|>` (HASH: xxh3-64 of its raw JSON).
fn part<'a, C: Capture>(
    cur: &mut Cursor<'a>,
    out: &mut Out,
    scratch: &mut Vec<u8>,
    cap: &mut C,
) -> Result<(), ParseError> {
    match cur.peek() {
        Some(b'"') => {
            let start = out.len();
            cur.string_into(out)?;
            if C::ON {
                cap.text_part(out.written_since(start));
            }
            return Ok(());
        }
        Some(b'{') => {}
        _ => {
            // `[type, text]`, or not a part at all: serde's verdict.
            let raw: &'a RawValue = cur.value()?;
            if C::ON {
                cap.raw_part(raw.get().as_bytes());
            }
            let p: Part<'_> = serde_json::from_str(raw.get())
                .map_err(|e| ParseError::Json(format!("{e}, in a content part")))?;
            let text_kind = p.text.as_deref().map(|t| (t, p.kind.as_deref()));
            return match text_kind {
                Some((t, kind)) if is_text(kind.unwrap_or("")) => {
                    out.put(t.as_bytes());
                    Ok(())
                }
                _ => {
                    placeholder(out, p.kind.as_deref().unwrap_or(""), raw.get().as_bytes());
                    Ok(())
                }
            };
        }
    }
    let raw_start = cur.pos();
    cur.bump();
    if C::ON {
        cap.part_start();
    }
    let start = out.len();
    let mut kind: Option<Cow<'a, str>> = None;
    let mut has_text = false;
    let (mut seen_type, mut seen_text) = (false, false);
    let mut first = true;
    while let Some(f) = cur.next_key(&mut first, scratch, |k| match k {
        b"type" => PartField::Type,
        b"text" => PartField::Text,
        _ => {
            if C::ON {
                cap.key(k);
            }
            PartField::Other
        }
    })? {
        match f {
            PartField::Type => {
                once(cur, &mut seen_type, "type")?;
                kind = opt_str(cur, scratch)?;
                if C::ON {
                    cap.str_field("type", kind.as_deref());
                }
            }
            PartField::Text => {
                once(cur, &mut seen_text, "text")?;
                match cur.peek() {
                    Some(b'"') => {
                        let text_start = out.len();
                        cur.string_into(out)?;
                        if C::ON {
                            cap.text_field("text", out.written_since(text_start));
                        }
                        has_text = true;
                    }
                    Some(b'n') => {
                        cur.null()?;
                        if C::ON {
                            cap.str_field("text", None);
                        }
                    }
                    _ => {
                        let t = cur.value::<Option<Cow<'_, str>>>()?;
                        if C::ON {
                            cap.str_field("text", t.as_deref());
                        }
                        if let Some(t) = t {
                            out.put(t.as_bytes());
                            has_text = true;
                        }
                    }
                }
            }
            PartField::Other => {
                // serde_json skips without checking UTF-8; the raw part
                // (which the placeholder hashes) must be UTF-8 though.
                let s = cur.pos();
                cur.value::<IgnoredAny>()?;
                if std::str::from_utf8(cur.since(s)).is_err() {
                    return Err(cur.error("invalid unicode code point"));
                }
                if C::ON {
                    cap.raw_field(cur.since(s));
                }
            }
        }
    }
    if C::ON {
        cap.part_end();
    }
    let kind = kind.as_deref().unwrap_or("");
    if !(has_text && is_text(kind)) {
        out.truncate(start);
        placeholder(out, kind, cur.since(raw_start));
    }
    Ok(())
}

fn is_text(kind: &str) -> bool {
    matches!(kind, "text" | "input_text" | "output_text" | "")
}

/// `<|TYPE:HASH|>`, TYPE `part` when empty, HASH the xxh3-64 of `raw` in
/// 16 lower-case hex digits.
fn placeholder(out: &mut Out, kind: &str, raw: &[u8]) {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let kind = if kind.is_empty() { "part" } else { kind };
    let h = xxh3_64(raw);
    let mut hex = [0u8; 16];
    for (i, d) in hex.iter_mut().enumerate() {
        *d = HEX[((h >> (60 - 4 * i)) & 0xf) as usize];
    }
    out.put(b"<|");
    out.put(kind.as_bytes());
    out.put_byte(b':');
    out.put(&hex);
    out.put(b"|>");
}

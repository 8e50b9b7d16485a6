#!/usr/bin/env python3
"""Writes the request-body corpus in this folder (run it from anywhere).

Good bodies are named after the API they target (chat-*, completions-*,
responses-*, embeddings-*, generate-* for vLLM's /inference/v1/generate); bad-* bodies must be refused with a typed error
(or, where README.md says so, parsed); crash-* bodies reproduce core bugs.
The small hand-written bodies are literal below; the large or binary ones
(deep nesting, huge strings, invalid UTF-8) are generated so that they stay
reviewable here.
"""
import json
import os

HERE = os.path.dirname(os.path.abspath(__file__))
SYSTEM = "You are a careful coding assistant. Answer with a short patch and one sentence of why. "


def write(name, data):
    if isinstance(data, (dict, list)):
        data = json.dumps(data, ensure_ascii=False, indent=1).encode()
    elif isinstance(data, str):
        data = data.encode()
    with open(os.path.join(HERE, name), "wb") as f:
        f.write(data)


good = {
    "chat-basic.json": {"model": "qwen3-32b", "messages": [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "Why does my Rust parser panic on an empty slice?"}]},
    "chat-multiturn-stream.json": {"model": "qwen3-32b", "stream": True, "max_completion_tokens": 256,
        "stream_options": {"include_usage": True}, "temperature": 0.2, "messages": [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "Fix the off-by-one in this loop: for i in 0..=v.len() { v[i] }"},
        {"role": "assistant", "content": "Use `0..v.len()`: the inclusive range indexes one past the end."},
        {"role": "user", "content": "And when v is empty?"}]},
    "chat-tools.json": {"model": "qwen3-32b", "tool_choice": "auto", "max_tokens": 512,
        "tools": [{"type": "function", "function": {"name": "get_weather", "description": "Current weather",
                   "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
                  {"type": "function", "function": {"name": "search", "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}}],
        "messages": [
            {"role": "system", "content": "You can call tools."},
            {"role": "user", "content": "Weather in Lyon?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\":\"Lyon\"}"}}]},
            {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "{\"temp_c\": 18, \"sky\": \"clear\"}"},
            {"role": "user", "content": "And tomorrow?"}]},
    "chat-multipart-image.json": {"model": "qwen2-vl", "cache_salt": "tenant-42", "messages": [
        {"role": "system", "content": [{"type": "text", "text": "Describe images precisely."}]},
        {"role": "user", "name": "alice", "content": [
            {"type": "text", "text": "What is in this picture? "},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8BQDwAEhQGAhKmMIQAAAABJRU5ErkJggg==", "detail": "low"}},
            {"type": "input_audio", "input_audio": {"data": "UklGRiQAAABXQVZFZm10IBAAAAABAAEAESsAACJWAAACABAAZGF0YQAAAAA=", "format": "wav"}},
            "and a bare string part"]}]},
    "chat-unicode-escapes.json": "{\"model\":\"m\\u0031\",\"messages\":[{\"role\":\"user\",\"content\":\"caf\\u00e9 \\ud83d\\ude00 \\\"quoted\\\"\\n\\ttab\"}]}",
    "completions-text.json": {"model": "qwen3-32b", "prompt": SYSTEM + "def parse(body):", "max_tokens": 64, "stream": False},
    "completions-batch.json": {"model": "qwen3-32b", "prompt": ["first prompt routes", "second is ignored"], "max_tokens": 8},
    "completions-token-ids.json": {"model": "qwen3-32b", "prompt": list(range(1000, 1300)), "max_tokens": 16},
    "completions-token-id-batch.json": {"model": "qwen3-32b", "prompt": [[1, 2, 3, 4, 5, 6, 7, 8], [9, 10]], "max_tokens": 16},
    "responses-text.json": {"model": "gpt-oss-20b", "instructions": "Be brief.", "input": "Summarise the design in one line.", "max_output_tokens": 100},
    "responses-items.json": {"model": "gpt-oss-20b", "instructions": SYSTEM, "stream": True, "input": [
        {"role": "user", "content": [{"type": "input_text", "text": "Hello"}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "Hi, what do you need?"}]},
        {"role": "user", "content": [{"type": "input_text", "text": "A haiku about caches."},
                                     {"type": "input_image", "image_url": "https://example.invalid/cat.png"}]}]},
    "embeddings-text.json": {"model": "bge-small", "input": "kv cache aware routing", "encoding_format": "float"},
    "embeddings-batch.json": {"model": "bge-small", "input": ["one", "two", "three"]},
    # vLLM's /inference/v1/generate (tokens in, tokens out).
    "generate-token-ids.json": {"model": "qwen3-32b", "token_ids": list(range(2000, 2300)), "stream": True,
        "sampling_params": {"max_tokens": 16, "temperature": 0.0, "n": 1}, "cache_salt": "tenant-7"},
    # Anthropic's Messages API (/v1/messages).
    "messages-basic.json": {"model": "qwen3-32b", "max_tokens": 256, "system": SYSTEM,
        "metadata": {"user_id": "user-1"}, "messages": [
        {"role": "user", "content": "Why does my Rust parser panic on an empty slice?"}]},
    "messages-tools-multiturn.json": {"model": "qwen3-32b", "max_tokens": 512, "stream": True,
        "system": [{"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}}],
        "tools": [{"name": "read_file", "description": "Read a file.",
                   "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}}}],
        "messages": [
        {"role": "user", "content": [{"type": "text", "text": "Fix src/parse.rs."}]},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "Read it first.", "signature": "sig"},
                                          {"type": "text", "text": "Reading it."},
                                          {"type": "tool_use", "id": "toolu_01", "name": "read_file", "input": {"path": "src/parse.rs"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_01",
                                      "content": [{"type": "text", "text": "fn parse(b: &[u8]) { b[0]; }"}]},
                                     {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}},
                                     {"type": "text", "text": "And the screenshot."}]}]},
}

bad = {
    "bad-empty.json": b"",
    "bad-whitespace.json": b" \n\t ",
    "bad-truncated.json": json.dumps(good["chat-tools.json"]).encode()[:200],
    "bad-not-object.json": b'[{"model":"m","messages":[{"role":"user","content":"x"}]}]',
    "bad-missing-model.json": {"messages": [{"role": "user", "content": "hi"}]},
    "bad-empty-model.json": {"model": "", "messages": [{"role": "user", "content": "hi"}]},
    "bad-model-number.json": {"model": 7, "messages": [{"role": "user", "content": "hi"}]},
    "bad-messages-object.json": {"model": "m", "messages": {"role": "user", "content": "hi"}},
    "bad-content-number.json": {"model": "m", "messages": [{"role": "user", "content": 42}]},
    "bad-stream-string.json": {"model": "m", "stream": "yes", "messages": [{"role": "user", "content": "hi"}]},
    "bad-max-tokens-negative.json": {"model": "m", "max_tokens": -5, "prompt": "x", "messages": [{"role": "user", "content": "hi"}]},
    "bad-token-id-negative.json": {"model": "m", "prompt": [1, 2, -3]},
    "bad-token-id-too-big.json": {"model": "m", "prompt": [1, 4294967296]},
    "bad-empty-messages.json": {"model": "m", "messages": []},
    "bad-duplicate-model.json": b'{"model":"a","model":"b","messages":[{"role":"user","content":"x"}]}',
    "bad-trailing-garbage.json": b'{"model":"m","messages":[{"role":"user","content":"x"}]} trailing',
    "bad-invalid-utf8.json": b'{"model":"m","messages":[{"role":"user","content":"caf\xc3\x28 \xff\xfe"}]}',
    "bad-invalid-utf8-ignored-field.json": b'{"model":"m","user":"\xff\xfe","messages":[{"role":"user","content":"x"}]}',
    "bad-lone-surrogate.json": b'{"model":"m","messages":[{"role":"user","content":"\\ud800"}]}',
    "bad-nul-bytes.json": b'{"model":"m\x00","messages":[{"role":"user","content":"\x00"}]}',
    "bad-deep-array-10k.json": b'{"model":"m","messages":[{"role":"user","content":' + b"[" * 10000 + b"]" * 10000 + b"}]}",
    "bad-deep-object-10k.json": b'{"model":"m","messages":[{"role":"user","content":"x","name":' + b'{"a":' * 10000 + b"1" + b"}" * 10000 + b"}]}",
    "bad-deep-ignored-field-10k.json": b'{"model":"m","messages":[{"role":"user","content":"x"}],"extra":' + b"[" * 10000 + b"]" * 10000 + b"}",
    "bad-deep-unclosed-10k.json": b'{"model":"m","x":' + b"[" * 10000,
    "bad-huge-string-1mib.json": b'{"model":"m","messages":[{"role":"user","content":"' + b"a" * (1 << 20) + b'"}]}',
    "bad-huge-escaped-string.json": b'{"model":"m","messages":[{"role":"user","content":"' + b"\\u00e9" * 50000 + b'"}]}',
    "bad-huge-model.json": b'{"model":"' + b"m" * 100000 + b'","prompt":"x"}',
    "bad-many-empty-messages.json": b'{"model":"m","messages":[' + b",".join([b"{}"] * 50000) + b"]}",
    "bad-many-empty-parts.json": b'{"model":"m","messages":[{"role":"user","content":[' + b",".join([b"{}"] * 50000) + b"]}]}",
    "bad-max-tokens-over-u64.json": b'{"model":"m","max_tokens":18446744073709551616,"prompt":"x"}',
    "bad-max-tokens-1e400.json": b'{"model":"m","max_tokens":1e400,"prompt":"x"}',
    "bad-max-tokens-float.json": b'{"model":"m","max_tokens":1.5,"prompt":"x"}',
    "bad-messages-role.json": {"model": "m", "max_tokens": 8, "messages": [{"role": "robot", "content": "x"}]},
    "bad-messages-block-no-type.json": {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": [{"text": "x"}]}]},
    "bad-messages-tool-input-list.json": {"model": "m", "max_tokens": 8, "messages": [
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": [1, 2]}]}]},
    "bad-messages-deep-tool-result-10k.json": b'{"model":"m","max_tokens":8,"messages":[{"role":"user","content":[{"type":"tool_result","content":'
        + b'[{"type":"tool_result","content":' * 2000 + b'"x"' + b"}]" * 2000 + b"}]}]}",
}

for name, data in {**good, **bad}.items():
    write(name, data)

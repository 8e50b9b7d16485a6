//! vLLM's KV cache events, and their wire encoding.
//!
//! On the wire (vLLM's ZMQ publisher) each message has three frames:
//! `[topic, seq, payload]`, where `seq` is an 8-byte big-endian counter that
//! starts at 0 when the publisher starts, and `payload` is msgpack:
//!
//! ```text
//! KVEventBatch = [ts: f64 (unix seconds), events: [event…], data_parallel_rank: int|nil]
//! event (vLLM ≥ 0.11) = map {"type": "BlockStored", "block_hashes": [u64…],
//!     "parent_block_hash": u64|nil, "token_ids": [u32…], "block_size": int,
//!     "lora_id": nil, "medium": "GPU", "lora_name": nil,
//!     "extra_keys": [nil|[key…]…], "group_idx": 0,
//!     "kv_cache_spec_kind": "full_attention"}
//!   | map {"type": "BlockRemoved", "block_hashes": [u64…], "medium": "GPU", "group_idx": 0}
//!   | map {"type": "AllBlocksCleared"}
//! ```
//!
//! The key order above is the order vLLM 0.32 writes (checked against the
//! captures in `testdata/vllm/`). Older vLLM encodes an event as a tagged
//! array (`["BlockStored", hashes, parent, tokens, block_size, lora_id,
//! medium, …]`), and with `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0` a hash is a
//! byte string; the decoder accepts both and keeps a byte hash's low 64 bits
//! (its last 8 bytes, big-endian), which is what vLLM's int form holds.

use rmpv::Value;
use std::fmt;

/// `medium` of blocks in GPU memory.
pub const MEDIUM_GPU: &str = "GPU";

/// One KV cache event.
#[derive(Clone, Debug, PartialEq)]
pub enum KvEvent {
    /// A run of consecutive full blocks became cached.
    BlockStored {
        /// Chained block hashes, in prompt order.
        block_hashes: Vec<u64>,
        /// Hash of the block before the first one here; `None` at block 0.
        parent_block_hash: Option<u64>,
        /// All tokens of the stored blocks (`block_size` per block).
        token_ids: Vec<u32>,
        /// Tokens per block.
        block_size: u32,
        lora_id: Option<i64>,
        medium: Option<String>,
        lora_name: Option<String>,
        /// One entry per block: `None`, or the block's extra hash keys
        /// (LoRA name, multimodal hashes, cache salt), rendered as strings.
        extra_keys: Option<Vec<Option<Vec<String>>>>,
        group_idx: Option<i64>,
        kv_cache_spec_kind: Option<String>,
    },
    /// Blocks were evicted.
    BlockRemoved {
        block_hashes: Vec<u64>,
        medium: Option<String>,
        group_idx: Option<i64>,
    },
    /// The whole prefix cache was dropped.
    AllBlocksCleared,
}

/// The msgpack payload of one message.
#[derive(Clone, Debug, PartialEq)]
pub struct KvEventBatch {
    /// Unix time of the batch, seconds.
    pub ts: f64,
    pub events: Vec<KvEvent>,
    pub data_parallel_rank: Option<i64>,
}

/// Why a payload could not be decoded.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DecodeError(pub String);

impl fmt::Display for DecodeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "KV event payload: {}", self.0)
    }
}

impl std::error::Error for DecodeError {}

fn opt_str(s: &Option<String>) -> Value {
    s.as_deref().map_or(Value::Nil, Value::from)
}

fn opt_int(i: Option<i64>) -> Value {
    i.map_or(Value::Nil, Value::from)
}

fn hashes(h: &[u64]) -> Value {
    Value::Array(h.iter().map(|&x| Value::from(x)).collect())
}

impl KvEvent {
    /// The map form vLLM 0.32 publishes.
    pub fn to_msgpack_value(&self) -> Value {
        let kv = |k: &str, v: Value| (Value::from(k), v);
        match self {
            KvEvent::BlockStored {
                block_hashes,
                parent_block_hash,
                token_ids,
                block_size,
                lora_id,
                medium,
                lora_name,
                extra_keys,
                group_idx,
                kv_cache_spec_kind,
            } => Value::Map(vec![
                kv("type", Value::from("BlockStored")),
                kv("block_hashes", hashes(block_hashes)),
                kv(
                    "parent_block_hash",
                    parent_block_hash.map_or(Value::Nil, Value::from),
                ),
                kv(
                    "token_ids",
                    Value::Array(token_ids.iter().map(|&t| Value::from(t)).collect()),
                ),
                kv("block_size", Value::from(*block_size)),
                kv("lora_id", opt_int(*lora_id)),
                kv("medium", opt_str(medium)),
                kv("lora_name", opt_str(lora_name)),
                kv(
                    "extra_keys",
                    extra_keys.as_ref().map_or(Value::Nil, |per_block| {
                        Value::Array(
                            per_block
                                .iter()
                                .map(|k| {
                                    k.as_ref().map_or(Value::Nil, |keys| {
                                        Value::Array(
                                            keys.iter().map(|s| Value::from(s.as_str())).collect(),
                                        )
                                    })
                                })
                                .collect(),
                        )
                    }),
                ),
                kv("group_idx", opt_int(*group_idx)),
                kv("kv_cache_spec_kind", opt_str(kv_cache_spec_kind)),
            ]),
            KvEvent::BlockRemoved {
                block_hashes,
                medium,
                group_idx,
            } => Value::Map(vec![
                kv("type", Value::from("BlockRemoved")),
                kv("block_hashes", hashes(block_hashes)),
                kv("medium", opt_str(medium)),
                kv("group_idx", opt_int(*group_idx)),
            ]),
            KvEvent::AllBlocksCleared => {
                Value::Map(vec![kv("type", Value::from("AllBlocksCleared"))])
            }
        }
    }

    /// The older tagged-array form: `[tag, field…]` in vLLM's declaration
    /// order, trailing `nil`s left off (msgspec's `omit_defaults`).
    pub fn to_msgpack_array(&self) -> Value {
        let Value::Map(entries) = self.to_msgpack_value() else {
            return Value::Nil; // to_msgpack_value always builds a map
        };
        let mut items: Vec<Value> = entries.into_iter().map(|(_, v)| v).collect();
        while items.len() > 1 && items.last().is_some_and(Value::is_nil) {
            items.pop();
        }
        Value::Array(items)
    }

    /// Decodes one event in map form or in the older tagged-array form.
    pub fn from_msgpack_value(v: &Value) -> Result<KvEvent, DecodeError> {
        match v {
            Value::Map(entries) => {
                let fields: Vec<(&str, &Value)> = entries
                    .iter()
                    .filter_map(|(k, v)| k.as_str().map(|k| (k, v)))
                    .collect();
                let tag = field(&fields, "type")
                    .as_str()
                    .ok_or_else(|| DecodeError("event map has no string \"type\"".into()))?;
                build_event(tag, &fields)
            }
            Value::Array(items) => {
                let tag = items
                    .first()
                    .and_then(Value::as_str)
                    .ok_or_else(|| DecodeError("tagged event array has no tag".into()))?;
                // Positional fields after the tag, in vLLM's declaration order.
                let names: &[&str] = match tag {
                    "BlockStored" => &[
                        "block_hashes",
                        "parent_block_hash",
                        "token_ids",
                        "block_size",
                        "lora_id",
                        "medium",
                        "lora_name",
                        "extra_keys",
                        "group_idx",
                        "kv_cache_spec_kind",
                    ],
                    "BlockRemoved" => &["block_hashes", "medium", "group_idx"],
                    _ => &[],
                };
                let fields: Vec<(&str, &Value)> =
                    names.iter().copied().zip(items.iter().skip(1)).collect();
                build_event(tag, &fields)
            }
            other => Err(DecodeError(format!(
                "event is neither a map nor an array: {other}"
            ))),
        }
    }
}

/// A block hash as an int, or as bytes (low 64 bits = last 8 bytes, big-endian).
fn decode_hash(v: &Value) -> Result<u64, DecodeError> {
    if let Some(n) = v.as_u64() {
        return Ok(n);
    }
    if let Some(n) = v.as_i64() {
        return Ok(n as u64);
    }
    if let Some(b) = v.as_slice() {
        let mut last = [0u8; 8];
        let take = b.len().min(8);
        last[8 - take..].copy_from_slice(&b[b.len() - take..]);
        return Ok(u64::from_be_bytes(last));
    }
    Err(DecodeError(format!(
        "block hash is not an int or bytes: {v}"
    )))
}

fn decode_hashes(v: &Value) -> Result<Vec<u64>, DecodeError> {
    v.as_array()
        .ok_or_else(|| DecodeError(format!("block_hashes is not an array: {v}")))?
        .iter()
        .map(decode_hash)
        .collect()
}

fn decode_opt_str(v: &Value) -> Option<String> {
    v.as_str().map(str::to_owned)
}

fn render_key(v: &Value) -> String {
    match v {
        Value::String(s) => s.as_str().unwrap_or_default().to_owned(),
        other => other.to_string(),
    }
}

static NIL: Value = Value::Nil;

/// The value of a named field, `nil` when absent.
fn field<'a>(fields: &[(&str, &'a Value)], name: &str) -> &'a Value {
    fields
        .iter()
        .find(|(k, _)| *k == name)
        .map_or(&NIL, |(_, v)| *v)
}

fn build_event(tag: &str, fields: &[(&str, &Value)]) -> Result<KvEvent, DecodeError> {
    let get = |name: &str| field(fields, name);
    match tag {
        "BlockStored" => {
            let parent = get("parent_block_hash");
            Ok(KvEvent::BlockStored {
                block_hashes: decode_hashes(get("block_hashes"))?,
                parent_block_hash: if parent.is_nil() {
                    None
                } else {
                    Some(decode_hash(parent)?)
                },
                token_ids: get("token_ids")
                    .as_array()
                    .ok_or_else(|| DecodeError("BlockStored.token_ids is not an array".into()))?
                    .iter()
                    .map(|t| {
                        t.as_u64()
                            .and_then(|t| u32::try_from(t).ok())
                            .ok_or_else(|| DecodeError(format!("token id {t} is not a u32")))
                    })
                    .collect::<Result<_, _>>()?,
                block_size: get("block_size")
                    .as_u64()
                    .and_then(|b| u32::try_from(b).ok())
                    .ok_or_else(|| DecodeError("BlockStored.block_size is not an int".into()))?,
                lora_id: get("lora_id").as_i64(),
                medium: decode_opt_str(get("medium")),
                lora_name: decode_opt_str(get("lora_name")),
                extra_keys: get("extra_keys").as_array().map(|per_block| {
                    per_block
                        .iter()
                        .map(|k| {
                            k.as_array()
                                .map(|keys| keys.iter().map(render_key).collect())
                        })
                        .collect()
                }),
                group_idx: get("group_idx").as_i64(),
                kv_cache_spec_kind: decode_opt_str(get("kv_cache_spec_kind")),
            })
        }
        "BlockRemoved" => Ok(KvEvent::BlockRemoved {
            block_hashes: decode_hashes(get("block_hashes"))?,
            medium: decode_opt_str(get("medium")),
            group_idx: get("group_idx").as_i64(),
        }),
        "AllBlocksCleared" => Ok(KvEvent::AllBlocksCleared),
        other => Err(DecodeError(format!("unknown event type {other:?}"))),
    }
}

/// How events are written inside a batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EventForm {
    /// Maps with a `"type"` key (vLLM ≥ 0.11; what 0.32 publishes).
    Map,
    /// Tagged arrays (older vLLM).
    Array,
}

impl KvEventBatch {
    /// The msgpack payload: `[ts, [events…], data_parallel_rank]`, events as
    /// maps (vLLM 0.32's form).
    pub fn encode(&self) -> Vec<u8> {
        self.encode_as(EventForm::Map)
    }

    /// The msgpack payload with events in the given form.
    pub fn encode_as(&self, form: EventForm) -> Vec<u8> {
        let event = match form {
            EventForm::Map => KvEvent::to_msgpack_value,
            EventForm::Array => KvEvent::to_msgpack_array,
        };
        let v = Value::Array(vec![
            Value::F64(self.ts),
            Value::Array(self.events.iter().map(event).collect()),
            opt_int(self.data_parallel_rank),
        ]);
        let mut out = Vec::new();
        // Writing to a Vec cannot fail.
        let _ = rmpv::encode::write_value(&mut out, &v);
        out
    }

    /// Decodes a payload; accepts map-form and array-form events. Any event
    /// that does not decode fails the whole batch.
    pub fn decode(payload: &[u8]) -> Result<KvEventBatch, DecodeError> {
        let (batch, skipped) = Self::decode_lenient(payload)?;
        match skipped.into_iter().next() {
            Some(e) => Err(e),
            None => Ok(batch),
        }
    }

    /// Decodes a payload, skipping events that do not decode (an unknown
    /// `type`, a malformed field) and returning why each was skipped. The
    /// batch itself (msgpack, `[ts, events, …]` shape) must be well formed.
    pub fn decode_lenient(payload: &[u8]) -> Result<(KvEventBatch, Vec<DecodeError>), DecodeError> {
        let mut rd = payload;
        let v = rmpv::decode::read_value(&mut rd)
            .map_err(|e| DecodeError(format!("not msgpack: {e}")))?;
        if !rd.is_empty() {
            return Err(DecodeError(format!("{} trailing bytes", rd.len())));
        }
        let items = v
            .as_array()
            .ok_or_else(|| DecodeError("batch is not an array".into()))?;
        let ts = match items.first() {
            Some(Value::F64(t)) => *t,
            Some(Value::F32(t)) => f64::from(*t),
            Some(other) => other
                .as_f64()
                .or_else(|| other.as_i64().map(|i| i as f64))
                .ok_or_else(|| DecodeError(format!("batch ts is not a number: {other}")))?,
            None => return Err(DecodeError("batch is empty".into())),
        };
        let mut events = Vec::new();
        let mut skipped = Vec::new();
        for e in items
            .get(1)
            .and_then(Value::as_array)
            .ok_or_else(|| DecodeError("batch events is not an array".into()))?
        {
            match KvEvent::from_msgpack_value(e) {
                Ok(e) => events.push(e),
                Err(why) => skipped.push(why),
            }
        }
        let batch = KvEventBatch {
            ts,
            events,
            data_parallel_rank: items.get(2).and_then(Value::as_i64),
        };
        Ok((batch, skipped))
    }
}

/// The three ZMQ frames of one published message.
pub fn frames(topic: &str, seq: u64, batch: &KvEventBatch) -> [Vec<u8>; 3] {
    [
        topic.as_bytes().to_vec(),
        seq.to_be_bytes().to_vec(),
        batch.encode(),
    ]
}

/// Reads the sequence number frame (8 bytes, big-endian).
pub fn decode_seq(frame: &[u8]) -> Result<u64, DecodeError> {
    let b: [u8; 8] = frame
        .try_into()
        .map_err(|_| DecodeError(format!("seq frame is {} bytes, not 8", frame.len())))?;
    Ok(u64::from_be_bytes(b))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> KvEventBatch {
        KvEventBatch {
            ts: 1.7e9,
            events: vec![
                KvEvent::BlockStored {
                    block_hashes: vec![1, u64::MAX],
                    parent_block_hash: Some(9),
                    token_ids: vec![5; 4],
                    block_size: 2,
                    lora_id: None,
                    medium: Some(MEDIUM_GPU.into()),
                    lora_name: None,
                    extra_keys: Some(vec![None, None]),
                    group_idx: Some(0),
                    kv_cache_spec_kind: Some("full_attention".into()),
                },
                KvEvent::BlockRemoved {
                    block_hashes: vec![1],
                    medium: Some(MEDIUM_GPU.into()),
                    group_idx: None,
                },
                KvEvent::AllBlocksCleared,
            ],
            data_parallel_rank: Some(0),
        }
    }

    #[test]
    fn both_forms_round_trip() {
        let b = sample();
        for form in [EventForm::Map, EventForm::Array] {
            assert_eq!(
                KvEventBatch::decode(&b.encode_as(form)).unwrap(),
                b,
                "{form:?}"
            );
        }
        assert_ne!(b.encode_as(EventForm::Map), b.encode_as(EventForm::Array));
    }

    #[test]
    fn lenient_decode_skips_unknown_events_and_keeps_the_rest() {
        let v = Value::Array(vec![
            Value::F64(1.0),
            Value::Array(vec![
                Value::Map(vec![(Value::from("type"), Value::from("BlockMoved"))]),
                Value::Array(vec![
                    Value::from("BlockRemoved"),
                    Value::Array(vec![Value::from(7u64)]),
                ]),
            ]),
            Value::from(0),
        ]);
        let mut buf = Vec::new();
        rmpv::encode::write_value(&mut buf, &v).unwrap();
        let (batch, skipped) = KvEventBatch::decode_lenient(&buf).unwrap();
        assert_eq!(batch.events.len(), 1);
        assert_eq!(skipped.len(), 1);
        assert!(skipped[0].0.contains("BlockMoved"), "{:?}", skipped[0]);
        assert!(KvEventBatch::decode(&buf).is_err());
    }
}

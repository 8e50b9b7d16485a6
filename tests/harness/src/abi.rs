//! The numbers and byte layouts of proxy-wasm ABI 0.2.1, host side.
//!
//! Header maps cross the boundary in the ABI's pair encoding (all integers
//! u32 little-endian):
//!
//! ```text
//! count | (key_len, value_len) × count | (key bytes, 0, value bytes, 0) × count
//! ```

/// `WasmResult` codes the host returns (proxy-wasm spec, 0.2.1).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(i32)]
pub enum Status {
    Ok = 0,
    NotFound = 1,
    BadArgument = 2,
    SerializationFailure = 3,
    ParseFailure = 4,
    InvalidMemoryAccess = 6,
    Empty = 7,
    CasMismatch = 8,
    InternalFailure = 10,
    Unimplemented = 12,
}

/// `proxy_on_*` filter results: 0 Continue, 1 Pause (StopIteration).
pub const ACTION_CONTINUE: i32 = 0;
pub const ACTION_PAUSE: i32 = 1;

/// Header map types of `proxy_*_header_map_*`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MapType {
    RequestHeaders,
    RequestTrailers,
    ResponseHeaders,
    ResponseTrailers,
    GrpcInitialMetadata,
    GrpcTrailingMetadata,
    HttpCallResponseHeaders,
    HttpCallResponseTrailers,
}

impl MapType {
    pub fn from_abi(n: i32) -> Option<MapType> {
        Some(match n {
            0 => MapType::RequestHeaders,
            1 => MapType::RequestTrailers,
            2 => MapType::ResponseHeaders,
            3 => MapType::ResponseTrailers,
            4 => MapType::GrpcInitialMetadata,
            5 => MapType::GrpcTrailingMetadata,
            6 => MapType::HttpCallResponseHeaders,
            7 => MapType::HttpCallResponseTrailers,
            _ => return None,
        })
    }
}

/// Buffer types of `proxy_get_buffer_bytes` / `proxy_set_buffer_bytes`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BufferType {
    RequestBody,
    ResponseBody,
    DownstreamData,
    UpstreamData,
    HttpCallResponseBody,
    GrpcReceiveBuffer,
    VmConfiguration,
    PluginConfiguration,
    CallData,
}

impl BufferType {
    pub fn from_abi(n: i32) -> Option<BufferType> {
        Some(match n {
            0 => BufferType::RequestBody,
            1 => BufferType::ResponseBody,
            2 => BufferType::DownstreamData,
            3 => BufferType::UpstreamData,
            4 => BufferType::HttpCallResponseBody,
            5 => BufferType::GrpcReceiveBuffer,
            6 => BufferType::VmConfiguration,
            7 => BufferType::PluginConfiguration,
            8 => BufferType::CallData,
            _ => return None,
        })
    }
}

/// Header list as Envoy holds it: lower-case keys, order kept, repeats allowed.
pub type Headers = Vec<(String, String)>;

/// Encodes pairs in the ABI's pair encoding.
pub fn encode_pairs(pairs: &[(String, String)]) -> Vec<u8> {
    let size = 4 + pairs
        .iter()
        .map(|(k, v)| 8 + k.len() + v.len() + 2)
        .sum::<usize>();
    let mut out = Vec::with_capacity(size);
    out.extend_from_slice(&(pairs.len() as u32).to_le_bytes());
    for (k, v) in pairs {
        out.extend_from_slice(&(k.len() as u32).to_le_bytes());
        out.extend_from_slice(&(v.len() as u32).to_le_bytes());
    }
    for (k, v) in pairs {
        out.extend_from_slice(k.as_bytes());
        out.push(0);
        out.extend_from_slice(v.as_bytes());
        out.push(0);
    }
    out
}

/// Decodes the ABI's pair encoding; `None` if the bytes are not well formed
/// (Envoy answers such a call with `BadArgument`).
pub fn decode_pairs(bytes: &[u8]) -> Option<Headers> {
    if bytes.is_empty() {
        return Some(Vec::new());
    }
    let word = |at: usize| -> Option<usize> {
        let b = bytes.get(at..at + 4)?;
        Some(u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as usize)
    };
    let count = word(0)?;
    let mut sizes = Vec::with_capacity(count.min(1024));
    let mut at = 4;
    for _ in 0..count {
        sizes.push((word(at)?, word(at + 4)?));
        at += 8;
    }
    let mut pairs = Vec::with_capacity(sizes.len());
    for (k, v) in sizes {
        let key = bytes.get(at..at + k)?;
        at += k + 1;
        let value = bytes.get(at..at + v)?;
        at += v + 1;
        pairs.push((
            String::from_utf8_lossy(key).into_owned(),
            String::from_utf8_lossy(value).into_owned(),
        ));
    }
    Some(pairs)
}

/// A property path as the SDK sends it: segments joined by NUL.
pub fn property_path(bytes: &[u8]) -> String {
    bytes
        .split(|b| *b == 0)
        .map(|s| String::from_utf8_lossy(s).into_owned())
        .collect::<Vec<_>>()
        .join(".")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pairs_round_trip() {
        let pairs = vec![
            (":path".to_string(), "/v1/completions".to_string()),
            ("x-empty".to_string(), String::new()),
        ];
        let bytes = encode_pairs(&pairs);
        assert_eq!(&bytes[0..4], &2u32.to_le_bytes());
        assert_eq!(decode_pairs(&bytes), Some(pairs));
    }

    #[test]
    fn truncated_pairs_are_rejected() {
        let bytes = encode_pairs(&[("k".into(), "v".into())]);
        assert_eq!(decode_pairs(&bytes[..bytes.len() - 3]), None);
    }
}

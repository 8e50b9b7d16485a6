//! A small JSON reader for the hot path of request parsing.
//!
//! [`Cursor`] walks the structure of a body (objects, arrays, keys) and
//! decodes the strings whose text goes into the prompt straight into the
//! output, reading them exactly as `serde_json` does: the same whitespace,
//! the same escapes, surrogate pairs required, control characters and
//! invalid UTF-8 refused. Every other value is handed to `serde_json`
//! ([`Cursor::value`]), which parses it in place and reports where it ended,
//! so numbers, literals, raw JSON and skipped values keep serde_json's
//! semantics to the byte.
//!
//! Nothing here recurses: the structure read by hand is at most
//! object → array → object → array → object deep, and values nested deeper
//! are serde_json's (which limits its own recursion).

use super::ParseError;
use serde::Deserialize;

/// Where decoded text is written: a plain `Vec`, or [`Out`].
pub(super) trait Sink {
    fn vec(&mut self) -> &mut Vec<u8>;
    fn vec_ref(&self) -> &Vec<u8>;
    /// Makes room for `extra` more bytes (the sink's growth policy).
    fn room(&mut self, extra: usize);
    /// Tells the sink how far into the body the reader is (see [`Out`]).
    fn at(&mut self, _pos: usize) {}

    #[inline]
    fn put(&mut self, bytes: &[u8]) {
        self.room(bytes.len());
        self.vec().extend_from_slice(bytes);
    }
    #[inline]
    fn put_byte(&mut self, b: u8) {
        self.room(1);
        self.vec().push(b);
    }
    fn len(&self) -> usize {
        self.vec_ref().len()
    }
    /// The bytes written from `start` on.
    fn written_since(&self, start: usize) -> &[u8] {
        self.vec_ref().get(start..).unwrap_or_default()
    }
}

impl Sink for Vec<u8> {
    fn vec(&mut self) -> &mut Vec<u8> {
        self
    }
    fn vec_ref(&self) -> &Vec<u8> {
        self
    }
    fn room(&mut self, extra: usize) {
        self.reserve(extra);
    }
}

/// The rendered prompt being built.
///
/// It starts small (4 KiB) and, when that is full, grows by extrapolation:
/// the bytes rendered per body byte read since rendering began (the first
/// [`Sink::at`]), applied to the rest of the body, plus 1/16. An ordinary
/// request is thus reallocated once, to about its final size (a little
/// over, or under its body's size), and so is a body that renders to
/// several times its size (thousands of empty messages, `{}` parts),
/// without a body-sized first guess held beside it during the copy. Where
/// the estimate falls short, growth is at least geometric (×1.25).
pub(super) struct Out {
    buf: Vec<u8>,
    body_len: usize,
    /// Where in the body rendering began (the first [`Sink::at`]).
    start: Option<usize>,
    /// How far into the body the reader was at the last [`Sink::at`].
    pos: usize,
}

impl Out {
    /// The first capacity: small enough to be thrown away, large enough to
    /// extrapolate from.
    const FIRST: usize = 4096;
    /// Most bytes a body byte renders to (a `{}` content part, 3 bytes
    /// with its comma, renders to 25), for a cap on the estimate.
    const MAX_EXPANSION: usize = 9;

    pub fn for_body(body_len: usize) -> Out {
        Out {
            buf: Vec::with_capacity(body_len.min(Out::FIRST)),
            body_len,
            start: None,
            pos: 0,
        }
    }

    pub fn into_vec(self) -> Vec<u8> {
        self.buf
    }

    pub fn truncate(&mut self, len: usize) {
        self.buf.truncate(len);
    }

    /// Replaces `buf[start..end]` with `bytes`, moving what follows: only
    /// for bodies whose fields come in an unusual order.
    pub fn replace(&mut self, start: usize, end: usize, bytes: &[u8]) {
        let len = self.buf.len();
        let end = end.min(len);
        let start = start.min(end);
        let new_end = start + bytes.len();
        if new_end > end {
            self.reserve(new_end - end);
            self.buf.resize(len + (new_end - end), 0);
        }
        self.buf.copy_within(end..len, new_end);
        if new_end < end {
            self.buf.truncate(len - (end - new_end));
        }
        if let Some(dst) = self.buf.get_mut(start..new_end) {
            dst.copy_from_slice(bytes);
        }
    }

    #[inline]
    fn reserve(&mut self, extra: usize) {
        if self.buf.capacity() - self.buf.len() < extra {
            self.grow(extra);
        }
    }

    #[cold]
    #[inline(never)]
    fn grow(&mut self, extra: usize) {
        let len = self.buf.len();
        let cap = self.buf.capacity();
        let need = len.saturating_add(extra);
        let target = match self.start {
            Some(start) if start < self.pos && self.pos < self.body_len => {
                // Rendered so far, plus the rest of the body at the rate so
                // far, plus 1/16.
                let (read, left) = (self.pos - start, self.body_len - self.pos);
                let rest = (len as u128 * left as u128 / read as u128).min(usize::MAX as u128);
                let est = len.saturating_add(rest as usize);
                est.saturating_add(est / 16)
                    .min(self.body_len.saturating_mul(Out::MAX_EXPANSION) + Out::FIRST)
                    .max(cap.saturating_add(cap / 4))
            }
            _ => cap.saturating_mul(2),
        };
        let target = target.max(need).max(64);
        self.buf.reserve_exact(target - len);
    }
}

impl Sink for Out {
    #[inline]
    fn vec(&mut self) -> &mut Vec<u8> {
        &mut self.buf
    }
    fn vec_ref(&self) -> &Vec<u8> {
        &self.buf
    }
    #[inline]
    fn room(&mut self, extra: usize) {
        self.reserve(extra);
    }
    #[inline]
    fn at(&mut self, pos: usize) {
        self.start.get_or_insert(pos);
        self.pos = pos;
    }
}

/// A position in a JSON text.
pub(super) struct Cursor<'a> {
    src: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    pub fn new(src: &'a [u8]) -> Cursor<'a> {
        Cursor { src, pos: 0 }
    }

    pub fn pos(&self) -> usize {
        self.pos
    }

    /// The text from `start` to the cursor.
    pub fn since(&self, start: usize) -> &'a [u8] {
        self.src.get(start..self.pos).unwrap_or_default()
    }

    pub fn error(&self, what: &str) -> ParseError {
        ParseError::Json(format!("{what} at byte {}", self.pos))
    }

    /// Skips whitespace (JSON's four characters, as serde_json) and returns
    /// the next byte without consuming it.
    #[inline]
    pub fn peek(&mut self) -> Option<u8> {
        while let Some(&b) = self.src.get(self.pos) {
            match b {
                b' ' | b'\n' | b'\t' | b'\r' => self.pos += 1,
                _ => return Some(b),
            }
        }
        None
    }

    /// Consumes one byte (the one [`Cursor::peek`] returned).
    #[inline]
    pub fn bump(&mut self) {
        self.pos += 1;
    }

    /// Consumes `null` (the cursor is on its `n`).
    pub fn null(&mut self) -> Result<(), ParseError> {
        if self.src.get(self.pos..self.pos + 4) == Some(b"null") {
            self.pos += 4;
            Ok(())
        } else {
            Err(self.error("expected null"))
        }
    }

    /// Parses the value at the cursor with serde_json and moves past it.
    pub fn value<T: Deserialize<'a>>(&mut self) -> Result<T, ParseError> {
        let start = self.pos;
        let rest = self.src.get(start..).unwrap_or_default();
        let mut stream = serde_json::Deserializer::from_slice(rest).into_iter::<T>();
        match stream.next() {
            Some(Ok(v)) => {
                self.pos = start + stream.byte_offset();
                Ok(v)
            }
            Some(Err(e)) => Err(ParseError::Json(format!(
                "{e}, in the value at byte {start}"
            ))),
            None => Err(self.error("EOF while parsing a value")),
        }
    }

    /// Moves to the next key of an object whose `{` has been consumed, as
    /// serde_json's `MapAccess` does: `None` (with the `}` consumed) at the
    /// end, else the key's text mapped by `field` (from the body, or from
    /// `scratch` if the key has escapes), with the cursor on its value.
    pub fn next_key<F>(
        &mut self,
        first: &mut bool,
        scratch: &mut Vec<u8>,
        field: impl FnOnce(&[u8]) -> F,
    ) -> Result<Option<F>, ParseError> {
        match self.peek() {
            Some(b'}') => {
                self.pos += 1;
                return Ok(None);
            }
            Some(b',') if !*first => {
                self.pos += 1;
                match self.peek() {
                    Some(b'"') => {}
                    Some(b'}') => return Err(self.error("trailing comma")),
                    Some(_) => return Err(self.error("key must be a string")),
                    None => return Err(self.error("EOF while parsing a value")),
                }
            }
            Some(b'"') if *first => *first = false,
            Some(_) if *first => return Err(self.error("key must be a string")),
            Some(_) => return Err(self.error("expected `,` or `}`")),
            None => return Err(self.error("EOF while parsing an object")),
        }
        let key = match self.str_bytes(scratch)? {
            Some(borrowed) => field(borrowed),
            None => field(scratch),
        };
        match self.peek() {
            Some(b':') => self.pos += 1,
            Some(_) => return Err(self.error("expected `:`")),
            None => return Err(self.error("EOF while parsing an object")),
        }
        self.peek();
        Ok(Some(key))
    }

    /// Moves to the next element of an array whose `[` has been consumed,
    /// as serde_json's `SeqAccess` does: `false` (with the `]` consumed) at
    /// the end, else `true` with the cursor on the element.
    pub fn next_element(&mut self, first: &mut bool) -> Result<bool, ParseError> {
        match self.peek() {
            Some(b']') => {
                self.pos += 1;
                Ok(false)
            }
            Some(_) if *first => {
                *first = false;
                Ok(true)
            }
            Some(b',') => {
                self.pos += 1;
                match self.peek() {
                    Some(b']') => Err(self.error("trailing comma")),
                    Some(_) => Ok(true),
                    None => Err(self.error("EOF while parsing a value")),
                }
            }
            Some(_) => Err(self.error("expected `,` or `]`")),
            None => Err(self.error("EOF while parsing a list")),
        }
    }

    /// Reads the string at the cursor (on its opening quote). Without
    /// escapes its text is returned as a slice of the body; with escapes it
    /// is decoded into `scratch` (cleared first) and `None` is returned.
    pub fn str_bytes(&mut self, scratch: &mut Vec<u8>) -> Result<Option<&'a [u8]>, ParseError> {
        self.pos += 1;
        let start = self.pos;
        let rest = self.src.get(start..).unwrap_or_default();
        let mut non_ascii = false;
        let n = scan(rest, &mut non_ascii);
        self.pos += n;
        if self.src.get(self.pos) == Some(&b'"') {
            let text = rest.get(..n).unwrap_or_default();
            if non_ascii && std::str::from_utf8(text).is_err() {
                return Err(self.error("invalid unicode code point"));
            }
            self.pos += 1;
            return Ok(Some(text));
        }
        scratch.clear();
        scratch.put(rest.get(..n).unwrap_or_default());
        self.string_rest(scratch, 0, non_ascii)?;
        Ok(None)
    }

    /// Reads the string at the cursor (on its opening quote) and appends
    /// its text to `out`.
    #[inline]
    pub fn string_into<S: Sink>(&mut self, out: &mut S) -> Result<(), ParseError> {
        self.pos += 1;
        let start = out.len();
        self.string_rest(out, start, false)
    }

    /// The rest of a string: copies plain bytes, decodes escapes, stops
    /// after the closing quote, then checks that what was written from
    /// `start` on is UTF-8 (escapes always decode to whole characters, so
    /// that is the same as checking the raw text, as serde_json does).
    fn string_rest<S: Sink>(
        &mut self,
        out: &mut S,
        start: usize,
        mut non_ascii: bool,
    ) -> Result<(), ParseError> {
        let src = self.src;
        let mut pos = self.pos;
        loop {
            out.at(pos);
            pos = if non_ascii {
                copy_plain::<Specials>(out.vec(), src, pos)
            } else {
                copy_plain::<SpecialsOrNonAscii>(out.vec(), src, pos)
            };
            let rest = src.get(pos..).unwrap_or_default();
            match rest {
                [b'"', ..] => {
                    self.pos = pos + 1;
                    break;
                }
                [b'\\', ..] => {
                    self.pos = pos + 1;
                    self.escape(out)?;
                    pos = self.pos;
                    continue;
                }
                [b, ..] if *b < 0x20 => {
                    self.pos = pos;
                    return Err(
                        self.error("control character (\\u0000-\\u001F) while parsing a string")
                    );
                }
                [b, ..] if *b >= 0x80 && !non_ascii => {
                    // The first non-ASCII byte: the text is checked at the
                    // end, and such bytes no longer stop the copy.
                    non_ascii = true;
                    continue;
                }
                [_, ..] if rest.len() >= BLOCK => {
                    // No room for a block.
                    out.at(pos);
                    out.room(BLOCK);
                    continue;
                }
                [_, ..] => {
                    // Fewer than BLOCK bytes left: run by run.
                    let n = scan(rest, &mut non_ascii);
                    out.put(rest.get(..n).unwrap_or_default());
                    pos += n;
                    continue;
                }
                [] => {
                    self.pos = pos;
                    return Err(self.error("EOF while parsing a string"));
                }
            }
        }
        if non_ascii && std::str::from_utf8(out.written_since(start)).is_err() {
            return Err(self.error("invalid unicode code point"));
        }
        Ok(())
    }

    /// Decodes the escape after a backslash.
    fn escape<S: Sink>(&mut self, out: &mut S) -> Result<(), ParseError> {
        let Some(&c) = self.src.get(self.pos) else {
            return Err(self.error("EOF while parsing a string"));
        };
        self.pos += 1;
        match (c, simple_escape(c)) {
            (_, Some(b)) => {
                out.put_byte(b);
                Ok(())
            }
            (b'u', None) => self.unicode_escape(out),
            _ => Err(self.error("invalid escape")),
        }
    }

    /// `\uXXXX`, or a surrogate pair `\uD8XX\uDCXX`; a lone surrogate is an
    /// error, as in serde_json when it parses into a string.
    fn unicode_escape<S: Sink>(&mut self, out: &mut S) -> Result<(), ParseError> {
        let n = self.hex4()?;
        let c = match n {
            0xDC00..=0xDFFF => return Err(self.error("lone leading surrogate in hex escape")),
            0xD800..=0xDBFF => {
                for expected in [b'\\', b'u'] {
                    match self.src.get(self.pos) {
                        Some(&b) if b == expected => self.pos += 1,
                        Some(_) => {
                            self.pos += 1;
                            return Err(self.error("unexpected end of hex escape"));
                        }
                        None => return Err(self.error("EOF while parsing a string")),
                    }
                }
                let n2 = self.hex4()?;
                if !(0xDC00..=0xDFFF).contains(&n2) {
                    return Err(self.error("lone leading surrogate in hex escape"));
                }
                (((u32::from(n) - 0xD800) << 10) | (u32::from(n2) - 0xDC00)) + 0x1_0000
            }
            _ => u32::from(n),
        };
        let Some(c) = char::from_u32(c) else {
            return Err(self.error("invalid unicode code point"));
        };
        out.put(c.encode_utf8(&mut [0; 4]).as_bytes());
        Ok(())
    }

    fn hex4(&mut self) -> Result<u16, ParseError> {
        let Some(digits) = self.src.get(self.pos..self.pos + 4) else {
            self.pos = self.src.len();
            return Err(self.error("EOF while parsing a string"));
        };
        self.pos += 4;
        let mut n = 0u16;
        for &d in digits {
            let v = match d {
                b'0'..=b'9' => d - b'0',
                b'a'..=b'f' => d - b'a' + 10,
                b'A'..=b'F' => d - b'A' + 10,
                _ => return Err(self.error("invalid escape")),
            };
            n = (n << 4) | u16::from(v);
        }
        Ok(n)
    }
}

/// Bytes read (and copied) at a time by [`copy_plain`].
const BLOCK: usize = 32;

/// Copies the text of a string from `src[pos..]` to `buf`, decoding the
/// one-character escapes (`\n`, `\"`, …), up to the first stop (`S`) that
/// is not such an escape: the closing quote, a `\u` escape, an invalid
/// byte, or (with [`SpecialsOrNonAscii`]) a non-ASCII byte. Returns its
/// position; or that of the first block it could not take, when fewer than
/// BLOCK bytes are left in `src` or in `buf`'s capacity (the caller
/// handles those).
///
/// BLOCK bytes at a time: each block is appended as read (a fixed-size
/// copy, no call), and what follows the first stop is cut off
/// again.
#[inline(never)]
fn copy_plain<S: Stops>(buf: &mut Vec<u8>, src: &[u8], mut pos: usize) -> usize {
    // A local `Vec`, so that its length stays in a register.
    let mut out = std::mem::take(buf);
    loop {
        let rest = src.get(pos..).unwrap_or_default();
        let mut stop = None;
        for block in rest.chunks_exact(BLOCK) {
            if out.capacity() - out.len() < BLOCK {
                break;
            }
            let flagged = first_flagged::<S>(block);
            out.extend_from_slice(block);
            if flagged.is_some() {
                stop = flagged;
                break;
            }
            pos += BLOCK;
        }
        let Some(k) = stop else {
            break;
        };
        pos += k;
        let decoded = match src.get(pos..pos + 2) {
            Some([b'\\', e]) => simple_escape(*e),
            _ => None,
        };
        let Some(d) = decoded else {
            out.truncate(out.len() - (BLOCK - k));
            break;
        };
        // Keep the backslash's slot, for what it stands for.
        out.truncate(out.len() - (BLOCK - k - 1));
        if let Some(slot) = out.last_mut() {
            *slot = d;
        }
        pos += 2;
    }
    *buf = out;
    pos
}

/// What a one-character escape (`\` + `e`) stands for.
#[inline(always)]
fn simple_escape(e: u8) -> Option<u8> {
    match e {
        b'n' => Some(b'\n'),
        b'"' => Some(b'"'),
        b'\\' => Some(b'\\'),
        b't' => Some(b'\t'),
        b'r' => Some(b'\r'),
        b'/' => Some(b'/'),
        b'b' => Some(0x08),
        b'f' => Some(0x0c),
        _ => None,
    }
}

/// Finds the first `"`, `\` or control character (< 0x20) in `s`, or
/// `s.len()` if there is none; sets `non_ascii` if a byte ≥ 0x80 comes
/// before it.
#[inline(always)]
fn scan(s: &[u8], non_ascii: &mut bool) -> usize {
    if *non_ascii {
        return find::<Specials>(s);
    }
    // Until the first non-ASCII byte, stop at those too: the loop then
    // needs no accumulator, and what follows is known to need checking.
    let i = find::<SpecialsOrNonAscii>(s);
    match s.get(i) {
        Some(&b) if b >= 0x80 => {
            *non_ascii = true;
            i + find::<Specials>(s.get(i..).unwrap_or_default())
        }
        _ => i,
    }
}

/// The bytes a scan stops at: [`Specials`], or [`SpecialsOrNonAscii`].
trait Stops {
    /// The top bit of every byte lane of `x` that is a stop, exact for the
    /// lowest such lane (SWAR, eight bytes at a time).
    fn word(x: u64) -> u64;

    /// Bit i set if byte i of `v` is a stop (WebAssembly SIMD, sixteen
    /// bytes at a time: V8 and wasmtime compile it to SSE compares and a
    /// `pmovmskb`).
    #[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
    fn lanes(v: core::arch::wasm32::v128) -> u32;
}

/// `"`, `\` and the control characters (< 0x20).
struct Specials;

/// As [`Specials`], and every byte ≥ 0x80.
struct SpecialsOrNonAscii;

impl Stops for Specials {
    #[inline(always)]
    fn word(x: u64) -> u64 {
        specials(x)
    }

    #[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
    #[inline(always)]
    fn lanes(v: core::arch::wasm32::v128) -> u32 {
        use core::arch::wasm32::{u8x16_lt, u8x16_splat};
        quote_backslash_or(v, u8x16_lt(v, u8x16_splat(0x20)))
    }
}

impl Stops for SpecialsOrNonAscii {
    #[inline(always)]
    fn word(x: u64) -> u64 {
        specials_or_non_ascii(x)
    }

    #[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
    #[inline(always)]
    fn lanes(v: core::arch::wasm32::v128) -> u32 {
        use core::arch::wasm32::{i8x16_lt, i8x16_splat};
        // Below 0x20 or at least 0x80: as signed bytes, below 0x20.
        quote_backslash_or(v, i8x16_lt(v, i8x16_splat(0x20)))
    }
}

/// Bit i set if byte i of `v` is `"` or `\`, or its lane in `also` is set.
#[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
#[inline(always)]
fn quote_backslash_or(v: core::arch::wasm32::v128, also: core::arch::wasm32::v128) -> u32 {
    use core::arch::wasm32::*;
    let quote = i8x16_eq(v, u8x16_splat(b'"'));
    let backslash = i8x16_eq(v, u8x16_splat(b'\\'));
    u32::from(i8x16_bitmask(v128_or(v128_or(quote, backslash), also)))
}

/// The offset of the first stop in a 32-byte block, or `None` (also for
/// a block of another length).
#[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
#[inline(always)]
fn first_flagged<S: Stops>(block: &[u8]) -> Option<usize> {
    use core::arch::wasm32::u64x2;
    let Ok(block) = <&[u8; 32]>::try_from(block) else {
        return None;
    };
    let word = |i: usize| {
        let mut w = [0u8; 8];
        w.copy_from_slice(&block[i..i + 8]);
        u64::from_le_bytes(w)
    };
    let lo = S::lanes(u64x2(word(0), word(8)));
    let hi = S::lanes(u64x2(word(16), word(24)));
    let found = lo | (hi << 16);
    (found != 0).then(|| found.trailing_zeros() as usize)
}

/// The offset of the first stop in a 32-byte block (four words of the
/// SWAR test), or `None` (also for a block of another length).
#[cfg(not(all(target_arch = "wasm32", target_feature = "simd128")))]
#[inline(always)]
fn first_flagged<S: Stops>(block: &[u8]) -> Option<usize> {
    let Ok(block) = <&[u8; 32]>::try_from(block) else {
        return None;
    };
    let word = |i: usize| {
        let mut w = [0u8; 8];
        w.copy_from_slice(&block[i..i + 8]);
        S::word(u64::from_le_bytes(w))
    };
    let (fa, fb, fc, fd) = (word(0), word(8), word(16), word(24));
    if (fa | fb) | (fc | fd) == 0 {
        return None;
    }
    Some(if fa != 0 {
        lane(fa)
    } else if fb != 0 {
        8 + lane(fb)
    } else if fc != 0 {
        16 + lane(fc)
    } else {
        24 + lane(fd)
    })
}

/// The index of the first stop in `s`, or `s.len()`: 32 bytes at a time
/// ([`first_flagged`]), then eight (SWAR, as serde_json does), then one.
#[inline(always)]
fn find<S: Stops>(s: &[u8]) -> usize {
    let mut i = 0;
    let mut blocks = s.chunks_exact(32);
    for block in &mut blocks {
        if let Some(k) = first_flagged::<S>(block) {
            return i + k;
        }
        i += 32;
    }
    for word in blocks.remainder().chunks_exact(8) {
        let Ok(word) = <[u8; 8]>::try_from(word) else {
            break;
        };
        let f = S::word(u64::from_le_bytes(word));
        if f != 0 {
            return i + lane(f);
        }
        i += 8;
    }
    for &b in s.get(i..).unwrap_or_default() {
        // The byte alone in the lowest lane (the only exact one).
        if S::word(u64::from(b)) & 0x80 != 0 {
            return i;
        }
        i += 1;
    }
    i
}

const ONES: u64 = u64::MAX / 255;
const HIGH: u64 = ONES << 7;

/// The top bit of every byte lane of `x` that is `"`, `\` or < 0x20, exact
/// for the lowest such lane (lanes above it may be flagged spuriously).
///
/// `x ^ 0x02` maps `"` to 0x20 and the control characters onto themselves,
/// so "below 0x21" after it finds both; `x ^ 0x5c` maps `\` to zero,
/// "below 0x01". Subtracting k from every lane borrows (sets the lane's top
/// bit) where the lane is below k, and the lowest flagged lane is always a
/// true match, since a borrow only spreads upwards from one. Lanes ≥ 0x80
/// are masked out: no special byte has its top bit set, and none of them
/// borrows.
#[inline(always)]
fn specials(x: u64) -> u64 {
    special_borrows(x) & !x & HIGH
}

/// As [`specials`], and also every lane ≥ 0x80.
#[inline(always)]
fn specials_or_non_ascii(x: u64) -> u64 {
    (special_borrows(x) | x) & HIGH
}

#[inline(always)]
fn special_borrows(x: u64) -> u64 {
    let quote_or_control = (x ^ (ONES * 0x02)).wrapping_sub(ONES * 0x21);
    let backslash = (x ^ (ONES * u64::from(b'\\'))).wrapping_sub(ONES);
    quote_or_control | backslash
}

/// The index of the lowest flagged lane.
#[inline(always)]
fn lane(found: u64) -> usize {
    (found.trailing_zeros() / 8) as usize
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scan_ref(s: &[u8]) -> (usize, bool) {
        let i = s
            .iter()
            .position(|&b| b == b'"' || b == b'\\' || b < 0x20)
            .unwrap_or(s.len());
        (i, s[..i].iter().any(|&b| b >= 0x80))
    }

    fn scan2(s: &[u8]) -> (usize, bool) {
        let mut non_ascii = false;
        let i = scan(s, &mut non_ascii);
        // Once set, the flag only skips the non-ASCII stops.
        let mut set = true;
        assert_eq!(scan(s, &mut set), i);
        (i, non_ascii)
    }

    #[test]
    fn scan_matches_bytewise() {
        let alphabet = [
            b'a', b'"', b'\\', 0x00, 0x1f, 0x20, 0x7f, 0x80, 0xff, 0xc3, 0x21, 0x5d, 0x5b,
        ];
        let mut seed = 7u64;
        for len in 0..40 {
            for _ in 0..300 {
                let s: Vec<u8> = (0..len)
                    .map(|_| {
                        seed = seed.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
                        let r = (seed >> 33) as usize;
                        // Mostly plain bytes, so that matches come late.
                        if r.is_multiple_of(5) {
                            alphabet[r / 5 % alphabet.len()]
                        } else {
                            b'a' + (r % 26) as u8
                        }
                    })
                    .collect();
                assert_eq!(scan2(&s), scan_ref(&s), "{s:?}");
            }
        }
        for b in 0..=255u8 {
            for at in 0..17 {
                let mut s = vec![b'x'; 17];
                s[at] = b;
                assert_eq!(scan2(&s), scan_ref(&s), "byte {b:#x} at {at}");
            }
        }
    }

    /// The decoder accepts and decodes exactly what serde_json does.
    #[test]
    fn strings_match_serde_json() {
        let cases: &[&[u8]] = &[
            br#""""#,
            br#""plain""#,
            br#""a\nb\t\"\\\/\b\f\r""#,
            br#""\u00e9\u0000\u001f\uFFFF""#,
            br#""\ud83d\ude00""#,
            br#""\ud83d""#,
            br#""\ud83dx""#,
            br#""\ud83d\n""#,
            br#""\ud83d\u0041""#,
            br#""\ude00""#,
            br#""\u12""#,
            br#""\u12g4""#,
            br#""\x""#,
            br#""abc"#,
            br#""abc\"#,
            "\"caf\u{e9} \u{1F600}\"".as_bytes(),
            b"\"a\x01b\"",
            b"\"a\x7fb\"",
            b"\"\xff\"",
            b"\"\xc3\"",
            b"\"\xc3\\n\"",
            b"\"\\u00e9\xa9\"",
            b"\"\xed\xa0\x80\"",
        ];
        for &case in cases {
            let want = serde_json::from_slice::<String>(case).ok();
            let mut out = Vec::new();
            let mut cur = Cursor::new(case);
            let got = cur
                .string_into(&mut out)
                .ok()
                .map(|()| String::from_utf8(out).expect("validated"));
            assert_eq!(got, want, "{}", String::from_utf8_lossy(case));
            let mut scratch = Vec::new();
            let mut cur = Cursor::new(case);
            let got = match cur.str_bytes(&mut scratch) {
                Ok(Some(b)) => Some(b.to_vec()),
                Ok(None) => Some(scratch.clone()),
                Err(_) => None,
            };
            assert_eq!(got, want.map(String::into_bytes));
        }
    }
}

//! Little-endian fixed-width encoding helpers. Decoding never panics: a short
//! or corrupt value decodes as `None`, and callers treat it as absent.

/// Appends fixed-width little-endian values.
#[derive(Default)]
pub struct Writer {
    pub buf: Vec<u8>,
}

impl Writer {
    pub fn with_capacity(n: usize) -> Self {
        Writer {
            buf: Vec::with_capacity(n),
        }
    }
    pub fn u8(&mut self, v: u8) {
        self.buf.push(v);
    }
    pub fn u16(&mut self, v: u16) {
        self.buf.extend_from_slice(&v.to_le_bytes());
    }
    pub fn u32(&mut self, v: u32) {
        self.buf.extend_from_slice(&v.to_le_bytes());
    }
    pub fn u64(&mut self, v: u64) {
        self.buf.extend_from_slice(&v.to_le_bytes());
    }
    pub fn f64(&mut self, v: f64) {
        self.u64(v.to_bits());
    }
    /// A length-prefixed (u16) byte string, cut at 65,535 bytes.
    pub fn bytes(&mut self, v: &[u8]) {
        let v = &v[..v.len().min(u16::MAX as usize)];
        self.u16(v.len() as u16);
        self.buf.extend_from_slice(v);
    }
}

/// Reads fixed-width little-endian values; `None` when the input runs out.
pub struct Reader<'a> {
    buf: &'a [u8],
}

impl<'a> Reader<'a> {
    pub fn new(buf: &'a [u8]) -> Self {
        Reader { buf }
    }
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        if self.buf.len() < n {
            return None;
        }
        let (a, b) = self.buf.split_at(n);
        self.buf = b;
        Some(a)
    }
    pub fn u8(&mut self) -> Option<u8> {
        self.take(1).map(|b| b[0])
    }
    pub fn u16(&mut self) -> Option<u16> {
        self.take(2)
            .and_then(|b| b.try_into().ok())
            .map(u16::from_le_bytes)
    }
    pub fn u32(&mut self) -> Option<u32> {
        self.take(4)
            .and_then(|b| b.try_into().ok())
            .map(u32::from_le_bytes)
    }
    pub fn u64(&mut self) -> Option<u64> {
        self.take(8)
            .and_then(|b| b.try_into().ok())
            .map(u64::from_le_bytes)
    }
    pub fn f64(&mut self) -> Option<f64> {
        self.u64().map(f64::from_bits)
    }
    pub fn bytes(&mut self) -> Option<&'a [u8]> {
        let n = self.u16()? as usize;
        self.take(n)
    }
    pub fn is_empty(&self) -> bool {
        self.buf.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_short_input() {
        let mut w = Writer::default();
        w.u8(1);
        w.u16(2);
        w.u32(3);
        w.u64(4);
        w.f64(0.5);
        w.bytes(b"abc");
        let mut r = Reader::new(&w.buf);
        assert_eq!(
            (r.u8(), r.u16(), r.u32(), r.u64(), r.f64()),
            (Some(1), Some(2), Some(3), Some(4), Some(0.5))
        );
        assert_eq!(r.bytes(), Some(&b"abc"[..]));
        assert!(r.is_empty());
        assert_eq!(r.u8(), None);
        assert_eq!(Reader::new(&[5, 0, 1]).bytes(), None);
    }
}

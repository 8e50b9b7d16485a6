//! The mesh exchange's outbox: the accepted decisions of this proxy that
//! the other proxies have not been told of yet.
//!
//! A worker appends one [`Accepted`] when a server accepts a request (a 2xx
//! answer): the endpoint, the blocks the decision moved its eviction clock
//! by, the text prompt bytes it routed there (the bytes-per-token learner
//! divides the bytes every proxy routed by the tokens the server counted),
//! and the prompt's approximate block hashes from the index group that
//! holds its first new block on (an index group is keyed by its own blocks
//! only, so a receiver can insert them without the prefix before), and,
//! for a request of a `session_id` session, the session's hash and whether
//! this acceptance moved its binding ([`SessionNote`]). The collector takes
//! the whole outbox on each exchange and posts it.
//!
//! Bounded: at most [`MAX_OUTBOX_BYTES`] encoded, each entry at most
//! [`MAX_ENTRY_HASHES`] hashes (a longer prompt's tail is not told: the
//! peers learn its first part). A full outbox drops its oldest entries and
//! counts them (`dropped`), so an absent collector costs peers' knowledge,
//! never memory.

use crate::cas::{update, Updated};
use crate::codec::{Reader, Writer};
use crate::{Store, StoreError};

/// The outbox's key.
pub const OUTBOX_KEY: &str = "kvroute/mesh/outbox";
/// Most bytes the encoded outbox holds.
pub const MAX_OUTBOX_BYTES: usize = 64 * 1024;
/// Most hashes one entry carries (32 KiB; 2,048 blocks).
pub const MAX_ENTRY_HASHES: usize = 4096;

// 0x4e: the format before sessions (decodes as empty: an upgrade in place
// loses one period's decisions, never misreads them).
const MAGIC: u8 = 0x4f;
const HEADER_BYTES: usize = 1 + 8 + 4;
// slot, generation, new blocks, prompt bytes, session flags, session, hashes.
const ENTRY_HEAD_BYTES: usize = 2 + 2 + 4 + 4 + 1 + 8 + 2;
const SESSION_SET: u8 = 1;
const SESSION_MOVED: u8 = 2;

/// A session's part in an accepted decision: the hash of its session id
/// (the binding table's key; the id itself never leaves the proxy) and
/// whether this acceptance moved the session's binding here (the teller
/// found its bound endpoint absent or released, or Envoy retried the
/// request here) rather than binding or refreshing it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SessionNote {
    pub hash: u64,
    pub moved: bool,
}

/// One accepted decision, as the exchange tells it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Accepted {
    pub slot: u16,
    pub generation: u16,
    /// Blocks the decision advanced the endpoint's eviction clock by.
    pub new_blocks: u32,
    /// Text prompt bytes routed (0 for a token-ID prompt).
    pub prompt_bytes: u32,
    /// Approximate block hashes from the start of an index group on.
    pub hashes: Vec<u64>,
    /// The request's session binding, settled here (`session_id` only).
    pub session: Option<SessionNote>,
}

impl Accepted {
    fn encoded_len(&self) -> usize {
        ENTRY_HEAD_BYTES + 8 * self.hashes.len()
    }
}

/// The outbox's contents.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Outbox {
    /// Entries dropped at the bound, ever (monotone).
    pub dropped: u64,
    pub entries: Vec<Accepted>,
}

impl Outbox {
    pub fn encode(&self) -> Vec<u8> {
        let mut w = Writer::with_capacity(
            HEADER_BYTES
                + self
                    .entries
                    .iter()
                    .map(Accepted::encoded_len)
                    .sum::<usize>(),
        );
        w.u8(MAGIC);
        w.u64(self.dropped);
        w.u32(self.entries.len() as u32);
        for e in &self.entries {
            w.u16(e.slot);
            w.u16(e.generation);
            w.u32(e.new_blocks);
            w.u32(e.prompt_bytes);
            let s = e.session.unwrap_or_default();
            w.u8(match e.session {
                None => 0,
                Some(s) if s.moved => SESSION_SET | SESSION_MOVED,
                Some(_) => SESSION_SET,
            });
            w.u64(s.hash);
            w.u16(e.hashes.len() as u16);
            for &h in &e.hashes {
                w.u64(h);
            }
        }
        w.buf
    }

    /// A missing or corrupt value decodes as an empty outbox.
    pub fn decode(bytes: Option<&[u8]>) -> Outbox {
        bytes.and_then(Self::try_decode).unwrap_or_default()
    }

    fn try_decode(bytes: &[u8]) -> Option<Outbox> {
        let mut r = Reader::new(bytes);
        if r.u8()? != MAGIC {
            return None;
        }
        let dropped = r.u64()?;
        let n = r.u32()? as usize;
        if n > MAX_OUTBOX_BYTES / ENTRY_HEAD_BYTES {
            return None;
        }
        let mut entries = Vec::with_capacity(n);
        for _ in 0..n {
            let slot = r.u16()?;
            let generation = r.u16()?;
            let new_blocks = r.u32()?;
            let prompt_bytes = r.u32()?;
            let flags = r.u8()?;
            let hash = r.u64()?;
            if flags & !(SESSION_SET | SESSION_MOVED) != 0 {
                return None;
            }
            let session = (flags & SESSION_SET != 0).then_some(SessionNote {
                hash,
                moved: flags & SESSION_MOVED != 0,
            });
            let len = usize::from(r.u16()?);
            if len > MAX_ENTRY_HASHES {
                return None;
            }
            let mut hashes = Vec::with_capacity(len);
            for _ in 0..len {
                hashes.push(r.u64()?);
            }
            entries.push(Accepted {
                slot,
                generation,
                new_blocks,
                prompt_bytes,
                hashes,
                session,
            });
        }
        r.is_empty().then_some(Outbox { dropped, entries })
    }

    fn encoded_len(&self) -> usize {
        HEADER_BYTES
            + self
                .entries
                .iter()
                .map(Accepted::encoded_len)
                .sum::<usize>()
    }

    /// Appends `e` (its hashes cut to [`MAX_ENTRY_HASHES`]), dropping the
    /// oldest entries while the encoding would exceed [`MAX_OUTBOX_BYTES`].
    pub fn push(&mut self, mut e: Accepted) {
        e.hashes.truncate(MAX_ENTRY_HASHES);
        let mut len = self.encoded_len() + e.encoded_len();
        let mut cut = 0;
        while len > MAX_OUTBOX_BYTES && cut < self.entries.len() {
            len -= self.entries[cut].encoded_len();
            cut += 1;
        }
        self.entries.drain(..cut);
        self.dropped = self.dropped.saturating_add(cut as u64);
        self.entries.push(e);
    }
}

/// Appends one accepted decision to the outbox (a CAS loop, bounded).
pub fn post(store: &dyn Store, e: Accepted) -> Result<u32, StoreError> {
    let Updated { retries, .. } = update(
        store,
        OUTBOX_KEY,
        Outbox::decode,
        Outbox::encode,
        |o: &mut Outbox| {
            o.push(e.clone());
            Some(())
        },
    )?;
    Ok(retries)
}

/// Takes every entry out of the outbox (the collector, at each exchange);
/// the drop count stays.
pub fn take(store: &dyn Store) -> Result<Outbox, StoreError> {
    let Updated { result, .. } = update(
        store,
        OUTBOX_KEY,
        Outbox::decode,
        Outbox::encode,
        |o: &mut Outbox| {
            if o.entries.is_empty() {
                return None;
            }
            let taken = Outbox {
                dropped: o.dropped,
                entries: std::mem::take(&mut o.entries),
            };
            Some(taken)
        },
    )?;
    Ok(result.unwrap_or_default())
}

/// The key of this Envoy process's proxy id on the relays.
pub const PROXY_ID_KEY: &str = "kvroute/mesh/id";

/// This process's proxy id: the one stored, or `candidate` (made nonzero)
/// stored now if there is none, so every collector VM of the process
/// posts as one proxy.
pub fn proxy_id(store: &dyn Store, candidate: u64) -> Result<u64, StoreError> {
    let decode = |b: Option<&[u8]>| {
        b.and_then(|b| <[u8; 8]>::try_from(b).ok())
            .map_or(0, u64::from_le_bytes)
    };
    let Updated { result, .. } = update(
        store,
        PROXY_ID_KEY,
        decode,
        |v: &u64| v.to_le_bytes().to_vec(),
        |v: &mut u64| {
            if *v == 0 {
                *v = candidate.max(1);
            }
            Some(*v)
        },
    )?;
    Ok(result.unwrap_or(candidate.max(1)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::MemoryStore;

    fn entry(slot: u16, n: usize) -> Accepted {
        Accepted {
            slot,
            generation: 1,
            new_blocks: n as u32,
            prompt_bytes: 40 * n as u32 + 1,
            hashes: (0..n as u64).map(|h| h * 7 + u64::from(slot)).collect(),
            session: (slot % 2 == 1).then_some(SessionNote {
                hash: u64::MAX - u64::from(slot),
                moved: slot % 4 == 3,
            }),
        }
    }

    #[test]
    fn round_trip_and_take_empties() {
        let s = MemoryStore::new();
        post(&s, entry(0, 3)).unwrap();
        post(&s, entry(2, 5)).unwrap();
        post(&s, entry(3, 0)).unwrap();
        post(&s, entry(5, 1)).unwrap();
        let o = take(&s).unwrap();
        assert_eq!(
            o.entries,
            vec![entry(0, 3), entry(2, 5), entry(3, 0), entry(5, 1)]
        );
        // Sessions round-trip: none, a moved one, a bound one.
        assert_eq!(o.entries[0].session, None);
        assert!(o.entries[2].session.unwrap().moved);
        assert!(!o.entries[3].session.unwrap().moved);
        assert_eq!(o.dropped, 0);
        assert!(take(&s).unwrap().entries.is_empty());
    }

    #[test]
    fn the_outbox_stays_bounded_and_counts_what_it_drops() {
        let s = MemoryStore::new();
        for i in 0..200 {
            post(&s, entry(i % 8, 600)).unwrap();
            let (bytes, _) = s.get(OUTBOX_KEY).unwrap().unwrap();
            assert!(bytes.len() <= MAX_OUTBOX_BYTES, "{}", bytes.len());
        }
        let o = take(&s).unwrap();
        // 4,823 bytes per entry: 13 fit in 64 KiB.
        assert_eq!(o.entries.len(), 13);
        assert_eq!(o.dropped, 200 - 13);
        // The newest are kept.
        assert_eq!(o.entries.last().unwrap(), &entry(199 % 8, 600));
        // One entry's hashes are cut at the bound.
        post(&s, entry(1, MAX_ENTRY_HASHES + 10)).unwrap();
        assert_eq!(take(&s).unwrap().entries[0].hashes.len(), MAX_ENTRY_HASHES);
    }

    #[test]
    fn the_proxy_id_is_made_once() {
        let s = MemoryStore::new();
        let a = proxy_id(&s, 42).unwrap();
        assert_eq!(a, 42);
        assert_eq!(proxy_id(&s, 7).unwrap(), 42);
        assert_eq!(proxy_id(&MemoryStore::new(), 0).unwrap(), 1);
    }

    #[test]
    fn garbage_decodes_as_empty() {
        for bad in [
            &b""[..],
            b"\x4e",
            b"\x4f\0\0\0\0\0\0\0\0\xff\xff\xff\xff",
            b"xyz",
        ] {
            assert_eq!(Outbox::decode(Some(bad)), Outbox::default());
        }
        // The format before sessions is not misread.
        let mut old = entry(2, 3);
        old.session = None;
        let mut bytes = Outbox {
            dropped: 0,
            entries: vec![old],
        }
        .encode();
        bytes[0] = 0x4e;
        assert_eq!(Outbox::decode(Some(&bytes)), Outbox::default());
        // Unknown session flags are garbage.
        let mut bytes = Outbox {
            dropped: 0,
            entries: vec![entry(1, 0)],
        }
        .encode();
        bytes[HEADER_BYTES + 12] |= 4;
        assert_eq!(Outbox::decode(Some(&bytes)), Outbox::default());
        let mut good = Outbox::default();
        good.push(entry(3, 4));
        let mut bytes = good.encode();
        assert_eq!(Outbox::decode(Some(&bytes)), good);
        bytes.push(0);
        assert_eq!(Outbox::decode(Some(&bytes)), Outbox::default());
    }
}

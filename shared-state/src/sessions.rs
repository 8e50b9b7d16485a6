//! `kvroute/sessions/<shard>`: session bindings, session → endpoint, for
//! `session-affinity-scorer` / `-filter` with `strategy: session_id`.
//!
//! A binding is three numbers (24 bytes): the session id's hash, the
//! endpoint's key (a hash of its `ip:port`, the scheduler's
//! `Candidate::key`) and when work a server accepted last used it (ms).
//! Bindings live in `shards` values of at most [`SHARD_SLOTS`] bindings
//! each; a session's shard is its hash modulo `shards`. So the whole table
//! holds at most `shards × SHARD_SLOTS` bindings, whatever the traffic:
//! shared data stays under `shards × (2 + SHARD_SLOTS × 24)` bytes.
//!
//! Idle expiry is checked on read (a binding idle longer than the TTL reads
//! as absent) and on write (an expired binding's slot is reused first).
//! A full shard gives up its stalest binding for a new one. There is no
//! sweep: nothing grows between writes, so none is needed for the bound.
//!
//! Every change is a CAS read-modify-write of one shard ([`crate::cas`]).

use crate::cas::update;
use crate::codec::{Reader, Writer};
use crate::{Store, StoreError};

/// Bindings per shard value.
pub const SHARD_SLOTS: usize = 64;
/// The most shards a table may have (262,144 bindings).
pub const MAX_SHARDS: u32 = 4096;
const VERSION: u8 = 1;
/// Bytes of one encoded binding.
const BINDING_BYTES: usize = 24;

/// The key of shard `i`.
pub fn shard_key(i: u32) -> String {
    format!("kvroute/sessions/{i}")
}

/// One binding.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Binding {
    /// The session id's hash.
    pub session: u64,
    /// The endpoint's key (a hash of its `ip:port`).
    pub endpoint: u64,
    /// ms; when accepted work last used it.
    pub last_seen_ms: u64,
}

impl Binding {
    fn expired(&self, now_ms: u64, ttl_ms: u64) -> bool {
        now_ms.saturating_sub(self.last_seen_ms) > ttl_ms
    }
}

/// One shard's bindings (at most [`SHARD_SLOTS`]).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Shard {
    pub bindings: Vec<Binding>,
}

impl Shard {
    /// Decodes a shard; `None` for anything that is not exactly one
    /// well-formed shard (a wrong version, a count over [`SHARD_SLOTS`], a
    /// length that does not match).
    pub fn decode(bytes: &[u8]) -> Option<Shard> {
        let mut r = Reader::new(bytes);
        if r.u8()? != VERSION {
            return None;
        }
        let n = usize::from(r.u8()?);
        if n > SHARD_SLOTS || bytes.len() != 2 + n * BINDING_BYTES {
            return None;
        }
        let mut bindings = Vec::with_capacity(n);
        for _ in 0..n {
            bindings.push(Binding {
                session: r.u64()?,
                endpoint: r.u64()?,
                last_seen_ms: r.u64()?,
            });
        }
        Some(Shard { bindings })
    }

    /// A shard's value, empty when absent or unreadable (a corrupt shard
    /// loses its bindings: sessions re-bind on their next accepted request).
    pub fn decode_or_empty(bytes: Option<&[u8]>) -> Shard {
        bytes.and_then(Shard::decode).unwrap_or_default()
    }

    pub fn encode(&self) -> Vec<u8> {
        let n = self.bindings.len().min(SHARD_SLOTS);
        let mut w = Writer::with_capacity(2 + n * BINDING_BYTES);
        w.u8(VERSION);
        w.u8(n as u8);
        for b in &self.bindings[..n] {
            w.u64(b.session);
            w.u64(b.endpoint);
            w.u64(b.last_seen_ms);
        }
        w.buf
    }
}

/// The table's shape: how many shards.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SessionGeometry {
    pub shards: u32,
}

impl SessionGeometry {
    /// Enough shards for `max_sessions` bindings (at least one, at most
    /// [`MAX_SHARDS`]).
    pub fn for_capacity(max_sessions: u64) -> SessionGeometry {
        let shards = max_sessions.div_ceil(SHARD_SLOTS as u64);
        SessionGeometry {
            shards: shards.clamp(1, u64::from(MAX_SHARDS)) as u32,
        }
    }

    /// The most bindings the table holds.
    pub fn capacity(&self) -> u64 {
        u64::from(self.shards) * SHARD_SLOTS as u64
    }

    fn shard_of(&self, session: u64) -> u32 {
        // The high half: the low bits also pick nothing else here, but a
        // weak hash's high bits mix better.
        ((session >> 32) % u64::from(self.shards.max(1))) as u32
    }
}

/// What a lookup found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Lookup {
    /// No binding.
    Unbound,
    /// Bound to the endpoint with this key.
    Bound(u64),
    /// A binding idle past the TTL (reads as unbound).
    Expired,
}

/// The binding of `session`, with idle expiry checked on read.
pub fn lookup(
    store: &dyn Store,
    geo: &SessionGeometry,
    session: u64,
    now_ms: u64,
    ttl_ms: u64,
) -> Result<Lookup, StoreError> {
    let read = store.get(&shard_key(geo.shard_of(session)))?;
    let shard = Shard::decode_or_empty(read.as_ref().map(|(b, _)| b.as_slice()));
    Ok(match shard.bindings.iter().find(|b| b.session == session) {
        None => Lookup::Unbound,
        Some(b) if b.expired(now_ms, ttl_ms) => Lookup::Expired,
        Some(b) => Lookup::Bound(b.endpoint),
    })
}

/// What [`settle`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Settled {
    /// A new binding (the session had none, or only an expired one).
    Bound,
    /// Bound to the same endpoint: its idle clock restarted.
    Refreshed,
    /// Moved to the served endpoint (the caller allowed it).
    Moved,
    /// Bound elsewhere and not allowed to move: left as it was.
    Kept,
}

/// The outcome of [`settle`], with what it cost.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SettleOutcome {
    pub settled: Settled,
    /// A live binding of another session gave up its slot (the shard was
    /// full).
    pub evicted: bool,
    pub cas_retries: u32,
}

/// Records that accepted work of `session` was served by `endpoint` at
/// `now_ms`: binds an unbound (or expired) session, refreshes a binding to
/// the same endpoint, and moves one bound elsewhere only when `may_move`.
/// A new binding in a full shard takes the slot of an expired binding, or
/// else of the stalest.
pub fn settle(
    store: &dyn Store,
    geo: &SessionGeometry,
    session: u64,
    endpoint: u64,
    now_ms: u64,
    ttl_ms: u64,
    may_move: bool,
) -> Result<SettleOutcome, StoreError> {
    let updated = update(
        store,
        &shard_key(geo.shard_of(session)),
        Shard::decode_or_empty,
        Shard::encode,
        |s: &mut Shard| {
            let fresh = Binding {
                session,
                endpoint,
                last_seen_ms: now_ms,
            };
            if let Some(b) = s.bindings.iter_mut().find(|b| b.session == session) {
                let settled = if b.expired(now_ms, ttl_ms) {
                    Settled::Bound
                } else if b.endpoint == endpoint {
                    Settled::Refreshed
                } else if may_move {
                    Settled::Moved
                } else {
                    return Some((Settled::Kept, false));
                };
                *b = fresh;
                return Some((settled, false));
            }
            if s.bindings.len() < SHARD_SLOTS {
                s.bindings.push(fresh);
                return Some((Settled::Bound, false));
            }
            // Full: an expired slot first, else the stalest.
            let (k, evicted) = match s.bindings.iter().position(|b| b.expired(now_ms, ttl_ms)) {
                Some(k) => (k, false),
                None => {
                    let k = s
                        .bindings
                        .iter()
                        .enumerate()
                        .min_by_key(|(_, b)| b.last_seen_ms)
                        .map_or(0, |(k, _)| k);
                    (k, true)
                }
            };
            s.bindings[k] = fresh;
            Some((Settled::Bound, evicted))
        },
    )?;
    let (settled, evicted) = updated.result.unwrap_or((Settled::Kept, false));
    Ok(SettleOutcome {
        settled,
        evicted,
        cas_retries: updated.retries,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::MemoryStore;

    const TTL: u64 = 300_000;

    #[test]
    fn bind_refresh_keep_move_and_expire() {
        let store = MemoryStore::new();
        let geo = SessionGeometry::for_capacity(1000);
        let look = |now| lookup(&store, &geo, 7, now, TTL).unwrap();
        assert_eq!(look(0), Lookup::Unbound);
        let s = |ep, now, may_move| {
            settle(&store, &geo, 7, ep, now, TTL, may_move)
                .unwrap()
                .settled
        };
        assert_eq!(s(1, 1_000, false), Settled::Bound);
        assert_eq!(look(2_000), Lookup::Bound(1));
        assert_eq!(s(1, 2_000, false), Settled::Refreshed);
        assert_eq!(s(2, 3_000, false), Settled::Kept);
        assert_eq!(look(3_000), Lookup::Bound(1));
        assert_eq!(s(2, 4_000, true), Settled::Moved);
        assert_eq!(look(4_000), Lookup::Bound(2));
        // Idle past the TTL: expired on read, re-bound on write.
        assert_eq!(look(4_000 + TTL + 1), Lookup::Expired);
        assert_eq!(
            look(4_000 + TTL),
            Lookup::Bound(2),
            "the TTL itself is live"
        );
        assert_eq!(s(3, 4_000 + TTL + 1, false), Settled::Bound);
        assert_eq!(look(4_000 + TTL + 2), Lookup::Bound(3));
    }

    /// The table stays within `shards × SHARD_SLOTS` bindings and each value
    /// within its size, however many sessions come; the stalest go first.
    #[test]
    fn bounded_whatever_the_number_of_sessions() {
        let store = MemoryStore::new();
        let geo = SessionGeometry::for_capacity(256);
        assert_eq!((geo.shards, geo.capacity()), (4, 256));
        let mut evicted = 0;
        for i in 0..10_000u64 {
            let h = xxh(i);
            let out = settle(&store, &geo, h, i % 5, i, TTL, false).unwrap();
            evicted += u64::from(out.evicted);
        }
        let mut total = 0;
        for k in 0..geo.shards {
            let (bytes, _) = store.get(&shard_key(k)).unwrap().unwrap();
            assert!(bytes.len() <= 2 + SHARD_SLOTS * BINDING_BYTES);
            total += Shard::decode(&bytes).unwrap().bindings.len();
        }
        assert_eq!(total, 256, "every slot in use, none more");
        assert!(evicted >= 10_000 - 256, "{evicted}");
        assert_eq!(store.get(&shard_key(geo.shards)).unwrap(), None);
        // The newest sessions are the ones kept.
        assert!(matches!(
            lookup(&store, &geo, xxh(9_999), 10_000, TTL).unwrap(),
            Lookup::Bound(_)
        ));
        assert_eq!(
            lookup(&store, &geo, xxh(0), 10_000, TTL).unwrap(),
            Lookup::Unbound
        );
    }

    #[test]
    fn expired_slots_are_reused_before_live_ones() {
        let store = MemoryStore::new();
        let geo = SessionGeometry { shards: 1 };
        for i in 0..SHARD_SLOTS as u64 {
            settle(&store, &geo, i << 32, 1, i, 10, false).unwrap();
        }
        // At t = 20, session 0..=9 are expired (idle > 10 ms).
        let out = settle(&store, &geo, 999 << 32, 1, 20, 10, false).unwrap();
        assert_eq!((out.settled, out.evicted), (Settled::Bound, false));
    }

    #[test]
    fn malformed_shards_read_as_empty() {
        let good = Shard {
            bindings: vec![Binding {
                session: 1,
                endpoint: 2,
                last_seen_ms: 3,
            }],
        }
        .encode();
        assert!(Shard::decode(&good).is_some());
        for bad in [
            &[][..],
            &[VERSION][..],
            &good[..good.len() - 1],
            &[2, 0][..],
            &[VERSION, 65][..],
        ] {
            assert_eq!(Shard::decode(bad), None, "{bad:?}");
        }
        let mut long = good.clone();
        long.push(0);
        assert_eq!(Shard::decode(&long), None);
        let store = MemoryStore::new();
        store.set(&shard_key(0), &[VERSION, 200, 1], 0).unwrap();
        let geo = SessionGeometry { shards: 1 };
        assert_eq!(lookup(&store, &geo, 5, 0, TTL), Ok(Lookup::Unbound));
        assert_eq!(
            settle(&store, &geo, 5, 1, 0, TTL, false).unwrap().settled,
            Settled::Bound
        );
    }

    fn xxh(i: u64) -> u64 {
        // splitmix64: spread test sessions over the shards.
        let mut z = i.wrapping_add(0x9e37_79b9_7f4a_7c15);
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
}

//! `collector.mode: lease`: the worker VMs elect one collector among
//! themselves through a lease key in shared data, so an install with the
//! HTTP filter only (no bootstrap singleton) is complete.
//!
//! The lease (`kvroute/lease`, [`LeaseRecord`], 41 bytes) names its holder
//! and when it expires, and carries the collector's schedule (next admin
//! refresh, next `/metrics` poll, next reap), so a new holder goes on where
//! the old one stopped instead of polling again at once.
//!
//! Every collector tick, each contender:
//! 1. reads the lease; if another VM holds it and it has not expired, does
//!    nothing this tick;
//! 2. if it is free (expired, never held, or unreadable), takes it with a
//!    CAS write: of several contenders one wins, the others see a CAS
//!    mismatch and stay followers;
//! 3. the holder does the collector's work, then renews the lease (a CAS
//!    write, expiry `now + leaseMs`) with its updated schedule.
//!
//! A holder whose VM goes away stops renewing; within `leaseMs` plus one
//! tick another VM takes over. A holder that was paused past its expiry
//! reads the lease before any work and finds another holder, so two VMs
//! never poll in the same tick (save for the start-up race below).
//!
//! Shared data has no create-if-absent: the first write of a missing key
//! is unconditional. The lease key is therefore created free (holder 0)
//! and taken with CAS only on a later tick. Contender ids come from a CAS
//! counter (`kvroute/lease-ids`) mixed with the clock, so two VMs get the
//! same id only if they create that counter in the same instant and read
//! the same nanosecond.

use kvroute_shared_state::{Store, StoreError};

/// The lease's key in shared data.
pub const LEASE_KEY: &str = "kvroute/lease";
/// The counter contender ids are drawn from.
pub const LEASE_IDS_KEY: &str = "kvroute/lease-ids";

const VERSION: u8 = 1;

/// The collector's next deadlines, ms since the epoch.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Schedule {
    pub next_refresh_ms: u64,
    pub next_poll_ms: u64,
    pub next_reap_ms: u64,
}

/// The value of [`LEASE_KEY`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LeaseRecord {
    /// The holder's contender id; 0: nobody.
    pub holder: u64,
    /// ms since the epoch; the lease is free from then on.
    pub expires_at_ms: u64,
    pub schedule: Schedule,
}

impl LeaseRecord {
    pub const BYTES: usize = 1 + 5 * 8;

    pub fn encode(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(Self::BYTES);
        b.push(VERSION);
        for x in [
            self.holder,
            self.expires_at_ms,
            self.schedule.next_refresh_ms,
            self.schedule.next_poll_ms,
            self.schedule.next_reap_ms,
        ] {
            b.extend_from_slice(&x.to_le_bytes());
        }
        b
    }

    /// `None` unless exactly one well-formed record.
    pub fn decode(b: &[u8]) -> Option<LeaseRecord> {
        if b.len() != Self::BYTES || b[0] != VERSION {
            return None;
        }
        let word = |i: usize| {
            let mut w = [0u8; 8];
            w.copy_from_slice(&b[1 + 8 * i..9 + 8 * i]);
            u64::from_le_bytes(w)
        };
        Some(LeaseRecord {
            holder: word(0),
            expires_at_ms: word(1),
            schedule: Schedule {
                next_refresh_ms: word(2),
                next_poll_ms: word(3),
                next_reap_ms: word(4),
            },
        })
    }
}

/// What a VM is in the election.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Standing {
    /// It holds the lease and runs the collector this tick.
    Leader,
    /// Another VM holds it (or took it first this tick).
    Follower,
}

/// One VM's part in the election.
#[derive(Debug)]
pub struct Lease {
    id: u64,
    lease_ms: u64,
    held: bool,
}

/// Mixes a counter value and the clock into a non-zero id (splitmix64).
fn mix(counter: u64, now_ns: u64) -> u64 {
    let mut z = counter
        .wrapping_mul(0x9E37_79B9_7F4A_7C15)
        .wrapping_add(now_ns);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    (z ^ (z >> 31)).max(1)
}

impl Lease {
    /// Joins the election: draws a contender id.
    pub fn join(store: &dyn Store, lease_ms: u64, now_ns: u64) -> Result<Lease, StoreError> {
        let counter = loop {
            match store.get(LEASE_IDS_KEY)? {
                None => store.set(LEASE_IDS_KEY, &0u64.to_le_bytes(), 0)?,
                Some((b, cas)) => {
                    let n = b
                        .get(..8)
                        .and_then(|w| w.try_into().ok())
                        .map_or(0, u64::from_le_bytes)
                        .wrapping_add(1);
                    match store.set(LEASE_IDS_KEY, &n.to_le_bytes(), cas) {
                        Ok(()) => break n,
                        Err(StoreError::CasMismatch) => continue,
                        Err(e) => return Err(e),
                    }
                }
            }
        };
        Ok(Lease {
            id: mix(counter, now_ns),
            lease_ms,
            held: false,
        })
    }

    pub fn id(&self) -> u64 {
        self.id
    }

    /// Whether this VM held the lease after its last round.
    pub fn held(&self) -> bool {
        self.held
    }

    /// Step 1–2 of a tick: returns this VM's standing and, when it has just
    /// taken the lease from another holder (or nobody), the schedule to
    /// go on with.
    pub fn contend(
        &mut self,
        store: &dyn Store,
        now_ms: u64,
        mine: Schedule,
    ) -> Result<(Standing, Option<Schedule>), StoreError> {
        let Some((bytes, cas)) = store.get(LEASE_KEY)? else {
            // Create it free; take it with CAS on a later tick.
            store.set(LEASE_KEY, &LeaseRecord::default().encode(), 0)?;
            self.held = false;
            return Ok((Standing::Follower, None));
        };
        let record = LeaseRecord::decode(&bytes);
        if let Some(r) = record {
            if r.holder == self.id && now_ms < r.expires_at_ms {
                self.held = true;
                return Ok((Standing::Leader, None));
            }
            if r.holder != 0 && r.holder != self.id && now_ms < r.expires_at_ms {
                self.held = false;
                return Ok((Standing::Follower, None));
            }
        }
        // Free: expired, never held, unreadable, or our own lapsed lease.
        let adopted = match record {
            Some(r) if r.holder != self.id && r.holder != 0 => r.schedule,
            _ => mine,
        };
        let taken = LeaseRecord {
            holder: self.id,
            expires_at_ms: now_ms.saturating_add(self.lease_ms),
            schedule: adopted,
        };
        match store.set(LEASE_KEY, &taken.encode(), cas) {
            Ok(()) => {
                self.held = true;
                Ok((Standing::Leader, Some(adopted)))
            }
            Err(StoreError::CasMismatch) => {
                self.held = false;
                Ok((Standing::Follower, None))
            }
            Err(e) => Err(e),
        }
    }

    /// Step 3: the holder renews the lease with its schedule after the
    /// tick's work. Returns false (and gives up) if another VM holds it now.
    pub fn renew(
        &mut self,
        store: &dyn Store,
        now_ms: u64,
        schedule: Schedule,
    ) -> Result<bool, StoreError> {
        let Some((bytes, cas)) = store.get(LEASE_KEY)? else {
            self.held = false;
            return Ok(false);
        };
        if LeaseRecord::decode(&bytes).map(|r| r.holder) != Some(self.id) {
            self.held = false;
            return Ok(false);
        }
        let renewed = LeaseRecord {
            holder: self.id,
            expires_at_ms: now_ms.saturating_add(self.lease_ms),
            schedule,
        };
        match store.set(LEASE_KEY, &renewed.encode(), cas) {
            Ok(()) => Ok(true),
            Err(StoreError::CasMismatch) => {
                self.held = false;
                Ok(false)
            }
            Err(e) => Err(e),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvroute_shared_state::memory::MemoryStore;

    #[test]
    fn records_round_trip_and_garbage_is_none() {
        let r = LeaseRecord {
            holder: 7,
            expires_at_ms: 9,
            schedule: Schedule {
                next_refresh_ms: 1,
                next_poll_ms: 2,
                next_reap_ms: 3,
            },
        };
        assert_eq!(LeaseRecord::decode(&r.encode()), Some(r));
        let b = r.encode();
        for cut in 0..b.len() {
            assert_eq!(LeaseRecord::decode(&b[..cut]), None);
        }
        let mut v2 = b.clone();
        v2[0] = 2;
        assert_eq!(LeaseRecord::decode(&v2), None);
    }

    #[test]
    fn ids_are_distinct_even_at_one_instant() {
        let s = MemoryStore::new();
        let ids: Vec<u64> = (0..50)
            .map(|_| Lease::join(&s, 1000, 42).unwrap().id())
            .collect();
        let mut u = ids.clone();
        u.sort_unstable();
        u.dedup();
        assert_eq!(u.len(), ids.len());
        assert!(ids.iter().all(|&i| i != 0));
    }

    #[test]
    fn one_leader_takeover_after_expiry_and_schedule_carried_over() {
        let s = MemoryStore::new();
        let mut a = Lease::join(&s, 1000, 0).unwrap();
        let mut b = Lease::join(&s, 1000, 0).unwrap();
        let sa = Schedule {
            next_poll_ms: 500,
            ..Default::default()
        };
        // The first round creates the key; nobody leads yet.
        assert_eq!(a.contend(&s, 0, sa).unwrap().0, Standing::Follower);
        assert_eq!(a.contend(&s, 10, sa).unwrap(), (Standing::Leader, Some(sa)));
        assert_eq!(
            b.contend(&s, 10, Schedule::default()).unwrap().0,
            Standing::Follower
        );
        let later = Schedule {
            next_poll_ms: 1500,
            ..Default::default()
        };
        assert!(a.renew(&s, 600, later).unwrap());
        assert_eq!(
            b.contend(&s, 1500, Schedule::default()).unwrap().0,
            Standing::Follower
        );
        // a stops renewing (its VM went away): b takes over at expiry, with
        // a's schedule.
        assert_eq!(
            b.contend(&s, 1600, Schedule::default()).unwrap(),
            (Standing::Leader, Some(later))
        );
        // a comes back: it reads the lease before any work and follows.
        assert_eq!(a.contend(&s, 1700, sa).unwrap().0, Standing::Follower);
        assert!(!a.renew(&s, 1700, sa).unwrap());
        assert!(!a.held() && b.held());
    }

    #[test]
    fn of_two_contenders_on_one_read_only_one_wins() {
        let s = MemoryStore::new();
        let mut a = Lease::join(&s, 1000, 0).unwrap();
        let mut b = Lease::join(&s, 1000, 0).unwrap();
        a.contend(&s, 0, Schedule::default()).unwrap();
        // Both read the free lease; a writes first; b's CAS then fails.
        let (_, cas) = s.get(LEASE_KEY).unwrap().unwrap();
        assert_eq!(
            a.contend(&s, 5, Schedule::default()).unwrap().0,
            Standing::Leader
        );
        let taken = LeaseRecord {
            holder: b.id(),
            expires_at_ms: 1005,
            schedule: Schedule::default(),
        };
        assert_eq!(
            s.set(LEASE_KEY, &taken.encode(), cas),
            Err(StoreError::CasMismatch)
        );
        assert_eq!(
            b.contend(&s, 5, Schedule::default()).unwrap().0,
            Standing::Follower
        );
    }

    #[test]
    fn an_unreadable_lease_is_free() {
        let s = MemoryStore::new();
        let mut a = Lease::join(&s, 1000, 0).unwrap();
        s.set(LEASE_KEY, b"garbage", 0).unwrap();
        assert_eq!(
            a.contend(&s, 5, Schedule::default()).unwrap().0,
            Standing::Leader
        );
    }
}

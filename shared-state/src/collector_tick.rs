//! `kvroute/collector/tick`: when the collector last ran its tick, so the
//! filter's worker VMs can tell a collector that stopped (a dead singleton
//! VM, a lease nobody renews) from one that runs.
//!
//! The value is the tick's wall-clock time in ms since the epoch, 8 bytes
//! little-endian. Only the VM that collects writes it (the singleton, or the
//! lease holder), once per tick, unconditionally (no CAS: the newest stamp
//! wins, and two writers would both be alive). Workers read it and publish
//! `now − stamp` as `kvroute_collector_tick_age_ms`.

use crate::codec::{Reader, Writer};
use crate::{Store, StoreError};

/// The key of the collector's last tick.
pub const COLLECTOR_TICK_KEY: &str = "kvroute/collector/tick";

/// Records that the collector ticked at `now_ms`.
pub fn stamp(store: &dyn Store, now_ms: u64) -> Result<(), StoreError> {
    let mut w = Writer::with_capacity(8);
    w.u64(now_ms);
    store.set(COLLECTOR_TICK_KEY, &w.buf, 0)
}

/// When the collector last ticked, ms; `None` if it never did (or the value
/// is corrupt).
pub fn last(store: &dyn Store) -> Result<Option<u64>, StoreError> {
    Ok(store
        .get(COLLECTOR_TICK_KEY)?
        .and_then(|(bytes, _)| Reader::new(&bytes).u64()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::MemoryStore;

    #[test]
    fn absent_until_stamped_then_the_newest_stamp() {
        let store = MemoryStore::new();
        assert_eq!(last(&store), Ok(None));
        stamp(&store, 1_000).unwrap();
        stamp(&store, 1_250).unwrap();
        assert_eq!(last(&store), Ok(Some(1_250)));
        store.set(COLLECTOR_TICK_KEY, &[1, 2], 0).unwrap();
        assert_eq!(last(&store), Ok(None), "a short value reads as absent");
    }
}

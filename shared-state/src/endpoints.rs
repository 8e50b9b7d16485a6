//! The endpoint table: which model servers exist, their slot and health.
//!
//! Each endpoint gets a *slot* (its index in the load and metrics tables and
//! in prefix-index entries) and the slot's *generation*. When an endpoint
//! leaves, its slot is freed; when a slot is reused, its generation goes up,
//! so index entries and in-flight releases that name the old generation no
//! longer count. The collector is the only writer.

use crate::codec::{Reader, Writer};
use crate::MAX_ENDPOINTS;

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EndpointEntry {
    /// `ip:port`, as written in the destination header.
    pub address: String,
    pub slot: u16,
    pub generation: u16,
    pub healthy: bool,
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct EndpointTable {
    /// Bumped on every change.
    pub version: u64,
    pub endpoints: Vec<EndpointEntry>,
    /// The generation last used by each slot (index = slot), kept for slots
    /// that are free now, so reuse gets a fresh generation.
    pub slot_generations: Vec<u16>,
}

const MAGIC: u8 = 0xE1;

impl EndpointTable {
    pub fn encode(&self) -> Vec<u8> {
        let mut w =
            Writer::with_capacity(16 + self.endpoints.len() * 32 + self.slot_generations.len() * 2);
        w.u8(MAGIC);
        w.u64(self.version);
        w.u16(self.endpoints.len() as u16);
        for e in &self.endpoints {
            w.bytes(e.address.as_bytes());
            w.u16(e.slot);
            w.u16(e.generation);
            w.u8(u8::from(e.healthy));
        }
        w.u16(self.slot_generations.len() as u16);
        for g in &self.slot_generations {
            w.u16(*g);
        }
        w.buf
    }

    /// `None` for a missing or corrupt value.
    pub fn decode(bytes: &[u8]) -> Option<EndpointTable> {
        let mut r = Reader::new(bytes);
        if r.u8()? != MAGIC {
            return None;
        }
        let version = r.u64()?;
        let n = r.u16()? as usize;
        let mut endpoints = Vec::with_capacity(n.min(MAX_ENDPOINTS));
        for _ in 0..n {
            let address = String::from_utf8(r.bytes()?.to_vec()).ok()?;
            let slot = r.u16()?;
            let generation = r.u16()?;
            let healthy = r.u8()? != 0;
            endpoints.push(EndpointEntry {
                address,
                slot,
                generation,
                healthy,
            });
        }
        let g = r.u16()? as usize;
        let mut slot_generations = Vec::with_capacity(g.min(MAX_ENDPOINTS));
        for _ in 0..g {
            slot_generations.push(r.u16()?);
        }
        Some(EndpointTable {
            version,
            endpoints,
            slot_generations,
        })
    }

    /// The table for a static list: slot i, generation 1, healthy. Filters
    /// use it before the collector has written a table.
    pub fn from_static(addresses: &[String]) -> EndpointTable {
        let mut t = EndpointTable::default();
        t.apply_membership(addresses.iter().map(|a| (a.clone(), true)));
        t
    }

    /// Makes the table list exactly `members` (address, healthy), keeping the
    /// slots of endpoints that stay. Returns true if anything changed.
    /// At most [`MAX_ENDPOINTS`] members are kept.
    pub fn apply_membership(&mut self, members: impl IntoIterator<Item = (String, bool)>) -> bool {
        let mut wanted: Vec<(String, bool)> = Vec::new();
        for (a, h) in members {
            if wanted.len() < MAX_ENDPOINTS && !wanted.iter().any(|(w, _)| *w == a) {
                wanted.push((a, h));
            }
        }
        let before = self.endpoints.clone();
        // Drop leavers.
        self.endpoints
            .retain(|e| wanted.iter().any(|(a, _)| *a == e.address));
        // Update health, add joiners at the lowest free slot.
        for (addr, healthy) in wanted {
            if let Some(e) = self.endpoints.iter_mut().find(|e| e.address == addr) {
                e.healthy = healthy;
                continue;
            }
            let used: Vec<u16> = self.endpoints.iter().map(|e| e.slot).collect();
            let slot = (0..MAX_ENDPOINTS as u16)
                .find(|s| !used.contains(s))
                .unwrap_or(0);
            let s = slot as usize;
            if self.slot_generations.len() <= s {
                self.slot_generations.resize(s + 1, 0);
            }
            let generation = self.slot_generations[s].wrapping_add(1).max(1);
            self.slot_generations[s] = generation;
            self.endpoints.push(EndpointEntry {
                address: addr,
                slot,
                generation,
                healthy,
            });
        }
        let changed = self.endpoints != before;
        if changed {
            self.version += 1;
        }
        changed
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn members(list: &[(&str, bool)]) -> Vec<(String, bool)> {
        list.iter().map(|(a, h)| (a.to_string(), *h)).collect()
    }

    #[test]
    fn slots_are_stable_and_reuse_bumps_generation() {
        let mut t = EndpointTable::default();
        assert!(t.apply_membership(members(&[("a:1", true), ("b:1", true)])));
        assert_eq!((t.endpoints[0].slot, t.endpoints[1].slot), (0, 1));
        assert!(!t.apply_membership(members(&[("a:1", true), ("b:1", true)])));
        // a leaves, c joins and takes slot 0 with generation 2.
        assert!(t.apply_membership(members(&[("b:1", true), ("c:1", true)])));
        let c = t.endpoints.iter().find(|e| e.address == "c:1").unwrap();
        assert_eq!((c.slot, c.generation), (0, 2));
        let b = t.endpoints.iter().find(|e| e.address == "b:1").unwrap();
        assert_eq!((b.slot, b.generation), (1, 1));
        // Health changes are changes.
        assert!(t.apply_membership(members(&[("b:1", false), ("c:1", true)])));
        assert_eq!(t.version, 3);
    }

    #[test]
    fn round_trip_and_corruption() {
        let t = EndpointTable::from_static(&["127.0.0.1:1".into(), "[::1]:2".into()]);
        let enc = t.encode();
        assert_eq!(EndpointTable::decode(&enc), Some(t));
        for cut in 0..enc.len() {
            assert_eq!(EndpointTable::decode(&enc[..cut]), None);
        }
        assert_eq!(EndpointTable::decode(b"garbage"), None);
    }
}

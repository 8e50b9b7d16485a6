//! An in-memory [`Store`] with Envoy's semantics, for native tests and the
//! simulator: a process-wide CAS counter, CAS 0 = unconditional, no delete,
//! copy on get. It can also inject CAS conflicts.

use crate::{Store, StoreError};
use std::cell::{Cell, RefCell};
use std::collections::HashMap;

#[derive(Default)]
pub struct MemoryStore {
    map: RefCell<HashMap<String, (Vec<u8>, u32)>>,
    next_cas: Cell<u32>,
    /// The next this-many CAS sets fail with `CasMismatch` (test hook).
    pub inject_conflicts: Cell<u32>,
}

impl MemoryStore {
    pub fn new() -> Self {
        Self::default()
    }

    /// Bytes held in values (keys excluded), and the number of keys.
    pub fn usage(&self) -> (usize, usize) {
        let m = self.map.borrow();
        (m.values().map(|(v, _)| v.len()).sum(), m.len())
    }

    /// Bytes held under keys with this prefix.
    pub fn bytes_with_prefix(&self, prefix: &str) -> usize {
        self.map
            .borrow()
            .iter()
            .filter(|(k, _)| k.starts_with(prefix))
            .map(|(_, (v, _))| v.len())
            .sum()
    }
}

impl Store for MemoryStore {
    fn get(&self, key: &str) -> Result<Option<(Vec<u8>, u32)>, StoreError> {
        Ok(self.map.borrow().get(key).cloned())
    }

    fn set(&self, key: &str, value: &[u8], cas: u32) -> Result<(), StoreError> {
        if cas != 0 && self.inject_conflicts.get() > 0 {
            self.inject_conflicts.set(self.inject_conflicts.get() - 1);
            return Err(StoreError::CasMismatch);
        }
        let mut m = self.map.borrow_mut();
        if let Some((_, cur)) = m.get(key) {
            if cas != 0 && cas != *cur {
                return Err(StoreError::CasMismatch);
            }
        }
        let next = self.next_cas.get().wrapping_add(1).max(1);
        self.next_cas.set(next);
        m.insert(key.to_string(), (value.to_vec(), next));
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cas::update;

    #[test]
    fn cas_semantics() {
        let s = MemoryStore::new();
        assert_eq!(s.get("k").unwrap(), None);
        s.set("k", b"a", 0).unwrap();
        let (_, c1) = s.get("k").unwrap().unwrap();
        s.set("k", b"b", c1).unwrap();
        assert_eq!(s.set("k", b"c", c1), Err(StoreError::CasMismatch));
        s.set("k", b"d", 0).unwrap();
        assert_eq!(s.get("k").unwrap().unwrap().0, b"d");
    }

    #[test]
    fn update_retries_on_conflict() {
        let s = MemoryStore::new();
        s.set("n", &0u64.to_le_bytes(), 0).unwrap();
        s.inject_conflicts.set(3);
        let dec = |b: Option<&[u8]>| {
            b.and_then(|b| b.try_into().ok())
                .map(u64::from_le_bytes)
                .unwrap_or(0)
        };
        let enc = |v: &u64| v.to_le_bytes().to_vec();
        let u = update(&s, "n", dec, enc, |v| {
            *v += 1;
            Some(*v)
        })
        .unwrap();
        assert_eq!(
            u,
            crate::cas::Updated {
                result: Some(1),
                retries: 3
            }
        );
    }
}

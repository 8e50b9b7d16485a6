//! Envoy's process-wide shared data and shared queues.
//!
//! Semantics follow proxy-wasm-cpp-host's `SharedData`, which Envoy uses:
//! - one key space per `vm_id`;
//! - one CAS counter for the whole process, starting at 1, bumped on every
//!   successful set and skipping 0 on wrap-around;
//! - `set(key, value, cas)`: if the key exists and `cas != 0` and `cas` is not
//!   the entry's current CAS → `CasMismatch`; otherwise the value is stored
//!   with a fresh CAS. A set on a missing key always succeeds, whatever `cas`;
//! - no deletion and no key listing in ABI 0.2.1;
//! - get copies the value out (the host copies it into the VM's memory).
//!
//! Queues: one token per (vm_id, name), handed out on register; resolve by
//! (vm_id, name), 0 = not found; enqueue wakes the registering root context
//! with `proxy_on_queue_ready`, which Envoy posts to that VM's thread (so it
//! runs later, never inside the enqueuing call).

use crate::abi::Status;
use std::collections::{BTreeMap, HashMap, VecDeque};

#[derive(Default)]
pub struct SharedData {
    /// vm_id → key → (value, cas)
    spaces: HashMap<String, BTreeMap<String, (Vec<u8>, u32)>>,
    next_cas: u32,
    /// Number of sets refused with `CasMismatch`, for tests.
    pub cas_mismatches: u64,
    /// Conditional sets that must fail whatever their CAS (injected conflicts):
    /// (vm_id, key prefix, remaining count).
    forced_mismatches: Vec<(String, String, u32)>,
}

impl SharedData {
    pub fn new() -> SharedData {
        SharedData {
            next_cas: 1,
            ..Default::default()
        }
    }

    fn bump_cas(&mut self) -> u32 {
        let cas = self.next_cas;
        self.next_cas = self.next_cas.wrapping_add(1);
        if self.next_cas == 0 {
            self.next_cas = 1;
        }
        cas
    }

    pub fn get(&self, vm_id: &str, key: &str) -> Option<(Vec<u8>, u32)> {
        self.spaces.get(vm_id)?.get(key).cloned()
    }

    pub fn set(&mut self, vm_id: &str, key: &str, value: &[u8], cas: u32) -> Status {
        if cas != 0 && self.take_forced_mismatch(vm_id, key) {
            // An invisible writer got there first: the entry gets a new CAS
            // (same bytes), exactly as if another worker had rewritten it.
            let fresh = self.bump_cas();
            if let Some(entry) = self.spaces.get_mut(vm_id).and_then(|s| s.get_mut(key)) {
                entry.1 = fresh;
            }
            self.cas_mismatches += 1;
            return Status::CasMismatch;
        }
        let fresh = self.next_cas;
        let space = self.spaces.entry(vm_id.to_string()).or_default();
        match space.get_mut(key) {
            Some(entry) => {
                if cas != 0 && cas != entry.1 {
                    self.cas_mismatches += 1;
                    return Status::CasMismatch;
                }
                *entry = (value.to_vec(), fresh);
            }
            None => {
                space.insert(key.to_string(), (value.to_vec(), fresh));
            }
        }
        self.bump_cas();
        Status::Ok
    }

    /// Makes the next `count` conditional sets (cas ≠ 0) on keys starting with
    /// `key_prefix` in `vm_id` fail with `CasMismatch`.
    pub fn force_cas_mismatch(&mut self, vm_id: &str, key_prefix: &str, count: u32) {
        self.forced_mismatches
            .push((vm_id.to_string(), key_prefix.to_string(), count));
    }

    fn take_forced_mismatch(&mut self, vm_id: &str, key: &str) -> bool {
        for entry in self.forced_mismatches.iter_mut() {
            if entry.0 == vm_id && key.starts_with(&entry.1) && entry.2 > 0 {
                entry.2 -= 1;
                return true;
            }
        }
        false
    }

    /// Keys of one vm_id, in order (a test view; the ABI has no listing).
    pub fn keys(&self, vm_id: &str) -> Vec<String> {
        self.spaces
            .get(vm_id)
            .map(|s| s.keys().cloned().collect())
            .unwrap_or_default()
    }

    /// Bytes held for one vm_id: keys plus values.
    pub fn bytes_held(&self, vm_id: &str) -> usize {
        self.spaces
            .get(vm_id)
            .map(|s| s.iter().map(|(k, (v, _))| k.len() + v.len()).sum())
            .unwrap_or(0)
    }
}

/// Who gets `proxy_on_queue_ready` for a queue: (vm index, root context id).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QueueOwner {
    pub vm: usize,
    pub root_context: u32,
}

#[derive(Default)]
pub struct SharedQueues {
    tokens: HashMap<(String, String), u32>,
    queues: HashMap<u32, (QueueOwner, VecDeque<Vec<u8>>)>,
    next_token: u32,
    /// Wake-ups Envoy would post to the owner's thread, not yet delivered.
    pub pending_ready: VecDeque<(QueueOwner, u32)>,
}

impl SharedQueues {
    pub fn register(&mut self, vm_id: &str, name: &str, owner: QueueOwner) -> u32 {
        let key = (vm_id.to_string(), name.to_string());
        let token = match self.tokens.get(&key) {
            Some(t) => *t,
            None => {
                self.next_token += 1;
                self.tokens.insert(key, self.next_token);
                self.next_token
            }
        };
        // Re-registering moves the wake-ups to the new owner and keeps the data.
        let entry = self
            .queues
            .entry(token)
            .or_insert_with(|| (owner, VecDeque::new()));
        entry.0 = owner;
        token
    }

    pub fn resolve(&self, vm_id: &str, name: &str) -> Option<u32> {
        self.tokens
            .get(&(vm_id.to_string(), name.to_string()))
            .copied()
    }

    pub fn enqueue(&mut self, token: u32, value: &[u8]) -> Status {
        match self.queues.get_mut(&token) {
            None => Status::NotFound,
            Some((owner, q)) => {
                q.push_back(value.to_vec());
                let owner = *owner;
                self.pending_ready.push_back((owner, token));
                Status::Ok
            }
        }
    }

    pub fn dequeue(&mut self, token: u32) -> Result<Vec<u8>, Status> {
        match self.queues.get_mut(&token) {
            None => Err(Status::NotFound),
            Some((_, q)) => q.pop_front().ok_or(Status::Empty),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cas_follows_envoy() {
        let mut sd = SharedData::new();
        assert_eq!(sd.get("vm", "k"), None);
        // A set with a non-zero CAS on a missing key succeeds.
        assert_eq!(sd.set("vm", "k", b"a", 77), Status::Ok);
        let (v, cas1) = sd.get("vm", "k").unwrap();
        assert_eq!(v, b"a");
        assert_eq!(sd.set("vm", "k", b"b", cas1), Status::Ok);
        // The old CAS is now stale.
        assert_eq!(sd.set("vm", "k", b"c", cas1), Status::CasMismatch);
        // cas 0 is unconditional.
        assert_eq!(sd.set("vm", "k", b"d", 0), Status::Ok);
        assert_eq!(sd.get("vm", "k").unwrap().0, b"d");
        // One counter for the whole process: another vm_id sees higher CASes.
        assert_eq!(sd.set("other", "k", b"x", 0), Status::Ok);
        assert!(sd.get("other", "k").unwrap().1 > sd.get("vm", "k").unwrap().1);
        assert_eq!(sd.get("other", "nope"), None);
    }

    #[test]
    fn forced_mismatch_bumps_cas() {
        let mut sd = SharedData::new();
        sd.set("vm", "load/a", b"1", 0);
        let (_, cas) = sd.get("vm", "load/a").unwrap();
        sd.force_cas_mismatch("vm", "load/", 1);
        assert_eq!(sd.set("vm", "load/a", b"2", cas), Status::CasMismatch);
        let (v, cas2) = sd.get("vm", "load/a").unwrap();
        assert_eq!(v, b"1");
        assert_ne!(cas, cas2);
        assert_eq!(sd.set("vm", "load/a", b"2", cas2), Status::Ok);
    }

    #[test]
    fn queues_wake_the_owner() {
        let mut q = SharedQueues::default();
        let owner = QueueOwner {
            vm: 3,
            root_context: 1,
        };
        let t = q.register("vm", "events", owner);
        assert_eq!(q.resolve("vm", "events"), Some(t));
        assert_eq!(q.resolve("other", "events"), None);
        assert_eq!(q.dequeue(t), Err(Status::Empty));
        assert_eq!(q.enqueue(t, b"x"), Status::Ok);
        assert_eq!(q.pending_ready.pop_front(), Some((owner, t)));
        assert_eq!(q.dequeue(t), Ok(b"x".to_vec()));
        assert_eq!(q.enqueue(999, b"x"), Status::NotFound);
    }
}

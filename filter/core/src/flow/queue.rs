//! One worker's waiting requests: priority bands, flows within a band,
//! requests within a flow.
//!
//! A request's stream belongs to the worker VM that paused it, so each
//! worker keeps its own queue; what the workers of one Envoy must agree on
//! (which band goes first, who waited longest, the bounds) goes through the
//! board in shared data (`flow::board`).
//!
//! Dispatch order inside a worker: the highest-priority band with a waiting
//! request; in it, the band's fairness policy picks a flow (round robin
//! over the flows with waiting requests, or global strict: the flow whose
//! candidate arrived first); in the flow, the ordering policy picks the
//! request (FCFS: the first to arrive; EDF: the earliest deadline, ties by
//! arrival).

use super::{Fairness, Ordering};
use std::collections::VecDeque;

/// A waiting request.
#[derive(Debug)]
pub struct Entry<T> {
    /// The stream's context id (unique among this worker's live streams).
    pub id: u32,
    /// Index of its band in [`super::FlowConfig::bands`].
    pub band: usize,
    pub flow: String,
    pub enqueued_ms: u64,
    /// When it is shed if still waiting.
    pub deadline_ms: u64,
    /// Its body's bytes (the bands' `maxBytes`).
    pub bytes: u64,
    /// Arrival order in this worker (ties and global strict fairness).
    pub seq: u64,
    pub item: T,
}

struct Flow<T> {
    id: String,
    entries: VecDeque<Entry<T>>,
}

struct Band<T> {
    fairness: Fairness,
    ordering: Ordering,
    flows: Vec<Flow<T>>,
    /// Round robin: the flow served next (an index into `flows`).
    next: usize,
    requests: u64,
    bytes: u64,
}

impl<T> Band<T> {
    /// The flow and the index in it of the request this band would serve.
    fn pick(&self) -> Option<(usize, usize)> {
        if self.flows.is_empty() {
            return None;
        }
        let in_flow = |f: &Flow<T>| -> usize {
            match self.ordering {
                Ordering::Fcfs => 0,
                Ordering::Edf => f
                    .entries
                    .iter()
                    .enumerate()
                    .min_by_key(|(_, e)| (e.deadline_ms, e.seq))
                    .map_or(0, |(i, _)| i),
            }
        };
        let flow = match self.fairness {
            Fairness::RoundRobin => self.next % self.flows.len(),
            Fairness::GlobalStrict => self
                .flows
                .iter()
                .enumerate()
                .min_by_key(|(_, f)| {
                    let e = &f.entries[in_flow(f)];
                    match self.ordering {
                        Ordering::Fcfs => (e.seq, 0),
                        Ordering::Edf => (e.deadline_ms, e.seq),
                    }
                })
                .map_or(0, |(i, _)| i),
        };
        Some((flow, in_flow(&self.flows[flow])))
    }
}

/// A worker's queue. Bands are kept in the config's order (highest priority
/// first).
pub struct Queue<T> {
    bands: Vec<Band<T>>,
    seq: u64,
}

/// Per band: waiting requests, their bytes and the earliest arrival.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BandLoad {
    pub requests: u64,
    pub bytes: u64,
    /// The earliest `enqueued_ms` of the band's waiting requests (0: none).
    pub oldest_ms: u64,
}

impl<T> Queue<T> {
    pub fn new(policies: &[(Fairness, Ordering)]) -> Queue<T> {
        Queue {
            bands: policies
                .iter()
                .map(|&(fairness, ordering)| Band {
                    fairness,
                    ordering,
                    flows: Vec::new(),
                    next: 0,
                    requests: 0,
                    bytes: 0,
                })
                .collect(),
            seq: 0,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.bands.iter().all(|b| b.requests == 0)
    }

    pub fn len(&self) -> usize {
        self.bands.iter().map(|b| b.requests as usize).sum()
    }

    /// Adds a request (its `seq` is set here). An out-of-range band goes
    /// to the last (lowest) band.
    pub fn push(&mut self, mut e: Entry<T>) {
        e.band = e.band.min(self.bands.len().saturating_sub(1));
        e.seq = self.seq;
        self.seq += 1;
        let Some(band) = self.bands.get_mut(e.band) else {
            return;
        };
        band.requests += 1;
        band.bytes += e.bytes;
        match band.flows.iter_mut().find(|f| f.id == e.flow) {
            Some(f) => f.entries.push_back(e),
            None => band.flows.push(Flow {
                id: e.flow.clone(),
                entries: VecDeque::from([e]),
            }),
        }
    }

    /// The request dispatch would take next: its band and entry.
    pub fn head(&self) -> Option<&Entry<T>> {
        self.bands.iter().find_map(|b| {
            b.pick()
                .and_then(|(f, i)| b.flows.get(f).and_then(|f| f.entries.get(i)))
        })
    }

    /// Takes [`head`](Self::head) out; round robin moves to the next flow.
    pub fn pop_head(&mut self) -> Option<Entry<T>> {
        let b = self.bands.iter().position(|b| b.requests > 0)?;
        let band = &mut self.bands[b];
        let (f, i) = band.pick()?;
        let e = band.flows[f].entries.remove(i)?;
        band.requests -= 1;
        band.bytes -= e.bytes;
        if band.flows[f].entries.is_empty() {
            band.flows.remove(f);
            // The flow after the served one is now at index f.
            band.next = f;
        } else {
            band.next = f + 1;
        }
        if !band.flows.is_empty() {
            band.next %= band.flows.len();
        } else {
            band.next = 0;
        }
        Some(e)
    }

    /// Takes a request out by id (the client went away, or it is shed).
    pub fn remove(&mut self, id: u32) -> Option<Entry<T>> {
        for band in &mut self.bands {
            for f in 0..band.flows.len() {
                if let Some(i) = band.flows[f].entries.iter().position(|e| e.id == id) {
                    let e = band.flows[f].entries.remove(i)?;
                    band.requests -= 1;
                    band.bytes -= e.bytes;
                    if band.flows[f].entries.is_empty() {
                        band.flows.remove(f);
                        if band.next > f {
                            band.next -= 1;
                        }
                        if band.flows.is_empty() {
                            band.next = 0;
                        } else {
                            band.next %= band.flows.len();
                        }
                    }
                    return Some(e);
                }
            }
        }
        None
    }

    /// Takes out every request `pred` picks (expiry).
    pub fn take_if(&mut self, pred: impl Fn(&Entry<T>) -> bool) -> Vec<Entry<T>> {
        let ids: Vec<u32> = self
            .bands
            .iter()
            .flat_map(|b| b.flows.iter())
            .flat_map(|f| f.entries.iter())
            .filter(|e| pred(e))
            .map(|e| e.id)
            .collect();
        ids.into_iter().filter_map(|id| self.remove(id)).collect()
    }

    /// Takes out every request (the worker is going away).
    pub fn drain(&mut self) -> Vec<Entry<T>> {
        let ids: Vec<u32> = self
            .bands
            .iter()
            .flat_map(|b| b.flows.iter())
            .flat_map(|f| f.entries.iter())
            .map(|e| e.id)
            .collect();
        ids.into_iter().filter_map(|id| self.remove(id)).collect()
    }

    /// Per band: what waits here.
    pub fn loads(&self) -> Vec<BandLoad> {
        self.bands
            .iter()
            .map(|b| BandLoad {
                requests: b.requests,
                bytes: b.bytes,
                oldest_ms: b
                    .flows
                    .iter()
                    .flat_map(|f| f.entries.iter())
                    .map(|e| e.enqueued_ms)
                    .min()
                    .unwrap_or(0),
            })
            .collect()
    }
}

//! The board: what each worker of this Envoy has waiting, per band, in one
//! shared-data value (`kvroute/flow/board`), so that the workers agree on
//! which band goes first, who waited longest, and the queue bounds.
//!
//! Each worker writes only its own record (CAS on the one value), when its
//! queue changes and on every flow tick while it has requests waiting; a
//! record not written for [`STALE_MS`] is ignored (its worker is gone or
//! stuck), and an empty one is removed. At most [`MAX_RECORDS`] records:
//! a new worker beyond that replaces the stalest. The value stays under
//! `MAX_RECORDS × (17 + 20 × bands)` bytes (a test shows it).

use super::queue::BandLoad;
use kvroute_shared_state::cas::update;
use kvroute_shared_state::{Store, StoreError};

pub const BOARD_KEY: &str = "kvroute/flow/board";
/// A record older than this is ignored (a queueing worker rewrites its own
/// every flow tick).
pub const STALE_MS: u64 = 1_000;
pub const MAX_RECORDS: usize = 64;
const VERSION: u8 = 1;

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Record {
    pub worker: u64,
    pub updated_ms: u64,
    pub bands: Vec<BandLoad>,
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Board {
    pub records: Vec<Record>,
}

impl Board {
    pub fn decode(bytes: Option<&[u8]>) -> Board {
        let Some(b) = bytes else {
            return Board::default();
        };
        let mut r = Reader { b, at: 0 };
        let mut board = Board::default();
        if r.u8() != Some(VERSION) {
            return board;
        }
        let Some(n) = r.u8() else {
            return board;
        };
        for _ in 0..n.min(MAX_RECORDS as u8) {
            let (Some(worker), Some(updated_ms), Some(nb)) = (r.u64(), r.u64(), r.u8()) else {
                return Board::default();
            };
            let mut bands = Vec::with_capacity(nb as usize);
            for _ in 0..nb {
                let (Some(q), Some(bytes), Some(oldest_ms)) = (r.u32(), r.u64(), r.u64()) else {
                    return Board::default();
                };
                bands.push(BandLoad {
                    requests: u64::from(q),
                    bytes,
                    oldest_ms,
                });
            }
            board.records.push(Record {
                worker,
                updated_ms,
                bands,
            });
        }
        board
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut out = vec![VERSION, self.records.len().min(MAX_RECORDS) as u8];
        for rec in self.records.iter().take(MAX_RECORDS) {
            out.extend_from_slice(&rec.worker.to_le_bytes());
            out.extend_from_slice(&rec.updated_ms.to_le_bytes());
            out.push(rec.bands.len().min(255) as u8);
            for b in rec.bands.iter().take(255) {
                out.extend_from_slice(&(b.requests.min(u64::from(u32::MAX)) as u32).to_le_bytes());
                out.extend_from_slice(&b.bytes.to_le_bytes());
                out.extend_from_slice(&b.oldest_ms.to_le_bytes());
            }
        }
        out
    }

    /// Sets `worker`'s record (removed when nothing waits there), drops
    /// stale empty ones, and keeps at most [`MAX_RECORDS`].
    pub fn put(&mut self, worker: u64, now_ms: u64, bands: &[BandLoad]) {
        self.records.retain(|r| r.worker != worker);
        self.records
            .retain(|r| now_ms.saturating_sub(r.updated_ms) <= STALE_MS * 10);
        if bands.iter().any(|b| b.requests > 0) {
            if self.records.len() >= MAX_RECORDS {
                if let Some(i) = self
                    .records
                    .iter()
                    .enumerate()
                    .min_by_key(|(_, r)| r.updated_ms)
                    .map(|(i, _)| i)
                {
                    self.records.remove(i);
                }
            }
            self.records.push(Record {
                worker,
                updated_ms: now_ms,
                bands: bands.to_vec(),
            });
        }
    }

    /// What the other workers have waiting (fresh records only), per band.
    pub fn others(&self, me: u64, now_ms: u64, bands: usize) -> Vec<BandLoad> {
        let mut out = vec![BandLoad::default(); bands];
        for r in &self.records {
            if r.worker == me || now_ms.saturating_sub(r.updated_ms) > STALE_MS {
                continue;
            }
            for (o, b) in out.iter_mut().zip(&r.bands) {
                if b.requests == 0 {
                    continue;
                }
                o.requests += b.requests;
                o.bytes += b.bytes;
                if o.oldest_ms == 0 || (b.oldest_ms != 0 && b.oldest_ms < o.oldest_ms) {
                    o.oldest_ms = b.oldest_ms;
                }
            }
        }
        out
    }
}

/// Reads the board (an unreadable value is an empty board).
pub fn read(store: &dyn Store) -> Result<Board, StoreError> {
    Ok(Board::decode(
        store.get(BOARD_KEY)?.as_ref().map(|(b, _)| b.as_slice()),
    ))
}

/// Writes this worker's record; returns the CAS retries and what waits in
/// the whole Envoy per band (every fresh record, this one included).
pub fn publish(
    store: &dyn Store,
    worker: u64,
    now_ms: u64,
    bands: &[BandLoad],
) -> Result<(u32, Vec<BandLoad>), StoreError> {
    let r = update(
        store,
        BOARD_KEY,
        Board::decode,
        Board::encode,
        |b: &mut Board| {
            b.put(worker, now_ms, bands);
            let mut all = b.others(worker, now_ms, bands.len());
            for (a, mine) in all.iter_mut().zip(bands) {
                a.requests += mine.requests;
                a.bytes += mine.bytes;
            }
            Some(all)
        },
    )?;
    Ok((r.retries, r.result.unwrap_or_default()))
}

struct Reader<'a> {
    b: &'a [u8],
    at: usize,
}

impl Reader<'_> {
    fn take<const N: usize>(&mut self) -> Option<[u8; N]> {
        let s = self.b.get(self.at..self.at + N)?;
        self.at += N;
        s.try_into().ok()
    }
    fn u8(&mut self) -> Option<u8> {
        self.take::<1>().map(|b| b[0])
    }
    fn u32(&mut self) -> Option<u32> {
        self.take::<4>().map(u32::from_le_bytes)
    }
    fn u64(&mut self) -> Option<u64> {
        self.take::<8>().map(u64::from_le_bytes)
    }
}

//! The last polled vLLM metrics per endpoint, written by the collector only.
//!
//! A failed poll (timeout, 5xx, garbage) keeps the previous values and only
//! bumps `failures`; readers judge freshness from `ok_at_ms`.

use crate::codec::{Reader, Writer};
use crate::MAX_ENDPOINTS;

#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct MetricsSnapshot {
    pub generation: u16,
    /// ms; when the last successful poll finished (0 = never)
    pub ok_at_ms: u64,
    /// ms; when the last poll (any outcome) finished
    pub attempted_at_ms: u64,
    /// consecutive failed polls
    pub failures: u32,
    /// `vllm:num_requests_waiting`
    pub waiting: f64,
    /// `vllm:num_requests_running`
    pub running: f64,
    /// `vllm:kv_cache_usage_perc`, 0–1
    pub kv_cache_usage: f64,
    /// tokens per vLLM block (`vllm:cache_config_info{block_size}`), 0 = unknown
    pub block_size: u32,
    /// `vllm:cache_config_info{num_gpu_blocks}`, 0 = unknown
    pub num_gpu_blocks: u64,
    /// `vllm:prefix_cache_queries_total` (tokens)
    pub prefix_queries: f64,
    /// `vllm:prefix_cache_hits_total` (tokens)
    pub prefix_hits: f64,
    /// The online prefill-throughput estimate and its window baseline
    /// (`kvroute_core::learners::prefill_rate`).
    pub prefill: PrefillRate,
    /// Bytes per token: routed prompt bytes over `vllm:prompt_tokens_total`
    /// (`kvroute_core::learners::bytes_per_token`).
    pub bytes_per_token: RatioLearner,
    /// Output tokens per finished request: `vllm:request_generation_tokens`
    /// sum over count (`kvroute_core::learners::output_tokens`).
    pub output_tokens: RatioLearner,
}

/// Samples a ratio learner keeps per endpoint.
pub const RATIO_SAMPLES: usize = 9;

/// The collector's learner of one ratio of two growing totals
/// (`kvroute_core::learners::ratio`) for one endpoint: the window's
/// baseline and a ring of the last samples (as f32 bits).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct RatioLearner {
    /// A baseline has been taken.
    pub based: bool,
    /// The denominator's total at the window start.
    pub base_den: f64,
    /// The numerator's total at the window start.
    pub base_num: f64,
    pub samples: [f32; RATIO_SAMPLES],
    /// Samples kept (≤ `RATIO_SAMPLES`).
    pub count: u8,
    /// Where the next sample goes.
    pub next: u8,
}

impl RatioLearner {
    fn write(&self, w: &mut Writer) {
        w.u8(u8::from(self.based));
        w.f64(self.base_den);
        w.f64(self.base_num);
        for x in &self.samples {
            w.u32(x.to_bits());
        }
        w.u8(self.count);
        w.u8(self.next);
    }

    fn read(r: &mut Reader) -> Option<RatioLearner> {
        let based = r.u8()? != 0;
        let base_den = r.f64()?;
        let base_num = r.f64()?;
        let mut samples = [0f32; RATIO_SAMPLES];
        for x in samples.iter_mut() {
            *x = f32::from_bits(r.u32()?);
        }
        Some(RatioLearner {
            based,
            base_den,
            base_num,
            samples,
            count: r.u8()?.min(RATIO_SAMPLES as u8),
            next: r.u8()? % RATIO_SAMPLES as u8,
        })
    }
}

/// The collector's prefill-throughput estimate for one endpoint, kept in
/// shared data so a collector that takes over (lease mode) continues it.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct PrefillRate {
    /// Σ `vllm:request_prefill_kv_computed_tokens` (tokens) at the window start.
    pub base_tokens: f64,
    /// Σ `vllm:request_prefill_time_seconds` (s) at the window start.
    pub base_seconds: f64,
    /// Requests counted by both histograms at the window start.
    pub base_count: f64,
    /// ms; when the window started (0 = no baseline yet).
    pub base_at_ms: u64,
    /// The smoothed, bounded estimate, tokens/s (0 = none yet).
    pub tokens_per_s: f64,
    /// ms; when the estimate last changed (0 = never).
    pub updated_at_ms: u64,
    /// Windows that fed the estimate.
    pub samples: u32,
}

impl PrefillRate {
    /// The estimate, if at least one window fed it.
    pub fn estimate(&self) -> Option<f64> {
        (self.samples > 0 && self.tokens_per_s > 0.0).then_some(self.tokens_per_s)
    }
}

impl MetricsSnapshot {
    /// True when the last successful poll is at most `stale_after_ms` old.
    pub fn is_fresh(&self, now_ms: u64, stale_after_ms: u64) -> bool {
        self.ok_at_ms != 0 && now_ms.saturating_sub(self.ok_at_ms) <= stale_after_ms
    }

    /// KV capacity in tokens (`num_gpu_blocks × block_size`), if known.
    pub fn capacity_tokens(&self) -> Option<u64> {
        (self.block_size > 0 && self.num_gpu_blocks > 0).then(|| {
            self.num_gpu_blocks
                .saturating_mul(u64::from(self.block_size))
        })
    }
}

#[derive(Clone, Debug, Default, PartialEq)]
pub struct MetricsTable {
    pub slots: Vec<MetricsSnapshot>,
}

/// One slot's encoded size.
const SLOT_BYTES: usize = 236;

/// Bumped when the layout changes, so a table of another layout reads as empty.
const MAGIC: u8 = 0x41;

impl MetricsTable {
    pub fn encode(&self) -> Vec<u8> {
        let mut w = Writer::with_capacity(3 + self.slots.len() * SLOT_BYTES);
        w.u8(MAGIC);
        w.u16(self.slots.len() as u16);
        for m in &self.slots {
            w.u16(m.generation);
            w.u64(m.ok_at_ms);
            w.u64(m.attempted_at_ms);
            w.u32(m.failures);
            w.f64(m.waiting);
            w.f64(m.running);
            w.f64(m.kv_cache_usage);
            w.u32(m.block_size);
            w.u64(m.num_gpu_blocks);
            w.f64(m.prefix_queries);
            w.f64(m.prefix_hits);
            let p = &m.prefill;
            w.f64(p.base_tokens);
            w.f64(p.base_seconds);
            w.f64(p.base_count);
            w.u64(p.base_at_ms);
            w.f64(p.tokens_per_s);
            w.u64(p.updated_at_ms);
            w.u32(p.samples);
            m.bytes_per_token.write(&mut w);
            m.output_tokens.write(&mut w);
        }
        w.buf
    }

    pub fn decode(bytes: Option<&[u8]>) -> MetricsTable {
        bytes.and_then(Self::try_decode).unwrap_or_default()
    }

    fn try_decode(bytes: &[u8]) -> Option<MetricsTable> {
        let mut r = Reader::new(bytes);
        if r.u8()? != MAGIC {
            return None;
        }
        let n = r.u16()? as usize;
        if n > MAX_ENDPOINTS {
            return None;
        }
        let mut slots = Vec::with_capacity(n);
        for _ in 0..n {
            slots.push(MetricsSnapshot {
                generation: r.u16()?,
                ok_at_ms: r.u64()?,
                attempted_at_ms: r.u64()?,
                failures: r.u32()?,
                waiting: r.f64()?,
                running: r.f64()?,
                kv_cache_usage: r.f64()?,
                block_size: r.u32()?,
                num_gpu_blocks: r.u64()?,
                prefix_queries: r.f64()?,
                prefix_hits: r.f64()?,
                prefill: PrefillRate {
                    base_tokens: r.f64()?,
                    base_seconds: r.f64()?,
                    base_count: r.f64()?,
                    base_at_ms: r.u64()?,
                    tokens_per_s: r.f64()?,
                    updated_at_ms: r.u64()?,
                    samples: r.u32()?,
                },
                bytes_per_token: RatioLearner::read(&mut r)?,
                output_tokens: RatioLearner::read(&mut r)?,
            });
        }
        Some(MetricsTable { slots })
    }

    /// The snapshot of `slot` if it belongs to `generation`.
    pub fn get(&self, slot: u16, generation: u16) -> Option<&MetricsSnapshot> {
        self.slots
            .get(slot as usize)
            .filter(|m| m.generation == generation)
    }

    /// The snapshot of `slot`, reset for a new generation.
    pub fn entry(&mut self, slot: u16, generation: u16) -> Option<&mut MetricsSnapshot> {
        let s = slot as usize;
        if s >= MAX_ENDPOINTS {
            return None;
        }
        if self.slots.len() <= s {
            self.slots.resize(s + 1, MetricsSnapshot::default());
        }
        let m = &mut self.slots[s];
        if m.generation != generation {
            *m = MetricsSnapshot {
                generation,
                ..Default::default()
            };
        }
        Some(m)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_generation() {
        let mut t = MetricsTable::default();
        let m = t.entry(2, 5).unwrap();
        m.waiting = 3.0;
        m.ok_at_ms = 10;
        m.block_size = 16;
        m.num_gpu_blocks = 100;
        m.prefill = PrefillRate {
            base_tokens: 4096.0,
            base_seconds: 0.2,
            base_count: 1.0,
            base_at_ms: 9,
            tokens_per_s: 20480.0,
            updated_at_ms: 10,
            samples: 1,
        };
        m.bytes_per_token = RatioLearner {
            based: true,
            base_den: 5000.0,
            base_num: 20_000.0,
            samples: [3.5; RATIO_SAMPLES],
            count: 4,
            next: 4,
        };
        m.output_tokens = RatioLearner {
            based: true,
            base_den: 12.0,
            base_num: 9000.0,
            samples: [750.0; RATIO_SAMPLES],
            count: 2,
            next: 2,
        };
        let enc = t.encode();
        let d = MetricsTable::decode(Some(&enc));
        assert_eq!(d, t);
        assert_eq!(enc.len(), 3 + 3 * SLOT_BYTES);
        assert_eq!(d.get(2, 5).unwrap().prefill.estimate(), Some(20480.0));
        assert_eq!(d.get(0, 0).unwrap().prefill.estimate(), None);
        assert_eq!(d.get(2, 5).unwrap().capacity_tokens(), Some(1600));
        assert!(d.get(2, 5).unwrap().is_fresh(1010, 1000));
        assert!(!d.get(2, 5).unwrap().is_fresh(1011, 1000));
        assert_eq!(d.get(2, 4), None);
        assert_eq!(MetricsTable::decode(Some(b"xx")), MetricsTable::default());
    }
}

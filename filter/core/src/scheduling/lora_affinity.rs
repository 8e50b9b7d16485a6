//! `lora-affinity-scorer` (llm-d's, `plugins/scheduling/scorer/loraaffinity`):
//! prefer endpoints with the request's LoRA adapter already active, then
//! those with a free adapter slot.
//!
//! ```text
//! score(e) = 1.0  the request's model is among e's running adapters
//!            0.8  else, |running ∪ waiting| < max_lora  (a free slot)
//!            0.6  else, it is among e's waiting adapters
//!            0.0  otherwise (also: no `vllm:lora_requests_info`, max_lora 0)
//! ```
//!
//! From each endpoint's `vllm:lora_requests_info` (`running_lora_adapters`,
//! `waiting_lora_adapters`, `max_lora`), which the collector keeps in
//! `kvroute/models` (`engine/models.rs` fills [`Candidate::lora`]). A
//! request for a base model scores by free slots alone, as in llm-d.

use super::Candidate;
use crate::config::check::Params;
use crate::config::ConfigError;

/// One endpoint's adapter state towards the request's model.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LoraSlots {
    /// The model is a running adapter there.
    pub running: bool,
    /// The model is a waiting adapter there.
    pub waiting: bool,
    /// Fewer distinct adapters running or waiting than `max_lora`.
    pub free_slot: bool,
}

pub fn score(cands: &[Candidate], idx: &[usize], out: &mut [f64]) {
    for (o, &i) in out.iter_mut().zip(idx) {
        let l = cands[i].lora;
        *o = if l.running {
            1.0
        } else if l.free_slot {
            0.8
        } else if l.waiting {
            0.6
        } else {
            0.0
        };
    }
}

// ---------------------------------------------------------------------------
// Configuration: `lora-affinity-scorer` in `plugins`.

pub const TYPE: &str = "lora-affinity-scorer";

/// No parameters.
pub(crate) fn compile(p: &Params) -> Result<(), ConfigError> {
    p.none()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn active_then_free_slot_then_waiting() {
        let c = |running, waiting, free_slot| Candidate {
            lora: LoraSlots {
                running,
                waiting,
                free_slot,
            },
            ..Default::default()
        };
        let cands = [
            c(true, false, false),
            c(false, false, true),
            c(false, true, false),
            c(false, false, false),
            c(true, true, true),
            Candidate::default(),
        ];
        let mut out = [9.0; 6];
        score(&cands, &[0, 1, 2, 3, 4, 5], &mut out);
        assert_eq!(out, [1.0, 0.8, 0.6, 0.0, 1.0, 0.0]);
        // Only the passing candidates are written, in their order.
        let mut out = [9.0; 2];
        score(&cands, &[3, 0], &mut out);
        assert_eq!(out, [0.0, 1.0]);
    }
}

//! The one entry, [`Engine::route`]: a request's facts to a destination
//! (snapshot, schedule, charge, index insert), and what follows a
//! decision: the releases, a retried request's [`Engine::move_charge`] and
//! a rejected one's [`Engine::take_back`].

use super::snapshot::ModelFit;
use super::{Engine, Outcome, Provisional, RequestFacts, Routed, Snapshot, TokenizeJob, Unrouted};
use crate::precise::vllm_hash::LoraKey;
use crate::precise::{Fallback, PreciseUse};
use crate::scheduling::{Decision, Rng};
use kvroute_shared_state::cas::{update, update_bytes, update_seeded};
use kvroute_shared_state::index::{self, Holder};
use kvroute_shared_state::load::{window_ms, LoadTable, Ticket, Undo};
use kvroute_shared_state::{Store, StoreError, LOAD_KEY};
use std::fmt::Write as _;

/// What [`Engine::place`] came to (matched at once: its size does not
/// matter).
#[allow(clippy::large_enum_variant)]
enum Placed {
    Routed(Routed),
    /// No healthy endpoint (or the profile's filters left none).
    NoEndpoints,
    /// No endpoint serves the body's `model`.
    UnknownModel,
}

impl Engine {
    /// Routes one request: reads the state it is decided on
    /// ([`Engine::snapshot`]), schedules it, charges the chosen endpoint
    /// and records the prompt's blocks for it. What the request wrote is
    /// kept in the answer ([`Provisional`]), to be taken back if the server
    /// rejects it. A request kvroute cannot route goes the failure mode's
    /// way ([`Engine::fail_for`]).
    pub fn route(
        &self,
        store: &dyn Store,
        mut facts: RequestFacts,
        now_ms: u64,
        rng: &mut Rng,
    ) -> Outcome {
        let job = self.resolve_offpath(store, &mut facts);
        match self.place(store, &facts, now_ms, rng) {
            Ok(Placed::Routed(mut r)) => {
                // An adapter's prompt is not hashed as the base model's
                // (`engine/models.rs`): no text for the collector either.
                let job = job.filter(|_| !r.lora_adapter);
                r.stream = facts.stream;
                r.tokenize = job.map(|job| {
                    Box::new(TokenizeJob {
                        job,
                        partial: facts.precise.as_ref().is_some_and(|p| p.is_ok()),
                    })
                });
                if let Some(p) = r.provisional.as_mut().filter(|p| p.from_block.is_some()) {
                    p.hashes = facts.hashes;
                }
                if let Some(Err(why)) = facts.precise {
                    r.precise = Some(PreciseUse::Fallback { why, blocks: 0 });
                }
                Outcome::Routed(r)
            }
            Ok(Placed::NoEndpoints) => self.fail_for(Unrouted::NoEndpoints, facts.api),
            Ok(Placed::UnknownModel) => {
                self.fail_for(Unrouted::UnknownModel(facts.model), facts.api)
            }
            Err(e) => self.fail_for(Unrouted::Store(e.to_string()), facts.api),
        }
    }

    /// [`route`](Self::route) up to its answer; `None` when no healthy
    /// endpoint is known. Scheduling and the charge are on precise mode's
    /// held view when there is one; the approximate index is kept up to
    /// date either way (it is the fallback), from `facts.hashes`.
    fn place(
        &self,
        store: &dyn Store,
        facts: &RequestFacts,
        now_ms: u64,
        rng: &mut Rng,
    ) -> Result<Placed, StoreError> {
        let Some(mut snap) = self.snapshot(store, facts, now_ms)? else {
            return Ok(Placed::NoEndpoints);
        };
        let lora = match std::mem::replace(&mut snap.model, ModelFit::Served) {
            ModelFit::Unknown => return Ok(Placed::UnknownModel),
            ModelFit::Adapter(key) => Some(key),
            ModelFit::Served => None,
        };
        let lora_adapter = lora.is_some();
        let session = self.mark_session(store, facts.session.as_ref(), &mut snap, now_ms);
        let precise_hashes = facts
            .precise
            .as_ref()
            .and_then(|p| p.as_ref().ok())
            .map(|(h, tokens)| (h.as_slice(), *tokens));
        // vLLM hashes an adapter's blocks with its name and path: the base
        // model's hashes would match nothing, or the wrong blocks. With the
        // prompt's token IDs at hand (`facts.precise_ids`: not with
        // `tokenizeIn: collector`) and one path, hash again with them.
        let lora_hashes = match (&lora, &facts.precise_ids, &self.config.precise) {
            (Some(Ok(path)), Some(t), Some(p)) if precise_hashes.is_some() => {
                let key = LoraKey {
                    name: &facts.model,
                    path,
                };
                Some(p.hashes_of(&t.ids, Some(key), t.salt.as_deref()))
            }
            _ => None,
        };
        let lora_fallback = match &lora {
            None => None,
            Some(Err(why)) => Some(*why),
            Some(Ok(_)) if lora_hashes.is_none() => Some(Fallback::LoraAdapter),
            Some(Ok(_)) => None,
        };
        let precise_hashes = match (&lora_hashes, precise_hashes) {
            (Some(h), Some((_, tokens))) => Some((h.as_slice(), tokens)),
            (_, p) => p,
        };
        let precise = precise_hashes.filter(|_| lora_fallback.is_none());
        let held = match precise {
            Some((vllm_hashes, tokens)) => {
                let unknown = facts.precise_unknown_blocks;
                self.held_candidates(store, &snap, vllm_hashes, tokens, unknown, now_ms)?
            }
            None => None,
        };
        let precise_use = precise_hashes.map(|(vllm_hashes, _)| {
            let blocks = vllm_hashes.len().min(u32::MAX as usize) as u32;
            if let Some(why) = lora_fallback {
                PreciseUse::Fallback { why, blocks }
            } else if held.is_some() {
                PreciseUse::Matched { blocks }
            } else {
                PreciseUse::Fallback {
                    why: Fallback::NoHeldView,
                    blocks,
                }
            }
        });
        let Snapshot {
            endpoints,
            holders,
            first_recorded,
            shards,
            candidates,
            view,
            load,
            model: _,
        } = snap;
        // Scheduling (and the charge) on the held view when there is one;
        // the approximate index's bookkeeping below stays on its own blocks.
        let (sched_candidates, sched_view) = match &held {
            Some((c, v)) => (c, v),
            None => (&candidates, &view),
        };
        let scheduler = &self.config.scheduler;
        let decision = if facts.scorer_scores {
            scheduler.schedule_scored(sched_view, sched_candidates, rng)
        } else {
            scheduler.schedule(sched_view, sched_candidates, rng)
        };
        let Some(decision) = decision else {
            return Ok(Placed::NoEndpoints);
        };
        let chosen = &endpoints[decision.primary];
        let charge = self.config.scheduler.inflight.charge_work(
            sched_view,
            &sched_candidates[decision.primary],
            facts.work,
        );
        let cand = &candidates[decision.primary];
        // A server evicts at most its whole cache for one prompt: a prompt
        // longer than that ages the endpoint's entries by its capacity.
        let capacity = holders[decision.primary].capacity_blocks;
        let new_blocks = u64::from(view.total_blocks.saturating_sub(cand.matched_blocks));
        let new_blocks = if capacity == 0 {
            new_blocks
        } else {
            new_blocks.min(capacity)
        };
        let cold_stamp = if decision.cold { now_ms.max(1) } else { 0 };
        let window = window_ms(self.config.collector.reap_after_ms);

        // The charge must land: retry lost CAS races (bounded in `update`).
        // The first try is on the table the snapshot read.
        let charged = update_seeded(
            store,
            LOAD_KEY,
            load,
            LoadTable::decode,
            LoadTable::encode,
            |t: &mut LoadTable| {
                let prev_cold_pick = t.last_cold_pick(chosen.slot, chosen.generation);
                let charged = t.charge(
                    chosen.slot,
                    chosen.generation,
                    now_ms,
                    window,
                    charge.prompt_tokens,
                    charge.output_tokens,
                    new_blocks,
                    cold_stamp,
                );
                if let (Some(_), Some(b)) = (&charged, facts.text_bytes) {
                    t.add_routed_bytes(chosen.slot, chosen.generation, b);
                }
                charged.map(|(ticket, counter)| (ticket, counter, prev_cold_pick))
            },
        );
        let charged = charged?;
        let mut cas_retries = charged.retries;
        let (ticket, counter_after, prev_cold_pick) = charged
            .result
            .map_or((None, 0, 0), |(t, c, p)| (Some(t), c, p));
        let mut provisional = ticket.map(|_| Provisional {
            undo: Undo {
                slot: chosen.slot,
                generation: chosen.generation,
                new_blocks,
                routed_bytes: facts.text_bytes.unwrap_or(0),
                cold_stamp,
                prev_cold_pick,
            },
            hashes: Vec::new(),
            from_block: None,
            recorded: counter_after as u32,
        });

        // Record the blocks for the chosen endpoint (advisory: a failure
        // only costs future affinity).
        let hashes = facts.hashes.as_slice();
        if ticket.is_some() && !hashes.is_empty() {
            let me = Holder {
                slot: chosen.slot,
                generation: chosen.generation,
                insert_counter: counter_after,
                capacity_blocks: holders[decision.primary].capacity_blocks,
            };
            // Judge the chosen endpoint's entries by its counter *after*
            // this charge: this request's own entries are recorded with it,
            // and the pre-charge counter would see them as already evicted.
            let is_live = |slot: u16, generation: u16, recorded: u32| {
                if slot == me.slot {
                    return me.holds(slot, generation, recorded);
                }
                holders
                    .iter()
                    .find(|h| h.slot == slot)
                    .is_some_and(|h| h.holds(slot, generation, recorded))
            };
            // Whole groups the endpoint already holds are not rewritten
            // unless they are due for an LRU refresh.
            let skip = index::insert_skip(
                &me,
                cand.matched_blocks,
                hashes.len(),
                first_recorded[decision.primary],
            );
            if let Ok(st) =
                index::insert_seeded(store, &self.geometry, hashes, skip, &me, &is_live, shards)
            {
                cas_retries += st.cas_retries;
            }
            if let Some(p) = provisional.as_mut() {
                // Kept whether or not the insert went through: a partial
                // insert's entries are cleared all the same.
                p.from_block = Some(cand.matched_blocks as usize);
            }
        }

        let mut destination = chosen.address.clone();
        for &f in &decision.fallbacks {
            destination.push(',');
            destination.push_str(&endpoints[f].address);
        }
        Ok(Placed::Routed(Routed {
            destination,
            ticket,
            decision,
            uncached_tokens: charge.prompt_tokens,
            stream: false,
            cas_retries,
            precise: precise_use,
            provisional,
            tokenize: None,
            lora_adapter,
            session,
        }))
    }

    /// Moves a request's charge to the endpoint that actually served it:
    /// Envoy retried it (connect failure, refused stream, reset before the
    /// request) to the next address of the destination header. One
    /// load-table write releases the charge on the routed endpoint, undoes
    /// what the decision wrote there ([`Provisional`]: that server never
    /// saw the request) and charges the same tokens to `to`; then the
    /// routed endpoint's new index entries are cleared. Nothing is
    /// recorded for `to` in the index: its blocks reach the index with
    /// that prompt's next request. Returns the new ticket (`None` when
    /// `to` is not a known healthy endpoint: the charge is only released)
    /// and the CAS races lost.
    pub fn move_charge(
        &self,
        store: &dyn Store,
        ticket: &Ticket,
        provisional: Option<&Provisional>,
        to: &str,
        now_ms: u64,
    ) -> Result<(Option<Ticket>, u32), StoreError> {
        let table = self.endpoint_table(store)?;
        let target = table
            .endpoints
            .iter()
            .find(|e| e.healthy && e.address == to)
            .map(|e| (e.slot, e.generation));
        let window = window_ms(self.config.collector.reap_after_ms);
        let updated = update(
            store,
            LOAD_KEY,
            LoadTable::decode,
            LoadTable::encode,
            |t: &mut LoadTable| {
                t.release_rest(ticket, false);
                if let Some(p) = provisional {
                    t.undo(&p.undo);
                }
                Some(target.and_then(|(slot, generation)| {
                    t.charge(
                        slot,
                        generation,
                        now_ms,
                        window,
                        ticket.prompt_tokens,
                        ticket.output_tokens,
                        0,
                        0,
                    )
                    .map(|(t, _)| t)
                }))
            },
        )?;
        let mut retries = updated.retries;
        if let Some(p) = provisional {
            retries += self.remove_entries(store, p)?;
        }
        Ok((updated.result.flatten(), retries))
    }

    /// Clears a provisional record's index entries; returns the CAS races
    /// lost.
    fn remove_entries(&self, store: &dyn Store, p: &Provisional) -> Result<u32, StoreError> {
        let Some(from) = p.from_block else {
            return Ok(0);
        };
        let me = Holder {
            slot: p.undo.slot,
            generation: p.undo.generation,
            insert_counter: 0,
            capacity_blocks: 0,
        };
        let (_, r) = index::remove(store, &self.geometry, &p.hashes, from, &me, p.recorded)?;
        Ok(r)
    }

    /// Takes back a request the server rejected (a non-2xx answer, or a
    /// reset before any response byte): releases what its charge still
    /// holds and undoes the rest of what its decision wrote
    /// ([`Provisional`]), in the same load-table write; then clears its
    /// index entries. Returns the CAS races lost.
    pub fn take_back(
        &self,
        store: &dyn Store,
        ticket: &Ticket,
        p: &Provisional,
        prompt_released: bool,
    ) -> Result<u32, StoreError> {
        let mut retries = update(
            store,
            LOAD_KEY,
            LoadTable::decode,
            LoadTable::encode,
            |t: &mut LoadTable| {
                t.release_rest(ticket, prompt_released);
                t.undo(&p.undo);
                Some(())
            },
        )?
        .retries;
        retries += self.remove_entries(store, p)?;
        Ok(retries)
    }

    /// Releases the prompt part of a charge (first response byte).
    /// Returns the CAS races the write lost before it went through.
    pub fn release_prompt(&self, store: &dyn Store, ticket: &Ticket) -> Result<u32, StoreError> {
        release(store, ticket, None)
    }

    /// Releases the rest of a charge (end of stream, reset, abort…).
    pub fn release_rest(
        &self,
        store: &dyn Store,
        ticket: &Ticket,
        prompt_released: bool,
    ) -> Result<u32, StoreError> {
        release(store, ticket, Some(prompt_released))
    }
}

/// A release on the load table's bytes, patched in place
/// ([`LoadTable::release_encoded`]); lost CAS races are retried. Returns
/// the races lost.
fn release(store: &dyn Store, ticket: &Ticket, rest: Option<bool>) -> Result<u32, StoreError> {
    update_bytes(
        store,
        LOAD_KEY,
        None,
        || LoadTable::default().encode(),
        |_| {},
        |bytes: &mut Vec<u8>| LoadTable::release_encoded(bytes, ticket, rest).then_some(()),
    )
    .map(|u| u.retries)
}

/// `branch=sticky;endpoint=ip:port;affinity=0.95;ttft_ms=12.3;uncached_tokens=123;candidates=4;passed=1`
pub(super) fn explain(d: &Decision, primary_address: &str, uncached: u64) -> String {
    let r = &d.report[d.primary];
    let mut s = String::with_capacity(160);
    let _ = write!(
        s,
        "branch={};endpoint={};affinity={:.3};ttft_ms={:.1};uncached_tokens={};candidates={};passed={}",
        d.branch.as_str(),
        primary_address,
        r.affinity,
        r.ttft_ms,
        uncached,
        d.report.len(),
        d.report.iter().filter(|c| c.passed_filter).count(),
    );
    let best_other = d
        .report
        .iter()
        .enumerate()
        .filter(|(i, _)| *i != d.primary)
        .map(|(_, c)| c.ttft_ms)
        .fold(f64::INFINITY, f64::min);
    if best_other.is_finite() {
        let _ = write!(s, ";best_other_ttft_ms={best_other:.1}");
    }
    s
}

//! Several models and LoRA adapters behind one pool: what the collector
//! learns of each endpoint's models (`kvroute/models`,
//! `kvroute_shared_state::models`) and the request path's model filter.
//!
//! # The collector's writes
//!
//! - Each good `/metrics` poll ([`Engine::record_metrics`]) replaces the
//!   endpoint's `/metrics` part: the `model_name` label values (its served
//!   model name) and `vllm:lora_requests_info` (adapters running and
//!   waiting, `max_lora`).
//! - Each good `/v1/models` poll ([`Engine::record_model_list`],
//!   `collector.modelsPollIntervalMs`) replaces its listing part: base
//!   models (cards without `parent`) and loaded adapters (cards with one),
//!   idle ones included.
//!
//! A failed poll keeps the last list. The table is written only when it
//! changes, and then the state epoch is bumped so workers read it again.
//!
//! # The model filter
//!
//! Built in, before the profile's filters (llm-d has no such filter: its
//! InferencePool is one base model; kvroute's pool may be several): only
//! endpoints that may serve the body's `model` are candidates
//! ([`Serves::may_serve`]): those that list it as a base model or an
//! adapter, those whose list overflowed, and those whose models are not
//! known yet (no poll reported any), so a fleet without model reports
//! routes as before. A request with no `model` goes to every endpoint
//! (vLLM serves it with its first base model).
//!
//! When no endpoint may serve the model, the request is
//! [`Unrouted::UnknownModel`]: fail-closed answers 404 with vLLM's own
//! error ("The model `x` does not exist."); fail-open passes it on to
//! Envoy's balancer without a destination, counted
//! (`kvroute_unknown_model`).
//!
//! # LoRA and precise mode
//!
//! vLLM 0.32 hashes every block of an adapter's request with the extra
//! key `("lora", lora_name, lora_path)` (`_gen_lora_extra_hash_keys` in
//! `v1/core/kv_cache_utils.py`), so an adapter's prompt shares no blocks
//! with the base model's, and the same adapter loaded from another path on
//! another server hashes differently there. The path is the adapter card's
//! `root` in `/v1/models`, which the collector keeps (bounded) in the
//! models table. A request for a model some candidate serves as an adapter
//! (and none as a base model) is an adapter request ([`adapter_key`]):
//!
//! - every candidate that lists it reports the same path: precise mode
//!   hashes the prompt with `(model, path)` and matches as usual
//!   (`Engine::route`);
//! - one of them has no known path: falls back, `Fallback::LoraPathUnknown`;
//! - they report different paths: falls back, `Fallback::LoraPathsDiffer`
//!   (one set of hashes cannot match them all);
//! - `tokenizeIn: collector` for its model: falls back,
//!   `Fallback::LoraAdapter` (the collector's stored prefixes are hashed
//!   without the adapter).
//!
//! Each fallback is counted (`kvroute_precise_fallback_<reason>`).
//! Candidates that do not know their models yet (no poll) may serve it but
//! do not decide the path.

use super::{openai_error, Engine};
use crate::precise::Fallback;
use crate::reports::vllm_metrics::VllmMetrics;
use crate::reports::vllm_models;
use crate::scheduling::lora_affinity::LoraSlots;
use kvroute_shared_state::cas::update;
use kvroute_shared_state::endpoints::EndpointEntry;
use kvroute_shared_state::models::{
    flags, AdapterPath, EndpointModels, ModelsTable, Serves, Source, MODELS_KEY,
};
use kvroute_shared_state::{Store, StoreError};
use std::sync::Arc;

/// What the model filter left of the healthy endpoints.
pub(super) enum Eligible {
    /// Every endpoint may serve the model (the common case: nothing copied).
    All,
    /// Only these may (indices into the healthy endpoints, in order).
    Some(Vec<usize>),
    /// None may: the model is unknown to the pool.
    None,
}

/// Whether `model` is a LoRA adapter on the endpoints that may serve it
/// (some list it as an adapter and none as a base model), and if so the
/// path vLLM hashes its blocks with: `None` for a base model; `Some(Ok)`
/// when every endpoint that lists it reports this one path; else why
/// precise mode cannot hash it (`LoraPathsDiffer` before
/// `LoraPathUnknown`).
pub(super) fn adapter_key(
    models: &ModelsTable,
    endpoints: &[EndpointEntry],
    model: &str,
) -> Option<Result<String, Fallback>> {
    if model.is_empty() {
        return None;
    }
    let (mut adapter, mut unknown, mut differ) = (false, false, false);
    let mut path: Option<&str> = None;
    for e in endpoints {
        let Some(m) = models.get(e.slot, e.generation) else {
            continue;
        };
        match m.serves(model) {
            // Served as a base model anywhere: not an adapter request.
            Serves::Base => return None,
            Serves::Adapter { .. } => adapter = true,
            _ => continue,
        }
        match (m.adapter_path(model), path) {
            (AdapterPath::Path(p), Some(q)) => differ |= p != q,
            (AdapterPath::Path(p), None) => path = Some(p),
            _ => unknown = true,
        }
    }
    if !adapter {
        return None;
    }
    Some(match path {
        _ if differ => Err(Fallback::LoraPathsDiffer),
        Some(p) if !unknown => Ok(p.to_string()),
        _ => Err(Fallback::LoraPathUnknown),
    })
}

/// The model filter over `endpoints` (see the module doc).
pub(super) fn eligible(models: &ModelsTable, endpoints: &[EndpointEntry], model: &str) -> Eligible {
    if model.is_empty() {
        return Eligible::All;
    }
    let keep: Vec<usize> = endpoints
        .iter()
        .enumerate()
        .filter(|(_, e)| {
            models
                .get(e.slot, e.generation)
                .map_or(Serves::Unknown, |m| m.serves(model))
                .may_serve()
        })
        .map(|(i, _)| i)
        .collect();
    if keep.is_empty() {
        Eligible::None
    } else if keep.len() == endpoints.len() {
        Eligible::All
    } else {
        Eligible::Some(keep)
    }
}

/// An endpoint's adapter state towards `model`, for `lora-affinity-scorer`
/// (`None`: nothing known, all false).
pub(super) fn lora_slots(m: Option<&EndpointModels>, model: &str) -> LoraSlots {
    let Some(m) = m else {
        return LoraSlots::default();
    };
    let (running, waiting) = match m.serves(model) {
        Serves::Adapter { running, waiting } => (running, waiting),
        _ => (false, false),
    };
    LoraSlots {
        running,
        waiting,
        free_slot: m.active_adapters() < usize::from(m.max_lora),
    }
}

/// One endpoint's models for the state view (`routing.statePath`):
/// base models, adapters (with `running`/`waiting`), `maxLora`, `overflow`.
pub(super) fn state_json(m: &EndpointModels) -> serde_json::Value {
    let base: Vec<&str> = m
        .names
        .iter()
        .filter(|n| n.flags & flags::BASE != 0)
        .map(|n| n.name.as_str())
        .collect();
    let adapters: Vec<serde_json::Value> = m
        .names
        .iter()
        .filter(|n| n.flags & flags::BASE == 0)
        .map(|n| {
            serde_json::json!({
                "name": n.name,
                "path": n.path,
                "running": n.flags & flags::RUNNING != 0,
                "waiting": n.flags & flags::WAITING != 0,
            })
        })
        .collect();
    serde_json::json!({"base": base, "adapters": adapters, "maxLora": m.max_lora, "overflow": m.overflow})
}

/// The endpoints at `keep`, as a new shared list.
pub(super) fn pick(endpoints: &Arc<Vec<EndpointEntry>>, keep: &[usize]) -> Arc<Vec<EndpointEntry>> {
    Arc::new(keep.iter().map(|&i| endpoints[i].clone()).collect())
}

/// vLLM's answer to a model it does not serve
/// (`OpenAIModelRegistry::check_model`): 404, `NotFoundError`, `param: model`.
pub fn model_not_found(model: &str) -> String {
    let mut body: serde_json::Value = serde_json::from_str(&openai_error(
        &format!("The model `{model}` does not exist."),
        "NotFoundError",
        404,
    ))
    .unwrap_or_default();
    body["error"]["param"] = "model".into();
    body.to_string()
}

impl Engine {
    /// The models table (missing or another layout: empty).
    pub fn models_table(&self, store: &dyn Store) -> Result<ModelsTable, StoreError> {
        Ok(ModelsTable::decode(
            store.get(MODELS_KEY)?.as_ref().map(|(b, _)| b.as_slice()),
        ))
    }

    /// Writes `source`'s part of (`slot`, `generation`)'s models (and a
    /// listing's adapter paths). Returns true if the table changed (the
    /// caller bumps the state epoch).
    #[allow(clippy::too_many_arguments)]
    fn write_models(
        &self,
        store: &dyn Store,
        slot: u16,
        generation: u16,
        source: Source,
        names: &[(&str, u8)],
        max_lora: Option<u16>,
        adapter_paths: Option<&[(&str, &str)]>,
    ) -> Result<bool, StoreError> {
        let u = update(
            store,
            MODELS_KEY,
            ModelsTable::decode,
            ModelsTable::encode,
            |t: &mut ModelsTable| {
                let m = t.entry(slot, generation)?;
                // Compared whole: `apply` drops a listed-only adapter (and
                // its path) before adding it again.
                let before = m.clone();
                m.apply(source, names, max_lora);
                if let Some(p) = adapter_paths {
                    m.set_adapter_paths(p);
                }
                (*m != before).then_some(())
            },
        )?;
        Ok(u.result.is_some())
    }

    /// The `/metrics` part of an endpoint's models, from a parsed poll.
    /// Returns true if the table changed.
    pub(super) fn record_metrics_models(
        &self,
        store: &dyn Store,
        slot: u16,
        generation: u16,
        v: &VllmMetrics,
    ) -> Result<bool, StoreError> {
        let mut names: Vec<(&str, u8)> = v
            .model_names
            .iter()
            .map(|n| (n.as_str(), flags::METRICS_BASE))
            .collect();
        if let Some(l) = &v.lora {
            names.extend(l.running.iter().map(|n| (n.as_str(), flags::RUNNING)));
            names.extend(l.waiting.iter().map(|n| (n.as_str(), flags::WAITING)));
        }
        let max_lora = v.lora.as_ref().map(|l| l.max_lora);
        self.write_models(
            store,
            slot,
            generation,
            Source::Metrics,
            &names,
            max_lora,
            None,
        )
    }

    /// Records one `/v1/models` answer of (`slot`, `generation`). A body
    /// that does not parse keeps the last list and is returned as the
    /// error (counted as a failed poll).
    pub fn record_model_list(
        &self,
        store: &dyn Store,
        slot: u16,
        generation: u16,
        body: &[u8],
    ) -> Result<(), String> {
        let cards = vllm_models::parse(body)?;
        let names: Vec<(&str, u8)> = cards
            .iter()
            .map(|c| {
                let bit = if c.is_adapter() {
                    flags::LISTED_ADAPTER
                } else {
                    flags::LISTED_BASE
                };
                (c.id.as_str(), bit)
            })
            .collect();
        // Each adapter's path (`root`): vLLM hashes its blocks with it.
        let paths: Vec<(&str, &str)> = cards
            .iter()
            .filter(|c| c.is_adapter())
            .filter_map(|c| Some((c.id.as_str(), c.root.as_deref()?)))
            .collect();
        let changed = self
            .write_models(
                store,
                slot,
                generation,
                Source::Listing,
                &names,
                None,
                Some(&paths),
            )
            .map_err(|e| e.to_string())?;
        if changed {
            self.bump_epoch(store).map_err(|e| e.to_string())?;
        }
        Ok(())
    }
}

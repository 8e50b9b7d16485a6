//! The plugin registry: every `plugins[].type` kvroute accepts, in one
//! table (`PLUGINS`), each with its old names and its compile function
//! (which lives in the plugin's own file, beside its formula: parameters
//! struct, defaults, range checks). The type lookup, the aliases and the
//! supported-types list in the "unknown plugin type" error are all read
//! from the table; [`Scorer`] is the closed set the scheduler dispatches on
//! (a `match`, no `dyn` per request).
//!
//! Adding a scorer: its file (formula, struct, `TYPE`, parameters,
//! `compile`, `score`), its `pub mod` line in `scheduling/mod.rs`, a
//! [`Scorer`] variant with its `type_name` and `score` arms and a
//! `PLUGINS` line here, and its entry in `docs/configuration.md`.
//!
//! Types llm-d has and kvroute refuses are `config/llm_d.rs`'s
//! `unsupported_reason`; the three producers without a scheduling file are
//! `config/producers.rs`.

use super::active_request::{self, ActiveRequestScorer};
use super::affinity_filter::{self, AffinityFilter};
use super::charge::{self, InflightConfig};
use super::prefix_cache::{self, PrefixCacheScorer};
use super::saturation::{self, KvrouteLoadScorer};
use super::scheduler::{Branch, Picker};
use super::session::SessionAffinity;
use super::token_load::{self, TokenLoadScorer};
use super::{
    cache_balance, kv_cache_utilization, lora_affinity, max_score, no_hit_lru, queue,
    weighted_random,
};
use super::{session_affinity_filter, session_affinity_scorer};
use super::{Candidate, RequestView};
use crate::config::check::Params;
use crate::config::llm_d::{self, Inert};
use crate::config::producers::{self, PrefixProducerConfig};
use crate::config::ConfigError;
use crate::precise::{PreciseConfig, TokenizerConfig};

/// A scorer of the profile.
#[derive(Clone, Debug, PartialEq)]
pub enum Scorer {
    TokenLoad(TokenLoadScorer),
    ActiveRequest(ActiveRequestScorer),
    Queue,
    KvCacheUtilization,
    PrefixCache(PrefixCacheScorer),
    NoHitLru,
    LoraAffinity,
    /// kvroute's: the saturation-aware load signal (`saturation`).
    KvrouteLoad(KvrouteLoadScorer),
    /// kvroute's: balance the fleet's cache working sets (`cache_balance`).
    CacheBalance,
    /// `session-affinity-scorer` (its strategy is the profile's
    /// [`Scheduler::session`](super::Scheduler::session)).
    SessionAffinity,
}

/// What a scorer may read about one request, over the candidates that
/// passed the filters.
pub struct ScoreInput<'a> {
    pub req: &'a RequestView,
    pub cands: &'a [Candidate],
    /// Indices into `cands` of the candidates to score; `out[k]` is
    /// `passing[k]`'s score.
    pub passing: &'a [usize],
    /// The filter's branch (`Unfiltered`/`Single` without a filter).
    pub branch: Branch,
    /// `token-load-scorer`'s lookahead per candidate (empty unless it runs).
    pub lookahead: &'a [u64],
    /// `kvroute-load-scorer`'s held KV per candidate (empty unless it runs).
    pub held: &'a [u64],
    /// The session's candidate, when present after the filters
    /// (`session-affinity-scorer`).
    pub session: Option<usize>,
}

impl Scorer {
    /// The llm-d plugin type name.
    pub fn type_name(&self) -> &'static str {
        match self {
            Scorer::TokenLoad(_) => token_load::TYPE,
            Scorer::ActiveRequest(_) => active_request::TYPE,
            Scorer::Queue => queue::TYPE,
            Scorer::KvCacheUtilization => kv_cache_utilization::TYPE,
            Scorer::PrefixCache(_) => prefix_cache::TYPE,
            Scorer::NoHitLru => no_hit_lru::TYPE,
            Scorer::LoraAffinity => lora_affinity::TYPE,
            Scorer::KvrouteLoad(_) => saturation::TYPE,
            Scorer::CacheBalance => cache_balance::TYPE,
            Scorer::SessionAffinity => session_affinity_scorer::TYPE,
        }
    }

    /// Writes each passing candidate's score, unweighted, to `out`.
    /// (Always inlined: with plain `#[inline]`, `callgrind.sh decide`
    /// counted more instructions per decision; figures in this line's
    /// commit.)
    #[inline(always)]
    pub fn score(&self, x: &ScoreInput, out: &mut [f64]) {
        let (req, cands, passing) = (x.req, x.cands, x.passing);
        match self {
            Scorer::TokenLoad(s) => s.score(cands, x.lookahead, passing, out),
            Scorer::ActiveRequest(s) => s.score(cands, passing, out),
            Scorer::Queue => queue::score(cands, passing, out),
            Scorer::KvCacheUtilization => kv_cache_utilization::score(cands, passing, out),
            Scorer::PrefixCache(s)
                if (s.sticky_only && x.branch != Branch::Sticky)
                    || (s.skip_released
                        && matches!(x.branch, Branch::SaturationRelease | Branch::Exploration)) =>
            {
                out.iter_mut().for_each(|o| *o = 1.0)
            }
            Scorer::PrefixCache(s) => s.score(req, cands, passing, out),
            Scorer::NoHitLru => no_hit_lru::score(req, cands, passing, out),
            Scorer::LoraAffinity => lora_affinity::score(cands, passing, out),
            Scorer::KvrouteLoad(s) => s.score(req, cands, x.held, passing, out),
            Scorer::CacheBalance => {
                // Only for a request with no sticky endpoint: a warm or
                // released one is the load scorer's to place.
                let cold = !matches!(x.branch, Branch::Sticky | Branch::SaturationRelease);
                cache_balance::score(cands, passing, cold, out)
            }
            Scorer::SessionAffinity => session_affinity_scorer::score(x.session, passing, out),
        }
    }
}

/// One compiled `plugins[]` entry.
pub(crate) enum Compiled {
    Prefix(PrefixProducerConfig),
    /// `precise-prefix-cache-producer`; `scorer` for the deprecated
    /// `precise-prefix-cache-scorer`, which also scores in a profile.
    Precise {
        config: PreciseConfig,
        scorer: bool,
    },
    Tokenizer(TokenizerConfig),
    Inflight(InflightConfig),
    Filter(AffinityFilter),
    /// `session-affinity-scorer` or `-filter`.
    Session(SessionAffinity),
    Scorer(Scorer),
    Picker(Picker),
    /// Accepted, nothing to run (see [`Inert`]).
    Inert(Inert),
}

/// Whose plugin it is, which is how the supported-types list groups it.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Origin {
    LlmD,
    Kvroute,
    /// llm-d's, accepted with nothing to do.
    Inert,
}

#[derive(Clone, Copy)]
pub(crate) enum Compile {
    Run(fn(&Params) -> Result<Compiled, ConfigError>),
    /// Parameters checked (`llm_d::inert_params`), nothing to run.
    Inert(Inert),
}

#[derive(Clone, Copy)]
pub(crate) struct Plugin {
    /// The current llm-d type name.
    pub name: &'static str,
    /// Older names that still load (see [`PLUGINS`]).
    pub aliases: &'static [&'static str],
    pub origin: Origin,
    /// How the supported-types list shows it, when not by its name
    /// (consecutive equal labels are listed once).
    pub listed_as: Option<&'static str>,
    pub compile: Compile,
}

const fn llm_d(name: &'static str, f: fn(&Params) -> Result<Compiled, ConfigError>) -> Plugin {
    Plugin {
        name,
        aliases: &[],
        origin: Origin::LlmD,
        listed_as: None,
        compile: Compile::Run(f),
    }
}

const fn kvroute(name: &'static str, f: fn(&Params) -> Result<Compiled, ConfigError>) -> Plugin {
    Plugin {
        origin: Origin::Kvroute,
        ..llm_d(name, f)
    }
}

const fn inert(name: &'static str, role: Inert) -> Plugin {
    Plugin {
        name,
        aliases: &[],
        origin: Origin::Inert,
        listed_as: None,
        compile: Compile::Inert(role),
    }
}

impl Plugin {
    const fn aka(self, aliases: &'static [&'static str]) -> Plugin {
        Plugin { aliases, ..self }
    }

    const fn listed_as(self, label: &'static str) -> Plugin {
        Plugin {
            listed_as: Some(label),
            ..self
        }
    }
}

const DATA_LAYER: &str = "llm-d's data-layer sources and extractors";

/// Every plugin type kvroute accepts, in the order the supported-types list
/// names them.
///
/// The aliases are older llm-d / gateway-api-inference-extension names,
/// checked against the history of
/// `kubernetes-sigs/gateway-api-inference-extension`: `kv-cache`,
/// `queue`, `prefix-cache`, `max-score` and `single-profile` were renamed
/// with the `-scorer`/`-picker`/`-handler` suffixes in 0b141c6a
/// (2025-07-14); `kv-cache-scorer` became `kv-cache-utilization-scorer` in
/// 216d5bf0 (2025-07-28). llm-d-router renamed the tokenizer plugin;
/// `tokenizer` still loads there.
#[rustfmt::skip]
pub(crate) static PLUGINS: &[Plugin] = &[
    llm_d(producers::APPROX_PREFIX, |p| Ok(Compiled::Prefix(producers::approx_prefix(p)?))),
    llm_d(producers::PRECISE_PREFIX, |p| Ok(Compiled::Precise { config: producers::precise_prefix(p)?, scorer: false })),
    llm_d(producers::PRECISE_PREFIX_SCORER, |p| Ok(Compiled::Precise { config: producers::precise_prefix(p)?, scorer: true }))
        .listed_as("precise-prefix-cache-scorer (deprecated in llm-d)"),
    llm_d(producers::TOKEN, |p| Ok(Compiled::Tokenizer(producers::token(p)?)))
        .aka(&["tokenizer"]).listed_as("token-producer (or tokenizer)"),
    llm_d(charge::TYPE, |p| Ok(Compiled::Inflight(charge::compile(p)?))),
    llm_d(affinity_filter::TYPE, |p| Ok(Compiled::Filter(affinity_filter::compile(p)?))),
    llm_d(session_affinity_filter::TYPE, |p| Ok(Compiled::Session(session_affinity_filter::compile(p)?))),
    llm_d(session_affinity_scorer::TYPE, |p| Ok(Compiled::Session(session_affinity_scorer::compile(p)?))),
    llm_d(token_load::TYPE, |p| Ok(Compiled::Scorer(Scorer::TokenLoad(token_load::compile(p)?)))),
    llm_d(active_request::TYPE, |p| Ok(Compiled::Scorer(Scorer::ActiveRequest(active_request::compile(p)?)))),
    llm_d(queue::TYPE, |p| queue::compile(p).map(|()| Compiled::Scorer(Scorer::Queue)))
        .aka(&["queue"]),
    llm_d(kv_cache_utilization::TYPE, |p| kv_cache_utilization::compile(p).map(|()| Compiled::Scorer(Scorer::KvCacheUtilization)))
        .aka(&["kv-cache", "kv-cache-scorer"]),
    llm_d(prefix_cache::TYPE, |p| Ok(Compiled::Scorer(Scorer::PrefixCache(prefix_cache::compile(p)?))))
        .aka(&["prefix-cache"]),
    llm_d(no_hit_lru::TYPE, |p| no_hit_lru::compile(p).map(|()| Compiled::Scorer(Scorer::NoHitLru))),
    llm_d(lora_affinity::TYPE, |p| lora_affinity::compile(p).map(|()| Compiled::Scorer(Scorer::LoraAffinity))),
    llm_d(max_score::TYPE, |p| Ok(Compiled::Picker(Picker::MaxScore(max_score::compile(p)?))))
        .aka(&["max-score"]),
    llm_d(weighted_random::TYPE, |p| weighted_random::compile(p).map(|()| Compiled::Picker(Picker::WeightedRandom))),
    kvroute(saturation::TYPE, |p| Ok(Compiled::Scorer(Scorer::KvrouteLoad(saturation::compile(p)?)))),
    kvroute(cache_balance::TYPE, |p| cache_balance::compile(p).map(|()| Compiled::Scorer(Scorer::CacheBalance))),
    inert("single-profile-handler", Inert::ProfileHandler).aka(&["single-profile"]),
    inert("decode-filter", Inert::DecodeFilter),
    inert("utilization-detector", Inert::Detector),
    inert("concurrency-detector", Inert::Detector),
    inert("kvroute-saturation-detector", Inert::Detector),
    inert("openai-parser", Inert::Parser),
    inert("vllmhttp-parser", Inert::Parser),
    inert("anthropic-parser", Inert::Parser),
    inert("passthrough-parser", Inert::Parser),
    inert("global-strict-fairness-policy", Inert::FlowPolicy),
    inert("round-robin-fairness-policy", Inert::FlowPolicy),
    inert("fcfs-ordering-policy", Inert::FlowPolicy),
    inert("edf-ordering-policy", Inert::FlowPolicy),
    inert("static-usage-limit-policy", Inert::FlowPolicy),
    inert("metrics-data-source", Inert::DataLayer).listed_as(DATA_LAYER),
    inert("core-metrics-extractor", Inert::DataLayer).listed_as(DATA_LAYER),
    inert("models-data-source", Inert::DataLayer).listed_as(DATA_LAYER),
    inert("models-data-extractor", Inert::DataLayer).listed_as(DATA_LAYER),
    inert("endpoint-notification-source", Inert::DataLayer).listed_as(DATA_LAYER),
    inert("k8s-notification-source", Inert::DataLayer).listed_as(DATA_LAYER),
];

/// The registered plugin for `kind`, by its name or an alias.
pub(crate) fn lookup(kind: &str) -> Option<&'static Plugin> {
    PLUGINS
        .iter()
        .find(|p| p.name == kind || p.aliases.contains(&kind))
}

/// The current type name for `kind` (itself when it is not an alias).
pub(crate) fn canonical_type(kind: &str) -> &str {
    match PLUGINS.iter().find(|p| p.aliases.contains(&kind)) {
        Some(p) => p.name,
        None => kind,
    }
}

/// Compiles `plugins[i]` of a registered type.
pub(crate) fn compile(plugin: &Plugin, p: &Params) -> Result<Compiled, ConfigError> {
    match plugin.compile {
        Compile::Run(f) => f(p),
        Compile::Inert(role) => {
            llm_d::inert_params(p, role)?;
            Ok(Compiled::Inert(role))
        }
    }
}

/// What the "unknown plugin type" error lists: llm-d's types, kvroute's
/// own, then the ones accepted with nothing to do.
pub(crate) fn supported_types() -> String {
    let labels = |origin: Origin| {
        let mut out: Vec<&str> = Vec::new();
        for p in PLUGINS.iter().filter(|p| p.origin == origin) {
            let label = p.listed_as.unwrap_or(p.name);
            if out.last() != Some(&label) {
                out.push(label);
            }
        }
        out
    };
    let own = labels(Origin::Kvroute);
    let own = match own.split_last() {
        Some((last, rest)) if !rest.is_empty() => format!("{} and {last}", rest.join(", ")),
        _ => own.join(""),
    };
    format!(
        "{}, kvroute's {own} (and, accepted with nothing to do: {})",
        labels(Origin::LlmD).join(", "),
        labels(Origin::Inert).join(", ")
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_aliases_are_unique_and_none_is_also_refused() {
        let mut seen = std::collections::BTreeSet::new();
        for p in PLUGINS {
            for n in std::iter::once(&p.name).chain(p.aliases) {
                assert!(seen.insert(*n), "{n} is registered twice");
                assert_eq!(llm_d::unsupported_reason(n), None, "{n}");
            }
        }
    }

    #[test]
    fn the_supported_list_names_every_type() {
        let list = supported_types();
        for p in PLUGINS {
            assert!(list.contains(p.listed_as.unwrap_or(p.name)), "{}", p.name);
        }
        assert!(list.starts_with("approx-prefix-cache-producer, "), "{list}");
        let own = list.find(", kvroute's ").expect("kvroute's own are listed");
        let inert = list
            .find(" (and, accepted with nothing to do: ")
            .expect("inert part");
        assert!(own < inert && list.ends_with(')'), "{list}");
    }
}

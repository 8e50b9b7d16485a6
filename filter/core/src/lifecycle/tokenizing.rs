//! The collector's tokenizer (`tokenizeIn: collector`): it loads each such
//! model's tokenizer once (inline, or fetched by URL through a cluster and
//! checked against its sha256 pin), publishes what the workers need
//! (`kvroute/tok/<fingerprint>`: the added tokens to cut at), registers the
//! tokenize queue, and turns the jobs the workers enqueue into stored
//! prefixes (`precise::offpath::process`). Until a tokenizer is loaded the
//! workers route those prompts approximately (`tokenizer_loading`).
//!
//! Only the VM that collects does this (the singleton, or the lease
//! holder); a failed load or fetch is logged, counted and retried with a
//! backoff (10 s doubling to 5 min).

use super::{Counter, Counts, Host, Level};
use crate::engine::Engine;
use std::collections::HashMap;

/// The shared queue workers send jobs to.
pub const TOKENIZE_QUEUE: &str = "kvroute/tokenize";
/// Bytes of jobs waiting in the queue, at most (the workers reserve them in
/// `kvroute/tokenize/pending`).
pub const MAX_PENDING_BYTES: u64 = 16 << 20;
/// Time one queue callback or tick may spend on jobs, ms.
const JOB_BUDGET_MS: u64 = 50;
#[cfg(feature = "tokenizer")]
const RETRY_FIRST_MS: u64 = 10_000;
#[cfg(feature = "tokenizer")]
const RETRY_MAX_MS: u64 = 300_000;

#[cfg(feature = "tokenizer")]
enum State {
    /// Not loaded; try at this time.
    Waiting {
        at_ms: u64,
        backoff_ms: u64,
    },
    /// A fetch is in flight.
    Fetching {
        backoff_ms: u64,
    },
    Loaded(Box<crate::precise::tokenizer::ModelTokenizer>),
}

/// The collector's tokenizers, by the config's tokenizer index (`None`:
/// not tokenized off the request path).
#[derive(Default)]
pub struct Tokenizing {
    #[cfg(feature = "tokenizer")]
    models: Vec<Option<State>>,
    /// Fetches in flight: call token → model index.
    fetches: HashMap<u32, usize>,
    queue: Option<u32>,
    /// The stored prefixes' byte budget (`sharedState.hashedPrefixBytes`).
    #[cfg_attr(not(feature = "tokenizer"), allow(dead_code))]
    budget: Option<std::cell::RefCell<kvroute_shared_state::hashed::Budget>>,
}

impl Tokenizing {
    /// The off-path models of `engine`'s config (none: nothing to do).
    pub fn new(engine: &Engine) -> Tokenizing {
        #[cfg(feature = "tokenizer")]
        {
            let models = engine
                .config
                .precise
                .iter()
                .flat_map(|p| p.tokenizers.iter())
                .map(|t| {
                    t.offpath.as_ref().map(|_| State::Waiting {
                        at_ms: 0,
                        backoff_ms: RETRY_FIRST_MS,
                    })
                })
                .collect();
            let ss = &engine.config.shared_state;
            Tokenizing {
                models,
                budget: Some(std::cell::RefCell::new(
                    kvroute_shared_state::hashed::Budget::new(
                        ss.hashed_prefix_slots,
                        ss.hashed_prefix_bytes,
                    ),
                )),
                ..Tokenizing::default()
            }
        }
        #[cfg(not(feature = "tokenizer"))]
        {
            let _ = engine;
            Tokenizing::default()
        }
    }

    /// Whether there is anything to load.
    pub fn active(&self) -> bool {
        #[cfg(feature = "tokenizer")]
        return self.models.iter().any(Option::is_some);
        #[cfg(not(feature = "tokenizer"))]
        false
    }

    /// The queue token, if registered.
    pub fn queue(&self) -> Option<u32> {
        self.queue
    }

    /// Whether `token` is one of this tokenizer's fetches.
    pub fn owns_call(&self, token: u32) -> bool {
        self.fetches.contains_key(&token)
    }

    /// The collecting VM's tick: register the queue, load or fetch what is
    /// not loaded, and take jobs left in the queue.
    pub fn on_tick(&mut self, host: &dyn Host, engine: &Engine, counts: &Counts, now_ms: u64) {
        if !self.active() {
            return;
        }
        if self.queue.is_none() {
            match host.register_queue(TOKENIZE_QUEUE) {
                Ok(q) => {
                    self.queue = Some(q);
                    // Reservations of jobs a VM before this one did not take.
                    if let Err(e) = kvroute_shared_state::hashed::reset_pending(host.store()) {
                        warn(host, counts, "resetting the tokenize queue's bound", e);
                    }
                }
                Err(e) => warn(host, counts, "registering the tokenize queue", e),
            }
        }
        #[cfg(feature = "tokenizer")]
        self.load(host, engine, counts, now_ms);
        if let Some(q) = self.queue {
            self.take_jobs(host, engine, counts, q, now_ms);
        }
    }

    /// `proxy_on_queue_ready`.
    pub fn on_queue_ready(
        &mut self,
        host: &dyn Host,
        engine: &Engine,
        counts: &Counts,
        queue: u32,
        now_ms: u64,
    ) {
        if self.queue == Some(queue) {
            self.take_jobs(host, engine, counts, queue, now_ms);
        }
    }

    /// Takes jobs off the queue for up to [`JOB_BUDGET_MS`] (the rest wait
    /// for the next callback or tick).
    fn take_jobs(
        &mut self,
        host: &dyn Host,
        engine: &Engine,
        counts: &Counts,
        queue: u32,
        now_ms: u64,
    ) {
        let start = host.now_ns().map(|n| n / 1_000_000).unwrap_or(now_ms);
        loop {
            let item = match host.dequeue(queue) {
                Ok(Some(b)) => b,
                Ok(None) => return,
                Err(e) => {
                    warn(host, counts, "taking a tokenize job", e);
                    return;
                }
            };
            if let Err(e) = kvroute_shared_state::hashed::release(host.store(), item.len() as u64) {
                warn(host, counts, "releasing the tokenize queue's bound", e);
            }
            self.job(host, engine, counts, &item);
            let now = host.now_ns().map(|n| n / 1_000_000).unwrap_or(start);
            if now.saturating_sub(start) >= JOB_BUDGET_MS {
                return;
            }
        }
    }

    #[cfg(feature = "tokenizer")]
    fn job(&mut self, host: &dyn Host, engine: &Engine, counts: &Counts, item: &[u8]) {
        use crate::precise::offpath::{process, Job, JobError, Tokenizing as T};
        let Some(job) = Job::decode(item) else {
            counts.inc(host, Counter::TokenizeJobsFailed);
            return;
        };
        let i = usize::from(job.model);
        let (Some(p), Some(Some(State::Loaded(tok)))) =
            (engine.config.precise.as_ref(), self.models.get(i))
        else {
            counts.inc(host, Counter::TokenizeJobsFailed);
            return;
        };
        let (Some(m), Some(budget)) = (
            p.tokenizers.get(i).and_then(|t| t.offpath.as_deref()),
            self.budget.as_ref(),
        ) else {
            return;
        };
        let t = T {
            tok,
            fingerprint: m.fingerprint,
            block_size: p.block_size,
            hasher: &p.hasher,
            max_blocks: p.max_blocks,
            budget,
        };
        match process(&job, &t, host.store()) {
            Ok(done) => {
                counts.inc(host, Counter::TokenizeJobsDone);
                counts.add(host, Counter::TokenizeBytes, done.tokenized_bytes);
            }
            Err(JobError::Store(e)) => {
                counts.inc(host, Counter::TokenizeJobsFailed);
                warn(host, counts, "storing a tokenized prefix", e);
            }
            Err(_) => counts.inc(host, Counter::TokenizeJobsFailed),
        }
    }

    #[cfg(not(feature = "tokenizer"))]
    fn job(&mut self, host: &dyn Host, _engine: &Engine, counts: &Counts, _item: &[u8]) {
        counts.inc(host, Counter::TokenizeJobsFailed);
    }

    /// Loads inline tokenizers and starts the fetches that are due.
    #[cfg(feature = "tokenizer")]
    fn load(&mut self, host: &dyn Host, engine: &Engine, counts: &Counts, now_ms: u64) {
        use crate::precise::offpath::TokenizerSource;
        let Some(p) = engine.config.precise.as_ref() else {
            return;
        };
        for (i, state) in self.models.iter_mut().enumerate() {
            let Some(State::Waiting { at_ms, backoff_ms }) = *state else {
                continue;
            };
            if now_ms < at_ms {
                continue;
            }
            let Some(m) = p.tokenizers.get(i).and_then(|t| t.offpath.as_deref()) else {
                continue;
            };
            match &m.source {
                TokenizerSource::Inline(bytes) => {
                    *state = Some(loaded(host, engine, counts, i, bytes, backoff_ms, now_ms));
                }
                TokenizerSource::Url {
                    cluster,
                    authority,
                    path,
                    timeout_ms,
                    ..
                } => {
                    let headers = [
                        (":method", "GET"),
                        (":path", path.as_str()),
                        (":authority", authority.as_str()),
                    ];
                    match host.http_call(cluster, &headers, *timeout_ms) {
                        Ok(token) => {
                            self.fetches.insert(token, i);
                            *state = Some(State::Fetching { backoff_ms });
                        }
                        Err(e) => {
                            counts.inc(host, Counter::TokenizerLoadFailures);
                            host.log(
                                Level::Error,
                                &format!("kvroute collector: cannot fetch the tokenizer of model {} from cluster {cluster}: {e}; retrying in {} s", model_name(engine, i), backoff_ms / 1000),
                            );
                            *state = Some(retry(backoff_ms, now_ms));
                        }
                    }
                }
            }
        }
    }

    /// A fetch's answer (`token` is one of [`Tokenizing::owns_call`]).
    #[allow(clippy::too_many_arguments)]
    pub fn on_http_call_response(
        &mut self,
        host: &dyn Host,
        engine: &Engine,
        counts: &Counts,
        token: u32,
        num_headers: usize,
        body_size: usize,
        now_ms: u64,
    ) {
        let Some(i) = self.fetches.remove(&token) else {
            return;
        };
        #[cfg(feature = "tokenizer")]
        {
            let backoff_ms = match self.models.get(i) {
                Some(Some(State::Fetching { backoff_ms })) => *backoff_ms,
                _ => RETRY_FIRST_MS,
            };
            let status = if num_headers == 0 {
                None
            } else {
                host.http_call_status().ok().flatten()
            };
            let next = if status.as_deref() == Some("200") {
                match host.http_call_body(body_size) {
                    Ok(Some(body)) => loaded(host, engine, counts, i, &body, backoff_ms, now_ms),
                    _ => failed(
                        host,
                        engine,
                        counts,
                        i,
                        "its body could not be read".into(),
                        backoff_ms,
                        now_ms,
                    ),
                }
            } else {
                let why = match status {
                    Some(s) => format!("the fetch answered {s}"),
                    None => "the fetch failed (no answer: connection, timeout or cluster)".into(),
                };
                failed(host, engine, counts, i, why, backoff_ms, now_ms)
            };
            if let Some(s) = self.models.get_mut(i) {
                *s = Some(next);
            }
        }
        #[cfg(not(feature = "tokenizer"))]
        let _ = (host, engine, counts, i, num_headers, body_size, now_ms);
    }
}

#[cfg(feature = "tokenizer")]
fn model_name(engine: &Engine, i: usize) -> String {
    engine
        .config
        .precise
        .as_ref()
        .and_then(|p| p.tokenizers.get(i))
        .and_then(|t| t.model_names.first().cloned())
        .unwrap_or_default()
}

#[cfg(feature = "tokenizer")]
fn retry(backoff_ms: u64, now_ms: u64) -> State {
    State::Waiting {
        at_ms: now_ms + backoff_ms,
        backoff_ms: (backoff_ms * 2).min(RETRY_MAX_MS),
    }
}

#[cfg(feature = "tokenizer")]
#[allow(clippy::too_many_arguments)]
fn failed(
    host: &dyn Host,
    engine: &Engine,
    counts: &Counts,
    i: usize,
    why: String,
    backoff_ms: u64,
    now_ms: u64,
) -> State {
    counts.inc(host, Counter::TokenizerLoadFailures);
    host.log(
        Level::Error,
        &format!(
            "kvroute collector: the tokenizer of model {} is not loaded: {why}; its text and chat prompts are routed approximately (tokenizer_loading); retrying in {} s",
            model_name(engine, i),
            backoff_ms / 1000
        ),
    );
    retry(backoff_ms, now_ms)
}

/// Loads a tokenizer from `bytes` (checking a pin) and publishes its meta.
#[cfg(feature = "tokenizer")]
#[allow(clippy::too_many_arguments)]
fn loaded(
    host: &dyn Host,
    engine: &Engine,
    counts: &Counts,
    i: usize,
    bytes: &[u8],
    backoff_ms: u64,
    now_ms: u64,
) -> State {
    use crate::precise::OffPathModel;
    let Some(m) = engine
        .config
        .precise
        .as_ref()
        .and_then(|p| p.tokenizers.get(i))
        .and_then(|t| t.offpath.as_deref())
    else {
        return retry(backoff_ms, now_ms);
    };
    let tok = match m.load(bytes) {
        Ok(t) => t,
        Err(e) => return failed(host, engine, counts, i, e, backoff_ms, now_ms),
    };
    let meta = OffPathModel::meta(&tok);
    if let Err(e) = kvroute_shared_state::hashed::put_meta(host.store(), m.fingerprint, &meta) {
        return failed(
            host,
            engine,
            counts,
            i,
            format!("its cuts could not be published: {e}"),
            backoff_ms,
            now_ms,
        );
    }
    counts.inc(host, Counter::TokenizerLoaded);
    let how = match tok.ineligible() {
        None => "by segment".to_owned(),
        Some(why) => format!("whole ({})", why.label()),
    };
    host.log(
        Level::Info,
        &format!(
            "kvroute collector: loaded the tokenizer of model {} ({} bytes); prompts are hashed {how}",
            model_name(engine, i),
            bytes.len()
        ),
    );
    State::Loaded(Box::new(tok))
}

fn warn(host: &dyn Host, counts: &Counts, what: &str, e: impl std::fmt::Display) {
    host.log(Level::Warn, &format!("kvroute collector: {what}: {e}"));
    counts.inc(host, Counter::HostErrors);
}

//! Precise mode with `tokenizeIn: collector` on the request path: the
//! prompt's text (rendered by [`Engine::facts`]) is looked up in shared
//! data for its longest hashed prefix (`precise::offpath`), and what is
//! new in it becomes a job for the collector, sent once a server accepts
//! the request (`lifecycle::Stream`).

use super::{Engine, RequestFacts};
#[cfg(feature = "tokenizer")]
use crate::precise::Fallback;
use kvroute_shared_state::Store;

/// A worker VM's copy of each off-path model's published cuts: `None`
/// until the collector published them (the tokenizer is loading).
#[cfg(feature = "tokenizer")]
pub(super) type Cuts = Option<std::sync::Arc<Option<crate::precise::segments::Segmenter>>>;

#[derive(Debug, Default)]
pub(super) struct CutCache(#[cfg(feature = "tokenizer")] std::sync::Mutex<Vec<Cuts>>);

impl Clone for CutCache {
    fn clone(&self) -> Self {
        CutCache::default()
    }
}

impl Engine {
    /// Fills `facts.precise` (and the unknown blocks) from shared data for
    /// an off-path prompt, and returns the job for the collector, encoded.
    /// A store error routes approximately (`not_hashed_yet`), without a job.
    #[cfg(feature = "tokenizer")]
    pub(super) fn resolve_offpath(
        &self,
        store: &dyn Store,
        facts: &mut RequestFacts,
    ) -> Option<Vec<u8>> {
        use crate::precise::offpath::{key_seed, worker_hashes, JobFor};
        let o = facts.offpath.take()?;
        let p = self.config.precise.as_ref()?;
        let t = p.tokenizers.get(usize::from(o.model))?;
        let m = t.offpath.as_deref()?;
        let cut = match self.cuts(store, o.model, m.fingerprint) {
            Some(c) => c,
            None => {
                facts.precise = Some(Err(Fallback::TokenizerLoading));
                return None;
            }
        };
        let seed = key_seed(
            m.fingerprint,
            p.block_size,
            &p.hasher,
            o.add_special,
            o.salt.as_deref(),
        );
        let req = JobFor {
            model: o.model,
            add_special: o.add_special,
            salt: o.salt,
        };
        let bpt = u64::from(self.config.prefix.blocks.chars_per_token.max(1));
        match worker_hashes(
            store,
            self.config.shared_state.hashed_prefix_slots,
            cut.as_ref().as_ref(),
            &o.text,
            seed,
            req,
            p.block_size,
            bpt,
        ) {
            Ok(w) => {
                facts.precise = Some(w.hashes);
                facts.precise_unknown_blocks = w.unknown_blocks;
                w.job.map(|j| j.encode())
            }
            Err(_) => {
                facts.precise = Some(Err(Fallback::NotHashedYet));
                None
            }
        }
    }

    #[cfg(not(feature = "tokenizer"))]
    pub(super) fn resolve_offpath(
        &self,
        _store: &dyn Store,
        _facts: &mut RequestFacts,
    ) -> Option<Vec<u8>> {
        None
    }

    /// The cuts the collector published for model `idx`, read once.
    #[cfg(feature = "tokenizer")]
    fn cuts(&self, store: &dyn Store, idx: u8, fingerprint: u64) -> Cuts {
        use crate::precise::segments::Segmenter;
        let mut cache = self.cuts.0.lock().unwrap_or_else(|e| e.into_inner());
        let i = usize::from(idx);
        if cache.len() <= i {
            cache.resize(i + 1, None);
        }
        if cache[i].is_none() {
            let meta = kvroute_shared_state::hashed::get_meta(store, fingerprint).ok()??;
            let seg = meta.cuts.map(|c| Segmenter::from_cuts(&c, meta.post_adds));
            cache[i] = Some(std::sync::Arc::new(seg));
        }
        cache[i].clone()
    }
}

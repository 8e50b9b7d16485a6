//! The models and LoRA adapters each endpoint serves, written by the
//! collector only (`kvroute/models`).
//!
//! Two reports feed one endpoint's list, each replacing only its own part:
//!
//! - its `/metrics` ([`Source::Metrics`]): the served model names of the
//!   `model_name` labels, and vLLM's `vllm:lora_requests_info` (the adapters
//!   running and waiting, and `max_lora`, the adapter slots);
//! - its `/v1/models` ([`Source::Listing`]): the base models (cards without
//!   a `parent`) and every loaded adapter (cards with one), idle ones
//!   included, with each adapter's path (its card's `root`, the server's
//!   `--lora-modules name=path`): vLLM hashes an adapter's blocks with it,
//!   so precise mode needs it ([`EndpointModels::adapter_path`]).
//!
//! An endpoint with no list ([`EndpointModels::known`] false: never
//! reported, or a new generation of its slot) is taken to serve any model.
//!
//! # Bounds
//!
//! At most [`MAX_NAMES`] names per endpoint, each at most [`MAX_NAME_BYTES`]
//! bytes. A report with more, or a longer name, sets
//! [`EndpointModels::overflow`] and keeps what fits: such an endpoint is
//! taken to serve any model it does not list (kvroute cannot tell).
//! Adapter paths: each at most [`MAX_PATH_BYTES`], and at most
//! [`MAX_PATH_BYTES_PER_ENDPOINT`] for all of an endpoint's paths
//! together, in the listing's order; a path that does not fit is not kept
//! (the adapter's path is unknown there, and precise mode falls back for
//! it). With [`crate::MAX_ENDPOINTS`] slots the value is at most about
//! 3.3 MB (1024 × (16 × 133 + 1024 + 6) bytes); a fleet of 8 endpoints with
//! two names and a 40-byte path each takes about 1.5 KB.

use crate::codec::{Reader, Writer};
use crate::MAX_ENDPOINTS;

/// The key of the models table.
pub const MODELS_KEY: &str = "kvroute/models";
/// Most names kept per endpoint (base models and adapters together).
pub const MAX_NAMES: usize = 16;
/// Longest name kept, bytes.
pub const MAX_NAME_BYTES: usize = 128;
/// Longest adapter path kept, bytes.
pub const MAX_PATH_BYTES: usize = 512;
/// Most adapter path bytes kept per endpoint, all its paths together.
pub const MAX_PATH_BYTES_PER_ENDPOINT: usize = 1024;

/// Bumped when the layout changes, so a table of another layout reads as empty.
const MAGIC: u8 = 0x52;

/// What one endpoint reports about a name (bits).
pub mod flags {
    /// A `model_name` label of its `/metrics`: a served base model.
    pub const METRICS_BASE: u8 = 1;
    /// A `/v1/models` card without `parent`: a served base model.
    pub const LISTED_BASE: u8 = 2;
    /// A `/v1/models` card with a `parent`: a loaded LoRA adapter.
    pub const LISTED_ADAPTER: u8 = 4;
    /// In `vllm:lora_requests_info{running_lora_adapters}`.
    pub const RUNNING: u8 = 8;
    /// In `vllm:lora_requests_info{waiting_lora_adapters}`.
    pub const WAITING: u8 = 16;
    /// The bits a `/metrics` report sets.
    pub const FROM_METRICS: u8 = METRICS_BASE | RUNNING | WAITING;
    /// The bits a `/v1/models` report sets.
    pub const FROM_LISTING: u8 = LISTED_BASE | LISTED_ADAPTER;
    /// A base model, by either report.
    pub const BASE: u8 = METRICS_BASE | LISTED_BASE;
    /// An adapter, by either report.
    pub const ADAPTER: u8 = LISTED_ADAPTER | RUNNING | WAITING;
}

/// Which report an update carries.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Source {
    Metrics,
    Listing,
}

impl Source {
    fn bits(self) -> u8 {
        match self {
            Source::Metrics => flags::FROM_METRICS,
            Source::Listing => flags::FROM_LISTING,
        }
    }
}

/// One name an endpoint serves and what reported it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ModelName {
    pub name: String,
    pub flags: u8,
    /// A listed adapter's path (its `/v1/models` card's `root`); `None`:
    /// not listed with one, or over the bounds.
    pub path: Option<String>,
}

/// One endpoint's models and adapters.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct EndpointModels {
    pub generation: u16,
    /// A report with names arrived for this generation.
    pub known: bool,
    /// A report had more than [`MAX_NAMES`] names or a name longer than
    /// [`MAX_NAME_BYTES`]: names not listed may still be served.
    pub overflow: bool,
    /// `vllm:lora_requests_info{max_lora}`: adapter slots (0 = not reported).
    pub max_lora: u16,
    pub names: Vec<ModelName>,
}

/// What an endpoint knows of an adapter's path (precise mode's LoRA key).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AdapterPath<'a> {
    /// The endpoint does not list the name as an adapter.
    NotAdapter,
    /// It lists it as an adapter, but its path is not known (not in
    /// `/v1/models`, only in `/metrics`, or over the bounds).
    Unknown,
    /// It lists it as an adapter loaded from this path.
    Path(&'a str),
}

/// How an endpoint stands towards a requested model name.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Serves {
    /// Nothing is known of the endpoint's models: taken to serve it.
    Unknown,
    /// It serves the name as a base model.
    Base,
    /// It has the name loaded as a LoRA adapter; `running`/`waiting` say
    /// whether `vllm:lora_requests_info` lists it so.
    Adapter { running: bool, waiting: bool },
    /// It does not list the name, but its list overflowed: it may.
    Maybe,
    /// It does not serve the name.
    No,
}

impl Serves {
    /// Whether the endpoint may be sent the request.
    pub fn may_serve(self) -> bool {
        !matches!(self, Serves::No)
    }
}

impl EndpointModels {
    /// How this endpoint stands towards `model`.
    pub fn serves(&self, model: &str) -> Serves {
        if !self.known {
            return Serves::Unknown;
        }
        match self.names.iter().find(|n| n.name == model) {
            Some(n) if n.flags & flags::BASE != 0 => Serves::Base,
            Some(n) => Serves::Adapter {
                running: n.flags & flags::RUNNING != 0,
                waiting: n.flags & flags::WAITING != 0,
            },
            None if self.overflow => Serves::Maybe,
            None => Serves::No,
        }
    }

    /// The path `model` is loaded from here, if it is an adapter.
    pub fn adapter_path(&self, model: &str) -> AdapterPath<'_> {
        match self.names.iter().find(|n| n.name == model) {
            Some(n) if n.flags & flags::BASE == 0 => match &n.path {
                Some(p) => AdapterPath::Path(p),
                None => AdapterPath::Unknown,
            },
            _ => AdapterPath::NotAdapter,
        }
    }

    /// Replaces the adapters' paths with a listing's (`(name, path)`, in
    /// its order), within the bounds: a name not kept, not an adapter
    /// here, or whose path does not fit keeps no path. Returns true if
    /// anything changed. Call it after the listing's [`apply`](Self::apply),
    /// which drops a listed-only adapter's path with its entry.
    pub fn set_adapter_paths(&mut self, paths: &[(&str, &str)]) -> bool {
        let before: Vec<Option<String>> = self.names.iter_mut().map(|n| n.path.take()).collect();
        let mut budget = MAX_PATH_BYTES_PER_ENDPOINT;
        for &(name, path) in paths {
            if path.is_empty() || path.len() > MAX_PATH_BYTES || path.len() > budget {
                continue;
            }
            if let Some(n) = self.names.iter_mut().find(|n| {
                n.name == name && n.flags & flags::LISTED_ADAPTER != 0 && n.path.is_none()
            }) {
                n.path = Some(path.to_string());
                budget -= path.len();
            }
        }
        self.names.iter().map(|n| &n.path).ne(before.iter())
    }

    /// Distinct adapters running or waiting (llm-d's count of active
    /// adapters, against `max_lora`).
    pub fn active_adapters(&self) -> usize {
        self.names
            .iter()
            .filter(|n| n.flags & (flags::RUNNING | flags::WAITING) != 0)
            .count()
    }

    /// Replaces `source`'s part of the list with `names` (each with the
    /// bits of `source` it carries) and, for `/metrics`, `max_lora`.
    /// Returns true if anything changed.
    pub fn apply(&mut self, source: Source, names: &[(&str, u8)], max_lora: Option<u16>) -> bool {
        let before = self.clone();
        let mask = source.bits();
        for n in &mut self.names {
            n.flags &= !mask;
        }
        self.names.retain(|n| n.flags != 0);
        // Overflow is judged again on every report.
        self.overflow = false;
        for &(name, bits) in names {
            let bits = bits & mask;
            if bits == 0 || name.is_empty() {
                continue;
            }
            if name.len() > MAX_NAME_BYTES {
                self.overflow = true;
                continue;
            }
            if let Some(n) = self.names.iter_mut().find(|n| n.name == name) {
                n.flags |= bits;
            } else if self.names.len() < MAX_NAMES {
                self.names.push(ModelName {
                    name: name.to_string(),
                    flags: bits,
                    path: None,
                });
            } else {
                self.overflow = true;
            }
        }
        if source == Source::Metrics {
            self.max_lora = max_lora.unwrap_or(0);
        }
        self.known = self.known || !self.names.is_empty() || self.overflow;
        *self != before
    }
}

/// The models of every endpoint slot.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ModelsTable {
    pub slots: Vec<EndpointModels>,
}

impl ModelsTable {
    pub fn encode(&self) -> Vec<u8> {
        let mut w = Writer::with_capacity(3 + self.slots.len() * 8);
        w.u8(MAGIC);
        w.u16(self.slots.len() as u16);
        for m in &self.slots {
            w.u16(m.generation);
            w.u8(u8::from(m.known) | (u8::from(m.overflow) << 1));
            w.u16(m.max_lora);
            w.u8(m.names.len().min(MAX_NAMES) as u8);
            for n in m.names.iter().take(MAX_NAMES) {
                w.u8(n.flags);
                w.bytes(&n.name.as_bytes()[..n.name.len().min(MAX_NAME_BYTES)]);
                // Empty: no path (vLLM refuses an empty one). A path over
                // the bound is not kept by `set_adapter_paths`.
                let p = n.path.as_deref().filter(|p| p.len() <= MAX_PATH_BYTES);
                w.bytes(p.unwrap_or("").as_bytes());
            }
        }
        w.buf
    }

    /// The table in `bytes`; empty if missing or not this layout.
    pub fn decode(bytes: Option<&[u8]>) -> ModelsTable {
        bytes.and_then(Self::try_decode).unwrap_or_default()
    }

    fn try_decode(bytes: &[u8]) -> Option<ModelsTable> {
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
            let generation = r.u16()?;
            let bits = r.u8()?;
            let max_lora = r.u16()?;
            let count = r.u8()? as usize;
            if count > MAX_NAMES {
                return None;
            }
            let mut names = Vec::with_capacity(count);
            for _ in 0..count {
                let flags = r.u8()?;
                let name = r.bytes()?;
                if name.len() > MAX_NAME_BYTES {
                    return None;
                }
                let path = r.bytes()?;
                if path.len() > MAX_PATH_BYTES {
                    return None;
                }
                names.push(ModelName {
                    name: String::from_utf8(name.to_vec()).ok()?,
                    flags,
                    path: if path.is_empty() {
                        None
                    } else {
                        Some(String::from_utf8(path.to_vec()).ok()?)
                    },
                });
            }
            slots.push(EndpointModels {
                generation,
                known: bits & 1 != 0,
                overflow: bits & 2 != 0,
                max_lora,
                names,
            });
        }
        r.is_empty().then_some(ModelsTable { slots })
    }

    /// The models of `slot` if they belong to `generation`.
    pub fn get(&self, slot: u16, generation: u16) -> Option<&EndpointModels> {
        self.slots
            .get(slot as usize)
            .filter(|m| m.generation == generation)
    }

    /// The models of `slot`, reset for a new generation.
    pub fn entry(&mut self, slot: u16, generation: u16) -> Option<&mut EndpointModels> {
        let s = slot as usize;
        if s >= MAX_ENDPOINTS {
            return None;
        }
        if self.slots.len() <= s {
            self.slots.resize(s + 1, EndpointModels::default());
        }
        let m = &mut self.slots[s];
        if m.generation != generation {
            *m = EndpointModels {
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
    fn serves_by_source_and_round_trip() {
        let mut t = ModelsTable::default();
        let m = t.entry(1, 3).unwrap();
        assert_eq!(m.serves("x"), Serves::Unknown);
        assert!(m.apply(
            Source::Metrics,
            &[
                ("base", flags::METRICS_BASE),
                ("sql", flags::RUNNING),
                ("chat", flags::WAITING | flags::RUNNING)
            ],
            Some(4)
        ));
        assert!(m.apply(
            Source::Listing,
            &[
                ("base", flags::LISTED_BASE),
                ("idle", flags::LISTED_ADAPTER),
                ("sql", flags::LISTED_ADAPTER)
            ],
            None
        ));
        assert_eq!(m.max_lora, 4, "a listing keeps max_lora");
        assert!(m.set_adapter_paths(&[
            ("idle", "/adapters/idle"),
            ("sql", "/adapters/sql"),
            ("base", "/models/base"),
            ("chat", "/adapters/chat")
        ]));
        assert!(!m.set_adapter_paths(&[("idle", "/adapters/idle"), ("sql", "/adapters/sql")]));
        assert_eq!(m.adapter_path("sql"), AdapterPath::Path("/adapters/sql"));
        // A base model and an adapter only /metrics reports have no path.
        assert_eq!(m.adapter_path("base"), AdapterPath::NotAdapter);
        assert_eq!(m.adapter_path("chat"), AdapterPath::Unknown);
        assert_eq!(m.adapter_path("other"), AdapterPath::NotAdapter);
        assert_eq!(m.serves("base"), Serves::Base);
        assert_eq!(
            m.serves("sql"),
            Serves::Adapter {
                running: true,
                waiting: false
            }
        );
        assert_eq!(
            m.serves("idle"),
            Serves::Adapter {
                running: false,
                waiting: false
            }
        );
        assert_eq!(m.serves("other"), Serves::No);
        assert_eq!(m.active_adapters(), 2);
        // The same report again changes nothing (a listing's names and
        // paths are written together, and compared whole).
        let before = m.clone();
        m.apply(
            Source::Listing,
            &[("base", 2), ("idle", 4), ("sql", 4)],
            None,
        );
        m.set_adapter_paths(&[("idle", "/adapters/idle"), ("sql", "/adapters/sql")]);
        assert_eq!(*m, before);
        assert_eq!(m.adapter_path("idle"), AdapterPath::Path("/adapters/idle"));
        // The next /metrics: nothing running; "chat" was only there.
        assert!(m.apply(Source::Metrics, &[("base", flags::METRICS_BASE)], Some(4)));
        assert_eq!(m.serves("chat"), Serves::No);
        assert_eq!(m.active_adapters(), 0);
        let enc = t.encode();
        let d = ModelsTable::decode(Some(&enc));
        assert_eq!(d, t);
        assert!(d.get(1, 3).unwrap().serves("idle").may_serve());
        assert_eq!(d.get(1, 4), None);
        assert_eq!(d.get(0, 0).unwrap().serves("x"), Serves::Unknown);
        // A new generation starts unknown.
        assert_eq!(t.entry(1, 4).unwrap().serves("base"), Serves::Unknown);
        // Garbage and truncation read as empty.
        assert_eq!(ModelsTable::decode(Some(b"xx")), ModelsTable::default());
        assert_eq!(
            ModelsTable::decode(Some(&enc[..enc.len() - 1])),
            ModelsTable::default()
        );
    }

    #[test]
    fn bounded_names_and_overflow() {
        let mut t = ModelsTable::default();
        let long = "x".repeat(MAX_NAME_BYTES + 1);
        let many: Vec<String> = (0..MAX_NAMES + 5).map(|i| format!("lora-{i}")).collect();
        let mut names: Vec<(&str, u8)> = many
            .iter()
            .map(|n| (n.as_str(), flags::LISTED_ADAPTER))
            .collect();
        names.push((&long, flags::LISTED_BASE));
        // Paths: one over the per-path bound, then ones of 300 bytes until
        // the per-endpoint budget is spent.
        let too_long = format!("/{}", "p".repeat(MAX_PATH_BYTES));
        let paths_owned: Vec<String> = (0..many.len())
            .map(|i| {
                if i == 0 {
                    too_long.clone()
                } else {
                    format!("/{i:0>299}")
                }
            })
            .collect();
        let paths: Vec<(&str, &str)> = many
            .iter()
            .zip(&paths_owned)
            .map(|(n, p)| (n.as_str(), p.as_str()))
            .collect();
        for slot in 0..MAX_ENDPOINTS as u16 {
            let m = t.entry(slot, 1).unwrap();
            m.apply(Source::Listing, &names, None);
            m.set_adapter_paths(&paths);
            assert_eq!(m.names.len(), MAX_NAMES);
            assert!(m.overflow);
            let kept: usize = m
                .names
                .iter()
                .filter_map(|n| n.path.as_ref())
                .map(|p| p.len())
                .sum();
            assert!(kept <= MAX_PATH_BYTES_PER_ENDPOINT, "{kept}");
        }
        let m = t.get(0, 1).unwrap();
        // Too long for the bound: unknown; then three of 300 bytes fit.
        assert_eq!(m.adapter_path("lora-0"), AdapterPath::Unknown);
        assert_eq!(
            m.adapter_path("lora-1"),
            AdapterPath::Path(paths_owned[1].as_str())
        );
        assert_eq!(
            m.adapter_path("lora-3"),
            AdapterPath::Path(paths_owned[3].as_str())
        );
        assert_eq!(m.adapter_path("lora-4"), AdapterPath::Unknown);
        assert!(t.entry(MAX_ENDPOINTS as u16, 1).is_none());
        let m = t.get(0, 1).unwrap();
        assert_eq!(
            m.serves("lora-0"),
            Serves::Adapter {
                running: false,
                waiting: false
            }
        );
        // Not kept, but the list overflowed: it may serve them.
        assert_eq!(m.serves(&long), Serves::Maybe);
        assert_eq!(m.serves(&many[MAX_NAMES]), Serves::Maybe);
        let enc = t.encode();
        // The documented bound: 16 names of at most 128 bytes per slot, and
        // at most 1024 path bytes (each path's length 2 bytes).
        let bound = 3 + MAX_ENDPOINTS
            * (6 + MAX_NAMES * (3 + MAX_NAME_BYTES + 2) + MAX_PATH_BYTES_PER_ENDPOINT);
        assert!(enc.len() <= bound, "{} > {bound}", enc.len());
        assert!(bound < 3_300_000, "{bound}");
        assert_eq!(ModelsTable::decode(Some(&enc)), t);
        // A later report that fits clears the overflow.
        let m = t.entry(0, 1).unwrap();
        m.apply(Source::Listing, &[("base", flags::LISTED_BASE)], None);
        assert!(!m.overflow);
        assert_eq!(m.names.len(), 1);
        assert_eq!(m.serves("lora-0"), Serves::No);
    }
}

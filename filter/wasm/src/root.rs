//! The root context: reads the configuration, then acts as the filter's
//! root (creating one [`RouteContext`](crate::http::RouteContext) per
//! request) or as the collector, by `plugin_root_id`.

use crate::collector::Collector;
use crate::host::{self, Buffer, Level};
use crate::http::RouteContext;
use crate::stats::{Stats, FLUSH_PERIOD_MS};
use crate::COLLECTOR_ROOT_ID;
use kvroute_core::config::Config;
use kvroute_core::engine::Engine;
use kvroute_core::scheduling::Rng;
use std::cell::RefCell;
use std::rc::Rc;

/// What a worker VM shares between its requests.
pub struct Shared {
    pub engine: Engine,
    pub rng: RefCell<Rng>,
    pub stats: Stats,
}

#[derive(Default)]
pub struct Root {
    shared: Option<Rc<Shared>>,
    collector: Option<Collector>,
}

impl Root {
    /// The root context's end: hand over what was counted since the last tick.
    pub fn on_delete(&self) {
        if let Some(s) = &self.shared {
            s.stats.flush();
        }
    }

    pub fn on_http_call_response(&mut self, token_id: u32, num_headers: usize, body_size: usize) {
        if let Some(c) = self.collector.as_mut() {
            c.on_http_call_response(token_id, num_headers, body_size);
        }
    }

    pub fn on_configure(&mut self, plugin_configuration_size: usize) -> bool {
        let bytes =
            match host::get_buffer(Buffer::PluginConfiguration, 0, plugin_configuration_size) {
                Ok(Some(b)) => b,
                Ok(None) => Vec::new(),
                Err(e) => {
                    host::log(
                        Level::Error,
                        &format!("kvroute: cannot read the plugin configuration: {e}"),
                    );
                    return false;
                }
            };
        let config = match Config::from_json(&bytes) {
            Ok(c) => c,
            Err(e) => {
                host::log(Level::Error, &format!("kvroute: {e}"));
                return false;
            }
        };
        let root_id = host::get_property(&["plugin_root_id"])
            .ok()
            .flatten()
            .unwrap_or_default();
        let engine = Engine::new(config);
        if root_id == COLLECTOR_ROOT_ID.as_bytes() {
            match Collector::start(engine, Stats::define()) {
                Ok(c) => self.collector = Some(c),
                Err(e) => {
                    host::log(Level::Error, &format!("kvroute collector: {e}"));
                    return false;
                }
            }
            host::log(Level::Info, "kvroute collector configured");
        } else {
            if let Err(e) = engine.ensure_tables(&host::HostStore) {
                host::log(
                    Level::Warn,
                    &format!("kvroute: cannot create the shared tables: {e}"),
                );
            }
            let seed = engine
                .config
                .routing
                .seed
                .unwrap_or_else(|| host::now_ns().unwrap_or(0) ^ 0x6b76_726f_7574_6521);
            // Counts go to Envoy on the tick; without a tick, at once.
            let stats = match host::set_tick_period_ms(FLUSH_PERIOD_MS) {
                Ok(()) => Stats::define_batched(),
                Err(e) => {
                    host::log(
                        Level::Warn,
                        &format!("kvroute: no tick ({e}); counters are sent per request"),
                    );
                    Stats::define()
                }
            };
            self.shared = Some(Rc::new(Shared {
                engine,
                rng: RefCell::new(Rng::new(seed)),
                stats,
            }));
            host::log(Level::Info, "kvroute filter configured");
        }
        true
    }

    pub fn on_tick(&mut self) {
        if let Some(c) = self.collector.as_mut() {
            c.on_tick();
        }
        if let Some(s) = &self.shared {
            s.stats.flush();
        }
    }

    /// A request's context.
    pub fn new_stream(&self) -> RouteContext {
        RouteContext::new(self.shared.clone())
    }
}

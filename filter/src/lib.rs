//! kvroute's proxy-wasm filter: a thin adapter between Envoy and `kvroute-core`.
//!
//! One module serves two roots in one VM group (same `vm_id`): the singleton scraping
//! service (`root_id: kvroute.scraper`, an `envoy.bootstrap.wasm` service) and the HTTP
//! filter on each worker (any other `root_id`). Both read the same JSON configuration.
//! The service, when there is one, runs the `Poller` (discovery, scrapes, the published
//! fleet state); without it one worker does, elected by a lease (`lease`).

pub mod clock;
pub mod gauges;
pub mod hold;
pub mod homes;
pub mod host;
pub mod http;
pub mod lease;
pub mod mesh;
pub mod peers;
pub mod poller;
pub mod post_budget;
pub mod replicas;
pub mod stats;
pub mod worker;

use kvroute_core::Config;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{BufferType, ContextType, LogLevel};

use crate::http::Http;
use crate::lease::Lease;
use crate::poller::Poller;
use crate::worker::Worker;

/// The header Envoy's `override_host` / `ORIGINAL_DST` cluster reads.
pub const DESTINATION_HEADER: &str = "x-gateway-destination-endpoint";
/// The header that carries the replicas' shared secret on forwarded placements.
pub const PEER_SECRET_HEADER: &str = "x-kvroute-peer-secret";
/// The `root_id` that makes a root context the scraping service.
pub const SCRAPER_ROOT_ID: &str = "kvroute.scraper";

proxy_wasm::main! {{
    proxy_wasm::set_log_level(LogLevel::Info);
    std::panic::set_hook(Box::new(|info| host::log(LogLevel::Critical, &format!("kvroute panicked: {info}"))));
    proxy_wasm::set_root_context(|_| -> Box<dyn RootContext> { Box::new(Root::Unconfigured) });
}}

enum Root {
    Unconfigured,
    Service(Box<Service>),
    Worker(Box<Worker>),
}

/// The singleton service: holds the polling lease (it outranks every worker) and polls.
struct Service {
    poller: Poller,
    lease: Option<Lease>,
}

impl Service {
    fn on_tick(&mut self) {
        let now = host::now();
        if let Some(lease) = self.lease.as_mut() {
            lease.on_tick(now);
        }
        self.poller.on_tick(now);
    }
}

impl Context for Root {
    fn on_http_call_response(&mut self, token_id: u32, num_headers: usize, body_size: usize, _num_trailers: usize) {
        match self {
            Root::Service(s) => {
                s.poller.on_http_call_response(token_id, num_headers, body_size);
            }
            Root::Worker(w) => w.on_http_call_response(token_id, num_headers, body_size),
            Root::Unconfigured => {}
        }
    }
}

impl RootContext for Root {
    fn on_configure(&mut self, plugin_configuration_size: usize) -> bool {
        let bytes = host::buffer(BufferType::PluginConfiguration, 0, plugin_configuration_size).unwrap_or_default();
        let config = match Config::from_json(&bytes) {
            Ok(c) => c,
            Err(e) => {
                host::log(LogLevel::Critical, &e.to_string());
                return false;
            }
        };
        let root_id = host::property_string(&["plugin_root_id"]).unwrap_or_default();
        *self = if root_id == SCRAPER_ROOT_ID {
            peers::service_started_here();
            if host::set_tick_period_ms(Poller::service_tick_ms(&config)).is_err() {
                host::log(
                    LogLevel::Error,
                    "could not set the poller's tick; nothing will be scraped",
                );
            }
            let mut lease = Lease::new(true, config.discovery().lease_ms);
            // Take it now, before a worker that starts first does.
            if let Some(lease) = lease.as_mut() {
                lease.on_tick(host::now());
            }
            Root::Service(Box::new(Service {
                poller: Poller::new(config),
                lease,
            }))
        } else {
            Root::Worker(Box::new(Worker::new(config)))
        };
        true
    }

    fn on_tick(&mut self) {
        match self {
            Root::Service(s) => s.on_tick(),
            Root::Worker(w) => w.on_tick(),
            Root::Unconfigured => {}
        }
    }

    fn create_http_context(&self, context_id: u32) -> Option<Box<dyn HttpContext>> {
        // Always a context: even an unconfigured filter must strip client routing headers.
        let shared = match self {
            Root::Worker(w) => Some(w.shared()),
            _ => None,
        };
        Some(Box::new(Http::new(shared, context_id)))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

//! The worker VMs' root context: owns this VM's `Router`, shared with its HTTP contexts,
//! and on its own tick applies the scraping service's snapshot (decoding only when the
//! version changed) and exchanges placements and load with the other workers of this
//! Envoy (`mesh`), so the request path makes no host call for state.

use std::cell::{Cell, RefCell};
use std::rc::Rc;

use kvroute_core::{Config, EndpointId, Millis, Router, VllmMetrics};
use prost::Message;
use proxy_wasm::types::LogLevel;

use crate::host;
use crate::peers::Peers;
use crate::snapshot::{Snapshot, SNAPSHOT_KEY, VERSION_KEY};
use crate::stats::RequestStats;

/// Gauges are refreshed at most this often (the tick can be much faster).
const STATS_EVERY_MS: u64 = 100;

/// What HTTP contexts of one worker VM share.
pub struct Shared {
    pub router: RefCell<Router>,
    pub stats: RequestStats,
    pub peers: Peers,
    next_request: Cell<u64>,
    prompt_tokens: Cell<u64>,
    predicted_cached: Cell<u64>,
}

impl Shared {
    pub fn next_request_id(&self) -> u64 {
        let id = self.next_request.get();
        self.next_request.set(id.wrapping_add(1));
        id
    }

    /// Counts a routed request's prompt and the part the index predicted cached.
    pub fn count_tokens(&self, prompt: u64, predicted_cached: u64) {
        self.prompt_tokens.set(self.prompt_tokens.get().saturating_add(prompt));
        self.predicted_cached
            .set(self.predicted_cached.get().saturating_add(predicted_cached));
        self.stats.prompt_tokens.add(prompt);
        self.stats.predicted_cached_tokens.add(predicted_cached);
    }
}

pub struct Worker {
    shared: Rc<Shared>,
    seen_version: u64,
    published_at: Millis,
    reported_entries: Cell<u64>,
    reported_inflight: Cell<u64>,
    stats_at: Millis,
}

impl Worker {
    pub fn new(config: Config) -> Worker {
        let mut router = Router::new(config);
        let peers = Peers::join(&mut router);
        if host::set_tick_period_ms(peers.tick_ms()).is_err() {
            host::log(
                LogLevel::Error,
                "could not set the snapshot tick; routing will fall back",
            );
        }
        let shared = Shared {
            router: RefCell::new(router),
            stats: RequestStats::define(),
            peers,
            next_request: Cell::new(0),
            prompt_tokens: Cell::new(0),
            predicted_cached: Cell::new(0),
        };
        Worker {
            shared: Rc::new(shared),
            seen_version: 0,
            published_at: Millis(0),
            reported_entries: Cell::new(0),
            reported_inflight: Cell::new(0),
            stats_at: Millis(0),
        }
    }

    pub fn shared(&self) -> Rc<Shared> {
        Rc::clone(&self.shared)
    }

    pub fn on_tick(&mut self) {
        let now = host::now();
        self.poll_snapshot();
        if let Ok(mut router) = self.shared.router.try_borrow_mut() {
            self.shared.peers.on_tick(&mut router, &self.shared.stats, now);
        }
        if now.since(self.stats_at) >= STATS_EVERY_MS {
            self.stats_at = now;
            self.report_gauges(now);
        }
    }

    fn report_gauges(&self, now: Millis) {
        if self.published_at.0 > 0 {
            self.shared.stats.snapshot_age_ms.set(now.since(self.published_at));
        }
        // Summed over the worker VMs: each adds its change since its last report.
        if let Ok(router) = self.shared.router.try_borrow() {
            let stats = &self.shared.stats;
            stats
                .index_entries
                .contribute(&self.reported_entries, router.index().entries() as u64);
            stats
                .inflight
                .contribute(&self.reported_inflight, router.inflight_requests() as u64);
        }
        let cached = self.shared.predicted_cached.get().saturating_mul(1000);
        if let Some(permille) = cached.checked_div(self.shared.prompt_tokens.get()) {
            self.shared.stats.estimated_hit_permille.set(permille);
        }
    }

    fn poll_snapshot(&mut self) {
        let version = match host::shared_data(VERSION_KEY) {
            Ok(Some(bytes)) => bytes.try_into().map(u64::from_le_bytes).unwrap_or(0),
            _ => return,
        };
        if version == self.seen_version {
            return;
        }
        let Ok(Some(bytes)) = host::shared_data(SNAPSHOT_KEY) else {
            return;
        };
        match Snapshot::decode(bytes.as_slice()) {
            Ok(snapshot) => {
                self.seen_version = version;
                self.published_at = Millis(snapshot.published_at_ms);
                self.apply(snapshot);
            }
            Err(e) => host::log(LogLevel::Error, &format!("cannot decode the metrics snapshot: {e}")),
        }
    }

    fn apply(&self, snapshot: Snapshot) {
        let Ok(mut router) = self.shared.router.try_borrow_mut() else {
            return;
        };
        for e in snapshot.endpoints {
            let id = EndpointId::new(e.address);
            let known_at = router
                .endpoints()
                .iter()
                .find(|row| row.id == id)
                .and_then(|row| row.scraped_at);
            if let Some(m) = e.metrics {
                if e.scraped_at_ms > 0 && known_at.is_none_or(|t| t.0 < e.scraped_at_ms) {
                    router.on_metrics(&id, VllmMetrics::from(m), Millis(e.scraped_at_ms));
                }
            }
            router.on_active_health(&id, e.healthy);
        }
    }
}

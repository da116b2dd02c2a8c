//! The worker VMs' root context: owns this VM's `Router`, shared with its HTTP contexts,
//! and on its own tick applies the published fleet state (decoding only when the version
//! changed) and exchanges placements and load with the other workers of this Envoy
//! (`mesh`), so the request path makes no host call for state. Without a singleton
//! service, the worker that holds the lease (`lease`) also runs the `Poller`.

use std::cell::{Cell, RefCell};
use std::rc::Rc;

use kvroute_core::capture::Capturer;
use kvroute_core::{Config, FleetState, Millis, Router};
use proxy_wasm::types::LogLevel;

use crate::host;
use crate::lease::Lease;
use crate::peers::Peers;
use crate::poller::{read_version, Poller, SNAPSHOT_KEY};
use crate::stats::RequestStats;

/// Gauges are refreshed at most this often (the tick can be much faster).
const STATS_EVERY_MS: u64 = 100;

/// What HTTP contexts of one worker VM share.
pub struct Shared {
    pub router: RefCell<Router>,
    pub stats: RequestStats,
    pub peers: Peers,
    /// Traffic capture (`capture`), when on.
    pub capture: Option<Capturer>,
    next_request: Cell<u64>,
    prompt_tokens: Cell<u64>,
    predicted_cached: Cell<u64>,
    /// The fleet state version applied last, when it was published, and when it was
    /// last looked for.
    seen_version: Cell<u64>,
    published_at: Cell<Millis>,
    looked_at: Cell<Millis>,
}

/// The request path looks for a new fleet state itself when the tick has not for this long
/// (a VM Envoy reloaded after a crash gets no tick).
const TICK_MISSING_MS: u64 = 250;

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

    /// Before routing: applies a new fleet state if the tick has stopped doing it.
    pub fn catch_up(&self, router: &mut Router, now: Millis) {
        if now.since(self.looked_at.get()) >= TICK_MISSING_MS {
            self.apply_fleet_state(router, now);
        }
    }

    /// Applies the published fleet state if its version is new (decoding only then).
    fn apply_fleet_state(&self, router: &mut Router, now: Millis) {
        self.looked_at.set(now);
        let version = read_version();
        if version == 0 || version == self.seen_version.get() {
            return;
        }
        let Ok(Some(bytes)) = host::shared_data(SNAPSHOT_KEY) else {
            return;
        };
        match postcard::from_bytes::<FleetState>(&bytes) {
            Ok(state) => {
                self.seen_version.set(version);
                self.published_at.set(state.published_at);
                router.on_fleet(&state);
            }
            Err(e) => host::log(LogLevel::Error, &format!("cannot decode the fleet state: {e}")),
        }
    }
}

pub struct Worker {
    shared: Rc<Shared>,
    reported_entries: Cell<u64>,
    reported_inflight: Cell<u64>,
    stats_at: Millis,
    lease: Option<Lease>,
    poller: Option<Poller>,
    config: Config,
}

impl Worker {
    pub fn new(config: Config) -> Worker {
        let mut router = Router::new(config.clone());
        let peers = Peers::join(&mut router);
        let lease = Lease::new(false, config.discovery().lease_ms);
        if lease.is_none() {
            host::log(
                LogLevel::Warn,
                "cannot take part in the polling lease; this worker only reads the fleet state",
            );
        }
        let tick = peers.tick_ms().min(Poller::tick_ms(&config));
        if host::set_tick_period_ms(tick).is_err() {
            host::log(
                LogLevel::Error,
                "could not set the snapshot tick; routing will fall back",
            );
        }
        let shared = Shared {
            router: RefCell::new(router),
            stats: RequestStats::define(),
            peers,
            capture: Capturer::new(config.capture(), config.hashing().block_bytes),
            next_request: Cell::new(0),
            prompt_tokens: Cell::new(0),
            predicted_cached: Cell::new(0),
            seen_version: Cell::new(0),
            published_at: Cell::new(Millis(0)),
            looked_at: Cell::new(Millis(0)),
        };
        Worker {
            shared: Rc::new(shared),
            reported_entries: Cell::new(0),
            reported_inflight: Cell::new(0),
            stats_at: Millis(0),
            lease,
            poller: None,
            config,
        }
    }

    /// Hands an HTTP call's answer to the poller, if this worker runs it.
    pub fn on_http_call_response(&mut self, token: u32, body_size: usize) {
        if let Some(poller) = self.poller.as_mut() {
            poller.on_http_call_response(token, body_size);
        }
    }

    /// Takes, keeps or gives up the polling lease, and polls while holding it.
    fn poll_if_leader(&mut self, now: Millis) {
        let Some(lease) = self.lease.as_mut() else {
            return;
        };
        let held = lease.on_tick(now);
        match (held, self.poller.is_some()) {
            (true, false) => {
                host::log(LogLevel::Info, "this worker took the polling lease");
                self.shared.stats.lease_taken.inc();
                self.poller = Some(Poller::new(self.config.clone()));
            }
            (false, true) => {
                host::log(LogLevel::Info, "this worker gave up the polling lease");
                self.poller = None;
            }
            _ => {}
        }
        if let Some(poller) = self.poller.as_mut() {
            poller.on_tick(now);
        }
    }

    pub fn shared(&self) -> Rc<Shared> {
        Rc::clone(&self.shared)
    }

    pub fn on_tick(&mut self) {
        let now = host::now();
        self.poll_if_leader(now);
        if let Ok(mut router) = self.shared.router.try_borrow_mut() {
            self.shared.apply_fleet_state(&mut router, now);
            self.shared.peers.on_tick(&mut router, &self.shared.stats, now);
        }
        if now.since(self.stats_at) >= STATS_EVERY_MS {
            self.stats_at = now;
            self.report_gauges(now);
        }
    }

    fn report_gauges(&self, now: Millis) {
        let published_at = self.shared.published_at.get();
        if published_at.0 > 0 {
            self.shared.stats.snapshot_age_ms.set(now.since(published_at));
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
            for e in router.endpoints() {
                if let Some(rate) = e.speed.learned(now) {
                    stats.speed(e.id.as_str(), rate as u64);
                }
            }
        }
        let cached = self.shared.predicted_cached.get().saturating_mul(1000);
        if let Some(permille) = cached.checked_div(self.shared.prompt_tokens.get()) {
            self.shared.stats.estimated_hit_permille.set(permille);
        }
    }
}

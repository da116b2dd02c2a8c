//! The worker VMs' root context: owns this VM's `Router`, shared with its HTTP contexts,
//! and on its own tick applies the published fleet state (decoding only when the version
//! changed) and exchanges placements and load with the other workers of this Envoy
//! (`mesh`), so the request path makes no host call for state. Without a singleton
//! service, the worker that holds the lease (`lease`) also runs the `Poller`.

use std::cell::{Cell, RefCell};
use std::collections::BTreeSet;
use std::rc::Rc;

use kvroute_core::capture::Capturer;
use kvroute_core::config::ClusterShape;
use kvroute_core::policy;
use kvroute_core::response::ForcedUsage;
use kvroute_core::{Config, Decision, FleetState, Millis, Outcome, RouteRequest, Router};
use proxy_wasm::types::LogLevel;

use crate::gauges::VmGauges;
use crate::hold::Holds;
use crate::homes::AwaitingHome;
use crate::host;
use crate::lease::Lease;
use crate::peers::Peers;
use crate::poller::{read_version, Poller, SNAPSHOT_KEY};
use crate::replicas::count_direct_answer;
use crate::stats::RequestStats;

/// The slowest tick while holding is on: a held request waits at most this long past the
/// moment the fleet state shows room.
const HOLD_TICK_MS: u64 = 5;

/// Gauges are refreshed at most this often (the tick can be much faster).
const STATS_EVERY_MS: u64 = 100;

/// What HTTP contexts of one worker VM share.
pub struct Shared {
    pub router: RefCell<Router>,
    pub stats: RequestStats,
    pub peers: Peers,
    /// Traffic capture (`capture`), when on.
    pub capture: Option<Capturer>,
    /// Which servers send `usage` in streams that do not ask for it.
    pub forced_usage: RefCell<ForcedUsage>,
    /// Continuations waiting for their home to arrive from another replica (`homes`).
    pub awaiting_home: RefCell<Vec<AwaitingHome>>,
    /// When this worker's tick last ran (a VM Envoy reloaded after a crash gets none:
    /// nothing may wait for it then).
    pub ticked_at: Cell<Millis>,
    next_request: Cell<u64>,
    prompt_tokens: Cell<u64>,
    predicted_cached: Cell<u64>,
    /// Requests held while every server is full (`overload.hold`, see `hold`).
    pub holds: Holds,
    /// The fleet state version applied last, when it was published, and when it was
    /// last looked for.
    seen_version: Cell<u64>,
    /// The last snapshot version that did not decode: retried every tick (a torn read
    /// decodes on the next), logged once.
    undecodable_version: Cell<u64>,
    published_at: Cell<Millis>,
    looked_at: Cell<Millis>,
}

/// A request the gateway routed: the router's id for it, the server chosen first, and its
/// prompt tokens and the part of them the index predicted cached (counted again, with
/// vLLM's report, once its answer says what was cached).
#[derive(Clone, Debug)]
pub struct Routed {
    pub request_id: u64,
    pub best: String,
    pub prompt_tokens: u64,
    pub predicted_cached: u64,
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

    /// Counts a decision that sends nothing anywhere by itself (the header is set by
    /// `apply_decision`).
    pub fn count_outcome(&self, outcome: &Outcome) {
        match outcome {
            Outcome::PrefixHit => self.stats.prefix_hit.inc(),
            Outcome::Cold => self.stats.cold.inc(),
            Outcome::Fallback(reason) => {
                self.stats.fallback.inc();
                if *reason == kvroute_core::decision::FallbackReason::UnknownModel {
                    self.stats.unknown_model.inc();
                }
            }
            Outcome::Shed { .. } => self.stats.shed.inc(),
            Outcome::Hold => {}
            Outcome::ResponseHome => self.stats.response_home.inc(),
        }
    }

    /// Sets the destination header of the current (or effective) stream for a routed
    /// decision and records it, or `None` when the header could not be set (Envoy then
    /// balances the request).
    pub fn apply_decision(
        &self,
        router: &mut Router,
        req: &RouteRequest,
        decision: &Decision,
        now: Millis,
    ) -> Option<Routed> {
        self.count_outcome(&decision.outcome);
        // ORIGINAL_DST reads one address; override_host walks the whole list on retries.
        let value = match router.config().cluster_shape() {
            ClusterShape::OriginalDst => decision.best().map(ToString::to_string),
            ClusterShape::OverrideHost => decision.header_value(),
        }?;
        if host::set_request_header(crate::DESTINATION_HEADER, Some(&value)).is_err() {
            self.stats.skipped_error.inc();
            return None;
        }
        if decision.holder_first {
            self.stats.holder_first.inc();
        }
        let request_id = self.next_request_id();
        router.on_routed(request_id, req, decision, now);
        self.peers.after_route(router, &self.stats, now);
        let best = decision.best().map(|e| e.to_string()).unwrap_or_default();
        self.stats.chosen(&best);
        let predicted = u64::from(decision.matched_blocks) * (router.config().hashing().block_bytes as u64 / 4);
        let predicted_cached = predicted.min(req.prompt_tokens.0);
        self.count_tokens(req.prompt_tokens.0, predicted_cached);
        Some(Routed {
            request_id,
            best,
            prompt_tokens: req.prompt_tokens.0,
            predicted_cached,
        })
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
            Err(e) if self.undecodable_version.replace(version) != version => {
                host::log(LogLevel::Error, &format!("cannot decode the fleet state: {e}"))
            }
            Err(_) => {}
        }
    }
}

pub struct Worker {
    shared: Rc<Shared>,
    /// This VM's row of the process-wide gauges.
    gauges: VmGauges,
    stats_at: Millis,
    lease: Option<Lease>,
    poller: Option<Poller>,
    /// Calls of a poller this worker dropped with the lease, still unanswered: their
    /// answers are nobody's (not this worker's own POSTs).
    retired_calls: BTreeSet<u32>,
    config: Config,
}

impl Worker {
    pub fn new(config: Config) -> Worker {
        let mut router = Router::new(config.clone());
        let mut peers = Peers::join(&mut router);
        if config.overload().hold.max_wait_ms > 0 {
            peers.cap_tick_ms(HOLD_TICK_MS);
        }
        let lease = Lease::new(false, config.discovery().lease_ms);
        if lease.is_none() {
            host::log(
                LogLevel::Warn,
                "cannot take part in the polling lease; this worker only reads the fleet state",
            );
        }
        let mut tick = peers.tick_ms().min(Poller::tick_ms(&config));
        if config.overload().hold.max_wait_ms > 0 {
            // Held requests wait for this tick to find room.
            tick = tick.min(HOLD_TICK_MS);
        }
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
            forced_usage: RefCell::new(ForcedUsage::default()),
            awaiting_home: RefCell::new(Vec::new()),
            ticked_at: Cell::new(Millis(0)),
            next_request: Cell::new(0),
            prompt_tokens: Cell::new(0),
            predicted_cached: Cell::new(0),
            holds: Holds::new(&config),
            seen_version: Cell::new(0),
            undecodable_version: Cell::new(0),
            published_at: Cell::new(Millis(0)),
            looked_at: Cell::new(Millis(0)),
        };
        Worker {
            shared: Rc::new(shared),
            gauges: VmGauges::join(tick),
            stats_at: Millis(0),
            lease,
            poller: None,
            retired_calls: BTreeSet::new(),
            config,
        }
    }

    /// Hands an HTTP call's answer to the poller, if this worker runs it and the call was
    /// its own; any other is the answer to a placement this worker POSTed to another
    /// replica from its tick (`replicas::DirectSender`).
    pub fn on_http_call_response(&mut self, token: u32, num_headers: usize, body_size: usize) {
        let polled = self
            .poller
            .as_mut()
            .is_some_and(|poller| poller.on_http_call_response(token, num_headers, body_size));
        if !polled && !self.retired_calls.remove(&token) {
            count_direct_answer(num_headers, &self.shared.stats);
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
                if let Some(poller) = self.poller.take() {
                    self.retired_calls.extend(poller.pending_calls());
                }
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
        self.shared.ticked_at.set(now);
        self.poll_if_leader(now);
        if let Ok(mut router) = self.shared.router.try_borrow_mut() {
            self.shared.apply_fleet_state(&mut router, now);
            self.shared.peers.on_tick(&mut router, &self.shared.stats, now);
        }
        if now.since(self.stats_at) >= STATS_EVERY_MS {
            self.stats_at = now;
            self.report_gauges(now);
        }
        // Last: releasing a held request points host calls at its stream (the effective
        // context) until this callback returns.
        if let Ok(mut router) = self.shared.router.try_borrow_mut() {
            self.shared.release_awaiting_home(&mut router, now);
            self.shared.release_held(&mut router, now);
        }
    }

    fn report_gauges(&self, now: Millis) {
        let published_at = self.shared.published_at.get();
        if published_at.0 > 0 {
            self.shared.stats.snapshot_age_ms.set(now.since(published_at));
        }
        // Summed over the worker VMs that still report (`gauges`).
        if let Ok(router) = self.shared.router.try_borrow() {
            let stats = &self.shared.stats;
            let mine = [
                router.index().entries() as u64,
                router.own_inflight_requests() as u64,
                self.shared.holds.held_here() as u64,
            ];
            if let Some([entries, inflight, held]) = self.gauges.report(mine, now) {
                stats.index_entries.set(entries);
                stats.inflight.set(inflight);
                stats.hold_waiting.set(held);
            }
            // Only a router that places requests (its own or its peers') can tell what it
            // did not see: the VM that only scrapes would read every server as unseen.
            let places = router.stats().routed + router.stats().peer_events > 0;
            for e in router.endpoints() {
                if let Some(rate) = e.speed.learned(now) {
                    stats.speed(e.id.as_str(), rate as u64);
                }
                if let Some(per_ms) = e.pace.per_ms(now) {
                    stats.pace(e.id.as_str(), (per_ms * 1000.0) as u64);
                }
                if let Some(ms) = e.step.ms(now) {
                    stats.step(e.id.as_str(), (ms * 1000.0) as u64);
                }
                if let Some(per_s) = e.completions.per_s() {
                    stats.completions(e.id.as_str(), (per_s * 60.0).round() as u64);
                }
                if policy::weights_in_use(router.config()) {
                    let weight = policy::speed_weight(router.config(), e);
                    stats.speed_weight(e.id.as_str(), (weight * 1000.0).round() as u64);
                }
                if let Some(share) = e.seen.unseen().filter(|_| places) {
                    stats.unseen(e.id.as_str(), (share * 1000.0) as u64);
                }
                if places && router.config().tiers().on() {
                    stats.ttft_scale(e.id.as_str(), (e.ttft_bias.factor(now) * 1000.0).round() as u64);
                }
            }
            stats.forget_departed(router.endpoints());
        }
        let cached = self.shared.predicted_cached.get().saturating_mul(1000);
        if let Some(permille) = cached.checked_div(self.shared.prompt_tokens.get()) {
            self.shared.stats.estimated_hit_permille.set(permille);
        }
    }
}

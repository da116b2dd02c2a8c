//! The scraping side: learns the pool from Envoy, scrapes every server, publishes the fleet.
//!
//! One `Poller` runs per Envoy process: in the singleton service (`envoy.bootstrap.wasm`,
//! main thread) when there is one, else in the worker VM that holds the lease (`lease`).
//! Every `discovery.interval_ms` it GETs Envoy's admin `/clusters` view of the pool cluster
//! through `discovery.admin_cluster` (skipped for a static `endpoints` list); every
//! `scrape.interval_ms` it GETs each member's `/metrics` through the pool cluster, with the
//! destination header naming that member; every `discovery.models_interval_ms` (and at once
//! for a new member) its `/v1/models`. Results feed one [`Fleet`]; when a scrape round
//! completes (or at the next round if some answer never came) it publishes the
//! [`FleetState`] into shared data, postcard-encoded, with its version under a separate key
//! so workers decode only what changed. With `share.replicas`, it also forwards this
//! process's placements to the other gateway replicas (`replicas::Forwarder`), reading the
//! process's log every ms for them, learns those replicas from the admin's `/clusters` when
//! they are not listed (every `discovery.interval_ms`), and scrapes on the clock's
//! multiples of the interval (see `scrape_due`).

use std::collections::BTreeMap;

use kvroute_core::config::RawScrape;
use kvroute_core::discovery::{clusters_path, signature_path};
use kvroute_core::fleet::Host;
use kvroute_core::health::Flip;
use kvroute_core::{Config, EndpointId, EnvoyHealth, Fleet, FleetState, Millis};
use proxy_wasm::types::LogLevel;

use crate::host;
use crate::replicas::{init_replica_nonce, publish_targets, Forwarder, PeerList};
use crate::stats::ScrapeStats;

/// The fleet state's keys in shared data, named by the layout of `FleetState`: postcard
/// reads fields by position, so a VM of another module version (during an update, both run
/// for a while) would misread a state of another layout. Change the suffix with any change
/// to `FleetState` or `Member`; until the new layout is published, workers fall back to
/// Envoy's balancing. 2: `Member::weight`; 3: `VllmMetrics::finished`.
pub const SNAPSHOT_KEY: &str = "kvroute.snapshot.3";
pub const VERSION_KEY: &str = "kvroute.snapshot.3.version";

/// The last published fleet state in shared data, if any and readable.
pub fn read_snapshot() -> Option<FleetState> {
    let bytes = host::shared_data(SNAPSHOT_KEY).ok().flatten()?;
    postcard::from_bytes(&bytes).ok()
}

/// The published version (0 before the first).
pub fn read_version() -> u64 {
    match host::shared_data(VERSION_KEY) {
        Ok(Some(bytes)) => bytes.try_into().map(u64::from_le_bytes).unwrap_or(0),
        _ => 0,
    }
}

/// What an HTTP call in flight was for.
enum Call {
    /// A few of the pool cluster's stats (`discovery::signature_path`).
    Signature,
    Clusters,
    Metrics(EndpointId),
    Models(EndpointId),
    /// A batch to the replica at this address.
    Forward(String),
    /// Envoy's listing of `share.replicas.cluster` (replicas not listed in the config).
    Replicas,
}

pub struct Poller {
    config: Config,
    fleet: Fleet,
    calls: BTreeMap<u32, Call>,
    /// Scrapes of this round still unanswered.
    scrapes_pending: usize,
    dirty: bool,
    stats: ScrapeStats,
    /// Forwards this process's placements to the other gateway replicas, when configured.
    forwarder: Option<(Forwarder, u64)>,
    /// Where those go: listed, or learned from Envoy (`Call::Replicas`).
    replicas: PeerList,
    /// The replicas last written for the workers that send their own placements
    /// (`share.replicas.from_workers`).
    published_targets: Option<Vec<String>>,
    /// When Envoy's listing of the replicas was last asked for, and whether the answer is out.
    last_replicas_poll: Option<Millis>,
    replicas_polling: bool,
    /// Why the last reading of the replicas' cluster failed (logged when it changes).
    replicas_failure: Option<String>,
    last_scrape: Millis,
    last_poll: Option<Millis>,
    /// When `/clusters` was last read successfully.
    last_full: Option<Millis>,
    /// The signature stats as of that read, and as of the read in flight.
    signature: Option<Vec<u8>>,
    pending_signature: Option<Vec<u8>>,
    /// False once the admin refused the signature query.
    signatures: bool,
    polling: bool,
}

impl Poller {
    /// Starts from the fleet state last published in this process (a worker taking over
    /// the lease keeps the membership, verdicts and metrics its predecessor had).
    pub fn new(config: Config) -> Poller {
        let mut fleet = Fleet::new(config.health().clone());
        if let Some(state) = read_snapshot() {
            fleet.resume(state, read_version());
        }
        if !config.discovers() {
            // A static pool is the configured list, whatever an earlier snapshot held.
            let hosts: Vec<Host> = config
                .endpoints()
                .iter()
                .map(|id| Host {
                    id: id.clone(),
                    envoy: EnvoyHealth::Serve,
                    priority: 0,
                    weight: 1,
                })
                .collect();
            fleet.on_hosts(&hosts);
        }
        let listed = config.share().replicas.as_ref().map(|r| PeerList::listed(&r.peers));
        let replicas = listed.is_some();
        let forwarder = replicas
            .then(init_replica_nonce)
            .flatten()
            .map(|nonce| (Forwarder::default(), nonce));
        if replicas && forwarder.is_none() {
            host::log(
                LogLevel::Error,
                "cannot name this replica in shared data; not forwarding to the other replicas",
            );
        }
        let stats = ScrapeStats::define();
        if let Some(list) = &listed {
            stats.replica_peers.set(list.targets().count() as u64);
        }
        Poller {
            config,
            fleet,
            calls: BTreeMap::new(),
            scrapes_pending: 0,
            dirty: true,
            stats,
            forwarder,
            replicas: listed.unwrap_or_default(),
            published_targets: None,
            last_replicas_poll: None,
            replicas_polling: false,
            replicas_failure: None,
            last_scrape: Millis(0),
            last_poll: None,
            last_full: None,
            signature: None,
            pending_signature: None,
            signatures: true,
            polling: false,
        }
    }

    /// The tick period the poller needs (the caller may tick faster).
    pub fn tick_ms(config: &Config) -> u64 {
        let mut ms = config.scrape().interval_ms;
        if config.discovers() || config.discovers_replicas() {
            ms = ms.min(config.discovery().interval_ms);
        }
        if let Some(r) = config.share().replicas.as_ref() {
            ms = ms.min(r.interval_ms);
        }
        ms
    }

    /// The scraping service's tick: with `share.replicas.at_once` a placement leaves at the
    /// first tick that finds it in the log, so every ms (a worker holding the lease keeps
    /// its own tick and forwards on it: workers are not woken every ms for this). At most a
    /// quarter of `discovery.lease_ms` in any case: the service renews its lease only on its
    /// tick, and a lease unrenewed for `lease_ms` is taken by a worker (with a 2 s scrape
    /// interval, workers took it every cycle and two pollers scraped).
    pub fn service_tick_ms(config: &Config) -> u64 {
        let at_once = config.share().replicas.as_ref().is_some_and(|r| r.at_once);
        if at_once {
            1
        } else {
            Poller::tick_ms(config).min((config.discovery().lease_ms / 4).max(1))
        }
    }

    pub fn on_tick(&mut self, now: Millis) {
        self.forward(now);
        self.poll(now);
        self.poll_replicas(now);
        let interval = self.config.scrape_interval_ms(self.fleet.len());
        let aligned = self.forwarder.is_some();
        if !scrape_due(now, self.last_scrape, interval, aligned) {
            return;
        }
        self.last_scrape = now;
        if self.dirty || self.scrapes_pending > 0 {
            // Answers still missing are timeouts Envoy will report; publish what we have.
            self.publish(now);
        }
        self.scrape(now);
    }

    /// Asks Envoy's admin: the full `/clusters` listing when the cluster's signature stats
    /// moved or `discovery.resync_ms` passed, else only the signature.
    fn poll(&mut self, now: Millis) {
        let discovery = self.config.discovery().clone();
        let due = self.last_poll.is_none_or(|t| now.since(t) + 5 >= discovery.interval_ms);
        if !self.config.discovers() || self.polling || !due {
            return;
        }
        self.last_poll = Some(now);
        let resync = !self.signatures || self.last_full.is_none_or(|t| now.since(t) >= discovery.resync_ms);
        self.ask_admin(if resync { Call::Clusters } else { Call::Signature });
    }

    fn ask_admin(&mut self, call: Call) {
        let discovery = self.config.discovery();
        let path = match call {
            Call::Signature => signature_path(self.config.pool_cluster()),
            _ => clusters_path(self.config.pool_cluster()),
        };
        match host::dispatch_admin_get(&discovery.admin_cluster, &path, discovery.timeout_ms) {
            Ok(token) => {
                self.calls.insert(token, call);
                self.polling = true;
            }
            Err(status) => {
                self.stats.discovery_failure.inc();
                host::log(
                    LogLevel::Warn,
                    &format!(
                        "cannot ask Envoy's admin for the pool via cluster {}: {status:?}",
                        discovery.admin_cluster
                    ),
                );
            }
        }
    }

    fn scrape(&mut self, now: Millis) {
        let scrape = self.config.scrape().clone();
        let busy: Vec<EndpointId> = self
            .calls
            .values()
            .filter_map(|c| match c {
                Call::Metrics(id) => Some(id.clone()),
                _ => None,
            })
            .collect();
        let ids: Vec<EndpointId> = self.fleet.ids().filter(|id| !busy.contains(id)).cloned().collect();
        self.scrapes_pending = busy.len();
        for id in ids {
            self.scrape_one(id, &scrape);
        }
        self.ask_models(now);
    }

    fn scrape_one(&mut self, id: EndpointId, scrape: &RawScrape) {
        match host::dispatch_get(
            &scrape.cluster,
            id.as_str(),
            &scrape.path,
            id.as_str(),
            scrape.timeout_ms,
        ) {
            Ok(token) => {
                self.calls.insert(token, Call::Metrics(id));
                self.scrapes_pending += 1;
            }
            Err(status) => {
                host::log(
                    LogLevel::Warn,
                    &format!("cannot scrape {id} via cluster {}: {status:?}", scrape.cluster),
                );
                self.stats.failure.inc();
                self.dirty = true;
                let flip = self.fleet.on_scrape_failed(&id);
                log_flip(&id, flip, "cannot dispatch");
            }
        }
    }

    fn ask_models(&mut self, now: Millis) {
        let every = self.config.discovery().models_interval_ms;
        if every == 0 {
            return;
        }
        let scrape = self.config.scrape().clone();
        for id in self.fleet.models_due(now, every) {
            self.fleet.on_models_asked(&id, now);
            if let Ok(token) = host::dispatch_get(
                &scrape.cluster,
                id.as_str(),
                "/v1/models",
                id.as_str(),
                scrape.timeout_ms,
            ) {
                self.calls.insert(token, Call::Models(id));
            }
        }
    }

    /// The tokens of this poller's calls not answered yet.
    pub fn pending_calls(&self) -> impl Iterator<Item = u32> + '_ {
        self.calls.keys().copied()
    }

    /// POSTs this process's new placements to every replica listed (each drops its own).
    fn forward(&mut self, now: Millis) {
        let Some((forwarder, nonce)) = self.forwarder.as_mut() else {
            return;
        };
        let Some(replicas) = self.config.share().replicas.clone() else {
            return;
        };
        if replicas.from_workers {
            publish_targets(self.replicas.targets(), &mut self.published_targets);
        }
        let Some(body) = forwarder.collect(
            *nonce,
            now,
            replicas.at_once,
            replicas.interval_ms,
            &self.stats.forward_lost,
        ) else {
            return;
        };
        let targets: Vec<String> = self.replicas.targets().cloned().collect();
        for peer in targets {
            match host::dispatch_post(
                &replicas.cluster,
                &peer,
                &replicas.path,
                &replicas.secret,
                &body,
                replicas.interval_ms.max(200),
            ) {
                Ok(token) => {
                    self.calls.insert(token, Call::Forward(peer));
                    self.stats.forwarded.inc();
                }
                Err(status) => {
                    self.stats.forward_failure.inc();
                    if self.replicas.on_forward(&peer, Some("cannot dispatch")) {
                        host::log(
                            LogLevel::Warn,
                            &format!(
                                "cannot forward to replica {peer} through cluster {}: {status:?}",
                                replicas.cluster
                            ),
                        );
                    }
                }
            }
        }
    }

    /// Asks Envoy's admin for the replicas' cluster every `discovery.interval_ms`, when the
    /// replicas are not listed in the configuration.
    fn poll_replicas(&mut self, now: Millis) {
        let Some(replicas) = self.config.share().replicas.as_ref() else {
            return;
        };
        let discovery = self.config.discovery();
        let due = self
            .last_replicas_poll
            .is_none_or(|t| now.since(t) + 5 >= discovery.interval_ms);
        if !replicas.peers.is_empty() || self.replicas_polling || !due {
            return;
        }
        self.last_replicas_poll = Some(now);
        let path = clusters_path(&replicas.cluster);
        match host::dispatch_admin_get(&discovery.admin_cluster, &path, discovery.timeout_ms) {
            Ok(token) => {
                self.calls.insert(token, Call::Replicas);
                self.replicas_polling = true;
            }
            // BadArgument: Envoy has no cluster of that name.
            Err(status) => {
                let why = format!(
                    "cannot ask Envoy's admin via cluster {}: {status:?} (is discovery.admin_cluster a cluster of \
                     this Envoy?)",
                    discovery.admin_cluster
                );
                self.replicas_listing_failed(why);
            }
        }
    }
}

fn log_flip(id: &EndpointId, flip: Option<Flip>, why: &str) {
    match flip {
        Some(Flip::BecameHealthy) => host::log(LogLevel::Info, &format!("endpoint {id} is healthy")),
        Some(Flip::BecameUnhealthy) => host::log(LogLevel::Warn, &format!("endpoint {id} is unhealthy: {why}")),
        Some(Flip::Ejected { .. }) | None => {}
    }
}

/// Whether a scrape round is due at `now`. Alone, a replica scrapes `interval` after its last
/// round. Replicas that exchange placements (`aligned`) scrape at the wall clock's multiples
/// of `interval` instead, so every replica's snapshot is taken at nearly the same moment
/// (within clock skew and one tick, 5 ms at most with `share.replicas`): in replay, 8 replicas
/// exchanging with no delay but each scraping at its own phase had 21% more TTFT p95 than one
/// router on the shared-prefix matrix cell (70 vs 58 ms, 15 runs); with phases within 5 ms,
/// none (58 ms). Each replica then reads load from the same moment and adds the same
/// placements since.
fn scrape_due(now: Millis, last: Millis, interval: u64, aligned: bool) -> bool {
    if aligned && interval > 0 {
        return now.0 / interval > last.0 / interval;
    }
    now.since(last) + 5 >= interval
}

mod answers;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replicas_scrape_on_the_clocks_multiples_and_a_lone_one_by_elapsed_time() {
        let due = |now, last, aligned| scrape_due(Millis(now), Millis(last), 200, aligned);
        assert!(!due(1_199, 1_003, true), "same 200 ms slot");
        assert!(
            due(1_203, 1_199, true),
            "a new slot began: scrape even 4 ms after the last"
        );
        assert!(due(1_000, 0, true));
        assert!(!due(1_203, 1_199, false), "alone: 200 ms after the last round");
        assert!(due(1_395, 1_199, false), "alone: within the 5 ms tick allowance");
        assert!(!due(1_390, 1_199, false));
    }

    #[test]
    fn the_service_ticks_often_enough_to_keep_its_lease_whatever_the_intervals() {
        let tick = |json: &str| Poller::service_tick_ms(&Config::from_json(json.as_bytes()).unwrap());
        assert_eq!(tick(r#"{"endpoints": ["10.0.0.1:8000"]}"#), 200, "the scrape interval");
        assert_eq!(
            tick(
                r#"{"endpoints": ["10.0.0.1:8000"], "scrape": {"interval_ms": 2000, "timeout_ms": 500}, "health": {"stale_after_ms": 5000}}"#
            ),
            250,
            "a quarter of the 1 s lease"
        );
        assert_eq!(
            tick(
                r#"{"scrape": {"interval_ms": 5000, "timeout_ms": 500}, "health": {"stale_after_ms": 12000}, "discovery": {"interval_ms": 3000, "timeout_ms": 500, "lease_ms": 4000}}"#
            ),
            1000
        );
    }
}

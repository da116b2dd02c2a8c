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
//! process's log every ms for them, and scrapes on the clock's multiples of the interval
//! (see `scrape_due`).

use std::collections::BTreeMap;

use kvroute_core::config::RawScrape;
use kvroute_core::discovery::{clusters_path, parse_clusters, parse_models, signature_path};
use kvroute_core::fleet::Host;
use kvroute_core::health::Flip;
use kvroute_core::{parse_metrics, Config, EndpointId, EnvoyHealth, Fleet, FleetState, Millis};
use proxy_wasm::types::{BufferType, LogLevel};

use crate::host;
use crate::replicas::{init_replica_nonce, Forwarder};
use crate::stats::ScrapeStats;

pub const SNAPSHOT_KEY: &str = "kvroute.snapshot";
pub const VERSION_KEY: &str = "kvroute.snapshot.version";

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
    Forward,
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
                })
                .collect();
            fleet.on_hosts(&hosts);
        }
        let replicas = config.share().replicas.is_some();
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
        Poller {
            config,
            fleet,
            calls: BTreeMap::new(),
            scrapes_pending: 0,
            dirty: true,
            stats: ScrapeStats::define(),
            forwarder,
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
        if config.discovers() {
            ms = ms.min(config.discovery().interval_ms);
        }
        if let Some(r) = config.share().replicas.as_ref() {
            ms = ms.min(r.interval_ms);
        }
        ms
    }

    /// The scraping service's tick: with `share.replicas.at_once` a placement leaves at the
    /// first tick that finds it in the log, so every ms (a worker holding the lease keeps
    /// its own tick and forwards on it: workers are not woken every ms for this).
    pub fn service_tick_ms(config: &Config) -> u64 {
        let at_once = config.share().replicas.as_ref().is_some_and(|r| r.at_once);
        if at_once {
            1
        } else {
            Poller::tick_ms(config)
        }
    }

    pub fn on_tick(&mut self, now: Millis) {
        self.forward(now);
        self.poll(now);
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

    /// The signature stats answered: read the full listing if they moved.
    fn on_signature(&mut self, ok: bool, body_size: usize, status: Option<&[u8]>) {
        if status == Some(b"403") {
            // An admin that allows `/clusters?` but not this query: read the full listing
            // every poll (it costs more; README, "Point kvroute at your pool").
            self.signatures = false;
            host::log(
                LogLevel::Warn,
                "Envoy's admin refuses /stats?filter=^cluster\\.… (admin.allow_paths): reading /clusters at every poll",
            );
            self.ask_admin(Call::Clusters);
            return;
        }
        let body = ok
            .then(|| host::buffer(BufferType::HttpCallResponseBody, 0, body_size.min(64 << 10)).ok())
            .flatten();
        match body {
            Some(body) if self.signature.as_ref() == Some(&body) => {}
            Some(body) => {
                self.pending_signature = Some(body);
                self.ask_admin(Call::Clusters);
            }
            None => {
                self.stats.discovery_failure.inc();
                self.ask_admin(Call::Clusters);
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

    /// POSTs this process's new placements to every replica listed (each drops its own).
    fn forward(&mut self, now: Millis) {
        let Some((forwarder, nonce)) = self.forwarder.as_mut() else {
            return;
        };
        let Some(replicas) = self.config.share().replicas.clone() else {
            return;
        };
        let Some(body) = forwarder.collect(*nonce, now, replicas.at_once, replicas.interval_ms) else {
            return;
        };
        for peer in &replicas.peers {
            match host::dispatch_post(
                &replicas.cluster,
                peer,
                &replicas.path,
                &replicas.secret,
                &body,
                replicas.interval_ms.max(200),
            ) {
                Ok(token) => {
                    self.calls.insert(token, Call::Forward);
                    self.stats.forwarded.inc();
                }
                Err(status) => {
                    self.stats.forward_failure.inc();
                    host::log(
                        LogLevel::Debug,
                        &format!("cannot forward to replica {peer}: {status:?}"),
                    );
                }
            }
        }
    }

    /// Handles the answer to one of this poller's calls; false when the token is not one.
    pub fn on_http_call_response(&mut self, token: u32, body_size: usize) -> bool {
        let Some(call) = self.calls.remove(&token) else {
            return false;
        };
        let now = host::now();
        let status = host::call_response_header(":status").ok().flatten();
        let ok = status.as_deref() == Some(b"200");
        match call {
            Call::Forward => {
                if status.as_deref() != Some(b"204") {
                    self.stats.forward_failure.inc();
                }
            }
            Call::Signature => {
                self.polling = false;
                self.on_signature(ok, body_size, status.as_deref());
            }
            Call::Clusters => {
                self.polling = false;
                self.on_clusters(ok, body_size, status.as_deref());
            }
            Call::Models(id) => {
                let max = self.config.scrape().max_bytes;
                let models = (ok && body_size <= max)
                    .then(|| host::buffer(BufferType::HttpCallResponseBody, 0, body_size).ok())
                    .flatten()
                    .and_then(|body| parse_models(&body).ok());
                if let Some(models) = models {
                    self.fleet.on_models(&id, models);
                    self.dirty = true;
                }
            }
            Call::Metrics(id) => {
                self.scrapes_pending = self.scrapes_pending.saturating_sub(1);
                self.on_metrics(&id, ok, body_size, status.as_deref(), now);
                if self.scrapes_pending == 0 {
                    self.publish(now);
                }
            }
        }
        true
    }

    fn on_clusters(&mut self, ok: bool, body_size: usize, status: Option<&[u8]>) {
        let max = self.config.discovery().max_bytes;
        let cluster = self.config.pool_cluster().to_string();
        let hosts = if !ok {
            Err(match status {
                Some(s) => format!("Envoy's admin answered {}", String::from_utf8_lossy(s)),
                None => "no answer from Envoy's admin (timeout or connection failure)".into(),
            })
        } else if body_size > max {
            Err(format!(
                "/clusters answer of {body_size} bytes is over discovery.max_bytes ({max})"
            ))
        } else {
            host::buffer(BufferType::HttpCallResponseBody, 0, body_size)
                .map_err(|s| format!("cannot read the /clusters answer: {s:?}"))
                .and_then(|body| parse_clusters(&body, &cluster).map_err(|e| e.to_string()))
        };
        match hosts {
            Ok(hosts) => {
                self.stats.discovery_success.inc();
                self.last_full = Some(host::now());
                if let Some(signature) = self.pending_signature.take() {
                    self.signature = Some(signature);
                }
                self.stats.discovered_hosts.set(hosts.len() as u64);
                let change = self.fleet.on_hosts(&hosts);
                for id in &change.added {
                    host::log(LogLevel::Info, &format!("endpoint {id} joined the pool {cluster}"));
                }
                for (id, _) in &change.removed {
                    host::log(LogLevel::Info, &format!("endpoint {id} left the pool {cluster}"));
                }
                // Always publish: Envoy's health flags may have changed even when no one
                // joined or left, and routers must stop choosing a draining host now.
                let now = host::now();
                self.publish(now);
                // New members are scraped (and asked their models) at once, not at the
                // next round: the state is published again when their answers are in.
                let scrape = self.config.scrape().clone();
                for id in change.added {
                    self.scrape_one(id, &scrape);
                }
                self.ask_models(now);
            }
            Err(why) => {
                self.stats.discovery_failure.inc();
                host::log(
                    LogLevel::Warn,
                    &format!("pool discovery failed (keeping the last pool): {why}"),
                );
            }
        }
    }

    fn on_metrics(&mut self, id: &EndpointId, ok: bool, body_size: usize, status: Option<&[u8]>, now: Millis) {
        let max = self.config.scrape().max_bytes;
        let result = if !ok {
            Err(match status {
                Some(s) => format!("status {}", String::from_utf8_lossy(s)),
                None => "no response (timeout or connection failure)".into(),
            })
        } else if body_size > max {
            Err(format!("body of {body_size} bytes is over scrape.max_bytes ({max})"))
        } else {
            host::buffer(BufferType::HttpCallResponseBody, 0, body_size)
                .map_err(|s| format!("cannot read the body: {s:?}"))
                .and_then(|body| parse_metrics(&body, max).map_err(|e| e.to_string()))
        };
        self.dirty = true;
        match result {
            Ok(metrics) => {
                self.stats.success.inc();
                let flip = self.fleet.on_metrics(id, metrics, now);
                log_flip(id, flip, "");
            }
            Err(why) => {
                self.stats.failure.inc();
                host::log(LogLevel::Debug, &format!("scrape of {id} failed: {why}"));
                let flip = self.fleet.on_scrape_failed(id);
                log_flip(id, flip, &why);
            }
        }
    }

    fn publish(&mut self, now: Millis) {
        let state = self.fleet.publish(now);
        let bytes = match postcard::to_allocvec(&state) {
            Ok(b) => b,
            Err(e) => {
                host::log(LogLevel::Error, &format!("cannot encode the fleet state: {e}"));
                return;
            }
        };
        let ok = host::set_shared_data(SNAPSHOT_KEY, &bytes).is_ok()
            && host::set_shared_data(VERSION_KEY, &state.version.to_le_bytes()).is_ok();
        if ok {
            self.stats.published.inc();
            self.stats.healthy_endpoints.set(self.fleet.routable() as u64);
            self.dirty = false;
        } else {
            host::log(LogLevel::Error, "cannot write the fleet state to shared data");
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
}

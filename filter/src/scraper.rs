//! The singleton scraping service (`envoy.bootstrap.wasm`, main thread).
//!
//! Every `scrape.interval_ms` it GETs each endpoint's `/metrics` through the pool cluster,
//! with the destination header naming that endpoint, and a timeout below the interval. It
//! feeds results into its own `Router`, whose health state machine decides active health,
//! and publishes a versioned snapshot into shared data when a round completes (or at the
//! next tick if some answer never came). With `share.replicas`, it also forwards this
//! process's placements to the other gateway replicas every `share.replicas.interval_ms`
//! (see `mesh::Forwarder`).

use std::collections::BTreeMap;

use kvroute_core::health::{Flip, HealthState};
use kvroute_core::{parse_metrics, Config, EndpointId, Millis, Router};
use prost::Message;
use proxy_wasm::types::{BufferType, LogLevel};

use crate::host;
use crate::replicas::{init_replica_nonce, Forwarder};
use crate::snapshot::{EndpointSnap, MetricsSnap, Snapshot, SNAPSHOT_KEY, VERSION_KEY};
use crate::stats::ScrapeStats;

pub struct Scraper {
    router: Router,
    pending: BTreeMap<u32, EndpointId>,
    version: u64,
    dirty: bool,
    stats: ScrapeStats,
    /// Forwards this process's placements to the other gateway replicas, when configured.
    forwarder: Option<(Forwarder, u64)>,
    /// Calls to other replicas in flight (their answers are only counted).
    forwards: BTreeMap<u32, ()>,
    last_scrape: Millis,
}

impl Scraper {
    pub fn new(config: Config) -> Scraper {
        let replicas = config.share().replicas.as_ref();
        let interval = replicas.map_or(config.scrape().interval_ms, |r| {
            r.interval_ms.min(config.scrape().interval_ms)
        });
        let forwarder = replicas
            .and_then(|_| init_replica_nonce())
            .map(|nonce| (Forwarder::default(), nonce));
        if replicas.is_some() && forwarder.is_none() {
            host::log(
                LogLevel::Error,
                "cannot name this replica in shared data; not forwarding to the other replicas",
            );
        }
        if host::set_tick_period_ms(interval).is_err() {
            host::log(
                LogLevel::Error,
                "could not set the scrape tick; metrics will not be scraped",
            );
        }
        Scraper {
            router: Router::new(config),
            pending: BTreeMap::new(),
            version: 0,
            dirty: true,
            stats: ScrapeStats::define(),
            forwarder,
            forwards: BTreeMap::new(),
            last_scrape: Millis(0),
        }
    }

    /// POSTs this process's new placements to every replica listed (each drops its own).
    fn forward(&mut self, now: Millis) {
        let Some((forwarder, nonce)) = self.forwarder.as_mut() else {
            return;
        };
        let Some(replicas) = self.router.config().share().replicas.clone() else {
            return;
        };
        let Some(body) = forwarder.collect(*nonce, now) else {
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
                    self.forwards.insert(token, ());
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

    pub fn on_tick(&mut self) {
        let now = host::now();
        self.forward(now);
        if now.since(self.last_scrape) + 5 < self.router.config().scrape().interval_ms {
            return;
        }
        self.last_scrape = now;
        if self.dirty || !self.pending.is_empty() {
            // Answers still missing are timeouts Envoy will report; publish what we have.
            self.publish(now);
        }
        let scrape = self.router.config().scrape().clone();
        let busy: Vec<EndpointId> = self.pending.values().cloned().collect();
        let ids: Vec<EndpointId> = self.router.endpoints().iter().map(|e| e.id.clone()).collect();
        for id in ids.into_iter().filter(|id| !busy.contains(id)) {
            match host::dispatch_get(
                &scrape.cluster,
                id.as_str(),
                &scrape.path,
                id.as_str(),
                scrape.timeout_ms,
            ) {
                Ok(token) => {
                    self.pending.insert(token, id);
                }
                Err(status) => {
                    host::log(
                        LogLevel::Warn,
                        &format!("cannot scrape {id} via cluster {}: {status:?}", scrape.cluster),
                    );
                    self.failed(&id, now);
                }
            }
        }
    }

    pub fn on_http_call_response(&mut self, token: u32, body_size: usize) {
        if self.forwards.remove(&token).is_some() {
            let status = host::call_response_header(":status").ok().flatten();
            if status.as_deref() != Some(b"204") {
                self.stats.forward_failure.inc();
            }
            return;
        }
        let Some(id) = self.pending.remove(&token) else { return };
        let now = host::now();
        let max = self.router.config().scrape().max_bytes;
        let status = host::call_response_header(":status").ok().flatten();
        let status = status.as_deref().map(String::from_utf8_lossy);
        let result = match status.as_deref() {
            Some("200") if body_size > max => {
                Err(format!("body of {body_size} bytes is over scrape.max_bytes ({max})"))
            }
            Some("200") => host::buffer(BufferType::HttpCallResponseBody, 0, body_size)
                .map_err(|s| format!("cannot read the body: {s:?}"))
                .and_then(|body| parse_metrics(&body, max).map_err(|e| e.to_string())),
            Some(other) => Err(format!("status {other}")),
            None => Err("no response (timeout or connection failure)".to_string()),
        };
        match result {
            Ok(metrics) => {
                self.stats.success.inc();
                let flip = self.router.on_metrics(&id, metrics, now);
                log_flip(&id, flip, "");
            }
            Err(why) => {
                host::log(LogLevel::Debug, &format!("scrape of {id} failed: {why}"));
                let flip = self.failed(&id, now);
                log_flip(&id, flip, &why);
            }
        }
        self.dirty = true;
        if self.pending.is_empty() {
            self.publish(now);
        }
    }

    fn failed(&mut self, id: &EndpointId, now: Millis) -> Option<Flip> {
        self.stats.failure.inc();
        self.dirty = true;
        self.router.on_scrape_failed(id, now)
    }

    fn publish(&mut self, now: Millis) {
        self.version += 1;
        let endpoints: Vec<EndpointSnap> = self
            .router
            .endpoints()
            .iter()
            .map(|e| EndpointSnap {
                address: e.id.to_string(),
                healthy: e.health.state() != HealthState::Unhealthy,
                scraped_at_ms: e.scraped_at.map_or(0, |t| t.0),
                metrics: e.metrics.as_ref().map(MetricsSnap::from),
            })
            .collect();
        let healthy = endpoints.iter().filter(|e| e.healthy && e.metrics.is_some()).count();
        let snapshot = Snapshot {
            version: self.version,
            published_at_ms: now.0,
            endpoints,
        };
        let ok = host::set_shared_data(SNAPSHOT_KEY, &snapshot.encode_to_vec()).is_ok()
            && host::set_shared_data(VERSION_KEY, &self.version.to_le_bytes()).is_ok();
        if ok {
            self.stats.published.inc();
            self.stats.healthy_endpoints.set(healthy as u64);
            self.dirty = false;
        } else {
            host::log(LogLevel::Error, "cannot write the snapshot to shared data");
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

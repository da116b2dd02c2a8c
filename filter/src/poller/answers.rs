//! The answers to the poller's calls: Envoy's view of the pool, each server's `/metrics`
//! and `/v1/models`, the replicas' acknowledgements; and the fleet state they publish.

use kvroute_core::discovery::{parse_clusters, parse_models, DiscoveryError};
use kvroute_core::fleet::Host;
use kvroute_core::{parse_metrics, EndpointId, Millis};
use proxy_wasm::types::{BufferType, LogLevel};

use super::{log_flip, Call, Poller, SNAPSHOT_KEY, VERSION_KEY};
use crate::host;
use crate::replicas::{answers_self, REFUSED_VALUE, SELF_HEADER};

impl Poller {
    /// Handles the answer to one of this poller's calls; false when the token is not one.
    /// A call that failed comes with no headers, and none is read (`host::call_status`).
    pub fn on_http_call_response(&mut self, token: u32, num_headers: usize, body_size: usize) -> bool {
        let Some(call) = self.calls.remove(&token) else {
            return false;
        };
        let now = host::now();
        let status = host::call_status(num_headers);
        let ok = status.as_deref() == Some(b"200");
        match call {
            Call::Forward(peer) => {
                let delivered = status.as_deref() == Some(b"204");
                let marker = host::call_header(num_headers, SELF_HEADER);
                let failure = (!delivered).then(|| {
                    let by_kvroute = marker.as_deref() == Some(REFUSED_VALUE.as_bytes());
                    forward_failure(status.as_deref(), by_kvroute)
                });
                if self.replicas.on_forward(&peer, failure.as_deref()) {
                    log_forward(&peer, failure.as_deref());
                }
                if !delivered {
                    self.stats.forward_failure.inc();
                } else if marker.is_some_and(|answer| answers_self(&answer, &peer)) && self.replicas.mark_own(&peer) {
                    host::log(
                        LogLevel::Info,
                        &format!("replica {peer} is this gateway: not forwarding to it"),
                    );
                    self.stats.replica_peers.set(self.replicas.targets().count() as u64);
                }
            }
            Call::Replicas => {
                self.replicas_polling = false;
                self.on_replicas(ok, body_size, status.as_deref());
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
        let cluster = self.config.pool_cluster().to_string();
        let hosts = self.clusters_answer(ok, body_size, status, &cluster, "discovery.cluster");
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

    /// The hosts of `cluster` in the admin's answer to `/clusters`, or why not (`field`: the
    /// setting that names the cluster, for the hint when Envoy has no such cluster).
    fn clusters_answer(
        &self,
        ok: bool,
        body_size: usize,
        status: Option<&[u8]>,
        cluster: &str,
        field: &str,
    ) -> Result<Vec<Host>, String> {
        let max = self.config.discovery().max_bytes;
        if !ok {
            return Err(match status {
                Some(s) => format!("Envoy's admin answered {}", String::from_utf8_lossy(s)),
                None => "no answer from Envoy's admin (timeout or connection failure)".into(),
            });
        }
        if body_size > max {
            return Err(format!(
                "/clusters answer of {body_size} bytes is over discovery.max_bytes ({max})"
            ));
        }
        let body = host::buffer(BufferType::HttpCallResponseBody, 0, body_size)
            .map_err(|s| format!("cannot read the /clusters answer: {s:?}"))?;
        parse_clusters(&body, cluster).map_err(|e| match e {
            DiscoveryError::NoSuchCluster(_) => {
                format!("Envoy has no cluster named {cluster:?} (check {field}, or the cluster is still warming)")
            }
            other => other.to_string(),
        })
    }

    fn on_replicas(&mut self, ok: bool, body_size: usize, status: Option<&[u8]>) {
        let Some(cluster) = self.config.share().replicas.as_ref().map(|r| r.cluster.clone()) else {
            return;
        };
        let hosts = self.clusters_answer(ok, body_size, status, &cluster, "share.replicas.cluster");
        match hosts {
            Ok(hosts) => {
                let change = self.replicas.on_hosts(&hosts);
                for peer in &change.joined {
                    host::log(LogLevel::Info, &format!("replica {peer} joined {cluster}"));
                }
                for peer in &change.left {
                    host::log(LogLevel::Info, &format!("replica {peer} left {cluster}"));
                }
                self.stats.replica_peers.set(self.replicas.targets().count() as u64);
                if self.replicas_failure.take().is_some() {
                    host::log(LogLevel::Info, &format!("replica discovery reads {cluster} again"));
                }
            }
            Err(why) => self.replicas_listing_failed(why),
        }
    }

    /// Counts a failed reading of the replicas' cluster; logs it once per cause, not every
    /// interval.
    pub(super) fn replicas_listing_failed(&mut self, why: String) {
        self.stats.replicas_discovery_failure.inc();
        if self.replicas_failure.as_deref() != Some(why.as_str()) {
            host::log(
                LogLevel::Warn,
                &format!("replica discovery failed (keeping the last replicas): {why}"),
            );
            self.replicas_failure = Some(why);
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

    pub(super) fn publish(&mut self, now: Millis) {
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

    /// No usable signature (`why`): the full `/clusters` listing at every poll from now on.
    fn read_full_listing_every_poll(&mut self, why: &str) {
        self.signatures = false;
        host::log(LogLevel::Warn, &format!("{why}: reading /clusters at every poll"));
        self.ask_admin(Call::Clusters);
    }

    /// The signature stats answered: read the full listing if they moved.
    fn on_signature(&mut self, ok: bool, body_size: usize, status: Option<&[u8]>) {
        if status == Some(b"403") {
            // An admin that allows `/clusters?` but not this query: read the full listing
            // every poll (it costs more; README, "Point kvroute at your pool").
            self.read_full_listing_every_poll("Envoy's admin refuses /stats?filter=^cluster\\.… (admin.allow_paths)");
            return;
        }
        let body = ok
            .then(|| host::buffer(BufferType::HttpCallResponseBody, 0, body_size.min(64 << 10)).ok())
            .flatten();
        if body.as_ref().is_some_and(|b| b.is_empty()) {
            // No such stats: Envoy's stats matcher drops the cluster's (Istio's default
            // inclusion list may) or the cluster has an `alt_stat_name`. An empty signature
            // never moves, so read the full listing every poll instead.
            self.read_full_listing_every_poll(
                "Envoy reports none of the pool cluster's membership stats (a stats matcher, alt_stat_name)",
            );
            return;
        }
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
}

/// Why a forward was not delivered, from the replica's answer.
fn forward_failure(status: Option<&[u8]>, by_kvroute: bool) -> String {
    match status {
        Some(b"403") if by_kvroute => "403: its share.replicas.secret differs from this gateway's".to_string(),
        Some(b"403") => "403 from before kvroute (an authorization policy, or a listener without kvroute)".to_string(),
        Some(b"404") => "404: not a kvroute gateway (check share.replicas.cluster)".to_string(),
        Some(s) => format!("status {}", String::from_utf8_lossy(s)),
        None => "no answer (not listening, unreachable, or too slow)".into(),
    }
}

/// A change in how forwards to one replica go (logged when it changes, not per batch).
fn log_forward(peer: &str, failure: Option<&str>) {
    match failure {
        None => host::log(
            LogLevel::Info,
            &format!("forwards to replica {peer} are delivered again"),
        ),
        Some(why) => host::log(
            LogLevel::Warn,
            &format!("forwards to replica {peer} fail: {why}; it does not see this gateway's placements"),
        ),
    }
}

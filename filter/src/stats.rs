//! Envoy stats the filter exports (they appear under `wasmcustom.` in `/stats`). Counters
//! are defined by name in every VM and Envoy merges them, so the figures are gateway-wide.

use std::cell::RefCell;
use std::collections::BTreeMap;

use kvroute_core::endpoint::Endpoint;
use proxy_wasm::types::MetricType;

use crate::host;

/// A metric id, or `None` when the host refused to define it (then updates are skipped).
#[derive(Clone, Copy, Debug, Default)]
pub struct Metric(Option<u32>);

impl Metric {
    fn define(kind: MetricType, name: &str) -> Metric {
        Metric(host::define_metric(kind, name).ok())
    }

    pub fn inc(&self) {
        self.add(1);
    }

    pub fn add(&self, by: u64) {
        if let Some(id) = self.0 {
            let _ = host::increment_metric(id, i64::try_from(by).unwrap_or(i64::MAX));
        }
    }

    pub fn set(&self, value: u64) {
        if let Some(id) = self.0 {
            let _ = host::record_metric(id, value);
        }
    }
}

/// One per-server gauge family: each server's gauge and the value it was last set to.
type Gauges = BTreeMap<String, (Metric, u64)>;

/// The request-path stats of a worker VM.
#[derive(Debug, Default)]
pub struct RequestStats {
    pub prefix_hit: Metric,
    pub cold: Metric,
    /// Decisions where the holder of most of the prompt went first at a higher cost
    /// (`cost.holder_tolerance`).
    pub holder_first: Metric,
    pub fallback: Metric,
    pub shed: Metric,
    pub skipped_over_limit: Metric,
    pub skipped_malformed: Metric,
    pub skipped_error: Metric,
    pub passthrough: Metric,
    /// Requests to `share.replicas.path`, answered by kvroute whatever their outcome.
    pub peer_batch: Metric,
    pub client_header_removed: Metric,
    pub prompt_tokens: Metric,
    pub predicted_cached_tokens: Metric,
    /// The prompt tokens, and the part predicted cached, of the routed requests whose
    /// answer carried usage (`usage_reported`): those `reported_cached_tokens` counts.
    pub prompt_tokens_reported: Metric,
    pub predicted_cached_tokens_reported: Metric,
    pub reported_cached_tokens: Metric,
    pub estimated_hit_permille: Metric,
    pub snapshot_age_ms: Metric,
    pub index_entries: Metric,
    pub inflight: Metric,
    pub peer_events: Metric,
    pub peer_events_lost: Metric,
    /// Events this worker wrote into the log, and events it dropped after shared data kept
    /// refusing them (`Router::return_peer_events`).
    pub peer_events_published: Metric,
    pub peer_events_unpublished: Metric,
    /// POSTs of this worker's own placements to other replicas (`share.replicas.from_workers`),
    /// and those that could not leave or were not answered 204.
    pub direct_sent: Metric,
    pub direct_failure: Metric,
    /// Segments with news left to the scraping service because the worker's POST budget
    /// (`share.replicas.from_workers_per_s`) was spent.
    pub direct_over_budget: Metric,
    pub peers_gone: Metric,
    pub usage_reported: Metric,
    pub usage_missing: Metric,
    /// Routed requests whose client left before any response (no health signal).
    pub client_left: Metric,
    pub replica_events: Metric,
    pub replica_batches_refused: Metric,
    pub replica_events_dropped: Metric,
    pub unknown_model: Metric,
    pub lease_taken: Metric,
    pub captured: Metric,
    /// `self-timing` builds only: ns spent on the request's part of a line, on the line
    /// itself, and in the host call that hands it to Envoy.
    pub capture_ns: [Metric; 3],
    /// `self-timing` builds only: ns the worker mesh took before scoring (applying peers'
    /// events), after routing (publishing the placement) and on the tick, and of all that,
    /// the time spent applying peers' events to the router.
    pub share_ns: [Metric; 4],
    pub tier_spilled: Metric,
    pub tier_unmet: Metric,
    pub capture_failed: Metric,
    /// `overload.hold`: requests held, routed after waiting, answered 429 after the wait
    /// bound or because the queue was full, gone while held (client hung up), their total
    /// wait, and how many wait now (summed over the workers).
    pub hold_held: Metric,
    pub hold_released: Metric,
    pub hold_expired: Metric,
    pub hold_refused: Metric,
    pub hold_gone: Metric,
    pub hold_unavailable: Metric,
    pub hold_wait_ms: Metric,
    pub hold_waiting: Metric,
    /// Responses from another server than the one chosen (Envoy retried after a refusal:
    /// vLLM's 503 where 503 retries are on, a failed connection), and 503s a server itself
    /// answered that reached the client.
    pub refused_moved: Metric,
    pub refused_by_server: Metric,
    /// Requests about a stored response (a continuation, `GET /v1/responses/{id}`, its
    /// cancel) sent to the server that stored it, those whose home was unknown, and homes
    /// learned from answers.
    pub response_home: Metric,
    pub home_unknown: Metric,
    pub homes_learned: Metric,
    /// Continuations paused for their home to arrive from another replica (`homes`).
    pub home_awaited: Metric,
    per_endpoint: RefCell<BTreeMap<String, Metric>>,
    /// Per-server gauges (learned rate, pace, step, unseen share) by name and server, and
    /// the value each was last set to.
    speeds: RefCell<BTreeMap<&'static str, Gauges>>,
}

impl RequestStats {
    pub fn define() -> RequestStats {
        let c = |n: &str| Metric::define(MetricType::Counter, &format!("kvroute.{n}"));
        let g = |n: &str| Metric::define(MetricType::Gauge, &format!("kvroute.{n}"));
        RequestStats {
            prefix_hit: c("decision.prefix_hit"),
            cold: c("decision.cold"),
            holder_first: c("holder_first"),
            fallback: c("decision.fallback"),
            shed: c("decision.shed"),
            skipped_over_limit: c("skipped.over_limit"),
            skipped_malformed: c("skipped.malformed"),
            skipped_error: c("skipped.error"),
            passthrough: c("passthrough"),
            peer_batch: c("peer_batch"),
            client_header_removed: c("client_destination_header_removed"),
            prompt_tokens: c("tokens.prompt"),
            predicted_cached_tokens: c("tokens.predicted_cached"),
            prompt_tokens_reported: c("tokens.prompt_reported"),
            predicted_cached_tokens_reported: c("tokens.predicted_cached_reported"),
            reported_cached_tokens: c("tokens.reported_cached"),
            estimated_hit_permille: g("estimated_prefix_hit_permille"),
            snapshot_age_ms: g("snapshot_age_ms"),
            index_entries: g("index_entries"),
            inflight: g("inflight_requests"),
            peer_events: c("mesh.events_applied"),
            peer_events_lost: c("mesh.events_lost"),
            peer_events_published: c("mesh.events_published"),
            peer_events_unpublished: c("mesh.events_unpublished"),
            direct_sent: c("replicas.direct_sent"),
            direct_failure: c("replicas.direct_failure"),
            direct_over_budget: c("replicas.direct_over_budget"),
            peers_gone: c("mesh.peers_gone"),
            usage_reported: c("responses.usage_reported"),
            usage_missing: c("responses.usage_missing"),
            client_left: c("responses.client_left"),
            replica_events: c("replicas.events_taken"),
            replica_batches_refused: c("replicas.batches_refused"),
            replica_events_dropped: c("replicas.events_dropped"),
            unknown_model: c("decision.unknown_model"),
            lease_taken: c("lease.taken"),
            captured: c("capture.lines"),
            capture_ns: if cfg!(feature = "self-timing") {
                ["request", "line", "set_property"].map(|n| c(&format!("capture.ns_{n}")))
            } else {
                [Metric::default(); 3]
            },
            share_ns: if cfg!(feature = "self-timing") {
                ["before_route", "after_route", "tick", "apply"].map(|n| c(&format!("mesh.ns_{n}")))
            } else {
                [Metric::default(); 4]
            },
            tier_spilled: c("tiers.spilled"),
            tier_unmet: c("tiers.objective_unmet"),
            capture_failed: c("capture.failed"),
            hold_held: c("hold.held"),
            hold_released: c("hold.released"),
            hold_expired: c("hold.expired"),
            hold_refused: c("hold.refused"),
            hold_gone: c("hold.gone"),
            hold_unavailable: c("hold.unavailable"),
            hold_wait_ms: c("hold.wait_ms"),
            hold_waiting: g("hold.waiting"),
            refused_moved: c("refused.moved"),
            refused_by_server: c("refused.by_server"),
            response_home: c("decision.response_home"),
            home_unknown: c("stored_response.home_unknown"),
            homes_learned: c("stored_response.homes_learned"),
            home_awaited: c("stored_response.home_awaited"),
            per_endpoint: RefCell::new(BTreeMap::new()),
            speeds: RefCell::new(BTreeMap::new()),
        }
    }

    /// Sets the prefill rate this worker learned for `endpoint` from vLLM's sums, in tokens
    /// per second (`kvroute.endpoint.<ip_port>.prefill_tokens_per_s`; the workers' latest
    /// report wins).
    pub fn speed(&self, endpoint: &str, tokens_per_s: u64) {
        self.per_endpoint_gauge(endpoint, "prefill_tokens_per_s", tokens_per_s);
    }

    /// Sets the pace `endpoint`'s first tokens showed, in position-weighted prompt tokens
    /// per second (`kvroute.endpoint.<ip_port>.prefill_pace`; `speed::PrefillPace`).
    pub fn pace(&self, endpoint: &str, tokens_per_s: u64) {
        self.per_endpoint_gauge(endpoint, "prefill_pace", tokens_per_s);
    }

    /// Sets `endpoint`'s recent step time from its metrics, in microseconds
    /// (`kvroute.endpoint.<ip_port>.step_us`; `speed::StepTime`).
    pub fn step(&self, endpoint: &str, us: u64) {
        self.per_endpoint_gauge(endpoint, "step_us", us);
    }

    /// Sets how many requests `endpoint` finished per minute over the last seconds, from its
    /// metrics (`kvroute.endpoint.<ip_port>.completions_per_min`; `speed::Completions`): the pace
    /// its waiting requests are admitted at where its sequence slots are full (charged in
    /// untiered routing, `cost.admission_weight`).
    pub fn completions(&self, endpoint: &str, per_min: u64) {
        self.per_endpoint_gauge(endpoint, "completions_per_min", per_min);
    }

    /// Sets `endpoint`'s speed weight, in thousandths
    /// (`kvroute.endpoint.<ip_port>.speed_weight_permille`; `cost.speed_weights`, or its
    /// weight in Envoy's pool cluster with `cost.speed_weights_from_envoy`): the weight
    /// itself, applied only until its rate is learned and only where weights differ by
    /// more than 1.5×. Reported only where weights are in use (`policy::weights_in_use`).
    pub fn speed_weight(&self, endpoint: &str, permille: u64) {
        self.per_endpoint_gauge(endpoint, "speed_weight_permille", permille);
    }

    /// Sets the share of `endpoint`'s recent prompt tokens that went through neither this
    /// worker nor the routers it shares with, in permille
    /// (`kvroute.endpoint.<ip_port>.unseen_permille`; `seen::SeenShare`).
    pub fn unseen(&self, endpoint: &str, permille: u64) {
        self.per_endpoint_gauge(endpoint, "unseen_permille", permille);
    }

    /// Sets how far tiers scale `endpoint`'s predicted TTFT, in thousandths
    /// (`kvroute.endpoint.<ip_port>.ttft_scale_permille`; `speed::TtftBias`, learned from
    /// the streamed first tokens of this worker and the routers it shares with; 1000 until
    /// there are enough). Reported only with tiers.
    pub fn ttft_scale(&self, endpoint: &str, permille: u64) {
        self.per_endpoint_gauge(endpoint, "ttft_scale_permille", permille);
    }

    /// Sets to 0 and forgets the per-server gauges of servers no longer in the pool: a
    /// metric cannot be removed, and a departed server's last prefill rate or step time
    /// would read as a live server's in every dashboard (with pod IPs, one per pod that
    /// ever ran). Its `chosen` counter stays: a counter keeps its total. `in_pool` is the
    /// router's table, sorted by id (`EndpointTable`), so a lookup is a binary search.
    pub fn forget_departed(&self, in_pool: &[Endpoint]) {
        let stays = |id: &str| in_pool.binary_search_by(|e| e.id.as_str().cmp(id)).is_ok();
        if let Ok(mut map) = self.speeds.try_borrow_mut() {
            for gauges in map.values_mut() {
                gauges.retain(|id, (metric, _)| {
                    let keep = stays(id);
                    if !keep {
                        metric.set(0);
                    }
                    keep
                });
            }
        }
        // The `chosen` counters keep their totals in Envoy; this VM forgets its handles (a
        // returning server's counter is looked up again by name), so pod churn over days
        // does not grow the map.
        if let Ok(mut map) = self.per_endpoint.try_borrow_mut() {
            map.retain(|id, _| stays(id));
        }
    }

    fn per_endpoint_gauge(&self, endpoint: &str, name: &'static str, value: u64) {
        let Ok(mut map) = self.speeds.try_borrow_mut() else {
            return;
        };
        let gauges = map.entry(name).or_default();
        // Reported every 100 ms for every server: a host call only when the value moved.
        if let Some((metric, last)) = gauges.get_mut(endpoint) {
            if *last != value {
                *last = value;
                metric.set(value);
            }
            return;
        }
        let metric = Metric::define(
            MetricType::Gauge,
            &format!("kvroute.endpoint.{}.{name}", safe_name(endpoint)),
        );
        metric.set(value);
        gauges.insert(endpoint.to_string(), (metric, value));
    }

    /// Counts a request sent to `endpoint` (`kvroute.endpoint.<ip_port>.chosen`).
    pub fn chosen(&self, endpoint: &str) {
        let Ok(mut map) = self.per_endpoint.try_borrow_mut() else {
            return;
        };
        if let Some(metric) = map.get(endpoint) {
            metric.inc();
            return;
        }
        // First request to this endpoint in this VM: define its counter (allocates once).
        let metric = Metric::define(
            MetricType::Counter,
            &format!("kvroute.endpoint.{}.chosen", safe_name(endpoint)),
        );
        metric.inc();
        map.insert(endpoint.to_string(), metric);
    }
}

/// The scraping service's stats.
#[derive(Debug, Default)]
pub struct ScrapeStats {
    pub forward_failure: Metric,
    /// Segments of this process's log lost before the forwarder read them.
    pub forward_lost: Metric,
    /// Batches POSTed to other replicas (each peer counts once).
    pub forwarded: Metric,
    pub success: Metric,
    pub failure: Metric,
    pub healthy_endpoints: Metric,
    pub published: Metric,
    pub discovery_success: Metric,
    pub discovery_failure: Metric,
    pub discovered_hosts: Metric,
    /// Replicas batches go to (this process not counted once it knows its own address).
    pub replica_peers: Metric,
    pub replicas_discovery_failure: Metric,
}

impl ScrapeStats {
    pub fn define() -> ScrapeStats {
        ScrapeStats {
            forward_failure: Metric::define(MetricType::Counter, "kvroute.replicas.forward_failure"),
            forward_lost: Metric::define(MetricType::Counter, "kvroute.replicas.segments_lost"),
            forwarded: Metric::define(MetricType::Counter, "kvroute.replicas.batches_sent"),
            success: Metric::define(MetricType::Counter, "kvroute.scrape.success"),
            failure: Metric::define(MetricType::Counter, "kvroute.scrape.failure"),
            healthy_endpoints: Metric::define(MetricType::Gauge, "kvroute.scrape.healthy_endpoints"),
            published: Metric::define(MetricType::Counter, "kvroute.snapshot.published"),
            discovery_success: Metric::define(MetricType::Counter, "kvroute.discovery.success"),
            discovery_failure: Metric::define(MetricType::Counter, "kvroute.discovery.failure"),
            discovered_hosts: Metric::define(MetricType::Gauge, "kvroute.discovery.hosts"),
            replica_peers: Metric::define(MetricType::Gauge, "kvroute.replicas.peers"),
            replicas_discovery_failure: Metric::define(MetricType::Counter, "kvroute.replicas.discovery_failure"),
        }
    }
}

/// An endpoint address as a stat name segment.
fn safe_name(endpoint: &str) -> String {
    endpoint
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
        .collect()
}

/// The host clock in ns in `self-timing` builds (benchmark-only: the filter times its own
/// work); 0, and no host call, otherwise.
pub fn self_clock() -> u64 {
    if cfg!(feature = "self-timing") {
        crate::host::now_nanos()
    } else {
        0
    }
}

//! The configuration document's shape: every section as serde reads it (unknown fields
//! rejected, every field defaulted in `defaults`), before `Config` validates it.

use serde::Deserialize;

use crate::types::EndpointId;

/// Which scoring policy picks the endpoint.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PolicyKind {
    /// Predicted time to first token, in milliseconds (the default).
    Cost,
    /// Queue / KV / prefix scorers normalised to [0, 1] and weighted.
    Weighted,
    LeastRequest,
    RoundRobin,
    Random,
}

/// How Envoy reaches the pool: decides what the filter must enforce.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ClusterShape {
    /// `override_host` LB policy: only hosts in the cluster can be chosen.
    OverrideHost,
    /// `ORIGINAL_DST` with `use_http_header`: any address is reachable, so the pool must be declared.
    OriginalDst,
}

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RawConfig {
    pub endpoints: Vec<String>,
    pub cluster_shape: ClusterShape,
    pub policy: PolicyKind,
    pub fallbacks: usize,
    pub seed: u64,
    pub max_body_bytes: usize,
    pub tenant_header: String,
    pub priority_header: String,
    pub debug_headers: bool,
    /// Send requests about a stored Responses answer (a follow-up naming it, its `GET`, its
    /// cancel) to the server that stored it, learned from each answer. Off for a fleet run
    /// without `VLLM_ENABLE_RESPONSES_API_STORE=1`: it stores nothing, and learning each
    /// answer's server costs an event shared with every worker and replica.
    pub stored_responses: bool,
    pub hashing: RawHashing,
    pub scrape: RawScrape,
    pub health: RawHealth,
    pub cost: RawCost,
    pub weighted: RawWeighted,
    pub overload: RawOverload,
    pub index: RawIndex,
    pub share: RawShare,
    pub discovery: RawDiscovery,
    pub capture: RawCapture,
    pub tiers: RawTiers,
}

/// Where the pool comes from when `endpoints` is empty: Envoy's own view of the pool
/// cluster, read from its admin `/clusters` through `admin_cluster` (a cluster pointing at
/// the admin address; in Istio every proxy has `prometheus_stats`). The singleton service
/// polls it; without one, one worker VM holds a lease in shared data and polls for all.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RawDiscovery {
    pub admin_cluster: String,
    /// The pool cluster to follow; empty means `scrape.cluster`.
    pub cluster: String,
    pub interval_ms: u64,
    pub timeout_ms: u64,
    pub max_bytes: usize,
    /// How often each server's `/v1/models` is read (new servers at once); 0 never.
    pub models_interval_ms: u64,
    /// A lease holder (the worker polling for the others) silent this long is replaced.
    pub lease_ms: u64,
    /// Between full `/clusters` reads, each poll reads only a few of the cluster's stats
    /// and reads `/clusters` when they moved; it is read this often regardless.
    pub resync_ms: u64,
}

/// Price tiers with spillover (`tiers`): servers are put in tiers, cheapest first (tier 0).
/// A request goes to the cheapest tier whose best server's predicted TTFT meets its objective
/// and spills to the next tier only when it would not. Where no tier is predicted to serve
/// it in time the tiers step aside and the cost policy's best server takes it, unless it
/// would miss even on an idle server: that one stays in the cheapest (spilling it would
/// spend premium capacity on a miss). Off unless
/// `endpoints` lists a server or `from_priority` is set; needs the `cost` policy (its score
/// is the predicted TTFT).
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RawTiers {
    /// Each server's tier (`ip:port` → 0, 1, …); servers not listed are in tier 0.
    pub endpoints: std::collections::BTreeMap<String, u32>,
    /// Each server's tier is its priority in Envoy's pool cluster (EDS `priority`, as the
    /// admin `/clusters` view reports it), instead of `endpoints`.
    pub from_priority: bool,
    /// The TTFT objective of a request without the header, in ms.
    pub ttft_objective_ms: f64,
    /// A request's own objective in ms (a positive number; others are ignored).
    pub objective_header: String,
    /// The share of each request's objective the tier rule plans for (0 < share ≤ 1): a
    /// server meets the objective when its scaled prediction is within objective × share,
    /// a margin for the prediction's error.
    pub objective_share: f64,
    /// The most sequences each tier's servers run at once (vLLM's `--max-num-seqs`), by tier
    /// (the first number is tier 0's; 0 or a tier past the list: no limit). A server with
    /// that many requests of this gateway in flight does not meet the objective: a new
    /// request would wait in its queue for a slot, whatever its prefill would take.
    pub max_num_seqs: Vec<u32>,
}

impl RawTiers {
    pub fn on(&self) -> bool {
        !self.endpoints.is_empty() || self.from_priority
    }

    /// The tier of server `id`, whose priority in Envoy's pool cluster is `priority`.
    pub fn tier_of(&self, id: &EndpointId, priority: u32) -> u32 {
        if self.from_priority {
            return priority;
        }
        self.endpoints.get(id.as_str()).copied().unwrap_or(0)
    }

    /// Whether a server of `tier` with `inflight` requests in flight has no sequence slot
    /// left (`max_num_seqs`).
    pub fn full(&self, tier: u32, inflight: u32) -> bool {
        let slots = self.max_num_seqs.get(tier as usize).copied().unwrap_or(0);
        slots > 0 && inflight >= slots
    }
}

/// Traffic capture for `kvroute-sim replay` and `plan` (`capture`): off unless `sample` > 0.
/// Each captured request becomes a JSON line (no prompt text) in the filter state
/// `wasm.<property>`, which an Envoy access log writes (envoy/capture/README.md).
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RawCapture {
    /// Fraction of prefix families captured, 0 (off) to 1 (every routed request).
    pub sample: f64,
    /// Bytes of canonical prompt text per captured block id; 0 means `hashing.block_bytes`,
    /// otherwise a multiple of it.
    pub block_bytes: usize,
    /// The deployment's secret (16 bytes or more): ids are keyed by it.
    pub salt: String,
    /// The filter state name the line is written to (Envoy prefixes `wasm.`).
    pub property: String,
}

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RawHashing {
    pub block_bytes: usize,
    pub max_blocks: usize,
}

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RawScrape {
    pub cluster: String,
    pub path: String,
    pub interval_ms: u64,
    pub timeout_ms: u64,
    pub max_bytes: usize,
    /// Scrapes a second at most (0: no limit): a large pool is scraped less often than
    /// `interval_ms`, but at least every 40% of `health.stale_after_ms`.
    pub max_per_s: u64,
}

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RawHealth {
    pub unhealthy_after_failures: u32,
    pub healthy_after_successes: u32,
    pub stale_after_ms: u64,
    pub passive_failures_to_eject: u32,
    pub eject_ms: u64,
}

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RawCost {
    pub prefill_tokens_per_s: f64,
    pub decode_ms_per_running: f64,
    pub kv_pressure_threshold: f64,
    pub kv_pressure_ms: f64,
    /// The KV-pressure term's threshold and size where at least two candidates are scored
    /// at half the fastest one's rate or less (GPUs of different generations,
    /// `policy::unlike_rates`): the cost sends a faster server more of the work, but its
    /// KV cache is no larger, and near full it keeps new prompts waiting for blocks that
    /// decodes free.
    pub kv_pressure_unlike_threshold: f64,
    pub kv_pressure_unlike_ms: f64,
    /// Weight of the admission wait (`policy::admission_ms`): where a server's sequence
    /// slots are all taken and requests wait, a new request waits for one more running
    /// request than wait there to finish, at the server's recent completion rate. Charged
    /// in untiered routing only, and only while some candidate has nothing queued
    /// (`policy::ADMISSION_BACKLOG`). 0 leaves it out.
    pub admission_weight: f64,
    pub cold_tolerance: f64,
    /// A cold prefix's owner among the candidates within `cold_tolerance` is drawn by
    /// weighted rendezvous: each candidate's weight falls by e^(−cold_balance × r) where r
    /// is how far the prefix index entries it holds per unit of prefill rate lie above the
    /// candidates' mean, in fractions of that mean (`Router::prefer_rendezvous_owner`); 0
    /// draws by the plain hash, as does a router that does not see most of every
    /// candidate's traffic (`seen`).
    pub cold_balance: f64,
    /// The share of a request's uncached tokens that still counts in the scraped bound of
    /// its server's queue after its first token, until the next scrape (before it, a
    /// request's tokens counted in full until its completion or the next scrape).
    pub served_tokens_kept: f64,
    /// A candidate that holds at least `holder_min_share` of the prompt's blocks (and more
    /// than the best-scored candidate) goes first when its cost is within this fraction of
    /// the best (`Router::prefer_prefix_holder`); 0 turns it off.
    pub holder_tolerance: f64,
    pub holder_min_share: f64,
    /// On a fleet of unlike GPUs, while the best-scored server's KV cache binds
    /// (`Router::storage_binds`: its part of the prefix index is at least `storage_fill`
    /// full, and at least `storage_lost_share` of what it evicts is sent to it again (its
    /// class mates' share where it has evicted too little to tell), or, before any of them
    /// has, its hits reach back at least `storage_depth` of the way to its oldest content),
    /// a cold prompt's owner is drawn by the room left
    /// in each candidate's cache among those costing at most this many times more than the
    /// best (`Router::prefer_room_owner`), and the holder of most of a prompt may cost this
    /// much more (instead of `holder_tolerance`). 0 turns it off.
    pub storage_tolerance: f64,
    pub storage_fill: f64,
    pub storage_lost_share: f64,
    pub storage_depth: f64,
    pub default_prompt_tokens: u64,
    pub work_weight: f64,
    /// Added to a server's cost when the request's LoRA adapter is not loaded there.
    pub lora_load_ms: f64,
    /// Learn each server's prefill rate from first-token times (`speed`); the configured
    /// rate is the prior.
    pub learn_speeds: bool,
    /// Each server's speed relative to the others (`ip:port` → weight, e.g. 3 for each H100
    /// beside A100s at 1): until its own rate is learned, a server is scored at the typical
    /// rate × its weight ÷ the typical servers' weight. Servers not listed weigh 1, or their
    /// load-balancing weight in Envoy's pool cluster with `speed_weights_from_envoy`.
    /// Weights within `speed::SAME_WITHIN` (1.5×) of the typical one count as alike
    /// (`policy::weights`).
    pub speed_weights: std::collections::BTreeMap<String, f64>,
    /// Read the servers' load-balancing weights in Envoy's pool cluster (EDS
    /// `load_balancing_weight`, from the admin `/clusters` view) as speed weights. Off by
    /// default: weights set for another reason (a canary's small share) would read as a
    /// slow server.
    pub speed_weights_from_envoy: bool,
    /// Phase-aware placement (an experiment, off at 0): the stall a request's uncached
    /// prefill adds to the decodes running on a server (running × its prefill ms) enters
    /// the cost at this weight, so long prefills keep away from decode-heavy servers.
    pub phase_weight: f64,
    /// The delay a request's uncached prefill adds to the requests already waiting for
    /// their first token on a server (vLLM runs them in the same steps, so each step grows
    /// by its tokens), counted this many times for each of at most two of them: a long cold
    /// prompt keeps away from a server where short ones are about to start. 0 turns it off.
    pub pending_weight: f64,
    /// The most prompt tokens a server computes in one step (vLLM's
    /// `--max-num-batched-tokens`; its default for online serving is 8,192 on GPUs of 70
    /// GiB and more but the A100, 2,048 on the rest). A waiting request shares at most one
    /// step's worth of a new prompt's tokens, so `pending_weight` charges no more than this
    /// many of them for each. Give the largest of the fleet's.
    pub max_num_batched_tokens: u64,
    /// The share of the progress first tokens suggest a server made on its oldest prompt in
    /// prefill that is taken off its pending prefill (`Endpoint::prefill_left`); 0 keeps a
    /// prompt's whole length pending until its first token.
    pub progress_credit: f64,
    /// The context length at which a prompt token's attention costs as much as the rest of
    /// its compute (`speed::prefill_work`; 0: every token alike).
    pub attention_tokens: f64,
    /// The server's steps a new request waits for its first token beyond its prefill (the
    /// step in progress, then its own), at the step time its metrics show
    /// (`speed::StepTime`); 0 leaves step time out.
    pub first_token_steps: f64,
}

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RawWeighted {
    pub queue: f64,
    pub kv: f64,
    pub prefix: f64,
}

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RawOverload {
    /// Waiting requests (scraped), and KV usage, at which a server counts as full: with
    /// every server full a sheddable request is shed. The policies other than `cost` also
    /// skip a full server while another has room; `cost` weighs its queue and KV instead.
    pub queue_limit: u64,
    pub kv_limit: f64,
    pub retry_after_s: u64,
    /// A server that refused a request (vLLM's 503 of `--max-num-queued-reqs` /
    /// `--max-num-queued-tokens`, or a failed connection: Envoy retried it on the next
    /// server of the decision) goes after every server that did not, for this long. 0 (the
    /// default): measured live, demoting it cost more cache hits than it saved refusals.
    pub refused_ms: u64,
    /// Holding requests at the gateway while every server is full (see `hold`).
    pub hold: RawHold,
}

/// `overload.hold`: while every candidate is full, a request that may not be shed waits in
/// one queue per Envoy process (fair across tenants, weighted by priority) and is routed at
/// the first tick that finds room, up to `max_wait_ms`; then 429 with `Retry-After`.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RawHold {
    /// The longest a request waits for room; 0 turns holding off (every request is routed
    /// at once, to the least bad server when all are full).
    pub max_wait_ms: u64,
    /// A server is full for a new request when the prefill the gateway has queued or
    /// running there (its requests without a first token yet, less the progress credited
    /// to the one in prefill, at the server's own prefill rate; `policy::pending_prefill_ms`)
    /// would take this long.
    pub wait_limit_ms: u64,
    /// Requests one Envoy process holds at most.
    pub max_requests: usize,
    /// One priority band up gets this many times the dispatches of the band below.
    pub priority_weight: f64,
    /// Within one (priority, tenant) flow, the newest held request goes out first once the
    /// oldest has waited this long; 0 (the default): first come, first served.
    pub newest_first_after_ms: u64,
    /// A request that names its TTFT objective (`tiers.objective_header`) waits at most
    /// this share of it (within `max_wait_ms`): one held past its objective is served late
    /// anyway, and one with a long objective may wait longer than a short one's bound. 0
    /// (the default): every request waits up to `max_wait_ms`.
    pub objective_wait_share: f64,
}

impl RawHold {
    /// How long a request whose objective header says `objective_ms` may wait.
    pub fn wait_bound_ms(&self, objective_ms: Option<f64>) -> u64 {
        match objective_ms {
            // Holding off: nothing waits.
            _ if self.max_wait_ms == 0 => 0,
            Some(o) if self.objective_wait_share > 0.0 && o.is_finite() && o > 0.0 => {
                ((o * self.objective_wait_share).round() as u64).clamp(1, self.max_wait_ms.max(1))
            }
            _ => self.max_wait_ms,
        }
    }
}

/// How the routers of one Envoy process (one per worker thread) share one view.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RawShare {
    /// Exchange placements and load between the workers of one Envoy (see `peer`).
    pub workers: bool,
    /// How often a worker publishes its changes and applies its peers' (and polls the
    /// scraping service's snapshot).
    pub tick_ms: u64,
    /// A peer silent this long is gone: its requests' load is released.
    pub peer_timeout_ms: u64,
    /// Also exchange around each routing decision (not only on the tick).
    pub on_request: bool,
    /// With `on_request`: a decision publishes at once only a placement that is news (a
    /// cold or moved prefix); prefix hits wait for the tick (`PeerEvent::is_news`) while the
    /// worker published within the last two ticks.
    pub hits_on_tick: bool,
    /// Gateway replicas (other Envoy processes) to exchange the same events with; off when
    /// absent.
    pub replicas: Option<RawReplicas>,
}

/// How a gateway forwards its workers' events to the other replicas and takes theirs:
/// the scraping service POSTs them through `cluster` (an `override_host` cluster listing
/// the replicas' peer listeners) to `path`, which the filter answers locally.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RawReplicas {
    /// Every replica's peer listener, `IP:port` (this one's may be listed too). Empty: the
    /// replicas are the hosts of `cluster` as Envoy's admin lists them (a `STRICT_DNS`
    /// cluster on the gateways' headless Service follows the Deployment's pods), read every
    /// `discovery.interval_ms` through `discovery.admin_cluster`.
    pub peers: Vec<String>,
    pub cluster: String,
    pub path: String,
    /// Sent in `x-kvroute-peer-secret`; a request to `path` without it gets 403.
    pub secret: String,
    pub interval_ms: u64,
    /// Placements leave for the other replicas within a ms (the scraping service reads the
    /// log every ms), not only every `interval_ms`.
    pub at_once: bool,
    /// A worker that publishes a placement that is news (a cold or moved prefix) POSTs it
    /// to the other replicas itself as it publishes it, instead of leaving it for the
    /// scraping service's next tick.
    pub from_workers: bool,
    /// With `from_workers`: the most POSTs one worker makes a second (a segment costs one
    /// per other replica; a second's worth may be saved for a burst). A segment past it is
    /// left to the scraping service's next batch (`replicas.direct_over_budget`).
    pub from_workers_per_s: u32,
    pub max_body_bytes: usize,
}

impl RawReplicas {
    /// Whether the replicas are learned from Envoy (no `peers` listed).
    pub fn discovered(&self) -> bool {
        self.peers.is_empty()
    }
}

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RawIndex {
    pub max_memory_bytes: usize,
    pub default_capacity_tokens: u64,
    /// Correct what the index keeps per server with the cached tokens vLLM reports.
    pub learn_from_usage: bool,
}

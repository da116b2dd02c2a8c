//! The router: pure decisions over explicit state, changed only through named events.
//!
//! `route(&self, request, now)` reads the endpoint table and the prefix index and returns a
//! [`Decision`]; it changes nothing. What happened next is reported by the caller:
//! `on_routed` (the decision was used), `on_first_token` (its prefill is done),
//! `on_completed` (the response ended, however),
//! `on_metrics` / `on_scrape_failed` (a scrape result), `on_endpoints` (membership).
//! The filter, the simulator's replay and its live mode all drive the same events.

use std::collections::BTreeMap;

use crate::config::{Config, PolicyKind};
use crate::decision::{Decision, EndpointScore, FallbackReason, FilterReason, Outcome, Tiering};
use crate::endpoint::{Endpoint, EndpointTable};
use crate::fleet::EnvoyHealth;
use crate::hashing::PrefixHasher;
use crate::health::HealthState;
use crate::index::PrefixIndex;
use crate::metrics::VllmMetrics;
use crate::peer::PeerEvent;
use crate::policy::{self, Candidate, ScoreContext};
use crate::request::{ParsedRequest, BYTES_PER_TOKEN};
use crate::types::{BlockHash, Cost, EndpointId, Millis, Tokens};

/// Requests tracked in flight at most; the oldest is released past it (lost completions
/// must not leak memory or pin load on an endpoint forever).
pub const MAX_INFLIGHT: usize = 65_536;

/// What routing needs from one request, already hashed.
#[derive(Clone, Debug, PartialEq)]
pub struct RouteRequest {
    pub model: String,
    pub blocks: Vec<BlockHash>,
    pub prompt_tokens: Tokens,
    pub max_tokens: Option<u64>,
    /// From the priority header: a negative priority may be shed under overload.
    pub sheddable: bool,
    /// From `tiers.objective_header`: this request's TTFT objective in ms.
    pub ttft_objective_ms: Option<f64>,
}

/// How a routed request ended.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Completion {
    /// The upstream that actually answered, when the proxy knows it (retries may move it).
    pub served_by: Option<EndpointId>,
    /// HTTP status a server answered; 0 when none did (reset, connect failure, timeout, and
    /// the proxy's own replies after them, e.g. Envoy's 503 once its retries ran out).
    pub status: u16,
    /// `usage.prompt_tokens_details.cached_tokens`, when the response carried it.
    pub cached_tokens: Option<u64>,
    /// `usage.prompt_tokens`, when the response carried it.
    pub prompt_tokens: Option<u64>,
    /// The response carried `usage` (with or without `prompt_tokens_details`).
    pub usage: bool,
}

/// Counters for stats and for checking the index's predictions against vLLM's reports.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RouterStats {
    pub routed: u64,
    pub completed: u64,
    /// Prompt tokens the index predicted cached, over requests whose response reported.
    pub predicted_cached_tokens: u64,
    /// Cached tokens vLLM reported for the same requests.
    pub reported_cached_tokens: u64,
    pub reported_prompt_tokens: u64,
    /// Tokens the index predicted cached that vLLM did not have (over-prediction), and
    /// tokens vLLM had cached that the index did not predict (under-prediction).
    pub overpredicted_tokens: u64,
    pub underpredicted_tokens: u64,
    /// Events applied from peer routers.
    pub peer_events: u64,
    /// Requests served elsewhere than where they were sent (Envoy retried them after a
    /// refusal: vLLM's 503, a failed connection), this router's and its peers'.
    pub refusals: u64,
}

#[derive(Clone, Debug)]
struct Inflight {
    key: u64,
    endpoint: EndpointId,
    /// When it was routed: it counts in the endpoint's `sent_since_scrape` while the
    /// endpoint's metrics were taken before then (they cannot show it yet).
    routed_at: Millis,
    /// Still counted in the endpoint's `pending_prefill_tokens` (no first token seen yet).
    prefilling: bool,
    blocks: Vec<BlockHash>,
    prompt_tokens: Tokens,
    uncached: Tokens,
    /// This router's predicted TTFT at routing (NaN for a peer's request).
    predicted_ttft_ms: f64,
}

#[derive(Clone, Debug)]
pub struct Router {
    config: Config,
    hasher: PrefixHasher,
    table: EndpointTable,
    index: PrefixIndex,
    inflight: BTreeMap<u64, Inflight>,
    rotation: u64,
    mean_uncached: f64,
    stats: RouterStats,
    /// This router's number among the peers it shares with (0 when it shares with none).
    origin: u32,
    /// Changes not yet handed to peers; `None` when this router shares with none.
    outbox: Option<Vec<PeerEvent>>,
    /// Peers' requests whose completion arrived before their placement (bounded).
    early_completions: RecentKeys,
}

/// A bounded set of request keys: the oldest is forgotten past `RecentKeys::CAP`.
#[derive(Clone, Debug, Default)]
struct RecentKeys {
    keys: std::collections::BTreeSet<u64>,
    order: std::collections::VecDeque<u64>,
}

impl RecentKeys {
    const CAP: usize = 4096;

    fn insert(&mut self, key: u64) {
        if self.keys.insert(key) {
            self.order.push_back(key);
        }
        while self.order.len() > Self::CAP {
            if let Some(old) = self.order.pop_front() {
                self.keys.remove(&old);
            }
        }
    }

    fn remove(&mut self, key: &u64) -> bool {
        // `order` keeps the key until it is popped; a stale entry there only ages out.
        self.keys.remove(key)
    }
}

impl Router {
    pub fn new(config: Config) -> Router {
        let hasher = PrefixHasher::new(config.hashing().block_bytes, config.hashing().max_blocks);
        let index = PrefixIndex::new(config.index().max_memory_bytes);
        let mean_uncached = config.cost().default_prompt_tokens as f64;
        let mut router = Router {
            config,
            hasher,
            table: EndpointTable::default(),
            index,
            inflight: BTreeMap::new(),
            rotation: 0,
            mean_uncached,
            stats: RouterStats::default(),
            origin: 0,
            outbox: None,
            early_completions: RecentKeys::default(),
        };
        let endpoints = router.config.endpoints().to_vec();
        router.on_endpoints(&endpoints);
        router
    }

    pub fn config(&self) -> &Config {
        &self.config
    }
    pub fn endpoints(&self) -> &[Endpoint] {
        self.table.rows()
    }
    pub fn index(&self) -> &PrefixIndex {
        &self.index
    }
    pub fn stats(&self) -> &RouterStats {
        &self.stats
    }
    /// Gives the prefix index `max_memory_bytes` (instead of the configured
    /// `index.max_memory_bytes`): the routers of one process that share one view each keep a
    /// full copy, so they split the configured budget between them.
    pub fn set_index_budget(&mut self, max_memory_bytes: usize) {
        self.index.set_budget(max_memory_bytes);
    }

    pub fn inflight_requests(&self) -> usize {
        self.inflight.len()
    }

    /// Hashes a parsed body into a routing request for `tenant`.
    pub fn request(&self, parsed: &ParsedRequest, tenant: &str, sheddable: bool) -> RouteRequest {
        let salt = parsed.cache_salt.as_deref().unwrap_or("");
        RouteRequest {
            model: parsed.model.clone(),
            blocks: self.hasher.hash(&parsed.model, tenant, salt, &parsed.canonical),
            prompt_tokens: parsed.prompt_tokens,
            max_tokens: parsed.max_tokens,
            sheddable,
            ttft_objective_ms: None,
        }
    }

    fn tokens_per_block(&self) -> u64 {
        (self.config.hashing().block_bytes as u64 / BYTES_PER_TOKEN).max(1)
    }

    /// Picks endpoints for `req`. Pure: the same state, request and `now` give the same decision.
    pub fn route(&self, req: &RouteRequest, now: Millis) -> Decision {
        let rows = self.table.rows();
        let slots = rows.iter().map(|e| usize::from(e.slot) + 1).max().unwrap_or(0);
        let mut matched = vec![0u32; slots];
        self.index.matches(&req.blocks, &mut matched);
        let stale_after = self.config.health().stale_after_ms;
        let model_known = rows.iter().any(|e| e.lists_model(&req.model));
        if !model_known && rows.iter().any(|e| e.models.is_some()) {
            // Servers list their models and none lists this one: a typo or a model this pool
            // does not serve. Envoy balances it and the server answers (vLLM: 404).
            return Decision {
                endpoints: Vec::new(),
                outcome: Outcome::Fallback(FallbackReason::UnknownModel),
                matched_blocks: 0,
                breakdown: Vec::new(),
                tier: None,
                holder_first: false,
            };
        }

        let mut breakdown = Vec::with_capacity(rows.len());
        let mut cands: Vec<(usize, Candidate)> = Vec::with_capacity(rows.len());
        for e in rows {
            let m = matched.get(usize::from(e.slot)).copied().unwrap_or(0);
            let cached = Tokens((u64::from(m) * self.tokens_per_block()).min(req.prompt_tokens.0));
            let uncached = req.prompt_tokens.saturating_sub(cached);
            let fresh = e.fresh_metrics(now, stale_after);
            let filtered = self.filter(e, fresh, req, model_known, now);
            if let (None, Some(metrics)) = (filtered, fresh) {
                cands.push((
                    breakdown.len(),
                    Candidate {
                        endpoint: e,
                        metrics,
                        matched_blocks: m,
                        uncached,
                    },
                ));
            }
            breakdown.push(EndpointScore {
                endpoint: e.id.clone(),
                matched_blocks: m,
                uncached_tokens: uncached,
                prefill_ms: 0.0,
                decode_ms: 0.0,
                kv_ms: 0.0,
                cost: Cost(f64::NAN),
                ttft_ms: f64::NAN,
                filtered,
            });
        }
        if cands.is_empty() {
            return self.fallback(breakdown);
        }
        // Degraded hosts, servers with no LoRA slot for this adapter and servers that just
        // refused work only when nothing better is left.
        let demoted = |c: &Candidate| -> Option<FilterReason> {
            if c.endpoint.envoy == EnvoyHealth::Degraded {
                return Some(FilterReason::Degraded);
            }
            if c.endpoint.refusing(now) {
                return Some(FilterReason::Refusing);
            }
            let full = c.endpoint.adapter_state(&req.model).is_some_and(|(_, full)| full);
            full.then_some(FilterReason::LoraSlotsFull)
        };
        if cands.iter().any(|(_, c)| demoted(c).is_none()) {
            for (row, c) in &cands {
                if let Some(reason) = demoted(c) {
                    breakdown[*row].filtered = Some(reason);
                }
            }
            cands.retain(|(_, c)| demoted(c).is_none());
        }
        let overload = self.config.overload();
        let over = |c: &Candidate| c.metrics.waiting >= overload.queue_limit || c.metrics.kv_usage >= overload.kv_limit;
        // The cost policy prices each server's queue and KV pressure in time (the scraped
        // waiting count and KV usage are among its inputs) and does not also cut servers at
        // a limit: a scrape up to an interval old cut the servers that had just crossed it,
        // and the rest drew everything until they crossed it in turn (replay, 8 H100s: at
        // the Azure trace's 110% load the queued prefill drifted 2.4× apart between servers,
        // TTFT p95 5,907 ms, 5,101 without the cut; Mooncake at 130%, where KV usage
        // crosses 0.95, 18,762 → 10,848 ms; BENCHMARKS "The overload limits"). The limits
        // still decide when every server is past them.
        if cands.iter().all(|(_, c)| over(c)) {
            if req.sheddable {
                let outcome = Outcome::Shed {
                    retry_after_s: overload.retry_after_s,
                };
                return Decision {
                    endpoints: Vec::new(),
                    outcome,
                    matched_blocks: 0,
                    breakdown,
                    tier: None,
                    holder_first: false,
                };
            }
        } else if self.config.policy() != PolicyKind::Cost {
            for (row, _) in cands.iter().filter(|(_, c)| over(c)) {
                breakdown[*row].filtered = Some(FilterReason::Overloaded);
            }
            cands.retain(|(_, c)| !over(c));
        }

        let just_cands: Vec<Candidate> = cands.iter().map(|(_, c)| Candidate { ..*c }).collect();
        let ctx = ScoreContext {
            total_blocks: req.blocks.len(),
            fleet_backlog: policy::fleet_backlog(&self.config, &just_cands, self.mean_uncached, now),
            mean_uncached_tokens: self.mean_uncached,
            rotation: self.rotation,
            seed: self.config.seed(),
            now,
            rates: policy::rate_classes(&self.config, &just_cands, now),
            typical_pace: policy::typical_pace(&self.config, &just_cands, now),
            typical_step: None,
            fastest_step: None,
        };
        let ctx = policy::with_steps(&self.config, &just_cands, ctx);
        if let Some(outcome) = self.hold(&just_cands, &ctx) {
            return Decision {
                endpoints: Vec::new(),
                outcome,
                matched_blocks: 0,
                breakdown,
                tier: None,
                holder_first: false,
            };
        }
        let mut terms = policy::score(&self.config, &just_cands, &ctx);
        if self.config.policy() == PolicyKind::Cost {
            // A LoRA adapter not loaded on a server must be loaded before its prefill.
            let load_ms = self.config.cost().lora_load_ms;
            for (t, c) in terms.iter_mut().zip(&just_cands) {
                if c.endpoint.adapter_state(&req.model).is_some_and(|(loaded, _)| !loaded) {
                    t.prefill_ms += load_ms;
                    t.cost.0 += load_ms;
                    t.ttft_ms += load_ms;
                }
            }
        }
        let mut order: Vec<usize> = (0..cands.len()).collect();
        // Equal costs go to the longer prefix match, then (the sort is stable and candidates
        // are in id order) to the lower endpoint id.
        order.sort_by(|a, b| {
            terms[*a]
                .cost
                .total_cmp(&terms[*b].cost)
                .then(cands[*b].1.matched_blocks.cmp(&cands[*a].1.matched_blocks))
        });
        for (i, t) in terms.iter().enumerate() {
            let row = &mut breakdown[cands[i].0];
            (row.prefill_ms, row.decode_ms, row.kv_ms, row.cost, row.ttft_ms) =
                (t.prefill_ms, t.decode_ms, t.kv_ms, t.cost, t.ttft_ms);
        }
        if let Some(first) = req.blocks.first() {
            self.prefer_rendezvous_owner(*first, &mut order, &just_cands, &terms);
        }
        let holder_first = self.prefer_prefix_holder(req.blocks.len(), &mut order, &just_cands, &terms);
        let before_tiers = order[0];
        let tier = self.choose_tier(req, &mut order, &just_cands, &terms, now);
        let best = order[0];
        // Tiers may put another server first.
        let holder_first = holder_first && best == before_tiers;
        let matched_blocks = just_cands[best].matched_blocks;
        let endpoints = order
            .iter()
            .take(1 + self.config.fallbacks())
            .map(|i| just_cands[*i].endpoint.id.clone())
            .collect();
        let outcome = if matched_blocks > 0 {
            Outcome::PrefixHit
        } else {
            Outcome::Cold
        };
        Decision {
            endpoints,
            outcome,
            matched_blocks,
            breakdown,
            tier,
            holder_first,
        }
    }

    /// With `overload.hold` on and every candidate full: hold the request. A sheddable one
    /// is held too, at a fraction of the weight, and displaced first (`hold`): shedding it
    /// at once would refuse work a moment of fullness does not justify.
    fn hold(&self, cands: &[Candidate], ctx: &ScoreContext) -> Option<Outcome> {
        let overload = self.config.overload();
        let hold = &overload.hold;
        if hold.max_wait_ms == 0 {
            return None;
        }
        // Only what is current to the last first token: a stale scrape (KV usage, waiting)
        // would hold requests back from a server that has drained since, and release them
        // in bursts. A server that cannot admit more (KV full) shows as prefill that does
        // not finish.
        // Not on refusals (vLLM's 503) either: once a saturated fleet has refused requests
        // everywhere, every server would count as full for overload.refused_ms and every
        // request would wait that long (measured live).
        let full = |c: &Candidate| policy::pending_prefill_ms(&self.config, c, ctx) >= hold.wait_limit_ms as f64;
        if !cands.iter().all(full) {
            return None;
        }
        Some(Outcome::Hold)
    }

    fn filter(
        &self,
        e: &Endpoint,
        fresh: Option<&VllmMetrics>,
        req: &RouteRequest,
        model_known: bool,
        now: Millis,
    ) -> Option<FilterReason> {
        match e.envoy {
            EnvoyHealth::Excluded => return Some(FilterReason::ExcludedByEnvoy),
            EnvoyHealth::Draining => return Some(FilterReason::Draining),
            EnvoyHealth::Serve | EnvoyHealth::Degraded => {}
        }
        if e.health.state() == HealthState::Unhealthy {
            return Some(FilterReason::Unhealthy);
        }
        if e.health.is_ejected(now) {
            return Some(FilterReason::Ejected);
        }
        let Some(m) = fresh else {
            return Some(if e.metrics.is_some() {
                FilterReason::Stale
            } else {
                FilterReason::NoMetrics
            });
        };
        // Filter by model only when some endpoint lists it, and only servers that list
        // their models (without `/v1/models`, a name no metrics show may be an idle LoRA
        // adapter).
        if model_known && e.knows_models() && !e.lists_model(&req.model) {
            return Some(FilterReason::ModelNotServed);
        }
        let needed = req.prompt_tokens.0.saturating_add(req.max_tokens.unwrap_or(0));
        if m.capacity_tokens().is_some_and(|cap| needed > cap) {
            return Some(FilterReason::DoesNotFit);
        }
        None
    }

    /// For a prefix no endpoint holds, moves the rendezvous owner of its first block to the
    /// front when its cost is within `cold_tolerance` of the best, so independent workers
    /// and gateway replicas send the same cold prefix to the same place.
    fn prefer_rendezvous_owner(
        &self,
        first: BlockHash,
        order: &mut [usize],
        cands: &[Candidate],
        terms: &[policy::Terms],
    ) {
        let affinity_policy = matches!(self.config.policy(), PolicyKind::Cost | PolicyKind::Weighted);
        if !affinity_policy || cands.iter().any(|c| c.matched_blocks > 0) {
            return;
        }
        let near = near_best(order, terms, self.config.cost().cold_tolerance);
        let owner = (0..near).max_by_key(|pos| policy::rendezvous_weight(first, &cands[order[*pos]].endpoint.id));
        if let Some(pos) = owner {
            order[..=pos].rotate_right(1);
        }
    }

    /// With the cost policy: the candidate holding the most of the prompt goes first when it
    /// holds at least `cost.holder_min_share` of its blocks, more than the best-scored
    /// candidate, and costs at most `cost.holder_tolerance` more. The cost ranks a server
    /// deep into long prompts as busier than it is: it keeps each of this gateway's prompts
    /// there pending until its first token, less a credit for the one in prefill, and the
    /// holder of a long shared context is usually such a server (Mooncake trace at 50%: 49.9k
    /// tokens pending on average where 23.6k were left). Recomputing most of a long prompt
    /// elsewhere also spends capacity the fleet needs once it is loaded. On the Mooncake
    /// trace this took the captured share of reachable reuse from 95% / 92% to 97% / 97% at
    /// 50 / 80% load, with TTFT p95 the same there and 7% lower at 110%; a wider rule (any
    /// holder, or a half share) cost rag +5% to +31% (BENCHMARKS, "The holder of most of a
    /// prompt"). Returns whether it moved one.
    fn prefer_prefix_holder(
        &self,
        blocks: usize,
        order: &mut [usize],
        cands: &[Candidate],
        terms: &[policy::Terms],
    ) -> bool {
        let c = self.config.cost();
        if self.config.policy() != PolicyKind::Cost || c.holder_tolerance <= 0.0 || order.is_empty() {
            return false;
        }
        let need = c.holder_min_share * blocks as f64;
        let first = cands[order[0]].matched_blocks;
        let near = near_best(order, terms, c.holder_tolerance);
        // The most blocks, then the lower cost (`order` is sorted by cost).
        let holder = (0..near).max_by_key(|pos| (cands[order[*pos]].matched_blocks, std::cmp::Reverse(*pos)));
        if let Some(pos) = holder {
            let matched = cands[order[pos]].matched_blocks;
            if matched > first && f64::from(matched) >= need {
                order[..=pos].rotate_right(1);
                return true;
            }
        }
        false
    }

    /// Tiers (`tiers`): the servers of the cheapest tier whose best predicted TTFT meets the
    /// request's objective go first (the cheapest tier's when no tier's does: a request that
    /// misses everywhere does not spill), best first within it; the other tiers follow in
    /// score order as retries.
    fn choose_tier(
        &self,
        req: &RouteRequest,
        order: &mut [usize],
        cands: &[Candidate],
        terms: &[policy::Terms],
        now: Millis,
    ) -> Option<Tiering> {
        let tiers = self.config.tiers();
        if !tiers.on() {
            return None;
        }
        let objective = req.ttft_objective_ms.unwrap_or(tiers.ttft_objective_ms);
        let tier_of = |i: &usize| tiers.tier_of(&cands[*i].endpoint.id, cands[*i].endpoint.priority);
        let cheapest = order.iter().map(tier_of).min()?;
        // Predictions are scaled by how far off they have been on each server.
        let meets = |i: &&usize| terms[**i].ttft_ms * cands[**i].endpoint.ttft_bias.factor(now) <= objective;
        let meeting = order.iter().filter(meets).map(tier_of).min();
        let tier = meeting.unwrap_or(cheapest);
        order.sort_by_key(|i| tier_of(i) != tier);
        Some(Tiering {
            tier,
            spilled: tier != cheapest,
            met: meeting.is_some(),
        })
    }

    /// No endpoint has fresh metrics: order those that may serve by the gateway's own
    /// in-flight count (least-request), ties by id.
    fn fallback(&self, breakdown: Vec<EndpointScore>) -> Decision {
        let mut usable: Vec<&Endpoint> = self
            .table
            .rows()
            .iter()
            .zip(&breakdown)
            .filter(|(_, s)| matches!(s.filtered, Some(FilterReason::NoMetrics | FilterReason::Stale)))
            .map(|(e, _)| e)
            .collect();
        usable.sort_by_key(|e| e.inflight);
        let endpoints: Vec<EndpointId> = usable
            .iter()
            .take(1 + self.config.fallbacks())
            .map(|e| e.id.clone())
            .collect();
        let reason = if endpoints.is_empty() {
            FallbackReason::NoEndpoints
        } else {
            FallbackReason::NoMetrics
        };
        Decision {
            endpoints,
            outcome: Outcome::Fallback(reason),
            matched_blocks: 0,
            breakdown,
            tier: None,
            holder_first: false,
        }
    }
}

mod events;
mod peers;

/// How many candidates at the front of `order` (sorted by cost) cost at most `tolerance`
/// more than the first.
fn near_best(order: &[usize], terms: &[policy::Terms], tolerance: f64) -> usize {
    let best = terms[order[0]].cost.0;
    let limit = best + best.abs() * tolerance + 1e-9;
    order.iter().take_while(|i| terms[**i].cost.0 <= limit).count()
}

#[cfg(test)]
mod tests;

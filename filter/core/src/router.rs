//! The router: pure decisions over explicit state, changed only through named events.
//!
//! `route(&self, request, now)` reads the endpoint table and the prefix index and returns a
//! [`Decision`]; it changes nothing. What happened next is reported by the caller:
//! `on_routed` (the decision was used), `on_first_token` (its prefill is done),
//! `on_completed` (the response ended, however),
//! `on_metrics` / `on_scrape_failed` (a scrape result), `on_endpoints` (membership).
//! The filter, the simulator's replay and its live mode all drive the same events.

use crate::config::Config;
use crate::decision::{Decision, EndpointScore, FallbackReason, FilterReason, Outcome};
use crate::endpoint::{Endpoint, EndpointTable};
use crate::hashing::PrefixHasher;
use crate::index::PrefixIndex;
use crate::peer::PeerEvent;
use crate::policy::{self, Candidate, ScoreContext};
use crate::request::{ParsedRequest, BYTES_PER_TOKEN};
use crate::types::{BlockHash, EndpointId, Millis, Tokens};
use inflight::InflightTable;

/// Requests tracked in flight at most; the oldest is released past it (lost completions
/// must not leak memory or pin load on an endpoint forever).
pub const MAX_INFLIGHT: usize = 65_536;

/// The records of requests in flight hold their prompts' block hashes in at most
/// `index.max_memory_bytes / INFLIGHT_BUDGET_DIVISOR` bytes per router, that is per worker
/// VM (each holds every request of its process when they share, so a process holds the
/// workers' count times this): the default's 256 MiB allow 8M blocks, 16,384 prompts of
/// the longest `max_blocks` (512). Without the bound, 65,536 such prompts held 256 MiB per
/// worker besides the index, and a larger `max_blocks` more than a wasm VM can address. The
/// configured budget, not a worker's split of it: split, 16 workers would release live
/// requests from about a thousand long prompts in flight.
pub const INFLIGHT_BUDGET_DIVISOR: usize = 4;

pub use homes::MAX_HOMES;

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
    /// Its first token will be reported when it comes (a stream). A whole response's comes
    /// with its last token, so its wait says nothing of the server's TTFT: tiers learn
    /// neither their scaling nor their floor from it.
    pub first_token_timed: bool,
    /// The stored response this request continues (`request::response_key` of its
    /// `previous_response_id`): only the server that stored it can answer.
    pub continues: Option<u64>,
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
    /// The client went away before any response (no status at all, not even the proxy's
    /// own): a client timeout or hang-up says nothing of the server's health. A busy server
    /// whose clients give up under overload must not be ejected for it.
    pub client_left: bool,
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
    /// Requests released before their completion to keep the records within bounds
    /// (`MAX_INFLIGHT`, `INFLIGHT_BUDGET_DIVISOR`): their load no longer counts.
    pub released_unfinished: u64,
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
    inflight: InflightTable,
    rotation: u64,
    mean_uncached: f64,
    stats: RouterStats,
    /// This router's number among the peers it shares with (0 when it shares with none).
    origin: u32,
    /// Changes not yet handed to peers; `None` when this router shares with none.
    outbox: Option<Vec<PeerEvent>>,
    /// Peers' requests whose completion arrived before their placement (bounded).
    early_completions: RecentKeys,
    /// The servers that stored responses (`homes`).
    homes: homes::Homes,
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
            inflight: InflightTable::default(),
            rotation: 0,
            mean_uncached,
            stats: RouterStats::default(),
            origin: 0,
            outbox: None,
            early_completions: RecentKeys::default(),
            homes: homes::Homes::default(),
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

    /// Requests in flight as this router sees them: its own and its peers'.
    pub fn inflight_requests(&self) -> usize {
        self.inflight.len()
    }

    /// This router's own requests in flight (summed over a process's workers, each request
    /// counts once; a peer's copy would count it once per worker, late by the exchange).
    pub fn own_inflight_requests(&self) -> usize {
        let origin = self.origin;
        self.inflight
            .keys()
            .filter(|k| crate::peer::origin_of(**k) == origin)
            .count()
    }

    /// Hashes a parsed body into a routing request for `tenant`. A continuation of a stored
    /// response has no blocks: its prompt starts with the stored history, which the body
    /// does not carry, so its own text would record prefixes no server holds.
    pub fn request(&self, parsed: &ParsedRequest, tenant: &str, sheddable: bool) -> RouteRequest {
        let salt = parsed.cache_salt.as_deref().unwrap_or("");
        let continues = parsed.continues.as_deref().map(crate::request::response_key);
        RouteRequest {
            model: parsed.model.clone(),
            blocks: match continues {
                Some(_) => Vec::new(),
                None => self.hasher.hash(&parsed.model, tenant, salt, &parsed.canonical),
            },
            prompt_tokens: parsed.prompt_tokens,
            max_tokens: parsed.max_tokens,
            sheddable,
            ttft_objective_ms: None,
            first_token_timed: parsed.stream,
            continues,
        }
    }

    /// The server that stored response `response` (a `request::response_key`), while it is
    /// in the pool.
    pub fn home_of(&self, response: u64) -> Option<&EndpointId> {
        let home = self.homes.get(response)?;
        self.table.rows().iter().any(|e| &e.id == home).then_some(home)
    }

    /// Stored responses whose home this router remembers.
    pub fn homes_known(&self) -> usize {
        self.homes.len()
    }

    fn tokens_per_block(&self) -> u64 {
        (self.config.hashing().block_bytes as u64 / BYTES_PER_TOKEN).max(1)
    }

    /// The endpoints that may serve `req`, as bits (an endpoint's slot modulo 64): those that
    /// list its model, or every endpoint when none does (an empty name, a name no server
    /// lists, an adapter not loaded yet) or when some endpoint does not say what it serves.
    /// Held requests wait behind those that may use the same servers (the filter's hold
    /// board); no endpoint known: every bit.
    pub fn serving_mask(&self, req: &RouteRequest) -> u64 {
        let rows = self.table.rows();
        let bit = |e: &crate::endpoint::Endpoint| 1u64 << (usize::from(e.slot) % 64);
        let all = rows.iter().map(bit).fold(0, |a, b| a | b);
        let listing = rows
            .iter()
            .filter(|e| e.lists_model(&req.model))
            .map(bit)
            .fold(0, |a, b| a | b);
        match all {
            0 => u64::MAX,
            _ if req.model.is_empty() || listing == 0 || rows.iter().any(|e| !e.knows_models()) => all,
            _ => listing,
        }
    }

    /// Picks endpoints for `req`. Pure: the same state, request and `now` give the same decision.
    ///
    /// A continuation of a stored response goes to the server that stored it, whatever its
    /// load or health: every other server would answer 404. Unknown homes (forgotten, or
    /// stored before this router started) are routed like any request.
    pub fn route(&self, req: &RouteRequest, now: Millis) -> Decision {
        if let Some(home) = req.continues.and_then(|r| self.home_of(r)) {
            return Decision {
                endpoints: vec![home.clone()],
                ..Decision::without_endpoints(Outcome::ResponseHome, Vec::new())
            };
        }
        let rows = self.table.rows();
        let model_known = rows.iter().any(|e| e.lists_model(&req.model));
        // A body without `model` (the empty name) is served by each server's first model, as
        // vLLM does: no server is filtered by it.
        if !model_known && !req.model.is_empty() && rows.iter().any(|e| e.models.is_some()) {
            // Servers list their models and none lists this one: a typo or a model this pool
            // does not serve. Envoy balances it and the server answers (vLLM: 404).
            return Decision::without_endpoints(Outcome::Fallback(FallbackReason::UnknownModel), Vec::new());
        }
        let (mut breakdown, mut cands) = self.candidates(req, model_known, now);
        if cands.is_empty() {
            return self.fallback(breakdown);
        }
        candidates::demote(req, &mut cands, &mut breakdown, now);
        if let Some(outcome) = self.cut_overloaded(req, &mut cands, &mut breakdown) {
            return Decision::without_endpoints(outcome, breakdown);
        }
        let rows_of: Vec<usize> = cands.iter().map(|(row, _)| *row).collect();
        let cands: Vec<Candidate> = cands.into_iter().map(|(_, c)| c).collect();
        let ctx = self.context(req, &cands, now);
        if let Some(outcome) = self.hold(&cands, &ctx) {
            return Decision::without_endpoints(outcome, breakdown);
        }
        let terms = self.terms(req, &cands, &ctx);
        for (t, row) in terms.iter().zip(&rows_of) {
            let row = &mut breakdown[*row];
            (row.prefill_ms, row.decode_ms, row.kv_ms, row.cost, row.ttft_ms) =
                (t.prefill_ms, t.decode_ms, t.kv_ms, t.cost, t.ttft_ms);
        }
        let (order, tier, holder_first) = self.order(req, &cands, &terms, &ctx);
        let matched_blocks = cands[order[0]].matched_blocks;
        let endpoints = order
            .iter()
            .take(1 + self.config.fallbacks())
            .map(|i| cands[*i].endpoint.id.clone())
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
        // Nor when this router's own oldest stream there still without a first token has
        // waited past its own prefill by the limit: a server that stopped admitting (KV
        // cache or sequence slots full) shows it there while its predicted prefill reads as
        // drained. (Its whole wait would count a long prompt's own prefill as a stall.)
        let limit = hold.wait_limit_ms as f64;
        let full = |c: &Candidate| {
            policy::pending_prefill_ms(&self.config, c, ctx) >= limit || stalled_ms(&self.config, c, ctx) >= limit
        };
        if !cands.iter().all(full) {
            return None;
        }
        Some(Outcome::Hold)
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
            ..Decision::without_endpoints(Outcome::Fallback(reason), breakdown)
        }
    }
}

mod candidates;
mod events;
mod homes;
mod inflight;
mod order;
mod peers;
mod storage;

/// How long this router's oldest stream at `c` still without a first token has waited past
/// the time its own prefill takes there (0 when none waits).
fn stalled_ms(config: &Config, c: &Candidate, ctx: &ScoreContext) -> f64 {
    let e = c.endpoint;
    let Some(oldest) = e.oldest_timed() else {
        return 0.0;
    };
    let own = e
        .prefilling
        .get(&oldest)
        .map_or(0.0, |p| policy::prefill_ms(config, c, ctx, p.uncached));
    (ctx.now.since(oldest.0) as f64 - own).max(0.0)
}

#[cfg(test)]
mod tests;

//! Scoring policies. Every policy maps a candidate to a [`Cost`] where lower wins, so one
//! selection routine (in `router`) serves them all.
//!
//! - `cost` (default): predicted time to first token in ms, in the spirit of NVIDIA Dynamo's
//!   KV router (prefill blocks − overlap + decode load) but in one physical unit:
//!   `prefill = (queued prefill tokens + (1 + work_weight × (1 + backlog)) × this
//!   request's uncached tokens) / prefill rate`, where `backlog` is the number of requests
//!   queued at the least-loaded candidate (`fleet_backlog`),
//!   `decode = running sequences × per-sequence step cost`, plus a KV-pressure term that
//!   grows quadratically past `kv_pressure_threshold` (sooner and steeper on a fleet of
//!   unlike GPUs, `kv_pressure_unlike_*`: the faster ones draw more work into caches no
//!   larger than the slower ones'). Queued prefill tokens are the
//!   larger of two lower bounds: the scraped waiting requests times the gateway's running
//!   mean of uncached tokens per request plus the uncached tokens sent since the scrape, and
//!   the uncached tokens of this gateway's requests there that have no first token yet
//!   (prefills already running are invisible in vLLM's metrics), less part of the progress
//!   the oldest of them made since it could start (`Endpoint::prefill_left`). The `work_weight` share
//!   charges the prefill this request adds to the fleet, which delays the requests after
//!   it: without it a greedy TTFT estimate sees no difference between joining a sibling
//!   that is still prefilling the same prefix and recomputing that prefix elsewhere. The
//!   backlog factor makes that charge grow when no endpoint is free: then every recomputed
//!   token delays the requests already queued and those still arriving, so a cached prefix
//!   is worth more than a slightly shorter queue (0 when any candidate has no queued
//!   request, so an under-loaded fleet is scored as before). The prefill also delays the
//!   requests waiting there for their first token, which vLLM runs in the same steps:
//!   `pending_weight × min(waiting, 2) × min(this request's uncached tokens,
//!   max_num_batched_tokens) / prefill rate` more, so a long cold prompt keeps away from a
//!   server where short ones are about to start (a waiting request shares one step's
//!   tokens of it at most).
//! - `weighted`: the Gateway API Inference Extension's shape: queue (min-max normalised),
//!   KV (1 − usage) and prefix (matched fraction) scorers in [0, 1], weighted 2/2/3.
//! - `least_request`, `round_robin`, `random` (seeded): the classic baselines.

use crate::config::{Config, PolicyKind};
use crate::endpoint::Endpoint;
use crate::metrics::VllmMetrics;
use crate::speed::{PrefillPace, PACE_SAME_WITHIN, SAME_WITHIN};
use crate::types::{BlockHash, Cost, EndpointId, Millis, Tokens};

mod classes;
mod weights;
pub use classes::RateClasses;
pub use weights::{speed_weight, typical_weight, weights_in_use};

/// A candidate endpoint that passed the hard filters.
pub struct Candidate<'a> {
    pub endpoint: &'a Endpoint,
    pub metrics: &'a VllmMetrics,
    pub matched_blocks: u32,
    pub uncached: Tokens,
}

impl Candidate<'_> {
    /// Waiting requests as the scrape saw them plus those sent since.
    fn queued_requests(&self) -> f64 {
        self.metrics.waiting as f64 + f64::from(self.endpoint.sent_since_scrape)
    }
}

/// Per-request facts a policy may use beyond the candidate itself.
pub struct ScoreContext {
    pub total_blocks: usize,
    /// Requests queued at the least-loaded candidate: how overloaded the whole fleet is
    /// (`fleet_backlog`).
    pub fleet_backlog: f64,
    /// The candidates are scored at rates at least `UNLIKE` times apart (`unlike_rates`).
    pub unlike: bool,
    pub mean_uncached_tokens: f64,
    pub rotation: u64,
    pub seed: u64,
    pub now: Millis,
    /// The candidates' learned prefill rates in classes of like servers (`RateClasses`).
    pub rates: RateClasses,
    /// The candidates' median prefill pace (`typical_pace`), if any has one.
    pub typical_pace: Option<f64>,
    /// The prefill rate a unit of pace stands for (`rate_per_pace`), once a candidate has
    /// both.
    pub rate_per_pace: Option<f64>,
    /// The median step time of the candidates at the typical rate, and the shortest step
    /// time charged to any candidate (`with_steps`, `server_step`).
    pub typical_step: Option<f64>,
    pub fastest_step: Option<f64>,
    /// The weight of a typical server, when the candidates' speed weights differ
    /// (`typical_weight`).
    pub typical_weight: Option<f64>,
}

/// A policy's score split into its terms (all zero but `cost` for non-`cost` policies).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Terms {
    pub prefill_ms: f64,
    pub decode_ms: f64,
    pub kv_ms: f64,
    pub cost: Cost,
    /// `cost` only: the predicted time to first token itself, in ms. `cost` counts the
    /// request's own prefill more than once (`cost.work_weight`) to rank servers; absolute
    /// comparisons (tiers' objectives) use this.
    pub ttft_ms: f64,
}

/// Scores `cands` (sorted by endpoint id) under the configured policy.
pub fn score(config: &Config, cands: &[Candidate], ctx: &ScoreContext) -> Vec<Terms> {
    match config.policy() {
        PolicyKind::Cost => cands.iter().map(|c| predicted_ttft(config, c, ctx)).collect(),
        PolicyKind::Weighted => weighted(config, cands, ctx),
        PolicyKind::LeastRequest => cands
            .iter()
            .map(|c| only(c.metrics.running as f64 + c.queued_requests()))
            .collect(),
        PolicyKind::RoundRobin => {
            let n = cands.len().max(1) as u64;
            (0..cands.len() as u64)
                .map(|i| only(((i + n - ctx.rotation % n) % n) as f64))
                .collect()
        }
        PolicyKind::Random => cands
            .iter()
            .map(|c| only(mix(ctx.seed ^ mix(ctx.rotation) ^ str_hash(c.endpoint.id.as_str())) as f64))
            .collect(),
    }
}

fn only(cost: f64) -> Terms {
    Terms {
        cost: Cost(cost),
        ..Terms::default()
    }
}

/// At most this many of a server's requests still waiting for a first token are counted
/// as delayed by a new prompt (`cost.pending_weight`): vLLM schedules waiting prompts first
/// come, first served, so a new prompt shares its steps with the last ones in the queue,
/// while those deeper in it are done before it starts. On the replay, counting all of them
/// cost rag at 110 / 130% load 3-5% of TTFT p95, where every server has a queue; 1 lost
/// rag 80%'s gain (BENCHMARKS, "A prompt's delay to the requests it joins").
const PENDING_JOINED: usize = 2;

/// Predicted TTFT in ms. Non-decreasing in waiting, running, KV usage and sent load.
pub fn predicted_ttft(config: &Config, c: &Candidate, ctx: &ScoreContext) -> Terms {
    let p = config.cost();
    // Two lower bounds of the prefill queued ahead: what the scrape saw waiting (all
    // gateways' traffic) plus what this gateway sent since, and this gateway's own requests
    // there still without a first token (which also covers prefills already running).
    let scraped = c.metrics.waiting as f64 * ctx.mean_uncached_tokens + c.endpoint.sent_tokens_since_scrape.0 as f64;
    let queued_tokens = scraped.max(
        c.endpoint
            .prefill_left(ctx.now, p.progress_credit, p.attention_tokens)
            .0 as f64,
    );
    let own = (1.0 + p.work_weight * (1.0 + ctx.fleet_backlog)) * c.uncached.0 as f64;
    // This server's own speed where it is known (`speed`); a slower server's decode steps
    // are slower in the same proportion.
    let rate = server_rate(config, c, ctx);
    let prefill_ms = (queued_tokens + own) * 1000.0 / rate;
    let running = c.metrics.running as f64 + f64::from(c.endpoint.sent_since_scrape);
    let decode_ms = running * p.decode_ms_per_running * p.prefill_tokens_per_s / rate;
    let decode_ms = decode_ms + p.first_token_steps * server_step(config, c, ctx);
    // A faster GPU draws more of the work than a slower one but holds no more of it in its
    // KV cache: on a fleet of unlike GPUs the pressure starts sooner and weighs more.
    let (threshold, full_ms) = if ctx.unlike {
        (p.kv_pressure_unlike_threshold, p.kv_pressure_unlike_ms)
    } else {
        (p.kv_pressure_threshold, p.kv_pressure_ms)
    };
    let over = ((c.metrics.kv_usage - threshold) / (1.0 - threshold)).max(0.0);
    let kv_ms = full_ms * over * over;
    // Where requests wait for a sequence slot, the queue moves as running ones finish,
    // however little prefill it holds: the admission wait counts as far as it exceeds the
    // queued prefill's time. Only in untiered routing, and while some candidate has nothing
    // queued (`admission_ms`).
    let queued_ms = queued_tokens * 1000.0 / rate;
    let admit_ms = if !config.tiers().on() && ctx.fleet_backlog < ADMISSION_BACKLOG {
        (p.admission_weight * admission_ms(c) - queued_ms).max(0.0)
    } else {
        0.0
    };
    let prefill_ms = prefill_ms + admit_ms;
    let ttft_ms = queued_ms + admit_ms + c.uncached.0 as f64 * 1000.0 / rate + decode_ms + kv_ms;
    // Phase-aware (`cost.phase_weight`): the decode stall this prefill causes there. It
    // ranks servers and is kept out of the predicted TTFT; the breakdown shows it in
    // `decode_ms`.
    let stall_ms = p.phase_weight * running * c.uncached.0 as f64 * 1000.0 / rate;
    // The requests waiting there for a first token run in the same steps as this prefill,
    // and each of those steps grows by its tokens (`cost.pending_weight`): by one step's
    // budget at most, since a waiting request's tokens are scheduled before the new
    // prompt's and its first token comes with the step that finishes them.
    let joined = c.endpoint.prefilling.len().min(PENDING_JOINED) as f64;
    let shared = c.uncached.0.min(p.max_num_batched_tokens) as f64;
    let prefill_ms = prefill_ms + p.pending_weight * joined * shared * 1000.0 / rate;
    Terms {
        prefill_ms,
        decode_ms: decode_ms + stall_ms,
        kv_ms,
        cost: Cost(prefill_ms + decode_ms + stall_ms + kv_ms),
        ttft_ms,
    }
}

/// How long a new request waits at `c` for admission: where its sequence slots are all
/// taken (`speed::Completions::pinned`), vLLM admits its waiting requests in order as
/// running ones finish, so with `waiting` in the scrape plus what this router sent since,
/// the new one is admitted after one more completion than that, at the server's recent
/// completion rate. 0 where it is not slot-bound or the rate is unknown. The rest of the
/// cost prices the queued prefill in tokens and the KV pressure in usage; neither sees a
/// server whose slots all hold long decodes, where a prompt of a few hundred tokens waits
/// seconds for a slot (replay, chat at 100 req/s on 4 A100 + 4 H100: the A100s' 256 slots
/// full, their TTFT median 0.6–0.9 s against the H100s' 50 ms).
///
/// There untiered attainment of a 500 ms objective went 81.8 → 96.7% (steady state, seeds
/// 3–5). On a fleet of like servers the same: 8 A100s at chat 60 req/s (slot-bound, not
/// overloaded), steady TTFT p95 635 → 71 ms, where round-robin reads 63. The cost charges
/// it only without tiers, whose sequence slots (`tiers.max_num_seqs`) already keep a full
/// server from meeting the objective (with tiers it cost attainment: rag at 40 req/s on 4
/// A100 + 3 H100, two seeds of six 97.5 / 95.7 → 91.9 / 90.1%), and not where every
/// candidate has requests queued (`ADMISSION_BACKLOG`). Until that gate it was charged only
/// on unlike fleets or beside a server running twice as many: on like ones it ranked
/// servers, all slot-bound at overload, by the noise of their completion rates (4 H100s,
/// shared-prefix at 110% with holding: TTFT p99 +55%; 5 H100s, chat at 100 req/s:
/// attainment 45 → 32%). With the gate those cells read p99 3,081 → 3,017 ms and p95
/// 17.5 → 12.9 s (BENCHMARKS.md, "The admission wait on every fleet").
pub fn admission_ms(c: &Candidate) -> f64 {
    if c.metrics.waiting == 0 || !c.endpoint.completions.pinned() {
        return 0.0;
    }
    let Some(per_s) = c.endpoint.completions.per_s() else {
        return 0.0;
    };
    let ahead = c.metrics.waiting as f64 + f64::from(c.endpoint.sent_since_scrape);
    (ahead + 1.0) * 1000.0 / per_s
}

/// The admission wait is charged only while the least-loaded candidate has fewer requests
/// queued than this (`ScoreContext::fleet_backlog`): a server with room to take the request
/// at once. Where every server has a queue the fleet is past what it serves; charging the
/// slot-bound servers their wait then moved their share onto the others, whose KV caches
/// filled (replay, chat at 100 req/s on 4 A100 + 3 H100 with holding, steady state, seeds
/// 3–5: TTFT p99 17.6 s not charged, 30.4 s charged there too, 17.0 s with this gate; a
/// 500 ms objective met 44.4 / 43.1 / 56.9%).
pub const ADMISSION_BACKLOG: f64 = 0.5;

/// How many requests queue at the least-loaded candidate: how overloaded the whole fleet
/// is (`ScoreContext::fleet_backlog`). A candidate's queue is the larger of its scraped
/// waiting requests and the prefill this gateway knows is pending there (less the progress
/// credited to the prompt in prefill, `Endpoint::prefill_left`), counted in
/// requests of `mean_uncached_tokens` less the one being prefilled. vLLM's waiting count
/// alone misses most of it: chunked prefill admits requests to the running batch long
/// before their prefill starts, so a fleet of long prompts can be seconds of prefill behind
/// with nothing waiting (replay, Mooncake trace at 110% load: the waiting count read 0 in
/// 96% of decisions, this count in 75%, and the hit rate went from 19.7% to 25.3%).
pub fn fleet_backlog<'a>(
    config: &Config,
    cands: impl IntoIterator<Item = &'a Candidate<'a>>,
    mean_uncached_tokens: f64,
    now: Millis,
) -> f64 {
    let per_request = mean_uncached_tokens.max(1.0);
    let p = config.cost();
    cands
        .into_iter()
        .map(|c| {
            let pending =
                c.endpoint.prefill_left(now, p.progress_credit, p.attention_tokens).0 as f64 / per_request - 1.0;
            (c.metrics.waiting as f64).max(pending).max(0.0)
        })
        .fold(f64::INFINITY, f64::min)
        .min(1e6)
}

/// How long the prefill this gateway knows is queued or running at a candidate (its own
/// requests there without a first token, and its peers', less the progress credited to
/// the one in prefill: `Endpoint::prefill_left`) takes at the server's rate (ms). Unlike
/// the scraped queue it is current to the last first token, so a server it calls busy is
/// busy now: holding requests back while every server is past a limit of it cannot leave
/// one idle (`overload.hold`). It is the cost's own estimate: with the plain pending count
/// here, a request released from the hold went where the cost (which credits progress)
/// saw room and the hold did not, and more of them timed out (replay, shared-prefix at 110%
/// with holding: 2,234 429s and 138.5 req/s goodput, against 998 and 161.5).
pub fn pending_prefill_ms(config: &Config, c: &Candidate, ctx: &ScoreContext) -> f64 {
    let p = config.cost();
    let left = c.endpoint.prefill_left(ctx.now, p.progress_credit, p.attention_tokens);
    prefill_ms(config, c, ctx, left)
}

/// How far apart the fastest and the slowest rate a fleet of unlike GPUs is scored at
/// (`unlike_rates`).
pub const UNLIKE: f64 = 2.0;

/// Whether at least two candidates are scored at `UNLIKE` times slower than the fastest, or
/// slower still (`server_rate`: learned, from first tokens' pace or from speed weights):
/// GPUs of different generations (an H100 prefills about 3.4× as fast as an A100). Like
/// servers are usually scored at one class rate; one that falls far behind (slowed, or
/// stalled at overload) is a straggler the cost already routes around by its rate, not a
/// class of slower GPUs beside which the faster ones fill their KV caches (replay, shared-
/// prefix at 130% with holding on 4 H100s: counting one such server, TTFT p99 11.6 →
/// 13.8 s; counting two, 12.1 s).
pub fn unlike_rates(config: &Config, cands: &[Candidate], ctx: &ScoreContext) -> bool {
    // Two passes rather than a list: this runs on every request.
    let rate = |c: &Candidate| server_rate(config, c, ctx);
    let hi = cands.iter().map(rate).fold(0.0, f64::max);
    cands.iter().filter(|c| hi >= UNLIKE * rate(c)).count() >= 2
}

/// The ms `tokens` of prefill take at `c`'s rate.
pub fn prefill_ms(config: &Config, c: &Candidate, ctx: &ScoreContext, tokens: Tokens) -> f64 {
    tokens.0 as f64 * 1000.0 / server_rate(config, c, ctx)
}

/// The candidates' learned prefill rates (none when learning is off or no rate is
/// established), in classes of like servers (`RateClasses`).
pub fn rate_classes(config: &Config, cands: &[Candidate], now: Millis) -> RateClasses {
    if !config.cost().learn_speeds {
        return RateClasses::default();
    }
    RateClasses::new(cands.iter().filter_map(|c| c.endpoint.speed.learned(now)).collect())
}

/// The median of the candidates' prefill paces (`speed::PrefillPace`), if any has one. It
/// is every candidate's, not the typical class's: against the typical class's median pace,
/// the mixed fleet's Azure 110% read TTFT p95 +8.7% (replay, 3 replicas, every replica
/// worse).
pub fn typical_pace(config: &Config, cands: &[Candidate], now: Millis) -> Option<f64> {
    median_of(config, cands, |c| c.endpoint.pace.per_ms(now))
}

/// The prefill rate (tokens/s) a unit of pace (tokens/ms) stands for: the (upper) median,
/// over the candidates with both a learned rate and a pace, of the class rate they are
/// scored at over their pace. A server known only by its pace is scored at its pace times
/// this. Scaling the typical rate by the pace against the median pace instead mixed two
/// populations: vLLM's sums give a rate only when requests finish, so the servers with a
/// learned rate are the fast ones first, while the median pace is every candidate's. On 4
/// A100s and 3 H100s that median is an A100's: the A100s were scored at the H100s' 42k
/// tokens/s, 3.3 times their own, for their first 22 s (replay, rag at 40 req/s).
pub fn rate_per_pace(config: &Config, cands: &[Candidate], rates: &RateClasses, now: Millis) -> Option<f64> {
    median_of(config, cands, |c| {
        let learned = c.endpoint.speed.learned(now)?;
        Some(rates.class_of(learned) / c.endpoint.pace.per_ms(now)?)
    })
}

/// `ctx` with its step times filled in (`typical_step`, `fastest_step`; see `server_step`).
pub fn with_steps(config: &Config, cands: &[Candidate], ctx: ScoreContext) -> ScoreContext {
    if config.cost().first_token_steps == 0.0 {
        return ctx;
    }
    let ctx = ScoreContext {
        typical_step: typical_step(config, cands, &ctx),
        ..ctx
    };
    ScoreContext {
        fastest_step: cands
            .iter()
            .filter_map(|c| charged_step(config, c, &ctx))
            .reduce(f64::min),
        ..ctx
    }
}

/// The median step time (`speed::StepTime`) of the candidates scored at the typical
/// prefill rate.
fn typical_step(config: &Config, cands: &[Candidate], ctx: &ScoreContext) -> Option<f64> {
    median_of(config, cands, |c| {
        is_typical(config, c, ctx)
            .then(|| c.endpoint.step.ms(ctx.now))
            .flatten()
    })
}

/// Whether `server_rate` scores the candidate at the typical rate (it returns that very
/// value then, so the comparison is exact).
fn is_typical(config: &Config, c: &Candidate, ctx: &ScoreContext) -> bool {
    server_rate(config, c, ctx) == ctx.rates.typical().unwrap_or(config.cost().prefill_tokens_per_s)
}

/// The steps a request waits for beyond its prefill (`cost.first_token_steps` of them) on
/// this candidate, past those of the fastest candidate, in ms. A short prompt's first token
/// costs the step in progress and then its own step more than its prefill, and an A100's
/// steps take about 1.7× an H100's (the same weights read from slower memory): on a mixed
/// fleet at 80% load, multi-turn's turns took 30–37 ms to a first token on the A100s and 14
/// on the H100s, which the prefill rate alone did not show. Only a server already scored at
/// its own prefill rate (an unlike GPU, a server that slowed down) is charged its own step
/// time, and only beyond `speed::SAME_WITHIN` of the typical servers' median; the others
/// are charged that median. Among like servers a busier batch already shows in the queue
/// terms, and charging its longer steps too cost 8 identical H100s up to +10% TTFT p95
/// (replay; BENCHMARKS, "Steady state apart from cold start"). Only the excess over the
/// fastest candidate counts, so like servers score as without it.
fn server_step(config: &Config, c: &Candidate, ctx: &ScoreContext) -> f64 {
    match (charged_step(config, c, ctx), ctx.fastest_step) {
        (Some(step), Some(fastest)) => (step - fastest).max(0.0),
        _ => 0.0,
    }
}

fn charged_step(config: &Config, c: &Candidate, ctx: &ScoreContext) -> Option<f64> {
    let typical = ctx.typical_step?;
    Some(match c.endpoint.step.ms(ctx.now) {
        Some(own) if !is_typical(config, c, ctx) && (own / typical).max(typical / own) > SAME_WITHIN => own,
        _ => typical,
    })
}

/// The (upper) median of what `value` says of the candidates that have one; none when
/// learning is off.
fn median_of(config: &Config, cands: &[Candidate], value: impl Fn(&Candidate) -> Option<f64>) -> Option<f64> {
    if !config.cost().learn_speeds {
        return None;
    }
    let mut values: Vec<f64> = cands.iter().filter_map(value).collect();
    values.sort_by(f64::total_cmp);
    values.get(values.len() / 2).copied()
}

/// The prefill rate a candidate is scored with: its class's rate (`RateClasses`) when that
/// differs from the fleet's typical rate by more than `speed::SAME_WITHIN`, else the typical
/// rate (identical servers stay identical). A server with no learned rate yet is placed by
/// its prefill pace (`speed::PrefillPace`), at the rate a unit of pace stands for on the
/// servers whose rate is learned (`rate_per_pace`; against the candidates' median pace,
/// `typical_pace`, until one has both): vLLM adds a request's prefill time to its metrics
/// only when the request finishes, which at long outputs takes many seconds, while the
/// first tokens the pace counts come right after the prefill. For the same reason a server
/// that slowed down (throttling, a noisy neighbour) is scored by its
/// pace while its learned rate still says otherwise. Paces include waits behind decode
/// steps and spread more, so only one beyond `speed::PACE_SAME_WITHIN` of the median (and,
/// against a learned rate, below it by that much) counts, and only once
/// `PrefillPace::PLACE_SAMPLES` prompts made it, or sooner if even its fastest sample
/// (`PrefillPace::best_per_ms`) is that far below the median pace: a slower GPU is then
/// known from its first three prompts. Waiting for eight sent a new conversation to the
/// A100s of a mixed fleet in the first 6 s of a cold start, where it stayed for every
/// later turn (replay, 4 H100 + 4 A100, multi-turn at 80%: steady-state TTFT p95 30.8 →
/// 20.3 ms, the oracle 18.2); identical fleets never pass that test (8 H100s and 2
/// gateways × 8 workers: every cell unchanged). With neither a learned rate nor a placed
/// pace, a server whose speed weight differs from the typical servers' is scored at the
/// typical rate scaled by it (`weights`: a fleet that starts cold). The configured rate
/// stands in for the typical rate while none is learned, and is used alone when learning
/// is off.
pub(crate) fn server_rate(config: &Config, c: &Candidate, ctx: &ScoreContext) -> f64 {
    let prior = config.cost().prefill_tokens_per_s;
    if !config.cost().learn_speeds {
        return prior;
    }
    let typical = ctx.rates.typical().unwrap_or(prior);
    let by_pace = || {
        let (pace, typical_pace) = (c.endpoint.pace.per_ms(ctx.now)?, ctx.typical_pace?);
        let placed = c.endpoint.pace.samples() >= PrefillPace::PLACE_SAMPLES
            || c.endpoint.pace.best_per_ms(ctx.now)? * PACE_SAME_WITHIN < typical_pace;
        let scale = ctx.rate_per_pace.unwrap_or(typical / typical_pace);
        placed.then_some((pace * scale, PACE_SAME_WITHIN))
    };
    // vLLM's sums lag a slowdown by a request's whole life; the pace follows it within a
    // few first tokens, so a pace slower than the learned rate by more than its band wins.
    // Not the other way: identical servers' paces read faster than their rates often
    // enough to break their tie (replay, 8 H100s, Azure 80%: TTFT p95 +8.9%).
    let own = match (c.endpoint.speed.learned(ctx.now), by_pace()) {
        (Some(learned), Some((paced, within))) if learned / paced > within => Some((paced, within)),
        (Some(learned), _) => Some((ctx.rates.class_of(learned), SAME_WITHIN)),
        (None, paced) => paced.or_else(|| weights::prior_rate(config, c, ctx.typical_weight, typical)),
    };
    match own {
        Some((own, within)) if (own / typical).max(typical / own) > within => own,
        Some(_) => typical,
        // Nothing known of it yet (a server that just joined): scored as the fastest
        // class until its first tokens place its pace. At the typical rate, a new H100
        // beside 4 A100s and 3 H100s read as an A100, drew no prompt and so never showed
        // its speed (replay, long-chat's conversations opened at under half its pace, 80%
        // load: nothing for the rest of the run after joining at 150 s).
        None => ctx.rates.fastest().unwrap_or(typical),
    }
}

fn weighted(config: &Config, cands: &[Candidate], ctx: &ScoreContext) -> Vec<Terms> {
    let w = config.weighted();
    let queues: Vec<f64> = cands.iter().map(Candidate::queued_requests).collect();
    let (lo, hi) = queues
        .iter()
        .fold((f64::MAX, f64::MIN), |(lo, hi), q| (lo.min(*q), hi.max(*q)));
    cands
        .iter()
        .zip(&queues)
        .map(|(c, q)| {
            let queue = if hi > lo { (hi - q) / (hi - lo) } else { 1.0 };
            let kv = 1.0 - c.metrics.kv_usage.clamp(0.0, 1.0);
            let prefix = if ctx.total_blocks == 0 {
                0.0
            } else {
                f64::from(c.matched_blocks) / ctx.total_blocks as f64
            };
            only(-(w.queue * queue + w.kv * kv + w.prefix * prefix))
        })
        .collect()
}

/// Rendezvous (highest-random-weight) hashing of a prefix's first block onto an endpoint:
/// every gateway worker and replica computes the same owner with no shared state.
pub fn rendezvous_weight(first_block: BlockHash, endpoint: &EndpointId) -> u64 {
    mix(first_block.0 ^ str_hash(endpoint.as_str()))
}

/// Weighted rendezvous (the logarithmic method): the candidate with the highest
/// `weight / −ln(u)`, `u` its hash with `first_block` mapped into (0, 1), wins with
/// probability proportional to its weight, and routers that agree on the weights agree on
/// the winner. Equal weights pick the same owner as `rendezvous_weight`.
pub fn weighted_rendezvous(first_block: BlockHash, endpoint: &EndpointId, weight: f64) -> f64 {
    let u = ((rendezvous_weight(first_block, endpoint) >> 11) as f64 + 0.5) / (1u64 << 53) as f64;
    weight / -u.ln()
}

/// FNV-1a: stable across builds and platforms, unlike std's hasher.
fn str_hash(s: &str) -> u64 {
    s.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
    })
}

/// SplitMix64's finaliser: a cheap, well-mixed 64-bit permutation.
pub fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests;

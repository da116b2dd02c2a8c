//! Scoring policies. Every policy maps a candidate to a [`Cost`] where lower wins, so one
//! selection routine (in `router`) serves them all.
//!
//! - `cost` (default): predicted time to first token in ms, in the spirit of NVIDIA Dynamo's
//!   KV router (prefill blocks − overlap + decode load) but in one physical unit:
//!   `prefill = (queued prefill tokens + (1 + work_weight × (1 + backlog)) × this
//!   request's uncached tokens) / prefill rate`, where `backlog` is the number of requests
//!   queued at the least-loaded candidate (`fleet_backlog`),
//!   `decode = running sequences × per-sequence step cost`, plus a KV-pressure term that
//!   grows quadratically past `kv_pressure_threshold`. Queued prefill tokens are the
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
//!   request, so an under-loaded fleet is scored as before).
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
pub use weights::{endpoint_speed_weight, speed_weight, typical_weight};

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
    pub mean_uncached_tokens: f64,
    pub rotation: u64,
    pub seed: u64,
    pub now: Millis,
    /// The candidates' learned prefill rates in classes of like servers (`RateClasses`).
    pub rates: RateClasses,
    /// The candidates' median prefill pace (`typical_pace`), if any has one.
    pub typical_pace: Option<f64>,
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
    let over = ((c.metrics.kv_usage - p.kv_pressure_threshold) / (1.0 - p.kv_pressure_threshold)).max(0.0);
    let kv_ms = p.kv_pressure_ms * over * over;
    let ttft_ms = (queued_tokens + c.uncached.0 as f64) * 1000.0 / rate + decode_ms + kv_ms;
    // Phase-aware (`cost.phase_weight`): the decode stall this prefill causes there. It
    // ranks servers and is kept out of the predicted TTFT; the breakdown shows it in
    // `decode_ms`.
    let stall_ms = p.phase_weight * running * c.uncached.0 as f64 * 1000.0 / rate;
    Terms {
        prefill_ms,
        decode_ms: decode_ms + stall_ms,
        kv_ms,
        cost: Cost(prefill_ms + decode_ms + stall_ms + kv_ms),
        ttft_ms,
    }
}

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
    left.0 as f64 * 1000.0 / server_rate(config, c, ctx)
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
/// its prefill pace against the candidates' median pace (`typical_pace`,
/// `speed::PrefillPace`): vLLM adds a request's prefill time to its metrics only when the
/// request finishes, which at long outputs takes many seconds, while the first tokens the
/// pace counts come right after the prefill. For the
/// same reason a server that slowed down (throttling, a noisy neighbour) is scored by its
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
fn server_rate(config: &Config, c: &Candidate, ctx: &ScoreContext) -> f64 {
    let prior = config.cost().prefill_tokens_per_s;
    if !config.cost().learn_speeds {
        return prior;
    }
    let typical = ctx.rates.typical().unwrap_or(prior);
    let by_pace = || {
        let (pace, typical_pace) = (c.endpoint.pace.per_ms(ctx.now)?, ctx.typical_pace?);
        let placed = c.endpoint.pace.samples() >= PrefillPace::PLACE_SAMPLES
            || c.endpoint.pace.best_per_ms(ctx.now)? * PACE_SAME_WITHIN < typical_pace;
        placed.then_some((typical * pace / typical_pace, PACE_SAME_WITHIN))
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
        _ => typical,
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
mod tests {
    use super::*;
    use crate::endpoint::EndpointTable;

    fn table_of(n: usize) -> EndpointTable {
        let mut table = EndpointTable::default();
        let ids: Vec<EndpointId> = (1..=n).map(|i| EndpointId::new(format!("10.0.0.{i}:8000"))).collect();
        table.replace(&ids);
        table
    }

    /// Every endpoint of `table` as an idle candidate for a prompt of `uncached` tokens.
    fn idle_cands<'a>(table: &'a EndpointTable, idle: &'a VllmMetrics, uncached: u64) -> Vec<Candidate<'a>> {
        table
            .rows()
            .iter()
            .map(|endpoint| Candidate {
                endpoint,
                metrics: idle,
                matched_blocks: 0,
                uncached: Tokens(uncached),
            })
            .collect()
    }

    /// A context at time 0 with no backlog and the given rate classes and typical pace.
    fn ctx_at_zero(rates: RateClasses, typical_pace: Option<f64>) -> ScoreContext {
        ScoreContext {
            total_blocks: 0,
            fleet_backlog: 0.0,
            mean_uncached_tokens: 0.0,
            rotation: 0,
            seed: 0,
            now: Millis(0),
            rates,
            typical_pace,
            typical_step: None,
            fastest_step: None,
            typical_weight: None,
        }
    }

    fn cands<'a>(table: &'a EndpointTable, metrics: [&'a VllmMetrics; 2]) -> Vec<Candidate<'a>> {
        table
            .rows()
            .iter()
            .zip(metrics)
            .map(|(endpoint, metrics)| Candidate {
                endpoint,
                metrics,
                matched_blocks: 0,
                uncached: Tokens(1000),
            })
            .collect()
    }

    #[test]
    fn the_backlog_counts_prefills_queued_in_the_running_batch() {
        let mut table = EndpointTable::default();
        table.replace(&[EndpointId::new("10.0.0.1:8000"), EndpointId::new("10.0.0.2:8000")]);
        let config = Config::from_json(b"{}").unwrap();
        // Nothing waits anywhere, but 40k and 100k tokens of this gateway's prompts have no
        // first token yet: 4 and 10 requests of 10k, one of them prefilling.
        table.rows_mut()[0].pending_prefill_tokens = Tokens(40_000);
        table.rows_mut()[1].pending_prefill_tokens = Tokens(100_000);
        let idle = VllmMetrics::default();
        let busy = VllmMetrics {
            waiting: 5,
            ..VllmMetrics::default()
        };
        assert_eq!(
            fleet_backlog(&config, &cands(&table, [&idle, &idle]), 10_000.0, Millis(0)),
            3.0,
            "the least-loaded server's queue"
        );
        assert_eq!(
            fleet_backlog(&config, &cands(&table, [&busy, &idle]), 10_000.0, Millis(0)),
            5.0,
            "waiting counts when it is more"
        );
        assert_eq!(
            fleet_backlog(&config, &cands(&table, [&idle, &idle]), 80_000.0, Millis(0)),
            0.0,
            "one request prefilling is no queue"
        );
    }

    #[test]
    fn a_server_with_no_learned_rate_is_placed_by_its_pace_when_it_is_far_off() {
        let config = Config::from_json(b"{}").unwrap();
        let mut table = table_of(3);
        // First tokens came 4× slower from the third server, 1.5× from the second.
        for (row, ms) in [(0, 100), (1, 150), (2, 400)] {
            for _ in 0..PrefillPace::PLACE_SAMPLES {
                table.rows_mut()[row].pace.observe(3000, 3000.0, ms, true, Millis(0));
            }
        }
        let idle = VllmMetrics::default();
        let cands = idle_cands(&table, &idle, 1000);
        let ctx = |typical_pace| ctx_at_zero(RateClasses::default(), typical_pace);
        let ms = |ctx: &ScoreContext| -> Vec<f64> {
            cands.iter().map(|c| predicted_ttft(&config, c, ctx).ttft_ms).collect()
        };
        let paced = ctx(typical_pace(&config, &cands, Millis(0)));
        let [fast, near, slow] = ms(&paced)[..] else { panic!() };
        assert_eq!(fast, near, "within 2x of the median pace: typical");
        assert!(
            (slow / near - 400.0 / 150.0).abs() < 1e-9,
            "past 2x: its own pace ({slow} vs {near})"
        );
        // The configured rate stands in for the typical one: 1000 tokens at 20k/s.
        assert!((near - 50.0).abs() < 1e-9, "{near}");
        let unpaced = ctx(None);
        assert!(ms(&unpaced).iter().all(|m| (m - 50.0).abs() < 1e-9));
    }

    #[test]
    fn a_slower_gpu_is_placed_from_its_first_prompts_and_an_unlucky_like_server_is_not() {
        let config = Config::from_json(b"{}").unwrap();
        let mut table = table_of(4);
        for row in 0..2 {
            for _ in 0..PrefillPace::PLACE_SAMPLES {
                table.rows_mut()[row].pace.observe(3000, 3000.0, 100, true, Millis(0));
            }
        }
        // Three prompts each: the third server waited behind others twice but was as fast
        // once; the fourth was 3× slower every time.
        for (row, times) in [(2, [300, 300, 100]), (3, [300, 300, 300])] {
            for ms in times {
                table.rows_mut()[row].pace.observe(3000, 3000.0, ms, true, Millis(0));
            }
        }
        let idle = VllmMetrics::default();
        let cands = idle_cands(&table, &idle, 1000);
        let ctx = ctx_at_zero(RateClasses::default(), typical_pace(&config, &cands, Millis(0)));
        let [fast, _, unlucky, slow] = cands
            .iter()
            .map(|c| predicted_ttft(&config, c, &ctx).ttft_ms)
            .collect::<Vec<_>>()[..]
        else {
            panic!()
        };
        let unlucky_pace = table.rows()[2].pace.per_ms(Millis(0)).unwrap();
        assert!(
            unlucky_pace * PACE_SAME_WITHIN < 30.0,
            "its pace alone reads over 2x slow ({unlucky_pace})"
        );
        assert_eq!(unlucky, fast, "one fast sample of three: typical");
        assert!((slow / fast - 3.0).abs() < 1e-9, "{slow} vs {fast}");
    }

    #[test]
    fn an_unlike_server_is_charged_its_longer_steps_and_like_servers_are_not() {
        let config = Config::from_json(b"{}").unwrap();
        let mut table = table_of(4);
        // Three H100s (40k tokens/s), one with a busy batch's 9 ms steps, and an A100
        // (12k tokens/s) with 9 ms steps.
        for (row, rate, step) in [
            (0, 40_000.0, 5.0),
            (1, 40_000.0, 5.0),
            (2, 40_000.0, 9.0),
            (3, 12_000.0, 9.0),
        ] {
            table.rows_mut()[row].speed = crate::speed::Speed::exact(rate, Millis(0));
            table.rows_mut()[row].step = crate::speed::StepTime::exact(step, Millis(0));
        }
        let idle = VllmMetrics::default();
        let cands = idle_cands(&table, &idle, 1200);
        let ctx = ctx_at_zero(rate_classes(&config, &cands, Millis(0)), None);
        let ctx = with_steps(&config, &cands, ctx);
        let ms: Vec<f64> = cands.iter().map(|c| predicted_ttft(&config, c, &ctx).ttft_ms).collect();
        assert!(
            (ms[0] - 30.0).abs() < 1e-9,
            "1200 tokens at 40k/s, no step charge: {}",
            ms[0]
        );
        assert_eq!(ms[0], ms[2], "a like server's longer steps are not charged");
        // 100 ms of prefill at 12k/s, then 1.5 steps of 9 ms against the H100s' 5 ms.
        assert!((ms[3] - (100.0 + 1.5 * 4.0)).abs() < 1e-9, "{}", ms[3]);
        let off = Config::from_json(br#"{"cost": {"first_token_steps": 0}}"#).unwrap();
        assert!((predicted_ttft(&off, &cands[3], &ctx).ttft_ms - 100.0).abs() < 1e-9);
    }

    /// Predicted TTFT (no step charge) of 1,200 uncached tokens on each of `table`'s idle
    /// servers, with `config`'s speed weights.
    fn weighted_ms(config_json: &str, table: &EndpointTable) -> Vec<f64> {
        let config = Config::from_json(config_json.as_bytes()).unwrap();
        let idle = VllmMetrics::default();
        let cands = idle_cands(table, &idle, 1200);
        let mut ctx = ctx_at_zero(rate_classes(&config, &cands, Millis(0)), None);
        ctx.typical_weight = typical_weight(&config, &cands, &ctx.rates, Millis(0));
        cands.iter().map(|c| predicted_ttft(&config, c, &ctx).ttft_ms).collect()
    }

    const H100_H100_A100_A100: &str = r#"{"cost": {"first_token_steps": 0, "speed_weights":
        {"10.0.0.1:8000": 3, "10.0.0.2:8000": 3, "10.0.0.3:8000": 1, "10.0.0.4:8000": 1}}}"#;

    #[test]
    fn a_server_weighted_slower_is_scored_slower_until_its_own_rate_is_learned() {
        let mut table = table_of(4);
        let ms = weighted_ms(H100_H100_A100_A100, &table);
        // Nothing learned: the configured 20k tokens/s is the typical (weight 3) servers'.
        let near = |a: &[f64], b: &[f64]| a.iter().zip(b).all(|(x, y)| (x - y).abs() < 1e-9);
        assert!(near(&ms, &[60.0, 60.0, 180.0, 180.0]), "{ms:?}");
        table.rows_mut()[3].speed = crate::speed::Speed::exact(12_000.0, Millis(0));
        let ms = weighted_ms(H100_H100_A100_A100, &table);
        assert!((ms[3] - 100.0).abs() < 1e-9, "its learned 12k/s: {ms:?}");
        // The typical rate is now the only one learned (12k, at weight 1): the weight-3
        // servers are scored at 36k/s, the other weight-1 server at 12k/s.
        assert!(
            (ms[0] - 1200.0 / 36.0).abs() < 1e-9 && (ms[2] - 100.0).abs() < 1e-9,
            "{ms:?}"
        );
    }

    #[test]
    fn envoy_weights_count_when_asked_where_the_config_names_no_weight() {
        let mut table = table_of(4);
        for (row, w) in [3, 3, 1, 1].into_iter().enumerate() {
            table.rows_mut()[row].lb_weight = w;
        }
        let from_envoy = r#"{"cost": {"first_token_steps": 0, "speed_weights_from_envoy": true}}"#;
        assert_eq!(
            weighted_ms(from_envoy, &table),
            weighted_ms(H100_H100_A100_A100, &table_of(4))
        );
        assert_eq!(
            weighted_ms(r#"{"cost": {"first_token_steps": 0}}"#, &table),
            [60.0; 4],
            "not read unless asked: weights set for a canary's share are no speed"
        );
        // The config's weight wins: server 1 named at 1 beside its Envoy weight of 3.
        let named = r#"{"cost": {"first_token_steps": 0, "speed_weights_from_envoy": true,
            "speed_weights": {"10.0.0.2:8000": 1}}}"#;
        let ms = weighted_ms(named, &table);
        assert!(ms[1] > 2.9 * ms[0], "{ms:?}");
    }

    #[test]
    fn a_weights_rate_stays_within_eight_times_the_configured_one() {
        let far = r#"{"cost": {"first_token_steps": 0, "speed_weights": {"10.0.0.1:8000": 100,
            "10.0.0.4:8000": 0.01}}}"#;
        let ms = weighted_ms(far, &table_of(4));
        // Typical weight 1 at the configured 20k tokens/s: 160k and 2.5k at most and least.
        let near = |a: f64, b: f64| (a - b).abs() < 1e-9;
        assert!(near(ms[0], 7.5) && near(ms[1], 60.0) && near(ms[3], 480.0), "{ms:?}");
    }

    #[test]
    fn equal_or_near_weights_change_nothing() {
        let plain = weighted_ms(r#"{"cost": {"first_token_steps": 0}}"#, &table_of(4));
        assert_eq!(plain, [60.0; 4]);
        let all_two = r#"{"cost": {"first_token_steps": 0, "speed_weights": {"10.0.0.1:8000": 2,
            "10.0.0.2:8000": 2, "10.0.0.3:8000": 2, "10.0.0.4:8000": 2}}}"#;
        assert_eq!(weighted_ms(all_two, &table_of(4)), plain);
        let near = r#"{"cost": {"first_token_steps": 0, "speed_weights": {"10.0.0.1:8000": 1.4}}}"#;
        assert_eq!(weighted_ms(near, &table_of(4)), plain, "within 1.5x counts as alike");
        let off = r#"{"cost": {"first_token_steps": 0, "learn_speeds": false, "speed_weights":
            {"10.0.0.1:8000": 3, "10.0.0.2:8000": 3}}}"#;
        assert_eq!(weighted_ms(off, &table_of(4)), plain, "the configured rate alone");
    }

    #[test]
    fn like_servers_are_scored_at_their_class_rate() {
        // Four H100s whose learned rates drifted apart (the outer two 1.7x apart) and four
        // A100s, 3x slower (`RateClasses`).
        let rates = [
            30_000.0, 38_000.0, 44_000.0, 51_000.0, 10_000.0, 11_500.0, 12_000.0, 14_000.0,
        ];
        let config = Config::from_json(b"{}").unwrap();
        let mut table = table_of(8);
        for (row, rate) in rates.iter().enumerate() {
            table.rows_mut()[row].speed = crate::speed::Speed::exact(*rate, Millis(0));
        }
        let idle = VllmMetrics::default();
        let cands = idle_cands(&table, &idle, 1200);
        let ctx = ctx_at_zero(rate_classes(&config, &cands, Millis(0)), None);
        let off = Config::from_json(br#"{"cost": {"first_token_steps": 0}}"#).unwrap();
        let ms: Vec<f64> = cands.iter().map(|c| predicted_ttft(&off, c, &ctx).ttft_ms).collect();
        assert!(ms[..4].iter().all(|m| (m - 1200.0 / 44.0).abs() < 1e-9), "{ms:?}");
        assert!(
            ms[4..].iter().all(|m| (m - 100.0).abs() < 1e-9),
            "1200 tokens at 12k/s: {ms:?}"
        );
    }

    #[test]
    fn a_learned_rate_gives_way_to_a_pace_far_off_it() {
        let config = Config::from_json(b"{}").unwrap();
        let mut table = table_of(3);
        // All three learned 40k tokens/s from vLLM's sums; then the third slowed 3x: its
        // first tokens show it at once, its sums only when its requests finish. The first
        // reads 3x faster than the median pace: a pace never speeds a learned rate up.
        for (row, ms) in [(0, 50), (1, 150), (2, 450)] {
            table.rows_mut()[row].speed = crate::speed::Speed::exact(40_000.0, Millis(0));
            for _ in 0..PrefillPace::PLACE_SAMPLES {
                table.rows_mut()[row].pace.observe(3000, 3000.0, ms, true, Millis(0));
            }
        }
        let idle = VllmMetrics::default();
        let cands = idle_cands(&table, &idle, 1000);
        let ctx = ctx_at_zero(
            rate_classes(&config, &cands, Millis(0)),
            typical_pace(&config, &cands, Millis(0)),
        );
        let [fast, near, slow] = cands
            .iter()
            .map(|c| predicted_ttft(&config, c, &ctx).ttft_ms)
            .collect::<Vec<_>>()[..]
        else {
            panic!()
        };
        assert!(
            (fast - 25.0).abs() < 1e-9 && fast == near,
            "1000 tokens at the learned 40k/s: {fast}, {near}"
        );
        assert!(
            (slow / near - 3.0).abs() < 1e-9,
            "3x the median pace: its pace ({slow} vs {near})"
        );
    }
}

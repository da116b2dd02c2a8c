//! Each server's prefill speed, learned online from its own metrics.
//!
//! The cost policy turns tokens into milliseconds with a rate. One configured rate
//! (`cost.prefill_tokens_per_s`) is right for one GPU type at best: an A100 prefills about
//! 11.5k tokens/s of Llama-3-8B where an H100 does about 38.9k, and a throttled or shared GPU
//! less. vLLM counts, over its finished requests, the seconds each spent in prefill (from
//! its first scheduling to its first token, `vllm:request_prefill_time_seconds`) and the
//! prompt tokens it computed there (`vllm:request_prefill_kv_computed_tokens`). The growth
//! of the two sums between scrapes is one sample of the server's prefill rate once at least
//! `MIN_TOKENS` were computed (smaller growth is carried to the next scrape).
//!
//! Summed per-request seconds count a second once per prefill running in it. While they
//! grow no faster than the wall clock (on average at most one prefill at a time), their
//! ratio is the rate itself and a sample is taken at once. When they grow faster, several
//! prefills shared the server's steps and the plain ratio would read as the rate divided by
//! their number. That made the estimate feed on itself at overload: vLLM starts the clock
//! at scheduling, so a server with a deep waiting queue runs few prefills at a time and
//! looked fast, drew more work and looked faster still (replay, 8 identical H100s, Azure
//! trace at 110% load: learned rates from 3.4k to 11k tokens/s where the truth is about
//! 38k, and one server held 3× the queued prefill of another). Then the sample waits until
//! `MIN_WINDOW_MS` of wall time passed and counts the wall time instead: the tokens the
//! server drained per second while it was busy, whatever the number sharing a step (the
//! wait keeps one long prefill finishing just after a scrape from reading as a burst).
//!
//! Samples are averaged in the log domain (a slow and a fast sample weigh alike) and
//! clamped to an eighth and eight times the configured rate. Until `MIN_SAMPLES` samples
//! arrived, and again when none arrived for `FORGET_MS` (a server that lost all its traffic
//! is scored as a typical one again, so it is tried again), the rate is unknown.
//!
//! Every router of every worker reads the same scrapes, so they learn the same rates.
//! Servers of one kind differ by noise: the policy puts rates that chain within
//! `SAME_WITHIN` of their neighbours in one class and scores each server at its class's
//! median rate (`policy::RateClasses`), so noise never breaks the tie between identical
//! servers that keeps cold prefixes together. 1.5 is well under what tells GPUs apart (H100
//! against A100 3.4×; a throttled server 2–3×), and neighbouring rates of identical servers
//! rarely lie further apart (replay, 8 H100s, Azure trace at 110% load: in 3% of scrapes,
//! while in 30% some server's rate lay beyond 1.5× of the median).
//!
//! A gateway that starts in front of a running fleet (a new replica, an Envoy restart, a
//! wasm reload: every one drops what the VMs learned) would otherwise score every server
//! alike until each had sent it three samples, and at light traffic that is minutes; a
//! conversation or prefix placed meanwhile stays where it went. vLLM's counters are
//! cumulative since the server started, so the first scrape already holds its history:
//! when it holds `HISTORY_TOKENS`, the ratio of the sums establishes the rate at once. It
//! counts every second as often as prefills shared it, so it reads low on a server that
//! ran many at once; identical servers that ran alike read alike (the equal band absorbs
//! the rest), and live samples replace it at the usual pace. Like any learned rate it is
//! forgotten after `FORGET_MS` without a sample, so a server it called slow is tried
//! again. Replay `--restart-at-s`, 4 H100 + 4 A100, TTFT p95 of the requests after the
//! restart: multi-turn 101.7 → 50.7 ms, rag 259 → 165, Azure 4,297 → 3,260,
//! shared-prefix 23.6 → 16.0; on 8 identical H100s, also overloaded, no change.
//!
//! A sample measured in the first-token time the gateway sees instead (tokens it counted
//! ahead, divided by the time to the first token) was tried first and dropped: its count of
//! tokens ahead includes prefills already under way, so a busier server looked faster, drew
//! more traffic and looked faster still (replay, 8 identical H100s: one server's share rose
//! to 24%).
//!
//! vLLM observes a request's prefill time when the request *finishes*, so at long outputs a
//! server's first sample comes many seconds after its first prefill (replay, 4 H100 + 4
//! A100, rag at 130%: the A100s had computed nothing in vLLM's sums 13 s into the run). Until
//! a rate is learned, `PrefillPace` (one request at a time, timed from when the server could
//! start on it, so prefills under way do not count) places a server that is far off the
//! fleet's median pace (`policy::server_rate`). The same lag hides a server that slows
//! down: its sums still hold the requests it prefilled before (replay, rag at 50% load, one
//! of 8 H100s slowed 3×: the learned rate moved 14 s later, the pace within 2 s), so a
//! pace far slower than the learned rate places the server too.

use crate::types::Millis;

/// Samples needed before the learned rate replaces the configured one.
pub const MIN_SAMPLES: u32 = 3;
/// Prefill tokens computed between two samples at least (fewer say little about the rate).
pub const MIN_TOKENS: u64 = 2048;
/// Prefill tokens a server's history must hold for its first scrape to establish its rate:
/// as many as the live samples that establish one.
pub const HISTORY_TOKENS: u64 = MIN_SAMPLES as u64 * MIN_TOKENS;
/// Learned rates that chain within this factor of their neighbours are one class, scored
/// at its median (`policy::RateClasses`).
pub const SAME_WITHIN: f64 = 1.5;
/// A server with no learned rate yet whose prefill pace is within this factor of the
/// fleet's median pace counts as typical (`policy::server_rate`): wider than `SAME_WITHIN`,
/// as paces include waits behind decode steps (replay, 8 identical H100s, Azure trace at 80%:
/// at 1.5 TTFT p95 +5.7% over 11 replicas, at 2 unchanged).
pub const PACE_SAME_WITHIN: f64 = 2.0;
/// Wall time a sample spans at least when the summed prefill seconds outgrew it.
pub const MIN_WINDOW_MS: u64 = 2000;
/// A learned rate with no new sample for this long falls back to the configured one.
pub const FORGET_MS: u64 = 60_000;
const ALPHA: f64 = 0.25;
const CLAMP: f64 = 8.0;

#[derive(Clone, Debug, Default, PartialEq)]
pub struct Speed {
    log_rate: Option<f64>,
    samples: u32,
    last: Option<Millis>,
    /// Where the next sample starts.
    baseline: Option<Baseline>,
}

/// The server's cumulative counters at the scrape the next sample starts from.
#[derive(Clone, Copy, Debug, PartialEq)]
struct Baseline {
    tokens: f64,
    seconds: f64,
    at: Millis,
}

impl Speed {
    /// A scrape's cumulative prefill counters, taken at `now` (see the module note): the
    /// first one is the baseline and, holding the server's history, may establish the rate
    /// at once (`seed_from_history`); then a sample once enough tokens were computed since
    /// the baseline, and, when the summed seconds outgrew the wall time, once
    /// `MIN_WINDOW_MS` passed. A counter that went down (the server restarted) starts a new
    /// baseline.
    pub fn on_counters(&mut self, tokens: Option<f64>, seconds: Option<f64>, prior: f64, now: Millis) {
        let (Some(tokens), Some(seconds)) = (tokens, seconds) else {
            return;
        };
        let here = Baseline {
            tokens,
            seconds,
            at: now,
        };
        let Some(start) = self.baseline else {
            self.baseline = Some(here);
            self.seed_from_history(tokens, seconds, prior, now);
            return;
        };
        if tokens < start.tokens || seconds < start.seconds || now < start.at {
            self.baseline = Some(here);
            return;
        }
        let (dt, ds) = (tokens - start.tokens, seconds - start.seconds);
        let wall_ms = now.since(start.at);
        let wall_s = wall_ms as f64 / 1000.0;
        let shared = ds > wall_s;
        if dt < MIN_TOKENS as f64 || ds <= 0.0 || (shared && wall_ms < MIN_WINDOW_MS) {
            return;
        }
        self.baseline = Some(here);
        let busy_s = if shared { wall_s } else { ds };
        self.observe(dt as u64, (busy_s * 1000.0).round().max(1.0) as u64, prior, now);
    }

    /// The first scrape of a server: its counters hold everything since it started. When
    /// they hold as many tokens as the samples that establish a rate (`HISTORY_TOKENS`),
    /// their ratio establishes it at once (see the module note on gateways that restart).
    fn seed_from_history(&mut self, tokens: f64, seconds: f64, prior: f64, now: Millis) {
        if tokens < HISTORY_TOKENS as f64 || seconds <= 0.0 {
            return;
        }
        self.observe(tokens as u64, (seconds * 1000.0).round() as u64, prior, now);
        if self.log_rate.is_some() {
            self.samples = self.samples.max(MIN_SAMPLES);
        }
    }

    /// One sample: `tokens` computed in `ms` milliseconds of prefill.
    pub fn observe(&mut self, tokens: u64, ms: u64, prior: f64, now: Millis) {
        if tokens < MIN_TOKENS || ms == 0 || !(prior.is_finite() && prior > 0.0) {
            return;
        }
        let sample = (tokens as f64 * 1000.0 / ms as f64).clamp(prior / CLAMP, prior * CLAMP);
        let l = sample.ln();
        let fresh = self.last.is_some_and(|t| now.since(t) <= FORGET_MS);
        self.log_rate = Some(match self.log_rate {
            Some(x) if fresh => x + ALPHA * (l - x),
            _ => {
                self.samples = 0;
                l
            }
        });
        self.samples = self.samples.saturating_add(1);
        self.last = Some(now);
    }

    /// The learned rate in tokens per second when it is established and recent, else
    /// `prior`.
    pub fn rate(&self, prior: f64, now: Millis) -> f64 {
        match (self.log_rate, self.last) {
            (Some(l), Some(t)) if self.samples >= MIN_SAMPLES && now.since(t) <= FORGET_MS => l.exp(),
            _ => prior,
        }
    }

    /// A rate known exactly as of `now` (a reference that knows every server's true speed).
    pub fn exact(tokens_per_s: f64, now: Millis) -> Speed {
        Speed {
            log_rate: Some(tokens_per_s.ln()),
            samples: MIN_SAMPLES,
            last: Some(now),
            baseline: None,
        }
    }

    /// The learned rate, if established (for stats).
    pub fn learned(&self, now: Millis) -> Option<f64> {
        let rate = self.rate(f64::NAN, now);
        rate.is_finite().then_some(rate)
    }
}

/// A server's recent step time: the growth of vLLM's summed inter-token latencies over the
/// growth of their count between scrapes (ms per output token; a decode step, or a step
/// that also prefilled, seen from the requests decoding in it). vLLM observes them every
/// step, so unlike the prefill sums (observed when a request finishes) they follow a
/// slowdown at the next scrape. A new request waits for the step in progress and then
/// takes at least one step for its first token, so the cost charges a few of them
/// (`cost.first_token_steps`, `policy::server_step`): an A100's steps take about 1.7× an
/// H100's (they read the same weights from slower memory), which the prefill rate alone
/// does not show for short prompts.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct StepTime {
    ms: Option<f64>,
    last: Option<Millis>,
    baseline: Option<(f64, f64)>,
}

impl StepTime {
    /// Output tokens a sample needs at least (fewer say little about a step).
    pub const MIN_TOKENS: f64 = 32.0;
    /// Weight of a new sample in the average.
    const ALPHA: f64 = 0.5;

    /// A scrape's cumulative inter-token seconds and count, at `now`. A counter that went
    /// down (the server restarted) starts a new baseline.
    pub fn on_counters(&mut self, seconds: Option<f64>, count: Option<f64>, now: Millis) {
        let (Some(seconds), Some(count)) = (seconds, count) else {
            return;
        };
        let Some((s0, c0)) = self.baseline else {
            self.baseline = Some((seconds, count));
            return;
        };
        if seconds < s0 || count < c0 {
            self.baseline = Some((seconds, count));
            return;
        }
        let (ds, dc) = (seconds - s0, count - c0);
        if dc < Self::MIN_TOKENS {
            return;
        }
        self.baseline = Some((seconds, count));
        let sample = ds * 1000.0 / dc;
        if !sample.is_finite() {
            return;
        }
        let fresh = self.last.is_some_and(|t| now.since(t) <= FORGET_MS);
        self.ms = Some(match self.ms {
            Some(m) if fresh => m + Self::ALPHA * (sample - m),
            _ => sample,
        });
        self.last = Some(now);
    }

    /// A step time known exactly as of `now` (a reference that knows every server's truth).
    pub fn exact(ms: f64, now: Millis) -> StepTime {
        StepTime {
            ms: Some(ms),
            last: Some(now),
            baseline: None,
        }
    }

    /// The recent step time in ms, if a sample came in the last `FORGET_MS`.
    pub fn ms(&self, now: Millis) -> Option<f64> {
        self.ms.filter(|_| self.last.is_some_and(|t| now.since(t) <= FORGET_MS))
    }
}

/// How far off a server's predicted TTFT has been: observed ÷ predicted first-token times of
/// this router's own requests there, averaged in the log domain. The cost policy predicts
/// from lower bounds of the work queued ahead (`policy::predicted_ttft`), good for ranking
/// servers but short in absolute terms on a busy server; tiers compare a prediction with an
/// objective, so they scale it by this. It never changes the ranking itself (a busier server
/// looking slower there would feed on itself; see the note above on first-token samples).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct TtftBias {
    log_ratio: Option<f64>,
    /// Exponentially weighted variance of the log ratio.
    log_var: f64,
    samples: u32,
    last: Option<Millis>,
}

/// Predictions shorter than this are left out: a fixed few ms (the step in progress, the
/// network) would read as a large ratio.
pub const BIAS_MIN_PREDICTED_MS: f64 = 20.0;
const BIAS_ALPHA: f64 = 0.1;
/// The factor is the ratio's 90th percentile (a log-normal spread, z = 1.28), not its
/// middle: an objective is a promise per request, so a tier is trusted with a request only
/// when most of its recent requests came in within the prediction so scaled.
const BIAS_Z: f64 = 1.28;

impl TtftBias {
    /// One request: predicted `predicted_ms` at routing, first token after `observed_ms`.
    pub fn observe(&mut self, predicted_ms: f64, observed_ms: f64, now: Millis) {
        if !(predicted_ms.is_finite() && predicted_ms >= BIAS_MIN_PREDICTED_MS && observed_ms.is_finite()) {
            return;
        }
        let l = (observed_ms.max(1.0) / predicted_ms).clamp(1.0 / CLAMP, CLAMP).ln();
        let fresh = self.last.is_some_and(|t| now.since(t) <= FORGET_MS);
        match self.log_ratio {
            Some(x) if fresh => {
                let d = l - x;
                self.log_ratio = Some(x + BIAS_ALPHA * d);
                self.log_var = (1.0 - BIAS_ALPHA) * (self.log_var + BIAS_ALPHA * d * d);
            }
            _ => {
                self.log_ratio = Some(l);
                self.log_var = 0.0;
                self.samples = 0;
            }
        }
        self.samples = self.samples.saturating_add(1);
        self.last = Some(now);
    }

    /// The factor to scale a prediction by: 1 until `MIN_SAMPLES` recent samples.
    pub fn factor(&self, now: Millis) -> f64 {
        match (self.log_ratio, self.last) {
            (Some(l), Some(t)) if self.samples >= MIN_SAMPLES && now.since(t) <= FORGET_MS => {
                (l + BIAS_Z * self.log_var.sqrt()).exp()
            }
            _ => 1.0,
        }
    }
}

/// The work of prefilling `uncached` tokens after `cached` ones, in tokens at position 0: a
/// token's attention grows with its position, so its cost is `1 + position /
/// attention_tokens` (`cost.attention_tokens`; 0 counts every token alike).
pub fn prefill_work(cached: f64, uncached: f64, attention_tokens: f64) -> f64 {
    if attention_tokens <= 0.0 {
        return uncached;
    }
    uncached * (1.0 + (2.0 * cached + uncached) / (2.0 * attention_tokens))
}

/// How many tokens after `cached` ones `work` (as `prefill_work` counts it) computes: the
/// inverse of `prefill_work`.
pub fn tokens_for_work(cached: f64, work: f64, attention_tokens: f64) -> f64 {
    if attention_tokens <= 0.0 {
        return work.max(0.0);
    }
    let k = attention_tokens;
    let b = 1.0 + cached / k;
    (k * ((b * b + 2.0 * work.max(0.0) / k).sqrt() - b)).max(0.0)
}

/// How fast a server gets through this gateway's prompts, as first tokens show it: the
/// work (`prefill_work`) of the request it was taken to be prefilling (the oldest of this
/// gateway's requests there without a first token: vLLM schedules first come, first served)
/// over the time from when it could start on it (its routing, or the previous such first
/// token there) to its first token. Decayed sums over about the last ten such requests.
/// It is a pace, not the server's rate: it includes what slowed that prefill down (decode
/// steps, other gateways' prompts, a response that only starts when it ends), so it errs
/// towards slow. `Endpoint::prefill_left` uses it to take the progress of the prompt in
/// prefill off the pending count.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct PrefillPace {
    work: f64,
    ms: f64,
    /// The fastest sample's work per ms, of those timed from their routing.
    best: f64,
    samples: u32,
    last: Option<Millis>,
}

impl PrefillPace {
    /// Samples needed before `per_ms` answers.
    pub const MIN_SAMPLES: u32 = 3;
    /// Uncached tokens a request needs to be a sample: the first token of a shorter one
    /// measures a step and the network, not prefill (and one that Envoy retried elsewhere
    /// after a failed connection would make a short request read as a very slow server).
    pub const MIN_TOKENS: u64 = 256;
    /// Samples needed before the pace may place a server with no learned rate
    /// (`policy::server_rate`): with three, early paces of identical servers read over 2×
    /// apart (replay, 2 gateways × 8 workers, shared-prefix at 130%: TTFT p95 227 → 268 ms,
    /// p99 303 → 597; with eight 228 / 322). Before then only a server whose fastest sample
    /// is far off is placed (`best_per_ms`).
    pub const PLACE_SAMPLES: u32 = 8;

    /// A request of `tokens` uncached tokens, `work` as `prefill_work` counts them, took
    /// `ms` from when the server could start on it to its first token, seen at `now`;
    /// `from_routing` when that start was its own routing. Only such a sample can be the
    /// fastest (`best_per_ms`): one timed from the previous prompt's first token may have
    /// been prefilled in the same step as that one, and its first token then comes at the
    /// same instant (0 ms for a whole prompt). Counted as the fastest, such samples hid the
    /// A100s of a mixed fleet among the H100s (replay, 4 H100 + 4 A100: shared-prefix at
    /// 110% / 130% TTFT p95 74 / 74 → 55 / 56 ms; BENCHMARKS "The fastest sample").
    pub fn observe(&mut self, tokens: u64, work: f64, ms: u64, from_routing: bool, now: Millis) {
        if tokens < Self::MIN_TOKENS {
            return;
        }
        self.work = 0.9 * self.work + work;
        self.ms = 0.9 * self.ms + ms.max(1) as f64;
        if from_routing {
            self.best = self.best.max(work / ms.max(1) as f64);
        }
        self.samples = self.samples.saturating_add(1);
        self.last = Some(now);
    }

    /// The fastest sample's work per ms, under the same conditions as `per_ms`. Whatever
    /// slows a prefill down (a decode step, a prompt from elsewhere) only makes its first
    /// token later, so a server's fastest sample bounds its speed from above: an unlucky
    /// server that is as fast as the others shows it in one sample of a few, a slower GPU
    /// in none. That makes a few samples enough to tell a slower GPU from noise. None while
    /// no sample was timed from its routing (`observe`).
    pub fn best_per_ms(&self, now: Millis) -> Option<f64> {
        self.per_ms(now).filter(|_| self.best > 0.0).map(|_| self.best)
    }

    /// Samples taken so far.
    pub fn samples(&self) -> u32 {
        self.samples
    }

    /// Work per ms, once `MIN_SAMPLES` samples arrived and while the last is under
    /// `FORGET_MS` old (a server the pace called slow gets its traffic back, and a new pace).
    pub fn per_ms(&self, now: Millis) -> Option<f64> {
        let recent = self.last.is_some_and(|t| now.since(t) <= FORGET_MS);
        (recent && self.samples >= Self::MIN_SAMPLES && self.ms > 0.0).then(|| self.work / self.ms)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn later_tokens_of_a_prompt_cost_more_and_work_converts_back_to_tokens() {
        assert_eq!(prefill_work(0.0, 1000.0, 0.0), 1000.0);
        // 0 → 30k tokens at 30k: the mean position is half of it, so 1.5 × the tokens.
        assert!((prefill_work(0.0, 30_000.0, 30_000.0) - 45_000.0).abs() < 1e-6);
        // At 30k tokens of context a token costs about twice one at the start.
        assert!(prefill_work(30_000.0, 1000.0, 30_000.0) > 1.9 * prefill_work(0.0, 1000.0, 30_000.0));
        for (cached, tokens) in [(0.0, 5000.0), (12_000.0, 777.0), (40_000.0, 20_000.0)] {
            let work = prefill_work(cached, tokens, 30_000.0);
            assert!((tokens_for_work(cached, work, 30_000.0) - tokens).abs() < 1e-6);
        }
        assert_eq!(tokens_for_work(100.0, -5.0, 30_000.0), 0.0);
    }

    #[test]
    fn a_pace_needs_three_first_tokens_of_real_prompts_and_is_forgotten() {
        let mut pace = PrefillPace::default();
        let t = Millis(1000);
        pace.observe(1000, 1000.0, 100, true, t);
        pace.observe(1000, 1000.0, 100, true, t);
        pace.observe(20, 20.0, 5000, true, t);
        assert_eq!(pace.per_ms(t), None, "a 20-token prompt is no sample");
        pace.observe(1000, 1000.0, 0, true, t);
        let per_ms = pace.per_ms(t).unwrap();
        assert_eq!(pace.per_ms(t.plus(FORGET_MS + 1)), None);
        // 0.81 × 1000 + 0.9 × 1000 + 1000 over 0.81 × 100 + 0.9 × 100 + 1 (a 0 ms sample
        // counts as 1 ms).
        assert!((per_ms - 2710.0 / 172.0).abs() < 1e-9, "{per_ms}");
    }

    #[test]
    fn a_step_time_is_the_growth_of_the_inter_token_sums_and_follows_a_slowdown() {
        let mut step = StepTime::default();
        let t = Millis(1000);
        step.on_counters(Some(10.0), Some(1000.0), t);
        assert_eq!(step.ms(t), None, "the first scrape is the baseline");
        step.on_counters(Some(10.1), Some(1010.0), t.plus(200));
        assert_eq!(step.ms(t.plus(200)), None, "10 tokens are no sample; carried");
        // 0.5 s over 100 tokens since the baseline: 5 ms a step.
        step.on_counters(Some(10.5), Some(1100.0), t.plus(400));
        assert_eq!(step.ms(t.plus(400)), Some(5.0));
        // Slowed 3x: 15 ms a step; half of each new sample counts.
        step.on_counters(Some(12.0), Some(1200.0), t.plus(600));
        assert_eq!(step.ms(t.plus(600)), Some(10.0));
        step.on_counters(Some(13.5), Some(1300.0), t.plus(800));
        assert_eq!(step.ms(t.plus(800)), Some(12.5));
        // A restart (counters went down) starts a new baseline; a silent server is forgotten.
        step.on_counters(Some(0.1), Some(10.0), t.plus(1000));
        assert_eq!(step.ms(t.plus(1000)), Some(12.5));
        assert_eq!(step.ms(t.plus(800 + FORGET_MS + 1)), None);
        step.on_counters(None, Some(20.0), t.plus(1200));
        assert_eq!(
            step.ms(t.plus(1200)),
            Some(12.5),
            "a body without the sums changes nothing"
        );
    }

    const PRIOR: f64 = 20_000.0;

    #[test]
    fn the_prior_holds_until_enough_samples_then_the_rate_converges() {
        let mut s = Speed::default();
        s.observe(8000, 200, PRIOR, Millis(0)); // 40k tokens/s
        s.observe(8000, 200, PRIOR, Millis(10));
        assert_eq!(s.rate(PRIOR, Millis(10)), PRIOR);
        for i in 0..20 {
            s.observe(8000, 200, PRIOR, Millis(20 + i));
        }
        let r = s.rate(PRIOR, Millis(40));
        assert!((r - 40_000.0).abs() < 1.0, "{r}");
    }

    #[test]
    fn a_server_that_slows_three_times_is_seen_within_a_few_samples() {
        let mut s = Speed::default();
        for i in 0..10 {
            s.observe(9000, 300, PRIOR, Millis(i)); // 30k
        }
        for i in 0..8 {
            s.observe(9000, 900, PRIOR, Millis(100 + i)); // 10k
        }
        let r = s.rate(PRIOR, Millis(200));
        assert!(r < 12_000.0, "{r}");
    }

    #[test]
    fn scrapes_become_samples_once_enough_tokens_were_computed_and_a_restart_rebases() {
        let mut s = Speed::default();
        s.on_counters(Some(0.0), Some(0.0), PRIOR, Millis(0));
        for i in 1..=10u64 {
            // 1,000 tokens a scrape at 25k tokens/s: a sample every third scrape.
            s.on_counters(Some(1000.0 * i as f64), Some(0.04 * i as f64), PRIOR, Millis(i * 200));
        }
        assert_eq!(s.samples, 3);
        assert!((s.rate(PRIOR, Millis(2000)) - 25_000.0).abs() < 1.0);
        s.on_counters(Some(10.0), Some(0.001), PRIOR, Millis(2200));
        assert_eq!(
            s.baseline,
            Some(Baseline {
                tokens: 10.0,
                seconds: 0.001,
                at: Millis(2200)
            }),
            "a restarted server starts over"
        );
        s.on_counters(None, None, PRIOR, Millis(2400));
        assert_eq!(s.samples, 3, "a server without the counters teaches nothing");
    }

    #[test]
    fn prefills_sharing_steps_are_measured_in_wall_time_over_a_window() {
        // 30k tokens/s drained, four prefills at a time: each request's own seconds sum to
        // four times the wall time. The plain ratio would say 7.5k.
        let mut s = Speed::default();
        let mut t = 0u64;
        s.on_counters(Some(0.0), Some(0.0), PRIOR, Millis(t));
        let (mut tokens, mut seconds) = (0.0, 0.0);
        for _ in 0..40 {
            t += 200;
            tokens += 6000.0;
            seconds += 0.8;
            s.on_counters(Some(tokens), Some(seconds), PRIOR, Millis(t));
        }
        assert_eq!(s.samples, 4, "one sample per {MIN_WINDOW_MS} ms window, not per scrape");
        let r = s.rate(PRIOR, Millis(t));
        assert!((r - 30_000.0).abs() < 1.0, "{r}");
    }

    #[test]
    fn one_long_prefill_finishing_after_a_scrape_is_not_a_burst() {
        // One 24k-token prompt prefilled at 24k tokens/s in 1 s, seen 200 ms after the
        // previous sample: its second is counted against the window, not 200 ms.
        let mut s = Speed::default();
        s.on_counters(Some(0.0), Some(0.0), PRIOR, Millis(0));
        s.on_counters(Some(24_000.0), Some(1.0), PRIOR, Millis(200));
        assert_eq!(s.samples, 0, "wait: the seconds outgrew the 200 ms since the baseline");
        for t in [400, 600, 800, 1000] {
            s.on_counters(Some(24_000.0), Some(1.0), PRIOR, Millis(t));
        }
        assert_eq!(s.samples, 1, "taken once the wall time covers the seconds");
        assert_eq!(s.log_rate.map(f64::exp).map(f64::round), Some(24_000.0));
    }

    #[test]
    fn short_prompts_absurd_samples_and_old_knowledge_do_not_mislead() {
        let mut s = Speed::default();
        for i in 0..10 {
            s.observe(500, 1, PRIOR, Millis(i));
        }
        assert_eq!(s.learned(Millis(10)), None, "too few tokens ahead to say anything");
        for i in 0..10 {
            s.observe(4000, 1, PRIOR, Millis(i));
        }
        assert!((s.rate(PRIOR, Millis(10)) - PRIOR * CLAMP).abs() < 1e-6, "clamped");
        assert_eq!(s.rate(PRIOR, Millis(10 + FORGET_MS + 1)), PRIOR, "forgotten");
    }

    #[test]
    fn the_ttft_bias_learns_the_ratio_ignores_tiny_predictions_and_forgets() {
        let mut b = TtftBias::default();
        let t = Millis(1000);
        assert_eq!(b.factor(t), 1.0);
        for _ in 0..40 {
            b.observe(100.0, 300.0, t);
            b.observe(5.0, 500.0, t);
        }
        assert!((b.factor(t) - 3.0).abs() < 0.01, "a steady ratio: {}", b.factor(t));
        assert_eq!(b.factor(t.plus(FORGET_MS + 1)), 1.0);
        let mut spread = TtftBias::default();
        for _ in 0..40 {
            spread.observe(100.0, 150.0, t);
            spread.observe(100.0, 600.0, t);
        }
        assert!(
            spread.factor(t) > 4.0,
            "a spread ratio is trusted near its top: {}",
            spread.factor(t)
        );
    }

    #[test]
    fn a_first_scrape_with_history_establishes_the_rate_at_once() {
        // A server that ran before this gateway started: 120k tokens in 10 s of prefill.
        let mut s = Speed::default();
        s.on_counters(Some(120_000.0), Some(10.0), PRIOR, Millis(0));
        let r = s.learned(Millis(0)).unwrap();
        assert!((r - 12_000.0).abs() < 1e-6, "{r}");
        // Live samples then move it at the usual pace.
        s.on_counters(Some(150_000.0), Some(11.0), PRIOR, Millis(3000)); // 30k tokens/s
        let r = s.learned(Millis(3000)).unwrap();
        assert!(
            r > 14_000.0 && r < 16_000.0,
            "one sample moves it a quarter of the way: {r}"
        );
    }

    #[test]
    fn a_short_history_or_a_restarted_server_teaches_nothing_at_once() {
        let mut s = Speed::default();
        s.on_counters(Some((HISTORY_TOKENS - 1) as f64), Some(0.1), PRIOR, Millis(0));
        assert_eq!(s.learned(Millis(0)), None, "less history than three samples");
        let mut s = Speed::default();
        s.on_counters(Some(1e6), Some(0.0), PRIOR, Millis(0));
        assert_eq!(s.learned(Millis(0)), None, "tokens without seconds");
        // Counters that went down are a restarted server: a new baseline, no seed.
        let mut s = Speed::default();
        s.on_counters(Some(1000.0), Some(0.05), PRIOR, Millis(0));
        s.on_counters(Some(500_000.0), Some(20.0), PRIOR, Millis(200));
        let learned = s.learned(Millis(200));
        s.on_counters(Some(100_000.0), Some(2.0), PRIOR, Millis(400));
        assert_eq!(s.learned(Millis(400)), learned, "the rebase seeds nothing");
    }
}

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

mod admit;
mod bias;
mod pace;

pub use admit::Completions;
pub use bias::{TtftBias, BIAS_MIN_PREDICTED_MS};
pub use pace::{prefill_work, tokens_for_work, PrefillPace};

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
/// Learned rates are kept within this factor either way of the configured one.
pub const CLAMP: f64 = 8.0;

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

#[cfg(test)]
mod tests;

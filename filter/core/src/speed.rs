//! Each server's prefill speed, learned online from its own metrics.
//!
//! The cost policy turns tokens into milliseconds with a rate. One configured rate
//! (`cost.prefill_tokens_per_s`) is right for one GPU type at best: an A100 prefills about
//! 11.5k tokens/s of Llama-3-8B where an H100 does about 38.9k, and a throttled or shared GPU
//! less. vLLM counts, over its finished requests, the seconds each spent in prefill (from
//! its first scheduling to its first token, `vllm:request_prefill_time_seconds`) and the
//! prompt tokens it computed there (`vllm:request_prefill_kv_computed_tokens`). Between two
//! scrapes the growth of the two sums is one sample of the server's prefill rate as its
//! requests saw it — batching with other requests' steps included — once at least
//! `MIN_TOKENS` were computed (smaller growth is carried to the next scrape). Samples are
//! averaged in the log domain (a slow and a fast sample weigh alike) and clamped to an eighth
//! and eight times the configured rate. Until `MIN_SAMPLES` samples arrived, and again when
//! none arrived for `FORGET_MS` (a server that lost all its traffic is scored as a typical
//! one again, so it is tried again), the rate is unknown.
//!
//! Every router of every worker reads the same scrapes, so they learn the same rates.
//! Servers of one kind differ by noise: the policy treats rates within `SAME_WITHIN` of the
//! fleet's typical (median) rate as that rate (`policy::typical_rate`), so noise never breaks
//! the tie between identical servers that keeps cold prefixes together.
//!
//! A sample measured in the first-token time the gateway sees instead (tokens it counted
//! ahead, divided by the time to the first token) was tried first and dropped: its count of
//! tokens ahead includes prefills already under way, so a busier server looked faster, drew
//! more traffic and looked faster still (replay, 8 identical H100s: one server's share rose
//! to 24%).

use crate::types::Millis;

/// Samples needed before the learned rate replaces the configured one.
pub const MIN_SAMPLES: u32 = 3;
/// Prefill tokens computed between two samples at least (fewer say little about the rate).
pub const MIN_TOKENS: u64 = 2048;
/// Rates within this factor of the fleet's typical rate count as equal to it.
pub const SAME_WITHIN: f64 = 1.25;
/// A learned rate with no new sample for this long falls back to the configured one.
pub const FORGET_MS: u64 = 60_000;
const ALPHA: f64 = 0.25;
const CLAMP: f64 = 8.0;

#[derive(Clone, Debug, Default, PartialEq)]
pub struct Speed {
    log_rate: Option<f64>,
    samples: u32,
    last: Option<Millis>,
    /// The server's counters (tokens, seconds) where the next sample starts.
    baseline: Option<(f64, f64)>,
}

impl Speed {
    /// A scrape's cumulative prefill counters (see the module note): a sample once enough
    /// tokens were computed since the baseline. A counter that went down (the server
    /// restarted) starts a new baseline.
    pub fn on_counters(&mut self, tokens: Option<f64>, seconds: Option<f64>, prior: f64, now: Millis) {
        let (Some(tokens), Some(seconds)) = (tokens, seconds) else {
            return;
        };
        let Some((t0, s0)) = self.baseline else {
            self.baseline = Some((tokens, seconds));
            return;
        };
        if tokens < t0 || seconds < s0 {
            self.baseline = Some((tokens, seconds));
            return;
        }
        let (dt, ds) = (tokens - t0, seconds - s0);
        if dt < MIN_TOKENS as f64 || ds <= 0.0 {
            return;
        }
        self.baseline = Some((tokens, seconds));
        self.observe(dt as u64, (ds * 1000.0).round().max(1.0) as u64, prior, now);
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

#[cfg(test)]
mod tests {
    use super::*;

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
        assert_eq!(s.baseline, Some((10.0, 0.001)), "a restarted server starts over");
        s.on_counters(None, None, PRIOR, Millis(2400));
        assert_eq!(s.samples, 3, "a server without the counters teaches nothing");
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
}

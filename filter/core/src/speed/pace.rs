//! The work of a prefill by position (`prefill_work`) and how fast first tokens show a
//! server getting through this gateway's prompts (`PrefillPace`).

use super::FORGET_MS;
use crate::types::Millis;

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

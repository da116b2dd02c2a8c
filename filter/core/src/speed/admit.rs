//! How fast a server finishes requests, from its own counter: the growth of
//! `vllm:request_success_total` (summed over its finish reasons, engines and models)
//! between scrapes, over decayed sums. vLLM admits a waiting request when a running one
//! finishes and frees its sequence slot and KV blocks, so where requests wait, this rate
//! is how fast the queue moves: a slot-bound server (every `--max-num-seqs` slot holding a
//! long decode) can have little prefill queued and still keep a new prompt waiting for
//! seconds (`policy::admission_ms`).

use crate::types::Millis;

/// Sums decay with this time constant: long enough to count a few completions on a server
/// of long decodes, short enough to follow a change of load.
const WINDOW_MS: f64 = 10_000.0;

/// Below this many completions in the decayed sum the rate is not known.
const MIN_COMPLETIONS: f64 = 8.0;

/// One server's recent completions (see the module).
#[derive(Clone, Debug, Default)]
pub struct Completions {
    /// The counter and when it was read.
    last: Option<(f64, Millis)>,
    /// Decayed sums: completions, and the ms they came in.
    count: f64,
    ms: f64,
    /// The rate known exactly (a reference that knows every server's truth).
    exact: Option<f64>,
}

impl Completions {
    /// A scrape at `now` read the server's `request_success_total` (`None` when it does not
    /// export it). A counter that went back (the server restarted) starts over.
    pub fn on_counters(&mut self, total: Option<f64>, now: Millis) {
        let Some(total) = total.filter(|t| t.is_finite() && *t >= 0.0) else {
            return;
        };
        match self.last {
            Some((before, at)) if total >= before => {
                let elapsed = now.since(at) as f64;
                let decay = (-elapsed / WINDOW_MS).exp();
                self.count = self.count * decay + (total - before);
                self.ms = self.ms * decay + elapsed;
            }
            _ => (self.count, self.ms) = (0.0, 0.0),
        }
        self.last = Some((total, now));
    }

    /// A rate known exactly, in completions per second.
    pub fn exact(per_s: f64) -> Completions {
        Completions {
            exact: Some(per_s),
            ..Completions::default()
        }
    }

    /// Completions per second over the recent scrapes, or `None` while fewer than
    /// `MIN_COMPLETIONS` are counted (a cold server, or one that no longer finishes any).
    pub fn per_s(&self) -> Option<f64> {
        if self.exact.is_some() {
            return self.exact.filter(|r| *r > 0.0);
        }
        (self.count >= MIN_COMPLETIONS && self.ms > 0.0).then(|| self.count * 1000.0 / self.ms)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_rate_is_the_counters_growth_over_the_time_it_took() {
        let mut c = Completions::default();
        c.on_counters(Some(100.0), Millis(0));
        assert_eq!(c.per_s(), None, "one reading is no rate");
        for i in 1..=10u64 {
            c.on_counters(Some(100.0 + 5.0 * i as f64), Millis(1000 * i));
        }
        let r = c.per_s().expect("50 completions in 10 s");
        assert!((r - 5.0).abs() < 1e-9, "5 per second, read {r}");
    }

    #[test]
    fn a_few_completions_or_a_restart_leave_the_rate_unknown() {
        let mut c = Completions::default();
        c.on_counters(Some(0.0), Millis(0));
        c.on_counters(Some(7.0), Millis(1000));
        assert_eq!(c.per_s(), None, "7 completions are too few");
        c.on_counters(Some(20.0), Millis(2000));
        assert!(c.per_s().is_some());
        c.on_counters(Some(3.0), Millis(3000));
        assert_eq!(c.per_s(), None, "a counter that went back starts over");
        c.on_counters(None, Millis(4000));
        assert_eq!(c.per_s(), None, "a server without the counter has no rate");
    }

    #[test]
    fn old_completions_fade() {
        let mut c = Completions::default();
        c.on_counters(Some(0.0), Millis(0));
        c.on_counters(Some(100.0), Millis(1000));
        let busy = c.per_s().unwrap();
        for i in 2..=60u64 {
            c.on_counters(Some(100.0 + i as f64), Millis(1000 * i));
        }
        let slow = c.per_s().unwrap();
        assert!(slow < busy / 10.0 && slow < 2.0, "{busy} then {slow}");
    }
}

//! How much of a server's traffic the router sees: the prompt tokens it (and its peers)
//! routed there against the prompt tokens the server looked up in its prefix cache
//! (`vllm:prefix_cache_queries_total`). The prefix index only knows what was routed through
//! this router; the rest of a server's traffic (another gateway replica, a client that
//! bypasses the gateway) fills its cache unseen. That share decides how much a cache miss
//! the index did not predict says about what else the server evicted
//! (`Router::learn_from_cached`).
//!
//! The router counts prompts in its own estimate (`request::BYTES_PER_TOKEN`), the server in
//! its tokenizer's tokens; `TokenScale` learns the ratio from vLLM's `usage.prompt_tokens`,
//! so a tokenizer that packs fewer bytes into a token (code, CJK text) does not read as
//! unseen traffic.

use crate::types::{Millis, Tokens};

/// Sums decay with this time constant: long enough to span the queue between routing a
/// request and the server looking up its prefix (seconds at overload), short enough to
/// follow a replica that joins or leaves.
const WINDOW_MS: f64 = 10_000.0;

/// From this unseen share a cache miss counts in full (`SeenShare::miss_weight`). A router
/// that routes all of a server's traffic reads an unseen share of 0 to 0.1 (a preempted
/// request is looked up twice, a scrape splits a queue), 0.36 once in a hundred misses; a
/// second gateway replica makes it about a half.
pub const UNSEEN_FULL: f64 = 0.25;

/// Below this many looked-up tokens in the window the share is not known.
const MIN_QUERIED: f64 = 4_096.0;

/// Past this many estimated tokens `TokenScale` has seen enough to be used.
const MIN_ESTIMATED: f64 = 4_096.0;

/// Each observation weighs the sums down by this much: the ratio follows the last few
/// hundred responses (a change of model or of traffic).
const SCALE_KEEP: f64 = 1.0 - 1.0 / 256.0;

/// Server tokens per estimated token, from the responses that reported `usage.prompt_tokens`.
#[derive(Clone, Debug, Default)]
pub struct TokenScale {
    estimated: f64,
    reported: f64,
}

impl TokenScale {
    /// A response reported `reported` prompt tokens for a prompt estimated at `estimated`.
    pub fn observe(&mut self, estimated: Tokens, reported: u64) {
        if estimated.0 == 0 || reported == 0 {
            return;
        }
        self.estimated = self.estimated * SCALE_KEEP + estimated.0 as f64;
        self.reported = self.reported * SCALE_KEEP + reported as f64;
    }

    /// The ratio, 1 until enough was reported.
    pub fn factor(&self) -> f64 {
        if self.estimated < MIN_ESTIMATED {
            return 1.0;
        }
        self.reported / self.estimated
    }
}

#[derive(Clone, Debug, Default)]
pub struct SeenShare {
    /// Prompt tokens routed here since the last scrape.
    routed: f64,
    /// The server's counter and when it was read.
    last: Option<(f64, Millis)>,
    /// Decayed sums over the recent scrapes.
    seen: f64,
    queried: f64,
}

impl SeenShare {
    /// This router or a peer sent a request of `prompt` tokens here.
    pub fn on_routed(&mut self, prompt: Tokens) {
        self.routed += prompt.0 as f64;
    }

    /// A scrape at `now` read the server's prefix-cache queries counter (`None` when the
    /// server does not export it). A counter that went back (the server restarted) starts
    /// over.
    pub fn on_counters(&mut self, queries: Option<f64>, now: Millis) {
        let Some(total) = queries.filter(|q| q.is_finite() && *q >= 0.0) else {
            return;
        };
        let routed = std::mem::take(&mut self.routed);
        match self.last {
            Some((before, at)) if total >= before => {
                let decay = (-(now.since(at) as f64) / WINDOW_MS).exp();
                self.seen = self.seen * decay + routed;
                self.queried = self.queried * decay + (total - before);
            }
            _ => (self.seen, self.queried) = (0.0, 0.0),
        }
        self.last = Some((total, now));
    }

    /// The share of the server's recent prompt tokens this router did not route (0 to 1), or
    /// `None` while unknown (no counter, or too little traffic to tell); `scale` converts
    /// the router's estimated tokens into the server's (`TokenScale::factor`).
    pub fn unseen(&self, scale: f64) -> Option<f64> {
        (self.queried >= MIN_QUERIED).then(|| (1.0 - scale * self.seen / self.queried).clamp(0.0, 1.0))
    }

    /// How much a cache miss the index did not predict counts (0 to 1): the unseen share
    /// over `UNSEEN_FULL`, in full while the share is unknown.
    pub fn miss_weight(&self, scale: f64) -> f64 {
        self.unseen(scale).map_or(1.0, |u| (u / UNSEEN_FULL).min(1.0))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scrape(s: &mut SeenShare, routed: u64, total: f64, at: u64) {
        s.on_routed(Tokens(routed));
        s.on_counters(Some(total), Millis(at));
    }

    #[test]
    fn a_router_that_routed_all_of_a_servers_traffic_sees_all_of_it() {
        let mut s = SeenShare::default();
        s.on_counters(Some(1_000.0), Millis(0));
        for k in 1..=20u64 {
            scrape(&mut s, 2_000, 1_000.0 + 2_000.0 * k as f64, 100 * k);
        }
        assert_eq!(s.unseen(1.0), Some(0.0));
    }

    #[test]
    fn a_quarter_of_the_traffic_leaves_three_quarters_unseen() {
        let mut s = SeenShare::default();
        s.on_counters(Some(0.0), Millis(0));
        for k in 1..=20u64 {
            scrape(&mut s, 500, 2_000.0 * k as f64, 100 * k);
        }
        let unseen = s.unseen(1.0).unwrap_or(0.0);
        assert!((unseen - 0.75).abs() < 1e-9, "{unseen}");
    }

    #[test]
    fn unknown_without_the_counter_or_with_little_traffic() {
        let mut s = SeenShare::default();
        s.on_routed(Tokens(10_000));
        s.on_counters(None, Millis(100));
        assert_eq!(s.unseen(1.0), None);
        s.on_counters(Some(0.0), Millis(200));
        scrape(&mut s, 100, 100.0, 300);
        assert_eq!(s.unseen(1.0), None);
    }

    #[test]
    fn a_miss_counts_in_proportion_to_the_unseen_share_and_in_full_from_a_quarter() {
        let mut s = SeenShare::default();
        assert_eq!(s.miss_weight(1.0), 1.0);
        s.on_counters(Some(0.0), Millis(0));
        for k in 1..=20u64 {
            scrape(&mut s, 1_900, 2_000.0 * k as f64, 100 * k);
        }
        assert!((s.miss_weight(1.0) - 0.2).abs() < 1e-9, "{}", s.miss_weight(1.0));
        for k in 21..=200u64 {
            scrape(&mut s, 1_000, 2_000.0 * k as f64, 100 * k);
        }
        assert_eq!(s.miss_weight(1.0), 1.0);
    }

    #[test]
    fn a_tokenizer_denser_than_the_estimate_is_not_unseen_traffic() {
        let mut s = SeenShare::default();
        s.on_counters(Some(0.0), Millis(0));
        let mut scale = TokenScale::default();
        assert_eq!(scale.factor(), 1.0);
        // The server counts 1.25 tokens for each estimated one (CJK text, code).
        for k in 1..=20u64 {
            scrape(&mut s, 1_600, 2_000.0 * k as f64, 100 * k);
            scale.observe(Tokens(1_600), 2_000);
        }
        assert!((s.unseen(1.0).unwrap_or(0.0) - 0.2).abs() < 1e-9);
        assert!((scale.factor() - 1.25).abs() < 1e-9, "{}", scale.factor());
        assert_eq!(s.unseen(scale.factor()), Some(0.0));
    }

    #[test]
    fn a_restarted_server_starts_over() {
        let mut s = SeenShare::default();
        s.on_counters(Some(0.0), Millis(0));
        scrape(&mut s, 0, 50_000.0, 100);
        assert_eq!(s.unseen(1.0), Some(1.0));
        scrape(&mut s, 0, 10.0, 200);
        assert_eq!(s.unseen(1.0), None);
    }
}

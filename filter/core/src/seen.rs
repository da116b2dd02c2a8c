//! How much of a server's traffic the router sees: the prompt tokens of the requests it and
//! its peers (the workers and replicas it shares with) had served there, against all the
//! prompt tokens the server served (`vllm:prompt_tokens_total`). The prefix index only
//! knows what went through those routers; the rest of a server's traffic (a replica that
//! does not share, a client that bypasses the gateway) fills its cache unseen. That share
//! decides how much a cache miss the index did not predict says about what else the server
//! evicted (`Router::learn_from_cached`).
//!
//! Both sides count a prompt when its first token comes, as vLLM does: counted when routed,
//! a fleet running past its capacity (routed faster than served) would read as seen beyond
//! all its traffic, and vLLM's `prefix_cache_queries_total` counts a prompt again at every
//! step it waits for KV room. The router counts prompts in its own estimate
//! (`request::BYTES_PER_TOKEN`), the server in its tokenizer's tokens: each server's ratio
//! of the two is learned from its responses' `usage.prompt_tokens`, so a tokenizer that
//! packs fewer bytes into a token (code, CJK text) does not read as unseen traffic.

use crate::types::{Millis, Tokens};

/// Sums decay with this time constant: long enough to span a prefill, short enough to
/// follow a replica that joins or leaves.
const WINDOW_MS: f64 = 10_000.0;

/// Below this many served tokens in the window the share is not known.
const MIN_SERVED: f64 = 4_096.0;

/// From this unseen share a cache miss counts in full (`SeenShare::miss_weight`). A router
/// that sees all of a server's traffic reads 0 to 0.1 (a scrape splits a request's first
/// token from its count), a second replica that does not share about a half (replay).
pub const UNSEEN_FULL: f64 = 0.25;

/// Past this many estimated tokens the learned token ratio is used.
const MIN_ESTIMATED: f64 = 4_096.0;

/// Each reported response weighs the ratio's sums down by this much: it follows the last
/// few hundred responses.
const SCALE_KEEP: f64 = 1.0 - 1.0 / 256.0;

/// One server's traffic as this router saw it (see the module).
#[derive(Clone, Debug, Default)]
pub struct SeenShare {
    /// Estimated prompt tokens of requests that got their first token here since the last
    /// scrape.
    served: f64,
    /// The server's counter and when it was read.
    last: Option<(f64, Millis)>,
    /// Decayed sums over the recent scrapes: this router's estimate, the server's count.
    seen: f64,
    counted: f64,
    /// Reported ÷ estimated prompt tokens of this router's responses from here, decayed.
    estimated: f64,
    reported: f64,
}

impl SeenShare {
    /// A request this router or a peer sent here, of `prompt` estimated tokens, got its
    /// first token (or completed without one being seen).
    pub fn on_served(&mut self, prompt: Tokens) {
        self.served += prompt.0 as f64;
    }

    /// A response from here reported `reported` prompt tokens for a prompt estimated at
    /// `estimated`.
    pub fn on_reported(&mut self, estimated: Tokens, reported: u64) {
        if estimated.0 == 0 || reported == 0 {
            return;
        }
        self.estimated = self.estimated * SCALE_KEEP + estimated.0 as f64;
        self.reported = self.reported * SCALE_KEEP + reported as f64;
    }

    /// A scrape at `now` read the server's `prompt_tokens_total` (`None` when it does not
    /// export it). A counter that went back (the server restarted) starts over.
    pub fn on_counters(&mut self, total: Option<f64>, now: Millis) {
        let Some(total) = total.filter(|t| t.is_finite() && *t >= 0.0) else {
            return;
        };
        let served = std::mem::take(&mut self.served);
        match self.last {
            Some((before, at)) if total >= before => {
                let decay = (-(now.since(at) as f64) / WINDOW_MS).exp();
                self.seen = self.seen * decay + served;
                self.counted = self.counted * decay + (total - before);
            }
            _ => (self.seen, self.counted) = (0.0, 0.0),
        }
        self.last = Some((total, now));
    }

    /// Server tokens per estimated token, 1 until enough was reported.
    pub fn token_scale(&self) -> f64 {
        if self.estimated < MIN_ESTIMATED {
            return 1.0;
        }
        self.reported / self.estimated
    }

    /// What this router saw of the server's recent prompt tokens, in the server's tokens
    /// (1 = all of it; above 1 only by the estimate's error), or `None` while unknown (no
    /// counter, or too little traffic to tell).
    pub fn seen_fraction(&self) -> Option<f64> {
        (self.counted >= MIN_SERVED).then(|| self.token_scale() * self.seen / self.counted)
    }

    /// The share of the server's recent prompt tokens this router did not see (0 to 1).
    pub fn unseen(&self) -> Option<f64> {
        self.seen_fraction().map(|f| (1.0 - f).clamp(0.0, 1.0))
    }

    /// How much a cache miss the index did not predict counts (0 to 1): the unseen share
    /// over `UNSEEN_FULL`, in full while the share is unknown.
    pub fn miss_weight(&self) -> f64 {
        self.unseen().map_or(1.0, |u| (u / UNSEEN_FULL).min(1.0))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Serves `mine` estimated tokens here, then a scrape at `at` reads `total`.
    fn scrape(s: &mut SeenShare, mine: u64, total: f64, at: u64) {
        s.on_served(Tokens(mine));
        s.on_counters(Some(total), Millis(at));
    }

    #[test]
    fn a_router_that_routed_all_of_a_servers_traffic_sees_all_of_it() {
        let mut s = SeenShare::default();
        s.on_counters(Some(1_000.0), Millis(0));
        for k in 1..=20u64 {
            scrape(&mut s, 2_000, 1_000.0 + 2_000.0 * k as f64, 100 * k);
        }
        assert_eq!(s.seen_fraction(), Some(1.0));
        assert_eq!(s.unseen(), Some(0.0));
        assert_eq!(s.miss_weight(), 0.0);
    }

    #[test]
    fn a_quarter_of_the_traffic_leaves_three_quarters_unseen() {
        let mut s = SeenShare::default();
        s.on_counters(Some(0.0), Millis(0));
        for k in 1..=20u64 {
            scrape(&mut s, 500, 2_000.0 * k as f64, 100 * k);
        }
        let unseen = s.unseen().unwrap_or(0.0);
        assert!((unseen - 0.75).abs() < 1e-9, "{unseen}");
    }

    #[test]
    fn unknown_without_the_counter_or_with_little_traffic() {
        let mut s = SeenShare::default();
        s.on_served(Tokens(10_000));
        s.on_counters(None, Millis(100));
        assert_eq!(s.unseen(), None);
        assert_eq!(s.miss_weight(), 1.0);
        s.on_counters(Some(0.0), Millis(200));
        scrape(&mut s, 100, 100.0, 300);
        assert_eq!(s.unseen(), None);
    }

    #[test]
    fn a_miss_counts_in_proportion_to_the_unseen_share_and_in_full_from_a_quarter() {
        let mut s = SeenShare::default();
        s.on_counters(Some(0.0), Millis(0));
        for k in 1..=20u64 {
            scrape(&mut s, 1_900, 2_000.0 * k as f64, 100 * k);
        }
        assert!((s.miss_weight() - 0.2).abs() < 1e-9, "{}", s.miss_weight());
        for k in 21..=200u64 {
            scrape(&mut s, 1_000, 2_000.0 * k as f64, 100 * k);
        }
        assert_eq!(s.miss_weight(), 1.0);
    }

    #[test]
    fn a_tokenizer_denser_than_the_estimate_is_not_unseen_traffic() {
        let mut s = SeenShare::default();
        s.on_counters(Some(0.0), Millis(0));
        assert_eq!(s.token_scale(), 1.0);
        // The server counts 1.25 tokens for each estimated one (CJK text, code).
        for k in 1..=20u64 {
            scrape(&mut s, 1_600, 2_000.0 * k as f64, 100 * k);
            if k == 3 {
                let unseen = s.unseen().unwrap_or(0.0);
                assert!((unseen - 0.2).abs() < 1e-9, "before enough reports: {unseen}");
            }
            s.on_reported(Tokens(1_600), 2_000);
        }
        assert!((s.token_scale() - 1.25).abs() < 1e-9, "{}", s.token_scale());
        assert!((s.seen_fraction().unwrap_or(0.0) - 1.0).abs() < 1e-9);
    }

    #[test]
    fn a_restarted_server_starts_over() {
        let mut s = SeenShare::default();
        s.on_counters(Some(0.0), Millis(0));
        scrape(&mut s, 0, 50_000.0, 100);
        assert_eq!(s.unseen(), Some(1.0));
        scrape(&mut s, 0, 10.0, 200);
        assert_eq!(s.unseen(), None);
    }
}

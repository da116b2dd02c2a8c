//! How many POSTs a worker may make of its own placements (`share.replicas.from_workers`):
//! a token bucket of `from_workers_per_s` a second, at most a second's worth saved.
//!
//! Why a bucket: a POST costs its sender and its receiver about what a proxied request does
//! (BENCHMARKS.md, "The workers' POSTs, bounded"), and with every prompt a new prefix a
//! worker would make one per request per other replica. The bucket bounds that cost at any
//! request rate; news past it leaves with the scraping service's batch instead. A segment
//! for more replicas than a second's worth may still go once the bucket is full, and its
//! cost is owed (the bucket goes below zero), so the rate stays `per_s` at any replica count
//! instead of the workers never sending. Time is a parameter; a clock that steps back
//! refills nothing.

use kvroute_core::Millis;

#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PostBudget {
    per_s: f64,
    /// POSTs left; below zero while a segment for more replicas than `per_s` is paid off.
    left: f64,
    at: Option<Millis>,
}

impl PostBudget {
    pub fn new(per_s: u32) -> PostBudget {
        let per_s = f64::from(per_s);
        PostBudget {
            per_s,
            left: per_s,
            at: None,
        }
    }

    /// The POSTs left at `now`.
    fn left_at(&self, now: Millis) -> f64 {
        let elapsed_ms = self.at.map_or(0, |at| now.0.saturating_sub(at.0));
        (self.left + elapsed_ms as f64 * self.per_s / 1000.0).min(self.per_s)
    }

    /// Whether a segment costing `posts` POSTs may go at `now`: the bucket holds them, or
    /// is full when they are more than a second's worth.
    pub fn covers(&self, posts: usize, now: Millis) -> bool {
        self.left_at(now) >= (posts as f64).min(self.per_s)
    }

    /// Spends `posts` POSTs made at `now`.
    pub fn spend(&mut self, posts: usize, now: Millis) {
        self.left = self.left_at(now) - posts as f64;
        self.at = Some(self.at.map_or(now, |at| Millis(at.0.max(now.0))));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_workers_post_budget_allows_a_seconds_burst_then_its_rate() {
        let mut b = PostBudget::new(100);
        assert!(b.covers(100, Millis(5_000)));
        b.spend(100, Millis(5_000));
        assert!(!b.covers(1, Millis(5_000)), "spent");
        assert!(!b.covers(1, Millis(5_009)), "9 ms give 0.9 of a POST");
        assert!(b.covers(1, Millis(5_010)) && !b.covers(2, Millis(5_010)));
        b.spend(1, Millis(5_010));
        assert!(b.covers(100, Millis(60_000)), "a second saved");
        b.spend(60, Millis(60_000));
        assert!(
            !b.covers(41, Millis(60_000)) && b.covers(40, Millis(60_000)),
            "at most a second saved"
        );
    }

    #[test]
    fn a_clock_that_steps_back_refills_nothing() {
        let mut b = PostBudget::new(100);
        b.spend(100, Millis(60_000));
        assert!(!b.covers(1, Millis(59_000)));
        assert!(!b.covers(1, Millis(60_005)));
        assert!(b.covers(1, Millis(60_010)));
    }

    #[test]
    fn more_replicas_than_a_seconds_posts_go_when_the_bucket_is_full_at_the_same_rate() {
        let mut b = PostBudget::new(5);
        assert!(b.covers(8, Millis(0)), "a full bucket sends to all 8");
        b.spend(8, Millis(0));
        // 8 POSTs owed at 5 a second: full again after 1.6 s, not 1 s.
        assert!(!b.covers(8, Millis(1_000)));
        assert!(!b.covers(8, Millis(1_599)));
        assert!(b.covers(8, Millis(1_600)));
    }
}

//! The fleet-size search: the smallest size in `1..=max` that passes a test, when each test
//! is a replay lasting seconds to minutes and passing is only roughly monotonic in size.
//!
//! Doubling (1, 2, 4, …, `max`) finds a passing size, bisection between the last failing
//! and the first passing size narrows it to `n` with `n − 1` failing, and a confirmation
//! step tests `n + 1`: a fleet one server larger must pass too, or the pass at `n` was one
//! lucky arrival pattern. When `n + 1` fails, the search goes on above it (doubling steps,
//! then bisection again) and says that a larger size was needed. Every size is tested at
//! most once; a size below the first pass that doubling skipped is never tested, so an
//! isolated pass there can go unseen: the answer is the smallest size the search confirmed.

use std::collections::BTreeMap;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// `servers` passes, `servers − 1` fails (or is 0) and `servers + 1` passes (or is past
    /// `max`). `larger_needed`: a smaller size passed but the size after it failed.
    Met { servers: usize, larger_needed: bool },
    /// No confirmed passing size up to `max`.
    NotMet,
}

/// What the search found and every size it tested, in the order tested.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Search {
    pub outcome: Outcome,
    pub tested: Vec<(usize, bool)>,
}

/// Remembers every test so no size is replayed twice.
struct Memo<'a> {
    test: &'a mut dyn FnMut(usize) -> bool,
    seen: BTreeMap<usize, bool>,
    order: Vec<(usize, bool)>,
}

impl Memo<'_> {
    fn passes(&mut self, n: usize) -> bool {
        if let Some(p) = self.seen.get(&n) {
            return *p;
        }
        let p = (self.test)(n);
        self.seen.insert(n, p);
        self.order.push((n, p));
        p
    }

    fn done(self, outcome: Outcome) -> Search {
        Search {
            outcome,
            tested: self.order,
        }
    }
}

/// The smallest confirmed size in `1..=max` for which `test` passes (see the module note).
pub fn smallest(max: usize, test: &mut dyn FnMut(usize) -> bool) -> Search {
    let mut m = Memo {
        test,
        seen: BTreeMap::new(),
        order: Vec::new(),
    };
    if max == 0 {
        return m.done(Outcome::NotMet);
    }
    // `lo` failed (0: nothing below 1), `hi` passed.
    let (mut lo, mut hi) = match first_pass_above(&mut m, 0, max) {
        Some(bounds) => bounds,
        None => return m.done(Outcome::NotMet),
    };
    let mut larger_needed = false;
    loop {
        while hi - lo > 1 {
            let mid = lo + (hi - lo) / 2;
            if m.passes(mid) {
                hi = mid;
            } else {
                lo = mid;
            }
        }
        if hi >= max || m.passes(hi + 1) {
            return m.done(Outcome::Met {
                servers: hi,
                larger_needed,
            });
        }
        larger_needed = true;
        (lo, hi) = match first_pass_above(&mut m, hi + 1, max) {
            Some(bounds) => bounds,
            None => return m.done(Outcome::NotMet),
        };
    }
}

/// Doubling steps above `failed` (a failing size, or 0): the last failing size tested and
/// the first passing one, or `None` when nothing up to `max` passes.
fn first_pass_above(m: &mut Memo, failed: usize, max: usize) -> Option<(usize, usize)> {
    let (mut lo, mut step) = (failed, 1);
    loop {
        let n = if failed == 0 { step } else { failed + step }.min(max);
        if m.passes(n) {
            return Some((lo, n));
        }
        if n >= max {
            return None;
        }
        lo = n;
        step *= 2;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn search(max: usize, passes: impl Fn(usize) -> bool) -> Search {
        smallest(max, &mut |n| passes(n))
    }

    #[test]
    fn a_monotonic_test_finds_the_threshold_and_its_predecessor_failed() {
        for threshold in 1..=40 {
            let s = search(64, |n| n >= threshold);
            assert_eq!(
                s.outcome,
                Outcome::Met {
                    servers: threshold,
                    larger_needed: false
                },
                "threshold {threshold}"
            );
            let seen = |n| s.tested.iter().find(|(m, _)| *m == n).map(|(_, p)| *p);
            assert!(
                threshold == 1 || seen(threshold - 1) == Some(false),
                "{threshold}: n − 1 tested"
            );
            assert_eq!(seen(threshold + 1), Some(true), "{threshold}: n + 1 confirmed");
        }
    }

    #[test]
    fn the_search_tests_few_sizes_and_none_twice() {
        let s = search(64, |n| n >= 23);
        let mut sizes: Vec<usize> = s.tested.iter().map(|(n, _)| *n).collect();
        assert!(sizes.len() <= 12, "{sizes:?}");
        sizes.sort_unstable();
        sizes.dedup();
        assert_eq!(sizes.len(), s.tested.len(), "no size tested twice");
    }

    #[test]
    fn a_lucky_pass_whose_successor_fails_is_not_the_answer() {
        // 12 passes by luck, 13–15 fail, 16 and up pass.
        let s = search(64, |n| n == 12 || n >= 16);
        assert_eq!(
            s.outcome,
            Outcome::Met {
                servers: 16,
                larger_needed: true
            }
        );
    }

    #[test]
    fn nothing_passing_up_to_max_is_not_met_and_max_was_tested() {
        let s = search(64, |_| false);
        assert_eq!(s.outcome, Outcome::NotMet);
        assert_eq!(s.tested.last(), Some(&(64, false)));
        let s = search(10, |_| false);
        assert_eq!(
            s.tested.iter().map(|(n, _)| *n).collect::<Vec<_>>(),
            vec![1, 2, 4, 8, 10]
        );
    }

    #[test]
    fn passing_only_at_max_is_met_without_testing_past_it() {
        let s = search(20, |n| n == 20);
        assert_eq!(
            s.outcome,
            Outcome::Met {
                servers: 20,
                larger_needed: false
            }
        );
        assert!(s.tested.iter().all(|(n, _)| *n <= 20));
    }

    #[test]
    fn an_isolated_pass_with_nothing_above_it_is_not_met() {
        let s = search(16, |n| n == 6);
        assert_eq!(s.outcome, Outcome::NotMet);
    }

    #[test]
    fn one_server_enough_is_found_at_once() {
        let s = search(64, |_| true);
        assert_eq!(
            s.outcome,
            Outcome::Met {
                servers: 1,
                larger_needed: false
            }
        );
        assert_eq!(s.tested, vec![(1, true), (2, true)]);
    }

    proptest::proptest! {
        /// Any pass/fail pattern, monotonic or not.
        #[test]
        fn the_answer_is_a_confirmed_pass_and_every_size_is_tested_once_within_range(
            pattern in proptest::collection::vec(proptest::bool::ANY, 1..100)
        ) {
            let max = pattern.len();
            let s = search(max, |n| pattern[n - 1]);
            let mut sizes: Vec<usize> = s.tested.iter().map(|(n, _)| *n).collect();
            sizes.sort_unstable();
            sizes.dedup();
            proptest::prop_assert_eq!(sizes.len(), s.tested.len());
            proptest::prop_assert!(sizes.iter().all(|n| (1..=max).contains(n)));
            proptest::prop_assert!(s.tested.iter().all(|(n, p)| pattern[n - 1] == *p));
            let seen = |n: usize| s.tested.iter().find(|(m, _)| *m == n).map(|(_, p)| *p);
            match s.outcome {
                Outcome::Met { servers, larger_needed } => {
                    proptest::prop_assert_eq!(seen(servers), Some(true));
                    proptest::prop_assert!(servers == 1 || seen(servers - 1) == Some(false));
                    proptest::prop_assert!(servers == max || seen(servers + 1) == Some(true));
                    let smaller_passed = s.tested.iter().any(|(n, p)| *n < servers && *p);
                    proptest::prop_assert_eq!(larger_needed, smaller_passed);
                }
                Outcome::NotMet => proptest::prop_assert_eq!(seen(max), Some(false)),
            }
        }
    }

    #[test]
    fn zero_max_tests_nothing() {
        let s = search(0, |_| true);
        assert_eq!(s.outcome, Outcome::NotMet);
        assert!(s.tested.is_empty());
    }
}

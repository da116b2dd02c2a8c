//! How fast a server finishes requests, and whether its waiting requests wait for one to
//! finish. The rate is the growth of `vllm:request_success_total` (summed over its finish
//! reasons, engines and models) between scrapes, over decayed sums. vLLM admits a waiting
//! request while a sequence slot (`--max-num-seqs`), the step's token budget and KV blocks
//! allow. Where the slots are what holds it, it is admitted only as running requests
//! finish, so this rate is how fast the queue moves: a server whose slots all hold long
//! decodes has little prefill queued and still keeps a new prompt waiting for seconds
//! (`policy::admission_ms`).
//!
//! Slot-bound is told from the scrapes (`pinned`): requests waited at the last two, and at
//! both the number running was at least `MIN_SLOTS` and within 1/32 of the most ever seen
//! there, and the server has finished at least that many since the router first read it (a
//! server still filling has not met its ceiling: its highest so far is no ceiling, and
//! requests that arrived during a step are caught waiting at two scrapes in a row; counted,
//! they cost shared-prefix at 50% on 8 H100s 0.5–0.8% of TTFT p95, lower in none of 30
//! replicas) (the slots are not
//! exported; a slot-bound server keeps that many running, each freed slot refilled at
//! once). Waiting alone is no sign: a burst that the token budget holds back clears as
//! prefill proceeds, whatever the completion rate, and counting it cost like fleets TTFT
//! p95 (replay, 8 H100s: Mooncake 130% +44%, Azure 50% +12%, rag 80% +20%). A server of
//! several engines (data parallel) reports their sum: it reads as slot-bound only when
//! all of them are.

use crate::types::Millis;

/// Sums decay with this time constant: long enough to count a few completions on a server
/// of long decodes, short enough to follow a change of load.
const WINDOW_MS: f64 = 10_000.0;

/// Below this many completions in the decayed sum the rate is not known. A server that
/// finishes fewer than one a second or so is never charged the wait, though there it is
/// longest: reading it as finishing one in the window at best (once the sums span 5 s)
/// cost untiered chat at 100 req/s on 4 A100 + 4 H100 (replay, seeds 3–5: 88.0 / 87.4 /
/// 88.5 → 88.0 / 84.0 / 85.0%).
const MIN_COMPLETIONS: f64 = 8.0;

/// Fewer running than this is no full set of sequence slots (vLLM's `--max-num-seqs`
/// defaults to 256 or more): a few requests waiting beside a few running are a burst the
/// token budget holds back. Without it, a lightly loaded server of 4 H100s in a burst read
/// as slot-bound beside one running twice as many, and the end-to-end test of two
/// unshared replicas failed 2 runs in 10 (a server's unseen share read 845).
const MIN_SLOTS: u64 = 32;

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
    /// The last scrape's running and waiting requests.
    queue: Option<(u64, u64)>,
    /// Slot-bound at the last scrape (`pinned`).
    pinned: bool,
    /// The most requests seen running at once since the server (re)started.
    most_running: u64,
    /// Completions counted since the first reading (or the restart).
    finished: f64,
}

impl Completions {
    /// A scrape at `now` read the server's `request_success_total` (`None` when it does not
    /// export it, or not as a number: the rate is forgotten). A counter that went back (the
    /// server restarted) starts over, its queue and its most running too.
    pub fn on_counters(&mut self, total: Option<f64>, now: Millis) {
        let Some(total) = total.filter(|t| t.is_finite() && *t >= 0.0) else {
            (self.last, self.count, self.ms) = (None, 0.0, 0.0);
            return;
        };
        match self.last {
            Some((before, at)) if total >= before => {
                let elapsed = now.since(at) as f64;
                let decay = (-elapsed / WINDOW_MS).exp();
                self.count = self.count * decay + (total - before);
                self.finished += total - before;
                self.ms = self.ms * decay + elapsed;
            }
            _ => {
                (self.count, self.ms, self.most_running, self.finished) = (0.0, 0.0, 0, 0.0);
                (self.queue, self.pinned) = (None, false);
            }
        }
        self.last = Some((total, now));
    }

    /// A scrape read `running` requests running and `waiting` waiting (after its counter,
    /// `on_counters`).
    pub fn on_queue(&mut self, running: u64, waiting: u64) {
        self.most_running = self.most_running.max(running);
        // Within 1/32 of the most: a completion or two between a step and the scrape.
        let full = |r: u64| r >= MIN_SLOTS && r + self.most_running / 32 >= self.most_running;
        self.pinned = waiting > 0
            && self.finished >= self.most_running as f64
            && full(running)
            && self.queue.is_some_and(|(r, w)| w > 0 && full(r));
        self.queue = Some((running, waiting));
    }

    /// Whether the server is slot-bound: requests waited at the last two scrapes with about
    /// the most requests it ever ran running (see the module). Always with an exact rate.
    pub fn pinned(&self) -> bool {
        self.pinned || self.exact.is_some()
    }

    /// A rate known exactly, in completions per second.
    pub fn exact(per_s: f64) -> Completions {
        Completions {
            exact: Some(per_s),
            ..Completions::default()
        }
    }

    /// Completions per second over the recent scrapes, or `None` while fewer than
    /// `MIN_COMPLETIONS` are counted (a cold server, or one that finishes few).
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
        assert_eq!(c.per_s(), None, "7 completions in a second are too few");
        c.on_counters(Some(20.0), Millis(2000));
        assert!(c.per_s().is_some());
        c.on_counters(Some(3.0), Millis(3000));
        assert_eq!(c.per_s(), None, "a counter that went back starts over");
        c.on_counters(Some(30.0), Millis(4000));
        assert!(c.per_s().is_some());
        c.on_counters(None, Millis(5000));
        assert_eq!(c.per_s(), None, "a counter that went missing forgets the rate");
        c.on_counters(Some(30.0), Millis(6000));
        assert_eq!(c.per_s(), None, "and starts over when it comes back");
    }

    #[test]
    fn only_a_queue_held_at_the_most_running_reads_as_slot_bound() {
        let mut c = Completions::default();
        // A server that has finished more requests than it ever ran at once (below).
        c.on_counters(Some(0.0), Millis(0));
        c.on_counters(Some(1000.0), Millis(1000));
        let scrapes = |c: &mut Completions, queue: &[(u64, u64)]| -> Vec<bool> {
            queue
                .iter()
                .map(|(r, w)| {
                    c.on_queue(*r, *w);
                    c.pinned()
                })
                .collect()
        };
        // A few running and a few waiting, at its most: a burst on a lightly loaded server.
        assert_eq!(scrapes(&mut c, &[(3, 2), (3, 2), (4, 1)]), [false; 3]);
        // A burst: requests wait at one scrape, then the token budget admits them.
        assert_eq!(scrapes(&mut c, &[(40, 0), (90, 6), (120, 0)]), [false; 3]);
        // Every one of 256 slots taken: waiting at two scrapes, running held at the most.
        assert_eq!(
            scrapes(&mut c, &[(256, 3), (255, 5), (256, 9), (250, 4)]),
            [false, true, true, true],
            "within 1/32 of 256"
        );
        // Running falls well below the most while requests wait: the KV cache holds them.
        assert_eq!(scrapes(&mut c, &[(200, 7), (180, 9)]), [false, false]);
        assert_eq!(scrapes(&mut c, &[(256, 2), (256, 0)]), [false, false], "nothing waits");
        // A restart (its counter went back) forgets the most running and the last queue:
        // slot-bound again only after two scrapes of its own.
        c.on_counters(Some(1000.0), Millis(0));
        assert_eq!(scrapes(&mut c, &[(256, 3)]), [false]);
        c.on_counters(Some(100.0), Millis(1000));
        c.on_counters(Some(200.0), Millis(2000));
        assert_eq!(scrapes(&mut c, &[(64, 3), (64, 4)]), [false, true]);
    }

    #[test]
    fn a_server_still_filling_is_not_slot_bound_until_a_full_set_has_finished() {
        let mut c = Completions::default();
        let scrape = |c: &mut Completions, finished: f64, at: u64, queue: (u64, u64)| {
            c.on_counters(Some(finished), Millis(at));
            c.on_queue(queue.0, queue.1);
            c.pinned()
        };
        // 54 running at their highest so far, with requests caught waiting at two scrapes:
        // the fleet is filling (30 of them finished since the first reading), not full.
        assert!(!scrape(&mut c, 0.0, 0, (40, 1)));
        assert!(!scrape(&mut c, 20.0, 200, (54, 2)));
        assert!(!scrape(&mut c, 30.0, 400, (54, 2)), "fewer finished than ever ran");
        // Once as many have finished as ever ran at once, the highest is a ceiling.
        assert!(!scrape(&mut c, 50.0, 600, (54, 1)));
        assert!(scrape(&mut c, 60.0, 800, (54, 3)));
        // A restart counts again from its own first reading.
        assert!(!scrape(&mut c, 2.0, 1000, (54, 3)));
        assert!(!scrape(&mut c, 20.0, 1200, (54, 3)));
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

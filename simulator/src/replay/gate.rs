//! The gateway's hold queues in the replay (`overload.hold`).

use kvroute_core::hold::{Admit, HoldQueue};
use kvroute_core::Config;

use super::events::{Kind, Queue};

/// The gateway's side of `overload.hold` in the replay: the held requests (one queue per
/// gateway, at its first router's index, or one per router with `hold_per_worker`), each
/// with the router that holds it, which is woken by its tick (`share.tick_ms`, as the
/// filter's worker tick) while it holds any.
pub(super) struct Gate {
    /// `(request, the router holding it)`.
    pub(super) holds: Vec<HoldQueue<(usize, usize)>>,
    /// Requests each router holds.
    pub(super) owned: Vec<usize>,
    pub(super) due: Vec<bool>,
    pub(super) held_ms: Vec<f64>,
    /// `(request, held since, answered 429 at)`.
    pub(super) rejected: Vec<(usize, f64, f64)>,
    /// Each request's wait bound (`RawHold::wait_bound_ms` of its objective).
    bounds: Vec<u64>,
    tick_ms: f64,
    tenants: Vec<String>,
    priorities: Vec<i64>,
}

impl Gate {
    pub(super) fn new(config: &Config, routers: usize, classes: &[(i64, u32)], objectives: &[Option<f64>]) -> Gate {
        let hold = &config.overload().hold;
        let requests = classes.len();
        Gate {
            holds: (0..routers)
                .map(|_| {
                    let mut q = HoldQueue::new(hold.max_requests, hold.priority_weight);
                    q.set_newest_first(hold.newest_first_after_ms);
                    q
                })
                .collect(),
            owned: vec![0; routers],
            due: vec![false; routers],
            held_ms: vec![0.0; requests],
            rejected: Vec::new(),
            bounds: objectives.iter().map(|o| hold.wait_bound_ms(*o)).collect(),
            tick_ms: config.share().tick_ms.max(1) as f64,
            tenants: classes.iter().map(|c| c.1.to_string()).collect(),
            priorities: classes.iter().map(|c| c.0).collect(),
        }
    }

    /// Router `r` holds request `i` in queue `queue`.
    pub(super) fn hold(&mut self, q: &mut Queue, queue: usize, r: usize, i: usize, now: f64) {
        let since = kvroute_core::Millis(now as u64);
        match self.holds[queue].push((i, r), self.priorities[i], &self.tenants[i], since) {
            Admit::Held => self.owned[r] += 1,
            Admit::Displaced(h) => {
                self.owned[r] += 1;
                self.owned[h.item.1] -= 1;
                self.reject(h.item.0, h.since.0 as f64, now);
            }
            Admit::Refused((i, _)) => self.reject(i, now, now),
        }
        self.tick(q, r, now);
    }

    /// Answers 429 every request of queue `queue` past the wait bound.
    pub(super) fn expire(&mut self, queue: usize, now: f64) {
        let bounds = &self.bounds;
        for h in self.holds[queue].expire(kvroute_core::Millis(now as u64), |(i, _)| bounds[*i]) {
            self.owned[h.item.1] -= 1;
            self.reject(h.item.0, h.since.0 as f64, now);
        }
    }

    /// The head of queue `queue` leaves it, released.
    pub(super) fn take_head(&mut self, queue: usize) {
        if let Some(h) = self.holds[queue].pop() {
            self.owned[h.item.1] -= 1;
        }
    }

    pub(super) fn reject(&mut self, i: usize, since: f64, now: f64) {
        self.rejected.push((i, since, now));
    }

    /// Wakes router `r` at its next tick while it holds anything.
    pub(super) fn tick(&mut self, q: &mut Queue, r: usize, now: f64) {
        if self.owned[r] > 0 && !self.due[r] {
            self.due[r] = true;
            q.push(now + self.tick_ms, Kind::Release(r));
        }
    }
}

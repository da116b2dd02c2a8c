//! The classic load balancers: round-robin, seeded random, least outstanding requests (ties
//! at random, as Envoy's least_request does with equal weights), and power of two choices.

use super::{argmin_random, members, Incoming, Outstanding, Policy, Rng};
use crate::engine::{Engine, Finished};

#[derive(Default)]
pub struct RoundRobin(usize);

impl Policy for RoundRobin {
    fn pick(&mut self, req: &Incoming, servers: &[Engine], _: f64) -> usize {
        for _ in 0..servers.len() {
            self.0 = (self.0 + 1) % servers.len();
            if req.pool.get(self.0).copied().unwrap_or(false) {
                break;
            }
        }
        self.0
    }
}

pub struct Random(Rng);

impl Random {
    pub fn new(seed: u64) -> Random {
        Random(Rng::new(seed))
    }
}

impl Policy for Random {
    fn pick(&mut self, req: &Incoming, _: &[Engine], _: f64) -> usize {
        let pool = members(req.pool);
        pool.get(self.0.below(pool.len())).copied().unwrap_or(0)
    }
}

pub struct LeastRequest {
    outstanding: Outstanding,
    rng: Rng,
}

impl LeastRequest {
    pub fn new(servers: usize, seed: u64) -> LeastRequest {
        LeastRequest {
            outstanding: Outstanding::new(servers),
            rng: Rng::new(seed),
        }
    }
}

impl Policy for LeastRequest {
    fn pick(&mut self, req: &Incoming, _: &[Engine], _: f64) -> usize {
        let s = argmin_random(self.outstanding.get(), req.pool, &mut self.rng);
        self.outstanding.sent(s);
        s
    }
    fn on_finished(&mut self, s: usize, _: &Finished, _: f64) {
        self.outstanding.done(s);
    }
}

pub struct PowerOfTwo {
    outstanding: Outstanding,
    rng: Rng,
}

impl PowerOfTwo {
    pub fn new(servers: usize, seed: u64) -> PowerOfTwo {
        PowerOfTwo {
            outstanding: Outstanding::new(servers),
            rng: Rng::new(seed),
        }
    }
}

impl Policy for PowerOfTwo {
    fn pick(&mut self, req: &Incoming, _: &[Engine], _: f64) -> usize {
        let pool = members(req.pool);
        let n = pool.len();
        let a = self.rng.below(n);
        let b = if n > 1 { (a + 1 + self.rng.below(n - 1)) % n } else { a };
        let (a, b) = (pool.get(a).copied().unwrap_or(0), pool.get(b).copied().unwrap_or(0));
        let load = self.outstanding.get();
        let s = if load[b] < load[a] { b } else { a };
        self.outstanding.sent(s);
        s
    }
    fn on_finished(&mut self, s: usize, _: &Finished, _: f64) {
        self.outstanding.done(s);
    }
}

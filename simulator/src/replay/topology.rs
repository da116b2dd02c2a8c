//! The gateway topology in the replay: `gateways` replicas (separate Envoy processes behind
//! one Service) × `workers` Envoy worker threads each, every one an independent router with
//! its own state, as a production gateway runs.
//!
//! How a real deployment spreads and times things, and how the replay copies it:
//! - Arrivals: a Kubernetes Service spreads connections across replicas and the kernel
//!   spreads them across a replica's workers. The replay's workloads carry no connection or
//!   session, so each request picks a replica and then a worker at random (seeded): the
//!   least favourable spread for affinity, since nothing keeps related requests together.
//! - Scrapes: each replica scrapes on its own (phases spread over the interval; within 5 ms
//!   of each other when replicas exchange placements, which makes the filter align scrapes
//!   on the clock); each worker applies its replica's snapshot at its own tick after it was
//!   taken.
//! - Sharing: with `share_workers`, the workers of one replica exchange peer events
//!   (`kvroute_core::peer`) as the filter does: a worker flushes its events at its next tick,
//!   and a peer applies them at its first tick after that.
//! - Replicas share nothing unless `share_gateways` models a cross-replica exchange of the
//!   same peer events: a replica's events leave at the sender's flush and reach every other
//!   replica `gateway_delay_ms` later (one network hop, batching included), where each worker
//!   applies them at its next tick. Nothing else crosses: each replica keeps its own scrapes.

use kvroute_core::{Config, PeerEvent};

/// How far apart replicas that align their scrapes on the clock still take them.
const ALIGNED_SPREAD_MS: f64 = 5.0;

use crate::policies::{Policy, PolicyName, Rng};

#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Topology {
    pub gateways: usize,
    pub workers: usize,
    /// The workers of one gateway share placements and load (kvroute's filter does).
    pub share_workers: bool,
    /// The workers' tick: when they flush and apply peer events and apply snapshots.
    pub tick_ms: f64,
    /// Replicas exchange peer events too (a modelled cross-replica protocol).
    pub share_gateways: bool,
    /// How long a flushed event takes to reach another replica (with `gateway_interval_ms`,
    /// the network hop only).
    pub gateway_delay_ms: f64,
    /// 0: every flush leaves for the other replicas at once (`gateway_delay_ms` holds all the
    /// delay). Otherwise the filter's forwarding (`share.replicas.at_once`): the replica's
    /// scraping service reads the log every `SERVICE_TICK_MS` and sends a batch at the first
    /// tick that finds a placement; other events leave this long after its last batch (at a
    /// tick too).
    pub gateway_interval_ms: f64,
    /// With `gateway_interval_ms`: a worker's batch holding a placement that is news leaves
    /// for the other replicas when the worker writes it (the filter's
    /// `share.replicas.from_workers`: the worker POSTs it itself), not at the scraping
    /// service's next tick; the rest still leaves with the service's batches.
    pub direct_placements: bool,
    /// With `direct_placements`: the most POSTs a worker makes a second, a second's worth
    /// saved (`share.replicas.from_workers_per_s`, 20 by default as there); a batch holding
    /// news costs one per other replica, and one past the budget leaves with the service's
    /// batches.
    pub direct_per_s: f64,
    /// 0: a worker's events leave at its next tick. Otherwise only a batch holding a
    /// placement that is news (most of its prompt uncached where it went) leaves then; the
    /// rest leave on this slower grid, to the gateway's other workers and (with
    /// `gateway_interval_ms`) to the other replicas: the filter's `share.hits_on_tick`, whose
    /// worker writes what is not news to the log at its tick (`share.tick_ms`).
    pub news_flush_ms: f64,
    /// With `news_flush_ms`: a batch holding a placement also leaves at once when the
    /// router's last batch left over two `news_flush_ms` before (the filter's rate limit on
    /// `hits_on_tick`: a quiet worker publishes a hit at once, a busy one on its tick).
    pub hits_when_quiet: bool,
    /// A worker reads its peers' events at most once per wall-clock millisecond before its
    /// decisions (the filter's `share.on_request`): an event reaching a worker that already
    /// read in that millisecond waits for the next one (`Routers::deciding`, `unread_until`).
    pub read_once_per_ms: bool,
    /// The gateway restarts then: every router is rebuilt with nothing learned, while the
    /// fleet keeps its caches, queues and counters (`Routers::restart`).
    pub restart_at_ms: Option<f64>,
    /// Held requests (`overload.hold`) wait in one queue per worker instead of one per
    /// gateway. By default, as in the filter, a gateway's workers hold their requests in one
    /// queue (the Envoy process's board) and each worker releases its own when they reach
    /// the head; per-worker queues are the filter's earlier design, kept to compare.
    pub hold_per_worker: bool,
}

/// The scraping service's tick with `share.replicas.at_once`: batches leave on it.
const SERVICE_TICK_MS: f64 = 1.0;

impl Default for Topology {
    fn default() -> Self {
        Topology {
            gateways: 1,
            workers: 1,
            share_workers: true,
            tick_ms: 10.0,
            share_gateways: false,
            gateway_delay_ms: 0.0,
            gateway_interval_ms: 0.0,
            direct_placements: false,
            direct_per_s: 20.0,
            news_flush_ms: 0.0,
            hits_when_quiet: false,
            read_once_per_ms: false,
            restart_at_ms: None,
            hold_per_worker: false,
        }
    }
}

impl std::fmt::Display for Topology {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if let Some(t) = self.restart_at_ms {
            write!(f, "restarted at {} s, ", t / 1000.0)?;
        }
        if self.routers() == 1 {
            return f.write_str("one router");
        }
        write!(f, "{} gateways × {} workers", self.gateways, self.workers)?;
        if self.workers > 1 {
            let how = if self.share_workers { "shared" } else { "unshared" };
            write!(f, ", workers {how} at a {} ms tick", self.tick_ms)?;
        }
        if self.hold_per_worker && self.workers > 1 {
            f.write_str(", one hold queue per worker")?;
        }
        if self.gateways > 1 && self.share_gateways {
            if self.gateway_interval_ms > 0.0 {
                let by = if self.direct_placements {
                    format!(" (news from the workers, {} POSTs/s each)", self.direct_per_s)
                } else {
                    String::new()
                };
                write!(
                    f,
                    ", replicas shared: placements at once{by}, the rest every {} ms, {} ms hop",
                    self.gateway_interval_ms, self.gateway_delay_ms
                )?;
            } else {
                write!(f, ", replicas shared after {} ms", self.gateway_delay_ms)?;
            }
        }
        Ok(())
    }
}

impl Topology {
    pub fn routers(&self) -> usize {
        self.gateways.max(1) * self.workers.max(1)
    }

    pub fn gateway_of(&self, router: usize) -> usize {
        router / self.workers.max(1)
    }

    /// The index of the hold queue a request arriving at `router` waits in: its gateway's
    /// (at the gateway's first router), or its own with `hold_per_worker`.
    pub fn hold_queue_of(&self, router: usize) -> usize {
        if self.hold_per_worker {
            router
        } else {
            self.gateway_of(router) * self.workers.max(1)
        }
    }

    /// When gateway `g` takes its first scrape. Isolated replicas are not in step (phases
    /// spread over the interval); replicas that exchange placements scrape on the clock's
    /// multiples of the interval, as the filter does with `share.replicas`, so their phases
    /// differ only by clock skew and the 5 ms tick that notices the boundary
    /// (`ALIGNED_SPREAD_MS`, spread evenly).
    pub fn scrape_phase_ms(&self, g: usize, interval_ms: f64) -> f64 {
        let spread = if self.share_gateways {
            ALIGNED_SPREAD_MS.min(interval_ms)
        } else {
            interval_ms
        };
        spread * g as f64 / self.gateways.max(1) as f64
    }

    /// The first tick of `router` at or after `t`: ticks of one gateway's workers are spread
    /// evenly over the tick period.
    pub fn next_tick_ms(&self, router: usize, t: f64) -> f64 {
        let w = router % self.workers.max(1);
        let phase = self.tick_ms * (w as f64 + 0.5) / self.workers.max(1) as f64;
        let k = ((t - phase) / self.tick_ms).ceil().max(0.0);
        phase + k * self.tick_ms
    }

    /// When a peer event `from` makes at `t` reaches `to`: `from`'s next flush, the hop to
    /// another replica if `to` is on one, then `to`'s next tick after it.
    pub fn peer_delivery_ms(&self, from: usize, to: usize, t: f64) -> f64 {
        let mut flushed = self.next_tick_ms(from, t);
        if self.gateway_of(from) != self.gateway_of(to) {
            flushed += self.gateway_delay_ms;
        }
        self.next_tick_ms(to, flushed + 1e-6)
    }

    /// Peers of `router` that receive its events: its replica's other workers when workers
    /// share, every other replica's routers when replicas share.
    pub fn peers(&self, router: usize) -> impl Iterator<Item = usize> + '_ {
        let w = self.workers.max(1);
        let g = self.gateway_of(router);
        let workers = self.share_workers && w > 1;
        let replicas = self.share_gateways && self.gateways > 1;
        (0..self.routers()).filter(move |r| *r != router && if self.gateway_of(*r) == g { workers } else { replicas })
    }

    /// `router`'s peer origin: unique among all routers it may exchange events with.
    pub fn origin(&self, router: usize) -> u32 {
        let local = if self.share_gateways {
            router
        } else {
            router % self.workers.max(1)
        };
        1 + local as u32
    }
}

/// What every router of the topology is built from.
struct Build {
    policy: PolicyName,
    servers: usize,
    capacity_blocks: u64,
    seed: u64,
    config: Config,
}

impl Build {
    fn routers(&self, topology: Topology) -> Vec<Box<dyn Policy>> {
        let split = if topology.share_workers {
            topology.workers.max(1)
        } else {
            1
        };
        (0..topology.routers())
            .map(|r| {
                let seed = self.seed.wrapping_add(r as u64);
                let mut p = self
                    .policy
                    .build(self.servers, self.capacity_blocks, seed, &self.config, split);
                if topology.peers(r).next().is_some() {
                    p.share_with_peers(topology.origin(r));
                }
                p
            })
            .collect()
    }
}

/// Every router of the topology, and which one routed each request.
pub struct Routers {
    pub topology: Topology,
    pub all: Vec<Box<dyn Policy>>,
    /// How the routers are built (again at a restart).
    build: Build,
    owner: Vec<usize>,
    /// How many restarts there were, and how many before each request was routed: a router
    /// hears only of the requests it routed itself, as a restarted Envoy would.
    restarts: u32,
    routed_after: Vec<u32>,
    spread: Rng,
    /// When each replica last forwarded a batch to the others.
    last_forward: Vec<f64>,
    /// When each router's last batch left (`Topology::hits_when_quiet`).
    last_flush: Vec<f64>,
    /// When each router last read its peers before a decision (`Topology::read_once_per_ms`).
    last_read: Vec<f64>,
    /// Each router's POSTs left, and when they were counted (`Topology::direct_per_s`).
    direct_budget: Vec<(f64, f64)>,
}

impl Routers {
    pub fn new(
        topology: Topology,
        policy: PolicyName,
        servers: usize,
        capacity_blocks: u64,
        seed: u64,
        config: &Config,
        requests: usize,
    ) -> Routers {
        let build = Build {
            policy,
            servers,
            capacity_blocks,
            seed,
            config: config.clone(),
        };
        Routers {
            topology,
            all: build.routers(topology),
            build,
            owner: vec![0; requests],
            restarts: 0,
            routed_after: vec![0; requests],
            spread: Rng::new(seed ^ 0x7070),
            last_forward: vec![f64::NEG_INFINITY; topology.gateways.max(1)],
            last_flush: vec![f64::NEG_INFINITY; topology.routers()],
            last_read: vec![f64::NEG_INFINITY; topology.routers()],
            direct_budget: vec![(topology.direct_per_s, f64::NEG_INFINITY); topology.routers()],
        }
    }

    /// Whether `router`'s POST budget covers a batch to every other replica at `now` (as
    /// the filter's `PostBudget`: a full bucket covers more replicas than a second's worth,
    /// and the rest is owed); if so it is spent.
    fn spend_direct(&mut self, router: usize, now: f64) -> bool {
        let (per_s, posts) = (
            self.topology.direct_per_s,
            self.topology.gateways.saturating_sub(1) as f64,
        );
        let Some((left, at)) = self.direct_budget.get_mut(router) else {
            return false;
        };
        let elapsed_ms = if at.is_finite() { (now - *at).max(0.0) } else { 0.0 };
        *left = (*left + elapsed_ms * per_s / 1000.0).min(per_s);
        *at = at.max(now);
        if *left < posts.min(per_s) {
            return false;
        }
        *left -= posts;
        true
    }

    /// Every router learns the pool now.
    pub fn on_pool(&mut self, pool: &[bool], now_ms: f64) {
        for r in &mut self.all {
            r.on_pool(pool, now_ms);
        }
    }

    /// The gateway restarted: every router starts over as built (nothing learned, no
    /// index, no in-flight requests). The first tokens and completions of requests routed
    /// before never reach the new routers (`routed_here`).
    pub fn restart(&mut self) {
        self.all = self.build.routers(self.topology);
        self.restarts += 1;
        self.last_flush.fill(f64::NEG_INFINITY);
        self.last_read.fill(f64::NEG_INFINITY);
    }

    /// Request `i` is being routed now (at its arrival, or when a held request is sent).
    pub fn routing(&mut self, i: usize) {
        if let Some(r) = self.routed_after.get_mut(i) {
            *r = self.restarts;
        }
    }

    /// Whether request `i` was routed by the routers running now (not before a restart).
    pub fn routed_here(&self, i: usize) -> bool {
        self.routed_after.get(i).is_none_or(|r| *r == self.restarts)
    }

    /// Picks the router request `i` arrives at (replica, then worker, at random).
    pub fn assign(&mut self, i: usize) -> usize {
        let n = self.topology.routers();
        let r = if n == 1 { 0 } else { self.spread.below(n) };
        self.routed_by(i, r);
        self.routing(i);
        r
    }

    /// Router `r` is about to route a request: it reads its peers unless it read within
    /// this millisecond already (`Topology::read_once_per_ms`).
    pub fn deciding(&mut self, r: usize, now: f64) {
        if let Some(last) = self.last_read.get_mut(r) {
            if last.floor() != now.floor() {
                *last = now;
            }
        }
    }

    /// With `read_once_per_ms`: an event reaching router `r` at `now` after it already read
    /// its peers in this millisecond waits for the next one (returned).
    pub fn unread_until(&self, r: usize, now: f64) -> Option<f64> {
        let read = self.last_read.get(r)?;
        (self.topology.read_once_per_ms && read.floor() == now.floor() && now.fract() > 0.0).then(|| now.ceil())
    }

    /// Request `i` is routed by router `r`: its first tokens and completions go to `r` (the
    /// router it arrived at, or the one whose hold queue released it).
    pub fn routed_by(&mut self, i: usize, r: usize) {
        if let Some(o) = self.owner.get_mut(i) {
            *o = r;
        }
    }

    pub fn owner(&self, i: usize) -> usize {
        self.owner.get(i).copied().unwrap_or(0)
    }

    /// The events `router` produced since the last call, and which peers get them when.
    pub fn outgoing(&mut self, router: usize, now: f64) -> (Vec<PeerEvent>, Vec<(usize, f64)>) {
        let events = self.all[router].take_peer_events();
        if events.is_empty() {
            return (events, Vec::new());
        }
        let to = self.arrivals(router, now, &events);
        (events, to)
    }

    /// When each peer of `router` has `events`, flushed at `now`.
    fn arrivals(&mut self, router: usize, now: f64, events: &[PeerEvent]) -> Vec<(usize, f64)> {
        let t = self.topology;
        let g = t.gateway_of(router);
        let news = events.iter().any(PeerEvent::is_news);
        let placement = events.iter().any(|e| matches!(e, PeerEvent::Routed { .. }));
        // The filter: nothing published for over two ticks, in whole milliseconds (one more).
        let quiet = t.hits_when_quiet && placement && now - self.last_flush[router] >= 2.0 * t.news_flush_ms + 1.0;
        // When the batch is in the process's log: at the worker's next tick, or with
        // `news_flush_ms` (what is not news) on that slower grid.
        let held = (t.news_flush_ms > 0.0 && !news && !quiet).then(|| {
            let w = router % t.workers.max(1);
            let phase = t.news_flush_ms * (w as f64 + 0.5) / t.workers.max(1) as f64;
            phase + ((now - phase) / t.news_flush_ms).ceil().max(0.0) * t.news_flush_ms
        });
        self.last_flush[router] = self.last_flush[router].max(held.unwrap_or(now));
        let forwarded = t.gateway_interval_ms > 0.0 && t.share_gateways;
        let flushed = held.unwrap_or_else(|| t.next_tick_ms(router, now));
        let direct = forwarded && t.direct_placements && news && self.spend_direct(router, flushed);
        let leaves = forwarded.then(|| {
            // The service sends everything it holds in one batch (`replicas::Forwarder`): a
            // placement at once; the rest with the batch already due, else `interval` after
            // the last one (not `interval` after every earlier batch, which queued events
            // seconds deep at 200 requests/s). News from the workers does not wait for the
            // service at all, while their budget lasts.
            if direct {
                return flushed;
            }
            let earliest = if placement {
                flushed
            } else if self.last_forward[g] >= flushed {
                self.last_forward[g]
            } else {
                flushed.max(self.last_forward[g] + t.gateway_interval_ms)
            };
            // The service's ticks, each replica on its own phase.
            let phase = SERVICE_TICK_MS * g as f64 / t.gateways.max(1) as f64;
            let at = phase + ((earliest - phase) / SERVICE_TICK_MS).ceil() * SERVICE_TICK_MS;
            self.last_forward[g] = self.last_forward[g].max(at);
            at
        });
        t.peers(router)
            .map(|peer| match (leaves, held) {
                (Some(at), _) if t.gateway_of(peer) != g => {
                    (peer, t.next_tick_ms(peer, at + t.gateway_delay_ms + 1e-6))
                }
                (_, Some(at)) if t.gateway_of(peer) == g => (peer, t.next_tick_ms(peer, at + 1e-6)),
                _ => (peer, t.peer_delivery_ms(router, peer, now)),
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn build(topology: Topology) -> Routers {
        Routers::new(
            topology,
            PolicyName::Kvroute,
            4,
            1000,
            0,
            &Config::from_json(b"{}").unwrap(),
            8,
        )
    }

    /// A placement of a 10-token prompt, `uncached` of it uncached where it went.
    fn routed(key: u64, uncached: u64) -> PeerEvent {
        PeerEvent::Routed {
            key,
            endpoint: kvroute_core::EndpointId::new("10.0.0.1:8000"),
            blocks: vec![],
            prompt_tokens: kvroute_core::Tokens(10),
            uncached: kvroute_core::Tokens(uncached),
            at: kvroute_core::Millis(0),
        }
    }

    #[test]
    fn a_gateways_hold_queue_is_at_its_first_worker_unless_each_holds_its_own() {
        let t = Topology {
            gateways: 2,
            workers: 4,
            ..Topology::default()
        };
        let queues = |t: Topology| (0..8).map(|r| t.hold_queue_of(r)).collect::<Vec<_>>();
        assert_eq!(queues(t), vec![0, 0, 0, 0, 4, 4, 4, 4]);
        let per_worker = Topology {
            hold_per_worker: true,
            ..t
        };
        assert_eq!(queues(per_worker), (0..8).collect::<Vec<_>>());
    }

    /// 2 replicas × 4 workers forwarding as the filter does, news from the workers.
    fn news_from_the_workers() -> Topology {
        Topology {
            gateways: 2,
            workers: 4,
            share_gateways: true,
            gateway_interval_ms: 5.0,
            gateway_delay_ms: 0.25,
            tick_ms: 0.01,
            news_flush_ms: 2.0,
            direct_placements: true,
            ..Topology::default()
        }
    }

    #[test]
    fn news_from_the_workers_leaves_with_their_flush_and_hits_with_the_service() {
        let mut routers = build(news_from_the_workers());
        let remote = |to: &[(usize, f64)]| to.iter().find(|(r, _)| *r == 5).map(|(_, at)| *at).unwrap();
        let at = remote(&routers.arrivals(0, 99.6, &[routed(2, 10)]));
        assert!(
            (99.85..99.9).contains(&at),
            "news: the worker's flush, the hop, the receiver's tick: {at}"
        );
        let at = remote(&routers.arrivals(0, 99.6, &[routed(3, 1)]));
        assert!(
            (101.25..101.3).contains(&at),
            "a hit: its worker's flush (100.25), then the service's tick: {at}"
        );
    }

    #[test]
    fn news_past_a_workers_post_budget_waits_for_the_service() {
        let mut routers = build(Topology {
            direct_per_s: 2.0,
            ..news_from_the_workers()
        });
        let remote = |to: &[(usize, f64)]| to.iter().find(|(r, _)| *r == 5).map(|(_, at)| *at).unwrap();
        for k in 0..2 {
            let at = remote(&routers.arrivals(0, 99.6, &[routed(2 + k, 10)]));
            assert!((99.85..99.9).contains(&at), "news {k} within the budget: {at}");
        }
        let at = remote(&routers.arrivals(0, 99.6, &[routed(4, 10)]));
        assert!(
            (100.25..100.3).contains(&at),
            "the third: the service's next tick (100), then the hop: {at}"
        );
        let at = remote(&routers.arrivals(1, 99.6, &[routed(5, 10)]));
        assert!((99.85..99.9).contains(&at), "another worker has its own budget: {at}");
        let at = remote(&routers.arrivals(0, 600.0, &[routed(6, 10)]));
        assert!(at < 600.3, "half a second later worker 0 has a POST again: {at}");
    }

    #[test]
    fn ticks_are_spread_and_delivery_takes_a_flush_and_a_read() {
        let t = Topology {
            gateways: 2,
            workers: 4,
            share_workers: true,
            tick_ms: 10.0,
            ..Topology::default()
        };
        assert_eq!(t.next_tick_ms(0, 0.0), 1.25);
        assert_eq!(t.next_tick_ms(3, 0.0), 8.75);
        assert_eq!(t.next_tick_ms(0, 1.3), 11.25);
        let d = t.peer_delivery_ms(0, 1, 0.0);
        assert!(d > 1.25 && d <= 1.25 + 10.0, "{d}");
        assert!(t.peer_delivery_ms(1, 0, 0.0) <= 20.0);
        assert_eq!(
            t.peers(5).collect::<Vec<_>>(),
            vec![4, 6, 7],
            "only the same gateway's workers"
        );
        let alone = Topology {
            share_workers: false,
            ..t
        };
        assert_eq!(alone.peers(5).count(), 0);
        let replicas = Topology {
            share_gateways: true,
            gateway_delay_ms: 20.0,
            ..t
        };
        assert_eq!(replicas.peers(5).count(), 7, "every other router");
        assert_ne!(replicas.origin(1), replicas.origin(5), "origins unique across replicas");
        let leading = Topology {
            gateway_interval_ms: 5.0,
            gateway_delay_ms: 0.25,
            tick_ms: 0.01,
            ..replicas
        };
        let mut routers = build(leading);
        let placed = routed(1, 10);
        let first_token = PeerEvent::FirstToken { key: 1, ttft: None };
        let remote = |to: &[(usize, f64)]| to.iter().find(|(r, _)| *r == 5).map(|(_, at)| *at).unwrap();
        let at = remote(&routers.arrivals(0, 99.6, std::slice::from_ref(&placed)));
        assert!(
            (100.25..100.3).contains(&at),
            "a placement leaves at the service's next ms tick: {at}"
        );
        let at = remote(&routers.arrivals(1, 100.5, &[placed]));
        assert!((101.25..101.3).contains(&at), "the next one at the tick after: {at}");
        let at = remote(&routers.arrivals(2, 101.2, &[first_token]));
        assert!((106.25..106.3).contains(&at), "the rest waits for the interval: {at}");
        let at = remote(&routers.arrivals(3, 102.0, &[PeerEvent::FirstToken { key: 2, ttft: None }]));
        assert!((106.25..106.3).contains(&at), "and more of it joins that batch: {at}");
        let at = remote(&routers.arrivals(3, 107.0, &[PeerEvent::FirstToken { key: 3, ttft: None }]));
        assert!((111.25..111.3).contains(&at), "after it left, the next interval: {at}");
        // Hits on the tick: a hit reaches the log (and so the service) only at its worker's
        // flush; news leaves as before.
        let flushing = Topology {
            news_flush_ms: 2.0,
            ..leading
        };
        let mut routers = build(flushing);
        let news = routed(2, 10);
        let hit = routed(3, 1);
        let at = remote(&routers.arrivals(0, 99.6, std::slice::from_ref(&news)));
        assert!((100.25..100.3).contains(&at), "news leaves at once: {at}");
        let at = remote(&routers.arrivals(0, 99.6, std::slice::from_ref(&hit)));
        assert!(
            (101.25..101.3).contains(&at),
            "a hit waits for its worker's flush (100.25), then the service's tick: {at}"
        );
        // Reading once per millisecond: a worker that read at 10.2 sees an event of 10.5 at 11;
        // one that has not read in that millisecond, at once.
        let one = Topology {
            gateways: 1,
            workers: 3,
            tick_ms: 0.01,
            read_once_per_ms: true,
            ..Topology::default()
        };
        let mut routers = build(one);
        routers.deciding(0, 10.2);
        routers.deciding(0, 10.4);
        assert_eq!(routers.unread_until(0, 10.5), Some(11.0), "read at 10.2: waits for 11");
        assert_eq!(routers.unread_until(2, 10.5), None, "not read yet in this millisecond");
        assert_eq!(routers.unread_until(0, 11.0), None, "the next millisecond");
        routers.deciding(2, 10.7);
        assert_eq!(
            routers.unread_until(2, 10.9),
            Some(11.0),
            "a read after the event was sent counts"
        );
        // Quiet workers' hits: at once when the worker's last batch left over two flush
        // periods (+ 1 ms) before, else on the flush grid.
        let quiet = Topology {
            hits_when_quiet: true,
            ..flushing
        };
        let mut routers = build(quiet);
        let at = remote(&routers.arrivals(0, 99.6, std::slice::from_ref(&hit)));
        assert!(
            (100.25..100.3).contains(&at),
            "a quiet worker's hit leaves at once: {at}"
        );
        let at = remote(&routers.arrivals(0, 100.0, std::slice::from_ref(&hit)));
        assert!((101.25..101.3).contains(&at), "one that just published waits: {at}");
        let at = remote(&routers.arrivals(0, 106.3, &[hit]));
        assert!((107.25..107.3).contains(&at), "quiet again 6.3 ms later: {at}");
        let near = replicas.peer_delivery_ms(0, 1, 0.0);
        let far = replicas.peer_delivery_ms(0, 5, 0.0);
        assert!((21.25..=31.25).contains(&far), "a flush, 20 ms, a tick: {far}");
        assert!(near < far);
    }
}

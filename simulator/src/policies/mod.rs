//! Routing policies the replay compares on one workload. Each is a [`Policy`]: it picks a
//! server for a request, and hears about scrapes and completions. Baselines are written
//! from their published algorithms; `kvroute` runs `kvroute-core` with the filter's JSON
//! config; `oracle` sees every server's real cache and queue.

mod baselines;
mod cache_aware;
mod kvroute;

use std::fmt;

pub use baselines::{LeastRequest, PowerOfTwo, Random, RoundRobin};
pub use cache_aware::{DynamoKv, GieWeighted, Oracle, SglangCacheAware};
pub use kvroute::{endpoint_id, Kvroute};

use kvroute_core::{Config, PeerEvent, VllmMetrics};

use crate::engine::{Engine, Finished};

/// A request at routing time: its canonical text (what a gateway sees) and its engine view.
pub struct Incoming<'a> {
    pub id: u64,
    pub body: &'a [u8],
    pub canonical: &'a [u8],
    pub prompt_tokens: u64,
    pub engine_blocks: &'a [u64],
    /// The servers in the pool now (`pool[s]`, one entry per server; one missing counts as
    /// out): a policy picks only among them. Servers join and leave mid-run in the replay
    /// (`replay::PoolChange`); every router learns of a change at once, as from its discovery.
    pub pool: &'a [bool],
    /// The TTFT objective it sends (kvroute's objective header), if any.
    pub ttft_objective_ms: Option<f64>,
}

/// The indices of the servers in `pool`, in order.
pub fn members(pool: &[bool]) -> Vec<usize> {
    (0..pool.len()).filter(|s| pool[*s]).collect()
}

/// What a policy does with a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pick {
    Server(usize),
    /// Every server is full: keep it at the gateway and ask again at the next tick.
    Hold,
    /// Every server is full and the request may be shed: answer 429.
    Shed,
}

pub trait Policy {
    /// Picks a server index in `0..servers.len()`. `servers` is the real fleet: only the
    /// oracle and the KV-event-driven Dynamo router may look inside it.
    fn pick(&mut self, req: &Incoming, servers: &[Engine], now_ms: f64) -> usize;
    /// `pick`, for a policy that may also hold a request at the gateway or shed it when the
    /// fleet is full (`sheddable`: its priority is negative). Others always pick.
    fn admit(&mut self, req: &Incoming, servers: &[Engine], now_ms: f64, _sheddable: bool) -> Pick {
        Pick::Server(self.pick(req, servers, now_ms))
    }
    /// A scrape of server `s` at `now_ms` (metrics as a router would parse them).
    fn on_scrape(&mut self, _s: usize, _metrics: &VllmMetrics, _text: &str, _now_ms: f64) {}
    /// Request `id` produced its first token on server `s`.
    fn on_first_token(&mut self, _s: usize, _id: u64, _now_ms: f64) {}
    fn on_finished(&mut self, _s: usize, _f: &Finished, _now_ms: f64) {}
    /// Share state with the other routers of one gateway process (Envoy workers), as peer
    /// `origin`. Policies that cannot share ignore it and route on their own state.
    fn share_with_peers(&mut self, _origin: u32) {}
    /// What peers must learn since the last call.
    fn take_peer_events(&mut self) -> Vec<PeerEvent> {
        Vec::new()
    }
    fn on_peer_event(&mut self, _event: &PeerEvent, _now_ms: f64) {}
    /// The pool changed (a server joined or left): what a router with per-endpoint state
    /// learns from its discovery. `Incoming::pool` carries the same at every pick.
    fn on_pool(&mut self, _pool: &[bool], _now_ms: f64) {}
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, clap::ValueEnum)]
pub enum PolicyName {
    RoundRobin,
    Random,
    LeastRequest,
    PowerOfTwo,
    GieWeighted,
    SglangCacheAware,
    DynamoKv,
    Kvroute,
    Oracle,
}

impl fmt::Display for PolicyName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            PolicyName::RoundRobin => "round-robin",
            PolicyName::Random => "random",
            PolicyName::LeastRequest => "least-request",
            PolicyName::PowerOfTwo => "power-of-two",
            PolicyName::GieWeighted => "gie-weighted",
            PolicyName::SglangCacheAware => "sglang-cache-aware",
            PolicyName::DynamoKv => "dynamo-kv",
            PolicyName::Kvroute => "kvroute",
            PolicyName::Oracle => "oracle",
        })
    }
}

impl PolicyName {
    /// How often this policy's router reads the servers' metrics: `configured` (the
    /// replay's `--scrape-interval-ms`, kvroute's default 200 ms), but the Gateway API
    /// Inference Extension's endpoint picker refreshes every 50 ms by default
    /// (`pkg/epp/server/options.go`) and `smg` polls its workers' load every 10 s
    /// (`--load-monitor-interval`): each is judged at its own default.
    pub fn scrape_interval_ms(self, configured: f64) -> f64 {
        match self {
            PolicyName::GieWeighted => GIE_REFRESH_MS,
            PolicyName::SglangCacheAware => SMG_LOAD_POLL_MS,
            _ => configured,
        }
    }

    pub fn all() -> Vec<PolicyName> {
        use PolicyName::*;
        vec![
            RoundRobin,
            Random,
            LeastRequest,
            PowerOfTwo,
            GieWeighted,
            SglangCacheAware,
            DynamoKv,
            Kvroute,
            Oracle,
        ]
    }

    /// A fresh policy for a fleet of `servers` servers of `capacity_blocks` 16-token blocks;
    /// `budget_split` routers share kvroute's configured index budget (1 for one router).
    pub fn build(
        self,
        servers: usize,
        capacity_blocks: u64,
        seed: u64,
        config: &Config,
        budget_split: usize,
    ) -> Box<dyn Policy> {
        match self {
            PolicyName::RoundRobin => Box::new(RoundRobin::default()),
            PolicyName::Random => Box::new(Random::new(seed)),
            PolicyName::LeastRequest => Box::new(LeastRequest::new(servers, seed)),
            PolicyName::PowerOfTwo => Box::new(PowerOfTwo::new(servers, seed)),
            PolicyName::GieWeighted => Box::new(GieWeighted::new(servers, capacity_blocks, seed)),
            PolicyName::SglangCacheAware => Box::new(SglangCacheAware::new(servers)),
            PolicyName::DynamoKv => Box::new(DynamoKv::new(servers, seed)),
            PolicyName::Kvroute => Box::new(Kvroute::new(servers, config, budget_split)),
            PolicyName::Oracle => Box::new(Oracle::new(servers, config)),
        }
    }
}

/// The endpoint picker's default metrics refresh (`gie-weighted`).
const GIE_REFRESH_MS: f64 = 50.0;
/// `smg`'s default load poll (`sglang-cache-aware`).
const SMG_LOAD_POLL_MS: f64 = 10_000.0;

/// A seeded generator for policies that break ties or sample (SplitMix64).
#[derive(Clone, Debug)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed ^ 0x9e37_79b9_7f4a_7c15)
    }
    pub fn below(&mut self, n: usize) -> usize {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        (kvroute_core::policy::mix(self.0) % n.max(1) as u64) as usize
    }
}

/// Index of the minimum of `keys` among the servers in `pool`, ties broken by `rng` among
/// equals.
pub fn argmin_random<K: PartialOrd + Copy>(keys: &[K], pool: &[bool], rng: &mut Rng) -> usize {
    let mut best: Vec<usize> = Vec::new();
    for (i, k) in keys
        .iter()
        .enumerate()
        .filter(|(i, _)| pool.get(*i).copied().unwrap_or(false))
    {
        match best.first().map(|b| keys[*b]) {
            None => best.push(i),
            Some(b) if *k < b => best = vec![i],
            Some(b) if *k == b => best.push(i),
            _ => {}
        }
    }
    best.get(rng.below(best.len())).copied().unwrap_or(0)
}

/// Router-side count of requests sent to each server and not yet finished.
#[derive(Clone, Debug)]
pub struct Outstanding(Vec<u64>);

impl Outstanding {
    pub fn new(servers: usize) -> Outstanding {
        Outstanding(vec![0; servers])
    }
    pub fn sent(&mut self, s: usize) {
        self.0[s] += 1;
    }
    pub fn done(&mut self, s: usize) {
        self.0[s] = self.0[s].saturating_sub(1);
    }
    pub fn get(&self) -> &[u64] {
        &self.0
    }
}

/// An approximate per-server prefix index of chained block hashes with LRU eviction:
/// what GIE's prefix plugin and SGLang's approximate radix tree keep router-side.
#[derive(Clone, Debug)]
pub struct ApproxIndex {
    servers: Vec<(
        std::collections::HashMap<u64, u64>,
        std::collections::BTreeMap<u64, u64>,
    )>,
    capacity: usize,
    tick: u64,
    /// A prompt's blocks are recorded last to first, so its head is the most recently used
    /// and goes last (a radix tree evicts leaves first: SGLang's); otherwise first to last,
    /// so its head goes first (GIE's prefix plugin adds them to its LRU in prompt order).
    keep_head: bool,
}

impl ApproxIndex {
    pub fn new(servers: usize, capacity: usize, keep_head: bool) -> ApproxIndex {
        ApproxIndex {
            servers: vec![Default::default(); servers],
            capacity: capacity.max(1),
            tick: 0,
            keep_head,
        }
    }

    /// Leading blocks of `blocks` that server `s` holds.
    pub fn matched(&self, s: usize, blocks: &[u64]) -> usize {
        blocks.iter().take_while(|b| self.servers[s].0.contains_key(b)).count()
    }

    pub fn insert(&mut self, s: usize, blocks: &[u64]) {
        let (map, lru) = &mut self.servers[s];
        let order: Box<dyn Iterator<Item = &u64>> = if self.keep_head {
            Box::new(blocks.iter().rev())
        } else {
            Box::new(blocks.iter())
        };
        for b in order {
            self.tick += 1;
            if let Some(old) = map.insert(*b, self.tick) {
                lru.remove(&old);
            }
            lru.insert(self.tick, *b);
        }
        while map.len() > self.capacity {
            if let Some((_, b)) = lru.pop_first() {
                map.remove(&b);
            }
        }
    }
}

/// Chained hashes of `chunk`-byte runs of `text` (router-side prefix blocks).
pub fn chunk_hashes(text: &[u8], chunk: usize) -> Vec<u64> {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    text.chunks_exact(chunk)
        .map(|c| {
            for b in c {
                h = (h ^ u64::from(*b)).wrapping_mul(0x100_0000_01b3);
            }
            h = kvroute_core::policy::mix(h);
            h
        })
        .collect()
}

#[cfg(test)]
mod tests;

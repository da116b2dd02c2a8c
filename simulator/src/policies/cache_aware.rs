//! Cache-aware baselines, each from its published algorithm, plus the oracle.
//!
//! - `gie-weighted`: the Gateway API Inference Extension's default scheduling profile:
//!   queue scorer (min-max normalised waiting requests), KV-cache scorer (1 − usage), prefix
//!   scorer (matched / total 64-character blocks, at most 256, from an LRU index of 31,250
//!   blocks per server recorded at routing time), weights 2 / 2 / 3, highest score wins
//!   (ties at random). Metrics come from the scrapes, as stale as the interval makes them.
//! - `sglang-cache-aware`: SGLang's router: if the fleet is imbalanced (max − min
//!   outstanding > 64 and max > 1.5 × min) the least loaded server; otherwise the server whose
//!   approximate radix tree matches the most of the prompt if that is over half of it, else
//!   the server with the smallest tree. The tree is approximated by 16-token text blocks.
//! - `dynamo-kv`: NVIDIA Dynamo's KV router: cost = (prompt blocks − overlap blocks) +
//!   active blocks, lowest wins. Dynamo learns overlap and active blocks from the engines'
//!   KV events; here it reads the real caches, the best case for it.
//! - `oracle`: kvroute's cost formula with perfect information: each server's real cached
//!   prefix and real pending prefill tokens.

use kvroute_core::VllmMetrics;

use super::{argmin_random, chunk_hashes, ApproxIndex, Incoming, Outstanding, Policy, Rng};
use crate::engine::{Engine, Finished};
use crate::profile::BLOCK_TOKENS;

pub struct GieWeighted {
    index: ApproxIndex,
    waiting: Vec<f64>,
    kv: Vec<f64>,
    rng: Rng,
}

impl GieWeighted {
    pub fn new(servers: usize, seed: u64) -> GieWeighted {
        GieWeighted {
            index: ApproxIndex::new(servers, 31_250),
            waiting: vec![0.0; servers],
            kv: vec![0.0; servers],
            rng: Rng::new(seed),
        }
    }
}

impl Policy for GieWeighted {
    fn pick(&mut self, req: &Incoming, servers: &[Engine], _: f64) -> usize {
        let mut blocks = chunk_hashes(req.canonical, 64);
        blocks.truncate(256);
        let (lo, hi) = self
            .waiting
            .iter()
            .fold((f64::MAX, f64::MIN), |(lo, hi), q| (lo.min(*q), hi.max(*q)));
        let scores: Vec<f64> = (0..servers.len())
            .map(|s| {
                let queue = if hi > lo {
                    (hi - self.waiting[s]) / (hi - lo)
                } else {
                    1.0
                };
                let kv = 1.0 - self.kv[s];
                let prefix = if blocks.is_empty() {
                    0.0
                } else {
                    self.index.matched(s, &blocks) as f64 / blocks.len() as f64
                };
                -(2.0 * queue + 2.0 * kv + 3.0 * prefix)
            })
            .collect();
        let s = argmin_random(&scores, &mut self.rng);
        self.index.insert(s, &blocks);
        s
    }
    fn on_scrape(&mut self, s: usize, m: &VllmMetrics, _: &str, _: f64) {
        self.waiting[s] = m.waiting as f64;
        self.kv[s] = m.kv_usage;
    }
}

pub struct SglangCacheAware {
    index: ApproxIndex,
    outstanding: Outstanding,
}

impl SglangCacheAware {
    pub fn new(servers: usize, capacity_blocks: u64) -> SglangCacheAware {
        SglangCacheAware {
            index: ApproxIndex::new(servers, capacity_blocks as usize),
            outstanding: Outstanding::new(servers),
        }
    }
}

impl Policy for SglangCacheAware {
    fn pick(&mut self, req: &Incoming, servers: &[Engine], _: f64) -> usize {
        let load = self.outstanding.get();
        let (min, max) = (*load.iter().min().unwrap_or(&0), *load.iter().max().unwrap_or(&0));
        let blocks = chunk_hashes(req.canonical, 64);
        let s = if max - min > 64 && max as f64 > 1.5 * min as f64 {
            load.iter().position(|l| *l == min).unwrap_or(0)
        } else {
            let matches: Vec<usize> = (0..servers.len()).map(|s| self.index.matched(s, &blocks)).collect();
            let best = (0..servers.len())
                .max_by_key(|s| (matches[*s], std::cmp::Reverse(*s)))
                .unwrap_or(0);
            let ratio = if blocks.is_empty() {
                0.0
            } else {
                matches[best] as f64 / blocks.len() as f64
            };
            if ratio > 0.5 {
                best
            } else {
                (0..servers.len())
                    .min_by_key(|s| (self.index.size(*s), *s))
                    .unwrap_or(0)
            }
        };
        self.index.insert(s, &blocks);
        self.outstanding.sent(s);
        s
    }
    fn on_finished(&mut self, s: usize, _: &Finished, _: f64) {
        self.outstanding.done(s);
    }
}

pub struct DynamoKv;

impl Policy for DynamoKv {
    fn pick(&mut self, req: &Incoming, servers: &[Engine], _: f64) -> usize {
        let total = req.prompt_tokens.div_ceil(BLOCK_TOKENS) as f64;
        let costs: Vec<f64> = servers
            .iter()
            .map(|e| {
                let overlap = e.kv().cached_prefix(req.engine_blocks) as f64;
                let active = e.kv().usage() * (e.kv().num_blocks() - 1) as f64;
                (total - overlap) + active
            })
            .collect();
        (0..costs.len())
            .min_by(|a, b| costs[*a].total_cmp(&costs[*b]))
            .unwrap_or(0)
    }
}

pub struct Oracle;

impl Policy for Oracle {
    fn pick(&mut self, req: &Incoming, servers: &[Engine], _: f64) -> usize {
        let costs: Vec<f64> = servers
            .iter()
            .map(|e| {
                let rate_per_ms = e.profile().prefill_tokens_per_s(2048) / 1000.0;
                let hit = (e.kv().cached_prefix(req.engine_blocks) as u64 * BLOCK_TOKENS)
                    .min(req.prompt_tokens.saturating_sub(1));
                let uncached = (req.prompt_tokens - hit) as f64;
                (e.pending_prefill_tokens() as f64 + 2.0 * uncached) / rate_per_ms + e.num_running() as f64 * 0.1
            })
            .collect();
        (0..costs.len())
            .min_by(|a, b| costs[*a].total_cmp(&costs[*b]))
            .unwrap_or(0)
    }
}

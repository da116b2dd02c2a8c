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
//! - `oracle`: kvroute's own cost function with perfect information: each server's real
//!   cached prefix, queues, KV usage and speed.

use kvroute_core::endpoint::{EndpointTable, Prefill};
use kvroute_core::policy::{
    fleet_backlog, most_running, predicted_ttft, rate_classes, unlike_rates, with_steps, Candidate, ScoreContext,
};
use kvroute_core::speed::{Speed, StepTime};
use kvroute_core::{Config, EndpointId, Millis, Tokens, VllmMetrics};

use super::{argmin_random, chunk_hashes, members, ApproxIndex, Incoming, Outstanding, Policy, Rng};
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
        let (lo, hi) = members(req.pool)
            .iter()
            .map(|s| self.waiting[*s])
            .fold((f64::MAX, f64::MIN), |(lo, hi), q| (lo.min(q), hi.max(q)));
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
        let s = argmin_random(&scores, req.pool, &mut self.rng);
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
    fn pick(&mut self, req: &Incoming, _: &[Engine], _: f64) -> usize {
        let load = self.outstanding.get();
        let pool = members(req.pool);
        let min = pool.iter().map(|s| load[*s]).min().unwrap_or(0);
        let max = pool.iter().map(|s| load[*s]).max().unwrap_or(0);
        let blocks = chunk_hashes(req.canonical, 64);
        let s = if max - min > 64 && max as f64 > 1.5 * min as f64 {
            pool.iter().copied().find(|s| load[*s] == min).unwrap_or(0)
        } else {
            let matches: Vec<usize> = (0..load.len()).map(|s| self.index.matched(s, &blocks)).collect();
            let best = pool
                .iter()
                .copied()
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
                pool.iter()
                    .copied()
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
        members(req.pool)
            .into_iter()
            .min_by(|a, b| costs[*a].total_cmp(&costs[*b]))
            .unwrap_or(0)
    }
}

/// kvroute's own cost function (`kvroute_core::policy::predicted_ttft`, with the configured
/// weights) fed the truth: each server's real cached prefix, real queued prefill tokens,
/// real running and waiting requests and KV usage, its real prefill speed (profile and
/// slowdown) and its recent completion rate. It can only be beaten by luck or by what the
/// cost function does not model.
pub struct Oracle {
    config: Config,
    table: EndpointTable,
    /// The running mean of the uncached tokens of the requests it placed, as the router
    /// keeps one (it counts the fleet's backlog in requests).
    mean_uncached: f64,
}

impl Oracle {
    pub fn new(servers: usize, config: &Config) -> Oracle {
        let mut table = EndpointTable::default();
        // Zero-padded: the table keeps ids sorted, and row `s` must be server `s`.
        let ids: Vec<EndpointId> = (0..servers)
            .map(|s| EndpointId::new(format!("server-{s:05}:8000")))
            .collect();
        table.replace(&ids);
        Oracle {
            config: config.clone(),
            table,
            mean_uncached: config.cost().default_prompt_tokens as f64,
        }
    }
}

impl Policy for Oracle {
    fn pick(&mut self, req: &Incoming, servers: &[Engine], now_ms: f64) -> usize {
        let now = Millis(now_ms as u64);
        let truth: Vec<(VllmMetrics, u64)> = servers
            .iter()
            .enumerate()
            .map(|(s, e)| {
                let row = &mut self.table.rows_mut()[s];
                row.pending_prefill_tokens = Tokens(e.pending_prefill_tokens());
                // The requests still without a first token, as `cost.pending_weight` counts
                // them: only their number matters. Their tokens are 0, so `prefill_left`
                // credits no progress against the exact pending count set above.
                row.prefilling = (0..e.prefill_phase_requests() as u64)
                    .map(|k| {
                        (
                            (now, k),
                            Prefill {
                                cached: Tokens(0),
                                uncached: Tokens(0),
                            },
                        )
                    })
                    .collect();
                row.speed = Speed::exact(e.profile().prefill_tokens_per_s(2048) / e.slow(), now);
                // A decode step of the batch running now, reading the KV cache in use.
                let context = e.kv().usage() * e.profile().num_gpu_blocks as f64 * BLOCK_TOKENS as f64;
                let step = e.profile().step_ms(e.num_running() as u64, 0.0, context as u64) * e.slow();
                row.step = StepTime::exact(step, now);
                // Its requests finished so far, read at every arrival: the recent completion
                // rate a waiting request is admitted at (`policy::admission_ms`). Its queue
                // too, so "waited at two scrapes" means at two arrivals here, a weaker test
                // than the router's (two scrapes 200 ms apart).
                let finished = e.counters.finished + e.counters.aborted;
                row.completions.on_counters(Some(finished as f64), now);
                row.completions.on_queue(e.num_running() as u64, e.num_waiting() as u64);
                let metrics = VllmMetrics {
                    kv_usage: e.kv().usage(),
                    running: e.num_running() as u64,
                    waiting: e.num_waiting() as u64,
                    ..VllmMetrics::default()
                };
                let hit = (e.kv().cached_prefix(req.engine_blocks) as u64 * BLOCK_TOKENS)
                    .min(req.prompt_tokens.saturating_sub(1));
                (metrics, hit)
            })
            .collect();
        let pool = members(req.pool);
        let cands: Vec<Candidate> = pool
            .iter()
            .map(|s| (&self.table.rows()[*s], &truth[*s]))
            .map(|(endpoint, (metrics, hit))| Candidate {
                endpoint,
                metrics,
                matched_blocks: (hit / BLOCK_TOKENS) as u32,
                uncached: Tokens(req.prompt_tokens - hit),
            })
            .collect();
        let ctx = ScoreContext {
            total_blocks: req.engine_blocks.len(),
            fleet_backlog: fleet_backlog(&self.config, &cands, self.mean_uncached, now),
            unlike: false,
            most_running: most_running(&cands),
            // The true queued prefill is in `pending_prefill_tokens`; the scraped estimate
            // (waiting × mean) must not add to it.
            mean_uncached_tokens: 0.0,
            rotation: 0,
            seed: 0,
            now,
            rates: rate_classes(&self.config, &cands, now),
            typical_pace: None,
            rate_per_pace: None,
            typical_step: None,
            fastest_step: None,
            typical_weight: None,
        };
        let ctx = ScoreContext {
            unlike: unlike_rates(&self.config, &cands, &ctx),
            ..ctx
        };
        let ctx = with_steps(&self.config, &cands, ctx);
        let costs: Vec<f64> = cands
            .iter()
            .map(|c| predicted_ttft(&self.config, c, &ctx).cost.0)
            .collect();
        let chosen = (0..costs.len())
            .min_by(|a, b| costs[*a].total_cmp(&costs[*b]))
            .unwrap_or(0);
        if let Some(c) = cands.get(chosen) {
            self.mean_uncached = 0.9 * self.mean_uncached + 0.1 * c.uncached.0 as f64;
        }
        pool.get(chosen).copied().unwrap_or(0)
    }
}

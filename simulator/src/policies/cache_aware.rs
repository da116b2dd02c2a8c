//! Cache-aware baselines, each from its source's default algorithm and settings, plus the
//! oracle.
//!
//! - `gie-weighted`: the Gateway API Inference Extension's (and llm-d's) default endpoint
//!   picker profile (`pkg/epp/config/loader/defaults.go`): queue scorer (min-max normalised
//!   waiting requests), KV-cache scorer (1 − usage), prefix scorer (matched / total
//!   64-character blocks, at most 256, from an LRU index per server recorded at routing
//!   time, its size the server's KV blocks as the plugin's auto-tuning reads them from
//!   `vllm:cache_config_info`, blocks added in prompt order), weights 2 / 2 / 3, highest
//!   score wins (ties at random). Metrics are refreshed every 50 ms, its default
//!   (`PolicyName::scrape_interval_ms`).
//! - `sglang-cache-aware`: SGLang's model gateway (`smg` 1.13, the HTTP path, `cache_aware.rs`
//!   `select_worker_with_text`, with the defaults and spill gate its `--help` gives): the
//!   server whose approximate radix tree matches the most of the prompt if that is over 30%
//!   of it (`--cache-threshold 0.3`) and its in-flight load is not past the spill gate
//!   (`sglang_spills`), else the least loaded server (ties to the first). The tree is
//!   approximated by 64-character blocks, `--max-tree-size` (2^26 characters) shared by the
//!   servers, leaves evicted first. Its worker-overload protection, on by default in 1.13
//!   (`--worker-overload-waiting-requests 8`, `--worker-overload-token-usage 0.8`): a server
//!   whose last load poll read at least 8 waiting requests or at least 80% KV usage is left
//!   out of the choice while another is under both, and where every server is over them the
//!   least loaded goes; the load is polled every 10 s (`--load-monitor-interval`,
//!   `PolicyName::scrape_interval_ms`) from vLLM's `/metrics`.
//! - `dynamo-kv`: NVIDIA Dynamo's KV router with its defaults (`lib/kv-router`, the default
//!   selector: overlap credit 1, prefill load scale 1, temperature 0, prefill tokens and
//!   active blocks tracked): cost = max(0, (active prefill tokens + prompt tokens) / block
//!   − overlap blocks) + active blocks + the prompt's blocks not among them, lowest wins,
//!   ties at random. The router charges each request where it sent it: its uncached prompt
//!   tokens until its first token, its blocks until it finishes. Dynamo learns the overlap
//!   from the engines' KV events; here it reads the real caches, the best case for it.
//! - `oracle`: kvroute's own cost function with perfect information: each server's real
//!   cached prefix, queues, KV usage and speed.

use kvroute_core::endpoint::{EndpointTable, Prefill};
use kvroute_core::policy::{
    fleet_backlog, predicted_ttft, rate_classes, unlike_rates, with_steps, Candidate, ScoreContext,
};
use kvroute_core::speed::{Speed, StepTime};
use kvroute_core::{Config, EndpointId, Millis, Tokens, VllmMetrics};

use std::collections::HashMap;

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
    /// `capacity_blocks`: each server's KV blocks of 16 tokens, one 64-character block of
    /// the index each.
    pub fn new(servers: usize, capacity_blocks: u64, seed: u64) -> GieWeighted {
        GieWeighted {
            index: ApproxIndex::new(servers, capacity_blocks as usize, false),
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

/// `smg`'s `--cache-threshold` default: the share of the prompt the best tree must match.
const SGLANG_CACHE_THRESHOLD: f64 = 0.3;
/// `smg`'s `--max-tree-size` default: characters in one model's tree, all servers together.
const SGLANG_TREE_CHARS: usize = 1 << 26;
/// `smg`'s spill gate (`--balance-abs-threshold` 64, `--balance-rel-threshold` 1.5).
const SGLANG_SPILL_ABS: f64 = 64.0;
const SGLANG_SPILL_REL: f64 = 1.5;

/// `smg` 1.13's worker-overload thresholds (its `--help`: on by default), each inclusive.
const SGLANG_OVERLOAD_WAITING: u64 = 8;
const SGLANG_OVERLOAD_KV: f64 = 0.8;

pub struct SglangCacheAware {
    index: ApproxIndex,
    outstanding: Outstanding,
    /// Per server: whether its last load poll read it overloaded.
    overloaded: Vec<bool>,
}

impl SglangCacheAware {
    pub fn new(servers: usize) -> SglangCacheAware {
        SglangCacheAware {
            index: ApproxIndex::new(servers, SGLANG_TREE_CHARS / 64 / servers.max(1), true),
            outstanding: Outstanding::new(servers),
            overloaded: vec![false; servers],
        }
    }

    /// The servers the choice is made among: those of `pool` not overloaded, or, where every
    /// one is, the least loaded alone.
    fn eligible(&self, pool: &[usize], load: &[u64]) -> Vec<usize> {
        let under: Vec<usize> = pool.iter().copied().filter(|s| !self.overloaded[*s]).collect();
        if !under.is_empty() {
            return under;
        }
        let min = pool.iter().map(|s| load[*s]).min().unwrap_or(0);
        pool.iter().copied().find(|s| load[*s] == min).into_iter().collect()
    }
}

/// Whether `smg` 1.13 skips the matched server for the least loaded one (its `--help`): its
/// in-flight load exceeds the pool's mean by the absolute threshold, capped at the count's
/// natural swing at that mean (two standard deviations of a Poisson count, at least 4),
/// and by the relative threshold.
pub(super) fn sglang_spills(load: u64, mean: f64) -> bool {
    let margin = SGLANG_SPILL_ABS.min((2.0 * mean.sqrt()).max(4.0));
    load as f64 > mean + margin && load as f64 > SGLANG_SPILL_REL * mean
}

impl Policy for SglangCacheAware {
    fn pick(&mut self, req: &Incoming, _: &[Engine], _: f64) -> usize {
        let load = self.outstanding.get();
        let pool = self.eligible(&members(req.pool), load);
        let min = pool.iter().map(|s| load[*s]).min().unwrap_or(0);
        let mean = pool.iter().map(|s| load[*s] as f64).sum::<f64>() / pool.len().max(1) as f64;
        let blocks = chunk_hashes(req.canonical, 64);
        let least_loaded = pool.iter().copied().find(|s| load[*s] == min).unwrap_or(0);
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
        let s = if ratio > SGLANG_CACHE_THRESHOLD && !sglang_spills(load[best], mean) {
            best
        } else {
            least_loaded
        };
        self.index.insert(s, &blocks);
        self.outstanding.sent(s);
        s
    }
    fn on_finished(&mut self, s: usize, _: &Finished, _: f64) {
        self.outstanding.done(s);
    }
    fn on_scrape(&mut self, s: usize, m: &VllmMetrics, _: &str, _: f64) {
        self.overloaded[s] = m.waiting >= SGLANG_OVERLOAD_WAITING || m.kv_usage >= SGLANG_OVERLOAD_KV;
    }
}

/// A request Dynamo's router sent and has not seen finish.
struct DynamoActive {
    server: usize,
    /// Its uncached prompt tokens, charged to the server until its first token (0 after).
    prefill: u64,
    blocks: Vec<u64>,
}

pub struct DynamoKv {
    /// Per server: the uncached prompt tokens of its requests still without a first token.
    prefill_tokens: Vec<u64>,
    /// Per server: the blocks of its active requests, each once, with how many hold it.
    active: Vec<HashMap<u64, u32>>,
    requests: HashMap<u64, DynamoActive>,
    rng: Rng,
}

impl DynamoKv {
    pub fn new(servers: usize, seed: u64) -> DynamoKv {
        DynamoKv {
            prefill_tokens: vec![0; servers],
            active: vec![HashMap::new(); servers],
            requests: HashMap::new(),
            rng: Rng::new(seed),
        }
    }
}

impl Policy for DynamoKv {
    fn pick(&mut self, req: &Incoming, servers: &[Engine], _: f64) -> usize {
        let block = BLOCK_TOKENS as f64;
        let overlaps: Vec<u64> = servers
            .iter()
            .map(|e| e.kv().cached_prefix(req.engine_blocks) as u64)
            .collect();
        let costs: Vec<f64> = (0..servers.len())
            .map(|s| {
                let raw_prefill = (self.prefill_tokens[s] + req.prompt_tokens) as f64 / block;
                let prefill = (raw_prefill - overlaps[s] as f64).max(0.0);
                let active = &self.active[s];
                let new = req.engine_blocks.iter().filter(|b| !active.contains_key(b)).count();
                prefill + (active.len() + new) as f64
            })
            .collect();
        let s = argmin_random(&costs, req.pool, &mut self.rng);
        let cached = (overlaps[s] * BLOCK_TOKENS).min(req.prompt_tokens);
        let prefill = req.prompt_tokens - cached;
        self.prefill_tokens[s] += prefill;
        for b in req.engine_blocks {
            *self.active[s].entry(*b).or_insert(0) += 1;
        }
        self.requests.insert(
            req.id,
            DynamoActive {
                server: s,
                prefill,
                blocks: req.engine_blocks.to_vec(),
            },
        );
        s
    }
    fn on_first_token(&mut self, _: usize, id: u64, _: f64) {
        if let Some(r) = self.requests.get_mut(&id) {
            self.prefill_tokens[r.server] = self.prefill_tokens[r.server].saturating_sub(r.prefill);
            r.prefill = 0;
        }
    }
    fn on_finished(&mut self, _: usize, f: &Finished, _: f64) {
        let Some(r) = self.requests.remove(&f.id) else { return };
        self.prefill_tokens[r.server] = self.prefill_tokens[r.server].saturating_sub(r.prefill);
        let active = &mut self.active[r.server];
        for b in &r.blocks {
            if let Some(n) = active.get_mut(b) {
                *n -= 1;
                if *n == 0 {
                    active.remove(b);
                }
            }
        }
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

//! One simulated vLLM server: a scheduler like vLLM v1's over the paged KV cache.
//!
//! Each step: running requests first (a decode token each, or the next chunk of their
//! prefill), then waiting requests in FCFS order while the token budget
//! (`max_num_batched_tokens`), `max_num_seqs` and free blocks allow; a new request first
//! takes the cached blocks of its longest cached prefix (always leaving at least one token
//! to compute). When a running request needs a block and none is free, the most recently
//! admitted running request is preempted by recompute: its blocks are freed and it goes
//! back to the head of the queue, to prefill its prompt and the tokens it had generated.
//! No new request is admitted in a step that preempted. The step's duration comes from the
//! profile; its tokens appear when it ends.
//!
//! Time is a parameter (ms as f64): the replay passes virtual time, the live servers wall time.

use std::collections::VecDeque;

use crate::kv::{BlockId, KvCache};
use crate::profile::{Profile, BLOCK_TOKENS};
pub use counters::Counters;

/// A request as the engine sees it: token counts and its prompt's 16-token block hashes.
#[derive(Clone, Debug)]
pub struct SeqSpec {
    pub id: u64,
    pub prompt_tokens: u64,
    pub output_tokens: u64,
    /// Chained hashes of the prompt's full 16-token blocks.
    pub block_hashes: Vec<u64>,
    /// It ends by a stop (its natural end), not by `max_tokens`: vLLM's `finished_reason`.
    pub stops: bool,
}

#[derive(Clone, Debug)]
struct Seq {
    spec: SeqSpec,
    arrival: f64,
    prefill_target: u64,
    computed: u64,
    generated: u64,
    blocks: Vec<BlockId>,
    cached_tokens: Option<u64>,
    /// While it waits: the prefix it would find cached, as of its arrival (the oracle's
    /// queued work is its prompt less this); 0 once preempted (its blocks were freed).
    expected_hit: u64,
    first_token: Option<f64>,
    /// Start of the first step that ran it (the end of its queueing).
    scheduled: Option<f64>,
    last_token: f64,
    itl_sum: f64,
    preemptions: u32,
}

/// What a step produced.
#[derive(Clone, Debug, PartialEq)]
pub enum Event {
    FirstToken { id: u64, at: f64 },
    Token { id: u64, at: f64 },
    Finished(Finished),
}

#[derive(Clone, Debug, PartialEq)]
pub struct Finished {
    pub id: u64,
    pub arrival: f64,
    pub first_token: f64,
    pub finish: f64,
    pub prompt_tokens: u64,
    pub output_tokens: u64,
    pub cached_tokens: u64,
    /// Mean inter-token latency in ms (0 for a single output token).
    pub itl_mean: f64,
    pub preemptions: u32,
}

pub struct Engine {
    profile: Profile,
    kv: KvCache,
    waiting: VecDeque<Seq>,
    running: Vec<Seq>,
    /// New tokens per running request this step: `plan[j]` is for `running[j]`.
    plan: Vec<u64>,
    plan_ms: f64,
    pub counters: Counters,
    /// Sum over steps of KV usage, and steps, for the mean usage.
    usage_sum: f64,
    steps: u64,
    /// Steps take this many times their profiled time (a throttled or shared GPU).
    slow: f64,
    /// Sequences whose client went away, taken out before the next step is planned.
    aborts: Vec<u64>,
}

impl Engine {
    pub fn new(profile: Profile) -> Engine {
        let kv = KvCache::new(profile.num_gpu_blocks);
        Engine {
            profile,
            kv,
            waiting: VecDeque::new(),
            running: Vec::new(),
            plan: Vec::new(),
            plan_ms: 0.0,
            counters: Counters::default(),
            usage_sum: 0.0,
            steps: 0,
            slow: 1.0,
            aborts: Vec::new(),
        }
    }

    /// Aborts sequence `id` (its client went away), as vLLM does: it leaves the queue or the
    /// batch before the next step and frees its KV blocks (those computed stay in the
    /// prefix cache). A sequence already finished is ignored.
    pub fn abort(&mut self, id: u64) {
        self.aborts.push(id);
    }

    fn take_aborted(&mut self) {
        for id in std::mem::take(&mut self.aborts) {
            let gone = if let Some(i) = self.waiting.iter().position(|s| s.spec.id == id) {
                self.waiting.remove(i)
            } else if let Some(i) = self.running.iter().position(|s| s.spec.id == id) {
                Some(self.running.remove(i))
            } else {
                None
            };
            if let Some(s) = gone {
                self.kv.release(&s.blocks);
                self.counters.aborted += 1;
            }
        }
    }

    /// How many times its profiled time a step takes.
    pub fn slow(&self) -> f64 {
        self.slow
    }

    /// From now on, every step takes `factor` (≥ 1) times its profiled time.
    pub fn set_slow(&mut self, factor: f64) {
        self.slow = factor.max(1.0);
    }

    pub fn profile(&self) -> &Profile {
        &self.profile
    }
    pub fn kv(&self) -> &KvCache {
        &self.kv
    }
    pub fn num_running(&self) -> usize {
        self.running.len()
    }
    pub fn num_waiting(&self) -> usize {
        self.waiting.len()
    }
    pub fn mean_kv_usage(&self) -> f64 {
        if self.steps == 0 {
            0.0
        } else {
            self.usage_sum / self.steps as f64
        }
    }

    /// Sequences waiting or running: what vLLM's `--max-num-queued-reqs` counts (a request
    /// with `n` samples is `n`).
    pub fn unfinished(&self) -> usize {
        self.waiting.len() + self.running.len()
    }

    /// Prompt tokens of the sequences still in their prefill (queued, or running with part
    /// of the prompt left): what vLLM's `--max-num-queued-tokens` counts.
    pub fn prefill_phase_prompt_tokens(&self) -> u64 {
        self.waiting
            .iter()
            .chain(&self.running)
            .filter(|s| s.computed < s.prefill_target)
            .map(|s| s.spec.prompt_tokens)
            .sum()
    }

    /// Requests still without their first token (queued, or running with part of the
    /// prompt left): the oracle's count of the requests a new prompt would join.
    pub fn prefill_phase_requests(&self) -> usize {
        self.waiting
            .iter()
            .chain(&self.running)
            .filter(|s| s.computed < s.prefill_target)
            .count()
    }

    /// Prefill tokens still to compute, over queued and running requests (the oracle's
    /// view). A queued request will find part of its prompt cached when it is admitted: it
    /// counts its prompt less the prefix cached when it arrived (a preempted one, all of it).
    pub fn pending_prefill_tokens(&self) -> u64 {
        let queued: u64 = self
            .waiting
            .iter()
            .map(|s| s.prefill_target - s.computed.max(s.expected_hit).min(s.prefill_target))
            .sum();
        let running: u64 = self
            .running
            .iter()
            .map(|s| s.prefill_target - s.computed.min(s.prefill_target))
            .sum();
        queued + running
    }

    pub fn has_work(&self) -> bool {
        !self.waiting.is_empty() || !self.running.is_empty()
    }

    pub fn add(&mut self, spec: SeqSpec, now: f64) {
        debug_assert!(spec.output_tokens >= 1, "a request generates at least one token");
        let prefill_target = spec.prompt_tokens.max(1);
        let expected_hit = self.hit_blocks(&spec.block_hashes, prefill_target) as u64 * BLOCK_TOKENS;
        self.waiting.push_back(Seq {
            spec,
            arrival: now,
            prefill_target,
            computed: 0,
            generated: 0,
            blocks: Vec::new(),
            cached_tokens: None,
            expected_hit,
            first_token: None,
            scheduled: None,
            last_token: now,
            itl_sum: 0.0,
            preemptions: 0,
        });
    }

    fn blocks_for(tokens: u64) -> usize {
        tokens.div_ceil(BLOCK_TOKENS) as usize
    }

    /// Plans the next step and returns its duration in ms (`None` when nothing can run).
    pub fn start_step(&mut self) -> Option<f64> {
        debug_assert!(self.plan.is_empty(), "a step is already in flight");
        self.take_aborted();
        let mut budget = self.profile.max_num_batched_tokens;
        let preemptions_before = self.counters.preemptions;
        let mut i = 0;
        while i < self.running.len() && budget > 0 {
            let s = &self.running[i];
            let num_new = if s.computed < s.prefill_target {
                (s.prefill_target - s.computed).min(budget)
            } else {
                1
            };
            let need = Self::blocks_for(s.computed + num_new).saturating_sub(s.blocks.len());
            if !self.make_room(need, i) {
                continue; // running[i] itself was preempted (it was the last one)
            }
            if let Some(new) = self.kv.allocate(need) {
                self.running[i].blocks.extend(new);
            }
            let s = &self.running[i];
            if self.profile.cache_at_schedule && s.computed < s.spec.prompt_tokens {
                Self::register_blocks(&mut self.kv, s, s.computed + num_new);
            }
            self.plan.push(num_new);
            budget -= num_new;
            i += 1;
        }
        let preempted = self.counters.preemptions > preemptions_before;
        while !preempted && budget > 0 && self.running.len() < self.profile.max_num_seqs {
            let Some(num_new) = self.admit(budget) else { break };
            budget -= num_new;
        }
        if self.plan.is_empty() {
            return None;
        }
        let (mut new_tokens, mut pairs, mut context) = (0u64, 0.0f64, 0u64);
        for (s, n) in self.running.iter().zip(&self.plan) {
            new_tokens += n;
            pairs += *n as f64 * (s.computed as f64 + *n as f64 / 2.0);
            context += s.computed + n;
        }
        self.plan_ms = self.profile.step_ms(new_tokens, pairs, context) * self.slow;
        Some(self.plan_ms)
    }

    /// Frees blocks by preempting the latest-admitted running requests until `need` are
    /// free. Returns false if request `i` itself had to be preempted.
    fn make_room(&mut self, need: usize, i: usize) -> bool {
        while (self.kv.free_blocks() as usize) < need {
            let victim = self.running.len() - 1;
            let mut s = self.running.remove(victim);
            self.kv.release(&s.blocks);
            s.blocks.clear();
            s.prefill_target = s.spec.prompt_tokens.max(1) + s.generated;
            s.expected_hit = 0;
            s.computed = 0;
            s.preemptions += 1;
            self.counters.preemptions += 1;
            self.waiting.push_front(s);
            if victim == i {
                return false;
            }
        }
        true
    }

    /// Leading blocks of `hashes` cached now, short of the prompt's last token (one token
    /// must be computed to produce the first output).
    fn hit_blocks(&self, hashes: &[u64], prefill_target: u64) -> usize {
        let usable = ((prefill_target - 1) / BLOCK_TOKENS) as usize;
        self.kv.cached_prefix(hashes).min(usable)
    }

    /// Admits the head of the queue if it fits; returns the tokens it computes this step.
    fn admit(&mut self, budget: u64) -> Option<u64> {
        let s = self.waiting.front()?;
        let hits = self.hit_blocks(&s.spec.block_hashes, s.prefill_target);
        let hit_tokens = hits as u64 * BLOCK_TOKENS;
        let num_new = (s.prefill_target - hit_tokens).min(budget);
        let fresh = Self::blocks_for(hit_tokens + num_new) - hits;
        let blocks = self.kv.admit(&s.spec.block_hashes, hits, fresh)?;
        let mut s = self.waiting.pop_front()?;
        if s.cached_tokens.is_none() {
            s.cached_tokens = Some(hit_tokens);
            self.counters.prefix_queries += s.spec.prompt_tokens;
            self.counters.prefix_hits += hit_tokens;
        }
        s.computed = hit_tokens;
        s.blocks = blocks;
        if self.profile.cache_at_schedule {
            Self::register_blocks(&mut self.kv, &s, hit_tokens + num_new);
        }
        self.plan.push(num_new);
        self.running.push(s);
        Some(num_new)
    }

    /// Applies the step planned by `start_step`, ending at `now`.
    pub fn finish_step(&mut self, now: f64) -> Vec<Event> {
        let plan = std::mem::take(&mut self.plan);
        let mut events = Vec::new();
        self.usage_sum += self.kv.usage();
        self.steps += 1;
        self.counters
            .requests
            .iteration_tokens
            .observe(plan.iter().sum::<u64>() as f64);
        let step_start = now - self.plan_ms;
        // Blocks become hits when the step ends, unless they did when it was planned.
        let at_end = !self.profile.cache_at_schedule;
        let mut pos = 0;
        for n in plan {
            let s = &mut self.running[pos];
            s.scheduled.get_or_insert(step_start);
            let id = s.spec.id;
            let was_prefilling = s.computed < s.prefill_target;
            s.computed += n;
            // A decode step adds no prompt block: every one was registered by then.
            if at_end && was_prefilling {
                Self::register_blocks(&mut self.kv, s, s.computed);
            }
            if was_prefilling && s.computed < s.prefill_target {
                pos += 1;
                continue;
            }
            s.generated += 1;
            self.counters.generation_tokens += 1;
            if s.first_token.is_none() {
                s.first_token = Some(now);
                // vLLM observes TTFT in the step that produced the first token.
                self.counters.ttft.observe((now - s.arrival) / 1000.0);
                // vLLM counts a prompt in `prompt_tokens_total` once, with its first token.
                self.counters.prompt_tokens += s.spec.prompt_tokens;
                events.push(Event::FirstToken { id, at: now });
            } else {
                s.itl_sum += now - s.last_token;
                self.counters.itl.observe((now - s.last_token) / 1000.0);
                events.push(Event::Token { id, at: now });
            }
            s.last_token = now;
            if s.generated >= s.spec.output_tokens {
                let s = self.running.remove(pos);
                self.kv.release(&s.blocks);
                events.push(Event::Finished(self.finish(s, now)));
            } else {
                pos += 1;
            }
        }
        events
    }

    /// Makes the prompt's full blocks among its first `tokens` hittable.
    fn register_blocks(kv: &mut KvCache, s: &Seq, tokens: u64) {
        let full = ((tokens.min(s.spec.prompt_tokens)) / BLOCK_TOKENS) as usize;
        for (block, hash) in s.blocks.iter().zip(&s.spec.block_hashes).take(full) {
            kv.register(*block, *hash);
        }
    }

    fn finish(&mut self, s: Seq, now: f64) -> Finished {
        let first = s.first_token.unwrap_or(now);
        let itl_mean = if s.generated > 1 {
            s.itl_sum / (s.generated - 1) as f64
        } else {
            0.0
        };
        self.counters.finished += 1;
        self.counters.finished_stop += u64::from(s.spec.stops);
        self.counters.e2e.observe((now - s.arrival) / 1000.0);
        let scheduled = s.scheduled.unwrap_or(s.arrival);
        let cached = s.cached_tokens.unwrap_or(0);
        let r = &mut self.counters.requests;
        r.prompt_tokens.observe(s.spec.prompt_tokens as f64);
        r.generation_tokens.observe(s.generated as f64);
        r.time_per_output_token.observe(itl_mean / 1000.0);
        r.queue.observe((scheduled - s.arrival) / 1000.0);
        r.inference.observe((now - scheduled) / 1000.0);
        r.prefill.observe((first - scheduled) / 1000.0);
        r.decode.observe((now - first) / 1000.0);
        r.num_preemptions.observe(f64::from(s.preemptions));
        r.prefill_kv_computed
            .observe(s.spec.prompt_tokens.saturating_sub(cached) as f64);
        Finished {
            id: s.spec.id,
            arrival: s.arrival,
            first_token: first,
            finish: now,
            prompt_tokens: s.spec.prompt_tokens,
            output_tokens: s.generated,
            cached_tokens: s.cached_tokens.unwrap_or(0),
            itl_mean,
            preemptions: s.preemptions,
        }
    }
}

mod counters;
#[cfg(test)]
mod tests;

//! What a simulated server counts and exports: vLLM's token, prefix-cache and preemption
//! counters and its latency histograms (`Counters`), and the `/metrics` body rendered from
//! them and the engine's state (`crate::prom` writes the text as vLLM 0.33 does).

use super::Engine;
use crate::prom::{Histogram, RequestHistograms, View, E2E_BOUNDS, ITL_BOUNDS, TTFT_BOUNDS};

/// Counters a vLLM server exports (token counts, not requests, for the prefix cache).
#[derive(Clone, Debug, PartialEq)]
pub struct Counters {
    pub prompt_tokens: u64,
    pub generation_tokens: u64,
    pub prefix_queries: u64,
    pub prefix_hits: u64,
    pub preemptions: u64,
    pub finished: u64,
    /// Of `finished`, those that ended by a stop rather than `max_tokens`.
    pub finished_stop: u64,
    /// Sequences aborted because their client went away.
    pub aborted: u64,
    /// Requests refused by `--max-num-queued-reqs` and by `--max-num-queued-tokens`.
    pub admission_rejected: [u64; 2],
    pub ttft: Histogram,
    /// Observed once per generated token after the first, as vLLM does.
    pub itl: Histogram,
    pub e2e: Histogram,
    pub requests: RequestHistograms,
}

impl Default for Counters {
    fn default() -> Self {
        Counters {
            prompt_tokens: 0,
            generation_tokens: 0,
            prefix_queries: 0,
            prefix_hits: 0,
            preemptions: 0,
            finished: 0,
            finished_stop: 0,
            aborted: 0,
            admission_rejected: [0; 2],
            ttft: Histogram::new(TTFT_BOUNDS),
            itl: Histogram::new(ITL_BOUNDS),
            e2e: Histogram::new(E2E_BOUNDS),
            requests: RequestHistograms::default(),
        }
    }
}

impl Engine {
    /// The server's `/metrics` body now (`legacy`: pre-0.12 family names).
    pub fn metrics_text(&self, legacy: bool, created: f64) -> String {
        let c = &self.counters;
        crate::prom::render(
            &View {
                model: self.profile.model.served_name(),
                running: self.running.len(),
                waiting: self.waiting.len(),
                kv_usage: self.kv.usage(),
                prompt_tokens: c.prompt_tokens,
                generation_tokens: c.generation_tokens,
                prefix_queries: c.prefix_queries,
                prefix_hits: c.prefix_hits,
                preemptions: c.preemptions,
                finished: c.finished,
                finished_stop: c.finished_stop,
                aborted: c.aborted,
                admission_rejected: c.admission_rejected,
                num_gpu_blocks: self.kv.num_blocks(),
                ttft: &c.ttft,
                itl: &c.itl,
                e2e: &c.e2e,
                requests: &c.requests,
                created,
            },
            legacy,
        )
    }
}

//! The named events that change the router's state: what the caller did with a decision
//! (`on_routed`), how the request went (`on_first_token`, `on_completed`), what the scrapes
//! said (`on_metrics`, `on_scrape_failed`, `on_active_health`) and who is in the pool
//! (`on_endpoints`).

use super::RouteRequest;
use super::{Completion, Inflight, Router, MAX_INFLIGHT};
use crate::decision::Decision;
use crate::health::Flip;
use crate::metrics::VllmMetrics;
use crate::types::{EndpointId, Millis, Tokens};

impl Router {
    /// The caller sent `request_id` per `decision` (to its best endpoint first).
    pub fn on_routed(&mut self, request_id: u64, req: &RouteRequest, decision: &Decision, _now: Millis) {
        let Some(best) = decision.best() else { return };
        let uncached = decision
            .breakdown
            .iter()
            .find(|s| s.endpoint == *best)
            .map_or(req.prompt_tokens, |s| s.uncached_tokens);
        let Some(e) = self.table.get_mut(best) else { return };
        e.inflight = e.inflight.saturating_add(1);
        e.sent_since_scrape = e.sent_since_scrape.saturating_add(1);
        e.sent_tokens_since_scrape = e.sent_tokens_since_scrape.saturating_add(uncached);
        e.pending_prefill_tokens = e.pending_prefill_tokens.saturating_add(uncached);
        let (slot, epoch) = (e.slot, e.epoch);
        self.index.record(slot, &req.blocks);
        self.rotation = self.rotation.wrapping_add(1);
        self.mean_uncached = 0.9 * self.mean_uncached + 0.1 * uncached.0 as f64;
        self.stats.routed += 1;
        let record = Inflight {
            endpoint: best.clone(),
            epoch,
            prefilling: true,
            blocks: req.blocks.clone(),
            prompt_tokens: req.prompt_tokens,
            uncached,
        };
        if let Some(old) = self.inflight.insert(request_id, record) {
            self.release(&old);
        }
        while self.inflight.len() > MAX_INFLIGHT {
            if let Some((_, old)) = self.inflight.pop_first() {
                self.release(&old);
            }
        }
    }

    /// `request_id` ended: success, error status, reset or local reply alike.
    pub fn on_completed(&mut self, request_id: u64, done: &Completion, now: Millis) -> Option<Flip> {
        let record = self.inflight.remove(&request_id)?;
        self.release(&record);
        self.stats.completed += 1;
        let served = done.served_by.clone().unwrap_or_else(|| record.endpoint.clone());
        if served != record.endpoint {
            // A retry moved it: the prefix now lives where it was served.
            if let Some(slot) = self.table.get(&served).map(|e| e.slot) {
                self.index.record(slot, &record.blocks);
            }
        }
        if let Some(cached) = done.cached_tokens {
            self.stats.predicted_cached_tokens += record.prompt_tokens.saturating_sub(record.uncached).0;
            self.stats.reported_cached_tokens += cached;
            self.stats.reported_prompt_tokens += record.prompt_tokens.0;
        }
        let ok = done.status != 0 && done.status < 500;
        let health = self.config.health().clone();
        self.table.get_mut(&served)?.health.on_response(ok, now, &health)
    }

    /// The first token (or the response headers of a stream) of `request_id` arrived: its
    /// prefill is done.
    pub fn on_first_token(&mut self, request_id: u64, _now: Millis) {
        let Some(record) = self.inflight.get_mut(&request_id) else {
            return;
        };
        if !std::mem::replace(&mut record.prefilling, false) {
            return;
        }
        let uncached = record.uncached;
        if let Some(e) = self.table.get_mut(&record.endpoint) {
            e.pending_prefill_tokens = e.pending_prefill_tokens.saturating_sub(uncached);
        }
    }

    fn release(&mut self, record: &Inflight) {
        if let Some(e) = self.table.get_mut(&record.endpoint) {
            e.inflight = e.inflight.saturating_sub(1);
            if record.prefilling {
                e.pending_prefill_tokens = e.pending_prefill_tokens.saturating_sub(record.uncached);
            }
            if e.epoch == record.epoch {
                e.sent_since_scrape = e.sent_since_scrape.saturating_sub(1);
                e.sent_tokens_since_scrape = e.sent_tokens_since_scrape.saturating_sub(record.uncached);
            }
        }
    }

    /// A successful scrape of `id` taken at `scraped_at`.
    pub fn on_metrics(&mut self, id: &EndpointId, metrics: VllmMetrics, scraped_at: Millis) -> Option<Flip> {
        let tpb = self.tokens_per_block();
        let default_capacity = self.config.index().default_capacity_tokens;
        let health = self.config.health().clone();
        let e = self.table.get_mut(id)?;
        let capacity_blocks = metrics.capacity_tokens().unwrap_or(default_capacity) / tpb;
        e.metrics = Some(metrics);
        e.scraped_at = Some(scraped_at);
        e.epoch += 1;
        e.sent_since_scrape = 0;
        e.sent_tokens_since_scrape = Tokens(0);
        let (slot, flip) = (e.slot, e.health.on_scrape_ok(&health));
        self.index
            .set_capacity(slot, usize::try_from(capacity_blocks).unwrap_or(usize::MAX));
        flip
    }

    /// A scrape of `id` failed (timeout, non-200, unparsable body).
    pub fn on_scrape_failed(&mut self, id: &EndpointId, _now: Millis) -> Option<Flip> {
        let health = self.config.health().clone();
        self.table.get_mut(id)?.health.on_scrape_failed(&health)
    }

    /// Active health decided elsewhere (see `Health::set_active`).
    pub fn on_active_health(&mut self, id: &EndpointId, healthy: bool) -> Option<Flip> {
        self.table.get_mut(id)?.health.set_active(healthy)
    }

    /// The pool is now exactly `ids`: new endpoints start unknown, departed ones are forgotten.
    pub fn on_endpoints(&mut self, ids: &[EndpointId]) {
        let change = self.table.replace(ids);
        for (_, slot) in &change.removed {
            self.index.remove(*slot);
        }
        let default_blocks = self.config.index().default_capacity_tokens / self.tokens_per_block();
        for id in &change.added {
            if let Some(slot) = self.table.get(id).map(|e| e.slot) {
                self.index
                    .set_capacity(slot, usize::try_from(default_blocks).unwrap_or(usize::MAX));
            }
        }
    }
}

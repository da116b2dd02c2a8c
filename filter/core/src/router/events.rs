//! The named events that change the router's state: what the caller did with a decision
//! (`on_routed`), how the request went (`on_first_token`, `on_completed`), what the scrapes
//! said (`on_metrics`, `on_scrape_failed`, `on_active_health`), who is in the pool
//! (`on_endpoints`), and all of that at once from the scraping side (`on_fleet`). What peer
//! routers did is in `peers`.

use super::RouteRequest;
use super::{Completion, Inflight, Router, INFLIGHT_BUDGET_DIVISOR, MAX_INFLIGHT};
use crate::decision::Decision;
use crate::endpoint::Prefill;
use crate::fleet::FleetState;
use crate::health::Flip;
use crate::metrics::VllmMetrics;
use crate::peer::{request_key, PeerEvent, TtftSample};
use crate::speed;
use crate::types::{BlockHash, EndpointId, Millis, Tokens};

/// A request routed at `routed_at` is load the endpoint's metrics (taken at `scraped_at`)
/// cannot show yet.
fn unseen_by_scrape(scraped_at: Option<Millis>, routed_at: Millis) -> bool {
    scraped_at.is_none_or(|s| routed_at >= s)
}

/// What of a request's `uncached` tokens counts in its server's `sent_tokens_since_scrape`
/// once its first token came (`cost.served_tokens_kept`): its prefill is done, and the
/// decode it started weighs on the server until the next scrape shows it running. In full
/// (the earlier rule), a server that had just served a prompt read as busy as one still
/// computing its own, and the rendezvous owner of a new prefix took it to the busy one
/// (replay, shared-prefix 50%: 12 of 64 cold prompts at 59-83 ms, none over 57 ms with
/// none kept); none kept, rag at 80% load read 3.9% worse (BENCHMARKS.md, "A cold
/// prefix's owner, weighted").
fn kept_after_first_token(uncached: Tokens, share: f64) -> Tokens {
    Tokens((uncached.0 as f64 * share).round() as u64)
}

/// What `record` counts in its server's `sent_tokens_since_scrape` now: all of its uncached
/// tokens until its first token, then the kept share.
fn counted_since_scrape(record: &Inflight, share: f64) -> Tokens {
    if record.prefilling {
        record.uncached
    } else {
        kept_after_first_token(record.uncached, share)
    }
}

impl Router {
    /// The caller sent `request_id` per `decision` (to its best endpoint first).
    pub fn on_routed(&mut self, request_id: u64, req: &RouteRequest, decision: &Decision, now: Millis) {
        let Some(best) = decision.best() else { return };
        let score = decision.breakdown.iter().find(|s| s.endpoint == *best);
        let uncached = score.map_or(req.prompt_tokens, |s| s.uncached_tokens);
        let key = request_key(self.origin, request_id);
        let timed = req.first_token_timed;
        if self.place(key, best, &req.blocks, req.prompt_tokens, uncached, now) {
            if let Some(e) = self.table.get_mut(best).filter(|_| timed) {
                e.mark_timed(now, key);
            }
            // Only tiers read the learned ratio of observed to predicted TTFT, and only a
            // timed first token says how far off the prediction was.
            let learn = self.config.tiers().on() && timed;
            if let (true, Some(r), Some(s)) = (learn, self.inflight.get_mut(&key), score) {
                r.predicted_ttft_ms = s.ttft_ms;
            }
            self.stats.routed += 1;
            self.tell_peers(|| PeerEvent::Routed {
                key,
                endpoint: best.clone(),
                blocks: req.blocks.clone(),
                prompt_tokens: req.prompt_tokens,
                uncached,
                at: now,
            });
        }
    }

    /// Counts request `key`, routed at `routed_at`, on `endpoint` and records its blocks there.
    pub(super) fn place(
        &mut self,
        key: u64,
        endpoint: &EndpointId,
        blocks: &[BlockHash],
        prompt_tokens: Tokens,
        uncached: Tokens,
        routed_at: Millis,
    ) -> bool {
        let Some(e) = self.table.get_mut(endpoint) else {
            return false;
        };
        e.inflight = e.inflight.saturating_add(1);
        e.pending_prefill_tokens = e.pending_prefill_tokens.saturating_add(uncached);
        if unseen_by_scrape(e.scraped_at, routed_at) {
            e.sent_since_scrape = e.sent_since_scrape.saturating_add(1);
            e.sent_tokens_since_scrape = e.sent_tokens_since_scrape.saturating_add(uncached);
        }
        let slot = e.slot;
        self.index.record(slot, blocks);
        self.rotation = self.rotation.wrapping_add(1);
        self.mean_uncached = 0.9 * self.mean_uncached + 0.1 * uncached.0 as f64;
        let record = Inflight {
            key,
            endpoint: endpoint.clone(),
            routed_at,
            prefilling: true,
            blocks: blocks.to_vec(),
            prompt_tokens,
            uncached,
            predicted_ttft_ms: f64::NAN,
        };
        if let Some(old) = self.inflight.insert(key, record) {
            self.release(&old);
        }
        if let Some(e) = self.table.get_mut(endpoint) {
            let cached = prompt_tokens.saturating_sub(uncached);
            e.prefilling.insert((routed_at, key), Prefill { cached, uncached });
        }
        // Lost completions must not pin load or memory forever: past 65,536 requests in
        // flight, or past the blocks their records may hold, the oldest others are released
        // (a scan, but only there); the request just placed stays.
        let most_blocks =
            self.config.index().max_memory_bytes / INFLIGHT_BUDGET_DIVISOR / std::mem::size_of::<BlockHash>();
        while self.inflight.len() > MAX_INFLIGHT || self.inflight.blocks() > most_blocks {
            let oldest = self
                .inflight
                .iter()
                .filter(|(k, _)| **k != key)
                .min_by_key(|(_, r)| r.routed_at)
                .map(|(k, _)| *k);
            let Some(old) = oldest.and_then(|k| self.inflight.remove(&k)) else {
                break;
            };
            self.release(&old);
            self.stats.released_unfinished += 1;
        }
        true
    }

    /// `request_id` ended: success, error status, reset or local reply alike.
    pub fn on_completed(&mut self, request_id: u64, done: &Completion, now: Millis) -> Option<Flip> {
        let key = request_key(self.origin, request_id);
        let record = self.inflight.remove(&key)?;
        self.stats.completed += 1;
        let served = done.served_by.clone().unwrap_or_else(|| record.endpoint.clone());
        let moved = (served != record.endpoint).then(|| served.clone());
        // The server's own 503 (vLLM's admission limits): it computed nothing. A moved
        // request that still got a 503 was refused everywhere it went: its prefix is nowhere.
        let refused = done.status == 503;
        let cached = self.cached_reported(&served, done);
        if let (Some(reported), false, Some(e)) = (done.prompt_tokens, refused, self.table.get_mut(&served)) {
            e.seen.on_reported(record.prompt_tokens, reported);
        }
        if refused {
            self.release(&record);
            self.refused_by(&record, now);
            if moved.is_some() {
                self.stats.refusals += 1;
            }
        } else {
            self.finish(&record, moved.as_ref(), cached, now);
        }
        if let Some(cached) = cached {
            let predicted = record.prompt_tokens.saturating_sub(record.uncached).0;
            let cached_in_prompt = cached.min(record.prompt_tokens.0);
            self.stats.overpredicted_tokens += predicted.saturating_sub(cached_in_prompt);
            self.stats.underpredicted_tokens += cached_in_prompt.saturating_sub(predicted);
            self.stats.predicted_cached_tokens += predicted;
            self.stats.reported_cached_tokens = self.stats.reported_cached_tokens.saturating_add(cached);
            self.stats.reported_prompt_tokens += record.prompt_tokens.0;
        }
        self.tell_peers(|| PeerEvent::Completed {
            key,
            served_by: moved.filter(|_| !refused),
            cached_tokens: cached,
        });
        let health = self.config.health().clone();
        let refused_ms = self.config.overload().refused_ms;
        let e = self.table.get_mut(&served)?;
        if refused {
            // The server itself refused (the proxy passes Envoy's own 503s, after failed
            // connections, as status 0): it is full, not failing. Ejecting it would take
            // capacity away from an overloaded fleet.
            e.refused_until = Some(now.plus(refused_ms));
            return None;
        }
        if done.client_left {
            return None;
        }
        let ok = done.status != 0 && done.status < 500;
        e.health.on_response(ok, now, &health)
    }

    /// `record.endpoint` refused the request: it counts as refusing for
    /// `overload.refused_ms`, and it computed nothing, so the blocks routing recorded for
    /// it there beyond what the server already held are not there.
    fn refused_by(&mut self, record: &Inflight, now: Millis) {
        let tpb = self.tokens_per_block();
        let held = usize::try_from(record.prompt_tokens.saturating_sub(record.uncached).0 / tpb).unwrap_or(usize::MAX);
        let backoff = self.config.overload().refused_ms;
        let Some(e) = self.table.get_mut(&record.endpoint) else {
            return;
        };
        e.refused_until = Some(now.plus(backoff));
        let slot = e.slot;
        if let Some(new) = record.blocks.get(held..) {
            self.index.forget(slot, new);
        }
    }

    /// What `served` reported cached for a response: the number when the response gave one
    /// (and from then on the server counts as one that reports), 0 when it gave `usage`
    /// without details and the server has reported before (vLLM omits the details of a
    /// miss), nothing otherwise.
    fn cached_reported(&mut self, served: &EndpointId, done: &Completion) -> Option<u64> {
        let e = self.table.get_mut(served)?;
        if done.cached_tokens.is_some() {
            e.reports_cached = true;
            return done.cached_tokens;
        }
        (done.usage && e.reports_cached).then_some(0)
    }

    /// Releases a request's load and learns where its prefix lives: where it was served when
    /// a retry `moved` it (the server it was sent to refused it: it goes last for
    /// `overload.refused_ms`), and how much the server really had cached.
    pub(super) fn finish(&mut self, record: &Inflight, moved: Option<&EndpointId>, cached: Option<u64>, now: Millis) {
        self.release(record);
        if record.prefilling {
            // Served without a first token seen (a peer's that came late, a response with
            // no body before its end): the server counted its prompt all the same.
            if let Some(e) = self.table.get_mut(moved.unwrap_or(&record.endpoint)) {
                e.seen.on_served(record.prompt_tokens);
            }
        }
        if let Some(served) = moved {
            self.stats.refusals += 1;
            self.refused_by(record, now);
            if let Some(slot) = self.table.get(served).map(|e| e.slot) {
                self.index.record(slot, &record.blocks);
            }
        } else if let (Some(cached), true) = (cached, self.config.index().learn_from_usage) {
            self.learn_from_cached(record, cached);
        }
    }

    /// Engine truth corrects the guess. vLLM reported `cached` tokens of this request were
    /// already cached where the index predicted `prompt - uncached`. When it had fewer, the
    /// server evicted blocks the index still lists: since vLLM evicts least recently used
    /// first, the index's oldest entries for that server are gone too, and the index keeps
    /// less for it from now on. When it had as many or more, the index may keep more again.
    /// (The request's own blocks are on the server now either way: it just computed them.)
    /// One block of slack absorbs the difference between our token estimate and the
    /// server's tokenizer.
    ///
    /// A miss says that much only where traffic the router did not see filled the server's
    /// cache (a replica that does not share, a client that bypasses the gateway): it counts
    /// in proportion to that share, in full from `seen::UNSEEN_FULL`
    /// (`SeenShare::miss_weight`). Where the router and its peers saw everything a server
    /// served, the index already models the evictions, and misses come from what it
    /// does not model (a prompt waits in a queue long enough to lose its prefix, decode
    /// blocks, blocks pinned by running requests); shrinking on those forgot conversations
    /// vLLM still held (replay, multi-turn past capacity on 7 H100s: after 40 s a hit rate
    /// of 36.5% against 52.1%, TTFT p50 191 against 46 ms; BENCHMARKS "A miss counts as
    /// much as the traffic the router did not see").
    fn learn_from_cached(&mut self, record: &Inflight, cached: u64) {
        let tpb = self.tokens_per_block();
        let predicted = record.prompt_tokens.saturating_sub(record.uncached).0;
        let cached = cached.min(record.prompt_tokens.0);
        let Some((slot, weight)) = self.table.get(&record.endpoint).map(|e| (e.slot, e.seen.miss_weight())) else {
            return;
        };
        let (predicted_blocks, cached_blocks) = (predicted / tpb, cached / tpb);
        if predicted_blocks > cached_blocks + 1 {
            let missing = ((predicted_blocks - cached_blocks) as f64 * weight).round() as usize;
            if missing > 0 {
                self.index.on_overpredicted(slot, missing);
            }
        } else {
            let new_blocks = usize::try_from(record.uncached.0 / tpb).unwrap_or(usize::MAX);
            self.index.on_confirmed(slot, new_blocks.max(1));
        }
    }

    /// The first token (or the response headers of a stream) of `request_id` arrived: its
    /// prefill is done.
    pub fn on_first_token(&mut self, request_id: u64, now: Millis) {
        self.first_token(request_id, true, now);
    }

    /// The first token of `request_id` came from another server than the one it was routed
    /// to (a retry moved it): its prefill is done, but its time says nothing of the routed
    /// server's predictions, so neither this router nor its peers learn from it.
    pub fn on_first_token_elsewhere(&mut self, request_id: u64, now: Millis) {
        self.first_token(request_id, false, now);
    }

    fn first_token(&mut self, request_id: u64, timed_here: bool, now: Millis) {
        let key = request_key(self.origin, request_id);
        let timed = self
            .inflight
            .get(&key)
            .filter(|_| timed_here)
            .map(|r| (r.predicted_ttft_ms, now.since(r.routed_at) as f64));
        let mut ttft = None;
        if let (true, Some((predicted, observed))) = (self.config.tiers().on(), timed) {
            self.learn_ttft(key, predicted, observed, now);
            ttft = TtftSample::new(predicted, observed);
        }
        if self.prefill_done(key, now) {
            self.tell_peers(|| PeerEvent::FirstToken { key, ttft });
        }
    }

    /// Tiers learn how far off request `key`'s predicted TTFT ran on its server (this
    /// router's stream, or a peer's sample): only while its prefill is pending here, so a
    /// first token teaches once.
    pub(super) fn learn_ttft(&mut self, key: u64, predicted_ms: f64, observed_ms: f64, now: Millis) {
        if !self.config.tiers().on() {
            return;
        }
        if let Some(r) = self.inflight.get(&key).filter(|r| r.prefilling) {
            if let Some(e) = self.table.get_mut(&r.endpoint) {
                e.ttft_bias.observe(predicted_ms, observed_ms, now);
            }
        }
    }

    /// Request `key` produced its first token at `now` (as far as this router knows: a
    /// peer's arrives a tick or two late).
    pub(super) fn prefill_done(&mut self, key: u64, now: Millis) -> bool {
        let Some(record) = self.inflight.get_mut(&key) else {
            return false;
        };
        if !std::mem::replace(&mut record.prefilling, false) {
            return false;
        }
        let (uncached, routed_at, prompt) = (record.uncached, record.routed_at, record.prompt_tokens);
        let cached = prompt.saturating_sub(uncached);
        let attention_tokens = self.config.cost().attention_tokens;
        let kept = kept_after_first_token(uncached, self.config.cost().served_tokens_kept);
        if let Some(e) = self.table.get_mut(&record.endpoint) {
            e.seen.on_served(prompt);
            if unseen_by_scrape(e.scraped_at, routed_at) {
                e.sent_tokens_since_scrape = e.sent_tokens_since_scrape.saturating_sub(uncached.saturating_sub(kept));
            }
            e.pending_prefill_tokens = e.pending_prefill_tokens.saturating_sub(uncached);
            if e.prefilling
                .first_key_value()
                .is_some_and(|(first, _)| *first == (routed_at, key))
            {
                // The request taken to be in prefill finished: one sample of the pace, and
                // the next one starts now.
                let started = e.front_started().unwrap_or(routed_at);
                let work = speed::prefill_work(cached.0 as f64, uncached.0 as f64, attention_tokens);
                e.pace
                    .observe(uncached.0, work, now.since(started), started == routed_at, now);
                e.front_done_at = Some(now);
            }
            e.end_prefill(routed_at, key);
        }
        true
    }

    pub(super) fn release(&mut self, record: &Inflight) {
        let share = self.config.cost().served_tokens_kept;
        if let Some(e) = self.table.get_mut(&record.endpoint) {
            e.inflight = e.inflight.saturating_sub(1);
            if record.prefilling {
                e.pending_prefill_tokens = e.pending_prefill_tokens.saturating_sub(record.uncached);
                e.end_prefill(record.routed_at, record.key);
            }
            if unseen_by_scrape(e.scraped_at, record.routed_at) {
                e.sent_since_scrape = e.sent_since_scrape.saturating_sub(1);
                let counted = counted_since_scrape(record, share);
                e.sent_tokens_since_scrape = e.sent_tokens_since_scrape.saturating_sub(counted);
            }
        }
    }

    /// A successful scrape of `id` taken at `scraped_at`.
    pub fn on_metrics(&mut self, id: &EndpointId, metrics: VllmMetrics, scraped_at: Millis) -> Option<Flip> {
        let tpb = self.tokens_per_block();
        let default_capacity = self.config.index().default_capacity_tokens;
        let health = self.config.health().clone();
        // Requests routed since the scrape was taken are still unseen by it (a snapshot
        // reaches a worker some milliseconds after the scrape).
        let (mut sent, mut sent_tokens) = (0u32, Tokens(0));
        let share = self.config.cost().served_tokens_kept;
        for r in self
            .inflight
            .values()
            .filter(|r| r.endpoint == *id && r.routed_at >= scraped_at)
        {
            sent = sent.saturating_add(1);
            sent_tokens = sent_tokens.saturating_add(counted_since_scrape(r, share));
        }
        let prior = self.config.cost().prefill_tokens_per_s;
        let e = self.table.get_mut(id)?;
        e.speed.on_counters(
            metrics.prefill_computed_tokens,
            metrics.prefill_seconds,
            prior,
            scraped_at,
        );
        e.step.on_counters(metrics.itl_seconds, metrics.itl_count, scraped_at);
        e.seen.on_counters(metrics.prompt_tokens, scraped_at);
        e.completions.on_counters(metrics.finished, scraped_at);
        e.completions.on_queue(metrics.running, metrics.waiting);
        let capacity_blocks = metrics.capacity_tokens().unwrap_or(default_capacity) / tpb;
        e.metrics = Some(metrics);
        e.scraped_at = Some(scraped_at);
        e.sent_since_scrape = sent;
        e.sent_tokens_since_scrape = sent_tokens;
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

    /// The scraping side's view of the fleet (see `fleet`): membership (when the pool is
    /// discovered; a static pool stays the configured list), Envoy's verdict on each host,
    /// the scrape verdict, metrics newer than those held, and models.
    pub fn on_fleet(&mut self, state: &FleetState) {
        if self.config.discovers() {
            let ids: Vec<EndpointId> = state.members.iter().map(|m| m.id.clone()).collect();
            self.on_endpoints(&ids);
        }
        for m in &state.members {
            let Some(known_at) = self.table.get(&m.id).map(|e| e.scraped_at) else {
                continue;
            };
            if let (Some(metrics), Some(at)) = (&m.metrics, m.scraped_at) {
                if known_at.is_none_or(|t| t < at) {
                    self.on_metrics(&m.id, metrics.clone(), at);
                }
            }
            if let Some(e) = self.table.get_mut(&m.id) {
                e.health.set_active(m.scrape_healthy);
                e.envoy = m.envoy;
                e.priority = m.priority;
                e.lb_weight = m.weight.max(1);
                if e.models != m.models {
                    e.models.clone_from(&m.models);
                }
            }
        }
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

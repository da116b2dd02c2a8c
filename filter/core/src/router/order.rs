//! How `Router::route` orders the candidates that may serve: their costs (`policy`), then
//! the rules that put another candidate first (the rendezvous owner of a cold prefix, the
//! holder of most of the prompt, the cheapest tier that meets the objective).

use super::{RouteRequest, Router};
use crate::config::PolicyKind;
use crate::decision::Tiering;
use crate::policy::{self, Candidate, ScoreContext};
use crate::seen::UNSEEN_FULL;
use crate::types::{BlockHash, Millis};

impl Router {
    /// What scoring `cands` needs to know of the fleet as a whole.
    pub(super) fn context(&self, req: &RouteRequest, cands: &[Candidate], now: Millis) -> ScoreContext {
        let rates = policy::rate_classes(&self.config, cands, now);
        let rate_per_pace = policy::rate_per_pace(&self.config, cands, &rates, now);
        let ctx = ScoreContext {
            total_blocks: req.blocks.len(),
            fleet_backlog: policy::fleet_backlog(&self.config, cands, self.mean_uncached, now),
            unlike: false,
            mean_uncached_tokens: self.mean_uncached,
            rotation: self.rotation,
            seed: self.config.seed(),
            now,
            typical_weight: policy::typical_weight(&self.config, cands, &rates, now),
            rates,
            typical_pace: policy::typical_pace(&self.config, cands, now),
            rate_per_pace,
            typical_step: None,
            fastest_step: None,
        };
        let ctx = ScoreContext {
            unlike: policy::unlike_rates(&self.config, cands, &ctx),
            ..ctx
        };
        policy::with_steps(&self.config, cands, ctx)
    }

    /// Each candidate's score; under the cost policy a LoRA adapter not loaded on a server
    /// adds its load time (it must be loaded before the prefill).
    pub(super) fn terms(&self, req: &RouteRequest, cands: &[Candidate], ctx: &ScoreContext) -> Vec<policy::Terms> {
        let mut terms = policy::score(&self.config, cands, ctx);
        if self.config.policy() == PolicyKind::Cost {
            let load_ms = self.config.cost().lora_load_ms;
            for (t, c) in terms.iter_mut().zip(cands) {
                if c.endpoint.adapter_state(&req.model).is_some_and(|(loaded, _)| !loaded) {
                    t.prefill_ms += load_ms;
                    t.cost.0 += load_ms;
                    t.ttft_ms += load_ms;
                }
            }
        }
        terms
    }

    /// The candidates best first, the tier chosen (tiers configured) and whether the holder
    /// of most of the prompt went first at a higher cost (`prefer_prefix_holder`).
    pub(super) fn order(
        &self,
        req: &RouteRequest,
        cands: &[Candidate],
        terms: &[policy::Terms],
        ctx: &ScoreContext,
    ) -> (Vec<usize>, Option<Tiering>, bool) {
        let mut order: Vec<usize> = (0..cands.len()).collect();
        // Equal costs go to the longer prefix match, then (the sort is stable and candidates
        // are in id order) to the lower endpoint id.
        order.sort_by(|a, b| {
            terms[*a]
                .cost
                .total_cmp(&terms[*b].cost)
                .then(cands[*b].matched_blocks.cmp(&cands[*a].matched_blocks))
        });
        // Both rules below act on cold prompts only, the holder rule only where some
        // candidate holds part of the prompt: neither moves the best before the other reads it.
        let binds = self.storage_binds(&order, cands, ctx);
        let roomy = binds && self.prefer_room_owner(req, &mut order, cands, terms);
        if let Some(first) = req.blocks.first().filter(|_| !roomy) {
            self.prefer_rendezvous_owner(*first, &mut order, cands, terms, ctx);
        }
        let holder_first = self.prefer_prefix_holder(req.blocks.len(), &mut order, cands, terms, binds);
        let before_tiers = order[0];
        let tier = self.choose_tier(req, &mut order, cands, terms, ctx);
        // Tiers may put another server first.
        let holder_first = holder_first && order[0] == before_tiers;
        (order, tier, holder_first)
    }

    /// For a prefix no endpoint holds, moves the rendezvous owner of its first block to the
    /// front when its cost is within `cold_tolerance` of the best, so independent workers
    /// and gateway replicas send the same cold prefix to the same place.
    ///
    /// The owner is drawn by weighted rendezvous (`cold_balance`): a candidate whose share of
    /// the prefix index, per unit of its prefill rate, lies above the candidates' mean
    /// weighs less, so prefixes spread by what each server already holds as a smallest-tree
    /// rule spreads them, while routers with the same view (workers and replicas that share
    /// their placements) still draw the same owner. With the plain hash the 64 groups of
    /// shared-prefix fell 6 to 10 on a server (replay); a server with 10 groups gets 10
    /// groups' traffic for the rest of the run.
    fn prefer_rendezvous_owner(
        &self,
        first: BlockHash,
        order: &mut [usize],
        cands: &[Candidate],
        terms: &[policy::Terms],
        ctx: &ScoreContext,
    ) {
        let affinity_policy = matches!(self.config.policy(), PolicyKind::Cost | PolicyKind::Weighted);
        if !affinity_policy || cands.iter().any(|c| c.matched_blocks > 0) {
            return;
        }
        let near = near_best(order, terms, self.config.cost().cold_tolerance);
        if near < 2 {
            return;
        }
        let weights = self.balance_weights(cands, ctx);
        let draw = |pos: &usize| {
            let i = order[*pos];
            policy::weighted_rendezvous(first, &cands[i].endpoint.id, weights[i])
        };
        let owner = (0..near).max_by(|a, b| draw(a).total_cmp(&draw(b)));
        if let Some(pos) = owner {
            order[..=pos].rotate_right(1);
        }
    }

    /// Each candidate's rendezvous weight for a cold prefix (`prefer_rendezvous_owner`):
    /// e^(−cold_balance × r), r the candidate's prefix index entries per unit of prefill
    /// rate above the candidates' mean, as a fraction of that mean (1 for every candidate
    /// while the index is empty, with `cold_balance` 0, or while this router does not see
    /// most of every candidate's traffic).
    fn balance_weights(&self, cands: &[Candidate], ctx: &ScoreContext) -> Vec<f64> {
        let plain = || vec![1.0; cands.len()];
        let k = self.config.cost().cold_balance;
        // Routers that do not see most of the servers' traffic (gateway replicas that do
        // not share their placements) each hold a different part of the index: weighted
        // by it, they stop agreeing on owners (replay, 4 such replicas: shared-prefix and
        // multi-turn TTFT p95 up to 19% worse).
        let seen_all = cands
            .iter()
            .all(|c| c.endpoint.seen.unseen().is_some_and(|u| u < UNSEEN_FULL));
        if k <= 0.0 || !seen_all {
            return plain();
        }
        // What a server holds, or what its live conversations will hold once grown where
        // that is more: by what it holds now, a server that joined while conversations
        // opened won every draw it was near the best for (replay, an H100 joining 3 H100 + 4
        // A100 at 150 s: 172 of the 381 conversations opened after it, TTFT p95 after the
        // last opened 44–68 ms; by the projection 131 and 42–45 ms; BENCHMARKS, "The slower
        // opening and a join").
        let held: Vec<f64> = cands
            .iter()
            .map(|c| {
                let slot = c.endpoint.slot;
                let held = self.index.held(slot) as f64;
                let held = self.index.projected_held(slot).map_or(held, |p| held.max(p));
                held / policy::server_rate(&self.config, c, ctx)
            })
            .collect();
        let mean = held.iter().sum::<f64>() / held.len().max(1) as f64;
        if !mean.is_normal() {
            return plain();
        }
        // Bounded so that the weights stay finite and non-zero.
        held.iter()
            .map(|h| (-k * (h - mean) / mean).clamp(-60.0, 60.0).exp())
            .collect()
    }

    /// With the cost policy: the candidate holding the most of the prompt goes first when it
    /// holds at least `cost.holder_min_share` of its blocks, more than the best-scored
    /// candidate, and costs at most `cost.holder_tolerance` more. The cost ranks a server
    /// deep into long prompts as busier than it is: it keeps each of this gateway's prompts
    /// there pending until its first token, less a credit for the one in prefill, and the
    /// holder of a long shared context is usually such a server (Mooncake trace at 50%: 49.9k
    /// tokens pending on average where 23.6k were left). Recomputing most of a long prompt
    /// elsewhere also spends capacity the fleet needs once it is loaded. On the Mooncake
    /// trace this took the captured share of reachable reuse from 95% / 92% to 97% / 97% at
    /// 50 / 80% load, with TTFT p95 the same there and 7% lower at 110%; a wider rule (any
    /// holder, or a half share) cost rag +5% to +31% (BENCHMARKS, "The holder of most of a
    /// prompt"). Returns whether it moved one.
    fn prefer_prefix_holder(
        &self,
        blocks: usize,
        order: &mut [usize],
        cands: &[Candidate],
        terms: &[policy::Terms],
        storage_binds: bool,
    ) -> bool {
        let c = self.config.cost();
        // Where the caches bind, a conversation placed by room stays there: at
        // `holder_tolerance` its later turns went back to a faster GPU's cache (replay,
        // long-chat on 4 H100 + 4 A100: TTFT p95 95 / 133 / 598 / 296 ms at 50–130%,
        // against 90 / 91 / 94 / 97 widened; the Mooncake trace 0–4% better unwidened).
        let tolerance = if storage_binds {
            c.holder_tolerance.max(c.storage_tolerance)
        } else {
            c.holder_tolerance
        };
        if self.config.policy() != PolicyKind::Cost || c.holder_tolerance <= 0.0 || order.is_empty() {
            return false;
        }
        let need = c.holder_min_share * blocks as f64;
        let first = cands[order[0]].matched_blocks;
        let near = near_best(order, terms, tolerance);
        // The most blocks, then the lower cost (`order` is sorted by cost).
        let holder = (0..near).max_by_key(|pos| (cands[order[*pos]].matched_blocks, std::cmp::Reverse(*pos)));
        if let Some(pos) = holder {
            let matched = cands[order[pos]].matched_blocks;
            if matched > first && f64::from(matched) >= need {
                order[..=pos].rotate_right(1);
                return true;
            }
        }
        false
    }

    /// Tiers (`tiers`): the servers of the cheapest tier whose best predicted TTFT meets the
    /// planned share of the request's objective go first, or the best scored server's tier
    /// where it is cheaper still and that server meets the whole objective; with none, the
    /// cheapest tier's within the whole objective; with none of those either, the tier of
    /// the best scored server (the cost decides, as without tiers), unless the request
    /// would miss even on an idle server (a request that fits nowhere does not spill: the
    /// cheapest tier's). Best first within the tier; the other tiers follow in score order
    /// as retries.
    fn choose_tier(
        &self,
        req: &RouteRequest,
        order: &mut [usize],
        cands: &[Candidate],
        terms: &[policy::Terms],
        ctx: &ScoreContext,
    ) -> Option<Tiering> {
        let now = ctx.now;
        let tiers = self.config.tiers();
        if !tiers.on() {
            return None;
        }
        let whole = req.ttft_objective_ms.unwrap_or(tiers.ttft_objective_ms);
        // The share of the objective planned for leaves a margin for the prediction's error.
        let planned = whole * tiers.objective_share;
        let tier_of = |i: &usize| tiers.tier_of(&cands[*i].endpoint.id, cands[*i].endpoint.priority);
        let cheapest = order.iter().map(tier_of).min()?;
        // Predictions are scaled by how far off they have been on each server, and are never
        // shorter than the wait of this router's own oldest request there still without a
        // first token: a server that stopped admitting work (its sequences or KV cache
        // full of long decodes) shows it there long before the slow first tokens teach the
        // scaling. A server whose sequence slots are all taken (when the tier's are given)
        // meets nothing until one frees.
        let scaled: Vec<Option<f64>> = cands
            .iter()
            .zip(terms)
            .map(|(c, t)| {
                let e = c.endpoint;
                let admits = e.oldest_pending_ms(now) as f64 <= planned
                    && !tiers.full(tiers.tier_of(&e.id, e.priority), e.inflight);
                admits.then(|| t.ttft_ms * e.ttft_bias.factor(now))
            })
            .collect();
        let within = |limit: f64| -> Vec<bool> { scaled.iter().map(|s| s.is_some_and(|ms| ms <= limit)).collect() };
        let (meets, meets_whole) = (within(planned), within(whole));
        let cheapest_of = |ok: &[bool]| order.iter().filter(|i| ok[**i]).map(tier_of).min();
        // Where nothing is predicted within the planned share, the margin goes before the
        // tier does: the cheapest tier predicted within the whole objective (its oldest
        // wait still within the share). Without this a burst that fits nowhere with the
        // margin went to the cheap tier whole, where the premium tier still met the
        // objective (replay, rag at 40 req/s on 4 A100 + 3 H100, 1 s: the worst of six
        // seeds 98.7 → 99.7%).
        let meeting = cheapest_of(&meets).or_else(|| cheapest_of(&meets_whole));
        // The margin buys no dearer tier than the best scored server's, where that server is
        // predicted within the whole objective: the cost would send the request there
        // without tiers, and it meets the objective. Without this, a cheap tier predicted
        // between the planned share and the objective lost its work to the premium tier
        // whose servers still met the share, until they no longer did and the cheap tier
        // took a burst at once (replay, rag at 40 req/s on 4 A100 + 4 H100, 500 ms, steady
        // state, 12 seeds: 99.4 [97.7-100.0]% -> 100.0 [99.9-100.0]%; untiered 100.0%).
        let best_tier = order.first().filter(|i| meets_whole[**i]).map(tier_of);
        let meeting = match (meeting, best_tier) {
            (Some(m), Some(b)) if b < m => Some(b),
            (m, _) => m,
        };
        // Where nothing is predicted within the objective, the fleet is past what the tiers
        // plan for, and they step aside: the request goes where the cost puts it, the tier
        // of the best scored server. Only a request that would miss even on an idle server
        // fits nowhere and stays in the cheapest tier. With the cheapest tier for every such
        // request, the cheap tier took the whole overload while the premium tier idled
        // (replay, rag at 40 req/s on 4 A100 + 3 H100, 500 ms, steady state: the A100s' TTFT
        // median grew past 170 s while the H100s' stayed near 250 ms with 19% of the
        // requests; attainment 18% against untiered routing's 75%). The idle check is the
        // plain prefill: the learned scaling measures busy servers, and at overload it
        // would call every prompt one that fits nowhere.
        let tier = meeting.unwrap_or_else(|| {
            let fits_idle = cands
                .iter()
                .any(|c| policy::prefill_ms(&self.config, c, ctx, c.uncached) <= whole);
            match order.first() {
                Some(i) if fits_idle => tier_of(i),
                _ => cheapest,
            }
        });
        // The chosen tier first, and in it the servers that meet the objective: the best
        // scored may be one that stopped admitting.
        order.sort_by_key(|i| (tier_of(i) != tier, !meets[*i], !meets_whole[*i]));
        Some(Tiering {
            tier,
            spilled: tier != cheapest,
            met: meeting.is_some(),
        })
    }
}

/// How many candidates at the front of `order` (sorted by cost) cost at most `tolerance`
/// more than the first.
pub(super) fn near_best(order: &[usize], terms: &[policy::Terms], tolerance: f64) -> usize {
    let best = terms[order[0]].cost.0;
    let limit = best + best.abs() * tolerance + 1e-9;
    order.iter().take_while(|i| terms[**i].cost.0 <= limit).count()
}

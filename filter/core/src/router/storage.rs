//! The storage rule: on a fleet of unlike GPUs, whether the fast servers' caches bind
//! (`Router::storage_binds`), and where a cold prompt goes while they do
//! (`Router::prefer_room_owner`). Called from `Router::order`.

use super::order::near_best;
use super::{RouteRequest, Router};
use crate::config::PolicyKind;
use crate::policy::{self, Candidate, ScoreContext};

impl Router {
    /// Whether the cache of the best-scored server (`order[0]`) binds on a fleet of unlike
    /// GPUs: its part of the prefix index is at least `cost.storage_fill` full, and either
    /// at least `cost.storage_lost_share` of its evictions come back
    /// (`PrefixIndex::lost_share`; its class mates' where it has evicted too little to tell,
    /// `class_lost_share`), or, before any of them evicted enough, its hits reach
    /// back to the oldest of its content (`PrefixIndex::reuse_depth` at least
    /// `cost.storage_depth`: what it will evict first is still asked for). The faster GPUs
    /// draw most of the work by cost, into caches no larger than the slower ones': where
    /// the prompts come back (conversations), the fast caches overflow and least recently
    /// used eviction then keeps almost nothing (replay, long-chat on 4 H100 + 4 A100 at
    /// 80%: the H100s' hit rate fell from 0.69 to 0.00–0.02 within 30 s, 85% of requests on
    /// them). The depth of the hits is the early sign: where histories stop coming back
    /// before the cache fills (the same workload with conversations starting at under half
    /// the pace, or the Mooncake trace), it falls below 0.9 and speed decides again. With
    /// the fill alone the rule bound there for as long as conversations opened (TTFT p95
    /// 92 ms against 48–52 with the depth and 34 with no rule) and cost the Mooncake trace
    /// 4–11% (BENCHMARKS, "When the fast caches will not overflow").
    pub(super) fn storage_binds(&self, order: &[usize], cands: &[Candidate], ctx: &ScoreContext) -> bool {
        let c = self.config.cost();
        let Some(best) = order.first().map(|i| &cands[*i]) else {
            return false;
        };
        ctx.unlike
            && c.storage_tolerance > 0.0
            && self.config.policy() == PolicyKind::Cost
            && self.index.fill(best.endpoint.slot) >= c.storage_fill
            && match self
                .index
                .lost_share(best.endpoint.slot)
                .or_else(|| self.class_lost_share(best, cands, ctx))
            {
                Some(lost) => lost >= c.storage_lost_share,
                None => self
                    .index
                    .reuse_depth(best.endpoint.slot)
                    .is_some_and(|d| d >= c.storage_depth),
            }
    }

    /// The mean lost share (`PrefixIndex::lost_share`) of the candidates scored within
    /// `policy::UNLIKE` of `best`'s rate (its class: the other GPUs like it) that have
    /// evicted enough to tell, each counting once; none where none has. Only candidates
    /// count: servers of another model or out of health tell nothing of this request's
    /// traffic. A server that joined a running fleet has evicted nothing yet and all its
    /// content is young, so its hits reach back to its oldest content (reuse depth 1)
    /// whatever the workload: judged alone its cache bound as soon as it was
    /// `cost.storage_fill` full, and cold prompts went by room to the slower GPUs while its
    /// class mates' caches had shown that what they evict is not asked for again (replay,
    /// an H100 joining 3 H100 + 4 A100 at 150 s on conversations that end before the
    /// caches overflow: TTFT p95 after the last conversation opened 37–45 ms, seeds 0–8;
    /// borrowing the class's share, 33–41, lower on every seed; BENCHMARKS, "A server that
    /// joins borrows its class's evictions").
    fn class_lost_share(&self, best: &Candidate, cands: &[Candidate], ctx: &ScoreContext) -> Option<f64> {
        // Rates are read only for servers with a share: none before the first evictions.
        let mut rate = None;
        let (mut sum, mut known) = (0.0, 0u32);
        for c in cands {
            let Some(lost) = self.index.lost_share(c.endpoint.slot) else {
                continue;
            };
            let best_rate = *rate.get_or_insert_with(|| policy::server_rate(&self.config, best, ctx));
            let r = policy::server_rate(&self.config, c, ctx);
            if r * policy::UNLIKE > best_rate && r < best_rate * policy::UNLIKE {
                sum += lost;
                known += 1;
            }
        }
        (known > 0).then(|| sum / f64::from(known))
    }

    /// Where the caches bind (`storage_binds`, checked by the caller), a cold prompt (no
    /// candidate holds any of it) goes to the owner drawn by weighted rendezvous among the
    /// candidates that cost at most `1 + cost.storage_tolerance` times the best, each
    /// weighing (room + 0.01)^4 × (1 − lost share). Room is the share of its part of the
    /// prefix index that holds nothing still asked for, 1 − fill × reuse depth (content
    /// older than its hits reach is evicted first), so caches full of finished
    /// conversations count as having room beside a server that just joined (replay: it
    /// still draws about half the new ones at first). The power sends most new prefixes to
    /// the emptier caches, so the fast ones stop filling first (replay, long-chat at 80%
    /// with the fill test at 0.3: at power 1 the H100s still overflowed, 165 ms against 153
    /// without the rule; at 4, 94.5 ms).
    /// Returns whether it moved one.
    pub(super) fn prefer_room_owner(
        &self,
        req: &RouteRequest,
        order: &mut [usize],
        cands: &[Candidate],
        terms: &[policy::Terms],
    ) -> bool {
        let Some(first) = req.blocks.first() else {
            return false;
        };
        if cands.iter().any(|c| c.matched_blocks > 0) {
            return false;
        }
        let near = near_best(order, terms, self.config.cost().storage_tolerance);
        let draw = |pos: &usize| {
            let c = &cands[order[*pos]];
            let slot = c.endpoint.slot;
            let live = self.index.fill(slot) * self.index.reuse_depth(slot).unwrap_or(1.0);
            let room = (1.0 - live).max(0.0);
            let lost = self.index.lost_share(slot).unwrap_or(0.0);
            let weight = (room + 0.01).powi(4) * (1.0 - lost).max(0.01);
            policy::weighted_rendezvous(*first, &c.endpoint.id, weight)
        };
        match (0..near).max_by(|a, b| draw(a).total_cmp(&draw(b))) {
            Some(pos) if pos > 0 => {
                order[..=pos].rotate_right(1);
                true
            }
            _ => false,
        }
    }
}

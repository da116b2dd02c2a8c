//! Which endpoints may serve a request (`Router::route`'s first half): each endpoint's
//! prefix match and why it was left out, if it was; servers that should serve only when
//! nothing better is left; the overload limits.

use super::{RouteRequest, Router};
use crate::config::PolicyKind;
use crate::decision::{EndpointScore, FilterReason, Outcome};
use crate::endpoint::Endpoint;
use crate::fleet::EnvoyHealth;
use crate::health::HealthState;
use crate::metrics::VllmMetrics;
use crate::policy::Candidate;
use crate::types::{Cost, Millis, Tokens};

/// Candidates with their row in the breakdown.
pub(super) type Rows<'a> = Vec<(usize, Candidate<'a>)>;

impl Router {
    /// Every endpoint's row of the breakdown (its match, or why it may not serve) and the
    /// candidates among them.
    pub(super) fn candidates(
        &self,
        req: &RouteRequest,
        model_known: bool,
        now: Millis,
    ) -> (Vec<EndpointScore>, Rows<'_>) {
        let rows = self.table.rows();
        let slots = rows.iter().map(|e| usize::from(e.slot) + 1).max().unwrap_or(0);
        let mut matched = vec![0u32; slots];
        self.index.matches(&req.blocks, &mut matched);
        let stale_after = self.config.health().stale_after_ms;
        let mut breakdown = Vec::with_capacity(rows.len());
        let mut cands = Vec::with_capacity(rows.len());
        for e in rows {
            let m = matched.get(usize::from(e.slot)).copied().unwrap_or(0);
            let cached = Tokens((u64::from(m) * self.tokens_per_block()).min(req.prompt_tokens.0));
            let uncached = req.prompt_tokens.saturating_sub(cached);
            let fresh = e.fresh_metrics(now, stale_after);
            let filtered = self.filter(e, fresh, req, model_known, now);
            if let (None, Some(metrics)) = (filtered, fresh) {
                cands.push((
                    breakdown.len(),
                    Candidate {
                        endpoint: e,
                        metrics,
                        matched_blocks: m,
                        uncached,
                    },
                ));
            }
            breakdown.push(EndpointScore {
                endpoint: e.id.clone(),
                matched_blocks: m,
                uncached_tokens: uncached,
                prefill_ms: 0.0,
                decode_ms: 0.0,
                kv_ms: 0.0,
                cost: Cost(f64::NAN),
                ttft_ms: f64::NAN,
                filtered,
            });
        }
        (breakdown, cands)
    }

    /// The overload limits (`overload.queue_limit`, `overload.kv_limit`). The cost policy
    /// prices each server's queue and KV pressure in time (the scraped waiting count and KV
    /// usage are among its inputs) and does not also cut servers at a limit: a scrape up to
    /// an interval old cut the servers that had just crossed it, and the rest drew everything
    /// until they crossed it in turn (replay, 8 H100s: at the Azure trace's 110% load the
    /// queued prefill drifted 2.4× apart between servers, TTFT p95 5,907 ms, 5,101 without
    /// the cut; Mooncake at 130%, where KV usage crosses 0.95, 18,762 → 10,848 ms;
    /// BENCHMARKS "The overload limits"). The limits still decide when every server is past
    /// them: a sheddable request is then shed (the outcome returned).
    pub(super) fn cut_overloaded(
        &self,
        req: &RouteRequest,
        cands: &mut Rows<'_>,
        breakdown: &mut [EndpointScore],
    ) -> Option<Outcome> {
        let overload = self.config.overload();
        let over = |c: &Candidate| c.metrics.waiting >= overload.queue_limit || c.metrics.kv_usage >= overload.kv_limit;
        if cands.iter().all(|(_, c)| over(c)) {
            return req.sheddable.then_some(Outcome::Shed {
                retry_after_s: overload.retry_after_s,
            });
        }
        if self.config.policy() != PolicyKind::Cost {
            for (row, _) in cands.iter().filter(|(_, c)| over(c)) {
                breakdown[*row].filtered = Some(FilterReason::Overloaded);
            }
            cands.retain(|(_, c)| !over(c));
        }
        None
    }

    /// Why `e` may not serve `req`, if it may not.
    fn filter(
        &self,
        e: &Endpoint,
        fresh: Option<&VllmMetrics>,
        req: &RouteRequest,
        model_known: bool,
        now: Millis,
    ) -> Option<FilterReason> {
        match e.envoy {
            EnvoyHealth::Excluded => return Some(FilterReason::ExcludedByEnvoy),
            EnvoyHealth::Draining => return Some(FilterReason::Draining),
            EnvoyHealth::Serve | EnvoyHealth::Degraded => {}
        }
        if e.health.state() == HealthState::Unhealthy {
            return Some(FilterReason::Unhealthy);
        }
        if e.health.is_ejected(now) {
            return Some(FilterReason::Ejected);
        }
        let Some(m) = fresh else {
            return Some(if e.metrics.is_some() {
                FilterReason::Stale
            } else {
                FilterReason::NoMetrics
            });
        };
        // Filter by model only when some endpoint lists it, and only servers that list
        // their models (without `/v1/models`, a name no metrics show may be an idle LoRA
        // adapter).
        if model_known && e.knows_models() && !e.lists_model(&req.model) {
            return Some(FilterReason::ModelNotServed);
        }
        let needed = req.prompt_tokens.0.saturating_add(req.max_tokens.unwrap_or(0));
        if m.capacity_tokens().is_some_and(|cap| needed > cap) {
            return Some(FilterReason::DoesNotFit);
        }
        None
    }
}

/// Degraded hosts, servers with no LoRA slot for this adapter and servers that just refused
/// work serve only when nothing better is left.
pub(super) fn demote(req: &RouteRequest, cands: &mut Rows<'_>, breakdown: &mut [EndpointScore], now: Millis) {
    let demoted = |c: &Candidate| -> Option<FilterReason> {
        if c.endpoint.envoy == EnvoyHealth::Degraded {
            return Some(FilterReason::Degraded);
        }
        if c.endpoint.refusing(now) {
            return Some(FilterReason::Refusing);
        }
        let full = c.endpoint.adapter_state(&req.model).is_some_and(|(_, full)| full);
        full.then_some(FilterReason::LoraSlotsFull)
    };
    if cands.iter().any(|(_, c)| demoted(c).is_none()) {
        for (row, c) in cands.iter() {
            if let Some(reason) = demoted(c) {
                breakdown[*row].filtered = Some(reason);
            }
        }
        cands.retain(|(_, c)| demoted(c).is_none());
    }
}

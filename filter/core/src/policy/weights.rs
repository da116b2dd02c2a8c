//! Each server's speed relative to the others, as the operator gave it, until it is learned.
//!
//! A server's prefill rate is learned from its own metrics and first tokens (`speed`), and
//! until then it is scored at the fleet's typical rate. On a fleet that starts cold that is
//! wrong for every unlike GPU: an A100 beside H100s is scored 3.4× too fast, draws a share
//! of the first conversations and prefixes, and keeps them, as later turns and hits follow
//! their cache (replay, 4 H100 + 4 A100, multi-turn at 50% load: TTFT p95 46.5 ms against
//! the oracle's 24.5). The operator knows which servers are which: a weight per server
//! (`cost.speed_weights`, or with `cost.speed_weights_from_envoy` the host's load-balancing
//! weight in Envoy's pool cluster, where a control plane states relative capacity) scales
//! the typical rate until the server's own rate or pace is known. Weights within
//! `SAME_WITHIN` of the typical servers' count as alike, as learned rates do, and the rate
//! is kept within `CLAMP` of the configured one, as learned rates are.

use crate::config::Config;
use crate::endpoint::Endpoint;
use crate::speed::{CLAMP, SAME_WITHIN};
use crate::types::Millis;

use super::{Candidate, RateClasses};

/// Whether any server can have a weight other than 1 (`cost.speed_weights` names one, or
/// Envoy's weights are read): without, nothing here runs on the request path.
pub fn weights_in_use(config: &Config) -> bool {
    let cost = config.cost();
    !cost.speed_weights.is_empty() || cost.speed_weights_from_envoy
}

/// A server's speed weight: `cost.speed_weights` for its `ip:port`, else its weight in
/// Envoy's pool cluster with `cost.speed_weights_from_envoy` (1 for a static pool), else 1.
pub fn speed_weight(config: &Config, e: &Endpoint) -> f64 {
    let cost = config.cost();
    match cost.speed_weights.get(e.id.as_str()) {
        Some(w) => *w,
        None if cost.speed_weights_from_envoy => f64::from(e.lb_weight),
        None => 1.0,
    }
}

/// The weight of a typical server: the (upper) median weight of the candidates whose
/// learned rate is in the typical class, or of all candidates while none has one. `None`
/// when every candidate has the same weight (nothing to scale: checked first, without
/// allocating, as it is on every request) or learning is off.
pub fn typical_weight(config: &Config, cands: &[Candidate], rates: &RateClasses, now: Millis) -> Option<f64> {
    if !config.cost().learn_speeds || !weights_in_use(config) {
        return None;
    }
    let weight = |c: &Candidate| speed_weight(config, c.endpoint);
    let first = weight(cands.first()?);
    if cands.iter().all(|c| weight(c) == first) {
        return None;
    }
    let typical_rate = rates.typical();
    let in_typical_class = |c: &Candidate| {
        let learned = c.endpoint.speed.learned(now);
        typical_rate.is_some_and(|t| learned.is_some_and(|l| rates.class_of(l) == t))
    };
    let mut weights: Vec<f64> = cands.iter().filter(|c| in_typical_class(c)).map(weight).collect();
    if weights.is_empty() {
        weights = cands.iter().map(weight).collect();
    }
    weights.sort_by(f64::total_cmp);
    weights.get(weights.len() / 2).copied()
}

/// The rate a candidate with no learned rate or placed pace is scored at, from its weight,
/// with the band within which it counts as typical (`SAME_WITHIN`).
pub fn prior_rate(
    config: &Config,
    c: &Candidate,
    typical_weight: Option<f64>,
    typical_rate: f64,
) -> Option<(f64, f64)> {
    let prior = config.cost().prefill_tokens_per_s;
    let rate = typical_rate * speed_weight(config, c.endpoint) / typical_weight?;
    Some((rate.clamp(prior / CLAMP, prior * CLAMP), SAME_WITHIN))
}

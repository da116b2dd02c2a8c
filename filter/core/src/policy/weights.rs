//! Each server's speed relative to the others, as the operator gave it, until it is learned.
//!
//! A server's prefill rate is learned from its own metrics and first tokens (`speed`), and
//! until then it is scored at the fleet's typical rate. On a fleet that starts cold that is
//! wrong for every unlike GPU: an A100 beside H100s is scored 3.4× too fast, draws a share
//! of the first conversations and prefixes, and keeps them, as later turns and hits follow
//! their cache (replay, 4 H100 + 4 A100, multi-turn at 50% load: TTFT p95 46.5 ms against
//! the oracle's 24.5). The operator knows which servers are which: a weight per server
//! (`cost.speed_weights`, or the host's load-balancing weight in Envoy's pool cluster,
//! which is where a control plane states relative capacity) scales the typical rate until
//! the server's own rate or pace is known. Weights within `SAME_WITHIN` of the typical
//! servers' count as alike, as learned rates do, and the ratio is clamped to an eighth and
//! eight times, as learned rates are.

use crate::speed::SAME_WITHIN;

use super::{Candidate, RateClasses};
use crate::config::Config;
use crate::endpoint::Endpoint;
use crate::types::Millis;

/// Weight ratios beyond this either way are clamped (learned rates are clamped alike).
const MAX_RATIO: f64 = 8.0;

/// A candidate's speed weight (`endpoint_speed_weight`).
pub fn speed_weight(config: &Config, c: &Candidate) -> f64 {
    endpoint_speed_weight(config, c.endpoint)
}

/// A server's speed weight: `cost.speed_weights` for its `ip:port`, else its weight in
/// Envoy's pool cluster (1 for a static pool).
pub fn endpoint_speed_weight(config: &Config, e: &Endpoint) -> f64 {
    config
        .cost()
        .speed_weights
        .get(e.id.as_str())
        .copied()
        .unwrap_or(f64::from(e.lb_weight))
}

/// The weight of a typical server: the (upper) median weight of the candidates whose
/// learned rate is in the typical class, or of all candidates while none has one. `None`
/// when every candidate has the same weight (nothing to scale) or learning is off.
pub fn typical_weight(config: &Config, cands: &[Candidate], rates: &RateClasses, now: Millis) -> Option<f64> {
    if !config.cost().learn_speeds {
        return None;
    }
    let all: Vec<f64> = cands.iter().map(|c| speed_weight(config, c)).collect();
    if all.windows(2).all(|w| w[0] == w[1]) {
        return None;
    }
    let typical_rate = rates.typical();
    let mut of_typical: Vec<f64> = cands
        .iter()
        .zip(&all)
        .filter(|(c, _)| {
            let learned = c.endpoint.speed.learned(now);
            typical_rate.is_some_and(|t| learned.is_some_and(|l| rates.class_of(l) == t))
        })
        .map(|(_, w)| *w)
        .collect();
    if of_typical.is_empty() {
        of_typical = all;
    }
    of_typical.sort_by(f64::total_cmp);
    of_typical.get(of_typical.len() / 2).copied()
}

/// The rate a candidate with no learned rate or placed pace is scored at, from its weight:
/// with the band within which it counts as typical (`SAME_WITHIN`).
pub fn prior_rate(
    config: &Config,
    c: &Candidate,
    typical_weight: Option<f64>,
    typical_rate: f64,
) -> Option<(f64, f64)> {
    let ratio = speed_weight(config, c) / typical_weight?;
    Some((typical_rate * ratio.clamp(1.0 / MAX_RATIO, MAX_RATIO), SAME_WITHIN))
}

//! How far off a server's predicted TTFT has run (`TtftBias`): what tiers scale a
//! prediction by before comparing it with an objective.

use super::{CLAMP, FORGET_MS, MIN_SAMPLES};
use crate::types::Millis;

/// How far off a server's predicted TTFT has been: observed ÷ predicted first-token times of
/// streamed requests there (this router's own, and its peers' samples when it shares:
/// `PeerEvent::FirstToken`), averaged in the log domain. The cost policy predicts
/// from lower bounds of the work queued ahead (`policy::predicted_ttft`), good for ranking
/// servers but short in absolute terms on a busy server; tiers compare a prediction with an
/// objective, so they scale it by this. It never changes the ranking itself (a busier server
/// looking slower there would feed on itself; see `speed`'s module note on first-token samples).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct TtftBias {
    log_ratio: Option<f64>,
    /// Exponentially weighted variance of the log ratio.
    log_var: f64,
    samples: u32,
    last: Option<Millis>,
}

/// Predictions shorter than this are left out: a fixed few ms (the step in progress, the
/// network) would read as a large ratio.
pub const BIAS_MIN_PREDICTED_MS: f64 = 20.0;
const BIAS_ALPHA: f64 = 0.1;
/// The factor is the ratio's 90th percentile (a log-normal spread, z = 1.28), not its
/// middle: an objective is a promise per request, so a tier is trusted with a request only
/// when most of its recent requests came in within the prediction so scaled.
const BIAS_Z: f64 = 1.28;

impl TtftBias {
    /// One request: predicted `predicted_ms` at routing, first token after `observed_ms`.
    pub fn observe(&mut self, predicted_ms: f64, observed_ms: f64, now: Millis) {
        if !(predicted_ms.is_finite() && predicted_ms >= BIAS_MIN_PREDICTED_MS && observed_ms.is_finite()) {
            return;
        }
        let l = (observed_ms.max(1.0) / predicted_ms).clamp(1.0 / CLAMP, CLAMP).ln();
        let fresh = self.last.is_some_and(|t| now.since(t) <= FORGET_MS);
        match self.log_ratio {
            Some(x) if fresh => {
                let d = l - x;
                self.log_ratio = Some(x + BIAS_ALPHA * d);
                self.log_var = (1.0 - BIAS_ALPHA) * (self.log_var + BIAS_ALPHA * d * d);
            }
            _ => {
                self.log_ratio = Some(l);
                self.log_var = 0.0;
                self.samples = 0;
            }
        }
        self.samples = self.samples.saturating_add(1);
        self.last = Some(now);
    }

    /// The factor to scale a prediction by: 1 until `MIN_SAMPLES` recent samples.
    pub fn factor(&self, now: Millis) -> f64 {
        match (self.log_ratio, self.last) {
            (Some(l), Some(t)) if self.samples >= MIN_SAMPLES && now.since(t) <= FORGET_MS => {
                (l + BIAS_Z * self.log_var.sqrt()).exp()
            }
            _ => 1.0,
        }
    }
}

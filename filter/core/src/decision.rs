//! What `route()` returns: the endpoints to try in order, why, and the score of every
//! endpoint, so a decision explains itself in logs, debug headers and tests.

use std::fmt;

use crate::types::{Cost, EndpointId, Tokens};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// The best endpoint already holds part of the prompt's prefix.
    PrefixHit,
    /// No endpoint holds the prefix: picked by load (rendezvous among near-equal ones).
    Cold,
    /// Picked without metrics (least gateway in-flight), or nothing could be picked.
    Fallback(FallbackReason),
    /// Every endpoint is overloaded and the request is sheddable: answer 429.
    Shed { retry_after_s: u64 },
    /// Every endpoint is full (`overload.hold`) and the request may wait: the caller holds
    /// it and routes it again when a tick finds room.
    Hold,
    /// It continues a stored response: sent to the server that stored it.
    ResponseHome,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FallbackReason {
    /// No endpoint has fresh metrics: ordered by the gateway's own in-flight counts.
    NoMetrics,
    /// No endpoint may serve (all unhealthy, ejected or absent): `endpoints` is empty.
    NoEndpoints,
    /// No server lists the requested model: Envoy balances it (and the server answers).
    UnknownModel,
}

impl Outcome {
    /// A short label for stats and the `x-kvroute-reason` debug header.
    pub fn label(&self) -> &'static str {
        match self {
            Outcome::PrefixHit => "prefix_hit",
            Outcome::Cold => "cold",
            Outcome::Fallback(FallbackReason::NoMetrics) => "fallback_no_metrics",
            Outcome::Fallback(FallbackReason::NoEndpoints) => "fallback_no_endpoints",
            Outcome::Fallback(FallbackReason::UnknownModel) => "fallback_unknown_model",
            Outcome::Shed { .. } => "shed",
            Outcome::Hold => "held",
            Outcome::ResponseHome => "response_home",
        }
    }
}

/// Why an endpoint was not a candidate.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FilterReason {
    Unhealthy,
    Ejected,
    NoMetrics,
    Stale,
    ModelNotServed,
    DoesNotFit,
    /// Past `overload.queue_limit` or `overload.kv_limit` while others were not (not with
    /// the cost policy, which weighs both).
    Overloaded,
    /// Envoy excludes it: failing its active health check, ejected by outlier detection,
    /// or unhealthy in EDS.
    ExcludedByEnvoy,
    /// Draining or pending removal in Envoy: no new requests.
    Draining,
    /// Degraded in Envoy while others are not.
    Degraded,
    /// Every LoRA slot is taken by other adapters while another server has room.
    LoraSlotsFull,
    /// It refused a request within `overload.refused_ms` (the request moved to another
    /// server on Envoy's retry) while others did not.
    Refusing,
}

impl fmt::Display for FilterReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            FilterReason::Unhealthy => "unhealthy",
            FilterReason::Ejected => "ejected",
            FilterReason::NoMetrics => "no_metrics",
            FilterReason::Stale => "stale_metrics",
            FilterReason::ModelNotServed => "model_not_served",
            FilterReason::DoesNotFit => "does_not_fit",
            FilterReason::Overloaded => "overloaded",
            FilterReason::ExcludedByEnvoy => "excluded_by_envoy",
            FilterReason::Draining => "draining",
            FilterReason::Degraded => "degraded",
            FilterReason::LoraSlotsFull => "lora_slots_full",
            FilterReason::Refusing => "refusing",
        })
    }
}

/// One endpoint's line in the breakdown. For `cost`, `prefill_ms + decode_ms + kv_ms = cost`.
#[derive(Clone, Debug, PartialEq)]
pub struct EndpointScore {
    pub endpoint: EndpointId,
    pub matched_blocks: u32,
    pub uncached_tokens: Tokens,
    pub prefill_ms: f64,
    pub decode_ms: f64,
    pub kv_ms: f64,
    pub cost: Cost,
    /// `cost` only: the predicted time to first token (see `policy::Terms::ttft_ms`).
    pub ttft_ms: f64,
    pub filtered: Option<FilterReason>,
}

/// Where tiers (`tiers`) sent a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Tiering {
    pub tier: u32,
    /// It went past the cheapest tier: a cheaper tier could not meet the objective, or no
    /// tier could and the cost policy's best server is in a dearer one.
    pub spilled: bool,
    /// The chosen tier's best server is predicted to meet the objective: its planned share,
    /// or where no server is predicted within that, the whole objective.
    pub met: bool,
}

#[derive(Clone, Debug, PartialEq)]
pub struct Decision {
    /// Best first, then fallbacks; empty when nothing may serve or the request is shed.
    pub endpoints: Vec<EndpointId>,
    pub outcome: Outcome,
    /// The chosen endpoint's matched prefix blocks (0 when none chosen).
    pub matched_blocks: u32,
    pub breakdown: Vec<EndpointScore>,
    /// Set when tiers are configured and candidates were scored.
    pub tier: Option<Tiering>,
    /// The holder of most of the prompt went first at a higher cost than the best-scored
    /// candidate (`cost.holder_tolerance`).
    pub holder_first: bool,
}

impl Decision {
    /// A decision that names no endpoint: `outcome` says why (the filter then leaves the
    /// request to Envoy, sheds it or holds it).
    pub fn without_endpoints(outcome: Outcome, breakdown: Vec<EndpointScore>) -> Decision {
        Decision {
            endpoints: Vec::new(),
            outcome,
            matched_blocks: 0,
            breakdown,
            tier: None,
            holder_first: false,
        }
    }

    pub fn best(&self) -> Option<&EndpointId> {
        self.endpoints.first()
    }

    /// The value of `x-gateway-destination-endpoint`: `best,next,…`.
    pub fn header_value(&self) -> Option<String> {
        (!self.endpoints.is_empty()).then(|| {
            self.endpoints
                .iter()
                .map(EndpointId::as_str)
                .collect::<Vec<_>>()
                .join(",")
        })
    }
}

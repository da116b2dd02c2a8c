//! The one JSON configuration document shared by the Envoy filter and the simulator.
//!
//! Parsing is two steps, as in linkerd and pingora: serde reads a [`RawConfig`] (unknown
//! fields rejected, every field defaulted), then `TryFrom` validates it into a [`Config`]
//! whose fields are private and known-good. Every rejection names the field and the fix.

use std::fmt;

use crate::types::EndpointId;

mod defaults;
mod path;
mod raw;
mod validate;
pub use raw::*;
use validate::{
    validate_capture, validate_discovery, validate_endpoints, validate_hashing, validate_health, validate_lease,
    validate_replicas_cluster, validate_scoring, validate_scrape, validate_share, validate_tiers,
};

/// A rejected configuration: the field, what was wrong, and what to do.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConfigError {
    pub field: &'static str,
    pub message: String,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "invalid kvroute config: {}: {}", self.field, self.message)
    }
}

impl std::error::Error for ConfigError {}

fn reject(field: &'static str, message: impl Into<String>) -> ConfigError {
    ConfigError {
        field,
        message: message.into(),
    }
}

/// A validated configuration. Construct with [`Config::from_json`] or `TryFrom<RawConfig>`.
#[derive(Clone, Debug)]
pub struct Config {
    raw: RawConfig,
    endpoints: Vec<EndpointId>,
}

impl Config {
    /// Parses and validates the JSON document; an empty document means all defaults.
    pub fn from_json(bytes: &[u8]) -> Result<Config, ConfigError> {
        let text = std::str::from_utf8(bytes).map_err(|_| reject("(document)", "is not UTF-8"))?;
        if text.trim().is_empty() {
            return Config::try_from(RawConfig::default());
        }
        // The path names the field whose value is wrong, or the section of an unknown key:
        // serde's own message names neither, and where Istio or Envoy Gateway generate the
        // JSON its line and column point into text the operator never wrote.
        let raw: RawConfig = serde_json::from_str(text).map_err(|e| {
            let at = path::at(text, e.line(), e.column()).map_or(String::new(), |p| format!("at `{p}`: "));
            reject(
                "(document)",
                format!("{at}{e}; see filter/core/README.md for the fields"),
            )
        })?;
        Config::try_from(raw)
    }

    pub fn endpoints(&self) -> &[EndpointId] {
        &self.endpoints
    }
    pub fn cluster_shape(&self) -> ClusterShape {
        self.raw.cluster_shape
    }
    pub fn policy(&self) -> PolicyKind {
        self.raw.policy
    }
    pub fn fallbacks(&self) -> usize {
        self.raw.fallbacks
    }
    pub fn seed(&self) -> u64 {
        self.raw.seed
    }
    pub fn max_body_bytes(&self) -> usize {
        self.raw.max_body_bytes
    }
    pub fn tenant_header(&self) -> &str {
        &self.raw.tenant_header
    }
    pub fn priority_header(&self) -> &str {
        &self.raw.priority_header
    }
    pub fn debug_headers(&self) -> bool {
        self.raw.debug_headers
    }
    pub fn stored_responses(&self) -> bool {
        self.raw.stored_responses
    }
    pub fn hashing(&self) -> &RawHashing {
        &self.raw.hashing
    }
    /// How often each of `servers` is scraped: `scrape.interval_ms`, stretched to keep
    /// under `scrape.max_per_s`, but never past 40% of `health.stale_after_ms` (so metrics
    /// are not stale before the next scrape).
    pub fn scrape_interval_ms(&self, servers: usize) -> u64 {
        let base = self.raw.scrape.interval_ms;
        let Some(budget) = (servers as u64)
            .saturating_mul(1000)
            .checked_div(self.raw.scrape.max_per_s)
        else {
            return base;
        };
        budget
            .min(self.raw.health.stale_after_ms.saturating_mul(2) / 5)
            .max(base)
    }
    pub fn scrape(&self) -> &RawScrape {
        &self.raw.scrape
    }
    pub fn health(&self) -> &RawHealth {
        &self.raw.health
    }
    pub fn cost(&self) -> &RawCost {
        &self.raw.cost
    }
    pub fn weighted(&self) -> &RawWeighted {
        &self.raw.weighted
    }
    pub fn overload(&self) -> &RawOverload {
        &self.raw.overload
    }
    pub fn index(&self) -> &RawIndex {
        &self.raw.index
    }
    pub fn discovery(&self) -> &RawDiscovery {
        &self.raw.discovery
    }
    pub fn tiers(&self) -> &RawTiers {
        &self.raw.tiers
    }

    pub fn capture(&self) -> &RawCapture {
        &self.raw.capture
    }

    /// Whether the pool is learned from Envoy (no static `endpoints`).
    pub fn discovers(&self) -> bool {
        self.endpoints.is_empty()
    }
    /// Whether the other gateway replicas are learned from Envoy (`share.replicas` without
    /// `peers`: the hosts of `share.replicas.cluster`).
    pub fn discovers_replicas(&self) -> bool {
        self.raw.share.replicas.as_ref().is_some_and(RawReplicas::discovered)
    }
    /// The cluster whose hosts make the pool.
    pub fn pool_cluster(&self) -> &str {
        if self.raw.discovery.cluster.is_empty() {
            &self.raw.scrape.cluster
        } else {
            &self.raw.discovery.cluster
        }
    }
    pub fn share(&self) -> &RawShare {
        &self.raw.share
    }

    /// A copy with another policy: the simulator runs several policies on one config.
    pub fn with_policy(&self, policy: PolicyKind) -> Config {
        let mut copy = self.clone();
        copy.raw.policy = policy;
        copy
    }
}

impl TryFrom<RawConfig> for Config {
    type Error = ConfigError;

    fn try_from(raw: RawConfig) -> Result<Config, ConfigError> {
        let endpoints = validate_endpoints(&raw)?;
        validate_hashing(&raw.hashing)?;
        validate_scrape(&raw.scrape)?;
        validate_health(&raw.health, &raw.scrape)?;
        validate_scoring(&raw)?;
        validate_share(&raw.share)?;
        validate_capture(&raw.capture, &raw.hashing)?;
        validate_tiers(&raw)?;
        validate_replicas_cluster(&raw)?;
        // The admin is asked for the pool, or for the replicas when they are not listed.
        let replicas_discovered = raw.share.replicas.as_ref().is_some_and(RawReplicas::discovered);
        if raw.endpoints.is_empty() || replicas_discovered {
            validate_discovery(&raw.discovery)?;
        } else {
            validate_lease(&raw.discovery)?;
        }
        if raw.max_body_bytes < 1024 {
            return Err(reject(
                "max_body_bytes",
                format!("({}) must be at least 1024", raw.max_body_bytes),
            ));
        }
        if raw.tenant_header.is_empty() || raw.priority_header.is_empty() {
            return Err(reject("tenant_header/priority_header", "must not be empty"));
        }
        if raw.fallbacks > 16 {
            return Err(reject("fallbacks", format!("({}) must be at most 16", raw.fallbacks)));
        }
        Ok(Config { raw, endpoints })
    }
}

#[cfg(test)]
mod tests;

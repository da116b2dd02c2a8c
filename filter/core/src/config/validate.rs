//! The checks that turn a `RawConfig` into a `Config`: each names the field and the fix.

use std::collections::BTreeSet;

use super::{
    reject, ClusterShape, ConfigError, RawCapture, RawConfig, RawDiscovery, RawHashing, RawHealth, RawScrape, RawShare,
};
use crate::types::EndpointId;

pub(super) fn validate_endpoints(raw: &RawConfig) -> Result<Vec<EndpointId>, ConfigError> {
    if raw.cluster_shape == ClusterShape::OriginalDst && raw.endpoints.is_empty() {
        return Err(reject(
            "endpoints",
            "must list the pool when cluster_shape is original_dst: that cluster reaches any address the header names",
        ));
    }
    distinct_addresses("endpoints", &raw.endpoints)?;
    Ok(raw.endpoints.iter().map(EndpointId::new).collect())
}

/// Each of `addresses` an IP address and port (`socket_address`), none listed twice.
fn distinct_addresses(field: &'static str, addresses: &[String]) -> Result<(), ConfigError> {
    let mut seen = BTreeSet::new();
    for address in addresses {
        socket_address(field, address)?;
        if !seen.insert(address.as_str()) {
            return Err(reject(field, format!("{address:?} is listed twice")));
        }
    }
    Ok(())
}

/// `address` must be an IP address and port as Envoy names a host (`10.0.0.7:8000`,
/// `[fd00::7]:8000`): the destination header (`override_host`, `ORIGINAL_DST`) and every
/// per-server setting are matched against that form, and a hostname matches nothing.
pub(super) fn socket_address(field: &'static str, address: &str) -> Result<(), ConfigError> {
    match address.parse::<std::net::SocketAddr>() {
        Ok(a) if a.port() != 0 => Ok(()),
        Ok(_) => Err(reject(field, format!("{address:?}: the port must be 1-65535"))),
        Err(_) => Err(reject(
            field,
            format!(
                "{address:?} must be an IP address and port, e.g. 10.0.0.7:8000 or [fd00::7]:8000: \
                 Envoy routes to the addresses its cluster resolved, never to a hostname"
            ),
        )),
    }
}

pub(super) fn validate_hashing(h: &RawHashing) -> Result<(), ConfigError> {
    if !(16..=65_536).contains(&h.block_bytes) {
        return Err(reject(
            "hashing.block_bytes",
            format!("({}) must be in 16..=65536", h.block_bytes),
        ));
    }
    if !(1..=16_384).contains(&h.max_blocks) {
        return Err(reject(
            "hashing.max_blocks",
            format!("({}) must be in 1..=16384", h.max_blocks),
        ));
    }
    Ok(())
}

/// Only checked when the pool is discovered (no static `endpoints`).
pub(super) fn validate_discovery(d: &RawDiscovery) -> Result<(), ConfigError> {
    if d.admin_cluster.is_empty() {
        return Err(reject(
            "discovery.admin_cluster",
            "must name a cluster pointing at Envoy's admin (or list the pool in `endpoints`)",
        ));
    }
    if d.interval_ms < 20 {
        return Err(reject(
            "discovery.interval_ms",
            format!("({}) must be at least 20", d.interval_ms),
        ));
    }
    if d.timeout_ms == 0 || d.timeout_ms > d.interval_ms {
        return Err(reject(
            "discovery.timeout_ms",
            format!(
                "({}) must be above 0 and at most discovery.interval_ms ({})",
                d.timeout_ms, d.interval_ms
            ),
        ));
    }
    if d.max_bytes < 4096 {
        return Err(reject(
            "discovery.max_bytes",
            format!("({}) must be at least 4096", d.max_bytes),
        ));
    }
    validate_lease(d)
}

/// The polling lease is taken in every mode (a static pool is polled too), so it is checked
/// whether or not the pool is discovered.
pub(super) fn validate_lease(d: &RawDiscovery) -> Result<(), ConfigError> {
    if d.lease_ms < 200 {
        return Err(reject(
            "discovery.lease_ms",
            format!("({}) must be at least 200", d.lease_ms),
        ));
    }
    Ok(())
}

pub(super) fn validate_scrape(s: &RawScrape) -> Result<(), ConfigError> {
    if s.interval_ms < 10 {
        return Err(reject(
            "scrape.interval_ms",
            format!("({}) must be at least 10", s.interval_ms),
        ));
    }
    if s.timeout_ms == 0 || s.timeout_ms >= s.interval_ms {
        return Err(reject(
            "scrape.timeout_ms",
            format!(
                "({}) must be above 0 and below scrape.interval_ms ({})",
                s.timeout_ms, s.interval_ms
            ),
        ));
    }
    if !s.path.starts_with('/') {
        return Err(reject("scrape.path", format!("({:?}) must start with '/'", s.path)));
    }
    if s.cluster.is_empty() {
        return Err(reject("scrape.cluster", "must name the Envoy cluster of the vLLM pool"));
    }
    if s.max_bytes < 4096 {
        return Err(reject(
            "scrape.max_bytes",
            format!("({}) must be at least 4096", s.max_bytes),
        ));
    }
    Ok(())
}

pub(super) fn validate_health(h: &RawHealth, s: &RawScrape) -> Result<(), ConfigError> {
    if h.unhealthy_after_failures == 0 || h.healthy_after_successes == 0 || h.passive_failures_to_eject == 0 {
        return Err(reject("health", "failure and success thresholds must be at least 1"));
    }
    // A round of scrapes is published when its slowest answer is in, up to timeout_ms after
    // it began, and replaced one interval later: metrics are that old before the next.
    if h.stale_after_ms <= s.interval_ms.saturating_add(s.timeout_ms) {
        return Err(reject(
            "health.stale_after_ms",
            format!(
                "({}) must be above scrape.interval_ms + scrape.timeout_ms ({} + {}): metrics are that old \
                 before the next round replaces them, and would go stale in between",
                h.stale_after_ms, s.interval_ms, s.timeout_ms
            ),
        ));
    }
    if h.eject_ms == 0 {
        return Err(reject(
            "health.eject_ms",
            "must be at least 1: to keep servers that fail responses, raise health.passive_failures_to_eject",
        ));
    }
    Ok(())
}

pub(super) fn validate_scoring(raw: &RawConfig) -> Result<(), ConfigError> {
    let c = &raw.cost;
    if !(c.prefill_tokens_per_s.is_finite() && c.prefill_tokens_per_s > 0.0) {
        return Err(reject("cost.prefill_tokens_per_s", "must be a positive number"));
    }
    for (field, v) in [
        ("cost.decode_ms_per_running", c.decode_ms_per_running),
        ("cost.kv_pressure_ms", c.kv_pressure_ms),
        ("cost.kv_pressure_unlike_ms", c.kv_pressure_unlike_ms),
        ("cost.admission_weight", c.admission_weight),
        ("cost.work_weight", c.work_weight),
        ("cost.lora_load_ms", c.lora_load_ms),
        ("cost.phase_weight", c.phase_weight),
        ("cost.pending_weight", c.pending_weight),
        ("cost.attention_tokens", c.attention_tokens),
        ("cost.first_token_steps", c.first_token_steps),
    ] {
        if !(v.is_finite() && v >= 0.0) {
            return Err(reject(field, format!("({v}) must be a non-negative number")));
        }
    }
    for id in c.speed_weights.keys() {
        socket_address("cost.speed_weights", id)?;
    }
    if c.speed_weights_from_envoy && !raw.endpoints.is_empty() {
        return Err(reject(
            "cost.speed_weights_from_envoy",
            "needs the pool learned from Envoy (no static \"endpoints\" list): the weights come from its \
             /clusters view; give cost.speed_weights instead",
        ));
    }
    if let Some((id, w)) = c.speed_weights.iter().find(|(_, w)| !(w.is_finite() && **w > 0.0)) {
        return Err(reject(
            "cost.speed_weights",
            format!("{id}: ({w}) must be a positive number"),
        ));
    }
    if c.max_num_batched_tokens == 0 {
        return Err(reject(
            "cost.max_num_batched_tokens",
            "must be at least 1 (vLLM's --max-num-batched-tokens; its default is 8192 on an H100)",
        ));
    }
    for (field, v) in [
        ("cost.kv_pressure_threshold", c.kv_pressure_threshold),
        ("cost.kv_pressure_unlike_threshold", c.kv_pressure_unlike_threshold),
    ] {
        if !(0.0..1.0).contains(&v) {
            return Err(reject(field, format!("({v}) must be in [0, 1)")));
        }
    }
    if !(0.0..=1.0).contains(&c.progress_credit) {
        return Err(reject(
            "cost.progress_credit",
            format!("({}) must be in [0, 1]", c.progress_credit),
        ));
    }
    for (field, v) in [
        ("cost.cold_tolerance", c.cold_tolerance),
        ("cost.holder_tolerance", c.holder_tolerance),
        ("cost.holder_min_share", c.holder_min_share),
        ("cost.served_tokens_kept", c.served_tokens_kept),
        ("cost.storage_fill", c.storage_fill),
        ("cost.storage_lost_share", c.storage_lost_share),
        ("cost.storage_depth", c.storage_depth),
    ] {
        if !(0.0..=1.0).contains(&v) {
            return Err(reject(field, format!("({v}) must be in [0, 1]")));
        }
    }
    if !(0.0..=16.0).contains(&c.storage_tolerance) {
        return Err(reject(
            "cost.storage_tolerance",
            format!("({}) must be in [0, 16]", c.storage_tolerance),
        ));
    }
    if !(0.0..=64.0).contains(&c.cold_balance) {
        return Err(reject(
            "cost.cold_balance",
            format!("({}) must be in [0, 64]", c.cold_balance),
        ));
    }
    let w = &raw.weighted;
    if [w.queue, w.kv, w.prefix].iter().any(|v| !(v.is_finite() && *v >= 0.0)) || w.queue + w.kv + w.prefix <= 0.0 {
        return Err(reject(
            "weighted",
            "queue, kv and prefix must be non-negative and not all zero",
        ));
    }
    let o = &raw.overload;
    if !(o.kv_limit > 0.0 && o.kv_limit <= 1.0) {
        return Err(reject(
            "overload.kv_limit",
            format!("({}) must be in (0, 1]", o.kv_limit),
        ));
    }
    if o.retry_after_s == 0 {
        return Err(reject(
            "overload.retry_after_s",
            "must be at least 1: `Retry-After: 0` asks every refused client to come back at once, into the same overload",
        ));
    }
    if o.queue_limit == 0 {
        return Err(reject("overload.queue_limit", "must be at least 1"));
    }
    if o.refused_ms > 60_000 {
        return Err(reject(
            "overload.refused_ms",
            format!(
                "({}) must be at most 60000: a refusal says how full a server was then, not later",
                o.refused_ms
            ),
        ));
    }
    let h = &o.hold;
    if h.max_wait_ms > 0 {
        if h.wait_limit_ms == 0 {
            return Err(reject("overload.hold.wait_limit_ms", "must be at least 1"));
        }
        if h.max_requests == 0 {
            return Err(reject(
                "overload.hold.max_requests",
                "must be at least 1 (or set overload.hold.max_wait_ms to 0 to turn holding off)",
            ));
        }
        if !(h.priority_weight.is_finite() && h.priority_weight >= 1.0) {
            return Err(reject(
                "overload.hold.priority_weight",
                format!("({}) must be at least 1", h.priority_weight),
            ));
        }
        if h.newest_first_after_ms >= h.max_wait_ms {
            return Err(reject(
                "overload.hold.newest_first_after_ms",
                format!(
                    "({}) must be below max_wait_ms ({}), or 0 for first come, first served",
                    h.newest_first_after_ms, h.max_wait_ms
                ),
            ));
        }
        if !(h.objective_wait_share.is_finite() && (0.0..=1.0).contains(&h.objective_wait_share)) {
            return Err(reject(
                "overload.hold.objective_wait_share",
                format!(
                    "({}) must be in [0, 1] (0: every request waits up to max_wait_ms)",
                    h.objective_wait_share
                ),
            ));
        }
        if h.max_wait_ms > 600_000 {
            return Err(reject(
                "overload.hold.max_wait_ms",
                format!(
                    "({}) must be at most 600000 (10 minutes): clients and Envoy's stream timeouts give up long before",
                    h.max_wait_ms
                ),
            ));
        }
    }
    if raw.index.max_memory_bytes < 64 * 1024 {
        return Err(reject(
            "index.max_memory_bytes",
            format!("({}) must be at least 65536", raw.index.max_memory_bytes),
        ));
    }
    if raw.index.default_capacity_tokens == 0 {
        return Err(reject("index.default_capacity_tokens", "must be at least 1"));
    }
    Ok(())
}

pub(super) fn validate_share(s: &RawShare) -> Result<(), ConfigError> {
    if !(1..=1000).contains(&s.tick_ms) {
        return Err(reject("share.tick_ms", format!("({}) must be in 1..=1000", s.tick_ms)));
    }
    if s.peer_timeout_ms < 3000 || s.peer_timeout_ms < 10 * s.tick_ms {
        return Err(reject(
            "share.peer_timeout_ms",
            format!(
                "({}) must be at least 3000 (three 1 s heartbeats) and at least 10 × share.tick_ms ({})",
                s.peer_timeout_ms, s.tick_ms
            ),
        ));
    }
    if let Some(r) = &s.replicas {
        if !s.workers {
            return Err(reject(
                "share.replicas",
                "needs share.workers: a replica forwards the placements its workers share, and with \
                 share.workers off there are none to forward",
            ));
        }
        validate_replicas(r)?;
    }
    Ok(())
}

pub(super) fn validate_replicas(r: &super::RawReplicas) -> Result<(), ConfigError> {
    distinct_addresses("share.replicas.peers", &r.peers)?;
    if r.secret.len() < 16 {
        return Err(reject(
            "share.replicas.secret",
            "must be at least 16 characters: anyone who knows it can feed this gateway placements",
        ));
    }
    if !r.path.starts_with('/') || r.cluster.is_empty() {
        return Err(reject(
            "share.replicas",
            "path must start with '/' and cluster must name the replicas' cluster",
        ));
    }
    if !(1..=1000).contains(&r.interval_ms) {
        return Err(reject(
            "share.replicas.interval_ms",
            format!("({}) must be in 1..=1000", r.interval_ms),
        ));
    }
    if r.from_workers && r.from_workers_per_s == 0 {
        return Err(reject(
            "share.replicas.from_workers_per_s",
            "must be at least 1 with from_workers (turn from_workers off to leave every segment to the scraping service)",
        ));
    }
    if r.max_body_bytes < 64 * 1024 {
        return Err(reject("share.replicas.max_body_bytes", "must be at least 65536"));
    }
    Ok(())
}

/// The replicas' cluster must be neither the pool's nor the admin's: batches, and the
/// shared secret with them, would go to the vLLM servers or to Envoy's admin.
pub(super) fn validate_replicas_cluster(raw: &RawConfig) -> Result<(), ConfigError> {
    let Some(r) = &raw.share.replicas else {
        return Ok(());
    };
    let pool = [raw.discovery.cluster.as_str(), raw.scrape.cluster.as_str()];
    let why = if pool.contains(&r.cluster.as_str()) {
        "the pool's cluster: batches (and the shared secret) would go to the vLLM servers"
    } else if r.cluster == raw.discovery.admin_cluster {
        "the admin's cluster: batches (and the shared secret) would go to Envoy's admin"
    } else {
        return Ok(());
    };
    Err(reject(
        "share.replicas.cluster",
        format!("({:?}) is {why}; name the cluster of the gateway replicas", r.cluster),
    ))
}

pub(super) fn validate_capture(c: &RawCapture, h: &RawHashing) -> Result<(), ConfigError> {
    if !(0.0..=1.0).contains(&c.sample) {
        return Err(reject(
            "capture.sample",
            format!("({}) must be a fraction from 0 (off) to 1 (every request)", c.sample),
        ));
    }
    if c.sample == 0.0 {
        return Ok(());
    }
    if c.salt.len() < 16 {
        return Err(reject(
            "capture.salt",
            "must be set to a secret of 16 bytes or more when capture is on: it keys the captured block ids (one per deployment, kept like a password)",
        ));
    }
    if c.block_bytes != 0 && (c.block_bytes % h.block_bytes != 0 || c.block_bytes > 65_536) {
        return Err(reject(
            "capture.block_bytes",
            format!(
                "({}) must be 0 (hashing.block_bytes) or a multiple of hashing.block_bytes ({}) up to 65536",
                c.block_bytes, h.block_bytes
            ),
        ));
    }
    let name_ok = |ch: char| ch.is_ascii_alphanumeric() || ch == '_' || ch == '.';
    if c.property.is_empty() || !c.property.chars().all(name_ok) {
        return Err(reject(
            "capture.property",
            format!(
                "({:?}) must be a filter state name of letters, digits, '_' and '.'",
                c.property
            ),
        ));
    }
    Ok(())
}

pub(super) fn validate_tiers(raw: &RawConfig) -> Result<(), ConfigError> {
    let t = &raw.tiers;
    if !(t.ttft_objective_ms.is_finite() && t.ttft_objective_ms > 0.0) {
        return Err(reject(
            "tiers.ttft_objective_ms",
            format!("({}) must be a positive number of milliseconds", t.ttft_objective_ms),
        ));
    }
    if t.objective_header.is_empty() {
        return Err(reject("tiers.objective_header", "must not be empty"));
    }
    if !(t.objective_share >= 0.1 && t.objective_share <= 1.0) {
        return Err(reject(
            "tiers.objective_share",
            format!("({}) must be from 0.1 to 1", t.objective_share),
        ));
    }
    validate_tier_slots(t)?;
    if !t.on() {
        if t.objective_share != super::defaults::OBJECTIVE_SHARE {
            return Err(reject(
                "tiers.objective_share",
                "has no effect without tiers: give tiers.endpoints or tiers.from_priority",
            ));
        }
        return Ok(());
    }
    if raw.policy != super::PolicyKind::Cost {
        return Err(reject(
            if t.from_priority {
                "tiers.from_priority"
            } else {
                "tiers.endpoints"
            },
            "needs \"policy\": \"cost\": tiers compare each server's predicted time to first token with the objective",
        ));
    }
    if t.from_priority && !t.endpoints.is_empty() {
        return Err(reject(
            "tiers.from_priority",
            "give the tiers either as tiers.endpoints or as the pool cluster's priorities, not both",
        ));
    }
    if t.from_priority && !raw.endpoints.is_empty() {
        return Err(reject(
            "tiers.from_priority",
            "needs the pool learned from Envoy (no static \"endpoints\" list): priorities come from its /clusters view",
        ));
    }
    for id in t.endpoints.keys() {
        socket_address("tiers.endpoints", id)?;
    }
    if let Some((id, tier)) = t.endpoints.iter().find(|(_, tier)| **tier > 15) {
        return Err(reject("tiers.endpoints", format!("{id}: tier {tier} must be 0-15")));
    }
    Ok(())
}

fn validate_tier_slots(t: &super::RawTiers) -> Result<(), ConfigError> {
    if t.max_num_seqs.len() > 16 {
        return Err(reject(
            "tiers.max_num_seqs",
            format!("({} numbers) lists at most 16 tiers (0-15)", t.max_num_seqs.len()),
        ));
    }
    if !t.on() && !t.max_num_seqs.is_empty() {
        return Err(reject(
            "tiers.max_num_seqs",
            "has no effect without tiers: give tiers.endpoints or tiers.from_priority",
        ));
    }
    Ok(())
}

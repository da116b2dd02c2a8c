//! Learning the pool from Envoy itself.
//!
//! No proxy-wasm call lists a cluster's hosts in stock Envoy, but its admin endpoint does:
//! `GET /clusters?format=json&filter=^<cluster>$` gives every host of the cluster with its
//! address and `health_status` (EDS status, active health check, outlier detection, pending
//! removal). [`clusters_path`] builds that request; [`parse_clusters`] reduces the answer to
//! [`Host`]s. [`parse_models`] reads a server's `/v1/models` (base models and LoRA adapters).

use std::fmt;

use serde::Deserialize;

use crate::fleet::{EnvoyHealth, Host};
use crate::types::EndpointId;

/// Models read from one `/v1/models` at most (bounds memory on hostile input).
pub const MAX_MODELS: usize = 256;

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DiscoveryError {
    Json(String),
    /// Envoy's answer does not list the pool cluster: a typo in `discovery.cluster`, or the
    /// cluster is not there yet (xDS still warming).
    NoSuchCluster(String),
}

impl fmt::Display for DiscoveryError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DiscoveryError::Json(e) => write!(f, "not Envoy's /clusters JSON: {e}"),
            DiscoveryError::NoSuchCluster(name) => write!(
                f,
                "Envoy has no cluster named {name:?} (check discovery.cluster, or the cluster is still warming)"
            ),
        }
    }
}

impl std::error::Error for DiscoveryError {}

/// `name` as an RE2 literal.
fn regex_literal(name: &str) -> String {
    let mut regex = String::new();
    for c in name.chars() {
        if !c.is_ascii_alphanumeric() && c != '_' {
            regex.push('\\');
        }
        regex.push(c);
    }
    regex
}

fn percent_encoded(text: &str) -> String {
    let mut out = String::new();
    for b in text.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'~') {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// The admin path that lists exactly `cluster` (its name anchored and escaped as an RE2
/// regex, then percent-encoded for the query).
pub fn clusters_path(cluster: &str) -> String {
    let regex = format!("^{}$", regex_literal(cluster));
    format!("/clusters?format=json&filter={}", percent_encoded(&regex))
}

/// The admin path of a few of `cluster`'s stats that move whenever its hosts or their
/// health change (membership counts and changes, EDS/DNS updates, outlier ejections): a
/// cheap signature, so the full `/clusters` listing is read only when it changed (and every
/// `discovery.resync_ms` regardless).
pub fn signature_path(cluster: &str) -> String {
    let regex = format!(
        "^cluster\\.{}\\.(membership_(change|healthy|degraded|excluded|total)|update_success|outlier_detection\\.ejections_active)$",
        regex_literal(cluster)
    );
    format!("/stats?filter={}", percent_encoded(&regex))
}

#[derive(Deserialize)]
struct Clusters {
    #[serde(default)]
    cluster_statuses: Vec<ClusterStatus>,
}

#[derive(Deserialize)]
struct ClusterStatus {
    name: String,
    #[serde(default)]
    host_statuses: Vec<HostStatus>,
}

#[derive(Deserialize)]
struct HostStatus {
    #[serde(default)]
    address: Option<Address>,
    #[serde(default)]
    health_status: HealthStatus,
    #[serde(default)]
    priority: u32,
    #[serde(default)]
    weight: u32,
}

#[derive(Deserialize)]
struct Address {
    #[serde(default)]
    socket_address: Option<SocketAddress>,
}

#[derive(Deserialize)]
struct SocketAddress {
    address: String,
    #[serde(default)]
    port_value: u32,
}

/// Envoy omits false flags and an unset status.
#[derive(Default, Deserialize)]
#[serde(default)]
struct HealthStatus {
    failed_active_health_check: bool,
    failed_outlier_check: bool,
    failed_active_degraded_check: bool,
    pending_dynamic_removal: bool,
    excluded_via_immediate_hc_fail: bool,
    active_hc_timeout: bool,
    eds_health_status: Option<String>,
}

impl HealthStatus {
    fn envoy_health(&self) -> EnvoyHealth {
        let eds = self.eds_health_status.as_deref().unwrap_or("UNKNOWN");
        if self.failed_active_health_check
            || self.failed_outlier_check
            || self.excluded_via_immediate_hc_fail
            || self.active_hc_timeout
            || matches!(eds, "UNHEALTHY" | "TIMEOUT")
        {
            EnvoyHealth::Excluded
        } else if eds == "DRAINING" || self.pending_dynamic_removal {
            EnvoyHealth::Draining
        } else if eds == "DEGRADED" || self.failed_active_degraded_check {
            EnvoyHealth::Degraded
        } else {
            EnvoyHealth::Serve
        }
    }
}

/// The hosts of `cluster` in Envoy's `/clusters?format=json` answer. Hosts that are not IP
/// sockets (pipes, internal addresses) cannot be named in the destination header and are
/// left out.
pub fn parse_clusters(body: &[u8], cluster: &str) -> Result<Vec<Host>, DiscoveryError> {
    let clusters: Clusters = serde_json::from_slice(body).map_err(|e| DiscoveryError::Json(e.to_string()))?;
    let status = clusters
        .cluster_statuses
        .into_iter()
        .find(|c| c.name == cluster)
        .ok_or_else(|| DiscoveryError::NoSuchCluster(cluster.to_string()))?;
    Ok(status
        .host_statuses
        .iter()
        .filter_map(|h| {
            let socket = h.address.as_ref()?.socket_address.as_ref()?;
            let port = u16::try_from(socket.port_value).ok().filter(|p| *p > 0)?;
            let id = if socket.address.contains(':') {
                format!("[{}]:{port}", socket.address)
            } else {
                format!("{}:{port}", socket.address)
            };
            Some(Host {
                id: EndpointId::new(id),
                envoy: h.health_status.envoy_health(),
                priority: h.priority,
                // Envoy's weights are at least 1; an answer without one is Envoy's default.
                weight: h.weight.max(1),
            })
        })
        .collect())
}

#[derive(Deserialize)]
struct ModelList {
    data: Vec<ModelCard>,
}

#[derive(Deserialize)]
struct ModelCard {
    id: String,
}

/// The model ids of an OpenAI-style `/v1/models` answer (vLLM lists its served model names
/// and every LoRA adapter it has), at most [`MAX_MODELS`].
pub fn parse_models(body: &[u8]) -> Result<Vec<String>, DiscoveryError> {
    let list: ModelList = serde_json::from_slice(body).map_err(|e| DiscoveryError::Json(e.to_string()))?;
    let mut ids: Vec<String> = list.data.into_iter().map(|m| m.id).take(MAX_MODELS).collect();
    ids.sort();
    ids.dedup();
    Ok(ids)
}

#[cfg(test)]
mod tests {
    use super::*;

    const ANSWER: &str = r#"{"cluster_statuses":[{"name":"vllm_pool","added_via_api":true,"host_statuses":[
      {"address":{"socket_address":{"address":"10.0.0.1","port_value":8000}},"stats":[{"name":"cx_total"}],
       "health_status":{"eds_health_status":"HEALTHY"},"weight":1,"locality":{},"priority":2},
      {"address":{"socket_address":{"address":"10.0.0.2","port_value":8000}},"weight":3,
       "health_status":{"failed_active_health_check":true,"eds_health_status":"HEALTHY"}},
      {"address":{"socket_address":{"address":"10.0.0.3","port_value":8000}},
       "health_status":{"eds_health_status":"DRAINING"}},
      {"address":{"socket_address":{"address":"10.0.0.4","port_value":8000}},
       "health_status":{"eds_health_status":"DEGRADED"}},
      {"address":{"socket_address":{"address":"10.0.0.5","port_value":8000}},
       "health_status":{"failed_outlier_check":true,"eds_health_status":"HEALTHY"}},
      {"address":{"socket_address":{"address":"10.0.0.6","port_value":8000}},
       "health_status":{"pending_dynamic_removal":true,"eds_health_status":"HEALTHY"}},
      {"address":{"socket_address":{"address":"fd00::7","port_value":8000}},"health_status":{}},
      {"address":{"pipe":{"path":"/tmp/x.sock"}},"health_status":{}}
    ]},{"name":"other","host_statuses":[{"address":{"socket_address":{"address":"10.9.9.9","port_value":1}}}]}]}"#;

    #[test]
    fn envoy_health_flags_map_to_what_routing_does() {
        let hosts = parse_clusters(ANSWER.as_bytes(), "vllm_pool").unwrap();
        let got: Vec<(&str, EnvoyHealth)> = hosts.iter().map(|h| (h.id.as_str(), h.envoy)).collect();
        assert_eq!(
            got,
            vec![
                ("10.0.0.1:8000", EnvoyHealth::Serve),
                ("10.0.0.2:8000", EnvoyHealth::Excluded),
                ("10.0.0.3:8000", EnvoyHealth::Draining),
                ("10.0.0.4:8000", EnvoyHealth::Degraded),
                ("10.0.0.5:8000", EnvoyHealth::Excluded),
                ("10.0.0.6:8000", EnvoyHealth::Draining),
                ("[fd00::7]:8000", EnvoyHealth::Serve),
            ]
        );
        let priorities: Vec<u32> = hosts.iter().map(|h| h.priority).collect();
        assert_eq!(priorities, vec![2, 0, 0, 0, 0, 0, 0], "EDS priority, 0 when absent");
        let weights: Vec<u32> = hosts.iter().map(|h| h.weight).collect();
        assert_eq!(
            weights,
            vec![1, 3, 1, 1, 1, 1, 1],
            "EDS load-balancing weight, 1 when absent"
        );
    }

    #[test]
    fn a_missing_cluster_or_garbage_is_an_error_not_an_empty_pool() {
        assert_eq!(
            parse_clusters(ANSWER.as_bytes(), "vllm"),
            Err(DiscoveryError::NoSuchCluster("vllm".into()))
        );
        assert!(matches!(
            parse_clusters(b"<html>", "vllm_pool"),
            Err(DiscoveryError::Json(_))
        ));
        assert_eq!(
            parse_clusters(br#"{"cluster_statuses":[{"name":"p"}]}"#, "p"),
            Ok(vec![])
        );
    }

    #[test]
    fn the_path_anchors_and_escapes_istio_cluster_names() {
        assert_eq!(
            clusters_path("vllm_pool"),
            "/clusters?format=json&filter=%5Evllm_pool%24"
        );
        assert_eq!(
            clusters_path("outbound|8000||vllm.ns.svc"),
            "/clusters?format=json&filter=%5Eoutbound%5C%7C8000%5C%7C%5C%7Cvllm%5C.ns%5C.svc%24"
        );
    }

    #[test]
    fn the_signature_path_names_the_cluster_stats_that_move_with_its_hosts() {
        assert_eq!(
            signature_path("vllm_pool"),
            "/stats?filter=%5Ecluster%5C.vllm_pool%5C.%28membership_%28change%7Chealthy%7Cdegraded%7Cexcluded%7Ctotal%29%7Cupdate_success%7Coutlier_detection%5C.ejections_active%29%24"
        );
    }

    #[test]
    fn models_lists_ids_sorted_and_bounded() {
        let body = br#"{"object":"list","data":[{"id":"sql-lora","object":"model","parent":"base"},{"id":"base","object":"model"}]}"#;
        assert_eq!(
            parse_models(body).unwrap(),
            vec!["base".to_string(), "sql-lora".to_string()]
        );
        assert!(parse_models(b"{}").is_err());
    }
}

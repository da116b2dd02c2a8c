//! The snapshot the scraping service publishes in shared data for the worker VMs: every
//! endpoint's latest metrics, when they were taken, and the active-health verdict.
//!
//! Encoded with prost (messages declared here with its derive, no .proto build step).
//! A separate 8-byte key carries the version so workers copy the snapshot only when it
//! changed.

use kvroute_core::metrics::LoraInfo;
use kvroute_core::VllmMetrics;

pub const SNAPSHOT_KEY: &str = "kvroute.snapshot";
pub const VERSION_KEY: &str = "kvroute.snapshot.version";

#[derive(Clone, PartialEq, prost::Message)]
pub struct Snapshot {
    #[prost(uint64, tag = "1")]
    pub version: u64,
    #[prost(uint64, tag = "2")]
    pub published_at_ms: u64,
    #[prost(message, repeated, tag = "3")]
    pub endpoints: Vec<EndpointSnap>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct EndpointSnap {
    #[prost(string, tag = "1")]
    pub address: String,
    /// The scraping service's active-health verdict (unknown endpoints count as healthy).
    #[prost(bool, tag = "2")]
    pub healthy: bool,
    #[prost(uint64, tag = "3")]
    pub scraped_at_ms: u64,
    #[prost(message, optional, tag = "4")]
    pub metrics: Option<MetricsSnap>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct MetricsSnap {
    #[prost(double, tag = "1")]
    pub kv_usage: f64,
    #[prost(uint64, tag = "2")]
    pub running: u64,
    #[prost(uint64, tag = "3")]
    pub waiting: u64,
    #[prost(uint32, optional, tag = "4")]
    pub block_size: Option<u32>,
    #[prost(uint64, optional, tag = "5")]
    pub num_gpu_blocks: Option<u64>,
    #[prost(double, optional, tag = "6")]
    pub prefix_queries: Option<f64>,
    #[prost(double, optional, tag = "7")]
    pub prefix_hits: Option<f64>,
    #[prost(string, repeated, tag = "8")]
    pub models: Vec<String>,
    #[prost(uint32, tag = "9")]
    pub engines: u32,
    #[prost(bool, tag = "10")]
    pub legacy_names: bool,
    #[prost(message, optional, tag = "11")]
    pub lora: Option<LoraSnap>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct LoraSnap {
    #[prost(uint32, tag = "1")]
    pub max_lora: u32,
    #[prost(string, repeated, tag = "2")]
    pub running: Vec<String>,
    #[prost(string, repeated, tag = "3")]
    pub waiting: Vec<String>,
}

impl From<&VllmMetrics> for MetricsSnap {
    fn from(m: &VllmMetrics) -> Self {
        MetricsSnap {
            kv_usage: m.kv_usage,
            running: m.running,
            waiting: m.waiting,
            block_size: m.block_size,
            num_gpu_blocks: m.num_gpu_blocks,
            prefix_queries: m.prefix_queries,
            prefix_hits: m.prefix_hits,
            models: m.models.clone(),
            engines: m.engines,
            legacy_names: m.legacy_names,
            lora: m.lora.as_ref().map(|l| LoraSnap {
                max_lora: l.max_lora,
                running: l.running.clone(),
                waiting: l.waiting.clone(),
            }),
        }
    }
}

impl From<MetricsSnap> for VllmMetrics {
    fn from(m: MetricsSnap) -> Self {
        VllmMetrics {
            kv_usage: m.kv_usage,
            running: m.running,
            waiting: m.waiting,
            block_size: m.block_size,
            num_gpu_blocks: m.num_gpu_blocks,
            prefix_queries: m.prefix_queries,
            prefix_hits: m.prefix_hits,
            models: m.models,
            engines: m.engines,
            legacy_names: m.legacy_names,
            lora: m.lora.map(|l| LoraInfo {
                max_lora: l.max_lora,
                running: l.running,
                waiting: l.waiting,
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use prost::Message;

    #[test]
    fn metrics_survive_the_round_trip() {
        let body = include_str!("../core/tests/fixtures/vllm_metrics_v0.33.txt");
        let lora = include_str!("../core/tests/fixtures/vllm_lora_info.txt");
        let m = kvroute_core::parse_metrics(format!("{body}\n{lora}").as_bytes(), 1 << 20).unwrap();
        let snap = Snapshot {
            version: 3,
            published_at_ms: 99,
            endpoints: vec![EndpointSnap {
                address: "127.0.0.1:8001".into(),
                healthy: true,
                scraped_at_ms: 98,
                metrics: Some(MetricsSnap::from(&m)),
            }],
        };
        let decoded = Snapshot::decode(snap.encode_to_vec().as_slice()).unwrap();
        assert_eq!(decoded, snap);
        assert_eq!(VllmMetrics::from(decoded.endpoints[0].metrics.clone().unwrap()), m);
    }
}

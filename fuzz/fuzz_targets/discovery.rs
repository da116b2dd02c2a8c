//! Envoy's admin `/clusters` answer and a server's `/v1/models` on arbitrary bytes: never
//! panic; every host read is an `ip:port` the destination header can carry, and the model
//! list stays bounded.
#![no_main]
use kvroute_core::discovery::{parse_clusters, parse_models, MAX_MODELS};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(hosts) = parse_clusters(data, "vllm_pool") {
        for h in hosts {
            let id = h.id.as_str();
            let (host, port) = id.rsplit_once(':').expect("a host without a port");
            assert!(!host.is_empty(), "empty host in {id:?}");
            assert!(port.parse::<u16>().is_ok_and(|p| p > 0), "bad port in {id:?}");
        }
    }
    if let Ok(models) = parse_models(data) {
        assert!(models.len() <= MAX_MODELS);
    }
});

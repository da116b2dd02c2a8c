//! The Prometheus / vLLM metrics parser on arbitrary bytes: never panics, and whatever it
//! accepts is in range.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(m) = kvroute_core::parse_metrics(data, 1 << 20) {
        assert!((0.0..=1.0).contains(&m.kv_usage), "kv usage out of range: {}", m.kv_usage);
        assert!(m.engines >= 1);
    }
});

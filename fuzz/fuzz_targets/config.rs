//! The JSON configuration on arbitrary bytes: never panics; what validates builds a router.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(config) = kvroute_core::Config::from_json(data) {
        let _ = kvroute_core::Router::new(config);
    }
});

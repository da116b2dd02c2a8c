//! Request bodies of every API on arbitrary bytes, then hashing and routing what parses.
#![no_main]
use kvroute_core::request::{parse, ApiKind};
use kvroute_core::{Config, Millis, Router};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    for kind in [ApiKind::Chat, ApiKind::Completions, ApiKind::Responses, ApiKind::Messages] {
        if let Ok(p) = parse(kind, data) {
            if let Ok(config) = Config::from_json(br#"{"endpoints": ["10.0.0.1:8000", "10.0.0.2:8000"]}"#) {
                let router = Router::new(config);
                let req = router.request(&p, "t", false);
                let _ = router.route(&req, Millis(0));
            }
        }
    }
});

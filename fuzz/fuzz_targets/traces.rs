//! The Mooncake and Azure trace parsers on arbitrary text.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(text) = std::str::from_utf8(data) {
        if let Ok(reqs) = kvroute_sim::workload::parse_mooncake(text) {
            for r in reqs.iter().take(4) {
                // Rendering is bounded by the trace's own lengths; keep fuzz inputs small.
                if r.input_tokens() < 100_000 {
                    let _ = r.prompt_text();
                }
            }
        }
        let _ = kvroute_sim::workload::parse_azure(text, 4, 0);
    }
});

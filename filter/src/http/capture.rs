//! The traffic capture (`capture`): each request's line, handed to Envoy when it ends.

use kvroute_core::capture::CaptureLine;
use kvroute_core::response::usage_tokens;

use super::Http;
use crate::host;
use crate::worker::Shared;

impl Http {
    /// Hands the finished capture line to Envoy (filter state `wasm.<capture.property>`,
    /// written by an access log after this `on_log`).
    pub(super) fn write_capture(&mut self, shared: &Shared, server: Option<&str>, cached: Option<u64>) {
        let t0 = crate::stats::self_clock();
        let (Some(c), Some(capturer)) = (self.capture.take(), shared.capture.as_ref()) else {
            return;
        };
        let usage = usage_tokens(&self.tail);
        let line = CaptureLine {
            timestamp: c.timestamp,
            model: &c.model,
            input_length: usage.map_or(c.prompt_estimate, |u| u.0),
            output_length: usage.map_or(c.max_tokens.unwrap_or(0), |u| u.1),
            usage: usage.is_some(),
            hash_ids: &c.hash_ids,
            block_tokens: capturer.block_tokens(),
            server,
            cached_tokens: cached,
            status: self.status,
        };
        let json = line.to_json();
        let t1 = crate::stats::self_clock();
        match host::set_property(capturer.property(), json.as_bytes()) {
            Ok(()) => shared.stats.captured.inc(),
            Err(_) => shared.stats.capture_failed.inc(),
        }
        shared.stats.capture_ns[1].add(t1.saturating_sub(t0));
        shared.stats.capture_ns[2].add(crate::stats::self_clock().saturating_sub(t1));
    }
}

//! The traffic capture (`capture`): each request's line, handed to Envoy when it ends.

use kvroute_core::capture::CaptureLine;
use kvroute_core::response::usage_tokens;

use kvroute_core::{Millis, RouteRequest};

use super::Http;
use crate::host;
use crate::worker::Shared;

/// The request's part of a capture line; the response completes it in `on_log`.
pub(super) struct Captured {
    timestamp: u64,
    model: String,
    hash_ids: Vec<u64>,
    prompt_estimate: u64,
    max_tokens: Option<u64>,
}

impl Http {
    /// When this request is in the capture's sample, keeps what its line needs from it.
    pub(super) fn sample_capture(&mut self, shared: &Shared, req: &RouteRequest, now: Millis) {
        let t0 = crate::stats::self_clock();
        let sample_key = now.0 ^ req.prompt_tokens.0.rotate_left(32);
        if let Some(c) = shared.capture.as_ref().filter(|c| c.sampled(&req.blocks, sample_key)) {
            self.capture = Some(Box::new(Captured {
                timestamp: now.0,
                model: req.model.clone(),
                hash_ids: c.ids(&req.blocks),
                prompt_estimate: req.prompt_tokens.0,
                max_tokens: req.max_tokens,
            }));
            shared.stats.capture_ns[0].add(crate::stats::self_clock().saturating_sub(t0));
        }
    }

    /// Hands the finished capture line to Envoy (filter state `wasm.<capture.property>`,
    /// written by an access log after this `on_log`). `prompt`: the prompt's tokens where
    /// the usage's own count is not them (Anthropic's `input_tokens` leaves out the cached).
    pub(super) fn write_capture(
        &mut self,
        shared: &Shared,
        server: Option<&str>,
        cached: Option<u64>,
        prompt: Option<u64>,
    ) {
        let t0 = crate::stats::self_clock();
        let (Some(c), Some(capturer)) = (self.capture.take(), shared.capture.as_ref()) else {
            return;
        };
        let usage = usage_tokens(&self.tail).map(|(p, o)| (prompt.unwrap_or(p), o));
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

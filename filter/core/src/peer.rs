//! What one router tells the other routers of the same gateway process, so that every Envoy
//! worker routes with the placements and the load all workers recorded.
//!
//! Why events and not a shared index: each Envoy worker runs its own wasm VM with its own
//! memory, and proxy-wasm's only shared memory is a key → bytes map without delete. Looking
//! a prompt up in a shared map would cost one host call per block on the request path; a
//! replicated index costs none there. So each router keeps its own copy of the fleet view and
//! the routers exchange the few state changes that matter, in the order they happened:
//! a request was routed (its prefix blocks now live on that endpoint, its prefill is queued
//! there), its first token came (the prefill is done), it completed (the load is gone, and
//! a retry may have moved the prefix). Health, scrapes and membership are not exchanged: the
//! scraping service already gives every worker the same snapshot.
//!
//! A router that shares stamps its requests with its `origin` (a small number unique among
//! the routers of one process), so peers' requests and its own live in one in-flight table
//! without clashing, and a departed peer's requests can be released at once
//! (`Router::forget_peer`).

use crate::types::{BlockHash, EndpointId, Millis, Tokens};

/// Bits of a request key that hold the router-local request id; the origin sits above.
pub const LOCAL_ID_BITS: u32 = 40;

/// A request key unique across the routers of one process.
pub fn request_key(origin: u32, local_id: u64) -> u64 {
    (u64::from(origin) << LOCAL_ID_BITS) | (local_id & ((1 << LOCAL_ID_BITS) - 1))
}

/// The router that made the request a key names.
pub fn origin_of(key: u64) -> u32 {
    (key >> LOCAL_ID_BITS) as u32
}

/// The router-local request id a key holds.
pub fn local_id_of(key: u64) -> u64 {
    key & ((1 << LOCAL_ID_BITS) - 1)
}

/// A first token's time against its router's prediction, in ms: each router's tiers learn
/// how far off predictions run on each server from every router's streams, not only its
/// own (`TtftBias`). With many routers (Envoy workers, gateway replicas), each sees a small
/// share of the first tokens and would learn slowly alone.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TtftSample {
    pub predicted_ms: u32,
    pub observed_ms: u32,
}

impl TtftSample {
    /// A sample worth sending: the prediction long enough to be learned from
    /// (`BIAS_MIN_PREDICTED_MS`).
    pub fn new(predicted_ms: f64, observed_ms: f64) -> Option<TtftSample> {
        let ms = |x: f64| x.round().clamp(0.0, f64::from(u32::MAX)) as u32;
        (predicted_ms.is_finite() && predicted_ms >= crate::speed::BIAS_MIN_PREDICTED_MS && observed_ms.is_finite())
            .then(|| TtftSample {
                predicted_ms: ms(predicted_ms),
                observed_ms: ms(observed_ms),
            })
    }
}

/// One change to a router's view, for its peers to apply.
#[derive(Clone, Debug, PartialEq)]
pub enum PeerEvent {
    /// `key` was sent to `endpoint`, which will hold `blocks`; `uncached` of its
    /// `prompt_tokens` must be prefilled there. `at` is when it was routed.
    Routed {
        key: u64,
        endpoint: EndpointId,
        blocks: Vec<BlockHash>,
        prompt_tokens: Tokens,
        uncached: Tokens,
        at: Millis,
    },
    /// `key` produced its first token: its prefill is done. `ttft` is how long it took
    /// against what its router predicted, when that router timed it (tiers learn from it).
    FirstToken { key: u64, ttft: Option<TtftSample> },
    /// `key` ended; `served_by` names the endpoint that answered when a retry moved it, and
    /// `cached_tokens` is what vLLM reported (every router corrects its index with it).
    Completed {
        key: u64,
        served_by: Option<EndpointId>,
        cached_tokens: Option<u64>,
    },
    /// `endpoint` stored response `response` (a `request::response_key`): requests about it
    /// go there (`Router::home_of`). `key` only names the router that learned it.
    Stored {
        key: u64,
        response: u64,
        endpoint: EndpointId,
    },
}

impl PeerEvent {
    pub fn key(&self) -> u64 {
        match self {
            PeerEvent::Routed { key, .. }
            | PeerEvent::FirstToken { key, .. }
            | PeerEvent::Completed { key, .. }
            | PeerEvent::Stored { key, .. } => *key,
        }
    }

    /// A placement the peers cannot guess: most of its prompt was not cached where it went
    /// (a cold prefix, or one moved to a server without it). Its siblings, arriving on other
    /// workers within milliseconds, need it at once; a prefix hit only adds load where the
    /// peers already send that prefix, and can wait for the next tick (`share.hits_on_tick`).
    /// A stored response's home is news too: its follow-up may come at once, through any
    /// worker or replica, and only that server can answer it.
    pub fn is_news(&self) -> bool {
        match self {
            PeerEvent::Routed {
                prompt_tokens,
                uncached,
                ..
            } => uncached.0.saturating_mul(2) >= prompt_tokens.0,
            PeerEvent::Stored { .. } => true,
            _ => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_of_different_origins_never_clash_and_name_their_origin() {
        let a = request_key(1, 7);
        let b = request_key(2, 7);
        assert_ne!(a, b);
        assert_eq!(origin_of(a), 1);
        assert_eq!(origin_of(b), 2);
        assert_eq!(
            origin_of(request_key(3, u64::MAX)),
            3,
            "a huge local id cannot spill into the origin"
        );
    }
}

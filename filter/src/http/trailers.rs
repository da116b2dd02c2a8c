//! Request trailers end a request whose body did not (HTTP/2 and HTTP/3, HTTP/1.1 chunked
//! with `enable_trailers`): the body buffered so far is the whole body, so the decision is
//! taken here. Without this, Envoy would release the request with no decision, and a peer
//! batch with trailers would reach the pool.

use proxy_wasm::types::{Action, BufferType};

use super::{Http, Phase};
use crate::host;

impl Http {
    pub(super) fn request_trailers(&mut self) -> Action {
        let Some(shared) = self.shared.clone() else {
            return Action::Continue;
        };
        let limit = match self.phase {
            Phase::Buffering(_) => shared.router.try_borrow().map_or(0, |r| r.config().max_body_bytes()),
            Phase::PeerBatch => shared
                .router
                .try_borrow()
                .ok()
                .and_then(|r| r.config().share().replicas.as_ref().map(|p| p.max_body_bytes))
                .unwrap_or(0),
            _ => return Action::Continue,
        };
        // One byte past the limit tells an oversized body from one exactly at it.
        let size = host::buffer(BufferType::HttpRequestBody, 0, limit.saturating_add(1)).map_or(0, |b| b.len());
        if self.phase == Phase::PeerBatch {
            return self.peer_batch_body(size, true);
        }
        self.on_body_end(&shared, size)
    }
}

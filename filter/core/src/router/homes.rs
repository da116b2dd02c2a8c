//! Where stored responses live. vLLM keeps a response made with `store` (and
//! `VLLM_ENABLE_RESPONSES_API_STORE=1`) in the memory of the server that made it, so a
//! follow-up that names it (`previous_response_id`), `GET /v1/responses/{id}` and its
//! cancel can only be answered there: any other server says 404. Routers learn the home of
//! each response from its answer (the filter reads the id) and from their peers
//! (`PeerEvent::Stored`), and send those requests home.
//!
//! Bounded: the oldest home is forgotten past `MAX_HOMES` (about 5 MB per router); a
//! follow-up to a forgotten response is routed like any request, and answered 404 unless
//! it lands home by chance. vLLM never evicts, so a conversation resumed after that many
//! newer stored responses through one gateway process loses its history.

use std::collections::{HashMap, VecDeque};
use std::hash::BuildHasherDefault;

use crate::index::IdentityHasher;
use crate::types::EndpointId;

/// Stored responses whose home a router remembers.
pub const MAX_HOMES: usize = 65_536;

#[derive(Clone, Debug, Default)]
pub(super) struct Homes {
    /// Keyed by `response_key`, already a mixed hash: no hashing again.
    home: HashMap<u64, EndpointId, BuildHasherDefault<IdentityHasher>>,
    order: VecDeque<u64>,
}

impl Homes {
    /// `response` (a `request::response_key`) lives on `endpoint`.
    pub(super) fn insert(&mut self, response: u64, endpoint: EndpointId) {
        if self.home.insert(response, endpoint).is_none() {
            self.order.push_back(response);
        }
        while self.order.len() > MAX_HOMES {
            if let Some(old) = self.order.pop_front() {
                self.home.remove(&old);
            }
        }
    }

    pub(super) fn get(&self, response: u64) -> Option<&EndpointId> {
        self.home.get(&response)
    }

    pub(super) fn len(&self) -> usize {
        self.home.len()
    }
}

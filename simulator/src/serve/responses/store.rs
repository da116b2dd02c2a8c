//! The responses a server keeps for `previous_response_id` and `GET /v1/responses/{id}`, as
//! vLLM 0.33 keeps them when started with `VLLM_ENABLE_RESPONSES_API_STORE=1`: in the
//! server's memory, so a follow-up sent to another server of the fleet finds nothing.
//!
//! vLLM never evicts (its store grows until the process ends); this one drops the oldest
//! past [`MAX_RESPONSES`] responses or [`MAX_BYTES`] of kept text, so a long soak test cannot
//! exhaust the machine running the fleet.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};

use bytes::Bytes;

use super::super::request::Prompt;

/// Responses kept per server at most.
pub const MAX_RESPONSES: usize = 100_000;
/// Bytes kept per server at most (bodies and conversations).
pub const MAX_BYTES: usize = 512 << 20;

/// One kept response.
#[derive(Debug)]
pub struct Stored {
    /// The response object as `GET /v1/responses/{id}` returns it (JSON).
    pub body: Bytes,
    /// The conversation as the engine saw it, its output included: the prefix a follow-up's
    /// prompt starts with.
    pub conversation: Vec<u8>,
    pub tokens: u64,
}

impl Stored {
    /// The engine prompt of a follow-up whose own prompt is `next`: this conversation, then it.
    pub fn followed_by(&self, next: &Prompt) -> Prompt {
        let mut canonical = Vec::with_capacity(self.conversation.len() + next.canonical.len());
        canonical.extend_from_slice(&self.conversation);
        canonical.extend_from_slice(&next.canonical);
        Prompt {
            canonical,
            tokens: self.tokens + next.tokens,
            text: String::new(),
        }
    }

    fn bytes(&self) -> usize {
        self.body.len() + self.conversation.len()
    }
}

/// A server's kept responses; a store that is off keeps nothing.
pub struct ResponseStore {
    enabled: bool,
    max_responses: usize,
    max_bytes: usize,
    kept: Mutex<Kept>,
}

#[derive(Default)]
struct Kept {
    by_id: HashMap<String, Arc<Stored>>,
    /// Ids oldest first.
    order: VecDeque<String>,
    bytes: usize,
}

impl ResponseStore {
    pub fn new(enabled: bool) -> ResponseStore {
        ResponseStore::with_limits(enabled, MAX_RESPONSES, MAX_BYTES)
    }

    pub fn with_limits(enabled: bool, max_responses: usize, max_bytes: usize) -> ResponseStore {
        ResponseStore {
            enabled,
            max_responses,
            max_bytes,
            kept: Mutex::new(Kept::default()),
        }
    }

    pub fn enabled(&self) -> bool {
        self.enabled
    }

    pub fn get(&self, id: &str) -> Option<Arc<Stored>> {
        self.kept.lock().ok()?.by_id.get(id).cloned()
    }

    /// Keeps `stored` under `id` (nothing when the store is off), dropping the oldest past the
    /// limits.
    pub fn put(&self, id: String, stored: Stored) {
        if !self.enabled {
            return;
        }
        let Ok(mut kept) = self.kept.lock() else {
            return;
        };
        kept.bytes += stored.bytes();
        if let Some(old) = kept.by_id.insert(id.clone(), Arc::new(stored)) {
            // Ids are unique; a repeat replaces the old one, which no longer counts.
            kept.bytes -= old.bytes();
            kept.order.retain(|k| *k != id);
        }
        kept.order.push_back(id);
        while kept.order.len() > self.max_responses || (kept.bytes > self.max_bytes && kept.order.len() > 1) {
            let Some(oldest) = kept.order.pop_front() else {
                break;
            };
            if let Some(gone) = kept.by_id.remove(&oldest) {
                kept.bytes -= gone.bytes();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stored(bytes: usize) -> Stored {
        Stored {
            body: Bytes::from("x".repeat(bytes)),
            conversation: Vec::new(),
            tokens: 0,
        }
    }

    #[test]
    fn the_oldest_response_goes_first_past_either_limit() {
        let store = ResponseStore::with_limits(true, 2, 100);
        for id in ["a", "b", "c"] {
            store.put(id.to_string(), stored(10));
        }
        assert!(store.get("a").is_none(), "past 2 responses");
        assert!(store.get("b").is_some() && store.get("c").is_some());
        store.put("d".to_string(), stored(95));
        assert!(store.get("c").is_none(), "past 100 bytes");
        assert!(store.get("d").is_some());
    }

    #[test]
    fn a_store_that_is_off_keeps_nothing() {
        let store = ResponseStore::new(false);
        store.put("a".to_string(), stored(1));
        assert!(store.get("a").is_none());
    }

    #[test]
    fn a_follow_up_prompt_starts_with_the_whole_conversation() {
        let s = Stored {
            body: Bytes::new(),
            conversation: b"user\x1fhi\x1e tok tok".to_vec(),
            tokens: 7,
        };
        let next = Prompt {
            canonical: b"user\x1fmore\x1e".to_vec(),
            tokens: 6,
            text: String::new(),
        };
        let p = s.followed_by(&next);
        assert_eq!(p.canonical, b"user\x1fhi\x1e tok tokuser\x1fmore\x1e");
        assert_eq!(p.tokens, 13);
    }
}

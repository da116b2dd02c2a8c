//! What peer routers (the workers of one Envoy, gateway replicas that share) did: the
//! changes this router hands them and applies from them (see `peer`), and forgetting a
//! peer that went silent.

use super::Router;
use crate::peer::{local_id_of, origin_of, request_key, PeerEvent};
use crate::types::{EndpointId, Millis};

/// Events waiting for the peers at most, when the log keeps refusing them.
const MAX_OUTBOX: usize = 65_536;

impl Router {
    /// From now on, record every change peers must know (see `take_peer_events`), and stamp
    /// this router's requests with `origin`, unique among the peers.
    pub fn share_with_peers(&mut self, origin: u32) {
        let before = std::mem::replace(&mut self.origin, origin);
        let sharing = self.outbox.is_some();
        self.outbox.get_or_insert_with(Vec::new);
        if sharing && before != origin {
            // Whatever this router still holds under its new origin is a departed peer's
            // (origins are reused after `MAX_PEERS` claims): released, not taken as its own.
            self.forget_peer(origin);
            self.rekey_own(before);
        }
    }

    /// This router's requests in flight under its previous origin `before` take keys of its
    /// new one: their first tokens and completions are looked up by the current origin.
    /// Peers knew them by the old keys: they release those and place the new ones.
    fn rekey_own(&mut self, before: u32) {
        for key in self.keys_of(before) {
            let Some(mut record) = self.inflight.remove(&key) else {
                continue;
            };
            let new = request_key(self.origin, local_id_of(key));
            if let Some(e) = self.table.get_mut(&record.endpoint) {
                e.rekey_prefill(record.routed_at, key, new);
            }
            record.key = new;
            self.tell_peers(|| PeerEvent::Completed {
                key,
                served_by: None,
                cached_tokens: None,
            });
            self.tell_peers(|| PeerEvent::Routed {
                key: new,
                endpoint: record.endpoint.clone(),
                blocks: record.blocks.clone(),
                prompt_tokens: record.prompt_tokens,
                uncached: record.uncached,
                at: record.routed_at,
            });
            if !record.prefilling {
                self.tell_peers(|| PeerEvent::FirstToken { key: new, ttft: None });
            }
            if let Some(stale) = self.inflight.insert(new, record) {
                self.release(&stale);
            }
        }
    }

    /// Whether the changes waiting for the peers include a placement that is news
    /// (`PeerEvent::is_news`).
    pub fn peer_news_waiting(&self) -> bool {
        self.outbox.as_ref().is_some_and(|o| o.iter().any(PeerEvent::is_news))
    }

    /// The changes made since the last call, oldest first, for the peers.
    pub fn take_peer_events(&mut self) -> Vec<PeerEvent> {
        self.outbox.as_mut().map(std::mem::take).unwrap_or_default()
    }

    /// Events `take_peer_events` handed out that could not be published: they go first
    /// again. The outbox keeps at most `MAX_OUTBOX` events (the oldest go past it: a log
    /// refused that long is down); returns how many were dropped.
    pub fn return_peer_events(&mut self, mut events: Vec<PeerEvent>) -> usize {
        let Some(outbox) = self.outbox.as_mut() else {
            return events.len();
        };
        events.append(outbox);
        let dropped = events.len().saturating_sub(MAX_OUTBOX);
        events.drain(..dropped);
        *outbox = events;
        dropped
    }

    /// `endpoint` answered a request with a stored response whose id is `response_id`:
    /// requests about it go there, from this router and from its peers.
    pub fn on_stored(&mut self, response_id: &str, endpoint: &EndpointId) {
        let response = crate::request::response_key(response_id);
        self.homes.insert(response, endpoint.clone());
        let key = request_key(self.origin, 0);
        self.tell_peers(|| PeerEvent::Stored {
            key,
            response,
            endpoint: endpoint.clone(),
        });
    }

    pub(super) fn tell_peers(&mut self, event: impl FnOnce() -> PeerEvent) {
        if let Some(outbox) = self.outbox.as_mut() {
            outbox.push(event());
        }
    }

    /// A change a peer router made (see `peer`). Events of this router's own origin are
    /// ignored, so a peer log that echoes them back does no harm.
    pub fn on_peer_event(&mut self, event: &PeerEvent, now: Millis) {
        if self.outbox.is_some() && origin_of(event.key()) == self.origin {
            return;
        }
        self.stats.peer_events += 1;
        match event {
            PeerEvent::Routed {
                key,
                endpoint,
                blocks,
                prompt_tokens,
                uncached,
                at,
            } => {
                if self.early_completions.remove(key) {
                    // Its completion came first (batches from other replicas can overtake each
                    // other): the prefix is on the server, the load already gone.
                    if let Some(e) = self.table.get_mut(endpoint) {
                        e.seen.on_served(*prompt_tokens);
                        let slot = e.slot;
                        self.index.record(slot, blocks);
                    }
                } else {
                    self.place(*key, endpoint, blocks, *prompt_tokens, *uncached, *at);
                }
            }
            PeerEvent::FirstToken { key, ttft } => {
                // The peer's sample teaches this router's tiers too.
                if let Some(s) = ttft {
                    self.learn_ttft(*key, f64::from(s.predicted_ms), f64::from(s.observed_ms), now);
                }
                self.prefill_done(*key, now);
            }
            PeerEvent::Completed {
                key,
                served_by,
                cached_tokens,
            } => match self.inflight.remove(key) {
                Some(record) => self.finish(&record, served_by.as_ref(), *cached_tokens, now),
                None => self.early_completions.insert(*key),
            },
            PeerEvent::Stored { response, endpoint, .. } => self.homes.insert(*response, endpoint.clone()),
        }
    }

    /// Releases peers' requests routed more than `max_age_ms` before `now`: their completion
    /// was lost (a batch from another replica that never arrived, a reader lapped), and a
    /// live peer is never forgotten as a whole. This router's own requests are left alone.
    pub fn expire_peer_requests(&mut self, now: Millis, max_age_ms: u64) -> usize {
        let origin = self.origin;
        let old: Vec<u64> = self
            .inflight
            .iter()
            .filter(|(k, r)| origin_of(**k) != origin && now.since(r.routed_at) > max_age_ms)
            .map(|(k, _)| *k)
            .collect();
        for key in &old {
            if let Some(record) = self.inflight.remove(key) {
                self.release(&record);
            }
        }
        old.len()
    }

    /// Peer `origin` is gone (its VM stopped reporting): release its requests' load, which
    /// no completion will ever release. Their prefix blocks stay: the servers still hold them.
    pub fn forget_peer(&mut self, origin: u32) {
        for key in self.keys_of(origin) {
            if let Some(record) = self.inflight.remove(&key) {
                self.release(&record);
            }
        }
    }

    /// The keys of the requests in flight that router `origin` made.
    fn keys_of(&self, origin: u32) -> Vec<u64> {
        self.inflight
            .keys()
            .copied()
            .filter(|k| origin_of(*k) == origin)
            .collect()
    }
}

//! Another gateway replica's batch of routing events (`share.replicas`): a request to the
//! configured path is answered here and never sent upstream.

use proxy_wasm::types::{Action, BufferType};

use super::{Headers, Http, Phase};
use crate::host;
use crate::worker::Shared;

impl Http {
    /// A request to `share.replicas.path` is another replica's batch, answered here and never
    /// sent upstream: 403 without the shared secret; otherwise its body is buffered.
    pub(super) fn peer_batch_headers(
        &mut self,
        shared: &Shared,
        headers: &Headers,
        end_of_stream: bool,
    ) -> Option<Action> {
        let router = shared.router.try_borrow().ok()?;
        let replicas = router.config().share().replicas.as_ref()?;
        let path = headers.text(":path")?;
        if path.split('?').next() != Some(replicas.path.as_str()) {
            return None;
        }
        // Every request to the path is one kvroute answered: the listener's request count
        // (the failing-open alert) must find it among kvroute's outcomes.
        shared.stats.peer_batch.inc();
        let secret = headers.get(crate::PEER_SECRET_HEADER).unwrap_or_default();
        let post = headers.text(":method") == Some("POST");
        if !post || !same_secret(secret, replicas.secret.as_bytes()) {
            shared.stats.replica_batches_refused.inc();
            let refused = vec![(crate::replicas::SELF_HEADER, crate::replicas::REFUSED_VALUE)];
            let _ = host::send_local_response(403, refused, b"not a kvroute replica\n");
            return Some(Action::Pause);
        }
        if end_of_stream {
            let _ = host::send_local_response(400, vec![], b"a batch needs a body\n");
            return Some(Action::Pause);
        }
        self.phase = Phase::PeerBatch;
        Some(Action::Pause)
    }

    pub(super) fn peer_batch_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        let Some(shared) = self.shared.clone() else {
            return Action::Continue;
        };
        let max = shared
            .router
            .try_borrow()
            .ok()
            .and_then(|r| r.config().share().replicas.as_ref().map(|p| p.max_body_bytes));
        if body_size > max.unwrap_or(0) {
            self.phase = Phase::PassThrough;
            let _ = host::send_local_response(413, vec![], b"batch too large\n");
            return Action::Pause;
        }
        if !end_of_stream {
            return Action::Pause;
        }
        self.phase = Phase::PassThrough;
        let taken = host::buffer(BufferType::HttpRequestBody, 0, body_size)
            .ok()
            .and_then(|body| crate::replicas::take_forwarded(&body, host::now()));
        let mut own = None;
        let (status, body): (u32, &[u8]) = match taken {
            Some(taken) => {
                shared.stats.replica_events.add(taken.events as u64);
                if taken.dropped > 0 {
                    shared.stats.replica_events_dropped.add(taken.dropped as u64);
                }
                if taken.own {
                    // The local address the batch arrived at: the sender checks it is the
                    // one it named before it stops sending there.
                    own = host::property_string(&["destination", "address"])
                        .map(|address| crate::replicas::self_answer(&address));
                }
                (204, b"")
            }
            None => {
                shared.stats.replica_batches_refused.inc();
                (400, b"not a kvroute batch\n")
            }
        };
        let headers = match &own {
            Some(answer) => vec![(crate::replicas::SELF_HEADER, answer.as_str())],
            None => vec![],
        };
        let _ = host::send_local_response(status, headers, body);
        Action::Pause
    }
}

/// Compares secrets in time that does not depend on where they first differ.
fn same_secret(given: &[u8], expected: &[u8]) -> bool {
    given.len() == expected.len() && given.iter().zip(expected).fold(0u8, |acc, (a, b)| acc | (a ^ b)) == 0
}

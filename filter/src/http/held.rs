//! A request held while every server is full (`overload.hold`): paused on the process's
//! hold queue, and what the worker's tick did with it.

use kvroute_core::{Millis, RouteRequest};
use proxy_wasm::types::Action;

use super::{Http, Phase};
use crate::hold::{Held, Slot, Waiting};
use crate::worker::Shared;

impl Http {
    /// Leaves the request paused on the process's hold queue; 429 when the queue is full,
    /// Envoy's balancing when it cannot be used.
    pub(super) fn hold(
        &mut self,
        shared: &Shared,
        req: RouteRequest,
        servers: u64,
        bound_ms: u64,
        now: Millis,
        retry_after_s: u64,
    ) -> Action {
        let waiting = Waiting {
            context_id: self.context_id,
            req,
            slot: Slot::default(),
            bound_ms,
        };
        match shared.hold(waiting, servers, self.priority, &self.tenant, now) {
            Held::Waiting(slot) => {
                self.release = Some(slot);
                Action::Pause
            }
            Held::Unavailable => {
                self.reason = "hold_unavailable";
                Action::Continue
            }
            Held::Refused => {
                self.reason = "hold_full";
                if crate::hold::answer_429(retry_after_s) {
                    self.status = 429;
                    return Action::Pause;
                }
                Action::Continue
            }
        }
    }

    /// Takes over what the tick did with this request while it was held, at its response
    /// or when its stream ends. A request still held has no answer of the tick's: one that
    /// ends anyway (the client hung up; a response while held is Envoy's own, a stream
    /// timeout) leaves the queue at the next tick.
    pub(super) fn adopt_release(&mut self) {
        let Some(slot) = self.release.take() else { return };
        let mut r = slot.borrow_mut();
        if let Some(reason) = r.reason {
            self.reason = reason;
        }
        if r.routed.is_none() && !r.rejected {
            r.gone = true;
            return;
        }
        if let Some(routed) = &r.routed {
            self.chosen = Some(routed.best.clone());
            self.phase = Phase::Routed {
                request_id: routed.request_id,
                tokens: (routed.prompt_tokens, routed.predicted_cached),
            };
            if let Some(shared) = self.shared.clone() {
                self.read_forced_usage(&shared);
            }
        }
        if r.rejected {
            self.status = 429;
        }
    }
}

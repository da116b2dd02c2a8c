//! Holding at the gateway (`overload.hold`): while every server is full, an HTTP context
//! leaves its request paused in this worker's `HoldQueue` and the worker's tick routes it
//! when a server has room (with the metrics and placements the tick just applied), or
//! answers 429 with `Retry-After` past `max_wait_ms`.
//!
//! The tick reaches a held stream through `proxy_set_effective_context` (the same VM and
//! thread own it), sets the destination header and resumes it. What the tick did is left
//! in the request's `Release` slot, which its HTTP context reads back for its own
//! accounting (`Http::adopt_release`); a stream that ends while held marks the slot gone and
//! the tick drops it without a host call on it.

use std::cell::RefCell;
use std::rc::Rc;

use kvroute_core::hold::{Admit, Held};
use kvroute_core::{Millis, Outcome, RouteRequest, Router};
use proxy_wasm::types::LogLevel;

use crate::host;
use crate::worker::Shared;

/// What became of a held request.
#[derive(Debug, Default)]
pub struct Release {
    /// Its stream ended while it waited: nothing may be done to it.
    pub gone: bool,
    /// Routed by the tick: the router's request id and the chosen server.
    pub routed: Option<(u64, String)>,
    /// Answered 429 by the tick.
    pub rejected: bool,
    /// The decision's label once it left the queue.
    pub reason: Option<&'static str>,
}

pub type Slot = Rc<RefCell<Release>>;

/// One held request: its stream, what routing needs, and its slot.
pub struct Waiting {
    pub context_id: u32,
    pub req: RouteRequest,
    pub slot: Slot,
}

/// The 429 a request gets when the gateway will not hold it (longer).
pub fn answer_429(retry_after_s: u64) -> bool {
    let retry = retry_after_s.to_string();
    let body = br#"{"error":{"message":"all inference servers are busy; retry later","type":"overloaded","code":429}}"#;
    let headers = vec![("retry-after", retry.as_str()), ("content-type", "application/json")];
    host::send_local_response(429, headers, body).is_ok()
}

impl Shared {
    /// Whether this worker holds requests now: an arrival then waits its turn behind them.
    pub fn holding(&self) -> bool {
        self.held.try_borrow().is_ok_and(|h| !h.is_empty())
    }

    /// Holds a request; `None` when the queue refused it (the caller answers 429). A
    /// lower-priority request it displaced is answered 429 here.
    pub fn hold(&self, waiting: Waiting, priority: i64, tenant: &str, now: Millis, retry_after_s: u64) -> Option<Slot> {
        let slot = Rc::clone(&waiting.slot);
        let Ok(mut held) = self.held.try_borrow_mut() else {
            return None;
        };
        match held.push(waiting, priority, tenant, now) {
            Admit::Held => {}
            Admit::Displaced(h) => self.reject(h, false, retry_after_s),
            Admit::Refused(_) => {
                self.stats.hold_refused.inc();
                return None;
            }
        }
        self.stats.hold_held.inc();
        Some(slot)
    }

    /// The tick: drops streams that ended, answers those past the wait bound, then routes
    /// held requests in fair order while the router finds room.
    pub fn release_held(&self, router: &mut Router, now: Millis) {
        let Ok(mut held) = self.held.try_borrow_mut() else {
            return;
        };
        if held.is_empty() {
            return;
        }
        let gone = held.remove_where(|h| h.item.slot.borrow().gone);
        self.stats.hold_gone.add(gone.len() as u64);
        let overload = router.config().overload().clone();
        for h in held.expire(now, overload.hold.max_wait_ms) {
            self.reject(h, true, overload.retry_after_s);
        }
        while let Some(next) = held.peek() {
            let decision = router.route(&next.item.req, now);
            if decision.outcome == Outcome::Hold {
                break;
            }
            let Some(h) = held.pop() else { break };
            self.stats.hold_wait_ms.add(now.since(h.since));
            let w = h.item;
            if host::set_effective_context(w.context_id).is_err() {
                self.stats.hold_gone.inc();
                continue;
            }
            self.stats.hold_released.inc();
            let mut slot = w.slot.borrow_mut();
            slot.reason = Some(decision.outcome.label());
            if matches!(decision.outcome, Outcome::PrefixHit | Outcome::Cold) {
                slot.routed = self.apply_decision(router, &w.req, &decision, now);
            } else {
                self.count_outcome(&decision.outcome);
            }
            if host::resume_http_request().is_err() {
                host::log(LogLevel::Warn, "cannot resume a held request");
            }
        }
        let now_held = held.len() as u64;
        self.stats.hold_waiting.contribute(&self.reported_held, now_held);
    }

    /// Answers a held request 429: past the wait bound (`expired`) or displaced.
    fn reject(&self, h: Held<Waiting>, expired: bool, retry_after_s: u64) {
        if expired {
            self.stats.hold_expired.inc();
        } else {
            self.stats.hold_refused.inc();
        }
        let mut slot = h.item.slot.borrow_mut();
        if host::set_effective_context(h.item.context_id).is_ok() && answer_429(retry_after_s) {
            slot.rejected = true;
            slot.reason = Some(if expired { "hold_expired" } else { "hold_displaced" });
        }
    }
}

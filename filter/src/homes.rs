//! A continuation of a stored response whose home this gateway does not know yet waits a
//! moment for it. With gateway replicas, the replica that saw the answer sends its home to
//! the others as the answer leaves (`replicas`), and a client that continues at once
//! through another replica can arrive first (1 of 32 follow-ups sent the moment the answer
//! ended, `e2e_responses`): only the server that stored the response can answer, every
//! other says 404. So with `share.replicas` on, such a request (or a `GET` of the response,
//! its cancel) is paused and the worker's tick, which applies the peers' events, sends it
//! home as soon as the home arrives, or
//! leaves it to Envoy's balancing after `WAIT_MS` (a response stored before this gateway
//! started, or forgotten: it waits once, then gets the 404 it would have got).
//!
//! Per worker and bounded (`MAX_WAITING`): past it a continuation is routed at once.

use std::cell::RefCell;
use std::rc::Rc;

use kvroute_core::{Millis, Outcome, RouteRequest, Router};
use proxy_wasm::types::LogLevel;

use crate::hold::{Release, Slot};
use crate::host;
use crate::worker::Shared;

/// How long a continuation waits for its home to arrive from another replica.
pub const WAIT_MS: u64 = 25;
/// Continuations one worker holds at most.
const MAX_WAITING: usize = 1024;

/// A paused continuation: its stream, its request (none for a `GET` or a cancel, which
/// only need the destination), and where the tick's answer goes.
pub struct AwaitingHome {
    context_id: u32,
    req: Option<RouteRequest>,
    response: u64,
    until: Millis,
    slot: Slot,
}

impl Shared {
    /// Pauses continuation `req` of stored response `response` until its home is known:
    /// the slot the tick fills, or `None` (route it now) when this worker waits for too many.
    pub fn await_home(&self, context_id: u32, req: Option<RouteRequest>, response: u64, now: Millis) -> Option<Slot> {
        let mut waiting = self.awaiting_home.try_borrow_mut().ok()?;
        if waiting.len() >= MAX_WAITING {
            return None;
        }
        let slot: Slot = Rc::new(RefCell::new(Release::default()));
        waiting.push(AwaitingHome {
            context_id,
            req,
            response,
            until: Millis(now.0 + WAIT_MS),
            slot: Rc::clone(&slot),
        });
        self.stats.home_awaited.inc();
        Some(slot)
    }

    /// On the tick, after the peers' events: sends home the continuations whose home came,
    /// resumes those past their wait without a destination (Envoy balances them), and
    /// drops those whose client left.
    pub fn release_awaiting_home(&self, router: &mut Router, now: Millis) {
        let Ok(mut waiting) = self.awaiting_home.try_borrow_mut() else {
            return;
        };
        if waiting.is_empty() {
            return;
        }
        let (due, wait): (Vec<AwaitingHome>, Vec<AwaitingHome>) = waiting
            .drain(..)
            .partition(|a| a.slot.borrow().gone || now >= a.until || router.home_of(a.response).is_some());
        *waiting = wait;
        drop(waiting);
        for a in due {
            if a.slot.borrow().gone || host::set_effective_context(a.context_id).is_err() {
                continue;
            }
            let sent = match &a.req {
                Some(req) => {
                    let decision = router.route(req, now);
                    let home = decision.outcome == Outcome::ResponseHome;
                    if home {
                        a.slot.borrow_mut().routed = self.apply_decision(router, req, &decision, now);
                        self.peers.publish_now(router, &self.stats, now);
                    }
                    home
                }
                None => router.home_of(a.response).is_some_and(|home| {
                    host::set_request_header(crate::DESTINATION_HEADER, Some(home.as_str())).is_ok()
                }),
            };
            if a.req.is_none() && sent {
                self.stats.response_home.inc();
            }
            if !sent {
                // Still unknown: no server but an unknown one holds it; Envoy balances it.
                self.stats.home_unknown.inc();
            }
            a.slot.borrow_mut().reason = Some(if sent {
                Outcome::ResponseHome.label()
            } else {
                "response_home_unknown"
            });
            if host::resume_http_request().is_err() {
                host::log(LogLevel::Warn, "cannot resume a request that waited for its home");
            }
        }
    }
}

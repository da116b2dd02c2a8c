//! A continuation of a stored response whose home this gateway does not know yet waits a
//! moment for it. With gateway replicas, the replica that saw the answer sends its home to
//! the others as the answer leaves (`replicas`), and a client that continues at once
//! through another replica can arrive first (1 of 32 follow-ups sent the moment the answer
//! ended, `e2e_responses`): only the server that stored the response can answer, every
//! other says 404. So with `share.replicas` on, such a request (or a `GET` of the response,
//! its cancel) is paused and the worker's tick, which applies the peers' events, sends it
//! home as soon as the home arrives, or after `WAIT_MS` (and the next tick) routes it like
//! any request (a response stored before this gateway started, or forgotten: it waits
//! once, then gets the 404 it would have got). A `GET` or cancel with a body is not paused
//! (its body would release it early).
//!
//! Per worker and bounded (`MAX_WAITING`): past it, or while the worker's tick is not
//! running, a request goes on at once.

use std::cell::RefCell;
use std::rc::Rc;

use kvroute_core::{EndpointId, Millis, Outcome, RouteRequest, Router};
use proxy_wasm::types::LogLevel;

use crate::hold::{Release, Slot};
use crate::host;
use crate::worker::Shared;

/// How long a continuation waits for its home to arrive from another replica. The wait
/// ends when the home arrives, so the bound costs only where none comes (a response
/// stored before this gateway started), once; a home later than the bound costs the client
/// a 404. 25 ms, the first bound, was within reach of a loaded 2-core machine's batch and
/// POST between two local replicas, and between nodes the network's time adds to it.
pub const WAIT_MS: u64 = 100;
/// Continuations one worker holds at most.
const MAX_WAITING: usize = 1024;
/// A tick this late is not running (a VM Envoy reloaded gets none): nothing waits then.
const TICK_MISSING_MS: u64 = 250;

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
    /// Pauses continuation `req` of stored response `response` (`None`: a `GET` or a cancel)
    /// until its home is known: the slot the tick fills, or `None` (go on now) when this
    /// worker waits for too many or its tick is not running.
    pub fn await_home(&self, context_id: u32, req: Option<RouteRequest>, response: u64, now: Millis) -> Option<Slot> {
        if now.since(self.ticked_at.get()) > TICK_MISSING_MS {
            return None;
        }
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
        // The fast tick, not the idle one: the wait ends at the next tick past it.
        self.peers.stay_awake(now);
        self.stats.home_awaited.inc();
        Some(slot)
    }

    /// On the tick, after the peers' events: sends home the requests whose home came,
    /// routes or resumes those past their wait as if they had not waited, and drops those
    /// whose client left.
    pub fn release_awaiting_home(&self, router: &mut Router, now: Millis) {
        if self.awaiting_home.try_borrow().map_or(true, |w| w.is_empty()) {
            return;
        }
        self.peers.stay_awake(now);
        // What the peers published since the tick's own read, even within this millisecond.
        self.peers.pull_now(router, &self.stats, now);
        let Ok(mut waiting) = self.awaiting_home.try_borrow_mut() else {
            return;
        };
        let (due, wait): (Vec<AwaitingHome>, Vec<AwaitingHome>) = waiting
            .drain(..)
            .partition(|a| a.slot.borrow().gone || now >= a.until || router.home_of(a.response).is_some());
        *waiting = wait;
        drop(waiting);
        for a in due {
            if a.slot.borrow().gone || host::set_effective_context(a.context_id).is_err() {
                // Its client left while it waited: counted as one that left the hold queue.
                self.stats.hold_gone.inc();
                continue;
            }
            let home = router.home_of(a.response).map(ToString::to_string);
            if home.is_none() {
                self.stats.home_unknown.inc();
            }
            let resume = match &a.req {
                Some(req) => self.route_after_wait(router, req, &a.slot, now),
                None => {
                    let sent = home
                        .as_deref()
                        .is_some_and(|h| host::set_request_header(crate::DESTINATION_HEADER, Some(h)).is_ok());
                    if sent {
                        self.stats.response_home.inc();
                    } else {
                        self.stats.passthrough.inc();
                    }
                    a.slot.borrow_mut().reason = Some(if sent {
                        Outcome::ResponseHome.label()
                    } else {
                        "response_home_unknown"
                    });
                    true
                }
            };
            if resume && host::resume_http_request().is_err() {
                host::log(LogLevel::Warn, "cannot resume a request that waited for its home");
            }
        }
    }

    /// Routes a continuation whose wait ended: home, or, its home still unknown, by load
    /// like any request (held is not offered again after the wait: every server full, Envoy
    /// balances it). Returns whether to resume it (not after a 429).
    fn route_after_wait(&self, router: &mut Router, req: &RouteRequest, slot: &Slot, now: Millis) -> bool {
        let decision = router.route(req, now);
        slot.borrow_mut().reason = Some(match decision.outcome {
            Outcome::ResponseHome => decision.outcome.label(),
            _ => "response_home_unknown",
        });
        self.carry_out(router, req, slot, &decision, now)
    }

    /// The server that stored response `response`, reading what the peers published since
    /// this worker last read when it is not known yet (another worker may have just
    /// learned it).
    pub fn find_home(&self, router: &mut Router, response: u64, now: Millis) -> Option<EndpointId> {
        if router.home_of(response).is_none() {
            self.peers.pull_now(router, &self.stats, now);
        }
        router.home_of(response).cloned()
    }
}

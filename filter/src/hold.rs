//! Holding at the gateway (`overload.hold`), one queue per Envoy process: while every
//! server is full, an HTTP context leaves its request paused and puts a ticket for it on
//! the process's board, a `kvroute_core::hold::HoldQueue` kept in shared data
//! (`BOARD_KEY`, postcard, compare-and-swap). The board orders the tickets of every worker
//! VM fairly (priority bands, tenants); the worker whose ticket is at its head routes that
//! request at its tick when a server has room (with the metrics and placements the tick
//! just applied), takes the ticket off and resumes the stream. Past `max_wait_ms` a request
//! is answered 429 with `Retry-After`.
//!
//! Why one board and not one queue per worker: with a queue per worker, an arrival at a
//! worker that holds nothing is routed past requests the other workers hold, and every
//! worker releases its own head into the same freed room at once. The replay measured it
//! (`replay --shared-hold`, 2 gateways × 8 workers at 130%: BENCHMARKS "Holding on
//! 2 gateways × 8 workers").
//!
//! Only the VM that owns a stream can resume it (`proxy_set_effective_context` reaches the
//! streams of its own VM), so a ticket names its owner (`Ticket::vm`) and only the owner
//! takes it off the board to release it, one at a time, publishing the placement to the
//! other workers at once (`share.on_request`) so the next head's owner sees the server it
//! filled. What the tick did is left in the request's `Release` slot, which its HTTP
//! context reads back for its own accounting (`Http::adopt_release`); a stream that ends
//! while held marks the slot gone and the owner's next tick takes its ticket off without a
//! host call on the stream.
//!
//! Failure: a ticket whose request the owner no longer holds (an arrival displaced it, see
//! `HoldQueue::push`) is answered 429 by the owner when it sees the ticket gone. A worker
//! VM that died leaves its tickets; any worker drops them `STALE_GRACE_MS` after their
//! wait bound (until then they hold back the requests behind them, at most `max_wait_ms`).
//! When shared data cannot be used, a request that would be held is left to Envoy's
//! balancing (`hold.unavailable`), and a held request past its bound is still answered.

use std::cell::{Cell, RefCell};
use std::collections::{BTreeMap, BTreeSet};
use std::rc::Rc;

use kvroute_core::hold::{Admit, HoldQueue};
use kvroute_core::{Config, Millis, Outcome, RouteRequest, Router};
use proxy_wasm::types::{LogLevel, Status};
use serde::{Deserialize, Serialize};

use crate::host;
use crate::worker::Shared;

/// The process's board of held requests.
const BOARD_KEY: &str = "kvroute.hold.board";
/// The counter that names worker VMs on the board.
const IDS_KEY: &str = "kvroute.hold.ids";
/// Another worker's ticket this long past its wait bound is dropped by whoever sees it:
/// its owner answers its own at the bound, from a tick of at most `HOLD_TICK_MS`.
const STALE_GRACE_MS: u64 = 250;
/// Compare-and-swap attempts on the board before giving up for this call.
const CAS_TRIES: usize = 16;
/// Requests one tick releases at most (the next tick goes on).
const MAX_RELEASES_PER_TICK: usize = 64;
/// A worker that holds nothing reads the board this often, to know whether an arrival must
/// wait behind the others' held requests.
const IDLE_READ_MS: u64 = 10;

/// A held request on the board: the worker VM that holds its stream, and its number there.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Ticket {
    pub vm: u64,
    pub seq: u64,
}

type Board = HoldQueue<Ticket>;

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

/// A request this worker holds.
struct Mine {
    waiting: Waiting,
    since: Millis,
}

/// What `Shared::hold` did with a request.
pub enum Held {
    /// On the board: its slot tells what the tick did.
    Waiting(Slot),
    /// The board is full of requests at least as important: answer 429.
    Refused,
    /// The board cannot be used (shared data failed): leave the request to Envoy.
    Unavailable,
}

/// This worker's side of the process's hold queue.
pub struct Holds {
    /// This VM's name on the board; `None` when shared data gave none (holding is then
    /// unavailable here).
    me: Option<u64>,
    next_seq: Cell<u64>,
    mine: RefCell<BTreeMap<u64, Mine>>,
    /// The board's length when this worker last read or wrote it.
    board_len: Cell<usize>,
    read_at: Cell<Millis>,
    max_requests: usize,
    priority_weight: f64,
}

impl Holds {
    pub fn new(config: &Config) -> Holds {
        let hold = &config.overload().hold;
        let me = if hold.max_wait_ms > 0 {
            crate::mesh::increment(IDS_KEY)
        } else {
            None
        };
        if hold.max_wait_ms > 0 && me.is_none() {
            host::log(LogLevel::Warn, "cannot join the hold queue; requests will not be held");
        }
        let holds = Holds {
            me,
            next_seq: Cell::new(0),
            mine: RefCell::new(BTreeMap::new()),
            board_len: Cell::new(0),
            read_at: Cell::new(Millis(0)),
            max_requests: hold.max_requests,
            priority_weight: hold.priority_weight,
        };
        // Created here, before any request: shared data has no create-if-absent, so two
        // workers creating it at once would lose a ticket, and an empty board costs nothing.
        if me.is_some() && matches!(host::shared_data_cas(BOARD_KEY), Ok((None, _))) {
            let _ = host::set_shared_data_cas(BOARD_KEY, &holds.encode(&holds.empty()), None);
        }
        holds
    }

    /// Whether this worker holds no request.
    pub fn is_empty(&self) -> bool {
        self.mine.try_borrow().is_ok_and(|m| m.is_empty())
    }

    fn empty(&self) -> Board {
        HoldQueue::new(self.max_requests, self.priority_weight)
    }

    fn encode(&self, board: &Board) -> Vec<u8> {
        postcard::to_allocvec(board).unwrap_or_default()
    }

    /// The board and its compare-and-swap token; an unreadable one (another build's) is
    /// replaced by an empty board.
    fn read(&self, now: Millis) -> Option<(Board, Option<u32>)> {
        let (value, cas) = host::shared_data_cas(BOARD_KEY).ok()?;
        let mut board = match value.as_deref().map(postcard::from_bytes::<Board>) {
            None => self.empty(),
            Some(Ok(b)) => b,
            Some(Err(e)) => {
                host::log(
                    LogLevel::Error,
                    &format!("cannot decode the hold queue, starting it afresh: {e}"),
                );
                self.empty()
            }
        };
        board.set_limits(self.max_requests, self.priority_weight);
        self.read_at.set(now);
        self.board_len.set(board.len());
        Some((board, cas))
    }

    /// Takes a released request's ticket off the board. One that cannot be taken off (the
    /// board kept changing) is dropped by this worker when it reaches the head again.
    fn take_off(&self, me: u64, seq: u64, now: Millis) {
        for _ in 0..CAS_TRIES {
            let Some((mut board, cas)) = self.read(now) else { return };
            if board.take(|t| *t == Ticket { vm: me, seq }).is_none() {
                return;
            }
            match self.write(&board, cas) {
                Err(Status::CasMismatch) => continue,
                _ => return,
            }
        }
    }

    fn write(&self, board: &Board, cas: Option<u32>) -> Result<(), Status> {
        host::set_shared_data_cas(BOARD_KEY, &self.encode(board), cas)?;
        self.board_len.set(board.len());
        Ok(())
    }
}

/// A tenant's flow on the board: a fixed-size digest of its key (a header value can be
/// long, and the board is copied at every tick).
fn flow_of(tenant: &str) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in tenant.bytes() {
        h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
    }
    format!("{h:016x}")
}

/// The 429 a request gets when the gateway will not hold it (longer).
pub fn answer_429(retry_after_s: u64) -> bool {
    let retry = retry_after_s.to_string();
    let body = br#"{"error":{"message":"all inference servers are busy; retry later","type":"overloaded","code":429}}"#;
    let headers = vec![("retry-after", retry.as_str()), ("content-type", "application/json")];
    host::send_local_response(429, headers, body).is_ok()
}

impl Shared {
    /// Whether this Envoy process holds requests now (as this worker last saw the board):
    /// an arrival then waits its turn behind them.
    pub fn holding(&self) -> bool {
        self.holds.board_len.get() > 0 || !self.holds.is_empty()
    }

    /// Puts a request on the process's board. An arrival that displaced a lower-priority
    /// request of this worker answers it 429 here; one of another worker is answered by
    /// its owner at its tick.
    pub fn hold(&self, waiting: Waiting, priority: i64, tenant: &str, now: Millis, retry_after_s: u64) -> Held {
        let holds = &self.holds;
        let Some(me) = holds.me else {
            self.stats.hold_unavailable.inc();
            return Held::Unavailable;
        };
        let ticket = Ticket {
            vm: me,
            seq: holds.next_seq.get(),
        };
        let flow = flow_of(tenant);
        for _ in 0..CAS_TRIES {
            let Some((mut board, cas)) = holds.read(now) else { break };
            let displaced = match board.push(ticket, priority, &flow, now) {
                Admit::Held => None,
                Admit::Displaced(h) => Some(h.item),
                Admit::Refused(_) => {
                    self.stats.hold_refused.inc();
                    return Held::Refused;
                }
            };
            match holds.write(&board, cas) {
                Ok(()) => {}
                Err(Status::CasMismatch) => continue,
                Err(_) => break,
            }
            holds.next_seq.set(ticket.seq.wrapping_add(1));
            let context_id = waiting.context_id;
            let slot = Rc::clone(&waiting.slot);
            let Ok(mut mine) = holds.mine.try_borrow_mut() else {
                break;
            };
            mine.insert(ticket.seq, Mine { waiting, since: now });
            if let Some(d) = displaced.filter(|d| d.vm == me).and_then(|d| mine.remove(&d.seq)) {
                drop(mine);
                self.reject(d, false, retry_after_s);
                // Host calls go on acting on this request's own stream.
                let _ = host::set_effective_context(context_id);
            }
            self.stats.hold_held.inc();
            return Held::Waiting(slot);
        }
        self.stats.hold_unavailable.inc();
        Held::Unavailable
    }

    /// The tick: drops this worker's streams that ended, answers its requests past the wait
    /// bound and those the board no longer has, then routes its requests that reach the
    /// head of the board while the router finds room.
    pub fn release_held(&self, router: &mut Router, now: Millis) {
        let holds = &self.holds;
        let Some(me) = holds.me else { return };
        let Ok(mut mine) = holds.mine.try_borrow_mut() else {
            return;
        };
        if mine.is_empty() && now.since(holds.read_at.get()) < IDLE_READ_MS {
            return;
        }
        let overload = router.config().overload().clone();
        let max_wait_ms = overload.hold.max_wait_ms;
        let gone: BTreeSet<u64> = mine
            .iter()
            .filter(|(_, m)| m.waiting.slot.borrow().gone)
            .map(|(s, _)| *s)
            .collect();
        let expired: BTreeSet<u64> = mine
            .iter()
            .filter(|(s, m)| !gone.contains(s) && now.since(m.since) >= max_wait_ms)
            .map(|(s, _)| *s)
            .collect();
        let mut settled = false;
        let mut released = 0;
        for _ in 0..MAX_RELEASES_PER_TICK + CAS_TRIES {
            if released == MAX_RELEASES_PER_TICK {
                break;
            }
            let Some((mut board, cas)) = holds.read(now) else { break };
            let mut changed = !board
                .remove_where(|h| {
                    let t = h.item;
                    if t.vm == me {
                        gone.contains(&t.seq) || expired.contains(&t.seq)
                    } else {
                        now.since(h.since) >= max_wait_ms.saturating_add(STALE_GRACE_MS)
                    }
                })
                .is_empty();
            // The head, when it is this worker's and a server has room for it.
            let mut release = None;
            if let Some(head) = board.peek().map(|h| h.item).filter(|t| t.vm == me) {
                match mine.get(&head.seq).filter(|_| !gone.contains(&head.seq)) {
                    // A ticket of this worker with no request behind it: it goes.
                    None => {
                        board.pop();
                        changed = true;
                    }
                    Some(m) => {
                        self.peers.before_route(router, &self.stats, now);
                        let decision = router.route(&m.waiting.req, now);
                        if decision.outcome != Outcome::Hold {
                            release = Some((head.seq, decision));
                        }
                    }
                }
            }
            if changed {
                match holds.write(&board, cas) {
                    Ok(()) => {}
                    Err(Status::CasMismatch) => continue,
                    Err(_) => break,
                }
            }
            if !settled {
                settled = true;
                let on_board: BTreeSet<u64> = board.iter().filter(|h| h.item.vm == me).map(|h| h.item.seq).collect();
                let missing: Vec<u64> = mine.keys().filter(|s| !on_board.contains(s)).copied().collect();
                for seq in missing {
                    let Some(m) = mine.remove(&seq) else { continue };
                    if gone.contains(&seq) {
                        self.stats.hold_gone.inc();
                    } else {
                        // Past its bound, or displaced by a more important arrival.
                        let expired = now.since(m.since) >= max_wait_ms;
                        self.reject(m, expired, overload.retry_after_s);
                    }
                }
            }
            let Some((seq, decision)) = release else {
                if changed && board.peek().is_some_and(|h| h.item.vm == me) {
                    continue;
                }
                break;
            };
            let Some(m) = mine.remove(&seq) else { continue };
            released += 1;
            // Routed and published first, then its ticket leaves the head: the owner of
            // the next one sees the server this one filled before it may release its own.
            self.resume(router, m, &decision, now);
            holds.take_off(me, seq, now);
        }
        if !settled {
            // The board could not be used: this worker still answers its own requests.
            for seq in gone.iter().chain(&expired) {
                let Some(m) = mine.remove(seq) else { continue };
                if gone.contains(seq) {
                    self.stats.hold_gone.inc();
                } else {
                    self.reject(m, true, overload.retry_after_s);
                }
            }
        }
        let now_held = mine.len() as u64;
        self.stats.hold_waiting.contribute(&self.reported_held, now_held);
    }

    /// Routes a released request and resumes its stream.
    fn resume(&self, router: &mut Router, m: Mine, decision: &kvroute_core::Decision, now: Millis) {
        self.stats.hold_wait_ms.add(now.since(m.since));
        let w = m.waiting;
        if host::set_effective_context(w.context_id).is_err() {
            self.stats.hold_gone.inc();
            return;
        }
        self.stats.hold_released.inc();
        let mut slot = w.slot.borrow_mut();
        slot.reason = Some(decision.outcome.label());
        if matches!(decision.outcome, Outcome::PrefixHit | Outcome::Cold) {
            slot.routed = self.apply_decision(router, &w.req, decision, now);
            self.peers.publish_now(router, now);
        } else {
            self.count_outcome(&decision.outcome);
        }
        if host::resume_http_request().is_err() {
            host::log(LogLevel::Warn, "cannot resume a held request");
        }
    }

    /// Answers a held request 429: past the wait bound (`expired`) or displaced.
    fn reject(&self, m: Mine, expired: bool, retry_after_s: u64) {
        if expired {
            self.stats.hold_expired.inc();
        } else {
            self.stats.hold_refused.inc();
        }
        let mut slot = m.waiting.slot.borrow_mut();
        if host::set_effective_context(m.waiting.context_id).is_ok() && answer_429(retry_after_s) {
            slot.rejected = true;
            slot.reason = Some(if expired { "hold_expired" } else { "hold_displaced" });
        }
    }
}

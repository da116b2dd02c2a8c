//! Holding at the gateway (`overload.hold`), one queue per Envoy process: while every
//! server of its model is full, an HTTP context leaves its request paused and puts a ticket
//! for it on the process's board, a `kvroute_core::hold::HoldQueue` kept in shared data
//! (`BOARD_KEY`, encoded by `Board::encode`, compare-and-swap). The board orders the tickets of every worker
//! VM fairly (priority bands, tenants); a ticket names the servers its request may use
//! (`Router::serving_mask`: those listing its model), and one is a head when no earlier
//! ticket may use any of the same servers. The worker whose ticket is a head routes that
//! request at its tick when a server has room (with the metrics and placements the tick
//! just applied), takes the ticket off and resumes the stream. So a request waits only
//! behind requests that compete for its servers: another model's servers may have room while
//! this one's are full. Past its wait bound (`max_wait_ms`, or its share of the request's own
//! TTFT objective: `objective_wait_share`) a request is answered 429 with `Retry-After`.
//!
//! Why one board and not one queue per worker: with a queue per worker, an arrival at a
//! worker that holds nothing is routed past requests the other workers hold, and every
//! worker releases its own head into the same freed room at once. The replay measured it
//! (`replay --hold-per-worker` against the default, 2 gateways × 8 workers at 130%:
//! BENCHMARKS "One hold queue per Envoy process, built").
//!
//! Only the VM that owns a stream can resume it (`proxy_set_effective_context` reaches the
//! streams of its own VM), so a ticket names its owner (`Ticket::vm`) and only the owner
//! takes it off the board to release it, one at a time: it reads its peers' latest
//! placements, routes, publishes the placement at once (`Peers::publish_now`) and only then
//! takes the ticket off, so the next head's owner sees the server it filled. What the tick
//! did is left in the request's `Release` slot, which its HTTP context reads back for its
//! own accounting (`Http::adopt_release`); a stream that ends while held marks the slot
//! gone and the owner's next tick takes its ticket off without a host call on the stream.
//!
//! Failure: a ticket whose request the owner no longer holds (an arrival displaced it, see
//! `HoldQueue::push`) is answered 429 by the owner when it sees the ticket gone. A worker
//! that holds tickets writes a heartbeat on the board every `BEAT_MS`; the tickets of one
//! silent for `SILENT_MS` (its VM failed, or its tick stopped) are dropped by whoever reads
//! the board, as are tickets `STALE_GRACE_MS` past the reader's `max_wait_ms` (a request's own
//! bound is its owner's alone and never longer), so a dead worker holds
//! back the requests behind it for `SILENT_MS` at most. A worker whose own tick stopped or
//! has not run yet (Envoy reloads a crashed VM without one) holds nothing new, since no one
//! could release it. When shared data cannot be used, a request that would be held is left
//! to Envoy's balancing (`hold.unavailable`), and a held request past its bound is still
//! answered.
//! Roots with different `overload.hold` settings in one process share the board: the
//! reader's bounds apply.

use std::cell::{Cell, RefCell};
use std::rc::Rc;

use kvroute_core::hold::{Admit, HoldQueue};
use kvroute_core::{Config, Millis, Outcome, RouteRequest, Router};
use proxy_wasm::types::{LogLevel, Status};

use crate::host;
use crate::worker::Shared;

mod board;
mod release;
use board::Board;
pub use board::Ticket;

/// The process's board of held requests (the version changes with its layout, so builds
/// side by side in one process during a reload keep separate boards).
const BOARD_KEY: &str = "kvroute.hold.board.v2";
/// The counter that names worker VMs on the board.
const IDS_KEY: &str = "kvroute.hold.ids";
/// Another worker's ticket this long past `max_wait_ms` is dropped by whoever sees it: its
/// owner answers its own at its bound (never past `max_wait_ms`), from a tick of at most
/// `HOLD_TICK_MS`.
const STALE_GRACE_MS: u64 = 250;
/// A worker with tickets on the board writes its heartbeat this often.
const BEAT_MS: u64 = 100;
/// A worker whose heartbeat is this old is gone: its tickets are dropped.
const SILENT_MS: u64 = 500;
/// A worker whose own tick is this late holds nothing new (no one would release it).
const TICK_MISSING_MS: u64 = 250;
/// Compare-and-swap attempts on the board before giving up for this call.
const CAS_TRIES: usize = 32;
/// Requests one tick releases at most (the next tick goes on).
const MAX_RELEASES_PER_TICK: usize = 64;
/// Heads one look at the board tries at most: each covers at least one server the earlier
/// ones did not, so 64 server bits are through after 64.
const MAX_HEADS_PER_LOOK: usize = 64;
/// A worker that holds nothing reads the board this often, to know whether an arrival must
/// wait behind the others' held requests.
const IDLE_READ_MS: u64 = 10;

/// What became of a held request.
#[derive(Debug, Default)]
pub struct Release {
    /// Its stream ended while it waited: nothing may be done to it.
    pub gone: bool,
    /// Routed by the tick.
    pub routed: Option<crate::worker::Routed>,
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
    /// The longest it may wait (`RawHold::wait_bound_ms`; never past the `max_wait_ms` in
    /// force).
    pub bound_ms: u64,
}

impl Waiting {
    /// Whether it has waited its bound at `now`, held since `since`.
    fn expired(&self, since: Millis, now: Millis, max_wait_ms: u64) -> bool {
        now.since(since) >= self.bound_ms.min(max_wait_ms)
    }
}

/// A request this worker holds.
struct Mine {
    waiting: Waiting,
    since: Millis,
    /// The servers it may use (its ticket's).
    servers: u64,
}

/// The requests this worker holds, in the order of their numbers (a ticket's number only
/// grows). Vectors, not B-trees or sorting: the filter's size is bounded.
#[derive(Default)]
struct Mines(Vec<(u64, Mine)>);

impl Mines {
    fn insert(&mut self, seq: u64, m: Mine) {
        self.0.push((seq, m));
    }

    fn at(&self, seq: u64) -> Option<usize> {
        self.0.binary_search_by_key(&seq, |(s, _)| *s).ok()
    }

    fn get(&self, seq: &u64) -> Option<&Mine> {
        self.at(*seq).map(|i| &self.0[i].1)
    }

    fn remove(&mut self, seq: &u64) -> Option<Mine> {
        self.at(*seq).map(|i| self.0.remove(i).1)
    }

    /// The numbers of the requests `which` picks, in order.
    fn numbers(&self, mut which: impl FnMut(u64, &Mine) -> bool) -> Numbers {
        Numbers(self.0.iter().filter(|(s, m)| which(*s, m)).map(|(s, _)| *s).collect())
    }
}

/// Some of this worker's request numbers, in order.
struct Numbers(Vec<u64>);

impl Numbers {
    fn contains(&self, x: &u64) -> bool {
        self.0.binary_search(x).is_ok()
    }
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
    mine: RefCell<Mines>,
    /// The board's length when this worker last read or wrote it.
    board_len: Cell<usize>,
    /// The servers the board's tickets may use, when this worker last read or wrote it.
    board_servers: Cell<u64>,
    read_at: Cell<Millis>,
    max_requests: usize,
    priority_weight: f64,
    newest_first_after_ms: u64,
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
            mine: RefCell::new(Mines::default()),
            board_len: Cell::new(0),
            board_servers: Cell::new(0),
            read_at: Cell::new(Millis(0)),
            max_requests: hold.max_requests,
            priority_weight: hold.priority_weight,
            newest_first_after_ms: hold.newest_first_after_ms,
        };
        // Created here, before any request, and only if absent (a worker that starts late
        // must not wipe the tickets of one already serving); an empty board costs nothing.
        if me.is_some() {
            let _ = host::set_shared_data_cas(BOARD_KEY, &holds.empty().encode(), None);
        }
        holds
    }

    /// Whether this worker holds no request.
    pub fn is_empty(&self) -> bool {
        self.mine.try_borrow().is_ok_and(|m| m.0.is_empty())
    }

    /// How many requests this worker holds now.
    pub fn held_here(&self) -> usize {
        self.mine.try_borrow().map_or(0, |m| m.0.len())
    }

    fn empty(&self) -> Board {
        Board {
            queue: HoldQueue::new(self.max_requests, self.priority_weight),
            beats: Vec::new(),
        }
    }

    /// The board and its compare-and-swap token; an unreadable one (another build's) is
    /// replaced by an empty board.
    fn read(&self, now: Millis) -> Option<(Board, Option<u32>)> {
        let (value, cas) = host::shared_data_cas(BOARD_KEY).ok()?;
        let mut board = match value.as_deref() {
            None => self.empty(),
            Some(bytes) => Board::decode(bytes, self.max_requests, self.priority_weight).unwrap_or_else(|| {
                host::log(LogLevel::Error, "cannot decode the hold queue, starting it afresh");
                self.empty()
            }),
        };
        board.queue.set_limits(self.max_requests, self.priority_weight);
        board.queue.set_newest_first(self.newest_first_after_ms);
        board.queue.set_now(now);
        self.read_at.set(now);
        self.seen(&board);
        Some((board, cas))
    }

    /// Takes a released request's ticket off the board. One that cannot be taken off (the
    /// board kept changing) is dropped by this worker when it reaches the head again.
    fn take_off(&self, me: u64, seq: u64, now: Millis) {
        for _ in 0..CAS_TRIES {
            let Some((mut board, cas)) = self.read(now) else { return };
            if board.queue.take(|t| t.vm == me && t.seq == seq).is_none() {
                return;
            }
            match self.write(&board, cas) {
                Err(Status::CasMismatch) => continue,
                _ => return,
            }
        }
    }

    fn write(&self, board: &Board, cas: Option<u32>) -> Result<(), Status> {
        host::set_shared_data_cas(BOARD_KEY, &board.encode(), cas)?;
        self.seen(board);
        Ok(())
    }

    /// Remembers what the board holds, as this worker last read or wrote it.
    fn seen(&self, board: &Board) {
        self.board_len.set(board.queue.len());
        self.board_servers.set(board.servers());
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
    /// Whether this Envoy process holds requests that may use any of the arrival's `servers`
    /// now (as this worker last saw the board, and its own): it then waits its turn behind
    /// those. `servers` is worked out only when something is held.
    pub fn holding(&self, servers: impl FnOnce() -> u64) -> bool {
        let holds = &self.holds;
        let Ok(mine) = holds.mine.try_borrow() else { return true };
        let on_board = holds.board_servers.get();
        if on_board == 0 && mine.0.is_empty() {
            return false;
        }
        let servers = servers();
        on_board & servers != 0 || mine.0.iter().any(|(_, m)| m.servers & servers != 0)
    }

    /// Puts a request on the process's board. A lower-priority request it displaced is
    /// answered 429 by its owner at its next tick.
    pub fn hold(&self, waiting: Waiting, servers: u64, priority: i64, tenant: &str, now: Millis) -> Held {
        let holds = &self.holds;
        // `ticked_at` is 0 until the first tick: a worker whose tick has not run, or never
        // runs, holds nothing, since nothing would release it.
        let ticking = now.since(self.ticked_at.get()) <= TICK_MISSING_MS;
        let (Some(me), true, Ok(mut mine)) = (holds.me, ticking, holds.mine.try_borrow_mut()) else {
            self.stats.hold_unavailable.inc();
            return Held::Unavailable;
        };
        let ticket = Ticket {
            vm: me,
            seq: holds.next_seq.get(),
            servers,
        };
        let flow = flow_of(tenant);
        for _ in 0..CAS_TRIES {
            let Some((mut board, cas)) = holds.read(now) else { break };
            // A request this one displaced is answered 429 by its owner's next tick
            // (`settle`), this worker's too: a local reply sent from here, for another
            // stream, raises proxy-wasm's stop flag, which is the VM's and not the stream's,
            // so this callback's `Pause` would be read as a stop without buffering. (Not seen
            // to lose a body in the end-to-end test, but nothing here needs the risk.)
            if let Admit::Refused(_) = board.queue.push(ticket, priority, &flow, now) {
                self.stats.hold_refused.inc();
                return Held::Refused;
            }
            board.beat(me, now);
            match holds.write(&board, cas) {
                Ok(()) => {}
                Err(Status::CasMismatch) => continue,
                Err(_) => break,
            }
            holds.next_seq.set(ticket.seq.wrapping_add(1));
            let slot = Rc::clone(&waiting.slot);
            mine.insert(
                ticket.seq,
                Mine {
                    waiting,
                    since: now,
                    servers,
                },
            );
            self.stats.hold_held.inc();
            return Held::Waiting(slot);
        }
        self.stats.hold_unavailable.inc();
        Held::Unavailable
    }

    /// Routes a released request and resumes its stream.
    fn resume(&self, router: &mut Router, m: Mine, decision: &kvroute_core::Decision, now: Millis) {
        self.stats.hold_wait_ms.add(now.since(m.since));
        let w = m.waiting;
        if host::set_effective_context(w.context_id).is_err() {
            self.stats.hold_gone.inc();
            return;
        }
        w.slot.borrow_mut().reason = Some(decision.outcome.label());
        if !matches!(decision.outcome, Outcome::Shed { .. }) {
            self.stats.hold_released.inc();
        }
        if self.carry_out(router, &w.req, &w.slot, decision, now) && host::resume_http_request().is_err() {
            host::log(LogLevel::Warn, "cannot resume a held request");
        }
    }

    /// Carries out `decision` for a request paused on `slot` (held, or waiting for its
    /// home: `homes`), its stream the effective context: routes it, answers it 429, or
    /// leaves it to Envoy's balancing. Returns whether to resume it (not after a 429).
    pub(crate) fn carry_out(
        &self,
        router: &mut Router,
        req: &RouteRequest,
        slot: &Slot,
        decision: &kvroute_core::Decision,
        now: Millis,
    ) -> bool {
        match decision.outcome {
            Outcome::PrefixHit | Outcome::Cold | Outcome::ResponseHome => {
                let routed = self.apply_decision(router, req, decision, now);
                slot.borrow_mut().routed = routed;
                self.peers.publish_now(router, &self.stats, now);
                true
            }
            // A sheddable request past every server's limits by the scrape: 429, as on arrival.
            Outcome::Shed { retry_after_s } => {
                self.count_outcome(&decision.outcome);
                let rejected = answer_429(retry_after_s);
                slot.borrow_mut().rejected = rejected;
                !rejected
            }
            Outcome::Fallback(_) => {
                self.count_outcome(&decision.outcome);
                true
            }
            // Not offered the queue again (a continuation whose home never came, every
            // server full): Envoy balances it.
            Outcome::Hold => {
                self.stats.hold_unavailable.inc();
                true
            }
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
        if host::set_effective_context(m.waiting.context_id).is_err() {
            return;
        }
        if answer_429(retry_after_s) {
            slot.rejected = true;
            slot.reason = Some(if expired { "hold_expired" } else { "hold_displaced" });
        } else if host::resume_http_request().is_err() {
            // Neither answered nor resumed: Envoy's own timeout ends the stream.
            host::log(LogLevel::Warn, "cannot answer nor resume a held request");
        }
    }
}

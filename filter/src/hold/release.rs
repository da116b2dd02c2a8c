//! The worker's tick for its held requests: tidy the board, answer what left it, release
//! the head while a server has room.

use kvroute_core::{Millis, Outcome, Router};
use proxy_wasm::types::Status;

use super::{Board, Mines, Numbers, BEAT_MS, CAS_TRIES, IDLE_READ_MS, MAX_HEADS_PER_LOOK, MAX_RELEASES_PER_TICK};
use crate::worker::Shared;

impl Shared {
    /// The tick: drops this worker's streams that ended, answers its requests past the wait
    /// bound and those the board no longer has, then routes its requests that reach the
    /// head of the board while the router finds room.
    pub fn release_held(&self, router: &mut Router, now: Millis) {
        let holds = &self.holds;
        let Some(me) = holds.me else { return };
        let Ok(mut mine) = holds.mine.try_borrow_mut() else {
            return;
        };
        if mine.0.is_empty() && now.since(holds.read_at.get()) < IDLE_READ_MS {
            return;
        }
        if !mine.0.is_empty() || holds.board_len.get() > 0 {
            self.peers.stay_awake(now);
        }
        let overload = router.config().overload().clone();
        let max_wait_ms = overload.hold.max_wait_ms;
        let gone = mine.numbers(|_, m| m.waiting.slot.borrow().gone);
        let expired = mine.numbers(|s, m| !gone.contains(&s) && m.waiting.expired(m.since, now, max_wait_ms));
        let mut settled = false;
        let mut released = 0;
        for _ in 0..MAX_RELEASES_PER_TICK + CAS_TRIES {
            if released == MAX_RELEASES_PER_TICK {
                break;
            }
            let Some((mut board, cas)) = holds.read(now) else { break };
            let changed = tidy(&mut board, me, &mine, &gone, &expired, now, max_wait_ms);
            let release = self.route_head(router, &board, me, &mine, now);
            if changed {
                match holds.write(&board, cas) {
                    Ok(()) => {}
                    Err(Status::CasMismatch) => continue,
                    Err(_) => break,
                }
            }
            if !settled {
                settled = true;
                self.settle(&board, me, &mut mine, &gone, now, max_wait_ms, overload.retry_after_s);
            }
            let Some((seq, decision)) = release else { break };
            let Some(m) = mine.remove(&seq) else { continue };
            released += 1;
            // Routed and published first, then its ticket leaves the head: the owner of
            // the next one sees the server this one filled before it may release its own.
            self.resume(router, m, &decision, now);
            holds.take_off(me, seq, now);
        }
        if !settled {
            // The board could not be used: this worker still answers its own requests.
            for seq in gone.0.iter().chain(&expired.0) {
                let Some(m) = mine.remove(seq) else { continue };
                if gone.contains(seq) {
                    self.stats.hold_gone.inc();
                } else {
                    self.reject(m, true, overload.retry_after_s);
                }
            }
        }
    }

    /// A head of the board (a ticket no earlier one shares a server with), when it is this
    /// worker's and the router finds a server with room for it: its number and the
    /// decision. Heads are tried in the board's order; one that is another worker's (which
    /// routes it at its own tick) or finds no room is passed over, and so is every later
    /// ticket that may use any of its servers. (This worker's tickets without a live request
    /// behind them left the board in `tidy`.)
    fn route_head(
        &self,
        router: &mut Router,
        board: &Board,
        me: u64,
        mine: &Mines,
        now: Millis,
    ) -> Option<(u64, kvroute_core::Decision)> {
        let mut passed: u64 = 0;
        let mut pulled = false;
        for _ in 0..MAX_HEADS_PER_LOOK {
            let head = board.queue.peek_where(|t| t.servers & passed == 0)?.item;
            // A ticket that names no server waits behind everything, and everything behind it.
            passed |= if head.servers == 0 { u64::MAX } else { head.servers };
            let Some(m) = mine.get(&head.seq).filter(|_| head.vm == me) else {
                continue;
            };
            if !pulled {
                self.peers.pull_now(router, &self.stats, now);
                pulled = true;
            }
            let decision = router.route(&m.waiting.req, now);
            if decision.outcome != Outcome::Hold {
                return Some((head.seq, decision));
            }
        }
        None
    }

    /// Once per tick, after the board was read (and written): answers this worker's held
    /// requests that are no longer on it, past their bound or displaced by a more important
    /// arrival (429), or whose stream ended.
    #[allow(clippy::too_many_arguments)]
    fn settle(
        &self,
        board: &Board,
        me: u64,
        mine: &mut Mines,
        gone: &Numbers,
        now: Millis,
        max_wait_ms: u64,
        retry_after_s: u64,
    ) {
        let mut on_board = vec![false; mine.0.len()];
        for h in board.queue.iter().filter(|h| h.item.vm == me) {
            if let Some(i) = mine.at(h.item.seq) {
                on_board[i] = true;
            }
        }
        let missing: Vec<u64> = mine
            .0
            .iter()
            .zip(&on_board)
            .filter(|(_, on)| !**on)
            .map(|((s, _), _)| *s)
            .collect();
        for seq in missing {
            let Some(m) = mine.remove(&seq) else { continue };
            if gone.contains(&seq) {
                self.stats.hold_gone.inc();
            } else {
                let expired = m.waiting.expired(m.since, now, max_wait_ms);
                self.reject(m, expired, retry_after_s);
            }
        }
    }
}

/// Takes this worker's tickets whose stream ended, that passed their bound or that have no
/// request behind them off `board`, drops other workers' stale tickets and writes this
/// worker's heartbeat when due; whether the board changed.
#[allow(clippy::too_many_arguments)]
fn tidy(
    board: &mut Board,
    me: u64,
    mine: &Mines,
    gone: &Numbers,
    expired: &Numbers,
    now: Millis,
    max_wait_ms: u64,
) -> bool {
    let mut changed = !board
        .queue
        .remove_where(|h| {
            let seq = h.item.seq;
            // Also a ticket of this worker with no request behind it (its take-off ran out
            // of tries): a ticket and its request are added in one callback. (Removed
            // without moving its flow's schedule: rare, and a `take` here costs the module
            // 3 KB it does not have.)
            h.item.vm == me && (gone.contains(&seq) || expired.contains(&seq) || mine.at(seq).is_none())
        })
        .is_empty();
    changed |= board.drop_stale(me, now, max_wait_ms);
    let holding = board.queue.iter().any(|h| h.item.vm == me);
    if holding && board.beat_of(me).is_none_or(|at| now.0.saturating_sub(at) >= BEAT_MS) {
        board.beat(me, now);
        changed = true;
    }
    changed
}

//! The replay's events: what happens when, in the order it happens, and the peer events
//! in flight between routers.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use kvroute_core::{PeerEvent, VllmMetrics};

use super::topology::Routers;

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(super) enum Kind {
    /// The configured slowdown starts.
    Slow,
    /// Pool change `k` (`ReplaySetup::pool_changes`).
    Pool(usize),
    /// Gateway `g` scrapes every server.
    Scrape(usize),
    /// Router `r` applies its gateway's latest snapshot.
    Snapshot(usize),
    /// Router `r` applies peer event `k`.
    Peer(usize, usize),
    StepEnd(usize),
    Arrival(usize),
    /// Router `r`'s tick while it holds requests (`overload.hold`).
    Release(usize),
    /// The gateway restarts (`Topology::restart_at_ms`).
    Restart,
}

/// A gateway's latest scrape: when, and each server's parsed metrics and text.
pub(super) type Scraped = (f64, Vec<(usize, VllmMetrics, String)>);

#[derive(Default)]
pub(super) struct Queue {
    heap: BinaryHeap<Reverse<(u64, u64, Kind)>>,
    seq: u64,
}

impl Queue {
    /// Events are ordered by time in microseconds, then by the order they were queued.
    pub(super) fn push(&mut self, at_ms: f64, kind: Kind) {
        self.seq += 1;
        self.heap
            .push(Reverse(((at_ms * 1000.0).round() as u64, self.seq, kind)));
    }

    pub(super) fn pop(&mut self) -> Option<(f64, Kind)> {
        self.heap
            .pop()
            .map(|Reverse((t_us, _, kind))| (t_us as f64 / 1000.0, kind))
    }
}

/// Peer events in flight between routers: one copy each, read by all its recipients.
#[derive(Default)]
pub(super) struct Mailbox {
    pub(super) events: Vec<PeerEvent>,
    /// Events before this index were sent by routers that have since restarted.
    pub(super) floor: usize,
}

impl Mailbox {
    pub(super) fn send(&mut self, q: &mut Queue, routers: &mut Routers, from: usize, now: f64) {
        let (events, recipients) = routers.outgoing(from, now);
        for ev in events {
            self.events.push(ev);
            let k = self.events.len() - 1;
            for (to, at) in &recipients {
                q.push(*at, Kind::Peer(*to, k));
            }
        }
    }
}

//! One view per Envoy process: the worker VMs exchange `kvroute_core::PeerEvent`s through
//! proxy-wasm shared data, so each one routes with the placements and load of all.
//!
//! Shape, and why:
//! - One ordered log for the whole process, in `SLOTS` keys `kvroute.mesh.seg.<n % SLOTS>`.
//!   On its tick (`share.tick_ms`) a worker with something to say reserves the next segment
//!   number `n` (compare-and-swap on `kvroute.mesh.head`) and writes segment `n`: its events
//!   since its last tick. Shared data has no delete; the key space is bounded by `SLOTS`.
//! - A reader reads `kvroute.mesh.head` (one host call) and, when it moved, the segments it
//!   has not seen, once each, skipping its own (it remembers their numbers): every event is
//!   copied to every other worker exactly once, and an idle gateway costs one host call per
//!   worker tick. A placement reaches every worker within two ticks, or at once with
//!   `share.on_request` (`peers`).
//! - Host calls are what sharing costs (each one crosses the VM boundary and takes Envoy's
//!   shared-data lock; applying an event is cheaper than reading it): a writer that read the
//!   head and everything up to it reserves the next number with one compare-and-swap from
//!   that read (two host calls otherwise), so with `share.on_request` a decision costs the
//!   head read, the peers' new segments, that swap and the write (the read at most once per
//!   millisecond per worker: `peers`).
//! - A segment reserved but not written yet (its writer is between the two calls) is waited
//!   for, up to `UNWRITTEN_WAIT_MS`, then skipped; a reader lapped by `SLOTS` segments skips
//!   what was overwritten. Both count as lost events (`mesh.events_lost`).
//! - A worker with nothing to say writes an empty segment every `HEARTBEAT_MS`; a peer
//!   silent for `share.peer_timeout_ms` (its VM failed or stopped) is forgotten and its
//!   requests' load released.
//! - Origins come from a counter (`kvroute.mesh.members`, compare-and-swap, counting around
//!   `MAX_PEERS` so configuration reloads never run out of them). Shared data has
//!   no create call; a counter is created with a compare-and-swap token that Envoy
//!   ignores for an absent key and refuses for a present one (`host::CREATE_ONLY`). Every
//!   segment also carries its writer's nonce, and a worker that reads a segment under its
//!   own origin with another nonce takes a new origin.
//!
//! Cost: every placement is applied by every worker (O(workers) work per request, none of it
//! on the request path), and every worker keeps a copy of the prefix index, so the configured
//! index budget is split between the workers (`Router::set_index_budget`).

use std::collections::{BTreeMap, VecDeque};

use kvroute_core::{Millis, PeerEvent};
use prost::Message;
use proxy_wasm::types::Status;

use crate::host;

mod wire;

pub use wire::{Segment, WireEvent};

const MEMBERS_KEY: &str = "kvroute.mesh.members";
pub(crate) const HEAD_KEY: &str = "kvroute.mesh.head";
/// Workers of one process that can share (origins above it do not join).
pub const MAX_PEERS: u64 = 256;
/// Segments kept readable: a reader more than this many segments behind loses events.
const SLOTS: u64 = 1024;
/// How long a reader waits for a reserved segment to be written before skipping it.
const UNWRITTEN_WAIT_MS: u64 = 100;
/// A worker with nothing to say still writes a segment this often, so peers know it lives.
pub(crate) const HEARTBEAT_MS: u64 = 1000;
/// Segments a reader reads in one tick at most (it catches up over the next ticks).
const MAX_READ_PER_TICK: u64 = 256;

pub(crate) fn slot_key(segment: u64) -> String {
    format!("kvroute.mesh.seg.{}", segment % SLOTS)
}

#[derive(Clone, Debug)]
struct Peer {
    nonce: u64,
    heard_ms: u64,
    gone: bool,
}

/// What one tick brought from the peers.
#[derive(Debug, Default)]
pub struct Received {
    pub events: Vec<PeerEvent>,
    /// Segments this worker could not read (overwritten, or never written).
    pub lost: u64,
    /// Origins to forget: silent past the timeout.
    pub gone: Vec<u32>,
    /// Origins now written by a new VM, each with the index in `events` of the new VM's
    /// first event: the old one's requests are forgotten there, after the old one's last
    /// events and before the new one's.
    pub replaced: Vec<(usize, u32)>,
    /// This process's live workers (counted once a heartbeat period; 0 otherwise).
    pub members: u64,
    /// Another VM writes under this worker's origin...
    origin_taken: bool,
    /// ...so this worker took a new one.
    pub new_origin: Option<u32>,
}

pub struct Mesh {
    origin: u32,
    nonce: u64,
    last_write_ms: u64,
    cursor: Cursor,
    last_members_read_ms: u64,
    peers: BTreeMap<u32, Peer>,
}

/// What became of a `Mesh::publish`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Published {
    Written,
    /// No events, and no heartbeat due.
    NotDue,
    /// No segment number could be reserved (shared data refused): nothing was written.
    NotReserved,
    /// A number was reserved but the segment could not be written (readers count it lost
    /// after `UNWRITTEN_WAIT_MS`); the caller keeps the events for its next try.
    NotWritten,
}

/// Where a reader is in the process's log.
#[derive(Debug, Default)]
pub struct Cursor {
    /// The next segment number to read (`None` before the first read).
    next: Option<u64>,
    /// Since when the segment `next` was found reserved but not written.
    unwritten_since: Option<u64>,
    /// Segments this worker wrote that the cursor has not passed yet: skipped, not read.
    own: VecDeque<u64>,
    /// The head as the last read found it, with its CAS, when the cursor had read up to it:
    /// the next publish reserves `head + 1` with one host call while nobody moved it.
    head_cas: Option<(u64, u32)>,
}

impl Cursor {
    /// The segments written since the last call, in order, and how many were lost
    /// (overwritten before this reader came, or reserved and never written).
    pub fn read_new(&mut self, now: Millis) -> (Vec<Segment>, u64) {
        let (mut out, mut lost) = (Vec::new(), 0);
        let (head, cas) = read_u64_cas(HEAD_KEY);
        // First call: start after what is already there (older events are history).
        let mut next = *self.next.get_or_insert(head + 1);
        if head + 1 > next + SLOTS {
            lost += head + 1 - SLOTS - next;
            next = head + 1 - SLOTS;
            self.unwritten_since = None;
        }
        let last = head.min(next + MAX_READ_PER_TICK - 1);
        while next <= last {
            if skip_own(&mut self.own, next) {
                next += 1;
                continue;
            }
            match read_segment(next) {
                Some(segment) => {
                    lost += segment.number - next;
                    next = segment.number + 1;
                    self.unwritten_since = None;
                    out.push(segment);
                }
                None => {
                    let since = *self.unwritten_since.get_or_insert(now.0);
                    if now.0.saturating_sub(since) < UNWRITTEN_WAIT_MS {
                        break;
                    }
                    lost += 1;
                    next += 1;
                    self.unwritten_since = None;
                }
            }
        }
        self.next = Some(next);
        self.head_cas = cas.filter(|_| next == head + 1).map(|c| (head, c));
        (out, lost)
    }

    /// Reserves the next segment number for this worker's own segment: one compare-and-swap
    /// from the head the last read saw when nobody moved it since, else the full increment.
    fn reserve(&mut self) -> Option<u64> {
        let number = match self.head_cas.take() {
            Some((head, cas)) => match host::set_shared_data_cas(HEAD_KEY, &(head + 1).to_le_bytes(), Some(cas)) {
                Ok(()) => Some(head + 1),
                Err(Status::CasMismatch) => increment(HEAD_KEY),
                Err(_) => None,
            },
            None => increment(HEAD_KEY),
        }?;
        if self.own.len() as u64 >= SLOTS {
            self.own.pop_front();
        }
        self.own.push_back(number);
        Some(number)
    }
}

/// Whether segment `next` is this worker's own (forgetting its own numbers the reader passed).
fn skip_own(own: &mut VecDeque<u64>, next: u64) -> bool {
    while own.front().is_some_and(|n| *n < next) {
        own.pop_front();
    }
    if own.front() == Some(&next) {
        own.pop_front();
        return true;
    }
    false
}

/// Segment `number`, or a later one that overwrote its slot; `None` when it is reserved
/// but not written yet (the slot still holds an older one).
fn read_segment(number: u64) -> Option<Segment> {
    let bytes = host::shared_data(&slot_key(number)).ok().flatten()?;
    let segment = Segment::decode(bytes.as_slice()).ok()?;
    (segment.number >= number).then_some(segment)
}

impl Mesh {
    /// Joins the process's mesh, or `None` when shared data refuses or too many joined.
    pub fn join() -> Option<Mesh> {
        Some(Mesh {
            origin: claim_origin()?,
            nonce: host::now_nanos() | 1,
            last_write_ms: 0,
            cursor: Cursor::default(),
            last_members_read_ms: 0,
            peers: BTreeMap::new(),
        })
    }

    pub fn origin(&self) -> u32 {
        self.origin
    }

    /// Publishes `events` (this worker's changes since its last tick) as one segment, or an
    /// empty one when a heartbeat is due. A segment holding a placement is marked `sent`
    /// when there is a `send` (the worker forwards it to the other replicas itself,
    /// `replicas::DirectSender`), and handed to it once written: the scraping service does
    /// not forward it too, and a segment the log refused is sent by no one.
    pub fn publish(&mut self, events: &[PeerEvent], now: Millis, send: Option<impl FnOnce(&Segment)>) -> Published {
        if events.is_empty() && now.0.saturating_sub(self.last_write_ms) < HEARTBEAT_MS {
            return Published::NotDue;
        }
        // Nothing reserved: the caller keeps the events for its next try.
        let Some(number) = self.cursor.reserve() else {
            return Published::NotReserved;
        };
        let mut segment = Segment {
            number,
            origin: self.origin,
            nonce: self.nonce,
            written_ms: now.0,
            events: events.iter().map(WireEvent::from).collect(),
            sent: false,
        };
        let send = send.filter(|_| segment.holds_placement());
        segment.sent = send.is_some();
        if host::set_shared_data(&slot_key(number), &segment.encode_to_vec()).is_err() {
            return Published::NotWritten;
        }
        if let Some(send) = send {
            send(&segment);
        }
        self.last_write_ms = now.0;
        Published::Written
    }

    /// What the peers published since the last call.
    pub fn receive(&mut self, now: Millis, peer_timeout_ms: u64) -> Received {
        let mut rx = Received::default();
        let (segments, lost) = self.cursor.read_new(now);
        rx.lost = lost;
        for segment in segments {
            self.apply(segment, now, &mut rx);
        }
        rx.gone = self.expire(now, peer_timeout_ms);
        if rx.origin_taken {
            if let Some(origin) = claim_origin() {
                self.origin = origin;
                // A departed peer's origin, reused: its segments are now this worker's own.
                self.peers.remove(&origin);
                rx.new_origin = Some(origin);
            }
        }
        if now.0.saturating_sub(self.last_members_read_ms) >= HEARTBEAT_MS {
            self.last_members_read_ms = now.0;
            rx.members = self.live_workers();
        }
        rx
    }

    /// This process's workers alive now: this one and the local peers not gone (workers of
    /// other replicas do not count: they keep their own copies elsewhere).
    fn live_workers(&self) -> u64 {
        let peers = self
            .peers
            .iter()
            .filter(|(origin, p)| **origin <= MAX_PEERS as u32 && !p.gone)
            .count();
        1 + peers as u64
    }

    /// Peers not heard from for `timeout_ms`, each reported once until heard again.
    fn expire(&mut self, now: Millis, timeout_ms: u64) -> Vec<u32> {
        let mut gone = Vec::new();
        for (origin, peer) in &mut self.peers {
            if !peer.gone && now.0.saturating_sub(peer.heard_ms) > timeout_ms {
                peer.gone = true;
                gone.push(*origin);
            }
        }
        // Long gone (a replica restarted with new origins): no need to remember them.
        self.peers
            .retain(|_, p| !p.gone || now.0.saturating_sub(p.heard_ms) <= timeout_ms.saturating_mul(10));
        gone
    }

    fn apply(&mut self, segment: Segment, now: Millis, rx: &mut Received) {
        if segment.origin == self.origin {
            rx.origin_taken |= segment.nonce != self.nonce;
            return;
        }
        let peer = self.peers.entry(segment.origin).or_insert(Peer {
            nonce: segment.nonce,
            heard_ms: now.0,
            gone: false,
        });
        if peer.nonce != segment.nonce {
            rx.replaced.push((rx.events.len(), segment.origin));
        }
        (peer.nonce, peer.heard_ms, peer.gone) = (segment.nonce, now.0, false);
        rx.events
            .extend(segment.events.into_iter().filter_map(WireEvent::into_event));
    }
}

/// A counter's value (0 when absent) and its CAS.
fn read_u64_cas(key: &str) -> (u64, Option<u32>) {
    match host::shared_data_cas(key) {
        Ok((bytes, cas)) => (bytes.and_then(|b| b.try_into().ok()).map_or(0, u64::from_le_bytes), cas),
        Err(_) => (0, None),
    }
}

pub(crate) fn read_u64(key: &str) -> Option<u64> {
    match host::shared_data(key) {
        Ok(Some(bytes)) => bytes.try_into().ok().map(u64::from_le_bytes),
        _ => None,
    }
}

/// Adds one to a shared counter and returns the new value (compare-and-swap, retried).
pub(crate) fn increment(key: &str) -> Option<u64> {
    increment_in(&mut HostShared, key)
}

/// Shared data as the counter sees it (the host's, or a test's).
pub(crate) trait SharedCells {
    fn get(&mut self, key: &str) -> Result<(Option<Vec<u8>>, Option<u32>), Status>;
    /// `cas` as `host::set_shared_data_cas` takes it (`None`: create only if absent).
    fn set(&mut self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), Status>;
}

pub(crate) struct HostShared;

impl SharedCells for HostShared {
    fn get(&mut self, key: &str) -> Result<(Option<Vec<u8>>, Option<u32>), Status> {
        host::shared_data_cas(key)
    }
    fn set(&mut self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), Status> {
        host::set_shared_data_cas(key, value, cas)
    }
}

/// `increment` over any shared data. An absent counter is created at 1 only if it is still
/// absent (`host::set_shared_data_cas`), so two VMs that both found it absent cannot both
/// take 1: the second write is refused and that VM counts on from the first's value.
fn increment_in(cells: &mut impl SharedCells, key: &str) -> Option<u64> {
    for _ in 0..64 {
        let (value, cas) = cells.get(key).ok()?;
        let Some(cas) = cas else {
            match cells.set(key, &1u64.to_le_bytes(), None) {
                Ok(()) => return Some(1),
                Err(Status::CasMismatch) => continue,
                Err(_) => return None,
            }
        };
        let current = value.and_then(|b| b.try_into().ok()).map_or(0, u64::from_le_bytes);
        let next = current.wrapping_add(1);
        match cells.set(key, &next.to_le_bytes(), Some(cas)) {
            Ok(()) => return Some(next),
            Err(Status::CasMismatch) => continue,
            Err(_) => return None,
        }
    }
    None
}

/// The next origin, counting around `MAX_PEERS`: a filter reloaded by a configuration change
/// starts new worker roots, and the origins of the ones it replaced (silent, so forgotten by
/// their peers after `share.peer_timeout_ms`) are taken again. Two live workers could share
/// one only if 256 joined while one of them lived; the nonce check then moves one of them.
fn claim_origin() -> Option<u32> {
    let n = increment(MEMBERS_KEY)?;
    Some(((n.saturating_sub(1) % MAX_PEERS) + 1) as u32)
}

/// Envoy's shared data as tests see it (`SharedData::set`: a compare-and-swap value is
/// checked only for a present key; values count up from 1), with another VM's step that
/// runs right after this VM's next read (`other_vm`), as a VM on another thread can.
#[cfg(test)]
#[derive(Default)]
pub(crate) struct EnvoyCells {
    cells: BTreeMap<String, (Vec<u8>, u32)>,
    last_cas: u32,
    pub other_vm: Option<OtherVm>,
}

/// What another VM does between this VM's read and its write.
#[cfg(test)]
pub(crate) type OtherVm = Box<dyn FnOnce(&mut EnvoyCells)>;

#[cfg(test)]
impl SharedCells for EnvoyCells {
    fn get(&mut self, key: &str) -> Result<(Option<Vec<u8>>, Option<u32>), Status> {
        let read = self.cells.get(key).cloned();
        if let Some(step) = self.other_vm.take() {
            step(self);
        }
        Ok((read.as_ref().map(|r| r.0.clone()), read.map(|r| r.1)))
    }
    fn set(&mut self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), Status> {
        let cas = host::cas_token(cas);
        if let Some((_, current)) = self.cells.get(key) {
            if cas != 0 && cas != *current {
                return Err(Status::CasMismatch);
            }
        }
        self.last_cas += 1;
        self.cells.insert(key.to_string(), (value.to_vec(), self.last_cas));
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::wire::tests::routed;
    use super::*;

    #[test]
    fn two_vms_that_find_a_counter_absent_take_different_numbers() {
        let mut cells = EnvoyCells {
            other_vm: Some(Box::new(|c: &mut EnvoyCells| {
                assert_eq!(increment_in(c, "ids"), Some(1), "the other VM found it absent too");
            })),
            ..EnvoyCells::default()
        };
        assert_eq!(increment_in(&mut cells, "ids"), Some(2), "the other VM took 1");
        assert_eq!(increment_in(&mut cells, "ids"), Some(3));
    }

    fn reader() -> Mesh {
        Mesh {
            origin: 1,
            nonce: 9,
            last_write_ms: 0,
            cursor: Cursor::default(),
            last_members_read_ms: 0,
            peers: BTreeMap::new(),
        }
    }

    fn segment(number: u64, origin: u32, events: &[PeerEvent]) -> Segment {
        Segment {
            number,
            origin,
            nonce: 5,
            written_ms: 0,
            events: events.iter().map(WireEvent::from).collect(),
            sent: false,
        }
    }

    #[test]
    fn a_reader_applies_peers_events_and_not_its_own() {
        let mut m = reader();
        let mut rx = Received::default();
        m.apply(segment(1, 2, &[routed(1), routed(2)]), Millis(10), &mut rx);
        let mut own = segment(2, 1, &[routed(3)]);
        own.nonce = m.nonce;
        m.apply(own, Millis(10), &mut rx);
        assert_eq!(rx.events.len(), 2);
        assert!(!rx.origin_taken, "same nonce: its own segment");
        let mut other = segment(3, 1, &[routed(4)]);
        other.nonce = 77;
        m.apply(other, Millis(10), &mut rx);
        assert!(rx.origin_taken, "another VM writes under origin 1");
        assert_eq!(rx.events.len(), 2);
    }

    #[test]
    fn a_restarted_peer_is_forgotten_between_its_old_events_and_its_new_ones() {
        let mut m = reader();
        let mut rx = Received::default();
        m.apply(segment(1, 2, &[routed(1)]), Millis(10), &mut rx);
        m.apply(segment(2, 2, &[routed(2)]), Millis(10), &mut rx);
        let mut again = segment(3, 2, &[routed(3)]);
        again.nonce = 6;
        m.apply(again, Millis(10), &mut rx);
        assert_eq!(rx.events.len(), 3);
        assert_eq!(rx.replaced, vec![(2, 2)], "after the old VM's two events");
    }

    #[test]
    fn a_reader_skips_its_own_segments_and_only_those() {
        let mut own: VecDeque<u64> = [3, 5, 6].into();
        let read: Vec<u64> = (1..=8).filter(|n| !skip_own(&mut own, *n)).collect();
        assert_eq!(read, vec![1, 2, 4, 7, 8]);
        assert!(own.is_empty());
        let mut own: VecDeque<u64> = [2, 9].into();
        assert!(!skip_own(&mut own, 4), "a lapped reader drops the numbers it passed");
        assert_eq!(own, VecDeque::from([9]));
    }

    #[test]
    fn only_live_local_workers_split_the_index_budget() {
        let mut m = reader();
        let mut rx = Received::default();
        m.apply(segment(1, 2, &[]), Millis(10), &mut rx);
        m.apply(segment(2, 3, &[]), Millis(10), &mut rx);
        m.apply(segment(3, 0x1000 + 7, &[]), Millis(10), &mut rx);
        assert_eq!(
            m.live_workers(),
            3,
            "this one and two local peers; the remote one is not"
        );
        m.peers.get_mut(&3).unwrap().gone = true;
        assert_eq!(m.live_workers(), 2);
    }

    #[test]
    fn a_silent_peer_is_gone_once() {
        let mut m = reader();
        let mut rx = Received::default();
        m.apply(segment(1, 2, &[]), Millis(10), &mut rx);
        let late = Millis(10 + 6000);
        assert_eq!(m.expire(Millis(10 + 4000), 5000), Vec::<u32>::new());
        assert_eq!(m.expire(late, 5000), vec![2]);
        assert_eq!(m.expire(late, 5000), Vec::<u32>::new(), "reported once");
        let mut rx = Received::default();
        m.apply(segment(2, 2, &[]), late, &mut rx);
        assert!(!m.peers[&2].gone, "heard again: back");
    }
}

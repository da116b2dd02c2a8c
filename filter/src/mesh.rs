//! One view per Envoy process: the worker VMs exchange `kvroute_core::PeerEvent`s through
//! proxy-wasm shared data, so each one routes with the placements and load of all.
//!
//! Shape, and why:
//! - Each worker VM owns one key, `kvroute.mesh.log.<origin>`, holding its recent events (the
//!   last `RETAIN_MS`, at most `MAX_RETAINED`) numbered in order. Only its owner writes it, so
//!   writers never contend; shared data has no delete, and the key space stays bounded by
//!   the number of workers (`MAX_PEERS`).
//! - A process-wide counter, `kvroute.mesh.version`, is bumped (compare-and-swap, retried)
//!   after every write, so a worker reads its peers' logs only when one moved: an idle
//!   gateway costs one host call per worker tick.
//! - On its tick (`share.tick_ms`) a worker publishes what it did since its last tick and
//!   applies what its peers published: a placement reaches every worker within two ticks.
//!   The request path makes no host call for sharing; events wait in the router's outbox.
//! - A reader that fell behind the retained window counts what it lost
//!   (`mesh.lost_events`). A peer silent for `share.peer_timeout_ms` (its VM failed or
//!   stopped) is forgotten and its requests' load released.
//! - Origins come from a counter (`kvroute.mesh.members`, compare-and-swap). Shared data has
//!   no create-if-absent, so two VMs starting at the same instant could take one origin;
//!   every log carries its writer's nonce, and a worker that finds its origin's log written
//!   by another VM takes a new origin.
//!
//! Cost: every placement is applied by every worker (O(workers) work per request, none of it
//! on the request path), and every worker keeps a copy of the prefix index, so the configured
//! index budget is split between the workers (`Router::set_index_budget`).

use std::collections::{BTreeMap, VecDeque};

use kvroute_core::{BlockHash, EndpointId, Millis, PeerEvent, Tokens};
use prost::Message;
use proxy_wasm::types::Status;

use crate::host;

const MEMBERS_KEY: &str = "kvroute.mesh.members";
const VERSION_KEY: &str = "kvroute.mesh.version";
/// Workers of one process that can share (origins above it do not join).
pub const MAX_PEERS: u64 = 256;
/// How long a worker's events stay readable by its peers.
const RETAIN_MS: u64 = 250;
const MAX_RETAINED: usize = 4096;
/// A worker with nothing to say still writes its log this often, so peers know it lives.
const HEARTBEAT_MS: u64 = 1000;

fn log_key(origin: u32) -> String {
    format!("kvroute.mesh.log.{origin}")
}

/// A worker's log as it sits in shared data.
#[derive(Clone, PartialEq, prost::Message)]
pub struct PeerLog {
    #[prost(uint32, tag = "1")]
    pub origin: u32,
    #[prost(uint64, tag = "2")]
    pub nonce: u64,
    #[prost(uint64, tag = "3")]
    pub heartbeat_ms: u64,
    /// Sequence number of `events[0]`.
    #[prost(uint64, tag = "4")]
    pub first_seq: u64,
    #[prost(message, repeated, tag = "5")]
    pub events: Vec<WireEvent>,
}

const ROUTED: u32 = 0;
const FIRST_TOKEN: u32 = 1;
const COMPLETED: u32 = 2;

#[derive(Clone, PartialEq, prost::Message)]
pub struct WireEvent {
    #[prost(uint64, tag = "1")]
    pub key: u64,
    #[prost(uint32, tag = "2")]
    pub kind: u32,
    #[prost(string, tag = "3")]
    pub endpoint: String,
    #[prost(fixed64, repeated, tag = "4")]
    pub blocks: Vec<u64>,
    #[prost(uint64, tag = "5")]
    pub prompt_tokens: u64,
    #[prost(uint64, tag = "6")]
    pub uncached: u64,
    #[prost(uint64, tag = "7")]
    pub at_ms: u64,
    #[prost(uint64, optional, tag = "8")]
    pub cached_tokens: Option<u64>,
}

impl From<&PeerEvent> for WireEvent {
    fn from(e: &PeerEvent) -> WireEvent {
        let mut w = WireEvent {
            key: e.key(),
            ..WireEvent::default()
        };
        match e {
            PeerEvent::Routed {
                endpoint,
                blocks,
                prompt_tokens,
                uncached,
                at,
                ..
            } => {
                w.kind = ROUTED;
                w.endpoint = endpoint.to_string();
                w.blocks = blocks.iter().map(|b| b.0).collect();
                (w.prompt_tokens, w.uncached, w.at_ms) = (prompt_tokens.0, uncached.0, at.0);
            }
            PeerEvent::FirstToken { .. } => w.kind = FIRST_TOKEN,
            PeerEvent::Completed {
                served_by,
                cached_tokens,
                ..
            } => {
                w.kind = COMPLETED;
                w.endpoint = served_by.as_ref().map(ToString::to_string).unwrap_or_default();
                w.cached_tokens = *cached_tokens;
            }
        }
        w
    }
}

impl WireEvent {
    fn into_event(self) -> Option<PeerEvent> {
        let key = self.key;
        match self.kind {
            ROUTED => Some(PeerEvent::Routed {
                key,
                endpoint: EndpointId::new(self.endpoint),
                blocks: self.blocks.into_iter().map(BlockHash).collect(),
                prompt_tokens: Tokens(self.prompt_tokens),
                uncached: Tokens(self.uncached),
                at: Millis(self.at_ms),
            }),
            FIRST_TOKEN => Some(PeerEvent::FirstToken { key }),
            COMPLETED => Some(PeerEvent::Completed {
                key,
                served_by: (!self.endpoint.is_empty()).then(|| EndpointId::new(self.endpoint)),
                cached_tokens: self.cached_tokens,
            }),
            _ => None,
        }
    }
}

#[derive(Clone, Debug)]
struct Peer {
    nonce: u64,
    /// The next sequence number expected from it (`None` before first contact).
    next_seq: Option<u64>,
    heartbeat_ms: u64,
    gone: bool,
}

/// What one tick brought from the peers.
#[derive(Debug, Default)]
pub struct Received {
    pub events: Vec<PeerEvent>,
    /// Events a peer published that this worker read too late to see.
    pub lost: u64,
    /// Origins to forget: silent past the timeout, or replaced by a new VM.
    pub gone: Vec<u32>,
    /// Workers that joined the process so far.
    pub members: u64,
}

pub struct Mesh {
    origin: u32,
    nonce: u64,
    next_seq: u64,
    /// This worker's retained events, encoded, with the time each was published.
    retained: VecDeque<(u64, Vec<u8>)>,
    last_write_ms: u64,
    seen_version: Option<u64>,
    last_full_read_ms: u64,
    peers: BTreeMap<u32, Peer>,
}

impl Mesh {
    /// Joins the process's mesh, or `None` when shared data refuses or too many joined.
    pub fn join() -> Option<Mesh> {
        let nonce = host::now_nanos() | 1;
        let origin = claim_origin()?;
        Some(Mesh {
            origin,
            nonce,
            next_seq: 0,
            retained: VecDeque::new(),
            last_write_ms: 0,
            seen_version: None,
            last_full_read_ms: 0,
            peers: BTreeMap::new(),
        })
    }

    pub fn origin(&self) -> u32 {
        self.origin
    }

    /// Publishes `events` (this worker's changes since the last call). Returns a new origin
    /// when another VM was found writing under this one's (the caller re-stamps its router).
    pub fn publish(&mut self, events: &[PeerEvent], now: Millis) -> Option<u32> {
        for e in events {
            self.retained.push_back((now.0, WireEvent::from(e).encode_to_vec()));
            self.next_seq += 1;
        }
        while self
            .retained
            .front()
            .is_some_and(|(at, _)| now.0.saturating_sub(*at) > RETAIN_MS || self.retained.len() > MAX_RETAINED)
        {
            self.retained.pop_front();
        }
        let heartbeat_due = now.0.saturating_sub(self.last_write_ms) >= HEARTBEAT_MS;
        if events.is_empty() && !heartbeat_due {
            return None;
        }
        let rejoined = if heartbeat_due { self.check_origin() } else { None };
        if host::set_shared_data(&log_key(self.origin), &self.encode_log(now)).is_ok() {
            self.last_write_ms = now.0;
            bump_version();
        }
        rejoined
    }

    /// The log as prost would encode `PeerLog`, with the retained events' bytes reused.
    fn encode_log(&self, now: Millis) -> Vec<u8> {
        let head = PeerLog {
            origin: self.origin,
            nonce: self.nonce,
            heartbeat_ms: now.0,
            first_seq: self.next_seq - self.retained.len() as u64,
            events: Vec::new(),
        };
        let size: usize = self.retained.iter().map(|(_, b)| b.len() + 8).sum();
        let mut out = Vec::with_capacity(head.encoded_len() + size);
        let _ = head.encode(&mut out);
        for (_, bytes) in &self.retained {
            prost::encoding::encode_key(5, prost::encoding::WireType::LengthDelimited, &mut out);
            prost::encoding::encode_varint(bytes.len() as u64, &mut out);
            out.extend_from_slice(bytes);
        }
        out
    }

    /// Another VM wrote this origin's log since this one last did: take a new origin.
    fn check_origin(&mut self) -> Option<u32> {
        let Ok(Some(bytes)) = host::shared_data(&log_key(self.origin)) else {
            return None;
        };
        let theirs = PeerLog::decode(bytes.as_slice()).ok()?.nonce;
        if theirs == self.nonce || self.last_write_ms == 0 {
            return None;
        }
        let origin = claim_origin()?;
        self.origin = origin;
        Some(origin)
    }

    /// What the peers published since the last call. Reads their logs only when the
    /// version moved (or once a heartbeat period, to notice silent peers).
    pub fn receive(&mut self, now: Millis, peer_timeout_ms: u64) -> Received {
        let mut rx = Received::default();
        let version = read_u64(VERSION_KEY).unwrap_or(0);
        let full = now.0.saturating_sub(self.last_full_read_ms) >= HEARTBEAT_MS;
        if self.seen_version == Some(version) && !full {
            return rx;
        }
        self.seen_version = Some(version);
        if full {
            self.last_full_read_ms = now.0;
        }
        rx.members = read_u64(MEMBERS_KEY).unwrap_or(0).min(MAX_PEERS);
        for origin in 1..=rx.members as u32 {
            if origin == self.origin {
                continue;
            }
            let Ok(Some(bytes)) = host::shared_data(&log_key(origin)) else {
                continue;
            };
            let Ok(log) = PeerLog::decode(bytes.as_slice()) else {
                continue;
            };
            self.read_log(origin, log, &mut rx);
        }
        for (origin, peer) in &mut self.peers {
            if !peer.gone && now.0.saturating_sub(peer.heartbeat_ms) > peer_timeout_ms {
                peer.gone = true;
                rx.gone.push(*origin);
            }
        }
        rx
    }

    fn read_log(&mut self, origin: u32, log: PeerLog, rx: &mut Received) {
        let peer = self.peers.entry(origin).or_insert(Peer {
            nonce: log.nonce,
            next_seq: None,
            heartbeat_ms: log.heartbeat_ms,
            gone: false,
        });
        if peer.nonce != log.nonce {
            // A new VM took this origin: whatever the old one had in flight is not coming back.
            rx.gone.push(origin);
            *peer = Peer {
                nonce: log.nonce,
                next_seq: None,
                heartbeat_ms: log.heartbeat_ms,
                gone: false,
            };
        }
        peer.heartbeat_ms = peer.heartbeat_ms.max(log.heartbeat_ms);
        peer.gone = false;
        let end = log.first_seq + log.events.len() as u64;
        let start = peer.next_seq.unwrap_or(log.first_seq);
        rx.lost += log.first_seq.saturating_sub(start);
        let skip = start.saturating_sub(log.first_seq) as usize;
        rx.events
            .extend(log.events.into_iter().skip(skip).filter_map(WireEvent::into_event));
        peer.next_seq = Some(end.max(start));
    }
}

fn read_u64(key: &str) -> Option<u64> {
    match host::shared_data(key) {
        Ok(Some(bytes)) => bytes.try_into().ok().map(u64::from_le_bytes),
        _ => None,
    }
}

/// Adds one to a shared counter and returns the new value (compare-and-swap, retried).
fn increment(key: &str) -> Option<u64> {
    for _ in 0..64 {
        let (value, cas) = host::shared_data_cas(key).ok()?;
        let Some(cas) = cas else {
            // Absent: create it. Shared data has no create-if-absent; see the module note.
            host::set_shared_data_cas(key, &0u64.to_le_bytes(), None).ok()?;
            continue;
        };
        let current = value.and_then(|b| b.try_into().ok()).map_or(0, u64::from_le_bytes);
        let next = current.wrapping_add(1);
        match host::set_shared_data_cas(key, &next.to_le_bytes(), Some(cas)) {
            Ok(()) => return Some(next),
            Err(Status::CasMismatch) => continue,
            Err(_) => return None,
        }
    }
    None
}

fn claim_origin() -> Option<u32> {
    let n = increment(MEMBERS_KEY)?;
    (n <= MAX_PEERS).then_some(n as u32)
}

fn bump_version() {
    let _ = increment(VERSION_KEY);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn routed(key: u64) -> PeerEvent {
        PeerEvent::Routed {
            key,
            endpoint: EndpointId::new("10.0.0.1:8000"),
            blocks: vec![BlockHash(1), BlockHash(u64::MAX)],
            prompt_tokens: Tokens(300),
            uncached: Tokens(44),
            at: Millis(1234),
        }
    }

    #[test]
    fn every_event_kind_survives_the_wire() {
        let events = vec![
            routed(7),
            PeerEvent::FirstToken { key: 7 },
            PeerEvent::Completed {
                key: 7,
                served_by: Some(EndpointId::new("10.0.0.2:8000")),
                cached_tokens: Some(256),
            },
            PeerEvent::Completed {
                key: 8,
                served_by: None,
                cached_tokens: None,
            },
        ];
        for e in events {
            let bytes = WireEvent::from(&e).encode_to_vec();
            assert_eq!(WireEvent::decode(bytes.as_slice()).unwrap().into_event(), Some(e));
        }
    }

    fn mesh_with(events: &[PeerEvent], first_seq: u64) -> (Mesh, Vec<u8>) {
        let mut m = Mesh {
            origin: 1,
            nonce: 9,
            next_seq: first_seq,
            retained: VecDeque::new(),
            last_write_ms: 0,
            seen_version: None,
            last_full_read_ms: 0,
            peers: BTreeMap::new(),
        };
        for e in events {
            m.retained.push_back((0, WireEvent::from(e).encode_to_vec()));
            m.next_seq += 1;
        }
        let bytes = m.encode_log(Millis(50));
        (m, bytes)
    }

    #[test]
    fn the_hand_built_log_is_what_prost_decodes() {
        let (_, bytes) = mesh_with(&[routed(1), PeerEvent::FirstToken { key: 1 }], 10);
        let log = PeerLog::decode(bytes.as_slice()).unwrap();
        assert_eq!((log.origin, log.nonce, log.heartbeat_ms, log.first_seq), (1, 9, 50, 10));
        assert_eq!(log.events.len(), 2);
        assert_eq!(
            log.events[1].clone().into_event(),
            Some(PeerEvent::FirstToken { key: 1 })
        );
    }

    #[test]
    fn a_reader_applies_each_event_once_and_counts_what_it_missed() {
        let (_, bytes) = mesh_with(&[routed(1), routed(2), routed(3)], 10);
        let log = PeerLog::decode(bytes.as_slice()).unwrap();
        let (mut reader, _) = mesh_with(&[], 0);
        let mut rx = Received::default();
        reader.read_log(2, log.clone(), &mut rx);
        assert_eq!(
            (rx.events.len(), rx.lost),
            (3, 0),
            "first contact takes what is retained"
        );
        let mut again = Received::default();
        reader.read_log(2, log, &mut again);
        assert!(again.events.is_empty(), "nothing twice");
        // The writer moved on by 5 events and retains only its last 2: 3 were missed.
        let (_, later) = mesh_with(&[routed(7), routed(8)], 16);
        let mut rx = Received::default();
        reader.read_log(2, PeerLog::decode(later.as_slice()).unwrap(), &mut rx);
        assert_eq!((rx.events.len(), rx.lost), (2, 3));
    }

    #[test]
    fn a_new_vm_under_a_known_origin_makes_the_old_one_gone() {
        let (_, bytes) = mesh_with(&[routed(1)], 0);
        let mut log = PeerLog::decode(bytes.as_slice()).unwrap();
        let (mut reader, _) = mesh_with(&[], 0);
        let mut rx = Received::default();
        reader.read_log(3, log.clone(), &mut rx);
        log.nonce = 77;
        log.first_seq = 0;
        let mut rx = Received::default();
        reader.read_log(3, log, &mut rx);
        assert_eq!(rx.gone, vec![3]);
        assert_eq!(rx.events.len(), 1, "the new VM's events are applied from its start");
    }
}

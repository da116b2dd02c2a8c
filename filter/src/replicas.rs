//! Gateway replicas (separate Envoy processes behind one Service) share no memory: each
//! forwards its own workers' peer events to the others through Envoy itself, and takes
//! theirs into its process's log (`mesh`), so every router of every replica sees the
//! placements and load of all.
//!
//! The protocol, and why: the scraping service (main thread, one per process) reads the
//! process's log like a worker does (`Forwarder`, which takes no origin and applies nothing)
//! and POSTs what its own workers wrote since the last batch — not what came from other
//! replicas, so nothing echoes — to every replica listed
//! in `share.replicas.peers`, or, without that list, to every host of the
//! `share.replicas.cluster` cluster as Envoy's admin lists it (read like the pool, so a
//! Deployment's pods are followed: `PeerList`), through that cluster (an `override_host`
//! cluster, so the destination header picks each replica). A replica that gets its own
//! batch says so in its answer, and the sender stops sending to that address. A replica's
//! kvroute filter answers `share.replicas.path` itself (204), after checking the shared
//! secret in `x-kvroute-peer-secret` (403 without it), and writes each segment into its own
//! log under a remote origin with the request keys re-stamped (`take_forwarded`). No new
//! service, no extra hop on the request path.
//!
//! When: with `share.replicas.at_once` (the default) the service reads the log every ms
//! (one host call when nothing is new) and sends a batch at the first tick that finds a
//! placement in it; first tokens and completions ride along or leave `interval_ms` after
//! the last batch. Why: what a replica decides before the others' placements arrive is
//! what separates R replicas from one router, and it grows with the delay (replay, 8
//! replicas × 16 workers, TTFT p95 on the matrix's workloads at 80% load −4% to +11% of one
//! router when placements leave within the ms, +39% to +59% on three of five workloads
//! when everything waited for a 5 ms batch; BENCHMARKS.md). Why polling, not a wake-up:
//! a proxy-wasm shared queue would let a worker wake the service at once, but its callback
//! is posted across threads, and one of the two Envoys of a live run died in a host call at
//! shutdown (SIGTERM) while that design was on; HTTP calls made only from the service's own
//! timer are what every earlier run did. One batch a ms at most bounds the POST rate.
//! With `share.replicas.from_workers` a worker POSTs a segment that holds a placement that
//! is news (a cold or moved prefix, `PeerEvent::is_news`) to the other replicas itself as it
//! writes it (`DirectSender`; the service publishes where to in shared data), so it does not
//! wait for the service's tick; the service sends the rest. That is one POST per such
//! placement per replica, instead of one per batch, at most `from_workers_per_s` a second
//! per worker (`post_budget`; 20 by default: then a flood of cold prompts costs what
//! `at_once` alone does; news past it leaves with the service's next batch).
//!
//! Cost: one POST of the batch per replica per batch (at most 1,000 a second while
//! placements keep coming; empty batches only as a 1 s heartbeat), a 1 ms tick on the main
//! thread; each forwarded event is applied by every worker of every replica. A replica
//! that is down makes its POSTs fail (`replicas.forward_failure`; nothing is retried or
//! queued) and its workers' load is released on the others after `share.peer_timeout_ms`
//! without a heartbeat. Its placements already taken stay: the servers still hold them.

use std::cell::Cell;

use kvroute_core::fleet::Host;
use kvroute_core::peer::{local_id_of, origin_of, request_key};
use kvroute_core::{Config, EnvoyHealth, Millis};
use prost::Message;

use crate::host;
use crate::mesh::{increment, read_u64, slot_key, Cursor, Segment, HEAD_KEY, HEARTBEAT_MS, MAX_PEERS};
use crate::post_budget::PostBudget;
use crate::stats::{Metric, RequestStats};

/// What one replica forwards to the others: its workers' segments since its last batch.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Forward {
    /// The sending replica's nonce (a receiver drops its own).
    #[prost(uint64, tag = "1")]
    pub replica: u64,
    #[prost(message, repeated, tag = "2")]
    pub segments: Vec<Segment>,
}

const REPLICA_KEY: &str = "kvroute.mesh.replica";
/// A batch bigger than this is refused (400): a sender never has more to say in one
/// interval, and writing it would lap every reader of this process's log.
const MAX_SEGMENTS_PER_BATCH: usize = 256;
const MAX_EVENTS_PER_BATCH: usize = 65_536;
/// Origins of events from other replicas start here, above every local origin.
const REMOTE_BASE: u32 = 0x1000;

/// This process's replica nonce, as the scraping service set it (`None` before it did).
pub fn replica_nonce() -> Option<u64> {
    read_u64(REPLICA_KEY)
}

/// Sets this process's replica nonce unless set: only the scraping service (one per process,
/// on the main thread) calls it, so there is no race to create it.
pub fn init_replica_nonce() -> Option<u64> {
    if let Some(n) = replica_nonce() {
        return Some(n);
    }
    host::set_shared_data(REPLICA_KEY, &(host::now_nanos() | 1).to_le_bytes()).ok()?;
    replica_nonce()
}

/// The local origin under which worker `origin` of replica `replica` is known here: above
/// every local origin, distinct per (replica, worker) unless two replicas' nonces collide
/// modulo 16383 (then their workers share origins: accounting blurs, nothing breaks).
pub fn remote_origin(replica: u64, origin: u32) -> u32 {
    let r = (kvroute_core::policy::mix(replica) % 0x3fff) as u32;
    REMOTE_BASE + ((r << 9) | (origin & 0x1ff))
}

/// Reads the workers' segments for forwarding to the other replicas (the scraping service
/// runs it on the main thread; it takes no origin and applies nothing).
#[derive(Default)]
pub struct Forwarder {
    cursor: Cursor,
    last_sent_ms: u64,
    /// This process's own segments read but not sent yet.
    pending: Vec<Segment>,
}

impl Forwarder {
    /// The body to POST to the other replicas, when one is due: this process's own
    /// workers' segments since the last batch (not those that came from other replicas).
    /// Due at once when `at_once` and one of them holds a placement, else `interval_ms`
    /// after the last batch; an empty batch after `HEARTBEAT_MS` of nothing.
    /// Segments this process's log lost before the forwarder read them (it fell behind or a
    /// writer never wrote one) are counted in `lost`: the other replicas never see them.
    pub fn collect(
        &mut self,
        replica: u64,
        now: Millis,
        at_once: bool,
        interval_ms: u64,
        lost: &Metric,
    ) -> Option<Vec<u8>> {
        let (segments, missed) = self.cursor.read_new(now);
        if missed > 0 {
            lost.add(missed);
        }
        self.pending.extend(
            segments
                .into_iter()
                .filter(|s| s.origin != 0 && s.origin <= MAX_PEERS as u32 && !s.sent),
        );
        let since = now.0.saturating_sub(self.last_sent_ms);
        let placement = at_once && self.pending.iter().any(Segment::holds_placement);
        let due = placement
            || self.pending.len() >= MAX_SEGMENTS_PER_BATCH
            || (!self.pending.is_empty() && since >= interval_ms)
            || since >= HEARTBEAT_MS;
        if !due {
            return None;
        }
        self.last_sent_ms = now.0;
        // No batch above what a receiver takes; the rest leaves at the next tick.
        let n = self.pending.len().min(MAX_SEGMENTS_PER_BATCH);
        Some(
            Forward {
                replica,
                segments: self.pending.drain(..n).collect(),
            }
            .encode_to_vec(),
        )
    }
}

/// Where the scraping service writes the replicas it forwards to (`PeerList::targets`, one
/// per line), for the workers that POST their placements themselves.
const TARGETS_KEY: &str = "kvroute.replicas.targets";

/// Writes the replicas the workers send their placements to (the scraping service, on its
/// tick, when they changed since `last`: nothing is allocated on a tick that changes nothing).
pub fn publish_targets<'a>(targets: impl Iterator<Item = &'a String> + Clone, last: &mut Option<Vec<String>>) {
    if last.as_ref().is_some_and(|l| l.iter().eq(targets.clone())) {
        return;
    }
    let targets: Vec<String> = targets.cloned().collect();
    if host::set_shared_data(TARGETS_KEY, targets.join("\n").as_bytes()).is_ok() {
        *last = Some(targets);
    }
}

/// A worker's own forwarding of its placements (`share.replicas.from_workers`): a segment
/// that holds news is POSTed to every other replica as the worker writes it, from the
/// context the worker runs in (a request's, or its root's tick), instead of waiting for the
/// scraping service's next tick (up to 1 ms, and that tick's own delay on a busy main
/// thread). Replay, 2 replicas × 8 workers: what separates R replicas from one router is
/// that delay (BENCHMARKS.md). The batch and its receiver are the service's. The segment is
/// marked `sent` when it is written to the log, and POSTed only once it is written, so the
/// service skips it and nothing reaches a replica twice (a log write that fails sends
/// nothing: the events are published again later). A POST that cannot leave, or whose
/// answer is not 204, is counted (`replicas.direct_failure`), not retried, as the service
/// does (its batches through the same cluster would fail alike). Envoy makes the call on
/// the VM's root, so a request whose stream ends first does not cancel it; the answer is
/// then dropped uncounted. Until the service named this process and listed the replicas,
/// the service sends everything. A worker makes at most `from_workers_per_s` POSTs a
/// second (`PostBudget`); a segment past it is left to the service's next batch, so the
/// cost of a flood of cold prompts stays bounded and nothing is lost.
pub struct DirectSender {
    cluster: String,
    path: String,
    secret: String,
    timeout_ms: u64,
    nonce: Cell<Option<u64>>,
    budget: Cell<PostBudget>,
}

/// Why a worker leaves a segment with news to the scraping service.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NotSent {
    /// The service has not named this replica or listed another yet.
    NotReady,
    /// This worker's POSTs for the second are spent (`replicas.direct_over_budget`).
    OverBudget,
}

/// Where a worker's segment goes: this replica's name and the other replicas, as the
/// scraping service last listed them.
pub struct Outbound {
    replica: u64,
    targets: Vec<String>,
    at: Millis,
}

impl DirectSender {
    /// The sender for `config`, when it asks workers to forward their placements.
    pub fn new(config: &Config) -> Option<DirectSender> {
        let r = config.share().replicas.as_ref().filter(|r| r.from_workers)?;
        Some(DirectSender {
            cluster: r.cluster.clone(),
            path: r.path.clone(),
            secret: r.secret.clone(),
            timeout_ms: r.interval_ms.max(200),
            nonce: Cell::new(None),
            budget: Cell::new(PostBudget::new(r.from_workers_per_s)),
        })
    }

    /// Where to send now, or why the service forwards the segment instead: it has not
    /// named this replica or listed another, or this worker's POST budget does not cover
    /// the replicas listed. The list is read at every news placement (one host call,
    /// against the POSTs it precedes), so a replica the service just listed gets it.
    pub fn ready(&self, now: Millis) -> Result<Outbound, NotSent> {
        if self.nonce.get().is_none() {
            self.nonce.set(replica_nonce());
        }
        let replica = self.nonce.get().ok_or(NotSent::NotReady)?;
        let budget = self.budget.get();
        if !budget.covers(1, now) {
            return Err(NotSent::OverBudget);
        }
        let bytes = host::shared_data(TARGETS_KEY).ok().flatten().ok_or(NotSent::NotReady)?;
        let targets: Vec<String> = String::from_utf8_lossy(&bytes)
            .split('\n')
            .filter(|t| !t.is_empty())
            .map(str::to_string)
            .collect();
        if targets.is_empty() {
            return Err(NotSent::NotReady);
        }
        if !budget.covers(targets.len(), now) {
            return Err(NotSent::OverBudget);
        }
        Ok(Outbound {
            replica,
            targets,
            at: now,
        })
    }

    /// POSTs `segment` (written to the log, marked `sent`) to every replica of `out`.
    pub fn post(&self, out: &Outbound, segment: &Segment, stats: &RequestStats) {
        let mut budget = self.budget.get();
        budget.spend(out.targets.len(), out.at);
        self.budget.set(budget);
        let body = Forward {
            replica: out.replica,
            segments: vec![segment.clone()],
        }
        .encode_to_vec();
        for peer in &out.targets {
            match host::dispatch_post(&self.cluster, peer, &self.path, &self.secret, &body, self.timeout_ms) {
                Ok(_) => stats.direct_sent.inc(),
                Err(_) => stats.direct_failure.inc(),
            }
        }
    }
}

/// Counts the answer to a worker's own POST (`DirectSender`): anything but 204 failed.
pub fn count_direct_answer(num_headers: usize, stats: &RequestStats) {
    if host::call_status(num_headers).as_deref() != Some(b"204") {
        stats.direct_failure.inc();
    }
}

/// The replicas this process forwards to: the configured `share.replicas.peers`, or the
/// hosts of `share.replicas.cluster` as Envoy's admin last listed them. An address whose
/// answer said the batch came back to this process (`SELF_HEADER`) is not sent to again:
/// a listed or discovered peer set holds this replica too, and each of its batches would
/// cost one wasted POST. An address stays this process's as long as the process lives (a
/// pod's IP is its own until it ends).
#[derive(Debug, Default)]
pub struct PeerList {
    peers: Vec<String>,
    own: Vec<String>,
    /// Peers whose last forward failed, and why (logged when that changes, not per batch).
    failing: Vec<(String, String)>,
}

/// What a new listing of the replicas changed.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct PeerChange {
    pub joined: Vec<String>,
    pub left: Vec<String>,
}

impl PeerList {
    pub fn listed(peers: &[String]) -> PeerList {
        PeerList {
            peers: peers.to_vec(),
            ..PeerList::default()
        }
    }

    /// Records how a forward to `peer` went (`None`: delivered, else why not); true when
    /// that differs from the one before (a first failure, another cause, a recovery).
    pub fn on_forward(&mut self, peer: &str, failure: Option<&str>) -> bool {
        let at = self.failing.iter().position(|(p, _)| p == peer);
        match (failure, at) {
            (None, None) => false,
            (None, Some(i)) => {
                self.failing.swap_remove(i);
                true
            }
            (Some(why), Some(i)) if self.failing[i].1 == why => false,
            (Some(why), Some(i)) => {
                self.failing[i].1 = why.to_string();
                true
            }
            (Some(why), None) => {
                self.failing.push((peer.to_string(), why.to_string()));
                true
            }
        }
    }

    /// The addresses a batch goes to: every peer but this process.
    pub fn targets(&self) -> impl Iterator<Item = &String> + Clone {
        self.peers.iter().filter(|p| !self.own.contains(p))
    }

    /// Takes Envoy's current listing of the replicas' cluster: hosts that Envoy excludes
    /// (failing its health check, ejected) are left out; draining ones still get batches
    /// while they finish their requests.
    pub fn on_hosts(&mut self, hosts: &[Host]) -> PeerChange {
        let mut now: Vec<String> = hosts
            .iter()
            .filter(|h| h.envoy != EnvoyHealth::Excluded)
            .map(|h| h.id.as_str().to_string())
            .collect();
        now.sort();
        now.dedup();
        let change = PeerChange {
            joined: now.iter().filter(|p| !self.peers.contains(p)).cloned().collect(),
            left: self.peers.iter().filter(|p| !now.contains(p)).cloned().collect(),
        };
        self.failing.retain(|(p, _)| now.contains(p));
        self.peers = now;
        change
    }

    /// `peer` answered that the batch reached this process; true the first time.
    pub fn mark_own(&mut self, peer: &str) -> bool {
        if self.own.iter().any(|p| p == peer) {
            return false;
        }
        self.own.push(peer.to_string());
        true
    }
}

/// What a batch forwarded by another replica came to.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Taken {
    /// Events written into this process's log.
    pub events: usize,
    /// Events shared data refused (their segment or those after it).
    pub dropped: usize,
    /// The batch was this replica's own (sent to an address that is this process): the
    /// answer says so, and the sender stops sending there.
    pub own: bool,
}

/// The answer's header that tells a sender the batch reached itself, with the local address
/// the batch arrived at (`self 10.1.0.4:10000`). The sender takes the address it named as
/// its own only when the two agree: the replicas' cluster sends a batch for a host it does
/// not hold (not resolved yet, just removed) to another host (the `override_host` fallback),
/// which may be the sender itself, and that must not make it stop sending to the host it
/// named (a pod IP comes back with a new pod).
pub const SELF_HEADER: &str = "x-kvroute-replica";

/// The value of `SELF_HEADER` on kvroute's own refusal of a batch (a wrong or missing
/// secret): a 403 without it came from something before kvroute (an authorization policy,
/// a listener without kvroute).
pub const REFUSED_VALUE: &str = "refused";

/// The value of `SELF_HEADER` for a batch that arrived at local address `address`.
pub fn self_answer(address: &str) -> String {
    format!("self {address}")
}

/// Whether `answer` (the value of `SELF_HEADER`) says the batch sent to `peer` reached this
/// process at that very address.
pub fn answers_self(answer: &[u8], peer: &str) -> bool {
    answer.strip_prefix(b"self ") == Some(peer.as_bytes())
}

/// Takes a batch another replica forwarded into this process's log, each segment under the
/// sender's remote origin with its request keys re-stamped, so every worker here applies it.
/// `None` for a batch that does not decode; nothing taken for this replica's own.
pub fn take_forwarded(body: &[u8], now: Millis) -> Option<Taken> {
    let batch = Forward::decode(body).ok()?;
    let events: usize = batch.segments.iter().map(|s| s.events.len()).sum();
    if batch.segments.len() > MAX_SEGMENTS_PER_BATCH || events > MAX_EVENTS_PER_BATCH {
        return None;
    }
    let mut taken = Taken::default();
    // Until the scraping service named this replica, a batch could be this replica's own.
    match replica_nonce() {
        None => return Some(taken),
        Some(own) if own == batch.replica => {
            taken.own = true;
            return Some(taken);
        }
        Some(_) => {}
    }
    let mut refused = false;
    for mut segment in batch.segments {
        let n = segment.events.len();
        if !refused {
            restamp(&mut segment, batch.replica, now);
            refused = !increment(HEAD_KEY).is_some_and(|number| {
                segment.number = number;
                host::set_shared_data(&slot_key(number), &segment.encode_to_vec()).is_ok()
            });
        }
        if refused {
            taken.dropped += n;
        } else {
            taken.events += n;
        }
    }
    Some(taken)
}

/// Re-stamps a segment forwarded by replica `replica` for this process's log: its origin,
/// and each event's key, under the sender's remote origins; its times as of arrival.
fn restamp(segment: &mut Segment, replica: u64, now: Millis) {
    segment.origin = remote_origin(replica, segment.origin);
    segment.nonce = replica;
    segment.written_ms = now.0;
    for e in &mut segment.events {
        // By the key's own origin, not the segment's: a worker that took a new origin
        // publishes its requests' old keys (their completions, `Router::share_with_peers`)
        // under the new one.
        let origin = remote_origin(replica, origin_of(e.key));
        e.key = request_key(origin, local_id_of(e.key));
        // The sender's clock is not ours: "routed after the scrape" is judged by arrival.
        if e.at_ms != 0 {
            e.at_ms = now.0;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mesh::WireEvent;

    #[test]
    fn a_forwarded_key_keeps_its_own_origin_under_the_senders_remote_one() {
        // Worker 3 took origin 5 while its request 7 (keyed under 3) was in flight: the
        // completion of that request travels in a segment of origin 5.
        let mut segment = Segment {
            number: 40,
            origin: 5,
            nonce: 1,
            written_ms: 10,
            events: vec![
                WireEvent {
                    key: request_key(3, 7),
                    kind: 2,
                    ..WireEvent::default()
                },
                WireEvent {
                    key: request_key(5, 7),
                    at_ms: 10,
                    ..WireEvent::default()
                },
            ],
            sent: false,
        };
        restamp(&mut segment, 99, Millis(500));
        assert_eq!(segment.origin, remote_origin(99, 5));
        assert_eq!(segment.events[0].key, request_key(remote_origin(99, 3), 7));
        assert_eq!(segment.events[1].key, request_key(remote_origin(99, 5), 7));
        assert_eq!(segment.events[1].at_ms, 500, "the sender's clock is not ours");
        assert_eq!((segment.nonce, segment.written_ms), (99, 500));
    }

    fn host(id: &str, envoy: EnvoyHealth) -> Host {
        Host {
            id: kvroute_core::EndpointId::new(id),
            envoy,
            priority: 0,
            weight: 1,
        }
    }

    #[test]
    fn discovered_replicas_follow_envoys_listing_and_skip_this_process() {
        let mut list = PeerList::default();
        assert_eq!(list.targets().count(), 0, "nothing before the first listing");
        let change = list.on_hosts(&[
            host("10.0.0.2:10000", EnvoyHealth::Serve),
            host("10.0.0.1:10000", EnvoyHealth::Serve),
            host("10.0.0.3:10000", EnvoyHealth::Excluded),
        ]);
        assert_eq!(change.joined, ["10.0.0.1:10000", "10.0.0.2:10000"]);
        assert!(list.mark_own("10.0.0.1:10000"));
        assert!(!list.mark_own("10.0.0.1:10000"), "told once");
        assert_eq!(list.targets().collect::<Vec<_>>(), ["10.0.0.2:10000"]);
        // A pod replaced: its address leaves, a new one joins; this process stays skipped.
        let change = list.on_hosts(&[
            host("10.0.0.1:10000", EnvoyHealth::Serve),
            host("10.0.0.4:10000", EnvoyHealth::Draining),
        ]);
        assert_eq!(
            change,
            PeerChange {
                joined: vec!["10.0.0.4:10000".into()],
                left: vec!["10.0.0.2:10000".into()],
            }
        );
        assert_eq!(list.targets().collect::<Vec<_>>(), ["10.0.0.4:10000"]);
        let peer = "10.0.0.4:10000";
        assert!(answers_self(self_answer(peer).as_bytes(), peer));
        assert!(
            !answers_self(self_answer("10.0.0.1:10000").as_bytes(), peer),
            "a batch for a host the cluster lacked, sent to this process by the fallback"
        );
        assert!(!answers_self(b"self", peer), "no address: not taken as this process");
        assert!(list.on_forward(peer, Some("503")), "the first failure is news");
        assert!(!list.on_forward(peer, Some("503")), "the next ones are not");
        assert!(list.on_forward(peer, Some("403")), "another cause is");
        assert!(list.on_forward(peer, None), "recovered");
        assert!(!list.on_forward(peer, None));
    }

    #[test]
    fn remote_origins_sit_above_local_ones_and_differ_per_worker() {
        let a = remote_origin(12345, 1);
        assert!(a > MAX_PEERS as u32);
        assert_ne!(a, remote_origin(12345, 2));
        assert_ne!(a, remote_origin(999, 1));
        assert!(remote_origin(u64::MAX, 256) < 1 << (64 - kvroute_core::peer::LOCAL_ID_BITS));
    }
}

//! The virtual-time driver: a fleet of engines, one policy, one workload, deterministic.
//!
//! Events (arrivals, step ends, scrape ticks) are ordered by time in microseconds, then by
//! sequence number, so a run with the same inputs is byte-for-byte repeatable. At each
//! scrape tick every server's `/metrics` body is rendered and parsed (as a gateway would),
//! and the policy sees only those snapshots, as stale as the interval makes them.
//!
//! The policy runs as one router or as a gateway topology (`topology`: replicas × workers,
//! each an independent router; see `replay::topology`).

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use kvroute_core::hold::{Admit, HoldQueue};
use kvroute_core::request::{parse, ApiKind};
use kvroute_core::{parse_metrics, Config, PeerEvent, VllmMetrics};

use crate::engine::{Engine, Event};
use crate::policies::{Incoming, Pick, PolicyName};
use crate::profile::{Profile, BLOCK_TOKENS};
use crate::report::{Record, Rejection, RunReport};
use crate::tokens::engine_blocks;
use crate::workload::SimRequest;

pub use classes::Classes;
use topology::Routers;
pub use topology::Topology;

#[derive(Clone, Debug)]
pub struct ReplaySetup {
    /// The servers' profile (the first server's, for a mixed fleet).
    pub profile: Profile,
    pub servers: usize,
    /// A mixed fleet: server `i` runs `mixed[i]` (empty: every server runs `profile`).
    pub mixed: Vec<Profile>,
    /// One server slows down mid-run.
    pub slowdown: Option<Slowdown>,
    pub scrape_interval_ms: f64,
    pub seed: u64,
    pub router_config: Config,
    pub topology: Topology,
    /// Tenants and priority bands (overload runs); none: every request is priority 0 of
    /// tenant 0.
    pub classes: Option<Classes>,
    /// Servers that join or leave the pool mid-run (`check_pool_changes`).
    pub pool_changes: Vec<PoolChange>,
}

/// Server `server` joins the pool at `at_ms` (it is out of it before: no router knows it,
/// nothing scrapes it), or leaves it (from then on no router sends it anything and nothing
/// scrapes it; what it is running finishes, as a terminating pod drains). Every router
/// learns of it at once, as from its discovery.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PoolChange {
    pub server: usize,
    pub at_ms: f64,
    pub joins: bool,
}

/// Pool changes name servers of the fleet, each at most once, and leave one server in the
/// pool throughout.
pub fn check_pool_changes(servers: usize, changes: &[PoolChange]) -> anyhow::Result<()> {
    for (k, c) in changes.iter().enumerate() {
        anyhow::ensure!(
            c.server < servers,
            "server {} joins or leaves, but the fleet has {servers} servers, 0 to {}",
            c.server,
            servers.saturating_sub(1)
        );
        anyhow::ensure!(
            c.at_ms >= 0.0,
            "server {} joins or leaves before the run starts",
            c.server
        );
        anyhow::ensure!(
            changes[..k].iter().all(|o| o.server != c.server),
            "server {} joins or leaves twice: one change per server",
            c.server
        );
    }
    anyhow::ensure!(
        (0..servers).any(|s| changes.iter().all(|c| c.server != s)),
        "every server joins or leaves: keep one in the pool throughout"
    );
    Ok(())
}

/// From `at_ms` on, server `server`'s steps take `factor` times as long.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Slowdown {
    pub server: usize,
    pub factor: f64,
    pub at_ms: f64,
}

impl ReplaySetup {
    /// The profile server `i` runs.
    pub fn profile_of(&self, i: usize) -> Profile {
        self.mixed.get(i).unwrap_or(&self.profile).clone()
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Kind {
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
type Scraped = (f64, Vec<(usize, VllmMetrics, String)>);

struct Queue {
    heap: BinaryHeap<Reverse<(u64, u64, Kind)>>,
    seq: u64,
}

impl Queue {
    fn push(&mut self, at_ms: f64, kind: Kind) {
        self.seq += 1;
        self.heap
            .push(Reverse(((at_ms * 1000.0).round() as u64, self.seq, kind)));
    }
}

/// The chat body a client would send for `req`.
pub fn chat_body(model: &str, req: &SimRequest) -> String {
    serde_json::json!({
        "model": model,
        "messages": [{"role": "user", "content": req.prompt_text()}],
        "max_tokens": req.output_tokens,
    })
    .to_string()
}

/// A restart (`Topology::restart_at_ms`) must come before the last arrival: after it
/// nothing would be reported.
pub fn check_restart(topology: &Topology, requests: &[SimRequest]) -> anyhow::Result<()> {
    let Some(at) = topology.restart_at_ms else {
        return Ok(());
    };
    let last = requests.iter().map(|r| r.arrival_ms).fold(0.0, f64::max);
    anyhow::ensure!(
        at <= last,
        "the restart at {:.1} s comes after the last arrival ({:.1} s): nothing would be reported",
        at / 1000.0,
        last / 1000.0
    );
    Ok(())
}

/// Runs `policy` over `requests` and reports per-request outcomes.
pub fn run(setup: &ReplaySetup, policy: PolicyName, requests: &[SimRequest], progress: &dyn Fn(u64)) -> RunReport {
    run_until(setup, policy, requests, progress, &mut |_| false).0
}

/// `run`, but `stop` hears every completed request and ends the replay early by returning
/// true (e.g. once a latency objective can no longer be met): the report then covers the
/// requests completed so far, and the second value is true.
pub fn run_until(
    setup: &ReplaySetup,
    policy: PolicyName,
    requests: &[SimRequest],
    progress: &dyn Fn(u64),
    stop: &mut dyn FnMut(&Record) -> bool,
) -> (RunReport, bool) {
    let mut engines: Vec<Engine> = (0..setup.servers).map(|i| Engine::new(setup.profile_of(i))).collect();
    let topo = setup.topology;
    let mut routers = Routers::new(
        topo,
        policy,
        setup.servers,
        setup.profile.num_gpu_blocks,
        setup.seed,
        &setup.router_config,
        requests.len(),
    );
    let mut busy = vec![false; setup.servers];
    let mut pool: Vec<bool> = (0..setup.servers)
        .map(|s| !setup.pool_changes.iter().any(|c| c.server == s && c.joins))
        .collect();
    if pool.contains(&false) {
        routers.on_pool(&pool, 0.0);
    }
    let mut records: Vec<Option<Record>> = vec![None; requests.len()];
    let mut reachable = vec![0u64; requests.len()];
    let mut q = Queue {
        heap: BinaryHeap::new(),
        seq: 0,
    };
    // Queued first: a request arriving at the very moment of the restart meets the new
    // routers.
    if let Some(at) = topo.restart_at_ms {
        q.push(at, Kind::Restart);
    }
    // Queued before the arrivals too: a request arriving at the very moment of a change
    // meets the new pool.
    for (k, c) in setup.pool_changes.iter().enumerate() {
        q.push(c.at_ms, Kind::Pool(k));
    }
    for (i, r) in requests.iter().enumerate() {
        q.push(r.arrival_ms, Kind::Arrival(i));
    }
    if let Some(slow) = setup.slowdown {
        q.push(slow.at_ms, Kind::Slow);
    }
    for g in 0..topo.gateways.max(1) {
        q.push(topo.scrape_phase_ms(g, setup.scrape_interval_ms), Kind::Scrape(g));
    }
    let mut scraped: Vec<Scraped> = vec![(0.0, Vec::new()); topo.gateways.max(1)];
    let mut mail = Mailbox::default();
    let model = setup.profile.model.served_name();
    let mut done = 0usize;
    let mut stopped = false;
    let mut eviction_marks = Vec::new();
    let classes: Vec<(i64, u32)> = requests
        .iter()
        .enumerate()
        .map(|(i, r)| setup.classes.as_ref().map_or((0, 0), |c| c.of(r, i, setup.seed)))
        .collect();
    let mut gate = Gate::new(&setup.router_config, topo.routers(), requests.len(), &classes);
    while let Some(Reverse((t_us, _, kind))) = q.heap.pop() {
        if stopped {
            break;
        }
        let now = t_us as f64 / 1000.0;
        match kind {
            Kind::Slow => {
                if let Some(slow) = setup.slowdown {
                    if let Some(e) = engines.get_mut(slow.server) {
                        e.set_slow(slow.factor);
                    }
                }
            }
            Kind::Pool(k) => {
                let c = setup.pool_changes[k];
                pool[c.server] = c.joins;
                routers.on_pool(&pool, now);
            }
            Kind::Scrape(g) => {
                let snapshot = engines
                    .iter()
                    .enumerate()
                    .filter(|(s, _)| pool[*s])
                    .map(|(s, e)| {
                        let text = e.metrics_text(false, 0.0);
                        match parse_metrics(text.as_bytes(), 1 << 20) {
                            Ok(m) => (s, m, text),
                            Err(err) => simulator_bug(&format!("server {s}'s /metrics does not parse: {err}")),
                        }
                    })
                    .collect();
                scraped[g] = (now, snapshot);
                if g == 0 {
                    eviction_marks.push((now, engines.iter().map(|e| e.kv().evictions).sum()));
                }
                let workers = topo.workers.max(1);
                for r in g * workers..(g + 1) * workers {
                    if topo.routers() == 1 {
                        apply_snapshot(&mut routers, r, &scraped[g]);
                    } else {
                        q.push(topo.next_tick_ms(r, now), Kind::Snapshot(r));
                    }
                }
                if done + gate.rejected.len() < requests.len() {
                    q.push(now + setup.scrape_interval_ms, Kind::Scrape(g));
                }
            }
            Kind::Snapshot(r) => apply_snapshot(&mut routers, r, &scraped[topo.gateway_of(r)]),
            Kind::Restart => {
                routers.restart();
                if pool.contains(&false) {
                    routers.on_pool(&pool, now);
                }
                // What the old routers sent each other dies with them.
                mail.floor = mail.events.len();
            }
            Kind::Peer(r, k) => {
                if let Some(later) = routers.unread_until(r, now) {
                    // The worker already read its peers in this millisecond.
                    q.push(later, Kind::Peer(r, k));
                } else if let Some(ev) = mail.events.get(k).filter(|_| k >= mail.floor) {
                    routers.all[r].on_peer_event(ev, now);
                }
            }
            Kind::Arrival(i) => {
                let (body, parsed, blocks) = prepare(model, &requests[i], i);
                reachable[i] = engines
                    .iter()
                    .zip(&pool)
                    .filter(|(_, in_pool)| **in_pool)
                    .map(|(e, _)| e.kv().cached_prefix(&blocks) as u64 * BLOCK_TOKENS)
                    .max()
                    .unwrap_or(0)
                    .min(parsed.prompt_tokens.0.saturating_sub(1));
                let r = routers.assign(i);
                let held_at = topo.hold_queue_of(r);
                // Behind requests already held, an arrival waits its turn.
                let sheddable = classes[i].0 < 0;
                let pick = if gate.holds[held_at].is_empty() {
                    let incoming = Incoming {
                        id: i as u64,
                        body: body.as_bytes(),
                        canonical: &parsed.canonical,
                        prompt_tokens: parsed.prompt_tokens.0,
                        engine_blocks: &blocks,
                        pool: &pool,
                    };
                    routers.deciding(r, now);
                    let pick = routers.all[r].admit(&incoming, &engines, now, sheddable);
                    mail.send(&mut q, &mut routers, r, now);
                    pick
                } else {
                    Pick::Hold
                };
                match in_pool(pick, &pool) {
                    Pick::Server(s) => start(
                        &mut engines,
                        &mut busy,
                        &mut q,
                        s,
                        i,
                        &requests[i],
                        &parsed,
                        blocks,
                        now,
                    ),
                    Pick::Shed => gate.reject(i, now, now),
                    Pick::Hold => gate.hold(&mut q, held_at, r, i, now),
                }
            }
            Kind::Release(r) => {
                gate.due[r] = false;
                let held_at = topo.hold_queue_of(r);
                gate.expire(held_at, now);
                // The worker releases the head while it is its own (only the worker that
                // holds a stream can resume it) and a server has room.
                while let Some((i, _)) = gate.holds[held_at].peek().map(|h| h.item).filter(|h| h.1 == r) {
                    let (body, parsed, blocks) = prepare(model, &requests[i], i);
                    let incoming = Incoming {
                        id: i as u64,
                        body: body.as_bytes(),
                        canonical: &parsed.canonical,
                        prompt_tokens: parsed.prompt_tokens.0,
                        engine_blocks: &blocks,
                        pool: &pool,
                    };
                    routers.routing(i);
                    routers.deciding(r, now);
                    let pick = routers.all[r].admit(&incoming, &engines, now, false);
                    mail.send(&mut q, &mut routers, r, now);
                    let Pick::Server(s) = in_pool(pick, &pool) else { break };
                    gate.take_head(held_at);
                    routers.routed_by(i, r);
                    gate.held_ms[i] = now - requests[i].arrival_ms;
                    start(
                        &mut engines,
                        &mut busy,
                        &mut q,
                        s,
                        i,
                        &requests[i],
                        &parsed,
                        blocks,
                        now,
                    );
                }
                gate.tick(&mut q, r, now);
            }
            Kind::StepEnd(s) => {
                for ev in engines[s].finish_step(now) {
                    match ev {
                        Event::FirstToken { id, .. } => {
                            let r = routers.owner(id as usize);
                            if routers.routed_here(id as usize) {
                                routers.all[r].on_first_token(s, id, now);
                                mail.send(&mut q, &mut routers, r, now);
                            }
                        }
                        Event::Finished(f) => {
                            let r = routers.owner(f.id as usize);
                            if routers.routed_here(f.id as usize) {
                                routers.all[r].on_finished(s, &f, now);
                                mail.send(&mut q, &mut routers, r, now);
                            }
                            let id = f.id as usize;
                            let base = Record::from_finished(&f, s);
                            let held = gate.held_ms[id];
                            let record = Record {
                                reachable_tokens: reachable[id],
                                held_ms: held,
                                arrival_ms: requests[id].arrival_ms.min(base.arrival_ms),
                                ttft_ms: base.ttft_ms + held,
                                e2e_ms: base.e2e_ms + held,
                                priority: classes[id].0,
                                tenant: classes[id].1,
                                ..base
                            };
                            stopped |= stop(&record);
                            records[f.id as usize] = Some(record);
                            done += 1;
                            progress(done as u64);
                        }
                        Event::Token { .. } => {}
                    }
                }
                busy[s] = false;
                if let Some(d) = engines[s].start_step() {
                    busy[s] = true;
                    q.push(now + d, Kind::StepEnd(s));
                }
            }
        }
    }
    // After a restart only the requests that arrived from then on are reported (evictions
    // and preemptions still count the whole run).
    let reported = match topo.restart_at_ms {
        Some(at) => {
            for (r, req) in records.iter_mut().zip(requests) {
                if req.arrival_ms < at {
                    *r = None;
                }
            }
            requests.iter().filter(|r| r.arrival_ms >= at).count()
        }
        None => requests.len(),
    };
    let mut report = RunReport::build(&policy.to_string(), reported, records, &engines);
    let from = topo.restart_at_ms.unwrap_or(f64::NEG_INFINITY);
    report.rejections = gate
        .rejected
        .iter()
        .filter(|(i, _, _)| requests[*i].arrival_ms >= from)
        .map(|(i, since, at)| Rejection {
            arrival_ms: requests[*i].arrival_ms,
            waited_ms: at - since,
            priority: classes[*i].0,
            tenant: classes[*i].1,
        })
        .collect();
    eviction_marks.push((f64::MAX, report.evictions));
    report.eviction_marks = eviction_marks;
    (report, stopped)
}

/// A request's body as a client sends it, parsed as the gateway parses it, and its blocks
/// as the engines hash them.
fn prepare(model: &str, req: &SimRequest, i: usize) -> (String, kvroute_core::ParsedRequest, Vec<u64>) {
    let body = chat_body(model, req);
    let parsed = match parse(ApiKind::Chat, body.as_bytes()) {
        Ok(p) => p,
        Err(err) => simulator_bug(&format!("request {i}'s body does not parse: {err}")),
    };
    let blocks = engine_blocks(&parsed.canonical, parsed.prompt_tokens.0);
    (body, parsed, blocks)
}

/// Hands request `i` to server `s` and starts a step there if it was idle.
#[allow(clippy::too_many_arguments)]
fn start(
    engines: &mut [Engine],
    busy: &mut [bool],
    q: &mut Queue,
    s: usize,
    i: usize,
    req: &SimRequest,
    parsed: &kvroute_core::ParsedRequest,
    blocks: Vec<u64>,
    now: f64,
) {
    let spec = crate::engine::SeqSpec {
        id: i as u64,
        prompt_tokens: parsed.prompt_tokens.0,
        output_tokens: req.output_tokens,
        block_hashes: blocks,
    };
    engines[s].add(spec, now);
    if !busy[s] {
        if let Some(d) = engines[s].start_step() {
            busy[s] = true;
            q.push(now + d, Kind::StepEnd(s));
        }
    }
}

/// The gateway's side of `overload.hold` in the replay: the held requests (one queue per
/// gateway, at its first router's index, or one per router with `hold_per_worker`), each
/// with the router that holds it, which is woken by its tick (`share.tick_ms`, as the
/// filter's worker tick) while it holds any.
struct Gate {
    /// `(request, the router holding it)`.
    holds: Vec<HoldQueue<(usize, usize)>>,
    /// Requests each router holds.
    owned: Vec<usize>,
    due: Vec<bool>,
    held_ms: Vec<f64>,
    /// `(request, held since, answered 429 at)`.
    rejected: Vec<(usize, f64, f64)>,
    max_wait_ms: u64,
    tick_ms: f64,
    tenants: Vec<String>,
    priorities: Vec<i64>,
}

impl Gate {
    fn new(config: &Config, routers: usize, requests: usize, classes: &[(i64, u32)]) -> Gate {
        let hold = &config.overload().hold;
        Gate {
            holds: (0..routers)
                .map(|_| {
                    let mut q = HoldQueue::new(hold.max_requests, hold.priority_weight);
                    q.set_newest_first(hold.newest_first_after_ms);
                    q
                })
                .collect(),
            owned: vec![0; routers],
            due: vec![false; routers],
            held_ms: vec![0.0; requests],
            rejected: Vec::new(),
            max_wait_ms: hold.max_wait_ms,
            tick_ms: config.share().tick_ms.max(1) as f64,
            tenants: classes.iter().map(|c| c.1.to_string()).collect(),
            priorities: classes.iter().map(|c| c.0).collect(),
        }
    }

    /// Router `r` holds request `i` in queue `queue`.
    fn hold(&mut self, q: &mut Queue, queue: usize, r: usize, i: usize, now: f64) {
        let since = kvroute_core::Millis(now as u64);
        match self.holds[queue].push((i, r), self.priorities[i], &self.tenants[i], since) {
            Admit::Held => self.owned[r] += 1,
            Admit::Displaced(h) => {
                self.owned[r] += 1;
                self.owned[h.item.1] -= 1;
                self.reject(h.item.0, h.since.0 as f64, now);
            }
            Admit::Refused((i, _)) => self.reject(i, now, now),
        }
        self.tick(q, r, now);
    }

    /// Answers 429 every request of queue `queue` past the wait bound.
    fn expire(&mut self, queue: usize, now: f64) {
        for h in self.holds[queue].expire(kvroute_core::Millis(now as u64), self.max_wait_ms) {
            self.owned[h.item.1] -= 1;
            self.reject(h.item.0, h.since.0 as f64, now);
        }
    }

    /// The head of queue `queue` leaves it, released.
    fn take_head(&mut self, queue: usize) {
        if let Some(h) = self.holds[queue].pop() {
            self.owned[h.item.1] -= 1;
        }
    }

    fn reject(&mut self, i: usize, since: f64, now: f64) {
        self.rejected.push((i, since, now));
    }

    /// Wakes router `r` at its next tick while it holds anything.
    fn tick(&mut self, q: &mut Queue, r: usize, now: f64) {
        if self.owned[r] > 0 && !self.due[r] {
            self.due[r] = true;
            q.push(now + self.tick_ms, Kind::Release(r));
        }
    }
}

/// Peer events in flight between routers: one copy each, read by all its recipients.
#[derive(Default)]
struct Mailbox {
    events: Vec<PeerEvent>,
    /// Events before this index were sent by routers that have since restarted.
    floor: usize,
}

impl Mailbox {
    fn send(&mut self, q: &mut Queue, routers: &mut Routers, from: usize, now: f64) {
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

/// The replay renders every body and metrics text itself: one that does not parse is a bug
/// in the simulator, and skipping it would quietly skew every figure of the run.
#[allow(clippy::panic)]
fn simulator_bug(what: &str) -> ! {
    panic!("replay: {what}")
}

/// A policy that picks a server out of the pool is a bug in the simulator (Envoy would not
/// send there).
fn in_pool(pick: Pick, pool: &[bool]) -> Pick {
    if let Pick::Server(s) = pick {
        if !pool.get(s).copied().unwrap_or(false) {
            simulator_bug(&format!("a policy picked server {s}, which is not in the pool"));
        }
    }
    pick
}

fn apply_snapshot(routers: &mut Routers, r: usize, (at, servers): &Scraped) {
    for (s, m, text) in servers {
        routers.all[r].on_scrape(*s, m, text, *at);
    }
}

mod classes;
mod topology;

#[cfg(test)]
mod tests;

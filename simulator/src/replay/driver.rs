//! The replay's event loop: a queue of timed events and what each does to the engines, the
//! routers and the gateway's hold queues.

use kvroute_core::{parse_metrics, ParsedRequest};

use super::events::{Kind, Mailbox, Queue, Scraped};
use super::gate::Gate;
use super::topology::Routers;
use super::{prepare, simulator_bug, ReplaySetup};
use crate::engine::{Engine, Event, Finished};
use crate::policies::{Incoming, Pick, PolicyName};
use crate::profile::BLOCK_TOKENS;
use crate::report::{Record, Rejection, RunReport};
use crate::workload::SimRequest;

/// One replay in progress.
pub(super) struct Driver<'a> {
    setup: &'a ReplaySetup,
    policy: PolicyName,
    /// How often each gateway scrapes: the setup's interval, or the policy's own default
    /// refresh (`PolicyName::scrape_interval_ms`).
    scrape_ms: f64,
    requests: &'a [SimRequest],
    progress: &'a dyn Fn(u64),
    stop: &'a mut dyn FnMut(&Record) -> bool,
    model: &'static str,
    engines: Vec<Engine>,
    /// Whether server `s` has a step under way.
    busy: Vec<bool>,
    /// Whether server `s` is in the pool now.
    pool: Vec<bool>,
    routers: Routers,
    q: Queue,
    scraped: Vec<Scraped>,
    mail: Mailbox,
    gate: Gate,
    /// Each request's priority band and tenant.
    classes: Vec<(i64, u32)>,
    /// Each request's TTFT objective (`Classes::objective_of` its band).
    objectives: Vec<Option<f64>>,
    records: Vec<Option<Record>>,
    /// Each request's longest prefix cached on any server in the pool when it arrived.
    reachable: Vec<u64>,
    /// `(time, evictions so far)` at each of the first gateway's scrapes.
    eviction_marks: Vec<(f64, u64)>,
    done: usize,
    stopped: bool,
}

impl<'a> Driver<'a> {
    pub(super) fn new(
        setup: &'a ReplaySetup,
        policy: PolicyName,
        requests: &'a [SimRequest],
        progress: &'a dyn Fn(u64),
        stop: &'a mut dyn FnMut(&Record) -> bool,
    ) -> Driver<'a> {
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
        let pool: Vec<bool> = (0..setup.servers)
            .map(|s| !setup.pool_changes.iter().any(|c| c.server == s && c.joins))
            .collect();
        if pool.contains(&false) {
            routers.on_pool(&pool, 0.0);
        }
        let classes: Vec<(i64, u32)> = requests
            .iter()
            .enumerate()
            .map(|(i, r)| setup.classes.as_ref().map_or((0, 0), |c| c.of(r, i, setup.seed)))
            .collect();
        let objectives: Vec<Option<f64>> = classes
            .iter()
            .map(|c| setup.classes.as_ref().and_then(|k| k.objective_of(c.0)))
            .collect();
        let gate = Gate::new(&setup.router_config, topo.routers(), &classes, &objectives);
        Driver {
            setup,
            policy,
            scrape_ms: policy.scrape_interval_ms(setup.scrape_interval_ms),
            requests,
            progress,
            stop,
            model: setup.profile.model.served_name(),
            engines: (0..setup.servers).map(|i| Engine::new(setup.profile_of(i))).collect(),
            busy: vec![false; setup.servers],
            pool,
            routers,
            q: Queue::default(),
            scraped: vec![(0.0, Vec::new()); topo.gateways.max(1)],
            mail: Mailbox::default(),
            gate,
            classes,
            objectives,
            records: vec![None; requests.len()],
            reachable: vec![0; requests.len()],
            eviction_marks: Vec::new(),
            done: 0,
            stopped: false,
        }
    }

    /// Runs every event, or until `stop` asks to end; the report, and whether it ended early.
    pub(super) fn run(mut self) -> (RunReport, bool) {
        self.queue_start();
        while let Some((now, kind)) = self.q.pop() {
            if self.stopped {
                break;
            }
            self.on(kind, now);
        }
        let stopped = self.stopped;
        (self.report(), stopped)
    }

    fn queue_start(&mut self) {
        let setup = self.setup;
        let topo = setup.topology;
        // Queued first: a request arriving at the very moment of the restart meets the new
        // routers.
        if let Some(at) = topo.restart_at_ms {
            self.q.push(at, Kind::Restart);
        }
        // Queued before the arrivals too: a request arriving at the very moment of a change
        // meets the new pool.
        for (k, c) in setup.pool_changes.iter().enumerate() {
            self.q.push(c.at_ms, Kind::Pool(k));
        }
        for (i, r) in self.requests.iter().enumerate() {
            self.q.push(r.arrival_ms, Kind::Arrival(i));
        }
        if let Some(slow) = setup.slowdown {
            self.q.push(slow.at_ms, Kind::Slow);
        }
        for g in 0..topo.gateways.max(1) {
            self.q.push(topo.scrape_phase_ms(g, self.scrape_ms), Kind::Scrape(g));
        }
    }

    fn on(&mut self, kind: Kind, now: f64) {
        match kind {
            Kind::Slow => {
                if let Some(slow) = self.setup.slowdown {
                    if let Some(e) = self.engines.get_mut(slow.server) {
                        e.set_slow(slow.factor);
                    }
                }
            }
            Kind::Pool(k) => {
                let c = self.setup.pool_changes[k];
                self.pool[c.server] = c.joins;
                self.routers.on_pool(&self.pool, now);
            }
            Kind::Scrape(g) => self.on_scrape(g, now),
            Kind::Snapshot(r) => {
                let g = self.setup.topology.gateway_of(r);
                apply_snapshot(&mut self.routers, r, &self.scraped[g]);
            }
            Kind::Restart => {
                self.routers.restart();
                if self.pool.contains(&false) {
                    self.routers.on_pool(&self.pool, now);
                }
                // What the old routers sent each other dies with them.
                self.mail.floor = self.mail.events.len();
            }
            Kind::Peer(r, k) => {
                if let Some(later) = self.routers.unread_until(r, now) {
                    // The worker already read its peers in this millisecond.
                    self.q.push(later, Kind::Peer(r, k));
                } else if let Some(ev) = self.mail.events.get(k).filter(|_| k >= self.mail.floor) {
                    self.routers.all[r].on_peer_event(ev, now);
                }
            }
            Kind::Arrival(i) => self.on_arrival(i, now),
            Kind::Release(r) => self.on_release(r, now),
            Kind::StepEnd(s) => self.on_step_end(s, now),
        }
    }

    /// Gateway `g` renders and parses every pooled server's `/metrics`; its routers apply
    /// the snapshot at once (one router) or at their next tick.
    fn on_scrape(&mut self, g: usize, now: f64) {
        let topo = self.setup.topology;
        let snapshot = self
            .engines
            .iter()
            .enumerate()
            .filter(|(s, _)| self.pool[*s])
            .map(|(s, e)| {
                let text = e.metrics_text(false, 0.0);
                match parse_metrics(text.as_bytes(), 1 << 20) {
                    Ok(m) => (s, m, text),
                    Err(err) => simulator_bug(&format!("server {s}'s /metrics does not parse: {err}")),
                }
            })
            .collect();
        self.scraped[g] = (now, snapshot);
        if g == 0 {
            let evictions = self.engines.iter().map(|e| e.kv().evictions).sum();
            self.eviction_marks.push((now, evictions));
        }
        let workers = topo.workers.max(1);
        for r in g * workers..(g + 1) * workers {
            if topo.routers() == 1 {
                apply_snapshot(&mut self.routers, r, &self.scraped[g]);
            } else {
                self.q.push(topo.next_tick_ms(r, now), Kind::Snapshot(r));
            }
        }
        if self.done + self.gate.rejected.len() < self.requests.len() {
            self.q.push(now + self.scrape_ms, Kind::Scrape(g));
        }
    }

    fn on_arrival(&mut self, i: usize, now: f64) {
        let (body, parsed, blocks) = prepare(self.model, &self.requests[i], i);
        self.reachable[i] = self
            .engines
            .iter()
            .zip(&self.pool)
            .filter(|(_, in_pool)| **in_pool)
            .map(|(e, _)| e.kv().cached_prefix(&blocks) as u64 * BLOCK_TOKENS)
            .max()
            .unwrap_or(0)
            .min(parsed.prompt_tokens.0.saturating_sub(1));
        let r = self.routers.assign(i);
        let held_at = self.setup.topology.hold_queue_of(r);
        // Behind requests already held, an arrival waits its turn.
        let pick = if self.gate.holds[held_at].is_empty() {
            let sheddable = self.classes[i].0 < 0;
            self.admit(r, i, &body, &parsed, &blocks, sheddable, now)
        } else {
            Pick::Hold
        };
        match pick {
            Pick::Server(s) => self.start(s, i, &parsed, blocks, now),
            Pick::Shed => self.gate.reject(i, now, now),
            Pick::Hold => self.gate.hold(&mut self.q, held_at, r, i, now),
        }
    }

    /// Router `r`'s tick while it holds requests: the expired ones get 429, and the head
    /// leaves while it is `r`'s own (only the worker that holds a stream can resume it) and
    /// a server has room.
    fn on_release(&mut self, r: usize, now: f64) {
        self.gate.due[r] = false;
        let held_at = self.setup.topology.hold_queue_of(r);
        self.gate.expire(held_at, now);
        while let Some((i, _)) = self.gate.holds[held_at].peek().map(|h| h.item).filter(|h| h.1 == r) {
            let (body, parsed, blocks) = prepare(self.model, &self.requests[i], i);
            self.routers.routing(i);
            let Pick::Server(s) = self.admit(r, i, &body, &parsed, &blocks, false, now) else {
                break;
            };
            self.gate.take_head(held_at);
            self.routers.routed_by(i, r);
            self.gate.held_ms[i] = now - self.requests[i].arrival_ms;
            self.start(s, i, &parsed, blocks, now);
        }
        self.gate.tick(&mut self.q, r, now);
    }

    /// Router `r` decides where request `i` goes; what it learned meanwhile goes out to
    /// its peers.
    #[allow(clippy::too_many_arguments)]
    fn admit(
        &mut self,
        r: usize,
        i: usize,
        body: &str,
        parsed: &ParsedRequest,
        blocks: &[u64],
        sheddable: bool,
        now: f64,
    ) -> Pick {
        let incoming = Incoming {
            id: i as u64,
            body: body.as_bytes(),
            canonical: &parsed.canonical,
            prompt_tokens: parsed.prompt_tokens.0,
            engine_blocks: blocks,
            pool: &self.pool,
            ttft_objective_ms: self.objectives[i],
        };
        self.routers.deciding(r, now);
        let pick = self.routers.all[r].admit(&incoming, &self.engines, now, sheddable);
        self.mail.send(&mut self.q, &mut self.routers, r, now);
        in_pool(pick, &self.pool)
    }

    /// Hands request `i` to server `s` and starts a step there if it was idle.
    fn start(&mut self, s: usize, i: usize, parsed: &ParsedRequest, blocks: Vec<u64>, now: f64) {
        let spec = crate::engine::SeqSpec {
            id: i as u64,
            prompt_tokens: parsed.prompt_tokens.0,
            output_tokens: self.requests[i].output_tokens,
            block_hashes: blocks,
            stops: false,
        };
        self.engines[s].add(spec, now);
        if !self.busy[s] {
            self.next_step(s, now);
        }
    }

    fn next_step(&mut self, s: usize, now: f64) {
        if let Some(d) = self.engines[s].start_step() {
            self.busy[s] = true;
            self.q.push(now + d, Kind::StepEnd(s));
        }
    }

    /// Server `s` finished a step: first tokens and completions reach the routers that
    /// routed them, completions become records, and the next step starts.
    fn on_step_end(&mut self, s: usize, now: f64) {
        for ev in self.engines[s].finish_step(now) {
            match ev {
                Event::FirstToken { id, .. } => {
                    let r = self.routers.owner(id as usize);
                    if self.routers.routed_here(id as usize) {
                        self.routers.all[r].on_first_token(s, id, now);
                        self.mail.send(&mut self.q, &mut self.routers, r, now);
                    }
                }
                Event::Finished(f) => self.on_finished(s, &f, now),
                Event::Token { .. } => {}
            }
        }
        self.busy[s] = false;
        self.next_step(s, now);
    }

    fn on_finished(&mut self, s: usize, f: &Finished, now: f64) {
        let id = f.id as usize;
        let r = self.routers.owner(id);
        if self.routers.routed_here(id) {
            self.routers.all[r].on_finished(s, f, now);
            self.mail.send(&mut self.q, &mut self.routers, r, now);
        }
        let base = Record::from_finished(f, s);
        let held = self.gate.held_ms[id];
        let record = Record {
            reachable_tokens: self.reachable[id],
            held_ms: held,
            arrival_ms: self.requests[id].arrival_ms.min(base.arrival_ms),
            ttft_ms: base.ttft_ms + held,
            e2e_ms: base.e2e_ms + held,
            priority: self.classes[id].0,
            tenant: self.classes[id].1,
            ttft_objective_ms: self.objectives[id],
            ..base
        };
        self.stopped |= (self.stop)(&record);
        self.records[id] = Some(record);
        self.done += 1;
        (self.progress)(self.done as u64);
    }

    /// After a restart only the requests that arrived from then on are reported (evictions
    /// and preemptions still count the whole run).
    fn report(mut self) -> RunReport {
        let requests = self.requests;
        let restart = self.setup.topology.restart_at_ms;
        let reported = match restart {
            Some(at) => {
                for (r, req) in self.records.iter_mut().zip(requests) {
                    if req.arrival_ms < at {
                        *r = None;
                    }
                }
                requests.iter().filter(|r| r.arrival_ms >= at).count()
            }
            None => requests.len(),
        };
        let mut report = RunReport::build(&self.policy.to_string(), reported, self.records, &self.engines);
        let from = restart.unwrap_or(f64::NEG_INFINITY);
        let classes = &self.classes;
        report.rejections = self
            .gate
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
        self.eviction_marks.push((f64::MAX, report.evictions));
        report.eviction_marks = self.eviction_marks;
        report
    }
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

//! The virtual-time driver: a fleet of engines, one policy, one workload, deterministic.
//!
//! Events (arrivals, step ends, scrape ticks) are ordered by time in microseconds, then by
//! sequence number, so a run with the same inputs is byte-for-byte repeatable. At each
//! scrape tick every server's `/metrics` body is rendered and parsed (as a gateway would),
//! and the policy sees only those snapshots, as stale as the interval makes them.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use kvroute_core::request::{parse, ApiKind};
use kvroute_core::{parse_metrics, Config};

use crate::engine::{Engine, Event};
use crate::policies::{Incoming, PolicyName};
use crate::profile::Profile;
use crate::report::{Record, RunReport};
use crate::tokens::engine_blocks;
use crate::workload::SimRequest;

#[derive(Clone, Debug)]
pub struct ReplaySetup {
    pub profile: Profile,
    pub servers: usize,
    pub scrape_interval_ms: f64,
    pub seed: u64,
    pub router_config: Config,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Kind {
    Scrape,
    StepEnd(usize),
    Arrival(usize),
}

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

/// Runs `policy` over `requests` and reports per-request outcomes.
pub fn run(setup: &ReplaySetup, policy: PolicyName, requests: &[SimRequest], progress: &dyn Fn(u64)) -> RunReport {
    let mut engines: Vec<Engine> = (0..setup.servers).map(|_| Engine::new(setup.profile.clone())).collect();
    let mut router = policy.build(
        setup.servers,
        setup.profile.num_gpu_blocks,
        setup.seed,
        &setup.router_config,
    );
    let mut busy = vec![false; setup.servers];
    let mut records: Vec<Option<Record>> = vec![None; requests.len()];
    let mut q = Queue {
        heap: BinaryHeap::new(),
        seq: 0,
    };
    for (i, r) in requests.iter().enumerate() {
        q.push(r.arrival_ms, Kind::Arrival(i));
    }
    q.push(0.0, Kind::Scrape);
    let model = setup.profile.model.served_name();
    let mut done = 0usize;
    while let Some(Reverse((t_us, _, kind))) = q.heap.pop() {
        let now = t_us as f64 / 1000.0;
        match kind {
            Kind::Scrape => {
                for (s, e) in engines.iter().enumerate() {
                    let text = e.metrics_text(false, 0.0);
                    if let Ok(m) = parse_metrics(text.as_bytes(), 1 << 20) {
                        router.on_scrape(s, &m, &text, now);
                    }
                }
                if done < requests.len() {
                    q.push(now + setup.scrape_interval_ms, Kind::Scrape);
                }
            }
            Kind::Arrival(i) => {
                let body = chat_body(model, &requests[i]);
                let Ok(parsed) = parse(ApiKind::Chat, body.as_bytes()) else {
                    continue;
                };
                let blocks = engine_blocks(&parsed.canonical, parsed.prompt_tokens.0);
                let incoming = Incoming {
                    id: i as u64,
                    body: body.as_bytes(),
                    canonical: &parsed.canonical,
                    prompt_tokens: parsed.prompt_tokens.0,
                    engine_blocks: &blocks,
                };
                let s = router.pick(&incoming, &engines, now).min(setup.servers - 1);
                let spec = crate::engine::SeqSpec {
                    id: i as u64,
                    prompt_tokens: parsed.prompt_tokens.0,
                    output_tokens: requests[i].output_tokens,
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
            Kind::StepEnd(s) => {
                for ev in engines[s].finish_step(now) {
                    match ev {
                        Event::FirstToken { id, .. } => router.on_first_token(s, id, now),
                        Event::Finished(f) => {
                            router.on_finished(s, &f, now);
                            records[f.id as usize] = Some(Record::from_finished(&f, s));
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
    RunReport::build(&policy.to_string(), requests.len(), records, &engines)
}

#[cfg(test)]
mod tests;

//! kvroute in the replay: `kvroute-core`'s `Router`, configured by the same JSON as the
//! filter, fed the scraped metrics and completions exactly as the filter feeds it.

use kvroute_core::request::{parse, ApiKind};
use kvroute_core::{Completion, Config, EndpointId, Millis, Outcome, PeerEvent, Router, VllmMetrics};

use super::{members, Incoming, Outstanding, Pick, Policy};
use crate::engine::{Engine, Finished};

pub struct Kvroute {
    router: Router,
    ids: Vec<EndpointId>,
    /// Used only if the router chooses nothing (no endpoint may serve).
    outstanding: Outstanding,
}

/// The address the replay gives simulated server `i` (the filter would see `ip:port`).
pub fn endpoint_id(i: usize) -> EndpointId {
    EndpointId::new(format!("127.0.0.1:{}", 8001 + i))
}

impl Kvroute {
    /// `share_of_budget`: how many routers split the configured index budget (1 alone).
    pub fn new(servers: usize, config: &Config, share_of_budget: usize) -> Kvroute {
        let ids: Vec<EndpointId> = (0..servers).map(endpoint_id).collect();
        let mut router = Router::new(config.clone());
        router.set_index_budget(config.index().max_memory_bytes / share_of_budget.max(1));
        router.on_endpoints(&ids);
        Kvroute {
            router,
            ids,
            outstanding: Outstanding::new(servers),
        }
    }

    /// Where a request goes when the router chooses nothing (no endpoint may serve).
    fn least_outstanding(&self, pool: &[bool]) -> usize {
        let load = self.outstanding.get();
        members(pool).into_iter().min_by_key(|s| load[*s]).unwrap_or(0)
    }

    fn index_of(&self, id: &EndpointId) -> Option<usize> {
        self.ids.iter().position(|e| e == id)
    }
}

impl Policy for Kvroute {
    fn pick(&mut self, req: &Incoming, servers: &[Engine], now_ms: f64) -> usize {
        match self.admit(req, servers, now_ms, false) {
            Pick::Server(s) => s,
            // Not reached: `pick` is only called with holding off.
            Pick::Hold | Pick::Shed => self.least_outstanding(req.pool),
        }
    }
    fn admit(&mut self, req: &Incoming, _: &[Engine], now_ms: f64, sheddable: bool) -> Pick {
        let now = Millis(now_ms as u64);
        let mut held = None;
        let chosen = parse(ApiKind::Chat, req.body).ok().and_then(|parsed| {
            let mut r = self.router.request(&parsed, "", sheddable);
            // The replay reports each request's real first token, as a stream does.
            r.first_token_timed = true;
            r.ttft_objective_ms = req.ttft_objective_ms;
            let d = self.router.route(&r, now);
            match d.outcome {
                Outcome::Hold => held = Some(Pick::Hold),
                Outcome::Shed { .. } => held = Some(Pick::Shed),
                _ => {}
            }
            let s = d.best().and_then(|b| self.index_of(b))?;
            self.router.on_routed(req.id, &r, &d, now);
            Some(s)
        });
        if let Some(p) = held {
            return p;
        }
        let s = chosen.unwrap_or_else(|| self.least_outstanding(req.pool));
        self.outstanding.sent(s);
        Pick::Server(s)
    }
    fn on_scrape(&mut self, s: usize, m: &VllmMetrics, _: &str, now_ms: f64) {
        self.router.on_metrics(&self.ids[s], m.clone(), Millis(now_ms as u64));
    }
    fn on_first_token(&mut self, _s: usize, id: u64, now_ms: f64) {
        self.router.on_first_token(id, Millis(now_ms as u64));
    }
    fn on_finished(&mut self, s: usize, f: &Finished, now_ms: f64) {
        self.outstanding.done(s);
        let done = Completion {
            served_by: Some(self.ids[s].clone()),
            status: 200,
            // What vLLM (with --enable-prompt-tokens-details) reports: no details on a miss.
            cached_tokens: (f.cached_tokens > 0).then_some(f.cached_tokens),
            prompt_tokens: Some(f.prompt_tokens),
            usage: true,
            client_left: false,
        };
        self.router.on_completed(f.id, &done, Millis(now_ms as u64));
    }
    fn share_with_peers(&mut self, origin: u32) {
        self.router.share_with_peers(origin);
    }
    fn take_peer_events(&mut self) -> Vec<PeerEvent> {
        self.router.take_peer_events()
    }
    fn on_peer_event(&mut self, event: &PeerEvent, now_ms: f64) {
        self.router.on_peer_event(event, Millis(now_ms as u64));
    }
    fn on_pool(&mut self, pool: &[bool], _: f64) {
        // What the filter's discovery hands the router: the cluster's hosts now.
        let ids: Vec<EndpointId> = members(pool).into_iter().map(|s| self.ids[s].clone()).collect();
        self.router.on_endpoints(&ids);
    }
}

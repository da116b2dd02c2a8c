//! Invariants that must hold under any sequence of events.

#![allow(clippy::unwrap_used)] // test helpers outside #[test] functions

use kvroute_core::config::RawIndex;
use kvroute_core::health::HealthState;
use kvroute_core::index::ENTRY_BYTES;
use kvroute_core::policy::RateClasses;
use kvroute_core::speed::SAME_WITHIN;
use kvroute_core::{
    BlockHash, Completion, Config, EndpointId, Millis, PolicyKind, PrefixHasher, RawConfig, RouteRequest, Router,
    Tokens, VllmMetrics,
};
use proptest::prelude::*;

#[derive(Clone, Debug)]
enum Event {
    Metrics {
        ep: usize,
        running: u64,
        waiting: u64,
        kv: f64,
        blocks: u64,
    },
    ScrapeFailed {
        ep: usize,
    },
    Route {
        prefix: u64,
        len: usize,
        sheddable: bool,
    },
    Complete {
        back: usize,
        status: u16,
    },
    Membership {
        mask: u8,
    },
    Tick {
        ms: u64,
    },
}

fn event() -> impl Strategy<Value = Event> {
    prop_oneof![
        (0..8usize, 0..300u64, 0..300u64, 0.0..=1.0f64, 1..5000u64).prop_map(|(ep, running, waiting, kv, blocks)| {
            Event::Metrics {
                ep,
                running,
                waiting,
                kv,
                blocks,
            }
        }),
        (0..8usize).prop_map(|ep| Event::ScrapeFailed { ep }),
        (0..20u64, 0..200usize, any::<bool>()).prop_map(|(prefix, len, sheddable)| Event::Route {
            prefix,
            len,
            sheddable
        }),
        (0..10usize, prop::sample::select(vec![0u16, 200, 429, 500, 503]))
            .prop_map(|(back, status)| Event::Complete { back, status }),
        any::<u8>().prop_map(|mask| Event::Membership { mask }),
        (0..2000u64).prop_map(|ms| Event::Tick { ms }),
    ]
}

fn id(i: usize) -> EndpointId {
    EndpointId::new(format!("10.1.0.{i}:8000"))
}

fn router(policy: PolicyKind, budget: usize) -> Router {
    let raw = RawConfig {
        endpoints: (0..8).map(|i| id(i).to_string()).collect(),
        policy,
        index: RawIndex {
            max_memory_bytes: budget,
            default_capacity_tokens: 100_000,
            ..RawIndex::default()
        },
        ..RawConfig::default()
    };
    Router::new(Config::try_from(raw).unwrap())
}

fn request(prefix: u64, len: usize, sheddable: bool) -> RouteRequest {
    RouteRequest {
        model: "m".into(),
        blocks: (0..len as u64)
            .map(|i| BlockHash(prefix.wrapping_mul(1_000_003) ^ i))
            .collect(),
        prompt_tokens: Tokens(len as u64 * 64),
        max_tokens: Some(16),
        sheddable,
        ttft_objective_ms: None,
        first_token_timed: true,
        continues: None,
    }
}

fn metrics(running: u64, waiting: u64, kv: f64, blocks: u64) -> VllmMetrics {
    VllmMetrics {
        kv_usage: kv,
        running,
        waiting,
        block_size: Some(16),
        num_gpu_blocks: Some(blocks),
        models: vec!["m".into()],
        engines: 1,
        ..VllmMetrics::default()
    }
}

fn policies() -> impl Strategy<Value = PolicyKind> {
    prop::sample::select(vec![
        PolicyKind::Cost,
        PolicyKind::Weighted,
        PolicyKind::LeastRequest,
        PolicyKind::RoundRobin,
        PolicyKind::Random,
    ])
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    #[test]
    fn never_routes_to_an_unhealthy_ejected_or_absent_endpoint(
        policy in policies(),
        events in prop::collection::vec(event(), 1..120),
    ) {
        let mut r = router(policy, 1 << 20);
        let mut now = Millis(1_000);
        let mut routed: Vec<u64> = Vec::new();
        let mut next_id = 0u64;
        for e in events {
            match e {
                Event::Metrics { ep, running, waiting, kv, blocks } => { r.on_metrics(&id(ep), metrics(running, waiting, kv, blocks), now); }
                Event::ScrapeFailed { ep } => { r.on_scrape_failed(&id(ep), now); }
                Event::Complete { back, status } => {
                    if let Some(req_id) = routed.len().checked_sub(back + 1).map(|i| routed.remove(i)) {
                        r.on_completed(req_id, &Completion { served_by: None, status, cached_tokens: None, prompt_tokens: None, usage: false, client_left: false }, now);
                    }
                }
                Event::Membership { mask } => {
                    let members: Vec<EndpointId> = (0..8).filter(|i| mask & (1 << i) != 0).map(id).collect();
                    r.on_endpoints(&members);
                }
                Event::Tick { ms } => now = now.plus(ms),
                Event::Route { prefix, len, sheddable } => {
                    let req = request(prefix, len, sheddable);
                    let d = r.route(&req, now);
                    for chosen in &d.endpoints {
                        let row = r.endpoints().iter().find(|e| &e.id == chosen);
                        prop_assert!(row.is_some(), "{chosen} is not a member");
                        let row = row.unwrap();
                        prop_assert!(row.health.state() != HealthState::Unhealthy, "{chosen} is unhealthy");
                        prop_assert!(!row.health.is_ejected(now), "{chosen} is ejected");
                    }
                    let unique: std::collections::BTreeSet<_> = d.endpoints.iter().collect();
                    prop_assert_eq!(unique.len(), d.endpoints.len(), "an endpoint is listed twice");
                    r.on_routed(next_id, &req, &d, now);
                    routed.push(next_id);
                    next_id += 1;
                }
            }
        }
    }

    #[test]
    fn memory_budget_holds_under_any_sequence_of_events(
        events in prop::collection::vec(event(), 1..200),
        budget_kib in 64usize..256,
    ) {
        let budget = budget_kib * 1024;
        let mut r = router(PolicyKind::Cost, budget);
        let mut now = Millis(0);
        for (n, e) in events.into_iter().enumerate() {
            match e {
                Event::Metrics { ep, running, waiting, kv, blocks } => { r.on_metrics(&id(ep), metrics(running, waiting, kv, blocks), now); }
                Event::Membership { mask } => r.on_endpoints(&(0..8).filter(|i| mask & (1 << i) != 0).map(id).collect::<Vec<_>>()),
                Event::Route { prefix, len, .. } => {
                    let req = request(prefix + n as u64, len, false);
                    let d = r.route(&req, now);
                    r.on_routed(n as u64, &req, &d, now);
                }
                Event::Tick { ms } => now = now.plus(ms),
                _ => {}
            }
            prop_assert!(r.index().entries() * ENTRY_BYTES <= budget, "{} entries over a {budget} byte budget", r.index().entries());
        }
    }

    #[test]
    fn cost_never_falls_as_load_rises(
        running in 0..500u64, waiting in 0..500u64, kv in 0.0..0.94f64,
        d_running in 0..50u64, d_waiting in 0..50u64, d_kv in 0.0..0.05f64,
        len in 0..100usize,
    ) {
        let cost = |m: VllmMetrics| {
            let mut r = Router::new(Config::try_from(RawConfig { endpoints: vec!["10.0.0.1:1".into()], ..RawConfig::default() }).unwrap());
            r.on_metrics(&EndpointId::new("10.0.0.1:1"), m, Millis(0));
            r.route(&request(1, len, false), Millis(0)).breakdown[0].cost.0
        };
        let light = cost(metrics(running, waiting, kv, 10_000));
        let heavy = cost(metrics(running + d_running, waiting + d_waiting, kv + d_kv, 10_000));
        prop_assert!(heavy >= light, "{heavy} < {light}");
    }

    #[test]
    fn a_slot_bound_servers_wait_is_charged_and_grows_with_its_queue(
        slots in 32..600u64, per_s in 2..40u64, waiting in 1..300u64, d_waiting in 0..100u64,
        other_waiting in 1..50u64, kv in 0.0..0.9f64, len in 1..100usize,
    ) {
        // Server 0's slots are full (`slots` running at every scrape, requests waiting) and
        // it finishes `per_s` requests a second, read long enough to have finished a full
        // set of slots (before that it is still filling); server 1 runs twice as many with
        // `other_waiting` waiting there. Server 0's predicted TTFT and cost, for a config's
        // `cost` and `tiers` settings and `waiting` at the last scrape.
        let score = |settings: &str, waiting: u64, other_waiting: u64| {
            let json = format!(r#"{{"endpoints": ["10.0.0.1:1", "10.0.0.2:1"], "policy": "cost"{settings}}}"#);
            let mut r = Router::new(Config::from_json(json.as_bytes()).unwrap());
            let span = slots.div_ceil(per_s).max(10);
            for second in 0..=span {
                let at = Millis(1_000_000 + second * 1000);
                let finished = Some(100.0 + (per_s * second) as f64);
                for (i, (running, waiting)) in [(slots, waiting), (2 * slots, other_waiting)].into_iter().enumerate() {
                    let m = VllmMetrics { finished, ..metrics(running, waiting, kv, 10_000) };
                    r.on_metrics(&EndpointId::new(format!("10.0.0.{}:1", i + 1)), m, at);
                }
            }
            let d = r.route(&request(1, len, false), Millis(1_000_050 + span * 1000));
            let s = d.breakdown.iter().find(|s| s.endpoint.as_str() == "10.0.0.1:1").unwrap();
            (s.ttft_ms, s.cost.0)
        };
        let off = r#", "cost": {"admission_weight": 0}"#;
        // Server 1 has room (nothing waits there): the wait is charged.
        let (ttft, cost) = score("", waiting, 0);
        // Admitted after the `waiting` ahead and itself have finished somewhere in the slots.
        let wait_ms = (waiting + 1) as f64 * 1000.0 / per_s as f64;
        prop_assert!(ttft >= wait_ms * (1.0 - 1e-9), "predicted {ttft} ms, the slots' wait {wait_ms} ms");
        let (heavier, heavier_cost) = score("", waiting + d_waiting, 0);
        prop_assert!(heavier_cost >= cost, "{heavier_cost} < {cost} with {d_waiting} more waiting");
        prop_assert!(heavier >= ttft, "{heavier} < {ttft} ms with {d_waiting} more waiting");
        // Requests wait at every server: the fleet is past what it serves, nothing charged.
        prop_assert_eq!(score("", waiting, other_waiting), score(off, waiting, other_waiting));
        // With tiers the slots are the tiers' own (`tiers.max_num_seqs`): nothing charged.
        let tiers = r#", "tiers": {"endpoints": {"10.0.0.2:1": 1}}"#;
        prop_assert_eq!(score(tiers, waiting, 0), score(&format!("{tiers}{off}"), waiting, 0));
    }

    #[test]
    fn hashing_is_prefix_stable(
        head in prop::collection::vec(any::<u8>(), 0..2000),
        tail in prop::collection::vec(any::<u8>(), 0..2000),
        block in 16usize..300,
    ) {
        let h = PrefixHasher::new(block, 10_000);
        let short = h.hash("m", "t", "", &head);
        let mut joined = head.clone();
        joined.extend_from_slice(&tail);
        let long = h.hash("m", "t", "", &joined);
        prop_assert_eq!(short.len(), head.len() / block);
        prop_assert_eq!(&long[..short.len()], &short[..]);
    }

    #[test]
    fn rate_classes_are_ordered_runs_scored_at_a_member(
        rates in prop::collection::vec(1_000.0f64..100_000.0, 1..40),
    ) {
        let classes = RateClasses::new(rates.clone());
        let mut sorted = rates.clone();
        sorted.sort_by(f64::total_cmp);
        for pair in sorted.windows(2) {
            let (lo, hi) = (classes.class_of(pair[0]), classes.class_of(pair[1]));
            prop_assert!(lo <= hi, "classes out of order: {lo} > {hi}");
            if pair[1] / pair[0] <= SAME_WITHIN {
                prop_assert_eq!(lo, hi, "neighbours within the band share a class");
            } else {
                prop_assert!(hi / lo > SAME_WITHIN, "classes {lo} and {hi} too close");
            }
        }
        for r in &rates {
            prop_assert!(rates.contains(&classes.class_of(*r)), "a class rate is a member's");
        }
        let typical = classes.typical().unwrap();
        prop_assert!(rates.contains(&typical));
    }
}

#[derive(Clone, Debug)]
enum WaitEvent {
    Route { prefix: u64, timed: bool },
    Peer { ep: usize },
    FirstToken { back: usize },
    Complete { back: usize },
    Membership { mask: u8 },
    Tick { ms: u64 },
}

fn wait_event() -> impl Strategy<Value = WaitEvent> {
    prop_oneof![
        (0..20u64, any::<bool>()).prop_map(|(prefix, timed)| WaitEvent::Route { prefix, timed }),
        (0..8usize).prop_map(|ep| WaitEvent::Peer { ep }),
        (0..6usize).prop_map(|back| WaitEvent::FirstToken { back }),
        (0..6usize).prop_map(|back| WaitEvent::Complete { back }),
        any::<u8>().prop_map(|mask| WaitEvent::Membership { mask }),
        (0..500u64).prop_map(|ms| WaitEvent::Tick { ms }),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    /// The tiers' floor (`Endpoint::oldest_pending_ms`) is the wait of the oldest of this
    /// router's own streams on each server still without a first token, whatever happened
    /// between: other requests, peers' requests, completions without a first token, servers
    /// leaving and coming back.
    #[test]
    fn the_oldest_wait_is_that_of_the_oldest_own_stream_still_waiting(
        events in prop::collection::vec(wait_event(), 1..150),
    ) {
        let mut r = router(PolicyKind::Cost, 1 << 20);
        let mut now = Millis(1_000);
        // This router's streams still without a first token: (request id, server, routed at).
        let mut waiting: Vec<(u64, EndpointId, Millis)> = Vec::new();
        let mut live: Vec<u64> = Vec::new();
        let mut next_id = 0u64;
        for e in events {
            match e {
                WaitEvent::Route { prefix, timed } => {
                    let mut req = request(prefix, 8, false);
                    req.first_token_timed = timed;
                    let d = r.route(&req, now);
                    r.on_routed(next_id, &req, &d, now);
                    if let Some(best) = d.best() {
                        live.push(next_id);
                        if timed {
                            waiting.push((next_id, best.clone(), now));
                        }
                    }
                    next_id += 1;
                }
                WaitEvent::Peer { ep } => r.on_peer_event(
                    &kvroute_core::PeerEvent::Routed {
                        key: kvroute_core::peer::request_key(7, next_id),
                        endpoint: id(ep),
                        blocks: vec![BlockHash(next_id)],
                        prompt_tokens: Tokens(64),
                        uncached: Tokens(64),
                        at: now,
                    },
                    now,
                ),
                WaitEvent::FirstToken { back } | WaitEvent::Complete { back } => {
                    let Some(i) = live.len().checked_sub(back + 1) else { continue };
                    let req_id = live[i];
                    if matches!(e, WaitEvent::FirstToken { .. }) {
                        r.on_first_token(req_id, now);
                    } else {
                        live.remove(i);
                        r.on_completed(req_id, &Completion::default(), now);
                    }
                    waiting.retain(|(w, _, _)| *w != req_id);
                }
                WaitEvent::Membership { mask } => {
                    let members: Vec<EndpointId> = (0..8).filter(|i| mask & (1 << i) != 0).map(id).collect();
                    r.on_endpoints(&members);
                    // A server that left is forgotten with what waited there.
                    waiting.retain(|(_, ep, _)| members.contains(ep));
                }
                WaitEvent::Tick { ms } => now = now.plus(ms),
            }
            for e in r.endpoints() {
                let oldest = waiting.iter().filter(|(_, ep, _)| *ep == e.id).map(|(_, _, at)| *at).min();
                prop_assert_eq!(e.oldest_pending_ms(now), oldest.map_or(0, |at| now.since(at)), "{}", e.id);
            }
        }
    }
}

#[derive(Clone, Debug)]
enum MeshEvent {
    Route {
        at: usize,
        prefix: u64,
    },
    FirstToken {
        at: usize,
        back: usize,
    },
    Complete {
        at: usize,
        back: usize,
    },
    /// Delivers up to `n` of `from`'s events waiting for `to`, oldest first.
    Deliver {
        from: usize,
        to: usize,
        n: usize,
    },
    /// Router `at` takes a new origin (two VMs took one origin, and this one noticed).
    NewOrigin {
        at: usize,
    },
}

fn mesh_event() -> impl Strategy<Value = MeshEvent> {
    prop_oneof![
        3 => (0..3usize, 0..6u64).prop_map(|(at, prefix)| MeshEvent::Route { at, prefix }),
        2 => (0..3usize, 0..4usize).prop_map(|(at, back)| MeshEvent::FirstToken { at, back }),
        2 => (0..3usize, 0..4usize).prop_map(|(at, back)| MeshEvent::Complete { at, back }),
        4 => (0..3usize, 0..3usize, 1..6usize).prop_map(|(from, to, n)| MeshEvent::Deliver { from, to, n }),
        1 => (0..3usize).prop_map(|at| MeshEvent::NewOrigin { at }),
    ]
}

/// What each router published that each other router has not applied yet, by sender and
/// receiver.
type Channels = Vec<Vec<std::collections::VecDeque<kvroute_core::PeerEvent>>>;

/// Every router's view of the load: (requests in flight, per server (in flight, tokens
/// waiting for a first token)).
fn load_view(r: &Router) -> (usize, Vec<(u32, Tokens)>) {
    let per_server = r
        .endpoints()
        .iter()
        .map(|e| (e.inflight, e.pending_prefill_tokens))
        .collect();
    (r.inflight_requests(), per_server)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    /// Three routers that share (the workers of one Envoy): whatever order their events
    /// arrive in (each sender's in order), and whichever of them takes a new origin while
    /// its requests are in flight, each counts exactly its own live requests, and once
    /// every event has arrived, every router sees the same load; when everything has ended,
    /// none is left anywhere.
    #[test]
    fn peers_agree_on_the_load_once_their_events_arrive(
        events in prop::collection::vec(mesh_event(), 1..120),
    ) {
        let mut routers: Vec<Router> = (0..3).map(|_| router(PolicyKind::Cost, 1 << 20)).collect();
        for (i, r) in routers.iter_mut().enumerate() {
            r.share_with_peers(i as u32 + 1);
        }
        let mut next_origin = 10u32;
        let now = Millis(1_000);
        // Per router: its live requests (id, first token seen).
        let mut live: Vec<Vec<(u64, bool)>> = vec![Vec::new(); 3];
        // What each router published and each other router has not applied yet.
        let mut channels: Channels =
            vec![vec![std::collections::VecDeque::new(); 3]; 3];
        let mut next_id = 0u64;
        let publish = |routers: &mut Vec<Router>, channels: &mut Channels, at: usize| {
            for ev in routers[at].take_peer_events() {
                for (to, ch) in channels[at].iter_mut().enumerate() {
                    if to != at {
                        ch.push_back(ev.clone());
                    }
                }
            }
        };
        let deliver_all = |routers: &mut Vec<Router>, channels: &mut Channels| {
            for row in channels.iter_mut() {
                for (to, ch) in row.iter_mut().enumerate() {
                    while let Some(ev) = ch.pop_front() {
                        routers[to].on_peer_event(&ev, now);
                    }
                }
            }
        };
        for e in events {
            match e {
                MeshEvent::Route { at, prefix } => {
                    let req = request(prefix, 8, false);
                    let d = routers[at].route(&req, now);
                    routers[at].on_routed(next_id, &req, &d, now);
                    if d.best().is_some() {
                        live[at].push((next_id, false));
                    }
                    next_id += 1;
                }
                MeshEvent::FirstToken { at, back } => {
                    let Some(i) = live[at].len().checked_sub(back + 1) else { continue };
                    routers[at].on_first_token(live[at][i].0, now);
                    live[at][i].1 = true;
                }
                MeshEvent::Complete { at, back } => {
                    let Some(i) = live[at].len().checked_sub(back + 1) else { continue };
                    let (id, _) = live[at].remove(i);
                    routers[at].on_completed(id, &Completion::default(), now);
                }
                MeshEvent::Deliver { from, to, n } => {
                    for _ in 0..n {
                        let Some(ev) = channels[from][to].pop_front() else { break };
                        routers[to].on_peer_event(&ev, now);
                    }
                }
                MeshEvent::NewOrigin { at } => {
                    routers[at].share_with_peers(next_origin);
                    next_origin += 1;
                }
            }
            for at in 0..3 {
                publish(&mut routers, &mut channels, at);
                prop_assert_eq!(routers[at].own_inflight_requests(), live[at].len(), "router {}", at);
            }
        }
        deliver_all(&mut routers, &mut channels);
        let total: usize = live.iter().map(Vec::len).sum();
        let first = load_view(&routers[0]);
        prop_assert_eq!(first.0, total);
        for r in &routers[1..] {
            prop_assert_eq!(load_view(r), first.clone());
        }
        for at in 0..3 {
            for (id, _) in std::mem::take(&mut live[at]) {
                routers[at].on_completed(id, &Completion::default(), now);
            }
            publish(&mut routers, &mut channels, at);
        }
        deliver_all(&mut routers, &mut channels);
        for r in &routers {
            prop_assert_eq!(r.inflight_requests(), 0);
            prop_assert!(r.endpoints().iter().all(|e| e.inflight == 0 && e.pending_prefill_tokens == Tokens(0)));
        }
    }
}

use super::*;
use crate::profile::{Gpu, Model};
use crate::workload::{generate, GenParams, Generator};

fn setup(servers: usize) -> ReplaySetup {
    ReplaySetup {
        classes: None,
        pool_changes: Vec::new(),
        profile: Profile::new(Gpu::H100_80g, Model::Llama31_8b, 1).unwrap(),
        servers,
        mixed: Vec::new(),
        slowdown: None,
        scrape_interval_ms: 200.0,
        seed: 1,
        router_config: Config::from_json(b"").unwrap(),
        topology: Topology::default(),
    }
}

fn small_shared_prefix(rate: f64) -> Vec<SimRequest> {
    let p = GenParams {
        rate,
        groups: 8,
        prompts_per_group: 8,
        ..GenParams::defaults(Generator::SharedPrefix)
    };
    generate(Generator::SharedPrefix, &p)
}

#[test]
fn every_policy_completes_every_request() {
    let reqs = small_shared_prefix(20.0);
    for policy in PolicyName::all() {
        let r = run(&setup(4), policy, &reqs, &|_| {});
        assert_eq!((r.completed, r.failed), (64, 0), "{policy}");
        assert!(r.ttft_ms.p50 > 0.0 && r.throughput.output_tok_s > 0.0, "{policy}");
    }
}

#[test]
fn the_same_inputs_give_the_same_report() {
    let reqs = small_shared_prefix(20.0);
    for policy in [PolicyName::Kvroute, PolicyName::Random, PolicyName::GieWeighted] {
        assert_eq!(
            run(&setup(4), policy, &reqs, &|_| {}),
            run(&setup(4), policy, &reqs, &|_| {}),
            "{policy}"
        );
    }
}

#[test]
fn cache_aware_routing_beats_round_robin_on_shared_prefixes() {
    let reqs = small_shared_prefix(30.0);
    let rr = run(&setup(4), PolicyName::RoundRobin, &reqs, &|_| {});
    let kv = run(&setup(4), PolicyName::Kvroute, &reqs, &|_| {});
    let oracle = run(&setup(4), PolicyName::Oracle, &reqs, &|_| {});
    // 8 groups × 8 prompts: with affinity, 7 of 8 prompts of a group hit 2048 of 2180 tokens.
    assert!(kv.prefix_hit_rate > 0.8, "kvroute hit rate {}", kv.prefix_hit_rate);
    assert!(
        kv.prefix_hit_rate > rr.prefix_hit_rate + 0.2,
        "kvroute {} vs round-robin {}",
        kv.prefix_hit_rate,
        rr.prefix_hit_rate
    );
    assert!(
        kv.ttft_ms.p95 < rr.ttft_ms.p95,
        "kvroute p95 {} vs round-robin {}",
        kv.ttft_ms.p95,
        rr.ttft_ms.p95
    );
    assert!(oracle.prefix_hit_rate >= kv.prefix_hit_rate - 0.05);
}

fn with_topology(workers: usize, share: bool, tick_ms: f64) -> ReplaySetup {
    ReplaySetup {
        classes: None,
        topology: Topology {
            gateways: 1,
            workers,
            share_workers: share,
            tick_ms,
            ..Topology::default()
        },
        ..setup(4)
    }
}

/// 32 groups of 6 over 4 servers at 40 req/s: affinity decides the hit rate.
fn affinity_workload() -> Vec<SimRequest> {
    let p = GenParams {
        rate: 40.0,
        groups: 32,
        prompts_per_group: 6,
        ..GenParams::defaults(Generator::SharedPrefix)
    };
    generate(Generator::SharedPrefix, &p)
}

#[test]
fn workers_that_share_at_once_route_exactly_like_one_router() {
    // 32 groups over 4 servers, so affinity decides the hit rate; requests spread at random
    // over 4 workers. Sharing with a negligible delay must reproduce one router's every
    // decision (one view per process); without sharing the workers disagree.
    let reqs = affinity_workload();
    let one = run(&setup(4), PolicyName::Kvroute, &reqs, &|_| {});
    let shared = run(&with_topology(4, true, 0.001), PolicyName::Kvroute, &reqs, &|_| {});
    let apart = run(&with_topology(4, false, 0.001), PolicyName::Kvroute, &reqs, &|_| {});
    assert_eq!(shared.prefix_hit_rate, one.prefix_hit_rate);
    assert_eq!(shared.ttft_ms, one.ttft_ms);
    assert!(
        apart.prefix_hit_rate < one.prefix_hit_rate - 0.02,
        "unshared {} vs one {}",
        apart.prefix_hit_rate,
        one.prefix_hit_rate
    );
}

#[test]
fn replicas_that_exchange_peer_events_agree_where_isolated_replicas_do_not() {
    // 4 replicas share nothing but what the modelled cross-replica exchange carries; even
    // 50 ms late it keeps one prefix in one place, where isolated replicas spread it.
    let reqs = affinity_workload();
    let replicas = |share: bool| ReplaySetup {
        classes: None,
        topology: Topology {
            gateways: 4,
            share_gateways: share,
            gateway_delay_ms: 50.0,
            ..Topology::default()
        },
        ..setup(4)
    };
    let one = run(&setup(4), PolicyName::Kvroute, &reqs, &|_| {});
    let apart = run(&replicas(false), PolicyName::Kvroute, &reqs, &|_| {});
    let shared = run(&replicas(true), PolicyName::Kvroute, &reqs, &|_| {});
    assert!(
        shared.prefix_hit_rate > apart.prefix_hit_rate + 0.02,
        "shared {} vs isolated {}",
        shared.prefix_hit_rate,
        apart.prefix_hit_rate
    );
    assert!(
        shared.prefix_hit_rate >= one.prefix_hit_rate - 0.02,
        "shared {} vs one router {}",
        shared.prefix_hit_rate,
        one.prefix_hit_rate
    );
}

#[test]
fn tiers_keep_work_on_the_cheap_servers_while_they_meet_the_objective() {
    // Servers 0-1 are A100s (tier 0, cheap), 2-3 H100s (tier 1): untiered, the cost policy
    // sends most work to the faster H100s; tiered, the A100s take what they serve in time.
    let a100 = Profile::new(Gpu::A100_80g, Model::Llama31_8b, 1).unwrap();
    let h100 = Profile::new(Gpu::H100_80g, Model::Llama31_8b, 1).unwrap();
    let mut s = setup(4);
    s.mixed = vec![a100.clone(), a100, h100.clone(), h100];
    let p = GenParams {
        rate: 8.0,
        groups: 40,
        prompts_per_group: 6,
        ..GenParams::defaults(Generator::SharedPrefix)
    };
    let reqs = generate(Generator::SharedPrefix, &p);
    let premium = |r: &RunReport| r.per_server[2..].iter().map(|s| s.share).sum::<f64>();
    let untiered = run(&s, PolicyName::Kvroute, &reqs, &|_| {});
    s.router_config = Config::from_json(
        br#"{"tiers": {"endpoints": {"127.0.0.1:8003": 1, "127.0.0.1:8004": 1}, "ttft_objective_ms": 1000}}"#,
    )
    .unwrap();
    let tiered = run(&s, PolicyName::Kvroute, &reqs, &|_| {});
    assert_eq!(tiered.completed, reqs.len());
    assert!(
        premium(&tiered) < premium(&untiered) - 0.1,
        "premium share: tiered {:.2}, untiered {:.2}",
        premium(&tiered),
        premium(&untiered)
    );
    assert!(
        tiered.ttft_ms.p95 < 1000.0,
        "the objective holds: p95 {}",
        tiered.ttft_ms.p95
    );
}

#[test]
fn a_replay_asked_to_stop_ends_at_that_request_with_what_completed_so_far() {
    let reqs = small_shared_prefix(20.0);
    let mut seen = 0;
    let (r, stopped) = run_until(&setup(4), PolicyName::Kvroute, &reqs, &|_| {}, &mut |_| {
        seen += 1;
        seen == 10
    });
    assert!(stopped);
    assert!((10..64).contains(&r.completed), "{} completed", r.completed);
    let (whole, stopped) = run_until(&setup(4), PolicyName::Kvroute, &reqs, &|_| {}, &mut |_| false);
    assert!(!stopped);
    assert_eq!(
        whole,
        run(&setup(4), PolicyName::Kvroute, &reqs, &|_| {}),
        "never stopping is `run`"
    );
}

#[test]
fn phases_split_requests_by_arrival_and_evictions_by_time() {
    // 64 groups on 2 small caches: prefixes evict each other all along.
    let p = GenParams {
        rate: 20.0,
        groups: 64,
        prompts_per_group: 2,
        ..GenParams::defaults(Generator::SharedPrefix)
    };
    let reqs = generate(Generator::SharedPrefix, &p);
    let small = ReplaySetup {
        classes: None,
        profile: setup(2).profile.with_blocks(600),
        ..setup(2)
    };
    let r = run(&small, PolicyName::RoundRobin, &reqs, &|_| {});
    assert!(r.evictions > 0);
    let cut = reqs[reqs.len() / 2].arrival_ms;
    let (cold, steady) = (r.phase(f64::MIN, cut), r.phase(cut, f64::MAX));
    assert_eq!(cold.completed + steady.completed, r.completed);
    assert!(cold.records.iter().all(|x| x.arrival_ms < cut));
    assert_eq!(cold.evictions + steady.evictions, r.evictions);
    assert!(
        cold.evictions > 0 && steady.evictions > 0,
        "{} {}",
        cold.evictions,
        steady.evictions
    );
}

#[test]
fn a_gateway_restart_forgets_placements_reports_the_requests_after_it_and_at_zero_changes_nothing() {
    let reqs = small_shared_prefix(20.0);
    let restarted = |at_ms: f64| ReplaySetup {
        topology: Topology {
            restart_at_ms: Some(at_ms),
            ..Topology::default()
        },
        ..setup(4)
    };
    let at = reqs[reqs.len() / 2].arrival_ms;
    let later = reqs.iter().filter(|r| r.arrival_ms >= at).count();
    let r = run(&restarted(at), PolicyName::Kvroute, &reqs, &|_| {});
    assert_eq!((r.requests, r.completed, r.failed), (later, later, 0));
    // The restarted routers lost the prefix index: the same requests hit less than they
    // did behind routers that kept it.
    let kept = run(&setup(4), PolicyName::Kvroute, &reqs, &|_| {}).phase(at - 0.01, f64::INFINITY);
    assert_eq!(kept.completed, later);
    assert!(
        r.prefix_hit_rate < kept.prefix_hit_rate,
        "{} vs {}",
        r.prefix_hit_rate,
        kept.prefix_hit_rate
    );
    assert_eq!(
        run(&restarted(0.0), PolicyName::Kvroute, &reqs, &|_| {}),
        run(&setup(4), PolicyName::Kvroute, &reqs, &|_| {}),
        "a restart before the first request is no restart"
    );
}

#[test]
fn no_policy_sends_a_request_to_a_server_out_of_the_pool() {
    let reqs = small_shared_prefix(20.0);
    // At the very moments of two arrivals (the replay's clock counts whole microseconds):
    // an arrival then meets the new pool.
    let us = |ms: f64| (ms * 1000.0).round() as u64;
    let (join_ms, leave_ms) = (reqs[reqs.len() / 3].arrival_ms, reqs[2 * reqs.len() / 3].arrival_ms);
    let changed = ReplaySetup {
        pool_changes: vec![
            PoolChange {
                server: 3,
                at_ms: join_ms,
                joins: true,
            },
            PoolChange {
                server: 0,
                at_ms: leave_ms,
                joins: false,
            },
        ],
        ..setup(4)
    };
    for policy in PolicyName::all() {
        let r = run(&changed, policy, &reqs, &|_| {});
        assert_eq!((r.completed, r.failed), (64, 0), "{policy}");
        let on = |s: usize| r.records.iter().filter(move |x| x.server == s);
        assert!(
            on(3).all(|x| us(x.arrival_ms) >= us(join_ms)),
            "{policy}: server 3 served before it joined"
        );
        assert!(on(3).count() > 0, "{policy}: the server that joined got nothing");
        assert!(
            on(0).all(|x| us(x.arrival_ms) < us(leave_ms)),
            "{policy}: server 0 served after it left"
        );
    }
}

#[test]
fn pool_changes_are_checked() {
    let c = |server, at_ms, joins| PoolChange { server, at_ms, joins };
    assert!(check_pool_changes(4, &[c(3, 1000.0, true), c(0, 2000.0, false)]).is_ok());
    let err = |changes: &[PoolChange]| check_pool_changes(4, changes).unwrap_err().to_string();
    assert!(err(&[c(4, 0.0, true)]).contains("4 servers, 0 to 3"));
    assert!(err(&[c(1, 0.0, true), c(1, 5.0, false)]).contains("twice"));
    assert!(err(&[c(0, 1.0, true), c(1, 1.0, true), c(2, 1.0, false), c(3, 1.0, false)]).contains("keep one"));
}

/// 64 prompts of 2,180 tokens at 400 req/s on 2 servers (far past capacity), through 4
/// workers holding with a 1 s bound, in one queue or one per worker.
fn held_on_four_workers(hold_per_worker: bool) -> RunReport {
    let hold = br#"{"overload": {"hold": {"max_wait_ms": 1000, "wait_limit_ms": 100}}}"#;
    let s = ReplaySetup {
        router_config: Config::from_json(hold).unwrap(),
        topology: Topology {
            hold_per_worker,
            ..with_topology(4, true, 2.0).topology
        },
        ..setup(2)
    };
    run(&s, PolicyName::Kvroute, &small_shared_prefix(400.0), &|_| {})
}

#[test]
fn held_requests_are_released_within_the_bound_with_one_queue_per_gateway_or_per_worker() {
    for hold_per_worker in [false, true] {
        let r = held_on_four_workers(hold_per_worker);
        let held = r.records.iter().filter(|x| x.held_ms > 0.0).count();
        // Most are held, and every one is released within the 1 s bound: the router that
        // releases a request hears its first tokens, so its view of the servers drains as
        // theirs does.
        assert!(held >= 32, "per worker {hold_per_worker}: {held} held");
        assert_eq!(
            (r.completed, r.rejections.len()),
            (64, 0),
            "per worker {hold_per_worker}"
        );
    }
}

#[test]
fn a_request_with_an_objective_waits_its_share_of_it_and_no_longer() {
    // Every request sends a 100 ms objective: with objective_wait_share 0.5 each waits 50 ms at
    // most (the 1 s bound applies without the share).
    let run_with = |share: f64| {
        let hold = format!(
            r#"{{"overload": {{"hold": {{"max_wait_ms": 1000, "wait_limit_ms": 100, "objective_wait_share": {share}}}}}}}"#
        );
        let s = ReplaySetup {
            router_config: Config::from_json(hold.as_bytes()).unwrap(),
            classes: Some(Classes::parse("1", "0:1").unwrap().with_objectives("0:100").unwrap()),
            topology: with_topology(4, true, 2.0).topology,
            ..setup(2)
        };
        run(&s, PolicyName::Kvroute, &small_shared_prefix(400.0), &|_| {})
    };
    let whole = run_with(0.0);
    assert_eq!(
        (whole.completed, whole.rejections.len()),
        (64, 0),
        "1 s: every request released"
    );
    let share = run_with(0.5);
    assert!(share.rejections.len() >= 8, "{} answered 429", share.rejections.len());
    assert_eq!(share.completed + share.rejections.len(), 64);
    for r in &share.rejections {
        // Answered at the first tick (2 ms) past 50 ms.
        assert!((50.0..=53.0).contains(&r.waited_ms), "waited {} ms", r.waited_ms);
    }
    assert!(share
        .records
        .iter()
        .all(|x| x.held_ms < 53.0 && x.ttft_objective_ms == Some(100.0)));
}

#[test]
fn one_queue_per_gateway_releases_its_workers_requests_in_arrival_order() {
    // One priority and tenant: the fair order is arrival order. With one queue per worker,
    // each worker releases its own head when it sees room, whatever the others hold.
    let inversions = |hold_per_worker: bool| {
        let r = held_on_four_workers(hold_per_worker);
        let mut held: Vec<(f64, f64)> = r
            .records
            .iter()
            .filter(|x| x.held_ms > 0.0)
            .map(|x| (x.arrival_ms, x.arrival_ms + x.held_ms))
            .collect();
        held.sort_by(|a, b| a.0.total_cmp(&b.0));
        // Released at arrival + held: two released at one instant differ by rounding.
        held.windows(2).filter(|w| w[1].1 < w[0].1 - 1e-6).count()
    };
    assert_eq!(inversions(false), 0, "one queue per gateway: released in arrival order");
    assert!(
        inversions(true) > 0,
        "per-worker queues do reorder here (the test can fail)"
    );
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(24))]
    /// Any set of joins and leaves (server 0 stays), at arrival instants or between them,
    /// under any policy, with or without holding and several workers: every request is
    /// answered and none is served by a server out of the pool when it arrived.
    #[test]
    fn no_request_reaches_a_server_out_of_the_pool(
        changes in proptest::collection::vec(proptest::option::of((proptest::bool::ANY, 0usize..64, proptest::bool::ANY)), 3),
        policy in 0usize..9,
        holding in proptest::bool::ANY,
        workers in 1usize..4,
    ) {
        let reqs = small_shared_prefix(if holding { 200.0 } else { 20.0 });
        let us = |ms: f64| (ms * 1000.0).round() as u64;
        let pool_changes: Vec<PoolChange> = changes
            .iter()
            .enumerate()
            .filter_map(|(k, c)| c.map(|(joins, at, exact)| PoolChange {
                server: k + 1,
                at_ms: reqs[at].arrival_ms + if exact { 0.0 } else { 0.4 },
                joins,
            }))
            .collect();
        let config: &[u8] = if holding {
            br#"{"overload": {"hold": {"max_wait_ms": 1000, "wait_limit_ms": 100}}}"#
        } else {
            b""
        };
        let s = ReplaySetup {
            pool_changes: pool_changes.clone(),
            router_config: Config::from_json(config).unwrap(),
            topology: Topology {
                hold_per_worker: !holding,
                ..with_topology(workers, true, 2.0).topology
            },
            ..setup(4)
        };
        let policy = PolicyName::all()[policy];
        let r = run(&s, policy, &reqs, &|_| {});
        proptest::prop_assert_eq!(r.completed + r.rejections.len(), reqs.len());
        for x in &r.records {
            let change = pool_changes.iter().find(|c| c.server == x.server);
            let ok = match change {
                None => true,
                Some(c) if c.joins => us(x.arrival_ms + x.held_ms) >= us(c.at_ms),
                Some(c) => us(x.arrival_ms + x.held_ms) < us(c.at_ms),
            };
            proptest::prop_assert!(ok, "{policy}: server {} served a request arriving at {} ms ({:?})", x.server, x.arrival_ms, change);
        }
    }
}

use super::*;
use crate::config::PolicyKind;
use crate::config::RawConfig;
use crate::decision::FallbackReason;
use crate::fleet::EnvoyHealth;
use crate::metrics::VllmMetrics;

const T0: Millis = Millis(10_000);

fn config_with(policy: PolicyKind, n: usize) -> Config {
    let raw = RawConfig {
        endpoints: (0..n).map(|i| format!("10.0.0.{i}:8000")).collect(),
        policy,
        ..RawConfig::default()
    };
    Config::try_from(raw).unwrap()
}

fn ep(i: usize) -> EndpointId {
    EndpointId::new(format!("10.0.0.{i}:8000"))
}

fn load(running: u64, waiting: u64, kv: f64) -> VllmMetrics {
    VllmMetrics {
        kv_usage: kv,
        running,
        waiting,
        block_size: Some(16),
        num_gpu_blocks: Some(10_000),
        models: vec!["m".into()],
        engines: 1,
        ..VllmMetrics::default()
    }
}

fn router(policy: PolicyKind, loads: &[VllmMetrics]) -> Router {
    let mut r = Router::new(config_with(policy, loads.len()));
    for (i, m) in loads.iter().enumerate() {
        r.on_metrics(&ep(i), m.clone(), T0);
    }
    r
}

fn req(prefix: u64, blocks: usize) -> RouteRequest {
    RouteRequest {
        model: "m".into(),
        blocks: (0..blocks as u64).map(|i| BlockHash(prefix * 1000 + i)).collect(),
        prompt_tokens: Tokens(blocks as u64 * 64 + 10),
        max_tokens: Some(100),
        sheddable: false,
        ttft_objective_ms: None,
        first_token_timed: true,
        continues: None,
    }
}

/// A 200 response from `served_by` (`None`: the server routed to) that reported
/// `cached_tokens` in its usage, or carried no usage at all.
fn answered(served_by: Option<EndpointId>, cached_tokens: Option<u64>) -> Completion {
    Completion {
        served_by,
        status: 200,
        cached_tokens,
        prompt_tokens: None,
        usage: cached_tokens.is_some(),
        client_left: false,
    }
}

fn idle(n: usize) -> Vec<VllmMetrics> {
    vec![load(0, 0, 0.0); n]
}

#[test]
fn cold_prefix_goes_to_least_loaded_endpoint() {
    let r = router(PolicyKind::Cost, &[load(10, 8, 0.6), load(0, 0, 0.05), load(4, 2, 0.3)]);
    let d = r.route(&req(1, 32), T0);
    assert_eq!(d.best(), Some(&ep(1)));
    assert_eq!(d.outcome, Outcome::Cold);
    assert_eq!(d.endpoints.len(), 3, "best plus two fallbacks");
    assert_eq!(d.endpoints[1], ep(2), "fallbacks are ordered by cost too");
}

#[test]
fn shared_prefix_sticks_to_the_endpoint_that_holds_it() {
    let mut r = router(PolicyKind::Cost, &idle(4));
    let first = r.route(&req(7, 32), T0);
    r.on_routed(1, &req(7, 32), &first, T0);
    for id in 2..10 {
        let d = r.route(&req(7, 32), T0);
        assert_eq!(d.best(), first.best(), "request {id}");
        assert_eq!(d.outcome, Outcome::PrefixHit);
        assert_eq!(d.matched_blocks, 32);
        r.on_routed(id, &req(7, 32), &d, T0);
    }
}

#[test]
fn distinct_prefixes_spread_over_the_fleet() {
    let mut r = router(PolicyKind::Cost, &idle(4));
    let mut used = std::collections::BTreeSet::new();
    for p in 0..16 {
        let d = r.route(&req(p, 32), T0);
        used.insert(d.best().unwrap().clone());
        r.on_routed(p, &req(p, 32), &d, T0);
    }
    assert_eq!(used.len(), 4);
}

#[test]
fn a_swamped_prefix_holder_loses_to_an_idle_endpoint() {
    let mut r = router(PolicyKind::Cost, &idle(2));
    let d = r.route(&req(3, 32), T0);
    r.on_routed(1, &req(3, 32), &d, T0);
    let holder = d.best().unwrap().clone();
    let other = if holder == ep(0) { ep(1) } else { ep(0) };
    r.on_metrics(&holder, load(60, 40, 0.7), T0);
    r.on_metrics(&other, load(0, 0, 0.0), T0);
    let d = r.route(&req(3, 32), T0);
    assert_eq!(d.best(), Some(&other));
    let row = |id: &EndpointId| d.breakdown.iter().find(|s| s.endpoint == *id).unwrap().clone();
    assert!(row(&holder).matched_blocks == 32 && row(&holder).cost.0 > row(&other).cost.0);
}

#[test]
fn when_every_endpoint_has_a_queue_recomputing_a_prefix_costs_more() {
    // The same shape twice: the holder has 12 waiting, the other endpoint `waiting_other`.
    let pick = |waiting_other: u64| {
        let mut r = router(PolicyKind::Cost, &idle(2));
        let d = r.route(&req(4, 32), T0);
        r.on_routed(1, &req(4, 32), &d, T0);
        let holder = d.best().unwrap().clone();
        let other = if holder == ep(0) { ep(1) } else { ep(0) };
        let done = Completion {
            served_by: Some(holder.clone()),
            status: 200,
            cached_tokens: None,
            prompt_tokens: None,
            usage: false,
            client_left: false,
        };
        r.on_completed(1, &done, T0);
        r.on_metrics(&holder, load(8, 12, 0.5), Millis(T0.0 + 1));
        r.on_metrics(&other, load(8, waiting_other, 0.5), Millis(T0.0 + 1));
        let d = r.route(&req(4, 32), Millis(T0.0 + 1));
        (d.best() == Some(&holder), d)
    };
    // A shorter queue elsewhere, but no endpoint is free: the 2k-token prefix the holder
    // has would be recomputed ahead of every request queued behind it, so it stays.
    let (stays, d) = pick(2);
    assert!(stays, "{:?}", d.breakdown);
    // With an idle endpoint in the fleet, the same queue gap moves the request.
    let (stays, d) = pick(0);
    assert!(!stays, "{:?}", d.breakdown);
}

/// Routes one 32-block prompt of prefix 5 on an idle two-server router and completes it
/// with its prefix cached: returns (the server that holds it, the other).
fn place_prefix_5(r: &mut Router) -> (EndpointId, EndpointId) {
    let placed = r.route(&req(5, 32), T0);
    let holder = placed.best().unwrap().clone();
    r.on_routed(1, &req(5, 32), &placed, T0);
    r.on_completed(1, &done_at(Some(holder.clone()), Some(32 * 64)), T0);
    let other = if holder == ep(0) { ep(1) } else { ep(0) };
    (holder, other)
}

#[test]
fn the_holder_of_most_of_a_prompt_goes_first_when_it_costs_a_little_more() {
    // Server 0 holds the first 32 blocks of prefix 5; it is busier than server 1 by enough
    // that plain cost prefers server 1, by less than `cost.holder_tolerance`.
    let route = |config: Config, blocks: usize, waiting: u64| {
        let mut r = Router::new(config);
        r.on_metrics(&ep(0), load(0, 0, 0.0), T0);
        r.on_metrics(&ep(1), load(0, 0, 0.0), T0);
        let (holder, other) = place_prefix_5(&mut r);
        let later = Millis(T0.0 + 1);
        r.on_metrics(&holder, load(4, waiting, 0.3), later);
        r.on_metrics(&other, load(4, 0, 0.3), later);
        let d = r.route(&req(5, blocks), later);
        let cost = |id: &EndpointId| d.breakdown.iter().find(|s| s.endpoint == *id).unwrap().cost.0;
        let first = d.best() == Some(&holder);
        assert_eq!(
            d.holder_first,
            first && cost(&holder) > cost(&other),
            "the decision says so"
        );
        (first, cost(&holder) / cost(&other))
    };
    let with = |json: &str| {
        let mut raw: RawConfig = serde_json::from_str(json).unwrap();
        raw.endpoints = vec![ep(0).as_str().into(), ep(1).as_str().into()];
        Config::try_from(raw).unwrap()
    };
    // The queue at the holder that makes it cost 1–1.3× the other for a 40-block prompt.
    let waiting = (0..200)
        .find(|w| {
            let (_, ratio) = route(with("{}"), 40, *w);
            ratio > 1.0 && ratio < 1.3
        })
        .expect("some queue puts the holder within 30% of the other server");
    // 32 of 40 blocks (80%) held: the holder goes first; without the rule it would not.
    assert!(route(with("{}"), 40, waiting).0);
    assert!(!route(with(r#"{"cost": {"holder_tolerance": 0}}"#), 40, waiting).0);
    // 32 of 64 (50%) is below `holder_min_share`: plain cost decides.
    let (stays, ratio) = route(with("{}"), 64, waiting);
    assert!(!stays || ratio <= 1.0, "{ratio}");
}

#[test]
fn cost_rises_with_every_kind_of_load() {
    let base = router(PolicyKind::Cost, &[load(2, 2, 0.5)])
        .route(&req(1, 8), T0)
        .breakdown[0]
        .cost
        .0;
    for heavier in [load(3, 2, 0.5), load(2, 3, 0.5), load(2, 2, 0.95)] {
        let c = router(PolicyKind::Cost, std::slice::from_ref(&heavier))
            .route(&req(1, 8), T0)
            .breakdown[0]
            .cost
            .0;
        assert!(c > base, "{heavier:?}: {c} <= {base}");
    }
}

/// A decision that sends a cold request to `to` alone.
fn cold_to(to: EndpointId) -> Decision {
    Decision {
        endpoints: vec![to],
        outcome: Outcome::Cold,
        matched_blocks: 0,
        breakdown: vec![],
        tier: None,
        holder_first: false,
    }
}

#[test]
fn clients_that_leave_before_any_response_do_not_eject_the_server() {
    let ended = |client_left: bool| {
        let mut r = router(PolicyKind::Cost, &idle(2));
        for id in 0..5 {
            r.on_routed(id, &req(1, 1), &cold_to(ep(1)), T0);
            let done = Completion {
                client_left,
                ..served(&ep(1), 0)
            };
            r.on_completed(id, &done, T0);
        }
        r.route(&req(1, 8), T0).breakdown[1].filtered
    };
    // Five requests that ended with no response at all: a reset counts against the server,
    // five clients giving up on a busy one (timeouts under overload) do not.
    assert_eq!(ended(false), Some(FilterReason::Ejected));
    assert_eq!(ended(true), None);
}

#[test]
fn unhealthy_ejected_and_stale_endpoints_are_never_picked() {
    let mut r = router(PolicyKind::Cost, &idle(4));
    r.on_scrape_failed(&ep(0), T0);
    r.on_scrape_failed(&ep(0), T0);
    for _ in 0..3 {
        r.on_routed(99, &req(1, 1), &cold_to(ep(1)), T0);
        r.on_completed(
            99,
            &Completion {
                served_by: Some(ep(1)),
                status: 500,
                cached_tokens: None,
                prompt_tokens: None,
                usage: false,
                client_left: false,
            },
            T0,
        );
    }
    let later = T0.plus(500);
    r.on_metrics(&ep(3), load(0, 0, 0.0), later);
    let d = r.route(&req(1, 8), later);
    let reasons: Vec<_> = d.breakdown.iter().map(|s| s.filtered).collect();
    assert_eq!(reasons[0], Some(FilterReason::Unhealthy), "two failed scrapes");
    assert_eq!(reasons[1], Some(FilterReason::Ejected), "three 5xx responses");
    assert!(!d.endpoints.contains(&ep(0)) && !d.endpoints.contains(&ep(1)));
    // One good scrape brings it back (healthy_after_successes defaults to 1); these metrics
    // are dated T0, so they go stale with the rest below.
    r.on_metrics(&ep(0), load(0, 0, 0.0), T0);
    assert_eq!(r.route(&req(1, 8), later).breakdown[0].filtered, None);
    // stale_after_ms defaults to 1000: T0 metrics are still fresh at T0+500, stale at T0+1500.
    let d = r.route(&req(1, 8), T0.plus(1500));
    assert_eq!(d.endpoints, vec![ep(3)]);
    assert_eq!(d.breakdown[2].filtered, Some(FilterReason::Stale));
}

#[test]
fn without_metrics_the_least_busy_endpoint_by_gateway_count_is_the_fallback() {
    let mut r = Router::new(config_with(PolicyKind::Cost, 3));
    let d = r.route(&req(1, 8), T0);
    assert_eq!(d.outcome, Outcome::Fallback(FallbackReason::NoMetrics));
    r.on_routed(1, &req(1, 8), &d, T0);
    let d2 = r.route(&req(1, 8), T0);
    assert_ne!(d2.best(), d.best(), "the gateway's own in-flight count spreads load");
}

#[test]
fn with_every_endpoint_down_nothing_is_chosen() {
    let mut r = router(PolicyKind::Cost, &idle(2));
    for i in 0..2 {
        r.on_scrape_failed(&ep(i), T0);
        r.on_scrape_failed(&ep(i), T0);
    }
    let d = r.route(&req(1, 8), T0);
    assert_eq!(
        (d.endpoints.len(), d.outcome),
        (0, Outcome::Fallback(FallbackReason::NoEndpoints))
    );
    assert_eq!(d.header_value(), None);
}

#[test]
fn overload_sheds_sheddable_requests_and_serves_the_rest_least_bad() {
    let r = router(PolicyKind::Cost, &[load(100, 200, 0.99), load(100, 150, 0.97)]);
    let mut shed = req(1, 8);
    shed.sheddable = true;
    assert_eq!(r.route(&shed, T0).outcome, Outcome::Shed { retry_after_s: 1 });
    let d = r.route(&req(1, 8), T0);
    assert_eq!(d.best(), Some(&ep(1)));
}

#[test]
fn overloaded_endpoints_are_skipped_while_others_have_room() {
    let r = router(PolicyKind::LeastRequest, &[load(0, 0, 0.96), load(50, 20, 0.5)]);
    let d = r.route(&req(1, 8), T0);
    assert_eq!(d.endpoints, vec![ep(1)]);
    assert_eq!(d.breakdown[0].filtered, Some(FilterReason::Overloaded));
}

#[test]
fn the_cost_policy_weighs_queues_and_kv_instead_of_cutting_servers_at_the_overload_limits() {
    // Two servers either side of `overload.queue_limit` (128 waiting) or `kv_limit` (0.95);
    // the one past it holds the prompt. The cost policy weighs both and keeps the prompt on
    // its holder; least-request skips the server past the limit.
    let route_kv = |policy: PolicyKind, waiting: [u64; 2], kv: [f64; 2], sheddable: bool| {
        let mut r = router(policy, &idle(2));
        let (holder, other) = place_prefix_5(&mut r);
        let later = Millis(T0.0 + 1);
        r.on_metrics(&holder, load(4, waiting[0], kv[0]), later);
        r.on_metrics(&other, load(4, waiting[1], kv[1]), later);
        let mut q = req(5, 32);
        q.sheddable = sheddable;
        (r.route(&q, later), holder)
    };
    let route =
        |policy: PolicyKind, waiting: [u64; 2], sheddable: bool| route_kv(policy, waiting, [0.3, 0.3], sheddable);
    let (d, holder) = route(PolicyKind::Cost, [130, 126], false);
    assert_eq!(d.best(), Some(&holder));
    assert!(d.breakdown.iter().all(|s| s.filtered.is_none()), "{:?}", d.breakdown);
    let (d, holder) = route(PolicyKind::LeastRequest, [130, 126], false);
    assert_ne!(d.best(), Some(&holder));
    let cut = d.breakdown.iter().find(|s| s.endpoint == holder).unwrap();
    assert_eq!(cut.filtered, Some(FilterReason::Overloaded));
    // The count still decides when every server is past it: a sheddable request is shed.
    let (d, _) = route(PolicyKind::Cost, [130, 129], true);
    assert_eq!(d.outcome, Outcome::Shed { retry_after_s: 1 });
    let (d, _) = route(PolicyKind::Cost, [130, 126], true);
    assert_ne!(d.best(), None);
    // The same with KV usage.
    let (d, holder) = route_kv(PolicyKind::Cost, [10, 10], [0.96, 0.5], false);
    assert_eq!(d.best(), Some(&holder));
    assert!(d.breakdown.iter().all(|s| s.filtered.is_none()), "{:?}", d.breakdown);
    let (d, holder) = route_kv(PolicyKind::LeastRequest, [10, 10], [0.96, 0.5], false);
    assert_ne!(d.best(), Some(&holder));
    let cut = d.breakdown.iter().find(|s| s.endpoint == holder).unwrap();
    assert_eq!(cut.filtered, Some(FilterReason::Overloaded));
    let (d, _) = route_kv(PolicyKind::Cost, [10, 10], [0.96, 0.97], true);
    assert_eq!(d.outcome, Outcome::Shed { retry_after_s: 1 });
}

#[test]
fn models_not_served_and_prompts_that_do_not_fit_are_filtered() {
    let mut other = load(0, 0, 0.0);
    other.models = vec!["other".into()];
    let mut small = load(0, 0, 0.0);
    small.num_gpu_blocks = Some(10);
    let r = router(PolicyKind::Cost, &[other, small, load(5, 5, 0.5)]);
    let d = r.route(&req(1, 8), T0);
    assert_eq!(d.endpoints, vec![ep(2)]);
    assert_eq!(d.breakdown[0].filtered, Some(FilterReason::ModelNotServed));
    assert_eq!(d.breakdown[1].filtered, Some(FilterReason::DoesNotFit));
    let mut lora = req(1, 8);
    lora.model = "sql-lora".into();
    assert_eq!(
        r.route(&lora, T0).endpoints.len(),
        2,
        "an unknown name (a LoRA adapter) is not filtered by model"
    );
}

#[test]
fn route_is_pure() {
    let r = router(PolicyKind::Cost, &idle(3));
    let before = format!("{:?}", r);
    let a = r.route(&req(1, 8), T0);
    assert_eq!(a, r.route(&req(1, 8), T0));
    assert_eq!(before, format!("{:?}", r));
}

#[test]
fn round_robin_rotates_and_random_follows_its_seed() {
    let mut r = router(PolicyKind::RoundRobin, &idle(3));
    let mut picks = Vec::new();
    for i in 0..6 {
        let d = r.route(&req(i, 1), T0);
        picks.push(d.best().unwrap().clone());
        r.on_routed(i, &req(i, 1), &d, T0);
    }
    assert_eq!(picks, vec![ep(0), ep(1), ep(2), ep(0), ep(1), ep(2)]);
    let run = |seed| {
        let mut raw = RawConfig {
            endpoints: (0..8).map(|i| format!("10.0.0.{i}:8000")).collect(),
            policy: PolicyKind::Random,
            ..RawConfig::default()
        };
        raw.seed = seed;
        let mut r = Router::new(Config::try_from(raw).unwrap());
        (0..8).for_each(|i| {
            r.on_metrics(&ep(i), load(0, 0, 0.0), T0);
        });
        (0..20)
            .map(|i| {
                let d = r.route(&req(i, 1), T0);
                r.on_routed(i, &req(i, 1), &d, T0);
                d.best().unwrap().clone()
            })
            .collect::<Vec<_>>()
    };
    assert_eq!(run(1), run(1));
    assert_ne!(run(1), run(2));
}

#[test]
fn weighted_policy_prefers_the_prefix_holder_at_equal_load() {
    let mut r = router(PolicyKind::Weighted, &idle(3));
    let d = r.route(&req(5, 16), T0);
    r.on_routed(1, &req(5, 16), &d, T0);
    let again = r.route(&req(5, 16), T0);
    assert_eq!(again.best(), d.best());
    assert_eq!(again.outcome, Outcome::PrefixHit);
}

#[test]
fn independent_routers_agree_on_the_owner_of_a_cold_prefix() {
    let mut a = router(PolicyKind::Cost, &idle(8));
    let mut b = router(PolicyKind::Cost, &idle(8));
    // Both served the same unrelated request (their indexes agree, as those of workers
    // and replicas that share their placements do); b has routed more since (its rotation
    // differs) and scraped its server later.
    for r in [&mut a, &mut b] {
        let other = r.route(&req(99, 4), T0);
        r.on_routed(1, &req(99, 4), &other, T0);
        r.on_completed(1, &answered(None, Some(0)), T0);
    }
    let other = b.route(&req(99, 4), T0);
    b.on_routed(2, &req(99, 4), &other, T0);
    b.on_first_token(2, T0);
    b.on_metrics(other.best().unwrap(), load(0, 0, 0.0), T0);
    let owners: Vec<_> = (0..20)
        .map(|p| {
            (
                a.route(&req(p, 8), T0).best().cloned(),
                b.route(&req(p, 8), T0).best().cloned(),
            )
        })
        .collect();
    assert!(owners.iter().all(|(x, y)| x == y), "{owners:?}");
    let distinct: std::collections::BTreeSet<_> = owners.iter().map(|(x, _)| x.clone()).collect();
    assert!(distinct.len() >= 4, "rendezvous spreads prefixes: {distinct:?}");
}

#[test]
fn a_server_holding_more_of_the_index_draws_fewer_cold_prefixes() {
    // Server 0 holds 40 prefixes, the others none: with `cold_balance` the new prefixes
    // go elsewhere; with the plain hash (0) about a quarter of them land there, and so
    // they do for a router that sees only half of the servers' traffic (a gateway replica
    // that does not share its placements: the others' indexes differ from its own).
    let owners = |balance: f64, seen: f64| {
        let mut raw = RawConfig {
            endpoints: (0..4).map(|i| format!("10.0.0.{i}:8000")).collect(),
            ..RawConfig::default()
        };
        raw.cost.cold_balance = balance;
        let mut r = Router::new(Config::try_from(raw).unwrap());
        for i in 0..4 {
            r.on_metrics(&ep(i), load(0, 0, 0.0), T0);
            let e = r.table.get_mut(&ep(i)).unwrap();
            e.seen.on_counters(Some(0.0), T0);
            e.seen.on_served(Tokens((10_000.0 * seen) as u64));
            e.seen.on_counters(Some(10_000.0), Millis(T0.0 + 200));
        }
        let slot = r.endpoints()[0].slot;
        for p in 0..40 {
            r.index.record(slot, &req(1000 + p, 8).blocks);
        }
        (0..40)
            .filter(|p| r.route(&req(*p, 8), T0).best() == Some(&ep(0)))
            .count()
    };
    assert_eq!(owners(16.0, 1.0), 0);
    let plain = owners(0.0, 1.0);
    assert!((5..=15).contains(&plain), "{plain} of 40 with the plain hash");
    assert_eq!(owners(16.0, 0.5), plain);
}

#[test]
fn a_served_prompt_stops_counting_as_queued_prefill() {
    // Two cold prompts on two idle servers, one of them served (first token): a third sees
    // the server that served as the cheaper one. With the earlier rule (the tokens kept in
    // full until the next scrape) the two read alike.
    let costs = |kept: f64| {
        let mut raw = RawConfig {
            endpoints: (0..2).map(|i| format!("10.0.0.{i}:8000")).collect(),
            ..RawConfig::default()
        };
        raw.cost.served_tokens_kept = kept;
        raw.cost.learn_speeds = false;
        // The second server's prompt still waits for its first token: a third prompt
        // would join it (`pending_weight`), a charge apart from what this test measures.
        raw.cost.pending_weight = 0.0;
        let mut r = Router::new(Config::try_from(raw).unwrap());
        for i in 0..2 {
            r.on_metrics(&ep(i), load(0, 0, 0.0), T0);
        }
        let first = r.route(&req(1, 32), T0);
        r.on_routed(1, &req(1, 32), &first, T0);
        let second = r.route(&req(2, 32), T0);
        r.on_routed(2, &req(2, 32), &second, T0);
        assert_ne!(first.best(), second.best());
        r.on_first_token(1, Millis(T0.0 + 1));
        let d = r.route(&req(3, 32), Millis(T0.0 + 1));
        let cost = |id: &EndpointId| d.breakdown.iter().find(|s| s.endpoint == *id).unwrap().cost.0;
        (cost(first.best().unwrap()), cost(second.best().unwrap()))
    };
    let (served, busy) = costs(0.0);
    assert!(served < busy, "{served} vs {busy}");
    let (served, busy) = costs(1.0);
    assert!((served - busy).abs() < 1e-9, "{served} vs {busy}");
}

#[test]
fn completion_releases_accounting_and_a_retry_moves_the_prefix() {
    let mut r = router(PolicyKind::Cost, &idle(2));
    let d = r.route(&req(4, 16), T0);
    r.on_routed(7, &req(4, 16), &d, T0);
    let best = d.best().unwrap().clone();
    let other = if best == ep(0) { ep(1) } else { ep(0) };
    assert_eq!(r.endpoints().iter().find(|e| e.id == best).unwrap().inflight, 1);
    r.on_completed(7, &answered(Some(other.clone()), Some(0)), T0);
    assert!(r
        .endpoints()
        .iter()
        .all(|e| e.inflight == 0 && e.sent_since_scrape == 0));
    assert_eq!(
        r.route(&req(4, 16), T0)
            .breakdown
            .iter()
            .find(|s| s.endpoint == other)
            .unwrap()
            .matched_blocks,
        16
    );
    assert_eq!(r.stats().reported_prompt_tokens, req(4, 16).prompt_tokens.0);
    assert_eq!(
        r.on_completed(7, &answered(None, None), T0),
        None,
        "a second completion is ignored"
    );
}

#[test]
fn departed_endpoints_are_forgotten_and_never_chosen() {
    let mut r = router(PolicyKind::Cost, &idle(3));
    let d = r.route(&req(1, 8), T0);
    r.on_routed(1, &req(1, 8), &d, T0);
    let keep: Vec<EndpointId> = (0..3).map(ep).filter(|e| Some(e) != d.best()).collect();
    r.on_endpoints(&keep);
    let d2 = r.route(&req(1, 8), T0);
    assert!(d2.endpoints.iter().all(|e| keep.contains(e)));
    assert_eq!(d2.outcome, Outcome::Cold);
    assert_eq!(r.index().entries(), 0);
}

#[test]
fn header_value_lists_best_then_fallbacks() {
    let r = router(PolicyKind::Cost, &[load(0, 0, 0.0), load(1, 0, 0.1)]);
    assert_eq!(
        r.route(&req(1, 0), T0).header_value().as_deref(),
        Some("10.0.0.0:8000,10.0.0.1:8000")
    );
}

#[test]
fn prefill_the_gateway_sent_counts_until_the_first_token_even_after_a_scrape() {
    let mut r = router(PolicyKind::Cost, &idle(2));
    let d = r.route(&req(1, 64), T0);
    r.on_routed(1, &req(1, 64), &d, T0);
    let busy = d.best().unwrap().clone();
    // A scrape taken just before the request was admitted shows an idle server.
    r.on_metrics(&busy, load(0, 0, 0.0), T0.plus(10));
    let pending = |r: &Router| {
        r.endpoints()
            .iter()
            .find(|e| e.id == busy)
            .unwrap()
            .pending_prefill_tokens
    };
    assert_eq!(pending(&r), req(1, 64).prompt_tokens);
    let cost_of = |r: &Router| {
        r.route(&req(9, 8), T0.plus(20))
            .breakdown
            .iter()
            .find(|s| s.endpoint == busy)
            .unwrap()
            .cost
            .0
    };
    let before = cost_of(&r);
    r.on_first_token(1, T0.plus(30));
    assert_eq!(pending(&r), Tokens(0));
    assert!(
        cost_of(&r) < before,
        "a finished prefill no longer delays new requests: {} vs {before}",
        cost_of(&r)
    );
    r.on_first_token(1, T0.plus(31));
    r.on_completed(1, &answered(None, None), T0.plus(40));
    assert_eq!(pending(&r), Tokens(0), "nothing is released twice");
}

#[test]
fn the_same_prompt_from_two_tenants_shares_no_prefix_state() {
    let mut r = router(PolicyKind::Cost, &idle(4));
    let parsed = crate::request::parse(
        crate::request::ApiKind::Completions,
        format!(r#"{{"model":"m","prompt":"{}"}}"#, "x".repeat(4096)).as_bytes(),
    )
    .unwrap();
    let a = r.request(&parsed, "tenant-a", false);
    let d = r.route(&a, T0);
    r.on_routed(1, &a, &d, T0);
    assert_eq!(r.route(&a, T0).outcome, Outcome::PrefixHit);
    let b = r.request(&parsed, "tenant-b", false);
    assert!(
        a.blocks.iter().all(|h| !b.blocks.contains(h)),
        "no block hash in common"
    );
    assert_eq!(r.route(&b, T0).matched_blocks, 0);
}

fn done_at(endpoint: Option<EndpointId>, cached: Option<u64>) -> Completion {
    Completion {
        served_by: endpoint,
        status: 200,
        cached_tokens: cached,
        prompt_tokens: None,
        usage: cached.is_some(),
        client_left: false,
    }
}

fn inflight_on(r: &Router, id: &EndpointId) -> (u32, Tokens) {
    let e = r.endpoints().iter().find(|e| e.id == *id).unwrap();
    (e.inflight, e.pending_prefill_tokens)
}

/// Two routers of one process over `n` idle endpoints, sharing as peers 1 and 2.
fn peers(n: usize) -> (Router, Router) {
    let mut a = router(PolicyKind::Cost, &idle(n));
    let mut b = router(PolicyKind::Cost, &idle(n));
    a.share_with_peers(1);
    b.share_with_peers(2);
    (a, b)
}

fn pass(from: &mut Router, to: &mut Router) {
    for ev in from.take_peer_events() {
        to.on_peer_event(&ev, T0);
    }
}

#[test]
fn peers_route_with_each_others_placements_and_load() {
    let (mut a, mut b) = peers(4);
    let d = a.route(&req(9, 24), T0);
    a.on_routed(1, &req(9, 24), &d, T0);
    let chosen = d.best().unwrap().clone();
    pass(&mut a, &mut b);
    assert_eq!(inflight_on(&b, &chosen), inflight_on(&a, &chosen), "b sees a's load");
    let sibling = b.route(&req(9, 24), T0);
    assert_eq!(sibling.best(), Some(&chosen));
    assert_eq!(sibling.matched_blocks, 24, "b knows where a put the prefix");

    a.on_first_token(1, T0);
    pass(&mut a, &mut b);
    assert_eq!(inflight_on(&b, &chosen).1, Tokens(0), "prefill done on a is done on b");
    let other = ep(if chosen == ep(0) { 1 } else { 0 });
    a.on_completed(1, &done_at(Some(other.clone()), None), T0);
    pass(&mut a, &mut b);
    assert_eq!(inflight_on(&b, &chosen).0, 0, "a's completion releases b's count");
    assert_eq!(
        b.route(&req(9, 24), T0)
            .breakdown
            .iter()
            .find(|s| s.endpoint == other)
            .unwrap()
            .matched_blocks,
        24,
        "a retry that moved the request moves the prefix on b too"
    );
    assert_eq!(b.stats().peer_events, 3);
    assert_eq!(b.stats().routed, 0, "peer requests are not b's own");
}

#[test]
fn without_the_events_a_peer_routes_blind() {
    // The claim above is not vacuous: the same two routers, no events passed.
    let mut a = router(PolicyKind::Cost, &idle(4));
    let b = router(PolicyKind::Cost, &idle(4));
    a.share_with_peers(1);
    let d = a.route(&req(9, 24), T0);
    a.on_routed(1, &req(9, 24), &d, T0);
    assert_eq!(b.route(&req(9, 24), T0).matched_blocks, 0);
}

#[test]
fn keys_from_two_peers_with_the_same_local_id_stay_apart_and_own_events_are_ignored() {
    let (mut a, mut b) = peers(2);
    for r in [&mut a, &mut b] {
        let d = r.route(&req(3, 8), T0);
        r.on_routed(5, &req(3, 8), &d, T0);
    }
    let from_b = b.take_peer_events();
    for ev in &from_b {
        a.on_peer_event(ev, T0);
        a.on_peer_event(ev, T0);
    }
    assert_eq!(
        a.inflight_requests(),
        2,
        "same local id, two origins; a repeated event counts once"
    );
    assert_eq!(a.own_inflight_requests(), 1, "b's copy is not a's own");
    let applied = a.stats().peer_events;
    for ev in a.take_peer_events() {
        a.on_peer_event(&ev, T0);
    }
    assert_eq!(a.stats().peer_events, applied, "a router ignores its own events");
    let total: u32 = a.endpoints().iter().map(|e| e.inflight).sum();
    assert_eq!(total, 2);
}

#[test]
fn a_completion_that_overtakes_its_placement_leaves_no_load() {
    let (mut a, mut b) = peers(2);
    let d = a.route(&req(3, 8), T0);
    a.on_routed(1, &req(3, 8), &d, T0);
    a.on_completed(1, &done_at(None, None), T0);
    let events = a.take_peer_events();
    for ev in events.iter().rev() {
        b.on_peer_event(ev, T0);
    }
    assert_eq!(b.inflight_requests(), 0);
    assert!(b
        .endpoints()
        .iter()
        .all(|e| e.inflight == 0 && e.pending_prefill_tokens == Tokens(0)));
    assert_eq!(b.route(&req(3, 8), T0).matched_blocks, 8, "the placement still counts");
}

#[test]
fn events_the_log_refused_go_first_at_the_next_publish() {
    let (mut a, mut b) = peers(2);
    let d = a.route(&req(3, 8), T0);
    a.on_routed(1, &req(3, 8), &d, T0);
    a.on_first_token(1, T0);
    let refused = a.take_peer_events();
    assert_eq!(refused.len(), 2);
    a.on_completed(1, &done_at(None, None), T0);
    assert_eq!(a.return_peer_events(refused), 0);
    pass(&mut a, &mut b);
    assert_eq!(b.inflight_requests(), 0, "placement, first token, completion, in order");
    assert_eq!(b.stats().peer_events, 3);
    assert!(b.endpoints().iter().all(|e| e.inflight == 0));
}

#[test]
fn the_outbox_keeps_the_newest_events_when_the_log_refuses_for_long() {
    let (mut a, _) = peers(2);
    let d = a.route(&req(3, 8), T0);
    for id in 0..70_000u64 {
        a.on_routed(id, &req(3, 8), &d, T0);
        a.on_completed(id, &done_at(None, None), T0);
    }
    let all = a.take_peer_events();
    assert_eq!(all.len(), 140_000);
    let newest = all.last().cloned();
    assert_eq!(a.return_peer_events(all), 140_000 - 65_536);
    let kept = a.take_peer_events();
    assert_eq!(kept.len(), 65_536);
    assert_eq!(kept.last().cloned(), newest);
}

#[test]
fn requests_in_flight_when_a_router_takes_a_new_origin_still_end() {
    // Two VMs that started at the same instant can take one origin; the one that notices
    // takes another while its requests are in flight. Their first tokens and completions
    // must still find them, here and on every peer.
    let (mut a, mut b) = peers(2);
    let d = a.route(&req(3, 8), T0);
    a.on_routed(1, &req(3, 8), &d, T0);
    a.on_routed(2, &req(3, 8), &d, T0);
    a.on_first_token(2, T0);
    pass(&mut a, &mut b);
    a.share_with_peers(7);
    a.on_first_token(1, T0);
    pass(&mut a, &mut b);
    let chosen = d.best().unwrap().clone();
    assert_eq!(
        inflight_on(&b, &chosen),
        (2, Tokens(0)),
        "b sees both, neither prefilling"
    );
    a.on_completed(1, &done_at(None, None), T0);
    a.on_completed(2, &done_at(None, None), T0);
    assert_eq!(a.inflight_requests(), 0);
    assert!(a
        .endpoints()
        .iter()
        .all(|e| e.inflight == 0 && e.pending_prefill_tokens == Tokens(0)));
    pass(&mut a, &mut b);
    assert_eq!(b.inflight_requests(), 0);
    assert!(b
        .endpoints()
        .iter()
        .all(|e| e.inflight == 0 && e.pending_prefill_tokens == Tokens(0)));
}

#[test]
fn a_new_origin_once_a_departed_peers_releases_what_that_peer_left() {
    // Origins are reused after `MAX_PEERS` claims: the one a router takes may still name a
    // departed peer's requests in its view. They are released, not counted as its own.
    let (mut a, mut b) = peers(2);
    let mut gone = router(PolicyKind::Cost, &idle(2));
    gone.share_with_peers(9);
    let d = gone.route(&req(3, 8), T0);
    gone.on_routed(5, &req(3, 8), &d, T0);
    pass(&mut gone, &mut a);
    assert_eq!(a.inflight_requests(), 1);
    let d = a.route(&req(4, 8), T0);
    a.on_routed(1, &req(4, 8), &d, T0);
    pass(&mut a, &mut b);
    a.share_with_peers(9);
    assert_eq!(a.inflight_requests(), 1, "the departed peer's request is released");
    assert_eq!(a.own_inflight_requests(), 1);
    assert_eq!(a.endpoints().iter().map(|e| e.inflight).sum::<u32>(), 1);
    a.on_completed(1, &done_at(None, None), T0);
    pass(&mut a, &mut b);
    assert_eq!((a.inflight_requests(), b.inflight_requests()), (0, 0));
}

#[test]
fn peer_requests_whose_completion_never_came_are_released_after_a_while() {
    let (mut a, mut b) = peers(2);
    let d = a.route(&req(3, 8), T0);
    a.on_routed(1, &req(3, 8), &d, T0);
    pass(&mut a, &mut b);
    let d = b.route(&req(4, 8), T0);
    b.on_routed(1, &req(4, 8), &d, T0);
    assert_eq!(b.expire_peer_requests(T0.plus(1000), 60_000), 0);
    assert_eq!(
        b.expire_peer_requests(T0.plus(61_000), 60_000),
        1,
        "a's request is released"
    );
    assert_eq!(b.inflight_requests(), 1, "b's own request stays");
}

#[test]
fn a_peer_request_routed_before_the_scrape_is_not_counted_as_unseen_load() {
    let mut a = router(PolicyKind::Cost, &idle(2));
    let mut b = router(PolicyKind::Cost, &idle(2));
    a.share_with_peers(1);
    let d = a.route(&req(3, 8), Millis(T0.0 - 50));
    a.on_routed(1, &req(3, 8), &d, Millis(T0.0 - 50));
    pass(&mut a, &mut b);
    let e = b.endpoints().iter().find(|e| Some(&e.id) == d.best()).unwrap();
    assert_eq!(
        (e.inflight, e.sent_since_scrape),
        (1, 0),
        "the metrics of T0 already show it"
    );
}

#[test]
fn a_departed_peer_leaves_no_load_behind() {
    let (mut a, mut b) = peers(2);
    for id in 0..3 {
        let d = a.route(&req(id, 8), T0);
        a.on_routed(id, &req(id, 8), &d, T0);
    }
    let d = b.route(&req(7, 8), T0);
    b.on_routed(1, &req(7, 8), &d, T0);
    pass(&mut a, &mut b);
    assert_eq!(b.inflight_requests(), 4);
    b.forget_peer(1);
    assert_eq!(b.inflight_requests(), 1, "only b's own request is left");
    let total: u32 = b.endpoints().iter().map(|e| e.inflight).sum();
    assert_eq!(total, 1);
}

#[test]
fn vllm_reporting_fewer_cached_tokens_than_predicted_shrinks_what_the_index_keeps() {
    let mut r = router(PolicyKind::Cost, &idle(1));
    // Fill the index with 40 old prefixes (8 blocks each), then route a sibling of the last.
    for id in 0..40 {
        let d = r.route(&req(id, 8), T0);
        r.on_routed(id, &req(id, 8), &d, T0);
        r.on_completed(id, &done_at(None, None), T0);
    }
    let before = r.index().entries();
    let d = r.route(&req(39, 8), T0);
    assert_eq!(d.matched_blocks, 8);
    r.on_routed(100, &req(39, 8), &d, T0);
    r.on_completed(100, &done_at(None, Some(64)), T0);
    assert!(
        r.index().entries() < before - 5,
        "{} !< {before} - 5",
        r.index().entries()
    );
    assert_eq!(r.stats().overpredicted_tokens, 8 * 64 - 64);
    assert_eq!(
        r.route(&req(0, 8), T0).matched_blocks,
        1,
        "the oldest prefix lost its tail, as vLLM evicts"
    );
    assert_eq!(r.route(&req(39, 8), T0).matched_blocks, 8, "the one just served stays");
}

/// The index after 40 prefixes and a sibling of the last one that vLLM reported one block
/// of (7 of the 8 predicted blocks missing), on a server whose `prompt_tokens_total` grew
/// by `served_per_routed` × the estimated prompt tokens this router had served there, and
/// whose responses reported `reported_per_estimated` × the estimate as `prompt_tokens`.
fn entries_after_a_miss(served_per_routed: f64, reported_per_estimated: Option<f64>) -> (usize, usize) {
    let counter = |tokens: u64| VllmMetrics {
        prompt_tokens: Some(tokens as f64 * served_per_routed),
        ..load(0, 0, 0.0)
    };
    let mut r = router(PolicyKind::Cost, &[counter(0)]);
    let mut routed = 0;
    for id in 0..40 {
        let d = r.route(&req(id, 8), T0);
        r.on_routed(id, &req(id, 8), &d, T0);
        let estimate = req(id, 8).prompt_tokens.0;
        let done = Completion {
            prompt_tokens: reported_per_estimated.map(|k| (estimate as f64 * k) as u64),
            ..done_at(None, None)
        };
        r.on_completed(id, &done, T0);
        routed += estimate;
    }
    r.on_metrics(&ep(0), counter(routed), Millis(T0.0 + 100));
    let before = r.index().entries();
    let d = r.route(&req(39, 8), T0);
    r.on_routed(100, &req(39, 8), &d, T0);
    r.on_completed(100, &done_at(None, Some(64)), T0);
    (before, r.index().entries())
}

#[test]
fn a_miss_shrinks_the_index_only_where_traffic_the_router_did_not_see_filled_the_cache() {
    let (before, after) = entries_after_a_miss(1.0, None);
    assert_eq!(after, before, "the router saw all the server served");
    let (before, after) = entries_after_a_miss(1.1, None);
    assert_eq!(
        after,
        before - 3,
        "a tenth unseen: 7 missing blocks count 7 × 0.09 / 0.25"
    );
    let (before, after) = entries_after_a_miss(2.0, None);
    assert_eq!(after, before - 7, "half of it unseen: the miss counts in full");
}

#[test]
fn a_server_that_counts_more_tokens_than_the_estimate_is_judged_by_its_reports() {
    // vLLM's tokenizer counts 1.25 tokens per estimated one, and says so in its responses.
    let (before, after) = entries_after_a_miss(1.25, Some(1.25));
    assert_eq!(after, before, "all of it seen once the reports scale the estimate");
    let (before, after) = entries_after_a_miss(1.25, None);
    assert_eq!(
        after,
        before - 6,
        "without reports a fifth reads as unseen: 7 × 0.2 / 0.25"
    );
}

#[test]
fn peers_count_each_request_a_server_served_once() {
    let (mut a, mut b) = peers(1);
    let counter = |tokens: u64| VllmMetrics {
        prompt_tokens: Some(tokens as f64),
        ..load(0, 0, 0.0)
    };
    for r in [&mut a, &mut b] {
        r.on_metrics(&ep(0), counter(0), T0);
    }
    let mut served = 0;
    for id in 0..20 {
        let (from, to) = if id % 2 == 0 {
            (&mut a, &mut b)
        } else {
            (&mut b, &mut a)
        };
        let d = from.route(&req(id, 8), T0);
        from.on_routed(id, &req(id, 8), &d, T0);
        from.on_first_token(id, T0);
        from.on_completed(id, &done_at(None, None), T0);
        pass(from, to);
        served += req(id, 8).prompt_tokens.0;
    }
    for r in [&mut a, &mut b] {
        r.on_metrics(&ep(0), counter(served), Millis(T0.0 + 100));
        let fraction = r.endpoints()[0].seen.seen_fraction().unwrap_or(0.0);
        assert!((fraction - 1.0).abs() < 1e-9, "{fraction}");
    }
}

#[test]
fn confirmed_predictions_let_the_index_grow_back() {
    let mut r = router(PolicyKind::Cost, &idle(1));
    for id in 0..40 {
        let d = r.route(&req(id, 8), T0);
        r.on_routed(id, &req(id, 8), &d, T0);
    }
    let d = r.route(&req(39, 8), T0);
    r.on_routed(100, &req(39, 8), &d, T0);
    r.on_completed(100, &done_at(None, Some(0)), T0);
    let shrunk = r.index().capacity(0);
    for id in 200..260 {
        let d = r.route(&req(id, 8), T0);
        r.on_routed(id, &req(id, 8), &d, T0);
        r.on_completed(id, &done_at(None, Some(0)), T0);
    }
    assert!(r.index().capacity(0) > shrunk, "{} !> {shrunk}", r.index().capacity(0));
    assert_eq!(r.stats().underpredicted_tokens, 0);
}

#[test]
fn a_request_routed_after_a_scrape_was_taken_stays_counted_when_the_scrape_arrives_late() {
    let mut r = router(PolicyKind::Cost, &idle(1));
    let d = r.route(&req(1, 8), Millis(T0.0 + 100));
    r.on_routed(1, &req(1, 8), &d, Millis(T0.0 + 100));
    // The scrape taken at T0 + 50 reaches this router only now: it cannot show request 1.
    r.on_metrics(&ep(0), load(0, 0, 0.0), Millis(T0.0 + 50));
    assert_eq!(r.endpoints()[0].sent_since_scrape, 1);
    r.on_metrics(&ep(0), load(1, 0, 0.0), Millis(T0.0 + 150));
    assert_eq!(
        r.endpoints()[0].sent_since_scrape,
        0,
        "a scrape taken after it shows it"
    );
}

#[test]
fn usage_without_details_counts_as_a_miss_only_from_a_server_that_reports_details() {
    let mut r = router(PolicyKind::Cost, &idle(1));
    let without_details = Completion {
        served_by: None,
        status: 200,
        cached_tokens: None,
        prompt_tokens: None,
        usage: true,
        client_left: false,
    };
    // Never reported details (vLLM without --enable-prompt-tokens-details): nothing learned.
    let d = r.route(&req(1, 8), T0);
    r.on_routed(1, &req(1, 8), &d, T0);
    let d = r.route(&req(1, 8), T0);
    r.on_routed(2, &req(1, 8), &d, T0);
    r.on_completed(2, &without_details, T0);
    assert_eq!(r.stats().reported_prompt_tokens, 0);
    // Once it reported details, usage without them is vLLM's way of saying "0 cached".
    r.on_completed(1, &done_at(None, Some(64)), T0);
    let d = r.route(&req(1, 8), T0);
    r.on_routed(3, &req(1, 8), &d, T0);
    r.on_completed(3, &without_details, T0);
    // Request 1 was predicted cold and had 64 cached; request 3 was predicted fully cached.
    assert_eq!(r.stats().underpredicted_tokens, 64);
    assert_eq!(r.stats().overpredicted_tokens, 8 * 64);
}

/// A discovered pool (no static `endpoints`) fed by fleet states, as the filter's workers are.
mod fleet {
    use super::*;
    use crate::fleet::{EnvoyHealth, Fleet, FleetState, Host};
    use crate::metrics::LoraInfo;

    fn discovering() -> Router {
        Router::new(Config::try_from(RawConfig::default()).unwrap())
    }

    fn hosts(states: &[EnvoyHealth]) -> Vec<Host> {
        states
            .iter()
            .enumerate()
            .map(|(i, s)| Host {
                id: ep(i),
                envoy: *s,
                priority: 0,
                weight: 1,
            })
            .collect()
    }

    fn publish(fleet: &mut Fleet, loads: &[VllmMetrics]) -> FleetState {
        for (i, m) in loads.iter().enumerate() {
            fleet.on_metrics(&ep(i), m.clone(), T0);
        }
        fleet.publish(T0)
    }

    #[test]
    fn the_pool_is_what_the_fleet_state_says_and_departed_hosts_are_forgotten() {
        let mut r = discovering();
        assert!(r.endpoints().is_empty());
        let mut fleet = Fleet::new(r.config().health().clone());
        fleet.on_hosts(&hosts(&[EnvoyHealth::Serve; 3]));
        r.on_fleet(&publish(&mut fleet, &idle(3)));
        assert_eq!(r.endpoints().len(), 3);
        let d = r.route(&req(1, 8), T0);
        r.on_routed(1, &req(1, 8), &d, T0);
        let holder = d.best().unwrap().clone();
        let rest: Vec<Host> = hosts(&[EnvoyHealth::Serve; 3])
            .into_iter()
            .filter(|h| h.id != holder)
            .collect();
        fleet.on_hosts(&rest);
        r.on_fleet(&fleet.publish(T0));
        assert_eq!(r.endpoints().len(), 2);
        assert_eq!(r.index().entries(), 0, "the departed host's index entries are freed");
        let d = r.route(&req(1, 8), T0);
        assert!(d.best().is_some_and(|b| *b != holder));
        r.on_completed(1, &Completion::default(), T0);
    }

    #[test]
    fn excluded_and_draining_hosts_get_nothing_and_degraded_ones_only_when_alone() {
        let mut r = discovering();
        let mut fleet = Fleet::new(r.config().health().clone());
        let states = [
            EnvoyHealth::Excluded,
            EnvoyHealth::Draining,
            EnvoyHealth::Degraded,
            EnvoyHealth::Serve,
        ];
        fleet.on_hosts(&hosts(&states));
        // The only host Envoy fully serves is the busiest: it still wins.
        r.on_fleet(&publish(
            &mut fleet,
            &[idle(1)[0].clone(), load(0, 0, 0.0), load(0, 0, 0.0), load(50, 20, 0.7)],
        ));
        let d = r.route(&req(2, 8), T0);
        assert_eq!(d.endpoints, vec![ep(3)]);
        let reasons: Vec<Option<FilterReason>> = d.breakdown.iter().map(|b| b.filtered).collect();
        assert_eq!(
            reasons,
            vec![
                Some(FilterReason::ExcludedByEnvoy),
                Some(FilterReason::Draining),
                Some(FilterReason::Degraded),
                None
            ]
        );
        fleet.on_hosts(&hosts(&states[..3]));
        r.on_fleet(&fleet.publish(T0));
        assert_eq!(
            r.route(&req(2, 8), T0).endpoints,
            vec![ep(2)],
            "degraded when nothing else is left"
        );
    }

    #[test]
    fn models_split_the_pool_and_an_unknown_model_is_left_to_envoy() {
        let mut r = discovering();
        let mut fleet = Fleet::new(r.config().health().clone());
        fleet.on_hosts(&hosts(&[EnvoyHealth::Serve; 4]));
        for i in 0..4 {
            let name = if i < 2 { "m" } else { "other" };
            fleet.on_models(&ep(i), vec![name.to_string()]);
        }
        let mut loads = idle(4);
        loads[2].models = vec!["other".into()];
        loads[3].models = vec!["other".into()];
        r.on_fleet(&publish(&mut fleet, &loads));
        for p in 0..20 {
            let d = r.route(&req(p, 4), T0);
            assert!(d.endpoints.iter().all(|e| *e == ep(0) || *e == ep(1)), "{d:?}");
        }
        let mut unknown = req(1, 4);
        unknown.model = "nobody-serves-this".into();
        let d = r.route(&unknown, T0);
        assert_eq!(d.outcome, Outcome::Fallback(FallbackReason::UnknownModel));
        assert!(d.endpoints.is_empty());
        // No model named (vLLM serves it with its first model): routed, on any server.
        let mut unnamed = req(1, 4);
        unnamed.model = String::new();
        let d = r.route(&unnamed, T0);
        assert_eq!(d.outcome, Outcome::Cold, "{d:?}");
        assert!(d.breakdown.iter().all(|b| b.filtered.is_none()), "{d:?}");
    }

    #[test]
    fn a_lora_adapter_goes_where_it_is_loaded_and_never_to_a_server_with_no_slot() {
        let mut r = discovering();
        let mut fleet = Fleet::new(r.config().health().clone());
        fleet.on_hosts(&hosts(&[EnvoyHealth::Serve; 3]));
        let lora = |running: &[&str]| LoraInfo {
            max_lora: 2,
            running: running.iter().map(|s| s.to_string()).collect(),
            waiting: vec![],
        };
        let mut loads = vec![load(2, 0, 0.2), load(0, 0, 0.0), load(0, 0, 0.0)];
        loads[0].lora = Some(lora(&["sql"]));
        loads[1].lora = Some(lora(&["a", "b"]));
        loads[2].lora = Some(lora(&[]));
        for i in 0..3 {
            fleet.on_models(&ep(i), vec!["m".into(), "sql".into(), "a".into(), "b".into()]);
        }
        r.on_fleet(&publish(&mut fleet, &loads));
        let mut sql = req(3, 4);
        sql.model = "sql".into();
        let d = r.route(&sql, T0);
        assert_eq!(
            d.best(),
            Some(&ep(0)),
            "loaded beats a slightly idler server that must load it"
        );
        assert_eq!(d.breakdown[1].filtered, Some(FilterReason::LoraSlotsFull));
        assert!(!d.endpoints.contains(&ep(1)));
    }
}

#[test]
fn a_server_whose_metrics_say_it_prefills_three_times_slower_loses_its_share() {
    let mut r = router(PolicyKind::Cost, &idle(2));
    // Each scrape, 400 ms apart: both servers computed 4,000 prompt tokens; the fast one
    // in 0.1 s of prefill, the slow one in 0.3 s.
    let mut counters = [(0.0, 0.0); 2];
    let mut now = T0;
    for _ in 0..10 {
        now = now.plus(400);
        for (s, seconds) in [(0usize, 0.1), (1, 0.3)] {
            counters[s].0 += 4000.0;
            counters[s].1 += seconds;
            let m = VllmMetrics {
                prefill_computed_tokens: Some(counters[s].0),
                prefill_seconds: Some(counters[s].1),
                ..idle(1)[0].clone()
            };
            r.on_metrics(&ep(s), m, now);
        }
    }
    let fast = r.endpoints()[0].speed.learned(now).unwrap();
    assert!((39_000.0..41_000.0).contains(&fast), "learned {fast}");
    let picks: Vec<EndpointId> = (0..20)
        .filter_map(|p| r.route(&req(500 + p, 40), now).best().cloned())
        .collect();
    assert!(
        picks.iter().all(|e| *e == ep(0)),
        "the slow server still gets cold prefixes: {picks:?}"
    );
    let mut constant = Router::new(
        Config::try_from(RawConfig {
            endpoints: vec![ep(0).to_string(), ep(1).to_string()],
            cost: crate::config::RawCost {
                learn_speeds: false,
                ..Default::default()
            },
            ..RawConfig::default()
        })
        .unwrap(),
    );
    for (s, seconds) in [(0usize, 1.0), (1, 3.0)] {
        let m = |t: f64| VllmMetrics {
            prefill_computed_tokens: Some(40_000.0 * t),
            prefill_seconds: Some(seconds * t),
            ..idle(1)[0].clone()
        };
        for k in 0..10 {
            constant.on_metrics(&ep(s), m(f64::from(k)), T0);
        }
    }
    let spread: std::collections::BTreeSet<EndpointId> = (0..20)
        .filter_map(|p| constant.route(&req(500 + p, 40), T0).best().cloned())
        .collect();
    assert_eq!(spread.len(), 2, "without learning both servers look alike");
}

/// Servers 0-1 in tier 0 (cheap), 2-3 in tier 1, with this objective.
fn tiered(objective_ms: f64, loads: &[VllmMetrics]) -> Router {
    tiered_with_slots(objective_ms, loads, &[])
}

/// `tiered`, with each tier's sequence slots (`tiers.max_num_seqs`).
fn tiered_with_slots(objective_ms: f64, loads: &[VllmMetrics], slots: &[u32]) -> Router {
    let mut raw = RawConfig {
        endpoints: (0..4).map(|i| format!("10.0.0.{i}:8000")).collect(),
        ..RawConfig::default()
    };
    raw.tiers.endpoints = [(2, 1), (3, 1)].map(|(i, t)| (format!("10.0.0.{i}:8000"), t)).into();
    raw.tiers.ttft_objective_ms = objective_ms;
    raw.tiers.max_num_seqs = slots.to_vec();
    let mut r = Router::new(Config::try_from(raw).unwrap());
    for (i, m) in loads.iter().enumerate() {
        r.on_metrics(&ep(i), m.clone(), T0);
    }
    r
}

#[test]
fn tiers_fill_the_cheap_tier_first_and_spill_only_when_it_would_miss() {
    // The premium tier is idle, the cheap one busy but within the objective: stay cheap.
    let busy = [load(8, 0, 0.3), load(8, 0, 0.3), load(0, 0, 0.0), load(0, 0, 0.0)];
    let d = tiered(1000.0, &busy).route(&req(1, 32), T0);
    assert!(
        d.best() == Some(&ep(0)) || d.best() == Some(&ep(1)),
        "{:?}",
        d.endpoints
    );
    let t = d.tier.unwrap();
    assert_eq!((t.tier, t.spilled, t.met), (0, false, true));
    assert_eq!(d.endpoints.len(), 3);
    assert!(
        [ep(2), ep(3)].contains(&d.endpoints[2]),
        "the other tier stays as a retry"
    );
    // Without tiers the idle premium server wins on predicted TTFT.
    let untiered = router(PolicyKind::Cost, &busy).route(&req(1, 32), T0);
    assert!([ep(2), ep(3)].contains(untiered.best().unwrap()));

    // The cheap tier is swamped past the objective: spill to premium.
    let swamped = [load(60, 40, 0.7), load(60, 40, 0.7), load(0, 0, 0.0), load(0, 0, 0.0)];
    // Predicted TTFT: ≈ 1236 ms on the cheap servers, ≈ 206 ms (the prefill) on premium.
    let r = tiered(500.0, &swamped);
    let d = r.route(&req(2, 32), T0);
    assert!(
        d.best() == Some(&ep(2)) || d.best() == Some(&ep(3)),
        "{:?}",
        d.endpoints
    );
    assert_eq!(d.tier.map(|t| (t.tier, t.spilled, t.met)), Some((1, true, true)));

    // A tight per-request objective nothing meets: no spill.
    let mut tight = req(3, 32);
    tight.ttft_objective_ms = Some(0.001);
    let d = r.route(&tight, T0);
    assert!(
        d.best() == Some(&ep(0)) || d.best() == Some(&ep(1)),
        "{:?}",
        d.endpoints
    );
    assert_eq!(d.tier.map(|t| (t.tier, t.spilled, t.met)), Some((0, false, false)));
}

#[test]
fn with_nothing_within_the_planned_share_the_cheapest_tier_within_the_whole_objective_serves() {
    // Predicted TTFT ≈ 1133 ms on the swamped cheap servers, ≈ 875 ms on the busy premium
    // ones; the tier rule plans for 60% of the objective.
    let loads = [
        load(60, 40, 0.7),
        load(60, 40, 0.7),
        load(30, 30, 0.7),
        load(30, 30, 0.7),
    ];
    let ttft: Vec<f64> = tiered(1000.0, &loads)
        .route(&req(1, 32), T0)
        .breakdown
        .iter()
        .map(|s| s.ttft_ms)
        .collect();
    assert!(ttft[..2].iter().all(|t| *t > 1000.0), "{ttft:?}");
    assert!(ttft[2..].iter().all(|t| *t > 600.0 && *t < 1000.0), "{ttft:?}");
    let tier = |objective_ms: f64| {
        let d = tiered(objective_ms, &loads).route(&req(1, 32), T0);
        (d.tier.map(|t| (t.tier, t.spilled, t.met)), d.best().cloned())
    };
    // 1000 ms: nothing within 600 ms, the premium tier within 1000 ms: spill there.
    let (tiering, best) = tier(1000.0);
    assert_eq!(tiering, Some((1, true, true)));
    assert!(best == Some(ep(2)) || best == Some(ep(3)), "{best:?}");
    // 2000 ms: the cheap tier is within 1200 ms and keeps it.
    assert_eq!(tier(2000.0).0, Some((0, false, true)));
    // 700 ms: nothing within the objective either. The request would meet it on an idle
    // server, so the tiers step aside and the cost decides: the premium tier.
    let (tiering, best) = tier(700.0);
    assert_eq!(tiering, Some((1, true, false)));
    assert!(best == Some(ep(2)) || best == Some(ep(3)), "{best:?}");
}

#[test]
fn with_nothing_within_the_objective_the_cost_decides_unless_the_request_fits_nowhere() {
    // Predicted TTFT ≈ 874 ms on a busy server, over 2 s on a swamped one (costs far enough
    // apart that no cold-prefix owner is drawn across them); the objective is 700 ms.
    let (busy, swamped) = (load(30, 30, 0.7), load(90, 80, 0.7));
    let tier = |loads: [&VllmMetrics; 4], blocks: usize| {
        let loads: Vec<VllmMetrics> = loads.into_iter().cloned().collect();
        let d = tiered(700.0, &loads).route(&req(1, blocks), T0);
        assert!(d.breakdown.iter().all(|s| s.ttft_ms > 700.0), "{:?}", d.breakdown);
        (d.tier.map(|t| (t.tier, t.spilled, t.met)), d.best().cloned())
    };
    let swamped_cheap = [&swamped, &swamped, &busy, &busy];
    let (tiering, best) = tier(swamped_cheap, 32);
    assert_eq!(tiering, Some((1, true, false)));
    assert!(best == Some(ep(2)) || best == Some(ep(3)), "{best:?}");
    // The other way round the cheap tier scores best and keeps the request.
    let (tiering, best) = tier([&busy, &busy, &swamped, &swamped], 32);
    assert_eq!(tiering, Some((0, false, false)));
    assert!(best == Some(ep(0)) || best == Some(ep(1)), "{best:?}");
    // A prompt of 25,610 tokens takes ≈ 1280 ms even on an idle server: it fits nowhere and
    // does not spill, however the tiers are loaded, though the cost alone would place it
    // in the premium tier.
    let (tiering, best) = tier(swamped_cheap, 400);
    assert_eq!(tiering, Some((0, false, false)));
    assert!(best == Some(ep(0)) || best == Some(ep(1)), "{best:?}");
    let loads: Vec<VllmMetrics> = swamped_cheap.into_iter().cloned().collect();
    let untiered = router(PolicyKind::Cost, &loads).route(&req(1, 400), T0);
    assert!([ep(2), ep(3)].contains(untiered.best().unwrap()));
}

#[test]
fn whether_a_request_fits_an_idle_server_is_not_scaled_by_what_busy_servers_taught() {
    // Every server has learned that its first tokens come far later than predicted (5 s
    // after routing, 8× per sample at most); then nothing meets 700 ms. A 32-block prompt
    // (≈ 100 ms of prefill) still fits an idle server, so the cost decides: the busy
    // premium tier, not the swamped cheap one.
    let light = light_loads();
    let mut r = tiered(700.0, &light);
    let mut at = T0;
    let mut id = 0;
    for _ in 0..5 {
        for server in 0..4 {
            id += 1;
            for (i, m) in light.iter().enumerate() {
                r.on_metrics(&ep(i), m.clone(), at);
            }
            route_to(&mut r, id, &req(id, 32), server, at);
            r.on_first_token(id, at.plus(5_000));
            r.on_completed(id, &Completion::default(), at.plus(5_000));
        }
        at = at.plus(5_000);
    }
    assert!(r.endpoints().iter().all(|e| e.ttft_bias.factor(at) > 7.0));
    let (busy, swamped) = (load(30, 30, 0.7), load(90, 80, 0.7));
    for (i, m) in [&swamped, &swamped, &busy, &busy].into_iter().enumerate() {
        r.on_metrics(&ep(i), m.clone(), at);
    }
    let d = r.route(&req(99, 32), at);
    assert_eq!(d.tier.map(|t| (t.tier, t.spilled, t.met)), Some((1, true, false)));
}

#[test]
fn tiers_plan_for_the_share_of_the_objective_given() {
    // Predicted TTFT ≈ 1236 ms on the busy cheap servers, ≈ 206 ms on the idle premium ones.
    let swamped = [load(60, 40, 0.7), load(60, 40, 0.7), load(0, 0, 0.0), load(0, 0, 0.0)];
    let tier = |share: f64, own: Option<f64>| {
        let mut raw = RawConfig {
            endpoints: (0..4).map(|i| format!("10.0.0.{i}:8000")).collect(),
            ..RawConfig::default()
        };
        raw.tiers.endpoints = [(2, 1), (3, 1)].map(|(i, t)| (format!("10.0.0.{i}:8000"), t)).into();
        raw.tiers.ttft_objective_ms = 1500.0;
        raw.tiers.objective_share = share;
        let mut r = Router::new(Config::try_from(raw).unwrap());
        for (i, m) in swamped.iter().enumerate() {
            r.on_metrics(&ep(i), m.clone(), T0);
        }
        let mut q = req(1, 32);
        q.ttft_objective_ms = own;
        r.route(&q, T0).tier.map(|t| (t.tier, t.spilled))
    };
    assert_eq!(tier(1.0, None), Some((0, false)), "1236 ms meets 1500 ms");
    assert_eq!(tier(0.6, None), Some((1, true)), "1236 ms misses 60% of 1500 ms");
    assert_eq!(
        tier(0.6, Some(1500.0)),
        Some((1, true)),
        "a request's own objective too"
    );
    assert_eq!(tier(0.6, Some(3000.0)), Some((0, false)));

    for bad in [0.0, 0.05, -0.5, 1.5, f64::NAN] {
        let mut raw = RawConfig::default();
        raw.tiers.endpoints = [("10.0.0.2:8000".to_string(), 1)].into();
        raw.tiers.objective_share = bad;
        assert_eq!(Config::try_from(raw).unwrap_err().field, "tiers.objective_share");
    }
    let mut untiered = RawConfig::default();
    untiered.tiers.objective_share = 0.8;
    let err = Config::try_from(untiered).unwrap_err();
    assert_eq!(err.field, "tiers.objective_share", "no effect without tiers");
}

/// Servers 0-1 (the cheap tier) lightly loaded, 2-3 idle.
fn light_loads() -> [VllmMetrics; 4] {
    [load(1, 0, 0.2), load(1, 0, 0.2), load(0, 0, 0.0), load(0, 0, 0.0)]
}

/// Routes request `id` as `r` would, then sends it to `server` whatever `r` chose.
fn route_to(r: &mut Router, id: u64, q: &RouteRequest, server: usize, at: Millis) {
    let mut d = r.route(q, at);
    d.endpoints = vec![ep(server)];
    r.on_routed(id, q, &d, at);
}

/// Servers 0 and 1 (the cheap tier) each given one request of `req(id, 32)`'s size at T0:
/// this router's own (`timed`: a stream), or a peer's.
fn cheap_servers_with_a_request_each(own: bool, timed: bool) -> Router {
    cheap_servers_with_a_request_each_and_slots(own, timed, &[])
}

/// `cheap_servers_with_a_request_each`, with each tier's sequence slots (`tiers.max_num_seqs`).
fn cheap_servers_with_a_request_each_and_slots(own: bool, timed: bool, slots: &[u32]) -> Router {
    let light = light_loads();
    let mut r = tiered_with_slots(500.0, &light, slots);
    for (id, server) in [(1, 0), (2, 1)] {
        let mut q = req(id, 32);
        q.first_token_timed = timed;
        if own {
            route_to(&mut r, id, &q, server, T0);
        } else {
            r.on_peer_event(
                &PeerEvent::Routed {
                    key: crate::peer::request_key(7, id),
                    endpoint: ep(server),
                    blocks: q.blocks.clone(),
                    prompt_tokens: q.prompt_tokens,
                    uncached: q.prompt_tokens,
                    at: T0,
                },
                T0,
            );
        }
    }
    r
}

#[test]
fn a_cheap_server_whose_request_waits_past_the_objective_no_longer_meets_it() {
    // Both cheap servers look light, but each holds a request of ours without a first token
    // (a server out of sequences or KV keeps new work waiting whatever its scrape says).
    let r = cheap_servers_with_a_request_each(true, true);
    let soon = r.route(&req(3, 32), T0.plus(100));
    assert_eq!(
        soon.tier.map(|t| (t.tier, t.spilled)),
        Some((0, false)),
        "waited less than the objective"
    );
    // The prediction alone still meets the objective there: the wait made the difference.
    spilled_though_the_cheap_prediction_meets(&r.route(&req(4, 32), T0.plus(600)));
}

/// `d` went to a premium server (2 or 3) though server 0's predicted TTFT meets the share of
/// the 500 ms objective the rule plans for.
fn spilled_though_the_cheap_prediction_meets(d: &Decision) {
    assert_eq!(
        d.tier.map(|t| (t.tier, t.spilled, t.met)),
        Some((1, true, true)),
        "{:?}",
        d.endpoints
    );
    assert!([ep(2), ep(3)].contains(d.best().unwrap()));
    let cheap = d.breakdown.iter().find(|s| s.endpoint == ep(0)).unwrap();
    assert!(cheap.ttft_ms < 500.0 * 0.6, "{}", cheap.ttft_ms);
}

#[test]
fn the_floor_lifts_once_the_waiting_request_has_its_first_token_or_ends() {
    // Server 0's request gets its first token, server 1's ends without one (a reset): both
    // cheap servers meet the objective again.
    let mut r = cheap_servers_with_a_request_each(true, true);
    assert_eq!(r.route(&req(3, 32), T0.plus(600)).tier.map(|t| t.tier), Some(1));
    r.on_first_token(1, T0.plus(600));
    r.on_completed(2, &Completion::default(), T0.plus(600));
    for (i, e) in r.endpoints().iter().enumerate().take(2) {
        assert_eq!(e.oldest_pending_ms(T0.plus(700)), 0, "server {i}");
    }
    let d = r.route(&req(4, 32), T0.plus(700));
    assert_eq!(
        d.tier.map(|t| (t.tier, t.spilled)),
        Some((0, false)),
        "{:?}",
        d.endpoints
    );
}

#[test]
fn only_our_own_timed_first_tokens_set_the_floor() {
    // A peer's request (its first token may be lost on the way here) and a whole response
    // of ours (its first token comes with its last) waiting as long change nothing.
    for (own, timed) in [(false, true), (true, false)] {
        let r = cheap_servers_with_a_request_each(own, timed);
        let d = r.route(&req(4, 32), T0.plus(600));
        assert_eq!(
            d.tier.map(|t| (t.tier, t.spilled)),
            Some((0, false)),
            "own {own}, timed {timed}: {:?}",
            d.endpoints
        );
    }
}

#[test]
fn a_cheap_server_with_every_sequence_slot_taken_does_not_meet_the_objective() {
    // Each cheap server runs one request (a peer's: the floor leaves it out) and looks light.
    // With two slots per cheap server a new request stays cheap; with one it spills to a
    // premium server, whose one slot is free.
    let roomy = cheap_servers_with_a_request_each_and_slots(false, true, &[2, 1]);
    let d = roomy.route(&req(4, 32), T0.plus(100));
    assert_eq!(
        d.tier.map(|t| (t.tier, t.spilled)),
        Some((0, false)),
        "{:?}",
        d.endpoints
    );
    // The prediction alone meets the objective on the cheap servers: the slots decided.
    let full = cheap_servers_with_a_request_each_and_slots(false, true, &[1, 1]);
    spilled_though_the_cheap_prediction_meets(&full.route(&req(4, 32), T0.plus(100)));
}

#[test]
fn a_tiers_slots_are_full_at_its_count_and_unlimited_at_0_or_past_the_list() {
    let mut t = RawConfig::default().tiers;
    t.max_num_seqs = vec![2, 0];
    assert!(!t.full(0, 1));
    assert!(t.full(0, 2));
    assert!(t.full(0, 3));
    assert!(!t.full(1, 10_000), "0 is no limit");
    assert!(!t.full(2, 10_000), "a tier past the list has no limit");
}

#[test]
fn only_streamed_first_tokens_teach_the_tiers_scaling() {
    // Five requests on server 0 whose first token came 5 s after routing: a stream's says the
    // prediction ran short; a whole response's only that its generation took 5 s.
    for timed in [true, false] {
        let light = light_loads();
        let mut r = tiered(500.0, &light);
        let mut at = T0;
        for id in 1..=5 {
            for (i, m) in light.iter().enumerate() {
                r.on_metrics(&ep(i), m.clone(), at);
            }
            let mut q = req(id, 32);
            q.first_token_timed = timed;
            route_to(&mut r, id, &q, 0, at);
            r.on_first_token(id, at.plus(5_000));
            r.on_completed(id, &Completion::default(), at.plus(5_000));
            at = at.plus(5_000);
        }
        let factor = r.endpoints()[0].ttft_bias.factor(at);
        assert_eq!(factor > 1.0, timed, "timed {timed}: factor {factor}");
    }
}

#[test]
fn a_peers_streamed_first_tokens_teach_the_tiers_scaling_too() {
    // Router a sends five streams to server 0 whose first tokens come 600 ms after routing
    // (a few times the prediction); router b, its peer, learns the same scaling from a's
    // events (within the samples' rounding to whole ms), and nothing from them when they
    // carry no sample.
    for with_samples in [true, false] {
        let light = light_loads();
        let (mut a, mut b) = (tiered(500.0, &light), tiered(500.0, &light));
        a.share_with_peers(1);
        b.share_with_peers(2);
        let mut at = T0;
        for id in 1..=5 {
            for (i, m) in light.iter().enumerate() {
                a.on_metrics(&ep(i), m.clone(), at);
                b.on_metrics(&ep(i), m.clone(), at);
            }
            let q = req(id, 32);
            route_to(&mut a, id, &q, 0, at);
            a.on_first_token(id, at.plus(600));
            a.on_completed(id, &Completion::default(), at.plus(600));
            at = at.plus(600);
            for mut ev in a.take_peer_events() {
                if let (false, PeerEvent::FirstToken { ttft, .. }) = (with_samples, &mut ev) {
                    *ttft = None;
                }
                b.on_peer_event(&ev, at);
            }
        }
        let own = a.endpoints()[0].ttft_bias.factor(at);
        let learned = b.endpoints()[0].ttft_bias.factor(at);
        assert!(own > 1.5 && own < 7.9, "a's own factor {own}, below the clamp");
        if with_samples {
            assert!((learned / own - 1.0).abs() < 0.02, "b learned {learned}, a {own}");
        } else {
            assert_eq!(learned, 1.0);
        }
    }
}

#[test]
fn a_first_token_from_another_server_teaches_nothing() {
    // A retry moved each stream off server 0: its late first token says nothing of server
    // 0's predictions, for this router or its peers.
    let light = light_loads();
    let mut a = tiered(500.0, &light);
    a.share_with_peers(1);
    let mut at = T0;
    for id in 1..=5 {
        let q = req(id, 32);
        route_to(&mut a, id, &q, 0, at);
        a.on_first_token_elsewhere(id, at.plus(600));
        at = at.plus(600);
    }
    assert_eq!(a.endpoints()[0].ttft_bias.factor(at), 1.0);
    let firsts: Vec<_> = a
        .take_peer_events()
        .into_iter()
        .filter_map(|e| match e {
            PeerEvent::FirstToken { ttft, .. } => Some(ttft),
            _ => None,
        })
        .collect();
    assert_eq!(
        firsts,
        vec![None; 5],
        "the peers hear of the first tokens, with no sample"
    );
}

/// A pool learned from Envoy whose servers 2-3 sit at priority 1, tiers from priorities.
fn tiered_by_priority(objective_ms: f64, loads: &[VllmMetrics]) -> Router {
    let mut raw = RawConfig::default();
    raw.tiers.from_priority = true;
    raw.tiers.ttft_objective_ms = objective_ms;
    let mut r = Router::new(Config::try_from(raw).unwrap());
    apply_discovered(&mut r, loads, |i| (u32::from(i >= 2), 1));
    r
}

/// Gives `r` a pool learned from Envoy: server `i` with `loads[i]` and the (priority,
/// load-balancing weight) `of(i)`.
fn apply_discovered(r: &mut Router, loads: &[VllmMetrics], of: impl Fn(usize) -> (u32, u32)) {
    let members = loads
        .iter()
        .enumerate()
        .map(|(i, m)| crate::fleet::Member {
            id: ep(i),
            envoy: EnvoyHealth::Serve,
            priority: of(i).0,
            weight: of(i).1,
            scrape_healthy: true,
            scraped_at: Some(T0),
            metrics: Some(m.clone()),
            models: None,
        })
        .collect();
    r.on_fleet(&crate::FleetState {
        version: 1,
        published_at: T0,
        members,
    });
}

#[test]
fn tiers_can_be_the_pool_clusters_priorities() {
    let busy = [load(8, 0, 0.3), load(8, 0, 0.3), load(0, 0, 0.0), load(0, 0, 0.0)];
    let d = tiered_by_priority(1000.0, &busy).route(&req(1, 32), T0);
    assert!([ep(0), ep(1)].contains(d.best().unwrap()), "{:?}", d.endpoints);
    assert_eq!(d.tier.map(|t| (t.tier, t.spilled)), Some((0, false)));
    let swamped = [load(60, 40, 0.7), load(60, 40, 0.7), load(0, 0, 0.0), load(0, 0, 0.0)];
    let d = tiered_by_priority(500.0, &swamped).route(&req(2, 32), T0);
    assert!([ep(2), ep(3)].contains(d.best().unwrap()), "{:?}", d.endpoints);
    assert_eq!(d.tier.map(|t| (t.tier, t.spilled, t.met)), Some((1, true, true)));
}

#[test]
fn tiers_from_priorities_need_a_discovered_pool_and_no_map() {
    let mut raw = RawConfig::default();
    raw.tiers.from_priority = true;
    raw.tiers.endpoints.insert("10.0.0.1:8000".into(), 1);
    assert_eq!(Config::try_from(raw.clone()).unwrap_err().field, "tiers.from_priority");
    raw.tiers.endpoints.clear();
    raw.endpoints = vec!["10.0.0.1:8000".into()];
    assert_eq!(Config::try_from(raw.clone()).unwrap_err().field, "tiers.from_priority");
    raw.endpoints.clear();
    assert!(Config::try_from(raw.clone()).is_ok());
    raw.policy = PolicyKind::Weighted;
    assert_eq!(Config::try_from(raw).unwrap_err().field, "tiers.from_priority");
}

#[test]
fn tiers_need_the_cost_policy_and_small_tier_numbers() {
    let mut raw = RawConfig {
        policy: PolicyKind::Weighted,
        ..RawConfig::default()
    };
    raw.tiers.endpoints.insert("10.0.0.1:8000".into(), 1);
    assert_eq!(Config::try_from(raw.clone()).unwrap_err().field, "tiers.endpoints");
    raw.policy = PolicyKind::Cost;
    raw.tiers.endpoints.insert("10.0.0.2:8000".into(), 16);
    assert_eq!(Config::try_from(raw.clone()).unwrap_err().field, "tiers.endpoints");
    raw.tiers.endpoints.remove("10.0.0.2:8000");
    raw.tiers.max_num_seqs = vec![256; 17];
    assert_eq!(Config::try_from(raw.clone()).unwrap_err().field, "tiers.max_num_seqs");
    raw.tiers.max_num_seqs = vec![256, 1024];
    assert!(Config::try_from(raw.clone()).is_ok());
    raw.tiers.ttft_objective_ms = 0.0;
    assert_eq!(Config::try_from(raw).unwrap_err().field, "tiers.ttft_objective_ms");
    let mut untiered = RawConfig::default();
    untiered.tiers.max_num_seqs = vec![256];
    assert_eq!(Config::try_from(untiered).unwrap_err().field, "tiers.max_num_seqs");
}

fn holding(loads: &[VllmMetrics]) -> Router {
    let mut raw = RawConfig {
        endpoints: (0..loads.len()).map(|i| format!("10.0.0.{i}:8000")).collect(),
        ..RawConfig::default()
    };
    raw.overload.hold.max_wait_ms = 5_000;
    raw.overload.hold.wait_limit_ms = 500;
    let mut r = Router::new(Config::try_from(raw).unwrap());
    for (i, m) in loads.iter().enumerate() {
        r.on_metrics(&ep(i), m.clone(), T0);
    }
    r
}

/// Routes distinct long prompts until the router holds one; how many it routed.
fn fill(r: &mut Router) -> u64 {
    for id in 0..1000 {
        let q = req(id + 100, 32);
        let d = r.route(&q, T0);
        if d.outcome == Outcome::Hold {
            return id;
        }
        r.on_routed(id, &q, &d, T0);
    }
    panic!("never full");
}

#[test]
fn with_holding_on_a_request_waits_once_every_server_has_its_limit_of_prefill() {
    let mut r = holding(&[load(0, 0, 0.1), load(0, 0, 0.1)]);
    let routed = fill(&mut r);
    // 32 blocks of 64 tokens: about 100 ms of prefill each at the default 20,000 tokens/s;
    // a server is full at 500 ms of it.
    assert!(
        (8..=14).contains(&routed),
        "both servers fill from the gateway's own sends, without a new scrape: {routed}"
    );
    let d = r.route(&req(1, 8), T0);
    assert_eq!(d.outcome, Outcome::Hold);
    assert!(d.endpoints.is_empty(), "a held request goes nowhere yet");
    let mut low = req(1, 8);
    low.sheddable = true;
    assert_eq!(
        r.route(&low, T0).outcome,
        Outcome::Hold,
        "a sheddable request waits too (at a lower weight)"
    );
}

/// Sends short prompts (`timed`: as streams or not) until each of two servers has one.
fn one_each(r: &mut Router, timed: bool) {
    let mut seen = std::collections::BTreeSet::new();
    for id in 0..100 {
        let mut q = req(id + 100, 4);
        q.first_token_timed = timed;
        let d = r.route(&q, T0);
        assert_ne!(d.outcome, Outcome::Hold);
        r.on_routed(id, &q, &d, T0);
        seen.insert(d.best().cloned().unwrap());
        if seen.len() == 2 {
            return;
        }
    }
    panic!("one server took every prompt");
}

#[test]
fn a_server_whose_oldest_stream_waits_past_its_own_prefill_by_the_limit_is_full() {
    // A short stream on each server: predicted prefill far below the 500 ms limit. 600 ms
    // later none has a first token (both stopped admitting: KV cache or slots full).
    let later = T0.plus(600);
    let mut r = holding(&[load(0, 0, 0.1), load(0, 0, 0.1)]);
    one_each(&mut r, true);
    for i in 0..2 {
        r.on_metrics(&ep(i), load(1, 0, 0.1), later);
    }
    assert_eq!(
        r.route(&req(1, 8), later).outcome,
        Outcome::Hold,
        "both servers stalled"
    );
    // A non-streamed request's first token comes with its last: its wait says nothing.
    let mut r = holding(&[load(0, 0, 0.1), load(0, 0, 0.1)]);
    one_each(&mut r, false);
    for i in 0..2 {
        r.on_metrics(&ep(i), load(1, 0, 0.1), later);
    }
    assert_ne!(r.route(&req(1, 8), later).outcome, Outcome::Hold);
}

#[test]
fn a_first_token_gives_its_server_room_again() {
    let mut r = holding(&[load(0, 0, 0.1), load(0, 0, 0.1)]);
    let routed = fill(&mut r);
    let on_first: Vec<EndpointId> = (0..routed)
        .filter_map(|id| {
            r.on_first_token(id, T0.plus(50));
            let d = r.route(&req(1, 8), T0.plus(50));
            (d.outcome != Outcome::Hold).then(|| d.best().cloned()).flatten()
        })
        .take(1)
        .collect();
    assert_eq!(on_first.len(), 1, "one first token makes room on its server");
    let mut off = RawConfig {
        endpoints: vec!["10.0.0.0:8000".into()],
        ..RawConfig::default()
    };
    off.overload.hold.max_wait_ms = 0;
    let mut r = Router::new(Config::try_from(off).unwrap());
    r.on_metrics(&ep(0), load(200, 60, 0.9), T0);
    for id in 0..40 {
        let d = r.route(&req(id + 100, 32), T0);
        assert_ne!(d.outcome, Outcome::Hold, "holding is off by default");
        r.on_routed(id, &req(id + 100, 32), &d, T0);
    }
}

#[test]
fn the_prompt_in_prefill_makes_room_for_a_held_request_as_it_progresses() {
    let mut r = holding(&[load(0, 0, 0.1)]);
    // Three prompts of 64 blocks prefilled one after another, 100 ms each: the pace.
    let mut at = T0;
    for id in 1..=3 {
        let q = req(id, 64);
        let d = r.route(&q, at);
        r.on_routed(id, &q, &d, at);
        at = at.plus(100);
        r.on_first_token(id, at);
        r.on_completed(id, &done_at(Some(ep(0)), None), at);
    }
    // Prompts of 32 blocks (about 100 ms each at the configured 20,000 tokens/s) until the
    // server holds 500 ms of them.
    let mut id = 10;
    loop {
        let q = req(id + 100, 32);
        let d = r.route(&q, at);
        if d.outcome == Outcome::Hold {
            break;
        }
        r.on_routed(id, &q, &d, at);
        id += 1;
    }
    // No first token yet, but 400 ms on the oldest is past its prefill at the pace the
    // earlier ones showed: the hold counts it done (as the cost does), and there is room.
    let d = r.route(&req(1, 8), at.plus(400));
    assert_ne!(d.outcome, Outcome::Hold, "room once the prompt in prefill is credited");
    assert_eq!(d.best(), Some(&ep(0)));
}

fn served(at: &EndpointId, status: u16) -> Completion {
    Completion {
        served_by: Some(at.clone()),
        status,
        cached_tokens: None,
        prompt_tokens: None,
        usage: false,
        client_left: false,
    }
}

/// Routers with `overload.refused_ms` 1000 (off by default), holding on when `hold`.
fn refusing_router(loads: &[VllmMetrics], hold: bool) -> Router {
    let mut raw = RawConfig {
        endpoints: (0..loads.len()).map(|i| format!("10.0.0.{i}:8000")).collect(),
        ..RawConfig::default()
    };
    raw.overload.refused_ms = 1_000;
    if hold {
        raw.overload.hold.max_wait_ms = 5_000;
        raw.overload.hold.wait_limit_ms = 500;
    }
    let mut r = Router::new(Config::try_from(raw).unwrap());
    for (i, m) in loads.iter().enumerate() {
        r.on_metrics(&ep(i), m.clone(), T0);
    }
    r
}

#[test]
fn a_server_that_refused_a_request_goes_last_for_a_while() {
    let mut r = refusing_router(&idle(3), false);
    let d = r.route(&req(5, 16), T0);
    r.on_routed(1, &req(5, 16), &d, T0);
    let refused = d.best().unwrap().clone();
    let retried = d.endpoints[1].clone();
    // Envoy retried it on the next server of the decision after the first answered 503.
    r.on_completed(1, &served(&retried, 200), T0);
    assert_eq!(r.stats().refusals, 1);
    for k in 0..20 {
        let d = r.route(&req(100 + k, 16), T0.plus(10));
        assert_ne!(d.best(), Some(&refused), "a server that just refused is not chosen");
        let row = d.breakdown.iter().find(|s| s.endpoint == refused).unwrap();
        assert_eq!(row.filtered, Some(FilterReason::Refusing));
    }
    for i in 0..3 {
        r.on_metrics(&ep(i), load(0, 0, 0.0), T0.plus(1_000));
    }
    let back = (0..20).any(|k| r.route(&req(200 + k, 16), T0.plus(1_001)).best() == Some(&refused));
    assert!(back, "after overload.refused_ms it takes work again");
}

#[test]
fn when_every_server_refused_the_request_still_goes_somewhere() {
    let mut r = refusing_router(&idle(2), false);
    for (id, at) in [(1, ep(0)), (2, ep(1))] {
        let d = r.route(&req(id, 16), T0);
        r.on_routed(id, &req(id, 16), &d, T0);
        r.on_completed(id, &served(&at, 503), T0);
    }
    let d = r.route(&req(3, 16), T0.plus(10));
    assert_eq!(d.endpoints.len(), 2, "both, the least bad first: {:?}", d.outcome);
}

#[test]
fn by_default_refusals_change_no_order_and_eject_nobody() {
    let mut r = router(PolicyKind::Cost, &idle(2));
    for id in 1..=5 {
        let d = r.route(&req(id, 16), T0);
        r.on_routed(id, &req(id, 16), &d, T0);
        r.on_completed(id, &served(&ep(0), 503), T0);
    }
    let d = r.route(&req(9, 16), T0.plus(10));
    assert!(d.breakdown.iter().all(|s| s.filtered.is_none()), "{:?}", d.breakdown);
    assert!(r.endpoints().iter().all(|e| e.health.may_serve(T0.plus(10))));
}

#[test]
fn refusals_alone_never_hold_a_request() {
    let mut r = refusing_router(&[load(0, 0, 0.1), load(0, 0, 0.1)], true);
    for (id, at) in [(1, ep(0)), (2, ep(1))] {
        let d = r.route(&req(id, 2), T0);
        r.on_routed(id, &req(id, 2), &d, T0);
        r.on_completed(id, &served(&at, 503), T0);
    }
    assert!(r.endpoints().iter().all(|e| e.refusing(T0.plus(10))));
    assert_ne!(r.route(&req(3, 2), T0.plus(10)).outcome, Outcome::Hold);
}

/// A cost-policy router over servers 0 and 1 with `configure` applied to its config.
fn two_servers(configure: impl FnOnce(&mut RawConfig)) -> Router {
    let mut raw = RawConfig {
        endpoints: vec!["10.0.0.0:8000".into(), "10.0.0.1:8000".into()],
        ..RawConfig::default()
    };
    configure(&mut raw);
    Router::new(Config::try_from(raw).unwrap())
}

/// Short prompts routed to server 0 of two idle ones wait there for their first token; a
/// cold 64-block prompt (4,106 tokens) is then scored on both. Returns server 0's extra
/// cost and extra predicted TTFT over server 1.
fn long_prompt_beside_waiting(waiting: u64, configure: impl FnOnce(&mut RawConfig)) -> (f64, f64) {
    let mut r = two_servers(configure);
    for i in 0..2 {
        r.on_metrics(&ep(i), load(0, 0, 0.0), T0);
    }
    for id in 1..=waiting {
        let short = req(id, 1);
        route_to(&mut r, id, &short, 0, T0);
    }
    let d = r.route(&req(9, 64), T0);
    let row = |i: usize| d.breakdown.iter().find(|s| s.endpoint == ep(i)).unwrap().clone();
    (row(0).cost.0 - row(1).cost.0, row(0).ttft_ms - row(1).ttft_ms)
}

fn default_prefill_rate() -> f64 {
    Config::try_from(RawConfig::default())
        .unwrap()
        .cost()
        .prefill_tokens_per_s
}

#[test]
fn a_long_prompt_is_charged_for_the_waiting_requests_it_would_join() {
    let extra = |weight: f64, waiting: u64| long_prompt_beside_waiting(waiting, |raw| raw.cost.pending_weight = weight);
    let own_ms = (64.0 * 64.0 + 10.0) * 1000.0 / default_prefill_rate();
    let (off, ttft_off) = extra(0.0, 1);
    let (one, ttft_one) = extra(0.5, 1);
    assert!((one - off - 0.5 * own_ms).abs() < 1e-6, "one waiting: {off} -> {one}");
    assert_eq!(ttft_one, ttft_off, "the predicted TTFT is unchanged");
    // A third waiting request is done before the new prompt starts: two count at most.
    let (off3, _) = extra(0.0, 3);
    let (on3, _) = extra(0.5, 3);
    assert!(
        (on3 - off3 - 2.0 * 0.5 * own_ms).abs() < 1e-6,
        "three waiting: {off3} -> {on3}"
    );
    // None waiting: nothing charged.
    assert_eq!(extra(0.5, 0), extra(0.0, 0));
}

#[test]
fn a_waiting_request_is_charged_for_one_step_of_a_longer_prompt_at_most() {
    // With a step budget of 1,024 tokens the 4,106-token prompt adds at most 1,024 tokens
    // to the step that gives the waiting request its first token.
    let extra = |weight: f64, budget: u64| {
        long_prompt_beside_waiting(1, |raw| {
            raw.cost.pending_weight = weight;
            raw.cost.max_num_batched_tokens = budget;
        })
    };
    let rate = default_prefill_rate();
    let (off, ttft_off) = extra(0.0, 1024);
    let (capped, ttft_capped) = extra(0.5, 1024);
    assert!(
        (capped - off - 0.5 * 1024.0 * 1000.0 / rate).abs() < 1e-6,
        "one step's tokens: {off} -> {capped}"
    );
    assert_eq!(ttft_capped, ttft_off, "the predicted TTFT is unchanged");
    // A budget above the prompt charges the whole prompt.
    let (whole, _) = extra(0.5, 8192);
    assert!(
        (whole - off - 0.5 * 4106.0 * 1000.0 / rate).abs() < 1e-6,
        "the whole prompt: {off} -> {whole}"
    );
}

#[test]
fn phase_weight_charges_a_long_prefill_for_the_decodes_it_stalls_and_only_then() {
    let route_with = |weight: f64, blocks: usize| {
        let mut r = two_servers(|raw| raw.cost.phase_weight = weight);
        // Server 0 decodes 60 sequences with a short queue; server 1 decodes none with a
        // longer one.
        r.on_metrics(&ep(0), load(60, 0, 0.3), T0);
        r.on_metrics(&ep(1), load(0, 2, 0.3), T0);
        let d = r.route(&req(3, blocks), T0);
        (d.best().cloned(), d.breakdown[0].ttft_ms)
    };
    assert_eq!(route_with(0.0, 64).0, Some(ep(0)), "off: the shorter queue wins");
    assert_eq!(
        route_with(0.1, 64).0,
        Some(ep(1)),
        "a long prefill avoids the decoding server"
    );
    assert_eq!(route_with(0.1, 1).0, Some(ep(0)), "a short one does not care");
    assert_eq!(
        route_with(0.0, 64).1,
        route_with(0.1, 64).1,
        "the predicted TTFT is unchanged"
    );
}

#[test]
fn a_refused_request_leaves_no_prefix_where_it_was_refused() {
    let mut r = router(PolicyKind::Cost, &idle(2));
    let d = r.route(&req(6, 16), T0);
    r.on_routed(1, &req(6, 16), &d, T0);
    let chosen = d.best().unwrap().clone();
    let matched = |r: &Router| {
        r.route(&req(6, 16), T0)
            .breakdown
            .iter()
            .find(|s| s.endpoint == chosen)
            .unwrap()
            .matched_blocks
    };
    assert_eq!(matched(&r), 16, "routing records the placement at once");
    r.on_completed(1, &served(&chosen, 503), T0);
    assert_eq!(matched(&r), 0, "the server refused it: it computed nothing");
    let (e, pending) = inflight_on(&r, &chosen);
    assert_eq!((e, pending), (0, Tokens(0)), "and its load is released");
}

#[test]
fn the_prompt_in_prefill_counts_less_as_its_pace_says_it_progresses() {
    let mut r = router(PolicyKind::Cost, &idle(1));
    let cfg = r.config().cost().clone();
    let left = |r: &Router, at: Millis| r.endpoints()[0].prefill_left(at, cfg.progress_credit, cfg.attention_tokens);
    let mut at = T0;
    // Three prompts of 64 blocks prefilled one after another, 100 ms each: the pace.
    for id in 1..=3 {
        let q = req(id, 64);
        let d = r.route(&q, at);
        r.on_routed(id, &q, &d, at);
        assert_eq!(
            left(&r, at.plus(50)),
            q.prompt_tokens,
            "no pace known yet: the whole prompt"
        );
        at = at.plus(100);
        r.on_first_token(id, at);
        r.on_completed(id, &done_at(Some(ep(0)), None), at);
    }
    assert!(r.endpoints()[0].pace.per_ms(at).is_some());
    // Two more: the older is in prefill, the newer waits behind it.
    let (a, b) = (req(11, 64), req(12, 64));
    for (id, q) in [(11, &a), (12, &b)] {
        let d = r.route(q, at);
        r.on_routed(id, q, &d, at);
    }
    let whole = a.prompt_tokens.saturating_add(b.prompt_tokens);
    assert_eq!(left(&r, at), whole);
    // Halfway through the first one's expected prefill: half of that progress is credited
    // (`progress_credit`), a quarter of its work, and a little more in tokens (its first
    // tokens cost less than its last).
    let taken = whole.0 - left(&r, at.plus(50)).0;
    let quarter = a.prompt_tokens.0 / 4;
    assert!(
        taken > quarter && taken < quarter * 11 / 10,
        "{taken} of {}",
        a.prompt_tokens.0
    );
    // Long past it: never more than the first prompt is taken off.
    assert_eq!(left(&r, at.plus(10_000)), b.prompt_tokens);
    // The first one's first token: the second starts from then.
    r.on_first_token(11, at.plus(120));
    assert_eq!(left(&r, at.plus(120)), b.prompt_tokens);
    assert!(left(&r, at.plus(170)) < b.prompt_tokens);
    // A request that ends without a first token leaves the queue too.
    r.on_completed(12, &done_at(Some(ep(0)), None), at.plus(180));
    assert_eq!(left(&r, at.plus(200)), Tokens(0));
    assert!(r.endpoints()[0].prefilling.is_empty());
}

#[test]
fn a_prompt_prefilled_in_the_same_step_as_the_one_before_it_is_no_fastest_sample() {
    let mut r = router(PolicyKind::Cost, &idle(1));
    let mut at = T0;
    // Pairs of prompts prefilled together in one 300 ms step: both first tokens come at once.
    for pair in 0..2 {
        let ids = [10 * pair + 1, 10 * pair + 2];
        for id in ids {
            let q = req(id, 64);
            let d = r.route(&q, at);
            r.on_routed(id, &q, &d, at);
        }
        at = at.plus(300);
        for id in ids {
            r.on_first_token(id, at);
            r.on_completed(id, &done_at(Some(ep(0)), None), at);
        }
    }
    let pace = r.endpoints()[0].pace;
    let (per_ms, best) = (pace.per_ms(at).unwrap(), pace.best_per_ms(at).unwrap());
    // The second of a pair is timed from the first one's first token, the same instant: its
    // sample says nothing of the server's speed, and as the fastest one it would make a
    // slower GPU (a mixed fleet's A100) look like the rest.
    assert!(
        best <= per_ms,
        "the fastest sample ({best} work/ms) is at most the server's throughput ({per_ms})"
    );
}

#[test]
fn a_cold_fleet_places_new_prefixes_by_envoys_weights() {
    // Servers 2 and 3 weigh 3 in Envoy's pool cluster (H100s beside A100s at 1): before any
    // rate is learned, a new prefix goes to one of them, and the others' predicted time is
    // the same prefill at a third of the rate.
    let mut raw = RawConfig::default();
    raw.cost.speed_weights_from_envoy = true;
    let mut r = Router::new(Config::try_from(raw).unwrap());
    let idle = [load(0, 0, 0.0), load(0, 0, 0.0), load(0, 0, 0.0), load(0, 0, 0.0)];
    apply_discovered(&mut r, &idle, |i| (0, if i >= 2 { 3 } else { 1 }));
    // Eight new prefixes: without weights their rendezvous owners spread over all four.
    for prefix in 1..=8 {
        let d = r.route(&req(prefix, 32), T0);
        assert!([ep(2), ep(3)].contains(d.best().unwrap()), "{:?}", d.endpoints);
        let prefill = |i: usize| d.breakdown.iter().find(|s| s.endpoint == ep(i)).unwrap().prefill_ms;
        assert!(
            (prefill(0) - 3.0 * prefill(2)).abs() < 1e-6,
            "{} vs {}",
            prefill(0),
            prefill(2)
        );
    }
}

#[test]
fn a_slower_gpu_whose_waiting_requests_move_slowly_loses_the_next_request() {
    // Two A100s and an H100 (speed weights 1, 1, 3.4: a fleet of unlike GPUs). A100 0's
    // sequence slots are full and 2 requests wait; its counter of finished requests grows
    // by 5 a second, read for a minute (it has finished more than it ever ran at once).
    // A100 1 runs more (900, more slots) and nothing waits there. The H100 is deep in
    // queued prefill.
    let route_with = |h100: f64, cost: &str| {
        let raw: RawConfig = serde_json::from_str(&format!(
            r#"{{"cost": {{"speed_weights": {{"{}": 1, "{}": 1, "{}": {h100}}}{cost}}}}}"#,
            ep(0),
            ep(1),
            ep(2)
        ))
        .unwrap();
        let raw = RawConfig {
            endpoints: (0..3).map(|i| ep(i).as_str().into()).collect(),
            policy: PolicyKind::Cost,
            ..raw
        };
        let mut r = Router::new(Config::try_from(raw).unwrap());
        for second in 0..=60u64 {
            let at = Millis(T0.0 + second * 1000);
            let finished = Some(100.0 + 5.0 * second as f64);
            for (i, queue) in [(256, 2), (900, 0), (300, 50)].into_iter().enumerate() {
                let metrics = VllmMetrics {
                    finished,
                    ..load(queue.0, queue.1, 0.3)
                };
                r.on_metrics(&ep(i), metrics, at);
            }
        }
        let per_s = r
            .endpoints()
            .iter()
            .find(|e| e.id == ep(0))
            .unwrap()
            .completions
            .per_s();
        assert!(per_s.is_some_and(|p| (p - 5.0).abs() < 1e-9), "{per_s:?}");
        r.route(&req(1, 8), Millis(T0.0 + 60_050)).best().cloned()
    };
    assert_eq!(route_with(3.4, ""), Some(ep(1)), "3 completions away: 0.6 s");
    let off = r#", "admission_weight": 0"#;
    assert_eq!(
        route_with(3.4, off),
        Some(ep(0)),
        "without the admission wait, 2 prompts queued read as little"
    );
    // Like GPUs: charged as well.
    assert_eq!(route_with(1.0, ""), Some(ep(1)));
}

#[test]
fn the_margin_buys_no_dearer_tier_than_the_best_scored_servers_when_it_meets_the_objective() {
    // Cheap server 0 holds the whole prompt behind 6 waiting requests: predicted TTFT ≈ 262
    // ms at the lowest cost (its hit). The premium servers, nearly idle, would compute the
    // prompt in ≈ 205 ms at about twice the cost.
    let route = |objective_ms: f64| {
        let loads = [load(8, 6, 0.3), load(8, 6, 0.3), load(2, 0, 0.1), load(2, 0, 0.1)];
        let mut r = tiered(objective_ms, &loads);
        route_to(&mut r, 1, &req(5, 64), 0, T0);
        r.on_first_token(1, T0.plus(50));
        r.on_completed(1, &Completion::default(), T0.plus(60));
        for (i, m) in loads.iter().enumerate() {
            r.on_metrics(&ep(i), m.clone(), T0.plus(100));
        }
        let d = r.route(&req(5, 64), T0.plus(100));
        let ttft: Vec<f64> = d.breakdown.iter().map(|s| s.ttft_ms).collect();
        assert!(ttft[0] > 250.0 && ttft[0] < 275.0 && ttft[2] < 210.0, "{ttft:?}");
        (d.tier.map(|t| (t.tier, t.spilled, t.met)), d.best().cloned())
    };
    // 400 ms, planned for 240: only the premium servers meet the planned share, but server
    // 0 is the best scored and within 400 ms: it keeps the request in the cheap tier.
    assert_eq!(route(400.0), (Some((0, false, true)), Some(ep(0))));
    // 250 ms: server 0 misses the whole objective; the premium tier, within it, serves.
    let (tiering, best) = route(250.0);
    assert_eq!(tiering, Some((1, true, true)));
    assert!(best == Some(ep(2)) || best == Some(ep(3)), "{best:?}");
}

#[test]
fn the_records_of_requests_in_flight_hold_no_more_blocks_than_their_share_of_the_budget() {
    // A 64 KiB index budget leaves the records 2,048 block hashes: 20 prompts of 100 blocks.
    let raw = RawConfig {
        endpoints: (0..2).map(|i| format!("10.0.0.{i}:8000")).collect(),
        index: crate::config::RawIndex {
            max_memory_bytes: 64 * 1024,
            ..RawConfig::default().index
        },
        ..RawConfig::default()
    };
    let mut r = Router::new(Config::try_from(raw).unwrap());
    for i in 0..2 {
        r.on_metrics(&ep(i), load(0, 0, 0.0), T0);
    }
    for id in 1..=30u64 {
        let q = req(id, 100);
        let at = T0.plus(id);
        let d = r.route(&q, at);
        r.on_routed(id, &q, &d, at);
    }
    assert_eq!(r.inflight_requests(), 20);
    // The oldest went, their load with them: the servers count the 20 left.
    let counted: u32 = r.endpoints().iter().map(|e| e.inflight).sum();
    assert_eq!(counted, 20);
    assert_eq!(r.stats().released_unfinished, 10);
    // A request released early finishes as one the router no longer knows.
    r.on_completed(1, &Completion::default(), T0.plus(100));
    assert_eq!((r.inflight_requests(), r.stats().completed), (20, 0));
    r.on_completed(30, &Completion::default(), T0.plus(100));
    assert_eq!((r.inflight_requests(), r.stats().completed), (19, 1));
    // 30 short prompts more fit beside them (2,020 blocks); one of 100 more does not.
    for id in 31..=60u64 {
        let q = req(id, 4);
        let d = r.route(&q, T0.plus(id));
        r.on_routed(id, &q, &d, T0.plus(id));
    }
    assert_eq!(r.inflight_requests(), 49);
    let q = req(61, 100);
    let d = r.route(&q, T0.plus(61));
    r.on_routed(61, &q, &d, T0.plus(61));
    assert_eq!(r.inflight_requests(), 49, "the oldest record (100 blocks) made room");
    r.on_completed(61, &Completion::default(), T0.plus(100));
    assert_eq!(r.inflight_requests(), 48, "the new record stayed");
    // A prompt past the whole bound releases every other record but stays itself.
    let q = req(62, 2100);
    let d = r.route(&q, T0);
    r.on_routed(62, &q, &d, T0);
    assert_eq!(r.inflight_requests(), 1);
    r.on_completed(62, &Completion::default(), T0.plus(100));
    assert_eq!(r.inflight_requests(), 0);
}

/// A request that continues stored response `id`.
fn continuing(id: &str) -> RouteRequest {
    RouteRequest {
        blocks: Vec::new(),
        continues: Some(crate::request::response_key(id)),
        ..req(0, 0)
    }
}

#[test]
fn a_continuation_goes_to_the_server_that_stored_its_response_whatever_its_load() {
    let mut r = router(PolicyKind::Cost, &[load(40, 30, 0.9), load(0, 0, 0.0), load(0, 0, 0.0)]);
    assert_ne!(
        r.route(&continuing("resp_a"), T0).best(),
        Some(&ep(0)),
        "unknown: routed by load"
    );
    r.on_stored("resp_a", &ep(0));
    let d = r.route(&continuing("resp_a"), T0);
    assert_eq!(d.endpoints, vec![ep(0)], "home only: no other server holds it");
    assert_eq!(d.outcome, Outcome::ResponseHome);
    assert_eq!(
        r.route(&continuing("resp_b"), T0).outcome,
        Outcome::Cold,
        "another id is not pinned"
    );
    // The home left the pool: the follow-up is routed like any request.
    r.on_endpoints(&[ep(1), ep(2)]);
    assert_eq!(r.home_of(crate::request::response_key("resp_a")), None);
    assert_eq!(r.route(&continuing("resp_a"), T0).outcome, Outcome::Cold);
}

#[test]
fn peers_learn_where_responses_are_stored() {
    let (mut a, mut b) = peers(4);
    a.on_stored("resp_x", &ep(3));
    assert_eq!(
        b.route(&continuing("resp_x"), T0).outcome,
        Outcome::Cold,
        "not yet told"
    );
    pass(&mut a, &mut b);
    assert_eq!(b.route(&continuing("resp_x"), T0).endpoints, vec![ep(3)]);
    // An event under its own origin (its own, echoed by the log) is not applied.
    b.on_stored("resp_y", &ep(2));
    let echo = PeerEvent::Stored {
        key: crate::peer::request_key(2, 0),
        response: crate::request::response_key("resp_y"),
        endpoint: ep(1),
    };
    b.on_peer_event(&echo, T0);
    assert_eq!(b.route(&continuing("resp_y"), T0).endpoints, vec![ep(2)]);
    assert_eq!(b.homes_known(), 2);
}

#[test]
fn homes_are_bounded_and_the_oldest_is_forgotten() {
    let mut r = router(PolicyKind::Cost, &idle(2));
    for i in 0..=MAX_HOMES {
        r.on_stored(&format!("resp_{i}"), &ep(i % 2));
    }
    assert_eq!(r.homes_known(), MAX_HOMES);
    assert_eq!(r.home_of(crate::request::response_key("resp_0")), None);
    let last = format!("resp_{MAX_HOMES}");
    assert_eq!(r.home_of(crate::request::response_key(&last)), Some(&ep(MAX_HOMES % 2)));
}

#[test]
fn a_continuation_records_no_prefix_its_body_does_not_carry() {
    let r = router(PolicyKind::Cost, &idle(2));
    let body = br#"{"model":"m","input":"and then?","previous_response_id":"resp_1"}"#;
    let parsed = crate::request::parse(crate::request::ApiKind::Responses, body).unwrap();
    let q = r.request(&parsed, "", false);
    assert!(q.blocks.is_empty());
    assert_eq!(q.continues, Some(crate::request::response_key("resp_1")));
    let fresh = br#"{"model":"m","input":"and then?"}"#;
    let parsed = crate::request::parse(crate::request::ApiKind::Responses, fresh).unwrap();
    assert_eq!(r.request(&parsed, "", false).continues, None);
}

#[test]
fn a_requests_servers_are_those_listing_its_model_or_all_of_them() {
    let mut other = load(0, 0, 0.0);
    other.models = vec!["other".into()];
    let r = router(PolicyKind::Cost, &[other, load(0, 0, 0.0), load(0, 0, 0.0)]);
    let slot = |i: usize| {
        r.endpoints()
            .iter()
            .find(|e| e.id == ep(i))
            .map(|e| 1u64 << (usize::from(e.slot) % 64))
            .unwrap()
    };
    let m = r.serving_mask(&req(1, 4));
    assert_eq!(m, slot(1) | slot(2));
    let mut o = req(1, 4);
    o.model = "other".into();
    assert_eq!(r.serving_mask(&o), slot(0));
    assert_eq!(m & r.serving_mask(&o), 0, "two models on their own servers share none");
    // An adapter no server lists yet, or no name at all: any server may serve it.
    for name in ["sql-lora", ""] {
        let mut any = req(1, 4);
        any.model = name.into();
        assert_eq!(r.serving_mask(&any), slot(0) | slot(1) | slot(2), "{name:?}");
    }
    assert_eq!(
        Router::new(config_with(PolicyKind::Cost, 0)).serving_mask(&req(1, 4)),
        u64::MAX
    );
}

/// A cost router over endpoints `0..weights.len()`, each with its speed weight (1 an A100,
/// 3.4 an H100) and `cost` appended to the `cost` section, every one idle.
fn idle_unlike_fleet(weights: &[f64], cost: &str) -> Router {
    let speeds: Vec<String> = weights
        .iter()
        .enumerate()
        .map(|(i, w)| format!(r#""{}": {w}"#, ep(i)))
        .collect();
    let json = format!(r#"{{"cost": {{"speed_weights": {{{}}}{cost}}}}}"#, speeds.join(", "));
    let raw: RawConfig = serde_json::from_str(&json).unwrap();
    let raw = RawConfig {
        endpoints: (0..weights.len()).map(|i| ep(i).as_str().into()).collect(),
        policy: PolicyKind::Cost,
        ..raw
    };
    let mut r = Router::new(Config::try_from(raw).unwrap());
    for i in 0..weights.len() {
        r.on_metrics(&ep(i), load(0, 0, 0.0), T0);
    }
    r
}

#[test]
fn where_the_fast_gpus_caches_fill_first_a_cold_prompt_goes_where_there_is_room() {
    // Two A100s (0, 1) and two H100s (2, 3; speed weight 3.4), all idle, each with room
    // for 2,500 of the index's blocks. The H100s hold 1,000 each (40%), the A100s none.
    // `again` prompts are then sent once more: the first ones, whose hits reach back to
    // the oldest of the H100s' content (conversations still going on), or the last ones,
    // the newest (prompts that stopped coming back). With `done`, A100 0's part of the
    // index is full of prompts that stopped coming back (its last one sent ten times).
    let route_cold_to = |cost: &str, again: &[u64], done: bool| {
        let mut r = idle_unlike_fleet(&[1.0, 1.0, 3.4, 3.4], cost);
        for n in 0..100u64 {
            let server = 2 + (n % 2) as usize;
            let slot = r.endpoints().iter().find(|e| e.id == ep(server)).unwrap().slot;
            r.index.record(slot, &req(100 + n, 20).blocks);
        }
        for n in again {
            let server = 2 + (n % 2) as usize;
            let slot = r.endpoints().iter().find(|e| e.id == ep(server)).unwrap().slot;
            r.index.record(slot, &req(100 + n, 20).blocks);
        }
        if done {
            let slot = r.endpoints().iter().find(|e| e.id == ep(0)).unwrap().slot;
            for n in (500..625u64).chain([624; 10]) {
                r.index.record(slot, &req(n, 20).blocks);
            }
            assert!((r.index().fill(slot) - 1.0).abs() < 1e-9);
        }
        assert_eq!((r.index().held(2), r.index().held(3)), (1000, 1000));
        let to: Vec<EndpointId> = (0..40u64)
            .map(|p| r.route(&req(1000 + p, 8), T0.plus(2)).best().unwrap().clone())
            .collect();
        (0..2)
            .map(|i| to.iter().filter(|e| **e == ep(i)).count())
            .collect::<Vec<_>>()
    };
    let route_cold = |cost: &str, again: &[u64]| route_cold_to(cost, again, false).iter().sum::<usize>();
    let oldest: Vec<u64> = (0..20).collect();
    let to_a100s = route_cold("", &oldest);
    assert!(to_a100s >= 30, "{to_a100s} of 40");
    assert_eq!(
        route_cold(r#", "storage_tolerance": 0"#, &oldest),
        0,
        "the cost alone: the H100s"
    );
    // Below `storage_fill` the caches do not bind yet.
    assert_eq!(route_cold(r#", "storage_fill": 0.5"#, &oldest), 0);
    // Hits from the newest content only: what the H100s will evict first is not coming
    // back, so their caches do not bind.
    let newest: Vec<u64> = (80..100).collect();
    assert_eq!(route_cold("", &newest), 0);
    // Nor before enough prompts came back to tell.
    assert_eq!(route_cold("", &oldest[..6]), 0);
    // A cache full of prompts that stopped coming back has room: least recently used
    // eviction takes them first.
    let to = route_cold_to("", &oldest, true);
    assert!(to[0] >= 10 && to[0] + to[1] >= 30, "{to:?} of 40");
}

#[test]
fn a_fast_server_that_joined_reads_its_class_mates_evictions() {
    // Two A100s (0, 1) and three H100s (2, 3, 4; speed weight 3.4), all idle, each with
    // room for 2,500 of the index's blocks. H100 2 joined late: 25 prompts of 20 blocks
    // (20% full), each sent twice, so its hits reach back to its oldest content. H100s 3
    // and 4 ran `prompts` prompts each: 150 (3,000 blocks) evict, 100 do not. With
    // `returning`, their first 30 prompts (evicted, with 150) are sent to them again.
    let route_cold = |prompts: u64, returning: bool| {
        let mut r = idle_unlike_fleet(&[1.0, 1.0, 3.4, 3.4, 3.4], "");
        let slot = |r: &Router, i: usize| r.endpoints().iter().find(|e| e.id == ep(i)).unwrap().slot;
        let joined = slot(&r, 2);
        for n in (0..25u64).chain(0..25) {
            r.index.record(joined, &req(100 + n, 20).blocks);
        }
        for server in [3, 4] {
            let s = slot(&r, server);
            for n in 0..prompts {
                r.index.record(s, &req(1000 * server as u64 + n, 20).blocks);
            }
            if returning {
                for n in 0..30u64 {
                    r.index.record(s, &req(1000 * server as u64 + n, 20).blocks);
                }
            }
        }
        assert_eq!(r.index().lost_share(joined), None);
        assert!(r.index().reuse_depth(joined).is_some_and(|d| d > 0.99));
        let mates: Vec<Option<f64>> = [3, 4].iter().map(|i| r.index().lost_share(slot(&r, *i))).collect();
        let to_a100s = (0..40u64)
            .map(|p| r.route(&req(5000 + p, 8), T0.plus(2)).best().unwrap().clone())
            .filter(|e| *e == ep(0) || *e == ep(1))
            .count();
        (to_a100s, mates)
    };
    // What H100s 3 and 4 evict is never asked for again: H100 2's cache does not bind
    // either, and the cost sends the cold prompts to the H100s.
    let (to_a100s, mates) = route_cold(150, false);
    assert_eq!(mates, vec![Some(0.0), Some(0.0)]);
    assert_eq!(to_a100s, 0);
    // What they evict comes back: the caches bind, and most go where there is room.
    let (to_a100s, mates) = route_cold(150, true);
    assert!(mates.iter().all(|m| m.is_some_and(|m| m >= 0.3)), "{mates:?}");
    assert!(to_a100s >= 20, "{to_a100s} of 40");
    // Neither has evicted: H100 2's own depth decides, and its cache binds.
    let (to_a100s, mates) = route_cold(100, false);
    assert_eq!(mates, vec![None, None]);
    assert!(to_a100s >= 20, "{to_a100s} of 40");
}

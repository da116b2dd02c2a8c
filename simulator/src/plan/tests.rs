use kvroute_core::Config;

use super::*;
use crate::profile::Model;
use crate::replay::Topology;
use crate::workload::{generate, GenParams, Generator};

#[test]
fn objectives_read_milliseconds_and_seconds() {
    let o: Objective = "ttft_p95=500ms,itl_p95=50ms".parse().unwrap();
    assert_eq!(
        o,
        Objective {
            ttft_p95_ms: 500.0,
            itl_p95_ms: Some(50.0)
        }
    );
    let o: Objective = " ttft_p95 = 1.5s ".parse().unwrap();
    assert_eq!((o.ttft_p95_ms, o.itl_p95_ms), (1500.0, None));
}

#[test]
fn bad_objectives_say_what_to_write() {
    for (spec, says) in [
        ("", "no ttft_p95"),
        ("itl_p95=50ms", "no ttft_p95"),
        ("ttft_p95=500", "no unit"),
        ("ttft_p95=-5ms", "not a positive duration"),
        ("ttft_p95=0ms", "not a positive duration"),
        ("ttft_p95=fast", "no unit"),
        ("ttft_p99=500ms", "unknown objective"),
        ("ttft_p95", "expected KEY=DURATION"),
        ("ttft_p95=1s,ttft_p95=2s", "given twice"),
    ] {
        let err = spec.parse::<Objective>().unwrap_err();
        assert!(err.contains(says), "{spec:?}: {err}");
    }
}

#[test]
fn prices_must_name_known_gpus_and_cover_every_gpu_sized() {
    let both = [Gpu::H100_80g, Gpu::A100_80g];
    let p = Prices::parse("h100-80g=2.49, a100-80g=1.29", &both).unwrap();
    assert_eq!((p.of(Gpu::H100_80g), p.of(Gpu::A100_80g)), (2.49, 1.29));
    let err = Prices::parse("h100-80g=2.49", &both).unwrap_err();
    assert!(err.contains("no price for a100-80g"), "{err}");
    let err = Prices::parse("h200=3.5,h100-80g=2.49", &[Gpu::H100_80g]).unwrap_err();
    assert!(
        err.contains("unknown GPU \"h200\"") && err.contains("h100-80g"),
        "{err}"
    );
    for bad in ["h100-80g", "h100-80g=free", "h100-80g=0", "h100-80g=1,h100-80g=2"] {
        assert!(Prices::parse(bad, &[Gpu::H100_80g]).is_err(), "{bad}");
    }
}

#[test]
fn monthly_cost_is_gpus_times_price_times_730_hours() {
    let c = Cost::of(8, 2.49, 3600.0, 1_000_000);
    assert!((c.usd_per_month - 8.0 * 2.49 * 730.0).abs() < 1e-9);
    // 8 GPUs for one hour at 2.49 = 19.92 USD for a million tokens.
    assert!((c.usd_per_mtok - 19.92).abs() < 1e-9);
    // Half the span for the same tokens: half the price per token.
    assert!((Cost::of(8, 2.49, 1800.0, 1_000_000).usd_per_mtok - 9.96).abs() < 1e-9);
}

#[test]
fn a_sizing_costs_its_answer_with_tp_gpus_per_server() {
    let point = |servers, busy_s| Point {
        servers,
        meets: true,
        replicas: 1,
        stopped_early: 0,
        attainment: 1.0,
        ttft_p95_ms: Some(100.0),
        itl_p95_ms: Some(10.0),
        hit_rate: Some(0.5),
        evictions: Some(0),
        failed: 0,
        tokens: 2_000_000,
        busy_s,
    };
    let s = Sizing {
        policy: PolicyName::Kvroute,
        gpu: Gpu::H100_80g,
        tp: 4,
        servers: Some(3),
        larger_needed: false,
        points: vec![point(2, 1.0), point(3, 7200.0)],
        cost: None,
    };
    let c = s.cost_at(2.0).unwrap();
    assert!((c.usd_per_month - 12.0 * 2.0 * 730.0).abs() < 1e-9);
    // 12 GPUs × 2 USD × 2 h / 2 Mtok.
    assert!((c.usd_per_mtok - 24.0).abs() < 1e-9);
    assert_eq!(s.clone().priced(2.0).cost, Some(c));
    assert!(Sizing { servers: None, ..s }.cost_at(2.0).is_none());
}

#[test]
fn the_misses_a_p95_allows_match_the_percentile_and_never_fall() {
    assert_eq!(misses_allowed(0), 0);
    assert_eq!(misses_allowed(1), 0);
    assert_eq!(misses_allowed(100), 5);
    assert_eq!(misses_allowed(3993), 200);
    for n in 1..2000 {
        assert!(misses_allowed(n + 1) >= misses_allowed(n), "{n}");
        // With exactly that many values above the threshold, the p95 is still within it.
        let allowed = misses_allowed(n);
        let mut v: Vec<f64> = (0..n).map(|i| if i < allowed { 2.0 } else { 1.0 }).collect();
        assert!(crate::report::Percentiles::of(&mut v).p95 <= 1.0, "{n}");
        if allowed < n {
            let mut v: Vec<f64> = (0..n).map(|i| if i <= allowed { 2.0 } else { 1.0 }).collect();
            assert!(
                crate::report::Percentiles::of(&mut v).p95 > 1.0,
                "{n}: one more miss fails"
            );
        }
    }
}

pub(super) fn planner(requests: &[SimRequest], ttft_ms: f64, early_stop: bool) -> Planner<'_> {
    let profile = Profile::new(Gpu::H100_80g, Model::Llama31_8b, 1).unwrap();
    Planner {
        base: ReplaySetup {
            classes: None,
            pool_changes: Vec::new(),
            profile,
            servers: 1,
            mixed: Vec::new(),
            slowdown: None,
            scrape_interval_ms: 200.0,
            seed: 0,
            router_config: Config::from_json(b"").unwrap(),
            topology: Topology::default(),
        },
        requests,
        objective: Objective {
            ttft_p95_ms: ttft_ms,
            itl_p95_ms: None,
        },
        replicas: 1,
        early_stop,
        parallel_replicas: false,
        cold_ms: 0.0,
    }
}

fn busy_workload() -> Vec<SimRequest> {
    let p = GenParams {
        rate: 150.0,
        groups: 16,
        prompts_per_group: 16,
        ..GenParams::defaults(Generator::SharedPrefix)
    };
    generate(Generator::SharedPrefix, &p)
}

#[test]
fn more_servers_meet_a_tight_objective_that_one_server_misses() {
    let reqs = busy_workload();
    let plan = planner(&reqs, 150.0, false);
    let profile = plan.base.profile.clone();
    let one = plan.evaluate(PolicyName::Kvroute, &profile, 1);
    let many = plan.evaluate(PolicyName::Kvroute, &profile, 8);
    assert!(!one.meets && many.meets, "{one:?} {many:?}");
    assert!(one.attainment < many.attainment);
    assert!(many.tokens > 0 && many.busy_s > 0.0);
}

#[test]
fn stopping_early_gives_the_same_verdict_and_an_estimate() {
    let reqs = busy_workload();
    let profile = Profile::new(Gpu::H100_80g, Model::Llama31_8b, 1).unwrap();
    let full = planner(&reqs, 150.0, false).evaluate(PolicyName::RoundRobin, &profile, 1);
    let early = planner(&reqs, 150.0, true).evaluate(PolicyName::RoundRobin, &profile, 1);
    assert!(!full.meets && !early.meets);
    assert_eq!((early.stopped_early, early.ttft_p95_ms), (1, None));
    assert!(early.attainment < 0.95, "{}", early.attainment);
}

#[test]
fn planning_sizes_every_policy_and_gpu_in_parallel_in_order() {
    let reqs = busy_workload();
    let plan = planner(&reqs, 150.0, true);
    let profiles = [
        Profile::new(Gpu::H100_80g, Model::Llama31_8b, 1).unwrap(),
        Profile::new(Gpu::A100_80g, Model::Llama31_8b, 1).unwrap(),
    ];
    let policies = [PolicyName::Kvroute, PolicyName::RoundRobin];
    let out = plan.size_all(&policies, &profiles, 8, 2, &|_| {});
    let got: Vec<(PolicyName, Gpu)> = out.iter().map(|s| (s.policy, s.gpu)).collect();
    assert_eq!(
        got,
        vec![
            (PolicyName::Kvroute, Gpu::H100_80g),
            (PolicyName::RoundRobin, Gpu::H100_80g),
            (PolicyName::Kvroute, Gpu::A100_80g),
            (PolicyName::RoundRobin, Gpu::A100_80g)
        ]
    );
    for s in &out {
        assert!(
            s.points.windows(2).all(|w| w[0].servers < w[1].servers),
            "sorted, no repeats"
        );
        if let Some(p) = s.answer() {
            assert!(p.meets);
            assert!(s.points.iter().all(|q| q.servers != p.servers - 1 || !q.meets));
        }
    }
    let chart = chart::text_chart(&out, &plan.objective);
    assert!(
        chart.contains("← answer") || out.iter().all(|s| s.servers.is_none()),
        "{chart}"
    );
    let svg = chart::svg("t", &out, &plan.objective);
    assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
}

fn point_at(servers: usize, meets: bool, ttft: Option<f64>, attainment: f64) -> Point {
    Point {
        servers,
        meets,
        replicas: 1,
        stopped_early: usize::from(ttft.is_none()),
        attainment,
        ttft_p95_ms: ttft,
        itl_p95_ms: ttft.map(|_| 12.0),
        hit_rate: ttft.map(|_| 0.4),
        evictions: None,
        failed: 0,
        tokens: 1_000_000,
        busy_s: 3600.0,
    }
}

#[test]
fn the_table_prices_each_answer_and_says_what_was_not_met_or_needed_more() {
    let met = Sizing {
        policy: PolicyName::Kvroute,
        gpu: Gpu::H100_80g,
        tp: 1,
        servers: Some(3),
        larger_needed: true,
        points: vec![
            point_at(2, false, None, 0.5),
            point_at(3, true, Some(90.0), 0.96),
            point_at(4, true, Some(70.0), 0.99),
        ],
        cost: None,
    }
    .priced(2.0);
    let missed = Sizing {
        policy: PolicyName::RoundRobin,
        servers: None,
        larger_needed: false,
        points: vec![point_at(8, false, None, 0.7)],
        ..met.clone()
    }
    .priced(2.0);
    let sizings = [met, missed];
    let table = chart::table(&sizings, 8);
    let kv = table.lines().find(|l| l.starts_with("kvroute")).unwrap();
    // 3 GPUs × 2 USD × 730 h = 4380 USD a month; 3 × 2 USD for an hour and 1 Mtok = 6 USD.
    assert!(
        kv.contains(" 4380 ") && kv.contains("6.0000") && kv.contains("a larger size was needed"),
        "{kv}"
    );
    let rr = table.lines().find(|l| l.starts_with("round-robin")).unwrap();
    assert!(rr.contains("not met up to 8 servers"), "{rr}");
    let obj = Objective {
        ttft_p95_ms: 100.0,
        itl_p95_ms: None,
    };
    let text = chart::text_chart(&sizings, &obj);
    let line = |n: &str| {
        text.lines()
            .find(|l| l.trim_start().starts_with(n))
            .unwrap()
            .to_string()
    };
    assert!(
        line("3 [").contains("← answer") && line("3 [").contains("TTFT p95 90 ms"),
        "{text}"
    );
    assert!(
        line("2 [").contains("~ 50.0%") && line("2 [").contains("stopped early"),
        "{text}"
    );
}

#[test]
fn replicas_in_threads_give_the_same_point_as_one_after_another() {
    let reqs = busy_workload();
    let profile = Profile::new(Gpu::H100_80g, Model::Llama31_8b, 1).unwrap();
    let mut plan = planner(&reqs, 150.0, true);
    plan.replicas = 3;
    let serial = plan.evaluate(PolicyName::Kvroute, &profile, 4);
    plan.parallel_replicas = true;
    assert_eq!(plan.evaluate(PolicyName::Kvroute, &profile, 4), serial);
    assert_eq!(serial.replicas, 3);
}

/// A burst of 64 cold prompts at once, then 40 more 200 ms apart from 20 s on.
fn burst_then_light() -> Vec<SimRequest> {
    let cold = |rate: f64, seed: u64, n: u64| {
        generate(
            Generator::SharedPrefix,
            &GenParams {
                rate,
                seed,
                groups: n,
                prompts_per_group: 1,
                ..GenParams::defaults(Generator::SharedPrefix)
            },
        )
    };
    let mut reqs = cold(100_000.0, 1, 64);
    reqs.extend(cold(5.0, 2, 40).into_iter().map(|r| SimRequest {
        arrival_ms: r.arrival_ms + 20_000.0,
        ..r
    }));
    reqs
}

#[test]
fn in_steady_state_the_objective_is_judged_after_the_cold_start() {
    let reqs = burst_then_light();
    let profile = Profile::new(Gpu::H100_80g, Model::Llama31_8b, 1).unwrap();
    for early_stop in [false, true] {
        let whole = planner(&reqs, 150.0, early_stop).evaluate(PolicyName::RoundRobin, &profile, 1);
        assert!(!whole.meets, "the burst queues seconds of prefill: {whole:?}");
        let steady = Planner {
            cold_ms: 10_000.0,
            ..planner(&reqs, 150.0, early_stop)
        }
        .evaluate(PolicyName::RoundRobin, &profile, 1);
        assert!(steady.meets, "the light traffic after it meets 150 ms: {steady:?}");
        assert_eq!(steady.stopped_early, 0, "the burst's misses do not stop it");
        assert!(steady.attainment > 0.99, "{steady:?}");
        let p95 = steady.ttft_p95_ms.unwrap();
        assert!(p95 < 150.0, "the judged p95 is the steady state's: {p95}");
        // The cost stays the whole run's: every request's tokens, the burst's included.
        if !early_stop {
            assert_eq!((steady.tokens, steady.busy_s), (whole.tokens, whole.busy_s));
        }
    }
}

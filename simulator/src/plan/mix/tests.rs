use kvroute_core::{Config, EndpointId};

use super::super::tests::planner;

use super::*;
use crate::profile::{Gpu, Model};
use crate::workload::{generate, GenParams, Generator};

/// The cheapest fleet of the grid (c ≤ max_cheap, q ≤ max_premium, not empty) that `meets`.
fn brute_force(
    pc: f64,
    pp: f64,
    max_premium: usize,
    max_cheap: usize,
    meets: &dyn Fn(usize, usize) -> bool,
) -> Option<f64> {
    (0..=max_cheap)
        .flat_map(|c| (0..=max_premium).map(move |q| (c, q)))
        .filter(|&(c, q)| c + q > 0 && meets(c, q))
        .map(|(c, q)| c as f64 * pc + q as f64 * pp)
        .min_by(f64::total_cmp)
}

#[test]
fn the_staircase_finds_the_cheapest_fleet_of_the_grid_and_tests_far_fewer() {
    let mut cases = 0;
    // A fleet meets the objective when its capacity covers the demand (monotone in both).
    for (cheap_cap, premium_cap) in [(1.0, 3.0), (1.0, 1.5), (2.0, 3.0), (1.0, 10.0)] {
        for (pc, pp) in [(1.3, 3.0), (0.8, 4.0), (2.9, 3.0), (1.0, 1.0)] {
            for demand in [0.5, 3.0, 7.5, 10.0, 23.0, 40.0] {
                let meets = |c: usize, q: usize| c as f64 * cheap_cap + q as f64 * premium_cap >= demand;
                let mut tested: Vec<(usize, usize)> = Vec::new();
                let steps = staircase(pc, pp, 16, 16, &mut |c, q| {
                    tested.push((c, q));
                    meets(c, q)
                });
                let want = brute_force(pc, pp, 16, 16, &meets);
                let got = cheapest(&steps, pc, pp)
                    .map(|i| steps[i].cheap as f64 * pc + steps[i].premium.unwrap() as f64 * pp);
                let case = format!("caps {cheap_cap}/{premium_cap}, prices {pc}/{pp}, demand {demand}");
                assert_eq!(got.is_some(), want.is_some(), "{case}");
                if let (Some(g), Some(w)) = (got, want) {
                    assert!((g - w).abs() < 1e-9, "{case}: found {g}, cheapest {w}; steps {steps:?}");
                }
                assert!(!tested.contains(&(0, 0)), "{case}: an empty fleet was replayed");
                let mut once = tested.clone();
                once.sort_unstable();
                once.dedup();
                assert_eq!(once.len(), tested.len(), "{case}: a fleet replayed twice");
                // Every step's fleet meets it, and one premium server fewer does not.
                for s in &steps {
                    if let Some(q) = s.premium {
                        assert!(meets(s.cheap, q), "{case}: {s:?}");
                        if q > usize::from(s.cheap == 0) {
                            assert!(!meets(s.cheap, q - 1), "{case}: {s:?} is not the fewest");
                        }
                    }
                }
                assert!(tested.len() < 17 * 17 / 2, "{case}: {} fleets replayed", tested.len());
                cases += 1;
            }
        }
    }
    assert_eq!(cases, 96);
}

#[test]
fn the_staircase_stops_where_cheap_servers_alone_cost_as_much_as_the_best_fleet() {
    // 2 premium servers (6.0 per hour) meet it; 5 cheap ones (6.5) would cost more than them
    // whatever they did, so no fleet with 5 or more cheap servers is replayed.
    let mut tested: Vec<(usize, usize)> = Vec::new();
    let steps = staircase(1.3, 3.0, 16, 16, &mut |c, q| {
        tested.push((c, q));
        q >= 2 || (q == 1 && c >= 3)
    });
    assert!(tested.iter().all(|(c, _)| *c < 5), "{tested:?}");
    let best = &steps[cheapest(&steps, 1.3, 3.0).unwrap()];
    assert_eq!((best.cheap, best.premium), (0, Some(2)));
    // And cheap servers alone meeting it end the search: more of them only cost more.
    let steps = staircase(1.3, 3.0, 16, 16, &mut |c, q| c + 2 * q >= 3);
    let last = steps.last().unwrap();
    assert_eq!((last.cheap, last.premium), (3, Some(0)));
}

#[test]
fn tiered_configs_put_the_premium_servers_in_tier_one_and_keep_the_operators_settings() {
    let a100 = Profile::new(Gpu::A100_80g, Model::Llama31_8b, 1).unwrap();
    let h100 = Profile::new(Gpu::H100_80g, Model::Llama31_8b, 1).unwrap();
    let obj = Objective {
        ttft_p95_ms: 800.0,
        itl_p95_ms: None,
    };
    let c = tiered_config(&serde_json::json!({}), &a100, &h100, 2, 3, &obj).unwrap();
    let tiers = c.tiers();
    let tier = |i: usize| tiers.tier_of(&EndpointId::new(format!("127.0.0.1:{}", 8001 + i)), 0);
    assert_eq!((0..6).map(tier).collect::<Vec<_>>(), vec![0, 0, 1, 1, 1, 0]);
    assert_eq!(tiers.ttft_objective_ms, 800.0);
    assert_eq!(tiers.max_num_seqs, vec![256, 1024]);
    let theirs = serde_json::json!({"tiers": {"ttft_objective_ms": 500, "objective_share": 0.8,
        "endpoints": {"10.0.0.1:8000": 1}}, "cost": {"kv_pressure_ms": 300}});
    let c = tiered_config(&theirs, &a100, &h100, 1, 1, &obj).unwrap();
    assert_eq!((c.tiers().ttft_objective_ms, c.tiers().objective_share), (500.0, 0.8));
    assert_eq!(c.tiers().endpoints.keys().collect::<Vec<_>>(), vec!["127.0.0.1:8002"]);
    // Everything else the operator wrote stays as written.
    let mut want = theirs.clone();
    want["tiers"]["endpoints"] = serde_json::json!({"127.0.0.1:8002": 1});
    want["tiers"]["max_num_seqs"] = serde_json::json!([256, 1024]);
    let want = Config::from_json(want.to_string().as_bytes()).unwrap();
    assert_eq!(format!("{c:?}"), format!("{want:?}"));
    for (bad, says) in [
        (serde_json::json!([]), "a JSON object"),
        (serde_json::json!({"tiers": 3}), "must be an object"),
        (serde_json::json!({"tiers": {"from_priority": true}}), "from_priority"),
        (
            serde_json::json!({"tiers": {"objective_share": 7}}),
            "tiered router configuration",
        ),
    ] {
        let err = tiered_config(&bad, &a100, &h100, 1, 1, &obj).unwrap_err();
        assert!(err.contains(says), "{bad}: {err}");
    }
}

#[test]
fn a_mixed_search_replays_the_fleets_it_names_and_prices_them() {
    let a100 = Profile::new(Gpu::A100_80g, Model::Llama31_8b, 1).unwrap();
    let h100 = Profile::new(Gpu::H100_80g, Model::Llama31_8b, 1).unwrap();
    let p = GenParams {
        rate: 12.0,
        groups: 24,
        prompts_per_group: 6,
        ..GenParams::defaults(Generator::SharedPrefix)
    };
    let reqs = generate(Generator::SharedPrefix, &p);
    let plan = planner(&reqs, 400.0, true);
    let config_json = serde_json::json!({});
    let mix = Mix {
        cheap: &a100,
        premium: &h100,
        cheap_usd_per_gpu_hour: 1.3,
        premium_usd_per_gpu_hour: 3.0,
        max_premium: 8,
        max_cheap: 8,
        config_json: &config_json,
    };
    let tasks = [
        MixTask {
            policy: PolicyName::Kvroute,
            tiered: false,
        },
        MixTask {
            policy: PolicyName::Kvroute,
            tiered: true,
        },
    ];
    let out = plan.size_mixes(&tasks, &mix, 2, &|_| {});
    assert_eq!(out.len(), 2);
    assert_eq!(
        (out[0].policy.as_str(), out[1].policy.as_str()),
        ("kvroute", "kvroute+tiers")
    );
    for s in &out {
        let best = &s.rows[s.cheapest.expect("some fleet meets 400 ms")];
        assert!(best.point.meets, "{}", s.policy);
        for r in &s.rows {
            assert!(r.usd_per_hour >= best.usd_per_hour - 1e-9, "{}", s.policy);
            assert!((r.usd_per_hour - (r.cheap as f64 * 1.3 + r.premium as f64 * 3.0)).abs() < 1e-9);
            assert!((r.cost.usd_per_month - r.usd_per_hour * HOURS_PER_MONTH).abs() < 1e-6);
        }
        // The all-premium row is the homogeneous sizing's fleet, replayed alike.
        let base = s
            .rows
            .iter()
            .find(|r| r.cheap == 0)
            .expect("premium servers alone meet it");
        let same = plan.evaluate(PolicyName::Kvroute, &h100, base.premium);
        assert_eq!(same, base.point, "{}", s.policy);
    }
    // A fleet with cheap servers replays them: the A100s' slower prefill shows in the
    // TTFT of one A100 against one H100 (every other setting alike).
    let whole = planner(&reqs, 400.0, false);
    let one = |c: usize, q: usize| {
        whole.evaluate_fleet(
            PolicyName::Kvroute,
            &mix.fleet(&whole.base, &tasks[0], &whole.objective, c, q),
        )
    };
    let (a, h) = (one(1, 0), one(0, 1));
    assert!(
        a.ttft_p95_ms.unwrap() > h.ttft_p95_ms.unwrap() * 1.5,
        "A100 {a:?}, H100 {h:?}"
    );
}

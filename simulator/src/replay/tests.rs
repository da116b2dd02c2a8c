use super::*;
use crate::profile::{Gpu, Model};
use crate::workload::{generate, GenParams, Generator};

fn setup(servers: usize) -> ReplaySetup {
    ReplaySetup {
        profile: Profile::new(Gpu::H100_80g, Model::Llama31_8b, 1).unwrap(),
        servers,
        scrape_interval_ms: 200.0,
        seed: 1,
        router_config: Config::from_json(b"").unwrap(),
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

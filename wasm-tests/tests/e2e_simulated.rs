//! End to end on the simulated fleet: real Envoy + dist/kvroute.wasm in front of
//! `kvroute-sim serve` (the engine model answering like vLLM, in wall time), with the
//! simulator's own load generator as the client and its fault injection as the crash.

#![allow(clippy::unwrap_used, clippy::disallowed_methods)] // wall-time test helpers

use std::time::Duration;

use kvroute_sim::bench::Api;
use kvroute_sim::profile::{Gpu, Model, Profile};
use kvroute_sim::workload::{generate, GenParams, Generator};
use kvroute_wasm_tests::envoy::Envoy;
use kvroute_wasm_tests::http_client;

/// 16 groups × 6 prompts sharing a 2048-token system prompt, at 80 requests per second.
fn shared_prefix_groups() -> GenParams {
    GenParams {
        rate: 80.0,
        groups: 16,
        prompts_per_group: 6,
        output_tokens: 8,
        ..GenParams::defaults(Generator::SharedPrefix)
    }
}

/// Every server's `unseen_permille` gauge on `envoy` (`seen::SeenShare`).
fn unseen_permille(envoy: &Envoy) -> Vec<u64> {
    let gauges = http_client::request(envoy.admin, "GET", "/stats?filter=unseen_permille", &[], b"").unwrap();
    gauges
        .body
        .lines()
        .filter_map(|l| l.split_once(": ")?.1.trim().parse().ok())
        .collect()
}

#[test]
fn simulated_fleet_keeps_prefix_groups_together_and_survives_a_crash() {
    let profile = Profile::new(Gpu::H100_80g, Model::Llama31_8b, 1).unwrap();
    let (rt, base) = kvroute_sim::serve::start_in_background(profile, 4, 20.0).unwrap();
    let ports: Vec<u16> = (base..base + 4).collect();
    let envoy = Envoy::start("envoy.yaml", &ports, |t| t).unwrap();
    // Every server scraped before the first request (a fixed sleep was not always enough on
    // a loaded 2-core machine: a server not scraped yet is no candidate), then a worker tick.
    envoy.wait_scraped(4);
    let url = format!("http://127.0.0.1:{}", envoy.port);

    // 16 groups × 6 prompts sharing a 2048-token system prompt. The fleet runs 20× faster
    // than wall time, so it is idle at each group's first prompt and kvroute sends that
    // prompt to the rendezvous owner of its first block: with 8 groups all of them landed on
    // two of the four servers for some port numbers (2.3% of hashings; CI saw it), with 16 a
    // hashing does that once in about 10,000.
    let p = shared_prefix_groups();
    let reqs = generate(Generator::SharedPrefix, &p);
    let (run, servers) = rt
        .block_on(kvroute_sim::bench::quiet(&url, Api::Chat, &reqs, 60.0, "kvroute"))
        .unwrap();
    assert_eq!((run.completed, run.failed), (96, 0));
    // With affinity a group misses once per Envoy worker at most: ≥ 4 of 6 hit 2048 of 2180 tokens.
    assert!(run.prefix_hit_rate > 0.6, "hit rate {}", run.prefix_hit_rate);
    assert!(servers.len() >= 3, "groups should spread: {servers:?}");
    // The streams asked for usage (`include_usage`): the filter read the servers' cached
    // token counts from their last chunks.
    let reported = envoy.stat("wasmcustom.kvroute.tokens.reported_cached");
    assert!(reported > 0, "no cached tokens read from the streams");
    // One gateway routed everything the servers looked up: none of it reads as unseen
    // (`seen::SeenShare`, its estimate scaled by the servers' reported prompt tokens), so a
    // miss the index did not predict does not shrink it. The gauges come every 100 ms.
    std::thread::sleep(Duration::from_millis(300));
    let unseen = unseen_permille(&envoy);
    assert!(unseen.len() >= 3, "unseen share of too few servers: {unseen:?}");
    assert!(unseen.iter().all(|permille| *permille < 200), "{unseen:?}");

    // Crash server 0 (listener and connections closed). Once the scrapes have marked it
    // down (well under 2 s), kvroute never picks it again and no request fails.
    let r = http_client::request(base - 1, "POST", "/servers/0/fault", &[], br#"{"down": true}"#).unwrap();
    assert_eq!(r.status, 200);
    std::thread::sleep(Duration::from_millis(1500));
    let chosen = format!("wasmcustom.kvroute.endpoint.127_0_0_1_{base}.chosen");
    let before = envoy.stat(&chosen);
    let later = GenParams { seed: 7, ..p };
    let (run, _) = rt
        .block_on(kvroute_sim::bench::quiet(
            &url,
            Api::Chat,
            &generate(Generator::SharedPrefix, &later),
            60.0,
            "after",
        ))
        .unwrap();
    assert_eq!((run.completed, run.failed), (96, 0), "requests failed after the crash");
    assert_eq!(envoy.stat(&chosen), before, "kvroute still chose the crashed server");
    assert!(envoy.stat("wasmcustom.kvroute.scrape.failure") >= 2);
    assert_eq!(envoy.stat("wasmcustom.kvroute.scrape.healthy_endpoints"), 3);
}

/// Two gateway replicas that do not share, each sent half of the traffic: each reads about
/// half of every server's prompts as unseen (`seen::SeenShare`), so vLLM's reports of
/// evicted prefixes correct its index in full (`Router::learn_from_cached`).
#[test]
fn replicas_that_do_not_share_read_the_others_traffic_as_unseen() {
    let profile = Profile::new(Gpu::H100_80g, Model::Llama31_8b, 1).unwrap();
    let (rt, base) = kvroute_sim::serve::start_in_background(profile, 4, 20.0).unwrap();
    let ports: Vec<u16> = (base..base + 4).collect();
    let replicas = [
        Envoy::start("envoy.yaml", &ports, |t| t).unwrap(),
        Envoy::start("envoy.yaml", &ports, |t| t).unwrap(),
    ];
    for e in &replicas {
        e.wait_scraped(4);
    }
    // The load generator sends its requests to the two gateways in turn.
    let urls = replicas
        .iter()
        .map(|e| format!("http://127.0.0.1:{}", e.port))
        .collect::<Vec<_>>()
        .join(",");
    let p = shared_prefix_groups();
    let (run, _) = rt
        .block_on(kvroute_sim::bench::quiet(
            &urls,
            Api::Chat,
            &generate(Generator::SharedPrefix, &p),
            60.0,
            "two replicas",
        ))
        .unwrap();
    assert_eq!((run.completed, run.failed), (96, 0));
    std::thread::sleep(Duration::from_millis(300));
    for envoy in &replicas {
        let unseen = unseen_permille(envoy);
        assert!(unseen.len() >= 3, "unseen share of too few servers: {unseen:?}");
        // Each server's figure is a few seconds of a 96-request run: one read 776 of 13 runs
        // with the other test beside it, and one 845 in a fresh-clone CI run (the others 445–
        // 533). Their mean says "about half"; a replica that shared would read near 0, one
        // that missed every placement near 1000. Each server only has to be clear of both.
        let mean = unseen.iter().sum::<u64>() / unseen.len() as u64;
        assert!((350..=650).contains(&mean), "mean {mean}: {unseen:?}");
        assert!(unseen.iter().all(|u| (100..=900).contains(u)), "{unseen:?}");
    }
}

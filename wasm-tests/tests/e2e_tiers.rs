//! End to end: price tiers taken from the pool cluster's EDS priorities
//! (`tiers.from_priority`). Two idle servers at priority 0 and two at priority 1 of the same
//! cluster: with tiers from priorities every request stays on priority 0 (it meets its
//! objective there); without tiers kvroute spreads cold prompts over all four, which also
//! shows that Envoy's `override_host` reaches hosts at priority 1. With each tier's sequence
//! slots given (`tiers.max_num_seqs`), a request spills once the cheap servers' are taken.
//! With two workers, each learns how far off a server's predictions run from the other's
//! streamed first tokens too (`ttft_scale_permille`).

#![allow(clippy::disallowed_methods)] // wall-time end-to-end tests read the clock
#![allow(clippy::unwrap_used)] // test helpers outside #[test] functions

use std::collections::BTreeSet;
use std::thread;
use std::time::{Duration, Instant};

use kvroute_wasm_tests::envoy::Envoy;
use kvroute_wasm_tests::fake_vllm::{FakeVllm, Load, MODEL};

fn chat_body(system: &str) -> String {
    format!(
        r#"{{"model":"{MODEL}","max_tokens":16,"messages":[{{"role":"system","content":"{system}"}},{{"role":"user","content":"hello"}}]}}"#
    )
}

/// Four idle servers, the third and fourth at priority 1 of the pool cluster (the locality
/// opens at the third), and Envoy with kvroute
/// whose configuration gains `tiers` (a JSON member, or "" for none), once it has scraped.
fn start(tiers: &str) -> (Vec<FakeVllm>, Vec<u16>, Envoy) {
    let servers: Vec<FakeVllm> = (0..4).map(|_| FakeVllm::start(Load::idle()).unwrap()).collect();
    let ports: Vec<u16> = servers.iter().map(|s| s.port).collect();
    let premium = ports[2];
    let tiers = tiers.to_string();
    let edit = move |text: String| {
        let line = format!("              - endpoint: {{ address: {{ socket_address: {{ address: 127.0.0.1, port_value: {premium} }} }} }}");
        let text = text.replacen(
            &line,
            &format!("          - priority: 1\n            lb_endpoints:\n{line}"),
            1,
        );
        text.replace("\"policy\": \"cost\",", &format!("\"policy\": \"cost\",{tiers}"))
    };
    let envoy = Envoy::start_workers("envoy.yaml", &ports, 1, edit).unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while servers.iter().any(|s| s.scrapes() < 2) {
        assert!(Instant::now() < deadline, "no scrapes:\n{}", envoy.log_text());
        thread::sleep(Duration::from_millis(20));
    }
    thread::sleep(Duration::from_millis(300));
    (servers, ports, envoy)
}

/// The servers (by port) that 16 distinct prompts went to.
fn served(from_priority: bool) -> (BTreeSet<u16>, Vec<u16>, u64) {
    let tiers = if from_priority {
        r#" "tiers": {"from_priority": true},"#
    } else {
        ""
    };
    let (_servers, ports, envoy) = start(tiers);
    let mut used = BTreeSet::new();
    for i in 0..16 {
        let system = format!("You are assistant number {i} of the tier test. ").repeat(40);
        let r = envoy
            .post(
                "/v1/chat/completions",
                &[("content-type", "application/json")],
                &chat_body(&system),
            )
            .unwrap();
        assert_eq!(r.status, 200, "{}", r.body);
        let by = r.header("x-served-by").unwrap_or("").to_string();
        used.insert(by.rsplit(':').next().unwrap().parse::<u16>().unwrap());
    }
    let spilled = envoy.stat("wasmcustom.kvroute.tiers.spilled");
    (used, ports, spilled)
}

#[test]
fn tiers_from_priorities_keep_requests_on_priority_zero() {
    let (used, ports, spilled) = served(true);
    assert!(
        used.iter().all(|p| *p == ports[0] || *p == ports[1]),
        "servers used {used:?}; priority 0 is {:?}",
        &ports[..2]
    );
    assert_eq!(spilled, 0);
}

#[test]
fn without_tiers_the_priority_one_servers_get_requests_too() {
    let (used, ports, _) = served(false);
    assert!(
        used.contains(&ports[2]) || used.contains(&ports[3]),
        "servers used {used:?}: nothing reached priority 1 ({:?})",
        &ports[2..]
    );
}

/// With one sequence slot per priority-0 server, two slow requests in flight there fill
/// them: the third request goes to priority 1, though every scrape reads idle.
#[test]
fn a_cheap_tier_whose_sequence_slots_are_taken_spills() {
    let (servers, ports, envoy) = start(r#" "tiers": {"from_priority": true, "max_num_seqs": [1]},"#);
    for s in &servers {
        s.set_delay_ms(1500);
    }
    let post = |i: usize| {
        let system = format!("You are assistant number {i} of the slot test. ").repeat(40);
        envoy.post(
            "/v1/chat/completions",
            &[("content-type", "application/json")],
            &chat_body(&system),
        )
    };
    let by = |r: &kvroute_wasm_tests::http_client::Response| {
        r.header("x-served-by")
            .unwrap_or("")
            .rsplit(':')
            .next()
            .unwrap()
            .parse::<u16>()
            .unwrap()
    };
    thread::scope(|scope| {
        // Each slow request is routed (it has reached a server, which then waits) before the
        // next is sent.
        let slow: Vec<_> = (0..2u64)
            .map(|i| {
                let r = scope.spawn(move || post(i as usize).unwrap());
                let deadline = Instant::now() + Duration::from_secs(5);
                while servers.iter().map(FakeVllm::inference_requests).sum::<u64>() < i + 1 {
                    assert!(Instant::now() < deadline, "slow request {i} reached no server");
                    thread::sleep(Duration::from_millis(10));
                }
                r
            })
            .collect();
        let third = post(2).unwrap();
        assert_eq!(third.status, 200, "{}", third.body);
        let first_two: BTreeSet<u16> = slow.into_iter().map(|h| by(&h.join().unwrap())).collect();
        assert_eq!(
            first_two,
            ports[..2].iter().copied().collect(),
            "one request on each priority-0 server"
        );
        assert!(
            ports[2..].contains(&by(&third)),
            "the third went to {}; priority 1 is {:?}",
            by(&third),
            &ports[2..]
        );
    });
    assert_eq!(envoy.stat("wasmcustom.kvroute.tiers.spilled"), 1);
}

/// Every reading of server `port`'s `ttft_scale_permille` gauge over `ms` (each of Envoy's
/// workers reports its own every 100 ms; the latest report wins).
fn ttft_scales(envoy: &Envoy, port: u16, ms: u64) -> Vec<u64> {
    let name = format!("wasmcustom.kvroute.endpoint.127_0_0_1_{port}.ttft_scale_permille");
    let deadline = Instant::now() + Duration::from_millis(ms);
    let mut seen = Vec::new();
    while Instant::now() < deadline {
        seen.push(envoy.stat(&name));
        thread::sleep(Duration::from_millis(20));
    }
    seen
}

/// Two workers; three streams to a cheap server whose first tokens come 600 ms late. The
/// scaling needs three samples, which no single worker has of its own unless all three
/// landed there: every worker's report reads above 1000 only when each learns from the
/// other's first tokens too.
#[test]
fn every_worker_learns_the_tiers_scaling_from_the_others_first_tokens() {
    let servers: Vec<FakeVllm> = (0..2).map(|_| FakeVllm::start(Load::idle()).unwrap()).collect();
    let ports: Vec<u16> = servers.iter().map(|s| s.port).collect();
    let premium = ports[1];
    let edit = move |text: String| {
        text.replace(
            "\"policy\": \"cost\",",
            &format!(
                "\"policy\": \"cost\", \"tiers\": {{\"endpoints\": {{\"127.0.0.1:{premium}\": 1}}, \"ttft_objective_ms\": 60000}},"
            ),
        )
    };
    let envoy = Envoy::start_workers("envoy.yaml", &ports, 2, edit).unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while servers.iter().any(|s| s.scrapes() < 2) {
        assert!(Instant::now() < deadline, "no scrapes:\n{}", envoy.log_text());
        thread::sleep(Duration::from_millis(20));
    }
    servers[0].set_delay_ms(600);
    for i in 0..3 {
        // A long prompt, so the prediction is long enough to learn from (20 ms or more).
        let system = format!("You are assistant number {i} of the scaling test. ").repeat(200);
        let body = format!(
            r#"{{"model":"{MODEL}","max_tokens":4,"stream":true,"messages":[{{"role":"system","content":"{system}"}},{{"role":"user","content":"hello"}}]}}"#
        );
        let r = envoy
            .post("/v1/chat/completions", &[("content-type", "application/json")], &body)
            .unwrap();
        assert_eq!(r.status, 200, "{}", r.body);
        assert_eq!(
            r.header("x-served-by"),
            Some(format!("127.0.0.1:{}", ports[0]).as_str())
        );
    }
    // Within a few of the workers' 2 ms ticks each has the other's events; then 500 ms of
    // their reports.
    thread::sleep(Duration::from_millis(300));
    let scales = ttft_scales(&envoy, ports[0], 500);
    assert!(!scales.is_empty() && scales.iter().all(|s| *s > 1000), "{scales:?}");
}

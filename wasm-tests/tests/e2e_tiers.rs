//! End to end: price tiers taken from the pool cluster's EDS priorities
//! (`tiers.from_priority`). Two idle servers at priority 0 and two at priority 1 of the same
//! cluster: with tiers from priorities every request stays on priority 0 (it meets its
//! objective there); without tiers kvroute spreads cold prompts over all four, which also
//! shows that Envoy's `override_host` reaches hosts at priority 1.

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

/// The servers (by port) that 16 distinct prompts went to.
fn served(from_priority: bool) -> (BTreeSet<u16>, Vec<u16>, u64) {
    let servers: Vec<FakeVllm> = (0..4).map(|_| FakeVllm::start(Load::idle()).unwrap()).collect();
    let ports: Vec<u16> = servers.iter().map(|s| s.port).collect();
    let premium = ports[2];
    let edit = move |text: String| {
        let line = format!("              - endpoint: {{ address: {{ socket_address: {{ address: 127.0.0.1, port_value: {premium} }} }} }}");
        let text = text.replacen(
            &line,
            &format!("          - priority: 1\n            lb_endpoints:\n{line}"),
            1,
        );
        let tiers = if from_priority {
            r#" "tiers": {"from_priority": true},"#
        } else {
            ""
        };
        text.replace("\"policy\": \"cost\",", &format!("\"policy\": \"cost\",{tiers}"))
    };
    let envoy = Envoy::start_workers("envoy.yaml", &ports, 1, edit).unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while servers.iter().any(|s| s.scrapes() < 2) {
        assert!(Instant::now() < deadline, "no scrapes:\n{}", envoy.log_text());
        thread::sleep(Duration::from_millis(20));
    }
    thread::sleep(Duration::from_millis(300));
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

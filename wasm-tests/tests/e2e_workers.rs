//! End to end: one view per Envoy process. With several worker threads, each with its own
//! wasm VM, a prefix one worker placed is found by every other worker (they exchange
//! placements through shared data); with sharing switched off, the others route blind.

#![allow(clippy::disallowed_methods)] // wall-time end-to-end tests read the clock
#![allow(clippy::unwrap_used)] // test helpers outside #[test] functions

use std::thread;
use std::time::{Duration, Instant};

use kvroute_wasm_tests::envoy::Envoy;
use kvroute_wasm_tests::fake_vllm::{FakeVllm, Load, MODEL};

const WORKERS: u32 = 4;
const PAIRS: usize = 24;

fn chat_body(system: &str, question: &str) -> String {
    format!(
        r#"{{"model":"{MODEL}","max_tokens":16,"messages":[{{"role":"system","content":"{system}"}},{{"role":"user","content":"{question}"}}]}}"#
    )
}

fn long_prompt(tag: &str) -> String {
    format!("You are the assistant of team {tag}. Follow the house style. ").repeat(60)
}

/// What the workers' exchange did, once it settled (or after 5 s).
#[derive(Debug)]
struct Exchange {
    applied: u64,
    published: u64,
    unpublished: Option<u64>,
    inflight: Option<u64>,
}

/// Sends PAIRS pairs of requests sharing a prefix, each on its own connection (so Envoy
/// spreads them over its workers), the second 50 ms after the first. Returns, per pair,
/// (server of the first, server of the second, kvroute's reason for the second).
fn pairs(share: bool) -> (Vec<(String, String, String)>, Exchange) {
    let servers: Vec<FakeVllm> = (0..4).map(|_| FakeVllm::start(Load::idle()).unwrap()).collect();
    let ports: Vec<u16> = servers.iter().map(|s| s.port).collect();
    let edit = |text: String| {
        let extra = if share { "" } else { " \"share\": {\"workers\": false}," };
        text.replace(
            "\"policy\": \"cost\",",
            &format!("\"policy\": \"cost\", \"debug_headers\": true,{extra}"),
        )
    };
    let envoy = Envoy::start_workers("envoy.yaml", &ports, WORKERS, edit).unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while servers.iter().any(|s| s.scrapes() < 2) {
        assert!(Instant::now() < deadline, "no scrapes:\n{}", envoy.log_text());
        thread::sleep(Duration::from_millis(20));
    }
    thread::sleep(Duration::from_millis(300));
    let post = |body: &str| {
        let r = envoy
            .post("/v1/chat/completions", &[("content-type", "application/json")], body)
            .unwrap();
        assert_eq!(r.status, 200, "{}", r.body);
        let served = r.header("x-served-by").unwrap_or("").to_string();
        (served, r.header("x-kvroute-reason").unwrap_or("").to_string())
    };
    let out = (0..PAIRS)
        .map(|i| {
            let system = long_prompt(&format!("pair-{i}"));
            let (first, _) = post(&chat_body(&system, "first"));
            thread::sleep(Duration::from_millis(50));
            let (second, reason) = post(&chat_body(&system, "second"));
            (first, second, reason)
        })
        .collect();
    let read = || Exchange {
        applied: envoy.stat("wasmcustom.kvroute.mesh.events_applied"),
        published: envoy.stat("wasmcustom.kvroute.mesh.events_published"),
        unpublished: envoy.stat_if_defined("wasmcustom.kvroute.mesh.events_unpublished"),
        inflight: envoy.stat_if_defined("wasmcustom.kvroute.inflight_requests"),
    };
    // Settled: every request's three events published (the last completions leave at
    // the next tick, after the client has its response) and applied by each other worker.
    // Without sharing nothing is published.
    let events = if share { (2 * PAIRS * 3) as u64 } else { 0 };
    let settled = |x: &Exchange| {
        x.published == events && x.applied == x.published * u64::from(WORKERS - 1) && x.inflight == Some(0)
    };
    let deadline = Instant::now() + Duration::from_secs(5);
    let mut exchange = read();
    while !settled(&exchange) && Instant::now() < deadline {
        thread::sleep(Duration::from_millis(50));
        exchange = read();
    }
    (out, exchange)
}

#[test]
fn every_worker_finds_the_prefix_another_worker_placed() {
    let (pairs, exchange) = pairs(true);
    for (i, (first, second, reason)) in pairs.iter().enumerate() {
        assert_eq!(
            reason, "prefix_hit",
            "pair {i}: the second request did not know the prefix: {pairs:?}"
        );
        assert_eq!(first, second, "pair {i}: {pairs:?}");
    }
    // A request makes three events (routed, first token, completed), each applied by the
    // other workers only: the filter's root on Envoy's main thread serves no traffic and
    // must not read the log too. None is lost on the way, and the gauge counts each
    // request once, by the worker that routed it.
    assert_eq!(exchange.published, (2 * PAIRS * 3) as u64, "{exchange:?}");
    assert_eq!(
        exchange.applied,
        exchange.published * u64::from(WORKERS - 1),
        "{exchange:?}"
    );
    assert_eq!(
        (exchange.unpublished, exchange.inflight),
        (Some(0), Some(0)),
        "{exchange:?}"
    );
}

#[test]
fn without_sharing_workers_route_blind() {
    // The claim above can fail: the same traffic with sharing off leaves the workers that
    // did not place a prefix treating it as cold.
    let (pairs, exchange) = pairs(false);
    let cold = pairs.iter().filter(|(_, _, r)| r == "cold").count();
    assert!(cold >= 1, "every sibling hit its prefix without sharing: {pairs:?}");
    assert_eq!((exchange.applied, exchange.published), (0, 0));
}

/// The filter's configuration as an ECDS resource (a file Envoy watches), with
/// `debug_headers` on or off: changing it replaces the filter's root contexts, as an xDS
/// push of a new plugin configuration does.
fn ecds(debug: bool) -> String {
    format!(
        r#"resources:
  - "@type": type.googleapis.com/envoy.config.core.v3.TypedExtensionConfig
    name: envoy.filters.http.wasm
    typed_config:
      "@type": type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm
      config:
        name: kvroute
        root_id: kvroute
        vm_config:
          vm_id: kvroute
          runtime: envoy.wasm.runtime.v8
          code: {{ local: {{ filename: dist/kvroute.wasm }} }}
        configuration:
          "@type": type.googleapis.com/google.protobuf.StringValue
          value: '{{"cluster_shape": "override_host", "policy": "cost", "debug_headers": {debug}, "scrape": {{"cluster": "vllm_pool", "interval_ms": 200, "timeout_ms": 150}}, "discovery": {{"admin_cluster": "kvroute_admin", "cluster": "vllm_pool"}}}}'
        allow_on_headers_stop_iteration: true
        failure_policy: FAIL_OPEN
"#
    )
}

/// Summed gauges (`index_entries` here) count only the root contexts still reporting: after
/// a configuration update the replaced roots' prefix index leaves the gauge within about
/// 2 s, where each root's last count used to stay in it for good.
#[test]
fn a_configuration_update_leaves_no_stale_count_in_the_summed_gauges() {
    let servers: Vec<FakeVllm> = (0..2).map(|_| FakeVllm::start(Load::idle()).unwrap()).collect();
    let ports: Vec<u16> = servers.iter().map(|s| s.port).collect();
    let dir = std::env::temp_dir().join(format!("kvroute-ecds-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("kvroute.yaml");
    let swap_in = |debug: bool| {
        let tmp = dir.join("next.tmp");
        std::fs::write(&tmp, ecds(debug)).unwrap();
        std::fs::rename(&tmp, &file).unwrap();
    };
    swap_in(false);
    let discovery = format!(
        "                  - name: envoy.filters.http.wasm\n                    config_discovery:\n                      config_source:\n                        path_config_source:\n                          path: {}\n                          watched_directory: {{ path: {} }}\n                      type_urls: [\"type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm\"]\n",
        file.display(),
        dir.display()
    );
    let edit = |text: String| {
        let start = text
            .find("                  - name: envoy.filters.http.wasm\n")
            .unwrap();
        let end = text
            .find("                  - name: envoy.filters.http.router")
            .unwrap();
        // A file-based xDS source needs the node named.
        format!(
            "node: {{ id: kvroute-test, cluster: kvroute-test }}\n{}{discovery}{}",
            &text[..start],
            &text[end..]
        )
    };
    let envoy = Envoy::start_workers("envoy.yaml", &ports, 2, edit).unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while servers.iter().any(|s| s.scrapes() < 2) {
        assert!(Instant::now() < deadline, "no scrapes:\n{}", envoy.log_text());
        thread::sleep(Duration::from_millis(20));
    }
    let post = |body: &str| {
        let r = envoy
            .post("/v1/chat/completions", &[("content-type", "application/json")], body)
            .unwrap();
        assert_eq!(r.status, 200, "{}\n{}", r.body, envoy.log_text());
        r.header("x-kvroute-reason").map(str::to_string)
    };
    for i in 0..20 {
        post(&chat_body(&long_prompt(&format!("before-{i}")), "q"));
    }
    thread::sleep(Duration::from_millis(400));
    let before = envoy.stat("wasmcustom.kvroute.index_entries");
    assert!(before > 0, "the roots indexed nothing:\n{}", envoy.log_text());
    // The update: new root contexts route (their debug header shows it).
    swap_in(true);
    let deadline = Instant::now() + Duration::from_secs(10);
    while post(&chat_body("short", "probe")).is_none() {
        assert!(
            Instant::now() < deadline,
            "the update did not apply:\n{}",
            envoy.log_text()
        );
        thread::sleep(Duration::from_millis(100));
    }
    thread::sleep(Duration::from_secs(3));
    let after = envoy.stat("wasmcustom.kvroute.index_entries");
    eprintln!("index_entries before the update {before}, 3 s after it {after}");
    assert!(
        after < before / 2,
        "the replaced roots' entries still count: {after} (before the update {before})"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

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

//! End to end: gateway replicas (two Envoy processes in front of one fleet) exchange their
//! placements through Envoy itself (`share.replicas`), so a prefix one replica placed is
//! found by the other; only a caller with the shared secret can feed a replica placements;
//! a replica that is down costs the other nothing but failed forwards.

#![allow(clippy::disallowed_methods)] // wall-time end-to-end tests read the clock
#![allow(clippy::unwrap_used)] // test helpers outside #[test] functions

use std::thread;
use std::time::{Duration, Instant};

use kvroute_wasm_tests::envoy::{free_port, repo_root, Envoy};
use kvroute_wasm_tests::fake_vllm::{FakeVllm, Load, MODEL};
use kvroute_wasm_tests::http_client;

const SECRET: &str = "e2e-replica-secret-0123456789";
const PATH: &str = "/kvroute/v1/peer-events";

fn chat_body(system: &str, question: &str) -> String {
    format!(
        r#"{{"model":"{MODEL}","max_tokens":16,"messages":[{{"role":"system","content":"{system}"}},{{"role":"user","content":"{question}"}}]}}"#
    )
}

fn long_prompt(tag: &str) -> String {
    format!("You are the assistant of team {tag}. Follow the house style. ").repeat(60)
}

/// envoy.yaml with the replicas' cluster (envoy/fragments/replicas-cluster.yaml) naming
/// `peers`, and kvroute told to exchange with them (or not).
fn replica_config_every(text: String, peers: [u16; 2], share: bool, interval_ms: u64) -> String {
    let fragment = std::fs::read_to_string(repo_root().join("envoy/fragments/replicas-cluster.yaml")).unwrap();
    let cluster: String = fragment
        .lines()
        .filter(|l| !l.starts_with('#'))
        .collect::<Vec<_>>()
        .join("\n")
        .replace("port_value: 10100", &format!("port_value: {}", peers[0]))
        .replace("port_value: 10200", &format!("port_value: {}", peers[1]));
    let plugin = if share {
        format!(
            r#""policy": "cost", "debug_headers": true, "share": {{"replicas": {{"peers": ["127.0.0.1:{}", "127.0.0.1:{}"], "secret": "{SECRET}", "interval_ms": {interval_ms}}}}},"#,
            peers[0], peers[1]
        )
    } else {
        r#""policy": "cost", "debug_headers": true,"#.to_string()
    };
    text.replace("\"policy\": \"cost\",", &plugin)
        .replace("  clusters:\n", &format!("  clusters:\n{cluster}\n"))
}

struct Pair {
    servers: Vec<FakeVllm>,
    a: Envoy,
    b: Envoy,
}

fn pair(share: bool) -> Pair {
    pair_every(share, 5)
}

fn pair_every(share: bool, interval_ms: u64) -> Pair {
    pair_edited(share, interval_ms, |t| t)
}

/// Like `pair_every`, with `edit` applied to both replicas' configs as well.
fn pair_edited(share: bool, interval_ms: u64, edit: fn(String) -> String) -> Pair {
    let servers: Vec<FakeVllm> = (0..4).map(|_| FakeVllm::start(Load::idle()).unwrap()).collect();
    let ports: Vec<u16> = servers.iter().map(|s| s.port).collect();
    let peers = [free_port(), free_port()];
    let start = |listen: u16| {
        Envoy::start_listening("envoy.yaml", &ports, 2, Some(listen), |t| {
            edit(replica_config_every(t, peers, share, interval_ms))
        })
        .unwrap()
    };
    let (a, b) = (start(peers[0]), start(peers[1]));
    let deadline = Instant::now() + Duration::from_secs(10);
    while servers.iter().any(|s| s.scrapes() < 4) {
        assert!(Instant::now() < deadline, "no scrapes:\n{}", a.log_text());
        thread::sleep(Duration::from_millis(20));
    }
    thread::sleep(Duration::from_millis(300));
    Pair { servers, a, b }
}

fn chat(envoy: &Envoy, body: &str) -> (String, String) {
    let r = envoy
        .post("/v1/chat/completions", &[("content-type", "application/json")], body)
        .unwrap();
    assert_eq!(r.status, 200, "{}", r.body);
    (
        r.header("x-served-by").unwrap_or("").to_string(),
        r.header("x-kvroute-reason").unwrap_or("").to_string(),
    )
}

/// Per pair: (server of the first request, sent to replica A; server and kvroute's reason
/// of its sibling, sent to replica B 200 ms later).
fn across(p: &Pair, pairs: usize) -> Vec<(String, String, String)> {
    across_after(p, pairs, 200)
}

fn across_after(p: &Pair, pairs: usize, gap_ms: u64) -> Vec<(String, String, String)> {
    (0..pairs)
        .map(|i| {
            let system = long_prompt(&format!("replica-pair-{i}"));
            let (first, _) = chat(&p.a, &chat_body(&system, "first"));
            thread::sleep(Duration::from_millis(gap_ms));
            let (second, reason) = chat(&p.b, &chat_body(&system, "second"));
            (first, second, reason)
        })
        .collect()
}

#[test]
fn a_replica_finds_the_prefix_another_replica_placed() {
    let p = pair(true);
    // A starts before B: its first forwards may find B not listening yet.
    let failed_at_start = p.a.stat("wasmcustom.kvroute.replicas.forward_failure");
    let pairs = across(&p, 12);
    for (i, (first, second, reason)) in pairs.iter().enumerate() {
        assert_eq!(reason, "prefix_hit", "pair {i}: {pairs:?}\n{}", p.b.log_text());
        assert_eq!(first, second, "pair {i}: {pairs:?}");
    }
    assert!(p.b.stat("wasmcustom.kvroute.replicas.events_taken") >= 12);
    assert_eq!(p.a.stat("wasmcustom.kvroute.replicas.forward_failure"), failed_at_start);
    for (name, envoy) in [("a", &p.a), ("b", &p.b)] {
        for stat in ["replicas.events_dropped", "replicas.segments_lost", "mesh.events_lost"] {
            let value = envoy.stat_if_defined(&format!("wasmcustom.kvroute.{stat}"));
            assert_eq!(value, Some(0), "{name}: {stat}");
        }
    }
}

#[test]
fn a_placement_leaves_for_the_other_replica_at_once() {
    // Batches every second: only the workers' notice to the scraping service gets a placement
    // to B within the 30 ms before its sibling arrives there.
    let p = pair_every(true, 1000);
    let pairs = across_after(&p, 6, 30);
    for (i, (first, second, reason)) in pairs.iter().enumerate() {
        assert_eq!(reason, "prefix_hit", "pair {i}: {pairs:?}\n{}", p.b.log_text());
        assert_eq!(first, second, "pair {i}: {pairs:?}");
    }
}

#[test]
fn without_the_exchange_a_replica_sees_only_its_own_placements() {
    let p = pair(false);
    let pairs = across(&p, 12);
    assert!(
        pairs.iter().all(|(_, _, r)| r == "cold"),
        "B never saw A's prefixes: {pairs:?}"
    );
}

#[test]
fn only_a_replica_with_the_secret_can_feed_placements_and_nothing_reaches_a_server() {
    let p = pair(true);
    let before: u64 = p.servers.iter().map(FakeVllm::inference_requests).sum();
    let cases: [(&str, Vec<(&str, &str)>); 4] = [
        ("POST", vec![]),
        ("POST", vec![("x-kvroute-peer-secret", "wrong-secret-0123456789")]),
        ("GET", vec![("x-kvroute-peer-secret", SECRET)]),
        ("POST", vec![("x-kvroute-peer-secret", &SECRET[..SECRET.len() - 1])]),
    ];
    for (method, headers) in &cases {
        let r = http_client::request(p.b.port, method, PATH, headers, b"\x0a\x00").unwrap();
        assert_eq!(r.status, 403, "{method} {headers:?}: {}", r.body);
    }
    let r = http_client::request(
        p.b.port,
        "POST",
        PATH,
        &[("x-kvroute-peer-secret", SECRET)],
        b"\xff\xff\xff",
    )
    .unwrap();
    assert_eq!(r.status, 400, "garbage with the secret is refused: {}", r.body);
    let r = http_client::request(p.b.port, "POST", PATH, &[("x-kvroute-peer-secret", SECRET)], b"").unwrap();
    assert_eq!(
        r.status, 400,
        "a batch without a body is answered, not left hanging: {}",
        r.body
    );
    let after: u64 = p.servers.iter().map(FakeVllm::inference_requests).sum();
    assert_eq!(before, after, "a peer-events request reached a vLLM server");
    // Four 403s and the garbage's 400 (the empty body's 400 is not a refused batch). Read
    // until it shows: one admin read failing under load reads as 0 (a CI run saw that once).
    let refused = || p.b.stat("wasmcustom.kvroute.replicas.batches_refused");
    let deadline = Instant::now() + Duration::from_secs(2);
    while refused() < 5 && Instant::now() < deadline {
        thread::sleep(Duration::from_millis(50));
    }
    let n = refused();
    assert!(n >= 5, "{n} batches refused:\n{}", p.b.log_text());
}

/// Every request on the listener is counted under one of kvroute's outcomes, the other
/// replica's batches included: the failing-open alert compares the two
/// (`kvroute:unaccounted_requests:ratio_rate5m`). Without `peer_batch` the batches, here on
/// the inference listener as the README deploys them, read as requests kvroute never saw.
#[test]
fn every_request_on_the_listener_is_counted_under_an_outcome_batches_included() {
    let p = pair(true);
    for i in 0..10 {
        let system = long_prompt(&format!("accounted-{i}"));
        chat(&p.a, &chat_body(&system, "first"));
        chat(&p.b, &chat_body(&system, "second"));
    }
    let _ = http_client::request(p.b.port, "GET", "/not-inference", &[], b"");
    thread::sleep(Duration::from_millis(300));
    let outcomes = [
        "decision.prefix_hit",
        "decision.cold",
        "decision.fallback",
        "decision.shed",
        "passthrough",
    ]
    .iter()
    .chain(&["skipped.over_limit", "skipped.malformed", "skipped.error", "peer_batch"])
    .chain(&["hold.expired", "hold.refused", "hold.gone", "hold.unavailable"])
    .map(|n| format!("wasmcustom.kvroute.{n}"))
    .collect::<Vec<_>>();
    // One read of the admin for both sides: batches keep arriving while it is taken.
    let r = http_client::request(p.b.admin, "GET", "/stats", &[], b"").unwrap();
    let value = |name: &str| -> u64 {
        r.body
            .lines()
            .find_map(|l| l.strip_prefix(&format!("{name}: ")).and_then(|v| v.trim().parse().ok()))
            .unwrap_or(0)
    };
    let listener = value("http.inference.downstream_rq_total");
    let batches = value("wasmcustom.kvroute.peer_batch");
    let counted: u64 = outcomes.iter().map(|n| value(n)).sum();
    assert!(batches > 20, "{batches} batches from the other replica:\n{}", r.body);
    assert!(
        listener.abs_diff(counted) <= 2,
        "the listener saw {listener} requests, kvroute's outcomes count {counted} ({batches} batches):\n{}",
        r.body
    );
}

#[test]
fn a_replica_that_is_down_costs_the_other_only_failed_forwards() {
    let Pair { servers, a, b } = pair(true);
    drop(a);
    for i in 0..10 {
        let (_, reason) = chat(&b, &chat_body(&long_prompt(&format!("alone-{i}")), "q"));
        assert!(reason == "cold" || reason == "prefix_hit", "{reason}");
    }
    thread::sleep(Duration::from_millis(300));
    assert!(b.stat("wasmcustom.kvroute.replicas.forward_failure") > 0);
    drop(servers);
}

#[test]
fn a_batch_ending_in_trailers_is_answered_and_never_reaches_a_server() {
    // Envoy passes HTTP/1.1 trailers on only with enable_trailers (HTTP/2 and 3 always do).
    let p = pair_edited(true, 5, |t| {
        t.replace(
            "accept_http_10: true\n",
            "accept_http_10: true\n                  enable_trailers: true\n",
        )
    });
    let before: u64 = p.servers.iter().map(FakeVllm::inference_requests).sum();
    let garbage = "\u{7f}\u{7f}\u{7f}";
    let raw = format!(
        "POST {PATH} HTTP/1.1\r\nhost: x\r\nx-kvroute-peer-secret: {SECRET}\r\ntransfer-encoding: chunked\r\nconnection: close\r\n\r\n{:x}\r\n{garbage}\r\n0\r\nx-trailer: yes\r\n\r\n",
        garbage.len()
    );
    let r = http_client::request_raw(p.b.port, raw.as_bytes()).unwrap();
    assert_eq!(r.status, 400, "{}", r.body);
    let after: u64 = p.servers.iter().map(FakeVllm::inference_requests).sum();
    assert_eq!(before, after, "a peer batch with trailers reached a vLLM server");
}

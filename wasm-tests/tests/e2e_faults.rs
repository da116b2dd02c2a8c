//! Faults end to end: real Envoy + dist/kvroute.wasm in front of the simulator's live
//! servers, with faults injected at run time through the simulator's admin port. In every
//! scenario Envoy and its wasm VMs stay up, traffic leaves a bad server within 2 s and
//! returns when it recovers, and nothing that could be retried safely is lost.

#![allow(clippy::unwrap_used, clippy::disallowed_methods)] // wall-time test helpers

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::thread::sleep;
use std::time::{Duration, Instant};

use kvroute_sim::bench::Api;
use kvroute_sim::profile::{Gpu, Model, Profile};
use kvroute_sim::workload::{generate, GenParams, Generator};
use kvroute_wasm_tests::envoy::Envoy;
use kvroute_wasm_tests::http_client;

struct Fleet {
    _rt: tokio::runtime::Runtime,
    base: u16,
    envoy: Envoy,
}

fn fleet() -> Fleet {
    fleet_with(|t| t)
}

/// A fleet whose envoy.yaml (debug headers on) is further changed by `edit`.
fn fleet_with(edit: impl Fn(String) -> String) -> Fleet {
    let profile = Profile::new(Gpu::H100_80g, Model::Llama31_8b, 1).unwrap();
    let (rt, base) = kvroute_sim::serve::start_in_background(profile, 4, 20.0).unwrap();
    let ports: Vec<u16> = (base..base + 4).collect();
    let debug = |t: String| {
        edit(t.replace(
            "\"policy\": \"cost\",",
            "\"policy\": \"cost\", \"debug_headers\": true,",
        ))
    };
    let envoy = Envoy::start("envoy.yaml", &ports, debug).unwrap();
    envoy.wait_scraped(4);
    Fleet { _rt: rt, base, envoy }
}

impl Fleet {
    fn fault(&self, server: u16, fault: &str) {
        self.admin(server, "fault", fault);
    }

    /// Sets vLLM's admission limits on one server (`{"max_num_queued_tokens": 0}`...).
    fn admission(&self, server: u16, limits: &str) {
        self.admin(server, "admission", limits);
    }

    /// POSTs `body` to the simulator's `/servers/{server}/{what}`.
    fn admin(&self, server: u16, what: &str, body: &str) {
        let path = format!("/servers/{server}/{what}");
        let r = http_client::request(self.base - 1, "POST", &path, &[], body.as_bytes()).unwrap();
        assert_eq!(r.status, 200, "{}", r.body);
    }

    /// A counter summed over the fleet's `/metrics`.
    fn fleet_counter(&self, family: &str) -> f64 {
        (0..4)
            .map(|i| {
                let r = http_client::request(self.base + i, "GET", "/metrics", &[], b"").unwrap();
                r.body
                    .lines()
                    .filter(|l| l.starts_with(&format!("{family}{{")))
                    .filter_map(|l| l.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok()))
                    .sum::<f64>()
            })
            .sum()
    }

    fn address(&self, server: u16) -> String {
        format!("127.0.0.1:{}", self.base + server)
    }

    /// One chat request with a distinct prompt: (status, endpoint kvroute chose, elapsed).
    fn chat(&self, n: usize) -> (u16, String, Duration) {
        let body = format!(
            r#"{{"model":"m","max_tokens":4,"messages":[{{"role":"user","content":"{} question {n}"}}]}}"#,
            format!("prompt family {n} ").repeat(30)
        );
        let start = Instant::now();
        let r = http_client::request(self.envoy.port, "POST", "/v1/chat/completions", &[], body.as_bytes()).unwrap();
        if r.status != 200 {
            // Envoy's response details say which attempt failed how (kept for a flaky run).
            eprintln!(
                "request {n}: {} from {:?}: {:?} {}",
                r.status,
                r.header("x-kvroute-endpoint"),
                r.header("x-envoy-upstream-service-time"),
                &r.body[..r.body.len().min(300)]
            );
        }
        (
            r.status,
            r.header("x-kvroute-endpoint").unwrap_or("").to_string(),
            start.elapsed(),
        )
    }

    /// Sends `n` requests; returns how many kvroute sent to `server` and the failures.
    fn traffic(&self, n: usize, server: u16, offset: usize) -> (usize, Vec<u16>) {
        let mut chosen = 0;
        let mut failures = Vec::new();
        for i in 0..n {
            let (status, endpoint, _) = self.chat(offset + i);
            if endpoint == self.address(server) {
                chosen += 1;
            }
            if status != 200 {
                failures.push(status);
            }
        }
        (chosen, failures)
    }

    fn assert_vms_up(&mut self) {
        assert!(self.envoy.alive(), "Envoy died");
        // Under `FAIL_OPEN` a VM that panicked is not reloaded: only its log tells.
        let log = self.envoy.log_text();
        assert!(!log.contains("kvroute panicked"), "a VM panicked:\n{log}");
        for stat in [
            "wasm.kvroute.vm_reload",
            "wasm.kvroute.vm_reload_failure",
            "wasm.kvroute.scraper.vm_reload",
        ] {
            assert_eq!(self.envoy.stat(stat), 0, "{stat}");
        }
    }
}

#[test]
fn broken_metrics_take_a_server_out_within_two_seconds_and_back_after_recovery() {
    let mut f = fleet();
    // `cut`: the server drops the connection halfway through its answer (Envoy then hands
    // the filter a call with no response at all: reading its status must not panic).
    for (i, mode) in ["garbage", "404", "huge", "labelbomb", "cut"].into_iter().enumerate() {
        f.fault(1, &format!(r#"{{"metrics":"{mode}"}}"#));
        sleep(Duration::from_secs(2));
        let (chosen, failures) = f.traffic(24, 1, 1000 * i);
        assert_eq!(chosen, 0, "{mode}: kvroute still chose the server with broken metrics");
        assert!(failures.is_empty(), "{mode}: {failures:?}");
        f.fault(1, "{}");
        sleep(Duration::from_secs(2));
        let (chosen, failures) = f.traffic(40, 1, 1000 * i + 500);
        assert!(chosen > 0, "{mode}: the recovered server got no traffic");
        assert!(failures.is_empty(), "{mode}: {failures:?}");
    }
    assert!(f.envoy.stat("wasmcustom.kvroute.scrape.failure") >= 8);
    f.assert_vms_up();
}

#[test]
fn bursts_of_5xx_eject_a_server_by_passive_health() {
    // An ejection long enough to outlast both phases on a busy CI machine (with the default
    // 5 s, a slow first phase let the ejection expire and one probe reached the server).
    let mut f = fleet_with(|t| {
        t.replace(
            "\"policy\": \"cost\",",
            "\"policy\": \"cost\", \"health\": {\"eject_ms\": 60000},",
        )
    });
    f.fault(2, r#"{"error_rate": 1.0}"#);
    // Until the ejection (3 consecutive failures in each of Envoy's 2 workers, whose routers
    // learn separately) some requests get the 500s: never more than 3 per worker. Envoy
    // hands each connection to a worker as it accepts it, so how many requests a worker
    // needs to see three failures varies (60 were once not enough for one of them): send
    // until both have logged the ejection.
    let ejections = |f: &Fleet| f.envoy.log_text().matches("passive health: Ejected").count();
    let (mut early, mut sent) = (Vec::new(), 0);
    while ejections(&f) < 2 && sent < 400 {
        early.extend(f.traffic(20, 2, sent).1);
        sent += 20;
    }
    assert_eq!(ejections(&f), 2, "after {sent} requests: {early:?}");
    assert!(early.iter().all(|s| *s == 500) && early.len() <= 6, "{early:?}");
    let (chosen, failures) = f.traffic(30, 2, 1000);
    assert_eq!((chosen, failures.len()), (0, 0), "the failing server was not ejected");
    f.assert_vms_up();
}

/// vLLM's admission limits answer 503 before any work. With the opt-in 503 retry (see
/// `retry_on` in envoy.yaml) and `overload.refused_ms`, Envoy retries on kvroute's next
/// server, kvroute stops choosing the refusing one, and every request is generated once.
#[test]
fn with_503_retries_on_a_refusing_server_loses_nothing_and_is_avoided() {
    let mut f = fleet_with(|t| {
        let retry = "retry_on: connect-failure,reset-before-request,refused-stream,reset\n";
        assert!(t.contains(retry));
        let indent = " ".repeat(30);
        t.replace(
            "\"policy\": \"cost\",",
            "\"policy\": \"cost\", \"overload\": {\"refused_ms\": 60000},",
        )
        .replace(
            retry,
            &format!(
                "retry_on: connect-failure,reset-before-request,refused-stream,reset,retriable-status-codes\n{indent}retriable_status_codes: [503]\n"
            ),
        )
    });
    // A token limit of 0: server 1 refuses everything, as a full server (vLLM refuses once
    // the prompts in prefill reach the limit, the new one not counted).
    f.admission(1, r#"{"max_num_queued_tokens": 0}"#);
    let (chosen, failures) = f.traffic(60, 1, 0);
    assert!(failures.is_empty(), "a refusal reached the client: {failures:?}");
    // Each of Envoy's 2 workers may pick it once before its own refusal or its peer's
    // tells it (a cold prefix goes to its rendezvous owner: a quarter of them here).
    assert!(chosen <= 2, "kvroute kept choosing the refusing server: {chosen} of 60");
    assert!(chosen >= 1, "server 1 was never chosen: the test proves nothing");
    let retries = f.envoy.stat("cluster.vllm_pool.upstream_rq_retry");
    assert_eq!(retries, chosen as u64, "one retry per refusal");
    assert_eq!(f.envoy.stat("wasmcustom.kvroute.refused.moved"), chosen as u64);
    sleep(Duration::from_millis(300));
    assert_eq!(
        f.fleet_counter("vllm:request_success_total"),
        60.0,
        "each request generated once"
    );

    // Every server refuses: the client gets the 503 quickly and nobody is ejected for it.
    for s in 0..4 {
        f.admission(s, r#"{"max_num_queued_tokens": 0}"#);
    }
    for n in 0..8 {
        let (status, _, took) = f.chat(100 + n);
        assert_eq!(status, 503);
        assert!(took < Duration::from_secs(2), "a 503 took {took:?}");
    }
    assert_eq!(f.envoy.stat("wasmcustom.kvroute.refused.by_server"), 8);
    for s in 0..4 {
        f.admission(s, "{}");
    }
    let (chosen, failures) = f.traffic(40, 0, 200);
    assert!(failures.is_empty(), "after the limits are lifted: {failures:?}");
    assert!(chosen > 0, "server 0 was ejected for its 503s");
    f.assert_vms_up();
}

/// The shipped config passes vLLM's 503 on (no retry) and ejects nobody for it.
#[test]
fn a_503_refusal_reaches_the_client_once_and_ejects_nobody() {
    let mut f = fleet();
    f.admission(2, r#"{"max_num_queued_tokens": 0}"#);
    let (chosen, failures) = f.traffic(40, 2, 0);
    assert!(chosen >= 1, "server 2 was never chosen: the test proves nothing");
    assert_eq!(
        failures,
        vec![503; chosen],
        "each request sent to server 2 gets its 503"
    );
    assert_eq!(f.envoy.stat("cluster.vllm_pool.upstream_rq_retry"), 0);
    assert_eq!(f.envoy.stat("wasmcustom.kvroute.refused.by_server"), chosen as u64);
    f.admission(2, "{}");
    let (chosen, failures) = f.traffic(40, 2, 100);
    assert!(
        failures.is_empty() && chosen >= 1,
        "server 2 was ejected: chosen {chosen}, {failures:?}"
    );
    f.assert_vms_up();
}

/// A client cannot ask the gateway to retry what a server may have generated: with the
/// shipped listener (clients connect directly: Envoy takes them as external) Envoy ignores a
/// client's `x-envoy-retry-on` / `x-envoy-max-retries`. Behind a trusted proxy that makes
/// requests internal, strip `x-envoy-*` there.
#[test]
fn a_client_cannot_make_the_gateway_retry_a_500() {
    let f = fleet();
    for s in 0..4 {
        f.fault(s, r#"{"error_rate": 1.0}"#);
    }
    let body = r#"{"model":"m","max_tokens":4,"messages":[{"role":"user","content":"retry me"}]}"#;
    let headers = [("x-envoy-retry-on", "5xx"), ("x-envoy-max-retries", "3")];
    let r = http_client::request(f.envoy.port, "POST", "/v1/chat/completions", &headers, body.as_bytes()).unwrap();
    assert_eq!(r.status, 500);
    assert_eq!(
        f.envoy.stat("cluster.vllm_pool.upstream_rq_retry"),
        0,
        "the client's retry headers were honoured"
    );
}

#[test]
fn with_every_server_down_envoy_answers_503_quickly_and_recovers() {
    let mut f = fleet();
    for s in 0..4 {
        f.fault(s, r#"{"down": true}"#);
    }
    sleep(Duration::from_millis(800));
    for n in 0..10 {
        let (status, _, took) = f.chat(n);
        assert_eq!(status, 503);
        assert!(took < Duration::from_secs(2), "a 503 took {took:?}");
    }
    for s in 0..4 {
        f.fault(s, "{}");
    }
    sleep(Duration::from_secs(1));
    let (_, failures) = f.traffic(20, 0, 100);
    assert!(failures.is_empty(), "{failures:?}");
    f.assert_vms_up();
}

#[test]
fn a_flapping_server_loses_no_request_and_returns_when_stable() {
    let mut f = fleet();
    let mut n = 0;
    for _ in 0..3 {
        f.fault(3, r#"{"down": true}"#);
        let (_, failures) = f.traffic(15, 3, n);
        assert!(failures.is_empty(), "down phase: {failures:?}");
        f.fault(3, "{}");
        let (_, failures) = f.traffic(15, 3, n + 15);
        assert!(failures.is_empty(), "up phase: {failures:?}");
        n += 30;
    }
    sleep(Duration::from_secs(2));
    let (chosen, failures) = f.traffic(40, 3, n);
    assert!(
        chosen > 0 && failures.is_empty(),
        "chosen {chosen}, failures {failures:?}"
    );
    f.assert_vms_up();
}

/// A streamed request on its own connection, read up to the end of its response headers;
/// with the server kvroute chose (its debug header, empty when absent).
fn open_stream(port: u16, body: &str) -> (BufReader<TcpStream>, String) {
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    write!(
        s,
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nconnection: close\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut reader = BufReader::new(s);
    let mut chosen = String::new();
    loop {
        let mut line = String::new();
        reader.read_line(&mut line).unwrap();
        if let Some(v) = line.to_lowercase().strip_prefix("x-kvroute-endpoint:") {
            chosen = v.trim().to_string();
        }
        if line == "\r\n" || line.is_empty() {
            return (reader, chosen);
        }
    }
}

#[test]
fn a_server_killed_mid_stream_cuts_that_stream_only() {
    let mut f = fleet();
    let body =
        r#"{"model":"m","max_tokens":3000,"stream":true,"messages":[{"role":"user","content":"tell a long story"}]}"#;
    let (mut reader, chosen) = open_stream(f.envoy.port, body);
    let server = chosen.rsplit(':').next().and_then(|p| p.parse::<u16>().ok()).unwrap() - f.base;
    sleep(Duration::from_millis(300));
    f.fault(server, r#"{"down": true}"#);
    let mut rest = String::new();
    let _ = reader.read_to_string(&mut rest);
    assert!(rest.contains("data: {"), "the stream had started");
    assert!(!rest.contains("[DONE]"), "the stream should have been cut");
    let (_, failures) = f.traffic(20, server, 0);
    assert!(failures.is_empty(), "new requests failed: {failures:?}");
    f.assert_vms_up();
}

/// A fleet behind the test-only build that panics on `x-kvroute-test-panic`, under `policy`.
fn panicking_fleet(policy: &'static str) -> Fleet {
    let root = kvroute_wasm_tests::envoy::repo_root();
    assert!(
        root.join("dist/kvroute-test-panic.wasm").exists(),
        "run `make build-wasm-test-panic`"
    );
    fleet_with(move |t| {
        t.replace("dist/kvroute.wasm", "dist/kvroute-test-panic.wasm")
            .replace("failure_policy: FAIL_OPEN", &format!("failure_policy: {policy}"))
    })
}

const HELLO: &str = r#"{"model":"m","max_tokens":4,"messages":[{"role":"user","content":"hello"}]}"#;

#[test]
fn a_panicking_filter_fails_open_and_requests_are_still_served() {
    let mut f = panicking_fleet("FAIL_OPEN");
    let (port, admin) = (f.envoy.port, f.envoy.admin);
    let post = |headers: &[(&str, &str)]| {
        http_client::request(port, "POST", "/v1/chat/completions", headers, HELLO.as_bytes()).map(|r| r.status)
    };
    assert_eq!(post(&[]).unwrap(), 200);
    // The request that crashes its worker's VM gets whatever Envoy answers; every later
    // request, on either worker, must be served (FAIL_OPEN: without kvroute, balanced by
    // the cluster's fallback policy; the client's destination header is still stripped by
    // Envoy's header_mutation filter).
    let crashed = post(&[("x-kvroute-test-panic", "1")]);
    let crashed_again = post(&[("x-kvroute-test-panic", "1")]);
    for i in 0..20 {
        let admin = format!("127.0.0.1:{admin}");
        let status = post(&[("x-gateway-destination-endpoint", admin.as_str())]).unwrap();
        assert_eq!(
            status, 200,
            "request {i} after the panics ({crashed:?}, {crashed_again:?})"
        );
    }
    assert!(f.envoy.alive(), "Envoy died");
    assert!(f.envoy.log_text().contains("panicked"), "the panic hook did not log");
    eprintln!("panicking requests got: {crashed:?}, {crashed_again:?}");
}

/// The gateway's `inflight_requests` (like `index_entries` and `hold.waiting`) is the sum
/// over the worker VMs still reporting: a VM that crashed (`FAIL_OPEN` does not reload it)
/// drops out within `gauges::STALE_MS` (2 s), where it used to leave its last count for
/// good. Also what such a crash does to the streams in flight: the crashed worker's are cut,
/// the other worker's run to their end.
#[test]
fn a_crashed_workers_requests_leave_the_in_flight_gauge() {
    let f = panicking_fleet("FAIL_OPEN");
    let port = f.envoy.port;
    let inflight = || f.envoy.stat("wasmcustom.kvroute.inflight_requests");
    let body =
        r#"{"model":"m","max_tokens":30000,"stream":true,"messages":[{"role":"user","content":"tell a long story"}]}"#;
    // Each stream on its own connection: Envoy spreads connections over its 2 workers.
    let t0 = Instant::now();
    let streams: Vec<_> = (0..16).map(|_| open_stream(port, body).0).collect();
    sleep(Duration::from_millis(400));
    assert_eq!(inflight(), 16, "every stream counted while it runs");
    let crashed = http_client::request(
        port,
        "POST",
        "/v1/chat/completions",
        &[("x-kvroute-test-panic", "1")],
        HELLO.as_bytes(),
    )
    .map(|r| r.status);
    // Past the 2 s after which a silent VM's row no longer counts, streams still running.
    sleep(Duration::from_secs(3));
    let survivors = inflight();
    let mut cut = 0;
    for mut s in streams {
        let mut rest = String::new();
        let _ = s.read_to_string(&mut rest); // a cut stream may end in a reset
        cut += usize::from(!rest.contains("[DONE]"));
    }
    let ran = t0.elapsed();
    assert!(
        f.envoy.log_text().contains("kvroute panicked"),
        "no VM crashed ({crashed:?})"
    );
    eprintln!("crash with 16 streams open: {cut} cut, {survivors} on the other worker ran to their end ({ran:?})");
    assert!(
        ran > Duration::from_secs(5),
        "the streams ended before the gauge was read: {ran:?}"
    );
    assert_eq!(
        cut + survivors as usize,
        16,
        "the gauge counts the surviving worker's streams, and only its streams ran to their end"
    );
    assert!(cut > 0, "the crashed worker routed none of the 16 streams: run again");
    sleep(Duration::from_millis(300));
    assert_eq!(inflight(), 0);
}

/// The alternative failure policy, measured so the README can say what it does: FAIL_RELOAD
/// brings routing back after a crash (a new VM per crash), but while Envoy backs off between
/// reloads (1 s by default) the worker's innocent requests fail (503 or a reset), which is why the
/// shipped configs keep FAIL_OPEN.
#[test]
fn fail_reload_restores_routing_after_a_crash() {
    let mut f = panicking_fleet("FAIL_RELOAD");
    let port = f.envoy.port;
    let post = |headers: &[(&str, &str)]| {
        http_client::request(port, "POST", "/v1/chat/completions", headers, HELLO.as_bytes())
            .map(|r| (r.status, r.header("x-kvroute-reason").unwrap_or("").to_string()))
            .unwrap_or((0, String::new())) // 0: the connection was reset
    };
    assert_eq!(post(&[]).0, 200);
    let mut innocent_failed = 0;
    for _ in 0..6 {
        assert_ne!(post(&[("x-kvroute-test-panic", "1")]).0, 200);
        innocent_failed += usize::from(post(&[]).0 != 200);
    }
    // After the last backoff, every request is served and routed by a reloaded VM.
    sleep(Duration::from_millis(2500));
    for i in 0..10 {
        let (status, reason) = post(&[]);
        assert_eq!(status, 200, "request {i} after the reloads");
        assert!(
            ["cold", "prefix_hit", "fallback_no_metrics"].contains(&reason.as_str()),
            "request {i}: reason {reason:?}: kvroute is not routing"
        );
    }
    assert!(f.envoy.alive(), "Envoy died");
    assert!(
        f.envoy.stat("wasm.kvroute.vm_reload_success") >= 1,
        "no VM was reloaded"
    );
    eprintln!(
        "FAIL_RELOAD: {innocent_failed} of 6 requests sent right after a crash failed (503 or reset); reloads: {}, backoffs: {}",
        f.envoy.stat("wasm.kvroute.vm_reload_success"),
        f.envoy.stat("wasm.kvroute.vm_reload_backoff")
    );
}

#[test]
fn a_hung_server_costs_one_per_try_timeout_at_most_then_is_avoided() {
    // The shipped configs have no per-try timeout (it would cut long non-streaming generations
    // and run them again, issue 13); a gateway that serves only streams may opt into one.
    let mut f = fleet_with(|t| {
        t.replace(
            "                              num_retries: 2",
            "                              per_try_timeout: 2s\n                              num_retries: 2",
        )
    });
    f.fault(1, r#"{"hang": true}"#);
    // A request that reaches the hung server is retried elsewhere after the per-try timeout.
    for n in 0..16 {
        let (status, _, took) = f.chat(n);
        assert_eq!(status, 200, "request {n}");
        assert!(took < Duration::from_secs(4), "request {n} took {took:?}");
    }
    // Its scrapes time out (150 ms, twice in a row): kvroute stops choosing it.
    sleep(Duration::from_secs(2));
    let (chosen, failures) = f.traffic(24, 1, 100);
    assert_eq!((chosen, failures.len()), (0, 0), "the hung server was still chosen");
    f.fault(1, "{}");
    sleep(Duration::from_secs(2));
    let (chosen, failures) = f.traffic(40, 1, 200);
    assert!(
        chosen > 0 && failures.is_empty(),
        "chosen {chosen}, failures {failures:?}"
    );
    f.assert_vms_up();
}

#[test]
fn a_slow_server_gets_a_smaller_share() {
    let mut f = fleet();
    f.fault(0, r#"{"slow": 10}"#);
    sleep(Duration::from_millis(500));
    // Concurrent traffic (the simulator's load generator), distinct prefixes.
    let p = GenParams {
        rate: 60.0,
        groups: 256,
        prompts_per_group: 1,
        output_tokens: 16,
        ..GenParams::defaults(Generator::SharedPrefix)
    };
    let reqs = generate(Generator::SharedPrefix, &p);
    let url = format!("http://127.0.0.1:{}", f.envoy.port);
    let (run, servers) = f
        ._rt
        .block_on(kvroute_sim::bench::quiet(&url, Api::Chat, &reqs, 60.0, "slow"))
        .unwrap();
    assert_eq!(run.failed, 0);
    let slow = servers
        .iter()
        .position(|s| *s == f.address(0))
        .map_or(0.0, |i| run.per_server[i].share);
    // Relational: clearly less than the healthy servers get on average.
    let others = (1.0 - slow) / 3.0;
    assert!(
        slow < 0.75 * others,
        "the slow server got {:.0}% of the requests, the others {:.0}% each on average",
        slow * 100.0,
        others * 100.0
    );
    f.assert_vms_up();
}

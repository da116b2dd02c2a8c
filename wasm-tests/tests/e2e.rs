//! End to end: real Envoy 1.40 + dist/kvroute.wasm in front of test vLLM servers, for both
//! shipped cluster shapes (`override_host` in envoy.yaml, `ORIGINAL_DST` in
//! envoy-original-dst.yaml).

#![allow(clippy::disallowed_methods)] // wall-time end-to-end tests read the clock
#![allow(clippy::unwrap_used)] // test helpers outside #[test] functions

use std::collections::BTreeMap;
use std::thread;
use std::time::{Duration, Instant};

use kvroute_wasm_tests::envoy::Envoy;
use kvroute_wasm_tests::fake_vllm::{FakeVllm, Load, MODEL};
use kvroute_wasm_tests::http_client::{self, Response};

const SHAPES: [&str; 2] = ["envoy.yaml", "envoy-original-dst.yaml"];

struct Fleet {
    servers: Vec<FakeVllm>,
    envoy: Envoy,
}

fn debug_headers(text: String) -> String {
    text.replace(
        "\"policy\": \"cost\",",
        "\"policy\": \"cost\", \"debug_headers\": true,",
    )
}

fn fleet(config: &str, loads: Vec<Load>) -> Fleet {
    let servers: Vec<FakeVllm> = loads.into_iter().map(|l| FakeVllm::start(l).unwrap()).collect();
    let ports: Vec<u16> = servers.iter().map(|s| s.port).collect();
    let envoy = Envoy::start(config, &ports, debug_headers).unwrap();
    let fleet = Fleet { servers, envoy };
    fleet.wait_for_scrapes();
    fleet
}

impl Fleet {
    /// Waits until every server was scraped twice and a snapshot reached the workers.
    fn wait_for_scrapes(&self) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while self.servers.iter().any(|s| s.scrapes() < 2) {
            assert!(
                Instant::now() < deadline,
                "servers were not scraped:\n{}",
                self.envoy.log_text()
            );
            thread::sleep(Duration::from_millis(20));
        }
        thread::sleep(Duration::from_millis(300));
    }

    fn chat(&self, system: &str, question: &str) -> (u16, String, String) {
        let body = chat_body(system, question, false);
        let r = self
            .envoy
            .post("/v1/chat/completions", &[("content-type", "application/json")], &body)
            .unwrap();
        let served = r.header("x-served-by").unwrap_or("").to_string();
        let reason = r.header("x-kvroute-reason").unwrap_or("").to_string();
        (r.status, served, reason)
    }

    fn send(&self, path: &str, headers: &[(&str, &str)], body: &str) -> Response {
        self.envoy.post(path, headers, body).unwrap()
    }

    fn stat(&self, name: &str) -> u64 {
        self.envoy.stat(&format!("wasmcustom.kvroute.{name}"))
    }
}

fn chat_body(system: &str, question: &str, stream: bool) -> String {
    format!(
        r#"{{"model":"{MODEL}","stream":{stream},"max_tokens":16,"messages":[{{"role":"system","content":"{system}"}},{{"role":"user","content":"{question}"}}]}}"#
    )
}

fn long_prompt(tag: &str) -> String {
    format!("You are the assistant of team {tag}. Follow the house style. ").repeat(60)
}

#[test]
fn heavily_loaded_server_gets_almost_no_requests() {
    for shape in SHAPES {
        let f = fleet(shape, vec![Load::heavy(), Load::idle(), Load::idle(), Load::idle()]);
        let mut by_server = BTreeMap::new();
        for i in 0..40 {
            let (status, served, _) = f.chat(&long_prompt(&format!("t{i}")), "hello");
            assert_eq!(status, 200, "{shape}");
            *by_server.entry(served).or_insert(0) += 1;
        }
        let heavy = by_server.get(&f.servers[0].address()).copied().unwrap_or(0);
        assert!(
            heavy <= 1,
            "{shape}: the loaded server got {heavy} of 40: {by_server:?}"
        );
        assert!(
            by_server.len() >= 3,
            "{shape}: idle servers should share the load: {by_server:?}"
        );
    }
}

#[test]
fn requests_sharing_a_long_prefix_land_on_one_server_and_distinct_prefixes_spread() {
    for shape in SHAPES {
        let f = fleet(shape, vec![Load::idle(), Load::idle(), Load::idle(), Load::idle()]);
        let system = long_prompt("shared");
        let served: Vec<String> = (0..20).map(|i| f.chat(&system, &format!("question {i}")).1).collect();
        assert!(
            served.iter().all(|s| *s == served[0]),
            "{shape}: one prefix, several servers: {served:?}"
        );
        let reasons: Vec<String> = (0..5).map(|i| f.chat(&system, &format!("again {i}")).2).collect();
        assert!(reasons.iter().all(|r| r == "prefix_hit"), "{shape}: {reasons:?}");
        let spread: std::collections::BTreeSet<String> = (0..24)
            .map(|i| f.chat(&long_prompt(&format!("group-{i}")), "q").1)
            .collect();
        assert!(
            spread.len() >= 3,
            "{shape}: distinct prefixes should spread: {spread:?}"
        );
        // One cold decision per worker VM at most, then hits (19 + 5 of the 25 siblings).
        assert!(f.stat("decision.prefix_hit") >= 23, "{shape}: prefix hits not counted");
    }
}

#[test]
fn a_killed_server_stops_receiving_requests_within_two_seconds() {
    for shape in SHAPES {
        let f = fleet(shape, vec![Load::idle(), Load::idle(), Load::idle(), Load::idle()]);
        let victim = f.servers[1].address();
        f.servers[1].kill();
        let killed_at = Instant::now();
        let mut late_choices_of_victim = 0;
        let mut failures = Vec::new();
        let mut n = 0;
        while killed_at.elapsed() < Duration::from_secs(3) {
            let body = chat_body(&long_prompt(&format!("k{n}")), "q", false);
            let r = f.send("/v1/chat/completions", &[], &body);
            let elapsed = killed_at.elapsed();
            if r.header("x-kvroute-endpoint") == Some(victim.as_str()) && elapsed > Duration::from_secs(2) {
                late_choices_of_victim += 1;
            }
            // override_host retries a refused connection on the next listed host, so every
            // request succeeds; ORIGINAL_DST names one host, so requests may fail until the
            // scrapes mark the server down (a reason to prefer override_host).
            let must_succeed = shape == "envoy.yaml" || elapsed > Duration::from_secs(1);
            if r.status != 200 && must_succeed {
                failures.push((elapsed, r.status));
            }
            n += 1;
            thread::sleep(Duration::from_millis(20));
        }
        assert_eq!(
            late_choices_of_victim, 0,
            "{shape}: the dead server was still chosen after 2 s"
        );
        assert!(
            failures.is_empty(),
            "{shape}: requests failed after the kill: {failures:?}"
        );
        assert!(n > 30, "{shape}: only {n} requests in 3 s");
        assert!(f.stat("scrape.failure") >= 2, "{shape}: scrape failures not counted");
    }
}

#[test]
fn a_client_sent_destination_header_is_ignored() {
    for shape in SHAPES {
        let f = fleet(shape, vec![Load::heavy(), Load::idle(), Load::idle(), Load::idle()]);
        let heavy = f.servers[0].address();
        for i in 0..10 {
            let body = chat_body(&long_prompt(&format!("h{i}")), "q", false);
            let r = f.send(
                "/v1/chat/completions",
                &[("x-gateway-destination-endpoint", heavy.as_str())],
                &body,
            );
            assert_eq!(r.status, 200);
            assert_ne!(
                r.header("x-served-by"),
                Some(heavy.as_str()),
                "{shape}: the client chose the server"
            );
        }
        // A header naming an address outside the pool (Envoy's own admin port) on a path the
        // gateway does not serve must not reach it: the listener answers its own 404.
        let admin = format!("127.0.0.1:{}", f.envoy.admin);
        let r = http_client::request(
            f.envoy.port,
            "GET",
            "/stats",
            &[("x-gateway-destination-endpoint", admin.as_str())],
            b"",
        )
        .unwrap();
        assert_eq!(
            r.status,
            404,
            "{shape}: reached {admin}: {}",
            &r.body[..r.body.len().min(200)]
        );
        assert!(
            r.header("x-served-by").is_none() && r.body.contains("Not served by the gateway"),
            "{shape}: not the listener's own 404"
        );
    }
}

#[test]
fn servers_exporting_only_legacy_metric_names_are_scored_by_load() {
    for shape in SHAPES {
        let servers: Vec<FakeVllm> = [Load::heavy(), Load::idle(), Load::idle()]
            .into_iter()
            .map(|l| FakeVllm::start(l).unwrap())
            .collect();
        for s in &servers {
            s.set_legacy_names(true);
        }
        let ports: Vec<u16> = servers.iter().map(|s| s.port).collect();
        let envoy = Envoy::start(shape, &ports, debug_headers).unwrap();
        let f = Fleet { servers, envoy };
        f.wait_for_scrapes();
        for i in 0..20 {
            let (status, served, reason) = f.chat(&long_prompt(&format!("l{i}")), "q");
            assert_eq!(status, 200, "{shape}");
            assert_ne!(
                served,
                f.servers[0].address(),
                "{shape}: request {i} went to the loaded server ({reason})"
            );
            assert_eq!(reason, "cold", "{shape}");
        }
    }
}

#[test]
fn odd_requests_pass_and_envoy_stays_healthy() {
    for shape in SHAPES {
        let mut f = fleet(shape, vec![Load::idle(), Load::idle()]);
        let json = [("content-type", "application/json")];
        let r = f.send("/v1/chat/completions", &json, "{not json");
        assert_eq!(
            (r.status, r.header("x-kvroute-reason")),
            (200, Some("malformed")),
            "{shape}"
        );
        let huge = chat_body(&"x".repeat(5 << 20), "q", false);
        let r = f.send("/v1/chat/completions", &json, &huge);
        assert_eq!(
            (r.status, r.header("x-kvroute-reason")),
            (200, Some("over_limit")),
            "{shape}"
        );
        let r = http_client::request(f.envoy.port, "GET", "/v1/models", &[], b"").unwrap();
        assert_eq!(
            (r.status, r.header("x-kvroute-reason")),
            (200, Some("passthrough")),
            "{shape}"
        );
        let r = f.send("/v1/unknown", &json, "{}");
        assert_eq!(r.status, 404, "{shape}: {:?} {}", r.headers, r.body);
        let r = f.send("/v1/chat/completions", &json, &chat_body("stream me", "q", true));
        assert_eq!(r.status, 200, "{shape}");
        assert!(r.body.contains("data: [DONE]"), "{shape}: {}", r.body);
        let r = f.send(
            "/v1/completions",
            &json,
            &format!(r#"{{"model":"{MODEL}","prompt":[1,2,3]}}"#),
        );
        assert_eq!((r.status, r.header("x-kvroute-reason")), (200, Some("cold")), "{shape}");
        assert!(f.envoy.alive(), "{shape}: Envoy died");
        assert_eq!(
            f.envoy.stat("wasm.kvroute.vm_reload"),
            0,
            "{shape}: the wasm VM was reloaded"
        );
        assert_eq!(f.stat("skipped.malformed"), 1, "{shape}");
        assert_eq!(f.stat("skipped.over_limit"), 1, "{shape}");
        assert!(f.stat("passthrough") >= 2, "{shape}");
    }
}

/// Envoy passes header values with bytes above 0x7f (obs-text) to the filter; none of them
/// may crash its VM, whichever header they are in.
#[test]
fn header_values_that_are_not_utf8_neither_crash_the_vm_nor_stop_routing() {
    for shape in SHAPES {
        let mut f = fleet(shape, vec![Load::idle(), Load::idle()]);
        let body = chat_body("obs-text headers", "q", false);
        for header in [
            "x-kvroute-tenant",
            "x-gateway-destination-endpoint",
            "x-kvroute-priority",
            "content-type",
        ] {
            let mut raw = format!(
                "POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1\r\nconnection: close\r\ncontent-length: {}\r\n",
                body.len()
            )
            .into_bytes();
            raw.extend_from_slice(header.as_bytes());
            raw.extend_from_slice(b": caf\xe9 \xff\xfe\r\n\r\n");
            raw.extend_from_slice(body.as_bytes());
            let r = http_client::request_raw(f.envoy.port, &raw)
                .unwrap_or_else(|e| panic!("{shape} {header}: {e}\n{}", f.envoy.log_text()));
            assert_eq!(r.status, 200, "{shape} {header}: {:?} {}", r.headers, r.body);
        }
        // The VM still routes afterwards.
        let (status, _, reason) = f.chat("after obs-text", "q");
        assert_eq!((status, reason.as_str()), (200, "cold"), "{shape}");
        assert!(f.envoy.alive(), "{shape}: Envoy died");
        assert_eq!(f.envoy.stat("wasm.kvroute.vm_reload"), 0, "{shape}");
        assert_eq!(f.stat("skipped.error"), 0, "{shape}");
        assert!(
            !f.envoy.log_text().contains("panicked"),
            "{shape}: {}",
            f.envoy.log_text()
        );
    }
}

#[test]
fn stats_move_as_the_decisions_did() {
    for shape in SHAPES {
        let f = fleet(shape, vec![Load::idle(), Load::idle(), Load::idle()]);
        let system = long_prompt("stats");
        let mut reasons = BTreeMap::new();
        for i in 0..12 {
            let (_, _, reason) = f.chat(&system, &format!("q{i}"));
            *reasons.entry(reason).or_insert(0u64) += 1;
        }
        // Each of Envoy's 2 worker VMs keeps its own index, so a prefix is cold once per worker
        // (rendezvous hashing still sends both to the same server).
        let cold = reasons.get("cold").copied().unwrap_or(0);
        assert!((1..=2).contains(&cold), "{shape}: {reasons:?}");
        assert_eq!(
            reasons.get("prefix_hit").copied().unwrap_or(0) + cold,
            12,
            "{shape}: {reasons:?}"
        );
        assert_eq!(f.stat("decision.cold"), cold, "{shape}");
        assert_eq!(f.stat("decision.prefix_hit"), 12 - cold, "{shape}");
        let chosen: u64 = f
            .servers
            .iter()
            .map(|s| f.stat(&format!("endpoint.127_0_0_1_{}.chosen", s.port)))
            .sum();
        assert_eq!(chosen, 12, "{shape}");
        let (prompt, cached) = (f.stat("tokens.prompt"), f.stat("tokens.predicted_cached"));
        assert!(
            cached > 0 && prompt > cached,
            "{shape}: prompt {prompt}, predicted cached {cached}"
        );
        assert!(f.stat("scrape.success") >= 6, "{shape}");
        assert_eq!(f.stat("scrape.healthy_endpoints"), 3, "{shape}");
        assert_eq!(f.stat("decision.fallback") + f.stat("decision.shed"), 0, "{shape}");
    }
}

/// Envoy keeps every stat until it restarts, so with pod churn each server ever seen adds
/// its per-server series; an operator drops them with Envoy's stats matcher. kvroute
/// defines them all the same: routing and its other stats go on.
#[test]
fn per_server_stats_left_out_by_envoys_stats_matcher_change_nothing_else() {
    let servers: Vec<FakeVllm> = (0..3).map(|_| FakeVllm::start(Load::idle()).unwrap()).collect();
    let ports: Vec<u16> = servers.iter().map(|s| s.port).collect();
    let matcher = "stats_config:\n  stats_matcher:\n    exclusion_list:\n      patterns:\n        - prefix: wasmcustom.kvroute.endpoint.\n";
    let envoy = Envoy::start("envoy.yaml", &ports, |t| {
        debug_headers(t).replacen("admin:", &format!("{matcher}admin:"), 1)
    })
    .unwrap();
    let f = Fleet { servers, envoy };
    f.wait_for_scrapes();
    let system = long_prompt("matcher");
    for i in 0..12 {
        let (status, _, reason) = f.chat(&system, &format!("q{i}"));
        assert_eq!(status, 200);
        assert!(reason == "cold" || reason == "prefix_hit", "{reason}");
    }
    assert_eq!(f.stat("decision.cold") + f.stat("decision.prefix_hit"), 12);
    for port in &ports {
        let name = format!("wasmcustom.kvroute.endpoint.127_0_0_1_{port}.chosen");
        assert_eq!(f.envoy.stat_if_defined(&name), None, "{name} was not left out");
    }
    assert!(!f.envoy.log_text().contains("panicked"), "{}", f.envoy.log_text());
}

#[test]
fn no_query_string_or_body_field_can_choose_the_upstream() {
    for shape in SHAPES {
        let f = fleet(shape, vec![Load::heavy(), Load::idle(), Load::idle(), Load::idle()]);
        let heavy = f.servers[0].address();
        let admin = format!("127.0.0.1:{}", f.envoy.admin);
        for (i, target) in [heavy.as_str(), admin.as_str()].into_iter().enumerate() {
            let path = format!("/v1/chat/completions?x-gateway-destination-endpoint={target}&endpoint={target}");
            let body = format!(
                r#"{{"model":"{MODEL}","x-gateway-destination-endpoint":"{target}","endpoint":"{target}","messages":[{{"role":"user","content":"{}"}}]}}"#,
                long_prompt(&format!("steer{i}"))
            );
            let r = f.send(&path, &[("content-type", "application/json")], &body);
            assert_eq!(r.status, 200, "{shape}: {}", r.body);
            let served = r.header("x-served-by").unwrap_or("");
            assert!(
                served != heavy && f.servers.iter().any(|s| s.address() == served),
                "{shape}: served by {served:?}"
            );
        }
    }
}

#[test]
fn tenants_share_no_affinity_and_debug_headers_say_nothing_about_them() {
    let f = fleet(
        "envoy.yaml",
        vec![Load::idle(), Load::idle(), Load::idle(), Load::idle()],
    );
    let body = chat_body(&long_prompt("tenants"), "same question", false);
    let ask = |tenant: &str| {
        let r = f.send("/v1/chat/completions", &[("x-kvroute-tenant", tenant)], &body);
        assert_eq!(r.status, 200);
        for (name, value) in &r.headers {
            assert!(!value.contains(tenant), "{name}: {value} names the tenant");
        }
        r.header("x-kvroute-reason").unwrap_or("").to_string()
    };
    // Warm tenant "acme-corp" on both Envoy workers (connections land on either; 12 tries
    // leave a worker unwarmed with probability about 2^-11): after that it hits.
    for _ in 0..12 {
        ask("acme-corp");
    }
    assert_eq!(ask("acme-corp"), "prefix_hit");
    // The same prompt from another tenant starts cold: no shared chain, no shared affinity.
    assert_eq!(ask("globex-inc"), "cold");
}

#[test]
fn clients_that_give_up_before_any_response_do_not_eject_a_busy_server() {
    use std::io::Write;
    // One worker, one server: with the defaults three failures in a row eject it for 5 s.
    let server = FakeVllm::start(Load::idle()).unwrap();
    let envoy = Envoy::start_workers("envoy.yaml", &[server.port], 1, debug_headers).unwrap();
    let f = Fleet {
        servers: vec![server],
        envoy,
    };
    f.wait_for_scrapes();
    f.servers[0].set_delay_ms(5_000);
    let body = chat_body("a busy server", "will you answer?", false);
    for i in 0..5 {
        // A non-streaming request's response headers come when generation ends: a client
        // whose timeout is shorter leaves before any response byte.
        let seen = f.servers[0].inference_requests();
        let mut client = std::net::TcpStream::connect(("127.0.0.1", f.envoy.port)).unwrap();
        let request = format!(
            "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
            body.len()
        );
        client.write_all(request.as_bytes()).unwrap();
        let deadline = Instant::now() + Duration::from_secs(5);
        while f.servers[0].inference_requests() == seen {
            assert!(Instant::now() < deadline, "request {i} never reached the server");
            thread::sleep(Duration::from_millis(10));
        }
        drop(client);
    }
    let deadline = Instant::now() + Duration::from_secs(2);
    while f.stat("responses.client_left") < 5 && Instant::now() < deadline {
        thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(f.stat("responses.client_left"), 5);
    f.servers[0].set_delay_ms(0);
    let (status, served, reason) = f.chat("a busy server", "and now?");
    assert_eq!(status, 200);
    assert!(served.ends_with(&f.servers[0].port.to_string()), "{served}");
    assert!(!reason.starts_with("fallback"), "{reason}: the server was ejected");
    assert!(
        !f.envoy.log_text().contains("passive health: Ejected"),
        "{}",
        f.envoy.log_text()
    );
}

#[test]
fn a_request_whose_body_ends_in_trailers_is_routed() {
    // Envoy passes HTTP/1.1 trailers on only with enable_trailers (HTTP/2 and 3 always do):
    // the body then ends without end_of_stream, and the decision comes with the trailers.
    let servers: Vec<FakeVllm> = (0..2).map(|_| FakeVllm::start(Load::idle()).unwrap()).collect();
    let ports: Vec<u16> = servers.iter().map(|s| s.port).collect();
    let envoy = Envoy::start("envoy.yaml", &ports, |t| {
        debug_headers(t).replace(
            "accept_http_10: true\n",
            "accept_http_10: true\n                  enable_trailers: true\n",
        )
    })
    .unwrap();
    let f = Fleet { servers, envoy };
    f.wait_for_scrapes();
    let body = chat_body(&long_prompt("trailers"), "q", false);
    let raw = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\nconnection: close\r\n\r\n{:x}\r\n{body}\r\n0\r\nx-trailer: yes\r\n\r\n",
        body.len()
    );
    // One request: the test servers do not read chunked bodies, so a second one on the same
    // upstream connection would be read from the first one's leftovers.
    let r = http_client::request_raw(f.envoy.port, raw.as_bytes()).unwrap();
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.header("x-kvroute-reason"), Some("cold"), "{:?}", r.headers);
    assert_eq!(f.stat("decision.cold"), 1);
}

/// vLLM's `--enable-force-include-usage` puts `usage` in every stream, asked for or not: the
/// filter finds out per server from one such stream and reads that server's streams from
/// then on, and leaves the streams of a server that sends none unread.
#[test]
fn streams_that_did_not_ask_for_usage_are_read_where_the_server_sends_it_anyway() {
    let f = fleet("envoy.yaml", vec![Load::idle(), Load::idle()]);
    f.servers[0].set_force_usage(true);
    let mut served = BTreeMap::new();
    for i in 0..24 {
        let body = chat_body(&long_prompt(&format!("usage-{i}")), "q", true);
        let r = f.send("/v1/chat/completions", &[("content-type", "application/json")], &body);
        assert_eq!(r.status, 200, "{}", r.body);
        *served
            .entry(r.header("x-served-by").unwrap_or("").to_string())
            .or_insert(0u64) += 1;
    }
    let forcing = served.get(&f.servers[0].address()).copied().unwrap_or(0);
    let other = served.get(&f.servers[1].address()).copied().unwrap_or(0);
    assert!(forcing >= 2 && other >= 2, "both servers answered streams: {served:?}");
    // Every stream of the server that sends usage was read (its first to find out), none
    // of the other's reported any.
    assert_eq!(f.stat("responses.usage_reported"), forcing, "{served:?}");
    assert_eq!(f.stat("responses.usage_missing"), other, "{served:?}");
    assert!(f
        .envoy
        .log_text()
        .contains("sends usage in streams that do not ask for it"));
}

/// vLLM serves Anthropic's `/v1/messages` as the chat request it translates it to, with the
/// same prefix cache: kvroute hashes it the same way, so a conversation sent either way
/// finds the server that holds its prefix.
#[test]
fn anthropic_messages_share_their_prefix_with_the_same_conversation_sent_as_chat() {
    let f = fleet("envoy.yaml", vec![Load::idle(), Load::idle(), Load::idle()]);
    let system = long_prompt("anthropic");
    let anthropic = |question: &str| {
        format!(
            r#"{{"model":"{MODEL}","max_tokens":16,"system":[{{"type":"text","text":"{system}"}}],"messages":[{{"role":"user","content":[{{"type":"text","text":"{question}"}}]}}]}}"#
        )
    };
    let first = f.send("/v1/messages", &[], &anthropic("first"));
    assert_eq!(first.status, 200, "{}", first.body);
    let home = first.header("x-served-by").unwrap().to_string();
    assert_eq!(first.header("x-kvroute-reason"), Some("cold"));
    for (path, body) in [
        ("/v1/messages", anthropic("second")),
        ("/v1/chat/completions", chat_body(&system, "third", false)),
    ] {
        let r = f.send(path, &[], &body);
        assert_eq!(r.status, 200, "{path}: {}", r.body);
        assert_eq!(r.header("x-kvroute-reason"), Some("prefix_hit"), "{path}");
        assert_eq!(r.header("x-served-by"), Some(home.as_str()), "{path}");
    }
}

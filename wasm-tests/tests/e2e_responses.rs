//! End to end: the Responses API through real Envoy and dist/kvroute.wasm, in front of
//! simulated vLLM servers that store responses (`VLLM_ENABLE_RESPONSES_API_STORE=1`). A
//! stored response lives on the server that made it; a follow-up naming it, its `GET` and
//! its cancel reach that server through any Envoy worker and any gateway replica, where
//! Envoy's balancing alone lands most of them on a server that answers 404.

#![allow(clippy::unwrap_used, clippy::disallowed_methods)] // wall-time test helpers

use std::time::Duration;

use kvroute_sim::profile::{Gpu, Model, Profile};
use kvroute_wasm_tests::envoy::{free_port, with_replicas_cluster, Envoy};
use kvroute_wasm_tests::http_client;

const SERVERS: u16 = 4;
const SECRET: &str = "e2e-responses-secret-0123456789";

/// `SERVERS` simulated servers that store responses, and their runtime (the fleet lives as
/// long as it does).
fn storing_fleet() -> (tokio::runtime::Runtime, Vec<u16>) {
    let profile = Profile::new(Gpu::H100_80g, Model::Llama31_8b, 1).unwrap();
    let (rt, base) = kvroute_sim::serve::start_storing_in_background(profile, SERVERS, 20.0).unwrap();
    (rt, (base..base + SERVERS).collect())
}

fn debug_headers(text: String) -> String {
    text.replace(
        "\"policy\": \"cost\",",
        "\"policy\": \"cost\", \"debug_headers\": true,",
    )
}

fn body(input: &str, previous: Option<&str>, stream: bool) -> String {
    let model = Model::Llama31_8b.served_name();
    let previous = previous.map_or(String::new(), |id| format!(r#","previous_response_id":"{id}""#));
    format!(r#"{{"model":"{model}","input":"{input}","max_output_tokens":8,"stream":{stream}{previous}}}"#)
}

/// An answer's response id: a whole response's `id`, or a stream's first event's.
fn response_id(r: &http_client::Response) -> String {
    let json = r.body.lines().find_map(|l| l.strip_prefix("data: ")).unwrap_or(&r.body);
    let v: serde_json::Value = serde_json::from_str(json)
        .map_err(|e| format!("{e}: {}", r.body))
        .unwrap();
    v.get("response").unwrap_or(&v)["id"].as_str().unwrap().to_string()
}

struct Turn {
    status: u16,
    served_by: String,
    reason: String,
    body: String,
}

fn post(envoy: &Envoy, path: &str, body: &str) -> Turn {
    let r = envoy.post(path, &[], body).unwrap();
    turn(r)
}

fn turn(r: http_client::Response) -> Turn {
    Turn {
        status: r.status,
        served_by: r.header("x-served-by").unwrap_or("").to_string(),
        reason: r.header("x-kvroute-reason").unwrap_or("").to_string(),
        body: r.body,
    }
}

/// Starts conversation `i` on `first`, and continues it on `second` `gap` later: returns
/// the server that stored the first answer, and what the follow-up, the `GET` and the
/// cancel of the first answer got through `second`.
fn conversation(first: &Envoy, second: &Envoy, i: usize, gap: Duration) -> (String, [Turn; 3]) {
    let stream = i % 2 == 0;
    // Every third opening is past `max_body_bytes` (2,048 in the first test): Envoy balances
    // it, and its home is learned all the same.
    let repeat = if i % 3 == 0 { 50 } else { 20 };
    let opening = format!("Conversation {i}: tell me about the number {i}, at length. ").repeat(repeat);
    let r = first.post("/v1/responses", &[], &body(&opening, None, stream)).unwrap();
    assert_eq!(r.status, 200, "{}", r.body);
    let id = response_id(&r);
    let home = r.header("x-served-by").unwrap().to_string();
    std::thread::sleep(gap);
    let follow_up = post(second, "/v1/responses", &body("And then?", Some(&id), !stream));
    let get = turn(http_client::request(second.port, "GET", &format!("/v1/responses/{id}"), &[], b"").unwrap());
    let cancel = post(second, &format!("/v1/responses/{id}/cancel"), "");
    (home, [follow_up, get, cancel])
}

fn assert_all_home(turns: &[(String, [Turn; 3])], log: &str) {
    for (i, (home, [follow_up, get, cancel])) in turns.iter().enumerate() {
        assert_eq!(follow_up.status, 200, "conversation {i}: {}\n{log}", follow_up.body);
        assert_eq!(&follow_up.served_by, home, "conversation {i}");
        assert_eq!(follow_up.reason, "response_home", "conversation {i}");
        assert_eq!(get.status, 200, "conversation {i}: {}", get.body);
        assert_eq!(&get.served_by, home, "conversation {i}");
        // vLLM refuses to cancel a finished synchronous response: the server that holds it
        // says so, any other would say 404.
        assert_eq!(cancel.status, 400, "conversation {i}: {}", cancel.body);
        assert_eq!(&cancel.served_by, home, "conversation {i}");
    }
}

#[test]
fn a_follow_up_reaches_the_server_that_stored_its_response_through_any_worker() {
    let (_rt, ports) = storing_fleet();
    let envoy = Envoy::start_workers("envoy.yaml", &ports, 4, |t| {
        debug_headers(t).replace(
            "\"debug_headers\": true,",
            "\"debug_headers\": true, \"max_body_bytes\": 2048,",
        )
    })
    .unwrap();
    envoy.wait_scraped(u64::from(SERVERS));
    // At once: the worker that read the id published its home before the client had it.
    let turns: Vec<_> = (0..12)
        .map(|i| conversation(&envoy, &envoy, i, Duration::ZERO))
        .collect();
    assert_all_home(&turns, &envoy.log_text());
    let homes: std::collections::BTreeSet<&String> = turns.iter().map(|(h, _)| h).collect();
    assert!(homes.len() > 1, "the conversations spread over the fleet: {homes:?}");
    // Every answer taught its home (the 12 openings and the 12 follow-ups, themselves
    // stored), and the routed openings' usage was read (a continuation's is not).
    assert!(envoy.stat("wasmcustom.kvroute.stored_response.homes_learned") >= 24);
    assert_eq!(envoy.stat("wasmcustom.kvroute.stored_response.home_unknown"), 0);
    assert!(envoy.stat("wasmcustom.kvroute.decision.response_home") >= 36);
    assert!(envoy.stat("wasmcustom.kvroute.responses.usage_reported") >= 8);
    assert_eq!(envoy.stat("wasmcustom.kvroute.skipped.over_limit"), 4);

    // A response the gateway never saw is routed like any request (and answered 404); a
    // GET of one is left to Envoy.
    let unknown = post(&envoy, "/v1/responses", &body("Hello?", Some("resp_unknown"), false));
    assert_eq!(unknown.status, 404, "{}", unknown.body);
    let get = http_client::request(envoy.port, "GET", "/v1/responses/resp_unknown", &[], b"").unwrap();
    assert_eq!(get.status, 404, "{}", get.body);
    assert_eq!(envoy.stat("wasmcustom.kvroute.stored_response.home_unknown"), 2);
    // Every request of the listener counted under one outcome, the follow-ups, GETs and
    // cancels sent home included (the failing-open alert compares the two).
    let (listener, counted) = envoy.requests_accounted();
    assert!(listener >= 40, "the listener's count was read: {listener}");
    assert_eq!(
        listener, counted,
        "the listener saw {listener} requests, kvroute's outcomes count {counted}"
    );
}

/// Two gateway replicas in front of one storing fleet, exchanging their events with
/// `replicas` (JSON members of `share.replicas` besides the peers and the secret).
fn replica_pair(ports: &[u16], replicas: &str) -> (Envoy, Envoy) {
    let peers = [free_port(), free_port()];
    let config = |text: String| {
        let share = format!(
            r#""policy": "cost", "debug_headers": true, "share": {{"replicas": {{"peers": ["127.0.0.1:{}", "127.0.0.1:{}"], "secret": "{SECRET}"{replicas}}}}},"#,
            peers[0], peers[1]
        );
        with_replicas_cluster(&text.replace("\"policy\": \"cost\",", &share), peers)
    };
    let a = Envoy::start_listening("envoy.yaml", ports, 2, Some(peers[0]), config).unwrap();
    let b = Envoy::start_listening("envoy.yaml", ports, 2, Some(peers[1]), config).unwrap();
    a.wait_scraped(u64::from(SERVERS));
    b.wait_scraped(u64::from(SERVERS));
    (a, b)
}

#[test]
fn a_follow_up_reaches_the_server_that_stored_its_response_through_another_replica() {
    let (_rt, ports) = storing_fleet();
    let (a, b) = replica_pair(&ports, "");
    // Opened through one replica, continued through the other at once: the home leaves with
    // the worker's own POST as the answer leaves for the client, and a continuation that
    // arrives first waits for it (`homes`).
    let gap = Duration::ZERO;
    let turns: Vec<_> = (0..8)
        .map(|i| {
            if i % 2 == 0 {
                conversation(&a, &b, i, gap)
            } else {
                conversation(&b, &a, i, gap)
            }
        })
        .collect();
    assert_all_home(&turns, &b.log_text());
    for envoy in [&a, &b] {
        assert_eq!(envoy.stat("wasmcustom.kvroute.stored_response.home_unknown"), 0);
    }
}

#[test]
fn a_follow_up_that_outruns_its_home_to_another_replica_waits_for_it() {
    let (_rt, ports) = storing_fleet();
    // Homes leave only with the service's batch, every 40 ms: a follow-up sent at once
    // through the other replica arrives before its home (unless the client, on a loaded
    // machine, takes longer than what is left of the interval), and waits for it, within
    // the 100 ms a follow-up waits (`homes`).
    let (a, b) = replica_pair(
        &ports,
        r#", "from_workers": false, "at_once": false, "interval_ms": 40"#,
    );
    let turns: Vec<_> = (0..6).map(|i| conversation(&a, &b, i, Duration::ZERO)).collect();
    assert_all_home(&turns, &b.log_text());
    assert!(
        b.stat("wasmcustom.kvroute.stored_response.home_awaited") >= 3,
        "the follow-ups waited"
    );
    // A `GET` sent at once waits too (a background response's first poll).
    let waited = b.stat("wasmcustom.kvroute.stored_response.home_awaited");
    for i in 0..4 {
        let r = a
            .post("/v1/responses", &[], &body(&format!("Poll me, {i}."), None, false))
            .unwrap();
        assert_eq!(r.status, 200, "{}", r.body);
        let id = response_id(&r);
        let get = turn(http_client::request(b.port, "GET", &format!("/v1/responses/{id}"), &[], b"").unwrap());
        assert_eq!(get.status, 200, "poll {i}: {}", get.body);
        assert_eq!(Some(get.served_by.as_str()), r.header("x-served-by"), "poll {i}");
        assert_eq!(get.reason, "response_home", "poll {i}");
    }
    assert!(
        b.stat("wasmcustom.kvroute.stored_response.home_awaited") >= waited + 2,
        "the polls waited"
    );
    assert_eq!(b.stat("wasmcustom.kvroute.stored_response.home_unknown"), 0);
}

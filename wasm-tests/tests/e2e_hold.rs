//! End to end: holding requests at the gateway while every server is full
//! (`overload.hold`), in real Envoy. One fake vLLM server that answers after a delay is
//! "full" while a request of this gateway waits there without a first token
//! (`wait_limit_ms: 1`): a second request is held in the worker, routed by the worker's
//! tick once the first answers, or answered 429 past `max_wait_ms`; a higher priority
//! leaves first; one whose client hangs up leaves the queue without reaching the server.
//! With 4 worker threads the held requests of all workers wait in one queue per process:
//! they leave in order, one at a time, whichever worker each connection landed on.

#![allow(clippy::disallowed_methods)] // wall-time end-to-end tests read the clock
#![allow(clippy::unwrap_used)] // test helpers outside #[test] functions

use std::io::Write;
use std::net::TcpStream;
use std::thread;
use std::time::{Duration, Instant};

use kvroute_wasm_tests::envoy::Envoy;
use kvroute_wasm_tests::fake_vllm::{FakeVllm, Load, MODEL};

/// A prompt of about 500 tokens: at the default prior of 20,000 prefill tokens/s, 25 ms of
/// prefill, past `wait_limit_ms: 1` while it has no first token.
fn body() -> String {
    let prompt = "Please hold this request while the server is busy. ".repeat(40);
    format!(r#"{{"model":"{MODEL}","max_tokens":8,"messages":[{{"role":"user","content":"{prompt}"}}]}}"#)
}

/// One server answering after `delay_ms`, behind Envoy (one worker) with holding on.
fn start(delay_ms: u64, max_wait_ms: u64) -> (FakeVllm, Envoy) {
    start_with_workers(1, delay_ms, max_wait_ms)
}

fn start_with_workers(workers: u32, delay_ms: u64, max_wait_ms: u64) -> (FakeVllm, Envoy) {
    start_holding(workers, delay_ms, &format!(r#""max_wait_ms": {max_wait_ms}"#))
}

/// `hold` is the JSON members of `overload.hold` besides `wait_limit_ms`.
fn start_holding(workers: u32, delay_ms: u64, hold: &str) -> (FakeVllm, Envoy) {
    start_holding_with(workers, delay_ms, hold, |text| text)
}

/// Like `start_holding`, with `edit` applied to Envoy's config as well.
fn start_holding_with(workers: u32, delay_ms: u64, hold: &str, edit: impl Fn(String) -> String) -> (FakeVllm, Envoy) {
    let server = FakeVllm::start(Load::idle()).unwrap();
    let hold = format!(r#""overload": {{"hold": {{{hold}, "wait_limit_ms": 1}}}},"#);
    let envoy = Envoy::start_workers("envoy.yaml", &[server.port], workers, move |text| {
        // Each new connection to the worker with the fewest open: the held requests of one
        // test sit on different workers (`spread_over_workers` checks it).
        edit(
            text.replace("\"policy\": \"cost\",", &format!("\"policy\": \"cost\", {hold}"))
                .replace(
                    "    - name: inference\n",
                    "    - name: inference\n      connection_balance_config: { exact_balance: {} }\n",
                ),
        )
    })
    .unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while server.scrapes() < 2 {
        assert!(Instant::now() < deadline, "no scrapes:\n{}", envoy.log_text());
        thread::sleep(Duration::from_millis(20));
    }
    thread::sleep(Duration::from_millis(300));
    server.set_delay_ms(delay_ms);
    (server, envoy)
}

/// Waits until `done` holds, 10 s at most. A request's way to the server or into the queue
/// takes longer than any fixed sleep on a loaded machine, and the tests' order of arrivals
/// must not rest on one.
fn until(what: &str, envoy: &Envoy, done: impl Fn() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !done() {
        assert!(Instant::now() < deadline, "{what}:\n{}", envoy.log_text());
        thread::sleep(Duration::from_millis(10));
    }
}

/// Waits until `n` requests reached the server.
fn reached(server: &FakeVllm, envoy: &Envoy, n: u64) {
    until(&format!("{n} requests never reached the server"), envoy, || {
        server.inference_requests() >= n
    });
}

/// Waits until `n` requests were held in all.
fn held(envoy: &Envoy, n: u64) {
    until(&format!("{n} requests were never held"), envoy, || {
        envoy.stat("wasmcustom.kvroute.hold.held") >= n
    });
}

/// Sends one request from another thread; its status and how long it took.
fn send(
    envoy: &Envoy,
    headers: Vec<(&'static str, &'static str)>,
) -> thread::JoinHandle<(u16, Duration, Option<String>)> {
    let port = envoy.port;
    let body = body();
    thread::spawn(move || {
        let t0 = Instant::now();
        let mut h = vec![("content-type", "application/json")];
        h.extend(headers);
        let r = kvroute_wasm_tests::http_client::request(port, "POST", "/v1/chat/completions", &h, body.as_bytes())
            .unwrap();
        (r.status, t0.elapsed(), r.header("retry-after").map(str::to_string))
    })
}

#[test]
fn a_request_waits_while_the_only_server_is_full_and_goes_once_it_has_room() {
    let (server, envoy) = start(800, 10_000);
    let first = send(&envoy, vec![]);
    reached(&server, &envoy, 1);
    let second = send(&envoy, vec![]);
    let (s1, _, _) = first.join().unwrap();
    let (s2, took, _) = second.join().unwrap();
    assert_eq!((s1, s2), (200, 200), "{}", envoy.log_text());
    assert!(
        took >= Duration::from_millis(1200),
        "the second waited for the first's answer, then its own 800 ms: {took:?}"
    );
    assert_eq!(envoy.stat("wasmcustom.kvroute.hold.held"), 1);
    assert_eq!(envoy.stat("wasmcustom.kvroute.hold.released"), 1);
    assert_eq!(server.inference_requests(), 2, "each request reached the server once");
    assert!(envoy.stat("wasmcustom.kvroute.hold.wait_ms") >= 400);
}

#[test]
fn past_the_wait_bound_a_held_request_gets_429_with_retry_after() {
    let (server, envoy) = start(3_000, 300);
    let first = send(&envoy, vec![]);
    reached(&server, &envoy, 1);
    let (status, took, retry) = send(&envoy, vec![]).join().unwrap();
    assert_eq!(status, 429, "{}", envoy.log_text());
    assert_eq!(retry.as_deref(), Some("1"));
    assert!(
        (Duration::from_millis(250)..Duration::from_millis(2500)).contains(&took),
        "answered at the wait bound (plus Envoy's 1 s delayed close), not at once nor after the first: {took:?}"
    );
    assert_eq!(first.join().unwrap().0, 200);
    assert_eq!(envoy.stat("wasmcustom.kvroute.hold.expired"), 1);
    assert_eq!(
        server.inference_requests(),
        1,
        "the refused request never reached the server"
    );
}

#[test]
fn a_request_that_names_its_objective_waits_only_its_share_of_it() {
    let (server, envoy) = start_holding(1, 2_500, r#""max_wait_ms": 20000, "objective_wait_share": 0.5"#);
    let first = send(&envoy, vec![]);
    reached(&server, &envoy, 1);
    let hurried = send(&envoy, vec![("x-kvroute-ttft-objective-ms", "600")]);
    held(&envoy, 1);
    let patient = send(&envoy, vec![]);
    held(&envoy, 2);
    let (status, took, retry) = hurried.join().unwrap();
    assert_eq!(status, 429, "{}", envoy.log_text());
    assert_eq!(retry.as_deref(), Some("1"));
    assert!(
        (Duration::from_millis(250)..Duration::from_millis(2000)).contains(&took),
        "answered at half its 600 ms objective (plus Envoy's delayed close), not at 20 s nor after the first: {took:?}"
    );
    assert_eq!(first.join().unwrap().0, 200);
    let (status, took, _) = patient.join().unwrap();
    assert_eq!(
        status,
        200,
        "without the header it waits up to max_wait_ms: {}",
        envoy.log_text()
    );
    assert!(
        took >= Duration::from_millis(2500),
        "it waited for the first's answer: {took:?}"
    );
    assert_eq!(envoy.stat("wasmcustom.kvroute.hold.expired"), 1);
    assert_eq!(envoy.stat("wasmcustom.kvroute.hold.released"), 1);
    assert_eq!(
        server.inference_requests(),
        2,
        "the refused request never reached the server"
    );
}

#[test]
fn a_higher_priority_leaves_the_queue_first_and_a_sheddable_one_still_gets_its_turn() {
    let (server, envoy) = start(700, 10_000);
    let first = send(&envoy, vec![]);
    reached(&server, &envoy, 1);
    let low = send(&envoy, vec![("x-kvroute-priority", "-1")]);
    held(&envoy, 1);
    let high = send(&envoy, vec![("x-kvroute-priority", "1")]);
    let t0 = Instant::now();
    let (s_high, _, _) = high.join().unwrap();
    let high_done = t0.elapsed();
    let (s_low, _, _) = low.join().unwrap();
    let low_done = t0.elapsed();
    assert_eq!(
        (first.join().unwrap().0, s_high, s_low),
        (200, 200, 200),
        "{}",
        envoy.log_text()
    );
    assert!(
        low_done >= high_done + Duration::from_millis(500),
        "the later high-priority request went first: high {high_done:?}, low {low_done:?}"
    );
    assert_eq!(envoy.stat("wasmcustom.kvroute.hold.held"), 2);
    assert_eq!(envoy.stat("wasmcustom.kvroute.hold.released"), 2);
    assert_eq!(envoy.stat("wasmcustom.kvroute.decision.shed"), 0, "held, not shed");
    assert_eq!(server.inference_requests(), 3);
}

#[test]
fn a_client_that_hangs_up_while_held_leaves_the_queue_and_nothing_reaches_the_server() {
    let (server, envoy) = start(1_000, 10_000);
    let first = send(&envoy, vec![]);
    reached(&server, &envoy, 1);
    let body = body();
    let mut s = TcpStream::connect(("127.0.0.1", envoy.port)).unwrap();
    let head = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    s.write_all(head.as_bytes()).unwrap();
    held(&envoy, 1);
    drop(s);
    assert_eq!(first.join().unwrap().0, 200);
    thread::sleep(Duration::from_millis(300));
    assert_eq!(envoy.stat("wasmcustom.kvroute.hold.held"), 1);
    assert_eq!(envoy.stat("wasmcustom.kvroute.hold.gone"), 1, "{}", envoy.log_text());
    assert_eq!(server.inference_requests(), 1);
    server.set_delay_ms(0);
    let (status, _, _) = send(&envoy, vec![]).join().unwrap();
    assert_eq!(status, 200, "the gateway still routes");
}

#[test]
fn a_held_request_that_envoy_answers_itself_leaves_the_queue() {
    // A route with a stream duration bound: a held request on it gets Envoy's own answer
    // (504) while held, and its ticket must leave the queue then, not when the server frees.
    let (server, envoy) = start_holding_with(1, 1_500, r#""max_wait_ms": 20000"#, |text| {
        let short = "                        - match: { prefix: \"/v1/\", headers: [{ name: x-test-short, present_match: true }] }\n                          route: { cluster: vllm_pool, max_stream_duration: { max_stream_duration: 0.5s } }\n";
        text.replacen(
            "                        - match: { safe_regex: { regex: \"/v1/.*|/tokenize|/detokenize|/health\" } }\n",
            &format!("{short}                        - match: {{ safe_regex: {{ regex: \"/v1/.*|/tokenize|/detokenize|/health\" }} }}\n"),
            1,
        )
    });
    let first = send(&envoy, vec![]);
    reached(&server, &envoy, 1);
    let (status, took, _) = send(&envoy, vec![("x-test-short", "1")]).join().unwrap();
    assert_eq!(status, 504, "Envoy's stream duration bound: {}", envoy.log_text());
    assert!(took < Duration::from_millis(1_200), "{took:?}");
    // The gauges are summed every 100 ms.
    thread::sleep(Duration::from_millis(400));
    assert_eq!(envoy.stat("wasmcustom.kvroute.hold.held"), 1);
    assert_eq!(
        envoy.stat("wasmcustom.kvroute.hold.waiting"),
        0,
        "the ticket left the queue"
    );
    assert_eq!(envoy.stat("wasmcustom.kvroute.hold.gone"), 1);
    assert_eq!(first.join().unwrap().0, 200);
    assert_eq!(
        server.inference_requests(),
        1,
        "the timed-out request never reached the server"
    );
}

/// How many of Envoy's workers accepted a connection on the inference listener.
fn workers_used(envoy: &Envoy, workers: u32) -> usize {
    (0..workers)
        .filter(|w| {
            envoy.stat(&format!(
                "listener.127.0.0.1_{}.worker_{w}.downstream_cx_total",
                envoy.port
            )) > 0
        })
        .count()
}

/// Sends `headers[i]` requests one after another, each once the one before is held (each
/// on its own connection, so Envoy's workers share them), after one that fills the server;
/// when each finished, in send order.
fn held_on_many_workers(
    server: &FakeVllm,
    envoy: &Envoy,
    headers: &[Vec<(&'static str, &'static str)>],
) -> Vec<Duration> {
    let t0 = Instant::now();
    let first = send(envoy, vec![]);
    reached(server, envoy, 1);
    let sent: Vec<_> = (1..)
        .zip(headers)
        .map(|(n, h)| {
            let sent = (t0.elapsed(), send(envoy, h.clone()));
            held(envoy, n);
            sent
        })
        .collect();
    assert_eq!(first.join().unwrap().0, 200, "{}", envoy.log_text());
    sent.into_iter()
        .map(|(sent_at, h)| {
            let (status, took, _) = h.join().unwrap();
            assert_eq!(status, 200, "{}", envoy.log_text());
            sent_at + took
        })
        .collect()
}

#[test]
fn with_four_workers_held_requests_leave_in_arrival_order_one_at_a_time() {
    let (server, envoy) = start_with_workers(4, 400, 20_000);
    let done = held_on_many_workers(&server, &envoy, &vec![vec![]; 6]);
    for (i, pair) in done.windows(2).enumerate() {
        assert!(
            pair[1] >= pair[0] + Duration::from_millis(300),
            "request {} finished {:?} after request {}: released out of order or two at once ({done:?})",
            i + 1,
            pair[1].saturating_sub(pair[0]),
            i,
        );
    }
    assert_eq!(envoy.stat("wasmcustom.kvroute.hold.held"), 6);
    assert_eq!(envoy.stat("wasmcustom.kvroute.hold.released"), 6);
    assert_eq!(envoy.stat("wasmcustom.kvroute.hold.unavailable"), 0);
    assert_eq!(workers_used(&envoy, 4), 4, "the requests were spread over the workers");
    assert_eq!(server.inference_requests(), 7, "each request reached the server once");
}

#[test]
fn with_four_workers_a_later_higher_priority_request_passes_every_held_one() {
    let (server, envoy) = start_with_workers(4, 400, 20_000);
    let mut headers = vec![vec![]; 5];
    headers.push(vec![("x-kvroute-priority", "1")]);
    let done = held_on_many_workers(&server, &envoy, &headers);
    let high = done[5];
    let before = done[..5].iter().filter(|d| **d < high).count();
    assert!(
        before <= 1,
        "the high-priority request, held last, went out at the first release after it came \
         (at most the one released while it was being sent is ahead): {done:?}"
    );
    assert_eq!(envoy.stat("wasmcustom.kvroute.hold.released"), 6);
    assert_eq!(server.inference_requests(), 7);
    assert_eq!(workers_used(&envoy, 4), 4, "the requests were spread over the workers");
}

#[test]
fn with_four_workers_a_full_queue_answers_the_request_it_displaces_whichever_worker_holds_it() {
    displacement(4);
}

#[test]
fn on_one_worker_a_full_queue_answers_the_request_it_displaces() {
    // The arrival and the request it displaces on one worker: the displaced one's 429 goes
    // out from the tick, not from the arrival's own callback.
    displacement(1);
}

/// A full queue (2) of lower-priority requests, a higher-priority arrival: the newest of
/// them is answered 429 at once, the others are served, each once.
fn displacement(workers: u32) {
    let (server, envoy) = start_holding(workers, 1_500, r#""max_wait_ms": 20000, "max_requests": 2"#);
    let first = send(&envoy, vec![]);
    reached(&server, &envoy, 1);
    let old = send(&envoy, vec![]);
    held(&envoy, 1);
    let newest = send(&envoy, vec![]);
    held(&envoy, 2);
    let high = send(&envoy, vec![("x-kvroute-priority", "1")]);
    let (s_newest, took, retry) = newest.join().unwrap();
    assert_eq!(
        s_newest,
        429,
        "the newest of the lower priority made room: {}",
        envoy.log_text()
    );
    assert_eq!(retry.as_deref(), Some("1"));
    assert!(
        took < Duration::from_millis(1000),
        "answered when displaced, not when the server freed: {took:?}"
    );
    let statuses = [first, high, old].map(|h| h.join().unwrap().0);
    assert_eq!(statuses, [200, 200, 200], "{}", envoy.log_text());
    assert_eq!(envoy.stat("wasmcustom.kvroute.hold.held"), 3);
    assert_eq!(envoy.stat("wasmcustom.kvroute.hold.refused"), 1);
    assert_eq!(envoy.stat("wasmcustom.kvroute.hold.released"), 2);
    assert_eq!(
        server.inference_requests(),
        3,
        "the displaced request never reached the server"
    );
}

#[test]
fn with_newest_first_the_last_held_request_leaves_first_once_the_oldest_waited() {
    let (server, envoy) = start_holding(4, 400, r#""max_wait_ms": 20000, "newest_first_after_ms": 300"#);
    // All three held within the first 400 ms, the first request's time at the server. At
    // each release after the oldest has waited 300 ms the newest goes, so the third request
    // leaves before the second (whether the first release finds the oldest past 300 ms or
    // not). First come, first served would finish the second before the third.
    let done = held_on_many_workers(&server, &envoy, &vec![vec![]; 3]);
    assert!(
        done[2] < done[1],
        "past 300 ms of waiting the newest goes before the one held before it: {done:?}"
    );
    assert_eq!(envoy.stat("wasmcustom.kvroute.hold.released"), 3);
    assert_eq!(server.inference_requests(), 4);
}

/// Held requests of one model do not hold back another model's, whose servers have room:
/// the board keeps one order, and each model's first request in it is that model's head.
#[test]
fn a_request_for_another_model_with_room_is_not_held_behind_a_full_models() {
    let busy = FakeVllm::start(Load::idle()).unwrap();
    let other = FakeVllm::start_serving(Load::idle(), "other-model").unwrap();
    let hold = r#""overload": {"hold": {"max_wait_ms": 2000, "wait_limit_ms": 1}},"#;
    let envoy = Envoy::start_workers("envoy.yaml", &[busy.port, other.port], 2, move |text| {
        text.replace("\"policy\": \"cost\",", &format!("\"policy\": \"cost\", {hold}"))
    })
    .unwrap();
    until("no scrapes", &envoy, || busy.scrapes() >= 2 && other.scrapes() >= 2);
    thread::sleep(Duration::from_millis(300));
    busy.set_delay_ms(3_000);
    let first = send(&envoy, vec![]);
    reached(&busy, &envoy, 1);
    let second = send(&envoy, vec![]);
    held(&envoy, 1);
    let t0 = Instant::now();
    let prompt = "A question for the other model, whose server is idle. ".repeat(40);
    let body =
        format!(r#"{{"model":"other-model","max_tokens":8,"messages":[{{"role":"user","content":"{prompt}"}}]}}"#);
    let r = kvroute_wasm_tests::http_client::request(
        envoy.port,
        "POST",
        "/v1/chat/completions",
        &[("content-type", "application/json")],
        body.as_bytes(),
    )
    .unwrap();
    let took = t0.elapsed();
    assert_eq!(r.status, 200, "{}", envoy.log_text());
    assert_eq!(r.header("x-served-by"), Some(other.address().as_str()));
    assert!(
        took < Duration::from_millis(1000),
        "waited behind the other model's held request: {took:?}"
    );
    assert_eq!(
        envoy.stat("wasmcustom.kvroute.hold.held"),
        1,
        "only the full model's request was held"
    );
    let (s2, _, _) = second.join().unwrap();
    assert_eq!(s2, 429, "the full model's held request still waits its bound");
    assert_eq!(first.join().unwrap().0, 200);
}

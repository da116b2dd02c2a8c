//! End to end: the pool follows Envoy's own cluster. The shipped `envoy/envoy.yaml`, its
//! pool cluster switched to file-based EDS (or STRICT_DNS), with no pool list in kvroute's
//! configuration: kvroute learns the hosts and Envoy's verdict on each from the admin's
//! `/clusters`. Every scenario runs with the singleton service and in lease mode (no
//! bootstrap service: one worker VM polls for the others, as on Istio).

#![allow(clippy::disallowed_methods)] // wall-time end-to-end tests read the clock
#![allow(clippy::unwrap_used)] // test helpers outside #[test] functions

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use kvroute_wasm_tests::envoy::{without_service, Envoy};
use kvroute_wasm_tests::fake_vllm::{FakeVllm, Load, MODEL};
use kvroute_wasm_tests::http_client;

#[derive(Clone, Copy, Debug, PartialEq)]
enum Mode {
    /// The shipped shape: the singleton `envoy.bootstrap.wasm` service polls.
    Service,
    /// No bootstrap service: the worker VMs elect one poller by lease.
    Lease,
}

/// A directory Envoy watches for `eds.yaml`, replaced atomically (write, then rename).
struct EdsDir(PathBuf);

impl EdsDir {
    fn new(tag: &str) -> EdsDir {
        let dir = std::env::temp_dir().join(format!("kvroute-eds-{}-{tag}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        EdsDir(dir)
    }

    /// The pool is now `hosts`: (port, EDS health status).
    fn write(&self, hosts: &[(u16, &str)]) {
        let mut text = String::from(
            "resources:\n- \"@type\": type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment\n  cluster_name: vllm_pool\n  endpoints:\n  - lb_endpoints:\n",
        );
        for (port, status) in hosts {
            text.push_str(&format!(
                "    - endpoint: {{ address: {{ socket_address: {{ address: 127.0.0.1, port_value: {port} }} }} }}\n      health_status: {status}\n"
            ));
        }
        if hosts.is_empty() {
            text.push_str("    []\n");
        }
        let tmp = self.0.join("eds.yaml.tmp");
        std::fs::write(&tmp, text).unwrap();
        std::fs::rename(&tmp, self.0.join("eds.yaml")).unwrap();
    }
}

impl EdsDir {
    /// The pool is now `hosts`, all healthy: (port, EDS `load_balancing_weight`).
    fn write_weighted(&self, hosts: &[(u16, u32)]) {
        let mut text = String::from(
            "resources:\n- \"@type\": type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment\n  cluster_name: vllm_pool\n  endpoints:\n  - lb_endpoints:\n",
        );
        for (port, weight) in hosts {
            text.push_str(&format!(
                "    - endpoint: {{ address: {{ socket_address: {{ address: 127.0.0.1, port_value: {port} }} }} }}\n      load_balancing_weight: {weight}\n"
            ));
        }
        let tmp = self.0.join("eds.yaml.tmp");
        std::fs::write(&tmp, text).unwrap();
        std::fs::rename(&tmp, self.0.join("eds.yaml")).unwrap();
    }
}

impl Drop for EdsDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The shipped config with the pool cluster's endpoint source replaced by `source` (the
/// harness has already removed its static hosts), debug headers on, and in lease mode no
/// bootstrap service.
fn shaped(text: String, mode: Mode, source: &str, extra_json: &str) -> String {
    let mut text = text.replace(
        "      load_assignment:\n        cluster_name: vllm_pool\n        endpoints:\n          - lb_endpoints:\n",
        "",
    );
    text = text.replacen("      type: STATIC\n      connect_timeout: 1s\n", source, 1);
    text = text.replace(
        "\"policy\": \"cost\",",
        &format!("\"policy\": \"cost\", \"debug_headers\": true,{extra_json}"),
    );
    text = format!("node: {{ id: kvroute-e2e, cluster: kvroute-e2e }}\n{text}");
    if mode == Mode::Lease {
        text = without_service(&text);
    }
    text
}

fn eds_source(dir: &Path) -> String {
    let d = dir.display();
    format!(
        "      type: EDS\n      connect_timeout: 1s\n      eds_cluster_config:\n        eds_config:\n          path_config_source:\n            path: {d}/eds.yaml\n            watched_directory: {{ path: {d} }}\n"
    )
}

/// One response seen by the traffic threads.
#[derive(Clone, Debug)]
struct Seen {
    sent: Instant,
    status: u16,
    served_by: String,
    reason: String,
}

/// Steady traffic through Envoy: two client threads, each request on a new connection (so
/// Envoy spreads them over its workers), mostly new prefixes (so kvroute places them by load).
struct Traffic {
    stop: Arc<AtomicBool>,
    seen: Arc<Mutex<Vec<Seen>>>,
    threads: Vec<thread::JoinHandle<()>>,
}

impl Traffic {
    fn start(port: u16, model: &'static str) -> Traffic {
        let stop = Arc::new(AtomicBool::new(false));
        let seen = Arc::new(Mutex::new(Vec::new()));
        let counter = Arc::new(AtomicU64::new(0));
        let threads = (0..2)
            .map(|_| {
                let (stop, seen, counter) = (Arc::clone(&stop), Arc::clone(&seen), Arc::clone(&counter));
                thread::spawn(move || {
                    while !stop.load(Ordering::SeqCst) {
                        let n = counter.fetch_add(1, Ordering::SeqCst);
                        let system = format!("Tenant {n} system prompt, house style applies. ").repeat(20);
                        let body = format!(
                            r#"{{"model":"{model}","max_tokens":8,"messages":[{{"role":"system","content":"{system}"}},{{"role":"user","content":"q"}}]}}"#
                        );
                        let sent = Instant::now();
                        let r = http_client::request(
                            port,
                            "POST",
                            "/v1/chat/completions",
                            &[("content-type", "application/json")],
                            body.as_bytes(),
                        );
                        let seen_now = match r {
                            Ok(r) => Seen {
                                sent,
                                status: r.status,
                                served_by: r.header("x-served-by").unwrap_or("").to_string(),
                                reason: r.header("x-kvroute-reason").unwrap_or("").to_string(),
                            },
                            Err(e) => Seen {
                                sent,
                                status: 0,
                                served_by: String::new(),
                                reason: e,
                            },
                        };
                        seen.lock().unwrap().push(seen_now);
                        thread::sleep(Duration::from_millis(3));
                    }
                })
            })
            .collect();
        Traffic { stop, seen, threads }
    }

    fn since(&self, t: Instant) -> Vec<Seen> {
        self.seen
            .lock()
            .unwrap()
            .iter()
            .filter(|s| s.sent >= t)
            .cloned()
            .collect()
    }

    fn finish(mut self) -> Vec<Seen> {
        self.stop.store(true, Ordering::SeqCst);
        for t in self.threads.drain(..) {
            t.join().unwrap();
        }
        self.seen.lock().unwrap().clone()
    }
}

fn addr(s: &FakeVllm) -> String {
    s.address()
}

fn routed(s: &Seen) -> bool {
    s.reason == "cold" || s.reason == "prefix_hit"
}

fn wait_until(what: &str, limit: Duration, envoy: &Envoy, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + limit;
    while !done() {
        assert!(
            Instant::now() < deadline,
            "{what}: not within {limit:?}\n{}",
            tail(envoy)
        );
        thread::sleep(Duration::from_millis(10));
    }
}

fn tail(envoy: &Envoy) -> String {
    let log = envoy.log_text();
    log.lines()
        .rev()
        .take(40)
        .collect::<Vec<_>>()
        .into_iter()
        .rev()
        .collect::<Vec<_>>()
        .join("\n")
}

/// Scale out 4 → 8, drain one host, scale in to 3, replace every server one by one: no
/// client request fails, new hosts get requests within 1 s, removed and draining hosts get
/// none 1 s after the change.
fn pool_changes_under_traffic(mode: Mode) {
    let servers: Vec<FakeVllm> = (0..11).map(|_| FakeVllm::start(Load::idle()).unwrap()).collect();
    let eds = EdsDir::new(&format!("{mode:?}"));
    let ports: Vec<u16> = servers.iter().map(|s| s.port).collect();
    let healthy = |ids: &[usize]| -> Vec<(u16, &'static str)> { ids.iter().map(|i| (ports[*i], "HEALTHY")).collect() };
    eds.write(&healthy(&[0, 1, 2, 3]));
    let source = eds_source(&eds.0);
    let envoy = Envoy::start("envoy.yaml", &[], |t| shaped(t, mode, &source, "")).unwrap();
    let traffic = Traffic::start(envoy.port, MODEL);
    wait_until("routing to the first 4", Duration::from_secs(10), &envoy, || {
        let seen = traffic.since(Instant::now() - Duration::from_millis(500));
        let hit: BTreeSet<String> = seen.iter().filter(|s| routed(s)).map(|s| s.served_by.clone()).collect();
        hit.len() == 4
    });

    // Scale out: each new host routed to by kvroute within 1 s.
    let t_out = Instant::now();
    eds.write(&healthy(&[0, 1, 2, 3, 4, 5, 6, 7]));
    let new: Vec<String> = servers[4..8].iter().map(addr).collect();
    wait_until(
        "kvroute routing to every new host",
        Duration::from_secs(1),
        &envoy,
        || {
            let seen = traffic.since(t_out);
            new.iter().all(|n| seen.iter().any(|s| routed(s) && s.served_by == *n))
        },
    );
    let first_new = traffic
        .since(t_out)
        .iter()
        .filter(|s| routed(s) && new.contains(&s.served_by))
        .map(|s| s.sent.duration_since(t_out))
        .min()
        .unwrap();

    // Drain host 0: nothing new for it 1 s later.
    let t_drain = Instant::now();
    let mut hosts = healthy(&[1, 2, 3, 4, 5, 6, 7]);
    hosts.push((ports[0], "DRAINING"));
    eds.write(&hosts);
    thread::sleep(Duration::from_millis(1500));
    let drained = addr(&servers[0]);
    let late: Vec<Seen> = traffic
        .since(t_drain + Duration::from_secs(1))
        .into_iter()
        .filter(|s| s.served_by == drained)
        .collect();
    assert!(
        late.is_empty(),
        "{mode:?}: the draining host got {} requests 1 s after: {late:?}",
        late.len()
    );

    // Scale in to 3: the removed hosts get nothing 1 s later.
    let t_in = Instant::now();
    eds.write(&healthy(&[1, 2, 3]));
    thread::sleep(Duration::from_millis(1500));
    let kept: Vec<String> = servers[1..4].iter().map(addr).collect();
    let stray: Vec<Seen> = traffic
        .since(t_in + Duration::from_secs(1))
        .into_iter()
        .filter(|s| !kept.contains(&s.served_by))
        .collect();
    assert!(stray.is_empty(), "{mode:?}: removed hosts still served {stray:?}");

    // Rolling replacement: each old server drains, leaves the pool, then dies.
    let mut current = vec![1, 2, 3];
    for (old, fresh) in [(1, 8), (2, 9), (3, 10)] {
        current.push(fresh);
        let mut hosts = healthy(&current.iter().copied().filter(|i| *i != old).collect::<Vec<_>>());
        hosts.push((ports[old], "DRAINING"));
        eds.write(&hosts);
        thread::sleep(Duration::from_millis(700));
        current.retain(|i| *i != old);
        eds.write(&healthy(&current));
        thread::sleep(Duration::from_millis(500));
        servers[old].kill();
    }
    thread::sleep(Duration::from_millis(1000));
    let t_end = Instant::now();
    let seen = traffic.finish();
    let failed: Vec<&Seen> = seen.iter().filter(|s| s.status != 200).collect();
    assert!(
        failed.is_empty(),
        "{mode:?}: {} of {} requests failed: {:?}",
        failed.len(),
        seen.len(),
        &failed[..failed.len().min(5)]
    );
    let replaced: Vec<String> = servers[8..11].iter().map(addr).collect();
    let last: Vec<&Seen> = seen
        .iter()
        .filter(|s| s.sent + Duration::from_millis(800) >= t_end)
        .collect();
    assert!(
        last.iter().all(|s| replaced.contains(&s.served_by)),
        "{mode:?}: after the rolling replacement: {last:?}"
    );
    assert!(
        last.iter().any(|s| routed(s)),
        "{mode:?}: kvroute is not routing after the replacement"
    );
    eprintln!(
        "{mode:?}: {} requests, 0 failed; EDS change → first kvroute-routed request on a new host: {} ms",
        seen.len(),
        first_new.as_millis()
    );
}

#[test]
fn service_mode_pool_follows_eds_scale_out_drain_scale_in_and_rolling_replacement() {
    pool_changes_under_traffic(Mode::Service);
}

#[test]
fn lease_mode_pool_follows_eds_scale_out_drain_scale_in_and_rolling_replacement() {
    pool_changes_under_traffic(Mode::Lease);
}

/// Hosts Envoy takes out — failing its active health check, ejected by outlier detection —
/// get no request from kvroute, even while their `/metrics` still answer.
fn envoy_verdicts_are_honoured(mode: Mode) {
    let servers: Vec<FakeVllm> = (0..4).map(|_| FakeVllm::start(Load::idle()).unwrap()).collect();
    let eds = EdsDir::new(&format!("health-{mode:?}"));
    eds.write(&servers.iter().map(|s| (s.port, "HEALTHY")).collect::<Vec<_>>());
    let mut source = eds_source(&eds.0);
    source.push_str(
        "      health_checks:\n        - timeout: 0.2s\n          interval: 0.2s\n          no_traffic_interval: 0.2s\n          unhealthy_threshold: 1\n          healthy_threshold: 1\n          http_health_check: { path: /health }\n      outlier_detection: { consecutive_5xx: 3, interval: 0.1s, base_ejection_time: 60s, max_ejection_percent: 100, successful_active_health_check_uneject_host: false }\n",
    );
    // kvroute's own passive ejection off, so only Envoy's verdict can keep the host out.
    let extra = " \"health\": {\"passive_failures_to_eject\": 1000000},";
    let envoy = Envoy::start("envoy.yaml", &[], |t| shaped(t, mode, &source, extra)).unwrap();
    let traffic = Traffic::start(envoy.port, MODEL);
    wait_until("routing to all 4", Duration::from_secs(10), &envoy, || {
        let seen = traffic.since(Instant::now() - Duration::from_millis(500));
        seen.iter()
            .filter(|s| routed(s))
            .map(|s| s.served_by.clone())
            .collect::<BTreeSet<_>>()
            .len()
            == 4
    });
    let (sick, broken) = (&servers[0], &servers[1]);
    sick.set_healthy(false);
    broken.set_failing(true);
    wait_until(
        "Envoy ejecting the failing host",
        Duration::from_secs(10),
        &envoy,
        || envoy.stat("cluster.vllm_pool.outlier_detection.ejections_active") >= 1,
    );
    // It answers again, but Envoy keeps it ejected for 60 s (a passing active health check
    // would un-eject it by default; not here): so must kvroute.
    broken.set_failing(false);
    let t = Instant::now();
    thread::sleep(Duration::from_millis(2000));
    let seen = traffic.finish();
    let late: Vec<&Seen> = seen.iter().filter(|s| s.sent >= t + Duration::from_secs(1)).collect();
    assert!(late.len() > 20, "{mode:?}: too little traffic: {}", late.len());
    for out in [sick, broken] {
        let got: Vec<&&Seen> = late.iter().filter(|s| s.served_by == out.address()).collect();
        let clusters = http_client::request(
            envoy.admin,
            "GET",
            "/clusters?format=json&filter=%5Evllm_pool%24",
            &[],
            b"",
        )
        .map(|r| r.body)
        .unwrap_or_default();
        assert!(
            got.is_empty(),
            "{mode:?}: {} got {} requests after Envoy took it out: {:?}\n{clusters}",
            out.address(),
            got.len(),
            &got[..got.len().min(3)]
        );
    }
    assert!(late.iter().all(|s| s.status == 200 && routed(s)), "{mode:?}: {late:?}");
}

#[test]
fn service_mode_hosts_failing_health_checks_or_ejected_by_envoy_get_nothing() {
    envoy_verdicts_are_honoured(Mode::Service);
}

#[test]
fn lease_mode_hosts_failing_health_checks_or_ejected_by_envoy_get_nothing() {
    envoy_verdicts_are_honoured(Mode::Lease);
}

/// A STRICT_DNS pool (`localhost`): kvroute learns the resolved addresses and routes.
fn strict_dns_pool(mode: Mode) {
    let servers: Vec<FakeVllm> = (0..3).map(|_| FakeVllm::start(Load::idle()).unwrap()).collect();
    let mut source = String::from(
        "      type: STRICT_DNS\n      dns_lookup_family: V4_ONLY\n      connect_timeout: 1s\n      load_assignment:\n        cluster_name: vllm_pool\n        endpoints:\n          - lb_endpoints:\n",
    );
    for s in &servers {
        source.push_str(&format!(
            "              - endpoint: {{ address: {{ socket_address: {{ address: localhost, port_value: {} }} }} }}\n",
            s.port
        ));
    }
    let envoy = Envoy::start("envoy.yaml", &[], |t| shaped(t, mode, &source, "")).unwrap();
    let traffic = Traffic::start(envoy.port, MODEL);
    wait_until(
        "routing to all 3 resolved hosts",
        Duration::from_secs(10),
        &envoy,
        || {
            let seen = traffic.since(Instant::now() - Duration::from_millis(1000));
            seen.iter()
                .filter(|s| routed(s))
                .map(|s| s.served_by.clone())
                .collect::<BTreeSet<_>>()
                .len()
                == 3
        },
    );
    let seen = traffic.finish();
    assert!(seen.iter().all(|s| s.status == 200), "{mode:?}");
}

#[test]
fn service_mode_strict_dns_pool_is_discovered() {
    strict_dns_pool(Mode::Service);
}

#[test]
fn lease_mode_strict_dns_pool_is_discovered() {
    strict_dns_pool(Mode::Lease);
}

/// Two models in one cluster: each request goes only to servers of its model; an unknown
/// model is left to Envoy and counted.
fn two_models_in_one_cluster(mode: Mode) {
    let a: Vec<FakeVllm> = (0..2)
        .map(|_| FakeVllm::start_serving(Load::idle(), "model-a").unwrap())
        .collect();
    let b: Vec<FakeVllm> = (0..2)
        .map(|_| FakeVllm::start_serving(Load::idle(), "model-b").unwrap())
        .collect();
    let ports: Vec<u16> = a.iter().chain(&b).map(|s| s.port).collect();
    let envoy = Envoy::start("envoy.yaml", &ports, |t| {
        let t = t.replace(
            "\"policy\": \"cost\",",
            "\"policy\": \"cost\", \"debug_headers\": true,",
        );
        if mode == Mode::Lease {
            without_service(&t)
        } else {
            t
        }
    })
    .unwrap();
    let post = |model: &str, n: usize| chat(&envoy, model, &format!("Prompt {n} for {model}. ").repeat(30));
    // Every worker routes both models (a worker that has not applied a fleet state yet
    // leaves requests to Envoy).
    wait_until("kvroute routing", Duration::from_secs(10), &envoy, || {
        (0..8).all(|i| routed_reason(&post("model-a", 100 + i)) && routed_reason(&post("model-b", 100 + i)))
    });
    let of = |set: &[FakeVllm]| set.iter().map(FakeVllm::address).collect::<Vec<_>>();
    let (of_a, of_b) = (of(&a), of(&b));
    for n in 0..30 {
        for (model, servers) in [("model-a", &of_a), ("model-b", &of_b)] {
            let r = post(model, n);
            let by = r.header("x-served-by").unwrap_or("").to_string();
            assert!(
                servers.contains(&by),
                "{model} request {n} served by {by}: {:?}",
                r.headers
            );
            assert!(
                routed_reason(&r),
                "{model} request {n}: {:?}",
                r.header("x-kvroute-reason")
            );
        }
    }
    // A model no server lists is known unknown once the servers' `/v1/models` are in the
    // published state (asked when they joined; the answers may come a round after the
    // metrics). Then every request for it, on any worker, is left to Envoy and counted.
    wait_until("/v1/models in the fleet state", Duration::from_secs(5), &envoy, || {
        post("no-such-model", 0).header("x-kvroute-reason") == Some("fallback_unknown_model")
    });
    let counted = envoy.stat("wasmcustom.kvroute.decision.unknown_model");
    for n in 1..=8 {
        let r = post("no-such-model", n);
        assert_eq!(
            r.header("x-kvroute-reason"),
            Some("fallback_unknown_model"),
            "request {n}"
        );
    }
    assert_eq!(envoy.stat("wasmcustom.kvroute.decision.unknown_model"), counted + 8);
}

#[test]
fn service_mode_two_models_in_one_cluster_are_each_served_only_by_their_servers() {
    two_models_in_one_cluster(Mode::Service);
}

#[test]
fn lease_mode_two_models_in_one_cluster_are_each_served_only_by_their_servers() {
    two_models_in_one_cluster(Mode::Lease);
}

/// A chat completion for `model` with `system` as its system prompt, through `envoy`.
fn chat(envoy: &Envoy, model: &str, system: &str) -> http_client::Response {
    let body = format!(
        r#"{{"model":"{model}","max_tokens":8,"messages":[{{"role":"system","content":"{system}"}},{{"role":"user","content":"q"}}]}}"#
    );
    envoy
        .post("/v1/chat/completions", &[("content-type", "application/json")], &body)
        .unwrap()
}

fn routed_reason(r: &http_client::Response) -> bool {
    matches!(r.header("x-kvroute-reason"), Some("cold" | "prefix_hit"))
}

/// Lease mode: the worker VM that polls dies (its filter panics); another worker takes the
/// lease and the fleet state keeps being published. Prints the takeover time.
#[test]
fn lease_mode_another_worker_takes_over_when_the_polling_worker_dies() {
    let servers: Vec<FakeVllm> = (0..3).map(|_| FakeVllm::start(Load::idle()).unwrap()).collect();
    let eds = EdsDir::new("takeover");
    eds.write(&servers[..2].iter().map(|s| (s.port, "HEALTHY")).collect::<Vec<_>>());
    let source = eds_source(&eds.0);
    let panicking = |t: String| {
        shaped(t, Mode::Lease, &source, "")
            .replace("filename: dist/kvroute.wasm", "filename: dist/kvroute-test-panic.wasm")
    };
    let envoy = Envoy::start_workers("envoy.yaml", &[], 4, panicking).unwrap();
    wait_until("a worker holding the lease", Duration::from_secs(10), &envoy, || {
        envoy.stat("wasmcustom.kvroute.lease.taken") >= 1 && envoy.stat("wasmcustom.kvroute.snapshot.published") >= 2
    });
    thread::sleep(Duration::from_millis(500));
    let taken = envoy.stat("wasmcustom.kvroute.lease.taken");
    // A request carrying the trigger asks, through shared data, the VM holding the lease
    // (a worker's or the main thread's) to panic on its next tick.
    let _ = http_client::request(envoy.port, "GET", "/", &[("x-kvroute-test-panic", "lease")], b"");
    let mut died = None;
    let deadline = Instant::now() + Duration::from_secs(10);
    while Instant::now() < deadline {
        if envoy.log_text().contains("kvroute panicked") {
            died = Some(Instant::now());
            break;
        }
        thread::sleep(Duration::from_millis(2));
    }
    let died = died.expect("the VM holding the lease did not panic");
    wait_until(
        "another worker taking the lease",
        Duration::from_secs(5),
        &envoy,
        || envoy.stat("wasmcustom.kvroute.lease.taken") > taken,
    );
    let takeover = died.elapsed();
    // The new poller follows the pool: a new host is routed to.
    eds.write(&servers.iter().map(|s| (s.port, "HEALTHY")).collect::<Vec<_>>());
    let traffic = Traffic::start(envoy.port, MODEL);
    let third = servers[2].address();
    wait_until(
        "routing to the host added after the takeover",
        Duration::from_secs(5),
        &envoy,
        || traffic.since(died).iter().any(|s| routed(s) && s.served_by == third),
    );
    let seen = traffic.finish();
    assert!(seen.iter().all(|s| s.status == 200));
    eprintln!(
        "lease takeover after the polling worker's VM died: {} ms",
        takeover.as_millis()
    );
}

/// The admin cluster kvroute polls answers only read-only listings; no client request
/// reaches the admin through the gateway.
#[test]
fn the_admin_answers_kvroute_only_clusters_and_stats_and_clients_cannot_reach_it() {
    let servers: Vec<FakeVllm> = (0..2).map(|_| FakeVllm::start(Load::idle()).unwrap()).collect();
    let ports: Vec<u16> = servers.iter().map(|s| s.port).collect();
    let envoy = Envoy::start("envoy.yaml", &ports, |t| t).unwrap();
    let admin = |method: &str, path: &str| {
        http_client::request(envoy.admin, method, path, &[], b"")
            .unwrap()
            .status
    };
    assert_eq!(admin("GET", "/clusters?format=json&filter=%5Evllm_pool%24"), 200);
    assert_eq!(admin("GET", "/stats/prometheus"), 200);
    assert_eq!(admin("GET", "/stats"), 200);
    assert_eq!(admin("GET", "/stats?filter=%5Ecluster%5C."), 200);
    for (method, path) in [
        ("POST", "/stats/recentlookups/enable"),
        ("POST", "/stats/recentlookups/clear"),
        ("GET", "/clusters"),
        ("GET", "/config_dump"),
        ("GET", "/server_info"),
        ("GET", "/certs"),
        ("POST", "/quitquitquit"),
        ("POST", "/healthcheck/fail"),
        ("POST", "/logging?level=trace"),
        ("POST", "/runtime_modify?a=b"),
        ("POST", "/drain_listeners"),
        ("POST", "/reset_counters"),
    ] {
        assert_eq!(admin(method, path), 403, "{method} {path}");
    }
    // Through the gateway, the admin's paths and address reach neither the admin nor a
    // server: the listener answers them itself (a 404, envoy.yaml's paths; e2e_paths.rs).
    let admin_addr = format!("127.0.0.1:{}", envoy.admin);
    for (path, headers) in [
        ("/clusters?format=json", vec![]),
        (
            "/quitquitquit",
            vec![("x-gateway-destination-endpoint", admin_addr.as_str())],
        ),
        ("/config_dump", vec![]),
    ] {
        let r = http_client::request(envoy.port, "POST", path, &headers, b"").unwrap();
        assert!(
            r.status == 404 && r.header("x-served-by").is_none() && r.body.contains("Not served by the gateway"),
            "{path}: not the listener's own 404: {} {}",
            r.status,
            r.body
        );
    }
    wait_until("kvroute reading /clusters", Duration::from_secs(5), &envoy, || {
        envoy.stat("wasmcustom.kvroute.discovery.success") >= 1
    });
}

/// Envoy (service mode, `cost.speed_weights_from_envoy`) over an EDS pool of `hosts` (port,
/// weight), once kvroute's stats show every weight.
fn weighted_pool(tag: &str, hosts: &[(u16, u32)]) -> (EdsDir, Envoy) {
    let eds = EdsDir::new(tag);
    eds.write_weighted(hosts);
    let source = eds_source(&eds.0);
    let from_envoy = r#" "cost": {"speed_weights_from_envoy": true},"#;
    let envoy = Envoy::start("envoy.yaml", &[], |t| shaped(t, Mode::Service, &source, from_envoy)).unwrap();
    wait_until(
        "the weights in kvroute's stats",
        Duration::from_secs(10),
        &envoy,
        || {
            hosts
                .iter()
                .all(|(port, w)| weight_gauge(&envoy, *port) == Some(u64::from(*w) * 1000))
        },
    );
    (eds, envoy)
}

fn weight_gauge(envoy: &Envoy, port: u16) -> Option<u64> {
    envoy.stat_if_defined(&format!(
        "wasmcustom.kvroute.endpoint.127_0_0_1_{port}.speed_weight_permille"
    ))
}

/// Two hosts weigh 3 in the pool's EDS (H100s beside A100s at 1): kvroute reads the weights
/// from Envoy, reports them, and on a fleet whose speeds it has not learned places new
/// prefixes on the heavier hosts.
#[test]
fn service_mode_envoy_weights_reach_kvroute_and_place_a_cold_fleets_prefixes() {
    let servers: Vec<FakeVllm> = (0..4).map(|_| FakeVllm::start(Load::idle()).unwrap()).collect();
    let hosts: Vec<(u16, u32)> = servers.iter().zip([3, 3, 1, 1]).map(|(s, w)| (s.port, w)).collect();
    let (_eds, envoy) = weighted_pool("weights", &hosts);
    let post = |n: usize| chat(&envoy, MODEL, &format!("Weighted prompt {n}. ").repeat(30));
    wait_until("kvroute routing", Duration::from_secs(10), &envoy, || {
        (0..8).all(|i| routed_reason(&post(1000 + i)))
    });
    let heavy: Vec<String> = servers[..2].iter().map(addr).collect();
    for n in 0..24 {
        let r = post(n);
        let by = r.header("x-served-by").unwrap_or("").to_string();
        assert!(
            routed_reason(&r) && heavy.contains(&by),
            "prefix {n} served by {by} ({:?}); the weight-3 hosts are {heavy:?}",
            r.header("x-kvroute-reason")
        );
    }
}

/// A server that leaves the pool stops reading as a live one: its per-server gauges go to 0
/// (a metric cannot be removed; its last value would stay in every dashboard).
#[test]
fn service_mode_a_departed_servers_gauges_read_zero() {
    let servers: Vec<FakeVllm> = (0..3).map(|_| FakeVllm::start(Load::idle()).unwrap()).collect();
    let hosts: Vec<(u16, u32)> = servers.iter().zip([3, 1, 1]).map(|(s, w)| (s.port, w)).collect();
    let (eds, envoy) = weighted_pool("departed", &hosts);
    let gauge = |port: u16| weight_gauge(&envoy, port);
    eds.write_weighted(&hosts[..2]);
    let gone = hosts[2].0;
    wait_until(
        "the departed server's gauge at 0",
        Duration::from_secs(10),
        &envoy,
        || gauge(gone) == Some(0),
    );
    assert_eq!(gauge(hosts[0].0), Some(3000), "a server that stays keeps its gauge");
    assert_eq!(gauge(hosts[1].0), Some(1000), "a server that stays keeps its gauge");
    eds.write_weighted(&hosts);
    wait_until("the returning server's gauge", Duration::from_secs(10), &envoy, || {
        gauge(gone) == Some(1000)
    });
}

/// An operator's stats matcher that drops the pool cluster's stats leaves discovery's cheap
/// signature (`/stats?filter=^cluster\.vllm_pool\.…`) empty for ever: kvroute then reads the
/// full `/clusters` at every poll, and a new host is routed within a poll or two, not at the
/// next full resync (60 s here).
#[test]
fn service_mode_a_pool_whose_cluster_stats_envoy_drops_is_still_followed_at_every_poll() {
    let servers: Vec<FakeVllm> = (0..2).map(|_| FakeVllm::start(Load::idle()).unwrap()).collect();
    let eds = EdsDir::new("no-cluster-stats");
    eds.write(&[(servers[0].port, "HEALTHY")]);
    let source = eds_source(&eds.0);
    let matcher =
        "stats_config:\n  stats_matcher:\n    exclusion_list:\n      patterns:\n        - prefix: cluster.vllm_pool.\n";
    let envoy = Envoy::start("envoy.yaml", &[], |t| {
        shaped(t, Mode::Service, &source, "")
            .replace(
                r#""discovery": {"admin_cluster": "kvroute_admin", "cluster": "vllm_pool"}"#,
                r#""discovery": {"admin_cluster": "kvroute_admin", "cluster": "vllm_pool", "resync_ms": 60000}"#,
            )
            .replacen("admin:", &format!("{matcher}admin:"), 1)
    })
    .unwrap();
    let hosts = || envoy.stat("wasmcustom.kvroute.discovery.hosts");
    wait_until("the first host", Duration::from_secs(10), &envoy, || hosts() == 1);
    eds.write(&[(servers[0].port, "HEALTHY"), (servers[1].port, "HEALTHY")]);
    wait_until("the new host", Duration::from_secs(3), &envoy, || hosts() == 2);
    assert!(
        envoy.log_text().contains("reading /clusters at every poll"),
        "{}",
        tail(&envoy)
    );
}

/// The service renews its polling lease on its own tick: with scrape and discovery
/// intervals past `discovery.lease_ms` (1 s) it still ticks often enough, so no worker takes
/// the lease from it (workers took it every cycle, and two pollers scraped each server).
#[test]
fn service_mode_slow_intervals_leave_the_lease_with_the_service() {
    let servers: Vec<FakeVllm> = (0..2).map(|_| FakeVllm::start(Load::idle()).unwrap()).collect();
    let ports: Vec<u16> = servers.iter().map(|s| s.port).collect();
    let slow = [
        (
            r#""scrape": {"cluster": "vllm_pool", "interval_ms": 200, "timeout_ms": 150},"#,
            r#""scrape": {"cluster": "vllm_pool", "interval_ms": 2000, "timeout_ms": 500}, "health": {"stale_after_ms": 5000},"#,
        ),
        (
            r#""discovery": {"admin_cluster": "kvroute_admin", "cluster": "vllm_pool"}"#,
            r#""discovery": {"admin_cluster": "kvroute_admin", "cluster": "vllm_pool", "interval_ms": 2000, "timeout_ms": 500}"#,
        ),
    ];
    let envoy = Envoy::start("envoy.yaml", &ports, |mut t| {
        for (from, to) in slow {
            assert!(t.contains(from), "{from}");
            t = t.replace(from, to);
        }
        t
    })
    .unwrap();
    std::thread::sleep(Duration::from_millis(5_000));
    assert_eq!(envoy.stat("wasmcustom.kvroute.lease.taken"), 0, "{}", tail(&envoy));
    // About 3 scrape rounds in 5 s: one poller, not two.
    for s in &servers {
        assert!((2..=4).contains(&s.scrapes()), "{} scrapes", s.scrapes());
    }
}

//! End to end: real Envoy 1.40 + dist/kvroute.wasm in front of test vLLM servers, for both
//! shipped cluster shapes (`override_host` in envoy.yaml, `ORIGINAL_DST` in
//! envoy-original-dst.yaml).

use std::collections::BTreeMap;
use std::thread;
use std::time::{Duration, Instant};

use kvroute_wasm_tests::envoy::Envoy;
use kvroute_wasm_tests::fake_vllm::{FakeVllm, Load, MODEL};

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

    fn index_of(&self, address: &str) -> Option<usize> {
        self.servers.iter().position(|s| s.address() == address)
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
fn probe_stats() {
    let f = fleet(
        "envoy.yaml",
        vec![Load::heavy(), Load::idle(), Load::idle(), Load::idle()],
    );
    for i in 0..5 {
        let r = f.chat(&long_prompt(&format!("t{i}")), "hello");
        eprintln!("{r:?}");
    }
    let r = kvroute_wasm_tests::http_client::request(f.envoy.admin, "GET", "/stats?filter=kvroute", &[], b"").unwrap();
    eprintln!("{}", r.body);
    eprintln!(
        "{}",
        f.envoy
            .log_text()
            .lines()
            .filter(|l| l.contains("wasm") || l.contains("kvroute"))
            .take(20)
            .collect::<Vec<_>>()
            .join("\n")
    );
}

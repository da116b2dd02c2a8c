//! Which paths the gateway serves (README: "Which paths the gateway serves"), in real Envoy
//! with every shipped config that has an inference listener, in front of the simulator's live
//! servers. vLLM's per-request API (`/v1/*`, `/tokenize`, `/detokenize`, `/health`) reaches a
//! server; `/metrics` and every other path get the gateway's own 404 in vLLM's error shape and
//! never reach a server (every simulator response names its server in `x-served-by`); HTTP/1.0
//! clients are served, streams included, where Envoy's default answers 426.

#![allow(clippy::unwrap_used, clippy::panic, clippy::disallowed_methods)] // wall-time test helpers

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use kvroute_sim::profile::{Gpu, Model, Profile};
use kvroute_wasm_tests::envoy::Envoy;
use kvroute_wasm_tests::http_client::{self, Response};

const CONFIGS: [&str; 3] = ["envoy.yaml", "envoy-original-dst.yaml", "envoy-round-robin.yaml"];
const MODEL: &str = "meta-llama/Llama-3.1-8B-Instruct";

fn fleet() -> (tokio::runtime::Runtime, Vec<u16>) {
    let profile = Profile::new(Gpu::H100_80g, Model::Llama31_8b, 1).unwrap();
    let (rt, base) = kvroute_sim::serve::start_in_background(profile, 2, 20.0).unwrap();
    (rt, vec![base, base + 1])
}

/// One request on a new keep-alive connection, the response read up to its `content-length`
/// (every answer checked here has one), as HTTP clients read it. Reading to EOF instead would
/// race the gateway's own 404s: Envoy answers them from the request headers and closes the
/// connection with the body unread, and the kernel's reset can discard the unread response.
fn send(envoy: &Envoy, method: &str, path: &str, body: &str) -> Response {
    let mut s = TcpStream::connect(("127.0.0.1", envoy.port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    let request = format!(
        "{method} {path} HTTP/1.1\r\nhost: gateway\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    s.write_all(request.as_bytes()).unwrap();
    let mut raw = Vec::new();
    let mut buf = [0u8; 65536];
    loop {
        let n = s.read(&mut buf).unwrap_or_else(|e| panic!("{method} {path}: {e}"));
        raw.extend_from_slice(&buf[..n]);
        let text = String::from_utf8_lossy(&raw);
        if let Some((head, rest)) = text.split_once("\r\n\r\n") {
            let length = head
                .lines()
                .find_map(|l| {
                    l.to_ascii_lowercase()
                        .strip_prefix("content-length:")
                        .map(|v| v.trim().to_string())
                })
                .and_then(|v| v.parse::<usize>().ok())
                .unwrap_or_else(|| panic!("{method} {path}: no content-length: {head}"));
            if rest.len() >= length {
                break;
            }
        }
        assert!(n > 0, "{method} {path}: closed before the whole response");
    }
    http_client::parse_response(&raw).unwrap()
}

fn assert_from_a_server(r: &Response, what: &str) {
    assert_eq!(r.status, 200, "{what}: {}", r.body);
    assert!(r.header("x-served-by").is_some(), "{what}: not answered by a server");
}

fn assert_gateway_404(r: &Response, what: &str, says: &str) {
    assert_eq!(r.status, 404, "{what}: {}", r.body);
    assert!(r.header("x-served-by").is_none(), "{what}: reached a server");
    assert_eq!(r.header("content-type"), Some("application/json"), "{what}");
    assert!(
        r.body.starts_with(r#"{"error": {"message": "#) && r.body.contains(r#""code": 404"#),
        "{what}: not vLLM's error shape: {}",
        r.body
    );
    assert!(r.body.contains(says), "{what}: {}", r.body);
}

#[test]
fn every_inference_listener_forwards_the_vllm_api_and_answers_other_paths_itself() {
    let (_rt, ports) = fleet();
    let completion = format!(r#"{{"model":"{MODEL}","prompt":"hello","max_tokens":2}}"#);
    let chat = format!(r#"{{"model":"{MODEL}","messages":[{{"role":"user","content":"hi"}}],"max_tokens":2}}"#);
    for config in CONFIGS {
        let envoy = Envoy::start(config, &ports, |t| t).unwrap();
        std::thread::sleep(Duration::from_millis(600));
        for (method, path, body) in [
            ("POST", "/v1/completions", completion.as_str()),
            ("POST", "/v1/chat/completions", chat.as_str()),
            ("GET", "/v1/models", ""),
            ("GET", "/v1/models?limit=1", ""),
            ("POST", "/tokenize", r#"{"prompt":"hello"}"#),
            ("POST", "/detokenize", r#"{"tokens":[1819043176]}"#),
            ("GET", "/health", ""),
        ] {
            assert_from_a_server(&send(&envoy, method, path, body), &format!("{config} {method} {path}"));
        }
        for path in ["/metrics", "/metrics?name[]=vllm:num_requests_running"] {
            let r = send(&envoy, "GET", path, "");
            assert_gateway_404(
                &r,
                &format!("{config} GET {path}"),
                "Scrape every server at its own /metrics",
            );
        }
        // vLLM's per-server operations and anything unknown: never aimed at a random server.
        for (method, path) in [
            ("POST", "/v1/load_lora_adapter"),
            ("POST", "/v1/unload_lora_adapter"),
            ("POST", "/reset_prefix_cache"),
            ("POST", "/sleep"),
            ("POST", "/start_profile"),
            ("GET", "/server_info"),
            ("GET", "/load"),
            ("GET", "/"),
            ("GET", "/healthz"),
            ("GET", "/tokenize/extra"),
        ] {
            let r = send(&envoy, method, path, "{}");
            assert_gateway_404(&r, &format!("{config} {method} {path}"), "Not served by the gateway");
        }
    }
}

#[test]
fn http_1_0_clients_are_served_streams_included_and_kvroute_routes_them() {
    let (_rt, ports) = fleet();
    let envoy = Envoy::start("envoy.yaml", &ports, |t| t).unwrap();
    std::thread::sleep(Duration::from_millis(800));
    let decisions = || -> u64 {
        ["cold", "prefix_hit", "fallback"]
            .iter()
            .map(|d| envoy.stat(&format!("wasmcustom.kvroute.decision.{d}")))
            .sum()
    };
    let before = decisions();
    for (host, stream) in [("host: 127.0.0.1\r\n", false), ("", true)] {
        let body = format!(r#"{{"model":"{MODEL}","prompt":"once upon a time","max_tokens":3,"stream":{stream}}}"#);
        // No `host` header in the second request: HTTP/1.0 does not require one.
        let raw = format!(
            "POST /v1/completions HTTP/1.0\r\n{host}content-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
            body.len()
        );
        let r = http_client::request_raw(envoy.port, raw.as_bytes()).unwrap();
        assert_from_a_server(&r, &format!("HTTP/1.0 stream={stream}"));
        if stream {
            // No chunked framing in HTTP/1.0: the stream ends when the connection closes.
            assert_eq!(r.body.matches("\"text\":\" tok\"").count(), 3, "{}", r.body);
            assert!(r.body.trim_end().ends_with("data: [DONE]"), "{}", r.body);
        } else {
            assert!(r.body.contains(r#""completion_tokens":3"#), "{}", r.body);
        }
    }
    assert_eq!(decisions() - before, 2, "kvroute routed both HTTP/1.0 bodies");
    let raw = "GET /metrics HTTP/1.0\r\n\r\n";
    let r = http_client::request_raw(envoy.port, raw.as_bytes()).unwrap();
    assert_gateway_404(&r, "HTTP/1.0 GET /metrics", "Scrape every server");
}

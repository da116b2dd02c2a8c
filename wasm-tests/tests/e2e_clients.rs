//! What a client sees through the whole stack: real Envoy + dist/kvroute.wasm in front of the
//! simulator's live servers (wall time), with the shipped configs. Issue 13: a long
//! non-streaming generation must come back once, generated once — the gateway never cuts a
//! generation and runs it again.

#![allow(clippy::unwrap_used, clippy::panic, clippy::disallowed_methods)] // wall-time test helpers

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use kvroute_sim::profile::{Gpu, Model, Profile};
use kvroute_wasm_tests::envoy::{repo_root, Envoy};
use kvroute_wasm_tests::http_client;

/// Sends one request and waits up to `wait` for the whole answer: (status, body).
fn request_waiting(port: u16, path: &str, body: &str, wait: Duration) -> (u16, String) {
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(wait)).unwrap();
    write!(
        s,
        "POST {path} HTTP/1.1\r\nhost: x\r\nconnection: close\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).unwrap();
    let text = String::from_utf8_lossy(&raw).to_string();
    let (head, rest) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let status = head.split(' ').nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
    (status, rest.to_string())
}

/// Sum over `ports` of the samples of `family` whose labels contain `label` (Prometheus text).
fn fleet_metric(ports: &[u16], family: &str, label: &str) -> f64 {
    ports
        .iter()
        .map(|p| {
            let r = http_client::request(*p, "GET", "/metrics", &[], b"").unwrap();
            r.body
                .lines()
                .filter(|l| l.starts_with(&format!("{family}{{")) && l.contains(label))
                .filter_map(|l| l.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok()))
                .sum::<f64>()
        })
        .sum()
}

/// The number after `"key":` in a JSON text (this crate has no JSON parser).
fn number(json: &str, key: &str) -> f64 {
    let at = json
        .find(&format!("\"{key}\":"))
        .unwrap_or_else(|| panic!("no {key} in {json}"));
    let rest = &json[at + key.len() + 3..];
    let end = rest
        .find(|c: char| !c.is_ascii_digit() && c != '.')
        .unwrap_or(rest.len());
    rest[..end].parse().unwrap()
}

#[test]
fn shipped_configs_have_no_per_try_timeout_and_retry_only_before_any_work() {
    for config in [
        "envoy.yaml",
        "envoy-original-dst.yaml",
        "envoy-round-robin.yaml",
        "bench-overhead.yaml",
    ] {
        let text = std::fs::read_to_string(repo_root().join("envoy").join(config)).unwrap();
        let settings: Vec<&str> = text.lines().map(str::trim).filter(|l| !l.starts_with('#')).collect();
        assert!(
            !settings
                .iter()
                .any(|l| l.starts_with("per_try_timeout") || l.starts_with("per_try_idle_timeout")),
            "{config}: a per-try timeout cuts long non-streaming generations and runs them again"
        );
        for retry_on in settings.iter().filter_map(|l| l.strip_prefix("retry_on:")) {
            for condition in retry_on.split(',').map(str::trim) {
                assert!(
                    [
                        "connect-failure",
                        "reset-before-request",
                        "refused-stream",
                        "reset",
                        "retriable-status-codes"
                    ]
                    .contains(&condition),
                    "{config}: `{condition}` retries a request a server may already have generated"
                );
            }
        }
        // The only status retried is vLLM's 503 refusal (admission limits, before any work).
        for codes in settings
            .iter()
            .filter_map(|l| l.strip_prefix("retriable_status_codes:"))
        {
            assert_eq!(
                codes.trim(),
                "[503]",
                "{config}: a status other than 503 may follow work done"
            );
        }
    }
}

/// ≈ 40 s of generation at wall-clock speed (8B on H100 decodes a token in ≈ 7.3 ms), longer
/// than the 30 s per-try timeout the configs used to ship.
#[test]
fn a_long_non_streaming_generation_runs_once_and_returns_200() {
    let profile = Profile::new(Gpu::H100_80g, Model::Llama31_8b, 1).unwrap();
    let (_rt, base) = kvroute_sim::serve::start_in_background(profile, 4, 1.0).unwrap();
    let ports: Vec<u16> = (base..base + 4).collect();
    let envoy = Envoy::start("envoy.yaml", &ports, |t| t).unwrap();
    std::thread::sleep(Duration::from_millis(800));

    let max_tokens = 5_500;
    let body = format!(
        r#"{{"model":"meta-llama/Llama-3.1-8B-Instruct","max_tokens":{max_tokens},"messages":[{{"role":"user","content":"write a very long story"}}]}}"#
    );
    let started = Instant::now();
    let (status, answer) = request_waiting(envoy.port, "/v1/chat/completions", &body, Duration::from_secs(150));
    let took = started.elapsed();
    assert_eq!(status, 200, "after {took:?}: {answer}");
    assert!(
        took > Duration::from_secs(35),
        "the generation should take ≈ 40 s, took {took:?}"
    );
    assert_eq!(number(&answer, "completion_tokens"), f64::from(max_tokens), "{answer}");

    // Server side: one request admitted and finished in the whole fleet, its tokens once.
    let admitted_prompt_tokens = fleet_metric(&ports, "vllm:prompt_tokens_total", "engine=");
    assert_eq!(admitted_prompt_tokens, number(&answer, "prompt_tokens"));
    assert_eq!(fleet_metric(&ports, "vllm:request_success_total", "engine="), 1.0);
    assert_eq!(
        fleet_metric(&ports, "vllm:generation_tokens_total", "engine="),
        f64::from(max_tokens)
    );
    assert_eq!(envoy.stat("cluster.vllm_pool.upstream_rq_retry"), 0);
}

//! Deterministic scripts over the public API, used to prove that a build (native, wasm32,
//! the filter's) computes exactly what the reference build computes.
//!
//! [`check_golden_vectors`] replays the prefix-hashing golden vectors (made by an independent
//! Python implementation); [`scripted_routing`] runs a fixed sequence of scrapes, requests,
//! completions, failures and membership changes and prints one line per decision. The
//! native test suite compares that text with `tests/fixtures/scenario_expected.txt`, and so
//! does the wasm-bindgen suite: equal text means equal behaviour.

use std::fmt::Write;

use serde::Deserialize;

use crate::config::{Config, PolicyKind, RawConfig};
use crate::hashing::PrefixHasher;
use crate::metrics::parse_metrics;
use crate::request::{parse, ApiKind};
use crate::router::{Completion, Router};
use crate::types::{EndpointId, Millis};

#[derive(Deserialize)]
struct Golden {
    cases: Vec<GoldenCase>,
}

#[derive(Deserialize)]
struct GoldenCase {
    model: String,
    tenant: String,
    cache_salt: String,
    text_hex: String,
    block_bytes: usize,
    max_blocks: usize,
    hashes: Vec<String>,
}

/// Checks every golden vector in `json`; returns how many hashes matched, or the first mismatch.
pub fn check_golden_vectors(json: &str) -> Result<usize, String> {
    let golden: Golden = serde_json::from_str(json).map_err(|e| format!("golden file: {e}"))?;
    let mut checked = 0;
    for (n, case) in golden.cases.iter().enumerate() {
        let text = unhex(&case.text_hex).ok_or(format!("case {n}: text_hex is not hex"))?;
        let got: Vec<String> = PrefixHasher::new(case.block_bytes, case.max_blocks)
            .hash(&case.model, &case.tenant, &case.cache_salt, &text)
            .iter()
            .map(ToString::to_string)
            .collect();
        if got != case.hashes {
            return Err(format!("case {n}: expected {:?}, got {:?}", case.hashes, got));
        }
        checked += got.len();
    }
    Ok(checked)
}

fn unhex(s: &str) -> Option<Vec<u8>> {
    (0..s.len())
        .step_by(2)
        .map(|i| s.get(i..i + 2).and_then(|b| u8::from_str_radix(b, 16).ok()))
        .collect()
}

const METRICS: &str = include_str!("../tests/fixtures/vllm_metrics_v0.33.txt");

fn metrics_body(running: u32, waiting: u32, kv: f64) -> String {
    METRICS
        .replace(
            "vllm:num_requests_running{engine=\"0\",model_name=\"meta-llama/Llama-3.1-8B-Instruct\"} 12.0",
            &format!(
                "vllm:num_requests_running{{engine=\"0\",model_name=\"meta-llama/Llama-3.1-8B-Instruct\"}} {running}.0"
            ),
        )
        .replace(
            "vllm:num_requests_waiting{engine=\"0\",model_name=\"meta-llama/Llama-3.1-8B-Instruct\"} 3.0",
            &format!(
                "vllm:num_requests_waiting{{engine=\"0\",model_name=\"meta-llama/Llama-3.1-8B-Instruct\"}} {waiting}.0"
            ),
        )
        .replace(
            "vllm:kv_cache_usage_perc{engine=\"0\",model_name=\"meta-llama/Llama-3.1-8B-Instruct\"} 0.4137",
            &format!("vllm:kv_cache_usage_perc{{engine=\"0\",model_name=\"meta-llama/Llama-3.1-8B-Instruct\"}} {kv}"),
        )
}

fn chat_body(group: u32, question: u32) -> String {
    let system = format!("You are assistant number {group}. ").repeat(40);
    format!(
        r#"{{"model":"meta-llama/Llama-3.1-8B-Instruct","max_tokens":64,"messages":[{{"role":"system","content":"{system}"}},{{"role":"user","content":"question {question}"}}]}}"#
    )
}

/// Runs the fixed script under `policy` and returns one line per event that decided something.
pub fn scripted_routing(policy: PolicyKind) -> Result<String, String> {
    let raw = RawConfig {
        endpoints: (1..=4).map(|i| format!("127.0.0.1:800{i}")).collect(),
        policy,
        ..RawConfig::default()
    };
    let config = Config::try_from(raw).map_err(|e| e.to_string())?;
    let ids: Vec<EndpointId> = config.endpoints().to_vec();
    let mut router = Router::new(config);
    let mut out = String::new();
    let mut now = Millis(1_000);
    for (i, id) in ids.iter().enumerate() {
        let body = metrics_body(i as u32 * 3, i as u32, 0.1 * i as f64);
        let m = parse_metrics(body.as_bytes(), 1 << 20).map_err(|e| e.to_string())?;
        router.on_metrics(id, m, now);
    }
    for n in 0..48u32 {
        now = now.plus(37);
        if n == 20 {
            router.on_scrape_failed(&ids[1], now);
            router.on_scrape_failed(&ids[1], now);
        }
        if n == 30 {
            let m = parse_metrics(metrics_body(40, 30, 0.7).as_bytes(), 1 << 20).map_err(|e| e.to_string())?;
            router.on_metrics(&ids[0], m, now);
        }
        if n == 40 {
            router.on_endpoints(&ids[..3]);
        }
        let parsed = parse(ApiKind::Chat, chat_body(n % 6, n).as_bytes()).map_err(|e| e.to_string())?;
        let req = router.request(&parsed, if n % 5 == 0 { "tenant-b" } else { "" }, false);
        let d = router.route(&req, now);
        let cost = d
            .breakdown
            .iter()
            .find(|s| Some(&s.endpoint) == d.best())
            .map_or(f64::NAN, |s| s.cost.0);
        let _ = writeln!(
            out,
            "{n} {} {} matched={} cost={cost:.6} blocks={}",
            d.outcome.label(),
            d.header_value().unwrap_or_default(),
            d.matched_blocks,
            req.blocks.first().map(ToString::to_string).unwrap_or_default()
        );
        router.on_routed(u64::from(n), &req, &d, now);
        if n % 3 == 0 {
            let done = Completion {
                served_by: None,
                status: 200,
                cached_tokens: Some(u64::from(d.matched_blocks) * 64),
                prompt_tokens: None,
                usage: true,
                client_left: false,
            };
            router.on_completed(u64::from(n), &done, now);
        }
    }
    let s = router.stats();
    let _ = writeln!(
        out,
        "stats routed={} completed={} predicted_cached={} entries={}",
        s.routed,
        s.completed,
        s.predicted_cached_tokens,
        router.index().entries()
    );
    Ok(out)
}

/// The scenario under every policy, concatenated.
pub fn scripted_routing_all_policies() -> Result<String, String> {
    let mut out = String::new();
    for p in [
        PolicyKind::Cost,
        PolicyKind::Weighted,
        PolicyKind::LeastRequest,
        PolicyKind::RoundRobin,
        PolicyKind::Random,
    ] {
        let _ = writeln!(out, "# policy {p:?}");
        out.push_str(&scripted_routing(p)?);
    }
    Ok(out)
}

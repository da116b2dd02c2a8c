//! The load generator: replays a workload against a real HTTP endpoint (a gateway or one
//! server) in wall time, streaming every request, and measures what a client sees: TTFT
//! (first content chunk), mean inter-token latency, end-to-end latency, errors, the server
//! that answered (`x-served-by`) and the cached tokens vLLM reported. The JSON has the same
//! shape as a replay run.

#![allow(clippy::disallowed_methods)] // the wall-time driver: reading the clock is its job

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context;
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;

use crate::report::{Record, RunReport};
use crate::workload::SimRequest;

struct Outcome {
    server: String,
    start_ms: f64,
    first_ms: f64,
    last_ms: f64,
    end_ms: f64,
    tokens: u64,
    prompt_tokens: u64,
    cached_tokens: u64,
}

/// Sends `requests` (arrival times in ms from now) to `url` and reports. Requests arriving
/// after `duration_s` are not sent.
pub async fn bench(
    url: &str,
    model: &str,
    requests: &[SimRequest],
    duration_s: f64,
    label: &str,
    progress: impl Fn(u64) + Send + Sync + 'static,
) -> anyhow::Result<(RunReport, Vec<String>)> {
    let base: hyper::Uri = url.parse().with_context(|| format!("--url {url:?} is not a URL"))?;
    anyhow::ensure!(base.scheme_str() == Some("http"), "--url must be http://host:port");
    let target: hyper::Uri = format!("{}/v1/chat/completions", url.trim_end_matches('/')).parse()?;
    let client: Client<_, Full<Bytes>> = Client::builder(TokioExecutor::new())
        .pool_idle_timeout(Duration::from_secs(30))
        .build_http();
    let start = Instant::now();
    let outcomes: Arc<Mutex<Vec<Outcome>>> = Arc::new(Mutex::new(Vec::new()));
    let progress = Arc::new(progress);
    let mut tasks = tokio::task::JoinSet::new();
    let chosen: Vec<&SimRequest> = requests
        .iter()
        .filter(|r| r.arrival_ms <= duration_s * 1000.0)
        .collect();
    for r in &chosen {
        let body = serde_json::json!({
            "model": model,
            "messages": [{"role": "user", "content": r.prompt_text()}],
            "max_tokens": r.output_tokens,
            "stream": true,
            "stream_options": {"include_usage": true},
        })
        .to_string();
        let (client, target, outcomes, progress) = (
            client.clone(),
            target.clone(),
            Arc::clone(&outcomes),
            Arc::clone(&progress),
        );
        let at = Duration::from_secs_f64(r.arrival_ms / 1000.0);
        tasks.spawn(async move {
            tokio::time::sleep_until(tokio::time::Instant::from_std(start + at)).await;
            let res = tokio::time::timeout(Duration::from_secs(600), one(&client, target, body, start)).await;
            if let (Ok(Some(o)), Ok(mut all)) = (res, outcomes.lock()) {
                all.push(o);
                progress(all.len() as u64);
            }
        });
    }
    while tasks.join_next().await.is_some() {}
    let outcomes = outcomes.lock().map(|mut o| std::mem::take(&mut *o)).unwrap_or_default();
    let servers: Vec<String> = outcomes
        .iter()
        .map(|o| o.server.clone())
        .collect::<std::collections::BTreeSet<_>>()
        .into_iter()
        .collect();
    let index: BTreeMap<&str, usize> = servers.iter().enumerate().map(|(i, s)| (s.as_str(), i)).collect();
    let records: Vec<Record> = outcomes
        .iter()
        .map(|o| Record {
            server: index.get(o.server.as_str()).copied().unwrap_or(0),
            arrival_ms: o.start_ms,
            finish_ms: o.end_ms,
            ttft_ms: o.first_ms - o.start_ms,
            itl_ms: if o.tokens > 1 {
                (o.last_ms - o.first_ms) / (o.tokens - 1) as f64
            } else {
                0.0
            },
            e2e_ms: o.end_ms - o.start_ms,
            prompt_tokens: o.prompt_tokens,
            cached_tokens: o.cached_tokens,
            output_tokens: o.tokens,
        })
        .collect();
    Ok((
        RunReport::from_records(label, chosen.len(), &records, &[], servers.len()),
        servers,
    ))
}

async fn one(
    client: &Client<hyper_util::client::legacy::connect::HttpConnector, Full<Bytes>>,
    target: hyper::Uri,
    body: String,
    start: Instant,
) -> Option<Outcome> {
    let ms = || start.elapsed().as_secs_f64() * 1000.0;
    let start_ms = ms();
    let req = hyper::Request::post(target)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body)))
        .ok()?;
    let resp = client.request(req).await.ok()?;
    if !resp.status().is_success() {
        return None;
    }
    let server = resp
        .headers()
        .get("x-served-by")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("unknown")
        .to_string();
    let mut body = resp.into_body();
    let (mut buf, mut tokens, mut first, mut last, mut prompt, mut cached, mut done) =
        (Vec::new(), 0u64, 0.0, 0.0, 0, 0, false);
    while let Some(frame) = body.frame().await {
        let Ok(data) = frame.ok()?.into_data() else { continue };
        buf.extend_from_slice(&data);
        while let Some(end) = buf.windows(2).position(|w| w == b"\n\n") {
            let event: Vec<u8> = buf.drain(..end + 2).collect();
            let line = String::from_utf8_lossy(&event);
            let Some(payload) = line.trim().strip_prefix("data: ") else {
                continue;
            };
            if payload == "[DONE]" {
                done = true;
                continue;
            }
            let v: serde_json::Value = serde_json::from_str(payload).ok()?;
            // A token is a chunk with text: vLLM opens a chat stream with a role-only delta.
            let text = |c: &serde_json::Value| {
                c["delta"]["content"]
                    .as_str()
                    .or(c["text"].as_str())
                    .is_some_and(|t| !t.is_empty())
            };
            if v["choices"].as_array().is_some_and(|c| c.iter().any(text)) {
                let now = ms();
                if tokens == 0 {
                    first = now;
                }
                last = now;
                tokens += 1;
            }
            if let Some(u) = v.get("usage").filter(|u| !u.is_null()) {
                prompt = u["prompt_tokens"].as_u64().unwrap_or(0);
                cached = u["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap_or(0);
            }
        }
    }
    (done && tokens > 0).then(|| Outcome {
        server,
        start_ms,
        first_ms: first,
        last_ms: last,
        end_ms: ms(),
        tokens,
        prompt_tokens: prompt,
        cached_tokens: cached,
    })
}

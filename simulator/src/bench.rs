//! The load generator: replays a workload against a real HTTP endpoint (a gateway or one
//! server) in wall time, streaming every request, and measures what a client sees: TTFT
//! (first content chunk), mean inter-token latency, end-to-end latency, errors, the server
//! that answered (`x-served-by`) and the cached tokens vLLM reported. The JSON has the same
//! shape as a replay run, plus why the failed requests failed (`failures`: the HTTP
//! status, no answer, a stream cut short or malformed, counted by cause; also printed as a
//! `failed:` line after the table).
//!
//! Two things a live comparison of gateways needs, and how to ask for them:
//! - **Several gateways** (replicas behind a Service): `--url` takes a comma-separated list;
//!   each request goes to one of them at random, from a fixed seed and the request's place in
//!   the workload, so the same workload spreads the same way every run.
//! - **Cold start and steady state apart**: with `KVROUTE_BENCH_COLD_S=S` and
//!   `KVROUTE_BENCH_PHASES_JSON=PATH` in the environment, the requests scheduled in the first
//!   S seconds (the first fill of the caches) and the rest are also reported separately, as
//!   two more rows and as `{"cold_s": S, "runs": [cold, steady]}` at PATH (the runs are named
//!   `<label>/cold` and `<label>/steady`, in wall time whatever `--time-scale` says;
//!   `kvroute-sim compare` reads the file). These are environment variables because the
//!   command line belongs to `main.rs`.
//!
//! With request classes (`bench --tenants/--priorities/--objectives`, as the replay draws
//! them) each request carries kvroute's headers: `x-kvroute-priority`, `x-kvroute-tenant`
//! and, where its band has one, `x-kvroute-ttft-objective-ms`; an answer 429 from the
//! gateway is then a refusal of that class (`RunReport::rejections`), not a failure.
//!
//! `Api::Messages` sends each prompt as Anthropic's `/v1/messages` does as Claude Code
//! sends it: the prompt as the user message, and a `system` block of Claude Code's
//! attribution (`x-anthropic-billing-header: …; cch=…;`) whose hash differs on every
//! request. vLLM leaves that block out of the prompt (vllm-project/vllm#36829), so the
//! servers cache such prompts as they cache chat's; a gateway that hashed it would see no
//! two requests share a prefix.

#![allow(clippy::disallowed_methods)] // the wall-time driver: reading the clock is its job

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context;
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;

use crate::report::{Record, Rejection, RunReport};
use crate::workload::SimRequest;

struct Outcome {
    /// The request's place in the workload (its scheduled arrival decides its phase).
    index: usize,
    server: String,
    start_ms: f64,
    first_ms: f64,
    last_ms: f64,
    end_ms: f64,
    tokens: u64,
    prompt_tokens: u64,
    cached_tokens: u64,
}

/// What a request says of itself in kvroute's headers.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct RequestClass {
    pub priority: i64,
    pub tenant: u32,
    pub ttft_objective_ms: Option<f64>,
}

impl RequestClass {
    fn headers(&self) -> Vec<(&'static str, String)> {
        let mut h = vec![
            ("x-kvroute-priority", self.priority.to_string()),
            ("x-kvroute-tenant", format!("tenant-{}", self.tenant)),
        ];
        if let Some(o) = self.ttft_objective_ms {
            h.push(("x-kvroute-ttft-objective-ms", format!("{o}")));
        }
        h
    }
}

/// What became of one request sent.
enum Sent {
    Done(Outcome),
    /// Answered 429 (by the gateway), after `waited_ms`.
    Refused {
        index: usize,
        start_ms: f64,
        waited_ms: f64,
    },
}

/// How long one request may take, first byte to last, before it counts as failed.
const REQUEST_TIMEOUT_S: u64 = 600;

/// The seed of the spread across several `--url`s (any constant: it only has to be fixed).
const SPREAD_SEED: u64 = 0x6b76_726f_7574_6531;

/// The API the prompts are sent through.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum Api {
    /// OpenAI's chat completions (`/v1/chat/completions`).
    #[default]
    Chat,
    /// Anthropic's Messages (`/v1/messages`), as Claude Code sends them (see the module note).
    Messages,
}

impl Api {
    fn path(self) -> &'static str {
        match self {
            Api::Chat => "/v1/chat/completions",
            Api::Messages => "/v1/messages",
        }
    }

    /// Request `index`'s body.
    fn body(self, model: &str, r: &SimRequest, index: usize) -> String {
        match self {
            Api::Chat => serde_json::json!({
                "model": model,
                "messages": [{"role": "user", "content": r.prompt_text()}],
                "max_tokens": r.output_tokens,
                "stream": true,
                "stream_options": {"include_usage": true},
            }),
            Api::Messages => {
                let cch = kvroute_core::policy::mix(SPREAD_SEED ^ !(index as u64)) & 0xf_ffff;
                let attribution =
                    format!("x-anthropic-billing-header: cc_version=2.1.100; cc_entrypoint=cli; cch={cch:05x};");
                serde_json::json!({
                    "model": model,
                    "system": [{"type": "text", "text": attribution}],
                    "messages": [{"role": "user", "content": r.prompt_text()}],
                    "max_tokens": r.output_tokens,
                    "stream": true,
                })
            }
        }
        .to_string()
    }
}

/// Where `api`'s requests go: `url` is one gateway's `http://host:port` or a
/// comma-separated list of them.
pub fn targets(url: &str, api: Api) -> anyhow::Result<Vec<hyper::Uri>> {
    let targets = url
        .split(',')
        .map(str::trim)
        .filter(|u| !u.is_empty())
        .map(|u| {
            let base: hyper::Uri = u.parse().with_context(|| format!("--url {u:?} is not a URL"))?;
            anyhow::ensure!(
                base.scheme_str() == Some("http"),
                "--url {u:?} must be http://host:port (a comma-separated list for several gateways)"
            );
            Ok(format!("{}{}", u.trim_end_matches('/'), api.path()).parse()?)
        })
        .collect::<anyhow::Result<Vec<hyper::Uri>>>()?;
    anyhow::ensure!(!targets.is_empty(), "--url is empty: give http://host:port");
    Ok(targets)
}

/// Which of `n` gateways request `index` goes to: uniform at random, reproducible.
pub fn spread(index: usize, n: usize) -> usize {
    debug_assert!(n > 0, "spread over no gateway");
    (kvroute_core::policy::mix(SPREAD_SEED ^ index as u64) % n.max(1) as u64) as usize
}

/// Sends `requests` (arrival times in ms from now) to `url` (one gateway or a comma-separated
/// list, see `targets`) through `api` and reports. Requests arriving after `duration_s` are
/// not sent. `classes` (one per request, or empty for none) adds kvroute's headers and
/// counts 429s as refusals.
#[allow(clippy::too_many_arguments)]
pub async fn bench(
    url: &str,
    api: Api,
    model: &str,
    requests: &[SimRequest],
    classes: &[RequestClass],
    duration_s: f64,
    label: &str,
    progress: impl Fn(u64) + Send + Sync + 'static,
) -> anyhow::Result<(RunReport, Vec<String>)> {
    let targets = targets(url, api)?;
    let phases = PhaseRequest::from_env()?;
    let client: Client<_, Full<Bytes>> = Client::builder(TokioExecutor::new())
        .pool_idle_timeout(Duration::from_secs(30))
        .build_http();
    let start = Instant::now();
    let outcomes: Arc<Mutex<Vec<Result<Sent, String>>>> = Arc::new(Mutex::new(Vec::new()));
    let progress = Arc::new(progress);
    let mut tasks = tokio::task::JoinSet::new();
    let chosen: Vec<&SimRequest> = requests
        .iter()
        .filter(|r| r.arrival_ms <= duration_s * 1000.0)
        .collect();
    for (index, r) in chosen.iter().enumerate() {
        let body = api.body(model, r, index);
        let (client, target, outcomes, progress) = (
            client.clone(),
            targets[spread(index, targets.len())].clone(),
            Arc::clone(&outcomes),
            Arc::clone(&progress),
        );
        let at = Duration::from_secs_f64(r.arrival_ms / 1000.0);
        let headers = classes.get(index).map(RequestClass::headers).unwrap_or_default();
        let classed = !classes.is_empty();
        tasks.spawn(async move {
            tokio::time::sleep_until(tokio::time::Instant::from_std(start + at)).await;
            let sent = one(&client, target, body, headers, classed, start, index, api);
            let res = tokio::time::timeout(Duration::from_secs(REQUEST_TIMEOUT_S), sent)
                .await
                .unwrap_or_else(|_| Err(format!("no end within {REQUEST_TIMEOUT_S} s")));
            if let Ok(mut all) = outcomes.lock() {
                all.push(res);
                progress(all.len() as u64);
            }
        });
    }
    while tasks.join_next().await.is_some() {}
    let sent = outcomes.lock().map(|mut o| std::mem::take(&mut *o)).unwrap_or_default();
    let mut outcomes = Vec::new();
    let mut rejections = Vec::new();
    let mut failures = BTreeMap::new();
    for s in sent {
        match s {
            Err(why) => *failures.entry(why).or_insert(0) += 1,
            Ok(Sent::Done(o)) => outcomes.push(o),
            Ok(Sent::Refused {
                index,
                start_ms,
                waited_ms,
            }) => {
                let c = classes.get(index).copied().unwrap_or_default();
                rejections.push(Rejection {
                    arrival_ms: start_ms,
                    waited_ms,
                    priority: c.priority,
                    tenant: c.tenant,
                });
            }
        }
    }
    let servers: Vec<String> = outcomes
        .iter()
        .map(|o| o.server.clone())
        .collect::<std::collections::BTreeSet<_>>()
        .into_iter()
        .collect();
    let index: BTreeMap<&str, usize> = servers.iter().enumerate().map(|(i, s)| (s.as_str(), i)).collect();
    let records: Vec<(usize, Record)> = outcomes
        .iter()
        .map(|o| {
            let c = classes.get(o.index).copied().unwrap_or_default();
            let r = Record {
                priority: c.priority,
                tenant: c.tenant,
                ttft_objective_ms: c.ttft_objective_ms,
                ..record(o, index.get(o.server.as_str()).copied().unwrap_or(0))
            };
            (o.index, r)
        })
        .collect();
    let arrivals: Vec<f64> = chosen.iter().map(|r| r.arrival_ms).collect();
    if let Some(p) = phases {
        let [cold, steady] = split_phases(label, &arrivals, &records, p.cold_s, servers.len());
        print!("{}", crate::report::table(&[cold.clone(), steady.clone()]));
        let doc = serde_json::json!({ "cold_s": p.cold_s, "url": url, "servers": servers, "runs": [cold, steady] });
        std::fs::write(&p.path, serde_json::to_string_pretty(&doc)? + "\n")
            .with_context(|| format!("cannot write {} (KVROUTE_BENCH_PHASES_JSON)", p.path))?;
    }
    let all: Vec<Record> = records.into_iter().map(|(_, r)| r).collect();
    let mut run = RunReport::from_records(label, chosen.len(), &all, &[], servers.len());
    // A refusal is an answer: not a failure.
    run.failed = run.failed.saturating_sub(rejections.len());
    run.rejections = rejections;
    run.failures = failures;
    Ok((run, servers))
}

/// `bench` as the tests and the soak drive it: to servers that answer to the short model
/// name `m`, showing no progress.
pub async fn quiet(
    url: &str,
    api: Api,
    requests: &[SimRequest],
    duration_s: f64,
    label: &str,
) -> anyhow::Result<(RunReport, Vec<String>)> {
    bench(url, api, "m", requests, &[], duration_s, label, |_| {}).await
}

fn record(o: &Outcome, server: usize) -> Record {
    Record {
        server,
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
        ..Record::default()
    }
}

/// The cold/steady split asked for in the environment (see the module note).
struct PhaseRequest {
    cold_s: f64,
    path: String,
}

impl PhaseRequest {
    fn from_env() -> anyhow::Result<Option<PhaseRequest>> {
        let cold = std::env::var("KVROUTE_BENCH_COLD_S").ok();
        let path = std::env::var("KVROUTE_BENCH_PHASES_JSON").ok();
        match (cold, path) {
            (None, None) => Ok(None),
            (Some(c), Some(path)) => {
                let cold_s: f64 = c
                    .trim()
                    .parse()
                    .ok()
                    .filter(|s: &f64| s.is_finite() && *s > 0.0)
                    .with_context(|| format!("KVROUTE_BENCH_COLD_S={c:?} must be a positive number of seconds"))?;
                Ok(Some(PhaseRequest { cold_s, path }))
            }
            _ => anyhow::bail!(
                "set both KVROUTE_BENCH_COLD_S (seconds of cold start) and KVROUTE_BENCH_PHASES_JSON (output file), or neither"
            ),
        }
    }
}

/// Reports the cold start (requests scheduled in the first `cold_s` seconds) and the steady
/// state (the rest) apart. `arrivals[i]` is request i's scheduled arrival (ms); `records` are
/// the completed ones with their index. A request counts as sent (and failed if it has no
/// record) in the phase its scheduled arrival falls in.
pub fn split_phases(
    label: &str,
    arrivals: &[f64],
    records: &[(usize, Record)],
    cold_s: f64,
    servers: usize,
) -> [RunReport; 2] {
    let cold = |i: usize| arrivals.get(i).is_some_and(|&a| a < cold_s * 1000.0);
    let sent_cold = (0..arrivals.len()).filter(|&i| cold(i)).count();
    let phase = |want_cold: bool| -> Vec<Record> {
        records
            .iter()
            .filter(|(i, _)| cold(*i) == want_cold)
            .map(|(_, r)| r.clone())
            .collect()
    };
    [
        RunReport::from_records(&format!("{label}/cold"), sent_cold, &phase(true), &[], servers),
        RunReport::from_records(
            &format!("{label}/steady"),
            arrivals.len() - sent_cold,
            &phase(false),
            &[],
            servers,
        ),
    ]
}

/// Why a request failed, in a few words an operator can count: the HTTP status, or what
/// broke and where (the innermost error of the chain, which names the cause).
fn cause(what: &str, e: &(dyn std::error::Error + 'static)) -> String {
    let mut inner = e;
    while let Some(next) = inner.source() {
        inner = next;
    }
    format!("{what}: {inner}")
}

/// Sends one request; `Err` says why it failed. With `classed`, a 429 is a refusal.
#[allow(clippy::too_many_arguments)]
async fn one(
    client: &Client<hyper_util::client::legacy::connect::HttpConnector, Full<Bytes>>,
    target: hyper::Uri,
    body: String,
    headers: Vec<(&'static str, String)>,
    classed: bool,
    start: Instant,
    index: usize,
    api: Api,
) -> Result<Sent, String> {
    let ms = || start.elapsed().as_secs_f64() * 1000.0;
    let start_ms = ms();
    let mut req = hyper::Request::post(target).header("content-type", "application/json");
    for (name, value) in headers {
        req = req.header(name, value);
    }
    let req = req
        .body(Full::new(Bytes::from(body)))
        .map_err(|e| cause("request not built", &e))?;
    let resp = client.request(req).await.map_err(|e| cause("no answer", &e))?;
    if classed && resp.status() == hyper::StatusCode::TOO_MANY_REQUESTS {
        return Ok(Sent::Refused {
            index,
            start_ms,
            waited_ms: ms() - start_ms,
        });
    }
    if !resp.status().is_success() {
        return Err(format!("HTTP {}", resp.status().as_u16()));
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
        let frame = frame.map_err(|e| cause("stream broken", &e))?;
        let Ok(data) = frame.into_data() else { continue };
        buf.extend_from_slice(&data);
        while let Some(end) = buf.windows(2).position(|w| w == b"\n\n") {
            let event: Vec<u8> = buf.drain(..end + 2).collect();
            let line = String::from_utf8_lossy(&event);
            // An Anthropic event has an `event:` line before its data.
            let Some(payload) = line.lines().find_map(|l| l.strip_prefix("data: ")) else {
                continue;
            };
            if payload == "[DONE]" {
                done = true;
                continue;
            }
            let v: serde_json::Value =
                serde_json::from_str(payload).map_err(|_| "stream: an event that is not JSON".to_string())?;
            let non_empty = |t: &serde_json::Value| t.as_str().is_some_and(|t| !t.is_empty());
            // A token is an event with text (vLLM opens a chat stream with a role-only delta);
            // the usage read is the last one.
            let (token, usage) = match api {
                Api::Chat => {
                    let text = |c: &serde_json::Value| non_empty(&c["delta"]["content"]) || non_empty(&c["text"]);
                    let usage = v.get("usage").filter(|u| !u.is_null()).map(|u| {
                        let cached = u["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap_or(0);
                        (u["prompt_tokens"].as_u64().unwrap_or(0), cached)
                    });
                    (v["choices"].as_array().is_some_and(|c| c.iter().any(text)), usage)
                }
                Api::Messages => {
                    done |= v["type"] == "message_stop";
                    // The final usage: the prompt is what was computed plus what was read
                    // from the cache (and written to it).
                    let usage = (v["type"] == "message_delta").then(|| {
                        let field = |name: &str| v["usage"][name].as_u64().unwrap_or(0);
                        let cached = field("cache_read_input_tokens");
                        (
                            field("input_tokens") + cached + field("cache_creation_input_tokens"),
                            cached,
                        )
                    });
                    (
                        v["type"] == "content_block_delta" && non_empty(&v["delta"]["text"]),
                        usage,
                    )
                }
            };
            if token {
                let now = ms();
                if tokens == 0 {
                    first = now;
                }
                last = now;
                tokens += 1;
            }
            if let Some(u) = usage {
                (prompt, cached) = u;
            }
        }
    }
    match (done, tokens) {
        (false, _) => return Err("stream ended before its last event".into()),
        (true, 0) => return Err("stream without a token".into()),
        _ => {}
    }
    Ok(Sent::Done(Outcome {
        index,
        server,
        start_ms,
        first_ms: first,
        last_ms: last,
        end_ms: ms(),
        tokens,
        prompt_tokens: prompt,
        cached_tokens: cached,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(arrival_ms: f64, ttft_ms: f64, prompt: u64, cached: u64) -> Record {
        Record {
            server: 0,
            arrival_ms,
            finish_ms: arrival_ms + ttft_ms + 10.0,
            ttft_ms,
            itl_ms: 1.0,
            e2e_ms: ttft_ms + 10.0,
            prompt_tokens: prompt,
            cached_tokens: cached,
            output_tokens: 4,
            ..Record::default()
        }
    }

    #[test]
    fn phases_split_by_scheduled_arrival_and_count_failures_where_they_were_sent() {
        // Four requests scheduled at 0, 1, 2 and 3 s; the cold start is the first 2 s.
        // Request 1 failed (no record); request 2 was sent late (its measured start is
        // before 2 s) but belongs to the steady state by its schedule.
        let arrivals = [0.0, 1000.0, 2000.0, 3000.0];
        let records = [
            (0, rec(0.0, 500.0, 100, 0)),
            (2, rec(1999.0, 20.0, 100, 90)),
            (3, rec(3000.0, 40.0, 100, 80)),
        ];
        let [cold, steady] = split_phases("kvroute", &arrivals, &records, 2.0, 1);
        assert_eq!(
            (cold.policy.as_str(), steady.policy.as_str()),
            ("kvroute/cold", "kvroute/steady")
        );
        assert_eq!((cold.requests, cold.completed, cold.failed), (2, 1, 1));
        assert_eq!((steady.requests, steady.completed, steady.failed), (2, 2, 0));
        assert!(cold.prefix_hit_rate < steady.prefix_hit_rate);
        assert_eq!(steady.prefix_hit_rate, 0.85);
        assert!(cold.ttft_ms.p95 > steady.ttft_ms.p95);
    }

    #[test]
    fn a_cold_start_longer_than_the_run_leaves_the_steady_state_empty() {
        let [cold, steady] = split_phases("rr", &[0.0, 10.0], &[(0, rec(0.0, 5.0, 10, 0))], 60.0, 1);
        assert_eq!((cold.requests, cold.completed), (2, 1));
        assert_eq!((steady.requests, steady.completed, steady.failed), (0, 0, 0));
    }

    #[test]
    fn a_url_list_names_every_gateway_and_rejects_what_is_not_http() {
        let t = targets("http://127.0.0.1:10000, http://127.0.0.1:10001/", Api::Chat).unwrap();
        let t: Vec<String> = t.iter().map(ToString::to_string).collect();
        assert_eq!(
            t,
            [
                "http://127.0.0.1:10000/v1/chat/completions",
                "http://127.0.0.1:10001/v1/chat/completions"
            ]
        );
        assert!(targets("https://127.0.0.1:10000", Api::Chat).is_err());
        assert!(targets(" , ", Api::Chat).is_err());
        assert!(targets("http://a:1,not a url", Api::Chat).is_err());
    }

    #[test]
    fn messages_carry_the_prompt_and_an_attribution_hash_of_their_own() {
        let p = crate::workload::GenParams {
            groups: 1,
            prompts_per_group: 2,
            ..crate::workload::GenParams::defaults(crate::workload::Generator::SharedPrefix)
        };
        let reqs = crate::workload::generate(crate::workload::Generator::SharedPrefix, &p);
        let body =
            |i: usize| -> serde_json::Value { serde_json::from_str(&Api::Messages.body("m", &reqs[0], i)).unwrap() };
        let (a, b) = (body(0), body(1));
        assert_eq!(a["messages"][0]["content"], reqs[0].prompt_text().as_str());
        assert_eq!(a["max_tokens"], reqs[0].output_tokens);
        let attribution = |v: &serde_json::Value| v["system"][0]["text"].as_str().unwrap().to_string();
        assert!(attribution(&a).starts_with("x-anthropic-billing-header: "));
        assert_ne!(attribution(&a), attribution(&b), "a hash per request");
        assert_eq!(a["messages"], b["messages"]);
        let t = targets("http://127.0.0.1:10000", Api::Messages).unwrap();
        assert_eq!(t[0].to_string(), "http://127.0.0.1:10000/v1/messages");
    }

    #[test]
    fn the_spread_is_reproducible_and_close_to_even() {
        let n = 10_000;
        let mut counts = [0usize; 2];
        for i in 0..n {
            assert_eq!(spread(i, 2), spread(i, 2));
            counts[spread(i, 2)] += 1;
        }
        // Binomial(10 000, 1/2): 4 800..5 200 is ± 4 standard deviations.
        assert!((4_800..=5_200).contains(&counts[0]), "{counts:?}");
        assert!((0..n).all(|i| spread(i, 1) == 0));
        assert!(
            (0..n)
                .map(|i| spread(i, 3))
                .collect::<std::collections::BTreeSet<_>>()
                .len()
                == 3
        );
    }
}

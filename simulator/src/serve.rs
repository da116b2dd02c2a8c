//! Live mode: each simulated server is a real HTTP server that answers like vLLM 0.33.
//!
//! `/v1/chat/completions` and `/v1/completions` (validation in `request`, bodies and streams
//! in `respond`, errors in `errors`), Anthropic's Messages API (`POST /v1/messages`, served as
//! the chat request vLLM translates it to, in `messages`), OpenAI's Responses API
//! (`POST /v1/responses`, `GET /v1/responses/{id}`, `POST /v1/responses/{id}/cancel`, in
//! `responses`; responses are
//! stored only with `--responses-store`, as vLLM stores them only with
//! `VLLM_ENABLE_RESPONSES_API_STORE=1`), `/tokenize` and `/detokenize` (`tokenize`),
//! `/v1/models`, `/health`, `/metrics` (vLLM 0.33's format, or the legacy names). What the
//! APIs share (engine submission, streaming, aborts) is in `answer`. Tokens come
//! from the engine model in wall time: a driver task per server runs the engine's steps and
//! sleeps each step's duration divided by `--time-scale`. Every response names its server in
//! `x-served-by`. HTTP/1.1 only, as uvicorn serves vLLM, and a connection idle for
//! `VLLM_HTTP_TIMEOUT_KEEP_ALIVE` seconds (5) after its last answer is closed, as uvicorn does.
//!
//! Faults are set at run time on the admin listener (`--admin-port`, default base − 1):
//! `POST /servers/{i}/fault` with any of `{"down": bool, "hang": bool, "slow": k,
//! "error_rate": 0..1, "metrics": "ok" | "garbage" | "404" | "huge", "legacy": bool}`;
//! `GET /servers/{i}/fault` shows them. `down` closes the listener and every open
//! connection (a crashed server); `hang` accepts and never answers; `slow` stretches steps.
//!
//! Admission control as vLLM's `--max-num-queued-reqs` / `--max-num-queued-tokens` (serve's
//! flags of the same names, or `POST /servers/{i}/admission` with `{"max_num_queued_reqs": n,
//! "max_num_queued_tokens": n}`): a request that would take the server's unfinished sequences
//! (waiting + running) or the prompt tokens of those still in prefill past a limit is refused
//! with a 503 before it reaches the engine.

#![allow(clippy::disallowed_methods)] // the wall-time driver: reading the clock is its job

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::extract::State;
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use bytes::Bytes;
use kvroute_core::request::ApiKind;
use serde::{Deserialize, Serialize};
use tokio::sync::{mpsc, Notify};
use tokio::task::JoinSet;

use crate::engine::{Engine, Event};
use respond::Reply;

mod admin;
mod answer;
mod errors;
mod info;
mod messages;
mod request;
mod respond;
mod responses;
mod start;
mod testing;
mod tokenize;
pub use errors::ApiError;
use responses::ResponseStore;
use start::listen;
pub use start::{responses_store_from_env, serve, serve_names};
pub use testing::{
    free_base_port, start_in_background, start_in_background_with, start_storing_in_background, wait_listening,
};

/// How every server of a fleet runs, besides its profile: `serve`'s flags.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Options {
    /// Export the pre-0.12 metric names (`--legacy-metrics`).
    pub legacy: bool,
    /// vLLM's admission limits (`--max-num-queued-reqs`, `--max-num-queued-tokens`).
    pub admission: Admission,
    /// Keep responses of the Responses API for `previous_response_id` and
    /// `GET /v1/responses/{id}` (`--responses-store`; vLLM's
    /// `VLLM_ENABLE_RESPONSES_API_STORE=1`). Off, as on vLLM by default.
    pub responses_store: bool,
    /// Report usage in every chat and completions stream, at its end and on each chunk,
    /// whatever `stream_options` asks (`--enable-force-include-usage`, as vLLM's). Off, as on
    /// vLLM by default. Responses API streams always end with their usage.
    pub force_include_usage: bool,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct Fault {
    pub down: bool,
    pub hang: bool,
    pub slow: f64,
    pub error_rate: f64,
    pub metrics: MetricsFault,
    pub legacy: bool,
}

#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum MetricsFault {
    #[default]
    Ok,
    Garbage,
    #[serde(rename = "404")]
    NotFound,
    Huge,
    /// A wanted family with more labels than any parser should accept.
    LabelBomb,
    /// The headers and half the body, then the connection drops (a server killed in the
    /// middle of its answer).
    Cut,
}

/// vLLM's admission limits (`None`: unbounded, vLLM's default).
#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields, default)]
pub struct Admission {
    pub max_num_queued_reqs: Option<u64>,
    pub max_num_queued_tokens: Option<u64>,
}

impl Admission {
    /// Why a request is refused, and the limit that refused it (0: requests, 1: tokens).
    /// vLLM 0.33's rules (`AsyncLLM.check_admission`) and messages: the unfinished
    /// sequences with this request's `n` past the request limit, or the prompt tokens of the
    /// sequences still in prefill already at the token limit (the new prompt does not count:
    /// an idle server admits a prompt longer than the limit).
    fn refuses(&self, engine: &Engine, seqs: u64) -> Option<(String, usize)> {
        if let Some(max) = self.max_num_queued_reqs {
            if engine.unfinished() as u64 + seqs > max {
                return Some((
                    "The engine is currently busy and cannot accept new requests. Please try again later \
                     or on a different instance."
                        .to_string(),
                    0,
                ));
            }
        }
        if let Some(max) = self.max_num_queued_tokens {
            if engine.prefill_phase_prompt_tokens() >= max {
                return Some((
                    "The engine has reached its prefill token backlog limit. Please try again later or \
                     on a different instance."
                        .to_string(),
                    1,
                ));
            }
        }
        None
    }
}

pub struct SimServer {
    pub index: usize,
    pub addr: SocketAddr,
    engine: Mutex<Engine>,
    streams: Mutex<HashMap<u64, mpsc::UnboundedSender<Event>>>,
    wake: Notify,
    next_id: AtomicU64,
    fault: Mutex<Fault>,
    admission: Mutex<Admission>,
    start: Instant,
    time_scale: f64,
    created: f64,
    connections: Mutex<Option<JoinSet<()>>>,
    /// A connection idle this long after its last answer is closed (vLLM's keep-alive).
    keep_alive: std::time::Duration,
    /// Model names served (vLLM's `--served-model-name`); the first is the default.
    served: Vec<String>,
    max_model_len: u64,
    /// Responses kept for the Responses API (empty unless `Options::responses_store`).
    responses: ResponseStore,
    /// `Options::force_include_usage`.
    force_include_usage: bool,
}

impl SimServer {
    fn now_ms(&self) -> f64 {
        self.start.elapsed().as_secs_f64() * 1000.0 * self.time_scale
    }
    fn fault(&self) -> Fault {
        self.fault.lock().map(|f| f.clone()).unwrap_or_default()
    }
    fn name(&self) -> String {
        self.addr.to_string()
    }
    /// A request id unique across servers and requests: `prefix-` and [`Self::hex_id`].
    fn request_id(&self, prefix: &str, n: u64) -> String {
        format!("{prefix}-{}", self.hex_id(n))
    }
    /// The id of request `n`'s answer: `prefix-` and the client's `X-Request-Id` when it sent
    /// one, as vLLM builds its request id (behind Envoy, which sets one on every request, the
    /// ids are Envoy's), else the body's `request_id` when given, else [`Self::request_id`].
    fn answer_id(&self, prefix: &str, headers: &HeaderMap, body_id: Option<&str>, n: u64) -> String {
        match headers.get("x-request-id").and_then(|v| v.to_str().ok()).or(body_id) {
            Some(given) => format!("{prefix}-{given}"),
            None => self.request_id(prefix, n),
        }
    }
    /// 32 hex digits from this server's address, its start time and `n` (a per-server
    /// counter): unique across servers, requests and restarts (vLLM uses a random UUID's hex).
    fn hex_id(&self, n: u64) -> String {
        use kvroute_core::policy::mix;
        let seed = (u64::from(self.addr.port()) << 40) ^ (self.index as u64) << 32 ^ mix(self.created.to_bits());
        let a = mix(seed ^ n);
        let b = mix(a ^ 0x9e37_79b9_7f4a_7c15);
        format!("{a:016x}{b:016x}")
    }
}

/// The vLLM release these servers answer like (`/version`).
pub const VLLM_VERSION: &str = "0.33.0";

/// Request bodies accepted (vLLM sets no limit; a 2 MB prompt must reach the context check).
pub const MAX_BODY_BYTES: usize = 64 << 20;

/// Llama 3.1's context (`max_position_embeddings`), capped by the KV cache as vLLM requires.
pub fn max_model_len(num_gpu_blocks: u64) -> u64 {
    (131_072u64).min(num_gpu_blocks * crate::profile::BLOCK_TOKENS)
}

fn app(srv: Arc<SimServer>) -> Router {
    Router::new()
        .route("/v1/chat/completions", post(|s, h, b| complete(s, h, b, ApiKind::Chat)))
        .route(
            "/v1/completions",
            post(|s, h, b| complete(s, h, b, ApiKind::Completions)),
        )
        .route("/v1/messages", post(messages::create))
        .route("/v1/messages/count_tokens", post(messages::count_tokens))
        .route("/v1/responses", post(responses::create))
        .route("/v1/responses/{id}", get(responses::retrieve))
        .route("/v1/responses/{id}/cancel", post(responses::cancel))
        .route("/v1/models", get(info::models))
        .route("/tokenize", post(info::tokenize))
        .route("/detokenize", post(info::detokenize))
        .route("/health", get(health))
        .route("/ping", get(health).post(health))
        .route(
            "/version",
            get(|| async { Json(serde_json::json!({"version": VLLM_VERSION})) }),
        )
        .route("/metrics", get(metrics))
        // FastAPI's answers to an unknown path and to a wrong method, as vLLM gives them.
        .fallback(|| async { (StatusCode::NOT_FOUND, Json(serde_json::json!({"detail": "Not Found"}))) })
        .method_not_allowed_fallback(|| async {
            (
                StatusCode::METHOD_NOT_ALLOWED,
                Json(serde_json::json!({"detail": "Method Not Allowed"})),
            )
        })
        .layer(axum::extract::DefaultBodyLimit::max(MAX_BODY_BYTES))
        .with_state(srv)
}

/// How far behind its schedule a busy engine may run before the schedule restarts from now
/// (a stalled machine must not be followed by a burst of zero-length steps).
const MAX_LATE: Duration = Duration::from_millis(2);

/// Runs the engine: one step at a time, sleeping each step's duration (scaled).
///
/// Back-to-back steps are scheduled from the previous step's ideal end, not from when the
/// timer woke: tokio's timer rounds every sleep up to the next millisecond, and relative
/// sleeps added that to every step (4–5 ms to a cached request's TTFT, 15% to ITL, against
/// the same workload replayed in virtual time).
async fn drive(srv: Arc<SimServer>) {
    let mut ideal_end: Option<Instant> = None;
    loop {
        // The engine itself runs slower (its step times, hence the prefill and decode times
        // it reports in /metrics, stretch as the wall-clock steps do).
        let slow = srv.fault().slow.max(1.0);
        let step = srv.engine.lock().ok().and_then(|mut e| {
            e.set_slow(slow);
            e.start_step()
        });
        let Some(ms) = step else {
            ideal_end = None;
            srv.wake.notified().await;
            continue;
        };
        let now = Instant::now();
        let start = ideal_end
            .filter(|end| now.duration_since(*end) <= MAX_LATE)
            .unwrap_or(now);
        let end = start + Duration::from_secs_f64(ms / 1000.0 / srv.time_scale);
        tokio::time::sleep_until(end.into()).await;
        ideal_end = Some(end);
        let now = srv.now_ms();
        let events = srv.engine.lock().map(|mut e| e.finish_step(now)).unwrap_or_default();
        if let Ok(mut streams) = srv.streams.lock() {
            for ev in events {
                let id = match &ev {
                    Event::FirstToken { id, .. } | Event::Token { id, .. } => *id,
                    Event::Finished(f) => f.id,
                };
                let finished = matches!(ev, Event::Finished(_));
                if let Some(tx) = streams.get(&id) {
                    let _ = tx.send(ev);
                }
                if finished {
                    streams.remove(&id);
                }
            }
        }
    }
}

fn with_server(mut r: Response, srv: &SimServer) -> Response {
    if let Ok(v) = HeaderValue::from_str(&srv.name()) {
        r.headers_mut().insert("x-served-by", v);
    }
    r
}

fn error(status: StatusCode, message: &str) -> Response {
    let mut e = ApiError::bad_request(message);
    e.status = status;
    e.into_response()
}

async fn health(State(srv): State<Arc<SimServer>>) -> Response {
    with_server(StatusCode::OK.into_response(), &srv)
}

/// A hung server never answers, on new and on kept-alive connections alike.
async fn hang_if_faulted(srv: &SimServer) {
    if srv.fault().hang {
        std::future::pending::<()>().await;
    }
}

async fn metrics(State(srv): State<Arc<SimServer>>) -> Response {
    hang_if_faulted(&srv).await;
    let f = srv.fault();
    let text = match f.metrics {
        MetricsFault::NotFound => return with_server(StatusCode::NOT_FOUND.into_response(), &srv),
        MetricsFault::Garbage => "vllm:num_requests_running{engine=\"0 not prometheus {{{\n\u{0}\u{1}".to_string(),
        MetricsFault::Huge => format!("# {}\n", "x".repeat(4 << 20)),
        MetricsFault::LabelBomb => {
            let labels: Vec<String> = (0..10_000).map(|i| format!("l{i}=\"{i}\"")).collect();
            format!("vllm:num_requests_running{{{}}} 1.0\n", labels.join(","))
        }
        MetricsFault::Ok | MetricsFault::Cut => srv
            .engine
            .lock()
            .map(|e| e.metrics_text(f.legacy, srv.created))
            .unwrap_or_default(),
    };
    if f.metrics == MetricsFault::Cut {
        let mut half = Bytes::from(text);
        half.truncate(half.len() / 2);
        // The error waits for the first half to leave: sent together, the server would
        // close before its headers.
        let parts = futures_util::stream::unfold(Some(half), |left| async move {
            match left {
                Some(half) => Some((Ok(half), None)),
                None => {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    Some((Err(std::io::Error::other("cut")), None))
                }
            }
        });
        return with_server(axum::body::Body::from_stream(parts).into_response(), &srv);
    }
    let mut r = text.into_response();
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"),
    );
    with_server(r, &srv)
}

/// Hangs when the server is hung, numbers the request, and answers the injected 500 of
/// `error_rate` (every inference endpoint's faults).
async fn request_number(srv: &SimServer) -> Result<u64, Response> {
    hang_if_faulted(srv).await;
    let f = srv.fault();
    let n = srv.next_id.fetch_add(1, Ordering::Relaxed);
    if f.error_rate > 0.0 && (kvroute_core::policy::mix(n ^ srv.index as u64) % 10_000) as f64 / 10_000.0 < f.error_rate
    {
        return Err(with_server(ApiError::internal("injected fault").into_response(), srv));
    }
    Ok(n)
}

async fn complete(State(srv): State<Arc<SimServer>>, headers: HeaderMap, body: Bytes, kind: ApiKind) -> Response {
    let n = match request_number(&srv).await {
        Ok(n) => n,
        Err(r) => return r,
    };
    let content_type = headers.get(header::CONTENT_TYPE).and_then(|v| v.to_str().ok());
    let mut ask = match request::read(kind, content_type, &body, &srv.served, srv.max_model_len) {
        Ok(a) => a,
        Err(e) => return with_server(e.into_response(), &srv),
    };
    if srv.force_include_usage {
        ask.force_usage();
    }
    let sub = match answer::submit(&srv, &ask, n) {
        Ok(s) => s,
        Err(e) => return with_server(e.into_response(), &srv),
    };
    let prefix = if kind == ApiKind::Chat { "chatcmpl" } else { "cmpl" };
    let created = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
    let id = srv.answer_id(prefix, &headers, ask.request_id.as_deref(), n);
    let stream = ask.stream;
    let reply = Reply::new(ask, id, created, sub.choices.clone());
    let r = if stream {
        answer::stream(sub, reply)
    } else {
        answer::whole(sub, reply).await
    };
    with_server(r, &srv)
}

#[cfg(test)]
mod tests;

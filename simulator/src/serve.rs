//! Live mode: each simulated server is a real HTTP server that answers like vLLM.
//!
//! `/v1/chat/completions` and `/v1/completions` (JSON, or SSE with `data: [DONE]`, `usage`
//! with `prompt_tokens_details.cached_tokens` when `stream_options.include_usage`),
//! `/v1/models`, `/health`, `/metrics` (vLLM 0.33's format, or the legacy names). Tokens come
//! from the engine model in wall time: a driver task per server runs the engine's steps and
//! sleeps each step's duration divided by `--time-scale`. Every response names its server in
//! `x-served-by`.
//!
//! Faults are set at run time on the admin listener (`--admin-port`, default base − 1):
//! `POST /servers/{i}/fault` with any of `{"down": bool, "hang": bool, "slow": k,
//! "error_rate": 0..1, "metrics": "ok" | "garbage" | "404" | "huge", "legacy": bool}`;
//! `GET /servers/{i}/fault` shows them. `down` closes the listener and every open
//! connection (a crashed server); `hang` accepts and never answers; `slow` stretches steps.

#![allow(clippy::disallowed_methods)] // the wall-time driver: reading the clock is its job

use std::collections::HashMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::body::Body;
use axum::extract::State;
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use bytes::Bytes;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::service::TowerToHyperService;
use kvroute_core::request::{parse, ApiKind};
use serde::{Deserialize, Serialize};
use tokio::net::TcpListener;
use tokio::sync::{mpsc, Notify};
use tokio::task::JoinSet;

use crate::engine::{Engine, Event, SeqSpec};
use crate::profile::Profile;
use crate::tokens::engine_blocks;

mod admin;
mod errors;
mod testing;
use admin::{get_fault, set_fault};
pub use errors::ApiError;
pub use testing::{free_base_port, start_in_background, wait_listening};

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
}

pub struct SimServer {
    pub index: usize,
    pub addr: SocketAddr,
    engine: Mutex<Engine>,
    streams: Mutex<HashMap<u64, mpsc::UnboundedSender<Event>>>,
    wake: Notify,
    next_id: AtomicU64,
    fault: Mutex<Fault>,
    start: Instant,
    time_scale: f64,
    created: f64,
    connections: Mutex<Option<JoinSet<()>>>,
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
}

/// Starts `n` servers on `base_port..` and the admin listener; runs until the process ends.
pub async fn serve(
    profile: Profile,
    n: usize,
    host: &str,
    base_port: u16,
    admin_port: u16,
    time_scale: f64,
    legacy: bool,
) -> anyhow::Result<()> {
    anyhow::ensure!(time_scale > 0.0, "--time-scale must be positive");
    let created = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64());
    let mut servers = Vec::new();
    for i in 0..n {
        let addr: SocketAddr = format!("{host}:{}", base_port as usize + i).parse()?;
        let srv = Arc::new(SimServer {
            index: i,
            addr,
            engine: Mutex::new(Engine::new(profile.clone())),
            streams: Mutex::new(HashMap::new()),
            wake: Notify::new(),
            next_id: AtomicU64::new(0),
            fault: Mutex::new(Fault {
                slow: 1.0,
                legacy,
                ..Fault::default()
            }),
            start: Instant::now(),
            time_scale,
            created,
            connections: Mutex::new(None),
        });
        listen(&srv).await?;
        tokio::spawn(drive(Arc::clone(&srv)));
        servers.push(srv);
    }
    let admin = Router::new()
        .route("/servers/{i}/fault", get(get_fault).post(set_fault))
        .with_state(Arc::new(servers.clone()));
    let admin_listener = TcpListener::bind((host, admin_port))
        .await
        .map_err(|e| anyhow::anyhow!("admin port {admin_port}: {e}"))?;
    eprintln!(
        "kvroute-sim: {n} × {} on {:?} at {host}:{base_port}..{}, admin {host}:{admin_port}, time scale {time_scale}",
        profile.model,
        profile.gpu,
        base_port as usize + n - 1
    );
    axum::serve(admin_listener, admin).await?;
    Ok(())
}

/// Binds the server's port and accepts connections into a fresh `JoinSet`.
async fn listen(srv: &Arc<SimServer>) -> anyhow::Result<()> {
    let listener = TcpListener::bind(srv.addr)
        .await
        .map_err(|e| anyhow::anyhow!("cannot listen on {}: {e}", srv.addr))?;
    let app = app(Arc::clone(srv));
    let mut set = JoinSet::new();
    let accept_srv = Arc::clone(srv);
    set.spawn(async move {
        let mut conns = JoinSet::new();
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                continue;
            };
            let _ = stream.set_nodelay(true);
            if accept_srv.fault().hang {
                conns.spawn(async move {
                    let _keep_open = stream;
                    tokio::time::sleep(Duration::from_secs(3600)).await;
                });
                continue;
            }
            let service = TowerToHyperService::new(app.clone());
            conns.spawn(async move {
                let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                    .serve_connection(TokioIo::new(stream), service)
                    .await;
            });
            while conns.try_join_next().is_some() {}
        }
        // Dropping `conns` (when this task is aborted) aborts every connection task.
    });
    if let Ok(mut c) = srv.connections.lock() {
        *c = Some(set);
    }
    Ok(())
}

/// Request bodies accepted (vLLM sets no limit; a 2 MB prompt must reach the context check).
pub const MAX_BODY_BYTES: usize = 64 << 20;

/// Llama 3.1's context (`max_position_embeddings`), capped by the KV cache as vLLM requires.
pub fn max_model_len(profile: &Profile) -> u64 {
    (131_072u64).min(profile.num_gpu_blocks * crate::profile::BLOCK_TOKENS)
}

fn app(srv: Arc<SimServer>) -> Router {
    Router::new()
        .route("/v1/chat/completions", post(|s, b| complete(s, b, ApiKind::Chat)))
        .route("/v1/completions", post(|s, b| complete(s, b, ApiKind::Completions)))
        .route("/v1/models", get(models))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .layer(axum::extract::DefaultBodyLimit::max(MAX_BODY_BYTES))
        .with_state(srv)
}

/// Runs the engine: one step at a time, sleeping each step's duration (scaled).
async fn drive(srv: Arc<SimServer>) {
    loop {
        let step = srv.engine.lock().ok().and_then(|mut e| e.start_step());
        let Some(ms) = step else {
            srv.wake.notified().await;
            continue;
        };
        let slow = srv.fault().slow.max(1.0);
        tokio::time::sleep(Duration::from_secs_f64(ms * slow / 1000.0 / srv.time_scale)).await;
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

async fn models(State(srv): State<Arc<SimServer>>) -> Response {
    let model = srv.engine.lock().map(|e| e.profile().model.served_name()).unwrap_or("");
    let body = serde_json::json!({"object": "list", "data": [{"id": model, "object": "model", "owned_by": "vllm"}]});
    with_server(Json(body).into_response(), &srv)
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
        MetricsFault::Ok => srv
            .engine
            .lock()
            .map(|e| e.metrics_text(f.legacy, srv.created))
            .unwrap_or_default(),
    };
    let mut r = text.into_response();
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"),
    );
    with_server(r, &srv)
}

#[derive(Deserialize, Default)]
struct StreamOptions {
    #[serde(default)]
    include_usage: bool,
}

#[derive(Deserialize, Default)]
struct Extra {
    #[serde(default)]
    stream_options: Option<StreamOptions>,
}

async fn complete(State(srv): State<Arc<SimServer>>, body: Bytes, kind: ApiKind) -> Response {
    hang_if_faulted(&srv).await;
    let f = srv.fault();
    let n = srv.next_id.fetch_add(1, Ordering::Relaxed);
    if f.error_rate > 0.0 && (kvroute_core::policy::mix(n ^ srv.index as u64) % 10_000) as f64 / 10_000.0 < f.error_rate
    {
        return with_server(error(StatusCode::INTERNAL_SERVER_ERROR, "injected fault"), &srv);
    }
    let parsed = match parse(kind, &body) {
        Ok(p) => p,
        Err(e) => return with_server(error(StatusCode::BAD_REQUEST, &e.to_string()), &srv),
    };
    let include_usage = serde_json::from_slice::<Extra>(&body)
        .ok()
        .and_then(|e| e.stream_options)
        .is_some_and(|o| o.include_usage);
    let limit = srv.engine.lock().map(|e| max_model_len(e.profile())).unwrap_or(0);
    let prompt = parsed.prompt_tokens.0;
    if prompt >= limit {
        return with_server(ApiError::prompt_too_long(limit, prompt).into_response(), &srv);
    }
    if let Some(m) = parsed.max_tokens.filter(|m| prompt + m > limit) {
        return with_server(ApiError::max_tokens_too_large(limit, prompt, m).into_response(), &srv);
    }
    let output = parsed.max_tokens.unwrap_or(256).clamp(1, limit - prompt);
    let spec = SeqSpec {
        id: n,
        prompt_tokens: parsed.prompt_tokens.0,
        output_tokens: output,
        block_hashes: engine_blocks(&parsed.canonical, parsed.prompt_tokens.0),
    };
    let (tx, rx) = mpsc::unbounded_channel();
    if let Ok(mut s) = srv.streams.lock() {
        s.insert(n, tx);
    }
    let now = srv.now_ms();
    if let Ok(mut e) = srv.engine.lock() {
        e.add(spec, now);
    }
    srv.wake.notify_one();
    let model = parsed.model.clone();
    let r = if parsed.stream {
        stream_response(rx, kind, model, n, include_usage)
    } else {
        json_response(rx, kind, model, n).await
    };
    with_server(r, &srv)
}

fn usage(f: &crate::engine::Finished) -> serde_json::Value {
    serde_json::json!({
        "prompt_tokens": f.prompt_tokens,
        "completion_tokens": f.output_tokens,
        "total_tokens": f.prompt_tokens + f.output_tokens,
        "prompt_tokens_details": {"cached_tokens": f.cached_tokens},
    })
}

async fn json_response(mut rx: mpsc::UnboundedReceiver<Event>, kind: ApiKind, model: String, id: u64) -> Response {
    while let Some(ev) = rx.recv().await {
        if let Event::Finished(f) = ev {
            let text = "tok ".repeat(f.output_tokens as usize);
            let choice = match kind {
                ApiKind::Chat => {
                    serde_json::json!({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "length"})
                }
                ApiKind::Completions => serde_json::json!({"index": 0, "text": text, "finish_reason": "length"}),
            };
            let object = if kind == ApiKind::Chat {
                "chat.completion"
            } else {
                "text_completion"
            };
            let body = serde_json::json!({"id": format!("cmpl-{id}"), "object": object, "model": model, "choices": [choice], "usage": usage(&f)});
            return Json(body).into_response();
        }
    }
    error(StatusCode::INTERNAL_SERVER_ERROR, "the engine dropped the request")
}

fn stream_response(
    rx: mpsc::UnboundedReceiver<Event>,
    kind: ApiKind,
    model: String,
    id: u64,
    include_usage: bool,
) -> Response {
    let object = if kind == ApiKind::Chat {
        "chat.completion.chunk"
    } else {
        "text_completion"
    };
    let chunk = move |choices: serde_json::Value, usage: Option<serde_json::Value>| {
        let mut v = serde_json::json!({"id": format!("cmpl-{id}"), "object": object, "model": model.clone(), "choices": choices});
        if let Some(u) = usage {
            v["usage"] = u;
        }
        Bytes::from(format!("data: {v}\n\n"))
    };
    let delta = move |finish: Option<&str>| match kind {
        ApiKind::Chat => serde_json::json!([{"index": 0, "delta": {"content": "tok "}, "finish_reason": finish}]),
        ApiKind::Completions => serde_json::json!([{"index": 0, "text": "tok ", "finish_reason": finish}]),
    };
    let events = futures_util::stream::unfold((rx, false), move |(mut rx, done)| {
        let chunk = chunk.clone();
        async move {
            if done {
                return None;
            }
            let ev = rx.recv().await?;
            let bytes = match ev {
                Event::FirstToken { .. } | Event::Token { .. } => chunk(delta(None), None),
                Event::Finished(f) => {
                    let mut out = Vec::new();
                    if include_usage {
                        out.extend_from_slice(&chunk(serde_json::json!([]), Some(usage(&f))));
                    }
                    out.extend_from_slice(b"data: [DONE]\n\n");
                    return Some((Ok::<Bytes, Infallible>(Bytes::from(out)), (rx, true)));
                }
            };
            Some((Ok(bytes), (rx, false)))
        }
    });
    let mut r = Response::new(Body::from_stream(events));
    r.headers_mut()
        .insert(header::CONTENT_TYPE, HeaderValue::from_static("text/event-stream"));
    r
}

#[cfg(test)]
mod tests;

//! Starting the simulated servers: one listener and one engine driver per server, and the
//! fault admin listener.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::routing::get;
use axum::Router;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tokio::sync::Notify;
use tokio::task::JoinSet;

use super::admin::{get_admission, get_fault, set_admission, set_fault};
use super::{app, drive, max_model_len, Fault, Options, ResponseStore, SimServer};
use crate::engine::Engine;
use crate::profile::Profile;

/// Like `serve` with `n` servers of one `profile`, all answering to every name in `names` (the
/// first is the default model).
#[allow(clippy::too_many_arguments)] // the CLI's flags, passed through
pub async fn serve_names(
    profile: Profile,
    n: usize,
    host: &str,
    base_port: u16,
    admin_port: u16,
    time_scale: f64,
    names: Vec<String>,
    options: Options,
) -> anyhow::Result<()> {
    anyhow::ensure!(!names.is_empty(), "at least one served model name is needed");
    serve(
        vec![profile; n],
        host,
        base_port,
        admin_port,
        time_scale,
        Some(names),
        options,
    )
    .await
}

/// Starts server `i` on `base_port + i` running `profiles[i]` (a mixed fleet when they
/// differ), answering to `names`, or to its own model's name when `names` is `None`, and the
/// fault admin listener, every server run with `options`; runs until the process ends.
pub async fn serve(
    profiles: Vec<Profile>,
    host: &str,
    base_port: u16,
    admin_port: u16,
    time_scale: f64,
    names: Option<Vec<String>>,
    options: Options,
) -> anyhow::Result<()> {
    anyhow::ensure!(time_scale > 0.0, "--time-scale must be positive");
    let created = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64());
    let kinds: Vec<(crate::profile::Model, crate::profile::Gpu, u32)> =
        profiles.iter().map(|p| (p.model, p.gpu, p.tp)).collect();
    let mut servers = Vec::new();
    for (i, profile) in profiles.into_iter().enumerate() {
        let served = names
            .clone()
            .unwrap_or_else(|| vec![profile.model.served_name().to_string()]);
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
                legacy: options.legacy,
                ..Fault::default()
            }),
            admission: Mutex::new(options.admission),
            start: Instant::now(),
            time_scale,
            created,
            connections: Mutex::new(None),
            keep_alive: keep_alive(),
            served,
            max_model_len: max_model_len(profile.num_gpu_blocks),
            responses: ResponseStore::new(options.responses_store),
            force_include_usage: options.force_include_usage,
        });
        listen(&srv).await?;
        tokio::spawn(drive(Arc::clone(&srv)));
        servers.push(srv);
    }
    let admin = Router::new()
        .route("/servers/{i}/fault", get(get_fault).post(set_fault))
        .route("/servers/{i}/admission", get(get_admission).post(set_admission))
        .with_state(Arc::new(servers.clone()));
    let admin_listener = TcpListener::bind((host, admin_port))
        .await
        .map_err(|e| anyhow::anyhow!("admin port {admin_port}: {e}"))?;
    let n = servers.len();
    eprintln!(
        "kvroute-sim: {} at {host}:{base_port}..{}, admin {host}:{admin_port}, time scale {time_scale}{}",
        describe(&kinds),
        base_port as usize + n.max(1) - 1,
        if options.responses_store {
            ", responses stored"
        } else {
            ""
        }
    );
    axum::serve(admin_listener, admin).await?;
    Ok(())
}

/// "4 × Llama31_8b on H100_80g" for each run of equal servers, comma-separated.
fn describe(kinds: &[(crate::profile::Model, crate::profile::Gpu, u32)]) -> String {
    let mut runs: Vec<(usize, (crate::profile::Model, crate::profile::Gpu, u32))> = Vec::new();
    for k in kinds {
        match runs.last_mut() {
            Some((count, last)) if last == k => *count += 1,
            _ => runs.push((1, *k)),
        }
    }
    runs.iter()
        .map(|(count, (model, gpu, tp))| format!("{count} × {model} on {gpu:?} (TP{tp})"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// How long a connection may stay idle between requests: vLLM's
/// `VLLM_HTTP_TIMEOUT_KEEP_ALIVE` (seconds, 5 by default), passed to uvicorn as
/// `timeout_keep_alive`. Wall time, whatever `--time-scale`: it is the server's, not the GPU's.
fn keep_alive() -> Duration {
    let seconds = std::env::var("VLLM_HTTP_TIMEOUT_KEEP_ALIVE")
        .ok()
        .and_then(|v| v.trim().parse::<f64>().ok())
        .filter(|s| s.is_finite() && *s > 0.0)
        .unwrap_or(5.0);
    Duration::from_secs_f64(seconds)
}

/// vLLM's `VLLM_ENABLE_RESPONSES_API_STORE`, read as vLLM reads it (`bool(int(value))`, off
/// when unset): `serve --responses-store`'s default.
pub fn responses_store_from_env() -> anyhow::Result<bool> {
    const NAME: &str = "VLLM_ENABLE_RESPONSES_API_STORE";
    match std::env::var(NAME) {
        Err(_) => Ok(false),
        Ok(v) => v
            .trim()
            .parse::<i64>()
            .map(|n| n != 0)
            .map_err(|_| anyhow::anyhow!("{NAME} must be an integer (0 or 1), not {v:?}")),
    }
}

/// Binds the server's port and accepts connections into a fresh `JoinSet`.
pub(super) async fn listen(srv: &Arc<SimServer>) -> anyhow::Result<()> {
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
            // HTTP/1.1 only, as vLLM's server (uvicorn) speaks; a connection idle for the
            // keep-alive timeout after its last answer is closed, as uvicorn does (hyper's
            // header timer runs only while no request is in progress).
            let keep_alive = accept_srv.keep_alive;
            conns.spawn(async move {
                let _ = hyper::server::conn::http1::Builder::new()
                    .timer(TokioTimer::new())
                    .header_read_timeout(keep_alive)
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

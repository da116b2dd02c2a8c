//! A small stand-in for a vLLM server, for end-to-end tests of the filter in real Envoy:
//! `/metrics` in vLLM 0.33's format (or the legacy pre-0.12 names) with load the test
//! sets, `/health`, `/v1/models`, chat/completions answers (JSON or SSE), Responses API
//! answers (`/v1/responses`, JSON or SSE, nothing stored) and Anthropic `/v1/messages`
//! answers (JSON) that name the
//! server in `x-served-by` and count what each server received. `kill()` closes the
//! listener and every open connection, as a crashed server would.
//!
//! It is a test double: the simulator's live servers replace it where timing matters.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::Duration;

/// The load a fake server reports on `/metrics`.
#[derive(Clone, Debug)]
pub struct Load {
    pub running: u64,
    pub waiting: u64,
    pub kv: f64,
}

impl Load {
    pub fn idle() -> Load {
        Load {
            running: 0,
            waiting: 0,
            kv: 0.02,
        }
    }
    pub fn heavy() -> Load {
        Load {
            running: 120,
            waiting: 60,
            kv: 0.93,
        }
    }
}

struct State {
    load: Mutex<Load>,
    model: Mutex<String>,
    legacy: AtomicBool,
    /// `/health` answers 503 when false (Envoy's active health check fails).
    healthy: AtomicBool,
    /// Inference answers 500 when true (Envoy's outlier detection ejects it).
    failing: AtomicBool,
    alive: AtomicBool,
    /// Inference answers wait this long first (a server busy with prefill).
    delay_ms: AtomicU64,
    /// Streams carry `usage` whether they asked for it or not (vLLM's
    /// `--enable-force-include-usage`); otherwise only those that asked.
    force_usage: AtomicBool,
    /// Tokens in a streamed answer, each its own chunk, and the pause before each.
    stream_tokens: AtomicU64,
    token_gap_us: AtomicU64,
    inference: AtomicU64,
    scrapes: AtomicU64,
    streams: Mutex<Vec<TcpStream>>,
}

#[derive(Clone)]
pub struct FakeVllm {
    pub port: u16,
    state: Arc<State>,
}

pub const MODEL: &str = "meta-llama/Llama-3.1-8B-Instruct";

impl FakeVllm {
    pub fn start(load: Load) -> std::io::Result<FakeVllm> {
        Self::start_serving(load, MODEL)
    }

    /// A server of `model` (in its metrics, `/v1/models` and answers).
    pub fn start_serving(load: Load, model: &str) -> std::io::Result<FakeVllm> {
        let listener = crate::envoy::bind_unclaimed()?;
        listener.set_nonblocking(true)?;
        let port = listener.local_addr()?.port();
        let state = Arc::new(State {
            load: Mutex::new(load),
            model: Mutex::new(model.to_string()),
            legacy: AtomicBool::new(false),
            healthy: AtomicBool::new(true),
            failing: AtomicBool::new(false),
            alive: AtomicBool::new(true),
            delay_ms: AtomicU64::new(0),
            force_usage: AtomicBool::new(false),
            stream_tokens: AtomicU64::new(1),
            token_gap_us: AtomicU64::new(0),
            inference: AtomicU64::new(0),
            scrapes: AtomicU64::new(0),
            streams: Mutex::new(Vec::new()),
        });
        let s = Arc::clone(&state);
        thread::spawn(move || accept_loop(listener, s, port));
        Ok(FakeVllm { port, state })
    }

    pub fn address(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }
    pub fn set_load(&self, load: Load) {
        if let Ok(mut l) = self.state.load.lock() {
            *l = load;
        }
    }
    pub fn set_legacy_names(&self, legacy: bool) {
        self.state.legacy.store(legacy, Ordering::SeqCst);
    }
    pub fn set_healthy(&self, healthy: bool) {
        self.state.healthy.store(healthy, Ordering::SeqCst);
    }
    pub fn set_failing(&self, failing: bool) {
        self.state.failing.store(failing, Ordering::SeqCst);
    }
    /// Inference answers come this long after the request (0: at once).
    pub fn set_delay_ms(&self, ms: u64) {
        self.state.delay_ms.store(ms, Ordering::SeqCst);
    }
    /// Streams carry `usage` even when they did not ask (`--enable-force-include-usage`).
    pub fn set_force_usage(&self, force: bool) {
        self.state.force_usage.store(force, Ordering::SeqCst);
    }
    /// Streamed answers carry `tokens` tokens (at least one), each written as its own chunk
    /// `gap_us` after the one before, as a server decoding one token per step does.
    pub fn set_stream(&self, tokens: u64, gap_us: u64) {
        self.state.stream_tokens.store(tokens.max(1), Ordering::SeqCst);
        self.state.token_gap_us.store(gap_us, Ordering::SeqCst);
    }
    pub fn inference_requests(&self) -> u64 {
        self.state.inference.load(Ordering::SeqCst)
    }
    pub fn scrapes(&self) -> u64 {
        self.state.scrapes.load(Ordering::SeqCst)
    }
    /// Stops accepting and drops every open connection.
    pub fn kill(&self) {
        self.state.alive.store(false, Ordering::SeqCst);
        if let Ok(streams) = self.state.streams.lock() {
            for s in streams.iter() {
                let _ = s.shutdown(Shutdown::Both);
            }
        }
    }
}

impl Drop for State {
    fn drop(&mut self) {
        self.alive.store(false, Ordering::SeqCst);
    }
}

fn accept_loop(listener: TcpListener, state: Arc<State>, port: u16) {
    while state.alive.load(Ordering::SeqCst) && Arc::strong_count(&state) > 1 {
        match listener.accept() {
            Ok((stream, _)) => {
                let _ = stream.set_nonblocking(false);
                // Responses are small writes; without this, Nagle's algorithm meets the
                // peer's delayed ACK and stalls them about 40 ms.
                let _ = stream.set_nodelay(true);
                if let (Ok(mut streams), Ok(clone)) = (state.streams.lock(), stream.try_clone()) {
                    streams.push(clone);
                }
                let s = Arc::clone(&state);
                thread::spawn(move || serve(stream, s, port));
            }
            Err(_) => thread::sleep(Duration::from_millis(5)),
        }
    }
}

struct Request {
    method: String,
    path: String,
    body: Vec<u8>,
}

fn read_request(reader: &mut BufReader<TcpStream>) -> Option<Request> {
    let mut line = String::new();
    reader.read_line(&mut line).ok().filter(|n| *n > 0)?;
    let mut parts = line.split_whitespace();
    let (method, path) = (parts.next()?.to_string(), parts.next()?.to_string());
    let mut length = 0usize;
    loop {
        // Header values may hold bytes that are not UTF-8 (obs-text): read bytes.
        let mut raw = Vec::new();
        reader.read_until(b'\n', &mut raw).ok().filter(|n| *n > 0)?;
        let h = String::from_utf8_lossy(&raw);
        let h = h.trim_end();
        if h.is_empty() {
            break;
        }
        if let Some((k, v)) = h.split_once(':') {
            if k.eq_ignore_ascii_case("content-length") {
                length = v.trim().parse().ok()?;
            }
        }
    }
    let mut body = vec![0; length];
    reader.read_exact(&mut body).ok()?;
    Some(Request { method, path, body })
}

fn serve(stream: TcpStream, state: Arc<State>, port: u16) {
    let Ok(write_half) = stream.try_clone() else { return };
    let mut writer = write_half;
    let mut reader = BufReader::new(stream);
    while let Some(req) = read_request(&mut reader) {
        if !state.alive.load(Ordering::SeqCst) {
            break;
        }
        let ok = match (req.method.as_str(), req.path.split('?').next().unwrap_or("")) {
            ("GET", "/metrics") => {
                state.scrapes.fetch_add(1, Ordering::SeqCst);
                respond(&mut writer, 200, "text/plain; version=0.0.4", &metrics(&state), port)
            }
            ("GET", "/health") if state.healthy.load(Ordering::SeqCst) => {
                respond(&mut writer, 200, "text/plain", b"", port)
            }
            ("GET", "/health") => respond(&mut writer, 503, "text/plain", b"", port),
            ("GET", "/v1/models") => {
                let model = model_of(&state);
                let body = format!(r#"{{"object":"list","data":[{{"id":"{model}","object":"model"}}]}}"#);
                respond(&mut writer, 200, "application/json", body.as_bytes(), port)
            }
            ("POST", "/v1/chat/completions") | ("POST", "/v1/completions") if state.failing.load(Ordering::SeqCst) => {
                state.inference.fetch_add(1, Ordering::SeqCst);
                respond(
                    &mut writer,
                    500,
                    "application/json",
                    br#"{"error":{"message":"broken"}}"#,
                    port,
                )
            }
            ("POST", "/v1/chat/completions") | ("POST", "/v1/completions") => {
                state.inference.fetch_add(1, Ordering::SeqCst);
                let delay = state.delay_ms.load(Ordering::SeqCst);
                if delay > 0 {
                    thread::sleep(std::time::Duration::from_millis(delay));
                }
                let model = model_of(&state);
                let body = String::from_utf8_lossy(&req.body);
                if body.contains("\"stream\":true") {
                    let usage = if state.force_usage.load(Ordering::SeqCst) {
                        StreamUsage::Forced
                    } else if body.contains("\"include_usage\":true") {
                        StreamUsage::Asked
                    } else {
                        StreamUsage::None
                    };
                    respond_stream(&mut writer, port, usage, &Pace::of(&state))
                } else {
                    // Every answer is a miss: vLLM (with --enable-prompt-tokens-details) then
                    // gives no details, null in a whole response and absent from a stream's usage.
                    let body = format!(
                        r#"{{"id":"x","object":"chat.completion","model":"{model}","choices":[{{"index":0,"message":{{"role":"assistant","content":"ok from {port}"}},"finish_reason":"stop"}}],"usage":{{"prompt_tokens":{},"completion_tokens":3,"prompt_tokens_details":null}}}}"#,
                        req.body.len() / 4
                    );
                    respond(&mut writer, 200, "application/json", body.as_bytes(), port)
                }
            }
            ("POST", "/v1/responses") => {
                let n = state.inference.fetch_add(1, Ordering::SeqCst);
                let id = format!("resp_{port}x{n}");
                let prompt_tokens = req.body.len() / 4;
                if String::from_utf8_lossy(&req.body).contains("\"stream\":true") {
                    respond_responses_stream(&mut writer, port, &id, prompt_tokens, &Pace::of(&state))
                } else {
                    let body = format!(
                        r#"{{"id":"{id}","object":"response","status":"completed","output":[{{"type":"message","role":"assistant","content":[{{"type":"output_text","text":"ok from {port}"}}]}}],"usage":{}}}"#,
                        responses_usage(prompt_tokens, 3)
                    );
                    respond(&mut writer, 200, "application/json", body.as_bytes(), port)
                }
            }
            ("POST", "/v1/messages") => {
                state.inference.fetch_add(1, Ordering::SeqCst);
                let model = model_of(&state);
                let body = format!(
                    r#"{{"id":"chatcmpl-x","type":"message","role":"assistant","content":[{{"type":"text","text":"ok from {port}"}}],"model":"{model}","stop_reason":"end_turn","stop_sequence":null,"usage":{{"input_tokens":{},"output_tokens":3}}}}"#,
                    req.body.len() / 4
                );
                respond(&mut writer, 200, "application/json", body.as_bytes(), port)
            }
            _ => respond(&mut writer, 404, "text/plain", b"not found\n", port),
        };
        if !ok {
            break;
        }
    }
    // The server's list of streams holds a clone of this socket, so dropping ours would not
    // close it: a connection accepted as the server was killed would then hang, unanswered
    // and never closed, until the client gave up.
    let _ = writer.shutdown(Shutdown::Both);
}

fn model_of(state: &State) -> String {
    state
        .model
        .lock()
        .map(|m| m.clone())
        .unwrap_or_else(|_| MODEL.to_string())
}

fn respond(w: &mut TcpStream, status: u16, content_type: &str, body: &[u8], port: u16) -> bool {
    let head = format!(
        "HTTP/1.1 {status} X\r\ncontent-type: {content_type}\r\ncontent-length: {}\r\nx-served-by: 127.0.0.1:{port}\r\n\r\n",
        body.len()
    );
    w.write_all(head.as_bytes())
        .and_then(|_| w.write_all(body))
        .and_then(|_| w.flush())
        .is_ok()
}

/// How a stream's tokens come: how many, and the pause before each.
struct Pace {
    tokens: u64,
    gap: Duration,
}

impl Pace {
    fn of(state: &State) -> Pace {
        Pace {
            tokens: state.stream_tokens.load(Ordering::SeqCst).max(1),
            gap: Duration::from_micros(state.token_gap_us.load(Ordering::SeqCst)),
        }
    }
}

/// An SSE answer, one HTTP chunk per event: `events` before the tokens, `token(i)` for each
/// token (after the pace's gap), then `after`.
fn write_stream(
    w: &mut TcpStream,
    port: u16,
    pace: &Pace,
    before: &[String],
    token: impl Fn(u64) -> String,
    after: &[String],
) -> bool {
    let head = format!(
        "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\nx-served-by: 127.0.0.1:{port}\r\n\r\n"
    );
    if w.write_all(head.as_bytes()).is_err() {
        return false;
    }
    let mut chunk = |event: &str| {
        let chunk = format!("{event}\n\n");
        w.write_all(format!("{:x}\r\n{chunk}\r\n", chunk.len()).as_bytes())
            .is_ok()
    };
    let mut ok = before.iter().all(|e| chunk(e));
    for i in 0..pace.tokens {
        if !ok {
            break;
        }
        if !pace.gap.is_zero() {
            thread::sleep(pace.gap);
        }
        ok = chunk(&token(i));
    }
    ok = ok && after.iter().all(|e| chunk(e));
    ok && w.write_all(b"0\r\n\r\n").and_then(|_| w.flush()).is_ok()
}

/// The usage a chat stream carries.
#[derive(Clone, Copy, PartialEq)]
enum StreamUsage {
    None,
    /// A last chunk with the usage (`stream_options.include_usage`).
    Asked,
    /// That, and the usage so far on every chunk (`--enable-force-include-usage` forces both).
    Forced,
}

/// A chat stream of the pace's tokens, then the usage if it carries any, then `[DONE]`.
fn respond_stream(w: &mut TcpStream, port: u16, usage: StreamUsage, pace: &Pace) -> bool {
    let mut after = Vec::new();
    if usage != StreamUsage::None {
        after.push(format!(
            r#"data: {{"choices":[],"usage":{{"prompt_tokens":10,"completion_tokens":{}}}}}"#,
            pace.tokens
        ));
    }
    after.push("data: [DONE]".to_string());
    write_stream(
        w,
        port,
        pace,
        &[],
        |i| {
            let role = if i == 0 { r#""role":"assistant","# } else { "" };
            let so_far = if usage == StreamUsage::Forced {
                format!(
                    r#","usage":{{"prompt_tokens":10,"total_tokens":{},"completion_tokens":{}}}"#,
                    11 + i,
                    i + 1
                )
            } else {
                String::new()
            };
            format!(r#"data: {{"choices":[{{"index":0,"delta":{{{role}"content":"ok"}}}}]{so_far}}}"#)
        },
        &after,
    )
}

fn responses_usage(input: usize, output: u64) -> String {
    format!(
        r#"{{"input_tokens":{input},"input_tokens_details":{{"cached_tokens":0}},"output_tokens":{output},"output_tokens_details":{{"reasoning_tokens":0}},"total_tokens":{}}}"#,
        input as u64 + output
    )
}

/// A Responses API stream as vLLM sends one: `response.created` and `response.in_progress`
/// (the response's id first) at once, the message's opening events with the first token's
/// `response.output_text.delta`, one delta per token, the closing events and
/// `response.completed` with the usage; no `[DONE]`.
fn respond_responses_stream(w: &mut TcpStream, port: u16, id: &str, input: usize, pace: &Pace) -> bool {
    let event = |kind: &str, data: String| format!("event: {kind}\ndata: {data}");
    let response = |status: &str, usage: &str| {
        format!(r#"{{"id":"{id}","object":"response","status":"{status}","output":[]{usage}}}"#)
    };
    let before = [
        event(
            "response.created",
            format!(
                r#"{{"type":"response.created","sequence_number":0,"response":{}}}"#,
                response("in_progress", "")
            ),
        ),
        event(
            "response.in_progress",
            format!(
                r#"{{"type":"response.in_progress","sequence_number":1,"response":{}}}"#,
                response("in_progress", "")
            ),
        ),
    ];
    // The message's opening events come with its first token, as vLLM sends them.
    let opening = [
        event(
            "response.output_item.added",
            r#"{"type":"response.output_item.added","sequence_number":2,"output_index":0,"item":{"type":"message","role":"assistant","content":[]}}"#.to_string(),
        ),
        event(
            "response.content_part.added",
            r#"{"type":"response.content_part.added","sequence_number":3,"output_index":0,"content_index":0,"part":{"type":"output_text","text":""}}"#.to_string(),
        ),
    ]
    .join("\n\n");
    let usage = format!(r#","usage":{}"#, responses_usage(input, pace.tokens));
    let after = [
        event(
            "response.output_item.done",
            r#"{"type":"response.output_item.done","output_index":0,"item":{"type":"message","role":"assistant"}}"#
                .to_string(),
        ),
        event(
            "response.completed",
            format!(
                r#"{{"type":"response.completed","response":{}}}"#,
                response("completed", &usage)
            ),
        ),
    ];
    write_stream(
        w,
        port,
        pace,
        &before,
        |i| {
            let delta = event(
                "response.output_text.delta",
                format!(
                    r#"{{"type":"response.output_text.delta","sequence_number":{},"output_index":0,"content_index":0,"delta":"ok"}}"#,
                    i + 4
                ),
            );
            if i == 0 {
                format!("{opening}\n\n{delta}")
            } else {
                delta
            }
        },
        &after,
    )
}

fn metrics(state: &State) -> Vec<u8> {
    let load = state.load.lock().map(|l| l.clone()).unwrap_or_else(|_| Load::idle());
    let model = model_of(state);
    let labels = format!(r#"engine="0",model_name="{model}""#);
    let (kv_name, prefix) = if state.legacy.load(Ordering::SeqCst) {
        ("vllm:gpu_cache_usage_perc", "vllm:gpu_prefix_cache")
    } else {
        ("vllm:kv_cache_usage_perc", "vllm:prefix_cache")
    };
    format!(
        "# HELP vllm:num_requests_running Number of requests in model execution batches.\n\
         # TYPE vllm:num_requests_running gauge\n\
         vllm:num_requests_running{{{labels}}} {}.0\n\
         # TYPE vllm:num_requests_waiting gauge\n\
         vllm:num_requests_waiting{{{labels}}} {}.0\n\
         # TYPE {kv_name} gauge\n\
         {kv_name}{{{labels}}} {}\n\
         # TYPE {prefix}_queries_total counter\n\
         {prefix}_queries_total{{{labels}}} 1000.0\n\
         {prefix}_hits_total{{{labels}}} 500.0\n\
         vllm:cache_config_info{{block_size=\"16\",engine=\"0\",num_gpu_blocks=\"29205\"}} 1.0\n",
        load.running, load.waiting, load.kv
    )
    .into_bytes()
}

//! The Rust `async-openai` client's types (0.43, types only) deserialize every response shape a
//! live `kvroute-sim serve` sends: chat (n = 1 and 2, a tools request), chat stream chunks (the
//! role-first chunk, content chunks, the finish chunk, the usage chunk with `choices: []`),
//! completions (a prompt list × n), a completions stream with usage, and the model list.
//!
//! Error bodies are vLLM 0.33's `{"error": {"message", "type", "param", "code": 404}}`;
//! async-openai's `WrappedError` types `code` as a string, so it rejects vLLM's integer code (as
//! it would real vLLM's). The test pins both halves: the simulator keeps vLLM's integer, and
//! that field is the only one async-openai disagrees with.
//!
//! The server is started by each test on free loopback ports and spoken to in HTTP/1.0, so a
//! response (streams included) is everything up to the close. `KVROUTE_SIM` names the binary
//! (default `target/release/kvroute-sim` of the main workspace).

#![allow(clippy::disallowed_methods)] // a wall-clock deadline for the server to start

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::thread::sleep;
use std::time::{Duration, Instant};

use async_openai::error::WrappedError;
use async_openai::types::chat::{
    CompletionFinishReason, CreateChatCompletionResponse, CreateChatCompletionStreamResponse, FinishReason, Role,
};
use async_openai::types::completions::CreateCompletionResponse;
use async_openai::types::models::ListModelResponse;
use serde_json::{json, Value};

const MODEL: &str = "meta-llama/Llama-3.1-8B-Instruct";

/// One simulated server, killed on drop.
struct Sim {
    child: Child,
    port: u16,
}

impl Drop for Sim {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn free_port() -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind an ephemeral port");
    listener.local_addr().expect("local address").port()
}

fn sim() -> Sim {
    let bin = std::env::var_os("KVROUTE_SIM")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../target/release/kvroute-sim"));
    assert!(
        bin.exists(),
        "no {}: run `cargo build --release -p kvroute-sim`",
        bin.display()
    );
    let (port, admin) = (free_port(), free_port());
    let child = Command::new(&bin)
        .args(["serve", "--servers", "1", "--host", "127.0.0.1"])
        .args(["--base-port", &port.to_string(), "--admin-port", &admin.to_string()])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("start kvroute-sim");
    let sim = Sim { child, port };
    let deadline = Instant::now() + Duration::from_secs(20);
    while http(sim.port, "GET", "/health", None).map(|(s, _)| s) != Some(200) {
        assert!(Instant::now() < deadline, "kvroute-sim did not answer /health in 20 s");
        sleep(Duration::from_millis(20));
    }
    sim
}

/// Status and body of one HTTP/1.0 exchange, or `None` when the server is not listening yet.
fn http(port: u16, method: &str, path: &str, body: Option<&Value>) -> Option<(u16, String)> {
    let mut stream = TcpStream::connect(("127.0.0.1", port)).ok()?;
    stream.set_read_timeout(Some(Duration::from_secs(30))).ok()?;
    let body = body.map(Value::to_string).unwrap_or_default();
    let head = format!(
        "{method} {path} HTTP/1.0\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
        body.len()
    );
    stream.write_all(head.as_bytes()).ok()?;
    stream.write_all(body.as_bytes()).ok()?;
    let mut raw = String::new();
    stream.read_to_string(&mut raw).ok()?;
    let (head, body) = raw.split_once("\r\n\r\n")?;
    let status = head.split(' ').nth(1)?.parse().ok()?;
    Some((status, body.to_string()))
}

fn post(sim: &Sim, path: &str, body: Value) -> String {
    let (status, text) = http(sim.port, "POST", path, Some(&body)).expect("an answer");
    assert_eq!(status, 200, "{path} {body}: {text}");
    text
}

/// The `data:` payloads of an SSE body, checking it ends with `data: [DONE]`.
fn events(body: &str) -> Vec<&str> {
    let data: Vec<&str> = body.lines().filter_map(|l| l.strip_prefix("data: ")).collect();
    assert_eq!(data.last(), Some(&"[DONE]"), "stream not closed by [DONE]: {body}");
    data[..data.len() - 1].to_vec()
}

fn typed<T: serde::de::DeserializeOwned>(text: &str) -> T {
    serde_json::from_str(text).unwrap_or_else(|e| panic!("{}: {e}\n{text}", std::any::type_name::<T>()))
}

#[test]
fn chat_responses_deserialize_with_n_and_tools() {
    let sim = sim();
    let chat: CreateChatCompletionResponse = typed(&post(
        &sim,
        "/v1/chat/completions",
        json!({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "n": 2}),
    ));
    assert_eq!(chat.choices.len(), 2);
    assert!(chat.created > 0 && chat.object == "chat.completion");
    for c in &chat.choices {
        assert_eq!(c.message.role, Role::Assistant);
        assert_eq!(c.finish_reason, Some(FinishReason::Length));
    }
    let usage = chat.usage.expect("usage");
    assert_eq!(usage.completion_tokens, 6);
    let tools = json!([{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]);
    let with_tools: CreateChatCompletionResponse = typed(&post(
        &sim,
        "/v1/chat/completions",
        json!({"model": MODEL, "messages": [{"role": "user", "content": "call f"}], "tools": tools, "max_tokens": 2}),
    ));
    assert_eq!(with_tools.choices.len(), 1);
}

#[test]
fn chat_stream_chunks_deserialize_role_first_finish_last_usage_chunk() {
    let sim = sim();
    let body = post(
        &sim,
        "/v1/chat/completions",
        json!({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
               "stream": true, "stream_options": {"include_usage": true}}),
    );
    let chunks: Vec<CreateChatCompletionStreamResponse> = events(&body).into_iter().map(typed).collect();
    assert_eq!(chunks.len(), 1 + 3 + 1, "role chunk, 3 tokens, usage chunk");
    assert_eq!(chunks[0].choices[0].delta.role, Some(Role::Assistant));
    assert_eq!(chunks[3].choices[0].finish_reason, Some(FinishReason::Length));
    assert!(chunks[..3].iter().all(|c| c.choices[0].finish_reason.is_none()));
    let last = &chunks[4];
    assert!(last.choices.is_empty());
    assert_eq!(last.usage.as_ref().map(|u| u.completion_tokens), Some(3));
}

#[test]
fn completions_deserialize_for_a_prompt_list_times_n_and_streamed() {
    let sim = sim();
    let done: CreateCompletionResponse = typed(&post(
        &sim,
        "/v1/completions",
        json!({"model": MODEL, "prompt": ["one", "two"], "n": 2, "max_tokens": 2}),
    ));
    assert_eq!(done.choices.len(), 4);
    assert!(done
        .choices
        .iter()
        .all(|c| c.finish_reason == Some(CompletionFinishReason::Length)));
    let body = post(
        &sim,
        "/v1/completions",
        json!({"model": MODEL, "prompt": "once", "max_tokens": 2, "stream": true,
               "stream_options": {"include_usage": true}}),
    );
    let chunks: Vec<CreateCompletionResponse> = events(&body).into_iter().map(typed).collect();
    assert_eq!(chunks.len(), 2 + 1, "2 tokens, usage chunk");
    assert_eq!(chunks[0].choices[0].finish_reason, None);
    assert_eq!(chunks[1].choices[0].finish_reason, Some(CompletionFinishReason::Length));
    assert_eq!(
        chunks[2].usage.as_ref().map(|u| u.total_tokens),
        Some(chunks[2].usage.as_ref().map_or(0, |u| u.prompt_tokens) + 2)
    );
}

#[test]
fn model_list_deserializes() {
    let sim = sim();
    let (status, body) = http(sim.port, "GET", "/v1/models", None).expect("an answer");
    assert_eq!(status, 200);
    let models: ListModelResponse = typed(&body);
    assert_eq!(models.data[0].id, MODEL);
    assert!(models.data[0].created > 0);
}

#[test]
fn error_body_fits_async_openai_except_vllms_integer_code() {
    let sim = sim();
    let bad = json!({"model": "no-such-model", "prompt": "hi"});
    let (status, body) = http(sim.port, "POST", "/v1/completions", Some(&bad)).expect("an answer");
    assert_eq!(status, 404);
    let mut raw: Value = typed(&body);
    assert_eq!(
        raw["error"]["code"],
        json!(404),
        "vLLM 0.33's ErrorInfo.code is an integer"
    );
    let err = serde_json::from_value::<WrappedError>(raw.clone()).expect_err("async-openai types code as a string");
    assert!(err.to_string().contains("invalid type: integer"), "{err}");
    raw["error"]["code"] = json!("404");
    let wrapped: WrappedError = serde_json::from_value(raw).expect("the rest of the body fits");
    assert_eq!(wrapped.error.param.as_deref(), Some("model"));
    assert_eq!(wrapped.error.r#type.as_deref(), Some("NotFoundError"));
}

//! The live server against what vLLM 0.33 answers: real HTTP on loopback, a small fleet.

#![allow(clippy::unwrap_used, clippy::disallowed_methods)] // tests

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use serde_json::Value;

use super::start_in_background;
use crate::profile::{Gpu, Model, Profile};

const MODEL: &str = "meta-llama/Llama-3.1-8B-Instruct";

struct Fleet {
    _rt: tokio::runtime::Runtime,
    base: u16,
}

/// `n` fast servers (time scale 50) of 8B on H100.
fn fleet(n: u16) -> Fleet {
    let profile = Profile::new(Gpu::H100_80g, Model::Llama31_8b, 1).unwrap();
    let (rt, base) = start_in_background(profile, n, 50.0).unwrap();
    Fleet { _rt: rt, base }
}

struct Answer {
    status: u16,
    body: String,
}

impl Answer {
    fn json(&self) -> Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("{e}: {}", self.body))
    }
    /// The `data:` payloads of an SSE body, `[DONE]` excluded.
    #[allow(dead_code)] // used by the stream tests
    fn chunks(&self) -> Vec<Value> {
        self.body
            .split("\n\n")
            .filter_map(|e| e.strip_prefix("data: "))
            .filter(|d| *d != "[DONE]")
            .map(|d| serde_json::from_str(d).unwrap())
            .collect()
    }
}

fn send(port: u16, method: &str, path: &str, body: &[u8]) -> Answer {
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nhost: x\r\nconnection: close\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
        body.len()
    )
    .unwrap();
    s.write_all(body).unwrap();
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).unwrap();
    let text = String::from_utf8_lossy(&raw).to_string();
    let (head, rest) = text.split_once("\r\n\r\n").unwrap();
    let status = head.split(' ').nth(1).unwrap().parse().unwrap();
    let body = if head.to_ascii_lowercase().contains("transfer-encoding: chunked") {
        dechunk(rest)
    } else {
        rest.to_string()
    };
    Answer { status, body }
}

fn dechunk(mut s: &str) -> String {
    let mut out = String::new();
    while let Some((size, rest)) = s.split_once("\r\n") {
        let n = usize::from_str_radix(size.trim(), 16).unwrap_or(0);
        if n == 0 {
            break;
        }
        out.push_str(&rest[..n]);
        s = &rest[n + 2..];
    }
    out
}

fn post(port: u16, path: &str, body: &Value) -> Answer {
    send(port, "POST", path, body.to_string().as_bytes())
}

fn chat(port: u16, extra: Value) -> Answer {
    let mut body = serde_json::json!({"model": MODEL, "messages": [{"role": "user", "content": "hello there"}]});
    merge(&mut body, extra);
    post(port, "/v1/chat/completions", &body)
}

fn completion(port: u16, extra: Value) -> Answer {
    let mut body = serde_json::json!({"model": MODEL, "prompt": "once upon a time"});
    merge(&mut body, extra);
    post(port, "/v1/completions", &body)
}

fn merge(body: &mut Value, extra: Value) {
    if let (Some(b), Value::Object(e)) = (body.as_object_mut(), extra) {
        for (k, v) in e {
            if v.is_null() && k.starts_with('-') {
                b.remove(&k[1..]);
            } else {
                b.insert(k, v);
            }
        }
    }
}

#[test]
fn a_two_megabyte_prompt_gets_400_at_once_and_the_server_serves_right_after() {
    let f = fleet(1);
    let huge = "abc ".repeat(2 << 18); // 2 MiB ≈ 524k tokens, over the 131,072-token context
    let started = Instant::now();
    let a = chat(
        f.base,
        serde_json::json!({"max_tokens": 8, "messages": [{"role": "user", "content": huge}]}),
    );
    assert!(
        started.elapsed() < Duration::from_secs(1),
        "took {:?}",
        started.elapsed()
    );
    assert_eq!(a.status, 400, "{}", a.body);
    let e = &a.json()["error"];
    assert_eq!(e["type"], "BadRequestError");
    assert_eq!(e["param"], "input_tokens");
    assert_eq!(e["code"], 400);
    let message = e["message"].as_str().unwrap();
    assert!(
        message.starts_with("This model's maximum context length is 131072 tokens. However, your request has "),
        "{message}"
    );
    assert!(
        message.ends_with("Please reduce the length of the input messages. (parameter=input_tokens, value=524294)"),
        "{message}"
    );
    let small = chat(f.base, serde_json::json!({"max_tokens": 4}));
    assert_eq!(small.status, 200, "{}", small.body);
}

#[test]
fn prompt_plus_max_tokens_over_the_context_is_refused_with_param_max_tokens() {
    let f = fleet(1);
    let a = completion(f.base, serde_json::json!({"max_tokens": 131_070}));
    assert_eq!(a.status, 400);
    let e = &a.json()["error"];
    assert_eq!(e["param"], "max_tokens");
    assert_eq!(
        e["message"],
        "'max_tokens' or 'max_completion_tokens' is too large: 131070. This model's maximum context length is \
         131072 tokens and your request has 4 input tokens (131070 > 131072 - 4). (parameter=max_tokens, value=131070)"
    );
}

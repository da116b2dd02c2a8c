//! The live servers over real HTTP: vLLM-shaped answers (JSON and SSE), prefix-cache hits
//! reported in `usage`, `/metrics` the core can parse, and run-time fault injection.

#![allow(clippy::unwrap_used, clippy::disallowed_methods)] // test helpers; wall-time test

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use kvroute_sim::bench::Api;
use kvroute_sim::profile::{Gpu, Model, Profile};
use kvroute_sim::workload::{generate, GenParams, Generator};

fn http(port: u16, method: &str, path: &str, body: &str) -> std::io::Result<(u16, String, String)> {
    let mut s = TcpStream::connect(("127.0.0.1", port))?;
    s.set_read_timeout(Some(Duration::from_secs(10)))?;
    write!(s, "{method} {path} HTTP/1.1\r\nhost: x\r\nconnection: close\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}", body.len())?;
    let mut raw = String::new();
    s.read_to_string(&mut raw)?;
    let (head, body) = raw.split_once("\r\n\r\n").unwrap_or((&raw, ""));
    let status = head.split_whitespace().nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
    Ok((status, head.to_lowercase(), body.to_string()))
}

#[test]
fn live_servers_answer_like_vllm_and_take_faults() {
    let profile = Profile::new(Gpu::H100_80g, Model::Llama31_8b, 1)
        .unwrap()
        .with_blocks(4000);
    let (rt, base) = kvroute_sim::serve::start_in_background(profile, 2, 50.0).unwrap();

    // Non-streaming chat: a vLLM-shaped body naming its server; the repeat hits the cache.
    let prompt = "You are a careful assistant. ".repeat(40);
    let body = format!(r#"{{"model":"m","max_tokens":4,"messages":[{{"role":"user","content":"{prompt}"}}]}}"#);
    let (status, head, first) = http(base, "POST", "/v1/chat/completions", &body).unwrap();
    assert_eq!(status, 200, "{first}");
    assert!(head.contains(&format!("x-served-by: 127.0.0.1:{base}")), "{head}");
    let v: serde_json::Value = serde_json::from_str(&first).unwrap();
    assert_eq!(v["usage"]["completion_tokens"], 4);
    assert!(
        v["usage"].get("prompt_tokens_details").is_none(),
        "a miss has no details, as vLLM sends them: {first}"
    );
    let (_, _, again) = http(base, "POST", "/v1/chat/completions", &body).unwrap();
    let v: serde_json::Value = serde_json::from_str(&again).unwrap();
    assert!(
        v["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap() >= 256,
        "{again}"
    );

    // Streaming through the load generator: every request completes with its tokens.
    let p = GenParams {
        rate: 50.0,
        groups: 2,
        prompts_per_group: 4,
        output_tokens: 8,
        ..GenParams::defaults(Generator::SharedPrefix)
    };
    let reqs = generate(Generator::SharedPrefix, &p);
    let url = format!("http://127.0.0.1:{base}");
    let (run, servers) = rt
        .block_on(kvroute_sim::bench::quiet(&url, Api::Chat, &reqs, 60.0, "live"))
        .unwrap();
    assert_eq!((run.completed, run.failed), (8, 0));
    assert_eq!(servers, vec![format!("127.0.0.1:{base}")]);
    assert!(
        run.prefix_hit_rate > 0.5,
        "siblings share 2048 of 2180 tokens: {}",
        run.prefix_hit_rate
    );
    assert!(run.ttft_ms.p50 > 0.0 && run.itl_ms.p50 > 0.0);

    // The same through Anthropic's Messages, each request with its own attribution hash:
    // the server leaves the block out, so the siblings still share their prefix.
    let later = generate(Generator::SharedPrefix, &GenParams { seed: 9, ..p });
    let (run, _) = rt
        .block_on(kvroute_sim::bench::quiet(&url, Api::Messages, &later, 60.0, "messages"))
        .unwrap();
    assert_eq!((run.completed, run.failed), (8, 0));
    assert!(
        run.prefix_hit_rate > 0.5,
        "the attribution block is no part of the prefix: {}",
        run.prefix_hit_rate
    );
    assert!(run.ttft_ms.p50 > 0.0 && run.itl_ms.p50 > 0.0);

    // /metrics parses and counts what was served.
    let (status, _, text) = http(base, "GET", "/metrics", "").unwrap();
    assert_eq!(status, 200);
    let m = kvroute_core::parse_metrics(text.as_bytes(), 1 << 20).unwrap();
    assert_eq!(m.num_gpu_blocks, Some(4000));
    assert!(m.prefix_hits.unwrap() > 0.0);

    // Faults: garbage metrics, metrics 404, 5xx, down (connection refused) and back.
    let fault = |i: usize, f: &str| http(base - 1, "POST", &format!("/servers/{i}/fault"), f).unwrap().0;
    assert_eq!(fault(0, r#"{"metrics":"garbage"}"#), 200);
    let (_, _, garbage) = http(base, "GET", "/metrics", "").unwrap();
    assert!(kvroute_core::parse_metrics(garbage.as_bytes(), 1 << 20).is_err());
    assert_eq!(fault(0, r#"{"metrics":"404","error_rate":1.0}"#), 200);
    assert_eq!(http(base, "GET", "/metrics", "").unwrap().0, 404);
    assert_eq!(
        http(base, "POST", "/v1/completions", r#"{"model":"m","prompt":"x"}"#)
            .unwrap()
            .0,
        500
    );
    assert_eq!(fault(0, r#"{"bogus":1}"#), 400, "unknown fault fields are refused");
    assert_eq!(fault(1, r#"{"down":true}"#), 200);
    std::thread::sleep(Duration::from_millis(100));
    assert!(
        TcpStream::connect(("127.0.0.1", base + 1)).is_err(),
        "a down server refuses connections"
    );
    assert_eq!(fault(1, r#"{"down":false}"#), 200);
    assert!(
        kvroute_sim::serve::wait_listening(base + 1, Duration::from_secs(10)),
        "the server did not come back"
    );
    assert_eq!(http(base + 1, "GET", "/health", "").unwrap().0, 200);
    assert_eq!(
        http(base, "POST", "/v1/chat/completions", "{nope").unwrap().0,
        500,
        "error_rate 1.0 still applies"
    );
}

/// A gateway stand-in that answers 429 to every request of priority -1 and streams one
/// token to the others, noting each request's kvroute headers.
fn refusing_gateway() -> (u16, std::sync::Arc<std::sync::Mutex<Vec<String>>>) {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let log = std::sync::Arc::clone(&seen);
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(mut s) = conn else { continue };
            let log = std::sync::Arc::clone(&log);
            std::thread::spawn(move || {
                let mut buf = Vec::new();
                let mut chunk = [0u8; 4096];
                // One request per connection is enough here: read its head and body.
                loop {
                    let Ok(n) = s.read(&mut chunk) else { return };
                    if n == 0 {
                        return;
                    }
                    buf.extend_from_slice(&chunk[..n]);
                    let text = String::from_utf8_lossy(&buf).to_lowercase();
                    let Some((head, body)) = text.split_once("\r\n\r\n") else {
                        continue;
                    };
                    let len: usize = head
                        .lines()
                        .find_map(|l| l.strip_prefix("content-length: "))
                        .and_then(|v| v.trim().parse().ok())
                        .unwrap_or(0);
                    if body.len() < len {
                        continue;
                    }
                    let kv: Vec<&str> = head.lines().filter(|l| l.starts_with("x-kvroute-")).collect();
                    log.lock().unwrap().push(kv.join("; "));
                    let reply = if head.contains("x-kvroute-priority: -1") {
                        "HTTP/1.1 429 Too Many Requests\r\nretry-after: 1\r\ncontent-length: 0\r\nconnection: close\r\n\r\n".to_string()
                    } else {
                        let events = "data: {\"choices\":[{\"delta\":{\"content\":\"hi\"}}]}\n\ndata: [DONE]\n\n";
                        format!("HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nx-served-by: a\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{events}", events.len())
                    };
                    let _ = s.write_all(reply.as_bytes());
                    return;
                }
            });
        }
    });
    (port, seen)
}

#[test]
fn classed_requests_carry_kvroute_headers_and_a_429_is_a_refusal_not_a_failure() {
    use kvroute_sim::bench::RequestClass;
    let (port, seen) = refusing_gateway();
    let p = GenParams {
        rate: 100.0,
        groups: 2,
        prompts_per_group: 4,
        output_tokens: 1,
        ..GenParams::defaults(Generator::SharedPrefix)
    };
    let reqs = generate(Generator::SharedPrefix, &p);
    let classes: Vec<RequestClass> = (0..reqs.len())
        .map(|i| RequestClass {
            priority: if i % 2 == 0 { 0 } else { -1 },
            tenant: (i % 3) as u32,
            ttft_objective_ms: (i % 2 == 0).then_some(750.0),
        })
        .collect();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let url = format!("http://127.0.0.1:{port}");
    let (run, _) = rt
        .block_on(kvroute_sim::bench::bench(
            &url,
            Api::Chat,
            "m",
            &reqs,
            &classes,
            60.0,
            "classed",
            |_| {},
        ))
        .unwrap();
    assert_eq!((run.completed, run.rejections.len(), run.failed), (4, 4, 0));
    assert!(run.rejections.iter().all(|r| r.priority == -1));
    assert!(run
        .records
        .iter()
        .all(|r| r.priority == 0 && r.ttft_objective_ms == Some(750.0)));
    let seen = seen.lock().unwrap().clone();
    assert_eq!(seen.len(), 8);
    assert!(
        seen.iter().any(|h| h.contains("x-kvroute-ttft-objective-ms: 750")),
        "{seen:?}"
    );
    assert!(seen.iter().all(|h| h.contains("x-kvroute-tenant: tenant-")), "{seen:?}");
    // Without classes a 429 is a failure, and nothing is added to the request.
    let (run, _) = rt
        .block_on(kvroute_sim::bench::bench(
            &url,
            Api::Chat,
            "m",
            &reqs,
            &[],
            60.0,
            "plain",
            |_| {},
        ))
        .unwrap();
    assert_eq!((run.completed, run.rejections.len()), (8, 0));
}

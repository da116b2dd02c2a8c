//! The load generator says why a request failed: the HTTP status, a connection refused, a
//! stream cut short. Each case is a one-connection server on loopback that answers as told.

#![allow(clippy::unwrap_used)] // test helpers

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};

use kvroute_sim::bench::Api;
use kvroute_sim::workload::{generate, GenParams, Generator};

/// Reads one HTTP request (head and body) off `s`.
fn read_request(s: &TcpStream) {
    let mut r = BufReader::new(s);
    let mut length = 0usize;
    loop {
        let mut line = String::new();
        r.read_line(&mut line).unwrap();
        if let Some(v) = line.to_lowercase().strip_prefix("content-length:") {
            length = v.trim().parse().unwrap();
        }
        if line == "\r\n" || line.is_empty() {
            break;
        }
    }
    let mut body = vec![0; length];
    r.read_exact(&mut body).unwrap();
}

/// Sends one request to a server that answers its first connection with `reply` and
/// closes; returns the bench's failure causes.
fn failures_for(reply: String) -> (usize, Vec<(String, usize)>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    std::thread::spawn(move || {
        let (mut s, _) = listener.accept().unwrap();
        read_request(&s);
        s.write_all(reply.as_bytes()).unwrap();
    });
    bench_one(port)
}

fn bench_one(port: u16) -> (usize, Vec<(String, usize)>) {
    let p = GenParams {
        groups: 1,
        prompts_per_group: 1,
        output_tokens: 4,
        ..GenParams::defaults(Generator::SharedPrefix)
    };
    let reqs = generate(Generator::SharedPrefix, &p);
    let rt = tokio::runtime::Runtime::new().unwrap();
    let url = format!("http://127.0.0.1:{port}");
    let (run, _) = rt
        .block_on(kvroute_sim::bench::quiet(&url, Api::Chat, &reqs, 60.0, "failing"))
        .unwrap();
    (run.failed, run.failures.into_iter().collect())
}

/// A chat stream's head.
const STREAM: &str = "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n";

#[test]
fn a_status_a_cut_stream_and_a_malformed_event_are_named() {
    let token = "data: {\"choices\":[{\"delta\":{\"content\":\"a\"}}]}\n\n";
    for (reply, says) in [
        (
            "HTTP/1.1 503 Service Unavailable\r\ncontent-length: 0\r\nconnection: close\r\n\r\n".to_string(),
            "HTTP 503",
        ),
        // Two tokens, then the connection closes: no `[DONE]`.
        (format!("{STREAM}{token}{token}"), "stream ended before its last event"),
        (
            format!("{STREAM}data: {{\"choices\n\ndata: [DONE]\n\n"),
            "stream: an event that is not JSON",
        ),
    ] {
        let (failed, why) = failures_for(reply);
        assert_eq!((failed, why), (1, vec![(says.to_string(), 1)]));
    }
}

#[test]
fn a_server_that_refuses_the_connection_is_named() {
    // A port that was free a moment ago: nothing listens there.
    let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let (failed, why) = bench_one(port);
    assert_eq!(failed, 1);
    assert_eq!(why.len(), 1, "{why:?}");
    assert!(why[0].0.starts_with("no answer: "), "{why:?}");
    assert!(why[0].0.to_lowercase().contains("refused"), "{why:?}");
}

#[test]
fn a_complete_stream_is_no_failure() {
    let reply = format!("{STREAM}data: {{\"choices\":[{{\"delta\":{{\"content\":\"a\"}}}}]}}\n\ndata: [DONE]\n\n");
    assert_eq!(failures_for(reply), (0, vec![]));
}

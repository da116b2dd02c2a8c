//! `streams [TOKENS [GAP_US]]`: what kvroute costs Envoy on the answers it reads. A stream is
//! read chunk by chunk when kvroute wants something from it: the usage at its end (the
//! client asked for it, or the server sends it unasked, vLLM's `--enable-force-include-usage`),
//! or, for the Responses API, the response's id (its home) and the first output event (the
//! first token). Each case runs on a fresh Envoy and four fresh fake servers streaming TOKENS
//! tokens (64), each its own chunk GAP_US (1,000 µs) after the one before, and is loaded by
//! wrk on the three listeners (no filter, the empty filter, kvroute) in the order A B C C B A:
//! Envoy's CPU per request, and kvroute's share of it over the empty filter's.

use kvroute_wasm_tests::envoy::Envoy;
use kvroute_wasm_tests::fake_vllm::{FakeVllm, MODEL};

use crate::common::fleet;
use crate::wrk::{body_script, wrk_abccba};

/// One kind of answer: its label, the path, the request body, and whether the servers send
/// stream usage unasked.
struct Case {
    label: &'static str,
    path: &'static str,
    body: String,
    force_usage: bool,
}

fn cases() -> Vec<Case> {
    let prompt = format!("{} stream bench", "a".repeat(900));
    let chat = |extra: &str| {
        format!(r#"{{"model":"{MODEL}","max_tokens":64,{extra}"messages":[{{"role":"user","content":"{prompt}"}}]}}"#)
    };
    let responses = |extra: &str| format!(r#"{{"model":"{MODEL}","max_output_tokens":64,{extra}"input":"{prompt}"}}"#);
    vec![
        Case {
            label: "chat, whole answer",
            path: "/v1/chat/completions",
            body: chat(""),
            force_usage: false,
        },
        Case {
            label: "chat stream asking for usage (read to its end)",
            path: "/v1/chat/completions",
            body: chat(r#""stream":true,"stream_options":{"include_usage":true},"#),
            force_usage: false,
        },
        Case {
            label: "chat stream not asking; servers send none (unread once learned)",
            path: "/v1/chat/completions",
            body: chat(r#""stream":true,"#),
            force_usage: false,
        },
        Case {
            label: "chat stream not asking; servers send usage anyway (read to its end)",
            path: "/v1/chat/completions",
            body: chat(r#""stream":true,"#),
            force_usage: true,
        },
        Case {
            label: "Responses API, whole answer (id read)",
            path: "/v1/responses",
            body: responses(""),
            force_usage: false,
        },
        Case {
            label: "Responses API stream (id, first output event, usage)",
            path: "/v1/responses",
            body: responses(r#""stream":true,"#),
            force_usage: false,
        },
    ]
}

pub fn streams(tokens: u64, gap_us: u64) -> Result<(), String> {
    let dir = std::env::temp_dir().join(format!("kvroute-streams-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
    println!("Each case: a fresh Envoy (--concurrency 2) and 4 fake servers streaming {tokens} tokens, one chunk each, {gap_us} µs apart; wrk 16 connections, 4 s per listener in the order none, empty, kvroute, kvroute, empty, none; means of the two runs.\n");
    println!("| answer | req/s none / empty / kvroute | Envoy CPU/req none | empty | kvroute | kvroute − empty | usage read (kvroute) |");
    println!("|---|---|---|---|---|---|---|");
    for (n, case) in cases().into_iter().enumerate() {
        let servers: Vec<FakeVllm> = fleet(4)?;
        for s in &servers {
            s.set_stream(tokens, gap_us);
            s.set_force_usage(case.force_usage);
        }
        let ports: Vec<u16> = servers.iter().map(|s| s.port).collect();
        let envoy = Envoy::start("bench-overhead.yaml", &ports, |t| t)?;
        std::thread::sleep(std::time::Duration::from_millis(600));
        let script = body_script(&dir, &format!("stream-{n}"), &case.body)?;
        let [none, empty, with] = wrk_abccba(&envoy, case.path, &script, 16, 4)?;
        let flag = if with.errors || none.errors || empty.errors {
            " (errors)"
        } else {
            ""
        };
        let read = envoy.stat("wasmcustom.kvroute.responses.usage_reported");
        let missing = envoy.stat("wasmcustom.kvroute.responses.usage_missing");
        println!(
            "| {}{flag} | {:.0} / {:.0} / {:.0} | {:.1} µs | {:.1} µs | {:.1} µs | {:+.1} µs | {read} of {} |",
            case.label,
            none.rps,
            empty.rps,
            with.rps,
            none.envoy_cpu_us,
            empty.envoy_cpu_us,
            with.envoy_cpu_us,
            with.envoy_cpu_us - empty.envoy_cpu_us,
            read + missing,
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}

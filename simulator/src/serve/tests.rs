//! The live server against what vLLM 0.33 answers: real HTTP on loopback, a small fleet.

#![allow(clippy::unwrap_used, clippy::disallowed_methods)] // tests

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use serde_json::Value;

use super::{start_in_background, start_in_background_with, start_storing_in_background, Options};
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

/// `fleet`, storing Responses API responses (vLLM's `VLLM_ENABLE_RESPONSES_API_STORE=1`).
fn fleet_storing(n: u16) -> Fleet {
    let profile = Profile::new(Gpu::H100_80g, Model::Llama31_8b, 1).unwrap();
    let (rt, base) = start_storing_in_background(profile, n, 50.0).unwrap();
    Fleet { _rt: rt, base }
}

/// `fleet`, started with `serve --enable-force-include-usage`.
fn fleet_forcing_usage(n: u16) -> Fleet {
    let profile = Profile::new(Gpu::H100_80g, Model::Llama31_8b, 1).unwrap();
    let options = Options {
        force_include_usage: true,
        ..Options::default()
    };
    let (rt, base) = start_in_background_with(profile, n, 50.0, options).unwrap();
    Fleet { _rt: rt, base }
}

struct Answer {
    status: u16,
    /// The status line and headers, lowercase.
    head: String,
    body: String,
}

impl Answer {
    fn json(&self) -> Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("{e}: {}", self.body))
    }
    /// The `data:` payloads of an SSE body, `[DONE]` excluded.
    fn chunks(&self) -> Vec<Value> {
        self.body
            .split("\n\n")
            .filter_map(|e| e.strip_prefix("data: "))
            .filter(|d| *d != "[DONE]")
            .map(|d| serde_json::from_str(d).unwrap())
            .collect()
    }
    /// The named events of an SSE body (`event: …\ndata: …`), in order.
    fn events(&self) -> Vec<(String, Value)> {
        self.body
            .split("\n\n")
            .filter(|e| !e.is_empty())
            .map(|e| {
                let (name, data) = e
                    .strip_prefix("event: ")
                    .and_then(|e| e.split_once("\ndata: "))
                    .unwrap_or_else(|| panic!("not a named event: {e:?}"));
                (name.to_string(), serde_json::from_str(data).unwrap())
            })
            .collect()
    }
}

/// The header line an OpenAI client sends with its JSON body.
const JSON: &str = "content-type: application/json\r\n";

fn send(port: u16, method: &str, path: &str, body: &[u8]) -> Answer {
    send_with(port, method, path, JSON, body)
}

/// `send` with these header lines instead of `JSON` (each ending in `\r\n`).
fn send_with(port: u16, method: &str, path: &str, headers: &str, body: &[u8]) -> Answer {
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nhost: x\r\nconnection: close\r\n{headers}content-length: {}\r\n\r\n",
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
    Answer {
        status,
        head: head.to_ascii_lowercase(),
        body,
    }
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
    // Refused before any engine work: computing 524k tokens would take the simulated
    // server far longer. The bound leaves room for a loaded machine (it read 1.0 s once
    // with a replay matrix running beside the tests).
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "took {:?}",
        started.elapsed()
    );
    assert_eq!(a.status, 400, "{}", a.body);
    let e = &a.json()["error"];
    assert_eq!(e["type"], "BadRequestError");
    assert_eq!(e["param"], "input_tokens");
    assert_eq!(e["code"], 400);
    let message = e["message"].as_str().unwrap();
    assert_eq!(
        message,
        "You passed 524294 input tokens and requested 8 output tokens. However, the model's context length is \
         only 131072 tokens, resulting in a maximum input length of 131064 tokens. Please reduce the length of \
         the input prompt. (parameter=input_tokens, value=524294)"
    );
    let small = chat(f.base, serde_json::json!({"max_tokens": 4}));
    assert_eq!(small.status, 200, "{}", small.body);
}

#[test]
fn prompt_plus_max_tokens_over_the_context_is_refused_as_vllms_renderer_refuses_it() {
    let f = fleet(1);
    // The prompt (4 tokens) past the room max_tokens leaves: param input_tokens.
    let a = completion(f.base, serde_json::json!({"max_tokens": 131_070}));
    assert_eq!(a.status, 400);
    let e = &a.json()["error"];
    assert_eq!(e["param"], "input_tokens");
    assert_eq!(
        e["message"],
        "You passed 4 input tokens and requested 131070 output tokens. However, the model's context length is \
         only 131072 tokens, resulting in a maximum input length of 2 tokens. Please reduce the length of the \
         input prompt. (parameter=input_tokens, value=4)"
    );
    // max_tokens alone past the context: named by the field it came in.
    let a = chat(f.base, serde_json::json!({"max_completion_tokens": 200_000}));
    assert_eq!(a.status, 400);
    let e = &a.json()["error"];
    assert_eq!(e["param"], "max_completion_tokens");
    assert_eq!(
        e["message"],
        "max_completion_tokens=200000cannot be greater than max_model_len=max_total_tokens=131072. Please request \
         fewer output tokens. (parameter=max_completion_tokens, value=200000)"
    );
    // The Responses API too (its truncation is disabled by default): its field named.
    let a = respond(f.base, serde_json::json!({"input": "hi", "max_output_tokens": 200_000}));
    assert_eq!(a.status, 400, "{}", a.body);
    assert_eq!(a.json()["error"]["param"], "max_output_tokens");
    let a = respond(f.base, serde_json::json!({"input": "hi", "max_output_tokens": 131_070}));
    assert_eq!(
        (a.status, &a.json()["error"]["param"]),
        (400, &"input_tokens".into()),
        "{}",
        a.body
    );
}

#[test]
fn every_response_chunk_and_model_card_carries_created() {
    let f = fleet(1);
    let whole = chat(f.base, serde_json::json!({"max_tokens": 3})).json();
    assert!(whole["created"].as_u64().unwrap() > 1_700_000_000, "{whole}");
    assert_eq!(whole["object"], "chat.completion");
    assert_eq!(whole["model"], MODEL);
    let c = completion(f.base, serde_json::json!({"max_tokens": 3})).json();
    assert!(c["created"].is_u64(), "{c}");
    let chunks = chat(f.base, serde_json::json!({"max_tokens": 3, "stream": true})).chunks();
    assert!(chunks
        .iter()
        .all(|c| c["created"].is_u64() && c["object"] == "chat.completion.chunk"));
    let models = send(f.base, "GET", "/v1/models", b"").json();
    let card = &models["data"][0];
    assert_eq!(
        (card["id"].as_str(), card["object"].as_str()),
        (Some(MODEL), Some("model"))
    );
    assert!(card["created"].is_u64() && card["max_model_len"] == 131_072, "{card}");
}

#[test]
fn a_chat_stream_opens_with_the_role_and_ends_with_finish_reason_on_the_last_token() {
    let f = fleet(1);
    let chunks = chat(f.base, serde_json::json!({"max_tokens": 5, "stream": true})).chunks();
    assert_eq!(chunks.len(), 1 + 5, "a role chunk then one chunk per token");
    assert_eq!(
        chunks[0]["choices"][0]["delta"],
        serde_json::json!({"role": "assistant", "content": ""})
    );
    for (i, c) in chunks[1..].iter().enumerate() {
        let choice = &c["choices"][0];
        assert_eq!(choice["delta"]["content"], " tok", "one token, leading space");
        let last = i == 4;
        assert_eq!(choice["finish_reason"] == "length", last, "{c}");
        assert_eq!(choice["finish_reason"].is_null(), !last, "{c}");
    }
    assert!(
        chunks.iter().all(|c| c.get("usage").is_none()),
        "no usage without include_usage"
    );
    let ids: std::collections::HashSet<&str> = chunks.iter().map(|c| c["id"].as_str().unwrap()).collect();
    assert_eq!(ids.len(), 1, "one id for the whole stream");
}

#[test]
fn include_usage_adds_a_last_chunk_with_no_choices_and_the_usage() {
    let f = fleet(1);
    let a = completion(
        f.base,
        serde_json::json!({"max_tokens": 4, "stream": true, "stream_options": {"include_usage": true}}),
    );
    assert!(a.body.ends_with("data: [DONE]\n\n"));
    let chunks = a.chunks();
    assert_eq!(chunks.len(), 4 + 1);
    assert_eq!(chunks[3]["choices"][0]["finish_reason"], "length");
    assert_eq!(chunks[3]["choices"][0]["text"], " tok");
    let last = &chunks[4];
    assert_eq!(last["choices"], serde_json::json!([]));
    assert_eq!(last["usage"]["completion_tokens"], 4);
    assert_eq!(last["usage"]["prompt_tokens"], 4);
    assert_eq!(last["usage"]["total_tokens"], 8);
}

/// vLLM's `should_include_usage`: a stream reports usage when its request asks, and every
/// stream does, on each chunk and at its end, on a server started with
/// `--enable-force-include-usage`, even one whose request says `include_usage: false`.
#[test]
fn a_stream_reports_usage_only_when_asked_unless_the_server_forces_it() {
    let (plain, forcing) = (fleet(1), fleet_forcing_usage(1));
    for options in [
        serde_json::json!({}),
        serde_json::json!({"stream_options": {"include_usage": false}}),
    ] {
        let mut extra = serde_json::json!({"max_tokens": 3, "stream": true});
        merge(&mut extra, options.clone());
        for (ask, chat_stream) in [(chat as fn(u16, Value) -> Answer, true), (completion, false)] {
            let unasked = ask(plain.base, extra.clone()).chunks();
            assert!(
                unasked.iter().all(|c| c.get("usage").is_none()),
                "{options}: {unasked:?}"
            );
            let forced = ask(forcing.base, extra.clone()).chunks();
            let (last, tokens) = forced.split_last().unwrap();
            assert_eq!(tokens.len(), usize::from(chat_stream) + 3, "{forced:?}");
            assert_eq!(last["choices"], serde_json::json!([]), "{options}");
            let prompt = last["usage"]["prompt_tokens"].as_u64().unwrap();
            assert_eq!(
                (
                    &last["usage"]["completion_tokens"],
                    last["usage"]["total_tokens"].as_u64()
                ),
                (&serde_json::json!(3), Some(prompt + 3)),
                "{options}"
            );
            // Continuous usage: the role chunk has generated nothing, each token chunk one more.
            for (c, generated) in tokens.iter().zip(u64::from(!chat_stream)..) {
                assert_eq!(
                    c["usage"],
                    serde_json::json!({"prompt_tokens": prompt, "total_tokens": prompt + generated, "completion_tokens": generated}),
                    "{options}: {c}"
                );
            }
        }
    }
    // A Responses API stream reports its usage in `response.completed` either way.
    let events = |f: &Fleet| {
        let a = respond(f.base, serde_json::json!({"stream": true, "max_output_tokens": 3}));
        let events = a.events();
        let names: Vec<String> = events.iter().map(|(n, _)| n.clone()).collect();
        (
            names,
            events
                .last()
                .map(|(_, e)| e["response"]["usage"]["output_tokens"].clone()),
        )
    };
    assert_eq!(events(&forcing), events(&plain));
}

#[test]
fn continuous_usage_stats_adds_each_choices_usage_so_far_to_every_chunk_of_a_stream_with_usage() {
    let f = fleet(1);
    let ask = |include_usage: bool| {
        let options = serde_json::json!({"include_usage": include_usage, "continuous_usage_stats": true});
        chat(
            f.base,
            serde_json::json!({"n": 2, "max_tokens": 2, "stream": true, "stream_options": options}),
        )
        .chunks()
    };
    let alone = ask(false);
    assert!(alone.iter().all(|c| c.get("usage").is_none()), "{alone:?}");
    let with_usage = ask(true);
    let (last, chunks) = with_usage.split_last().unwrap();
    assert_eq!(last["usage"]["completion_tokens"], 4, "both choices");
    let per_choice: Vec<(u64, u64)> = chunks
        .iter()
        .map(|c| {
            (
                c["choices"][0]["index"].as_u64().unwrap(),
                c["usage"]["completion_tokens"].as_u64().unwrap(),
            )
        })
        .collect();
    for index in [0, 1] {
        let counts: Vec<u64> = per_choice.iter().filter(|c| c.0 == index).map(|c| c.1).collect();
        assert_eq!(counts, vec![0, 1, 2], "choice {index}: its own tokens so far");
    }
}

#[test]
fn chat_without_max_tokens_stops_by_itself_and_completions_default_to_16_tokens() {
    let f = fleet(1);
    let c = chat(f.base, serde_json::json!({})).json();
    assert_eq!(c["choices"][0]["finish_reason"], "stop");
    assert_eq!(c["usage"]["completion_tokens"], super::request::NATURAL_STOP_TOKENS);
    let t = completion(f.base, serde_json::json!({})).json();
    assert_eq!(t["choices"][0]["finish_reason"], "length");
    assert_eq!(t["usage"]["completion_tokens"], 16);
    assert_eq!(t["choices"][0]["text"], " tok".repeat(16));
    // /metrics counts each by the reason its body gave.
    let m = send(f.base, "GET", "/metrics", b"").body;
    for reason in ["stop", "length"] {
        let line = format!(
            "vllm:request_success_total{{engine=\"0\",finished_reason=\"{reason}\",model_name=\"{MODEL}\"}} 1.0"
        );
        assert!(m.lines().any(|l| l == line), "{line}");
    }
}

#[test]
fn n_and_prompt_lists_give_one_choice_per_prompt_and_sample_with_vllm_indexes() {
    let f = fleet(1);
    let a = completion(
        f.base,
        serde_json::json!({"prompt": ["first prompt", "second one here"], "n": 3, "max_tokens": 2}),
    );
    let j = a.json();
    let indexes: Vec<u64> = j["choices"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["index"].as_u64().unwrap())
        .collect();
    assert_eq!(indexes, vec![0, 1, 2, 3, 4, 5]);
    assert_eq!(j["usage"]["completion_tokens"], 12);
    assert_eq!(
        j["usage"]["prompt_tokens"],
        3 + 4,
        "prompt tokens once per prompt, not per sample"
    );
    let s = chat(f.base, serde_json::json!({"n": 2, "max_tokens": 2, "stream": true})).chunks();
    let roles: Vec<&Value> = s
        .iter()
        .filter(|c| c["choices"][0]["delta"].get("role").is_some())
        .collect();
    assert_eq!(roles.len(), 2, "one role chunk per choice");
    let finished: Vec<u64> = s
        .iter()
        .filter(|c| c["choices"][0]["finish_reason"] == "length")
        .map(|c| c["choices"][0]["index"].as_u64().unwrap())
        .collect();
    assert_eq!(finished.len(), 2);
    assert!(finished.contains(&0) && finished.contains(&1));
}

#[test]
fn an_unknown_model_is_404_with_param_model_and_no_model_means_the_served_one() {
    let f = fleet(1);
    let a = chat(f.base, serde_json::json!({"model": "gpt-4"}));
    assert_eq!(a.status, 404);
    assert_eq!(
        a.json(),
        serde_json::json!({"error": {"message": "The model `gpt-4` does not exist.", "type": "NotFoundError", "param": "model", "code": 404}})
    );
    let b = chat(f.base, serde_json::json!({"-model": null, "max_tokens": 1}));
    assert_eq!(b.status, 200, "{}", b.body);
    assert_eq!(b.json()["model"], MODEL);
    // An empty name is no name (vLLM's `_is_model_supported`).
    for path in ["/v1/chat/completions", "/v1/completions", "/tokenize"] {
        let body = serde_json::json!({"model": "", "messages": [{"role": "user", "content": "hi"}], "prompt": "hi", "max_tokens": 1});
        let a = post(f.base, path, &body);
        assert_eq!(a.status, 200, "{path}: {}", a.body);
    }
    assert_eq!(
        chat(f.base, serde_json::json!({"model": "", "max_tokens": 1})).json()["model"],
        MODEL
    );
}

#[test]
fn ids_are_unique_across_servers_and_requests_and_shaped_like_vllms() {
    let f = fleet(2);
    let mut ids = std::collections::HashSet::new();
    for port in [f.base, f.base + 1] {
        for _ in 0..3 {
            let id = chat(port, serde_json::json!({"max_tokens": 1})).json()["id"]
                .as_str()
                .unwrap()
                .to_string();
            let hex = id.strip_prefix("chatcmpl-").unwrap();
            assert!(hex.len() == 32 && hex.chars().all(|c| c.is_ascii_hexdigit()), "{id}");
            assert!(ids.insert(id));
        }
        let id = completion(port, serde_json::json!({"max_tokens": 1})).json()["id"]
            .as_str()
            .unwrap()
            .to_string();
        assert!(id.starts_with("cmpl-") && ids.insert(id));
    }
    // A client's (or Envoy's) X-Request-Id becomes the id, as in vLLM.
    let body = serde_json::json!({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1});
    let given = &format!("x-request-id: 5e1f0c7a-envoy\r\n{JSON}");
    let a = send_with(
        f.base,
        "POST",
        "/v1/chat/completions",
        given,
        body.to_string().as_bytes(),
    );
    assert_eq!(a.json()["id"], "chatcmpl-5e1f0c7a-envoy", "{}", a.body);
    let body = serde_json::json!({"model": MODEL, "prompt": "hi", "max_tokens": 1});
    let a = send_with(f.base, "POST", "/v1/completions", given, body.to_string().as_bytes());
    assert_eq!(a.json()["id"], "cmpl-5e1f0c7a-envoy", "{}", a.body);
    // Without the header, the body's request_id; the header wins over it.
    let a = chat(f.base, serde_json::json!({"max_tokens": 1, "request_id": "trace-7"}));
    assert_eq!(a.json()["id"], "chatcmpl-trace-7", "{}", a.body);
    let a = completion(f.base, serde_json::json!({"max_tokens": 1, "request_id": "trace-8"}));
    assert_eq!(a.json()["id"], "cmpl-trace-8", "{}", a.body);
    let body = serde_json::json!({"model": MODEL, "prompt": "hi", "max_tokens": 1, "request_id": "trace-9"});
    let a = send_with(f.base, "POST", "/v1/completions", given, body.to_string().as_bytes());
    assert_eq!(a.json()["id"], "cmpl-5e1f0c7a-envoy", "{}", a.body);
}

#[test]
fn what_vllm_rejects_gets_400_and_what_it_accepts_gets_200() {
    let f = fleet(1);
    for (extra, kind, param) in [
        (
            serde_json::json!({"max_tokens": 0}),
            "BadRequestError",
            Some("max_tokens"),
        ),
        (serde_json::json!({"n": 0}), "BadRequestError", Some("n")),
        (serde_json::json!({"prompt": ""}), "Bad Request", None),
    ] {
        let a = completion(f.base, extra.clone());
        assert_eq!(a.status, 400, "{extra}: {}", a.body);
        let e = &a.json()["error"];
        assert_eq!(
            (e["type"].as_str(), e["param"].as_str()),
            (Some(kind), param),
            "{extra}"
        );
    }
    let plain = {
        let mut s = TcpStream::connect(("127.0.0.1", f.base)).unwrap();
        let body = r#"{"prompt":"x"}"#;
        write!(s, "POST /v1/completions HTTP/1.1\r\nhost: x\r\nconnection: close\r\ncontent-type: text/plain\r\ncontent-length: {}\r\n\r\n{body}", body.len()).unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).unwrap();
        out
    };
    assert!(plain.starts_with("HTTP/1.1 400"), "{plain}");
    assert!(plain.contains(r#""type":"Bad Request""#), "{plain}");
    for extra in [
        serde_json::json!({"stream": null}),
        serde_json::json!({"max_tokens": 5.0}),
    ] {
        let a = chat(f.base, extra.clone());
        assert_eq!(a.status, 200, "{extra}: {}", a.body);
    }
}

#[test]
fn tokenize_counts_what_inference_reports_and_detokenize_inverts_it() {
    let f = fleet(1);
    let t = post(
        f.base,
        "/tokenize",
        &serde_json::json!({"model": MODEL, "prompt": "hello world, tokens"}),
    )
    .json();
    assert_eq!(t["count"], 5);
    assert_eq!(t["max_model_len"], 131_072);
    assert!(t["token_strs"].is_null());
    let back = post(f.base, "/detokenize", &serde_json::json!({"tokens": t["tokens"]})).json();
    assert_eq!(back["prompt"], "hello world, tokens");
    let messages = serde_json::json!([{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]);
    let tc = post(
        f.base,
        "/tokenize",
        &serde_json::json!({"messages": messages, "return_token_strs": true}),
    )
    .json();
    let inference = chat(f.base, serde_json::json!({"messages": messages, "max_tokens": 1})).json();
    assert_eq!(tc["count"], inference["usage"]["prompt_tokens"]);
    assert_eq!(
        tc["token_strs"].as_array().unwrap().len() as u64,
        tc["count"].as_u64().unwrap()
    );
    // Token ids sent as a prompt are the same bytes, hence the same cached blocks, as the text.
    let long = "abcd".repeat(64);
    let ids = post(f.base, "/tokenize", &serde_json::json!({"prompt": long})).json()["tokens"].clone();
    completion(f.base, serde_json::json!({"prompt": long, "max_tokens": 1}));
    let by_ids = completion(f.base, serde_json::json!({"prompt": ids, "max_tokens": 1})).json();
    assert_eq!(by_ids["usage"]["prompt_tokens"], 64);
    assert_eq!(
        by_ids["usage"]["prompt_tokens_details"]["cached_tokens"], 48,
        "3 of 4 blocks (one token is always computed)"
    );
    let unknown = post(
        f.base,
        "/tokenize",
        &serde_json::json!({"model": "nope", "prompt": "x"}),
    );
    assert_eq!(
        (unknown.status, unknown.json()["error"]["param"].as_str()),
        (404, Some("model"))
    );
}

#[test]
fn inter_token_latency_is_observed_per_token_and_request_histograms_per_request() {
    let f = fleet(1);
    chat(f.base, serde_json::json!({"max_tokens": 5}));
    let text = send(f.base, "GET", "/metrics", b"").body;
    let sample = |name: &str| -> f64 {
        let line = text
            .lines()
            .find(|l| l.starts_with(&format!("{name}{{")))
            .unwrap_or_else(|| panic!("no {name}"));
        line.rsplit(' ').next().unwrap().parse().unwrap()
    };
    assert_eq!(
        sample("vllm:inter_token_latency_seconds_count"),
        4.0,
        "5 tokens, 4 gaps"
    );
    assert_eq!(sample("vllm:request_generation_tokens_count"), 1.0);
    assert_eq!(sample("vllm:request_generation_tokens_sum"), 5.0);
    assert_eq!(
        sample("vllm:request_prefill_kv_computed_tokens_sum"),
        sample("vllm:request_prompt_tokens_sum")
    );
    assert_eq!(
        sample("vllm:iteration_tokens_total_count"),
        5.0,
        "a prefill step then 4 decode steps"
    );
    for family in ["queue", "prefill", "decode", "inference"] {
        assert_eq!(
            sample(&format!("vllm:request_{family}_time_seconds_count")),
            1.0,
            "{family}"
        );
    }
}

#[test]
fn admission_limits_refuse_with_503_before_any_work_as_vllm_does() {
    let f = fleet(1);
    let admission = |limits: &str| {
        let a = send(f.base - 1, "POST", "/servers/0/admission", limits.as_bytes());
        assert_eq!(a.status, 200, "{}", a.body);
    };
    admission(r#"{"max_num_queued_reqs": 1}"#);
    // One long generation (20,000 tokens ≈ 3 s at time scale 50) takes the only place.
    let port = f.base;
    let long = std::thread::spawn(move || chat(port, serde_json::json!({"max_tokens": 20_000})));
    std::thread::sleep(Duration::from_millis(300));
    let refused = chat(f.base, serde_json::json!({"max_tokens": 4}));
    assert_eq!(refused.status, 503, "{}", refused.body);
    let e = &refused.json()["error"];
    assert_eq!(
        (e["type"].as_str(), e["code"].as_u64()),
        (Some("Service Unavailable"), Some(503))
    );
    assert!(
        e["param"].is_null() && e["message"].as_str().unwrap().contains("busy"),
        "{e}"
    );

    // Prompt tokens of the sequences still in prefill, before this one: the long request
    // decodes, so none are, and a prompt longer than the limit is admitted (vLLM does not
    // count the new prompt); at a limit of 0 nothing is.
    admission(r#"{"max_num_queued_tokens": 100}"#);
    let big = "many words in this prompt ".repeat(40);
    let a = chat(
        f.base,
        serde_json::json!({"max_tokens": 4, "messages": [{"role": "user", "content": big}]}),
    );
    assert_eq!(a.status, 200, "{}", a.body);
    admission(r#"{"max_num_queued_tokens": 0}"#);
    let refused = chat(f.base, serde_json::json!({"max_tokens": 4}));
    assert_eq!(refused.status, 503, "{}", refused.body);
    assert!(
        refused.json()["error"]["message"].as_str().unwrap().contains("backlog"),
        "{}",
        refused.body
    );
    admission("{}");
    assert_eq!(long.join().unwrap().status, 200);
    let m = send(f.base, "GET", "/metrics", b"").body;
    let successes: f64 = m
        .lines()
        .filter(|l| l.starts_with("vllm:request_success_total{"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum();
    assert_eq!(successes, 2.0, "refused requests never reached the engine");
    for (reason, n) in [("max_num_queued_reqs", 1), ("max_num_queued_tokens", 1)] {
        let line = format!("vllm:admission_rejections_total{{model_name=\"{MODEL}\",reason=\"{reason}\"}} {n}.0");
        assert!(m.lines().any(|l| l == line), "{line}");
    }
}

#[test]
fn a_client_that_hangs_up_aborts_its_request_as_vllm_does() {
    let f = fleet(1);
    let sample = |prefix: &str| -> f64 {
        let m = send(f.base, "GET", "/metrics", b"").body;
        let line = m
            .lines()
            .find(|l| l.starts_with(prefix))
            .unwrap_or_else(|| panic!("no {prefix}"));
        line.rsplit(' ').next().unwrap().parse().unwrap()
    };
    let running = || sample("vllm:num_requests_running{");
    let wait_for = |what: &str, until: &dyn Fn() -> bool| {
        let deadline = Instant::now() + Duration::from_secs(2);
        while !until() {
            assert!(Instant::now() < deadline, "{what}");
            std::thread::sleep(Duration::from_millis(10));
        }
    };
    for stream in [false, true] {
        // 20,000 tokens take about 3 s at time scale 50: a client that leaves after the
        // first ones must free the batch long before.
        let body = serde_json::json!({"model": MODEL, "max_tokens": 20_000, "stream": stream,
            "messages": [{"role": "user", "content": "a long answer, please"}]})
        .to_string();
        let mut client = TcpStream::connect(("127.0.0.1", f.base)).unwrap();
        write!(
            client,
            "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
            body.len()
        )
        .unwrap();
        wait_for("the request never ran", &|| running() == 1.0);
        drop(client);
        wait_for("the request still runs after its client left", &|| running() == 0.0);
    }
    assert_eq!(
        sample("vllm:request_success_total{engine=\"0\",finished_reason=\"abort\""),
        2.0
    );
    assert_eq!(
        sample("vllm:request_success_total{engine=\"0\",finished_reason=\"length\""),
        0.0
    );
    // The server goes on serving.
    assert_eq!(chat(f.base, serde_json::json!({"max_tokens": 4})).status, 200);
}

#[test]
fn version_ping_and_unknown_paths_answer_as_vllms_api_server() {
    let f = fleet(1);
    let v = send(f.base, "GET", "/version", b"");
    assert_eq!(
        (v.status, v.json()["version"].as_str()),
        (200, Some(super::VLLM_VERSION))
    );
    assert_eq!(send(f.base, "GET", "/ping", b"").status, 200);
    assert_eq!(send(f.base, "POST", "/ping", b"").status, 200);
    let missing = send(f.base, "GET", "/v1/nothing-here", b"");
    assert_eq!(
        (missing.status, missing.json()["detail"].as_str()),
        (404, Some("Not Found"))
    );
    let wrong = send(f.base, "GET", "/v1/chat/completions", b"");
    assert_eq!(
        (wrong.status, wrong.json()["detail"].as_str()),
        (405, Some("Method Not Allowed"))
    );
}

#[test]
fn ignore_eos_min_tokens_and_stream_options_act_as_in_vllm() {
    let f = fleet(1);
    let tokens = |extra: Value| {
        let a = chat(f.base, extra);
        assert_eq!(a.status, 200, "{}", a.body);
        let j = a.json();
        (
            j["usage"]["completion_tokens"].as_u64().unwrap(),
            j["choices"][0]["finish_reason"].clone(),
        )
    };
    let natural = super::request::NATURAL_STOP_TOKENS;
    assert_eq!(
        tokens(serde_json::json!({"min_tokens": natural + 44})),
        (natural + 44, "stop".into())
    );
    assert_eq!(
        tokens(serde_json::json!({"ignore_eos": true, "max_tokens": natural + 10})),
        (natural + 10, "length".into())
    );
    let refused = chat(f.base, serde_json::json!({"stream_options": {"include_usage": true}}));
    assert_eq!(refused.status, 400, "{}", refused.body);
    let e = &refused.json()["error"];
    assert!(e["message"].as_str().unwrap().contains("stream=True"), "{e}");
    assert_eq!(
        (e["type"].as_str(), e["param"].as_str()),
        (Some("Bad Request"), Some("stream_options"))
    );
}

/// One answer read off a kept-alive connection: the head, then `content-length` bytes.
fn read_answer(s: &mut TcpStream) -> String {
    let mut raw = Vec::new();
    let mut byte = [0u8; 1];
    while !raw.ends_with(b"\r\n\r\n") {
        assert_eq!(s.read(&mut byte).unwrap(), 1, "connection closed mid-answer: {raw:?}");
        raw.push(byte[0]);
    }
    let head = String::from_utf8_lossy(&raw).to_ascii_lowercase();
    let length: usize = head
        .lines()
        .find_map(|l| l.strip_prefix("content-length: "))
        .map_or(0, |v| v.trim().parse().unwrap());
    let mut body = vec![0u8; length];
    s.read_exact(&mut body).unwrap();
    head
}

/// As vLLM's server (uvicorn, `timeout_keep_alive` = `VLLM_HTTP_TIMEOUT_KEEP_ALIVE`, 5 s):
/// a connection is kept between requests, and closed once idle for 5 s. A gateway that
/// keeps idle upstream connections longer (Envoy's default is an hour) may send a request
/// on one the server is closing: the shipped Envoy configs close theirs at 4 s.
#[test]
fn an_idle_connection_is_closed_after_vllms_keep_alive_timeout() {
    let f = fleet(1);
    let mut s = TcpStream::connect(("127.0.0.1", f.base)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(15))).unwrap();
    for _ in 0..2 {
        s.write_all(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n").unwrap();
        let head = read_answer(&mut s);
        assert!(head.starts_with("http/1.1 200"), "{head}");
        std::thread::sleep(Duration::from_millis(1000));
    }
    let idle = Instant::now();
    let mut rest = Vec::new();
    let n = s.read_to_end(&mut rest).unwrap();
    let waited = idle.elapsed();
    assert_eq!(n, 0, "nothing written before the close: {rest:?}");
    assert!(
        (Duration::from_millis(3500)..Duration::from_millis(8000)).contains(&waited),
        "closed {waited:?} after the last answer's second (5 s of idle expected)"
    );
}

/// uvicorn speaks HTTP/1.1 only: a client that opens with HTTP/2's preface (h2c prior
/// knowledge) gets no HTTP/2 connection.
#[test]
fn http2_prior_knowledge_is_not_served() {
    let f = fleet(1);
    let mut s = TcpStream::connect(("127.0.0.1", f.base)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    s.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n").unwrap();
    // An HTTP/2 server would answer with a SETTINGS frame (its 9-byte header: type 4).
    let mut raw = Vec::new();
    let _ = s.read_to_end(&mut raw);
    assert!(
        raw.is_empty() || raw.starts_with(b"HTTP/1.1 "),
        "answered as HTTP/2: {:?}",
        &raw[..raw.len().min(32)]
    );
}

#[test]
fn a_request_without_content_type_is_refused_as_vllm_refuses_it() {
    let f = fleet(1);
    let body = serde_json::json!({"model": MODEL, "prompt": "hi", "max_tokens": 1});
    let a = send_with(f.base, "POST", "/v1/completions", "", body.to_string().as_bytes());
    assert_eq!(a.status, 400, "{}", a.body);
    assert!(a.body.contains("Only 'application/json' is allowed"), "{}", a.body);
    assert_eq!(a.json()["error"]["type"], "Bad Request");
}

/// vLLM answers a body FastAPI cannot read into its request type through its
/// `RequestValidationError` handler (type: the status's phrase), and what its serving code
/// refuses with that code's error type.
#[test]
fn a_body_that_does_not_fit_the_request_type_is_a_bad_request_and_a_refused_request_a_bad_request_error() {
    let f = fleet(1);
    let hello = serde_json::json!([{"role": "user", "content": "hi"}]);
    let unreadable: [(&str, Vec<u8>); 8] = [
        ("/v1/chat/completions", b"{\"model\": ".to_vec()),
        ("/v1/chat/completions", b"[1, 2]".to_vec()),
        (
            "/v1/chat/completions",
            serde_json::json!({"model": MODEL}).to_string().into(),
        ),
        (
            "/v1/chat/completions",
            serde_json::json!({"messages": hello, "max_tokens": "x"})
                .to_string()
                .into(),
        ),
        (
            "/v1/chat/completions",
            serde_json::json!({"messages": hello, "model": 5}).to_string().into(),
        ),
        (
            "/v1/chat/completions",
            serde_json::json!({"messages": [{"role": "user", "content": 5}]})
                .to_string()
                .into(),
        ),
        (
            "/v1/completions",
            serde_json::json!({"model": MODEL}).to_string().into(),
        ),
        (
            "/v1/responses",
            serde_json::json!({"input": "hi", "background": "maybe"})
                .to_string()
                .into(),
        ),
    ];
    for (path, body) in unreadable {
        let a = send(f.base, "POST", path, &body);
        assert_eq!(a.status, 400, "{path} {}: {}", String::from_utf8_lossy(&body), a.body);
        let e = &a.json()["error"];
        assert_eq!(
            (e["type"].as_str(), e["code"].as_u64()),
            (Some("Bad Request"), Some(400)),
            "{e}"
        );
        assert!(e["param"].is_null() && e["message"].is_string(), "{e}");
    }
    let tokenize = send(f.base, "POST", "/tokenize", b"not json");
    assert_eq!(
        (tokenize.status, tokenize.json()["error"]["type"].as_str()),
        (400, Some("Bad Request"))
    );
    // Read, then refused: an empty conversation (no message for the chat template) and a prompt
    // over the context.
    for extra in [
        serde_json::json!({"messages": []}),
        serde_json::json!({"max_tokens": 200_000}),
    ] {
        let a = chat(f.base, extra.clone());
        assert_eq!(a.status, 400, "{extra}: {}", a.body);
        assert_eq!(a.json()["error"]["type"], "BadRequestError", "{extra}");
    }
}

#[test]
fn a_batch_of_prompts_reports_the_cached_tokens_of_its_last_prompt() {
    let f = fleet(1);
    let long = "abcd".repeat(64);
    completion(f.base, serde_json::json!({"prompt": long, "max_tokens": 1}));
    let cached = |prompt: Value| {
        completion(f.base, serde_json::json!({"prompt": prompt, "max_tokens": 1})).json()["usage"]
            ["prompt_tokens_details"]["cached_tokens"]
            .clone()
    };
    assert_eq!(cached(serde_json::json!(["a fresh prompt", long])), 48);
    assert_eq!(
        cached(serde_json::json!([long, "another fresh prompt"])),
        Value::Null,
        "a miss has no details"
    );
}

/// A Responses API request: `{"model", "input": "hello there"}` with `extra`'s fields.
fn respond(port: u16, extra: Value) -> Answer {
    let mut body = serde_json::json!({"model": MODEL, "input": "hello there"});
    merge(&mut body, extra);
    post(port, "/v1/responses", &body)
}

/// The keys of the JSON object `body`, in the order it writes them.
fn keys_in_order(body: &str) -> Vec<String> {
    struct Keys;
    impl<'de> serde::de::Visitor<'de> for Keys {
        type Value = Vec<String>;
        fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            f.write_str("an object")
        }
        fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<Vec<String>, A::Error> {
            let mut keys = Vec::new();
            while let Some((k, _)) = map.next_entry::<String, serde::de::IgnoredAny>()? {
                keys.push(k);
            }
            Ok(keys)
        }
    }
    let mut de = serde_json::Deserializer::from_str(body);
    serde::Deserializer::deserialize_map(&mut de, Keys).unwrap()
}

fn is_hex_id(id: &str, prefix: &str) -> bool {
    id.strip_prefix(prefix)
        .is_some_and(|hex| hex.len() == 32 && hex.chars().all(|c| c.is_ascii_hexdigit()))
}

#[test]
fn a_whole_response_has_vllms_fields_in_order_with_usage_last_but_one() {
    let f = fleet(1);
    let a = respond(
        f.base,
        serde_json::json!({"instructions": "be brief", "max_output_tokens": 5}),
    );
    assert_eq!(a.status, 200, "{}", a.body);
    assert!(
        a.head.contains(&format!("x-served-by: 127.0.0.1:{}", f.base)),
        "{}",
        a.head
    );
    assert_eq!(
        keys_in_order(&a.body),
        [
            "id",
            "created_at",
            "incomplete_details",
            "instructions",
            "metadata",
            "model",
            "object",
            "output",
            "parallel_tool_calls",
            "temperature",
            "tool_choice",
            "tools",
            "top_p",
            "background",
            "max_output_tokens",
            "max_tool_calls",
            "previous_response_id",
            "prompt",
            "reasoning",
            "service_tier",
            "status",
            "text",
            "top_logprobs",
            "truncation",
            "usage",
            "user",
        ]
    );
    let r = a.json();
    assert!(is_hex_id(r["id"].as_str().unwrap(), "resp_"), "{r}");
    assert!(r["created_at"].as_u64().unwrap() > 1_700_000_000);
    assert_eq!(
        (r["object"].as_str(), r["model"].as_str()),
        (Some("response"), Some(MODEL))
    );
    assert_eq!(r["instructions"], "be brief");
    assert_eq!(r["status"], "incomplete", "stopped by max_output_tokens");
    assert_eq!(
        r["incomplete_details"],
        serde_json::json!({"reason": "max_output_tokens"})
    );
    assert_eq!(r["max_output_tokens"], 5);
    let message = &r["output"][0];
    assert!(is_hex_id(message["id"].as_str().unwrap(), "msg_"), "{message}");
    assert_eq!(
        (&message["type"], &message["role"], &message["status"]),
        (&"message".into(), &"assistant".into(), &"completed".into())
    );
    assert_eq!(
        message["content"],
        serde_json::json!([{"annotations": [], "text": " tok".repeat(5), "type": "output_text", "logprobs": null}])
    );
    // The prompt is the chat prompt of the same messages, as /tokenize counts it.
    let messages =
        serde_json::json!([{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]);
    let input = post(f.base, "/tokenize", &serde_json::json!({"messages": messages})).json()["count"].clone();
    assert_eq!(
        r["usage"],
        serde_json::json!({"input_tokens": input, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": 5,
            "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": input.as_u64().unwrap() + 5})
    );

    // Without max_output_tokens it stops by itself, as a chat request does.
    let r = respond(f.base, serde_json::json!({})).json();
    assert_eq!(
        (r["status"].as_str(), &r["incomplete_details"]),
        (Some("completed"), &Value::Null)
    );
    assert_eq!(r["usage"]["output_tokens"], super::request::NATURAL_STOP_TOKENS);
}

#[test]
fn a_response_stream_sends_vllms_events_in_order_with_sequence_numbers_and_no_done() {
    let f = fleet(1);
    let a = respond(f.base, serde_json::json!({"stream": true, "max_output_tokens": 3}));
    assert_eq!(a.status, 200, "{}", a.body);
    assert!(a.head.contains("content-type: text/event-stream"), "{}", a.head);
    assert!(!a.body.contains("[DONE]"), "{}", a.body);
    let events = a.events();
    let names: Vec<&str> = events.iter().map(|(n, _)| n.as_str()).collect();
    let delta = "response.output_text.delta";
    assert_eq!(
        names,
        [
            "response.created",
            "response.in_progress",
            "response.output_item.added",
            "response.content_part.added",
            delta,
            delta,
            delta,
            "response.output_text.done",
            "response.content_part.done",
            "response.output_item.done",
            "response.completed",
        ]
    );
    for (i, (name, e)) in events.iter().enumerate() {
        assert_eq!(
            (e["type"].as_str(), e["sequence_number"].as_u64()),
            (Some(name.as_str()), Some(i as u64))
        );
    }
    let created = &events[0].1["response"];
    assert_eq!(
        (&created["status"], &created["output"], &created["usage"]),
        (&"in_progress".into(), &serde_json::json!([]), &Value::Null)
    );
    let item_id = events[2].1["item"]["id"].clone();
    assert!(is_hex_id(item_id.as_str().unwrap(), "msg_"));
    for (_, e) in &events[4..7] {
        assert_eq!(
            (&e["delta"], &e["item_id"], &e["logprobs"]),
            (&" tok".into(), &item_id, &serde_json::json!([]))
        );
    }
    assert_eq!(events[7].1["text"], " tok".repeat(3));
    let done = &events[10].1["response"];
    assert_eq!((&done["id"], &done["status"]), (&created["id"], &"incomplete".into()));
    assert_eq!(done["output"][0]["content"][0]["text"], " tok".repeat(3));
    assert_eq!(done["usage"]["output_tokens"], 3);
}

/// vLLM sends `response.created` and `response.in_progress` before it has any token: a
/// router must cope with a stream that opened long before its first token.
#[test]
fn a_response_stream_announces_the_response_before_the_first_token() {
    let f = fleet(1);
    // Steps a million times slower: the prompt's prefill would take minutes.
    let slow = send(f.base - 1, "POST", "/servers/0/fault", br#"{"slow": 1000000}"#);
    assert_eq!(slow.status, 200, "{}", slow.body);
    let body = serde_json::json!({"model": MODEL, "input": "hello there", "stream": true}).to_string();
    let mut s = TcpStream::connect(("127.0.0.1", f.base)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    write!(
        s,
        "POST /v1/responses HTTP/1.1\r\nhost: x\r\n{JSON}content-length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut raw = Vec::new();
    let mut buf = [0u8; 4096];
    while !String::from_utf8_lossy(&raw).contains(r#""type":"response.in_progress"}"#) {
        let n = s
            .read(&mut buf)
            .expect("response.in_progress did not come before the first token");
        assert!(n > 0, "closed: {}", String::from_utf8_lossy(&raw));
        raw.extend_from_slice(&buf[..n]);
    }
    let text = String::from_utf8_lossy(&raw).to_string();
    assert!(text.starts_with("HTTP/1.1 200"), "{text}");
    let created = text.find("event: response.created\ndata: ").unwrap();
    assert!(created < text.find("event: response.in_progress\ndata: ").unwrap());
    // Nothing else comes while the engine has no token.
    s.set_read_timeout(Some(Duration::from_millis(500))).unwrap();
    let more = s.read(&mut buf);
    assert!(more.is_err(), "more arrived before any token: {more:?}");
    assert!(!text.contains("response.output_item.added"), "{text}");
}

#[test]
fn with_the_store_on_a_follow_up_hits_the_stored_conversation_and_it_can_be_read_but_not_cancelled() {
    let f = fleet_storing(1);
    // 250 bytes of text: a canonical prompt of 256 bytes, 68 tokens, 4 whole blocks.
    let text = format!("{}ab", "abcd".repeat(62));
    let first = respond(f.base, serde_json::json!({"input": text, "max_output_tokens": 4}));
    assert_eq!(first.status, 200, "{}", first.body);
    let r = first.json();
    let id = r["id"].as_str().unwrap();
    let prompt_tokens = r["usage"]["input_tokens"].as_u64().unwrap();
    assert_eq!(prompt_tokens, 68);

    let own = respond(
        f.base,
        serde_json::json!({"input": "and then?", "max_output_tokens": 1}),
    )
    .json()["usage"]["input_tokens"]
        .as_u64()
        .unwrap();
    let next = respond(
        f.base,
        serde_json::json!({"input": "and then?", "previous_response_id": id, "max_output_tokens": 2}),
    );
    assert_eq!(next.status, 200, "{}", next.body);
    let n = next.json();
    assert_eq!(n["previous_response_id"], id);
    assert_eq!(
        n["usage"]["input_tokens"].as_u64().unwrap(),
        prompt_tokens + 4 + own,
        "the history (prompt and output) counts"
    );
    let cached = n["usage"]["input_tokens_details"]["cached_tokens"].as_u64().unwrap();
    assert!(cached >= prompt_tokens / 16 * 16, "{cached} cached: {}", next.body);

    let got = send(f.base, "GET", &format!("/v1/responses/{id}"), b"");
    assert_eq!((got.status, got.body.as_str()), (200, first.body.as_str()));
    assert!(got.head.contains("x-served-by: "), "{}", got.head);
    // A body's request_id names the response, and the stored response is found by it.
    let named = respond(
        f.base,
        serde_json::json!({"input": "hi", "max_output_tokens": 1, "request_id": "resp_mine"}),
    );
    assert_eq!(named.json()["id"], "resp_mine", "{}", named.body);
    assert_eq!(send(f.base, "GET", "/v1/responses/resp_mine", b"").status, 200);
    let cancel = send(f.base, "POST", &format!("/v1/responses/{id}/cancel"), b"");
    assert_eq!(cancel.status, 400);
    assert_eq!(
        cancel.json(),
        serde_json::json!({"error": {"message": "Cannot cancel a synchronous response.", "type": "invalid_request_error", "param": "response_id", "code": 400}})
    );
    assert_eq!(
        send(f.base, "POST", "/v1/responses/resp_unknown/cancel", b"").status,
        404
    );

    // A streamed response is kept as `response.completed` gave it; `store: false` is not.
    let streamed = respond(f.base, serde_json::json!({"stream": true, "max_output_tokens": 2})).events();
    let completed = &streamed.last().unwrap().1["response"];
    let got = send(
        f.base,
        "GET",
        &format!("/v1/responses/{}", completed["id"].as_str().unwrap()),
        b"",
    );
    assert_eq!(&got.json(), completed);
    let unstored = respond(f.base, serde_json::json!({"store": false, "max_output_tokens": 1})).json();
    let got = send(
        f.base,
        "GET",
        &format!("/v1/responses/{}", unstored["id"].as_str().unwrap()),
        b"",
    );
    assert_eq!(got.status, 404);

    let background = respond(f.base, serde_json::json!({"background": true}));
    assert_eq!(background.status, 400, "{}", background.body);
    let e = &background.json()["error"];
    assert_eq!(e["param"], "background");
    assert!(e["message"].as_str().unwrap().contains("does not model"), "{e}");
}

#[test]
fn with_the_store_off_as_vllm_by_default_follow_ups_and_reads_are_404() {
    let f = fleet(1);
    let first = respond(f.base, serde_json::json!({"max_output_tokens": 2})).json();
    let id = first["id"].as_str().unwrap();
    let not_found = serde_json::json!({"error": {"message": format!("Response with id '{id}' not found."),
        "type": "invalid_request_error", "param": "response_id", "code": 404}});
    let next = respond(f.base, serde_json::json!({"previous_response_id": id}));
    assert_eq!((next.status, next.json()), (404, not_found.clone()));
    let got = send(f.base, "GET", &format!("/v1/responses/{id}"), b"");
    assert_eq!((got.status, got.json()), (404, not_found.clone()));
    let cancel = send(f.base, "POST", &format!("/v1/responses/{id}/cancel"), b"");
    assert_eq!((cancel.status, cancel.json()), (404, not_found));

    let background = respond(f.base, serde_json::json!({"background": true}));
    assert_eq!(background.status, 400);
    assert_eq!(
        background.json(),
        serde_json::json!({"error": {"message": "This vLLM engine does not support `store=True` and therefore does not \
            support the background mode. To enable these features, set the environment variable \
            `VLLM_ENABLE_RESPONSES_API_STORE=1` when launching the vLLM server.",
            "type": "invalid_request_error", "param": "background", "code": 400}})
    );
    for (extra, status, param) in [
        (serde_json::json!({"max_output_tokens": 0}), 400, Some("max_tokens")),
        (serde_json::json!({"-input": null}), 400, None),
        (serde_json::json!({"model": "gpt-4"}), 404, Some("model")),
    ] {
        let a = respond(f.base, extra.clone());
        assert_eq!(
            (a.status, a.json()["error"]["param"].as_str()),
            (status, param),
            "{extra}: {}",
            a.body
        );
    }
}

/// The store is each server's own: only the server that answered can continue a response,
/// which is what the router's response affinity must respect.
#[test]
fn a_follow_up_sent_to_another_server_of_the_fleet_is_404() {
    let f = fleet_storing(2);
    let first = respond(f.base, serde_json::json!({"max_output_tokens": 2})).json();
    let id = first["id"].as_str().unwrap();
    let follow_up = serde_json::json!({"input": "more", "previous_response_id": id, "max_output_tokens": 2});
    let elsewhere = respond(f.base + 1, follow_up.clone());
    assert_eq!(elsewhere.status, 404, "{}", elsewhere.body);
    assert!(elsewhere
        .head
        .contains(&format!("x-served-by: 127.0.0.1:{}", f.base + 1)));
    assert_eq!(send(f.base + 1, "GET", &format!("/v1/responses/{id}"), b"").status, 404);
    assert_eq!(respond(f.base, follow_up).status, 200);
}

mod messages;

//! Anthropic's Messages API (`POST /v1/messages`) against what vLLM 0.33 answers, and the
//! prefix it shares with the same conversation sent as chat.

use serde_json::{json, Value};

use super::super::request::NATURAL_STOP_TOKENS;
use super::*;
use crate::tokens::{render, Segment};

/// A Messages API request: `{"model", "max_tokens": 16, "messages": [user "hello there"]}`
/// with `extra`'s fields.
fn message(port: u16, extra: Value) -> Answer {
    let mut body = json!({"model": MODEL, "max_tokens": 16, "messages": [{"role": "user", "content": "hello there"}]});
    merge(&mut body, extra);
    post(port, "/v1/messages", &body)
}

/// The prompt tokens of these chat messages, as `/tokenize` counts them.
fn chat_prompt_tokens(port: u16, messages: Value) -> u64 {
    let t = post(port, "/tokenize", &json!({"messages": messages})).json();
    t["count"].as_u64().unwrap()
}

/// The finished requests `/metrics` counts with this `finished_reason`.
fn finished(port: u16, reason: &str) -> f64 {
    let label = format!("finished_reason=\"{reason}\"");
    send(port, "GET", "/metrics", b"")
        .body
        .lines()
        .filter(|l| l.starts_with("vllm:request_success_total{") && l.contains(&label))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

#[test]
fn a_whole_message_has_vllms_fields_in_order_and_the_chat_prompts_usage() {
    let f = fleet(1);
    let a = message(f.base, json!({"system": "be brief", "max_tokens": 5}));
    assert_eq!(a.status, 200, "{}", a.body);
    assert!(a.head.contains("content-type: application/json"), "{}", a.head);
    assert!(
        a.head.contains(&format!("x-served-by: 127.0.0.1:{}", f.base)),
        "{}",
        a.head
    );
    assert_eq!(
        keys_in_order(&a.body),
        ["id", "type", "role", "content", "model", "stop_reason", "usage"],
        "pydantic's order, None (stop_sequence) left out"
    );
    let m = a.json();
    assert!(
        is_hex_id(m["id"].as_str().unwrap(), "chatcmpl-"),
        "the chat request's id: {m}"
    );
    assert_eq!(
        (m["type"].as_str(), m["role"].as_str(), m["model"].as_str()),
        (Some("message"), Some("assistant"), Some(MODEL))
    );
    assert_eq!(m["content"], json!([{"type": "text", "text": " tok".repeat(5)}]));
    assert_eq!(m["stop_reason"], "max_tokens");
    let input = chat_prompt_tokens(
        f.base,
        json!([{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]),
    );
    assert_eq!(
        m["usage"],
        json!({"input_tokens": input, "output_tokens": 5}),
        "the chat prompt's tokens; a miss has no cache fields"
    );

    let body = json!({"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]});
    let named = send_with(
        f.base,
        "POST",
        "/v1/messages",
        &format!("{JSON}x-request-id: abc-123\r\n"),
        body.to_string().as_bytes(),
    );
    assert_eq!(
        named.json()["id"],
        "chatcmpl-abc-123",
        "named as vLLM names the chat request"
    );
}

#[test]
fn max_tokens_reached_is_stop_reason_max_tokens_and_a_model_that_stops_first_ends_its_turn() {
    let f = fleet(1);
    let outcome = |max_tokens: u64| {
        let m = message(f.base, json!({"max_tokens": max_tokens})).json();
        (
            m["stop_reason"].as_str().map(str::to_string),
            m["usage"]["output_tokens"].as_u64(),
        )
    };
    assert_eq!(outcome(3), (Some("max_tokens".to_string()), Some(3)));
    assert_eq!(
        outcome(NATURAL_STOP_TOKENS),
        (Some("max_tokens".to_string()), Some(NATURAL_STOP_TOKENS))
    );
    // `max_tokens` is a ceiling clients set high (Claude Code: 32,000): the model stops first.
    assert_eq!(
        outcome(32_000),
        (Some("end_turn".to_string()), Some(NATURAL_STOP_TOKENS))
    );
    assert_eq!(
        (finished(f.base, "length"), finished(f.base, "stop")),
        (2.0, 1.0),
        "the engine's finished_reason agrees"
    );
}

#[test]
fn a_message_stream_sends_vllms_events_byte_for_byte_with_the_final_usage_and_no_done() {
    let f = fleet(1);
    let a = message(f.base, json!({"stream": true, "max_tokens": 3}));
    assert_eq!(a.status, 200, "{}", a.body);
    assert!(a.head.contains("content-type: text/event-stream"), "{}", a.head);
    let events = a.events();
    let names: Vec<&str> = events.iter().map(|(n, _)| n.as_str()).collect();
    let delta = "content_block_delta";
    assert_eq!(
        names,
        [
            "message_start",
            "content_block_start",
            delta,
            delta,
            delta,
            "content_block_stop",
            "message_delta",
            "message_stop",
        ],
        "no ping"
    );
    let id = events[0].1["message"]["id"].as_str().unwrap().to_string();
    assert!(is_hex_id(&id, "chatcmpl-"), "{id}");
    let input = chat_prompt_tokens(f.base, json!([{"role": "user", "content": "hello there"}]));
    let event = |name: &str, data: String| format!("event: {name}\ndata: {data}\n\n");
    let expected = [
        event(
            "message_start",
            format!(
                r#"{{"type":"message_start","message":{{"id":"{id}","type":"message","role":"assistant","content":[],"model":"{MODEL}","stop_reason":null,"stop_sequence":null,"usage":{{"input_tokens":{input},"output_tokens":0}}}}}}"#
            ),
        ),
        event(
            "content_block_start",
            r#"{"type":"content_block_start","content_block":{"type":"text","text":""},"index":0}"#.into(),
        ),
        event(
            delta,
            r#"{"type":"content_block_delta","delta":{"type":"text_delta","text":" tok"},"index":0}"#.into(),
        )
        .repeat(3),
        event("content_block_stop", r#"{"type":"content_block_stop","index":0}"#.into()),
        event(
            "message_delta",
            format!(
                r#"{{"type":"message_delta","delta":{{"stop_reason":"max_tokens","stop_sequence":null}},"usage":{{"input_tokens":{input},"output_tokens":3}}}}"#
            ),
        ),
        event("message_stop", r#"{"type":"message_stop"}"#.into()),
    ]
    .concat();
    assert_eq!(a.body, expected, "no data: [DONE] after message_stop");
}

/// What pydantic refuses in vLLM's `AnthropicMessagesRequest` is answered by the app's
/// validation handler (OpenAI's body, type `Bad Request`); what the serving code refuses, by
/// the Anthropic router in Anthropic's body with vLLM's status and type.
#[test]
fn what_pydantic_refuses_is_a_bad_request_and_what_vllms_code_refuses_comes_in_anthropics_shape() {
    let f = fleet(1);
    let hi = json!([{"role": "user", "content": "hi"}]);
    let unreadable = [
        json!({"model": MODEL, "messages": hi}),
        json!({"model": MODEL, "messages": hi, "max_tokens": null}),
        json!({"model": MODEL, "messages": hi, "max_tokens": 0}),
        json!({"model": MODEL, "messages": hi, "max_tokens": "many"}),
        json!({"messages": hi, "max_tokens": 5}),
        json!({"model": "", "messages": hi, "max_tokens": 5}),
        // Read before the model is looked up: not a 404.
        json!({"model": "nope", "messages": hi}),
        json!({"model": MODEL, "max_tokens": 5}),
        json!({"model": MODEL, "max_tokens": 5, "messages": "hi"}),
        json!({"model": MODEL, "max_tokens": 5, "messages": [{"role": "robot", "content": "hi"}]}),
        json!({"model": MODEL, "max_tokens": 5, "messages": [{"role": "user"}]}),
        json!({"model": MODEL, "max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "text"}]}]}),
        json!({"model": MODEL, "max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "video"}]}]}),
        json!({"model": MODEL, "max_tokens": 5, "messages": [{"role": "assistant", "content": [{"type": "tool_use", "name": "f", "input": {}}]}]}),
        json!({"model": MODEL, "max_tokens": 5, "messages": hi, "system": 5}),
        json!({"model": MODEL, "max_tokens": 5, "messages": hi, "tools": [{"name": "f"}]}),
    ];
    let bad_request = |a: &Answer, what: &str| {
        assert_eq!(a.status, 400, "{what}: {}", a.body);
        let e = &a.json()["error"];
        assert_eq!(
            (e["type"].as_str(), e["code"].as_u64()),
            (Some("Bad Request"), Some(400)),
            "{what}: {e}"
        );
    };
    for body in unreadable {
        bad_request(&post(f.base, "/v1/messages", &body), &body.to_string());
    }
    bad_request(&send(f.base, "POST", "/v1/messages", b"{\"model\": "), "not JSON");
    let hello = json!({"model": MODEL, "max_tokens": 5, "messages": hi}).to_string();
    bad_request(
        &send_with(f.base, "POST", "/v1/messages", "", hello.as_bytes()),
        "no content-type",
    );

    let unknown = message(f.base, json!({"model": "nope"}));
    assert_eq!(unknown.status, 404, "{}", unknown.body);
    assert_eq!(keys_in_order(&unknown.body), ["type", "error"]);
    assert_eq!(
        unknown.json(),
        json!({"type": "error", "error": {"type": "NotFoundError", "message": "The model `nope` does not exist."}})
    );
    for (extra, status, kind, says) in [
        (
            json!({"max_tokens": 200_000}),
            400,
            "BadRequestError",
            "max_tokens=200000cannot be greater than max_model_len",
        ),
        (json!({"messages": []}), 400, "BadRequestError", ""),
    ] {
        let a = message(f.base, extra.clone());
        assert_eq!(a.status, status, "{extra}: {}", a.body);
        let e = a.json();
        assert_eq!(
            (e["type"].as_str(), e["error"]["type"].as_str()),
            (Some("error"), Some(kind))
        );
        assert!(e["error"]["message"].as_str().unwrap().contains(says), "{e}");
        assert_eq!(e["error"].as_object().unwrap().len(), 2, "no param, no code: {e}");
    }

    // What vLLM reads: system blocks, tools, tool use and results, thinking, Claude Code's roles.
    let accepted = json!({"model": MODEL, "max_tokens": 2, "stream": false,
        "system": [{"type": "text", "text": "be brief"}],
        "tools": [{"name": "f", "input_schema": {"type": "object"}}],
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "call f"}]},
            {"role": "assistant", "content": [{"type": "thinking", "thinking": "hmm"},
                {"type": "tool_use", "id": "t1", "name": "f", "input": {}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "42"}]},
            {"role": "ctx", "content": "and?"}]});
    let a = post(f.base, "/v1/messages", &accepted);
    assert_eq!(a.status, 200, "{}", a.body);

    // Admission control refuses it as vLLM's router turns any error of the serving code:
    // Anthropic's body with the status and type vLLM gives it.
    let limits = send(
        f.base - 1,
        "POST",
        "/servers/0/admission",
        br#"{"max_num_queued_tokens": 0}"#,
    );
    assert_eq!(limits.status, 200, "{}", limits.body);
    let refused = message(f.base, json!({}));
    assert_eq!(refused.status, 503, "{}", refused.body);
    let e = refused.json();
    assert_eq!(
        (e["type"].as_str(), e["error"]["type"].as_str()),
        (Some("error"), Some("Service Unavailable"))
    );
    assert!(e["error"]["message"].as_str().unwrap().contains("backlog"), "{e}");
}

/// vLLM runs a Messages request as the chat request it translates it to, through the same
/// engine and prefix cache: the same conversation sent once each way hits the blocks the
/// other computed.
#[test]
fn a_conversation_sent_as_chat_then_as_messages_hits_the_prefix_cache_and_the_other_way_round() {
    let f = fleet(1);
    // Conversation `seed`: its own tool (the tools come first in the prompt) and system prompt.
    let system = |seed: u64| render(&[Segment::new(seed, 600)]);
    let anthropic = |seed: u64| {
        let system = system(seed);
        let (a, b) = system.split_at(system.len() / 2);
        json!({"model": MODEL, "max_tokens": 4,
            "system": [{"type": "text", "text": a}, {"type": "text", "text": b}],
            "tools": [{"name": "f", "description": format!("tool {seed}"), "input_schema": {"type": "object"}}],
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "hello"}]},
                {"role": "assistant", "content": [{"type": "text", "text": "calling"},
                    {"type": "tool_use", "id": "t1", "name": "f", "input": {}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "42"},
                    {"type": "text", "text": "and?"}]}]})
    };
    let chat = |seed: u64| {
        json!({"model": MODEL, "max_tokens": 4,
            "tools": [{"type": "function", "function": {"name": "f", "description": format!("tool {seed}"),
                "parameters": {"type": "object"}}}],
            "messages": [{"role": "system", "content": system(seed)}, {"role": "user", "content": "hello"},
                {"role": "assistant", "content": "calling",
                    "tool_calls": [{"id": "t1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
                {"role": "tool", "tool_call_id": "t1", "content": "42"}, {"role": "user", "content": "and?"}]})
    };
    let cached_of_chat = |seed: u64| {
        let usage = post(f.base, "/v1/chat/completions", &chat(seed)).json()["usage"].clone();
        (
            usage["prompt_tokens"].as_u64().unwrap(),
            usage["prompt_tokens_details"]["cached_tokens"].as_u64(),
        )
    };
    let usage_of_messages = |body: &Value| post(f.base, "/v1/messages", body).json()["usage"].clone();

    // Chat first, then Messages (whole and streamed), then chat again: Messages hits every
    // block a repeat of the chat request hits.
    let (prompt, cold) = cached_of_chat(7);
    assert_eq!(cold, None, "a cold cache");
    let usage = usage_of_messages(&anthropic(7));
    let (_, repeat) = cached_of_chat(7);
    let cached = repeat.unwrap();
    assert!(cached > 600, "the system prompt's blocks at least: {cached}");
    assert_eq!(
        usage,
        json!({"input_tokens": prompt - cached, "output_tokens": 4, "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached}),
        "the chat prompt, as cached as by chat itself"
    );
    let mut streamed = anthropic(7);
    streamed["stream"] = json!(true);
    let events = post(f.base, "/v1/messages", &streamed).events();
    assert_eq!(
        events[0].1["message"]["usage"],
        json!({"input_tokens": prompt, "output_tokens": 0}),
        "message_start: chat's opening chunk has no cache details"
    );
    let last = events.iter().find(|(n, _)| n == "message_delta").unwrap();
    assert_eq!(last.1["usage"], usage);

    // Messages first, then chat, on another conversation: chat hits what Messages computed.
    let cold = usage_of_messages(&anthropic(8));
    assert!(cold["cache_read_input_tokens"].is_null(), "a cold cache: {cold}");
    let (prompt, cached) = cached_of_chat(8);
    assert_eq!(cold["input_tokens"], prompt, "the same prompt");
    let cached = cached.unwrap();
    assert!(cached > 600, "the system prompt's blocks at least: {cached}");
    assert_eq!(
        usage_of_messages(&anthropic(8))["cache_read_input_tokens"],
        cached,
        "as much as a repeat of the Messages request"
    );
}

#[test]
fn count_tokens_answers_the_cold_messages_usage_without_max_tokens_or_engine_work() {
    let f = fleet(1);
    let conversation =
        json!({"model": MODEL, "system": "be brief", "messages": [{"role": "user", "content": "count me"}]});
    let count = post(f.base, "/v1/messages/count_tokens", &conversation);
    assert_eq!(count.status, 200, "accepted without max_tokens: {}", count.body);
    assert!(count.head.contains("content-type: application/json"), "{}", count.head);
    let input = count.json()["input_tokens"].as_u64().unwrap();
    assert_eq!(count.json(), json!({"input_tokens": input}), "the only field");
    assert_eq!(
        (finished(f.base, "length"), finished(f.base, "stop")),
        (0.0, 0.0),
        "nothing generated"
    );

    let mut sent = conversation.clone();
    sent["max_tokens"] = json!(1);
    let cold = post(f.base, "/v1/messages", &sent).json();
    assert_eq!(cold["usage"]["input_tokens"].as_u64(), Some(input), "{cold}");

    let refused = post(f.base, "/v1/messages/count_tokens", &json!({"model": MODEL}));
    assert_eq!(refused.status, 400, "{}", refused.body);
    assert_eq!(refused.json()["error"]["type"], "Bad Request");
    let unknown = post(
        f.base,
        "/v1/messages/count_tokens",
        &json!({"model": "nope", "messages": [{"role": "user", "content": "hi"}]}),
    );
    assert_eq!(unknown.status, 404, "{}", unknown.body);
    assert_eq!(unknown.json()["error"]["type"], "NotFoundError", "Anthropic's body");
}

//! The Responses API's answer as vLLM 0.33 writes it: the response object (vLLM's
//! `ResponsesResponse`, fields in the order pydantic dumps them, so `usage` comes last but
//! one, where a router reading the body's tail finds it) and the stream's events.
//!
//! A stream writes each event as `event: <type>\ndata: <compact JSON>\n\n`, every event with
//! its `type` and a `sequence_number` counting from 0, and no `data: [DONE]`.
//! `response.created` and `response.in_progress` (the response `in_progress`, no output, no
//! usage) leave at once, before the first token, as vLLM sends them; at the first token
//! `response.output_item.added` and `response.content_part.added`; one
//! `response.output_text.delta` per token; at the end `response.output_text.done`,
//! `response.content_part.done`, `response.output_item.done`, then `response.completed`
//! with the whole response.
//!
//! A response stopped by `max_output_tokens` is `incomplete` with `incomplete_details:
//! {"reason": "max_output_tokens"}`. The fields vLLM copies from the request are copied
//! from it (`instructions`, `metadata`, `tools`, `temperature`, …, each with vLLM's default
//! when absent; `temperature` and `top_p` default to 1.0, where vLLM would take the model's
//! generation config); `max_output_tokens` is the limit generation ran under (the request's,
//! cut to the context's room, or the room). A response to be stored is stored before its
//! last byte leaves, so a follow-up sent after it always finds it.

use std::sync::Arc;

use axum::response::{IntoResponse, Response};
use axum::Json;
use bytes::Bytes;
use serde::Serialize;
use serde_json::{json, Map, Value};

use super::super::answer::{Answer, TOKEN_TEXT};
use super::super::errors::ApiError;
use super::super::request::Prompt;
use super::super::SimServer;
use super::store::Stored;
use crate::engine::Finished;

/// vLLM's `ResponsesResponse`, fields in its order.
#[derive(Clone, Debug, Serialize)]
pub struct ResponseObject {
    id: String,
    created_at: u64,
    incomplete_details: Option<Value>,
    instructions: Value,
    metadata: Value,
    model: String,
    object: &'static str,
    output: Vec<Message>,
    parallel_tool_calls: Value,
    temperature: Value,
    tool_choice: Value,
    tools: Value,
    top_p: Value,
    background: bool,
    max_output_tokens: u64,
    max_tool_calls: Value,
    previous_response_id: Value,
    prompt: Value,
    reasoning: Value,
    service_tier: Value,
    status: &'static str,
    text: Value,
    top_logprobs: Value,
    truncation: Value,
    usage: Option<Value>,
    user: Value,
}

impl ResponseObject {
    /// The response as created (`in_progress`, no output, no usage) for a request `body`.
    pub fn created(
        id: String,
        created_at: u64,
        model: String,
        body: &Map<String, Value>,
        max_output_tokens: u64,
    ) -> Self {
        let echo = |name: &str, default: Value| body.get(name).filter(|v| !v.is_null()).cloned().unwrap_or(default);
        ResponseObject {
            id,
            created_at,
            incomplete_details: None,
            instructions: echo("instructions", Value::Null),
            metadata: echo("metadata", Value::Null),
            model,
            object: "response",
            output: Vec::new(),
            parallel_tool_calls: echo("parallel_tool_calls", Value::Bool(true)),
            temperature: echo("temperature", json!(1.0)),
            tool_choice: echo("tool_choice", json!("auto")),
            tools: echo("tools", json!([])),
            top_p: echo("top_p", json!(1.0)),
            background: false,
            max_output_tokens,
            max_tool_calls: echo("max_tool_calls", Value::Null),
            previous_response_id: echo("previous_response_id", Value::Null),
            prompt: echo("prompt", Value::Null),
            reasoning: echo("reasoning", Value::Null),
            service_tier: echo("service_tier", json!("auto")),
            status: "in_progress",
            text: echo("text", Value::Null),
            top_logprobs: echo("top_logprobs", Value::Null),
            truncation: echo("truncation", json!("disabled")),
            usage: None,
            user: echo("user", Value::Null),
        }
    }
}

/// The assistant's message (vLLM's `ResponseOutputMessage`).
#[derive(Clone, Debug, Serialize)]
struct Message {
    id: String,
    content: Vec<OutputText>,
    role: &'static str,
    status: &'static str,
    #[serde(rename = "type")]
    kind: &'static str,
}

#[derive(Clone, Debug, Serialize)]
struct OutputText {
    annotations: [Value; 0],
    text: String,
    #[serde(rename = "type")]
    kind: &'static str,
    logprobs: Option<Value>,
}

impl OutputText {
    fn new(text: String) -> OutputText {
        OutputText {
            annotations: [],
            text,
            kind: "output_text",
            logprobs: None,
        }
    }
}

/// One stream event: its fields, then `sequence_number` and `type`.
#[derive(Serialize)]
struct Event<'a, E: Serialize> {
    #[serde(flatten)]
    fields: E,
    sequence_number: u64,
    #[serde(rename = "type")]
    kind: &'a str,
}

#[derive(Serialize)]
struct OfResponse<'a> {
    response: &'a ResponseObject,
}

#[derive(Serialize)]
struct OfItem<'a> {
    item: &'a Message,
    output_index: u32,
}

#[derive(Serialize)]
struct OfPart<'a> {
    content_index: u32,
    item_id: &'a str,
    output_index: u32,
    part: &'a OutputText,
}

#[derive(Serialize)]
struct OfText<'a> {
    content_index: u32,
    #[serde(skip_serializing_if = "Option::is_none")]
    delta: Option<&'a str>,
    item_id: &'a str,
    logprobs: [Value; 0],
    output_index: u32,
    #[serde(skip_serializing_if = "Option::is_none")]
    text: Option<&'a str>,
}

/// A Responses answer: the response as created, where its message goes, and what to store.
pub struct Responding {
    srv: Arc<SimServer>,
    response: ResponseObject,
    item_id: String,
    /// The engine prompt, to store with the output once generated; `None`: not stored.
    keep: Option<Prompt>,
    finish_by_length: bool,
    sequence: u64,
}

impl Responding {
    pub fn new(
        srv: Arc<SimServer>,
        response: ResponseObject,
        item_id: String,
        keep: Option<Prompt>,
        finish_by_length: bool,
    ) -> Responding {
        Responding {
            srv,
            response,
            item_id,
            keep,
            finish_by_length,
            sequence: 0,
        }
    }

    fn message(&self, content: Vec<OutputText>, status: &'static str) -> Message {
        Message {
            id: self.item_id.clone(),
            content,
            role: "assistant",
            status,
            kind: "message",
        }
    }

    /// Writes one event with the next sequence number.
    fn emit(&mut self, out: &mut Vec<u8>, kind: &str, fields: impl Serialize) {
        let event = Event {
            fields,
            sequence_number: self.sequence,
            kind,
        };
        self.sequence += 1;
        out.extend_from_slice(b"event: ");
        out.extend_from_slice(kind.as_bytes());
        out.extend_from_slice(b"\ndata: ");
        // Writing these types into memory cannot fail.
        let _ = serde_json::to_writer(&mut *out, &event);
        out.extend_from_slice(b"\n\n");
    }

    /// The response once generated (one sequence: `finished[0]`), stored when it is to be.
    fn finish(&mut self, finished: &[Finished]) -> ResponseObject {
        let (input, output, cached) = finished
            .first()
            .map_or((0, 0, 0), |f| (f.prompt_tokens, f.output_tokens, f.cached_tokens));
        let text = TOKEN_TEXT.repeat(output as usize);
        let mut r = self.response.clone();
        r.status = if self.finish_by_length {
            "incomplete"
        } else {
            "completed"
        };
        r.incomplete_details = self.finish_by_length.then(|| json!({"reason": "max_output_tokens"}));
        r.output = vec![self.message(vec![OutputText::new(text.clone())], "completed")];
        r.usage = Some(json!({
            "input_tokens": input,
            "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": output,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": input + output,
        }));
        if let Some(prompt) = self.keep.take() {
            let mut conversation = prompt.canonical;
            conversation.extend_from_slice(text.as_bytes());
            let stored = Stored {
                body: Bytes::from(serde_json::to_vec(&r).unwrap_or_default()),
                conversation,
                tokens: prompt.tokens + output,
            };
            self.srv.responses.put(r.id.clone(), stored);
        }
        r
    }
}

impl Answer for Responding {
    fn whole(&mut self, finished: Vec<Finished>) -> Response {
        Json(self.finish(&finished)).into_response()
    }

    fn opening(&mut self, out: &mut Vec<u8>) {
        let response = self.response.clone();
        for kind in ["response.created", "response.in_progress"] {
            self.emit(out, kind, OfResponse { response: &response });
        }
    }

    fn token(&mut self, _seq: u64, nth: u64, out: &mut Vec<u8>) {
        let item_id = self.item_id.clone();
        if nth == 1 {
            let item = self.message(Vec::new(), "in_progress");
            self.emit(
                out,
                "response.output_item.added",
                OfItem {
                    item: &item,
                    output_index: 0,
                },
            );
            let part = OutputText::new(String::new());
            self.emit(
                out,
                "response.content_part.added",
                OfPart {
                    content_index: 0,
                    item_id: &item_id,
                    output_index: 0,
                    part: &part,
                },
            );
        }
        let delta = OfText {
            content_index: 0,
            delta: Some(TOKEN_TEXT),
            item_id: &item_id,
            logprobs: [],
            output_index: 0,
            text: None,
        };
        self.emit(out, "response.output_text.delta", delta);
    }

    fn end(&mut self, finished: &[Finished], out: &mut Vec<u8>) {
        let response = self.finish(finished);
        let item_id = self.item_id.clone();
        let Some(item) = response.output.first() else {
            return;
        };
        let part = item
            .content
            .first()
            .cloned()
            .unwrap_or_else(|| OutputText::new(String::new()));
        let done = OfText {
            content_index: 0,
            delta: None,
            item_id: &item_id,
            logprobs: [],
            output_index: 0,
            text: Some(&part.text),
        };
        self.emit(out, "response.output_text.done", done);
        self.emit(
            out,
            "response.content_part.done",
            OfPart {
                content_index: 0,
                item_id: &item_id,
                output_index: 0,
                part: &part,
            },
        );
        self.emit(out, "response.output_item.done", OfItem { item, output_index: 0 });
        self.emit(out, "response.completed", OfResponse { response: &response });
    }

    fn failed(&mut self, error: &ApiError, out: &mut Vec<u8>) {
        let fields = json!({"code": error.status.as_u16(), "message": error.message, "param": error.param});
        self.emit(out, "error", fields);
    }
}

//! Anthropic's Messages API as vLLM 0.33 serves it: `POST /v1/messages`
//! (`vllm/entrypoints/anthropic/api_router.py`, `create_messages`; `serving.py`,
//! `AnthropicServingMessages`).
//!
//! vLLM translates the request into the chat request it stands for
//! (`to_chat_completion_request`: the `system` blocks joined into a first system message, text
//! and image blocks as content parts, a user's `tool_result` block as a `tool` message, tools
//! as function tools, `max_tokens` as both `max_tokens` and `max_completion_tokens`, a stream
//! with `include_usage` and `continuous_usage_stats`), runs it through chat's path and
//! translates the answer back. Here the prompt is `kvroute_core::request::parse`'s canonical
//! text of the Anthropic body, byte for byte that of the chat request (`anthropic_canonical`),
//! and it goes to the same engine as chat (`answer::submit`): a conversation sent once as chat
//! and once here hits the same cached blocks, and is batched, cached and timed as chat is.
//!
//! Refusals in vLLM's order: what pydantic refuses in an `AnthropicMessagesRequest`
//! (`protocol.py`: `model` and `max_tokens` required, `model` not empty, `max_tokens`
//! positive, the messages' roles and content blocks with each block type's fields, tools with a
//! `name` and an `input_schema`) is a 400 from FastAPI's validation handler, in the OpenAI
//! error body (that handler serves the whole app); what the serving code refuses (an unknown
//! model 404, the context 400, an empty conversation 400, admission 503) in Anthropic's error
//! body with vLLM's status and type (`translate_error_response`; `errors`).
//!
//! Generation: `max_tokens` is required, so clients send a ceiling (Claude Code 32,000), not a
//! length. The simulated model stops by itself after `NATURAL_STOP_TOKENS` (`end_turn`), as
//! a chat request without `max_tokens` does, unless `max_tokens` comes first (`max_tokens`).
//! Stop sequences, tool calls and thinking are not generated.
//!
//! `POST /v1/messages/count_tokens` (`AnthropicCountTokensRequest`: the same fields, no
//! `max_tokens`) renders the same chat prompt and answers `{"input_tokens": N}`, its token
//! count; nothing reaches the engine.

use std::sync::Arc;

use axum::extract::State;
use axum::http::{header, HeaderMap};
use axum::response::{IntoResponse, Response};
use axum::Json;
use bytes::Bytes;
use kvroute_core::request::ApiKind;
use serde_json::{Map, Value};

use super::errors::ApiError;
use super::request::{self, int_field, Ask};
use super::{answer, request_number, with_server, SimServer};
use shape::Messaging;

mod shape;

/// `POST /v1/messages`.
pub(super) async fn create(State(srv): State<Arc<SimServer>>, headers: HeaderMap, body: Bytes) -> Response {
    let number = match request_number(&srv).await {
        Ok(n) => n,
        Err(r) => return r,
    };
    let content_type = headers.get(header::CONTENT_TYPE).and_then(|v| v.to_str().ok());
    let r = match request::read(ApiKind::Messages, content_type, &body, &srv.served, srv.max_model_len) {
        Ok(ask) => respond(&srv, ask, &headers, number).await,
        Err(e) => e.into_anthropic_response(),
    };
    with_server(r, &srv)
}

/// Runs the request in the engine and answers it, whole or streamed. Its id is the chat
/// request's (`chatcmpl-…`), which vLLM's answer keeps.
async fn respond(srv: &Arc<SimServer>, ask: Ask, headers: &HeaderMap, number: u64) -> Response {
    let sub = match answer::submit(srv, &ask, number) {
        Ok(s) => s,
        Err(e) => return e.into_anthropic_response(),
    };
    let stream = ask.stream;
    let answer = Messaging::new(srv.answer_id("chatcmpl", headers, None, number), ask);
    if stream {
        answer::stream(sub, answer)
    } else {
        answer::whole(sub, answer).await
    }
}

/// `POST /v1/messages/count_tokens`: the prompt's tokens, as `/v1/messages` measures them, with
/// no engine work (so, like `/tokenize`, no request number, fault or metric).
pub(super) async fn count_tokens(State(srv): State<Arc<SimServer>>, headers: HeaderMap, body: Bytes) -> Response {
    let content_type = headers.get(header::CONTENT_TYPE).and_then(|v| v.to_str().ok());
    let r = match count(content_type, &body, &srv.served) {
        Ok(n) => Json(serde_json::json!({"input_tokens": n})).into_response(),
        Err(e) => e.into_anthropic_response(),
    };
    with_server(r, &srv)
}

fn count(content_type: Option<&str>, body: &[u8], served: &[String]) -> Result<u64, ApiError> {
    let mut obj = request::json_object(content_type, body)?;
    check_fields(&obj, false)?;
    request::served_model(&obj, served)?;
    // Not a field of the count request: pydantic ignores it, so `parse` must not refuse it.
    obj.remove("max_tokens");
    Ok(request::prompts(ApiKind::Messages, &obj)?
        .iter()
        .map(|p| p.tokens)
        .sum())
}

const FIELD_REQUIRED: &str = "Field required";

/// Roles an Anthropic message may have: vLLM reads Claude Code's `ctx` and `msg` as `user`
/// (`AnthropicMessage.normalize_role`).
const ROLES: [&str; 5] = ["user", "assistant", "system", "ctx", "msg"];

/// What pydantic refuses in an `AnthropicMessagesRequest` before vLLM's code runs, as
/// [`ApiError::schema`]; the message names the field as pydantic's `loc` does.
pub fn check_body(obj: &Map<String, Value>) -> Result<(), ApiError> {
    check_fields(obj, true)
}

/// [`check_body`], with `max_tokens` checked only where the request type has it.
fn check_fields(obj: &Map<String, Value>, has_max_tokens: bool) -> Result<(), ApiError> {
    match obj.get("model") {
        None => return Err(refused("model", FIELD_REQUIRED)),
        Some(Value::String(m)) if m.is_empty() => return Err(refused("model", "Value error, Model is required")),
        Some(Value::String(_)) => {}
        Some(_) => return Err(refused("model", "Input should be a valid string")),
    }
    if has_max_tokens {
        match int_field(obj, "max_tokens")? {
            _ if !obj.contains_key("max_tokens") => return Err(refused("max_tokens", FIELD_REQUIRED)),
            None => return Err(refused("max_tokens", "Input should be a valid integer")),
            Some(m) if m <= 0 => return Err(refused("max_tokens", "Value error, max_tokens must be positive")),
            Some(_) => {}
        }
    }
    match obj.get("messages") {
        None => return Err(refused("messages", FIELD_REQUIRED)),
        Some(Value::Array(messages)) => {
            for (i, m) in messages.iter().enumerate() {
                check_message(&format!("messages.{i}"), m)?;
            }
        }
        Some(_) => return Err(refused("messages", "Input should be a valid list")),
    }
    match obj.get("system") {
        None | Some(Value::Null | Value::String(_)) => {}
        Some(Value::Array(blocks)) => check_blocks("system", blocks)?,
        Some(_) => return Err(refused("system", "Input should be a valid string")),
    }
    match obj.get("tools") {
        None | Some(Value::Null) => Ok(()),
        Some(Value::Array(tools)) => tools
            .iter()
            .enumerate()
            .try_for_each(|(i, t)| check_tool(&format!("tools.{i}"), t)),
        Some(_) => Err(refused("tools", "Input should be a valid list")),
    }
}

fn refused(loc: &str, why: &str) -> ApiError {
    ApiError::schema(format!("{loc}: {why}"))
}

fn check_message(loc: &str, m: &Value) -> Result<(), ApiError> {
    let Some(m) = m.as_object() else {
        return Err(refused(loc, "Input should be a valid dictionary"));
    };
    match m.get("role").and_then(Value::as_str) {
        Some(role) if ROLES.contains(&role) => {}
        None if !m.contains_key("role") => return Err(refused(&format!("{loc}.role"), FIELD_REQUIRED)),
        _ => {
            return Err(refused(
                &format!("{loc}.role"),
                "Input should be 'user', 'assistant' or 'system'",
            ))
        }
    }
    match m.get("content") {
        None => Err(refused(&format!("{loc}.content"), FIELD_REQUIRED)),
        Some(Value::String(_)) => Ok(()),
        Some(Value::Array(blocks)) => check_blocks(&format!("{loc}.content"), blocks),
        Some(_) => Err(refused(&format!("{loc}.content"), "Input should be a valid string")),
    }
}

/// Content blocks: a known type, with the fields its validator requires
/// (`AnthropicContentBlock`).
fn check_blocks(loc: &str, blocks: &[Value]) -> Result<(), ApiError> {
    for (i, b) in blocks.iter().enumerate() {
        let loc = format!("{loc}.{i}");
        let Some(b) = b.as_object() else {
            return Err(refused(&loc, "Input should be a valid dictionary"));
        };
        let string = |f: &&str| b.get(*f).is_some_and(Value::is_string);
        let named = |f: &&str| b.get(*f).and_then(Value::as_str).is_some_and(|s| !s.is_empty());
        let object = |f: &&str| b.get(*f).is_some_and(Value::is_object);
        let kind = b.get("type").and_then(Value::as_str).unwrap_or("");
        let missing = match kind {
            "text" => ["text"].into_iter().find(|f| !string(f)),
            "image" => ["source"].into_iter().find(|f| !object(f)),
            "tool_use" => ["id", "name"]
                .into_iter()
                .find(|f| !named(f))
                .or(["input"].into_iter().find(|f| !object(f))),
            "tool_result" => ["tool_use_id"].into_iter().find(|f| !named(f)),
            "thinking" => ["thinking"].into_iter().find(|f| !string(f)),
            "redacted_thinking" => ["data"].into_iter().find(|f| !named(f)),
            "tool_reference" => None,
            _ => {
                return Err(refused(
                    &format!("{loc}.type"),
                    "Input should be 'text', 'image', 'tool_use', 'tool_result', 'tool_reference', \
                     'thinking' or 'redacted_thinking'",
                ))
            }
        };
        if let Some(field) = missing {
            return Err(refused(
                &loc,
                &format!("Value error, a {kind} block requires '{field}'"),
            ));
        }
    }
    Ok(())
}

/// A tool (`AnthropicTool`): a `name` and an `input_schema` object.
fn check_tool(loc: &str, t: &Value) -> Result<(), ApiError> {
    let Some(t) = t.as_object() else {
        return Err(refused(loc, "Input should be a valid dictionary"));
    };
    match t.get("name") {
        Some(Value::String(_)) => {}
        None => return Err(refused(&format!("{loc}.name"), FIELD_REQUIRED)),
        Some(_) => return Err(refused(&format!("{loc}.name"), "Input should be a valid string")),
    }
    match t.get("input_schema") {
        Some(Value::Object(_)) => Ok(()),
        None => Err(refused(&format!("{loc}.input_schema"), FIELD_REQUIRED)),
        Some(_) => Err(refused(
            &format!("{loc}.input_schema"),
            "Input should be a valid dictionary",
        )),
    }
}

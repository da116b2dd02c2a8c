//! OpenAI's Responses API as vLLM 0.33 serves it: `POST /v1/responses`,
//! `GET /v1/responses/{id}` and `POST /v1/responses/{id}/cancel`.
//!
//! A request is validated as the other endpoints are (`request::draft`: media type, JSON,
//! model, `max_output_tokens` ≥ 1, `input`); its prompt is `instructions` then `input` read
//! as chat messages (the canonical text of `kvroute_core::request`, which the filter hashes)
//! and it generates as a chat request does: `max_output_tokens` tokens, or until the natural
//! stop. Then, in vLLM's order (`serving_responses.py`, `create_responses`): `background`,
//! the lookup of `previous_response_id`, the prompt's fit in the context.
//!
//! Storing is vLLM's `VLLM_ENABLE_RESPONSES_API_STORE=1`, a per-server option here (`serve
//! --responses-store`, `Options::responses_store`). Off (vLLM's default), `store` is
//! silently ignored: nothing is kept, so `previous_response_id` and `GET` answer 404, and
//! `background: true` is refused with vLLM's message. On, a response whose `store` is not
//! false is kept once generated (`store`, in the server's memory: another server of the
//! fleet does not have it). A follow-up's engine prompt is the stored conversation (its
//! prompt and output) followed by its own prompt, so it hits the prefix cache as on vLLM and
//! its `usage.input_tokens` counts the history. Background mode is not modelled (400), so
//! every stored response is finished and `cancel` gets vLLM's 400 for a synchronous one.
//!
//! Ids are `resp_` and `msg_` with 32 hex digits unique across servers (vLLM:
//! `uuid4().hex`), or the body's `request_id` where it has one; `X-Request-Id` does not name a
//! response.

use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::extract::{Path, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use kvroute_core::request::ApiKind;
use serde_json::{Map, Value};

use super::errors::ApiError;
use super::request::{self, Ask};
use super::{answer, hang_if_faulted, request_number, with_server, SimServer};
use shape::{Responding, ResponseObject};

mod shape;
mod store;
pub use store::ResponseStore;

/// `POST /v1/responses`.
pub(super) async fn create(State(srv): State<Arc<SimServer>>, headers: HeaderMap, body: Bytes) -> Response {
    let number = match request_number(&srv).await {
        Ok(n) => n,
        Err(r) => return r,
    };
    let content_type = headers.get(header::CONTENT_TYPE).and_then(|v| v.to_str().ok());
    let r = match prepare(&srv, content_type, &body, number) {
        Ok((ask, response, stores)) => respond(&srv, ask, response, stores, number).await,
        Err(e) => e.into_response(),
    };
    with_server(r, &srv)
}

/// Validates a request and finds the response it continues: the request, its response as
/// created, and whether it is to be stored.
fn prepare(
    srv: &SimServer,
    content_type: Option<&str>,
    body: &[u8],
    number: u64,
) -> Result<(Ask, ResponseObject, bool), ApiError> {
    let mut draft = request::draft(ApiKind::Responses, content_type, body, &srv.served)?;
    // Absent, `store` is true; `null` is vLLM's `None`, which stores nothing.
    let store = match draft.body.get("store") {
        Some(Value::Null) => false,
        _ => flag(&draft.body, "store")?.unwrap_or(true),
    };
    if flag(&draft.body, "background")?.unwrap_or(false) {
        return Err(background_refused(srv.responses.enabled() || !store));
    }
    match draft.body.get("previous_response_id") {
        None | Some(Value::Null) => {}
        Some(Value::String(id)) => {
            let stored = srv.responses.get(id).ok_or_else(|| ApiError::response_not_found(id))?;
            if let Some(prompt) = draft.prompts.first_mut() {
                *prompt = stored.followed_by(prompt);
            }
        }
        Some(_) => return Err(ApiError::schema("previous_response_id: Input should be a valid string")),
    }
    // vLLM's sampling limit: the request's, cut to the room the prompt leaves, or that room.
    let room = srv
        .max_model_len
        .saturating_sub(draft.prompts.first().map_or(0, |p| p.tokens));
    let max_output_tokens = draft.max_tokens.map_or(room, |m| m.min(room));
    let created = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
    // The body's `request_id` names the response (`ResponsesRequest.request_id`, whose
    // default is `resp_` and a UUID's hex).
    let id = draft
        .request_id
        .clone()
        .unwrap_or_else(|| format!("resp_{}", srv.hex_id(number)));
    let response = ResponseObject::created(id, created, draft.model.clone(), &draft.body, max_output_tokens);
    let ask = draft.fit(srv.max_model_len)?;
    Ok((ask, response, store && srv.responses.enabled()))
}

/// Runs the request in the engine and answers it, whole or streamed.
async fn respond(srv: &Arc<SimServer>, mut ask: Ask, response: ResponseObject, stores: bool, number: u64) -> Response {
    let sub = match answer::submit(srv, &ask, number) {
        Ok(s) => s,
        Err(e) => return e.into_response(),
    };
    // The message's id: the same digits' scheme, another number than any request's.
    let item_id = format!("msg_{}", srv.hex_id(number | 1 << 63));
    let keep = if stores { ask.prompts.pop() } else { None };
    let answer = Responding::new(Arc::clone(srv), response, item_id, keep, ask.finish_by_length);
    if ask.stream {
        answer::stream(sub, answer)
    } else {
        answer::whole(sub, answer).await
    }
}

/// `GET /v1/responses/{id}`: the stored response.
pub(super) async fn retrieve(State(srv): State<Arc<SimServer>>, Path(id): Path<String>) -> Response {
    hang_if_faulted(&srv).await;
    let r = match srv.responses.get(&id) {
        Some(stored) => {
            let mut r = stored.body.clone().into_response();
            r.headers_mut()
                .insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
            r
        }
        None => ApiError::response_not_found(&id).into_response(),
    };
    with_server(r, &srv)
}

/// `POST /v1/responses/{id}/cancel`: every stored response is finished (no background mode),
/// so vLLM's answer for a synchronous one.
pub(super) async fn cancel(State(srv): State<Arc<SimServer>>, Path(id): Path<String>) -> Response {
    hang_if_faulted(&srv).await;
    let e = match srv.responses.get(&id) {
        Some(_) => ApiError::invalid_request(
            StatusCode::BAD_REQUEST,
            "Cannot cancel a synchronous response.",
            "response_id",
        ),
        None => ApiError::response_not_found(&id),
    };
    with_server(e.into_response(), &srv)
}

/// `background: true`: vLLM refuses it without a store; with one, the simulator does not
/// model it (`supported`: vLLM would run it).
fn background_refused(supported: bool) -> ApiError {
    let message = if supported {
        "kvroute-sim does not model the background mode: send the request without `background: true`."
    } else {
        "This vLLM engine does not support `store=True` and therefore does not support the background \
         mode. To enable these features, set the environment variable `VLLM_ENABLE_RESPONSES_API_STORE=1` \
         when launching the vLLM server."
    };
    ApiError::invalid_request(StatusCode::BAD_REQUEST, message, "background")
}

/// An optional flag as pydantic's lax `bool` reads it (`true`, `"true"`, `1`, `"no"`…).
fn flag(body: &Map<String, Value>, name: &str) -> Result<Option<bool>, ApiError> {
    let read = match body.get(name) {
        None | Some(Value::Null) => return Ok(None),
        Some(Value::Bool(b)) => Some(*b),
        Some(Value::Number(n)) => match n.as_f64() {
            Some(0.0) => Some(false),
            Some(1.0) => Some(true),
            _ => None,
        },
        Some(Value::String(s)) => match s.to_ascii_lowercase().as_str() {
            "true" | "1" | "yes" | "on" | "t" | "y" => Some(true),
            "false" | "0" | "no" | "off" | "f" | "n" => Some(false),
            _ => None,
        },
        Some(_) => None,
    };
    read.map(Some)
        .ok_or_else(|| ApiError::schema(format!("{name}: Input should be a valid boolean")))
}

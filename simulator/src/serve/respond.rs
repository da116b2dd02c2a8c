//! Responses as vLLM 0.33 writes them, from the engine's events.
//!
//! One engine sequence per choice: a completions prompt list × `n` gives `prompts × n`
//! choices, choice `i·n + j` for sample `j` of prompt `i` (vLLM's `serving_completion`).
//! Every response, chunk and usage chunk carries `id` (`chatcmpl-`/`cmpl-` and the request's
//! `X-Request-Id`, or else 32 hex digits unique per server and request), `object`, `created`
//! (Unix seconds) and `model`.
//!
//! Streams (SSE, `data: …\n\n`, then `data: [DONE]`): a chat stream opens each choice with
//! the delta `{"role": "assistant", "content": ""}`; then one chunk per generated token with
//! the text `" tok"` (vLLM detokenises incrementally: one token, a leading space); the last
//! token's chunk carries `finish_reason` (`length` when `max_tokens` ended it, else `stop`);
//! with `stream_options.include_usage` a last chunk has `choices: []` and `usage`.
//! Generated text is not model output: every token is `" tok"`. `logprobs` are not produced
//! (always `null`).

use std::collections::HashMap;
use std::convert::Infallible;
use std::sync::Arc;

use axum::body::Body;
use axum::http::{header, HeaderValue};
use axum::response::{IntoResponse, Response};
use axum::Json;
use bytes::Bytes;
use kvroute_core::request::ApiKind;
use serde_json::{json, Value};
use tokio::sync::mpsc;

use super::errors::ApiError;
use super::request::Ask;
use super::SimServer;
use crate::engine::{Event, Finished};

/// The text of one generated token.
pub const TOKEN_TEXT: &str = " tok";

/// What the response needs besides the events: the request, its id and time, and which
/// engine sequence is which choice.
pub struct Reply {
    pub ask: Ask,
    pub id: String,
    pub created: u64,
    /// Engine sequence id → (choice index, prompt index).
    pub choices: HashMap<u64, (usize, usize)>,
}

impl Reply {
    fn object(&self, chunk: bool) -> &'static str {
        match (self.ask.kind, chunk) {
            (ApiKind::Chat, false) => "chat.completion",
            (ApiKind::Chat, true) => "chat.completion.chunk",
            (ApiKind::Completions, _) => "text_completion",
        }
    }
    fn finish_reason(&self) -> &'static str {
        if self.ask.finish_by_length {
            "length"
        } else {
            "stop"
        }
    }
    fn envelope(&self, chunk: bool, choices: Value) -> Value {
        json!({"id": self.id, "object": self.object(chunk), "created": self.created, "model": self.ask.model, "choices": choices})
    }
}

/// `usage` over the finished sequences: prompt tokens once per prompt (not per sample); the
/// cached tokens of the last prompt only, as vLLM reports a batch of prompts.
fn usage(reply: &Reply, finished: &[Finished]) -> Value {
    let mut prompt_seen = vec![false; reply.ask.prompts.len()];
    let (mut prompt, mut completion) = (0u64, 0u64);
    let mut cached_of_last = (0usize, 0u64);
    for f in finished {
        completion += f.output_tokens;
        let p = reply.choices.get(&f.id).map_or(0, |c| c.1);
        if let Some(seen) = prompt_seen.get_mut(p).filter(|s| !**s) {
            *seen = true;
            prompt += f.prompt_tokens;
            if p >= cached_of_last.0 {
                cached_of_last = (p, f.cached_tokens);
            }
        }
    }
    let cached = cached_of_last.1;
    // As vLLM 0.33 started with --enable-prompt-tokens-details: the details only when some
    // prompt tokens were cached (a miss has none).
    let mut usage = json!({
        "prompt_tokens": prompt,
        "total_tokens": prompt + completion,
        "completion_tokens": completion,
    });
    if cached > 0 {
        usage["prompt_tokens_details"] = json!({"cached_tokens": cached});
    }
    usage
}

/// A request's sequences, aborted in the engine when this is dropped before they all
/// finished: the handler's future or the response stream was dropped because the client went
/// away, and vLLM aborts a request whose client disconnected (its KV blocks freed, counted as
/// `finished_reason="abort"`).
pub struct AbortOnDrop {
    srv: Arc<SimServer>,
    ids: Vec<u64>,
}

impl AbortOnDrop {
    pub fn new(srv: Arc<SimServer>, ids: Vec<u64>) -> AbortOnDrop {
        AbortOnDrop { srv, ids }
    }

    /// Every sequence finished: nothing to abort.
    fn finished(&mut self) {
        self.ids.clear();
    }
}

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        if self.ids.is_empty() {
            return;
        }
        if let Ok(mut streams) = self.srv.streams.lock() {
            for id in &self.ids {
                streams.remove(id);
            }
        }
        if let Ok(mut engine) = self.srv.engine.lock() {
            for id in &self.ids {
                engine.abort(*id);
            }
        }
        self.srv.wake.notify_one();
    }
}

/// Waits for every sequence, then answers one JSON body.
pub async fn whole(mut rx: mpsc::UnboundedReceiver<Event>, reply: Reply, mut guard: AbortOnDrop) -> Response {
    let mut finished = Vec::new();
    while finished.len() < reply.choices.len() {
        match rx.recv().await {
            Some(Event::Finished(f)) => finished.push(f),
            Some(_) => {}
            None => return ApiError::internal("the engine dropped the request").into_response(),
        }
    }
    guard.finished();
    finished.sort_by_key(|f| reply.choices.get(&f.id).map_or(0, |c| c.0));
    let choices: Vec<Value> = finished
        .iter()
        .map(|f| {
            let (index, prompt) = reply.choices.get(&f.id).copied().unwrap_or((0, 0));
            let text = TOKEN_TEXT.repeat(f.output_tokens as usize);
            match reply.ask.kind {
                ApiKind::Chat => json!({
                    "index": index,
                    "message": {"role": "assistant", "content": text, "refusal": null, "tool_calls": [], "reasoning_content": null},
                    "logprobs": null, "finish_reason": reply.finish_reason(), "stop_reason": null,
                }),
                ApiKind::Completions => {
                    let text = match reply.ask.prompts.get(prompt).filter(|_| reply.ask.echo) {
                        Some(p) => format!("{}{text}", p.text),
                        None => text,
                    };
                    json!({"index": index, "text": text, "logprobs": null, "finish_reason": reply.finish_reason(), "stop_reason": null, "prompt_logprobs": null})
                }
            }
        })
        .collect();
    let mut body = reply.envelope(false, Value::Array(choices));
    body["usage"] = usage(&reply, &finished);
    Json(body).into_response()
}

/// Streams chunks as the engine produces tokens.
pub fn stream(rx: mpsc::UnboundedReceiver<Event>, reply: Reply, guard: AbortOnDrop) -> Response {
    let state = Streaming {
        rx,
        generated: HashMap::new(),
        finished: Vec::new(),
        opened: false,
        reply,
        done: false,
        guard,
    };
    let events = futures_util::stream::unfold(state, |mut s| async move {
        let bytes = s.next().await?;
        Some((Ok::<Bytes, Infallible>(bytes), s))
    });
    let mut r = Response::new(Body::from_stream(events));
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/event-stream; charset=utf-8"),
    );
    r
}

struct Streaming {
    rx: mpsc::UnboundedReceiver<Event>,
    generated: HashMap<u64, u64>,
    finished: Vec<Finished>,
    opened: bool,
    reply: Reply,
    done: bool,
    guard: AbortOnDrop,
}

fn sse(v: &Value, out: &mut Vec<u8>) {
    out.extend_from_slice(b"data: ");
    out.extend_from_slice(v.to_string().as_bytes());
    out.extend_from_slice(b"\n\n");
}

impl Streaming {
    /// The bytes of the next engine event (several chunks at most), `None` at the end.
    async fn next(&mut self) -> Option<Bytes> {
        if self.done {
            return None;
        }
        loop {
            let mut out = Vec::new();
            match self.rx.recv().await {
                Some(Event::FirstToken { id, .. } | Event::Token { id, .. }) => self.token(id, &mut out),
                Some(Event::Finished(f)) => {
                    self.finished.push(f);
                    if self.finished.len() == self.reply.choices.len() {
                        self.guard.finished();
                        self.end(&mut out);
                    }
                }
                None => {
                    self.done = true;
                    let e = ApiError::internal("the engine dropped the request");
                    sse(&e.body(), &mut out);
                    out.extend_from_slice(b"data: [DONE]\n\n");
                }
            }
            if !out.is_empty() {
                return Some(Bytes::from(out));
            }
        }
    }

    fn token(&mut self, id: u64, out: &mut Vec<u8>) {
        let r = &self.reply;
        if !self.opened && r.ask.kind == ApiKind::Chat {
            // vLLM's first iteration: the role of every choice, before any content.
            let mut indexes: Vec<usize> = r.choices.values().map(|c| c.0).collect();
            indexes.sort_unstable();
            for index in indexes {
                let choice = json!([{"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": null, "finish_reason": null}]);
                sse(&r.envelope(true, choice), out);
            }
        }
        self.opened = true;
        let (index, prompt) = r.choices.get(&id).copied().unwrap_or((0, 0));
        let count = self.generated.entry(id).or_insert(0);
        *count += 1;
        let planned = r.ask.output_tokens.get(prompt).copied().unwrap_or(0);
        let finish = (*count >= planned).then(|| r.finish_reason());
        let choice = match r.ask.kind {
            ApiKind::Chat => {
                json!([{"index": index, "delta": {"content": TOKEN_TEXT}, "logprobs": null, "finish_reason": finish}])
            }
            ApiKind::Completions => {
                let echo = match r.ask.prompts.get(prompt) {
                    Some(p) if r.ask.echo && *count == 1 => p.text.as_str(),
                    _ => "",
                };
                json!([{"index": index, "text": format!("{echo}{TOKEN_TEXT}"), "logprobs": null, "finish_reason": finish, "stop_reason": null}])
            }
        };
        let mut chunk = r.envelope(true, choice);
        if finish.is_some() && r.ask.kind == ApiKind::Chat {
            chunk["choices"][0]["stop_reason"] = Value::Null;
        }
        sse(&chunk, out);
    }

    fn end(&mut self, out: &mut Vec<u8>) {
        if self.reply.ask.include_usage {
            let mut chunk = self.reply.envelope(true, json!([]));
            chunk["usage"] = usage(&self.reply, &self.finished);
            sse(&chunk, out);
        }
        out.extend_from_slice(b"data: [DONE]\n\n");
        self.done = true;
    }
}

//! A Messages API answer as vLLM 0.33 writes it: the chat answer the engine generated,
//! translated as `vllm/entrypoints/anthropic/serving.py` does (`messages_full_converter`,
//! `message_stream_converter`, `_build_anthropic_usage`), fields in pydantic's order.
//!
//! Whole (`model_dump(exclude_none=True)`): `{"id", "type": "message", "role": "assistant",
//! "content": [{"type": "text", "text"}], "model", "stop_reason", "usage"}`, no `stop_sequence`
//! (none matched). `id` is the chat request's (`chatcmpl-…`), `stop_reason` chat's
//! `finish_reason` mapped (`stop` → `end_turn`, `length` → `max_tokens`).
//!
//! Stream (`event: <type>\ndata: <compact JSON>\n\n`, each event `exclude_unset`, no `ping`,
//! no `data: [DONE]`): with the first token, from chat's opening chunk, `message_start` (the
//! message with no content, `stop_reason` and `stop_sequence` null, the usage of that chunk)
//! and `content_block_start` (an empty text block, index 0); one `content_block_delta`
//! (`text_delta`) per token; at the end, from chat's usage chunk, `content_block_stop`,
//! `message_delta` (`stop_reason`, `stop_sequence: null`, the final usage), then, from
//! `[DONE]`, `message_stop`. A request the engine lost ends with an `error` event of type
//! `internal_error`, as the converter reports a chunk it cannot read.
//!
//! Usage is `_build_anthropic_usage` of the chat usage the simulator reports (`respond`:
//! `prompt_tokens_details.cached_tokens` only when some prompt tokens were cached):
//! `input_tokens` is the prompt less its cached tokens, and `cache_read_input_tokens` the
//! cached ones, present only then, with `cache_creation_input_tokens` 0 beside them (chat
//! reports no tokens written to the cache; vllm-project/vllm#40912). In a stream, `message_start` has no cache fields (chat's opening
//! chunk carries no details) and `message_delta` has them.

use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Serialize;

use super::super::answer::{Answer, TOKEN_TEXT};
use super::super::errors::{AnthropicError, ApiError};
use super::super::request::Ask;
use crate::engine::Finished;

/// vLLM's `AnthropicMessagesResponse`, as far as the simulator fills it.
#[derive(Debug, Serialize)]
struct Message<'a> {
    id: &'a str,
    #[serde(rename = "type")]
    kind: &'static str,
    role: &'static str,
    content: Vec<TextBlock<'a>>,
    model: &'a str,
    stop_reason: Option<&'static str>,
    /// Left out of a whole answer (`None`), `null` in `message_start`, which sets it.
    #[serde(skip_serializing_if = "Option::is_none")]
    stop_sequence: Option<Option<&'a str>>,
    usage: Usage,
}

#[derive(Debug, Serialize)]
struct TextBlock<'a> {
    #[serde(rename = "type")]
    kind: &'static str,
    text: &'a str,
}

impl TextBlock<'_> {
    fn of(text: &str) -> TextBlock<'_> {
        TextBlock { kind: "text", text }
    }
}

/// vLLM's `AnthropicUsage`: the cache fields only where chat's usage has cache details.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
struct Usage {
    input_tokens: u64,
    output_tokens: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    cache_creation_input_tokens: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    cache_read_input_tokens: Option<u64>,
}

impl Usage {
    /// `_build_anthropic_usage` of a chat usage of `prompt` tokens, `cached` of them cached.
    fn of(prompt: u64, output: u64, cached: u64) -> Usage {
        Usage {
            input_tokens: prompt.saturating_sub(cached),
            output_tokens: output,
            cache_creation_input_tokens: (cached > 0).then_some(0),
            cache_read_input_tokens: (cached > 0).then_some(cached),
        }
    }
}

/// `AnthropicDelta`: a text delta or the message's stop.
#[derive(Debug, Serialize)]
struct Delta<'a> {
    #[serde(rename = "type", skip_serializing_if = "Option::is_none")]
    kind: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    text: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    stop_reason: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    stop_sequence: Option<Option<&'a str>>,
}

/// `AnthropicStreamEvent`: its type and the fields that event sets.
#[derive(Debug, Serialize)]
struct Event<'a> {
    #[serde(rename = "type")]
    kind: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    message: Option<Message<'a>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    delta: Option<Delta<'a>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    content_block: Option<TextBlock<'a>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    index: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    usage: Option<Usage>,
}

impl<'a> Event<'a> {
    fn of(kind: &'static str) -> Event<'a> {
        Event {
            kind,
            message: None,
            delta: None,
            content_block: None,
            index: None,
            usage: None,
        }
    }
}

/// Writes one server-sent event named `name`.
fn emit(out: &mut Vec<u8>, name: &str, data: &impl Serialize) {
    out.extend_from_slice(b"event: ");
    out.extend_from_slice(name.as_bytes());
    out.extend_from_slice(b"\ndata: ");
    // Writing these types into memory cannot fail.
    let _ = serde_json::to_writer(&mut *out, data);
    out.extend_from_slice(b"\n\n");
}

/// A Messages API answer: one engine sequence (the API has no `n`).
pub struct Messaging {
    id: String,
    model: String,
    prompt_tokens: u64,
    finish_by_length: bool,
}

impl Messaging {
    pub fn new(id: String, ask: Ask) -> Messaging {
        debug_assert!(
            ask.kind == kvroute_core::request::ApiKind::Messages && ask.prompts.len() == 1 && ask.n == 1,
            "a Messages request is one prompt, one sample"
        );
        Messaging {
            id,
            model: ask.model,
            prompt_tokens: ask.prompts.first().map_or(0, |p| p.tokens),
            finish_by_length: ask.finish_by_length,
        }
    }

    /// Chat's `finish_reason`, as `stop_reason_map` names it.
    fn stop_reason(&self) -> &'static str {
        if self.finish_by_length {
            "max_tokens"
        } else {
            "end_turn"
        }
    }

    /// The final usage: the sequence's prompt, output and cached tokens.
    fn usage(finished: &[Finished]) -> Usage {
        finished.first().map_or(Usage::of(0, 0, 0), |f| {
            Usage::of(f.prompt_tokens, f.output_tokens, f.cached_tokens)
        })
    }
}

impl Answer for Messaging {
    fn whole(&mut self, finished: Vec<Finished>) -> Response {
        let text = TOKEN_TEXT.repeat(finished.first().map_or(0, |f| f.output_tokens) as usize);
        let message = Message {
            id: &self.id,
            kind: "message",
            role: "assistant",
            content: vec![TextBlock::of(&text)],
            model: &self.model,
            stop_reason: Some(self.stop_reason()),
            stop_sequence: None,
            usage: Self::usage(&finished),
        };
        Json(message).into_response()
    }

    fn token(&mut self, _seq: u64, nth: u64, out: &mut Vec<u8>) {
        if nth == 1 {
            let message = Message {
                id: &self.id,
                kind: "message",
                role: "assistant",
                content: Vec::new(),
                model: &self.model,
                stop_reason: None,
                stop_sequence: Some(None),
                usage: Usage::of(self.prompt_tokens, 0, 0),
            };
            let start = Event {
                message: Some(message),
                ..Event::of("message_start")
            };
            emit(out, "message_start", &start);
            let block = Event {
                content_block: Some(TextBlock::of("")),
                index: Some(0),
                ..Event::of("content_block_start")
            };
            emit(out, "content_block_start", &block);
        }
        let delta = Delta {
            kind: Some("text_delta"),
            text: Some(TOKEN_TEXT),
            stop_reason: None,
            stop_sequence: None,
        };
        let event = Event {
            delta: Some(delta),
            index: Some(0),
            ..Event::of("content_block_delta")
        };
        emit(out, "content_block_delta", &event);
    }

    fn end(&mut self, finished: &[Finished], out: &mut Vec<u8>) {
        let stop = Event {
            index: Some(0),
            ..Event::of("content_block_stop")
        };
        emit(out, "content_block_stop", &stop);
        let delta = Delta {
            kind: None,
            text: None,
            stop_reason: Some(self.stop_reason()),
            stop_sequence: Some(None),
        };
        let last = Event {
            delta: Some(delta),
            usage: Some(Self::usage(finished)),
            ..Event::of("message_delta")
        };
        emit(out, "message_delta", &last);
        emit(out, "message_stop", &Event::of("message_stop"));
    }

    fn failed(&mut self, error: &ApiError, out: &mut Vec<u8>) {
        emit(out, "error", &AnthropicError::new("internal_error", &error.message));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn usage_moves_the_cached_tokens_out_of_input_tokens_only_on_a_hit() {
        let miss = serde_json::to_value(Usage::of(100, 5, 0)).unwrap_or_default();
        assert_eq!(miss, serde_json::json!({"input_tokens": 100, "output_tokens": 5}));
        let hit = serde_json::to_value(Usage::of(100, 5, 64)).unwrap_or_default();
        assert_eq!(
            hit,
            serde_json::json!({"input_tokens": 36, "output_tokens": 5, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 64})
        );
    }
}

//! Chat and completions answers as vLLM 0.33 writes them, from the engine's events (through
//! `answer`'s [`Answer`]).
//!
//! One engine sequence per choice: a completions prompt list × `n` gives `prompts × n`
//! choices, choice `i·n + j` for sample `j` of prompt `i` (vLLM's `serving_completion`).
//! Every response, chunk and usage chunk carries `id` (`chatcmpl-`/`cmpl-` and the request's
//! `X-Request-Id`, or else 32 hex digits unique per server and request), `object`, `created`
//! (Unix seconds) and `model`.
//!
//! Streams (SSE, `data: …\n\n`, then `data: [DONE]`): a chat stream opens each choice with
//! the delta `{"role": "assistant", "content": ""}`; then one chunk per generated token with
//! the text `" tok"` ([`TOKEN_TEXT`]); the last token's chunk carries `finish_reason`
//! (`length` when `max_tokens` ended it, else `stop`); with `stream_options.include_usage` a
//! last chunk has `choices: []` and `usage`, and with `continuous_usage_stats` as well every
//! other chunk carries its choice's usage so far (serve's `--enable-force-include-usage` gives
//! every stream both, as vLLM's does). `logprobs` are not produced (always `null`).

use std::collections::HashMap;

use axum::response::{IntoResponse, Response};
use axum::Json;
use kvroute_core::request::ApiKind;
use serde_json::{json, Value};

use super::answer::{Answer, TOKEN_TEXT};
use super::errors::ApiError;
use super::request::Ask;
use crate::engine::Finished;

/// A chat or completions answer: the request, its id and time, and which engine sequence is
/// which choice.
pub struct Reply {
    ask: Ask,
    id: String,
    created: u64,
    /// Engine sequence id → (choice index, prompt index).
    choices: HashMap<u64, (usize, usize)>,
    /// A chat stream sent its role chunks (before its first token).
    roles_sent: bool,
}

impl Reply {
    pub fn new(ask: Ask, id: String, created: u64, choices: HashMap<u64, (usize, usize)>) -> Reply {
        debug_assert!(
            ask.kind != ApiKind::Responses,
            "the Responses API answers through `responses`"
        );
        Reply {
            ask,
            id,
            created,
            choices,
            roles_sent: false,
        }
    }
    fn chat(&self) -> bool {
        self.ask.kind == ApiKind::Chat
    }
    fn object(&self, chunk: bool) -> &'static str {
        match (self.chat(), chunk) {
            (true, false) => "chat.completion",
            (true, true) => "chat.completion.chunk",
            (false, _) => "text_completion",
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
    /// A stream chunk, with the usage so far of the choice it is about when the stream reports
    /// usage continuously: its prompt and the tokens it has generated (vLLM's per-chunk
    /// `UsageInfo`, without details).
    fn chunk(&self, choices: Value, prompt: usize, generated: u64) -> Value {
        let mut chunk = self.envelope(true, choices);
        if self.ask.continuous_usage {
            let prompt_tokens = self.ask.prompts.get(prompt).map_or(0, |p| p.tokens);
            chunk["usage"] = json!({
                "prompt_tokens": prompt_tokens,
                "total_tokens": prompt_tokens + generated,
                "completion_tokens": generated,
            });
        }
        chunk
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

fn sse(v: &Value, out: &mut Vec<u8>) {
    out.extend_from_slice(b"data: ");
    out.extend_from_slice(v.to_string().as_bytes());
    out.extend_from_slice(b"\n\n");
}

impl Answer for Reply {
    fn whole(&mut self, mut finished: Vec<Finished>) -> Response {
        finished.sort_by_key(|f| self.choices.get(&f.id).map_or(0, |c| c.0));
        let choices: Vec<Value> = finished
            .iter()
            .map(|f| {
                let (index, prompt) = self.choices.get(&f.id).copied().unwrap_or((0, 0));
                let text = TOKEN_TEXT.repeat(f.output_tokens as usize);
                if self.chat() {
                    json!({
                        "index": index,
                        "message": {"role": "assistant", "content": text, "refusal": null, "reasoning": null},
                        "logprobs": null, "finish_reason": self.finish_reason(), "stop_reason": null,
                    })
                } else {
                    let text = match self.ask.prompts.get(prompt).filter(|_| self.ask.echo) {
                        Some(p) => format!("{}{text}", p.text),
                        None => text,
                    };
                    json!({"index": index, "text": text, "logprobs": null, "finish_reason": self.finish_reason(), "stop_reason": null, "prompt_logprobs": null})
                }
            })
            .collect();
        let mut body = self.envelope(false, Value::Array(choices));
        body["usage"] = usage(self, &finished);
        Json(body).into_response()
    }

    fn token(&mut self, id: u64, nth: u64, out: &mut Vec<u8>) {
        if !self.roles_sent && self.chat() {
            // vLLM's first iteration: the role of every choice, before any content.
            let mut opening: Vec<(usize, usize)> = self.choices.values().copied().collect();
            opening.sort_unstable();
            for (index, prompt) in opening {
                let choice = json!([{"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": null, "finish_reason": null}]);
                sse(&self.chunk(choice, prompt, 0), out);
            }
        }
        self.roles_sent = true;
        let (index, prompt) = self.choices.get(&id).copied().unwrap_or((0, 0));
        let planned = self.ask.output_tokens.get(prompt).copied().unwrap_or(0);
        let finish = (nth >= planned).then(|| self.finish_reason());
        let choice = if self.chat() {
            json!([{"index": index, "delta": {"content": TOKEN_TEXT}, "logprobs": null, "finish_reason": finish}])
        } else {
            let echo = match self.ask.prompts.get(prompt) {
                Some(p) if self.ask.echo && nth == 1 => p.text.as_str(),
                _ => "",
            };
            json!([{"index": index, "text": format!("{echo}{TOKEN_TEXT}"), "logprobs": null, "finish_reason": finish, "stop_reason": null}])
        };
        let mut chunk = self.chunk(choice, prompt, nth);
        if finish.is_some() && self.chat() {
            chunk["choices"][0]["stop_reason"] = Value::Null;
        }
        sse(&chunk, out);
    }

    fn end(&mut self, finished: &[Finished], out: &mut Vec<u8>) {
        if self.ask.include_usage {
            let mut chunk = self.envelope(true, json!([]));
            chunk["usage"] = usage(self, finished);
            sse(&chunk, out);
        }
        out.extend_from_slice(b"data: [DONE]\n\n");
    }

    fn failed(&mut self, error: &ApiError, out: &mut Vec<u8>) {
        sse(&error.body(), out);
        out.extend_from_slice(b"data: [DONE]\n\n");
    }
}

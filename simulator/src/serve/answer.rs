//! What every API's answer shares: submitting a request's sequences to the engine under
//! vLLM's admission limits, waiting for them or streaming their tokens as the driver
//! produces them, and aborting them when the client goes away. Each API writes its own
//! shapes through [`Answer`]: chat and completions in `respond`, the Responses API in
//! `responses`.

use std::collections::HashMap;
use std::convert::Infallible;
use std::sync::Arc;

use axum::body::Body;
use axum::http::{header, HeaderValue};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use tokio::sync::mpsc;

use super::errors::ApiError;
use super::request::Ask;
use super::SimServer;
use crate::engine::{Event, Finished, SeqSpec};
use crate::tokens::engine_blocks;

/// The text of one generated token (vLLM detokenises incrementally: one token, a leading
/// space). Generated text is not model output.
pub const TOKEN_TEXT: &str = " tok";

/// How one API writes its answer from the engine's events.
pub trait Answer: Send + 'static {
    /// The body, once every sequence finished.
    fn whole(&mut self, finished: Vec<Finished>) -> Response;
    /// Stream events sent at once, before the engine produced anything.
    fn opening(&mut self, _out: &mut Vec<u8>) {}
    /// Stream events for token `nth` (from 1) of engine sequence `seq`.
    fn token(&mut self, seq: u64, nth: u64, out: &mut Vec<u8>);
    /// Stream events once every sequence finished; the stream ends after them.
    fn end(&mut self, finished: &[Finished], out: &mut Vec<u8>);
    /// Stream events when the engine lost the request; the stream ends after them.
    fn failed(&mut self, error: &ApiError, out: &mut Vec<u8>);
}

/// A request's sequences in the engine and the channel their events arrive on.
pub struct Submitted {
    events: mpsc::UnboundedReceiver<Event>,
    guard: AbortOnDrop,
    /// Engine sequence id → (choice index, prompt index).
    pub choices: HashMap<u64, (usize, usize)>,
}

/// Submits one sequence per prompt and sample (choice `p·n + j` for sample `j` of prompt
/// `p`), with ids from the server's request `number`; refused (503) when vLLM's admission
/// limits would refuse it.
pub fn submit(srv: &Arc<SimServer>, ask: &Ask, number: u64) -> Result<Submitted, ApiError> {
    let seqs = ask.prompts.len() as u64 * ask.n;
    let admission = srv.admission.lock().map(|a| *a).unwrap_or_default();
    let (tx, rx) = mpsc::unbounded_channel();
    let mut choices = HashMap::new();
    let mut specs = Vec::new();
    for (p, prompt) in ask.prompts.iter().enumerate() {
        for j in 0..ask.n {
            // Sequence ids: the request's number in the high bits, the choice in the low.
            let seq = (number << 20) | choices.len() as u64;
            choices.insert(seq, (p * ask.n as usize + j as usize, p));
            specs.push(SeqSpec {
                id: seq,
                prompt_tokens: prompt.tokens,
                output_tokens: ask.output_tokens[p].max(1),
                block_hashes: engine_blocks(&prompt.canonical, prompt.tokens),
                stops: !ask.finish_by_length,
            });
        }
    }
    {
        // Admission and submission under one lock: a burst cannot pass the check together.
        let Ok(mut engine) = srv.engine.lock() else {
            return Err(ApiError::internal("the engine is unavailable"));
        };
        if let Some((why, limit)) = admission.refuses(&engine, seqs) {
            engine.counters.admission_rejected[limit] += 1;
            return Err(ApiError::overloaded(why));
        }
        if let Ok(mut s) = srv.streams.lock() {
            for spec in &specs {
                s.insert(spec.id, tx.clone());
            }
        }
        let now = srv.now_ms();
        for spec in specs {
            engine.add(spec, now);
        }
    }
    srv.wake.notify_one();
    Ok(Submitted {
        events: rx,
        guard: AbortOnDrop::new(Arc::clone(srv), choices.keys().copied().collect()),
        choices,
    })
}

/// A request's sequences, aborted in the engine when this is dropped before they all
/// finished: the handler's future or the response stream was dropped because the client went
/// away, and vLLM aborts a request whose client disconnected (its KV blocks freed, counted as
/// `finished_reason="abort"`).
struct AbortOnDrop {
    srv: Arc<SimServer>,
    ids: Vec<u64>,
}

impl AbortOnDrop {
    fn new(srv: Arc<SimServer>, ids: Vec<u64>) -> AbortOnDrop {
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

/// Waits for every sequence, then answers one body.
pub async fn whole<A: Answer>(mut sub: Submitted, mut answer: A) -> Response {
    let mut finished = Vec::new();
    while finished.len() < sub.choices.len() {
        match sub.events.recv().await {
            Some(Event::Finished(f)) => finished.push(f),
            Some(_) => {}
            None => return ApiError::internal("the engine dropped the request").into_response(),
        }
    }
    sub.guard.finished();
    answer.whole(finished)
}

/// Streams server-sent events as the engine produces tokens: the answer's opening at once,
/// then its events per token, then its end.
pub fn stream<A: Answer>(sub: Submitted, answer: A) -> Response {
    let state = Streaming {
        sub,
        answer,
        generated: HashMap::new(),
        finished: Vec::new(),
        opened: false,
        done: false,
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

struct Streaming<A> {
    sub: Submitted,
    answer: A,
    /// Tokens so far per engine sequence.
    generated: HashMap<u64, u64>,
    finished: Vec<Finished>,
    opened: bool,
    done: bool,
}

impl<A: Answer> Streaming<A> {
    /// The bytes of the opening or of the next engine event, `None` at the end.
    async fn next(&mut self) -> Option<Bytes> {
        if self.done {
            return None;
        }
        let mut out = Vec::new();
        if !self.opened {
            self.opened = true;
            self.answer.opening(&mut out);
            if !out.is_empty() {
                return Some(Bytes::from(out));
            }
        }
        loop {
            match self.sub.events.recv().await {
                Some(Event::FirstToken { id, .. } | Event::Token { id, .. }) => {
                    let nth = self.generated.entry(id).or_insert(0);
                    *nth += 1;
                    self.answer.token(id, *nth, &mut out);
                }
                Some(Event::Finished(f)) => {
                    self.finished.push(f);
                    if self.finished.len() == self.sub.choices.len() {
                        self.sub.guard.finished();
                        self.done = true;
                        self.answer.end(&self.finished, &mut out);
                    }
                }
                None => {
                    self.done = true;
                    self.answer
                        .failed(&ApiError::internal("the engine dropped the request"), &mut out);
                }
            }
            if !out.is_empty() {
                return Some(Bytes::from(out));
            }
        }
    }
}

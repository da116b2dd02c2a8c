//! Reading an inference request the way vLLM 0.33 validates it, before any engine work.
//!
//! Order as in vLLM's `OpenAIServing`: JSON and media type (400), the model (404 with
//! `param: "model"`; no `model`, or an empty one, means the first served name), the sampling
//! fields (`n ≥ 1`, `max_tokens ≥ 1`), then each prompt against the context (the renderer's
//! `TokenizeParams`: `max_tokens` no longer than `max_model_len`, the prompt no longer than
//! `max_model_len − max_tokens`, `max_tokens` counted 0 where the request sets none; a chat
//! prompt that fills the context then leaves `max_tokens` 0, which `SamplingParams` refuses).
//!
//! What FastAPI and pydantic refuse before vLLM's code runs (the media type, JSON, a field
//! missing or of the wrong type, the request model's validators) is an [`ApiError::schema`];
//! what vLLM's serving code refuses keeps its own error type.
//!
//! Prompts are measured by `kvroute_core::request::parse`, the rule the filter hashes with
//! (4 bytes a token, +4 per chat message): a completions `prompt` list is one sequence per
//! entry, each measured on its own; a Responses body's `instructions` and `input` as chat
//! messages; an Anthropic Messages body as the chat request vLLM translates it to. The
//! context check comes last (`Draft::fit`): a Responses continuation's prompt
//! is known only once its stored history is found.

use kvroute_core::request::{parse, ApiKind, RequestError};
use serde_json::Value;

use super::errors::ApiError;

/// Default output length of a completion without `max_tokens` (vLLM's `CompletionRequest`).
pub const COMPLETION_DEFAULT_MAX_TOKENS: u64 = 16;
/// Where the simulated model stops by itself (an end-of-sequence token) when a chat request
/// sets no `max_tokens`, or a Messages API request a larger one; vLLM would allow up to the
/// rest of the context.
pub const NATURAL_STOP_TOKENS: u64 = 256;

/// One prompt: the canonical bytes its cache blocks come from, and its token count.
#[derive(Clone, Debug, PartialEq)]
pub struct Prompt {
    pub canonical: Vec<u8>,
    pub tokens: u64,
    /// The prompt as text, for `echo` (token-id prompts are rendered by the 4-byte rule).
    pub text: String,
}

/// A validated request.
#[derive(Clone, Debug, PartialEq)]
pub struct Ask {
    pub kind: ApiKind,
    /// The served name the response carries.
    pub model: String,
    pub prompts: Vec<Prompt>,
    pub n: u64,
    /// Output tokens of every choice, and whether reaching them is a `length` finish.
    pub output_tokens: Vec<u64>,
    pub finish_by_length: bool,
    pub stream: bool,
    /// A stream ends with a chunk of the request's usage (`stream_options.include_usage`).
    pub include_usage: bool,
    /// Every chunk of a stream carries the usage so far (`stream_options.continuous_usage_stats`,
    /// with `include_usage`).
    pub continuous_usage: bool,
    pub echo: bool,
    /// The body's `request_id` (`Draft::request_id`).
    pub request_id: Option<String>,
}

impl Ask {
    /// As vLLM started with `--enable-force-include-usage` (`should_include_usage`): usage at
    /// the end of every stream and on each of its chunks, whatever `stream_options` asks.
    pub fn force_usage(&mut self) {
        self.include_usage = true;
        self.continuous_usage = true;
    }
}

/// A request validated but for its fit in the context: a Responses continuation's prompt is
/// known only once its stored history is found (vLLM looks it up before rendering the prompt).
#[derive(Debug)]
pub struct Draft {
    pub kind: ApiKind,
    pub model: String,
    pub prompts: Vec<Prompt>,
    pub n: u64,
    /// `max_tokens` (`max_completion_tokens`, Responses' `max_output_tokens`), at least 1.
    pub max_tokens: Option<u64>,
    /// The field `max_tokens` came from, as vLLM's context errors name it.
    max_tokens_param: &'static str,
    /// The body's `request_id` (not in the Messages API): a chat or completion answer's id
    /// where the client sent no `X-Request-Id` (vLLM's `_base_request_id(raw_request,
    /// request.request_id)`), a Responses answer's id (`ResponsesRequest.request_id`).
    pub request_id: Option<String>,
    ignore_eos: bool,
    min_tokens: u64,
    pub stream: bool,
    include_usage: bool,
    continuous_usage: bool,
    echo: bool,
    /// The body's fields, for what an answer echoes.
    pub body: serde_json::Map<String, Value>,
}

/// Validates `body` (with its `content-type`) against the served names and context. A
/// request without `content-type` is refused as vLLM refuses it.
pub fn read(
    kind: ApiKind,
    content_type: Option<&str>,
    body: &[u8],
    served: &[String],
    max_model_len: u64,
) -> Result<Ask, ApiError> {
    draft(kind, content_type, body, served)?.fit(max_model_len)
}

/// The JSON object of a request body sent as `content-type` (vLLM's media type and JSON
/// checks, the first it makes).
pub fn json_object(content_type: Option<&str>, body: &[u8]) -> Result<serde_json::Map<String, Value>, ApiError> {
    let media = content_type
        .unwrap_or("")
        .split(';')
        .next()
        .unwrap_or("")
        .trim()
        .to_ascii_lowercase();
    if media != "application/json" {
        return Err(ApiError::schema(
            "Unsupported Media Type: Only 'application/json' is allowed",
        ));
    }
    let json: Value = serde_json::from_slice(body).map_err(|e| ApiError::schema(format!("JSON decode error: {e}")))?;
    match json {
        Value::Object(obj) => Ok(obj),
        _ => Err(ApiError::schema("Input should be a valid dictionary")),
    }
}

/// Everything `read` checks but the context.
pub fn draft(kind: ApiKind, content_type: Option<&str>, body: &[u8], served: &[String]) -> Result<Draft, ApiError> {
    let obj = json_object(content_type, body)?;
    if kind == ApiKind::Messages {
        // Pydantic reads the whole Anthropic request before vLLM's code looks at the model.
        super::messages::check_body(&obj)?;
    }
    let model = served_model(&obj, served)?;
    // The Responses and Messages APIs have no `n`, `ignore_eos`, `min_tokens`, `echo` nor
    // `stream_options` (vLLM builds the Messages API's chat request without them).
    let openai = matches!(kind, ApiKind::Chat | ApiKind::Completions);
    let n = if openai { int_field(&obj, "n")?.unwrap_or(1) } else { 1 };
    if n < 1 {
        return Err(ApiError::validation(&format!("n must be at least 1, got {n}."), "n", n));
    }
    let max_tokens_param = match kind {
        ApiKind::Chat if int_field(&obj, "max_completion_tokens")?.is_some() => "max_completion_tokens",
        ApiKind::Responses => "max_output_tokens",
        _ => "max_tokens",
    };
    let max_tokens = int_field(&obj, max_tokens_param)?;
    // vLLM's `SamplingParams` check, whichever field the API calls it.
    if let Some(m) = max_tokens.filter(|m| *m < 1) {
        return Err(ApiError::validation(
            &format!("max_tokens must be at least 1, got {m}."),
            "max_tokens",
            m,
        ));
    }
    // Sampling parameters that set the length: `ignore_eos` generates to `max_tokens` or the
    // context's end, `min_tokens` holds off the natural stop.
    let ignore_eos = openai && obj.get("ignore_eos").and_then(Value::as_bool).unwrap_or(false);
    let min_tokens = if openai {
        int_field(&obj, "min_tokens")?.unwrap_or(0).max(0) as u64
    } else {
        0
    };
    let prompts = prompts(kind, &obj)?;
    let stream = obj.get("stream").and_then(Value::as_bool).unwrap_or(false);
    let stream_options = obj
        .get("stream_options")
        .filter(|o| o.as_object().is_some_and(|m| !m.is_empty()));
    if stream_options.is_some() && !stream && openai {
        // The request model's validator raises a `VLLMValidationError`, whose parameter the
        // validation handler reports.
        return Err(ApiError {
            param: Some("stream_options".into()),
            ..ApiError::schema("Stream options can only be defined when `stream=True`.")
        });
    }
    let asked = |option: &str| {
        openai
            && stream_options
                .and_then(|o| o.get(option))
                .and_then(Value::as_bool)
                .unwrap_or(false)
    };
    let include_usage = asked("include_usage");
    Ok(Draft {
        kind,
        model,
        prompts,
        n: n as u64,
        max_tokens: max_tokens.map(|m| m as u64),
        max_tokens_param,
        request_id: (kind != ApiKind::Messages)
            .then(|| obj.get("request_id").and_then(Value::as_str).map(str::to_string))
            .flatten(),
        ignore_eos,
        min_tokens,
        stream,
        include_usage,
        continuous_usage: include_usage && asked("continuous_usage_stats"),
        echo: kind == ApiKind::Completions && obj.get("echo").and_then(Value::as_bool).unwrap_or(false),
        body: obj,
    })
}

/// The served name `obj` asks for (vLLM's model check, `_is_model_supported`: no `model`, or
/// an empty one, means the first served name; an unknown one is a 404).
pub fn served_model(obj: &serde_json::Map<String, Value>, served: &[String]) -> Result<String, ApiError> {
    match obj.get("model") {
        None | Some(Value::Null) => Ok(served.first().cloned().unwrap_or_default()),
        Some(Value::String(m)) if m.is_empty() => Ok(served.first().cloned().unwrap_or_default()),
        Some(Value::String(m)) if served.contains(m) => Ok(m.clone()),
        Some(Value::String(m)) => Err(ApiError::unknown_model(m)),
        Some(_) => Err(ApiError::schema("model: Input should be a valid string")),
    }
}

impl Draft {
    /// The output each prompt may have, once every prompt is known to fit the context with
    /// the requested output (vLLM's renderer, `TokenizeParams`, `max_output_tokens` for the
    /// Responses API, whose default truncation is disabled) and to leave room for one token;
    /// a completion's `max_tokens` is 16 where the request sets none.
    pub fn fit(self, max_model_len: u64) -> Result<Ask, ApiError> {
        let asked = match (self.kind, self.max_tokens) {
            (ApiKind::Completions, None) => COMPLETION_DEFAULT_MAX_TOKENS,
            (_, m) => m.unwrap_or(0),
        };
        if asked > max_model_len {
            return Err(ApiError::output_over_context(
                self.max_tokens_param,
                asked,
                max_model_len,
            ));
        }
        let mut output_tokens = Vec::with_capacity(self.prompts.len());
        for p in &self.prompts {
            if p.tokens > max_model_len - asked {
                return Err(ApiError::prompt_too_long(max_model_len, p.tokens, asked));
            }
            if p.tokens >= max_model_len {
                return Err(ApiError::no_room_for_output(0));
            }
            let room = max_model_len - p.tokens;
            let planned = match (self.kind, self.max_tokens) {
                (ApiKind::Responses, Some(m)) => m.min(room),
                // The Messages API requires `max_tokens`: a ceiling, which the model's own stop
                // usually comes before.
                (ApiKind::Messages, Some(m)) => m.min(NATURAL_STOP_TOKENS),
                (_, Some(m)) => m,
                (ApiKind::Chat, None) if self.ignore_eos => room,
                (ApiKind::Chat | ApiKind::Responses | ApiKind::Messages, None) => {
                    NATURAL_STOP_TOKENS.max(self.min_tokens).min(room)
                }
                (ApiKind::Completions, None) => COMPLETION_DEFAULT_MAX_TOKENS.min(room),
            };
            output_tokens.push(planned);
        }
        Ok(Ask {
            kind: self.kind,
            model: self.model,
            prompts: self.prompts,
            n: self.n,
            output_tokens,
            finish_by_length: match self.kind {
                ApiKind::Messages => self.max_tokens.is_some_and(|m| m <= NATURAL_STOP_TOKENS),
                _ => self.max_tokens.is_some() || self.kind == ApiKind::Completions || self.ignore_eos,
            },
            stream: self.stream,
            include_usage: self.include_usage,
            continuous_usage: self.continuous_usage,
            echo: self.echo,
            request_id: self.request_id,
        })
    }
}

/// An optional integer field; `5.0` counts as 5 (pydantic's lax mode), null as absent.
pub fn int_field(obj: &serde_json::Map<String, Value>, name: &'static str) -> Result<Option<i64>, ApiError> {
    let invalid = || ApiError::schema(format!("{name}: Input should be a valid integer"));
    match obj.get(name) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Number(n)) => match (n.as_i64(), n.as_f64()) {
            (Some(v), _) => Ok(Some(v)),
            (None, Some(f)) if f.fract() == 0.0 && (-9.2e18..9.2e18).contains(&f) => Ok(Some(f as i64)),
            _ => Err(invalid()),
        },
        Some(_) => Err(invalid()),
    }
}

const EMPTY_PROMPT: &str = "Either prompt or prompt_embeds must be provided and non-empty.";

/// What `parse` refuses, as vLLM refuses it: an empty conversation passes pydantic and is
/// refused by the serving code (the chat template finds no message); the rest (a shape the API
/// does not allow, a field missing or of the wrong type) fails validation.
pub fn unreadable(e: RequestError) -> ApiError {
    match e {
        RequestError::InvalidField {
            reason: "must not be empty",
            ..
        } => ApiError::bad_request(e.to_string()),
        _ => ApiError::schema(e.to_string()),
    }
}

/// The prompts of a validated body, measured by `kvroute_core::request::parse`.
pub fn prompts(kind: ApiKind, obj: &serde_json::Map<String, Value>) -> Result<Vec<Prompt>, ApiError> {
    let one = |body: Value| -> Result<Prompt, ApiError> {
        let bytes = body.to_string();
        let p = parse(kind, bytes.as_bytes()).map_err(unreadable)?;
        let text = String::from_utf8_lossy(&p.canonical).into_owned();
        Ok(Prompt {
            canonical: p.canonical,
            tokens: p.prompt_tokens.0,
            text,
        })
    };
    match kind {
        ApiKind::Chat => {
            // Only what the canonical text is made of: the rest is validated here.
            let mut body = serde_json::json!({"model": "", "messages": obj.get("messages").cloned()});
            if let Some(tools) = obj.get("tools") {
                body["tools"] = tools.clone();
            }
            Ok(vec![one(body)?])
        }
        ApiKind::Responses | ApiKind::Messages => {
            let mut body = serde_json::json!({"model": ""});
            for field in ["input", "instructions", "tools", "system", "messages", "max_tokens"] {
                if let Some(v) = obj.get(field) {
                    body[field] = v.clone();
                }
            }
            Ok(vec![one(body)?])
        }
        ApiKind::Completions => {
            let prompt = obj.get("prompt").cloned().unwrap_or(Value::Null);
            if prompt.is_null() || prompt.as_str() == Some("") {
                // `CompletionRequest`'s validator; an empty list passes it.
                return Err(ApiError::schema(EMPTY_PROMPT));
            }
            let entries = match &prompt {
                Value::Array(items) if items.iter().all(|i| i.is_string() || i.is_array()) && !items.is_empty() => {
                    items.clone()
                }
                _ => vec![prompt],
            };
            let mut out = Vec::with_capacity(entries.len());
            for p in entries {
                if p.is_null() || p.as_str() == Some("") || p.as_array().is_some_and(Vec::is_empty) {
                    return Err(ApiError::bad_request(EMPTY_PROMPT));
                }
                let mut prompt = one(serde_json::json!({"model": "", "prompt": p}))?;
                if p.is_array() {
                    prompt.text = super::tokenize::detokenize_ids(&prompt.canonical);
                }
                out.push(prompt);
            }
            Ok(out)
        }
    }
}

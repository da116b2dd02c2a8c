//! Parsing OpenAI-style request bodies into what routing needs: the model, the canonical
//! prompt text, a prompt-length estimate and the sampling fields that matter for placement.
//!
//! Canonical text (part of the prefix-hashing spec, see `hashing`):
//! - chat: the `tools` array as compact JSON with sorted keys (if present and non-empty),
//!   then per message: role, `\x1f`, content text, `\x1e`. Content given as parts joins the
//!   `text` parts; any other part (an image, audio) contributes its compact JSON, so two
//!   different images never share affinity.
//! - responses (`/v1/responses`): as chat, with `instructions` as a first `system` message
//!   and `input` as the messages (a string is one `user` message; message items give their
//!   role and content, `input_text`/`output_text` parts count as text; any other item, a
//!   function call or its output, gives its `type` as the role and its compact JSON as the
//!   content). A request that continues a stored response (`previous_response_id`) is
//!   routed to the server that stored it, the only one that can answer it (`Router::route`).
//! - messages (Anthropic's, `/v1/messages`): the chat request vLLM translates it to, so a
//!   conversation shares its prefix with the same one sent as chat: `system` (its text
//!   blocks, Claude Code's attribution block left out, as vLLM leaves it out) and the system
//!   messages leading the conversation joined by blank lines as a first `system` message; a
//!   later system message a `system` message where it stands (after the tool results when
//!   it comes between a tool call and them), as vLLM places it; the roles `ctx` and `msg`
//!   as `user`; each message's content as chat content (text blocks as text, an
//!   image as an `image_url` part with vLLM's `data:` URI; `tool_use` and `thinking` blocks
//!   become fields chat does not hash; a user message left without content is dropped); a
//!   user's `tool_result` block as a `tool` message before its message (blocks: their text
//!   joined by newlines, their images a user message after it, the tools they reference a
//!   `tool` message after that); an assistant's as `Tool result: ` and its content; `tools`
//!   as chat's function tools. Its `usage` is read where it has the cached tokens
//!   (`response::usage`).
//! - completions: the prompt string; for an array of strings, the first string is the
//!   canonical text (vLLM runs them as separate sequences) while all count toward the token
//!   estimate, and the response's `usage` is not read (vLLM reports one prompt's cached
//!   tokens); token ids are written as 4-byte little-endian integers.
//!
//! Token estimate (documented rule): ceil(bytes / 4) for text, plus 4 tokens per chat
//! message for the template and 1,024 per media part (an image, audio, a video, a file; a
//! part of another type, a tool reference, counts as the text of its JSON); token-id
//! prompts count exactly.
//!
//! Leniency: the parser accepts what vLLM 0.33 accepts (its pydantic models are lax), so a
//! body vLLM serves is never skipped as malformed: `"stream": null` or `"true"`, integers
//! written as `5.0` or `"5"`. A body without `model` is served by vLLM's first served model:
//! it is routed under the empty model name (no endpoint filter by model, and such bodies
//! share prefix affinity with each other only). A value vLLM would reject (`"max_tokens": 0`,
//! `-3`, `1.5`, an object) is read as absent: the server answers the 400, never the filter.

use std::fmt;

use serde::Deserialize;
use serde_json::Value;

use crate::types::Tokens;

/// Which OpenAI API the body belongs to (from the request path).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ApiKind {
    Chat,
    Completions,
    /// OpenAI's Responses API (`/v1/responses`).
    Responses,
    /// Anthropic's Messages API (`/v1/messages`), which vLLM serves as the chat request it
    /// translates it to.
    Messages,
}

impl ApiKind {
    /// The inference paths the filter acts on; everything else passes through.
    pub fn from_path(path: &str) -> Option<ApiKind> {
        let path = path.split('?').next().unwrap_or(path);
        match path {
            "/v1/chat/completions" => Some(ApiKind::Chat),
            "/v1/completions" => Some(ApiKind::Completions),
            "/v1/responses" => Some(ApiKind::Responses),
            "/v1/messages" => Some(ApiKind::Messages),
            _ => None,
        }
    }
}

/// The response id in the path of a request about a stored response (vLLM's
/// `GET /v1/responses/{id}` and `POST /v1/responses/{id}/cancel`): only the server that
/// stored it can answer.
pub fn stored_response_path(path: &str) -> Option<&str> {
    let path = path.split('?').next().unwrap_or(path);
    let rest = path.strip_prefix("/v1/responses/")?;
    let id = rest.strip_suffix("/cancel").unwrap_or(rest);
    (!id.is_empty() && !id.contains('/')).then_some(id)
}

/// A response id as the routers of every worker and replica key it (FNV-1a, mixed).
pub fn response_key(id: &str) -> u64 {
    let fnv = id.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    });
    crate::policy::mix(fnv)
}

pub const BYTES_PER_TOKEN: u64 = 4;
/// Chat messages parsed at most: past this the body is not routed (Envoy balances it). It
/// bounds the parse cost of a hostile body of tiny messages (≈ 50 ms for 130k natively).
pub const MAX_MESSAGES: usize = 4096;
const TOKENS_PER_MESSAGE: u64 = 4;
/// A content part other than text (an image, audio) counts this many tokens, whatever its
/// encoding: its JSON (a base64 image of 200 KB would read as 50,000 tokens) says nothing
/// of what the model makes of it, and vision models turn an image into a few hundred to a
/// couple of thousand tokens (LLaVA-1.5: 576 at 336 px; Qwen2-VL: about 1,300 at 1024 px).
const TOKENS_PER_MEDIA_PART: u64 = 1024;

/// What the router needs to know about one request body.
#[derive(Clone, Debug, PartialEq)]
pub struct ParsedRequest {
    pub model: String,
    /// Canonical bytes the prefix blocks are cut from.
    pub canonical: Vec<u8>,
    pub prompt_tokens: Tokens,
    pub max_tokens: Option<u64>,
    pub stream: bool,
    /// Whether the response carries `usage` (with `prompt_tokens_details.cached_tokens`):
    /// always for a whole response, only with `stream_options.include_usage` for a stream.
    pub reports_usage: bool,
    /// A stream that did not ask for `usage`: a server started with vLLM's
    /// `--enable-force-include-usage` sends it all the same (`response::ForcedUsage`).
    pub usage_unasked: bool,
    pub user: Option<String>,
    pub cache_salt: Option<String>,
    /// Responses: the stored response this request continues (`previous_response_id`).
    pub continues: Option<String>,
    /// Responses: the server keeps the response for a follow-up (`store`, true unless the
    /// body says otherwise; vLLM stores only with `VLLM_ENABLE_RESPONSES_API_STORE=1`).
    pub stores: bool,
}

/// Why a body could not be used for routing; the caller falls back to Envoy's balancing.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RequestError {
    /// Not JSON, not UTF-8, nested too deep, or a field of the wrong type.
    Malformed(String),
    MissingField(&'static str),
    /// A field present with a value the API does not allow.
    InvalidField {
        field: &'static str,
        reason: &'static str,
    },
}

impl fmt::Display for RequestError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RequestError::Malformed(e) => write!(f, "request body is not a valid OpenAI request: {e}"),
            RequestError::MissingField(name) => write!(f, "request body has no `{name}` field"),
            RequestError::InvalidField { field, reason } => write!(f, "request field `{field}` {reason}"),
        }
    }
}

impl std::error::Error for RequestError {}

#[derive(Deserialize)]
struct Body {
    model: Option<String>,
    #[serde(default, deserialize_with = "bounded_messages")]
    messages: Option<Vec<Message>>,
    prompt: Option<Prompt>,
    tools: Option<Value>,
    #[serde(default, deserialize_with = "lax_count")]
    max_tokens: Option<u64>,
    #[serde(default, deserialize_with = "lax_count")]
    max_completion_tokens: Option<u64>,
    #[serde(default, deserialize_with = "lax_bool")]
    stream: bool,
    stream_options: Option<Value>,
    user: Option<String>,
    cache_salt: Option<String>,
    /// Anthropic's Messages API: the system prompt (`parse_messages`).
    system: Option<Value>,
}

/// A Responses body: its own fields, so a chat or completions body is read as before
/// whatever Responses fields it carries.
#[derive(Deserialize)]
struct ResponsesBody {
    model: Option<String>,
    #[serde(default, deserialize_with = "bounded_input")]
    input: Option<Input>,
    instructions: Option<String>,
    tools: Option<Value>,
    #[serde(default, deserialize_with = "lax_count")]
    max_output_tokens: Option<u64>,
    #[serde(default, deserialize_with = "lax_bool")]
    stream: bool,
    /// vLLM answers at once (the response queued) and generates after: no usage comes.
    #[serde(default, deserialize_with = "lax_bool")]
    background: bool,
    previous_response_id: Option<String>,
    /// Absent: true (the API's default); `null`: vLLM stores nothing (`Some(Null)`).
    #[serde(default, deserialize_with = "present")]
    store: Option<Value>,
    user: Option<String>,
    cache_salt: Option<String>,
}

/// A Responses `input`: one text, or items (messages, function calls and their outputs).
enum Input {
    Text(String),
    Items(Vec<Value>),
}

/// Reads `input` but stops with an error past [`MAX_MESSAGES`] items, as `messages`.
fn bounded_input<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<Input>, D::Error> {
    struct Bounded;
    impl<'de> serde::de::Visitor<'de> for Bounded {
        type Value = Option<Input>;
        fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
            f.write_str("a string or an array of input items")
        }
        fn visit_unit<E: serde::de::Error>(self) -> Result<Option<Input>, E> {
            Ok(None)
        }
        fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Option<Input>, E> {
            Ok(Some(Input::Text(v.to_owned())))
        }
        fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<Option<Input>, A::Error> {
            let mut out = Vec::new();
            while let Some(item) = seq.next_element::<Value>()? {
                if out.len() == MAX_MESSAGES {
                    return Err(serde::de::Error::custom(format!(
                        "more than {MAX_MESSAGES} input items"
                    )));
                }
                out.push(item);
            }
            Ok(Some(Input::Items(out)))
        }
    }
    d.deserialize_any(Bounded)
}

#[derive(Deserialize)]
struct Message {
    role: String,
    #[serde(default)]
    content: Option<Value>,
}

/// Reads `messages` but stops with an error past [`MAX_MESSAGES`] entries.
fn bounded_messages<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<Vec<Message>>, D::Error> {
    struct Bounded;
    impl<'de> serde::de::Visitor<'de> for Bounded {
        type Value = Vec<Message>;
        fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
            f.write_str("an array of messages")
        }
        fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<Vec<Message>, A::Error> {
            let mut out = Vec::new();
            while let Some(m) = seq.next_element()? {
                if out.len() == MAX_MESSAGES {
                    return Err(serde::de::Error::custom(format!("more than {MAX_MESSAGES} messages")));
                }
                out.push(m);
            }
            Ok(out)
        }
    }
    d.deserialize_seq(Bounded).map(Some)
}

/// A positive token count as pydantic's lax `int` reads it (`5`, `5.0`, `"5"`); anything
/// else, null included, is absent (vLLM rejects it or uses its default).
fn lax_count<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
    let v = Value::deserialize(d)?;
    let n = match &v {
        Value::Number(n) => n
            .as_u64()
            .or_else(|| n.as_f64().filter(|f| f.fract() == 0.0 && *f >= 0.0).map(|f| f as u64)),
        Value::String(s) => s.trim().parse::<u64>().ok(),
        _ => None,
    };
    Ok(n.filter(|n| *n > 0))
}

/// A field's value as given, `null` included (`Option` alone reads `null` as absent).
fn present<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<Value>, D::Error> {
    Value::deserialize(d).map(Some)
}

/// A flag as pydantic's lax `bool` reads it (`true`, `"true"`, `1`, `"yes"`…); null and
/// anything else are false.
fn lax_bool<'de, D: serde::Deserializer<'de>>(d: D) -> Result<bool, D::Error> {
    Ok(truthy(&Value::deserialize(d)?))
}

fn truthy(v: &Value) -> bool {
    match v {
        Value::Bool(b) => *b,
        Value::Number(n) => n.as_f64() == Some(1.0),
        Value::String(s) => matches!(s.to_ascii_lowercase().as_str(), "true" | "1" | "yes" | "on" | "t" | "y"),
        _ => false,
    }
}

/// Parses a request body of the given API kind.
pub fn parse(kind: ApiKind, body: &[u8]) -> Result<ParsedRequest, RequestError> {
    match kind {
        ApiKind::Responses => return parse_responses(body),
        ApiKind::Messages => return parse_messages(body),
        ApiKind::Chat | ApiKind::Completions => {}
    }
    let body: Body = serde_json::from_slice(body).map_err(|e| RequestError::Malformed(e.to_string()))?;
    let model = body.model.unwrap_or_default();
    let (canonical, prompt_tokens) = match kind {
        ApiKind::Chat => {
            let messages = body.messages.ok_or(RequestError::MissingField("messages"))?;
            chat_canonical(&messages, body.tools.as_ref())?
        }
        ApiKind::Completions | ApiKind::Responses | ApiKind::Messages => {
            completion_canonical(body.prompt.as_ref().ok_or(RequestError::MissingField("prompt"))?)?
        }
    };
    // A batch of prompts is left unread: vLLM reports the cached tokens of one of its
    // prompts (the last to finish), which says nothing of the first, the one routed on.
    let batch = body.prompt.as_ref().is_some_and(Prompt::is_batch);
    let asked = body
        .stream_options
        .as_ref()
        .and_then(|o| o.get("include_usage"))
        .is_some_and(truthy);
    Ok(ParsedRequest {
        model,
        canonical,
        prompt_tokens,
        max_tokens: body.max_completion_tokens.or(body.max_tokens),
        stream: body.stream,
        reports_usage: !batch && (!body.stream || asked),
        usage_unasked: !batch && body.stream && !asked,
        user: body.user,
        cache_salt: body.cache_salt,
        continues: None,
        stores: false,
    })
}

fn parse_responses(body: &[u8]) -> Result<ParsedRequest, RequestError> {
    let body: ResponsesBody = serde_json::from_slice(body).map_err(|e| RequestError::Malformed(e.to_string()))?;
    let input = body.input.as_ref().ok_or(RequestError::MissingField("input"))?;
    let (canonical, prompt_tokens) = chat_canonical(
        &responses_messages(body.instructions.as_deref(), input)?,
        body.tools.as_ref(),
    )?;
    let continues = body.previous_response_id.filter(|id| !id.is_empty());
    Ok(ParsedRequest {
        model: body.model.unwrap_or_default(),
        canonical,
        prompt_tokens,
        max_tokens: body.max_output_tokens,
        stream: body.stream,
        // A Responses answer ends with `usage` (a stream's in `response.completed`), but
        // for a continuation it counts the stored history too, which the filter never saw,
        // and a background one answers before any work.
        reports_usage: continues.is_none() && !body.background,
        usage_unasked: false,
        user: body.user,
        cache_salt: body.cache_salt,
        continues,
        stores: body.store.as_ref().is_none_or(truthy),
    })
}

/// An Anthropic body, read with chat's `Body` (its `messages` have a role and a content,
/// `system` is one more field): one reader for both keeps the wasm module small.
fn parse_messages(body: &[u8]) -> Result<ParsedRequest, RequestError> {
    let body: Body = serde_json::from_slice(body).map_err(|e| RequestError::Malformed(e.to_string()))?;
    let messages = body.messages.as_ref().ok_or(RequestError::MissingField("messages"))?;
    let tools = body.tools.as_ref().and_then(Value::as_array).map(Vec::as_slice);
    let (canonical, prompt_tokens) = anthropic_canonical(body.system.as_ref(), messages, tools)?;
    Ok(ParsedRequest {
        model: body.model.unwrap_or_default(),
        canonical,
        prompt_tokens,
        max_tokens: body.max_tokens,
        stream: body.stream,
        // vLLM's translation puts the usage in every answer, a stream's in `message_delta`.
        reports_usage: true,
        usage_unasked: false,
        user: None,
        cache_salt: None,
        continues: None,
        stores: false,
    })
}

/// The canonical text of an Anthropic body: byte for byte what `chat_canonical` makes of
/// the chat request vLLM translates it to, written directly (building that request as
/// JSON values cost the wasm module 25 KB).
fn anthropic_canonical(
    system: Option<&Value>,
    messages: &[Message],
    tools: Option<&[Value]>,
) -> Result<(Vec<u8>, Tokens), RequestError> {
    let invalid = |field| RequestError::InvalidField {
        field,
        reason: "is not what the Messages API allows",
    };
    let mut c = Canon::default();
    if let Some(tools) = tools.filter(|t| !t.is_empty()) {
        // Chat's function tools as compact JSON with sorted keys.
        c.out.push(b'[');
        for (i, t) in tools.iter().enumerate() {
            if i > 0 {
                c.out.push(b',');
            }
            c.out.extend_from_slice(br#"{"function":{"#);
            let mut first = true;
            for (to, from) in [
                ("description", "description"),
                ("name", "name"),
                ("parameters", "input_schema"),
            ] {
                if let Some(v) = t.get(from).filter(|v| !v.is_null()) {
                    if !first {
                        c.out.push(b',');
                    }
                    first = false;
                    // vLLM gives a schema without a type the type `object` (a copy only
                    // then: a client's tools, sent with every request, may be large).
                    let typed = match v {
                        Value::Object(schema) if from == "input_schema" && !schema.contains_key("type") => {
                            let mut schema = schema.clone();
                            schema.insert("type".to_string(), Value::String("object".to_string()));
                            Some(Value::Object(schema))
                        }
                        _ => None,
                    };
                    let v = typed.as_ref().unwrap_or(v);
                    c.out.extend_from_slice(format!("\"{to}\":{v}").as_bytes());
                }
            }
            c.out.extend_from_slice(br#"},"type":"function"}"#);
        }
        c.out.extend_from_slice(b"]\x1e");
    }
    // System messages as vLLM places them (vllm/entrypoints/anthropic/inline_system.py):
    // those leading the conversation join the system prompt, separated by a blank line;
    // a later one stays where it is (moved past the tool results when it sits between a
    // tool call and them), as a system turn, or folded into the neighbouring user turn
    // where the template has no distinct one; either way it changes the prompt where it
    // stands, so a conversation that gains one keeps its prefix (joined into the first
    // system message, as vLLM's earlier translation did, it changed the prompt's start).
    let mut system_parts: Vec<String> = Vec::new();
    match system {
        None | Some(Value::Null) => {}
        Some(Value::String(text)) => system_parts.push(text.clone()),
        Some(Value::Array(blocks)) => system_parts.push(system_texts(blocks).collect()),
        Some(_) => return Err(invalid("system")),
    }
    let leading = messages.iter().take_while(|m| m.role == "system").count();
    for m in &messages[..leading] {
        system_parts.push(inline_system_text(m).ok_or_else(|| invalid("messages[].content"))?);
    }
    system_parts.retain(|t| !t.is_empty());
    if !system_parts.is_empty() {
        c.message("system", system_parts.join("\n\n").as_bytes());
    }
    for m in after_tool_results(&messages[leading..]) {
        let role = match anthropic_role(m) {
            "system" => {
                let text = inline_system_text(m).ok_or_else(|| invalid("messages[].content"))?;
                if !text.is_empty() {
                    c.message("system", text.as_bytes());
                }
                continue;
            }
            role => role,
        };
        let blocks = match &m.content {
            Some(Value::String(text)) => {
                c.message(role, text.as_bytes());
                continue;
            }
            Some(Value::Array(blocks)) => blocks,
            _ => return Err(invalid("messages[].content")),
        };
        // The message's own content, written after the tool messages its blocks make.
        let mut own = Vec::new();
        let (mut parts, mut media) = (0usize, Media::default());
        for b in blocks {
            match b.get("type").and_then(Value::as_str) {
                Some("text") => {
                    if let Some(text) = b.get("text").and_then(Value::as_str).filter(|t| !t.is_empty()) {
                        own.extend_from_slice(text.as_bytes());
                        parts += 1;
                    }
                }
                // vLLM skips an image without a source.
                Some("image")
                    if b.get("source")
                        .is_some_and(|s| s.as_object().is_some_and(|o| !o.is_empty())) =>
                {
                    let json = image_part(b.get("source"));
                    media.parts += 1;
                    media.bytes += json.len();
                    own.extend_from_slice(json.as_bytes());
                    parts += 1;
                }
                Some("tool_result") if role == "user" => user_tool_result(&mut c, b.get("content")),
                Some("tool_result") => {
                    own.extend_from_slice(b"Tool result: ");
                    match b.get("content") {
                        None | Some(Value::Null) => {}
                        Some(Value::String(text)) => own.extend_from_slice(text.as_bytes()),
                        Some(Value::Array(items)) if items.is_empty() => {}
                        Some(other) => own.extend_from_slice(other.to_string().as_bytes()),
                    }
                    parts += 1;
                }
                // `tool_use` and `thinking` become fields chat does not hash; the rest is
                // dropped.
                _ => {}
            }
        }
        // A user message left without content is no message; an assistant's always is one.
        if parts > 0 || role != "user" {
            c.media.parts += media.parts;
            c.media.bytes += media.bytes;
            c.message(role, &own);
        }
    }
    if c.messages == 0 {
        return Err(RequestError::InvalidField {
            field: "messages",
            reason: "must not be empty",
        });
    }
    let tokens = text_tokens(c.out.len() - c.media.bytes)
        + TOKENS_PER_MESSAGE * c.messages
        + TOKENS_PER_MEDIA_PART.saturating_mul(c.media.parts);
    Ok((c.out, Tokens(tokens)))
}

/// The first text of Claude Code's attribution block in `system`: it carries a hash that
/// changes with every request, and vLLM leaves it out of the prompt so that the prefix can
/// be cached (vllm-project/vllm#36829); so does kvroute, or no two such requests would share
/// a block.
const BILLING_HEADER: &str = "x-anthropic-billing-header";

/// The texts vLLM keeps of system blocks: those of the text blocks, but the attribution
/// block's and empty ones.
fn system_texts(blocks: &[Value]) -> impl Iterator<Item = &str> {
    blocks
        .iter()
        .filter(|b| b.get("type").and_then(Value::as_str) == Some("text"))
        .filter_map(|b| b.get("text").and_then(Value::as_str))
        .filter(|t| !t.is_empty() && !t.starts_with(BILLING_HEADER))
}

/// A message's role as vLLM reads it: Claude Code's own roles for context and messages,
/// `ctx` and `msg`, are user turns.
fn anthropic_role(m: &Message) -> &str {
    match m.role.as_str() {
        "ctx" | "msg" => "user",
        role => role,
    }
}

/// A system message's text as vLLM reads it: a string (none if it is Claude Code's
/// attribution), or its text blocks' (`system_texts`); `None` for other content.
fn inline_system_text(m: &Message) -> Option<String> {
    match &m.content {
        Some(Value::String(text)) if text.starts_with(BILLING_HEADER) => Some(String::new()),
        Some(Value::String(text)) => Some(text.clone()),
        Some(Value::Array(blocks)) => Some(system_texts(blocks).collect()),
        _ => None,
    }
}

/// `messages` in vLLM's order: a system message between an assistant's tool call and the
/// user turn answering it goes after that turn (a template may not part a call from its
/// result).
fn after_tool_results(messages: &[Message]) -> Vec<&Message> {
    let (mut out, mut held) = (Vec::with_capacity(messages.len()), Vec::new());
    let mut awaiting_results = false;
    for m in messages {
        let role = anthropic_role(m);
        if role == "system" {
            if awaiting_results {
                held.push(m);
            } else {
                out.push(m);
            }
            continue;
        }
        if role == "assistant" {
            out.append(&mut held);
        }
        out.push(m);
        if role == "user" {
            out.append(&mut held);
        }
        awaiting_results = role == "assistant"
            && matches!(&m.content, Some(Value::Array(blocks))
                if blocks.iter().any(|b| b.get("type").and_then(Value::as_str) == Some("tool_use")));
    }
    out.append(&mut held);
    out
}

/// A user's `tool_result` block as the messages vLLM makes of it: a `tool` message of its
/// text (a string, or its text items joined by newlines), then a user message of its images,
/// then a `tool` message of the tools it references (Claude Code's tool search).
fn user_tool_result(c: &mut Canon, content: Option<&Value>) {
    let items = match content {
        Some(Value::String(text)) => return c.message("tool", text.as_bytes()),
        Some(Value::Array(items)) => items,
        _ => return c.message("tool", b""),
    };
    let of_type = |kind: &'static str| {
        items
            .iter()
            .filter(move |i| i.get("type").and_then(Value::as_str) == Some(kind))
    };
    let texts: Vec<&str> = of_type("text")
        .map(|i| i.get("text").and_then(Value::as_str).unwrap_or(""))
        .collect();
    c.message("tool", texts.join("\n").as_bytes());
    // vLLM skips an image whose source gives no URL (a `url` source without one).
    let images: Vec<String> = of_type("image")
        .filter(|i| {
            let source = i.get("source");
            let field = |name| source.and_then(|s| s.get(name)).and_then(Value::as_str);
            field("type") != Some("url") || field("url").is_some_and(|u| !u.is_empty())
        })
        .map(|i| image_part(i.get("source")))
        .collect();
    if !images.is_empty() {
        let joined = images.concat();
        c.media.parts += images.len() as u64;
        c.media.bytes += joined.len();
        c.message("user", joined.as_bytes());
    }
    let references: Vec<Value> = of_type("tool_reference")
        .filter_map(|i| {
            let name = ["tool_name", "name"]
                .iter()
                .find_map(|k| i.get(*k).and_then(Value::as_str).filter(|n| !n.is_empty()));
            name.map(|n| {
                let mut part = serde_json::Map::new();
                part.insert("name".to_string(), Value::String(n.to_string()));
                part.insert("type".to_string(), Value::String("tool_reference".to_string()));
                Value::Object(part)
            })
        })
        .collect();
    if !references.is_empty() {
        let mut content = Vec::new();
        append_parts(&mut content, &references, &mut c.media);
        c.message("tool", &content);
    }
}

/// An Anthropic image `source` as the chat image part vLLM makes of it: a `url` source's
/// URL, otherwise a `data:` URI of its media type (JPEG unless it says) and data.
fn image_part(source: Option<&Value>) -> String {
    let field = |name| source.and_then(|s| s.get(name)).and_then(Value::as_str);
    let url = match field("type") {
        Some("url") => field("url").unwrap_or("").to_string(),
        _ => format!(
            "data:{};base64,{}",
            field("media_type").unwrap_or("image/jpeg"),
            field("data").unwrap_or("")
        ),
    };
    format!(r#"{{"image_url":{{"url":{}}},"type":"image_url"}}"#, Value::String(url))
}

/// Canonical text written message by message (`chat_canonical`'s format).
#[derive(Default)]
struct Canon {
    out: Vec<u8>,
    media: Media,
    messages: u64,
}

impl Canon {
    fn message(&mut self, role: &str, content: &[u8]) {
        self.out.extend_from_slice(role.as_bytes());
        self.out.push(0x1f);
        self.out.extend_from_slice(content);
        self.out.push(0x1e);
        self.messages += 1;
    }
}

/// A Responses body's `instructions` and `input` as chat messages (see the module's
/// canonical text).
fn responses_messages(instructions: Option<&str>, input: &Input) -> Result<Vec<Message>, RequestError> {
    let mut out = Vec::new();
    if let Some(text) = instructions.filter(|t| !t.is_empty()) {
        out.push(Message {
            role: "system".to_string(),
            content: Some(Value::String(text.to_string())),
        });
    }
    match input {
        Input::Text(text) => out.push(Message {
            role: "user".to_string(),
            content: Some(Value::String(text.clone())),
        }),
        Input::Items(items) => {
            for item in items {
                let role = item.get("role").and_then(Value::as_str);
                let kind = item.get("type").and_then(Value::as_str).unwrap_or("message");
                out.push(match role {
                    Some(role) if kind == "message" => Message {
                        role: role.to_string(),
                        content: item.get("content").cloned(),
                    },
                    _ if item.is_object() => Message {
                        role: kind.to_string(),
                        content: Some(Value::String(item.to_string())),
                    },
                    _ => {
                        return Err(RequestError::InvalidField {
                            field: "input",
                            reason: "must be a string or an array of input items",
                        })
                    }
                });
            }
        }
    }
    if out.is_empty() {
        return Err(RequestError::InvalidField {
            field: "input",
            reason: "must not be empty",
        });
    }
    Ok(out)
}

fn text_tokens(bytes: usize) -> u64 {
    (bytes as u64).div_ceil(BYTES_PER_TOKEN)
}

fn chat_canonical(messages: &[Message], tools: Option<&Value>) -> Result<(Vec<u8>, Tokens), RequestError> {
    if messages.is_empty() {
        return Err(RequestError::InvalidField {
            field: "messages",
            reason: "must not be empty",
        });
    }
    let mut out = Vec::new();
    let mut media = Media::default();
    if let Some(tools) = tools.filter(|t| !t.is_null() && t.as_array().is_none_or(|a| !a.is_empty())) {
        // serde_json's map is a BTreeMap here, so re-serialising sorts keys and drops whitespace.
        out.extend_from_slice(tools.to_string().as_bytes());
        out.push(0x1e);
    }
    for message in messages {
        out.extend_from_slice(message.role.as_bytes());
        out.push(0x1f);
        match &message.content {
            None | Some(Value::Null) => {}
            Some(Value::String(text)) => out.extend_from_slice(text.as_bytes()),
            Some(Value::Array(parts)) => append_parts(&mut out, parts, &mut media),
            Some(_) => {
                return Err(RequestError::InvalidField {
                    field: "messages[].content",
                    reason: "must be a string or an array of content parts",
                })
            }
        }
        out.push(0x1e);
    }
    let tokens = text_tokens(out.len() - media.bytes)
        + TOKENS_PER_MESSAGE * messages.len() as u64
        + TOKENS_PER_MEDIA_PART.saturating_mul(media.parts);
    Ok((out, Tokens(tokens)))
}

/// The non-text content parts of a chat body: in the canonical text (they are part of the
/// prefix), counted apart in the token estimate.
#[derive(Default)]
struct Media {
    parts: u64,
    bytes: usize,
}

fn append_parts(out: &mut Vec<u8>, parts: &[Value], media: &mut Media) {
    for part in parts {
        match part.get("text").and_then(Value::as_str) {
            Some(text)
                if matches!(
                    part.get("type").and_then(Value::as_str),
                    Some("text" | "input_text" | "output_text")
                ) =>
            {
                out.extend_from_slice(text.as_bytes())
            }
            _ => {
                let json = part.to_string();
                if is_media(part) {
                    media.parts += 1;
                    media.bytes += json.len();
                }
                out.extend_from_slice(json.as_bytes());
            }
        }
    }
}

/// Whether a content part that is not text is media (an image, audio, a video, a file),
/// counted as `TOKENS_PER_MEDIA_PART`; any other part (a tool reference, a refusal) is text
/// its JSON's length measures.
fn is_media(part: &Value) -> bool {
    match part.get("type").and_then(Value::as_str) {
        Some(kind) => ["image", "audio", "video", "file"].iter().any(|m| kind.contains(m)),
        None => true,
    }
}

fn completion_canonical(prompt: &Prompt) -> Result<(Vec<u8>, Tokens), RequestError> {
    match prompt {
        Prompt::Text(text) => Ok((text.as_bytes().to_vec(), Tokens(text_tokens(text.len())))),
        Prompt::Texts { first, tokens, .. } => Ok((first.as_bytes().to_vec(), Tokens(*tokens))),
        Prompt::Ids(ids) => Ok((ids_bytes(ids), Tokens(ids.len() as u64))),
        Prompt::IdBatches { first, tokens, .. } => Ok((ids_bytes(first), Tokens(*tokens))),
        Prompt::Empty => Err(RequestError::InvalidField {
            field: "prompt",
            reason: "must not be empty",
        }),
    }
}

/// The completions `prompt`, read by a visitor instead of into a JSON tree: token ids stay
/// 4 bytes each (a `Value` costs 32), and of a batch only the first prompt is kept.
#[derive(Debug)]
enum Prompt {
    Text(String),
    /// `batch`: more than one prompt.
    Texts {
        first: String,
        tokens: u64,
        batch: bool,
    },
    Ids(Vec<u32>),
    IdBatches {
        first: Vec<u32>,
        tokens: u64,
        batch: bool,
    },
    Empty,
}

impl Prompt {
    /// Several prompts in one request (vLLM runs each as its own sequence).
    fn is_batch(&self) -> bool {
        matches!(
            self,
            Prompt::Texts { batch: true, .. } | Prompt::IdBatches { batch: true, .. }
        )
    }
}

/// One element of a `prompt` array.
enum PromptItem {
    Id(u32),
    Text(String),
    Ids(Vec<u32>),
}

const PROMPT_SHAPE: &str = "a string, an array of strings, or an array of token ids (integers in 0..2^32)";

impl<'de> Deserialize<'de> for Prompt {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Prompt, D::Error> {
        struct V;
        impl<'de> serde::de::Visitor<'de> for V {
            type Value = Prompt;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str(PROMPT_SHAPE)
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Prompt, E> {
                Ok(Prompt::Text(v.to_owned()))
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<Prompt, A::Error> {
                let mut out = Prompt::Empty;
                while let Some(item) = seq.next_element::<PromptItem>()? {
                    out = match (out, item) {
                        (Prompt::Empty, PromptItem::Id(id)) => Prompt::Ids(vec![id]),
                        (Prompt::Ids(mut ids), PromptItem::Id(id)) => {
                            ids.push(id);
                            Prompt::Ids(ids)
                        }
                        (Prompt::Empty, PromptItem::Text(t)) => Prompt::Texts {
                            tokens: text_tokens(t.len()),
                            first: t,
                            batch: false,
                        },
                        (Prompt::Texts { first, tokens, .. }, PromptItem::Text(t)) => Prompt::Texts {
                            first,
                            tokens: tokens + text_tokens(t.len()),
                            batch: true,
                        },
                        (Prompt::Empty, PromptItem::Ids(ids)) => Prompt::IdBatches {
                            tokens: ids.len() as u64,
                            first: ids,
                            batch: false,
                        },
                        (Prompt::IdBatches { first, tokens, .. }, PromptItem::Ids(ids)) => Prompt::IdBatches {
                            first,
                            tokens: tokens + ids.len() as u64,
                            batch: true,
                        },
                        _ => {
                            return Err(serde::de::Error::custom(format!(
                                "prompt mixes kinds: it must be {PROMPT_SHAPE}"
                            )))
                        }
                    };
                }
                Ok(out)
            }
        }
        d.deserialize_any(V)
    }
}

impl<'de> Deserialize<'de> for PromptItem {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<PromptItem, D::Error> {
        struct V;
        impl<'de> serde::de::Visitor<'de> for V {
            type Value = PromptItem;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str(PROMPT_SHAPE)
            }
            fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<PromptItem, E> {
                u32::try_from(v)
                    .map(PromptItem::Id)
                    .map_err(|_| E::custom("token ids must be integers in 0..2^32"))
            }
            fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<PromptItem, E> {
                u32::try_from(v)
                    .map(PromptItem::Id)
                    .map_err(|_| E::custom("token ids must be integers in 0..2^32"))
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<PromptItem, E> {
                Ok(PromptItem::Text(v.to_owned()))
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<PromptItem, A::Error> {
                let mut ids = Vec::new();
                while let Some(id) = seq.next_element::<u32>()? {
                    ids.push(id);
                }
                Ok(PromptItem::Ids(ids))
            }
        }
        d.deserialize_any(V)
    }
}

fn ids_bytes(ids: &[u32]) -> Vec<u8> {
    ids.iter().flat_map(|id| id.to_le_bytes()).collect()
}

#[cfg(test)]
mod tests;

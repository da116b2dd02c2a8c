//! Parsing OpenAI-style request bodies into what routing needs: the model, the canonical
//! prompt text, a prompt-length estimate and the sampling fields that matter for placement.
//!
//! Canonical text (part of the prefix-hashing spec, see `hashing`):
//! - chat: the `tools` array as compact JSON with sorted keys (if present and non-empty),
//!   then per message: role, `\x1f`, content text, `\x1e`. Content given as parts joins the
//!   `text` parts; any other part (an image, audio) contributes its compact JSON, so two
//!   different images never share affinity.
//! - completions: the prompt string; for an array of strings, the first string is the
//!   canonical text (vLLM runs them as separate sequences) while all count toward the token
//!   estimate; token ids are written as 4-byte little-endian integers.
//!
//! Token estimate (documented rule): ceil(bytes / 4) for text, plus 4 tokens per chat
//! message for the template; token-id prompts count exactly.

use std::fmt;

use serde::Deserialize;
use serde_json::Value;

use crate::types::Tokens;

/// Which OpenAI API the body belongs to (from the request path).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ApiKind {
    Chat,
    Completions,
}

impl ApiKind {
    /// The inference paths the filter acts on; everything else passes through.
    pub fn from_path(path: &str) -> Option<ApiKind> {
        let path = path.split('?').next().unwrap_or(path);
        match path {
            "/v1/chat/completions" => Some(ApiKind::Chat),
            "/v1/completions" => Some(ApiKind::Completions),
            _ => None,
        }
    }
}

pub const BYTES_PER_TOKEN: u64 = 4;
const TOKENS_PER_MESSAGE: u64 = 4;

/// What the router needs to know about one request body.
#[derive(Clone, Debug, PartialEq)]
pub struct ParsedRequest {
    pub model: String,
    /// Canonical bytes the prefix blocks are cut from.
    pub canonical: Vec<u8>,
    pub prompt_tokens: Tokens,
    pub max_tokens: Option<u64>,
    pub stream: bool,
    pub user: Option<String>,
    pub cache_salt: Option<String>,
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
    messages: Option<Vec<Message>>,
    prompt: Option<Value>,
    tools: Option<Value>,
    max_tokens: Option<u64>,
    max_completion_tokens: Option<u64>,
    #[serde(default)]
    stream: bool,
    user: Option<String>,
    cache_salt: Option<String>,
}

#[derive(Deserialize)]
struct Message {
    role: String,
    #[serde(default)]
    content: Option<Value>,
}

/// Parses a request body of the given API kind.
pub fn parse(kind: ApiKind, body: &[u8]) -> Result<ParsedRequest, RequestError> {
    let body: Body = serde_json::from_slice(body).map_err(|e| RequestError::Malformed(e.to_string()))?;
    let model = body.model.ok_or(RequestError::MissingField("model"))?;
    let (canonical, prompt_tokens) = match kind {
        ApiKind::Chat => {
            let messages = body.messages.ok_or(RequestError::MissingField("messages"))?;
            chat_canonical(&messages, body.tools.as_ref())?
        }
        ApiKind::Completions => {
            completion_canonical(body.prompt.as_ref().ok_or(RequestError::MissingField("prompt"))?)?
        }
    };
    Ok(ParsedRequest {
        model,
        canonical,
        prompt_tokens,
        max_tokens: body.max_completion_tokens.or(body.max_tokens),
        stream: body.stream,
        user: body.user,
        cache_salt: body.cache_salt,
    })
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
            Some(Value::Array(parts)) => append_parts(&mut out, parts),
            Some(_) => {
                return Err(RequestError::InvalidField {
                    field: "messages[].content",
                    reason: "must be a string or an array of content parts",
                })
            }
        }
        out.push(0x1e);
    }
    let tokens = text_tokens(out.len()) + TOKENS_PER_MESSAGE * messages.len() as u64;
    Ok((out, Tokens(tokens)))
}

fn append_parts(out: &mut Vec<u8>, parts: &[Value]) {
    for part in parts {
        match part.get("text").and_then(Value::as_str) {
            Some(text) if part.get("type").and_then(Value::as_str) == Some("text") => {
                out.extend_from_slice(text.as_bytes())
            }
            _ => out.extend_from_slice(part.to_string().as_bytes()),
        }
    }
}

fn completion_canonical(prompt: &Value) -> Result<(Vec<u8>, Tokens), RequestError> {
    const INVALID: RequestError = RequestError::InvalidField {
        field: "prompt",
        reason: "must be a string, an array of strings, or an array of token ids",
    };
    match prompt {
        Value::String(text) => Ok((text.as_bytes().to_vec(), Tokens(text_tokens(text.len())))),
        Value::Array(items) if items.is_empty() => Err(RequestError::InvalidField {
            field: "prompt",
            reason: "must not be empty",
        }),
        Value::Array(items) => match &items[0] {
            Value::String(first) => {
                let mut total = 0;
                for item in items {
                    total += text_tokens(item.as_str().ok_or(INVALID)?.len());
                }
                Ok((first.as_bytes().to_vec(), Tokens(total)))
            }
            Value::Number(_) => token_ids(items).map(|ids| (ids_bytes(&ids), Tokens(ids.len() as u64))),
            Value::Array(first) => {
                // A batch of token-id prompts: the first is canonical, all count.
                let mut total = 0;
                for item in items {
                    total += item.as_array().ok_or(INVALID)?.len() as u64;
                }
                token_ids(first).map(|ids| (ids_bytes(&ids), Tokens(total)))
            }
            _ => Err(INVALID),
        },
        _ => Err(INVALID),
    }
}

fn token_ids(items: &[Value]) -> Result<Vec<u32>, RequestError> {
    items
        .iter()
        .map(|v| v.as_u64().and_then(|n| u32::try_from(n).ok()))
        .collect::<Option<Vec<u32>>>()
        .ok_or(RequestError::InvalidField {
            field: "prompt",
            reason: "token ids must be integers in 0..2^32",
        })
}

fn ids_bytes(ids: &[u32]) -> Vec<u8> {
    ids.iter().flat_map(|id| id.to_le_bytes()).collect()
}

#[cfg(test)]
mod tests;

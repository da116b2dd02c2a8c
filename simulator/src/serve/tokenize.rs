//! `/tokenize` and `/detokenize` as vLLM 0.33 serves them, over the simulator's token rule.
//!
//! Shapes (vLLM `entrypoints/serve/tokenize/protocol.py`): `POST /tokenize` takes either
//! `{"model"?, "prompt", "add_special_tokens"?, "return_token_strs"?}` or
//! `{"model"?, "messages", "tools"?, "add_generation_prompt"?, "return_token_strs"?, …}` and
//! answers `{"count", "max_model_len", "tokens", "token_strs"}`; `POST /detokenize` takes
//! `{"model"?, "tokens"}` and answers `{"prompt"}`. An unknown model is a 404 as for inference.
//!
//! The rule (documented, reversible): a text token is 4 bytes of the canonical text read as a
//! little-endian `u32` (the last one zero-padded), so `tokens` sent back as a completions
//! prompt give the filter and the engine the same bytes — the same prefix blocks — as the
//! text did. A chat prompt adds 4 template tokens per message (Llama 3's special ids
//! 128000–128255, whose bytes `xx F4 01 00` are never UTF-8 text), so `count` equals the
//! `prompt_tokens` an inference request reports. Zero bytes padding the last token are
//! dropped when detokenising (a prompt ending in NUL characters loses them).

use kvroute_core::request::{parse, ApiKind};
use serde_json::Value;

use super::errors::ApiError;
use super::request::unreadable;

/// Llama 3's `<|begin_of_text|>`, `<|start_header_id|>`, `<|end_header_id|>`, `<|eot_id|>`.
const TEMPLATE_IDS: [u32; 4] = [128_000, 128_006, 128_007, 128_009];
/// Llama 3's special tokens: never text.
const SPECIAL_IDS: std::ops::RangeInclusive<u32> = 128_000..=128_255;

/// The token ids of `text` under the 4-byte rule.
pub fn text_ids(text: &[u8]) -> Vec<u32> {
    text.chunks(4)
        .map(|c| {
            let mut b = [0u8; 4];
            b[..c.len()].copy_from_slice(c);
            u32::from_le_bytes(b)
        })
        .collect()
}

/// Text of canonical bytes that came from token ids (4 bytes each, padding dropped).
pub fn detokenize_ids(bytes: &[u8]) -> String {
    let ids: Vec<u32> = bytes
        .chunks_exact(4)
        .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    detokenize(&ids)
}

/// The text of `ids`: text tokens back to their bytes, special tokens skipped.
pub fn detokenize(ids: &[u32]) -> String {
    let mut bytes = Vec::with_capacity(ids.len() * 4);
    for id in ids.iter().filter(|id| !SPECIAL_IDS.contains(*id)) {
        let b = id.to_le_bytes();
        let len = b.iter().rposition(|x| *x != 0).map_or(0, |i| i + 1);
        bytes.extend_from_slice(&b[..len]);
    }
    String::from_utf8_lossy(&bytes).into_owned()
}

/// `POST /tokenize`: the response body, or vLLM's error.
pub fn tokenize(body: &[u8], served: &[String], max_model_len: u64) -> Result<Value, ApiError> {
    let json: Value = serde_json::from_slice(body).map_err(|e| ApiError::schema(format!("JSON decode error: {e}")))?;
    check_model(&json, served)?;
    let (kind, request) = if let Some(messages) = json.get("messages") {
        let mut r = serde_json::json!({"model": "", "messages": messages});
        if let Some(tools) = json.get("tools") {
            r["tools"] = tools.clone();
        }
        (ApiKind::Chat, r)
    } else {
        let prompt = json.get("prompt").cloned().unwrap_or(Value::Null);
        if !prompt.is_string() {
            return Err(ApiError::schema("prompt: Input should be a valid string"));
        }
        (ApiKind::Completions, serde_json::json!({"model": "", "prompt": prompt}))
    };
    let messages = request["messages"].as_array().map_or(0, Vec::len);
    let mut ids = Vec::new();
    if !request["prompt"].as_str().is_some_and(str::is_empty) {
        let parsed = parse(kind, request.to_string().as_bytes()).map_err(unreadable)?;
        ids = text_ids(&parsed.canonical);
        debug_assert_eq!(
            ids.len() as u64 + 4 * messages as u64,
            parsed.prompt_tokens.0,
            "tokenize counts what inference reports"
        );
    }
    for _ in 0..messages {
        ids.extend(TEMPLATE_IDS);
    }
    let strs = json
        .get("return_token_strs")
        .and_then(Value::as_bool)
        .unwrap_or(false)
        .then(|| ids.iter().map(|id| detokenize(&[*id])).collect::<Vec<_>>());
    Ok(serde_json::json!({"count": ids.len(), "max_model_len": max_model_len, "tokens": ids, "token_strs": strs}))
}

/// `POST /detokenize`.
pub fn detokenize_body(body: &[u8], served: &[String]) -> Result<Value, ApiError> {
    let json: Value = serde_json::from_slice(body).map_err(|e| ApiError::schema(format!("JSON decode error: {e}")))?;
    check_model(&json, served)?;
    let Some(tokens) = json.get("tokens").and_then(Value::as_array) else {
        return Err(ApiError::schema("tokens: Field required"));
    };
    let mut ids = Vec::with_capacity(tokens.len());
    for t in tokens {
        match t.as_u64().and_then(|v| u32::try_from(v).ok()) {
            Some(id) => ids.push(id),
            None => {
                return Err(ApiError::validation(
                    &format!("Token id {t} is out of vocabulary"),
                    "tokens",
                    t,
                ))
            }
        }
    }
    Ok(serde_json::json!({"prompt": detokenize(&ids)}))
}

fn check_model(json: &Value, served: &[String]) -> Result<(), ApiError> {
    match json.get("model") {
        None | Some(Value::Null) => Ok(()),
        Some(Value::String(m)) if m.is_empty() || served.contains(m) => Ok(()),
        Some(Value::String(m)) => Err(ApiError::unknown_model(m)),
        Some(_) => Err(ApiError::schema("model: Input should be a valid string")),
    }
}

//! Error bodies as vLLM 0.33's OpenAI server writes them.
//!
//! `{"error": {"message", "type", "param", "code"}}` (vLLM's `ErrorResponse`/`ErrorInfo`). A
//! body that cannot be read into vLLM's request type (not JSON, not of the JSON media type, a
//! field missing or of the wrong type, a refusal by one of the request model's validators) is
//! answered by vLLM's `RequestValidationError` handler: a 400 whose type is the status's phrase,
//! `Bad Request`. What vLLM's serving code refuses once the request is read keeps its
//! exception's type: a validation failure (`VLLMValidationError`) is a 400 `BadRequestError`
//! whose `param` names the parameter and whose message ends with ` (parameter=…, value=…)`, as
//! that exception's `__str__` prints it; an unknown model is a 404 `NotFoundError` with
//! `param: "model"`.
//! Messages are vLLM's texts (`vllm/renderers/params.py`'s `TokenizeParams` for the context,
//! `vllm/entrypoints/openai/engine/serving.py`'s `_check_model`; the Responses API's,
//! `serving_responses.py`, are of type `invalid_request_error`).
//!
//! The Messages API writes its serving code's refusals in Anthropic's shape,
//! `{"type": "error", "error": {"type", "message"}}` with the same status and type
//! (`vllm/entrypoints/anthropic/api_router.py`, `translate_error_response`); what the validation
//! handler refuses keeps the body above, as vLLM registers that handler for every route.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Serialize;

/// One error answer: status, vLLM's error type, message and the parameter at fault.
#[derive(Clone, Debug, PartialEq)]
pub struct ApiError {
    pub status: StatusCode,
    pub kind: &'static str,
    pub message: String,
    pub param: Option<String>,
}

impl ApiError {
    /// A body vLLM could not read into its request type (`validation_exception_handler`): 400,
    /// typed with the status's phrase; no `param` unless a validator's `VLLMValidationError`
    /// names one.
    pub fn schema(message: impl Into<String>) -> ApiError {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            kind: "Bad Request",
            message: message.into(),
            param: None,
        }
    }

    /// A 400 from vLLM's serving code, without a parameter (its plain `ValueError` path).
    pub fn bad_request(message: impl Into<String>) -> ApiError {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            kind: "BadRequestError",
            message: message.into(),
            param: None,
        }
    }

    /// A `VLLMValidationError(message, parameter=…, value=…)`.
    pub fn validation(message: &str, param: &str, value: impl std::fmt::Display) -> ApiError {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            kind: "BadRequestError",
            message: format!("{message} (parameter={param}, value={value})"),
            param: Some(param.to_string()),
        }
    }

    pub fn unknown_model(model: &str) -> ApiError {
        ApiError {
            status: StatusCode::NOT_FOUND,
            kind: "NotFoundError",
            message: format!("The model `{model}` does not exist."),
            param: Some("model".into()),
        }
    }

    pub fn internal(message: impl Into<String>) -> ApiError {
        ApiError {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            kind: "InternalServerError",
            message: message.into(),
            param: None,
        }
    }

    /// Admission control refused the request (`--max-num-queued-reqs` or
    /// `--max-num-queued-tokens`, vLLM ≥ 0.29): 503 before the request reaches the engine,
    /// so nothing was computed for it. As vLLM 0.33 answers it: the type is the status's
    /// phrase, no `param`.
    pub fn overloaded(message: impl Into<String>) -> ApiError {
        ApiError {
            status: StatusCode::SERVICE_UNAVAILABLE,
            kind: "Service Unavailable",
            message: message.into(),
            param: None,
        }
    }

    /// A Responses API refusal as vLLM writes it (`create_error_response` with
    /// `err_type="invalid_request_error"`): its own type, a `param`, any status.
    pub fn invalid_request(status: StatusCode, message: impl Into<String>, param: &str) -> ApiError {
        ApiError {
            status,
            kind: "invalid_request_error",
            message: message.into(),
            param: Some(param.to_string()),
        }
    }

    /// No stored response has this id (vLLM's `_make_not_found_error`): never stored, stored
    /// by another server, or the store is off.
    pub fn response_not_found(id: &str) -> ApiError {
        ApiError::invalid_request(
            StatusCode::NOT_FOUND,
            format!("Response with id '{id}' not found."),
            "response_id",
        )
    }

    /// The prompt leaves less than the requested output's room in the context (vLLM's
    /// renderer, `TokenizeParams._token_len_check`: at most `max_model_len − max_tokens` input
    /// tokens, `max_tokens` counted 0 where the request sets none).
    pub fn prompt_too_long(max_model_len: u64, prompt_tokens: u64, max_output: u64) -> ApiError {
        ApiError::validation(
            &format!(
                "You passed {prompt_tokens} input tokens and requested {max_output} output tokens. However, the \
                 model's context length is only {max_model_len} tokens, resulting in a maximum input length of {} \
                 tokens. Please reduce the length of the input prompt.",
                max_model_len.saturating_sub(max_output)
            ),
            "input_tokens",
            prompt_tokens,
        )
    }

    /// The requested output alone is longer than the context (`TokenizeParams.__post_init__`),
    /// in vLLM's words to the byte: its message has no space after the number and names the
    /// context twice (`max_model_len=max_total_tokens=…`).
    pub fn output_over_context(param: &str, max_output: u64, max_model_len: u64) -> ApiError {
        ApiError::validation(
            &format!(
                "{param}={max_output}cannot be greater than max_model_len=max_total_tokens={max_model_len}. \
                 Please request fewer output tokens."
            ),
            param,
            max_output,
        )
    }

    /// `max_tokens` worked out as the context's room, where the prompt fills the context
    /// (`SamplingParams`' check).
    pub fn no_room_for_output(max_tokens: i64) -> ApiError {
        ApiError::validation(
            &format!("max_tokens must be at least 1, got {max_tokens}."),
            "max_tokens",
            max_tokens,
        )
    }

    /// A body vLLM could not read into its request type, answered by its validation handler.
    pub fn unreadable_body(&self) -> bool {
        self.kind == "Bad Request"
    }

    /// As the Messages API answers it: Anthropic's body, with this status and type, unless the
    /// validation handler answers it.
    pub fn into_anthropic_response(self) -> Response {
        if self.unreadable_body() {
            return self.into_response();
        }
        (self.status, Json(AnthropicError::new(self.kind, &self.message))).into_response()
    }

    pub fn body(&self) -> serde_json::Value {
        serde_json::json!({"error": {
            "message": self.message,
            "type": self.kind,
            "param": self.param,
            "code": self.status.as_u16(),
        }})
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.status, Json(self.body())).into_response()
    }
}

/// Anthropic's error body (vLLM's `AnthropicErrorResponse`), also the data of a Messages
/// stream's `error` event.
#[derive(Debug, Serialize)]
pub struct AnthropicError<'a> {
    #[serde(rename = "type")]
    kind: &'static str,
    error: AnthropicErrorInfo<'a>,
}

#[derive(Debug, Serialize)]
struct AnthropicErrorInfo<'a> {
    #[serde(rename = "type")]
    kind: &'a str,
    message: &'a str,
}

impl<'a> AnthropicError<'a> {
    pub fn new(kind: &'a str, message: &'a str) -> AnthropicError<'a> {
        AnthropicError {
            kind: "error",
            error: AnthropicErrorInfo { kind, message },
        }
    }
}

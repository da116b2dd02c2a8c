//! vLLM's informational endpoints: `/v1/models` (a model card per served name) and the
//! `/tokenize` and `/detokenize` routes over `tokenize`'s rule.

use std::sync::Arc;

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use bytes::Bytes;

use super::{with_server, SimServer};

/// vLLM's model cards: one per served name.
pub(super) async fn models(State(srv): State<Arc<SimServer>>) -> Response {
    let root = srv.engine.lock().map(|e| e.profile().model.served_name()).unwrap_or("");
    let created = srv.created as u64;
    let data: Vec<serde_json::Value> = srv
        .served
        .iter()
        .map(|name| {
            serde_json::json!({
                "id": name, "object": "model", "created": created, "owned_by": "vllm", "root": root,
                "parent": null, "max_model_len": srv.max_model_len,
                "permission": [{
                    "id": format!("modelperm-{}", &srv.request_id("x", created)[2..]), "object": "model_permission",
                    "created": created, "allow_create_engine": false, "allow_sampling": true,
                    "allow_logprobs": true, "allow_search_indices": false, "allow_view": true,
                    "allow_fine_tuning": false, "organization": "*", "group": null, "is_blocking": false,
                }],
            })
        })
        .collect();
    with_server(
        Json(serde_json::json!({"object": "list", "data": data})).into_response(),
        &srv,
    )
}

pub(super) async fn tokenize(State(srv): State<Arc<SimServer>>, body: Bytes) -> Response {
    let r = match super::tokenize::tokenize(&body, &srv.served, srv.max_model_len) {
        Ok(v) => Json(v).into_response(),
        Err(e) => e.into_response(),
    };
    with_server(r, &srv)
}

pub(super) async fn detokenize(State(srv): State<Arc<SimServer>>, body: Bytes) -> Response {
    let r = match super::tokenize::detokenize_body(&body, &srv.served) {
        Ok(v) => Json(v).into_response(),
        Err(e) => e.into_response(),
    };
    with_server(r, &srv)
}

//! The admin listener: `GET|POST /servers/{i}/fault` (fault injection) and
//! `GET|POST /servers/{i}/admission` (vLLM's admission limits).

use std::sync::Arc;

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use bytes::Bytes;

use super::{error, listen, Admission, Fault, SimServer};

type Fleet = Arc<Vec<Arc<SimServer>>>;

pub(super) async fn get_fault(State(fleet): State<Fleet>, Path(i): Path<usize>) -> Response {
    match fleet.get(i) {
        Some(s) => Json(s.fault()).into_response(),
        None => error(StatusCode::NOT_FOUND, "no such server"),
    }
}

pub(super) async fn set_fault(State(fleet): State<Fleet>, Path(i): Path<usize>, body: Bytes) -> Response {
    let Some(srv) = fleet.get(i) else {
        return error(StatusCode::NOT_FOUND, "no such server");
    };
    let mut new: Fault = match serde_json::from_slice(&body) {
        Ok(f) => f,
        Err(e) => return error(StatusCode::BAD_REQUEST, &format!("fault: {e}")),
    };
    if new.slow < 1.0 {
        new.slow = 1.0;
    }
    let was_down = srv.fault().down;
    if let Ok(mut f) = srv.fault.lock() {
        *f = new.clone();
    }
    if new.down && !was_down {
        if let Ok(mut c) = srv.connections.lock() {
            if let Some(mut set) = c.take() {
                set.abort_all();
            }
        }
    } else if !new.down && was_down {
        if let Err(e) = listen(srv).await {
            return error(StatusCode::INTERNAL_SERVER_ERROR, &e.to_string());
        }
    }
    Json(new).into_response()
}

pub(super) async fn get_admission(State(fleet): State<Fleet>, Path(i): Path<usize>) -> Response {
    match fleet.get(i).and_then(|s| s.admission.lock().ok().map(|a| *a)) {
        Some(a) => Json(a).into_response(),
        None => error(StatusCode::NOT_FOUND, "no such server"),
    }
}

pub(super) async fn set_admission(State(fleet): State<Fleet>, Path(i): Path<usize>, body: Bytes) -> Response {
    let Some(srv) = fleet.get(i) else {
        return error(StatusCode::NOT_FOUND, "no such server");
    };
    let new: Admission = match serde_json::from_slice(&body) {
        Ok(a) => a,
        Err(e) => return error(StatusCode::BAD_REQUEST, &format!("admission: {e}")),
    };
    if let Ok(mut a) = srv.admission.lock() {
        *a = new;
    }
    Json(new).into_response()
}

//! The router: OpenAI routes behind the optional API key, `/health`, `/metrics`, and
//! JSON answers for unknown routes and methods (and for every other error, see
//! [`json_errors`]).

use std::sync::Arc;

use axum::extract::{Extension, Path, Request, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{middleware, Json, Router};
use serde_json::{json, Value};
use smoe_actors::scheduler::Status;

use super::admission::Admission;
use super::error::{json_errors, ApiError};
use super::state::AppState;
use super::{auth, completions, metrics};

/// All routes; the completion routes take their intake limits from `adm`.
pub fn router(st: Arc<AppState>, adm: Arc<Admission>) -> Router {
    let v1 = Router::new()
        .route("/v1/chat/completions", post(completions::chat))
        .route("/v1/completions", post(completions::text))
        .route("/v1/models", get(models))
        .route("/v1/models/{id}", get(model))
        .route_layer(middleware::from_fn_with_state(st.clone(), auth::require_key));
    Router::new()
        .merge(v1)
        .route("/health", get(health))
        .route("/metrics", get(metrics::render))
        .fallback(no_route)
        .method_not_allowed_fallback(wrong_method)
        .layer(Extension(adm))
        .layer(middleware::from_fn(metrics::count_requests))
        .layer(middleware::from_fn(json_errors))
        .with_state(st)
}

/// The model entry of `/v1/models`.
fn model_json(st: &AppState) -> Value {
    let m = &st.model;
    let mut v = json!({
        "id": m.id,
        "object": "model",
        "created": m.created,
        "owned_by": "smoe-pipeline",
        "max_model_len": m.max_context,
    });
    if let Some(d) = &m.description {
        v["description"] = json!(d);
    }
    v
}

/// `GET /v1/models`.
async fn models(State(st): State<Arc<AppState>>) -> Json<Value> {
    Json(json!({"object": "list", "data": [model_json(&st)]}))
}

/// `GET /v1/models/{id}`.
async fn model(State(st): State<Arc<AppState>>, Path(id): Path<String>) -> Response {
    if id == st.model.id {
        Json(model_json(&st)).into_response()
    } else {
        ApiError::unknown_model(&id, &st.model.id).into_response()
    }
}

/// `GET /health`: 200 while serving, 503 once shutting down or once the vault's
/// background check found it corrupt.
async fn health(State(st): State<Arc<AppState>>, Extension(adm): Extension<Arc<Admission>>) -> Response {
    if matches!(adm.integrity.status(), Some(Err(_))) {
        return (StatusCode::SERVICE_UNAVAILABLE, Json(json!({"status": "vault_corrupt"}))).into_response();
    }
    match st.scheduler.ask(Status).await {
        Ok(s) if s.accepting => Json(json!({
            "status": "ok",
            "model": st.model.id,
            "queued": s.queued,
            "running": s.running,
        }))
        .into_response(),
        _ => (StatusCode::SERVICE_UNAVAILABLE, Json(json!({"status": "shutting_down"}))).into_response(),
    }
}

async fn no_route(req: Request) -> Response {
    ApiError::no_route(req.method().as_str(), req.uri().path()).into_response()
}

async fn wrong_method(req: Request) -> Response {
    ApiError::wrong_method(req.method().as_str(), req.uri().path()).into_response()
}

//! OpenAI-style JSON errors: `{"error": {"message", "type", "param", "code"}}` with the
//! matching HTTP status, and the middleware that turns any other error response (from
//! axum's extractors or a layer) into one, so that every API error is JSON.

use std::fmt::Display;
use std::time::Duration;

use axum::extract::Request;
use axum::http::{header, HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use serde_json::json;

use crate::settings::ByteSize;

/// Headers of an error response kept when it is rewritten as JSON.
const KEPT_HEADERS: &[header::HeaderName] = &[header::ALLOW, header::RETRY_AFTER, header::WWW_AUTHENTICATE];
/// Most bytes of a non-JSON error body quoted in the JSON message.
const QUOTED_BODY: usize = 4096;

/// An error answered to an API client.
#[derive(Debug, Clone, PartialEq)]
pub struct ApiError {
    /// HTTP status.
    pub status: StatusCode,
    /// What went wrong and how to fix it.
    pub message: String,
    /// OpenAI error type (`invalid_request_error`, ...).
    pub kind: &'static str,
    /// The request parameter at fault, if any.
    pub param: Option<String>,
    /// Machine-readable code, if any.
    pub code: Option<&'static str>,
    /// Seconds to wait before retrying (sent as `Retry-After`).
    pub retry_after: Option<Duration>,
}

impl ApiError {
    fn new(status: StatusCode, kind: &'static str, message: impl Into<String>) -> Self {
        ApiError { status, message: message.into(), kind, param: None, code: None, retry_after: None }
    }

    /// 400: the request is invalid; `param` names the field at fault.
    pub fn invalid(param: &str, message: impl Into<String>) -> Self {
        let mut e = ApiError::new(StatusCode::BAD_REQUEST, "invalid_request_error", message);
        if !param.is_empty() {
            e.param = Some(param.to_string());
        }
        e
    }

    /// 400: the body is not JSON of the expected shape.
    pub fn bad_body(message: impl Into<String>) -> Self {
        ApiError::new(StatusCode::BAD_REQUEST, "invalid_request_error", message)
    }

    /// 400: prompt plus completion do not fit the context.
    pub fn context_exceeded(message: impl Into<String>) -> Self {
        let mut e = ApiError::invalid("messages", message);
        e.code = Some("context_length_exceeded");
        e
    }

    /// 404: the model is not served here.
    pub fn unknown_model(asked: &str, served: &str) -> Self {
        let mut e = ApiError::new(
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            format!("the model `{asked}` does not exist; this server serves `{served}` (see GET /v1/models)"),
        );
        e.param = Some("model".into());
        e.code = Some("model_not_found");
        e
    }

    /// 401: missing or wrong API key.
    pub fn unauthorized(message: impl Into<String>) -> Self {
        let mut e = ApiError::new(StatusCode::UNAUTHORIZED, "authentication_error", message);
        e.code = Some("invalid_api_key");
        e
    }

    /// 404: no such route.
    pub fn no_route(method: &str, path: &str) -> Self {
        ApiError::new(
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            format!("no route {method} {path}; see /v1/models, /v1/completions, /v1/chat/completions"),
        )
    }

    /// 405: the route exists with another method.
    pub fn wrong_method(method: &str, path: &str) -> Self {
        ApiError::new(
            StatusCode::METHOD_NOT_ALLOWED,
            "invalid_request_error",
            format!("{path} does not accept {method}"),
        )
    }

    /// 429: the queue is full.
    pub fn queue_full(retry_after: Duration) -> Self {
        let mut e = ApiError::new(
            StatusCode::TOO_MANY_REQUESTS,
            "rate_limit_error",
            "the request queue is full; retry after the time in the Retry-After header",
        );
        e.code = Some("queue_full");
        e.retry_after = Some(retry_after);
        e
    }

    /// 503: the server is shutting down.
    pub fn shutting_down() -> Self {
        let mut e =
            ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "server_error", "the server is shutting down");
        e.code = Some("shutting_down");
        e
    }

    /// 500: the server failed. `detail` (which may name server files) goes to the log
    /// under a fresh error id; the client gets the id, never the detail.
    pub fn internal(detail: impl Display) -> Self {
        let id = format!("{:016x}", rand::random::<u64>());
        tracing::error!(error_id = %id, "request failed: {detail}");
        let mut e = ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "server_error",
            format!(
                "the server failed to complete this request (error id {id}; the server log has the details)"
            ),
        );
        e.code = Some("internal_error");
        e
    }

    /// 413: the body is larger than `max_body_bytes`.
    pub fn body_too_large(limit: ByteSize) -> Self {
        let mut e = ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "invalid_request_error",
            format!(
                "the request body is larger than this server accepts ({} bytes, `max_body_bytes` = {limit})",
                limit.0
            ),
        );
        e.code = Some("request_too_large");
        e
    }

    /// 408: the body did not arrive within `body_read_timeout`.
    pub fn body_timeout(limit: Duration) -> Self {
        let mut e = ApiError::new(
            StatusCode::REQUEST_TIMEOUT,
            "invalid_request_error",
            format!("the request body did not arrive within {} s (`body_read_timeout`)", limit.as_secs_f64()),
        );
        e.code = Some("request_timeout");
        e
    }

    /// 503: the server holds `max_connections` connections already.
    pub fn too_many_connections(max: usize) -> Self {
        let mut e = ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "server_error",
            format!("the server is at its connection limit ({max}, `max_connections`); retry shortly"),
        );
        e.code = Some("too_many_connections");
        e.retry_after = Some(Duration::from_secs(1));
        e
    }

    /// The JSON body.
    pub fn body(&self) -> serde_json::Value {
        json!({"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}})
    }
}

/// Middleware: an error response that is not JSON (an extractor's rejection, a layer's
/// answer) is rewritten as an OpenAI-style error with the same status, quoting its text.
pub async fn json_errors(req: Request, next: Next) -> Response {
    let resp = next.run(req).await;
    let status = resp.status();
    let is_json = resp
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("application/json"));
    if !(status.is_client_error() || status.is_server_error()) || is_json {
        return resp;
    }
    let (parts, body) = resp.into_parts();
    let text = axum::body::to_bytes(body, QUOTED_BODY).await.unwrap_or_default();
    let text = String::from_utf8_lossy(&text);
    let message = match text.trim() {
        "" => status.canonical_reason().unwrap_or("error").to_string(),
        t => t.to_string(),
    };
    let kind = if status.is_server_error() { "server_error" } else { "invalid_request_error" };
    let mut out = ApiError::new(status, kind, message).into_response();
    for name in KEPT_HEADERS {
        if let Some(v) = parts.headers.get(name) {
            out.headers_mut().insert(name, v.clone());
        }
    }
    out
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut r = (self.status, axum::Json(self.body())).into_response();
        if let Some(d) = self.retry_after {
            let secs = d.as_secs_f64().ceil().max(1.0) as u64;
            r.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from(secs));
        }
        r
    }
}

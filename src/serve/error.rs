//! OpenAI-style JSON errors: `{"error": {"message", "type", "param", "code"}}` with the
//! matching HTTP status.

use std::time::Duration;

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::json;

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

    /// 500: the engine failed.
    pub fn internal(message: impl Into<String>) -> Self {
        ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "server_error", message)
    }

    /// The JSON body.
    pub fn body(&self) -> serde_json::Value {
        json!({"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}})
    }
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

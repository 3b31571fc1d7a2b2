//! One error enum for the whole router, mapped to HTTP codes and bodies in
//! one place: TGI's `{error, error_type}` everywhere, OpenAI's
//! `{"error": {message, type, param, code}}` on the OpenAI routes (Chat,
//! Completions, Responses), Anthropic's `{"type": "error", "error": {type,
//! message}}` on `/v1/messages`.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Serialize;

#[derive(Debug, Clone, thiserror::Error)]
pub enum RouterError {
    /// Bad input from the client: 422.
    #[error("{0}")]
    Validation(String),
    /// Body is not valid JSON for the route: 422 as well, with its own type.
    #[error("{0}")]
    InvalidJson(String),
    /// A known field asking for something this server cannot do (another
    /// engine's extension at a value other than its default): 422 / 400 like
    /// `Validation`, with its own type so clients can tell "fix the value"
    /// from "this server does not do that".
    #[error("{0}")]
    Unsupported(String),
    /// Too many concurrent requests: 429.
    #[error("Model is overloaded: {0}")]
    Overloaded(String),
    /// Waited longer than `--max-queue-wait-ms` for admission: 429, like
    /// `Overloaded` (retry later), with its own type.
    #[error("Model is overloaded: {0}")]
    QueueTimeout(String),
    /// The server received SIGTERM and drains in-flight requests: 503.
    #[error("The server is shutting down: {0}")]
    ShuttingDown(String),
    /// The shard failed while generating: 424.
    #[error("Request failed during generation: {0}")]
    Generation(String),
    /// Router or shards are not ready or are shutting down: 503.
    #[error("{0}")]
    Unhealthy(String),
    #[error("{0}")]
    NotFound(String),
    #[error("Request body is too large: {0}")]
    PayloadTooLarge(String),
    #[error("{0}")]
    Unauthorized(String),
}

/// Every error response: `{"error": "...", "error_type": "validation"}`.
/// The HTTP status is what the official `openai` client maps to its
/// exception classes (422 UnprocessableEntityError, 429 RateLimitError, ...).
#[derive(Serialize, utoipa::ToSchema)]
pub struct ErrorBody {
    pub error: String,
    pub error_type: String,
}

impl RouterError {
    pub fn error_type(&self) -> &'static str {
        match self {
            RouterError::Validation(_) => "validation",
            RouterError::InvalidJson(_) => "invalid_json",
            RouterError::Unsupported(_) => "unsupported",
            RouterError::Overloaded(_) => "overloaded",
            RouterError::QueueTimeout(_) => "queue_timeout",
            RouterError::ShuttingDown(_) => "shutting_down",
            RouterError::Generation(_) => "generation",
            RouterError::Unhealthy(_) => "unhealthy",
            RouterError::NotFound(_) => "not_found",
            RouterError::PayloadTooLarge(_) => "payload_too_large",
            RouterError::Unauthorized(_) => "unauthorized",
        }
    }

    /// Status on the TGI routes (and every non-OpenAI route).
    pub fn status(&self) -> StatusCode {
        match self {
            RouterError::Validation(_) | RouterError::InvalidJson(_) | RouterError::Unsupported(_) => {
                StatusCode::UNPROCESSABLE_ENTITY
            }
            RouterError::Overloaded(_) | RouterError::QueueTimeout(_) => StatusCode::TOO_MANY_REQUESTS,
            RouterError::ShuttingDown(_) => StatusCode::SERVICE_UNAVAILABLE,
            RouterError::Generation(_) => StatusCode::FAILED_DEPENDENCY,
            RouterError::Unhealthy(_) => StatusCode::SERVICE_UNAVAILABLE,
            RouterError::NotFound(_) => StatusCode::NOT_FOUND,
            RouterError::PayloadTooLarge(_) => StatusCode::PAYLOAD_TOO_LARGE,
            RouterError::Unauthorized(_) => StatusCode::UNAUTHORIZED,
        }
    }

    pub fn body(&self) -> ErrorBody {
        ErrorBody { error: self.to_string(), error_type: self.error_type().to_string() }
    }

    /// The parameter an input error is about: messages name it first, in
    /// backquotes (`` `top_p` must be ...``).
    pub fn param(&self) -> Option<String> {
        let (RouterError::Validation(m)
        | RouterError::InvalidJson(m)
        | RouterError::Unsupported(m)
        | RouterError::NotFound(m)) = self
        else {
            return None;
        };
        let rest = m.split_once('`')?.1;
        let name = rest.split_once('`')?.0;
        let is_path =
            !name.is_empty() && name.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '[' | ']'));
        is_path.then(|| name.to_string())
    }

    /// OpenAI's statuses: invalid input is a 400 (TGI's routes say 422).
    pub fn openai_status(&self) -> StatusCode {
        match self {
            RouterError::Validation(_) | RouterError::InvalidJson(_) | RouterError::Unsupported(_) => {
                StatusCode::BAD_REQUEST
            }
            other => other.status(),
        }
    }

    pub fn openai_body(&self) -> OpenAiErrorBody {
        let kind = match self {
            RouterError::Validation(_)
            | RouterError::InvalidJson(_)
            | RouterError::Unsupported(_)
            | RouterError::NotFound(_)
            | RouterError::PayloadTooLarge(_) => "invalid_request_error",
            RouterError::Unauthorized(_) => "authentication_error",
            RouterError::Overloaded(_) | RouterError::QueueTimeout(_) => "rate_limit_error",
            RouterError::ShuttingDown(_) | RouterError::Generation(_) | RouterError::Unhealthy(_) => "server_error",
        };
        OpenAiErrorBody {
            error: OpenAiError {
                message: self.to_string(),
                kind: kind.to_string(),
                param: self.param(),
                code: Some(self.error_type().to_string()),
            },
        }
    }
}

/// OpenAI's error body, on the OpenAI routes (the `openai` client reads
/// `error.message` into its exceptions).
#[derive(Serialize, utoipa::ToSchema)]
pub struct OpenAiErrorBody {
    pub error: OpenAiError,
}

#[derive(Serialize, utoipa::ToSchema)]
pub struct OpenAiError {
    pub message: String,
    /// "invalid_request_error", "authentication_error", "rate_limit_error" or "server_error".
    #[serde(rename = "type")]
    pub kind: String,
    /// The request field at fault, when there is one.
    pub param: Option<String>,
    /// TGI's `error_type` ("validation", "invalid_json", "overloaded", ...).
    pub code: Option<String>,
}

impl IntoResponse for RouterError {
    fn into_response(self) -> Response {
        let mut resp = (self.status(), Json(self.body())).into_response();
        // Kept so `openai_errors` can re-render it for the OpenAI routes.
        resp.extensions_mut().insert(self);
        resp
    }
}

/// Layer of the OpenAI routes: any RouterError response (from the handler,
/// the body extractor or the auth layer inside it) gets OpenAI's shape.
pub async fn openai_errors(req: axum::extract::Request, next: axum::middleware::Next) -> Response {
    let resp = next.run(req).await;
    match resp.extensions().get::<RouterError>() {
        Some(err) => (err.openai_status(), Json(err.openai_body())).into_response(),
        None => resp,
    }
}

/// Anthropic's error body, on `/v1/messages`: `{"type": "error", "error": {"type", "message"}}`.
#[derive(Serialize, utoipa::ToSchema)]
pub struct AnthropicErrorBody {
    /// "error"
    #[serde(rename = "type")]
    pub kind: String,
    pub error: AnthropicError,
}

#[derive(Serialize, utoipa::ToSchema)]
pub struct AnthropicError {
    /// "invalid_request_error", "authentication_error", "not_found_error", "request_too_large",
    /// "rate_limit_error", "api_error" or "overloaded_error".
    #[serde(rename = "type")]
    pub kind: String,
    pub message: String,
}

impl RouterError {
    /// Anthropic's statuses: invalid input is a 400, as on the OpenAI routes.
    pub fn anthropic_status(&self) -> StatusCode {
        self.openai_status()
    }

    pub fn anthropic_body(&self) -> AnthropicErrorBody {
        let kind = match self {
            RouterError::Validation(_) | RouterError::InvalidJson(_) | RouterError::Unsupported(_) => {
                "invalid_request_error"
            }
            RouterError::Unauthorized(_) => "authentication_error",
            RouterError::NotFound(_) => "not_found_error",
            RouterError::PayloadTooLarge(_) => "request_too_large",
            RouterError::Overloaded(_) | RouterError::QueueTimeout(_) => "rate_limit_error",
            RouterError::ShuttingDown(_) | RouterError::Unhealthy(_) => "overloaded_error",
            RouterError::Generation(_) => "api_error",
        };
        AnthropicErrorBody {
            kind: "error".into(),
            error: AnthropicError { kind: kind.into(), message: self.to_string() },
        }
    }
}

/// Layer of the Anthropic routes, as `openai_errors` is of the OpenAI ones.
pub async fn anthropic_errors(req: axum::extract::Request, next: axum::middleware::Next) -> Response {
    let resp = next.run(req).await;
    match resp.extensions().get::<RouterError>() {
        Some(err) => (err.anthropic_status(), Json(err.anthropic_body())).into_response(),
        None => resp,
    }
}

impl From<tonic::Status> for RouterError {
    fn from(status: tonic::Status) -> Self {
        RouterError::Generation(format!("shard: {}", status.message()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn input_errors_are_400_with_the_param_on_openai_routes() {
        let e = RouterError::Validation("`top_p` must be in (0, 1], got 2".into());
        assert_eq!((e.status(), e.openai_status()), (StatusCode::UNPROCESSABLE_ENTITY, StatusCode::BAD_REQUEST));
        let b = serde_json::to_value(e.openai_body()).unwrap();
        assert_eq!(b["error"]["type"], "invalid_request_error");
        assert_eq!(b["error"]["param"], "top_p");
        assert_eq!(b["error"]["code"], "validation");
        assert!(b["error"]["message"].as_str().unwrap().contains("top_p"));
    }

    #[test]
    fn other_errors_keep_their_status_and_have_no_param() {
        let e = RouterError::Overloaded("busy".into());
        assert_eq!(e.openai_status(), StatusCode::TOO_MANY_REQUESTS);
        let b = serde_json::to_value(e.openai_body()).unwrap();
        assert_eq!(b["error"]["type"], "rate_limit_error");
        assert!(b["error"]["param"].is_null());
        assert_eq!(RouterError::Validation("no field named".into()).param(), None);
        assert_eq!(RouterError::Validation("`a b` odd".into()).param(), None);
    }

    #[test]
    fn unsupported_names_the_field_in_every_shape() {
        let e = RouterError::Unsupported("`return_hidden_states`: hidden states are not returned".into());
        assert_eq!((e.status(), e.openai_status()), (StatusCode::UNPROCESSABLE_ENTITY, StatusCode::BAD_REQUEST));
        let b = serde_json::to_value(e.openai_body()).unwrap();
        assert_eq!(b["error"]["param"], "return_hidden_states");
        assert_eq!(b["error"]["code"], "unsupported");
        assert_eq!(b["error"]["type"], "invalid_request_error");
        assert_eq!(e.anthropic_body().error.kind, "invalid_request_error");
        assert_eq!(e.body().error_type, "unsupported");
    }

    #[test]
    fn anthropic_shape() {
        let b = serde_json::to_value(RouterError::Validation("`max_tokens` bad".into()).anthropic_body()).unwrap();
        assert_eq!(
            b,
            serde_json::json!({"type": "error", "error": {"type": "invalid_request_error", "message": "`max_tokens` bad"}})
        );
        let e = RouterError::Unauthorized("no key".into());
        assert_eq!(
            (e.anthropic_status(), e.anthropic_body().error.kind.as_str()),
            (StatusCode::UNAUTHORIZED, "authentication_error")
        );
    }
}

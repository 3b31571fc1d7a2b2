//! One error enum for the whole router, mapped to HTTP codes in one place.

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

    pub fn status(&self) -> StatusCode {
        match self {
            RouterError::Validation(_) | RouterError::InvalidJson(_) => {
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
        ErrorBody {
            error: self.to_string(),
            error_type: self.error_type().to_string(),
        }
    }
}

impl IntoResponse for RouterError {
    fn into_response(self) -> Response {
        (self.status(), Json(self.body())).into_response()
    }
}

impl From<tonic::Status> for RouterError {
    fn from(status: tonic::Status) -> Self {
        RouterError::Generation(format!("shard: {}", status.message()))
    }
}

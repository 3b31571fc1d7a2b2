//! JSON bodies whose every failure (size, syntax, types) is a RouterError,
//! so clients always get `{error, error_type}` rather than axum's plain text.

use axum::body::Bytes;
use axum::extract::{FromRequest, Request};
use axum::http::StatusCode;
use axum::response::IntoResponse;
use serde::de::DeserializeOwned;

use crate::error::RouterError;

pub struct JsonBody<T>(pub T);

impl<S, T> FromRequest<S> for JsonBody<T>
where
    S: Send + Sync,
    T: DeserializeOwned,
{
    type Rejection = RouterError;

    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        let bytes = Bytes::from_request(req, state).await.map_err(|rej| {
            let status = rej.into_response().status();
            if status == StatusCode::PAYLOAD_TOO_LARGE {
                RouterError::PayloadTooLarge("over the server's payload limit".into())
            } else {
                RouterError::InvalidJson(format!("cannot read request body ({status})"))
            }
        })?;
        serde_json::from_slice(&bytes)
            .map(JsonBody)
            .map_err(|e| RouterError::InvalidJson(format!("invalid JSON body: {e}")))
    }
}

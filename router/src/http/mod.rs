//! HTTP surface: routes, body extraction, SSE.

mod extract;
mod ops;
mod tgi;
pub mod types;

use std::sync::Arc;

use axum::routing::{get, post};
use axum::Router;

use crate::client::ShardedClient;
use crate::error::RouterError;
use crate::infer::Infer;
use crate::state::RouterState;

/// Static facts for `/info`, fixed at startup.
#[derive(Debug, Clone, serde::Serialize)]
pub struct ServerInfo {
    pub model_id: String,
    pub model_dtype: String,
    pub model_device_type: String,
    pub attention_backend: String,
    pub num_shards: u32,
    pub max_input_tokens: u32,
    pub max_total_tokens: u32,
    pub max_batch_prefill_tokens: u32,
    pub max_batch_total_tokens: u64,
    pub max_batch_size: u32,
    pub max_concurrent_requests: u32,
    pub max_stop_sequences: u32,
    pub max_top_n_tokens: u32,
    pub block_size: u32,
    pub version: String,
    pub router: String,
}

#[derive(Clone)]
pub struct AppState {
    pub infer: Infer,
    pub info: Arc<ServerInfo>,
    pub state: Arc<RouterState>,
    pub client: ShardedClient,
}

pub fn router(app: AppState, payload_limit: usize) -> Router {
    Router::new()
        .route("/generate", post(tgi::generate))
        .route("/generate_stream", post(tgi::generate_stream))
        .route("/health", get(ops::health))
        .route("/info", get(ops::info))
        .route("/metrics", get(ops::metrics))
        .fallback(|| async { RouterError::NotFound("no such route".into()) })
        .method_not_allowed_fallback(|| async { RouterError::NotFound("method not allowed on this route".into()) })
        .layer(axum::extract::DefaultBodyLimit::max(payload_limit))
        .with_state(app)
}

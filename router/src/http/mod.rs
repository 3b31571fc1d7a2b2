//! HTTP surface: routes, body extraction, auth, SSE, OpenAPI.

pub mod anthropic;
mod auth;
mod docs;
mod extract;
mod headers;
pub mod openai;
mod ops;
pub mod responses;
mod tenant;
pub mod tgi;
pub mod types;

use std::sync::Arc;

use axum::extract::{MatchedPath, Request, State};
use axum::middleware::{self, Next};
use axum::response::Response;
use axum::routing::{get, post};
use axum::Router;

use crate::chat_template::LoadedTemplate;
use crate::client::ShardedClient;
use crate::error::RouterError;
use crate::infer::Infer;
use crate::shared_state::RouterState;

/// Static facts for `/info`, fixed at startup. Field names follow TGI's
/// `/info` so TGI clients and dashboards read them.
#[derive(Debug, Clone, Default, serde::Serialize, utoipa::ToSchema)]
pub struct ServerInfo {
    pub model_id: String,
    pub model_sha: Option<String>,
    pub model_pipeline_tag: String,
    pub model_dtype: String,
    pub model_device_type: String,
    pub attention_backend: String,
    /// "native" (pagemill's model code) or "transformers" (transformers' modeling code over the paged pool).
    pub model_impl: String,
    pub num_shards: u32,
    pub max_input_tokens: u32,
    pub max_total_tokens: u32,
    pub max_batch_prefill_tokens: u32,
    pub max_batch_total_tokens: u64,
    pub max_batch_size: u32,
    pub max_concurrent_requests: u32,
    pub max_best_of: u32,
    pub max_stop_sequences: u32,
    pub max_top_n_tokens: u32,
    pub max_client_batch_size: u32,
    pub validation_workers: u32,
    pub block_size: u32,
    /// Whether generation routes need `Authorization: Bearer <key>`.
    pub api_key_required: bool,
    pub has_chat_template: bool,
    pub version: String,
    pub sha: Option<String>,
    pub docker_label: Option<String>,
    pub router: String,
}

#[derive(Clone)]
pub struct AppState {
    pub infer: Infer,
    pub info: Arc<ServerInfo>,
    pub state: Arc<RouterState>,
    /// One client per data-parallel shard group, in group order.
    pub clients: Arc<Vec<ShardedClient>>,
    pub chat_template: Arc<LoadedTemplate>,
    pub api_key: Option<Arc<str>>,
    /// How tool calls are written and parsed (--tool-call-parser, or inferred from the template).
    pub tool_format: crate::tools::ToolCallParser,
    /// --reasoning-parser
    pub reasoning_parser: Option<crate::reasoning::ReasoningParser>,
    /// For `/v1/models`' `created`.
    pub started_unix: u64,
}

pub fn router(app: AppState, payload_limit: usize) -> Router {
    // Everything that generates (or reveals the model's tokens) sits behind --api-key.
    let openai = Router::new()
        .route("/v1/completions", post(openai::completions::completions))
        .route("/v1/chat/completions", post(openai::chat::chat_completions))
        .route("/v1/responses", post(responses::responses))
        .route("/v1/models", get(openai::models))
        .route_layer(middleware::from_fn_with_state(app.clone(), auth::require_api_key))
        // Outside auth, so a 401 has OpenAI's shape too.
        .route_layer(middleware::from_fn(crate::error::openai_errors));
    let anthropic = Router::new()
        .route("/v1/messages", post(anthropic::messages))
        .route_layer(middleware::from_fn_with_state(app.clone(), auth::require_api_key))
        .route_layer(middleware::from_fn(crate::error::anthropic_errors));
    let protected = Router::new()
        .route("/", post(tgi::compat_generate))
        .route("/generate", post(tgi::generate))
        .route("/generate_stream", post(tgi::generate_stream))
        .route("/tokenize", post(tgi::tokenize))
        .route_layer(middleware::from_fn_with_state(app.clone(), auth::require_api_key))
        .merge(openai)
        .merge(anthropic);
    let open = Router::new()
        .route("/health", get(ops::health))
        .route("/info", get(ops::info))
        .route("/metrics", get(ops::metrics))
        .route("/openapi.json", get(docs::openapi_json));
    protected
        .merge(open)
        .fallback(|| async { RouterError::NotFound("no such route".into()) })
        .method_not_allowed_fallback(|| async { RouterError::NotFound("method not allowed on this route".into()) })
        .layer(middleware::from_fn_with_state(app.clone(), count_responses))
        .layer(axum::extract::DefaultBodyLimit::max(payload_limit))
        .with_state(app)
        .merge(docs::swagger_ui())
}

/// `pagemill_http_requests_total{route, status}`; the label is the matched
/// route pattern (bounded), "unmatched" for everything else.
async fn count_responses(State(app): State<AppState>, req: Request, next: Next) -> Response {
    let route =
        req.extensions().get::<MatchedPath>().map_or_else(|| "unmatched".to_string(), |p| p.as_str().to_string());
    let resp = next.run(req).await;
    app.state.metrics.count_http(&route, resp.status().as_u16());
    resp
}

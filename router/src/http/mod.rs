//! HTTP surface: one directory per API (tgi/, openai/, responses/,
//! anthropic/), the chat pipeline the chat-shaped APIs share (chat/), SSE
//! framing (sse.rs), body extraction, auth, OpenAPI, and what routers in
//! front of many servers read (vLLM's render routes in openai/, SGLang's
//! info routes); `router` wires the routes.

pub mod anthropic;
mod app_state;
mod auth;
pub mod chat;
mod docs;
mod extract;
mod headers;
pub mod openai;
mod ops;
pub mod response_meta;
pub mod responses;
mod sglang_info;
pub mod sse;
mod tenant;
pub mod tgi;

use axum::extract::{MatchedPath, Request, State};
use axum::middleware::{self, Next};
use axum::response::Response;
use axum::routing::{get, post};
use axum::Router;

use crate::error::RouterError;
pub use app_state::{AppState, ServerInfo};

pub fn router(app: AppState, payload_limit: usize) -> Router {
    // Everything that generates (or reveals the model's tokens) sits behind --api-key.
    let openai = Router::new()
        .route("/v1/completions", post(openai::completions::completions))
        .route("/v1/chat/completions", post(openai::chat::chat_completions))
        .route("/v1/completions/render", post(openai::render::render_completion))
        .route("/v1/chat/completions/render", post(openai::render::render_chat))
        .route("/v1/responses", post(responses::responses))
        .route("/v1/models", get(openai::adapters::models))
        .route("/v1/load_lora_adapter", post(openai::adapters::load_lora_adapter))
        .route("/v1/unload_lora_adapter", post(openai::adapters::unload_lora_adapter))
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
        .route("/server_info", get(sglang_info::server_info))
        .route("/get_server_info", get(sglang_info::server_info))
        .route("/model_info", get(sglang_info::model_info))
        .route("/get_model_info", get(sglang_info::model_info))
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

//! What every handler shares: the front door to generation (`Infer`), the
//! static `/info` facts, the shared counters, the shard clients, the chat
//! template and the API's options.

use std::sync::Arc;

use crate::chat_template::LoadedTemplate;
use crate::client::ShardedClient;
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
    // What the engine-compatible routes and metric labels report (SGLang's info routes,
    // vLLM's cache_config_info); not in `/info`, which keeps TGI's fields and the live figures.
    /// KV blocks of one shard group's pool (vLLM's `num_gpu_blocks`).
    #[serde(skip)]
    pub kv_blocks: u32,
    /// Storage dtype of the KV pool (the model's, or "fp8_e4m3" / "fp8_e5m2" / "int8").
    #[serde(skip)]
    pub kv_cache_dtype: String,
    /// Whether shared prompt prefixes reuse KV blocks (`--no-prefix-caching` turns it off).
    #[serde(skip)]
    pub prefix_caching: bool,
    /// The model directory (SGLang's `model_path`).
    #[serde(skip)]
    pub model_path: String,
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
    /// The LoRA adapters served, by name.
    pub lora: Arc<crate::lora::LoraRegistry>,
}

//! pagemill router: HTTP/SSE API, validation, continuous batching, paged KV
//! accounting and the gRPC client to the model shards.

pub mod adapter;
pub mod batching;
pub mod chat_template;
pub mod client;
pub mod config;
pub mod detokenize;
pub mod error;
pub mod grammar;
pub mod groups;
pub mod http;
pub mod infer;
pub mod kv;
pub mod kv_events;
pub mod lora;
pub mod metrics;
pub mod proto;
#[cfg(feature = "python")]
mod python;
pub mod queue;
pub mod reasoning;
pub mod request;
pub mod response;
pub mod routing;
pub mod scheduler;
mod serve;
pub mod shared_state;
pub mod stop;
pub mod stream;
pub mod tools;
pub mod validation;

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use tokenizers::Tokenizer;

use crate::chat_template::{ChatTemplate, LoadedTemplate};
use crate::client::ShardedClient;
use crate::config::RouterConfig;
use crate::groups::Group;
use crate::http::{AppState, ServerInfo};
use crate::infer::Infer;
use crate::kv::KvManager;
use crate::lora::{LoraLimits, LoraRegistry};
use crate::proto::pb;
use crate::scheduler::admission::Budget;
use crate::scheduler::{AdmissionOrder, SchedulerConfig};
use crate::shared_state::RouterState;
use crate::validation::{Limits, Validation};

/// Connects to the shards, warms them up, and serves until SIGINT/SIGTERM.
pub async fn run(config: RouterConfig) -> Result<(), String> {
    config.check()?;
    let tokenizer = load_tokenizer(&config)?;
    let lora = lora_registry(&config)?;
    let warmup_request = pb::WarmupRequest {
        max_batch_prefill_tokens: config.max_batch_prefill_tokens,
        max_input_tokens: config.max_input_tokens,
        max_total_tokens: config.max_total_tokens,
        max_batch_size: config.max_batch_size,
        // 0: adapters off; the shard reserves no room for them.
        max_loras: if config.enable_lora { config.max_loras } else { 0 },
        max_lora_rank: if config.enable_lora { config.max_lora_rank } else { 0 },
    };
    let groups = groups::connect(&config.groups(), &config.shard_auth()?, &warmup_request).await?;
    let shard_info = groups[0].info.clone();
    let pool = PoolSize::of(&config, &groups)?;
    let state = Arc::new(RouterState::with_groups(groups.len()));
    state.healthy.store(true, Ordering::Relaxed);
    RouterState::set(&state.kv_blocks_total, pool.kv_blocks as u64 * groups.len() as u64);
    RouterState::set(&state.kv_blocks_free, pool.kv_blocks as u64 * groups.len() as u64);
    RouterState::set(&state.kv_block_size, pool.block_size as u64);
    // Alive from here, so that /health is right before the tasks first run.
    state.scheduler_alive.store(true, Ordering::SeqCst);
    let scheduler_config = scheduler_config(&config, &pool, &shard_info);
    let events = kv_events::from_config(config.kv_events_config.as_ref(), config.kv_events_layout).await?;
    let routing = (config.prefix_caching, config.routing);
    let (placer, scheduler_tasks) = groups::start(&groups, scheduler_config, routing, &warmup_request, &state, events);
    let clients: Vec<ShardedClient> = groups.iter().map(|g| g.client.clone()).collect();
    let infer = Infer::new(
        Validation::new(tokenizer.clone(), limits(&config, &pool, &shard_info)),
        placer,
        config.max_concurrent_requests,
        (config.max_queue_wait_ms > 0).then(|| Duration::from_millis(config.max_queue_wait_ms)),
        state.clone(),
        stream::TextContext::new(tokenizer.clone()),
    );
    let chat_template = ChatTemplate::load(&config.tokenizer_dir);
    if let Err(e) = &chat_template {
        // Not fatal: TGI routes work without it; chat requests get this as a 422.
        tracing::warn!("chat completions unavailable: {e}");
    }
    let info = server_info(&config, &pool, &shard_info, clients[0].num_shards() as u32, chat_template.is_ok());
    let app = app_state(&config, infer, info, state, clients, chat_template, lora);
    serve::serve(app, &config, scheduler_tasks).await
}

/// The `--lora-modules` adapters checked and registered before any shard is
/// asked for room: a directory that cannot be served fails the launch.
fn lora_registry(config: &RouterConfig) -> Result<Arc<LoraRegistry>, String> {
    let limits =
        LoraLimits { enabled: config.enable_lora, max_loras: config.max_loras, max_rank: config.max_lora_rank };
    // The base model's name as the API reports it; the shard's model id is not known yet,
    // so an empty --model-id falls back to the directory's name.
    let base = if config.model_id.is_empty() {
        config.tokenizer_dir.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default()
    } else {
        config.model_id.clone()
    };
    Ok(Arc::new(LoraRegistry::new(limits, &base, &config.lora_modules)?))
}

fn load_tokenizer(config: &RouterConfig) -> Result<Arc<Tokenizer>, String> {
    let path = config.tokenizer_dir.join("tokenizer.json");
    let tokenizer = Tokenizer::from_file(&path).map_err(|e| format!("cannot load {}: {e}", path.display()))?;
    Ok(Arc::new(tokenizer))
}

/// The KV pool every group is held to: the smallest group's, as its warmup reported it.
struct PoolSize {
    kv_blocks: u32,
    block_size: u32,
    /// The batch's token budget within the pool.
    max_batch_total_tokens: u64,
}

impl PoolSize {
    /// Fails when the pool (or the model's context) cannot hold one request at its longest.
    fn of(config: &RouterConfig, groups: &[Group]) -> Result<Self, String> {
        let shard_info = &groups[0].info;
        if shard_info.max_position_embeddings > 0 && config.max_total_tokens > shard_info.max_position_embeddings {
            return Err(format!(
                "max_total_tokens ({}) exceeds the model's max_position_embeddings ({})",
                config.max_total_tokens, shard_info.max_position_embeddings
            ));
        }
        // Limits hold for every group: the smallest pool decides.
        let warmup = groups.iter().map(|g| &g.warmup).min_by_key(|w| w.num_blocks).expect("at least one group");
        let kv_blocks = KvManager::new(warmup.num_blocks, warmup.block_size, config.prefix_caching).capacity();
        let pool_tokens = kv_blocks as u64 * warmup.block_size as u64;
        // One request at its longest (plus speculative slots) must always fit, or
        // preemption could not make progress. (Forks of `n`/`best_of` together
        // may still not fit: validation refuses those, see `check_fits_pool`.)
        if pool_tokens < config.max_total_tokens as u64 + shard_info.speculate as u64 {
            return Err(format!(
                "the KV pool holds {pool_tokens} tokens, fewer than max_total_tokens ({}): give the shard more KV memory or lower max_total_tokens",
                config.max_total_tokens
            ));
        }
        let max_batch_total_tokens = config.max_batch_total_tokens.map_or(pool_tokens, |t| (t as u64).min(pool_tokens));
        tracing::info!(
            "{} shard group(s), routing {}; KV pool per group: {} blocks of {} tokens ({} tokens), max_batch_total_tokens {}, prefix caching {}",
            groups.len(),
            config.routing,
            kv_blocks,
            warmup.block_size,
            pool_tokens,
            max_batch_total_tokens,
            if config.prefix_caching { "on" } else { "off" }
        );
        Ok(Self { kv_blocks, block_size: warmup.block_size, max_batch_total_tokens })
    }
}

fn scheduler_config(config: &RouterConfig, pool: &PoolSize, shard_info: &pb::InfoResponse) -> SchedulerConfig {
    let budget = Budget {
        max_batch_prefill_tokens: config.max_batch_prefill_tokens,
        max_batch_total_tokens: pool.max_batch_total_tokens,
        max_batch_size: config.max_batch_size,
        // As vLLM: keep ~1% of the pool free at admission for running sequences to grow into.
        watermark_blocks: (pool.kv_blocks / 100).max(1),
        prefill_chunk_tokens: config.prefill_chunk_tokens,
    };
    SchedulerConfig {
        budget,
        speculate: shard_info.speculate,
        order: if config.cache_aware_admission { AdmissionOrder::LongestPrefix } else { AdmissionOrder::Fifo },
        max_num_batched_tokens: config.max_num_batched_tokens,
        priority_aging: (config.priority_aging_ms > 0).then(|| Duration::from_millis(config.priority_aging_ms)),
        max_running_per_tenant: (config.max_running_per_tenant > 0).then_some(config.max_running_per_tenant),
        max_loras: config.max_loras,
        sliding_window: shard_info.sliding_window,
        schedule_ahead_from: match (config.schedule_ahead, config.no_schedule_ahead) {
            (_, true) => 0,
            (true, false) => 1,
            (false, false) => scheduler::AHEAD_FROM_SEQUENCES,
        },
    }
}

fn limits(config: &RouterConfig, pool: &PoolSize, shard_info: &pb::InfoResponse) -> Limits {
    Limits {
        max_input_tokens: config.max_input_tokens,
        max_total_tokens: config.max_total_tokens,
        max_stop_sequences: config.max_stop_sequences,
        max_top_n_tokens: config.max_top_n_tokens,
        default_max_new_tokens: config.default_max_new_tokens,
        max_best_of: config.max_best_of,
        vocab_size: shard_info.vocab_size,
        kv_blocks: pool.kv_blocks,
        block_size: pool.block_size,
        speculate: shard_info.speculate,
    }
}

fn server_info(
    config: &RouterConfig,
    pool: &PoolSize,
    shard_info: &pb::InfoResponse,
    num_shards: u32,
    has_chat_template: bool,
) -> ServerInfo {
    ServerInfo {
        model_id: if config.model_id.is_empty() { shard_info.model_id.clone() } else { config.model_id.clone() },
        model_sha: None,
        model_pipeline_tag: "text-generation".to_string(),
        model_dtype: shard_info.dtype.clone(),
        model_device_type: shard_info.device_type.clone(),
        attention_backend: shard_info.attention_backend.clone(),
        model_impl: shard_info.model_impl.clone(),
        num_shards,
        max_input_tokens: config.max_input_tokens,
        max_total_tokens: config.max_total_tokens,
        max_batch_prefill_tokens: config.max_batch_prefill_tokens,
        max_batch_total_tokens: pool.max_batch_total_tokens,
        max_batch_size: config.max_batch_size,
        max_concurrent_requests: config.max_concurrent_requests,
        max_best_of: config.max_best_of,
        max_client_batch_size: 1,
        validation_workers: config.validation_workers as u32,
        api_key_required: config.api_key.is_some(),
        has_chat_template,
        sha: None,
        docker_label: std::env::var("PAGEMILL_DOCKER_LABEL").ok(),
        max_stop_sequences: config.max_stop_sequences,
        max_top_n_tokens: config.max_top_n_tokens,
        block_size: pool.block_size,
        kv_blocks: pool.kv_blocks,
        kv_cache_dtype: shard_info.kv_cache_dtype.clone(),
        prefix_caching: config.prefix_caching,
        model_path: config.tokenizer_dir.display().to_string(),
        version: env!("CARGO_PKG_VERSION").to_string(),
        router: "pagemill".to_string(),
    }
}

fn app_state(
    config: &RouterConfig,
    infer: Infer,
    info: ServerInfo,
    state: Arc<RouterState>,
    clients: Vec<ShardedClient>,
    chat_template: LoadedTemplate,
    lora: Arc<LoraRegistry>,
) -> AppState {
    let tool_format = config.tool_call_parser.unwrap_or_else(|| {
        chat_template.as_ref().map_or(tools::ToolCallParser::Hermes, |t| tools::ToolCallParser::detect(&t.source))
    });
    AppState {
        infer,
        info: Arc::new(info),
        state,
        clients: Arc::new(clients),
        chat_template: Arc::new(chat_template),
        api_key: config.api_key.as_deref().map(Arc::from),
        tool_format,
        reasoning_parser: config.reasoning_parser,
        started_unix: http::response_meta::unix_now(),
        lora,
    }
}

//! pagemill router: HTTP/SSE API, validation, continuous batching, paged KV
//! accounting and the gRPC client to the model shards.

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
pub mod shared_state;
pub mod stop;
pub mod stream;
pub mod tools;
pub mod validation;

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use tokenizers::Tokenizer;

use crate::client::ShardedClient;
use crate::config::RouterConfig;
use crate::http::{AppState, ServerInfo};
use crate::infer::Infer;
use crate::kv::KvManager;
use crate::proto::pb;
use crate::scheduler::admission::Budget;
use crate::scheduler::{AdmissionOrder, SchedulerConfig};
use crate::shared_state::RouterState;
use crate::validation::{Limits, Validation};

/// Connects to the shards, warms them up, and serves until SIGINT/SIGTERM.
pub async fn run(config: RouterConfig) -> Result<(), String> {
    config.check()?;
    let tokenizer_path = config.tokenizer_dir.join("tokenizer.json");
    let tokenizer =
        Tokenizer::from_file(&tokenizer_path).map_err(|e| format!("cannot load {}: {e}", tokenizer_path.display()))?;
    let tokenizer = Arc::new(tokenizer);

    let warmup_request = pb::WarmupRequest {
        max_batch_prefill_tokens: config.max_batch_prefill_tokens,
        max_input_tokens: config.max_input_tokens,
        max_total_tokens: config.max_total_tokens,
        max_batch_size: config.max_batch_size,
    };
    let groups = groups::connect(&config.groups(), &config.shard_auth()?, &warmup_request).await?;
    let shard_info = groups[0].info.clone();
    if shard_info.max_position_embeddings > 0 && config.max_total_tokens > shard_info.max_position_embeddings {
        return Err(format!(
            "max_total_tokens ({}) exceeds the model's max_position_embeddings ({})",
            config.max_total_tokens, shard_info.max_position_embeddings
        ));
    }
    // Limits hold for every group: the smallest pool decides.
    let warmup = groups.iter().map(|g| g.warmup.clone()).min_by_key(|w| w.num_blocks).expect("at least one group");
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

    let state = Arc::new(RouterState::with_groups(groups.len()));
    state.healthy.store(true, Ordering::Relaxed);
    RouterState::set(&state.kv_blocks_total, kv_blocks as u64 * groups.len() as u64);
    RouterState::set(&state.kv_blocks_free, kv_blocks as u64 * groups.len() as u64);
    RouterState::set(&state.kv_block_size, warmup.block_size as u64);

    let budget = Budget {
        max_batch_prefill_tokens: config.max_batch_prefill_tokens,
        max_batch_total_tokens,
        max_batch_size: config.max_batch_size,
        // As vLLM: keep ~1% of the pool free at admission for running sequences to grow into.
        watermark_blocks: (kv_blocks / 100).max(1),
        prefill_chunk_tokens: config.prefill_chunk_tokens,
    };
    let scheduler_config = SchedulerConfig {
        budget,
        speculate: shard_info.speculate,
        order: if config.cache_aware_admission { AdmissionOrder::LongestPrefix } else { AdmissionOrder::Fifo },
        max_num_batched_tokens: config.max_num_batched_tokens,
        priority_aging: (config.priority_aging_ms > 0).then(|| Duration::from_millis(config.priority_aging_ms)),
        max_running_per_tenant: (config.max_running_per_tenant > 0).then_some(config.max_running_per_tenant),
        sliding_window: shard_info.sliding_window,
        schedule_ahead_from: match (config.schedule_ahead, config.no_schedule_ahead) {
            (_, true) => 0,
            (true, false) => 1,
            (false, false) => scheduler::AHEAD_FROM_SEQUENCES,
        },
    };
    // Alive from here, so that /health is right before the tasks first run.
    state.scheduler_alive.store(true, Ordering::SeqCst);
    let (placer, scheduler_tasks) =
        groups::start(&groups, scheduler_config, config.prefix_caching, config.routing, &warmup_request, &state);
    let clients: Vec<ShardedClient> = groups.iter().map(|g| g.client.clone()).collect();
    let num_shards = clients[0].num_shards() as u32;

    let limits = Limits {
        max_input_tokens: config.max_input_tokens,
        max_total_tokens: config.max_total_tokens,
        max_stop_sequences: config.max_stop_sequences,
        max_top_n_tokens: config.max_top_n_tokens,
        default_max_new_tokens: config.default_max_new_tokens,
        max_best_of: config.max_best_of,
        vocab_size: shard_info.vocab_size,
        kv_blocks,
        block_size: warmup.block_size,
        speculate: shard_info.speculate,
    };
    let infer = Infer::new(
        Validation::new(tokenizer.clone(), limits),
        placer,
        config.max_concurrent_requests,
        (config.max_queue_wait_ms > 0).then(|| Duration::from_millis(config.max_queue_wait_ms)),
        state.clone(),
        stream::TextContext::new(tokenizer.clone()),
    );
    let chat_template = chat_template::ChatTemplate::load(&config.tokenizer_dir);
    if let Err(e) = &chat_template {
        // Not fatal: TGI routes work without it; chat requests get this as a 422.
        tracing::warn!("chat completions unavailable: {e}");
    }
    let info = ServerInfo {
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
        max_batch_total_tokens,
        max_batch_size: config.max_batch_size,
        max_concurrent_requests: config.max_concurrent_requests,
        max_best_of: config.max_best_of,
        max_client_batch_size: 1,
        validation_workers: config.validation_workers as u32,
        api_key_required: config.api_key.is_some(),
        has_chat_template: chat_template.is_ok(),
        sha: None,
        docker_label: std::env::var("PAGEMILL_DOCKER_LABEL").ok(),
        max_stop_sequences: config.max_stop_sequences,
        max_top_n_tokens: config.max_top_n_tokens,
        block_size: warmup.block_size,
        version: env!("CARGO_PKG_VERSION").to_string(),
        router: "pagemill".to_string(),
    };
    let tool_format = config.tool_call_parser.unwrap_or_else(|| {
        chat_template.as_ref().map_or(tools::ToolCallParser::Hermes, |t| tools::ToolCallParser::detect(&t.source))
    });
    let drain_infer = infer.clone();
    let drain_state = state.clone();
    let app = AppState {
        infer,
        info: Arc::new(info),
        state,
        clients: Arc::new(clients),
        chat_template: Arc::new(chat_template),
        api_key: config.api_key.as_deref().map(Arc::from),
        tool_format,
        reasoning_parser: config.reasoning_parser,
        started_unix: http::response_meta::unix_now(),
    };
    let routes = http::router(app, config.payload_limit);
    let addr = format!("{}:{}", config.hostname, config.port);
    let listener = tokio::net::TcpListener::bind(&addr).await.map_err(|e| format!("cannot listen on {addr}: {e}"))?;
    tracing::info!("router listening on http://{addr}");
    let timeout = Duration::from_secs(config.shutdown_timeout_s);
    let (deadline_tx, deadline_rx) = tokio::sync::oneshot::channel::<tokio::time::Instant>();
    // On a signal the listener stays open while accepted requests finish:
    // new ones get a 503 `shutting_down` (not a refused connection) and
    // `/health` turns 503 so balancers move away. Then axum stops accepting
    // and closes idle connections.
    let server = axum::serve(listener, routes).with_graceful_shutdown(async move {
        shutdown_signal().await;
        let deadline = tokio::time::Instant::now() + timeout;
        let _ = deadline_tx.send(deadline);
        drain_state.draining.store(true, Ordering::SeqCst);
        tracing::info!(
            "shutting down: draining {} in-flight request(s) (up to {}s)",
            drain_infer.in_flight(),
            timeout.as_secs()
        );
        if drain_infer.drain(timeout).await {
            tracing::info!("drained: every accepted request was answered");
        } else {
            tracing::warn!(
                "shutdown timeout reached: ending {} request(s) with a shutting_down error",
                drain_infer.in_flight()
            );
            drain_infer.cut_off();
            drain_infer.drain(CUTOFF_GRACE).await;
        }
    });
    let server = tokio::spawn(async move { server.await });
    // Past the deadline (plus a moment for the last responses to flush), the
    // router exits with whatever is still open.
    let hard_stop = async {
        match deadline_rx.await {
            Ok(deadline) => tokio::time::sleep_until(deadline + CUTOFF_GRACE * 2).await,
            Err(_) => std::future::pending().await,
        }
    };
    tokio::select! {
        r = server => r.map_err(|e| e.to_string())?.map_err(|e| e.to_string())?,
        _ = hard_stop => tracing::warn!("shutdown timeout reached with requests still in flight"),
    }
    for t in scheduler_tasks {
        t.abort();
    }
    Ok(())
}

/// After the shutdown timeout: time for the `shutting_down` error events to
/// reach their clients before the router exits regardless.
const CUTOFF_GRACE: Duration = Duration::from_secs(1);

async fn shutdown_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).expect("SIGTERM handler");
    tokio::select! {
        _ = ctrl_c => {},
        _ = term.recv() => {},
    }
}

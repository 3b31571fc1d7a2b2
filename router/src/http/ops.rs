//! Operational routes: health, info, metrics.

use std::sync::atomic::Ordering;
use std::time::Duration;

use axum::extract::State;
use axum::http::header;
use axum::response::IntoResponse;
use axum::Json;
use serde_json::json;

use super::{AppState, ServerInfo};
use crate::error::{ErrorBody, RouterError};
use crate::shared_state::RouterState;

/// 200 `{"status": "ok"}` when the batching loops run and every shard
/// group serves; 200 `{"status": "degraded", "groups": [...]}` while some
/// group is out of rotation and at least one serves; 503 when none does.
#[utoipa::path(get, path = "/health", tag = "Ops",
    responses((status = 200, description = "Shards answer (status ok, or degraded with per-group details)"),
        (status = 503, description = "Unhealthy", body = ErrorBody)))]
pub async fn health(State(app): State<AppState>) -> Result<Json<serde_json::Value>, RouterError> {
    if app.state.draining.load(Ordering::SeqCst) {
        return Err(RouterError::ShuttingDown("draining in-flight requests".into()));
    }
    if !app.state.scheduler_alive.load(Ordering::SeqCst) {
        return Err(RouterError::Unhealthy("the batching loop has stopped".into()));
    }
    // A shard busy with a long forward still answers Health from its event loop.
    let checks = app.clients.iter().map(|c| {
        let mut c = c.clone();
        async move {
            match tokio::time::timeout(Duration::from_secs(10), c.health()).await {
                Ok(Ok(_)) => Ok(()),
                Ok(Err(e)) => Err(format!("shard unhealthy: {}", e.message())),
                Err(_) => Err("shard health check timed out".to_string()),
            }
        }
    });
    let checks = futures::future::join_all(checks).await;
    let groups: Vec<(bool, Option<String>)> = checks
        .into_iter()
        .enumerate()
        .map(|(i, r)| {
            let in_rotation = app.state.groups.get(i).is_none_or(|g| g.serving());
            match r {
                Ok(()) if in_rotation => (true, None),
                Ok(()) => (false, Some("out of rotation: its shards came back and are being warmed up".into())),
                Err(e) => (false, Some(e)),
            }
        })
        .collect();
    let serving = groups.iter().filter(|g| g.0).count();
    app.state.healthy.store(serving > 0, Ordering::Relaxed);
    if serving == 0 {
        let why = groups.iter().find_map(|g| g.1.clone()).unwrap_or_else(|| "no shard group".into());
        return Err(RouterError::Unhealthy(why));
    }
    if serving == groups.len() {
        return Ok(Json(json!({"status": "ok"})));
    }
    let details: Vec<serde_json::Value> =
        groups.iter().enumerate().map(|(i, (ok, why))| json!({"group": i, "serving": ok, "error": why})).collect();
    Ok(Json(json!({"status": "degraded", "serving_groups": serving, "groups": details})))
}

/// Model, limits, and live KV / queue / batch numbers.
#[utoipa::path(get, path = "/info", tag = "Ops", responses((status = 200, description = "Server info", body = ServerInfo)))]
pub async fn info(State(app): State<AppState>) -> Json<serde_json::Value> {
    let st = &app.state;
    let total = RouterState::get(&st.kv_blocks_total);
    let free = RouterState::get(&st.kv_blocks_free);
    let mut v = serde_json::to_value(&*app.info).unwrap_or_default();
    let live = json!({
        "kv_blocks_cached": RouterState::get(&st.kv_blocks_cached),
        "kv_utilization": RouterState::get(&st.kv_utilization_ppm) as f64 / 1e6,
        "prefix_hit_tokens_total": RouterState::get(&st.prefix_hit_tokens_total),
        "prefill_tokens_total": RouterState::get(&st.prefill_tokens_total),
        "preemptions_total": RouterState::get(&st.preemptions_total),
        "requests_too_large_total": RouterState::get(&st.requests_too_large_total),
        "recomputed_tokens_total": RouterState::get(&st.recomputed_tokens_total),
        "kv_blocks_total": total,
        "kv_blocks_free": free,
        "kv_blocks_used": total.saturating_sub(free),
        "queue_size": RouterState::get(&st.queue_size),
        "batch_size": RouterState::get(&st.batch_size),
        "requeued_total": RouterState::get(&st.requeued_total),
        "data_parallel": st.groups.len().max(1),
        "routing": app.infer.placer().routing().to_string(),
        "groups": st.groups.iter().enumerate().map(|(i, g)| group_info(i, g)).collect::<Vec<_>>(),
    });
    if let (Some(obj), Some(extra)) = (v.as_object_mut(), live.as_object()) {
        obj.extend(extra.clone());
    }
    Json(v)
}

fn group_info(i: usize, g: &crate::shared_state::GroupStats) -> serde_json::Value {
    let get = RouterState::get;
    json!({
        "group": i,
        "serving": g.serving(),
        "queue_size": get(&g.queue_size),
        "batch_size": get(&g.batch_size),
        "queued_tokens": get(&g.queued_tokens) + get(&g.pending_tokens),
        "running_tokens": get(&g.running_tokens),
        "kv_blocks_total": get(&g.kv_blocks_total),
        "kv_blocks_free": get(&g.kv_blocks_free),
        "kv_blocks_cached": get(&g.kv_blocks_cached),
        "requests_placed_total": get(&g.placed_total),
        "prefill_tokens_total": get(&g.prefill_tokens_total),
        "prefix_hit_tokens_total": get(&g.prefix_hit_tokens_total),
        "generated_tokens_total": get(&g.generated_tokens_total),
    })
}

/// Prometheus text format: `pagemill_*` names, and the vLLM and SGLang names gateways read.
#[utoipa::path(get, path = "/metrics", tag = "Ops",
    responses((status = 200, description = "Prometheus metrics", body = String, content_type = "text/plain")))]
pub async fn metrics(State(app): State<AppState>) -> impl IntoResponse {
    let info = &app.info;
    let facts = crate::metrics::EngineFacts {
        model_name: info.model_id.clone(),
        block_size: info.block_size,
        num_gpu_blocks: info.kv_blocks,
        cache_dtype: info.kv_cache_dtype.clone(),
        prefix_caching: info.prefix_caching,
        max_lora: if app.lora.limits().enabled { app.lora.limits().max_loras } else { 0 },
    };
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], crate::metrics::render(&app.state, &facts))
}

#[cfg(test)]
mod tests {
    use std::str::FromStr;
    use std::sync::Arc;

    use tokenizers::Tokenizer;

    use super::*;
    use crate::infer::Infer;
    use crate::stream::TextContext;
    use crate::validation::{Limits, Validation};

    fn app(state: Arc<RouterState>) -> AppState {
        let json = r#"{"version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
            "normalizer": null, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": null, "decoder": null,
            "model": {"type": "WordLevel", "vocab": {"a": 0, "[UNK]": 1}, "unk_token": "[UNK]"}}"#;
        let tokenizer = Arc::new(Tokenizer::from_str(json).unwrap());
        let limits = Limits {
            max_input_tokens: 4,
            max_total_tokens: 8,
            max_stop_sequences: 1,
            max_top_n_tokens: 1,
            default_max_new_tokens: 1,
            max_best_of: 1,
            vocab_size: 2,
            kv_blocks: 16,
            block_size: 4,
            speculate: 0,
        };
        let (queue_tx, _) = tokio::sync::mpsc::unbounded_channel();
        let placer = Arc::new(crate::routing::Placer::single(queue_tx, crate::kv::KvManager::new(16, 4, true), &state));
        let infer = Infer::new(
            Validation::new(tokenizer.clone(), limits),
            placer,
            1,
            None,
            state.clone(),
            TextContext::new(tokenizer),
        );
        AppState {
            infer,
            info: Arc::new(ServerInfo::default()),
            state,
            clients: Arc::new(vec![]),
            chat_template: Arc::new(Err("none".into())),
            api_key: None,
            tool_format: crate::tools::ToolCallParser::Hermes,
            reasoning_parser: None,
            started_unix: 0,
            lora: Arc::new(crate::lora::LoraRegistry::disabled("m")),
        }
    }

    #[tokio::test]
    async fn health_is_503_once_the_batching_loop_is_gone() {
        let state = Arc::new(RouterState::default());
        state.scheduler_alive.store(false, Ordering::SeqCst);
        let err = health(State(app(state))).await.unwrap_err();
        assert_eq!(err.status(), axum::http::StatusCode::SERVICE_UNAVAILABLE);
        assert!(err.to_string().contains("batching loop"), "{err}");
    }
}

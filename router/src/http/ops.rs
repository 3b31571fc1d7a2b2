//! Operational routes: health, info, metrics.

use std::sync::atomic::Ordering;
use std::time::Duration;

use axum::extract::State;
use axum::http::header;
use axum::response::IntoResponse;
use axum::Json;
use serde_json::json;

use super::AppState;
use crate::error::RouterError;
use crate::state::RouterState;

pub async fn health(State(app): State<AppState>) -> Result<Json<serde_json::Value>, RouterError> {
    let mut client = app.client.clone();
    // A shard busy with a long forward still answers Health from its event loop.
    match tokio::time::timeout(Duration::from_secs(10), client.health()).await {
        Ok(Ok(_)) => {
            app.state.healthy.store(true, Ordering::Relaxed);
            Ok(Json(json!({"status": "ok"})))
        }
        Ok(Err(e)) => {
            app.state.healthy.store(false, Ordering::Relaxed);
            Err(RouterError::Unhealthy(format!("shard unhealthy: {}", e.message())))
        }
        Err(_) => {
            app.state.healthy.store(false, Ordering::Relaxed);
            Err(RouterError::Unhealthy("shard health check timed out".into()))
        }
    }
}

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
        "kv_blocks_total": total,
        "kv_blocks_free": free,
        "kv_blocks_used": total - free,
        "queue_size": RouterState::get(&st.queue_size),
        "batch_size": RouterState::get(&st.batch_size),
    });
    if let (Some(obj), Some(extra)) = (v.as_object_mut(), live.as_object()) {
        obj.extend(extra.clone());
    }
    Json(v)
}

pub async fn metrics(State(app): State<AppState>) -> impl IntoResponse {
    let st = &app.state;
    let total = RouterState::get(&st.kv_blocks_total);
    let free = RouterState::get(&st.kv_blocks_free);
    let rows: [(&str, &str, &str, u64); 15] = [
        ("pagemill_queue_size", "gauge", "Requests waiting for admission", RouterState::get(&st.queue_size)),
        ("pagemill_batch_size", "gauge", "Sequences in the running batch", RouterState::get(&st.batch_size)),
        ("pagemill_kv_blocks_total", "gauge", "KV blocks the router can hand out", total),
        ("pagemill_kv_blocks_free", "gauge", "KV blocks free", free),
        ("pagemill_kv_blocks_used", "gauge", "KV blocks held by sequences", total - free),
        ("pagemill_requests_total", "counter", "Requests accepted", RouterState::get(&st.requests_total)),
        ("pagemill_requests_failed_total", "counter", "Requests ended by a shard failure", RouterState::get(&st.requests_failed)),
        ("pagemill_prefill_tokens_total", "counter", "Prompt tokens computed", RouterState::get(&st.prefill_tokens_total)),
        ("pagemill_generated_tokens_total", "counter", "Tokens generated", RouterState::get(&st.generated_tokens_total)),
        ("pagemill_decode_steps_total", "counter", "Decode steps run", RouterState::get(&st.decode_steps_total)),
        ("pagemill_kv_blocks_cached", "gauge", "KV blocks indexed by the prefix cache", RouterState::get(&st.kv_blocks_cached)),
        ("pagemill_prefix_hit_tokens_total", "counter", "Prompt tokens served from the prefix cache", RouterState::get(&st.prefix_hit_tokens_total)),
        ("pagemill_preemptions_total", "counter", "Sequences preempted when the KV pool ran out", RouterState::get(&st.preemptions_total)),
        ("pagemill_decode_forward_seconds_total", "counter", "Shard-reported forward time of decode steps", 0),
        ("pagemill_decode_step_seconds_total", "counter", "Router-measured time of decode steps", 0),
    ];
    let mut out = String::new();
    for (name, kind, help, value) in rows {
        out.push_str(&format!("# HELP {name} {help}\n# TYPE {name} {kind}\n"));
        let value = match name {
            "pagemill_decode_forward_seconds_total" => RouterState::get(&st.decode_forward_ns_total) as f64 / 1e9,
            "pagemill_decode_step_seconds_total" => RouterState::get(&st.decode_step_ns_total) as f64 / 1e9,
            _ => value as f64,
        };
        out.push_str(&format!("{name} {value}\n"));
    }
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], out)
}

//! SGLang's info routes, `GET /server_info` and `GET /model_info` (and their
//! older names `/get_server_info`, `/get_model_info`), in SGLang's shapes.
//! SGLang's gateway reads them when a worker registers: the model id
//! (`served_model_name`, else `model_path`), `tp_size`, `dp_size`, the
//! model's type and architectures; the pool figures are SGLang's names for
//! this server's.

use axum::extract::State;
use axum::Json;
use serde_json::{json, Value};

use super::AppState;
use crate::shared_state::RouterState;

/// SGLang's server arguments and scheduler figures, with this server's values.
#[utoipa::path(get, path = "/server_info", tag = "Ops",
    responses((status = 200, description = "SGLang's server info: model, parallelism, pool and limits")))]
pub async fn server_info(State(app): State<AppState>) -> Json<Value> {
    let info = &app.info;
    let groups = app.state.groups.len().max(1) as u64;
    // One group's pool, as SGLang reports one data-parallel rank's.
    let pool_tokens = RouterState::get(&app.state.kv_blocks_total) / groups * u64::from(info.block_size);
    Json(json!({
        "model_path": info.model_path,
        "tokenizer_path": info.model_path,
        "served_model_name": info.model_id,
        "tp_size": info.num_shards,
        "dp_size": groups,
        "load_balance_method": app.infer.placer().routing().to_string().replace('-', "_"),
        "disaggregation_mode": "null",
        "context_length": info.max_total_tokens,
        "max_running_requests": info.max_batch_size,
        "max_total_tokens": pool_tokens,
        "max_total_num_tokens": pool_tokens,
        "max_prefill_tokens": info.max_batch_prefill_tokens,
        "chunked_prefill_size": info.max_batch_prefill_tokens,
        "max_req_input_len": info.max_input_tokens,
        "page_size": info.block_size,
        "kv_cache_dtype": info.kv_cache_dtype,
        "disable_radix_cache": !info.prefix_caching,
        "dtype": info.model_dtype,
        "device": info.model_device_type,
        "is_embedding": false,
        "version": info.version,
    }))
}

/// SGLang's model info: paths, generation model, and the type and
/// architectures of the model's `config.json`.
#[utoipa::path(get, path = "/model_info", tag = "Ops",
    responses((status = 200, description = "SGLang's model info: model path, type and architectures")))]
pub async fn model_info(State(app): State<AppState>) -> Json<Value> {
    let path = &app.info.model_path;
    let config = model_config(path);
    Json(json!({
        "model_path": path,
        "tokenizer_path": path,
        "is_generation": true,
        "preferred_sampling_params": null,
        "weight_version": "default",
        "has_image_understanding": false,
        "has_audio_understanding": false,
        "model_type": config.get("model_type").cloned().unwrap_or(Value::Null),
        "architectures": config.get("architectures").cloned().unwrap_or(Value::Null),
    }))
}

/// The model directory's `config.json` (an empty object when it cannot be read): a
/// small file, read when a gateway registers the server.
fn model_config(model_path: &str) -> Value {
    let path = std::path::Path::new(model_path).join("config.json");
    match std::fs::read_to_string(path) {
        Ok(text) => serde_json::from_str(&text).unwrap_or_else(|_| json!({})),
        Err(_) => json!({}),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_model_type_comes_from_config_json() {
        let dir = std::env::temp_dir().join(format!("pagemill-sglang-info-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("config.json"), r#"{"model_type": "llama", "architectures": ["LlamaForCausalLM"]}"#)
            .unwrap();
        let config = model_config(dir.to_str().unwrap());
        assert_eq!(
            (config["model_type"].as_str(), config["architectures"][0].as_str()),
            (Some("llama"), Some("LlamaForCausalLM"))
        );
        assert_eq!(model_config("/nonexistent"), json!({}));
        std::fs::remove_dir_all(dir).unwrap();
    }
}

//! vLLM's routes for LoRA adapters at run time, `POST /v1/load_lora_adapter`
//! and `POST /v1/unload_lora_adapter`, in its shapes: a plain-text success
//! line, OpenAI's error body (400 for a bad request, 404 for an unknown
//! name). And `/v1/models`: the base model, then each adapter with its
//! `parent` (the base) and `root` (its directory), as vLLM lists them.

use axum::extract::State;
use axum::Json;
use serde::Deserialize;
use utoipa::ToSchema;

use super::types::{ModelCard, ModelList};
use crate::error::{OpenAiErrorBody, RouterError};
use crate::http::extract::JsonBody;
use crate::http::AppState;

#[derive(Debug, Deserialize, ToSchema)]
pub struct LoadLoraAdapterRequest {
    /// The name requests pick the adapter by (`model`, `adapter_id`).
    pub lora_name: String,
    /// A PEFT adapter directory (adapter_config.json + adapter_model.safetensors), as the server sees it.
    pub lora_path: String,
}

#[derive(Debug, Deserialize, ToSchema)]
pub struct UnloadLoraAdapterRequest {
    pub lora_name: String,
}

/// Registers a LoRA adapter (the server must run with `--enable-lora`).
#[utoipa::path(post, path = "/v1/load_lora_adapter", tag = "OpenAI", request_body = LoadLoraAdapterRequest,
    responses(
        (status = 200, description = "Loaded", body = String, content_type = "text/plain"),
        (status = 400, description = "LoRA not enabled, name taken, or the directory cannot be served", body = OpenAiErrorBody),
        (status = 413, description = "Body over --payload-limit", body = OpenAiErrorBody),
        (status = 401, description = "Missing or wrong API key", body = OpenAiErrorBody),
    ))]
pub async fn load_lora_adapter(
    State(app): State<AppState>,
    JsonBody(req): JsonBody<LoadLoraAdapterRequest>,
) -> Result<String, RouterError> {
    let lora = app.lora.clone();
    let name = req.lora_name.clone();
    // Reading the directory touches the disk: off the async workers.
    tokio::task::spawn_blocking(move || lora.load(&req.lora_name, &req.lora_path))
        .await
        .map_err(|e| RouterError::Generation(format!("loading the adapter stopped: {e}")))??;
    Ok(format!("Success: LoRA adapter '{name}' added successfully."))
}

/// Removes a LoRA adapter: new requests naming it get 404; those already
/// running with it finish.
#[utoipa::path(post, path = "/v1/unload_lora_adapter", tag = "OpenAI", request_body = UnloadLoraAdapterRequest,
    responses(
        (status = 200, description = "Unloaded", body = String, content_type = "text/plain"),
        (status = 400, description = "LoRA not enabled", body = OpenAiErrorBody),
        (status = 404, description = "No adapter of that name", body = OpenAiErrorBody),
        (status = 413, description = "Body over --payload-limit", body = OpenAiErrorBody),
        (status = 401, description = "Missing or wrong API key", body = OpenAiErrorBody),
    ))]
pub async fn unload_lora_adapter(
    State(app): State<AppState>,
    JsonBody(req): JsonBody<UnloadLoraAdapterRequest>,
) -> Result<String, RouterError> {
    app.lora.unload(&req.lora_name)?;
    Ok(format!("Success: LoRA adapter '{}' removed successfully.", req.lora_name))
}

/// The served model, then each LoRA adapter, in OpenAI's list format.
#[utoipa::path(get, path = "/v1/models", tag = "OpenAI",
    responses((status = 200, description = "The base model and its adapters", body = ModelList),
              (status = 401, description = "Missing or wrong API key", body = OpenAiErrorBody)))]
pub async fn models(State(app): State<AppState>) -> Json<ModelList> {
    let card = |id: &str, root: &str, parent: Option<&str>| ModelCard {
        id: id.to_string(),
        object: "model".into(),
        created: app.started_unix,
        owned_by: "pagemill".into(),
        root: root.to_string(),
        parent: parent.map(str::to_string),
    };
    let base = &app.info.model_id;
    let mut data = vec![card(base, &app.info.model_path, None)];
    data.extend(app.lora.list().iter().map(|a| card(&a.name, &a.path, Some(base))));
    Json(ModelList { object: "list".into(), data })
}

//! `GET /openapi.json`, generated from the Rust types, and `GET /docs`,
//! Swagger UI served from assets compiled into the router (works offline).

use axum::Json;
use utoipa::OpenApi;

use super::openai::{chat, completions, render};
use super::{ops, sglang_info, tgi};

#[derive(OpenApi)]
#[openapi(
    info(title = "pagemill", description = "LLM text generation: TGI- and OpenAI-compatible API"),
    paths(
        tgi::compat_generate,
        tgi::generate,
        tgi::generate_stream,
        tgi::tokenize,
        completions::completions,
        chat::chat_completions,
        render::render_completion,
        render::render_chat,
        super::responses::responses,
        super::anthropic::messages,
        super::openai::adapters::models,
        super::openai::adapters::load_lora_adapter,
        super::openai::adapters::unload_lora_adapter,
        ops::health,
        ops::info,
        ops::metrics,
        sglang_info::server_info,
        sglang_info::model_info,
    ),
    tags(
        (name = "TGI", description = "Hugging Face text-generation-inference routes"),
        (name = "OpenAI", description = "OpenAI-compatible routes"),
        (name = "Anthropic", description = "Anthropic-compatible Messages API"),
        (name = "Ops", description = "Health, info, metrics"),
    )
)]
pub struct ApiDoc;

pub async fn openapi_json() -> Json<utoipa::openapi::OpenApi> {
    Json(ApiDoc::openapi())
}

/// Swagger UI's page; its script and stylesheet are the crate's embedded
/// copies under /docs/assets, so the page needs no network.
const INDEX: &str = r##"<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8" />
<meta name="viewport" content="width=device-width, initial-scale=1" />
<title>pagemill API</title>
<link rel="stylesheet" href="/docs/assets/swagger-ui.css" />
</head>
<body>
<div id="swagger-ui"></div>
<script src="/docs/assets/swagger-ui-bundle.js"></script>
<script>
window.onload = () => { window.ui = SwaggerUIBundle({ url: "/openapi.json", dom_id: "#swagger-ui" }); };
</script>
</body>
</html>
"##;

/// `/docs` (and `/docs/`): our own index with absolute asset paths, since the
/// crate's index builds them from the request path (`/docs/` would break).
pub fn swagger_ui() -> axum::Router {
    let index = || async { axum::response::Html(INDEX) };
    swagger_ui_dist::generate_routes(swagger_ui_dist::ApiDefinition {
        uri_prefix: "/docs/assets",
        api_definition: swagger_ui_dist::OpenApiSource::Uri("/openapi.json"),
        title: Some("pagemill API"),
    })
    .route("/docs", axum::routing::get(index))
    .route("/docs/", axum::routing::get(index))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spec_has_every_route_and_schema() {
        let spec = serde_json::to_value(ApiDoc::openapi()).unwrap();
        for path in [
            "/",
            "/generate",
            "/generate_stream",
            "/tokenize",
            "/v1/completions",
            "/v1/chat/completions",
            "/v1/models",
            "/health",
            "/info",
            "/metrics",
            "/v1/completions/render",
            "/v1/chat/completions/render",
            "/server_info",
            "/model_info",
        ] {
            assert!(spec["paths"].get(path).is_some(), "missing {path}");
        }
        let schemas = &spec["components"]["schemas"];
        for s in [
            "GenerateRequest",
            "GenerateParameters",
            "ChatCompletionRequest",
            "ErrorBody",
            "GrammarParam",
            "OpenAiErrorBody",
        ] {
            assert!(schemas.get(s).is_some(), "missing schema {s}");
        }
    }

    /// Property names of a schema, through `$ref` and `allOf` (how flattened structs appear).
    fn properties(spec: &serde_json::Value, schema: &serde_json::Value) -> std::collections::BTreeSet<String> {
        if let Some(r) = schema.get("$ref").and_then(|r| r.as_str()) {
            let name = r.rsplit('/').next().unwrap();
            return properties(spec, &spec["components"]["schemas"][name]);
        }
        let mut names: std::collections::BTreeSet<String> =
            schema["properties"].as_object().map(|o| o.keys().cloned().collect()).unwrap_or_default();
        for part in schema["allOf"].as_array().into_iter().flatten() {
            names.extend(properties(spec, part));
        }
        names
    }

    /// `OpenAiJson` accepts exactly the fields the schema documents: the
    /// hand-kept lists cannot drift from the structs.
    #[test]
    fn accepted_openai_fields_are_the_schema_fields() {
        use crate::http::openai::engine_fields::ENGINE_FIELDS;
        use crate::http::openai::types::{ChatCompletionRequest, CompletionRequest, OpenAiBody, SAMPLING_FIELDS};
        let spec = serde_json::to_value(ApiDoc::openapi()).unwrap();
        for (name, own) in
            [("CompletionRequest", CompletionRequest::FIELDS), ("ChatCompletionRequest", ChatCompletionRequest::FIELDS)]
        {
            let documented = properties(&spec, &spec["components"]["schemas"][name]);
            let accepted: std::collections::BTreeSet<String> =
                own.iter().chain(SAMPLING_FIELDS).chain(ENGINE_FIELDS).map(|s| s.to_string()).collect();
            assert_eq!(documented, accepted, "{name}");
        }
    }
}

//! vLLM's render routes, `POST /v1/chat/completions/render` and
//! `POST /v1/completions/render`: what a request would be generated from,
//! without generating: the prompt's token ids (chat template applied) and the
//! sampling parameters as validated, in vLLM's `GenerateRequest` shape (one
//! per prompt for completions). `vllm-router` calls them before each request
//! and routes on the token ids. Input errors are the generation routes' own.

use std::collections::BTreeMap;

use axum::extract::State;
use axum::Json;
use serde::Serialize;
use utoipa::ToSchema;

use super::types::{ChatCompletionRequest, CompletionRequest, PromptInput, SamplingParams};
use crate::error::{OpenAiErrorBody, RouterError};
use crate::http::chat::prepare::prepare;
use crate::http::extract::OpenAiJson;
use crate::http::response_meta::ResponseMeta;
use crate::http::AppState;
use crate::infer::GenerateInput;
use crate::request::ValidRequest;

/// vLLM's `GenerateRequest`: the tokens-in request its render routes answer.
#[derive(Debug, Serialize, ToSchema)]
pub struct GenerateRequest {
    pub request_id: String,
    /// The prompt's token ids, as the generation routes would compute them.
    pub token_ids: Vec<u32>,
    /// Multimodal features: always `null` (text-only models).
    #[schema(value_type = Option<Object>)]
    pub features: Option<serde_json::Value>,
    pub sampling_params: VllmSamplingParams,
    pub model: String,
    pub stream: bool,
    #[schema(value_type = Option<Object>)]
    pub stream_options: Option<serde_json::Value>,
    pub cache_salt: Option<String>,
    pub priority: i64,
    #[schema(value_type = Option<Object>)]
    pub kv_transfer_params: Option<serde_json::Value>,
}

/// vLLM's `SamplingParams`, with the values this server would generate with.
#[derive(Debug, Serialize, ToSchema)]
pub struct VllmSamplingParams {
    pub n: u32,
    pub presence_penalty: f32,
    pub frequency_penalty: f32,
    pub repetition_penalty: f32,
    /// 0 when greedy.
    pub temperature: f32,
    pub top_p: f32,
    /// 0 disables.
    pub top_k: u32,
    pub min_p: f32,
    pub seed: Option<u64>,
    pub stop: Vec<String>,
    pub stop_token_ids: Vec<u32>,
    pub ignore_eos: bool,
    pub max_tokens: u32,
    pub min_tokens: u32,
    pub logprobs: Option<u32>,
    pub prompt_logprobs: Option<u32>,
    pub skip_special_tokens: bool,
    pub spaces_between_special_tokens: bool,
    pub include_stop_str_in_output: bool,
    /// Token id -> bias.
    pub logit_bias: Option<BTreeMap<u32, f32>>,
}

/// The token ids and sampling parameters of a chat request (vLLM's render).
#[utoipa::path(post, path = "/v1/chat/completions/render", tag = "OpenAI", request_body = ChatCompletionRequest,
    responses(
        (status = 200, description = "What the request would be generated from", body = GenerateRequest),
        (status = 400, description = "Invalid input, as on /v1/chat/completions", body = OpenAiErrorBody),
        (status = 401, description = "Missing or wrong API key", body = OpenAiErrorBody),
        (status = 404, description = "`model` names no model this server serves (with --enable-lora)", body = OpenAiErrorBody),
    ))]
pub async fn render_chat(
    State(app): State<AppState>,
    OpenAiJson(req): OpenAiJson<ChatCompletionRequest>,
) -> Result<Json<GenerateRequest>, RouterError> {
    let top_n = req.top_logprobs.filter(|_| req.logprobs == Some(true));
    req.reasoning_out()?;
    let prepared = prepare(&app, &req, top_n)?;
    let meta = ResponseMeta::new(&app, "chatcmpl");
    Ok(Json(generate_request(&app, meta.id, prepared.input, &req.sampling, top_n).await?))
}

/// The token ids and sampling parameters of each prompt of a completions request (vLLM's render).
#[utoipa::path(post, path = "/v1/completions/render", tag = "OpenAI", request_body = CompletionRequest,
    responses(
        (status = 200, description = "What each prompt would be generated from", body = [GenerateRequest]),
        (status = 400, description = "Invalid input, as on /v1/completions", body = OpenAiErrorBody),
        (status = 401, description = "Missing or wrong API key", body = OpenAiErrorBody),
        (status = 404, description = "`model` names no model this server serves (with --enable-lora)", body = OpenAiErrorBody),
    ))]
pub async fn render_completion(
    State(app): State<AppState>,
    OpenAiJson(req): OpenAiJson<CompletionRequest>,
) -> Result<Json<Vec<GenerateRequest>>, RouterError> {
    let prompts = req.prompt.clone().into_inputs();
    super::completions::check(&app, &req, prompts.len())?;
    let mut parameters = super::completions::parameters(&req)?;
    parameters.adapter = app.lora.for_model(req.sampling.model.as_deref())?;
    let meta = ResponseMeta::new(&app, "cmpl");
    let mut out = Vec::new();
    for (i, prompt) in prompts.into_iter().enumerate() {
        let input = match prompt {
            PromptInput::Text(text) => GenerateInput::new(text, parameters.clone()),
            PromptInput::Ids(ids) => GenerateInput {
                add_special_tokens: false,
                input_ids: Some(ids),
                ..GenerateInput::new(String::new(), parameters.clone())
            },
        };
        let id = format!("{}-{i}", meta.id);
        let mut rendered = generate_request(&app, id, input, &req.sampling, req.logprobs).await?;
        rendered.sampling_params.prompt_logprobs = req.prompt_logprobs;
        out.push(rendered);
    }
    Ok(Json(out))
}

/// One prompt validated as the generation routes validate it, in vLLM's shape.
async fn generate_request(
    app: &AppState,
    request_id: String,
    input: GenerateInput,
    sampling: &SamplingParams,
    logprobs: Option<u32>,
) -> Result<GenerateRequest, RouterError> {
    let n = sampling.n.unwrap_or(1);
    let validation = app.infer.validation();
    validation.check_fanout("n", n)?;
    let text = input.parameters.extras.text;
    let request =
        validation.validate(input.inputs, input.input_ids, input.parameters, input.add_special_tokens).await?;
    Ok(GenerateRequest {
        request_id,
        token_ids: request.input_ids.clone(),
        features: None,
        sampling_params: vllm_sampling(&request, n, logprobs, text.show_special_tokens, text.keep_stop),
        model: request.adapter.as_ref().map_or_else(|| app.info.model_id.clone(), |a| a.name.clone()),
        stream: sampling.stream,
        stream_options: sampling.stream_options.as_ref().map(|o| serde_json::json!({"include_usage": o.include_usage})),
        cache_salt: None,
        priority: i64::from(request.priority),
        kv_transfer_params: None,
    })
}

fn vllm_sampling(
    r: &ValidRequest,
    n: u32,
    logprobs: Option<u32>,
    special: bool,
    keep_stop: bool,
) -> VllmSamplingParams {
    let p = &r.parameters;
    VllmSamplingParams {
        n,
        presence_penalty: p.presence_penalty,
        frequency_penalty: p.frequency_penalty,
        repetition_penalty: p.repetition_penalty,
        temperature: if p.do_sample { p.temperature } else { 0.0 },
        top_p: p.top_p,
        top_k: p.top_k,
        min_p: p.min_p,
        seed: r.seed,
        stop: r.stop_sequences.clone(),
        stop_token_ids: r.stop_token_ids.clone(),
        ignore_eos: r.ignore_eos,
        max_tokens: r.max_new_tokens,
        min_tokens: r.min_new_tokens,
        logprobs,
        prompt_logprobs: None,
        skip_special_tokens: !special,
        spaces_between_special_tokens: true,
        include_stop_str_in_output: keep_stop,
        logit_bias: (!p.logit_bias.is_empty()).then(|| p.logit_bias.iter().map(|(k, v)| (*k, *v)).collect()),
    }
}

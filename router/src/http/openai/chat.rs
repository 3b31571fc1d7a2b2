//! `POST /v1/chat/completions`: messages rendered with the model's chat
//! template, then generated like any prompt.

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::Value as Json_;

use super::stream::{self, ChoiceEvent, ChoiceMsg};
use super::types::{
    ChatChoice, ChatChunkChoice, ChatCompletionChunk, ChatCompletionRequest, ChatCompletionResponse, ChatDelta,
    ChatLogprobs, ChatMessage, ChatResponseMessage, ContentPart, MessageContent, Usage, ROLES,
};
use super::{logprobs, ResponseMeta};
use crate::error::{OpenAiErrorBody, RouterError};
use crate::http::extract::OpenAiJson;
use crate::http::{headers, AppState};
use crate::infer::GenerateInput;

fn invalid(msg: impl Into<String>) -> RouterError {
    RouterError::Validation(msg.into())
}

/// Messages as the template sees them: `content` flattened to a string
/// (text parts joined), since the served models are text-only.
fn template_messages(messages: &[ChatMessage]) -> Result<Vec<Json_>, RouterError> {
    if messages.is_empty() {
        return Err(invalid("`messages` must not be empty"));
    }
    messages
        .iter()
        .enumerate()
        .map(|(i, m)| {
            if !ROLES.contains(&m.role.as_str()) {
                return Err(invalid(format!(
                    "`messages[{i}].role` must be one of {}; got {:?}",
                    ROLES.join(", "),
                    m.role
                )));
            }
            // OpenAI's newer name for system instructions; chat templates know "system".
            let role = if m.role == "developer" { "system" } else { m.role.as_str() };
            let content = match &m.content {
                None => String::new(),
                Some(MessageContent::Text(t)) => t.clone(),
                Some(MessageContent::Parts(parts)) => {
                    let mut text = String::new();
                    for p in parts {
                        match p {
                            ContentPart::Text { text: t } => text.push_str(t),
                            ContentPart::ImageUrl { .. } => {
                                return Err(invalid("image content is not supported by this text-only model"))
                            }
                        }
                    }
                    text
                }
            };
            let mut obj = serde_json::Map::new();
            obj.insert("role".into(), Json_::String(role.to_string()));
            obj.insert("content".into(), Json_::String(content));
            if let Some(name) = &m.name {
                obj.insert("name".into(), Json_::String(name.clone()));
            }
            if let Some(calls) = &m.tool_calls {
                obj.insert("tool_calls".into(), calls.clone());
            }
            if let Some(id) = &m.tool_call_id {
                obj.insert("tool_call_id".into(), Json_::String(id.clone()));
            }
            Ok(Json_::Object(obj))
        })
        .collect()
}

/// The rendered prompt for a chat request (also what `/v1/chat/completions` generates from).
pub fn render_prompt(app: &AppState, req: &ChatCompletionRequest) -> Result<String, RouterError> {
    let template = app.chat_template.as_ref().as_ref().map_err(|e| invalid(e.clone()))?;
    let messages = template_messages(&req.messages)?;
    let mut extra = req.chat_template_kwargs.clone().unwrap_or_default();
    if let Some(tools) = &req.tools {
        extra.insert("tools".into(), tools.clone());
    }
    template.apply(&messages, true, extra)
}

/// Chat completion (OpenAI API).
#[utoipa::path(post, path = "/v1/chat/completions", tag = "OpenAI", request_body = ChatCompletionRequest,
    responses(
        (status = 200, description = "The completion, or `chat.completion.chunk` SSE events when `stream`", content(
            (ChatCompletionResponse = "application/json"), (ChatCompletionChunk = "text/event-stream"))),
        (status = 401, description = "Missing or wrong API key", body = OpenAiErrorBody),
        (status = 400, description = "Invalid input, a field or role this route does not accept, or a chat template error", body = OpenAiErrorBody),
        (status = 424, description = "Generation failed", body = OpenAiErrorBody),
        (status = 413, description = "Body over --payload-limit", body = OpenAiErrorBody),
        (status = 429, description = "Too many concurrent requests, or queued past --max-queue-wait-ms", body = OpenAiErrorBody),
        (status = 503, description = "Shutting down (draining)", body = OpenAiErrorBody),
    ))]
pub async fn chat_completions(
    State(app): State<AppState>,
    OpenAiJson(req): OpenAiJson<ChatCompletionRequest>,
) -> Result<Response, RouterError> {
    let prompt = render_prompt(&app, &req)?;
    let want_logprobs = req.logprobs.unwrap_or(false);
    if req.top_logprobs.is_some() && !want_logprobs {
        return Err(invalid("`top_logprobs` requires `logprobs: true`"));
    }
    let max_top = app.infer.validation().limits().max_top_n_tokens;
    if let Some(k) = req.top_logprobs.filter(|&k| k > max_top) {
        return Err(invalid(format!("`top_logprobs` must be <= {max_top}. Given: {k}")));
    }
    let max_tokens = req.max_completion_tokens.or(req.sampling.max_tokens);
    let parameters = req.sampling.to_parameters(max_tokens, req.top_logprobs.filter(|_| want_logprobs))?;
    let input = GenerateInput { add_special_tokens: false, ..GenerateInput::new(prompt, parameters) };
    let n = req.sampling.n.unwrap_or(1);
    let meta = ResponseMeta::new(&app, "chatcmpl");
    let tokenizer = app.infer.validation().tokenizer().clone();

    if req.sampling.stream {
        let handles = app.infer.generate_streams(input, n, "n").await?;
        let prompt_tokens = handles.first().map_or(0, |h| h.request.input_ids.len() as u32);
        let chunk_meta = meta.clone();
        let chunk = move |msg: &ChoiceMsg| {
            let (token, top, finish) = match &msg.event {
                ChoiceEvent::Token { token, top_tokens } => (token, top_tokens, None),
                ChoiceEvent::End { token, top_tokens, generated } => {
                    (token, top_tokens, Some(generated.finish_reason.openai().to_string()))
                }
            };
            let logprobs = want_logprobs
                .then(|| ChatLogprobs { content: logprobs::chat(&tokenizer, token, top).into_iter().collect() });
            let content = if token.special { String::new() } else { token.text.clone() };
            serde_json::to_value(chunk_of(&chunk_meta, vec![ChatChunkChoice {
                index: msg.index,
                delta: ChatDelta { role: "assistant".into(), content: Some(content) },
                logprobs,
                finish_reason: finish,
            }], None))
            .ok()
        };
        let usage = req.sampling.include_usage().then(|| {
            Box::new(move |u: Usage| serde_json::to_value(chunk_of(&meta, vec![], Some(u))).unwrap_or_default())
                as stream::UsageFn
        });
        let handles = handles.into_iter().enumerate().map(|(i, h)| (i as u32, h)).collect();
        return Ok(stream::sse(handles, prompt_tokens, Box::new(chunk), usage));
    }

    let responses = app.infer.generate_n(input, n, "n").await?;
    let prompt_tokens = responses.first().map_or(0, |r| r.input_length);
    let completion_tokens = responses.iter().map(|r| r.generated_text.generated_tokens).sum();
    let headers = responses
        .first()
        .map(|r| headers::timing(r, &app.info.model_device_type, completion_tokens))
        .unwrap_or_default();
    let choices = responses
        .iter()
        .enumerate()
        .map(|(i, r)| ChatChoice {
            index: i as u32,
            message: ChatResponseMessage { role: "assistant".into(), content: r.generated_text.text.clone() },
            logprobs: want_logprobs.then(|| ChatLogprobs {
                content: r
                    .tokens
                    .iter()
                    .enumerate()
                    .filter_map(|(j, t)| {
                        logprobs::chat(&tokenizer, t, r.top_tokens.get(j).map(Vec::as_slice).unwrap_or_default())
                    })
                    .collect(),
            }),
            finish_reason: r.generated_text.finish_reason.openai().to_string(),
        })
        .collect();
    let body = ChatCompletionResponse {
        id: meta.id,
        object: "chat.completion".into(),
        created: meta.created,
        model: meta.model,
        system_fingerprint: meta.system_fingerprint,
        choices,
        usage: Usage::new(prompt_tokens, completion_tokens),
    };
    Ok((headers, Json(body)).into_response())
}

fn chunk_of(meta: &ResponseMeta, choices: Vec<ChatChunkChoice>, usage: Option<Usage>) -> ChatCompletionChunk {
    ChatCompletionChunk {
        id: meta.id.clone(),
        object: "chat.completion.chunk".into(),
        created: meta.created,
        model: meta.model.clone(),
        system_fingerprint: meta.system_fingerprint.clone(),
        choices,
        usage,
    }
}

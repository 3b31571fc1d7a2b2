//! `POST /v1/chat/completions`: messages rendered with the model's chat
//! template, then generated like any prompt.

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::Value as Json_;

use super::prepare::{prepare, PreparedChat};
use super::reply::{self, CallDelta, StreamSplitter};
use super::stream::{self, ChoiceEvent, ChoiceMsg};
use super::types::{
    ChatChoice, ChatChunkChoice, ChatCompletionChunk, ChatCompletionRequest, ChatCompletionResponse, ChatDelta,
    ChatLogprobs, ChatMessage, ChatResponseMessage, ContentPart, FunctionCallDelta, MessageContent, ToolCallDelta,
    Usage, ROLES,
};
use super::{logprobs, ResponseMeta};
use crate::error::{OpenAiErrorBody, RouterError};
use crate::http::extract::OpenAiJson;
use crate::http::tenant::Tenant;
use crate::http::{headers, AppState};

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
                obj.insert("tool_calls".into(), crate::tools::history_tool_calls(calls));
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
        extra.insert("tools".into(), serde_json::to_value(tools).unwrap_or_default());
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
    tenant: Tenant,
    OpenAiJson(mut req): OpenAiJson<ChatCompletionRequest>,
) -> Result<Response, RouterError> {
    tenant.fill(&mut req.sampling.user);
    let want_logprobs = req.logprobs.unwrap_or(false);
    if req.top_logprobs.is_some() && !want_logprobs {
        return Err(invalid("`top_logprobs` requires `logprobs: true`"));
    }
    let max_top = app.infer.validation().limits().max_top_n_tokens;
    if let Some(k) = req.top_logprobs.filter(|&k| k > max_top) {
        return Err(invalid(format!("`top_logprobs` must be <= {max_top}. Given: {k}")));
    }
    let PreparedChat { input, n, plan, think } = prepare(&app, &req, req.top_logprobs.filter(|_| want_logprobs))?;
    let meta = ResponseMeta::new(&app, "chatcmpl");
    let tokenizer = app.infer.validation().tokenizer().clone();

    if req.sampling.stream {
        let handles = app.infer.generate_streams(input, n, "n").await?;
        let prompt_tokens = handles.first().map_or(0, |h| h.request.input_ids.len() as u32);
        let chunk_meta = meta.clone();
        let mut splitters: std::collections::HashMap<u32, StreamSplitter> = Default::default();
        let chunk = move |msg: &ChoiceMsg| {
            let (token, top, generated) = match &msg.event {
                ChoiceEvent::Token { token, top_tokens } => (token, top_tokens, None),
                ChoiceEvent::End { token, top_tokens, generated } => (token, top_tokens, Some(generated)),
            };
            let logprobs = want_logprobs
                .then(|| ChatLogprobs { content: logprobs::chat(&tokenizer, token, top).into_iter().collect() });
            let text = if token.special { "" } else { token.text.as_str() };
            let splitter = splitters.entry(msg.index).or_insert_with(|| StreamSplitter::new(plan.as_ref(), think));
            let step = splitter.push(text, generated.is_some());
            let finish = generated.map(|g| {
                let reason = g.finish_reason.openai();
                if splitter.calls_finished() {
                    "tool_calls".to_string()
                } else {
                    reason.to_string()
                }
            });
            let choice = |delta: ChatDelta, logprobs, finish_reason| ChatChunkChoice {
                index: msg.index,
                delta,
                logprobs,
                finish_reason,
            };
            let delta = |content: Option<String>, tool_calls| ChatDelta {
                role: "assistant".into(),
                content,
                reasoning_content: None,
                tool_calls,
            };
            // The step's reasoning and text (with its logprobs), then each call it completed, then the finish.
            let mut choices = Vec::new();
            let reasoning = (!step.reasoning.is_empty()).then_some(step.reasoning);
            if reasoning.is_some()
                || !step.content.is_empty()
                || logprobs.is_some()
                || (step.tool_calls.is_empty() && finish.is_none())
            {
                let content = (reasoning.is_none() || !step.content.is_empty()).then_some(step.content);
                let d = ChatDelta { reasoning_content: reasoning, ..delta(content, vec![]) };
                choices.push(choice(d, logprobs, None));
            }
            let no_calls = step.tool_calls.is_empty();
            for call in step.tool_calls {
                let d = match call {
                    CallDelta::Start { index, id, name } => ToolCallDelta {
                        index,
                        id: Some(id),
                        kind: Some("function".into()),
                        function: FunctionCallDelta { name: Some(name), arguments: String::new() },
                    },
                    CallDelta::Args { index, text } => ToolCallDelta {
                        index,
                        id: None,
                        kind: None,
                        function: FunctionCallDelta { name: None, arguments: text },
                    },
                    CallDelta::End { .. } => continue,
                };
                choices.push(choice(delta(None, vec![d]), None, None));
            }
            // One chunk per token: the last token's text carries the finish
            // (clients count chunks); a separate chunk only after tool calls or for no text.
            if let Some(reason) = finish {
                match choices.last_mut() {
                    Some(last) if no_calls => last.finish_reason = Some(reason),
                    _ => choices.push(choice(delta(Some(String::new()), vec![]), None, Some(reason))),
                }
            }
            choices.into_iter().map(|c| stream::chunk_event(&chunk_of(&chunk_meta, vec![c], None))).collect()
        };
        let usage = req.sampling.include_usage().then(|| {
            Box::new(move |u: Usage| stream::chunk_event(&chunk_of(&meta, vec![], Some(u)))) as stream::UsageFn
        });
        let handles = handles.into_iter().enumerate().map(|(i, h)| (i as u32, h)).collect();
        return Ok(stream::sse(handles, prompt_tokens, Box::new(chunk), usage, stream::OPENAI));
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
        .map(|(i, r)| {
            let reply = reply::split(plan.as_ref(), think, &r.generated_text.text);
            let finish_reason = reply.finish_reason(r.generated_text.finish_reason.openai());
            let content = (!(reply.content.is_empty() && !reply.tool_calls.is_empty())).then_some(reply.content);
            ChatChoice {
                index: i as u32,
                message: ChatResponseMessage {
                    role: "assistant".into(),
                    content,
                    reasoning_content: reply.reasoning,
                    tool_calls: reply.tool_calls,
                },
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
                finish_reason,
            }
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

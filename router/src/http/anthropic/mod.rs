//! Anthropic Messages API, `POST /v1/messages`: translated into a chat
//! request (`convert`), generated and split into reasoning, text and tool
//! calls by the chat pipeline (http/chat/), and answered in Anthropic's shapes.

mod convert;
mod events;
pub mod types;

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::json;

use super::chat::prepare::{prepare, PreparedChat};
use super::chat::reply::{self, StreamSplitter};
use super::extract::JsonBody;
use super::response_meta::ResponseMeta;
use super::sse::{self, ChoiceEvent, ChoiceMsg, Framing};
use super::AppState;
use crate::error::{AnthropicErrorBody, RouterError};
use crate::http::tenant::Tenant;
use crate::response::FinishReason;
use types::{tool_use_id, MessagesRequest, MessagesResponse, MessagesUsage, OutputBlock};

fn stop_reason(finish: &FinishReason, made_calls: bool) -> &'static str {
    match finish {
        _ if made_calls => "tool_use",
        FinishReason::Length => "max_tokens",
        FinishReason::StopSequence => "stop_sequence",
        FinishReason::EosToken => "end_turn",
    }
}

fn error_event(e: &RouterError) -> axum::response::sse::Event {
    axum::response::sse::Event::default()
        .event("error")
        .data(serde_json::to_string(&e.anthropic_body()).unwrap_or_default())
}

const FRAMING: Framing = Framing { error: error_event, done: false };

/// Create a message (Anthropic Messages API).
#[utoipa::path(post, path = "/v1/messages", tag = "Anthropic", request_body = MessagesRequest,
    responses(
        (status = 200, description = "The message, or its named SSE events when `stream`", content(
            (MessagesResponse = "application/json"), (String = "text/event-stream"))),
        (status = 400, description = "Invalid input, or a field this route does not accept", body = AnthropicErrorBody),
        (status = 401, description = "Missing or wrong API key (`x-api-key` or `Authorization: Bearer`)", body = AnthropicErrorBody),
        (status = 404, description = "`model` names no model this server serves (with --enable-lora)", body = AnthropicErrorBody),
        (status = 424, description = "Generation failed", body = AnthropicErrorBody),
        (status = 413, description = "Body over --payload-limit", body = AnthropicErrorBody),
        (status = 429, description = "Too many concurrent requests, or queued past --max-queue-wait-ms", body = AnthropicErrorBody),
        (status = 503, description = "Shutting down (draining)", body = AnthropicErrorBody),
    ))]
pub async fn messages(
    State(app): State<AppState>,
    tenant: Tenant,
    JsonBody(req): JsonBody<MessagesRequest>,
) -> Result<Response, RouterError> {
    let mut chat = convert::to_chat(&req)?;
    tenant.fill(&mut chat.sampling.user);
    let PreparedChat { input, plan, think, .. } = prepare(&app, &chat, None)?;
    let meta = ResponseMeta::new(&app, "msg").serving(input.parameters.adapter.as_ref());

    if req.stream {
        let handles = app.infer.generate_streams(input, 1, "n").await?;
        let prompt_tokens = handles.first().map_or(0, |h| h.request.input_ids.len() as u32);
        let start = json!({"id": meta.id, "type": "message", "role": "assistant", "model": req.model,
            "content": [], "stop_reason": null, "stop_sequence": null,
            "usage": {"input_tokens": prompt_tokens, "output_tokens": 0}});
        let mut events = events::MessageEvents::new(start);
        let mut splitter = StreamSplitter::new(plan.as_ref(), think);
        let chunk = move |msg: &ChoiceMsg| {
            let (token, generated) = match &msg.event {
                ChoiceEvent::Token { token, .. } => (token, None),
                ChoiceEvent::End { token, generated, .. } => (token, Some(generated)),
            };
            let text = if token.special { "" } else { token.text.as_str() };
            let step = splitter.push(text, generated.is_some());
            let end = generated.map(|g| (stop_reason(&g.finish_reason, splitter.calls_finished()), g.generated_tokens));
            events.step(step, end)
        };
        let handles = handles.into_iter().map(|h| (0, h)).collect();
        return Ok(sse::sse(handles, prompt_tokens, Box::new(chunk), None, FRAMING));
    }

    let r = app.infer.generate_one(input).await?;
    let reply = reply::split(plan.as_ref(), think, &r.generated_text.text);
    let mut content = Vec::new();
    if let Some(thinking) = reply.reasoning {
        content.push(OutputBlock::Thinking { thinking, signature: String::new() });
    }
    if !reply.content.is_empty() {
        content.push(OutputBlock::Text { text: reply.content });
    }
    let made_calls = !reply.tool_calls.is_empty();
    for call in reply.tool_calls {
        let input = serde_json::from_str(&call.function.arguments).unwrap_or_else(|_| json!({}));
        content.push(OutputBlock::ToolUse { id: tool_use_id(&call.id), name: call.function.name, input });
    }
    let body = MessagesResponse {
        id: meta.id,
        kind: "message".into(),
        role: "assistant".into(),
        model: req.model,
        content,
        stop_reason: Some(stop_reason(&r.generated_text.finish_reason, made_calls).into()),
        stop_sequence: None,
        usage: MessagesUsage { input_tokens: r.input_length, output_tokens: r.generated_text.generated_tokens },
    };
    Ok(Json(body).into_response())
}

//! OpenAI Responses API, `POST /v1/responses`, stateless: translated into a
//! chat request (`convert`), generated and split by the chat pipeline (http/chat/), and
//! answered as a response object with output items, or as its typed
//! streaming events. Errors have OpenAI's shape (the `openai_errors` layer).

mod convert;
mod events;
mod items;
pub mod types;

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};

use super::chat::prepare::{prepare, PreparedChat};
use super::chat::reply::{self, StreamSplitter};
use super::extract::JsonBody;
use super::openai::OPENAI;
use super::response_meta::{unix_now, ResponseMeta};
use super::sse::{self, ChoiceEvent, ChoiceMsg, Framing};
use super::AppState;
use crate::error::{OpenAiErrorBody, RouterError};
use crate::http::tenant::Tenant;
use crate::response::FinishReason;
use items::{call_item, message_item, reasoning_item};
use types::{ResponseObject, ResponsesRequest};

fn usage(input: u32, output: u32) -> Value {
    json!({"input_tokens": input, "input_tokens_details": {"cached_tokens": 0},
           "output_tokens": output, "output_tokens_details": {"reasoning_tokens": 0},
           "total_tokens": input + output})
}

/// The response object before any output.
fn base(req: &ResponsesRequest, meta: &ResponseMeta) -> ResponseObject {
    ResponseObject {
        id: meta.id.clone(),
        object: "response".into(),
        created_at: unix_now(),
        status: "in_progress".into(),
        model: req.model.clone(),
        output: vec![],
        incomplete_details: None,
        instructions: req.instructions.clone(),
        max_output_tokens: req.max_output_tokens,
        parallel_tool_calls: req.parallel_tool_calls.unwrap_or(true),
        temperature: req.temperature,
        top_p: req.top_p,
        tool_choice: match &req.tool_choice {
            None => json!("auto"),
            Some(types::ToolChoice::Mode(m)) => json!(m),
            Some(types::ToolChoice::Function(f)) => json!({"type": "function", "name": f.name}),
        },
        tools: req
            .tools
            .iter()
            .flatten()
            .map(|t| {
                json!({"type": "function", "name": t.name,
            "description": t.description, "parameters": t.parameters, "strict": t.strict.unwrap_or(false)})
            })
            .collect(),
        metadata: json!(req.metadata.clone().unwrap_or_default()),
        store: false,
        error: None,
        usage: None,
    }
}

/// Sets the final status from the finish reason.
fn finish(obj: &mut ResponseObject, reason: &FinishReason, input: u32, output: u32) {
    if matches!(reason, FinishReason::Length) {
        obj.status = "incomplete".into();
        obj.incomplete_details = Some(json!({"reason": "max_output_tokens"}));
    } else {
        obj.status = "completed".into();
    }
    obj.usage = Some(usage(input, output));
}

/// Create a model response (OpenAI Responses API, stateless).
#[utoipa::path(post, path = "/v1/responses", tag = "OpenAI", request_body = ResponsesRequest,
    responses(
        (status = 200, description = "The response, or its typed SSE events when `stream`", content(
            (ResponseObject = "application/json"), (String = "text/event-stream"))),
        (status = 400, description = "Invalid input, or a field this route does not accept", body = OpenAiErrorBody),
        (status = 401, description = "Missing or wrong API key", body = OpenAiErrorBody),
        (status = 404, description = "`model` names no model this server serves (with --enable-lora)", body = OpenAiErrorBody),
        (status = 424, description = "Generation failed", body = OpenAiErrorBody),
        (status = 413, description = "Body over --payload-limit", body = OpenAiErrorBody),
        (status = 429, description = "Too many concurrent requests, or queued past --max-queue-wait-ms", body = OpenAiErrorBody),
        (status = 503, description = "Shutting down (draining)", body = OpenAiErrorBody),
    ))]
pub async fn responses(
    State(app): State<AppState>,
    tenant: Tenant,
    JsonBody(req): JsonBody<ResponsesRequest>,
) -> Result<Response, RouterError> {
    let mut chat = convert::to_chat(&req)?;
    tenant.fill(&mut chat.sampling.user);
    let PreparedChat { input, plan, think, .. } = prepare(&app, &chat, None)?;
    let meta = ResponseMeta::new(&app, "resp").serving(input.parameters.adapter.as_ref());
    let mut obj = base(&req, &meta);

    if req.stream {
        let handles = app.infer.generate_streams(input, 1, "n").await?;
        let prompt_tokens = handles.first().map_or(0, |h| h.request.input_ids.len() as u32);
        let mut events = events::ResponseEvents::new(obj, &meta.id);
        let mut splitter = StreamSplitter::new(plan.as_ref(), think);
        let chunk = move |msg: &ChoiceMsg| {
            let (token, generated) = match &msg.event {
                ChoiceEvent::Token { token, .. } => (token, None),
                ChoiceEvent::End { token, generated, .. } => (token, Some(generated)),
            };
            let text = if token.special { "" } else { token.text.as_str() };
            let step = splitter.push(text, generated.is_some());
            let mut out = events.step(step);
            if let Some(g) = generated {
                out.extend(events.end(|o| finish(o, &g.finish_reason, prompt_tokens, g.generated_tokens)));
            }
            out
        };
        let handles = handles.into_iter().map(|h| (0, h)).collect();
        let framing = Framing { done: false, ..OPENAI };
        return Ok(sse::sse(handles, prompt_tokens, Box::new(chunk), None, framing));
    }

    let r = app.infer.generate_one(input).await?;
    let reply = reply::split(plan.as_ref(), think, &r.generated_text.text);
    if let Some(reasoning) = &reply.reasoning {
        obj.output.push(reasoning_item(&format!("rs_{}", meta.id), reasoning));
    }
    if !reply.content.is_empty() || reply.tool_calls.is_empty() {
        obj.output.push(message_item(&format!("msg_{}", meta.id), &reply.content, "completed"));
    }
    for call in &reply.tool_calls {
        obj.output.push(call_item(&call.id, &call.function.name, &call.function.arguments, "completed"));
    }
    finish(&mut obj, &r.generated_text.finish_reason, r.input_length, r.generated_text.generated_tokens);
    Ok(Json(obj).into_response())
}

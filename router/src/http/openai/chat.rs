//! `POST /v1/chat/completions`: messages rendered with the model's chat
//! template (the chat pipeline, http/chat/), generated like any prompt, and
//! answered as a `chat.completion` or a stream of `chat.completion.chunk`s.

use std::collections::HashMap;
use std::sync::Arc;

use axum::extract::State;
use axum::response::sse::Event;
use axum::response::{IntoResponse, Response};
use axum::Json;
use tokenizers::Tokenizer;

use super::types::{
    ChatChoice, ChatChunkChoice, ChatCompletionChunk, ChatCompletionRequest, ChatCompletionResponse, ChatDelta,
    ChatLogprobs, ChatResponseMessage, FunctionCallDelta, ToolCallDelta, Usage,
};
use super::{logprobs, OPENAI};
use crate::error::{OpenAiErrorBody, RouterError};
use crate::http::chat::engine_chat::ReasoningOut;
use crate::http::chat::prepare::{prepare, PreparedChat};
use crate::http::chat::reply::{self, CallDelta, StepDelta, StreamSplitter};
use crate::http::extract::OpenAiJson;
use crate::http::response_meta::ResponseMeta;
use crate::http::sse::{self, json_event, ChoiceEvent, ChoiceMsg, UsageFn};
use crate::http::tenant::Tenant;
use crate::http::{headers, AppState};
use crate::infer::InferResponse;
use crate::tools::ToolPlan;

fn invalid(msg: impl Into<String>) -> RouterError {
    RouterError::Validation(msg.into())
}

/// How each choice's text is read back: tool calls, the think block, logprobs.
struct ReplyPlan {
    plan: Option<ToolPlan>,
    /// With --reasoning-parser, and the reasoning not left in the content.
    think: Option<bool>,
    want_logprobs: bool,
    /// The reasoning is not returned (`include_reasoning: false`).
    drop_reasoning: bool,
    /// Streamed reasoning is held and sent in one delta when it ends (`stream_reasoning: false`).
    hold_reasoning: bool,
}

/// Chat completion (OpenAI API).
#[utoipa::path(post, path = "/v1/chat/completions", tag = "OpenAI", request_body = ChatCompletionRequest,
    responses(
        (status = 200, description = "The completion, or `chat.completion.chunk` SSE events when `stream`", content(
            (ChatCompletionResponse = "application/json"), (ChatCompletionChunk = "text/event-stream"))),
        (status = 401, description = "Missing or wrong API key", body = OpenAiErrorBody),
        (status = 404, description = "`model` names no model this server serves (with --enable-lora)", body = OpenAiErrorBody),
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
    let top_n = top_logprobs(&app, &req, want_logprobs)?;
    let reasoning = req.reasoning_out()?;
    let PreparedChat { input, n, plan, think } = prepare(&app, &req, top_n)?;
    let meta = ResponseMeta::new(&app, "chatcmpl").serving(input.parameters.adapter.as_ref());
    let reply = ReplyPlan {
        plan,
        think: think.filter(|_| reasoning != ReasoningOut::Inline),
        want_logprobs,
        drop_reasoning: reasoning == ReasoningOut::Drop,
        hold_reasoning: !req.stream_reasoning(),
    };
    if req.sampling.stream {
        let handles = app.infer.generate_streams(input, n, "n").await?;
        let prompt_tokens = handles.first().map_or(0, |h| h.request.input_ids.len() as u32);
        let tokenizer = app.infer.validation().tokenizer().clone();
        let mut chunks =
            Chunks { meta: meta.clone(), tokenizer, reply, splitters: HashMap::new(), held: HashMap::new() };
        let chunk = move |msg: &ChoiceMsg| chunks.events(msg);
        let usage = req.sampling.include_usage().then(|| {
            let usage =
                move |prompt, completion| json_event(&chunk_of(&meta, vec![], Some(Usage::new(prompt, completion))));
            Box::new(usage) as UsageFn
        });
        let handles = handles.into_iter().enumerate().map(|(i, h)| (i as u32, h)).collect();
        return Ok(sse::sse(handles, prompt_tokens, Box::new(chunk), usage, OPENAI));
    }
    let responses = app.infer.generate_n(input, n, "n").await?;
    let prompt_tokens = responses.first().map_or(0, |r| r.input_length);
    let completion_tokens = responses.iter().map(|r| r.generated_text.generated_tokens).sum();
    let headers = responses
        .first()
        .map(|r| headers::timing(r, &app.info.model_device_type, completion_tokens))
        .unwrap_or_default();
    let tokenizer = app.infer.validation().tokenizer();
    let choices = responses.iter().enumerate().map(|(i, r)| whole_choice(i as u32, r, &reply, tokenizer)).collect();
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

/// Alternatives per token to ask for: `top_logprobs`, which needs `logprobs: true`.
fn top_logprobs(app: &AppState, req: &ChatCompletionRequest, want_logprobs: bool) -> Result<Option<u32>, RouterError> {
    if req.top_logprobs.is_some() && !want_logprobs {
        return Err(invalid("`top_logprobs` requires `logprobs: true`"));
    }
    let max_top = app.infer.validation().limits().max_top_n_tokens;
    if let Some(k) = req.top_logprobs.filter(|&k| k > max_top) {
        return Err(invalid(format!("`top_logprobs` must be <= {max_top}. Given: {k}")));
    }
    Ok(req.top_logprobs.filter(|_| want_logprobs))
}

/// One choice of a whole reply: its text split into reasoning, content and tool calls.
fn whole_choice(index: u32, r: &InferResponse, reply: &ReplyPlan, tokenizer: &Tokenizer) -> ChatChoice {
    let split = reply::split(reply.plan.as_ref(), reply.think, &r.generated_text.text);
    let finish_reason = split.finish_reason(r.generated_text.finish_reason.openai());
    let content = (!(split.content.is_empty() && !split.tool_calls.is_empty())).then_some(split.content);
    let top = |j: usize| r.top_tokens.get(j).map(Vec::as_slice).unwrap_or_default();
    ChatChoice {
        index,
        message: ChatResponseMessage {
            role: "assistant".into(),
            content,
            reasoning_content: split.reasoning.filter(|_| !reply.drop_reasoning),
            tool_calls: split.tool_calls,
        },
        logprobs: reply.want_logprobs.then(|| ChatLogprobs {
            content: r.tokens.iter().enumerate().filter_map(|(j, t)| logprobs::chat(tokenizer, t, top(j))).collect(),
        }),
        finish_reason,
    }
}

/// The `chat.completion.chunk`s of a streamed request; each choice's text
/// is split as it streams.
struct Chunks {
    meta: ResponseMeta,
    tokenizer: Arc<Tokenizer>,
    reply: ReplyPlan,
    splitters: HashMap<u32, StreamSplitter>,
    /// Each choice's reasoning held back (`stream_reasoning: false`).
    held: HashMap<u32, String>,
}

impl Chunks {
    fn events(&mut self, msg: &ChoiceMsg) -> Vec<Event> {
        let (token, top, generated) = match &msg.event {
            ChoiceEvent::Token { token, top_tokens } => (token, top_tokens, None),
            ChoiceEvent::End { token, top_tokens, generated } => (token, top_tokens, Some(generated)),
        };
        let logprobs = self
            .reply
            .want_logprobs
            .then(|| ChatLogprobs { content: logprobs::chat(&self.tokenizer, token, top).into_iter().collect() });
        let text = if token.special { "" } else { token.text.as_str() };
        let (plan, think) = (self.reply.plan.as_ref(), self.reply.think);
        let splitter = self.splitters.entry(msg.index).or_insert_with(|| StreamSplitter::new(plan, think));
        let mut step = splitter.push(text, generated.is_some());
        let finish = generated.map(|g| {
            if splitter.calls_finished() {
                "tool_calls".to_string()
            } else {
                g.finish_reason.openai().to_string()
            }
        });
        self.place_reasoning(msg.index, &mut step, finish.is_some());
        let choices = step_choices(msg.index, step, logprobs, finish);
        choices.into_iter().map(|c| json_event(&chunk_of(&self.meta, vec![c], None))).collect()
    }
}

impl Chunks {
    /// A step's reasoning dropped, held, or (held so far and) sent: held
    /// reasoning goes out once the answer starts or the reply ends.
    fn place_reasoning(&mut self, index: u32, step: &mut StepDelta, last: bool) {
        if self.reply.drop_reasoning {
            step.reasoning.clear();
            return;
        }
        if !self.reply.hold_reasoning {
            return;
        }
        let held = self.held.entry(index).or_default();
        held.push_str(&std::mem::take(&mut step.reasoning));
        if last || !step.content.is_empty() || !step.tool_calls.is_empty() {
            step.reasoning = std::mem::take(held);
        }
    }
}

fn delta(content: Option<String>, tool_calls: Vec<ToolCallDelta>) -> ChatDelta {
    ChatDelta { role: "assistant".into(), content, reasoning_content: None, tool_calls }
}

/// One streamed step as chunk choices: the step's reasoning and text (with
/// its logprobs), then each call it began or continued, then the finish.
fn step_choices(
    index: u32,
    step: StepDelta,
    logprobs: Option<ChatLogprobs>,
    finish: Option<String>,
) -> Vec<ChatChunkChoice> {
    let choice = |delta, logprobs, finish_reason| ChatChunkChoice { index, delta, logprobs, finish_reason };
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
    for call in step.tool_calls.into_iter().filter_map(call_delta) {
        choices.push(choice(delta(None, vec![call]), None, None));
    }
    // One chunk per token: the last token's text carries the finish
    // (clients count chunks); a separate chunk only after tool calls or for no text.
    if let Some(reason) = finish {
        match choices.last_mut() {
            Some(last) if no_calls => last.finish_reason = Some(reason),
            _ => choices.push(choice(delta(Some(String::new()), vec![]), None, Some(reason))),
        }
    }
    choices
}

/// A call's part of a step in OpenAI's delta shape; its end sends nothing.
fn call_delta(call: CallDelta) -> Option<ToolCallDelta> {
    match call {
        CallDelta::Start { index, id, name } => Some(ToolCallDelta {
            index,
            id: Some(id),
            kind: Some("function".into()),
            function: FunctionCallDelta { name: Some(name), arguments: String::new() },
        }),
        CallDelta::Args { index, text } => Some(ToolCallDelta {
            index,
            id: None,
            kind: None,
            function: FunctionCallDelta { name: None, arguments: text },
        }),
        CallDelta::End { .. } => None,
    }
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

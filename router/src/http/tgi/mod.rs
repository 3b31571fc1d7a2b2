//! TGI routes: `/generate`, `/generate_stream`, the `POST /` compat route
//! (dispatching on `stream`), and `/tokenize`.

pub mod types;

use std::convert::Infallible;

use axum::extract::State;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures::stream::{self, Stream};

use super::extract::JsonBody;
use super::headers;
use super::sse::json_event;
use super::tenant::Tenant;
use super::AppState;
use crate::error::{ErrorBody, RouterError};
use crate::infer::{GenerateInput, InferResponse, StreamHandle};
use crate::stream::InferStreamResponse;
use types::{
    BestOfSequence, CompatGenerateRequest, Details, GenerateRequest, GenerateResponse, SimpleToken, StreamDetails,
    StreamResponse,
};

/// Generate text for a prompt (whole response at once).
#[utoipa::path(post, path = "/generate", tag = "TGI", request_body = GenerateRequest,
    responses(
        (status = 200, description = "Generated text", body = GenerateResponse),
        (status = 422, description = "Invalid input", body = ErrorBody),
        (status = 424, description = "Generation failed", body = ErrorBody),
        (status = 401, description = "Missing or wrong API key", body = ErrorBody),
        (status = 404, description = "`adapter_id` names no LoRA adapter this server serves", body = ErrorBody),
        (status = 413, description = "Body over --payload-limit", body = ErrorBody),
        (status = 429, description = "Too many concurrent requests, or queued past --max-queue-wait-ms", body = ErrorBody),
        (status = 503, description = "Shutting down (draining)", body = ErrorBody),
    ))]
pub async fn generate(
    State(app): State<AppState>,
    tenant: Tenant,
    JsonBody(mut req): JsonBody<GenerateRequest>,
) -> Result<Response, RouterError> {
    tenant.fill(&mut req.parameters.user);
    let (headers, body) = run_generate(&app, req).await?;
    Ok((headers, Json(body)).into_response())
}

/// Server-sent events, one per token; the last carries `generated_text`.
#[utoipa::path(post, path = "/generate_stream", tag = "TGI", request_body = GenerateRequest,
    responses(
        (status = 200, description = "One `data:` event per token", body = StreamResponse, content_type = "text/event-stream"),
        (status = 422, description = "Invalid input", body = ErrorBody),
        (status = 401, description = "Missing or wrong API key", body = ErrorBody),
        (status = 404, description = "`adapter_id` names no LoRA adapter this server serves", body = ErrorBody),
        (status = 413, description = "Body over --payload-limit", body = ErrorBody),
        (status = 429, description = "Too many concurrent requests, or queued past --max-queue-wait-ms", body = ErrorBody),
        (status = 503, description = "Shutting down (draining)", body = ErrorBody),
    ))]
pub async fn generate_stream(
    State(app): State<AppState>,
    tenant: Tenant,
    JsonBody(mut req): JsonBody<GenerateRequest>,
) -> Result<Response, RouterError> {
    tenant.fill(&mut req.parameters.user);
    run_generate_stream(&app, req).await
}

/// TGI's root route: `stream: true` answers like `/generate_stream`,
/// otherwise like `/generate` but as a one-element list (what the
/// `text-generation` and `huggingface_hub` clients read).
#[utoipa::path(post, path = "/", tag = "TGI", request_body = CompatGenerateRequest,
    responses(
        (status = 200, description = "`[GenerateResponse]`, or SSE events when `stream`", content(
            (Vec<GenerateResponse> = "application/json"), (StreamResponse = "text/event-stream"))),
        (status = 422, description = "Invalid input", body = ErrorBody),
        (status = 401, description = "Missing or wrong API key", body = ErrorBody),
        (status = 404, description = "`adapter_id` names no LoRA adapter this server serves", body = ErrorBody),
        (status = 413, description = "Body over --payload-limit", body = ErrorBody),
        (status = 429, description = "Too many concurrent requests, or queued past --max-queue-wait-ms", body = ErrorBody),
        (status = 503, description = "Shutting down (draining)", body = ErrorBody),
    ))]
pub async fn compat_generate(
    State(app): State<AppState>,
    tenant: Tenant,
    JsonBody(mut req): JsonBody<CompatGenerateRequest>,
) -> Result<Response, RouterError> {
    tenant.fill(&mut req.parameters.user);
    let inner = GenerateRequest { inputs: req.inputs, parameters: req.parameters };
    if req.stream {
        return run_generate_stream(&app, inner).await;
    }
    let (headers, body) = run_generate(&app, inner).await?;
    Ok((headers, Json(vec![body])).into_response())
}

/// Tokens of `inputs` with their byte offsets.
#[utoipa::path(post, path = "/tokenize", tag = "TGI", request_body = GenerateRequest,
    responses(
        (status = 200, description = "Tokens", body = Vec<SimpleToken>),
        (status = 401, description = "Missing or wrong API key", body = ErrorBody),
        (status = 413, description = "Body over --payload-limit", body = ErrorBody),
        (status = 422, description = "Invalid input", body = ErrorBody),
    ))]
pub async fn tokenize(
    State(app): State<AppState>,
    JsonBody(req): JsonBody<GenerateRequest>,
) -> Result<Json<Vec<SimpleToken>>, RouterError> {
    let encoding = app.infer.validation().encode(req.inputs.clone(), true).await?;
    let tokenizer = app.infer.validation().tokenizer();
    let tokens = encoding
        .get_ids()
        .iter()
        .zip(encoding.get_offsets())
        .map(|(&id, &(start, stop))| SimpleToken {
            id,
            // Offsets of special tokens added by the tokenizer are (0, 0).
            text: match req.inputs.get(start..stop) {
                Some(t) if stop > start => t.to_string(),
                _ => tokenizer.decode(&[id], false).unwrap_or_default(),
            },
            start,
            stop,
        })
        .collect();
    Ok(Json(tokens))
}

fn best_of_sequence(r: InferResponse, prefix: &str) -> BestOfSequence {
    BestOfSequence {
        generated_text: format!("{prefix}{}", r.generated_text.text),
        finish_reason: r.generated_text.finish_reason,
        generated_tokens: r.generated_text.generated_tokens,
        seed: r.generated_text.seed,
        prefill: r.prefill,
        tokens: r.tokens,
        top_tokens: r.top_tokens,
    }
}

async fn run_generate(
    app: &AppState,
    mut req: GenerateRequest,
) -> Result<(axum::http::HeaderMap, GenerateResponse), RouterError> {
    req.parameters.adapter = app.lora.for_adapter_id(req.parameters.adapter_id.as_deref())?;
    let p = &req.parameters;
    let details = p.details || p.decoder_input_details;
    let prefix = if p.return_full_text.unwrap_or(false) { req.inputs.clone() } else { String::new() };
    let best_of = p.best_of.unwrap_or(1);
    let mut all = app.infer.generate_n(GenerateInput::new(req.inputs, req.parameters), best_of, "best_of").await?;
    // best_of: the candidate the model itself finds most likely wins.
    let best = (0..all.len())
        .max_by(|&a, &b| all[a].cumulative_logprob().total_cmp(&all[b].cumulative_logprob()))
        .unwrap_or(0);
    let resp = all.remove(best);
    let headers = headers::timing(&resp, &app.info.model_device_type, resp.generated_text.generated_tokens);
    let others = (best_of > 1).then(|| all.into_iter().map(|r| best_of_sequence(r, &prefix)).collect());
    let text = format!("{prefix}{}", resp.generated_text.text);
    let details = details.then(|| Details {
        finish_reason: resp.generated_text.finish_reason,
        generated_tokens: resp.generated_text.generated_tokens,
        seed: resp.generated_text.seed,
        prefill: resp.prefill,
        tokens: resp.tokens,
        top_tokens: resp.top_tokens,
        best_of_sequences: others,
    });
    Ok((headers, GenerateResponse { generated_text: text, details }))
}

async fn run_generate_stream(app: &AppState, mut req: GenerateRequest) -> Result<Response, RouterError> {
    req.parameters.adapter = app.lora.for_adapter_id(req.parameters.adapter_id.as_deref())?;
    if req.parameters.best_of.unwrap_or(1) > 1 {
        return Err(RouterError::Validation("`best_of` > 1 is not supported when streaming".into()));
    }
    let details = req.parameters.details;
    let prefix = req.parameters.return_full_text.unwrap_or(false).then(|| req.inputs.clone());
    let handle = app.infer.generate_stream(GenerateInput::new(req.inputs, req.parameters)).await?;
    Ok(Sse::new(sse_events(handle, details, prefix)).keep_alive(KeepAlive::default()).into_response())
}

struct StreamState {
    /// Dropped with the last event, not after it: the concurrency permit is
    /// free by the time the client reads the end of the stream, so a client
    /// that sends its next request right then is not refused with a 429.
    handle: Option<StreamHandle>,
    index: u32,
    details: bool,
    prefix: Option<String>,
}

/// One SSE event per token; the last carries generated_text (and details); a
/// failure ends the stream with an error event, never a silent close.
fn sse_events(
    handle: StreamHandle,
    details: bool,
    prefix: Option<String>,
) -> impl Stream<Item = Result<Event, Infallible>> {
    let st = StreamState { handle: Some(handle), index: 0, details, prefix };
    stream::unfold(st, |mut st| async move {
        let handle = st.handle.as_mut()?;
        loop {
            let msg = match handle.next().await {
                Some(m) => m,
                None => {
                    st.handle = None;
                    let err = RouterError::Generation("the request ended without a final token".into());
                    return Some((Ok(json_event(&err.body())), st));
                }
            };
            let event = match msg {
                Err(err) => {
                    st.handle = None;
                    json_event(&err.body())
                }
                Ok(InferStreamResponse::Prefill(_)) => continue,
                Ok(InferStreamResponse::Token { token, top_tokens }) => {
                    st.index += 1;
                    json_event(&StreamResponse {
                        index: st.index,
                        token,
                        top_tokens,
                        generated_text: None,
                        details: None,
                    })
                }
                Ok(InferStreamResponse::End { token, top_tokens, generated_text, .. }) => {
                    st.index += 1;
                    let input_length = handle.request.input_ids.len() as u32;
                    st.handle = None;
                    let text = match &st.prefix {
                        Some(p) => format!("{p}{}", generated_text.text),
                        None => generated_text.text.clone(),
                    };
                    json_event(&StreamResponse {
                        index: st.index,
                        token,
                        top_tokens,
                        generated_text: Some(text),
                        details: st.details.then(|| StreamDetails {
                            finish_reason: generated_text.finish_reason,
                            generated_tokens: generated_text.generated_tokens,
                            seed: generated_text.seed,
                            input_length,
                        }),
                    })
                }
            };
            return Some((Ok(event), st));
        }
    })
}

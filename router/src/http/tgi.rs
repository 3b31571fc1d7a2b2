//! TGI routes: `/generate` and `/generate_stream`.

use std::convert::Infallible;

use axum::extract::State;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures::stream::{self, Stream};

use super::extract::JsonBody;
use super::types::{Details, GenerateRequest, GenerateResponse, StreamDetails, StreamResponse};
use super::AppState;
use crate::error::RouterError;
use crate::infer::StreamHandle;
use crate::queue::InferStreamResponse;

pub async fn generate(
    State(app): State<AppState>,
    JsonBody(req): JsonBody<GenerateRequest>,
) -> Result<Response, RouterError> {
    let details = req.parameters.details || req.parameters.decoder_input_details;
    let full_text = req.parameters.return_full_text.unwrap_or(false);
    let inputs = req.inputs.clone();
    let resp = app.infer.generate(req.inputs, req.parameters).await?;
    let mut text = resp.generated_text.text.clone();
    if full_text {
        text = inputs + &text;
    }
    let details = details.then(|| Details {
        finish_reason: resp.generated_text.finish_reason,
        generated_tokens: resp.generated_text.generated_tokens,
        seed: resp.generated_text.seed,
        prefill: resp.prefill,
        tokens: resp.tokens,
        top_tokens: resp.top_tokens,
    });
    Ok(Json(GenerateResponse {
        generated_text: text,
        details,
    })
    .into_response())
}

pub async fn generate_stream(
    State(app): State<AppState>,
    JsonBody(req): JsonBody<GenerateRequest>,
) -> Result<Sse<impl Stream<Item = Result<Event, Infallible>>>, RouterError> {
    let details = req.parameters.details;
    let prefix = req
        .parameters
        .return_full_text
        .unwrap_or(false)
        .then(|| req.inputs.clone());
    let handle = app.infer.generate_stream(req.inputs, req.parameters).await?;
    Ok(Sse::new(sse_events(handle, details, prefix)).keep_alive(KeepAlive::default()))
}

struct StreamState {
    handle: StreamHandle,
    index: u32,
    done: bool,
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
    let st = StreamState {
        handle,
        index: 0,
        done: false,
        details,
        prefix,
    };
    stream::unfold(st, |mut st| async move {
        if st.done {
            return None;
        }
        loop {
            let msg = match st.handle.rx.recv().await {
                Some(m) => m,
                None => {
                    st.done = true;
                    let err = RouterError::Generation("the request ended without a final token".into());
                    return Some((Ok(json_event(&err.body())), st));
                }
            };
            let event = match msg {
                Err(err) => {
                    st.done = true;
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
                Ok(InferStreamResponse::End {
                    token,
                    top_tokens,
                    generated_text,
                    ..
                }) => {
                    st.index += 1;
                    st.done = true;
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
                            input_length: st.handle.request.input_ids.len() as u32,
                        }),
                    })
                }
            };
            return Some((Ok(event), st));
        }
    })
}

fn json_event<T: serde::Serialize>(v: &T) -> Event {
    Event::default().data(serde_json::to_string(v).unwrap_or_default())
}

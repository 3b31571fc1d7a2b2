//! OpenAI streaming: the `n` (x prompts) sequences of a request merged into
//! one SSE stream of chunks tagged by choice index, then an optional usage
//! chunk, then `data: [DONE]`. A failure ends the stream with an error event
//! in OpenAI's shape `{"error": {message, type, param, code}}` (the `openai`
//! client raises `APIError` on it).

use std::convert::Infallible;

use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use futures::stream::{self, BoxStream, SelectAll, StreamExt};

use super::types::Usage;
use crate::error::RouterError;
use crate::http::tgi::json_event;
use crate::http::types::Token;
use crate::infer::StreamHandle;
use crate::stream::{GeneratedText, InferStreamResponse};

/// One step of one choice.
pub enum ChoiceEvent {
    Token { token: Token, top_tokens: Vec<Token> },
    End { token: Token, top_tokens: Vec<Token>, generated: GeneratedText },
}

pub struct ChoiceMsg {
    pub index: u32,
    pub event: ChoiceEvent,
}

/// Builds the JSON chunk for a step (None: send nothing for it).
pub type ChunkFn = Box<dyn FnMut(&ChoiceMsg) -> Option<serde_json::Value> + Send>;
/// Builds the final usage chunk.
pub type UsageFn = Box<dyn FnOnce(Usage) -> serde_json::Value + Send>;

fn choice_stream(index: u32, handle: StreamHandle) -> BoxStream<'static, Result<ChoiceMsg, RouterError>> {
    stream::unfold(Some(handle), move |h| async move {
        let mut h = h?;
        loop {
            let item = match h.next().await {
                None => Err(RouterError::Generation("the request ended without a final token".into())),
                Some(Err(e)) => Err(e),
                Some(Ok(InferStreamResponse::Prefill(_))) => continue,
                Some(Ok(InferStreamResponse::Token { token, top_tokens })) => {
                    return Some((Ok(ChoiceMsg { index, event: ChoiceEvent::Token { token, top_tokens } }), Some(h)));
                }
                Some(Ok(InferStreamResponse::End { token, top_tokens, generated_text, .. })) => Ok(ChoiceMsg {
                    index,
                    event: ChoiceEvent::End { token, top_tokens, generated: generated_text },
                }),
            };
            // End or error: this choice is over (dropping the handle frees it).
            return Some((item, None));
        }
    })
    .boxed()
}

enum Phase {
    Choices,
    Usage,
    Done,
    Over,
}

struct State {
    merged: SelectAll<BoxStream<'static, Result<ChoiceMsg, RouterError>>>,
    chunk: ChunkFn,
    usage: Option<UsageFn>,
    prompt_tokens: u32,
    completion_tokens: u32,
    phase: Phase,
}

/// `handles` are (choice index, stream); `prompt_tokens` counts each prompt once.
pub fn sse(handles: Vec<(u32, StreamHandle)>, prompt_tokens: u32, chunk: ChunkFn, usage: Option<UsageFn>) -> Response {
    let merged = stream::select_all(handles.into_iter().map(|(i, h)| choice_stream(i, h)));
    let st = State { merged, chunk, usage, prompt_tokens, completion_tokens: 0, phase: Phase::Choices };
    let events = stream::unfold(st, |mut st| async move {
        loop {
            match st.phase {
                Phase::Choices => match st.merged.next().await {
                    None => st.phase = if st.usage.is_some() { Phase::Usage } else { Phase::Done },
                    Some(Err(e)) => {
                        st.phase = Phase::Over;
                        return Some((json_event(&e.openai_body()), st));
                    }
                    Some(Ok(msg)) => {
                        if let ChoiceEvent::End { generated, .. } = &msg.event {
                            st.completion_tokens += generated.generated_tokens;
                        }
                        if let Some(v) = (st.chunk)(&msg) {
                            return Some((json_event(&v), st));
                        }
                    }
                },
                Phase::Usage => {
                    st.phase = Phase::Done;
                    if let Some(f) = st.usage.take() {
                        let v = f(Usage::new(st.prompt_tokens, st.completion_tokens));
                        return Some((json_event(&v), st));
                    }
                }
                Phase::Done => {
                    st.phase = Phase::Over;
                    return Some((Event::default().data("[DONE]"), st));
                }
                Phase::Over => return None,
            }
        }
    })
    .map(Ok::<_, Infallible>);
    Sse::new(events).keep_alive(KeepAlive::default()).into_response()
}

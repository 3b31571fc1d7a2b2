//! Server-sent events of the choice-shaped APIs (OpenAI Chat and
//! Completions, Responses, Messages): the `n` (x prompts) sequences of a
//! request merged into one stream of events tagged by choice index, then an
//! optional usage event, then (OpenAI) `data: [DONE]`. A failure ends the
//! stream with an error event in the API's shape (`Framing`), never a silent
//! close.

use std::convert::Infallible;

use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use futures::stream::{self, BoxStream, SelectAll, StreamExt};

use crate::error::RouterError;
use crate::infer::StreamHandle;
use crate::response::Token;
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

/// Builds the events of a step (none, one, or several: a finished tool call
/// may go out with the step's text).
pub type ChunkFn = Box<dyn FnMut(&ChoiceMsg) -> Vec<Event> + Send>;
/// Builds the final usage event from the prompt and completion tokens.
pub type UsageFn = Box<dyn FnOnce(u32, u32) -> Event + Send>;

/// What differs between the APIs' streams besides their events: the error
/// event, and whether `data: [DONE]` ends the stream (OpenAI's Chat and Completions).
#[derive(Clone, Copy)]
pub struct Framing {
    pub error: fn(&RouterError) -> Event,
    pub done: bool,
}

/// One JSON value as an SSE `data:` event.
pub fn json_event<T: serde::Serialize>(v: &T) -> Event {
    Event::default().data(serde_json::to_string(v).unwrap_or_default())
}

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
                Some(Ok(InferStreamResponse::End { token, top_tokens, generated_text, .. })) => {
                    Ok(ChoiceMsg { index, event: ChoiceEvent::End { token, top_tokens, generated: generated_text } })
                }
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
    pending: std::collections::VecDeque<Event>,
    framing: Framing,
    merged: SelectAll<BoxStream<'static, Result<ChoiceMsg, RouterError>>>,
    chunk: ChunkFn,
    usage: Option<UsageFn>,
    prompt_tokens: u32,
    completion_tokens: u32,
    phase: Phase,
}

/// `handles` are (choice index, stream); `prompt_tokens` counts each prompt once.
pub fn sse(
    handles: Vec<(u32, StreamHandle)>,
    prompt_tokens: u32,
    chunk: ChunkFn,
    usage: Option<UsageFn>,
    framing: Framing,
) -> Response {
    let merged = stream::select_all(handles.into_iter().map(|(i, h)| choice_stream(i, h)));
    let st = State {
        pending: Default::default(),
        framing,
        merged,
        chunk,
        usage,
        prompt_tokens,
        completion_tokens: 0,
        phase: Phase::Choices,
    };
    let events = stream::unfold(st, |mut st| async move {
        loop {
            if let Some(e) = st.pending.pop_front() {
                return Some((e, st));
            }
            match st.phase {
                Phase::Choices => match st.merged.next().await {
                    None => {
                        st.phase = match (st.usage.is_some(), st.framing.done) {
                            (true, _) => Phase::Usage,
                            (false, true) => Phase::Done,
                            (false, false) => Phase::Over,
                        }
                    }
                    Some(Err(e)) => {
                        st.phase = Phase::Over;
                        return Some(((st.framing.error)(&e), st));
                    }
                    Some(Ok(msg)) => {
                        if let ChoiceEvent::End { generated, .. } = &msg.event {
                            st.completion_tokens += generated.generated_tokens;
                        }
                        let chunks = (st.chunk)(&msg);
                        st.pending.extend(chunks);
                    }
                },
                Phase::Usage => {
                    st.phase = if st.framing.done { Phase::Done } else { Phase::Over };
                    if let Some(f) = st.usage.take() {
                        return Some((f(st.prompt_tokens, st.completion_tokens), st));
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

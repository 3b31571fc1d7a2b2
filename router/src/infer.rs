//! The HTTP side's door to the scheduler: validates, enforces the
//! concurrency limit, enqueues, and hands back the response stream.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use tokio::sync::{mpsc, OwnedSemaphorePermit, Semaphore};

use crate::error::RouterError;
use crate::http::types::{GenerateParameters, PrefillToken, Token};
use crate::queue::{Entry, GeneratedText, InferStreamResponse, ResponseRx};
use crate::state::RouterState;
use crate::validation::{ValidRequest, Validation};

#[derive(Clone)]
pub struct Infer {
    validation: Validation,
    queue_tx: mpsc::UnboundedSender<Entry>,
    limit: Arc<Semaphore>,
    max_concurrent_requests: u32,
    next_id: Arc<AtomicU64>,
    state: Arc<RouterState>,
}

/// A whole generation, collected from the stream.
#[derive(Debug)]
pub struct InferResponse {
    pub input_length: u32,
    pub prefill: Vec<PrefillToken>,
    pub tokens: Vec<Token>,
    pub top_tokens: Vec<Vec<Token>>,
    pub generated_text: GeneratedText,
    pub queued_at: Instant,
    pub started_at: Instant,
}

pub struct StreamHandle {
    /// Held while the stream is alive: the request counts against the limit.
    pub permit: OwnedSemaphorePermit,
    pub request: ValidRequest,
    pub rx: ResponseRx,
}

impl Infer {
    pub fn new(
        validation: Validation,
        queue_tx: mpsc::UnboundedSender<Entry>,
        max_concurrent_requests: u32,
        state: Arc<RouterState>,
    ) -> Self {
        Self {
            validation,
            queue_tx,
            limit: Arc::new(Semaphore::new(max_concurrent_requests as usize)),
            max_concurrent_requests,
            next_id: Arc::new(AtomicU64::new(0)),
            state,
        }
    }

    pub fn validation(&self) -> &Validation {
        &self.validation
    }

    pub async fn generate_stream(&self, inputs: String, params: GenerateParameters) -> Result<StreamHandle, RouterError> {
        // Fail fast past the limit rather than queue without bound.
        let permit = self.limit.clone().try_acquire_owned().map_err(|_| {
            RouterError::Overloaded(format!(
                "more than {} concurrent requests",
                self.max_concurrent_requests
            ))
        })?;
        let request = self.validation.validate(inputs, params).await?;
        let (tx, rx) = mpsc::unbounded_channel();
        let entry = Entry {
            id: self.next_id.fetch_add(1, Ordering::Relaxed),
            request: request.clone(),
            response_tx: tx,
            queued_at: Instant::now(),
            group: None,
        };
        RouterState::add(&self.state.requests_total, 1);
        self.queue_tx
            .send(entry)
            .map_err(|_| RouterError::Unhealthy("the scheduler has stopped".into()))?;
        Ok(StreamHandle { permit, request, rx })
    }

    pub async fn generate(&self, inputs: String, params: GenerateParameters) -> Result<InferResponse, RouterError> {
        let mut handle = self.generate_stream(inputs, params).await?;
        let mut prefill = Vec::new();
        let mut tokens = Vec::new();
        let mut top = Vec::new();
        while let Some(msg) = handle.rx.recv().await {
            match msg? {
                InferStreamResponse::Prefill(p) => prefill = p,
                InferStreamResponse::Token { token, top_tokens } => {
                    tokens.push(token);
                    top.push(top_tokens);
                }
                InferStreamResponse::End {
                    token,
                    top_tokens,
                    generated_text,
                    queued_at,
                    started_at,
                } => {
                    tokens.push(token);
                    top.push(top_tokens);
                    if top.iter().all(|t| t.is_empty()) {
                        top.clear();
                    }
                    return Ok(InferResponse {
                        input_length: handle.request.input_ids.len() as u32,
                        prefill,
                        tokens,
                        top_tokens: top,
                        generated_text,
                        queued_at,
                        started_at,
                    });
                }
            }
        }
        Err(RouterError::Generation("the request ended without a final token".into()))
    }
}

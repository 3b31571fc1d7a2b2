//! What travels from the HTTP side to the scheduler: one `Entry` per request,
//! and the stream of `InferStreamResponse`s back.

use std::time::Instant;

use tokio::sync::mpsc;

use crate::error::RouterError;
use crate::http::types::{FinishReason, PrefillToken, Token};
use crate::validation::ValidRequest;

pub type ResponseTx = mpsc::UnboundedSender<Result<InferStreamResponse, RouterError>>;
pub type ResponseRx = mpsc::UnboundedReceiver<Result<InferStreamResponse, RouterError>>;

#[derive(Debug)]
pub struct Entry {
    pub id: u64,
    pub request: ValidRequest,
    pub response_tx: ResponseTx,
    pub queued_at: Instant,
    /// Entries of one `n`/`best_of` request share an id here: the scheduler
    /// admits them together and they share their prompt's KV blocks.
    pub group: Option<u64>,
}

impl Entry {
    /// The client went away (HTTP connection dropped its receiver).
    pub fn is_cancelled(&self) -> bool {
        self.response_tx.is_closed()
    }
}

#[derive(Debug, Clone)]
pub struct GeneratedText {
    pub text: String,
    pub generated_tokens: u32,
    pub finish_reason: FinishReason,
    pub seed: Option<u64>,
}

#[derive(Debug, Clone)]
pub enum InferStreamResponse {
    /// Prompt tokens with logprobs, sent first when `decoder_input_details`.
    Prefill(Vec<PrefillToken>),
    Token {
        token: Token,
        top_tokens: Vec<Token>,
    },
    End {
        token: Token,
        top_tokens: Vec<Token>,
        generated_text: GeneratedText,
        queued_at: Instant,
        started_at: Instant,
    },
}

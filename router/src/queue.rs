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
    /// Past this instant a request still waiting for admission is answered
    /// with `queue_timeout` and dropped (`--max-queue-wait-ms`; None: wait forever).
    pub queue_deadline: Option<Instant>,
    /// Entries of one `n`/`best_of` request share an id here: the scheduler
    /// admits them together and they share their prompt's KV blocks.
    pub group: Option<u64>,
}

impl Entry {
    /// The client went away (HTTP connection dropped its receiver).
    pub fn is_cancelled(&self) -> bool {
        self.response_tx.is_closed()
    }

    /// Whether a queued entry stays in the queue at `now`: not when its client
    /// went away, nor when it waited past its deadline (then the client is
    /// told why). `resumed` entries (preempted after streaming tokens) never
    /// time out: their client already has part of the answer.
    pub fn still_waiting(&self, now: Instant, resumed: bool) -> bool {
        if self.is_cancelled() {
            return false;
        }
        match self.queue_deadline {
            Some(deadline) if !resumed && now >= deadline => {
                let waited = now.saturating_duration_since(self.queued_at).as_millis();
                let _ = self.response_tx.send(Err(RouterError::QueueTimeout(format!(
                    "waited {waited} ms in the queue without being scheduled"
                ))));
                false
            }
            _ => true,
        }
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

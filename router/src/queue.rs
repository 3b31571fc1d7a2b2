//! What travels from the HTTP side to the scheduler: one `Entry` per request,
//! and the stream of token-id `SeqEvent`s back. Text (detokenization, stop
//! sequences) is made on the stream's side (`stream.rs`), not here.

use std::time::Instant;

use tokio::sync::mpsc;

use crate::error::RouterError;
use crate::proto::pb;
use crate::request::ValidRequest;

pub type ResponseTx = mpsc::UnboundedSender<Result<SeqEvent, RouterError>>;
pub type ResponseRx = mpsc::UnboundedReceiver<Result<SeqEvent, RouterError>>;

/// Why the shard ended a sequence (stop strings end it on the stream's side).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Finish {
    Length,
    EosToken,
    /// One of the request's `stop_token_ids`.
    StopToken,
}

/// What the scheduler tells a request's stream, in token ids.
#[derive(Debug, Clone)]
pub enum SeqEvent {
    /// Prompt token ids with logprobs (the first NaN), each token's rank and,
    /// when asked, the alternatives at its position (`ranks` and `top` as
    /// long as `ids`; `top` empty without alternatives); sent first when
    /// `decoder_input_details`.
    Prefill { ids: Vec<u32>, logprobs: Vec<f32>, ranks: Vec<u32>, top: Vec<pb::Tokens> },
    /// Tokens of one step (one, or several with speculation); `finish` is
    /// set on the last event of the sequence.
    Tokens {
        ids: Vec<u32>,
        logprobs: Vec<f32>,
        /// One entry per id when top-n alternatives were asked for.
        top: Vec<pb::Tokens>,
        finish: Option<Finish>,
        /// When the sequence was (last) admitted.
        started_at: Instant,
    },
}

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
    /// The client went away (HTTP connection dropped its receiver), or its
    /// stream ended it (a stop sequence matched).
    pub fn is_cancelled(&self) -> bool {
        self.response_tx.is_closed()
    }

    /// Whether a queued entry stays in the queue at `now`: not when its client
    /// went away, nor when it waited past its deadline.
    pub fn still_waiting(&self, now: Instant, resumed: bool) -> bool {
        !self.is_cancelled() && !self.overdue(now, resumed)
    }

    /// Waited past its deadline. `resumed` entries (preempted after streaming
    /// tokens) never time out: their client already has part of the answer.
    pub fn overdue(&self, now: Instant, resumed: bool) -> bool {
        matches!(self.queue_deadline, Some(deadline) if !resumed && now >= deadline)
    }

    /// Tells the client of an overdue entry why it was dropped.
    pub fn answer_queue_timeout(&self, now: Instant) {
        let waited = now.saturating_duration_since(self.queued_at).as_millis();
        let _ = self
            .response_tx
            .send(Err(RouterError::QueueTimeout(format!("waited {waited} ms in the queue without being scheduled"))));
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::proto::pb;

    fn entry(deadline: Option<Instant>) -> (Entry, ResponseRx) {
        let (tx, rx) = mpsc::unbounded_channel();
        let request = ValidRequest {
            inputs: "x".into(),
            input_ids: vec![1],
            parameters: pb::NextTokenChooserParameters::default(),
            max_new_tokens: 1,
            ignore_eos: false,
            min_new_tokens: 0,
            stop_token_ids: vec![],
            stop_sequences: vec![],
            top_n_tokens: 0,
            decoder_input_details: false,
            prompt_top_n: 0,
            seed: None,
            grammar: None,
            priority: 0,
            tenant: None,
            adapter: None,
        };
        let e =
            Entry { id: 0, request, response_tx: tx, queued_at: Instant::now(), queue_deadline: deadline, group: None };
        (e, rx)
    }

    #[test]
    fn an_overdue_entry_leaves_with_a_queue_timeout() {
        let now = Instant::now();
        let (e, mut rx) = entry(Some(now));
        let later = now + Duration::from_millis(1);
        assert!(!e.still_waiting(later, false) && e.overdue(later, false));
        assert!(rx.try_recv().is_err(), "leaving the queue and answering are separate steps");
        e.answer_queue_timeout(later);
        let err = rx.try_recv().unwrap().unwrap_err();
        assert_eq!(err.error_type(), "queue_timeout");
        assert_eq!(err.status(), axum::http::StatusCode::TOO_MANY_REQUESTS);
    }

    #[test]
    fn entries_within_their_deadline_or_resumed_keep_waiting() {
        let now = Instant::now();
        let (e, mut rx) = entry(Some(now + Duration::from_secs(5)));
        assert!(e.still_waiting(now, false));
        let (resumed, _rx2) = entry(Some(now));
        assert!(resumed.still_waiting(now + Duration::from_secs(1), true));
        let (forever, _rx3) = entry(None);
        assert!(forever.still_waiting(now + Duration::from_secs(3600), false));
        assert!(rx.try_recv().is_err());
    }

    #[test]
    fn a_cancelled_entry_leaves_silently() {
        let (e, rx) = entry(None);
        drop(rx);
        assert!(!e.still_waiting(Instant::now(), false));
    }
}

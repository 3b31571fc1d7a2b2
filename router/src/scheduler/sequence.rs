//! A running request: its KV blocks, its position, and the text it has sent.

use std::collections::HashSet;
use std::time::Instant;

use tokenizers::Tokenizer;

use crate::detokenize::IncrementalDecoder;
use crate::http::types::{FinishReason, PrefillToken, Token};
use crate::kv::KvBlocks;
use crate::proto::pb;
use crate::queue::{Entry, GeneratedText, InferStreamResponse};
use crate::stop::{StopMatcher, StopResult};

/// What happened to a sequence after the shard's generation was applied.
#[derive(Debug, PartialEq, Eq)]
pub enum Outcome {
    Running,
    /// The shard finished it (EOS, a stop token or length) and already dropped it.
    FinishedByShard,
    /// The router ended it (stop sequence, client gone): the shard still holds
    /// it and must be told to filter it out.
    EndedByRouter,
    /// The shard could not serve this request alone and dropped it.
    Failed,
}

pub struct Sequence {
    pub entry: Entry,
    /// Prompt then every generated token: what a resumed sequence recomputes.
    pub tokens: Vec<u32>,
    /// None while queued (new, or preempted and waiting to resume).
    pub blocks: Option<KvBlocks>,
    /// Tokens whose KV is written in `blocks`.
    pub seq_len: u32,
    pub generated_tokens: u32,
    pub seed: Option<u64>,
    pub started_at: Instant,
    /// Admission order; the newest running sequence is preempted first.
    pub admitted_at: u64,
    pub preemptions: u32,
    decoder: IncrementalDecoder,
    stop: StopMatcher,
    output: String,
}

pub struct TextContext<'a> {
    pub tokenizer: &'a Tokenizer,
    pub special_ids: &'a HashSet<u32>,
}

impl TextContext<'_> {
    fn token_text(&self, id: u32) -> String {
        self.tokenizer.decode(&[id], false).unwrap_or_default()
    }

    fn token(&self, id: u32, logprob: f32, text: String) -> Token {
        Token {
            id,
            text,
            logprob,
            special: self.special_ids.contains(&id),
        }
    }
}

impl Sequence {
    pub fn new(entry: Entry, seed: Option<u64>) -> Self {
        let decoder = IncrementalDecoder::new(&entry.request.input_ids);
        let stop = StopMatcher::new(entry.request.stop_sequences.clone());
        Self {
            tokens: entry.request.input_ids.clone(),
            entry,
            blocks: None,
            seq_len: 0,
            generated_tokens: 0,
            seed,
            started_at: Instant::now(),
            admitted_at: 0,
            preemptions: 0,
            decoder,
            stop,
            output: String::new(),
        }
    }

    pub fn id(&self) -> u64 {
        self.entry.id
    }

    pub fn remaining_new_tokens(&self) -> u32 {
        self.entry.request.max_new_tokens.saturating_sub(self.generated_tokens)
    }

    pub fn fail(&self, err: crate::error::RouterError) {
        let _ = self.entry.response_tx.send(Err(err));
    }

    fn send(&self, msg: InferStreamResponse) -> bool {
        self.entry.response_tx.send(Ok(msg)).is_ok()
    }

    pub fn send_prefill_tokens(&self, ctx: &TextContext, tokens: &pb::Tokens) -> bool {
        let prefill = tokens
            .ids
            .iter()
            .zip(tokens.logprobs.iter())
            .map(|(&id, &lp)| PrefillToken {
                id,
                text: ctx.token_text(id),
                logprob: if lp.is_nan() { None } else { Some(lp) },
            })
            .collect();
        self.send(InferStreamResponse::Prefill(prefill))
    }

    /// Applies one generation (one token, or several with speculation).
    pub fn apply(&mut self, ctx: &TextContext, generation: &pb::Generation) -> Outcome {
        if !generation.error.is_empty() {
            self.fail(crate::error::RouterError::Validation(generation.error.clone()));
            return Outcome::Failed;
        }
        let Some(tokens) = generation.tokens.as_ref() else {
            return Outcome::Running;
        };
        let n = tokens.ids.len();
        for (i, &id) in tokens.ids.iter().enumerate() {
            self.generated_tokens += 1;
            self.tokens.push(id);
            let logprob = tokens.logprobs.get(i).copied().unwrap_or(f32::NAN);
            let top_tokens = generation
                .top_tokens
                .get(i)
                .map(|t| {
                    t.ids
                        .iter()
                        .zip(t.logprobs.iter())
                        .map(|(&tid, &lp)| ctx.token(tid, lp, ctx.token_text(tid)))
                        .collect()
                })
                .unwrap_or_default();
            let last = i + 1 == n;
            let shard_finish = if last { finish_reason(generation.finish_reason) } else { None };

            // Special tokens (EOS, chat markup) show in the token stream but not in the text.
            let (token_text, stop) = if ctx.special_ids.contains(&id) {
                (ctx.token_text(id), StopResult::Continue(String::new()))
            } else {
                let piece = self.decoder.push(ctx.tokenizer, id);
                // Before `min_tokens` stop strings do not end the output either (as in vLLM).
                let res = if self.generated_tokens < self.entry.request.min_new_tokens {
                    StopResult::Continue(piece)
                } else {
                    self.stop.push(&piece)
                };
                let text = match &res {
                    StopResult::Continue(t) => t.clone(),
                    StopResult::Stopped { text, .. } => text.clone(),
                };
                (text, res)
            };
            let (mut token_text, finish) = match stop {
                StopResult::Stopped { .. } => (token_text, Some((FinishReason::StopSequence, true))),
                StopResult::Continue(_) => (token_text, shard_finish.map(|r| (r, false))),
            };

            match finish {
                None => {
                    if !ctx.special_ids.contains(&id) {
                        self.output.push_str(&token_text);
                    }
                    let token = ctx.token(id, logprob, token_text);
                    if !self.send(InferStreamResponse::Token { token, top_tokens }) {
                        return Outcome::EndedByRouter;
                    }
                }
                Some((reason, by_router)) => {
                    if !ctx.special_ids.contains(&id) {
                        if !by_router {
                            // Nothing more can come: release what was held for a partial stop match.
                            token_text.push_str(&self.stop.flush());
                        }
                        self.output.push_str(&token_text);
                    }
                    let token = ctx.token(id, logprob, token_text);
                    let generated_text = GeneratedText {
                        text: std::mem::take(&mut self.output),
                        generated_tokens: self.generated_tokens,
                        finish_reason: reason,
                        seed: self.seed,
                    };
                    self.send(InferStreamResponse::End {
                        token,
                        top_tokens,
                        generated_text,
                        queued_at: self.entry.queued_at,
                        started_at: self.started_at,
                    });
                    // A stop before the last token means the shard still holds the request.
                    return if by_router || !last {
                        Outcome::EndedByRouter
                    } else {
                        Outcome::FinishedByShard
                    };
                }
            }
        }
        Outcome::Running
    }
}

fn finish_reason(code: i32) -> Option<FinishReason> {
    match pb::FinishReason::try_from(code).unwrap_or(pb::FinishReason::Unspecified) {
        pb::FinishReason::Unspecified => None,
        pb::FinishReason::Length => Some(FinishReason::Length),
        pb::FinishReason::EosToken => Some(FinishReason::EosToken),
        pb::FinishReason::StopSequence => Some(FinishReason::StopSequence),
    }
}

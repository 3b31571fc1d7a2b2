//! Text on the stream's side of the scheduler: each request's token-id
//! events become tokens with text (incremental detokenization) and stop
//! sequences are matched here, outside the batching loop. A matched stop
//! ends the stream; the scheduler then sees the stream closed and aborts
//! the sequence the way it does for a client that went away.

use std::collections::{HashSet, VecDeque};
use std::sync::Arc;
use std::time::Instant;

use tokenizers::Tokenizer;

use crate::detokenize::IncrementalDecoder;
use crate::proto::pb;
use crate::queue::{Finish, SeqEvent};
use crate::request::{TextOptions, ValidRequest};
use crate::response::{FinishReason, PrefillToken, Token};
use crate::stop::{StopMatcher, StopResult};

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

/// The tokenizer and which ids are special, shared by every stream.
#[derive(Clone)]
pub struct TextContext {
    pub tokenizer: Arc<Tokenizer>,
    pub special_ids: Arc<HashSet<u32>>,
}

impl TextContext {
    pub fn new(tokenizer: Arc<Tokenizer>) -> Self {
        let special_ids =
            tokenizer.get_added_tokens_decoder().iter().filter(|(_, t)| t.special).map(|(&id, _)| id).collect();
        Self { tokenizer, special_ids: Arc::new(special_ids) }
    }

    fn token_text(&self, id: u32) -> String {
        self.tokenizer.decode(&[id], false).unwrap_or_default()
    }

    fn token(&self, id: u32, logprob: f32, text: String) -> Token {
        Token { id, text, logprob, special: self.special_ids.contains(&id) }
    }
}

/// One sequence's text state: what it has said, and the stop matcher.
pub struct TextStream {
    ctx: TextContext,
    decoder: IncrementalDecoder,
    stop: StopMatcher,
    output: String,
    generated: u32,
    min_new_tokens: u32,
    seed: Option<u64>,
    queued_at: Instant,
    ended: bool,
    options: TextOptions,
}

impl TextStream {
    pub fn new(ctx: TextContext, request: &ValidRequest, options: TextOptions, queued_at: Instant) -> Self {
        Self {
            ctx,
            decoder: IncrementalDecoder::new(&request.input_ids),
            stop: StopMatcher::new(request.stop_sequences.clone()),
            output: String::new(),
            generated: 0,
            min_new_tokens: request.min_new_tokens,
            seed: request.seed,
            queued_at,
            ended: false,
            options,
        }
    }

    /// Whether the last message (`End`) was produced: later events are ignored.
    pub fn ended(&self) -> bool {
        self.ended
    }

    /// The messages one event becomes, in order.
    pub fn apply(&mut self, event: SeqEvent, out: &mut VecDeque<InferStreamResponse>) {
        if self.ended {
            return;
        }
        match event {
            SeqEvent::Prefill { ids, logprobs, ranks, top } => {
                out.push_back(InferStreamResponse::Prefill(self.prefill(&ids, &logprobs, &ranks, &top)));
            }
            SeqEvent::Tokens { ids, logprobs, top, finish, started_at } => {
                let n = ids.len();
                for (i, &id) in ids.iter().enumerate() {
                    let logprob = logprobs.get(i).copied().unwrap_or(f32::NAN);
                    let top_tokens = top
                        .get(i)
                        .map(|t| {
                            t.ids
                                .iter()
                                .zip(t.logprobs.iter())
                                .map(|(&tid, &lp)| self.ctx.token(tid, lp, self.ctx.token_text(tid)))
                                .collect()
                        })
                        .unwrap_or_default();
                    let last_finish = if i + 1 == n { finish } else { None };
                    if let Some(msg) = self.push(id, logprob, top_tokens, last_finish, started_at) {
                        let end = matches!(msg, InferStreamResponse::End { .. });
                        out.push_back(msg);
                        if end {
                            self.ended = true;
                            return;
                        }
                    }
                }
            }
        }
    }

    /// Prompt tokens with text; the first (NaN) has no logprob.
    fn prefill(&self, ids: &[u32], logprobs: &[f32], ranks: &[u32], top: &[pb::Tokens]) -> Vec<PrefillToken> {
        let alternatives = |i: usize| -> Vec<Token> {
            top.get(i).map_or_else(Vec::new, |t| {
                t.ids.iter().zip(&t.logprobs).map(|(&a, &lp)| self.ctx.token(a, lp, self.ctx.token_text(a))).collect()
            })
        };
        ids.iter()
            .enumerate()
            .map(|(i, &id)| {
                let lp = logprobs.get(i).copied().filter(|l| !l.is_nan());
                PrefillToken {
                    id,
                    text: self.ctx.token_text(id),
                    logprob: lp,
                    rank: lp.and(ranks.get(i).copied()),
                    top: if lp.is_some() { alternatives(i) } else { Vec::new() },
                }
            })
            .collect()
    }

    fn push(
        &mut self,
        id: u32,
        logprob: f32,
        top_tokens: Vec<Token>,
        finish: Option<Finish>,
        started_at: Instant,
    ) -> Option<InferStreamResponse> {
        self.generated += 1;
        let (mut text, stopped, hidden) = self.text_of(id, finish);
        let reason = if stopped {
            Some(FinishReason::StopSequence)
        } else {
            finish.map(|f| match f {
                Finish::Length => FinishReason::Length,
                Finish::EosToken => FinishReason::EosToken,
                Finish::StopToken => FinishReason::StopSequence,
            })
        };
        let token = |text| Token { id, text, logprob, special: hidden };
        let Some(reason) = reason else {
            if !hidden {
                self.output.push_str(&text);
            }
            return Some(InferStreamResponse::Token { token: token(text), top_tokens });
        };
        if !hidden {
            if !stopped {
                // Nothing more can come: release what was held for a partial stop match.
                text.push_str(&self.stop.flush());
            }
            self.output.push_str(&text);
        }
        Some(InferStreamResponse::End {
            token: token(text),
            top_tokens,
            generated_text: GeneratedText {
                text: std::mem::take(&mut self.output),
                generated_tokens: self.generated,
                finish_reason: reason,
                seed: self.seed,
            },
            queued_at: self.queued_at,
            started_at,
        })
    }

    /// One token's text: (text, whether a stop string matched, whether the
    /// token is left out of the text). Special tokens (EOS, chat markup) show
    /// in the token stream but not in the text, unless the request asked for
    /// them; the EOS that ends a sequence is then kept only with `keep_stop`.
    fn text_of(&mut self, id: u32, finish: Option<Finish>) -> (String, bool, bool) {
        let special = self.ctx.special_ids.contains(&id);
        let trimmed_eos = finish == Some(Finish::EosToken) && !self.options.keep_stop;
        if special && (!self.options.show_special_tokens || trimmed_eos) {
            return (self.ctx.token_text(id), false, true);
        }
        let piece = self.decoder.push(&self.ctx.tokenizer, id);
        // Before `min_tokens` stop strings do not end the output either (as in vLLM).
        if self.generated < self.min_new_tokens {
            return (piece, false, false);
        }
        match self.stop.push(&piece) {
            StopResult::Continue(t) => (t, false, false),
            StopResult::Stopped { mut text, stop } => {
                if self.options.keep_stop {
                    text.push_str(&stop);
                }
                (text, true, false)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::str::FromStr;

    use super::*;
    use crate::proto::pb;

    fn ctx() -> TextContext {
        let json = r#"{"version": "1.0", "truncation": null, "padding": null, "added_tokens": [
            {"id": 4, "content": "<e>", "single_word": false, "lstrip": false, "rstrip": false,
             "normalized": false, "special": true}],
            "normalizer": null, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": null, "decoder": null,
            "model": {"type": "WordLevel", "vocab": {"a": 0, "b": 1, "c": 2, "[UNK]": 3, "<e>": 4}, "unk_token": "[UNK]"}}"#;
        TextContext::new(Arc::new(Tokenizer::from_str(json).unwrap()))
    }

    fn request(stop: &[&str]) -> ValidRequest {
        ValidRequest {
            inputs: "a".into(),
            input_ids: vec![0],
            parameters: pb::NextTokenChooserParameters::default(),
            max_new_tokens: 8,
            ignore_eos: false,
            min_new_tokens: 0,
            stop_token_ids: vec![],
            stop_sequences: stop.iter().map(|s| s.to_string()).collect(),
            top_n_tokens: 0,
            decoder_input_details: false,
            prompt_top_n: 0,
            seed: Some(7),
            grammar: None,
            priority: 0,
            tenant: None,
            adapter: None,
        }
    }

    fn tokens(ids: &[u32], finish: Option<Finish>) -> SeqEvent {
        SeqEvent::Tokens {
            ids: ids.to_vec(),
            logprobs: vec![-1.0; ids.len()],
            top: vec![],
            finish,
            started_at: Instant::now(),
        }
    }

    #[test]
    fn a_stop_sequence_ends_the_stream_mid_step_and_ignores_the_rest() {
        let mut s = TextStream::new(ctx(), &request(&["c"]), TextOptions::default(), Instant::now());
        let mut out = VecDeque::new();
        s.apply(tokens(&[1, 2, 0], None), &mut out);
        assert!(s.ended());
        assert_eq!(out.len(), 2, "the token after the stop is not sent");
        let InferStreamResponse::End { generated_text, .. } = out.pop_back().unwrap() else { panic!("no End") };
        assert_eq!(generated_text.finish_reason, FinishReason::StopSequence);
        assert_eq!(generated_text.generated_tokens, 2);
        assert_eq!(generated_text.seed, Some(7));
        s.apply(tokens(&[1], Some(Finish::Length)), &mut out);
        assert_eq!(out.len(), 1, "nothing after the end");
    }

    #[test]
    fn the_shards_finish_ends_the_stream_with_its_reason() {
        let mut s = TextStream::new(ctx(), &request(&[]), TextOptions::default(), Instant::now());
        let mut out = VecDeque::new();
        s.apply(SeqEvent::Prefill { ids: vec![0], logprobs: vec![f32::NAN], ranks: vec![0], top: vec![] }, &mut out);
        s.apply(tokens(&[1], None), &mut out);
        s.apply(tokens(&[1, 2], Some(Finish::Length)), &mut out);
        assert_eq!(out.len(), 4);
        assert!(matches!(&out[0], InferStreamResponse::Prefill(p) if p[0].logprob.is_none()));
        let InferStreamResponse::End { generated_text, .. } = &out[3] else { panic!("no End") };
        assert_eq!(generated_text.finish_reason, FinishReason::Length);
        assert_eq!(generated_text.generated_tokens, 3);
        assert!(generated_text.text.contains('c'), "{:?}", generated_text.text);
    }

    /// The text of a whole stream of `ids` (the last one finishing with `finish`).
    fn text_with(options: TextOptions, stop: &[&str], ids: &[u32], finish: Finish) -> (String, Vec<Token>) {
        let mut s = TextStream::new(ctx(), &request(stop), options, Instant::now());
        let mut out = VecDeque::new();
        s.apply(tokens(ids, Some(finish)), &mut out);
        let mut seen = Vec::new();
        for msg in out {
            match msg {
                InferStreamResponse::Token { token, .. } => seen.push(token),
                InferStreamResponse::End { token, generated_text, .. } => {
                    seen.push(token);
                    return (generated_text.text, seen);
                }
                InferStreamResponse::Prefill(_) => {}
            }
        }
        panic!("no End")
    }

    #[test]
    fn keep_stop_keeps_the_matched_stop_string() {
        let keep = TextOptions { keep_stop: true, ..Default::default() };
        let (trimmed, _) = text_with(TextOptions::default(), &["c"], &[1, 2, 0], Finish::Length);
        let (kept, tokens) = text_with(keep, &["c"], &[1, 2, 0], Finish::Length);
        assert_eq!(kept, format!("{trimmed}c"));
        assert!(kept.ends_with('c') && !trimmed.contains('c'), "{kept:?} {trimmed:?}");
        assert_eq!(tokens.len(), 2, "the stop still ends the stream");
    }

    #[test]
    fn special_tokens_are_left_out_unless_shown() {
        let show = TextOptions { show_special_tokens: true, ..Default::default() };
        let (hidden, tokens) = text_with(TextOptions::default(), &[], &[1, 4, 2], Finish::Length);
        assert!(!hidden.contains("<e>") && tokens[1].special, "{hidden:?}");
        let (shown, tokens) = text_with(show, &[], &[1, 4, 2], Finish::Length);
        assert!(shown.contains("<e>") && !tokens[1].special, "{shown:?}");
    }

    #[test]
    fn the_eos_that_ends_a_sequence_is_kept_only_with_keep_stop() {
        let show = TextOptions { show_special_tokens: true, ..Default::default() };
        let (text, tokens) = text_with(show, &[], &[1, 4], Finish::EosToken);
        assert!(!text.contains("<e>") && tokens[1].special, "{text:?}");
        let (text, _) = text_with(TextOptions { keep_stop: true, ..show }, &[], &[1, 4], Finish::EosToken);
        assert!(text.ends_with("<e>"), "{text:?}");
        let (text, _) =
            text_with(TextOptions { keep_stop: true, ..Default::default() }, &[], &[1, 4], Finish::EosToken);
        assert!(!text.contains("<e>"), "skipped special tokens stay out: {text:?}");
    }
}

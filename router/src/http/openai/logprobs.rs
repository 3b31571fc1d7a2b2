//! Token logprobs in OpenAI's two shapes (chat's `content` list, the legacy
//! completions' parallel arrays). Token strings are each token decoded on
//! its own, as OpenAI reports them, not the stop-held text of the stream.

use tokenizers::Tokenizer;

use super::types::{ChatLogprob, CompletionLogprobs, TopLogprob};
use crate::response::{PrefillToken, Token};

fn token_text(tokenizer: &Tokenizer, id: u32) -> String {
    tokenizer.decode(&[id], false).unwrap_or_default()
}

pub fn chat(tokenizer: &Tokenizer, token: &Token, top: &[Token]) -> Option<ChatLogprob> {
    if token.special {
        return None;
    }
    let text = token_text(tokenizer, token.id);
    Some(ChatLogprob {
        bytes: text.as_bytes().to_vec(),
        token: text,
        logprob: token.logprob,
        top_logprobs: top
            .iter()
            .map(|t| {
                let text = token_text(tokenizer, t.id);
                TopLogprob { bytes: text.as_bytes().to_vec(), token: text, logprob: t.logprob }
            })
            .collect(),
    })
}

/// The legacy completions' arrays, one entry per token: the prompt's first
/// (with `echo`; its first token's logprob and alternatives are `null`),
/// then the completion's, special tokens included. Offsets count characters
/// from the start of the choice's text.
pub fn completion(
    tokenizer: &Tokenizer,
    prompt: &[PrefillToken],
    tokens: &[Token],
    top: &[Vec<Token>],
) -> CompletionLogprobs {
    let mut out =
        CompletionLogprobs { tokens: vec![], token_logprobs: vec![], top_logprobs: vec![], text_offset: vec![] };
    let mut at = 0;
    let mut push = |text: String, logprob: Option<f32>, alternatives: Option<&[Token]>| {
        out.text_offset.push(at);
        at += text.chars().count();
        out.tokens.push(text);
        out.token_logprobs.push(logprob);
        out.top_logprobs
            .push(alternatives.map(|alts| {
                alts.iter().map(|a| (token_text(tokenizer, a.id), serde_json::json!(a.logprob))).collect()
            }));
    };
    for t in prompt {
        push(t.text.clone(), t.logprob, t.logprob.map(|_| t.top.as_slice()));
    }
    for (i, t) in tokens.iter().enumerate() {
        push(token_text(tokenizer, t.id), Some(t.logprob), Some(top.get(i).map(Vec::as_slice).unwrap_or_default()));
    }
    out
}

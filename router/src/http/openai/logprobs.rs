//! Token logprobs in OpenAI's two shapes (chat's `content` list, the legacy
//! completions' parallel arrays). Token strings are each token decoded on
//! its own, as OpenAI reports them, not the stop-held text of the stream.

use tokenizers::Tokenizer;

use super::types::{ChatLogprob, CompletionLogprobs, TopLogprob};
use crate::response::Token;

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

/// `offset` is where the first token's text starts in the choice's text
/// (the prompt's length with `echo`).
pub fn completion(tokenizer: &Tokenizer, tokens: &[Token], top: &[Vec<Token>], offset: usize) -> CompletionLogprobs {
    let mut out =
        CompletionLogprobs { tokens: vec![], token_logprobs: vec![], top_logprobs: vec![], text_offset: vec![] };
    let mut at = offset;
    for (i, t) in tokens.iter().enumerate().filter(|(_, t)| !t.special) {
        let text = token_text(tokenizer, t.id);
        out.text_offset.push(at);
        at += text.chars().count();
        out.tokens.push(text);
        out.token_logprobs.push(t.logprob);
        let alternatives = top.get(i).map(Vec::as_slice).unwrap_or_default();
        out.top_logprobs
            .push(alternatives.iter().map(|a| (token_text(tokenizer, a.id), serde_json::json!(a.logprob))).collect());
    }
    out
}

//! Incremental detokenization: text is emitted only once the bytes decoded so
//! far form complete characters, and a token's text is read in the context of
//! the tokens before it (byte-level BPE and SentencePiece spaces both need it).

use tokenizers::Tokenizer;

#[derive(Debug, Clone)]
pub struct IncrementalDecoder {
    ids: Vec<u32>,
    prefix_offset: usize,
    read_offset: usize,
}

impl IncrementalDecoder {
    /// `context` is the tail of the prompt, used so that the first generated
    /// token is decoded as a continuation rather than a start of text.
    pub fn new(context: &[u32]) -> Self {
        let tail = &context[context.len().saturating_sub(5)..];
        Self { ids: tail.to_vec(), prefix_offset: 0, read_offset: tail.len() }
    }

    /// Appends a token and returns the new complete text, possibly empty.
    pub fn push(&mut self, tokenizer: &Tokenizer, id: u32) -> String {
        self.ids.push(id);
        let prefix = tokenizer.decode(&self.ids[self.prefix_offset..self.read_offset], false).unwrap_or_default();
        let full = tokenizer.decode(&self.ids[self.prefix_offset..], false).unwrap_or_default();
        if full.len() > prefix.len() && !full.ends_with('\u{FFFD}') && full.is_char_boundary(prefix.len()) {
            let text = full[prefix.len()..].to_string();
            self.prefix_offset = self.read_offset;
            self.read_offset = self.ids.len();
            // Keep the window small: decode cost stays constant per token.
            if self.prefix_offset > 64 {
                self.ids.drain(..self.prefix_offset);
                self.read_offset -= self.prefix_offset;
                self.prefix_offset = 0;
            }
            text
        } else {
            String::new()
        }
    }
}

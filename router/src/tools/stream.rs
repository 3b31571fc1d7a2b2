//! Tool calls in a streamed reply: text deltas in, content and whole calls
//! out. Content is passed on as soon as it cannot be the start of a call;
//! a call is sent once it is complete (Hermes: at its closing tag; Llama
//! and Mistral, whose calls are the whole reply: at the end). Concatenated,
//! the pieces equal what `parse` makes of the whole text.

use super::parse::{self, HERMES_CLOSE, HERMES_OPEN, MISTRAL_MARKER};
use super::{ToolCall, ToolCallParser};

#[derive(Debug, Clone, PartialEq)]
pub enum Piece {
    Content(String),
    Call(ToolCall),
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Mode {
    /// Only whitespace so far: the first character decides (Llama, Mistral).
    Start,
    Text,
    /// Inside `<tool_call>` (Hermes).
    InCall,
    /// The rest of the reply is calls or nothing: held to the end.
    Rest,
}

pub struct ToolStreamer {
    format: ToolCallParser,
    names: Vec<String>,
    buf: String,
    mode: Mode,
    seen_call: bool,
}

impl ToolStreamer {
    pub fn new(format: ToolCallParser, names: &[&str]) -> Self {
        let mode = if format == ToolCallParser::Hermes { Mode::Text } else { Mode::Start };
        Self { format, names: names.iter().map(|s| s.to_string()).collect(), buf: String::new(), mode, seen_call: false }
    }

    pub fn push(&mut self, delta: &str) -> Vec<Piece> {
        self.buf.push_str(delta);
        let mut out = Vec::new();
        loop {
            match self.mode {
                Mode::Start => {
                    let Some(c) = self.buf.trim_start().chars().next() else { break };
                    let opens = match self.format {
                        ToolCallParser::Llama3Json => c == '{' || c == '<',
                        ToolCallParser::Mistral => c == '[',
                        ToolCallParser::Hermes => false,
                    };
                    self.mode = if opens { Mode::Rest } else { Mode::Text };
                }
                Mode::Text => {
                    let marker = match self.format {
                        ToolCallParser::Hermes => HERMES_OPEN,
                        ToolCallParser::Mistral => MISTRAL_MARKER,
                        ToolCallParser::Llama3Json => {
                            content(std::mem::take(&mut self.buf), &mut out);
                            break;
                        }
                    };
                    if let Some(i) = self.buf.find(marker) {
                        let before: String = self.buf.drain(..i).collect();
                        self.content_before_call(before, &mut out);
                        if self.format == ToolCallParser::Hermes {
                            self.buf.drain(..marker.len());
                            self.mode = Mode::InCall;
                        } else {
                            self.mode = Mode::Rest;
                        }
                        continue;
                    }
                    // Hold what may be the start of the marker, and whitespace after a call.
                    let mut keep = held_prefix(&self.buf, marker);
                    let sendable = &self.buf[..self.buf.len() - keep];
                    if self.seen_call && sendable.trim().is_empty() {
                        keep = self.buf.len();
                    }
                    let send: String = self.buf.drain(..self.buf.len() - keep).collect();
                    content(send, &mut out);
                    break;
                }
                Mode::InCall => {
                    let Some(end) = self.buf.find(HERMES_CLOSE) else { break };
                    let body: String = self.buf.drain(..end + HERMES_CLOSE.len()).collect();
                    let body = &body[..end];
                    self.call_or_raw(body, true, &mut out);
                    self.mode = Mode::Text;
                }
                Mode::Rest => break,
            }
        }
        out
    }

    /// The end of the reply: whatever was held.
    pub fn finish(&mut self) -> Vec<Piece> {
        let mut out = Vec::new();
        let buf = std::mem::take(&mut self.buf);
        match self.mode {
            Mode::Start | Mode::Text => {
                if !(self.seen_call && buf.trim().is_empty()) {
                    content(buf, &mut out);
                }
            }
            Mode::InCall => self.call_or_raw(&buf, false, &mut out),
            Mode::Rest => {
                let names: Vec<&str> = self.names.iter().map(String::as_str).collect();
                let p = parse::parse(self.format, &buf, &names);
                content(p.content, &mut out);
                out.extend(p.calls.into_iter().map(Piece::Call));
            }
        }
        out
    }

    fn call_or_raw(&mut self, body: &str, closed: bool, out: &mut Vec<Piece>) {
        let names: Vec<&str> = self.names.iter().map(String::as_str).collect();
        let call = serde_json::from_str(body.trim()).ok().and_then(|v| parse::call_from_json(&v, &names));
        match call {
            Some(c) => {
                self.seen_call = true;
                out.push(Piece::Call(c));
            }
            None => {
                let close = if closed { HERMES_CLOSE } else { "" };
                content(format!("{HERMES_OPEN}{body}{close}"), out);
            }
        }
    }

    fn content_before_call(&mut self, text: String, out: &mut Vec<Piece>) {
        if !(self.seen_call && text.trim().is_empty()) {
            content(text, out);
        }
    }

}

fn content(text: String, out: &mut Vec<Piece>) {
    if !text.is_empty() {
        out.push(Piece::Content(text));
    }
}

/// Length of the longest suffix of `text` that is a proper prefix of `marker`.
pub(crate) fn held_prefix(text: &str, marker: &str) -> usize {
    (1..marker.len().min(text.len() + 1))
        .rev()
        .find(|&n| text.is_char_boundary(text.len() - n) && marker.starts_with(&text[text.len() - n..]))
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tools::parse::{parse, Parsed};

    const NAMES: &[&str] = &["get_weather", "add"];

    /// Streams `text` in pieces of `step` characters and folds the output.
    fn stream(format: ToolCallParser, text: &str, step: usize) -> (Parsed, usize) {
        let mut s = ToolStreamer::new(format, NAMES);
        let chars: Vec<char> = text.chars().collect();
        let mut pieces = Vec::new();
        let mut calls_before_end = 0;
        for chunk in chars.chunks(step) {
            pieces.extend(s.push(&chunk.iter().collect::<String>()));
            calls_before_end = pieces.iter().filter(|p| matches!(p, Piece::Call(_))).count();
        }
        pieces.extend(s.finish());
        let mut p = Parsed::default();
        for piece in pieces {
            match piece {
                Piece::Content(c) => p.content.push_str(&c),
                Piece::Call(c) => p.calls.push(c),
            }
        }
        (p, calls_before_end)
    }

    const RECORDED: &[(ToolCallParser, &str)] = &[
        (ToolCallParser::Hermes, "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"add\", \"arguments\": {\"a\": 1}}\n</tool_call>"),
        (ToolCallParser::Hermes, "<tool_call>\n{\"name\": \"add\", \"arguments\": {\"a\": 1\n</tool_call> then text"),
        (ToolCallParser::Hermes, "a < b and <tool_ca is not a tag"),
        (ToolCallParser::Hermes, "<tool_call>\n{\"name\": \"add\", \"arguments\": {\"a\": 1}}"),
        (ToolCallParser::Hermes, "<tool_call>\n{\"name\": \"add\", \"arguments\": {}}\n</tool_call>\nDone, héhé."),
        (ToolCallParser::Llama3Json, "  {\"name\": \"add\", \"parameters\": {\"a\": 1}}; {\"name\": \"add\", \"parameters\": {}}"),
        (ToolCallParser::Llama3Json, "It is sunny."),
        (ToolCallParser::Llama3Json, "{\"name\": \"add\", \"parameters\": {\"a\""),
        (ToolCallParser::Mistral, "[TOOL_CALLS][{\"name\": \"add\", \"arguments\": {\"a\": 1}}]"),
        (ToolCallParser::Mistral, "Sure. [TOOL_CALLS][{\"name\": \"add\", \"arguments\": {}}]"),
        (ToolCallParser::Mistral, "[1] see above"),
    ];

    #[test]
    fn streamed_equals_whole_at_every_split() {
        for &(format, text) in RECORDED {
            let whole = parse(format, text, NAMES);
            for step in [1, 2, 3, 7, 1000] {
                assert_eq!(stream(format, text, step).0, whole, "{format:?} step {step}: {text:?}");
            }
        }
    }

    #[test]
    fn hermes_calls_are_sent_before_the_end_and_content_early() {
        let (p, before_end) = stream(ToolCallParser::Hermes, RECORDED[0].1, 1);
        assert_eq!((p.calls.len(), before_end), (2, 2));
        let mut s = ToolStreamer::new(ToolCallParser::Hermes, NAMES);
        assert_eq!(s.push("Hello <tool"), vec![Piece::Content("Hello ".into())]);
        assert_eq!(s.push("box>"), vec![Piece::Content("<toolbox>".into())]);
    }
}

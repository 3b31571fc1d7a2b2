//! Tool calls in a streamed reply, in OpenAI's delta shape: text deltas
//! in; content, and for each call its start (name), argument fragments as
//! they are generated, and its end out. The reply so far is re-read at each
//! step (`analyze`) and what that reading adds is sent. Concatenated, the
//! pieces equal what `parse` makes of the whole text for every well-formed
//! reply; a reply cut off inside a call's arguments keeps the call (with
//! the arguments it got), where `parse` returns it as content.

use super::analyze::analyze;
use super::reading::Item;
use super::ToolCallParser;

#[derive(Debug, Clone, PartialEq)]
pub enum Piece {
    Content(String),
    /// A call begins; `index` counts the reply's calls from 0.
    CallStart {
        index: u32,
        name: String,
    },
    CallArgs {
        index: u32,
        text: String,
    },
    CallEnd {
        index: u32,
    },
}

/// What was sent of each item of the reading.
enum Sent {
    Content(usize),
    Call { index: u32, args: usize, ended: bool },
}

pub struct ToolStreamer {
    format: ToolCallParser,
    names: Vec<String>,
    text: String,
    sent: Vec<Sent>,
    calls: u32,
    cut_off: bool,
}

impl ToolStreamer {
    pub fn new(format: ToolCallParser, names: &[&str]) -> Self {
        Self {
            format,
            names: names.iter().map(|s| s.to_string()).collect(),
            text: String::new(),
            sent: vec![],
            calls: 0,
            cut_off: false,
        }
    }

    pub fn push(&mut self, delta: &str) -> Vec<Piece> {
        self.text.push_str(delta);
        self.diff(false)
    }

    /// The end of the reply: whatever was held, and the end of an unfinished call.
    pub fn finish(&mut self) -> Vec<Piece> {
        let mut out = self.diff(true);
        for s in &mut self.sent {
            if let Sent::Call { index, ended: ended @ false, .. } = s {
                *ended = true;
                self.cut_off = true;
                out.push(Piece::CallEnd { index: *index });
            }
        }
        out
    }

    /// Whether the reply ended inside a call's arguments (the call was sent with what it got).
    pub fn cut_off(&self) -> bool {
        self.cut_off
    }

    fn diff(&mut self, fin: bool) -> Vec<Piece> {
        let names: Vec<&str> = self.names.iter().map(String::as_str).collect();
        let items = analyze(self.format, &self.text, &names, fin);
        let mut out = Vec::new();
        for (i, item) in items.into_iter().enumerate() {
            match (item, self.sent.get_mut(i)) {
                (Item::Content(c), None) => {
                    self.sent.push(Sent::Content(c.len()));
                    out.push(Piece::Content(c));
                }
                (Item::Content(c), Some(Sent::Content(n))) => {
                    if let Some(tail) = c.get(*n..).filter(|t| !t.is_empty()) {
                        out.push(Piece::Content(tail.to_string()));
                    }
                    *n = c.len().max(*n);
                }
                (Item::Call { name, args, done }, None) => {
                    let index = self.calls;
                    self.calls += 1;
                    out.push(Piece::CallStart { index, name });
                    if !args.is_empty() {
                        out.push(Piece::CallArgs { index, text: args.clone() });
                    }
                    if done {
                        out.push(Piece::CallEnd { index });
                    }
                    self.sent.push(Sent::Call { index, args: args.len(), ended: done });
                }
                (Item::Call { args, done, .. }, Some(Sent::Call { index, args: n, ended })) => {
                    if let Some(tail) = args.get(*n..).filter(|t| !t.is_empty() && !*ended) {
                        out.push(Piece::CallArgs { index: *index, text: tail.to_string() });
                        *n = args.len();
                    }
                    if done && !*ended {
                        *ended = true;
                        out.push(Piece::CallEnd { index: *index });
                    }
                }
                // A reading that does not extend the last: cannot happen by construction; nothing is resent.
                _ => {}
            }
        }
        out
    }
}

#[cfg(test)]
#[path = "call_stream_tests.rs"]
mod tests;

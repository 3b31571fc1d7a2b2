//! A reply read as it grows: content and calls, where a call is known as
//! soon as its function name is read and its arguments have begun, and its
//! arguments grow with the text. Text that may still turn into a call (a
//! partial marker, a call whose name is still arriving) is held back.
//!
//! The reading of a prefix only ever grows into the reading of a longer
//! text (the last content or call grows, new ones follow), so a stream can
//! send the difference at each step (`stream`). A call is committed once its
//! name is known and its arguments started: if the text then breaks off
//! inside the arguments, the call stays, with the arguments it got.

use super::mistral::mistral;
use super::parse::{HERMES_CLOSE, HERMES_OPEN, LLAMA_PYTHON_TAG};
use super::scan;
use super::stream::held_prefix;
use super::{pythonic, ToolCallParser};

#[derive(Debug, Clone, PartialEq)]
pub enum Item {
    Content(String),
    /// `done`: the arguments are complete.
    Call {
        name: String,
        args: String,
        done: bool,
    },
}

pub(super) struct Out<'a> {
    items: Vec<Item>,
    names: &'a [&'a str],
    pub(super) fin: bool,
}

impl Out<'_> {
    pub(super) fn content(&mut self, s: &str) {
        if s.is_empty() {
            return;
        }
        match self.items.last_mut() {
            Some(Item::Content(c)) => c.push_str(s),
            _ => self.items.push(Item::Content(s.to_string())),
        }
    }

    pub(super) fn call(&mut self, name: &str, args: &str, done: bool) {
        self.items.push(Item::Call { name: name.to_string(), args: args.to_string(), done });
    }

    fn calls(&self) -> bool {
        self.items.iter().any(|i| matches!(i, Item::Call { .. }))
    }

    pub(super) fn known(&self, name: &str) -> bool {
        self.names.contains(&name)
    }
}

/// Reads `text`; `fin`: the reply is over (nothing is held back).
pub fn analyze(format: ToolCallParser, text: &str, names: &[&str], fin: bool) -> Vec<Item> {
    let mut out = Out { items: Vec::new(), names, fin };
    match format {
        ToolCallParser::Hermes => hermes(text, &mut out),
        ToolCallParser::Llama3Json => whole_reply(text, false, &mut out),
        ToolCallParser::Pythonic => whole_reply(text, true, &mut out),
        ToolCallParser::Mistral => mistral(text, &mut out),
    }
    out.items
}

/// One call object at the start of `s` (after whitespace).
enum Obj {
    Call { name: String, args: String, done: bool, end: Option<usize> },
    Pending,
    NotCall,
}

/// `closed`: no more text will come to this object.
fn object(s: &str, out: &Out, closed: bool) -> Obj {
    let sc = scan::call_object(s);
    let undecided = || if closed || sc.bad || sc.end.is_some() { Obj::NotCall } else { Obj::Pending };
    let Some(name) = sc.name.clone() else { return undecided() };
    if !out.known(&name) {
        return Obj::NotCall;
    }
    match sc.args {
        None if sc.end.is_some() => Obj::Call { name, args: "{}".into(), done: true, end: sc.end },
        None => undecided(),
        Some((start, end)) => match s.as_bytes()[start] {
            b'{' => {
                Obj::Call { name, args: s[start..end.unwrap_or(s.len())].to_string(), done: end.is_some(), end: sc.end }
            }
            // Arguments written as a JSON string holding the object.
            b'"' => match end {
                None => undecided(),
                Some(e) => match serde_json::from_str::<String>(&s[start..e]) {
                    Ok(a) if serde_json::from_str::<serde_json::Value>(&a).is_ok_and(|v| v.is_object()) => {
                        Obj::Call { name, args: a, done: true, end: sc.end }
                    }
                    _ => Obj::NotCall,
                },
            },
            _ => Obj::NotCall,
        },
    }
}

pub(super) fn ws(b: &[u8], mut i: usize) -> usize {
    while i < b.len() && b[i].is_ascii_whitespace() {
        i += 1;
    }
    i
}

fn hermes(text: &str, out: &mut Out) {
    let mut rest = text;
    loop {
        let Some(start) = rest.find(HERMES_OPEN) else {
            let keep = if out.fin { 0 } else { held_prefix(rest, HERMES_OPEN) };
            let send = &rest[..rest.len() - keep];
            // Whitespace after a call is content only if text follows.
            if !(out.calls() && send.trim().is_empty()) {
                out.content(send);
            }
            return;
        };
        let (segment, after) = (&rest[..start], &rest[start + HERMES_OPEN.len()..]);
        let ws_after_call = out.calls() && segment.trim().is_empty();
        if !ws_after_call {
            out.content(segment);
        }
        let (body, next, tag_closed) = match after.find(HERMES_CLOSE) {
            Some(end) => (&after[..end], Some(&after[end + HERMES_CLOSE.len()..]), true),
            None if out.fin => (after, None, false),
            None => (&after[..after.len() - held_prefix(after, HERMES_CLOSE)], None, false),
        };
        match object(body, out, tag_closed || out.fin) {
            Obj::Call { name, args, done, .. } => out.call(&name, &args, done),
            Obj::Pending => return,
            Obj::NotCall => {
                if ws_after_call {
                    out.content(segment);
                }
                out.content(HERMES_OPEN);
                out.content(body);
                if tag_closed {
                    out.content(HERMES_CLOSE);
                } else if !out.fin {
                    // The held part of a closing tag is not known to be one yet.
                    return;
                }
            }
        }
        match next {
            Some(n) => rest = n,
            None => return,
        }
    }
}

/// Llama JSON and pythonic replies: calls are the whole reply (after an
/// optional `<|python_tag|>`), or it is all content.
fn whole_reply(text: &str, pythonic: bool, out: &mut Out) {
    let b = text.as_bytes();
    let mut i = ws(b, 0);
    if text[i..].starts_with('<') {
        if !out.fin && LLAMA_PYTHON_TAG.starts_with(&text[i..]) {
            return;
        }
        if !text[i..].starts_with(LLAMA_PYTHON_TAG) {
            return out.content(text);
        }
        i = ws(b, i + LLAMA_PYTHON_TAG.len());
    }
    match b.get(i) {
        None if out.fin => out.content(text),
        None => {}
        Some(b'{') if !pythonic => sequence(text, i, false, 0, out),
        Some(b'[') if pythonic => {
            let j = ws(b, i + 1);
            match b.get(j) {
                None if out.fin => out.content(text),
                None => {}
                // A JSON array of calls: what the forcing grammar writes for this format.
                Some(b'{') => sequence(text, j, true, 0, out),
                Some(_) => python_list(text, j, out),
            }
        }
        Some(_) => out.content(text),
    }
}

/// Call objects from `i`: separated by `;` (Llama) or in a JSON array
/// whose `[` is before `i`. If the first is not a call, everything from
/// `region` is content; after a call, a part that is not one is content.
pub(super) fn sequence(text: &str, mut i: usize, array: bool, region: usize, out: &mut Out) {
    let b = text.as_bytes();
    let mut first = true;
    loop {
        let between = i;
        if !first {
            if array {
                i = ws(b, i);
                match b.get(i) {
                    None => return,
                    Some(b',') => i += 1,
                    Some(b']') => return trailing(text, i + 1, out),
                    Some(_) => return out.content(&text[between..]),
                }
            } else {
                while i < b.len() && (b[i] == b';' || b[i].is_ascii_whitespace()) {
                    i += 1;
                }
            }
        }
        i = ws(b, i);
        if i == b.len() {
            if out.fin && first {
                out.content(&text[region..]);
            }
            return;
        }
        if b[i] != b'{' {
            return out.content(&text[if first { region } else { between }..]);
        }
        match object(&text[i..], out, out.fin) {
            Obj::Pending => return,
            Obj::NotCall => return out.content(&text[if first { region } else { between }..]),
            Obj::Call { name, args, done, end } => {
                out.call(&name, &args, done);
                match end {
                    Some(e) => i += e,
                    None => return,
                }
            }
        }
        first = false;
    }
}

/// Text after the calls: content unless it is only whitespace.
pub(super) fn trailing(text: &str, i: usize, out: &mut Out) {
    if !text[i..].trim().is_empty() {
        out.content(&text[i..]);
    }
}

/// `[f(a=1), g(b="x")]` from the first call at `i`.
fn python_list(text: &str, mut i: usize, out: &mut Out) {
    let b = text.as_bytes();
    let mut first = true;
    loop {
        let between = i;
        let fail = |out: &mut Out| out.content(&text[if first { 0 } else { between }..]);
        if !first {
            i = ws(b, i);
            match b.get(i) {
                None => return,
                Some(b',') => i += 1,
                Some(b']') => return trailing(text, i + 1, out),
                Some(_) => return fail(out),
            }
        }
        match pythonic::call(text, i) {
            pythonic::Read::Open if out.fin => return fail(out),
            pythonic::Read::Open => return,
            pythonic::Read::Bad => return fail(out),
            pythonic::Read::Done((name, args), e) => {
                if !out.known(&name) {
                    return fail(out);
                }
                out.call(&name, &args, true);
                i = e;
            }
        }
        first = false;
    }
}

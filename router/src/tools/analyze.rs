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

use super::markers::{held_prefix, HERMES_CLOSE, HERMES_OPEN, LLAMA_PYTHON_TAG};
use super::mistral::mistral;
use super::reading::{object, sequence, trailing, ws, Item, Obj, Out};
use super::{pythonic, ToolCallParser};

/// Reads `text`; `fin`: the reply is over (nothing is held back).
pub fn analyze(format: ToolCallParser, text: &str, names: &[&str], fin: bool) -> Vec<Item> {
    let mut out = Out::new(names, fin);
    match format {
        ToolCallParser::Hermes => hermes(text, &mut out),
        ToolCallParser::Llama3Json => whole_reply(text, false, &mut out),
        ToolCallParser::Pythonic => whole_reply(text, true, &mut out),
        ToolCallParser::Mistral => mistral(text, &mut out),
    }
    out.into_items()
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

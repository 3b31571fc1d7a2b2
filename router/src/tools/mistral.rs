//! Mistral's formats, read as they grow (see `analyze`): `[TOOL_CALLS]` then
//! a JSON array of calls, or (v11 tokenizers) `[TOOL_CALLS]name[ARGS]{...}`
//! per call; a bare array where the marker, a special token, was dropped
//! from the text.

use super::markers::{held_prefix, MISTRAL_ARGS, MISTRAL_CALL_ID, MISTRAL_MARKER};
use super::reading::{sequence, trailing, ws, Out};
use super::scan::{self, End};

pub(super) fn mistral(text: &str, out: &mut Out) {
    let b = text.as_bytes();
    let Some(m) = text.find(MISTRAL_MARKER) else {
        let i = ws(b, 0);
        if i == b.len() {
            if out.fin {
                out.content(text);
            }
            return;
        }
        if b[i] == b'[' {
            if !out.fin && MISTRAL_MARKER.starts_with(&text[i..]) {
                return;
            }
            // The marker is a special token, often dropped from the text: a bare array of calls.
            return sequence_after_bracket(text, i + 1, 0, out);
        }
        let keep = if out.fin { 0 } else { held_prefix(text, MISTRAL_MARKER) };
        return out.content(&text[..text.len() - keep]);
    };
    let before = &text[..m];
    let region = if before.trim().is_empty() {
        0
    } else {
        out.content(before);
        m
    };
    let after = ws(b, m + MISTRAL_MARKER.len());
    match b.get(after) {
        None if out.fin => out.content(&text[region..]),
        None => {}
        Some(b'[') => sequence_after_bracket(text, after + 1, region, out),
        Some(_) => mistral_v11(text, m, region, out),
    }
}

fn sequence_after_bracket(text: &str, i: usize, region: usize, out: &mut Out) {
    let j = ws(text.as_bytes(), i);
    match text.as_bytes().get(j) {
        None if out.fin => out.content(&text[region..]),
        None => {}
        Some(b'{') => sequence(text, j, true, region, out),
        Some(_) => out.content(&text[region..]),
    }
}

/// Mistral v11 tokenizers: `[TOOL_CALLS]name[ARGS]{...}` per call (some
/// with `[CALL_ID]id` before `[ARGS]`); `marker` is the first marker's offset.
fn mistral_v11(text: &str, mut marker: usize, region: usize, out: &mut Out) {
    let b = text.as_bytes();
    let mut first = true;
    loop {
        let fail = |out: &mut Out| out.content(&text[if first { region } else { marker }..]);
        let head = &text[marker + MISTRAL_MARKER.len()..];
        let Some(a) = head.find(MISTRAL_ARGS) else {
            let mut h = &head[..head.len() - if out.fin { 0 } else { held_prefix(head, MISTRAL_ARGS) }];
            if !out.fin {
                h = &h[..h.len() - held_prefix(h, MISTRAL_CALL_ID)];
            }
            let mut parts = h.splitn(2, MISTRAL_CALL_ID);
            let name = parts.next().unwrap_or_default().trim();
            let id_ok = parts.next().is_none_or(|id| id.chars().all(|c| c.is_alphanumeric()));
            let plausible = id_ok && name.chars().all(|c| c.is_alphanumeric() || "_-.".contains(c));
            if out.fin || !plausible {
                fail(out);
            }
            return;
        };
        let name = head[..a].split(MISTRAL_CALL_ID).next().unwrap_or_default().trim();
        if !out.known(name) {
            return fail(out);
        }
        let start = ws(b, marker + MISTRAL_MARKER.len() + a + MISTRAL_ARGS.len());
        match b.get(start) {
            None if out.fin => return fail(out),
            None => return,
            Some(b'{') => {}
            Some(_) => return fail(out),
        }
        let end = match scan::value_end(text, start) {
            End::At(e) => e,
            _ => return out.call(name, &text[start..], false),
        };
        out.call(name, &text[start..end], true);
        let next = ws(b, end);
        let rest = &text[next..];
        if rest.starts_with(MISTRAL_MARKER) {
            marker = next;
            first = false;
            continue;
        }
        if !out.fin && MISTRAL_MARKER.starts_with(rest) {
            return;
        }
        return trailing(text, end, out);
    }
}

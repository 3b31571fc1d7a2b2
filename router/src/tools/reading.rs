//! The reading every format shares: what a reply reads as so far (`Item`s
//! collected in `Out`), one call object at a position, and a run of call
//! objects (`;`-separated or in a JSON array) with the text after them.

use super::scan;

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

impl<'a> Out<'a> {
    pub(super) fn new(names: &'a [&'a str], fin: bool) -> Self {
        Self { items: Vec::new(), names, fin }
    }

    pub(super) fn into_items(self) -> Vec<Item> {
        self.items
    }

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

    pub(super) fn calls(&self) -> bool {
        self.items.iter().any(|i| matches!(i, Item::Call { .. }))
    }

    pub(super) fn known(&self, name: &str) -> bool {
        self.names.contains(&name)
    }
}

/// One call object at the start of `s` (after whitespace).
pub(super) enum Obj {
    Call { name: String, args: String, done: bool, end: Option<usize> },
    Pending,
    NotCall,
}

/// `closed`: no more text will come to this object.
pub(super) fn object(s: &str, out: &Out, closed: bool) -> Obj {
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

//! A lenient scanner over JSON text that may still be arriving: where a
//! value ends (or that it has not ended yet), and for a call object
//! `{"name": ..., "arguments": ...}` where its name and its arguments lie.
//! Streaming needs positions in the raw text, which a full parser does not
//! give for text that is cut off.

/// How far a scan got.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum End {
    /// The value ends at this byte offset (exclusive).
    At(usize),
    /// The text stops inside the value.
    Open,
    /// Not JSON.
    Bad,
}

fn skip_ws(b: &[u8], mut i: usize) -> usize {
    while i < b.len() && b[i].is_ascii_whitespace() {
        i += 1;
    }
    i
}

/// End of the JSON value starting at `i` (after any whitespace).
pub fn value_end(s: &str, i: usize) -> End {
    let b = s.as_bytes();
    let i = skip_ws(b, i);
    let Some(&c) = b.get(i) else { return End::Open };
    match c {
        b'"' => string_end(b, i),
        b'{' | b'[' => {
            let mut depth = 0usize;
            let mut j = i;
            while j < b.len() {
                match b[j] {
                    b'"' => match string_end(b, j) {
                        End::At(e) => {
                            j = e;
                            continue;
                        }
                        other => return other,
                    },
                    b'{' | b'[' => depth += 1,
                    b'}' | b']' => {
                        depth -= 1;
                        if depth == 0 {
                            return End::At(j + 1);
                        }
                    }
                    _ => {}
                }
                j += 1;
            }
            End::Open
        }
        b'-' | b'0'..=b'9' | b't' | b'f' | b'n' => {
            let mut j = i;
            while j < b.len() && (b[j].is_ascii_alphanumeric() || matches!(b[j], b'.' | b'-' | b'+')) {
                j += 1;
            }
            // A literal at the end of the text may go on.
            if j == b.len() {
                End::Open
            } else {
                End::At(j)
            }
        }
        _ => End::Bad,
    }
}

/// End of the string whose opening quote is at `i`.
fn string_end(b: &[u8], i: usize) -> End {
    let mut j = i + 1;
    while j < b.len() {
        match b[j] {
            b'\\' => j += 2,
            b'"' => return End::At(j + 1),
            _ => j += 1,
        }
    }
    End::Open
}

/// What is known so far of a call object.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct CallScan {
    /// The `name` member, once its string is whole.
    pub name: Option<String>,
    /// Where the value of `arguments` (or `parameters`) starts, and where it ends once known.
    pub args: Option<(usize, Option<usize>)>,
    /// The object's end (exclusive), once closed.
    pub end: Option<usize>,
    /// Not a JSON object.
    pub bad: bool,
}

/// Scans `s`, which starts (after whitespace) with the call object.
pub fn call_object(s: &str) -> CallScan {
    let b = s.as_bytes();
    let mut out = CallScan::default();
    let mut i = skip_ws(b, 0);
    match b.get(i) {
        None => return out,
        Some(b'{') => i += 1,
        Some(_) => return CallScan { bad: true, ..out },
    }
    loop {
        i = skip_ws(b, i);
        match b.get(i) {
            None => return out,
            Some(b'}') => {
                out.end = Some(i + 1);
                return out;
            }
            Some(b'"') => {}
            Some(_) => return CallScan { bad: true, ..out },
        }
        let key_end = match string_end(b, i) {
            End::At(e) => e,
            _ => return out,
        };
        let key: Option<String> = serde_json::from_str(&s[i..key_end]).ok();
        i = skip_ws(b, key_end);
        match b.get(i) {
            None => return out,
            Some(b':') => i = skip_ws(b, i + 1),
            Some(_) => return CallScan { bad: true, ..out },
        }
        if i >= b.len() {
            return out;
        }
        let is_args = matches!(key.as_deref(), Some("arguments" | "parameters"));
        let end = value_end(s, i);
        if is_args {
            out.args = Some((i, if let End::At(e) = end { Some(e) } else { None }));
        }
        let e = match end {
            End::At(e) => e,
            End::Open => return out,
            End::Bad => return CallScan { bad: true, ..out },
        };
        if key.as_deref() == Some("name") {
            match serde_json::from_str::<serde_json::Value>(&s[i..e]) {
                Ok(serde_json::Value::String(n)) => out.name = Some(n),
                _ => return CallScan { bad: true, ..out },
            }
        }
        i = skip_ws(b, e);
        match b.get(i) {
            None => return out,
            Some(b',') => i += 1,
            Some(b'}') => {
                out.end = Some(i + 1);
                return out;
            }
            Some(_) => return CallScan { bad: true, ..out },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn value_ends() {
        assert_eq!(value_end(r#" {"a": "}", "b": [1, {}]} x"#, 0), End::At(25));
        assert_eq!(value_end(r#"{"a": "\"}"#, 0), End::Open);
        assert_eq!(value_end("12", 0), End::Open);
        assert_eq!(value_end("12,", 0), End::At(2));
        assert_eq!(value_end("?", 0), End::Bad);
    }

    #[test]
    fn call_objects_as_they_arrive() {
        let whole = r#"{"name": "add", "arguments": {"a": "x}"}}"#;
        let s = call_object(whole);
        assert_eq!(s.name.as_deref(), Some("add"));
        assert_eq!(s.args, Some((29, Some(40))));
        assert_eq!(&whole[29..40], r#"{"a": "x}"}"#);
        assert_eq!(s.end, Some(41));
        // Cut inside the arguments: name and start known, end not.
        let part = call_object(&whole[..35]);
        assert_eq!((part.name.as_deref(), part.args, part.end, part.bad), (Some("add"), Some((29, None)), None, false));
        assert_eq!(call_object(r#"{"na"#), CallScan::default());
        assert!(call_object("[1]").bad);
        assert!(call_object(r#"{"name": 3}"#).bad);
        let late = call_object(r#"{"parameters": {}, "name": "f"}"#);
        assert_eq!((late.name.as_deref(), late.args), (Some("f"), Some((15, Some(17)))));
    }
}

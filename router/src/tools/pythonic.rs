//! Pythonic tool calls (Llama 3.2 and Llama 4 templates that ask for
//! `[func_name(param=value, ...), ...]`): one call read from text that may
//! still be arriving. Values are Python literals (strings, numbers,
//! True/False/None, lists, dicts), turned into the JSON arguments object.

use serde_json::{Map, Number, Value};

/// The result of reading at a position.
#[derive(Debug, Clone, PartialEq)]
pub enum Read<T> {
    /// Read, ending at this byte offset.
    Done(T, usize),
    /// The text stops before the end.
    Open,
    /// Not this syntax.
    Bad,
}
use Read::{Bad, Done, Open};

fn skip_ws(b: &[u8], mut i: usize) -> usize {
    while i < b.len() && b[i].is_ascii_whitespace() {
        i += 1;
    }
    i
}

fn ident(b: &[u8], i: usize) -> usize {
    let mut j = i;
    while j < b.len() && (b[j].is_ascii_alphanumeric() || b[j] == b'_' || (j > i && b[j] == b'.')) {
        j += 1;
    }
    j
}

/// A call `name(key=value, ...)` starting at `i`: (name, arguments as a JSON object text).
pub fn call(s: &str, i: usize) -> Read<(String, String)> {
    let b = s.as_bytes();
    let i = skip_ws(b, i);
    let name_end = ident(b, i);
    if name_end == b.len() {
        return Open;
    }
    if name_end == i || b[name_end] != b'(' {
        return Bad;
    }
    let name = s[i..name_end].to_string();
    let mut args = Map::new();
    let mut j = name_end + 1;
    loop {
        j = skip_ws(b, j);
        match b.get(j) {
            None => return Open,
            Some(b')') => return Done((name, Value::Object(args).to_string()), j + 1),
            _ => {}
        }
        let key_end = ident(b, j);
        if key_end == b.len() {
            return Open;
        }
        if key_end == j {
            return Bad;
        }
        let key = s[j..key_end].to_string();
        j = skip_ws(b, key_end);
        match b.get(j) {
            None => return Open,
            Some(b'=') => {}
            Some(_) => return Bad,
        }
        let (v, e) = match value(s, j + 1) {
            Done(v, e) => (v, e),
            Open => return Open,
            Bad => return Bad,
        };
        args.insert(key, v);
        j = skip_ws(b, e);
        match b.get(j) {
            None => return Open,
            Some(b',') => j += 1,
            Some(b')') => {}
            Some(_) => return Bad,
        }
    }
}

/// A Python literal starting at `i`.
pub fn value(s: &str, i: usize) -> Read<Value> {
    let b = s.as_bytes();
    let i = skip_ws(b, i);
    let Some(&c) = b.get(i) else { return Open };
    match c {
        b'"' | b'\'' => string(s, i),
        b'[' => sequence(s, i, b']'),
        b'(' => sequence(s, i, b')'),
        b'{' => dict(s, i),
        _ => word(s, i),
    }
}

/// A list or tuple whose opening bracket is at `i`, as a JSON array.
fn sequence(s: &str, i: usize, close: u8) -> Read<Value> {
    let b = s.as_bytes();
    let mut items = Vec::new();
    let mut j = i + 1;
    loop {
        j = skip_ws(b, j);
        match b.get(j) {
            None => return Open,
            Some(&x) if x == close => return Done(Value::Array(items), j + 1),
            _ => {}
        }
        match value(s, j) {
            Done(v, e) => {
                items.push(v);
                j = skip_ws(b, e);
            }
            other => return other,
        }
        match b.get(j) {
            None => return Open,
            Some(b',') => j += 1,
            Some(&x) if x == close => {}
            Some(_) => return Bad,
        }
    }
}

/// A dict whose `{` is at `i`, with string keys, as a JSON object.
fn dict(s: &str, i: usize) -> Read<Value> {
    let b = s.as_bytes();
    let mut map = Map::new();
    let mut j = i + 1;
    loop {
        j = skip_ws(b, j);
        match b.get(j) {
            None => return Open,
            Some(b'}') => return Done(Value::Object(map), j + 1),
            _ => {}
        }
        let key = match value(s, j) {
            Done(Value::String(k), e) => {
                j = skip_ws(b, e);
                k
            }
            Done(..) | Bad => return Bad,
            Open => return Open,
        };
        match b.get(j) {
            None => return Open,
            Some(b':') => {}
            Some(_) => return Bad,
        }
        match value(s, j + 1) {
            Done(v, e) => {
                map.insert(key, v);
                j = skip_ws(b, e);
            }
            other => return other,
        }
        match b.get(j) {
            None => return Open,
            Some(b',') => j += 1,
            Some(b'}') => {}
            Some(_) => return Bad,
        }
    }
}

/// `True`, `False`, `None` or a number at `i`.
fn word(s: &str, i: usize) -> Read<Value> {
    let b = s.as_bytes();
    let mut j = i;
    while j < b.len() && (b[j].is_ascii_alphanumeric() || matches!(b[j], b'.' | b'-' | b'+' | b'_')) {
        j += 1;
    }
    if j == b.len() {
        return Open;
    }
    let word = &s[i..j];
    let v = match word {
        "True" => Value::Bool(true),
        "False" => Value::Bool(false),
        "None" => Value::Null,
        _ => match word.parse::<i64>() {
            Ok(n) => Value::Number(n.into()),
            Err(_) => match word.parse::<f64>().ok().and_then(Number::from_f64) {
                Some(n) => Value::Number(n),
                None => return Bad,
            },
        },
    };
    Done(v, j)
}

fn string(s: &str, i: usize) -> Read<Value> {
    let quote = s.as_bytes()[i] as char;
    let mut out = String::new();
    let mut chars = s[i + 1..].char_indices();
    while let Some((k, c)) = chars.next() {
        match c {
            '\\' => match chars.next() {
                None => return Open,
                Some((_, e)) => out.push(match e {
                    'n' => '\n',
                    't' => '\t',
                    'r' => '\r',
                    other => other,
                }),
            },
            c if c == quote => return Done(Value::String(out), i + 1 + k + 1),
            c => out.push(c),
        }
    }
    Open
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn calls_with_literals() {
        let s = r#"get_weather(city="San Francisco", days=3, metric=True, tags=['a', "b"], opts={'x': None}, t=-1.5)]"#;
        let Done((name, args), end) = call(s, 0) else { panic!() };
        assert_eq!(name, "get_weather");
        let args: Value = serde_json::from_str(&args).unwrap();
        assert_eq!(
            args,
            json!({"city": "San Francisco", "days": 3, "metric": true, "tags": ["a", "b"],
            "opts": {"x": null}, "t": -1.5})
        );
        assert_eq!(&s[end..], "]");
        assert_eq!(call("add()", 0), Done(("add".into(), "{}".into()), 5));
        assert_eq!(call(r#"f(s='it\'s')"#, 0), Done(("f".into(), r#"{"s":"it's"}"#.into()), 12));
    }

    #[test]
    fn partial_and_malformed() {
        for cut in ["get_wea", "get_weather(", "get_weather(city=", "get_weather(city=\"Par", "f(a=1, b=[1, 2"] {
            assert_eq!(call(cut, 0), Open, "{cut}");
        }
        for bad in ["get weather(x=1)", "f(1, 2)", "f(a=1 b=2)", "f(a=@)", "(a=1)"] {
            assert_eq!(call(bad, 0), Bad, "{bad}");
        }
    }
}

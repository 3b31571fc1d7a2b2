//! Tool calls in a finished reply, per format. What is not a well-formed
//! call to a known function stays content: a model that writes a broken
//! call has its text returned, not dropped.

use serde_json::Value;

use super::analyze::analyze;
use super::markers::{HERMES_CLOSE, HERMES_OPEN, LLAMA_PYTHON_TAG, MISTRAL_MARKER};
use super::reading::Item;
use super::{ToolCall, ToolCallParser};

/// A reply split into its text and its calls.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct Parsed {
    pub content: String,
    pub calls: Vec<ToolCall>,
}

pub fn parse(format: ToolCallParser, text: &str, names: &[&str]) -> Parsed {
    match format {
        ToolCallParser::Hermes => hermes(text, names),
        ToolCallParser::Llama3Json => whole_reply(text.trim_start().trim_start_matches(LLAMA_PYTHON_TAG), names)
            .map_or_else(
                || Parsed { content: text.to_string(), calls: vec![] },
                |calls| Parsed { content: String::new(), calls },
            ),
        ToolCallParser::Mistral => mistral(text, names),
        ToolCallParser::Pythonic => read_whole(ToolCallParser::Pythonic, text, names),
    }
}

/// A whole reply by the streaming reading; a call cut off inside its
/// arguments makes the reply content, as in the other formats.
fn read_whole(format: ToolCallParser, text: &str, names: &[&str]) -> Parsed {
    let mut out = Parsed::default();
    for item in analyze(format, text, names, true) {
        match item {
            Item::Content(c) => out.content.push_str(&c),
            Item::Call { name, args, done: true } => out.calls.push(ToolCall { name, arguments: args }),
            Item::Call { done: false, .. } => return Parsed { content: text.to_string(), calls: vec![] },
        }
    }
    out
}

/// `{"name": ..., "arguments"|"parameters": {...}}` naming a known function.
pub fn call_from_json(v: &Value, names: &[&str]) -> Option<ToolCall> {
    let obj = v.as_object()?;
    let name = obj.get("name")?.as_str()?;
    if !names.contains(&name) {
        return None;
    }
    let arguments = match obj.get("arguments").or_else(|| obj.get("parameters")) {
        None => "{}".to_string(),
        // Some models write the arguments as a JSON string already.
        Some(Value::String(s)) if serde_json::from_str::<Value>(s).is_ok_and(|a| a.is_object()) => s.clone(),
        Some(a @ Value::Object(_)) => a.to_string(),
        Some(_) => return None,
    };
    Some(ToolCall { name: name.to_string(), arguments })
}

fn hermes(text: &str, names: &[&str]) -> Parsed {
    let mut out = Parsed::default();
    let mut rest = text;
    while let Some(start) = rest.find(HERMES_OPEN) {
        let body_and_more = &rest[start + HERMES_OPEN.len()..];
        let (body, after, closed) = match body_and_more.find(HERMES_CLOSE) {
            Some(end) => (&body_and_more[..end], &body_and_more[end + HERMES_CLOSE.len()..], true),
            None => (body_and_more, "", false),
        };
        let call = serde_json::from_str::<Value>(body.trim()).ok().and_then(|v| call_from_json(&v, names));
        match call {
            Some(c) => {
                push_segment(&mut out, &rest[..start]);
                out.calls.push(c);
            }
            None => {
                let raw_end = if closed { rest.len() - after.len() } else { rest.len() };
                out.content.push_str(&rest[..raw_end]);
            }
        }
        rest = after;
    }
    push_segment(&mut out, rest);
    out
}

/// Text between calls: whitespace that only separates calls is not content.
fn push_segment(out: &mut Parsed, text: &str) {
    if !(!out.calls.is_empty() && text.trim().is_empty()) {
        out.content.push_str(text);
    }
}

/// A reply that is nothing but calls: JSON objects separated by `;` or
/// whitespace (Llama), or one JSON array of them (Mistral). None when any
/// part is not a call.
pub fn whole_reply(text: &str, names: &[&str]) -> Option<Vec<ToolCall>> {
    let text = text.trim();
    if text.starts_with('[') {
        let v: Value = serde_json::from_str(text).ok()?;
        let calls: Option<Vec<_>> = v.as_array()?.iter().map(|c| call_from_json(c, names)).collect();
        return calls.filter(|c| !c.is_empty());
    }
    let mut calls = Vec::new();
    let mut rest = text;
    loop {
        rest = rest.trim_start_matches(|c: char| c == ';' || c.is_whitespace());
        if rest.is_empty() {
            break;
        }
        let mut values = serde_json::Deserializer::from_str(rest).into_iter::<Value>();
        let v = values.next()?.ok()?;
        calls.push(call_from_json(&v, names)?);
        rest = &rest[values.byte_offset()..];
    }
    (!calls.is_empty()).then_some(calls)
}

fn mistral(text: &str, names: &[&str]) -> Parsed {
    // The marker is a special token, often already dropped from the decoded
    // text; a reply that is a bare array of calls is read the same way.
    let (before, calls_text) = match text.find(MISTRAL_MARKER) {
        Some(i) => (&text[..i], &text[i + MISTRAL_MARKER.len()..]),
        None if text.trim_start().starts_with('[') => ("", text),
        None => return Parsed { content: text.to_string(), calls: vec![] },
    };
    // v11 tokenizers: `[TOOL_CALLS]name[ARGS]{...}`.
    if !calls_text.trim_start().starts_with('[') {
        return read_whole(ToolCallParser::Mistral, text, names);
    }
    match whole_reply(calls_text, names) {
        Some(calls) if calls_text.trim_start().starts_with('[') => {
            let content = if before.trim().is_empty() { String::new() } else { before.to_string() };
            Parsed { content, calls }
        }
        _ => Parsed { content: text.to_string(), calls: vec![] },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const NAMES: &[&str] = &["get_weather", "add"];

    fn call(name: &str, args: &str) -> ToolCall {
        ToolCall { name: name.into(), arguments: args.into() }
    }

    // Replies recorded from Qwen2.5-style models.
    #[test]
    fn hermes_calls_and_content() {
        let text = "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"add\", \"arguments\": {\"a\": 1, \"b\": 2}}\n</tool_call>";
        let p = parse(ToolCallParser::Hermes, text, NAMES);
        assert_eq!(p.calls, vec![call("get_weather", r#"{"city":"Paris"}"#), call("add", r#"{"a":1,"b":2}"#)]);
        assert_eq!(p.content, "Let me check.\n");
        let only =
            parse(ToolCallParser::Hermes, "<tool_call>\n{\"name\": \"add\", \"arguments\": {}}\n</tool_call>", NAMES);
        assert_eq!((only.content.as_str(), only.calls.len()), ("", 1));
    }

    #[test]
    fn hermes_malformed_stays_content() {
        for text in [
            "<tool_call>\n{\"name\": \"add\", \"arguments\": {\"a\": 1\n</tool_call>", // broken JSON
            "<tool_call>\n{\"name\": \"rm_rf\", \"arguments\": {}}\n</tool_call>",     // unknown function
            "<tool_call>\n{\"arguments\": {}}\n</tool_call>",                          // no name
            "<tool_call>\n{\"name\": \"add\", \"arguments\": [1]}\n</tool_call>",      // arguments not an object
            "Just text, no calls.",
        ] {
            let p = parse(ToolCallParser::Hermes, text, NAMES);
            assert!(p.calls.is_empty(), "{text}");
            assert_eq!(p.content, text);
        }
        // Cut off by max_tokens before the closing tag, but the JSON is whole.
        let p = parse(ToolCallParser::Hermes, "<tool_call>\n{\"name\": \"add\", \"arguments\": {\"a\": 1}}\n", NAMES);
        assert_eq!(p.calls, vec![call("add", r#"{"a":1}"#)]);
    }

    #[test]
    fn arguments_as_a_json_string_are_kept() {
        let text = r#"<tool_call>{"name": "add", "arguments": "{\"a\": 1}"}</tool_call>"#;
        assert_eq!(parse(ToolCallParser::Hermes, text, NAMES).calls, vec![call("add", r#"{"a": 1}"#)]);
    }

    // Replies recorded from Llama 3.1/3.2 instruct models.
    #[test]
    fn llama_json() {
        let p = parse(ToolCallParser::Llama3Json, r#"{"name": "get_weather", "parameters": {"city": "Oslo"}}"#, NAMES);
        assert_eq!(p.calls, vec![call("get_weather", r#"{"city":"Oslo"}"#)]);
        assert_eq!(p.content, "");
        let two = r#"<|python_tag|>{"name": "add", "parameters": {"a": 1}}; {"name": "add", "parameters": {"a": 2}}"#;
        assert_eq!(parse(ToolCallParser::Llama3Json, two, NAMES).calls.len(), 2);
        for text in ["The weather is nice.", r#"{"name": "add", "parameters": {"a": 1}} and more"#, r#"{"name": "add""#]
        {
            let p = parse(ToolCallParser::Llama3Json, text, NAMES);
            assert!(p.calls.is_empty(), "{text}");
            assert_eq!(p.content, text);
        }
    }

    // Replies recorded from Mistral 7B v0.3 / Nemo.
    #[test]
    fn mistral_array() {
        let text = r#"[TOOL_CALLS][{"name": "add", "arguments": {"a": 1, "b": 2}}, {"name": "get_weather", "arguments": {"city": "Rome"}}]"#;
        let p = parse(ToolCallParser::Mistral, text, NAMES);
        assert_eq!(p.calls, vec![call("add", r#"{"a":1,"b":2}"#), call("get_weather", r#"{"city":"Rome"}"#)]);
        let bare = parse(ToolCallParser::Mistral, r#" [{"name": "add", "arguments": {}}]"#, NAMES);
        assert_eq!(bare.calls.len(), 1);
        for text in ["[TOOL_CALLS][{\"name\": \"add\", \"arguments\": {", "[1] is a citation", "plain answer"] {
            let p = parse(ToolCallParser::Mistral, text, NAMES);
            assert!(p.calls.is_empty(), "{text}");
            assert_eq!(p.content, text);
        }
    }
}

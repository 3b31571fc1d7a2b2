use super::*;
use crate::tools::parse::{parse, Parsed};
use crate::tools::ToolCall;

const NAMES: &[&str] = &["get_weather", "add"];

/// Streams `text` in pieces of `step` characters; the folded reply, and
/// how many argument fragments arrived before the end.
fn stream(format: ToolCallParser, text: &str, step: usize) -> (Parsed, usize) {
    let mut s = ToolStreamer::new(format, NAMES);
    let chars: Vec<char> = text.chars().collect();
    let mut pieces = Vec::new();
    for chunk in chars.chunks(step) {
        pieces.extend(s.push(&chunk.iter().collect::<String>()));
    }
    let early_args = pieces.iter().filter(|p| matches!(p, Piece::CallArgs { .. })).count();
    pieces.extend(s.finish());
    (fold(pieces), early_args)
}

/// Accumulates pieces as a client accumulates OpenAI deltas, checking their order.
fn fold(pieces: Vec<Piece>) -> Parsed {
    let mut p = Parsed::default();
    let mut open: Option<u32> = None;
    for piece in pieces {
        match piece {
            Piece::Content(c) => p.content.push_str(&c),
            Piece::CallStart { index, name } => {
                assert!(open.is_none(), "a call starts before the last ended");
                assert_eq!(index as usize, p.calls.len());
                p.calls.push(ToolCall { name, arguments: String::new() });
                open = Some(index);
            }
            Piece::CallArgs { index, text } => {
                assert_eq!(open, Some(index));
                p.calls[index as usize].arguments.push_str(&text);
            }
            Piece::CallEnd { index } => {
                assert_eq!(open.take(), Some(index));
            }
        }
    }
    assert!(open.is_none(), "a call was never ended");
    p
}

/// Calls compared by name and arguments as JSON (a stream sends the
/// model's own text, a whole reply its compact form).
fn same(a: &Parsed, b: &Parsed) -> bool {
    let args = |p: &Parsed| -> Vec<(String, Option<serde_json::Value>)> {
        p.calls.iter().map(|c| (c.name.clone(), serde_json::from_str(&c.arguments).ok())).collect()
    };
    a.content == b.content && args(a) == args(b) && args(a).iter().all(|(_, v)| v.is_some())
}

// Replies recorded from models of each family (Qwen2.5, Llama 3.1/3.2, Mistral 7B v0.3, Mistral Small v11),
// and broken ones.
const RECORDED: &[(ToolCallParser, &str)] = &[
    (ToolCallParser::Hermes, "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"add\", \"arguments\": {\"a\": 1}}\n</tool_call>"),
    (ToolCallParser::Hermes, "<tool_call>\n{\"name\": \"rm\", \"arguments\": {\"a\": 1}}\n</tool_call> then text"),
    (ToolCallParser::Hermes, "<tool_call>\n{\"arguments\": {\"a\": 1}, \"name\": \"add\"}\n</tool_call>"),
    (ToolCallParser::Hermes, "<tool_call>\n{\"name\": \"add\", \"arguments\": \"{\\\"a\\\": 2}\"}\n</tool_call>"),
    (ToolCallParser::Hermes, "a < b and <tool_ca is not a tag"),
    (ToolCallParser::Hermes, "<tool_call>\n{\"name\": \"add\", \"arguments\": {\"a\": 1}}"),
    (ToolCallParser::Hermes, "<tool_call>\n{\"name\": \"add\", \"arguments\": {\"s\": \"</tool\"}}\n</tool_call>\nDone, héhé."),
    (ToolCallParser::Hermes, "<tool_call>\n{\"name\": \"add\"}\n</tool_call>"),
    (ToolCallParser::Llama3Json, "  {\"name\": \"add\", \"parameters\": {\"a\": 1}}; {\"name\": \"add\", \"parameters\": {}}"),
    (ToolCallParser::Llama3Json, "<|python_tag|>{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Oslo\"}}"),
    (ToolCallParser::Llama3Json, "It is sunny."),
    (ToolCallParser::Llama3Json, "{\"name\": \"nope\", \"parameters\": {\"a\": 1}}"),
    (ToolCallParser::Llama3Json, "<b>bold</b>"),
    (ToolCallParser::Mistral, "[TOOL_CALLS][{\"name\": \"add\", \"arguments\": {\"a\": 1}}, {\"name\": \"get_weather\", \"arguments\": {\"city\": \"Rome\"}}]"),
    (ToolCallParser::Mistral, "Sure. [TOOL_CALLS][{\"name\": \"add\", \"arguments\": {}}]"),
    (ToolCallParser::Mistral, "[1] see above"),
    (ToolCallParser::Mistral, "[TOOL_CALLS]add[ARGS]{\"a\": 1, \"b\": [2, 3]}[TOOL_CALLS]get_weather[ARGS]{\"city\": \"Rome\"}"),
    (ToolCallParser::Mistral, "[TOOL_CALLS]get_weather[CALL_ID]a1b2c3d4e[ARGS]{\"city\": \"Rome\"}"),
    (ToolCallParser::Mistral, "[TOOL_CALLS]delete everything[ARGS]{}"),
    (ToolCallParser::Pythonic, "[get_weather(city=\"San Francisco\", unit='celsius'), add(a=1, b=2.5)]"),
    (ToolCallParser::Pythonic, "<|python_tag|>[add(a=[1, 2], b={'k': None})]"),
    (ToolCallParser::Pythonic, "[add(a=1)]\n"),
    (ToolCallParser::Pythonic, "[{\"name\": \"add\", \"arguments\": {\"a\": 1}}]"),
    (ToolCallParser::Pythonic, "[Note] the weather is fine."),
    (ToolCallParser::Pythonic, "[rm(path='/')]"),
    (ToolCallParser::Pythonic, "The answer is 3."),
];

#[test]
fn streamed_equals_whole_at_every_split() {
    for &(format, text) in RECORDED {
        let whole = parse(format, text, NAMES);
        for step in [1, 2, 3, 7, 1000] {
            let (streamed, _) = stream(format, text, step);
            assert!(
                streamed.content == whole.content
                    && streamed.calls.len() == whole.calls.len()
                    && (whole.calls.is_empty() || same(&streamed, &whole)),
                "{format:?} step {step}: {text:?}\nstreamed {streamed:?}\nwhole    {whole:?}"
            );
        }
    }
}

#[test]
fn new_formats_parse_whole() {
    let p = parse(ToolCallParser::Pythonic, RECORDED[19].1, NAMES);
    assert_eq!(p.calls.len(), 2);
    assert_eq!(p.calls[0].arguments, r#"{"city":"San Francisco","unit":"celsius"}"#);
    assert_eq!(p.calls[1].arguments, r#"{"a":1,"b":2.5}"#);
    assert_eq!(p.content, "");
    let v11 = parse(ToolCallParser::Mistral, RECORDED[16].1, NAMES);
    assert_eq!(v11.calls.iter().map(|c| c.name.as_str()).collect::<Vec<_>>(), ["add", "get_weather"]);
    assert_eq!(v11.calls[0].arguments, r#"{"a": 1, "b": [2, 3]}"#);
    for (format, text) in [
        (ToolCallParser::Pythonic, "[add(a=1"),                      // cut off
        (ToolCallParser::Pythonic, "[rm(path='/')]"),                // unknown function
        (ToolCallParser::Mistral, "[TOOL_CALLS]add[ARGS]{\"a\": 1"), // cut off
        (ToolCallParser::Mistral, "[TOOL_CALLS]rm[ARGS]{}"),         // unknown function
    ] {
        let p = parse(format, text, NAMES);
        assert!(p.calls.is_empty(), "{text}");
        assert_eq!(p.content, text);
    }
}

#[test]
fn arguments_stream_as_they_are_generated() {
    let text = RECORDED[0].1;
    let mut s = ToolStreamer::new(ToolCallParser::Hermes, NAMES);
    let mut pieces = Vec::new();
    for c in text.chars() {
        pieces.extend(s.push(&c.to_string()));
    }
    // The name goes out alone, then the arguments in many fragments, each call ended before the next.
    let starts: Vec<_> = pieces.iter().filter(|p| matches!(p, Piece::CallStart { .. })).collect();
    assert_eq!(
        starts,
        [
            &Piece::CallStart { index: 0, name: "get_weather".into() },
            &Piece::CallStart { index: 1, name: "add".into() }
        ]
    );
    let frags = pieces.iter().filter(|p| matches!(p, Piece::CallArgs { index: 0, .. })).count();
    assert_eq!(frags, r#"{"city": "Paris"}"#.len());
    assert!(s.finish().is_empty() && !s.cut_off());
    let p = fold(pieces);
    assert_eq!(p.calls[0].arguments, r#"{"city": "Paris"}"#);
    for format in [ToolCallParser::Llama3Json, ToolCallParser::Mistral] {
        let text = RECORDED.iter().find(|r| r.0 == format).unwrap().1;
        assert!(stream(format, text, 1).1 > 5, "{format:?}: arguments only at the end");
    }
}

#[test]
fn content_is_held_only_while_it_may_be_a_call() {
    let mut s = ToolStreamer::new(ToolCallParser::Hermes, NAMES);
    assert_eq!(s.push("Hello <tool"), vec![Piece::Content("Hello ".into())]);
    assert_eq!(s.push("box>"), vec![Piece::Content("<toolbox>".into())]);
    // An unknown name is known not to be a call before the tag closes.
    let mut s = ToolStreamer::new(ToolCallParser::Hermes, NAMES);
    assert!(s.push("<tool_call>{\"name\": \"r").is_empty());
    assert_eq!(s.push("m\", "), vec![Piece::Content("<tool_call>{\"name\": \"rm\", ".into())]);
    let mut s = ToolStreamer::new(ToolCallParser::Llama3Json, NAMES);
    assert!(s.push(" {\"name\": \"add\", \"param").is_empty());
    assert_eq!(
        s.push("eters\": {\"a"),
        vec![Piece::CallStart { index: 0, name: "add".into() }, Piece::CallArgs { index: 0, text: "{\"a".into() },]
    );
}

/// Cut off inside the arguments (max_tokens): a stream has committed the
/// call and ends it with the arguments it got; a whole reply is content.
#[test]
fn cut_off_calls() {
    for (format, text) in [
        (ToolCallParser::Hermes, "<tool_call>\n{\"name\": \"add\", \"arguments\": {\"a\": 1"),
        (ToolCallParser::Llama3Json, "{\"name\": \"add\", \"parameters\": {\"a\""),
        (ToolCallParser::Mistral, "[TOOL_CALLS]add[ARGS]{\"a\": 1"),
    ] {
        let (p, _) = stream(format, text, 2);
        assert_eq!(p.calls.len(), 1, "{text}");
        assert!(text.ends_with(&p.calls[0].arguments), "{text}: {:?}", p.calls[0].arguments);
        assert!(parse(format, text, NAMES).calls.is_empty());
        let mut s = ToolStreamer::new(format, NAMES);
        s.push(text);
        s.finish();
        assert!(s.cut_off(), "{text}");
    }
}

/// Broken JSON inside a closed tag: the stream had committed the call; it ends with the reply
/// (its arguments as written) and counts as cut off, so the finish is the generation's own rather
/// than tool_calls. Text after the tag is still content.
#[test]
fn broken_arguments_after_commit() {
    let text = "<tool_call>\n{\"name\": \"add\", \"arguments\": {\"a\": 1\n</tool_call> then text";
    for step in [1, 3, 1000] {
        let mut s = ToolStreamer::new(ToolCallParser::Hermes, NAMES);
        let mut pieces = Vec::new();
        let chars: Vec<char> = text.chars().collect();
        for chunk in chars.chunks(step) {
            pieces.extend(s.push(&chunk.iter().collect::<String>()));
        }
        pieces.extend(s.finish());
        let p = fold(pieces);
        assert_eq!(p.content, " then text");
        assert_eq!(p.calls.len(), 1);
        assert_eq!(p.calls[0].arguments, "{\"a\": 1\n");
        assert!(s.cut_off());
    }
    assert!(parse(ToolCallParser::Hermes, text, NAMES).calls.is_empty());
}

//! The grammar that forces tool calls (`tool_choice` "required" or a named
//! function): the parser's own format, with each call's JSON held to
//! `{"name": <one of the tools>, "arguments": <its parameters schema>}` by
//! llguidance's `%json` rule. The reply then always parses, and its
//! arguments validate against the function's schema.

use serde_json::json;

use super::{Tool, ToolCallParser};
use crate::grammar::compact;

/// The schema of one call object; `args_key` is the format's name for the arguments.
fn call_schema(tool: &Tool, args_key: &str) -> String {
    let params = tool.function.parameters.clone().unwrap_or_else(|| json!({"type": "object"}));
    // Built as a map so "name" comes first (serde_json keeps insertion order here).
    let mut props = serde_json::Map::new();
    props.insert("name".into(), json!({"const": tool.function.name}));
    props.insert(args_key.into(), params);
    json!({
        "type": "object",
        "properties": props,
        "required": ["name", args_key],
        "additionalProperties": false,
        "x-guidance": compact(),
    })
    .to_string()
}

/// A Lark grammar (llguidance dialect) for one or more calls of `tools`.
/// `tag_ids`: token ids of `<tool_call>` and `</tool_call>` where the
/// tokenizer has them as added tokens (llguidance treats those as special,
/// so they are matched by id as well as by text).
pub fn lark(format: ToolCallParser, tools: &[Tool], parallel: bool, tag_ids: (Option<u32>, Option<u32>)) -> String {
    let args_key = if format == ToolCallParser::Llama3Json { "parameters" } else { "arguments" };
    let tag = |text: &str, id: Option<u32>| match id {
        Some(id) => format!("(\"{text}\" | <[{id}]>)"),
        None => format!("\"{text}\""),
    };
    let hermes = format!("{} \"\\n\" fn \"\\n\" {}", tag("<tool_call>", tag_ids.0), tag("</tool_call>", tag_ids.1));
    let mut g = String::new();
    let (call, sep, open, close) = match format {
        ToolCallParser::Hermes => (hermes.as_str(), "\"\\n\"", "", ""),
        ToolCallParser::Llama3Json => ("fn", "\"; \"", "", ""),
        // The marker is a special token the grammar cannot write as text; the parser reads a bare array.
        // Pythonic arguments cannot be held to a JSON schema: forced calls are a JSON array, which its parser reads too.
        ToolCallParser::Mistral | ToolCallParser::Pythonic => ("fn", "\", \"", "\"[\" ", " \"]\""),
    };
    let repeat = if parallel { format!(" ({sep} call)*") } else { String::new() };
    g.push_str(&format!("start: {open}call{repeat}{close}\n"));
    g.push_str(&format!("call: {call}\n"));
    let alts: Vec<String> = (0..tools.len()).map(|i| format!("fn_{i}")).collect();
    g.push_str(&format!("fn: {}\n", alts.join(" | ")));
    for (i, t) in tools.iter().enumerate() {
        g.push_str(&format!("fn_{i}: %json {}\n", call_schema(t, args_key)));
    }
    g
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tools() -> Vec<Tool> {
        serde_json::from_value(json!([
            {"type": "function", "function": {"name": "get_weather",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
            {"type": "function", "function": {"name": "add"}}
        ]))
        .unwrap()
    }

    #[test]
    fn hermes_grammar_shape() {
        let g = lark(ToolCallParser::Hermes, &tools(), true, (None, None));
        assert!(g.starts_with("start: call (\"\\n\" call)*\n"), "{g}");
        assert!(g.contains("call: \"<tool_call>\" \"\\n\" fn \"\\n\" \"</tool_call>\"\n"), "{g}");
        let ids = lark(ToolCallParser::Hermes, &tools(), true, (Some(5), Some(6)));
        assert!(
            ids.contains("call: (\"<tool_call>\" | <[5]>) \"\\n\" fn \"\\n\" (\"</tool_call>\" | <[6]>)\n"),
            "{ids}"
        );
        assert!(g.contains("fn: fn_0 | fn_1\n"));
        assert!(g.contains(r#"fn_0: %json {"type":"object","properties":{"name":{"const":"get_weather"},"arguments":{"type":"object","properties":{"city""#), "{g}");
        assert!(
            g.contains(
                r#"fn_1: %json {"type":"object","properties":{"name":{"const":"add"},"arguments":{"type":"object"}}"#
            ),
            "{g}"
        );
    }

    #[test]
    fn single_call_and_other_formats() {
        assert!(lark(ToolCallParser::Hermes, &tools()[..1], false, (None, None)).starts_with("start: call\n"));
        let l = lark(ToolCallParser::Llama3Json, &tools(), true, (None, None));
        assert!(l.starts_with("start: call (\"; \" call)*\n") && l.contains("\"parameters\""), "{l}");
        let m = lark(ToolCallParser::Mistral, &tools(), false, (None, None));
        assert!(m.starts_with("start: \"[\" call \"]\"\n"), "{m}");
    }
}

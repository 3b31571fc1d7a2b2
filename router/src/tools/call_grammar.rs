//! The grammar that forces tool calls (`tool_choice` "required" or a named
//! function): the parser's own format, with each call's JSON held to
//! `{"name": <one of the tools>, "arguments": <its parameters schema>}` by
//! llguidance's `%json` rule. The reply then always parses, and its
//! arguments validate against the function's schema (`strict` tools: with
//! no properties but the listed ones, `strict_schema`). One call, then the
//! end of the reply, unless parallel calls are allowed.

use serde_json::json;

use super::{Tool, ToolCallParser};
use crate::grammar::compact;

/// The schema of one call object; `args_key` is the format's name for the arguments.
fn call_schema(tool: &Tool, args_key: &str) -> String {
    let mut params = tool.function.parameters.clone().unwrap_or_else(|| json!({"type": "object"}));
    if tool.function.strict == Some(true) {
        strict_schema(&mut params);
    }
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

/// OpenAI's strict mode: every object schema that leaves `additionalProperties`
/// unsaid takes none, down through properties, items and combinations.
pub fn strict_schema(schema: &mut serde_json::Value) {
    let Some(obj) = schema.as_object_mut() else { return };
    let is_object =
        obj.get("type").is_some_and(|t| t == "object" || t.as_array().is_some_and(|a| a.contains(&json!("object"))))
            || obj.contains_key("properties");
    if is_object && !obj.contains_key("additionalProperties") {
        obj.insert("additionalProperties".into(), json!(false));
    }
    for key in ["properties", "$defs", "definitions", "patternProperties"] {
        if let Some(map) = obj.get_mut(key).and_then(|m| m.as_object_mut()) {
            map.values_mut().for_each(strict_schema);
        }
    }
    for key in ["items", "additionalProperties", "not"] {
        if let Some(sub) = obj.get_mut(key) {
            strict_schema(sub);
        }
    }
    for key in ["anyOf", "oneOf", "allOf", "prefixItems"] {
        if let Some(list) = obj.get_mut(key).and_then(|l| l.as_array_mut()) {
            list.iter_mut().for_each(strict_schema);
        }
    }
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
    fn strict_tools_take_no_unlisted_properties() {
        let mut s = json!({"type": "object", "properties": {
            "place": {"type": "object", "properties": {"city": {"type": "string"}}},
            "tags": {"type": "array", "items": {"type": "object"}},
            "extra": {"type": "object", "additionalProperties": true}}});
        strict_schema(&mut s);
        assert_eq!(s["additionalProperties"], false);
        assert_eq!(s["properties"]["place"]["additionalProperties"], false);
        assert_eq!(s["properties"]["tags"]["items"]["additionalProperties"], false);
        assert_eq!(s["properties"]["extra"]["additionalProperties"], true, "what the schema says stays");
        let mut t = tools();
        t[0].function.strict = Some(true);
        let g = lark(ToolCallParser::Hermes, &t[..1], false, (None, None));
        assert!(g.contains(r#""required":["city"],"additionalProperties":false"#), "{g}");
        let loose = lark(ToolCallParser::Hermes, &tools()[..1], false, (None, None));
        assert!(!loose.contains(r#""required":["city"],"additionalProperties":false"#), "{loose}");
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

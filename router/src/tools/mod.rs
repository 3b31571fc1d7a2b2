//! Tool calling: the function tools of a chat request, the text formats
//! model families emit calls in, and how a call is found in (or forced on)
//! the model's output.
//!
//! Parsing is per format (`parse`, `call_stream`); forcing (`tool_choice`
//! "required" or a named function) is a Lark grammar the shard enforces
//! with llguidance (`call_grammar`), written in the same format so the same
//! parser reads it back.

pub mod analyze;
pub mod call_grammar;
pub mod call_stream;
pub mod markers;
mod mistral;
pub mod parse;
pub mod pythonic;
pub mod reading;
pub mod scan;

use rand::distr::{Alphanumeric, SampleString};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use crate::error::RouterError;

/// The formats a model may emit tool calls in (`--tool-call-parser`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum ToolCallParser {
    /// `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (Hermes, Qwen 2.5/3).
    Hermes,
    /// The whole reply is `{"name": ..., "parameters": {...}}` (Llama 3.1-3.3), calls joined by `;`.
    #[value(name = "llama3_json")]
    #[serde(rename = "llama3_json")]
    Llama3Json,
    /// `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` (Mistral), or
    /// `[TOOL_CALLS]name[ARGS]{...}` per call (Mistral v11 tokenizers).
    Mistral,
    /// `[name(key=value, ...), ...]` with Python literals (Llama 3.2 / Llama 4 pythonic templates).
    Pythonic,
}

impl ToolCallParser {
    /// The format a chat template renders tool calls in, judged by the
    /// markers it writes; Hermes (the most common) when it shows none.
    pub fn detect(template_source: &str) -> Self {
        // The pythonic templates show the call syntax to the model in the system prompt.
        if template_source.contains("[func_name1(") || template_source.contains("[func_name(") {
            ToolCallParser::Pythonic
        } else if template_source.contains("[TOOL_CALLS]") {
            ToolCallParser::Mistral
        } else if template_source.contains("<tool_call>") {
            ToolCallParser::Hermes
        } else if template_source.contains("<|python_tag|>") || template_source.contains("ipython") {
            ToolCallParser::Llama3Json
        } else {
            ToolCallParser::Hermes
        }
    }
}

/// One entry of `tools`: only function tools exist in the chat API.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct Tool {
    /// "function"
    #[serde(rename = "type")]
    pub kind: String,
    pub function: FunctionDef,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct FunctionDef {
    pub name: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    /// JSON schema of the arguments object; absent means no arguments constraint.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub parameters: Option<serde_json::Value>,
    /// Forced calls' arguments always follow `parameters`; with `strict`, every object in
    /// it that does not say otherwise takes no properties beyond its own (as OpenAI's strict mode).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub strict: Option<bool>,
}

/// A function tool as the Responses and Messages APIs list them: flat
/// (name, description, schema) rather than under `function`.
pub struct FlatTool<'a> {
    /// Why the entry's `type` is not served, if it is not.
    pub unserved: Option<String>,
    pub name: &'a str,
    pub description: Option<&'a String>,
    pub parameters: Option<&'a serde_json::Value>,
    pub strict: Option<bool>,
}

/// Another API's `tools` as chat tools; `view` reads one entry.
pub fn from_flat<'a, T>(
    list: Option<&'a [T]>,
    view: impl Fn(&'a T) -> FlatTool<'a>,
) -> Result<Option<Vec<Tool>>, RouterError> {
    let Some(list) = list else { return Ok(None) };
    let tools = list.iter().enumerate().map(|(i, t)| {
        let v = view(t);
        if let Some(why) = v.unserved {
            return Err(RouterError::Validation(format!("`tools[{i}].type`: {why}")));
        }
        Ok(Tool {
            kind: "function".into(),
            function: FunctionDef {
                name: v.name.to_string(),
                description: v.description.cloned(),
                parameters: v.parameters.cloned(),
                strict: v.strict,
            },
        })
    });
    tools.collect::<Result<Vec<_>, _>>().map(Some)
}

impl ToolChoice {
    /// The named function `name`.
    pub fn named(name: &str) -> Self {
        ToolChoice::Named(NamedToolChoice {
            kind: "function".into(),
            function: NamedFunction { name: name.to_string() },
        })
    }
}

/// `tool_choice`: "none", "auto", "required", or `{"type": "function", "function": {"name": ...}}`.
#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(untagged)]
pub enum ToolChoice {
    Mode(String),
    Named(NamedToolChoice),
}

#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct NamedToolChoice {
    #[serde(rename = "type")]
    pub kind: String,
    pub function: NamedFunction,
}

#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct NamedFunction {
    pub name: String,
}

/// What a request asks of tool calling, validated.
#[derive(Debug, Clone)]
pub struct ToolPlan {
    pub format: ToolCallParser,
    pub tools: Vec<Tool>,
    /// Parse the output for calls ("auto", "required", named).
    pub parse: bool,
    /// Force calls with a grammar: all tools ("required") or one (named).
    pub force: Option<Vec<Tool>>,
    /// More than one call per reply: never for a named function (exactly
    /// one call to it), nor with `parallel_tool_calls: false` (at most one).
    pub parallel: bool,
}

impl ToolPlan {
    /// None when the request has no tools, or tool_choice "none" (tools still reach the template).
    pub fn new(
        format: ToolCallParser,
        tools: Option<&[Tool]>,
        choice: Option<&ToolChoice>,
        parallel: Option<bool>,
    ) -> Result<Option<Self>, RouterError> {
        let invalid = |m: String| RouterError::Validation(m);
        let tools = tools.unwrap_or_default();
        for (i, t) in tools.iter().enumerate() {
            if t.kind != "function" {
                return Err(invalid(format!("`tools[{i}].type` must be \"function\", got {:?}", t.kind)));
            }
            if t.function.name.is_empty() {
                return Err(invalid(format!("`tools[{i}].function.name` must not be empty")));
            }
            if let Some(p) = &t.function.parameters {
                if !p.is_object() {
                    return Err(invalid(format!("`tools[{i}].function.parameters` must be a JSON schema object")));
                }
            }
        }
        let force = match choice {
            None => None,
            Some(ToolChoice::Mode(m)) => match m.as_str() {
                "none" => return Ok(None),
                "auto" => None,
                "required" => Some(tools.to_vec()),
                other => {
                    return Err(invalid(format!(
                        "`tool_choice` must be \"none\", \"auto\", \"required\" or a named function; got {other:?}"
                    )))
                }
            },
            Some(ToolChoice::Named(n)) => {
                if n.kind != "function" {
                    return Err(invalid(format!("`tool_choice.type` must be \"function\", got {:?}", n.kind)));
                }
                let Some(t) = tools.iter().find(|t| t.function.name == n.function.name) else {
                    return Err(invalid(format!(
                        "`tool_choice.function.name` {:?} is not one of `tools`",
                        n.function.name
                    )));
                };
                Some(vec![t.clone()])
            }
        };
        if tools.is_empty() {
            if force.is_some() {
                return Err(invalid("`tool_choice` requires `tools`".into()));
            }
            return Ok(None);
        }
        let named = matches!(choice, Some(ToolChoice::Named(_)));
        let parallel = parallel.unwrap_or(true) && !named;
        Ok(Some(Self { format, tools: tools.to_vec(), parse: true, force, parallel }))
    }

    pub fn names(&self) -> Vec<&str> {
        self.tools.iter().map(|t| t.function.name.as_str()).collect()
    }
}

/// A call found in the output. `arguments` is JSON text (OpenAI sends it as a string).
#[derive(Debug, Clone, PartialEq)]
pub struct ToolCall {
    pub name: String,
    pub arguments: String,
}

/// `call_` and 24 random characters, as OpenAI's ids look.
pub fn call_id() -> String {
    format!("call_{}", Alphanumeric.sample_string(&mut rand::rng(), 24))
}

/// Tool calls of an assistant message in the history, as chat templates
/// expect them: `arguments` as an object (OpenAI clients send a JSON string).
pub fn history_tool_calls(calls: &serde_json::Value) -> serde_json::Value {
    let mut calls = calls.clone();
    if let Some(list) = calls.as_array_mut() {
        for c in list {
            if let Some(args) = c.pointer_mut("/function/arguments") {
                if let Some(parsed) = args.as_str().and_then(|s| serde_json::from_str::<serde_json::Value>(s).ok()) {
                    *args = parsed;
                }
            }
        }
    }
    calls
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tools() -> Vec<Tool> {
        serde_json::from_value(serde_json::json!([
            {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}},
            {"type": "function", "function": {"name": "add"}}
        ]))
        .unwrap()
    }

    #[test]
    fn detects_the_format_from_the_template() {
        assert_eq!(ToolCallParser::detect("{{ '<tool_call>' }}"), ToolCallParser::Hermes);
        assert_eq!(ToolCallParser::detect("[TOOL_CALLS] {{ x }}"), ToolCallParser::Mistral);
        assert_eq!(ToolCallParser::detect("<|python_tag|>"), ToolCallParser::Llama3Json);
        assert_eq!(ToolCallParser::detect("plain"), ToolCallParser::Hermes);
        let pythonic = "respond in the format [func_name1(params_name1=params_value1, params_name2=params_value2...), func_name2(params)]";
        assert_eq!(ToolCallParser::detect(pythonic), ToolCallParser::Pythonic);
        assert_eq!(ToolCallParser::detect("{{ '[TOOL_CALLS]' + name + '[ARGS]' }}"), ToolCallParser::Mistral);
    }

    #[test]
    fn tool_choice_modes() {
        let t = tools();
        let h = ToolCallParser::Hermes;
        let plan = |c: serde_json::Value| {
            let c: ToolChoice = serde_json::from_value(c).unwrap();
            ToolPlan::new(h, Some(&t), Some(&c), None)
        };
        assert!(plan(serde_json::json!("none")).unwrap().is_none());
        let auto = plan(serde_json::json!("auto")).unwrap().unwrap();
        assert!(auto.force.is_none() && auto.parse && auto.parallel);
        assert_eq!(plan(serde_json::json!("required")).unwrap().unwrap().force.unwrap().len(), 2);
        let named = plan(serde_json::json!({"type": "function", "function": {"name": "add"}})).unwrap().unwrap();
        assert!(!named.parallel, "a named function is called exactly once");
        assert_eq!(named.force.unwrap()[0].function.name, "add");
        let e = plan(serde_json::json!({"type": "function", "function": {"name": "nope"}})).unwrap_err();
        assert_eq!(e.param().as_deref(), Some("tool_choice.function.name"));
        assert!(plan(serde_json::json!("sometimes")).is_err());
        let none: ToolChoice = serde_json::from_value(serde_json::json!("required")).unwrap();
        assert!(ToolPlan::new(h, None, Some(&none), None).is_err());
    }

    #[test]
    fn history_arguments_become_objects() {
        let calls = serde_json::json!([{"id": "call_1", "type": "function",
            "function": {"name": "f", "arguments": "{\"a\": 1}"}}]);
        let out = history_tool_calls(&calls);
        assert_eq!(out[0]["function"]["arguments"], serde_json::json!({"a": 1}));
        assert!(call_id().starts_with("call_") && call_id().len() == 29);
    }
}

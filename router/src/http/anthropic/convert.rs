//! A Messages request as the chat request the router already serves: the
//! system prompt becomes a system message, `tool_result` blocks become
//! `tool` messages, `tool_use` blocks become the assistant's `tool_calls`,
//! tools and tool_choice their OpenAI forms. Everything after that (template,
//! sampling, tool parsing, grammar) is the chat pipeline's (http/chat/).

use serde_json::{json, Value};

use super::types::{Content, InputBlock, MessagesRequest, TextOrBlocks};
use crate::error::RouterError;
use crate::http::openai::types::{ChatCompletionRequest, ChatMessage, SamplingParams};
use crate::tools::{from_flat, FlatTool, ToolChoice};

fn invalid(m: String) -> RouterError {
    RouterError::Validation(m)
}

fn text_of(t: &TextOrBlocks, field: &str) -> Result<String, RouterError> {
    match t {
        TextOrBlocks::Text(s) => Ok(s.clone()),
        TextOrBlocks::Blocks(blocks) => {
            let mut out = String::new();
            for (i, b) in blocks.iter().enumerate() {
                if b.kind != "text" {
                    return Err(invalid(format!("`{field}[{i}].type` must be \"text\", got {:?}", b.kind)));
                }
                out.push_str(&b.text);
            }
            Ok(out)
        }
    }
}

fn messages(req: &MessagesRequest) -> Result<Vec<ChatMessage>, RouterError> {
    let mut out = Vec::new();
    if let Some(system) = &req.system {
        out.push(ChatMessage::text("system", text_of(system, "system")?));
    }
    for (i, m) in req.messages.iter().enumerate() {
        if m.role != "user" && m.role != "assistant" {
            return Err(invalid(format!("`messages[{i}].role` must be \"user\" or \"assistant\"; got {:?}", m.role)));
        }
        let blocks = match &m.content {
            Content::Text(t) => {
                out.push(ChatMessage::text(&m.role, t.clone()));
                continue;
            }
            Content::Blocks(b) => b,
        };
        let mut text = String::new();
        let mut calls = Vec::new();
        for (j, b) in blocks.iter().enumerate() {
            let at = |what: &str| format!("`messages[{i}].content[{j}]` ({what})");
            match b {
                InputBlock::Text { text: t } => text.push_str(t),
                InputBlock::Thinking { .. } => {}
                InputBlock::ToolUse { id, name, input } => {
                    if m.role != "assistant" {
                        return Err(invalid(format!(
                            "{}: only assistant messages hold tool_use blocks",
                            at("tool_use")
                        )));
                    }
                    calls.push(json!({"id": id, "type": "function",
                        "function": {"name": name, "arguments": input.to_string()}}));
                }
                InputBlock::ToolResult { tool_use_id, content, is_error } => {
                    if m.role != "user" {
                        return Err(invalid(format!(
                            "{}: only user messages hold tool_result blocks",
                            at("tool_result")
                        )));
                    }
                    let mut result = match content {
                        Some(c) => text_of(c, &format!("messages[{i}].content[{j}].content"))?,
                        None => String::new(),
                    };
                    if *is_error == Some(true) {
                        result = format!("Error: {result}");
                    }
                    out.push(ChatMessage {
                        tool_call_id: Some(tool_use_id.clone()),
                        ..ChatMessage::text("tool", result)
                    });
                }
            }
        }
        if !text.is_empty() || !calls.is_empty() || m.role == "assistant" {
            out.push(ChatMessage {
                tool_calls: (!calls.is_empty()).then_some(Value::Array(calls)),
                ..ChatMessage::text(&m.role, text)
            });
        }
    }
    Ok(out)
}

fn tool_choice(req: &MessagesRequest) -> Result<(Option<ToolChoice>, Option<bool>), RouterError> {
    let Some(c) = &req.tool_choice else { return Ok((None, None)) };
    let mode = |m: &str| Some(ToolChoice::Mode(m.into()));
    let choice = match (c.kind.as_str(), &c.name) {
        ("auto", None) => mode("auto"),
        ("any", None) => mode("required"),
        ("none", None) => mode("none"),
        ("tool", Some(name)) => Some(ToolChoice::named(name)),
        ("tool", None) => return Err(invalid("`tool_choice.name` is required with type \"tool\"".into())),
        (_, Some(_)) => return Err(invalid("`tool_choice.name` is only for type \"tool\"".into())),
        (other, None) => {
            return Err(invalid(format!("`tool_choice.type` must be auto, any, tool or none; got {other:?}")))
        }
    };
    Ok((choice, c.disable_parallel_tool_use.map(|d| !d)))
}

pub fn to_chat(req: &MessagesRequest) -> Result<ChatCompletionRequest, RouterError> {
    if req.max_tokens <= 0 {
        return Err(invalid(format!("`max_tokens` must be strictly positive, got {}", req.max_tokens)));
    }
    if let Some(t) = req.temperature.filter(|t| !(0.0..=1.0).contains(t)) {
        return Err(invalid(format!("`temperature` must be in [0, 1], got {t}")));
    }
    let tools = from_flat(req.tools.as_deref(), |t| FlatTool {
        unserved: t
            .kind
            .as_deref()
            .is_some_and(|k| k != "custom")
            .then(|| "only client tools (\"custom\") are served".into()),
        name: &t.name,
        description: t.description.as_ref(),
        parameters: Some(&t.input_schema),
        strict: None,
    })?;
    let (tool_choice, parallel_tool_calls) = tool_choice(req)?;
    Ok(ChatCompletionRequest {
        messages: messages(req)?,
        sampling: SamplingParams {
            model: Some(req.model.clone()),
            max_tokens: Some(req.max_tokens),
            temperature: req.temperature,
            top_p: req.top_p,
            top_k: req.top_k,
            stream: req.stream,
            stop: req.stop_sequences.clone().map(crate::http::openai::types::StringOrList::Many),
            user: req.metadata.as_ref().and_then(|m| m.user_id.clone()),
            ..Default::default()
        },
        max_completion_tokens: None,
        logprobs: None,
        top_logprobs: None,
        tools,
        tool_choice,
        parallel_tool_calls,
        chat_template_kwargs: None,
        ..Default::default()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(v: Value) -> MessagesRequest {
        serde_json::from_value(v).unwrap()
    }

    #[test]
    fn system_tool_use_and_tool_result_become_chat_messages() {
        let r = req(json!({
            "model": "m", "max_tokens": 10, "system": "Be brief.",
            "messages": [
                {"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": [{"type": "text", "text": "Checking."},
                    {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Oslo"}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "21C"},
                    {"type": "text", "text": "Thanks"}]}
            ],
            "tools": [{"name": "get_weather", "input_schema": {"type": "object"}}],
            "tool_choice": {"type": "any", "disable_parallel_tool_use": true}
        }));
        let c = to_chat(&r).unwrap();
        let roles: Vec<&str> = c.messages.iter().map(|m| m.role.as_str()).collect();
        assert_eq!(roles, ["system", "user", "assistant", "tool", "user"]);
        let calls = c.messages[2].tool_calls.as_ref().unwrap();
        assert_eq!(calls[0]["function"]["arguments"], r#"{"city":"Oslo"}"#);
        assert_eq!(c.messages[3].tool_call_id.as_deref(), Some("toolu_1"));
        assert!(matches!(c.tool_choice, Some(ToolChoice::Mode(ref m)) if m == "required"));
        assert_eq!(c.parallel_tool_calls, Some(false));
        assert_eq!(c.tools.unwrap()[0].function.name, "get_weather");
    }

    #[test]
    fn bad_requests_name_the_field() {
        let base = json!({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]});
        let mut wizard = base.clone();
        wizard["messages"][0]["role"] = json!("wizard");
        assert_eq!(to_chat(&req(wizard)).unwrap_err().param().as_deref(), Some("messages[0].role"));
        let mut hot = base.clone();
        hot["temperature"] = json!(1.5);
        assert_eq!(to_chat(&req(hot)).unwrap_err().param().as_deref(), Some("temperature"));
        let mut named = base.clone();
        named["tool_choice"] = json!({"type": "tool"});
        assert!(to_chat(&req(named)).is_err());
        let mut unknown = base;
        unknown["frobnicate"] = json!(1);
        assert!(serde_json::from_value::<MessagesRequest>(unknown).is_err());
    }
}

//! A Responses request as a chat request: `instructions` become a system
//! message, input items messages, `function_call` items the assistant's
//! `tool_calls`, `function_call_output` items `tool` messages.

use serde_json::{json, Value};

use super::types::{Input, InputItem, MessageContent, ResponsesRequest, ToolChoice as RToolChoice};
use crate::error::RouterError;
use crate::http::openai::types::{ChatCompletionRequest, ChatMessage, SamplingParams};
use crate::tools::{from_flat, FlatTool, NamedFunction, NamedToolChoice, ToolChoice};

fn invalid(m: String) -> RouterError {
    RouterError::Validation(m)
}

fn messages(req: &ResponsesRequest) -> Result<Vec<ChatMessage>, RouterError> {
    let mut out = Vec::new();
    if let Some(i) = &req.instructions {
        out.push(ChatMessage::text("system", i.clone()));
    }
    let items = match &req.input {
        Input::Text(t) => {
            out.push(ChatMessage::text("user", t.clone()));
            return Ok(out);
        }
        Input::Items(items) => items,
    };
    for (i, item) in items.iter().enumerate() {
        match item {
            InputItem::Message(m) => {
                if m.kind.as_deref().is_some_and(|k| k != "message") {
                    return Err(invalid(format!("`input[{i}].type` must be \"message\", got {:?}", m.kind)));
                }
                if !["user", "system", "developer", "assistant"].contains(&m.role.as_str()) {
                    return Err(invalid(format!(
                        "`input[{i}].role` must be user, system, developer or assistant; got {:?}",
                        m.role
                    )));
                }
                let text = match &m.content {
                    MessageContent::Text(t) => t.clone(),
                    MessageContent::Parts(parts) => {
                        let mut text = String::new();
                        for (j, p) in parts.iter().enumerate() {
                            if p.kind != "input_text" && p.kind != "output_text" {
                                return Err(invalid(format!(
                                    "`input[{i}].content[{j}].type` must be input_text or output_text; got {:?}",
                                    p.kind
                                )));
                            }
                            text.push_str(&p.text);
                        }
                        text
                    }
                };
                let role = if m.role == "developer" { "system" } else { m.role.as_str() };
                out.push(ChatMessage::text(role, text));
            }
            InputItem::FunctionCall(c) => {
                let call = json!({"id": c.call_id, "type": "function",
                    "function": {"name": c.name, "arguments": c.arguments}});
                // Consecutive calls are one assistant turn.
                match out.last_mut() {
                    Some(last) if last.role == "assistant" && last.tool_calls.is_some() => {
                        if let Some(Value::Array(calls)) = &mut last.tool_calls {
                            calls.push(call);
                        }
                    }
                    _ => out.push(ChatMessage {
                        tool_calls: Some(Value::Array(vec![call])),
                        ..ChatMessage::text("assistant", String::new())
                    }),
                }
            }
            InputItem::FunctionCallOutput(o) => {
                out.push(ChatMessage {
                    tool_call_id: Some(o.call_id.clone()),
                    ..ChatMessage::text("tool", o.output.clone())
                });
            }
        }
    }
    if out.iter().all(|m| m.role == "system") {
        return Err(invalid("`input` must hold at least one message".into()));
    }
    Ok(out)
}

pub fn to_chat(req: &ResponsesRequest) -> Result<ChatCompletionRequest, RouterError> {
    if req.store == Some(true) {
        return Err(invalid("`store`: this server keeps no responses; leave it unset or false".into()));
    }
    let tools = from_flat(req.tools.as_deref(), |t| FlatTool {
        unserved: (t.kind != "function").then(|| format!("only function tools are served, got {:?}", t.kind)),
        name: &t.name,
        description: t.description.as_ref(),
        parameters: t.parameters.as_ref(),
        strict: t.strict,
    })?;
    let tool_choice = match &req.tool_choice {
        None => None,
        Some(RToolChoice::Mode(m)) => Some(ToolChoice::Mode(m.clone())),
        Some(RToolChoice::Function(f)) => Some(ToolChoice::Named(NamedToolChoice {
            kind: f.kind.clone(),
            function: NamedFunction { name: f.name.clone() },
        })),
    };
    Ok(ChatCompletionRequest {
        messages: messages(req)?,
        sampling: SamplingParams {
            model: Some(req.model.clone()),
            max_tokens: req.max_output_tokens,
            temperature: req.temperature,
            top_p: req.top_p,
            stream: req.stream,
            user: req.user.clone(),
            ..Default::default()
        },
        max_completion_tokens: None,
        logprobs: None,
        top_logprobs: None,
        tools,
        tool_choice,
        parallel_tool_calls: req.parallel_tool_calls,
        chat_template_kwargs: None,
        ..Default::default()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(v: Value) -> ResponsesRequest {
        serde_json::from_value(v).unwrap()
    }

    #[test]
    fn items_become_chat_messages() {
        let r = req(json!({"model": "m", "instructions": "Be brief.", "input": [
            {"role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
            {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"},
            {"type": "function_call", "call_id": "call_2", "name": "get_weather", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "call_1", "output": "21C"}
        ], "tools": [{"type": "function", "name": "get_weather", "parameters": {"type": "object"}}],
           "tool_choice": {"type": "function", "name": "get_weather"}, "max_output_tokens": 9}));
        let c = to_chat(&r).unwrap();
        let roles: Vec<&str> = c.messages.iter().map(|m| m.role.as_str()).collect();
        assert_eq!(roles, ["system", "user", "assistant", "tool"]);
        assert_eq!(c.messages[2].tool_calls.as_ref().unwrap().as_array().unwrap().len(), 2);
        assert_eq!(c.sampling.max_tokens, Some(9));
        assert!(matches!(c.tool_choice, Some(ToolChoice::Named(ref n)) if n.function.name == "get_weather"));
    }

    #[test]
    fn stateful_and_unknown_things_are_rejected() {
        assert!(to_chat(&req(json!({"model": "m", "input": "hi", "store": true}))).is_err());
        assert!(to_chat(&req(json!({"model": "m", "input": [{"role": "wizard", "content": "x"}]}))).is_err());
        assert!(serde_json::from_value::<ResponsesRequest>(
            json!({"model": "m", "input": "hi", "previous_response_id": "r"})
        )
        .is_err());
    }
}

//! A chat request's prompt: its messages as the chat template sees them,
//! rendered with the model's template (tools, template kwargs and
//! `reasoning_effort` included), closed by a new assistant turn or left
//! open in the final assistant message (`continue_final_message`).

use serde_json::Value as Json_;

use crate::chat_template::continue_final;
use crate::error::RouterError;
use crate::http::openai::types::{ChatCompletionRequest, ChatMessage, ContentPart, MessageContent, ROLES};
use crate::http::AppState;

fn invalid(msg: impl Into<String>) -> RouterError {
    RouterError::Validation(msg.into())
}

/// Messages as the template sees them: `content` flattened to a string
/// (text parts joined), since the served models are text-only.
fn template_messages(messages: &[ChatMessage]) -> Result<Vec<Json_>, RouterError> {
    if messages.is_empty() {
        return Err(invalid("`messages` must not be empty"));
    }
    messages
        .iter()
        .enumerate()
        .map(|(i, m)| {
            if !ROLES.contains(&m.role.as_str()) {
                return Err(invalid(format!(
                    "`messages[{i}].role` must be one of {}; got {:?}",
                    ROLES.join(", "),
                    m.role
                )));
            }
            // OpenAI's newer name for system instructions; chat templates know "system".
            let role = if m.role == "developer" { "system" } else { m.role.as_str() };
            let content = match &m.content {
                None => String::new(),
                Some(MessageContent::Text(t)) => t.clone(),
                Some(MessageContent::Parts(parts)) => {
                    let mut text = String::new();
                    for p in parts {
                        match p {
                            ContentPart::Text { text: t } => text.push_str(t),
                            ContentPart::ImageUrl { .. } => {
                                return Err(invalid("image content is not supported by this text-only model"))
                            }
                        }
                    }
                    text
                }
            };
            let mut obj = serde_json::Map::new();
            obj.insert("role".into(), Json_::String(role.to_string()));
            obj.insert("content".into(), Json_::String(content));
            if let Some(name) = &m.name {
                obj.insert("name".into(), Json_::String(name.clone()));
            }
            if let Some(calls) = &m.tool_calls {
                obj.insert("tool_calls".into(), crate::tools::history_tool_calls(calls));
            }
            if let Some(id) = &m.tool_call_id {
                obj.insert("tool_call_id".into(), Json_::String(id.clone()));
            }
            Ok(Json_::Object(obj))
        })
        .collect()
}

/// The rendered prompt for a chat request (also what `/v1/chat/completions` generates from):
/// the turn opened for the reply, or the final assistant message left open to continue.
pub fn render_prompt(app: &AppState, req: &ChatCompletionRequest) -> Result<String, RouterError> {
    let template = app.chat_template.as_ref().as_ref().map_err(|e| invalid(e.clone()))?;
    let end = req.prompt_end()?;
    let messages = template_messages(&req.messages)?;
    let mut extra = req.chat_template_kwargs.clone().unwrap_or_default();
    if let Some(tools) = &req.tools {
        extra.insert("tools".into(), serde_json::to_value(tools).unwrap_or_default());
    }
    if let Some(effort) = req.reasoning_effort()? {
        extra.insert("reasoning_effort".into(), Json_::String(effort.to_string()));
    }
    let rendered = template.apply(&messages, end.add_generation_prompt, extra)?;
    if !end.continue_final_message {
        return Ok(rendered);
    }
    let last = messages.last().and_then(|m| m["content"].as_str()).unwrap_or_default();
    continue_final(&rendered, last)
}

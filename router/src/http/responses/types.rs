//! OpenAI Responses API request body (`POST /v1/responses`), stateless:
//! no `previous_response_id`, `store` only false. Strict: an unknown field
//! is a 400 naming it.

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ResponsesRequest {
    /// Accepted and echoed back; the server serves one model.
    pub model: String,
    /// A user message's text, or a list of input items.
    pub input: Input,
    /// A system message placed before the input.
    pub instructions: Option<String>,
    pub tools: Option<Vec<FunctionTool>>,
    /// "none", "auto", "required", or `{"type": "function", "name": ...}`.
    pub tool_choice: Option<ToolChoice>,
    pub parallel_tool_calls: Option<bool>,
    pub max_output_tokens: Option<i64>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    #[serde(default)]
    pub stream: bool,
    /// Only false: the server keeps no responses.
    pub store: Option<bool>,
    /// Echoed back in the response.
    pub metadata: Option<serde_json::Map<String, serde_json::Value>>,
    /// A label for the end user; accepted and not used.
    pub user: Option<String>,
}

#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(untagged)]
pub enum Input {
    Text(String),
    Items(Vec<InputItem>),
}

#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(untagged)]
pub enum InputItem {
    FunctionCall(FunctionCallItem),
    FunctionCallOutput(FunctionCallOutputItem),
    Message(MessageItem),
}

#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct MessageItem {
    /// "message" when present.
    #[serde(rename = "type")]
    pub kind: Option<String>,
    /// "user", "system", "developer" or "assistant".
    pub role: String,
    pub content: MessageContent,
    pub id: Option<String>,
    pub status: Option<String>,
}

#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(untagged)]
pub enum MessageContent {
    Text(String),
    Parts(Vec<ContentPart>),
}

#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ContentPart {
    /// "input_text" or "output_text".
    #[serde(rename = "type")]
    pub kind: String,
    pub text: String,
    /// Of earlier output_text parts; must be empty.
    pub annotations: Option<Vec<serde_json::Value>>,
}

#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct FunctionCallItem {
    /// "function_call"
    #[serde(rename = "type")]
    pub kind: FunctionCallTag,
    pub call_id: String,
    pub name: String,
    pub arguments: String,
    pub id: Option<String>,
    pub status: Option<String>,
}

#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum FunctionCallTag {
    FunctionCall,
}

#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct FunctionCallOutputItem {
    /// "function_call_output"
    #[serde(rename = "type")]
    pub kind: FunctionCallOutputTag,
    pub call_id: String,
    pub output: String,
    pub id: Option<String>,
    pub status: Option<String>,
}

#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum FunctionCallOutputTag {
    FunctionCallOutput,
}

#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct FunctionTool {
    /// "function"
    #[serde(rename = "type")]
    pub kind: String,
    pub name: String,
    pub description: Option<String>,
    pub parameters: Option<serde_json::Value>,
    pub strict: Option<bool>,
}

#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(untagged)]
pub enum ToolChoice {
    Mode(String),
    Function(NamedFunction),
}

#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct NamedFunction {
    /// "function"
    #[serde(rename = "type")]
    pub kind: String,
    pub name: String,
}

/// The response object (also inside `response.created` and `response.completed` events).
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct ResponseObject {
    pub id: String,
    /// "response"
    pub object: String,
    pub created_at: u64,
    /// "in_progress", "completed" or "incomplete".
    pub status: String,
    pub model: String,
    /// Output items: `message` (output_text parts), `function_call`, `reasoning`.
    #[schema(value_type = Vec<Object>)]
    pub output: Vec<serde_json::Value>,
    /// `{"reason": "max_output_tokens"}` when incomplete.
    #[schema(value_type = Object)]
    pub incomplete_details: Option<serde_json::Value>,
    pub instructions: Option<String>,
    pub max_output_tokens: Option<i64>,
    pub parallel_tool_calls: bool,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    #[schema(value_type = Object)]
    pub tool_choice: serde_json::Value,
    #[schema(value_type = Vec<Object>)]
    pub tools: Vec<serde_json::Value>,
    #[schema(value_type = Object)]
    pub metadata: serde_json::Value,
    pub store: bool,
    #[schema(value_type = Object)]
    pub error: Option<serde_json::Value>,
    #[schema(value_type = Object)]
    pub usage: Option<serde_json::Value>,
}

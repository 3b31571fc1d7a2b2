//! Anthropic Messages API bodies (`POST /v1/messages`). Requests are
//! strict: an unknown field is a 400 naming it.

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

/// Anthropic's tool-use ids look like `toolu_...`; the random part is the call id's.
pub fn tool_use_id(call_id: &str) -> String {
    format!("toolu_{}", call_id.trim_start_matches("call_"))
}

#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct MessagesRequest {
    /// Accepted and echoed back; the server serves one model.
    pub model: String,
    pub max_tokens: i64,
    pub messages: Vec<InputMessage>,
    /// System prompt: text, or a list of text blocks.
    pub system: Option<TextOrBlocks>,
    pub stop_sequences: Option<Vec<String>>,
    #[serde(default)]
    pub stream: bool,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<i64>,
    pub tools: Option<Vec<ToolDef>>,
    pub tool_choice: Option<ToolChoice>,
    /// `user_id` is a label for the end user; accepted and not used.
    pub metadata: Option<Metadata>,
}

#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct Metadata {
    pub user_id: Option<String>,
}

#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct InputMessage {
    /// "user" or "assistant".
    pub role: String,
    pub content: Content,
}

#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(untagged)]
pub enum Content {
    Text(String),
    Blocks(Vec<InputBlock>),
}

#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(untagged)]
pub enum TextOrBlocks {
    Text(String),
    Blocks(Vec<TextBlock>),
}

#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct TextBlock {
    /// "text"
    #[serde(rename = "type")]
    pub kind: String,
    pub text: String,
}

#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(tag = "type", rename_all = "snake_case", deny_unknown_fields)]
pub enum InputBlock {
    Text {
        text: String,
    },
    ToolUse {
        id: String,
        name: String,
        input: serde_json::Value,
    },
    ToolResult {
        tool_use_id: String,
        #[serde(default)]
        content: Option<TextOrBlocks>,
        /// Rendered into the result's text as an error marker.
        #[serde(default)]
        is_error: Option<bool>,
    },
    /// Reasoning of an earlier turn; not shown to the model again, as chat templates drop it.
    Thinking {
        thinking: String,
        signature: Option<String>,
    },
}

#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ToolDef {
    pub name: String,
    pub description: Option<String>,
    pub input_schema: serde_json::Value,
    /// "custom" when present (client tools only).
    #[serde(rename = "type")]
    pub kind: Option<String>,
}

#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ToolChoice {
    /// "auto", "any", "tool" or "none".
    #[serde(rename = "type")]
    pub kind: String,
    /// With "tool": the tool to call.
    pub name: Option<String>,
    pub disable_parallel_tool_use: Option<bool>,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum OutputBlock {
    Thinking { thinking: String, signature: String },
    Text { text: String },
    ToolUse { id: String, name: String, input: serde_json::Value },
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct MessagesUsage {
    pub input_tokens: u32,
    pub output_tokens: u32,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct MessagesResponse {
    pub id: String,
    /// "message"
    #[serde(rename = "type")]
    pub kind: String,
    /// "assistant"
    pub role: String,
    pub model: String,
    pub content: Vec<OutputBlock>,
    /// "end_turn", "max_tokens", "stop_sequence" or "tool_use"; null in `message_start`.
    pub stop_reason: Option<String>,
    pub stop_sequence: Option<String>,
    pub usage: MessagesUsage,
}

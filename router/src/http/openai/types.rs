//! OpenAI-compatible request and response bodies (`/v1/completions`,
//! `/v1/chat/completions`, `/v1/models`). Unknown request fields are
//! ignored, as OpenAI-compatible servers do, so newer clients keep working.

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use crate::grammar::ResponseFormat;
use crate::http::types::null_default;

#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(untagged)]
pub enum StringOrList {
    One(String),
    Many(Vec<String>),
}

impl StringOrList {
    pub fn into_vec(self) -> Vec<String> {
        match self {
            StringOrList::One(s) => vec![s],
            StringOrList::Many(v) => v,
        }
    }
}

#[derive(Debug, Clone, Default, Deserialize, ToSchema)]
pub struct StreamOptions {
    /// Send one last chunk with `usage` (and no choices) before `[DONE]`.
    #[serde(default, deserialize_with = "null_default")]
    pub include_usage: bool,
}

/// Fields both OpenAI routes share.
#[derive(Debug, Clone, Default, Deserialize, ToSchema)]
pub struct SamplingParams {
    /// Accepted and echoed back; the server serves one model.
    pub model: Option<String>,
    pub max_tokens: Option<i64>,
    /// 0 means greedy; default 1 (sampling), range [0, 2].
    pub temperature: Option<f32>,
    /// In (0, 1]; 1 disables.
    pub top_p: Option<f32>,
    /// Choices to generate (sampling only when > 1).
    pub n: Option<u32>,
    #[serde(default, deserialize_with = "null_default")]
    pub stream: bool,
    pub stream_options: Option<StreamOptions>,
    /// A stop string or a list of them; excluded from the output.
    pub stop: Option<StringOrList>,
    pub presence_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    pub seed: Option<u64>,
    /// `{"type": "json_object"}` or `{"type": "json_schema", "json_schema": {"schema": {...}}}`.
    pub response_format: Option<ResponseFormat>,
    /// Extension (vLLM/TGI): top-k sampling.
    pub top_k: Option<i64>,
    /// Extension: min-p sampling.
    pub min_p: Option<f32>,
    /// Extension: repetition penalty (1 disables).
    pub repetition_penalty: Option<f32>,
    pub user: Option<String>,
}

#[derive(Debug, Clone, Deserialize, ToSchema)]
pub struct CompletionRequest {
    /// A prompt or a list of prompts.
    pub prompt: StringOrList,
    #[serde(flatten)]
    pub sampling: SamplingParams,
    /// Return logprobs of the chosen tokens and of the `logprobs` most likely ones.
    pub logprobs: Option<u32>,
    /// Prepend the prompt to the completion.
    #[serde(default, deserialize_with = "null_default")]
    pub echo: bool,
}

#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ContentPart {
    Text { text: String },
    ImageUrl { image_url: serde_json::Value },
}

#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(untagged)]
pub enum MessageContent {
    Text(String),
    Parts(Vec<ContentPart>),
}

#[derive(Debug, Clone, Deserialize, ToSchema)]
pub struct ChatMessage {
    /// "system", "user", "assistant", "tool", ... (whatever the template knows).
    pub role: String,
    pub content: Option<MessageContent>,
    pub name: Option<String>,
    pub tool_calls: Option<serde_json::Value>,
    pub tool_call_id: Option<String>,
}

#[derive(Debug, Clone, Deserialize, ToSchema)]
pub struct ChatCompletionRequest {
    pub messages: Vec<ChatMessage>,
    #[serde(flatten)]
    pub sampling: SamplingParams,
    /// Newer name of `max_tokens`; wins when both are set.
    pub max_completion_tokens: Option<i64>,
    /// Return logprobs of the chosen tokens.
    pub logprobs: Option<bool>,
    /// With `logprobs`: this many alternatives per token.
    pub top_logprobs: Option<u32>,
    /// Passed to the chat template as `tools` (no tool-call parsing).
    pub tools: Option<serde_json::Value>,
    /// Extra variables for the chat template (vLLM's extension).
    pub chat_template_kwargs: Option<serde_json::Map<String, serde_json::Value>>,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct Usage {
    pub prompt_tokens: u32,
    pub completion_tokens: u32,
    pub total_tokens: u32,
}

impl Usage {
    pub fn new(prompt_tokens: u32, completion_tokens: u32) -> Self {
        Self { prompt_tokens, completion_tokens, total_tokens: prompt_tokens + completion_tokens }
    }
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct CompletionLogprobs {
    pub tokens: Vec<String>,
    pub token_logprobs: Vec<f32>,
    pub top_logprobs: Vec<serde_json::Map<String, serde_json::Value>>,
    /// Character offset of each token in the choice's text.
    pub text_offset: Vec<usize>,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct CompletionChoice {
    pub index: u32,
    pub text: String,
    pub logprobs: Option<CompletionLogprobs>,
    /// "stop" or "length"; `null` in stream chunks until the last.
    pub finish_reason: Option<String>,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct CompletionResponse {
    pub id: String,
    /// "text_completion"
    pub object: String,
    pub created: u64,
    pub model: String,
    pub system_fingerprint: String,
    pub choices: Vec<CompletionChoice>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct TopLogprob {
    pub token: String,
    pub logprob: f32,
    pub bytes: Vec<u8>,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct ChatLogprob {
    pub token: String,
    pub logprob: f32,
    pub bytes: Vec<u8>,
    pub top_logprobs: Vec<TopLogprob>,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct ChatLogprobs {
    pub content: Vec<ChatLogprob>,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct ChatResponseMessage {
    pub role: String,
    pub content: String,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct ChatChoice {
    pub index: u32,
    pub message: ChatResponseMessage,
    pub logprobs: Option<ChatLogprobs>,
    pub finish_reason: String,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct ChatCompletionResponse {
    pub id: String,
    /// "chat.completion"
    pub object: String,
    pub created: u64,
    pub model: String,
    pub system_fingerprint: String,
    pub choices: Vec<ChatChoice>,
    pub usage: Usage,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct ChatDelta {
    pub role: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub content: Option<String>,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct ChatChunkChoice {
    pub index: u32,
    pub delta: ChatDelta,
    pub logprobs: Option<ChatLogprobs>,
    pub finish_reason: Option<String>,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct ChatCompletionChunk {
    pub id: String,
    /// "chat.completion.chunk"
    pub object: String,
    pub created: u64,
    pub model: String,
    pub system_fingerprint: String,
    pub choices: Vec<ChatChunkChoice>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct ModelCard {
    pub id: String,
    /// "model"
    pub object: String,
    pub created: u64,
    pub owned_by: String,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct ModelList {
    /// "list"
    pub object: String,
    pub data: Vec<ModelCard>,
}

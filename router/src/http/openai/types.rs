//! OpenAI-compatible request and response bodies (`/v1/completions`,
//! `/v1/chat/completions`, `/v1/models`). Every request field is honoured or
//! rejected: an unknown field is a 400 naming it (`OpenAiJson` checks bodies
//! against `FIELDS`), never silently ignored.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use super::engine_fields::EngineFields;
use crate::grammar::ResponseFormat;
use crate::request::null_default;
use crate::tools::{Tool, ToolChoice};

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
#[serde(deny_unknown_fields)]
pub struct StreamOptions {
    /// Send one last chunk with `usage` (and no choices) before `[DONE]`.
    #[serde(default, deserialize_with = "null_default")]
    pub include_usage: bool,
}

/// Fields both OpenAI routes share.
#[derive(Debug, Clone, Default, Deserialize, ToSchema)]
pub struct SamplingParams {
    /// The base model's name or a LoRA adapter's (with `--enable-lora`; an unknown
    /// name is a 404 then). Without `--enable-lora` any name is accepted and echoed back.
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
    /// The end user: the tenant that `--max-running-per-tenant` caps.
    pub user: Option<String>,
    /// Extension (vLLM): generate past EOS until `max_tokens`.
    #[serde(default, deserialize_with = "null_default")]
    pub ignore_eos: bool,
    /// Extension (vLLM): EOS, `stop_token_ids` and `stop` cannot end the output before this many tokens.
    pub min_tokens: Option<i64>,
    /// Extension (vLLM): token ids that end the output like EOS (the token is kept in the output).
    pub stop_token_ids: Option<Vec<i64>>,
    /// Token id (as a string) -> bias in [-100, 100] added to its logit before sampling.
    pub logit_bias: Option<BTreeMap<String, f32>>,
    /// Extension (vLLM): scheduling priority, lower first (default 0).
    pub priority: Option<i64>,
    /// The fields vLLM's and SGLang's servers add (their routers send them with every request).
    #[serde(flatten)]
    pub engine: EngineFields,
}

/// Every field `SamplingParams` reads itself (`ENGINE_FIELDS` come on top) (the shared part of both request bodies).
pub const SAMPLING_FIELDS: &[&str] = &[
    "model",
    "max_tokens",
    "temperature",
    "top_p",
    "n",
    "stream",
    "stream_options",
    "stop",
    "presence_penalty",
    "frequency_penalty",
    "seed",
    "response_format",
    "top_k",
    "min_p",
    "repetition_penalty",
    "user",
    "ignore_eos",
    "min_tokens",
    "stop_token_ids",
    "logit_bias",
    "priority",
];

/// An OpenAI request body: the fields it accepts, for `OpenAiJson`'s
/// unknown-field check (a unit test holds them equal to the OpenAPI schema).
pub trait OpenAiBody {
    /// The route's own fields; `SAMPLING_FIELDS` come on top.
    const FIELDS: &'static [&'static str];
}

impl OpenAiBody for CompletionRequest {
    const FIELDS: &'static [&'static str] =
        &["prompt", "logprobs", "echo", "prompt_logprobs", "suffix", "best_of", "json_schema"];
}

impl OpenAiBody for ChatCompletionRequest {
    const FIELDS: &'static [&'static str] = &[
        "messages",
        "max_completion_tokens",
        "logprobs",
        "top_logprobs",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "chat_template_kwargs",
        "continue_final_message",
        "add_generation_prompt",
        "separate_reasoning",
        "stream_reasoning",
        "include_reasoning",
        "reasoning_effort",
        "echo",
        "functions",
        "function_call",
        "service_tier",
        "verbosity",
        "metadata",
        "modalities",
    ];
}

/// `/v1/completions`' prompt: text, texts, token ids, or lists of token ids
/// (several prompts), as OpenAI's and vLLM's.
#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(untagged)]
pub enum Prompt {
    Text(String),
    Texts(Vec<String>),
    Ids(Vec<u32>),
    IdLists(Vec<Vec<u32>>),
}

/// One prompt of a request.
#[derive(Debug, Clone)]
pub enum PromptInput {
    Text(String),
    Ids(Vec<u32>),
}

impl Prompt {
    pub fn into_inputs(self) -> Vec<PromptInput> {
        match self {
            Prompt::Text(t) => vec![PromptInput::Text(t)],
            Prompt::Texts(v) => v.into_iter().map(PromptInput::Text).collect(),
            Prompt::Ids(ids) => vec![PromptInput::Ids(ids)],
            Prompt::IdLists(v) => v.into_iter().map(PromptInput::Ids).collect(),
        }
    }
}

#[derive(Debug, Clone, Deserialize, ToSchema)]
pub struct CompletionRequest {
    /// A prompt, a list of prompts, a list of token ids, or a list of lists of token ids.
    pub prompt: Prompt,
    #[serde(flatten)]
    pub sampling: SamplingParams,
    /// Return logprobs of the chosen tokens and of the `logprobs` most likely ones.
    pub logprobs: Option<u32>,
    /// Prepend the prompt to the completion.
    #[serde(default, deserialize_with = "null_default")]
    pub echo: bool,
    /// Extension (vLLM): return the logprob of each prompt token in `choices[].prompt_logprobs`
    /// (`null` for the first) with this many alternatives, cached prefix or not.
    pub prompt_logprobs: Option<u32>,
    /// Only `null` or `""`: no fill-in-the-middle.
    pub suffix: Option<String>,
    /// Only `null` or equal to `n`: every generated choice is returned.
    pub best_of: Option<u32>,
    /// Extension (SGLang): a JSON schema (as a string) the output follows.
    #[schema(value_type = Option<Object>)]
    pub json_schema: Option<serde_json::Value>,
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

/// Roles a chat message may have (OpenAI's set); anything else is a 400.
pub const ROLES: &[&str] = &["system", "developer", "user", "assistant", "tool"];

#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ChatMessage {
    /// One of `ROLES`; "developer" is rendered as "system".
    pub role: String,
    pub content: Option<MessageContent>,
    pub name: Option<String>,
    pub tool_calls: Option<serde_json::Value>,
    pub tool_call_id: Option<String>,
}

impl ChatMessage {
    /// A message of plain text (what the Responses and Messages routes build their history from).
    pub fn text(role: &str, content: String) -> Self {
        Self {
            role: role.into(),
            content: Some(MessageContent::Text(content)),
            name: None,
            tool_calls: None,
            tool_call_id: None,
        }
    }
}

#[derive(Debug, Clone, Default, Deserialize, ToSchema)]
pub struct ChatCompletionRequest {
    pub messages: Vec<ChatMessage>,
    #[serde(flatten)]
    pub sampling: SamplingParams,
    /// Newer name of `max_tokens`; both given and different is a 400.
    pub max_completion_tokens: Option<i64>,
    /// Return logprobs of the chosen tokens.
    pub logprobs: Option<bool>,
    /// With `logprobs`: this many alternatives per token.
    pub top_logprobs: Option<u32>,
    /// Function tools: passed to the chat template, and calls to them parsed
    /// from the reply into `message.tool_calls` (format: `--tool-call-parser`).
    pub tools: Option<Vec<Tool>>,
    /// "auto" (default with tools): calls parsed from free text; "none": not parsed;
    /// "required" or `{"type": "function", "function": {"name": ...}}`: forced by a grammar.
    pub tool_choice: Option<ToolChoice>,
    /// More than one call per reply (default true).
    pub parallel_tool_calls: Option<bool>,
    /// Extra variables for the chat template (vLLM's extension).
    pub chat_template_kwargs: Option<serde_json::Map<String, serde_json::Value>>,
    // The fields vLLM's and SGLang's chat servers add (their routers send most
    // of them with every request); what each does: http/chat/engine_chat.rs.
    /// Render the template without closing the last (assistant) message, which the reply continues.
    pub continue_final_message: Option<bool>,
    /// Open the assistant's turn after the messages (default true; false with `continue_final_message`).
    pub add_generation_prompt: Option<bool>,
    /// SGLang, with --reasoning-parser: reasoning in `reasoning_content` (default true) or left in `content`.
    pub separate_reasoning: Option<bool>,
    /// SGLang: stream the reasoning as it comes (default true), or in one delta when it ends.
    pub stream_reasoning: Option<bool>,
    /// vLLM: return the reasoning (default true); false drops it.
    pub include_reasoning: Option<bool>,
    /// OpenAI: passed to the chat template as `reasoning_effort`.
    pub reasoning_effort: Option<String>,
    /// vLLM: only `false` (the reply is not prefixed with the last message).
    pub echo: Option<bool>,
    /// OpenAI's deprecated functions: only `null` (use `tools`).
    #[schema(value_type = Option<Object>)]
    pub functions: Option<serde_json::Value>,
    /// Only `null` (use `tool_choice`).
    #[schema(value_type = Option<Object>)]
    pub function_call: Option<serde_json::Value>,
    /// OpenAI: only `null`, "auto" or "default".
    pub service_tier: Option<String>,
    /// OpenAI: only `null` or "medium".
    pub verbosity: Option<String>,
    /// OpenAI: only `null` (nothing is stored).
    #[schema(value_type = Option<Object>)]
    pub metadata: Option<serde_json::Value>,
    /// OpenAI: only `null` or `["text"]`.
    pub modalities: Option<Vec<String>>,
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
    /// With `echo`, the prompt's tokens first.
    pub tokens: Vec<String>,
    /// `null` for the first prompt token, which nothing predicts.
    pub token_logprobs: Vec<Option<f32>>,
    /// The `logprobs` most likely tokens at each position; `null` for the first prompt token.
    pub top_logprobs: Vec<Option<serde_json::Map<String, serde_json::Value>>>,
    /// Character offset of each token in the choice's text.
    pub text_offset: Vec<usize>,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct CompletionChoice {
    pub index: u32,
    pub text: String,
    pub logprobs: Option<CompletionLogprobs>,
    /// With `prompt_logprobs`: per prompt token `{token id: {logprob, rank, decoded_token}}` (the token,
    /// then its alternatives), `null` first.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prompt_logprobs: Option<Vec<Option<serde_json::Value>>>,
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
    /// `null` when the reply is only tool calls.
    pub content: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ToolCallOut>,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct FunctionCallOut {
    pub name: String,
    /// The arguments as JSON text.
    pub arguments: String,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct ToolCallOut {
    /// `call_...`
    pub id: String,
    /// "function"
    #[serde(rename = "type")]
    pub kind: String,
    pub function: FunctionCallOut,
}

/// A tool call in a stream chunk, as OpenAI streams them: the first delta
/// of a call has its `id`, `type` and `function.name` with `arguments` "";
/// the next ones only `index` and a fragment of `function.arguments`.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct ToolCallDelta {
    pub index: u32,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    /// "function", on the first delta
    #[serde(rename = "type", skip_serializing_if = "Option::is_none")]
    pub kind: Option<String>,
    pub function: FunctionCallDelta,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct FunctionCallDelta {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    pub arguments: String,
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
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ToolCallDelta>,
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
    /// Where the weights come from: the model directory, or the adapter's directory.
    pub root: String,
    /// The base model an adapter applies to; null for the base model itself.
    pub parent: Option<String>,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct ModelList {
    /// "list"
    pub object: String,
    pub data: Vec<ModelCard>,
}

//! TGI-compatible request and response bodies.

use serde::{Deserialize, Deserializer, Serialize};
use utoipa::ToSchema;

use crate::grammar::GrammarParam;

/// Clients (huggingface_hub, text-generation) send `null` for unset
/// booleans and lists; treat it as the default rather than a type error.
pub fn null_default<'de, D, T>(d: D) -> Result<T, D::Error>
where
    D: Deserializer<'de>,
    T: Default + Deserialize<'de>,
{
    Ok(Option::<T>::deserialize(d)?.unwrap_or_default())
}

#[derive(Debug, Clone, Deserialize, ToSchema)]
pub struct GenerateRequest {
    #[schema(example = "The capital of France is")]
    pub inputs: String,
    #[serde(default, deserialize_with = "null_default")]
    pub parameters: GenerateParameters,
}

/// `POST /`: a `GenerateRequest` that says itself whether to stream.
#[derive(Debug, Clone, Deserialize, ToSchema)]
pub struct CompatGenerateRequest {
    pub inputs: String,
    #[serde(default, deserialize_with = "null_default")]
    pub parameters: GenerateParameters,
    #[serde(default, deserialize_with = "null_default")]
    pub stream: bool,
}

#[derive(Debug, Clone, Default, Deserialize, ToSchema)]
pub struct GenerateParameters {
    /// Generate this many sequences (sampling) and return the one with the
    /// highest cumulative logprob; the others are in `details.best_of_sequences`.
    pub best_of: Option<u32>,
    pub temperature: Option<f32>,
    pub repetition_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    pub presence_penalty: Option<f32>,
    pub top_k: Option<i64>,
    pub top_p: Option<f32>,
    pub typical_p: Option<f32>,
    pub min_p: Option<f32>,
    #[serde(default, deserialize_with = "null_default")]
    pub do_sample: bool,
    pub max_new_tokens: Option<i64>,
    pub return_full_text: Option<bool>,
    #[serde(default, deserialize_with = "null_default")]
    pub stop: Vec<String>,
    /// Keep only the last `truncate` prompt tokens.
    pub truncate: Option<i64>,
    #[serde(default, deserialize_with = "null_default")]
    pub watermark: bool,
    #[serde(default, deserialize_with = "null_default")]
    pub details: bool,
    /// Return the prompt tokens with their logprobs in `details.prefill`.
    #[serde(default, deserialize_with = "null_default")]
    pub decoder_input_details: bool,
    pub seed: Option<u64>,
    /// Alternatives returned with each generated token.
    pub top_n_tokens: Option<i64>,
    #[serde(default, deserialize_with = "null_default")]
    pub ignore_eos_token: bool,
    /// Constrained decoding: a JSON schema or a regex.
    pub grammar: Option<GrammarParam>,
    /// Extension (vLLM): scheduling priority, lower first (default 0).
    /// Orders admission and preemption; waiting raises it (`--priority-aging-ms`).
    pub priority: Option<i64>,
    /// Extension: who the request is for (OpenAI's `user`); with
    /// `--max-running-per-tenant`, caps that tenant's running requests.
    pub user: Option<String>,
    /// Set by the OpenAI routes only (vLLM's extra fields); not part of TGI's API.
    #[serde(skip)]
    pub extras: SamplingExtras,
}

/// Controls the OpenAI routes accept and TGI's `parameters` do not.
#[derive(Debug, Clone, Default)]
pub struct SamplingExtras {
    /// EOS and `stop_token_ids` cannot end the output before this many tokens.
    pub min_new_tokens: Option<i64>,
    /// Tokens that end the output like EOS.
    pub stop_token_ids: Vec<i64>,
    /// (token id as the client wrote it, bias); checked in validation.
    pub logit_bias: Vec<(String, f32)>,
    /// A Lark grammar the router built (forced tool calls); exclusive with `grammar`.
    pub lark: Option<String>,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct Token {
    pub id: u32,
    pub text: String,
    pub logprob: f32,
    pub special: bool,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct PrefillToken {
    pub id: u32,
    pub text: String,
    /// `null` for the first token, which has no context to be predicted from.
    pub logprob: Option<f32>,
}

#[derive(Debug, Clone, Copy, Serialize, PartialEq, Eq, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    Length,
    EosToken,
    StopSequence,
}

impl FinishReason {
    pub fn as_str(&self) -> &'static str {
        match self {
            FinishReason::Length => "length",
            FinishReason::EosToken => "eos_token",
            FinishReason::StopSequence => "stop_sequence",
        }
    }

    /// OpenAI's names: a stop sequence and EOS are both "stop".
    pub fn openai(&self) -> &'static str {
        match self {
            FinishReason::Length => "length",
            FinishReason::EosToken | FinishReason::StopSequence => "stop",
        }
    }
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct BestOfSequence {
    pub generated_text: String,
    pub finish_reason: FinishReason,
    pub generated_tokens: u32,
    pub seed: Option<u64>,
    pub prefill: Vec<PrefillToken>,
    pub tokens: Vec<Token>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub top_tokens: Vec<Vec<Token>>,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct Details {
    pub finish_reason: FinishReason,
    pub generated_tokens: u32,
    pub seed: Option<u64>,
    pub prefill: Vec<PrefillToken>,
    pub tokens: Vec<Token>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub top_tokens: Vec<Vec<Token>>,
    /// The other `best_of` candidates.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub best_of_sequences: Option<Vec<BestOfSequence>>,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct GenerateResponse {
    pub generated_text: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub details: Option<Details>,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct StreamDetails {
    pub finish_reason: FinishReason,
    pub generated_tokens: u32,
    pub seed: Option<u64>,
    pub input_length: u32,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct StreamResponse {
    pub index: u32,
    pub token: Token,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub top_tokens: Vec<Token>,
    pub generated_text: Option<String>,
    pub details: Option<StreamDetails>,
}

/// `POST /tokenize`: the same body as `/generate`; only `inputs` (and
/// `parameters.truncate`) matter.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct SimpleToken {
    pub id: u32,
    pub text: String,
    /// Byte offsets of the token in `inputs`.
    pub start: usize,
    pub stop: usize,
}

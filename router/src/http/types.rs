//! TGI-compatible request and response bodies.

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Deserialize)]
pub struct GenerateRequest {
    pub inputs: String,
    #[serde(default)]
    pub parameters: GenerateParameters,
}

#[derive(Debug, Clone, Default, Deserialize)]
pub struct GenerateParameters {
    pub best_of: Option<u32>,
    pub temperature: Option<f32>,
    pub repetition_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    pub presence_penalty: Option<f32>,
    pub top_k: Option<i64>,
    pub top_p: Option<f32>,
    pub typical_p: Option<f32>,
    pub min_p: Option<f32>,
    #[serde(default)]
    pub do_sample: bool,
    pub max_new_tokens: Option<i64>,
    pub return_full_text: Option<bool>,
    #[serde(default)]
    pub stop: Vec<String>,
    pub truncate: Option<i64>,
    #[serde(default)]
    pub watermark: bool,
    #[serde(default)]
    pub details: bool,
    #[serde(default)]
    pub decoder_input_details: bool,
    pub seed: Option<u64>,
    pub top_n_tokens: Option<i64>,
    #[serde(default)]
    pub ignore_eos_token: bool,
}

#[derive(Debug, Clone, Serialize)]
pub struct Token {
    pub id: u32,
    pub text: String,
    pub logprob: f32,
    pub special: bool,
}

#[derive(Debug, Clone, Serialize)]
pub struct PrefillToken {
    pub id: u32,
    pub text: String,
    /// `null` for the first token, which has no context to be predicted from.
    pub logprob: Option<f32>,
}

#[derive(Debug, Clone, Copy, Serialize, PartialEq, Eq)]
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
}

#[derive(Debug, Clone, Serialize)]
pub struct Details {
    pub finish_reason: FinishReason,
    pub generated_tokens: u32,
    pub seed: Option<u64>,
    pub prefill: Vec<PrefillToken>,
    pub tokens: Vec<Token>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub top_tokens: Vec<Vec<Token>>,
}

#[derive(Debug, Clone, Serialize)]
pub struct GenerateResponse {
    pub generated_text: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub details: Option<Details>,
}

#[derive(Debug, Clone, Serialize)]
pub struct StreamDetails {
    pub finish_reason: FinishReason,
    pub generated_tokens: u32,
    pub seed: Option<u64>,
    pub input_length: u32,
}

#[derive(Debug, Clone, Serialize)]
pub struct StreamResponse {
    pub index: u32,
    pub token: Token,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub top_tokens: Vec<Token>,
    pub generated_text: Option<String>,
    pub details: Option<StreamDetails>,
}

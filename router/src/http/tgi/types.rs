//! TGI-compatible request and response bodies.

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use crate::request::{null_default, GenerateParameters};
use crate::response::{FinishReason, PrefillToken, Token};

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

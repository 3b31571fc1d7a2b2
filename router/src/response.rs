//! What a generation returns, in TGI's shapes: its tokens and why it ended.
//! The per-request stream (`stream.rs`) produces them and every API reports
//! or converts them, so they live below the HTTP layer.

use serde::Serialize;
use utoipa::ToSchema;

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
    /// Its rank in the vocabulary at its position (1: the most likely); OpenAI's routes report it.
    #[serde(skip)]
    pub rank: Option<u32>,
    /// The most likely tokens at its position, when asked (OpenAI's routes).
    #[serde(skip)]
    pub top: Vec<Token>,
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

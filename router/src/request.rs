//! A generation request as the API layer hands it on and as validation passes
//! it to the queue and the scheduler. Every route (TGI, OpenAI, Responses,
//! Messages) translates its body into `GenerateParameters`; validation checks
//! them into a `ValidRequest`. Both live below the HTTP layer so that
//! validation, the queue and the scheduler name them without importing it.

use serde::{Deserialize, Deserializer};
use utoipa::ToSchema;

use crate::adapter::AdapterRef;
use crate::grammar::GrammarParam;
use crate::proto::pb;

/// Clients (huggingface_hub, text-generation) send `null` for unset
/// booleans and lists; treat it as the default rather than a type error.
pub fn null_default<'de, D, T>(d: D) -> Result<T, D::Error>
where
    D: Deserializer<'de>,
    T: Default + Deserialize<'de>,
{
    Ok(Option::<T>::deserialize(d)?.unwrap_or_default())
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
    /// The LoRA adapter to generate with, by name (TGI's `adapter_id`); unset: the base model.
    pub adapter_id: Option<String>,
    /// Set by the OpenAI routes only (vLLM's extra fields); not part of TGI's API.
    #[serde(skip)]
    pub extras: SamplingExtras,
    /// The adapter each route resolved from its own field (`model`, `adapter_id`).
    #[serde(skip)]
    pub adapter: Option<AdapterRef>,
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
    /// With `decoder_input_details`: alternatives at each prompt position
    /// (`logprobs` with `echo`, vLLM's `prompt_logprobs`).
    pub prompt_top_n: u32,
    /// How the stream writes the generated text (special tokens, matched stops).
    pub text: TextOptions,
}

/// How a request's text is written: the stream side of vLLM's and SGLang's
/// `skip_special_tokens` and `no_stop_trim` / `include_stop_str_in_output`.
/// The default is what every route does unless told otherwise.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TextOptions {
    /// Special tokens (chat markup, EOS) written into the text instead of
    /// left out (`skip_special_tokens: false`).
    pub show_special_tokens: bool,
    /// The matched stop string, or the EOS / stop token that ended the
    /// sequence, kept at the end of the text (`no_stop_trim: true`).
    pub keep_stop: bool,
}

/// A request that passed validation: prompt tokenized, limits checked,
/// sampling parameters in the shard's form.
#[derive(Debug, Clone)]
pub struct ValidRequest {
    pub inputs: String,
    pub input_ids: Vec<u32>,
    pub parameters: pb::NextTokenChooserParameters,
    pub max_new_tokens: u32,
    pub ignore_eos: bool,
    /// EOS and `stop_token_ids` are held back until this many tokens are out.
    pub min_new_tokens: u32,
    pub stop_token_ids: Vec<u32>,
    pub stop_sequences: Vec<String>,
    pub top_n_tokens: u32,
    /// Every prompt token's logprob (the first has none), gap-free whatever was cached.
    pub decoder_input_details: bool,
    /// With it: alternatives at each prompt position.
    pub prompt_top_n: u32,
    pub seed: Option<u64>,
    /// Constrained decoding, checked here (schema is an object, regex compiles).
    pub grammar: Option<pb::Grammar>,
    /// Scheduling priority: lower values are admitted first and preempted
    /// last (as vLLM's); 0 by default.
    pub priority: i32,
    /// Who sent it (`user`), for the per-tenant cap; None: not capped.
    pub tenant: Option<String>,
    /// The LoRA adapter it runs with; None: the base model.
    pub adapter: Option<AdapterRef>,
}

//! OpenAI-compatible routes. Each request is translated into the TGI
//! parameters the rest of the router speaks, so validation, limits and
//! errors are the same on every route.

pub mod adapters;
pub mod chat;
pub mod completions;
pub mod engine_fields;
mod logprobs;
pub mod render;
mod scoring;
pub mod structured_outputs;
pub mod types;

use axum::response::sse::Event;

use super::sse::{json_event, Framing};
use crate::error::RouterError;
use crate::request::{GenerateParameters, SamplingExtras};
use types::SamplingParams;

fn error_event(e: &RouterError) -> Event {
    json_event(&e.openai_body())
}

/// OpenAI's streams: errors in its shape, `data: [DONE]` at the end (Chat
/// and Completions; the Responses API has no `[DONE]`).
pub const OPENAI: Framing = Framing { error: error_event, done: true };

fn invalid(msg: impl Into<String>) -> RouterError {
    RouterError::Validation(msg.into())
}

impl SamplingParams {
    /// OpenAI semantics on top of TGI's parameters: sampling by default
    /// (temperature 1), `temperature: 0` is greedy whatever the other knobs say.
    pub fn to_parameters(
        &self,
        max_tokens: Option<i64>,
        top_n_tokens: Option<u32>,
    ) -> Result<GenerateParameters, RouterError> {
        if let Some(t) = self.temperature {
            if !t.is_finite() || !(0.0..=2.0).contains(&t) {
                return Err(invalid(format!("`temperature` must be in [0, 2], got {t}")));
            }
        }
        if let Some(m) = max_tokens {
            if m <= 0 {
                return Err(invalid(format!("`max_tokens` must be strictly positive, got {m}")));
            }
        }
        self.engine.check()?;
        let greedy = self.temperature == Some(0.0);
        let sample = |v| if greedy { None } else { v };
        Ok(GenerateParameters {
            temperature: sample(self.temperature),
            top_p: sample(self.top_p),
            top_k: if greedy { None } else { self.top_k },
            min_p: sample(self.min_p),
            do_sample: !greedy,
            max_new_tokens: max_tokens,
            stop: self.stop.clone().map(|s| s.into_vec()).unwrap_or_default(),
            seed: self.engine.seed(self.seed)?,
            presence_penalty: self.presence_penalty,
            frequency_penalty: self.frequency_penalty,
            repetition_penalty: self.repetition_penalty,
            top_n_tokens: top_n_tokens.map(i64::from),
            grammar: self.engine.grammar(self.response_format.as_ref())?,
            ignore_eos_token: self.ignore_eos,
            priority: self.priority,
            user: self.user.clone().or_else(|| self.engine.safety_identifier.clone()),
            extras: SamplingExtras {
                min_new_tokens: self.min_tokens,
                stop_token_ids: self.stop_token_ids.clone().unwrap_or_default(),
                logit_bias: self.logit_bias.iter().flatten().map(|(k, v)| (k.clone(), *v)).collect(),
                lark: None,
                prompt_top_n: 0,
                text: self.engine.text_options()?,
            },
            ..Default::default()
        })
    }

    pub fn include_usage(&self) -> bool {
        self.stream_options.as_ref().is_some_and(|o| o.include_usage)
    }
}

#[cfg(test)]
mod tests {
    use super::types::{SamplingParams, StringOrList};

    #[test]
    fn temperature_zero_is_greedy_and_drops_sampling_knobs() {
        let s = SamplingParams { temperature: Some(0.0), top_p: Some(0.5), top_k: Some(3), ..Default::default() };
        let p = s.to_parameters(Some(5), None).unwrap();
        assert!(!p.do_sample);
        assert_eq!((p.temperature, p.top_p, p.top_k), (None, None, None));
        assert_eq!(p.max_new_tokens, Some(5));
    }

    #[test]
    fn default_is_sampling_and_top_p_one_is_fine() {
        let s = SamplingParams { top_p: Some(1.0), stop: Some(StringOrList::One("\n".into())), ..Default::default() };
        let p = s.to_parameters(None, Some(2)).unwrap();
        assert!(p.do_sample);
        assert_eq!(p.top_p, Some(1.0));
        assert_eq!(p.stop, vec!["\n".to_string()]);
        assert_eq!(p.top_n_tokens, Some(2));
    }

    #[test]
    fn vllm_extras_reach_the_parameters() {
        let s = SamplingParams {
            ignore_eos: true,
            min_tokens: Some(3),
            stop_token_ids: Some(vec![7, 9]),
            logit_bias: Some([("504".to_string(), 100.0)].into_iter().collect()),
            top_k: Some(5),
            min_p: Some(0.1),
            repetition_penalty: Some(1.2),
            ..Default::default()
        };
        let p = s.to_parameters(Some(8), None).unwrap();
        assert!(p.ignore_eos_token);
        assert_eq!(p.extras.min_new_tokens, Some(3));
        assert_eq!(p.extras.stop_token_ids, vec![7, 9]);
        assert_eq!(p.extras.logit_bias, vec![("504".to_string(), 100.0)]);
        assert_eq!((p.top_k, p.min_p, p.repetition_penalty), (Some(5), Some(0.1), Some(1.2)));
    }

    #[test]
    fn out_of_range_values_are_rejected() {
        for t in [-0.1, 2.5, f32::NAN] {
            let s = SamplingParams { temperature: Some(t), ..Default::default() };
            assert!(s.to_parameters(None, None).is_err());
        }
        assert!(SamplingParams::default().to_parameters(Some(0), None).is_err());
    }
}

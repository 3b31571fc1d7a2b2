//! What `/v1/completions` is asked about its prompt, as evaluation harnesses
//! ask it (lm-evaluation-harness computes every loglikelihood this way):
//! `echo` with `logprobs: k` (the prompt's tokens, each with its logprob
//! and k alternatives, before the completion's; the first token's are
//! `null`), vLLM's `prompt_logprobs: k`, and `max_tokens: 0` with either
//! (the prompt scored, nothing generated). The router then gathers every
//! prompt position's logprob, cached prefix or not (scheduler/prompt_logprobs.rs).

use super::types::CompletionRequest;
use crate::error::RouterError;
use crate::response::PrefillToken;

fn invalid(msg: impl Into<String>) -> RouterError {
    RouterError::Validation(msg.into())
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Scoring {
    /// Every prompt token's logprob is needed (`echo` + `logprobs`, or `prompt_logprobs`).
    pub prompt: bool,
    /// Alternatives per prompt position: the larger of `logprobs` (with `echo`) and `prompt_logprobs`.
    pub top_n: u32,
    /// `max_tokens: 0`: one token is generated for the prompt's sake and left out of the reply.
    pub score_only: bool,
}

impl Scoring {
    /// The `max_tokens` to generate with: 1 where the reply leaves it out.
    pub fn max_tokens(&self, asked: Option<i64>) -> Option<i64> {
        if self.score_only {
            Some(1)
        } else {
            asked
        }
    }
}

/// What the request asks of its prompt; refuses what cannot be served.
pub fn scoring(req: &CompletionRequest) -> Result<Scoring, RouterError> {
    let echo_logprobs = req.echo.then_some(req.logprobs).flatten();
    if req.sampling.stream && req.prompt_logprobs.is_some() {
        return Err(invalid("`prompt_logprobs` is not supported with `stream`"));
    }
    let score_only = req.sampling.max_tokens == Some(0);
    if score_only && !req.echo && req.prompt_logprobs.is_none() {
        return Err(invalid(
            "`max_tokens` must be strictly positive, or 0 with `echo` or `prompt_logprobs` (the prompt scored, nothing generated)",
        ));
    }
    let prompt = echo_logprobs.is_some() || req.prompt_logprobs.is_some();
    let top_n = echo_logprobs.unwrap_or(0).max(req.prompt_logprobs.unwrap_or(0));
    Ok(Scoring { prompt, top_n, score_only })
}

/// vLLM's `prompt_logprobs`: per prompt token `{"<id>": {logprob, rank, decoded_token}}`,
/// then its `k` alternatives (rank 1 first) where they are other tokens; `null` for the
/// first token, which nothing predicts.
pub fn vllm_prompt_logprobs(prefill: &[PrefillToken], k: u32) -> Vec<Option<serde_json::Value>> {
    prefill
        .iter()
        .map(|t| {
            let lp = t.logprob?;
            let mut m = serde_json::Map::new();
            let entry = |logprob: f32, rank: u32, text: &str| {
                serde_json::json!({ "logprob": logprob, "rank": rank, "decoded_token": text })
            };
            m.insert(t.id.to_string(), entry(lp, t.rank.unwrap_or(0), &t.text));
            for (i, a) in t.top.iter().take(k as usize).enumerate() {
                m.entry(a.id.to_string()).or_insert_with(|| entry(a.logprob, i as u32 + 1, &a.text));
            }
            Some(serde_json::Value::Object(m))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::response::Token;

    fn req(body: serde_json::Value) -> CompletionRequest {
        serde_json::from_value(body).unwrap()
    }

    #[test]
    fn what_each_field_asks() {
        let s =
            scoring(&req(serde_json::json!({"prompt": "a", "echo": true, "logprobs": 3, "max_tokens": 0}))).unwrap();
        assert_eq!(s, Scoring { prompt: true, top_n: 3, score_only: true });
        assert_eq!(s.max_tokens(Some(0)), Some(1));
        let s = scoring(&req(serde_json::json!({"prompt": "a", "echo": true, "max_tokens": 5}))).unwrap();
        assert_eq!((s.prompt, s.max_tokens(Some(5))), (false, Some(5)), "echo alone needs no logprobs");
        let s = scoring(&req(serde_json::json!({"prompt": "a", "logprobs": 1, "prompt_logprobs": 4}))).unwrap();
        assert_eq!((s.prompt, s.top_n), (true, 4), "logprobs without echo are the completion's");
        let e = scoring(&req(serde_json::json!({"prompt": "a", "max_tokens": 0}))).unwrap_err();
        assert_eq!(e.param().as_deref(), Some("max_tokens"));
        let e = scoring(&req(serde_json::json!({"prompt": "a", "prompt_logprobs": 0, "stream": true}))).unwrap_err();
        assert_eq!(e.param().as_deref(), Some("prompt_logprobs"));
    }

    #[test]
    fn vllm_shape_lists_the_token_then_other_alternatives() {
        let tok = |id: u32, lp: f32| Token { id, text: format!("t{id}"), logprob: lp, special: false };
        let prefill = vec![
            PrefillToken { id: 5, text: "t5".into(), logprob: None, rank: None, top: vec![] },
            PrefillToken {
                id: 6,
                text: "t6".into(),
                logprob: Some(-0.5),
                rank: Some(1),
                top: vec![tok(6, -0.5), tok(9, -1.5)],
            },
        ];
        let v = vllm_prompt_logprobs(&prefill, 2);
        assert!(v[0].is_none());
        let m = v[1].as_ref().unwrap();
        assert_eq!(m["6"], serde_json::json!({"logprob": -0.5, "rank": 1, "decoded_token": "t6"}));
        assert_eq!(m["9"]["rank"], 2);
        assert_eq!(m.as_object().unwrap().len(), 2);
        assert_eq!(vllm_prompt_logprobs(&prefill, 0)[1].as_ref().unwrap().as_object().unwrap().len(), 1);
    }
}

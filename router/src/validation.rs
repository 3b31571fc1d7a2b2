//! Turns an HTTP request into a `ValidRequest`: parameters checked, prompt
//! tokenized and measured against the token limits. Every rejection is a 422.
//! TGI's rule that any sampling knob implies sampling is applied here, the
//! one place: the shard samples exactly when `do_sample` says so.

use std::sync::Arc;

use tokenizers::Tokenizer;

use crate::error::RouterError;
use crate::kv::{lifetime_blocks, too_large};
use crate::proto::pb;
use crate::request::{GenerateParameters, ValidRequest};

#[derive(Debug, Clone)]
pub struct Limits {
    pub max_input_tokens: u32,
    pub max_total_tokens: u32,
    pub max_stop_sequences: u32,
    pub max_top_n_tokens: u32,
    pub default_max_new_tokens: u32,
    /// Largest `n` / `best_of`.
    pub max_best_of: u32,
    /// The model's vocabulary (from the shard): token ids must be below it.
    pub vocab_size: u32,
    /// KV blocks in the pool, tokens per block, and the speculative slots
    /// each decode step takes: a request must fit the pool alone.
    pub kv_blocks: u32,
    pub block_size: u32,
    pub speculate: u32,
}

/// Most `stop_token_ids` and `logit_bias` entries in one request (OpenAI
/// caps `logit_bias` at 300 tokens); both are sent to the shard every step.
pub const MAX_TOKEN_ID_LIST: usize = 300;
/// `logit_bias` values are in [-BIAS_RANGE, BIAS_RANGE], as OpenAI's.
pub const BIAS_RANGE: f32 = 100.0;

#[derive(Clone)]
pub struct Validation {
    tokenizer: Arc<Tokenizer>,
    limits: Limits,
}

fn invalid(msg: impl Into<String>) -> RouterError {
    RouterError::Validation(msg.into())
}

fn check_float(name: &str, v: Option<f32>, ok: impl Fn(f32) -> bool, rule: &str) -> Result<(), RouterError> {
    match v {
        Some(x) if !x.is_finite() || !ok(x) => Err(invalid(format!("`{name}` must be {rule}, got {x}"))),
        _ => Ok(()),
    }
}

/// The request's grammar for the shard: TGI's `grammar` / `response_format`,
/// or the Lark grammar the router built for forced tool calls, not both.
fn check_grammar(p: &GenerateParameters) -> Result<Option<pb::Grammar>, RouterError> {
    match (&p.grammar, &p.extras.lark) {
        (Some(_), Some(_)) => Err(invalid("`response_format` cannot be combined with a forced `tool_choice`")),
        (_, Some(lark)) => Ok(Some(pb::Grammar { r#type: pb::GrammarType::Lark as i32, value: lark.clone() })),
        (g, None) => g.as_ref().map(crate::grammar::validate).transpose(),
    }
}

/// `min_tokens`: at most `max_new_tokens`.
fn check_min_new_tokens(p: &GenerateParameters, max_new_tokens: u32) -> Result<u32, RouterError> {
    match p.extras.min_new_tokens {
        None => Ok(0),
        Some(m) if m < 0 => Err(invalid(format!("`min_tokens` must be >= 0, got {m}"))),
        Some(m) if m > max_new_tokens as i64 => {
            Err(invalid(format!("`min_tokens` ({m}) must be <= `max_tokens` ({max_new_tokens})")))
        }
        Some(m) => Ok(m as u32),
    }
}

impl Validation {
    pub fn new(tokenizer: Arc<Tokenizer>, limits: Limits) -> Self {
        Self { tokenizer, limits }
    }

    pub fn tokenizer(&self) -> &Arc<Tokenizer> {
        &self.tokenizer
    }

    pub fn limits(&self) -> &Limits {
        &self.limits
    }

    /// Tokenizes on the blocking pool so long prompts never stall the HTTP workers.
    pub async fn encode(&self, text: String, add_special_tokens: bool) -> Result<tokenizers::Encoding, RouterError> {
        let tokenizer = self.tokenizer.clone();
        tokio::task::spawn_blocking(move || {
            tokenizer.encode(text, add_special_tokens).map_err(|e| invalid(format!("tokenization failed: {e}")))
        })
        .await
        .map_err(|e| invalid(format!("tokenization task failed: {e}")))?
    }

    pub async fn tokenize(&self, text: String, add_special_tokens: bool) -> Result<Vec<u32>, RouterError> {
        Ok(self.encode(text, add_special_tokens).await?.get_ids().to_vec())
    }

    /// `add_special_tokens` is false for rendered chat prompts: the template
    /// already wrote the BOS (as in TGI), a second one would change the output.
    /// `ids`: a prompt given as token ids, used as is (`inputs` is then only its text).
    pub async fn validate(
        &self,
        inputs: String,
        ids: Option<Vec<u32>>,
        p: GenerateParameters,
        add_special_tokens: bool,
    ) -> Result<ValidRequest, RouterError> {
        let mut params = self.check_parameters(&p)?;
        params.logit_bias = self.check_logit_bias(&p.extras.logit_bias)?;
        let stop_token_ids = self.check_token_ids("stop_token_ids", &p.extras.stop_token_ids)?;
        let grammar = check_grammar(&p)?;
        let input_ids = self.prompt_ids(&inputs, ids, add_special_tokens, p.truncate).await?;
        let max_new_tokens = self.max_new_tokens(&p, input_ids.len() as u32)?;
        let top_n_tokens = self.top_n_tokens(&p)?;
        let prompt_top_n = self.prompt_top_n(&p)?;
        self.check_stop_sequences(&p.stop)?;
        let min_new_tokens = check_min_new_tokens(&p, max_new_tokens)?;
        // A finished grammar allows only EOS; holding EOS back would leave no token at all.
        if grammar.is_some() && (min_new_tokens > 0 || !stop_token_ids.is_empty()) {
            return Err(invalid("`min_tokens` and `stop_token_ids` cannot be combined with `response_format`"));
        }
        let priority = match p.priority {
            None => 0,
            Some(v) => i32::try_from(v)
                .map_err(|_| invalid(format!("`priority` must be in [{}, {}], got {v}", i32::MIN, i32::MAX)))?,
        };
        Ok(ValidRequest {
            inputs,
            input_ids,
            parameters: params,
            max_new_tokens,
            ignore_eos: p.ignore_eos_token,
            min_new_tokens,
            stop_token_ids,
            stop_sequences: p.stop,
            top_n_tokens,
            decoder_input_details: p.decoder_input_details,
            prompt_top_n,
            seed: p.seed,
            grammar,
            priority,
            tenant: p.user.filter(|u| !u.is_empty()),
            adapter: p.adapter,
        })
    }

    /// The prompt's token ids (given, or tokenized from `inputs`), kept to
    /// its last `truncate` tokens, within `max_input_tokens`.
    async fn prompt_ids(
        &self,
        inputs: &str,
        ids: Option<Vec<u32>>,
        add_special_tokens: bool,
        truncate: Option<i64>,
    ) -> Result<Vec<u32>, RouterError> {
        let mut input_ids = match ids {
            Some(ids) => {
                if ids.is_empty() {
                    return Err(invalid("`prompt` must not be an empty list of token ids"));
                }
                if let Some(&bad) = ids.iter().find(|&&t| t >= self.limits.vocab_size) {
                    return Err(invalid(format!(
                        "`prompt` token id {bad} is out of the vocabulary (size {})",
                        self.limits.vocab_size
                    )));
                }
                ids
            }
            None => {
                if inputs.is_empty() {
                    return Err(invalid("`inputs` must not be empty"));
                }
                self.tokenize(inputs.to_string(), add_special_tokens).await?
            }
        };
        if input_ids.is_empty() {
            return Err(invalid("`inputs` tokenized to zero tokens"));
        }
        if let Some(t) = truncate {
            if t <= 0 {
                return Err(invalid(format!("`truncate` must be strictly positive, got {t}")));
            }
            let t = t as usize;
            if input_ids.len() > t {
                // Keep the end of the prompt, as TGI does: it is what the model continues.
                input_ids.drain(..input_ids.len() - t);
            }
        }
        let input_len = input_ids.len() as u32;
        if input_len > self.limits.max_input_tokens {
            return Err(invalid(format!(
                "`inputs` must have less than {} tokens. Given: {input_len}",
                self.limits.max_input_tokens + 1
            )));
        }
        Ok(input_ids)
    }

    /// `max_new_tokens` (the default where unset), prompt plus it within `max_total_tokens`.
    fn max_new_tokens(&self, p: &GenerateParameters, input_len: u32) -> Result<u32, RouterError> {
        let limits = &self.limits;
        let max_new_tokens = match p.max_new_tokens {
            Some(n) if n <= 0 => return Err(invalid(format!("`max_new_tokens` must be strictly positive, got {n}"))),
            Some(n) if n > u32::MAX as i64 => return Err(invalid(format!("`max_new_tokens` is too large: {n}"))),
            Some(n) => n as u32,
            None => limits.default_max_new_tokens.min(limits.max_total_tokens - input_len),
        };
        if input_len as u64 + max_new_tokens as u64 > limits.max_total_tokens as u64 {
            return Err(invalid(format!(
                "`inputs` tokens + `max_new_tokens` must be <= {}. Given: {input_len} `inputs` tokens and {max_new_tokens} `max_new_tokens`",
                limits.max_total_tokens
            )));
        }
        Ok(max_new_tokens)
    }

    fn top_n_tokens(&self, p: &GenerateParameters) -> Result<u32, RouterError> {
        match p.top_n_tokens {
            Some(n) if n < 0 || n > self.limits.max_top_n_tokens as i64 => {
                Err(invalid(format!("`top_n_tokens` must be >= 0 and <= {}. Given: {n}", self.limits.max_top_n_tokens)))
            }
            Some(n) => Ok(n as u32),
            None => Ok(0),
        }
    }

    /// Alternatives per prompt position: only with prompt logprobs, at most `max_top_n_tokens`.
    fn prompt_top_n(&self, p: &GenerateParameters) -> Result<u32, RouterError> {
        let n = p.extras.prompt_top_n;
        if n > self.limits.max_top_n_tokens {
            return Err(invalid(format!("`prompt_logprobs` must be <= {}. Given: {n}", self.limits.max_top_n_tokens)));
        }
        Ok(if p.decoder_input_details { n } else { 0 })
    }

    fn check_stop_sequences(&self, stop: &[String]) -> Result<(), RouterError> {
        if stop.len() > self.limits.max_stop_sequences as usize {
            return Err(invalid(format!(
                "`stop` supports up to {} stop sequences. Given: {}",
                self.limits.max_stop_sequences,
                stop.len()
            )));
        }
        if stop.iter().any(|s| s.is_empty()) {
            return Err(invalid("`stop` sequences must not be empty"));
        }
        Ok(())
    }

    fn check_token_ids(&self, name: &str, ids: &[i64]) -> Result<Vec<u32>, RouterError> {
        if ids.len() > MAX_TOKEN_ID_LIST {
            return Err(invalid(format!("`{name}` lists at most {MAX_TOKEN_ID_LIST} tokens. Given: {}", ids.len())));
        }
        ids.iter()
            .map(|&t| match u32::try_from(t) {
                Ok(t) if t < self.limits.vocab_size => Ok(t),
                _ => Err(invalid(format!(
                    "`{name}`: token id {t} is out of the vocabulary (size {})",
                    self.limits.vocab_size
                ))),
            })
            .collect()
    }

    /// Keys are token ids written as strings (JSON object keys), as OpenAI's.
    fn check_logit_bias(&self, bias: &[(String, f32)]) -> Result<std::collections::HashMap<u32, f32>, RouterError> {
        if bias.len() > MAX_TOKEN_ID_LIST {
            return Err(invalid(format!(
                "`logit_bias` lists at most {MAX_TOKEN_ID_LIST} tokens. Given: {}",
                bias.len()
            )));
        }
        let mut out = std::collections::HashMap::with_capacity(bias.len());
        for (key, value) in bias {
            let id = key.trim().parse::<u32>().ok().filter(|&t| t < self.limits.vocab_size).ok_or_else(|| {
                invalid(format!(
                    "`logit_bias` key {key:?} is not a token id in the vocabulary (0..{})",
                    self.limits.vocab_size
                ))
            })?;
            if !value.is_finite() || value.abs() > BIAS_RANGE {
                return Err(invalid(format!("`logit_bias` values must be in [-100, 100], got {value} for token {id}")));
            }
            out.insert(id, *value);
        }
        Ok(out)
    }

    /// `n` / `best_of`: how many sequences one request fans out into.
    /// A request (with its `n` forks) that needs more KV blocks at its
    /// longest than the whole pool could never finish: it is refused here
    /// rather than preempted and retried forever.
    pub fn check_fits_pool(&self, r: &ValidRequest, n: u32) -> Result<(), RouterError> {
        let l = &self.limits;
        let needed = lifetime_blocks(r.input_ids.len() as u32, r.max_new_tokens, l.speculate, n, l.block_size);
        if needed > l.kv_blocks as u64 {
            return Err(too_large(needed, l.kv_blocks, l.block_size));
        }
        Ok(())
    }

    pub fn check_fanout(&self, name: &str, n: u32) -> Result<(), RouterError> {
        if n == 0 {
            return Err(invalid(format!("`{name}` must be strictly positive")));
        }
        if n > self.limits.max_best_of {
            return Err(invalid(format!("`{name}` must be <= {}. Given: {n}", self.limits.max_best_of)));
        }
        Ok(())
    }

    fn check_parameters(&self, p: &GenerateParameters) -> Result<pb::NextTokenChooserParameters, RouterError> {
        if let Some(b) = p.best_of {
            self.check_fanout("best_of", b)?;
        }
        check_float("temperature", p.temperature, |x| x > 0.0, "strictly positive")?;
        check_float("repetition_penalty", p.repetition_penalty, |x| x > 0.0, "strictly positive")?;
        check_float("frequency_penalty", p.frequency_penalty, |x| (-2.0..=2.0).contains(&x), "in [-2, 2]")?;
        check_float("presence_penalty", p.presence_penalty, |x| (-2.0..=2.0).contains(&x), "in [-2, 2]")?;
        check_float("top_p", p.top_p, |x| x > 0.0 && x <= 1.0, "in (0, 1]")?;
        check_float("typical_p", p.typical_p, |x| x > 0.0 && x <= 1.0, "in (0, 1]")?;
        check_float("min_p", p.min_p, |x| (0.0..=1.0).contains(&x), "in [0, 1]")?;
        let top_k = match p.top_k {
            Some(k) if k <= 0 => return Err(invalid(format!("`top_k` must be strictly positive, got {k}"))),
            Some(k) => k.min(u32::MAX as i64) as u32,
            None => 0,
        };
        if p.watermark {
            return Err(invalid("`watermark` is not supported"));
        }
        let temperature = p.temperature.unwrap_or(1.0);
        // As in TGI: any sampling knob implies sampling.
        let do_sample = p.do_sample
            || (p.temperature.is_some() && temperature != 1.0)
            || top_k > 0
            || p.top_p.is_some_and(|x| x < 1.0)
            || p.typical_p.is_some_and(|x| x < 1.0)
            || p.min_p.is_some_and(|x| x > 0.0);
        Ok(pb::NextTokenChooserParameters {
            temperature,
            top_k,
            top_p: p.top_p.unwrap_or(1.0),
            typical_p: p.typical_p.unwrap_or(1.0),
            min_p: p.min_p.unwrap_or(0.0),
            do_sample,
            seed: p.seed.unwrap_or(0),
            has_seed: p.seed.is_some(),
            repetition_penalty: p.repetition_penalty.unwrap_or(1.0),
            frequency_penalty: p.frequency_penalty.unwrap_or(0.0),
            presence_penalty: p.presence_penalty.unwrap_or(0.0),
            logit_bias: Default::default(),
        })
    }
}

#[cfg(test)]
mod tests {
    use std::str::FromStr;

    use super::*;
    use crate::request::SamplingExtras;

    /// A word-level tokenizer over "a b c" and a model vocabulary of 10 ids.
    fn validation() -> Validation {
        let json = r#"{"version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
            "normalizer": null, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": null, "decoder": null,
            "model": {"type": "WordLevel", "vocab": {"a": 0, "b": 1, "c": 2, "[UNK]": 3}, "unk_token": "[UNK]"}}"#;
        let limits = Limits {
            max_input_tokens: 16,
            max_total_tokens: 32,
            max_stop_sequences: 4,
            max_top_n_tokens: 5,
            default_max_new_tokens: 8,
            max_best_of: 2,
            vocab_size: 10,
            kv_blocks: 8,
            block_size: 4,
            speculate: 0,
        };
        Validation::new(Arc::new(Tokenizer::from_str(json).unwrap()), limits)
    }

    fn with(extras: SamplingExtras) -> GenerateParameters {
        GenerateParameters { max_new_tokens: Some(4), extras, ..Default::default() }
    }

    async fn check(ids: Option<Vec<u32>>, p: GenerateParameters) -> Result<ValidRequest, RouterError> {
        validation().validate("a b".into(), ids, p, true).await
    }

    #[tokio::test]
    async fn token_id_prompts_are_used_as_given_within_the_vocabulary() {
        let r = check(Some(vec![9, 0, 9]), with(Default::default())).await.unwrap();
        assert_eq!(r.input_ids, vec![9, 0, 9]);
        let e = check(Some(vec![1, 10]), with(Default::default())).await.unwrap_err();
        assert_eq!(e.param().as_deref(), Some("prompt"), "{e}");
        assert!(check(Some(vec![]), with(Default::default())).await.is_err());
        assert_eq!(check(None, with(Default::default())).await.unwrap().input_ids, vec![0, 1]);
    }

    #[tokio::test]
    async fn logit_bias_keys_are_token_ids_and_values_in_range() {
        let bias = |k: &str, v: f32| with(SamplingExtras { logit_bias: vec![(k.into(), v)], ..Default::default() });
        let r = check(None, bias("7", -100.0)).await.unwrap();
        assert_eq!(r.parameters.logit_bias.get(&7), Some(&-100.0));
        for (k, v) in [("abc", 1.0), ("10", 1.0), ("-1", 1.0), ("3", 100.5), ("3", f32::NAN), ("3", f32::INFINITY)] {
            let e = check(None, bias(k, v)).await.unwrap_err();
            assert_eq!(e.param().as_deref(), Some("logit_bias"), "{k} {v}: {e}");
        }
    }

    #[tokio::test]
    async fn stop_token_ids_and_min_tokens() {
        let stops = |ids: Vec<i64>| with(SamplingExtras { stop_token_ids: ids, ..Default::default() });
        assert_eq!(check(None, stops(vec![2, 9])).await.unwrap().stop_token_ids, vec![2, 9]);
        for bad in [vec![-1], vec![10], vec![1; MAX_TOKEN_ID_LIST + 1]] {
            let e = check(None, stops(bad)).await.unwrap_err();
            assert_eq!(e.param().as_deref(), Some("stop_token_ids"), "{e}");
        }
        let min = |m: i64| with(SamplingExtras { min_new_tokens: Some(m), ..Default::default() });
        assert_eq!(check(None, min(4)).await.unwrap().min_new_tokens, 4);
        for bad in [5, -1] {
            let e = check(None, min(bad)).await.unwrap_err();
            assert_eq!(e.param().as_deref(), Some("min_tokens"), "{e}");
        }
        let mut p = min(2);
        p.grammar = Some(crate::grammar::GrammarParam::Json(serde_json::json!({})));
        assert!(check(None, p).await.is_err());
    }

    /// The one place sampling is decided: the shard draws exactly when `do_sample` is set.
    #[tokio::test]
    async fn any_sampling_knob_implies_sampling() {
        let sampled = |p: GenerateParameters| async move { check(None, p).await.unwrap().parameters.do_sample };
        let base = || with(Default::default());
        assert!(!sampled(base()).await);
        for off in [
            GenerateParameters { temperature: Some(1.0), top_p: Some(1.0), typical_p: Some(1.0), ..base() },
            GenerateParameters { min_p: Some(0.0), repetition_penalty: Some(1.3), ..base() },
        ] {
            assert!(!sampled(off).await);
        }
        for on in [
            GenerateParameters { do_sample: true, ..base() },
            GenerateParameters { temperature: Some(0.7), ..base() },
            GenerateParameters { top_k: Some(5), ..base() },
            GenerateParameters { top_p: Some(0.9), ..base() },
            GenerateParameters { typical_p: Some(0.9), ..base() },
            GenerateParameters { min_p: Some(0.1), ..base() },
        ] {
            assert!(sampled(on).await);
        }
    }

    #[tokio::test]
    async fn a_request_longer_than_the_pool_is_refused_with_the_numbers() {
        let v = validation();
        // 2 prompt tokens + 31 new = 32 tokens at most, 8 blocks of 4: fits exactly.
        let p = GenerateParameters { max_new_tokens: Some(30), ..Default::default() };
        let r = v.validate("a b".into(), None, p, true).await.unwrap();
        assert!(v.check_fits_pool(&r, 1).is_ok());
        let p = GenerateParameters { max_new_tokens: Some(30), ..Default::default() };
        let mut r = v.validate("a b".into(), None, p, true).await.unwrap();
        r.max_new_tokens = 32;
        let e = v.check_fits_pool(&r, 1).unwrap_err();
        assert_eq!(e.error_type(), "validation");
        assert!(e.to_string().contains("needs 9 blocks") && e.to_string().contains("holds 8"), "{e}");
        // Two forks of a 2-token prompt share no full block: 2 x 4 blocks fit, 2 x 5 do not.
        r.max_new_tokens = 15;
        assert!(v.check_fits_pool(&r, 2).is_ok());
        r.max_new_tokens = 16;
        assert!(v.check_fits_pool(&r, 2).is_err());
    }
}

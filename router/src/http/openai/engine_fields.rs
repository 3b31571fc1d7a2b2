//! The fields vLLM's and SGLang's OpenAI servers add to both routes
//! (completions and chat), which their routers (`vllm-router`, SGLang's
//! gateway) send with every request. Each is honoured, or accepted at its
//! default and refused with an `unsupported` 400 naming it when it asks for
//! something this server cannot do. docs/api.md lists them.

use serde::Deserialize;
use utoipa::ToSchema;

use super::structured_outputs::StructuredOutputs;
use crate::error::RouterError;
use crate::grammar::{GrammarParam, ResponseFormat};
use crate::request::TextOptions;

#[derive(Debug, Clone, Default, Deserialize, ToSchema)]
pub struct EngineFields {
    /// SGLang: keep the matched stop string (or the EOS / stop token) at the end of the output.
    pub no_stop_trim: Option<bool>,
    /// vLLM's name for `no_stop_trim`.
    pub include_stop_str_in_output: Option<bool>,
    /// Leave special tokens (chat markup, EOS) out of the text (default true).
    pub skip_special_tokens: Option<bool>,
    /// Accepted either way: fast (Rust) tokenizers never put spaces between special tokens (as in vLLM).
    pub spaces_between_special_tokens: Option<bool>,
    /// SGLang: only `false`; hidden states are not returned.
    pub return_hidden_states: Option<bool>,
    /// SGLang: a LoRA adapter; only `null` (adapters are chosen by `model`, docs/lora.md).
    #[schema(value_type = Option<Object>)]
    pub lora_path: Option<serde_json::Value>,
    /// SGLang: session continuation; only `null`.
    #[schema(value_type = Option<Object>)]
    pub session_params: Option<serde_json::Value>,
    /// SGLang: the whole output matches this regular expression.
    pub regex: Option<String>,
    /// SGLang: an EBNF grammar; only `null` (use `regex`, `response_format` or `structured_outputs`).
    pub ebnf: Option<String>,
    /// SGLang's name for `seed`.
    pub sampling_seed: Option<u64>,
    /// vLLM: constrained decoding (`json`, `regex`, `choice` or `json_object`).
    pub structured_outputs: Option<StructuredOutputs>,
    /// OpenAI: who the request is for; the tenant when `user` is not set.
    pub safety_identifier: Option<String>,
    /// OpenAI: a cache-routing hint; accepted, as every prefix is cached without one.
    pub prompt_cache_key: Option<String>,
}

/// Every field `EngineFields` reads.
pub const ENGINE_FIELDS: &[&str] = &[
    "no_stop_trim",
    "include_stop_str_in_output",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "return_hidden_states",
    "lora_path",
    "session_params",
    "regex",
    "ebnf",
    "sampling_seed",
    "structured_outputs",
    "safety_identifier",
    "prompt_cache_key",
];

fn unsupported(msg: String) -> RouterError {
    RouterError::Unsupported(msg)
}

/// One value under two names: both given and different is a 400.
pub fn alias<T: PartialEq + std::fmt::Debug + Clone>(
    (name, value): (&str, Option<&T>),
    (other, other_value): (&str, Option<&T>),
) -> Result<Option<T>, RouterError> {
    match (value, other_value) {
        (Some(a), Some(b)) if a != b => Err(RouterError::Validation(format!(
            "`{other}` is another name for `{name}`: they differ ({b:?} and {a:?}); give one"
        ))),
        (a, b) => Ok(a.or(b).cloned()),
    }
}

impl EngineFields {
    /// Refuses what this server cannot do; everything else is honoured.
    pub fn check(&self) -> Result<(), RouterError> {
        if self.return_hidden_states == Some(true) {
            return Err(unsupported("`return_hidden_states`: hidden states are not returned by this server".into()));
        }
        if self.lora_path.as_ref().is_some_and(|v| !v.is_null()) {
            return Err(unsupported("`lora_path`: choose a LoRA adapter by its name in `model`".into()));
        }
        if self.session_params.as_ref().is_some_and(|v| !v.is_null()) {
            return Err(unsupported("`session_params`: sessions are not supported; send the whole prompt".into()));
        }
        if self.ebnf.is_some() {
            return Err(unsupported(
                "`ebnf`: EBNF grammars are not supported; use `regex`, `response_format` or `structured_outputs`"
                    .into(),
            ));
        }
        Ok(())
    }

    /// How the stream writes the text.
    pub fn text_options(&self) -> Result<TextOptions, RouterError> {
        let keep_stop = alias(
            ("no_stop_trim", self.no_stop_trim.as_ref()),
            ("include_stop_str_in_output", self.include_stop_str_in_output.as_ref()),
        )?;
        Ok(TextOptions {
            show_special_tokens: !self.skip_special_tokens.unwrap_or(true),
            keep_stop: keep_stop.unwrap_or(false),
        })
    }

    /// The sampling seed, `seed` or SGLang's `sampling_seed`.
    pub fn seed(&self, seed: Option<u64>) -> Result<Option<u64>, RouterError> {
        alias(("seed", seed.as_ref()), ("sampling_seed", self.sampling_seed.as_ref()))
    }

    /// The one grammar of a request: `response_format`, `regex` or `structured_outputs`.
    pub fn grammar(&self, response_format: Option<&ResponseFormat>) -> Result<Option<GrammarParam>, RouterError> {
        let given: Vec<(&str, GrammarParam)> = [
            ("response_format", response_format.and_then(ResponseFormat::to_grammar)),
            ("regex", self.regex.clone().map(GrammarParam::Regex)),
            ("structured_outputs", self.structured_outputs.as_ref().map(StructuredOutputs::to_grammar).transpose()?),
        ]
        .into_iter()
        .filter_map(|(name, g)| g.map(|g| (name, g)))
        .collect();
        match given.as_slice() {
            [] => Ok(None),
            [(_, g)] => Ok(Some(g.clone())),
            [(a, _), (b, _), ..] => {
                Err(RouterError::Validation(format!("`{b}` cannot be combined with `{a}`: give one constraint")))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fields(v: serde_json::Value) -> EngineFields {
        serde_json::from_value(v).unwrap()
    }

    #[test]
    fn the_routers_defaults_are_accepted() {
        let f = fields(serde_json::json!({
            "no_stop_trim": false, "skip_special_tokens": true, "return_hidden_states": false,
            "lora_path": null, "session_params": null, "spaces_between_special_tokens": true}));
        assert!(f.check().is_ok());
        assert_eq!(f.text_options().unwrap(), TextOptions::default());
    }

    #[test]
    fn what_cannot_be_done_is_named() {
        for (body, name) in [
            (serde_json::json!({"return_hidden_states": true}), "return_hidden_states"),
            (serde_json::json!({"lora_path": "adapter"}), "lora_path"),
            (serde_json::json!({"session_params": {"id": "s"}}), "session_params"),
            (serde_json::json!({"ebnf": "root ::= \"a\""}), "ebnf"),
        ] {
            let e = fields(body).check().unwrap_err();
            assert_eq!((e.error_type(), e.param().as_deref()), ("unsupported", Some(name)), "{e}");
        }
    }

    #[test]
    fn text_options_and_their_aliases() {
        let f = fields(serde_json::json!({"no_stop_trim": true, "skip_special_tokens": false}));
        assert_eq!(f.text_options().unwrap(), TextOptions { show_special_tokens: true, keep_stop: true });
        let f = fields(serde_json::json!({"include_stop_str_in_output": true, "no_stop_trim": true}));
        assert!(f.text_options().unwrap().keep_stop);
        let e = fields(serde_json::json!({"include_stop_str_in_output": true, "no_stop_trim": false}))
            .text_options()
            .unwrap_err();
        assert_eq!(e.param().as_deref(), Some("include_stop_str_in_output"), "{e}");
    }

    #[test]
    fn sampling_seed_is_seed() {
        assert_eq!(fields(serde_json::json!({"sampling_seed": 7})).seed(None).unwrap(), Some(7));
        assert_eq!(fields(serde_json::json!({"sampling_seed": 7})).seed(Some(7)).unwrap(), Some(7));
        let e = fields(serde_json::json!({"sampling_seed": 7})).seed(Some(8)).unwrap_err();
        assert_eq!(e.param().as_deref(), Some("sampling_seed"));
    }

    #[test]
    fn one_constraint_at_a_time() {
        let f = fields(serde_json::json!({"regex": "a+"}));
        assert!(matches!(f.grammar(None).unwrap(), Some(GrammarParam::Regex(r)) if r == "a+"));
        let json: ResponseFormat = serde_json::from_value(serde_json::json!({"type": "json_object"})).unwrap();
        let e = f.grammar(Some(&json)).unwrap_err();
        assert_eq!(e.param().as_deref(), Some("regex"), "{e}");
        let text: ResponseFormat = serde_json::from_value(serde_json::json!({"type": "text"})).unwrap();
        assert!(f.grammar(Some(&text)).unwrap().is_some());
    }
}

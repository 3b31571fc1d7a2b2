//! vLLM's `structured_outputs` (what `vllm-router` forwards for constrained
//! decoding) as one of the grammars the shard applies: `json` (a schema),
//! `regex`, `choice` (one of the strings) or `json_object` (any JSON
//! object). vLLM's other kinds and its backend knobs are refused by name.

use serde::Deserialize;
use utoipa::ToSchema;

use crate::error::RouterError;
use crate::grammar::GrammarParam;

#[derive(Debug, Clone, Default, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct StructuredOutputs {
    /// A JSON schema (an object, or a string holding one).
    #[schema(value_type = Option<Object>)]
    pub json: Option<serde_json::Value>,
    pub regex: Option<String>,
    /// The output is exactly one of these strings.
    pub choice: Option<Vec<String>>,
    /// Any JSON object.
    pub json_object: Option<bool>,
    /// Only `null`: grammars are given as `regex` or `json` here.
    pub grammar: Option<String>,
    /// Only `null`.
    #[schema(value_type = Option<Object>)]
    pub structural_tag: Option<serde_json::Value>,
    /// Accepted either way: there is no fallback to unconstrained decoding.
    pub disable_fallback: Option<bool>,
    /// Only `false`: JSON is written compactly already.
    pub disable_any_whitespace: Option<bool>,
    /// Only `false`: schemas are applied as given.
    pub disable_additional_properties: Option<bool>,
    /// Only `null`.
    pub whitespace_pattern: Option<String>,
}

fn unsupported(field: &str, why: &str) -> RouterError {
    RouterError::Unsupported(format!("`structured_outputs.{field}`: {why}"))
}

impl StructuredOutputs {
    pub fn to_grammar(&self) -> Result<GrammarParam, RouterError> {
        self.refuse_unsupported()?;
        let mut kinds: Vec<(&str, GrammarParam)> = Vec::new();
        if let Some(schema) = &self.json {
            kinds.push(("json", GrammarParam::Json(schema.clone())));
        }
        if let Some(re) = &self.regex {
            kinds.push(("regex", GrammarParam::Regex(re.clone())));
        }
        if let Some(choices) = &self.choice {
            kinds.push(("choice", GrammarParam::Regex(choice_regex(choices)?)));
        }
        if self.json_object == Some(true) {
            kinds.push(("json_object", GrammarParam::Json(serde_json::json!({"type": "object"}))));
        }
        match kinds.len() {
            1 => Ok(kinds.remove(0).1),
            0 => Err(RouterError::Validation(
                "`structured_outputs` must set one of `json`, `regex`, `choice` or `json_object`".into(),
            )),
            _ => Err(RouterError::Validation(format!(
                "`structured_outputs.{}` cannot be combined with `structured_outputs.{}`: give one kind",
                kinds[1].0, kinds[0].0
            ))),
        }
    }

    fn refuse_unsupported(&self) -> Result<(), RouterError> {
        if self.grammar.is_some() {
            return Err(unsupported("grammar", "grammars are not supported; use `regex` or `json`"));
        }
        if self.structural_tag.as_ref().is_some_and(|v| !v.is_null()) {
            return Err(unsupported("structural_tag", "structural tags are not supported"));
        }
        if self.disable_any_whitespace == Some(true) {
            return Err(unsupported("disable_any_whitespace", "only false (JSON is written compactly already)"));
        }
        if self.disable_additional_properties == Some(true) {
            return Err(unsupported("disable_additional_properties", "only false (schemas apply as given)"));
        }
        if self.whitespace_pattern.is_some() {
            return Err(unsupported("whitespace_pattern", "a whitespace pattern cannot be set"));
        }
        Ok(())
    }
}

/// A regex matching exactly one of `choices`.
fn choice_regex(choices: &[String]) -> Result<String, RouterError> {
    if choices.is_empty() {
        return Err(RouterError::Validation("`structured_outputs.choice` must not be empty".into()));
    }
    Ok(choices.iter().map(|c| format!("({})", regex::escape(c))).collect::<Vec<_>>().join("|"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn grammar(v: serde_json::Value) -> Result<GrammarParam, RouterError> {
        serde_json::from_value::<StructuredOutputs>(v).unwrap().to_grammar()
    }

    #[test]
    fn each_kind_becomes_a_grammar() {
        assert!(matches!(grammar(serde_json::json!({"regex": "a+"})), Ok(GrammarParam::Regex(r)) if r == "a+"));
        let Ok(GrammarParam::Regex(re)) = grammar(serde_json::json!({"choice": ["yes", "no (1.5)"]})) else {
            panic!("no regex")
        };
        let re = regex::Regex::new(&format!("^(?:{re})$")).unwrap();
        assert!(re.is_match("yes") && re.is_match("no (1.5)") && !re.is_match("no 1x5") && !re.is_match("ye"));
        assert!(matches!(grammar(serde_json::json!({"json": {"type": "integer"}})), Ok(GrammarParam::Json(_))));
        assert!(matches!(grammar(serde_json::json!({"json_object": true})), Ok(GrammarParam::Json(_))));
    }

    #[test]
    fn one_kind_and_no_unsupported_knob() {
        let e = grammar(serde_json::json!({"regex": "a", "choice": ["b"]})).unwrap_err();
        assert_eq!(e.param().as_deref(), Some("structured_outputs.choice"), "{e}");
        assert!(grammar(serde_json::json!({})).is_err());
        assert!(grammar(serde_json::json!({"choice": []})).is_err());
        let e = grammar(serde_json::json!({"grammar": "root ::= x"})).unwrap_err();
        assert_eq!((e.error_type(), e.param().as_deref()), ("unsupported", Some("structured_outputs.grammar")));
        let e = grammar(serde_json::json!({"regex": "a", "disable_any_whitespace": true})).unwrap_err();
        assert_eq!(e.param().as_deref(), Some("structured_outputs.disable_any_whitespace"));
        assert!(grammar(serde_json::json!({"regex": "a", "disable_fallback": true})).is_ok());
    }
}

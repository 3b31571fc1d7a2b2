//! Constrained decoding requests, validated here into the proto's `Grammar`;
//! the shard compiles and applies them. TGI's `grammar` parameter and
//! OpenAI's `response_format` both end up as one of these.

use serde::Deserialize;
use utoipa::ToSchema;

use crate::error::RouterError;
use crate::proto::pb;

/// TGI's `grammar`: `{"type": "json", "value": <JSON schema>}` or
/// `{"type": "regex", "value": "<regex>"}`.
#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(tag = "type", content = "value", rename_all = "snake_case")]
pub enum GrammarParam {
    /// A JSON schema (an object, or a string holding one); `{}` means any JSON value.
    Json(serde_json::Value),
    /// A regular expression the whole output must match.
    Regex(String),
}

/// OpenAI's `response_format`, plus TGI's chat forms that huggingface_hub's
/// `chat_completion` sends: `{"type": "json_object", "value": schema}` (what
/// it turns `json_schema` into), `{"type": "json", "value": schema}`,
/// `{"type": "regex", "value": ...}`.
#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ResponseFormat {
    Text,
    JsonObject {
        /// TGI extension: a schema; absent means any JSON value (OpenAI).
        #[serde(default)]
        value: Option<serde_json::Value>,
    },
    JsonSchema {
        json_schema: JsonSchemaFormat,
    },
    Json {
        value: serde_json::Value,
    },
    Regex {
        value: String,
    },
}

#[derive(Debug, Clone, Deserialize, ToSchema)]
pub struct JsonSchemaFormat {
    pub name: Option<String>,
    pub description: Option<String>,
    pub schema: Option<serde_json::Value>,
    pub strict: Option<bool>,
}

impl ResponseFormat {
    pub fn to_grammar(&self) -> Option<GrammarParam> {
        match self {
            ResponseFormat::Text => None,
            ResponseFormat::JsonObject { value } => {
                Some(GrammarParam::Json(value.clone().unwrap_or_else(|| serde_json::json!({}))))
            }
            ResponseFormat::JsonSchema { json_schema } => {
                Some(GrammarParam::Json(json_schema.schema.clone().unwrap_or(serde_json::Value::Null)))
            }
            ResponseFormat::Json { value } => Some(GrammarParam::Json(value.clone())),
            ResponseFormat::Regex { value } => Some(GrammarParam::Regex(value.clone())),
        }
    }
}

/// Regexes are compiled here only to reject bad ones early (422 rather than a
/// failure on the shard); the size limit keeps a hostile pattern from costing
/// the router much.
const REGEX_SIZE_LIMIT: usize = 1 << 20;

pub fn validate(g: &GrammarParam) -> Result<pb::Grammar, RouterError> {
    let invalid = |m: String| RouterError::Validation(m);
    match g {
        GrammarParam::Json(v) => {
            let schema = match v {
                serde_json::Value::String(s) => serde_json::from_str::<serde_json::Value>(s)
                    .map_err(|e| invalid(format!("`grammar` JSON schema is not valid JSON: {e}")))?,
                other => other.clone(),
            };
            let Some(obj) = schema.as_object() else {
                return Err(invalid("`grammar` JSON schema must be a JSON object".into()));
            };
            // "" is the proto's "any JSON value" (OpenAI json_object).
            let value = if obj.is_empty() { String::new() } else { schema.to_string() };
            Ok(pb::Grammar { r#type: pb::GrammarType::Json as i32, value })
        }
        GrammarParam::Regex(r) => {
            if r.is_empty() {
                return Err(invalid("`grammar` regex must not be empty".into()));
            }
            regex::RegexBuilder::new(r)
                .size_limit(REGEX_SIZE_LIMIT)
                .build()
                .map_err(|e| invalid(format!("`grammar` regex does not compile: {e}")))?;
            Ok(pb::Grammar { r#type: pb::GrammarType::Regex as i32, value: r.clone() })
        }
    }
}

/// JSON written compactly with fixed separators, as the shard's
/// response_format grammars: flexible whitespace lets small models pad forever.
pub fn compact() -> serde_json::Value {
    serde_json::json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "})
}

/// A grammar as Lark rules whose start rule is `start`, so the router can
/// compose it (after a reasoning block). JSON keeps the shard's compact
/// whitespace through llguidance's `x-guidance` key.
pub fn to_lark(g: &GrammarParam) -> Result<String, RouterError> {
    let g = validate(g)?;
    if g.r#type == pb::GrammarType::Regex as i32 {
        return Ok(format!("start: /{}/\n", escape_slashes(&g.value)));
    }
    let mut schema: serde_json::Value = if g.value.is_empty() {
        serde_json::json!({"type": "object"})
    } else {
        serde_json::from_str(&g.value).map_err(|e| RouterError::Validation(format!("`grammar`: {e}")))?
    };
    if let Some(obj) = schema.as_object_mut() {
        obj.entry("x-guidance").or_insert_with(compact);
    }
    Ok(format!("start: %json {schema}\n"))
}

/// A regex inside Lark's `/.../`: unescaped slashes escaped.
fn escape_slashes(re: &str) -> String {
    let mut out = String::with_capacity(re.len());
    let mut escaped = false;
    for c in re.chars() {
        if c == '/' && !escaped {
            out.push('\\');
        }
        escaped = c == '\\' && !escaped;
        out.push(c);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(v: serde_json::Value) -> GrammarParam {
        serde_json::from_value(v).unwrap()
    }

    #[test]
    fn json_schema_object_passes_through() {
        let g = validate(&parse(serde_json::json!({"type": "json", "value": {"type": "object"}}))).unwrap();
        assert_eq!(g.r#type, pb::GrammarType::Json as i32);
        assert_eq!(g.value, r#"{"type":"object"}"#);
    }

    #[test]
    fn json_schema_as_string_is_parsed() {
        let g = validate(&parse(serde_json::json!({"type": "json", "value": "{\"type\": \"string\"}"}))).unwrap();
        assert_eq!(g.value, r#"{"type":"string"}"#);
    }

    #[test]
    fn non_object_schemas_are_rejected() {
        for v in [serde_json::json!(5), serde_json::json!([1]), serde_json::json!("nope"), serde_json::json!(null)] {
            let err = validate(&GrammarParam::Json(v)).unwrap_err();
            assert_eq!(err.error_type(), "validation");
        }
    }

    #[test]
    fn lark_forms() {
        assert_eq!(to_lark(&GrammarParam::Regex(r"a/b\/c".into())).unwrap(), "start: /a\\/b\\/c/\n");
        let j = to_lark(&GrammarParam::Json(serde_json::json!({}))).unwrap();
        assert!(j.starts_with(r#"start: %json {"type":"object","x-guidance":{"whitespace_flexible":false"#), "{j}");
    }

    #[test]
    fn regex_must_compile() {
        assert!(validate(&GrammarParam::Regex(r"\d{3}-[a-z]+".into())).is_ok());
        assert!(validate(&GrammarParam::Regex("(unclosed".into())).is_err());
        assert!(validate(&GrammarParam::Regex(String::new())).is_err());
    }

    #[test]
    fn response_formats_map_to_grammars() {
        let any: ResponseFormat = serde_json::from_value(serde_json::json!({"type": "json_object"})).unwrap();
        let g = validate(&any.to_grammar().unwrap()).unwrap();
        assert_eq!((g.r#type, g.value.as_str()), (pb::GrammarType::Json as i32, ""));
        let text: ResponseFormat = serde_json::from_value(serde_json::json!({"type": "text"})).unwrap();
        assert!(text.to_grammar().is_none());
        let schema: ResponseFormat = serde_json::from_value(serde_json::json!(
            {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "integer"}}}))
        .unwrap();
        assert_eq!(validate(&schema.to_grammar().unwrap()).unwrap().value, r#"{"type":"integer"}"#);
        let missing: ResponseFormat = serde_json::from_value(serde_json::json!(
            {"type": "json_schema", "json_schema": {"name": "x"}}))
        .unwrap();
        assert!(validate(&missing.to_grammar().unwrap()).is_err());
        let hf: ResponseFormat = serde_json::from_value(serde_json::json!(
            {"type": "json_object", "value": {"type": "integer"}}))
        .unwrap();
        assert_eq!(validate(&hf.to_grammar().unwrap()).unwrap().value, r#"{"type":"integer"}"#);
        let tgi: ResponseFormat = serde_json::from_value(serde_json::json!(
            {"type": "regex", "value": "a+"}))
        .unwrap();
        assert_eq!(validate(&tgi.to_grammar().unwrap()).unwrap().r#type, pb::GrammarType::Regex as i32);
    }
}

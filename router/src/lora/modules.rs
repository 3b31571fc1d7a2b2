//! `--lora-modules` values, in vLLM's two forms: `name=path`, or the JSON
//! object `{"name": ..., "path": ..., "base_model_name": ...}`.

use serde::Deserialize;

/// One adapter named on the command line.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct LoraModule {
    pub name: String,
    pub path: String,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct JsonForm {
    name: String,
    path: String,
    /// vLLM's: the base the adapter was trained on; the server's own model is the base.
    #[allow(dead_code)]
    base_model_name: Option<String>,
}

impl LoraModule {
    /// Parses one value (clap's value parser).
    pub fn parse(text: &str) -> Result<Self, String> {
        let text = text.trim();
        let (name, path) = if text.starts_with('{') {
            let j: JsonForm = serde_json::from_str(text).map_err(|e| format!("not a LoRA module object: {e}"))?;
            (j.name, j.path)
        } else {
            let (name, path) = text
                .split_once('=')
                .ok_or_else(|| format!("{text:?} is not name=path (or {{\"name\": ..., \"path\": ...}})"))?;
            (name.trim().to_string(), path.trim().to_string())
        };
        check_name(&name)?;
        if path.is_empty() {
            return Err(format!("LoRA module {name:?} has no path"));
        }
        Ok(Self { name, path })
    }
}

/// An adapter name: what clients write in `model`, so no blanks and not empty.
pub fn check_name(name: &str) -> Result<(), String> {
    if name.is_empty() {
        return Err("an adapter name must not be empty".into());
    }
    if name.chars().any(|c| c.is_whitespace() || c.is_control()) {
        return Err(format!("adapter name {name:?} holds blanks"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_forms_parse() {
        let m = |n: &str, p: &str| LoraModule { name: n.into(), path: p.into() };
        assert_eq!(LoraModule::parse("sql=/adapters/sql"), Ok(m("sql", "/adapters/sql")));
        assert_eq!(LoraModule::parse("a=b=c"), Ok(m("a", "b=c")), "the first = splits");
        assert_eq!(
            LoraModule::parse(r#"{"name": "sql", "path": "/a", "base_model_name": "llama"}"#),
            Ok(m("sql", "/a"))
        );
    }

    #[test]
    fn bad_values_say_what_is_expected() {
        for (text, needle) in [
            ("sql", "is not name=path"),
            ("=/a", "must not be empty"),
            ("sql=", "has no path"),
            ("my sql=/a", "blanks"),
            (r#"{"name": "sql"}"#, "missing field `path`"),
            (r#"{"name": "s", "path": "/a", "rank": 8}"#, "unknown field"),
        ] {
            let err = LoraModule::parse(text).unwrap_err();
            assert!(err.contains(needle), "{text}: {err}");
        }
    }
}

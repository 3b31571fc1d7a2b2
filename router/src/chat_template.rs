//! Chat templates from the model directory (`chat_template.jinja`, or
//! `chat_template` in `tokenizer_config.json`), rendered with minijinja the
//! way transformers renders them (trim_blocks, lstrip_blocks, Python string
//! methods, `raise_exception`, a Python-style `tojson`). Every failure, at
//! load or at render, becomes a 422 for the chat request: never a 500.

use std::path::Path;

use minijinja::value::{Kwargs, Serde};
use minijinja::{Environment, Error, ErrorKind, Value};
use serde_json::Value as Json;

use crate::error::RouterError;

pub struct ChatTemplate {
    env: Environment<'static>,
    /// The template text, for what the router infers from it (the tool-call format).
    pub source: String,
    bos_token: String,
    eos_token: String,
}

/// What the router knows about the model's template: usable, absent, or broken.
pub type LoadedTemplate = Result<ChatTemplate, String>;

const NAME: &str = "chat";

impl ChatTemplate {
    pub fn new(source: String, bos_token: String, eos_token: String) -> Result<Self, String> {
        let mut env = Environment::new();
        env.set_syntax(
            minijinja::syntax::SyntaxConfig::builder()
                .trim_blocks(true)
                .lstrip_blocks(true)
                .build()
                .map_err(|e| e.to_string())?,
        );
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_filter("tojson", tojson);
        env.add_template_owned(NAME, source.clone())
            .map_err(|e| format!("the model's chat template does not compile: {e}"))?;
        Ok(Self { env, source, bos_token, eos_token })
    }

    /// Reads the template and special tokens next to tokenizer.json.
    pub fn load(dir: &Path) -> LoadedTemplate {
        let config: Json = std::fs::read_to_string(dir.join("tokenizer_config.json"))
            .ok()
            .and_then(|s| serde_json::from_str(&s).ok())
            .unwrap_or(Json::Null);
        // A standalone file wins, as in transformers.
        let source = match std::fs::read_to_string(dir.join("chat_template.jinja")) {
            Ok(s) => Some(s),
            Err(_) => template_from_config(&config),
        };
        let Some(source) = source else {
            return Err("the model has no chat template (tokenizer_config.json has no `chat_template`)".into());
        };
        Self::new(source, special_token(&config, "bos_token"), special_token(&config, "eos_token"))
    }

    /// Renders the prompt. `messages` are OpenAI messages with `content`
    /// already flattened to a string; `extra` holds `tools` and
    /// `chat_template_kwargs` (merged into the template's context).
    pub fn apply(
        &self,
        messages: &[Json],
        add_generation_prompt: bool,
        extra: serde_json::Map<String, Json>,
    ) -> Result<String, RouterError> {
        let template =
            self.env.get_template(NAME).map_err(|e| RouterError::Validation(format!("chat template: {e}")))?;
        let mut ctx = extra;
        ctx.insert("messages".into(), Json::Array(messages.to_vec()));
        ctx.insert("add_generation_prompt".into(), Json::Bool(add_generation_prompt));
        ctx.insert("bos_token".into(), Json::String(self.bos_token.clone()));
        ctx.insert("eos_token".into(), Json::String(self.eos_token.clone()));
        template
            .render(Value::from(Serde(Json::Object(ctx))))
            .map_err(|e| RouterError::Validation(format!("cannot apply the chat template: {}", describe(&e))))
    }
}

/// A rendered conversation cut right after the text of its final message,
/// so the model continues that message (`continue_final_message`), as
/// transformers' `apply_chat_template` cuts it: at the last occurrence of the
/// message's text, keeping its trailing whitespace only where the template did.
pub fn continue_final(rendered: &str, final_text: &str) -> Result<String, RouterError> {
    let stripped = final_text.trim();
    if stripped.is_empty() {
        return Err(RouterError::Validation(
            "`continue_final_message` is set but the final message has no text to continue".into(),
        ));
    }
    let Some(at) = rendered.rfind(stripped) else {
        return Err(RouterError::Validation(
            "`continue_final_message` is set but the chat template does not write the final message's text".into(),
        ));
    };
    let kept = final_text.trim_start();
    let end = if rendered[at..].starts_with(kept) { at + kept.len() } else { at + stripped.len() };
    Ok(rendered[..end].to_string())
}

/// `chat_template` is a string, or a list of `{name, template}` where the
/// one named "default" is the chat template.
fn template_from_config(config: &Json) -> Option<String> {
    match config.get("chat_template")? {
        Json::String(s) => Some(s.clone()),
        Json::Array(list) => {
            let named = |n: &str| {
                list.iter()
                    .find(|t| t.get("name").and_then(Json::as_str) == Some(n))
                    .and_then(|t| t.get("template")?.as_str().map(str::to_string))
            };
            named("default").or_else(|| list.first().and_then(|t| t.get("template")?.as_str().map(str::to_string)))
        }
        _ => None,
    }
}

/// Special tokens are strings or AddedToken dicts `{"content": ...}`.
fn special_token(config: &Json, key: &str) -> String {
    match config.get(key) {
        Some(Json::String(s)) => s.clone(),
        Some(Json::Object(o)) => o.get("content").and_then(Json::as_str).unwrap_or_default().to_string(),
        _ => String::new(),
    }
}

/// A template's own `raise_exception("...")` message is what the client
/// should read, without minijinja's decoration.
fn describe(e: &Error) -> String {
    match e.kind() {
        ErrorKind::InvalidOperation => e.detail().unwrap_or("invalid operation").to_string(),
        _ => e.to_string(),
    }
}

fn raise_exception(msg: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, msg))
}

/// `strftime_now(fmt)` (Llama 3 templates put today's date in the system prompt).
fn strftime_now(fmt: String) -> String {
    let secs = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
    strftime(secs, &fmt)
}

const MONTHS: [&str; 12] = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
];

/// The subset of strftime that chat templates use, in UTC.
fn strftime(unix_secs: u64, fmt: &str) -> String {
    let days = (unix_secs / 86_400) as i64;
    let rem = unix_secs % 86_400;
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    let name = MONTHS[(month - 1) as usize];
    let mut out = String::new();
    let mut chars = fmt.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('Y') => out.push_str(&year.to_string()),
            Some('m') => out.push_str(&format!("{month:02}")),
            Some('d') => out.push_str(&format!("{day:02}")),
            Some('B') => out.push_str(name),
            Some('b') => out.push_str(&name[..3]),
            Some('H') => out.push_str(&format!("{:02}", rem / 3600)),
            Some('M') => out.push_str(&format!("{:02}", rem % 3600 / 60)),
            Some('S') => out.push_str(&format!("{:02}", rem % 60)),
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}

/// transformers' `tojson`: `json.dumps(x, ensure_ascii=False, indent=...)`,
/// so separators are ", " and ": " (or "," and ": " with an indent), and
/// nothing is HTML-escaped (minijinja's own filter escapes for HTML).
fn tojson(value: Value, kwargs: Kwargs) -> Result<Value, Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    kwargs.assert_all_used()?;
    let json =
        serde_json::to_value(&value).map_err(|e| Error::new(ErrorKind::InvalidOperation, format!("tojson: {e}")))?;
    let mut out = String::new();
    write_py_json(&json, indent, sort_keys.unwrap_or(false), 0, &mut out);
    Ok(Value::from_safe_string(out))
}

fn write_py_json(v: &Json, indent: Option<usize>, sort: bool, depth: usize, out: &mut String) {
    let newline = |out: &mut String, depth: usize| {
        if let Some(n) = indent {
            out.push('\n');
            out.push_str(&" ".repeat(n * depth));
        }
    };
    let item_sep = if indent.is_some() { "," } else { ", " };
    match v {
        Json::Array(items) if !items.is_empty() => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                newline(out, depth + 1);
                write_py_json(item, indent, sort, depth + 1, out);
            }
            newline(out, depth);
            out.push(']');
        }
        Json::Object(map) if !map.is_empty() => {
            let mut entries: Vec<_> = map.iter().collect();
            if sort {
                entries.sort_by(|a, b| a.0.cmp(b.0));
            }
            out.push('{');
            for (i, (k, item)) in entries.into_iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                newline(out, depth + 1);
                out.push_str(&Json::String(k.clone()).to_string());
                out.push_str(": ");
                write_py_json(item, indent, sort, depth + 1, out);
            }
            newline(out, depth);
            out.push('}');
        }
        other => out.push_str(&other.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    const SMOLLM2: &str = "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

    fn template(src: &str) -> ChatTemplate {
        ChatTemplate::new(src.to_string(), "<s>".into(), "</s>".into()).unwrap()
    }

    #[test]
    fn smollm2_template_renders_like_transformers() {
        let t = template(SMOLLM2);
        let out = t.apply(&[json!({"role": "user", "content": "Hi"})], true, Default::default()).unwrap();
        assert_eq!(
            out,
            "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
        );
    }

    #[test]
    fn python_methods_and_special_tokens() {
        let t = template("{{ bos_token }}{% for m in messages %}{{ m['content'].strip().upper() }}{% if m.role.startswith('us') %}!{% endif %}{% endfor %}{{ eos_token }}");
        let out = t.apply(&[json!({"role": "user", "content": "  hey  "})], false, Default::default()).unwrap();
        assert_eq!(out, "<s>HEY!</s>");
    }

    #[test]
    fn raise_exception_is_a_validation_error_with_the_message() {
        let t = template("{% if messages[0]['role'] != 'user' %}{{ raise_exception('Conversation must start with user') }}{% endif %}ok");
        let err = t.apply(&[json!({"role": "assistant", "content": "x"})], false, Default::default()).unwrap_err();
        assert_eq!(err.error_type(), "validation");
        assert!(err.to_string().contains("Conversation must start with user"), "{err}");
    }

    #[test]
    fn broken_templates_fail_at_load_not_at_runtime() {
        assert!(ChatTemplate::new("{% for m in messages %}".into(), String::new(), String::new()).is_err());
    }

    #[test]
    fn runtime_errors_are_validation_errors() {
        let t = template("{{ messages[0].content + 1 }}");
        let err = t.apply(&[json!({"role": "user", "content": "x"})], false, Default::default()).unwrap_err();
        assert_eq!(err.error_type(), "validation");
    }

    #[test]
    fn tojson_matches_python_json_dumps() {
        let t = template("{{ tools | tojson }}|{{ tools | tojson(indent=2) }}");
        let mut extra = serde_json::Map::new();
        extra.insert("tools".into(), json!([{"name": "f", "a": [1, "é<"]}]));
        let out = t.apply(&[], false, extra).unwrap();
        assert_eq!(out, "[{\"name\": \"f\", \"a\": [1, \"é<\"]}]|[\n  {\n    \"name\": \"f\",\n    \"a\": [\n      1,\n      \"é<\"\n    ]\n  }\n]");
    }

    #[test]
    fn trim_and_lstrip_blocks_like_transformers() {
        let t = template("{% for m in messages %}\n    {{ m.content }}\n{% endfor %}");
        let out = t.apply(&[json!({"role": "user", "content": "a"})], false, Default::default()).unwrap();
        assert_eq!(out, "    a\n");
    }

    #[test]
    fn config_template_forms() {
        assert_eq!(template_from_config(&json!({"chat_template": "x"})).as_deref(), Some("x"));
        let list =
            json!({"chat_template": [{"name": "tool_use", "template": "t"}, {"name": "default", "template": "d"}]});
        assert_eq!(template_from_config(&list).as_deref(), Some("d"));
        assert_eq!(special_token(&json!({"bos_token": {"content": "<b>"}}), "bos_token"), "<b>");
    }

    #[test]
    fn continuing_the_final_message_cuts_after_its_text() {
        let t = template(SMOLLM2);
        let msgs = [json!({"role": "user", "content": "Hi"}), json!({"role": "assistant", "content": "Once upon"})];
        let out = continue_final(&t.apply(&msgs, false, Default::default()).unwrap(), "Once upon").unwrap();
        assert!(out.ends_with("<|im_start|>assistant\nOnce upon"), "{out:?}");
        // Trailing whitespace stays only where the template wrote it.
        let spaced = [json!({"role": "user", "content": "Hi"}), json!({"role": "assistant", "content": "Once "})];
        let out = continue_final(&t.apply(&spaced, false, Default::default()).unwrap(), "Once ").unwrap();
        assert!(out.ends_with("assistant\nOnce "), "{out:?}");
        let trimming = template("{% for m in messages %}[{{ m.content | trim }}]{% endfor %}");
        let out = continue_final(&trimming.apply(&spaced, false, Default::default()).unwrap(), "Once ").unwrap();
        assert_eq!(out, "[Hi][Once");
        assert!(continue_final("abc", "  ").is_err());
        assert!(continue_final("abc", "zz").is_err());
    }

    #[test]
    fn strftime_subset() {
        // 2024-07-26 12:34:56 UTC
        assert_eq!(strftime(1_721_997_296, "%d %b %Y %H:%M:%S"), "26 Jul 2024 12:34:56");
        assert_eq!(strftime(0, "%B %m %%"), "January 01 %");
    }
}

//! What the chat pipeline does with the chat fields of vLLM's and SGLang's
//! servers (`vllm-router` and SGLang's gateway send most of them with every
//! request): how the template is rendered (`add_generation_prompt`,
//! `continue_final_message`, `reasoning_effort`), where the reasoning goes
//! (`separate_reasoning`, `include_reasoning`, `stream_reasoning`), the
//! `max_completion_tokens` alias, and the fields accepted only at their
//! default.

use crate::error::RouterError;
use crate::http::openai::engine_fields::alias;
use crate::http::openai::types::ChatCompletionRequest;

/// OpenAI's `reasoning_effort` values, passed to the template as they are.
const EFFORTS: &[&str] = &["none", "minimal", "low", "medium", "high", "xhigh"];

/// How the template closes the conversation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PromptEnd {
    /// The assistant's turn is opened after the messages.
    pub add_generation_prompt: bool,
    /// The last (assistant) message is left open: the reply continues it.
    pub continue_final_message: bool,
}

/// Where the reasoning of a reply goes (with `--reasoning-parser`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReasoningOut {
    /// In `reasoning_content` (the default).
    Separate,
    /// Left in `content` as the model wrote it (`separate_reasoning: false`).
    Inline,
    /// Not returned (`include_reasoning: false`).
    Drop,
}

fn unsupported(msg: &str) -> RouterError {
    RouterError::Unsupported(msg.to_string())
}

impl ChatCompletionRequest {
    /// The generation limit: `max_completion_tokens`, or its older name `max_tokens`.
    pub fn max_new_tokens(&self) -> Result<Option<i64>, RouterError> {
        alias(
            ("max_completion_tokens", self.max_completion_tokens.as_ref()),
            ("max_tokens", self.sampling.max_tokens.as_ref()),
        )
    }

    pub fn prompt_end(&self) -> Result<PromptEnd, RouterError> {
        let continue_final_message = self.continue_final_message.unwrap_or(false);
        if !continue_final_message {
            return Ok(PromptEnd {
                add_generation_prompt: self.add_generation_prompt.unwrap_or(true),
                continue_final_message,
            });
        }
        if self.add_generation_prompt == Some(true) {
            return Err(RouterError::Validation(
                "`add_generation_prompt` cannot be true with `continue_final_message`: the reply continues the last \
                 message instead of opening a new turn"
                    .into(),
            ));
        }
        if self.messages.last().is_none_or(|m| m.role != "assistant") {
            return Err(RouterError::Validation(
                "`continue_final_message` needs the last message to be the assistant's".into(),
            ));
        }
        Ok(PromptEnd { add_generation_prompt: false, continue_final_message })
    }

    /// `reasoning_effort` for the template, when given.
    pub fn reasoning_effort(&self) -> Result<Option<&str>, RouterError> {
        match self.reasoning_effort.as_deref() {
            Some(e) if !EFFORTS.contains(&e) => Err(RouterError::Validation(format!(
                "`reasoning_effort` must be one of {}; got {e:?}",
                EFFORTS.join(", ")
            ))),
            other => Ok(other),
        }
    }

    pub fn reasoning_out(&self) -> Result<ReasoningOut, RouterError> {
        match (self.separate_reasoning.unwrap_or(true), self.include_reasoning.unwrap_or(true)) {
            (true, true) => Ok(ReasoningOut::Separate),
            (false, true) => Ok(ReasoningOut::Inline),
            (true, false) => Ok(ReasoningOut::Drop),
            (false, false) => Err(RouterError::Validation(
                "`include_reasoning` false drops the reasoning that `separate_reasoning` false leaves in the \
                 content; give one"
                    .into(),
            )),
        }
    }

    /// Whether streamed reasoning goes out as it comes (else in one delta when it ends).
    pub fn stream_reasoning(&self) -> bool {
        self.stream_reasoning.unwrap_or(true)
    }

    /// The chat fields accepted only at their default.
    pub fn check_engine_fields(&self) -> Result<(), RouterError> {
        if self.echo == Some(true) {
            return Err(unsupported("`echo`: chat replies are not prefixed with the last message"));
        }
        if self.functions.as_ref().is_some_and(|v| !v.is_null()) {
            return Err(unsupported("`functions`: deprecated by OpenAI and not supported; use `tools`"));
        }
        if self.function_call.as_ref().is_some_and(|v| !v.is_null()) {
            return Err(unsupported("`function_call`: deprecated by OpenAI and not supported; use `tool_choice`"));
        }
        if self.service_tier.as_deref().is_some_and(|t| !matches!(t, "auto" | "default")) {
            return Err(unsupported("`service_tier`: only \"auto\" or \"default\"; there is one tier"));
        }
        if self.verbosity.as_deref().is_some_and(|v| v != "medium") {
            return Err(unsupported("`verbosity`: only \"medium\""));
        }
        if self.metadata.as_ref().is_some_and(|v| !v.is_null()) {
            return Err(unsupported("`metadata`: nothing is stored, so there is nothing to tag"));
        }
        if self.modalities.as_ref().is_some_and(|m| m.iter().any(|m| m != "text")) {
            return Err(unsupported("`modalities`: only [\"text\"]"));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(v: serde_json::Value) -> ChatCompletionRequest {
        let mut body = serde_json::json!({"messages": [{"role": "user", "content": "hi"}]});
        body.as_object_mut().unwrap().extend(v.as_object().unwrap().clone());
        serde_json::from_value(body).unwrap()
    }

    #[test]
    fn the_routers_defaults_change_nothing() {
        let r = req(serde_json::json!({"continue_final_message": false, "separate_reasoning": true,
            "stream_reasoning": true, "include_reasoning": true, "logprobs": false, "max_completion_tokens": 3}));
        assert_eq!(r.prompt_end().unwrap(), PromptEnd { add_generation_prompt: true, continue_final_message: false });
        assert_eq!(r.reasoning_out().unwrap(), ReasoningOut::Separate);
        assert!(r.stream_reasoning() && r.check_engine_fields().is_ok());
        assert_eq!(r.max_new_tokens().unwrap(), Some(3));
    }

    #[test]
    fn max_tokens_and_max_completion_tokens_must_agree() {
        assert_eq!(req(serde_json::json!({"max_tokens": 4})).max_new_tokens().unwrap(), Some(4));
        assert_eq!(
            req(serde_json::json!({"max_tokens": 4, "max_completion_tokens": 4})).max_new_tokens().unwrap(),
            Some(4)
        );
        let e = req(serde_json::json!({"max_tokens": 4, "max_completion_tokens": 5})).max_new_tokens().unwrap_err();
        assert_eq!(e.param().as_deref(), Some("max_tokens"), "{e}");
    }

    #[test]
    fn continuing_the_final_message() {
        let mut r = req(serde_json::json!({"continue_final_message": true}));
        assert!(r.prompt_end().is_err(), "the last message is the user's");
        r.messages.push(crate::http::openai::types::ChatMessage::text("assistant", "Once".into()));
        assert_eq!(r.prompt_end().unwrap(), PromptEnd { add_generation_prompt: false, continue_final_message: true });
        r.add_generation_prompt = Some(true);
        let e = r.prompt_end().unwrap_err();
        assert_eq!(e.param().as_deref(), Some("add_generation_prompt"));
        let r = req(serde_json::json!({"add_generation_prompt": false}));
        assert!(!r.prompt_end().unwrap().add_generation_prompt);
    }

    #[test]
    fn reasoning_placement() {
        assert_eq!(
            req(serde_json::json!({"separate_reasoning": false})).reasoning_out().unwrap(),
            ReasoningOut::Inline
        );
        assert_eq!(req(serde_json::json!({"include_reasoning": false})).reasoning_out().unwrap(), ReasoningOut::Drop);
        let e = req(serde_json::json!({"include_reasoning": false, "separate_reasoning": false}))
            .reasoning_out()
            .unwrap_err();
        assert_eq!(e.param().as_deref(), Some("include_reasoning"));
        assert!(!req(serde_json::json!({"stream_reasoning": false})).stream_reasoning());
        assert_eq!(req(serde_json::json!({"reasoning_effort": "low"})).reasoning_effort().unwrap(), Some("low"));
        assert!(req(serde_json::json!({"reasoning_effort": "extreme"})).reasoning_effort().is_err());
    }

    #[test]
    fn fields_accepted_only_at_their_default() {
        let defaults = serde_json::json!({"echo": false, "functions": null, "service_tier": "auto",
            "verbosity": "medium", "metadata": null, "modalities": ["text"]});
        assert!(req(defaults).check_engine_fields().is_ok());
        for (bad, name) in [
            (serde_json::json!({"echo": true}), "echo"),
            (serde_json::json!({"functions": [{"name": "f"}]}), "functions"),
            (serde_json::json!({"function_call": "auto"}), "function_call"),
            (serde_json::json!({"service_tier": "flex"}), "service_tier"),
            (serde_json::json!({"verbosity": "low"}), "verbosity"),
            (serde_json::json!({"metadata": {"k": "v"}}), "metadata"),
            (serde_json::json!({"modalities": ["text", "audio"]}), "modalities"),
        ] {
            let e = req(bad).check_engine_fields().unwrap_err();
            assert_eq!((e.error_type(), e.param().as_deref()), ("unsupported", Some(name)), "{e}");
        }
    }
}

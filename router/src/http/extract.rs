//! JSON bodies whose every failure (size, syntax, types) is a RouterError,
//! so clients always get their API's error shape rather than axum's plain text.

use axum::body::Bytes;
use axum::extract::{FromRequest, Request};
use axum::http::StatusCode;
use axum::response::IntoResponse;
use serde::de::DeserializeOwned;

use super::openai::engine_fields::{EngineFields, ENGINE_FIELDS};
use super::openai::types::{OpenAiBody, SamplingParams, SAMPLING_FIELDS};
use crate::error::RouterError;

pub struct JsonBody<T>(pub T);

async fn read_body<S: Send + Sync>(req: Request, state: &S) -> Result<Bytes, RouterError> {
    Bytes::from_request(req, state).await.map_err(|rej| {
        let status = rej.into_response().status();
        if status == StatusCode::PAYLOAD_TOO_LARGE {
            RouterError::PayloadTooLarge("over the server's payload limit".into())
        } else {
            RouterError::InvalidJson(format!("cannot read request body ({status})"))
        }
    })
}

impl<S, T> FromRequest<S> for JsonBody<T>
where
    S: Send + Sync,
    T: DeserializeOwned,
{
    type Rejection = RouterError;

    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        let bytes = read_body(req, state).await?;
        serde_json::from_slice(&bytes)
            .map(JsonBody)
            .map_err(|e| RouterError::InvalidJson(format!("invalid JSON body: {e}")))
    }
}

/// An OpenAI request body, strictly: a field the route does not know is a
/// 400 naming it (an ignored field would silently change what the client
/// asked for), and a field of the wrong type is named by its path. Serde's
/// own `deny_unknown_fields` cannot be used: the bodies flatten `SamplingParams`.
pub struct OpenAiJson<T>(pub T);

impl<S, T> FromRequest<S> for OpenAiJson<T>
where
    S: Send + Sync,
    T: DeserializeOwned + OpenAiBody,
{
    type Rejection = RouterError;

    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        let bytes = read_body(req, state).await?;
        let value: serde_json::Value =
            serde_json::from_slice(&bytes).map_err(|e| RouterError::InvalidJson(format!("invalid JSON body: {e}")))?;
        let Some(object) = value.as_object() else {
            return Err(RouterError::InvalidJson("the body must be a JSON object".into()));
        };
        let known = |k: &str| T::FIELDS.contains(&k) || SAMPLING_FIELDS.contains(&k) || ENGINE_FIELDS.contains(&k);
        if let Some(key) = object.keys().find(|k| !known(k)) {
            return Err(RouterError::InvalidJson(format!("`{key}`: unknown field, not supported by this route")));
        }
        // The shared fields first, on their own: inside the flattened body serde
        // buffers them, and a type error there would come without its path.
        serde_path_to_error::deserialize::<_, EngineFields>(&value).map_err(named)?;
        serde_path_to_error::deserialize::<_, SamplingParams>(&value).map_err(named)?;
        serde_path_to_error::deserialize(&value).map(OpenAiJson).map_err(named)
    }
}

/// A serde error as a 400 whose message starts with the field's path.
fn named(e: serde_path_to_error::Error<serde_json::Error>) -> RouterError {
    let path = e.path().to_string();
    let inner = e.inner().to_string();
    // Name the field itself: for an unknown nested field the path may stop at its parent.
    let field = match inner.strip_prefix("unknown field `").and_then(|r| r.split('`').next()) {
        Some(name) if path == "." => name.to_string(),
        Some(name) if path.rsplit(['.', ']']).next() == Some(name) => path,
        Some(name) => format!("{path}.{name}"),
        None => path,
    };
    RouterError::InvalidJson(format!("`{field}`: {inner}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::http::openai::types::{ChatCompletionRequest, CompletionRequest};

    async fn parse<T: DeserializeOwned + OpenAiBody>(body: &str) -> Result<T, RouterError> {
        let req = Request::builder().body(axum::body::Body::from(body.to_string())).unwrap();
        OpenAiJson::<T>::from_request(req, &()).await.map(|OpenAiJson(t)| t)
    }

    #[tokio::test]
    async fn unknown_fields_are_named() {
        let e = parse::<CompletionRequest>(r#"{"prompt": "a", "frobnicate": 1}"#).await.unwrap_err();
        assert!(matches!(&e, RouterError::InvalidJson(m) if m.starts_with("`frobnicate`")), "{e}");
        let e = parse::<ChatCompletionRequest>(r#"{"messages": [{"role": "user", "content": "a", "foo": 1}]}"#)
            .await
            .unwrap_err();
        assert_eq!(e.param().as_deref(), Some("messages[0].foo"), "{e}");
    }

    #[tokio::test]
    async fn type_errors_name_the_field() {
        let e = parse::<CompletionRequest>(r#"{"prompt": "a", "min_tokens": "x"}"#).await.unwrap_err();
        assert_eq!(e.param().as_deref(), Some("min_tokens"), "{e}");
        let e = parse::<CompletionRequest>(r#"{"prompt": "a", "logprobs": -1}"#).await.unwrap_err();
        assert_eq!(e.param().as_deref(), Some("logprobs"), "{e}");
    }

    #[tokio::test]
    async fn what_the_routers_send_parses_and_bad_types_are_named() {
        let body = r#"{"model": "m", "prompt": "hello", "max_tokens": 3, "stream": false, "echo": false,
            "no_stop_trim": false, "ignore_eos": false, "skip_special_tokens": true, "return_hidden_states": false}"#;
        let r = parse::<CompletionRequest>(body).await.unwrap();
        assert_eq!(r.sampling.engine.skip_special_tokens, Some(true));
        let body = r#"{"messages": [{"role": "user", "content": "hi"}], "model": "m", "logprobs": false,
            "max_completion_tokens": 3, "stream": true, "no_stop_trim": false, "ignore_eos": false,
            "continue_final_message": false, "skip_special_tokens": true, "separate_reasoning": true,
            "stream_reasoning": true, "return_hidden_states": false, "include_reasoning": true}"#;
        let r = parse::<ChatCompletionRequest>(body).await.unwrap();
        assert_eq!((r.separate_reasoning, r.include_reasoning), (Some(true), Some(true)));
        for (body, field) in [
            (r#"{"prompt": "a", "no_stop_trim": "yes"}"#, "no_stop_trim"),
            (r#"{"prompt": "a", "skip_special_tokens": 1}"#, "skip_special_tokens"),
            (r#"{"prompt": "a", "structured_outputs": {"regex": 5}}"#, "structured_outputs.regex"),
            (r#"{"messages": [], "continue_final_message": "no"}"#, "continue_final_message"),
            (r#"{"messages": [], "separate_reasoning": []}"#, "separate_reasoning"),
        ] {
            let e = match body.contains("messages") {
                true => parse::<ChatCompletionRequest>(body).await.unwrap_err(),
                false => parse::<CompletionRequest>(body).await.unwrap_err(),
            };
            assert_eq!(e.param().as_deref(), Some(field), "{e}");
        }
        let e = parse::<CompletionRequest>(r#"{"prompt": "a", "rid": "x"}"#).await.unwrap_err();
        assert_eq!(e.param().as_deref(), Some("rid"), "other engines' fields stay unknown: {e}");
    }

    #[tokio::test]
    async fn token_id_prompts_parse() {
        use crate::http::openai::types::Prompt;
        let r = parse::<CompletionRequest>(r#"{"prompt": [504, 6102]}"#).await.unwrap();
        assert!(matches!(r.prompt, Prompt::Ids(ref v) if v == &[504, 6102]));
        let r = parse::<CompletionRequest>(r#"{"prompt": [[1], [2, 3]], "ignore_eos": true}"#).await.unwrap();
        assert!(matches!(r.prompt, Prompt::IdLists(ref v) if v.len() == 2));
        assert!(r.sampling.ignore_eos);
    }
}

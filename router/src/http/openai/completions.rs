//! `POST /v1/completions` (OpenAI's legacy text completions): a prompt or a
//! list of prompts (text or token ids), `n` choices each; choice `i` of
//! prompt `p` has index `p * n + i`.

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;

use super::stream::{self, ChoiceEvent, ChoiceMsg};
use super::types::{CompletionChoice, CompletionRequest, CompletionResponse, PromptInput, Usage};
use super::{logprobs, ResponseMeta};
use crate::error::{OpenAiErrorBody, RouterError};
use crate::http::extract::OpenAiJson;
use crate::http::tenant::Tenant;
use crate::http::{headers, AppState};
use crate::infer::GenerateInput;
use crate::response::PrefillToken;

fn invalid(msg: impl Into<String>) -> RouterError {
    RouterError::Validation(msg.into())
}

/// Text completion (OpenAI API).
#[utoipa::path(post, path = "/v1/completions", tag = "OpenAI", request_body = CompletionRequest,
    responses(
        (status = 200, description = "The completion, or `text_completion` SSE chunks when `stream`", content(
            (CompletionResponse = "application/json"), (CompletionResponse = "text/event-stream"))),
        (status = 401, description = "Missing or wrong API key", body = OpenAiErrorBody),
        (status = 400, description = "Invalid input, or a field this route does not accept", body = OpenAiErrorBody),
        (status = 424, description = "Generation failed", body = OpenAiErrorBody),
        (status = 413, description = "Body over --payload-limit", body = OpenAiErrorBody),
        (status = 429, description = "Too many concurrent requests, or queued past --max-queue-wait-ms", body = OpenAiErrorBody),
        (status = 503, description = "Shutting down (draining)", body = OpenAiErrorBody),
    ))]
pub async fn completions(
    State(app): State<AppState>,
    tenant: Tenant,
    OpenAiJson(mut req): OpenAiJson<CompletionRequest>,
) -> Result<Response, RouterError> {
    tenant.fill(&mut req.sampling.user);
    let tokenizer = app.infer.validation().tokenizer().clone();
    // The text of each prompt (for `echo`), and its token ids when given as ids.
    let prompts: Vec<(String, Option<Vec<u32>>)> = req
        .prompt
        .clone()
        .into_inputs()
        .into_iter()
        .map(|p| match p {
            PromptInput::Text(t) => (t, None),
            PromptInput::Ids(ids) => (tokenizer.decode(&ids, false).unwrap_or_default(), Some(ids)),
        })
        .collect();
    if prompts.is_empty() {
        return Err(invalid("`prompt` must not be empty"));
    }
    // Each prompt holds a concurrency permit: a list longer than the limit
    // could never be served, and a 429 would have clients retry it forever.
    let max_prompts = app.info.max_concurrent_requests as usize;
    if prompts.len() > max_prompts {
        return Err(invalid(format!(
            "`prompt` lists at most {max_prompts} prompts (--max-concurrent-requests). Given: {}",
            prompts.len()
        )));
    }
    let max_top = app.infer.validation().limits().max_top_n_tokens;
    if let Some(k) = req.logprobs.filter(|&k| k > max_top) {
        return Err(invalid(format!("`logprobs` must be <= {max_top}. Given: {k}")));
    }
    if req.echo && req.sampling.stream {
        return Err(invalid("`echo` is not supported with `stream`"));
    }
    let want_prompt_logprobs = match req.prompt_logprobs {
        None => false,
        Some(0) if req.sampling.stream => return Err(invalid("`prompt_logprobs` is not supported with `stream`")),
        Some(0) => true,
        Some(k) => {
            let why = "the prompt tokens' own logprobs; alternatives are not computed";
            return Err(invalid(format!("`prompt_logprobs` must be 0 ({why}). Given: {k}")));
        }
    };
    let mut parameters = req.sampling.to_parameters(req.sampling.max_tokens, req.logprobs)?;
    parameters.decoder_input_details = want_prompt_logprobs;
    let n = req.sampling.n.unwrap_or(1);
    let meta = ResponseMeta::new(&app, "cmpl");
    let inputs = |(text, ids): &(String, Option<Vec<u32>>)| GenerateInput {
        // Token ids are the whole prompt: no BOS is added in front of them.
        add_special_tokens: ids.is_none(),
        input_ids: ids.clone(),
        ..GenerateInput::new(text.clone(), parameters.clone())
    };

    if req.sampling.stream {
        let mut handles = Vec::new();
        let mut prompt_tokens = 0;
        for (p, prompt) in prompts.iter().enumerate() {
            let hs = app.infer.generate_streams(inputs(prompt), n, "n").await?;
            prompt_tokens += hs.first().map_or(0, |h| h.request.input_ids.len() as u32);
            handles.extend(hs.into_iter().enumerate().map(|(i, h)| ((p as u32) * n + i as u32, h)));
        }
        let want_logprobs = req.logprobs.is_some();
        let chunk_meta = meta.clone();
        let chunk = move |msg: &ChoiceMsg| {
            let (token, top, finish) = match &msg.event {
                ChoiceEvent::Token { token, top_tokens } => (token, top_tokens, None),
                ChoiceEvent::End { token, top_tokens, generated } => {
                    (token, top_tokens, Some(generated.finish_reason.openai().to_string()))
                }
            };
            let text = if token.special { String::new() } else { token.text.clone() };
            let logprobs = want_logprobs
                .then(|| logprobs::completion(&tokenizer, std::slice::from_ref(token), std::slice::from_ref(top), 0));
            let choice =
                CompletionChoice { index: msg.index, text, logprobs, prompt_logprobs: None, finish_reason: finish };
            vec![stream::chunk_event(&response_of(&chunk_meta, vec![choice], None))]
        };
        let usage = req.sampling.include_usage().then(|| {
            Box::new(move |u: Usage| stream::chunk_event(&response_of(&meta, vec![], Some(u)))) as stream::UsageFn
        });
        return Ok(stream::sse(handles, prompt_tokens, Box::new(chunk), usage, stream::OPENAI));
    }

    let per_prompt =
        futures::future::try_join_all(prompts.iter().map(|p| app.infer.generate_n(inputs(p), n, "n"))).await?;
    let prompt_tokens = per_prompt.iter().filter_map(|rs| rs.first()).map(|r| r.input_length).sum();
    let completion_tokens = per_prompt.iter().flatten().map(|r| r.generated_text.generated_tokens).sum();
    let headers = per_prompt
        .first()
        .and_then(|rs| rs.first())
        .map(|r| headers::timing(r, &app.info.model_device_type, completion_tokens))
        .unwrap_or_default();
    let mut choices = Vec::new();
    for (p, responses) in per_prompt.iter().enumerate() {
        for (i, r) in responses.iter().enumerate() {
            let echo = if req.echo { prompts[p].0.as_str() } else { "" };
            choices.push(CompletionChoice {
                index: (p as u32) * n + i as u32,
                text: format!("{echo}{}", r.generated_text.text),
                logprobs: req
                    .logprobs
                    .map(|_| logprobs::completion(&tokenizer, &r.tokens, &r.top_tokens, echo.chars().count())),
                prompt_logprobs: want_prompt_logprobs.then(|| prompt_logprobs(&r.prefill)),
                finish_reason: Some(r.generated_text.finish_reason.openai().to_string()),
            });
        }
    }
    let body = response_of(&meta, choices, Some(Usage::new(prompt_tokens, completion_tokens)));
    Ok((headers, Json(body)).into_response())
}

/// vLLM's shape: per prompt token `{"<id>": {"logprob", "decoded_token"}}`, `null`
/// where there is none (the first token; tokens served from the prefix cache).
fn prompt_logprobs(prefill: &[PrefillToken]) -> Vec<Option<serde_json::Value>> {
    prefill
        .iter()
        .map(|t| {
            t.logprob.map(|lp| serde_json::json!({ t.id.to_string(): { "logprob": lp, "decoded_token": t.text } }))
        })
        .collect()
}

fn response_of(meta: &ResponseMeta, choices: Vec<CompletionChoice>, usage: Option<Usage>) -> CompletionResponse {
    CompletionResponse {
        id: meta.id.clone(),
        object: "text_completion".into(),
        created: meta.created,
        model: meta.model.clone(),
        system_fingerprint: meta.system_fingerprint.clone(),
        choices,
        usage,
    }
}

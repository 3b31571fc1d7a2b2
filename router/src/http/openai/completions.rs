//! `POST /v1/completions` (OpenAI's legacy text completions): a prompt or a
//! list of prompts (text or token ids), `n` choices each; choice `i` of
//! prompt `p` has index `p * n + i`. What it is asked of the prompt (`echo`
//! with `logprobs`, `prompt_logprobs`, `max_tokens: 0`): scoring.rs.

use std::sync::Arc;

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use tokenizers::Tokenizer;

use super::scoring::{scoring, vllm_prompt_logprobs, Scoring};
use super::types::{CompletionChoice, CompletionRequest, CompletionResponse, PromptInput, Usage};
use super::{logprobs, OPENAI};
use crate::error::{OpenAiErrorBody, RouterError};
use crate::grammar::GrammarParam;
use crate::http::extract::OpenAiJson;
use crate::http::response_meta::ResponseMeta;
use crate::http::sse::{self, json_event, ChoiceEvent, ChoiceMsg, UsageFn};
use crate::http::tenant::Tenant;
use crate::http::{headers, AppState};
use crate::infer::{GenerateInput, InferResponse};
use crate::request::GenerateParameters;

fn invalid(msg: impl Into<String>) -> RouterError {
    RouterError::Validation(msg.into())
}

/// One prompt: its text (for `echo`), and its token ids when given as ids.
type Prompt = (String, Option<Vec<u32>>);

/// Text completion (OpenAI API).
#[utoipa::path(post, path = "/v1/completions", tag = "OpenAI", request_body = CompletionRequest,
    responses(
        (status = 200, description = "The completion, or `text_completion` SSE chunks when `stream`", content(
            (CompletionResponse = "application/json"), (CompletionResponse = "text/event-stream"))),
        (status = 401, description = "Missing or wrong API key", body = OpenAiErrorBody),
        (status = 404, description = "`model` names no model this server serves (with --enable-lora)", body = OpenAiErrorBody),
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
    let prompts = prompts(&req, &tokenizer);
    check(&app, &req, prompts.len())?;
    let scored = scoring(&req)?;
    let mut parameters = parameters(&req)?;
    parameters.adapter = app.lora.for_model(req.sampling.model.as_deref())?;
    let n = req.sampling.n.unwrap_or(1);
    let meta = ResponseMeta::new(&app, "cmpl").serving(parameters.adapter.as_ref());
    let inputs: Vec<GenerateInput> = prompts
        .iter()
        .map(|(text, ids)| GenerateInput {
            // Token ids are the whole prompt: no BOS is added in front of them.
            add_special_tokens: ids.is_none(),
            input_ids: ids.clone(),
            ..GenerateInput::new(text.clone(), parameters.clone())
        })
        .collect();
    if req.sampling.stream {
        return stream(&app, &req, inputs, n, meta, tokenizer).await;
    }
    let per_prompt =
        futures::future::try_join_all(inputs.into_iter().map(|input| app.infer.generate_n(input, n, "n"))).await?;
    let prompt_tokens = per_prompt.iter().filter_map(|rs| rs.first()).map(|r| r.input_length).sum();
    let completion_tokens = if scored.score_only {
        0
    } else {
        per_prompt.iter().flatten().map(|r| r.generated_text.generated_tokens).sum()
    };
    let headers = per_prompt
        .first()
        .and_then(|rs| rs.first())
        .map(|r| headers::timing(r, &app.info.model_device_type, completion_tokens))
        .unwrap_or_default();
    let mut choices = Vec::new();
    for (p, responses) in per_prompt.iter().enumerate() {
        let echo = if req.echo { prompts[p].0.as_str() } else { "" };
        for (i, r) in responses.iter().enumerate() {
            let index = (p as u32) * n + i as u32;
            choices.push(whole_choice(index, r, &req, echo, scored, &tokenizer));
        }
    }
    let body = response_of(&meta, choices, Some(Usage::new(prompt_tokens, completion_tokens)));
    Ok((headers, Json(body)).into_response())
}

/// The prompts of a request, text or token ids (decoded for `echo`).
fn prompts(req: &CompletionRequest, tokenizer: &Tokenizer) -> Vec<Prompt> {
    req.prompt
        .clone()
        .into_inputs()
        .into_iter()
        .map(|p| match p {
            PromptInput::Text(t) => (t, None),
            PromptInput::Ids(ids) => (tokenizer.decode(&ids, false).unwrap_or_default(), Some(ids)),
        })
        .collect()
}

/// What this route (and its render) refuses before generating anything.
pub(super) fn check(app: &AppState, req: &CompletionRequest, num_prompts: usize) -> Result<(), RouterError> {
    if num_prompts == 0 {
        return Err(invalid("`prompt` must not be empty"));
    }
    // Each prompt holds a concurrency permit: a list longer than the limit
    // could never be served, and a 429 would have clients retry it forever.
    let max_prompts = app.info.max_concurrent_requests as usize;
    if num_prompts > max_prompts {
        return Err(invalid(format!(
            "`prompt` lists at most {max_prompts} prompts (--max-concurrent-requests). Given: {num_prompts}"
        )));
    }
    let max_top = app.infer.validation().limits().max_top_n_tokens;
    if let Some(k) = req.logprobs.filter(|&k| k > max_top) {
        return Err(invalid(format!("`logprobs` must be <= {max_top}. Given: {k}")));
    }
    if req.echo && req.sampling.stream {
        return Err(invalid("`echo` is not supported with `stream`"));
    }
    check_engine_fields(req)
}

/// The generation parameters, with what the request asks of its prompt (`scoring.rs`); SGLang's
/// `json_schema` is one more way to give the grammar.
pub fn parameters(req: &CompletionRequest) -> Result<GenerateParameters, RouterError> {
    let scored = scoring(req)?;
    let mut parameters = req.sampling.to_parameters(scored.max_tokens(req.sampling.max_tokens), req.logprobs)?;
    parameters.decoder_input_details = scored.prompt;
    parameters.extras.prompt_top_n = scored.top_n;
    if let Some(schema) = req.json_schema.clone().filter(|s| !s.is_null()) {
        if parameters.grammar.is_some() {
            return Err(invalid("`json_schema` cannot be combined with another constraint: give one"));
        }
        parameters.grammar = Some(GrammarParam::Json(schema));
    }
    Ok(parameters)
}

/// `suffix` (fill-in-the-middle) and `best_of` above `n` are not done.
fn check_engine_fields(req: &CompletionRequest) -> Result<(), RouterError> {
    if req.suffix.as_deref().is_some_and(|s| !s.is_empty()) {
        return Err(RouterError::Unsupported("`suffix`: fill-in-the-middle is not supported".into()));
    }
    let n = req.sampling.n.unwrap_or(1);
    match req.best_of {
        Some(b) if b < n => Err(invalid(format!("`best_of` must be >= `n`. Given: best_of {b}, n {n}"))),
        Some(b) if b > n => Err(RouterError::Unsupported(format!(
            "`best_of`: only equal to `n` (every generated choice is returned). Given: best_of {b}, n {n}"
        ))),
        _ => Ok(()),
    }
}

/// One choice of a whole reply. With `max_tokens: 0` the generated token is left out: the
/// text is the echoed prompt, and the reply ends on the length it was given.
fn whole_choice(
    index: u32,
    r: &InferResponse,
    req: &CompletionRequest,
    echo: &str,
    scored: Scoring,
    tokenizer: &Tokenizer,
) -> CompletionChoice {
    let prompt = if req.echo { r.prefill.as_slice() } else { &[] };
    let (text, tokens, top) = match scored.score_only {
        true => (String::new(), &[][..], &[][..]),
        false => (r.generated_text.text.clone(), r.tokens.as_slice(), r.top_tokens.as_slice()),
    };
    let finish = if scored.score_only { "length" } else { r.generated_text.finish_reason.openai() };
    CompletionChoice {
        index,
        text: format!("{echo}{text}"),
        logprobs: req.logprobs.map(|_| logprobs::completion(tokenizer, prompt, tokens, top)),
        prompt_logprobs: req.prompt_logprobs.map(|k| vllm_prompt_logprobs(&r.prefill, k)),
        finish_reason: Some(finish.to_string()),
    }
}

/// `text_completion` chunks, one per token of each choice, then usage if asked.
async fn stream(
    app: &AppState,
    req: &CompletionRequest,
    inputs: Vec<GenerateInput>,
    n: u32,
    meta: ResponseMeta,
    tokenizer: Arc<Tokenizer>,
) -> Result<Response, RouterError> {
    let mut handles = Vec::new();
    let mut prompt_tokens = 0;
    for (p, input) in inputs.into_iter().enumerate() {
        let hs = app.infer.generate_streams(input, n, "n").await?;
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
            .then(|| logprobs::completion(&tokenizer, &[], std::slice::from_ref(token), std::slice::from_ref(top)));
        let choice =
            CompletionChoice { index: msg.index, text, logprobs, prompt_logprobs: None, finish_reason: finish };
        vec![json_event(&response_of(&chunk_meta, vec![choice], None))]
    };
    let usage = req.sampling.include_usage().then(|| {
        let usage =
            move |prompt, completion| json_event(&response_of(&meta, vec![], Some(Usage::new(prompt, completion))));
        Box::new(usage) as UsageFn
    });
    Ok(sse::sse(handles, prompt_tokens, Box::new(chunk), usage, OPENAI))
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

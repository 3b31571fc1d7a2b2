//! The HTTP side's door to the scheduler: validates, enforces the
//! concurrency limit, enqueues (one entry, or `n` grouped entries for
//! `n`/`best_of`), and hands back response streams that record latency.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use std::collections::VecDeque;

use rand::Rng;
use tokio::sync::{mpsc, watch, OwnedSemaphorePermit, Semaphore};

use crate::error::RouterError;
use crate::queue::{Entry, ResponseRx};
use crate::request::{GenerateParameters, ValidRequest};
use crate::response::{PrefillToken, Token};
use crate::routing::Placer;
use crate::shared_state::RouterState;
use crate::stream::{GeneratedText, InferStreamResponse, TextContext, TextStream};
use crate::validation::Validation;

#[derive(Clone)]
pub struct Infer {
    validation: Validation,
    /// Places each request on a shard group and hands it to its loop.
    placer: Arc<Placer>,
    limit: Arc<Semaphore>,
    max_concurrent_requests: u32,
    /// `--max-queue-wait-ms`: how long a request may wait for admission.
    max_queue_wait: Option<Duration>,
    /// Turns true when the shutdown timeout passes with requests still
    /// running: their streams end with a `shutting_down` error then.
    cutoff: Arc<watch::Sender<bool>>,
    next_id: Arc<AtomicU64>,
    state: Arc<RouterState>,
    text: TextContext,
}

/// What to generate from: the prompt text and the TGI parameters every
/// route is translated into.
#[derive(Debug, Clone)]
pub struct GenerateInput {
    pub inputs: String,
    pub parameters: GenerateParameters,
    /// False for rendered chat prompts (the template wrote the BOS).
    pub add_special_tokens: bool,
    /// The prompt as token ids (`/v1/completions`): used as given instead of
    /// tokenizing `inputs` (which is then their decoded text).
    pub input_ids: Option<Vec<u32>>,
}

impl GenerateInput {
    pub fn new(inputs: String, parameters: GenerateParameters) -> Self {
        Self { inputs, parameters, add_special_tokens: true, input_ids: None }
    }
}

/// A whole generation, collected from the stream.
#[derive(Debug)]
pub struct InferResponse {
    pub input_length: u32,
    pub prefill: Vec<PrefillToken>,
    pub tokens: Vec<Token>,
    pub top_tokens: Vec<Vec<Token>>,
    pub generated_text: GeneratedText,
    /// Request arrival (before validation).
    pub start: Instant,
    /// Validated and enqueued.
    pub queued_at: Instant,
    /// Admitted into a prefill.
    pub started_at: Instant,
}

impl InferResponse {
    /// Sum of the generated tokens' logprobs: how `best_of` ranks candidates.
    pub fn cumulative_logprob(&self) -> f64 {
        self.tokens.iter().map(|t| t.logprob as f64).filter(|x| x.is_finite()).sum()
    }
}

pub struct StreamHandle {
    /// Held while any stream of the request is alive: the request counts
    /// once against the concurrency limit, whatever its `n`.
    pub permit: Arc<OwnedSemaphorePermit>,
    pub request: ValidRequest,
    pub rx: ResponseRx,
    pub start: Instant,
    pub queued_at: Instant,
    last_token: Option<Instant>,
    cutoff: watch::Receiver<bool>,
    state: Arc<RouterState>,
    /// Token ids become text here, and stop sequences end the stream here.
    text: TextStream,
    pending: VecDeque<InferStreamResponse>,
}

impl StreamHandle {
    /// The next message of the stream, with TTFT / inter-token / end-to-end
    /// latency recorded as the client will see it.
    pub async fn next(&mut self) -> Option<Result<InferStreamResponse, RouterError>> {
        let msg = loop {
            if let Some(m) = self.pending.pop_front() {
                if matches!(m, InferStreamResponse::End { .. }) {
                    // The scheduler sees the stream closed and lets the sequence go
                    // (a stop sequence ends it like a disconnect would).
                    self.rx.close();
                }
                break Ok(m);
            }
            if self.text.ended() {
                return None;
            }
            let event = tokio::select! {
                biased;
                msg = self.rx.recv() => msg?,
                // A dropped sender (the router is gone) disables this branch.
                Ok(_) = self.cutoff.wait_for(|cut| *cut) => {
                    return Some(Err(RouterError::ShuttingDown(
                        "the shutdown timeout passed before this request finished".into(),
                    )))
                }
            };
            match event {
                Ok(event) => self.text.apply(event, &mut self.pending),
                Err(e) => break Err(e),
            }
        };
        let now = Instant::now();
        let m = &self.state.metrics;
        if let Ok(InferStreamResponse::Token { .. } | InferStreamResponse::End { .. }) = &msg {
            match self.last_token {
                None => m.time_to_first_token.observe((now - self.start).as_secs_f64()),
                Some(t) => m.inter_token_latency.observe((now - t).as_secs_f64()),
            }
            self.last_token = Some(now);
        }
        if let Ok(InferStreamResponse::End { generated_text, queued_at, started_at, .. }) = &msg {
            m.request_duration.observe((now - self.start).as_secs_f64());
            m.queue_time.observe(started_at.saturating_duration_since(*queued_at).as_secs_f64());
            m.request_generated_tokens.observe(generated_text.generated_tokens as f64);
        }
        Some(msg)
    }

    pub async fn collect(mut self) -> Result<InferResponse, RouterError> {
        let mut prefill = Vec::new();
        let mut tokens = Vec::new();
        let mut top = Vec::new();
        while let Some(msg) = self.next().await {
            match msg? {
                InferStreamResponse::Prefill(p) => prefill = p,
                InferStreamResponse::Token { token, top_tokens } => {
                    tokens.push(token);
                    top.push(top_tokens);
                }
                InferStreamResponse::End { token, top_tokens, generated_text, queued_at, started_at } => {
                    tokens.push(token);
                    top.push(top_tokens);
                    if top.iter().all(|t| t.is_empty()) {
                        top.clear();
                    }
                    return Ok(InferResponse {
                        input_length: self.request.input_ids.len() as u32,
                        prefill,
                        tokens,
                        top_tokens: top,
                        generated_text,
                        start: self.start,
                        queued_at,
                        started_at,
                    });
                }
            }
        }
        Err(RouterError::Generation("the request ended without a final token".into()))
    }
}

/// Seed of the `i`-th sequence of a fanned-out request: the request's own
/// seed for the first (so `n=1` and choice 0 agree), then a splitmix64 mix,
/// which keeps them distinct and reproducible.
pub fn fork_seed(seed: u64, i: u32) -> u64 {
    if i == 0 {
        return seed;
    }
    let mut z = seed.wrapping_add((i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15));
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The `i`-th of `n` sequences of a request: its own seed when there are several.
fn fork(request: &ValidRequest, n: u32, i: u32) -> ValidRequest {
    let mut request = request.clone();
    if n > 1 {
        if let Some(seed) = request.seed {
            let s = fork_seed(seed, i);
            request.seed = Some(s);
            request.parameters.seed = s;
            request.parameters.has_seed = true;
        }
    }
    request
}

impl Infer {
    pub fn new(
        validation: Validation,
        placer: Arc<Placer>,
        max_concurrent_requests: u32,
        max_queue_wait: Option<Duration>,
        state: Arc<RouterState>,
        text: TextContext,
    ) -> Self {
        Self {
            validation,
            placer,
            limit: Arc::new(Semaphore::new(max_concurrent_requests as usize)),
            max_concurrent_requests,
            max_queue_wait,
            cutoff: Arc::new(watch::channel(false).0),
            next_id: Arc::new(AtomicU64::new(0)),
            state,
            text,
        }
    }

    pub fn placer(&self) -> &Arc<Placer> {
        &self.placer
    }

    pub fn validation(&self) -> &Validation {
        &self.validation
    }

    /// Requests holding a concurrency permit: accepted and not yet answered
    /// (a stream counts until its last event is produced).
    pub fn in_flight(&self) -> usize {
        self.max_concurrent_requests as usize - self.limit.available_permits()
    }

    fn refuse_if_draining(&self) -> Result<(), RouterError> {
        if self.state.draining.load(Ordering::SeqCst) {
            return Err(RouterError::ShuttingDown("not accepting new requests".into()));
        }
        Ok(())
    }

    /// Waits until every accepted request is answered, or `timeout` passes;
    /// returns whether it drained. New requests are refused meanwhile
    /// (`RouterState::draining`), so this only ever goes down.
    pub async fn drain(&self, timeout: Duration) -> bool {
        let deadline = tokio::time::Instant::now() + timeout;
        while self.in_flight() > 0 {
            if tokio::time::Instant::now() >= deadline {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        true
    }

    /// Ends every running request now with a `shutting_down` error (stream
    /// event or status): past the shutdown timeout, nothing closes silently.
    pub fn cut_off(&self) {
        self.cutoff.send_replace(true);
    }

    pub async fn generate_stream(&self, input: GenerateInput) -> Result<StreamHandle, RouterError> {
        let mut handles = self.generate_streams(input, 1, "n").await?;
        Ok(handles.remove(0))
    }

    /// Submits `n` sequences of one prompt: distinct seeds, one shared
    /// `Entry.group` so the scheduler can share their prompt's KV blocks.
    /// `name` is the client's parameter (`n` or `best_of`) for error messages.
    pub async fn generate_streams(
        &self,
        input: GenerateInput,
        n: u32,
        name: &str,
    ) -> Result<Vec<StreamHandle>, RouterError> {
        let start = Instant::now();
        let permit = Arc::new(self.permit()?);
        let text_options = input.parameters.extras.text;
        let request = self.valid_request(input, n, name).await?;
        let first_id = self.next_id.fetch_add(n as u64, Ordering::Relaxed);
        let group = (n > 1).then_some(first_id);
        let queued_at = Instant::now();
        let queue_deadline = self.max_queue_wait.map(|w| queued_at + w);
        let mut handles = Vec::with_capacity(n as usize);
        let mut entries = Vec::with_capacity(n as usize);
        for i in 0..n {
            let request = fork(&request, n, i);
            let (tx, rx) = mpsc::unbounded_channel();
            let id = first_id + i as u64;
            entries.push(Entry { id, request: request.clone(), response_tx: tx, queued_at, queue_deadline, group });
            let text = TextStream::new(self.text.clone(), &request, text_options, queued_at);
            handles.push(StreamHandle {
                permit: permit.clone(),
                request,
                rx,
                start,
                queued_at,
                last_token: None,
                cutoff: self.cutoff.subscribe(),
                state: self.state.clone(),
                text,
                pending: VecDeque::new(),
            });
        }
        self.placer.place(entries)?;
        RouterState::add(&self.state.requests_total, 1);
        if let Some(adapter) = &request.adapter {
            *self
                .state
                .lora_requests
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .entry(adapter.name.clone())
                .or_default() += 1;
        }
        let input_len = request.input_ids.len() as u64;
        RouterState::add(&self.state.metrics.prompt_tokens_total, input_len);
        self.state.metrics.request_input_tokens.observe(input_len as f64);
        Ok(handles)
    }

    /// A concurrency permit, or why the request is refused (over the limit, draining).
    fn permit(&self) -> Result<OwnedSemaphorePermit, RouterError> {
        self.refuse_if_draining()?;
        // Fail fast past the limit rather than queue without bound.
        let permit = self.limit.clone().try_acquire_owned().map_err(|_| {
            RouterError::Overloaded(format!("more than {} concurrent requests", self.max_concurrent_requests))
        })?;
        // Checked again after taking the permit: `drain` waits for every
        // permit taken before `draining` was set, and every later one sees it.
        self.refuse_if_draining()?;
        Ok(permit)
    }

    /// The validated request of `n` sequences, with the seed every sampled
    /// sequence gets (so that it is reported and a recomputed, preempted
    /// sequence draws the same tokens again).
    async fn valid_request(&self, input: GenerateInput, n: u32, name: &str) -> Result<ValidRequest, RouterError> {
        self.validation.check_fanout(name, n)?;
        let mut request =
            self.validation.validate(input.inputs, input.input_ids, input.parameters, input.add_special_tokens).await?;
        if let Err(e) = self.validation.check_fits_pool(&request, n) {
            RouterState::add(&self.state.requests_too_large_total, 1);
            return Err(e);
        }
        if n > 1 && !request.parameters.do_sample {
            // Greedy sequences would all be the same (TGI and vLLM reject this too).
            return Err(RouterError::Validation(format!(
                "`{name}` > 1 requires sampling: set a temperature > 0 (or `do_sample`)"
            )));
        }
        if request.parameters.do_sample && request.seed.is_none() {
            request.seed = Some(rand::rng().random());
        }
        if let Some(seed) = request.seed {
            request.parameters.seed = seed;
            request.parameters.has_seed = true;
        }
        Ok(request)
    }

    pub async fn generate(&self, input: GenerateInput) -> Result<InferResponse, RouterError> {
        self.generate_stream(input).await?.collect().await
    }

    /// All `n` sequences, in submission order.
    pub async fn generate_n(
        &self,
        input: GenerateInput,
        n: u32,
        name: &str,
    ) -> Result<Vec<InferResponse>, RouterError> {
        let handles = self.generate_streams(input, n, name).await?;
        futures::future::try_join_all(handles.into_iter().map(StreamHandle::collect)).await
    }

    /// One reply (the Messages and Responses APIs, which have no `n`).
    pub async fn generate_one(&self, input: GenerateInput) -> Result<InferResponse, RouterError> {
        let mut replies = self.generate_n(input, 1, "n").await?;
        replies.pop().ok_or_else(|| RouterError::Generation("no reply".into()))
    }
}

#[cfg(test)]
mod tests {
    use super::fork_seed;

    #[test]
    fn fork_seeds_are_stable_and_distinct() {
        assert_eq!(fork_seed(42, 0), 42);
        let seeds: std::collections::HashSet<u64> = (0..64).map(|i| fork_seed(42, i)).collect();
        assert_eq!(seeds.len(), 64);
        assert_eq!(fork_seed(42, 3), fork_seed(42, 3));
        assert_ne!(fork_seed(42, 1), fork_seed(43, 1));
    }
}

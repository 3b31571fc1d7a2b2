//! A sequence as the scheduler sees it: token ids, KV blocks, and how far
//! the shard has computed. No text and no channel: those belong to the
//! request's stream and to the batching loop.

use std::time::Instant;

use super::prompt_logprobs::PromptLogprobs;
use crate::adapter::Adapter;
use crate::kv::KvBlocks;
use crate::proto::pb;
use crate::queue::Entry;
use crate::request::ValidRequest;

#[derive(Debug)]
pub struct Sequence {
    pub id: u64,
    pub request: ValidRequest,
    pub group: Option<u64>,
    pub queued_at: Instant,
    pub queue_deadline: Option<Instant>,
    /// Prompt then every generated token: what a resumed sequence recomputes.
    pub tokens: Vec<u32>,
    /// None while queued (new, or preempted and waiting to resume).
    pub blocks: Option<KvBlocks>,
    /// Leading tokens whose KV the shard has written into `blocks`.
    pub num_computed: u32,
    /// Leading entries of the block table the shard already has.
    pub sent_blocks: usize,
    /// The shard holds this sequence's state (else its next step carries a NewRequest).
    pub on_shard: bool,
    /// A first token was sampled since admission: it decodes now.
    pub prefilled: bool,
    pub generated: u32,
    /// Admission order; the newest running sequence is preempted first.
    pub admitted_at: u64,
    pub started_at: Instant,
    pub preemptions: u32,
    /// Arrival order (set by `State::enqueue`); kept across preemptions,
    /// so a resumed sequence keeps its place ahead of later arrivals.
    pub arrival: u64,
    /// Tokens whose KV the last preemption gave up (what resuming recomputes
    /// unless the prefix cache still holds them).
    pub lost: u32,
    /// The prompt's logprobs as they come, when the request asked for them.
    pub prompt_lps: Option<PromptLogprobs>,
}

impl Sequence {
    pub fn new(entry: Entry) -> Self {
        let Entry { id, request, queued_at, queue_deadline, group, .. } = entry;
        let prompt_lps =
            request.decoder_input_details.then(|| PromptLogprobs::new(request.input_ids.len(), request.prompt_top_n));
        Self {
            id,
            tokens: request.input_ids.clone(),
            request,
            group,
            queued_at,
            queue_deadline,
            blocks: None,
            num_computed: 0,
            sent_blocks: 0,
            on_shard: false,
            prefilled: false,
            generated: 0,
            admitted_at: 0,
            started_at: queued_at,
            preemptions: 0,
            arrival: 0,
            lost: 0,
            prompt_lps,
        }
    }

    pub fn priority(&self) -> i32 {
        self.request.priority
    }

    /// Priority for admission order at `now`: every `aging` waited counts as
    /// one step up (lower value). Everyone ages alike, so only newcomers of a
    /// better priority q that arrive within (priority - q) x `aging` after
    /// this one can overtake it: the starvation bound.
    pub fn effective_priority(&self, now: Instant, aging: Option<std::time::Duration>) -> i64 {
        let steps = match aging {
            Some(a) if !a.is_zero() => (now.saturating_duration_since(self.queued_at).as_nanos() / a.as_nanos()) as i64,
            _ => 0,
        };
        self.priority() as i64 - steps
    }

    pub fn len(&self) -> u32 {
        self.tokens.len() as u32
    }

    /// Tokens not yet computed: the prompt's rest, or the last sampled token.
    pub fn pending(&self) -> u32 {
        self.len() - self.num_computed
    }

    pub fn remaining_new_tokens(&self) -> u32 {
        self.request.max_new_tokens.saturating_sub(self.generated)
    }

    /// Still waiting at `now`: resumed sequences never time out (their
    /// client already has part of the answer).
    pub fn overdue(&self, now: Instant) -> bool {
        matches!(self.queue_deadline, Some(d) if self.preemptions == 0 && now >= d)
    }

    /// What the shard needs on this sequence's first step after admission.
    pub fn new_request(&self) -> pb::NewRequest {
        let r = &self.request;
        pb::NewRequest {
            input_ids: self.tokens.clone(),
            parameters: Some(r.parameters.clone()),
            stopping_parameters: Some(pb::StoppingCriteriaParameters {
                max_new_tokens: self.remaining_new_tokens(),
                ignore_eos_token: r.ignore_eos,
                min_new_tokens: r.min_new_tokens.saturating_sub(self.generated),
                stop_token_ids: r.stop_token_ids.clone(),
            }),
            top_n_tokens: r.top_n_tokens,
            prefill_logprobs: self.wants_prompt_logprobs(),
            generated_len: self.generated,
            grammar: r.grammar.clone(),
            prompt_top_n: if self.wants_prompt_logprobs() { r.prompt_top_n } else { 0 },
            adapter: r.adapter.as_ref().map(|a| a.to_proto()),
        }
    }

    /// The LoRA adapter it runs with (None: the base model).
    pub fn adapter(&self) -> Option<&Adapter> {
        self.request.adapter.as_deref()
    }

    /// Its adapter's id, 0 for the base model.
    pub fn adapter_id(&self) -> u32 {
        self.request.adapter.as_ref().map_or(0, |a| a.id)
    }

    /// Prompt logprobs asked for and not yet handed to the stream (a
    /// sequence resumed after its first token already sent them).
    pub fn wants_prompt_logprobs(&self) -> bool {
        self.prompt_lps.as_ref().is_some_and(|l| !l.sent)
    }

    /// Forks read blocks their leader writes in the same step: they may not be chunked.
    pub fn chunkable(&self) -> bool {
        self.group.is_none()
    }
}

//! `schedule`: what the next step computes. Pure: it reads and changes the
//! scheduler's `State` (admission, block allocation, preemption) and returns
//! the `StepPlan`; the batching loop does the I/O.
//!
//! Mixed steps (`max_num_batched_tokens` set, vLLM v1 style): every running
//! sequence's decode token first, then prompt chunks (prompts already under
//! way, then new admissions) up to the step's token budget. Without it a step
//! is either a prefill (whole prompts under `max_batch_prefill_tokens`, or
//! chunks of `prefill_chunk_tokens`) or a decode, alternating.

use std::time::Instant;

use super::priority_preempt::preempt_for_priority;
use super::prompts::schedule_prompts;
use super::sequence::Sequence;
use super::state::State;
use super::too_large::reject_never_admissible;
use crate::error::RouterError;
use crate::kv::too_large;
use crate::proto::pb;

/// One scheduled range of one sequence, as the plan promised it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Planned {
    pub id: u64,
    pub num_computed: u32,
    pub num_tokens: u32,
    /// The range reaches the end of the known tokens: the shard samples.
    pub samples: bool,
    pub max_proposals: u32,
    /// A prompt range (the first sample of a sequence comes from one).
    pub prompt: bool,
}

/// A sequence admitted with blocks to load from the second tier: this step
/// only loads them; its compute is planned once the reply confirmed them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Loading {
    pub id: u64,
    /// Index in its block table of the first loaded block.
    pub first_block: u32,
    pub keys: Vec<String>,
}

#[derive(Debug, Default)]
pub struct StepPlan {
    /// Sequences whose blocks this step loads from the second tier.
    pub loading: Vec<Loading>,
    /// Prompt tokens those loads bring back (metrics).
    pub tier_hit_tokens: u64,
    pub planned: Vec<Planned>,
    pub request: pb::StepRequest,
    pub preempted: u32,
    /// Prompt tokens computed by this step, and prompt tokens served from
    /// the prefix cache at admission (metrics).
    pub prompt_tokens: u64,
    pub prefix_hit_tokens: u64,
    /// Sequences ended because they can never fit (see `too_large.rs`):
    /// their streams get the error, the shard is told to forget them.
    pub rejected: Vec<(u64, RouterError)>,
    /// Tokens resumed sequences compute again, their KV lost to preemption.
    pub recomputed_tokens: u64,
}

impl StepPlan {
    /// Nothing to compute or load (finished ids and tier saves may still need telling).
    pub fn is_empty(&self) -> bool {
        self.planned.is_empty() && self.loading.is_empty()
    }

    /// A step worth sending even with nothing to compute.
    pub fn has_messages(&self) -> bool {
        let r = &self.request;
        !(r.finished_ids.is_empty() && r.kv_saves.is_empty() && r.kv_deletes.is_empty())
    }

    pub fn has_decode(&self) -> bool {
        self.planned.iter().any(|p| !p.prompt)
    }

    pub(super) fn push(&mut self, s: &mut Sequence, num_tokens: u32, max_proposals: u32, prompt: bool) {
        let ids = s.blocks.as_ref().map_or(&[][..], |b| b.ids());
        let from = if s.on_shard { s.sent_blocks.min(ids.len()) } else { 0 };
        let new_request = (!s.on_shard).then(|| s.new_request());
        self.request.requests.push(pb::ScheduledRequest {
            id: s.id,
            new_request,
            num_computed: s.num_computed,
            num_tokens,
            new_block_ids: ids[from..].to_vec(),
            max_proposals,
        });
        s.sent_blocks = ids.len();
        s.on_shard = true;
        if prompt {
            self.prompt_tokens += num_tokens as u64;
            // The part of this range a preemption had computed before.
            let redo = s.lost.min(s.num_computed + num_tokens).saturating_sub(s.num_computed);
            self.recomputed_tokens += redo as u64;
        }
        self.planned.push(Planned {
            id: s.id,
            num_computed: s.num_computed,
            num_tokens,
            samples: s.num_computed + num_tokens == s.len(),
            max_proposals,
            prompt,
        });
    }
}

pub fn schedule(st: &mut State, now: Instant) -> StepPlan {
    let mut plan = StepPlan::default();
    reject_never_admissible(st, &mut plan);
    let bumped = preempt_for_priority(st, now);
    plan.preempted += bumped.len() as u32;
    requeue(st, bumped);
    match st.config.max_num_batched_tokens {
        Some(budget) => {
            let used = schedule_decodes(st, &mut plan);
            // Prompt tokens per step also stay under the prefill budget the
            // shard warmed up for, and under a chunk size if one is set.
            let cap = st.config.budget.prefill_chunk_tokens.unwrap_or(u32::MAX);
            let left = budget.saturating_sub(used).min(cap).min(st.config.budget.max_batch_prefill_tokens);
            schedule_prompts(st, &mut plan, Some(left), now);
        }
        None => {
            let chunk = st.config.budget.prefill_chunk_tokens;
            let prefer_prefill = !st.last_was_prefill;
            if prefer_prefill {
                schedule_prompts(st, &mut plan, chunk, now);
            }
            if plan.is_empty() {
                schedule_decodes(st, &mut plan);
                if plan.is_empty() && !prefer_prefill {
                    schedule_prompts(st, &mut plan, chunk, now);
                }
            }
            st.last_was_prefill = plan.planned.iter().any(|p| p.prompt);
        }
    }
    plan.request.finished_ids = std::mem::take(&mut st.finished);
    // Evictions and commits made in this plan (and since the last one): the
    // shard copies these blocks out before this step's forward overwrites them.
    let ops = st.kv.take_tier_ops();
    plan.request.kv_saves = ops.saves;
    plan.request.kv_deletes = ops.deletes;
    plan
}

/// Every decoding sequence gets its next token (plus room for speculative
/// proposals), oldest first; when the pool runs out the newest sequence is
/// preempted. Returns the step tokens used.
fn schedule_decodes(st: &mut State, plan: &mut StepPlan) -> u32 {
    let spec = st.config.speculate;
    // Better priorities grow first; the rest, and the victims, come after.
    st.running.sort_by_key(|s| (s.priority(), s.admitted_at));
    let mut preempted = Vec::new();
    let mut used = 0;
    let mut i = 0;
    while i < st.running.len() {
        if !st.running[i].prefilled {
            i += 1;
            continue;
        }
        let end = st.running[i].len() + spec;
        let grown = loop {
            if st.running[i].blocks.as_mut().is_some_and(|b| b.ensure_capacity(end)) {
                break true;
            }
            if st.running.len() == 1 {
                // Alone, with every other block free or evictable: it has
                // outgrown the pool. Preempting it would only repeat this.
                let s = st.running.remove(i);
                let s = st.release(s, true);
                let bs = st.kv.block_size();
                let needed = st.kv.blocks_for(end) as u64;
                tracing::warn!("request {} outgrew the KV pool after {} tokens", s.id, s.generated);
                plan.rejected.push((s.id, too_large(needed, st.kv.capacity(), bs)));
                break false;
            }
            let v = victim(&st.running, i);
            let s = st.running.remove(v);
            preempted.push(preempt(st, s));
            match v.cmp(&i) {
                std::cmp::Ordering::Equal => break false,
                std::cmp::Ordering::Less => i -= 1,
                std::cmp::Ordering::Greater => {}
            }
        };
        if !grown {
            // `i` now points at the next sequence.
            continue;
        }
        let s = &mut st.running[i];
        let n = s.pending();
        plan.push(s, n, spec, false);
        used += n + spec;
        i += 1;
    }
    plan.preempted += preempted.len() as u32;
    requeue(st, preempted);
    used
}

/// Preempted sequences back to the queue; admission orders it by priority
/// and arrival, so they resume before anything that arrived after them.
fn requeue(st: &mut State, mut preempted: Vec<Sequence>) {
    preempted.sort_by_key(|s| s.arrival);
    for s in preempted.into_iter().rev() {
        st.queue.push_front(s);
    }
}

/// Which running sequence to preempt so that `running[grow]` can grow: one
/// not yet in this step's plan (`grow` itself, those after it, or prompts
/// still under way). The worst priority goes first; among equals, the one
/// that loses the least work (fewest computed tokens to redo), then the
/// newest.
fn victim(running: &[Sequence], grow: usize) -> usize {
    (0..running.len())
        .filter(|&j| j >= grow || !running[j].prefilled)
        .max_by_key(|&j| {
            let s = &running[j];
            (s.priority(), std::cmp::Reverse(s.num_computed), s.admitted_at)
        })
        .expect("the sequence being grown is a candidate")
}

/// Preemption by recompute: computed blocks go to the prefix cache, so on
/// resume only what others have taken meanwhile is recomputed.
pub(super) fn preempt(st: &mut State, s: Sequence) -> Sequence {
    let mut s = st.release(s, true);
    tracing::debug!("preempted request {} after {} tokens", s.id, s.generated);
    s.lost = s.num_computed;
    s.preemptions += 1;
    s.num_computed = 0;
    s.sent_blocks = 0;
    s.prefilled = false;
    s
}

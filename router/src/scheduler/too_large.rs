//! Requests that can never run: refused, never retried forever.
//!
//! Nothing is reserved at admission, so a request whose prompt plus
//! `max_new_tokens` needs more KV blocks than the whole pool would be
//! admitted, grow until it is alone, be preempted, resume, and do it again
//! (vLLM #35541). Validation refuses such requests before they are queued
//! (`kv::lifetime_blocks` against the pool); the scheduler checks again, at
//! the head of the queue and while decoding, so that whatever slips through
//! (a configuration that validation does not see, a resumed sequence that
//! no step can take back) ends with a clear error instead of a hang.

use super::admission::{Budget, Candidate};
use super::order::units;
use super::prompts::candidate;
use super::state::State;
use super::step_plan::StepPlan;
use crate::error::RouterError;
use crate::kv::{lifetime_blocks, too_large};

/// Why a queued unit can never be admitted, even alone into an empty batch
/// with the whole pool free; None when it can (now or once others finish).
/// `lifetime`: its `lifetime_blocks`.
pub fn never_admissible(
    budget: &Budget,
    capacity: u32,
    block_size: u32,
    c: &Candidate,
    lifetime: u64,
) -> Option<RouterError> {
    if lifetime > capacity as u64 {
        return Some(too_large(lifetime, capacity, block_size));
    }
    if c.sequences > budget.max_batch_size {
        return Some(RouterError::Validation(format!(
            "{} sequences can never run at once: `--max-batch-size` is {}",
            c.sequences, budget.max_batch_size
        )));
    }
    if c.tokens > budget.max_batch_total_tokens {
        return Some(RouterError::Validation(format!(
            "{} context tokens can never run at once: the batch holds at most {}",
            c.tokens, budget.max_batch_total_tokens
        )));
    }
    // A prompt that must go in one step and exceeds every step's budget.
    // Without chunking, a chunkable one longer than a step can only be a
    // resumed sequence's recompute, which admission splits (prompts.rs).
    if !c.chunkable && c.prefill_tokens > budget.max_batch_prefill_tokens {
        return Some(RouterError::Validation(format!(
            "{} prompt tokens must be computed in one step, more than `--max-batch-prefill-tokens` ({})",
            c.prefill_tokens, budget.max_batch_prefill_tokens
        )));
    }
    None
}

/// Queued units that could not be admitted even alone into an empty batch
/// leave the queue with an error; the rest keep their order. Without this
/// one such unit at the head would block everyone behind it forever.
pub fn reject_never_admissible(st: &mut State, plan: &mut StepPlan) {
    if st.queue.is_empty() {
        return;
    }
    let bs = st.kv.block_size();
    let mut doomed = Vec::new();
    for u in units(&st.queue) {
        let c = candidate(st, &u);
        let r = &st.queue[u.start].request;
        let n = u.len() as u32;
        let lifetime = lifetime_blocks(r.input_ids.len() as u32, r.max_new_tokens, st.config.speculate, n, bs);
        if let Some(err) = never_admissible(&st.config.budget, st.kv.capacity(), bs, &c, lifetime) {
            doomed.extend(u.clone().map(|k| (k, err.clone())));
        }
    }
    for (k, err) in doomed.into_iter().rev() {
        let s = st.queue.remove(k).expect("index of a queued unit");
        tracing::warn!("request {} can never be scheduled: {err}", s.id);
        plan.rejected.push((s.id, err));
    }
}

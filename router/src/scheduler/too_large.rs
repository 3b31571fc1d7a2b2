//! Requests that can never run: refused, never retried forever.
//!
//! Nothing is reserved at admission, so a request whose prompt plus
//! `max_new_tokens` needs more KV blocks than the whole pool would be
//! admitted, grow until it is alone, be preempted, resume, and do it again
//! (vLLM #35541). Validation refuses such requests before they are queued
//! (`lifetime_blocks` against the pool); the scheduler checks again, at the
//! head of the queue and while decoding, so that whatever slips through
//! (a configuration that validation does not see, a resumed sequence that
//! no step can take back) ends with a clear error instead of a hang.

use super::admission::{Budget, Candidate};
use super::order::units;
use super::plan::StepPlan;
use super::prompts::candidate;
use super::state::State;
use crate::error::RouterError;

/// KV blocks a request needs at its longest: every prompt token and every
/// generated token but the last (which is sampled, never fed back), plus
/// the speculative proposal slots of its last decode step. `n` forks share
/// their prompt's full blocks (all but the last prompt token) and each
/// needs its own blocks for the rest.
pub fn lifetime_blocks(prompt_len: u32, max_new_tokens: u32, speculate: u32, n: u32, block_size: u32) -> u64 {
    let longest = prompt_len as u64 + (max_new_tokens as u64).saturating_sub(1) + speculate as u64;
    let per_fork = longest.div_ceil(block_size as u64);
    let shared = (prompt_len.saturating_sub(1) / block_size) as u64;
    shared + n.max(1) as u64 * (per_fork - shared.min(per_fork))
}

/// The client-facing error: a 4xx in every API's shape (`validation`).
pub fn too_large(needed: u64, capacity: u32, block_size: u32) -> RouterError {
    RouterError::Validation(format!(
        "`inputs` tokens + `max_new_tokens` can never fit the KV cache: the request needs {needed} blocks \
         of {block_size} tokens at its longest, the pool holds {capacity} ({} tokens); shorten the prompt \
         or lower `max_new_tokens`",
        capacity as u64 * block_size as u64
    ))
}

/// Why a queued unit can never be admitted, even alone into an empty batch
/// with the whole pool free; None when it can (now or once others finish).
/// `lifetime`: its `lifetime_blocks`. `chunked`: prompts may be split
/// across steps (chunked prefill or mixed steps).
pub fn never_admissible(
    budget: &Budget,
    capacity: u32,
    block_size: u32,
    c: &Candidate,
    lifetime: u64,
    chunked: bool,
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
    let one_step = !chunked || !c.chunkable;
    if one_step && c.prefill_tokens > budget.max_batch_prefill_tokens {
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
    let chunked = st.config.max_num_batched_tokens.is_some() || st.config.budget.prefill_chunk_tokens.is_some();
    let bs = st.kv.block_size();
    let mut doomed = Vec::new();
    for u in units(&st.queue) {
        let c = candidate(st, &u);
        let r = &st.queue[u.start].request;
        let n = u.len() as u32;
        let lifetime = lifetime_blocks(r.input_ids.len() as u32, r.max_new_tokens, st.config.speculate, n, bs);
        if let Some(err) = never_admissible(&st.config.budget, st.kv.capacity(), bs, &c, lifetime, chunked) {
            doomed.extend(u.clone().map(|k| (k, err.clone())));
        }
    }
    for (k, err) in doomed.into_iter().rev() {
        let s = st.queue.remove(k).expect("index of a queued unit");
        tracing::warn!("request {} can never be scheduled: {err}", s.id);
        plan.rejected.push((s.id, err));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lifetime_counts_prompt_generated_but_last_and_proposals() {
        // 10 + 6 - 1 = 15 tokens: 4 blocks of 4; 16 tokens would need 4 too, 17 five.
        assert_eq!(lifetime_blocks(10, 6, 0, 1, 4), 4);
        assert_eq!(lifetime_blocks(10, 8, 0, 1, 4), 5);
        assert_eq!(lifetime_blocks(10, 6, 2, 1, 4), 5);
        // 3 forks share the 2 full prompt blocks (positions 0..8), each needs 2 more.
        assert_eq!(lifetime_blocks(10, 6, 0, 3, 4), 2 + 3 * 2);
    }
}

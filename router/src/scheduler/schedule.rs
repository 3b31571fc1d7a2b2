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

use super::preempt::{preempt, requeue, victim};
use super::priority_preempt::preempt_for_priority;
use super::prompts::schedule_prompts;
use super::state::State;
use super::step_plan::StepPlan;
use super::too_large::reject_never_admissible;
use crate::kv::too_large;

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
/// proposals), best priority first, then oldest; when the pool runs out a
/// victim is preempted (`preempt::victim`: worst priority, then least work
/// lost, then newest). Returns the step tokens used.
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

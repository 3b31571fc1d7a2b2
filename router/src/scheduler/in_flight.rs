//! A prefix is computed once. A queued request whose prompt shares blocks
//! with a prompt a running sequence is still computing waits for those
//! blocks (as SGLang does) instead of computing a copy of its own: once the
//! shard confirms them they are in the prefix cache, and the waiter is
//! admitted with them as a cache hit.
//!
//! The wait is bounded by the owner: its prompt chunks come first in every
//! step, and a waiter proceeds as soon as no running prompt will write more
//! of its prefix than it can have now (the owner committed them, finished,
//! failed or was preempted). Blocks another prompt writes in this very step
//! are not waited for: the waiter shares them in the same step (the shard
//! writes every row's KV before attention reads it; prompts.rs).

use std::ops::Range;

use super::order::hold_back;
use super::sequence::Sequence;
use super::state::State;
use super::step_plan::StepPlan;

/// Leading full blocks two sequences' KV has in common: none when they run
/// with different adapters (or one with an adapter and one without).
pub(super) fn common_blocks(a: &Sequence, b: &Sequence, block_size: u32) -> u32 {
    if a.adapter_id() != b.adapter_id() {
        return 0;
    }
    let same = a.tokens.iter().zip(&b.tokens).take_while(|(x, y)| x == y).count() as u32;
    same / block_size
}

/// Where `a`'s computed tokens will reach once this step's plan is done.
pub(super) fn reach(plan: &StepPlan, a: &Sequence) -> u32 {
    let planned = plan.planned.iter().find(|p| p.id == a.id).map_or(0, |p| p.num_computed + p.num_tokens);
    planned.max(a.num_computed)
}

/// Whether `s` should wait: a running prompt will write more blocks of
/// `s`'s prefix than `s` can take now (cached, or written in this step).
pub(super) fn waits(st: &State, plan: &StepPlan, s: &Sequence) -> bool {
    // Without prefix caching nothing is shared across requests; with every
    // layer windowed, a prompt's blocks never reach the cache whole.
    if !st.kv.prefix_caching() || st.config.sliding_window > 0 {
        return false;
    }
    let bs = st.kv.block_size();
    // At least one token is left to compute (it yields the first sample).
    let shareable = s.len().saturating_sub(1) / bs;
    let mut now = st.kv.peek_prefix(s.adapter(), &s.tokens);
    let mut later = 0;
    for a in st.running.iter().filter(|a| !a.prefilled) {
        let common = common_blocks(a, s, bs).min(shareable);
        now = now.max(common.min(reach(plan, a) / bs));
        later = later.max(common);
    }
    later > now
}

/// Moves the leading `eligible` units whose leader waits (waits()) behind
/// the others; returns the units as they now lie and how many lead eligible.
pub(super) fn hold_back_waiting(
    st: &mut State,
    plan: &StepPlan,
    units: &[Range<usize>],
    eligible: usize,
) -> (Vec<Range<usize>>, usize) {
    let held: Vec<bool> =
        units.iter().enumerate().map(|(k, u)| k >= eligible || waits(st, plan, &st.queue[u.start])).collect();
    if held.iter().take(eligible).all(|h| !h) {
        return (units.to_vec(), eligible);
    }
    hold_back(&mut st.queue, units, &held)
}

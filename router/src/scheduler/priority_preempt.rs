//! A better-priority arrival takes its seat from running worse-priority
//! sequences (vLLM's priority policy): when the head of the queue cannot be
//! admitted for want of seats, batch tokens or KV blocks, running sequences
//! whose effective priority is strictly worse are preempted (by recompute,
//! preempt.rs) until it fits, so it is admitted in this same step.
//!
//! Effective priorities (aging included) on both sides keep this free of
//! thrash and bounded: a victim goes back to the queue ranked behind the
//! newcomer and both age alike from then on, so it never preempts it back;
//! and a running sequence's effective priority improves with the time since
//! it arrived, so after `(p - q) x aging` no newcomer of priority q can
//! preempt it any more: the starvation bound of `order.rs` holds for
//! running sequences too.

use std::time::Instant;

use super::admission::{fits_resources, Running};
use super::lora_cap::lora_fits;
use super::order::{order_queue, units};
use super::preempt::preempt;
use super::prompts::{budget_with_running, candidate, growth_budget};
use super::sequence::Sequence;
use super::state::State;

/// Preempts for the head of the queue where it has a strictly better
/// priority and would fit without them; returns the preempted sequences
/// (already released, to go back to the queue). Preempts nobody when even
/// every eligible victim would not make room: that would only lose work.
pub fn preempt_for_priority(st: &mut State, now: Instant) -> Vec<Sequence> {
    if st.queue.is_empty() || st.running.is_empty() {
        return Vec::new();
    }
    order_queue(st, now);
    let unit = units(&st.queue)[0].clone();
    let aging = st.config.priority_aging;
    let head = st.queue[unit.start].effective_priority(now, aging);
    let head_static = st.queue[unit.start].priority();
    if let (Some(cap), Some(tenant)) =
        (st.config.max_running_per_tenant, st.queue[unit.start].request.tenant.as_deref())
    {
        // Held back by its tenant's cap, not by the others.
        let own = st.running.iter().filter(|s| s.request.tenant.as_deref() == Some(tenant)).count() as u32;
        if own > 0 && own + unit.len() as u32 > cap {
            return Vec::new();
        }
    }
    if !lora_fits(&st.running, st.queue[unit.start].adapter_id(), st.config.max_loras) {
        // Waiting for an adapter slot, not for room: preempting would not admit it.
        return Vec::new();
    }
    let c = candidate(st, &unit);
    if fits_resources(&growth_budget(st), running_now(st), &c) {
        return Vec::new();
    }
    // Victims, worst first: worst effective priority, then least work lost, then newest.
    let mut order: Vec<usize> = (0..st.running.len())
        .filter(|&j| {
            // Static priorities too: among equals, aging alone never preempts.
            let s = &st.running[j];
            s.priority() > head_static && s.effective_priority(now, aging) > head
        })
        .collect();
    order.sort_by_key(|&j| {
        let s = &st.running[j];
        std::cmp::Reverse((s.effective_priority(now, aging), std::cmp::Reverse(s.num_computed), s.admitted_at))
    });
    // Upper bound of what preempting them all frees (shared blocks may stay held).
    let mut bound = running_now(st);
    for &j in &order {
        let s = &st.running[j];
        bound.sequences -= 1;
        bound.tokens -= s.len() as u64;
        bound.available_blocks += s.blocks.as_ref().map_or(0, |b| b.ids().len() as u32);
    }
    let others = st.running.len() - order.len();
    if order.is_empty() || !fits_resources(&budget_with_running(st, others), bound, &c) {
        return Vec::new();
    }
    let ids: Vec<u64> = order.iter().map(|&j| st.running[j].id).collect();
    let mut preempted = Vec::new();
    for id in ids {
        let j = st.running.iter().position(|s| s.id == id).expect("victims are running");
        let s = st.running.remove(j);
        preempted.push(preempt(st, s));
        if fits_resources(&growth_budget(st), running_now(st), &c) {
            break;
        }
    }
    tracing::debug!("preempted {} sequence(s) for a priority {head} arrival", preempted.len());
    preempted
}

fn running_now(st: &State) -> Running {
    Running {
        sequences: st.running.len() as u32,
        tokens: st.running.iter().map(|s| s.len() as u64).sum(),
        available_blocks: st.kv.available(),
    }
}

//! `plan_ahead`: the decode step after the one in flight, planned before its
//! reply (vLLM's async scheduling, in its simplest case). Step N+1 names step
//! N as its `after_step_id` (batching/run.rs), so the shard runs them in that order
//! whichever call gRPC hands it first, and step N+1 may name each sequence's
//! token sampled in step N without the router knowing it yet: the shard keeps
//! it (proto: "the last sampled token"). The router's time between two steps
//! (the reply's way back, `update`, delivery, the next plan and its way out,
//! ~1.5 ms at batch 1 on a 2-core CPU) then overlaps the shard's forward.
//!
//! Only when nothing else could change the next plan: every running sequence
//! decodes one token in the step in flight (no prompt, no speculation, no
//! tier operation, no sliding window), nobody waits in the queue, and every
//! table grows without a preemption. Pure, like `schedule`: the state
//! changes only by the blocks it allocates and the table entries it sends.
//!
//! A sequence that the step in flight ends (EOS, a stop token) is in the
//! next step too: the shard dropped it and answers that entry with an error,
//! and `update` ignores it (it is no longer running). Its one extra position
//! writes into a block past what it committed to the prefix cache, and a
//! block it frees is only reallocated by a later plan, whose step the shard
//! runs after this one.

use super::state::State;
use super::step_plan::{Planned, StepPlan};
use crate::proto::pb;

/// The fewest sequences of a step in flight for which the next is planned ahead unless the
/// operator says otherwise (`--schedule-ahead`: from 1, `--no-schedule-ahead`: never).
/// Measured on a 2-core CPU (docs/architecture.md): at 64 concurrent requests the gap between
/// two forwards fell from ~3 to ~2 ms a step, the forward, sharing the cores with the
/// overlapped work, took up to as much longer (net -2% to +4% in four paired runs), while at
/// one sequence the overlap lost outright (int8 batch-1 decode 11% slower). Without spare
/// host cores (a GPU shard) the gap is all gain.
pub const AHEAD_FROM_SEQUENCES: u32 = 16;

/// The step after `inflight`, or None when this step must wait for its reply.
pub fn plan_ahead(st: &mut State, inflight: &StepPlan) -> Option<StepPlan> {
    if !pipelinable(st, inflight) {
        return None;
    }
    // Each sequence whose token from the step in flight is not its last,
    // with a slot for that token's position; else the step waits: a block
    // that needs a preemption must see the reply first.
    let mut next: Vec<(usize, u32)> = Vec::with_capacity(inflight.planned.len());
    for p in &inflight.planned {
        let Some(i) = st.running_index(p.id) else { continue };
        let s = &mut st.running[i];
        if s.remaining_new_tokens() <= 1 {
            continue;
        }
        let num_computed = p.num_computed + p.num_tokens;
        if !s.blocks.as_mut().is_some_and(|b| b.ensure_capacity(num_computed + 1)) {
            // (The blocks taken so far stay with their sequences: they need them next step anyway.)
            return None;
        }
        next.push((i, num_computed));
    }
    let mut plan = StepPlan::default();
    for (i, num_computed) in next {
        let s = &mut st.running[i];
        let ids = s.blocks.as_ref().map_or(&[][..], |b| b.ids());
        let from = s.sent_blocks.min(ids.len());
        plan.request.requests.push(pb::ScheduledRequest {
            id: s.id,
            new_request: None,
            num_computed,
            num_tokens: 1,
            new_block_ids: ids[from..].to_vec(),
            max_proposals: 0,
        });
        s.sent_blocks = ids.len();
        plan.planned.push(Planned {
            id: s.id,
            num_computed,
            num_tokens: 1,
            samples: true,
            max_proposals: 0,
            prompt: false,
        });
    }
    if plan.planned.is_empty() {
        return None;
    }
    plan.request.finished_ids = std::mem::take(&mut st.finished);
    Some(plan)
}

/// Whether the step after `inflight` is a plain decode of the same sequences.
fn pipelinable(st: &State, inflight: &StepPlan) -> bool {
    let cfg = &st.config;
    let from = cfg.schedule_ahead_from as usize;
    let decode_only = from > 0
        && inflight.planned.len() >= from
        && inflight.planned.iter().all(|p| p.samples && !p.prompt && p.num_tokens == 1 && p.max_proposals == 0);
    let r = &inflight.request;
    decode_only
        && cfg.speculate == 0
        && cfg.sliding_window == 0
        && inflight.loading.is_empty()
        && r.kv_saves.is_empty()
        && r.kv_loads.is_empty()
        && r.kv_deletes.is_empty()
        && !st.kv.has_tier_ops()
        && st.queue.is_empty()
        // Every running sequence decodes in the step in flight (none waits for a prompt chunk).
        && st.running.iter().all(|s| inflight.planned.iter().any(|p| p.id == s.id))
}

//! `schedule`: what the next step computes. Pure: it reads and changes the
//! scheduler's `State` (admission, block allocation, preemption) and returns
//! the `StepPlan`; the batching loop does the I/O.
//!
//! Mixed steps (`max_num_batched_tokens` set, vLLM v1 style): every running
//! sequence's decode token first, then prompt chunks (prompts already under
//! way, then new admissions) up to the step's token budget. Without it a step
//! is either a prefill (whole prompts under `max_batch_prefill_tokens`, or
//! chunks of `prefill_chunk_tokens`) or a decode, alternating.

use std::collections::VecDeque;
use std::time::Instant;

use super::admission::{admit, admit_chunked, Admission, Budget, Candidate, Running};
use super::sequence::Sequence;
use super::state::State;
use super::priority_preempt::preempt_for_priority;
use super::tenant::hold_back_capped;
use super::order::{order_queue, units};
use super::too_large::{reject_never_admissible, too_large};
use crate::error::RouterError;
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

    fn push(&mut self, s: &mut Sequence, num_tokens: u32, max_proposals: u32, prompt: bool) {
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

/// Prompt work: chunks of prompts under way, then admissions from the
/// queue. `step_tokens`: prompt tokens this step may compute (None: whole
/// prompts under `max_batch_prefill_tokens`).
fn schedule_prompts(st: &mut State, plan: &mut StepPlan, step_tokens: Option<u32>, now: Instant) {
    let mut left = step_tokens;
    let mut any_prompt = false;
    for s in st.running.iter_mut().filter(|s| !s.prefilled) {
        let pending = s.pending();
        let n = left.map_or(pending, |l| l.min(pending));
        if n == 0 {
            return;
        }
        plan.push(s, n, 0, true);
        any_prompt = true;
        if let Some(l) = left.as_mut() {
            *l -= n;
        }
    }
    if left == Some(0) || st.queue.is_empty() {
        return;
    }
    admit_from_queue(st, plan, left, !any_prompt, now);
}

fn admit_from_queue(st: &mut State, plan: &mut StepPlan, left: Option<u32>, alone_ok: bool, now: Instant) {
    order_queue(st, now);
    let mut units = units(&st.queue);
    let mut eligible = units.len();
    if let Some(cap) = st.config.max_running_per_tenant {
        (units, eligible) = hold_back_capped(&mut st.queue, &st.running, &units, cap);
    }
    let candidates: Vec<Candidate> = units[..eligible].iter().map(|u| candidate(st, u)).collect();
    let running = Running {
        sequences: st.running.len() as u32,
        tokens: st.running.iter().map(|s| s.len() as u64).sum(),
        available_blocks: st.kv.available(),
    };
    let budget = growth_budget(st);
    let Admission { whole, partial } = match left {
        Some(l) => admit_chunked(&budget, running, &candidates, l, alone_ok),
        None => Admission { whole: admit(&budget, running, &candidates), partial: None },
    };
    let take = if whole == 0 { 0 } else { units[whole - 1].end } + partial.is_some() as usize;
    let bs = st.kv.block_size();
    let first_new = st.running.len();
    let mut taken: VecDeque<Sequence> = st.queue.drain(..take).collect();
    while let Some(mut s) = taken.pop_front() {
        let len = s.len();
        let mut blocks = st.kv.acquire_prefix(&s.tokens);
        // Prompts admitted in this same step that share a longer prefix
        // (forks of `n`/`best_of`, a common system prompt arriving at once)
        // share the earlier one's blocks, as far as that one computes them
        // in this step: the shard writes them before anyone reads.
        let limit = fork_shared_blocks(len, bs);
        let caching = st.kv.prefix_caching();
        let planned_end = |id: u64| plan.planned.iter().find(|p| p.id == id).map_or(0, |p| p.num_computed + p.num_tokens);
        let best = st.running[first_new..]
            .iter()
            // Without prefix caching only forks of one request share.
            .filter(|a| caching || (s.group.is_some() && a.group == s.group))
            .map(|a| {
                let m = common_blocks(&a.tokens, &s.tokens, bs).min(limit).min(planned_end(a.id) / bs);
                (m, a)
            })
            .max_by_key(|(m, _)| *m);
        if let Some((m, a)) = best {
            if m > blocks.len() {
                if let Some(b) = a.blocks.as_ref() {
                    blocks = b.share_prefix(m);
                }
            }
        }
        let cache_len = blocks.len() * bs;
        if !blocks.ensure_capacity(len) {
            // Admission estimates are conservative; should one still fall
            // short, the rest waits for the next step rather than failing.
            drop(blocks);
            taken.push_front(s);
            while let Some(s) = taken.pop_back() {
                st.queue.push_front(s);
            }
            break;
        }
        s.blocks = Some(blocks);
        s.num_computed = cache_len;
        st.admissions += 1;
        s.admitted_at = st.admissions;
        s.started_at = now;
        // The chunked candidate is the last one taken; it starts with what
        // is left of this step's budget.
        let n = match partial {
            Some(tokens) if taken.is_empty() => tokens.min(len - cache_len),
            _ => len - cache_len,
        };
        plan.prefix_hit_tokens += cache_len as u64;
        let first = cache_len / bs;
        let keys = st.kv.tier_hits(&s.tokens, first as usize);
        if !keys.is_empty() {
            let ids = s.blocks.as_ref().map_or(&[][..], |b| b.ids());
            for (i, key) in keys.iter().enumerate() {
                let block_id = ids[first as usize + i];
                plan.request.kv_loads.push(pb::KvLoad { key: key.clone(), block_id });
            }
            plan.tier_hit_tokens += keys.len() as u64 * bs as u64;
            plan.loading.push(Loading { id: s.id, first_block: first, keys });
            st.running.push(s);
            continue;
        }
        plan.push(&mut s, n, 0, true);
        st.running.push(s);
    }
}

/// The budget with room for the running batch to grow: on top of the
/// watermark, one block per running sequence, which is what the batch
/// takes over the next `block_size` decode steps. Without it admission
/// packs the pool to the brim and a newcomer is preempted (and its prompt
/// recomputed) within a few steps, over and over.
pub(super) fn growth_budget(st: &State) -> Budget {
    budget_with_running(st, st.running.len())
}

/// The growth budget as it is with `running` sequences in the batch.
pub(super) fn budget_with_running(st: &State, running: usize) -> Budget {
    let per_step = 1 + st.config.speculate;
    let growth = running as u32 * per_step;
    let mut budget = st.config.budget;
    budget.watermark_blocks = budget.watermark_blocks.saturating_add(growth);
    budget
}

pub(super) fn candidate(st: &State, unit: &std::ops::Range<usize>) -> Candidate {
    let bs = st.kv.block_size();
    let leader = &st.queue[unit.start];
    let len = leader.len();
    let blocks = st.kv.blocks_for(len);
    let cached = st.kv.peek_prefix(&leader.tokens).min(blocks);
    let forks = unit.len() as u32 - 1;
    let shared = fork_shared_blocks(len, bs);
    Candidate {
        chunkable: forks == 0 && leader.chunkable(),
        sequences: unit.len() as u32,
        prefill_tokens: (len - cached * bs) + forks * (len - shared * bs),
        tokens: len as u64 * unit.len() as u64,
        // Taking a cached prefix can use up reclaimable blocks too, so the
        // cached part counts against availability as well.
        new_blocks: blocks + forks * (blocks - shared),
    }
}

/// Full prompt blocks a fork shares with its leader: at least one token is
/// left for the fork to compute, since its first token is sampled from it.
fn fork_shared_blocks(len: u32, block_size: u32) -> u32 {
    len.saturating_sub(1) / block_size
}

/// Number of leading full blocks two token sequences have in common.
fn common_blocks(a: &[u32], b: &[u32], block_size: u32) -> u32 {
    let same = a.iter().zip(b).take_while(|(x, y)| x == y).count() as u32;
    same / block_size
}

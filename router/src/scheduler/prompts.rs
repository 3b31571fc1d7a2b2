//! A step's prompt work (`schedule` calls `schedule_prompts` after the
//! decodes): chunks of prompts already under way, then admissions from the
//! queue, with their KV blocks (a cached prefix, or the blocks of a fork
//! admitted in the same step) and second-tier loads; and the admission
//! budget with room for the running batch to grow.

use std::collections::VecDeque;
use std::time::Instant;

use super::admission::{admit, admit_chunked, fits_resources, Admission, Budget, Candidate, Running};
use super::in_flight::{common_blocks, hold_back_waiting, reach, waits};
use super::logprob_gather::{cacheable_blocks, fill_from_cache};
use super::lora_cap::hold_back_lora;
use super::order::{order_queue, units};
use super::sequence::Sequence;
use super::state::State;
use super::step_plan::{Loading, StepPlan};
use super::tenant_cap::hold_back_capped;
use crate::kv::KvBlocks;
use crate::proto::pb;

/// Prompt work: chunks of prompts under way, then admissions from the
/// queue. `step_tokens`: prompt tokens this step may compute (None: whole
/// prompts under `max_batch_prefill_tokens`).
pub(super) fn schedule_prompts(st: &mut State, plan: &mut StepPlan, step_tokens: Option<u32>, now: Instant) {
    let mut left = step_tokens;
    let mut any_prompt = false;
    // Without chunking only a resumed sequence's recompute can be longer
    // than a step: it goes on in steps of `max_batch_prefill_tokens`.
    let whole_cap = st.config.budget.max_batch_prefill_tokens;
    for s in st.running.iter_mut().filter(|s| !s.prefilled) {
        let pending = s.pending();
        let n = left.map_or(pending.min(whole_cap), |l| l.min(pending));
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
    let (take, partial) = admissions(st, plan, left, alone_ok, now);
    let bs = st.kv.block_size();
    let mut taken: VecDeque<Sequence> = st.queue.drain(..take).collect();
    // Those that now wait for a prompt admitted before them (one loading its
    // prefix from the second tier in this step) go back to the queue.
    let mut waiting = Vec::new();
    while let Some(mut s) = taken.pop_front() {
        if s.group.is_none() && waits(st, plan, &s) {
            waiting.push(s);
            continue;
        }
        let len = s.len();
        fill_from_cache(&mut s, &mut st.logprob_cache);
        let cap = cacheable_blocks(&s, &st.logprob_cache, bs);
        let mut blocks = prompt_blocks(st, plan, &s, cap);
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
        if st.config.sliding_window == 0 {
            // KV-event consumers learn of the blocks it computes now, not
            // once computed: a request for the same prefix meanwhile waits
            // for them here (kv/announce.rs). Windowed layers give blocks
            // back before the cache could take them: nothing is announced.
            st.kv.announce(&mut blocks, s.adapter(), &s.tokens);
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
        if !plan_tier_loads(st, plan, &s, cache_len / bs, cap) {
            plan.push(&mut s, n, 0, true);
        }
        st.running.push(s);
    }
    for s in waiting.into_iter().rev() {
        st.queue.push_front(s);
    }
}

/// How many queued sequences this step admits (whole units), and the prompt
/// tokens of one more admitted in part (a chunk), if any.
fn admissions(
    st: &mut State,
    plan: &StepPlan,
    left: Option<u32>,
    alone_ok: bool,
    now: Instant,
) -> (usize, Option<u32>) {
    order_queue(st, now);
    let mut units = units(&st.queue);
    let mut eligible = units.len();
    if let Some(cap) = st.config.max_running_per_tenant {
        (units, eligible) = hold_back_capped(&mut st.queue, &st.running, &units, cap);
    }
    (units, eligible) = hold_back_lora(&mut st.queue, &st.running, &units, eligible, st.config.max_loras);
    (units, eligible) = hold_back_waiting(st, plan, &units, eligible);
    let candidates: Vec<Candidate> = units[..eligible].iter().map(|u| candidate(st, u)).collect();
    let running = Running {
        sequences: st.running.len() as u32,
        tokens: st.running.iter().map(|s| s.len() as u64).sum(),
        available_blocks: st.kv.available(),
    };
    let budget = growth_budget(st);
    let Admission { whole, partial } = match left {
        Some(l) => admit_chunked(&budget, running, &candidates, l, alone_ok),
        None => admit_whole(&budget, running, &candidates, alone_ok),
    };
    let take = if whole == 0 { 0 } else { units[whole - 1].end } + partial.is_some() as usize;
    (take, partial)
}

/// Admission of whole prompts (no chunked prefill). A resumed sequence
/// whose recompute (prompt plus the tokens it had generated) is longer than
/// any step starts alone in a step of `max_batch_prefill_tokens` and goes on
/// in the next ones, rather than never fitting.
fn admit_whole(budget: &Budget, running: Running, candidates: &[Candidate], alone_ok: bool) -> Admission {
    let whole = admit(budget, running, candidates);
    let oversized = |c: &Candidate| c.chunkable && c.prefill_tokens > budget.max_batch_prefill_tokens;
    match candidates.first() {
        Some(c) if whole == 0 && alone_ok && oversized(c) && fits_resources(budget, running, c) => {
            Admission { whole: 0, partial: Some(budget.max_batch_prefill_tokens) }
        }
        _ => Admission { whole, partial: None },
    }
}

/// The block table an admitted prompt starts with: its cached prefix, or
/// the longer prefix of a prompt still being computed (a common system
/// prompt, forks of `n`/`best_of` admitted together), as far as that one
/// has computed it or computes it in this step: the shard writes those
/// blocks before anyone reads them. At most `cap` blocks (`cacheable_blocks`).
fn prompt_blocks(st: &State, plan: &StepPlan, s: &Sequence, cap: u32) -> KvBlocks {
    let bs = st.kv.block_size();
    let mut blocks = st.kv.acquire_prefix(s.adapter(), capped(&s.tokens, cap, bs));
    let limit = fork_shared_blocks(s.len(), bs).min(cap);
    let caching = st.kv.prefix_caching();
    let best = st
        .running
        .iter()
        .filter(|a| !a.prefilled)
        // Without prefix caching only forks of one request share.
        .filter(|a| caching || (s.group.is_some() && a.group == s.group))
        .map(|a| {
            let m = common_blocks(a, s, bs).min(limit).min(reach(plan, a) / bs);
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
    blocks
}

/// Plans loading the blocks from `first` on that the second tier holds;
/// true when there are any: the sequence then only loads in this step, its
/// compute is planned once the reply confirmed the loads.
fn plan_tier_loads(st: &State, plan: &mut StepPlan, s: &Sequence, first: u32, cap: u32) -> bool {
    let keys = st.kv.tier_hits(s.adapter(), capped(&s.tokens, cap, st.kv.block_size()), first as usize);
    if keys.is_empty() {
        return false;
    }
    let ids = s.blocks.as_ref().map_or(&[][..], |b| b.ids());
    for (i, key) in keys.iter().enumerate() {
        let block_id = ids[first as usize + i];
        plan.request.kv_loads.push(pb::KvLoad { key: key.clone(), block_id });
    }
    plan.tier_hit_tokens += keys.len() as u64 * st.kv.block_size() as u64;
    plan.loading.push(Loading { id: s.id, first_block: first, keys });
    true
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
    let cap = cacheable_blocks(leader, &st.logprob_cache, bs);
    let cached = st.kv.peek_prefix(leader.adapter(), &leader.tokens).min(blocks).min(cap);
    let forks = unit.len() as u32 - 1;
    let shared = fork_shared_blocks(len, bs).min(cap);
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

/// The tokens whose cached prefix may be taken, `cap` blocks at most: the
/// cache leaves the last token of what it is given to compute.
fn capped(tokens: &[u32], cap: u32, block_size: u32) -> &[u32] {
    let n = (cap as usize).saturating_mul(block_size as usize).saturating_add(1);
    &tokens[..n.min(tokens.len())]
}

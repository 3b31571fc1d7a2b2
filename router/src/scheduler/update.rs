//! `update`: applies what the shard computed for a plan. Pure: it changes
//! the `State` and returns one event per touched sequence for the loop to
//! deliver. A reply that does not match the plan (a missing generation, a
//! wrong token count, a finish on a prompt chunk, tokens past
//! max_new_tokens) ends the sequences it touches with a `generation` error;
//! it never panics the router.
//!
//! Where a sequence finishes is decided once per kind. The router owns the
//! length accounting: it sends the stopping criteria with each (re)admitted
//! sequence (`Sequence::new_request`: what is left of max_new_tokens,
//! ignore_eos, min_new_tokens, stop_token_ids) and checks every reply
//! against them. The shard, which samples (and sees each token of a
//! speculative run), applies them: length, EOS and stop-token finishes are
//! decided there alone (server/pagemill/shard/generations.py), the run cut
//! at the finish and the request dropped; here the finish reason is only
//! carried to the stream. Stop strings are text, matched by the request's
//! stream (stream.rs), which ends it like a client that went away.

use std::collections::HashMap;

use super::logprob_gather::{prefill_event, take_report};
use super::sequence::Sequence;
use super::state::State;
use super::step_plan::{Planned, StepPlan};
use crate::error::RouterError;
use crate::proto::pb;
use crate::queue::{Finish, SeqEvent};

/// An event for the stream of sequence `.0`.
pub type Event = (u64, Result<SeqEvent, RouterError>);

/// Whether an event ends its stream.
pub fn is_terminal(event: &Result<SeqEvent, RouterError>) -> bool {
    matches!(event, Err(_) | Ok(SeqEvent::Tokens { finish: Some(_), .. }))
}

#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct StepStats {
    pub generated_tokens: u64,
    /// Generations whose id the plan did not schedule (ignored).
    pub unknown_ids: u32,
    /// Blocks running sequences gave back behind a sliding window.
    pub window_released_blocks: u64,
    /// Second-tier blocks loaded and confirmed, and loads that failed.
    pub tier_loaded_blocks: u64,
    pub tier_failed_loads: u64,
}

pub fn update(st: &mut State, plan: &StepPlan, resp: &pb::StepResponse) -> (Vec<Event>, StepStats) {
    let mut stats = StepStats::default();
    let by_id = generations_by_id(resp);
    stats.unknown_ids = by_id.keys().filter(|id| !plan.planned.iter().any(|p| p.id == **id)).count() as u32;
    apply_loads(st, plan, resp, &mut stats);
    let mut events = Vec::with_capacity(plan.planned.len());
    for p in &plan.planned {
        let Some(i) = st.running_index(p.id) else { continue };
        let left = st.running[i].remaining_new_tokens();
        let outcome = match by_id.get(&p.id) {
            None => Err(format!("the shard returned no generation for request {}", p.id)),
            Some(None) => Err(format!("the shard returned two generations for request {}", p.id)),
            Some(Some(g)) => check(p, g, left).and_then(|g| {
                // A sequence that failed on the shard is ended with that error below.
                if g.error.is_empty() {
                    take_report(&mut st.running[i], g, p.samples)?;
                }
                Ok(g)
            }),
        };
        let g = match outcome {
            Ok(g) => g,
            Err(msg) => {
                let s = st.running.remove(i);
                st.release(s, false);
                tracing::error!("{msg}");
                events.push((p.id, Err(RouterError::Generation(msg))));
                continue;
            }
        };
        if !g.error.is_empty() {
            // The shard dropped it already.
            let mut s = st.running.remove(i);
            s.on_shard = false;
            st.release(s, false);
            events.push((p.id, Err(RouterError::Validation(g.error.clone()))));
        } else if p.samples {
            apply_sample(st, i, p, g, &mut events, &mut stats);
        } else {
            apply_chunk(st, i, p, &mut stats);
        }
    }
    (events, stats)
}

/// Each request's generation; None for a request answered twice (neither can be trusted).
fn generations_by_id(resp: &pb::StepResponse) -> HashMap<u64, Option<&pb::Generation>> {
    let mut by_id: HashMap<u64, Option<&pb::Generation>> = HashMap::with_capacity(resp.generations.len());
    for g in &resp.generations {
        by_id.entry(g.request_id).and_modify(|slot| *slot = None).or_insert(Some(g));
    }
    by_id
}

/// An intermediate prompt chunk: computed, nothing sampled.
fn apply_chunk(st: &mut State, i: usize, p: &Planned, stats: &mut StepStats) {
    let s = &mut st.running[i];
    s.num_computed = p.num_computed + p.num_tokens;
    // The shard confirmed this chunk's KV: its full blocks may be shared now.
    if let Some(b) = s.blocks.as_ref() {
        st.kv.commit(s.adapter(), b, &s.tokens[..s.num_computed as usize]);
    }
    stats.window_released_blocks += release_behind_window(s, st.config.sliding_window, st.kv.block_size());
}

/// A range the shard sampled after: its tokens (and the prompt's logprobs on
/// the first sample) go to the stream; a finish the shard reported ends the
/// sequence, which the shard has already dropped.
fn apply_sample(
    st: &mut State,
    i: usize,
    p: &Planned,
    g: &pb::Generation,
    events: &mut Vec<Event>,
    stats: &mut StepStats,
) {
    let s = &mut st.running[i];
    let tokens = g.tokens.as_ref().expect("checked");
    let ids = tokens.ids.clone();
    let finish = finish_of(g.finish_reason);
    let n = ids.len() as u32;
    s.num_computed = p.num_computed + p.num_tokens + n.saturating_sub(1);
    s.tokens.extend_from_slice(&ids);
    s.generated += n;
    stats.generated_tokens += n as u64;
    if !s.prefilled {
        s.prefilled = true;
        if let Some(b) = s.blocks.as_ref() {
            st.kv.commit(s.adapter(), b, &s.tokens[..(p.num_computed + p.num_tokens) as usize]);
        }
        if let Some(prefill) = prefill_event(s, &mut st.logprob_cache, st.kv.prefix_caching()) {
            events.push((p.id, Ok(prefill)));
        }
    }
    stats.window_released_blocks += release_behind_window(s, st.config.sliding_window, st.kv.block_size());
    let mut logprobs = tokens.logprobs.clone();
    logprobs.truncate(ids.len());
    let mut top = g.top_tokens.clone();
    top.truncate(ids.len());
    let started_at = s.started_at;
    events.push((p.id, Ok(SeqEvent::Tokens { ids, logprobs, top, finish, started_at })));
    if finish.is_some() {
        let mut s = st.running.remove(i);
        s.on_shard = false;
        st.release(s, true);
    }
}

/// Second-tier loads: a sequence counts as computed up to its first failed
/// load (a missing, corrupt or mismatched file), and the rest of its prompt
/// is computed from there. Failed and lost keys leave the index, so nothing
/// is ever served from them again.
pub fn apply_loads(st: &mut State, plan: &StepPlan, resp: &pb::StepResponse, stats: &mut StepStats) {
    st.kv.tier_forget(resp.kv_lost.iter().chain(&resp.kv_failed_loads));
    let failed: std::collections::HashSet<&str> = resp.kv_failed_loads.iter().map(String::as_str).collect();
    let bs = st.kv.block_size();
    for l in &plan.loading {
        let Some(i) = st.running_index(l.id) else { continue };
        let ok = l.keys.iter().take_while(|k| !failed.contains(k.as_str())).count() as u32;
        stats.tier_loaded_blocks += ok as u64;
        stats.tier_failed_loads += l.keys.len() as u64 - ok as u64;
        let s = &mut st.running[i];
        s.num_computed = (l.first_block + ok) * bs;
        if let Some(b) = s.blocks.as_ref() {
            st.kv.commit(s.adapter(), b, &s.tokens[..s.num_computed as usize]);
        }
    }
}

/// Gives back the blocks no later query of `s` reads when every layer has a
/// `window` (0: none). Its next query sits at position num_computed and reads
/// keys from num_computed + 1 - window on: the blocks wholly before that are dead.
fn release_behind_window(s: &mut Sequence, window: u32, block_size: u32) -> u64 {
    let first_read = (s.num_computed + 1).saturating_sub(window);
    match s.blocks.as_mut() {
        Some(b) if window > 0 => b.release_behind(first_read / block_size) as u64,
        _ => 0,
    }
}

/// The generation must answer the planned range: no tokens for a prompt
/// chunk, 1..=1+max_proposals tokens where the shard samples, never past
/// the `left` tokens of the sequence's max_new_tokens, and a finish on the
/// last of them (the shard decides the length finish from the stopping
/// criteria it was sent; a reply that overruns them is malformed).
fn check<'a>(p: &Planned, g: &'a pb::Generation, left: u32) -> Result<&'a pb::Generation, String> {
    if !g.error.is_empty() {
        return Ok(g);
    }
    let n = g.tokens.as_ref().map_or(0, |t| t.ids.len()) as u32;
    let finished = g.finish_reason != pb::FinishReason::Unspecified as i32;
    if !p.samples {
        if n > 0 || finished {
            return Err(format!("the shard sampled for request {}, whose prompt is not complete", p.id));
        }
        return Ok(g);
    }
    if n == 0 || n > 1 + p.max_proposals {
        return Err(format!(
            "the shard returned {n} tokens for request {}, expected 1 to {}",
            p.id,
            1 + p.max_proposals
        ));
    }
    if n > left {
        return Err(format!(
            "the shard returned {n} tokens for request {}, past its max_new_tokens ({left} left)",
            p.id
        ));
    }
    if n == left && !finished {
        return Err(format!("the shard did not finish request {} at its max_new_tokens", p.id));
    }
    Ok(g)
}

fn finish_of(code: i32) -> Option<Finish> {
    match pb::FinishReason::try_from(code).unwrap_or(pb::FinishReason::Unspecified) {
        pb::FinishReason::Unspecified => None,
        pb::FinishReason::Length => Some(Finish::Length),
        pb::FinishReason::EosToken => Some(Finish::EosToken),
        pb::FinishReason::StopSequence => Some(Finish::StopToken),
    }
}

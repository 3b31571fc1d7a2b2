//! The scheduler against a fake shard: schedule -> FakeShard::step -> update,
//! with no I/O. Outputs are checked against `fake_shard::next_token`, the
//! fake model, so recompute after preemption, chunking, speculation and
//! block sharing must all leave every sequence's tokens unchanged.

use std::collections::HashMap;
use std::time::Instant;

use proptest::prelude::*;
use tokio::sync::mpsc;

use super::admission::Budget;
use super::fake_shard::{next_token, FakeShard, EOS};
use super::schedule;
use super::state::State;
use super::update::{is_terminal, update};
use super::{AdmissionOrder, SchedulerConfig};
use crate::error::RouterError;
use crate::kv::{lifetime_blocks, KvManager};
use crate::proto::pb;
use crate::queue::{Entry, Finish, SeqEvent};
use crate::request::ValidRequest;

pub(super) const BS: u32 = 4;

pub(super) fn config(mixed: Option<u32>, chunk: Option<u32>, speculate: u32) -> SchedulerConfig {
    SchedulerConfig {
        budget: Budget {
            max_batch_prefill_tokens: 256,
            max_batch_total_tokens: 100_000,
            max_batch_size: 64,
            watermark_blocks: 1,
            prefill_chunk_tokens: chunk,
        },
        speculate,
        order: AdmissionOrder::Fifo,
        max_num_batched_tokens: mixed,
        priority_aging: None,
        max_running_per_tenant: None,
        max_loras: 2,
        sliding_window: 0,
        schedule_ahead_from: 1,
    }
}

pub(super) fn request(prompt: Vec<u32>, max_new: u32) -> ValidRequest {
    ValidRequest {
        inputs: String::new(),
        input_ids: prompt,
        parameters: pb::NextTokenChooserParameters::default(),
        max_new_tokens: max_new,
        ignore_eos: true,
        min_new_tokens: 0,
        stop_token_ids: vec![],
        stop_sequences: vec![],
        top_n_tokens: 0,
        decoder_input_details: false,
        prompt_top_n: 0,
        seed: None,
        grammar: None,
        priority: 0,
        tenant: None,
        adapter: None,
    }
}

pub(super) fn entry(id: u64, request: ValidRequest, group: Option<u64>) -> Entry {
    let (tx, _rx) = mpsc::unbounded_channel();
    Entry { id, request, response_tx: tx, queued_at: Instant::now(), queue_deadline: None, group }
}

/// What the fake model generates after `prompt`, `n` tokens (ignoring EOS).
pub(super) fn expected(prompt: &[u32], n: u32) -> Vec<u32> {
    let mut ctx = prompt.to_vec();
    for _ in 0..n {
        ctx.push(next_token(&ctx));
    }
    ctx[prompt.len()..].to_vec()
}

pub(super) fn prompt(id: u64, len: u32) -> Vec<u32> {
    (0..len).map(|i| 3 + ((id as u32 * 7 + i * 13) % 90)).collect()
}

#[derive(Default, Debug)]
pub(super) struct Outcome {
    pub tokens: HashMap<u64, Vec<u32>>,
    pub finish: HashMap<u64, Option<Finish>>,
    pub errors: HashMap<u64, RouterError>,
    /// Prompt logprobs (and alternatives) each sequence's stream got.
    pub prefill: HashMap<u64, (Vec<f32>, Vec<pb::Tokens>)>,
    pub steps: usize,
    /// Sequences preempted over the run.
    pub preempted: u32,
    /// Per step: prompt tokens, and decode tokens with their proposal room.
    pub step_tokens: Vec<(u32, u32)>,
    /// Blocks given back behind a sliding window, and the most blocks held at once.
    window_released: u64,
    peak_used: u32,
}

/// Runs schedule/step/update until nothing is left (or a step limit is hit,
/// which fails the test: the scheduler must never hang).
pub(super) fn drive(st: &mut State, shard: &mut FakeShard) -> Outcome {
    let mut out = Outcome::default();
    while !st.is_idle() {
        out.steps += 1;
        assert!(out.steps < 10_000, "the scheduler made no progress");
        let mut plan = schedule(st, Instant::now());
        out.preempted += plan.preempted;
        let rejected = std::mem::take(&mut plan.rejected);
        let refused = !rejected.is_empty();
        collect(&mut out, rejected.into_iter().map(|(id, e)| (id, Err(e))).collect());
        if plan.is_empty() && refused {
            if !plan.request.finished_ids.is_empty() {
                shard.step(&plan.request);
            }
            continue;
        }
        assert!(!plan.is_empty(), "work is left but nothing was scheduled");
        let prompt_tokens = plan.planned.iter().filter(|p| p.prompt).map(|p| p.num_tokens).sum();
        let decode_cost = plan.planned.iter().filter(|p| !p.prompt).map(|p| p.num_tokens + p.max_proposals).sum();
        out.step_tokens.push((prompt_tokens, decode_cost));
        let resp = shard.step(&plan.request);
        let (events, stats) = update(st, &plan, &resp);
        out.window_released += stats.window_released_blocks;
        out.peak_used = out.peak_used.max(st.kv.stats().used());
        collect(&mut out, events);
    }
    out
}

pub(super) fn collect(out: &mut Outcome, events: Vec<super::update::Event>) {
    for (id, ev) in events {
        let terminal = is_terminal(&ev);
        match ev {
            Ok(SeqEvent::Tokens { ids, finish, .. }) => {
                out.tokens.entry(id).or_default().extend(ids);
                if terminal {
                    out.finish.insert(id, finish);
                }
            }
            Ok(SeqEvent::Prefill { logprobs, top, .. }) => {
                assert!(out.prefill.insert(id, (logprobs, top)).is_none(), "request {id}: its prompt twice");
            }
            Err(e) => {
                out.errors.insert(id, e);
            }
        }
    }
}

pub(super) fn setup(cfg: SchedulerConfig, num_blocks: u32) -> (State, FakeShard) {
    (State::new(cfg, KvManager::new(num_blocks, BS, true)), FakeShard::new(BS, num_blocks))
}

pub(super) fn assert_no_leak(st: &State) {
    let kv = st.kv.stats();
    assert_eq!(kv.used(), 0, "blocks still held after every sequence ended: {kv:?}");
}

#[test]
fn every_request_completes_with_the_models_tokens() {
    for cfg in [config(None, None, 0), config(Some(16), None, 0), config(None, Some(5), 0)] {
        let (mut st, mut shard) = setup(cfg, 200);
        for id in 0..6 {
            st.enqueue(entry(id, request(prompt(id, 3 + id as u32 * 5), 7), None));
        }
        let out = drive(&mut st, &mut shard);
        for id in 0..6 {
            assert_eq!(out.tokens[&id], expected(&prompt(id, 3 + id as u32 * 5), 7), "request {id}");
            assert_eq!(out.finish[&id], Some(Finish::Length));
        }
        assert!(out.errors.is_empty());
        assert_no_leak(&st);
        assert_eq!(shard.held(), 0, "the shard still holds requests");
    }
}

#[test]
fn mixed_steps_respect_the_token_budget_and_carry_decodes_with_chunks() {
    let (mut st, mut shard) = setup(config(Some(10), None, 0), 200);
    st.enqueue(entry(0, request(prompt(0, 3), 30), None));
    // Admitted while 0 decodes: a long prompt that must be chunked around it.
    let plan = schedule(&mut st, Instant::now());
    let resp = shard.step(&plan.request);
    update(&mut st, &plan, &resp);
    st.enqueue(entry(1, request(prompt(1, 37), 4), None));
    let mut mixed = 0;
    while !st.is_idle() {
        let plan = schedule(&mut st, Instant::now());
        let total: u32 = plan.planned.iter().map(|p| p.num_tokens).sum();
        assert!(total <= 10, "step of {total} tokens over a budget of 10");
        if plan.planned.iter().any(|p| p.prompt) && plan.planned.iter().any(|p| !p.prompt) {
            mixed += 1;
        }
        let resp = shard.step(&plan.request);
        update(&mut st, &plan, &resp);
    }
    // 37 tokens in 9-token chunks next to one decode: 5 steps carry both.
    assert!(mixed >= 4, "only {mixed} mixed steps");
    assert_no_leak(&st);
}

#[test]
fn without_mixed_steps_prefill_and_decode_steps_never_mix() {
    let (mut st, mut shard) = setup(config(None, Some(6), 0), 200);
    for id in 0..4 {
        st.enqueue(entry(id, request(prompt(id, 11), 5), None));
    }
    let out = drive(&mut st, &mut shard);
    for step in &shard.steps {
        let prompts = step.requests.iter().filter(|r| r.new_request.is_some() || r.num_tokens > 1).count();
        let prompt_tokens: u32 = step.requests.iter().filter(|r| r.num_tokens > 1).map(|r| r.num_tokens).sum();
        assert!(prompts == 0 || prompts == step.requests.len() || prompt_tokens <= 6);
    }
    assert_eq!(out.tokens.len(), 4);
}

#[test]
fn a_chunked_prompt_gives_the_same_tokens_and_sends_no_sampling_for_chunks() {
    let p = prompt(9, 50);
    let (mut st, mut shard) = setup(config(None, Some(8), 0), 200);
    st.enqueue(entry(9, request(p.clone(), 6), None));
    let out = drive(&mut st, &mut shard);
    assert_eq!(out.tokens[&9], expected(&p, 6));
    let chunks: Vec<u32> = shard.steps.iter().flat_map(|s| s.requests.iter()).map(|r| r.num_tokens).collect();
    assert_eq!(&chunks[..7], &[8, 8, 8, 8, 8, 8, 2]);
    // Only the first step carries the request; later chunks append blocks only.
    assert!(shard.steps[0].requests[0].new_request.is_some());
    assert!(shard.steps[1..].iter().all(|s| s.requests.iter().all(|r| r.new_request.is_none())));
}

#[test]
fn preemption_recomputes_and_loses_nothing() {
    // 14 usable blocks of 4 tokens: four sequences growing to 30 tokens cannot all fit.
    let (mut st, mut shard) = setup(config(Some(64), None, 0), 15);
    for id in 0..4 {
        st.enqueue(entry(id, request(prompt(id, 6), 24), None));
    }
    let out = drive(&mut st, &mut shard);
    assert!(out.preempted > 0, "the pool was large enough: the test does not preempt");
    for id in 0..4 {
        assert_eq!(out.tokens[&id], expected(&prompt(id, 6), 24), "request {id}");
    }
    assert_no_leak(&st);
    assert_eq!(shard.held(), 0);
}

#[test]
fn a_recompute_longer_than_any_step_resumes_in_steps_without_chunking() {
    // No chunked prefill, 16-token steps, 19 usable blocks of 4 tokens for
    // five sequences growing to 30 tokens (two of them forks of request 10):
    // some are preempted past 16 tokens, and their recompute is longer than a step.
    let mut cfg = config(None, None, 0);
    cfg.budget.max_batch_prefill_tokens = 16;
    let (mut st, mut shard) = setup(cfg, 20);
    for id in 0..3 {
        st.enqueue(entry(id, request(prompt(id, 6), 24), None));
    }
    for f in 0..2 {
        st.enqueue(entry(10 + f, request(prompt(10, 6), 24), Some(1000)));
    }
    let out = drive(&mut st, &mut shard);
    assert!(out.preempted > 0, "the pool was large enough: the test does not preempt");
    assert!(out.errors.is_empty(), "refused: {:?}", out.errors);
    for id in [0, 1, 2, 10, 11] {
        assert_eq!(out.tokens[&id], expected(&prompt(id.min(10), 6), 24), "request {id}");
    }
    assert_no_leak(&st);
    assert_eq!(shard.held(), 0);
}

#[test]
fn speculative_rollback_keeps_the_tokens_exact() {
    for accept in [0, 1, 3] {
        let (mut st, mut shard) = setup(config(Some(64), None, 3), 100);
        shard.accept = accept;
        for id in 0..3 {
            st.enqueue(entry(id, request(prompt(id, 5), 13), None));
        }
        let out = drive(&mut st, &mut shard);
        for id in 0..3 {
            assert_eq!(out.tokens[&id], expected(&prompt(id, 5), 13), "accept {accept}, request {id}");
        }
        assert!(shard.steps.iter().any(|s| s.requests.iter().any(|r| r.max_proposals == 3)));
        assert_no_leak(&st);
    }
}

#[test]
fn forks_share_the_prompt_blocks_their_leader_writes_in_the_same_step() {
    let (mut st, mut shard) = setup(config(None, None, 0), 100);
    let p = prompt(4, 13);
    for id in 10..13 {
        st.enqueue(entry(id, request(p.clone(), 3), Some(10)));
    }
    let plan = schedule(&mut st, Instant::now());
    assert_eq!(plan.planned.len(), 3, "forks are admitted together");
    // 13 tokens: 3 full blocks are shared, the forks compute the last token.
    assert_eq!(plan.planned[1].num_computed, 12);
    assert_eq!(plan.request.requests[1].new_block_ids[..3], plan.request.requests[0].new_block_ids[..3]);
    let resp = shard.step(&plan.request);
    let (events, _) = update(&mut st, &plan, &resp);
    let mut out = Outcome::default();
    collect(&mut out, events);
    let rest = drive(&mut st, &mut shard);
    for id in 10..13 {
        let mut all = out.tokens.get(&id).cloned().unwrap_or_default();
        all.extend(rest.tokens.get(&id).cloned().unwrap_or_default());
        assert_eq!(all, expected(&p, 3));
    }
}

#[test]
fn a_cached_prefix_starts_the_next_request_past_it() {
    let (mut st, mut shard) = setup(config(None, None, 0), 100);
    let p = prompt(1, 10);
    st.enqueue(entry(0, request(p.clone(), 2), None));
    drive(&mut st, &mut shard);
    st.enqueue(entry(1, request(p.clone(), 2), None));
    let plan = schedule(&mut st, Instant::now());
    assert_eq!(plan.planned[0].num_computed, 8);
    assert_eq!(plan.prefix_hit_tokens, 8);
    let resp = shard.step(&plan.request);
    update(&mut st, &plan, &resp);
    let out = drive(&mut st, &mut shard);
    assert_eq!(out.tokens[&1], expected(&p, 2)[1..].to_vec());
}

#[test]
fn eos_finishes_unless_ignored() {
    // Find a prompt whose first generated token is EOS.
    let p = (0..500u32).map(|x| vec![5, x]).find(|p| next_token(p) == EOS).expect("some prompt samples EOS");
    let (mut st, mut shard) = setup(config(None, None, 0), 50);
    let mut r = request(p.clone(), 5);
    r.ignore_eos = false;
    st.enqueue(entry(0, r, None));
    st.enqueue(entry(1, request(p.clone(), 5), None));
    let out = drive(&mut st, &mut shard);
    assert_eq!(out.tokens[&0], vec![EOS]);
    assert_eq!(out.finish[&0], Some(Finish::EosToken));
    assert_eq!(out.tokens[&1].len(), 5);
}

#[test]
fn abort_tells_the_shard_and_frees_the_blocks() {
    let (mut st, mut shard) = setup(config(Some(32), None, 0), 50);
    st.enqueue(entry(0, request(prompt(0, 9), 50), None));
    st.enqueue(entry(1, request(prompt(1, 9), 5), None));
    for _ in 0..3 {
        let plan = schedule(&mut st, Instant::now());
        let resp = shard.step(&plan.request);
        update(&mut st, &plan, &resp);
    }
    assert!(shard.holds(0));
    assert!(st.abort(0));
    assert!(!st.abort(0), "a second abort finds nothing");
    let plan = schedule(&mut st, Instant::now());
    assert_eq!(plan.request.finished_ids, vec![0]);
    let resp = shard.step(&plan.request);
    update(&mut st, &plan, &resp);
    assert!(!shard.holds(0));
    drive(&mut st, &mut shard);
    assert_no_leak(&st);
    // A queued request aborts without the shard hearing of it.
    st.enqueue(entry(7, request(prompt(7, 4), 3), None));
    assert!(st.abort(7));
    assert!(st.is_idle() && st.finished.is_empty());
}

/// Runs one step with the shard's reply altered by `corrupt`; returns the events.
fn corrupted_step(corrupt: impl Fn(&mut pb::StepResponse)) -> (State, FakeShard, Outcome) {
    let (mut st, mut shard) = setup(config(Some(64), None, 0), 50);
    for id in 0..3 {
        st.enqueue(entry(id, request(prompt(id, 5), 4), None));
    }
    let plan = schedule(&mut st, Instant::now());
    let mut resp = shard.step(&plan.request);
    corrupt(&mut resp);
    let (events, _) = update(&mut st, &plan, &resp);
    let mut out = Outcome::default();
    collect(&mut out, events);
    (st, shard, out)
}

#[test]
fn a_missing_generation_fails_that_request_only() {
    let (mut st, mut shard, out) = corrupted_step(|r| r.generations.retain(|g| g.request_id != 1));
    assert_eq!(out.errors[&1].error_type(), "generation");
    assert_eq!(out.errors.len(), 1);
    assert_eq!(st.finished, vec![1], "the shard is told to forget it");
    let rest = drive(&mut st, &mut shard);
    assert_eq!(rest.tokens[&0].len() + out.tokens[&0].len(), 4);
    assert_no_leak(&st);
}

#[test]
fn wrong_token_counts_and_duplicates_fail_the_requests_they_touch() {
    let (_, _, out) = corrupted_step(|r| {
        r.generations[0].tokens.as_mut().unwrap().ids.push(5);
        r.generations[1].tokens = None;
        let dup = r.generations[2].clone();
        r.generations.push(dup);
    });
    for id in 0..3 {
        assert_eq!(out.errors[&id].error_type(), "generation", "request {id}");
    }
}

/// The shard decides the length finish; a reply past what the router sent
/// (more tokens than are left, or none finishing at the limit) is malformed.
#[test]
fn a_reply_past_max_new_tokens_or_not_finishing_at_it_is_malformed() {
    type Corrupt = fn(&mut pb::Generation);
    let overrun: Corrupt = |g| {
        g.tokens.as_mut().unwrap().ids.push(7);
        g.tokens.as_mut().unwrap().logprobs.push(-0.5);
        g.finish_reason = pb::FinishReason::Unspecified as i32;
    };
    let no_finish: Corrupt = |g| g.finish_reason = pb::FinishReason::Unspecified as i32;
    for corrupt in [overrun, no_finish] {
        // Room for proposals, so that an extra token is within the step's count.
        let (mut st, mut shard) = setup(config(Some(64), None, 3), 50);
        st.enqueue(entry(0, request(prompt(0, 5), 2), None));
        let plan = schedule(&mut st, Instant::now());
        let (events, _) = update(&mut st, &plan, &shard.step(&plan.request));
        assert!(matches!(&events[..], [(0, Ok(SeqEvent::Tokens { finish: None, .. }))]));
        // The last token: the shard finishes it with `length`.
        let plan = schedule(&mut st, Instant::now());
        let mut resp = shard.step(&plan.request);
        assert_eq!(resp.generations[0].finish_reason, pb::FinishReason::Length as i32);
        corrupt(&mut resp.generations[0]);
        let (events, _) = update(&mut st, &plan, &resp);
        assert!(matches!(&events[..], [(0, Err(RouterError::Generation(_)))]), "{events:?}");
        assert!(st.is_idle());
        assert_eq!(st.finished, vec![0], "the shard is told to forget it");
        assert_no_leak(&st);
    }
}

#[test]
fn unknown_ids_in_a_reply_are_ignored() {
    let (mut st, mut shard, out) = corrupted_step(|r| {
        r.generations.push(pb::Generation { request_id: 999, ..Default::default() });
    });
    assert!(out.errors.is_empty());
    let plan = schedule(&mut st, Instant::now());
    let resp = shard.step(&plan.request);
    let (_, stats) = update(&mut st, &plan, &resp);
    assert_eq!(stats.unknown_ids, 0);
}

#[test]
fn a_sample_on_a_prompt_chunk_is_malformed() {
    let (mut st, mut shard) = setup(config(None, Some(4), 0), 50);
    st.enqueue(entry(0, request(prompt(0, 10), 3), None));
    let plan = schedule(&mut st, Instant::now());
    assert!(!plan.planned[0].samples);
    let mut resp = shard.step(&plan.request);
    resp.generations[0].tokens = Some(pb::Tokens { ids: vec![4], logprobs: vec![0.0] });
    let (events, _) = update(&mut st, &plan, &resp);
    assert!(matches!(&events[0], (0, Err(RouterError::Generation(_)))));
    assert!(st.is_idle());
    assert_no_leak(&st);
}

#[test]
fn a_shard_error_for_one_request_ends_it_as_a_validation_error() {
    let (st, _, out) = corrupted_step(|r| {
        r.generations[2] =
            pb::Generation { request_id: 2, error: "grammar does not compile".into(), ..Default::default() };
    });
    assert_eq!(out.errors[&2].error_type(), "validation");
    assert!(!st.finished.contains(&2), "the shard dropped it itself");
}

#[test]
fn a_failed_step_ends_every_running_request_and_frees_its_blocks() {
    let (mut st, _shard) = setup(config(Some(64), None, 0), 50);
    for id in 0..3 {
        st.enqueue(entry(id, request(prompt(id, 5), 4), None));
    }
    let _plan = schedule(&mut st, Instant::now());
    let mut ids = st.fail_running();
    ids.sort();
    assert_eq!(ids, vec![0, 1, 2]);
    assert_no_leak(&st);
}

#[test]
fn admission_waits_for_blocks_rather_than_overcommitting() {
    // 9 usable blocks; each request needs 3 for its prompt, more to grow.
    let (mut st, mut shard) = setup(config(None, None, 0), 10);
    for id in 0..6 {
        st.enqueue(entry(id, request(prompt(id, 12), 3), None));
    }
    let plan = schedule(&mut st, Instant::now());
    assert!(plan.planned.len() < 6, "admitted {} prompts into 9 blocks", plan.planned.len());
    let resp = shard.step(&plan.request);
    update(&mut st, &plan, &resp);
    let out = drive(&mut st, &mut shard);
    assert_eq!(out.errors.len(), 0);
    assert_no_leak(&st);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]
    /// Any mix of prompts and budgets: everything completes with the model's
    /// tokens, no step exceeds its budget (unless one unsplittable prompt
    /// goes alone), and every block comes back.
    #[test]
    fn random_workloads_complete_exactly(
        reqs in prop::collection::vec((1u32..40, 1u32..12), 1..12),
        budget in prop::option::of(4u32..48),
        chunk in prop::option::of(2u32..20),
        speculate in 0u32..3,
        accept in 0u32..3,
        blocks in 16u32..80,
    ) {
        let (mut st, mut shard) = setup(config(budget, chunk, speculate), blocks);
        shard.accept = accept;
        for (i, &(len, n)) in reqs.iter().enumerate() {
            st.enqueue(entry(i as u64, request(prompt(i as u64, len), n), None));
        }
        let out = drive(&mut st, &mut shard);
        for (i, &(len, n)) in reqs.iter().enumerate() {
            prop_assert_eq!(&out.tokens[&(i as u64)], &expected(&prompt(i as u64, len), n));
        }
        if let Some(b) = budget {
            for (prompt_tokens, decode_cost) in &out.step_tokens {
                prop_assert!(*prompt_tokens <= b.saturating_sub(*decode_cost), "{prompt_tokens} prompt tokens next to {decode_cost} decode tokens");
            }
        }
        assert_no_leak(&st);
        prop_assert_eq!(shard.held(), 0);
    }
}

#[test]
fn a_request_that_can_never_fit_is_refused_at_once_and_the_rest_are_served() {
    // 14 usable blocks of 4 = 56 tokens; request 1 needs 6 + 99 tokens.
    let (mut st, mut shard) = setup(config(Some(64), None, 0), 15);
    st.enqueue(entry(1, request(prompt(1, 6), 100), None));
    for id in [0, 2] {
        st.enqueue(entry(id, request(prompt(id, 6), 10), None));
    }
    let first = schedule(&mut st, Instant::now());
    assert_eq!(first.rejected.len(), 1, "refused on the first step, not after retries");
    assert_eq!(first.rejected[0].0, 1);
    let msg = first.rejected[0].1.to_string();
    assert!(msg.contains("needs 27 blocks") && msg.contains("holds 14"), "{msg}");
    assert_eq!(first.rejected[0].1.error_type(), "validation");
    assert_eq!(first.planned.len(), 2, "the requests behind it are admitted in the same step");
    let resp = shard.step(&first.request);
    let (events, _) = update(&mut st, &first, &resp);
    let mut out = Outcome::default();
    collect(&mut out, events);
    let rest = drive(&mut st, &mut shard);
    for id in [0, 2] {
        let mut all = out.tokens.remove(&id).unwrap_or_default();
        all.extend(rest.tokens.get(&id).cloned().unwrap_or_default());
        assert_eq!(all, expected(&prompt(id, 6), 10), "request {id}");
    }
    assert!(rest.errors.is_empty());
    assert_no_leak(&st);
}

#[test]
fn forks_that_together_outgrow_the_pool_are_refused() {
    // Each of 3 forks alone fits (6 + 19 tokens = 7 blocks), together 1 + 3 x 6 = 19 > 14.
    let (mut st, mut shard) = setup(config(None, None, 0), 15);
    assert_eq!(lifetime_blocks(6, 20, 0, 3, BS), 19);
    for id in 10..13 {
        st.enqueue(entry(id, request(prompt(4, 6), 20), Some(10)));
    }
    st.enqueue(entry(20, request(prompt(5, 6), 3), None));
    let out = drive(&mut st, &mut shard);
    for id in 10..13 {
        assert_eq!(out.errors[&id].error_type(), "validation", "fork {id}");
    }
    assert_eq!(out.tokens[&20], expected(&prompt(5, 6), 3));
    assert_no_leak(&st);
}

#[test]
fn a_sequence_that_outgrows_the_pool_alone_ends_with_an_error_not_a_retry_loop() {
    // Admission saw max_new_tokens 4; the sequence then grows as if it had
    // asked for 100 (what a check that is bypassed would let through).
    let (mut st, mut shard) = setup(config(Some(64), None, 0), 15);
    let p = prompt(3, 6);
    st.enqueue(entry(3, request(p.clone(), 4), None));
    let mut plan = schedule(&mut st, Instant::now());
    st.running[0].request.max_new_tokens = 100;
    let stop = plan.request.requests[0].new_request.as_mut().unwrap().stopping_parameters.as_mut().unwrap();
    stop.max_new_tokens = 100;
    let resp = shard.step(&plan.request);
    let (events, _) = update(&mut st, &plan, &resp);
    let mut out = Outcome::default();
    collect(&mut out, events);
    let rest = drive(&mut st, &mut shard);
    let err = &rest.errors[&3];
    assert_eq!(err.error_type(), "validation");
    assert!(err.to_string().contains("holds 14"), "{err}");
    // 56 slots: it ran until its table needed a 15th block, and every token
    // it streamed is the model's.
    let mut got = out.tokens.remove(&3).unwrap_or_default();
    got.extend(rest.tokens.get(&3).cloned().unwrap_or_default());
    assert_eq!(got.len(), 56 - 6 + 1);
    assert_eq!(got, expected(&p, got.len() as u32));
    assert!(rest.steps < 100, "{} steps", rest.steps);
    assert_eq!(shard.held(), 0, "the shard is told to forget it");
    assert_no_leak(&st);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]
    /// Requests of any size against a small pool: a request is refused
    /// exactly when it needs more blocks at its longest than the pool
    /// holds; every other request completes with the model's tokens, no
    /// step loops forever, and every block comes back.
    #[test]
    fn oversized_requests_are_refused_and_never_block_the_rest(
        reqs in prop::collection::vec((1u32..40, 1u32..60, 1u32..3), 1..10),
        budget in prop::option::of(8u32..48),
        chunk in prop::option::of(4u32..20),
        blocks in 8u32..30,
    ) {
        let mut cfg = config(budget, chunk, 0);
        cfg.budget.max_batch_prefill_tokens = 64;
        let (mut st, mut shard) = setup(cfg, blocks);
        let capacity = st.kv.capacity() as u64;
        for (i, &(len, n, forks)) in reqs.iter().enumerate() {
            let group = (forks > 1).then_some(1000 + i as u64);
            for f in 0..forks as u64 {
                st.enqueue(entry(i as u64 * 10 + f, request(prompt(i as u64, len), n), group));
            }
        }
        let out = drive(&mut st, &mut shard);
        for (i, &(len, n, forks)) in reqs.iter().enumerate() {
            let too_big = lifetime_blocks(len, n, 0, forks, BS) > capacity;
            for f in 0..forks as u64 {
                let id = i as u64 * 10 + f;
                if too_big {
                    prop_assert_eq!(out.errors.get(&id).map(|e| e.error_type()), Some("validation"));
                    prop_assert!(!out.tokens.contains_key(&id), "request {} streamed before its refusal", id);
                } else {
                    prop_assert!(!out.errors.contains_key(&id), "request {}: {:?}", id, out.errors.get(&id));
                    prop_assert_eq!(&out.tokens[&id], &expected(&prompt(i as u64, len), n));
                }
            }
        }
        assert_no_leak(&st);
        prop_assert_eq!(shard.held(), 0);
    }
}

fn windowed(mut cfg: SchedulerConfig, window: u32, num_blocks: u32) -> (State, FakeShard) {
    cfg.sliding_window = window;
    let (st, mut shard) = setup(cfg, num_blocks);
    shard.window = window;
    (st, shard)
}

#[test]
fn windowed_sequences_give_blocks_back_and_keep_their_tokens() {
    // The fake shard checks every key a query's window reads: a block given
    // back too early is reused by another sequence and fails that check.
    let configs = [config(None, None, 0), config(Some(16), Some(5), 0), config(None, None, 2)];
    for (k, cfg) in configs.into_iter().enumerate() {
        let (mut st, mut shard) = windowed(cfg, 6, 24);
        shard.accept = 1;
        for id in 0..5 {
            st.enqueue(entry(id, request(prompt(id, 3 + id as u32 * 5), 30), None));
        }
        let out = drive(&mut st, &mut shard);
        for id in 0..5 {
            assert_eq!(out.tokens[&id], expected(&prompt(id, 3 + id as u32 * 5), 30), "config {k} request {id}");
        }
        assert!(out.errors.is_empty(), "config {k}: {:?}", out.errors);
        assert!(out.window_released > 0, "config {k}: no block was given back");
        assert_no_leak(&st);
    }
}

#[test]
fn recomputed_tokens_count_exactly_what_preemption_made_the_shard_redo() {
    let (mut st, mut shard) = setup(config(Some(64), None, 0), 13);
    for id in 0..3 {
        st.enqueue(entry(id, request(prompt(id, 6), 24), None));
    }
    let (mut recomputed, mut prompt_tokens, mut preempted) = (0u64, 0u64, 0);
    while !st.is_idle() {
        let plan = schedule(&mut st, Instant::now());
        recomputed += plan.recomputed_tokens;
        prompt_tokens += plan.prompt_tokens;
        preempted += plan.preempted;
        let resp = shard.step(&plan.request);
        update(&mut st, &plan, &resp);
    }
    assert!(preempted > 0);
    // Prompt work: the three prompts once (distinct, so no cache hits),
    // plus per resume what the victim had computed and lost, plus its last
    // sampled token, which was never computed before.
    assert!(recomputed > 0);
    assert_eq!(prompt_tokens, 3 * 6 + recomputed + preempted as u64);
}

#[test]
fn a_long_windowed_request_holds_only_its_window() {
    // 4 + 100 tokens of 4-token blocks would take 26 blocks; behind an 8-token
    // window a few are held at once (measured after each step: at most 3).
    let (mut st, mut shard) = windowed(config(None, None, 0), 8, 200);
    st.enqueue(entry(0, request(prompt(0, 4), 100), None));
    let out = drive(&mut st, &mut shard);
    assert_eq!(out.tokens[&0], expected(&prompt(0, 4), 100));
    assert!(out.peak_used <= 8 / BS + 2, "peak {} blocks", out.peak_used);
    // The last query (position 103) reads from 96 on: blocks 0..24 were given back.
    assert_eq!(out.window_released, ((104 - 8) / BS) as u64);
    assert_no_leak(&st);
    // Without a window the same request holds every block to the end.
    let (mut st, mut shard) = setup(config(None, None, 0), 200);
    st.enqueue(entry(0, request(prompt(0, 4), 100), None));
    let out = drive(&mut st, &mut shard);
    assert_eq!((out.peak_used, out.window_released), (104 / BS, 0));
}

#[test]
fn the_prefix_cache_never_serves_blocks_a_window_gave_back() {
    // A's prompt blocks enter the cache at prefill; its later blocks were given
    // back, so its finish commits nothing. B repeats A's whole text: it may
    // start past A's cached prompt blocks only, which still hold A's KV (the
    // fake shard checks what B's windows read).
    let (mut st, mut shard) = windowed(config(None, None, 0), 6, 40);
    let a = prompt(1, 13);
    st.enqueue(entry(1, request(a.clone(), 20), None));
    let out = drive(&mut st, &mut shard);
    assert!(out.window_released > 0);
    let mut b = a.clone();
    b.extend(&out.tokens[&1]);
    assert_eq!(st.kv.peek_prefix(None, &b), 13 / BS, "the cache offers more than A's prompt blocks");
    st.enqueue(entry(2, request(b.clone(), 10), None));
    // Other traffic first, so that blocks A gave back are reused before B runs.
    for id in 3..6 {
        st.enqueue(entry(id, request(prompt(id, 9), 12), None));
    }
    let out = drive(&mut st, &mut shard);
    assert_eq!(out.tokens[&2], expected(&b, 10));
    assert!(out.errors.is_empty());
    assert_no_leak(&st);
}

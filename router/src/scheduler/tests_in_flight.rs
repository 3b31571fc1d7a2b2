//! A prefix computed once: requests arriving while another request computes
//! the prompt prefix they share wait for its blocks (in_flight.rs) and then
//! take them from the cache, against the fake shard.

use std::collections::HashMap;
use std::time::Instant;

use proptest::prelude::*;

use super::in_flight::waits;
use super::preempt::preempt;
use super::schedule;
use super::state::State;
use super::step_plan::StepPlan;
use super::tests::{assert_no_leak, collect, config, entry, expected, request, setup, Outcome, BS};
use super::update::update;
use crate::queue::Entry;

/// A shared system prompt of `blocks` full blocks, then a question of its own.
fn shared_prompt(system: u32, blocks: u32, id: u64) -> Vec<u32> {
    let mut p: Vec<u32> = (0..blocks * BS).map(|i| 3 + (system * 11 + i * 7) % 90).collect();
    p.extend([5 + id as u32 % 80, 7, 9]);
    p
}

/// Like `drive`, with `arrivals[k]` enqueued before step k; also counts the
/// prompt tokens every step computed.
fn drive_arrivals(st: &mut State, arrivals: &mut HashMap<usize, Vec<Entry>>) -> (Outcome, u64) {
    let mut shard = super::fake_shard::FakeShard::new(BS, st.kv.capacity() + 1);
    let mut out = Outcome::default();
    let mut computed = 0;
    let mut step = 0;
    while !st.is_idle() || arrivals.keys().any(|&k| k >= step) {
        for e in arrivals.remove(&step).unwrap_or_default() {
            st.enqueue(e);
        }
        step += 1;
        assert!(step < 5_000, "the scheduler made no progress");
        let plan = schedule(st, Instant::now());
        computed += plan.prompt_tokens;
        if plan.is_empty() {
            assert!(st.queue.is_empty() || !st.running.is_empty(), "work is queued but nothing was scheduled");
            continue;
        }
        let resp = shard.step(&plan.request);
        let (events, _) = update(st, &plan, &resp);
        collect(&mut out, events);
    }
    (out, computed)
}

fn arrivals(at: &[(usize, u64, Vec<u32>)]) -> HashMap<usize, Vec<Entry>> {
    let mut m: HashMap<usize, Vec<Entry>> = HashMap::new();
    for (step, id, p) in at {
        m.entry(*step).or_default().push(entry(*id, request(p.clone(), 3), None));
    }
    m
}

#[test]
fn requests_arriving_while_their_prefix_is_computed_wait_and_compute_it_once() {
    // 10 shared blocks (40 tokens) + 3 computed in 16-token chunks: the
    // last chunk writes blocks 8 and 9 and leaves room to admit the others,
    // which share those blocks in that step instead of writing their own.
    for cfg in [config(None, Some(16), 0), config(Some(20), Some(16), 0)] {
        let (mut st, _) = setup(cfg, 200);
        let prompts: Vec<Vec<u32>> = (0..4).map(|id| shared_prompt(1, 10, id)).collect();
        let mut at = arrivals(&[(0, 0, prompts[0].clone()), (1, 1, prompts[1].clone()), (2, 2, prompts[2].clone())]);
        at.entry(3).or_default().push(entry(3, request(prompts[3].clone(), 3), None));
        let (out, computed) = drive_arrivals(&mut st, &mut at);
        // The prefix once, then each question's 3 tokens.
        assert_eq!(computed, 43 + 3 * 3, "prompt tokens computed");
        for (id, p) in prompts.iter().enumerate() {
            assert_eq!(out.tokens[&(id as u64)], expected(p, 3), "request {id}");
        }
        assert!(out.errors.is_empty());
        assert_no_leak(&st);
    }
}

#[test]
fn a_request_sharing_blocks_computed_in_the_same_step_shares_them_at_once() {
    let (mut st, _) = setup(config(Some(64), None, 0), 200);
    let p0 = shared_prompt(2, 6, 0);
    let p1 = shared_prompt(2, 6, 1);
    let mut at = arrivals(&[(0, 0, p0.clone()), (0, 1, p1.clone())]);
    let (out, computed) = drive_arrivals(&mut st, &mut at);
    assert_eq!(computed, 27 + 3);
    assert_eq!(out.tokens[&1], expected(&p1, 3));
}

/// `b` queued behind `a`, which runs its prompt's first chunk.
fn owner_and_waiter() -> (State, StepPlan) {
    let (mut st, mut shard) = setup(config(None, Some(8), 0), 200);
    st.enqueue(entry(0, request(shared_prompt(3, 10, 0), 3), None));
    let plan = schedule(&mut st, Instant::now());
    let resp = shard.step(&plan.request);
    update(&mut st, &plan, &resp);
    st.enqueue(entry(1, request(shared_prompt(3, 10, 1), 3), None));
    (st, StepPlan::default())
}

#[test]
fn a_waiter_waits_only_while_its_owner_runs_its_prompt() {
    let (mut st, plan) = owner_and_waiter();
    assert!(waits(&st, &plan, &st.queue[0]));
    // The owner preempted: nobody computes the prefix for the waiter, which proceeds.
    let owner = st.running.remove(0);
    let owner = preempt(&mut st, owner);
    assert!(!waits(&st, &plan, &st.queue[0]));
    st.queue.push_back(owner);
}

#[test]
fn a_waiter_does_not_wait_without_prefix_caching_or_with_windowed_layers() {
    let (mut st, plan) = owner_and_waiter();
    st.config.sliding_window = 16;
    assert!(!waits(&st, &plan, &st.queue[0]));
    let (mut st, mut shard) = (
        State::new(config(None, Some(8), 0), crate::kv::KvManager::new(200, BS, false)),
        super::fake_shard::FakeShard::new(BS, 200),
    );
    st.enqueue(entry(0, request(shared_prompt(3, 10, 0), 3), None));
    let plan = schedule(&mut st, Instant::now());
    update(&mut st, &plan, &shard.step(&plan.request));
    st.enqueue(entry(1, request(shared_prompt(3, 10, 1), 3), None));
    assert!(!waits(&st, &StepPlan::default(), &st.queue[0]));
}

proptest! {
    // Whatever arrives when, on a pool small enough to preempt: every request
    // ends with the model's tokens, nothing leaks, and the scheduler never
    // stalls (waiters never wait on each other or on nobody).
    #[test]
    fn waiting_never_deadlocks_and_keeps_tokens_exact(
        reqs in prop::collection::vec((0u32..3, 1u32..8, 0usize..12), 1..12),
        blocks in 24u32..80, chunk in 4u32..20, mixed in prop::bool::ANY,
    ) {
        let cfg = config(mixed.then_some(chunk + 4), Some(chunk), 0);
        let mut st = State::new(cfg, crate::kv::KvManager::new(blocks, BS, true));
        let at: Vec<(usize, u64, Vec<u32>)> = reqs.iter().enumerate()
            .map(|(id, &(sys, nb, step))| (step, id as u64, shared_prompt(sys, nb, id as u64))).collect();
        let mut arr = arrivals(&at);
        let (out, _) = drive_arrivals(&mut st, &mut arr);
        for (_, id, p) in &at {
            prop_assert_eq!(&out.tokens[id], &expected(p, 3));
        }
        prop_assert!(out.errors.is_empty());
        assert_no_leak(&st);
    }
}

#[test]
fn a_request_sharing_a_prefix_its_owner_loads_from_the_second_tier_waits_for_it() {
    // Room to admit both at once.
    let (mut st, mut shard) = super::tests_tier::tiered(40);
    let p = super::tests_tier::shared(40);
    st.enqueue(entry(1, request(p.clone(), 3), None));
    super::tests::drive(&mut st, &mut shard);
    // Unrelated prompts evict it from the pool; the tier keeps it.
    for id in 2..8 {
        st.enqueue(entry(id, request(super::tests::prompt(id, 40), 2), None));
        super::tests::drive(&mut st, &mut shard);
    }
    let (a, b) = ([p.clone(), vec![7, 8, 9]].concat(), [p.clone(), vec![5, 6, 7]].concat());
    st.enqueue(entry(10, request(a.clone(), 3), None));
    st.enqueue(entry(11, request(b.clone(), 3), None));
    let loads_before: usize = shard.steps.iter().map(|s| s.kv_loads.len()).sum();
    let out = super::tests::drive(&mut st, &mut shard);
    let loads: usize = shard.steps.iter().map(|s| s.kv_loads.len()).sum::<usize>() - loads_before;
    assert_eq!(loads, 10, "the prefix's 10 blocks are loaded once, by the first request");
    let first_b = shard.steps.iter().flat_map(|s| &s.requests).find(|r| r.id == 11).unwrap();
    assert_eq!(first_b.num_computed, 40, "the second starts past the prefix the first loaded");
    assert_eq!((out.tokens[&10].clone(), out.tokens[&11].clone()), (expected(&a, 3), expected(&b, 3)));
    assert_no_leak(&st);
}

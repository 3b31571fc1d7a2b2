//! A better-priority arrival preempts running worse-priority sequences
//! (priority_preempt.rs), against the fake shard (helpers in tests.rs).

use std::time::{Duration, Instant};

use proptest::prelude::*;

use super::fake_shard::FakeShard;
use super::schedule;
use super::state::State;
use super::tests::{assert_no_leak, collect, config, drive, entry, expected, prompt, request, setup, Outcome};
use super::update::update;
use crate::request::ValidRequest;

fn with_priority(mut r: ValidRequest, priority: i32) -> ValidRequest {
    r.priority = priority;
    r
}

/// Runs `n` steps, collecting what they stream.
fn steps(st: &mut State, shard: &mut FakeShard, n: usize, out: &mut Outcome) {
    for _ in 0..n {
        let plan = schedule(st, Instant::now());
        let resp = shard.step(&plan.request);
        let (events, _) = update(st, &plan, &resp);
        collect(out, events);
    }
}

fn running_ids(st: &State) -> Vec<u64> {
    let mut ids: Vec<u64> = st.running.iter().map(|s| s.id).collect();
    ids.sort();
    ids
}

/// Two worse-priority requests hold both seats; a better one arrives.
fn seats_taken(priority: i32) -> (State, FakeShard, Outcome) {
    let mut cfg = config(Some(64), None, 0);
    cfg.budget.max_batch_size = 2;
    let (mut st, mut shard) = setup(cfg, 200);
    st.enqueue(entry(0, with_priority(request(prompt(0, 5), 20), 5), None));
    st.enqueue(entry(1, with_priority(request(prompt(1, 9), 20), 5), None));
    let mut out = Outcome::default();
    steps(&mut st, &mut shard, 4, &mut out);
    st.enqueue(entry(9, with_priority(request(prompt(9, 5), 6), priority), None));
    (st, shard, out)
}

#[test]
fn a_better_priority_arrival_takes_a_seat_at_once() {
    let (mut st, mut shard, mut out) = seats_taken(-1);
    let plan = schedule(&mut st, Instant::now());
    assert_eq!(plan.preempted, 1);
    assert!(plan.planned.iter().any(|p| p.id == 9 && p.prompt), "the arrival is admitted in the same step");
    // The victim lost the least work: 0 has the shorter context.
    assert_eq!(running_ids(&st), vec![1, 9]);
    let resp = shard.step(&plan.request);
    collect(&mut out, update(&mut st, &plan, &resp).0);
    let rest = drive(&mut st, &mut shard);
    for (id, len, n) in [(0, 5, 20), (1, 9, 20), (9, 5, 6)] {
        let mut stream = out.tokens.remove(&id).unwrap_or_default();
        stream.extend(rest.tokens.get(&id).cloned().unwrap_or_default());
        assert_eq!(stream, expected(&prompt(id, len), n), "request {id}: nothing lost or repeated");
    }
    assert_no_leak(&st);
}

#[test]
fn equal_or_worse_priorities_wait_for_a_seat() {
    for p in [5, 7] {
        let (mut st, _shard, _) = seats_taken(p);
        let plan = schedule(&mut st, Instant::now());
        assert_eq!(plan.preempted, 0, "priority {p}");
        assert_eq!(running_ids(&st), vec![0, 1]);
    }
}

#[test]
fn aging_makes_a_long_running_sequence_safe_from_newcomers() {
    // Aging 1 s: the victims arrived 10 s ago, so priority 5 ranks like -5
    // and a newcomer of priority -1 (arriving now) cannot take their seats.
    let (mut st, _shard, _) = seats_taken(-1);
    st.config.priority_aging = Some(Duration::from_secs(1));
    let later = Instant::now() + Duration::from_secs(10);
    for s in st.queue.iter_mut() {
        s.queued_at = later;
    }
    let plan = schedule(&mut st, later);
    assert_eq!(plan.preempted, 0);
    assert_eq!(running_ids(&st), vec![0, 1]);
}

#[test]
fn kv_blocks_are_taken_from_the_worse_priority() {
    // 20 blocks of 4 tokens: two priority-3 requests of 24-token prompts
    // hold 14 blocks; a priority-0 arrival of 28 tokens needs 7 + watermark.
    let (mut st, mut shard) = setup(config(Some(64), None, 0), 20);
    st.enqueue(entry(0, with_priority(request(prompt(0, 24), 8), 3), None));
    st.enqueue(entry(1, with_priority(request(prompt(1, 24), 8), 3), None));
    let mut out = Outcome::default();
    steps(&mut st, &mut shard, 2, &mut out);
    assert_eq!(running_ids(&st), vec![0, 1]);
    st.enqueue(entry(9, request(prompt(9, 28), 4), None));
    let plan = schedule(&mut st, Instant::now());
    assert!(plan.preempted >= 1);
    assert!(plan.planned.iter().any(|p| p.id == 9));
    let resp = shard.step(&plan.request);
    collect(&mut out, update(&mut st, &plan, &resp).0);
    let rest = drive(&mut st, &mut shard);
    for (id, len, n) in [(0, 24, 8), (1, 24, 8), (9, 28, 4)] {
        let mut stream = out.tokens.remove(&id).unwrap_or_default();
        stream.extend(rest.tokens.get(&id).cloned().unwrap_or_default());
        assert_eq!(stream, expected(&prompt(id, len), n));
    }
    assert_no_leak(&st);
}

#[test]
fn nobody_is_preempted_when_it_would_not_make_room() {
    // The better-priority running request holds most of the pool: even
    // preempting the worse one would not fit the arrival, so it stays.
    let (mut st, mut shard) = setup(config(Some(64), None, 0), 20);
    st.enqueue(entry(0, with_priority(request(prompt(0, 44), 8), -5), None));
    st.enqueue(entry(1, with_priority(request(prompt(1, 8), 8), 3), None));
    let mut out = Outcome::default();
    steps(&mut st, &mut shard, 2, &mut out);
    assert_eq!(running_ids(&st), vec![0, 1]);
    st.enqueue(entry(9, request(prompt(9, 40), 4), None));
    let plan = schedule(&mut st, Instant::now());
    assert_eq!(plan.preempted, 0);
    assert_eq!(running_ids(&st), vec![0, 1]);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]
    /// Arrivals of random priorities into a running batch under seat and
    /// pool pressure: whatever is preempted, every request completes with
    /// exactly the model's tokens, and no block is left held.
    #[test]
    fn arrivals_preempt_only_worse_priorities_and_lose_nothing(
        reqs in prop::collection::vec((1u32..24, 1u32..16, -2i32..3, 0usize..6), 1..10),
        seats in 1u32..4,
        blocks in 16u32..48,
    ) {
        let mut cfg = config(Some(32), None, 0);
        cfg.budget.max_batch_size = seats;
        let (mut st, mut shard) = setup(cfg, blocks);
        let mut out = Outcome::default();
        let mut step = 0usize;
        let mut pending: Vec<(u64, (u32, u32, i32, usize))> = reqs.iter().copied().enumerate().map(|(i, r)| (i as u64, r)).collect();
        while !pending.is_empty() || !st.is_idle() {
            step += 1;
            prop_assert!(step < 10_000);
            let (now, later): (Vec<_>, Vec<_>) = pending.into_iter().partition(|(_, r)| r.3 <= step);
            pending = later;
            for (id, (len, n, p, _)) in now {
                st.enqueue(entry(id, with_priority(request(prompt(id, len), n), p), None));
            }
            let mut plan = schedule(&mut st, Instant::now());
            collect(&mut out, std::mem::take(&mut plan.rejected).into_iter().map(|(id, e)| (id, Err(e))).collect());
            if plan.is_empty() {
                continue;
            }
            let resp = shard.step(&plan.request);
            collect(&mut out, update(&mut st, &plan, &resp).0);
        }
        for (i, &(len, n, _, _)) in reqs.iter().enumerate() {
            prop_assert_eq!(&out.tokens[&(i as u64)], &expected(&prompt(i as u64, len), n));
        }
        assert_no_leak(&st);
        prop_assert_eq!(shard.held(), 0);
    }
}

//! Steps planned ahead of the reply in flight (ahead.rs) against the fake
//! shard, in the loop's order: plan N+1 before applying N's reply, the shard
//! running N then N+1. The tokens must equal the fake model's, as without.

use std::time::Instant;

use proptest::prelude::*;

use super::ahead::plan_ahead;
use super::fake_shard::{next_token, FakeShard, EOS};
use super::state::State;
use super::tests::{assert_no_leak, collect, config, entry, expected, prompt, request, setup, Outcome};
use super::update::update;
use super::{schedule, StepPlan};
use crate::queue::Finish;

/// What the loop would do between two steps: an abort or an arrival.
enum News {
    Abort(u64),
    Arrive(u64, Vec<u32>, u32),
}

/// As run.rs: each step's successor is planned before its reply is applied;
/// `news` happen before the step-th plan_ahead. Returns the outcome and how
/// many steps went ahead.
fn drive_ahead(st: &mut State, shard: &mut FakeShard, mut news: Vec<(usize, News)>) -> (Outcome, usize) {
    let mut out = Outcome::default();
    let mut ahead: Option<StepPlan> = None;
    let mut pipelined = 0;
    while !st.is_idle() || !st.finished.is_empty() || ahead.is_some() || !news.is_empty() {
        out.steps += 1;
        assert!(out.steps < 10_000, "the scheduler made no progress");
        for (_, n) in news.extract_if(.., |(at, _)| *at <= out.steps) {
            match n {
                News::Abort(id) => {
                    st.abort(id);
                }
                News::Arrive(id, p, n) => st.enqueue(entry(id, request(p, n), None)),
            }
        }
        let plan = match ahead.take() {
            Some(p) => p,
            None => {
                let mut plan = schedule(st, Instant::now());
                collect(&mut out, std::mem::take(&mut plan.rejected).into_iter().map(|(id, e)| (id, Err(e))).collect());
                if plan.is_empty() {
                    if plan.has_messages() {
                        shard.step(&plan.request);
                    }
                    continue;
                }
                plan
            }
        };
        ahead = plan_ahead(st, &plan);
        pipelined += ahead.is_some() as usize;
        let resp = shard.step(&plan.request);
        let (events, _) = update(st, &plan, &resp);
        collect(&mut out, events);
    }
    (out, pipelined)
}

#[test]
fn decodes_planned_ahead_give_the_models_tokens() {
    for mixed in [None, Some(24)] {
        let (mut st, mut shard) = setup(config(mixed, None, 0), 200);
        let lens = [(5u32, 30u32), (9, 1), (17, 12), (3, 40), (12, 2)];
        for (i, &(len, n)) in lens.iter().enumerate() {
            st.enqueue(entry(i as u64, request(prompt(i as u64, len), n), None));
        }
        let (out, pipelined) = drive_ahead(&mut st, &mut shard, vec![]);
        for (i, &(len, n)) in lens.iter().enumerate() {
            assert_eq!(out.tokens[&(i as u64)], expected(&prompt(i as u64, len), n), "request {i}");
            assert_eq!(out.finish[&(i as u64)], Some(Finish::Length));
        }
        // 40 tokens for the longest: most of its steps went ahead.
        assert!(pipelined >= 30, "only {pipelined} steps planned ahead");
        assert!(out.errors.is_empty(), "{:?}", out.errors);
        assert_no_leak(&st);
        assert_eq!(shard.held(), 0);
    }
}

#[test]
fn steps_go_ahead_only_from_the_configured_batch() {
    // Three sequences of 3, 8 and 20 tokens: the decode steps have 3, then 2, then 1 of them.
    let lens = [(4u32, 3u32), (6, 8), (5, 20)];
    let mut pipelined_from = Vec::new();
    for from in [0u32, 1, 2, 3, 4] {
        let mut cfg = config(None, None, 0);
        cfg.schedule_ahead_from = from;
        let (mut st, mut shard) = setup(cfg, 100);
        for (i, &(len, n)) in lens.iter().enumerate() {
            st.enqueue(entry(i as u64, request(prompt(i as u64, len), n), None));
        }
        let (out, pipelined) = drive_ahead(&mut st, &mut shard, vec![]);
        for (i, &(len, n)) in lens.iter().enumerate() {
            assert_eq!(out.tokens[&(i as u64)], expected(&prompt(i as u64, len), n), "request {i}, from {from}");
        }
        // Every step sent ahead followed a step of at least `from` sequences.
        let mut sizes = shard.steps.iter().map(|s| s.requests.len());
        let mut prev = sizes.next().unwrap_or(0);
        let eligible = sizes
            .filter(|&n| {
                let ok = prev >= from.max(1) as usize && n > 0;
                prev = n;
                ok
            })
            .count();
        assert!(pipelined <= eligible, "from {from}: {pipelined} ahead, {eligible} steps after a big enough one");
        pipelined_from.push(pipelined);
        assert_no_leak(&st);
    }
    assert_eq!(pipelined_from[0], 0, "0 means never");
    assert_eq!(pipelined_from[4], 0, "no step ever had 4 sequences");
    assert!(
        pipelined_from[1] > pipelined_from[2] && pipelined_from[2] > pipelined_from[3] && pipelined_from[3] > 0,
        "{pipelined_from:?}"
    );
}

#[test]
fn a_sequence_the_step_in_flight_ends_by_eos_is_dropped_quietly() {
    // A prompt whose third generated token is EOS, next to a long one.
    let p = (0..5000u32)
        .map(|x| vec![5, x, 7])
        .find(|p| {
            let e = expected(p, 3);
            e[2] == EOS && !e[..2].contains(&EOS)
        })
        .expect("some prompt samples EOS third");
    let (mut st, mut shard) = setup(config(Some(32), None, 0), 100);
    let mut r = request(p.clone(), 10);
    r.ignore_eos = false;
    st.enqueue(entry(0, r, None));
    st.enqueue(entry(1, request(prompt(1, 6), 12), None));
    let (out, pipelined) = drive_ahead(&mut st, &mut shard, vec![]);
    assert_eq!(out.tokens[&0], expected(&p, 3));
    assert_eq!(out.finish[&0], Some(Finish::EosToken));
    assert_eq!(out.tokens[&1], expected(&prompt(1, 6), 12));
    assert!(out.errors.is_empty(), "the stale entry's error reached a stream: {:?}", out.errors);
    // The step after EOS was planned before the EOS was seen: it named request 0.
    let after_eos = shard.steps.iter().filter(|s| s.requests.iter().any(|r| r.id == 0)).count();
    assert_eq!(after_eos, 4, "prompt step, two decodes, one stale decode");
    assert!(pipelined > 0);
    assert_no_leak(&st);
    assert_eq!(shard.held(), 0);
}

#[test]
fn an_abort_while_a_step_is_ahead_frees_everything_and_tells_the_shard() {
    let (mut st, mut shard) = setup(config(Some(32), None, 0), 100);
    st.enqueue(entry(0, request(prompt(0, 7), 30), None));
    st.enqueue(entry(1, request(prompt(1, 5), 30), None));
    let (out, _) = drive_ahead(&mut st, &mut shard, vec![(6, News::Abort(0))]);
    assert!(out.tokens[&0].len() < 30);
    assert_eq!(out.tokens[&0], expected(&prompt(0, 7), out.tokens[&0].len() as u32));
    assert_eq!(out.tokens[&1], expected(&prompt(1, 5), 30));
    assert!(shard.steps.iter().any(|s| s.finished_ids.contains(&0)));
    assert_no_leak(&st);
    assert_eq!(shard.held(), 0);
}

#[test]
fn an_arrival_waits_at_most_one_step_and_is_then_admitted() {
    let (mut st, mut shard) = setup(config(Some(32), None, 0), 100);
    st.enqueue(entry(0, request(prompt(0, 7), 30), None));
    let late = prompt(9, 6);
    let (out, _) = drive_ahead(&mut st, &mut shard, vec![(8, News::Arrive(9, late.clone(), 5))]);
    assert_eq!(out.tokens[&9], expected(&late, 5));
    assert_eq!(out.tokens[&0], expected(&prompt(0, 7), 30));
    // The first step naming it (its prompt) is at most one step after the arrival.
    let first = shard.steps.iter().position(|s| s.requests.iter().any(|r| r.id == 9)).expect("admitted");
    let arrived_at = 8 - 1; // steps before the 8th loop turn
    assert!(first <= arrived_at + 1, "admitted at step {first}, arrived before step {arrived_at}");
    assert_no_leak(&st);
}

#[test]
fn nothing_goes_ahead_when_the_pool_needs_a_preemption() {
    // 3 sequences growing in 12 blocks of 4: the pool runs out and the
    // scheduler must preempt, which only a plan after the reply does.
    let (mut st, mut shard) = setup(config(Some(64), None, 0), 12);
    for i in 0..3 {
        st.enqueue(entry(i, request(prompt(i, 6), 10), None));
    }
    let (out, _) = drive_ahead(&mut st, &mut shard, vec![]);
    for i in 0..3 {
        assert_eq!(out.tokens[&i], expected(&prompt(i, 6), 10));
    }
    assert!(out.errors.is_empty(), "{:?}", out.errors);
    assert_no_leak(&st);
}

#[test]
fn speculation_and_prompt_steps_never_go_ahead() {
    let (mut st, mut shard) = setup(config(Some(32), None, 2), 100);
    shard.accept = 1;
    st.enqueue(entry(0, request(prompt(0, 7), 20), None));
    let (out, pipelined) = drive_ahead(&mut st, &mut shard, vec![]);
    assert_eq!(out.tokens[&0], expected(&prompt(0, 7), 20));
    assert_eq!(pipelined, 0);
    let (mut st, _) = setup(config(Some(32), None, 0), 100);
    st.enqueue(entry(0, request(prompt(0, 7), 20), None));
    let plan = schedule(&mut st, Instant::now());
    assert!(plan.planned[0].prompt);
    assert!(plan_ahead(&mut st, &plan).is_none(), "a prompt step's successor waits for its first token");
}

#[test]
fn the_fake_model_has_an_eos_somewhere() {
    // Guards the EOS test above against a fake model that never samples EOS.
    assert!((0..5000u32).any(|x| next_token(&[5, x, 7]) == EOS));
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]
    /// Any mix of prompts, budgets, pool sizes and EOS, with aborts and
    /// arrivals along the way: the tokens are the model's and every block
    /// comes back, with steps planned ahead wherever they could be.
    #[test]
    fn random_workloads_planned_ahead_complete_exactly(
        reqs in prop::collection::vec((1u32..40, 1u32..24, any::<bool>()), 1..10),
        budget in prop::option::of(8u32..48),
        blocks in 24u32..80,
        abort in prop::option::of((1usize..30, 0u64..10)),
        arrive in prop::option::of((1usize..30, 1u32..20, 1u32..10)),
    ) {
        let (mut st, mut shard) = setup(config(budget, None, 0), blocks);
        for (i, &(len, n, eos)) in reqs.iter().enumerate() {
            let mut r = request(prompt(i as u64, len), n);
            r.ignore_eos = !eos;
            st.enqueue(entry(i as u64, r, None));
        }
        let mut news = Vec::new();
        if let Some((at, id)) = abort {
            news.push((at, News::Abort(id)));
        }
        if let Some((at, len, n)) = arrive {
            news.push((at, News::Arrive(99, prompt(99, len), n)));
        }
        let (out, _) = drive_ahead(&mut st, &mut shard, news);
        for (i, &(len, n, eos)) in reqs.iter().enumerate() {
            let id = i as u64;
            let want = expected(&prompt(id, len), n);
            let got = &out.tokens.get(&id).cloned().unwrap_or_default();
            let aborted = matches!(abort, Some((_, a)) if a == id);
            if aborted {
                prop_assert_eq!(&got[..], &want[..got.len()]);
            } else if eos && want.contains(&EOS) {
                let cut = want.iter().position(|&t| t == EOS).unwrap() + 1;
                prop_assert_eq!(&got[..], &want[..cut]);
            } else {
                prop_assert_eq!(got, &want);
            }
        }
        if let Some((_, len, n)) = arrive {
            prop_assert_eq!(&out.tokens[&99], &expected(&prompt(99, len), n));
        }
        prop_assert!(out.errors.is_empty(), "{:?}", out.errors);
        assert_no_leak(&st);
        prop_assert_eq!(shard.held(), 0);
    }
}

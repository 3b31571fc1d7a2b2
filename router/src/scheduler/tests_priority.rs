//! Priority, preemption victims and the per-tenant cap, against the fake
//! shard (helpers in tests.rs).

use std::time::Instant;

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

/// Ids in the order the shard first saw them (NewRequest), repeats included.
fn admissions(shard: &FakeShard) -> Vec<u64> {
    shard.steps.iter().flat_map(|s| s.requests.iter()).filter(|r| r.new_request.is_some()).map(|r| r.id).collect()
}

#[test]
fn a_better_priority_is_admitted_before_queued_worse_ones() {
    let mut cfg = config(Some(64), None, 0);
    cfg.budget.max_batch_size = 1;
    let (mut st, mut shard) = setup(cfg, 100);
    for id in 0..3 {
        st.enqueue(entry(id, with_priority(request(prompt(id, 5), 3), 5), None));
    }
    st.enqueue(entry(9, with_priority(request(prompt(9, 5), 3), -1), None));
    let out = drive(&mut st, &mut shard);
    assert_eq!(admissions(&shard), vec![9, 0, 1, 2]);
    for id in [0, 1, 2, 9] {
        assert_eq!(out.tokens[&id], expected(&prompt(id, 5), 3));
    }
}

#[test]
fn aging_bounds_how_long_newcomers_of_a_better_priority_overtake() {
    // Aging 1 s: priority 3 waiting 3.5 s ranks like priority 0 and keeps
    // its (earlier) place; waiting 2.5 s it still ranks like 1 and yields.
    for (waited_ms, first) in [(3500, 1), (2500, 2)] {
        let mut cfg = config(Some(64), None, 0);
        cfg.budget.max_batch_size = 1;
        cfg.priority_aging = Some(std::time::Duration::from_secs(1));
        let (mut st, mut shard) = setup(cfg, 100);
        let now = Instant::now() + std::time::Duration::from_secs(10);
        let mut old = entry(1, with_priority(request(prompt(1, 5), 2), 3), None);
        old.queued_at = now - std::time::Duration::from_millis(waited_ms);
        st.enqueue(old);
        let mut fresh = entry(2, request(prompt(2, 5), 2), None);
        fresh.queued_at = now;
        st.enqueue(fresh);
        let plan = schedule(&mut st, now);
        assert_eq!(plan.planned[0].id, first, "waited {waited_ms} ms");
        let resp = shard.step(&plan.request);
        update(&mut st, &plan, &resp);
        drive(&mut st, &mut shard);
    }
}

/// Runs until the first preemption; returns the ids preempted by it, and
/// the tokens streamed so far.
fn run_until_preemption(st: &mut State, shard: &mut FakeShard) -> (Vec<u64>, Outcome) {
    let mut out = Outcome::default();
    for _ in 0..200 {
        let running: Vec<u64> = st.running.iter().map(|s| s.id).collect();
        let plan = schedule(st, Instant::now());
        let after: Vec<u64> = st.running.iter().map(|s| s.id).collect();
        let resp = shard.step(&plan.request);
        let (events, _) = update(st, &plan, &resp);
        collect(&mut out, events);
        if plan.preempted > 0 {
            return (running.into_iter().filter(|id| !after.contains(id)).collect(), out);
        }
    }
    panic!("no preemption");
}

#[test]
fn the_victim_is_the_worst_priority_even_when_it_is_the_oldest() {
    let (mut st, mut shard) = setup(config(Some(64), None, 0), 13);
    st.enqueue(entry(0, with_priority(request(prompt(0, 6), 30), 1), None));
    st.enqueue(entry(1, request(prompt(1, 6), 30), None));
    assert_eq!(run_until_preemption(&mut st, &mut shard).0, vec![0]);
    let out = drive(&mut st, &mut shard);
    assert!(out.errors.is_empty());
    assert_no_leak(&st);
}

#[test]
fn among_equal_priorities_the_victim_loses_the_least_work() {
    // 0 is older but has computed less than 1: 0 goes, whereas "newest
    // first" would have thrown away 1's longer context.
    let (mut st, mut shard) = setup(config(Some(64), None, 0), 13);
    st.enqueue(entry(0, request(prompt(0, 2), 30), None));
    st.enqueue(entry(1, request(prompt(1, 16), 24), None));
    assert_eq!(run_until_preemption(&mut st, &mut shard).0, vec![0]);
}

#[test]
fn a_preempted_request_resumes_before_later_arrivals_and_loses_nothing() {
    let (mut st, mut shard) = setup(config(Some(64), None, 0), 13);
    st.enqueue(entry(0, request(prompt(0, 6), 24), None));
    st.enqueue(entry(1, request(prompt(1, 6), 24), None));
    let (gone, mut before) = run_until_preemption(&mut st, &mut shard);
    assert_eq!(gone.len(), 1);
    // A newcomer, small enough to fit beside the survivor, waits its turn.
    st.enqueue(entry(5, request(prompt(5, 2), 4), None));
    let after = drive(&mut st, &mut shard);
    let order: Vec<u64> = admissions(&shard).into_iter().filter(|id| *id == gone[0] || *id == 5).collect();
    assert_eq!(order, vec![gone[0], gone[0], 5], "the resumed request was overtaken");
    // The same requests with a pool that never preempts.
    let (mut calm_st, mut calm_shard) = setup(config(Some(64), None, 0), 200);
    for id in [0, 1] {
        calm_st.enqueue(entry(id, request(prompt(id, 6), 24), None));
    }
    let calm = drive(&mut calm_st, &mut calm_shard);
    for id in [0, 1] {
        let mut stream = before.tokens.remove(&id).unwrap_or_default();
        stream.extend(after.tokens.get(&id).cloned().unwrap_or_default());
        assert_eq!(stream, calm.tokens[&id], "request {id}: the stream under pressure differs");
        assert_eq!(stream, expected(&prompt(id, 6), 24));
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]
    /// Random priorities under pool pressure: every request completes with
    /// the model's tokens (no token lost or repeated across preemptions),
    /// and no running sequence was ever preempted while a sequence of a
    /// worse priority that was not yet scheduled in that step kept running.
    #[test]
    fn priorities_under_pressure_lose_nothing(
        reqs in prop::collection::vec((1u32..24, 1u32..24, -2i32..3), 1..10),
        budget in prop::option::of(8u32..48),
        blocks in 14u32..40,
    ) {
        let (mut st, mut shard) = setup(config(budget, None, 0), blocks);
        for (i, &(len, n, p)) in reqs.iter().enumerate() {
            st.enqueue(entry(i as u64, with_priority(request(prompt(i as u64, len), n), p), None));
        }
        let mut out = Outcome::default();
        while !st.is_idle() {
            out.steps += 1;
            prop_assert!(out.steps < 10_000);
            let before: Vec<(u64, i32)> = st.running.iter().map(|s| (s.id, s.priority())).collect();
            let mut plan = schedule(&mut st, Instant::now());
            collect(&mut out, std::mem::take(&mut plan.rejected).into_iter().map(|(id, e)| (id, Err(e))).collect());
            if plan.preempted > 0 {
                let kept: Vec<u64> = st.running.iter().map(|s| s.id).collect();
                let worst_gone = before.iter().filter(|(id, _)| !kept.contains(id)).map(|(_, p)| *p).min().unwrap();
                // Survivors not in this step's decode plan before the victim
                // would be planned: every survivor of a worse priority was already planned.
                for (id, p) in &before {
                    if kept.contains(id) && *p > worst_gone {
                        prop_assert!(plan.planned.iter().any(|x| x.id == *id && !x.prompt),
                            "request {} (priority {}) kept running while priority {} was preempted", id, p, worst_gone);
                    }
                }
            }
            if plan.is_empty() {
                continue;
            }
            let resp = shard.step(&plan.request);
            let (events, _) = update(&mut st, &plan, &resp);
            collect(&mut out, events);
        }
        for (i, &(len, n, _)) in reqs.iter().enumerate() {
            prop_assert_eq!(&out.tokens[&(i as u64)], &expected(&prompt(i as u64, len), n));
        }
        assert_no_leak(&st);
        prop_assert_eq!(shard.held(), 0);
    }
}

fn for_tenant(mut r: ValidRequest, tenant: &str) -> ValidRequest {
    r.tenant = Some(tenant.to_string());
    r
}

fn running_of(st: &State, tenant: &str) -> usize {
    st.running.iter().filter(|s| s.request.tenant.as_deref() == Some(tenant)).count()
}

#[test]
fn a_tenant_flooding_the_queue_cannot_take_every_seat() {
    let mut cfg = config(Some(64), None, 0);
    cfg.budget.max_batch_size = 4;
    cfg.max_running_per_tenant = Some(2);
    let (mut st, mut shard) = setup(cfg, 200);
    for id in 0..6 {
        st.enqueue(entry(id, for_tenant(request(prompt(id, 5), 6), "flood"), None));
    }
    st.enqueue(entry(10, for_tenant(request(prompt(10, 5), 6), "quiet"), None));
    st.enqueue(entry(11, request(prompt(11, 5), 6), None));
    let first = schedule(&mut st, Instant::now());
    let ids: Vec<u64> = first.planned.iter().map(|p| p.id).collect();
    assert_eq!(ids, vec![0, 1, 10, 11], "the other tenant and the untagged request get seats at once");
    let resp = shard.step(&first.request);
    update(&mut st, &first, &resp);
    let mut out = Outcome::default();
    while !st.is_idle() {
        assert!(running_of(&st, "flood") <= 2);
        let plan = schedule(&mut st, Instant::now());
        assert!(running_of(&st, "flood") <= 2);
        let resp = shard.step(&plan.request);
        let (events, _) = update(&mut st, &plan, &resp);
        collect(&mut out, events);
    }
    for id in 2..6 {
        assert_eq!(out.tokens[&id], expected(&prompt(id, 5), 6));
    }
    // Without the cap the flood takes all four seats first.
    let mut cfg = config(Some(64), None, 0);
    cfg.budget.max_batch_size = 4;
    let (mut st, _) = setup(cfg, 200);
    for id in 0..6 {
        st.enqueue(entry(id, for_tenant(request(prompt(id, 5), 6), "flood"), None));
    }
    st.enqueue(entry(10, for_tenant(request(prompt(10, 5), 6), "quiet"), None));
    let plan = schedule(&mut st, Instant::now());
    assert_eq!(plan.planned.iter().map(|p| p.id).collect::<Vec<_>>(), vec![0, 1, 2, 3]);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]
    /// Any mix of tenants, priorities and pool pressure: no tenant ever has
    /// more than the cap running, and everything completes exactly.
    #[test]
    fn the_tenant_cap_holds_at_every_step(
        reqs in prop::collection::vec((1u32..24, 1u32..16, prop::option::of(0u8..3), -1i32..2), 1..12),
        cap in 1u32..3,
        blocks in 14u32..60,
        budget in prop::option::of(8u32..48),
    ) {
        let mut cfg = config(budget, None, 0);
        cfg.max_running_per_tenant = Some(cap);
        let (mut st, mut shard) = setup(cfg, blocks);
        for (i, &(len, n, t, p)) in reqs.iter().enumerate() {
            let mut r = with_priority(request(prompt(i as u64, len), n), p);
            r.tenant = t.map(|t| format!("t{t}"));
            st.enqueue(entry(i as u64, r, None));
        }
        let mut out = Outcome::default();
        while !st.is_idle() {
            out.steps += 1;
            prop_assert!(out.steps < 10_000);
            let plan = schedule(&mut st, Instant::now());
            for t in ["t0", "t1", "t2"] {
                prop_assert!(running_of(&st, t) <= cap as usize, "{} runs {}", t, running_of(&st, t));
            }
            let resp = shard.step(&plan.request);
            let (events, _) = update(&mut st, &plan, &resp);
            collect(&mut out, events);
        }
        for (i, &(len, n, _, _)) in reqs.iter().enumerate() {
            prop_assert_eq!(&out.tokens[&(i as u64)], &expected(&prompt(i as u64, len), n));
        }
        assert_no_leak(&st);
    }
}

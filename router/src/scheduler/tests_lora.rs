//! LoRA adapters through the scheduler, against the fake shard: never more
//! than `max_loras` distinct adapters in a step, a request whose adapter
//! must wait does not block those behind it, a resumed sequence carries its
//! adapter again, and no cached prefix crosses from one adapter to another.

use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;
use std::time::Instant;

use super::schedule;
use super::tests::{assert_no_leak, collect, config, drive, entry, expected, prompt, request, setup, Outcome};
use super::update::update;
use crate::adapter::{Adapter, AdapterRef};
use crate::request::ValidRequest;

fn adapter(id: u32) -> AdapterRef {
    Arc::new(Adapter { id, name: format!("a{id}"), path: format!("/adapters/{id}"), fingerprint: format!("f{id}") })
}

fn with_adapter(mut r: ValidRequest, id: u32) -> ValidRequest {
    r.adapter = (id > 0).then(|| adapter(id));
    r
}

#[test]
fn a_step_runs_at_most_max_loras_adapters_and_the_rest_wait_their_turn() {
    // max_loras 2; requests for adapters 1, 2, 3 and the base, queued in that order, twice.
    let (mut st, mut shard) = setup(config(Some(64), None, 0), 200);
    let ids = [1u32, 2, 3, 0, 3, 1, 0, 2];
    let mut adapter_of = HashMap::new();
    for (id, &a) in ids.iter().enumerate() {
        st.enqueue(entry(id as u64, with_adapter(request(prompt(id as u64, 5), 6), a), None));
        adapter_of.insert(id as u64, a);
    }
    let mut out = Outcome::default();
    let mut first_step = None;
    while !st.is_idle() {
        let plan = schedule(&mut st, Instant::now());
        let running: BTreeSet<u32> = st.running.iter().map(|s| s.adapter_id()).filter(|&a| a != 0).collect();
        let scheduled: BTreeSet<u32> =
            plan.request.requests.iter().map(|r| adapter_of[&r.id]).filter(|&a| a != 0).collect();
        assert!(scheduled.len() <= 2 && running.len() <= 2, "step {}: adapters {scheduled:?}", out.steps);
        first_step.get_or_insert_with(|| plan.request.requests.iter().map(|r| r.id).collect::<BTreeSet<u64>>());
        let resp = shard.step(&plan.request);
        let (events, _) = update(&mut st, &plan, &resp);
        collect(&mut out, events);
        out.steps += 1;
        assert!(out.steps < 1000);
    }
    // The first step: adapters 1 and 2, and the base requests behind adapter 3's.
    assert_eq!(first_step.unwrap(), BTreeSet::from([0, 1, 3, 5, 6, 7]));
    for id in 0..ids.len() as u64 {
        assert_eq!(out.tokens[&id], expected(&prompt(id, 5), 6), "request {id} waited and finished");
    }
    assert_no_leak(&st);
}

#[test]
fn the_first_step_of_a_request_names_its_adapter_again_after_preemption() {
    // 14 usable blocks of 4 tokens: four sequences growing to 30 tokens cannot all fit.
    let (mut st, mut shard) = setup(config(Some(64), None, 0), 15);
    for id in 0..4 {
        st.enqueue(entry(id, with_adapter(request(prompt(id, 6), 24), 1 + id as u32 % 2), None));
    }
    let mut out = Outcome::default();
    let (mut preempted, mut firsts) = (0, HashMap::<u64, u32>::new());
    while !st.is_idle() {
        let plan = schedule(&mut st, Instant::now());
        preempted += plan.preempted;
        for r in &plan.request.requests {
            if let Some(n) = &r.new_request {
                let a = n.adapter.as_ref().expect("every request here runs with an adapter");
                assert_eq!((a.id, a.name.as_str()), (1 + r.id as u32 % 2, format!("a{}", 1 + r.id % 2).as_str()));
                *firsts.entry(r.id).or_default() += 1;
            }
        }
        let resp = shard.step(&plan.request);
        let (events, _) = update(&mut st, &plan, &resp);
        collect(&mut out, events);
        out.steps += 1;
        assert!(out.steps < 2000);
    }
    assert!(preempted > 0, "the pool was large enough: the test does not preempt");
    assert!(firsts.values().any(|&n| n > 1), "a resumed request is sent anew, with its adapter");
    for id in 0..4 {
        assert_eq!(out.tokens[&id], expected(&prompt(id, 6), 24), "request {id}");
    }
    assert_no_leak(&st);
}

#[test]
fn the_same_prompt_under_another_adapter_is_computed_again() {
    let (mut st, mut shard) = setup(config(Some(64), None, 0), 100);
    let p = prompt(7, 17);
    let mut hits = Vec::new();
    // Base, adapter 1, adapter 1 again, adapter 2, base again: one after another.
    for (id, a) in [0u32, 1, 1, 2, 0].into_iter().enumerate() {
        st.enqueue(entry(id as u64, with_adapter(request(p.clone(), 2), a), None));
        let mut hit = 0;
        while !st.is_idle() {
            let plan = schedule(&mut st, Instant::now());
            hit += plan.prefix_hit_tokens;
            let resp = shard.step(&plan.request);
            update(&mut st, &plan, &resp);
        }
        hits.push(hit);
    }
    // 17 tokens: 4 full blocks, of which a repeat may take all 4 (16 tokens, one left to compute).
    assert_eq!(hits, [0, 0, 16, 0, 16], "only the same adapter's blocks are reused");
    assert_no_leak(&st);
}

#[test]
fn requests_with_the_same_prompt_in_flight_share_only_within_an_adapter() {
    // Arriving together, same long prompt: one computes the prefix per adapter, never across.
    let (mut st, mut shard) = setup(config(Some(64), Some(8), 0), 200);
    let p = prompt(3, 33);
    for (id, a) in [1u32, 2, 1, 2].into_iter().enumerate() {
        st.enqueue(entry(id as u64, with_adapter(request(p.clone(), 3), a), None));
    }
    let out = drive(&mut st, &mut shard);
    for id in 0..4 {
        assert_eq!(out.tokens[&id], expected(&p, 3));
    }
    // Each adapter's second request reuses its first's prefix: the blocks it shares carry one adapter.
    let st_kv = st.kv.stats();
    assert!(st_kv.cached >= 16, "both adapters' prefixes are cached apart: {st_kv:?}");
    assert_no_leak(&st);
}

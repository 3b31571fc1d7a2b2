//! Prompt logprobs through the scheduler, against the fake shard: every
//! position of every prompt reaches the stream, whether the prompt went in
//! chunks, shared blocks with forks or found its prefix in the KV cache.

use std::time::Instant;

use super::fake_shard::prompt_logprob;
use super::schedule;
use super::tests::{assert_no_leak, collect, config, drive, entry, expected, prompt, request, setup, Outcome, BS};
use super::update::update;
use crate::request::ValidRequest;

fn with_logprobs(prompt: Vec<u32>, max_new: u32, top_n: u32) -> ValidRequest {
    ValidRequest { decoder_input_details: true, prompt_top_n: top_n, ..request(prompt, max_new) }
}

/// The stream of `id` got every position's logprob (none for the first) and `top_n` alternatives.
fn assert_complete(out: &Outcome, id: u64, prompt: &[u32], top_n: u32) {
    let (lps, top) = out.prefill.get(&id).unwrap_or_else(|| panic!("request {id}: no prompt logprobs"));
    assert_eq!(lps.len(), prompt.len());
    assert!(lps[0].is_nan());
    for p in 1..prompt.len() {
        let (want, _, alternatives) = prompt_logprob(&prompt[..p], prompt[p], top_n);
        assert_eq!(lps[p], want, "request {id}, position {p}");
        if top_n > 0 {
            assert_eq!(top[p], alternatives, "request {id}, position {p}");
        }
    }
}

/// Runs everything queued; also returns where `id`'s first scheduled range started.
fn run_watching(st: &mut super::State, shard: &mut super::fake_shard::FakeShard, id: u64) -> (u32, Outcome) {
    let mut out = Outcome::default();
    let mut start = None;
    while !st.is_idle() {
        let plan = schedule(st, Instant::now());
        start = start.or(plan.planned.iter().find(|p| p.id == id).map(|p| p.num_computed));
        let resp = shard.step(&plan.request);
        let (events, _) = update(st, &plan, &resp);
        collect(&mut out, events);
    }
    (start.expect("scheduled"), out)
}

#[test]
fn prompts_in_chunks_report_every_position() {
    for cfg in [config(None, Some(5), 0), config(Some(7), None, 0), config(None, None, 0)] {
        let (mut st, mut shard) = setup(cfg, 200);
        let (a, b) = (prompt(1, 23), prompt(2, 9));
        st.enqueue(entry(1, with_logprobs(a.clone(), 4, 2), None));
        st.enqueue(entry(2, with_logprobs(b.clone(), 4, 0), None));
        let out = drive(&mut st, &mut shard);
        assert!(out.errors.is_empty(), "{:?}", out.errors);
        assert_complete(&out, 1, &a, 2);
        assert_complete(&out, 2, &b, 0);
        assert_eq!(out.tokens[&1], expected(&a, 4));
        assert_no_leak(&st);
    }
}

#[test]
fn a_cached_prefix_is_served_from_the_logprobs_stored_beside_it() {
    let (mut st, mut shard) = setup(config(None, None, 0), 200);
    let a = prompt(1, 20);
    st.enqueue(entry(1, with_logprobs(a.clone(), 3, 1), None));
    assert_complete(&drive(&mut st, &mut shard), 1, &a, 1);
    assert_eq!(st.logprob_cache.len(), 5, "A's five full prompt blocks");
    // B shares A's first four blocks. Their KV is cached and their logprobs
    // stored, but the logprob of B's first token after them needs the logits
    // of the last cached position: B recomputes that one block.
    let mut b = a[..16].to_vec();
    b.extend([90, 91, 92, 93, 94]);
    st.enqueue(entry(2, with_logprobs(b.clone(), 3, 1), None));
    let (start, out) = run_watching(&mut st, &mut shard, 2);
    assert_eq!(start, 3 * BS);
    assert_complete(&out, 2, &b, 1);
    assert!(out.errors.is_empty());
    // A again: its fifth block's logprobs give the first uncached token's, so
    // the whole cacheable prefix is taken.
    st.enqueue(entry(3, with_logprobs(a.clone(), 3, 1), None));
    let (start, out) = run_watching(&mut st, &mut shard, 3);
    assert_eq!(start, 4 * BS);
    assert_complete(&out, 3, &a, 1);
    assert_no_leak(&st);
}

#[test]
fn a_prefix_cached_without_its_logprobs_is_recomputed() {
    let (mut st, mut shard) = setup(config(None, None, 0), 200);
    let a = prompt(1, 20);
    st.enqueue(entry(1, request(a.clone(), 3), None));
    drive(&mut st, &mut shard);
    assert_eq!(st.kv.peek_prefix(None, &a), 4, "A's blocks are cached");
    st.enqueue(entry(2, with_logprobs(a.clone(), 3, 0), None));
    let (start, out) = run_watching(&mut st, &mut shard, 2);
    assert_eq!(start, 0);
    assert_complete(&out, 2, &a, 0);
    // Stored with no alternatives: a request that asks for two computes its prompt.
    st.enqueue(entry(3, with_logprobs(a.clone(), 3, 2), None));
    let (start, out) = run_watching(&mut st, &mut shard, 3);
    assert_eq!(start, 0);
    assert_complete(&out, 3, &a, 2);
    // Without prompt logprobs the cache serves the whole prefix as before.
    st.enqueue(entry(4, request(a.clone(), 3), None));
    assert_eq!(run_watching(&mut st, &mut shard, 4).0, 4 * BS);
    assert_no_leak(&st);
}

#[test]
fn forks_each_compute_the_positions_they_report() {
    let (mut st, mut shard) = setup(config(None, None, 0), 200);
    let a = prompt(3, 14);
    for id in 0..3 {
        st.enqueue(entry(id, with_logprobs(a.clone(), 2, 1), Some(7)));
    }
    let out = drive(&mut st, &mut shard);
    for id in 0..3 {
        assert_complete(&out, id, &a, 1);
    }
    assert_no_leak(&st);
}

#[test]
fn a_shard_that_leaves_a_position_out_fails_the_request_instead_of_a_gap() {
    let (mut st, mut shard) = setup(config(None, Some(4), 0), 200);
    shard.omit_prompt_position = Some(6);
    let a = prompt(1, 11);
    st.enqueue(entry(1, with_logprobs(a.clone(), 3, 0), None));
    st.enqueue(entry(2, request(prompt(2, 5), 3), None));
    let out = drive(&mut st, &mut shard);
    let e = out.errors.get(&1).expect("request 1 fails");
    assert_eq!(e.error_type(), "generation");
    assert!(e.to_string().contains("position 6"), "{e}");
    assert!(!out.prefill.contains_key(&1));
    assert_eq!(out.tokens[&2], expected(&prompt(2, 5), 3));
    assert_no_leak(&st);
}

/// `b` enqueued once `a` has run its first prompt chunk; returns where `b`'s
/// first scheduled range started and what both streams got.
fn second_arrives_mid_prefill(a: ValidRequest, b: ValidRequest) -> (u32, Outcome) {
    let (mut st, mut shard) = setup(config(None, Some(8), 0), 200);
    st.enqueue(entry(1, a, None));
    let plan = schedule(&mut st, Instant::now());
    let mut out = Outcome::default();
    collect(&mut out, update(&mut st, &plan, &shard.step(&plan.request)).0);
    st.enqueue(entry(2, b, None));
    let (start, rest) = run_watching(&mut st, &mut shard, 2);
    out.prefill.extend(rest.prefill);
    out.errors.extend(rest.errors);
    out.tokens.extend(rest.tokens);
    assert_no_leak(&st);
    (start, out)
}

#[test]
fn a_prompt_in_flight_is_shared_only_as_far_as_its_logprobs_are_known() {
    let a = prompt(4, 40);
    let mut b = a[..36].to_vec();
    b.extend([70, 71, 72]);
    // The prompt computing ahead gathers no logprobs: its blocks would give
    // the second prompt KV without logprobs, so that one computes its own.
    let (start, out) = second_arrives_mid_prefill(request(a.clone(), 2), with_logprobs(b.clone(), 2, 1));
    assert!(out.errors.is_empty(), "{:?}", out.errors);
    assert_eq!(start, 0);
    assert_complete(&out, 2, &b, 1);
    assert_eq!(out.tokens[&2], expected(&b, 2));
    // It gathers them too: once stored beside its blocks they serve the
    // shared prefix, all but the block whose logits give the next position.
    let (start, out) = second_arrives_mid_prefill(with_logprobs(a.clone(), 2, 1), with_logprobs(b.clone(), 2, 1));
    assert!(out.errors.is_empty(), "{:?}", out.errors);
    assert_eq!(start, 8 * BS);
    assert_complete(&out, 1, &a, 1);
    assert_complete(&out, 2, &b, 1);
    // Without prompt logprobs the second shares what the first computes.
    let (start, out) = second_arrives_mid_prefill(request(a.clone(), 2), request(b.clone(), 2));
    assert!(start >= 8 * BS, "started at {start}");
    assert_eq!(out.tokens[&2], expected(&b, 2));
}

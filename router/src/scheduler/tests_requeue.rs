//! A group that fails mid-generation: its sequences move to another group's
//! state and finish there with exactly the tokens an undisturbed run gives,
//! none lost and none repeated (the stream sees each token once).

use std::sync::{Arc, Mutex};
use std::time::Instant;

use tokio::sync::mpsc;

use super::schedule;
use super::tests::{assert_no_leak, collect, config, drive, entry, expected, prompt, request, setup, Outcome};
use super::update::update;
use crate::kv::KvManager;
use crate::routing::{Arrival, GroupHandle, Placer, Routing};
use crate::shared_state::RouterState;

#[test]
fn sequences_of_a_failed_group_finish_on_another_exactly() {
    for cfg in [config(None, None, 0), config(Some(16), Some(5), 0)] {
        let (mut a, mut shard_a) = setup(cfg, 200);
        let (mut b, mut shard_b) = setup(cfg, 200);
        for id in 0..5 {
            a.enqueue(entry(id, request(prompt(id, 5 + id as u32 * 4), 12), None));
        }
        // Some steps on group A: prompts computed, some tokens streamed.
        let mut out = Outcome::default();
        for _ in 0..4 {
            let plan = schedule(&mut a, Instant::now());
            let resp = shard_a.step(&plan.request);
            let (events, _) = update(&mut a, &plan, &resp);
            collect(&mut out, events);
        }
        let streamed: usize = out.tokens.values().map(Vec::len).sum();
        assert!(streamed > 0, "nothing was generated before the failure: the test tests nothing");
        // Group A's shard dies: every sequence moves to B.
        let moved = a.evacuate();
        assert_eq!(moved.len(), 5);
        assert!(a.is_idle() && a.finished.is_empty());
        assert_no_leak(&a);
        for s in moved {
            assert!(s.blocks.is_none() && s.num_computed == 0 && !s.on_shard);
            b.resume(s);
        }
        let rest = drive(&mut b, &mut shard_b);
        for id in 0..5 {
            let mut all = out.tokens.remove(&id).unwrap_or_default();
            all.extend(&rest.tokens[&id]);
            assert_eq!(all, expected(&prompt(id, 5 + id as u32 * 4), 12), "request {id}");
        }
        assert!(rest.errors.is_empty());
        assert_no_leak(&b);
    }
}

fn group(kv_blocks: u32) -> (GroupHandle, mpsc::UnboundedReceiver<Arrival>) {
    let (tx, rx) = mpsc::unbounded_channel();
    let stats = Arc::new(crate::shared_state::GroupStats::default());
    stats.serving.store(true, std::sync::atomic::Ordering::SeqCst);
    RouterState::set(&stats.kv_blocks_free, kv_blocks as u64);
    (GroupHandle { tx, kv: Arc::new(Mutex::new(KvManager::new(kv_blocks, 4, true))), stats }, rx)
}

#[test]
fn requeue_skips_the_failed_group_and_returns_what_finds_none() {
    let (g0, mut rx0) = group(64);
    let (g1, mut rx1) = group(64);
    let stats0 = g0.stats.clone();
    let stats1 = g1.stats.clone();
    let placer = Placer::new(vec![g0, g1], Routing::RoundRobin);
    let (mut a, _) = setup(config(None, None, 0), 64);
    for id in 0..3 {
        a.enqueue(entry(id, request(prompt(id, 6), 4), None));
    }
    let seqs = a.evacuate().into_iter().map(|s| (s, mpsc::unbounded_channel().0)).collect();
    stats0.serving.store(false, std::sync::atomic::Ordering::SeqCst);
    assert!(placer.requeue(0, seqs).is_empty());
    let mut ids = vec![];
    while let Ok(Arrival::Resume(s, _)) = rx1.try_recv() {
        ids.push(s.id);
    }
    assert_eq!(ids, [0, 1, 2]);
    assert!(rx0.try_recv().is_err(), "a sequence went back to the failed group");
    assert_eq!(RouterState::get(&stats1.pending_tokens), 18);
    // No group left: everything comes back to fail with the error.
    stats1.serving.store(false, std::sync::atomic::Ordering::SeqCst);
    let (mut a, _) = setup(config(None, None, 0), 64);
    a.enqueue(entry(7, request(prompt(7, 6), 4), None));
    let seqs = a.evacuate().into_iter().map(|s| (s, mpsc::unbounded_channel().0)).collect();
    assert_eq!(placer.requeue(0, seqs).len(), 1);
}

#[test]
fn placement_follows_the_exact_cached_prefix() {
    let (g0, mut rx0) = group(64);
    let (g1, mut rx1) = group(64);
    let kv1 = g1.kv.lock().unwrap().clone();
    let stats1 = g1.stats.clone();
    let placer = Placer::new(vec![g0, g1], Routing::Prefix);
    // Group 1's radix tree holds the first 8 tokens of the prompt.
    let shared = prompt(3, 9);
    let blocks = kv1.allocate(2).unwrap();
    kv1.commit(None, &blocks, &shared[..8]);
    drop(blocks);
    for id in 0..4 {
        assert_eq!(placer.place(vec![entry(id, request(shared.clone(), 2), None)]).unwrap(), 1);
    }
    assert!(rx0.try_recv().is_err());
    assert!(matches!(rx1.try_recv(), Ok(Arrival::New(_))));
    // Placed work counts as load until the loop takes it: 4 x 9 tokens.
    assert_eq!(RouterState::get(&stats1.pending_tokens), 36);
    RouterState::set(&stats1.pending_tokens, 0);
    // A prompt nobody holds, equal loads: spread by the cursor, not always group 0.
    let mut seen = [0; 2];
    for id in 10..14 {
        seen[placer.place(vec![entry(id, request(prompt(id, 9), 2), None)]).unwrap()] += 1;
    }
    assert!(seen[0] > 0 && seen[1] > 0, "{seen:?}");
}

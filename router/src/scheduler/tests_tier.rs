//! The second KV tier through the scheduler: a prompt whose prefix was evicted
//! from the pool is loaded (the fake shard checks every slot it reads holds
//! the right token, so a wrong or unconfirmed load shows up), and a failed
//! load is recomputed without changing a token.

use super::fake_shard::FakeShard;
use super::state::State;
use super::tests::{assert_no_leak, config, drive, entry, expected, request, BS};
use crate::kv::{KvManager, TierConfig, TierCosts};

pub(super) fn tiered(num_blocks: u32) -> (State, FakeShard) {
    let costs = TierCosts { block_bytes: 64, load_bytes_per_s: 1e9, prefill_tokens_per_s: 1e3 };
    let tier = TierConfig {
        medium: crate::kv::Medium::Disk,
        namespace: "t".into(),
        capacity_blocks: 1000,
        keys: Vec::new(),
        costs,
    };
    let kv = KvManager::new(num_blocks, BS, true).with_tier(tier);
    (State::new(config(None, None, 0), kv), FakeShard::new(BS, num_blocks))
}

pub(super) fn shared(len: u32) -> Vec<u32> {
    (0..len).map(|i| 3 + (i * 11) % 90).collect()
}

/// Turn 1 with prefix P, then unrelated prompts that evict it, then P again.
fn three_turns(st: &mut State, shard: &mut FakeShard) -> (u64, u64) {
    let p: Vec<u32> = shared(40);
    st.enqueue(entry(1, request(p.clone(), 3), None));
    let out = drive(st, shard);
    assert_eq!(out.tokens[&1], expected(&p, 3));
    for id in 2..5 {
        st.enqueue(entry(id, request(super::tests::prompt(id, 40), 2), None));
        drive(st, shard);
    }
    let mut q = p.clone();
    q.extend([7, 8, 9]);
    let computed_before = st.kv.tier_stats().unwrap().hit_blocks;
    st.enqueue(entry(9, request(q.clone(), 4), None));
    let out = drive(st, shard);
    assert_eq!(out.tokens[&9], expected(&q, 4));
    assert!(out.errors.is_empty());
    assert_no_leak(st);
    (computed_before, st.kv.tier_stats().unwrap().hit_blocks)
}

#[test]
fn an_evicted_prefix_is_loaded_not_recomputed() {
    let (mut st, mut shard) = tiered(16);
    let (before, after) = three_turns(&mut st, &mut shard);
    assert_eq!(after - before, 10, "all 10 full blocks of the 40-token prefix come from the tier");
    let loads: usize = shard.steps.iter().map(|s| s.kv_loads.len()).sum();
    assert_eq!(loads, 10);
    // The loading step computes nothing for that request: its compute waits for the reply.
    let step = shard.steps.iter().position(|s| !s.kv_loads.is_empty()).unwrap();
    assert!(shard.steps[step].requests.iter().all(|r| r.id != 9));
    let next = &shard.steps[step + 1].requests;
    assert!(next.iter().any(|r| r.id == 9 && r.num_computed == 40));
}

#[test]
fn a_corrupt_tier_block_is_recomputed_and_never_served_again() {
    let (mut st, mut shard) = tiered(16);
    let p = shared(40);
    st.enqueue(entry(1, request(p.clone(), 3), None));
    drive(&mut st, &mut shard);
    for id in 2..5 {
        st.enqueue(entry(id, request(super::tests::prompt(id, 40), 2), None));
        drive(&mut st, &mut shard);
    }
    let keys = crate::kv::chain_keys("t", &p, BS as usize, 10);
    shard.corrupt.insert(keys[4].clone());
    let mut q = p.clone();
    q.push(5);
    st.enqueue(entry(9, request(q.clone(), 4), None));
    let out = drive(&mut st, &mut shard);
    assert_eq!(out.tokens[&9], expected(&q, 4), "recomputed past the failed load");
    let step = shard.steps.iter().rposition(|s| !s.kv_loads.is_empty()).unwrap();
    let next = shard.steps[step + 1].requests.iter().find(|r| r.id == 9).unwrap();
    assert_eq!(next.num_computed, 4 * BS, "computed only up to the failed block");
    // The corrupt key is gone from the index: it is not asked for again...
    let hits = st.kv.tier_hits(None, &q, 0);
    assert!(!hits.contains(&keys[4]) || !shard.corrupt.contains(&keys[4]));
    assert_no_leak(&st);
}

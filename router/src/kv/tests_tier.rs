//! The two-tier index under random interleavings: a fake store executes the
//! manager's ops as the shard does (saves before the step reuses a block,
//! then loads, then deletes) and can corrupt files. Whatever tier holds a
//! prefix, it maps to exactly that prefix's tokens; a key whose load failed
//! is never served again until a fresh save rewrites it.

use std::collections::{HashMap, HashSet};

use proptest::prelude::*;

use super::tests::{check, prompt, write, Content, Seq, BS};
use super::{Key, TierCosts};
use super::{KvManager, TierConfig};

#[derive(Debug, Clone)]
enum Op {
    Admit {
        pat: u8,
        len: u8,
    },
    Finish {
        seq: usize,
    },
    Pressure {
        n: u8,
    },
    /// Flip bytes of one stored file (the n-th key, if any).
    Corrupt {
        n: usize,
    },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0u8..3, 1u8..28).prop_map(|(pat, len)| Op::Admit { pat, len }),
        2 => any::<usize>().prop_map(|seq| Op::Finish { seq }),
        2 => (1u8..12).prop_map(|n| Op::Pressure { n }),
        1 => any::<usize>().prop_map(|n| Op::Corrupt { n }),
    ]
}

/// The shard's store: key -> the prefix tokens whose KV the file holds.
#[derive(Default)]
struct Store {
    files: HashMap<Key, Vec<u32>>,
    corrupt: HashSet<Key>,
}

fn tier(capacity: u32) -> TierConfig {
    let costs = TierCosts { block_bytes: 64, load_bytes_per_s: 1e9, prefill_tokens_per_s: 1e3 };
    TierConfig {
        medium: super::Medium::Disk,
        namespace: "test".into(),
        capacity_blocks: capacity,
        keys: Vec::new(),
        costs,
    }
}

/// Saves and deletes the manager queued, run as the shard runs them.
fn run_ops(kv: &KvManager, store: &mut Store, content: &Content) -> Result<(), TestCaseError> {
    let ops = kv.take_tier_ops();
    for s in ops.saves {
        let c = content.get(&s.block_id).cloned();
        prop_assert!(c.is_some(), "save of block {} that holds nothing", s.block_id);
        store.corrupt.remove(&s.key);
        store.files.insert(s.key, c.unwrap());
    }
    for k in ops.deletes {
        store.files.remove(&k);
        store.corrupt.remove(&k);
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]
    #[test]
    fn two_tier_index_serves_exact_prefixes(ops in prop::collection::vec(op(), 1..100), pool in 8u32..24, cap in 1u32..16) {
        let kv = KvManager::new(pool, BS, true).with_tier(tier(cap));
        let mut store = Store::default();
        let mut seqs: Vec<Seq> = Vec::new();
        let mut content = Content::new();
        let mut failed: HashSet<Key> = HashSet::new();
        for op in ops {
            match op {
                Op::Admit { pat, len } => {
                    let tokens = prompt(pat, len);
                    let mut blocks = kv.acquire_prefix(None, &tokens);
                    let cached = blocks.len() as usize;
                    if !blocks.ensure_capacity(tokens.len() as u32) {
                        continue;
                    }
                    let hits = kv.tier_hits(None, &tokens, cached);
                    // The step: saves first (evictions of this allocation), then loads.
                    run_ops(&kv, &mut store, &content)?;
                    let mut loaded = 0;
                    for (i, key) in hits.iter().enumerate() {
                        prop_assert!(!failed.contains(key), "key {} served after its load failed", key);
                        let b = cached + i;
                        let file = store.files.get(key);
                        prop_assert!(file.is_some(), "the index claims key {} the store lacks", key);
                        match file {
                            Some(c) if !store.corrupt.contains(key) => {
                                // A prefix maps to exactly its tokens.
                                prop_assert_eq!(&c[..], &tokens[..(b + 1) * BS as usize]);
                                content.insert(blocks.ids()[b], c.clone());
                                loaded += 1;
                            }
                            _ => break,
                        }
                    }
                    if loaded < hits.len() {
                        // The step reply names the failed load; the rest is recomputed.
                        kv.tier_forget(&hits[loaded..loaded + 1]);
                        failed.insert(hits[loaded].clone());
                    }
                    let s = Seq { tokens, blocks };
                    write(&mut content, &s, (cached + loaded) * BS as usize);
                    kv.commit(None, &s.blocks, &s.tokens);
                    seqs.push(s);
                }
                Op::Finish { seq } if !seqs.is_empty() => {
                    seqs.swap_remove(seq % seqs.len());
                }
                Op::Pressure { n } => {
                    if let Some(b) = kv.allocate(n as u32) {
                        run_ops(&kv, &mut store, &content)?;
                        for id in b.ids() {
                            content.remove(id);
                        }
                    }
                }
                Op::Corrupt { n } => {
                    let mut keys: Vec<&Key> = store.files.keys().collect();
                    keys.sort();
                    if !keys.is_empty() {
                        store.corrupt.insert(keys[n % keys.len()].clone());
                    }
                }
                _ => {}
            }
            run_ops(&kv, &mut store, &content)?;
            // A fresh save makes a key servable again.
            failed.retain(|k| !store.files.contains_key(k) || store.corrupt.contains(k));
            check(&kv, &seqs, &content)?;
            let st = kv.tier_stats().unwrap();
            prop_assert!(st.stored <= cap as u64, "tier over its capacity");
            // The index never claims a key the store does not have.
            prop_assert!(st.stored as usize <= store.files.len());
        }
    }
}

#[test]
fn evicted_prefix_comes_back_from_the_tier() {
    let kv = KvManager::new(6, BS, true).with_tier(tier(64));
    let a: Vec<u32> = (0..9).collect();
    let mut s = kv.acquire_prefix(None, &a);
    assert!(s.ensure_capacity(9));
    kv.commit(None, &s, &a);
    // Write-through: both full blocks are saved once.
    assert_eq!(kv.take_tier_ops().saves.len(), 2);
    drop(s);
    assert!(kv.allocate(5).is_some()); // evicts the cached prefix
    assert_eq!(kv.stats().cached, 0);
    assert!(kv.take_tier_ops().saves.is_empty(), "already in the tier: not saved again");
    assert_eq!(kv.tier_hits(None, &a, 0).len(), 2);
    kv.tier_forget(&kv.tier_hits(None, &a, 0)[1..]);
    assert_eq!(kv.tier_hits(None, &a, 0).len(), 1);
}

#[test]
fn restart_keys_are_hit_and_budget_holds() {
    let keys = super::chain_keys("test", &(0..9).collect::<Vec<u32>>(), BS as usize, 2);
    let mut cfg = tier(1);
    cfg.keys = keys.clone();
    let kv = KvManager::new(6, BS, true).with_tier(cfg);
    // Capacity 1: the older key is deleted, the newer one stays.
    assert_eq!(kv.take_tier_ops().deletes, vec![keys[0].clone()]);
    assert!(
        kv.tier_hits(None, &(0..9).collect::<Vec<u32>>(), 0).is_empty(),
        "hits are consecutive from the first block"
    );
    assert_eq!(kv.tier_hits(None, &(0..9).collect::<Vec<u32>>(), 1), vec![keys[1].clone()]);
}

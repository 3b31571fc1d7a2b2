//! KV-cache events against what the cache really does, under random
//! interleavings of admissions, commits, finishes and eviction pressure: a
//! block is announced once while held, its hash recomputable from its
//! parent and its tokens; it is removed only while held; in the pool (a
//! tree) its parent is announced before it and removed after it; once
//! everything is evicted every announced pool block has been removed; and
//! the second tier's announced blocks are exactly the keys it holds. Prompts
//! may announce their blocks at admission (announce.rs): then the pool's
//! announced blocks are those cached or in flight.

use std::collections::HashMap;

use proptest::prelude::*;

use super::block_hash::{block_hash, root_hash, HASH_SEED};
use super::tests::{prompt, BS};
use super::{KvBlocks, KvEvent, KvManager, Medium, TierConfig, TierCosts};

#[derive(Debug, Clone)]
enum Op {
    Admit { pat: u8, len: u8, announce: bool },
    Commit { seq: usize },
    Finish { seq: usize },
    Pressure { n: u8 },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (0u8..3, 1u8..30, any::<bool>()).prop_map(|(pat, len, announce)| Op::Admit { pat, len, announce }),
        3 => any::<usize>().prop_map(|seq| Op::Commit { seq }),
        2 => any::<usize>().prop_map(|seq| Op::Finish { seq }),
        1 => (1u8..12).prop_map(|n| Op::Pressure { n }),
    ]
}

/// What subscribers know, per medium: each held hash and its parent.
#[derive(Default)]
struct Subscriber {
    held: HashMap<(Medium, u64), Option<u64>>,
}

impl Subscriber {
    fn apply(&mut self, e: KvEvent) -> Result<(), TestCaseError> {
        match e {
            KvEvent::Stored { hashes, parent, tokens, block_size, medium, lora } => {
                prop_assert_eq!(tokens.len(), hashes.len() * block_size as usize);
                let mut prev = parent;
                for (h, chunk) in hashes.iter().zip(tokens.chunks(block_size as usize)) {
                    // The pool is a tree: a block is held with its whole prefix. (The
                    // second tier keeps single keys, least recently used first.)
                    if let (Some(p), Medium::Device) = (prev, medium) {
                        prop_assert!(self.held.contains_key(&(medium, p)), "parent {} of {} not held", p, h);
                    }
                    prop_assert_eq!(
                        *h,
                        block_hash(prev.unwrap_or(root_hash(HASH_SEED)), chunk, lora.as_ref().map(|l| &*l.name)),
                        "hash chains by parent"
                    );
                    prop_assert!(self.held.insert((medium, *h), prev).is_none(), "{} stored twice", h);
                    prev = Some(*h);
                }
            }
            KvEvent::Removed { hashes, medium } => {
                for h in hashes {
                    prop_assert!(self.held.remove(&(medium, h)).is_some(), "{} removed but not held", h);
                    let orphan = self.held.iter().any(|(k, p)| k.0 == Medium::Device && *p == Some(h));
                    prop_assert!(medium != Medium::Device || !orphan, "{} removed before its children", h);
                }
            }
            KvEvent::Cleared => self.held.clear(),
        }
        Ok(())
    }

    fn count(&self, medium: Medium) -> usize {
        self.held.keys().filter(|k| k.0 == medium).count()
    }
}

fn run(kv: &KvManager, ops: Vec<Op>, pool: u32) -> Result<Subscriber, TestCaseError> {
    let mut sub = Subscriber::default();
    let mut seqs: Vec<(Vec<u32>, KvBlocks)> = Vec::new();
    for op in ops {
        match op {
            Op::Admit { pat, len, announce } => {
                let tokens = prompt(pat, len);
                let mut blocks = kv.acquire_prefix(None, &tokens);
                if blocks.ensure_capacity(tokens.len() as u32) {
                    if announce {
                        // Announced at admission, as the scheduler does (announce.rs).
                        kv.announce(&mut blocks, None, &tokens);
                    }
                    seqs.push((tokens, blocks));
                }
            }
            Op::Commit { seq } if !seqs.is_empty() => {
                let (t, b) = &seqs[seq % seqs.len()];
                kv.commit(None, b, t);
            }
            Op::Finish { seq } if !seqs.is_empty() => drop(seqs.swap_remove(seq % seqs.len())),
            Op::Pressure { n } => drop(kv.allocate(n as u32)),
            _ => {}
        }
        for e in kv.take_events() {
            sub.apply(e)?;
        }
        prop_assert_eq!(sub.count(Medium::Device), kv.published_blocks(), "announced = cached or in flight");
    }
    drop(seqs);
    // Everything evicted: every announced block of the pool was removed.
    drop(kv.allocate(pool - 1));
    for e in kv.take_events() {
        sub.apply(e)?;
    }
    prop_assert_eq!(sub.count(Medium::Device), 0);
    Ok(sub)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]
    #[test]
    fn events_mirror_the_pool(ops in prop::collection::vec(op(), 1..100), pool in 8u32..40) {
        run(&KvManager::new(pool, BS, true).with_events(), ops, pool)?;
    }

    #[test]
    fn events_mirror_the_second_tier_too(ops in prop::collection::vec(op(), 1..100), pool in 8u32..40, cap in 1u32..12) {
        let costs = TierCosts { block_bytes: 64, load_bytes_per_s: 1e9, prefill_tokens_per_s: 1e3 };
        let tier = TierConfig { medium: Medium::Host, namespace: "t".into(), capacity_blocks: cap, keys: Vec::new(), costs };
        let kv = KvManager::new(pool, BS, true).with_tier(tier).with_events();
        let sub = run(&kv, ops, pool)?;
        prop_assert_eq!(sub.count(Medium::Host) as u64, kv.tier_stats().unwrap().stored, "announced = held by the tier");
    }
}

#[test]
fn nothing_is_recorded_unless_asked() {
    let kv = KvManager::new(16, BS, true);
    let tokens = prompt(1, 20);
    let b = kv.acquire_prefix(None, &tokens);
    let mut b = b;
    assert!(b.ensure_capacity(20));
    kv.commit(None, &b, &tokens);
    assert!(kv.take_events().is_empty());
    assert_eq!(kv.stats().cached, 5);
}

fn stored(events: &[KvEvent]) -> Vec<u64> {
    events.iter().flat_map(|e| if let KvEvent::Stored { hashes, .. } = e { hashes.clone() } else { vec![] }).collect()
}

fn removed(events: &[KvEvent]) -> Vec<u64> {
    events.iter().flat_map(|e| if let KvEvent::Removed { hashes, .. } = e { hashes.clone() } else { vec![] }).collect()
}

#[test]
fn an_admitted_prompt_is_announced_before_it_is_computed() {
    let kv = KvManager::new(32, BS, true).with_events();
    let tokens = prompt(1, 20); // 5 full blocks
    let mut a = kv.acquire_prefix(None, &tokens);
    assert!(a.ensure_capacity(20));
    kv.announce(&mut a, None, &tokens);
    let at_admission = stored(&kv.take_events());
    assert_eq!(at_admission.len(), 5, "every full block, before the shard computes any");
    // A second prompt sharing the first 3 blocks (waiting for them, then
    // computing its own rest) announces only what is new.
    let other = [&tokens[..12], &prompt(2, 8)[..]].concat();
    let mut b = kv.acquire_prefix(None, &other);
    assert!(b.ensure_capacity(20));
    kv.announce(&mut b, None, &other);
    assert_eq!(stored(&kv.take_events()).len(), 2);
    // Computed and cached: nothing more to say.
    kv.commit(None, &a, &tokens);
    assert!(kv.take_events().is_empty());
    // The second ends before computing its blocks: its own two are removed,
    // the shared ones stay (the cache holds them now).
    drop(b);
    let gone = removed(&kv.take_events());
    assert_eq!(gone.len(), 2);
    assert!(gone.iter().all(|h| !at_admission.contains(h)));
    // The first finishes: its blocks stay cached, then go on eviction.
    drop(a);
    assert!(kv.take_events().is_empty());
    drop(kv.allocate(31));
    assert_eq!(removed(&kv.take_events()).len(), 5);
}

#[test]
fn a_preempted_prompt_withdraws_what_it_never_computed() {
    let kv = KvManager::new(32, BS, true).with_events();
    let tokens = prompt(0, 16); // 4 full blocks
    let mut a = kv.acquire_prefix(None, &tokens);
    assert!(a.ensure_capacity(16));
    kv.announce(&mut a, None, &tokens);
    let announced = stored(&kv.take_events());
    // The first chunk (2 blocks) is computed, then the sequence is preempted.
    kv.commit(None, &a, &tokens[..8]);
    assert!(kv.take_events().is_empty());
    drop(a);
    let gone = removed(&kv.take_events());
    assert_eq!(gone, vec![announced[3], announced[2]], "the uncomputed blocks, deepest first");
    assert_eq!(kv.published_blocks(), 2);
    // Announcing again (the sequence resumes) names only the uncached rest.
    let mut again = kv.acquire_prefix(None, &tokens);
    assert!(again.ensure_capacity(16));
    kv.announce(&mut again, None, &tokens);
    assert_eq!(stored(&kv.take_events()), announced[2..].to_vec());
}

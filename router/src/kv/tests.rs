//! Allocator + radix cache together, driven by random interleavings of what
//! the scheduler does: admit (prefix match + allocate), extend, commit,
//! finish, preempt, and allocation pressure that forces eviction.

use std::collections::HashMap;

use proptest::prelude::*;

use super::{KvBlocks, KvManager};

pub(super) const BS: u32 = 4;

pub(super) struct Seq {
    pub(super) tokens: Vec<u32>,
    pub(super) blocks: KvBlocks,
}

#[derive(Debug, Clone)]
enum Op {
    /// Admit a sequence whose prompt is `len` tokens of pattern `pat`.
    Admit {
        pat: u8,
        len: u8,
    },
    /// Generate `n` tokens for a running sequence.
    Extend {
        seq: usize,
        n: u8,
    },
    /// Commit a sequence's computed full blocks into the cache.
    Commit {
        seq: usize,
    },
    Finish {
        seq: usize,
    },
    /// Commit then drop, as preemption does.
    Preempt {
        seq: usize,
    },
    /// Grab raw blocks (eviction pressure), then return them.
    Pressure {
        n: u8,
    },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (0u8..3, 1u8..24).prop_map(|(pat, len)| Op::Admit { pat, len }),
        3 => (any::<usize>(), 1u8..9).prop_map(|(seq, n)| Op::Extend { seq, n }),
        2 => any::<usize>().prop_map(|seq| Op::Commit { seq }),
        1 => any::<usize>().prop_map(|seq| Op::Finish { seq }),
        1 => any::<usize>().prop_map(|seq| Op::Preempt { seq }),
        1 => (1u8..12).prop_map(|n| Op::Pressure { n }),
    ]
}

/// Prompts of one pattern share prefixes; generated tokens diverge.
pub(super) fn prompt(pat: u8, len: u8) -> Vec<u32> {
    (0..len as u32).map(|i| (pat as u32) * 1000 + i % 7).collect()
}

/// What each block holds: the token prefix its KV was computed for.
pub(super) type Content = HashMap<u32, Vec<u32>>;

pub(super) fn write(content: &mut Content, s: &Seq, from: usize) {
    let bs = BS as usize;
    for (i, &b) in s.blocks.ids().iter().enumerate() {
        let end = ((i + 1) * bs).min(s.tokens.len());
        // Only blocks that now hold newly written tokens, and only once full.
        if end == (i + 1) * bs && end > from {
            content.insert(b, s.tokens[..end].to_vec());
        }
    }
}

pub(super) fn check(kv: &KvManager, seqs: &[Seq], content: &Content) -> Result<(), TestCaseError> {
    let st = kv.stats();
    let mut held: HashMap<u32, u32> = HashMap::new();
    for s in seqs {
        for &b in s.blocks.ids() {
            *held.entry(b).or_default() += 1;
        }
    }
    prop_assert_eq!(st.used() as usize, held.len(), "used blocks = distinct blocks held");
    prop_assert_eq!(st.free + st.cached_unused + st.used(), st.capacity);
    for (&b, &n) in &held {
        let in_tree = kv.cached_prefix_of(b).is_some() as u32;
        prop_assert_eq!(kv.refs(b), n + in_tree, "block {} refcount", b);
    }
    // A cached prefix always maps to a block holding exactly those tokens.
    for b in 1..=st.capacity {
        if let Some(prefix) = kv.cached_prefix_of(b) {
            prop_assert_eq!(Some(&prefix), content.get(&b), "cached block {} content", b);
        }
    }
    // Blocks shared through the cache hold the sharer's own tokens.
    for s in seqs {
        for (i, &b) in s.blocks.ids().iter().enumerate() {
            let end = (i + 1) * BS as usize;
            if end <= s.tokens.len() {
                if let Some(c) = content.get(&b) {
                    prop_assert_eq!(&c[..], &s.tokens[..end], "block {} of a sequence", b);
                }
            }
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]
    #[test]
    fn cache_and_allocator_never_leak_or_corrupt(ops in prop::collection::vec(op(), 1..120), pool in 8u32..40) {
        let kv = KvManager::new(pool, BS, true);
        let mut seqs: Vec<Seq> = Vec::new();
        let mut content = Content::new();
        for op in ops {
            match op {
                Op::Admit { pat, len } => {
                    let tokens = prompt(pat, len);
                    let mut blocks = kv.acquire_prefix(None, &tokens);
                    let cached = blocks.len() as usize * BS as usize;
                    prop_assert!(cached < tokens.len(), "at least one token is computed");
                    if blocks.ensure_capacity(tokens.len() as u32) {
                        let s = Seq { tokens, blocks };
                        write(&mut content, &s, cached);
                        seqs.push(s);
                    }
                }
                Op::Extend { seq, n } if !seqs.is_empty() => {
                    let i = seq % seqs.len();
                    let s = &mut seqs[i];
                    let gen = s.tokens.len() as u32;
                    let new_len = s.tokens.len() + n as usize;
                    if s.blocks.ensure_capacity(new_len as u32) {
                        s.tokens.extend((0..n as u32).map(|k| 50_000 + (i as u32) * 100 + gen + k));
                        let from = s.tokens.len() - n as usize;
                        let s = &seqs[i];
                        write(&mut content, s, from);
                    }
                }
                Op::Commit { seq } if !seqs.is_empty() => {
                    let s = &seqs[seq % seqs.len()];
                    kv.commit(None, &s.blocks, &s.tokens);
                }
                Op::Finish { seq } if !seqs.is_empty() => {
                    seqs.swap_remove(seq % seqs.len());
                }
                Op::Preempt { seq } if !seqs.is_empty() => {
                    let s = seqs.swap_remove(seq % seqs.len());
                    kv.commit(None, &s.blocks, &s.tokens);
                    drop(s);
                }
                Op::Pressure { n } => {
                    let before = kv.available();
                    match kv.allocate(n as u32) {
                        Some(b) => {
                            prop_assert!(n as u32 <= before);
                            // Fresh blocks hold nothing until written.
                            for id in b.ids() { content.remove(id); }
                        }
                        None => prop_assert!(n as u32 > before),
                    }
                }
                _ => {}
            }
            check(&kv, &seqs, &content)?;
        }
        seqs.clear();
        let st = kv.stats();
        prop_assert_eq!(st.used(), 0);
        prop_assert_eq!(st.free + st.cached_unused, st.capacity);
        // Everything cached can be reclaimed once nobody runs.
        prop_assert!(kv.allocate(st.capacity).is_some());
    }
}

#[test]
fn shared_prefix_is_reused_and_evicted_lru() {
    let kv = KvManager::new(9, BS, true);
    let a: Vec<u32> = (0..9).collect();
    let mut s = kv.acquire_prefix(None, &a);
    assert!(s.is_empty());
    assert!(s.ensure_capacity(9));
    kv.commit(None, &s, &a);
    assert_eq!(kv.stats().cached, 2);
    let b = kv.acquire_prefix(None, &a);
    assert_eq!(b.ids(), &s.ids()[..2]);
    drop(b);
    drop(s);
    let st = kv.stats();
    assert_eq!((st.used(), st.cached_unused), (0, 2));
    // Pressure evicts the cached blocks rather than failing.
    assert!(kv.allocate(8).is_some());
    assert_eq!(kv.stats().cached, 0);
}

#[test]
fn disabled_prefix_caching_caches_nothing() {
    let kv = KvManager::new(9, BS, false);
    let a: Vec<u32> = (0..9).collect();
    let mut s = kv.acquire_prefix(None, &a);
    s.ensure_capacity(9);
    kv.commit(None, &s, &a);
    assert_eq!(kv.stats().cached, 0);
    assert_eq!(kv.peek_prefix(None, &a), 0);
}

#[test]
fn at_least_one_token_is_left_to_compute() {
    let kv = KvManager::new(9, BS, true);
    let a: Vec<u32> = (0..8).collect();
    let mut s = kv.acquire_prefix(None, &a);
    s.ensure_capacity(8);
    kv.commit(None, &s, &a);
    // 8 tokens = 2 full blocks cached, but a repeat may take only one.
    assert_eq!(kv.acquire_prefix(None, &a).len(), 1);
}

//! Prompt logprobs kept beside the prefix cache's blocks, so a request that
//! asks for them can still take its prefix from the KV cache.
//!
//! An entry holds the logprobs of one full block of a prompt: for block `b`,
//! those of positions `b * bs .. (b + 1) * bs`, each given everything before
//! it, which is a function of the prefix up to the block's end alone. So an
//! entry is keyed by the block's chain hash (the hash of the whole prefix
//! through it, as the radix tree keys its blocks), and outlives the KV block
//! it was computed with. A sequence that computed its whole prompt's
//! logprobs stores every full block of it (`prompt_logprobs::prefill_event`);
//! later requests on the same prefix read them back (`fill`). Entries are
//! least-recently-used out past `capacity` (the pool's block count), and
//! hold the alternatives of the request that computed them: a request
//! asking for more reads none of them and computes its prompt.

use std::collections::hash_map::DefaultHasher;
use std::collections::{BTreeMap, HashMap};
use std::hash::{Hash, Hasher};

use super::prompt_logprobs::PromptLogprobs;
use crate::proto::pb;

#[derive(Debug)]
struct Entry {
    tokens: Vec<u32>,
    logprobs: Vec<f32>,
    ranks: Vec<u32>,
    top: Vec<pb::Tokens>,
    top_n: u32,
    used: u64,
}

#[derive(Debug)]
pub struct LogprobCache {
    block_size: usize,
    capacity: usize,
    entries: HashMap<u64, Entry>,
    /// Last use -> key: the least recently used entry first.
    lru: BTreeMap<u64, u64>,
    clock: u64,
}

/// The chain hash of the prefix through `block`, given the one before it.
fn chain(prev: u64, block: &[u32]) -> u64 {
    let mut h = DefaultHasher::new();
    prev.hash(&mut h);
    block.hash(&mut h);
    h.finish()
}

impl LogprobCache {
    pub fn new(block_size: u32, capacity: u32) -> Self {
        Self {
            block_size: block_size.max(1) as usize,
            capacity: capacity as usize,
            entries: HashMap::new(),
            lru: BTreeMap::new(),
            clock: 0,
        }
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Keys of the full blocks of `tokens` under adapter `lora` (0: the
    /// base model; an adapter's logprobs are its own), in order.
    fn keys<'a>(&self, lora: u32, tokens: &'a [u32]) -> impl Iterator<Item = (u64, &'a [u32])> {
        let seed = if lora == 0 { 0 } else { chain(lora as u64, &[]) };
        tokens.chunks_exact(self.block_size).scan(seed, |prev, block| {
            *prev = chain(*prev, block);
            Some((*prev, block))
        })
    }

    fn usable(&self, key: u64, block: &[u32], top_n: u32) -> Option<&Entry> {
        self.entries.get(&key).filter(|e| e.tokens == block && e.top_n >= top_n)
    }

    /// Per full block of `tokens`: whether an entry with `top_n` alternatives holds it.
    pub fn stored_blocks(&self, lora: u32, tokens: &[u32], top_n: u32) -> Vec<bool> {
        self.keys(lora, tokens).map(|(key, block)| self.usable(key, block, top_n).is_some()).collect()
    }

    /// Fills the positions of `lps` that stored blocks of `tokens` hold.
    pub fn fill(&mut self, lora: u32, tokens: &[u32], lps: &mut PromptLogprobs) {
        let keys: Vec<(u64, usize)> = self.keys(lora, tokens).enumerate().map(|(b, (k, _))| (k, b)).collect();
        for (key, b) in keys {
            let start = b * self.block_size;
            let Some(e) = self.usable(key, &tokens[start..start + self.block_size], lps.top_n) else { continue };
            for i in 0..self.block_size {
                if !e.logprobs[i].is_nan() && !lps.known(start + i) {
                    lps.set(start + i, e.logprobs[i], e.ranks[i], e.top.get(i));
                }
            }
            self.touch(key);
        }
    }

    /// Stores every full block of a prompt whose logprobs are all known;
    /// an entry with fewer alternatives is replaced.
    pub fn store(&mut self, lora: u32, tokens: &[u32], lps: &PromptLogprobs) {
        let keys: Vec<(u64, usize)> = self.keys(lora, tokens).enumerate().map(|(b, (k, _))| (k, b)).collect();
        for (key, b) in keys {
            let range = b * self.block_size..(b + 1) * self.block_size;
            if self.usable(key, &tokens[range.clone()], lps.top_n).is_none() {
                let top = if lps.top.is_empty() { Vec::new() } else { lps.top[range.clone()].to_vec() };
                let entry = Entry {
                    tokens: tokens[range.clone()].to_vec(),
                    logprobs: lps.logprobs[range.clone()].to_vec(),
                    ranks: lps.ranks[range].to_vec(),
                    top,
                    top_n: lps.top_n,
                    used: 0,
                };
                if let Some(old) = self.entries.insert(key, entry) {
                    self.lru.remove(&old.used);
                }
            }
            self.touch(key);
        }
        self.evict();
    }

    fn touch(&mut self, key: u64) {
        self.clock += 1;
        if let Some(e) = self.entries.get_mut(&key) {
            self.lru.remove(&e.used);
            e.used = self.clock;
            self.lru.insert(self.clock, key);
        }
    }

    fn evict(&mut self) {
        while self.entries.len() > self.capacity {
            let Some((_, key)) = self.lru.pop_first() else { break };
            self.entries.remove(&key);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A complete prompt of `len` tokens whose position p has logprob -p.
    fn complete(len: usize, top_n: u32) -> PromptLogprobs {
        let mut l = PromptLogprobs::new(len, top_n);
        for p in 1..len {
            let top = pb::Tokens { ids: vec![p as u32; top_n as usize], logprobs: vec![-0.5; top_n as usize] };
            l.set(p, -(p as f32), 1, Some(&top));
        }
        l
    }

    #[test]
    fn full_blocks_are_stored_and_read_back_by_prefix() {
        let mut c = LogprobCache::new(4, 100);
        let a: Vec<u32> = (0..10).collect();
        c.store(0, &a, &complete(10, 1));
        assert_eq!(c.len(), 2, "two full blocks of 10 tokens");
        // Same first block, another second one.
        let b: Vec<u32> = (0..4).chain(50..60).collect();
        assert_eq!(c.stored_blocks(0, &b, 1), [true, false, false]);
        assert_eq!(c.stored_blocks(0, &b, 2), [false, false, false], "fewer alternatives than asked");
        assert_eq!(c.stored_blocks(7, &b, 1), [false, false, false], "an adapter's logprobs are its own");
        let mut lps = PromptLogprobs::new(b.len(), 1);
        c.fill(0, &b, &mut lps);
        assert_eq!(lps.known_prefix(), 4);
        assert_eq!((lps.logprobs[3], lps.top[3].ids.clone()), (-3.0, vec![3]));
        // Position 4 starts a block nobody stored: not known.
        assert!(lps.logprobs[4].is_nan());
    }

    #[test]
    fn least_recently_used_blocks_leave_past_capacity() {
        let mut c = LogprobCache::new(2, 3);
        let a = [1, 2, 3, 4];
        let b = [9, 9, 8, 8];
        c.store(0, &a, &complete(4, 0));
        c.store(0, &b, &complete(4, 0));
        assert_eq!(c.len(), 3);
        assert_eq!(c.stored_blocks(0, &a, 0), [false, true], "a's first block was the least recently used");
        assert_eq!(c.stored_blocks(0, &b, 0), [true, true]);
        // More alternatives replace an entry.
        c.store(0, &b, &complete(4, 2));
        assert_eq!(c.stored_blocks(0, &b, 2), [true, true]);
        assert_eq!(c.len(), 3);
    }
}

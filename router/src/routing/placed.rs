//! Prompts placed on a group whose blocks are not in its prefix cache yet.
//! Counting them lets `--routing prefix` send the second of two requests
//! sharing a new prefix, arriving together, to the group the first went to
//! (where it waits for those blocks, scheduler/in_flight.rs) instead of
//! spreading them over the groups to compute the prefix twice.
//!
//! An entry lives until its prompt's blocks are in that group's cache (the
//! radix tree then answers for them) or its request has ended, as the
//! caller tells `retain`. Keys are cheap chain hashes of the
//! prompt's full blocks: one key names a whole prefix. Pure.

use std::hash::{DefaultHasher, Hash, Hasher};

/// Chain keys of the full blocks of `tokens`, at most `max_blocks`, for the
/// KV of adapter `lora` (0: the base model): another adapter's prompt with
/// the same tokens shares no key.
pub fn prefix_keys(lora: u32, tokens: &[u32], block_size: usize, max_blocks: usize) -> Vec<u64> {
    let mut parent = if lora == 0 {
        0u64
    } else {
        let mut h = DefaultHasher::new();
        ("lora", lora).hash(&mut h);
        h.finish()
    };
    tokens
        .chunks_exact(block_size)
        .take(max_blocks)
        .map(|chunk| {
            let mut h = DefaultHasher::new();
            parent.hash(&mut h);
            chunk.hash(&mut h);
            parent = h.finish();
            parent
        })
        .collect()
}

/// One placed prompt: `T` tells whether its request is still alive.
#[derive(Debug)]
struct Placed<T> {
    watch: T,
    keys: Vec<u64>,
}

/// Per group, the prompts placed there and not yet cached.
#[derive(Debug)]
pub struct PlacedPrefixes<T> {
    groups: Vec<Vec<Placed<T>>>,
}

impl<T> PlacedPrefixes<T> {
    pub fn new(groups: usize) -> Self {
        Self { groups: (0..groups).map(|_| Vec::new()).collect() }
    }

    /// A prompt with prefix `keys` was placed on `group`.
    pub fn record(&mut self, group: usize, watch: T, keys: Vec<u64>) {
        if !keys.is_empty() {
            self.groups[group].push(Placed { watch, keys });
        }
    }

    /// Blocks of the prefix `keys` that prompts placed on `group` share.
    pub fn longest(&self, group: usize, keys: &[u64]) -> usize {
        self.groups[group]
            .iter()
            .map(|p| p.keys.iter().zip(keys).take_while(|(a, b)| a == b).count())
            .max()
            .unwrap_or(0)
    }

    /// Keeps the entries `keep(group, watch, keys)` says are still pending
    /// (their request alive, their blocks not all in that group's cache).
    pub fn retain(&mut self, keep: impl Fn(usize, &T, &[u64]) -> bool) {
        for (g, placed) in self.groups.iter_mut().enumerate() {
            placed.retain(|p| keep(g, &p.watch, &p.keys));
        }
    }

    #[cfg(test)]
    fn len(&self, group: usize) -> usize {
        self.groups[group].len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_name_whole_prefixes() {
        let a = prefix_keys(0, &[1, 2, 3, 4, 5], 2, 9);
        assert_eq!(a.len(), 2);
        assert_eq!(prefix_keys(0, &[1, 2, 3, 4], 2, 1), a[..1].to_vec());
        assert_ne!(prefix_keys(0, &[9, 2, 3, 4], 2, 9)[1], a[1]);
        let lora = prefix_keys(1, &[1, 2, 3, 4, 5], 2, 9);
        assert!(lora.iter().zip(&a).all(|(x, y)| x != y), "an adapter's prompt shares no key with the base's");
        assert_ne!(prefix_keys(2, &[1, 2], 2, 9), lora[..1].to_vec());
    }

    #[test]
    fn the_longest_shared_prefix_of_a_group_counts() {
        let mut p = PlacedPrefixes::new(2);
        p.record(0, 1u64, prefix_keys(0, &[1, 2, 3, 4, 5, 6], 2, 9));
        p.record(0, 2u64, prefix_keys(0, &[1, 2, 7, 7], 2, 9));
        let q = prefix_keys(0, &[1, 2, 3, 4, 8, 8], 2, 9);
        assert_eq!((p.longest(0, &q), p.longest(1, &q)), (2, 0));
        // Request 1 ended: only request 2's block is left in common.
        p.retain(|_, id, _| *id != 1);
        assert_eq!(p.longest(0, &q), 1);
        // Its blocks reached the cache: the entry goes.
        p.retain(|g, _, keys| !(g == 0 && keys.len() == 2));
        assert_eq!((p.len(0), p.longest(0, &q)), (0, 0));
    }
}

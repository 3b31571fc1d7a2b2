//! The second tier's key index: which block keys the shard's store (disk
//! files or host memory) holds, least recently used first, and how a block's
//! key is made. A key
//! is the chain hash of the whole token prefix up to and including a block,
//! seeded with the shard's namespace (model weights, dtype, KV dtype, block
//! size), so one key names exactly one prefix of one model: the tier needs no
//! tree, a prompt's keys are looked up block by block.

use std::collections::{BTreeSet, HashMap};

use sha2::{Digest, Sha256};

/// 128 bits of SHA-256, as lowercase hex (file names, proto strings).
pub type Key = String;

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Keys of the first `n` full blocks of `tokens`: key(i) = H(key(i-1), tokens of block i),
/// key(-1) = H(namespace). A cryptographic hash, so one client cannot craft a
/// prompt whose key collides with another's prefix.
pub fn chain_keys(namespace: &str, tokens: &[u32], block_size: usize, n: usize) -> Vec<Key> {
    let mut prev: [u8; 32] = Sha256::digest(namespace.as_bytes()).into();
    tokens
        .chunks_exact(block_size)
        .take(n)
        .map(|chunk| {
            let mut h = Sha256::new();
            h.update(prev);
            for t in chunk {
                h.update(t.to_le_bytes());
            }
            prev = h.finalize().into();
            hex(&prev[..16])
        })
        .collect()
}

/// The keys one tier holds, with LRU order and a capacity in blocks.
#[derive(Debug)]
pub struct TierIndex {
    capacity: usize,
    last_use: HashMap<Key, u64>,
    lru: BTreeSet<(u64, Key)>,
    tick: u64,
}

impl TierIndex {
    /// `keys`: what the store already holds, least recently used first.
    pub fn new(capacity: usize, keys: impl IntoIterator<Item = Key>) -> (Self, Vec<Key>) {
        let mut t = Self { capacity, last_use: HashMap::new(), lru: BTreeSet::new(), tick: 0 };
        let mut over = Vec::new();
        for k in keys {
            over.extend(t.insert(k));
        }
        (t, over)
    }

    pub fn len(&self) -> usize {
        self.last_use.len()
    }

    pub fn is_empty(&self) -> bool {
        self.last_use.is_empty()
    }

    pub fn contains(&self, key: &str) -> bool {
        self.last_use.contains_key(key)
    }

    /// Marks `key` most recently used; false when absent.
    pub fn touch(&mut self, key: &str) -> bool {
        self.tick += 1;
        let tick = self.tick;
        match self.last_use.get_mut(key) {
            Some(t) => {
                self.lru.remove(&(*t, key.to_string()));
                *t = tick;
                self.lru.insert((tick, key.to_string()));
                true
            }
            None => false,
        }
    }

    /// Adds `key` (most recently used); returns the keys evicted to stay
    /// within capacity, which the store must delete.
    pub fn insert(&mut self, key: Key) -> Vec<Key> {
        if self.touch(&key) {
            return Vec::new();
        }
        self.last_use.insert(key.clone(), self.tick);
        self.lru.insert((self.tick, key));
        let mut evicted = Vec::new();
        while self.last_use.len() > self.capacity {
            let (_, k) = self.lru.pop_first().expect("non-empty");
            self.last_use.remove(&k);
            evicted.push(k);
        }
        evicted
    }

    /// Forgets `key` (the store lost it or a load of it failed).
    pub fn remove(&mut self, key: &str) -> bool {
        match self.last_use.remove(key) {
            Some(t) => {
                self.lru.remove(&(t, key.to_string()));
                true
            }
            None => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_chain_the_whole_prefix() {
        let a = chain_keys("m", &[1, 2, 3, 4, 5, 6], 2, 3);
        let b = chain_keys("m", &[9, 2, 3, 4, 5, 6], 2, 3);
        assert_eq!(a.len(), 3);
        // Same block tokens after a different first block: different keys.
        assert!(a.iter().zip(&b).all(|(x, y)| x != y));
        assert_eq!(chain_keys("m", &[1, 2, 3, 4], 2, 9), a[..2].to_vec());
        assert_ne!(chain_keys("other", &[1, 2], 2, 1), a[..1].to_vec());
        assert_eq!(a[0].len(), 32);
    }

    #[test]
    fn index_evicts_least_recently_used() {
        let (mut t, over) = TierIndex::new(2, ["a".to_string(), "b".to_string(), "c".to_string()]);
        assert_eq!(over, vec!["a".to_string()]);
        assert!(t.touch("b"));
        assert_eq!(t.insert("d".into()), vec!["c".to_string()]);
        assert!(t.contains("b") && t.contains("d") && !t.contains("c"));
        assert!(t.remove("b"));
        assert_eq!(t.insert("e".into()), Vec::<Key>::new());
    }
}

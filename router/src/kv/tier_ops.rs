//! The KV manager's plan of second-tier ops: which pool blocks to save under
//! which key, which keys to delete, which prompt blocks to load instead of
//! computing (where the measured costs say loading is cheaper), and the
//! counts behind the tier metrics, and the KV-cache events of what the
//! tier gains and loses. The shard executes the ops
//! (server/pagemill/shard/kv_tier.py); nothing here does I/O.

use std::collections::HashMap;
use std::ops::Range;

use super::events::{EventLog, KvEvent, LoraTag, Medium};
use super::radix::Evicted;
use super::tier_index::{chain_keys, Key, TierIndex};
use crate::adapter::Adapter;
use crate::proto::pb;

/// Rates the shard measured: the router loads a hit only when that is
/// cheaper than computing the same tokens again.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TierCosts {
    pub block_bytes: u64,
    pub load_bytes_per_s: f64,
    pub prefill_tokens_per_s: f64,
}

impl TierCosts {
    /// Seconds to load one block, and to recompute it.
    pub fn load_s(&self) -> f64 {
        if self.load_bytes_per_s > 0.0 {
            self.block_bytes as f64 / self.load_bytes_per_s
        } else {
            0.0
        }
    }

    pub fn recompute_s(&self, block_size: u32) -> f64 {
        if self.prefill_tokens_per_s > 0.0 {
            block_size as f64 / self.prefill_tokens_per_s
        } else {
            f64::INFINITY
        }
    }

    pub fn load_is_cheaper(&self, block_size: u32) -> bool {
        self.load_s() < self.recompute_s(block_size)
    }
}

/// What the shard reported of its tier at warmup.
#[derive(Debug, Clone)]
pub struct TierConfig {
    /// Host memory or disk (the shard's `kind`).
    pub medium: Medium,
    pub namespace: String,
    pub capacity_blocks: u32,
    /// Already stored (a restart), least recently used first.
    pub keys: Vec<Key>,
    pub costs: TierCosts,
}

impl TierConfig {
    pub fn from_warmup(t: &pb::KvTier) -> Self {
        Self {
            medium: Medium::of_tier(&t.kind),
            namespace: t.namespace.clone(),
            capacity_blocks: t.capacity_blocks,
            keys: t.keys.clone(),
            costs: TierCosts {
                block_bytes: t.block_bytes,
                load_bytes_per_s: t.load_bytes_per_s,
                prefill_tokens_per_s: t.prefill_tokens_per_s,
            },
        }
    }
}

/// Ops for the next step, in the order the shard runs them: saves, then
/// (the plan's loads, then) deletes.
#[derive(Debug, Default)]
pub struct TierOps {
    pub saves: Vec<pb::KvSave>,
    pub deletes: Vec<Key>,
}

/// Cumulative counts (blocks), for /metrics.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct TierStats {
    pub stored: u64,
    pub hit_blocks: u64,
    pub miss_blocks: u64,
    /// Hits not taken: recomputing was measured cheaper than loading.
    pub skipped_blocks: u64,
    pub saved_blocks: u64,
    pub forgotten: u64,
    pub block_bytes: u64,
}

/// A block as KV-cache events name it: its content hash, its parent's, its tokens.
#[derive(Debug, Clone)]
pub struct Named<'a> {
    pub hash: u64,
    pub parent: Option<u64>,
    pub tokens: &'a [u32],
    pub lora: Option<LoraTag>,
}

#[derive(Debug)]
pub struct SecondTier {
    medium: Medium,
    namespace: String,
    block_size: u32,
    index: TierIndex,
    costs: TierCosts,
    /// Key of every pool block the radix tree indexes, for saving on eviction.
    key_of: HashMap<u32, Key>,
    /// Content hash of each key this process saved (keys found at startup
    /// have none: no event names them).
    hash_of: HashMap<Key, u64>,
    ops: TierOps,
    stats: TierStats,
}

impl SecondTier {
    pub fn new(config: TierConfig, block_size: u32) -> Self {
        let (index, over) = TierIndex::new(config.capacity_blocks as usize, config.keys);
        let stats = TierStats { block_bytes: config.costs.block_bytes, ..Default::default() };
        Self {
            medium: config.medium,
            namespace: config.namespace,
            block_size,
            index,
            costs: config.costs,
            key_of: HashMap::new(),
            hash_of: HashMap::new(),
            ops: TierOps { saves: Vec::new(), deletes: over },
            stats,
        }
    }

    /// The chain's keys: the base model's under the shard's namespace, an
    /// adapter's under that namespace and the adapter's fingerprint (its
    /// files, not its id: the tier outlives the server's ids).
    fn keys(&self, adapter: Option<&Adapter>, tokens: &[u32], n: usize) -> Vec<Key> {
        let namespace = match adapter {
            None => std::borrow::Cow::Borrowed(self.namespace.as_str()),
            Some(a) => std::borrow::Cow::Owned(format!("{}/lora/{}", self.namespace, a.fingerprint)),
        };
        chain_keys(&namespace, tokens, self.block_size as usize, n)
    }

    /// `tokens` (full blocks) live in `blocks`; the radix tree just indexed
    /// `added` of them, whose content hashes (and parents') are `named`.
    /// Those the tier lacks are saved.
    pub fn commit(
        &mut self,
        adapter: Option<&Adapter>,
        tokens: &[u32],
        blocks: &[u32],
        added: Range<usize>,
        named: &[(u64, Option<u64>)],
        events: &mut EventLog,
    ) {
        let keys = self.keys(adapter, tokens, added.end);
        let lora = LoraTag::of(adapter);
        let bs = self.block_size as usize;
        for (i, &(hash, parent)) in added.zip(named) {
            let key = keys[i].clone();
            self.key_of.insert(blocks[i], key.clone());
            let block_tokens = &tokens[i * bs..(i + 1) * bs];
            self.save(blocks[i], key, Named { hash, parent, tokens: block_tokens, lora: lora.clone() }, events);
        }
    }

    fn save(&mut self, block: u32, key: Key, named: Named, events: &mut EventLog) {
        if self.index.touch(&key) {
            // Held already; one found at startup is named the first time its tokens are seen.
            if !self.hash_of.contains_key(&key) {
                self.announce(key, named, events);
            }
            return;
        }
        let over = self.index.insert(key.clone());
        // The shard runs a step's saves before its deletes: within one batch
        // the last word on a key must win, so drop what it contradicts.
        self.ops.deletes.retain(|k| *k != key);
        self.ops.saves.retain(|s| !over.contains(&s.key));
        self.ops.saves.push(pb::KvSave { block_id: block, key: key.clone() });
        self.stats.saved_blocks += 1;
        self.announce(key, named, events);
        self.dropped(&over, events);
        self.ops.deletes.extend(over);
    }

    fn announce(&mut self, key: Key, named: Named, events: &mut EventLog) {
        self.hash_of.insert(key, named.hash);
        events.push(KvEvent::Stored {
            hashes: vec![named.hash],
            parent: named.parent,
            tokens: named.tokens.to_vec(),
            block_size: self.block_size,
            medium: self.medium,
            lora: named.lora,
        });
    }

    /// Keys the tier no longer holds: removal events for those this process named.
    fn dropped(&mut self, keys: &[Key], events: &mut EventLog) {
        for k in keys {
            if let Some(h) = self.hash_of.remove(k) {
                events.removed(h, self.medium);
            }
        }
    }

    /// The radix tree dropped a block: saved unless the tier still has it.
    pub fn evicted(&mut self, gone: &Evicted, events: &mut EventLog) {
        if let Some(key) = self.key_of.remove(&gone.block) {
            let named = Named { hash: gone.hash, parent: gone.parent, tokens: &gone.tokens, lora: gone.lora.clone() };
            self.save(gone.block, key, named, events);
        }
    }

    /// Keys of blocks `from..max` of `tokens` the tier holds, consecutive from `from`.
    pub fn hits(&mut self, adapter: Option<&Adapter>, tokens: &[u32], from: usize, max: usize) -> Vec<Key> {
        let keys = self.keys(adapter, tokens, max);
        let found: Vec<Key> = keys[from..].iter().take_while(|k| self.index.contains(k)).cloned().collect();
        self.stats.miss_blocks += (max - from - found.len()) as u64;
        if !self.costs.load_is_cheaper(self.block_size) {
            self.stats.skipped_blocks += found.len() as u64;
            return Vec::new();
        }
        for k in &found {
            self.index.touch(k);
        }
        self.stats.hit_blocks += found.len() as u64;
        found
    }

    pub fn has_ops(&self) -> bool {
        !(self.ops.saves.is_empty() && self.ops.deletes.is_empty())
    }

    pub fn take_ops(&mut self) -> TierOps {
        std::mem::take(&mut self.ops)
    }

    pub fn forget<'a>(&mut self, keys: impl IntoIterator<Item = &'a String>, events: &mut EventLog) {
        for k in keys {
            if self.index.remove(k) {
                self.stats.forgotten += 1;
                self.dropped(std::slice::from_ref(k), events);
            }
        }
    }

    pub fn costs(&self) -> TierCosts {
        self.costs
    }

    pub fn stats(&self) -> TierStats {
        TierStats { stored: self.index.len() as u64, ..self.stats }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn load_only_when_cheaper() {
        let c = TierCosts { block_bytes: 1000, load_bytes_per_s: 1e6, prefill_tokens_per_s: 1000.0 };
        assert!(c.load_is_cheaper(16)); // 1 ms < 16 ms
        let slow = TierCosts { load_bytes_per_s: 1e4, ..c }; // 100 ms > 16 ms
        assert!(!slow.load_is_cheaper(16));
    }
}

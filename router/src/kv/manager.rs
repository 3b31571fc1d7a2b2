//! The router's KV cache: the refcounted allocator and the radix prefix
//! cache behind one lock (pool.rs); a sequence's share of it is a `KvBlocks`
//! (blocks.rs), which releases its references on Drop.

use std::sync::{Arc, Mutex, PoisonError};

use super::announce::runs;
use super::block_allocator::BlockAllocator;
use super::blocks::KvBlocks;
use super::events::{EventLog, KvEvent, LoraTag, Medium};
use super::pool::Pool;
use super::radix::RadixCache;
use super::tier_index::Key;
use super::tier_ops::{SecondTier, TierConfig, TierCosts, TierOps, TierStats};
use crate::adapter::Adapter;

/// Cheap to clone: every clone is a handle on the same cache. A panic while
/// the lock is held cannot leave the pool half-updated in a way later
/// callers would trip on (every mutation is a few field updates), so a
/// poisoned lock is taken over instead of turning one panic into many.
#[derive(Debug, Clone)]
pub struct KvManager {
    inner: Arc<Mutex<Pool>>,
    block_size: u32,
    capacity: u32,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct KvStats {
    pub capacity: u32,
    pub free: u32,
    /// Held by the radix cache only: reusable, and evictable on demand.
    pub cached_unused: u32,
    /// All blocks indexed by the radix cache (in use or not).
    pub cached: u32,
}

impl KvStats {
    /// Blocks held by running sequences.
    pub fn used(&self) -> u32 {
        self.capacity - self.free - self.cached_unused
    }
}

impl KvManager {
    pub fn new(num_blocks: u32, block_size: u32, prefix_caching: bool) -> Self {
        let alloc = BlockAllocator::new(num_blocks, block_size);
        let capacity = alloc.capacity();
        Self {
            inner: Arc::new(Mutex::new(Pool {
                alloc,
                radix: RadixCache::new(block_size),
                prefix_caching,
                tier: None,
                events: EventLog::default(),
                in_flight: Default::default(),
            })),
            block_size,
            capacity,
        }
    }

    /// Adds the shard's second tier: every block the prefix cache indexes is
    /// also saved there, and prompts look past the cache into it.
    pub fn with_tier(self, config: TierConfig) -> Self {
        self.lock().tier = Some(SecondTier::new(config, self.block_size));
        self
    }

    /// Records KV-cache events from now on (drained with `take_events`).
    pub fn with_events(self) -> Self {
        self.lock().events = EventLog::enabled();
        self
    }

    pub fn events_enabled(&self) -> bool {
        self.lock().events.is_on()
    }

    /// The events recorded since the last call, oldest first.
    pub fn take_events(&self) -> Vec<KvEvent> {
        self.lock().events.take()
    }

    /// The manager for a shard group's pool as its Warmup reply describes it,
    /// with the second tier when the shard has one.
    pub fn for_warmup(warmup: &crate::proto::pb::WarmupResponse, prefix_caching: bool) -> Self {
        let kv = Self::new(warmup.num_blocks, warmup.block_size, prefix_caching);
        let Some(t) = warmup.kv_tier.as_ref() else { return kv };
        let cfg = TierConfig::from_warmup(t);
        tracing::info!(
            "second KV tier ({}): {} of {} blocks stored, load {:.3} ms/block vs recompute {:.3} ms/block{}",
            t.kind,
            t.keys.len(),
            t.capacity_blocks,
            cfg.costs.load_s() * 1e3,
            cfg.costs.recompute_s(warmup.block_size) * 1e3,
            if prefix_caching { "" } else { " (unused: prefix caching is off)" }
        );
        kv.with_tier(cfg)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Pool> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    pub fn block_size(&self) -> u32 {
        self.block_size
    }

    pub fn prefix_caching(&self) -> bool {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner).prefix_caching
    }

    pub fn capacity(&self) -> u32 {
        self.capacity
    }

    pub fn blocks_for(&self, tokens: u32) -> u32 {
        tokens.div_ceil(self.block_size)
    }

    /// Blocks an allocation can get right now, evicting cached prefixes.
    pub fn available(&self) -> u32 {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner).available()
    }

    pub fn stats(&self) -> KvStats {
        let g = self.inner.lock().unwrap_or_else(PoisonError::into_inner);
        KvStats {
            capacity: self.capacity,
            free: g.alloc.free_blocks(),
            cached_unused: g.radix.reclaimable() as u32,
            cached: g.radix.len() as u32,
        }
    }

    /// Most blocks of `tokens` that may come from the cache: at least one
    /// token is always left for the shard to compute (it yields the logits).
    fn max_cached_blocks(&self, tokens: &[u32]) -> usize {
        (tokens.len().saturating_sub(1) / self.block_size as usize) as usize
    }

    /// Length in blocks of the cached prefix of `tokens` computed with
    /// `adapter` (None: the base model), without taking it.
    pub fn peek_prefix(&self, adapter: Option<&Adapter>, tokens: &[u32]) -> u32 {
        let mut g = self.inner.lock().unwrap_or_else(PoisonError::into_inner);
        if !g.prefix_caching {
            return 0;
        }
        let max = self.max_cached_blocks(tokens);
        g.radix.match_prefix(adapter, tokens, max, false).len() as u32
    }

    /// A block table starting with the cached prefix of `tokens` under
    /// `adapter` (retained).
    pub fn acquire_prefix(&self, adapter: Option<&Adapter>, tokens: &[u32]) -> KvBlocks {
        let mut g = self.inner.lock().unwrap_or_else(PoisonError::into_inner);
        let ids = if g.prefix_caching {
            let max = self.max_cached_blocks(tokens);
            g.radix.match_prefix(adapter, tokens, max, true)
        } else {
            Vec::new()
        };
        for &id in &ids {
            g.retain(id);
        }
        KvBlocks::new(ids, self.inner.clone(), self.block_size)
    }

    /// Announces to KV-event consumers the full blocks of `tokens` (an
    /// admitted prompt, computed with `adapter`) that `blocks` will hold
    /// past what the prefix cache holds, before the shard computes them;
    /// withdrawn when `blocks` is dropped (announce.rs). Nothing where
    /// events or prefix caching are off.
    pub fn announce(&self, blocks: &mut KvBlocks, adapter: Option<&Adapter>, tokens: &[u32]) {
        let mut g = self.lock();
        if !g.events.is_on() || !g.prefix_caching || blocks.announced.is_some() {
            return;
        }
        blocks.announced = g.announce(adapter, tokens, self.block_size);
    }

    /// Distinct blocks of the pool that KV-event consumers are told are held:
    /// the prefix cache's and those announced in flight (checks and tests).
    pub fn published_blocks(&self) -> usize {
        let g = self.lock();
        let cached = g.radix.hashes();
        cached.len() + g.in_flight.hashes().filter(|h| !cached.contains(h)).count()
    }

    /// `n` fresh blocks, evicting cached prefixes if needed; all-or-nothing.
    pub fn allocate(&self, n: u32) -> Option<KvBlocks> {
        let ids = self.inner.lock().unwrap_or_else(PoisonError::into_inner).allocate(n)?;
        Some(KvBlocks::new(ids, self.inner.clone(), self.block_size))
    }

    /// Indexes the full blocks of `tokens` (whose KV the shard has computed)
    /// so later requests can reuse them. A table that gave blocks back behind
    /// a sliding window has no complete prefix left to index: nothing is.
    /// `adapter`: what computed them (None: the base model).
    pub fn commit(&self, adapter: Option<&Adapter>, blocks: &KvBlocks, tokens: &[u32]) {
        let mut guard = self.lock();
        let g = &mut *guard;
        if !g.prefix_caching || blocks.dropped > 0 {
            return;
        }
        let bs = self.block_size as usize;
        let n = (tokens.len() / bs).min(blocks.ids.len());
        let added = g.radix.insert(adapter, &tokens[..n * bs], &blocks.ids[..n]);
        let Some(first) = blocks.ids[..n].iter().position(|b| added.first() == Some(b)) else { return };
        for &id in &added {
            // The tree's own reference keeps the block after its sequences end.
            g.alloc.retain(id);
        }
        // The added blocks are consecutive in the table: one chain.
        let named: Vec<(u64, Option<u64>)> = added.iter().map(|&b| g.radix.hash_of(b).expect("just indexed")).collect();
        let stored = first..first + added.len();
        if g.events.is_on() {
            // Blocks announced at admission (announce.rs) were stored then.
            let fresh: Vec<bool> = named.iter().map(|h| !g.in_flight.contains(h.0)).collect();
            for run in runs(&fresh) {
                let at = stored.start + run.start..stored.start + run.end;
                g.events.push(KvEvent::Stored {
                    hashes: named[run.clone()].iter().map(|h| h.0).collect(),
                    parent: named[run.start].1,
                    tokens: tokens[at.start * bs..at.end * bs].to_vec(),
                    block_size: self.block_size,
                    medium: Medium::Device,
                    lora: LoraTag::of(adapter),
                });
            }
        }
        if let Some(tier) = g.tier.as_mut() {
            // Write-through: what the tree indexes is saved once, so an
            // eviction drops nothing the tier lacks and a restart finds it.
            tier.commit(adapter, &tokens[..n * bs], &blocks.ids[..n], stored, &named, &mut g.events);
        }
    }

    /// Keys of the full blocks of `tokens` from block `from` on that the
    /// second tier holds (consecutive, at most the cacheable blocks), when
    /// loading them is cheaper than computing them; empty otherwise.
    pub fn tier_hits(&self, adapter: Option<&Adapter>, tokens: &[u32], from: usize) -> Vec<Key> {
        let max = self.max_cached_blocks(tokens);
        let mut g = self.lock();
        let caching = g.prefix_caching;
        match g.tier.as_mut() {
            Some(t) if caching && from < max => t.hits(adapter, tokens, from, max),
            _ => Vec::new(),
        }
    }

    /// Saves and deletes to send with the next step (drained).
    pub fn take_tier_ops(&self) -> TierOps {
        self.lock().tier.as_mut().map(SecondTier::take_ops).unwrap_or_default()
    }

    pub fn has_tier_ops(&self) -> bool {
        self.lock().tier.as_ref().is_some_and(SecondTier::has_ops)
    }

    /// The shard no longer holds these keys (failed load, lost file).
    pub fn tier_forget<'a>(&self, keys: impl IntoIterator<Item = &'a String>) {
        let mut guard = self.lock();
        let g = &mut *guard;
        if let Some(t) = g.tier.as_mut() {
            t.forget(keys, &mut g.events);
        }
    }

    pub fn tier_costs(&self) -> Option<TierCosts> {
        self.lock().tier.as_ref().map(SecondTier::costs)
    }

    pub fn tier_stats(&self) -> Option<TierStats> {
        self.lock().tier.as_ref().map(SecondTier::stats)
    }

    /// Radix cache's token prefix ending at `block` (tests and checks).
    pub fn cached_prefix_of(&self, block: u32) -> Option<Vec<u32>> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner).radix.prefix_of(block)
    }

    pub fn refs(&self, block: u32) -> u32 {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner).alloc.refs(block)
    }
}

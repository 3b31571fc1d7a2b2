//! The KV pool's shared state behind the manager's one lock: the
//! refcounted block allocator, the radix prefix cache and the second tier's
//! plan, and the KV-cache events their changes make. Block tables
//! (blocks.rs) and the manager (manager.rs) both take and give back blocks
//! through it.

use super::announce::InFlight;
use super::block_allocator::BlockAllocator;
use super::events::{EventLog, Medium};
use super::radix::RadixCache;
use super::tier_ops::SecondTier;

/// The allocator, the prefix cache and the second tier, changed together.
#[derive(Debug)]
pub(super) struct Pool {
    pub(super) alloc: BlockAllocator,
    pub(super) radix: RadixCache,
    pub(super) prefix_caching: bool,
    pub(super) tier: Option<SecondTier>,
    pub(super) events: EventLog,
    /// Blocks admitted prompts will compute, announced ahead (announce.rs).
    pub(super) in_flight: InFlight,
}

impl Pool {
    pub(super) fn retain(&mut self, id: u32) {
        if self.alloc.retain(id) == 2 && self.radix.contains(id) {
            self.radix.set_unused(id, false);
        }
    }

    pub(super) fn release(&mut self, id: u32) {
        if self.alloc.release(id) == 1 && self.radix.contains(id) {
            self.radix.set_unused(id, true);
        }
    }

    pub(super) fn available(&self) -> u32 {
        self.alloc.free_blocks() + self.radix.reclaimable() as u32
    }

    pub(super) fn allocate(&mut self, n: u32) -> Option<Vec<u32>> {
        if self.available() < n {
            return None;
        }
        // Evict least recently used cached prefixes only as far as needed.
        while self.alloc.free_blocks() < n {
            let gone = self.radix.evict_one().expect("reclaimable blocks are evictable");
            if !self.in_flight.contains(gone.hash) {
                // Still announced by a prompt computing it: removed when that ends.
                self.events.removed(gone.hash, Medium::Device);
            }
            let block = gone.block;
            if let Some(t) = self.tier.as_mut() {
                // Copied out by the shard before this step's forward reuses it.
                t.evicted(&gone, &mut self.events);
            }
            let left = self.alloc.release(block);
            debug_assert_eq!(left, 0, "an evicted block had holders");
        }
        self.alloc.allocate(n)
    }
}

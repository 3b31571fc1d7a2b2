//! Free-list allocator over the shard's KV pool, with blocks returned on Drop.

use std::sync::{Arc, Mutex};

/// Block 0 is the shard's padding/scratch slot and is never handed out.
pub const RESERVED_BLOCKS: u32 = 1;

#[derive(Debug)]
struct Pool {
    free: Vec<u32>,
    // Guards against double frees in debug and property tests.
    in_use: Vec<bool>,
}

/// Cheap to clone: every clone is a handle on the same pool.
#[derive(Debug, Clone)]
pub struct BlockAllocator {
    pool: Arc<Mutex<Pool>>,
    num_blocks: u32,
    block_size: u32,
}

impl BlockAllocator {
    pub fn new(num_blocks: u32, block_size: u32) -> Self {
        assert!(block_size > 0, "block_size must be positive");
        // Pop from the end: hand out low ids first, which keeps traces readable.
        let free: Vec<u32> = (RESERVED_BLOCKS..num_blocks).rev().collect();
        let pool = Pool {
            free,
            in_use: vec![false; num_blocks as usize],
        };
        Self {
            pool: Arc::new(Mutex::new(pool)),
            num_blocks,
            block_size,
        }
    }

    pub fn block_size(&self) -> u32 {
        self.block_size
    }

    /// Blocks that can ever be handed out (the pool minus the reserved ones).
    pub fn capacity(&self) -> u32 {
        self.num_blocks.saturating_sub(RESERVED_BLOCKS)
    }

    pub fn free_blocks(&self) -> u32 {
        self.pool.lock().unwrap().free.len() as u32
    }

    pub fn used_blocks(&self) -> u32 {
        self.capacity() - self.free_blocks()
    }

    /// Number of blocks needed to hold `tokens` tokens.
    pub fn blocks_for(&self, tokens: u32) -> u32 {
        tokens.div_ceil(self.block_size)
    }

    /// All-or-nothing: `n` blocks, or `None` without touching the pool.
    pub fn allocate(&self, n: u32) -> Option<KvBlocks> {
        let ids = self.take(n)?;
        Some(KvBlocks {
            ids,
            allocator: self.clone(),
        })
    }

    fn take(&self, n: u32) -> Option<Vec<u32>> {
        let mut pool = self.pool.lock().unwrap();
        if (pool.free.len() as u32) < n {
            return None;
        }
        let at = pool.free.len() - n as usize;
        let ids = pool.free.split_off(at);
        for &id in &ids {
            debug_assert!(!pool.in_use[id as usize]);
            pool.in_use[id as usize] = true;
        }
        Some(ids)
    }

    fn give_back(&self, ids: &[u32]) {
        let mut pool = self.pool.lock().unwrap();
        for &id in ids.iter().rev() {
            assert!(
                pool.in_use[id as usize],
                "block {id} freed twice or never allocated"
            );
            pool.in_use[id as usize] = false;
            pool.free.push(id);
        }
    }
}

/// The blocks of one sequence, in block-table order. Dropping it frees them,
/// so every path that ends a sequence (finish, stop, disconnect, shard error)
/// returns its memory.
#[derive(Debug)]
pub struct KvBlocks {
    ids: Vec<u32>,
    allocator: BlockAllocator,
}

impl KvBlocks {
    pub fn ids(&self) -> &[u32] {
        &self.ids
    }

    pub fn len(&self) -> u32 {
        self.ids.len() as u32
    }

    pub fn is_empty(&self) -> bool {
        self.ids.is_empty()
    }

    /// Token capacity of the blocks held.
    pub fn capacity_tokens(&self) -> u32 {
        self.len() * self.allocator.block_size
    }

    /// Grows the table so that it can hold `tokens` tokens. Returns false,
    /// leaving the table unchanged, when the pool cannot supply the blocks.
    pub fn ensure_capacity(&mut self, tokens: u32) -> bool {
        let needed = self.allocator.blocks_for(tokens);
        if needed <= self.len() {
            return true;
        }
        match self.allocator.take(needed - self.len()) {
            Some(mut more) => {
                // take() returns ids in pool order; table order is ours to pick.
                more.reverse();
                self.ids.extend(more);
                true
            }
            None => false,
        }
    }

    /// Flat slot index of token position `pos` (block * block_size + offset).
    pub fn slot(&self, pos: u32) -> u64 {
        let bs = self.allocator.block_size;
        let block = self.ids[(pos / bs) as usize] as u64;
        block * bs as u64 + (pos % bs) as u64
    }

    /// Slots of positions `start..end`.
    pub fn slots(&self, start: u32, end: u32) -> Vec<u64> {
        (start..end).map(|p| self.slot(p)).collect()
    }
}

impl Drop for KvBlocks {
    fn drop(&mut self) {
        self.allocator.give_back(&self.ids);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::HashSet;

    #[test]
    fn block_zero_is_never_handed_out() {
        let a = BlockAllocator::new(4, 16);
        let blocks = a.allocate(3).unwrap();
        assert!(!blocks.ids().contains(&0));
        assert!(a.allocate(1).is_none());
    }

    #[test]
    fn allocate_is_all_or_nothing() {
        let a = BlockAllocator::new(5, 16);
        let _held = a.allocate(3).unwrap();
        assert!(a.allocate(2).is_none());
        assert_eq!(a.free_blocks(), 1);
    }

    #[test]
    fn incremental_growth_crosses_block_boundaries() {
        let a = BlockAllocator::new(10, 4);
        let mut b = a.allocate(a.blocks_for(5)).unwrap();
        assert_eq!(b.len(), 2);
        assert!(b.ensure_capacity(8));
        assert_eq!(b.len(), 2);
        assert!(b.ensure_capacity(9));
        assert_eq!(b.len(), 3);
        assert_eq!(b.slot(8), b.ids()[2] as u64 * 4);
        assert_eq!(b.slot(5), b.ids()[1] as u64 * 4 + 1);
    }

    #[test]
    fn failed_growth_leaves_table_unchanged() {
        let a = BlockAllocator::new(3, 4);
        let mut b = a.allocate(2).unwrap();
        let before = b.ids().to_vec();
        assert!(!b.ensure_capacity(12));
        assert_eq!(b.ids(), &before[..]);
        assert_eq!(a.free_blocks(), 0);
    }

    #[test]
    fn drop_frees_everything() {
        let a = BlockAllocator::new(8, 16);
        {
            let mut b = a.allocate(2).unwrap();
            b.ensure_capacity(16 * 5);
            assert_eq!(a.used_blocks(), 5);
        }
        assert_eq!(a.used_blocks(), 0);
        assert_eq!(a.free_blocks(), 7);
    }

    #[derive(Debug, Clone)]
    enum Op {
        Alloc(u32),
        Grow(usize, u32),
        Free(usize),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (0u32..6).prop_map(Op::Alloc),
            (any::<usize>(), 1u32..80).prop_map(|(i, t)| Op::Grow(i, t)),
            any::<usize>().prop_map(Op::Free),
        ]
    }

    proptest! {
        // Random alloc/grow/free sequences: no block is ever held twice, the
        // free count always matches what is held, and dropping all leaks nothing.
        #[test]
        fn no_double_allocation_and_no_leak(ops in prop::collection::vec(op(), 1..200),
                                             num_blocks in 2u32..64, block_size in 1u32..17) {
            let a = BlockAllocator::new(num_blocks, block_size);
            let mut held: Vec<KvBlocks> = Vec::new();
            for op in ops {
                match op {
                    Op::Alloc(n) => {
                        let free = a.free_blocks();
                        match a.allocate(n) {
                            Some(b) => { prop_assert!(n <= free); held.push(b); }
                            None => { prop_assert!(n > free); prop_assert_eq!(a.free_blocks(), free); }
                        }
                    }
                    Op::Grow(i, tokens) if !held.is_empty() => {
                        let i = i % held.len();
                        let before = held[i].len();
                        let free = a.free_blocks();
                        let need = a.blocks_for(tokens).saturating_sub(before);
                        let ok = held[i].ensure_capacity(tokens);
                        prop_assert_eq!(ok, need <= free);
                        if ok { prop_assert!(held[i].capacity_tokens() >= tokens); }
                        else { prop_assert_eq!(held[i].len(), before); }
                    }
                    Op::Free(i) if !held.is_empty() => {
                        let i = i % held.len();
                        held.swap_remove(i);
                    }
                    _ => {}
                }
                let mut seen = HashSet::new();
                for b in &held {
                    for &id in b.ids() {
                        prop_assert!(id >= RESERVED_BLOCKS && id < num_blocks);
                        prop_assert!(seen.insert(id), "block {} held twice", id);
                    }
                }
                prop_assert_eq!(seen.len() as u32 + a.free_blocks(), a.capacity());
            }
            held.clear();
            prop_assert_eq!(a.free_blocks(), a.capacity());
        }
    }
}

//! Reference-counted free list over the shard's KV pool. A block is free when
//! nobody holds it; sequences sharing a prefix and the radix cache each hold
//! one reference.

/// Block 0 is the shard's padding/scratch slot and is never handed out.
pub const RESERVED_BLOCKS: u32 = 1;

#[derive(Debug, Clone)]
pub struct BlockAllocator {
    free: Vec<u32>,
    refs: Vec<u32>,
    block_size: u32,
}

impl BlockAllocator {
    pub fn new(num_blocks: u32, block_size: u32) -> Self {
        assert!(block_size > 0, "block_size must be positive");
        // Pop from the end: low ids first, which keeps traces readable.
        let free = (RESERVED_BLOCKS..num_blocks.max(RESERVED_BLOCKS)).rev().collect();
        Self { free, refs: vec![0; num_blocks as usize], block_size }
    }

    pub fn block_size(&self) -> u32 {
        self.block_size
    }

    /// Blocks that can ever be handed out.
    pub fn capacity(&self) -> u32 {
        (self.refs.len() as u32).saturating_sub(RESERVED_BLOCKS)
    }

    pub fn free_blocks(&self) -> u32 {
        self.free.len() as u32
    }

    pub fn refs(&self, id: u32) -> u32 {
        self.refs[id as usize]
    }

    /// All-or-nothing: `n` blocks with one reference each, or `None`.
    pub fn allocate(&mut self, n: u32) -> Option<Vec<u32>> {
        if self.free_blocks() < n {
            return None;
        }
        let ids = self.free.split_off(self.free.len() - n as usize);
        for &id in &ids {
            debug_assert_eq!(self.refs[id as usize], 0);
            self.refs[id as usize] = 1;
        }
        Some(ids)
    }

    /// One more holder of an allocated block; returns the new count.
    pub fn retain(&mut self, id: u32) -> u32 {
        let r = &mut self.refs[id as usize];
        assert!(*r > 0, "retain of free block {id}");
        *r += 1;
        *r
    }

    /// One holder fewer; the block is free again at zero. Returns the new count.
    pub fn release(&mut self, id: u32) -> u32 {
        let r = &mut self.refs[id as usize];
        assert!(*r > 0, "block {id} released more often than held");
        *r -= 1;
        if *r == 0 {
            self.free.push(id);
        }
        *r
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn block_zero_is_never_handed_out() {
        let mut a = BlockAllocator::new(4, 16);
        let ids = a.allocate(3).unwrap();
        assert!(!ids.contains(&0));
        assert!(a.allocate(1).is_none());
    }

    #[test]
    fn allocate_is_all_or_nothing() {
        let mut a = BlockAllocator::new(5, 16);
        let _held = a.allocate(3).unwrap();
        assert!(a.allocate(2).is_none());
        assert_eq!(a.free_blocks(), 1);
    }

    #[test]
    fn shared_block_is_free_only_after_last_release() {
        let mut a = BlockAllocator::new(3, 16);
        let id = a.allocate(1).unwrap()[0];
        assert_eq!(a.retain(id), 2);
        assert_eq!(a.release(id), 1);
        assert_eq!(a.free_blocks(), 1);
        assert_eq!(a.release(id), 0);
        assert_eq!(a.free_blocks(), 2);
    }

    #[test]
    #[should_panic(expected = "released more often")]
    fn double_free_is_caught() {
        let mut a = BlockAllocator::new(3, 16);
        let id = a.allocate(1).unwrap()[0];
        a.release(id);
        a.release(id);
    }
}

//! `KvBlocks`: one sequence's block table, holding a reference on each of
//! its blocks in the KV pool until it is dropped.

use std::sync::{Arc, Mutex, PoisonError};

use super::announce::Announced;
use super::pool::Pool;

/// One sequence's block table, in order. Dropping it releases every block,
/// so any path that ends a sequence (finish, stop, disconnect, preemption,
/// shard error) returns its memory.
#[derive(Debug)]
pub struct KvBlocks {
    pub(super) ids: Vec<u32>,
    pool: Arc<Mutex<Pool>>,
    block_size: u32,
    /// Leading blocks given back behind a sliding window (release_behind): their
    /// ids stay in `ids`, as in the shard's copy of the table, but are no longer held.
    pub(super) dropped: u32,
    /// The blocks this table's prompt announced to KV-event consumers before
    /// computing them (announce.rs); withdrawn on Drop.
    pub(super) announced: Option<Announced>,
}

impl KvBlocks {
    pub(super) fn new(ids: Vec<u32>, pool: Arc<Mutex<Pool>>, block_size: u32) -> Self {
        KvBlocks { ids, pool, block_size, dropped: 0, announced: None }
    }

    pub fn ids(&self) -> &[u32] {
        &self.ids
    }

    pub fn len(&self) -> u32 {
        self.ids.len() as u32
    }

    pub fn is_empty(&self) -> bool {
        self.ids.is_empty()
    }

    pub fn capacity_tokens(&self) -> u32 {
        self.len() * self.block_size
    }

    /// Gives back the blocks before block `n` (those no query will read again,
    /// every layer's window having passed them); returns how many were released
    /// now. Their KV may still be in the prefix cache, which holds its own
    /// reference: a cached prefix stays complete.
    pub fn release_behind(&mut self, n: u32) -> u32 {
        let n = n.min(self.len());
        if n <= self.dropped {
            return 0;
        }
        let mut g = self.pool.lock().unwrap_or_else(PoisonError::into_inner);
        for &id in &self.ids[self.dropped as usize..n as usize] {
            g.release(id);
        }
        let released = n - self.dropped;
        self.dropped = n;
        released
    }

    /// A table sharing this one's first `n` blocks (forks of `n`/`best_of`);
    /// none where blocks were given back (forks are admitted before any are).
    pub fn share_prefix(&self, n: u32) -> KvBlocks {
        let n = if self.dropped > 0 { 0 } else { n };
        let ids: Vec<u32> = self.ids[..n as usize].to_vec();
        let mut g = self.pool.lock().unwrap_or_else(PoisonError::into_inner);
        for &id in &ids {
            g.retain(id);
        }
        KvBlocks::new(ids, self.pool.clone(), self.block_size)
    }

    /// Grows the table to hold `tokens` tokens. False, with the table
    /// unchanged, when the pool cannot supply the blocks.
    pub fn ensure_capacity(&mut self, tokens: u32) -> bool {
        let needed = tokens.div_ceil(self.block_size);
        if needed <= self.len() {
            return true;
        }
        match self.pool.lock().unwrap_or_else(PoisonError::into_inner).allocate(needed - self.len()) {
            Some(more) => {
                self.ids.extend(more);
                true
            }
            None => false,
        }
    }

    /// Flat slot of token position `pos` (block * block_size + offset).
    pub fn slot(&self, pos: u32) -> u64 {
        let bs = self.block_size;
        self.ids[(pos / bs) as usize] as u64 * bs as u64 + (pos % bs) as u64
    }

    pub fn slots(&self, start: u32, end: u32) -> Vec<u64> {
        (start..end).map(|p| self.slot(p)).collect()
    }
}

impl Drop for KvBlocks {
    fn drop(&mut self) {
        let mut g = self.pool.lock().unwrap_or_else(PoisonError::into_inner);
        for &id in &self.ids[self.dropped as usize..] {
            g.release(id);
        }
        if let Some(a) = self.announced.take() {
            g.withdraw(a, self.block_size);
        }
    }
}

//! Paged KV-cache accounting. The router owns every block id; shards only
//! write where they are told.

pub mod block_allocator;
pub mod manager;
pub mod radix;
#[cfg(test)]
mod tests;

pub use block_allocator::BlockAllocator;
pub use manager::{KvBlocks, KvManager, KvStats};
pub use radix::RadixCache;

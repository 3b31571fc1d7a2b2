//! Paged KV-cache accounting. The router owns every block id; shards only
//! write where they are told.

pub mod block_allocator;
pub mod blocks;
pub mod lifetime;
pub mod manager;
pub mod radix;
pub mod second_tier;
#[cfg(test)]
mod tests;
#[cfg(test)]
mod tests_tier;
pub mod tier;

pub use block_allocator::BlockAllocator;
pub use blocks::KvBlocks;
pub use lifetime::{lifetime_blocks, too_large};
pub use manager::{KvManager, KvStats};
pub use radix::RadixCache;
pub use second_tier::{TierConfig, TierOps, TierStats};

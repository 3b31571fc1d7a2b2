//! Paged KV-cache accounting. The router owns every block id; shards only
//! write where they are told.

mod announce;
pub mod block_allocator;
pub mod block_hash;
pub mod blocks;
pub mod events;
pub mod lifetime;
pub mod manager;
mod pool;
pub mod radix;
#[cfg(test)]
mod tests;
#[cfg(test)]
mod tests_events;
#[cfg(test)]
mod tests_lora;
#[cfg(test)]
mod tests_tier;
pub mod tier_index;
pub mod tier_ops;

pub use block_allocator::BlockAllocator;
pub use blocks::KvBlocks;
pub use events::{KvEvent, LoraTag, Medium};
pub use lifetime::{lifetime_blocks, too_large};
pub use manager::{KvManager, KvStats};
pub use radix::RadixCache;
pub use tier_index::{chain_keys, Key};
pub use tier_ops::{TierConfig, TierCosts, TierOps, TierStats};

//! Paged KV-cache accounting. The router owns every block id; shards only
//! write where they are told.

pub mod block_allocator;

pub use block_allocator::{BlockAllocator, KvBlocks};

//! gRPC client to the shards over unix sockets.

mod shard;
mod sharded;

pub use shard::ShardClient;
pub use sharded::ShardedClient;
